"""Misuse of the shared guards (docs/spec.md section 2.4), single process: the step guard (grads checked before
the scaler moves, no second step without a backward, late param groups), the all-or-nothing
load of MixedPrecisionOptimizer (with its spike detector), a detector bound to one optimizer,
the spike policy "raise" and the zero count of the two step paths.

Each case names the exception type and the words its message must contain, and checks that the
refusal changed nothing: the bytes of every param, grad, main param, inner optimizer state,
scaler state and spike-detector state are the same after it. DistributedOptimizer cases (they
need a process group) are in tests/test_distributed_optimizer_guards.py, SpikeDetector's own
load_state_dict cases in tests/test_spikes.py; the runner is tests/misuse_utils.py."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from dist_utils import freeze, tensor_bytes
from misuse_utils import Case, assert_every_setup_case_refused_by_tpamp, assert_refused_and_unchanged
from misuse_utils import set_in as _set_in

import tpamp
from tpamp import GradSpikeError
from tpamp._guards import wrapped_by

NAN = math.nan


# ---- a byte-exact picture of everything a refusal must leave alone ---------------------------


def _picture(opt=None, params=(), detector=None):
    out = {}
    for i, p in enumerate(params):
        out[f"param{i}"] = tensor_bytes(p)
        out[f"grad{i}"] = tensor_bytes(p.grad) if p.grad is not None else None
        g = getattr(p, "main_grad", None)
        out[f"main_grad{i}"] = tensor_bytes(g) if isinstance(g, torch.Tensor) else repr(g)
    if opt is not None:
        out["opt"] = freeze(opt.state_dict())
        out["groups"] = [[id(p) for p in g["params"]] for g in opt.param_groups]
    if detector is not None:
        out["detector"] = freeze(detector.state_dict())
    return out


# ---- builders --------------------------------------------------------------------------------


def _mpo(dtype=torch.float16, inner=torch.optim.Adam, n=2, fused=True, scaler=True, **kw):
    params = [torch.nn.Parameter(torch.linspace(-1, 1, 3 + i).to(dtype)) for i in range(n)]
    sc = tpamp.DynamicGradScaler(initial_scale=8.0, growth_interval=2, hysteresis=1) if scaler else None
    opt = tpamp.MixedPrecisionOptimizer(inner([{"params": [p]} for p in params], lr=0.1),
                                        grad_scaler=sc, fused_step=fused, **kw)
    return opt, params


def _backward(opt, params, value=1.0):
    loss = sum((p.float() * value).sum() for p in params)
    opt.scale_loss(loss).backward()


def _stepped(**kw):
    opt, params = _mpo(**kw)
    _backward(opt, params)
    opt.step()
    opt.zero_grad()
    return opt, params, copy.deepcopy(opt.state_dict())


def _watch(opt=None, params=(), detector=None):
    return lambda: _picture(opt, params, detector)


# -- the step guard: MixedPrecisionOptimizer ----------------------------------------------------


def _second_step(dtype, fused, main_grad=False, inner=torch.optim.Adam):
    def setup():
        opt, params = _mpo(dtype, inner=inner, fused=fused)
        if main_grad:
            for p in params:
                p.main_grad = torch.full(p.shape, 8.0)
        else:
            _backward(opt, params)
        opt.step()
        return _watch(opt, params), opt.step
    return setup


def _bad_main_grad(value_fn, which=1, dtype=torch.float16):
    """main_grad of param ``which`` replaced by value_fn(param); the others good."""
    def setup():
        opt, params = _mpo(dtype)
        for i, p in enumerate(params):
            p.main_grad = value_fn(p) if i == which else torch.full(p.shape, 8.0)
        return _watch(opt, params), opt.step
    return setup


def _late_group():
    opt, params = _mpo()
    _backward(opt, params)
    opt.optimizer.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
    return _watch(opt, params), opt.step


def _removed_param():
    opt, params = _mpo()
    _backward(opt, params)
    opt.optimizer.param_groups[1]["params"] = []
    return _watch(opt, params), opt.step


def _replaced_param():
    opt, params = _mpo()
    _backward(opt, params)
    opt.optimizer.param_groups[0]["params"][0] = torch.nn.Parameter(torch.ones(3))
    return _watch(opt, params), opt.step


def _norms_without_tracker():
    opt, params = _mpo()
    _backward(opt, params)
    return _watch(opt, params), lambda: opt.step(param_grad_norms=True)


def _closure():
    opt, params = _mpo()
    _backward(opt, params)
    return _watch(opt, params), lambda: opt.step(lambda: 0.0)


def _fp32_fp16_main_grad():
    opt, params = _mpo(torch.float32, scaler=False)
    params[0].main_grad = torch.ones(3, dtype=torch.float16)
    return _watch(opt, params), opt.step


# -- MixedPrecisionOptimizer.load_state_dict ------------------------------------------------------


def _load(edit, **kw):
    def setup():
        opt, params, sd = _stepped(**kw)
        sd = edit(sd)
        return _watch(opt, params), lambda: opt.load_state_dict(sd)
    return setup


def _with_spikes(edit):
    def setup():
        det = tpamp.SpikeDetector("skip", window=4, warmup=2)
        opt, params, sd = _stepped(spike_detector=det)
        sd = edit(sd)
        return _watch(opt, params, det), lambda: opt.load_state_dict(sd)
    return setup


def _sgd_into_adam(sd):
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    q = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    sgd = tpamp.MixedPrecisionOptimizer(
        torch.optim.SGD([{"params": [p]}, {"params": [q]}], lr=0.1, momentum=0.9),
        grad_scaler=tpamp.DynamicGradScaler(initial_scale=8.0, growth_interval=2, hysteresis=1))
    _backward(sgd, [p, q])
    sgd.step()
    sd["optimizer"] = copy.deepcopy(sgd.state_dict()["optimizer"])
    return sd


def _first_state(sd):
    return next(iter(sd["optimizer"]["state"].values()))


def _nan_exp_avg(sd):
    _first_state(sd)["exp_avg"][0] = NAN
    return sd


# -- hyperparameters: checked at wrapping, at every step and in every load (main e82d3a5: never;
# eps 0 over a zero grad, an infinite lr: nan params while step() reported success)


def _set_later(**values):
    """A wrapped Adam after a backward, its first group's values then changed (a scheduler)."""
    def setup():
        opt, params = _mpo()
        _backward(opt, params)
        opt.optimizer.param_groups[0].update(values)
        return _watch(opt, params), opt.step
    return setup


