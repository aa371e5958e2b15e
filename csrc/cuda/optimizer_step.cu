// CUDA launcher of tpamp::fused_adam_step_ and tpamp::fused_sgd_step_ (math:
// csrc/kernels/optimizer_step.h; CPU twin: csrc/cpu/optimizer_step.cpp).
//
// One multi_tensor_apply launch per (grad dtype, model dtype) group: each block takes one chunk
// of one param, reads found_inf, the grad multiplier, the lr and the param's step count on the
// device (no host sync), computes the step's scalars once per block, and updates its elements.
// The step counts (float32 or float64, mixed) are incremented after those launches, on the same
// stream, by one small kernel that also reads found_inf (nothing changes when it is set).

#include "../host/optimizer_step_checks.h"
#include "../kernels/optimizer_step.h"
#include "../ops.h"
#include "multi_tensor_apply.cuh"

#include <ATen/core/Tensor.h>

#include <type_traits>

namespace tpamp {

// Table sizes of the step launches (kernel parameters <= 4 KB with the functor).
template <>
struct MaxTensors<4> { static constexpr int value = 64; };
template <>
struct MaxTensors<6> { static constexpr int value = 48; };

namespace cuda {
namespace {

struct NoModel {};

constexpr int kAdamDepth = 6;  // grad, param, exp_avg, exp_avg_sq, model (or null), step
constexpr int kSgdDepth = 4;   // grad, param, momentum buffer (or null), model (or null)

__device__ __forceinline__ bool skipped(const float* found_inf) {
  return found_inf != nullptr && *found_inf != 0.0f;
}

template <typename G, typename M>
struct AdamFunctor {
  AdamHyper h;
  const float* grad_scale;  // null: 1
  const float* found_inf;   // null: never skip
  const float* lr;          // null: h.lr
  bool maximize;
  bool step_is_double;

  __device__ __forceinline__ void operator()(const ChunkInfo<kAdamDepth>& c) const {
    if (skipped(found_inf)) return;
    __shared__ AdamScalars shared;
    if (threadIdx.x == 0) {
      AdamHyper hh = h;
      if (lr != nullptr) hh.lr = static_cast<double>(*lr);
      const double step = step_is_double ? *static_cast<const double*>(c.addr[5])
                                         : static_cast<double>(*static_cast<const float*>(c.addr[5]));
      shared = adam_scalars(hh, step + 1.0, grad_scale != nullptr ? *grad_scale : 1.0f, maximize);
    }
    __syncthreads();
    const AdamScalars s = shared;
    const G* g = static_cast<const G*>(c.addr[0]) + c.offset;
    float* p = static_cast<float*>(c.addr[1]) + c.offset;
    float* m = static_cast<float*>(c.addr[2]) + c.offset;
    float* v = static_cast<float*>(c.addr[3]) + c.offset;
    for (int i = threadIdx.x; i < c.n; i += kBlockSize) {
      float pi = p[i], mi = m[i], vi = v[i];
      adam_element<float>(pi, mi, vi, static_cast<float>(g[i]), s);
      p[i] = pi;
      m[i] = mi;
      v[i] = vi;
      if constexpr (!std::is_same_v<M, NoModel>) {
        static_cast<M*>(c.addr[4])[c.offset + i] = static_cast<M>(pi);
      }
    }
  }
};

template <typename G, typename M>
struct SgdFunctor {
  SgdHyper h;
  const float* grad_scale;
  const float* found_inf;
  const float* lr;
  bool maximize;

