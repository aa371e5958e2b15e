// Frontend of the extension tpamp._C: the schemas of every op (torch.ops.tpamp.*) and the
// registration of the CUDA launchers (csrc/cuda/, built when torch is a CUDA build and nvcc is
// found: TPAMP_WITH_CUDA). The CPU launchers (csrc/cpu/) are registered by the capability module
// tpamp._C_cpu_<capability> that tpamp/_ext.py loads next; the fake (meta) implementations that
// torch.compile uses are registered in Python, in tpamp/_ext.py.
//
// Importing tpamp._C (a plain Python module with no functions) loads this library, whose static
// initializers run the registrations below. tpamp/ops.py is the only caller; the contracts are
// there and in docs/spec.md section 4.
//
// Alias annotations say exactly what each op writes: `Tensor(a!)[]` is mutated, every other
// tensor argument is only read, and no output aliases an input.

#include <Python.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/library.h>

#include "ops.h"

extern "C" PyMODINIT_FUNC PyInit__C(void) {
  // A module with no methods: the ops live in the torch.ops.tpamp namespace, not on the module.
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT,
      "_C",
      "Fused multi-tensor kernels of tpamp: op schemas and CUDA kernels, registered as "
      "torch.ops.tpamp.*",
      -1,
      nullptr,
  };
  PyObject* m = PyModule_Create(&module_def);
#ifdef TPAMP_WITH_CUDA
  if (m != nullptr) PyModule_AddIntConstant(m, "with_cuda", 1);
#else
  if (m != nullptr) PyModule_AddIntConstant(m, "with_cuda", 0);
#endif
  return m;
}

