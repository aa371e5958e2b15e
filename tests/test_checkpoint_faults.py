"""tpamp.checkpoint under faults and misuse (docs/spec.md sections 7.2 and 7.3): a save that raises or is killed part-way
never costs the previous checkpoint, which then loads bit-identically to what was saved; a
corrupted, truncated or incomplete checkpoint, one of another optimizer class or param-group
structure, or bad values are refused with CheckpointError naming the fault, and the refused
load leaves model, main params, optimizer state, scaler and spike detector exactly as they
were.

The reference for "bit-identical" is an independent copy: the full tensors taken from the
saving run (torch.optim's state_dict, cloned) right before it saved, never the loader's
output.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import shutil
import signal
import struct
import time
import traceback

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tpamp
from tests.dist_utils import free_port, run_workers
from tpamp.checkpoint import (
    CheckpointError,
    iteration_dir,
    load_checkpoint,
    read_latest_iteration,
    save_checkpoint,
    write_latest_iteration,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SHAPES = {"w": (4, 4), "b": (4,), "v": (3, 4)}
MANIFEST = "tpamp_checksums.json"


def _model(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        n: torch.nn.Parameter((torch.randn(s, generator=g) * 0.5).half()) for n, s in SHAPES.items()
    }


_LAYOUT = ((("w", "v"), {}), (("b",), {"weight_decay": 0.0}))


def _groups(params, layout=_LAYOUT):
    return [{"params": [params[n] for n in names], **kw} for names, kw in layout]


def _optimizer(params, inner_cls=torch.optim.AdamW, layout=None, detector=None, scaler=None):
    groups = _groups(params) if layout is None else _groups(params, layout)
    kw = {"lr": 1e-2}
    if inner_cls is torch.optim.SGD:
        kw.update(momentum=0.9, weight_decay=0.5)
    scaler = scaler or tpamp.DynamicGradScaler(initial_scale=2.0**8, growth_interval=2, hysteresis=2)
    opt = tpamp.MixedPrecisionOptimizer(
        inner_cls(groups, **kw), grad_scaler=scaler, spike_detector=detector
    )
    opt.group_names = [list(names) for names, _ in (layout or _LAYOUT)]
    return opt


def _step(params, opt, seed):
    g = torch.Generator().manual_seed(1000 + seed)
    for n in sorted(params):
        p = params[n]
        p.grad = (torch.randn(p.shape, generator=g) * float(opt.get_loss_scale())).to(p.dtype)
    result = opt.step()
    opt.zero_grad()
    return result


def _snapshot(params, opt):
    """Everything a load may change, by name, as independent copies (pickled: no live
    tensor survives into the snapshot). The wrapper keeps each group's params in order,
    the fp32 main param in place of an fp16 param (``opt.group_names``: the names we gave)."""
    inner = opt.optimizer
    mains, state = {}, {}
    for names, g in zip(opt.group_names, inner.param_groups):
        assert len(names) == len(g["params"])
        for n, main in zip(names, g["params"]):
            assert main.dtype == torch.float32 and main.shape == params[n].shape
            mains[n] = main
            state[n] = dict(inner.state.get(main, {}))
    snap = {
        "params": {n: p.detach() for n, p in params.items()},
        "mains": {n: m.detach() for n, m in mains.items()},
        "state": state,
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups],
        "scaler": opt.grad_scaler.state_dict() if opt.grad_scaler is not None else None,
        "detector": opt.spike_detector.state_dict() if opt.spike_detector is not None else None,
        "class": type(inner).__name__,
    }
    return pickle.loads(pickle.dumps(snap))


def _assert_same(a, b):
    """Bit-identical (torch.equal and dtypes), key for key."""
    assert a.keys() == b.keys()
    for key in a:
        _same(a[key], b[key], key)


def _same(x, y, where):
    if isinstance(x, torch.Tensor):
        assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y), where
    elif isinstance(x, dict):
        assert isinstance(y, dict) and x.keys() == y.keys(), (where, x.keys(), getattr(y, "keys", None))
        for k in x:
            _same(x[k], y[k], f"{where}.{k}")
    elif isinstance(x, (list, tuple)):
        assert type(x) is type(y) and len(x) == len(y), where
        for i, (u, v) in enumerate(zip(x, y)):
            _same(u, v, f"{where}[{i}]")
    else:
        assert x == y, (where, x, y)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A checkpoint after 3 steps at root/iter_0000003 with the marker, and the saving run's
    own snapshot taken just before it saved."""
    root = str(tmp_path_factory.mktemp("good"))
    params = _model()
    det = tpamp.SpikeDetector(policy="skip", window=4, warmup=2)
    opt = _optimizer(params, detector=det)
    for s in range(3):
        assert _step(params, opt, s).update_successful
    want = _snapshot(params, opt)
    path = iteration_dir(root, 3)
    save_checkpoint(path, params, opt, extra={"iteration": 3})
    write_latest_iteration(root, 3)
    return root, path, want


