// Single-thread timing of the uint8 (dynamic map) block functions of the CPU launcher
// (csrc/cpu/dynamic_map_simd.h) on one cache-resident block of 256 elements, as the one-pass
// kernel calls them on its L1 buffers: ns per 8 elements (thread CPU time) for the decode, the
// block absmax and the encode (and the encode's division alone), per map; then the encode over
// 64 different blocks (64 KB, each with its own scale: values near a code threshold, which take
// a slower path in some modules, occur as in real moments), and both maps' blocks (exp_avg and
// a non-negative exp_avg_sq) by two encodes against dynamic_encode_block2. Not part of the build:
//
//   TI=$(python -c "import torch.utils.cpp_extension as c; print(c.include_paths()[0])")
//   g++ -O3 -std=c++17 -I$TI -DCPU_CAPABILITY_AVX2 -mavx2 -mfma -mf16c \
//       scripts/bench_dynamic_map_block.cpp -o /tmp/bench_block && /tmp/bench_block
//   (-DCPU_CAPABILITY_AVX512 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx2 -mfma -mf16c;
//    -DCPU_CAPABILITY_DEFAULT)
#include "../csrc/cpu/dynamic_map_simd.h"

#include <time.h>

#include <cstdio>
#include <random>
#include <vector>

using namespace tpamp;
using namespace tpamp::cpu;

static double cpu_now() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

#define NOINLINE __attribute__((noinline))
NOINLINE void encode(const float* x, float d, const DynamicTables& t, uint8_t* c) {
  dynamic_encode_block(x, 256, d, t, c);
}
NOINLINE void decode(const uint8_t* c, float s, const DynamicTables& t, float* y) {
  dynamic_decode_block(c, 256, s, t, y);
}
NOINLINE void encode2(const float* m, float md, uint8_t* mc, const float* v, float vd,
                      uint8_t* vc) {
  dynamic_encode_block2(m, md, mc, v, vd, vc, 256);
}
NOINLINE float absmax(const float* x) { return dynamic_absmax(x, 256, [] { return 0.0f; }); }
NOINLINE void divide(const float* x, float d, float* y) {
  for (int i = 0; i < 256; ++i) y[i] = x[i] / d;
}

int main() {
  std::mt19937 g(1);
  std::normal_distribution<float> nd(0, 1);
  alignas(64) float x[256], y[256];
  alignas(64) uint8_t c[256];
  const int reps = 400000;
  const double per8 = 1e9 / (reps * 256.0 / 8);
  for (int u = 0; u < 2; ++u) {
    for (auto& v : x) v = u ? nd(g) * nd(g) * 1e-6f : nd(g) * 1e-3f;  // exp_avg_sq: >= 0
    float d = 0.0f;
    for (float v : x) d = fabsf(v) > d ? fabsf(v) : d;
    const DynamicTables& t = dynamic_tables(u);
    for (int rep = 0; rep < 3; ++rep) {
      double t0 = cpu_now();
      for (int r = 0; r < reps; ++r) { encode(x, d, t, c); asm volatile("" ::: "memory"); }
      double t1 = cpu_now();
      for (int r = 0; r < reps; ++r) { decode(c, d, t, y); asm volatile("" ::: "memory"); }
      double t2 = cpu_now();
      float acc = 0.0f;
      for (int r = 0; r < reps; ++r) { acc += absmax(x); asm volatile("" ::: "memory"); }
      double t3 = cpu_now();
      for (int r = 0; r < reps; ++r) { divide(x, d, y); asm volatile("" ::: "memory"); }
      double t4 = cpu_now();
      printf("%s map, ns per 8 elements: encode %.3f decode %.3f absmax %.3f (division alone %.3f)%s\n",
             u ? "unsigned" : "signed", (t1 - t0) * per8, (t2 - t1) * per8, (t3 - t2) * per8,
             (t4 - t3) * per8, acc == 1.5f ? " " : "");
    }
  }
  const int nb = 64, breps = 6000;
  std::vector<float> xs(nb * 256), ds(nb);
  std::vector<uint8_t> cs(nb * 256);
  for (int u = 0; u < 2; ++u) {
    for (int b = 0; b < nb; ++b) {
      float m = 0.0f;
      for (int k = 0; k < 256; ++k) {
        const float v = u ? nd(g) * nd(g) * 1e-6f : nd(g) * 1e-3f;
        xs[b * 256 + k] = v;
        m = fabsf(v) > m ? fabsf(v) : m;
      }
      ds[b] = m;
    }
    const DynamicTables& t = dynamic_tables(u);
    for (int rep = 0; rep < 3; ++rep) {
      double t0 = cpu_now();
      for (int r = 0; r < breps; ++r) {
        for (int b = 0; b < nb; ++b) encode(&xs[b * 256], ds[b], t, &cs[b * 256]);
      }
      double t1 = cpu_now();
      printf("%s map, 64 blocks, ns per 8 elements: encode %.3f\n", u ? "unsigned" : "signed",
             (t1 - t0) * 1e9 / (breps * nb * 256.0 / 8));
    }
  }
  // both moments' blocks as the one-pass loop encodes them: two calls, then one
  // dynamic_encode_block2 (AVX-512: one loop over both)
  std::vector<float> ms(nb * 256), vs(nb * 256), mds(nb), vds(nb);
  std::vector<uint8_t> mcs(nb * 256), vcs(nb * 256);
  for (int b = 0; b < nb; ++b) {
    float mm = 0.0f, vm = 0.0f;
    for (int k = 0; k < 256; ++k) {
      const float m = nd(g) * 1e-3f, v = m * m + nd(g) * nd(g) * 1e-7f;
      ms[b * 256 + k] = m;
      vs[b * 256 + k] = v;
      mm = fabsf(m) > mm ? fabsf(m) : mm;
      vm = v > vm ? v : vm;
    }
    mds[b] = mm;
    vds[b] = vm;
  }
  for (int rep = 0; rep < 3; ++rep) {
    double t0 = cpu_now();
    for (int r = 0; r < breps; ++r) {
      for (int b = 0; b < nb; ++b) {
        encode(&ms[b * 256], mds[b], dynamic_tables(false), &mcs[b * 256]);
        encode(&vs[b * 256], vds[b], dynamic_tables(true), &vcs[b * 256]);
      }
    }
    double t1 = cpu_now();
    for (int r = 0; r < breps; ++r) {
      for (int b = 0; b < nb; ++b) {
        encode2(&ms[b * 256], mds[b], &mcs[b * 256], &vs[b * 256], vds[b], &vcs[b * 256]);
      }
    }
    double t2 = cpu_now();
    const double per8 = 1e9 / (breps * nb * 256.0 / 8);
    printf("both maps, 64 blocks each, ns per 8 elements of each: two encodes %.3f, "
           "dynamic_encode_block2 %.3f\n", (t1 - t0) * per8, (t2 - t1) * per8);
  }
  return 0;
}
