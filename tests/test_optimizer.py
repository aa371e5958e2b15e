"""MixedPrecisionOptimizer / FP32Optimizer in one process (docs/spec.md section 2)."""

import copy
import math

import pytest
import torch
from misuse_utils import DROP, all_of, assert_every_case_refused_by_tpamp, assert_raises_naming, case_ids

import tpamp


def _half_model(dtype=torch.float16, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).to(dtype)


def _set_grads(params, grads, scale):
    for p, g in zip(params, grads):
        p.grad = (g * scale).to(p.dtype)


def test_step_equals_fp64_adamw_on_unscaled_grads():
    model = _half_model()
    params = list(model.parameters())
    ref = [p.detach().double().clone().requires_grad_() for p in params]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    scaler = tpamp.ConstantGradScaler(1024.0)
    opt = tpamp.MixedPrecisionOptimizer(
        torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1), grad_scaler=scaler
    )
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=g, dtype=torch.float64).half().double() for p in params]
        _set_grads(params, grads, 1024.0)
        for r, gr in zip(ref, grads):
            r.grad = gr.clone()
        ok, norm, zeros = opt.step()
        ref_opt.step()
        assert ok and zeros is None
        assert math.isclose(norm, float(torch.cat([x.flatten() for x in grads]).norm()), rel_tol=1e-6)
    mains = [m for grp in opt.param_groups for m in grp["params"]]
    for m, r, p in zip(mains, ref, params):
        assert m.dtype == torch.float32
        torch.testing.assert_close(m.detach().double(), r.detach(), rtol=1e-5, atol=1e-6)
        assert torch.equal(p.detach(), m.detach().half())  # model param = fp16(main param)


def test_main_params_replace_half_params_and_keep_megatron_attributes():
    model = _half_model(torch.bfloat16)
    w = model[0].weight
    w.tensor_model_parallel, w.partition_dim, w.partition_stride = True, 0, 1
    model[2].weight.shared = True
    fp32_extra = torch.nn.Parameter(torch.ones(2))
    inner = torch.optim.SGD([{"params": list(model.parameters())}, {"params": [fp32_extra], "lr": 0.5}], lr=0.1)
    opt = tpamp.MixedPrecisionOptimizer(inner)
    mains = opt.param_groups[0]["params"]
    assert all(m.dtype == torch.float32 and m.is_leaf for m in mains)
    assert not any(m is p for m, p in zip(mains, model.parameters()))
    assert mains[0].tensor_model_parallel is True and mains[0].partition_dim == 0
    assert mains[0].partition_stride == 1 and mains[2].shared is True
    assert opt.param_groups[1]["params"][0] is fp32_extra  # fp32 params used as they are
    for m, p in zip(mains, model.parameters()):
        assert torch.equal(m.detach(), p.detach().float())


def test_existing_optimizer_state_moves_to_the_main_param():
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    inner = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones_like(p)
    inner.step()
    buf = inner.state[p]["momentum_buffer"].clone()
    opt = tpamp.MixedPrecisionOptimizer(inner)
    main = opt.param_groups[0]["params"][0]
    assert p not in opt.state
    assert torch.equal(opt.state[main]["momentum_buffer"], buf.float())


def test_main_grad_is_used_instead_of_grad():
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    p.main_grad = torch.tensor([1.0, 2.0, 2.0])  # Megatron DDP's fp32 buffer
    p.grad = torch.full((3,), 100.0, dtype=torch.bfloat16)  # must be ignored
    opt = tpamp.MixedPrecisionOptimizer(torch.optim.SGD([p], lr=1.0))
    ok, norm, _ = opt.step()
    assert ok and norm == pytest.approx(3.0)
    assert torch.equal(p.detach(), torch.tensor([-1.0, -2.0, -2.0], dtype=torch.bfloat16))


