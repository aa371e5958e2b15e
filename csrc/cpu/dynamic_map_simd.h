// The uint8 moment format (the dynamic map, csrc/kernels/optimizer_step.h) on one block of the
// CPU launcher: decode codes to float32 values, the block's max |x|, and encode float32 values to
// codes, with the AVX-512 / AVX2 instructions of the translation unit's capability and plain
// scalar code on the default one. Every path gives the bits of the CUDA launcher's
// dynamic_encode_bits and of map[code] * scale; only how they are found differs. (g++'s
// vectorizer turned the table search into scalar loads and inserts, 9 ns per element with
// AVX-512; explicit 16-lane gathers cost ~3 ns per element on the AMD CPU measured.)
//
// Encode: the code of y = x / div (a float32 division, as torchao).
// * AVX-512: the AVX2 arithmetic below on 16 lanes (DynamicPieces; 127 folded into the signed
//   map's tables), 64 values a round, on y' = x * (1 / div) where 1 / div is a normal float32
//   (dynamic_recip_ok): y' lies at most 2 float32 steps from y, and a lane whose y' lies within
//   3 steps of a threshold (or within kDynamicRecipGuard of a decade piece's start) is flagged
//   and redone by division (the scalar path). 0.114 (signed map) / 0.109 (unsigned) ns per
//   element on the Zen 5 measured (scripts/bench_dynamic_map_block.cpp), both maps' blocks
//   in one loop (dynamic_encode_block2) 0.22 ns per element of each; the steps before (see
//   DynamicPieces): 0.124 / 0.122 with the codes packed from the low bits (signed 0.126 with
//   the sign applied per 16 values), 0.135 / 0.128 with an addition for the flag near a
//   piece's start (unsigned 0.133 with a = max(min(y, 1), 0)), 0.135 / 0.135 with
//   two-register tables, 0.147 / 0.147 with the piece found through a byte shuffle and the
//   start of a piece by piece (both maps' blocks 0.29 ns per element of each), the division
//   and 24 operations per 16 values before it 0.21 / 0.18, the 8-level binary search on the
//   thresholds' 16-bit key halves (kDynamicThreshold*) before that 0.21.
// * AVX2: no table read per element: the map is linear within each decade, so the code is
//   floor(a A[p] + B[p]) on the decade piece p of a = |y| (kDynamicPiece*, from
//   scripts/gen_dynamic_map.py --pieces; see dynamic_encode_block); a lane within 2^-12 of a
//   threshold (in code units) takes the scalar path; the signed map's sign is applied to the
//   32 packed magnitude codes of a round (a blend of 127 + k and 127 - k by x's packed sign
//   bytes) instead of in each 8-lane register (vpsignd and an add per 8). 0.32 (signed) /
//   0.29 (unsigned) ns per element on the Zen 5 measured (one thread, blocks in L1), the sign
//   per register before it 0.34 / 0.29, the keyed gather before that 0.40. (The reciprocal and
//   the guard of the AVX-512 path cost more than the division here: 0.37 against 0.35; with
//   the signed sign on the bytes, a guard of 3 operations per 8 lanes (the distance to the
//   piece's start less 7, its compare, a shift and a minimum into the flags, no key for negative
//   y): signed 0.32 either way, unsigned 0.31 against 0.29. Each vector operation removed from
//   the 8-lane function saves ~0.015 ns per element, a cross-lane permute about the same:
//   the table lookups by vpermd are not the bottleneck (the top code from 2 << piece, 3
//   operations instead of a vpermd, +0.015; cvttps2dq replaced by an add of 2^23 and a
//   subtract, +0.02).)
// * scalar (and the AVX2 fallback): one read of a keyed table (kDynamicKeyed*, see
//   dynamic_encode_scalar).
// A NaN divisor (a block holding NaN; no y is NaN otherwise; AVX2: any divisor not > 0, which
// dynamic_scale never gives) takes the scalar loop, whose segments put NaN where
// dynamic_encode_bits does (255 with a clear sign bit, else 0).
// Decode (map[c]: DynamicTables::decode, exp_avg_sq's code 0 reading as code 1's entry; a block
// with a negative scale is read by the caller, csrc/cpu/optimizer_step.cpp read_moment):
// AVX-512 picks the 16-bit halves of map[c] by word permutes (DynamicDecoder); in the
// one-pass loop, where the CPU has VBMI (dynamic_vbmi_enabled), the four bytes of map[c] by byte
// permutes, 64 codes a round (DynamicDecoderVbmi); AVX2 and scalar read the table (scalar loads beat AVX2 gathers here: 0.18 against 0.45 ns per element).
// scripts/gen_dynamic_map.py generates and checks the tables; tests/test_dynamic_map_modules.py
// checks every float32 threshold of both maps and its neighbours in every CPU module against
// the numpy rule and the emulated CUDA launcher.

#pragma once

