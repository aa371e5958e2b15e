"""``DistributedOptimizer(deterministic_grad_reduction=True)`` (docs/spec.md section 23): every
element of the reduce-scattered grad is the float32 sum of the DP ranks' values in rank order,
``((g_0 + g_1) + g_2) + g_3``, whatever the ring position, bucket boundaries or overlap.

The reference is that sum computed here, in one process, from the grads each rank used (SGD with
lr 1 on zero params: the param after one step is ``-(sum * 1/4)``, exact since 1/4 is a power of
two). The default ring reduction is checked to differ from it (the ring adds chunk r starting
at rank r + 1), so the test can fail."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from dist_utils import run_workers

import tpamp

SHAPES = {"w": (37, 29), "b": (53,), "v": (4, 251)}
WORLD = 4


def _grads(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return {n: torch.randn(s, generator=g) * (1 + 10 * rank) for n, s in SHAPES.items()}


def _step(rank, world, kwargs):
    params = {n: torch.nn.Parameter(torch.zeros(s)) for n, s in SHAPES.items()}
    opt = tpamp.DistributedOptimizer(
        torch.optim.SGD(list(params.values()), lr=1.0), data_parallel_group=dist.group.WORLD,
        param_names=params.items(), **kwargs)
    # a real backward (the overlap hooks start buckets from it): d/dp sum(p * g) = g exactly
    sum((params[n] * g).sum() for n, g in _grads(rank).items()).backward()
    result = opt.step()
    assert result.update_successful
    return {n: p.detach().numpy().copy() for n, p in params.items()}


def _reference():
    grads = [_grads(r) for r in range(WORLD)]
    out = {}
    for n in SHAPES:
        s = grads[0][n].clone()
        for r in range(1, WORLD):
            s = s + grads[r][n]  # float32, rank order
        out[n] = (-(s * 0.25)).numpy()
    return out


def _same_bits(a, b):
    return np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(bucket_size=300),
    dict(bucket_size=300, overlap_grad_reduce=True),
], ids=["one-bucket", "buckets", "overlapped-buckets"])
def test_the_reduction_is_the_rank_ordered_sum(kwargs):
    ref = _reference()
    ordered = run_workers(_step, WORLD, dict(kwargs, deterministic_grad_reduction=True), timeout=60)
    for rank, params in enumerate(ordered):
        for n in SHAPES:
            assert _same_bits(params[n], ref[n]), (rank, n)
    ring = run_workers(_step, WORLD, dict(kwargs), timeout=60)[0]
    assert not all(_same_bits(ring[n], ref[n]) for n in SHAPES)  # the default path is not it


def test_two_ranks_change_nothing():
    """With 2 ranks a SUM of two has one result: the option takes the default path."""
    ordered = run_workers(_step, 2, dict(deterministic_grad_reduction=True), timeout=60)
    default = run_workers(_step, 2, dict(), timeout=60)
    for n in SHAPES:
        assert _same_bits(ordered[0][n], default[0][n]) and _same_bits(ordered[1][n], default[1][n])


def test_a_non_bool_is_refused():
    with pytest.raises(TypeError, match="deterministic_grad_reduction"):
        tpamp.DistributedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=1.0),
                                   data_parallel_group=object(), deterministic_grad_reduction=1)
