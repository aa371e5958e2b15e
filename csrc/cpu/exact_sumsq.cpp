// CPU launcher of tpamp::grad_sumsq_exact and tpamp::exact_sumsq_to_double (math:
// csrc/kernels/exact_sumsq.h; CUDA twin: csrc/cuda/exact_sumsq.cu).
//
// grad_sumsq_exact: each chunk (csrc/cpu/launcher.h) converts its values to float32 r =
// float32(float(x) * scale) a few hundred at a time (at::vec), adds each r's M^2 to a uint64 bin
// per exponent (eight banks, element j to bank j % 8, so consecutive adds to one bin do not wait
// on each other), then turns the bins into normalized int64 digits in its slot. The slots are
// added (integers: any order gives the same sum) and normalized once more. Every result is the
// exact sum, so it does not depend on the thread count, the chunking or the tensor split.

#include "../host/validate.h"
#include "../kernels/exact_sumsq.h"
#include "../ops.h"
#include "launcher.h"
#include "vec_lanes.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <array>
#include <type_traits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace tpamp {
namespace cpu {
namespace {

using Digits = std::array<int64_t, kExactDigits>;

constexpr int kBanks = 8;
constexpr int64_t kBuffer = 1024;  // values converted to float32 at a time
static_assert(kBuffer % (4 * 16) == 0, "whole vector steps and bank groups");
static_assert(kChunkSize <= 65536, "a bin of a chunk's M^2 (each < 2^48) stays below 2^64");

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
// exact_square of 8 values at once (AVX2; the AVX-512 module has it too): idx[k] = the bin of
// p[k] in bank k (bin + kExactBins * k, into the flat bins), m2[k] = its M^2.
TPAMP_INLINE void exact_square8(const float* p, uint32_t* idx, uint64_t* m2) {
  const __m256i bits = _mm256_castps_si256(_mm256_loadu_ps(p));
  const __m256i e = _mm256_and_si256(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(0xff));
  const __m256i normal = _mm256_andnot_si256(_mm256_cmpeq_epi32(e, _mm256_setzero_si256()),
                                             _mm256_set1_epi32(0x800000));
  const __m256i m = _mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffff)), normal);
  const __m256i bank = _mm256_setr_epi32(0, kExactBins, 2 * kExactBins, 3 * kExactBins,
                                         4 * kExactBins, 5 * kExactBins, 6 * kExactBins,
                                         7 * kExactBins);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(idx), _mm256_add_epi32(e, bank));
  const __m256i even = _mm256_mul_epu32(m, m);  // M^2 of values 0, 2, 4, 6 (64-bit lanes)
  const __m256i mo = _mm256_srli_epi64(m, 32);
  const __m256i odd = _mm256_mul_epu32(mo, mo);  // 1, 3, 5, 7
  const __m256i lo = _mm256_unpacklo_epi64(even, odd);  // 0, 1 | 4, 5
  const __m256i hi = _mm256_unpackhi_epi64(even, odd);  // 2, 3 | 6, 7
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(m2), _mm256_permute2x128_si256(lo, hi, 0x20));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(m2 + 4), _mm256_permute2x128_si256(lo, hi, 0x31));
}
static_assert(kBanks == 8, "exact_square8 puts value k of 8 into bank k");
#endif

// M^2 of buf[0 .. m) into the banks' bins (element j into bank j % kBanks), m <= kBuffer.
TPAMP_INLINE void bin_values(const float* buf, int64_t m, uint64_t (*bins)[kExactBins]) {
  int64_t j = 0;
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  // the squares 8 at a time, then the adds (a scatter: one add per value)
  alignas(64) uint32_t idx[kBuffer];
  alignas(64) uint64_t m2[kBuffer];
  for (; j + 8 <= m; j += 8) exact_square8(buf + j, idx + j, m2 + j);
  uint64_t* flat = &bins[0][0];
  for (int64_t k = 0; k < j; ++k) flat[idx[k]] += m2[k];
#endif
  for (; j + kBanks <= m; j += kBanks) {
    for (int k = 0; k < kBanks; ++k) {
      const ExactSquare sq = exact_square(buf[j + k]);
      bins[k][sq.bin] += sq.m2;
    }
  }
  for (; j < m; ++j) {
    const ExactSquare sq = exact_square(buf[j]);
    bins[0][sq.bin] += sq.m2;
  }
}

