"""Grad norm, clipping and zero counting under TP x PP (Megatron-LM's clip_grads.py).

Which gradients count toward the norm and the zero count (found_inf uses all of them):

* the param has a gradient;
* it is not ``shared`` (attribute ``shared=True``: a tied copy such as the word embedding on the
  last pipeline stage, whose twin on the first stage is counted);
* it is not a tensor-parallel duplicate: a TP shard (Megatron attribute
  ``tensor_model_parallel=True``, or a DTensor with a ``Shard`` placement on the TP mesh dim)
  counts on every TP rank; anything else is replicated across TP ranks and counts on TP rank 0.

Reductions run over the grad-stats group (the model-parallel group TP x PP by default), so the
norm equals that of the full, unsharded model's gradient computed in one process.
"""

from __future__ import annotations

import math
import numbers
from typing import Iterable, List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from tpamp import ops
from tpamp._checks import (
    check_group_member,
    check_norm_type,
    check_real,
    check_tensor_list,
    tp_rank,
)
from tpamp.common import collective_device, local_tensor

try:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Shard
except ImportError:  # pragma: no cover - torch without DTensor
    DTensor = None
    Shard = None

__all__ = [
    "filter_grads_for_norm",
    "get_grad_norm_fp32",
    "clip_grad_by_total_norm_fp32",
    "count_zeros_fp32",
    "is_tensor_parallel_shard",
    "is_expert_param",
    "mark_expert_param",
    "local_tensor",
]

Tensor = torch.Tensor
# this module's own short names for the shared checks (tpamp._checks)


def _check_group(group, what: str = "grad_stats_group") -> None:
    check_group_member(group, what)


_check_norm_type = check_norm_type
_tp_rank = tp_rank
_TP_DIM_NAMES = ("tp", "tensor", "tensor_parallel", "tensor_model_parallel")


def is_tensor_parallel_shard(param: Tensor, tensor_parallel_group=None) -> bool:
    """True if ``param`` is one TP rank's shard (each rank holds different data).

    Megatron attribute ``tensor_model_parallel=True``, or a DTensor with a Shard placement on
    its TP mesh dim: a dim named "tp" (or "tensor"...), the dim whose group is
    ``tensor_parallel_group``, or the only dim of a 1-D mesh -- unless that 1-D mesh is known to
    be another one: its ranks differ from ``tensor_parallel_group``'s, or (without that group)
    it is named as a data-parallel dim ("dp", "dp_shard", "fsdp"...). So a param that
    ``torch.distributed.fsdp.fully_shard`` shards over the DP mesh only (e.g. a LayerNorm weight
    under TP x FSDP) is not a TP shard: it is replicated over TP (tpamp/fsdp.py).
    """
    if getattr(param, "tensor_model_parallel", False):
        return True
    if DTensor is None or not isinstance(param, DTensor):
        return False
    mesh = param.device_mesh
    names = mesh.mesh_dim_names or ()
    for dim, placement in enumerate(param.placements):
        if not placement.is_shard():
            continue
        if mesh.ndim == 1:
            return _one_dim_mesh_is_tp(mesh, tensor_parallel_group)
        if dim < len(names) and names[dim] in _TP_DIM_NAMES:
            return True
        if tensor_parallel_group is not None and mesh.get_group(dim) == tensor_parallel_group:
            return True
    return False


_EP_DIM_NAMES = ("ep", "expert", "expert_parallel", "expert_model_parallel")


def is_expert_param(param: Tensor) -> bool:
    """True if ``param`` is a mixture-of-experts expert param (docs/spec.md section 19).

    As Megatron-core recognizes them, exactly: ``not getattr(param, "allreduce", True)`` (the
    attribute ``allreduce=False``, set by :func:`mark_expert_param` and by Megatron's expert
    layers; any false value such as 0 or None counts, as in Megatron-core's DDP and
    optimizer, and a param without the attribute is dense); or a DTensor
    whose mesh has an expert-parallel dim (named "ep", as on ``ParallelState.expert_mesh``, or
    "expert"...), as torchtitan recognises them. Expert params are sharded over the
    expert-parallel group and replicated over the expert-data-parallel group, so their grad
    statistics are reduced over the expert model-parallel group (expert-TP x EP x PP), not the
    dense model-parallel group.
    """
    if not getattr(param, "allreduce", True):  # megatron/core: not getattr(p, "allreduce", True)
        return True
    if DTensor is not None and isinstance(param, DTensor):
        names = param.device_mesh.mesh_dim_names or ()
        return any(n in _EP_DIM_NAMES for n in names)
    return False


