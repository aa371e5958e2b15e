"""tpamp with PyTorch's pipeline schedules (``torch.distributed.pipelining``).

A schedule (``ScheduleGPipe``, ``Schedule1F1B``, ...) calls ``loss_fn(output, target)`` on the
last stage for every microbatch and runs ``backward()`` on what it returns; tpamp's loss scaling
must therefore happen inside ``loss_fn``. Two parts make a tpamp optimizer work with a schedule:

- :class:`PipelineLoss`: wraps a per-microbatch loss function so that it returns
  ``loss / num_microbatches * loss_scale`` (the loss scale read from the optimizer at every
  call, as ``optimizer.scale_loss`` does), for a schedule built with ``scale_grads=False``.
  The schedule's own ``scale_grads=True`` divides only ``param.grad`` after the whole
  backward (not the ``main_grad`` buffers of :class:`tpamp.DistributedOptimizer`, and only after
  half-precision grads were summed over the microbatches), so the division belongs in the loss,
  before backward, as in Megatron-LM. :meth:`PipelineLoss.unscale` turns the losses the
  schedule returns back into the per-microbatch losses for logging.
- :class:`NoSyncPipelineStage`: a ``PipelineStage`` that runs every backward but the step's
  last under a ``no_sync`` context of the caller's choice (``DistributedOptimizer.no_sync``
  with ``overlap_grad_reduce=True``): PyTorch's stage knows only DDP and FSDP for that.

Stage metadata: give ``PipelineStage`` example ``input_args`` and ``output_args`` (static
metadata). Without them the stage infers shapes by running ``forward`` and ``loss_fn`` once on
uninitialised tensors during the first step, which a :class:`tpamp.NonFiniteTracer` or a
spike detector fed from ``loss_fn`` would observe. A non-first stage's example input and every
example output must have ``requires_grad=True`` (else no input grad is sent back and the
previous stage waits for it until the process group's timeout). See docs/guide/pipelining.md
(and scripts/train_gpt.py for a whole training loop).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Callable, Optional

import torch
from torch.distributed.pipelining import PipelineStage

from tpamp._checks import check_f32_scale

__all__ = ["NoSyncPipelineStage", "PipelineLoss"]


class PipelineLoss:
    """``loss_fn`` for a ``torch.distributed.pipelining`` schedule built with
    ``scale_grads=False``: ``loss_fn(output, target) / num_microbatches * loss_scale``.

    Args:
        loss_fn: ``(output, target) -> loss``, a 0-dim floating tensor: the loss of one
            microbatch (a mean over its tokens), on the last stage's device.
        num_microbatches: M, the microbatches per step (the schedule's ``n_microbatches``);
            the step minimises the mean of the M losses. An int >= 1.
        optimizer: the tpamp optimizer whose ``get_loss_scale()`` (a 1-element fp32 tensor) is
            read at every call; None: no loss scaling (scale 1).

    Returns from a call the 0-dim loss ``loss / M * scale`` in the loss's dtype promoted with
    fp32 (the scale is fp32): what the schedule runs backward on. Raises TypeError for a
    ``loss_fn`` that is not callable, a ``num_microbatches`` that is not an int, an optimizer
    without ``get_loss_scale``/``scale_loss`` (a string, a torch optimizer: wrap it first),
    ValueError for a ``num_microbatches`` < 1, and TypeError when ``loss_fn`` returns no
    floating-point tensor.
    """

    def __init__(self, loss_fn: Callable, num_microbatches: int, optimizer=None):
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int):
            raise TypeError(
                f"num_microbatches must be an int, got {type(num_microbatches).__name__} "
                f"{num_microbatches!r}"
            )
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
        if optimizer is not None and not (callable(getattr(optimizer, "get_loss_scale", None))
                                          and callable(getattr(optimizer, "scale_loss", None))):
            raise TypeError(
                "optimizer must be a tpamp optimizer (with get_loss_scale() and scale_loss(), "
                "e.g. tpamp.MixedPrecisionOptimizer; wrap a torch optimizer first) or None, got "
                + (f"{optimizer!r:.60} " if isinstance(optimizer, (str, bytes, int, float)) else "")
                + f"({type(optimizer).__name__})")
        self.loss_fn = loss_fn
        self.num_microbatches = num_microbatches
        self.optimizer = optimizer

    def loss_scale(self) -> torch.Tensor:
        """The current loss scale, a 0-dim fp32 tensor (1.0 without an optimizer)."""
        if self.optimizer is None:
            return torch.ones((), dtype=torch.float32)
        return self.optimizer.get_loss_scale().reshape(())

    def __call__(self, output, target) -> torch.Tensor:
        loss = self.loss_fn(output, target)
        if not isinstance(loss, torch.Tensor) or not loss.is_floating_point():
            raise TypeError(
                f"loss_fn must return a floating-point tensor, got {type(loss).__name__}"
                + (f" of {loss.dtype}" if isinstance(loss, torch.Tensor) else "")
            )
        loss = loss / self.num_microbatches  # the mean over microbatches, before backward
        if self.optimizer is None:
            return loss
        return self.optimizer.scale_loss(loss)

    def unscale(self, losses, loss_scale: Optional[torch.Tensor] = None) -> list:
        """The per-microbatch losses from what the schedule returned (``losses=`` of
        ``schedule.step`` / ``eval``): each ``loss * M / scale``, detached fp32 0-dim tensors.
        ``loss_scale``: the scale those losses were multiplied by (default: the current one;
        pass the scale read before ``optimizer.step()``, which may change it). Exact when the
        scale and M are powers of two, else within fp32 rounding. ``loss_scale``: a
        one-element floating-point tensor or a number (finite and > 0 in float32). Raises
        TypeError for a loss that is not a tensor or a loss_scale of another type, ValueError
        for a non-finite or non-positive number."""
        if loss_scale is None:
            scale = self.loss_scale()
        elif isinstance(loss_scale, torch.Tensor):
            if loss_scale.numel() != 1 or not loss_scale.is_floating_point():
                raise TypeError(f"loss_scale must be a number or a one-element floating-point "
                                f"tensor, got a tensor of shape {tuple(loss_scale.shape)} and "
                                f"dtype {loss_scale.dtype}")
            scale = loss_scale.reshape(())
        else:
            scale = torch.tensor(check_f32_scale("loss_scale", loss_scale), dtype=torch.float32)
        if isinstance(losses, torch.Tensor) or not isinstance(losses, Iterable):
            raise TypeError("losses must be a list of loss tensors (the schedule's losses=), got "
                            f"{type(losses).__name__}")
        losses = list(losses)
        for i, x in enumerate(losses):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"losses[{i}] must be a tensor, got {x!r:.80} ({type(x).__name__})")
        return [(x.detach().float() / scale) * self.num_microbatches for x in losses]


class NoSyncPipelineStage(PipelineStage):
    """``torch.distributed.pipelining.PipelineStage`` whose backwards, except the last of each
    step, run under ``no_sync()``: the grad reduction that a data-parallel wrapper starts from
    backward hooks (``tpamp.DistributedOptimizer(overlap_grad_reduce=True)``) starts only
    during the last microbatch's backward, as Megatron-LM does. ``PipelineStage`` itself does
    this only for DDP and FSDP modules.

    Args: those of ``PipelineStage``, and keyword-only ``no_sync``: a callable returning a
    context manager (e.g. ``optimizer.no_sync``), or None: every backward as in
    ``PipelineStage``. Raises TypeError for a ``no_sync`` that is not callable.
    """

    def __init__(self, *args, no_sync: Optional[Callable] = None, **kwargs):
        if no_sync is not None and not callable(no_sync):
            raise TypeError(f"no_sync must be callable or None, got {type(no_sync).__name__}")
        super().__init__(*args, **kwargs)
        self.no_sync = no_sync

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        ctx = (self.no_sync() if self.no_sync is not None and not last_backward
               else contextlib.nullcontext())
        with ctx:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
