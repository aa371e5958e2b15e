"""Loss scalers with Megatron-LM semantics (megatron/core/optimizer/grad_scaler.py).

A loss scale is a multiplier applied to the loss before backward so that small fp16 gradients
do not flush to zero; the optimizer wrapper multiplies gradients by ``inv_scale`` before use.

Usage::

    scaler = tpamp.DynamicGradScaler(initial_scale=2.0**16)
    opt = tpamp.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters()), grad_scaler=scaler)
    opt.scale_loss(loss).backward(); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import math
import warnings
from typing import Dict, Optional, Union

import torch

from tpamp import ops
from tpamp._checks import (
    as_float32,
    check_device,
    check_f32_scale,
    check_int,
    check_mapping,
    check_real,
)

__all__ = [
    "MegatronGradScaler",
    "ScalerSnapshot",
    "ConstantGradScaler",
    "DynamicGradScaler",
    "LossScaleUnderflowError",
]


class LossScaleUnderflowError(RuntimeError):
    """Raised by a DynamicGradScaler with raise_at_min_scale=True when a step overflows while the
    loss scale is already at min_scale: training cannot make progress by backing off further."""


_INT32_MAX = 2**31 - 1  # the trackers are int32 device tensors


class ScalerSnapshot:
    """An opaque copy of a loss scaler's device state, from :meth:`MegatronGradScaler.snapshot`
    (clones of its state tensors on the scaler's device); give it back to
    :meth:`MegatronGradScaler.restore` of a scaler of the same class."""

    __slots__ = ("kind", "tensors")

    def __init__(self, kind: type, tensors: Dict[str, torch.Tensor]):
        self.kind = kind
        self.tensors = tensors

    def __repr__(self) -> str:
        return f"ScalerSnapshot({self.kind.__name__}, {sorted(self.tensors)})"


class MegatronGradScaler:
    """Base class: a loss scale held as a 1-element float32 tensor on ``device``.

    ``scale`` is the multiplier (float32 tensor, shape [1]); ``inv_scale`` is its reciprocal
    computed in float64 and rounded to float32 (as Megatron-LM does).

    The protocol the optimizer wrappers use, besides ``update``: :meth:`snapshot` /
    :meth:`restore` (put the scaler back as it was before a step, e.g. when a spike detector
    discards the step) and :meth:`overflow_at_min_scale` / :meth:`report_overflow_at_min_scale`
    (a stall reported where the step already reads the device).
    """

    def __init__(self, initial_scale: float, device: Optional[Union[str, torch.device]] = None,
                 *, _name: str = "initial_scale"):
        initial_scale = check_f32_scale(_name, initial_scale)
        self._device = check_device(device) if device is not None else _default_device()
        self._scale = torch.tensor([initial_scale], dtype=torch.float32, device=self._device)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def scale(self) -> torch.Tensor:
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        return self._scale.double().reciprocal().float()

    def to(self, device: Union[str, torch.device]) -> "MegatronGradScaler":
        """Move the scaler's tensors to ``device`` (in place); returns self. Raises
        TypeError/ValueError for a device this build cannot use."""
        self._device = check_device(device)
        for name, value in list(vars(self).items()):
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.to(self._device))
        return self

    def update(self, found_inf) -> None:
        raise NotImplementedError

    @property
    def never_below_one(self) -> bool:
        """True when the scale can never drop below 1, so multiplying by ``inv_scale`` cannot
        overflow (known on the host, without reading the device)."""
        return False

    def overflow_at_min_scale(self) -> Optional[torch.Tensor]:
        """Device bool tensor of shape [1]: the last update saw an overflow while the scale was
        at min_scale (or growth reached the float32 cap, until reported once); None when this
        scaler does not track it. Never reads the device."""
        return None

    def report_overflow_at_min_scale(self) -> None:
        """Called by the optimizer after it read :meth:`overflow_at_min_scale` nonzero on the
        host: warns once, or raises :class:`LossScaleUnderflowError` (DynamicGradScaler with
        raise_at_min_scale=True)."""

    # the names the optimizer wrappers call today: aliases of the public protocol (a subclass
    # that overrides the public methods re-binds them, as DynamicGradScaler does)
    _overflow_at_min_scale = overflow_at_min_scale
    _report_overflow_at_min_scale = report_overflow_at_min_scale

    def _state_tensors(self) -> Dict[str, torch.Tensor]:
        """The device tensors that hold this scaler's state (snapshot / restore copy them)."""
        return {"scale": self._scale}

    def snapshot(self) -> ScalerSnapshot:
        """An opaque copy of the scaler's state: clones of its state tensors on its device (no
        host sync). Host-side reporting flags (warned once) are not part of it."""
        return ScalerSnapshot(type(self), {k: v.clone() for k, v in self._state_tensors().items()})

    def restore(self, snapshot: ScalerSnapshot) -> None:
        """Put the state saved by :meth:`snapshot` back, in place (no host sync). TypeError
        for anything but a :class:`ScalerSnapshot`, ValueError for one of another scaler class."""
        if not isinstance(snapshot, ScalerSnapshot):
            raise TypeError(
                f"snapshot must be a ScalerSnapshot from {type(self).__name__}.snapshot(), got "
                f"{snapshot!r:.80} ({type(snapshot).__name__})"
            )
        mine = self._state_tensors()
        if snapshot.kind is not type(self) or set(snapshot.tensors) != set(mine):
            raise ValueError(
                f"snapshot {snapshot!r} was taken from a {snapshot.kind.__name__}; this scaler is "
                f"a {type(self).__name__}"
            )
        for k, t in mine.items():
            t.copy_(snapshot.tensors[k])

    def state_dict(self) -> dict:
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict) -> None:
        raise NotImplementedError


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class ConstantGradScaler(MegatronGradScaler):
    """A fixed loss scale (Megatron-LM's ConstantGradScaler).

    ``update`` does nothing; the optimizer still checks found_inf and skips overflowing steps.
    state_dict: ``{'tpamp_constant_scale': float}``; Megatron's empty dict loads as a no-op.

    Raises TypeError for a scale that is not a real number, ValueError for one that is not
    finite and > 0 in float32 (1e39 is inf and 1e-50 is 0 in float32), or a device this build
    cannot use.
    """

    def __init__(self, scale: float, device: Optional[Union[str, torch.device]] = None):
        super().__init__(scale, device, _name="scale")
        self._host_scale = as_float32(float(scale))

    @property
    def never_below_one(self) -> bool:
        return self._host_scale >= 1.0

    def update(self, found_inf) -> None:
        _validate_found_inf(found_inf)

    def state_dict(self) -> dict:
        return {"tpamp_constant_scale": float(self._scale.item())}

    def check_state_dict(self, state_dict: dict) -> Optional[float]:
        """Validate ``state_dict`` as :meth:`load_state_dict` would, without changing anything
        (the wrappers' all-or-nothing loads call it first). Returns the float32 scale to load
        (None: Megatron's {}, keep the current). Raises TypeError/KeyError/ValueError as
        load_state_dict does."""
        check_mapping("grad scaler state_dict", state_dict)
        unknown = set(state_dict) - {"tpamp_constant_scale"}
        if unknown:
            raise KeyError(
                f"unexpected keys in ConstantGradScaler state_dict: {sorted(map(str, unknown))}; "
                "expected {'tpamp_constant_scale': float} or Megatron's {}"
            )
        if "tpamp_constant_scale" not in state_dict:
            return None
        value = state_dict["tpamp_constant_scale"]
        if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point():
            value = float(value.reshape(()).item())
        check_f32_scale("state_dict['tpamp_constant_scale']", value)
        return as_float32(float(value))

    def load_state_dict(self, state_dict: dict) -> None:
        """Load {'tpamp_constant_scale': float} (or Megatron's {}: nothing to load). Raises
        TypeError/KeyError/ValueError naming the key before changing anything."""
        value = self.check_state_dict(state_dict)
        if value is not None:
            self._host_scale = value
            self._scale.fill_(value)