def test_one_scaler_and_one_found_inf_for_all_param_groups():
    a = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
    b = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
    scaler = tpamp.DynamicGradScaler(initial_scale=16.0, hysteresis=1)
    opt = tpamp.MixedPrecisionOptimizer(
        torch.optim.SGD([{"params": [a]}, {"params": [b], "lr": 2.0}], lr=1.0), grad_scaler=scaler
    )
    a.grad = torch.ones(2, dtype=torch.float16)
    b.grad = torch.tensor([1.0, math.inf], dtype=torch.float16)  # only group 1 overflows
    assert tuple(opt.step()) == (False, None, None)
    assert torch.equal(a.detach(), torch.zeros(2, dtype=torch.float16))  # group 0 skipped too
    assert float(scaler.scale) == 8.0


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_bf16_without_scaler_skips_nonfinite_steps(bad):
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    opt = tpamp.MixedPrecisionOptimizer(torch.optim.SGD([p], lr=1.0))
    p.grad = torch.tensor([1.0, bad, 1.0], dtype=torch.bfloat16)
    assert tuple(opt.step()) == (False, None, None)
    assert torch.equal(p.detach(), torch.ones(3, dtype=torch.bfloat16))


def test_skip_nonfinite_false_steps_anyway_without_scaler():
    p = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    opt = tpamp.MixedPrecisionOptimizer(torch.optim.SGD([p], lr=1.0), skip_nonfinite=False)
    p.grad = torch.tensor([math.nan, 0.0], dtype=torch.bfloat16)
    ok, norm, _ = opt.step()
    assert ok and math.isnan(norm) and math.isnan(float(p.detach()[0]))


def test_clip_and_zero_count_against_hand_values():
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
    opt = tpamp.MixedPrecisionOptimizer(
        torch.optim.SGD([p], lr=1.0), grad_scaler=tpamp.ConstantGradScaler(4.0),
        clip_grad=2.5, log_num_zeros_in_grad=True,
    )
    p.grad = torch.tensor([3.0, 0.0, 4.0, 0.0], dtype=torch.float16) * 4  # unscaled norm 5
    ok, norm, zeros = opt.step()
    assert ok and norm == pytest.approx(5.0) and zeros == 2
    coeff = 2.5 / (5.0 + 1e-6)
    torch.testing.assert_close(p.detach().float(), torch.tensor([-3 * coeff, 0, -4 * coeff, 0]), rtol=1e-3, atol=0)


def test_inf_norm_type():
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    opt = tpamp.MixedPrecisionOptimizer(torch.optim.SGD([p], lr=0.0), norm_type=math.inf)
    p.grad = torch.tensor([1.0, -7.0, 2.0], dtype=torch.bfloat16)
    assert opt.step().grad_norm == 7.0


def test_zero_grad_clears_model_and_main_grads():
    model = _half_model()
    opt = tpamp.MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), grad_scaler=tpamp.ConstantGradScaler(1.0))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert all(m.grad is None for g in opt.param_groups for m in g["params"])
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.zero_grad(set_to_none=False)
    assert all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())


def test_reload_model_params_copies_model_into_main():
    model = _half_model()
    opt = tpamp.MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), grad_scaler=tpamp.ConstantGradScaler(1.0))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.25)
    opt.reload_model_params()
    assert all(torch.all(m == 0.25) for g in opt.param_groups for m in g["params"])


def test_state_dict_has_megatron_keys_and_round_trips():
    model = _half_model()
    scaler = tpamp.DynamicGradScaler(initial_scale=8.0)
    opt = tpamp.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters()), grad_scaler=scaler)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    sd = opt.state_dict()
    assert set(sd) == {"optimizer", "grad_scaler", "fp32_from_fp16_params"}
    assert len(sd["fp32_from_fp16_params"]) == 1 and len(sd["fp32_from_fp16_params"][0]) == 4
    assert set(sd["grad_scaler"]) >= {"scale", "growth_tracker", "hysteresis_tracker"}
    other = _half_model(seed=9)
    opt2 = tpamp.MixedPrecisionOptimizer(torch.optim.AdamW(other.parameters()), grad_scaler=tpamp.DynamicGradScaler(initial_scale=2.0))
    opt2.load_state_dict(sd)
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)
    assert float(opt2.get_loss_scale()) == 8.0
    bad = dict(sd, fp32_from_fp16_params=[sd["fp32_from_fp16_params"][0][:3]])
    with pytest.raises(ValueError, match="3 main params"):
        opt2.load_state_dict(bad)


