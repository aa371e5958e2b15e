// Stand-in for the CUDA runtime header under the SIMT emulator (csrc/simt/): the types and
// built-ins of csrc/simt/simt.h, and a stream type. This directory is first on the include path
// of tpamp._C_simt only; nvcc builds never see it.
#pragma once

#include "../simt.h"

typedef struct CUstream_st* cudaStream_t;