def _copy(good, tmp_path):
    """A private copy of the good checkpoint to damage."""
    dst = str(tmp_path / "copy")
    shutil.copytree(good[1], dst)
    return dst


def _live(seed=9, **kw):
    """A model/optimizer with its own state (one step taken) that a refused load must keep."""
    params = _model(seed)
    kw.setdefault("detector", tpamp.SpikeDetector(policy="skip", window=4, warmup=2))
    opt = _optimizer(params, **kw)
    _step(params, opt, 50 + seed)
    return params, opt


def _refused(path, match, **kw):
    """Load into a live model that must stay exactly as it was; returns the error text."""
    params, opt = _live(**{k: kw.pop(k) for k in list(kw) if k in ("inner_cls", "layout", "detector", "scaler")})
    before = _snapshot(params, opt)
    with pytest.raises(CheckpointError, match=match) as e:
        load_checkpoint(path, params, opt, extra={"iteration": None}, **kw)
    _assert_same(_snapshot(params, opt), before)
    return str(e.value)


def _loaded(path, **kw):
    params, opt = _live()
    extra = load_checkpoint(path, params, opt, extra={"iteration": None}, **kw)
    return _snapshot(params, opt), extra


def _data_file(path):
    names = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))
    assert names, os.listdir(path)
    return os.path.join(path, names[0])


# ----------------------------------------------------------------------------- the reference


def test_the_good_checkpoint_loads_bit_identically(good):
    _, path, want = good
    got, extra = _loaded(path)
    assert extra == {"iteration": 3}
    _assert_same(got, want)
    # and the snapshot really differs from a fresh model's: the comparison can fail
    fresh = _snapshot(*_live())
    assert not torch.equal(fresh["mains"]["w"], want["mains"]["w"])


# ----------------------------------------------------------------------------- damaged files


def _main_w_bytes(path, want):
    """Where the fp32 main param 'w' lies in the data file (its raw bytes, found by value)."""
    raw = want["mains"]["w"].numpy().tobytes()
    data = open(_data_file(path), "rb").read()
    at = data.find(raw)
    assert at >= 0 and data.find(raw, at + 1) < 0
    return at, len(raw)


def test_finite_garbage_in_a_tensor_is_refused_by_its_checksum(good, tmp_path):
    path = _copy(good, tmp_path)
    at, n = _main_w_bytes(path, good[2])
    with open(_data_file(path), "r+b") as f:  # two finite floats over w[0, 1:3]
        f.seek(at + 4)
        f.write(struct.pack("<2f", 1.5, -2.25))
    text = _refused(path, "do not match their checksum")
    assert "'optimizer.main_params.w'" in text and os.path.basename(_data_file(path)) in text
    # DCP alone takes the garbage: the checksum is what refuses it
    got, _ = _loaded(path, verify_checksums=False)
    assert got["mains"]["w"][0, 1:3].tolist() == [1.5, -2.25]


def test_a_truncated_data_file_is_refused(good, tmp_path):
    path = _copy(good, tmp_path)
    f = _data_file(path)
    size = os.path.getsize(f)
    with open(f, "r+b") as fh:
        fh.truncate(size - 100)
    text = _refused(path, "truncated")
    assert f"{os.path.basename(f)} is {size - 100} bytes, {size} were written" in text
    # without the checksums it is still a CheckpointError, not a raw traceback
    params, opt = _live()
    before = _snapshot(params, opt)
    with pytest.raises(CheckpointError, match=r"rank 0: reading __0_0.distcp in .* failed: "
                       r"torch.distributed.checkpoint failed on rank 0: RuntimeError"):
        load_checkpoint(path, params, opt, verify_checksums=False)
    _assert_same(_snapshot(params, opt), before)


def test_an_extended_data_file_is_refused(good, tmp_path):
    path = _copy(good, tmp_path)
    with open(_data_file(path), "ab") as fh:
        fh.write(b"\0" * 8)
    _refused(path, "extended")


