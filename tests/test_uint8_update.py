"""The update arithmetic of the uint8 moment format (docs/spec.md section 9): a tensor with a
uint8 moment is stepped with torchao's AdamW8bit / Adam8bit arithmetic (float32 throughout,
every product rounded, float32 bias corrections from powf), so that it gets torchao's bits.

Checked against an independent numpy float32 re-implementation of that arithmetic (with the
numpy format reference of test_dynamic_map.py), in the PyTorch reference step, the CPU kernel
and the emulated CUDA launcher in every schedule order, bit for bit; and against torchao's
compiled AdamW8bit step from the same state when torchao imports (skipped otherwise).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import simt_utils
import torch
from simt_utils import order  # noqa: F401  (fixture: every test runs in each schedule order)
from test_dynamic_map import numpy_encode

from tpamp import ops
from tpamp import state_formats as sf

U8 = torch.uint8
SIMT = simt_utils.load()
needs_cpu_kernel = pytest.mark.skipif(not ops.extension_available("cpu"),
                                      reason="CPU kernels not built")
needs_simt = pytest.mark.skipif(SIMT is None, reason=simt_utils.skip_reason())
F = np.float32


def numpy_step(p, g, mc, ms, vc, vs, step, lr, beta1, beta2, eps, wd, decoupled, grad_scale):
    """One step of a tensor with uint8 moments, written again from torchao's single_param_adam
    (torchao/optim/adam.py) in numpy float32 (IEEE operations one by one, no fma): returns
    (p, m codes, m scales, v codes, v scales). Bias corrections: 1 - float32(float32(beta)^step)
    correctly rounded (equal to glibc's powf for the step counts used here)."""
    # the float32 map as torchao builds it (its entries equal numpy_map's to float32 rounding:
    # test_dynamic_map.py checks both)
    qs, qu = sf.dynamic_map(True).numpy(), sf.dynamic_map(False).numpy()
    # tpamp's one departure from torchao: exp_avg_sq's code 0 reads back as code 1's entry, not
    # 0 (docs/spec.md section 9); the encode is torchao's
    qu_read = qu.copy()
    qu_read[0] = qu[1]
    n = p.size

    def decode(c, s, q):
        nb = s.size
        vals = np.zeros(nb * 256, dtype=F)
        vals[:n] = q[c.astype(np.int64)]
        return (vals.reshape(nb, 256) * s[:, None].astype(F)).reshape(-1)[:n].astype(F)

    m, v = decode(mc, ms, qs), decode(vc, vs, qu_read)
    g = (g.astype(F) * F(grad_scale)).astype(F)
    if decoupled:
        p = (p - (F(lr) * F(wd)) * p).astype(F)
    else:
        g = (g + F(wd) * p).astype(F)

    def lerp(a, b, w):  # torch._refs.lerp: coeff * (b - a) + base, rounded twice
        w = F(w)
        return ((b - a) * w + a).astype(F) if abs(w) < 0.5 else ((b - a) * (w - F(1)) + b).astype(F)

    m = lerp(m, g, 1.0 - beta1)
    v = lerp(v, (g * g).astype(F), 1.0 - beta2)
    bc1 = F(1) - F(float(F(beta1)) ** step)
    bc2 = F(1) - F(float(F(beta2)) ** step)
    denom = (np.sqrt(v) / np.sqrt(bc2) + F(eps)).astype(F)
    p = (p - (F(lr) * (m / bc1)) / denom).astype(F)
    mc, ms = numpy_encode(m, True, qs)
    vc, vs = numpy_encode(v, False, qu)
    return p, mc, ms, vc, vs


def _case(seed, n=65536 + 300):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g) * 0.02
    m, ms = sf.encode_moment(torch.randn(n, generator=g) * 1e-3, U8)
    # exp_avg_sq over many magnitudes within a block (small values near code 0 included)
    v = torch.rand(n, generator=g) ** 4 * 1e-6
    v, vs = sf.encode_moment(v, U8, sqrt=True)
    grad = (torch.randn(n, generator=g) * 1e-3).to(torch.bfloat16)
    return p, m, ms, v, vs, grad


