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

// f(slot, chunk) for every chunk, in parallel. f must only write its own slot's results and its
// chunk's elements. Lists of less than about two chunks' worth run on the calling thread.
template <typename F>
void for_each_chunk(const ChunkPlan& plan, const F& f) {
  const int64_t slots = static_cast<int64_t>(plan.chunks.size());
  if (slots == 0) return;
  int64_t elements = 0;
  if (slots <= 2) {
    for (const Chunk& c : plan.chunks) elements += c.n;
  }
  if (slots == 1 || (slots <= 2 && elements < kChunkSize)) {
    for (int64_t s = 0; s < slots; ++s) f(s, plan.chunks[s]);
    return;
  }
  at::parallel_for(0, slots, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) f(s, plan.chunks[s]);
  });
}

// f(i) for every i in [0, items), in parallel, each thread taking the next item from a shared
// counter (a dynamic schedule) instead of a fixed share of the range: a thread that starts late
// (the intra-op pool's workers sleep between regions; waking one took milliseconds on a VM) or
// is descheduled leaves its items to the others instead of making them wait at the end. Which
// thread runs an item never changes its result (f writes only item i's results), so results
// are the same as for_each_chunk's. Any call of the parallel_for body drains the counter, so
// this is correct for every at::parallel_for backend and when nested (one call, on one thread).
template <typename F>
void for_each_item_shared(int64_t items, const F& f) {
  if (items <= 0) return;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, items, 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < items;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      f(i);
    }
  });
}

// for_each_chunk with the chunks handed out by for_each_item_shared (same results).
template <typename F>
void for_each_chunk_shared(const ChunkPlan& plan, const F& f) {
  const int64_t slots = static_cast<int64_t>(plan.chunks.size());
  if (slots == 0) return;
  int64_t elements = 0;
  if (slots <= 2) {
    for (const Chunk& c : plan.chunks) elements += c.n;
  }
  if (slots == 1 || (slots <= 2 && elements < kChunkSize)) {
    for (int64_t s = 0; s < slots; ++s) f(s, plan.chunks[s]);
    return;
  }
  for_each_item_shared(slots, [&](int64_t s) { f(s, plan.chunks[s]); });
}

}  // namespace cpu
}  // namespace tpamp