#include "../kernels/optimizer_step.h"
#include "dynamic_map_pieces.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace tpamp {
namespace cpu {
// internal linkage: every capability module compiles its own variant of these functions
namespace {

// The tables of one map (signed: exp_avg; unsigned: exp_avg_sq).
struct DynamicTables {
  const float* map;        // 257 values
  const float* threshold;  // 256 thresholds
  const uint32_t* keyed;   // 2 * kDynamicKeySlots entries
  const float* decode;     // the values codes read back as (dynamic_decode_table)
};

// The keyed tables' segments: as dynamic_encode_bits' but from 2^kDynamicKeyLowExponent.
constexpr int kDynamicKeyLowExponent = -24;
constexpr int32_t kDynamicKeySlots = 24 * (1 << kDynamicSegmentBits) + 3;
static_assert(sizeof(kDynamicKeyedSigned) == 2 * kDynamicKeySlots * sizeof(uint32_t),
              "the keyed tables of scripts/gen_dynamic_map.py");
constexpr int32_t kDynamicKeyBias =
    ((127 + kDynamicKeyLowExponent) << kDynamicSegmentBits) - 1;
static_assert(23 - kDynamicSegmentBits == 16, "segments of 7 mantissa bits: 16 bits below");

// The values codes read back as (before the block's scale): the signed map; the unsigned map
// with code 0 reading as code 1's entry (dynamic_sq_decode in kernels/optimizer_step.h).
inline const float* dynamic_decode_table(bool is_unsigned) {
  struct Table {
    float v[257];
  };
  static const Table u = [] {
    Table t;
    for (int c = 0; c < 257; ++c) t.v[c] = kDynamicMapUnsigned[c];
    t.v[0] = t.v[1];
    return t;
  }();
  return is_unsigned ? u.v : kDynamicMapSigned;
}

inline const DynamicTables& dynamic_tables(bool is_unsigned) {
  static const DynamicTables t[2] = {
      {kDynamicMapSigned, kDynamicThresholdSigned, kDynamicKeyedSigned,
       dynamic_decode_table(false)},
      {kDynamicMapUnsigned, kDynamicThresholdUnsigned, kDynamicKeyedUnsigned,
       dynamic_decode_table(true)}};
  return t[is_unsigned ? 1 : 0];
}


// dynamic_encode_bits(y, ...) with one table read: the entry of y's segment (sign, exponent
// clamped to [-24, 0], 7 mantissa bits) holds the code of the segment's lowest value and the key
// of the one threshold above it in the segment (0x10000: none); the key of y (its low 16 bits,
// complemented for negative y) orders the segment's values, so code = code + (key(y) >= key).
// NaN and |y| >= 1 fall in the last segment of their sign (no threshold: 255 positive, 0
// negative), as in dynamic_encode_bits.
inline uint32_t dynamic_encode_scalar(float y, const DynamicTables& t) {
  const uint32_t u = float_to_bits(y);
  int32_t slot = static_cast<int32_t>((u & 0x7fffffffu) >> 16) - kDynamicKeyBias;
  slot = slot < 0 ? 0 : (slot > kDynamicKeySlots - 2 ? kDynamicKeySlots - 2 : slot);
  const uint32_t e = t.keyed[slot + static_cast<int32_t>(u >> 31) * kDynamicKeySlots];
  const uint32_t key = (u & 0xffffu) ^ ((u >> 31) != 0u ? 0xffffu : 0u);
  return (e & 0xffu) + (key >= (e >> 8) ? 1u : 0u);
}

// Whether the AVX-512 dynamic_encode_block may compute y' = x * r with r = 1 / div (one float32
// division per block) instead of y = x / div: when r is a normal float32 (2^-126 <= div <=
// 2^126; not for NaN, the saturated FLT_MAX of a block with inf, or a subnormal absmax). Then
// r = (1 / div)(1 + e), |e| <= 2^-24, so the exact product x * r = v (1 + e) with v = x / div
// lies less than one float32 step of v's binade from v (|v| < 2^(E+1), step 2^(E-23)); rounding
// is monotone, so y' = RN(x * r) lies between RN(v - step) and RN(v + step), at most 2 float32
// steps from y = RN(v) (a step of the binade below is half as wide; a subnormal v moves by less
// than one step). The lane function gives a code only where every value within 3 steps of
// its y' has that code (else the lane is flagged, t within 2^-12 of an integer or a within
// kDynamicRecipGuard steps of a decade piece's start, and redone by division), so the codes
// are those of x / div: scripts/check_dynamic_map_exhaustive.cpp checks this for every float32
// y' and both maps.
constexpr int32_t kDynamicRecipGuard = 6;  // float32 steps around a piece's start
inline bool dynamic_recip_ok(float div) { return div >= 0x1p-126f && div <= 0x1p126f; }

// The max |x| of a block's n values for its scale, as the caller's NaN-propagating reduction
// (nan_path) computes it, without its serial chain of NaN-propagating maxima: the maximum of
// the bits of |x| as integers (their order is the order of the values; a NaN's bits are above
// +inf's), in four accumulators. A block holding NaN returns nan_path(), so its scale keeps
// the bits it had (the NaN a block's scale holds decides its codes' signs).
template <typename F>
inline float dynamic_absmax(const float* __restrict in, int64_t n, const F& nan_path) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                    _mm512_setzero_si512()};
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    for (int k = 0; k < 4; ++k) {
      const __m512i u = _mm512_loadu_si512(in + i + 16 * k);
      acc[k] = _mm512_max_epi32(acc[k], _mm512_and_si512(u, abs_mask));
    }
  }
  for (; i < n; i += 16) {
    const __mmask16 live = n - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1u);
    const __m512i u = _mm512_maskz_loadu_epi32(live, in + i);
    acc[0] = _mm512_max_epi32(acc[0], _mm512_and_si512(u, abs_mask));
  }
  const uint32_t m = static_cast<uint32_t>(_mm512_reduce_max_epi32(
      _mm512_max_epi32(_mm512_max_epi32(acc[0], acc[1]), _mm512_max_epi32(acc[2], acc[3]))));
  return m > 0x7f800000u ? nan_path() : bits_to_float(m);
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                    _mm256_setzero_si256()};
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    for (int k = 0; k < 4; ++k) {
      const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i + 8 * k));
      acc[k] = _mm256_max_epi32(acc[k], _mm256_and_si256(u, abs_mask));
    }
  }
  __m256i r = _mm256_max_epi32(_mm256_max_epi32(acc[0], acc[1]),
                               _mm256_max_epi32(acc[2], acc[3]));
  __m128i h = _mm_max_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  h = _mm_max_epi32(h, _mm_shuffle_epi32(h, 0x4e));
  h = _mm_max_epi32(h, _mm_shuffle_epi32(h, 0xb1));
  uint32_t m = static_cast<uint32_t>(_mm_cvtsi128_si32(h));
  for (; i < n; ++i) {
    const uint32_t a = float_to_bits(in[i]) & 0x7fffffffu;
    m = a > m ? a : m;
  }
  return m > 0x7f800000u ? nan_path() : bits_to_float(m);
