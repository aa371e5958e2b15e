"""LayerWiseDistributedOptimizer (docs/spec.md section 18): whole params owned by one DP rank
each. Through it, torch.optim.Muon and torch.optim.Adafactor at DP 2 equal a single-process
float64 run of the same torch optimizer class on the DP-mean gradients (to fp32 rounding),
fp32 and fp16 models, with the loss scaler's skip on every rank; state bytes per rank are
about 1/DP of the replicated wrapper's; a checkpoint saved at DP 2 resumes at DP 1 and DP 4
(and in a replicated MixedPrecisionOptimizer) bit-identically to the uninterrupted run."""

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
from dist_utils import run_workers

import tpamp
from tpamp.layerwise_optimizer import layerwise_cost, layerwise_owners

checkpoint = pytest.importorskip("tpamp.checkpoint")

MATRICES = {"w1": (8, 6), "w2": (6, 8), "w3": (12, 6), "w4": (6, 6), "w5": (4, 10)}
VECTORS = {"b1": (6,), "ln": (8,)}
DP = 2  # the reference's data-parallel size: the mean of this many ranks' grads
STEPS = 5
INF_STEP = 2  # DP rank 1 alone gets an inf in w1's grad at this step


def _shapes(opt_name):
    return dict(MATRICES) if opt_name == "muon" else {**MATRICES, **VECTORS}


def _inner(opt_name, params):
    if opt_name == "adamw":
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    if opt_name == "muon":
        return torch.optim.Muon(params, lr=0.02, weight_decay=0.1, momentum=0.95)
    return torch.optim.Adafactor(params, lr=0.01, weight_decay=0.1)


def _values(shapes, dtype):
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for k, s in shapes.items()}


def _grad(name, shape, rank, step):
    """float64 grad of one DP rank: multiples of 1/16 with <= 7 significant bits (exact in
    fp16 and fp32, and so is their sum and mean over ranks); a quarter of the elements are zero
    on every rank."""
    i = sorted(MATRICES | VECTORS).index(name)
    g = torch.Generator().manual_seed(1000 * step + 10 * i + rank)
    t = torch.round(torch.randn(shape, generator=g, dtype=torch.float64).clamp(-3.9, 3.9) * 16) / 16
    zeros = torch.rand(shape, generator=torch.Generator().manual_seed(1000 * step + i)) < 0.25
    return torch.where(zeros, torch.zeros_like(t), t)


def _np(t):
    return t.detach().double().numpy().copy()


def _reference(opt_name, dtype, clip_grad):
    """Single process, float64: the same torch optimizer class on the DP-mean grads, Megatron's
    clip (coefficient clip / (norm + 1e-6) when < 1), the inf step skipped."""
    shapes = _shapes(opt_name)
    params = {k: torch.nn.Parameter(v.double()) for k, v in _values(shapes, dtype).items()}
    opt = _inner(opt_name, list(params.values()))
    stats = []
    for step in range(STEPS):
        if step == INF_STEP:
            stats.append((False, None, None))
            continue
        grads = {k: sum(_grad(k, s, r, step) for r in range(DP)) / DP for k, s in shapes.items()}
        flat = torch.cat([g.reshape(-1) for g in grads.values()])
        norm = float(flat.norm())
        coeff = clip_grad / (norm + 1e-6) if clip_grad > 0 else 1.0
        for k, p in params.items():
            p.grad = grads[k] * min(coeff, 1.0)
        opt.step()
        stats.append((True, norm, int((flat == 0).sum())))
    last = {k: float(g.norm()) for k, g in grads.items()}  # per param, the last step's
    return {k: _np(p) for k, p in params.items()}, stats, last


def _build(opt_name, dtype, group, kind="layerwise", clip_grad=4.0, offset=0.0):
    shapes = _shapes(opt_name)
    params = {k: torch.nn.Parameter(v + offset) for k, v in _values(shapes, dtype).items()}
    scaler = (tpamp.DynamicGradScaler(initial_scale=2.0**8, hysteresis=1, growth_interval=2)
              if dtype == torch.float16 else None)
    kw = dict(grad_scaler=scaler, clip_grad=clip_grad, log_num_zeros_in_grad=True,
              param_names=iter(params.items()))  # a one-shot iterator, as a generator is
    inner = _inner(opt_name, list(params.values()))
    if kind == "layerwise":
        opt = tpamp.LayerWiseDistributedOptimizer(inner, data_parallel_group=group, **kw)
    elif kind == "distributed":
        opt = tpamp.DistributedOptimizer(inner, data_parallel_group=group, **kw)
    else:
        opt = tpamp.MixedPrecisionOptimizer(inner, **kw)
    return params, opt


