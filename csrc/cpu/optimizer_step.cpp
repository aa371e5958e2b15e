// CPU launcher of tpamp::fused_adam_step_ and tpamp::fused_sgd_step_ (math:
// csrc/kernels/optimizer_step.h; CUDA twin: csrc/cuda/optimizer_step.cu).
//
// One pass per param: each chunk reads the grad (fp16/bf16/fp32), the fp32 main param and its
// state, updates them and writes the fp16/bf16 model param. The step-dependent scalars are
// computed per param on the host from the step count (CPU memory: no sync). A set found_inf
// returns before anything is touched; the step counts are incremented after the pass.

#include "../host/optimizer_step_checks.h"
#include "../kernels/optimizer_step.h"
#include "../ops.h"
#include "dynamic_map_simd.h"
#include "launcher.h"
#include "vec_lanes.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace tpamp {

// RoundedHere (kernels/optimizer_step.h) for the CPU lanes: an empty asm that takes the register
// (or, for the portable emulation, the memory) of x and may have changed it, so the compiler
// cannot contract a product before it with an add after it.
template <>
struct RoundedHere<FVec> {
  static inline __attribute__((always_inline)) FVec apply(const FVec& x) {
#if defined(CPU_CAPABILITY_AVX512)
    __m512 r = x;
    __asm__("" : "+v"(r));
    return FVec(r);
#elif defined(CPU_CAPABILITY_AVX2)
    __m256 r = x;
    __asm__("" : "+x"(r));
    return FVec(r);
#else
    FVec r = x;
    __asm__("" : "+m"(r));
    return r;
#endif
  }
};

