// Stand-in for c10/cuda/CUDAGuard.h under the SIMT emulator (csrc/simt/): the emulated launchers
// run on CPU tensors, so a device guard has nothing to switch.
#pragma once

#include <c10/core/Device.h>

#include <optional>

namespace c10 {
namespace cuda {
struct CUDAGuard {
  explicit CUDAGuard(c10::Device) {}
  explicit CUDAGuard(c10::DeviceIndex) {}
  CUDAGuard(const CUDAGuard&) = delete;
  CUDAGuard& operator=(const CUDAGuard&) = delete;
};
struct OptionalCUDAGuard {
  OptionalCUDAGuard() = default;
  explicit OptionalCUDAGuard(std::optional<c10::Device>) {}
};
}  // namespace cuda
}  // namespace c10
