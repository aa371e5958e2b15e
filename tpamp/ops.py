"""Kernel dispatch: the only caller of multi-tensor ops in tpamp.

Each op here has a pure-PyTorch implementation (``torch._foreach_*`` and the amp ops) that runs
on any device; on CUDA tensors the fused kernels of the extension ``tpamp._C`` (csrc/, registered
as ``torch.ops.tpamp.*``) are used instead when it is built. Both paths give the same results:
norms to fp32 rounding, flags and counts exactly. Contracts: SPEC.md section 4.

Every op takes plain (local) tensors: callers pass ``DTensor.to_local()`` views. Scalars that
depend on device results (loss scale, clip coefficient) are 1-element float32 tensors on the
tensors' device, and no op reads a device value on the host.
"""

from __future__ import annotations

import importlib.util
import math
import warnings
from typing import List, NamedTuple, Optional, Sequence

import torch

__all__ = [
    "GradStats",
    "grad_stats",
    "scale_and_copy",
    "dynamic_scaler_update_",
    "extension_available",
]

Tensor = torch.Tensor
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_ext = None
_ext_error: Optional[str] = None


def _load_extension():
    """Import tpamp._C once; an extension that fails to load (built for another torch, say)
    is ignored with a warning and the PyTorch path is used."""
    global _ext, _ext_error
    if _ext is not None or _ext_error is not None:
        return _ext
    if not torch.version.cuda:
        # A CPU (or ROCm) torch cannot load a CUDA extension; a stale tpamp._C built in the
        # same tree by a CUDA torch is not an error here, so no warning.
        _ext_error = f"torch {torch.__version__} is not a CUDA build"
        return None
    if importlib.util.find_spec("tpamp._C") is None:
        _ext_error = "tpamp._C is not built"  # installed without the extension: no warning
        return None
    try:
        from tpamp import _C  # noqa: F401  (registers torch.ops.tpamp.*)

        _ext = torch.ops.tpamp
    except Exception as e:  # e.g. undefined symbols: built against a different torch
        _ext_error = str(e)
        warnings.warn(
            f"tpamp._C could not be loaded ({_ext_error}); using the PyTorch fallback. "
            "Rebuild tpamp against the installed torch to use the fused CUDA kernels.",
            RuntimeWarning,
            stacklevel=3,
        )
    return _ext


def extension_available() -> bool:
    """True when the CUDA extension tpamp._C is built and loads with this torch."""
    return _load_extension() is not None


_force_fallback = False


def _use_ext(tensors: Sequence[Tensor]) -> bool:
    if _force_fallback or not tensors:
        return False
    if not tensors[0].is_cuda:
        return False
    return _load_extension() is not None and hasattr(_ext, "grad_stats")


class GradStats(NamedTuple):
    """Local (not yet reduced) statistics of one pass over a list of gradients.

    found_inf: float32, shape [1], 1.0 if any element of any tensor (masked or not) is inf/nan.
    norm_stat: float32 0-dim, sum of |g|^p over the masked-in tensors for finite p, max |g| for
        p = inf; None when no norm was asked for. Not rooted: the caller reduces over ranks and
        then takes the p-th root.
    num_zeros: int64 0-dim count of zero elements in the masked-in tensors, or None.
    per_tensor_norms: float32 [len(grads)] p-norm of each tensor (mask ignored), or None.
    """

    found_inf: Tensor
    norm_stat: Optional[Tensor]
    num_zeros: Optional[Tensor]
    per_tensor_norms: Optional[Tensor]


def _check_list(name: str, tensors: Sequence[Tensor]) -> None:
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}[{i}] must be a Tensor, got {type(t).__name__}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(
                f"{name}[{i}] has dtype {t.dtype}; expected one of float32, float16, bfloat16"
            )