namespace cpu {
namespace {

struct NoModel {};

// Copies the last n < kVecStep elements into zero-padded registers' worth of memory and back,
// so a tail runs the same vector math as the body (one formula for every element).
template <typename T>
struct Tail {
  T buf[kVecStep];
  void in(const T* p, int64_t n) {
    std::memset(static_cast<void*>(buf), 0, sizeof(buf));
    std::memcpy(static_cast<void*>(buf), p, static_cast<size_t>(n) * sizeof(T));
  }
  void out(T* p, int64_t n) const {
    std::memcpy(static_cast<void*>(p), buf, static_cast<size_t>(n) * sizeof(T));
  }
};

// The uint8 loops' update of two registers of decoded moments (m, v: map[c] * scale) in place:
// the moments rounded where they stand (the decode's products are not contracted into the
// update), then adam_element_dynamic on each register. Raw is the capability's register type.
template <typename Raw, typename Flags>
inline __attribute__((always_inline)) void dynamic_update2(FVec& p0, FVec& p1, Raw& m0, Raw& m1,
                                                           Raw& v0, Raw& v1, const FVec& g0,
                                                           const FVec& g1, const AdamScalars& s,
                                                           const Flags& flags) {
  FVec fm0 = RoundedHere<FVec>::apply(FVec(m0)), fm1 = RoundedHere<FVec>::apply(FVec(m1));
  FVec fv0 = RoundedHere<FVec>::apply(FVec(v0)), fv1 = RoundedHere<FVec>::apply(FVec(v1));
  adam_element_dynamic<FVec>(p0, fm0, fv0, g0, s, flags);
  adam_element_dynamic<FVec>(p1, fm1, fv1, g1, s, flags);
  m0 = fm0;
  m1 = fm1;
  v0 = fv0;
  v1 = fv1;
}

// The tail of a one-pass loop (the bf16-moment loop, the uint8 loops): the r < kVecStep elements
// from j through zero-padded copies (Tail) of the grad and of the fp32 params, or, with kRem, of
// the remainders and the bf16 model params they are joined with; f(g, p, rem, model) runs one
// step on the copies (p or rem unused as kRem says; model null without model params; a loop
// with moments of its own copies them inside f), then the params / remainders and the model
// params are written back.
template <bool kRem, typename G, typename M, typename F>
inline __attribute__((always_inline)) void step_tail(const G* g, float* p, int16_t* rem,
                                                        M* model, int64_t j, int64_t r,
                                                        const F& f) {
  constexpr bool kModel = !std::is_same_v<M, NoModel>;
  Tail<G> tg;
  Tail<float> tp;
  Tail<int16_t> trem;
  Tail<std::conditional_t<kModel, M, float>> tmodel;
  tg.in(g + j, r);
  if constexpr (kRem) {
    trem.in(rem + j, r);
    tmodel.in(model + j, r);
  } else {
    tp.in(p + j, r);
  }
  f(tg.buf, tp.buf, trem.buf, kModel ? reinterpret_cast<M*>(tmodel.buf) : nullptr);
  if constexpr (kRem) {
    trem.out(rem + j, r);
  } else {
    tp.out(p + j, r);
  }
  if constexpr (kModel) tmodel.out(model + j, r);
}

// The model params' writes of the fp32-state loop bypass the cache (non-temporal stores) when
// a step moves at least this many elements: the step streams far more than any cache holds, so
// the write-allocate read of every model-param line would be memory traffic for nothing (2 of the
// ~32 bytes per element). Smaller steps keep ordinary stores (the next forward reads them).
constexpr int64_t kStreamModelMinElements = int64_t{1} << 22;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
constexpr bool kStreamModel = true;
#else
constexpr bool kStreamModel = false;
#endif

// Stores a, b as 16-bit M at p (aligned to one M vector) with a non-temporal store where the
// capability has one; the values are those of VecIO<M>::store.
template <typename M>
inline __attribute__((always_inline)) void store_model_stream(M* p, FVec& a, FVec& b) {
#if defined(CPU_CAPABILITY_AVX512)
  _mm512_stream_si512(reinterpret_cast<__m512i*>(p),
                      static_cast<__m512i>(at::vec::convert_from_float<M>(a, b)));
#elif defined(CPU_CAPABILITY_AVX2)
  _mm256_stream_si256(reinterpret_cast<__m256i*>(p),
                      static_cast<__m256i>(at::vec::convert_from_float<M>(a, b)));
#else
  VecIO<M>::template store<true, false>(p, a, b);
#endif
}

// The Adam update of one chunk with fp32 state (the hot loop of the default configuration).
// Flags: AdamFixedFlags (no branch in the loop) or AdamRuntimeFlags. Kept out of line so that
// each instance is compiled on its own (inlined into the dtype dispatch, g++ left
// adam_element out of line and the loop passed every register through the stack).
// stream: write the model params with store_model_stream (the caller checked the alignment).
// How far ahead (elements) the fp32-state loop asks for the lines of the param, both moments and
// the grad (__builtin_prefetch), on top of the hardware prefetchers. Measured on the 2-core Zen 5
// (AVX-512 module, in one process against the same loop without it, 100M elements in 196
// tensors, 2 threads): the kernel 5-6% faster in the VM's fast memory state, ~1% in its slow
// one; at 20M, 6-12% on 1 and 2 threads; 1024 ahead (4 KB of fp32, the next page) lost it again.
constexpr int64_t kPrefetchAhead = 256;

// The lines of the kVecStep elements kAhead elements past q, for reading (kWrite: for writing,
// prefetchw).
template <typename T, int64_t kAhead = kPrefetchAhead, int kWrite = 0>
inline __attribute__((always_inline)) void prefetch_step(const T* q) {
  constexpr int64_t kBytes = kVecStep * static_cast<int64_t>(sizeof(T));
  for (int64_t b = 0; b < kBytes; b += 64) {
    __builtin_prefetch(reinterpret_cast<const char*>(q + kAhead) + b, kWrite, 3);
  }
}

template <typename G, typename M, typename Flags>
__attribute__((noinline)) void adam_chunk(const G* __restrict g, float* __restrict p,
                                          float* __restrict m, float* __restrict v,
                                          M* __restrict model, int64_t n,
                                          const AdamScalars& scalars, Flags flags,
                                          bool stream = false) {
  constexpr bool kModel = !std::is_same_v<M, NoModel>;
  // a local copy: the stores below cannot alias it, so the scalars stay in registers
  const AdamScalars s = scalars;
  auto step = [&](const G* gp, float* pp, float* mp, float* vp, M* modelp, auto stream_tag) {
    prefetch_step(pp);  // (a prefetch past the tensor's end does not fault)
    prefetch_step(mp);
    prefetch_step(vp);
    prefetch_step(gp);
    FVec g0, g1, p0, p1, m0, m1, v0, v1;
    VecIO<G>::load(gp, g0, g1);
    VecIO<float>::load(pp, p0, p1);
    VecIO<float>::load(mp, m0, m1);
    VecIO<float>::load(vp, v0, v1);
    adam_element_flags<FVec>(p0, m0, v0, g0, s, flags);
    adam_element_flags<FVec>(p1, m1, v1, g1, s, flags);
    VecIO<float>::template store<true, false>(pp, p0, p1);
    VecIO<float>::template store<true, false>(mp, m0, m1);
    VecIO<float>::template store<true, false>(vp, v0, v1);
    if constexpr (kModel) {
      if constexpr (decltype(stream_tag)::value) {
        store_model_stream(modelp, p0, p1);
      } else {
        VecIO<M>::template store<true, false>(modelp, p0, p1);
      }
    }
  };
  int64_t i = 0;
  if (kModel && stream) {
    for (; i + kVecStep <= n; i += kVecStep) {
      step(g + i, p + i, m + i, v + i, model + i, std::true_type{});
    }
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    _mm_sfence();  // the streamed stores are ordered before the chunk counts as done
#endif
  }
  for (; i + kVecStep <= n; i += kVecStep) {
    step(g + i, p + i, m + i, v + i, kModel ? model + i : nullptr, std::false_type{});
  }
  if (i < n) {
    const int64_t r = n - i;
    Tail<G> tg;
    Tail<float> tp, tm, tv;
    tg.in(g + i, r);
    tp.in(p + i, r);
    tm.in(m + i, r);
    tv.in(v + i, r);
    if constexpr (kModel) {
      Tail<M> tmodel;
      step(tg.buf, tp.buf, tm.buf, tv.buf, tmodel.buf, std::false_type{});
      tmodel.out(model + i, r);
    } else {
      step(tg.buf, tp.buf, tm.buf, tv.buf, nullptr, std::false_type{});
    }
    tp.out(p + i, r);
    tm.out(m + i, r);
    tv.out(v + i, r);
  }
}

// f(flags) with the Adam branches of s fixed at compile time for AdamW (weight decay or none)
// and Adam with L2 (beta1 >= 0.5, the lerp form every usual beta1 takes), read at run time
// otherwise. The fixed instances hold no branch in their loops.
template <typename F>
void with_adam_flags(const AdamScalars& s, const F& f) {
  if (s.lerp_small && !s.has_l2) {
    if (s.has_param_decay) return f(AdamFixedFlags<false, true, true>{});
    return f(AdamFixedFlags<false, false, true>{});
  }
  if (s.lerp_small && s.has_l2 && !s.has_param_decay) {
    return f(AdamFixedFlags<true, false, true>{});
  }
  return f(AdamRuntimeFlags(s));
}

// -- narrow state (kernels/optimizer_step.h): bf16 / 8-bit moments, bf16 params + remainders --

static_assert(kChunkSize % kMomentBlock == 0, "a chunk holds whole moment blocks");

enum class Kind : int { kFloat, kBFloat16, kFp8, kDynamic };

Kind kind_of(at::ScalarType t) {
  if (t == at::kByte) return Kind::kDynamic;  // uint8: codes of the dynamic map
  return t == at::kFloat ? Kind::kFloat : (t == at::kBFloat16 ? Kind::kBFloat16 : Kind::kFp8);
}

// One stored moment of a chunk: its memory (float, bf16 bits or e4m3fn codes) and, for 8-bit,
// the scales of the chunk's blocks.
struct MomentRef {
  Kind kind;
  void* data;     // at the chunk's first element
  float* scales;  // at the chunk's first block (8-bit only)
  bool sqrt;      // exp_avg_sq: e4m3fn codes hold sqrt(value); uint8 uses the unsigned map
};

// The loops below call the scalar format functions of kernels/optimizer_step.h (the CUDA
// launcher's, so the bits agree) on one block (<= kMomentBlock elements, in L1); they are written
// with integer selects so that -O3 compiles these loops to vector code for every capability
// (checked with g++ 12 -fopt-info-vec: all of them vectorized for AVX2).

// The float32 values of block b of a chunk's moment: float32 moments in place, the others decoded
// into buf. n <= kMomentBlock.
inline float* read_moment(const MomentRef& r, int64_t b, int64_t n, float* __restrict buf) {
  const int64_t o = b * kMomentBlock;
  switch (r.kind) {
    case Kind::kFloat:
      return static_cast<float*>(r.data) + o;
    case Kind::kBFloat16: {
      const uint16_t* __restrict in = static_cast<const uint16_t*>(r.data) + o;
      for (int64_t i = 0; i < n; ++i) buf[i] = bf16_to_float(in[i]);
      return buf;
    }
    case Kind::kFp8: {
      const uint8_t* __restrict in = static_cast<const uint8_t*>(r.data) + o;
      const float scale = r.scales[b];
      alignas(64) uint32_t codes[kMomentBlock];  // widened first: the decode runs in 32-bit lanes
      for (int64_t i = 0; i < n; ++i) codes[i] = in[i];
      if (r.sqrt) {
        for (int64_t i = 0; i < n; ++i) {
          const float x = fp8_e4m3_decode(codes[i]) * scale;
          buf[i] = x * x;
        }
      } else {
        for (int64_t i = 0; i < n; ++i) buf[i] = fp8_e4m3_decode(codes[i]) * scale;
      }
      return buf;
    }
    case Kind::kDynamic: {
      const uint8_t* __restrict in = static_cast<const uint8_t*>(r.data) + o;
      const float scale = r.scales[b];
      if (r.sqrt && scale < 0.0f) {  // exp_avg_sq holding +inf (dynamic_sq_decode): code 255
        dynamic_decode_block(in, n, -scale, dynamic_tables(true), buf);
        for (int64_t i = 0; i < n; ++i) buf[i] = in[i] == 255 ? bits_to_float(0x7f800000u) : buf[i];
        return buf;
      }
      dynamic_decode_block(in, n, scale, dynamic_tables(r.sqrt), buf);
      return buf;
    }
  }
  return buf;
}

// Whether any of the nb scales of a uint8 exp_avg_sq from block `first` is negative (a block
// holding inf: dynamic_sq_decode).
inline bool any_negative(const at::Tensor& scales, int64_t first, int64_t nb) {
  const float* __restrict s = scales.data_ptr<float>() + first;
  bool neg = false;
  for (int64_t i = 0; i < nb; ++i) neg |= s[i] < 0.0f;
  return neg;
}

// The max |value| of a block's n values (NaN if any).
inline float block_absmax(int64_t n, const float* __restrict buf) {
  int64_t i = 0;
  FVec vmax(0.0f);
  if constexpr (kUseVec) {
    for (; i + FVec::size() <= n; i += FVec::size()) {
      vmax = at::vec::maximum(vmax, FVec::loadu(buf + i).abs());
    }
  }
  float absmax = Lanes<FVec>::max_all(vmax);
  for (; i < n; ++i) absmax = max_propagate_nan(absmax, fabsf(buf[i]));
  return absmax;
}

// Stores the n values of buf (from read_moment) to block b of a bf16 or 8-bit moment (float32
// moments were updated in place). For 8-bit exp_avg_sq (r.sqrt), buf holds sqrt(exp_avg_sq):
// the step keeps the root its denominator takes.
inline void write_moment(const MomentRef& r, int64_t b, int64_t n, const float* __restrict buf) {
  const int64_t o = b * kMomentBlock;
  switch (r.kind) {
    case Kind::kFloat:
      break;
    case Kind::kBFloat16: {
      alignas(64) uint32_t bits[kMomentBlock];  // 32-bit lanes, then narrowed (see the header)
      for (int64_t i = 0; i < n; ++i) bits[i] = float_to_bf16_bits(buf[i]);
      uint16_t* __restrict out = static_cast<uint16_t*>(r.data) + o;
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint16_t>(bits[i]);
      break;
    }
    case Kind::kFp8: {
      int64_t i = 0;
      FVec vmax(0.0f);
      if constexpr (kUseVec) {
        for (; i + FVec::size() <= n; i += FVec::size()) {
          vmax = at::vec::maximum(vmax, FVec::loadu(buf + i).abs());
        }
      }
      float absmax = Lanes<FVec>::max_all(vmax);
      for (; i < n; ++i) absmax = max_propagate_nan(absmax, fabsf(buf[i]));
      const MomentScale s = moment_scale(absmax);
      r.scales[b] = s.scale;
      const float inv = s.inv;
      alignas(64) uint32_t codes[kMomentBlock];  // 32-bit lanes, then narrowed (see the header)
      for (int64_t k = 0; k < n; ++k) codes[k] = fp8_e4m3_encode_bits(buf[k] * inv);
      uint8_t* __restrict out = static_cast<uint8_t*>(r.data) + o;
      for (int64_t k = 0; k < n; ++k) out[k] = static_cast<uint8_t>(codes[k]);
      break;
    }
    case Kind::kDynamic: {
      const float absmax = dynamic_absmax(buf, n, [&] { return block_absmax(n, buf); });
      uint8_t* __restrict out = static_cast<uint8_t*>(r.data) + o;
      if (r.sqrt && absmax > FLT_MAX && absmax == absmax) {  // exp_avg_sq holding +-inf
        float finite_max = 0.0f;
        for (int64_t i = 0; i < n; ++i) {
          const float a = fabsf(buf[i]);
          finite_max = a <= FLT_MAX && a > finite_max ? a : finite_max;
        }
        const DynamicScale s = dynamic_sq_inf_scale(finite_max);
        r.scales[b] = s.scale;
        dynamic_encode_block(buf, n, s.div, dynamic_tables(true), out);
        for (int64_t i = 0; i < n; ++i) {
          out[i] = static_cast<uint8_t>(dynamic_sq_inf_code(buf[i], out[i]));
        }
        break;
      }
      const DynamicScale s = dynamic_scale(absmax);
      r.scales[b] = s.scale;
      dynamic_encode_block(buf, n, s.div, dynamic_tables(r.sqrt), out);
      break;
    }
  }
}

// The vector math of adam_chunk on one block of k <= kMomentBlock float32 values in place (p
// masters, m and v moments; v receives sqrt(v) when v_root), torchao's arithmetic when dynamic
// (a uint8 moment), and the model params written from the new masters when model is not null.
// The block loops below (adam_chunk_narrow, adam_chunk_sr) share it.
template <typename G, typename M>
inline void adam_block(const G* g, float* p, float* m, float* v, M* model, int64_t k,
                       const AdamScalars& s, bool v_root, bool dynamic) {
  constexpr bool kModel = !std::is_same_v<M, NoModel>;
  auto step = [&](const G* gp, float* pp, float* mp, float* vp, M* modelp) {
    FVec g0, g1, p0, p1, m0, m1, v0, v1, r0, r1;
    VecIO<G>::load(gp, g0, g1);
    VecIO<float>::load(pp, p0, p1);
    VecIO<float>::load(mp, m0, m1);
    VecIO<float>::load(vp, v0, v1);
    if (dynamic) {
      adam_element_dynamic<FVec>(p0, m0, v0, g0, s, AdamRuntimeFlags(s));
      adam_element_dynamic<FVec>(p1, m1, v1, g1, s, AdamRuntimeFlags(s));
      if (v_root) {
        r0 = Lanes<FVec>::sqrt(v0);
        r1 = Lanes<FVec>::sqrt(v1);
      }
    } else {
      adam_element<FVec>(p0, m0, v0, g0, s, v_root ? &r0 : nullptr);
      adam_element<FVec>(p1, m1, v1, g1, s, v_root ? &r1 : nullptr);
    }
    VecIO<float>::template store<true, false>(pp, p0, p1);
    VecIO<float>::template store<true, false>(mp, m0, m1);
    if (v_root) {
      VecIO<float>::template store<true, false>(vp, r0, r1);
    } else {
      VecIO<float>::template store<true, false>(vp, v0, v1);
    }
    if constexpr (kModel) {
      if (modelp != nullptr) VecIO<M>::template store<true, false>(modelp, p0, p1);
    }
  };
  int64_t i = 0;
  for (; i + kVecStep <= k; i += kVecStep) {
    step(g + i, p + i, m + i, v + i, model != nullptr ? model + i : nullptr);
  }
  if (i < k) {  // the last block's tail: through zero-padded copies, as adam_chunk
    const int64_t r = k - i;
    Tail<G> tg;
    Tail<float> tp, tm, tv;
    Tail<std::conditional_t<kModel, M, float>> tmodel;
    tg.in(g + i, r);
    tp.in(p + i, r);
    tm.in(m + i, r);
    tv.in(v + i, r);
    M* tmodel_out = nullptr;
    if constexpr (kModel) tmodel_out = model != nullptr ? reinterpret_cast<M*>(tmodel.buf) : nullptr;
    step(tg.buf, tp.buf, tm.buf, tv.buf, tmodel_out);
    tp.out(p + i, r);
    tm.out(m + i, r);
    tv.out(v + i, r);
    if constexpr (kModel) {
      if (model != nullptr) tmodel.out(model + i, r);
    }
  }
}

// adam_chunk for any storage: per block of kMomentBlock elements, the vector math of adam_chunk
// runs on float32 values, read in place (float32 moments and masters) or decoded into L1 buffers
// first (bf16 and 8-bit moments, masters rebuilt from remainders), and the stored values are
// written back in their formats. p: fp32 masters, or null with rem (int16 remainders) and a bf16
// model.
template <typename G, typename M>
void adam_chunk_narrow(const G* g, float* p, int16_t* rem, const MomentRef& mref,
                       const MomentRef& vref, M* model, int64_t n, const AdamScalars& scalars) {
  constexpr bool kModel = !std::is_same_v<M, NoModel>;
  constexpr bool kBf16Model = std::is_same_v<M, at::BFloat16>;
  const AdamScalars s = scalars;
  // 8-bit exp_avg_sq stores sqrt(v): the step hands over the root its denominator takes
  const bool v_root = vref.kind == Kind::kFp8 && vref.sqrt;
  // a uint8 moment: torchao's arithmetic (adam_element_dynamic)
  const bool dynamic = mref.kind == Kind::kDynamic || vref.kind == Kind::kDynamic;
  alignas(64) float pbuf[kMomentBlock];
  alignas(64) float mbuf[kMomentBlock];
  alignas(64) float vbuf[kMomentBlock];
  for (int64_t b = 0; b * kMomentBlock < n; ++b) {
    const int64_t o = b * kMomentBlock;
    const int64_t k = std::min<int64_t>(kMomentBlock, n - o);
    float* mb = read_moment(mref, b, k, mbuf);
    float* vb = read_moment(vref, b, k, vbuf);
    float* pb = p != nullptr ? p + o : pbuf;
    if constexpr (kBf16Model) {
      if (rem != nullptr) {
        const uint16_t* __restrict mp = reinterpret_cast<const uint16_t*>(model + o);
        const int16_t* __restrict rp = rem + o;
        for (int64_t i = 0; i < k; ++i) pbuf[i] = join_remainder(mp[i], rp[i]);
      }
    }
    adam_block<G, M>(g + o, pb, mb, vb, kModel && rem == nullptr ? model + o : nullptr, k, s,
                     v_root, dynamic);
    write_moment(mref, b, k, mb);
    write_moment(vref, b, k, vb);
    if constexpr (kBf16Model) {
      if (rem != nullptr) {
        uint16_t* __restrict mp = reinterpret_cast<uint16_t*>(model + o);
        int16_t* __restrict rp = rem + o;
        for (int64_t j = 0; j < k; ++j) split_remainder(pbuf[j], mp[j], rp[j]);
      }
    }
  }
}

// -- bf16 params with stochastic rounding (docs/spec.md section 21) --------------------------
//
// adam_chunk_narrow's block loop with the bf16 param as the master: per block of kMomentBlock
// elements the param is widened to float32 (exact), the moments read (any storage), the vector
// math of adam_chunk run, the moments written back and the param written with stochastic
// rounding (float_to_bf16_sr_bits, random bits sr_random_bits of each element's global index
// j0 + i). Its own function: the other loops are untouched. On AVX2 and AVX-512, bf16 and
// float32 moments in a chunk with one high index word take adam_chunk_bf16_sr (one loop)
// instead; this loop keeps 8-bit moments, mixed storage, a wrapping low word and the default
// module.
template <typename G>
void adam_chunk_sr(const G* g, uint16_t* param, const MomentRef& mref, const MomentRef& vref,
                   int64_t n, const AdamScalars& scalars, uint64_t stream, uint64_t j0) {
  const AdamScalars s = scalars;
  const bool v_root = vref.kind == Kind::kFp8 && vref.sqrt;
  // a uint8 moment: torchao's arithmetic (adam_element_dynamic), as adam_chunk_narrow
  const bool dynamic = mref.kind == Kind::kDynamic || vref.kind == Kind::kDynamic;
  alignas(64) float pbuf[kMomentBlock];
  alignas(64) float mbuf[kMomentBlock];
  alignas(64) float vbuf[kMomentBlock];
  for (int64_t b = 0; b * kMomentBlock < n; ++b) {
    const int64_t o = b * kMomentBlock;
    const int64_t k = std::min<int64_t>(kMomentBlock, n - o);
    float* mb = read_moment(mref, b, k, mbuf);
    float* vb = read_moment(vref, b, k, vbuf);
    {
      const uint16_t* __restrict in = param + o;
      for (int64_t i = 0; i < k; ++i) pbuf[i] = bf16_to_float(in[i]);
    }
    adam_block<G, NoModel>(g + o, pbuf, mb, vb, nullptr, k, s, v_root, dynamic);
    write_moment(mref, b, k, mb);
    write_moment(vref, b, k, vb);
    // the random bits of j = j0 + o + i: the low word wraps at most once in a block
    const uint64_t jb = j0 + static_cast<uint64_t>(o);
    const uint32_t lo0 = static_cast<uint32_t>(jb);
    const uint32_t salt0 = sr_salt(stream, jb >> 32);
    const uint32_t salt1 = sr_salt(stream, (jb >> 32) + 1);
    alignas(64) uint32_t bits[kMomentBlock];  // 32-bit lanes, then narrowed (see the header)
    for (int64_t q = 0; q < k; ++q) {
      const uint32_t lo = lo0 + static_cast<uint32_t>(q);
      const uint32_t salt = select_bits(lo < lo0, salt1, salt0);
      bits[q] = float_to_bf16_sr_bits(pbuf[q], sr_random_bits(lo, salt));
    }
    uint16_t* __restrict out = param + o;
    for (int64_t q = 0; q < k; ++q) out[q] = static_cast<uint16_t>(bits[q]);
  }
}

// -- bf16 moments (+ remainders) in the one loop of adam_chunk ---------------------------------
//
// bf16 moments need no block scale, so their conversions (and the remainder join/split) are a
// few integer operations per register: done here in one loop over the chunk instead of
// adam_chunk_narrow's decode / update / encode loops over L1 buffers (which made the narrow step
// slower than the fp32-state one although it moves fewer bytes). Each function computes exactly
// what its scalar twin in kernels/optimizer_step.h computes, on every 32-bit lane of a float
// register: bf16_rne_bits = float_to_bf16_bits, the join = join_remainder, the split =
// split_remainder. AVX2 and AVX-512 only; elsewhere adam_chunk_narrow runs.
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
constexpr bool kBf16Pass = true;

// The 32-bit integer lanes of one float register (FVec) and their 16-bit memory.
struct Lanes32 {
#if defined(CPU_CAPABILITY_AVX512)
  using I = __m512i;
  static I bits(const FVec& x) { return _mm512_castps_si512(x); }
  static FVec from_bits(I u) { return FVec(_mm512_castsi512_ps(u)); }
  static I set1(uint32_t c) { return _mm512_set1_epi32(static_cast<int>(c)); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static I shr16(I a) { return _mm512_srli_epi32(a, 16); }
  static I shl16(I a) { return _mm512_slli_epi32(a, 16); }
  // a > b ? x : y per lane (a, b < 2^31)
  static I select_gt(I a, I b, I x, I y) {
    return _mm512_mask_blend_epi32(_mm512_cmpgt_epi32_mask(a, b), y, x);
  }
  // 2 x 16 lanes from 2 x 16 uint16 / int16 (zero- / sign-extended)
  static void load_u16(const uint16_t* p, I& a, I& b) {
    a = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    b = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16)));
  }
  static void load_s16(const int16_t* p, I& a, I& b) {
    a = _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    b = _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16)));
  }
  // the low 16 bits of every lane of a, then b
  static void store16(void* p, I a, I b) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(a));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p) + 1, _mm512_cvtepi32_epi16(b));
  }
