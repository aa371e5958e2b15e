// Per-element math of the one-pass optimizer step (Adam/AdamW, SGD), shared by the CPU launcher
// (V = at::vec::Vectorized<float>) and the CUDA launcher (V = float). Host and device code.
//
// The formulas follow torch.optim's own (torch/optim/adam.py, sgd.py, and ATen's
// FusedAdamKernel.cpp): the same operations in the same order, in float32, with the
// step-dependent scalars (bias corrections, step size) computed in float64 from the step count
// and rounded to float32 once, as torch does. Results therefore equal torch.optim's on the fp32
// main params to float32 rounding. Except for a tensor with a uint8 moment: torchao's AdamW8bit
// arithmetic (adam_element_dynamic), so that the uint8 format steps as torchao's does.
//
// V is a lane type of csrc/kernels/common.h (float on CUDA, at::vec::Vectorized<float> on CPU);
// the math uses Lanes<V>::fmadd and Lanes<V>::sqrt.

#pragma once

#include "common.h"

#include <cstring>
#include <type_traits>

namespace tpamp {

// Hyperparameters of one Adam/AdamW param group (float64, as torch.optim holds them).
struct AdamHyper {
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  bool decoupled;  // AdamW (p *= 1 - lr * wd) instead of Adam's L2 (g += wd * p)
};

// The float32 scalars of one Adam step of one tensor.
struct AdamScalars {
  float grad_scale;     // multiplies the grad: 1/loss scale x clip coefficient, negated for maximize
  float l2_decay;       // Adam: g += p * l2_decay (used when has_l2)
  float param_decay;    // AdamW: p *= param_decay (used when has_param_decay)
  float lerp_coeff;     // exp_avg.lerp_(g, 1 - beta1) as fma(coeff, g - m, base) (ATen's lerp)
  float beta2;
  float one_minus_beta2;
  float bias_correction2_sqrt;
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^step)
  bool lerp_small;      // |1 - beta1| < 0.5: base = m, coeff = w; else base = g, coeff = w - 1
  bool has_l2;
  bool has_param_decay;
  // The uint8 format's update (adam_element_dynamic): torchao's AdamW8bit arithmetic, float32
  float lr_f32;                    // float32(lr)
  float lr_decay_f32;              // AdamW: p -= lr_decay_f32 * p, float32(lr) * float32(wd)
  float bias_correction1_f32;      // 1 - powf(float32(beta1), step)
  float bias_correction2_sqrt_f32; // sqrtf(1 - powf(float32(beta2), step))
  float lerp2_coeff;               // exp_avg_sq.lerp(g * g, 1 - beta2): coeff and base as lerp_*
  bool lerp2_small;
};