#else
  (void)in;
  (void)n;
  return nan_path();
#endif
}

#if defined(CPU_CAPABILITY_AVX512)
// The AVX-512 decode of 32 codes into registers: map[c] from two 16-bit planes of the map's
// float32 bits (low and high halves, 256 words each: 8 registers a plane), each picked with 4
// two-register word permutes (64 entries) and 3 selects by the code's bits 6 and 7, then the
// halves joined by unpacks (the codes permuted first so that the joined lanes are in order).
// Half the permutes and selects per element of a 32-bit pick (8 permutes and 7 selects per 16
// codes). The values are map[c] * scale, those of dynamic_decode_block.
struct DynamicPlanes {
  alignas(64) uint16_t lo[256];
  alignas(64) uint16_t hi[256];
};

inline const DynamicPlanes& dynamic_planes(const DynamicTables& t) {
  static const DynamicPlanes* planes = [] {
    static DynamicPlanes pl[2];
    for (int u = 0; u < 2; ++u) {
      const float* map = dynamic_decode_table(u != 0);
      for (int c = 0; c < 256; ++c) {
        const uint32_t bits = float_to_bits(map[c]);
        pl[u].lo[c] = static_cast<uint16_t>(bits & 0xffffu);
        pl[u].hi[c] = static_cast<uint16_t>(bits >> 16);
      }
    }
    return pl;
  }();
  return planes[t.map == kDynamicMapUnsigned ? 1 : 0];
}

struct DynamicDecoder {
  __m512i lo[8], hi[8];
  // word k of the permuted codes: code 4l + j (k = 8l + j), 16 + 4l + j (k = 8l + 4 + j)
  __m512i order;
  explicit DynamicDecoder(const DynamicTables& t) {
    const DynamicPlanes& pl = dynamic_planes(t);
    for (int k = 0; k < 8; ++k) {
      lo[k] = _mm512_load_si512(pl.lo + 32 * k);
      hi[k] = _mm512_load_si512(pl.hi + 32 * k);
    }
    alignas(64) uint16_t ord[32];
    for (int l = 0; l < 4; ++l) {
      for (int j = 0; j < 4; ++j) {
        ord[8 * l + j] = static_cast<uint16_t>(4 * l + j);
        ord[8 * l + 4 + j] = static_cast<uint16_t>(16 + 4 * l + j);
      }
    }
    order = _mm512_load_si512(ord);
  }
  // the 32 codes c (zero-extended 16-bit lanes, in memory order) -> map[c] * scale: codes 0-15
  // in a, 16-31 in b
  inline __attribute__((always_inline)) void decode32(__m512i c, __m512 scale, __m512& a,
                                                      __m512& b) const {
    c = _mm512_permutexvar_epi16(order, c);
    const __mmask32 k6 = _mm512_test_epi16_mask(c, _mm512_set1_epi16(64));
    const __mmask32 k7 = _mm512_test_epi16_mask(c, _mm512_set1_epi16(128));
    auto plane = [&](const __m512i* t) {
      const __m512i p0 = _mm512_mask_blend_epi16(k6, _mm512_permutex2var_epi16(t[0], c, t[1]),
                                                 _mm512_permutex2var_epi16(t[2], c, t[3]));
      const __m512i p1 = _mm512_mask_blend_epi16(k6, _mm512_permutex2var_epi16(t[4], c, t[5]),
                                                 _mm512_permutex2var_epi16(t[6], c, t[7]));
      return _mm512_mask_blend_epi16(k7, p0, p1);
    };
    const __m512i l = plane(lo), h = plane(hi);
    a = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(l, h)), scale);
    b = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(l, h)), scale);
  }
  inline __attribute__((always_inline)) void decode32(const uint8_t* p, __m512 scale, __m512& a,
                                                      __m512& b) const {
    decode32(_mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))),
             scale, a, b);
  }
};
#endif

#if defined(CPU_CAPABILITY_AVX512)
// Whether the CPU has AVX-512 VBMI (byte permutes; not part of ATen's AVX-512 capability) and
// the environment does not set TPAMP_DISABLE_VBMI to a value other than "0" (which forces the
// code without VBMI: tests and benchmarks of both paths). Read once.
inline bool dynamic_vbmi_enabled() {
  static const bool on = [] {
    const char* off = std::getenv("TPAMP_DISABLE_VBMI");
    return __builtin_cpu_supports("avx512vbmi") &&
           (off == nullptr || off[0] == '\0' || (off[0] == '0' && off[1] == '\0'));
  }();
  return on;
}

