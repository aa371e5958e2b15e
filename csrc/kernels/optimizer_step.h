// Per-element math of the one-pass optimizer step (Adam/AdamW, SGD), shared by the CPU launcher
// (V = at::vec::Vectorized<float>) and the CUDA launcher (V = float). Host and device code.
//
// The formulas follow torch.optim's own (torch/optim/adam.py, sgd.py, and ATen's
// FusedAdamKernel.cpp): the same operations in the same order, in float32, with the
// step-dependent scalars (bias corrections, step size) computed in float64 from the step count
// and rounded to float32 once, as torch does. Results therefore equal torch.optim's on the fp32
// main params to float32 rounding.
//
// V is a lane type of csrc/kernels/common.h (float on CUDA, at::vec::Vectorized<float> on CPU);
// the math uses Lanes<V>::fmadd and Lanes<V>::sqrt.

#pragma once

#include "common.h"

namespace tpamp {

// Hyperparameters of one Adam/AdamW param group (float64, as torch.optim holds them).
struct AdamHyper {
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  bool decoupled;  // AdamW (p *= 1 - lr * wd) instead of Adam's L2 (g += wd * p)
};

// The float32 scalars of one Adam step of one tensor.
struct AdamScalars {
  float grad_scale;     // multiplies the grad: 1/loss scale x clip coefficient, negated for maximize
  float l2_decay;       // Adam: g += p * l2_decay (used when has_l2)
  float param_decay;    // AdamW: p *= param_decay (used when has_param_decay)
  float lerp_coeff;     // exp_avg.lerp_(g, 1 - beta1) as fma(coeff, g - m, base) (ATen's lerp)
  float beta2;
  float one_minus_beta2;
  float bias_correction2_sqrt;
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^step)
  bool lerp_small;      // |1 - beta1| < 0.5: base = m, coeff = w; else base = g, coeff = w - 1
  bool has_l2;
  bool has_param_decay;
};

// step: the step count after this step's increment (torch.optim increments, then uses it).
// grad_scale: float32 multiplier of the grad (1 when none); maximize negates it (exact).
TPAMP_INLINE AdamScalars adam_scalars(const AdamHyper& h, double step, float grad_scale,
                                      bool maximize) {
  AdamScalars s;
  s.grad_scale = maximize ? -grad_scale : grad_scale;
  const bool decay = h.weight_decay != 0.0;
  s.has_l2 = decay && !h.decoupled;
  s.has_param_decay = decay && h.decoupled;
  s.l2_decay = static_cast<float>(h.weight_decay);
  s.param_decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  const float w = static_cast<float>(1.0 - h.beta1);
  s.lerp_small = (w < 0.0f ? -w : w) < 0.5f;
  s.lerp_coeff = s.lerp_small ? w : w - 1.0f;
  s.beta2 = static_cast<float>(h.beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  // float64 here, as torch.optim (Python floats) and ATen's fused kernels
  const double bias_correction1 = 1.0 - ::pow(h.beta1, step);
  const double bias_correction2 = 1.0 - ::pow(h.beta2, step);
  s.bias_correction2_sqrt = static_cast<float>(::sqrt(bias_correction2));
  s.neg_step_size = static_cast<float>(-(h.lr / bias_correction1));
  s.eps = static_cast<float>(h.eps);
  return s;
}

// One Adam/AdamW update of p (fp32 main param), m (exp_avg), v (exp_avg_sq) from the grad g
// (already widened to float32, not yet scaled).
template <typename V>
TPAMP_INLINE void adam_element(V& p, V& m, V& v, V g, const AdamScalars& s) {
  g = g * V(s.grad_scale);
  if (s.has_l2) g = g + p * V(s.l2_decay);
  if (s.has_param_decay) p = p * V(s.param_decay);
  m = Lanes<V>::fmadd(V(s.lerp_coeff), g - m, s.lerp_small ? m : g);
  v = v * V(s.beta2) + V(s.one_minus_beta2) * g * g;
  const V denom = Lanes<V>::sqrt(v) / V(s.bias_correction2_sqrt) + V(s.eps);
  p = p + V(s.neg_step_size) * m / denom;
}

// Hyperparameters of one SGD param group.
struct SgdHyper {
  double lr;
  double momentum;
  double dampening;
  double weight_decay;
  bool nesterov;
};

struct SgdScalars {
  float grad_scale;  // as in AdamScalars
  float weight_decay;
  float momentum;
  float one_minus_dampening;
  float neg_lr;
  bool has_weight_decay;
  bool has_momentum;
  bool nesterov;
};

TPAMP_INLINE SgdScalars sgd_scalars(const SgdHyper& h, float grad_scale, bool maximize) {
  SgdScalars s;
  s.grad_scale = maximize ? -grad_scale : grad_scale;
  s.has_weight_decay = h.weight_decay != 0.0;
  s.weight_decay = static_cast<float>(h.weight_decay);
  s.has_momentum = h.momentum != 0.0;
  s.momentum = static_cast<float>(h.momentum);
  s.one_minus_dampening = static_cast<float>(1.0 - h.dampening);
  s.nesterov = h.nesterov;
  s.neg_lr = static_cast<float>(-h.lr);
  return s;
}

// One SGD update of p and its momentum buffer buf (unused without momentum). first: the buffer
// has no value yet (torch.optim's first step: buf = g, no dampening). ATen computes
// `a.add_(b, alpha=x)` as fma(b, x, a); so do we.
template <typename V>
TPAMP_INLINE void sgd_element(V& p, V& buf, V g, bool first, const SgdScalars& s) {
  g = g * V(s.grad_scale);
  if (s.has_weight_decay) g = Lanes<V>::fmadd(p, V(s.weight_decay), g);
  if (s.has_momentum) {
    buf = first ? g : Lanes<V>::fmadd(g, V(s.one_minus_dampening), buf * V(s.momentum));
    g = s.nesterov ? Lanes<V>::fmadd(buf, V(s.momentum), g) : buf;
  }
  p = Lanes<V>::fmadd(g, V(s.neg_lr), p);
}

}  // namespace tpamp