def _wrap_groups(inner_cls=torch.optim.Adam, **values):
    """Wrapping an inner optimizer whose second group has its own ``values`` (torch checks only
    its constructor's defaults)."""
    def setup():
        params = [torch.nn.Parameter(torch.ones(3, 2, dtype=torch.float16)) for _ in range(2)]
        inner = inner_cls([{"params": [params[0]]}, {"params": [params[1]], **values}], lr=0.1)
        picture = lambda: (_picture(inner, params), wrapped_by(inner))  # noqa: E731
        return picture, lambda: tpamp.MixedPrecisionOptimizer(
            inner, grad_scaler=tpamp.DynamicGradScaler(initial_scale=8.0))
    return setup


# -- spike detectors ------------------------------------------------------------------------------


def _shared_detector(cls_name):
    def setup():
        det = tpamp.SpikeDetector("skip")
        first, _ = _mpo(spike_detector=det)
        p = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
        inner = torch.optim.SGD([p], lr=0.1)
        cls = getattr(tpamp, cls_name)
        kw = {} if cls_name == "FP32Optimizer" else {"grad_scaler": tpamp.ConstantGradScaler(2.0)}
        if cls_name == "FP32Optimizer":
            p = torch.nn.Parameter(torch.ones(3))
            inner = torch.optim.SGD([p], lr=0.1)

        def call():
            cls(inner, spike_detector=det, **kw)

        def picture():
            # the second inner optimizer is untouched (its param not replaced, not marked
            # wrapped: it can still be wrapped), the detector still judges the first one
            return (_picture(first, [p], det), [id(q) for q in inner.param_groups[0]["params"]],
                    wrapped_by(inner), det.owner is first)
        return picture, call
    return setup


def _detector_wrong_type():
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    inner = torch.optim.SGD([p], lr=0.1)
    return (lambda: ([id(q) for q in inner.param_groups[0]["params"]], tensor_bytes(p))), \
        lambda: tpamp.MixedPrecisionOptimizer(inner, grad_scaler=tpamp.ConstantGradScaler(2.0),
                                              spike_detector={"policy": "skip"})


def _detector_sync_free():
    det = tpamp.SpikeDetector("log")
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    inner = torch.optim.Adam([p], lr=0.1, fused=True)
    return (lambda: (det.owner, [id(q) for q in inner.param_groups[0]["params"]])), \
        lambda: tpamp.MixedPrecisionOptimizer(inner, grad_scaler=tpamp.ConstantGradScaler(2.0),
                                              sync_free=True, spike_detector=det)


