"""deterministic_grad_norm across layouts (docs/spec.md section 23), multi-process.

The same global gradients (a small model: TP-sharded matrices, TP-replicated biases, a word
embedding tied between the first and last pipeline stage, zero-element params, experts) are laid
out over the ranks in every way: TP x PP x DP x EP, the dense params replicated over DP (stats
over the model-parallel group, experts over the expert model-parallel group: dense + expert
parts apart) or sharded over DP as ZeRO-1 / FSDP shard them (stats over every rank). With the
option on, every rank of every layout reports the same float64 norm (the one the clip uses),
equal bit for bit to the single-process reference math.sqrt(math.fsum(squares)), and the same
zeros and found_inf.

The default run covers a fast subset on 4 ranks; the full sweep of every factorization of 8
ranks runs with ``-m repro_sweep`` (or TPAMP_FULL_SWEEP=1).
"""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_workers

import tpamp

N_LAYERS = 4
N_EXPERTS = 8
MOE_LAYER = 1


def _global_model(seed: int):
    """[(name, kind, layer, grad)]: kind "tp" (sharded on dim 0 over TP), "rep" (replicated over
    TP), "tied" (the word embedding: on the first stage, with a shared copy on the last one),
    "expert". Values of widely mixed magnitudes, with exact zeros."""
    g = torch.Generator().manual_seed(seed)

    def values(*shape):
        x = torch.randn(*shape, generator=g) * torch.exp(torch.randn(*shape, generator=g) * 8)
        x[torch.rand(*shape, generator=g) < 0.1] = 0.0
        return x.float()

    rows = [("embedding.word", "tied", 0, values(8, 5))]
    for layer in range(N_LAYERS):
        rows.append((f"layers.{layer}.fc.weight", "tp", layer, values(8, 6)))
        rows.append((f"layers.{layer}.norm.weight", "rep", layer, values(6)))
        rows.append((f"layers.{layer}.empty", "rep", layer, values(0)))
        rows.append((f"layers.{layer}.fc.empty", "tp", layer, values(8, 0)))
    for k in range(N_EXPERTS):
        rows.append((f"layers.{MOE_LAYER}.experts.{k}.w", "expert", MOE_LAYER, values(4, 3)))
    return rows


def _reference(rows):
    vals = [v for name, kind, layer, grad in rows for v in grad.reshape(-1).tolist()]
    return math.sqrt(math.fsum(v * v for v in vals)), sum(v == 0.0 for v in vals)


def layouts(world: int):
    """Every (tp, pp, dp, ep, sharded) with tp * pp * dp == world and ep dividing tp * dp."""
    out = []
    for tp, pp in itertools.product([1, 2, 4, 8], repeat=2):
        if world % (tp * pp):
            continue
        dp = world // (tp * pp)
        for ep in [e for e in (1, 2, 4, 8) if (tp * dp) % e == 0 and e <= N_EXPERTS]:
            for sharded in (False, True):
                out.append((tp, pp, dp, ep, sharded))
    return out


class _Groups:
    """Process groups by their ranks, created in the same order on every rank."""

    def __init__(self):
        self.groups = {}

    def get(self, ranks):
        ranks = tuple(sorted(ranks))
        if ranks not in self.groups:
            self.groups[ranks] = dist.new_group(list(ranks))
        return self.groups[ranks]


