"""The one-pass optimizer step (docs/spec.md sections 2 and 4): tpamp.ops.fused_adam_step_ /
fused_sgd_step_ and MixedPrecisionOptimizer's fused path.

References, all independent of the code under test: torch.optim's own Adam/AdamW/SGD (the
for-loop implementation) stepping fp32 params with the same unscaled grads; a float64 Adam/SGD
written out here from the algorithm; megatron-core's Float16OptimizerWithFloat16Params (when
megatron-core is installed; run on CPU through scripts/megatron_cpu.py).
Every op test runs twice: on the extension's kernel (when tpamp._C is built) and on the PyTorch
reference path of tpamp.ops.
"""

from __future__ import annotations

import copy
import math
import os
import sys

import pytest
import torch
from dist_utils import fused_step_built as _kernel_built
from dist_utils import run_workers

import tpamp
from tpamp import ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = [(0,), (1,), (33,), (5, 67), (70001,)]  # empty, tails, > one CPU chunk of 32768
LOSS_SCALE = 1024.0




def _randn(shape, gen, std=1.0, dtype=torch.float32):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * std).to(dtype)


def _assert_close_fp32(actual, expected, what):
    """Equal to float32 rounding: a few ulps of each value, or of the tensor's largest value
    where terms cancel (Adam's L2 term against the grad)."""
    for i, (a, e) in enumerate(zip(actual, expected)):
        atol = max(1e-9, 4e-7 * float(e.abs().max())) if e.numel() else 0.0
        torch.testing.assert_close(a, e, rtol=2e-6, atol=atol, msg=lambda m: f"{what}[{i}]: {m}")


# --------------------------------------------------------------------------------------------
# the ops against torch.optim


ADAM_CASES = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.1)),
    "adam_l2": (torch.optim.Adam, dict(lr=1e-3, weight_decay=0.1)),
    "adam_maximize": (torch.optim.Adam, dict(lr=1e-3, maximize=True)),
    "adamw_tensor_lr": (torch.optim.AdamW, dict(lr=torch.tensor(2e-3), weight_decay=0.01)),
    "adamw_large_lerp_weight": (torch.optim.AdamW, dict(lr=1e-3, betas=(0.3, 0.9), eps=1e-3, weight_decay=0.0)),
}


@pytest.mark.parametrize(
    "case, grad_dtype",
    [(c, torch.float16) for c in sorted(ADAM_CASES)]
    + [("adamw", torch.bfloat16), ("adamw", torch.float32)],
)
def test_adam_step_equals_torch_optim_to_fp32_rounding(path, case, grad_dtype):
    cls, kw = ADAM_CASES[case]
    gen = torch.Generator().manual_seed(0)
    mains = [_randn(s, gen, 0.5) for s in SHAPES]
    ref = [m.clone().requires_grad_() for m in mains]
    torch_opt = cls(ref, foreach=False, **kw)
    exp_avgs = [torch.zeros_like(m) for m in mains]
    exp_avg_sqs = [torch.zeros_like(m) for m in mains]
    steps = [torch.tensor(0.0) for _ in mains]
    model_dtype = torch.bfloat16 if grad_dtype == torch.bfloat16 else torch.float16
    models = [m.to(model_dtype) for m in mains]
    beta1, beta2 = kw.get("betas", (0.9, 0.999))
    for k in range(3):
        grads = [_randn(s, gen, LOSS_SCALE, grad_dtype) for s in SHAPES]
        grad_scale = torch.tensor([0.5 / LOSS_SCALE])  # 1/loss scale x a clip coefficient
        ops.fused_adam_step_(
            mains, grads, exp_avgs, exp_avg_sqs, steps, model_params=models,
            grad_scale=grad_scale, found_inf=torch.zeros(1), lr=kw["lr"], beta1=beta1,
            beta2=beta2, eps=kw.get("eps", 1e-8), weight_decay=kw.get("weight_decay", 0.0),
            decoupled_weight_decay=cls is torch.optim.AdamW, maximize=kw.get("maximize", False),
        )
        for r, g in zip(ref, grads):
            r.grad = g.float() * grad_scale
        torch_opt.step()
    _assert_close_fp32(mains, [r.detach() for r in ref], "main param")
    _assert_close_fp32(exp_avgs, [torch_opt.state[r]["exp_avg"] for r in ref], "exp_avg")
    _assert_close_fp32(exp_avg_sqs, [torch_opt.state[r]["exp_avg_sq"] for r in ref], "exp_avg_sq")
    assert [s.item() for s in steps] == [torch_opt.state[r]["step"].item() for r in ref] == [3.0] * 5
    for model, main in zip(models, mains):
        assert torch.equal(model, main.to(model_dtype))  # the model param is cast(main param)


