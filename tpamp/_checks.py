"""Argument checks shared by every tpamp module: numbers, devices, tensors, process groups.

One family of number checks: :func:`check_real`, :func:`check_int`, :func:`check_bool` and
:func:`check_f32_scale` raise TypeError for a value of the wrong type (a string, None where
None is not allowed, a bool where a number is expected) and ValueError for a value of the right
type that is out of range (nan, inf, negative, above a bound). Every message names the
argument and the bad value.
"""

from __future__ import annotations

import math
import numbers
import struct
from collections.abc import Mapping
from typing import Iterable, List, Optional

import torch
import torch.distributed as dist

Tensor = torch.Tensor
_F32_MAX = float(torch.finfo(torch.float32).max)

__all__ = [
    "as_float32",
    "check_bool",
    "check_device",
    "check_f32_scale",
    "check_group_member",
    "check_int",
    "check_loss",
    "check_mapping",
    "check_narrow_state_scaler",
    "check_norm_type",
    "check_param_names",
    "check_real",
    "check_tensor_list",
    "tp_rank",
]


# ---- numbers --------------------------------------------------------------------------------


def as_float32(value: float) -> float:
    """``value`` rounded to float32 (inf above float32's range, 0 below its smallest subnormal),
    computed on the host without touching any tensor."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def _type_error(name: str, value, expected: str) -> TypeError:
    return TypeError(f"{name} must be {expected}, got {value!r} ({type(value).__name__})")


def check_real(name: str, value, *, low=None, low_inclusive=True, high=None,
               high_inclusive=True, allow_inf=False, allow_none=False) -> Optional[float]:
    """A real number within the given bounds; returns float(value) (None for None when
    ``allow_none``).

    TypeError for anything but a real number (a string, a bool, None unless ``allow_none``);
    ValueError for nan, for +-inf unless ``allow_inf``, and for a value outside [low, high]
    (open ends with ``low_inclusive`` / ``high_inclusive`` False)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _type_error(name, value, "a real number" + (" or None" if allow_none else ""))
    value = float(value)
    if math.isnan(value) or (math.isinf(value) and not allow_inf):
        raise ValueError(f"{name} must be {'not nan' if allow_inf else 'finite'}, got {value!r}")
    if low is not None and (value < low or (value == low and not low_inclusive)):
        raise ValueError(f"{name} must be {'>=' if low_inclusive else '>'} {low}, got {value!r}")
    if high is not None and (value > high or (value == high and not high_inclusive)):
        raise ValueError(f"{name} must be {'<=' if high_inclusive else '<'} {high}, got {value!r}")
    return value


def check_int(name: str, value, *, low: Optional[int] = None, high: Optional[int] = None,
              allow_none: bool = False) -> Optional[int]:
    """An int within [low, high] (a 1-element integer tensor is accepted); returns int(value)
    (None for None when ``allow_none``).

    TypeError for anything but an int (a float such as 2.0, a string, a bool, a floating-point
    tensor, None unless ``allow_none``); ValueError for an int outside [low, high]."""
    if value is None and allow_none:
        return None
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
            raise TypeError(
                f"{name} must be an int, got a tensor of dtype {value.dtype} and shape "
                f"{tuple(value.shape)}"
            )
        value = int(value.reshape(()).item())
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _type_error(name, value, "an int" + (" or None" if allow_none else ""))
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        if low is not None and high is not None:
            expected = f"in [{low}, {high}]"
        else:
            expected = f">= {low}" if low is not None else f"<= {high}"
        raise ValueError(f"{name} must be an int {expected}, got {value}")
    return value


def check_bool(name: str, value) -> bool:
    """True or False (TypeError for anything else, 0 and 1 included)."""
    if not isinstance(value, bool):
        raise _type_error(name, value, "True or False")
    return value


