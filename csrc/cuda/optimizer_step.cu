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
template <>
struct MaxTensors<8> { static constexpr int value = 36; };

namespace cuda {
namespace {

struct NoModel {};

constexpr int kAdamDepth = 6;  // grad, param, exp_avg, exp_avg_sq, model (or null), step
constexpr int kSgdDepth = 4;   // grad, param, momentum buffer (or null), model (or null)
// narrow state: grad, param (fp32 or int16 remainder), exp_avg, exp_avg_sq, model (or null),
// step, exp_avg scales (8-bit, else null), exp_avg_sq scales (8-bit, else null)
constexpr int kNarrowDepth = 8;
constexpr int kWarps = kBlockSize / 32;
static_assert(kMomentBlock == 8 * 32, "one warp reads a moment block as 8 elements per lane");

__device__ __forceinline__ bool skipped(const float* found_inf) {
  return found_inf != nullptr && *found_inf != 0.0f;
}

// This chunk's Adam scalars (bias corrections from its tensor's step count): thread 0 computes
// them once per block, the others read them after the barrier.
__device__ __forceinline__ AdamScalars block_adam_scalars(AdamHyper h, const float* lr,
                                                          const void* step, bool step_is_double,
                                                          const float* grad_scale, bool maximize) {
  __shared__ AdamScalars shared;
  if (threadIdx.x == 0) {
    if (lr != nullptr) h.lr = static_cast<double>(*lr);
    const double n = step_is_double ? *static_cast<const double*>(step)
                                    : static_cast<double>(*static_cast<const float*>(step));
    shared = adam_scalars(h, n + 1.0, grad_scale != nullptr ? *grad_scale : 1.0f, maximize);
  }
  __syncthreads();
  return shared;
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
    const AdamScalars s =
        block_adam_scalars(h, lr, c.addr[5], step_is_double, grad_scale, maximize);
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

// Storage of a moment (kernels/optimizer_step.h): float32, bf16, or e4m3fn / uint8 (dynamic map)
// codes + block scales.
enum MomentKind : int { kMomentFloat = 0, kMomentBf16 = 1, kMomentFp8 = 2, kMomentDynamic = 3 };
constexpr int kMomentKinds = 4;

__device__ __forceinline__ bool blockwise(int kind) {
  return kind == kMomentFp8 || kind == kMomentDynamic;
}

__device__ __forceinline__ float load_moment(const void* data, int64_t i, int kind,
                                             float scale, bool sq) {
  if (kind == kMomentFloat) return static_cast<const float*>(data)[i];
  if (kind == kMomentBf16) return bf16_to_float(static_cast<const uint16_t*>(data)[i]);
  if (kind == kMomentDynamic) {  // exp_avg_sq (sq): the unsigned map, the value itself
    const uint8_t c = static_cast<const uint8_t*>(data)[i];
    return sq ? dynamic_sq_decode(c, scale, kDynamicMapUnsigned) : kDynamicMapSigned[c] * scale;
  }
  const float r = fp8_e4m3_decode(static_cast<const uint8_t*>(data)[i]) * scale;
  return sq ? r * r : r;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = max_propagate_nan(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// Adam/AdamW with narrow state: each warp takes one block of kMomentBlock elements (8 per lane,
// coalesced), so an 8-bit moment's block max is one warp reduction and no block barrier.
template <typename G, typename M>
struct NarrowAdamFunctor {
  AdamHyper h;
  const float* grad_scale;
  const float* found_inf;
  const float* lr;
  bool maximize;
  bool step_is_double;
  bool remainders;  // params are int16 remainders of the bf16 model params
  // params are bf16, stepped in place with stochastic rounding (docs/spec.md section 21); the
  // model slot holds a pointer to the param's (key, first element index) int64 pair
  bool stochastic;
  int m_kind;
  int v_kind;

  __device__ __forceinline__ void operator()(const ChunkInfo<kNarrowDepth>& c) const {
    if (skipped(found_inf)) return;
    const AdamScalars s =
        block_adam_scalars(h, lr, c.addr[5], step_is_double, grad_scale, maximize);
    const int warp = static_cast<int>(threadIdx.x) / 32;
    const int lane = static_cast<int>(threadIdx.x) % 32;
    const G* g = static_cast<const G*>(c.addr[0]);
    float* m_scales = static_cast<float*>(c.addr[6]);
    float* v_scales = static_cast<float*>(c.addr[7]);
    uint64_t sr_key_stream = 0, sr_first = 0;
    if (stochastic) {
      const int64_t* row = static_cast<const int64_t*>(c.addr[4]);
      const double n = step_is_double ? *static_cast<const double*>(c.addr[5])
                                      : static_cast<double>(*static_cast<const float*>(c.addr[5]));
      sr_key_stream = sr_stream(static_cast<uint64_t>(row[0]), n + 1.0);
      sr_first = static_cast<uint64_t>(row[1]);
    }
    for (int base = warp * static_cast<int>(kMomentBlock); base < c.n;
         base += kWarps * static_cast<int>(kMomentBlock)) {
      const int64_t block = (c.offset + base) / kMomentBlock;
      const float ms_in = blockwise(m_kind) ? m_scales[block] : 1.0f;
      const float vs_in = blockwise(v_kind) ? v_scales[block] : 1.0f;
      float mv[8], vv[8];
      float m_max = 0.0f, v_max = 0.0f;
#pragma unroll 1  // unrolled, cicc took > 12 min per arch on this functor (40 s like this)
      for (int k = 0; k < 8; ++k) {
        const int j = base + lane + 32 * k;
        mv[k] = 0.0f;
        vv[k] = 0.0f;
        if (j >= c.n) continue;
        const int64_t i = c.offset + j;
        float p;
        if (stochastic) {
          p = bf16_to_float(static_cast<const uint16_t*>(c.addr[1])[i]);
        } else if (remainders) {
          p = join_remainder(static_cast<const uint16_t*>(c.addr[4])[i],
                             static_cast<const int16_t*>(c.addr[1])[i]);
        } else {
          p = static_cast<const float*>(c.addr[1])[i];
        }
        float m = load_moment(c.addr[2], i, m_kind, ms_in, false);
        float v = load_moment(c.addr[3], i, v_kind, vs_in, true);
        float v_root;  // 8-bit exp_avg_sq holds sqrt(v): the root the step takes
        if (m_kind == kMomentDynamic || v_kind == kMomentDynamic) {  // torchao's arithmetic
          adam_element_dynamic<float>(p, m, v, static_cast<float>(g[i]), s, AdamRuntimeFlags(s));
          v_root = sqrtf(v);
        } else {
          adam_element<float>(p, m, v, static_cast<float>(g[i]), s,
                              v_kind == kMomentFp8 ? &v_root : nullptr);
        }
        if (stochastic) {
          const uint64_t jg = sr_first + static_cast<uint64_t>(i);
          static_cast<uint16_t*>(c.addr[1])[i] = static_cast<uint16_t>(float_to_bf16_sr_bits(
              p, sr_random_bits(static_cast<uint32_t>(jg), sr_salt(sr_key_stream, jg >> 32))));
        } else if (remainders) {
          uint16_t bits;
          int16_t rem;
          split_remainder(p, bits, rem);
          static_cast<uint16_t*>(c.addr[4])[i] = bits;
          static_cast<int16_t*>(c.addr[1])[i] = rem;
        } else {
          static_cast<float*>(c.addr[1])[i] = p;
          if constexpr (!std::is_same_v<M, NoModel>) static_cast<M*>(c.addr[4])[i] = static_cast<M>(p);
        }
        if (v_kind == kMomentFp8) v = v_root;
        mv[k] = m;
        vv[k] = v;
        m_max = max_propagate_nan(m_max, fabsf(m));
        v_max = max_propagate_nan(v_max, fabsf(v));
      }
      MomentScale msc{1.0f, 1.0f}, vsc{1.0f, 1.0f};
      DynamicScale mdyn{1.0f, 1.0f}, vdyn{1.0f, 1.0f};
      if (blockwise(m_kind)) m_max = warp_max(m_max);
      if (blockwise(v_kind)) v_max = warp_max(v_max);
      if (m_kind == kMomentFp8) msc = moment_scale(m_max);
      if (v_kind == kMomentFp8) vsc = moment_scale(v_max);
      if (m_kind == kMomentDynamic) mdyn = dynamic_scale(m_max);
      if (v_kind == kMomentDynamic) vdyn = dynamic_scale(v_max);
      // exp_avg_sq holding inf (v_max is the warp's: a uniform branch): scale from the largest
      // finite |value| (dynamic_sq_inf_scale), inf code 255
      const bool v_inf = v_kind == kMomentDynamic && v_max > FLT_MAX;
      if (v_inf) {
        float finite_max = 0.0f;
        for (int k = 0; k < 8; ++k) {
          const float a = fabsf(vv[k]);
          finite_max = a <= FLT_MAX && a > finite_max ? a : finite_max;
        }
        vdyn = dynamic_sq_inf_scale(warp_max(finite_max));
      }
      if (lane == 0 && m_kind == kMomentFp8) m_scales[block] = msc.scale;
      if (lane == 0 && v_kind == kMomentFp8) v_scales[block] = vsc.scale;
      if (lane == 0 && m_kind == kMomentDynamic) m_scales[block] = mdyn.scale;
      if (lane == 0 && v_kind == kMomentDynamic) v_scales[block] = vdyn.scale;
#pragma unroll 1  // unrolled, cicc took > 12 min per arch on this functor (40 s like this)
      for (int k = 0; k < 8; ++k) {
        const int j = base + lane + 32 * k;
        if (j >= c.n) continue;
        const int64_t i = c.offset + j;
        if (m_kind == kMomentFloat) static_cast<float*>(c.addr[2])[i] = mv[k];
        if (m_kind == kMomentBf16) static_cast<uint16_t*>(c.addr[2])[i] = float_to_bf16(mv[k]);
        if (m_kind == kMomentFp8) static_cast<uint8_t*>(c.addr[2])[i] = fp8_e4m3_encode(mv[k] * msc.inv);
        if (m_kind == kMomentDynamic) {
          static_cast<uint8_t*>(c.addr[2])[i] = static_cast<uint8_t>(
              dynamic_encode_bits(mv[k] / mdyn.div, kDynamicMapSigned, kDynamicFloorSigned));
        }
        if (v_kind == kMomentFloat) static_cast<float*>(c.addr[3])[i] = vv[k];
        if (v_kind == kMomentBf16) static_cast<uint16_t*>(c.addr[3])[i] = float_to_bf16(vv[k]);
        if (v_kind == kMomentFp8) static_cast<uint8_t*>(c.addr[3])[i] = fp8_e4m3_encode(vv[k] * vsc.inv);
        if (v_kind == kMomentDynamic) {
          const uint32_t code =
              dynamic_encode_bits(vv[k] / vdyn.div, kDynamicMapUnsigned, kDynamicFloorUnsigned);
          static_cast<uint8_t*>(c.addr[3])[i] =
              static_cast<uint8_t>(v_inf ? dynamic_sq_inf_code(vv[k], code) : code);
        }
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

int moment_kind(at::ScalarType t) {
  if (t == at::kByte) return kMomentDynamic;
  return t == at::kFloat ? kMomentFloat : (t == at::kBFloat16 ? kMomentBf16 : kMomentFp8);
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
                      bool maximize, at::TensorList exp_avg_scales,
                      at::TensorList exp_avg_sq_scales,
                      const std::optional<at::Tensor>& stochastic_rounding) {
  const char* op = "tpamp::fused_adam_step_";
  const StepArgs a = validate_adam_step(op, params, exp_avgs, exp_avg_sqs, steps, model_params,
                                        grads, grad_scale, found_inf, lr_tensor, exp_avg_scales,
                                        exp_avg_sq_scales, at::Device(kLauncherDevice),
                                        stochastic_rounding);
  if (params.empty()) return;
  const c10::cuda::CUDAGuard guard(a.device);
  const bool has_model = !model_params.empty();
  const AdamHyper h{lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay};
  // entries grouped by (grad dtype, model dtype, step dtype)
  std::vector<TensorEntry<kAdamDepth>> groups[3][3][2];
  // narrow state: grouped by (grad, model, step dtype) x (exp_avg kind, exp_avg_sq kind,
  // master: fp32 / remainders / stochastic rounding)
  std::vector<TensorEntry<kNarrowDepth>> narrow[3][3][2][kMomentKinds][kMomentKinds][3];
  for (size_t i = 0; i < params.size(); ++i) {
    const int mk = moment_kind(exp_avgs[i].scalar_type());
    const int vk = moment_kind(exp_avg_sqs[i].scalar_type());
    const bool rem = params[i].scalar_type() == at::kShort;
    const bool sr = params[i].scalar_type() == at::kBFloat16;  // no model_params (validated)
    if (mk != kMomentFloat || vk != kMomentFloat || rem || sr) {
      TensorEntry<kNarrowDepth> e;
      e.addr = {const_cast<void*>(grads[i].const_data_ptr()), params[i].data_ptr(),
                exp_avgs[i].data_ptr(), exp_avg_sqs[i].data_ptr(),
                sr ? static_cast<void*>(stochastic_rounding->data_ptr<int64_t>() + 2 * i)
                   : (has_model ? model_params[i].data_ptr() : nullptr),
                steps[i].data_ptr(),
                mk == kMomentFp8 || mk == kMomentDynamic ? exp_avg_scales[i].data_ptr() : nullptr,
                vk == kMomentFp8 || vk == kMomentDynamic ? exp_avg_sq_scales[i].data_ptr()
                                                         : nullptr};
      e.numel = params[i].numel();
      e.slot = 0;
      e.index = static_cast<int32_t>(i);
      e.flags = kWrite;
      narrow[dtype_slot(grads[i].scalar_type())]
            [has_model ? dtype_slot(model_params[i].scalar_type()) : 0]
            [steps[i].scalar_type() == at::kDouble ? 1 : 0][mk][vk][sr ? 2 : (rem ? 1 : 0)]
                .push_back(e);
      continue;
    }
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
  for (int gi = 0; gi < 3; ++gi) {
    for (int mi = 0; mi < 3; ++mi) {
      for (int si = 0; si < 2; ++si) {
        for (int mk = 0; mk < kMomentKinds; ++mk) {
          for (int vk = 0; vk < kMomentKinds; ++vk) {
            for (int ri = 0; ri < 3; ++ri) {
              const auto& entries = narrow[gi][mi][si][mk][vk][ri];
              if (entries.empty()) continue;
              const size_t first = static_cast<size_t>(entries[0].index);
              dispatch_grad_model(
                  grads[first].scalar_type(), has_model,
                  has_model ? model_params[first].scalar_type() : at::kFloat,
                  [&](auto g_tag, auto m_tag) {
                    using G = decltype(g_tag);
                    using M = decltype(m_tag);
                    multi_tensor_apply<kNarrowDepth>(
                        entries,
                        NarrowAdamFunctor<G, M>{h, ptr_or_null(grad_scale, a.has_grad_scale),
                                                ptr_or_null(found_inf, a.has_found_inf),
                                                ptr_or_null(lr_tensor, a.has_lr_tensor), maximize,
                                                si == 1, ri == 1, ri == 2, mk, vk});
                  });
            }
          }
        }
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
