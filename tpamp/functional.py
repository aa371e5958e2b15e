"""Megatron-LM's fp16 numerics helpers for a half-precision transformer.

* :func:`residual_add` — the residual stream kept in fp32 (``--fp32-residual-connection``).
* :func:`scale_mask_softmax` — attention softmax computed in fp32 and returned in the input
  dtype (``--attention-softmax-in-fp32``; Megatron's ``FusedScaleMaskSoftmax`` torch path).
* :func:`vocab_parallel_cross_entropy` — cross-entropy over vocab-sharded logits on the
  tensor-parallel group, in fp32 unless ``fp16_lm_cross_entropy`` (Megatron's
  ``_VocabParallelCrossEntropy``, megatron/core/tensor_parallel/cross_entropy.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["residual_add", "scale_mask_softmax", "vocab_parallel_cross_entropy"]

_HALF_DTYPES = (torch.float16, torch.bfloat16)


def residual_add(
    x: torch.Tensor, residual: torch.Tensor, fp32_residual_connection: bool = False
) -> torch.Tensor:
    """``residual + x`` for a transformer sublayer output ``x``.

    With ``fp32_residual_connection`` (Megatron's ``--fp32-residual-connection``) the sum is
    done and returned in fp32, so the residual stream accumulates in fp32 even when the
    sublayers run in fp16/bf16; otherwise the sum is in ``x.dtype`` (the residual is cast to it).
    Shapes must broadcast (normally both ``[s, b, h]`` or ``[b, s, h]``). Differentiable.
    """
    if fp32_residual_connection:
        return residual.float() + x.float()
    return residual.to(x.dtype) + x


def _causal_mask(sq: int, sk: int, device) -> torch.Tensor:
    # query i (of the last sq positions of sk keys) may see keys <= sk - sq + i
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu_(diagonal=1 + sk - sq)


def scale_mask_softmax(
    input: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    *,
    causal: bool = False,
    softmax_in_fp32: bool = True,
    mask_value: float = -10000.0,
) -> torch.Tensor:
    """Attention probabilities ``softmax(mask(scale * input))`` over the last dim.

    Args:
        input: attention scores ``[b, np, sq, sk]`` (any floating dtype).
        mask: bool tensor broadcastable to the input, True = masked out (Megatron's
            convention), or None.
        scale: multiplier applied before masking (e.g. Megatron's query-key layer scaling
            coefficient), or None.
        causal: also mask keys after each query (upper triangle; with sq < sk the queries are
            the last sq positions).
        softmax_in_fp32: for fp16/bf16 input, compute scale, mask and softmax in fp32 and cast
            the probabilities back to the input dtype (``--attention-softmax-in-fp32``). When
            False the softmax runs in the input dtype.
        mask_value: value written at masked positions (Megatron: -10000.0, so a fully masked
            row gives a uniform distribution instead of nan).

    Returns probabilities of ``input``'s shape and dtype. Raises ValueError if input is not 4-D
    or the mask is not bool.
    """
    if input.dim() != 4:
        raise ValueError(f"input must be [b, np, sq, sk], got shape {tuple(input.shape)}")
    if mask is not None and mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor (True = masked), got {mask.dtype}")
    orig_dtype = input.dtype
    upcast = softmax_in_fp32 and orig_dtype in _HALF_DTYPES
    x = input.float() if upcast else input
    if scale is not None:
        x = x * scale
    if causal:
        cm = _causal_mask(x.size(-2), x.size(-1), x.device)
        mask = cm if mask is None else (mask | cm)
    if mask is not None:
        x = x.masked_fill(mask, mask_value)
    probs = torch.softmax(x, dim=-1)
    return probs.to(orig_dtype) if upcast else probs


def _group_rank_size(group) -> tuple:
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron-LM's _VocabParallelCrossEntropy: three all-reduces (max logit, target logit,
    sum of exps) over the TP group; backward is ``softmax - onehot`` on the local shard.
    Unlike Megatron the logits are not modified in place."""

    @staticmethod
    def forward(ctx, logits, target, group, rank, world_size):
        # max over the full vocabulary, for a stable exp
        logits_max = logits.max(dim=-1)[0]
        if world_size > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)

        partition_vocab_size = logits.size(-1)
        vocab_start = rank * partition_vocab_size
        vocab_end = vocab_start + partition_vocab_size
        target_mask = (target < vocab_start) | (target >= vocab_end)
        masked_target = target - vocab_start
        masked_target = masked_target.masked_fill(target_mask, 0)

        shifted_2d = shifted.reshape(-1, partition_vocab_size)
        masked_target_1d = masked_target.reshape(-1)
        arange_1d = torch.arange(shifted_2d.size(0), device=logits.device)
        predicted = shifted_2d[arange_1d, masked_target_1d].reshape(target.shape)
        predicted = predicted.masked_fill(target_mask, 0.0)
        if world_size > 1:
            dist.all_reduce(predicted, op=dist.ReduceOp.SUM, group=group)

        exp_logits = torch.exp(shifted)
        sum_exp = exp_logits.sum(dim=-1)
        if world_size > 1:
            dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=group)
        loss = torch.log(sum_exp) - predicted

        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        grad_input = softmax.clone()
        grad_2d = grad_input.view(-1, grad_input.size(-1))
        arange_1d = torch.arange(grad_2d.size(0), device=grad_2d.device)
        grad_2d[arange_1d, masked_target_1d] -= 1.0 - target_mask.reshape(-1).to(grad_2d.dtype)
        grad_input.mul_(grad_output.unsqueeze(-1).to(grad_input.dtype))
        return grad_input, None, None, None, None


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    tp_group: Optional[dist.ProcessGroup] = None,
    *,
    fp16_lm_cross_entropy: bool = False,
) -> torch.Tensor:
    """Per-token cross-entropy of logits sharded along the vocabulary over the TP group.

    Args:
        vocab_parallel_logits: ``[..., vocab / tp]``, this rank's contiguous slice of the vocab
            (TP rank r holds ids ``[r * V/tp, (r + 1) * V/tp)``, Megatron's layout; all ranks
            hold the same slice size).
        target: ``[...]`` int64 token ids in the full vocabulary, same leading shape, same on
            every TP rank.
        tp_group: the tensor-parallel group (``ParallelState.tp_group``); None = unsharded.
        fp16_lm_cross_entropy: compute in the logits' own dtype (fp16/bf16) and return a
            loss of that dtype (Megatron's ``--fp16-lm-cross-entropy``). Default: the logits
            are cast to fp32 first and the loss is fp32 (the gradient flows back in the
            logits' dtype either way).

    Returns the unreduced loss ``[...]`` (apply the loss mask / mean outside, as Megatron).
    Every TP rank must call it (three all-reduces). Raises ValueError on shape mismatch or a
    non-integer target, TypeError for non-floating logits.
    """
    if not vocab_parallel_logits.is_floating_point():
        raise TypeError(f"logits must be floating point, got {vocab_parallel_logits.dtype}")
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise ValueError(f"target must hold integer token ids, got {target.dtype}")
    if vocab_parallel_logits.shape[:-1] != target.shape:
        raise ValueError(
            f"logits shape {tuple(vocab_parallel_logits.shape)} does not match target shape "
            f"{tuple(target.shape)} + [vocab/tp]"
        )
    logits = vocab_parallel_logits
    if not fp16_lm_cross_entropy and logits.dtype in _HALF_DTYPES:
        logits = logits.float()
    rank, world_size = _group_rank_size(tp_group)
    return _VocabParallelCrossEntropy.apply(logits, target.long(), tp_group, rank, world_size)