#else
  using I = __m256i;
  static I bits(const FVec& x) { return _mm256_castps_si256(x); }
  static FVec from_bits(I u) { return FVec(_mm256_castsi256_ps(u)); }
  static I set1(uint32_t c) { return _mm256_set1_epi32(static_cast<int>(c)); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static I shr16(I a) { return _mm256_srli_epi32(a, 16); }
  static I shl16(I a) { return _mm256_slli_epi32(a, 16); }
  static I select_gt(I a, I b, I x, I y) {
    return _mm256_blendv_epi8(y, x, _mm256_cmpgt_epi32(a, b));
  }
  static void load_u16(const uint16_t* p, I& a, I& b) {
    a = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    b = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  }
  static void load_s16(const int16_t* p, I& a, I& b) {
    a = _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    b = _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  }
  static void store16(void* p, I a, I b) {
    const I low = set1(0xffffu);  // the low halves, so that the unsigned saturation keeps them
    const I packed = _mm256_packus_epi32(and_(a, low), and_(b, low));  // a0-3 b0-3 a4-7 b4-7
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, 0xd8));
  }
#endif
};
static_assert(2 * sizeof(Lanes32::I) / sizeof(float) == kVecStep, "two registers per step");

// float_to_bf16_bits of every lane of x (in the low 16 bits of its lane)
inline __attribute__((always_inline)) Lanes32::I bf16_rne_bits(const FVec& x) {
  using L = Lanes32;
  const L::I u = L::bits(x);
  const L::I high = L::shr16(u);
  const L::I rounded = L::shr16(L::add(L::add(u, L::set1(0x7fffu)), L::and_(high, L::set1(1u))));
  const L::I nan = L::or_(high, L::set1(0x0040u));
  return L::select_gt(L::and_(u, L::set1(0x7fffffffu)), L::set1(0x7f800000u), nan, rounded);
}

// The bf16 stores of the loops below. AVX-512: store16 of bf16_rne_bits (and of at::vec's
// conversion for bf16 model params). AVX2: without a NaN lane (tested once for all the registers
// stored: never a NaN in practice), the rounding is u + 0x7fff + lsb (the result in the high
// half of the lane, as float_to_bf16_bits and at::vec's conversion round a non-NaN x) and the
// store packs the high halves (no select, no masking of the low halves); with one, the
// functions above (the same bits either way).
#if defined(CPU_CAPABILITY_AVX2)
// the high 16 bits of every lane of a, then b, at p (in order)
inline __attribute__((always_inline)) void store_high16(void* p, __m256i a, __m256i b) {
  const __m256i packed = _mm256_packus_epi32(_mm256_srli_epi32(a, 16), _mm256_srli_epi32(b, 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, 0xd8));
}
// float_to_bf16_bits(x) in the high half of every lane of x that is not NaN
inline __attribute__((always_inline)) __m256i bf16_rne_high(const FVec& x) {
  const __m256i u = _mm256_castps_si256(x);
  return _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)),
                          _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)));
}
// all lanes of a mask of _mm256_cmp_ps false
inline __attribute__((always_inline)) bool none_of(__m256 mask) {
  return _mm256_movemask_ps(mask) == 0;
}
#endif

// float_to_bf16_bits of m0, m1 at mp and of v0, v1 at vp (two bf16 moments)
inline __attribute__((always_inline)) void store_moments_bf16(uint16_t* mp, const FVec& m0,
                                                              const FVec& m1, uint16_t* vp,
                                                              const FVec& v0, const FVec& v1) {
#if defined(CPU_CAPABILITY_AVX2)
  if (__builtin_expect(none_of(_mm256_or_ps(_mm256_cmp_ps(m0, m1, _CMP_UNORD_Q),
                                            _mm256_cmp_ps(v0, v1, _CMP_UNORD_Q))),
                       1)) {
    store_high16(mp, bf16_rne_high(m0), bf16_rne_high(m1));
    store_high16(vp, bf16_rne_high(v0), bf16_rne_high(v1));
    return;
  }
#endif
  Lanes32::store16(mp, bf16_rne_bits(m0), bf16_rne_bits(m1));
  Lanes32::store16(vp, bf16_rne_bits(v0), bf16_rne_bits(v1));
}

// VecIO<M>::store of p0, p1 to model params
template <typename M>
inline __attribute__((always_inline)) void store_model(M* modelp, FVec& p0, FVec& p1) {
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<M, at::BFloat16>) {
    if (__builtin_expect(none_of(_mm256_cmp_ps(p0, p1, _CMP_UNORD_Q)), 1)) {
      store_high16(modelp, bf16_rne_high(p0), bf16_rne_high(p1));
      return;
    }
  }
#endif
  VecIO<M>::template store<true, false>(modelp, p0, p1);
}

// the remainders (low halves) of u0, u1 at rp and the bf16 params (u + 0x8000) >> 16 at modelp
// (split_remainder of every lane)
inline __attribute__((always_inline)) void store_split(int16_t* rp, void* modelp, Lanes32::I u0,
                                                       Lanes32::I u1) {
  using L = Lanes32;
  const L::I half = L::set1(0x8000u);
  L::store16(rp, u0, u1);
#if defined(CPU_CAPABILITY_AVX2)
  store_high16(modelp, L::add(u0, half), L::add(u1, half));
#else
  L::store16(modelp, L::shr16(L::add(u0, half)), L::shr16(L::add(u1, half)));
#endif
}

// The grads whose all-16-bit loops run in the unpacked lane order on AVX2 (adam_chunk_unpacked,
// defined with its reasons below the stochastic rounding's loop)
#if defined(CPU_CAPABILITY_AVX2)
template <typename G>
constexpr bool kUnpackedGrads = std::is_same_v<G, float> || std::is_same_v<G, at::BFloat16>;
#else
template <typename G>
constexpr bool kUnpackedGrads = false;
#endif
template <typename G, typename P, typename Flags>
inline __attribute__((always_inline)) void adam_chunk_unpacked(
    const G* __restrict g, P* __restrict param, uint16_t* __restrict m, uint16_t* __restrict v,
    at::BFloat16* __restrict model, int64_t n, const AdamScalars& scalars, Flags flags,
    uint32_t lo0 = 0, uint32_t salt = 0);

// The update of one chunk with bf16 moments m, v (bits) and either fp32 masters p (kRem false)
// or bf16 model params with int16 remainders rem (kRem true, M = at::BFloat16).
template <typename G, typename M, typename Flags, bool kRem>
__attribute__((noinline)) void adam_chunk_bf16(const G* __restrict g, float* __restrict p,
                                               int16_t* __restrict rem, uint16_t* __restrict m,
                                               uint16_t* __restrict v, M* __restrict model,
                                               int64_t n, const AdamScalars& scalars,
                                               Flags flags) {
  using L = Lanes32;
  constexpr bool kModel = !std::is_same_v<M, NoModel>;
  static_assert(!kRem || std::is_same_v<M, at::BFloat16>, "remainders go with bf16 params");
  if constexpr (kUnpackedGrads<G> && std::is_same_v<M, at::BFloat16>) {
    if constexpr (kRem) {
      return adam_chunk_unpacked(g, rem, m, v, model, n, scalars, flags);
    } else {
      return adam_chunk_unpacked(g, p, m, v, model, n, scalars, flags);
    }
  }
  const AdamScalars s = scalars;  // in registers (see adam_chunk)
  auto step = [&](const G* gp, float* pp, int16_t* rp, uint16_t* mp, uint16_t* vp, M* modelp) {
    FVec g0, g1, p0, p1, m0, m1, v0, v1;
    L::I a, b;
    VecIO<G>::load(gp, g0, g1);
    if constexpr (kRem) {
      L::I ra, rb;
      L::load_u16(reinterpret_cast<const uint16_t*>(modelp), a, b);
      L::load_s16(rp, ra, rb);
      p0 = L::from_bits(L::add(L::shl16(a), ra));
      p1 = L::from_bits(L::add(L::shl16(b), rb));
    } else {
      VecIO<float>::load(pp, p0, p1);
    }
    L::load_u16(mp, a, b);
    m0 = L::from_bits(L::shl16(a));
    m1 = L::from_bits(L::shl16(b));
    L::load_u16(vp, a, b);
    v0 = L::from_bits(L::shl16(a));
    v1 = L::from_bits(L::shl16(b));
    adam_element_flags<FVec>(p0, m0, v0, g0, s, flags);
    adam_element_flags<FVec>(p1, m1, v1, g1, s, flags);
    store_moments_bf16(mp, m0, m1, vp, v0, v1);
    if constexpr (kRem) {
      store_split(rp, modelp, L::bits(p0), L::bits(p1));
    } else {
      VecIO<float>::template store<true, false>(pp, p0, p1);
      if constexpr (kModel) store_model(modelp, p0, p1);
    }
  };
  int64_t i = 0;
  for (; i + kVecStep <= n; i += kVecStep) {
    step(g + i, kRem ? nullptr : p + i, kRem ? rem + i : nullptr, m + i, v + i,
         kModel ? model + i : nullptr);
  }
  if (i < n) {  // through zero-padded copies, as adam_chunk
    const int64_t r = n - i;
    step_tail<kRem>(g, p, rem, model, i, r, [&](const G* tg, float* tp, int16_t* trem, M* tmodel) {
      Tail<uint16_t> tm, tv;
      tm.in(m + i, r);
      tv.in(v + i, r);
      step(tg, tp, trem, tm.buf, tv.buf, tmodel);
      tm.out(m + i, r);
      tv.out(v + i, r);
    });
  }
}
#else
constexpr bool kBf16Pass = false;
// declared for the call in fused_adam_step_, which discards it here (if constexpr)
template <typename G, typename M, typename Flags, bool kRem>
void adam_chunk_bf16(const G* g, float* p, int16_t* rem, uint16_t* m, uint16_t* v, M* model,
                     int64_t n, const AdamScalars& scalars, Flags flags);