CASES = [
    # a second step() without a new backward: refused on every path, also with plain .grad
    Case("step-twice-fp16-grad-generic", _second_step(torch.float16, False), RuntimeError, ["step", "backward"]),
    Case("step-twice-fp16-grad-fused", _second_step(torch.float16, True), RuntimeError, ["step", "backward"]),
    Case("step-twice-bf16-grad-generic", _second_step(torch.bfloat16, False), RuntimeError, ["step", "backward"]),
    Case("step-twice-bf16-grad-fused", _second_step(torch.bfloat16, True), RuntimeError, ["step", "backward"]),
    Case("step-twice-fp32-grad", _second_step(torch.float32, True), RuntimeError, ["step", "backward"]),
    Case("step-twice-main-grad-fused", _second_step(torch.float16, True, main_grad=True), RuntimeError, ["step", "backward"]),
    Case("step-twice-main-grad-sgd", _second_step(torch.float16, False, main_grad=True, inner=torch.optim.SGD), RuntimeError, ["step", "backward"]),
    # grads checked before the scaler or anything else moves
    Case("main-grad-wrong-shape", _bad_main_grad(lambda p: torch.ones(p.numel() + 1)), ValueError, ["gradient", "shape", "(5,)", "(4,)"]),
    Case("main-grad-2d", _bad_main_grad(lambda p: torch.ones(1, p.numel())), ValueError, ["gradient", "shape", "(1, 4)"]),
    Case("main-grad-int", _bad_main_grad(lambda p: torch.ones(p.shape, dtype=torch.int64)), TypeError, ["gradient", "dtype", "torch.int64"]),
    Case("main-grad-float64", _bad_main_grad(lambda p: torch.ones(p.shape, dtype=torch.float64)), TypeError, ["gradient", "torch.float64"]),
    Case("main-grad-list", _bad_main_grad(lambda p: [1.0] * p.numel()), TypeError, ["gradient", "list", "tensor"]),
    Case("main-grad-meta", _bad_main_grad(lambda p: torch.ones(p.shape, device="meta")), ValueError, ["gradient", "device", "meta", "cpu"]),
    Case("main-grad-first-param", _bad_main_grad(lambda p: torch.ones(7), which=0), ValueError, ["param", "0", "shape", "(7,)"]),
    Case("main-grad-bf16-model", _bad_main_grad(lambda p: torch.ones(2), dtype=torch.bfloat16), ValueError, ["shape", "(2,)"]),
    Case("fp32-param-fp16-main-grad", _fp32_fp16_main_grad, TypeError, ["fp32", "float32", "torch.float16"]),
    # param groups changed after wrapping
    Case("late-param-group", _late_group, RuntimeError, ["param_groups", "wrapped"]),
    Case("param-removed-after-wrap", _removed_param, RuntimeError, ["param_groups", "wrapped"]),
    Case("param-replaced-after-wrap", _replaced_param, RuntimeError, ["param_groups", "wrapped"]),
    Case("step-norms-without-tracker", _norms_without_tracker, ValueError, ["track_param_grad_norms"]),
    Case("step-closure", _closure, ValueError, ["closure"]),
    # MixedPrecisionOptimizer.load_state_dict: all or nothing
    Case("load-None", _load(lambda sd: None), TypeError, ["state_dict", "None"]),
    Case("load-str", _load(lambda sd: "ckpt.pt"), TypeError, ["state_dict", "str"]),
    Case("load-sgd-into-adam", _load(_sgd_into_adam), ValueError, ["betas", "Adam"]),
    Case("load-nan-exp-avg", _load(_nan_exp_avg), ValueError, ["exp_avg", "nan"]),
    Case("load-scaler-nan", _load(_set_in(["grad_scaler", "scale"], torch.tensor([NAN]))), ValueError, ["grad_scaler", "scale", "nan"]),
    Case("load-scaler-str", _load(_set_in(["grad_scaler", "scale"], "8")), TypeError, ["grad_scaler", "scale"]),
    Case("load-main-nan", _load(lambda sd: (sd["fp32_from_fp16_params"][1][0].fill_(NAN), sd)[1]), ValueError, ["fp32_from_fp16_params", "nan"]),
    Case("load-main-second-group-shape", _load(_set_in(["fp32_from_fp16_params", 1, 0], torch.zeros(9))), ValueError, ["shape", "(9,)", "fp32_from_fp16_params"]),
    Case("load-main-missing-group", _load(lambda sd: (sd["fp32_from_fp16_params"].pop(), sd)[1]), ValueError, ["param groups", "1", "2"]),
    Case("load-spike-nan-window", _with_spikes(_set_in(["spike_detector", "windows", "grad_norm"], [1.0, NAN])), ValueError, ["spike_detector", "nan"]),
    Case("load-spike-str-window", _with_spikes(_set_in(["spike_detector", "windows", "loss"], ["1.0"])), TypeError, ["spike_detector", "'1.0'"]),
    Case("load-spike-negative-count", _with_spikes(_set_in(["spike_detector", "spikes"], -1)), ValueError, ["spike_detector", "spikes", "-1"]),
    Case("load-spike-not-dict", _with_spikes(_set_in(["spike_detector"], [1.0])), TypeError, ["spike_detector", "list"]),
    Case("load-spike-ok-inner-bad", _with_spikes(_nan_exp_avg), ValueError, ["exp_avg", "nan"]),
    # hyperparameters of the inner optimizer's groups (tpamp.hyperparameters)
    Case("load-group-lr-inf", _load(_set_in(["optimizer", "param_groups", 0, "lr"], math.inf)), ValueError, ["lr", "inf"]),
    Case("load-group-lr-str", _load(_set_in(["optimizer", "param_groups", 1, "lr"], "0.1")), TypeError, ["lr", "'0.1'"]),
    Case("load-group-eps-0", _load(_set_in(["optimizer", "param_groups", 1, "eps"], 0.0)), ValueError, ["eps", "0.0"]),
    Case("load-group-betas-1", _load(_set_in(["optimizer", "param_groups", 0, "betas"], (0.9, 1.0))), ValueError, ["betas", "1.0"]),
    Case("load-group-weight_decay-nan", _load(_set_in(["optimizer", "param_groups", 0, "weight_decay"], NAN)), ValueError, ["weight_decay", "nan"]),
    Case("load-group-amsgrad-int", _load(_set_in(["optimizer", "param_groups", 0, "amsgrad"], 1)), TypeError, ["amsgrad", "1"]),
    Case("step-lr-inf-set-later", _set_later(lr=math.inf), ValueError, ["lr", "inf"]),
    Case("step-lr-nan-set-later", _set_later(lr=NAN), ValueError, ["lr", "nan"]),
    Case("step-eps-0-set-later", _set_later(eps=0.0), ValueError, ["eps", "0.0"]),
    Case("step-betas-set-later", _set_later(betas=(1.0, 0.999)), ValueError, ["betas", "1.0"]),
    Case("wrap-adam-group-eps-0", _wrap_groups(eps=0.0), ValueError, ["eps", "0.0", "Adam"]),
    Case("wrap-adam-group-lr-inf", _wrap_groups(lr=math.inf), ValueError, ["lr", "inf"]),
    Case("wrap-sgd-group-momentum-nan", _wrap_groups(torch.optim.SGD, momentum=NAN), ValueError, ["momentum", "nan"]),
    Case("wrap-muon-group-momentum-1", _wrap_groups(torch.optim.Muon, momentum=1.0), ValueError, ["momentum", "1.0", "Muon"]),
    Case("wrap-muon-group-ns_coefficients", _wrap_groups(torch.optim.Muon, ns_coefficients=(1.0, 2.0)), ValueError, ["ns_coefficients", "3"]),
    # one detector, one optimizer
    Case("det-shared-two-mpo", _shared_detector("MixedPrecisionOptimizer"), ValueError, ["SpikeDetector", "MixedPrecisionOptimizer"]),
    Case("det-shared-mpo-fp32", _shared_detector("FP32Optimizer"), ValueError, ["SpikeDetector", "MixedPrecisionOptimizer"]),
    Case("det-wrong-type", _detector_wrong_type, TypeError, ["spike_detector", "dict"]),
    Case("det-sync-free", _detector_sync_free, ValueError, ["spike_detector", "sync_free"]),
]