// Compiled for VBMI (the callers check dynamic_vbmi_enabled() first): DynamicDecoder's values
// (map[c] * scale) for 64 codes a call, from the four byte planes of the map's float32 bits (256
// bytes each: 4 registers a plane), each picked with two 128-entry byte permutes (vpermi2b) and
// one select by the code's bit 7, then the bytes joined by unpacks (the codes' dwords transposed
// first so that the joined lanes are in order): 26 operations per 64 codes against the 42 of
// DynamicDecoder.
#pragma GCC push_options
#pragma GCC target("avx512vbmi")
struct DynamicDecoderVbmi {
  __m512i plane[4][4];  // plane[j][q]: byte j of map[64 q + l] in byte l
  __m512i order;        // dword 4 l + k of the permuted codes: dword 4 k + l of the codes
  explicit DynamicDecoderVbmi(const DynamicTables& t) {
    alignas(64) uint8_t b[4][256];
    for (int c = 0; c < 256; ++c) {
      const uint32_t bits = float_to_bits(t.decode[c]);
      for (int j = 0; j < 4; ++j) b[j][c] = static_cast<uint8_t>(bits >> (8 * j));
    }
    for (int j = 0; j < 4; ++j) {
      for (int q = 0; q < 4; ++q) plane[j][q] = _mm512_load_si512(b[j] + 64 * q);
    }
    order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  }
  // the 64 codes c (bytes, in memory order) -> map[c] * scale: codes 16 r .. 16 r + 15 in out[r]
  inline __attribute__((always_inline)) void decode64(__m512i c, __m512 scale,
                                                      __m512* out) const {
    // after the unpacks, dword s of lane l of the k-th result holds byte 16 l + 4 k + s
    c = _mm512_permutexvar_epi32(order, c);
    const __mmask64 high = _mm512_movepi8_mask(c);  // code bit 7: entries 128..255
    __m512i b[4];
    for (int j = 0; j < 4; ++j) {
      b[j] = _mm512_mask_blend_epi8(high, _mm512_permutex2var_epi8(plane[j][0], c, plane[j][1]),
                                    _mm512_permutex2var_epi8(plane[j][2], c, plane[j][3]));
    }
    const __m512i w0 = _mm512_unpacklo_epi8(b[0], b[1]), w1 = _mm512_unpackhi_epi8(b[0], b[1]);
    const __m512i v0 = _mm512_unpacklo_epi8(b[2], b[3]), v1 = _mm512_unpackhi_epi8(b[2], b[3]);
    out[0] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(w0, v0)), scale);
    out[1] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(w0, v0)), scale);
    out[2] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(w1, v1)), scale);
    out[3] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(w1, v1)), scale);
  }
};
#pragma GCC pop_options
#endif

// out[i] = t.decode[in[i]] * scale for i < n (n <= kMomentBlock).
inline void dynamic_decode_block(const uint8_t* __restrict in, int64_t n, float scale,
                                 const DynamicTables& t, float* __restrict out) {
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
  // DynamicDecoder: 32 codes a round (a zero-padded tail reads no byte past n)
  const DynamicDecoder dec(t);
  const __m512 s = _mm512_set1_ps(scale);
  for (; i < n; i += 32) {
    const int64_t r = n - i;
    const __mmask32 live = r >= 32 ? __mmask32(0xffffffffu) : __mmask32((1u << r) - 1u);
    __m512 a, b;
    dec.decode32(_mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(live, in + i)), s, a, b);
    _mm512_mask_storeu_ps(out + i, static_cast<__mmask16>(live), a);
    _mm512_mask_storeu_ps(out + i + 16, static_cast<__mmask16>(live >> 16), b);
  }
#endif
  // AVX2 and default: scalar loads (g++ vectorizes the multiply: 0.18 ns per element on the
  // Zen 5 measured; an 8-lane gather 0.45, 8 codes per 64-bit read and inserts 0.19)
  for (; i < n; ++i) out[i] = t.decode[in[i]] * scale;
}

#if defined(CPU_CAPABILITY_AVX512)
// The AVX-512 encode: the AVX2 encode's decade pieces (kDynamicPiece*; see the AVX2 branch of
// dynamic_encode_block) on 16 lanes: a = min(|y|, 1) by one vrangeps, the binade pair q of a,
// the next piece's start (plus kDynamicRecipGuard) by q and its difference to a's bits (its
// sign: past the start; small: the lane is flagged), t = fma(a, A[p], B[p]) in fixed point
// (16 bits below the point) with the piece's A, B and top code read by one-register permutes
// on q + (past the start), the flag of a t within 2^-12 of an integer, the cap by the piece's
// top code; signed map: 127 folded into B and the top codes (k' = 127 + k; code k' or 254 -
// k' by y's sign, applied to 64 codes at once), unsigned: code 0 where y's sign bit is set.
// Its codes are those of dynamic_encode_bits wherever a lane is not flagged
// (scripts/check_dynamic_map_exhaustive.cpp: every float32 y and its neighbours, and the block
// encode against the lane function); word permutes, a saturating pack and one qword permute
// put 64 codes in order. Flagged lanes are redone by dynamic_encode_scalar. About 18 vector
// operations per 16 values (signed; the 37 of the binary search on the thresholds' 16-bit key
// halves before it: 0.21 ns per element on the Zen 5 measured,
// scripts/bench_dynamic_map_block.cpp). On the Zen 5 measured (a 16-value group's chain ~45
// cycles long, the loop ~8 cycles per 16 values) both the operations and the latency before
// the FMA count: indexing the tables by pair and past-the-start bit took the byte shuffle to
// the piece (kDynamicPieceBinade*) off that path, an arithmetic shift and subtraction (4
// cycles) replaced a compare into a mask register and a masked add (~9 cycles; mask-register
// logic and masked merges are slow there too): 6% off the encode; one-register tables
// instead of two-register ones (index q + 16) 1-3%; the guard folded into the start table 5%;
// each operation fewer per 16 values ~3-5%, each extra permute or vector operation as much
// slower (both tables of a pair selected by the sign, or the flag as a vector: 5-15%).
// DynamicPieces' tables of one map by binade pair q (kDynamicPieceBinade*: the piece p(q) at
// the pair's bottom): the piece's A, B (the offsets with the signed map's 127 folded in, rounded
// to float32: ulp 2^-4 below 2^20 in the kDynamicPieceFracBits fixed point; the exhaustive
// check covers the rounded tables; both times 2^4, exactly) and top code (127 folded in; in the
// high half, 0xffff below), and the start of piece p(q) + 1 plus kDynamicRecipGuard (the last
// piece's: INT_MAX). A pair holds at most one piece start, and where it holds one, the next
// pair's bottom lies in the piece after it (p(q + 1) = p(q) + 1), so entry q + 1 serves the
// lanes past the start in pair q: the index is q + (a past the start), and each table is one
// register (a one-register dword permute, no copy of a table or index as two-register
// permutes need). Built once.
struct DynamicPieceTables {
  alignas(64) float scale[16];
  alignas(64) float offset[16];
  alignas(64) int32_t top[16];
  alignas(64) int32_t start[16];
};

