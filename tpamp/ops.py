"""Kernel dispatch: the only caller of multi-tensor ops in tpamp.

Each op here has a pure-PyTorch implementation (``torch._foreach_*`` and the amp ops) that runs
on any device; on CPU and CUDA tensors the fused one-pass kernels of ``tpamp._C*`` (csrc/,
registered as ``torch.ops.tpamp.*``, loaded by tpamp/_ext.py) are used instead when they are
built. Both paths give the same results: norms to fp32 rounding, flags and counts exactly.
Contracts: docs/spec.md section 4.

Dispatch: every tensor's device is checked (one device for the whole call, the scale included,
else a ValueError). Tensors the kernels take -- float32/float16/bfloat16, non-overlapping and dense
(any dimension order, e.g. channels_last), an output with its input's strides -- go to the
kernels; only the others take the PyTorch path, and the results are combined.

Every op takes plain (local) tensors: callers pass ``DTensor.to_local()`` views. Scalars that
depend on device results (loss scale, clip coefficient) are 1-element float32 tensors on the
tensors' device, and no op reads a device value on the host.

:func:`force_fallback` runs every op on the PyTorch path while it is active (tests compare the
two paths, benchmarks time them). The narrow-state formats the Adam step reads and writes
(bf16 / 8-bit moments, param remainders) live in :mod:`tpamp.state_formats`; their functions
(``encode_moment``, ``decode_moment``, ``join_remainders``, ``split_remainders``,
``moment_blocks``, ``MOMENT_BLOCK``, ``MOMENT_DTYPES``) are importable from here too.
"""

from __future__ import annotations

import contextlib
import math
import operator
import threading
from typing import Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch

from tpamp import _ext

# the narrow-state formats, also importable from here under their names of before
# (tpamp.ops.encode_moment...; "X as X" marks a re-export)
from tpamp.state_formats import BLOCKWISE_DTYPES as BLOCKWISE_DTYPES
from tpamp.state_formats import MOMENT_BLOCK as MOMENT_BLOCK
from tpamp.state_formats import MOMENT_DTYPES as MOMENT_DTYPES
from tpamp.state_formats import decode_moment as decode_moment
from tpamp.state_formats import encode_moment as encode_moment
from tpamp.state_formats import join_remainders as join_remainders
from tpamp.state_formats import moment_blocks as moment_blocks
from tpamp.state_formats import split_remainders as split_remainders
from tpamp.state_formats import stochastic_round_bf16 as stochastic_round_bf16

__all__ = [
    "GradStats",
    "grad_stats",
    "scale_and_copy",
    "dynamic_scaler_update_",
    "fused_adam_step_",
    "fused_sgd_step_",
    "extension_available",
    "force_fallback",
    "fallback_forced",
]

Tensor = torch.Tensor
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# True while a force_fallback() context is active anywhere in the process (read by _kernels
# only; set by force_fallback under _fallback_lock).
_force_fallback = False
_fallback_depth = 0
_fallback_lock = threading.Lock()


@contextlib.contextmanager
def force_fallback(enabled: bool = True) -> Iterator[None]:
    """Run every op of this module on its PyTorch path (no tpamp._C* kernel) inside the block.

    ``with tpamp.ops.force_fallback(): ...`` -- for tests that compare the kernels with the
    reference and benchmarks that time both. Results agree between the paths as the module
    docstring says; only the speed differs.

    Process-wide: while any such block is active, in any thread, every call of every thread
    takes the PyTorch path (the optimizer step may call the ops from another thread, e.g.
    autograd hooks). Nestable and thread-safe: a count of the active blocks is kept under a
    lock, and the kernels come back when the last one exits (also on an exception).
    ``enabled=False`` does nothing (for code that forces the path conditionally; it does not
    turn the kernels back on inside an enclosing block). Usable as a decorator."""
    global _force_fallback, _fallback_depth
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    if not enabled:
        yield
        return
    with _fallback_lock:
        _fallback_depth += 1
        _force_fallback = True
    try:
        yield
    finally:
        with _fallback_lock:
            _fallback_depth -= 1
            _force_fallback = _fallback_depth > 0


def fallback_forced() -> bool:
    """True while a :func:`force_fallback` block is active (the ops take the PyTorch path)."""
    return _force_fallback


def _kernels(device: torch.device):
    """torch.ops.tpamp when the kernels run on ``device``, else None (tpamp._ext warns once)."""
    if _force_fallback:
        return None
    return _ext.ops_for(device)


def extension_available(device: Optional[torch.device] = None) -> bool:
    """True when the kernels of tpamp._C* load and run on ``device`` (default: CPU)."""
    return _ext.ops_for(torch.device("cpu") if device is None else torch.device(device)) is not None


def _common_device(what: str, tensors: Sequence[Tensor], scale: Optional[Tensor] = None):
    """The one device of all ``tensors`` (and of ``scale``); ValueError naming the first tensor
    elsewhere."""
    device = tensors[0].device if tensors else (scale.device if scale is not None else None)
    for name, ts in (what, tensors), ("scale", [scale] if scale is not None else []):
        for i, t in enumerate(ts):
            if t.device != device:
                where = name if name == "scale" else f"{name}[{i}]"
                raise ValueError(
                    f"{where} is on {t.device}, expected {device} (all tensors of one call on "
                    "one device)"
                )
    return device


def _check_on(name: str, tensors: Sequence[Tensor], device: torch.device) -> None:
    for i, t in enumerate(tensors):
        if t.device != device:
            raise ValueError(
                f"{name}[{i}] is on {t.device}, expected {device} (all tensors of one call on "
                "one device)"
            )


