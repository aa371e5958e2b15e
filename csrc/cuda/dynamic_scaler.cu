// tpamp::dynamic_scaler_update_: Megatron-LM's DynamicGradScaler.update on the device, one
// thread, so a training step never reads found_inf on the host (SPEC.md section 1).
//
// It reproduces tpamp/ops.py's PyTorch path bit for bit: the same float32 products
// (scale * float32(factor)), the same clamps (NaN passes through, as torch.clamp does) and the
// same int32 tracker arithmetic.

#include "multi_tensor_apply.cuh"
#include "ops.h"

namespace tpamp {
namespace {

__device__ __forceinline__ float clamp_min_keep_nan(float v, float lo) {
  return (v != v) ? v : (v < lo ? lo : v);
}
__device__ __forceinline__ float clamp_max_keep_nan(float v, float hi) {
  return (v != v) ? v : (v > hi ? hi : v);
}

__global__ void dynamic_scaler_update_kernel(float* scale, int32_t* growth_tracker,
                                             int32_t* hysteresis_tracker, const float* found_inf,
                                             float growth_factor, float backoff_factor,
                                             int64_t growth_interval, int32_t hysteresis,
                                             float min_scale, float max_scale, bool consecutive) {
  const bool overflow = found_inf[0] != 0.0f;  // NaN counts as an overflow, as `!= 0` does
  const float s = scale[0];
  const int32_t growth = growth_tracker[0];
  const int32_t hyst = hysteresis_tracker[0];
  if (overflow) {
    // Reset growth, spend one unit of hysteresis; back off once it is spent.
    const int32_t hyst_left = static_cast<int32_t>(static_cast<uint32_t>(hyst) - 1u);
    growth_tracker[0] = 0;
    hysteresis_tracker[0] = hyst_left;
    if (hyst_left <= 0) scale[0] = clamp_min_keep_nan(s * backoff_factor, min_scale);
  } else {
    const int32_t grown = static_cast<int32_t>(static_cast<uint32_t>(growth) + 1u);
    if (static_cast<int64_t>(grown) == growth_interval) {
      growth_tracker[0] = 0;
      hysteresis_tracker[0] = hysteresis;
      scale[0] = clamp_max_keep_nan(s * growth_factor, max_scale);
    } else {
      growth_tracker[0] = grown;
      if (consecutive) hysteresis_tracker[0] = hysteresis;
    }
  }
}

void check_one_element(const at::Tensor& t, const char* name, at::ScalarType dtype,
                       const at::Device& device) {
  TORCH_CHECK(t.defined(), "tpamp::dynamic_scaler_update_: ", name, " is undefined");
  TORCH_CHECK(t.device() == device, "tpamp::dynamic_scaler_update_: ", name, " is on ",
              t.device(), ", expected ", device, " (the scale's device)");
  TORCH_CHECK(t.scalar_type() == dtype && t.numel() == 1, "tpamp::dynamic_scaler_update_: ", name,
              " must be a 1-element ", dtype, " tensor, got ", t.scalar_type(), " of shape ",
              t.sizes());
}

}  // namespace

void dynamic_scaler_update_cuda(const at::Tensor& scale, const at::Tensor& growth_tracker,
                                const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                                double growth_factor, double backoff_factor,
                                int64_t growth_interval, int64_t hysteresis, double min_scale,
                                double max_scale, bool consecutive) {
  TORCH_CHECK(scale.defined(), "tpamp::dynamic_scaler_update_: scale is undefined");
  TORCH_CHECK(scale.is_cuda(), "tpamp::dynamic_scaler_update_: scale must be a CUDA tensor, got ",
              "one on ", scale.device());
  const at::Device device = scale.device();
  check_one_element(scale, "scale", at::kFloat, device);
  check_one_element(growth_tracker, "growth_tracker", at::kInt, device);
  check_one_element(hysteresis_tracker, "hysteresis_tracker", at::kInt, device);
  check_one_element(found_inf, "found_inf", at::kFloat, device);
  TORCH_CHECK(growth_interval >= 1, "tpamp::dynamic_scaler_update_: growth_interval must be >= 1, got ",
              growth_interval);
  TORCH_CHECK(hysteresis >= 1 && hysteresis <= INT32_MAX,
              "tpamp::dynamic_scaler_update_: hysteresis must be in [1, 2^31), got ", hysteresis);

  c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // The factors are rounded to float32 as torch does for a Python scalar times a float32 tensor.
  dynamic_scaler_update_kernel<<<1, 1, 0, stream>>>(
      scale.data_ptr<float>(), growth_tracker.data_ptr<int32_t>(),
      hysteresis_tracker.data_ptr<int32_t>(), found_inf.data_ptr<float>(),
      static_cast<float>(growth_factor), static_cast<float>(backoff_factor), growth_interval,
      static_cast<int32_t>(hysteresis), static_cast<float>(min_scale),
      static_cast<float>(max_scale), consecutive);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace tpamp
