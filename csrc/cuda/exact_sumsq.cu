// CUDA launcher of tpamp::grad_sumsq_exact and tpamp::exact_sumsq_to_double (math:
// csrc/kernels/exact_sumsq.h; CPU twin: csrc/cpu/exact_sumsq.cpp).
//
// grad_sumsq_exact: one block per chunk (multi_tensor_apply). Each thread adds M^2 of its values
// r = float32(float(x) * scale) to its warp's copy of the exponent bins in shared memory
// (unsigned 64-bit atomics: a warp's copy sees at most kChunkSize / 16 values); then one thread
// per exponent merges the warp copies and adds the bin's four 24-bit pieces into the block's
// digits (shared atomics), thread 0 normalizes them, and the block adds them to an int64
// accumulator in global memory (atomics). A finalize kernel normalizes the accumulator into the
// float64 output. Every addition is an integer one, so the result is exact and does not depend
// on the block schedule, the order of the atomics or the tensor split; no host sync.
// exact_sumsq_to_double: one thread (kernels/exact_sumsq.h); digits that are not integers in
// [0, 2^53) give NaN (the CPU twin raises: a CUDA kernel cannot without a host sync).

#include "../host/validate.h"
#include "../kernels/exact_sumsq.h"
#include "../ops.h"
#include "multi_tensor_apply.cuh"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

namespace tpamp {
namespace cuda {
namespace {

constexpr int kWarps = kBlockSize / 32;
static_assert(kChunkSize <= 65536, "a bin of a chunk's M^2 (each < 2^48) stays below 2^64");
static_assert(kExactNonFiniteBin < kBlockSize, "one thread per exponent bin");

using ull = unsigned long long;

template <typename in_t>
struct ExactSumsqFunctor {
  const float* scale;  // null: no multiply
  ull* acc;            // int64 [kExactDigits] accumulator in global memory

