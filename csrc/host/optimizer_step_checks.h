// Argument validation of fused_adam_step_ and fused_sgd_step_, shared by the CPU and CUDA
// launchers so both accept and reject exactly the same calls (host code, header-only).

#pragma once

#include "checks.h"
#include "../kernels/optimizer_step.h"

#include <algorithm>
#include <initializer_list>
#include <string>

#include <ATen/core/List.h>

namespace tpamp {

struct StepArgs {
  at::Device device;
  bool has_grad_scale;
  bool has_found_inf;
  bool has_lr_tensor;
};

// A 1-element float32 tensor on `device`, or absent. Returns whether present.
inline bool check_device_scalar(const char* op, const char* name,
                                const std::optional<at::Tensor>& t, const at::Device& device) {
  if (!t.has_value() || !t->defined()) return false;
  TORCH_CHECK(t->device() == device, op, ": ", name, " is on ", t->device(), ", expected ",
              device, " (the params' device)");
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == 1, op, ": ", name,
              " must be a 1-element float32 tensor, got ", t->scalar_type(), " of shape ",
              t->sizes());
  return true;
}

inline void check_fp32_list(const char* op, const char* name, at::TensorList ts) {
  for (size_t i = 0; i < ts.size(); ++i) {
    TORCH_CHECK(ts[i].scalar_type() == at::kFloat, op, ": ", name, "[", i, "] has dtype ",
                ts[i].scalar_type(), "; expected float32");
  }
}

// Every tensor of a list: defined, on `device`, one of `dtypes`, non-overlapping and dense.
inline void check_dense_list(const char* op, const char* name, at::TensorList ts,
                             const at::Device& device, std::initializer_list<at::ScalarType> dtypes,
                             const char* expected) {
  for (size_t i = 0; i < ts.size(); ++i) {
    const at::Tensor& t = ts[i];
    TORCH_CHECK(t.defined(), op, ": ", name, "[", i, "] is undefined");
    TORCH_CHECK(t.device() == device, op, ": ", name, "[", i, "] is on ", t.device(),
                ", expected ", device, " (all tensors on one device)");
    TORCH_CHECK(std::find(dtypes.begin(), dtypes.end(), t.scalar_type()) != dtypes.end(), op,
                ": ", name, "[", i, "] has dtype ", t.scalar_type(), "; expected ", expected);
    TORCH_CHECK(t.numel() <= 1 || t.is_non_overlapping_and_dense(), op, ": ", name, "[", i,
                "] must be non-overlapping and dense, got sizes ", t.sizes(), " and strides ",
                t.strides());
  }
}

// A moment list (float32, bfloat16, uint8 or float8_e4m3fn) and its scales: for every 8-bit
// (uint8 or float8_e4m3fn) entry i,
// scales[i] is a contiguous float32 tensor of num_moment_blocks(numel) elements (one per block
// of kMomentBlock, kernels/optimizer_step.h); scales is empty when no entry is 8-bit.
inline void check_moment_list(const char* op, const char* name, at::TensorList moments,
                              const char* scale_name, at::TensorList scales,
                              at::TensorList params, const at::Device& device) {
  check_dense_list(op, name, moments, device,
                   {at::kFloat, at::kBFloat16, at::kByte, at::kFloat8_e4m3fn},
                   "float32, bfloat16, uint8 (dynamic-map codes) or float8_e4m3fn");
  check_same_layout(op, "params", params, name, moments);
  auto is8 = [](const at::Tensor& t) {
    return t.scalar_type() == at::kFloat8_e4m3fn || t.scalar_type() == at::kByte;
  };
  bool any8 = false;
  for (const auto& t : moments) any8 |= is8(t);
  TORCH_CHECK(scales.size() == moments.size() || (!any8 && scales.empty()), op, ": ",
              scale_name, " has ", scales.size(), " tensors, ", name, " has ", moments.size(),
              " (pass one per param when any is uint8 or float8_e4m3fn, else none)");
  for (size_t i = 0; i < moments.size() && any8; ++i) {
    if (!is8(moments[i])) continue;
    const at::Tensor& sc = scales[i];
    const int64_t blocks = num_moment_blocks(moments[i].numel());
    TORCH_CHECK(sc.defined() && sc.device() == device && sc.scalar_type() == at::kFloat &&
                    sc.is_contiguous() && sc.numel() == blocks,
                op, ": ", scale_name, "[", i, "] must be a contiguous float32 tensor of ", blocks,
                " elements (one per block of ", kMomentBlock, ") on ", device, ", got ",
                sc.defined() ? sc.toString() : "undefined",
                sc.defined() ? " of " + std::to_string(sc.numel()) + " elements" : "");
  }
}