def test_a_missing_data_file_is_refused(good, tmp_path):
    path = _copy(good, tmp_path)
    os.remove(_data_file(path))
    _refused(path, r"__0_0.distcp is missing")


def test_a_corrupted_metadata_file_is_refused(good, tmp_path):
    path = _copy(good, tmp_path)
    md = os.path.join(path, ".metadata")
    data = bytearray(open(md, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(md, "wb").write(bytes(data))
    _refused(path, r"\.metadata does not match its checksum")


def test_a_checkpoint_without_checksums_is_refused_unless_asked(good, tmp_path):
    path = _copy(good, tmp_path)
    os.remove(os.path.join(path, MANIFEST))
    _refused(path, "has no tpamp_checksums.json")
    got, _ = _loaded(path, verify_checksums=False)
    _assert_same(got, good[2])


def test_an_unreadable_manifest_is_refused(good, tmp_path):
    path = _copy(good, tmp_path)
    open(os.path.join(path, MANIFEST), "w").write("{not json")
    _refused(path, "tpamp_checksums.json is unreadable")


def test_a_manifest_of_other_files_is_refused(good, tmp_path):
    path = _copy(good, tmp_path)
    m = json.load(open(os.path.join(path, MANIFEST)))
    m["files"]["__7_0.distcp"] = m["files"].pop(os.path.basename(_data_file(path)))
    json.dump(m, open(os.path.join(path, MANIFEST), "w"))
    _refused(path, "are not those of tpamp_checksums.json")


def test_a_missing_directory_is_refused(tmp_path):
    _refused(str(tmp_path / "nowhere"), "there is no checkpoint directory")


# ----------------------------------------------------------------------------- optimizer


def test_another_optimizer_class_is_refused_unless_reset(good):
    _, path, want = good
    text = _refused(path, "written by a torch.optim.adamw.AdamW optimizer", inner_cls=torch.optim.SGD)
    assert "this one is a torch.optim.sgd.SGD" in text and "reset_optimizer_state=True" in text
    _refused(path, "torch.optim.adam.Adam", inner_cls=torch.optim.Adam)
    # a deliberate change: params, masters, scaler and detector load; SGD keeps its own
    # hyperparameters and starts with no state
    params, opt = _live(inner_cls=torch.optim.SGD)
    sgd_groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.optimizer.param_groups]
    load_checkpoint(path, params, opt, reset_optimizer_state=True)
    got = _snapshot(params, opt)
    _assert_same(got["params"], want["params"])
    _assert_same(got["mains"], want["mains"])
    _assert_same(got["scaler"], want["scaler"])
    _assert_same(got["detector"], want["detector"])
    assert got["groups"] == sgd_groups and got["groups"][0]["weight_decay"] == 0.5
    assert all(not s for s in got["state"].values())
    assert _step(params, opt, 7).update_successful  # and it trains on


def test_a_param_in_another_group_is_refused(good):
    moved = ((("w",), {}), (("b", "v"), {"weight_decay": 0.0}))
    text = _refused(good[1], "the param groups differ from the checkpoint's", layout=moved)
    assert "'v' (group 1 here, 0 in the checkpoint)" in text


def test_another_group_count_is_refused(good):
    one = ((("w", "v", "b"), {}),)
    _refused(good[1], "the checkpoint has 2 param groups, the optimizer has 1", layout=one)


def test_unknown_or_bad_hyperparameters_are_refused(tmp_path):
    for key, value, match in [
        ("my_option", 1, r"hyperparameters \['my_option'\] that this optimizer's group does not have"),
        ("lr", "0.1", "param group 0: 'lr' is '0.1' in the checkpoint, expected a number"),
        ("lr", float("nan"), "'lr' is nan in the checkpoint, expected a finite number"),
        ("betas", (0.9,), "'betas' is \\(0.9,\\) in the checkpoint, expected a tuple of 2"),
    ]:
        params = _model()
        opt = _optimizer(params)
        _step(params, opt, 0)
        opt.optimizer.param_groups[0][key] = value
        path = str(tmp_path / f"{key}-{value}")
        save_checkpoint(path, params, opt, extra={"iteration": 0})
        _refused(path, match, detector=None)


def test_non_finite_optimizer_state_is_refused(tmp_path):
    params = _model()
    opt = _optimizer(params)
    _step(params, opt, 0)
    main_v = opt.optimizer.param_groups[0]["params"][1]
    opt.optimizer.state[main_v]["exp_avg_sq"][2, 1] = float("inf")
    save_checkpoint(str(tmp_path / "c"), params, opt, extra={"iteration": 0})
    _refused(str(tmp_path / "c"), "optimizer state 'v.exp_avg_sq' holds inf/nan", detector=None)


# ----------------------------------------------------------------------------- values and callers


def test_a_spike_detector_of_other_settings_is_refused(good):
    other = tpamp.SpikeDetector(policy="skip", window=8, warmup=2)
    _refused(good[1], "the spike detector refuses the saved state: ValueError", detector=other)


def test_a_scaler_of_another_kind_is_refused(good):
    _refused(good[1], "loss scaler state has keys", scaler=tpamp.ConstantGradScaler(2.0**8))


def test_check_extra_refuses_and_nothing_changes(good):
    def check(extra):
        raise ValueError(f"iteration {extra['iteration']} is not the one expected")

    _refused(good[1], "check_extra refuses the extras: ValueError: iteration 3 is not", check_extra=check)


def test_a_missing_extra_is_refused(good):
    params, opt = _live()
    before = _snapshot(params, opt)
    with pytest.raises(CheckpointError, match="the checkpoint has no 'extra.data_position'"):
        load_checkpoint(good[1], params, opt, extra={"data_position": None})
    _assert_same(_snapshot(params, opt), before)


class _FailingScaler(tpamp.DynamicGradScaler):
    """Accepts the state on the load's trial copy, then fails part-way on the real commit
    (after the model, main params and optimizer state were already copied in)."""

    calls = [0]  # shared by deep copies

    def load_state_dict(self, state_dict):
        _FailingScaler.calls[0] += 1
        if _FailingScaler.calls[0] == 2:
            self._scale.fill_(12345.0)  # a partial change the load must undo
            raise RuntimeError("device lost while loading the scale")
        super().load_state_dict(state_dict)


def test_a_commit_that_fails_part_way_is_rolled_back(good):
    _FailingScaler.calls[0] = 0
    scaler = _FailingScaler(initial_scale=2.0**8, growth_interval=2, hysteresis=2)
    text = _refused(good[1], "every rank restored the state it had before", scaler=scaler)
    assert "RuntimeError: device lost while loading the scale" in text
    assert _FailingScaler.calls[0] == 3  # trial, failed commit, restore


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda p, o, d: load_checkpoint(d, list(p.values()), o), TypeError, "model_params must be a mapping"),
        (lambda p, o, d: load_checkpoint(d, {1: p["w"]}, o), ValueError, "names must be non-empty strings"),
        (lambda p, o, d: load_checkpoint(None, p, o), TypeError, "checkpoint_dir must be a path"),
        (lambda p, o, d: load_checkpoint(d, p, o, strict="yes"), TypeError, "strict must be a bool"),
        (lambda p, o, d: load_checkpoint(d, p, o, reset_optimizer_state=1), TypeError,
         "reset_optimizer_state must be a bool"),
        (lambda p, o, d: load_checkpoint(d, p, o, check_extra=3), TypeError, "check_extra must be callable"),
        (lambda p, o, d: load_checkpoint(d, p, o, extra=[1]), TypeError, "extra must be a mapping"),
        (lambda p, o, d: load_checkpoint(d, p, torch.optim.SGD([p["w"]], lr=1.0)), TypeError,
         "optimizer must be a tpamp MixedPrecisionOptimizer"),
    ],
    ids=["params_list", "int_name", "dir_none", "strict_str", "reset_int", "check_int", "extra_list", "bare_sgd"],
)
def test_bad_load_arguments_are_refused_and_nothing_changes(good, call, error, match):
    params, opt = _live()
    before = _snapshot(params, opt)
    with pytest.raises(error, match=match):
        call(params, opt, good[1])
    _assert_same(_snapshot(params, opt), before)


