// Host entry points of the tpamp ops, one per (op, launcher). The schemas are in tpamp_ops.cpp
// (TORCH_LIBRARY); the CPU entry points are registered in cpu/register.cpp, the CUDA ones in
// tpamp_ops.cpp. Contracts: tpamp/ops.py (the only caller) and docs/spec.md section 4.

#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace tpamp {

using GradStatsResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

#define TPAMP_DECLARE_OPS(ns)                                                                 \
  namespace ns {                                                                              \
  GradStatsResult grad_stats_(at::TensorList grads, const std::optional<at::Tensor>& scale,   \
                              const c10::List<bool>& mask, bool count_zeros, bool per_tensor); \
  GradStatsResult grad_stats_out(at::TensorList grads, const std::optional<at::Tensor>& scale, \
                                 const c10::List<bool>& mask, bool count_zeros,               \
                                 bool per_tensor, at::TensorList out);                        \
  void scale_(at::TensorList tensors, const at::Tensor& scale);                               \
  void scale_and_copy(at::TensorList srcs, at::TensorList dsts,                               \
                      const std::optional<at::Tensor>& scale);                                \
  void dynamic_scaler_update_(const at::Tensor& scale, const at::Tensor& growth_tracker,      \
                              const at::Tensor& hysteresis_tracker,                           \
                              const at::Tensor& found_inf, double growth_factor,              \
                              double backoff_factor, int64_t growth_interval,                 \
                              int64_t hysteresis, double min_scale, double max_scale,         \
                              bool consecutive);                                              \
  void fused_adam_step_(at::TensorList params, at::TensorList exp_avgs,                       \
                        at::TensorList exp_avg_sqs, at::TensorList steps,                     \
                        at::TensorList model_params, at::TensorList grads,                    \
                        const std::optional<at::Tensor>& grad_scale,                          \
                        const std::optional<at::Tensor>& found_inf,                           \
                        const std::optional<at::Tensor>& lr_tensor, double lr, double beta1,  \
                        double beta2, double eps, double weight_decay,                        \
                        bool decoupled_weight_decay, bool maximize,                           \
                        at::TensorList exp_avg_scales, at::TensorList exp_avg_sq_scales,      \
                        const std::optional<at::Tensor>& stochastic_rounding);                \
  void fused_sgd_step_(at::TensorList params, at::TensorList momentum_buffers,                \
                       at::TensorList model_params, at::TensorList grads,                     \
                       const c10::List<bool>& first_step,                                     \
                       const std::optional<at::Tensor>& grad_scale,                           \
                       const std::optional<at::Tensor>& found_inf,                            \
                       const std::optional<at::Tensor>& lr_tensor, double lr, double momentum, \
                       double dampening, double weight_decay, bool nesterov, bool maximize);  \
  at::Tensor grad_sumsq_exact(at::TensorList tensors, const std::optional<at::Tensor>& scale); \
  at::Tensor exact_sumsq_to_double(const at::Tensor& digits);                                 \
  }

TPAMP_DECLARE_OPS(cpu)   // csrc/cpu/*.cpp
TPAMP_DECLARE_OPS(cuda)  // csrc/cuda/*.cu

#undef TPAMP_DECLARE_OPS

// Every op of torch.ops.tpamp, for the registrations that cover them all: the Autograd and
// ADInplaceOrView kernels (tpamp_ops.cpp) and the emulated CUDA launchers (csrc/simt/register.cpp,
// torch.ops.tpamp_simt.*). A new op is added here once.
#define TPAMP_FOR_EACH_OP(X)  \
  X(grad_stats_)              \
  X(grad_stats_out)           \
  X(scale_)                   \
  X(scale_and_copy)           \
  X(dynamic_scaler_update_)   \
  X(fused_adam_step_)         \
  X(fused_sgd_step_)          \
  X(grad_sumsq_exact)         \
  X(exact_sumsq_to_double)

}  // namespace tpamp