def _validate_found_inf(found_inf):
    if isinstance(found_inf, bool):
        return
    if isinstance(found_inf, torch.Tensor):
        if found_inf.numel() != 1:
            raise ValueError(f"found_inf must have one element, got shape {tuple(found_inf.shape)}")
        return
    raise TypeError(f"found_inf must be a bool or a 1-element tensor, got {type(found_inf).__name__}")


class DynamicGradScaler(MegatronGradScaler):
    """Dynamic loss scale with hysteresis and a minimum (Megatron-LM's DynamicGradScaler).

    State: ``scale`` (float32 [1] on ``device``), ``growth_tracker`` (clean steps since the last
    overflow or growth), ``hysteresis_tracker`` (overflows left before a back-off), starting at
    0 and ``hysteresis``. ``update(found_inf)``:

    * overflow: growth_tracker = 0; hysteresis_tracker -= 1 (it may go below 0); if
      hysteresis_tracker <= 0: scale = max(scale * backoff_factor, min_scale).
    * clean step: growth_tracker += 1; when it reaches growth_interval: growth_tracker = 0,
      hysteresis_tracker = hysteresis, scale *= growth_factor (clamped to max_scale if given).
      Hysteresis is refilled only when the scale grows, unless consecutive_hysteresis=True
      (DeepSpeed's option), where every clean step refills it.
    * an overflow while scale == min_scale keeps skipping and warns once (Megatron), or raises
      :class:`LossScaleUnderflowError` with raise_at_min_scale=True. Both happen where the
      optimizer step already reads found_inf on the host, never as an extra sync.

    Worked trace (hysteresis=2, growth_interval=3, initial 8, min 1): inf -> 8; inf -> 4;
    inf -> 2; ok, ok -> 2; inf -> 1; ok x3 -> 2.

    ``update`` takes a Python bool or a 1-element tensor; a tensor is never read on the host:
    the update runs on the scaler's device (a CUDA kernel when tpamp._C is built).

    Without max_scale, growth stops at the largest power of growth_factor that float32 holds
    (2**127 for 2), so the scale never becomes inf; reaching it is reported once (a
    RuntimeWarning, where the step already reads the device).

    Raises TypeError (naming the argument and the value) for an argument of the wrong type (a
    string, a bool or None for a number, a float for growth_interval or hysteresis), and
    ValueError unless initial_scale > 0, 0 < min_scale <= initial_scale, growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1,
    hysteresis >= 1, max_scale None or >= initial_scale, all finite; the scales
    (initial_scale, min_scale, max_scale) must also be finite and > 0 in float32, the dtype
    the scale is stored in (1e39 is inf there, 1e-50 is 0). TypeError/ValueError for a
    device this build cannot use (e.g. "cuda" without CUDA).
    """

    def __init__(
        self,
        initial_scale: float = 2.0**32,
        min_scale: float = 1.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        *,
        max_scale: Optional[float] = None,
        consecutive_hysteresis: bool = False,
        raise_at_min_scale: bool = False,
        device: Optional[Union[str, torch.device]] = None,
    ):
        # scales are stored in float32: 1e39 would be inf there and 1e-50 would be 0
        initial = check_f32_scale("initial_scale", initial_scale)
        min_scale = check_real("min_scale", min_scale)
        growth_factor = check_real("growth_factor", growth_factor)
        backoff_factor = check_real("backoff_factor", backoff_factor)
        max_scale = check_real("max_scale", max_scale, allow_none=True)
        if min_scale > 0:
            check_f32_scale("min_scale", min_scale)
        if max_scale is not None and max_scale > 0:
            check_f32_scale("max_scale", max_scale)
        if not 0 < min_scale <= initial:
            raise ValueError(
                f"min_scale must satisfy 0 < min_scale <= initial_scale ({initial}), got {min_scale}"
            )
        if growth_factor <= 1:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor must satisfy 0 < backoff_factor < 1, got {backoff_factor}")
        growth_interval = check_int("growth_interval", growth_interval, low=1, high=_INT32_MAX)
        hysteresis = check_int("hysteresis", hysteresis, low=1, high=_INT32_MAX)
        if max_scale is not None and max_scale < initial:
            raise ValueError(f"max_scale must be None or >= initial_scale ({initial}), got {max_scale}")
        super().__init__(initial, device)
        self.min_scale = min_scale
        # the largest scale growth may reach: max_scale, else the largest power of
        # growth_factor that float32 holds (so the scale never becomes inf and stops training)
        self._growth_cap = max_scale if max_scale is not None else _largest_f32_power(growth_factor, initial)
        self._at_implicit_cap = torch.zeros(1, dtype=torch.bool, device=self._device)
        self._warned_cap = max_scale is not None  # an explicit max_scale is a documented clamp
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.max_scale = max_scale
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.raise_at_min_scale = bool(raise_at_min_scale)
        self._growth_tracker_t = torch.zeros(1, dtype=torch.int32, device=self._device)
        self._hysteresis_tracker_t = torch.full((1,), hysteresis, dtype=torch.int32, device=self._device)
        self._overflow_at_min = torch.zeros(1, dtype=torch.bool, device=self._device)
        self._warned_min_scale = False

    @property
    def growth_tracker(self) -> int:
        """Clean steps since the last overflow or growth (reads the device: not for a step)."""
        return int(self._growth_tracker_t.item())

    @property
    def hysteresis_tracker(self) -> int:
        """Overflows left before the next back-off (reads the device: not for a step)."""
        return int(self._hysteresis_tracker_t.item())

    def update(self, found_inf: Union[bool, torch.Tensor]) -> None:
        """Advance the state machine by one step (see the class docstring).

        found_inf: Python bool, or a 1-element tensor (any float/bool dtype, nonzero = overflow)
        on any device; a tensor is moved to the scaler's device and never read on the host.
        """
        _validate_found_inf(found_inf)
        if isinstance(found_inf, bool):
            flag = torch.tensor([found_inf], dtype=torch.float32, device=self._device)
        else:
            flag = found_inf.detach().reshape(1).to(device=self._device, dtype=torch.float32)
        # remembered so the optimizer can report a stall where it already syncs
        torch.logical_and(flag != 0, self._scale <= as_float32(self.min_scale), out=self._overflow_at_min)
        ops.dynamic_scaler_update_(
            self._scale,
            self._growth_tracker_t,
            self._hysteresis_tracker_t,
            flag,
            growth_factor=self.growth_factor,
            backoff_factor=self.backoff_factor,
            growth_interval=self.growth_interval,
            hysteresis=self.hysteresis,
            min_scale=self.min_scale,
            max_scale=self._growth_cap,
            consecutive_hysteresis=self.consecutive_hysteresis,
        )
        if not self._warned_cap:
            torch.logical_or(
                self._at_implicit_cap, self._scale >= as_float32(self._growth_cap),
                out=self._at_implicit_cap,
            )
        if isinstance(found_inf, bool) and bool(self.overflow_at_min_scale().any()):
            self.report_overflow_at_min_scale()

    def _state_tensors(self) -> Dict[str, torch.Tensor]:
        return {
            "scale": self._scale,
            "growth_tracker": self._growth_tracker_t,
            "hysteresis_tracker": self._hysteresis_tracker_t,
            "overflow_at_min": self._overflow_at_min,
            "at_implicit_cap": self._at_implicit_cap,
        }

    def overflow_at_min_scale(self) -> Optional[torch.Tensor]:
        # also raised (until reported once) when growth has reached the float32 cap
        if self._warned_cap:
            return self._overflow_at_min
        return self._overflow_at_min | self._at_implicit_cap

    @property
    def never_below_one(self) -> bool:
        return self.min_scale >= 1.0

    def report_overflow_at_min_scale(self) -> None:
        # called only when the flag above was read nonzero: a rare event, so reading the
        # device flags here adds no sync to an ordinary step
        if not self._warned_cap and bool(self._at_implicit_cap.item()):
            self._warned_cap = True
            warnings.warn(
                f"the loss scale reached {self._growth_cap:.6g}, the largest power of "
                f"growth_factor={self.growth_factor} that float32 holds, and will not grow "
                "further (set max_scale to choose the cap; reported once)",
                RuntimeWarning,
                stacklevel=3,
            )
        if not bool(self._overflow_at_min.item()):
            return
        msg = (
            f"gradient overflow while the loss scale is at min_scale={self.min_scale}: the step "
            "is skipped and the scale cannot back off further"
        )
        if self.raise_at_min_scale:
            raise LossScaleUnderflowError(msg)
        if not self._warned_min_scale:
            self._warned_min_scale = True
            warnings.warn(msg + " (reported once; training may be stalled)", RuntimeWarning, stacklevel=3)

    _overflow_at_min_scale = overflow_at_min_scale  # aliases of the public protocol
    _report_overflow_at_min_scale = report_overflow_at_min_scale

    def state_dict(self) -> dict:
        """Megatron's keys: 'scale' (1-element float32 CPU tensor), 'growth_tracker' and
        'hysteresis_tracker' (ints). Reads the device (a checkpoint-time sync)."""
        return {
            "scale": self._scale.detach().cpu().clone(),
            "growth_tracker": self.growth_tracker,
            "hysteresis_tracker": self.hysteresis_tracker,
        }

    def check_state_dict(self, state_dict: dict):
        """Validate ``state_dict`` against this scaler's config as :meth:`load_state_dict`
        would, without changing anything (the wrappers' all-or-nothing loads call it first).
        Returns (scale as float32 [1] CPU tensor, growth_tracker, hysteresis_tracker). Raises
        TypeError/KeyError/ValueError as load_state_dict does."""
        check_mapping("grad scaler state_dict", state_dict)
        keys = {"scale", "growth_tracker", "hysteresis_tracker"}
        missing = keys - set(state_dict)
        if missing:
            raise KeyError(f"DynamicGradScaler state_dict is missing {sorted(missing)}")
        unknown = set(state_dict) - keys
        if unknown:
            raise KeyError(
                f"unexpected keys in DynamicGradScaler state_dict: {sorted(map(str, unknown))}; "
                f"expected {sorted(keys)}"
            )
        scale = state_dict["scale"]
        if isinstance(scale, torch.Tensor):
            if scale.numel() != 1 or not scale.is_floating_point():
                raise ValueError(
                    "state_dict['scale'] must be a 1-element floating-point tensor, got dtype "
                    f"{scale.dtype} and shape {tuple(scale.shape)}"
                )
            value = float(scale.detach().reshape(()).to("cpu", torch.float64).item())
        else:
            value = scale
        value = check_f32_scale("state_dict['scale']", value)
        value32 = as_float32(value)
        if value32 < as_float32(self.min_scale):
            raise ValueError(
                f"state_dict['scale']={value32!r} is below this scaler's min_scale="
                f"{self.min_scale!r}; resume with a min_scale <= the saved scale"
            )
        if value32 > as_float32(self._growth_cap):
            which = "max_scale" if self.max_scale is not None else "float32 growth cap"
            raise ValueError(
                f"state_dict['scale']={value32!r} is above this scaler's {which} "
                f"{self._growth_cap!r}"
            )
        growth = check_int(
            "state_dict['growth_tracker']", state_dict["growth_tracker"],
            low=0, high=self.growth_interval - 1,
        )
        hyst = check_int(
            "state_dict['hysteresis_tracker']", state_dict["hysteresis_tracker"],
            low=-_INT32_MAX - 1, high=self.hysteresis,
        )
        return torch.tensor([value32], dtype=torch.float32), growth, hyst

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a dict from :meth:`state_dict` or from Megatron-LM's DynamicGradScaler (scale as
        a 1-element tensor on any device, moved to this scaler's device).

        Everything is checked before anything changes: TypeError/KeyError for a non-dict, a
        missing or unknown key or a non-number; ValueError for a scale that is not finite and
        > 0 in float32 or lies outside [min_scale, max_scale (or the float32 growth cap)], a
        growth_tracker outside [0, growth_interval - 1] (a checkpoint from a run with a larger
        growth_interval: its tracker could never reach this one's interval) or a
        hysteresis_tracker above hysteresis."""
        scale, growth, hyst = self.check_state_dict(state_dict)
        self._scale.copy_(scale.to(self._device))
        self._growth_tracker_t.fill_(growth)
        self._hysteresis_tracker_t.fill_(hyst)
        self._overflow_at_min.zero_()
        self._at_implicit_cap.zero_()


def _largest_f32_power(growth_factor: float, initial_scale: float) -> float:
    """The largest growth_factor**k (k an int) that is finite in float32, or initial_scale if
    that is larger: where an unbounded dynamic scale stops growing."""
    k = int(math.floor(math.log(_F32_MAX) / math.log(growth_factor)))
    while k > 0 and not math.isfinite(as_float32(growth_factor**k)):
        k -= 1
    while math.isfinite(as_float32(growth_factor ** (k + 1))):
        k += 1
    return max(float(growth_factor**k), float(initial_scale))


_F32_MAX = float(torch.finfo(torch.float32).max)
