// The math of tpamp::grad_stats_ / grad_stats_out, shared by csrc/cpu/grad_stats.cpp and
// csrc/cuda/grad_stats.cu.
//
// Per element (lane type V, see common.h): r = the value as stored (float(cast<out_t>(g * s)));
//   sq    += r * r  (fp32, per lane, over at most kSumBlock elements of a chunk)
//   amax   = max(amax, |r|)  (a plain max: what it does with NaN does not matter, see below)
//   zeros += (r == 0), -0.0 included
// Per block (fold_block), found_inf and NaN come from those two accumulators, with no per-element
// test: a sum of squares of non-negative terms is NaN exactly when some r is NaN, and max |r| is
// > FLT_MAX exactly when some r is +-inf (an overflow in the multiply or in the cast to fp16/bf16
// counts, so a clean step's grads are finite as written). NaN makes the block's max NaN ("NaN
// wins", as torch.max). The block's fp32 lane sums are added into an fp64 total; when they
// overflowed while every value was finite (|g| > ~1.8e19), the launcher sums the block again in
// fp64 (add_sq_fp64), so a norm whose fp64 value is finite is never inf.
// Per chunk: a ChunkStats; chunks are combined in chunk order (combine) in fp64.

#pragma once

#include "common.h"

namespace tpamp {

// Elements summed in fp32 before the sum moves into fp64. With 8..16 lanes, a lane adds at most
// a few hundred squares in fp32: the relative error of the total stays near 1e-7.
constexpr int64_t kSumBlock = 4096;
static_assert(kChunkSize % kSumBlock == 0, "a chunk splits into whole sum blocks");

template <typename V>
struct StatsLanes {
  V sq;
  V amax;
  V zeros;
};

template <typename V>
TPAMP_INLINE StatsLanes<V> stats_init() {
  return {Lanes<V>::splat(0.0f), Lanes<V>::splat(0.0f), Lanes<V>::splat(0.0f)};
}

// Statistics of one value r as stored. kZeros: count zeros too.
template <bool kZeros, typename V>
TPAMP_INLINE void stats_add(StatsLanes<V>& a, const V& r) {
  using L = Lanes<V>;
  a.sq = L::fmadd(r, r, a.sq);
  a.amax = L::max_plain(a.amax, L::abs(r));
  if (kZeros) a.zeros = a.zeros + L::is_zero(r);
}

// The partial results of one chunk.
struct ChunkStats {
  double sumsq;   // sum of squares of the values written
  float amax;     // max |r|, NaN if any r is NaN
  int32_t zeros;  // elements equal to zero (<= kChunkSize)
  int32_t found;  // 1 if any value written is inf or NaN
};

TPAMP_INLINE ChunkStats chunk_stats_init() { return {0.0, 0.0f, 0, 0}; }

// Folds one block's lane accumulators (reduced to scalars by the launcher: sq summed, amax by a
// plain max) into the chunk. Returns false when the fp32 sum of squares overflowed with every
// value finite: the caller then adds that block's squares with add_sq_fp64 instead of sq_fp32.
TPAMP_INLINE bool fold_block(ChunkStats& c, float sq_fp32, float amax, float zeros) {
  const bool has_nan = sq_fp32 != sq_fp32;
  const bool has_inf = !has_nan && !(amax <= FLT_MAX);  // amax may be NaN-free even with NaN
  c.amax = max_propagate_nan(c.amax, has_nan ? sq_fp32 : amax);
  c.zeros += static_cast<int32_t>(zeros);
  c.found |= (has_nan || has_inf) ? 1 : 0;
  if (!has_nan && !has_inf && !(sq_fp32 <= FLT_MAX)) return false;
  c.sumsq += static_cast<double>(sq_fp32);
  return true;
}

// One square in fp64 (the overflow redo of a block).
TPAMP_INLINE void add_sq_fp64(double& sumsq, float r) {
  const double d = static_cast<double>(r);
  sumsq += d * d;
}

// The totals of a list: chunks combined in chunk order.
struct TotalStats {
  double sumsq;
  float amax;
  int64_t zeros;
  int32_t found;
};

TPAMP_INLINE TotalStats total_stats_init() { return {0.0, 0.0f, 0, 0}; }

TPAMP_INLINE void combine(TotalStats& t, const ChunkStats& c, bool masked) {
  t.found |= c.found;
  if (masked) {
    t.sumsq += c.sumsq;
    t.amax = max_propagate_nan(t.amax, c.amax);
    t.zeros += c.zeros;
  }
}

}  // namespace tpamp