def _feed(params, opt, rank, world, step, replicated=False):
    """This rank's loss-scaled grads for ``step``: the DP-2 run's rank ``rank``; at DP 1 the
    mean of both; at DP 4 ranks 2r and 2r+1 stand for DP-2 rank r (same mean)."""
    scale = float(opt.get_loss_scale())
    if replicated or world == 1:
        mine = range(DP)
    else:
        mine = [rank * DP // world]
    for k, p in params.items():
        g = sum(_grad(k, p.shape, r, step) for r in mine) / len(mine) * scale
        if step == INF_STEP and k == "w1" and (DP - 1) in mine:
            g[0, 0] = math.inf
        p.grad = g.to(p.dtype)


def _steps(params, opt, rank, world, start, n, replicated=False, param_norms=False):
    out = []
    for step in range(start, start + n):
        _feed(params, opt, rank, world, step, replicated)
        out.append(tuple(opt.step(param_grad_norms=param_norms)))
        opt.zero_grad()
    return out


def _train(rank, world, opt_name, dtype):
    params, opt = _build(opt_name, dtype, dist.group.WORLD)
    tracker = opt.track_param_grad_norms()
    stats = _steps(params, opt, rank, world, 0, INF_STEP + 1, param_norms=True)
    nonfinite = [(r.name, r.dp_rank, r.num_inf) for r in opt.last_nonfinite]
    stats += _steps(params, opt, rank, world, INF_STEP + 1, STEPS - INF_STEP - 1,
                    param_norms=True)
    masters = {k: _np(v) for k, v in opt.sharded_state_dict(params)["main_params"].items()}
    _, replicated = _build(opt_name, dtype, None, kind="replicated")
    _steps(_, replicated, rank, world, 0, 1, replicated=True)  # state exists after a step
    return dict(stats=stats, params={k: _np(p) for k, p in params.items()}, masters=masters,
                owners=opt.owners(), scale=float(opt.get_loss_scale()), norms=tracker.norms,
                nonfinite=nonfinite,
                state_bytes=opt.optimizer_state_bytes(),
                replicated_bytes=replicated.optimizer_state_bytes())


def test_owners_balance_newton_schulz_cost_deterministically():
    # costs 64, 512, 2, 512: 512 (index 1) -> rank 0, 512 (index 3) -> rank 1, 64 -> rank 0
    # (tie at 512: the lower rank), 2 -> rank 1 (514 < 576)
    assert layerwise_owners([(4, 4), (8, 8), (2,), (8, 8)], 2) == [0, 0, 1, 1]
    assert layerwise_cost((12, 6)) == 12 * 6 * 6 and layerwise_cost((4, 2, 5)) == 4 * 10 * 4
    assert layerwise_cost((7,)) == 7 and layerwise_cost(()) == 1
    assert layerwise_owners([(3, 3)] * 5, 1) == [0] * 5
    with pytest.raises(ValueError, match="dp_size"):
        layerwise_owners([(2, 2)], 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("opt_name", ["muon", "adafactor"])
def test_dp2_equals_single_process_float64_with_the_same_torch_optimizer(opt_name, dtype):
    want, want_stats, want_norms = _reference(opt_name, dtype, clip_grad=4.0)
    results = run_workers(_train, DP, opt_name, dtype)
    owners = results[0]["owners"]
    assert owners == results[1]["owners"] and set(owners.values()) == {0, 1}
    for rank, res in enumerate(results):
        # every DP rank takes the same decisions: the inf on rank 1 skips the step everywhere
        assert [s[0] for s in res["stats"]] == [s[0] for s in want_stats], rank
        for (ok, norm, zeros), (_, wnorm, wzeros) in zip(res["stats"], want_stats):
            if ok:  # each param counted once over DP
                assert math.isclose(norm, wnorm, rel_tol=1e-5) and zeros == wzeros, rank
        assert res["scale"] == results[0]["scale"]
        # the culprit, named on every rank: the owner's DP-summed grad of w1 held the inf
        assert res["nonfinite"] == [("w1", owners["w1"], 1)], res["nonfinite"]
        assert set(res["norms"]) == set(want_norms)  # per-param norms: each on its owner
        for k, n in want_norms.items():
            assert math.isclose(res["norms"][k], n, rel_tol=1e-5), (rank, k)
        assert set(res["masters"]) == {k for k, o in owners.items() if o == rank}
        for k, v in res["params"].items():  # the broadcast: every rank has every param
            assert np.array_equal(v, results[owners[k]]["params"][k]), (rank, k)
    if dtype == torch.float16:
        # 2**8, grown after steps 0-1, halved at the skip, grown after steps 3-4
        assert results[0]["scale"] == 2.0**8 * 2 / 2 * 2
    masters = {k: v for res in results for k, v in res["masters"].items()}
    assert set(masters) == set(want)
    for k in want:  # fp32 main params against the float64 run, to fp32 rounding
        np.testing.assert_allclose(masters[k], want[k], rtol=2e-5, atol=2e-6, err_msg=k)
        if dtype == torch.float16:
            assert np.array_equal(results[0]["params"][k],
                                  torch.from_numpy(masters[k]).half().double().numpy()), k


@pytest.mark.parametrize("opt_name", ["muon", "adafactor"])
def test_state_bytes_per_rank_are_about_one_over_dp_of_the_replicated(opt_name):
    results = run_workers(_train, DP, opt_name, torch.float16)
    replicated = results[0]["replicated_bytes"]
    mine = [r["state_bytes"] for r in results]
    assert sum(mine) == replicated  # every param's masters and state on exactly one rank
    assert max(mine) <= 0.6 * replicated, (mine, replicated)


CKPT_CONFIGS = (("muon", torch.float16), ("adafactor", torch.float32))


def _everything(params, opt):
    masters = {k: _np(v) for k, v in opt.sharded_state_dict(params)["main_params"].items()}
    return {k: _np(p) for k, p in params.items()}, masters, float(opt.get_loss_scale())


def _save_and_continue(rank, world, path):
    out = {}
    for opt_name, dtype in CKPT_CONFIGS:
        params, opt = _build(opt_name, dtype, dist.group.WORLD, clip_grad=0.0)
        _steps(params, opt, rank, world, 0, 3)  # the inf step (2) included
        checkpoint.save_checkpoint(f"{path}/{opt_name}", params, opt, extra={"iteration": 3})
        rest = _steps(params, opt, rank, world, 3, 3)
        out[opt_name] = (rest, *_everything(params, opt))
    return out


def _load_and_continue(rank, world, path, kind):
    out = {}
    for opt_name, dtype in CKPT_CONFIGS:
        group = dist.group.WORLD if kind == "layerwise" else None
        # another init (offset): everything must come from the checkpoint
        params, opt = _build(opt_name, dtype, group, kind=kind, clip_grad=0.0, offset=1.0)
        got = checkpoint.load_checkpoint(f"{path}/{opt_name}", params, opt,
                                         extra={"iteration": None})
        assert got["iteration"] == 3
        rest = _steps(params, opt, rank, world, 3, 3, replicated=kind != "layerwise")
        out[opt_name] = (rest, *_everything(params, opt))
    return out


def test_checkpoint_saved_at_dp2_resumes_at_dp1_dp4_and_replicated_bit_identically(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_workers(_save_and_continue, DP, path)
    runs = {
        "dp1": run_workers(_load_and_continue, 1, path, "layerwise"),
        "dp4": run_workers(_load_and_continue, 4, path, "layerwise"),
        "replicated": run_workers(_load_and_continue, 1, path, "replicated"),
    }
    for opt_name, _ in CKPT_CONFIGS:
        want_rest, want_params, _, want_scale = saved[0][opt_name]
        want_masters = {k: v for res in saved for k, v in res[opt_name][2].items()}
        assert all(r[0] for r in want_rest)
        for run, results in runs.items():
            masters = {k: v for res in results for k, v in res[opt_name][2].items()}
            assert set(masters) == set(want_masters), (opt_name, run)
            for rank, res in enumerate(results):
                rest, params, _, scale = res[opt_name]
                assert scale == want_scale, (opt_name, run)
                for (ok, norm, zeros), (wok, wnorm, wzeros) in zip(rest, want_rest):
                    # the norm is summed over other partitions: equal to fp32 rounding only
                    assert ok == wok and zeros == wzeros and math.isclose(norm, wnorm,
                                                                          rel_tol=1e-6)
                for k in want_params:
                    assert np.array_equal(params[k], want_params[k]), (opt_name, run, rank, k)
            for k in want_masters:
                assert np.array_equal(masters[k], want_masters[k]), (opt_name, run, k)


# -- TP 2 x DP 2: each TP rank holds its shard; TP peers own the same params ------------------

TP_STEPS = 3


def _tp_inner(opt_name, params, tp_group=None):
    if opt_name == "muon" and tp_group is not None:  # the unsharded Muon over TP shards
        return tpamp.TensorParallelMuon(params, lr=0.02, weight_decay=0.1,
                                        tp_mode="duplicated", tensor_parallel_group=tp_group)
    if opt_name == "muon":
        return torch.optim.Muon(params, lr=0.02, weight_decay=0.1)
    if opt_name == "adafactor" and tp_group is not None:
        return tpamp.TensorParallelAdafactor(params, lr=0.01, weight_decay=0.1,
                                             tensor_parallel_group=tp_group)
    if opt_name == "adafactor":
        return torch.optim.Adafactor(params, lr=0.01, weight_decay=0.1)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def _tp_names(opt_name):
    from model_fixture import FULL_MODEL

    return [k for k, (s, _, _) in FULL_MODEL.items() if opt_name != "muon" or len(s) == 2]


def _tp_full(params, st, style):
    """Each param's full value (the TP shards put together), float64 numpy."""
    from model_fixture import FULL_MODEL

    out = {}
    for k, p in params.items():
        kind = FULL_MODEL[k][2]
        if style == "dtensor":
            out[k] = _np(p.full_tensor())
        elif kind == "rep":
            out[k] = _np(p)
        else:
            parts = [torch.empty_like(p.detach()) for _ in range(2)]
            dist.all_gather(parts, p.detach().contiguous(), group=st.tp_group)
            out[k] = _np(torch.cat(parts, dim=0 if kind == "col" else 1))
    return out


def _tp_train(rank, world, style):
    from model_fixture import FULL_MODEL, full_grads, local_slice, shard_params
    from torch.distributed.tensor import DTensor

    from tpamp.parallel import initialize_model_parallel

    st = initialize_model_parallel(2, 1)  # TP 2 x DP 2
    out = {}
    for opt_name in ("adamw", "muon", "adafactor"):
        runs = {}
        for kind in ("layerwise", "replicated"):
            params = shard_params(st, full_grads(0), style=style)
            params = {k: params[k] for k in _tp_names(opt_name)}
            common = dict(clip_grad=1.0, tensor_parallel_group=st.tp_group,
                          log_num_zeros_in_grad=True, param_names=params.items())
            inner = _tp_inner(opt_name, list(params.values()), st.tp_group)
            if kind == "layerwise":
                opt = tpamp.LayerWiseDistributedOptimizer(
                    inner, data_parallel_group=st.dp_group, grad_stats_group=dist.group.WORLD,
                    **common)
            else:  # the replicated wrapper on the DP-mean grads, reduced over TP only
                opt = tpamp.MixedPrecisionOptimizer(inner, grad_stats_group=st.tp_group, **common)
            stats = []
            for step in range(TP_STEPS):
                if kind == "layerwise":
                    g = full_grads(seed=100 * step + st.dp_rank)
                else:
                    gs = [full_grads(seed=100 * step + r) for r in range(2)]
                    g = {k: (gs[0][k] + gs[1][k]) / 2 for k in gs[0]}
                for k, p in params.items():
                    loc = local_slice(g[k], FULL_MODEL[k][2], 2, st.tp_rank).float()
                    p.grad = (DTensor.from_local(loc, st.tp_mesh, p.placements, run_check=False)
                              if style == "dtensor" else loc)
                stats.append(tuple(opt.step()))
                opt.zero_grad()
            runs[kind] = (stats, _tp_full(params, st, style))
            if kind == "layerwise":
                runs["owners"] = opt.owners()
        out[opt_name] = runs
    return out


def _tp_reference(opt_name):
    """float64, one process, the unsharded model: AdamW on the DP-mean grads with the clip."""
    from model_fixture import FULL_MODEL, full_grads

    names = _tp_names(opt_name)
    params = {k: torch.nn.Parameter(torch.randn(
        FULL_MODEL[k][0], generator=torch.Generator().manual_seed(len(k)),
        dtype=torch.float64).float().double()) for k in names}
    init = {k: _np(p) for k, p in params.items()}
    opt = _tp_inner(opt_name, list(params.values()))
    norms = []
    for step in range(TP_STEPS):
        gs = [full_grads(seed=100 * step + r) for r in range(2)]
        grads = {k: (gs[0][k] + gs[1][k]) / 2 for k in names}
        flat = torch.cat([g.reshape(-1) for g in grads.values()])
        norms.append((float(flat.norm()), int((flat == 0).sum())))
        coeff = min(1.0, 1.0 / (norms[-1][0] + 1e-6))
        for k, p in params.items():
            p.grad = grads[k] * coeff
        opt.step()
    return {k: _np(p) for k, p in params.items()}, norms, init


@pytest.mark.parametrize("style", ["megatron", "dtensor"])
def test_tp2_dp2_equals_float64_and_the_replicated_wrapper_under_tp(style):
    """AdamW (elementwise) through the layer-wise optimizer at TP 2 x DP 2 equals the unsharded
    float64 run; Muon (tpamp.TensorParallelMuon, duplicated) and Adafactor
    (tpamp.TensorParallelAdafactor) equal the replicated wrapper at TP 2 on the DP-mean grads
    (layer-wise adds no error over DP) and the unsharded float64 run of torch.optim.Muon (to the
    bf16 rounding of torch's own Newton-Schulz) / torch.optim.Adafactor (to fp32 rounding)."""
    results = run_workers(_tp_train, 4, style)
    for opt_name in ("adamw", "muon", "adafactor"):
        owners = results[0][opt_name]["owners"]
        assert all(r[opt_name]["owners"] == owners for r in results)
        assert set(owners.values()) == {0, 1}
        want, want_stats, want_init = _tp_reference(opt_name)
        for rank, res in enumerate(results):
            stats, params = res[opt_name]["layerwise"]
            for (ok, norm, zeros), (wnorm, wzeros) in zip(stats, want_stats):
                assert ok and zeros == wzeros and math.isclose(norm, wnorm, rel_tol=1e-5), rank
            if opt_name == "adamw":
                for k in want:
                    np.testing.assert_allclose(params[k], want[k], rtol=1e-5, atol=1e-6,
                                               err_msg=f"{style} {rank} {k}")
            else:
                _, replicated = res[opt_name]["replicated"]
                for k in params:
                    np.testing.assert_allclose(params[k], replicated[k], rtol=1e-6, atol=1e-7,
                                               err_msg=f"{style} {rank} {k}")
                    moved = np.linalg.norm(want[k] - want_init[k])
                    err = np.linalg.norm(params[k] - want[k]) / moved
                    # Muon: torch's Newton-Schulz runs in bf16; Adafactor: fp32 rounding
                    assert err < (3e-2 if opt_name == "muon" else 1e-4), (style, rank, k, err)


def _save_one(rank, world, path, opt_name, dtype, kind):
    group = None if kind == "replicated" else dist.group.WORLD
    params, opt = _build(opt_name, dtype, group, kind=kind, clip_grad=0.0)
    _steps(params, opt, rank, world, 0, 3, replicated=kind == "replicated")
    checkpoint.save_checkpoint(path, params, opt)
    rest = _steps(params, opt, rank, world, 3, 3, replicated=kind == "replicated")
    return rest, {k: _np(p) for k, p in params.items()}


def _load_one(rank, world, path, opt_name, dtype, kind):
    group = None if kind == "replicated" else dist.group.WORLD
    params, opt = _build(opt_name, dtype, group, kind=kind, clip_grad=0.0, offset=1.0)
    checkpoint.load_checkpoint(path, params, opt)
    rest = _steps(params, opt, rank, world, 3, 3, replicated=kind == "replicated")
    return rest, {k: _np(p) for k, p in params.items()}


@pytest.mark.parametrize("opt_name,dtype,saver,loader", [
    ("muon", torch.float16, "replicated", "layerwise"),
    ("adamw", torch.float16, "layerwise", "distributed"),
], ids=["replicated-to-layerwise", "layerwise-to-distributed"])
def test_checkpoint_moves_between_layerwise_and_the_other_wrappers(tmp_path, opt_name, dtype,
                                                                   saver, loader):
    path = str(tmp_path / "ckpt")
    want_rest, want = run_workers(_save_one, 1 if saver == "replicated" else DP, path, opt_name,
                                  dtype, saver)[0]
    for rest, params in run_workers(_load_one, DP, path, opt_name, dtype, loader):
        assert [r[0] for r in rest] == [r[0] for r in want_rest] == [True] * 3
        for k in want:  # the same DP-mean grads from the same state: the same params
            assert np.array_equal(params[k], want[k]), k


# -- misuse: clear errors, nothing changed -----------------------------------------------------


def _misuse(rank, world):
    out = {}
    params = {k: torch.nn.Parameter(v) for k, v in _values(MATRICES, torch.float16).items()}
    inner = _inner("muon", list(params.values()))
    before = [list(g["params"]) for g in inner.param_groups]
    for name, kw in (("no_dp_group", dict(data_parallel_group=None)),
                     ("no_scaler", dict(data_parallel_group=dist.group.WORLD))):
        try:
            tpamp.LayerWiseDistributedOptimizer(inner, **kw)
        except ValueError as e:
            out[name] = str(e)
    # a refused construction leaves the inner optimizer's groups as they were
    out["groups_restored"] = [list(g["params"]) for g in inner.param_groups] == before
    try:
        tpamp.LayerWiseDistributedOptimizer("sgd", data_parallel_group=dist.group.WORLD)
    except TypeError as e:
        out["not_an_optimizer"] = str(e)
    other = {k: torch.nn.Parameter(v.float() + (rank if k == "w3" else 0))
             for k, v in _values(MATRICES, torch.float16).items()}
    try:  # DP ranks that start from different params
        tpamp.LayerWiseDistributedOptimizer(_inner("muon", list(other.values())),
                                            data_parallel_group=dist.group.WORLD,
                                            param_names=other.items())
    except ValueError as e:
        out["params_differ"] = str(e)
    # a param that no DP rank has a grad for is not stepped and gets no state (section 2)
    p32, opt = _build("muon", torch.float32, dist.group.WORLD)
    w5 = p32["w5"].detach().clone()
    _feed(p32, opt, rank, world, 0)
    p32["w5"].grad = None
    assert opt.step().update_successful
    out["untouched"] = torch.equal(p32["w5"], w5) and p32["w5"] not in opt.optimizer.state
    opt.zero_grad()
    # a state_dict resumes on its own layout only: rank 0's dict on rank 1 is refused on every rank
    _steps(p32, opt, rank, world, 1, 1)
    sd = opt.state_dict()
    assert sd["layout"]["dp_rank"] == rank
    mine = [None, None]
    dist.all_gather_object(mine, sd)
    opt.load_state_dict(mine[rank])  # its own: loads
    try:
        opt.load_state_dict(mine[1 - rank])
    except ValueError as e:
        out["other_layout"] = str(e)
    return out


def test_bad_arguments_and_another_layouts_state_dict_are_clear_errors():
    for rank, out in enumerate(run_workers(_misuse, DP)):
        assert "data_parallel_group" in out["no_dp_group"], out
        assert "loss scaler" in out["no_scaler"], out
        assert out["groups_restored"] and out["untouched"]
        assert "torch.optim.Optimizer" in out["not_an_optimizer"]
        assert "first differing param is 'w3'" in out["params_differ"], out
        assert "layout" in out["other_layout"] or "refused on rank" in out["other_layout"], out


# -- PP 2 x DP 2: each stage's DP group owns its own params; the tied embedding summed first --


def _pp_train(rank, world):
    from model_fixture import full_grads, shard_params

    from tpamp.parallel import initialize_model_parallel

    st = initialize_model_parallel(1, 2)  # PP 2 x DP 2
    params = shard_params(st, full_grads(0), style="megatron")
    opt = tpamp.LayerWiseDistributedOptimizer(
        torch.optim.AdamW(list(params.values()), lr=0.01, weight_decay=0.1),
        data_parallel_group=st.dp_group, grad_stats_group=dist.group.WORLD, clip_grad=1.0,
        log_num_zeros_in_grad=True, param_names=params.items())
    stats = []
    for step in range(TP_STEPS):
        g = full_grads(seed=100 * step + st.dp_rank)
        for k, p in params.items():
            p.grad = g["embed" if k == "head" else k].float().clone()
        tied = params.get("embed", params.get("head"))
        if st.embedding_group is not None and tied is not None:  # as scripts/train_gpt.py
            dist.all_reduce(tied.grad, group=st.embedding_group)
        stats.append(tuple(opt.step()))
        opt.zero_grad()
    return st.pp_rank, stats, {k: _np(p) for k, p in params.items()}


def test_pp2_dp2_equals_float64_with_the_tied_embedding_summed_before_the_step():
    from model_fixture import FULL_MODEL, full_grads

    params = {k: torch.nn.Parameter(torch.randn(
        s, generator=torch.Generator().manual_seed(len(k)), dtype=torch.float64).float().double())
        for k, (s, _, _) in FULL_MODEL.items()}
    ref = torch.optim.AdamW(list(params.values()), lr=0.01, weight_decay=0.1)
    want_stats = []
    for step in range(TP_STEPS):
        gs = [full_grads(seed=100 * step + r) for r in range(2)]
        grads = {k: (gs[0][k] + gs[1][k]) / 2 for k in FULL_MODEL}
        grads["embed"] = grads["embed"] * 2  # the embedding and its tied head copy
        flat = torch.cat([g.reshape(-1) for g in grads.values()])
        want_stats.append((float(flat.norm()), int((flat == 0).sum())))
        coeff = min(1.0, 1.0 / (want_stats[-1][0] + 1e-6))
        for k, p in params.items():
            p.grad = grads[k] * coeff
        ref.step()
    for pp_rank, stats, got in run_workers(_pp_train, 4):
        for (ok, norm, zeros), (wnorm, wzeros) in zip(stats, want_stats):
            assert ok and zeros == wzeros and math.isclose(norm, wnorm, rel_tol=1e-5), pp_rank
        for k, v in got.items():
            np.testing.assert_allclose(v, _np(params["embed" if k == "head" else k]),
                                       rtol=1e-5, atol=1e-6, err_msg=f"{pp_rank} {k}")


# -- per-rank differences and layouts that parallel_state refuses (docs/spec.md sections 2.4, 19) --


def _peer_misuse(rank, world):
    from dist_utils import freeze, tensor_bytes

    from tpamp.parallel import initialize_model_parallel

    out = {}
    # the inner optimizer's lr per DP rank: the owners would step with two lrs and broadcast
    # a model that mixes both; refused at the first step on every rank, nothing changed
    params = {k: torch.nn.Parameter(v) for k, v in _values(MATRICES, torch.float32).items()}
    inner = torch.optim.Muon(list(params.values()), lr=0.02 if rank == 0 else 0.04)
    opt = tpamp.LayerWiseDistributedOptimizer(inner, data_parallel_group=dist.group.WORLD)
    _feed(params, opt, rank, world, 0)

    def picture():
        return [tensor_bytes(p) for p in params.values()], freeze(opt.state_dict())

    before = picture()
    try:
        opt.step()
        out["lr"] = (None, "", False)
    except Exception as e:
        out["lr"] = (type(e).__name__, str(e), picture() == before)
    # under cp = 2 the DP group alone never sums the CP ranks' grads: refused at construction
    st = initialize_model_parallel(1, 1, context_parallel_size=2)
    params = {k: torch.nn.Parameter(v) for k, v in _values(MATRICES, torch.float32).items()}
    inner = _inner("muon", list(params.values()))
    try:
        tpamp.LayerWiseDistributedOptimizer(inner, data_parallel_group=st.dp_group,
                                            parallel_state=st)
        out["cp"] = (None, "")
    except Exception as e:
        out["cp"] = (type(e).__name__, str(e))
    out["cp_untouched"] = len(inner.param_groups[0]["params"]) == len(MATRICES)
    return out


def test_a_per_rank_lr_and_a_dp_group_without_the_cp_ranks_are_refused():
    msgs = []
    for rank, out in enumerate(run_workers(_peer_misuse, DP)):
        kind, msg, unchanged = out["lr"]
        assert kind == "ValueError", (rank, kind, msg)
        for word in ("'lr'", "data-parallel", "rank 0: 0.02", "rank 1: 0.04"):
            assert word in msg, (word, msg)
        assert unchanged, f"rank {rank}: the refused step changed state"
        msgs.append(msg)
        kind, msg = out["cp"]
        assert kind == "ValueError", (rank, kind, msg)
        assert "parallel_state.dp_cp_group" in msg and "cp = 2" in msg, msg
        assert out["cp_untouched"]
    assert msgs[0] == msgs[1]
