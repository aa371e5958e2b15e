// Argument validation of each op, shared by the CPU and CUDA launchers so both accept and reject
// exactly the same calls (host code, header-only).

#pragma once

#include "checks.h"

#include <ATen/core/List.h>

namespace tpamp {

struct GradStatsArgs {
  at::Device device;
  bool has_scale;
};

// grad_stats_ (out empty: in place) and grad_stats_out. `expect` is the launcher's device type.
inline GradStatsArgs validate_grad_stats(const char* op, at::TensorList grads, at::TensorList out,
                                         bool in_place, const std::optional<at::Tensor>& scale,
                                         const c10::List<bool>& mask, at::DeviceType expect) {
  const int64_t n = static_cast<int64_t>(grads.size());
  TORCH_CHECK(static_cast<int64_t>(mask.size()) == n, op, ": mask has ", mask.size(),
              " entries, grads has ", n);
  const bool scale_given = scale.has_value() && scale->defined();
  TORCH_CHECK(n > 0 || scale_given, op,
              ": grads is empty and no scale gives the device for the results");
  const at::Device device = n > 0 ? grads[0].device() : scale->device();
  TORCH_CHECK(device.type() == expect, op, ": expected tensors on ", expect, ", got ", device);
  check_float_list(op, "grads", grads, device);
  if (!in_place) {
    check_float_list(op, "out", out, device);
    check_same_layout(op, "grads", grads, "out", out);
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(out[i].scalar_type() == at::kFloat, op, ": out[", i, "] has dtype ",
                  out[i].scalar_type(), "; expected float32");
    }
    check_no_overlap(op, {grads, out}, {"grads", "out"}, {false, true}, false);
  } else {
    check_no_overlap(op, {grads}, {"grads"}, {true}, false);
  }
  const bool has_scale = check_scale(op, scale, device);
  if (in_place) {
    check_scalar_not_written(op, "scale", scale, {grads}, {"grads"}, {true});
  } else {
    check_scalar_not_written(op, "scale", scale, {out}, {"out"}, {true});
  }
  return {device, has_scale};
}

// scale_ (in place: dsts is srcs) and scale_and_copy.
inline bool validate_scale_and_copy(const char* op, at::TensorList srcs, at::TensorList dsts,
                                    bool in_place, const std::optional<at::Tensor>& scale,
                                    at::DeviceType expect, at::Device* device_out) {
  if (srcs.empty()) {
    TORCH_CHECK(dsts.empty(), op, ": srcs is empty, dsts has ", dsts.size(), " tensors");
    return scale.has_value() && scale->defined();
  }
  const at::Device device = srcs[0].device();
  *device_out = device;
  TORCH_CHECK(device.type() == expect, op, ": expected tensors on ", expect, ", got ", device);
  check_float_list(op, in_place ? "tensors" : "srcs", srcs, device);
  if (in_place) {
    check_no_overlap(op, {srcs}, {"tensors"}, {true}, false);
  } else {
    check_float_list(op, "dsts", dsts, device);
    check_same_layout(op, "srcs", srcs, "dsts", dsts);
    check_no_overlap(op, {srcs, dsts}, {"srcs", "dsts"}, {false, true}, false);
  }
  const bool has_scale = check_scale(op, scale, device);
  check_scalar_not_written(op, "scale", scale, {dsts}, {in_place ? "tensors" : "dsts"}, {true});
  return has_scale;
}

inline void check_one_element(const char* op, const at::Tensor& t, const char* name,
                              at::ScalarType dtype, const at::Device& device) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(t.device() == device, op, ": ", name, " is on ", t.device(), ", expected ", device,
              " (the scale's device)");
  TORCH_CHECK(t.scalar_type() == dtype && t.numel() == 1, op, ": ", name, " must be a 1-element ",
              dtype, " tensor, got ", t.scalar_type(), " of shape ", t.sizes());
}

inline void validate_dynamic_scaler(const char* op, const at::Tensor& scale,
                                    const at::Tensor& growth_tracker,
                                    const at::Tensor& hysteresis_tracker,
                                    const at::Tensor& found_inf, int64_t growth_interval,
                                    int64_t hysteresis, at::DeviceType expect) {
  TORCH_CHECK(scale.defined(), op, ": scale is undefined");
  TORCH_CHECK(scale.device().type() == expect, op, ": expected tensors on ", expect, ", got ",
              scale.device());
  const at::Device device = scale.device();
  check_one_element(op, scale, "scale", at::kFloat, device);
  check_one_element(op, growth_tracker, "growth_tracker", at::kInt, device);
  check_one_element(op, hysteresis_tracker, "hysteresis_tracker", at::kInt, device);
  check_one_element(op, found_inf, "found_inf", at::kFloat, device);
  TORCH_CHECK(growth_interval >= 1, op, ": growth_interval must be >= 1, got ", growth_interval);
  TORCH_CHECK(hysteresis >= 1 && hysteresis <= INT32_MAX, op,
              ": hysteresis must be in [1, 2^31), got ", hysteresis);
  check_scalar_not_written(op, "found_inf", found_inf, {{scale}, {growth_tracker}, {hysteresis_tracker}},
                           {"scale", "growth_tracker", "hysteresis_tracker"}, {true, true, true});
}

// grad_sumsq_exact: tensors float32/float16/bfloat16 on one device of type `expect` (read only:
// they may share memory), scale absent or a 1-element float32 tensor there. Returns the device.
inline at::Device validate_grad_sumsq_exact(const char* op, at::TensorList tensors,
                                            const std::optional<at::Tensor>& scale,
                                            at::DeviceType expect) {
  const bool scale_given = scale.has_value() && scale->defined();
  TORCH_CHECK(!tensors.empty() || scale_given, op,
              ": tensors is empty and no scale gives the device for the result");
  const at::Device device = !tensors.empty() ? tensors[0].device() : scale->device();
  TORCH_CHECK(device.type() == expect, op, ": expected tensors on ", expect, ", got ", device);
  check_float_list(op, "tensors", tensors, device);
  check_scale(op, scale, device);
  return device;
}

// exact_sumsq_to_double: digits a float64 tensor of shape [kExactDigits] on a device of type
// `expect` (its values are checked by the CPU launcher; the CUDA one returns NaN instead).
inline void validate_exact_digits(const char* op, const at::Tensor& digits, int64_t num_digits,
                                  at::DeviceType expect) {
  TORCH_CHECK(digits.defined(), op, ": digits is undefined");
  TORCH_CHECK(digits.device().type() == expect, op, ": expected digits on ", expect, ", got ",
              digits.device());
  TORCH_CHECK(digits.scalar_type() == at::kDouble && digits.dim() == 1 &&
                  digits.size(0) == num_digits,
              op, ": digits must be a float64 tensor of shape [", num_digits, "], got ",
              digits.scalar_type(), " of shape ", digits.sizes());
}

}  // namespace tpamp
