"""Checkpoints written by an earlier tpamp still load (tests/fixtures, rebuilt by
tests/fixtures/make_checkpoint_fixtures.py): every value a load gives is compared with the
plain numbers recorded beside the checkpoint when it was written."""

import json
import os
import shutil

import pytest
import torch

import tpamp
from tpamp.checkpoint import load_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
GROUPS = [["w", "v"], ["b"]]  # the param groups' names, in the inner optimizer's order


def _fixture(name, tmp_path):
    """(a copy of the checkpoint directory, its record)."""
    path = str(tmp_path / name)
    shutil.copytree(os.path.join(FIXTURES, name), path)
    with open(os.path.join(FIXTURES, name + ".json")) as f:
        return path, json.load(f)


def _fresh(rec, fp32_names=()):
    """Params of other values and a fresh optimizer of the recorded kind: everything compared
    below must come from the checkpoint."""
    params = {}
    for n, shape in rec["shapes"].items():
        dtype = torch.float32 if n in fp32_names else torch.float16
        params[n] = torch.nn.Parameter(torch.full(shape, 0.25, dtype=dtype))
    inner = torch.optim.AdamW([{"params": [params[n] for n in GROUPS[0]]},
                               {"params": [params["b"]], "weight_decay": 0.0, "lr": 5e-3}],
                              lr=1e-2)
    scaler = tpamp.DynamicGradScaler(initial_scale=2.0**8, growth_interval=1, hysteresis=2)
    return params, tpamp.MixedPrecisionOptimizer(inner, grad_scaler=scaler)


def _want(values, shape, dtype=torch.float32):
    return torch.tensor(values, dtype=torch.float64).to(dtype).view(shape)


def _check(params, opt, rec, extra, fp32_names=()):
    shapes = rec["shapes"]
    for n, p in params.items():
        want = _want(rec["model"][n]["values"], shapes[n], p.dtype)
        assert str(p.dtype) == rec["model"][n]["dtype"], n
        assert torch.equal(p.detach(), want), n
    sd = opt.state_dict()
    half = [[n for n in g if n not in fp32_names] for g in GROUPS]
    mains = {n: m for names, ms in zip(half, sd["fp32_from_fp16_params"])
             for n, m in zip(names, ms)}
    mains.update({n: params[n].detach() for n in fp32_names})
    assert sorted(mains) == sorted(rec["main"])
    for n, m in mains.items():
        assert m.dtype == torch.float32 and torch.equal(m, _want(rec["main"][n], shapes[n])), n
    order = [n for g in GROUPS for n in g]
    state = {order[i]: st for i, st in sd["optimizer"]["state"].items()}
    assert sorted(state) == sorted(rec["state"])
    for n, st in state.items():
        want = rec["state"][n]
        assert float(st["step"]) == want["step"], n
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(st[k].float(), _want(want[k], shapes[n])), (n, k)
    groups = sd["optimizer"]["param_groups"]
    assert [{"lr": g["lr"], "weight_decay": g["weight_decay"]} for g in groups] == rec["groups"]
    assert float(opt.get_loss_scale()) == rec["scaler"]["scale"]
    assert opt.grad_scaler.growth_tracker == rec["scaler"]["growth_tracker"]
    assert opt.grad_scaler.hysteresis_tracker == rec["scaler"]["hysteresis_tracker"]
    assert extra == rec["extra"]


def test_mixed_precision_fp16_checkpoint_of_an_earlier_version_loads(tmp_path):
    path, rec = _fixture("mpo_fp16", tmp_path)
    params, opt = _fresh(rec, fp32_names=("v",))
    extra = load_checkpoint(path, params, opt, extra={"iteration": None})
    _check(params, opt, rec, extra, fp32_names=("v",))
    # and it trains on from there
    for p in params.values():
        p.grad = torch.ones_like(p) * float(opt.get_loss_scale())
    assert opt.step().update_successful


def test_distributed_optimizer_dp2_checkpoint_of_an_earlier_version_loads_in_one_process(tmp_path):
    path, rec = _fixture("dist_dp2", tmp_path)
    params, opt = _fresh(rec)
    extra = load_checkpoint(path, params, opt, extra={"iteration": None})
    _check(params, opt, rec, extra)


def test_fixture_records_are_not_the_fresh_values(tmp_path):
    """The comparison above can fail: a fresh optimizer differs from every record."""
    for name, fp32 in (("mpo_fp16", ("v",)), ("dist_dp2", ())):
        _, rec = _fixture(name, tmp_path / name)
        params, opt = _fresh(rec, fp32)
        with pytest.raises(AssertionError):
            _check(params, opt, rec, {"iteration": 2}, fp32)


def _load_dp2_worker(rank, world, path, rec):
    import torch.distributed as dist

    params = {n: torch.nn.Parameter(torch.full(s, 0.25, dtype=torch.float16))
              for n, s in rec["shapes"].items()}
    inner = torch.optim.AdamW([{"params": [params[n] for n in GROUPS[0]]},
                               {"params": [params["b"]], "weight_decay": 0.0, "lr": 5e-3}],
                              lr=1e-2)
    scaler = tpamp.DynamicGradScaler(initial_scale=2.0**8, growth_interval=1, hysteresis=2)
    opt = tpamp.DistributedOptimizer(inner, grad_scaler=scaler,
                                     data_parallel_group=dist.group.WORLD, bucket_size=8)
    extra = load_checkpoint(path, params, opt, extra={"iteration": None})
    assert extra == rec["extra"]
    for n, p in params.items():
        assert torch.equal(p.detach(), _want(rec["model"][n]["values"], rec["shapes"][n],
                                             torch.float16)), n
    # this rank's shard of every master and moment, box by box, against the recorded values
    sd = opt.sharded_state_dict(params)
    boxes = 0
    for n, view in sd["main_params"].items():
        full = {"main": _want(rec["main"][n], rec["shapes"][n])}
        for k in ("exp_avg", "exp_avg_sq"):
            full[k] = _want(rec["state"][n][k], rec["shapes"][n])
        for what, t in [("main", view)] + [(k, sd["state"][n][k]) for k in ("exp_avg", "exp_avg_sq")]:
            for s in t.local_shards():
                box = tuple(slice(o, o + z) for o, z in zip(s.metadata.shard_offsets,
                                                             s.metadata.shard_sizes))
                assert torch.equal(s.tensor.float(), full[what][box]), (n, what)
                boxes += 1
        assert float(sd["state"][n]["step"]) == rec["state"][n]["step"], n
    assert float(opt.get_loss_scale()) == rec["scaler"]["scale"]
    assert opt.grad_scaler.growth_tracker == rec["scaler"]["growth_tracker"]
    return boxes


def test_distributed_optimizer_dp2_checkpoint_of_an_earlier_version_loads_on_dp2(tmp_path):
    from dist_utils import run_workers

    path, rec = _fixture("dist_dp2", tmp_path)
    boxes = run_workers(_load_dp2_worker, 2, path, rec, timeout=60)
    assert all(b > 0 for b in boxes)  # every rank compared its own shards