#endif

// -- uint8 moments (+ remainders) in one loop per block (AVX-512, AVX2) ------------------------
//
// adam_chunk_narrow with both moments in the uint8 format, fused: per block of kMomentBlock
// elements, one loop over 32 elements at a time decodes both moments into registers
// (DynamicDecoder; AVX-512 with VBMI: adam_chunk_dynamic_vbmi, 64 codes a round), runs
// adam_element_dynamic, writes the params (fp32 masters and model params,
// or bf16 params + remainders split in registers as adam_chunk_bf16) and the new moments into
// L1 buffers, and keeps the running max of |m| and |v| bits (dynamic_absmax's order); then each
// moment's scale and its encode (dynamic_encode_block) from the buffer. A block whose moment
// holds NaN takes write_moment (its scale keeps the NaN bits dynamic_absmax's nan_path gives).
// The bits of adam_chunk_narrow: the same functions per element, only fewer passes over L1.
// AVX2: the same loop on 16 elements a step, the decode by scalar table loads (see below).
#if defined(CPU_CAPABILITY_AVX512)
constexpr bool kDynamicPass = true;

// How far ahead (elements) the uint8 loops ask for the lines of the grad, the params (or
// remainders) and the model params (every step of 32), and of the codes of both moments (every
// round of 64), on top of the hardware prefetchers. Measured on the 2-core Zen 5 (AVX-512
// module, one thread, fp32 grads, alternating processes; one block ahead instead of two gained
// less): see docs/benchmarks.md.
constexpr int64_t kDynamicPrefetchAhead = 2 * kMomentBlock;
constexpr int64_t kDynamicCodesAhead = 4 * kMomentBlock;

// One step of 32 elements of the loops below on decoded moments (m0, m1, v0, v1: map[c] *
// scale): read the params (remainders: joined with the bf16 params), update them and the
// moments (adam_element_dynamic), store the new moments in the block buffers mo / vo, fold their
// |bits| into the running maxima over the live lanes, store the params. `ps` (when kSave) keeps
// the params read; p0 / p1 come back as the new params. Inlined into adam_chunk_dynamic_words
// and, compiled with VBMI allowed, into adam_chunk_dynamic_vbmi.
template <typename G, typename M, typename Flags, bool kRem, bool kSave>
inline __attribute__((always_inline)) void dynamic_step32(
    const G* gp, float* pp, int16_t* rp, M* modelp, __m512 m0, __m512 m1, __m512 v0,
    __m512 v1, float* mo, float* vo, float* ps, __mmask32 live, const AdamScalars& s,
    Flags flags, __m512i& mmax, __m512i& vmax, FVec& p0, FVec& p1) {
  using L = Lanes32;
  constexpr bool kModel = !std::is_same_v<M, NoModel>;
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  // two blocks ahead (kDynamicPrefetchAhead); the model params, written only, for writing
  prefetch_step<G, kDynamicPrefetchAhead>(gp);
  if constexpr (kRem) {
    prefetch_step<int16_t, kDynamicPrefetchAhead>(rp);
    prefetch_step<M, kDynamicPrefetchAhead>(modelp);
  } else {
    prefetch_step<float, kDynamicPrefetchAhead>(pp);
    if constexpr (kModel) prefetch_step<M, kDynamicPrefetchAhead, 1>(modelp);
  }
  FVec g0, g1;
  VecIO<G>::load(gp, g0, g1);
  if constexpr (kRem) {
    L::I a, c, ra, rb;
    L::load_u16(reinterpret_cast<const uint16_t*>(modelp), a, c);
    L::load_s16(rp, ra, rb);
    p0 = L::from_bits(L::add(L::shl16(a), ra));
    p1 = L::from_bits(L::add(L::shl16(c), rb));
  } else {
    VecIO<float>::load(pp, p0, p1);
  }
  if constexpr (kSave) {
    _mm512_store_ps(ps, p0);
    _mm512_store_ps(ps + 16, p1);
  }
  dynamic_update2(p0, p1, m0, m1, v0, v1, g0, g1, s, flags);
  _mm512_store_ps(mo, m0);
  _mm512_store_ps(mo + 16, m1);
  _mm512_store_ps(vo, v0);
  _mm512_store_ps(vo + 16, v1);
  const __mmask16 live0 = static_cast<__mmask16>(live);
  const __mmask16 live1 = static_cast<__mmask16>(live >> 16);
  mmax = _mm512_mask_max_epi32(mmax, live0, mmax,
                               _mm512_and_si512(_mm512_castps_si512(m0), abs_mask));
  mmax = _mm512_mask_max_epi32(mmax, live1, mmax,
                               _mm512_and_si512(_mm512_castps_si512(m1), abs_mask));
  vmax = _mm512_mask_max_epi32(vmax, live0, vmax,
                               _mm512_and_si512(_mm512_castps_si512(v0), abs_mask));
  vmax = _mm512_mask_max_epi32(vmax, live1, vmax,
                               _mm512_and_si512(_mm512_castps_si512(v1), abs_mask));
  if constexpr (kRem) {
    const L::I u0 = L::bits(p0), u1 = L::bits(p1);
    const L::I half = L::set1(0x8000u);
    L::store16(rp, u0, u1);
    L::store16(modelp, L::shr16(L::add(u0, half)), L::shr16(L::add(u1, half)));
  } else {
    VecIO<float>::template store<true, false>(pp, p0, p1);
    if constexpr (kModel) VecIO<M>::template store<true, false>(modelp, p0, p1);
  }
}

// The loop described above, with the decode of DynamicDecoder (word permutes; any AVX-512 CPU).
template <typename G, typename M, typename Flags, bool kRem, bool kLerp2Small>
__attribute__((noinline)) void adam_chunk_dynamic_words(
    const G* __restrict g, float* __restrict p, int16_t* __restrict rem, const MomentRef& mref,
    const MomentRef& vref, M* __restrict model, int64_t n, const AdamScalars& scalars,
    Flags flags) {
  constexpr bool kModel = !std::is_same_v<M, NoModel>;
  static_assert(!kRem || std::is_same_v<M, at::BFloat16>, "remainders go with bf16 params");
  static_assert(kVecStep == 32, "32 elements a step (two registers of 16)");
  AdamScalars s = scalars;  // in registers (see adam_chunk)
  s.lerp2_small = kLerp2Small;  // a constant (see adam_chunk_dynamic)
  const DynamicTables& mt = dynamic_tables(false);
  const DynamicTables& vt = dynamic_tables(true);
  const DynamicDecoder mdec(mt), vdec(vt);
  uint8_t* const mcodes = static_cast<uint8_t*>(mref.data);
  uint8_t* const vcodes = static_cast<uint8_t*>(vref.data);
  alignas(64) float mbuf[kMomentBlock];
  alignas(64) float vbuf[kMomentBlock];
  for (int64_t b = 0; b * kMomentBlock < n; ++b) {
    const int64_t o = b * kMomentBlock;
    const int64_t k = std::min<int64_t>(kMomentBlock, n - o);
    const __m512 mscale = _mm512_set1_ps(mref.scales[b]);
    const __m512 vscale = _mm512_set1_ps(vref.scales[b]);
    __m512i mmax = _mm512_setzero_si512(), vmax = _mm512_setzero_si512();
    // one step of 32 elements; live: the lanes of the block (the tail's padding lanes are
    // computed but neither stored nor counted in the maxima)
    auto step = [&](const G* gp, float* pp, int16_t* rp, M* modelp, __m512i mc, __m512i vc,
                    float* mo, float* vo, __mmask32 live) {
      __m512 m0, m1, v0, v1;
      mdec.decode32(mc, mscale, m0, m1);
      vdec.decode32(vc, vscale, v0, v1);
      FVec p0, p1;
      dynamic_step32<G, M, Flags, kRem, false>(gp, pp, rp, modelp, m0, m1, v0, v1, mo, vo,
                                               nullptr, live, s, flags, mmax, vmax, p0, p1);
    };
    auto codes = [](const uint8_t* c, __mmask32 live) {
      return _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(live, c));
    };
    int64_t i = 0;
    for (; i + kVecStep <= k; i += kVecStep) {
      const int64_t j = o + i;
      __builtin_prefetch(mcodes + j + kDynamicCodesAhead, 0, 3);
      __builtin_prefetch(vcodes + j + kDynamicCodesAhead, 0, 3);
      step(g + j, kRem ? nullptr : p + j, kRem ? rem + j : nullptr,
           kModel ? model + j : nullptr, codes(mcodes + j, ~__mmask32(0)),
           codes(vcodes + j, ~__mmask32(0)), mbuf + i, vbuf + i, ~__mmask32(0));
    }
    if (i < k) {  // the last block's tail: through zero-padded copies, as adam_chunk
      const int64_t r = k - i;
      const int64_t j = o + i;
      const __mmask32 live = static_cast<__mmask32>((1u << r) - 1u);
      step_tail<kRem>(g, p, rem, model, j, r,
                         [&](const G* tg, float* tp, int16_t* trem, M* tmodel) {
                           step(tg, tp, trem, tmodel, codes(mcodes + j, live),
                                codes(vcodes + j, live), mbuf + i, vbuf + i, live);
                         });
    }
    // the scales and codes (write_moment's, with the maxima found above; both moments'
    // encodes in one loop where neither holds NaN, dynamic_encode_block2)
    const uint32_t mmx = static_cast<uint32_t>(_mm512_reduce_max_epi32(mmax));
    const uint32_t vmx = static_cast<uint32_t>(_mm512_reduce_max_epi32(vmax));
    auto finish = [&](const MomentRef& ref, uint32_t mx, const DynamicTables& t, const float* buf,
                      uint8_t* out) {
      // NaN, or exp_avg_sq holding inf: write_moment's paths
      if (mx > 0x7f800000u || (ref.sqrt && mx == 0x7f800000u)) {
        write_moment(ref, b, k, buf);
        return;
      }
      const DynamicScale sc = dynamic_scale(bits_to_float(mx));
      ref.scales[b] = sc.scale;
      dynamic_encode_block(buf, k, sc.div, t, out + o);
    };
    if (mmx > 0x7f800000u || vmx >= 0x7f800000u) {
      finish(mref, mmx, mt, mbuf, mcodes);
      finish(vref, vmx, vt, vbuf, vcodes);
    } else {
      const DynamicScale ms = dynamic_scale(bits_to_float(mmx));
      mref.scales[b] = ms.scale;
      const DynamicScale vsc = dynamic_scale(bits_to_float(vmx));
      vref.scales[b] = vsc.scale;
      dynamic_encode_block2(mbuf, ms.div, mcodes + o, vbuf, vsc.div, vcodes + o, k);
    }
  }
}

