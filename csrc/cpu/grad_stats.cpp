// CPU launcher of tpamp::grad_stats_ and tpamp::grad_stats_out (math: csrc/kernels/grad_stats.h;
// CUDA twin: csrc/cuda/grad_stats.cu).
//
// One pass: each chunk (csrc/cpu/launcher.h) reads its gradients once, multiplies, stores (in
// place or into the float32 out) and accumulates its ChunkStats; the chunks are then combined in
// slot order on one thread (fp64), so results do not depend on the thread count.

#include "../host/validate.h"
#include "../kernels/grad_stats.h"
#include "../ops.h"
#include "launcher.h"
#include "vec_lanes.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace tpamp {
namespace cpu {
namespace {

// stats_add (csrc/kernels/grad_stats.h) on a vector, with the zero count as one compare into a
// mask and one masked add on AVX-512 (at::vec's eq returns 1.0f / 0.0f lanes: compare, mask to
// vector, and, add). The same counts: r == 0 (ordered compare: -0.0 counts, NaN does not).
template <bool kZeros>
TPAMP_INLINE void stats_add_vec(StatsLanes<FVec>& a, const FVec& r) {
#if defined(CPU_CAPABILITY_AVX512)
  using L = Lanes<FVec>;
  a.sq = L::fmadd(r, r, a.sq);
  a.amax = L::max_plain(a.amax, L::abs(r));
  if (kZeros) {
    const __mmask16 z = _mm512_cmp_ps_mask(r, _mm512_setzero_ps(), _CMP_EQ_OQ);
    a.zeros = FVec(_mm512_mask_add_ps(a.zeros, z, a.zeros, _mm512_set1_ps(1.0f)));
  }
#else
  stats_add<kZeros>(a, r);
#endif
}

// Software prefetch of 16-bit grads in the read-only pass (the one-pass step's statistics:
// nothing stored), kPrefetchBytes ahead of the loads (AVX-512 module). One sequential read
// stream per thread did not keep enough reads in flight: 100M fp16 grads, 1 thread: 7.0-7.3 ->
// 5.1-5.9 ms of thread CPU time with prefetcht0 8-32 KB ahead (no gain at 1-2 KB). Not used
// where it measured slower: float32 grads, and the fp16 -> fp32 copy with a multiply (+12%).
// A prefetch only touches the cache (it never faults), so reading past the chunk is harmless;
// the values and the order of every operation are unchanged (docs/benchmarks.md).
constexpr int64_t kPrefetchBytes = 16384;

// Statistics of one chunk: in[0 .. n) -> out[0 .. n).
//   kMul: multiply by s;  kStore: write out (false: in place without a multiply, nothing to write)
//   kZeros: count zeros.  Statistics are taken on the values as stored.
template <typename in_t, typename out_t, bool kMul, bool kStore, bool kZeros>
TPAMP_INLINE void grad_stats_block(const in_t* in, out_t* out, int64_t b0, int64_t end, float s,
                                   ChunkStats& c) {
  constexpr bool kRound = kMul && !std::is_same_v<out_t, float>;
  const FVec sv(s);
  {
    // Four independent accumulators, so that the fma, max and add chains do not
    // wait on each other: with one accumulator the loop was latency-bound (one fp32 fma chain
    // per lane, ~10 G elements/s on one Zen 5 core, below the memory bandwidth). Element
    // i + k * FVec::size() of each 4 * FVec::size() group goes to acc[k]; the tail of the
    // block that does not fill a group goes to acc[0], acc[1] by whole vector steps. Combined
    // as (acc[0] + acc[1]) + (acc[2] + acc[3]) per lane, then over the lanes in order
    // (Lanes::sum): a fixed order, so the result is deterministic and does not depend on the
    // thread count (it does on the vector width, as before: the default, AVX2 and AVX-512
    // modules and the CUDA twin agree to rounding, not bit for bit).
    StatsLanes<FVec> acc[4] = {stats_init<FVec>(), stats_init<FVec>(), stats_init<FVec>(),
                               stats_init<FVec>()};
    int64_t i = b0;
    for (; kUseVec && i + 2 * kVecStep <= end; i += 2 * kVecStep) {
#if defined(CPU_CAPABILITY_AVX512)
      if constexpr (sizeof(in_t) == 2 && !kStore) {
        constexpr int64_t kLines = 2 * kVecStep * static_cast<int64_t>(sizeof(in_t)) / 64;
        const char* p = reinterpret_cast<const char*>(in + i) + kPrefetchBytes;
        for (int64_t k = 0; k < kLines; ++k) _mm_prefetch(p + 64 * k, _MM_HINT_T0);
      }
#endif
      FVec a, b, c, d;
      VecIO<in_t>::load(in + i, a, b);
      VecIO<in_t>::load(in + i + kVecStep, c, d);
      if (kMul) {
        a = scale_value(a, sv);
        b = scale_value(b, sv);
        c = scale_value(c, sv);
        d = scale_value(d, sv);
      }
      VecIO<out_t>::template store<kStore, kRound>(out + i, a, b);
      VecIO<out_t>::template store<kStore, kRound>(out + i + kVecStep, c, d);
      stats_add_vec<kZeros>(acc[0], a);
      stats_add_vec<kZeros>(acc[1], b);
      stats_add_vec<kZeros>(acc[2], c);
      stats_add_vec<kZeros>(acc[3], d);
    }
    for (; kUseVec && i + kVecStep <= end; i += kVecStep) {
      FVec a, b;
      VecIO<in_t>::load(in + i, a, b);
      if (kMul) {
        a = scale_value(a, sv);
        b = scale_value(b, sv);
      }
      VecIO<out_t>::template store<kStore, kRound>(out + i, a, b);
      stats_add_vec<kZeros>(acc[0], a);
      stats_add_vec<kZeros>(acc[1], b);
    }
    StatsLanes<float> tail = stats_init<float>();
    auto add_one = [&](int64_t j, StatsLanes<float>& t) {
      float v = static_cast<float>(in[j]);
      if (kMul) v = scale_value(v, s);
      const out_t w = static_cast<out_t>(v);
      if (kStore) out[j] = w;
      stats_add<kZeros>(t, static_cast<float>(w));
    };
    if constexpr (!kUseVec) {
      // x86 DEFAULT module (scalar only): 16 independent sums, element b0 + 16 q + r into slot
      // r, combined in slot order, as 16 vector lanes would be. One chain over a whole sum
      // block lost accuracy (fp32 rounding over up to 4096 adds: a relative error of ~2e-6 on
      // the sum of squares, outside the promised float32 rounding of the other modules) and
      // was latency-bound.
      constexpr int kSlots = 16;
      StatsLanes<float> slot[kSlots];
      for (auto& t : slot) t = stats_init<float>();
      for (; i + kSlots <= end; i += kSlots) {
        for (int r = 0; r < kSlots; ++r) add_one(i + r, slot[r]);
      }
      tail = slot[0];
      for (int r = 1; r < kSlots; ++r) {
        tail.sq += slot[r].sq;
        tail.amax = max_propagate_nan(tail.amax, slot[r].amax);
        tail.zeros += slot[r].zeros;
      }
    }
    for (; i < end; ++i) add_one(i, tail);
    using L = Lanes<FVec>;
    const FVec sq_v = (acc[0].sq + acc[1].sq) + (acc[2].sq + acc[3].sq);
    const FVec amax_v = L::max_plain(L::max_plain(acc[0].amax, acc[1].amax),
                                     L::max_plain(acc[2].amax, acc[3].amax));
    const FVec zeros_v = (acc[0].zeros + acc[1].zeros) + (acc[2].zeros + acc[3].zeros);
    const float sq = L::sum(sq_v) + tail.sq;
    const float amax = max_propagate_nan(L::max_all(amax_v), tail.amax);
    const float zeros = L::sum(zeros_v) + tail.zeros;
    if (!fold_block(c, sq, amax, zeros)) {
      // The fp32 sum of squares overflowed with every value finite: sum the block in fp64,
      // reading the values as stored.
      for (int64_t j = b0; j < end; ++j) {
        add_sq_fp64(c.sumsq, kStore ? static_cast<float>(out[j]) : static_cast<float>(in[j]));
      }
    }
  }
}

template <typename in_t, typename out_t, bool kMul, bool kStore, bool kZeros>
ChunkStats grad_stats_chunk(const in_t* in, out_t* out, int64_t n, float s) {
  ChunkStats c = chunk_stats_init();
  for (int64_t b0 = 0; b0 < n; b0 += kSumBlock) {
    grad_stats_block<in_t, out_t, kMul, kStore, kZeros>(in, out, b0, std::min(n, b0 + kSumBlock),
                                                        s, c);
  }
  return c;
}

// Two chunks, read only, one sum block of each in turn (two read streams far apart).
template <typename in_t, bool kZeros>
void grad_stats_pair(const in_t* a, int64_t na, ChunkStats& ca, const in_t* b, int64_t nb,
                     ChunkStats& cb) {
  ca = chunk_stats_init();
  cb = chunk_stats_init();
  in_t* none = nullptr;
  for (int64_t b0 = 0; b0 < na || b0 < nb; b0 += kSumBlock) {
    if (b0 < na) {
      grad_stats_block<in_t, in_t, false, false, kZeros>(a, none, b0, std::min(na, b0 + kSumBlock),
                                                         1.0f, ca);
    }
    if (b0 < nb) {
      grad_stats_block<in_t, in_t, false, false, kZeros>(b, none, b0, std::min(nb, b0 + kSumBlock),
                                                         1.0f, cb);
    }
  }
}

template <typename F>
void dispatch_float(at::ScalarType t, const F& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kHalf: f(at::Half{}); break;
    case at::kBFloat16: f(at::BFloat16{}); break;
    default: TORCH_CHECK(false, "tpamp: unexpected dtype ", t);  // validated before
  }
}

template <typename in_t, typename out_t, bool kStore>
ChunkStats run_chunk(const in_t* in, out_t* out, int64_t n, bool mul, float s, bool zeros) {
  if (mul) {
    return zeros ? grad_stats_chunk<in_t, out_t, true, true, true>(in, out, n, s)
                 : grad_stats_chunk<in_t, out_t, true, true, false>(in, out, n, s);
  }
  return zeros ? grad_stats_chunk<in_t, out_t, false, kStore, true>(in, out, n, s)
               : grad_stats_chunk<in_t, out_t, false, kStore, false>(in, out, n, s);
}

GradStatsResult grad_stats_impl(const char* op, at::TensorList grads, at::TensorList out,
                                bool in_place, const std::optional<at::Tensor>& scale,
                                const c10::List<bool>& mask, bool count_zeros, bool per_tensor) {
  const GradStatsArgs args =
      validate_grad_stats(op, grads, out, in_place, scale, mask, at::kCPU);
  const int64_t n = static_cast<int64_t>(grads.size());
  const float s = args.has_scale ? scale->item<float>() : 1.0f;

  std::vector<int64_t> numels;
  numels.reserve(n);
  for (const auto& g : grads) numels.push_back(g.numel());
  const ChunkPlan plan = plan_chunks(numels);
  std::vector<ChunkStats> partials(plan.chunks.size());

  // The read-only pass (in place, no multiply: nothing is written) reads two streams per
  // thread: its run of chunks in halves, chunks j and half + j one sum block at a time
  // (grad_stats_pair), the last pairs of a run taken by whichever thread is free
  // (for_each_part_balanced). Every chunk's partial is the same as chunk by chunk, so the results
  // are too. 100M fp16, 2 threads: 4.29-4.41 -> 3.89-4.26 ms (docs/benchmarks.md).
  const bool read_only = in_place && !args.has_scale;
  if (read_only && plan.chunks.size() > 2) {
    const int64_t slots = static_cast<int64_t>(plan.chunks.size());
    auto one = [&](int64_t slot) {
      const Chunk& c = plan.chunks[slot];
      const at::Tensor& g = grads[c.entry];
      dispatch_float(g.scalar_type(), [&](auto tag) {
        using in_t = decltype(tag);
        const in_t* src = static_cast<const in_t*>(g.const_data_ptr()) + c.offset;
        in_t* none = nullptr;  // nothing is stored
        partials[slot] = run_chunk<in_t, in_t, false>(src, none, c.n, false, s, count_zeros);
      });
    };
    // one run of slots per thread (part); in each, pairs (j, half + j) of its halves, then its
    // odd last slot; the last items of a part taken by whichever thread is free
    const int64_t parts = balanced_parts(slots);
    auto half_of = [&](int64_t part) {
      return (part_begin(slots, parts, part + 1) - part_begin(slots, parts, part)) / 2;
    };
    for_each_part_balanced(
        parts,
        [&](int64_t part) {
          const int64_t n = part_begin(slots, parts, part + 1) - part_begin(slots, parts, part);
          return n / 2 + n % 2;
        },
        [&](int64_t part, int64_t j) {
          const int64_t begin = part_begin(slots, parts, part);
          const int64_t half = half_of(part);
          if (j == half) {
            one(begin + 2 * half);
            return;
          }
          const int64_t sa = begin + j, sb = begin + half + j;
          const Chunk& x = plan.chunks[sa];
          const Chunk& y = plan.chunks[sb];
          const at::Tensor& gx = grads[x.entry];
          const at::Tensor& gy = grads[y.entry];
          if (gx.scalar_type() != gy.scalar_type()) {
            one(sa);
            one(sb);
            return;
          }
          dispatch_float(gx.scalar_type(), [&](auto tag) {
            using in_t = decltype(tag);
            const in_t* pa = static_cast<const in_t*>(gx.const_data_ptr()) + x.offset;
            const in_t* pb = static_cast<const in_t*>(gy.const_data_ptr()) + y.offset;
            if (count_zeros) {
              grad_stats_pair<in_t, true>(pa, x.n, partials[sa], pb, y.n, partials[sb]);
            } else {
              grad_stats_pair<in_t, false>(pa, x.n, partials[sa], pb, y.n, partials[sb]);
            }
          });
        });
  } else {
    for_each_chunk_balanced(plan, [&](int64_t slot, const Chunk& c) {
      const at::Tensor& g = grads[c.entry];
      dispatch_float(g.scalar_type(), [&](auto tag) {
        using in_t = decltype(tag);
        const in_t* src = static_cast<const in_t*>(g.const_data_ptr()) + c.offset;
        if (in_place) {
          in_t* dst = static_cast<in_t*>(g.data_ptr()) + c.offset;
          partials[slot] =
              run_chunk<in_t, in_t, false>(src, dst, c.n, args.has_scale, s, count_zeros);
        } else {
          float* dst = out[c.entry].data_ptr<float>() + c.offset;
          partials[slot] =
              run_chunk<in_t, float, true>(src, dst, c.n, args.has_scale, s, count_zeros);
        }
      });
    });
  }

  TotalStats total = total_stats_init();
  for (size_t slot = 0; slot < plan.chunks.size(); ++slot) {
    combine(total, partials[slot], mask.get(plan.chunks[slot].entry));
  }
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(args.device);
  at::Tensor found_inf = at::empty({1}, f32);
  at::Tensor sumsq = at::empty({}, f32.dtype(at::kDouble));
  at::Tensor amax = at::empty({}, f32);
  at::Tensor zeros = at::empty({}, f32.dtype(at::kLong));
  at::Tensor norms = at::empty({per_tensor ? n : 0}, f32);
  found_inf.data_ptr<float>()[0] = total.found ? 1.0f : 0.0f;
  sumsq.data_ptr<double>()[0] = total.sumsq;
  amax.data_ptr<float>()[0] = total.amax;
  zeros.data_ptr<int64_t>()[0] = total.zeros;
  if (per_tensor) {
    float* out_norms = norms.data_ptr<float>();
    for (int64_t e = 0; e < n; ++e) {
      double sq = 0.0;
      for (int64_t slot = plan.first_slot[e]; slot < plan.first_slot[e + 1]; ++slot) {
        sq += partials[slot].sumsq;
      }
      out_norms[e] = static_cast<float>(std::sqrt(sq));
    }
  }
  return {found_inf, sumsq, amax, zeros, norms};
}

}  // namespace

GradStatsResult grad_stats_(at::TensorList grads, const std::optional<at::Tensor>& scale,
                            const c10::List<bool>& mask, bool count_zeros, bool per_tensor) {
  return grad_stats_impl("tpamp::grad_stats_", grads, {}, true, scale, mask, count_zeros,
                         per_tensor);
}

GradStatsResult grad_stats_out(at::TensorList grads, const std::optional<at::Tensor>& scale,
                               const c10::List<bool>& mask, bool count_zeros, bool per_tensor,
                               at::TensorList out) {
  return grad_stats_impl("tpamp::grad_stats_out", grads, out, false, scale, mask, count_zeros,
                         per_tensor);
}

}  // namespace cpu
}  // namespace tpamp
