// Frontend of the extension tpamp._C: the schemas of every op (torch.ops.tpamp.*) and the
// registration of the CUDA launchers (csrc/cuda/, built when torch is a CUDA build and nvcc is
// found: TPAMP_WITH_CUDA). The CPU launchers (csrc/cpu/) are registered by the capability module
// tpamp._C_cpu_<capability> that tpamp/_ext.py loads next; the fake (meta) implementations that
// torch.compile uses are registered in Python, in tpamp/_ext.py.
//
// Importing tpamp._C (a plain Python module with no functions) loads this library, whose static
// initializers run the registrations below. tpamp/ops.py is the only caller; the contracts are
// there and in SPEC.md section 4.
//
// Alias annotations say exactly what each op writes: `Tensor(a!)[]` is mutated, every other
// tensor argument is only read, and no output aliases an input.

#include <Python.h>

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
  m.def(
      "fused_adam_step_(Tensor(a!)[] params, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] steps, Tensor(e!)[] model_params, Tensor[] grads, Tensor? grad_scale, "
      "Tensor? found_inf, Tensor? lr_tensor, float lr, float beta1, float beta2, float eps, "
      "float weight_decay, bool decoupled_weight_decay, bool maximize) -> ()");
  m.def(
      "fused_sgd_step_(Tensor(a!)[] params, Tensor(b!)[] momentum_buffers, "
      "Tensor(c!)[] model_params, Tensor[] grads, bool[] first_step, Tensor? grad_scale, "
      "Tensor? found_inf, Tensor? lr_tensor, float lr, float momentum, float dampening, "
      "float weight_decay, bool nesterov, bool maximize) -> ()");
}

#ifdef TPAMP_WITH_CUDA
TORCH_LIBRARY_IMPL(tpamp, CUDA, m) {
  m.impl("grad_stats_", &tpamp::cuda::grad_stats_);
  m.impl("grad_stats_out", &tpamp::cuda::grad_stats_out);
  m.impl("scale_", &tpamp::cuda::scale_);
  m.impl("scale_and_copy", &tpamp::cuda::scale_and_copy);
  m.impl("dynamic_scaler_update_", &tpamp::cuda::dynamic_scaler_update_);
  m.impl("fused_adam_step_", &tpamp::cuda::fused_adam_step_);
  m.impl("fused_sgd_step_", &tpamp::cuda::fused_sgd_step_);
}
#endif
