// Exhaustive check of the CPU launcher's uint8 encode (csrc/cpu/dynamic_map_simd.h) against the
// CUDA launcher's rule (dynamic_encode_bits, csrc/kernels/optimizer_step.h): every one of the
// 2^32 float32 bit patterns through both maps (a NaN y only with a NaN divisor, as the kernel
// makes it), every block length 0..256 with NaN, -NaN and finite divisors, the decode (AVX-512
// on a CPU with VBMI: also DynamicDecoderVbmi on every code at every position), and the
// block absmax; then a timing per element (thread CPU time). Not part of the build; a few minutes
// per capability:
//
//   TI=$(python -c "import torch.utils.cpp_extension as c; print(c.include_paths()[0])")
//   g++ -O3 -std=c++17 -I$TI -DCPU_CAPABILITY_AVX512 -mavx512f -mavx512bw -mavx512vl \
//       -mavx512dq -mavx2 -mfma -mf16c scripts/check_dynamic_map_exhaustive.cpp -o /tmp/chk
//   /tmp/chk all        # (-DCPU_CAPABILITY_AVX2 -mavx2 -mfma -mf16c; -DCPU_CAPABILITY_DEFAULT)
//
// Without an argument it only times. Prints "mismatches 0" and exits 0 when all agree.
#include "../csrc/cpu/dynamic_map_simd.h"
#include <cstdio>
#include <chrono>
#include <vector>
#include <random>
#include <cstring>
#include <cmath>
#include <algorithm>
using namespace tpamp; using namespace tpamp::cpu;
#include <time.h>
static double cpu_now() { timespec ts; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts); return ts.tv_sec + ts.tv_nsec * 1e-9; }
static uint32_t wf[2][2 * kDynamicSlots];
static const uint32_t* floor_of(int u) { return wf[u]; }
#if defined(CPU_CAPABILITY_AVX512)
// DynamicDecoderVbmi (the one-pass loop's decode where the CPU has VBMI) on 256 codes
#pragma GCC push_options
#pragma GCC target("avx512vbmi")
static void decode_vbmi(const uint8_t* c, float s, const DynamicTables& t, float* out) {
  const DynamicDecoderVbmi dec(t);
  for (int q = 0; q < 4; ++q) {
    __m512 o[4];
    dec.decode64(_mm512_loadu_si512(c + 64 * q), _mm512_set1_ps(s), o);
    for (int r = 0; r < 4; ++r) _mm512_storeu_ps(out + 64 * q + 16 * r, o[r]);
  }
}
#pragma GCC pop_options
#endif
// The lane function of the capability's encode on 16 values y (not NaN): the code (before
// any redo) and whether the lane is flagged (redone by division). false where the capability has
// none (AVX2 and the scalar path divide).
static bool lane_codes(int u, const float* y, uint8_t* code, uint8_t* flag) {
#if defined(CPU_CAPABILITY_AVX512)
  const DynamicPieces pieces(u != 0);
  __mmask16 near;
  const __m512 v = _mm512_loadu_ps(y);
  __m512i c = u ? pieces.codes16y<true>(v, 0xffff, near) : pieces.codes16y<false>(v, 0xffff, near);
  c = _mm512_max_epi32(c, _mm512_setzero_si512());
  _mm512_mask_cvtepi32_storeu_epi8(code, 0xffff, c);
  for (int k = 0; k < 16; ++k) flag[k] = (near >> k) & 1u;
  return true;
#else
  (void)u; (void)y; (void)code; (void)flag;
  return false;
#endif
}
// float32 bits <-> a key ordered as the values (-0 and +0 both 0)
static int64_t key_of(uint32_t b) { return (b >> 31) ? -int64_t(b & 0x7fffffffu) : int64_t(b); }
static uint32_t bits_of(int64_t k) { return k < 0 ? 0x80000000u | uint32_t(-k) : uint32_t(k); }
int main(int argc, char** argv) {
  for (int i = 0; i < 2 * kDynamicSlots; ++i) { wf[0][i] = kDynamicFloorSigned[i]; wf[1][i] = kDynamicFloorUnsigned[i]; }
  long bad = 0;
  if (argc > 1) {
  for (int u = 0; u < 2; ++u) {
    const DynamicTables& t = dynamic_tables(u);
    alignas(64) float in[256]; alignas(64) uint8_t out[256];
    for (uint64_t base = 0; base < (1ull << 32); base += 256) {
      for (int k = 0; k < 256; ++k) { uint32_t b = uint32_t(base + k); memcpy(&in[k], &b, 4); }
      dynamic_encode_block(in, 256, 1.0f, t, out);
      for (int k = 0; k < 256; ++k) {
        uint32_t ref = dynamic_encode_bits(in[k] / 1.0f, t.map, floor_of(u));
        if (in[k] != in[k]) continue;  // a NaN y comes only with a NaN divisor (below)
        if (ref != out[k]) { if (bad < 10) printf("u=%d bits=%08x ref=%u got=%u\n", u, uint32_t(base+k), ref, out[k]); ++bad; }
      }
    }
    // short blocks (tails)
    for (int n = 0; n <= 256; ++n) {
      std::mt19937 g(n);
      for (int k = 0; k < 256; ++k) { uint32_t b = g(); memcpy(&in[k], &b, 4); }
      memset(out, 0xaa, 256);
      for (int k = 0; k < 256; ++k) if (in[k] != in[k]) in[k] = 0.5f;
      const float dv = (n % 3 == 0) ? std::nanf("") : (n % 3 == 1 ? -std::nanf("") : 3.0f);
      if (dv != dv && n % 2) { for (int k = 0; k < 256; k += 7) { uint32_t b = 0xffc00001u; memcpy(&in[k], &b, 4); } }
      dynamic_encode_block(in, n, dv, t, out);
      for (int k = 0; k < 256; ++k) {
        uint32_t ref = k < n ? dynamic_encode_bits(in[k] / dv, t.map, floor_of(u)) : 0xaa;
        if (ref != out[k]) { ++bad; if (bad < 20) printf("tail n=%d k=%d\n", n, k); }
      }
      float dec[256]; uint8_t codes[256];
      for (int k = 0; k < 256; ++k) codes[k] = g();
      for (int k = 0; k < 256; ++k) dec[k] = -7.0f;
      dynamic_decode_block(codes, n, 0.37f, t, dec);
      for (int k = 0; k < 256; ++k) { float r = k < n ? t.map[codes[k]] * 0.37f : -7.0f; if (memcmp(&r, &dec[k], 4)) { ++bad; if (bad < 20) printf("dec n=%d k=%d\n", n, k);} }
    }
  }
  // The reciprocal encode (dynamic_recip_ok): the lane function sees y' = RN(x * RN(1/div)),
  // at most 2 float32 steps from y = RN(x / div). Every float32 y' (NaN aside: the lanes never
  // see one) whose lane is not flagged must have the code of every value within kSteps steps of
  // it (the code is monotone in y: the values kSteps below and above suffice; their codes come
  // from dynamic_encode_block with div 1, checked exactly above). The block encode's 64-value
  // rounds (AVX-512: the signed map's sign applied after the packs) must give the lane
  // function's code in every lane it does not flag: dynamic_encode_block of y' with div 1
  // (1 / div = 1: the same y') against lane_codes.
  {
    constexpr int64_t kSteps = 3;
    long unflagged = 0;
    alignas(64) float y[256], lo[256], hi[256];
    alignas(64) uint8_t code[256], flag[256], clo[256], chi[256], cblk[256];
    for (int u = 0; u < 2 && lane_codes(u, y, code, flag); ++u) {
      const DynamicTables& t = dynamic_tables(u);
      for (uint64_t base = 0; base < (1ull << 32); base += 256) {
        for (int k = 0; k < 256; ++k) {
          uint32_t b = uint32_t(base + k);
          if ((b & 0x7fffffffu) > 0x7f800000u) b &= 0xff800000u;  // NaN -> inf of its sign
          const int64_t key = key_of(b);
          const int64_t kl = std::max<int64_t>(key - kSteps, -0x7f800000ll);
          const int64_t kh = std::min<int64_t>(key + kSteps, 0x7f800000ll);
          uint32_t bl = bits_of(kl), bh = bits_of(kh);
          memcpy(&y[k], &b, 4); memcpy(&lo[k], &bl, 4); memcpy(&hi[k], &bh, 4);
        }
        for (int k = 0; k < 256; k += 16) lane_codes(u, y + k, code + k, flag + k);
        dynamic_encode_block(lo, 256, 1.0f, t, clo);
        dynamic_encode_block(hi, 256, 1.0f, t, chi);
        dynamic_encode_block(y, 256, 1.0f, t, cblk);
        for (int k = 0; k < 256; ++k) {
          if (flag[k]) continue;
          ++unflagged;
          if (code[k] != clo[k] || code[k] != chi[k] || code[k] != cblk[k]) {
            if (bad < 10) printf("recip u=%d bits=%08x code=%u lo=%u hi=%u block=%u\n", u, uint32_t(base + k), code[k], clo[k], chi[k], cblk[k]);
            ++bad;
          }
        }
      }
    }
    printf("reciprocal: %ld unflagged y checked against +-%ld steps\n", unflagged, long(kSteps));
    // and blocks of random values and divisors against dynamic_encode_bits(x / div)
    long pairs = 0;
    alignas(64) float pin[256]; alignas(64) uint8_t pout[256];
    for (int trial = 0; trial < 400000; ++trial) {
      std::mt19937 g(trial + 7);
      const int u = trial & 1;
      const DynamicTables& t = dynamic_tables(u);
      uint32_t db = (g() & 0x7fffffffu) % 0x7f800000u;
      if (trial % 5 == 1) db = 0x3f800000u + (g() & 0x7fffffu);
      if (trial % 5 == 2) db = (g() % 24 < 12) ? 0x00800000u + (g() % 4) - 2 : 0x7e800000u + (g() % 4) - 2;
      float dv; memcpy(&dv, &db, 4);
      if (dv == 0.0f) dv = 1.0f;
      for (int k = 0; k < 256; ++k) {
        // |x| <= div mostly (as the kernels: div is the block's absmax), some above
        const float f = (g() % 8 == 0) ? 1.0f + float(g() % 100) : std::ldexp(float(g() % (1 << 24)) / float(1 << 24), -int(g() % 40));
        pin[k] = ((g() & 1) ? -1.0f : 1.0f) * f * dv;
        if (k == int(g() % 256)) pin[k] = dv;
      }
      const int n = 1 + int(g() % 256);
      dynamic_encode_block(pin, n, dv, t, pout);
      for (int k = 0; k < n; ++k) {
        const uint32_t ref = dynamic_encode_bits(pin[k] / dv, t.map, floor_of(u));
        ++pairs;
        if (ref != pout[k]) { if (bad < 20) printf("pair div=%a x=%a ref=%u got=%u\n", dv, pin[k], ref, pout[k]); ++bad; }
      }
    }
    printf("random divisors: %ld values\n", pairs);
  }
  // absmax
  for (int trial = 0; trial < 200000; ++trial) {
    std::mt19937 g(trial);
    int n = 1 + g() % 256;
    alignas(64) float b[256];
    for (int k = 0; k < n; ++k) { float v = std::ldexp(float(int(g() % 2001) - 1000), int(g() % 60) - 40); b[k] = v; }
    int kind = g() % 8;
    if (kind == 1) b[g() % n] = INFINITY; if (kind == 2) b[g() % n] = -INFINITY;
    if (kind == 3) { uint32_t nb = 0x7f800000u | (g() & 0x807fffffu) | 1u; memcpy(&b[g() % n], &nb, 4); }
    if (kind == 4) for (int k = 0; k < n; ++k) b[k] = (k & 1) ? -0.0f : 0.0f;
    float ref = 0.0f; for (int k = 0; k < n; ++k) ref = max_propagate_nan(ref, fabsf(b[k]));
    int calls = 0;
    float got = dynamic_absmax(b, n, [&] { ++calls; return ref; });
    if (memcmp(&got, &ref, 4) && !(ref != ref && calls == 1)) { ++bad; if (bad < 20) printf("absmax trial %d n %d\n", trial, n); }
    if ((ref != ref) != (calls == 1)
#if !defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
        && false
#endif
       ) { ++bad; if (bad < 20) printf("absmax nan path trial %d\n", trial); }
  }
#if defined(CPU_CAPABILITY_AVX512)
  if (dynamic_vbmi_enabled()) {  // every code at every position, random codes, several scales
    long checked = 0;
    for (int u = 0; u < 2; ++u) {
      const DynamicTables& t = dynamic_tables(u);
      for (int trial = 0; trial < 20000; ++trial) {
        std::mt19937 g(trial);
        alignas(64) uint8_t codes[256]; alignas(64) float dec[256];
        for (int k = 0; k < 256; ++k) codes[k] = trial < 256 ? uint8_t(k + trial) : uint8_t(g());
        const float sc = trial % 7 == 0 ? std::nanf("") : (trial % 5 == 0 ? 3.4028235e38f : std::ldexp(float(g() % 1000 + 1), int(g() % 80) - 60));
        decode_vbmi(codes, sc, t, dec);
        for (int k = 0; k < 256; ++k) {
          const float r = t.map[codes[k]] * sc;
          ++checked;
          if (memcmp(&r, &dec[k], 4)) { ++bad; if (bad < 20) printf("vbmi decode u=%d trial=%d k=%d\n", u, trial, k); }
        }
      }
    }
    printf("vbmi decode: %ld values\n", checked);
  }
#endif
  printf("mismatches %ld\n", bad);
  }
  // timing
  std::mt19937 g(1); std::normal_distribution<float> nd(0, 1);
  const int NB = 4096; std::vector<float> x(NB * 256); for (auto& v : x) v = nd(g) * 1e-3f;
  std::vector<uint8_t> c(NB * 256); std::vector<float> y(NB * 256);
  for (int u = 0; u < 2; ++u) {
    const DynamicTables& t = dynamic_tables(u);
    for (int rep = 0; rep < 3; ++rep) {
      auto t0 = cpu_now();
      for (int r = 0; r < 10; ++r) for (int b = 0; b < NB; ++b) dynamic_encode_block(&x[b*256], 256, 4e-3f, t, &c[b*256]);
      auto t1 = cpu_now();
      for (int r = 0; r < 10; ++r) for (int b = 0; b < NB; ++b) dynamic_decode_block(&c[b*256], 256, 4e-3f, t, &y[b*256]);
      auto t2 = cpu_now();
      double ne = 10.0 * NB * 256;
      auto t3 = cpu_now(); float acc = 0; for (int r = 0; r < 10; ++r) for (int b = 0; b < NB; ++b) acc += dynamic_absmax(&x[b*256], 256, [] { return 0.0f; });
      auto t4 = cpu_now(); if (acc == 1.2345f) printf("!");
      printf("absmax %.3f ns/el ", (t4-t3)/ne*1e9);
      printf("u=%d encode %.3f ns/el decode %.3f ns/el\n", u, (t1-t0)/ne*1e9, (t2-t1)/ne*1e9);
    }
  }
  return bad != 0;
}
