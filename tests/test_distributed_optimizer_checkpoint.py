"""DistributedOptimizer checkpoints through tpamp.checkpoint (torch.distributed.checkpoint, keyed
by global names): saved on DP=2, they load with or without the distributed optimizer, on DP=1 or
DP=2, and the run continues; on the same layout bit-identically."""

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
from dist_utils import run_workers
from model_fixture import FULL_MODEL, full_grads, shard_params
from test_distributed_optimizer import EPS, SHAPES, _grad, _groups, _np, _values

import tpamp
from tpamp.parallel import initialize_model_parallel

checkpoint = pytest.importorskip("tpamp.checkpoint")

VIRTUAL_DP = 2  # the saving run's DP size; a DP=1 run feeds the mean of both ranks' grads


def _build(kind, dtype, offset):
    params = {k: torch.nn.Parameter(v.clone() + offset) for k, v in _values(dtype).items()}
    scaler = tpamp.DynamicGradScaler(initial_scale=2.0**8, hysteresis=1, growth_interval=2)
    kw = dict(grad_scaler=scaler, clip_grad=4.0, log_num_zeros_in_grad=True)
    adamw = torch.optim.AdamW(_groups(params), lr=1e-2)
    if kind == "dist":
        opt = tpamp.DistributedOptimizer(adamw, data_parallel_group=dist.group.WORLD,
                                         bucket_size=40, **kw)
    else:
        opt = tpamp.MixedPrecisionOptimizer(adamw, **kw)
    return params, opt


def _steps(params, opt, kind, rank, world, start, n, inf_step=4):
    out = []
    for step in range(start, start + n):
        scale = float(opt.get_loss_scale())
        per = VIRTUAL_DP // world  # the saving run's ranks whose grads this rank stands for
        mine = range(VIRTUAL_DP) if kind == "mpo" else range(rank * per, (rank + 1) * per)
        for k, p in params.items():
            g = sum(_grad(k, SHAPES[k], r, step) for r in mine) / len(mine) * scale
            if step == inf_step and k == "w1":
                g[0, 0] = math.inf
            if kind == "dist":
                p.grad = g.to(p.dtype)  # this DP rank's local grad (exact in fp16)
            else:
                p.main_grad = g.float()  # the DP mean, as a hand all-reduce gives it
        out.append(tuple(opt.step()))
        opt.zero_grad()
    return out


def _save_and_continue(rank, world, path):
    params, opt = _build("dist", torch.float16, 0.0)
    first = _steps(params, opt, "dist", rank, world, 0, 3)
    checkpoint.save_checkpoint(path, params, opt, extra={"iteration": 3})
    rest = _steps(params, opt, "dist", rank, world, 3, 3)
    return first, rest, {k: _np(p) for k, p in params.items()}, float(opt.get_loss_scale())


def _load_and_continue(rank, world, path, kinds):
    out = {}
    for kind in kinds:
        params, opt = _build(kind, torch.float16, 1.0)  # another init: all must come from disk
        got = checkpoint.load_checkpoint(path, params, opt, extra={"iteration": None})
        assert got["iteration"] == 3
        rest = _steps(params, opt, kind, rank, world, 3, 3)
        out[kind] = rest, {k: _np(p) for k, p in params.items()}, float(opt.get_loss_scale())
    return out


def test_saved_on_dp2_loads_on_dp1_or_dp2_with_or_without_the_distributed_optimizer(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_workers(_save_and_continue, 2, path)
    first, want_rest, want, want_scale = saved[0]
    assert [r[0] for r in want_rest] == [True, False, True]  # the continuation skips a step
    same_layout = run_workers(_load_and_continue, 2, path, ("dist", "mpo"))
    other = run_workers(_load_and_continue, 1, path, ("dist", "mpo"))
    for rank, res in enumerate(same_layout):  # same layout: bit-identical
        rest, params, scale = res["dist"]
        assert rest == want_rest and scale == want_scale, rank
        assert all(np.array_equal(params[k], saved[rank][2][k]) for k in SHAPES), rank
    for res in same_layout + other:
        for kind, (rest, params, scale) in res.items():
            assert [r[0] for r in rest] == [r[0] for r in want_rest], kind
            assert scale == want_scale
            for (ok, norm, zeros), (_, wnorm, wzeros) in zip(rest, want_rest):
                if ok:
                    assert math.isclose(norm, wnorm, rel_tol=1e-6) and zeros == wzeros, kind
            for k in SHAPES:  # within one ulp of fp16 (the norm's summation order differs)
                torch.testing.assert_close(torch.from_numpy(params[k]), torch.from_numpy(want[k]),
                                           rtol=EPS[torch.float16], atol=1e-30)


def _save_tp_dp(rank, world, path):
    st = initialize_model_parallel(2, 1)  # TP 2 x DP 2
    for style in STYLES:
        params = shard_params(st, full_grads(seed=0), style=style, dtype=torch.bfloat16)
        opt = tpamp.DistributedOptimizer(
            torch.optim.AdamW(list(params.values()), lr=1e-2), data_parallel_group=st.dp_group,
            grad_stats_group=dist.group.WORLD, tensor_parallel_group=st.tp_group, bucket_size=50)
        checkpoint.save_checkpoint(f"{path}/{style}", params, opt)


def _load_full(rank, world, path):
    """The main params as full fp32 tensors, read by DCP itself in one process."""
    import torch.distributed.checkpoint as dcp

    out = {}
    for style in STYLES:
        sd = {f"optimizer.main_params.{k}": torch.zeros(s) for k, (s, _, _) in FULL_MODEL.items()}
        dcp.load(sd, storage_reader=dcp.FileSystemReader(f"{path}/{style}"))
        out[style] = {k[len("optimizer.main_params."):]: _np(v) for k, v in sd.items()}
    return out


STYLES = ("dtensor", "megatron")


def test_tp2_dp2_shards_load_as_full_tensors_in_one_process(tmp_path):
    """Every TP x DP box lands at its global offset (DP flat ranges inside Shard(0)/Shard(1)
    TP shards), checked against the fixture's seeded full values."""
    path = str(tmp_path / "ckpt")
    run_workers(_save_tp_dp, 4, path)
    [loaded] = run_workers(_load_full, 1, path)
    for style, mains in loaded.items():
        for name, (shape, _, _) in FULL_MODEL.items():
            g = torch.Generator().manual_seed(len(name))
            want = torch.randn(shape, generator=g, dtype=torch.float64).to(torch.bfloat16)
            assert np.array_equal(mains[name], want.double().numpy()), (style, name)
