"""Spike detection and skipping (tpamp/spikes.py, docs/spec.md section 6)."""

import copy
import math

import pytest
import torch
from dist_utils import freeze, run_workers
from misuse_utils import DROP, Case, assert_every_setup_case_refused_by_tpamp, assert_refused_and_unchanged
from model_fixture import full_grads, round_to, shard_params

import tpamp
from tpamp.parallel import initialize_model_parallel


def _detector(**kw):
    kw.setdefault("grad_norm_min_rel_std", 0.0)
    return tpamp.SpikeDetector("log", threshold=3.0, window=4, warmup=4, watch=("grad_norm",), **kw)


def test_hand_worked_trace_of_the_window_statistics():
    d = _detector()
    for x in (1.0, 2.0, 1.0):  # warm-up: no z-score, no decision, however large
        assert d.decide(x, None).z_grad_norm is None
    assert d.decide(2.0, None).z_grad_norm is None  # the 4th value completes the warm-up
    # window [1, 2, 1, 2]: mean 1.5, population std 0.5; limit 1.5 + 3 * 0.5 = 3.0
    ok = d.decide(2.9, None)  # z = 1.4 / 0.5 = 2.8; enters the window: [2, 1, 2, 2.9]
    assert not ok.spike and math.isclose(ok.z_grad_norm, 2.8)
    # window [2, 1, 2, 2.9]: mean 1.975, var (0.000625 + 0.950625 + 0.000625 + 0.855625) / 4
    mean, std = 1.975, math.sqrt((0.025**2 + 0.975**2 + 0.025**2 + 0.925**2) / 4)
    spike = d.decide(10.0, None)
    assert spike.spike and not spike.skipped  # policy "log"
    assert math.isclose(spike.z_grad_norm, (10.0 - mean) / std)
    # the spike enters clipped to the limit mean + 3 std: window [1, 2, 2.9, limit]
    limit = mean + 3 * std
    w = [1.0, 2.0, 2.9, limit]
    m = sum(w) / 4
    s = math.sqrt(sum((v - m) ** 2 for v in w) / 4)
    assert math.isclose(d.decide(2.0, None).z_grad_norm, (2.0 - m) / s)
    assert (d.spikes, d.spike_skips, d.steps_seen) == (1, 0, 7)


def test_relative_std_floor_and_downward_moves():
    d = _detector(grad_norm_min_rel_std=0.05)
    for _ in range(4):
        d.decide(1.0, None)  # std 0: the floor 0.05 * 1.0 is used
    assert math.isclose(d.decide(1.1, None).z_grad_norm, 2.0)  # 0.1 / 0.05: no spike
    d = _detector(grad_norm_min_rel_std=0.05)
    for _ in range(4):
        d.decide(1.0, None)
    assert d.decide(1.2, None).spike  # z 4 > 3
    assert not d.decide(0.01, None).spike  # only upward excursions count


def test_overflow_steps_and_non_finite_values_are_not_judged():
    d = _detector()
    assert d.decide(None, None, overflow=True).overflow
    for x in (1.0, 2.0, 1.0, 2.0):
        d.decide(x, None)
    d.decide(math.nan, None)  # not added to the window
    assert math.isclose(d.decide(2.9, None).z_grad_norm, 2.8)
    assert d.steps_seen == 6


def test_raise_policy_and_bad_settings():
    d = tpamp.SpikeDetector("raise", threshold=3.0, window=4, warmup=4, grad_norm_min_rel_std=0.0)
    for x in (1.0, 2.0, 1.0, 2.0):
        d.decide(x, 2.0)
    with pytest.raises(tpamp.GradSpikeError, match="grad norm 10.0"):
        d.decide(10.0, 2.0)
    with pytest.raises(ValueError, match="policy must be one of"):
        tpamp.SpikeDetector("ignore")
    with pytest.raises(ValueError, match="warmup \\(30\\) must be <= window \\(10\\)"):
        tpamp.SpikeDetector(window=10, warmup=30)
    with pytest.raises(ValueError, match="threshold must be > 0.0, got -1"):
        tpamp.SpikeDetector(threshold=-1)
    with pytest.raises(ValueError, match="watch must be a non-empty subset"):
        tpamp.SpikeDetector(watch=("lr",))
    with pytest.raises(ValueError, match="cannot be used with sync_free"):
        p = torch.nn.Parameter(torch.ones(2))
        tpamp.FP32Optimizer(
            torch.optim.AdamW([p], fused=True), sync_free=True, spike_detector=tpamp.SpikeDetector()
        )