  __device__ __forceinline__ void operator()(const ChunkInfo<kSgdDepth>& c) const {
    if (skipped(found_inf)) return;
    SgdHyper hh = h;
    if (lr != nullptr) hh.lr = static_cast<double>(*lr);
    const SgdScalars s = sgd_scalars(hh, grad_scale != nullptr ? *grad_scale : 1.0f, maximize);
    const bool first = c.masked;  // the buffer holds no value yet
    const G* g = static_cast<const G*>(c.addr[0]) + c.offset;
    float* p = static_cast<float*>(c.addr[1]) + c.offset;
    float* buf = s.has_momentum ? static_cast<float*>(c.addr[2]) + c.offset : nullptr;
    for (int i = threadIdx.x; i < c.n; i += kBlockSize) {
      float pi = p[i];
      float bi = (buf != nullptr && !first) ? buf[i] : 0.0f;
      sgd_element<float>(pi, bi, static_cast<float>(g[i]), first, s);
      p[i] = pi;
      if (buf != nullptr) buf[i] = bi;
      if constexpr (!std::is_same_v<M, NoModel>) {
        static_cast<M*>(c.addr[3])[c.offset + i] = static_cast<M>(pi);
      }
    }
  }
};

// The step counts of one launch: one thread per count, steps[i] += 1 unless found_inf is set.
constexpr int kMaxStepCounts = 384;  // 3.5 KB of kernel parameters
constexpr int kStepThreads = 128;
struct StepTable {
  void* addr[kMaxStepCounts];
  uint8_t is_double[kMaxStepCounts];
  int32_t count;
};

__global__ void __launch_bounds__(kStepThreads)
    increment_steps_kernel(const StepTable table, const float* found_inf) {
  if (skipped(found_inf)) return;
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= table.count) return;
  if (table.is_double[i] != 0) {
    *static_cast<double*>(table.addr[i]) += 1.0;
  } else {
    *static_cast<float*>(table.addr[i]) += 1.0f;
  }
}

// steps[i] += (found_inf == 0) for every i, on the current stream (after the step launches).
void increment_steps(at::TensorList steps, const float* found_inf) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  StepTable table;
  table.count = 0;
  auto launch = [&]() {
    if (table.count == 0) return;
    const unsigned int blocks = (table.count + kStepThreads - 1) / kStepThreads;
    TPAMP_LAUNCH(increment_steps_kernel, blocks, kStepThreads, 0, stream, table, found_inf);
    table.count = 0;
  };
  for (const at::Tensor& s : steps) {
    if (table.count == kMaxStepCounts) launch();
    table.addr[table.count] = s.data_ptr();
    table.is_double[table.count] = s.scalar_type() == at::kDouble ? 1 : 0;
    ++table.count;
  }
  launch();
}

// f(G{}, M{}) for the C++ types of a grad and a model dtype (M = NoModel: no model params).
template <typename F>
void dispatch_grad_model(at::ScalarType gt, bool has_model, at::ScalarType mt, F&& f) {
  dispatch_float_type(gt, "grads", [&](auto g_tag) {
    if (!has_model) {
      f(g_tag, NoModel{});
    } else if (mt == at::kHalf) {
      f(g_tag, at::Half{});
    } else {
      f(g_tag, at::BFloat16{});
    }
  });
}

int dtype_slot(at::ScalarType t) {
  return t == at::kFloat ? 0 : (t == at::kHalf ? 1 : 2);
}

const float* ptr_or_null(const std::optional<at::Tensor>& t, bool present) {
  return present ? t->const_data_ptr<float>() : nullptr;
}

}  // namespace

