"""The one-pass step's kept lists (tpamp/optimizer.py: the fp32-state Adam lists reused between
steps, checked by identity) must notice every change they were built from: a load, a state
tensor or state dict replaced, a grad of the wrong dtype. Each case is compared against an
independent reference: torch.optim.AdamW in float64 on the same (unscaled) grads, or the
expected error with nothing changed."""

import copy

import pytest
import torch

import tpamp

SIZES = (7, 33, 5, 64)
LR, WD = 1e-2, 0.01


def _grads(seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g) * 0.1).half() for n in SIZES]


def _setup():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n).half()) for n in SIZES]
    opt = tpamp.MixedPrecisionOptimizer(
        torch.optim.AdamW(params, lr=LR, weight_decay=WD),
        grad_scaler=tpamp.ConstantGradScaler(4.0), log_num_zeros_in_grad=True)
    ref_params = [torch.nn.Parameter(p.detach().double()) for p in params]
    ref = torch.optim.AdamW(ref_params, lr=LR, weight_decay=WD)
    return params, opt, ref_params, ref


def _step(params, opt, ref_params, ref, seed):
    for p, r, g in zip(params, ref_params, _grads(seed)):
        p.grad = g * 4.0  # the loss-scaled grad; the reference gets the unscaled one
        r.grad = g.double()
    result = opt.step()
    assert result.update_successful
    ref.step()


def _after_three_steps():
    """_setup, then three steps of both (the lists are kept from the third step on)."""
    params, opt, ref_params, ref = _setup()
    for seed in range(3):
        _step(params, opt, ref_params, ref, seed)
    return params, opt, ref_params, ref


def _check(opt, ref_params):
    mains = [m for group in opt.main_params_by_group() for m in group]
    for m, r in zip(mains, ref_params):
        torch.testing.assert_close(m.double(), r.detach(), rtol=1e-5, atol=1e-6)


def test_steps_match_float64_reference():
    params, opt, ref_params, ref = _setup()
    for seed in range(5):
        _step(params, opt, ref_params, ref, seed)
    _check(opt, ref_params)


def test_load_state_dict_after_the_lists_were_kept():
    params, opt, ref_params, ref = _setup()
    _step(params, opt, ref_params, ref, 0)
    saved, ref_saved = copy.deepcopy(opt.state_dict()), copy.deepcopy(ref.state_dict())
    ref_values = [r.detach().clone() for r in ref_params]
    for seed in (1, 2, 3):  # lists kept from the third step on
        _step(params, opt, ref_params, ref, seed)
    opt.load_state_dict(saved)  # new state dicts and tensors: the kept lists are stale
    ref.load_state_dict(ref_saved)
    with torch.no_grad():
        for r, v in zip(ref_params, ref_values):
            r.copy_(v)
    for seed in (4, 5):
        _step(params, opt, ref_params, ref, seed)
    _check(opt, ref_params)


def test_state_tensor_and_state_dict_replaced():
    params, opt, ref_params, ref = _after_three_steps()
    mains = [m for group in opt.main_params_by_group() for m in group]
    # a moment replaced in place of the dict entry: the next step must use the new tensor
    opt.optimizer.state[mains[1]]["exp_avg"] = torch.zeros_like(mains[1])
    ref.state[ref_params[1]]["exp_avg"] = torch.zeros_like(ref_params[1])
    _step(params, opt, ref_params, ref, 3)
    _check(opt, ref_params)
    # a whole state dict replaced (same keys): new step count and moments
    st = opt.optimizer.state[mains[2]]
    opt.optimizer.state[mains[2]] = {"step": torch.tensor(1.0), "exp_avg": st["exp_avg"] * 0.5,
                                     "exp_avg_sq": st["exp_avg_sq"].clone()}
    rst = ref.state[ref_params[2]]
    ref.state[ref_params[2]] = {"step": torch.tensor(1.0, dtype=torch.float64),
                                "exp_avg": rst["exp_avg"] * 0.5,
                                "exp_avg_sq": rst["exp_avg_sq"].clone()}
    _step(params, opt, ref_params, ref, 4)
    _step(params, opt, ref_params, ref, 5)
    _check(opt, ref_params)


def test_state_cleared_restarts_that_param():
    params, opt, ref_params, ref = _after_three_steps()
    mains = [m for group in opt.main_params_by_group() for m in group]
    opt.optimizer.state[mains[0]].clear()  # same dict object, now empty: a fresh state
    ref.state[ref_params[0]].clear()
    _step(params, opt, ref_params, ref, 3)
    _check(opt, ref_params)


