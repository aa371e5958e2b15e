// The SIMD lane type of the CPU launcher: Lanes<at::vec::Vectorized<float>> (see
// csrc/kernels/common.h) and VecIO, which loads/stores float32/float16/bfloat16 memory as pairs
// of float registers.
//
// at::vec::Vectorized picks its width from the CPU_CAPABILITY_* macro of the translation unit:
// setup.py compiles every csrc/cpu/*.cpp once per capability (DEFAULT, AVX2, AVX512), each into
// its own extension module, and tpamp/_ext.py loads the one that matches the CPU at run time.

#pragma once

#include "../kernels/common.h"

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <tuple>

namespace tpamp {

using FVec = at::vec::Vectorized<float>;

template <>
struct Lanes<FVec> {
  static inline FVec splat(float x) { return FVec(x); }
  static inline FVec abs(const FVec& x) { return x.abs(); }
  // at::vec::maximum propagates NaN from either side, as max_propagate_nan does.
  static inline FVec max_nan(const FVec& a, const FVec& b) { return at::vec::maximum(a, b); }
  // One max instruction (clamp_min(b, a) = max(a, b)); NaN handling unspecified.
  static inline FVec max_plain(const FVec& a, const FVec& b) { return at::vec::clamp_min(b, a); }
  // le/eq return 1.0f / 0.0f per lane (not bit masks); |NaN| <= FLT_MAX is false.
  static inline FVec is_finite(const FVec& x) { return x.abs().le(FVec(FLT_MAX)); }
  static inline FVec is_zero(const FVec& x) { return x.eq(FVec(0.0f)); }
  // a * b + c rounded once, as Lanes<float>::fmadd (fmaf) and CUDA's fma. at::vec's portable
  // (x86 DEFAULT capability) fmadd is a * b + c, rounded twice: one fmaf per lane there instead.
  static inline FVec fmadd(const FVec& a, const FVec& b, const FVec& c) {
#if defined(CPU_CAPABILITY_DEFAULT) && (defined(__x86_64__) || defined(_M_X64))
    float av[FVec::size()], bv[FVec::size()], cv[FVec::size()];
    a.store(av);
    b.store(bv);
    c.store(cv);
    for (int i = 0; i < FVec::size(); ++i) av[i] = std::fma(av[i], bv[i], cv[i]);
    return FVec::loadu(av);
#else
    return at::vec::fmadd(a, b, c);
#endif
  }
  static inline FVec sqrt(const FVec& x) { return x.sqrt(); }
  // old where old is +inf, else x (Lanes<float>::keep_inf); operator> gives a bit mask.
  static inline FVec keep_inf(const FVec& old, const FVec& x) {
    return FVec::blendv(x, old, old > FVec(FLT_MAX));
  }
  // Horizontal reductions in a fixed lane order (deterministic).
  static inline float sum(const FVec& x) {
    float v[FVec::size()];
    x.store(v);
    float s = 0.0f;
    for (int i = 0; i < FVec::size(); ++i) s += v[i];
    return s;
  }
  static inline float max_all(const FVec& x) {
    float v[FVec::size()];
    x.store(v);
    float m = v[0];
    for (int i = 1; i < FVec::size(); ++i) m = max_propagate_nan(m, v[i]);
    return m;
  }
};

// On x86-64 the DEFAULT capability's Vectorized is a portable emulation that is slower than the
// plain scalar loop the compiler vectorizes itself, so the launchers use only their scalar path
// there (aarch64's DEFAULT Vectorized is NEON and is kept).
#if defined(CPU_CAPABILITY_DEFAULT) && (defined(__x86_64__) || defined(_M_X64))
constexpr bool kUseVec = false;
#else
constexpr bool kUseVec = true;
#endif

// Elements per vector step: one Vectorized of a 16-bit type = two float registers.
constexpr int64_t kVecStep = 2 * FVec::size();

template <typename T>
struct VecIO;

template <>
struct VecIO<float> {
  static inline void load(const float* p, FVec& a, FVec& b) {
    a = FVec::loadu(p);
    b = FVec::loadu(p + FVec::size());
  }
  // Stores a, b (kStore); float32 holds them exactly, so they are the values as stored.
  template <bool kStore, bool kRound>
  static inline void store(float* p, FVec& a, FVec& b) {
    if (kStore) {
      a.store(p);
      b.store(p + FVec::size());
    }
  }
};

template <typename R>
struct VecIO16 {
  using RVec = at::vec::Vectorized<R>;
  static_assert(RVec::size() == kVecStep, "a 16-bit register holds two float registers");
  static inline void load(const R* p, FVec& a, FVec& b) {
    std::tie(a, b) = at::vec::convert_to_float<R>(RVec::loadu(p));
  }
  // Rounds a, b to R, stores them (kStore), and with kRound turns a, b into the values as
  // stored (float(R(x))), on which statistics are taken.
  template <bool kStore, bool kRound>
  static inline void store(R* p, FVec& a, FVec& b) {
    if (!kStore && !kRound) return;
    const RVec h = at::vec::convert_from_float<R>(a, b);
    if (kStore) h.store(p);
    if (kRound) std::tie(a, b) = at::vec::convert_to_float<R>(h);
  }
};
template <>
struct VecIO<at::Half> : VecIO16<at::Half> {};
template <>
struct VecIO<at::BFloat16> : VecIO16<at::BFloat16> {};

}  // namespace tpamp
