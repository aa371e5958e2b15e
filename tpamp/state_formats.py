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
  (round to nearest even) or ``torch.float8_e4m3fn`` (8-bit codes with one float32 scale per
  block of :data:`MOMENT_BLOCK` = 256 elements; exp_avg_sq keeps the codes of its square root).
  The state keeps torch.optim's keys (``exp_avg``, ``exp_avg_sq``, ``step``) in these dtypes,
  plus ``exp_avg_scale`` / ``exp_avg_sq_scale`` (float32, one per block) for 8-bit.
* ``store_param_remainders=True`` (bf16 model params only): no float32 master copy; the master
  is the bf16 param's bits plus an int16 remainder (:func:`join_remainders`), rebuilt exactly
  inside the kernel, so the fp32 master values are bit-identical to the fp32-master step's. The
  bf16 param is the master rounded to nearest with ties away from zero (one ulp away from
  round-to-nearest-even when the low half is exactly 0x8000; see csrc/kernels/optimizer_step.h
  for why 16 bits cannot do round-to-nearest-even).

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

from tpamp.common import is_dtensor, local_tensor

__all__ = [
    # bit formats (the kernels' reference)
    "MOMENT_BLOCK",
    "MOMENT_DTYPES",
    "moment_blocks",
    "encode_moment",
    "decode_moment",
    "join_remainders",
    "split_remainders",
    # options
    "check_state_options",
    "refuse_generic_step",
    "new_adam_state",
    "needs_conversion",
    "state_tensor_bytes",
    "SCALE_KEYS",
    # conversion between formats
    "convert_adam_state",
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
#: The dtypes a stored moment may have (float8_e4m3fn: 8-bit codes with per-block scales).
MOMENT_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn)


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

    float32: a copy; bfloat16: round to nearest even; float8_e4m3fn: per block of
    :data:`MOMENT_BLOCK` elements in memory order, scale = absmax / 448 (float32),
    codes = e4m3fn(x * (448 / absmax)) (round to nearest even), scales float32
    [moment_blocks(numel)]; ``sqrt=True`` (exp_avg_sq) quantizes sqrt(x) instead.
    x: a dense float tensor (any device). Raises ValueError for another dtype."""
    if dtype not in MOMENT_DTYPES:
        raise ValueError(f"a moment dtype must be one of {MOMENT_DTYPES}, got {dtype}")
    x = x.detach().float()
    if dtype != torch.float8_e4m3fn:
        return x.to(dtype, copy=True), None
    flat = _flat_memory_order(x)
    if sqrt:  # correctly rounded (as the kernels' sqrt); torch's vectorized float sqrt is not
        flat = flat.double().sqrt().float()
    n = flat.numel()
    nb = moment_blocks(n)
    blocks = torch.nn.functional.pad(flat, (0, nb * MOMENT_BLOCK - n)).view(nb, MOMENT_BLOCK)
    absmax = blocks.abs().amax(dim=1) if nb else blocks.new_zeros(0)
    ok = (absmax > 0) & (absmax <= torch.finfo(torch.float32).max)
    safe = torch.where(ok, absmax, torch.ones_like(absmax))
    scale = torch.where(ok, safe / _FP8_MAX,
                        torch.where(absmax == 0, torch.zeros_like(absmax),
                                    torch.full_like(absmax, math.nan)))
    inv = torch.where(ok, _FP8_MAX / safe, torch.zeros_like(absmax))
    codes = (blocks * inv[:, None]).view(-1)[:n].to(torch.float8_e4m3fn)
    return _unflatten_like(codes, x), scale


def decode_moment(t: Tensor, scales: Optional[Tensor] = None, sqrt: bool = False) -> Tensor:
    """The float32 values of a stored moment, a new tensor (the inverse of :func:`encode_moment`;
    exact for float32/bfloat16, value = (float(code) * scale) (squared with sqrt=True) for 8-bit)."""
    if t.dtype != torch.float8_e4m3fn:
        return t.to(torch.float32, copy=True)
    if scales is None:
        raise ValueError("an 8-bit (float8_e4m3fn) moment needs its per-block scales")
    flat = _flat_memory_order(t).float()
    n = flat.numel()
    nb = moment_blocks(n)
    if scales.numel() != nb:
        raise ValueError(f"an 8-bit moment of {n} elements has {nb} blocks, got {scales.numel()} scales")
    vals = torch.nn.functional.pad(flat, (0, nb * MOMENT_BLOCK - n)).view(nb, MOMENT_BLOCK)
    vals = (vals * scales.reshape(nb, 1).float()).view(-1)[:n]
    if sqrt:
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
    low 16 bits, param = (bits + 0x8000) >> 16 (round to nearest, ties away from zero)."""
    u = master.detach().float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    lo = u & 0xFFFF
    rem = (lo - (lo >= 0x8000).to(torch.int64) * 0x10000).to(torch.int16)
    hi = ((u + 0x8000) >> 16) & 0xFFFF
    hi = (hi - (hi >= 0x8000).to(torch.int64) * 0x10000).to(torch.int16)
    param = _unflatten_like(_flat_memory_order(hi.view(torch.bfloat16)), master)
    return param, _unflatten_like(_flat_memory_order(rem), master)


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
    exact torch.optim.Adam/AdamW), or ``store_param_remainders`` with a trainable fp16 param
    (``half_dtypes``: the dtypes of the trainable 16-bit params); TypeError for a non-bool."""
    for name, dtype in (("exp_avg_dtype", exp_avg_dtype), ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
        if dtype not in MOMENT_DTYPES:
            raise ValueError(
                f"{name} must be one of torch.float32, torch.bfloat16, torch.float8_e4m3fn, "
                f"got {dtype!r}"
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
    return exp_avg_dtype, exp_avg_sq_dtype, store_param_remainders


def refuse_generic_step(wrapper) -> None:
    """Raise RuntimeError when ``wrapper`` (a tpamp optimizer wrapper: its public attributes
    ``exp_avg_dtype``, ``exp_avg_sq_dtype``, ``store_param_remainders``, absent meaning the
    defaults) keeps narrow state: the generic path (the inner optimizer's own step()) cannot
    keep it. Called before that path changes anything."""
    if (getattr(wrapper, "exp_avg_dtype", torch.float32) != torch.float32
            or getattr(wrapper, "exp_avg_sq_dtype", torch.float32) != torch.float32
            or getattr(wrapper, "store_param_remainders", False)):
        raise RuntimeError(
            f"this step would take the generic path (inner optimizer.step(): step hooks, an "
            f"option the one-pass kernel lacks, amsgrad or a loss scaler that may "
            f"drop below 1), which cannot keep exp_avg_dtype={wrapper.exp_avg_dtype}, "
            f"exp_avg_sq_dtype={wrapper.exp_avg_sq_dtype}, "
            f"store_param_remainders={wrapper.store_param_remainders}; nothing was changed"
        )


def new_adam_state(like: Tensor, step_dtype, exp_avg_dtype, exp_avg_sq_dtype) -> Dict:
    """A fresh Adam state for a param stored like ``like`` (torch.optim.Adam's _init_group,
    with the step on the param's device): zero moments in their dtypes (+ zero scales)."""
    state = {"step": torch.zeros((), dtype=step_dtype, device=like.device)}
    for key, dtype in (("exp_avg", exp_avg_dtype), ("exp_avg_sq", exp_avg_sq_dtype)):
        state[key] = torch.zeros_like(like, dtype=dtype, memory_format=torch.preserve_format)
        if dtype == torch.float8_e4m3fn:
            state[SCALE_KEYS[key]] = torch.zeros(
                moment_blocks(like.numel()), dtype=torch.float32, device=like.device)
    return state


def needs_conversion(state: Dict, exp_avg_dtype, exp_avg_sq_dtype) -> bool:
    """Whether a param's Adam state is stored otherwise than configured (after a load)."""
    for key, dtype in (("exp_avg", exp_avg_dtype), ("exp_avg_sq", exp_avg_sq_dtype)):
        if key not in state:
            continue
        if state[key].dtype != dtype or (SCALE_KEYS[key] in state) != (dtype == torch.float8_e4m3fn):
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
            codes = v.to(torch.float8_e4m3fn) if v.dtype != torch.float8_e4m3fn else v
            if dtype == torch.float8_e4m3fn and codes.is_contiguous() and like.is_contiguous():
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


def layout_free_state(state: Dict) -> Dict:
    """``state`` for a layout-free (torch.distributed.checkpoint) save: float32 and bfloat16
    moments as they are (views), 8-bit moments decoded to float32 values (new tensors) without
    their scales, whose blocks depend on this rank's layout. Loading re-encodes them: the
    codes come back identical, a scale to within one float32 ulp."""
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