# ----------------------------------------------------------------------------- saves that fail


class _PicklesOnce:
    """Pickles the first time (the save's own check), then fails (inside DCP's write)."""

    count = [0]

    def __reduce__(self):
        _PicklesOnce.count[0] += 1
        if _PicklesOnce.count[0] > 1:
            raise OSError("No space left on device")
        return (_PicklesOnce, ())


def _resave(path, extra, match):
    """Save another state over ``path``; it must fail and ``path`` must stay as it was."""
    params, opt = _live(seed=4)
    files_before = sorted(os.listdir(path))
    with pytest.raises(CheckpointError, match=match) as e:
        save_checkpoint(path, params, opt, extra=extra)
    assert sorted(os.listdir(path)) == files_before
    parent = os.path.dirname(path)
    assert not [n for n in os.listdir(parent) if ".saving-" in n or ".old-" in n]
    return str(e.value)


def test_an_unpicklable_extra_over_a_checkpoint_keeps_it_loadable(good, tmp_path):
    path = _copy(good, tmp_path)
    text = _resave(path, {"iteration": 4, "bad": lambda: 0}, "extra\\['bad'\\] cannot be saved")
    assert "nothing was written" in text
    got, extra = _loaded(path)
    assert extra == {"iteration": 3}
    _assert_same(got, good[2])