def _dense(t: Tensor) -> bool:
    """Non-overlapping and dense: the elements fill one block of memory in some dimension
    order (contiguous, channels_last, a transpose...), as ATen's is_non_overlapping_and_dense."""
    if t.numel() <= 1 or t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _kernel_ok(t: Tensor, like: Optional[Tensor] = None) -> bool:
    """Whether the kernels take ``t`` and its output ``like`` (dense, the same strides)."""
    if not _dense(t):
        return False
    if like is not None and t.numel() > 1 and (like.stride() != t.stride() or not _dense(like)):
        return False
    return True


class GradStats(NamedTuple):
    """Local (not yet reduced) statistics of one pass over a list of gradients.

    found_inf: float32, shape [1], 1.0 if any element of any tensor (masked or not) is inf/nan.
    norm_stat: 0-dim, sum of |g|^p over the masked-in tensors for finite p (float64: a sum of
        squares that overflows float32 stays finite), max |g| for p = inf (float32); None when no
        norm was asked for. Not rooted: the caller reduces over ranks and
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
        grads: tensors of float32/float16/bfloat16, any shapes (empty allowed), one device
            (every tensor, out and scale included, is checked: ValueError naming the first
            elsewhere). Dense tensors of any layout go to the kernels, others (e.g. strided
            slices) to the PyTorch path, and the results are combined.
        out: None to multiply in place, or float32 tensors of the same shapes that receive
            ``float32(grads[i]) * scale`` (the fp16/bf16 -> fp32 main-grad copy in the same pass).
            An entry may be the very tensor ``grads[i]`` (fp32): that one is done in place.
            Otherwise no written tensor may share memory with another entry (the kernels raise
            RuntimeError). Statistics are taken on the values written.
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
    if out is None and not per_tensor_norms and grads:
        stats = _grad_stats_kernel_first(grads, scale, norm_mask, norm_type, count_zeros)
        if stats is not None:
            return stats
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
    if scale is not None and (scale.numel() != 1 or scale.dtype != torch.float32):
        raise ValueError(
            f"scale must be a 1-element float32 tensor, got {scale.dtype} of shape "
            f"{tuple(scale.shape)}"
        )
    if grads:
        device = _common_device("grads", grads, scale)
        if out is not None:
            _check_on("out", out, device)
    elif device is None:
        device = torch.device("cpu") if scale is None else scale.device

    kernels = _kernels(device) if grads and norm_type in (None, 2.0, math.inf) else None
    if kernels is not None:
        return _grad_stats_ext(
            kernels, grads, out, scale, norm_mask, norm_type, count_zeros, per_tensor_norms,
            check_finite, device, scale_at_most_one,
        )
    return _grad_stats_torch(
        grads, out, scale, norm_mask, norm_type, count_zeros, per_tensor_norms, check_finite,
        device, scale_at_most_one,
    )


_DTYPE_OF = operator.attrgetter("dtype")
_DEVICE_OF = operator.attrgetter("device")


def _grad_stats_kernel_first(grads, scale, norm_mask, norm_type, count_zeros):
    """The usual call of :func:`grad_stats` (no out, no per-tensor norms, the kernels built, in
    eager mode) straight to the kernel, which checks every tensor itself (one device, float
    dtypes, dense layouts) before it reads or writes anything: ~50 us of host time a step for
    200 grads. None when this call is not such a call or the kernel refuses it: then the full
    path runs as before (its own checks and errors, the PyTorch path for what the kernels
    cannot take)."""
    if norm_type not in (None, 2.0, math.inf) or torch.compiler.is_compiling():
        return None
    if norm_mask is None:
        mask = [True] * len(grads)
    else:
        mask = list(map(bool, norm_mask))
        if len(mask) != len(grads):
            return None
    if scale is not None and not (isinstance(scale, Tensor) and scale.numel() == 1
                                  and scale.dtype == torch.float32):
        return None
    # one device (a tensor elsewhere could send the call to another key's kernel, e.g. the
    # meta one, which checks nothing): the full path names the tensor elsewhere
    try:
        devices = set(map(_DEVICE_OF, grads))
    except AttributeError:  # not a tensor: the full path's TypeError
        return None
    if len(devices) != 1 or (scale is not None and scale.device not in devices):
        return None
    kernels = _kernels(next(iter(devices)))
    if kernels is None:
        return None
    try:
        found_inf, sumsq, amax, zeros, _ = kernels.grad_stats_(
            grads, scale, mask, bool(count_zeros), False)
    except (RuntimeError, TypeError):
        return None
    stat = None if norm_type is None else (amax if norm_type == math.inf else sumsq)
    return GradStats(found_inf, stat, zeros if count_zeros else None, None)


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
            wide = torch.float32 if norm_type == math.inf else torch.float64
            norm_stat = torch.zeros((), dtype=wide, device=device)
        elif norm_type == math.inf:
            norm_stat = norms.max()
        else:
            norm_stat = (norms.double() ** norm_type).sum()
    num_zeros = None
    if count_zeros:
        num_zeros = torch.zeros((), dtype=torch.int64, device=device)
        for t in counted:
            num_zeros += t.numel() - torch.count_nonzero(t)
    pt = None
    if per_tensor:
        pt = _per_tensor_norms(targets, 2.0 if norm_type is None else norm_type, device)
    return GradStats(found_inf, norm_stat, num_zeros, pt)


def _acc_dtype(p: float) -> torch.dtype:
    """Accumulation dtype of a p-norm: float64 for finite p, so a sum of |g|^p beyond the float32
    range (|g| > ~1.8e19 for p = 2) stays finite, as in the kernels; a max is exact in float32."""
    return torch.float32 if p == math.inf else torch.float64


def _norms(tensors, p: float) -> Optional[Tensor]:
    """[n] p-norms of the non-empty tensors (float64 for finite p, float32 for inf; None if
    there are none): _foreach_norm rejects empty tensors for p = inf, and an empty tensor
    contributes 0 to any norm."""
    tensors = [t for t in tensors if t.numel() > 0]
    if not tensors:
        return None
    return torch.stack(torch._foreach_norm(tensors, p, dtype=_acc_dtype(p)))


def _per_tensor_norms(targets, p: float, device) -> Tensor:
    """float32 [len(targets)] p-norm of each tensor, 0 for an empty one. Built with stack, so
    no index tensor is made on the host (no host-to-device copy in a step)."""
    nonempty = [t for t in targets if t.numel() > 0]
    norms = iter(torch._foreach_norm(nonempty, p, dtype=_acc_dtype(p)) if nonempty else ())
    zero = torch.zeros((), dtype=_acc_dtype(p), device=device)
    if not targets:
        return torch.zeros(0, dtype=torch.float32, device=device)
    return torch.stack([next(norms) if t.numel() > 0 else zero for t in targets]).float()


def _grad_stats_ext(
    kernels, grads, out, scale, norm_mask, norm_type, count_zeros, per_tensor, check_finite,
    device, scale_at_most_one,
):
    """grad_stats through torch.ops.tpamp.grad_stats_ (entries done in place: no out, or
    out[i] is grads[i]) and grad_stats_out (the others), with the tensors the kernels cannot take
    on the PyTorch path; the parts' statistics are combined."""
    n = len(grads)
    mask = [True] * n if norm_mask is None else norm_mask
    in_place, copied, rest = [], [], []
    if out is None and all(map(Tensor.is_contiguous, grads)):  # the usual case, checked fast
        in_place = list(range(n))
    else:
        for i, g in enumerate(grads):
            o = None if out is None else out[i]
            if o is None or o is g:
                (in_place if _kernel_ok(g) else rest).append(i)
            else:
                (copied if _kernel_ok(g, o) else rest).append(i)
    want_pt = per_tensor and norm_type != math.inf  # the kernels give per-tensor L2 norms
    parts = []  # (indices, found_inf, norm_stat, num_zeros, per_tensor_norms)
    for idx, op in ((in_place, "in_place"), (copied, "copied")):
        if not idx:
            continue
        if len(idx) == n:
            sub, sub_mask = grads, mask
        else:
            sub = [grads[i] for i in idx]
            sub_mask = [mask[i] for i in idx]
        if op == "in_place":
            res = kernels.grad_stats_(sub, scale, sub_mask, bool(count_zeros), want_pt)
        else:
            res = kernels.grad_stats_out(
                sub, scale, sub_mask, bool(count_zeros), want_pt, out=[out[i] for i in idx]
            )
        found_inf, sumsq, amax, zeros, pt = res
        stat = None if norm_type is None else (amax if norm_type == math.inf else sumsq)
        parts.append((idx, found_inf, stat, zeros if count_zeros else None, pt))
    if rest:
        st = _grad_stats_torch(
            [grads[i] for i in rest], None if out is None else [out[i] for i in rest], scale,
            [mask[i] for i in rest], norm_type, count_zeros, want_pt, check_finite, device,
            scale_at_most_one,
        )
        parts.append((rest, st.found_inf, st.norm_stat, st.num_zeros, st.per_tensor_norms))

    if len(parts) == 1:
        _, found_inf, norm_stat, num_zeros, pt = parts[0]
    else:
        found_inf = parts[0][1]
        norm_stat = parts[0][2]
        num_zeros = parts[0][3]
        for _, f, st, z, _pt in parts[1:]:
            found_inf = torch.maximum(found_inf, f)
            if norm_stat is not None:
                if norm_type == math.inf:
                    norm_stat = torch.maximum(norm_stat, st)  # NaN wins
                else:
                    norm_stat = norm_stat.double() + st.double()
            if num_zeros is not None:
                num_zeros = num_zeros + z
        pt = None
        if want_pt:
            # back to the caller's order; built with stack (no index tensor made on the host)
            slot = {}
            for idx, _, _, _, part_pt in parts:
                for k, i in enumerate(idx):
                    slot[i] = part_pt[k]
            pt = torch.stack([slot[i] for i in range(n)])
    if per_tensor and norm_type == math.inf:
        # The kernels report per-tensor L2 norms only; the inf case is rare enough to recompute.
        pt = _per_tensor_norms(grads if out is None else out, math.inf, device)
    return GradStats(found_inf, norm_stat, num_zeros, pt if per_tensor else None)


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
    if scale is not None and (scale.numel() != 1 or scale.dtype != torch.float32):
        raise ValueError(
            f"scale must be a 1-element float32 tensor, got {scale.dtype} of shape "
            f"{tuple(scale.shape)}"
        )
    for i, (s_, d) in enumerate(zip(srcs, dsts)):
        if s_.shape != d.shape:
            raise ValueError(
                f"dsts[{i}] has shape {tuple(d.shape)}, srcs[{i}] has shape {tuple(s_.shape)}"
            )
    device = _common_device("srcs", srcs, scale)
    _check_on("dsts", dsts, device)
    kernels = _kernels(device)
    if kernels is not None:
        in_place = [s_ for s_, d in zip(srcs, dsts) if s_ is d and _kernel_ok(s_)]
        copied = [(s_, d) for s_, d in zip(srcs, dsts) if s_ is not d and _kernel_ok(s_, d)]
        if in_place and scale is not None:
            kernels.scale_(in_place, scale)  # no memory traffic when scale == 1
        if copied:
            kernels.scale_and_copy([p[0] for p in copied], [p[1] for p in copied], scale)
        rest = [
            (s_, d) for s_, d in zip(srcs, dsts)
            if not (_kernel_ok(s_) if s_ is d else _kernel_ok(s_, d))
        ]
        if not rest:
            return
        srcs, dsts = [p[0] for p in rest], [p[1] for p in rest]
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
    """Megatron-LM's DynamicGradScaler.update on the device, in place (docs/spec.md section 1).

    scale: float32 [1]; growth_tracker, hysteresis_tracker: int32 [1]; found_inf: any float or
    bool tensor with one element (nonzero means overflow). All on one device; no host read.
    """
    kernels = None
    if growth_tracker.device == scale.device and hysteresis_tracker.device == scale.device:
        kernels = _kernels(scale.device)
    if kernels is not None:
        kernels.dynamic_scaler_update_(
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


# -- one-pass optimizer step ------------------------------------------------------------------
#
# Contract of torch.ops.tpamp.fused_adam_step_ / fused_sgd_step_ (csrc/kernels/optimizer_step.h
# holds the per-element math, csrc/cpu and csrc/cuda its launchers) and of the PyTorch reference
# below, which states the same math with tensor ops: it is the fallback where the extension is
# not built and the tests' second opinion.


def _check_step_lists(op: str, params, grads, model_params, **state_lists) -> None:
    n = len(params)
    lists = {"grads": grads, **state_lists}
    if model_params is not None:
        lists["model_params"] = model_params
    for name, lst in lists.items():
        if len(lst) != n:
            raise ValueError(f"{op}: params has {n} tensors, {name} has {len(lst)}")
    _check_list("grads", grads)
    for i, p in enumerate(params):
        if not isinstance(p, Tensor) or p.dtype != torch.float32:
            raise TypeError(
                f"{op}: params[{i}] must be a float32 tensor (the fp32 main param), got "
                f"{getattr(p, 'dtype', type(p).__name__)}"
            )
        for name, lst in lists.items():
            t = lst[i]
            if t is None:
                continue
            if t.shape != p.shape:
                raise ValueError(
                    f"{op}: {name}[{i}] has shape {tuple(t.shape)}, params[{i}] has "
                    f"{tuple(p.shape)}"
                )
            if t.device != p.device:
                raise ValueError(
                    f"{op}: {name}[{i}] is on {t.device}, params[{i}] on {p.device}"
                )
        for name in state_lists:
            t = lists[name][i]
            if t is not None and name != "steps" and t.dtype != torch.float32:
                raise TypeError(f"{op}: {name}[{i}] must be float32, got {t.dtype}")
        if model_params is not None and model_params[i].dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(
                f"{op}: model_params[{i}] must be float16 or bfloat16, got {model_params[i].dtype}"
            )


def _check_device_scalar(name: str, t: Optional[Tensor], device: torch.device) -> None:
    if t is None:
        return
    if not isinstance(t, Tensor) or t.numel() != 1 or t.dtype != torch.float32:
        raise ValueError(
            f"{name} must be a 1-element float32 tensor, got "
            f"{getattr(t, 'dtype', type(t).__name__)} of shape {tuple(getattr(t, 'shape', ()))}"
        )
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the tensors on {device}")


def _lr_args(lr, device):
    """(lr_tensor or None, lr float) as the ops take them: a tensor lr is read on the device."""
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError(f"a tensor lr must have one element, got shape {tuple(lr.shape)}")
        return lr.reshape(1).to(device=device, dtype=torch.float32), 0.0
    return None, float(lr)


def _check_lengths(op: str, params, **lists) -> None:
    for name, lst in lists.items():
        if lst is not None and len(lst) != len(params):
            raise ValueError(f"{op}: params has {len(params)} tensors, {name} has {len(lst)}")


_FP32_ONLY = {torch.float32}


def _kernel_layouts_ok(lists) -> bool:
    """All contiguous (the usual case, checked fast), or each param's tensors dense alike."""
    if all(all(map(Tensor.is_contiguous, lst)) for lst in lists):
        return True
    return _kernel_layout_ok(*lists)


def _kernel_layout_ok(*tensor_lists) -> bool:
    """The kernels walk every tensor of one param in the same element order: all dense, with
    the same strides (contiguous, or e.g. all channels_last)."""
    return all(
        _kernel_ok(t, like) for group in zip(*tensor_lists) for t in group[:1] for like in group
    )


def _step_kernels(device: torch.device, name: str):
    """torch.ops.tpamp when it has the step op ``name`` for ``device``, else None."""
    kernels = _kernels(device)
    return kernels if kernels is not None and hasattr(kernels, name) else None


def fused_adam_step_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    steps: Sequence[Tensor],
    *,
    model_params: Optional[Sequence[Tensor]] = None,
    grad_scale: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None,
    lr,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    maximize: bool = False,
    exp_avg_scales: Optional[Sequence[Optional[Tensor]]] = None,
    exp_avg_sq_scales: Optional[Sequence[Optional[Tensor]]] = None,
    stochastic_rounding: Optional[Sequence[Tuple[int, int]]] = None,
) -> None:
    """One Adam/AdamW step of torch.optim.Adam/AdamW (for-loop/fused math) over a list of
    fp32 main params, reading the grads once and writing the fp16/bf16 model params, in place.

    For each i, with g = float32(grads[i]) * grad_scale (negated when maximize):
    steps[i] += 1; AdamW: p *= 1 - lr * weight_decay (Adam: g += weight_decay * p);
    exp_avg.lerp_(g, 1 - beta1); exp_avg_sq = exp_avg_sq * beta2 + (1 - beta2) * g * g;
    p += -lr / (1 - beta1^step) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2^step) + eps);
    model_params[i] = cast(p). The bias corrections are float64 of the step count, as
    torch.optim computes them; the state is torch.optim's own (exp_avg, exp_avg_sq, step).
    A tensor with a uint8 moment is stepped with torchao's AdamW8bit arithmetic instead
    (float32 bias corrections, both moments by lerp; docs/spec.md section 9).

    Args:
        params: float32 main params (plain local tensors), any shapes; empty tensors allowed.
        grads: float32/float16/bfloat16, same shapes: the model grads or fp32 main_grads.
        exp_avgs, exp_avg_sqs: float32, same shapes (torch.optim's state, updated in place).
        steps: per param a float32 (or float64) tensor with one element (the step count, as
            torch.optim keeps it), on the params' device; incremented in place.
        model_params: None, or float16/bfloat16 tensors of the same shapes that receive the
            updated params (the copy back to the model, in the same pass).
        grad_scale: None or a 1-element float32 tensor on the params' device that multiplies
            every grad (1/loss scale x clip coefficient).
        found_inf: None or a 1-element float32 tensor on the params' device: when nonzero,
            nothing is changed (no param, state or step count). Read on the device.
        lr: float, or a 1-element tensor (read on the device).
        beta1, beta2, eps, weight_decay: the param group's hyperparameters (floats).
        decoupled_weight_decay: True for AdamW, False for Adam's L2 penalty.
        maximize: ascend instead of descend (torch.optim's maximize).
        exp_avg_scales, exp_avg_sq_scales: narrow state (formats in :mod:`tpamp.state_formats`
            and csrc/kernels/optimizer_step.h): exp_avgs[i] and
            exp_avg_sqs[i] may be bfloat16, uint8 (dynamic-map codes) or float8_e4m3fn; an
            8-bit one needs its float32
            per-block scales (shape [moment_blocks(numel)], contiguous) at index i of these
            lists (None for the others). params[i] may be the int16 remainder of a bfloat16
            model_params[i] (no fp32 master: see :func:`join_remainders`); the step is then
            bit-identical to the fp32-master step on join_remainders(model, remainder).
        stochastic_rounding: None, or per param a (key, first index) pair of ints (key in
            [0, 2^63): :func:`tpamp.state_formats.stochastic_rounding_key`; first index >= 0:
            the global position of params[i]'s first element in its flattened param, for a
            ZeRO-1 piece its offset). Then params[i] may be a bfloat16 param with no master
            (docs/spec.md section 21): it is widened to float32, stepped, and written back in
            place with stochastic rounding (random bits
            :func:`tpamp.state_formats.stochastic_rounding_bits` of (key, step count after the
            increment, first index + position)); model_params must be None. Entries with a
            float32 or int16 param ignore their pair. The reference (no extension) reads the
            step counts of these params on the host.

    Raises ValueError/TypeError for mismatched lengths, shapes, devices or dtypes.
    Uses the extension's kernel (CPU or CUDA) when built, else the PyTorch reference.
    """
    params, grads = list(params), list(grads)
    exp_avgs, exp_avg_sqs, steps = list(exp_avgs), list(exp_avg_sqs), list(steps)
    if model_params is not None:
        model_params = list(model_params)
    op = "fused_adam_step_"
    _check_lengths(op, params, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs,
                   steps=steps, model_params=model_params, exp_avg_scales=exp_avg_scales,
                   exp_avg_sq_scales=exp_avg_sq_scales)
    if not params:
        return
    device = params[0].device
    lr_tensor, lr_float = _lr_args(lr, device)
    hyper = (float(beta1), float(beta2), float(eps), float(weight_decay),
             bool(decoupled_weight_decay), bool(maximize))
    kernels = _step_kernels(device, "fused_adam_step_")
    # The op checks every argument itself (csrc/host/optimizer_step_checks.h) before it writes
    # anything -- dtypes, devices, dense layouts. In eager mode it is called first: with no
    # scales and no stochastic rounding the call is the one the checks below would make, and
    # they run (naming the problem, or taking the PyTorch path for layouts the kernels do not
    # take) only when it refuses. 1000 tensors: ~100 us of host time a step. While
    # torch.compile traces, the fake kernel checks nothing: the checks come first.
    eager = kernels is not None and not torch.compiler.is_compiling()
    if eager and exp_avg_scales is None and exp_avg_sq_scales is None \
            and stochastic_rounding is None:
        try:
            kernels.fused_adam_step_(
                params, exp_avgs, exp_avg_sqs, steps, model_params or [], grads, grad_scale,
                found_inf, lr_tensor, lr_float, *hyper, [], [], None)
            return
        except RuntimeError:
            pass
    dtypes = set(map(_DTYPE_OF, params))
    dtypes.update(map(_DTYPE_OF, exp_avgs))
    dtypes.update(map(_DTYPE_OF, exp_avg_sqs))
    if dtypes == _FP32_ONLY and stochastic_rounding is None:
        # fp32 mains and moments: no narrow state, no scales, no bf16 param (fast path)
        scale_lists, narrow, sr_rows = [[], []], False, None
    else:
        scale_lists = [_scale_list(exp_avg_scales, exp_avgs, device),
                       _scale_list(exp_avg_sq_scales, exp_avg_sqs, device)]
        narrow = _check_narrow_state(op, params, exp_avgs, exp_avg_sqs, model_params, scale_lists)
        sr_rows = _stochastic_rounding_rows(op, params, model_params, stochastic_rounding)
    lists = [params, grads, exp_avgs, exp_avg_sqs] + ([model_params] if model_params else [])
    # eager: the layouts are looked at only when the op refuses them (comment above)
    if kernels is not None and (eager or _kernel_layouts_ok(lists)):
        try:
            kernels.fused_adam_step_(
                params, exp_avgs, exp_avg_sqs, steps, model_params or [], grads, grad_scale,
                found_inf, lr_tensor, lr_float, *hyper, *scale_lists,
                _stochastic_rounding_tensor(sr_rows, device),
            )
            return
        except RuntimeError:
            if not eager or _kernel_layouts_ok(lists):
                raise
    if narrow:
        _check_step_lists(op, [_master_like(p) for p in params], grads, model_params,
                          exp_avgs=[_master_like(m) for m in exp_avgs],
                          exp_avg_sqs=[_master_like(v) for v in exp_avg_sqs])
    else:
        _check_step_lists(op, params, grads, model_params, exp_avgs=exp_avgs,
                          exp_avg_sqs=exp_avg_sqs)
    for i, (p, s) in enumerate(zip(params, steps)):
        if p.device != device:
            raise ValueError(f"{op}: params[{i}] is on {p.device}, params[0] on {device}")
        if s.numel() != 1 or s.dtype not in (torch.float32, torch.float64) or s.device != device:
            raise ValueError(
                f"{op}: steps[{i}] must be a 1-element float32/float64 tensor on {device}, got "
                f"{s.dtype} of shape {tuple(s.shape)} on {s.device}"
            )
    _check_device_scalar("grad_scale", grad_scale, device)
    _check_device_scalar("found_inf", found_inf, device)
    _adam_step_torch(params, grads, exp_avgs, exp_avg_sqs, steps, model_params, grad_scale,
                     found_inf, lr_tensor, lr_float, *hyper, scale_lists=scale_lists,
                     sr_rows=sr_rows)