inline void check_model_list(const char* op, at::TensorList params, at::TensorList models,
                             const at::Device& device) {
  if (models.empty()) return;
  check_float_list(op, "model_params", models, device);
  check_same_layout(op, "params", params, "model_params", models);
  for (size_t i = 0; i < models.size(); ++i) {
    const auto t = models[i].scalar_type();
    TORCH_CHECK(t == at::kHalf || t == at::kBFloat16, op, ": model_params[", i, "] has dtype ",
                t, "; expected float16 or bfloat16 (fp32 params are their own model params)");
  }
}

// grad_scale, found_inf and lr_tensor are read by every block: none may share memory with a list
// the step writes (checks.h: check_scalar_not_written).
inline void check_step_scalars_not_written(const char* op,
                                           const std::optional<at::Tensor>& grad_scale,
                                           const std::optional<at::Tensor>& found_inf,
                                           const std::optional<at::Tensor>& lr_tensor,
                                           const std::vector<at::TensorList>& written_lists,
                                           const std::vector<const char*>& names) {
  const std::vector<bool> written(written_lists.size(), true);
  check_scalar_not_written(op, "grad_scale", grad_scale, written_lists, names, written);
  check_scalar_not_written(op, "found_inf", found_inf, written_lists, names, written);
  check_scalar_not_written(op, "lr_tensor", lr_tensor, written_lists, names, written);
}

// The lists every step op shares: params (fp32), grads (any float dtype), model_params (empty or
// fp16/bf16), all of one layout per entry; the device scalars.
inline StepArgs check_step_common(const char* op, at::TensorList params, at::TensorList grads,
                                  at::TensorList model_params,
                                  const std::optional<at::Tensor>& grad_scale,
                                  const std::optional<at::Tensor>& found_inf,
                                  const std::optional<at::Tensor>& lr_tensor,
                                  at::DeviceType expect, bool allow_remainders = false) {
  // The params' device; with no params, the first device scalar's (an empty step is valid on any
  // device of the launcher's type), else the launcher's device type.
  at::Device device(expect);
  if (!params.empty()) {
    device = params[0].device();
  } else {
    for (const auto* s : {&grad_scale, &found_inf, &lr_tensor}) {
      if (s->has_value() && (*s)->defined()) {
        device = (*s)->device();
        break;
      }
    }
  }
  TORCH_CHECK(device.type() == expect, op, ": expected tensors on ", expect, ", got ", device);
  if (allow_remainders) {
    check_dense_list(op, "params", params, device, {at::kFloat, at::kShort, at::kBFloat16},
                     "float32 (fp32 main params), int16 (remainders of bf16 model_params) or "
                     "bfloat16 (bf16 params with stochastic rounding)");
  } else {
    check_float_list(op, "params", params, device);
    check_fp32_list(op, "params", params);
  }
  check_float_list(op, "grads", grads, device);
  check_same_layout(op, "params", params, "grads", grads);
  TORCH_CHECK(model_params.empty() || model_params.size() == params.size(), op,
              ": model_params has ", model_params.size(), " tensors, params has ", params.size(),
              " (pass none, or one per param)");
  check_model_list(op, params, model_params, device);
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK(params[i].scalar_type() != at::kShort ||
                    (!model_params.empty() && model_params[i].scalar_type() == at::kBFloat16),
                op, ": params[", i, "] is int16 (the remainders of a bf16 param), so "
                "model_params[", i, "] must be the bfloat16 param, got ",
                model_params.empty() ? std::string("no model_params")
                                     : std::string(c10::toString(model_params[i].scalar_type())));
  }
  const bool gs = check_device_scalar(op, "grad_scale", grad_scale, device);
  const bool fi = check_device_scalar(op, "found_inf", found_inf, device);
  const bool lt = check_device_scalar(op, "lr_tensor", lr_tensor, device);
  return {device, gs, fi, lt};
}