@pytest.mark.parametrize("model_dtype", [torch.float16, torch.bfloat16])
def test_large_adam_step_writes_every_model_param_as_the_cast_main_param(path, model_dtype):
    """A step of >= 4M elements writes the model params past the cache (non-temporal stores, on
    64-byte aligned slices; csrc/cpu/optimizer_step.cpp): every element, aligned or not (a view at
    an odd offset), is still cast(main param), and the mains follow torch.optim.AdamW."""
    gen = torch.Generator().manual_seed(3)
    sizes = [(1 << 22) + 77, 70001, 33]  # > the streaming threshold in all, a chunk tail, a tail
    flat = torch.zeros(sizes[1] + 1, dtype=model_dtype)
    mains = [_randn((n,), gen, 0.5) for n in sizes]
    models = [mains[0].to(model_dtype), flat[1:].copy_(mains[1]), mains[2].to(model_dtype)]
    ref = [m.clone().requires_grad_() for m in mains]
    torch_opt = torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.1, foreach=False)
    exp_avgs = [torch.zeros_like(m) for m in mains]
    exp_avg_sqs = [torch.zeros_like(m) for m in mains]
    steps = [torch.tensor(0.0) for _ in mains]
    for _ in range(2):
        grads = [_randn((n,), gen, LOSS_SCALE, torch.float16) for n in sizes]
        grad_scale = torch.tensor([1.0 / LOSS_SCALE])
        ops.fused_adam_step_(
            mains, grads, exp_avgs, exp_avg_sqs, steps, model_params=models,
            grad_scale=grad_scale, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
            decoupled_weight_decay=True,
        )
        for r, g in zip(ref, grads):
            r.grad = g.float() * grad_scale
        torch_opt.step()
    _assert_close_fp32(mains, [r.detach() for r in ref], "main param")
    for i, (model, main) in enumerate(zip(models, mains)):
        assert torch.equal(model, main.to(model_dtype)), f"model_params[{i}]"
    assert torch.equal(flat[:1], torch.zeros(1, dtype=model_dtype))  # nothing written before


SGD_CASES = {
    "momentum": dict(lr=0.01, momentum=0.9),
    "nesterov_weight_decay": dict(lr=0.01, momentum=0.9, nesterov=True, weight_decay=0.1),
    "dampening_maximize": dict(lr=0.01, momentum=0.9, dampening=0.3, maximize=True),
    "plain_weight_decay": dict(lr=0.01, weight_decay=0.1),
    "momentum_tensor_lr": dict(lr=torch.tensor(0.02), momentum=0.5),
}