def _stochastic_rounding_rows(op, params, model_params, stochastic_rounding):
    """The checked (key, first index) pairs as a tuple of int pairs, or None."""
    if stochastic_rounding is None:
        for i, p in enumerate(params):
            if p.dtype == torch.bfloat16:
                raise TypeError(
                    f"{op}: params[{i}] is bfloat16 (a bf16 param with stochastic rounding), "
                    "which needs stochastic_rounding=[(key, first index), ...]")
        return None
    rows = []
    for i, row in enumerate(stochastic_rounding):
        if (not isinstance(row, (tuple, list)) or len(row) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in row)):
            raise TypeError(f"{op}: stochastic_rounding[{i}] must be a (key, first index) pair "
                            f"of ints, got {row!r}")
        key, first = row
        if not 0 <= key < 2**63 or not 0 <= first < 2**63:
            raise ValueError(f"{op}: stochastic_rounding[{i}] = {row!r}: expected 0 <= key < "
                             "2^63 and 0 <= first index < 2^63")
        rows.append((key, first))
    if len(rows) != len(params):
        raise ValueError(f"{op}: params has {len(params)} tensors, stochastic_rounding has "
                         f"{len(rows)} pairs")
    if model_params is not None and any(p.dtype == torch.bfloat16 for p in params):
        raise ValueError(f"{op}: bfloat16 params (stochastic rounding) are their own model "
                         "params: expected model_params=None")
    return tuple(rows)


