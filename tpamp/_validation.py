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
import weakref
from collections.abc import Mapping
from typing import Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

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
    """After construction: mark the inner optimizer as wrapped and remember its param groups
    (a group added later would be stepped with still-scaled, unchecked grads)."""
    mark_wrapped(wrapper)
    snapshot_param_groups(wrapper)


def mark_wrapped(wrapper) -> None:
    """Mark the inner optimizer as wrapped, so :func:`check_wrappable` refuses a second wrapper."""
    setattr(wrapper.optimizer, _WRAPPED_ATTR, type(wrapper).__name__)


def snapshot_param_groups(wrapper) -> None:
    """Remember the inner optimizer's param groups as they are now (a subclass that changes
    them on purpose after construction calls this again)."""
    wrapper._tpamp_param_groups = [list(g["params"]) for g in wrapper.optimizer.param_groups]


def _check_param_groups(wrapper) -> None:
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


# ---- optimizer wrappers: the step guard -----------------------------------------------------


def _local(t: Tensor) -> Tensor:
    from tpamp.grad_stats import local_tensor

    return local_tensor(t)


def _inplace_grads(wrapper) -> List[Tensor]:
    """The gradient tensors a step modifies in place (unscale, clip): fp32 grads and main_grad
    buffers. A new backward (or zero_grad) replaces them or bumps their version counter."""
    out = []
    if hasattr(wrapper, "_half_pairs"):
        for pairs, fp32s in zip(wrapper._half_pairs, wrapper._fp32_params):
            for model, _ in pairs:
                g = getattr(model, "main_grad", None)
                if isinstance(g, Tensor) and g.dtype == torch.float32:
                    out.append(_local(g))
            for p in fp32s:
                g = getattr(p, "main_grad", None)
                if g is None:
                    g = p.grad
                if isinstance(g, Tensor):
                    out.append(_local(g))
    else:
        for group in wrapper.optimizer.param_groups:
            for p in group["params"]:
                if isinstance(p.grad, Tensor):
                    out.append(_local(p.grad))
    return out


def _check_new_backward(wrapper, grads: List[Tensor]) -> None:
    last = getattr(wrapper, "_tpamp_last_grads", None)
    if not last or not grads or len(grads) != len(last):
        return
    for g, (ref, version) in zip(grads, last):
        if ref() is not g or g._version != version:
            return  # at least one grad is new: a backward (or zero_grad) ran since the last step
    raise RuntimeError(
        "step() was called again without a new backward: the gradients are the ones the last "
        "step() already unscaled (and clipped); stepping on them again would apply a wrongly "
        "scaled update. Call scale_loss(loss).backward() (after zero_grad()) before each "
        "step(), as torch.amp.GradScaler requires."
    )


def guard_step(step):
    """Decorator for a wrapper's ``step``: checks that the param groups are the wrapped ones and
    that a backward ran since the last step; on the first step, checks that every rank of the
    grad-stats group has the same settings (one small collective, :func:`agree_on_settings`)."""

    @functools.wraps(step)
    def guarded(self, *args, **kwargs):
        _check_param_groups(self)
        _check_new_backward(self, _inplace_grads(self))
        if not getattr(self, "_tpamp_settings_agreed", False):
            agree_on_settings(self)
            self._tpamp_settings_agreed = True
        result = step(self, *args, **kwargs)
        self._tpamp_last_grads = [(weakref.ref(g), g._version) for g in _inplace_grads(self)]
        return result

    return guarded


# ---- cross-rank agreement of settings -------------------------------------------------------

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
    "exp_avg_dtype",
    "exp_avg_sq_dtype",
    "store_param_remainders",
)
# the optimizer-state storage options (issue 22): 0 where a wrapper has none
_STATE_DTYPE_CODES = {torch.float32: 1.0, torch.bfloat16: 2.0, torch.float8_e4m3fn: 3.0}
_WRAPPER_KINDS = {"MixedPrecisionOptimizer": 1.0, "FP32Optimizer": 2.0, "TorchAMPOptimizer": 3.0}
_SCALER_KINDS = {None: 0.0, "ConstantGradScaler": 1.0, "DynamicGradScaler": 2.0,
                 "ModelParallelGradScaler": 3.0, "GradScaler": 4.0}


def _kind_name(table, code: float) -> str:
    for name, c in table.items():
        if c == code:
            return str(name)
    return f"other ({code:g})"


def _settings(wrapper) -> List[float]:
    """This rank's settings that must agree over the grad-stats group, as float64 values in the
    order of _SETTING_NAMES (0 where a setting does not apply; inf for max_scale=None)."""
    v = dict.fromkeys(_SETTING_NAMES, 0.0)
    v["wrapper"] = _WRAPPER_KINDS.get(type(wrapper).__name__, 9.0)
    v["norm_type"] = float(wrapper.norm_type)
    v["log_num_zeros_in_grad"] = float(bool(wrapper.log_num_zeros_in_grad))
    v["clip_grad"] = float(wrapper.clip_grad)
    v["skip_nonfinite"] = float(bool(getattr(wrapper, "skip_nonfinite", True)))
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


