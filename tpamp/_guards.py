"""The shared guards of the tpamp optimizer wrappers: wrapping once, the step guard (param
groups unchanged, gradients of the right shape / dtype / device, a new backward before each
step) and the cross-rank agreement of settings.

The guards keep their own state (:class:`GuardState`, per wrapper; which inner optimizers are
wrapped) in tables of this module: they never write attributes onto the wrappers or onto the
torch optimizers they guard.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import weakref
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from tpamp import _peer_settings
from tpamp.common import collective_device, local_tensor
from tpamp.hyperparameters import check_optimizer_hyperparameters

Tensor = torch.Tensor

__all__ = [
    "GuardState",
    "agree_on_settings",
    "check_new_backward",
    "check_param_groups",
    "check_spike_detector",
    "check_step_grads",
    "check_wrappable",
    "gather_rows",
    "guard_state",
    "guard_step",
    "guard_zero_grad",
    "mark_settings_agreed",
    "mark_wrapped",
    "register_wrapper",
    "reset_step_guard",
    "snapshot_param_groups",
    "step_grad_sources",
    "wrapped_by",
]


# ---- the guards' own state -------------------------------------------------------------------
#
# The guards keep what they remember about a wrapper (and which inner optimizers are wrapped)
# in tables of this module, keyed by the object without keeping it alive: no guard writes an
# attribute onto a wrapper or onto a torch optimizer.


class _ByObject:
    """obj -> value without holding obj (an entry goes when obj is collected) and without
    hashing it (an optimizer class that defines ``__eq__`` but no ``__hash__`` is a valid key)."""

    def __init__(self):
        self._entries = {}

    def get(self, obj, default=None):
        entry = self._entries.get(id(obj))
        if entry is None or entry[0]() is not obj:
            return default
        return entry[1]

    def set(self, obj, value) -> None:
        key, entries = id(obj), self._entries

        def forget(ref, key=key, entries=entries):
            entry = entries.get(key)
            if entry is not None and entry[0] is ref:
                del entries[key]

        entries[key] = (weakref.ref(obj, forget), value)


@dataclasses.dataclass
class GuardState:
    """What the step guard remembers about one wrapper.

    param_groups: the inner optimizer's params per group when it was wrapped (None: not
    registered). last_grads: (consumed, [(weakref to grad, grad version)]) of the last step, or
    None after zero_grad / a load. settings_agreed: the cross-rank settings check passed and no
    load happened since."""

    param_groups: Optional[List[List[Tensor]]] = None
    last_grads: Optional[Tuple[bool, list]] = None
    settings_agreed: bool = False


_WRAPPED_BY = _ByObject()  # inner torch optimizer -> the wrapper class's name
_STATES = _ByObject()  # wrapper -> GuardState


def guard_state(wrapper) -> GuardState:
    """The guard's state for ``wrapper`` (created empty on first use)."""
    state = _STATES.get(wrapper)
    if state is None:
        state = GuardState()
        _STATES.set(wrapper, state)
    return state


def wrapped_by(optimizer) -> Optional[str]:
    """The class name of the tpamp wrapper that wrapped the torch optimizer ``optimizer`` (its
    params are main params since; recorded as long as ``optimizer`` lives), None when none
    did."""
    return _WRAPPED_BY.get(optimizer)


# ---- optimizer wrappers: construction -------------------------------------------------------

_SUPPORTED_PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_wrappable(optimizer) -> None:
    """Before a wrapper changes anything: the inner optimizer is not wrapped already (its
    params were replaced by main params, so a second wrapper would step copies that never
    reach the model), and every param has a supported dtype (checked up front so that a bad
    param in a later group does not leave earlier groups half converted)."""
    owner = wrapped_by(optimizer)
    if owner is not None:
        raise ValueError(
            f"optimizer ({type(optimizer).__name__}) is already wrapped by a tpamp {owner}; "
            "wrap each inner optimizer once (build a new inner optimizer for a new wrapper)"
        )
    for gi, group in enumerate(optimizer.param_groups):
        for pi, param in enumerate(group["params"]):
            if not isinstance(param, Tensor):
                raise TypeError(
                    f"param {pi} of param group {gi} is a {type(param).__name__}, not a tensor"
                )
            if param.dtype not in _SUPPORTED_PARAM_DTYPES:
                raise TypeError(
                    f"param {pi} of param group {gi} has dtype {param.dtype}; "
                    "expected float32, float16 or bfloat16"
                )