@pytest.mark.parametrize("case", sorted(SGD_CASES))
def test_sgd_step_equals_torch_optim_to_fp32_rounding(path, case):
    kw = SGD_CASES[case]
    gen = torch.Generator().manual_seed(1)
    mains = [_randn(s, gen, 0.5) for s in SHAPES]
    ref = [m.clone().requires_grad_() for m in mains]
    torch_opt = torch.optim.SGD(ref, foreach=False, **kw)
    momentum = kw.get("momentum", 0.0)
    bufs = [torch.full_like(m, float("nan")) for m in mains] if momentum else None
    models = [m.half() for m in mains]
    for k in range(3):
        grads = [_randn(s, gen, LOSS_SCALE, torch.float16) for s in SHAPES]
        grad_scale = torch.tensor([1.0 / LOSS_SCALE])
        ops.fused_sgd_step_(
            mains, grads, bufs, first_step=[k == 0] * len(mains), model_params=models,
            grad_scale=grad_scale, lr=kw["lr"], momentum=momentum,
            dampening=kw.get("dampening", 0.0), weight_decay=kw.get("weight_decay", 0.0),
            nesterov=kw.get("nesterov", False), maximize=kw.get("maximize", False),
        )
        for r, g in zip(ref, grads):
            r.grad = g.float() * grad_scale
        torch_opt.step()
    _assert_close_fp32(mains, [r.detach() for r in ref], "main param")
    if momentum:
        _assert_close_fp32(bufs, [torch_opt.state[r]["momentum_buffer"] for r in ref], "buffer")
    for model, main in zip(models, mains):
        assert torch.equal(model, main.half())


def _bits(tensors):
    return [t.detach().clone().view(torch.int16 if t.element_size() == 2 else torch.int32) for t in tensors]


@pytest.mark.parametrize("first", [False, True])
def test_found_inf_changes_no_bit_of_params_state_or_step(path, first):
    gen = torch.Generator().manual_seed(2)
    mains = [_randn(s, gen) for s in SHAPES]
    exp_avgs = [_randn(s, gen).abs() for s in SHAPES]
    exp_avg_sqs = [_randn(s, gen).abs() for s in SHAPES]
    steps = [torch.tensor(0.0 if first else 7.0) for _ in SHAPES]
    bufs = [_randn(s, gen) for s in SHAPES]
    models = [m.half() for m in mains]
    grads = [_randn(s, gen, 10.0, torch.float16) for s in SHAPES]
    grads[3][0, 0] = float("inf")
    everything = mains + exp_avgs + exp_avg_sqs + steps + bufs + models
    before = _bits(everything)
    skip = torch.ones(1)
    common = dict(model_params=models, grad_scale=torch.tensor([0.5]), found_inf=skip, lr=0.1)
    ops.fused_adam_step_(mains, grads, exp_avgs, exp_avg_sqs, steps, beta1=0.9, beta2=0.999,
                         eps=1e-8, weight_decay=0.1, decoupled_weight_decay=True, **common)
    ops.fused_sgd_step_(mains, grads, bufs, first_step=[first] * len(SHAPES), momentum=0.9,
                        dampening=0.0, weight_decay=0.1, nesterov=True, **common)
    for i, (b, a) in enumerate(zip(before, _bits(everything))):
        assert torch.equal(b, a), f"tensor {i} changed although found_inf was set"


def test_ops_reject_mismatched_inputs(path):
    """Both paths name the bad argument (the kernel's own checks raise RuntimeError)."""
    bad = (ValueError, TypeError, RuntimeError)
    p, g = [torch.zeros(3)], [torch.zeros(4, dtype=torch.float16)]
    state = dict(lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0,
                 decoupled_weight_decay=True)
    with pytest.raises(bad, match=r"grads\[0\] has shape"):
        ops.fused_adam_step_(p, g, [torch.zeros(3)], [torch.zeros(3)], [torch.tensor(0.0)], **state)
    with pytest.raises(bad, match=r"params\[0\].*float32"):
        ops.fused_adam_step_([torch.zeros(3, dtype=torch.float16)], [torch.zeros(3)],
                             [torch.zeros(3)], [torch.zeros(3)], [torch.tensor(0.0)], **state)
    with pytest.raises(ValueError, match="steps has 0"):
        ops.fused_adam_step_([torch.zeros(3)], [torch.zeros(3)], [torch.zeros(3)],
                             [torch.zeros(3)], [], **state)
    with pytest.raises(bad, match="grad_scale must be a 1-element float32"):
        ops.fused_sgd_step_([torch.zeros(3)], [torch.zeros(3)], None, lr=0.1, momentum=0.0,
                            dampening=0.0, weight_decay=0.0, nesterov=False,
                            grad_scale=torch.ones(2))
    if path == "kernel":  # the kernels read and write chunks concurrently: no aliasing
        shared = torch.zeros(3)
        with pytest.raises(RuntimeError, match="overlap in memory"):
            ops.fused_adam_step_([shared], [torch.zeros(3)], [shared], [torch.zeros(3)],
                                 [torch.tensor(0.0)], **state)