def grad_stats(
    grads: Sequence[Tensor],
    *,
    out: Optional[Sequence[Tensor]] = None,
    scale: Optional[Tensor] = None,
    norm_mask: Optional[Sequence[bool]] = None,
    norm_type: Optional[float] = None,
    count_zeros: bool = False,
    per_tensor_norms: bool = False,
    check_finite: bool = True,
    scale_at_most_one: bool = False,
    device: Optional[torch.device] = None,
) -> GradStats:
    """One pass over ``grads``: optional multiply by ``scale``, found_inf, norm statistic, zeros.

    Args:
        grads: tensors of float32/float16/bfloat16, any shapes (empty allowed), one device.
        out: None to multiply in place, or float32 tensors of the same shapes that receive
            ``float32(grads[i]) * scale`` (the fp16/bf16 -> fp32 main-grad copy in the same pass).
            An entry may be the very tensor ``grads[i]`` (fp32): that one is done in place.
            Statistics are taken on the values written.
        scale: None (no multiply) or a 1-element float32 tensor on the grads' device, e.g. the
            inverse loss scale.
        norm_mask: per tensor, True if it counts toward the norm and zeros (default: all).
            found_inf always counts every tensor.
        norm_type: None for no norm, else p >= 1 or ``math.inf``.
        count_zeros: also count zero elements of the masked-in tensors (exact, int64).
        per_tensor_norms: also return each tensor's p-norm (p = norm_type, 2 if None).
        check_finite: False lets the PyTorch path skip the found_inf pass when the caller does not
            need it and passes no scale (found_inf is then all zeros); the fused kernel always
            computes it.
        scale_at_most_one: the caller knows |scale| <= 1 (an inverse loss scale whose scale
            never drops below 1), so the multiply cannot overflow and the PyTorch path checks
            the values and multiplies in one pass. The fused kernel needs no hint.
        device: where results live when ``grads`` is empty (default CPU).

    Returns:
        :class:`GradStats`, all on the grads' device; nothing is read on the host.
    """
    grads = list(grads)
    _check_list("grads", grads)
    if out is not None:
        out = list(out)
        if len(out) != len(grads):
            raise ValueError(f"out has {len(out)} tensors, grads has {len(grads)}")
        for i, (o, g) in enumerate(zip(out, grads)):
            if o.dtype != torch.float32 or o.shape != g.shape:
                raise ValueError(
                    f"out[{i}] must be float32 of shape {tuple(g.shape)}, "
                    f"got {o.dtype} {tuple(o.shape)}"
                )
    if norm_mask is not None:
        norm_mask = [bool(m) for m in norm_mask]
        if len(norm_mask) != len(grads):
            raise ValueError(f"norm_mask has {len(norm_mask)} entries, grads has {len(grads)}")
    if norm_type is not None:
        norm_type = float(norm_type)
        if not (norm_type >= 1.0):
            raise ValueError(f"norm_type must be >= 1 or inf, got {norm_type}")
    if grads:
        device = grads[0].device
    elif device is None:
        device = torch.device("cpu")
    if scale is not None and (scale.numel() != 1 or scale.dtype != torch.float32):
        raise ValueError(
            f"scale must be a 1-element float32 tensor, got {scale.dtype} of shape "
            f"{tuple(scale.shape)}"
        )

    if _use_ext(grads) and (norm_type in (None, 2.0, math.inf)):
        return _grad_stats_ext(grads, out, scale, norm_mask, norm_type, count_zeros, per_tensor_norms)
    return _grad_stats_torch(
        grads, out, scale, norm_mask, norm_type, count_zeros, per_tensor_norms, check_finite,
        device, scale_at_most_one,
    )