TORCH_LIBRARY(tpamp, m) {
  // One pass over grads: optional multiply by scale (1-element float32), with found_inf over every
  // tensor and, over the tensors whose mask entry is true, the sum of squares, max |g| and zero
  // count of the values written; per_tensor adds each tensor's L2 norm (mask ignored). Returns
  // (found_inf f32[1], sumsq f64[], amax f32[], zeros i64[], per_tensor_norms f32[n], or f32[0]
  // when not asked for). grad_stats_ writes the result into grads (in place); grad_stats_out
  // writes float32(grads[i]) * scale into out[i], which must not overlap any grads[j].
  m.def(
      "grad_stats_(Tensor(a!)[] grads, Tensor? scale, bool[] mask, bool count_zeros, "
      "bool per_tensor) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "grad_stats_out(Tensor[] grads, Tensor? scale, bool[] mask, bool count_zeros, "
      "bool per_tensor, *, Tensor(a!)[] out) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // tensors[i] *= scale in place (the clip); a scale of exactly 1 touches no memory.
  m.def("scale_(Tensor(a!)[] tensors, Tensor scale) -> ()");
  // dsts[i] = cast(srcs[i] * scale) (scale None: cast-copy); dsts disjoint from srcs.
  m.def("scale_and_copy(Tensor[] srcs, Tensor(a!)[] dsts, Tensor? scale) -> ()");
  // Megatron's DynamicGradScaler.update on the tensors' device; max_scale = inf means no maximum.
  m.def(
      "dynamic_scaler_update_(Tensor(a!) scale, Tensor(b!) growth_tracker, "
      "Tensor(c!) hysteresis_tracker, Tensor found_inf, float growth_factor, "
      "float backoff_factor, int growth_interval, int hysteresis, float min_scale, "
      "float max_scale, bool consecutive) -> ()");
  // The one-pass optimizer step (csrc/kernels/optimizer_step.h): per param, read grads[i]
  // (fp16/bf16/fp32) times grad_scale, update the fp32 params[i] and torch.optim's state, write
  // model_params[i] (fp16/bf16; none: empty list); a nonzero found_inf changes nothing. lr_tensor,
  // when given, replaces lr (read on the device). steps are torch.optim's step counts.
  // Narrow state (kernels/optimizer_step.h): params[i] may be int16 remainders of a bf16
  // model_params[i]; exp_avgs/exp_avg_sqs may be bf16 or float8_e4m3fn, the latter with their
  // per-block float32 scales in exp_avg_scales/exp_avg_sq_scales (else those lists are empty).
  // params[i] may be a bf16 param stepped in place with stochastic rounding (no master): then
  // stochastic_rounding is an int64 [len(params), 2] tensor of (key, first element index) per
  // param and model_params is empty (docs/spec.md section 21).
  m.def(
      "fused_adam_step_(Tensor(a!)[] params, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] steps, Tensor(e!)[] model_params, Tensor[] grads, Tensor? grad_scale, "
      "Tensor? found_inf, Tensor? lr_tensor, float lr, float beta1, float beta2, float eps, "
      "float weight_decay, bool decoupled_weight_decay, bool maximize, "
      "Tensor(f!)[] exp_avg_scales, Tensor(g!)[] exp_avg_sq_scales, "
      "Tensor? stochastic_rounding=None) -> ()");
  m.def(
      "fused_sgd_step_(Tensor(a!)[] params, Tensor(b!)[] momentum_buffers, "
      "Tensor(c!)[] model_params, Tensor[] grads, bool[] first_step, Tensor? grad_scale, "
      "Tensor? found_inf, Tensor? lr_tensor, float lr, float momentum, float dampening, "
      "float weight_decay, bool nesterov, bool maximize) -> ()");
  // The exact, order-invariant sum of squares (csrc/kernels/exact_sumsq.h): float64 [26], the
  // normalized base-2^24 digits of sum over every element of r^2, r = float32(float(x) * scale)
  // (scale: 1-element float32, None = 1), inf/NaN r skipped; identical for any split of the
  // same values into tensors. exact_sumsq_to_double: digits (float64 [26], integers in
  // [0, 2^53), not necessarily normalized) -> 0-dim float64, the correctly rounded
  // sum_i digits[i] * 2^(24 i - 298).
  m.def("grad_sumsq_exact(Tensor[] tensors, Tensor? scale) -> Tensor");
  m.def("exact_sumsq_to_double(Tensor digits) -> Tensor");
}

namespace {

// Calls `fn` with each tensor argument of the op on the stack (a Tensor, or each entry of a
// Tensor[]), with whether the schema marks it mutated (Tensor(a!) / Tensor(a!)[]).
template <typename Fn>
void for_each_tensor_arg(const c10::OperatorHandle& op, const torch::jit::Stack* stack, Fn fn) {
  const auto& args = op.schema().arguments();
  const auto inputs = torch::jit::last(*stack, args.size());
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::AliasInfo* alias = args[i].alias_info();
    const bool written = alias != nullptr && alias->isWrite();
    const c10::IValue& v = inputs[i];
    if (v.isTensor()) {
      fn(v.toTensor(), written);
    } else if (v.isTensorList()) {
      // the list's IValues as they are (iterating a c10::List<at::Tensor> copies each tensor)
      for (const c10::IValue& e : v.toListRef()) fn(e.toTensor(), written);
    }
  }
}

// The tensor arguments of one call, held until the op returns and then released together.
// Python runs the ops with its GIL released, and a C++ reference that is the last one besides
// the tensor's Python object hands that object back to Python when it goes (c10's
// intrusive_ptr: decref_pyobject), taking the GIL for each tensor: ~0.2 us a tensor, ~40 us of
// a step over 1000 tensors. The dispatcher's own copies (the stack, the unboxed vectors) are
// never the last ones while these are held, so only this release hands objects back: under one
// hold of the GIL (when Python runs and this thread does not hold it already).
class HeldArguments {
 public:
  HeldArguments(const c10::OperatorHandle& op, const torch::jit::Stack* stack) {
    for_each_tensor_arg(op, stack, [this](const at::Tensor& t, bool) {
      if (t.defined()) tensors_.push_back(t);
    });
  }
  ~HeldArguments() {
    if (tensors_.empty() || !Py_IsInitialized() || PyGILState_Check()) return;
    const PyGILState_STATE gil = PyGILState_Ensure();
    tensors_.clear();
    PyGILState_Release(gil);
  }
  HeldArguments(const HeldArguments&) = delete;
  HeldArguments& operator=(const HeldArguments&) = delete;

 private:
  std::vector<at::Tensor> tensors_;
};

// Autograd: these ops have no derivative (their results are statistics that need none), so a
// tensor they mutate must not require grad while grad mode is on: that would silently drop the
// change from the graph (under torch.no_grad(), as in an optimizer step, it is allowed).
// Then pass below autograd, as torch's generated autograd kernels do, to ADInplaceOrView and the
// device kernel, holding the tensor arguments until the op returns (HeldArguments).
void below_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                    torch::jit::Stack* stack) {
  if (at::GradMode::is_enabled()) {
    for_each_tensor_arg(op, stack, [&op](const at::Tensor& t, bool written) {
      TORCH_CHECK(!(written && t.defined() && t.requires_grad()), op.schema().name(),
                  " writes a tensor that requires grad; it has no derivative (call it on .grad "
                  "tensors or under torch.no_grad() on detached ones)");
    });
  }
  HeldArguments held(op, stack);
  at::AutoDispatchBelowAutograd guard;
  op.redispatchBoxed(ks & c10::after_autograd_keyset, stack);
}

// ADInplaceOrView: run the op, then bump the version counter of every tensor it mutates, as
// torch's own in-place ops do, so autograd and other version checks see the in-place change.
// The counters (shared with the tensor's views) are taken before the op pops its arguments
// (an undefined tensor has none; the op itself rejects it).
void bump_mutated_versions(const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                           torch::jit::Stack* stack) {
  std::vector<c10::VariableVersion> mutated;
  for_each_tensor_arg(op, stack, [&mutated](const at::Tensor& t, bool written) {
    if (written && t.defined()) mutated.push_back(t.unsafeGetTensorImpl()->version_counter());
  });
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(ks & c10::after_ADInplaceOrView_keyset, stack);
  }
  for (c10::VariableVersion& v : mutated) v.bump();
}

}  // namespace

