// Deliberately broken kernels (and their correct twins), CUDA source built only into the SIMT
// module, so tests/test_simt_misuse.py can check that the emulator reports each bug:
//
//   torch.ops.tpamp_simt_mutants.run(name, out)   out: float32 CPU tensor of >= 2 elements
//
//   reduce_reuse / reduce_reuse_fixed   a block reduction missing its closing barrier, its shared
//                                       buffer reused at once (a race: a wrong sum in some
//                                       schedule orders, named by ThreadSanitizer)
//   early_return / early_return_fixed   some threads return before a __syncthreads
//   warp_after_exit / warp_after_exit_fixed   a full-mask warp reduction after lanes exited
//   divergent_barrier                   two __syncthreads at different lines
//   deadlock                            a __syncwarp waiting for lanes held at a __syncthreads
//   shfl_outside_mask                   a shuffle reading a lane its mask does not name
//   too_many_threads, too_many_param_bytes, too_much_shared, empty_grid   launch limits
//
// Every kernel uses kBlockSize-independent sizes so the file stands alone.

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <string>

#include "../cuda/launch.cuh"

namespace tpamp {
namespace simt_mutants {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Block sum, valid in thread 0; `closing` is the barrier that lets `shared` be reused at once.
__device__ __forceinline__ float block_sum(float v, float* shared, bool closing) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  v = warp_sum(v);
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  float total = 0.0f;
  if (threadIdx.x == 0) {
    for (int w = 0; w < kWarps; ++w) total += shared[w];  // the read the missing barrier races
  }
  if (closing) __syncthreads();
  return total;
}

// out[0] = sum of (t + 1) over the block; out[1] = sum of the warps' tags (1000 * (w + 1)),
// written by each warp's lane 0 into the same shared buffer right after the first sum.
__global__ void reduce_reuse_kernel(float* out, bool closing) {
  __shared__ float shared[32];
  const float a = block_sum(static_cast<float>(threadIdx.x + 1), shared, closing);
  if ((threadIdx.x & 31) == 0) shared[threadIdx.x >> 5] = 1000.0f * ((threadIdx.x >> 5) + 1);
  __syncthreads();
  if (threadIdx.x == 0) {
    float b = 0.0f;
    for (int w = 0; w < kWarps; ++w) b += shared[w];
    out[0] = a;
    out[1] = b;
  }
}

__global__ void early_return_kernel(float* out, bool fixed) {
  __shared__ float shared[kThreads];
  const bool leaves = (threadIdx.x % 3) == 1;
  if (!fixed && leaves) return;  // the bug: these threads never reach the barrier below
  shared[threadIdx.x] = leaves ? 0.0f : 1.0f;
  __syncthreads();  // early_return: the barrier
  if (threadIdx.x == 0) {
    float s = 0.0f;
    for (int i = 0; i < kThreads; ++i) s += shared[i];
    out[0] = s;
  }
}

__global__ void warp_after_exit_kernel(float* out, bool fixed) {
  const int lane = threadIdx.x & 31;
  if (!fixed && lane >= 16) return;  // the bug: the reduction below names these lanes
  const float v = lane < 16 ? 1.0f : 0.0f;
  const float s = warp_sum(v);
  if (threadIdx.x == 0) out[0] = s;
}

__global__ void divergent_barrier_kernel(float* out) {
  if (threadIdx.x < 64) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  if (threadIdx.x == 0) out[0] = 1.0f;
}

__global__ void deadlock_kernel(float* out) {
  if ((threadIdx.x & 31) == 0) __syncwarp();  // waits for lanes 1..31, held below
  __syncthreads();
  if (threadIdx.x == 0) out[0] = 1.0f;
}

__global__ void shfl_outside_mask_kernel(float* out) {
  const int lane = threadIdx.x & 31;
  if (lane < 16) {
    const float v = __shfl_xor_sync(0x0000ffffu, 1.0f, 16);  // reads lanes 16..31
    if (threadIdx.x == 0) out[0] = v;
  }
}

struct Big {
  char bytes[5000];
};
__global__ void big_param_kernel(float* out, Big b) {
  if (threadIdx.x == 0) out[0] = static_cast<float>(b.bytes[0]);
}

__global__ void plain_kernel(float* out) {
  if (threadIdx.x == 0 && blockIdx.x == 0) out[0] = 1.0f;
}

void run(const std::string& name, const at::Tensor& out) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.numel() >= 2 && out.is_contiguous(),
              "tpamp_simt_mutants::run: out must be a contiguous float32 tensor of >= 2 elements");
  float* o = out.data_ptr<float>();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (name == "reduce_reuse" || name == "reduce_reuse_fixed") {
    TPAMP_LAUNCH(reduce_reuse_kernel, 1, kThreads, 0, stream, o, name != "reduce_reuse");
  } else if (name == "early_return" || name == "early_return_fixed") {
    TPAMP_LAUNCH(early_return_kernel, 2, kThreads, 0, stream, o, name != "early_return");
  } else if (name == "warp_after_exit" || name == "warp_after_exit_fixed") {
    TPAMP_LAUNCH(warp_after_exit_kernel, 1, 64, 0, stream, o, name != "warp_after_exit");
  } else if (name == "divergent_barrier") {
    TPAMP_LAUNCH(divergent_barrier_kernel, 1, kThreads, 0, stream, o);
  } else if (name == "deadlock") {
    TPAMP_LAUNCH(deadlock_kernel, 1, 64, 0, stream, o);
  } else if (name == "shfl_outside_mask") {
    TPAMP_LAUNCH(shfl_outside_mask_kernel, 1, 32, 0, stream, o);
  } else if (name == "too_many_threads") {
    TPAMP_LAUNCH(plain_kernel, 1, 1025, 0, stream, o);
  } else if (name == "too_many_param_bytes") {
    Big b{};
    TPAMP_LAUNCH(big_param_kernel, 1, 32, 0, stream, o, b);
  } else if (name == "too_much_shared") {
    TPAMP_LAUNCH(plain_kernel, 1, 32, 48 * 1024 + 1, stream, o);
  } else if (name == "empty_grid") {
    TPAMP_LAUNCH(plain_kernel, 0, 32, 0, stream, o);
  } else {
    TORCH_CHECK(false, "tpamp_simt_mutants::run: unknown kernel '", name, "'");
  }
}

}  // namespace
}  // namespace simt_mutants
}  // namespace tpamp

TORCH_LIBRARY(tpamp_simt_mutants, m) {
  m.def("run(str name, Tensor(a!) out) -> ()");
  m.impl("run", c10::DispatchKey::CPU, TORCH_FN(tpamp::simt_mutants::run));
}
