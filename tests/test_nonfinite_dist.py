"""Which parameter, on which (tp, pp, dp) rank, held the inf/NaN of a skipped step: inject into one
chosen grad on one chosen rank of a TP2 x PP2 x DP2 layout (8 gloo processes) and check that
every rank's ``last_nonfinite`` names exactly that parameter, rank and counts (the expected
record is written down from the injection, not computed by tpamp), and that clean steps report
nothing. Covers MixedPrecisionOptimizer (one-pass and generic paths) and DistributedOptimizer
(the culprit named before the DP reduce-scatter mixes the DP ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_workers

import tpamp

WORLD = 8  # TP 2 x PP 2 x DP 2 (tpamp.parallel: rank = pp * 4 + dp * 2 + tp)


def _rank_of(tp, pp, dp):
    return pp * 4 + dp * 2 + tp


def _stage_params(st, dtype):
    """Every rank's params (the same seeded values on DP peers): a TP-sharded weight, its bias
    and a replicated LayerNorm weight per stage, named with the stage index (global names)."""
    g = torch.Generator().manual_seed(100 + st.pp_rank * 2 + st.tp_rank)
    w = torch.nn.Parameter(torch.randn(4, 6, generator=g).to(dtype))
    w.tensor_model_parallel, w.partition_dim, w.partition_stride = True, 0, 1
    b = torch.nn.Parameter(torch.randn(4, generator=g).to(dtype))
    b.tensor_model_parallel, b.partition_dim, b.partition_stride = True, 0, 1
    ln = torch.nn.Parameter(torch.ones(6, dtype=dtype))
    pp = st.pp_rank
    return [(f"layers.{pp}.fc.weight", w), (f"layers.{pp}.fc.bias", b), (f"layers.{pp}.ln.weight", ln)]


def _grads_like(named, seed, inject=None):
    """Finite grads for every param; ``inject`` = (name, [flat indices of inf], [of nan])."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in named:
        grad = (torch.randn(p.shape, generator=g) * 0.5).to(p.dtype)
        if inject is not None and inject[0] == name:
            flat = grad.view(-1)
            for i in inject[1]:
                flat[i] = float("inf") if i % 2 == 0 else float("-inf")
            for i in inject[2]:
                flat[i] = float("nan")
        out[name] = grad
    return out


def _mpo_worker(rank, world, fused, target, name, n_inf, n_nan):
    st = tpamp.parallel.initialize_model_parallel(2, 2)
    named = _stage_params(st, torch.float16)
    opt = tpamp.MixedPrecisionOptimizer(
        torch.optim.AdamW([p for _, p in named], lr=1e-3),
        grad_scaler=tpamp.DynamicGradScaler(initial_scale=2.0**8, hysteresis=1),
        clip_grad=1.0, grad_stats_group=dist.group.WORLD, tensor_parallel_group=st.tp_group,
        fused_step=fused, param_names=named, parallel_state=st,
    )
    reports = []
    me = (st.tp_rank, st.pp_rank, st.dp_rank)
    for step in range(4):  # clean, injected, clean, two ranks injected
        here = step == 1 and me == target
        inject = (name, range(0, 2 * n_inf, 2), range(1, 2 * n_nan, 2)) if here else None
        if step == 3 and me in TWO_SITES:
            inject = TWO_SITES[me]
        grads = _grads_like(named, 10 * step + rank, inject)
        for pname, p in named:
            p.grad = grads[pname]
        result = opt.step()
        opt.zero_grad()
        reports.append((bool(result.update_successful), [tuple(r) for r in opt.last_nonfinite]))
    return reports


# step 4 of the MixedPrecisionOptimizer runs: one inf on stage 0, one nan on stage 1
TWO_SITES = {(0, 0, 1): ("layers.0.fc.weight", [4], []), (1, 1, 0): ("layers.1.ln.weight", [], [5])}


def _dist_opt_worker(rank, world, overlap, fp32_reduce, target, name, n_inf, n_nan):
    st = tpamp.parallel.initialize_model_parallel(2, 2)
    named = _stage_params(st, torch.float16)
    opt = tpamp.DistributedOptimizer(
        torch.optim.AdamW([p for _, p in named], lr=1e-3),
        grad_scaler=tpamp.DynamicGradScaler(initial_scale=2.0**8, hysteresis=1),
        clip_grad=1.0, data_parallel_group=st.dp_group, grad_stats_group=dist.group.WORLD,
        tensor_parallel_group=st.tp_group, param_names=named, parallel_state=st,
        overlap_grad_reduce=overlap, grad_reduce_in_fp32=fp32_reduce, bucket_size=20,
    )
    reports = []
    for step in range(3):
        here = step == 1 and (st.tp_rank, st.pp_rank, st.dp_rank) == target
        grads = _grads_like(named, 10 * step + rank, (name, range(0, 2 * n_inf, 2), range(1, 2 * n_nan, 2)) if here else None)
        # a real backward: d/dp sum(p * g) = g, through the optimizer's grad hooks
        loss = sum((p.float() * grads[pname].float()).sum() for pname, p in named)
        loss.backward()
        result = opt.step()
        opt.zero_grad()
        reports.append((bool(result.update_successful), [tuple(r) for r in opt.last_nonfinite]))
    return reports


def _check(reports, target, name, n_inf, n_nan):
    tp, pp, dp = target
    expected = [(name, tp, pp, dp, n_inf, n_nan, _rank_of(tp, pp, dp))]
    for rank, rep in enumerate(reports):
        assert rep[0] == (True, []), f"rank {rank}: clean first step reported {rep[0]}"
        assert rep[1] == (False, expected), f"rank {rank}: {rep[1]} != {(False, expected)}"
        assert rep[2] == (True, []), f"rank {rank}: clean step after the skip reported {rep[2]}"


@pytest.mark.parametrize(
    "fused,target,name,n_inf,n_nan",
    [
        (True, (1, 1, 0), "layers.1.fc.weight", 3, 2),
        (False, (0, 0, 1), "layers.0.ln.weight", 0, 1),
    ],
)
def test_mixed_precision_optimizer_names_param_and_rank(fused, target, name, n_inf, n_nan):
    reports = run_workers(_mpo_worker, WORLD, fused, target, name, n_inf, n_nan, timeout=120)
    _check(reports, target, name, n_inf, n_nan)
    # backward order: the later pipeline stage's record first, on every rank
    expected = [("layers.1.ln.weight", 1, 1, 0, 0, 1, _rank_of(1, 1, 0)),
                ("layers.0.fc.weight", 0, 0, 1, 1, 0, _rank_of(0, 0, 1))]
    for rank, rep in enumerate(reports):
        assert rep[3] == (False, expected), f"rank {rank}: {rep[3]}"


@pytest.mark.parametrize(
    "overlap,fp32_reduce,target,name,n_inf,n_nan",
    [
        (False, True, (1, 0, 1), "layers.0.fc.bias", 1, 1),
        (True, False, (0, 1, 1), "layers.1.fc.weight", 4, 0),
    ],
)
def test_distributed_optimizer_names_dp_rank_before_reduce(overlap, fp32_reduce, target, name, n_inf, n_nan):
    reports = run_workers(_dist_opt_worker, WORLD, overlap, fp32_reduce, target, name, n_inf, n_nan, timeout=120)
    _check(reports, target, name, n_inf, n_nan)
