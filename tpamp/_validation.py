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
    if not isinstance(group, dist.ProcessGroup):
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