// adam_chunk_dynamic_words with the decode of DynamicDecoderVbmi (64 codes of each moment a
// round, then two of its steps of 32 elements), compiled for VBMI: adam_chunk_dynamic calls it
// when dynamic_vbmi_enabled(). The same operations per element, but compiled in another
// function: where two NaN operands meet, g++ may have put them in the other order (x86 returns
// the first operand's NaN), so a NaN's sign, and so the code of a NaN block, could differ. A
// block whose params or moments come out NaN is therefore done again by
// adam_chunk_dynamic_words from its saved inputs (codes and scales are written last): every
// bit is adam_chunk_dynamic_words'.
#pragma GCC push_options
#pragma GCC target("avx512vbmi")
template <typename G, typename M, typename Flags, bool kRem, bool kLerp2Small>
__attribute__((noinline)) void adam_chunk_dynamic_vbmi(
    const G* __restrict g, float* __restrict p, int16_t* __restrict rem, const MomentRef& mref,
    const MomentRef& vref, M* __restrict model, int64_t n, const AdamScalars& scalars,
    Flags flags) {
  constexpr bool kModel = !std::is_same_v<M, NoModel>;
  static_assert(!kRem || std::is_same_v<M, at::BFloat16>, "remainders go with bf16 params");
  static_assert(kVecStep == 32, "32 elements a step (two registers of 16)");
  static_assert(kMomentBlock % 64 == 0, "whole rounds of 64 in a full block");
  AdamScalars s = scalars;  // in registers (see adam_chunk)
  s.lerp2_small = kLerp2Small;  // a constant (see adam_chunk_dynamic)
  const DynamicTables& mt = dynamic_tables(false);
  const DynamicTables& vt = dynamic_tables(true);
  const DynamicDecoderVbmi mdec(mt), vdec(vt);
  uint8_t* const mcodes = static_cast<uint8_t*>(mref.data);
  uint8_t* const vcodes = static_cast<uint8_t*>(vref.data);
  alignas(64) float mbuf[kMomentBlock];
  alignas(64) float vbuf[kMomentBlock];
  alignas(64) float psave[kMomentBlock];  // the params read (remainders: joined)
  for (int64_t b = 0; b * kMomentBlock < n; ++b) {
    const int64_t o = b * kMomentBlock;
    const int64_t k = std::min<int64_t>(kMomentBlock, n - o);
    const __m512 mscale = _mm512_set1_ps(mref.scales[b]);
    const __m512 vscale = _mm512_set1_ps(vref.scales[b]);
    __m512i mmax = _mm512_setzero_si512(), vmax = _mm512_setzero_si512();
    __mmask16 pnan = 0;  // lanes where a new param is NaN (or the padding's)
    // adam_chunk_dynamic_words' step on decoded moments, the params read kept in `ps` (for
    // adam_chunk_dynamic_words, see above) and a NaN among the new ones noted
    auto step = [&](const G* gp, float* pp, int16_t* rp, M* modelp, __m512 m0, __m512 m1,
                    __m512 v0, __m512 v1, float* mo, float* vo, float* ps, __mmask32 live) {
      FVec p0, p1;
      dynamic_step32<G, M, Flags, kRem, true>(gp, pp, rp, modelp, m0, m1, v0, v1, mo, vo, ps,
                                              live, s, flags, mmax, vmax, p0, p1);
      pnan |= _mm512_cmp_ps_mask(p0, p1, _CMP_UNORD_Q);
    };
    // the step of the 32 elements at block offset i, all in the block
    auto full = [&](int64_t i, const __m512* md, const __m512* vd) {
      const int64_t j = o + i;
      step(g + j, kRem ? nullptr : p + j, kRem ? rem + j : nullptr,
           kModel ? model + j : nullptr, md[0], md[1], vd[0], vd[1], mbuf + i, vbuf + i,
           psave + i, ~__mmask32(0));
    };
    int64_t i = 0;
    for (; i + 64 <= k; i += 64) {
      __m512 md[4], vd[4];
      __builtin_prefetch(mcodes + o + i + kDynamicCodesAhead, 0, 3);
      __builtin_prefetch(vcodes + o + i + kDynamicCodesAhead, 0, 3);
      mdec.decode64(_mm512_loadu_si512(mcodes + o + i), mscale, md);
      vdec.decode64(_mm512_loadu_si512(vcodes + o + i), vscale, vd);
      full(i, md, vd);
      full(i + 32, md + 2, vd + 2);
    }
    if (i < k) {  // the last block's tail: whole steps, then zero-padded copies, as adam_chunk
      const int64_t r = k - i;  // < 64
      const __mmask64 codes_live = (uint64_t{1} << r) - 1u;
      __m512 md[4], vd[4];
      mdec.decode64(_mm512_maskz_loadu_epi8(codes_live, mcodes + o + i), mscale, md);
      vdec.decode64(_mm512_maskz_loadu_epi8(codes_live, vcodes + o + i), vscale, vd);
      int h = 0;
      if (r >= 32) {
        full(i, md, vd);
        i += 32;
        h = 2;
      }
      if (i < k) {
        const int64_t rr = k - i;
        const int64_t j = o + i;
        const __mmask32 live = static_cast<__mmask32>((1u << rr) - 1u);
        step_tail<kRem>(g, p, rem, model, j, rr,
                           [&](const G* tg, float* tp, int16_t* trem, M* tmodel) {
                             step(tg, tp, trem, tmodel, md[h], md[h + 1], vd[h], vd[h + 1],
                                  mbuf + i, vbuf + i, psave + i, live);
                           });
      }
    }
    const uint32_t mmx = static_cast<uint32_t>(_mm512_reduce_max_epi32(mmax));
    const uint32_t vmx = static_cast<uint32_t>(_mm512_reduce_max_epi32(vmax));
    // a NaN (see above), or exp_avg_sq holding inf (write_moment's path, through the loop above)
    if (pnan != 0 || mmx > 0x7f800000u || vmx >= 0x7f800000u) {
      // the params back as they were (remainders: split_remainder of the joined bits, the
      // model param and remainder they were joined from)
      for (int64_t q = 0; q < k; ++q) {
        if constexpr (kRem) {
          const uint32_t u = float_to_bits(psave[q]);
          rem[o + q] = static_cast<int16_t>(static_cast<uint16_t>(u & 0xffffu));
          reinterpret_cast<uint16_t*>(model)[o + q] = static_cast<uint16_t>((u + 0x8000u) >> 16);
        } else {
          p[o + q] = psave[q];
        }
      }
      const MomentRef mb{mref.kind, mcodes + o, mref.scales + b, mref.sqrt};
      const MomentRef vb{vref.kind, vcodes + o, vref.scales + b, vref.sqrt};
      adam_chunk_dynamic_words<G, M, Flags, kRem, kLerp2Small>(
          g + o, kRem ? nullptr : p + o, kRem ? rem + o : nullptr, mb, vb,
          kModel ? model + o : nullptr, k, scalars, flags);
      continue;
    }
    // the scales and codes (write_moment's, with the maxima found above; none is NaN), both
    // moments' encodes in one loop (dynamic_encode_block2)
    const DynamicScale ms = dynamic_scale(bits_to_float(mmx));
    mref.scales[b] = ms.scale;
    const DynamicScale vsc = dynamic_scale(bits_to_float(vmx));
    vref.scales[b] = vsc.scale;
    dynamic_encode_block2(mbuf, ms.div, mcodes + o, vbuf, vsc.div, vcodes + o, k);
  }
}
#pragma GCC pop_options

template <typename G, typename M, typename Flags, bool kRem>
void adam_chunk_dynamic(const G* g, float* p, int16_t* rem, const MomentRef& mref,
                        const MomentRef& vref, M* model, int64_t n, const AdamScalars& scalars,
                        Flags flags) {
  // instantiated per scalars.lerp2_small: read at run time, g++ selected between exp_avg_sq and
  // g * g through the stack in every step (as in the AVX2 loop below)
  const bool vbmi = dynamic_vbmi_enabled();
  if (scalars.lerp2_small) {
    if (vbmi) {
      adam_chunk_dynamic_vbmi<G, M, Flags, kRem, true>(g, p, rem, mref, vref, model, n, scalars,
                                                       flags);
    } else {
      adam_chunk_dynamic_words<G, M, Flags, kRem, true>(g, p, rem, mref, vref, model, n,
                                                        scalars, flags);
    }
  } else if (vbmi) {
    adam_chunk_dynamic_vbmi<G, M, Flags, kRem, false>(g, p, rem, mref, vref, model, n, scalars,
                                                      flags);
  } else {
    adam_chunk_dynamic_words<G, M, Flags, kRem, false>(g, p, rem, mref, vref, model, n, scalars,
                                                       flags);
  }
}
#elif defined(CPU_CAPABILITY_AVX2)
constexpr bool kDynamicPass = true;

// map[c] * scale of 16 codes at c: codes 0-7 in a, 8-15 in b (scalar table loads into the
// lanes; the products are dynamic_decode_block's). Measured against decoding each block into
// the L1 buffers first (dynamic_decode_block) and loading them in the loop: 4M-element kernel
// 5.35 against 5.95 ms (u8), thread time on the Zen 5 (u8+rem 6.05 against 5.90 ms, but that
// with the step below still out of line).
inline __attribute__((always_inline)) void dynamic_decode16(const uint8_t* c, const float* map,
                                                            __m256 scale, __m256& a,
                                                            __m256& b) {
  a = _mm256_mul_ps(_mm256_setr_ps(map[c[0]], map[c[1]], map[c[2]], map[c[3]], map[c[4]],
                                   map[c[5]], map[c[6]], map[c[7]]),
                    scale);
  b = _mm256_mul_ps(_mm256_setr_ps(map[c[8]], map[c[9]], map[c[10]], map[c[11]], map[c[12]],
                                   map[c[13]], map[c[14]], map[c[15]]),
                    scale);
}

// The AVX2 twin of the AVX-512 adam_chunk_dynamic above (16 elements a step in two registers of
// 8; the decode by scalar table loads into the lanes, dynamic_decode16; the tail's codes
// through a zero-padded copy, its padding lanes left out of the maxima by a lane mask).
// Instantiated per scalars.lerp2_small (kLerp2Small; adam_chunk_dynamic picks): read at run time,
// g++ selected between exp_avg_sq and g * g through the stack in every step.
// Measured on the Zen 5 (u8, 4M elements, one thread; the kernel takes 1.25 ns per element in
// and out of cache: compute-bound; the loop below ~55%, the two encodes ~45%, their divisions
// ~8%), each against this loop in alternating processes, none kept: prefetch_step of the grad
// and params and the next block's codes, about 1.00x; the decode by integer moves (map bits
// through a general register) into L1 buffers a block ahead, 1.14-1.19x; the encode of one
// block interleaved into the 16 steps of the next (a 32-value round per step), 1.05x, and with
// the reciprocal and a piece-start guard instead of the division, 0.99x; the decode by
// broadcasts and blends, 1.02x; the decode one step ahead (the next step's moments carried in
// registers), 1.02x; g++'s -fschedule-insns -fsched-pressure on this function, 1.00x.
template <typename G, typename M, typename Flags, bool kRem, bool kLerp2Small>
__attribute__((noinline)) void adam_chunk_dynamic_avx2(
    const G* __restrict g, float* __restrict p, int16_t* __restrict rem, const MomentRef& mref,
    const MomentRef& vref, M* __restrict model, int64_t n, const AdamScalars& scalars,
    Flags flags) {
  using L = Lanes32;
  constexpr bool kModel = !std::is_same_v<M, NoModel>;
  static_assert(!kRem || std::is_same_v<M, at::BFloat16>, "remainders go with bf16 params");
  static_assert(kVecStep == 16, "16 elements a step (two registers of 8)");
  AdamScalars s = scalars;  // in registers (see adam_chunk)
  s.lerp2_small = kLerp2Small;
  const DynamicTables& mt = dynamic_tables(false);
  const DynamicTables& vt = dynamic_tables(true);
  const float* const mmap = mt.decode;
  const float* const vmap = vt.decode;
  uint8_t* const mcodes = static_cast<uint8_t*>(mref.data);
  uint8_t* const vcodes = static_cast<uint8_t*>(vref.data);
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  alignas(64) float mbuf[kMomentBlock];
  alignas(64) float vbuf[kMomentBlock];
  for (int64_t b = 0; b * kMomentBlock < n; ++b) {
    const int64_t o = b * kMomentBlock;
    const int64_t k = std::min<int64_t>(kMomentBlock, n - o);
    const __m256 mscale = _mm256_set1_ps(mref.scales[b]);
    const __m256 vscale = _mm256_set1_ps(vref.scales[b]);
    __m256i mmax = _mm256_setzero_si256(), vmax = _mm256_setzero_si256();
    // one step of 16 elements; live0, live1: abs_mask on the lanes of the block, 0 on the
    // tail's padding lanes (computed but neither stored nor counted in the maxima)
    // (inlined: g++ kept the remainder instances' step out of line, a call per 16 elements)
    auto step = [&](const G* gp, float* pp, int16_t* rp, M* modelp, const uint8_t* mc,
                    const uint8_t* vc, float* mo, float* vo, __m256i live0,
                    __m256i live1) __attribute__((always_inline)) {
      FVec g0, g1, p0, p1;
      __m256 m0, m1, v0, v1;
      if constexpr (std::is_same_v<G, at::BFloat16>) {  // widened exactly, in integer lanes
        L::I a, c;
        L::load_u16(reinterpret_cast<const uint16_t*>(gp), a, c);
        g0 = L::from_bits(L::shl16(a));
        g1 = L::from_bits(L::shl16(c));
      } else {
        VecIO<G>::load(gp, g0, g1);
      }
      if constexpr (kRem) {
        L::I a, c, ra, rb;
        L::load_u16(reinterpret_cast<const uint16_t*>(modelp), a, c);
        L::load_s16(rp, ra, rb);
        p0 = L::from_bits(L::add(L::shl16(a), ra));
        p1 = L::from_bits(L::add(L::shl16(c), rb));
      } else {
        VecIO<float>::load(pp, p0, p1);
      }
      dynamic_decode16(mc, mmap, mscale, m0, m1);
      dynamic_decode16(vc, vmap, vscale, v0, v1);
      dynamic_update2(p0, p1, m0, m1, v0, v1, g0, g1, s, flags);
      _mm256_store_ps(mo, m0);
      _mm256_store_ps(mo + 8, m1);
      _mm256_store_ps(vo, v0);
      _mm256_store_ps(vo + 8, v1);
      mmax = _mm256_max_epi32(mmax, _mm256_and_si256(_mm256_castps_si256(m0), live0));
      mmax = _mm256_max_epi32(mmax, _mm256_and_si256(_mm256_castps_si256(m1), live1));
      vmax = _mm256_max_epi32(vmax, _mm256_and_si256(_mm256_castps_si256(v0), live0));
      vmax = _mm256_max_epi32(vmax, _mm256_and_si256(_mm256_castps_si256(v1), live1));
      if constexpr (kRem) {
        store_split(rp, modelp, L::bits(p0), L::bits(p1));
      } else {
        VecIO<float>::template store<true, false>(pp, p0, p1);
        if constexpr (kModel) store_model(modelp, p0, p1);
      }
    };
    int64_t i = 0;
    for (; i + kVecStep <= k; i += kVecStep) {
      const int64_t j = o + i;
      step(g + j, kRem ? nullptr : p + j, kRem ? rem + j : nullptr,
           kModel ? model + j : nullptr, mcodes + j, vcodes + j, mbuf + i, vbuf + i, abs_mask,
           abs_mask);
    }
    if (i < k) {  // the last block's tail: through zero-padded copies, as adam_chunk
      const int64_t r = k - i;
      const int64_t j = o + i;
      const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      const __m256i live0 =
          _mm256_and_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(r)), iota),
                           abs_mask);
      const __m256i live1 = _mm256_and_si256(
          _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(r) - 8), iota), abs_mask);
      Tail<uint8_t> tmc, tvc;
      tmc.in(mcodes + j, r);
      tvc.in(vcodes + j, r);
      step_tail<kRem>(g, p, rem, model, j, r,
                         [&](const G* tg, float* tp, int16_t* trem, M* tmodel) {
                           step(tg, tp, trem, tmodel, tmc.buf, tvc.buf, mbuf + i, vbuf + i, live0,
                                live1);
                         });
    }
    // the scales and codes (write_moment's, with the maxima found above)
    auto finish = [&](const MomentRef& ref, __m256i vm, const DynamicTables& t, const float* buf,
                      uint8_t* out) {
      __m128i h = _mm_max_epi32(_mm256_castsi256_si128(vm), _mm256_extracti128_si256(vm, 1));
      h = _mm_max_epi32(h, _mm_shuffle_epi32(h, 0x4e));
      h = _mm_max_epi32(h, _mm_shuffle_epi32(h, 0xb1));
      const uint32_t mx = static_cast<uint32_t>(_mm_cvtsi128_si32(h));
      // NaN, or exp_avg_sq holding inf: write_moment's paths
      if (mx > 0x7f800000u || (ref.sqrt && mx == 0x7f800000u)) {
        write_moment(ref, b, k, buf);
        return;
      }
      const DynamicScale sc = dynamic_scale(bits_to_float(mx));
      ref.scales[b] = sc.scale;
      dynamic_encode_block(buf, k, sc.div, t, out + o);
    };
    finish(mref, mmax, mt, mbuf, mcodes);
    finish(vref, vmax, vt, vbuf, vcodes);
  }
}

