// CUDA launcher of tpamp::dynamic_scaler_update_ (math: csrc/kernels/dynamic_scaler.h; CPU twin:
// csrc/cpu/dynamic_scaler.cpp): one thread, so a training step never reads found_inf on the host
// (docs/spec.md section 1).

#include "../host/validate.h"
#include "../kernels/dynamic_scaler.h"
#include "../ops.h"
#include "multi_tensor_apply.cuh"

namespace tpamp {
namespace cuda {
namespace {

__global__ void dynamic_scaler_update_kernel(float* scale, int32_t* growth_tracker,
                                             int32_t* hysteresis_tracker, const float* found_inf,
                                             ScalerConfig cfg) {
  const ScalerState out =
      dynamic_scaler_step({scale[0], growth_tracker[0], hysteresis_tracker[0]}, found_inf[0], cfg);
  scale[0] = out.scale;
  growth_tracker[0] = out.growth_tracker;
  hysteresis_tracker[0] = out.hysteresis_tracker;
}

}  // namespace

void dynamic_scaler_update_(const at::Tensor& scale, const at::Tensor& growth_tracker,
                            const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                            double growth_factor, double backoff_factor, int64_t growth_interval,
                            int64_t hysteresis, double min_scale, double max_scale,
                            bool consecutive) {
  validate_dynamic_scaler("tpamp::dynamic_scaler_update_", scale, growth_tracker,
                          hysteresis_tracker, found_inf, growth_interval, hysteresis,
                          kLauncherDevice);
  // The factors are rounded to float32 as torch does for a Python scalar times a float32 tensor.
  const ScalerConfig cfg{static_cast<float>(growth_factor), static_cast<float>(backoff_factor),
                         growth_interval, static_cast<int32_t>(hysteresis),
                         static_cast<float>(min_scale), static_cast<float>(max_scale),
                         consecutive};
  c10::cuda::CUDAGuard guard(scale.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  TPAMP_LAUNCH(dynamic_scaler_update_kernel, 1, 1, 0, stream, scale.data_ptr<float>(),
               growth_tracker.data_ptr<int32_t>(), hysteresis_tracker.data_ptr<int32_t>(),
               found_inf.data_ptr<float>(), cfg);
}

}  // namespace cuda
}  // namespace tpamp