def test_every_case_is_refused_by_tpamp_itself():
    """The innermost frame of each case's exception is in the tpamp package: tpamp refuses the
    input itself, rather than the case's own setup or torch further down. Ids are distinct
    across this file and tests/test_distributed_optimizer_guards.py."""
    import test_distributed_optimizer_guards as dist_cases

    other = [c[0] for c in dist_cases.DO_CASES + dist_cases.SETTINGS_CASES]
    assert_every_setup_case_refused_by_tpamp(CASES, other)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_misuse_is_refused_and_changes_nothing(case):
    assert_refused_and_unchanged(case)


# ---- behaviour that is not a refusal ---------------------------------------------------------


def test_the_guards_write_no_attribute_onto_the_wrapper_or_the_inner_optimizer():
    """The guards keep their state in tables of tpamp._guards: wrapping, stepping, zero_grad and
    a load add no attribute to the inner torch optimizer, and none named _tpamp_* to the
    wrapper; the guard still knows the inner optimizer is wrapped."""
    params = [torch.nn.Parameter(torch.linspace(-1, 1, 3).half())]
    inner = torch.optim.Adam(params, lr=0.1)
    before = set(vars(inner))
    opt = tpamp.MixedPrecisionOptimizer(inner, grad_scaler=tpamp.DynamicGradScaler(initial_scale=8.0))
    for _ in range(2):
        _backward(opt, params)
        opt.step()
        opt.zero_grad()
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    added = set(vars(inner)) - before
    assert added == set(), added
    assert [k for k in vars(opt) if k.startswith("_tpamp")] == []
    assert wrapped_by(inner) == "MixedPrecisionOptimizer"
    with pytest.raises(ValueError, match="already wrapped by a tpamp MixedPrecisionOptimizer"):
        tpamp.MixedPrecisionOptimizer(inner, grad_scaler=tpamp.ConstantGradScaler(2.0))