  __device__ __forceinline__ void operator()(const ChunkInfo<1>& c) const {
    // 32 KiB: one copy of the bins per warp (fewer threads contend for one address)
    __shared__ ull bins[kWarps][kExactBins];
    __shared__ ull block_digits[kExactDigits];
    const int tid = static_cast<int>(threadIdx.x);
    const int warp = tid >> 5;
    for (int i = tid; i < kWarps * kExactBins; i += kBlockSize) bins[i / kExactBins][i % kExactBins] = 0;
    if (tid < kExactDigits) block_digits[tid] = 0;
    __syncthreads();

    const in_t* in = static_cast<const in_t*>(c.addr[0]) + c.offset;
    const bool mul = scale != nullptr;
    const float s = mul ? *scale : 1.0f;
    ull* my_bins = bins[warp];
    float* none = nullptr;  // nothing is stored
    transform_chunk(in, none, c.n, c.aligned, false, [&](in_t x) -> float {
      float r = static_cast<float>(x);
      if (mul) r = scale_value(r, s);
      const ExactSquare sq = exact_square(r);
      atomicAdd(&my_bins[sq.bin], static_cast<ull>(sq.m2));  // bin 255 (inf/NaN) is never read
      return r;
    });
    __syncthreads();

    if (tid < kExactNonFiniteBin) {
      ull v = 0;
      for (int w = 0; w < kWarps; ++w) v += bins[w][tid];  // < 2^16 (2^24 - 1)^2 < 2^64
      if (v != 0) {
        uint64_t pieces[4];
        const int at = exact_bin_pieces(static_cast<uint32_t>(tid), v, pieces);
        for (int k = 0; k < 4; ++k) {
          if (pieces[k] != 0) atomicAdd(&block_digits[at + k], static_cast<ull>(pieces[k]));
        }
      }
    }
    __syncthreads();
    if (tid == 0) {
      int64_t d[kExactDigits];
      for (int i = 0; i < kExactDigits; ++i) d[i] = static_cast<int64_t>(block_digits[i]);
      exact_normalize(d, kExactDigits);  // each digit < 2^24: 2^39 blocks fit the accumulator
      for (int i = 0; i < kExactDigits; ++i) block_digits[i] = static_cast<ull>(d[i]);
    }
    __syncthreads();
    if (tid < kExactDigits && block_digits[tid] != 0) atomicAdd(&acc[tid], block_digits[tid]);
  }
};

// One thread: the accumulator, normalized, as float64 digits.
__global__ void exact_sumsq_finalize_kernel(const ull* acc, double* out) {
  int64_t d[kExactDigits];
  for (int i = 0; i < kExactDigits; ++i) d[i] = static_cast<int64_t>(acc[i]);
  exact_normalize(d, kExactDigits);
  for (int i = 0; i < kExactDigits; ++i) out[i] = static_cast<double>(d[i]);
}

// One thread: the correctly rounded float64 of the digits (NaN if one is not an integer in
// [0, 2^53)).
__global__ void exact_sumsq_to_double_kernel(const double* digits, double* out) {
  out[0] = exact_digits_to_double(digits);
}

}  // namespace

at::Tensor grad_sumsq_exact(at::TensorList tensors, const std::optional<at::Tensor>& scale) {
  const char* op = "tpamp::grad_sumsq_exact";
  const at::Device device = validate_grad_sumsq_exact(op, tensors, scale, kLauncherDevice);
  const bool has_scale = scale.has_value() && scale->defined();
  const int64_t n = static_cast<int64_t>(tensors.size());
  TORCH_CHECK(n <= INT32_MAX, op, ": too many tensors (", n, ")");
  c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  // one launch group per dtype; type index 0 float32, 1 float16, 2 bfloat16
  std::vector<TensorEntry<1>> groups[3];
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& t = tensors[i];
    if (t.numel() == 0) continue;
    const at::ScalarType st = t.scalar_type();
    TensorEntry<1> e;
    e.addr = {const_cast<void*>(t.const_data_ptr())};
    e.numel = t.numel();
    e.slot = 0;  // no per-chunk slots: the blocks add integers
    e.index = static_cast<int32_t>(i);
    e.flags = is_aligned16(e.addr[0]) ? kAligned : 0;
    groups[st == at::kFloat ? 0 : (st == at::kHalf ? 1 : 2)].push_back(e);
  }

  const auto opts = at::TensorOptions().device(device);
  at::Tensor acc = at::zeros({kExactDigits}, opts.dtype(at::kLong));
  ull* acc_ptr = reinterpret_cast<ull*>(acc.data_ptr<int64_t>());
  const float* scale_ptr = has_scale ? scale->data_ptr<float>() : nullptr;
  const at::ScalarType types[3] = {at::kFloat, at::kHalf, at::kBFloat16};
  for (int k = 0; k < 3; ++k) {
    if (groups[k].empty()) continue;
    dispatch_float_type(types[k], "tensors", [&](auto tag) {
      using in_t = decltype(tag);
      multi_tensor_apply<1>(groups[k], ExactSumsqFunctor<in_t>{scale_ptr, acc_ptr});
    });
  }
  at::Tensor out = at::empty({kExactDigits}, opts.dtype(at::kDouble));
  TPAMP_LAUNCH(exact_sumsq_finalize_kernel, 1, 1, 0, stream, static_cast<const ull*>(acc_ptr),
               out.data_ptr<double>());
  return out;
}

at::Tensor exact_sumsq_to_double(const at::Tensor& digits) {
  const char* op = "tpamp::exact_sumsq_to_double";
  validate_exact_digits(op, digits, kExactDigits, kLauncherDevice);
  c10::cuda::CUDAGuard guard(digits.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor d = digits.contiguous();
  at::Tensor out = at::empty({}, d.options());
  TPAMP_LAUNCH(exact_sumsq_to_double_kernel, 1, 1, 0, stream, d.const_data_ptr<double>(),
               out.data_ptr<double>());
  return out;
}

}  // namespace cuda
}  // namespace tpamp