def _grad_stats_torch(
    grads, out, scale, norm_mask, norm_type, count_zeros, per_tensor, check_finite, device,
    scale_at_most_one=False,
):
    found_inf = torch.zeros(1, dtype=torch.float32, device=device)
    if out is not None:
        pairs = [(o, g) for o, g in zip(out, grads) if o is not g]
        if pairs:
            torch._foreach_copy_([o for o, _ in pairs], [g for _, g in pairs])
        targets = out
    else:
        targets = grads
    if targets and (check_finite or scale is not None):
        one = torch.ones(1, dtype=torch.float32, device=device)
        by_dtype = {}
        for t in targets:
            by_dtype.setdefault(t.dtype, []).append(t)
        for ts in by_dtype.values():
            if scale is None:
                torch._amp_foreach_non_finite_check_and_unscale_(ts, found_inf, one)
            elif scale_at_most_one:
                # checks the inputs, then multiplies: |x * scale| <= |x| cannot overflow
                torch._amp_foreach_non_finite_check_and_unscale_(ts, found_inf, scale.reshape(1))
            else:
                # multiply first, then check the values written: a scale > 1 may overflow
                torch._foreach_mul_(ts, scale.reshape(()))
                torch._amp_foreach_non_finite_check_and_unscale_(ts, found_inf, one)

    counted = targets if norm_mask is None else [t for t, m in zip(targets, norm_mask) if m]
    norm_stat = None
    if norm_type is not None:
        norms = _norms(counted, norm_type)
        if norms is None:
            norm_stat = torch.zeros((), dtype=torch.float32, device=device)
        elif norm_type == math.inf:
            norm_stat = norms.max()
        else:
            norm_stat = (norms.double() ** norm_type).sum().float()
    num_zeros = None
    if count_zeros:
        num_zeros = torch.zeros((), dtype=torch.int64, device=device)
        for t in counted:
            num_zeros += t.numel() - torch.count_nonzero(t)
    pt = None
    if per_tensor:
        pt = _per_tensor_norms(targets, 2.0 if norm_type is None else norm_type, device)
    return GradStats(found_inf, norm_stat, num_zeros, pt)


def _norms(tensors, p: float) -> Optional[Tensor]:
    """float32 [n] p-norms of the non-empty tensors (None if there are none): _foreach_norm
    rejects empty tensors for p = inf, and an empty tensor contributes 0 to any norm."""
    tensors = [t for t in tensors if t.numel() > 0]
    if not tensors:
        return None
    return torch.stack(torch._foreach_norm(tensors, p, dtype=torch.float32))


def _per_tensor_norms(targets, p: float, device) -> Tensor:
    """float32 [len(targets)] p-norm of each tensor, 0 for an empty one. Built with stack, so
    no index tensor is made on the host (no host-to-device copy in a step)."""
    nonempty = [t for t in targets if t.numel() > 0]
    norms = iter(torch._foreach_norm(nonempty, p, dtype=torch.float32) if nonempty else ())
    zero = torch.zeros((), dtype=torch.float32, device=device)
    if not targets:
        return torch.zeros(0, dtype=torch.float32, device=device)
    return torch.stack([next(norms) if t.numel() > 0 else zero for t in targets])


def _grad_stats_ext(grads, out, scale, norm_mask, norm_type, count_zeros, per_tensor):
    # Contract of torch.ops.tpamp.grad_stats (csrc/): see SPEC.md section 4. Returns
    # (found_inf [1] f32, sumsq [] f32, amax [] f32, zeros [] i64, per_tensor [n] f32).
    # The kernel walks contiguous memory only; other layouts (rare for grads) take the
    # PyTorch path, which gives the same results.
    if not all(t.is_contiguous() for t in grads) or (
        out is not None and not all(o.is_contiguous() for o in out)
    ):
        return _grad_stats_torch(
            grads, out, scale, norm_mask, norm_type, count_zeros, per_tensor, True, grads[0].device
        )
    mask = [True] * len(grads) if norm_mask is None else norm_mask
    found_inf, sumsq, amax, zeros, pt = _ext.grad_stats(
        grads, out if out is not None else [], scale, mask, bool(count_zeros), bool(per_tensor)
    )
    norm_stat = None
    if norm_type is not None:
        norm_stat = amax if norm_type == math.inf else sumsq
    if per_tensor and norm_type == math.inf:
        # The kernel reports per-tensor L2 norms only; the inf case is rare enough to recompute.
        # Built with stack (no index tensor made on the host, so no host-to-device copy).
        pt = _per_tensor_norms(out if out is not None else grads, math.inf, found_inf.device)
    return GradStats(found_inf, norm_stat, zeros if count_zeros else None, pt if per_tensor else None)