def test_a_save_that_raises_inside_dcp_keeps_the_previous_checkpoint(good, tmp_path):
    path = _copy(good, tmp_path)
    _PicklesOnce.count[0] = 0
    text = _resave(path, {"iteration": 4, "x": _PicklesOnce()}, "saving .* failed")
    assert "No space left on device" in text and "the checkpoint directory is as it was" in text
    got, extra = _loaded(path)
    assert extra == {"iteration": 3}
    _assert_same(got, good[2])


def test_a_save_never_replaces_a_directory_that_is_not_a_checkpoint(tmp_path):
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "todo.txt").write_text("keep me")
    params, opt = _live()
    with pytest.raises(CheckpointError, match="exists and is not a checkpoint directory"):
        save_checkpoint(str(mine), params, opt)
    assert (mine / "todo.txt").read_text() == "keep me" and os.listdir(mine) == ["todo.txt"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="exists and is not a checkpoint directory"):
        save_checkpoint(str(tmp_path / "file"), params, opt)


@pytest.mark.parametrize(
    "kw, error, match",
    [
        (dict(extra={"": 1}), ValueError, "extra: keys must be non-empty strings"),
        (dict(extra=[("a", 1)]), TypeError, "extra must be a mapping"),
        (dict(checkpoint_dir=""), ValueError, "checkpoint_dir must not be empty"),
        (dict(checkpoint_dir=3), TypeError, "checkpoint_dir must be a path"),
    ],
    ids=["empty_key", "extra_list", "empty_dir", "int_dir"],
)
def test_bad_save_arguments_write_nothing(tmp_path, kw, error, match):
    params, opt = _live()
    path = kw.pop("checkpoint_dir", str(tmp_path / "c"))
    with pytest.raises(error, match=match):
        save_checkpoint(path, params, opt, **kw)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two_renames"])
def test_a_resave_replaces_the_checkpoint_whole_and_leaves_nothing_behind(good, tmp_path, monkeypatch, exchange):
    if not exchange:  # an OS or file system without the atomic exchange
        monkeypatch.setattr(tpamp.checkpoint.directories, "rename_exchange", lambda a, b: False)
    path = _copy(good, tmp_path)
    # a killed earlier save left its staging directory: the next save of the name removes it
    os.makedirs(os.path.join(tmp_path, ".copy.saving-deadbeef"))
    params, opt = _live(seed=4)
    want = _snapshot(params, opt)
    save_checkpoint(path, params, opt, extra={"iteration": 9})
    assert sorted(os.listdir(tmp_path)) == ["copy"]
    got, extra = _loaded(path)
    assert extra == {"iteration": 9}
    _assert_same(got, want)


def test_the_marker_names_only_saved_checkpoints(good, tmp_path):
    root = good[0]
    assert read_latest_iteration(root) == 3
    with pytest.raises(ValueError, match="is not a saved checkpoint"):
        write_latest_iteration(root, 4)
    assert read_latest_iteration(root) == 3


# ----------------------------------------------------------------------------- two ranks

WORLD = 2


def _build_dist(rank, seed=0):
    params = _model(seed)
    opt = _optimizer(params)
    return params, opt


def _dist_steps(params, opt, start, n):
    for s in range(start, start + n):  # the same grads on both ranks: DP replicas
        assert _step(params, opt, s).update_successful


