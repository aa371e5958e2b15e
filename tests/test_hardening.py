"""No bad value trains silently (docs/spec.md section 14): the scale never becomes inf or 0 in float32, a
failed load changes nothing, a second step without a backward and param groups added after
wrapping are refused, and a skipped sync_free step is logged as null, never as Infinity."""

from __future__ import annotations

import copy
import json
import math
import warnings

import pytest
import torch

import tpamp

F32_MAX = (2 - 2**-23) * 2.0**127  # the largest finite float32, by its definition


def _strict_json(line: str):
    def refuse(name):
        raise ValueError(f"non-JSON constant {name} in the log")

    return json.loads(line, parse_constant=refuse)


# ---- the loss scale stays finite and positive in float32 ------------------------------------


@pytest.mark.parametrize("growth_factor", [2.0, 3.0])
def test_unbounded_growth_stops_at_the_largest_float32_power_of_the_growth_factor(growth_factor):
    k = 0
    while growth_factor ** (k + 1) <= F32_MAX:
        k += 1
    cap = growth_factor**k  # 2**127 for 2, 3**80 for 3
    s = tpamp.DynamicGradScaler(initial_scale=growth_factor ** (k - 3), growth_factor=growth_factor,
                                growth_interval=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(10):
            s.update(False)
    assert float(s.scale) == pytest.approx(cap, rel=1e-6)
    assert math.isfinite(float(s.scale))
    msgs = [str(w.message) for w in caught if "float32" in str(w.message)]
    assert len(msgs) == 1, msgs  # a one-time warning
    # the scale still backs off from the cap on an overflow
    s.update(True)
    s.update(True)
    assert float(s.scale) == pytest.approx(cap / 2, rel=1e-6)


def test_growth_cap_reached_inside_optimizer_steps_is_reported_once():
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    scaler = tpamp.DynamicGradScaler(initial_scale=2.0**125, growth_interval=1)
    opt = tpamp.MixedPrecisionOptimizer(torch.optim.SGD([p], lr=0.0), grad_scaler=scaler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(5):
            p.grad = torch.zeros(4, dtype=torch.float16)
            assert opt.step().update_successful
    assert float(scaler.scale) == 2.0**127
    assert sum("float32" in str(w.message) for w in caught) == 1


def test_explicit_max_scale_clamps_without_a_warning():
    s = tpamp.DynamicGradScaler(initial_scale=8.0, max_scale=16.0, growth_interval=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(4):
            s.update(False)
    assert float(s.scale) == 16.0


def test_stall_at_a_min_scale_not_representable_in_float32_is_still_reported():
    # float32(0.1) > 0.1: comparing the float32 scale with the float64 min_scale never matched
    s = tpamp.DynamicGradScaler(initial_scale=0.1, min_scale=0.1, hysteresis=1)
    with pytest.warns(RuntimeWarning, match="min_scale"):
        s.update(True)


# ---- load_state_dict: all or nothing --------------------------------------------------------


def _trained_pair():
    """Two optimizers over the same fp16 model shape; the source has taken steps."""
    torch.manual_seed(0)

    def make():
        w = torch.nn.Parameter(torch.randn(4, 3).half())
        b = torch.nn.Parameter(torch.randn(3))
        scaler = tpamp.DynamicGradScaler(initial_scale=2.0**10, growth_interval=3)
        opt = tpamp.MixedPrecisionOptimizer(
            torch.optim.AdamW([{"params": [w]}, {"params": [b], "lr": 0.01}], lr=0.1),
            grad_scaler=scaler,
        )
        return (w, b), opt

    (w, b), src = make()
    x = torch.randn(5, 4)
    for _ in range(3):
        loss = (x @ w.float() + b).square().mean()
        src.scale_loss(loss).backward()
        src.step()
        src.zero_grad()
    (w2, b2), dst = make()
    for _ in range(2):  # the destination has its own, different history
        loss = (x @ w2.float() + b2).sin().mean()
        dst.scale_loss(loss).backward()
        dst.step()
        dst.zero_grad()
    return copy.deepcopy(src.state_dict()), dst, (w2, b2)


def _snapshot(opt, params):
    return copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in params]


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _nan_main(sd):
    sd["fp32_from_fp16_params"][0][0][1, 2] = math.nan  # as a flipped exponent bit would


BAD_EDITS = {
    "scaler scale nan (inner state valid)": lambda sd: sd["grad_scaler"].update(scale=torch.tensor([math.nan])),
    "scaler growth tracker past the interval": lambda sd: sd["grad_scaler"].update(growth_tracker=3),
    "main param nan": _nan_main,
    "main param shape": lambda sd: sd["fp32_from_fp16_params"][0].__setitem__(0, torch.zeros(3, 4)),
    "inner state shape": lambda sd: next(iter(sd["optimizer"]["state"].values())).update(exp_avg=torch.zeros(2)),
    "inner group of another optimizer": lambda sd: sd["optimizer"]["param_groups"][1].pop("betas"),
}


@pytest.mark.parametrize("edit", list(BAD_EDITS), ids=list(BAD_EDITS))
def test_failed_load_leaves_optimizer_scaler_and_params_bit_identical(edit):
    sd, dst, params = _trained_pair()
    for group in sd["optimizer"]["param_groups"]:
        group["lr"] = 123.0  # would show if the inner state were loaded before the failure
    BAD_EDITS[edit](sd)
    before = _snapshot(dst, params)
    with pytest.raises((ValueError, TypeError, KeyError)):
        dst.load_state_dict(sd)
    after = _snapshot(dst, params)
    assert _same(before, after)
    assert all(g["lr"] != 123.0 for g in dst.param_groups)


def test_a_valid_load_after_a_failed_one_restores_the_saved_state():
    sd, dst, params = _trained_pair()
    bad = copy.deepcopy(sd)
    _nan_main(bad)
    with pytest.raises(ValueError):
        dst.load_state_dict(bad)
    dst.load_state_dict(sd)
    assert _same(copy.deepcopy(dst.state_dict()), sd)
    assert torch.equal(params[0], sd["fp32_from_fp16_params"][0][0].half())


# ---- step guard --------------------------------------------------------------------------------


def _fp32_setup(scale=4.0):
    q = torch.nn.Parameter(torch.ones(3))
    opt = tpamp.MixedPrecisionOptimizer(torch.optim.SGD([q], lr=1.0),
                                        grad_scaler=tpamp.ConstantGradScaler(scale))
    return q, opt


def test_second_step_without_backward_raises_and_changes_nothing():
    q, opt = _fp32_setup()
    opt.scale_loss(q.sum()).backward()
    opt.step()  # q = 1 - 1 (grad d(sum)/dq = 1 after unscaling)
    assert torch.equal(q.detach(), torch.zeros(3))
    with pytest.raises(RuntimeError, match="backward"):
        opt.step()
    assert torch.equal(q.detach(), torch.zeros(3))
    # a new backward makes the next step legal again
    opt.zero_grad()
    opt.scale_loss(q.sum()).backward()
    opt.step()
    assert torch.equal(q.detach(), -torch.ones(3))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_usual_loops_are_not_refused(set_to_none):
    q, opt = _fp32_setup()
    for _ in range(3):
        opt.zero_grad(set_to_none=set_to_none)
        for _ in range(2):  # gradient accumulation
            opt.scale_loss(q.sum()).backward()
        opt.step()
    assert torch.equal(q.detach(), torch.full((3,), -5.0))  # 1 - 3 steps of 2


def test_param_group_added_after_wrapping_is_refused_before_any_change():
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    inner = torch.optim.SGD([p], lr=0.1)
    opt = tpamp.MixedPrecisionOptimizer(inner, grad_scaler=tpamp.ConstantGradScaler(4.0))
    q = torch.nn.Parameter(torch.ones(2))
    inner.add_param_group({"params": [q]})
    p.grad = torch.full((3,), 4.0, dtype=torch.float16)
    q.grad = torch.full((2,), 4.0)
    with pytest.raises(RuntimeError, match="param_groups"):
        opt.step()
    assert torch.equal(q.detach(), torch.ones(2)) and torch.equal(p.detach(), torch.ones(3).half())


def test_wrapping_an_optimizer_twice_is_refused_and_the_first_wrapper_still_works():
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    inner = torch.optim.SGD([p], lr=0.5)
    opt = tpamp.MixedPrecisionOptimizer(inner, grad_scaler=tpamp.ConstantGradScaler(2.0))
    with pytest.raises(ValueError, match="already wrapped"):
        tpamp.MixedPrecisionOptimizer(inner, grad_scaler=tpamp.ConstantGradScaler(2.0))
    opt.scale_loss(p.float().sum()).backward()
    assert opt.step().update_successful
    assert torch.equal(p.detach(), torch.full((3,), 0.5).half())


def test_bad_param_in_a_later_group_leaves_earlier_groups_unconverted():
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    bad = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    inner = torch.optim.SGD([{"params": [p]}, {"params": [bad]}], lr=0.5)
    with pytest.raises(TypeError, match="float64"):
        tpamp.MixedPrecisionOptimizer(inner, grad_scaler=tpamp.ConstantGradScaler(2.0))
    assert inner.param_groups[0]["params"][0] is p


# ---- sync_free skipped steps and the log ------------------------------------------------------


def test_sync_free_skipped_step_reports_sentinels_and_the_log_has_null(tmp_path):
    q = torch.nn.Parameter(torch.ones(3))
    opt = tpamp.MixedPrecisionOptimizer(
        torch.optim.Adam([q], lr=1.0, fused=True), grad_scaler=tpamp.ConstantGradScaler(4.0),
        sync_free=True, log_num_zeros_in_grad=True)
    q.grad = torch.tensor([4.0, math.inf, 0.0])
    skipped = opt.step()
    opt.zero_grad()
    q.grad = torch.tensor([12.0, 16.0, 0.0])  # unscaled: [3, 4, 0], norm 5, one zero
    clean = opt.step()
    assert not bool(skipped.update_successful)
    assert math.isnan(float(skipped.grad_norm)) and int(skipped.num_zeros_in_grad) == -1
    assert bool(clean.update_successful)
    assert float(clean.grad_norm) == 5.0 and int(clean.num_zeros_in_grad) == 1
    path = tmp_path / "log.jsonl"
    with tpamp.TrainingLogger(2, jsonl_path=str(path), stream=open("/dev/null", "w")) as log:
        log.record(1, 2.0, 1e-3, 4.0, skipped)
        log.record(2, 1.5, 1e-3, 4.0, clean)
    first, second = [_strict_json(line) for line in path.read_text().splitlines()]
    assert first["grad_norm"] is None and first["num_zeros"] is None and first["skipped"] is True
    assert second["grad_norm"] == 5.0 and second["num_zeros"] == 1 and second["skipped"] is False


def test_logger_never_writes_non_json(tmp_path):
    path = tmp_path / "log.jsonl"
    with tpamp.TrainingLogger(3, jsonl_path=str(path), stream=open("/dev/null", "w")) as log:
        # a step that was not skipped (skip_nonfinite=False) with an inf norm, an inf scale
        log.record(1, math.inf, math.nan, math.inf, (True, math.inf, 3),
                   extra_norms={"w": math.nan, "b": 1.0}, tokens=torch.tensor(7))
    (rec,) = [_strict_json(line) for line in path.read_text().splitlines()]
    assert rec["loss"] is None and rec["nan"] is True
    assert rec["lr"] is None and rec["loss_scale"] is None and rec["grad_norm"] is None
    assert rec["num_zeros"] == 3
    assert rec["extra_norms"] == {"w": None, "b": 1.0} and rec["tokens"] == 7