// The normalized digits of one chunk in[0 .. n), n <= kChunkSize (so no bin overflows).
template <typename in_t, bool kMul>
Digits exact_chunk(const in_t* in, int64_t n, float s) {
  alignas(64) uint64_t bins[kBanks][kExactBins] = {};
  alignas(64) float buf[kBuffer];
  const FVec sv(s);
  for (int64_t b0 = 0; b0 < n; b0 += kBuffer) {
    const int64_t m = std::min(kBuffer, n - b0);
    const in_t* src = in + b0;
    if constexpr (std::is_same_v<in_t, float> && !kMul) {
      bin_values(src, m, bins);  // the values as they are
      continue;
    }
    int64_t i = 0;
    for (; kUseVec && i + kVecStep <= m; i += kVecStep) {
      FVec a, b;
      VecIO<in_t>::load(src + i, a, b);
      if (kMul) {
        a = scale_value(a, sv);
        b = scale_value(b, sv);
      }
      a.store(buf + i);
      b.store(buf + i + FVec::size());
    }
    for (; i < m; ++i) {
      float v = static_cast<float>(src[i]);
      if (kMul) v = scale_value(v, s);
      buf[i] = v;
    }
    bin_values(buf, m, bins);
  }
  Digits d{};
  for (uint32_t e = 0; e < static_cast<uint32_t>(kExactNonFiniteBin); ++e) {
    uint64_t v = 0;
    for (int k = 0; k < kBanks; ++k) v += bins[k][e];  // < 2^16 (2^24 - 1)^2 < 2^64
    if (v == 0) continue;
    uint64_t pieces[4];
    const int at = exact_bin_pieces(e, v, pieces);
    for (int k = 0; k < 4; ++k) d[at + k] += static_cast<int64_t>(pieces[k]);
  }
  exact_normalize(d.data(), kExactDigits);
  return d;
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

}  // namespace

at::Tensor grad_sumsq_exact(at::TensorList tensors, const std::optional<at::Tensor>& scale) {
  const char* op = "tpamp::grad_sumsq_exact";
  const at::Device device = validate_grad_sumsq_exact(op, tensors, scale, at::kCPU);
  const bool has_scale = scale.has_value() && scale->defined();
  const float s = has_scale ? scale->item<float>() : 1.0f;

  std::vector<int64_t> numels;
  numels.reserve(tensors.size());
  for (const auto& t : tensors) numels.push_back(t.numel());
  const ChunkPlan plan = plan_chunks(numels);
  std::vector<Digits> partials(plan.chunks.size());
  for_each_chunk_balanced(plan, [&](int64_t slot, const Chunk& c) {
    const at::Tensor& t = tensors[c.entry];
    dispatch_float(t.scalar_type(), [&](auto tag) {
      using in_t = decltype(tag);
      const in_t* src = static_cast<const in_t*>(t.const_data_ptr()) + c.offset;
      partials[slot] = has_scale ? exact_chunk<in_t, true>(src, c.n, s)
                                 : exact_chunk<in_t, false>(src, c.n, s);
    });
  });

  // Normalized slots: each digit grows by < 2^24 a slot, so 2^39 slots fit an int64.
  int64_t total[kExactDigits] = {};
  for (const Digits& d : partials) {
    for (int i = 0; i < kExactDigits; ++i) total[i] += d[i];
  }
  exact_normalize(total, kExactDigits);
  at::Tensor out = at::empty({kExactDigits}, at::TensorOptions().dtype(at::kDouble).device(device));
  double* o = out.data_ptr<double>();
  for (int i = 0; i < kExactDigits; ++i) o[i] = static_cast<double>(total[i]);
  return out;
}

at::Tensor exact_sumsq_to_double(const at::Tensor& digits) {
  const char* op = "tpamp::exact_sumsq_to_double";
  validate_exact_digits(op, digits, kExactDigits, at::kCPU);
  const at::Tensor d = digits.contiguous();
  const double* in = d.const_data_ptr<double>();
  for (int i = 0; i < kExactDigits; ++i) {
    TORCH_CHECK(exact_digit_ok(in[i]), op, ": digits[", i, "] is ", in[i],
                "; expected an integer in [0, 2^53) (the digits of grad_sumsq_exact, or a sum "
                "of fewer than 2^29 of them)");
  }
  at::Tensor out = at::empty({}, digits.options());
  out.data_ptr<double>()[0] = exact_digits_to_double(in);
  return out;
}

}  // namespace cpu
}  // namespace tpamp