def _first_save(rank, world, root):
    """Both ranks: 3 steps, save iteration 3 (a per-rank tensor too), marker; return the
    state as saved."""
    params, opt = _build_dist(rank)
    _dist_steps(params, opt, 0, 3)
    want = _snapshot(params, opt)
    save_checkpoint(iteration_dir(root, 3), params, opt,
                    extra={"iteration": 3, f"rank{rank}": torch.full((64,), float(rank))})
    if rank == 0:
        write_latest_iteration(root, 3)
    return want


def _rank_entry(rank, world, port, root, fault, queue):
    """A rank of the second run: resume from iteration 3, 2 more steps, save iteration 3
    again over the checkpoint (and, if that worked, would move on): ``fault`` on rank 1."""
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=20))
        params, opt = _build_dist(rank, seed=5)
        load_checkpoint(iteration_dir(root, 3), params, opt)
        _dist_steps(params, opt, 3, 2)
        if rank == int(fault[-1]):
            import torch.distributed.checkpoint.filesystem as fs

            original = fs._write_item

            def write_item(transforms, stream, data, *args, **kw):
                original(transforms, stream, data, *args, **kw)
                stream.flush()  # part of this rank's data is on disk
                if fault.startswith("kill"):
                    os.kill(os.getpid(), signal.SIGKILL)
                raise OSError(28, "No space left on device")

            fs._write_item = write_item
        try:
            save_checkpoint(iteration_dir(root, 3), params, opt,
                            extra={"iteration": 5, f"rank{rank}": torch.full((64,), 9.0)})
            queue.put((rank, "saved", ""))
        except CheckpointError as e:
            queue.put((rank, "CheckpointError", str(e)))
    except BaseException as e:  # noqa: BLE001 -- reported to the test
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        os._exit(0)


def _second_run(root, fault):
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_rank_entry, args=(r, WORLD, port, root, fault, queue))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 90
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.monotonic()))
    reports = {}
    while not queue.empty():
        rank, kind, text = queue.get()
        reports[rank] = (kind, text)
    for p in procs:
        if p.is_alive():
            p.kill()
    return reports, [p.exitcode for p in procs]


def _bit_identical_in_one_process(root, want):
    path = iteration_dir(root, read_latest_iteration(root))
    params, opt = _live(detector=None)
    extra = load_checkpoint(path, params, opt, extra={"iteration": None, "rank1": None})
    assert extra["iteration"] == 3 and torch.equal(extra["rank1"], torch.full((64,), 1.0))
    _assert_same(_snapshot(params, opt), want)


@pytest.mark.parametrize("fault", ["kill1", "kill0", "raise1"])
def test_a_two_rank_save_killed_or_failing_on_one_rank_keeps_the_previous_checkpoint(tmp_path, fault):
    """kill1 / kill0: kill -9 of rank 1 (or of rank 0, which would publish) after part of its
    data is on disk; raise1: a write error on rank 1. The save overwrites the checkpoint of
    the same name: the most exposed case."""
    root = str(tmp_path)
    want = run_workers(_first_save, WORLD, root, timeout=30)
    _same(want[0], want[1], "replicas")
    reports, codes = _second_run(root, fault)
    victim = int(fault[-1])
    if fault.startswith("kill"):
        assert codes[victim] == -signal.SIGKILL and victim not in reports, (codes, reports)
        kind, text = reports[1 - victim]
        assert kind == "CheckpointError", text
        assert "saving" in text and "the checkpoint directory is as it was" in text
    else:
        for r in range(WORLD):  # every rank names the failing rank and the fault
            kind, text = reports[r]
            assert kind == "CheckpointError", text
            assert "rank 1: OSError: [Errno 28] No space left on device" in text
    assert read_latest_iteration(root) == 3
    left = sorted(os.listdir(root))
    if fault == "kill0":  # nobody was left to remove the staging directory: hidden, unused
        assert len(left) == 3 and left[0].startswith(".iter_0000003.saving-"), left
        assert not os.path.exists(os.path.join(root, left[0], MANIFEST))
        _bit_identical_in_one_process(root, want[0])
        params, opt = _live(detector=None)  # the next save of that name removes it
        save_checkpoint(iteration_dir(root, 3), params, opt, extra={"iteration": 3, "rank1": None})
        left = sorted(os.listdir(root))
    else:
        _bit_identical_in_one_process(root, want[0])
    assert left == ["iter_0000003", "latest_checkpointed_iteration.txt"]


def _load_corrupted(rank, world, path):
    params, opt = _live(detector=None)
    before = _snapshot(params, opt)
    try:
        load_checkpoint(path, params, opt)
    except CheckpointError as e:
        _assert_same(_snapshot(params, opt), before)
        return str(e)
    return "loaded"


