"""Grad statistics with expert parallelism (docs/spec.md section 19): a small MoE-like model whose
expert params are sharded over EP (and expert-TP) and whose dense params are TP-sharded or
replicated gives the grad norm, zero count and clipped update of a single-process float64
computation of the unsharded model; an inf in one expert's grad on one rank skips the step on
every rank and names the expert param and its EP rank."""

import math

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_workers

import tpamp
from tpamp.parallel import initialize_model_parallel

H, E, N, D_MAX = 4, 4, 6, 4  # hidden, experts, tokens per data shard, data shards


def _params_and_data():
    g = torch.Generator().manual_seed(0)
    params = {
        "dense.w1": torch.randn(H, H, generator=g, dtype=torch.float64),
        "dense.b1": torch.randn(H, generator=g, dtype=torch.float64),
        "moe.experts.weight": torch.randn(E, H, H, generator=g, dtype=torch.float64),
        "moe.experts.bias": torch.randn(E, H, generator=g, dtype=torch.float64),
        "head.w2": torch.randn(H, generator=g, dtype=torch.float64),
    }
    return params, [torch.randn(N, H, generator=g, dtype=torch.float64) for _ in range(D_MAX)]


def _shard_loss(leaves, x, d):
    """Data shard d's loss. Token i goes to expert (d + i) % (E - 1), so expert E - 1 gets no
    token (a zero gradient: counted zeros)."""
    y = torch.tanh(x @ leaves["dense.w1"].T + leaves["dense.b1"])
    experts = [(d + i) % (E - 1) for i in range(N)]
    z = torch.stack([leaves["moe.experts.weight"][e] @ y[i] + leaves["moe.experts.bias"][e]
                     for i, e in enumerate(experts)])
    return ((z @ leaves["head.w2"]) ** 2).mean()


def _reference(num_data, shards=None):
    """The unsharded model in float64: params and the gradient of the global loss, the mean
    over the data shards of each shard's loss (or, with ``shards``, of the sum of those
    shards' losses, not divided)."""
    params, data = _params_and_data()
    leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    if shards is None:
        loss = sum(_shard_loss(leaves, data[d], d) for d in range(num_data)) / num_data
    else:
        loss = sum(_shard_loss(leaves, data[d], d) for d in shards)
    loss.backward()
    return params, {k: v.grad for k, v in leaves.items()}


def _local(name, full, st):
    """This rank's slice of a global tensor: w1 is column-parallel over TP (dim 0), the experts
    are split over EP (dim 0) and the expert weight over expert-TP (dim 1)."""
    d = st.dims
    if name == "dense.w1":
        return full.chunk(d.tp, 0)[st.tp_rank]
    if name.startswith("moe."):
        full = full.chunk(d.ep, 0)[st.ep_rank]
        if name == "moe.experts.weight":
            full = full.chunk(d.etp, 1)[st.expert_tp_rank]
    return full


def _stage_params(st):
    if st.dims.pp == 1:
        return ["dense.w1", "dense.b1", "moe.experts.weight", "moe.experts.bias", "head.w2"]
    return ["dense.w1", "dense.b1"] if st.pp_rank == 0 else [
        "moe.experts.weight", "moe.experts.bias", "head.w2"]


def _build(st, ref_params, ref_grads, wrapper, fused, clip):
    named = []
    for name in _stage_params(st):
        p = torch.nn.Parameter(_local(name, ref_params[name], st).float().clone())
        if name == "dense.w1":
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, 0, 1
        if name.startswith("moe."):
            tpamp.mark_expert_param(p, expert_dim=0)
        if name == "moe.experts.weight" and st.dims.etp > 1:
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, 1, 1
        p.grad = _local(name, ref_grads[name], st).float().clone()
        named.append((name, p))
    inner = torch.optim.SGD([p for _, p in named], lr=0.1)
    cls = tpamp.FP32Optimizer if wrapper == "fp32" else tpamp.MixedPrecisionOptimizer
    opt = cls(inner, clip_grad=clip, log_num_zeros_in_grad=True, fused_step=fused,
              grad_stats_group=st.model_parallel_group, tensor_parallel_group=st.tp_group,
              parallel_state=st, param_names=named)
    return opt, named


LAYOUTS = {
    "ep2-tp2": dict(tp=2, ep=2),
    "ep2-tp2-etp1": dict(tp=2, ep=2, etp=1),
    "ep2-pp2": dict(pp=2, ep=2),
    "ep4": dict(ep=4),
}