template <typename G, typename M, typename Flags, bool kRem>
void adam_chunk_dynamic(const G* g, float* p, int16_t* rem, const MomentRef& mref,
                        const MomentRef& vref, M* model, int64_t n, const AdamScalars& scalars,
                        Flags flags) {
  if (scalars.lerp2_small) {
    adam_chunk_dynamic_avx2<G, M, Flags, kRem, true>(g, p, rem, mref, vref, model, n, scalars,
                                                     flags);
  } else {
    adam_chunk_dynamic_avx2<G, M, Flags, kRem, false>(g, p, rem, mref, vref, model, n, scalars,
                                                      flags);
  }
}
#else
constexpr bool kDynamicPass = false;
// declared for the call in fused_adam_step_, which discards it here (if constexpr)
template <typename G, typename M, typename Flags, bool kRem>
void adam_chunk_dynamic(const G* g, float* p, int16_t* rem, const MomentRef& mref,
                        const MomentRef& vref, M* model, int64_t n, const AdamScalars& scalars,
                        Flags flags);
#endif

// -- bf16 moments + bf16 params with stochastic rounding in one loop (docs/spec.md section 21) ---
//
// As adam_chunk_bf16 with remainders, but the param is the master (widened exactly) and is
// written back with float_to_bf16_sr_bits; the random bits sr_random_bits of lanes whose
// global index has one high word (the caller takes adam_chunk_sr for a chunk whose low index
// word wraps). Integer lane math of the header's scalar functions, lane for lane.
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
struct SrLanes {
#if defined(CPU_CAPABILITY_AVX512)
  using I = __m512i;
  static constexpr int kLanes = 16;
  static I xor_(I a, I b) { return _mm512_xor_si512(a, b); }
  static I mul(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I shr15(I a) { return _mm512_srli_epi32(a, 15); }
  static I iota() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
#else
  using I = __m256i;
  static constexpr int kLanes = 8;
  static I xor_(I a, I b) { return _mm256_xor_si256(a, b); }
  static I mul(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I shr15(I a) { return _mm256_srli_epi32(a, 15); }
  static I iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
#endif
};

// sr_random_bits(lo, salt) of every lane (lo: the lanes' low index words)
inline __attribute__((always_inline)) Lanes32::I sr_bits_lanes(Lanes32::I lo, Lanes32::I salt) {
  using L = Lanes32;
  using S = SrLanes;
  L::I x = S::xor_(lo, salt);
  x = S::xor_(x, L::shr16(x));
  x = S::mul(x, L::set1(0x7feb352du));
  x = S::xor_(x, S::shr15(x));
  x = S::mul(x, L::set1(0x846ca68bu));
#if defined(CPU_CAPABILITY_AVX2)
  // (x ^ (x >> 16)) >> 16 = x >> 16: the last xor only changes the low half
  return L::shr16(x);
#else
  x = S::xor_(x, L::shr16(x));
  return L::shr16(x);
#endif
}

// float_to_bf16_sr_bits of every lane of x with the random bits r (the round-to-nearest lanes,
// |x| >= the largest finite bf16, inf, NaN, computed only when a lane has one: never in practice)
inline __attribute__((always_inline)) Lanes32::I bf16_sr_bits(const FVec& x, Lanes32::I r) {
  using L = Lanes32;
  const L::I u = L::bits(x);
  const L::I sr = L::shr16(L::add(u, r));
  const L::I a = L::and_(u, L::set1(0x7fffffffu));
  const L::I limit = L::set1(0x7f7effffu);
#if defined(CPU_CAPABILITY_AVX512)
  const bool any = _mm512_cmpgt_epi32_mask(a, limit) != 0;
#else
  const bool any = _mm256_movemask_epi8(_mm256_cmpgt_epi32(a, limit)) != 0;
#endif
  if (__builtin_expect(any, 0)) return L::select_gt(a, limit, bf16_rne_bits(x), sr);
  return sr;
}

// float_to_bf16_sr_bits of x0, x1 with the random bits r0, r1 stored at p. AVX2: one test for
// both registers, then (u + r) >> 16 by store_high16 (the bits of bf16_sr_bits).
inline __attribute__((always_inline)) void store_bf16_sr(uint16_t* p, const FVec& x0,
                                                         const FVec& x1, Lanes32::I r0,
                                                         Lanes32::I r1) {
  using L = Lanes32;
#if defined(CPU_CAPABILITY_AVX2)
  const L::I u0 = L::bits(x0), u1 = L::bits(x1);
  const L::I magnitude = L::set1(0x7fffffffu);
  const L::I a = _mm256_max_epi32(L::and_(u0, magnitude), L::and_(u1, magnitude));
  if (__builtin_expect(_mm256_movemask_ps(_mm256_castsi256_ps(
                           _mm256_cmpgt_epi32(a, L::set1(0x7f7effffu)))) == 0,
                       1)) {
    store_high16(p, L::add(u0, r0), L::add(u1, r1));
    return;
  }
#endif
  L::store16(p, bf16_sr_bits(x0, r0), bf16_sr_bits(x1, r1));
}

// S: the moments' storage, uint16_t (bf16 bits, rounded to nearest even) or float (float32
// moments, read and written in place: the adam_chunk_sr loop for float32 moments in one pass).
template <typename G, typename Flags, typename S = uint16_t>
__attribute__((noinline)) void adam_chunk_bf16_sr(const G* __restrict g,
                                                  uint16_t* __restrict param,
                                                  S* __restrict m, S* __restrict v,
                                                  int64_t n, const AdamScalars& scalars,
                                                  Flags flags, uint32_t lo0, uint32_t salt) {
  using L = Lanes32;
  static_assert(std::is_same_v<S, uint16_t> || std::is_same_v<S, float>, "bf16 or fp32 moments");
  constexpr bool kBf16Moments = std::is_same_v<S, uint16_t>;
  if constexpr (kUnpackedGrads<G> && kBf16Moments) {
    return adam_chunk_unpacked(g, param, m, v, nullptr, n, scalars, flags, lo0, salt);
  }
  const AdamScalars s = scalars;  // in registers (see adam_chunk)
  const L::I vsalt = L::set1(salt);
  const L::I iota = SrLanes::iota();
  const L::I second = L::set1(static_cast<uint32_t>(SrLanes::kLanes));
  // l0: the low index words of the step's first register's lanes
  auto step = [&](const G* gp, uint16_t* pp, S* mp, S* vp, L::I l0) {
    FVec g0, g1, p0, p1, m0, m1, v0, v1;
    L::I a, b;
    VecIO<G>::load(gp, g0, g1);
    L::load_u16(pp, a, b);
    p0 = L::from_bits(L::shl16(a));
    p1 = L::from_bits(L::shl16(b));
    if constexpr (kBf16Moments) {
      L::load_u16(mp, a, b);
      m0 = L::from_bits(L::shl16(a));
      m1 = L::from_bits(L::shl16(b));
      L::load_u16(vp, a, b);
      v0 = L::from_bits(L::shl16(a));
      v1 = L::from_bits(L::shl16(b));
    } else {
      VecIO<float>::load(mp, m0, m1);
      VecIO<float>::load(vp, v0, v1);
    }
    adam_element_flags<FVec>(p0, m0, v0, g0, s, flags);
    adam_element_flags<FVec>(p1, m1, v1, g1, s, flags);
    if constexpr (kBf16Moments) {
      store_moments_bf16(mp, m0, m1, vp, v0, v1);
    } else {
      VecIO<float>::template store<true, false>(mp, m0, m1);
      VecIO<float>::template store<true, false>(vp, v0, v1);
    }
    store_bf16_sr(pp, p0, p1, sr_bits_lanes(l0, vsalt),
                  sr_bits_lanes(L::add(l0, second), vsalt));
  };
  int64_t i = 0;
  L::I lanes = L::add(L::set1(lo0), iota);  // lo0 + i + lane, wrapping as uint32_t
  const L::I advance = L::set1(static_cast<uint32_t>(kVecStep));
  for (; i + kVecStep <= n; i += kVecStep) {
    step(g + i, param + i, m + i, v + i, lanes);
    lanes = L::add(lanes, advance);
  }
  if (i < n) {  // through zero-padded copies, as adam_chunk
    const int64_t r = n - i;
    Tail<G> tg;
    Tail<uint16_t> tp;
    Tail<S> tm, tv;
    tg.in(g + i, r);
    tp.in(param + i, r);
    tm.in(m + i, r);
    tv.in(v + i, r);
    step(tg.buf, tp.buf, tm.buf, tv.buf, lanes);
    tp.out(param + i, r);
    tm.out(m + i, r);
    tv.out(v + i, r);
  }
}
#else
// declared for the call in fused_adam_step_, which discards it here (if constexpr)
template <typename G, typename Flags, typename S = uint16_t>
void adam_chunk_bf16_sr(const G* g, uint16_t* param, S* m, S* v, int64_t n,
                        const AdamScalars& scalars, Flags flags, uint32_t lo0, uint32_t salt);
#endif

// -- AVX2: the all-16-bit loops in the unpacked lane order --------------------------------------
//
// adam_chunk_bf16 with bf16 model params and adam_chunk_bf16_sr with bf16 moments, for bf16 or
// float32 grads (kUnpackedGrads), on AVX2, where they call adam_chunk_unpacked: every 16-bit array
// of a 16-element step (bf16 moments, param, remainders) is widened from one 256-bit load by
// vpunpck{l,h}wd and narrowed by one vpackusdw, so the lanes of the step's two float registers hold
// elements 0-3, 8-11 (register 0) and 4-7, 12-15 (register 1); the float32 grads are loaded in that
// order (two 128-bit halves a register). No lane-crossing permute and no shift to widen: fewer
// instructions per element than the in-order loops, whose vpmovzxwd loads and vpermq stores this
// loop spends on. The arithmetic per element is theirs (the same functions lane for lane), so are
// the bits; the stochastic rounding's random bits take each lane's own index.
#if defined(CPU_CAPABILITY_AVX2)
struct Unpacked {
  using I = __m256i;
  static inline __attribute__((always_inline)) I load(const void* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  // float32 of 16 bf16 values (bits) at p
  static inline __attribute__((always_inline)) void load_bf16(const void* p, FVec& a, FVec& b) {
    const I x = load(p), z = _mm256_setzero_si256();
    a = FVec(_mm256_castsi256_ps(_mm256_unpacklo_epi16(z, x)));
    b = FVec(_mm256_castsi256_ps(_mm256_unpackhi_epi16(z, x)));
  }
  // the grads (bf16 or float32)
  template <typename G>
  static inline __attribute__((always_inline)) void load_grad(const G* p, FVec& a, FVec& b) {
    if constexpr (std::is_same_v<G, float>) {
      a = FVec(_mm256_loadu2_m128(p + 8, p));
      b = FVec(_mm256_loadu2_m128(p + 12, p + 4));
    } else {
      static_assert(std::is_same_v<G, at::BFloat16>, "bf16 or float32 grads");
      load_bf16(p, a, b);
    }
  }
  // join_remainder of the bf16 params at model and the remainders at rem:
  // (model << 16) + int32(rem) = ((model - (rem < 0)) << 16) | uint16(rem)
  static inline __attribute__((always_inline)) void load_join(const void* model, const void* rem,
                                                              FVec& a, FVec& b) {
    const I r = load(rem);
    const I hi = _mm256_add_epi16(load(model), _mm256_srai_epi16(r, 15));
    a = FVec(_mm256_castsi256_ps(_mm256_unpacklo_epi16(r, hi)));
    b = FVec(_mm256_castsi256_ps(_mm256_unpackhi_epi16(r, hi)));
  }
  static inline __attribute__((always_inline)) void store(void* p, I x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), x);
  }
  // the high / low 16 bits of every lane of a, b at p
  static inline __attribute__((always_inline)) void store_high16(void* p, I a, I b) {
    store(p, _mm256_packus_epi32(_mm256_srli_epi32(a, 16), _mm256_srli_epi32(b, 16)));
  }
  static inline __attribute__((always_inline)) void store_low16(void* p, I a, I b) {
    const I low = _mm256_set1_epi32(0xffff);
    store(p, _mm256_packus_epi32(_mm256_and_si256(a, low), _mm256_and_si256(b, low)));
  }
  // store_moments_bf16's bits
  static inline __attribute__((always_inline)) void store_moments(void* mp, const FVec& m0,
                                                                  const FVec& m1, void* vp,
                                                                  const FVec& v0, const FVec& v1) {
    if (__builtin_expect(none_of(_mm256_or_ps(_mm256_cmp_ps(m0, m1, _CMP_UNORD_Q),
                                              _mm256_cmp_ps(v0, v1, _CMP_UNORD_Q))),
                         1)) {
      store_high16(mp, bf16_rne_high(m0), bf16_rne_high(m1));
      store_high16(vp, bf16_rne_high(v0), bf16_rne_high(v1));
      return;
    }
    store_low16(mp, bf16_rne_bits(m0), bf16_rne_bits(m1));
    store_low16(vp, bf16_rne_bits(v0), bf16_rne_bits(v1));
  }
  // the float32 masters p0, p1 at pp (in 128-bit halves: element order again) and their bf16 at
  // modelp as at::vec's float32 -> bf16 (VecIO<at::BFloat16>::store): round to nearest even,
  // NaN 0xffff
  static inline __attribute__((always_inline)) void store_master(float* pp, void* modelp,
                                                                 const FVec& p0, const FVec& p1) {
    _mm256_storeu2_m128(pp + 8, pp, p0);
    _mm256_storeu2_m128(pp + 12, pp + 4, p1);
    if (__builtin_expect(none_of(_mm256_cmp_ps(p0, p1, _CMP_UNORD_Q)), 1)) {
      store_high16(modelp, bf16_rne_high(p0), bf16_rne_high(p1));
      return;
    }
    const I nan = _mm256_set1_epi32(0xffff);
    auto bits = [&](const FVec& x) {
      return _mm256_blendv_epi8(nan, _mm256_srli_epi32(bf16_rne_high(x), 16),
                                _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_ORD_Q)));
    };
    store_low16(modelp, bits(p0), bits(p1));
  }
  // split_remainder of p0, p1: the low halves at rp, and (u + 0x8000) >> 16 at modelp
  static inline __attribute__((always_inline)) void store_split(void* rp, void* modelp,
                                                                const FVec& p0, const FVec& p1) {
    const I u0 = _mm256_castps_si256(p0), u1 = _mm256_castps_si256(p1);
    const I half = _mm256_set1_epi32(0x8000);
    store_low16(rp, u0, u1);
    store_high16(modelp, _mm256_add_epi32(u0, half), _mm256_add_epi32(u1, half));
  }
  // store_bf16_sr's test and bits: float_to_bf16_sr_bits of p0, p1 with the random bits r0, r1
  static inline __attribute__((always_inline)) void store_sr(void* pp, const FVec& p0,
                                                             const FVec& p1, I r0, I r1) {
    const I u0 = _mm256_castps_si256(p0), u1 = _mm256_castps_si256(p1);
    const I magnitude = _mm256_set1_epi32(0x7fffffff);
    const I a = _mm256_max_epi32(_mm256_and_si256(u0, magnitude), _mm256_and_si256(u1, magnitude));
    if (__builtin_expect(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(
                             a, _mm256_set1_epi32(0x7f7effff)))) == 0,
                         1)) {
      store_high16(pp, _mm256_add_epi32(u0, r0), _mm256_add_epi32(u1, r1));
      return;
    }
    store_low16(pp, bf16_sr_bits(p0, r0), bf16_sr_bits(p1, r1));
  }
};