def test_wrong_grad_dtype_on_a_later_step_raises_before_any_change():
    params, opt, ref_params, ref = _after_three_steps()
    mains = [m.detach().clone() for group in opt.main_params_by_group() for m in group]
    models = [p.detach().clone() for p in params]
    scale = opt.get_loss_scale().clone()
    for p, g in zip(params, _grads(3)):
        p.grad = g
    params[2].grad = None
    params[2].main_grad = torch.zeros(SIZES[2], dtype=torch.int32)
    with pytest.raises(TypeError, match="torch.int32"):
        opt.step()
    params[2].main_grad = torch.zeros(SIZES[2] + 1)
    with pytest.raises(ValueError, match="shape"):
        opt.step()
    now = [m for group in opt.main_params_by_group() for m in group]
    for a, b in zip(now, mains):
        assert torch.equal(a, b)
    for p, m in zip(params, models):
        assert torch.equal(p.detach(), m)
    assert torch.equal(opt.get_loss_scale(), scale)


def _adamw_reference(p, g, steps):
    ref = torch.nn.Parameter(p.detach().double().clone())
    opt = torch.optim.AdamW([ref], lr=LR, weight_decay=WD)
    for _ in range(steps):
        ref.grad = g.double()
        opt.step()
    return ref.detach()


def test_fused_adam_step_kernel_first_still_falls_back_for_strided_tensors():
    # ops.fused_adam_step_ calls the kernel before looking at layouts; a strided (not dense)
    # tensor is refused by it and stepped by the PyTorch path, as before
    from tpamp import ops

    gen = torch.Generator().manual_seed(3)
    base = torch.randn(40, generator=gen)
    p_strided = base.clone()[::2]
    p_dense = torch.randn(8, generator=gen)
    grads = [torch.randn(20, generator=gen).half(), torch.randn(8, generator=gen).half()]
    start = [p_strided.clone(), p_dense.clone()]
    params = [p_strided, p_dense]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    steps = [torch.zeros(()) for _ in params]
    with torch.no_grad():
        ops.fused_adam_step_(params, grads, m, v, steps, lr=LR, beta1=0.9, beta2=0.999,
                             eps=1e-8, weight_decay=WD, decoupled_weight_decay=True)
    for p, s, g in zip(params, start, grads):
        torch.testing.assert_close(p.double(), _adamw_reference(s, g.float(), 1),
                                   rtol=1e-5, atol=1e-6)
    assert [float(s) for s in steps] == [1.0, 1.0]


def test_fused_adam_step_kernel_first_keeps_the_python_errors():
    from tpamp import ops

    p = [torch.zeros(4)]
    g = [torch.ones(4).half()]
    with pytest.raises(TypeError, match=r"exp_avgs\[0\] has dtype torch.float64"):
        ops.fused_adam_step_(p, g, [torch.zeros(4, dtype=torch.float64)], [torch.zeros(4)],
                             [torch.zeros(())], lr=LR, beta1=0.9, beta2=0.999, eps=1e-8,
                             weight_decay=WD, decoupled_weight_decay=True)
    with pytest.raises(ValueError, match="scales"):
        ops.fused_adam_step_(p, g, [torch.zeros(4, dtype=torch.uint8)], [torch.zeros(4)],
                             [torch.zeros(())], lr=LR, beta1=0.9, beta2=0.999, eps=1e-8,
                             weight_decay=WD, decoupled_weight_decay=True)
    assert torch.equal(p[0], torch.zeros(4))


def test_grad_stats_kernel_first_keeps_errors_and_strided_grads():
    from tpamp import ops

    g = torch.arange(12.0)[::3]  # not dense: the PyTorch path
    h = torch.tensor([3.0, 0.0, -4.0]).half()
    stats = ops.grad_stats([g, h], norm_type=2.0, count_zeros=True)
    expect = sum(float(x) ** 2 for x in g) + 25.0
    assert stats.norm_stat.item() == pytest.approx(expect)
    assert int(stats.num_zeros) == 2 and float(stats.found_inf) == 0.0
    with pytest.raises(TypeError, match=r"grads\[1\] has dtype torch.float64"):
        ops.grad_stats([h, torch.zeros(3, dtype=torch.float64)], norm_type=2.0)
    with pytest.raises(ValueError, match=r"grads\[1\] is on meta"):
        ops.grad_stats([h, torch.empty(3, device="meta")], norm_type=2.0)
