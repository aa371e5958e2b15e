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
    params, opt, ref_params, ref = _setup()
    for seed in range(3):
        _step(params, opt, ref_params, ref, seed)
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
    params, opt, ref_params, ref = _setup()
    for seed in range(3):
        _step(params, opt, ref_params, ref, seed)
    mains = [m for group in opt.main_params_by_group() for m in group]
    opt.optimizer.state[mains[0]].clear()  # same dict object, now empty: a fresh state
    ref.state[ref_params[0]].clear()
    _step(params, opt, ref_params, ref, 3)
    _check(opt, ref_params)


def test_wrong_grad_dtype_on_a_later_step_raises_before_any_change():
    params, opt, ref_params, ref = _setup()
    for seed in range(3):
        _step(params, opt, ref_params, ref, seed)
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