// The update of one chunk with bf16 moments m, v (bits) in the unpacked order; P, the param's
// storage, picks the rest, each the twin of an in-order loop above (which calls this one):
//   float     float32 masters param, bf16 model params model: adam_chunk_bf16, kRem false
//   int16_t   remainders param of the bf16 params model: adam_chunk_bf16, kRem true
//   uint16_t  bf16 params param (bits) written with stochastic rounding, the random bits of
//             the low index words lo0 + i and salt (model unused): adam_chunk_bf16_sr
template <typename G, typename P, typename Flags>
inline __attribute__((always_inline)) void adam_chunk_unpacked(
    const G* __restrict g, P* __restrict param, uint16_t* __restrict m, uint16_t* __restrict v,
    at::BFloat16* __restrict model, int64_t n, const AdamScalars& scalars, Flags flags,
    uint32_t lo0, uint32_t salt) {
  using U = Unpacked;
  constexpr bool kRem = std::is_same_v<P, int16_t>;
  constexpr bool kSr = std::is_same_v<P, uint16_t>;
  static_assert(kRem || kSr || std::is_same_v<P, float>, "masters, remainders or bf16 params");
  const AdamScalars s = scalars;  // in registers (see adam_chunk)
  // kSr: the salt, and the low index words of the lanes: lo0 + i + (0-3, 8-11) and (4-7, 12-15)
  const U::I vsalt = _mm256_set1_epi32(static_cast<int>(salt));
  U::I lanes0 = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(lo0)),
                                 _mm256_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11));
  U::I lanes1 = _mm256_add_epi32(lanes0, _mm256_set1_epi32(4));
  const U::I advance = _mm256_set1_epi32(static_cast<int>(kVecStep));
  auto step = [&](const G* gp, P* pp, uint16_t* mp, uint16_t* vp, at::BFloat16* modelp)
                  __attribute__((always_inline)) {
    FVec g0, g1, p0, p1, m0, m1, v0, v1;
    U::load_grad(gp, g0, g1);
    if constexpr (kRem) {
      U::load_join(modelp, pp, p0, p1);
    } else if constexpr (kSr) {
      U::load_bf16(pp, p0, p1);
    } else {
      U::load_grad(pp, p0, p1);
    }
    U::load_bf16(mp, m0, m1);
    U::load_bf16(vp, v0, v1);
    adam_element_flags<FVec>(p0, m0, v0, g0, s, flags);
    adam_element_flags<FVec>(p1, m1, v1, g1, s, flags);
    U::store_moments(mp, m0, m1, vp, v0, v1);
    if constexpr (kRem) {
      U::store_split(pp, modelp, p0, p1);
    } else if constexpr (kSr) {
      U::store_sr(pp, p0, p1, sr_bits_lanes(lanes0, vsalt), sr_bits_lanes(lanes1, vsalt));
    } else {
      U::store_master(pp, modelp, p0, p1);
    }
  };
  int64_t i = 0;
  for (; i + kVecStep <= n; i += kVecStep) {
    step(g + i, param + i, m + i, v + i, kSr ? nullptr : model + i);
    if constexpr (kSr) {
      lanes0 = _mm256_add_epi32(lanes0, advance);
      lanes1 = _mm256_add_epi32(lanes1, advance);
    }
  }
  if (i < n) {  // through zero-padded copies, as adam_chunk
    const int64_t r = n - i;
    Tail<G> tg;
    Tail<P> tp;
    Tail<uint16_t> tm, tv;
    Tail<at::BFloat16> tmodel;  // read in with remainders, written out but with kSr
    tg.in(g + i, r);
    tp.in(param + i, r);
    tm.in(m + i, r);
    tv.in(v + i, r);
    if constexpr (kRem) tmodel.in(model + i, r);
    step(tg.buf, tp.buf, tm.buf, tv.buf, tmodel.buf);
    tp.out(param + i, r);
    tm.out(m + i, r);
    tv.out(v + i, r);
    if constexpr (!kSr) tmodel.out(model + i, r);
  }
}
#endif

template <typename G, typename M, bool kMomentum>
void sgd_chunk(const G* g, float* p, float* buf, M* model, int64_t n, bool first,
               const SgdScalars& scalars) {
  constexpr bool kModel = !std::is_same_v<M, NoModel>;
  const SgdScalars s = scalars;  // in registers (see adam_chunk)
  auto step = [&](const G* gp, float* pp, float* bp, M* modelp) {
    FVec g0, g1, p0, p1, b0, b1;
    VecIO<G>::load(gp, g0, g1);
    VecIO<float>::load(pp, p0, p1);
    if constexpr (kMomentum) {
      if (!first) VecIO<float>::load(bp, b0, b1);  // a first step's buffer holds no value
    }
    sgd_element<FVec>(p0, b0, g0, first, s);
    sgd_element<FVec>(p1, b1, g1, first, s);
    VecIO<float>::template store<true, false>(pp, p0, p1);
    if constexpr (kMomentum) VecIO<float>::template store<true, false>(bp, b0, b1);
    if constexpr (kModel) VecIO<M>::template store<true, false>(modelp, p0, p1);
  };
  int64_t i = 0;
  for (; i + kVecStep <= n; i += kVecStep) {
    step(g + i, p + i, kMomentum ? buf + i : nullptr, kModel ? model + i : nullptr);
  }
  if (i < n) {
    const int64_t r = n - i;
    Tail<G> tg;
    Tail<float> tp, tb;
    tg.in(g + i, r);
    tp.in(p + i, r);
    if (kMomentum) tb.in(buf + i, r);
    Tail<std::conditional_t<kModel, M, float>> tmodel;
    step(tg.buf, tp.buf, kMomentum ? tb.buf : nullptr,
         kModel ? reinterpret_cast<M*>(tmodel.buf) : nullptr);
    tp.out(p + i, r);
    if (kMomentum) tb.out(buf + i, r);
    if constexpr (kModel) tmodel.out(model + i, r);
  }
}

// f(G{}, M{}) with the C++ types of the grad and model dtypes (M = NoModel without a model).
template <typename F>
void dispatch_grad_model(at::ScalarType gt, bool has_model, at::ScalarType mt, const F& f) {
  auto with_model = [&](auto g_tag) {
    if (!has_model) return f(g_tag, NoModel{});
    switch (mt) {
      case at::kHalf: return f(g_tag, at::Half{});
      case at::kBFloat16: return f(g_tag, at::BFloat16{});
      default: TORCH_CHECK(false, "tpamp: unexpected model dtype ", mt);  // validated before
    }
  };
  switch (gt) {
    case at::kFloat: return with_model(float{});
    case at::kHalf: return with_model(at::Half{});
    case at::kBFloat16: return with_model(at::BFloat16{});
    default: TORCH_CHECK(false, "tpamp: unexpected grad dtype ", gt);  // validated before
  }
}

double read_step(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? *t.const_data_ptr<double>()
                                        : static_cast<double>(*t.const_data_ptr<float>());
}

void increment_step(const at::Tensor& t) {
  if (t.scalar_type() == at::kDouble) {
    *t.data_ptr<double>() += 1.0;
  } else {
    *t.data_ptr<float>() += 1.0f;
  }
}