def test_scale_loss_multiplies_by_the_loss_scale_and_keeps_shape():
    p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float16))
    opt = tpamp.MixedPrecisionOptimizer(torch.optim.SGD([p], lr=1.0), grad_scaler=tpamp.ConstantGradScaler(512.0))
    loss = torch.tensor(0.5)
    scaled = opt.scale_loss(loss)
    assert scaled.shape == loss.shape and float(scaled) == 256.0


def test_fp32_optimizer_clips_counts_and_skips():
    p = torch.nn.Parameter(torch.zeros(4))
    opt = tpamp.FP32Optimizer(torch.optim.SGD([p], lr=1.0), clip_grad=1.0, log_num_zeros_in_grad=True)
    p.grad = torch.tensor([0.0, 3.0, 4.0, 0.0])
    ok, norm, zeros = opt.step()
    assert ok and norm == pytest.approx(5.0) and zeros == 2
    torch.testing.assert_close(p.detach(), torch.tensor([0.0, -0.6, -0.8, 0.0]), rtol=1e-5, atol=1e-6)
    assert opt.param_groups[0]["params"][0] is p
    p.grad = torch.tensor([0.0, math.inf, 0.0, 0.0])
    before = p.detach().clone()
    assert tuple(opt.step()) == (False, None, None)
    assert torch.equal(p.detach(), before)


def _trace(sync_free, steps=8):
    torch.manual_seed(0)
    model = _half_model()
    opt = tpamp.MixedPrecisionOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True),
        grad_scaler=tpamp.DynamicGradScaler(initial_scale=64.0, growth_interval=2, hysteresis=1),
        clip_grad=0.3, log_num_zeros_in_grad=True, sync_free=sync_free,
    )
    g = torch.Generator().manual_seed(3)
    out = []
    for it in range(steps):
        x = torch.randn(5, 6, generator=g).half()
        loss = model(x).float().pow(2).mean()
        opt.scale_loss(loss).backward()
        if it in (2, 5):
            model[0].weight.grad[0, 0] = math.inf
        ok, norm, zeros = opt.step()
        opt.zero_grad()
        out.append((bool(ok), None if not ok else float(norm), None if not ok else int(zeros),
                    float(opt.get_loss_scale())))
    return out, [p.detach().clone() for p in model.parameters()]


def test_sync_free_step_matches_the_synchronous_step():
    want, want_params = _trace(False)
    got, got_params = _trace(True)
    assert [r[0] for r in want].count(False) == 2
    assert got == want
    assert all(torch.equal(a, b) for a, b in zip(got_params, want_params))


def test_sync_free_needs_a_fused_inner_optimizer():
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="sync_free=True needs"):
        tpamp.MixedPrecisionOptimizer(torch.optim.AdamW([p]), sync_free=True)


def test_loss_scale_below_one_whose_unscale_overflows_skips_the_step():
    # scale 0.25: unscaling multiplies by 4, and 1e38 * 4 overflows fp32 (in-place fp32 grad)
    p = torch.nn.Parameter(torch.zeros(2))
    scaler = tpamp.DynamicGradScaler(initial_scale=0.25, min_scale=0.125, hysteresis=1)
    opt = tpamp.MixedPrecisionOptimizer(torch.optim.SGD([p], lr=1.0), grad_scaler=scaler)
    p.grad = torch.tensor([1e38, 1.0])
    assert tuple(opt.step()) == (False, None, None)
    assert torch.equal(p.detach(), torch.zeros(2)) and float(scaler.scale) == 0.125


# ---- misuse: each bad argument or loaded value raises the documented exception type, with a
# message that names the argument or key (docs/spec.md section 14); runner: tests/misuse_utils.py

NAN, INF = math.nan, math.inf


def _fp16_opt(inner_cls=torch.optim.SGD, scaler=None, **inner_kwargs):
    """An fp16 model param [3], its inner optimizer and the wrapper."""
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    inner = inner_cls([p], lr=0.1, **inner_kwargs)
    scaler = scaler or tpamp.DynamicGradScaler(initial_scale=4.0, growth_interval=4)
    return p, inner, tpamp.MixedPrecisionOptimizer(inner, grad_scaler=scaler)