_SR_TENSORS: Dict[tuple, Tensor] = {}


def _stochastic_rounding_tensor(rows, device) -> Optional[Tensor]:
    """The op's int64 [n, 2] tensor of ``rows`` on ``device`` (kept: the same params give the
    same rows every step, so a device copy is made once)."""
    if rows is None:
        return None
    key = (str(device), rows)
    t = _SR_TENSORS.get(key)
    if t is None:
        if len(_SR_TENSORS) >= 256:
            _SR_TENSORS.clear()
        t = _SR_TENSORS[key] = torch.tensor(rows, dtype=torch.int64).reshape(-1, 2).to(device)
    return t


def _master_like(t: Tensor) -> Tensor:
    """A float32 stand-in of a narrow state tensor (same shape and device) for the checks."""
    return t if t.dtype == torch.float32 else torch.empty_like(t, dtype=torch.float32)


def _scale_list(scales, moments, device) -> List[Tensor]:
    """The op's scale list: empty when no moment is 8-bit, else one tensor per param (an
    empty placeholder where a moment is not 8-bit)."""
    if not any(m.dtype in BLOCKWISE_DTYPES for m in moments):
        return []
    if scales is None:
        raise ValueError("8-bit (uint8 or float8_e4m3fn) moments need their per-block scales")
    return [s if s is not None else torch.empty(0, dtype=torch.float32, device=device)
            for s in scales]