inline const DynamicPieceTables& dynamic_piece_tables(bool is_unsigned) {
  static const DynamicPieceTables* tabs = [] {
    static DynamicPieceTables tb[2] = {};
    for (int u = 0; u < 2; ++u) {
      const int32_t fold = u ? 0 : 127;  // signed: k' = 127 + k
      const uint8_t* binade = u ? kDynamicPieceBinadeUnsigned : kDynamicPieceBinadeSigned;
      for (int q = 0; q < 16; ++q) {
        const int p = binade[q];
        // times 2^4, exactly: t in fixed point with 16 bits below the point
        tb[u].scale[q] = (u ? kDynamicPieceScaleUnsigned : kDynamicPieceScaleSigned)[p] * 16.0f;
        tb[u].offset[q] = ((u ? kDynamicPieceOffsetUnsigned : kDynamicPieceOffsetSigned)[p] +
                           static_cast<float>(fold << kDynamicPieceFracBits)) * 16.0f;
        const int32_t top = (u ? kDynamicPieceTopUnsigned : kDynamicPieceTopSigned)[p] + fold;
        tb[u].top[q] = (top << 16) | 0xffff;
        const int32_t start = (u ? kDynamicPieceStartUnsigned : kDynamicPieceStartSigned)[p];
        tb[u].start[q] = start == INT32_MAX ? start : start + kDynamicRecipGuard;
      }
    }
    return tb;
  }();
  return tabs[is_unsigned ? 1 : 0];
}