def _stepped_adam():
    """An fp16 Adam wrapper after one real step (so it has state) and its state dict."""
    p, inner, opt = _fp16_opt(torch.optim.Adam)
    opt.scale_loss(p.float().sum()).backward()
    opt.step()
    opt.zero_grad()
    # deep copy: torch's state_dict() shares the live per-param state dicts
    return opt, copy.deepcopy(opt.state_dict())


def _load_edited(edit):
    opt, sd = _stepped_adam()
    edit(sd)
    opt.load_state_dict(sd)


def _step_twice_mpo():
    q = torch.nn.Parameter(torch.ones(3))
    opt = tpamp.MixedPrecisionOptimizer(torch.optim.SGD([q], lr=1.0),
                                        grad_scaler=tpamp.ConstantGradScaler(4.0))
    opt.scale_loss(q.sum()).backward()
    opt.step()
    opt.step()


def _group_added_after_wrap():
    p, inner, opt = _fp16_opt()
    inner.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
    p.grad = torch.ones(3, dtype=torch.float16)
    opt.step()


def _wrap_twice():
    _, inner, _ = _fp16_opt()
    tpamp.MixedPrecisionOptimizer(inner, grad_scaler=tpamp.ConstantGradScaler(1.0))


def _sgd_state_into_adam():
    q = torch.nn.Parameter(torch.ones(3))
    sgd = torch.optim.SGD([q], lr=1.0, momentum=0.9)
    q.grad = torch.ones(3)
    sgd.step()
    r = torch.nn.Parameter(torch.ones(3))
    adam = tpamp.MixedPrecisionOptimizer(torch.optim.Adam([r]))
    adam.load_state_dict({"optimizer": sgd.state_dict(), "fp32_from_fp16_params": [[]],
                          "grad_scaler": None})


def _adam_state_into_sgd():
    opt, sd = _stepped_adam()
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    sgd = tpamp.MixedPrecisionOptimizer(torch.optim.SGD([p], lr=0.1, momentum=0.9),
                                        grad_scaler=tpamp.ConstantGradScaler(1.0))
    sd["grad_scaler"] = None
    sgd.load_state_dict(sd)


def _set(path, value):
    def edit(sd):
        d = sd
        for k in path[:-1]:
            d = d[k]
        if value is DROP:
            del d[path[-1]]
        else:
            d[path[-1]] = value(d[path[-1]]) if callable(value) else value
    return edit


def _first_state(sd):
    return next(iter(sd["optimizer"]["state"].values()))


def _edit_state(key, fn):
    def edit(sd):
        st = _first_state(sd)
        st[key] = fn(st[key])
    return edit