def _check_narrow_state(op, params, exp_avgs, exp_avg_sqs, model_params, scale_lists) -> bool:
    """Checks the narrow-state dtypes (the kernel checks them again); returns whether any."""
    narrow = False
    for name, lst, scales in (("exp_avgs", exp_avgs, scale_lists[0]),
                              ("exp_avg_sqs", exp_avg_sqs, scale_lists[1])):
        for i, t in enumerate(lst):
            if t.dtype not in MOMENT_DTYPES:
                raise TypeError(f"{op}: {name}[{i}] has dtype {t.dtype}; expected one of "
                                f"{MOMENT_DTYPES}")
            if t.dtype in BLOCKWISE_DTYPES:
                sc = scales[i]
                if sc.dtype != torch.float32 or sc.numel() != moment_blocks(t.numel()):
                    raise ValueError(
                        f"{op}: the scales of {name}[{i}] must be float32 with "
                        f"{moment_blocks(t.numel())} elements, got {sc.dtype} with {sc.numel()}")
            narrow |= t.dtype != torch.float32
    for i, p in enumerate(params):
        if p.dtype == torch.bfloat16:
            narrow = True
        if p.dtype == torch.int16:
            narrow = True
            if model_params is None or model_params[i].dtype != torch.bfloat16:
                raise TypeError(
                    f"{op}: params[{i}] is int16 (the remainders of a bf16 param), so "
                    f"model_params[{i}] must be the bfloat16 param")
    return narrow


