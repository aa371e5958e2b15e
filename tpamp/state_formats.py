"""Narrow storage of Adam/AdamW state in tpamp's optimizer wrappers (issue 22).

Options of :class:`tpamp.MixedPrecisionOptimizer` and :class:`tpamp.DistributedOptimizer`, with
the names of Megatron-core's precision-aware optimizer and Transformer Engine's FusedAdam:

* ``exp_avg_dtype``, ``exp_avg_sq_dtype``: ``torch.float32`` (default), ``torch.bfloat16``
  (round to nearest even) or ``torch.float8_e4m3fn`` (8-bit codes with one float32 scale per
  block of :data:`tpamp.ops.MOMENT_BLOCK` = 256 elements; exp_avg_sq keeps the codes of its
  square root). The state keeps torch.optim's keys (``exp_avg``, ``exp_avg_sq``, ``step``) in
  these dtypes, plus ``exp_avg_scale`` / ``exp_avg_sq_scale`` (float32, one per block) for 8-bit.
* ``store_param_remainders=True`` (bf16 model params only): no float32 master copy; the master
  is the bf16 param's bits plus an int16 remainder (``tpamp.ops.join_remainders``), rebuilt
  exactly inside the kernel, so the fp32 master values are bit-identical to the fp32-master
  step's. The bf16 param is the master rounded to nearest with ties away from zero (one ulp
  away from round-to-nearest-even when the low half is exactly 0x8000; see
  csrc/kernels/optimizer_step.h for why 16 bits cannot do round-to-nearest-even).

Both need the one-pass fused step (an exact ``torch.optim.Adam``/``AdamW``, ``fused_step=True``);
the generic path refuses them. Bytes per parameter of state (master or remainder + two
moments): 12 (fp32), 8 (bf16 moments), 6 (bf16 moments + remainders), about 4.03 (8-bit moments
+ remainders: 2 + 2 x (1 + 4/256)) and 6.03 (8-bit moments with an fp32 master).

Conversions (loading a state dict or checkpoint saved in another configuration): moments are
decoded to float32 and encoded in the configured dtype (exact from bf16/8-bit to float32, and
fp32 -> bf16 rounds to nearest even, -> 8-bit quantizes blockwise); masters are saved as float32
(``fp32_from_fp16_params``/``main_params``, Megatron's format, rebuilt exactly from remainders),
and split exactly into param + remainder on load.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from tpamp import ops

__all__ = [
    "check_state_options",
    "new_adam_state",
    "convert_adam_state",
    "state_tensor_bytes",
    "layout_free_state",
    "needs_conversion",
    "SCALE_KEYS",
]

Tensor = torch.Tensor

#: state key -> the key of its per-block scales (8-bit moments only)
SCALE_KEYS = {"exp_avg": "exp_avg_scale", "exp_avg_sq": "exp_avg_sq_scale"}


def check_state_options(
    optimizer, fused_kind: Optional[str], fused_step: bool, exp_avg_dtype, exp_avg_sq_dtype,
    store_param_remainders, half_dtypes,
):
    """Validate the options before a wrapper changes anything; returns
    (exp_avg_dtype, exp_avg_sq_dtype, store_param_remainders).

    Raises ValueError for a dtype outside ``tpamp.ops.MOMENT_DTYPES``, a non-default option
    without the one-pass Adam step (``fused_step=False`` or an inner optimizer other than an
    exact torch.optim.Adam/AdamW), or ``store_param_remainders`` with a trainable fp16 param
    (``half_dtypes``: the dtypes of the trainable 16-bit params); TypeError for a non-bool."""
    for name, dtype in (("exp_avg_dtype", exp_avg_dtype), ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
        if dtype not in ops.MOMENT_DTYPES:
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


def new_adam_state(like: Tensor, step_dtype, exp_avg_dtype, exp_avg_sq_dtype) -> Dict:
    """A fresh Adam state for a param stored like ``like`` (torch.optim.Adam's _init_group,
    with the step on the param's device): zero moments in their dtypes (+ zero scales)."""
    state = {"step": torch.zeros((), dtype=step_dtype, device=like.device)}
    for key, dtype in (("exp_avg", exp_avg_dtype), ("exp_avg_sq", exp_avg_sq_dtype)):
        state[key] = torch.zeros_like(like, dtype=dtype, memory_format=torch.preserve_format)
        if dtype == torch.float8_e4m3fn:
            state[SCALE_KEYS[key]] = torch.zeros(
                ops.moment_blocks(like.numel()), dtype=torch.float32, device=like.device)
    return state


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
            values = ops.decode_moment(codes.reshape(like.shape), scales.float(), sqrt=sq)
        else:
            values = v.reshape(like.shape).float()
        values = values.to(like.device)
        if values.stride() != like.stride():
            values = torch.empty_like(like, dtype=torch.float32).copy_(values)
        stored, new_scales = ops.encode_moment(values, dtype, sqrt=sq)
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
            local = v.to_local() if hasattr(v, "to_local") else v
            values = ops.decode_moment(local, state[skey], sqrt=key == "exp_avg_sq")
            if local is not v:
                from torch.distributed.tensor import DTensor

                values = DTensor.from_local(values, v.device_mesh, v.placements, run_check=False,
                                            shape=v.shape, stride=v.stride())
            out[key] = values
    return out


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
