"""Specification tests for tpamp's loss scalers (docs/spec.md section 1).

Expected values come from hand-worked traces of the rules of docs/spec.md section 1 (written out step by step below)
or from ``RefScaler``, a small pure-Python model of those rules written here, never from tpamp.
"""

from __future__ import annotations

import math
import random
import re
import struct
import warnings

import pytest
import torch
from misuse_utils import DROP, assert_every_case_refused_by_tpamp, assert_raises_naming, case_ids

import tpamp
from tpamp import ConstantGradScaler, DynamicGradScaler, LossScaleUnderflowError

# --------------------------------------------------------------------------------------------
# helpers


def f32(x: float) -> float:
    """Round a Python float to the nearest float32 (pure Python)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def as_flag(found_inf: bool, kind: str):
    if kind == "bool":
        return found_inf
    if kind == "tensor":
        return torch.tensor([1.0 if found_inf else 0.0], dtype=torch.float32)
    raise AssertionError(kind)


def state(scaler):
    """(scale as a Python float, growth_tracker, hysteresis_tracker)."""
    return (float(scaler.scale.reshape(-1)[0]), scaler.growth_tracker, scaler.hysteresis_tracker)


def run_trace(scaler, trace, kind="tensor"):
    """trace: list of (found_inf, expected scale, expected growth_tracker, expected hysteresis)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # overflow-at-min-scale warnings are tested separately
        for step, (inf, scale, growth, hyst) in enumerate(trace, 1):
            scaler.update(as_flag(inf, kind))
            assert state(scaler) == (scale, growth, hyst), (
                f"after step {step} (found_inf={inf}): got (scale, growth, hysteresis) = "
                f"{state(scaler)}, expected {(scale, growth, hyst)}"
            )


INF, OK = True, False
KINDS = ["bool", "tensor"]


# --------------------------------------------------------------------------------------------
# hand-worked traces


# docs/spec.md section 1 worked trace: hysteresis=2, growth_interval=3, initial 8, min 1.
SPEC_TRACE = [
    (INF, 8.0, 0, 1),
    (INF, 4.0, 0, 0),
    (INF, 2.0, 0, -1),
    (OK, 2.0, 1, -1),
    (OK, 2.0, 2, -1),
    (INF, 1.0, 0, -2),
    (OK, 1.0, 1, -2),
    (OK, 1.0, 2, -2),
    (OK, 2.0, 0, 2),
]


