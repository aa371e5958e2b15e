"""An unsharded toy model's gradients, and each rank's TP x PP shard of it.

The full model is a dict of float64 gradients (seeded, identical on every rank, with exact zeros
sprinkled in). ``shard_params`` hands a rank the params it owns under a TP x PP layout, with
Megatron attributes or as DTensors, their ``.grad`` set to the matching slices. The references
(norms and zero counts of the full model, each tensor once) are computed here in float64,
independently of tpamp.
"""

from __future__ import annotations

import math

import torch

# name -> (shape, stage ("first" | "last"), kind): kind "col" shards dim 0 across TP, "row"
# shards dim 1, "rep" is replicated on every TP rank.
FULL_MODEL = {
    "embed": ((12, 8), "first", "rep"),  # tied with the output head on the last stage
    "ln0.weight": ((8,), "first", "rep"),
    "fc1.weight": ((16, 8), "first", "col"),
    "fc1.bias": ((16,), "first", "col"),
    "fc2.weight": ((8, 16), "first", "row"),
    "fc2.bias": ((8,), "first", "rep"),
    "fc3.weight": ((16, 8), "last", "col"),
    "fc4.weight": ((8, 16), "last", "row"),
    "ln_f.weight": ((8,), "last", "rep"),
}


def full_grads(seed: int = 0, zero_fraction: float = 0.2, quantum: float = 2.0**-8):
    """float64 gradients of the full model; every value is a multiple of ``quantum`` with at
    most 10 significant bits, so it is exact in fp16, bf16 (after 3 more bits are dropped, see
    ``round_to``) and fp32, and a power-of-two loss scale is exact too."""
    g = torch.Generator().manual_seed(seed)
    grads = {}
    for name, (shape, _, _) in FULL_MODEL.items():
        t = torch.randn(shape, generator=g, dtype=torch.float64)
        t = torch.round(t * 64) / 64 * (quantum * 256)
        t[torch.rand(shape, generator=g) < zero_fraction] = 0.0
        grads[name] = t
    return grads


def round_to(grads: dict, dtype: torch.dtype) -> dict:
    return {k: v.to(dtype).double() for k, v in grads.items()}


def reference_stats(grads: dict):
    """(L2 norm, inf norm, 3-norm, zero count) of the full model in float64, each tensor once."""
    flat = torch.cat([t.flatten() for t in grads.values()])
    return (
        float(flat.norm(2)),
        float(flat.abs().max()),
        float(flat.abs().pow(3).sum() ** (1.0 / 3.0)),
        int((flat == 0).sum()),
    )


def stage_of(where: str, pp: int) -> int:
    return 0 if where == "first" else pp - 1


def local_slice(full: torch.Tensor, kind: str, tp: int, tp_rank: int) -> torch.Tensor:
    if kind == "col":
        return full.chunk(tp, dim=0)[tp_rank].clone()
    if kind == "row":
        return full.chunk(tp, dim=1)[tp_rank].clone()
    return full.clone()


def shard_params(state, grads: dict, *, style: str, dtype=torch.float32, grad_scale: float = 1.0,
                 values: dict | None = None):
    """The params this rank owns, as a dict name -> param (with ``.grad`` set).

    style "megatron": plain tensors; TP shards carry tensor_model_parallel=True, partition_dim.
    style "dtensor": DTensors on the TP mesh with Shard(dim) / Replicate() placements.
    With pp > 1 the last stage also holds "head" (a copy of "embed", shared=True).
    grads are multiplied by grad_scale (a loss scale) and cast to ``dtype``; params hold
    ``values`` (default: a seeded random tensor of the same shape) in ``dtype``.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    tp, pp = state.dims.tp, state.dims.pp
    names = []
    for name, (shape, where, kind) in FULL_MODEL.items():
        if stage_of(where, pp) == state.pp_rank:
            names.append((name, name, kind))
    if pp > 1 and state.pp_rank == pp - 1:
        names.append(("head", "embed", "rep"))
    params = {}
    for own_name, src, kind in names:
        full_value = values[src] if values is not None else torch.randn(
            grads[src].shape, generator=torch.Generator().manual_seed(len(src)), dtype=torch.float64
        )
        val = local_slice(full_value, kind, tp, state.tp_rank).to(dtype)
        grad = (local_slice(grads[src], kind, tp, state.tp_rank) * grad_scale).to(dtype)
        if style == "megatron":
            p = torch.nn.Parameter(val)
            if kind != "rep":
                p.tensor_model_parallel = True
                p.partition_dim = 0 if kind == "col" else 1
                p.partition_stride = 1
            p.grad = grad
        elif style == "dtensor":
            placements = [Shard(0)] if kind == "col" else [Shard(1)] if kind == "row" else [Replicate()]
            p = torch.nn.Parameter(DTensor.from_local(val, state.tp_mesh, placements, run_check=False))
            p.grad = DTensor.from_local(grad, state.tp_mesh, placements, run_check=False)
        else:
            raise ValueError(style)
        if own_name == "head":
            p.shared = True
        params[own_name] = p
    return params


def isclose(a: float, b: float, rel: float = 1e-5) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)
