"""Narrow storage of Adam/AdamW state: the one home of the formats.

This module holds everything about how tpamp may store an optimizer's state narrower than
float32: the bit formats (the reference of the kernels' encodings), the options of the
wrappers and their checks, the conversion of state saved in one configuration into another,
and the wrapping of a rank's local state in DTensors. It imports torch and tpamp.common only;
tpamp.ops imports it for the reference step (never the reverse), so the path from
``exp_avg_dtype`` in a script to the kernel reads: the wrapper's option -> this module ->
``tpamp.ops.fused_adam_step_`` -> csrc/kernels/optimizer_step.h.

Options of :class:`tpamp.MixedPrecisionOptimizer` and :class:`tpamp.DistributedOptimizer`, with
the names of Megatron-core's precision-aware optimizer and Transformer Engine's FusedAdam:

* ``exp_avg_dtype``, ``exp_avg_sq_dtype``: ``torch.float32`` (default), ``torch.bfloat16``
  (round to nearest even), ``torch.uint8`` (the recommended 8-bit format: codes of the dynamic
  quantization map of bitsandbytes and torchao's AdamW8bit, :func:`dynamic_map`, signed for
  exp_avg and unsigned for exp_avg_sq, with one float32 absmax scale per block of
  :data:`MOMENT_BLOCK` = 256 elements) or ``torch.float8_e4m3fn`` (e4m3fn codes with one
  float32 scale per block; exp_avg_sq keeps the codes of its square root; about 5x the drift of
  uint8, kept for checkpoints that hold it). The state keeps torch.optim's keys (``exp_avg``,
  ``exp_avg_sq``, ``step``) in these dtypes, plus ``exp_avg_scale`` / ``exp_avg_sq_scale``
  (float32, one per block) for 8-bit.
* ``min_8bit_size`` (bitsandbytes' name; default 4096 with an 8-bit moment dtype): a param with
  fewer elements (the whole param's, a DTensor's global count) keeps float32 moments where the
  configured dtype is 8-bit, as bitsandbytes and torchao's AdamW8bit / AdamWFp8 keep small
  tensors (biases, norms) in 32-bit state: :func:`check_min_8bit_size`,
  :func:`param_moment_dtypes`. 0 quantizes every param.
* ``store_param_remainders=True`` (bf16 model params only): no float32 master copy; the master
  is the bf16 param's bits plus an int16 remainder (:func:`join_remainders`), rebuilt exactly
  inside the kernel, so the fp32 master values are bit-identical to the fp32-master step's. The
  bf16 param is the master rounded to nearest with ties away from zero (one ulp away from
  round-to-nearest-even when the low half is exactly 0x8000; see csrc/kernels/optimizer_step.h
  for why 16 bits cannot do round-to-nearest-even).

* ``master_weights=False, stochastic_rounding=True`` (bf16 model params only;
  docs/spec.md section 21): no master and no remainder; the step writes the bf16 param with
  stochastic rounding (:func:`round_bf16_stochastic`, random bits
  :func:`stochastic_rounding_bits`): 2 bytes of param + the moments. Options checked by
  :func:`check_master_options`.

Both need the one-pass fused step (an exact ``torch.optim.Adam``/``AdamW``, ``fused_step=True``);
the generic path refuses them. Bytes per parameter of state (master or remainder + two
moments): 12 (fp32), 8 (bf16 moments), 6 (bf16 moments + remainders), about 4.03 (8-bit moments
+ remainders: 2 + 2 x (1 + 4/256)) and 6.03 (8-bit moments with an fp32 master).

Conversions (loading a state dict or checkpoint saved in another configuration): moments are
decoded to float32 and encoded in the configured dtype (exact from bf16/8-bit to float32, and
fp32 -> bf16 rounds to nearest even, -> 8-bit quantizes blockwise); masters are saved as float32
(``fp32_from_fp16_params``/``main_params``, Megatron's format, rebuilt exactly from remainders),
and split exactly into param + remainder on load.

DTensor params (FSDP2, tensor parallel): the kernels and the format functions work on a rank's
local tensors; :func:`dtensor_like` and :func:`moments_like` put the results back in DTensors
with the main param's mesh and placements, as torch.optim keeps its state. 8-bit scales stay
local tensors (their blocks are this rank's).
"""

from __future__ import annotations

import math
from typing import Dict, Optional

import torch

import tpamp._dynamic_map_table as _dynamic_map_table
from tpamp.common import is_dtensor, local_tensor

__all__ = [
    # bit formats (the kernels' reference)
    "MOMENT_BLOCK",
    "MOMENT_DTYPES",
    "BLOCKWISE_DTYPES",
    "SATURATED_SCALE",
    "dynamic_map",
    "dynamic_decode_map",
    "moment_blocks",
    "encode_moment",
    "decode_moment",
    "join_remainders",
    "split_remainders",
    "stochastic_rounding_bits",
    "round_bf16_stochastic",
    "stochastic_round_bf16",
    "stochastic_rounding_key",
    # options
    "check_state_options",
    "MIN_8BIT_SIZE",
    "check_min_8bit_size",
    "param_moment_dtypes",
    "check_master_options",
    "refuse_generic_step",
    "new_adam_state",
    "needs_conversion",
    "state_tensor_bytes",
    "SCALE_KEYS",
    "check_saved_scales",
    # conversion between formats
    "convert_adam_state",
    "restore_code_dtypes",
    "layout_free_state",
    # DTensor wrapping
    "dtensor_like",
    "moments_like",
    "master_from_remainder",
]

Tensor = torch.Tensor


# -- bit formats (csrc/kernels/optimizer_step.h defines them) ---------------------------------
#
# The functions below state the kernels' formats with tensor ops: tpamp.ops' reference step
# uses them, and the optimizer wrappers use them to convert state between configurations.

#: Elements per float32 scale of an 8-bit moment (csrc/kernels/optimizer_step.h kMomentBlock).
MOMENT_BLOCK = 256
_FP8_MAX = 448.0
_FLT_MAX = torch.finfo(torch.float32).max
_FLT_MIN = torch.finfo(torch.float32).tiny  # the smallest normal float32, 2^-126
#: The scale of an 8-bit block holding +-inf: FLT_MAX / 448 in float32 (0x1.249248p+119), as
#: csrc/kernels/optimizer_step.h kFp8SaturatedScale; 448 times it is FLT_MAX.
SATURATED_SCALE = float.fromhex("0x1.249248p+119")
#: The dtypes a stored moment may have: uint8 (codes of the dynamic 8-bit map,
#: :func:`dynamic_map`) and float8_e4m3fn (e4m3fn codes), both with one float32 scale per block.
MOMENT_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.uint8)
#: The 8-bit moment dtypes: codes with one float32 scale per block of MOMENT_BLOCK elements.
BLOCKWISE_DTYPES = (torch.float8_e4m3fn, torch.uint8)


