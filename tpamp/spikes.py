"""Grad-norm and loss spike detection with a policy: log, skip the step, or raise.

A :class:`SpikeDetector` keeps running statistics (a window of recent values) of the all-reduced
grad norm and of the loss, and flags a step whose value lies more than ``threshold`` standard
deviations above the window's mean, once ``warmup`` values have been seen. Handling loss spikes
by skipping the offending steps is what PaLM and OLMo did by hand (re-starting before a spike
and skipping the batches); here the decision is taken inside the optimizer step.

Every rank of the grad-stats group decides alike: the grad norm it sees is the all-reduced one,
and the loss (known on the last pipeline stage only) is averaged over the ranks that report one
in one small all-reduce, so all ranks feed the same float64 numbers to the same host arithmetic.

Policies (``policy=``):

* ``"log"``: only record the spike (:attr:`SpikeDetector.last`, the counters);
* ``"skip"``: skip the step exactly as an overflow skip does -- the inner optimizer does not
  step, params, optimizer state and its step count do not change -- but the loss scaler is left
  exactly as it was before the step (scale and trackers: a spike is not an overflow), and the
  skip is counted in :attr:`SpikeDetector.spike_skips`, apart from overflow skips;
* ``"raise"``: raise :class:`GradSpikeError` on every rank; the optimizer puts the loss scaler
  back as it was before the step (as for "skip"), so no param, optimizer state or scaler
  state changes; the detector records the spike in its counters and window.

One detector judges one optimizer: the wrapper built with it binds it (:meth:`SpikeDetector.bind`)
and a second wrapper given the same detector is refused (it would feed two values per
iteration). Its settings (policy, watched series, threshold, window, warm-up, floors) are part
of the optimizers' cross-rank settings check: a detector on some ranks only, or one watching
the loss on some ranks only, would make some ranks join its loss all-reduce and others not.

Usage with :class:`tpamp.MixedPrecisionOptimizer`::

    detector = tpamp.SpikeDetector(policy="skip")
    opt = tpamp.MixedPrecisionOptimizer(inner, grad_scaler=scaler, spike_detector=detector, ...)
    for batch in data:
        loss = ...                          # on the ranks that compute it (last PP stage)
        opt.scale_loss(loss).backward()
        detector.observe_loss(loss)         # those ranks only; the others skip this call
        result = opt.step()                 # decides on the reduced grad norm and loss
        if detector.last.skipped: ...       # a spike skip (result.update_successful is False)
"""

from __future__ import annotations

import collections
import collections.abc
import math
import numbers
import weakref
from typing import Dict, NamedTuple, Optional

import torch
import torch.distributed as dist

from tpamp._checks import check_int, check_real

__all__ = ["SpikeDetector", "SpikeDecision", "GradSpikeError", "SPIKE_POLICIES"]

SPIKE_POLICIES = ("log", "skip", "raise")
_SERIES = ("grad_norm", "loss")


class GradSpikeError(RuntimeError):
    """Raised by a ``policy="raise"`` :class:`SpikeDetector` on a spike (on every rank)."""


class SpikeDecision(NamedTuple):
    """What the detector decided for one step.

    grad_norm, loss: the all-reduced values looked at (floats; loss None when no rank reported
    one; both None on an overflow step, which is not looked at). z_grad_norm, z_loss: how many
    standard deviations above the window mean (None during warm-up or when not watched).
    spike: a value crossed the threshold. skipped: the step was skipped for it (policy "skip").
    overflow: the step had inf/nan gradients (an overflow skip; no spike decision).
    """

    grad_norm: Optional[float] = None
    loss: Optional[float] = None
    z_grad_norm: Optional[float] = None
    z_loss: Optional[float] = None
    spike: bool = False
    skipped: bool = False
    overflow: bool = False

    def as_record(self) -> Dict:
        """JSON-ready fields for a log record (non-finite numbers as None)."""
        return {k: _finite_or_none(v) for k, v in self._asdict().items()}