# ----------------------------------------------------------------------------- in the optimizer


def _grads_for_step(k: int, spike_steps, factor: float = 100.0) -> float:
    """A small deterministic wobble around 1, times ``factor`` on the spike steps."""
    return (1.0 + 0.05 * ((k * 7) % 5)) * (factor if k in spike_steps else 1.0)


def _train(st, steps, grad_spikes, loss_spikes, policy):
    """TP2 x PP2 fixture model in fp16: the grads of step k are the fixture's times
    _grads_for_step(k); the last stage reports a loss of 2.0 + 0.01 k (times 50 on
    loss_spikes). Returns, per step, what every rank must agree on."""
    base = round_to(full_grads(seed=5), torch.float16)
    params = shard_params(st, base, style="megatron", dtype=torch.float16)
    refs = {name: p.grad.detach().float().clone() for name, p in params.items()}
    scaler = tpamp.DynamicGradScaler(initial_scale=1.0, growth_interval=1)  # grows each clean step
    detector = tpamp.SpikeDetector(policy, window=10, warmup=5)
    opt = tpamp.MixedPrecisionOptimizer(
        torch.optim.AdamW(list(params.values()), lr=1e-3),
        grad_scaler=scaler, spike_detector=detector,
        grad_stats_group=st.model_parallel_group, tensor_parallel_group=st.tp_group,
    )
    out = []
    for k in range(steps):
        scale = float(scaler.scale)
        for name, p in params.items():
            p.grad = (refs[name] * _grads_for_step(k, grad_spikes) * scale).half()
        before = [p.detach().clone() for p in params.values()]
        counts_before = [float(s["step"]) for s in opt.state.values()]
        if st.is_last_stage:
            detector.observe_loss(torch.tensor(2.0 * (50.0 if k in loss_spikes else 1.0) + 0.01 * k))
        result = opt.step()
        changed = [not torch.equal(b, p) for b, p in zip(before, params.values())]
        out.append({
            "ok": result.update_successful, "spike": detector.last.spike,
            "spike_skipped": detector.last.skipped, "params_changed": any(changed),
            "all_params_changed": all(changed),
            "step_counts_kept": [float(s["step"]) for s in opt.state.values()] == counts_before
            and len(opt.state) == len(counts_before),
            "scale_before": scale, "scale_after": float(scaler.scale),
            "growth_tracker": scaler.growth_tracker,
        })
        opt.zero_grad()
    return out, detector.spike_skips


GRAD_SPIKE, LOSS_SPIKE = 6, 8


def _runs(rank, world):
    st = initialize_model_parallel(2, 2)
    injected = _train(st, 10, (GRAD_SPIKE,), (LOSS_SPIKE,), "skip")
    normal = _train(st, 12, (), (), "skip")
    return injected, normal


@pytest.fixture(scope="module")
def four_rank_runs():
    """Per rank: (injected run, normal run) on TP2 x PP2, forked once for both."""
    return run_workers(_runs, 4, timeout=60)