def agree_on_settings(wrapper) -> None:
    """Check, with one all-gather over the wrapper's grad-stats group, that every rank has the
    same norm type, zero counting, clip, skip policy and loss-scaler settings and scale.

    Ranks that differ would run different collectives (a zero count on one rank only: a gloo
    error or a hang) or take different skip decisions (silently diverging replicas). Every rank
    raises the same ValueError, naming the first setting that differs and each rank's value."""
    group = _grad_stats_group(wrapper)
    if group is None or not dist.is_initialized() or dist.get_world_size(group) < 2:
        return
    from tpamp.grad_stats import collective_device

    mine = torch.tensor(_settings(wrapper), dtype=torch.float64, device=collective_device(group))
    size = dist.get_world_size(group)
    every = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(every, mine, group=group)
    table = torch.stack(every).cpu().tolist()
    ranks = dist.get_process_group_ranks(group)
    for j, name in enumerate(_SETTING_NAMES):
        column = [row[j] for row in table]
        if all(c == column[0] for c in column):
            continue
        if name == "wrapper":
            shown = [_kind_name(_WRAPPER_KINDS, c) for c in column]
        elif name == "loss scaler":
            shown = [_kind_name(_SCALER_KINDS, c) for c in column]
        elif name in ("exp_avg_dtype", "exp_avg_sq_dtype"):
            shown = [_kind_name({str(k): c for k, c in _STATE_DTYPE_CODES.items()}, c)
                     for c in column]
        elif name == "max_scale":
            shown = ["None" if c == math.inf else f"{c:g}" for c in column]
        else:
            shown = [f"{c:g}" for c in column]
        per_rank = ", ".join(f"rank {r}: {s}" for r, s in zip(ranks, shown))
        raise ValueError(
            f"{name} differs across the {size} ranks of the grad-stats group ({per_rank}); "
            "every rank of the group must use the same settings, or their collectives and "
            "skip decisions diverge"
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
    """Run a scaler's own check, naming the wrapper's key in its error."""
    try:
        return fn(*args)
    except (TypeError, KeyError, ValueError) as e:
        msg = e.args[0] if e.args else str(e)
        raise type(e)(f"{prefix}: {msg}") from e


def check_optimizer_state_dict(wrapper, state_dict) -> None:
    """Everything :meth:`MixedPrecisionOptimizer.load_state_dict` will load, checked before it
    changes anything: the top-level keys, the inner optimizer state (see
    :func:`check_inner_optimizer_state`), the scaler state against the scaler's config, and the
    main params (float32 tensors of the right shapes, all finite)."""
    check_mapping("state_dict", state_dict)
    for key in ("optimizer", "fp32_from_fp16_params"):
        if key not in state_dict:
            raise KeyError(f"optimizer state_dict has no {key!r} entry")
    check_inner_optimizer_state(wrapper.optimizer, state_dict["optimizer"])
    scaler_state = state_dict.get("grad_scaler")
    if wrapper.grad_scaler is not None and scaler_state is not None:
        _prefixed("state_dict['grad_scaler']", wrapper.grad_scaler._parse_state_dict, scaler_state)
    saved = state_dict["fp32_from_fp16_params"]
    if not isinstance(saved, (list, tuple)):
        raise TypeError(
            f"state_dict['fp32_from_fp16_params'] must be a list (per param group) of lists of "
            f"tensors, got {type(saved).__name__}"
        )
    pairs_per_group = wrapper._half_pairs
    if len(saved) != len(pairs_per_group):
        raise ValueError(
            f"state_dict has main params for {len(saved)} param groups, this optimizer "
            f"has {len(pairs_per_group)}"
        )
    tensors, names = [], []
    for gi, (saved_group, pairs) in enumerate(zip(saved, pairs_per_group)):
        if not isinstance(saved_group, (list, tuple)):
            raise TypeError(
                f"state_dict['fp32_from_fp16_params'][{gi}] must be a list of tensors, got "
                f"{type(saved_group).__name__}"
            )
        if len(saved_group) != len(pairs):
            raise ValueError(
                f"param group {gi}: state_dict has {len(saved_group)} main params, "
                f"this optimizer has {len(pairs)}"
            )
        for i, (s, (_, main)) in enumerate(zip(saved_group, pairs)):
            name = f"state_dict['fp32_from_fp16_params'][{gi}][{i}]"
            if not isinstance(s, Tensor):
                raise TypeError(f"{name} must be a tensor, got {type(s).__name__}")
            if s.dtype != torch.float32:
                raise ValueError(f"{name} has dtype {s.dtype}; main params are torch.float32")
            if tuple(s.shape) != tuple(main.shape) or tuple(_local(s).shape) != tuple(_local(main).shape):
                raise ValueError(
                    f"param group {gi}, main param {i}: saved shape {tuple(s.shape)} != "
                    f"{tuple(main.shape)} ({name})"
                )
            tensors.append(s)
            names.append(name)
    for name, ok in zip(names, _all_finite(tensors)):
        if not ok:
            raise ValueError(
                f"{name} holds inf or nan values (a corrupted checkpoint?); refusing to load it"
            )
