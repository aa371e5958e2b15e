// How the CUDA launchers launch a kernel, and which device type they serve: the one place where
// nvcc and the SIMT emulator (csrc/simt/, TPAMP_SIMT) see different text, so every csrc/cuda/*.cu
// is compiled unchanged by both (no second copy of any kernel).
//
//   TPAMP_LAUNCH(kernel, grid, block, smem, stream, args...)
//       nvcc: kernel<<<grid, block, smem, stream>>>(args...) and C10_CUDA_KERNEL_LAUNCH_CHECK();
//       SIMT: one fiber per CUDA thread on the calling CPU thread (csrc/simt/simt.h), with the
//       launch limits checked and misuse reported with this file:line.
//   `kernel` is one name: for a templated kernel take a function pointer first
//   (`auto* k = &my_kernel<A, B>;`), since a template argument list holds a comma.
//
//   kLauncherDevice: at::kCUDA; at::kCPU under the emulator (its tensors are CPU tensors). The
//   launchers pass it to csrc/host/ validation and create their outputs on it.

#pragma once

#include <c10/core/DeviceType.h>
#include <c10/cuda/CUDAException.h>

#ifdef TPAMP_SIMT
#include "../simt/simt.h"
#define TPAMP_LAUNCH(kernel, grid, block, smem, stream, ...)                                   \
  ::tpamp::simt::launch(::tpamp::simt::Site{__FILE__, __LINE__}, #kernel, kernel, grid, block, \
                        smem, stream, __VA_ARGS__)
#else
#define TPAMP_LAUNCH(kernel, grid, block, smem, stream, ...) \
  do {                                                       \
    kernel<<<grid, block, smem, stream>>>(__VA_ARGS__);      \
    C10_CUDA_KERNEL_LAUNCH_CHECK();                          \
  } while (0)
#endif

namespace tpamp {
#ifdef TPAMP_SIMT
constexpr c10::DeviceType kLauncherDevice = c10::DeviceType::CPU;
#else
constexpr c10::DeviceType kLauncherDevice = c10::DeviceType::CUDA;
#endif
}  // namespace tpamp