def test_injected_spikes_are_skipped_on_all_four_ranks_and_leave_everything_unchanged(four_rank_runs):
    grad_spike, loss_spike = GRAD_SPIKE, LOSS_SPIKE
    results = [injected for injected, _ in four_rank_runs]
    first, skips = results[0]
    assert all(r == results[0] for r in results), "the ranks decided differently"
    assert skips == 2
    for k, rec in enumerate(first):
        if k in (grad_spike, loss_spike):  # a grad-norm spike, and a loss spike seen only on
            # the last stage: skipped everywhere; params, AdamW state and step counts, loss
            # scale and its trackers as before the step (growth_interval=1 would have grown it)
            assert rec["spike"] and rec["spike_skipped"] and not rec["ok"], (k, rec)
            assert not rec["params_changed"] and rec["step_counts_kept"], (k, rec)
            assert rec["scale_after"] == rec["scale_before"], (k, rec)
            assert rec["growth_tracker"] == 0, (k, rec)
        else:
            assert rec["ok"] and not rec["spike"] and rec["all_params_changed"], (k, rec)
            assert rec["scale_after"] == 2 * rec["scale_before"], (k, rec)


def test_a_normal_run_is_not_touched(four_rank_runs):
    for _, (out, skips) in four_rank_runs:
        assert skips == 0
        assert all(rec["ok"] and not rec["spike"] for rec in out)


def _resume_run(steps, resume_at, spikes):
    """Single process: an fp32 model whose grad norms follow _grads_for_step; optionally saved
    and restored into a fresh optimizer + detector at step resume_at."""

    def build():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        det = tpamp.SpikeDetector("skip", window=6, warmup=3)
        opt = tpamp.FP32Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), spike_detector=det)
        return model, opt, det

    model, opt, det = build()
    decisions = []
    for k in range(steps):
        if k == resume_at:
            state = copy.deepcopy(opt.state_dict())
            weights = copy.deepcopy(model.state_dict())
            model, opt, det = build()
            model.load_state_dict(weights)
            opt.load_state_dict(state)
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.1 * _grads_for_step(k, spikes))
        det.observe_loss(1.0)
        opt.step()
        opt.zero_grad()
        decisions.append((det.last.spike, det.last.skipped, det.last.z_grad_norm))
    return decisions, [p.detach().clone() for p in model.parameters()]


def test_detector_state_is_in_the_optimizer_state_dict_and_a_resumed_run_decides_identically():
    plain, w_plain = _resume_run(12, None, (9,))
    resumed, w_resumed = _resume_run(12, 5, (9,))
    assert plain == resumed and plain[9][:2] == (True, True)
    assert all(torch.equal(a, b) for a, b in zip(w_plain, w_resumed))
    p = torch.nn.Parameter(torch.ones(2))
    sd = tpamp.FP32Optimizer(torch.optim.SGD([p], lr=1.0), spike_detector=tpamp.SpikeDetector()).state_dict()
    assert {"optimizer", "grad_scaler", "fp32_from_fp16_params", "spike_detector"} <= set(sd)


def test_snapshot_scaler_and_restore_scaler_go_through_the_scaler_protocol():
    s = tpamp.DynamicGradScaler(initial_scale=8.0, growth_interval=2, hysteresis=1)
    snap = tpamp.SpikeDetector.snapshot_scaler(s)
    assert isinstance(snap, tpamp.ScalerSnapshot)
    s.update(False)
    s.update(False)  # grows to 16, tracker back to 0
    s.update(False)
    assert (s.scale.item(), s.growth_tracker) == (16.0, 1)
    tpamp.SpikeDetector.restore_scaler(s, snap)
    assert (s.scale.item(), s.growth_tracker, s.hysteresis_tracker) == (8.0, 0, 1)
    assert tpamp.SpikeDetector.snapshot_scaler(None) is None
    tpamp.SpikeDetector.restore_scaler(None, None)  # nothing to restore


# ---- SpikeDetector.load_state_dict misuse: refused, and the detector unchanged (docs/spec.md section 2.4);
# runner: tests/misuse_utils.py ---------------------------------------------------------------


NAN, INF = math.nan, math.inf


def _watch_detector(det):
    return lambda: {"detector": freeze(det.state_dict())}