def _init(sizes):
    return initialize_model_parallel(
        sizes.get("tp", 1), sizes.get("pp", 1), expert_model_parallel_size=sizes.get("ep", 1),
        expert_tensor_parallel_size=sizes.get("etp"), context_parallel_size=sizes.get("cp", 1))


def _step(rank, world, sizes, wrapper, fused):
    st = _init(sizes)
    ref_params, ref_grads = _reference(st.dims.dp)
    opt, named = _build(st, ref_params, ref_grads, wrapper, fused, clip=0.5)
    tracker = opt.track_param_grad_norms(named)
    ok, norm, zeros = opt.step(param_grad_norms=True, param_update_norms=True)
    after = {name: p.detach().double() for name, p in named}
    return ok, norm, zeros, after, (st.tp_rank, st.pp_rank, st.ep_rank, st.expert_tp_rank), \
        (tracker.norms, tracker.update_norms)


@pytest.mark.parametrize("layout,wrapper,fused", [
    ("ep2-tp2", "fp32", True), ("ep2-tp2", "mixed", False), ("ep2-tp2-etp1", "fp32", True),
    ("ep2-pp2", "mixed", False), ("ep4", "fp32", True),
])
def test_grad_norm_zeros_and_clip_match_the_unsharded_float64_model(layout, wrapper, fused):
    sizes = LAYOUTS[layout]
    results = run_workers(_step, 4, sizes, wrapper, fused)
    dp = 4 // (sizes.get("tp", 1) * sizes.get("pp", 1))
    ref_params, ref_grads = _reference(dp)
    flat = torch.cat([g.reshape(-1) for g in ref_grads.values()])
    ref_norm = float(flat.norm())
    ref_zeros = int((flat == 0).sum())
    assert ref_zeros >= H * H + H  # the expert that got no token
    coeff = 0.5 / (ref_norm + 1e-6)
    assert coeff < 1
    ep = sizes.get("ep", 1)
    want_norms = {}  # per-parameter norms: each EP rank's part of an expert param apart
    for name, g in ref_grads.items():
        if name.startswith("moe."):
            for j, part in enumerate(g.chunk(ep, 0)):
                want_norms[f"{name} [ep {j}]"] = float(part.norm())
        else:
            want_norms[name] = float(g.norm())
    for ok, norm, zeros, after, _, (norms, updates) in results:
        assert ok
        assert norm == pytest.approx(ref_norm, rel=1e-5)
        assert zeros == ref_zeros
        assert set(norms) == set(want_norms) == set(updates)
        for name, value in want_norms.items():
            assert norms[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
            # SGD(lr 0.1): each param (each EP rank's part apart) moved by 0.1 x coeff x grad
            assert updates[name] == pytest.approx(0.1 * coeff * value, rel=1e-5, abs=1e-7), name
    # ONE clip coefficient for dense and expert params: every shard moved by lr * coeff * grad
    for rank, (_, _, _, after, (tp, pp, ep, etp), _) in enumerate(results):
        class _St:  # the coordinates _local reads
            pass
        st = _St()
        from tpamp.parallel import ParallelDims
        st.dims = ParallelDims(tp=sizes.get("tp", 1), pp=sizes.get("pp", 1), world_size=4,
                               ep=sizes.get("ep", 1), etp=sizes.get("etp"))
        st.tp_rank, st.ep_rank, st.expert_tp_rank = tp, ep, etp
        for name, value in after.items():
            want = _local(name, ref_params[name] - 0.1 * coeff * ref_grads[name], st)
            torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-6, msg=f"{name} rank {rank}")


def _inf_step(rank, world, sizes):
    st = _init(sizes)
    ref_params, ref_grads = _reference(st.dims.dp)
    opt, named = _build(st, ref_params, ref_grads, "fp32", True, clip=0.0)
    before = {name: p.detach().clone() for name, p in named}
    params = dict(named)
    if st.ep_rank == 1 and st.expert_tp_rank == 0 and st.tp_rank == 0 and "moe.experts.weight" in params:
        params["moe.experts.weight"].grad[0, 0, 0] = math.inf
    ok, norm, zeros = opt.step()
    unchanged = all(torch.equal(p.detach(), before[name]) for name, p in named)
    return ok, unchanged, [(type(r).__name__, r._asdict()) for r in opt.last_nonfinite], \
        tpamp.nonfinite.describe(opt.last_nonfinite), dist.get_rank()