HYPERS = {
    "adamw": (1e-3, 0.9, 0.999, 1e-8, 0.01, True),
    "adam_l2": (3e-3, 0.9, 0.95, 1e-8, 0.1, False),
    "lerp_large_weight": (1e-3, 0.3, 0.2, 1e-6, 0.05, True),  # 1 - beta >= 0.5: the other lerp
}


def _run(call, case, step, hyper, grad_scale=0.5):
    p, m, ms, v, vs, grad = [t.clone() for t in case]
    lr, b1, b2, eps, wd, decoupled = hyper
    call([p], [m], [v], [torch.tensor([float(step - 1)])], [], [grad],
         torch.tensor([grad_scale]), None, None, lr, b1, b2, eps, wd, decoupled, False, [ms], [vs])
    return p, m, ms, v, vs


def _fallback(params, exp_avgs, exp_avg_sqs, steps, models, grads, scale, found_inf, lr_t, lr,
              b1, b2, eps, wd, decoupled, maximize, mss, vss):
    with ops.force_fallback():
        ops.fused_adam_step_(params, grads, exp_avgs, exp_avg_sqs, steps, grad_scale=scale,
                             lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd,
                             decoupled_weight_decay=decoupled, maximize=maximize,
                             exp_avg_scales=mss, exp_avg_sq_scales=vss)


def _check(out, case, step, hyper, grad_scale=0.5):
    p, m, ms, v, vs, grad = case
    lr, b1, b2, eps, wd, decoupled = hyper
    ref = numpy_step(p.numpy(), grad.float().numpy(), m.numpy(), ms.numpy(), v.numpy(),
                     vs.numpy(), step, lr, b1, b2, eps, wd, decoupled, grad_scale)
    names = ("params", "exp_avg codes", "exp_avg scales", "exp_avg_sq codes", "exp_avg_sq scales")
    for name, got, want in zip(names, out, ref):
        np.testing.assert_array_equal(got.numpy(), want, err_msg=name)


@pytest.mark.parametrize("hyper", list(HYPERS), ids=list(HYPERS))
@pytest.mark.parametrize("step", [1, 7, 120])
def test_reference_step_matches_numpy(hyper, step):
    case = _case(step)
    _check(_run(_fallback, case, step, HYPERS[hyper]), case, step, HYPERS[hyper])




@needs_cpu_kernel
@pytest.mark.parametrize("hyper", list(HYPERS), ids=list(HYPERS))
@pytest.mark.parametrize("step", [1, 7, 120])
def test_cpu_kernel_step_matches_numpy(hyper, step):
    case = _case(step)
    _check(_run(torch.ops.tpamp.fused_adam_step_, case, step, HYPERS[hyper]), case, step,
           HYPERS[hyper])


@needs_simt
@pytest.mark.parametrize("hyper", list(HYPERS), ids=list(HYPERS))
def test_simt_launcher_step_matches_numpy(order, hyper):
    case = _case(11)
    _check(_run(SIMT.fused_adam_step_, case, 7, HYPERS[hyper]), case, 7, HYPERS[hyper])


@needs_cpu_kernel
def test_remainders_step_equals_master_step():
    """bf16 params + int16 remainders: the master rebuilt, the same bits as the fp32 master."""
    p, m, ms, v, vs, grad = _case(5)
    hi, lo = sf.split_remainders(p)
    master = sf.join_remainders(hi, lo)
    args = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                decoupled_weight_decay=True)
    a = [master.clone(), m.clone(), v.clone(), ms.clone(), vs.clone()]
    b = [lo.clone(), m.clone(), v.clone(), ms.clone(), vs.clone(), hi.clone()]
    ops.fused_adam_step_([a[0]], [grad], [a[1]], [a[2]], [torch.tensor([4.0])],
                         exp_avg_scales=[a[3]], exp_avg_sq_scales=[a[4]], **args)
    ops.fused_adam_step_([b[0]], [grad], [b[1]], [b[2]], [torch.tensor([4.0])],
                         model_params=[b[5]], exp_avg_scales=[b[3]], exp_avg_sq_scales=[b[4]],
                         **args)
    assert torch.equal(sf.join_remainders(b[5], b[0]), a[0])
    for x, y in zip(a[1:], b[1:5]):
        assert torch.equal(x, y)