def scale_and_copy(
    srcs: Sequence[Tensor], dsts: Sequence[Tensor], scale: Optional[Tensor] = None
) -> None:
    """``dsts[i] = cast(srcs[i] * scale)`` for every i, in one pass.

    srcs and dsts: same shapes, float32/float16/bfloat16 (casts either way). Pass the same list
    twice to scale in place (the clip); pass ``scale=None`` for a plain cast-copy (fp32 main
    params -> fp16/bf16 model params). scale: 1-element float32 tensor on the tensors' device.
    """
    srcs, dsts = list(srcs), list(dsts)
    if len(srcs) != len(dsts):
        raise ValueError(f"srcs has {len(srcs)} tensors, dsts has {len(dsts)}")
    if not srcs:
        return
    _check_list("srcs", srcs)
    _check_list("dsts", dsts)
    if (
        _use_ext(srcs)
        and hasattr(_ext, "scale_and_copy")
        and all(s.is_contiguous() and d.is_contiguous() for s, d in zip(srcs, dsts))
    ):
        _ext.scale_and_copy(srcs, dsts, scale)
        return
    in_place = all(s is d for s, d in zip(srcs, dsts))
    if scale is None:
        if not in_place:
            torch._foreach_copy_(dsts, srcs)
        return
    if in_place:
        torch._foreach_mul_(dsts, scale.reshape(()))
    else:
        # multiply in fp32 (not in the source's half precision), then cast on the copy
        wide = [s if s.dtype == torch.float32 else s.float() for s in srcs]
        torch._foreach_copy_(dsts, torch._foreach_mul(wide, scale.reshape(())))


def dynamic_scaler_update_(
    scale: Tensor,
    growth_tracker: Tensor,
    hysteresis_tracker: Tensor,
    found_inf: Tensor,
    *,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
    min_scale: float,
    max_scale: Optional[float],
    consecutive_hysteresis: bool,
) -> None:
    """Megatron-LM's DynamicGradScaler.update on the device, in place (SPEC.md section 1).

    scale: float32 [1]; growth_tracker, hysteresis_tracker: int32 [1]; found_inf: any float or
    bool tensor with one element (nonzero means overflow). All on one device; no host read.
    """
    if scale.is_cuda and _load_extension() is not None and hasattr(_ext, "dynamic_scaler_update_") and not _force_fallback:
        _ext.dynamic_scaler_update_(
            scale, growth_tracker, hysteresis_tracker,
            found_inf.reshape(1).to(device=scale.device, dtype=torch.float32),
            float(growth_factor), float(backoff_factor), int(growth_interval), int(hysteresis),
            float(min_scale), float(max_scale) if max_scale is not None else math.inf,
            bool(consecutive_hysteresis),
        )
        return
    inf = found_inf.reshape(1).to(device=scale.device) != 0
    # overflow: reset growth, spend hysteresis, back off once it is spent (floor at min_scale)
    hyst_after_inf = hysteresis_tracker - 1
    backoff = inf & (hyst_after_inf <= 0)
    # clean step: count towards growth; grow (and refill hysteresis) at the interval
    growth_after_ok = growth_tracker + 1
    grow = (~inf) & (growth_after_ok == growth_interval)
    hyst_after_ok = torch.full_like(hysteresis_tracker, hysteresis) if consecutive_hysteresis else hysteresis_tracker
    new_growth = torch.where(inf | grow, torch.zeros_like(growth_tracker), growth_after_ok)
    new_hyst = torch.where(inf, hyst_after_inf, torch.where(grow, torch.full_like(hysteresis_tracker, hysteresis), hyst_after_ok))
    backed = torch.clamp(scale * backoff_factor, min=min_scale)
    grown = scale * growth_factor
    if max_scale is not None:
        grown = torch.clamp(grown, max=max_scale)
    new_scale = torch.where(backoff, backed, torch.where(grow, grown, scale))
    scale.copy_(new_scale)
    growth_tracker.copy_(new_growth)
    hysteresis_tracker.copy_(new_hyst)
