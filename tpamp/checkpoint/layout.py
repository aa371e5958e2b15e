"""Global views: each tensor as torch.distributed.checkpoint should see it, in its param's global
shape and sharing its storage (a DTensor as it is, a Megatron TP shard as a DTensor
``Shard(partition_dim)``, a data-parallel flat range as a ShardedTensor of row-major boxes), and
new buffers sharded exactly like such a view.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = [
    "is_dtensor", "local_part", "global_view", "view_global_shape", "empty_like",
    "local_parts", "flat_range_chunks", "sharded_tensor_from_chunks",
]

Tensor = torch.Tensor


def _dtensor_cls():
    from torch.distributed.tensor import DTensor

    return DTensor


def is_dtensor(t) -> bool:
    """True for a ``torch.distributed.tensor.DTensor``."""
    return isinstance(t, _dtensor_cls())


def _is_sharded_tensor(t) -> bool:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return isinstance(t, ShardedTensor)


def local_part(t: Tensor) -> Tensor:
    """The rank-local tensor of a DTensor (``to_local()``), ``t`` itself otherwise."""
    return t.to_local() if is_dtensor(t) else t


_MESHES: Dict[Tuple[int, str], Any] = {}


def _tp_mesh(group, device_type: str):
    """A 1-D DeviceMesh over ``group`` (no communication), cached per group."""
    from torch.distributed.device_mesh import DeviceMesh

    key = (id(group), device_type)
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh.from_group(group, device_type)
    return _MESHES[key]


def global_view(t: Tensor, tensor_parallel_group=None, *, name: str = "tensor"):
    """``t`` as DCP should see it: in the param's global shape, sharing ``t``'s storage.

    - a DTensor (or ShardedTensor) is returned as it is;
    - a Megatron-LM tensor-parallel param (attribute ``tensor_model_parallel=True``, with
      ``partition_dim`` and ``partition_stride`` 1) becomes a DTensor ``Shard(partition_dim)``
      over a 1-D mesh of ``tensor_parallel_group`` (even shards, TP rank order: Megatron's
      layout), global shape = local shape with ``partition_dim`` times the TP size;
    - an expert param stacked over its local experts (``tpamp.mark_expert_param(p,
      expert_dim=d, expert_mesh=...)``, docs/spec.md section 19) becomes a DTensor on its
      expert mesh: ``Shard(d)`` over EP (this EP rank's experts at their global index) and,
      over expert-TP, ``Shard(partition_dim)`` for a Megatron TP param, else ``Replicate()``;
      so a checkpoint saved at one EP size loads at another;
    - any other tensor is returned detached: replicated, every holder writes the same key.

    Raises ValueError (naming ``name``) for a Megatron TP param without a
    ``tensor_parallel_group`` or with ``partition_stride`` != 1 (strided shards are not a box).
    """
    if is_dtensor(t) or _is_sharded_tensor(t):
        return t.detach() if is_dtensor(t) else t
    if not isinstance(t, Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
    # the Megatron attributes live on the Python object: read them before detaching
    is_tp = getattr(t, "tensor_model_parallel", False)
    stride = getattr(t, "partition_stride", 1)
    dim = getattr(t, "partition_dim", None)
    expert_dim = getattr(t, "expert_dim", None)
    expert_mesh = getattr(t, "expert_mesh", None)
    if expert_dim is not None and not getattr(t, "allreduce", True):  # is_expert_param
        return _expert_view(t.detach(), expert_dim, expert_mesh, is_tp, dim, stride, name)
    t = t.detach()
    if not is_tp:
        return t
    if stride != 1:
        raise ValueError(
            f"{name}: Megatron TP param with partition_stride={stride}; only 1 (one contiguous "
            "shard per TP rank) can be saved by global name"
        )
    if not isinstance(dim, int) or not 0 <= dim < t.dim():
        raise ValueError(
            f"{name}: Megatron TP param with partition_dim={dim!r} for shape {tuple(t.shape)}"
        )
    if tensor_parallel_group is None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError(
                f"{name} is a Megatron TP shard (tensor_model_parallel=True): pass "
                "tensor_parallel_group (or an optimizer that has one) so it is saved in its "
                "global shape"
            )
        return t  # one process: the shard is the whole tensor
    from torch.distributed.tensor import DTensor, Shard

    mesh = _tp_mesh(tensor_parallel_group, t.device.type)
    return DTensor.from_local(t, mesh, [Shard(dim)], run_check=False)


def _expert_view(t, expert_dim, mesh, is_tp, dim, stride, name):
    """An expert param stacked over its local experts as a DTensor on its (ep[, etp]) mesh."""
    if mesh is None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError(
                f"{name} is an expert param stacked over experts (expert_dim={expert_dim}): pass "
                "tpamp.mark_expert_param(p, expert_dim=..., expert_mesh=state.expert_mesh) so "
                "it is saved in its global shape"
            )
        return t  # one process: the local experts are all the experts
    from torch.distributed.tensor import DTensor, Replicate, Shard

    placements = [Shard(expert_dim)]
    if mesh.ndim == 2:
        if is_tp and stride != 1:
            raise ValueError(f"{name}: expert-TP param with partition_stride={stride}; only 1")
        placements.append(Shard(dim) if is_tp else Replicate())
    elif is_tp:
        raise ValueError(f"{name}: expert-TP param on an expert mesh without an 'etp' dim")
    return DTensor.from_local(t, mesh, placements, run_check=False)


def view_global_shape(view) -> Tuple[int, ...]:
    """The global shape of a view (Tensor, DTensor or ShardedTensor)."""
    return tuple(view.size()) if _is_sharded_tensor(view) else tuple(view.shape)


def empty_like(view, dtype: Optional[torch.dtype] = None):
    """New storage sharded exactly like ``view`` (Tensor, DTensor or ShardedTensor)."""
    if _is_sharded_tensor(view):
        from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

        md = copy.deepcopy(view.metadata())
        if dtype is not None:
            md.tensor_properties.dtype = dtype
        shards = [
            Shard(torch.empty_like(s.tensor, dtype=dtype), copy.deepcopy(s.metadata))
            for s in view.local_shards()
        ]
        # no communication: the global metadata is this rank's copy of view's
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, md, process_group=getattr(view, "_process_group", None)
        )
    return torch.empty_like(view.detach(), dtype=dtype)


def local_parts(view) -> List[Tensor]:
    """The tensors this rank holds of ``view``."""
    if _is_sharded_tensor(view):
        return [s.tensor for s in view.local_shards()]
    return [local_part(view)]


def flat_range_chunks(shape: Sequence[int], start: int, end: int) -> List[Tuple[tuple, tuple, int]]:
    """Cut the flat range [start, end) of a row-major tensor of ``shape`` into boxes.

    Returns [(offsets, sizes, flat_offset)]: each box is ``sizes`` elements at ``offsets`` of
    the tensor, and is contiguous in memory from ``flat_offset`` (so
    ``flat[flat_offset:flat_offset + prod(sizes)].view(sizes)`` is it). At most 2 * ndim - 1
    boxes, in memory order. A data-parallel optimizer's contiguous range of a flattened param
    (Megatron-LM's DistributedOptimizer) saves as these boxes, see
    :func:`sharded_tensor_from_chunks`. Raises ValueError unless 0 <= start <= end <= numel.
    """
    shape = tuple(int(s) for s in shape)
    numel = math.prod(shape)
    if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= numel):
        raise ValueError(
            f"flat range [{start}, {end}) is not inside a tensor of {numel} elements {shape}"
        )
    return _boxes(shape, start, end)


def _boxes(shape, start, end):
    if start >= end:
        return []
    if not shape:
        return [((), (), 0)]
    inner = math.prod(shape[1:])
    first, last = start // inner, (end - 1) // inner
    s_in, e_in = start - first * inner, end - last * inner

    def row(r, a, b):
        return [((r, *o), (1, *s), r * inner + f) for o, s, f in _boxes(shape[1:], a, b)]

    if first == last and (s_in, e_in) != (0, inner):
        return row(first, s_in, e_in)
    out, tail, lo, hi = [], [], first, last + 1
    if s_in:
        out, lo = row(first, s_in, inner), first + 1
    if e_in != inner:
        tail, hi = row(last, 0, e_in), last
    if hi > lo:
        out.append(((lo,) + (0,) * (len(shape) - 1), (hi - lo, *shape[1:]), lo * inner))
    return out + tail


def sharded_tensor_from_chunks(
    pieces: Sequence[Tuple[Tensor, Sequence[int]]],
    global_shape: Sequence[int],
    process_group=None,
):
    """A ShardedTensor of global shape ``global_shape`` whose local shards are ``pieces``:
    (tensor, offsets) pairs, each tensor a box of the global tensor at ``offsets`` (views into
    a flat buffer keep sharing its storage). Collective: every rank of ``process_group``
    (default: the world) calls it, with its own pieces (possibly none); together they must
    cover the tensor exactly once (torch's ``init_from_local_shards`` checks, raising
    ValueError). Use :func:`flat_range_chunks` to cut a flat range into boxes.
    """
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    rank = dist.get_rank()  # placements name global ranks
    shards = [
        Shard(t, ShardMetadata(list(off), list(t.shape), f"rank:{rank}/{t.device}"))
        for t, off in pieces
    ]
    return init_from_local_shards(shards, *global_shape, process_group=process_group)