@pytest.mark.parametrize("kind", KINDS)
def test_spec_worked_trace_scale_and_trackers_after_every_update(kind):
    s = DynamicGradScaler(initial_scale=8.0, min_scale=1.0, growth_interval=3, hysteresis=2)
    assert state(s) == (8.0, 0, 2)
    run_trace(s, SPEC_TRACE, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_hysteresis_is_refilled_only_at_growth_not_by_clean_steps(kind):
    s = DynamicGradScaler(initial_scale=16.0, min_scale=1.0, growth_interval=4, hysteresis=2)
    run_trace(
        s,
        [
            (INF, 16.0, 0, 1),  # first overflow is absorbed by hysteresis
            (OK, 16.0, 1, 1),  # clean steps do not refill it
            (OK, 16.0, 2, 1),
            (INF, 8.0, 0, 0),  # second overflow since the last growth backs off at once
            (OK, 8.0, 1, 0),
            (OK, 8.0, 2, 0),
            (OK, 8.0, 3, 0),
            (OK, 16.0, 0, 2),  # growth refills hysteresis
            (INF, 16.0, 0, 1),  # ... so the next overflow is absorbed again
            (INF, 8.0, 0, 0),
            (INF, 4.0, 0, -1),
        ],
        kind,
    )


@pytest.mark.parametrize("kind", KINDS)
def test_consecutive_hysteresis_clean_step_refills_hysteresis(kind):
    s = DynamicGradScaler(
        initial_scale=16.0, min_scale=1.0, growth_interval=4, hysteresis=2,
        consecutive_hysteresis=True,
    )
    run_trace(
        s,
        [
            (INF, 16.0, 0, 1),
            (OK, 16.0, 1, 2),  # refilled by a clean step
            (OK, 16.0, 2, 2),
            (INF, 16.0, 0, 1),  # absorbed again (the default mode would back off here)
            (INF, 8.0, 0, 0),  # two consecutive overflows back off
            (INF, 4.0, 0, -1),
            (OK, 4.0, 1, 2),
            (INF, 4.0, 0, 1),
            (OK, 4.0, 1, 2),
            (OK, 4.0, 2, 2),
            (OK, 4.0, 3, 2),
            (OK, 8.0, 0, 2),
        ],
        kind,
    )


@pytest.mark.parametrize("kind", KINDS)
def test_hysteresis_one_backs_off_on_every_overflow(kind):
    s = DynamicGradScaler(initial_scale=64.0, min_scale=1.0, growth_interval=2, hysteresis=1)
    run_trace(
        s,
        [
            (INF, 32.0, 0, 0),
            (INF, 16.0, 0, -1),
            (OK, 16.0, 1, -1),
            (INF, 8.0, 0, -2),
            (OK, 8.0, 1, -2),
            (OK, 16.0, 0, 1),
            (INF, 8.0, 0, 0),
        ],
        kind,
    )


@pytest.mark.parametrize("kind", KINDS)
def test_hysteresis_three_absorbs_two_overflows(kind):
    s = DynamicGradScaler(initial_scale=32.0, min_scale=1.0, growth_interval=10, hysteresis=3)
    run_trace(
        s,
        [(INF, 32.0, 0, 2), (INF, 32.0, 0, 1), (INF, 16.0, 0, 0), (INF, 8.0, 0, -1)],
        kind,
    )


@pytest.mark.parametrize("kind", KINDS)
def test_backoff_is_clamped_to_min_scale(kind):
    # 8 -> 4 -> 3 (not 2) -> 3: min_scale need not be a power of the backoff factor
    s = DynamicGradScaler(initial_scale=8.0, min_scale=3.0, growth_interval=100, hysteresis=1)
    run_trace(s, [(INF, 4.0, 0, 0), (INF, 3.0, 0, -1), (INF, 3.0, 0, -2), (INF, 3.0, 0, -3)], kind)


@pytest.mark.parametrize("kind", KINDS)
def test_backoff_with_min_equal_to_initial_never_moves_below(kind):
    s = DynamicGradScaler(initial_scale=5.0, min_scale=5.0, growth_interval=2, hysteresis=1)
    run_trace(s, [(INF, 5.0, 0, 0), (OK, 5.0, 1, 0), (OK, 10.0, 0, 1), (INF, 5.0, 0, 0)], kind)


@pytest.mark.parametrize("kind", KINDS)
def test_growth_every_growth_interval_clean_steps(kind):
    s = DynamicGradScaler(initial_scale=2.0, min_scale=1.0, growth_interval=2, hysteresis=2)
    run_trace(
        s,
        [
            (OK, 2.0, 1, 2),
            (OK, 4.0, 0, 2),
            (OK, 4.0, 1, 2),
            (OK, 8.0, 0, 2),
            (INF, 8.0, 0, 1),  # resets the growth count
            (OK, 8.0, 1, 1),
            (OK, 16.0, 0, 2),
        ],
        kind,
    )


@pytest.mark.parametrize("kind", KINDS)
def test_overflow_resets_growth_count(kind):
    s = DynamicGradScaler(initial_scale=4.0, min_scale=1.0, growth_interval=3, hysteresis=5)
    run_trace(
        s,
        [(OK, 4.0, 1, 5), (OK, 4.0, 2, 5), (INF, 4.0, 0, 4), (OK, 4.0, 1, 4), (OK, 4.0, 2, 4),
         (OK, 8.0, 0, 5)],
        kind,
    )


@pytest.mark.parametrize("kind", KINDS)
def test_growth_factor_and_backoff_factor_are_used(kind):
    s = DynamicGradScaler(
        initial_scale=1.0, min_scale=0.25, growth_factor=3.0, backoff_factor=0.25,
        growth_interval=1, hysteresis=1,
    )
    run_trace(
        s,
        [(OK, 3.0, 0, 1), (OK, 9.0, 0, 1), (OK, 27.0, 0, 1), (INF, 6.75, 0, 0), (INF, 1.6875, 0, -1),
         (INF, 0.421875, 0, -2), (INF, 0.25, 0, -3)],
        kind,
    )


@pytest.mark.parametrize("kind", KINDS)
def test_growth_is_clamped_to_max_scale(kind):
    s = DynamicGradScaler(
        initial_scale=4.0, min_scale=1.0, growth_interval=1, hysteresis=1, max_scale=10.0
    )
    run_trace(
        s,
        [(OK, 8.0, 0, 1), (OK, 10.0, 0, 1), (OK, 10.0, 0, 1), (INF, 5.0, 0, 0), (OK, 10.0, 0, 1)],
        kind,
    )


def test_initial_state_is_scale_zero_growth_and_full_hysteresis():
    s = DynamicGradScaler(initial_scale=1024.0, hysteresis=7)
    assert state(s) == (1024.0, 0, 7)
    assert s.scale.dtype == torch.float32
    assert tuple(s.scale.shape) == (1,)
    assert s.scale.device.type == "cpu"


def test_defaults_are_megatron_defaults():
    s = DynamicGradScaler()
    assert state(s) == (2.0**32, 0, 2)
    # growth_interval=1000: 999 clean steps do not grow, the 1000th does (x2)
    for _ in range(999):
        s.update(torch.zeros(1))
    assert state(s) == (2.0**32, 999, 2)
    s.update(torch.zeros(1))
    assert state(s) == (2.0**33, 0, 2)
    # backoff 0.5 after hysteresis 2
    s.update(torch.ones(1))
    s.update(torch.ones(1))
    assert state(s) == (2.0**32, 0, 0)


# --------------------------------------------------------------------------------------------
# randomized comparison against an independent pure-Python model of the rules of docs/spec.md section 1


class RefScaler:
    """docs/spec.md section 1 rules, in plain Python (scale rounded to float32 after each change)."""

    def __init__(self, initial_scale, min_scale, growth_factor, backoff_factor, growth_interval,
                 hysteresis, max_scale=None, consecutive_hysteresis=False):
        self.scale = f32(initial_scale)
        self.min_scale = min_scale
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.max_scale = max_scale
        self.consecutive = consecutive_hysteresis
        self.growth_tracker = 0
        self.hysteresis_tracker = hysteresis

    def update(self, found_inf: bool):
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(f32(self.scale * self.backoff_factor), self.min_scale)
        else:
            self.growth_tracker += 1
            if self.consecutive:
                self.hysteresis_tracker = self.hysteresis
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale = f32(self.scale * self.growth_factor)
                if self.max_scale is not None:
                    self.scale = min(self.scale, self.max_scale)

    def state(self):
        return (self.scale, self.growth_tracker, self.hysteresis_tracker)


# factors and bounds are exact float32 numbers, so float32 rounding is the only rounding
COMBOS = [
    dict(initial_scale=2.0**16, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5,
         growth_interval=3, hysteresis=2),
    dict(initial_scale=8.0, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5,
         growth_interval=2, hysteresis=1),
    dict(initial_scale=1024.0, min_scale=0.25, growth_factor=1.5, backoff_factor=0.75,
         growth_interval=4, hysteresis=3, consecutive_hysteresis=True),
    dict(initial_scale=4.0, min_scale=4.0, growth_factor=2.0, backoff_factor=0.5,
         growth_interval=2, hysteresis=2, max_scale=64.0),
    dict(initial_scale=100.0, min_scale=3.0, growth_factor=3.0, backoff_factor=0.25,
         growth_interval=5, hysteresis=2, max_scale=2000.0),
    dict(initial_scale=2.0**20, min_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5,
         growth_interval=1, hysteresis=4, max_scale=2.0**24, consecutive_hysteresis=True),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("combo", range(len(COMBOS)))
def test_random_sequences_match_reference_model(combo, kind):
    opts = COMBOS[combo]
    rng = random.Random(1234 + combo)
    s = DynamicGradScaler(**opts)
    ref = RefScaler(**opts)
    assert state(s) == ref.state()
    p = 0.3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(200):
            if step % 25 == 0:  # phases of rare and frequent overflows
                p = rng.choice([0.05, 0.2, 0.5, 0.8])
            inf = rng.random() < p
            s.update(as_flag(inf, kind))
            ref.update(inf)
            assert state(s) == ref.state(), f"combo {opts}, step {step} (found_inf={inf})"


# --------------------------------------------------------------------------------------------
# found_inf forms, no host read, inv_scale


FLAG_FORMS = {
    "bool": lambda v: bool(v),
    "float32 0-dim": lambda v: torch.tensor(float(v)),
    "float32 [1]": lambda v: torch.tensor([float(v)]),
    "float16 [1]": lambda v: torch.tensor([float(v)], dtype=torch.float16),
    "bool 0-dim": lambda v: torch.tensor(bool(v)),
    "bool [1]": lambda v: torch.tensor([bool(v)]),
    "float32 [1,1]": lambda v: torch.tensor([[float(v)]]),
}


@pytest.mark.parametrize("form", list(FLAG_FORMS))
def test_found_inf_forms_give_the_spec_trace(form):
    make = FLAG_FORMS[form]
    s = DynamicGradScaler(initial_scale=8.0, min_scale=1.0, growth_interval=3, hysteresis=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step, (inf, scale, growth, hyst) in enumerate(SPEC_TRACE, 1):
            s.update(make(inf))
            assert state(s) == (scale, growth, hyst), f"{form}: step {step}"


def test_tensor_found_inf_is_not_read_on_the_host(monkeypatch):
    s = DynamicGradScaler(initial_scale=8.0, min_scale=1.0, growth_interval=3, hysteresis=2)
    flags = [torch.tensor([1.0 if inf else 0.0]) for inf, *_ in SPEC_TRACE]

    def no_host_read(*args, **kwargs):
        raise AssertionError("update(tensor) read a tensor on the host")

    for name in ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, no_host_read)
    # the same trace, fed as tensors on the host-read-forbidding path (rounds 1..9)
    for f in flags:
        s.update(f)
    monkeypatch.undo()
    assert state(s) == (2.0, 0, 2)


@pytest.mark.parametrize("initial", [8.0, 3.0, 7.0, 1000.0, 2.0**32, 0.1, 12345.678])
def test_inv_scale_is_float32_of_float64_reciprocal(initial):
    s = DynamicGradScaler(initial_scale=initial, min_scale=min(initial, 1.0))
    expected = f32(1.0 / f32(initial))  # reciprocal of the float32 scale, taken in float64
    inv = s.inv_scale
    assert inv.dtype == torch.float32
    assert inv.numel() == 1
    assert float(inv.reshape(-1)[0]) == expected


def test_inv_scale_follows_scale_changes():
    s = DynamicGradScaler(initial_scale=12.0, min_scale=1.0, growth_interval=1, hysteresis=1,
                          growth_factor=1.5)
    s.update(False)  # 18
    assert float(s.inv_scale.reshape(-1)[0]) == f32(1.0 / 18.0)
    s.update(True)  # 9
    assert float(s.inv_scale.reshape(-1)[0]) == f32(1.0 / 9.0)


# --------------------------------------------------------------------------------------------
# overflow at min_scale: warn once (default) or raise


def test_raise_at_min_scale_raises_on_overflow_at_min_scale():
    s = DynamicGradScaler(initial_scale=4.0, min_scale=1.0, growth_interval=10, hysteresis=1,
                          raise_at_min_scale=True)
    s.update(True)  # 4 -> 2: not at min, no error
    s.update(True)  # 2 -> 1: the overflow happened at scale 2, no error
    assert state(s)[0] == 1.0
    with pytest.raises(LossScaleUnderflowError):
        s.update(True)  # overflow while scale == min_scale


def test_raise_at_min_scale_with_hysteresis_left_still_raises_at_min():
    # docs/spec.md section 1: "An overflow while scale == min_scale ... raise_at_min_scale=True raises"
    s = DynamicGradScaler(initial_scale=2.0, min_scale=2.0, growth_interval=10, hysteresis=3,
                          raise_at_min_scale=True)
    with pytest.raises(LossScaleUnderflowError):
        s.update(True)


def test_loss_scale_underflow_error_is_exported():
    assert tpamp.LossScaleUnderflowError is LossScaleUnderflowError
    assert issubclass(LossScaleUnderflowError, Exception)


def test_clean_steps_at_min_scale_never_raise():
    s = DynamicGradScaler(initial_scale=1.0, min_scale=1.0, growth_interval=1000, hysteresis=1,
                          raise_at_min_scale=True)
    for _ in range(5):
        s.update(False)
    assert state(s) == (1.0, 5, 1)


def test_default_mode_warns_once_on_overflow_at_min_scale_and_keeps_skipping():
    s = DynamicGradScaler(initial_scale=2.0, min_scale=1.0, growth_interval=10, hysteresis=1)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        s.update(True)  # 2 -> 1: not an overflow at min
    assert rec == []
    with pytest.warns(Warning):
        s.update(True)  # at min: warns
    assert state(s) == (1.0, 0, -1)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        s.update(True)  # at min again: no second warning
        s.update(True)
    assert rec == [], [str(w.message) for w in rec]
    assert state(s) == (1.0, 0, -3)


# --------------------------------------------------------------------------------------------
# state_dict


def test_state_dict_has_megatron_keys_and_types():
    s = DynamicGradScaler(initial_scale=8.0, min_scale=1.0, growth_interval=3, hysteresis=2)
    run_trace(s, SPEC_TRACE[:5])  # scale 2, growth 2, hysteresis -1
    sd = s.state_dict()
    assert {"scale", "growth_tracker", "hysteresis_tracker"} <= set(sd)
    assert isinstance(sd["scale"], torch.Tensor)
    assert sd["scale"].dtype == torch.float32
    assert sd["scale"].numel() == 1
    assert sd["scale"].device.type == "cpu"
    assert float(sd["scale"].reshape(-1)[0]) == 2.0
    assert type(sd["growth_tracker"]) is int and sd["growth_tracker"] == 2
    assert type(sd["hysteresis_tracker"]) is int and sd["hysteresis_tracker"] == -1


def test_state_dict_is_a_snapshot_not_a_view():
    s = DynamicGradScaler(initial_scale=8.0, min_scale=1.0, growth_interval=1, hysteresis=1)
    sd = s.state_dict()
    s.update(False)
    assert float(sd["scale"].reshape(-1)[0]) == 8.0


def test_state_dict_round_trip_continues_identically():
    opts = dict(initial_scale=8.0, min_scale=1.0, growth_interval=3, hysteresis=2)
    a = DynamicGradScaler(**opts)
    run_trace(a, SPEC_TRACE[:5])
    b = DynamicGradScaler(**opts)
    b.load_state_dict(a.state_dict())
    assert state(b) == state(a) == (2.0, 2, -1)
    # both continue with the rest of the worked trace
    run_trace(a, SPEC_TRACE[5:])
    run_trace(b, SPEC_TRACE[5:])
    rng = random.Random(7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(50):
            inf = rng.random() < 0.4
            a.update(inf)
            b.update(inf)
            assert state(a) == state(b)


@pytest.mark.parametrize("scale", [torch.tensor([1024.0]), torch.tensor(1024.0)],
                         ids=["1-element", "0-dim"])
def test_loads_megatron_format_state_dict(scale):
    s = DynamicGradScaler(initial_scale=2.0**16, min_scale=1.0, growth_interval=6, hysteresis=2)
    s.load_state_dict({"scale": scale, "growth_tracker": 5, "hysteresis_tracker": 1})
    assert state(s) == (1024.0, 5, 1)
    assert s.scale.dtype == torch.float32 and tuple(s.scale.shape) == (1,)
    # continues from the loaded trackers: one clean step reaches growth_interval=6
    s.update(False)
    assert state(s) == (2048.0, 0, 2)


def test_loaded_hysteresis_tracker_is_used_for_next_overflow():
    s = DynamicGradScaler(initial_scale=2.0**16, min_scale=1.0, growth_interval=6, hysteresis=2)
    s.load_state_dict({"scale": torch.tensor([1024.0]), "growth_tracker": 5,
                       "hysteresis_tracker": 1})
    s.update(True)  # hysteresis 1 -> 0: backs off at once
    assert state(s) == (512.0, 0, 0)


def test_load_state_dict_does_not_alias_the_given_tensor():
    s = DynamicGradScaler(initial_scale=2.0**16, min_scale=1.0, growth_interval=1, hysteresis=1)
    saved = torch.tensor([1024.0])
    s.load_state_dict({"scale": saved, "growth_tracker": 0, "hysteresis_tracker": 1})
    s.update(False)
    assert float(saved[0]) == 1024.0
    assert state(s)[0] == 2048.0


def test_constant_scaler_update_does_nothing():
    s = ConstantGradScaler(128.0)
    for flag in (True, False, torch.tensor([1.0]), torch.tensor(0.0), torch.tensor([True])):
        s.update(flag)
        assert float(s.scale.reshape(-1)[0]) == 128.0
    assert float(s.inv_scale.reshape(-1)[0]) == f32(1.0 / 128.0)
    assert s.scale.dtype == torch.float32 and s.scale.numel() == 1


def test_constant_scaler_loads_megatron_empty_state_dict():
    s = ConstantGradScaler(128.0)
    s.load_state_dict({})
    assert float(s.scale.reshape(-1)[0]) == 128.0


def test_constant_scaler_state_dict_round_trip_keeps_scale():
    a = ConstantGradScaler(96.0)
    b = ConstantGradScaler(96.0)
    b.load_state_dict(a.state_dict())
    assert float(b.scale.reshape(-1)[0]) == 96.0


def test_scalers_are_exported_from_package():
    assert tpamp.DynamicGradScaler is DynamicGradScaler
    assert tpamp.ConstantGradScaler is ConstantGradScaler


# --------------------------------------------------------------------------------------------
# validation


def _value_pattern(value) -> str:
    """A regex that finds ``value`` as written in a message (repr, str or float form)."""
    forms = {repr(value), str(value)}
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        forms.add(repr(float(value)))
        if float(value).is_integer() and math.isfinite(value):
            forms.add(str(int(value)))
    alts = "|".join(re.escape(f) for f in sorted(forms, key=len, reverse=True))
    return rf"(?<![\w.])(?:{alts})(?![\w])"


BAD_ARGS = [
    # (kwargs, offending name, offending value)
    (dict(initial_scale=0.0), "initial_scale", 0.0),
    (dict(initial_scale=-4.5), "initial_scale", -4.5),
    (dict(initial_scale=8.0, min_scale=0.0), "min_scale", 0.0),
    (dict(initial_scale=8.0, min_scale=-2.5), "min_scale", -2.5),
    (dict(initial_scale=8.0, min_scale=16.5), "min_scale", 16.5),
    (dict(growth_factor=1.0), "growth_factor", 1.0),
    (dict(growth_factor=0.75), "growth_factor", 0.75),
    (dict(growth_factor=-3.0), "growth_factor", -3.0),
    (dict(backoff_factor=0.0), "backoff_factor", 0.0),
    (dict(backoff_factor=1.0), "backoff_factor", 1.0),
    (dict(backoff_factor=1.25), "backoff_factor", 1.25),
    (dict(backoff_factor=-0.5), "backoff_factor", -0.5),
    (dict(growth_interval=0), "growth_interval", 0),
    (dict(growth_interval=-7), "growth_interval", -7),
    (dict(hysteresis=0), "hysteresis", 0),
    (dict(hysteresis=-3), "hysteresis", -3),
    (dict(initial_scale=64.0, max_scale=32.5), "max_scale", 32.5),
    (dict(initial_scale=float("nan")), "initial_scale", float("nan")),
    (dict(initial_scale=float("inf")), "initial_scale", float("inf")),
    (dict(min_scale=float("nan")), "min_scale", float("nan")),
    (dict(growth_factor=float("inf")), "growth_factor", float("inf")),
    (dict(growth_factor=float("nan")), "growth_factor", float("nan")),
    (dict(backoff_factor=float("nan")), "backoff_factor", float("nan")),
    (dict(max_scale=float("inf")), "max_scale", float("inf")),
    (dict(max_scale=float("nan")), "max_scale", float("nan")),
    (dict(initial_scale=True), "initial_scale", True),
    (dict(initial_scale="1024"), "initial_scale", "1024"),
    (dict(min_scale="1"), "min_scale", "1"),
    (dict(growth_factor="2"), "growth_factor", "2"),
    (dict(growth_interval=True), "growth_interval", True),
    (dict(growth_interval="1000"), "growth_interval", "1000"),
    (dict(hysteresis=True), "hysteresis", True),
    (dict(hysteresis="2"), "hysteresis", "2"),
]


@pytest.mark.parametrize("kwargs,name,value", BAD_ARGS, ids=[f"{n}={v!r}" for _, n, v in BAD_ARGS])
def test_bad_argument_raises_naming_the_value(kwargs, name, value):
    # TypeError for a wrong type (a bool or a string for a number), ValueError for a wrong value
    expected = TypeError if isinstance(value, (bool, str)) else ValueError
    with pytest.raises(expected) as exc:
        DynamicGradScaler(**kwargs)
    assert type(exc.value) is expected
    msg = str(exc.value)
    assert name in msg, msg
    assert re.search(_value_pattern(value), msg), f"{value!r} not in message: {msg}"


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(initial_scale=1.0, min_scale=1.0),  # min == initial is allowed
        dict(initial_scale=8.0, max_scale=8.0),  # max == initial is allowed
        dict(growth_factor=1.0001, backoff_factor=0.9999, growth_interval=1, hysteresis=1),
        dict(initial_scale=0.5, min_scale=0.125),  # scales below 1 are allowed
    ],
)
def test_boundary_arguments_are_accepted(kwargs):
    s = DynamicGradScaler(**kwargs)
    assert float(s.scale.reshape(-1)[0]) == f32(kwargs.get("initial_scale", 2.0**32))


@pytest.mark.parametrize("name", ["growth_interval", "hysteresis"])
def test_tracker_limits_beyond_int32_are_rejected(name):
    # the trackers live in int32 device tensors; a larger interval could never be reached
    with pytest.raises(ValueError, match=rf"{name} must be an int in \[1, 2147483647\], got 2147483648"):
        tpamp.DynamicGradScaler(**{name: 2**31})


# --------------------------------------------------------------------------------------------
# the scaler protocol the optimizer wrappers use: snapshot / restore, overflow at min_scale


def test_snapshot_restore_puts_the_dynamic_state_back_as_a_twin_left_it():
    opts = dict(initial_scale=8.0, min_scale=1.0, growth_interval=3, hysteresis=2)
    a, twin = DynamicGradScaler(**opts), DynamicGradScaler(**opts)
    run_trace(a, SPEC_TRACE[:4])
    run_trace(twin, SPEC_TRACE[:4])
    snap = a.snapshot()
    run_trace(a, SPEC_TRACE[4:])  # scale, trackers and the at-min flag all move on
    assert state(a) != state(twin)
    a.restore(snap)
    assert state(a) == state(twin) == SPEC_TRACE[3][1:]
    assert torch.equal(a.overflow_at_min_scale(), twin.overflow_at_min_scale())
    # the snapshot is a copy, not a view: restoring twice gives the same state
    a.update(True)
    a.restore(snap)
    assert state(a) == state(twin)


def test_snapshot_at_min_scale_keeps_the_overflow_flag():
    s = DynamicGradScaler(initial_scale=1.0, min_scale=1.0, growth_interval=10, hysteresis=5)
    s.update(torch.ones(1))  # an overflow at min_scale (a tensor: not reported here)
    assert bool(s.overflow_at_min_scale().item())
    snap = s.snapshot()
    s.update(torch.zeros(1))
    assert not bool(s.overflow_at_min_scale().item())
    s.restore(snap)
    assert bool(s.overflow_at_min_scale().item())


def test_constant_scaler_snapshot_restore_and_no_overflow_tracking():
    s = ConstantGradScaler(4.0)
    snap = s.snapshot()
    s.scale.fill_(2.0)
    s.restore(snap)
    assert float(s.scale.reshape(-1)[0]) == 4.0
    assert s.overflow_at_min_scale() is None
    assert s.report_overflow_at_min_scale() is None


def test_restore_refuses_what_is_not_a_snapshot_of_this_scaler_class():
    d, c = DynamicGradScaler(initial_scale=8.0), ConstantGradScaler(4.0)
    with pytest.raises(TypeError, match="ScalerSnapshot.*dict"):
        d.restore({"scale": torch.ones(1)})
    with pytest.raises(ValueError, match="ConstantGradScaler.*DynamicGradScaler"):
        d.restore(c.snapshot())
    assert state(d) == (8.0, 0, 2)
    assert isinstance(d.snapshot(), tpamp.ScalerSnapshot)


def test_public_overflow_names_and_the_private_aliases_report_alike():
    s = DynamicGradScaler(initial_scale=1.0, min_scale=1.0, hysteresis=1, raise_at_min_scale=True)
    s.update(torch.ones(1))
    assert torch.equal(s.overflow_at_min_scale(), s._overflow_at_min_scale())
    with pytest.raises(LossScaleUnderflowError):
        s.report_overflow_at_min_scale()
    with pytest.raises(LossScaleUnderflowError):
        s._report_overflow_at_min_scale()


# ---- misuse: each bad argument or loaded value raises the documented exception type, with a
# message that names the argument or key (docs/spec.md section 14); runner: tests/misuse_utils.py

NAN, FLOAT_INF = math.nan, math.inf  # INF above is the overflow flag of the traces


def _dyn_load(**state):
    base = {"scale": torch.tensor([8.0]), "growth_tracker": 0, "hysteresis_tracker": 2}
    base.update(state)
    for k in [k for k, v in base.items() if v is DROP]:
        del base[k]
    s = tpamp.DynamicGradScaler(initial_scale=8.0, min_scale=2.0, max_scale=64.0,
                                growth_interval=4, hysteresis=2)
    s.load_state_dict(base)


MISUSE_CASES = [
    # DynamicGradScaler construction: scales are validated in float32, the dtype they live in
    ("dyn-initial_scale-1e39", lambda: tpamp.DynamicGradScaler(initial_scale=1e39), ValueError, ["initial_scale", "float32"]),
    ("dyn-initial_scale-1e-50", lambda: tpamp.DynamicGradScaler(initial_scale=1e-50, min_scale=1e-50), ValueError, ["initial_scale", "float32"]),
    ("dyn-min_scale-1e-50", lambda: tpamp.DynamicGradScaler(initial_scale=1.0, min_scale=1e-50), ValueError, ["min_scale", "float32"]),
    ("dyn-max_scale-1e39", lambda: tpamp.DynamicGradScaler(initial_scale=1.0, max_scale=1e39), ValueError, ["max_scale", "float32"]),
    ("dyn-initial_scale-list", lambda: tpamp.DynamicGradScaler(initial_scale=[8.0]), TypeError, ["initial_scale", "8.0", "list"]),
    ("dyn-device-cuda99", lambda: tpamp.DynamicGradScaler(device="cuda:99"), ValueError, ["device", "cuda:99"]),
    ("dyn-device-bogus", lambda: tpamp.DynamicGradScaler(device="bogus"), ValueError, ["device", "bogus"]),
    ("dyn-device-float", lambda: tpamp.DynamicGradScaler(device=3.5), TypeError, ["device", "3.5"]),
    # ConstantGradScaler construction
    ("const-1e39", lambda: tpamp.ConstantGradScaler(1e39), ValueError, ["scale", "float32"]),
    ("const-1e-50", lambda: tpamp.ConstantGradScaler(1e-50), ValueError, ["scale", "float32"]),
    ("const-0", lambda: tpamp.ConstantGradScaler(0.0), ValueError, ["scale"]),
    ("const-negative", lambda: tpamp.ConstantGradScaler(-2.0), ValueError, ["scale", "-2.0"]),
    ("const-nan", lambda: tpamp.ConstantGradScaler(NAN), ValueError, ["scale", "nan"]),
    ("const-inf", lambda: tpamp.ConstantGradScaler(FLOAT_INF), ValueError, ["scale", "inf"]),
    ("const-str", lambda: tpamp.ConstantGradScaler("8"), TypeError, ["scale", "'8'"]),
    ("const-device-bogus", lambda: tpamp.ConstantGradScaler(8.0, device="bogus"), ValueError, ["device"]),
    # DynamicGradScaler.load_state_dict: checked against the scaler's config
    ("dynload-None", lambda: tpamp.DynamicGradScaler().load_state_dict(None), TypeError, ["state_dict", "None"]),
    ("dynload-list", lambda: tpamp.DynamicGradScaler().load_state_dict([8.0]), TypeError, ["state_dict", "list"]),
    ("dynload-missing-scale", lambda: _dyn_load(scale=DROP), KeyError, ["scale"]),
    ("dynload-missing-growth", lambda: _dyn_load(growth_tracker=DROP), KeyError, ["growth_tracker"]),
    ("dynload-unknown-key", lambda: _dyn_load(loss_scale=8.0), KeyError, ["loss_scale"]),
    ("dynload-scale-str", lambda: _dyn_load(scale="x"), TypeError, ["scale", "'x'"]),
    ("dynload-scale-None", lambda: _dyn_load(scale=None), TypeError, ["scale", "None"]),
    ("dynload-scale-nan", lambda: _dyn_load(scale=torch.tensor([NAN])), ValueError, ["scale", "nan"]),
    ("dynload-scale-inf", lambda: _dyn_load(scale=torch.tensor([FLOAT_INF])), ValueError, ["scale", "inf"]),
    ("dynload-scale-1e39", lambda: _dyn_load(scale=1e39), ValueError, ["scale", "float32"]),
    ("dynload-scale-zero", lambda: _dyn_load(scale=torch.tensor([0.0])), ValueError, ["scale"]),
    ("dynload-scale-2-elements", lambda: _dyn_load(scale=torch.tensor([8.0, 8.0])), ValueError, ["scale", "shape"]),
    ("dynload-scale-int-tensor", lambda: _dyn_load(scale=torch.tensor([8])), ValueError, ["scale", "int64"]),
    ("dynload-scale-below-min", lambda: _dyn_load(scale=torch.tensor([1.0])), ValueError, ["scale", "min_scale"]),
    ("dynload-scale-above-max", lambda: _dyn_load(scale=torch.tensor([128.0])), ValueError, ["scale", "max_scale"]),
    ("dynload-growth-at-interval", lambda: _dyn_load(growth_tracker=4), ValueError, ["growth_tracker", "4"]),
    ("dynload-growth-negative", lambda: _dyn_load(growth_tracker=-1), ValueError, ["growth_tracker", "-1"]),
    ("dynload-growth-float", lambda: _dyn_load(growth_tracker=1.5), TypeError, ["growth_tracker", "1.5"]),
    ("dynload-growth-str", lambda: _dyn_load(growth_tracker="3"), TypeError, ["growth_tracker", "'3'"]),
    ("dynload-growth-bool", lambda: _dyn_load(growth_tracker=True), TypeError, ["growth_tracker", "True"]),
    ("dynload-hysteresis-above", lambda: _dyn_load(hysteresis_tracker=3), ValueError, ["hysteresis_tracker", "3"]),
    ("dynload-hysteresis-None", lambda: _dyn_load(hysteresis_tracker=None), TypeError, ["hysteresis_tracker", "None"]),
    # ConstantGradScaler.load_state_dict
    ("constload-nan", lambda: tpamp.ConstantGradScaler(4.0).load_state_dict({"tpamp_constant_scale": NAN}), ValueError, ["tpamp_constant_scale", "nan"]),
    ("constload-1e39", lambda: tpamp.ConstantGradScaler(4.0).load_state_dict({"tpamp_constant_scale": 1e39}), ValueError, ["tpamp_constant_scale", "float32"]),
    ("constload-negative", lambda: tpamp.ConstantGradScaler(4.0).load_state_dict({"tpamp_constant_scale": -4.0}), ValueError, ["tpamp_constant_scale", "-4.0"]),
    ("constload-str", lambda: tpamp.ConstantGradScaler(4.0).load_state_dict({"tpamp_constant_scale": "4"}), TypeError, ["tpamp_constant_scale", "'4'"]),
    ("constload-unknown-key", lambda: tpamp.ConstantGradScaler(4.0).load_state_dict({"scale": 4.0}), KeyError, ["scale"]),
    ("constload-None", lambda: tpamp.ConstantGradScaler(4.0).load_state_dict(None), TypeError, ["state_dict"]),
    # update(found_inf)
    ("update-found_inf-str", lambda: tpamp.DynamicGradScaler().update("yes"), TypeError, ["found_inf", "str"]),
    ("update-found_inf-2-elements", lambda: tpamp.DynamicGradScaler().update(torch.zeros(2)), ValueError, ["found_inf", "shape"]),
    ("const-update-found_inf-None", lambda: tpamp.ConstantGradScaler(2.0).update(None), TypeError, ["found_inf"]),
]


def test_every_case_is_refused_by_tpamp_itself():
    """Ids distinct; each case refused inside tpamp itself (tests/misuse_utils.py)."""
    assert_every_case_refused_by_tpamp(MISUSE_CASES)


@pytest.mark.parametrize("case_id,call,exc,words", MISUSE_CASES, ids=case_ids(MISUSE_CASES))
def test_misuse_raises_a_clear_error_naming_the_argument(case_id, call, exc, words):
    assert_raises_naming(case_id, call, exc, words)


# ---- the loss scale stays finite and positive in float32 (docs/spec.md section 14) ---------------


F32_MAX = (2 - 2**-23) * 2.0**127  # the largest finite float32, by its definition


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