def _adam_step_torch(params, grads, exp_avgs, exp_avg_sqs, steps, model_params, grad_scale,
                     found_inf, lr_tensor, lr, beta1, beta2, eps, weight_decay, decoupled,
                     maximize, scale_lists=([], []), sr_rows=None):
    """The reference: csrc/kernels/optimizer_step.h written with tensor ops (float32, scalars
    from the step count in float64), sync-free: a set found_inf selects the old values.
    Narrow state is decoded to float32 first and encoded after (encode_moment, split_remainders)."""
    device = params[0].device
    keep_old = None if found_inf is None else found_inf.reshape(()) != 0
    sign = -1.0 if maximize else 1.0
    mult = None if grad_scale is None else grad_scale.reshape(()) * sign
    lr_t = lr_tensor.reshape(()).double() if lr_tensor is not None else None
    lr_val = lr_t if lr_t is not None else lr
    w = torch.tensor(1.0 - beta1, dtype=torch.float32).item()  # the float32 lerp weight
    for i, stored_p in enumerate(params):
        m_scales = scale_lists[0][i] if scale_lists[0] else None
        v_scales = scale_lists[1][i] if scale_lists[1] else None
        rem = stored_p.dtype == torch.int16
        sr = stored_p.dtype == torch.bfloat16  # stochastic rounding: the param is the master
        p = join_remainders(model_params[i], stored_p) if rem else stored_p
        if sr:
            p = stored_p.float()
        exp_avg = decode_moment(exp_avgs[i], m_scales)
        exp_avg_sq = decode_moment(exp_avg_sqs[i], v_scales, sqrt=True)
        step = steps[i].reshape(()).double() + 1.0
        g = grads[i].float()
        g = g * mult if mult is not None else (g * sign if maximize else g.clone())
        new_p = p.clone()
        if torch.uint8 in (exp_avgs[i].dtype, exp_avg_sqs[i].dtype):
            new_p, m, v = _adam_update_dynamic(p, g, exp_avg, exp_avg_sq, step, lr_val, beta1,
                                               beta2, eps, weight_decay, decoupled)
        else:
            if weight_decay != 0.0:
                if decoupled:
                    decay = 1.0 - lr_val * weight_decay
                    new_p.mul_(decay.float() if isinstance(decay, Tensor) else decay)
                else:
                    g = g + p * weight_decay
            m = torch.lerp(exp_avg, g, w)
            v = torch.addcmul(exp_avg_sq * beta2, g, g, value=1.0 - beta2)
            bias_correction1 = 1.0 - torch.pow(torch.tensor(beta1, dtype=torch.float64, device=device), step)
            bias_correction2 = 1.0 - torch.pow(torch.tensor(beta2, dtype=torch.float64, device=device), step)
            neg_step_size = (-(lr_val / bias_correction1)).float()
            denom = v.sqrt() / bias_correction2.sqrt().float() + eps
            new_p = new_p + neg_step_size * m / denom
        new_step = step.to(steps[i].dtype).reshape(steps[i].shape)
        # the new values laid out as the tensors they are stored in, whatever layout the ops
        # above gave them: 8-bit blocks and stochastic rounding's element indices follow the
        # stored tensor's memory order, as the kernels walk it
        m = torch.empty_like(exp_avgs[i], dtype=torch.float32).copy_(m)
        v = torch.empty_like(exp_avg_sqs[i], dtype=torch.float32).copy_(v)
        new_m, new_ms = encode_moment(m, exp_avgs[i].dtype)
        new_v, new_vs = encode_moment(v, exp_avg_sqs[i].dtype, sqrt=True)
        outs = [(exp_avgs[i], new_m), (exp_avg_sqs[i], new_v), (steps[i], new_step)]
        outs += [(sc, new) for sc, new in ((m_scales, new_ms), (v_scales, new_vs)) if new is not None]
        if sr:
            key, first = sr_rows[i]
            new_p = torch.empty_like(stored_p, dtype=torch.float32).copy_(new_p)
            outs.append((stored_p, stochastic_round_bf16(new_p, key, int(step.item()), first)))
        elif rem:
            model_new, rem_new = split_remainders(new_p)
            outs += [(stored_p, rem_new), (model_params[i], model_new)]
        else:
            outs.append((p, new_p))
            if model_params is not None:
                outs.append((model_params[i], new_p.to(model_params[i].dtype)))
        for dst, new in outs:
            dst.copy_(new if keep_old is None else torch.where(keep_old, dst, new))


