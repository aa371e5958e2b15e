// Stand-in for c10/cuda/CUDAStream.h under the SIMT emulator (csrc/simt/): one stream, in order
// (an emulated launch has finished when it returns).
#pragma once

#include <cuda_runtime.h>

namespace c10 {
namespace cuda {
struct CUDAStream {
  operator cudaStream_t() const { return nullptr; }
  cudaStream_t stream() const { return nullptr; }
};
inline CUDAStream getCurrentCUDAStream(int = -1) { return {}; }
}  // namespace cuda
}  // namespace c10