def test_torch_optim_arithmetic_kept_for_other_formats():
    """bf16 moments keep torch.optim's arithmetic (float64 bias corrections, fma lerp)."""
    g = torch.Generator().manual_seed(2)
    p = torch.randn(4096, generator=g)
    grad = torch.randn(4096, generator=g) * 1e-2
    ref = torch.nn.Parameter(p.clone())
    opt = torch.optim.AdamW([ref], lr=1e-3, weight_decay=0.01, foreach=False)
    mine, m, v = p.clone(), torch.zeros(4096), torch.zeros(4096)
    step = torch.zeros(())
    for _ in range(3):
        ref.grad = grad.clone()
        opt.step()
        with ops.force_fallback():
            ops.fused_adam_step_([mine], [grad], [m], [v], [step], lr=1e-3, beta1=0.9,
                                 beta2=0.999, eps=1e-8, weight_decay=0.01,
                                 decoupled_weight_decay=True)
    assert torch.equal(mine, ref.detach())


def test_torchao_compiled_step_bit_for_bit():
    """From the same codes, scales, param and grad, for 6 steps: tpamp's uint8 step (kernel when
    built, else the reference) gives torchao AdamW8bit's bits (torch.compile'd on CPU). The
    grads are bounded away from 0 (|g| >= 0.005), so no exp_avg_sq code is 0 (which tpamp
    reads as the smallest positive entry, torchao as 0: docs/spec.md section 9)."""
    tao = pytest.importorskip("torchao.optim")
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        # torchao builds its map with torch ops too, whose float32 rounding depends on the
        # capability; tpamp's map is the AVX-512 construction (state_formats.dynamic_map)
        pytest.skip("torchao's compiled step is compared at the AVX512 capability")
    n = 256 * 40
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(n, generator=gen) * 0.02)
    opt = tao.AdamW8bit([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    mine = p.detach().clone()
    m, v = torch.zeros(n, dtype=U8), torch.zeros(n, dtype=U8)
    ms, vs = torch.zeros(n // 256), torch.zeros(n // 256)
    step = torch.zeros(())
    for _ in range(6):
        z = torch.randn(n, generator=gen)
        grad = ((z.abs() + 0.5) * z.sign() * 0.01).bfloat16().float()
        p.grad = grad.clone()
        opt.step()
        ops.fused_adam_step_([mine], [grad], [m], [v], [step], lr=1e-3, beta1=0.9, beta2=0.999,
                             eps=1e-8, weight_decay=0.01, decoupled_weight_decay=True,
                             exp_avg_scales=[ms], exp_avg_sq_scales=[vs])
        st = opt.state[p]
        assert torch.equal(mine, p.detach())
        assert torch.equal(m, st["exp_avg"].codes) and torch.equal(ms, st["exp_avg"].scale)
        assert torch.equal(v, st["exp_avg_sq"].codes) and torch.equal(vs, st["exp_avg_sq"].scale)


def test_bias_corrections_are_float32():
    """The premise of the numpy reference: its bias corrections equal powf's for these steps."""
    for beta in (0.9, 0.999, 0.95, 0.3, 0.2):
        for step in (1, 7, 120):
            got = 1.0 - torch.pow(torch.tensor(beta), torch.tensor(float(step)))
            assert float(got) == float(F(1) - F(float(F(beta)) ** step))
            assert not math.isnan(float(got))