// step: the step count after this step's increment (torch.optim increments, then uses it).
// grad_scale: float32 multiplier of the grad (1 when none); maximize negates it (exact).
TPAMP_INLINE AdamScalars adam_scalars(const AdamHyper& h, double step, float grad_scale,
                                      bool maximize) {
  AdamScalars s;
  s.grad_scale = maximize ? -grad_scale : grad_scale;
  const bool decay = h.weight_decay != 0.0;
  s.has_l2 = decay && !h.decoupled;
  s.has_param_decay = decay && h.decoupled;
  s.l2_decay = static_cast<float>(h.weight_decay);
  s.param_decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  const float w = static_cast<float>(1.0 - h.beta1);
  s.lerp_small = (w < 0.0f ? -w : w) < 0.5f;
  s.lerp_coeff = s.lerp_small ? w : w - 1.0f;
  s.beta2 = static_cast<float>(h.beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  // float64 here, as torch.optim (Python floats) and ATen's fused kernels
  const double bias_correction1 = 1.0 - ::pow(h.beta1, step);
  const double bias_correction2 = 1.0 - ::pow(h.beta2, step);
  s.bias_correction2_sqrt = static_cast<float>(::sqrt(bias_correction2));
  s.neg_step_size = static_cast<float>(-(h.lr / bias_correction1));
  s.eps = static_cast<float>(h.eps);
  // the uint8 format (adam_element_dynamic): torchao's float32 scalars; the C library's powf
  // of the float32 step count, as torchao's compiled step (a 0-dim float32 step tensor)
  s.lr_f32 = static_cast<float>(h.lr);
  s.lr_decay_f32 = s.lr_f32 * static_cast<float>(h.weight_decay);
  const float stepf = static_cast<float>(step);
  s.bias_correction1_f32 = 1.0f - powf(static_cast<float>(h.beta1), stepf);
  s.bias_correction2_sqrt_f32 = sqrtf(1.0f - powf(static_cast<float>(h.beta2), stepf));
  const float w2 = s.one_minus_beta2;
  s.lerp2_small = (w2 < 0.0f ? -w2 : w2) < 0.5f;
  s.lerp2_coeff = s.lerp2_small ? w2 : w2 - 1.0f;
  return s;
}

// Always inlined, also on the host: the CPU launcher's hot loops call the functions marked so
// once per vector register, and an out-of-line call there passes the registers through the stack
// and reloads every scalar (g++ 12 stopped inlining adam_element into the fp32-state loop once
// the narrow-state loops also called it).
#if defined(__CUDACC__) || defined(__HIPCC__)
#define TPAMP_ALWAYS_INLINE __host__ __device__ __forceinline__
#elif defined(__GNUC__)
#define TPAMP_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define TPAMP_ALWAYS_INLINE inline
#endif

// The three branches of an Adam step (AdamScalars::has_l2, has_param_decay, lerp_small), read
// from the scalars at run time (AdamRuntimeFlags) or fixed at compile time (AdamFixedFlags: the
// CPU launcher's loops are instantiated per combination, so they hold no branch).
struct AdamRuntimeFlags {
  bool l2;
  bool param_decay;
  bool lerp_small;
  explicit TPAMP_INLINE AdamRuntimeFlags(const AdamScalars& s)
      : l2(s.has_l2), param_decay(s.has_param_decay), lerp_small(s.lerp_small) {}
};

template <bool kL2, bool kParamDecay, bool kLerpSmall>
struct AdamFixedFlags {
  static constexpr bool l2 = kL2;
  static constexpr bool param_decay = kParamDecay;
  static constexpr bool lerp_small = kLerpSmall;
};

// x, rounded to float32 where it stands: the compiler may not contract the product x into an
// add after it (g++ contracts a * b + c into one fma across statements once no branch separates
// them, and the CPU loops have none). torch.optim's p.mul_(1 - lr * wd) is an op of its own, so
// the decayed param is rounded before the update is added; the scaled grad is rounded before
// Adam's L2 term is added (ATen's g.add(p, alpha=wd) is one fma of p * wd and g). Identity here
// (the CUDA launcher and the SIMT build); the CPU lane type specializes it
// (csrc/cpu/optimizer_step.cpp).
template <typename V>
struct RoundedHere {
  static TPAMP_ALWAYS_INLINE V apply(const V& x) { return x; }
};

// One Adam/AdamW update of p (fp32 main param), m (exp_avg), v (exp_avg_sq) from the grad g
// (already widened to float32, not yet scaled), with the branches of f (AdamRuntimeFlags or
// AdamFixedFlags; both give the same bits). sqrt_v: null, or where sqrt(v) of the new v goes
// (the square root the denominator takes, IEEE-rounded; 8-bit exp_avg_sq stores it).
template <typename V, typename Flags>
TPAMP_ALWAYS_INLINE void adam_element_flags(V& p, V& m, V& v, V g, const AdamScalars& s,
                                            const Flags& f, V* sqrt_v = nullptr) {
  g = RoundedHere<V>::apply(g * V(s.grad_scale));
  if (f.l2) g = g + p * V(s.l2_decay);
  if (f.param_decay) p = RoundedHere<V>::apply(p * V(s.param_decay));
  m = Lanes<V>::fmadd(V(s.lerp_coeff), g - m, f.lerp_small ? m : g);
  v = v * V(s.beta2) + V(s.one_minus_beta2) * g * g;
  const V root = Lanes<V>::sqrt(v);
  if (sqrt_v != nullptr) *sqrt_v = root;
  const V denom = root / V(s.bias_correction2_sqrt) + V(s.eps);
  p = p + V(s.neg_step_size) * m / denom;
}

// a * b rounded to float32 before anything is added to it (never contracted into an fma: nvcc
// contracts by default, g++ across statements; see RoundedHere).
template <typename V>
TPAMP_ALWAYS_INLINE V product_rn(const V& a, const V& b) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<V, float>) return __fmul_rn(a, b);
#endif
  return RoundedHere<V>::apply(a * b);
}