# --------------------------------------------------------------------------------------------
# MixedPrecisionOptimizer's fused path


def _model(dtype, seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Tanh(), torch.nn.Linear(30, 7))
    return m.to(dtype)


def _groups(params, inner):
    """Two param groups with their own lr and weight decay (matrices / vectors)."""
    mats = [p for p in params if p.dim() >= 2]
    vecs = [p for p in params if p.dim() < 2]
    extra = {"weight_decay": 0.0}
    if inner is torch.optim.SGD:
        extra["momentum"] = 0.8
    return [{"params": mats}, {"params": vecs, "lr": 5e-3, **extra}]


INNER = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))),
    "adam": (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.01)),
    "sgd_nesterov": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1)),
    "sgd_dampening": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.5)),
}


def _grad_sequence(params, steps, inf_at, gen):
    """Per step, the loss-scaled fp16 grads (scale 2**10); step ``inf_at`` has an inf."""
    seq = []
    for k in range(steps):
        grads = [_randn(p.shape, gen, 0.3 * LOSS_SCALE, torch.float16) for p in params]
        if k == inf_at:
            grads[1][0] = float("inf")
        seq.append(grads)
    return seq


def _run_wrapper(name, fused, seq, dtype=torch.float16, clip=0.5):
    cls, kw = INNER[name]
    model = _model(dtype)
    params = list(model.parameters())
    opt = tpamp.MixedPrecisionOptimizer(
        cls(_groups(params, cls), foreach=False, **kw),
        grad_scaler=tpamp.DynamicGradScaler(initial_scale=LOSS_SCALE, growth_interval=3,
                                            hysteresis=1),
        clip_grad=clip, log_num_zeros_in_grad=True, fused_step=fused,
    )
    results = []
    for grads in seq:
        for p, g in zip(params, grads):
            p.grad = g.to(dtype)
        results.append(opt.step())
    return opt, params, results


@pytest.mark.parametrize("name", sorted(INNER))
def test_fused_wrapper_equals_torch_optimizer_on_the_main_params(path, name):
    """Several steps with a skip, clipping and loss-scale changes: the fused path and the inner
    torch optimizer's own step (fused_step=False) agree to fp32 rounding, step counts exactly."""
    gen = torch.Generator().manual_seed(3)
    seq = _grad_sequence(list(_model(torch.float16).parameters()), 6, 2, gen)
    fused, fused_params, fused_res = _run_wrapper(name, True, seq)
    plain, plain_params, plain_res = _run_wrapper(name, False, seq)
    assert [r.update_successful for r in fused_res] == [r.update_successful for r in plain_res]
    assert [r.update_successful for r in fused_res] == [True, True, False, True, True, True]
    for a, b in zip(fused_res, plain_res):
        assert a.num_zeros_in_grad == b.num_zeros_in_grad
        if a.grad_norm is not None:
            assert math.isclose(a.grad_norm, b.grad_norm, rel_tol=1e-6)
    # backed off at the skip (hysteresis 1), grown after 3 clean steps
    assert fused.get_loss_scale().item() == plain.get_loss_scale().item() == LOSS_SCALE
    mains_f = [m for g in fused.param_groups for m in g["params"]]
    mains_p = [m for g in plain.param_groups for m in g["params"]]
    _assert_close_fp32([m.detach() for m in mains_f], [m.detach() for m in mains_p], "main")
    for mf, mp in zip(mains_f, mains_p):
        sf, sp = fused.state[mf], plain.state[mp]
        assert sorted(sf) == sorted(sp)  # torch.optim's own keys
        for key in sf:
            if key == "step":
                assert sf[key].dtype == sp[key].dtype and sf[key].item() == sp[key].item() == 5
            else:
                _assert_close_fp32([sf[key]], [sp[key]], key)
    cls = INNER[name][0]
    for p, m in zip([p for g in _groups(fused_params, cls) for p in g["params"]], mains_f):
        assert torch.equal(p.detach(), m.detach().half())
        assert m.grad is None and p.grad is None  # no fp32 main grads kept, model grads released