struct DynamicPieces {
  __m512 scale_tab, offset_tab;
  __m512i top_tab, start_tab;
  explicit DynamicPieces(bool is_unsigned) {
    const DynamicPieceTables& tb = dynamic_piece_tables(is_unsigned);
    scale_tab = _mm512_load_ps(tb.scale);
    offset_tab = _mm512_load_ps(tb.offset);
    top_tab = _mm512_load_si512(tb.top);
    start_tab = _mm512_load_si512(tb.start);
  }
  // The codes of the 16 values y (not NaN) in 32-bit lanes (signed map: -1 for y <= -1,
  // saturated to 0 by the caller), and in near the live lanes whose t lies within 2^-12 of an
  // integer or whose a lies within kDynamicRecipGuard float32 steps of the next piece's start
  // (the piece is found exactly on a's bits, and t need not be near an integer at a piece's
  // start; a negative y's boundary lies 0-2 steps below the positive one's).
  template <bool kUnsigned>
  inline __attribute__((always_inline)) __m512i codes16y(__m512 y, __mmask16 live,
                                                         __mmask16& near) const {
    const __m512i k = _mm512_srli_epi32(codes16w<kUnsigned>(y, live, near), 16);
    if constexpr (kUnsigned) {
      return k;
    } else {  // k' = 127 + k; 127 - k = 254 - k' for negative y
      return _mm512_mask_sub_epi32(k, _mm512_movepi32_mask(_mm512_castps_si512(y)),
                                   _mm512_set1_epi32(254), k);
    }
  }
  // codes16y's codes (signed: k', the sign not applied) in the high 16 bits of each lane
  template <bool kUnsigned>
  inline __attribute__((always_inline)) __m512i codes16w(__m512 y, __mmask16 live,
                                                         __mmask16& near) const {
    // a: the smaller magnitude of y and 1, sign cleared (inf -> 1; y is not NaN); unsigned:
    // code 0 where y's sign bit is set (-0.0 and -inf included), the lane zeroed at the end
    // (one operation and 2 cycles less before the piece search than a = max(min(y, 1), 0):
    // 3-6% off the unsigned map's encode on the Zen 5 measured)
    const __m512 a = _mm512_range_ps(y, _mm512_set1_ps(1.0f), 0x0a);
    const __m512i ab = _mm512_castps_si512(a);
    const __m512i pair = _mm512_srli_epi32(
        _mm512_subs_epu8(ab, _mm512_set1_epi32((kDynamicPieceBias / 2) << 24)), 24);
    // start + guard - ab: in [0, 2 guard] near the next piece's start (the lane is flagged),
    // negative past start + guard
    const __m512i rel = _mm512_sub_epi32(_mm512_permutexvar_epi32(pair, start_tab), ab);
    // the tables' index: pair, plus 1 past start + guard (a lane in (start, start + guard] is
    // flagged, so the lower piece may serve it: no addition for the flag, 5% off the encode);
    // no mask: a compare into a mask register and its use cost ~9 cycles of latency on the
    // Zen 5 measured, this 4
    const __m512i idx = _mm512_sub_epi32(pair, _mm512_srai_epi32(rel, 31));
    const __m512i ti = _mm512_cvttps_epi32(_mm512_fmadd_ps(
        a, _mm512_permutexvar_ps(idx, scale_tab), _mm512_permutexvar_ps(idx, offset_tab)));
    // ti = trunc(2^16 t): 16 times the kDynamicPieceFracBits fixed point's (the tables' 2^4
    // is exact), so its bits 4-15 are the 12 bits below that point
    near = _mm512_mask_testn_epi32_mask(
               live, ti, _mm512_set1_epi32(((1 << kDynamicPieceFracBits) - 2) << 4)) |
           _mm512_mask_cmple_epu32_mask(live, rel, _mm512_set1_epi32(2 * kDynamicRecipGuard));
    // the cap: top code in the high half, 0xffff below
    const __m512i top = _mm512_permutexvar_epi32(idx, top_tab);
    if constexpr (kUnsigned) {
      const __mmask16 positive = _mm512_testn_epi32_mask(_mm512_castps_si512(y),
                                                         _mm512_set1_epi32(INT32_MIN));
      return _mm512_maskz_min_epi32(positive, ti, top);
    } else {
      return _mm512_min_epi32(ti, top);
    }
  }
  // codes16y of the 16 values at p (live lanes read, the others 0) scaled by d: y = x * d
  // (kRecip: d = 1 / div, see dynamic_recip_ok) or x / d (d = div, not NaN)
  template <bool kUnsigned, bool kRecip>
  inline __attribute__((always_inline)) __m512i codes16(const float* p, __mmask16 live,
                                                        __m512 d, __mmask16& near) const {
    const __m512 x = _mm512_maskz_loadu_ps(live, p);
    return codes16y<kUnsigned>(kRecip ? _mm512_mul_ps(x, d) : _mm512_div_ps(x, d), live, near);
  }
  // out[j] = dynamic_encode_scalar(in[j] / div) for the lanes set in lanes
  static void redo(const float* in, unsigned lanes, float div, const DynamicTables& t,
                   uint8_t* out) {
    for (; lanes != 0u; lanes &= lanes - 1u) {
      const int j = __builtin_ctz(lanes);
      out[j] = static_cast<uint8_t>(dynamic_encode_scalar(in[j] / div, t));
    }
  }
  // the codes of the 64 values at in (d: see codes16) to out
  template <bool kUnsigned, bool kRecip>
  inline __attribute__((always_inline)) void encode64(const float* in, __m512 d, float div,
                                                      const DynamicTables& t,
                                                      uint8_t* out) const {
    __mmask16 near[4];
    __m512 y[4];
    __m512i c[4];
    for (int v = 0; v < 4; ++v) {
      const __m512 x = _mm512_loadu_ps(in + 16 * v);
      y[v] = kRecip ? _mm512_mul_ps(x, d) : _mm512_div_ps(x, d);
      c[v] = codes16w<kUnsigned>(y[v], 0xffff, near[v]);
    }
    // the high halves of two registers' lanes in order (word j: word 2 j + 1 of the pair)
    const __m512i high = _mm512_setr_epi32(
        0x00030001, 0x00070005, 0x000b0009, 0x000f000d, 0x00130011, 0x00170015, 0x001b0019,
        0x001f001d, 0x00230021, 0x00270025, 0x002b0029, 0x002f002d, 0x00330031, 0x00370035,
        0x003b0039, 0x003f003d);
    auto highs = [&](__m512i lo, __m512i hi) __attribute__((always_inline)) {
      return _mm512_permutex2var_epi16(lo, high, hi);
    };
    // codes 0-31 and 32-63 in words, packed to bytes (codes <= 255): qword 2 m of the pack
    // holds codes 8 m .. 8 m + 7, qword 2 m + 1 codes 32 + 8 m ..; one qword permute puts
    // them in order. 4 operations per 64 codes where codes in the low bits took 8 (4 shifts,
    // 3 packs with saturation, a dword permute): 6% (signed) / 9% (unsigned) off the encode
    // on the Zen 5 measured
    __m512i k = _mm512_packus_epi16(highs(c[0], c[1]), highs(c[2], c[3]));
    if constexpr (!kUnsigned) {
      // signed: the sign applied to 64 codes at once (254 - k' with unsigned byte
      // saturation, -1 -> 0 as the packs' saturation of codes16y's codes), the mask from the
      // high halves of y's bits in the codes' order (the sign kept by the signed saturation):
      // per 64 values 2 word permutes, a pack and one byte mask for 4 dword masks and 4
      // masked subtractions (~4% off the signed map's encode on the Zen 5 measured)
      auto bits = [](__m512 v) { return _mm512_castps_si512(v); };
      const __mmask64 neg = _mm512_movepi8_mask(_mm512_packs_epi16(
          highs(bits(y[0]), bits(y[1])), highs(bits(y[2]), bits(y[3]))));
      k = _mm512_mask_subs_epu8(k, neg, _mm512_set1_epi8(static_cast<char>(254)), k);
    }
    _mm512_storeu_si512(out, _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7),
                                                      k));
    if (__builtin_expect((near[0] | near[1] | near[2] | near[3]) != 0, 0)) {
      for (int v = 0; v < 4; ++v) redo(in + 16 * v, near[v], div, t, out + 16 * v);
    }
  }
  // the codes of the min(r, 16) values at in to out (a block's tail; nothing read or written
  // past them)
  template <bool kUnsigned, bool kRecip>
  inline void encode16(const float* in, int64_t r, __m512 d, float div, const DynamicTables& t,
                       uint8_t* out) const {
    const __mmask16 live = r >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << r) - 1u);
    __mmask16 near;
    const __m512i c = _mm512_max_epi32(codes16<kUnsigned, kRecip>(in, live, d, near),
                                       _mm512_setzero_si512());
    _mm512_mask_cvtepi32_storeu_epi8(out, live, c);
    if (__builtin_expect(near != 0, 0)) redo(in, near, div, t, out);
  }
};
#endif