def test_the_guard_state_goes_with_the_objects_it_describes():
    import gc
    import weakref

    from tpamp import _guards

    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    inner = torch.optim.SGD([p], lr=0.1)
    opt = tpamp.MixedPrecisionOptimizer(inner, grad_scaler=tpamp.ConstantGradScaler(2.0))
    state = _guards.guard_state(opt)
    assert [[id(q) for q in g] for g in state.param_groups] == [[id(q) for q in g["params"]] for g in inner.param_groups]
    refs = (weakref.ref(opt), weakref.ref(inner))
    del opt, inner, state
    gc.collect()
    assert [r() for r in refs] == [None, None]  # the tables did not keep them alive
    fresh = torch.optim.SGD([p], lr=0.1)
    assert wrapped_by(fresh) is None


def test_settings_are_compared_again_after_a_load_and_not_after_zero_grad(monkeypatch):
    from tpamp import _guards

    calls = []
    real = _guards.agree_on_settings
    monkeypatch.setattr(_guards, "agree_on_settings", lambda w: (calls.append(1), real(w)))
    opt, params = _mpo(fused=False)
    for _ in range(2):
        _backward(opt, params)
        opt.step()
        opt.zero_grad()
    assert len(calls) == 1  # the first step only
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert not _guards.guard_state(opt).settings_agreed
    _backward(opt, params)
    opt.step()
    assert len(calls) == 2 and _guards.guard_state(opt).settings_agreed


def test_an_optimizer_class_without_hash_can_still_be_wrapped_once():
    class Unhashable(torch.optim.SGD):
        def __eq__(self, other):
            return self is other

        __hash__ = None

    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    inner = Unhashable([p], lr=0.1)
    opt = tpamp.MixedPrecisionOptimizer(inner, grad_scaler=tpamp.ConstantGradScaler(2.0))
    opt.scale_loss(p.float().sum()).backward()
    assert opt.step().update_successful
    with pytest.raises(ValueError, match="already wrapped"):
        tpamp.MixedPrecisionOptimizer(inner, grad_scaler=tpamp.ConstantGradScaler(2.0))


def test_a_step_after_zero_grad_or_a_new_backward_is_accepted():
    opt, params = _mpo(fused=False)
    _backward(opt, params)
    assert opt.step().update_successful
    _backward(opt, params)  # a new backward without zero_grad: new model grads
    assert opt.step().update_successful
    opt.zero_grad()
    opt.step()  # after zero_grad: no grads, no refusal (a rank without grads must still step)


def test_a_refused_step_can_be_retried_after_fixing_the_grad():
    opt, params = _mpo()
    params[0].main_grad = torch.full(params[0].shape, 8.0)
    params[1].main_grad = torch.ones(1)
    with pytest.raises(ValueError):
        opt.step()
    params[1].main_grad = torch.full(params[1].shape, 8.0)
    result = opt.step()
    assert result.update_successful and result.grad_norm == pytest.approx(math.sqrt(7.0))