def test_a_corrupted_file_is_refused_on_every_rank(tmp_path):
    root = str(tmp_path)
    run_workers(_first_save, WORLD, root, timeout=30)
    path = iteration_dir(root, 3)
    victim = os.path.join(path, "__1_0.distcp")
    data = bytearray(open(victim, "rb").read())
    data[-200] ^= 0x01
    open(victim, "wb").write(bytes(data))
    texts = run_workers(_load_corrupted, WORLD, path, timeout=30)
    for t in texts:  # the file is verified by one rank, and refused by all
        assert "__1_0.distcp" in t and "nothing was changed" in t, t


def test_the_checksums_cover_every_byte_of_every_data_file(good):
    """The manifest covers every byte DCP wrote for every tensor: the items tile the file."""
    m = json.load(open(os.path.join(good[1], MANIFEST)))
    for name, entry in m["files"].items():
        spans = sorted((o, o + n) for o, n, _, _ in entry["items"])
        assert spans[0][0] == 0 and spans[-1][1] == entry["size"], name
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), name
        assert len(np.unique([w for *_, w in entry["items"]])) == len(entry["items"])


def _one_rank_faults(rank, world, root):
    """Faults on rank 1 alone: every rank must refuse together (no rank left waiting in a
    collective), with its state unchanged and nothing written."""
    out = {}
    params, opt = _live(detector=None)
    before = _snapshot(params, opt)
    path = iteration_dir(root, 3)
    # load: rank 1 forgets a trained param (its optimizer's hook raises ValueError there)
    mine = dict(params) if rank == 0 else {n: p for n, p in params.items() if n != "b"}
    try:
        load_checkpoint(path, mine, opt)
        out["load"] = "loaded"
    except CheckpointError as e:
        out["load"] = str(e)
    _assert_same(_snapshot(params, opt), before)
    # save: an unpicklable extra on rank 1 only
    listing = sorted(os.listdir(path))
    try:
        save_checkpoint(path, params, opt, extra={f"r{rank}": (lambda: 0) if rank else 0})
        out["save"] = "saved"
    except CheckpointError as e:
        out["save"] = str(e)
    # save: another directory on rank 1
    try:
        save_checkpoint(path if rank == 0 else path + "x", params, opt)
        out["dirs"] = "saved"
    except CheckpointError as e:
        out["dirs"] = str(e)
    out["same_files"] = sorted(os.listdir(path)) == listing
    out["others"] = sorted(os.listdir(root))
    return out


def test_a_fault_on_one_rank_is_refused_on_every_rank(tmp_path):
    root = str(tmp_path)
    want = run_workers(_first_save, WORLD, root, timeout=30)
    outs = run_workers(_one_rank_faults, WORLD, root, timeout=30)
    for r, out in enumerate(outs):
        assert "rank 1: ValueError: the optimizer updates a param" in out["load"], (r, out)
        assert "rank 1: extra['r1'] cannot be saved" in out["save"], (r, out)
        assert "nothing was written" in out["save"]
        assert "rank 1: checkpoint_dir" in out["dirs"] and "iter_0000003x" in out["dirs"], (r, out)
        assert out["same_files"]
        assert out["others"] == ["iter_0000003", "latest_checkpointed_iteration.txt"], out
    _bit_identical_in_one_process(root, want[0])


def test_a_checkpoint_set_aside_by_a_killed_two_rename_publish_is_put_back(good, tmp_path):
    """Without renameat2 a publish renames the old checkpoint aside, then the new one in; a
    kill between the two leaves the old one at .NAME.old-TOKEN: the next save puts it back
    (here that save itself fails inside DCP, so the old checkpoint is what remains)."""
    path = _copy(good, tmp_path)
    aside = os.path.join(tmp_path, ".copy.old-0123456789ab")
    os.rename(path, aside)
    os.makedirs(os.path.join(tmp_path, ".copy.saving-0123456789ab"))  # the new, unpublished
    params, opt = _live(seed=4)
    _PicklesOnce.count[0] = 0
    with pytest.raises(CheckpointError, match="No space left on device"):
        save_checkpoint(path, params, opt, extra={"x": _PicklesOnce()})
    assert sorted(os.listdir(tmp_path)) == ["copy"]
    got, extra = _loaded(path)
    assert extra == {"iteration": 3}
    _assert_same(got, good[2])