// The update of a tensor stored in the uint8 format (docs/spec.md section 9): torchao's
// AdamW8bit/Adam8bit step (torchao/optim/adam.py single_param_adam as torch.compile runs it:
// every product rounded, no fma), so that a tensor stepped from the same codes and grad gets
// the same bits as torchao's:
//   AdamW: p = p - (float32(lr) * float32(wd)) * p;  Adam: g = g + float32(wd) * p
//   m = m + w1 * (g - m)           (torch's lerp decomposition: w1 = float32(1 - beta1) < 0.5;
//   v = v + w2 * (g * g - v)        else g - (1 - w) * (g - m), likewise for v with g * g)
//   p = p - (float32(lr) * (m / bc1)) / (sqrt(v) / sqrt(bc2) + eps)
// with bc1, bc2 = 1 - powf(float32(beta), float32(step)) in float32 (torch.optim's step uses
// float64 bias corrections: the two differ by ~1e-5 of the step size in the first hundred steps).
template <typename V, typename Flags>
TPAMP_ALWAYS_INLINE void adam_element_dynamic(V& p, V& m, V& v, V g, const AdamScalars& s,
                                              const Flags& f) {
  g = RoundedHere<V>::apply(g * V(s.grad_scale));
  if (f.l2) g = g + product_rn(V(s.l2_decay), p);
  if (f.param_decay) p = p - product_rn(V(s.lr_decay_f32), p);
  m = product_rn(V(s.lerp_coeff), g - m) + (f.lerp_small ? m : g);
  const V g2 = RoundedHere<V>::apply(g * g);
  // an inf exp_avg_sq (a grad whose square overflowed float32) stays inf, as v * beta2 + ...
  // keeps it in the float32 step (the lerp would give inf - inf = NaN): its update stays 0
  v = Lanes<V>::keep_inf(v, product_rn(V(s.lerp2_coeff), g2 - v) + (s.lerp2_small ? v : g2));
  const V denom = Lanes<V>::sqrt(v) / V(s.bias_correction2_sqrt_f32) + V(s.eps);
  p = p - product_rn(V(s.lr_f32), m / V(s.bias_correction1_f32)) / denom;
}

// adam_element_flags with the branches read from s.
template <typename V>
TPAMP_ALWAYS_INLINE void adam_element(V& p, V& m, V& v, V g, const AdamScalars& s,
                                      V* sqrt_v = nullptr) {
  adam_element_flags<V>(p, m, v, g, s, AdamRuntimeFlags(s), sqrt_v);
}