inline StepArgs validate_adam_step(const char* op, at::TensorList params,
                                   at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                                   at::TensorList steps, at::TensorList model_params,
                                   at::TensorList grads,
                                   const std::optional<at::Tensor>& grad_scale,
                                   const std::optional<at::Tensor>& found_inf,
                                   const std::optional<at::Tensor>& lr_tensor,
                                   at::TensorList exp_avg_scales, at::TensorList exp_avg_sq_scales,
                                   const at::Device& launcher,
                                   const std::optional<at::Tensor>& stochastic_rounding =
                                       std::nullopt) {
  const StepArgs a = check_step_common(op, params, grads, model_params, grad_scale, found_inf,
                                       lr_tensor, launcher.type(), /*allow_remainders=*/true);
  // bf16 params with stochastic rounding (docs/spec.md section 21): the param is its own master
  // and model param; stochastic_rounding holds (key, global index of the first element) per
  // param as a contiguous int64 [len(params), 2] tensor on the params' device.
  const bool has_sr = stochastic_rounding.has_value() && stochastic_rounding->defined();
  if (has_sr) {
    const at::Tensor& t = *stochastic_rounding;
    TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 2 &&
                    t.size(0) == static_cast<int64_t>(params.size()) && t.size(1) == 2 &&
                    t.is_contiguous() && (params.empty() || t.device() == a.device),
                op, ": stochastic_rounding must be a contiguous int64 tensor of shape [",
                params.size(), ", 2] (key, first element index per param) on ", a.device,
                ", got ", t.toString(), " of shape ", t.sizes(), " on ", t.device());
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].scalar_type() != at::kBFloat16) continue;
    TORCH_CHECK(has_sr && model_params.empty(), op, ": params[", i,
                "] is bfloat16 (a bf16 param written with stochastic rounding), which needs the "
                "stochastic_rounding tensor and no model_params (the param is its own model "
                "param); got ", has_sr ? "" : "no stochastic_rounding, ", model_params.size(),
                " model_params");
  }
  check_scalar_not_written(
      op, "stochastic_rounding", stochastic_rounding,
      {params, exp_avgs, exp_avg_sqs, model_params, steps, exp_avg_scales, exp_avg_sq_scales},
      {"params", "exp_avgs", "exp_avg_sqs", "model_params", "steps", "exp_avg_scales",
       "exp_avg_sq_scales"},
      std::vector<bool>(7, true));
  check_moment_list(op, "exp_avgs", exp_avgs, "exp_avg_scales", exp_avg_scales, params, a.device);
  check_moment_list(op, "exp_avg_sqs", exp_avg_sqs, "exp_avg_sq_scales", exp_avg_sq_scales,
                    params, a.device);
  TORCH_CHECK(steps.size() == params.size(), op, ": steps has ", steps.size(),
              " tensors, params has ", params.size());
  for (size_t i = 0; i < steps.size(); ++i) {
    const at::Tensor& s = steps[i];
    TORCH_CHECK(s.defined() && s.numel() == 1 && s.device() == a.device &&
                    (s.scalar_type() == at::kFloat || s.scalar_type() == at::kDouble),
                op, ": steps[", i, "] must be a 1-element float32/float64 tensor on ", a.device,
                ", got ", s.defined() ? s.toString() : "undefined");
  }
  check_no_overlap(op, {params, exp_avgs, exp_avg_sqs, model_params, grads, steps,
                       exp_avg_scales, exp_avg_sq_scales},
                   {"params", "exp_avgs", "exp_avg_sqs", "model_params", "grads", "steps",
                    "exp_avg_scales", "exp_avg_sq_scales"},
                   {true, true, true, true, false, true, true, true}, false);
  check_step_scalars_not_written(
      op, grad_scale, found_inf, lr_tensor,
      {params, exp_avgs, exp_avg_sqs, model_params, steps, exp_avg_scales, exp_avg_sq_scales},
      {"params", "exp_avgs", "exp_avg_sqs", "model_params", "steps", "exp_avg_scales",
       "exp_avg_sq_scales"});
  return a;
}

inline StepArgs validate_sgd_step(const char* op, at::TensorList params,
                                  at::TensorList momentum_buffers, at::TensorList model_params,
                                  at::TensorList grads, const c10::List<bool>& first_step,
                                  const std::optional<at::Tensor>& grad_scale,
                                  const std::optional<at::Tensor>& found_inf,
                                  const std::optional<at::Tensor>& lr_tensor, double momentum,
                                  const at::Device& launcher) {
  const StepArgs a = check_step_common(op, params, grads, model_params, grad_scale, found_inf,
                                       lr_tensor, launcher.type());
  if (momentum != 0.0) {
    check_float_list(op, "momentum_buffers", momentum_buffers, a.device);
    check_fp32_list(op, "momentum_buffers", momentum_buffers);
    check_same_layout(op, "params", params, "momentum_buffers", momentum_buffers);
  } else {
    TORCH_CHECK(momentum_buffers.empty(), op, ": momentum is 0 but ", momentum_buffers.size(),
                " momentum_buffers were given");
  }
  TORCH_CHECK(first_step.size() == params.size(), op, ": first_step has ", first_step.size(),
              " entries, params has ", params.size());
  check_no_overlap(op, {params, momentum_buffers, model_params, grads},
                   {"params", "momentum_buffers", "model_params", "grads"},
                   {true, true, true, false}, false);
  check_step_scalars_not_written(op, grad_scale, found_inf, lr_tensor,
                                 {params, momentum_buffers, model_params},
                                 {"params", "momentum_buffers", "model_params"});
  return a;
}

}  // namespace tpamp
