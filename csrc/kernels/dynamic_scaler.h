// The math of tpamp::dynamic_scaler_update_: Megatron-LM's DynamicGradScaler.update, shared by
// csrc/cpu/dynamic_scaler.cpp and csrc/cuda/dynamic_scaler.cu (one thread).
//
// It reproduces tpamp/ops.py's PyTorch path bit for bit: the same float32 products
// (scale * float32(factor)), the same clamps (NaN passes through, as torch.clamp does) and the
// same int32 tracker arithmetic (wrapping, as int32 tensors do).

#pragma once

#include "common.h"

namespace tpamp {

struct ScalerState {
  float scale;
  int32_t growth_tracker;
  int32_t hysteresis_tracker;
};

struct ScalerConfig {
  float growth_factor;   // rounded to float32, as torch does for a Python scalar times f32
  float backoff_factor;
  int64_t growth_interval;
  int32_t hysteresis;
  float min_scale;
  float max_scale;       // inf: no maximum
  bool consecutive;      // consecutive hysteresis: a clean step refills the hysteresis
};

TPAMP_INLINE float clamp_min_keep_nan(float v, float lo) { return (v != v) ? v : (v < lo ? lo : v); }
TPAMP_INLINE float clamp_max_keep_nan(float v, float hi) { return (v != v) ? v : (v > hi ? hi : v); }

// One update. found_inf: NaN counts as an overflow, as `found_inf != 0` does.
TPAMP_INLINE ScalerState dynamic_scaler_step(ScalerState st, float found_inf,
                                             const ScalerConfig& c) {
  ScalerState out = st;
  if (found_inf != 0.0f) {
    // Reset growth, spend one unit of hysteresis; back off once it is spent.
    const int32_t hyst_left = static_cast<int32_t>(static_cast<uint32_t>(st.hysteresis_tracker) - 1u);
    out.growth_tracker = 0;
    out.hysteresis_tracker = hyst_left;
    if (hyst_left <= 0) out.scale = clamp_min_keep_nan(st.scale * c.backoff_factor, c.min_scale);
  } else {
    const int32_t grown = static_cast<int32_t>(static_cast<uint32_t>(st.growth_tracker) + 1u);
    if (static_cast<int64_t>(grown) == c.growth_interval) {
      out.growth_tracker = 0;
      out.hysteresis_tracker = c.hysteresis;
      out.scale = clamp_max_keep_nan(st.scale * c.growth_factor, c.max_scale);
    } else {
      out.growth_tracker = grown;
      if (c.consecutive) out.hysteresis_tracker = c.hysteresis;
    }
  }
  return out;
}

}  // namespace tpamp