def _adamw_fp64(params64, grads, state, lr, wd, betas, eps, t):
    """AdamW (Loshchilov & Hutter; torch.optim.AdamW's documented algorithm) in float64."""
    b1, b2 = betas
    for i, (p, g) in enumerate(zip(params64, grads)):
        m, v = state.setdefault(i, (torch.zeros_like(p), torch.zeros_like(p)))
        p.mul_(1 - lr[i] * wd[i])
        m.mul_(b1).add_(g, alpha=1 - b1)
        v.mul_(b2).add_(g * g, alpha=1 - b2)
        m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
        p.sub_(lr[i] * m_hat / (v_hat.sqrt() + eps))


def test_fused_wrapper_against_fp64_reference_with_skips_and_clipping(path):
    gen = torch.Generator().manual_seed(4)
    params = list(_model(torch.float16).parameters())
    seq = _grad_sequence(params, 6, 3, gen)
    opt, model_params, results = _run_wrapper("adamw", True, seq)
    lr = [1e-2 if p.dim() >= 2 else 5e-3 for p in params]
    wd = [0.1 if p.dim() >= 2 else 0.0 for p in params]
    ref = [p.detach().double() for p in params]
    state, t, scale, growth = {}, 0, LOSS_SCALE, 0
    for k, grads in enumerate(seq):
        g64 = [g.double() / scale for g in grads]
        if not all(torch.isfinite(g).all() for g in g64):
            assert not results[k].update_successful
            scale, growth = max(scale / 2, 1.0), 0  # hysteresis=1: every overflow backs off
            continue
        growth += 1
        if growth == 3:  # growth_interval=3 clean steps double the scale
            scale, growth = scale * 2, 0
        norm = math.sqrt(sum(float((g * g).sum()) for g in g64))
        assert math.isclose(results[k].grad_norm, norm, rel_tol=1e-6)
        assert results[k].num_zeros_in_grad == sum(int((g == 0).sum()) for g in g64)
        coeff = 0.5 / (norm + 1e-6)
        if coeff < 1.0:
            g64 = [g * coeff for g in g64]
        t += 1
        _adamw_fp64(ref, g64, state, lr, wd, (0.9, 0.95), 1e-8, t)
    mains = [m for g in opt.param_groups for m in g["params"]]
    order = [p for g in _groups(params, torch.optim.AdamW) for p in g["params"]]
    for m, p in zip(mains, order):
        r = ref[next(i for i, q in enumerate(params) if q is p)]
        torch.testing.assert_close(m.detach().double(), r, rtol=1e-5, atol=2e-7)


def test_skipped_fused_step_leaves_every_bit_unchanged(path):
    gen = torch.Generator().manual_seed(5)
    params = list(_model(torch.bfloat16).parameters())
    opt = tpamp.MixedPrecisionOptimizer(
        torch.optim.AdamW(params, lr=1e-2), grad_scaler=tpamp.ConstantGradScaler(1.0),
        clip_grad=1.0,
    )
    # a skipped first step creates no state at all
    for p in params:
        p.grad = torch.full_like(p, float("nan"))
    assert not opt.step().update_successful
    assert len(opt.state) == 0
    for p in params:
        p.grad = _randn(p.shape, gen, 1.0, torch.bfloat16)
    assert opt.step().update_successful
    mains = [m for g in opt.param_groups for m in g["params"]]
    snapshot = lambda: _bits(  # noqa: E731
        [*mains, *params] + [v for m in mains for v in opt.state[m].values()]
    )
    before = snapshot()
    for p in params:
        p.grad = _randn(p.shape, gen, 1.0, torch.bfloat16)
    params[0].grad[0, 0] = float("inf")
    assert not opt.step().update_successful
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot()))
    assert all(opt.state[m]["step"].item() == 1 for m in mains)