MISUSE_CASES = [
    # MixedPrecisionOptimizer construction and use
    ("mpo-wrap-twice", _wrap_twice, ValueError, ["optimizer", "already", "wrapped"]),
    ("mpo-group-added-after-wrap", _group_added_after_wrap, RuntimeError, ["param_groups", "wrapped"]),
    ("mpo-step-twice", _step_twice_mpo, RuntimeError, ["step", "backward"]),
    ("mpo-scale_loss-float", lambda: _fp16_opt()[2].scale_loss(1.0), TypeError, ["loss", "float"]),
    ("mpo-scale_loss-int-tensor", lambda: _fp16_opt()[2].scale_loss(torch.tensor(3)), TypeError, ["loss", "int64"]),
    ("mpo-backward-str", lambda: _fp16_opt()[2].backward("loss"), TypeError, ["loss", "str"]),
    ("mpo-grad_scaler-torch", lambda: tpamp.MixedPrecisionOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1), grad_scaler=torch.amp.GradScaler("cpu")), TypeError, ["grad_scaler", "GradScaler"]),
    ("mpo-grad_stats_group-int", lambda: tpamp.MixedPrecisionOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1), grad_stats_group=5), TypeError, ["grad_stats_group", "int"]),
    ("mpo-tensor_parallel_group-str", lambda: tpamp.MixedPrecisionOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1), tensor_parallel_group="tp"), TypeError, ["tensor_parallel_group", "str"]),
    ("mpo-clip_grad-str", lambda: tpamp.MixedPrecisionOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1), clip_grad="1"), TypeError, ["clip_grad", "'1'"]),
    ("mpo-norm_type-str", lambda: tpamp.MixedPrecisionOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1), norm_type="2"), TypeError, ["norm_type", "'2'"]),
    ("mpo-sync_free-unfused", lambda: tpamp.MixedPrecisionOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1), sync_free=True), ValueError, ["sync_free", "SGD"]),
    ("mpo-step-closure", lambda: _fp16_opt()[2].step(lambda: 0.0), ValueError, ["closure"]),
    ("mpo-float64-param-in-second-group", lambda: tpamp.MixedPrecisionOptimizer(torch.optim.SGD([{"params": [torch.nn.Parameter(torch.ones(1, dtype=torch.float16))]}, {"params": [torch.nn.Parameter(torch.ones(1, dtype=torch.float64))]}], lr=1), grad_scaler=tpamp.ConstantGradScaler(1.0)), TypeError, ["param", "group", "torch.float64"]),
    # MixedPrecisionOptimizer.load_state_dict: all of it checked first
    ("load-None", lambda: _stepped_adam()[0].load_state_dict(None), TypeError, ["state_dict", "None"]),
    ("load-list", lambda: _stepped_adam()[0].load_state_dict([]), TypeError, ["state_dict", "list"]),
    ("load-missing-optimizer", lambda: _load_edited(_set(["optimizer"], DROP)), KeyError, ["optimizer"]),
    ("load-missing-main-params", lambda: _load_edited(_set(["fp32_from_fp16_params"], DROP)), KeyError, ["fp32_from_fp16_params"]),
    ("load-optimizer-str", lambda: _load_edited(_set(["optimizer"], "adam")), TypeError, ["optimizer", "str"]),
    ("load-optimizer-no-state", lambda: _load_edited(_set(["optimizer", "state"], DROP)), KeyError, ["state"]),
    ("load-optimizer-no-param_groups", lambda: _load_edited(_set(["optimizer", "param_groups"], DROP)), KeyError, ["param_groups"]),
    ("load-param-group-count", lambda: _load_edited(_set(["optimizer", "param_groups"], lambda g: g + g)), ValueError, ["param_groups", "2"]),
    ("load-param-count", lambda: _load_edited(lambda sd: sd["optimizer"]["param_groups"][0].update(params=[0, 1])), ValueError, ["params", "2"]),
    ("load-group-without-params", lambda: _load_edited(lambda sd: sd["optimizer"]["param_groups"][0].pop("params")), KeyError, ["params"]),
    ("load-group-missing-betas", lambda: _load_edited(lambda sd: sd["optimizer"]["param_groups"][0].pop("betas")), ValueError, ["betas", "Adam"]),
    ("load-sgd-into-adam", _sgd_state_into_adam, ValueError, ["betas", "Adam"]),
    ("load-adam-into-sgd", _adam_state_into_sgd, ValueError, ["momentum", "SGD"]),
    ("load-state-unknown-id", lambda: _load_edited(lambda sd: sd["optimizer"]["state"].update({7: {}})), ValueError, ["state", "7"]),
    ("load-state-wrong-shape", lambda: _load_edited(_edit_state("exp_avg", lambda t: torch.zeros(5))), ValueError, ["exp_avg", "shape"]),
    ("load-state-nan", lambda: _load_edited(_edit_state("exp_avg_sq", lambda t: torch.full_like(t, NAN))), ValueError, ["exp_avg_sq", "nan"]),
    ("load-state-other-keys", lambda: _load_edited(lambda sd: sd["optimizer"]["state"].update({0: {"momentum_buffer": torch.zeros(3)}})), ValueError, ["momentum_buffer", "exp_avg"]),
    ("load-state-entry-not-dict", lambda: _load_edited(lambda sd: sd["optimizer"]["state"].update({0: 1.0})), TypeError, ["state", "float"]),
    ("load-scaler-nan", lambda: _load_edited(_set(["grad_scaler", "scale"], torch.tensor([NAN]))), ValueError, ["grad_scaler", "scale", "nan"]),
    ("load-scaler-str-scale", lambda: _load_edited(_set(["grad_scaler", "scale"], "big")), TypeError, ["grad_scaler", "scale"]),
    ("load-scaler-growth-tracker", lambda: _load_edited(_set(["grad_scaler", "growth_tracker"], 4)), ValueError, ["grad_scaler", "growth_tracker"]),
    ("load-scaler-not-dict", lambda: _load_edited(_set(["grad_scaler"], 8.0)), TypeError, ["grad_scaler", "float"]),
    ("load-main-nan", lambda: _load_edited(lambda sd: sd["fp32_from_fp16_params"][0][0].fill_(NAN)), ValueError, ["fp32_from_fp16_params", "nan"]),
    ("load-main-inf", lambda: _load_edited(lambda sd: sd["fp32_from_fp16_params"][0][0].__setitem__(1, INF)), ValueError, ["fp32_from_fp16_params", "inf"]),
    ("load-main-shape", lambda: _load_edited(lambda sd: sd["fp32_from_fp16_params"][0].__setitem__(0, torch.zeros(4))), ValueError, ["shape", "fp32_from_fp16_params"]),
    ("load-main-fp16", lambda: _load_edited(lambda sd: sd["fp32_from_fp16_params"][0].__setitem__(0, torch.zeros(3, dtype=torch.float16))), ValueError, ["fp32_from_fp16_params", "torch.float16"]),
    ("load-main-not-list", lambda: _load_edited(_set(["fp32_from_fp16_params"], torch.zeros(3))), TypeError, ["fp32_from_fp16_params", "Tensor"]),
    ("load-main-group-count", lambda: _load_edited(_set(["fp32_from_fp16_params"], lambda g: g + g)), ValueError, ["param groups", "2"]),
    ("load-main-not-tensor", lambda: _load_edited(lambda sd: sd["fp32_from_fp16_params"][0].__setitem__(0, [1.0, 1.0, 1.0])), TypeError, ["fp32_from_fp16_params", "list"]),
]