def _adam_update_dynamic(p, g, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps,
                         weight_decay, decoupled):
    """(new p, m, v) of a tensor with a uint8 moment: csrc/kernels/optimizer_step.h
    adam_element_dynamic (torchao's AdamW8bit arithmetic, docs/spec.md section 9) with tensor
    ops: float32 throughout, every product rounded, true divisions (no multiplication by a
    reciprocal: full-size divisors), IEEE square roots, bias corrections 1 - pow of the float32
    beta and step count (a 0-dim float32 pow: the C library's powf on CPU)."""
    f32 = torch.float32

    def full(x):
        return torch.full_like(p, 0.0).copy_(x.reshape(()).to(f32).expand(()))

    lr32 = (lr.float() if isinstance(lr, Tensor) else torch.tensor(lr, dtype=f32)).to(p.device)
    step32 = step.to(f32)
    wd32 = torch.tensor(weight_decay, dtype=f32, device=p.device)
    if weight_decay != 0.0:
        if decoupled:
            p = p - (lr32 * wd32) * p
        else:
            g = g + wd32 * p
    m = _lerp_decomposed(exp_avg, g, 1.0 - beta1)
    v = _lerp_decomposed(exp_avg_sq, g * g, 1.0 - beta2)
    # an inf exp_avg_sq stays inf (the lerp would give inf - inf = NaN), as v * beta2 + ...
    # keeps it in the float32 step: that element's update stays 0
    v = torch.where(exp_avg_sq == math.inf, exp_avg_sq, v)
    bc1 = 1.0 - torch.pow(torch.tensor(beta1, dtype=f32, device=p.device), step32)
    bc2 = 1.0 - torch.pow(torch.tensor(beta2, dtype=f32, device=p.device), step32)
    root = v.double().sqrt().float()  # correctly rounded (torch's vectorized float sqrt is not)
    sbc2 = bc2.double().sqrt().float()
    denom = root / full(sbc2) + eps
    return p - (lr32 * (m / full(bc1))) / denom, m, v