std::vector<int64_t> numels_of(at::TensorList ts) {
  std::vector<int64_t> n;
  n.reserve(ts.size());
  for (const auto& t : ts) n.push_back(t.numel());
  return n;
}

// Every chunk of every param with its grad and model-param slices typed by their dtypes
// (model: a null NoModel* when there are no model params), run by for_each_chunk_balanced (one
// run of chunks per thread, the last chunks taken by whichever thread is free: launcher.h): the
// loop both optimizer steps share.
// f(const G* grad, M* model, const Chunk& chunk).
template <typename F>
void for_each_step_chunk(at::TensorList params, at::TensorList grads, at::TensorList model_params,
                         const F& f) {
  const bool has_model = !model_params.empty();
  const ChunkPlan plan = plan_chunks(numels_of(params));
  for_each_chunk_balanced(plan, [&](int64_t, const Chunk& c) {
    const int64_t e = c.entry;
    dispatch_grad_model(
        grads[e].scalar_type(), has_model, has_model ? model_params[e].scalar_type() : at::kFloat,
        [&](auto g_tag, auto m_tag) {
          using G = decltype(g_tag);
          using M = decltype(m_tag);
          M* model = nullptr;
          if constexpr (!std::is_same_v<M, NoModel>) {
            model = static_cast<M*>(model_params[e].data_ptr()) + c.offset;
          }
          f(static_cast<const G*>(grads[e].const_data_ptr()) + c.offset, model, c);
        });
  });
}

// f(kRem, p, rem) with the chunk c of a param: its float32 masters p (kRem: std::false_type,
// rem null) or, for bf16 model params (M), their int16 remainders rem (std::true_type, p null).
template <typename M, typename F>
void with_masters_or_remainders(const at::Tensor& param, const Chunk& c, const F& f) {
  if (param.scalar_type() != at::kShort) {
    f(std::false_type{}, param.data_ptr<float>() + c.offset, nullptr);
  } else if constexpr (std::is_same_v<M, at::BFloat16>) {
    f(std::true_type{}, nullptr, param.data_ptr<int16_t>() + c.offset);
  } else {
    TORCH_CHECK(false, "tpamp: remainders without bf16 params");  // validated before
  }
}

}  // namespace

void fused_adam_step_(at::TensorList params, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                      at::TensorList steps, at::TensorList model_params, at::TensorList grads,
                      const std::optional<at::Tensor>& grad_scale,
                      const std::optional<at::Tensor>& found_inf,
                      const std::optional<at::Tensor>& lr_tensor, double lr, double beta1,
                      double beta2, double eps, double weight_decay, bool decoupled_weight_decay,
                      bool maximize, at::TensorList exp_avg_scales,
                      at::TensorList exp_avg_sq_scales,
                      const std::optional<at::Tensor>& stochastic_rounding) {
  const char* op = "tpamp::fused_adam_step_";
  const at::Device device(at::kCPU);
  const StepArgs a = validate_adam_step(op, params, exp_avgs, exp_avg_sqs, steps, model_params,
                                        grads, grad_scale, found_inf, lr_tensor, exp_avg_scales,
                                        exp_avg_sq_scales, device, stochastic_rounding);
  if (params.empty()) return;
  // host memory: reading the device scalars is no sync
  if (a.has_found_inf && found_inf->item<float>() != 0.0f) return;
  const float scale = a.has_grad_scale ? grad_scale->item<float>() : 1.0f;
  if (a.has_lr_tensor) lr = static_cast<double>(lr_tensor->item<float>());
  const AdamHyper h{lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay};
  std::vector<AdamScalars> scalars;
  scalars.reserve(params.size());
  for (const auto& st : steps) scalars.push_back(adam_scalars(h, read_step(st) + 1.0, scale, maximize));
  int64_t total = 0;
  for (const auto& t : params) total += t.numel();
  const bool stream_model = total >= kStreamModelMinElements;
  for_each_step_chunk(params, grads, model_params, [&](const auto* g, auto* model, const Chunk& c) {
    const int64_t e = c.entry;
    const Kind mk = kind_of(exp_avgs[e].scalar_type());
    const Kind vk = kind_of(exp_avg_sqs[e].scalar_type());
    const bool remainders = params[e].scalar_type() == at::kShort;
    if (params[e].scalar_type() == at::kBFloat16) {  // stochastic rounding (validated)
      const int64_t first_block = c.offset / kMomentBlock;
      auto ref = [&](const at::Tensor& t, Kind k, at::TensorList scales, bool sq) {
        return MomentRef{k, static_cast<char*>(t.data_ptr()) + c.offset * t.element_size(),
                         k == Kind::kFp8 || k == Kind::kDynamic
                             ? scales[e].data_ptr<float>() + first_block
                             : nullptr,
                         sq};
      };
      const int64_t* row = stochastic_rounding->const_data_ptr<int64_t>() + 2 * e;
      const uint64_t stream = sr_stream(static_cast<uint64_t>(row[0]), read_step(steps[e]) + 1.0);
      const uint64_t j0 = static_cast<uint64_t>(row[1]) + static_cast<uint64_t>(c.offset);
      uint16_t* param = static_cast<uint16_t*>(params[e].data_ptr()) + c.offset;
      // bf16 or float32 moments, one high index word in the chunk: the one-loop pass
      const bool one_word = (j0 & 0xffffffffull) + static_cast<uint64_t>(c.n) <= (1ull << 32);
      if (kBf16Pass && mk == Kind::kBFloat16 && vk == Kind::kBFloat16 && one_word) {
        using G = std::remove_const_t<std::remove_pointer_t<decltype(g)>>;
        with_adam_flags(scalars[e], [&](auto flags) {
          uint16_t* m = static_cast<uint16_t*>(exp_avgs[e].data_ptr()) + c.offset;
          uint16_t* v = static_cast<uint16_t*>(exp_avg_sqs[e].data_ptr()) + c.offset;
          if constexpr (kBf16Pass) {
            adam_chunk_bf16_sr<G, decltype(flags)>(g, param, m, v, c.n, scalars[e], flags,
                                                   static_cast<uint32_t>(j0),
                                                   sr_salt(stream, j0 >> 32));
          }
        });
        return;
      }
      if (kBf16Pass && mk == Kind::kFloat && vk == Kind::kFloat && one_word) {
        using G = std::remove_const_t<std::remove_pointer_t<decltype(g)>>;
        with_adam_flags(scalars[e], [&](auto flags) {
          if constexpr (kBf16Pass) {
            adam_chunk_bf16_sr<G, decltype(flags), float>(
                g, param, exp_avgs[e].data_ptr<float>() + c.offset,
                exp_avg_sqs[e].data_ptr<float>() + c.offset, c.n, scalars[e], flags,
                static_cast<uint32_t>(j0), sr_salt(stream, j0 >> 32));
          }
        });
        return;
      }
      adam_chunk_sr(g, param, ref(exp_avgs[e], mk, exp_avg_scales, false),
                    ref(exp_avg_sqs[e], vk, exp_avg_sq_scales, true), c.n, scalars[e], stream,
                    j0);
      return;
    }
    if (kBf16Pass && mk == Kind::kBFloat16 && vk == Kind::kBFloat16) {
      using G = std::remove_const_t<std::remove_pointer_t<decltype(g)>>;
      using M = std::remove_pointer_t<decltype(model)>;
      uint16_t* m = static_cast<uint16_t*>(exp_avgs[e].data_ptr()) + c.offset;
      uint16_t* v = static_cast<uint16_t*>(exp_avg_sqs[e].data_ptr()) + c.offset;
      with_adam_flags(scalars[e], [&](auto flags) {
        with_masters_or_remainders<M>(params[e], c, [&](auto rem, float* p, int16_t* r) {
          if constexpr (kBf16Pass) {
            adam_chunk_bf16<G, M, decltype(flags), decltype(rem)::value>(g, p, r, m, v, model,
                                                                         c.n, scalars[e], flags);
          }
        });
      });
      return;
    }
    // (an exp_avg_sq block holding inf, a negative scale, takes adam_chunk_narrow's read_moment)
    if (kDynamicPass && mk == Kind::kDynamic && vk == Kind::kDynamic &&
        !any_negative(exp_avg_sq_scales[e], c.offset / kMomentBlock, num_moment_blocks(c.n))) {
      using G = std::remove_const_t<std::remove_pointer_t<decltype(g)>>;
      using M = std::remove_pointer_t<decltype(model)>;
      const int64_t first_block = c.offset / kMomentBlock;  // c.offset: a multiple of kChunkSize
      const MomentRef mref{mk, static_cast<uint8_t*>(exp_avgs[e].data_ptr()) + c.offset,
                           exp_avg_scales[e].data_ptr<float>() + first_block, false};
      const MomentRef vref{vk, static_cast<uint8_t*>(exp_avg_sqs[e].data_ptr()) + c.offset,
                           exp_avg_sq_scales[e].data_ptr<float>() + first_block, true};
      with_adam_flags(scalars[e], [&](auto flags) {
        with_masters_or_remainders<M>(params[e], c, [&](auto rem, float* p, int16_t* r) {
          if constexpr (kDynamicPass) {
            adam_chunk_dynamic<G, M, decltype(flags), decltype(rem)::value>(
                g, p, r, mref, vref, model, c.n, scalars[e], flags);
          }
        });
      });
      return;
    }
    if (remainders || mk != Kind::kFloat || vk != Kind::kFloat) {
      const int64_t first_block = c.offset / kMomentBlock;  // c.offset: a multiple of kChunkSize
      auto ref = [&](const at::Tensor& t, Kind k, at::TensorList scales, bool sq) {
        return MomentRef{k, static_cast<char*>(t.data_ptr()) + c.offset * t.element_size(),
                         k == Kind::kFp8 || k == Kind::kDynamic
                             ? scales[e].data_ptr<float>() + first_block
                             : nullptr,
                         sq};
      };
      adam_chunk_narrow(g, remainders ? nullptr : params[e].data_ptr<float>() + c.offset,
                        remainders ? params[e].data_ptr<int16_t>() + c.offset : nullptr,
                        ref(exp_avgs[e], mk, exp_avg_scales, false),
                        ref(exp_avg_sqs[e], vk, exp_avg_sq_scales, true), model, c.n, scalars[e]);
      return;
    }
    // non-temporal model writes: a large step, and the model slice aligned to one 16-bit vector
    const bool stream = kStreamModel && stream_model &&
                        reinterpret_cast<uintptr_t>(model) % (kVecStep * 2) == 0;
    with_adam_flags(scalars[e], [&](auto flags) {
      adam_chunk(g, params[e].data_ptr<float>() + c.offset,
                 exp_avgs[e].data_ptr<float>() + c.offset,
                 exp_avg_sqs[e].data_ptr<float>() + c.offset, model, c.n, scalars[e], flags,
                 stream);
    });
  });
  for (const auto& st : steps) increment_step(st);
}

void fused_sgd_step_(at::TensorList params, at::TensorList momentum_buffers,
                     at::TensorList model_params, at::TensorList grads,
                     const c10::List<bool>& first_step,
                     const std::optional<at::Tensor>& grad_scale,
                     const std::optional<at::Tensor>& found_inf,
                     const std::optional<at::Tensor>& lr_tensor, double lr, double momentum,
                     double dampening, double weight_decay, bool nesterov, bool maximize) {
  const char* op = "tpamp::fused_sgd_step_";
  const at::Device device(at::kCPU);
  const StepArgs a = validate_sgd_step(op, params, momentum_buffers, model_params, grads,
                                       first_step, grad_scale, found_inf, lr_tensor, momentum,
                                       device);
  if (params.empty()) return;
  if (a.has_found_inf && found_inf->item<float>() != 0.0f) return;
  const float scale = a.has_grad_scale ? grad_scale->item<float>() : 1.0f;
  if (a.has_lr_tensor) lr = static_cast<double>(lr_tensor->item<float>());
  const SgdScalars s = sgd_scalars(SgdHyper{lr, momentum, dampening, weight_decay, nesterov},
                                   scale, maximize);
  const bool has_momentum = momentum != 0.0;
  for_each_step_chunk(params, grads, model_params, [&](const auto* g, auto* model, const Chunk& c) {
    using G = std::remove_const_t<std::remove_pointer_t<decltype(g)>>;
    using M = std::remove_pointer_t<decltype(model)>;
    const int64_t e = c.entry;
    float* p = params[e].data_ptr<float>() + c.offset;
    if (has_momentum) {
      sgd_chunk<G, M, true>(g, p, momentum_buffers[e].data_ptr<float>() + c.offset, model, c.n,
                            first_step.get(e), s);
    } else {
      sgd_chunk<G, M, false>(g, p, nullptr, model, c.n, false, s);
    }
  });
}

}  // namespace cpu
}  // namespace tpamp