def test_every_case_is_refused_by_tpamp_itself():
    """Ids distinct; each case refused inside tpamp itself (tests/misuse_utils.py)."""
    assert_every_case_refused_by_tpamp(MISUSE_CASES)


@pytest.mark.parametrize("case_id,call,exc,words", MISUSE_CASES, ids=case_ids(MISUSE_CASES))
def test_misuse_raises_a_clear_error_naming_the_argument(case_id, call, exc, words):
    assert_raises_naming(case_id, call, exc, words)


# ---- load_state_dict: all or nothing (docs/spec.md section 14) -----------------------------------


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


# ---- step guard: no second step without a backward, no late param groups, no second wrapper ------


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


# ---- construction: which params need a scaler, which dtypes and arguments are refused (docs/spec.md sections 1-3) ----


def _params(*dtypes, requires_grad=True):
    return [torch.nn.Parameter(torch.zeros(3, dtype=d), requires_grad=requires_grad) for d in dtypes]


def test_fp16_params_without_scaler_raise_value_error():
    opt = torch.optim.SGD(_params(torch.float16, torch.float32), lr=0.1)
    with pytest.raises(ValueError, match=r"(?i)scaler"):
        tpamp.MixedPrecisionOptimizer(opt)


def test_fp16_params_with_explicit_none_scaler_raise_value_error():
    opt = torch.optim.SGD(_params(torch.float16), lr=0.1)
    with pytest.raises(ValueError, match=r"(?i)scaler"):
        tpamp.MixedPrecisionOptimizer(opt, grad_scaler=None, clip_grad=1.0)


@pytest.mark.parametrize("dtypes", [(torch.bfloat16,), (torch.float32,), (torch.bfloat16, torch.float32)])
def test_bf16_and_fp32_params_need_no_scaler(dtypes):
    opt = torch.optim.SGD(_params(*dtypes), lr=0.1)
    wrapped = tpamp.MixedPrecisionOptimizer(opt)
    assert len(wrapped.param_groups[0]["params"]) == len(dtypes)


def test_fp16_params_with_a_scaler_are_accepted():
    opt = torch.optim.SGD(_params(torch.float16), lr=0.1)
    wrapped = tpamp.MixedPrecisionOptimizer(opt, grad_scaler=tpamp.ConstantGradScaler(8.0))
    assert wrapped.param_groups[0]["params"][0].dtype == torch.float32