def test_sync_free_fused_skip_leaves_every_bit_unchanged(path):
    gen = torch.Generator().manual_seed(6)
    params = list(_model(torch.float16).parameters())
    opt = tpamp.MixedPrecisionOptimizer(
        torch.optim.AdamW(params, lr=1e-2, fused=True),
        grad_scaler=tpamp.DynamicGradScaler(initial_scale=LOSS_SCALE), clip_grad=1.0,
        sync_free=True,
    )
    for p in params:
        p.grad = _randn(p.shape, gen, LOSS_SCALE, torch.float16)
    assert bool(opt.step().update_successful)
    mains = [m for g in opt.param_groups for m in g["params"]]
    before = _bits([*mains, *params] + [v for m in mains for v in opt.state[m].values()])
    for p in params:
        p.grad = _randn(p.shape, gen, LOSS_SCALE, torch.float16)
    params[2].grad[0] = float("nan")
    result = opt.step()
    assert not bool(result.update_successful)
    after = _bits([*mains, *params] + [v for m in mains for v in opt.state[m].values()])
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_fused_state_dict_loads_into_plain_torch_optimizer_and_back(path):
    gen = torch.Generator().manual_seed(7)
    params = list(_model(torch.float16).parameters())
    seq = _grad_sequence(params, 4, None, gen)
    opt, params, _ = _run_wrapper("adamw", True, seq[:3], clip=0.0)
    sd = copy.deepcopy(opt.state_dict())  # torch.optim's state_dict shares the state tensors
    # a plain torch AdamW over fp32 copies of the main params takes the inner state as it is
    mains = [m for g in opt.param_groups for m in g["params"]]
    plain_params = [m.detach().clone().requires_grad_() for m in mains]
    sizes = [len(g["params"]) for g in opt.param_groups]
    groups = [
        {"params": plain_params[: sizes[0]]},
        {"params": plain_params[sizes[0]:], "lr": 5e-3, "weight_decay": 0.0},
    ]
    plain = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), foreach=False)
    plain.load_state_dict(copy.deepcopy(sd["optimizer"]))
    for m, q in zip(mains, plain_params):
        assert sorted(plain.state[q]) == ["exp_avg", "exp_avg_sq", "step"]
        assert torch.equal(plain.state[q]["exp_avg"], opt.state[m]["exp_avg"])
    # one more step each: plain torch on the unscaled grads, the fused wrapper on the scaled ones
    scale = opt.get_loss_scale().item()
    by_id = {id(p): g for p, g in zip(params, seq[3])}
    order = [p for g in _groups(params, torch.optim.AdamW) for p in g["params"]]
    for q, p in zip(plain_params, order):
        q.grad = by_id[id(p)].float() * (1.0 / scale)
        p.grad = by_id[id(p)]
    plain.step()
    assert opt.step().update_successful
    _assert_close_fp32([m.detach() for m in mains], [q.detach() for q in plain_params], "main")
    # and back: a fresh fused wrapper resumes from the saved state dict bit-identically
    other_params = list(_model(torch.float16, seed=9).parameters())
    cls, kw = INNER["adamw"]
    other = tpamp.MixedPrecisionOptimizer(
        cls(_groups(other_params, cls), foreach=False, **kw),
        grad_scaler=tpamp.DynamicGradScaler(initial_scale=LOSS_SCALE, growth_interval=3,
                                            hysteresis=1),
    )
    other.load_state_dict(sd)
    for p, g in zip(other_params, seq[3]):
        p.grad = g
    assert other.step().update_successful
    others = [m for g in other.param_groups for m in g["params"]]
    assert all(torch.equal(a, b) for a, b in zip(others, mains))