// out[i] = the code of in[i] / div for i < n (n <= kMomentBlock).
inline void dynamic_encode_block(const float* __restrict in, int64_t n, float div,
                                 const DynamicTables& t, uint8_t* __restrict out) {
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
  // DynamicPieces (above), 64 values a round. A NaN divisor (a block holding NaN; else no y is
  // NaN) takes the scalar loop.
  if (div == div) {  // else NaN: every y is NaN, the scalar loop below
    const bool is_unsigned = t.map == kDynamicMapUnsigned;
    const DynamicPieces pieces(is_unsigned);
    const bool recip = dynamic_recip_ok(div);
    const __m512 d = _mm512_set1_ps(recip ? 1.0f / div : div);
    // inlined: a call would read the captured locals (in, out, i, the tables) from memory
    auto run = [&](auto unsigned_tag, auto recip_tag) __attribute__((always_inline)) {
      constexpr bool kUnsigned = decltype(unsigned_tag)::value;
      constexpr bool kRecip = decltype(recip_tag)::value;
      for (; i + 64 <= n; i += 64) {
        pieces.encode64<kUnsigned, kRecip>(in + i, d, div, t, out + i);
      }
      for (; i < n; i += 16) {
        pieces.encode16<kUnsigned, kRecip>(in + i, n - i, d, div, t, out + i);
      }
    };
    if (recip) {  // y = x * (1 / div): see dynamic_recip_ok
      if (is_unsigned) {
        run(std::true_type{}, std::true_type{});
      } else {
        run(std::false_type{}, std::true_type{});
      }
    } else if (is_unsigned) {
      run(std::true_type{}, std::false_type{});
    } else {
      run(std::false_type{}, std::false_type{});
    }
  }
#elif defined(CPU_CAPABILITY_AVX2)
  // No gather (this CPU's 8-lane gather cost more than the rest of the encode): the map is
  // linear within each decade, so on a = min(|y|, 1) the magnitude code k (signed: code =
  // 127 +- k by y's sign, saturated to [0, 255], on the packed bytes of 32 lanes; unsigned:
  // code = k, 0 for y < 0) is
  // min(floor(a A[p] + B[p]), hi[p]) on the piece p of a (kDynamicPiece*,
  // scripts/gen_dynamic_map.py --pieces, which checks the fit). The pieces start at the first
  // code of each decade, found exactly on the bits of a: a byte table by binade pair (vpshufb),
  // then one compare with the next piece's start; the key is a's bits less 2 for negative y (a
  // negative decade start lies 0-2 ulps from the positive one; where the key misplaces a lane,
  // its t lies on an integer and the lane is flagged). t = a A[p] + B[p] crosses the integer j
  // within 2^-15 of the threshold of k >= j inside the piece; a lane whose t lies within 2^-12
  // of an integer (about 1 in 2000 of uniform t) is redone by dynamic_encode_scalar. The code
  // depends on y only and y = x / div is IEEE division, so
  // scripts/check_dynamic_map_exhaustive.cpp (every float32 y) checks every divisor.
  const bool is_unsigned = t.map == kDynamicMapUnsigned;
  const __m256 scale_tab = _mm256_load_ps(is_unsigned ? kDynamicPieceScaleUnsigned
                                                      : kDynamicPieceScaleSigned);
  const __m256 offset_tab = _mm256_load_ps(is_unsigned ? kDynamicPieceOffsetUnsigned
                                                       : kDynamicPieceOffsetSigned);
  const __m256i top_tab = _mm256_load_si256(reinterpret_cast<const __m256i*>(
      is_unsigned ? kDynamicPieceTopUnsigned : kDynamicPieceTopSigned));
  const __m256i start_tab = _mm256_load_si256(reinterpret_cast<const __m256i*>(
      is_unsigned ? kDynamicPieceStartUnsigned : kDynamicPieceStartSigned));
  const __m256i binade_tab = _mm256_load_si256(reinterpret_cast<const __m256i*>(
      is_unsigned ? kDynamicPieceBinadeUnsigned : kDynamicPieceBinadeSigned));
  const __m256 d = _mm256_set1_ps(div);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256i bias = _mm256_set1_epi32((kDynamicPieceBias / 2) << 24);
  const __m256i zero = _mm256_setzero_si256();
  const __m256i frac_mask = _mm256_set1_epi32((1 << kDynamicPieceFracBits) - 2);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  // The codes of 8 values (32-bit lanes), the piece's t in fixed point: ti = trunc(2^bits t
  // + 1) (A and B scaled by 2^bits exactly, B plus 1: kDynamicPieceFracBits). ti & (2^bits -
  // 2) is 0 iff t lies within 2^-bits of an integer (the lane is flagged; otherwise ti >> bits
  // = floor(t)); the minimum over a group of 32 says whether any lane is.
  auto codes8 = [&](auto unsigned_tag, const float* p, __m256i& near) {  // near: per lane
    constexpr bool kUnsigned = decltype(unsigned_tag)::value;
    const __m256 y = _mm256_div_ps(_mm256_loadu_ps(p), d);
    // inf -> 1 (y is not NaN); unsigned: y <= 0 (-0.0, -inf included) -> +0.0, code 0
    const __m256 a = kUnsigned ? _mm256_max_ps(_mm256_min_ps(y, one), _mm256_setzero_ps())
                               : _mm256_min_ps(_mm256_and_ps(y, abs_mask), one);
    const __m256i ab = _mm256_castps_si256(a);
    const __m256i u = _mm256_castps_si256(y);
    // the key: a's bits, less 2 for negative y (|y| < 2; else a = 1, the last piece either way)
    const __m256i key = kUnsigned ? ab : _mm256_add_epi32(ab, _mm256_srai_epi32(u, 30));
    // the binade pair max(E - bias, 0) / 2 from a's top byte (E / 2, E <= 127): < 16; the
    // upper bytes are 0 and read table[0] = 0
    const __m256i pair = _mm256_srli_epi32(_mm256_subs_epu8(ab, bias), 24);
    const __m256i plo = _mm256_shuffle_epi8(binade_tab, pair);
    const __m256i piece = _mm256_sub_epi32(
        plo, _mm256_cmpgt_epi32(key, _mm256_permutevar8x32_epi32(start_tab, plo)));
    const __m256i ti = _mm256_cvttps_epi32(
        _mm256_fmadd_ps(a, _mm256_permutevar8x32_ps(scale_tab, piece),
                        _mm256_permutevar8x32_ps(offset_tab, piece)));
    near = _mm256_and_si256(ti, frac_mask);
    const __m256i k = _mm256_min_epi32(_mm256_srai_epi32(ti, kDynamicPieceFracBits),
                                       _mm256_permutevar8x32_epi32(top_tab, piece));
    return k;  // signed: the magnitude code, the sign applied to the packed bytes
  };
  auto run = [&](auto unsigned_tag) {
    for (; i + 32 <= n; i += 32) {
      __m256i near[4];
      const __m256i c0 = codes8(unsigned_tag, in + i, near[0]),
                    c1 = codes8(unsigned_tag, in + i + 8, near[1]),
                    c2 = codes8(unsigned_tag, in + i + 16, near[2]),
                    c3 = codes8(unsigned_tag, in + i + 24, near[3]);
      const __m256i any = _mm256_cmpeq_epi32(
          _mm256_min_epu32(_mm256_min_epu32(near[0], near[1]), _mm256_min_epu32(near[2], near[3])),
          zero);
      // 32 -> 16 -> 8 bits (codes <= 255), lanes back in order
      __m256i bytes =
          _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3));
      if constexpr (!decltype(unsigned_tag)::value) {
        // signed: the code 127 + k or 127 - k by y's sign, on the 32 packed magnitudes k <= 128
        // (saturated: 255 for y >= 1, 0 for y <= -1); y's sign is x's (div > 0), packed the same
        // way (signed saturation keeps it; -0.0 gives 127 - 0)
        auto x8 = [&](int64_t j) {
          return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + j));
        };
        const __m256i sign = _mm256_packs_epi16(_mm256_packs_epi32(x8(i), x8(i + 8)),
                                                _mm256_packs_epi32(x8(i + 16), x8(i + 24)));
        const __m256i c127 = _mm256_set1_epi8(127);
        bytes = _mm256_blendv_epi8(_mm256_adds_epu8(c127, bytes), _mm256_subs_epu8(c127, bytes),
                                   sign);
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                          _mm256_permutevar8x32_epi32(bytes, order));
      if (__builtin_expect(!_mm256_testz_si256(any, any), 0)) {  // the flagged lanes only
        for (int v = 0; v < 4; ++v) {
          unsigned lanes = static_cast<unsigned>(
              _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(near[v], zero))));
          for (; lanes != 0u; lanes &= lanes - 1u) {
            const int64_t j = i + 8 * v + __builtin_ctz(lanes);
            out[j] = static_cast<uint8_t>(dynamic_encode_scalar(in[j] / div, t));
          }
        }
      }
    }
  };
  if (div > 0.0f) {  // else NaN (every y is NaN; dynamic_scale's div is > 0): the scalar loop
    if (is_unsigned) {
      run(std::true_type{});
    } else {
      run(std::false_type{});
    }
  }