def _lerp_decomposed(start, end, weight):
    """torch's lerp as its decomposition runs compiled (torch._refs.lerp): coeff * (end - start)
    + base, two roundings (ATen's eager lerp is one fma)."""
    w = torch.tensor(weight, dtype=torch.float32)
    if abs(float(w)) < 0.5:
        return start + w * (end - start)
    return end + (w - 1.0) * (end - start)


def fused_sgd_step_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    momentum_buffers: Optional[Sequence[Tensor]],
    *,
    first_step: Optional[Sequence[bool]] = None,
    model_params: Optional[Sequence[Tensor]] = None,
    grad_scale: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None,
    lr,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool = False,
) -> None:
    """One step of torch.optim.SGD over fp32 main params, reading the grads once and writing
    the fp16/bf16 model params, in place.

    For each i, with g = float32(grads[i]) * grad_scale (negated when maximize):
    g += weight_decay * p; with momentum: buf = g on the buffer's first step (torch.optim: a
    clone of the grad, no dampening), else buf = buf * momentum + (1 - dampening) * g, and
    g = g + momentum * buf (nesterov) or buf; p += -lr * g; model_params[i] = cast(p).

    Args:
        params, grads, model_params, grad_scale, found_inf, lr: as in :func:`fused_adam_step_`.
        momentum_buffers: float32 tensors of the params' shapes (torch.optim's
            ``momentum_buffer``), or None when momentum == 0.
        first_step: per param, True when its buffer holds no value yet (freshly allocated; its
            contents are ignored and overwritten). Default all False.
        momentum, dampening, weight_decay, nesterov, maximize: the param group's options.

    A set found_inf changes nothing (a buffer marked first_step keeps its contents).
    """
    params, grads = list(params), list(grads)
    if model_params is not None:
        model_params = list(model_params)
    op = "fused_sgd_step_"
    has_momentum = float(momentum) != 0.0
    if has_momentum and momentum_buffers is None:
        raise ValueError(f"{op}: momentum={momentum} needs momentum_buffers")
    bufs = list(momentum_buffers) if has_momentum else []
    first = [False] * len(params) if first_step is None else [bool(f) for f in first_step]
    _check_lengths(op, params, grads=grads, model_params=model_params, first_step=first,
                   momentum_buffers=bufs if has_momentum else None)
    if not params:
        return
    device = params[0].device
    lr_tensor, lr_float = _lr_args(lr, device)
    hyper = (float(momentum), float(dampening), float(weight_decay), bool(nesterov), bool(maximize))
    lists = [params, grads] + ([bufs] if has_momentum else []) + (
        [model_params] if model_params else [])
    kernels = _step_kernels(device, "fused_sgd_step_")
    if kernels is not None and _kernel_layouts_ok(lists):
        # the op checks every argument itself (csrc/host/optimizer_step_checks.h)
        kernels.fused_sgd_step_(
            params, bufs, model_params or [], grads, first, grad_scale, found_inf, lr_tensor,
            lr_float, *hyper,
        )
        return
    _check_step_lists(op, params, grads, model_params,
                      **({"momentum_buffers": bufs} if has_momentum else {}))
    for i, p in enumerate(params):
        if p.device != device:
            raise ValueError(f"{op}: params[{i}] is on {p.device}, params[0] on {device}")
    _check_device_scalar("grad_scale", grad_scale, device)
    _check_device_scalar("found_inf", found_inf, device)
    _sgd_step_torch(params, grads, bufs, first, model_params, grad_scale, found_inf, lr_tensor,
                    lr_float, *hyper)


def _sgd_step_torch(params, grads, bufs, first, model_params, grad_scale, found_inf, lr_tensor,
                    lr, momentum, dampening, weight_decay, nesterov, maximize):
    """The reference of the SGD kernel with tensor ops (ATen's ``a.add(b, alpha=x)`` is
    a fused multiply-add; so is the kernel's)."""
    keep_old = None if found_inf is None else found_inf.reshape(()) != 0
    sign = -1.0 if maximize else 1.0
    mult = None if grad_scale is None else grad_scale.reshape(()) * sign
    neg_lr = -(lr_tensor.reshape(()).double()) if lr_tensor is not None else -lr
    for i, p in enumerate(params):
        g = grads[i].float()
        g = g * mult if mult is not None else (g * sign if maximize else g.clone())
        if weight_decay != 0.0:
            g = torch.add(g, p, alpha=weight_decay)
        outs = []
        if momentum != 0.0:
            if first[i]:
                buf = g
            else:
                buf = torch.add(bufs[i] * momentum, g, alpha=1.0 - dampening)
            outs.append((bufs[i], buf))
            g = torch.add(g, buf, alpha=momentum) if nesterov else buf
        if isinstance(neg_lr, Tensor):
            new_p = p + neg_lr.float() * g
        else:
            new_p = torch.add(p, g, alpha=neg_lr)
        outs.append((p, new_p))
        if model_params is not None:
            outs.append((model_params[i], new_p.to(model_params[i].dtype)))
        for dst, new in outs:
            dst.copy_(new if keep_old is None else torch.where(keep_old, dst, new))