void fused_adam_step_(at::TensorList params, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                      at::TensorList steps, at::TensorList model_params, at::TensorList grads,
                      const std::optional<at::Tensor>& grad_scale,
                      const std::optional<at::Tensor>& found_inf,
                      const std::optional<at::Tensor>& lr_tensor, double lr, double beta1,
                      double beta2, double eps, double weight_decay, bool decoupled_weight_decay,
                      bool maximize) {
  const char* op = "tpamp::fused_adam_step_";
  const StepArgs a = validate_adam_step(op, params, exp_avgs, exp_avg_sqs, steps, model_params,
                                        grads, grad_scale, found_inf, lr_tensor,
                                        at::Device(kLauncherDevice));
  if (params.empty()) return;
  const c10::cuda::CUDAGuard guard(a.device);
  const bool has_model = !model_params.empty();
  const AdamHyper h{lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay};
  // entries grouped by (grad dtype, model dtype, step dtype)
  std::vector<TensorEntry<kAdamDepth>> groups[3][3][2];
  for (size_t i = 0; i < params.size(); ++i) {
    TensorEntry<kAdamDepth> e;
    e.addr = {const_cast<void*>(grads[i].const_data_ptr()), params[i].data_ptr(),
              exp_avgs[i].data_ptr(), exp_avg_sqs[i].data_ptr(),
              has_model ? model_params[i].data_ptr() : nullptr, steps[i].data_ptr()};
    e.numel = params[i].numel();
    e.slot = 0;
    e.index = static_cast<int32_t>(i);
    e.flags = kWrite;
    groups[dtype_slot(grads[i].scalar_type())]
          [has_model ? dtype_slot(model_params[i].scalar_type()) : 0]
          [steps[i].scalar_type() == at::kDouble ? 1 : 0]
              .push_back(e);
  }
  for (int gi = 0; gi < 3; ++gi) {
    for (int mi = 0; mi < 3; ++mi) {
      for (int si = 0; si < 2; ++si) {
        const auto& entries = groups[gi][mi][si];
        if (entries.empty()) continue;
        const size_t first = static_cast<size_t>(entries[0].index);
        dispatch_grad_model(
            grads[first].scalar_type(), has_model,
            has_model ? model_params[first].scalar_type() : at::kFloat,
            [&](auto g_tag, auto m_tag) {
              using G = decltype(g_tag);
              using M = decltype(m_tag);
              multi_tensor_apply<kAdamDepth>(
                  entries, AdamFunctor<G, M>{h, ptr_or_null(grad_scale, a.has_grad_scale),
                                             ptr_or_null(found_inf, a.has_found_inf),
                                             ptr_or_null(lr_tensor, a.has_lr_tensor), maximize,
                                             si == 1});
            });
      }
    }
  }
  // steps += (found_inf == 0), after the launches on the same stream: no host sync
  increment_steps(steps, ptr_or_null(found_inf, a.has_found_inf));
}

void fused_sgd_step_(at::TensorList params, at::TensorList momentum_buffers,
                     at::TensorList model_params, at::TensorList grads,
                     const c10::List<bool>& first_step,
                     const std::optional<at::Tensor>& grad_scale,
                     const std::optional<at::Tensor>& found_inf,
                     const std::optional<at::Tensor>& lr_tensor, double lr, double momentum,
                     double dampening, double weight_decay, bool nesterov, bool maximize) {
  const char* op = "tpamp::fused_sgd_step_";
  const StepArgs a = validate_sgd_step(op, params, momentum_buffers, model_params, grads,
                                       first_step, grad_scale, found_inf, lr_tensor, momentum,
                                       at::Device(kLauncherDevice));
  if (params.empty()) return;
  const c10::cuda::CUDAGuard guard(a.device);
  const bool has_model = !model_params.empty();
  const bool has_momentum = momentum != 0.0;
  const SgdHyper h{lr, momentum, dampening, weight_decay, nesterov};
  std::vector<TensorEntry<kSgdDepth>> groups[3][3];
  for (size_t i = 0; i < params.size(); ++i) {
    TensorEntry<kSgdDepth> e;
    e.addr = {const_cast<void*>(grads[i].const_data_ptr()), params[i].data_ptr(),
              has_momentum ? momentum_buffers[i].data_ptr() : nullptr,
              has_model ? model_params[i].data_ptr() : nullptr};
    e.numel = params[i].numel();
    e.slot = 0;
    e.index = static_cast<int32_t>(i);
    e.flags = static_cast<uint8_t>(kWrite | (first_step.get(i) ? kMasked : 0));
    groups[dtype_slot(grads[i].scalar_type())]
          [has_model ? dtype_slot(model_params[i].scalar_type()) : 0]
              .push_back(e);
  }
  for (int gi = 0; gi < 3; ++gi) {
    for (int mi = 0; mi < 3; ++mi) {
      const auto& entries = groups[gi][mi];
      if (entries.empty()) continue;
      const size_t first = static_cast<size_t>(entries[0].index);
      dispatch_grad_model(
          grads[first].scalar_type(), has_model,
          has_model ? model_params[first].scalar_type() : at::kFloat,
          [&](auto g_tag, auto m_tag) {
            using G = decltype(g_tag);
            using M = decltype(m_tag);
            multi_tensor_apply<kSgdDepth>(
                entries, SgdFunctor<G, M>{h, ptr_or_null(grad_scale, a.has_grad_scale),
                                          ptr_or_null(found_inf, a.has_found_inf),
                                          ptr_or_null(lr_tensor, a.has_lr_tensor), maximize});
          });
    }
  }
}

}  // namespace cuda
}  // namespace tpamp