def mark_expert_param(param: Tensor, *, expert_dim: Optional[int] = None,
                      expert_mesh=None) -> Tensor:
    """Declare ``param`` an expert param (sets Megatron's ``allreduce=False``); returns it.

    expert_dim: for experts stacked in one tensor (e.g. shape ``(num_local_experts, d, h)``),
    the dim that indexes this rank's local experts: this EP rank holds global experts
    ``ep_rank * n .. ep_rank * n + n - 1`` (n = the size of that dim, the same on every EP
    rank), so a checkpoint saves it in its global shape (that dim times the EP size) and
    reloads it on another EP size (tpamp.checkpoint). None (default): the param belongs to one
    expert and its name must already be global (e.g. ``experts.{global_index}.w1``), or it is
    a DTensor that carries its own sharding. A Megatron TP attribute (``tensor_model_parallel``,
    ``partition_dim``) then means expert-TP sharding.

    expert_mesh: the expert layout's DeviceMesh (``ParallelState.expert_mesh``, or any mesh
    with an "ep" dim and optionally an "etp" dim), needed with ``expert_dim`` under more than
    one process so a checkpoint can place the param: it is kept (as ``param.expert_mesh``, the
    sub-mesh of its "ep" and "etp" dims) and a checkpoint sees the param as a DTensor
    ``[Shard(expert_dim), Shard(partition_dim) or Replicate()]`` on it.

    Raises TypeError for a param that is not a tensor, an expert_dim that is not an int or an
    expert_mesh that is not a DeviceMesh, ValueError for an expert_dim outside
    ``[0, param.dim())`` or a mesh without an "ep" dim.
    """
    if not isinstance(param, Tensor):
        raise TypeError(f"param must be a torch.Tensor, got {type(param).__name__}")
    if expert_dim is not None:
        if isinstance(expert_dim, bool) or not isinstance(expert_dim, int):
            raise TypeError(
                f"expert_dim must be an int or None, got {expert_dim!r} ({type(expert_dim).__name__})"
            )
        if not 0 <= expert_dim < param.dim():
            raise ValueError(
                f"expert_dim {expert_dim} is outside [0, {param.dim()}) for a param of shape "
                f"{tuple(param.shape)}"
            )
    sub = None
    if expert_mesh is not None:
        from torch.distributed.device_mesh import DeviceMesh

        if not isinstance(expert_mesh, DeviceMesh):
            raise TypeError(
                f"expert_mesh must be a DeviceMesh (ParallelState.expert_mesh), got "
                f"{type(expert_mesh).__name__}"
            )
        names = tuple(expert_mesh.mesh_dim_names or ())
        if "ep" not in names:
            raise ValueError(f"expert_mesh must have an 'ep' dim, got dims {names}")
        keep = tuple(n for n in ("ep", "etp") if n in names)
        sub = expert_mesh if names == keep else expert_mesh[keep if len(keep) > 1 else keep[0]]
    param.allreduce = False
    param.expert_dim = expert_dim
    if sub is not None:
        param.expert_mesh = sub
    return param


def _grad_of(param: Tensor) -> Optional[Tensor]:
    grad = param.grad
    if grad is None:
        grad = getattr(param, "main_grad", None)
    return grad


def counts_toward_norm(param: Tensor, tp_rank: int, tensor_parallel_group=None) -> bool:
    """The filter of this module for one param (ignoring whether it has a grad)."""
    if getattr(param, "shared", False):
        return False
    return tp_rank == 0 or is_tensor_parallel_shard(param, tensor_parallel_group)


def _as_list(params, name: str = "params") -> list:
    """A tensor or an iterable of tensors as a list; TypeError naming ``name`` otherwise."""
    return check_tensor_list(name, params)


def filter_grads_for_norm(params: Iterable[Tensor], tensor_parallel_group=None) -> List[Tensor]:
    """Gradients of ``params`` that count toward the norm (module docstring), as local tensors.

    params: tensors whose ``.grad`` (or, if None, ``.main_grad``) is read; DTensor params give
    their local shard. tensor_parallel_group: the TP group, used for the TP rank (None: rank 0,
    i.e. every replicated param counts). Raises ValueError if this rank is not in the group.
    """
    tp_rank = _tp_rank(tensor_parallel_group)
    grads = []
    for p in _as_list(params):
        g = _grad_of(p)
        if g is None:
            continue
        if counts_toward_norm(p, tp_rank, tensor_parallel_group):
            grads.append(local_tensor(g))
    return grads


