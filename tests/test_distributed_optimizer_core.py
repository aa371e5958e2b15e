"""DistributedOptimizer is a MixedPrecisionOptimizer that inherits the one optimizer core (no
method copied from another class), its DP collectives (tpamp.dp_collectives) sum and gather
like a reference, and its names and byte counts come from the shared implementations."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_workers

import tpamp
from tpamp import dp_collectives
from tpamp.distributed_optimizer import DistributedOptimizer
from tpamp.optimizer import FP32Optimizer, MixedPrecisionOptimizer

SHAPES = {"w": (5, 3), "b": (7,)}


def _params(dtype=torch.float16):
    g = torch.Generator().manual_seed(0)
    return {k: torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for k, s in SHAPES.items()}


def _do(params, **kw):
    return DistributedOptimizer(
        torch.optim.Adam(list(params.values()), lr=0.1),
        grad_scaler=tpamp.DynamicGradScaler(initial_scale=8.0),
        data_parallel_group=dist.group.WORLD, **kw)


def _functions_in_class_dict(cls):
    """The plain functions stored in cls.__dict__ (methods, static and class methods,
    property accessors), unwrapped from their decorators."""
    out = []
    for name, value in vars(cls).items():
        candidates = [value]
        if isinstance(value, (staticmethod, classmethod)):
            candidates = [value.__func__]
        elif isinstance(value, property):
            candidates = [value.fget, value.fset, value.fdel]
        for f in candidates:
            if f is not None and inspect.isfunction(f):
                out.append((name, inspect.unwrap(f)))
    return out


def test_distributed_optimizer_copies_no_method_of_another_class():
    functions = _functions_in_class_dict(DistributedOptimizer)
    assert functions  # the check looks at something
    for name, f in functions:
        assert f.__module__ == "tpamp.distributed_optimizer", (name, f.__module__)
        assert f.__qualname__.startswith("DistributedOptimizer."), (name, f.__qualname__)


def test_every_wrapper_runs_the_one_step_of_the_core():
    assert issubclass(DistributedOptimizer, MixedPrecisionOptimizer)
    assert issubclass(FP32Optimizer, MixedPrecisionOptimizer)
    for cls in (DistributedOptimizer, FP32Optimizer):
        for name in ("step", "get_loss_scale", "scale_loss", "backward", "optimizer_state_bytes"):
            assert getattr(cls, name) is getattr(MixedPrecisionOptimizer, name), (cls, name)
        assert "step" not in vars(cls)


def _core_facts(rank, world):
    params = _params()
    opt = _do(params, param_names=[("w", params["w"])])
    loss = sum((p.float() * (rank + 1)).sum() for p in params.values())
    opt.scale_loss(loss).backward()
    result = opt.step()
    # by hand: this rank's main shard (fp32) + Adam's exp_avg and exp_avg_sq (fp32) of each
    # piece + its 0-dim float32 step count
    n = sum(torch.Size(s).numel() for s in SHAPES.values())
    shard = -(-n // world)
    pieces = sum(len(g["params"]) for g in opt.optimizer.param_groups)
    expected_bytes = 4 * shard + 2 * 4 * sum(
        p.numel() for g in opt.optimizer.param_groups for p in g["params"]) + 4 * pieces
    try:
        _do(_params(), param_names=5)
        bad_names = None
    except TypeError as e:
        bad_names = str(e)
    return {
        "isinstance": isinstance(opt, MixedPrecisionOptimizer),
        "updated": bool(result.update_successful),
        "bytes": (opt.optimizer_state_bytes(), opt.fp32_state_bytes(), expected_bytes),
        "names": [n for n, _ in opt.named_model_params()],
        "by_group": [[tuple(p.shape) for p in g] for g in opt.main_params_by_group()],
        "inner": [[tuple(p.shape) for p in g["params"]] for g in opt.optimizer.param_groups],
        "bad_names": bad_names,
    }


@pytest.mark.parametrize("world", [1, 2])
def test_a_distributed_optimizer_is_a_mixed_precision_optimizer_with_shared_names_and_bytes(world):
    for r in run_workers(_core_facts, world):
        assert r["isinstance"] and r["updated"]
        state_bytes, old_name_bytes, expected = r["bytes"]
        assert state_bytes == old_name_bytes == expected
        # names from tpamp.nonfinite.param_name_map: given ones, the default for the others
        assert r["names"] == ["w", "param_groups.0.1"]
        assert r["by_group"] == r["inner"]
        # the shared param_names check (TypeError naming what was expected)
        assert r["bad_names"] is not None and "param_names must be" in r["bad_names"]


def _ring(rank, world, n_per_rank):
    n = n_per_rank * world
    # rank r's input: r * 1000 + [0, n): the SUM over ranks has a closed form
    data = torch.arange(n, dtype=torch.float32) + 1000.0 * rank
    out = torch.empty(n_per_rank)
    scratch = torch.empty(n_per_rank) if world > 2 else None
    group = dist.group.WORLD
    ring = dp_collectives.uses_ring(group, torch.device("cpu"))
    dp_collectives.start_reduce_scatter(group, data, out, 0, ring=ring, scratch=scratch).wait()
    reduced = out.clone()
    # all-gather: rank r contributes -(r + 1) x ones in its chunk of an in-place buffer
    buf = torch.zeros(n)
    mine = buf[rank * n_per_rank:(rank + 1) * n_per_rank]
    mine.fill_(-(rank + 1.0))
    dp_collectives.start_all_gather(group, buf, mine, 1, ring=ring).wait()
    # the same through torch.distributed's own collectives (ring=False)
    out2 = torch.empty(n_per_rank)
    dp_collectives.start_reduce_scatter(group, data, out2, 2, ring=False).wait()
    return ring, data, reduced, buf, out2


@pytest.mark.parametrize("world", [1, 2, 3])
def test_dp_collectives_reduce_scatter_and_all_gather_match_the_closed_form(world):
    n_per_rank = 5
    results = run_workers(_ring, world, n_per_rank)
    n = n_per_rank * world
    total = world * torch.arange(n, dtype=torch.float32) + 1000.0 * sum(range(world))
    gathered = torch.cat([torch.full((n_per_rank,), -(r + 1.0)) for r in range(world)])
    for rank, (ring, data, reduced, buf, out2) in enumerate(results):
        assert ring == (world > 1)  # gloo on CPU with more than one rank
        chunk = total[rank * n_per_rank:(rank + 1) * n_per_rank]
        assert torch.equal(reduced, chunk)
        assert torch.equal(out2, chunk)
        assert torch.equal(buf, gathered)
        # the reduce-scatter leaves its input unchanged
        assert torch.equal(data, torch.arange(n, dtype=torch.float32) + 1000.0 * rank)