def _finite_or_none(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class SpikeDetector:
    """Flags steps whose all-reduced grad norm or loss is far above its recent values.

    For each watched series (``"grad_norm"``, ``"loss"``) the detector keeps the last ``window``
    values (float64, host). A value x is a spike when at least ``warmup`` values are held and
    ``x > mean + threshold * max(std, min_rel_std * |mean|)`` (population std of the window;
    ``min_rel_std`` is per series). z = (x - mean) / that denominator is reported. The floor
    keeps a quiet series from flagging small wiggles; for the grad norm, whose distribution has
    a heavy tail (single steps at 3-4x the mean occur in normal training, and clipping already
    bounds their update), the default floor of 1.0 means that only a step above
    (1 + threshold) x the recent mean, 7x by default, is a spike. After the decision x enters the window, a spike clipped to the
    threshold value, so one spike does not blind the detector to the next one, while a lasting
    change of level is absorbed within about a window of steps instead of skipping forever.
    Only upward excursions count; non-finite values are never added.

    Args:
        policy: "log", "skip" or "raise" (module docstring).
        threshold: z-score threshold (standard deviations), > 0.
        window: number of recent values held, >= 2.
        warmup: values needed before any decision, 2 <= warmup <= window.
        grad_norm_min_rel_std, loss_min_rel_std: floor of the std relative to |mean| for each
            series, >= 0.
        watch: which series to judge, a subset of ("grad_norm", "loss"); the loss needs
            :meth:`observe_loss` on the ranks that have it before each step.

    The defaults (threshold 6, window 100, warmup 20, floors 1.0 and 0.05) do not fire on
    scripts/train_gpt.py's default run (its largest z-scores are about 3; docs/benchmarks-log.md).

    State (counters and windows) is in :meth:`state_dict`, which
    :class:`tpamp.MixedPrecisionOptimizer` and :class:`tpamp.DistributedOptimizer` save under
    ``"spike_detector"``, so a resumed run decides identically; :meth:`load_state_dict` is
    validated and all or nothing (:meth:`check_state_dict`).

    Raises TypeError for an argument of the wrong type (a string or a bool for a number, a
    float for window or warmup) and ValueError for a bad value (nan, inf, out of range, an
    unknown policy or series), naming the argument and the value.
    """

    def __init__(
        self,
        policy: str = "log",
        *,
        threshold: float = 6.0,
        window: int = 100,
        warmup: int = 20,
        grad_norm_min_rel_std: float = 1.0,
        loss_min_rel_std: float = 0.05,
        watch=_SERIES,
    ):
        if policy not in SPIKE_POLICIES:
            raise ValueError(f"policy must be one of {SPIKE_POLICIES}, got {policy!r}")
        self.policy = policy
        self.threshold = check_real("threshold", threshold, low=0.0, low_inclusive=False)
        self.window = check_int("window", window, low=2)
        self.warmup = check_int("warmup", warmup, low=2)
        if self.warmup > self.window:
            raise ValueError(f"warmup ({warmup}) must be <= window ({window})")
        self.min_rel_std = {
            "grad_norm": check_real("grad_norm_min_rel_std", grad_norm_min_rel_std, low=0.0),
            "loss": check_real("loss_min_rel_std", loss_min_rel_std, low=0.0),
        }
        watch = tuple(watch)
        bad = [w for w in watch if w not in _SERIES]
        if bad or not watch:
            raise ValueError(f"watch must be a non-empty subset of {_SERIES}, got {watch!r}")
        self.watch = watch
        self._values = {name: collections.deque(maxlen=self.window) for name in _SERIES}
        self._pending_loss: Optional[torch.Tensor] = None
        self.steps_seen = 0  # steps decided on (overflow steps excluded)
        self.spikes = 0  # steps flagged, whatever the policy
        self.spike_skips = 0  # steps skipped for a spike (policy "skip")
        self.last: Optional[SpikeDecision] = None
        self._owner = None  # weak reference to the one optimizer this detector judges

    # -- the one optimizer ----------------------------------------------------------------

    @property
    def owner(self):
        """The optimizer wrapper this detector judges (None before one is built with it, or
        after that one is gone)."""
        return self._owner() if self._owner is not None else None

    def bind(self, optimizer) -> None:
        """Called by the optimizer wrapper that takes this detector (at the end of its
        construction). Raises ValueError when another live optimizer already uses it: one
        detector fed by two optimizers would see two values per iteration and judge (and
        skip) steps on the other optimizer's statistics."""
        owner = self.owner
        if owner is not None and owner is not optimizer:
            raise ValueError(
                f"this SpikeDetector is already used by a {type(owner).__name__}; make a "
                "SpikeDetector per optimizer"
            )
        self._owner = weakref.ref(optimizer)

    # -- inputs ---------------------------------------------------------------------------

    def observe_loss(self, loss) -> None:
        """Report this step's loss (a float or a 1-element tensor, e.g. the mean loss over
        microbatches) on a rank that computes it; call before ``step()``. Ranks without a loss
        do not call it. Not read on the host here (step() reduces it with the grad stats)."""
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                raise ValueError(f"loss must have one element, got shape {tuple(loss.shape)}")
            self._pending_loss = loss.detach().reshape(1).double()
        elif isinstance(loss, numbers.Real) and not isinstance(loss, bool):
            self._pending_loss = torch.tensor([float(loss)], dtype=torch.float64)
        else:
            raise TypeError(f"loss must be a float or a 1-element tensor, got {type(loss).__name__}")

    def reduce_loss(self, group=None, device=None) -> Optional[float]:
        """Mean of the losses reported by the ranks of ``group`` (None when none reported), the
        same float on every rank: one all-reduce of 2 float64 numbers. Every rank of the group
        must call it (the optimizer does, in step()). Clears the pending loss."""
        pending, self._pending_loss = self._pending_loss, None
        if "loss" not in self.watch:
            return None
        if pending is None:
            buf = torch.zeros(2, dtype=torch.float64, device=device)
        else:
            pending = pending.to(device) if device is not None else pending
            buf = torch.cat([pending, torch.ones_like(pending)])
        if group is not None:
            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
        total, count = buf.tolist()
        return total / count if count > 0 else None

    # -- the decision ---------------------------------------------------------------------

    def _z(self, name: str, x: Optional[float]) -> Optional[float]:
        values = self._values[name]
        if name not in self.watch or x is None or len(values) < self.warmup:
            return None
        n = len(values)
        mean = math.fsum(values) / n
        var = math.fsum((v - mean) ** 2 for v in values) / n
        denom = max(math.sqrt(var), self.min_rel_std[name] * abs(mean))
        if denom == 0.0:
            return math.inf if x > mean else 0.0
        return (x - mean) / denom

    def _admit(self, name: str, x: Optional[float], z: Optional[float]) -> None:
        if name not in self.watch or x is None or not math.isfinite(x):
            return
        if z is not None and z > self.threshold:
            values = self._values[name]
            n = len(values)
            mean = math.fsum(values) / n
            x = mean + self.threshold * ((x - mean) / z)  # the threshold value: mean + t * denom
        self._values[name].append(x)

    def decide(self, grad_norm: Optional[float], loss: Optional[float], *, overflow: bool = False) -> SpikeDecision:
        """Judge one step from its all-reduced grad norm and loss (floats, host), update the
        statistics and counters, and apply the policy: returns the decision (``skipped`` True
        means the caller must skip the step); raises :class:`GradSpikeError` for policy
        "raise". An overflow step (``overflow=True``) is recorded but not judged."""
        if overflow:
            self.last = SpikeDecision(overflow=True)
            return self.last
        self.steps_seen += 1
        zg = self._z("grad_norm", grad_norm)
        zl = self._z("loss", loss)
        spike = any(z is not None and z > self.threshold for z in (zg, zl))
        # a non-finite loss (with finite grads) is not a spike here: it is counted as a nan
        # iteration by the logger
        self._admit("grad_norm", grad_norm, zg)
        self._admit("loss", loss, zl)
        skipped = spike and self.policy == "skip"
        self.spikes += spike
        self.spike_skips += skipped
        self.last = SpikeDecision(grad_norm, loss, zg, zl, spike, skipped, False)
        if spike and self.policy == "raise":
            raise GradSpikeError(
                f"spike: grad norm {grad_norm!r} (z {zg!r}), loss {loss!r} (z {zl!r}) above "
                f"{self.threshold} standard deviations of the last {self.window} values"
            )
        return self.last

    # -- the optimizer's hooks ------------------------------------------------------------

    @staticmethod
    def snapshot_scaler(grad_scaler):
        """``grad_scaler.snapshot()`` (its state tensors copied on its device, no host sync),
        taken by the optimizer wrappers before a step so that a spike skip ("skip" or "raise")
        can put the scaler back as an overflow skip would have left it. None for None."""
        if grad_scaler is None:
            return None
        return grad_scaler.snapshot()

    @staticmethod
    def restore_scaler(grad_scaler, snapshot) -> None:
        """``grad_scaler.restore(snapshot)`` for a :meth:`snapshot_scaler` (nothing for None),
        in place."""
        if snapshot is not None:
            grad_scaler.restore(snapshot)

    # -- checkpointing --------------------------------------------------------------------

    def state_dict(self) -> Dict:
        """{'windows': {series: [floats]}, 'steps_seen', 'spikes', 'spike_skips'} (plain
        Python values) plus the settings, checked on load."""
        return {
            "windows": {name: list(v) for name, v in self._values.items()},
            "steps_seen": self.steps_seen,
            "spikes": self.spikes,
            "spike_skips": self.spike_skips,
            "settings": {
                "threshold": self.threshold, "window": self.window, "warmup": self.warmup,
                "min_rel_std": dict(self.min_rel_std), "watch": list(self.watch),
            },
        }

    def check_state_dict(self, state_dict) -> Dict:
        """Check a state dict of :meth:`state_dict` against this detector without loading it;
        returns the parsed values. Raises TypeError for a non-dict (None included) or a value
        of the wrong type (a string, a bool, a non-list window), KeyError for a missing key,
        ValueError for a window value that is not finite (nan or inf: it would blind the
        detector for a whole window), a window longer than ``window``, a negative counter or
        counters that contradict each other (spike_skips <= spikes <= steps_seen), a series
        this detector does not know, or saved settings that differ from this detector's (the
        resumed run would decide differently). Each error names the key."""
        where = "spike detector state_dict"
        if not isinstance(state_dict, collections.abc.Mapping):
            raise TypeError(f"{where} must be a dict, got {state_dict!r:.80} "
                            f"({type(state_dict).__name__})")
        for key in ("windows", "steps_seen", "spikes", "spike_skips"):
            if key not in state_dict:
                raise KeyError(f"{where} has no {key!r} entry")
        counts = {}
        for key in ("steps_seen", "spikes", "spike_skips"):
            v = state_dict[key]
            if isinstance(v, torch.Tensor) and v.numel() == 1 and not v.is_floating_point():
                v = int(v.item())
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise TypeError(f"{where}[{key!r}] must be an int, got {v!r} ({type(v).__name__})")
            if v < 0:
                raise ValueError(f"{where}[{key!r}] must be >= 0, got {v}")
            counts[key] = int(v)
        if not counts["spike_skips"] <= counts["spikes"] <= counts["steps_seen"]:
            raise ValueError(
                f"{where}: expected spike_skips <= spikes <= steps_seen, got "
                f"{counts['spike_skips']}, {counts['spikes']}, {counts['steps_seen']}"
            )
        windows = state_dict["windows"]
        if not isinstance(windows, collections.abc.Mapping):
            raise TypeError(f"{where}['windows'] must be a dict of lists, got "
                            f"{type(windows).__name__}")
        parsed = {}
        for name, values in windows.items():
            wkey = f"{where}['windows'][{name!r}]"
            if name not in _SERIES:
                raise ValueError(f"{wkey}: unknown series {name!r}; expected one of {_SERIES}")
            if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple, collections.deque)):
                raise TypeError(f"{wkey} must be a list of floats, got {type(values).__name__}")
            if len(values) > self.window:
                raise ValueError(f"{wkey} holds {len(values)} values, more than window={self.window}")
            out = []
            for i, v in enumerate(values):
                if isinstance(v, bool) or not isinstance(v, numbers.Real):
                    raise TypeError(f"{wkey}[{i}] must be a float, got {v!r} ({type(v).__name__})")
                if not math.isfinite(v):
                    raise ValueError(f"{wkey}[{i}] is {v!r}; a window holds finite values only")
                out.append(float(v))
            parsed[name] = out
        saved = state_dict.get("settings")
        mine = self.state_dict()["settings"]
        if saved is not None:
            if not isinstance(saved, collections.abc.Mapping) or "watch" not in saved:
                raise TypeError(f"{where}['settings'] must be a dict like {mine}, got {saved!r:.80}")
            if dict(saved, watch=list(saved["watch"])) != mine:
                raise ValueError(f"spike detector settings differ: saved {dict(saved)}, this detector {mine}")
        return {"windows": parsed, **counts}

    def load_state_dict(self, state_dict: Dict) -> None:
        """Restore windows and counters, all or nothing (:meth:`check_state_dict` first: a
        refused state dict leaves the detector unchanged)."""
        parsed = self.check_state_dict(state_dict)
        for name in _SERIES:
            values = parsed["windows"].get(name, [])
            self._values[name] = collections.deque(values, maxlen=self.window)
        self.steps_seen = parsed["steps_seen"]
        self.spikes = parsed["spikes"]
        self.spike_skips = parsed["spike_skips"]