def create_dynamic_map(signed: bool) -> Tensor:
    """bitsandbytes' ``create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)`` built as
    torchao builds it (torch float32 linspace and means, scaled by a power of ten, sorted) on
    this machine: a float32 CPU tensor of 256 values. torch's float32 linspace rounds by the
    ATen CPU capability, so this may differ from :func:`dynamic_map` (the format's fixed map,
    made at AVX-512) by a float32 ulp in a few entries elsewhere; scripts/gen_dynamic_map.py
    builds the fixed tables from it."""
    return torch.tensor(_dynamic_map_values(bool(signed)), dtype=torch.float32)


def _dynamic_map_values(signed: bool):
    """The 256 values of :func:`create_dynamic_map` as Python floats."""
    data = []
    for i in range(7):  # decades 1e-6 .. 1e0, 2^i (signed) or 2^(i+1) (unsigned) steps each
        items = 2 ** i + 1 if signed else 2 ** (i + 1) + 1
        bounds = torch.linspace(0.1, 1, items)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        data += ((10 ** (i - 6)) * means).tolist()
        if signed:
            data += (-(10 ** (i - 6)) * means).tolist()
    data += [0.0, 1.0]
    return sorted(data)


_DYNAMIC_MAPS = {}


def dynamic_map(signed: bool, device=None) -> Tensor:
    """The dynamic (tree) quantization map of the uint8 moment format: a float32 tensor of
    256 increasing values in [-1, 1] (the value of code c is ``map[c]``), bitsandbytes'
    ``create_dynamic_map`` with 7 exponent bits as torchao's AdamW8bit uses it.

    signed=True (exp_avg): 0, 1.0 and +-127 values, 2^i per decade [1e-6, 1e0) (decade i=0..6:
    the midpoints of 2^i equal steps of [0.1, 1] x 10^(i-6)), most negative -0.99297.
    signed=False (exp_avg_sq): 0, 1.0 and 254 positive values, 2^(i+1) per decade.
    Returns a new tensor on ``device`` (default CPU). The values are fixed
    (tpamp/_dynamic_map_table.py, the same as csrc/kernels/dynamic_map_tables.h): torchao's
    construction (:func:`create_dynamic_map`) at the AVX-512 capability, whatever this
    machine's."""
    key = bool(signed)
    if key not in _DYNAMIC_MAPS:
        values = _dynamic_map_table.SIGNED if key else _dynamic_map_table.UNSIGNED
        _DYNAMIC_MAPS[key] = torch.tensor([float.fromhex(h) for h in values],
                                          dtype=torch.float32)
    return _DYNAMIC_MAPS[key].to(device, copy=True)


_DECODE_MAPS = {}


def dynamic_decode_map(signed: bool, device=None) -> Tensor:
    """The values the uint8 format's codes read back as (before the block's scale): for
    exp_avg (signed=True) :func:`dynamic_map` itself; for exp_avg_sq (signed=False) the unsigned
    map with code 0 reading as the smallest positive entry (code 1's, 3.25e-7) instead of 0, so
    a positive exp_avg_sq never reads back 0 (the "zero-point problem" of Li et al. 2023, Memory
    efficient optimizers with 4-bit states: an element far below its block's max, e.g. a
    neighbour of an outlier, would step by exp_avg / eps). An all-zero block (scale 0) still
    reads 0. Encoding is unchanged (torchao's rule, :func:`dynamic_map`). A new float32 tensor of
    256 values on ``device`` (default CPU)."""
    key = bool(signed)
    if key not in _DECODE_MAPS:
        q = dynamic_map(key)
        if not key:
            q[0] = q[1]
        _DECODE_MAPS[key] = q
    return _DECODE_MAPS[key].to(device, copy=True)


def _encode_dynamic(blocks: Tensor, signed: bool):
    """codes (int64, shape of ``blocks``) and scales of float32 ``blocks`` [nb, MOMENT_BLOCK]
    in the uint8 format (see :func:`encode_moment`)."""
    absmax = blocks.abs().amax(dim=1) if blocks.shape[0] else blocks.new_zeros(0)
    finite = absmax <= _FLT_MAX
    scale = torch.where(absmax == math.inf, torch.full_like(absmax, _FLT_MAX), absmax)
    div = torch.where((absmax > 0) & finite, absmax, torch.ones_like(absmax))
    div = torch.where(absmax == math.inf, torch.full_like(absmax, _FLT_MAX), div)
    flagged = None
    if not signed:  # exp_avg_sq: a block holding +-inf keeps its finite values (see encode)
        flagged = absmax == math.inf
        fin = torch.where(blocks.abs() <= _FLT_MAX, blocks.abs(), torch.zeros_like(blocks))
        fmax = fin.amax(dim=1) if blocks.shape[0] else blocks.new_zeros(0)
        fmax = torch.clamp_min(fmax, _FLT_MIN)
        scale = torch.where(flagged, -fmax, scale)
        div = torch.where(flagged, fmax, div)
    div = torch.where(absmax.isnan(), absmax, div)
    y = blocks / div[:, None]
    q = dynamic_map(signed, blocks.device)
    # floor: the largest c with q[c] <= y (0 when none), then up when y - q[c] >= (q[c+1] -
    # q[c]) / 2 (ties up), as torchao's quantize_8bit_with_qmap; a NaN y gives code 255 (positive
    # sign bit) or 0, as the kernels' bit-indexed search
    yy = torch.where(y.isnan(), torch.where(y.view(torch.int32) < 0, -2.0, 2.0), y)
    c = (torch.searchsorted(q, yy.contiguous(), right=True) - 1).clamp(0, 255)
    cu = (c + 1).clamp(max=255)
    lo, hi = q[c], q[cu]
    up = (yy - lo >= (hi - lo) * 0.5) & (c < 255)
    c = c + up.to(c.dtype)
    if flagged is not None:  # +inf: code 255 (reads +inf); finite values at most code 254
        f = flagged[:, None]
        c = torch.where(f, torch.where(blocks == math.inf, 255, c.clamp(max=254)), c)
    return c, scale