// -- narrow storage of the Adam state (docs/spec.md section 9) -----------------------------------
//
// The update above always runs in float32; these functions only read and write the stored
// values. Both launchers use them (the CPU launcher on 256-element blocks it vectorizes, the CUDA
// launcher per element), so one definition fixes every bit of the formats:
//
// * bfloat16 moments: float32 -> bf16 rounds to nearest even (NaN stays NaN), bf16 -> float32 is
//   exact.
// * 8-bit moments, uint8 (the dynamic map, recommended): see "the uint8 format" below.
// * 8-bit moments, torch.float8_e4m3fn codes, blockwise: each block of kMomentBlock consecutive
//   elements of a tensor (the last block may be shorter) has one float32 scale,
//   scale = absmax / 448 (448 = e4m3fn's largest finite value); code = e4m3fn(x * (448 / absmax))
//   rounded to nearest even, so the block's largest |x| maps to +-448; value = float(code) *
//   scale. exp_avg_sq is stored as the codes of sqrt(exp_avg_sq) (the quantity the denominator
//   uses; twice the dynamic range in exp_avg_sq): value = (float(code) * scale)^2. An all-zero
//   block has scale 0 and codes 0. A block holding +-inf (a finite grad whose square overflows
//   float32 makes exp_avg_sq, and so its root, inf) saturates: scale = kFp8SaturatedScale
//   (FLT_MAX / 448, finite), the inf elements get code +-448 (value +-FLT_MAX; squared, inf
//   again, as a float32 exp_avg_sq holds it: that element's update stays 0) and the block's
//   finite elements are quantized against FLT_MAX. So no finite grad writes a non-finite scale;
//   only a NaN in the block (which a finite grad cannot make) gives a NaN scale. (torchao's and bitsandbytes' 8-bit Adam quantize blockwise
//   too, with a dynamic-tree codebook instead of e4m3fn.)
// * bf16 params with 16-bit remainders (Transformer Engine's FusedAdam store_param_remainders,
//   Megatron-core's precision-aware optimizer): the float32 master x is not stored; its bits are
//   bits(x) = (bits(param) << 16) + int32(remainder) (mod 2^32), and a new x is split as
//   remainder = int16(low 16 bits of x), bits(param) = (bits(x) + 0x8000) >> 16. So x is exact
//   (the step is bit-identical to the fp32-master step), and the bf16 param is x rounded to
//   nearest with ties away from zero: it differs from round-to-nearest-even (what a model param
//   written from an fp32 master gets) only when the low 16 bits are exactly 0x8000 and the high
//   half is even, by one bf16 ulp away from zero. No 16-bit remainder can do better: under
//   round-to-nearest-even an even bf16 value has 65537 float32 preimages.

constexpr int64_t kMomentBlock = 256;  // elements per scale of an 8-bit moment; divides kChunkSize
constexpr float kFp8Max = 448.0f;      // largest finite torch.float8_e4m3fn
// The scale of a block holding +-inf: FLT_MAX / 448 rounded to float32 (0x1.249248p+119); 448
// times it is FLT_MAX, still finite.
constexpr float kFp8SaturatedScale = 0x1.249248p+119f;

TPAMP_INLINE int64_t num_moment_blocks(int64_t numel) {
  return (numel + kMomentBlock - 1) / kMomentBlock;
}

TPAMP_INLINE uint32_t float_to_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  memcpy(&u, &x, sizeof(u));
  return u;
#endif
}

TPAMP_INLINE float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  memcpy(&x, &u, sizeof(x));
  return x;
#endif
}

TPAMP_INLINE float bf16_to_float(uint16_t b) { return bits_to_float(static_cast<uint32_t>(b) << 16); }

// c ? a : b with integer masks, no branch. The e4m3fn functions below compute every case and
// select with it, so the CPU launcher's loops over a block compile to vector code (with a
// ternary, g++ sinks the subnormal case's float add into a branch, and a loop with a branch that
// may raise a floating-point exception stays scalar).
TPAMP_INLINE uint32_t select_bits(bool c, uint32_t a, uint32_t b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(c);
  return (a & mask) | (b & ~mask);
}

// The format functions come in a 32-bit form (the 16- or 8-bit result in the low bits of a
// uint32_t, or a code passed as uint32_t): a CPU loop that computes in 32-bit lanes and narrows
// in a separate loop runs 1.3-2.3x faster than one g++ narrows operand by operand (measured,
// AVX2). The narrow forms below are the same functions.