def _spike_state(**edits):
    d = tpamp.SpikeDetector("skip", window=4, warmup=2)
    sd = {"windows": {"grad_norm": [1.0, 2.0], "loss": [3.0]}, "steps_seen": 3, "spikes": 1,
          "spike_skips": 1, "settings": d.state_dict()["settings"]}
    for k, v in edits.items():
        if v is DROP:
            del sd[k]
        else:
            sd[k] = v
    return sd


def _detector_load(**edits):
    def setup():
        det = tpamp.SpikeDetector("skip", window=4, warmup=2)
        det.load_state_dict(_spike_state())  # something to lose
        bad = _spike_state(**edits)
        return _watch_detector(det), lambda: det.load_state_dict(bad)
    return setup


def _detector_load_value(value):
    def setup():
        det = tpamp.SpikeDetector("skip", window=4, warmup=2)
        return _watch_detector(det), lambda: det.load_state_dict(value)
    return setup


SPIKE_LOAD_CASES = [
    # SpikeDetector.load_state_dict: validated, all or nothing
    Case("det-load-None", _detector_load_value(None), TypeError, ["dict", "None"]),
    Case("det-load-list", _detector_load_value([1, 2]), TypeError, ["dict", "list"]),
    Case("det-window-nan", _detector_load(windows={"grad_norm": [1.0, NAN]}), ValueError, ["windows", "grad_norm", "nan"]),
    Case("det-window-inf", _detector_load(windows={"loss": [INF]}), ValueError, ["windows", "loss", "inf"]),
    Case("det-window-str-value", _detector_load(windows={"loss": [1.0, "2"]}), TypeError, ["windows", "loss", "'2'"]),
    Case("det-window-bool-value", _detector_load(windows={"loss": [True]}), TypeError, ["windows", "True"]),
    Case("det-window-str", _detector_load(windows={"loss": "1.0"}), TypeError, ["windows", "loss", "str"]),
    Case("det-window-tensor", _detector_load(windows={"loss": torch.ones(2)}), TypeError, ["windows", "loss", "Tensor"]),
    Case("det-windows-list", _detector_load(windows=[[1.0]]), TypeError, ["windows", "list"]),
    Case("det-window-unknown-series", _detector_load(windows={"lr": [1.0]}), ValueError, ["series", "'lr'"]),
    Case("det-window-too-long", _detector_load(windows={"loss": [1.0] * 5}), ValueError, ["5", "window"]),
    Case("det-steps-negative", _detector_load(steps_seen=-3), ValueError, ["steps_seen", "-3"]),
    Case("det-steps-float", _detector_load(steps_seen=2.5), TypeError, ["steps_seen", "2.5"]),
    Case("det-steps-str", _detector_load(steps_seen="3"), TypeError, ["steps_seen", "'3'"]),
    Case("det-skips-bool", _detector_load(spike_skips=True), TypeError, ["spike_skips", "True"]),
    Case("det-spikes-above-steps", _detector_load(spikes=9), ValueError, ["spikes", "steps_seen", "9"]),
    Case("det-skips-above-spikes", _detector_load(spike_skips=2), ValueError, ["spike_skips", "spikes", "2"]),
    Case("det-missing-windows", _detector_load(windows=DROP), KeyError, ["windows"]),
    Case("det-missing-spikes", _detector_load(spikes=DROP), KeyError, ["spikes"]),
    Case("det-settings-differ", _detector_load(settings={**_spike_state()["settings"], "window": 8}), ValueError, ["settings", "differ"]),
    Case("det-settings-str", _detector_load(settings="window=4"), TypeError, ["settings"]),
]


def test_every_case_is_refused_by_tpamp_itself():
    """Ids distinct; each case refused inside tpamp itself (tests/misuse_utils.py)."""
    assert_every_setup_case_refused_by_tpamp(SPIKE_LOAD_CASES)


@pytest.mark.parametrize("case", SPIKE_LOAD_CASES, ids=[c.id for c in SPIKE_LOAD_CASES])
def test_misuse_is_refused_and_changes_nothing(case):
    assert_refused_and_unchanged(case)