@pytest.mark.parametrize(
    "dtype", [torch.float64, torch.int64, torch.int32, torch.complex64],
    ids=["float64", "int64", "int32", "complex64"],
)
def test_unsupported_param_dtype_raises_type_error_naming_it(dtype):
    if dtype.is_floating_point or dtype.is_complex:
        bad = torch.nn.Parameter(torch.zeros(3, dtype=dtype))
    else:
        bad = torch.nn.Parameter(torch.zeros(3, dtype=dtype), requires_grad=False)
    opt = torch.optim.SGD([bad] + _params(torch.float32), lr=0.1)
    with pytest.raises(TypeError, match=str(dtype).replace(".", r"\.")):
        tpamp.MixedPrecisionOptimizer(opt, grad_scaler=tpamp.ConstantGradScaler(1.0))


def test_unsupported_param_dtype_in_second_param_group_raises_type_error():
    opt = torch.optim.SGD(
        [{"params": _params(torch.float32)}, {"params": _params(torch.float64)}], lr=0.1
    )
    with pytest.raises(TypeError, match=r"torch\.float64"):
        tpamp.MixedPrecisionOptimizer(opt)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64],
                         ids=["float16", "bfloat16", "float64"])
def test_fp32_optimizer_with_non_fp32_param_raises_type_error_naming_the_dtype(dtype):
    opt = torch.optim.SGD(_params(torch.float32, dtype), lr=0.1)
    with pytest.raises(TypeError, match=str(dtype).replace(".", r"\.")):
        tpamp.FP32Optimizer(opt)


def test_fp32_optimizer_over_fp32_params_is_accepted():
    opt = torch.optim.SGD(_params(torch.float32, torch.float32), lr=0.1)
    wrapped = tpamp.FP32Optimizer(opt, clip_grad=1.0)
    assert wrapped.param_groups[0]["params"] == opt.param_groups[0]["params"]


@pytest.mark.parametrize(
    "clip,shown",
    [(-1.0, r"-1\.0"), (-0.25, r"-0\.25"), (float("nan"), "nan"), (float("inf"), "inf")],
    ids=["-1", "-0.25", "nan", "inf"],
)
@pytest.mark.parametrize("cls", ["MixedPrecisionOptimizer", "FP32Optimizer"])
def test_bad_clip_grad_raises_value_error_naming_it(cls, clip, shown):
    opt = torch.optim.SGD(_params(torch.float32), lr=0.1)
    with pytest.raises(ValueError, match=all_of("clip_grad", shown)):
        getattr(tpamp, cls)(opt, clip_grad=clip)


@pytest.mark.parametrize(
    "norm_type,shown",
    [(0.5, r"0\.5"), (0.0, r"0(\.0)?"), (-2.0, r"-2(\.0)?"), (float("nan"), "nan")],
    ids=["0.5", "0", "-2", "nan"],
)
def test_bad_norm_type_raises_value_error_naming_it(norm_type, shown):
    opt = torch.optim.SGD(_params(torch.float32), lr=0.1)
    with pytest.raises(ValueError, match=all_of("norm_type", shown)):
        tpamp.MixedPrecisionOptimizer(opt, norm_type=norm_type)


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, math.inf])
def test_valid_norm_types_are_accepted(norm_type):
    opt = torch.optim.SGD(_params(torch.float32), lr=0.1)
    assert tpamp.MixedPrecisionOptimizer(opt, norm_type=norm_type).norm_type == norm_type


class _NotAnOptimizer:
    param_groups = [{"params": []}]

    def step(self):
        pass


@pytest.mark.parametrize(
    "obj,name",
    [(_NotAnOptimizer(), "_NotAnOptimizer"), ([torch.zeros(1)], "list"), (None, "NoneType")],
    ids=["duck-typed", "list", "None"],
)
@pytest.mark.parametrize("cls", ["MixedPrecisionOptimizer", "FP32Optimizer"])
def test_non_optimizer_raises_type_error_naming_its_type(cls, obj, name):
    with pytest.raises(TypeError, match=name):
        getattr(tpamp, cls)(obj)