def check_f32_scale(name: str, value, *, allow_none: bool = False,
                    type_error: type = TypeError) -> Optional[float]:
    """A loss scale stored as float32: a real number, finite and > 0 *in float32*.

    TypeError for a non-number (bool included) and ValueError for nan/inf/<= 0 or a value that
    float32 turns into inf (> 3.4028e+38) or 0 (< 1.4e-45). Returns float(value).
    ``type_error`` is accepted for callers not yet updated and ignored: a wrong type is always
    a TypeError (the one rule of this module)."""
    del type_error
    value = check_real(name, value, allow_none=allow_none, allow_inf=True)
    if value is None:
        return None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    f32 = as_float32(value)
    if not (math.isfinite(f32) and f32 > 0):
        raise ValueError(
            f"{name}={value!r} is {f32!r} in float32, the dtype the loss scale is stored in; "
            f"expected a value in [1.4e-45, {_F32_MAX:.6g}]"
        )
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


def check_norm_type(norm_type, name: str = "norm_type") -> float:
    """p of a grad norm: a real number >= 1 or ``math.inf``. TypeError for a non-number (bool
    included), ValueError for nan or a value below 1."""
    return check_real(name, norm_type, low=1.0, allow_inf=True)


def check_mapping(name: str, value) -> Mapping:
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a dict, got {value!r:.80} ({type(value).__name__})")
    return value


# ---- options of the optimizer wrappers -------------------------------------------------------


def check_narrow_state_scaler(grad_scaler, exp_avg_dtype, exp_avg_sq_dtype,
                              store_param_remainders) -> None:
    """Narrow optimizer state (``exp_avg_dtype`` / ``exp_avg_sq_dtype`` other than
    torch.float32, or ``store_param_remainders=True``; tpamp.state_formats) is kept only by the
    one-pass fused step, which runs only with a loss scaler that never drops below 1 (or none):
    raise ValueError at construction, naming the scaler's setting, when ``grad_scaler`` may
    drop below 1 (its ``never_below_one`` is False: a DynamicGradScaler with min_scale < 1, a
    ConstantGradScaler with scale < 1). Call it with the options already checked
    (tpamp.state_formats.check_state_options). Changes nothing."""
    narrow = (exp_avg_dtype != torch.float32 or exp_avg_sq_dtype != torch.float32
              or store_param_remainders is True)
    if not narrow or grad_scaler is None or getattr(grad_scaler, "never_below_one", True):
        return
    cls = type(grad_scaler).__name__
    if hasattr(grad_scaler, "min_scale"):
        setting = f"min_scale={float(grad_scaler.min_scale)!r}"
        fix = "min_scale >= 1"
    elif isinstance(getattr(grad_scaler, "scale", None), Tensor):  # a constant scale
        setting = f"scale={float(grad_scaler.scale.reshape(-1)[0])!r}"
        fix = "a scale >= 1"
    else:
        setting = "never_below_one=False"
        fix = "a scaler that never drops below 1"
    raise ValueError(
        f"exp_avg_dtype={exp_avg_dtype}, exp_avg_sq_dtype={exp_avg_sq_dtype}, "
        f"store_param_remainders={store_param_remainders} are kept only by the one-pass fused "
        f"step, which needs a loss scaler that never drops below 1; this {cls} has {setting}, "
        f"so the loss scale can be below 1 (give it {fix}, or keep float32 state)"
    )


def check_param_names(pairs, name: str = "param_names") -> None:
    """The values of (param name, param) pairs, as the per-parameter grad-norm tracker checks
    them (tpamp.param_norms.ParamGradNormTracker): every name a non-empty string (ValueError
    naming the position), no name given to two different params, no param given two different
    names (ValueError naming both). The same (name, param) pair twice is fine. Types are the
    caller's check. Changes nothing."""
    by_name, by_param = {}, {}
    for i, (n, p) in enumerate(pairs):
        if not isinstance(n, str) or not n:
            raise ValueError(f"{name}: names must be non-empty strings, got {n!r} (entry {i})")
        if n in by_name and by_name[n] is not p:
            raise ValueError(f"{name}: the name {n!r} is given to two different params")
        other = by_param.get(id(p))
        if other is not None and other != n:
            raise ValueError(f"{name}: one param is named both {other!r} and {n!r}")
        by_name[n] = p
        by_param[id(p)] = n