// Round to nearest even; NaN -> a quiet NaN of the same sign. (Integer operations only: g++
// turns the branch into a vector blend.)
TPAMP_INLINE uint32_t float_to_bf16_bits(float x) {
  const uint32_t u = float_to_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x0040u;
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

TPAMP_INLINE uint16_t float_to_bf16(float x) {
  return static_cast<uint16_t>(float_to_bf16_bits(x));
}

// The float32 master of a bf16 param with its remainder (see above).
TPAMP_INLINE float join_remainder(uint16_t param_bits, int16_t remainder) {
  return bits_to_float((static_cast<uint32_t>(param_bits) << 16) +
                       static_cast<uint32_t>(static_cast<int32_t>(remainder)));
}

TPAMP_INLINE void split_remainder(float x, uint16_t& param_bits, int16_t& remainder) {
  const uint32_t u = float_to_bits(x);
  remainder = static_cast<int16_t>(static_cast<uint16_t>(u & 0xffffu));
  param_bits = static_cast<uint16_t>((u + 0x8000u) >> 16);
}

// -- bf16 params with stochastic rounding (docs/spec.md section 21) --------------------------
//
// master_weights=False, stochastic_rounding=True: no float32 master and no remainder; the step
// widens the bf16 param to float32 (exact), updates it in float32 and writes it back with
// stochastic rounding: r = 16 random bits, bits(param) = (bits(x) + r) >> 16 (the 16 bits below
// the bf16 cut, plus r, carry into the kept half with probability (low 16 bits of x) / 2^16, so
// the expected value is x: unbiased). Values whose magnitude is at least the largest finite bf16
// (bits 0x7f7f0000, 3.39e38), +-inf and NaN round to nearest even instead (as a plain cast), so a
// result overflows to inf only where round-to-nearest also gives inf and NaN stays a quiet NaN of
// the same sign. A bf16-representable x (low bits 0) is written unchanged.
//
// The random bits are a counter-based hash, the same function on every launcher and in the
// PyTorch reference (tpamp.state_formats.stochastic_rounding_bits), so every device, thread
// count, DP rank and ZeRO-1 shard layout gives the same bits: for the element of global index j
// (its position in the flattened param, whatever piece of it a rank steps) of a param with key
// k (64 bits: the run's seed mixed with the param's identity) at step count t (after this step's
// increment):
//   stream = mix64(k ^ mix64(t)),  salt = high 32 bits of mix64(stream ^ (j >> 32)),
//   r = mix32((j mod 2^32) ^ salt) >> 16
// with mix64 = splitmix64 (Steele, Lea, Flood 2014) and mix32 = lowbias32 (C. Wellons' hash
// prospector), both bijections. Only 32-bit integer multiplies per element: the CPU loops
// vectorize it.

TPAMP_INLINE uint64_t sr_mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

TPAMP_INLINE uint32_t sr_mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// The per-(param, step) stream of the hash above; step: the step count after the increment.
TPAMP_INLINE uint64_t sr_stream(uint64_t key, double step) {
  return sr_mix64(key ^ sr_mix64(static_cast<uint64_t>(step)));
}

// The salt of the elements whose global index has high word `hi` (j >> 32).
TPAMP_INLINE uint32_t sr_salt(uint64_t stream, uint64_t hi) {
  return static_cast<uint32_t>(sr_mix64(stream ^ hi) >> 32);
}

// The 16 random bits of the element with low index word lo (j mod 2^32) under `salt`.
TPAMP_INLINE uint32_t sr_random_bits(uint32_t lo, uint32_t salt) { return sr_mix32(lo ^ salt) >> 16; }

// x written to bf16 with stochastic rounding by the random bits r (< 2^16), rule above; the bf16
// bits in the low 16 bits. Branch-free (select_bits), so the CPU loops vectorize it.
TPAMP_INLINE uint32_t float_to_bf16_sr_bits(float x, uint32_t r) {
  const uint32_t u = float_to_bits(x);
  const uint32_t a = u & 0x7fffffffu;
  const uint32_t nan = (u >> 16) | 0x0040u;
  const uint32_t rne = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t special = select_bits(a > 0x7f800000u, nan, rne);
  return select_bits(a >= 0x7f7f0000u, special, (u + r) >> 16);
}

// e4m3fn code of q, |q| <= 448 (larger finite values saturate to +-448), round to nearest even;
// NaN -> 0x7f | sign. The same result as torch's float32 -> float8_e4m3fn conversion there.
// Branch-free (select_bits); the code in the low 8 bits.
TPAMP_INLINE uint32_t fp8_e4m3_encode_bits(float q) {
  const uint32_t u = float_to_bits(q);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7fffffffu;
  // |q| < 2^-6: subnormal codes, steps of 2^-9 (16384 has ulp 2^-9, so the add rounds there)
  const uint32_t subnormal = float_to_bits(bits_to_float(a) + 16384.0f) - 0x46800000u;
  // else: round the mantissa to 3 bits (nearest even), rebias the exponent (8 -> 4 bits)
  const uint32_t normal = ((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - ((127u - 7u) << 3);
  const uint32_t finite =
      select_bits(a < 0x3c800000u, subnormal, select_bits(normal > 0x7eu, 0x7eu, normal));
  return select_bits(a > 0x7f800000u, 0x7fu, finite) | sign;
}

TPAMP_INLINE uint8_t fp8_e4m3_encode(float q) {
  return static_cast<uint8_t>(fp8_e4m3_encode_bits(q));
}

// The value of an e4m3fn code c (0..255; an 8-bit code widens to it). Branch-free: |value| from
// the code's 7 low bits, then the sign bit.
TPAMP_INLINE float fp8_e4m3_decode(uint32_t c) {
  const uint32_t low = c & 0x7fu;  // exponent (4 bits) and mantissa (3)
  // subnormal (exponent 0): mantissa x 2^-9; normal: rebias the exponent (4 -> 8 bits)
  const uint32_t subnormal = float_to_bits(static_cast<float>(low & 7u) * 0.001953125f);
  const uint32_t normal = (low << 20) + ((127u - 7u) << 23);
  const uint32_t mag =
      select_bits(low == 0x7fu, 0x7fc00000u, select_bits(low < 8u, subnormal, normal));
  return bits_to_float(mag | ((c & 0x80u) << 24));
}

// A block's scale and its multiplier for encoding, from the block's max |value| (NaN if any;
// inf saturates, see above).
struct MomentScale {
  float scale;  // stored: value = float(code) * scale
  float inv;    // code = e4m3fn(x * inv)
};

TPAMP_INLINE MomentScale moment_scale(float absmax) {
  MomentScale s;
  if (absmax > 0.0f && absmax <= FLT_MAX) {
    s.scale = absmax / kFp8Max;
    s.inv = kFp8Max / absmax;
  } else if (absmax > FLT_MAX) {  // +-inf: saturate (inf * inv encodes as +-448, see above)
    s.scale = kFp8SaturatedScale;
    s.inv = kFp8Max / FLT_MAX;
  } else {  // all zero: codes 0, scale 0; NaN: codes 0, scale NaN (the block reads NaN)
    s.scale = absmax == 0.0f ? 0.0f : bits_to_float(0x7fc00000u);
    s.inv = 0.0f;
  }
  return s;
}

// -- the uint8 format: codes of the dynamic quantization map (docs/spec.md section 9) ---------
//
// bitsandbytes' and torchao's 8-bit Adam state (create_dynamic_map with 7 exponent bits): code c
// of a block means map[c] x scale, with scale = the block's max |x| (float32) and map the
// signed table for exp_avg, the unsigned one for exp_avg_sq (which keeps the value itself, not
// its root; except that its code 0 reads map[1] x scale and a block of it holding +inf has a
// negative scale: see dynamic_sq_decode below). Encode: y = x / scale (float32 division, as
// torchao; an all-zero block divides by 1 and has scale 0; an exp_avg block holding +-inf has
// scale FLT_MAX and divides by it, so its inf elements get the largest code (1.0) or the most
// negative one; exp_avg_sq: dynamic_sq_inf_scale), then the code of the nearest
// map entry: c = the largest code with map[c] <= y (0 when none), plus one when
// y - map[c] >= (map[c+1] - map[c]) / 2 (ties up): torchao's quantize_8bit_with_qmap, bit for
// bit. dynamic_encode_bits below (the CUDA launcher's) searches with a table lookup on y's bits
// (sign, exponent, kDynamicSegmentBits mantissa bits) giving the floor code of that segment,
// and one step (every segment holds at most one map entry above its lowest value: checked when
// the tables are generated). The CPU launcher computes the same codes another way
// (csrc/cpu/dynamic_map_simd.h): the rule is monotone in y, so code(y) = #{c : T[c] <= y} with
// the 255 float32 thresholds kDynamicThreshold* (T[c] = the smallest float32 whose code is above
// c, generated by bisection and checked); AVX2 and AVX-512 compute the code from the map's
// decade pieces (kDynamicPiece*, csrc/cpu/dynamic_map_simd.h; 8 and 16 lanes), and AVX-512
// decodes with word permutes (byte permutes in the one-pass loop where the CPU has VBMI); the scalar path (and AVX2's rare fallback) reads one 32-bit
// entry of y's segment (kDynamicKeyed*: the code of the segment's lowest value and the low 16
// bits of the one threshold inside it; one read instead of four). tests/test_dynamic_map_modules.py checks every threshold and
// its neighbours in every CPU module. tpamp.state_formats (dynamic_map, encode_moment) is the
// reference; scripts/gen_dynamic_map.py prints the tables.

#if defined(__CUDACC__) || defined(__HIPCC__)
#define TPAMP_TABLE static __constant__ const
#else
#define TPAMP_TABLE static constexpr
#endif

constexpr int kDynamicSegmentBits = 7;   // mantissa bits of a segment
constexpr int kDynamicLowExponent = -22; // |y| < 2^-22: one segment (below every nonzero entry)
// segments per sign: |y| < 2^-22, 22 binades of 2^7 segments, |y| >= 1 (inf and NaN included)
constexpr int kDynamicSlots = 22 * (1 << kDynamicSegmentBits) + 3;

#include "dynamic_map_tables.h"  // generated by scripts/gen_dynamic_map.py

// The uint8 code of y (|y| <= 1 for a finite block; NaN: 255 with a clear sign bit, else 0) in
// the map q (257 entries: kDynamicMapSigned or kDynamicMapUnsigned) with its floor table
// (kDynamicFloorSigned / kDynamicFloorUnsigned, or a copy widened to 32 bits: the CPU launcher's,
// so that g++ vectorizes the loop with 32-bit gathers). Branch-free; the code in the low 8 bits.
template <typename T>
TPAMP_INLINE uint32_t dynamic_encode_bits(float y, const float* q, const T* floor_table) {
  const uint32_t u = float_to_bits(y);
  const int32_t e = static_cast<int32_t>((u & 0x7fffffffu) >> (23 - kDynamicSegmentBits)) -
                    ((127 + kDynamicLowExponent) << kDynamicSegmentBits);
  const int32_t top = kDynamicSlots - 2;
  const int32_t slot = (e < 0 ? 0 : (e > top - 1 ? top : e + 1));
  uint32_t c = floor_table[static_cast<int32_t>(u >> 31) * kDynamicSlots + slot];
  c += (y >= q[c + 1]) ? 1u : 0u;
  c = c > 255u ? 255u : c;
  c += (y - q[c] >= (q[c + 1] - q[c]) * 0.5f) ? 1u : 0u;
  return c > 255u ? 255u : c;
}

// A uint8 block's stored scale and the divisor of its encode, from the block's max |value|.
struct DynamicScale {
  float scale;  // stored: value = map[code] * scale
  float div;    // y = x / div
};

TPAMP_INLINE DynamicScale dynamic_scale(float absmax) {
  DynamicScale s;
  if (absmax > 0.0f && absmax <= FLT_MAX) {
    s.scale = absmax;
    s.div = absmax;
  } else if (absmax > FLT_MAX) {  // +-inf: saturate to FLT_MAX
    s.scale = FLT_MAX;
    s.div = FLT_MAX;
  } else {  // all zero: codes of 0, scale 0; NaN: scale NaN (the block reads NaN)
    s.scale = absmax;
    s.div = absmax == 0.0f ? 1.0f : absmax;
  }
  return s;
}

// exp_avg_sq (the unsigned map) never reads back 0 where it is positive, and keeps +inf:
// * code 0 reads as code 1's entry (the smallest positive one, 3.25e-7) times the scale, so an
//   element far below its block's max (a neighbour of an outlier) reads a small positive value
//   instead of 0 and steps by less than exp_avg / eps ("the zero-point problem", Li et al. 2023,
//   Memory efficient optimizers with 4-bit states); an all-zero block (scale 0) still reads 0.
// * a block holding +-inf (a grad whose square overflows float32) stores scale = -d with d = its
//   largest finite |value| (at least FLT_MIN) and divides by d: +inf gets code 255, which reads
//   back +inf (its update stays 0, as in float32 state), the finite values their codes against d
//   capped at 254 (read back as map[code] * d: the block's other elements keep their precision).
//   Only such a block has a negative scale. exp_avg (the signed map) keeps dynamic_scale's
//   saturation.
// The value of exp_avg_sq code c in a block with scale `scale`, map = kDynamicMapUnsigned (passed
// in, as to dynamic_encode_bits: a __constant__ table on CUDA; the CUDA launcher's decode; the
// CPU launcher decodes with the same values: dynamic_decode_table).
TPAMP_INLINE float dynamic_sq_decode(uint32_t c, float scale, const float* map) {
  const float q = map[c == 0u ? 1u : c];
  return scale < 0.0f ? (c == 255u ? bits_to_float(0x7f800000u) : q * -scale) : q * scale;
}

// The stored scale and the divisor of an exp_avg_sq block holding +-inf (no NaN), from its
// largest finite |value|.
TPAMP_INLINE DynamicScale dynamic_sq_inf_scale(float finite_max) {
  const float d = finite_max > FLT_MIN ? finite_max : FLT_MIN;
  DynamicScale s;
  s.scale = -d;
  s.div = d;
  return s;
}

// The code of x in an exp_avg_sq block holding +-inf, from c = dynamic_encode_bits(x / div).
TPAMP_INLINE uint32_t dynamic_sq_inf_code(float x, uint32_t c) {
  return x > FLT_MAX ? 255u : (c > 254u ? 254u : c);
}

// Hyperparameters of one SGD param group.
struct SgdHyper {
  double lr;
  double momentum;
  double dampening;
  double weight_decay;
  bool nesterov;
};

struct SgdScalars {
  float grad_scale;  // as in AdamScalars
  float weight_decay;
  float momentum;
  float one_minus_dampening;
  float neg_lr;
  bool has_weight_decay;
  bool has_momentum;
  bool nesterov;
};

TPAMP_INLINE SgdScalars sgd_scalars(const SgdHyper& h, float grad_scale, bool maximize) {
  SgdScalars s;
  s.grad_scale = maximize ? -grad_scale : grad_scale;
  s.has_weight_decay = h.weight_decay != 0.0;
  s.weight_decay = static_cast<float>(h.weight_decay);
  s.has_momentum = h.momentum != 0.0;
  s.momentum = static_cast<float>(h.momentum);
  s.one_minus_dampening = static_cast<float>(1.0 - h.dampening);
  s.nesterov = h.nesterov;
  s.neg_lr = static_cast<float>(-h.lr);
  return s;
}

// One SGD update of p and its momentum buffer buf (unused without momentum). first: the buffer
// has no value yet (torch.optim's first step: buf = g, no dampening). ATen computes
// `a.add_(b, alpha=x)` as fma(b, x, a); so do we.
template <typename V>
TPAMP_INLINE void sgd_element(V& p, V& buf, V g, bool first, const SgdScalars& s) {
  g = g * V(s.grad_scale);
  if (s.has_weight_decay) g = Lanes<V>::fmadd(p, V(s.weight_decay), g);
  if (s.has_momentum) {
    buf = first ? g : Lanes<V>::fmadd(g, V(s.one_minus_dampening), buf * V(s.momentum));
    g = s.nesterov ? Lanes<V>::fmadd(buf, V(s.momentum), g) : buf;
  }
  p = Lanes<V>::fmadd(g, V(s.neg_lr), p);
}

}  // namespace tpamp