#endif
  for (; i < n; ++i) out[i] = static_cast<uint8_t>(dynamic_encode_scalar(in[i] / div, t));
}

// dynamic_encode_block of exp_avg's block (signed map) and exp_avg_sq's (unsigned), both of n
// values: AVX-512, where both divisors take the reciprocal (dynamic_recip_ok) and n is a
// multiple of 64, in one loop, 64 values of each a round (one set-up, two independent chains in
// flight): 2.14 -> 2.07 ns per 8 elements of each moment against two dynamic_encode_block
// calls (scripts/bench_dynamic_map_block.cpp, one thread, Zen 5), the same codes.
inline void dynamic_encode_block2(const float* __restrict m, float mdiv, uint8_t* __restrict mout,
                                  const float* __restrict v, float vdiv,
                                  uint8_t* __restrict vout, int64_t n) {
#if defined(CPU_CAPABILITY_AVX512)
  if (n % 64 == 0 && dynamic_recip_ok(mdiv) && dynamic_recip_ok(vdiv)) {
    const DynamicTables& mt = dynamic_tables(false);
    const DynamicTables& vt = dynamic_tables(true);
    const DynamicPieces mp(false), vp(true);
    const __m512 md = _mm512_set1_ps(1.0f / mdiv), vd = _mm512_set1_ps(1.0f / vdiv);
    for (int64_t i = 0; i < n; i += 64) {
      mp.encode64<false, true>(m + i, md, mdiv, mt, mout + i);
      vp.encode64<true, true>(v + i, vd, vdiv, vt, vout + i);
    }
    return;
  }
#endif
  dynamic_encode_block(m, n, mdiv, dynamic_tables(false), mout);
  dynamic_encode_block(v, n, vdiv, dynamic_tables(true), vout);
}

}  // namespace
}  // namespace cpu
}  // namespace tpamp