def _flat_memory_order(t: Tensor) -> Tensor:
    """A 1-D view of a dense tensor's elements in memory order (the order the kernels walk)."""
    if t.is_contiguous():
        return t.view(-1)
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.shape[d]))
    return t.permute(order).reshape(-1)


def _unflatten_like(flat: Tensor, like: Tensor) -> Tensor:
    """The inverse of _flat_memory_order: a tensor shaped and strided like ``like``."""
    out = torch.empty_like(like, dtype=flat.dtype, memory_format=torch.preserve_format)
    _flat_memory_order(out).copy_(flat)
    return out


def moment_blocks(numel: int) -> int:
    """Number of 8-bit blocks (and float32 scales) of a moment with ``numel`` elements."""
    return -(-int(numel) // MOMENT_BLOCK)


def encode_moment(x: Tensor, dtype: torch.dtype, sqrt: bool = False):
    """Store float32 moment values ``x`` in ``dtype`` as the kernels do; returns
    (stored tensor shaped/strided like x, scales or None).

    float32: a copy; bfloat16: round to nearest even; uint8 (the dynamic map, docs/spec.md
    section 9): per block of :data:`MOMENT_BLOCK` elements in memory order, scale = absmax
    (float32), y = x / absmax (float32 division; an all-zero block divides by 1), code = the
    nearest entry of :func:`dynamic_map` (signed for exp_avg, unsigned with ``sqrt=True`` for
    exp_avg_sq, which keeps the value itself, no root): the largest c with map[c] <= y, plus
    one when y - map[c] >= (map[c+1] - map[c]) / 2 (torchao's quantize_8bit_with_qmap, bit for
    bit); an exp_avg block holding +-inf has scale FLT_MAX (inf codes +-1.0's neighbour: the
    largest entry); an exp_avg_sq block holding +-inf (a grad whose square overflows float32)
    has scale -d, d = its largest finite |value| (at least 2^-126), divides by d, and codes +inf
    255 (read back as +inf, as float32 state holds it) and its finite values at most 254 (read
    back against d: the block's other elements keep their precision); exp_avg_sq's code 0
    reads back as code 1's value (:func:`dynamic_decode_map`); float8_e4m3fn: per block of
    :data:`MOMENT_BLOCK` elements in memory order, scale = absmax / 448 (float32),
    codes = e4m3fn(x * (448 / absmax)) (round to nearest even), scales float32
    [moment_blocks(numel)]; ``sqrt=True`` (exp_avg_sq) quantizes sqrt(x) instead. A block
    holding +-inf (a finite grad whose square overflows float32) saturates: scale
    :data:`SATURATED_SCALE`, its inf elements code +-448 (value +-FLT_MAX, squared inf), its
    finite ones quantized against FLT_MAX; so a finite grad never writes a non-finite scale
    (only a NaN in the block gives a NaN scale). An all-zero block has scale 0.
    x: a dense float tensor (any device). Raises ValueError for another dtype."""
    if dtype not in MOMENT_DTYPES:
        raise ValueError(f"a moment dtype must be one of {MOMENT_DTYPES}, got {dtype}")
    x = x.detach().float()
    if dtype not in BLOCKWISE_DTYPES:
        return x.to(dtype, copy=True), None
    flat = _flat_memory_order(x)
    if dtype == torch.uint8:
        n = flat.numel()
        nb = moment_blocks(n)
        blocks = torch.nn.functional.pad(flat, (0, nb * MOMENT_BLOCK - n)).view(nb, MOMENT_BLOCK)
        codes, scale = _encode_dynamic(blocks, signed=not sqrt)
        return _unflatten_like(codes.view(-1)[:n].to(torch.uint8), x), scale
    if sqrt:  # correctly rounded (as the kernels' sqrt); torch's vectorized float sqrt is not
        flat = flat.double().sqrt().float()
    n = flat.numel()
    nb = moment_blocks(n)
    blocks = torch.nn.functional.pad(flat, (0, nb * MOMENT_BLOCK - n)).view(nb, MOMENT_BLOCK)
    absmax = blocks.abs().amax(dim=1) if nb else blocks.new_zeros(0)
    ok = (absmax > 0) & (absmax <= _FLT_MAX)
    saturated = absmax == math.inf
    safe = torch.where(ok, absmax, torch.ones_like(absmax))
    scale = torch.where(ok, safe / _FP8_MAX,
                        torch.where(absmax == 0, torch.zeros_like(absmax),
                                    torch.full_like(absmax, math.nan)))
    scale = torch.where(saturated, torch.full_like(absmax, SATURATED_SCALE), scale)
    inv = torch.where(ok, _FP8_MAX / safe, torch.zeros_like(absmax))
    # 448 / FLT_MAX rounded to float32, as the kernels divide
    sat_inv = torch.full_like(absmax, _FP8_MAX) / torch.full_like(absmax, _FLT_MAX)
    inv = torch.where(saturated, sat_inv, inv)
    # clamp: inf * inv -> +-448 as the kernels' encode saturates (NaN stays NaN)
    q = (blocks * inv[:, None]).clamp(-_FP8_MAX, _FP8_MAX)
    codes = q.view(-1)[:n].to(torch.float8_e4m3fn)
    return _unflatten_like(codes, x), scale


def decode_moment(t: Tensor, scales: Optional[Tensor] = None, sqrt: bool = False) -> Tensor:
    """The float32 values of a stored moment, a new tensor (the inverse of :func:`encode_moment`;
    exact for float32/bfloat16; value = map[code] * scale for uint8 (:func:`dynamic_map` for
    exp_avg, :func:`dynamic_decode_map` for exp_avg_sq with sqrt=True: code 0 reads as the
    smallest positive entry; a negative scale marks an exp_avg_sq block holding +inf: code 255
    reads +inf, the others map[code] * -scale); value = (float(code) * scale) (squared with
    sqrt=True) for float8_e4m3fn)."""
    if t.dtype not in BLOCKWISE_DTYPES:
        return t.to(torch.float32, copy=True)
    if scales is None:
        raise ValueError(f"an 8-bit ({t.dtype}) moment needs its per-block scales")
    flat = _flat_memory_order(t)
    codes = flat.long() if t.dtype == torch.uint8 else None
    flat = (dynamic_decode_map(not sqrt, t.device)[codes] if codes is not None
            else flat.float())
    n = flat.numel()
    nb = moment_blocks(n)
    if scales.numel() != nb:
        raise ValueError(f"an 8-bit moment of {n} elements has {nb} blocks, got {scales.numel()} scales")
    vals = torch.nn.functional.pad(flat, (0, nb * MOMENT_BLOCK - n)).view(nb, MOMENT_BLOCK)
    sc = scales.reshape(nb, 1).float()
    if codes is not None and sqrt:
        flagged = sc < 0
        c = torch.nn.functional.pad(codes, (0, nb * MOMENT_BLOCK - n)).view(nb, MOMENT_BLOCK)
        vals = torch.where(flagged & (c == 255), math.inf, vals * sc.abs())
    else:
        vals = vals * sc
    vals = vals.reshape(-1)[:n]
    if sqrt and t.dtype == torch.float8_e4m3fn:
        vals = vals * vals
    return _unflatten_like(vals, t)


def join_remainders(param: Tensor, remainder: Tensor) -> Tensor:
    """The float32 master of a bfloat16 param and its int16 remainder:
    bits = (bits(param) << 16) + remainder (mod 2^32), exactly (csrc/kernels/optimizer_step.h)."""
    hi = param.detach().view(torch.int16).to(torch.int64) & 0xFFFF
    bits = ((hi << 16) + remainder.to(torch.int64)) & 0xFFFFFFFF
    bits = bits - (bits >= 2**31).to(torch.int64) * 2**32
    return bits.to(torch.int32).view(torch.float32)


def split_remainders(master: Tensor):
    """(bfloat16 param, int16 remainder) holding the float32 ``master`` exactly: remainder =
    low 16 bits, param = (bits + 0x8000) >> 16 (round to nearest, ties away from zero),
    element by element; both laid out like ``master`` where it is dense (e.g. transposed),
    else contiguous."""
    u = master.detach().float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    lo = u & 0xFFFF
    rem = (lo - (lo >= 0x8000).to(torch.int64) * 0x10000).to(torch.int16)
    hi = ((u + 0x8000) >> 16) & 0xFFFF
    hi = (hi - (hi >= 0x8000).to(torch.int64) * 0x10000).to(torch.int16)
    # (u is in master's logical order: copied element by element, not in memory order)
    param = torch.empty_like(master, dtype=torch.bfloat16).copy_(hi.view(torch.bfloat16))
    return param, torch.empty_like(master, dtype=torch.int16).copy_(rem)


# -- bf16 params with stochastic rounding (docs/spec.md section 21) -------------------------
#
# csrc/kernels/optimizer_step.h (sr_mix64, sr_mix32, sr_stream, sr_salt, sr_random_bits,
# float_to_bf16_sr_bits) defines them; these are the same functions with Python ints (the
# per-param, per-step part) and int64 tensor ops (the per-element part).

_M64 = (1 << 64) - 1
_M32 = 0xFFFFFFFF


def _mix64(z: int) -> int:
    """splitmix64's finalizer (with its increment), on Python ints mod 2^64."""
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32), without int64 overflow (16-bit halves of c)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x: Tensor) -> Tensor:
    """lowbias32 on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def stochastic_rounding_key(seed: int, name: str) -> int:
    """The hash key of a param (an int in [0, 2^63), as an int64 holds it): splitmix64 of the
    run's ``seed`` mixed with the first 8 bytes of the BLAKE2b digest of the param's name (its
    global name: the same on every DP rank and for every ZeRO-1 layout)."""
    import hashlib

    digest = int.from_bytes(hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest(), "little")
    return _mix64(_mix64(seed & _M64) ^ digest) >> 1


def check_master_options(optimizer, fused_kind: Optional[str], fused_step: bool, master_weights,
                         stochastic_rounding, stochastic_rounding_seed, store_param_remainders,
                         half_dtypes):
    """Validate ``master_weights``, ``stochastic_rounding`` and ``stochastic_rounding_seed``
    (docs/spec.md section 21) before a wrapper changes anything; returns them as
    (bool, bool, int).

    ``master_weights=False, stochastic_rounding=True``: bf16 params keep no float32 master and
    no remainder; the step writes the bf16 param with stochastic rounding. Raises TypeError for
    a non-bool option or a non-int seed; ValueError for a seed outside [0, 2^63),
    ``stochastic_rounding=True`` with ``master_weights=True`` (the master holds the update
    exactly: nothing to round stochastically), ``master_weights=False`` without
    ``stochastic_rounding=True`` (round to nearest without a master loses every update below
    half a bf16 ulp), or with ``store_param_remainders=True`` (that keeps the master exactly),
    a seed other than 0 without stochastic rounding, without the one-pass Adam step (an exact
    torch.optim.Adam/AdamW, fused_step=True, no amsgrad/capturable/differentiable), with a
    trainable fp16 param, or without any trainable bf16 param (``half_dtypes``: the dtypes of
    the trainable 16-bit params)."""
    for name, value in (("master_weights", master_weights),
                        ("stochastic_rounding", stochastic_rounding)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    if not isinstance(stochastic_rounding_seed, int) or isinstance(stochastic_rounding_seed, bool):
        raise TypeError(f"stochastic_rounding_seed must be an int, got "
                        f"{type(stochastic_rounding_seed).__name__}")
    if not 0 <= stochastic_rounding_seed < 2**63:
        raise ValueError(f"stochastic_rounding_seed must be in [0, 2^63), got "
                         f"{stochastic_rounding_seed}")
    if stochastic_rounding and master_weights:
        raise ValueError(
            "stochastic_rounding=True rounds the bf16 param the step writes when no fp32 master "
            "is kept; with master_weights=True the master holds every update exactly (the param "
            "is its round-to-nearest copy): pass master_weights=False, stochastic_rounding=True")
    if not master_weights and not stochastic_rounding:
        raise ValueError(
            "master_weights=False needs stochastic_rounding=True: a bf16 param updated with "
            "round-to-nearest and no master loses every update below half a bf16 ulp (keep the "
            "master exactly in 2 bytes instead with store_param_remainders=True)")
    if stochastic_rounding_seed != 0 and not stochastic_rounding:
        raise ValueError(f"stochastic_rounding_seed={stochastic_rounding_seed} seeds stochastic "
                         "rounding, which is off: pass stochastic_rounding=True (with "
                         "master_weights=False) or leave the seed at 0")
    if not stochastic_rounding:
        return master_weights, stochastic_rounding, stochastic_rounding_seed
    if store_param_remainders:
        raise ValueError(
            "master_weights=False, stochastic_rounding=True keeps no master; "
            "store_param_remainders=True keeps it exactly as bf16 param + int16 remainder: "
            "pass one of them")
    if not (fused_step and fused_kind == "adam"):
        raise ValueError(
            f"master_weights=False, stochastic_rounding=True need the one-pass fused Adam step: "
            f"an exact torch.optim.Adam or AdamW with fused_step=True; got "
            f"{type(optimizer).__name__} with fused_step={fused_step}")
    if torch.float16 in half_dtypes:
        raise ValueError(
            "master_weights=False, stochastic_rounding=True apply to bf16 params; this optimizer "
            "has trainable float16 params (fp16 needs an fp32 master: master_weights=True)")
    if torch.bfloat16 not in half_dtypes:
        dtypes = sorted({str(p.dtype) for g in getattr(optimizer, "param_groups", [])
                         for p in g["params"] if p.requires_grad})
        raise ValueError(
            f"master_weights=False, stochastic_rounding=True drop the fp32 master of bf16 "
            f"params, but this optimizer has no trainable bf16 param (its trainable params are "
            f"{dtypes or 'none'}; fp32 params are their own masters), so they would do nothing")
    for gi, group in enumerate(getattr(optimizer, "param_groups", [])):
        for opt_name in ("amsgrad", "capturable", "differentiable"):
            if group.get(opt_name, False):
                raise ValueError(
                    f"master_weights=False, stochastic_rounding=True need the one-pass Adam "
                    f"step, which has no {opt_name}; param group {gi} has {opt_name}=True")
    return master_weights, stochastic_rounding, stochastic_rounding_seed


def stochastic_rounding_bits(key: int, step: int, index: Tensor) -> Tensor:
    """The 16 random bits (int64 values in [0, 2^16)) of the elements of global indices
    ``index`` (int64 tensor, >= 0: positions in the flattened param) of the param with hash key
    ``key`` at step count ``step`` (after this step's increment), as every launcher computes them:
    r = mix32((j mod 2^32) ^ salt(j >> 32)) >> 16 with salt(h) = high 32 bits of
    mix64(mix64(key ^ mix64(step)) ^ h) (csrc/kernels/optimizer_step.h)."""
    stream = _mix64((key & _M64) ^ _mix64(int(step) & _M64))
    index = index.to(torch.int64)
    hi = index >> 32
    salt = torch.zeros_like(index)
    for h in torch.unique(hi).tolist():
        salt = torch.where(hi == h, _mix64(stream ^ h) >> 32, salt)
    return _mix32((index & _M32) ^ salt) >> 16


def round_bf16_stochastic(x: Tensor, bits: Tensor) -> Tensor:
    """float32 ``x`` to bfloat16 with stochastic rounding by ``bits`` (int64 in [0, 2^16), same
    shape): bits(result) = (bits(x) + bits) >> 16 where |x| < the largest finite bf16 (bits
    0x7f7f0000); larger magnitudes, +-inf and NaN round to nearest even (a plain cast), so the
    result is inf only where round-to-nearest is inf (csrc/kernels/optimizer_step.h)."""
    x = x.detach().float().contiguous()
    u = x.view(torch.int32).to(torch.int64) & _M32
    a = u & 0x7FFFFFFF
    sr = (u + bits.reshape(x.shape).to(torch.int64)) >> 16
    rne = (u + 0x7FFF + ((u >> 16) & 1)) >> 16  # the kernels' float_to_bf16_bits
    nan = (u >> 16) | 0x0040  # a quiet NaN of the same sign
    out = torch.where(a >= 0x7F7F0000, torch.where(a > 0x7F800000, nan, rne), sr)
    out = out - (out >= 0x8000).to(torch.int64) * 0x10000
    return out.to(torch.int16).view(torch.bfloat16)


def stochastic_round_bf16(x: Tensor, key: int, step: int, first: int = 0) -> Tensor:
    """``x`` (float32, dense) written to bfloat16 as the step writes a param with stochastic
    rounding: element j (in memory order, the order the kernels walk) gets the random bits of
    global index ``first`` + j (:func:`stochastic_rounding_bits`) and
    :func:`round_bf16_stochastic`. Returns a new tensor shaped and strided like ``x``."""
    flat = _flat_memory_order(x.detach().float())
    index = first + torch.arange(flat.numel(), dtype=torch.int64, device=flat.device)
    out = round_bf16_stochastic(flat, stochastic_rounding_bits(key, step, index))
    return _unflatten_like(out, x)


# -- options ---------------------------------------------------------------------------------

#: state key -> the key of its per-block scales (8-bit moments only)
SCALE_KEYS = {"exp_avg": "exp_avg_scale", "exp_avg_sq": "exp_avg_sq_scale"}


def check_state_options(
    optimizer, fused_kind: Optional[str], fused_step: bool, exp_avg_dtype, exp_avg_sq_dtype,
    store_param_remainders, half_dtypes,
):
    """Validate the options before a wrapper changes anything; returns
    (exp_avg_dtype, exp_avg_sq_dtype, store_param_remainders).

    Raises ValueError for a dtype outside :data:`MOMENT_DTYPES`, a non-default option
    without the one-pass Adam step (``fused_step=False`` or an inner optimizer other than an
    exact torch.optim.Adam/AdamW) or with a param group option that step lacks (``amsgrad``,
    ``capturable``, ``differentiable``: named with the group), ``store_param_remainders`` with
    a trainable fp16 param or without any trainable bf16 param (fp32 params, FSDP2's
    included, have no remainder to keep: the option would do nothing) (``half_dtypes``: the
    dtypes of the trainable 16-bit params); TypeError for a non-bool. The loss scaler's part
    (narrow state needs one that never drops below 1) is
    :func:`tpamp._checks.check_narrow_state_scaler`."""
    for name, dtype in (("exp_avg_dtype", exp_avg_dtype), ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
        if dtype not in MOMENT_DTYPES:
            raise ValueError(
                f"{name} must be one of torch.float32, torch.bfloat16, torch.uint8 (8-bit "
                f"dynamic map), torch.float8_e4m3fn, got {dtype!r}"
            )
    if not isinstance(store_param_remainders, bool):
        raise TypeError(
            f"store_param_remainders must be a bool, got {type(store_param_remainders).__name__}"
        )
    narrow = (exp_avg_dtype != torch.float32 or exp_avg_sq_dtype != torch.float32
              or store_param_remainders)
    if narrow and not (fused_step and fused_kind == "adam"):
        raise ValueError(
            f"exp_avg_dtype={exp_avg_dtype}, exp_avg_sq_dtype={exp_avg_sq_dtype}, "
            f"store_param_remainders={store_param_remainders} need the one-pass fused Adam step: "
            f"an exact torch.optim.Adam or AdamW with fused_step=True; got "
            f"{type(optimizer).__name__} with fused_step={fused_step}"
        )
    if store_param_remainders and torch.float16 in half_dtypes:
        raise ValueError(
            "store_param_remainders=True keeps bf16 params + int16 remainders; this optimizer "
            "has float16 params (use an fp32 master for them: store_param_remainders=False)"
        )
    if store_param_remainders and torch.bfloat16 not in half_dtypes:
        dtypes = sorted({str(p.dtype) for g in getattr(optimizer, "param_groups", [])
                         for p in g["params"] if p.requires_grad})
        raise ValueError(
            f"store_param_remainders=True replaces the fp32 master of a bf16 param by an int16 "
            f"remainder, but this optimizer has no trainable bf16 param (its trainable params "
            f"are {dtypes or 'none'}; fp32 params, FSDP2's sharded fp32 params included, are "
            f"their own masters), so it would do nothing: pass store_param_remainders=False"
        )
    if narrow:
        for gi, group in enumerate(getattr(optimizer, "param_groups", [])):
            for opt_name in ("amsgrad", "capturable", "differentiable"):
                if group.get(opt_name, False):
                    raise ValueError(
                        f"exp_avg_dtype={exp_avg_dtype}, exp_avg_sq_dtype={exp_avg_sq_dtype}, "
                        f"store_param_remainders={store_param_remainders} need the one-pass "
                        f"Adam step, which has no {opt_name}; param group {gi} has "
                        f"{opt_name}=True (pass {opt_name}=False to "
                        f"{type(optimizer).__name__}, or keep float32 state)"
                    )
    return exp_avg_dtype, exp_avg_sq_dtype, store_param_remainders


#: The default ``min_8bit_size``: a param with fewer elements keeps float32 moments where its
#: configured moment dtype is 8-bit (bitsandbytes' ``min_8bit_size`` default; torchao's AdamW8bit
#: and AdamWFp8 quantize only tensors of >= 4096 elements too).
MIN_8BIT_SIZE = 4096


def check_min_8bit_size(min_8bit_size, exp_avg_dtype, exp_avg_sq_dtype) -> int:
    """Validate ``min_8bit_size`` (docs/spec.md section 9) before a wrapper changes anything;
    returns the rule's threshold as an int (elements).

    ``None`` (default): :data:`MIN_8BIT_SIZE` (4096) when a moment dtype is 8-bit
    (:data:`BLOCKWISE_DTYPES`), else 0 (nothing to decide). An int >= 0: a param with fewer
    elements (the whole param's ``numel()``: a DTensor's global one, never a ZeRO-1 shard's)
    keeps its 8-bit moments in float32 (0: quantize every param, the layout before the rule).
    Raises TypeError for a non-int (bool included), ValueError for a negative int or an int
    given when neither moment dtype is 8-bit (the option would do nothing)."""
    eight_bit = exp_avg_dtype in BLOCKWISE_DTYPES or exp_avg_sq_dtype in BLOCKWISE_DTYPES
    if min_8bit_size is None:
        return MIN_8BIT_SIZE if eight_bit else 0
    if not isinstance(min_8bit_size, int) or isinstance(min_8bit_size, bool):
        raise TypeError(f"min_8bit_size must be an int or None, got "
                        f"{type(min_8bit_size).__name__}")
    if min_8bit_size < 0:
        raise ValueError(f"min_8bit_size must be >= 0 (elements), got {min_8bit_size}")
    if not eight_bit:
        raise ValueError(
            f"min_8bit_size={min_8bit_size} chooses which params keep 8-bit moments, but "
            f"exp_avg_dtype={exp_avg_dtype} and exp_avg_sq_dtype={exp_avg_sq_dtype} are not "
            f"8-bit ({', '.join(str(d) for d in BLOCKWISE_DTYPES)}): leave it None")
    return min_8bit_size


def param_moment_dtypes(numel: int, exp_avg_dtype, exp_avg_sq_dtype, min_8bit_size: int):
    """(exp_avg dtype, exp_avg_sq dtype) stored for a param of ``numel`` elements (the whole
    param's) under the wrapper's configured dtypes: an 8-bit dtype becomes torch.float32 when
    ``numel < min_8bit_size``; float32 and bfloat16 stay as configured."""
    if numel >= min_8bit_size:
        return exp_avg_dtype, exp_avg_sq_dtype
    return tuple(torch.float32 if d in BLOCKWISE_DTYPES else d
                 for d in (exp_avg_dtype, exp_avg_sq_dtype))


def check_saved_scales(state, where: str = "state_dict['optimizer']['state']") -> None:
    """Check the 8-bit scale keys of a saved torch.optim state (``{param id: {key: value}}``,
    as in a state dict's ``'state'``) before anything is loaded, whatever the loading
    optimizer's configuration (it converts every moment to its own dtypes, reading 8-bit codes
    through these scales):

    * an 8-bit moment (``exp_avg`` / ``exp_avg_sq`` of dtype torch.uint8 or
      torch.float8_e4m3fn) needs its scale key (:data:`SCALE_KEYS`): KeyError naming both;
    * a scale key needs its moment, a float tensor of ``moment_blocks(numel)`` elements
      (``numel``: the moment's local elements; one float32 scale per :data:`MOMENT_BLOCK`),
      finite and >= 0 (0 only for an all-zero block; a uint8 ``exp_avg_sq`` may also hold
      negative scales: its blocks holding +inf, see :func:`encode_moment`); a moment with a
      scale key that is not
      float8 (e.g. cast to float32 by a torch.optim load) must hold e4m3fn code values exactly.
      TypeError for a non-tensor, ValueError otherwise, naming the key and the bad value.

    One host read for all the scales' values. Raises before any change (it changes nothing)."""
    to_read, signed_ok = [], []
    for pid, entry in state.items():
        if not hasattr(entry, "get"):
            continue  # the caller's mapping checks name it
        swhere = f"{where}[{pid!r}]"
        for key, skey in SCALE_KEYS.items():
            moment, scales = entry.get(key), entry.get(skey)
            if isinstance(moment, Tensor) and moment.dtype in BLOCKWISE_DTYPES and scales is None:
                raise KeyError(
                    f"{swhere}[{key!r}] holds 8-bit ({moment.dtype}) codes but {swhere} has no "
                    f"{skey!r}: without its per-block scales the codes have no values; refusing "
                    "to load it (nothing was changed)"
                )
            if skey not in entry:
                continue
            if not isinstance(scales, Tensor):
                raise TypeError(f"{swhere}[{skey!r}] must be a tensor, got {type(scales).__name__}")
            if not isinstance(moment, Tensor):
                raise ValueError(
                    f"{swhere} has {skey!r} but no {key!r} tensor (got {type(moment).__name__}): "
                    "scales without their 8-bit moment"
                )
            if not scales.is_floating_point() or scales.element_size() < 2:
                raise ValueError(
                    f"{swhere}[{skey!r}] has dtype {scales.dtype}; 8-bit scales are torch.float32"
                )
            n = local_tensor(moment).numel()
            nb = moment_blocks(n)
            if scales.dim() != 1 or scales.numel() != nb:
                raise ValueError(
                    f"{swhere}[{skey!r}] has shape {tuple(scales.shape)}; {key!r} has {n} "
                    f"elements, so its scales have shape ({nb},) (one per block of "
                    f"{MOMENT_BLOCK}): a truncated or foreign state dict?"
                )
            to_read.append((f"{swhere}[{skey!r}]", scales, f"{swhere}[{key!r}]", moment))
            signed_ok.append(key == "exp_avg_sq" and moment.dtype == torch.uint8)
    if not to_read:
        return
    flags = []
    for _, scales, _, moment in to_read:
        sc = local_tensor(scales).float()
        codes = local_tensor(moment)
        if codes.dtype in BLOCKWISE_DTYPES:
            exact = torch.ones((), dtype=torch.bool, device=sc.device)
        else:  # codes cast to another dtype: must round-trip through e4m3fn exactly
            c = codes.float()
            exact = ((c.to(torch.float8_e4m3fn).float() == c) | c.isnan()).all().to(sc.device)
        flags.append(torch.stack([sc.isfinite().all(), (sc >= 0).all(), exact]).cpu())
    for (sname, scales, mname, moment), (finite, nonneg, exact), neg_ok in zip(
            to_read, torch.stack(flags).tolist(), signed_ok):
        sc = local_tensor(scales).float()
        if not finite:
            bad = sc[~sc.isfinite()][:3].tolist()
            raise ValueError(f"{sname} holds non-finite scales {bad}; refusing to load it")
        if not nonneg and not neg_ok:
            bad = sc[sc < 0][:3].tolist()
            raise ValueError(
                f"{sname} holds negative scales {bad}; a scale is a block's max |value| / 448 "
                "(>= 0); refusing to load it"
            )
        if not exact:
            raise ValueError(
                f"{mname} has dtype {moment.dtype} with values that are not float8_e4m3fn codes, "
                f"but {sname} is present: a state dict whose moments are not the 8-bit codes "
                "their scales belong to; refusing to load it"
            )


def refuse_generic_step(wrapper) -> None:
    """Raise RuntimeError when ``wrapper`` (a tpamp optimizer wrapper: its public attributes
    ``exp_avg_dtype``, ``exp_avg_sq_dtype``, ``store_param_remainders``, absent meaning the
    defaults) keeps narrow state: the generic path (the inner optimizer's own step()) cannot
    keep it. Called before that path changes anything."""
    if not getattr(wrapper, "master_weights", True):
        raise RuntimeError(
            "this step would take the generic path (inner optimizer.step(): step hooks, a "
            "param group option the one-pass kernel lacks such as amsgrad set after "
            "construction, or a loss scaler that may drop below 1), which cannot keep bf16 "
            "params without masters (master_weights=False, stochastic_rounding=True); nothing "
            "was changed")
    if (getattr(wrapper, "exp_avg_dtype", torch.float32) != torch.float32
            or getattr(wrapper, "exp_avg_sq_dtype", torch.float32) != torch.float32
            or getattr(wrapper, "store_param_remainders", False)):
        raise RuntimeError(
            f"this step would take the generic path (inner optimizer.step(): step hooks, a "
            f"param group option the one-pass kernel lacks such as amsgrad set after "
            f"construction, or a loss scaler that may drop below 1), which cannot keep "
            f"exp_avg_dtype={wrapper.exp_avg_dtype}, "
            f"exp_avg_sq_dtype={wrapper.exp_avg_sq_dtype}, "
            f"store_param_remainders={wrapper.store_param_remainders}; nothing was changed"
        )


def new_adam_state(like: Tensor, step_dtype, exp_avg_dtype, exp_avg_sq_dtype) -> Dict:
    """A fresh Adam state for a param stored like ``like`` (torch.optim.Adam's _init_group,
    with the step on the param's device): zero moments in their dtypes (+ zero scales)."""
    state = {"step": torch.zeros((), dtype=step_dtype, device=like.device)}
    for key, dtype in (("exp_avg", exp_avg_dtype), ("exp_avg_sq", exp_avg_sq_dtype)):
        state[key] = torch.zeros_like(like, dtype=dtype, memory_format=torch.preserve_format)
        if dtype in BLOCKWISE_DTYPES:
            state[SCALE_KEYS[key]] = torch.zeros(
                moment_blocks(like.numel()), dtype=torch.float32, device=like.device)
    return state


def needs_conversion(state: Dict, exp_avg_dtype, exp_avg_sq_dtype) -> bool:
    """Whether a param's Adam state is stored otherwise than configured (after a load)."""
    for key, dtype in (("exp_avg", exp_avg_dtype), ("exp_avg_sq", exp_avg_sq_dtype)):
        if key not in state:
            continue
        if state[key].dtype != dtype or (SCALE_KEYS[key] in state) != (dtype in BLOCKWISE_DTYPES):
            return True
    return False


def state_tensor_bytes(state: Dict) -> int:
    """Bytes of the tensors of one param's optimizer state (every dtype, 0-dim included)."""
    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, Tensor))


# -- conversion between formats ------------------------------------------------------------


def convert_adam_state(state: Dict, like: Tensor, exp_avg_dtype, exp_avg_sq_dtype) -> Dict:
    """``state`` (torch.optim Adam state as loaded: moments in any dtype, possibly cast to
    float32 by torch.optim's load_state_dict; 8-bit ones recognised by their scale keys) with its
    moments stored in the configured dtypes, laid out like ``like`` (the tensor the kernel
    steps). Returns a new dict; exact where the target holds the value (see module doc)."""
    out = {k: v for k, v in state.items() if k not in SCALE_KEYS.values()}
    for key, dtype in (("exp_avg", exp_avg_dtype), ("exp_avg_sq", exp_avg_sq_dtype)):
        if key not in state:
            continue
        v = state[key]
        scales = state.get(SCALE_KEYS[key])
        sq = key == "exp_avg_sq"
        if scales is not None:  # 8-bit codes, maybe cast to another float dtype on load
            # uint8: dynamic-map codes (torch.optim's load keeps integer state); any other
            # dtype: e4m3fn codes, maybe cast to float32 by torch.optim's load
            codes = v if v.dtype in BLOCKWISE_DTYPES else v.to(torch.float8_e4m3fn)
            if dtype == codes.dtype and codes.is_contiguous() and like.is_contiguous():
                out[key] = codes.reshape(like.shape).to(like.device)  # the same codes: exact
                out[SCALE_KEYS[key]] = scales.float().to(like.device)
                continue
            values = decode_moment(codes.reshape(like.shape), scales.float(), sqrt=sq)
        else:
            values = v.reshape(like.shape).float()
        values = values.to(like.device)
        if values.stride() != like.stride():
            values = torch.empty_like(like, dtype=torch.float32).copy_(values)
        stored, new_scales = encode_moment(values, dtype, sqrt=sq)
        out[key] = stored
        if new_scales is not None:
            out[SCALE_KEYS[key]] = new_scales
    return out


def restore_code_dtypes(optimizer, saved: Dict) -> None:
    """After ``optimizer.load_state_dict(saved)`` (a torch.optim optimizer and the state dict it
    loaded): torch.optim casts floating state to the param's dtype and integer state too (8-bit
    codes come back as float32 numbers); cast every 8-bit moment (``exp_avg`` / ``exp_avg_sq``
    saved as torch.uint8 or torch.float8_e4m3fn with its scale key, :data:`SCALE_KEYS`) back to
    its saved dtype, exactly (codes are integers 0..255 or e4m3fn values), so
    :func:`convert_adam_state` reads them as the codes they are. Saved params are matched to
    the optimizer's by position in ``param_groups``, as torch.optim does. In place."""
    saved_state = saved.get("state", {})
    for saved_group, group in zip(saved.get("param_groups", []), optimizer.param_groups):
        for pid, p in zip(saved_group["params"], group["params"]):
            entry, live = saved_state.get(pid), optimizer.state.get(p)
            if not entry or not live:
                continue
            for key, skey in SCALE_KEYS.items():
                v = entry.get(key)
                if (skey in entry and isinstance(v, Tensor) and v.dtype in BLOCKWISE_DTYPES
                        and isinstance(live.get(key), Tensor) and live[key].dtype != v.dtype):
                    live[key] = live[key].to(v.dtype)


def layout_free_state(state: Dict) -> Dict:
    """``state`` for a layout-free (torch.distributed.checkpoint) save: float32 and bfloat16
    moments as they are (views), 8-bit moments decoded to float32 values (new tensors) without
    their scales, whose blocks depend on this rank's layout. Loading re-encodes them:
    float8_e4m3fn codes come back identical, a scale to within one float32 ulp; uint8 codes
    too, except in a block whose largest |value| is negative (the signed map's most negative
    entry is -0.993, not -1: that block's scale shrinks by 0.7% and a code may move by one),
    an exp_avg_sq code 0 (it reads as code 1's value and comes back as code 1: the same value)
    and an exp_avg_sq block holding inf (its largest finite value read back is at most 0.9965
    of d, which becomes the new d: codes may move by one; the inf stays inf)."""
    if not any(k in state for k in SCALE_KEYS.values()):
        return state
    out = {k: v for k, v in state.items() if k not in SCALE_KEYS.values()}
    for key, skey in SCALE_KEYS.items():
        if skey in state:
            v = state[key]
            values = decode_moment(local_tensor(v), state[skey], sqrt=key == "exp_avg_sq")
            out[key] = dtensor_like(values, v)
    return out


# -- DTensor wrapping ----------------------------------------------------------------------


def dtensor_like(local: Tensor, like: Tensor) -> Tensor:
    """``local`` (this rank's part, a plain tensor) as a tensor like ``like``.

    When ``like`` is a ``torch.distributed.tensor.DTensor`` (e.g. an FSDP2 or tensor-parallel
    main param), returns ``DTensor.from_local(local, like.device_mesh, like.placements,
    run_check=False, shape=like.shape, stride=like.stride())``: no communication, no copy;
    ``local`` must have the shape of ``like``'s local tensor (not checked). Otherwise returns
    ``local`` itself. Any dtype and device."""
    if not is_dtensor(like):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


def moments_like(state: Dict, main: Tensor) -> Dict:
    """Adam state whose moments (``exp_avg``, ``exp_avg_sq``) are DTensors like a DTensor
    ``main`` (as torch.optim keeps them), from moments that are this rank's local tensors
    (e.g. :func:`new_adam_state` or :func:`convert_adam_state` on the local main). The 8-bit
    scales and the step stay local (their blocks are this rank's). Returns ``state`` itself for
    a plain ``main``, else a new dict; moments already DTensors are kept as they are."""
    if not is_dtensor(main):
        return state
    out = dict(state)
    for k in ("exp_avg", "exp_avg_sq"):
        if k in out and not is_dtensor(out[k]):
            out[k] = dtensor_like(out[k], main)
    return out


def master_from_remainder(model: Tensor, remainder: Tensor, like: Tensor) -> Tensor:
    """The float32 master of a bf16 ``model`` param kept with an int16 ``remainder``
    (``store_param_remainders=True``): :func:`join_remainders` of the model's local data and
    the remainder (this rank's, same shape), exactly, a new tensor laid out as a tensor like
    ``like`` (:func:`dtensor_like`: a DTensor with the mesh and placements of a DTensor main)."""
    return dtensor_like(join_remainders(local_tensor(model.detach()), remainder), like)
