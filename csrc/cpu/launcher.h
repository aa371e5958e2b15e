// The CPU launcher: the twin of csrc/cuda/multi_tensor_apply.cuh.
//
// A list of tensors is cut into chunks of kChunkSize elements (csrc/kernels/common.h), tensors
// in the caller's order, each chunk a "slot" with its own partial result. at::parallel_for runs
// the chunks on the intra-op thread pool; partials are then combined in slot order on one
// thread, so every result is bit-identical whatever the number of threads (and the same on every
// rank and every resume). Empty tensors have no chunks.

#pragma once

#include "../kernels/common.h"

#include <ATen/Parallel.h>

#include <atomic>
#include <cstdint>
#include <vector>

namespace tpamp {
namespace cpu {

struct Chunk {
  int64_t entry;   // index into the caller's entries
  int64_t offset;  // first element of the chunk in the tensor
  int64_t n;       // elements, 1 .. kChunkSize
};

struct ChunkPlan {
  std::vector<Chunk> chunks;        // slot order
  std::vector<int64_t> first_slot;  // per entry, its first slot; first_slot[entries] = slots
};

// The chunks of entries with these element counts, in order.
inline ChunkPlan plan_chunks(const std::vector<int64_t>& numels) {
  ChunkPlan p;
  p.first_slot.reserve(numels.size() + 1);
  int64_t total = 0;
  for (int64_t n : numels) total += num_chunks(n);
  p.chunks.reserve(total);
  for (size_t e = 0; e < numels.size(); ++e) {
    p.first_slot.push_back(static_cast<int64_t>(p.chunks.size()));
    for (int64_t off = 0; off < numels[e]; off += kChunkSize) {
      const int64_t left = numels[e] - off;
      p.chunks.push_back({static_cast<int64_t>(e), off, left < kChunkSize ? left : kChunkSize});
    }
  }
  p.first_slot.push_back(static_cast<int64_t>(p.chunks.size()));
  return p;
}

// Whether a plan runs on the calling thread: no chunk, one chunk, or any number of chunks of
// less than one chunk's worth together (e.g. 200 small tensors: waking the intra-op threads
// for them costs more than their elements; each slot's results are the same either way).
inline bool runs_serially(const ChunkPlan& plan) {
  if (plan.chunks.size() <= 1) return true;
  int64_t total = 0;
  for (const Chunk& c : plan.chunks) {
    total += c.n;
    if (total >= kChunkSize) return false;
  }
  return true;
}

// f(slot, chunk) for every chunk, in parallel. f must only write its own slot's results and its
// chunk's elements. Lists of less than one chunk's worth run on the calling thread
// (runs_serially).
template <typename F>
void for_each_chunk(const ChunkPlan& plan, const F& f) {
  const int64_t slots = static_cast<int64_t>(plan.chunks.size());
  if (runs_serially(plan)) {
    for (int64_t s = 0; s < slots; ++s) f(s, plan.chunks[s]);
    return;
  }
  at::parallel_for(0, slots, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) f(s, plan.chunks[s]);
  });
}

// The number of parts for_each_part_balanced cuts `items` into: one per intra-op thread (at
// most one per item; 1 inside a parallel region, where at::parallel_for runs serially).
inline int64_t balanced_parts(int64_t items) {
  if (items <= 0) return 0;
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  return threads < items ? (threads < 1 ? 1 : threads) : items;
}

// f(part, k) for every part in [0, parts) and k in [0, count(part)), in parallel: thread t runs
// the items of part t in order from the front (as at::parallel_for's static split would: one
// long run of memory per thread), and when its part is done, takes the other parts' last items
// from their back, one at a time, so the owner's run stays one stream. A thread that starts
// late (the intra-op pool's workers sleep between regions) or is descheduled then leaves the
// end of its part to the others instead of making them wait. Each part's [front, back) is one
// atomic word, so every item runs exactly once. Which thread runs an item never changes its
// result (f writes only that item's results), so results do not depend on it. Correct for every
// at::parallel_for backend and when nested (any call of the body drains every part).
template <typename Count, typename F>
void for_each_part_balanced(int64_t parts, const Count& count, const F& f) {
  if (parts <= 0) return;
  struct alignas(64) Range {
    std::atomic<uint64_t> word{0};  // back << 32 | front
  };
  std::vector<Range> ranges(static_cast<size_t>(parts));
  for (int64_t part = 0; part < parts; ++part) {
    const int64_t n = count(part);
    TORCH_CHECK(n >= 0 && n < (int64_t{1} << 32), "tpamp: a part of ", n, " items");
    ranges[static_cast<size_t>(part)].word.store(static_cast<uint64_t>(n) << 32,
                                                 std::memory_order_relaxed);
  }
  // the next item of `part`: its front (owner) or its back (others); -1 when none is left
  auto take = [&](int64_t part, bool owner) -> int64_t {
    std::atomic<uint64_t>& word = ranges[static_cast<size_t>(part)].word;
    uint64_t w = word.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t front = w & 0xffffffffull, back = w >> 32;
      if (front >= back) return -1;
      const uint64_t next = owner ? w + 1 : ((back - 1) << 32) | front;
      if (word.compare_exchange_weak(w, next, std::memory_order_relaxed)) {
        return static_cast<int64_t>(owner ? front : back - 1);
      }
    }
  };
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t j = 0; j < parts; ++j) {
        const int64_t part = (t + j) % parts;
        for (int64_t k = take(part, j == 0); k >= 0; k = take(part, j == 0)) f(part, k);
      }
    }
  });
}

// The first slot of part `part` of `slots` cut into `parts` near-equal runs.
inline int64_t part_begin(int64_t slots, int64_t parts, int64_t part) {
  return slots * part / parts;
}

// for_each_chunk with the chunks cut into one run per thread and balanced at the end
// (for_each_part_balanced): the same results.
template <typename F>
void for_each_chunk_balanced(const ChunkPlan& plan, const F& f) {
  const int64_t slots = static_cast<int64_t>(plan.chunks.size());
  if (runs_serially(plan)) {
    for (int64_t s = 0; s < slots; ++s) f(s, plan.chunks[s]);
    return;
  }
  const int64_t parts = balanced_parts(slots);
  for_each_part_balanced(
      parts,
      [&](int64_t part) {
        return part_begin(slots, parts, part + 1) - part_begin(slots, parts, part);
      },
      [&](int64_t part, int64_t k) {
        const int64_t s = part_begin(slots, parts, part) + k;
        f(s, plan.chunks[s]);
      });
}

}  // namespace cpu
}  // namespace tpamp
