"""Checks that keep bad values out of training: argument and state-dict validation, the step
guard of the optimizer wrappers, and the first-step agreement of settings across ranks.

Every error names the argument or key, the bad value and what was expected. Loaded state is
checked completely before anything is changed (a failed load leaves the object as it was).
"""

from __future__ import annotations

import functools
import math
import numbers
import struct
import warnings
import weakref
from collections.abc import Mapping
from typing import Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from tpamp.common import collective_device, local_tensor

Tensor = torch.Tensor
_F32_MAX = float(torch.finfo(torch.float32).max)


# ---- numbers --------------------------------------------------------------------------------


def as_float32(value: float) -> float:
    """``value`` rounded to float32 (inf above float32's range, 0 below its smallest subnormal),
    computed on the host without touching any tensor."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def check_f32_scale(name: str, value, *, allow_none: bool = False,
                    type_error: type = TypeError) -> Optional[float]:
    """A loss scale stored as float32: a real number, finite and > 0 *in float32*.

    Raises ``type_error`` (TypeError unless the caller's contract says otherwise) for a
    non-number (bool included) and ValueError for nan/inf/<= 0 or a value that float32 turns
    into inf (> 3.4028e+38) or 0 (< 1.4e-45). Returns float(value).
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise type_error(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    f32 = as_float32(value)
    if not (math.isfinite(f32) and f32 > 0):
        raise ValueError(
            f"{name}={value!r} is {f32!r} in float32, the dtype the loss scale is stored in; "
            f"expected a value in [1.4e-45, {_F32_MAX:.6g}]"
        )
    return value


def check_real(name: str, value, *, low=None, low_inclusive=True, high=None,
               high_inclusive=True, allow_inf=False) -> float:
    """A real number (not bool), not nan, finite unless allow_inf, within the given bounds."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if math.isnan(value) or (math.isinf(value) and not allow_inf):
        raise ValueError(f"{name} must be {'not nan' if allow_inf else 'finite'}, got {value!r}")
    if low is not None and (value < low or (value == low and not low_inclusive)):
        raise ValueError(f"{name} must be {'>=' if low_inclusive else '>'} {low}, got {value!r}")
    if high is not None and (value > high or (value == high and not high_inclusive)):
        raise ValueError(f"{name} must be {'<=' if high_inclusive else '<'} {high}, got {value!r}")
    return value


def check_int(name: str, value, *, low: Optional[int] = None, high: Optional[int] = None) -> int:
    """An int (not bool; a 1-element integer tensor is accepted) within [low, high]."""
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
            raise TypeError(
                f"{name} must be an int, got a tensor of dtype {value.dtype} and shape "
                f"{tuple(value.shape)}"
            )
        value = int(value.reshape(()).item())
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        lo = "-inf" if low is None else low
        hi = "inf" if high is None else high
        raise ValueError(f"{name} must be an int in [{lo}, {hi}], got {value}")
    return value


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return value


def check_device(device, name: str = "device") -> torch.device:
    """A torch.device (or a str/int torch.device accepts) that this build can use.

    Raises TypeError for another type, ValueError for a malformed string or a CUDA device on a
    machine or build without CUDA."""
    if isinstance(device, bool) or not isinstance(device, (str, torch.device, int)):
        raise TypeError(
            f"{name} must be a torch.device or a string such as 'cpu' or 'cuda:0', got "
            f"{device!r} ({type(device).__name__})"
        )
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"{name}={device!r} is not a valid device: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"{name}={device!r}: CUDA is not available (torch {torch.__version__}, "
            f"cuda build: {torch.version.cuda is not None}); use 'cpu' or leave {name}=None"
        )
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(
            f"{name}={device!r}: there are only {torch.cuda.device_count()} CUDA devices"
        )
    return dev


def check_tensor_list(name: str, values) -> List[Tensor]:
    """A tensor or an iterable of tensors -> list; TypeError naming ``name`` otherwise."""
    if isinstance(values, Tensor):
        return [values]
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        raise TypeError(
            f"{name} must be a tensor or an iterable of tensors, got {type(values).__name__}"
        )
    out = list(values)
    for i, v in enumerate(out):
        if not isinstance(v, Tensor):
            raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {v!r} ({type(v).__name__})")
    return out


def check_loss(loss, name: str = "loss") -> None:
    """The loss to scale: a floating-point tensor."""
    if not isinstance(loss, Tensor):
        raise TypeError(
            f"{name} must be a floating-point torch.Tensor (the output of the loss function), "
            f"got {loss!r} ({type(loss).__name__})"
        )
    if not loss.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {loss.dtype}")


def check_group_member(group, name: str) -> None:
    if group is None:
        return
    # new_group hands non-members a placeholder (GroupMember.NON_GROUP_MEMBER), not a group
    if not isinstance(group, dist.ProcessGroup) and group is not dist.GroupMember.NON_GROUP_MEMBER:
        raise TypeError(f"{name} must be a torch.distributed ProcessGroup or None, got "
                        f"{type(group).__name__}")
    if dist.get_rank(group) < 0:
        raise ValueError(
            f"this rank (global rank {dist.get_rank()}) is not a member of the given {name}"
        )


def tp_rank(tensor_parallel_group) -> int:
    """This rank's position in ``tensor_parallel_group`` (0 for None). Raises TypeError for a
    non-group and ValueError when this rank is not a member."""
    if tensor_parallel_group is None:
        return 0
    check_group_member(tensor_parallel_group, "tensor_parallel_group")
    return dist.get_rank(tensor_parallel_group)


def check_norm_type(norm_type) -> float:
    """p of a grad norm: a real number >= 1 or ``math.inf`` (ValueError otherwise, as
    Megatron-LM's callers expect)."""
    if isinstance(norm_type, bool) or not isinstance(norm_type, numbers.Real):
        raise ValueError(f"norm_type must be a number >= 1 or inf, got {norm_type!r}")
    norm_type = float(norm_type)
    if not norm_type >= 1.0:
        raise ValueError(f"norm_type must be >= 1 or inf, got {norm_type}")
    return norm_type


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


def check_mapping(name: str, value) -> Mapping:
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a dict, got {value!r:.80} ({type(value).__name__})")
    return value


# ---- optimizer wrappers: construction -------------------------------------------------------

_WRAPPED_ATTR = "_tpamp_wrapped_by"
_SUPPORTED_PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_wrappable(optimizer) -> None:
    """Before a wrapper changes anything: the inner optimizer is not wrapped already (its
    params were replaced by main params, so a second wrapper would step copies that never
    reach the model), and every param has a supported dtype (checked up front so that a bad
    param in a later group does not leave earlier groups half converted)."""
    wrapped_by = getattr(optimizer, _WRAPPED_ATTR, None)
    if wrapped_by is not None:
        raise ValueError(
            f"optimizer ({type(optimizer).__name__}) is already wrapped by a tpamp {wrapped_by}; "
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
    """Mark the inner optimizer as wrapped, so :func:`check_wrappable` refuses a second wrapper."""
    setattr(wrapper.optimizer, _WRAPPED_ATTR, type(wrapper).__name__)


def snapshot_param_groups(wrapper) -> None:
    """Remember the inner optimizer's param groups as they are now (a subclass that changes
    them on purpose after construction calls this again)."""
    wrapper._tpamp_param_groups = [list(g["params"]) for g in wrapper.optimizer.param_groups]


def check_param_groups(wrapper) -> None:
    """RuntimeError when the inner optimizer's param groups are not the ones it was wrapped
    with (a group or param added or removed after wrapping)."""
    saved = getattr(wrapper, "_tpamp_param_groups", None)
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


_check_param_groups = check_param_groups


# ---- optimizer wrappers: the step guard -----------------------------------------------------
#
# The one step guard of MixedPrecisionOptimizer, DistributedOptimizer and TorchAMPOptimizer
# (``@guard_step`` on their ``step``). Before the step body runs, and so before the loss scaler
# or any other state moves:
#   1. the inner optimizer's param groups are the wrapped ones (check_param_groups);
#   2. every gradient the step will read has the param's shape, a float dtype (float32 for a
#      float32 param) and the param's device (check_step_grads);
#   3. a gradient changed since the last step consumed gradients: a backward, zero_grad() or a
#      grad assignment ran (check_new_backward);
#   4. on the first step (and the first after a load), the settings agree over the grad-stats
#      group (agree_on_settings).
# The wrapper names the gradients its step reads with a ``grad_sources()`` method returning
# (name, param, grad) triples; without one, every param's ``.grad`` of the inner optimizer.

_GRAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
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
    for name, param, grad in sources:
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
        if (tuple(grad.shape) != tuple(param.shape)) if both else (tuple(g.shape) != tuple(p.shape)):
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
    last = getattr(wrapper, "_tpamp_last_grads", None)
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


def reset_step_guard(wrapper) -> None:
    """Forget the last step's gradients (zero_grad and load_state_dict call this): the next
    step() is not compared with them, and the settings are checked across ranks again after a
    load."""
    wrapper._tpamp_last_grads = None


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
        sources = step_grad_sources(self)
        check_step_grads(sources)
        check_new_backward(self, sources)
        if not getattr(self, "_tpamp_settings_agreed", False):
            agree_on_settings(self)
            self._tpamp_settings_agreed = True
        consumed = bool(sources)
        try:
            result = step(self, *args, **kwargs)
        except GradSpikeError:
            self._tpamp_last_grads = (consumed, _snapshot(step_grad_sources(self)))
            raise
        self._tpamp_last_grads = (consumed, _snapshot(step_grad_sources(self)))
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
    "store_param_remainders",
)
# the optimizer-state storage options (issue 22): 0 where a wrapper has none
_STATE_DTYPE_CODES = {torch.float32: 1.0, torch.bfloat16: 2.0, torch.float8_e4m3fn: 3.0}
_WRAPPER_KINDS = {"MixedPrecisionOptimizer": 1.0, "FP32Optimizer": 2.0, "TorchAMPOptimizer": 3.0,
                  "DistributedOptimizer": 4.0}
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
    v["log_num_zeros_in_grad"] = float(bool(wrapper.log_num_zeros_in_grad))
    v["clip_grad"] = float(wrapper.clip_grad)
    v["skip_nonfinite"] = float(bool(getattr(wrapper, "skip_nonfinite", True)))
    if hasattr(wrapper, "data_parallel_group"):  # the DistributedOptimizer's bucketing
        v["grad_reduce_in_fp32"] = float(bool(wrapper.grad_reduce_in_fp32))
        v["overlap_grad_reduce"] = float(bool(wrapper.overlap_grad_reduce))
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
    v["store_param_remainders"] = float(bool(getattr(wrapper, "store_param_remainders", False)))
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


def _gather_rows(values: List[float], group) -> List[List[float]]:
    mine = torch.tensor(values, dtype=torch.float64, device=collective_device(group))
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return torch.stack(every).cpu().tolist()


def agree_on_settings(wrapper) -> None:
    """The one cross-rank settings check: one all-gather over the wrapper's grad-stats group
    compares the wrapper kind, norm type, zero counting, clip, skip policy, loss-scaler
    settings and scale, the DistributedOptimizer's bucketing options and the spike detector's
    settings (present or not, policy, watched series, threshold, window, warm-up, floors); a
    wrapper with ``data_parallel_group`` and ``bucket_layout()`` also compares its bucket
    layout over that group (a second all-gather).

    Ranks that differ would run different collectives (a zero count or a spike detector's loss
    all-reduce on some ranks only: a gloo error or a hang; reduce-scatters of different sizes)
    or take different skip decisions (silently diverging replicas). Every rank raises the same
    ValueError, naming the first setting that differs and each rank's value."""
    group = _grad_stats_group(wrapper)
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        table = _gather_rows(_settings(wrapper), group)
        ranks = dist.get_process_group_ranks(group)
        for j, name in enumerate(_SETTING_NAMES):
            column = [row[j] for row in table]
            if all(c == column[0] for c in column):
                continue
            per_rank = ", ".join(f"rank {r}: {s}" for r, s in zip(ranks, _shown(name, column)))
            raise ValueError(
                f"{name} differs across the {len(ranks)} ranks of the grad-stats group "
                f"({per_rank}); every rank of the group must use the same settings, or their "
                "collectives and skip decisions diverge"
            )
    dp = getattr(wrapper, "data_parallel_group", None)
    layout = getattr(wrapper, "bucket_layout", None)
    if dp is None or layout is None or not dist.is_initialized() or dist.get_world_size(dp) < 2:
        return
    buckets = layout()  # [(dtype name, padded numel)]
    dtype_code = {"torch.float32": 1.0, "torch.float16": 2.0, "torch.bfloat16": 3.0}
    total = float(sum(n for _, n in buckets))
    weighted = float(sum((i + 1) * n * dtype_code.get(str(d), 9.0) for i, (d, n) in enumerate(buckets)))
    table = _gather_rows([float(len(buckets)), total, weighted], dp)
    if any(row != table[0] for row in table):
        ranks = dist.get_process_group_ranks(dp)
        per_rank = ", ".join(f"rank {r}: {int(row[0])} buckets of {int(row[1])} elements"
                             for r, row in zip(ranks, table))
        raise ValueError(
            f"bucket layout differs across the {len(ranks)} ranks of the data-parallel group "
            f"({per_rank}, or the same sizes in another order or dtype); every DP rank must "
            "hold the same params with the same bucket_size, or the reduce-scatters mismatch"
        )


# ---- state dicts ----------------------------------------------------------------------------

# torch.optim state entries that hold one value per param element (shape of the param)
_PER_ELEMENT_STATE = frozenset({
    "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta",
    "sum", "ax", "prev", "step_size", "grad_avg", "exp_inf", "mu_product_buffer",
})
# tpamp's per-block scales of 8-bit moments (issue 22): present or not by configuration, so
# their presence does not mark another optimizer class
NARROW_STATE_KEYS = frozenset({"exp_avg_scale", "exp_avg_sq_scale"})


def _keys_filled_on_load(cls) -> set:
    """Param-group keys that ``cls.__setstate__`` fills in by itself when a state dict from an
    older torch lacks them (so their absence is not a sign of another optimizer class)."""
    try:
        probe = cls.__new__(cls)
        probe.__setstate__({"defaults": {}, "state": {}, "param_groups": [{"params": []}]})
        return set(probe.param_groups[0])
    except Exception:
        return set()


def _all_finite(tensors: Sequence[Tensor]) -> List[bool]:
    """One host read for the finiteness of many tensors (a load-time sync, never in a step)."""
    if not tensors:
        return []
    flags = [torch.isfinite(_local(t).float() if _local(t).element_size() == 1 else _local(t))
             .all().reshape(1).cpu() for t in tensors]
    return torch.cat(flags).tolist()


def check_inner_optimizer_state(optimizer, state_dict, where: str = "state_dict['optimizer']") -> None:
    """Check a ``torch.optim`` state dict against ``optimizer`` without loading it: the same
    number of param groups and params per group, the optimizer class's hyperparameters present
    in every group (an SGD state dict lacks Adam's ``betas``), state entries for listed params
    only, with the keys of the current state (when there is one) and per-element tensors of the
    param's shape, all floating-point state finite. Raises TypeError/KeyError/ValueError naming
    the key."""
    check_mapping(where, state_dict)
    for key in ("state", "param_groups"):
        if key not in state_dict:
            raise KeyError(f"{where} has no {key!r} entry (not a torch.optim state dict)")
    state, groups = state_dict["state"], state_dict["param_groups"]
    check_mapping(f"{where}['state']", state)
    if not isinstance(groups, (list, tuple)):
        raise TypeError(f"{where}['param_groups'] must be a list, got {type(groups).__name__}")
    mine = optimizer.param_groups
    if len(groups) != len(mine):
        raise ValueError(
            f"{where}['param_groups'] has {len(groups)} param groups, this optimizer has {len(mine)}"
        )
    cls = type(optimizer)
    needed = set(getattr(optimizer, "defaults", {})) - _keys_filled_on_load(cls)
    by_id = {}
    for gi, (saved, group) in enumerate(zip(groups, mine)):
        gwhere = f"{where}['param_groups'][{gi}]"
        check_mapping(gwhere, saved)
        if "params" not in saved:
            raise KeyError(f"{gwhere} has no 'params' entry")
        ids = saved["params"]
        if not isinstance(ids, (list, tuple)):
            raise TypeError(f"{gwhere}['params'] must be a list of ids, got {type(ids).__name__}")
        if len(ids) != len(group["params"]):
            raise ValueError(
                f"{gwhere}['params'] lists {len(ids)} params, this optimizer's group {gi} has "
                f"{len(group['params'])}"
            )
        missing = needed - set(saved)
        if missing:
            raise ValueError(
                f"{gwhere} lacks {sorted(missing)}, which {cls.__name__} needs: is this the state "
                f"dict of another optimizer class (it has {sorted(k for k in saved if k != 'params')})?"
            )
        for pid, p in zip(ids, group["params"]):
            by_id[pid] = p
    to_check, names = [], []
    for pid, entry in state.items():
        swhere = f"{where}['state'][{pid!r}]"
        if pid not in by_id:
            raise ValueError(f"{swhere}: no param group lists a param with id {pid!r}")
        check_mapping(swhere, entry)
        p = by_id[pid]
        current = optimizer.state.get(p) or {}
        if current and set(current) - NARROW_STATE_KEYS != set(entry) - NARROW_STATE_KEYS:
            raise ValueError(
                f"{swhere} has keys {sorted(entry)}, this {cls.__name__}'s state for that param "
                f"has {sorted(current)}: is this the state dict of another optimizer class?"
            )
        for k, v in entry.items():
            if not isinstance(v, Tensor):
                continue
            cur = current.get(k)
            expected = tuple(cur.shape) if isinstance(cur, Tensor) else (
                tuple(p.shape) if k in _PER_ELEMENT_STATE else None
            )
            if expected is not None and v.dim() > 0 and tuple(v.shape) != expected:
                raise ValueError(
                    f"{swhere}[{k!r}] has shape {tuple(v.shape)}, expected {expected} (the "
                    "param's): a state dict of another model?"
                )
            if v.is_floating_point():
                to_check.append(v)
                names.append(f"{swhere}[{k!r}]")
    for name, ok in zip(names, _all_finite(to_check)):
        if not ok:
            raise ValueError(f"{name} holds inf or nan values; refusing to load it")


def _prefixed(prefix: str, fn, *args):
    """Run an object's own check, naming the wrapper's key in its error."""
    try:
        return fn(*args)
    except (TypeError, KeyError, ValueError) as e:
        msg = e.args[0] if e.args else str(e)
        raise type(e)(f"{prefix}: {msg}") from e


# ---- the all-or-nothing load of every optimizer wrapper ------------------------------------


def match_saved_tensors(where: str, saved, targets, *, unit: str = "param group",
                        item: str = "main param") -> List[Tuple[str, Tensor, Tensor]]:
    """Match saved main params against this wrapper's: ``targets`` is a list of tensors or a
    list (per param group) of lists of tensors, ``saved`` must have the same structure, each
    a float32 tensor of the target's shape (global and local). Returns (key, saved, target)
    triples; raises TypeError / ValueError naming the key. Finiteness: :func:`check_finite`."""
    nested = bool(targets) and isinstance(targets[0], (list, tuple))
    if not isinstance(saved, (list, tuple)):
        raise TypeError(
            f"{where} must be a list{' (per ' + unit + ') of lists' if nested else ''} of "
            f"tensors, got {type(saved).__name__}"
        )
    if not nested and targets == [] and saved and isinstance(saved[0], (list, tuple)):
        nested = True
    if len(saved) != len(targets):
        raise ValueError(
            f"{where} has {item}s for {len(saved)} {unit}s, this optimizer has {len(targets)}"
            if nested else
            f"{where} has {len(saved)} {item}s, this optimizer has {len(targets)}"
        )
    out = []
    groups = zip(saved, targets) if nested else [(saved, targets)]
    for gi, (saved_group, target_group) in enumerate(groups):
        gwhere = f"{where}[{gi}]" if nested else where
        if not isinstance(saved_group, (list, tuple)):
            raise TypeError(f"{gwhere} must be a list of tensors, got {type(saved_group).__name__}")
        if len(saved_group) != len(target_group):
            raise ValueError(
                f"{unit} {gi}: {gwhere} has {len(saved_group)} {item}s, this optimizer has "
                f"{len(target_group)}"
            )
        for i, (s, t) in enumerate(zip(saved_group, target_group)):
            name = f"{gwhere}[{i}]"
            if not isinstance(s, Tensor):
                raise TypeError(f"{name} must be a tensor, got {type(s).__name__}")
            if s.dtype != torch.float32:
                raise ValueError(f"{name} has dtype {s.dtype}; {item}s are torch.float32")
            if tuple(s.shape) != tuple(t.shape) or tuple(_local(s).shape) != tuple(_local(t).shape):
                raise ValueError(
                    f"{unit + ' ' + str(gi) + ', ' if nested else ''}{item} {i}: saved shape "
                    f"{tuple(s.shape)} != {tuple(t.shape)} ({name})"
                )
            out.append((name, s, t))
    return out


def check_finite(named: Sequence[Tuple[str, Tensor]]) -> None:
    """ValueError naming the first (key, tensor) that holds inf or nan (one host read)."""
    for (name, _), ok in zip(named, _all_finite([t for _, t in named])):
        if not ok:
            raise ValueError(
                f"{name} holds inf or nan values (a corrupted checkpoint?); refusing to load it"
            )


def check_wrapper_state(wrapper, state_dict, *, mains_key: str, match_mains,
                        extra_keys: Sequence[str] = ()) -> List[Tuple[str, Tensor, Tensor]]:
    """Everything a wrapper's ``load_state_dict`` will load, checked before it changes
    anything (shared by MixedPrecisionOptimizer and DistributedOptimizer): a dict (TypeError,
    also for None) with ``optimizer``, ``mains_key`` and ``extra_keys`` (KeyError); the inner
    optimizer state against the inner optimizer (:func:`check_inner_optimizer_state`: group
    and param counts, the class's hyperparameters, state keys and shapes, finite values); the
    scaler state against the scaler's config; the spike detector's state against the
    detector; the main params (``match_mains(saved) -> [(key, saved, target)]``, then float32,
    shapes and finiteness). Returns the matched main params."""
    check_mapping("state_dict", state_dict)
    for key in ("optimizer", mains_key, *extra_keys):
        if key not in state_dict:
            raise KeyError(f"optimizer state_dict has no {key!r} entry")
    check_inner_optimizer_state(wrapper.optimizer, state_dict["optimizer"])
    scaler = getattr(wrapper, "grad_scaler", None)
    scaler_state = state_dict.get("grad_scaler")
    if scaler is not None and scaler_state is not None:
        _prefixed("state_dict['grad_scaler']", scaler.check_state_dict, scaler_state)
    detector = getattr(wrapper, "spike_detector", None)
    spike_state = state_dict.get("spike_detector")
    if detector is not None and spike_state is not None:
        _prefixed("state_dict['spike_detector']", detector.check_state_dict, spike_state)
    pairs = match_mains(state_dict[mains_key])
    check_finite([(name, s) for name, s, _ in pairs])
    return pairs


def load_wrapper_state(wrapper, state_dict, *, mains_key: str, match_mains, after_copy,
                       extra_keys: Sequence[str] = (), before=None, agree_group=None) -> None:
    """The one all-or-nothing load of the optimizer wrappers: ``before()`` (the wrapper's own
    checks, e.g. a layout), :func:`check_wrapper_state`; with ``agree_group`` (a group whose
    ranks load together and run a collective in ``after_copy``) one all-gather of a refused
    flag, so that a state dict refused on one rank is loaded on none (the others raise
    ValueError naming it); then (nothing can fail any more) the spike detector, the inner
    optimizer, the loss scaler (a RuntimeWarning when one side has no scaler state) and the
    main params, then ``after_copy()`` (main params -> model params). The step guard is reset
    and the settings are compared across ranks again at the next step."""
    error = None
    try:
        if before is not None:
            before()
        pairs = check_wrapper_state(wrapper, state_dict, mains_key=mains_key,
                                    match_mains=match_mains, extra_keys=extra_keys)
    except (TypeError, KeyError, ValueError) as e:
        error = e
    if agree_group is not None and dist.is_initialized() and dist.get_world_size(agree_group) > 1:
        flags = _gather_rows([1.0 if error is not None else 0.0], agree_group)
        if error is not None:
            raise error
        refused = [r for r, row in zip(dist.get_process_group_ranks(agree_group), flags) if row[0]]
        if refused:
            raise ValueError(
                f"the state_dict was refused on rank(s) {refused} of the group that loads "
                "together (see the error there); nothing was loaded on any rank"
            )
    elif error is not None:
        raise error
    detector = getattr(wrapper, "spike_detector", None)
    if detector is not None and state_dict.get("spike_detector") is not None:
        detector.load_state_dict(state_dict["spike_detector"])
    wrapper.optimizer.load_state_dict(state_dict["optimizer"])
    scaler = getattr(wrapper, "grad_scaler", None)
    scaler_state = state_dict.get("grad_scaler")
    if scaler is not None:
        if scaler_state is None:
            warnings.warn("the checkpoint has no grad_scaler state; the loss scaler starts afresh",
                          RuntimeWarning, stacklevel=3)
        else:
            scaler.load_state_dict(scaler_state)
    elif scaler_state:
        warnings.warn(
            "the checkpoint has grad_scaler state but this optimizer has no loss scaler; the "
            "saved loss scale is not used", RuntimeWarning, stacklevel=3,
        )
    with torch.no_grad():
        for _, s, target in pairs:
            _local(target).copy_(_local(s))
        after_copy()
    reset_step_guard(wrapper)
    wrapper._tpamp_settings_agreed = False


def check_optimizer_state_dict(wrapper, state_dict) -> None:
    """:meth:`MixedPrecisionOptimizer.load_state_dict`'s checks (:func:`check_wrapper_state`
    with its ``fp32_from_fp16_params``), without loading."""
    check_wrapper_state(
        wrapper, state_dict, mains_key="fp32_from_fp16_params",
        match_mains=lambda saved: match_saved_tensors(
            "state_dict['fp32_from_fp16_params']", saved, wrapper.main_params_by_group()),
    )