// Every op (TPAMP_FOR_EACH_OP, ops.h) for the device-independent keys.
#define TPAMP_IMPL_BOXED(op, fn) m.impl(#op, torch::CppFunction::makeFromBoxedFunction<&fn>());
#define TPAMP_IMPL_AUTOGRAD(op) TPAMP_IMPL_BOXED(op, below_autograd)
#define TPAMP_IMPL_INPLACE_OR_VIEW(op) TPAMP_IMPL_BOXED(op, bump_mutated_versions)
TORCH_LIBRARY_IMPL(tpamp, Autograd, m) { TPAMP_FOR_EACH_OP(TPAMP_IMPL_AUTOGRAD) }
TORCH_LIBRARY_IMPL(tpamp, ADInplaceOrView, m) { TPAMP_FOR_EACH_OP(TPAMP_IMPL_INPLACE_OR_VIEW) }

#ifdef TPAMP_WITH_CUDA
TORCH_LIBRARY_IMPL(tpamp, CUDA, m) {
  m.impl("grad_stats_", &tpamp::cuda::grad_stats_);
  m.impl("grad_stats_out", &tpamp::cuda::grad_stats_out);
  m.impl("scale_", &tpamp::cuda::scale_);
  m.impl("scale_and_copy", &tpamp::cuda::scale_and_copy);
  m.impl("dynamic_scaler_update_", &tpamp::cuda::dynamic_scaler_update_);
  m.impl("fused_adam_step_", &tpamp::cuda::fused_adam_step_);
  m.impl("fused_sgd_step_", &tpamp::cuda::fused_sgd_step_);
  m.impl("grad_sumsq_exact", &tpamp::cuda::grad_sumsq_exact);
  m.impl("exact_sumsq_to_double", &tpamp::cuda::exact_sumsq_to_double);
}
#endif
