// The CPU kernels' registration as torch.ops.tpamp.* (the schemas are in csrc/tpamp_ops.cpp),
// and the module init of this capability's extension.
//
// setup.py compiles csrc/cpu/*.cpp once per CPU capability into tpamp._C_cpu_<capability>
// (TPAMP_CPU_MODULE); tpamp/_ext.py imports exactly one of them, after tpamp._C, so these
// registrations run once.

#include <Python.h>

#include <torch/library.h>

#include "../ops.h"

#ifndef TPAMP_CPU_MODULE
#error "TPAMP_CPU_MODULE (the module name, e.g. _C_cpu_avx2) is set by setup.py"
#endif
#define TPAMP_CAT_(a, b) a##b
#define TPAMP_CAT(a, b) TPAMP_CAT_(a, b)
#define TPAMP_STR_(a) #a
#define TPAMP_STR(a) TPAMP_STR_(a)

extern "C" PyMODINIT_FUNC TPAMP_CAT(PyInit_, TPAMP_CPU_MODULE)(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT,
      TPAMP_STR(TPAMP_CPU_MODULE),
      "CPU kernels of tpamp (capability " TPAMP_STR(CPU_CAPABILITY) "), registered as "
      "torch.ops.tpamp.* for CPU tensors",
      -1,
      nullptr,
  };
  PyObject* m = PyModule_Create(&module_def);
  if (m != nullptr) PyModule_AddStringConstant(m, "cpu_capability", TPAMP_STR(CPU_CAPABILITY));
  return m;
}

TORCH_LIBRARY_IMPL(tpamp, CPU, m) {
  m.impl("grad_stats_", &tpamp::cpu::grad_stats_);
  m.impl("grad_stats_out", &tpamp::cpu::grad_stats_out);
  m.impl("scale_", &tpamp::cpu::scale_);
  m.impl("scale_and_copy", &tpamp::cpu::scale_and_copy);
  m.impl("dynamic_scaler_update_", &tpamp::cpu::dynamic_scaler_update_);
  m.impl("fused_adam_step_", &tpamp::cpu::fused_adam_step_);
  m.impl("fused_sgd_step_", &tpamp::cpu::fused_sgd_step_);
  m.impl("grad_sumsq_exact", &tpamp::cpu::grad_sumsq_exact);
  m.impl("exact_sumsq_to_double", &tpamp::cpu::exact_sumsq_to_double);
}
