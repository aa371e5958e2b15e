// Host entry points of the tpamp CUDA ops, registered in tpamp_ops.cpp as torch.ops.tpamp.*.
// Contracts: tpamp/ops.py (the only caller) and SPEC.md section 4.

#pragma once

#include <ATen/ATen.h>
#include <ATen/core/List.h>

#include <optional>
#include <tuple>

namespace tpamp {

// grad_stats.cu
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> grad_stats_cuda(
    at::TensorList grads, at::TensorList out, const std::optional<at::Tensor>& scale,
    const c10::List<bool>& mask, bool count_zeros, bool per_tensor);

// scale_and_copy.cu
void scale_and_copy_cuda(at::TensorList srcs, at::TensorList dsts,
                         const std::optional<at::Tensor>& scale);

// dynamic_scaler.cu
void dynamic_scaler_update_cuda(const at::Tensor& scale, const at::Tensor& growth_tracker,
                                const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                                double growth_factor, double backoff_factor,
                                int64_t growth_interval, int64_t hysteresis, double min_scale,
                                double max_scale, bool consecutive);

}  // namespace tpamp