def test_unsupported_options_take_the_generic_path(monkeypatch):
    calls = []
    monkeypatch.setattr(ops, "fused_adam_step_", lambda *a, **k: calls.append(1))

    class MyAdam(torch.optim.Adam):
        pass

    for make, fused_flag in [
        (lambda ps: torch.optim.Adam(ps, amsgrad=True), True),
        (lambda ps: MyAdam(ps), True),
        (lambda ps: torch.optim.Adam(ps, betas=(torch.tensor(0.9), torch.tensor(0.99))), True),
        (lambda ps: torch.optim.AdamW(ps), False),
    ]:
        params = list(_model(torch.bfloat16).parameters())
        opt = tpamp.MixedPrecisionOptimizer(make(params), fused_step=fused_flag)
        for p in params:
            p.grad = torch.ones_like(p)
        assert opt.step().update_successful
        assert all(m.grad is not None for g in opt.param_groups for m in g["params"])
    assert calls == []
    params = list(_model(torch.bfloat16).parameters())
    opt = tpamp.MixedPrecisionOptimizer(torch.optim.AdamW(params))
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert calls == [1]  # the default: one call (one param group of bf16 params)


# --------------------------------------------------------------------------------------------
# against megatron-core


def _megatron_vs_tpamp(rank, world_size, seq):
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import torch.distributed as dist
    from megatron_cpu import CudaAsCpu, make_megatron_fp16_optimizer

    group = dist.new_group([0])
    mega_params = list(_model(torch.float16).parameters())
    with CudaAsCpu():
        mega = make_megatron_fp16_optimizer(
            torch.optim.AdamW(mega_params, lr=1e-2, weight_decay=0.1, foreach=False), group,
            clip_grad=0.5, log_num_zeros_in_grad=True, initial_scale=LOSS_SCALE, hysteresis=1,
            growth_interval=3,
        )
        mega_results = []
        for grads in seq:
            for p, g in zip(mega_params, grads):
                p.grad = g.clone()
            mega_results.append(mega.step())
        mega_scale = mega.get_loss_scale().item()
    tp_params = list(_model(torch.float16).parameters())
    opt = tpamp.MixedPrecisionOptimizer(
        torch.optim.AdamW(tp_params, lr=1e-2, weight_decay=0.1),
        grad_scaler=tpamp.DynamicGradScaler(initial_scale=LOSS_SCALE, growth_interval=3,
                                            hysteresis=1),
        clip_grad=0.5, log_num_zeros_in_grad=True, grad_stats_group=group,
    )
    tp_results = []
    for grads in seq:
        for p, g in zip(tp_params, grads):
            p.grad = g.clone()
        tp_results.append(tuple(opt.step()))
    # numpy arrays travel by value (tensors would be shared through this exiting process's fds)
    arrays = lambda ts: [t.detach().float().numpy().copy() for t in ts]  # noqa: E731
    mains_m = arrays(m for g in mega.optimizer.param_groups for m in g["params"])
    mains_t = arrays(m for g in opt.param_groups for m in g["params"])
    return (mega_results, tp_results, mega_scale, opt.get_loss_scale().item(), mains_m, mains_t,
            arrays(mega_params), arrays(tp_params))


