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

For a :class:`tpamp.TensorParallelMuon` (alone or a part of a CombinedOptimizer) the same
steps also record each param's momentum norm before the orthogonalisation (its
``record_momentum_norms`` switch, on only for that step), reduced alike into the tracker's
``momentum_norms``.

Megatron-LM has no per-parameter update norms upstream; ||update|| / ||param|| is the
"update-to-weight ratio" of the training-dynamics literature (here with the param after the
step).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from tpamp import ops

__all__ = ["snapshot_masters", "update_and_param_norms", "momentum_recorders",
           "momentum_norms_of"]

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


def momentum_recorders(optimizer) -> list:
    """The optimizers among ``optimizer`` and its parts (a CombinedOptimizer's ``optimizers``)
    that can record momentum norms (an attribute ``record_momentum_norms``, e.g.
    :class:`tpamp.TensorParallelMuon`)."""
    parts = list(getattr(optimizer, "optimizers", None) or [optimizer])
    return [o for o in parts if hasattr(o, "record_momentum_norms")]


def momentum_norms_of(recorders: Sequence, mains: Sequence[Tensor],
                      device: Optional[torch.device]) -> Tuple[Tensor, List[bool]]:
    """After a step with ``record_momentum_norms`` on: (float32 [len(mains)] momentum norms,
    0 where none, [whether main i has one]) from the recorders' ``momentum_norms``."""
    found = {}
    for opt in recorders:
        for p, norm in getattr(opt, "momentum_norms", None) or ():
            found[id(p)] = norm
    has = [id(m) in found for m in mains]
    norms = [found[id(m)].reshape(()).float() for m in mains if id(m) in found]
    out = torch.zeros(len(mains), dtype=torch.float32,
                      device=norms[0].device if norms else device)
    if norms:
        index = torch.tensor([i for i, h in enumerate(has) if h], device=out.device)
        out[index] = torch.stack(norms).to(out.device)
    return out, has