def get_grad_norm_fp32(
    grads_for_norm: Union[Tensor, Sequence[Tensor]],
    norm_type: float = 2.0,
    grad_stats_group=None,
) -> Tensor:
    """Global p-norm of already-filtered gradients, reduced over ``grad_stats_group``.

    grads_for_norm: tensors of float32/float16/bfloat16 (e.g. from :func:`filter_grads_for_norm`),
    any shapes, possibly none on this rank (it contributes 0 and still joins the collective).
    norm_type: p >= 1 or ``math.inf``. Finite p: (SUM over ranks of sum |g|^p)^(1/p); inf: MAX
    over ranks of max |g|. Accumulates in float32 or wider.

    Returns a 0-dim float32 tensor on the grads' device (for an empty list, the collective's
    device); nothing is read on the host. Raises ValueError for a bad norm_type or a group this
    rank is not in.

    Collective: every rank of ``grad_stats_group`` must call it (None: no communication).
    """
    norm_type = _check_norm_type(norm_type)
    _check_group(grad_stats_group)
    grads = [local_tensor(g) for g in _as_list(grads_for_norm, "grads_for_norm")]
    device = grads[0].device if grads else collective_device(grad_stats_group)
    stats = ops.grad_stats(grads, norm_type=norm_type, check_finite=False, device=device)
    total = stats.norm_stat.reshape(())
    if grad_stats_group is not None:
        op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
        dist.all_reduce(total, op=op, group=grad_stats_group)
    if norm_type != math.inf:
        total = total.double().pow(1.0 / norm_type).float()
    return total


def clip_coefficient(max_norm: float, total_norm: Tensor) -> Tensor:
    """min(1, max_norm / (total_norm + 1e-6)) as float32 [1]; 1 when total_norm is not finite,
    so a non-finite norm never turns gradients into nan. On total_norm's device, no sync.
    Computed in float64 and rounded once to float32, as Megatron-LM computes it (a Python
    float from the float64 root of the norm statistic)."""
    total = total_norm.reshape(1).double()
    coeff = max_norm / (total + 1.0e-6)
    ok = torch.isfinite(total) & (coeff < 1.0)
    return torch.where(ok, coeff, torch.ones_like(coeff)).float()


def clip_grad_by_total_norm_fp32(
    params: Union[Tensor, Iterable[Tensor]],
    max_norm: float,
    total_norm: Union[float, Tensor],
) -> None:
    """Multiply every gradient of ``params`` (filtered or not) by max_norm / (total_norm + 1e-6)
    when that is < 1 (Megatron-LM's clip_grad_by_total_norm_fp32), in place.

    max_norm: > 0, in gradient units. total_norm: a float or a 0-dim tensor (kept on the device:
    the comparison happens there). A non-finite total_norm leaves the gradients unchanged.
    """
    check_real("max_norm", max_norm, low=0.0, low_inclusive=False, allow_inf=True)
    if isinstance(total_norm, bool) or not isinstance(total_norm, (numbers.Real, Tensor)):
        raise TypeError(
            f"total_norm must be a float or a 0-dim tensor, got {total_norm!r} "
            f"({type(total_norm).__name__})"
        )
    if isinstance(total_norm, Tensor) and total_norm.numel() != 1:
        raise ValueError(f"total_norm must have one element, got shape {tuple(total_norm.shape)}")
    grads = []
    for p in _as_list(params):
        g = _grad_of(p)
        if g is not None:
            grads.append(local_tensor(g))
    if not grads:
        return
    if isinstance(total_norm, Tensor):
        coeff = clip_coefficient(float(max_norm), total_norm.to(grads[0].device))
    else:
        total = float(total_norm)
        c = max_norm / (total + 1.0e-6)
        if not (math.isfinite(total) and c < 1.0):
            return
        coeff = torch.tensor([c], dtype=torch.float32, device=grads[0].device)
    ops.scale_and_copy(grads, grads, coeff)


def count_zeros_fp32(
    params: Union[Tensor, Iterable[Tensor]],
    grad_stats_group=None,
    tensor_parallel_group=None,
) -> Tensor:
    """Number of zero elements in the filtered gradients of ``params``, summed over
    ``grad_stats_group`` (Megatron-LM's count_zeros_fp32). Exact: a 0-dim int64 tensor on the
    grads' device (the collective's device when this rank has none); no host sync.
    Raises ValueError for a group this rank is not in. Collective: every rank of
    ``grad_stats_group`` must call it (None: no communication)."""
    _check_group(grad_stats_group)
    grads = filter_grads_for_norm(params, tensor_parallel_group)
    device = grads[0].device if grads else collective_device(grad_stats_group)
    stats = ops.grad_stats(grads, count_zeros=True, check_finite=False, device=device)
    zeros = stats.num_zeros
    if grad_stats_group is not None:
        dist.all_reduce(zeros, op=dist.ReduceOp.SUM, group=grad_stats_group)
    return zeros


_DP_DIM_NAMES = ("dp", "dp_shard", "dp_replicate", "data_parallel", "fsdp", "hsdp", "dp_shard_cp")


def _one_dim_mesh_is_tp(mesh, tensor_parallel_group) -> bool:
    """Is the dim of this 1-D mesh the TP dim? (see is_tensor_parallel_shard)"""
    name = (mesh.mesh_dim_names or (None,))[0]
    if name in _TP_DIM_NAMES:
        return True
    if tensor_parallel_group is not None:
        ranks = dist.get_process_group_ranks(tensor_parallel_group)
        return sorted(mesh.mesh.flatten().tolist()) == sorted(ranks)
    return name not in _DP_DIM_NAMES