@pytest.mark.parametrize("layout", ["ep2-tp2", "ep2-pp2"])
def test_inf_in_one_experts_grad_skips_the_step_everywhere_and_names_its_ep_rank(layout):
    results = run_workers(_inf_step, 4, LAYOUTS[layout])
    for ok, unchanged, records, text, rank in results:
        assert not ok and unchanged, (rank, ok, unchanged)
        assert len(records) == 1, (rank, records)
        kind, rec = records[0]
        assert kind == "ExpertNonFiniteGrad"
        assert rec["name"] == "moe.experts.weight" and rec["ep_rank"] == 1
        assert rec["num_inf"] == 1
        assert "ep 1" in text and "moe.experts.weight" in text


def test_expert_params_are_recognised_by_attribute_and_by_ep_mesh():
    p = torch.nn.Parameter(torch.zeros(2, 3))
    assert not tpamp.is_expert_param(p)
    assert tpamp.mark_expert_param(p, expert_dim=0) is p
    assert tpamp.is_expert_param(p) and p.allreduce is False and p.expert_dim == 0
    q = torch.zeros(3)
    q.allreduce = False  # as Megatron-core's expert layers mark them
    assert tpamp.is_expert_param(q)
    with pytest.raises(ValueError, match="expert_dim 2 is outside"):
        tpamp.mark_expert_param(torch.zeros(2, 3), expert_dim=2)
    with pytest.raises(TypeError, match="expert_dim"):
        tpamp.mark_expert_param(torch.zeros(2, 3), expert_dim="0")


def _dtensor_expert(rank, world):
    from torch.distributed.tensor import DTensor, Shard

    st = initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    w = DTensor.from_local(torch.zeros(1, 3), st.expert_mesh["ep"], [Shard(0)], run_check=False)
    dense = DTensor.from_local(torch.zeros(3), st.mesh["dp"], [Shard(0)], run_check=False)
    return tpamp.is_expert_param(w), tpamp.is_expert_param(dense)


def test_dtensor_on_the_ep_mesh_is_an_expert_param():
    assert all(r == (True, False) for r in run_workers(_dtensor_expert, 4))


# ---- checkpoints: saved at EP 2, resumed at EP 1 (tpamp.checkpoint) ---------------------------


def _ckpt_model(st, ref_params):
    named = []
    for name in _stage_params(st):
        p = torch.nn.Parameter(_local(name, ref_params[name], st).float().clone())
        if name.startswith("moe."):
            tpamp.mark_expert_param(p, expert_dim=0, expert_mesh=st.expert_mesh)
        named.append((name, p))
    opt = tpamp.FP32Optimizer(torch.optim.AdamW([p for _, p in named], lr=0.01),
                              grad_stats_group=st.model_parallel_group, parallel_state=st,
                              param_names=named)
    return opt, named


def _save_at_ep(rank, world, path, ep):
    from tpamp.checkpoint import save_checkpoint

    st = initialize_model_parallel(1, 1, expert_model_parallel_size=ep)
    ref_params, ref_grads = _reference(st.dims.dp)
    opt, named = _ckpt_model(st, ref_params)
    for name, p in named:
        p.grad = _local(name, ref_grads[name], st).float().clone()
    assert opt.step().update_successful
    save_checkpoint(path, dict(named), opt)
    state = {n: {k: v.clone() for k, v in opt.optimizer.state[p].items() if k != "step"}
             for n, p in named}
    return {n: p.detach().clone() for n, p in named}, state, st.ep_rank


def _load_at_ep1(rank, world, path):
    from tpamp.checkpoint import load_checkpoint

    st = initialize_model_parallel(1, 1)
    ref_params, _ = _reference(1)
    opt, named = _ckpt_model(st, {k: torch.zeros_like(v) for k, v in ref_params.items()})
    load_checkpoint(path, dict(named), opt)
    state = {n: {k: v.clone() for k, v in opt.optimizer.state[p].items() if k != "step"}
             for n, p in named}
    return {n: p.detach().clone() for n, p in named}, state


def test_checkpoint_saved_at_ep2_resumes_at_ep1(tmp_path):
    path = str(tmp_path / "ep2")
    saved = run_workers(_save_at_ep, 2, path, 2)
    (params, state), = run_workers(_load_at_ep1, 1, path)
    by_ep = {ep: (p, s) for p, s, ep in saved}
    for name in params:
        if name.startswith("moe."):  # the experts of EP ranks 0 and 1, at their global index
            want = torch.cat([by_ep[0][0][name], by_ep[1][0][name]])
            want_state = {k: torch.cat([by_ep[0][1][name][k], by_ep[1][1][name][k]])
                          for k in state[name]}
        else:
            want, want_state = by_ep[0][0][name], by_ep[0][1][name]
        torch.testing.assert_close(params[name], want, rtol=0, atol=0, msg=name)
        assert set(state[name]) == {"exp_avg", "exp_avg_sq"}
        for k, v in state[name].items():
            torch.testing.assert_close(v, want_state[k], rtol=0, atol=0, msg=f"{name} {k}")


