"""tpamp.checkpoint: the mixed-precision state through torch.distributed.checkpoint by global
names; all-or-nothing loading; flat ranges of params (a DP-sharded optimizer's shards)."""

from __future__ import annotations

import copy
import itertools
import math
import os

import pytest
import torch
import torch.distributed as dist

import tpamp
from tests.dist_utils import run_workers
from tpamp.checkpoint import (
    CheckpointError,
    flat_range_chunks,
    iteration_dir,
    load_checkpoint,
    read_latest_iteration,
    save_checkpoint,
    sharded_tensor_from_chunks,
    write_latest_iteration,
)

# ----------------------------------------------------------------------------- one process


def _model(seed=0, shapes=None):
    """{name: fp16 param}: a plain layout, seeded."""
    shapes = shapes or {"w": (4, 4), "b": (4,), "v": (3, 4)}
    g = torch.Generator().manual_seed(seed)
    return {
        n: torch.nn.Parameter((torch.randn(s, generator=g) * 0.5).half()) for n, s in shapes.items()
    }


def _optimizer(params, scaler=None):
    ps = list(params.values())
    inner = torch.optim.AdamW(
        [{"params": [p for p in ps if p.dim() >= 2]}, {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}],
        lr=1e-2,
    )
    scaler = scaler or tpamp.DynamicGradScaler(initial_scale=2.0**8, growth_interval=2, hysteresis=2)
    return tpamp.MixedPrecisionOptimizer(inner, grad_scaler=scaler)


def _step(params, opt, seed):
    g = torch.Generator().manual_seed(1000 + seed)
    for p in params.values():
        p.grad = (torch.randn(p.shape, generator=g) * float(opt.get_loss_scale())).to(p.dtype)
    result = opt.step()
    opt.zero_grad()
    return result


def _snapshot(params, opt):
    """Everything a load may change, as CPU copies."""
    sd = opt.state_dict()
    return (
        {n: p.detach().clone() for n, p in params.items()},
        [[m.clone() for m in g] for g in sd["fp32_from_fp16_params"]],
        {i: {k: v.clone() for k, v in s.items()} for i, s in sd["optimizer"]["state"].items()},
        [dict(g) for g in sd["optimizer"]["param_groups"]],
        sd["grad_scaler"],
    )


