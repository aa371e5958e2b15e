// CPU launcher of tpamp::dynamic_scaler_update_ (math: csrc/kernels/dynamic_scaler.h; CUDA twin:
// csrc/cuda/dynamic_scaler.cu): one scalar update on host memory.

#include "../host/validate.h"
#include "../kernels/dynamic_scaler.h"
#include "../ops.h"

namespace tpamp {
namespace cpu {

void dynamic_scaler_update_(const at::Tensor& scale, const at::Tensor& growth_tracker,
                            const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                            double growth_factor, double backoff_factor, int64_t growth_interval,
                            int64_t hysteresis, double min_scale, double max_scale,
                            bool consecutive) {
  validate_dynamic_scaler("tpamp::dynamic_scaler_update_", scale, growth_tracker,
                          hysteresis_tracker, found_inf, growth_interval, hysteresis, at::kCPU);
  const ScalerConfig cfg{static_cast<float>(growth_factor), static_cast<float>(backoff_factor),
                         growth_interval, static_cast<int32_t>(hysteresis),
                         static_cast<float>(min_scale), static_cast<float>(max_scale),
                         consecutive};
  float* s = scale.data_ptr<float>();
  int32_t* g = growth_tracker.data_ptr<int32_t>();
  int32_t* h = hysteresis_tracker.data_ptr<int32_t>();
  const ScalerState out =
      dynamic_scaler_step({*s, *g, *h}, *found_inf.const_data_ptr<float>(), cfg);
  *s = out.scale;
  *g = out.growth_tracker;
  *h = out.hysteresis_tracker;
}

}  // namespace cpu
}  // namespace tpamp