# ---- DistributedOptimizer: dense params sharded over DP, expert params over expert-DP ---------


def _dist_opt_model(rank, world, st):
    """(name, param, local grad) of a data-parallel run: dense grads of this rank's data shard,
    expert grads of the data shards whose tokens reach this rank's experts."""
    d = st.dims
    num_data = d.dp * d.cp  # each DP x CP rank's tokens are one data shard (a CP rank: a chunk)
    data_of = lambda s: d.dense_coords(s)[1] * d.cp + d.dense_coords(s)[2]
    ref_params, _ = _reference(num_data)
    # the data shards whose tokens reach this rank's experts: those of its EP group's ranks
    mine = d.expert_coords(rank)
    ep_group = [s for s in range(world) if d.expert_coords(s)[:2] == mine[:2]
                and d.expert_coords(s)[3] == mine[3]]
    expert_data = sorted({data_of(s) for s in ep_group})
    named = []
    for name in _stage_params(st):
        p = torch.nn.Parameter(_local(name, ref_params[name], st).float().clone())
        if name == "dense.w1":
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, 0, 1
        if name.startswith("moe."):
            tpamp.mark_expert_param(p, expert_dim=0, expert_mesh=st.expert_mesh)
            full = _reference(num_data, shards=expert_data)[1][name]
        else:
            full = _reference(num_data, shards=[data_of(rank)])[1][name]
        if name == "moe.experts.weight" and d.etp > 1:
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, 1, 1
        named.append((name, p, _local(name, full, st).float().clone()))
    return named


def _dist_opt_step(rank, world, sizes, fused, overlap=False):
    st = _init(sizes)
    named = _dist_opt_model(rank, world, st)
    opt = tpamp.DistributedOptimizer(
        torch.optim.SGD([p for _, p, _ in named], lr=0.1), clip_grad=0.5,
        log_num_zeros_in_grad=True, data_parallel_group=st.dp_cp_group,
        grad_stats_group=dist.group.WORLD, tensor_parallel_group=st.tp_group,
        parallel_state=st, param_names=[(n, p) for n, p, _ in named], fused_step=fused,
        overlap_grad_reduce=overlap, bucket_size=8)
    tracker = opt.track_param_grad_norms([(n, p) for n, p, _ in named])
    loss = sum((p * g).sum() for _, p, g in named)  # d loss / d p = g, through the grad hooks
    loss.backward()
    ok, norm, zeros = opt.step(param_grad_norms=True)
    return ok, norm, zeros, {n: p.detach().double() for n, p, _ in named}, tracker.norms


@pytest.mark.parametrize("layout,fused,overlap", [
    ("ep2-dp4", True, True), ("ep2-dp4", False, False), ("ep2-tp2", True, False),
    ("cp2-ep2", True, False)])
def test_distributed_optimizer_shards_experts_over_expert_dp_and_matches_float64(layout, fused, overlap):
    """Dense params reduced and sharded over DP x CP, expert params over expert-DP."""
    sizes = {"ep2-dp4": dict(ep=2), "ep2-tp2": dict(tp=2, ep=2), "cp2-ep2": dict(cp=2, ep=2)}[layout]
    results = run_workers(_dist_opt_step, 4, sizes, fused, overlap)
    dp = 4 // sizes.get("tp", 1)
    ref_params, ref_grads = _reference(dp)
    flat = torch.cat([g.reshape(-1) for g in ref_grads.values()])
    ref_norm = float(flat.norm())
    coeff = 0.5 / (ref_norm + 1e-6)
    from tpamp.parallel import ParallelDims

    dims = ParallelDims(tp=sizes.get("tp", 1), world_size=4, ep=2, cp=sizes.get("cp", 1))
    for rank, (ok, norm, zeros, after, norms) in enumerate(results):
        assert ok
        assert norm == pytest.approx(ref_norm, rel=1e-5)
        assert zeros == int((flat == 0).sum())
        assert norms["moe.experts.weight [ep 1]"] == pytest.approx(
            float(ref_grads["moe.experts.weight"].chunk(2, 0)[1].norm()), rel=1e-5)
        assert norms["dense.w1"] == pytest.approx(float(ref_grads["dense.w1"].norm()), rel=1e-5)
        assert math.fsum(v * v for v in norms.values()) == pytest.approx(ref_norm ** 2, rel=1e-5)

        class _St:
            pass
        st = _St()
        st.dims, st.tp_rank = dims, dims.dense_coords(rank)[3]
        st.ep_rank, st.expert_tp_rank = dims.expert_coords(rank)[2], dims.expert_coords(rank)[3]
        for name, value in after.items():
            want = _local(name, ref_params[name] - 0.1 * coeff * ref_grads[name], st)
            torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-6, msg=f"{name} rank {rank}")


