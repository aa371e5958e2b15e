"""Small helpers shared by tpamp's modules (a leaf: imports torch only, no other tpamp module).

The named home of what the optimizer wrappers, the grad statistics and the validation code all
need: a DTensor's local data, where a rank's empty contribution to a collective lives, a
DTensor grad placed like its param, and the inner optimizers the one-pass step implements.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without DTensor
    DTensor = None

__all__ = ["local_tensor", "is_dtensor", "placed_like", "collective_device", "FUSED_KINDS"]

Tensor = torch.Tensor


def local_tensor(t: Tensor) -> Tensor:
    """The rank-local data of ``t``: ``t.to_local()`` for a DTensor, ``t`` otherwise."""
    if DTensor is not None and isinstance(t, DTensor):
        return t._local_tensor
    return t


def is_dtensor(t) -> bool:
    """True for a ``torch.distributed.tensor.DTensor``."""
    return DTensor is not None and isinstance(t, DTensor)


def placed_like(grad: Tensor, param: Tensor) -> Tensor:
    """A DTensor grad with the param's placements. Some DTensor backwards (e.g. embedding on a
    Shard(0) weight) return Replicate or Partial grads; Replicate -> Shard is a local slice,
    Partial -> Shard a reduce-scatter that every rank of the mesh runs alike."""
    if is_dtensor(grad) and is_dtensor(param) and tuple(grad.placements) != tuple(param.placements):
        return grad.redistribute(param.device_mesh, param.placements)
    return grad


def collective_device(group=None) -> torch.device:
    """Device for a rank's contribution when it holds no tensors: CUDA for NCCL, else CPU."""
    if group is not None or dist.is_initialized():
        backend = dist.get_backend(group)
        if backend == "nccl" and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# The inner optimizers the one-pass step implements (exact types: a subclass may change step()).
FUSED_KINDS = {torch.optim.Adam: "adam", torch.optim.AdamW: "adam", torch.optim.SGD: "sgd"}