def check_spike_detector(detector, sync_free: bool):
    """A wrapper's ``spike_detector`` argument: None or a :class:`tpamp.SpikeDetector` that no
    other live optimizer uses (TypeError / ValueError). Binding happens in
    :func:`register_wrapper`, once the wrapper is built."""
    from tpamp.spikes import SpikeDetector

    if detector is None:
        return None
    if not isinstance(detector, SpikeDetector):
        raise TypeError(
            f"spike_detector must be a tpamp.SpikeDetector, got {type(detector).__name__}"
        )
    if sync_free:
        raise ValueError("spike_detector decides on the host: it cannot be used with sync_free=True")
    owner = detector.owner
    if owner is not None:
        raise ValueError(
            f"spike_detector is already used by a {type(owner).__name__}: one detector judges "
            "one optimizer's steps (a second one would feed it two values per iteration); "
            "make a SpikeDetector per optimizer"
        )
    return detector


def register_wrapper(wrapper) -> None:
    """After construction, shared by every tpamp optimizer wrapper: mark the inner optimizer as
    wrapped, remember its param groups (a group added later would be stepped with still-scaled,
    unchecked grads) and bind the wrapper's ``spike_detector`` to it (one detector judges one
    optimizer's steps)."""
    mark_wrapped(wrapper)
    snapshot_param_groups(wrapper)
    detector = getattr(wrapper, "spike_detector", None)
    if detector is not None:
        detector.bind(wrapper)


def mark_wrapped(wrapper) -> None:
    """Record the inner optimizer as wrapped, so :func:`check_wrappable` refuses a second
    wrapper (as long as the inner optimizer lives)."""
    _WRAPPED_BY.set(wrapper.optimizer, type(wrapper).__name__)


def snapshot_param_groups(wrapper) -> None:
    """Remember the inner optimizer's param groups as they are now (a subclass that changes
    them on purpose after construction calls this again)."""
    guard_state(wrapper).param_groups = [list(g["params"]) for g in wrapper.optimizer.param_groups]


def check_param_groups(wrapper) -> None:
    """RuntimeError when the inner optimizer's param groups are not the ones it was wrapped
    with (a group or param added or removed after wrapping)."""
    saved = guard_state(wrapper).param_groups
    if saved is None:
        return
    groups = wrapper.optimizer.param_groups
    same = len(groups) == len(saved) and all(
        len(g["params"]) == len(s) and all(a is b for a, b in zip(g["params"], s))
        for g, s in zip(groups, saved)
    )
    if not same:
        raise RuntimeError(
            f"the inner optimizer's param_groups changed after it was wrapped (now "
            f"{len(groups)} groups with {[len(g['params']) for g in groups]} params, wrapped "
            f"with {len(saved)} groups with {[len(s) for s in saved]}): params added later have "
            "no main copy, would be stepped with still-scaled grads and never checked for "
            "inf/nan. Add every param group before wrapping the optimizer."
        )


# ---- optimizer wrappers: the step guard -----------------------------------------------------
#
# The one step guard of MixedPrecisionOptimizer, DistributedOptimizer and TorchAMPOptimizer
# (``@guard_step`` on their ``step``). Before the step body runs, and so before the loss scaler
# or any other state moves:
#   1. the inner optimizer's param groups are the wrapped ones (check_param_groups), and their
#      hyperparameters pass tpamp.hyperparameters' rules (a finite lr set by a scheduler, ...);
#   2. every gradient the step will read has the param's shape, a float dtype (float32 for a
#      float32 param) and the param's device (check_step_grads);
#   3. a gradient changed since the last step consumed gradients: a backward, zero_grad() or a
#      grad assignment ran (check_new_backward);
#   4. on the first step (and the first after a load), the settings agree over the grad-stats
#      group (agree_on_settings).
# The wrapper names the gradients its step reads with a ``grad_sources()`` method returning
# (name, param, grad) triples; without one, every param's ``.grad`` of the inner optimizer.

_GRAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_PLAIN = (Tensor, torch.nn.Parameter)  # classes check_step_grads takes the short branch for
_local = local_tensor


def step_grad_sources(wrapper) -> List[Tuple[str, Tensor, Tensor]]:
    """(name, param, grad) for every gradient the wrapper's next step() reads."""
    sources = getattr(wrapper, "grad_sources", None)
    if sources is not None:
        return list(sources())
    out = []
    for gi, group in enumerate(wrapper.optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            if p.grad is not None:
                out.append((f"param {pi} of param group {gi}", p, p.grad))
    return out


def check_step_grads(sources) -> None:
    """Each (name, param, grad): grad a tensor (TypeError) of float32/float16/bfloat16 (float32
    for a float32 param; TypeError), of the param's shape (global and local; ValueError) and
    on the param's device (ValueError). Checked before a step changes anything."""
    f32 = torch.float32
    for name, param, grad in sources:
        # plain tensors (no DTensor) that pass every check below: one look at each attribute
        if type(grad) is Tensor and type(param) in _PLAIN:
            dtype = grad.dtype
            if (
                (dtype is f32 or (dtype in _GRAD_DTYPES and param.dtype is not f32))
                and grad.shape == param.shape
                and grad.device == param.device
            ):
                continue
        if not isinstance(grad, Tensor):
            raise TypeError(
                f"the gradient of {name} is a {type(grad).__name__}, not a tensor"
            )
        if grad.dtype not in _GRAD_DTYPES:
            raise TypeError(
                f"the gradient of {name} has dtype {grad.dtype}; expected float32, float16 or "
                "bfloat16"
            )
        if param.dtype == torch.float32 and grad.dtype != torch.float32:
            raise TypeError(
                f"the gradient of {name} has dtype {grad.dtype}: an fp32 param needs a float32 "
                "gradient"
            )
        g, p = _local(grad), _local(param)
        # two DTensors: the global shapes (placements may differ: the step redistributes);
        # otherwise the local data (a main_grad buffer holds a DTensor param's local shard)
        both = g is not grad and p is not param
        if (grad.shape != param.shape) if both else (g.shape != p.shape):  # torch.Size: tuples
            raise ValueError(
                f"the gradient of {name} has shape {tuple(grad.shape)} (local "
                f"{tuple(g.shape)}); expected the param's shape {tuple(param.shape)} (local "
                f"{tuple(p.shape)})"
            )
        if g.device != p.device:
            raise ValueError(
                f"the gradient of {name} is on device {g.device}; expected the param's device "
                f"{p.device}"
            )


def _snapshot(sources) -> list:
    return [(weakref.ref(_local(g)), _local(g)._version) for _, _, g in sources]


def check_new_backward(wrapper, sources) -> None:
    """RuntimeError when the last step consumed gradients and none has changed since: the same
    tensors at the same versions (no backward, no zero_grad, no assignment). Also with plain
    fp16/bf16 ``.grad`` (released by the step: none left), whose second step would change no
    param but count a clean step toward the scaler's growth."""
    last = guard_state(wrapper).last_grads
    if last is None:
        return
    consumed, recorded = last
    if not consumed or len(sources) != len(recorded):
        return
    for (_, _, g), (ref, version) in zip(sources, recorded):
        g = _local(g)
        if ref() is not g or g._version != version:
            return  # at least one grad is new: a backward (or zero_grad) ran since the last step
    raise RuntimeError(
        "step() was called again without a new backward: the gradients are the ones the last "
        "step() already consumed (unscaled, clipped or released); stepping on them again would "
        "apply a wrongly scaled update or count a clean step toward loss-scale growth. Call "
        "scale_loss(loss).backward() (after zero_grad()) before each step(), as "
        "torch.amp.GradScaler requires."
    )


def reset_step_guard(wrapper, *, settings: bool = False) -> None:
    """Forget the last step's gradients (zero_grad and the loads call this): the next step()
    is not compared with them. ``settings=True`` (after a load) also forgets that the settings
    agreed across ranks: the next step compares them again (:func:`agree_on_settings`)."""
    state = guard_state(wrapper)
    state.last_grads = None
    if settings:
        state.settings_agreed = False


def mark_settings_agreed(wrapper) -> None:
    """Record that ``wrapper``'s settings agreed across ranks (:func:`agree_on_settings` does
    it on success; the next step does not compare them again until a load)."""
    guard_state(wrapper).settings_agreed = True


def guard_step(step):
    """Decorator for a wrapper's ``step`` (the one step guard; comment block above): param
    groups, the gradients' shape, dtype and device, a new backward since the last step, and on
    the first step the settings across ranks (one small collective, :func:`agree_on_settings`)
    -- all before the step body changes anything. A step that raises GradSpikeError (spike
    policy "raise") has consumed its gradients like a finished step."""
    from tpamp.spikes import GradSpikeError

    @functools.wraps(step)
    def guarded(self, *args, **kwargs):
        check_param_groups(self)
        # values set since construction (a scheduler, a user): host values only, no sync
        check_optimizer_hyperparameters(self.optimizer, read_tensors=False)
        sources = step_grad_sources(self)
        check_step_grads(sources)
        check_new_backward(self, sources)
        state = guard_state(self)
        if not state.settings_agreed:
            agree_on_settings(self)
        consumed = bool(sources)
        try:
            result = step(self, *args, **kwargs)
        except GradSpikeError:
            state.last_grads = (consumed, _snapshot(step_grad_sources(self)))
            raise
        state.last_grads = (consumed, _snapshot(step_grad_sources(self)))
        return result

    return guarded


def guard_zero_grad(zero_grad):
    """Decorator for a wrapper's ``zero_grad``: the next step may run on new (or no) grads."""

    @functools.wraps(zero_grad)
    def guarded(self, *args, **kwargs):
        result = zero_grad(self, *args, **kwargs)
        reset_step_guard(self)
        return result

    return guarded


# ---- cross-rank agreement of settings -------------------------------------------------------
#
# The one cross-rank settings check of every tpamp optimizer wrapper: on the first step (and
# the first step after a load) one all-gather over the grad-stats group compares the settings
# below; a DistributedOptimizer also compares its bucket layout over its data-parallel group.

_SETTING_NAMES = (
    "wrapper",
    "norm_type",
    "deterministic_grad_norm",
    "deterministic_grad_reduction",
    "log_num_zeros_in_grad",
    "clip_grad",
    "skip_nonfinite",
    "loss scaler",
    "loss scale",
    "min_scale",
    "max_scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "hysteresis",
    "consecutive_hysteresis",
    "raise_at_min_scale",
    "loss scaler enabled",
    "grad_reduce_in_fp32",
    "overlap_grad_reduce",
    "bucket_size",
    "spike_detector",
    "spike policy",
    "spike watch",
    "spike threshold",
    "spike window",
    "spike warmup",
    "spike grad_norm_min_rel_std",
    "spike loss_min_rel_std",
    "exp_avg_dtype",
    "exp_avg_sq_dtype",
    "min_8bit_size",
    "store_param_remainders",
    "master_weights",
    "stochastic_rounding",
    "stochastic_rounding_seed (low 52 bits)",
    "stochastic_rounding_seed (high bits)",
)
# the optimizer-state storage options (narrow moments, param remainders): 0 where a wrapper has none
_STATE_DTYPE_CODES = {torch.float32: 1.0, torch.bfloat16: 2.0, torch.float8_e4m3fn: 3.0,
                      torch.uint8: 4.0}
_WRAPPER_KINDS = {"MixedPrecisionOptimizer": 1.0, "FP32Optimizer": 2.0, "TorchAMPOptimizer": 3.0,
                  "DistributedOptimizer": 4.0, "LayerWiseDistributedOptimizer": 5.0}
_SCALER_KINDS = {None: 0.0, "ConstantGradScaler": 1.0, "DynamicGradScaler": 2.0,
                 "ModelParallelGradScaler": 3.0, "GradScaler": 4.0}
_SPIKE_POLICIES = {"log": 1.0, "skip": 2.0, "raise": 3.0}
_SPIKE_WATCH = {"none": 0.0, "grad_norm": 1.0, "loss": 2.0, "grad_norm+loss": 3.0}


def _kind_name(table, code: float) -> str:
    for name, c in table.items():
        if c == code:
            return str(name)
    return f"other ({code:g})"


def _spike_settings(v: dict, detector) -> None:
    if detector is None:
        return
    v["spike_detector"] = 1.0
    v["spike policy"] = _SPIKE_POLICIES.get(detector.policy, 9.0)
    v["spike watch"] = float(("grad_norm" in detector.watch) + 2 * ("loss" in detector.watch))
    v["spike threshold"] = float(detector.threshold)
    v["spike window"] = float(detector.window)
    v["spike warmup"] = float(detector.warmup)
    v["spike grad_norm_min_rel_std"] = float(detector.min_rel_std["grad_norm"])
    v["spike loss_min_rel_std"] = float(detector.min_rel_std["loss"])


def _settings(wrapper) -> List[float]:
    """This rank's settings that must agree over the grad-stats group, as float64 values in the
    order of _SETTING_NAMES (0 where a setting does not apply; inf for max_scale=None and
    bucket_size=None)."""
    v = dict.fromkeys(_SETTING_NAMES, 0.0)
    v["wrapper"] = _WRAPPER_KINDS.get(type(wrapper).__name__, 9.0)
    v["norm_type"] = float(wrapper.norm_type)
    v["deterministic_grad_norm"] = float(bool(getattr(wrapper, "deterministic_grad_norm", False)))
    v["log_num_zeros_in_grad"] = float(bool(wrapper.log_num_zeros_in_grad))
    v["clip_grad"] = float(wrapper.clip_grad)
    v["skip_nonfinite"] = float(bool(getattr(wrapper, "skip_nonfinite", True)))
    if hasattr(wrapper, "data_parallel_group"):  # the DistributedOptimizer's bucketing
        v["grad_reduce_in_fp32"] = float(bool(wrapper.grad_reduce_in_fp32))
        v["overlap_grad_reduce"] = float(bool(wrapper.overlap_grad_reduce))
        v["deterministic_grad_reduction"] = float(
            bool(getattr(wrapper, "deterministic_grad_reduction", False)))
        size = wrapper.bucket_size
        v["bucket_size"] = math.inf if size is None else float(size)
    _spike_settings(v, getattr(wrapper, "spike_detector", None))
    scaler = getattr(wrapper, "grad_scaler", None)
    if scaler is None:
        scaler = getattr(wrapper, "scaler", None)
    name = type(scaler).__name__ if scaler is not None else None
    v["loss scaler"] = _SCALER_KINDS.get(name, 9.0)
    for key in ("exp_avg_dtype", "exp_avg_sq_dtype"):
        dtype = getattr(wrapper, key, None)
        v[key] = _STATE_DTYPE_CODES.get(dtype, 9.0) if dtype is not None else 0.0
    # which params keep 8-bit moments (docs/spec.md section 9): ranks must store alike
    v["min_8bit_size"] = float(getattr(wrapper, "min_8bit_size", 0))
    v["store_param_remainders"] = float(bool(getattr(wrapper, "store_param_remainders", False)))
    # docs/spec.md section 21: ranks that round differently would drift apart
    v["master_weights"] = float(bool(getattr(wrapper, "master_weights", True)))
    v["stochastic_rounding"] = float(bool(getattr(wrapper, "stochastic_rounding", False)))
    seed = int(getattr(wrapper, "stochastic_rounding_seed", 0))
    v["stochastic_rounding_seed (low 52 bits)"] = float(seed & (2**52 - 1))
    v["stochastic_rounding_seed (high bits)"] = float(seed >> 52)
    if scaler is None:
        return [v[n] for n in _SETTING_NAMES]
    if isinstance(scaler, torch.amp.GradScaler):
        enabled = scaler.is_enabled()
        v["loss scale"] = float(scaler.get_scale()) if enabled else 0.0
        v["growth_factor"] = float(scaler.get_growth_factor())
        v["backoff_factor"] = float(scaler.get_backoff_factor())
        v["growth_interval"] = float(scaler.get_growth_interval())
        v["loss scaler enabled"] = float(enabled)
        return [v[n] for n in _SETTING_NAMES]
    v["loss scale"] = float(scaler.scale.reshape(-1)[0].item())  # first step only
    for n in ("min_scale", "growth_factor", "backoff_factor", "growth_interval", "hysteresis",
              "consecutive_hysteresis", "raise_at_min_scale"):
        if hasattr(scaler, n):
            v[n] = float(getattr(scaler, n))
    if hasattr(scaler, "max_scale"):
        v["max_scale"] = math.inf if scaler.max_scale is None else float(scaler.max_scale)
    return [v[n] for n in _SETTING_NAMES]


def _grad_stats_group(wrapper):
    group = getattr(wrapper, "grad_stats_group", None)
    if group is None:
        scaler = getattr(wrapper, "scaler", None)
        group = getattr(scaler, "model_parallel_group", None)
    return group


def _shown(name: str, column: List[float]) -> List[str]:
    if name == "wrapper":
        return [_kind_name(_WRAPPER_KINDS, c) for c in column]
    if name == "loss scaler":
        return [_kind_name(_SCALER_KINDS, c) for c in column]
    if name == "spike policy":
        return [_kind_name(_SPIKE_POLICIES, c) for c in column]
    if name == "spike watch":
        return [_kind_name(_SPIKE_WATCH, c) for c in column]
    if name == "spike_detector":
        return ["a SpikeDetector" if c else "None" for c in column]
    if name in ("exp_avg_dtype", "exp_avg_sq_dtype"):
        return [_kind_name({str(k): c for k, c in _STATE_DTYPE_CODES.items()}, c) for c in column]
    if name in ("max_scale", "bucket_size"):
        return ["None" if c == math.inf else f"{c:g}" for c in column]
    return [f"{c:g}" for c in column]


def gather_rows(values: List[float], group) -> List[List[float]]:
    """Every rank's ``values`` (a float64 all-gather over ``group``), one row per rank in group
    rank order."""
    mine = torch.tensor(values, dtype=torch.float64, device=collective_device(group))
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return torch.stack(every).cpu().tolist()


def _gather_groups(wrapper) -> list:
    """(name, group) of each group the settings are all-gathered over: the grad-stats group,
    and the expert grad-stats group where expert statistics are reduced apart (its EP and
    expert-TP peers are not all in the dense one)."""
    groups = [("grad_stats_group", _grad_stats_group(wrapper))]
    if getattr(wrapper, "experts_apart", False):
        groups.append(("expert_grad_stats_group", wrapper.expert_grad_stats_group))
    return [(n, g) for n, g in groups
            if g is not None and dist.is_initialized() and dist.get_world_size(g) > 1]


def _gather_settings(name: str, group, row: List[float]) -> List[List[float]]:
    """One all-gather of ``row`` over ``group``; RuntimeError naming the group when a peer
    never joins."""
    try:
        return gather_rows(row, group)
    except RuntimeError as e:  # a peer that never joins: gloo's timeout or closed connection
        raise RuntimeError(
            f"the cross-rank settings check over {name} (ranks "
            f"{dist.get_process_group_ranks(group)}) failed: "
            f"{e}. Every rank of that group must pass the same {name} to its "
            "optimizer wrapper and reach step() together: a rank that passed "
            f"{name}=None (or another group), or that crashed, never joins"
        ) from e


def _compare(wrapper, name: str, group, table: List[List[float]]) -> None:
    """ValueError, the same on every rank of ``group``, when its rows differ."""
    ranks = dist.get_process_group_ranks(group)
    for j, setting in enumerate(_SETTING_NAMES):
        column = [r[j] for r in table]
        if all(c == column[0] for c in column):
            continue
        per_rank = ", ".join(f"rank {r}: {s}" for r, s in zip(ranks, _shown(setting, column)))
        where = "grad-stats group" if name == "grad_stats_group" else "expert grad-stats group"
        raise ValueError(
            f"{setting} differs across the {len(ranks)} ranks of the {where} "
            f"({per_rank}); every rank of the group must use the same settings, or their "
            "collectives and skip decisions diverge"
        )
    n = len(_SETTING_NAMES)
    found = _peer_settings.mismatches([r[n:] for r in table], ranks)
    if found:  # every rank has the same table: all of them take this branch together
        raise _peer_settings.explain(found, wrapper, group, ranks)


def agree_on_settings(wrapper) -> None:
    """The one cross-rank settings check: one all-gather over the wrapper's grad-stats group
    compares the wrapper kind, norm type, zero counting, clip, skip policy, loss-scaler
    settings and scale, the DistributedOptimizer's bucketing options and the spike detector's
    settings (present or not, policy, watched series, threshold, window, warm-up, floors); in
    the same all-gather, the inner optimizer's hyperparameters of every param group between
    the ranks of each group the wrapper reduces over (TP, DP or DP x CP, expert-TP, expert-DP,
    EP; never between pipeline stages) and the params' layout between TP peers
    (:mod:`tpamp._peer_settings`); where expert statistics are reduced over a group of their
    own, the same all-gather over that group too. A wrapper with ``data_parallel_group`` and
    ``bucket_layout()`` also compares its bucket layout over that group (a second all-gather).

    Ranks that differ would run different collectives (a zero count or a spike detector's loss
    all-reduce on some ranks only: a gloo error or a hang; reduce-scatters of different sizes;
    TensorParallelMuon tp_modes) or take different skip decisions or steps (silently diverging
    replicas, a gathered model that mixes two settings). Every rank raises the same
    ValueError, naming the first setting that differs and each rank's value (for a
    hyperparameter or layout difference after one more collective, ``all_gather_object`` of
    the descriptions, taken only then). Collective: every rank of the grad-stats group must
    call it; when a peer never joins (it passed ``grad_stats_group=None`` or crashed) the ranks
    that did raise RuntimeError saying so."""
    groups = _gather_groups(wrapper)
    if groups:
        row = _settings(wrapper) + _peer_settings.payload(wrapper)
        # every gather first: a rank that raises has then joined all of them (no peer waits)
        tables = [_gather_settings(name, group, row) for name, group in groups]
        for (name, group), table in zip(groups, tables):
            _compare(wrapper, name, group, table)
    dp = getattr(wrapper, "data_parallel_group", None)
    layout = getattr(wrapper, "bucket_layout", None)
    if dp is None or layout is None or not dist.is_initialized() or dist.get_world_size(dp) < 2:
        mark_settings_agreed(wrapper)
        return
    buckets = layout()  # [(dtype name, padded numel)]
    dtype_code = {"torch.float32": 1.0, "torch.float16": 2.0, "torch.bfloat16": 3.0}
    total = float(sum(n for _, n in buckets))
    weighted = float(sum((i + 1) * n * dtype_code.get(str(d), 9.0) for i, (d, n) in enumerate(buckets)))
    table = gather_rows([float(len(buckets)), total, weighted], dp)
    if any(row != table[0] for row in table):
        ranks = dist.get_process_group_ranks(dp)
        per_rank = ", ".join(f"rank {r}: {int(row[0])} buckets of {int(row[1])} elements"
                             for r, row in zip(ranks, table))
        raise ValueError(
            f"bucket layout differs across the {len(ranks)} ranks of the data-parallel group "
            f"({per_rank}, or the same sizes in another order or dtype); every DP rank must "
            "hold the same params with the same bucket_size, or the reduce-scatters mismatch"
        )
    mark_settings_agreed(wrapper)
