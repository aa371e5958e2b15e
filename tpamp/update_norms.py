"""Per-parameter update norms: ||master_new - master_old|| and ||master_new|| of each param.

The update of a param on a step is the change of its fp32 main param (its master: the fp32
copy of an fp16/bf16 param, rebuilt from param + remainder with ``store_param_remainders``;
the bf16 value itself with stochastic rounding; an fp32 param itself; a DistributedOptimizer's
shard piece), taken in float32 as the optimizer holds it. docs/spec.md section 5.

Only on the steps that ask for them (``step(param_update_norms=True)``, e.g. the logging steps
of ``--log-param-grad-norms N``): the step copies the masters it is about to change before the
update (one copy), and afterwards takes the per-tensor norms of (old - new) and of new with the
project's grad-stats pass (``tpamp.ops.grad_stats(per_tensor_norms=True)``, fp64 block sums,
independent of the thread count). Every other step does nothing here: no copy, no pass, no
collective. The per-tensor norms are combined into the whole model's per-param norms by
:meth:`tpamp.param_norms.ParamGradNormTracker.reduce_update_norms` (the same names, filter and
reduction as the per-parameter grad norms: TP shards and DistributedOptimizer pieces summed as
squares over the grad-stats group, TP duplicates once, ``shared`` tied copies not at all) with
one all-reduce of a float64 vector of 2 entries per named param.

Megatron-LM has no per-parameter update norms upstream; ||update|| / ||param|| is the
"update-to-weight ratio" of the training-dynamics literature (here with the param after the
step).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from tpamp import ops

__all__ = ["snapshot_masters", "update_and_param_norms"]

Tensor = torch.Tensor


def snapshot_masters(masters: Sequence[Tensor]) -> List[Tensor]:
    """float32 copies of ``masters`` (the values before the update), one per tensor."""
    return [m.detach().to(torch.float32, copy=True) for m in masters]


def update_and_param_norms(before: List[Tensor], after: Sequence[Tensor],
                           device: Optional[torch.device]) -> Tuple[Tensor, Tensor]:
    """(||before[i] - after[i]||, ||after[i]||) per tensor, two float32 [n] tensors on the
    masters' device (``device`` when there are none). ``before`` is overwritten with the
    differences (it is this step's snapshot, not needed afterwards)."""
    n = len(before)
    if len(after) != n:
        raise ValueError(f"{n} snapshots for {len(after)} masters")
    if n == 0:
        empty = torch.zeros(0, dtype=torch.float32, device=device)
        return empty, empty.clone()
    after = [a.detach() if a.dtype == torch.float32 else a.detach().float() for a in after]
    for b, a in zip(before, after):  # old - new, in float32 (exact while |u| << |p|)
        b.sub_(a)
    stats = ops.grad_stats(before + after, norm_type=2.0, per_tensor_norms=True,
                           check_finite=False, device=device)
    norms = stats.per_tensor_norms
    return norms[:n], norms[n:]