def _assert_same(a, b):
    pa, ma, sa, ga, ca = a
    pb, mb, sb, gb, cb = b
    assert pa.keys() == pb.keys() and all(torch.equal(pa[n], pb[n]) for n in pa)
    assert all(torch.equal(x, y) for gx, gy in zip(ma, mb) for x, y in zip(gx, gy))
    assert sa.keys() == sb.keys()
    for i in sa:
        assert sa[i].keys() == sb[i].keys() and all(torch.equal(sa[i][k], sb[i][k]) for k in sa[i])
    assert ga == gb
    assert ca.keys() == cb.keys()
    for k in ca:
        assert torch.equal(ca[k], cb[k]) if isinstance(ca[k], torch.Tensor) else ca[k] == cb[k], k


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint after 3 steps, and the run continued 3 more steps from it."""
    path = str(tmp_path_factory.mktemp("one") / "ckpt")
    params = _model()
    opt = _optimizer(params)
    for s in range(3):
        _step(params, opt, s)
    save_checkpoint(path, params, opt, extra={"iteration": 3, "note": {"a": [1, 2]}})
    after = [_step(params, opt, s) for s in range(3, 6)]
    return path, _snapshot(params, opt), after


def test_resume_in_one_process_is_bit_identical(saved):
    path, want, want_results = saved
    params = _model(seed=9)  # other weights: all must come from the checkpoint
    opt = _optimizer(params)
    extra = load_checkpoint(path, params, opt, extra={"iteration": None, "note": None})
    assert extra == {"iteration": 3, "note": {"a": [1, 2]}}
    assert opt.grad_scaler.growth_tracker == 1  # 3 clean steps, growth interval 2
    results = [_step(params, opt, s) for s in range(3, 6)]
    assert results == want_results
    _assert_same(_snapshot(params, opt), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resume_without_a_loss_scaler_is_bit_identical(tmp_path, dtype):
    """fp32 (FP32Optimizer: the params are their own masters) and bf16 (no scaler)."""
    wrap = tpamp.FP32Optimizer if dtype == torch.float32 else tpamp.MixedPrecisionOptimizer

    def build(seed):
        params = {n: torch.nn.Parameter(p.detach().to(dtype)) for n, p in _model(seed).items()}
        return params, wrap(torch.optim.AdamW(list(params.values()), lr=1e-2))

    params, opt = build(0)
    _step(params, opt, 0)
    save_checkpoint(str(tmp_path), params, opt)
    want = [_step(params, opt, s) for s in (1, 2)]
    params2, opt2 = build(7)
    load_checkpoint(str(tmp_path), params2, opt2)
    assert [_step(params2, opt2, s) for s in (1, 2)] == want
    assert all(torch.equal(params[n], params2[n]) for n in params)


def _fault_cases():
    def more_params(path):
        return _model(shapes={"w": (4, 4), "b": (4,), "v": (3, 4), "u": (2,)}), None

    def other_shape(path):
        return _model(shapes={"w": (4, 5), "b": (4,), "v": (3, 4)}), None

    def fewer_params(path):
        return _model(shapes={"w": (4, 4), "b": (4,)}), None

    def constant_scaler(path):
        p = _model()
        return p, _optimizer(p, tpamp.ConstantGradScaler(2.0**8))

    def one_param_group(path):
        p = _model()
        return p, tpamp.MixedPrecisionOptimizer(
            torch.optim.AdamW(list(p.values())), grad_scaler=tpamp.DynamicGradScaler(2.0**8)
        )

    return [
        (more_params, "has no 'model.u'"),
        (other_shape, "has shape (4, 4) in the checkpoint, expected (4, 5)"),
        (fewer_params, "params this model does not have"),
        (constant_scaler, "loss scaler state has keys"),
        (one_param_group, "the checkpoint has 2 param groups, the optimizer has 1"),
    ]


@pytest.mark.parametrize("build, message", _fault_cases(), ids=lambda x: getattr(x, "__name__", ""))
def test_a_checkpoint_that_does_not_fit_is_refused_and_nothing_changes(saved, build, message):
    path = saved[0]
    params, opt = build(path)
    opt = opt or _optimizer(params)
    _step(params, opt, 0)  # live state that must survive the refusal
    before = _snapshot(params, opt)
    with pytest.raises(CheckpointError, match="nothing was changed") as e:
        load_checkpoint(path, params, opt, extra={"iteration": None})
    assert message in str(e.value)
    _assert_same(_snapshot(params, opt), before)


@pytest.mark.parametrize("fault", ["nan_main", "zero_scale", "torn"])
def test_bad_values_are_refused_after_reading_and_nothing_changes(tmp_path, fault):
    params = _model()
    opt = _optimizer(params)
    _step(params, opt, 0)
    path = str(tmp_path / "bad")
    if fault == "nan_main":
        opt.param_groups[0]["params"][0].data[1, 2] = float("nan")
    if fault == "zero_scale":
        opt.grad_scaler._scale.fill_(0.0)
    save_checkpoint(path, params, opt)
    if fault == "torn":  # a crash before .metadata was written
        os.remove(os.path.join(path, ".metadata"))
    params2 = _model(seed=3)
    opt2 = _optimizer(params2)
    _step(params2, opt2, 1)
    before = _snapshot(params2, opt2)
    message = {
        "nan_main": "main param 'w' holds inf/nan",
        "zero_scale": "the loss scaler refuses the saved state",
        "torn": "no readable DCP checkpoint",
    }[fault]
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path, params2, opt2)
    _assert_same(_snapshot(params2, opt2), before)


def test_the_spike_detector_state_comes_back_or_is_refused_whole(tmp_path):
    params = _model()
    opt = _optimizer(params)
    opt.spike_detector = tpamp.SpikeDetector(policy="skip", window=4, warmup=2)
    _step(params, opt, 0)
    _step(params, opt, 1)
    saved_state = copy.deepcopy(opt.spike_detector.state_dict())
    assert saved_state["steps_seen"] == 2 and len(saved_state["windows"]["grad_norm"]) == 2
    save_checkpoint(str(tmp_path), params, opt)
    params2 = _model(seed=5)
    opt2 = _optimizer(params2)
    opt2.spike_detector = tpamp.SpikeDetector(policy="skip", window=4, warmup=2)
    load_checkpoint(str(tmp_path), params2, opt2)
    assert opt2.spike_detector.state_dict() == saved_state

    params3 = _model(seed=6)
    opt3 = _optimizer(params3)
    opt3.spike_detector = tpamp.SpikeDetector(policy="skip", window=8, warmup=2)
    before = _snapshot(params3, opt3)
    with pytest.raises(CheckpointError, match="spike detector refuses the saved state.*settings differ"):
        load_checkpoint(str(tmp_path), params3, opt3)
    _assert_same(_snapshot(params3, opt3), before)
    assert opt3.spike_detector.steps_seen == 0


def test_megatron_state_dict_still_round_trips(saved):
    params = _model()
    opt = _optimizer(params)
    for s in range(2):
        _step(params, opt, s)
    params2 = _model(seed=4)
    opt2 = _optimizer(params2)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))  # as if through torch.save/load
    assert [_step(params, opt, 5)] == [_step(params2, opt2, 5)]
    assert all(torch.equal(params[n], params2[n]) for n in params)


def test_iteration_directories_and_tracker(tmp_path):
    root = str(tmp_path)
    assert read_latest_iteration(root) is None
    assert iteration_dir(root, 120) == os.path.join(root, "iter_0000120")
    with pytest.raises(ValueError, match="iter_0000120 is not a saved checkpoint"):
        write_latest_iteration(root, 120)  # the marker names complete checkpoints only
    assert read_latest_iteration(root) is None
    save_checkpoint(iteration_dir(root, 120), _model())
    write_latest_iteration(root, 120)
    assert read_latest_iteration(root) == 120
    with pytest.raises(ValueError, match="iteration must be an int >= 0, got -1"):
        iteration_dir(root, -1)
    open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w").write("x\n")
    with pytest.raises(ValueError, match="holds 'x'"):
        read_latest_iteration(root)


@pytest.mark.parametrize("shape", [(5, 3), (2, 3, 4), (7,), (1, 1, 5), (3, 1, 2)])
def test_flat_range_chunks_tile_the_range_with_contiguous_boxes(shape):
    numel = math.prod(shape)
    index = torch.arange(numel).reshape(shape)  # row-major flat index of every element
    for start, end in itertools.combinations_with_replacement(range(numel + 1), 2):
        boxes = flat_range_chunks(shape, start, end)
        assert len(boxes) <= 2 * len(shape) - 1 or start == end
        covered = []
        for offsets, sizes, flat in boxes:
            sl = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
            flat_ids = index[sl].reshape(-1).tolist()
            assert flat_ids == list(range(flat, flat + math.prod(sizes))), (start, end, offsets, sizes)
            covered += flat_ids
        assert covered == list(range(start, end)), (shape, start, end, boxes)
    with pytest.raises(ValueError, match=r"flat range \[3, 99\)"):
        flat_range_chunks(shape, 3, 99)


# ----------------------------------------------------------------------------- four ranks

H = 4


def _full(name, seed):
    shapes = {"col": (6, H), "row": (H, 6), "meg": (8, 3), "bias": (3,)}
    g = torch.Generator().manual_seed(seed * 100 + sorted(shapes).index(name))
    return torch.randn(shapes[name], generator=g)


def _four_rank_worker(rank, world, path):
    """TP 2 x DP 2: DTensor Shard(0)/Shard(1) params, a Megatron-attribute param split on dim
    0, a replicated bias; 2 fp16 steps; save; return the full tensors (from torch's own
    DTensor.full_tensor and all_gather) as the reference."""
    from torch.distributed.tensor import Shard, distribute_tensor

    st = tpamp.parallel.initialize_model_parallel(2, 1)
    mesh, tp = st.tp_mesh, st.tp_rank

    def make(name, full):
        if name == "col":
            return distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)
        if name == "row":
            return distribute_tensor(full, mesh, [Shard(1)], src_data_rank=None)
        if name == "meg":
            return full[tp * 4:(tp + 1) * 4].clone()
        return full

    params = {}
    for n in ("col", "row", "meg", "bias"):
        params[n] = torch.nn.Parameter(make(n, _full(n, 0).half()))
    params["meg"].tensor_model_parallel, params["meg"].partition_dim = True, 0
    params["meg"].partition_stride = 1
    opt = tpamp.MixedPrecisionOptimizer(
        torch.optim.AdamW(list(params.values()), lr=1e-2),
        grad_scaler=tpamp.DynamicGradScaler(initial_scale=2.0**8, growth_interval=1),
        grad_stats_group=st.model_parallel_group, tensor_parallel_group=st.tp_group,
    )
    for s in (1, 2):  # DP replicas get the same grads, so they stay replicas
        for n, p in params.items():
            p.grad = make(n, (_full(n, s) * float(opt.get_loss_scale())).half())
        assert opt.step().update_successful
        opt.zero_grad()
    # a DP-sharded optimizer's view of a [5, 3] param: uneven flat ranges, one per rank
    lo, hi = [0, 4, 5, 11, 15][rank:rank + 2]
    flat = torch.arange(15.0)[lo:hi].clone()  # this rank's shard buffer
    pieces = [
        (flat[f - lo:f - lo + math.prod(sz)].view(sz), off)
        for off, sz, f in flat_range_chunks((5, 3), lo, hi)
    ]
    flat_st = sharded_tensor_from_chunks(pieces, (5, 3))
    save_checkpoint(path, params, opt, extra={"iteration": 2, "flat": flat_st})
    # the same ranges read back on 4 ranks, into a new sharded tensor laid out like flat_st
    back = load_checkpoint(path, params, opt, extra={"flat": flat_st})["flat"]
    assert [s.metadata for s in back.local_shards()] == [s.metadata for s in flat_st.local_shards()]
    assert all(torch.equal(a.tensor, b.tensor) for a, b in zip(back.local_shards(), flat_st.local_shards()))
    assert back.local_shards()[0].tensor.data_ptr() != flat_st.local_shards()[0].tensor.data_ptr()

    def full_of(t, name):
        if hasattr(t, "full_tensor"):
            return t.full_tensor()
        if name == "meg":
            parts = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(parts, t.contiguous(), group=st.tp_group)
            return torch.cat(parts, 0)
        return t

    mains = dict(zip(params, opt.param_groups[0]["params"]))
    out = {"params": {n: full_of(p.detach(), n) for n, p in params.items()}, "mains": {}, "state": {}}
    for n, m in mains.items():
        out["mains"][n] = full_of(m.detach(), n)
        s = opt.state[m]
        out["state"][n] = {k: full_of(v, n) if v.dim() else v.clone() for k, v in s.items()}
    out["scaler"] = opt.grad_scaler.state_dict()
    return out


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process: meant
def test_a_four_rank_checkpoint_loads_in_one_process(tmp_path):
    path = str(tmp_path / "ckpt4")
    ref = run_workers(_four_rank_worker, 4, path, timeout=60)[0]
    assert not dist.is_initialized()
    params = {n: torch.nn.Parameter(torch.zeros_like(_full(n, 0)).half()) for n in ("col", "row", "meg", "bias")}
    opt = tpamp.MixedPrecisionOptimizer(
        torch.optim.AdamW(list(params.values()), lr=1e-2),
        grad_scaler=tpamp.DynamicGradScaler(initial_scale=1.0, growth_interval=1),
    )
    extra = load_checkpoint(path, params, opt, extra={"iteration": None, "flat": None})
    assert extra["iteration"] == 2
    assert torch.equal(extra["flat"], torch.arange(15.0).view(5, 3))
    for n, p in params.items():
        assert torch.equal(p, ref["params"][n]), n
    for n, m in zip(params, opt.param_groups[0]["params"]):
        assert torch.equal(m, ref["mains"][n]), n
        got = opt.state[m]
        assert got.keys() == ref["state"][n].keys()
        for k in got:
            assert torch.equal(got[k], ref["state"][n][k]), (n, k)
    assert opt.grad_scaler.state_dict()["scale"].item() == ref["scaler"]["scale"].item() == 2.0**10
    # and plainly, with DCP alone: full tensors from the 4 ranks' shards
    import torch.distributed.checkpoint as dcp

    plain = {"optimizer.main_params.row": torch.empty(H, 6), "model.meg": torch.empty(8, 3, dtype=torch.half)}
    dcp.load(plain, checkpoint_id=path)
    assert torch.equal(plain["optimizer.main_params.row"], ref["mains"]["row"])
    assert torch.equal(plain["model.meg"], ref["params"]["meg"])
