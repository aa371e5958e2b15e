// Frontend of the extension tpamp._C: registers the fused CUDA ops as torch.ops.tpamp.*.
// Importing tpamp._C (a plain Python module with no functions) loads this library, whose static
// initializers run the registrations below. tpamp/ops.py is the only caller; the contracts are
// there and in SPEC.md section 4.

#include <Python.h>

#include <torch/library.h>

#include "ops.h"

extern "C" {
// A module with no methods: the ops live in the torch.ops.tpamp namespace, not on the module.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT,
      "_C",
      "Fused multi-tensor CUDA kernels of tpamp, registered as torch.ops.tpamp.*",
      -1,
      nullptr,
  };
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(tpamp, m) {
  // One pass over grads: optional multiply by scale (1-element float32), in place (out = [])
  // or into float32 out, with found_inf over every tensor and, over the tensors whose mask
  // entry is true, the sum of squares, max |g| and zero count of the values written; per_tensor
  // adds each tensor's L2 norm (mask ignored). Returns (found_inf f32[1], sumsq f32[],
  // amax f32[], zeros i64[], per_tensor_norms f32[n], or f32[0] when not asked for).
  m.def(
      "grad_stats(Tensor(a!)[] grads, Tensor(b!)[] out, Tensor? scale, bool[] mask, "
      "bool count_zeros, bool per_tensor) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // dsts[i] = cast(srcs[i] * scale) (scale None: cast-copy); srcs may be dsts (in place).
  m.def("scale_and_copy(Tensor[] srcs, Tensor(a!)[] dsts, Tensor? scale) -> ()");
  // Megatron's DynamicGradScaler.update on the device; max_scale = inf means no maximum.
  m.def(
      "dynamic_scaler_update_(Tensor(a!) scale, Tensor(b!) growth_tracker, "
      "Tensor(c!) hysteresis_tracker, Tensor found_inf, float growth_factor, "
      "float backoff_factor, int growth_interval, int hysteresis, float min_scale, "
      "float max_scale, bool consecutive) -> ()");
}

TORCH_LIBRARY_IMPL(tpamp, CUDA, m) {
  m.impl("grad_stats", &tpamp::grad_stats_cuda);
  m.impl("scale_and_copy", &tpamp::scale_and_copy_cuda);
  m.impl("dynamic_scaler_update_", &tpamp::dynamic_scaler_update_cuda);
}