def _fsdp_expert(rank, world):
    from torch.distributed.fsdp import fully_shard

    st = initialize_model_parallel(1, 1)
    model = torch.nn.Linear(4, 4)
    fully_shard(model, mesh=st.mesh["dp"])
    tpamp.mark_expert_param(model.weight)
    try:
        tpamp.fsdp.fully_shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), st.mesh["dp"])
    except ValueError as e:
        return str(e)
    return None


def test_fsdp2_refuses_expert_params_with_a_clear_error():
    for msg in run_workers(_fsdp_expert, 2):
        assert msg is not None and "expert param" in msg and "param 0 of param group 0" in msg


def _save_dist_opt_at_ep2(rank, world, path):
    from tpamp.checkpoint import save_checkpoint

    st = _init(dict(ep=2))
    named = _dist_opt_model(rank, world, st)
    opt = tpamp.DistributedOptimizer(
        torch.optim.AdamW([p for _, p, _ in named], lr=0.01),
        data_parallel_group=st.dp_group, grad_stats_group=dist.group.WORLD,
        tensor_parallel_group=st.tp_group, parallel_state=st,
        param_names=[(n, p) for n, p, _ in named], bucket_size=8)
    sum((p * g).sum() for _, p, g in named).backward()
    assert opt.step().update_successful
    save_checkpoint(path, {n: p for n, p, _ in named}, opt)
    return True


def test_distributed_optimizer_checkpoint_saved_at_ep2_resumes_at_ep1(tmp_path):
    """Expert params saved by flat range at their global expert offset: the state of a
    one-process EP 1 load equals that of an EP 2 run of FP32Optimizer on the same gradient."""
    path = str(tmp_path / "dist-ep2")
    assert all(run_workers(_save_dist_opt_at_ep2, 2, path))
    (params, state), = run_workers(_load_at_ep1, 1, path)
    saved = run_workers(_save_at_ep, 2, str(tmp_path / "fp32-ep2"), 2)
    by_ep = {ep: (p, s) for p, s, ep in saved}
    for name in params:
        cat = (lambda k: torch.cat([by_ep[0][k][name], by_ep[1][k][name]])) if name.startswith(
            "moe.") else (lambda k: by_ep[0][k][name])
        torch.testing.assert_close(params[name], cat(0), rtol=1e-5, atol=1e-7, msg=name)
        for key in ("exp_avg", "exp_avg_sq"):
            want = torch.cat([by_ep[0][1][name][key], by_ep[1][1][name][key]]) \
                if name.startswith("moe.") else by_ep[0][1][name][key]
            torch.testing.assert_close(state[name][key], want, rtol=1e-5, atol=1e-9,
                                       msg=f"{name} {key}")


def _dist_opt_inf(rank, world):
    st = _init(dict(ep=2))
    named = _dist_opt_model(rank, world, st)
    opt = tpamp.DistributedOptimizer(
        torch.optim.SGD([p for _, p, _ in named], lr=0.1), data_parallel_group=st.dp_group,
        grad_stats_group=dist.group.WORLD, parallel_state=st,
        param_names=[(n, p) for n, p, _ in named])
    before = {n: p.detach().clone() for n, p, _ in named}
    for n, p, g in named:
        if n == "moe.experts.bias" and rank == 3:  # ep rank 1, expert-DP rank 1
            g = g.clone()
            g[1, 2] = math.nan
        p.grad = g
    ok, _, _ = opt.step()
    unchanged = all(torch.equal(p.detach(), before[n]) for n, p, _ in named)
    return ok, unchanged, [str(r) for r in opt.last_nonfinite]


def test_distributed_optimizer_nan_in_one_experts_grad_skips_everywhere_and_names_it():
    for ok, unchanged, records in run_workers(_dist_opt_inf, 4):
        assert not ok and unchanged
        assert records == ["nan in moe.experts.bias [ep 1, etp 0, pp 0, edp 1]"], records