def _chunk(flat, index, count):
    n = flat.numel()
    return flat[n * index // count: n * (index + 1) // count]


def _one_layout(rank, world, layout, rows, groups, det, fused, spy):
    tp, pp, dp, ep, sharded = layout
    coord = {}
    for r in range(world):  # rank = (pp_rank * dp + dp_rank) * tp + tp_rank
        coord[r] = (r // (tp * dp), (r // tp) % dp, r % tp)
    my_pp, my_dp, my_tp = coord[rank]
    local_i = my_dp * tp + my_tp  # index within the stage, for the expert layout
    my_ep, my_edp = local_i % ep, local_i // ep
    # every group of the layout, created on every rank in one order
    tp_groups = {(p, d): groups.get([r for r in range(world) if coord[r][:2] == (p, d)])
                 for p in range(pp) for d in range(dp)}
    mp_groups = {d: groups.get([r for r in range(world) if coord[r][1] == d]) for d in range(dp)}
    edp_size = (tp * dp) // ep
    emp_groups = {e: groups.get([r for r in range(world)
                                 if (coord[r][1] * tp + coord[r][2]) // ep == e])
                  for e in range(edp_size)}
    singles = {r: groups.get([r]) for r in range(world)}
    world_group = groups.get(range(world))

    def stage(layer):
        return layer * pp // N_LAYERS

    params = []
    for name, kind, layer, grad in rows:
        copies = []
        if kind == "tied":
            copies.append((0, False))
            copies.append((pp - 1, True))  # the last stage's copy (the same stage when pp = 1)
        else:
            copies.append((stage(layer), False))
        for st, shared in copies:
            if st != my_pp:
                continue
            if kind == "expert":
                k = int(name.split(".")[3])
                if k % ep != my_ep:
                    continue
                local = grad.reshape(-1)
                if sharded:
                    local = _chunk(local, my_edp, edp_size)
            else:
                local = grad.chunk(tp, dim=0)[my_tp] if kind in ("tp", "tied") else grad
                local = local.reshape(-1)
                if sharded:
                    local = _chunk(local, my_dp, dp)
            p = torch.nn.Parameter(torch.zeros_like(local))
            p.grad = local.clone()
            if kind in ("tp", "tied"):
                p.tensor_model_parallel, p.partition_dim = True, 0
            if shared:
                p.shared = True
            if kind == "expert":
                p.allreduce = False
            params.append(p)
    if not params:  # a stage without params still joins the collectives
        params = [torch.nn.Parameter(torch.zeros(0))]
    inner = torch.optim.SGD(params, lr=1.0)
    if sharded:  # every rank holds distinct pieces: dense and expert stats over every rank
        stats, estats, etp = world_group, world_group, singles[rank]
    else:  # DP replicas: the model-parallel group, and the expert model-parallel group
        stats, estats, etp = mp_groups[my_dp], emp_groups[my_edp], singles[rank]
    opt = tpamp.FP32Optimizer(
        inner, clip_grad=1.0, grad_stats_group=stats,
        tensor_parallel_group=tp_groups[(my_pp, my_dp)], expert_grad_stats_group=estats,
        expert_tensor_parallel_group=etp, log_num_zeros_in_grad=True, fused_step=fused,
        deterministic_grad_norm=det)
    spy.clear()
    result = opt.step()
    return spy[-1], result.num_zeros_in_grad, result.update_successful


def _spy_on_norms():
    """A list that receives every float64 grad norm the core computes in this (forked) process."""
    root = tpamp.MixedPrecisionOptimizer._root
    spy = []

    def spying_root(self, norm_stat, finite_p):
        out = root(self, norm_stat, finite_p)
        spy.append(out.item())
        return out

    tpamp.MixedPrecisionOptimizer._root = spying_root
    return spy


def _sweep(rank, world, layouts_, seed, det, fused_flags, poison):
    spy = _spy_on_norms()
    rows = _global_model(seed)
    if poison:
        rows[1][3].view(-1)[5] = float("inf")  # layers.0.fc.weight
    groups = _Groups()
    out = []
    for layout in layouts_:
        for fused in fused_flags:
            out.append((layout, fused) + _one_layout(rank, world, tuple(layout), rows, groups,
                                                        det, fused, spy))
    return out


def _check(world, layouts_, seed=0, fused_flags=(True, False), timeout=120):
    results = run_workers(_sweep, world, layouts_, seed, True, fused_flags, False,
                          timeout=timeout)
    ref, zeros = _reference(_global_model(seed))
    for rank, rows in enumerate(results):
        for layout, fused, norm, nz, ok in rows:
            assert ok
            assert norm.hex() == ref.hex(), (rank, layout, fused, norm, ref)
            assert nz == zeros, (rank, layout, fused, nz, zeros)


FAST = [(2, 1, 2, 2, False), (1, 2, 2, 1, True), (2, 2, 1, 2, False), (4, 1, 1, 4, True),
        (1, 1, 4, 4, False)]


def test_layouts_fast_subset():
    """4 ranks, five layouts (TP x PP x DP x EP, replicated and ZeRO-sharded, both step paths):
    the same norm bits as the single-process fsum reference, the same zeros."""
    assert all(layout in layouts(4) for layout in FAST)
    _check(4, FAST)


def _default_and_poisoned(rank, world, layouts_):
    return (_sweep(rank, world, layouts_, 0, False, (True, False), False),
            _sweep(rank, world, layouts_, 1, True, (True, False), True))


def test_default_is_close_and_found_inf_agrees():
    """Without the option the norm is within float32 accumulation of the reference (its bits
    are not promised across layouts); with an inf in one grad, every layout skips."""
    ref, _ = _reference(_global_model(0))
    results = run_workers(_default_and_poisoned, 4, FAST[:3], timeout=60)
    seen = set()
    for default, poisoned in results:
        for layout, fused, norm, nz, ok in default:
            assert ok and norm == pytest.approx(ref, rel=1e-5), (layout, fused)
            seen.add(norm.hex())
        for layout, fused, norm, nz, ok in poisoned:
            assert not ok and nz is None, (layout, fused)
    # float accumulation in another order: these three layouts give three norms (measured
    # 2026-11-27: they differ from each other and from the reference from the 9th digit on)
    assert len(seen) > 1, seen


def _full_sweep_enabled(config) -> bool:
    return os.environ.get("TPAMP_FULL_SWEEP") == "1" or "repro_sweep" in (
        config.getoption("-m") or "")


@pytest.mark.repro_sweep
def test_every_factorization_of_8_ranks(request):
    """Every TP x PP x DP factorization of 8 ranks with every EP that fits, replicated and
    ZeRO-sharded, both step paths, two gradient draws."""
    if not _full_sweep_enabled(request.config):
        pytest.skip("the full sweep runs with -m repro_sweep (or TPAMP_FULL_SWEEP=1)")
    for seed in (0, 1):
        _check(8, layouts(8), seed=seed, timeout=600)


def _zero1_all(rank, world, configs):
    return [_zero1(rank, world, *c) for c in configs]


def _zero1(rank, world, tp, bucket_size, seed, fused):
    """DistributedOptimizer (ZeRO-1: each DP rank steps a shard of every bucket) over TP x DP,
    one stage, dense params. DP rank 0 holds d x grad and the others 0, so the reduce-scatter
    (SUM, then x 1/d) gives exactly the global grads whatever its order."""
    spy = _spy_on_norms()
    dp = world // tp
    my_dp, my_tp = rank // tp, rank % tp
    groups = _Groups()
    tp_groups = [groups.get([d * tp + t for t in range(tp)]) for d in range(dp)]
    dp_groups = [groups.get([d * tp + t for d in range(dp)]) for t in range(tp)]
    params = []
    for name, kind, layer, grad in _global_model(seed):
        if kind == "expert":
            continue
        for shared in ((False, True) if kind == "tied" else (False,)):
            local = grad.chunk(tp, dim=0)[my_tp] if kind in ("tp", "tied") else grad
            p = torch.nn.Parameter(torch.zeros_like(local))
            p.grad = local * dp if my_dp == 0 else torch.zeros_like(local)
            if kind in ("tp", "tied"):
                p.tensor_model_parallel, p.partition_dim = True, 0
            if shared:
                p.shared = True
            params.append(p)
    opt = tpamp.DistributedOptimizer(
        torch.optim.SGD(params, lr=1.0), data_parallel_group=dp_groups[my_tp],
        grad_stats_group=groups.get(range(world)), tensor_parallel_group=tp_groups[my_dp],
        bucket_size=bucket_size, clip_grad=1.0, log_num_zeros_in_grad=True, fused_step=fused,
        deterministic_grad_norm=True)
    result = opt.step()
    return spy[-1], result.num_zeros_in_grad, result.update_successful


def test_distributed_optimizer_zero1_shards():
    """ZeRO-1 shards of every bucket (several bucket sizes), TP x DP on 4 ranks, both step
    paths: the norm of the dense params is the single-process reference's bits."""
    configs = [(1, None, 0, True), (2, 7, 0, False), (1, 13, 0, False), (4, None, 0, True)]
    rows = [r for r in _global_model(0) if r[1] != "expert"]
    ref, zeros = _reference(rows)
    for per_rank in run_workers(_zero1_all, 4, configs, timeout=60):
        for config, (norm, nz, ok) in zip(configs, per_rank):
            assert ok and norm.hex() == ref.hex(), (config, norm, ref)
            assert nz == zeros, config


def _mismatch(rank, world):
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.ones(3)
    opt = tpamp.FP32Optimizer(torch.optim.SGD([p], lr=1.0), grad_stats_group=dist.group.WORLD,
                              deterministic_grad_norm=rank == 0)
    try:
        opt.step()
    except ValueError as e:
        return str(e)
    return None


def test_per_rank_mismatch_is_refused():
    for msg in run_workers(_mismatch, 2, timeout=30):
        assert msg is not None and "deterministic_grad_norm" in msg, msg
