// The module tpamp._C_simt (test infrastructure, built with TPAMP_BUILD_SIMT=1): the CUDA
// launchers of csrc/cuda/*.cu, compiled by g++ under the SIMT emulator (simt.h), registered as the
// CPU kernels of torch.ops.tpamp_simt.<op> for every op of torch.ops.tpamp (TPAMP_FOR_EACH_OP).
// The schemas are copied from torch.ops.tpamp by tpamp/_ext.py (load_simt), so they are the same
// text; importing this module registers the kernels.

#include <Python.h>

#include <torch/library.h>

#include "../ops.h"

#ifndef TPAMP_SIMT_MODULE
#error "TPAMP_SIMT_MODULE (the module name, e.g. _C_simt) is set by setup.py"
#endif
#define TPAMP_SIMT_CAT_(a, b) a##b
#define TPAMP_SIMT_CAT(a, b) TPAMP_SIMT_CAT_(a, b)
#define TPAMP_SIMT_STR_(a) #a
#define TPAMP_SIMT_STR(a) TPAMP_SIMT_STR_(a)

#if defined(__SANITIZE_THREAD__)
#define TPAMP_SIMT_SANITIZER "thread"
#elif defined(__SANITIZE_ADDRESS__)
#define TPAMP_SIMT_SANITIZER "address"
#else
#define TPAMP_SIMT_SANITIZER ""
#endif

extern "C" PyMODINIT_FUNC TPAMP_SIMT_CAT(PyInit_, TPAMP_SIMT_MODULE)(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT,
      TPAMP_SIMT_STR(TPAMP_SIMT_MODULE),
      "tpamp's CUDA launchers under the SIMT emulator, registered as torch.ops.tpamp_simt.* for "
      "CPU tensors (tests only)",
      -1,
      nullptr,
  };
  PyObject* m = PyModule_Create(&module_def);
  if (m != nullptr) PyModule_AddStringConstant(m, "sanitizer", TPAMP_SIMT_SANITIZER);
  return m;
}

#define TPAMP_SIMT_IMPL(op) m.impl(#op, &tpamp::cuda::op);
TORCH_LIBRARY_IMPL(tpamp_simt, CPU, m) { TPAMP_FOR_EACH_OP(TPAMP_SIMT_IMPL) }