def _spiking_run(policy, fused):
    det = tpamp.SpikeDetector(policy, threshold=3.0, window=4, warmup=2, watch=("grad_norm",))
    opt, params = _mpo(fused=fused, spike_detector=det)
    for _ in range(3):
        _backward(opt, params)
        opt.step()
        opt.zero_grad()
    _backward(opt, params, value=100.0)  # a grad-norm spike (finite in fp16 at scale 8..32)
    return opt, params, det


@pytest.mark.parametrize("fused", [True, False])
def test_spike_policy_raise_leaves_the_scaler_and_params_as_before_the_step(fused):
    opt, params, det = _spiking_run("raise", fused)
    scaler = copy.deepcopy(opt.grad_scaler.state_dict())
    models = [p.detach().clone() for p in params]
    inner = copy.deepcopy(opt.optimizer.state_dict())
    with pytest.raises(GradSpikeError):
        opt.step()
    assert freeze(opt.grad_scaler.state_dict()) == freeze(scaler)  # no growth-tracker tick
    assert all(torch.equal(a, b) for a, b in zip(models, params))
    assert freeze(opt.optimizer.state_dict()) == freeze(inner)
    assert det.spikes == 1 and det.spike_skips == 0
    # its grads are consumed: a retry without a new backward is refused like a second step
    with pytest.raises(RuntimeError, match="backward"):
        opt.step()


def test_spike_policy_skip_and_raise_leave_the_same_scaler():
    a, _, _ = _spiking_run("skip", True)
    b, _, _ = _spiking_run("raise", True)
    assert not a.step().update_successful
    with pytest.raises(GradSpikeError):
        b.step()
    assert freeze(a.grad_scaler.state_dict()) == freeze(b.grad_scaler.state_dict())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_step_paths_count_zeros_on_the_raw_grads(dtype):
    """A grad element of 2**-130 is not zero, but 2**-130 / 2**20 underflows to 0 in float32:
    both paths count the raw grads, so it is not a zero on either; the exact zeros (counted
    by hand here) are."""
    raw = torch.tensor([0.0, 2.0**-130, 1.0, 0.0, -2.0**-130, 3.0])
    expected = int((raw == 0).sum())  # 2
    assert float(raw[1].to(dtype)) != 0.0 and float(raw[1] * 2.0**-20) == 0.0
    counts = []
    for fused in (True, False):
        p = torch.nn.Parameter(torch.zeros(6, dtype=dtype))
        opt = tpamp.MixedPrecisionOptimizer(
            torch.optim.SGD([p], lr=0.0), grad_scaler=tpamp.ConstantGradScaler(2.0**20),
            log_num_zeros_in_grad=True, fused_step=fused)
        p.main_grad = raw.clone()
        counts.append(opt.step().num_zeros_in_grad)
    assert counts == [expected, expected]


def test_a_bad_gradient_is_named_by_its_dtype_index_and_group():
    """The step guard's message names the gradient as "<dtype> param <i> of param group <g>"
    (fp16/bf16 params) or "fp32 param <i> of param group <g>", a plain str."""
    half = [torch.nn.Parameter(torch.ones(4).half()) for _ in range(2)]
    full = torch.nn.Parameter(torch.ones(3))
    opt = tpamp.MixedPrecisionOptimizer(
        torch.optim.AdamW([{"params": [half[0]]}, {"params": [half[1], full]}], lr=1e-3),
        grad_scaler=tpamp.DynamicGradScaler(initial_scale=8.0))
    half[0].main_grad = torch.ones(4)
    half[1].main_grad = torch.ones(5)  # torch refuses a .grad of the wrong shape
    full.main_grad = torch.ones(3)
    with pytest.raises(ValueError, match=r"the gradient of torch\.float16 param 0 of param group 1 "
                                         r"has shape \(5,\)"):
        opt.step()
    half[1].main_grad = torch.ones(4)
    full.main_grad = torch.ones(3).half()
    with pytest.raises(TypeError, match="the gradient of fp32 param 0 of param group 1 has dtype "
                                        "torch.float16"):
        opt.step()
    names = [name for name, _, _ in opt.grad_sources()]
    assert names == ["torch.float16 param 0 of param group 0",
                     "torch.float16 param 0 of param group 1", "fp32 param 0 of param group 1"]
    assert all(type(name) is str for name in names)
