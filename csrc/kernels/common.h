// Shared by every kernel: the host/device macro, the chunk size and the lane primitives.
//
// The math of each op (csrc/kernels/<op>.h) is written once, as templates over a *lane type* V:
//   - V = float: one CUDA thread's element (csrc/cuda/), or the scalar tail of a CPU chunk;
//   - V = at::vec::Vectorized<float>: a SIMD register of the CPU launcher (csrc/cpu/), whose
//     Lanes<> specialization is in csrc/cpu/vec_lanes.h.
// Lanes<V> supplies the few primitives the math needs, with the same semantics for both.
// Everything here compiles as host code (g++) and as device code (nvcc).

#pragma once

#include <c10/macros/Macros.h>

#include <cfloat>
#include <cmath>
#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define TPAMP_HOST_DEVICE __host__ __device__
#define TPAMP_INLINE __host__ __device__ __forceinline__
#else
#define TPAMP_HOST_DEVICE
#define TPAMP_INLINE inline
#endif

namespace tpamp {

// Elements per chunk, on both launchers. A chunk is the unit of work (one CUDA block, one
// at::parallel_for item on CPU) and of partial results: per-chunk partials are combined in chunk
// order, so every result is independent of scheduling and thread count.
constexpr int64_t kChunkSize = 65536;

TPAMP_INLINE int64_t num_chunks(int64_t numel) { return (numel + kChunkSize - 1) / kChunkSize; }

// max that propagates NaN (as torch.max / torch.maximum do): NaN wins.
TPAMP_INLINE float max_propagate_nan(float a, float b) {
  return (a != a) ? a : ((b != b) ? b : (a < b ? b : a));
}

// The unscale / clip multiply, in float32 with the exact float32 scale (every op that scales).
template <typename V>
TPAMP_INLINE V scale_value(const V& x, const V& s) {
  return x * s;
}

template <typename V>
struct Lanes;

// The scalar lane: one float.
template <>
struct Lanes<float> {
  static TPAMP_INLINE float splat(float x) { return x; }
  static TPAMP_INLINE float abs(float x) { return fabsf(x); }
  static TPAMP_INLINE float max_nan(float a, float b) { return max_propagate_nan(a, b); }
  // One instruction where possible; NaN handling unspecified (callers detect NaN otherwise).
  static TPAMP_INLINE float max_plain(float a, float b) { return a < b ? b : a; }
  // 1.0f where |x| <= FLT_MAX (finite), 0.0f for +-inf and NaN.
  static TPAMP_INLINE float is_finite(float x) { return fabsf(x) <= FLT_MAX ? 1.0f : 0.0f; }
  // 1.0f where x == 0 (-0.0 included), else 0.0f.
  static TPAMP_INLINE float is_zero(float x) { return x == 0.0f ? 1.0f : 0.0f; }
  // a * b + c rounded once (an fma on every device: nvcc would contract a * b + c, g++ does not).
  static TPAMP_INLINE float fmadd(float a, float b, float c) { return fmaf(a, b, c); }
  static TPAMP_INLINE float sqrt(float x) { return sqrtf(x); }  // IEEE (no fast math)
  // old where old is +inf, else x (an inf exp_avg_sq stays inf through the uint8 format's lerp,
  // which would give inf - inf = NaN).
  static TPAMP_INLINE float keep_inf(float old, float x) { return old > FLT_MAX ? old : x; }
  // Horizontal reductions (trivial for one lane).
  static TPAMP_INLINE float sum(float x) { return x; }
  static TPAMP_INLINE float max_all(float x) { return x; }
};

}  // namespace tpamp
