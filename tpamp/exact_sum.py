"""Order-invariant (exact) sum of squares for the grad norm (docs/spec.md section 23,
"Bitwise reproducible grad statistics").

A float sum depends on the order of its terms, so the grad norm of the same global gradients
differs in its last bits between layouts (TP x PP x DP x EP splits, ZeRO-1 shards, lists in
another order). Here the sum of squares is computed EXACTLY, as an integer, so any split and
any order give the same bits:

* each value r (an fp32 number: the grad as stored, or ``fp32(float(x) * scale)``) is
  ``M * 2**(E' - 150)`` with the integer significand ``M < 2**24``, so ``r**2 = M**2 * 2**q *
  2**-298`` with ``q = 2*E' - 2`` in ``[0, 506]``: an integer in units of ``2**-298``;
* the sum ``X`` of these integers is held as ``K = 26`` base-``2**24`` digits, a float64 tensor
  of shape ``[26]``: ``X = sum_i digits[i] * 2**(24*i)``, i.e. the sum of squares is
  ``S = sum_i digits[i] * 2**(24*i - 298)``;
* non-finite values (inf, nan) contribute nothing (found_inf reports them);
* "normalized" digits are integers in ``[0, 2**24)`` (the top one may hold the rest): a unique
  form, so equal sums give equal digits whatever the order. Sums of normalized digit vectors
  (an ``all_reduce`` SUM over ranks, dense + expert parts) are exact in float64 (every entry
  stays below ``2**53``); :func:`digits_to_double` normalizes again and converts once, rounding
  correctly (to nearest, ties to even): the result equals ``math.fsum([float(r)**2 ...])`` bit
  for bit.

The compiled kernels ``torch.ops.tpamp.grad_sumsq_exact`` and
``torch.ops.tpamp.exact_sumsq_to_double`` (csrc/) are used when tpamp._ext loads them for the
device (and no :func:`tpamp.ops.force_fallback` block is active); the PyTorch code here is the
fallback, vectorized, with the same contract and results.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from tpamp import _ext, ops

__all__ = ["NUM_DIGITS", "DIGIT_BITS", "DIGIT_UNIT_EXP", "sumsq_digits", "digits_to_double"]

Tensor = torch.Tensor

#: number of base-2**24 digits of the exact sum (float64 [26])
NUM_DIGITS = 26
#: bits per digit
DIGIT_BITS = 24
#: digit i is worth 2**(24*i + DIGIT_UNIT_EXP)
DIGIT_UNIT_EXP = -298

_MASK = (1 << DIGIT_BITS) - 1
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CHUNK = 1 << 20  # elements per vectorized piece of the fallback (bounds its scratch memory)


def _kernel(device: torch.device, name: str):
    """The compiled op ``name`` when tpamp._ext runs kernels on ``device`` and has it; else None."""
    if ops.fallback_forced():
        return None
    kernels = _ext.ops_for(device)
    if kernels is None or not hasattr(kernels, name):
        return None
    return getattr(kernels, name)


def _check_scale(scale: Optional[Tensor], device: torch.device) -> None:
    if scale is None:
        return
    if not isinstance(scale, Tensor):
        raise TypeError(f"scale must be a float32 tensor or None, got {type(scale).__name__}")
    if scale.numel() != 1 or scale.dtype != torch.float32:
        raise ValueError(
            f"scale must be a 1-element float32 tensor, got {scale.dtype} of shape "
            f"{tuple(scale.shape)}")
    if scale.device != device:
        raise ValueError(f"scale is on {scale.device}, expected {device} (the tensors' device)")


def sumsq_digits(tensors: Sequence[Tensor], scale: Optional[Tensor] = None, *,
                 device: Optional[torch.device] = None) -> Tensor:
    """The exact sum of squares of every element of ``tensors``, as normalized digits.

    Args:
        tensors: float32/float16/bfloat16 tensors of any shapes and layouts (empty ones and an
            empty list allowed), all on one device.
        scale: None (1) or a 1-element float32 tensor on that device: each element x counts as
            ``r = fp32(float(x) * scale)`` (e.g. the inverse loss scale), the value the
            unscale pass writes.
        device: where the result lives when ``tensors`` is empty (default: ``scale``'s device,
            else CPU).

    Returns:
        float64 tensor of shape ``[26]`` on the tensors' device: integers ``digits[i]`` in
        ``[0, 2**24)`` with ``sum of r**2 = sum_i digits[i] * 2**(24*i - 298)`` exactly.
        Inf and nan elements (and those that the scale makes inf) add nothing. The same
        values in any order or split give the same digits. No host sync.

    Raises:
        TypeError for a non-tensor entry or another dtype; ValueError for tensors on several
        devices or a bad ``scale``.
    """
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            raise TypeError(f"tensors[{i}] must be a Tensor, got {type(t).__name__}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(
                f"tensors[{i}] has dtype {t.dtype}; expected one of float32, float16, bfloat16")
    if tensors:
        device = tensors[0].device
        for i, t in enumerate(tensors):
            if t.device != device:
                raise ValueError(f"tensors[{i}] is on {t.device}, expected {device} (one device)")
    elif device is None:
        device = scale.device if isinstance(scale, Tensor) else torch.device("cpu")
    device = torch.device(device)
    _check_scale(scale, device)
    op = _kernel(device, "grad_sumsq_exact") if tensors else None
    if op is not None:
        try:
            return op(tensors, scale.reshape(()) if scale is not None else None)
        except (RuntimeError, NotImplementedError):  # a layout or device the op refuses
            pass
    return _sumsq_digits_torch(tensors, scale, device)


def _sumsq_digits_torch(tensors, scale, device) -> Tensor:
    # per biased exponent E (256 bins): the sums of the low and high 24 bits of M**2, exact in
    # int64 below 2**39 elements; bin 255 (inf, nan) is dropped
    lo = torch.zeros(256, dtype=torch.int64, device=device)
    hi = torch.zeros(256, dtype=torch.int64, device=device)
    for t in tensors:
        if t.numel() == 0:
            continue
        flat = t.detach().reshape(-1)
        for start in range(0, flat.numel(), _CHUNK):
            _add_squares(lo, hi, flat[start:start + _CHUNK], scale)
    return _bins_to_digits(lo, hi)


def _add_squares(lo: Tensor, hi: Tensor, x: Tensor, scale: Optional[Tensor]) -> None:
    """lo[E] += low 24 bits of M**2, hi[E] += M**2 >> 24, for every element of x
    (|r| = M * 2**(max(E, 1) - 150))."""
    r = x.float()
    if scale is not None:
        r = r * scale.reshape(())  # fp32 multiply: correctly rounded fp32(float(x) * scale)
    bits = r.contiguous().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    mant = ((bits & 0x7FFFFF) | ((exp != 0).to(torch.int32) << 23)).to(torch.int64)
    sq = mant * mant  # < 2**48, exact
    lo.index_add_(0, exp, sq & _MASK)  # integer adds: exact, any order
    hi.index_add_(0, exp, sq >> DIGIT_BITS)


def _bins_to_digits(lo: Tensor, hi: Tensor) -> Tensor:
    """Per-exponent sums (int64 [256]) -> normalized digits, float64 [26]. Bin E holds
    (hi * 2**24 + lo) * 2**q with q = 2 * max(E, 1) - 2; each sum (< 2**63) is cut into three
    24-bit pieces, each piece shifted by q % 24 (< 2**48) and cut again into two."""
    device = lo.device
    e = torch.arange(255, device=device)  # bin 255: inf / nan, dropped
    q = 2 * e.clamp(min=1) - 2
    sums = torch.stack([lo[:255], hi[:255]])  # [2, 255]
    base = torch.stack([q, q + DIGIT_BITS])  # bit offset of each sum
    pieces = torch.stack([(sums >> (DIGIT_BITS * k)) & _MASK for k in range(3)])  # [3, 2, 255]
    offset = base.unsqueeze(0) + DIGIT_BITS * torch.arange(3, device=device).view(3, 1, 1)
    d = torch.div(offset, DIGIT_BITS, rounding_mode="floor")
    shifted = pieces << (offset - d * DIGIT_BITS)  # < 2**48
    acc = torch.zeros(NUM_DIGITS, dtype=torch.int64, device=device)  # d + 1 <= 25
    acc.index_add_(0, d.reshape(-1), (shifted & _MASK).reshape(-1))
    acc.index_add_(0, d.reshape(-1) + 1, (shifted >> DIGIT_BITS).reshape(-1))
    return _normalize(acc).double()


def _normalize(acc: Tensor) -> Tensor:
    """int64 digits (each in [0, 2**62)) -> the unique normalized form: digits in [0, 2**24),
    the top digit holding the rest. Vectorized: three carry passes bring every digit to
    [0, 2**24], then one carry-lookahead (a prefix scan) settles the chains of 2**24 - 1."""
    top = NUM_DIGITS - 1
    idx = torch.arange(NUM_DIGITS, device=acc.device)
    not_top = idx < top
    for _ in range(3):
        carry = torch.where(not_top, acc >> DIGIT_BITS, torch.zeros_like(acc))
        acc = torch.where(not_top, acc & _MASK, acc)
        acc = acc + torch.cat([carry.new_zeros(1), carry[:-1]])
    # now every non-top digit is <= 2**24: 2**24 generates a carry, 2**24 - 1 propagates one
    gen = (acc == (1 << DIGIT_BITS)) & not_top
    prop = (acc == _MASK) & not_top
    kill = ~(gen | prop)
    minus = torch.full_like(idx, -1)
    last_gen = torch.cummax(torch.where(gen, idx, minus), 0).values
    last_kill = torch.cummax(torch.where(kill, idx, minus), 0).values
    carry_out = last_gen > last_kill  # out of digit i
    carry_in = torch.cat([carry_out.new_zeros(1), carry_out[:-1]]).to(acc.dtype)
    acc = acc + carry_in
    return torch.where(not_top, acc & _MASK, acc)


def digits_to_double(digits: Tensor) -> Tensor:
    """The sum of squares held by ``digits``, correctly rounded to float64.

    Args:
        digits: float64 tensor of shape ``[26]`` whose entries are non-negative integers below
            ``2**53`` (normalized or not, e.g. a SUM of normalized digit vectors over ranks).

    Returns:
        0-dim float64 tensor on ``digits``' device: ``sum_i digits[i] * 2**(24*i - 298)``
        rounded to nearest (ties to even), computed on the device without a host sync.

    Raises:
        TypeError for a non-tensor or another dtype; ValueError for another shape. (Entries
        that are not non-negative integers below 2**53 are not checked: that would read the
        device.)
    """
    if not isinstance(digits, Tensor):
        raise TypeError(f"digits must be a float64 tensor, got {type(digits).__name__}")
    if digits.dtype != torch.float64:
        raise TypeError(f"digits must be float64, got {digits.dtype}")
    if tuple(digits.shape) != (NUM_DIGITS,):
        raise ValueError(f"digits must have shape [{NUM_DIGITS}], got {tuple(digits.shape)}")
    op = _kernel(digits.device, "exact_sumsq_to_double")
    if op is not None:
        try:
            return op(digits)
        except (RuntimeError, NotImplementedError):
            pass
    return _to_double_torch(digits)


def _to_double_torch(digits: Tensor) -> Tensor:
    d = _normalize(digits.to(torch.int64))
    device = d.device
    idx = torch.arange(NUM_DIGITS, device=device)
    nonzero = d != 0
    t = torch.where(nonzero, idx, torch.full_like(idx, -1)).max()  # top nonzero digit
    t0 = t.clamp(min=0)
    # bit length b of the top digit (frexp of an integer < 2**53 is exact)
    b = torch.frexp(d[t0].double()).exponent.to(torch.int64)
    # the top 62 bits: digit t - j placed at bit (62 - b - 24 j); lower bits go to a sticky bit
    j = torch.arange(4, device=device)
    pos = t0 - j
    dj = torch.where(pos >= 0, d[pos.clamp(min=0)], torch.zeros_like(pos))
    sh = 62 - b - DIGIT_BITS * j
    left = sh.clamp(min=0)
    right = (-sh).clamp(min=0, max=62)
    parts = (dj << left) >> right
    lost = (dj & ((torch.ones_like(right) << right) - 1)) != 0
    below = nonzero & (idx < t0 - 3)
    sticky = (lost.any() | below.any()).to(torch.int64)
    top = parts.sum() | sticky  # < 2**63; the rounding bits sit far above bit 0
    # value = top * 2**(24 t - 298 - (62 - b)); the int64 -> float64 conversion rounds to
    # nearest even, and the power of two is exact (built from its bits)
    exp = DIGIT_BITS * t0 + DIGIT_UNIT_EXP - (62 - b)
    pow2 = ((exp + 1023) << 52).view(torch.float64)
    value = top.double() * pow2
    return torch.where(t >= 0, value, torch.zeros_like(value))


# -- the optimizer core's option (tpamp.MixedPrecisionOptimizer(deterministic_grad_norm=...)) --

def check_deterministic_grad_norm(value, norm_type: float) -> bool:
    """``deterministic_grad_norm`` checked against ``norm_type`` (already checked): returns the
    bool. TypeError for a non-bool; ValueError with a norm_type other than 2 or inf (only the
    sum of squares has an exact order-invariant form here; max is order-invariant already)."""
    if not isinstance(value, bool):
        raise TypeError(
            f"deterministic_grad_norm must be a bool, got {value!r} ({type(value).__name__})")
    if value and norm_type not in (2.0, float("inf")):
        raise ValueError(
            f"deterministic_grad_norm=True needs norm_type 2 or inf, got norm_type={norm_type!r} "
            "(the exact order-invariant sum exists for the sum of squares only)")
    return value


def masked_sumsq_digits(tensors: Sequence[Tensor], mask: Sequence[bool],
                        scale: Optional[Tensor], device: torch.device) -> Tensor:
    """:func:`sumsq_digits` of the tensors whose ``mask`` entry is True (float64 [26] on
    ``device`` when none is): the local part of an exact norm statistic."""
    picked = [t for t, m in zip(tensors, mask) if m]
    if scale is not None:
        scale = scale.reshape(1)
    return sumsq_digits(picked, scale, device=device)