def test_fused_wrapper_matches_megatron_core_after_steps_with_skips_and_clipping(path):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (optional)")
    gen = torch.Generator().manual_seed(8)
    seq = _grad_sequence(list(_model(torch.float16).parameters()), 6, 1, gen)
    (mega_res, tp_res, mega_scale, tp_scale, mains_m, mains_t, model_m, model_t) = run_workers(
        _megatron_vs_tpamp, 1, seq, timeout=60.0
    )[0]
    assert [r[0] for r in mega_res] == [r[0] for r in tp_res] == [True, False, True, True, True, True]
    for m, t in zip(mega_res, tp_res):
        if m[0]:
            assert math.isclose(m[1], t[1], rel_tol=1e-6) and m[2] == t[2]
    assert mega_scale == tp_scale
    mains_t, mains_m, model_t, model_m = (
        [torch.from_numpy(a) for a in arrays] for arrays in (mains_t, mains_m, model_t, model_m)
    )
    _assert_close_fp32(mains_t, mains_m, "main param vs megatron")
    for a, b in zip(model_t, model_m):
        # fp16 copies of mains equal to fp32 rounding: at most one fp16 rounding step apart
        assert (a - b).abs().max() <= torch.finfo(torch.float16).eps * b.abs().max()


def test_spike_skip_on_the_fused_path_leaves_every_bit_unchanged(path, monkeypatch):
    """The main job's configuration (a SpikeDetector) takes the one-pass path; a skipped spike
    changes nothing and restores the loss scale, as an overflow skip does."""
    calls = []
    real = ops.fused_adam_step_
    monkeypatch.setattr(ops, "fused_adam_step_", lambda *a, **k: (calls.append(1), real(*a, **k)))
    gen = torch.Generator().manual_seed(10)
    params = list(_model(torch.float16).parameters())
    scaler = tpamp.DynamicGradScaler(initial_scale=8.0, growth_interval=1)
    opt = tpamp.MixedPrecisionOptimizer(
        torch.optim.AdamW(params, lr=1e-2), grad_scaler=scaler, clip_grad=1.0,
        spike_detector=tpamp.SpikeDetector("skip", window=4, warmup=3, watch=("grad_norm",)),
    )
    for k in range(4):
        for p in params:
            p.grad = _randn(p.shape, gen, 1.0 * float(scaler.scale), torch.float16)
        assert opt.step().update_successful
    assert len(calls) == 4
    mains = [m for g in opt.param_groups for m in g["params"]]
    state = lambda: _bits([*mains, *params] + [v for m in mains for v in opt.state[m].values()])  # noqa: E731
    before, scale_before = state(), float(scaler.scale)
    for p in params:  # a grad-norm spike: 50x the usual grads, still finite in fp16
        p.grad = _randn(p.shape, gen, 50.0 * float(scaler.scale), torch.float16)
        assert torch.isfinite(p.grad).all()  # so the skip is the spike's, not an overflow's
    assert not opt.step().update_successful
    assert all(torch.equal(a, b) for a, b in zip(before, state()))
    assert float(scaler.scale) == scale_before  # growth_interval=1 would have grown it
    assert len(calls) == 4


@pytest.mark.parametrize("op", ["fused_adam_step_", "fused_sgd_step_"])
def test_opcheck_fused_step_ops(op):
    """torch.library.opcheck: the schema marks exactly what the kernels write; the fake impl,
    autograd registration and AOT dispatch agree (docs/spec.md section 4)."""
    if not _kernel_built():
        pytest.skip("tpamp._C with the fused step kernels is not built")
    gen = torch.Generator().manual_seed(11)
    shapes = [(5,), (33,), (0,)]
    params = [_randn(s, gen) for s in shapes]
    models = [p.half() for p in params]
    grads = [_randn(s, gen, 1.0, torch.float16) for s in shapes]
    scale, skip = torch.tensor([0.5]), torch.zeros(1)
    if op == "fused_adam_step_":
        args = (params, [_randn(s, gen).abs() for s in shapes], [_randn(s, gen).abs() for s in shapes],
                [torch.tensor(3.0) for _ in shapes], models, grads, scale, skip, None, 1e-3, 0.9,
                0.999, 1e-8, 0.01, True, False, [], [])
    else:
        args = (params, [_randn(s, gen) for s in shapes], models, grads, [False, True, False], scale,
                skip, torch.tensor([0.1]), 0.0, 0.9, 0.1, 0.01, True, False)
    torch.library.opcheck(getattr(torch.ops.tpamp, op), args)
