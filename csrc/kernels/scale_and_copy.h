// The math of tpamp::scale_ (in place) and tpamp::scale_and_copy, shared by
// csrc/cpu/scale_and_copy.cpp and csrc/cuda/scale_and_copy.cu.
//
// dst = cast<dst_t>(float(src) * s): the product is taken in float32 with the exact float32
// scale and rounded once to the destination type. Without a scale, a same-dtype copy is a
// bit-exact copy (NaN payloads included) and a cross-dtype copy is one rounding.
// In place with s == 1 exactly, nothing is read or written (scale_is_identity).

#pragma once

#include "common.h"

namespace tpamp {

// In place, a coefficient of exactly 1 leaves every value as it is (x * 1 == x for every float,
// NaN included, and the cast back is exact): the launchers skip the pass.
TPAMP_INLINE bool scale_is_identity(float s) { return s == 1.0f; }

}  // namespace tpamp
