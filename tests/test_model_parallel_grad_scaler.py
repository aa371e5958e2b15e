"""ModelParallelGradScaler does what torch.amp.GradScaler does, and agrees found_inf over its group.

Single process (no group): every behaviour that PyTorch's own GradScaler tests check and that
our scaler must share (unscale of dense and sparse grads, the found_inf of any one-element
shape, growth and backoff, state dict round trips, pickling and deep copy between iterations,
foreach and fused optimizers, autocast loops) against hand-worked numbers or against
torch.amp.GradScaler running the same loop (an independent reference: the same algorithm in
torch's code). Pickling a scaler that holds a group: the copy keeps the numbers; loaded in the
process that pickled it, it has the same group back; loaded in another process (a fresh
interpreter, the fork parent), after its group was destroyed, or from a state with a forged
token or pid, it comes back without the group and refuses unscale_/step/update until
set_model_parallel_group.

Two fork-started gloo ranks: under each of those loops one rank's overflow makes both ranks
skip and back off identically (hand-worked scale trace; params equal to torch's scaler run
with the overflow on every rank), also after a state dict round trip, a deep copy and a pickle
round trip in the same process (no set_model_parallel_group call).
"""

from __future__ import annotations

import ast
import copy
import io
import math
import os
import pickle
import subprocess
import sys
import uuid

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_workers
from misuse_utils import (
    DROP,
    Case,
    assert_every_case_refused_by_tpamp,
    assert_every_setup_case_refused_by_tpamp,
    assert_raises_naming,
    assert_refused_and_unchanged,
    case_ids,
)
from torch import nn

import tpamp
from tpamp import ModelParallelGradScaler

SHORT = 10.0  # seconds: the gloo timeout of the two-rank runs

# A hand-worked trace: init_scale 8, growth_factor 2, backoff_factor 0.25, growth_interval 2;
# an overflow at steps 2 and 4. torch.amp's rule: an overflow multiplies the scale by the
# backoff factor and zeroes the tracker; a clean step adds one to the tracker and, when it
# reaches the interval, multiplies the scale by the growth factor and zeroes the tracker.
KW = dict(init_scale=8.0, growth_factor=2.0, backoff_factor=0.25, growth_interval=2)
STEPS = 8
OVERFLOW_AT = {2: 1, 4: 0}  # step -> the rank whose grads overflow (every rank in one process)
SCALES = [8.0, 16.0, 4.0, 4.0, 1.0, 1.0, 2.0, 2.0]  # after each update
TRACKERS = [1, 0, 0, 1, 0, 1, 0, 1]
SKIPPED = [False, False, True, False, True, False, False, False]

SHAPES = [(), (1,), (1, 1)]  # found_inf shapes torch accepts (one element)

# (name, optimizer kwargs or "sparse"/"autocast" model, unscale_ before step)
LOOPS = [
    ("sgd", "sgd", False),
    ("sgd-unscale", "sgd", True),
    ("sgd-foreach", "sgd-foreach", False),
    ("sparse", "sparse", False),
    ("sparse-unscale", "sparse", True),
    ("adam-foreach", "adam-foreach", False),
    ("adam-fused", "adam-fused", False),
    ("adam-fused-unscale", "adam-fused", True),
    ("autocast", "autocast", False),
    ("autocast-unscale", "autocast", True),
]


def _model_and_optimizer(kind):
    torch.manual_seed(0)
    if kind == "sparse":
        model = nn.Embedding(6, 3, sparse=True)
        return model, torch.optim.SGD(model.parameters(), lr=0.125)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    if kind in ("sgd", "autocast"):
        opt = torch.optim.SGD(model.parameters(), lr=0.125, momentum=0.5, foreach=False)
    elif kind == "sgd-foreach":
        opt = torch.optim.SGD(model.parameters(), lr=0.125, momentum=0.5, foreach=True)
    elif kind == "adam-foreach":
        opt = torch.optim.Adam(model.parameters(), lr=0.01, foreach=True)
    elif kind == "adam-fused":
        opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    else:
        raise AssertionError(kind)
    return model, opt


def _loss(kind, model, step):
    g = torch.Generator().manual_seed(100 + step)
    if kind == "sparse":
        idx = torch.tensor([[0, 2, 2], [5, 1, 0]])  # repeated rows: an uncoalesced grad
        return model(idx).pow(2).sum()
    x = torch.randn(5, 4, generator=g)
    if kind == "autocast":
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        return out.float().pow(2).mean()
    return model(x).pow(2).mean()


def _poison(model):
    # one element of one grad becomes inf (the scaled grad overflowed on this rank)
    p = next(model.parameters())
    with torch.no_grad():
        if p.grad.is_sparse:
            p.grad = p.grad.coalesce()
            p.grad.values()[0, 0] = float("inf")
        else:
            p.grad.view(-1)[0] = float("inf")


def run_loop(kind, scaler, *, unscale, overflow_here, replace=None, steps=STEPS):
    """The training loop every test runs; returns the trace and the final params.

    overflow_here(step) -> bool: whether this rank poisons its grads at that step;
    replace(step, scaler) -> scaler: called after update (pickle, deep copy, state dict)."""
    model, opt = _model_and_optimizer(kind)
    scales, trackers, skipped = [], [], []
    for step in range(steps):
        opt.zero_grad()
        before = [p.detach().clone() for p in model.parameters()]
        scaler.scale(_loss(kind, model, step)).backward()
        if overflow_here(step):
            _poison(model)
        if unscale:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        skipped.append(all(torch.equal(b, p) for b, p in zip(before, model.parameters())))
        sd = scaler.state_dict()
        scales.append(sd["scale"])
        trackers.append(sd["_growth_tracker"])
        if replace is not None:
            scaler = replace(step, scaler)
    params = [p.detach().clone() for p in model.parameters()]
    return {"scales": scales, "trackers": trackers, "skipped": skipped, "params": params,
            "scaler": scaler}


def _torch_reference(kind, unscale):
    # torch's own scaler, the overflow on this (the only) rank at every step where any rank
    # of the group overflowed
    return run_loop(kind, torch.amp.GradScaler("cpu", **KW), unscale=unscale,
                    overflow_here=lambda s: s in OVERFLOW_AT)


def _assert_trace(got):
    assert got["scales"] == SCALES, got["scales"]
    assert got["trackers"] == TRACKERS, got["trackers"]
    assert got["skipped"] == SKIPPED, got["skipped"]


def _assert_same_params(got, ref):
    for a, b in zip(got["params"], ref["params"]):
        assert torch.equal(a, b), (a, b)


# ---- one process, no group: torch.amp's behaviour -----------------------------------------


@pytest.mark.parametrize("name,kind,unscale", LOOPS, ids=[n for n, _, _ in LOOPS])
def test_loops_match_torch_scaler_and_the_hand_worked_trace(name, kind, unscale):
    ref = _torch_reference(kind, unscale)
    _assert_trace(ref)  # torch's scaler itself follows the hand-worked trace
    got = run_loop(kind, ModelParallelGradScaler("cpu", **KW), unscale=unscale,
                   overflow_here=lambda s: s in OVERFLOW_AT)
    _assert_trace(got)
    _assert_same_params(got, ref)


def test_unscale_of_dense_grads_divides_by_the_scale_and_flags_inf_and_nan():
    p = nn.Parameter(torch.zeros(3))
    q = nn.Parameter(torch.zeros(2, 2, dtype=torch.float64))
    opt = torch.optim.SGD([p, q], lr=1.0)
    s = ModelParallelGradScaler("cpu", init_scale=4.0)
    s.scale(torch.ones(()))  # the scale is made lazily, by the first scale()
    p.grad = torch.tensor([4.0, -8.0, 2.0])
    q.grad = torch.full((2, 2), 12.0, dtype=torch.float64).t()  # not contiguous
    s.unscale_(opt)
    assert p.grad.tolist() == [1.0, -2.0, 0.5]
    assert q.grad.tolist() == [[3.0, 3.0], [3.0, 3.0]]
    assert s.found_inf(opt).item() == 0.0
    for bad in (float("inf"), float("nan")):
        s.update(4.0)
        p.grad = torch.tensor([4.0, bad, 2.0])
        s.unscale_(opt)
        assert s.found_inf(opt).item() > 0
        s.step(opt)  # skipped
        assert p.tolist() == [0.0, 0.0, 0.0]


def test_unscale_of_sparse_grads_and_the_fp16_coalesced_overflow():
    s = ModelParallelGradScaler("cpu", init_scale=4.0)
    s.scale(torch.ones(()))
    i = torch.tensor([[0, 1, 1], [2, 0, 2]])
    p = nn.Parameter(torch.sparse_coo_tensor(i, torch.ones(3), (2, 3)))
    opt = torch.optim.SGD([p], lr=1.0)
    p.grad = torch.sparse_coo_tensor(i, torch.tensor([16.0, 32.0, 64.0]), (2, 3))
    s.unscale_(opt)
    assert s.found_inf(opt).item() == 0.0
    assert p.grad.to_dense().tolist() == [[0.0, 0.0, 4.0], [8.0, 0.0, 16.0]]
    s.update(4.0)
    # fp16, duplicated index: each value fits fp16 (max 65504), their sum 128000 does not
    half = nn.Parameter(torch.sparse_coo_tensor(i, torch.ones(3), (2, 3)).half())
    hopt = torch.optim.SGD([half], lr=1.0)
    dup = torch.tensor([[0, 1, 0], [2, 0, 2]])
    half.grad = torch.sparse_coo_tensor(dup, torch.tensor([64000.0, 32.0, 64000.0]), (2, 3),
                                        dtype=torch.float16)
    flags = s._unscale_grads_(hopt, torch.full((), 0.25), torch.zeros(()), True)
    assert sum(v.item() for v in flags.values()) == 1.0


@pytest.mark.parametrize("shape", SHAPES, ids=["0-dim", "(1,)", "(1,1)"])
def test_found_inf_of_any_one_element_shape(shape):
    s = ModelParallelGradScaler("cpu")
    p = nn.Parameter(torch.zeros(2))
    h = nn.Parameter(torch.zeros(2, dtype=torch.float16))
    opt = torch.optim.SGD([p, h], lr=1.0)
    p.grad = torch.tensor([4.0, 8.0])
    h.grad = torch.tensor([2.0, float("inf")], dtype=torch.float16)
    flags = s._unscale_grads_(opt, torch.full(shape, 0.5), torch.zeros(shape), True)
    assert [tuple(f.shape) for f in flags.values()] == [shape]
    assert sum(f.item() for f in flags.values()) == 1.0  # the fp16 grad's inf, once
    assert p.grad.tolist() == [2.0, 4.0]


def test_growth_stops_short_of_inf_and_set_scale_by_update():
    # torch's rule: a growth that would give inf keeps the scale
    s = ModelParallelGradScaler("cpu", init_scale=1e38, growth_factor=16.0, growth_interval=1)
    p = nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=1e-45)
    s.scale(p.sum() * 1e-30).backward()
    s.step(opt)
    s.update()
    assert s.get_scale() == torch.tensor(1e38, dtype=torch.float32).item()
    s.update(new_scale=32.0)
    assert s.get_scale() == 32.0


@pytest.mark.parametrize("at", [0, 3, 6])
def test_state_dict_round_trip_mid_training_continues_the_trace(at):
    def reload(step, scaler):
        if step != at:
            return scaler
        fresh = ModelParallelGradScaler("cpu", init_scale=3.0, growth_factor=7.0,
                                        backoff_factor=0.8, growth_interval=5)
        fresh.scale(torch.ones(1))  # the scale tensor made before the load, as torch's test does
        fresh.load_state_dict(scaler.state_dict())
        assert fresh.state_dict() == scaler.state_dict()
        return fresh

    got = run_loop("sgd", ModelParallelGradScaler("cpu", **KW), unscale=False,
                   overflow_here=lambda s: s in OVERFLOW_AT, replace=reload)
    _assert_trace(got)
    _assert_same_params(got, _torch_reference("sgd", False))


@pytest.mark.parametrize("how", ["pickle", "deepcopy", "torch.save"])
def test_copies_between_iterations_without_a_group_behave_as_torch(how, tmp_path):
    def roundtrip(scaler):
        if how == "pickle":
            return pickle.loads(pickle.dumps(scaler))
        if how == "deepcopy":
            return copy.deepcopy(scaler)
        torch.save(scaler, tmp_path / "s.pt")
        return torch.load(tmp_path / "s.pt", weights_only=False)

    def replace(step, scaler):
        new = roundtrip(scaler)
        assert type(new) is ModelParallelGradScaler and new is not scaler
        assert new.model_parallel_group is None and not new.is_detached()
        assert new.state_dict() == scaler.state_dict()
        return new

    got = run_loop("adam-fused", ModelParallelGradScaler("cpu", **KW), unscale=False,
                   overflow_here=lambda s: s in OVERFLOW_AT, replace=replace)
    _assert_trace(got)
    _assert_same_params(got, _torch_reference("adam-fused", False))


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_copies_in_the_middle_of_an_iteration_are_refused_as_by_torch(how):
    op = pickle.dumps if how == "pickle" else copy.deepcopy
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1.0)
    for scaler in (torch.amp.GradScaler("cpu"), ModelParallelGradScaler("cpu")):
        scaler.scale(p.sum()).backward()
        scaler.unscale_(opt)
        with pytest.raises(AssertionError, match="beginning of an iteration"):
            op(scaler)
        p.grad = None


def test_disabled_scaler_pickles_and_steps_as_torch():
    s = pickle.loads(pickle.dumps(ModelParallelGradScaler("cpu", enabled=False)))
    assert not s.is_enabled() and s.state_dict() == {} and s.get_scale() == 1.0
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1.0)
    s.scale(p.sum()).backward()
    s.step(opt)
    s.update()
    assert p.tolist() == [0.0, 0.0]


def test_found_inf_of_a_disabled_scaler_is_zero_as_it_never_skips():
    """torch.amp's disabled scaler (enabled=False; also "cuda" without CUDA) checks no grad and
    steps always; found_inf answers 0.0 (no skip), as get_scale() answers 1.0: code written for
    an enabled scaler runs unchanged with a disabled one."""
    s = ModelParallelGradScaler("cpu", enabled=False)
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1.0)
    for _ in range(2):
        s.scale(p.sum()).backward()
        p.grad[0] = float("inf")  # unchecked: the step runs
        s.step(opt)
        flag = s.found_inf(opt)
        assert flag.shape == () and flag.dtype == torch.float32 and flag.item() == 0.0
        s.update()
        assert s.found_inf(opt).item() == 0.0
        opt.zero_grad()
    assert p[0].item() == -math.inf and p[1].item() == -1.0  # stepped twice, inf included


def test_found_inf_is_known_from_unscale_until_the_next_scale():
    """found_inf(opt) answers for this iteration from unscale_ / step on, also after update()
    (torch's update() clears its per-iteration state), until the next iteration's scale();
    before this iteration's check it raises, naming unscale_ and step, and asking never adds
    state that would make the scaler refuse to pickle (torch: only between iterations)."""
    p = nn.Parameter(torch.ones(2))
    q = nn.Parameter(torch.ones(1))
    opt, other = torch.optim.SGD([p], lr=1.0), torch.optim.SGD([q], lr=1.0)
    s = ModelParallelGradScaler("cpu", init_scale=4.0, growth_interval=1)
    for bad in (float("inf"), None, float("nan"), None):
        s.scale(p.sum()).backward()
        with pytest.raises(RuntimeError, match=r"unscale_\(optimizer\) or scaler.step"):
            s.found_inf(opt)
        if bad is not None:
            p.grad[1] = bad
        s.step(opt)  # unscales, checks, skips on inf / nan
        expected = 0.0 if bad is None else 1.0
        assert s.found_inf(opt).item() == expected
        s.update()
        kept = s.found_inf(opt)
        assert kept.shape == () and kept.dtype == torch.float32 and kept.item() == expected
        with pytest.raises(RuntimeError, match="has not checked"):
            s.found_inf(other)  # never unscaled or stepped
        again = pickle.loads(pickle.dumps(s))  # between iterations: allowed, flags not carried
        with pytest.raises(RuntimeError, match="has not checked"):
            again.found_inf(opt)
        opt.zero_grad()
    # init 4, growth interval 1: inf halves, clean doubles, nan halves, clean doubles
    assert s.get_scale() == 4.0
    assert p.tolist() == [-1.0, -1.0]  # the two clean steps of lr 1 with grad 1


def test_set_model_parallel_group_checks_its_argument():
    s = ModelParallelGradScaler("cpu")
    with pytest.raises(TypeError, match="model_parallel_group.*int"):
        s.set_model_parallel_group(3)
    with pytest.raises(TypeError, match="model_parallel_group.*str"):
        s.model_parallel_group = "tp"
    s.set_model_parallel_group(None)
    assert s.model_parallel_group is None and not s.is_detached()


# ---- a 1-rank group in a forked process, and two ranks ---------------------------------------


def _forged(scaler, **changes):
    # what pickle.loads does with a pickled state whose entries were changed
    state = scaler.__getstate__()
    assert set(changes) <= set(state), (sorted(changes), sorted(state))
    state.update(changes)
    new = ModelParallelGradScaler.__new__(ModelParallelGradScaler)
    new.__setstate__(state)
    return new


def _detached_worker(rank, world):
    group = dist.new_group([0])
    s = ModelParallelGradScaler("cpu", init_scale=8.0, growth_interval=3, model_parallel_group=group)
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.5)
    s.scale(p.sum()).backward()
    s.step(opt)
    s.update()
    out = {"deepcopy_shares": copy.deepcopy(s).model_parallel_group is group}
    # same process: the same group back, also through torch.save and a second round trip
    same = pickle.loads(pickle.dumps(s))
    again = pickle.loads(pickle.dumps(same))
    buf = io.BytesIO()
    torch.save(s, buf)
    buf.seek(0)
    t = torch.load(buf, weights_only=False)
    out["same_process"] = [(x.model_parallel_group is group, x.is_detached(), x.state_dict())
                           for x in (same, again, t)]
    # two scalers, two groups (equal ranks): each comes back with its own
    other_group = dist.new_group([0])
    other = ModelParallelGradScaler("cpu", model_parallel_group=other_group)
    pair = pickle.loads(pickle.dumps((s, other)))
    out["own_groups"] = (pair[0].model_parallel_group is group,
                         pair[1].model_parallel_group is other_group)
    # what the fork parent and a fresh interpreter load (another pid, not this registry)
    out["pickled"] = pickle.dumps(s)
    # a forged token or pid: detached
    forged = {"token": _forged(s, _group_token=uuid.uuid4().hex),
              "pid": _forged(s, _group_pid=os.getpid() + 1),
              "no token": _forged(s, _group_token=None)}
    # a destroyed group: detached, also when the scaler still holds the group object
    doomed = dist.new_group([0])
    d = copy.deepcopy(s)
    d.set_model_parallel_group(doomed)
    blob = pickle.dumps(d)
    dist.destroy_process_group(doomed)
    forged["destroyed"] = pickle.loads(blob)
    out["forged"] = {k: (v.model_parallel_group is None, v.is_detached(), v.state_dict())
                     for k, v in forged.items()}
    out["state"] = s.state_dict()
    u = forged["token"]
    p.grad = None
    u.scale(p.sum()).backward()  # scale works while detached
    grad_before = p.grad.clone()
    errors = {}
    for what, call in (("unscale_", lambda: u.unscale_(opt)), ("step", lambda: u.step(opt)),
                       ("update", lambda: u.update()),
                       ("_unscale_grads_", lambda: u._unscale_grads_(
                           opt, torch.ones(1), torch.zeros(1), True))):
        try:
            call()
        except RuntimeError as e:
            errors[what] = str(e)
    out["errors"] = errors
    out["grad_untouched"] = torch.equal(p.grad, grad_before)
    u.set_model_parallel_group(group)
    u.step(opt)
    u.update()
    out["after_attach"] = (u.state_dict(), p.tolist(), u.is_detached())
    # a disabled scaler checks nothing: it comes back without the group, not detached
    d = pickle.loads(pickle.dumps(ModelParallelGradScaler("cpu", enabled=False,
                                                          model_parallel_group=group)))
    q = nn.Parameter(torch.ones(2))
    qopt = torch.optim.SGD([q], lr=0.5)
    d.scale(q.sum()).backward()
    d.step(qopt)
    d.update()
    out["disabled"] = (d.is_detached(), d.model_parallel_group, q.tolist())
    return out


_FRESH = """
import pickle, sys
import torch
from torch import nn
s = pickle.loads(sys.stdin.buffer.read())
p = nn.Parameter(torch.ones(2))
opt = torch.optim.SGD([p], lr=0.5)
s.scale(p.sum()).backward()
try:
    s.step(opt)
    err = None
except RuntimeError as e:
    err = str(e)
print(repr((s.model_parallel_group is None, s.is_detached(), s.state_dict(), err, p.tolist())))
"""


def test_a_pickled_scaler_with_a_group_is_detached_unless_loaded_in_the_same_process():
    (out,) = run_workers(_detached_worker, 1, timeout=SHORT)
    assert out["deepcopy_shares"]
    state = {"scale": 8.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3,
             "_growth_tracker": 1}
    assert out["state"] == state
    assert out["same_process"] == [(True, False, state)] * 3
    assert out["own_groups"] == (True, True)
    assert out["forged"] == {k: (True, True, state)
                             for k in ("token", "pid", "no token", "destroyed")}
    # the fork parent: another process
    parent = pickle.loads(out["pickled"])
    assert parent.model_parallel_group is None and parent.is_detached()
    assert parent.state_dict() == state
    # a fresh interpreter
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
         os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", _FRESH], input=out["pickled"],
                         capture_output=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr.decode()
    none, detached, sd, err, params = ast.literal_eval(run.stdout.decode())
    assert (none, detached, sd, params) == (True, True, state, [1.0, 1.0])
    assert "unpickled without its model_parallel_group" in err, err
    assert set(out["errors"]) == {"unscale_", "step", "update", "_unscale_grads_"}
    for what, msg in out["errors"].items():
        assert "unpickled without its model_parallel_group" in msg, msg
        assert "set_model_parallel_group(group)" in msg, msg
    assert out["grad_untouched"]  # refused before any grad was unscaled
    sd, params, detached = out["after_attach"]
    # second clean step: tracker 2 of 3; p = 1 - 0.5 - 0.5
    assert sd["scale"] == 8.0 and sd["_growth_tracker"] == 2 and params == [0.0, 0.0]
    assert not detached
    assert out["disabled"] == (False, None, [0.5, 0.5])


def _agreement_worker(rank, world):
    group = dist.new_group(list(range(world)))
    out = {}

    def mine(step):
        return OVERFLOW_AT.get(step) == rank

    def new():
        return ModelParallelGradScaler("cpu", **KW, model_parallel_group=group)

    for name, kind, unscale in LOOPS:
        got = run_loop(kind, new(), unscale=unscale, overflow_here=mine)
        ref = _torch_reference(kind, unscale)
        out[name] = _summary(got, ref)

    # found_inf of each one-element shape, the overflow on rank 1 only
    shapes = {}
    for shape in SHAPES:
        p = nn.Parameter(torch.zeros(2))
        opt = torch.optim.SGD([p], lr=1.0)
        p.grad = torch.tensor([4.0, float("inf") if rank == 1 else 8.0])
        flags = new()._unscale_grads_(opt, torch.full(shape, 0.5), torch.zeros(shape), True)
        shapes[shape] = ([tuple(f.shape) for f in flags.values()],
                              [f.item() for f in flags.values()])
    out["shapes"] = shapes

    # copies between iterations, each at step 3
    def state_dict_reload(step, scaler):
        if step != 3:
            return scaler
        fresh = ModelParallelGradScaler("cpu", model_parallel_group=group)
        fresh.load_state_dict(scaler.state_dict())
        return fresh

    def deep_copy(step, scaler):
        if step != 3:
            return scaler
        new_scaler = copy.deepcopy(scaler)
        assert new_scaler.model_parallel_group is group
        return new_scaler

    def pickle_round_trip(step, scaler):
        # same process: the same group back, no set_model_parallel_group call
        if step != 3:
            return scaler
        new_scaler = pickle.loads(pickle.dumps(scaler))
        assert new_scaler.model_parallel_group is group and not new_scaler.is_detached()
        return new_scaler

    for name, replace in (("state_dict", state_dict_reload), ("deepcopy", deep_copy),
                          ("pickle", pickle_round_trip)):
        for kind in ("sgd", "adam-fused"):
            got = run_loop(kind, new(), unscale=False, overflow_here=mine, replace=replace)
            out[f"{name}-{kind}"] = _summary(got, _torch_reference(kind, False))
    return out


def _summary(got, ref):
    return {"scales": got["scales"], "trackers": got["trackers"], "skipped": got["skipped"],
            "same_params_as_torch": all(torch.equal(a, b)
                                        for a, b in zip(got["params"], ref["params"])),
            "params": [p.tolist() for p in got["params"]]}


@pytest.fixture(scope="module")
def two_ranks():
    return run_workers(_agreement_worker, 2, timeout=SHORT)


COPIES = [f"{n}-{k}" for n in ("state_dict", "deepcopy", "pickle") for k in ("sgd", "adam-fused")]


@pytest.mark.parametrize("name", [n for n, _, _ in LOOPS] + COPIES)
def test_one_ranks_overflow_makes_every_rank_skip_and_back_off(two_ranks, name):
    r0, r1 = (r[name] for r in two_ranks)
    for r in (r0, r1):
        _assert_trace(r)  # the hand-worked trace on both ranks, each overflow on one rank
        assert r["same_params_as_torch"]  # = torch's scaler with the overflow on this rank
    assert r0["params"] == r1["params"]


def test_found_inf_of_any_one_element_shape_is_agreed(two_ranks):
    for r in two_ranks:
        for shape in SHAPES:
            shapes, values = r["shapes"][shape]
            assert shapes == [shape] and values == [1.0], (shape, shapes, values)


# ---- misuse: each bad argument or loaded value raises the documented exception type, with a
# message that names the argument or key (docs/spec.md section 14); runner: tests/misuse_utils.py

NAN = math.nan


def _torch_amp_opt(inner_cls=torch.optim.SGD, **kwargs):
    p = torch.nn.Parameter(torch.ones(3))
    inner = inner_cls([p], lr=0.1)
    return p, tpamp.TorchAMPOptimizer(inner, tpamp.ModelParallelGradScaler("cpu"), **kwargs)


def _step_twice_torch_amp():
    p, opt = _torch_amp_opt()
    opt.scale_loss(p.sum()).backward()
    opt.step()
    opt.step()


MISUSE_CASES = [
    # ModelParallelGradScaler
    ("mpgs-init_scale-0", lambda: tpamp.ModelParallelGradScaler("cpu", init_scale=0.0), ValueError, ["init_scale"]),
    ("mpgs-init_scale-negative", lambda: tpamp.ModelParallelGradScaler("cpu", init_scale=-8.0), ValueError, ["init_scale", "-8.0"]),
    ("mpgs-init_scale-1e39", lambda: tpamp.ModelParallelGradScaler("cpu", init_scale=1e39), ValueError, ["init_scale", "float32"]),
    ("mpgs-init_scale-nan", lambda: tpamp.ModelParallelGradScaler("cpu", init_scale=NAN), ValueError, ["init_scale", "nan"]),
    ("mpgs-growth_factor-1", lambda: tpamp.ModelParallelGradScaler("cpu", growth_factor=1.0), ValueError, ["growth_factor", "1.0"]),
    ("mpgs-backoff_factor-1.5", lambda: tpamp.ModelParallelGradScaler("cpu", backoff_factor=1.5), ValueError, ["backoff_factor", "1.5"]),
    ("mpgs-growth_interval-0", lambda: tpamp.ModelParallelGradScaler("cpu", growth_interval=0), ValueError, ["growth_interval", "0"]),
    ("mpgs-growth_interval-float", lambda: tpamp.ModelParallelGradScaler("cpu", growth_interval=2.5), TypeError, ["growth_interval", "2.5"]),
    ("mpgs-enabled-str", lambda: tpamp.ModelParallelGradScaler("cpu", enabled="yes"), TypeError, ["enabled", "'yes'"]),
    ("mpgs-device-int", lambda: tpamp.ModelParallelGradScaler(3), TypeError, ["device", "3"]),
    ("mpgs-group-int", lambda: tpamp.ModelParallelGradScaler("cpu", model_parallel_group=7), TypeError, ["model_parallel_group", "int"]),
    # TorchAMPOptimizer
    ("tamp-clip_grad-negative", lambda: _torch_amp_opt(clip_grad=-1.0), ValueError, ["clip_grad", "-1.0"]),
    ("tamp-clip_grad-nan", lambda: _torch_amp_opt(clip_grad=NAN), ValueError, ["clip_grad", "nan"]),
    ("tamp-norm_type-0.5", lambda: _torch_amp_opt(norm_type=0.5), ValueError, ["norm_type", "0.5"]),
    ("tamp-scaler-None", lambda: tpamp.TorchAMPOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1), None), TypeError, ["scaler", "NoneType"]),
    ("tamp-optimizer-list", lambda: tpamp.TorchAMPOptimizer([torch.ones(1)], tpamp.ModelParallelGradScaler("cpu")), TypeError, ["optimizer", "list"]),
    ("tamp-grad_stats_group-str", lambda: _torch_amp_opt(grad_stats_group="mp"), TypeError, ["grad_stats_group", "str"]),
    ("tamp-scale_loss-float", lambda: _torch_amp_opt()[1].scale_loss(2.0), TypeError, ["loss", "float"]),
    ("tamp-step-twice", _step_twice_torch_amp, RuntimeError, ["step", "backward"]),
    ("tamp-load-None", lambda: _torch_amp_opt()[1].load_state_dict(None), TypeError, ["state_dict", "None"]),
    ("tamp-load-missing-optimizer", lambda: _torch_amp_opt()[1].load_state_dict({"grad_scaler": {}}), KeyError, ["optimizer"]),
    ("tamp-load-adam-into-sgd", lambda: _torch_amp_opt()[1].load_state_dict({"optimizer": torch.optim.Adam([torch.nn.Parameter(torch.ones(3))]).state_dict()}), ValueError, ["momentum", "SGD"]),
    ("tamp-load-scaler-nan", lambda: _torch_amp_opt()[1].load_state_dict({"optimizer": torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1).state_dict(), "grad_scaler": {"scale": NAN, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000, "_growth_tracker": 0}}), ValueError, ["grad_scaler", "scale", "nan"]),
    ("tamp-load-scaler-tracker", lambda: _torch_amp_opt()[1].load_state_dict({"optimizer": torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1).state_dict(), "grad_scaler": {"scale": 8.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 10, "_growth_tracker": 10}}), ValueError, ["_growth_tracker", "10"]),
    ("tamp-load-scaler-missing", lambda: _torch_amp_opt()[1].load_state_dict({"optimizer": torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1).state_dict(), "grad_scaler": {"scale": 8.0}}), KeyError, ["grad_scaler", "growth_factor"]),
]


def test_every_case_is_refused_by_tpamp_itself():
    """Ids distinct; each case refused inside tpamp itself (tests/misuse_utils.py)."""
    assert_every_case_refused_by_tpamp(MISUSE_CASES)


@pytest.mark.parametrize("case_id,call,exc,words", MISUSE_CASES, ids=case_ids(MISUSE_CASES))
def test_misuse_raises_a_clear_error_naming_the_argument(case_id, call, exc, words):
    assert_raises_naming(case_id, call, exc, words)


# ---- load_state_dict: the constructor's rules, all or nothing (main e82d3a5 loaded anything) --


def _good_state(**changes):
    state = {"scale": 8.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 10,
             "_growth_tracker": 3}
    for k, v in changes.items():
        if v is DROP:
            del state[k]
        else:
            state[k] = v
    return state


def _load_into_scaler(state):
    def setup():
        scaler = tpamp.ModelParallelGradScaler("cpu", init_scale=2.0 ** 10, growth_interval=7)
        scaler.scale(torch.ones(())).item()  # the scale tensor exists
        picture = lambda: (scaler.state_dict(), scaler.get_scale())  # noqa: E731
        return picture, lambda: scaler.load_state_dict(state)
    return setup


SCALER_LOAD_MISUSE = [
    Case("mpgs-load-scale-nan", _load_into_scaler(_good_state(scale=NAN)), ValueError, ["scale", "nan"]),
    Case("mpgs-load-scale-inf", _load_into_scaler(_good_state(scale=math.inf)), ValueError, ["scale", "inf"]),
    Case("mpgs-load-scale-0", _load_into_scaler(_good_state(scale=0.0)), ValueError, ["scale", "0.0"]),
    Case("mpgs-load-scale-1e39", _load_into_scaler(_good_state(scale=1e39)), ValueError, ["scale", "float32"]),
    Case("mpgs-load-scale-str", _load_into_scaler(_good_state(scale="8")), TypeError, ["scale", "'8'"]),
    Case("mpgs-load-growth_factor-1", _load_into_scaler(_good_state(growth_factor=1.0)), ValueError, ["growth_factor", "1.0"]),
    Case("mpgs-load-growth_factor-inf", _load_into_scaler(_good_state(growth_factor=math.inf)), ValueError, ["growth_factor", "inf"]),
    Case("mpgs-load-backoff_factor-0", _load_into_scaler(_good_state(backoff_factor=0.0)), ValueError, ["backoff_factor", "0.0"]),
    Case("mpgs-load-backoff_factor-nan", _load_into_scaler(_good_state(backoff_factor=NAN)), ValueError, ["backoff_factor", "nan"]),
    Case("mpgs-load-growth_interval-0", _load_into_scaler(_good_state(growth_interval=0)), ValueError, ["growth_interval", "0"]),
    Case("mpgs-load-growth_interval-float", _load_into_scaler(_good_state(growth_interval=10.0)), TypeError, ["growth_interval", "10.0"]),
    Case("mpgs-load-growth_interval-2**31", _load_into_scaler(_good_state(growth_interval=2 ** 31)), ValueError, ["growth_interval", str(2 ** 31)]),
    Case("mpgs-load-tracker-negative", _load_into_scaler(_good_state(_growth_tracker=-1)), ValueError, ["_growth_tracker", "-1"]),
    Case("mpgs-load-tracker-interval", _load_into_scaler(_good_state(_growth_tracker=10)), ValueError, ["_growth_tracker", "10"]),
    Case("mpgs-load-tracker-float", _load_into_scaler(_good_state(_growth_tracker=1.5)), TypeError, ["_growth_tracker", "1.5"]),
    Case("mpgs-load-missing", _load_into_scaler(_good_state(backoff_factor=DROP)), KeyError, ["backoff_factor"]),
    Case("mpgs-load-None", _load_into_scaler(None), TypeError, ["state_dict", "None"]),
    Case("mpgs-load-list", _load_into_scaler([8.0]), TypeError, ["state_dict", "list"]),
]


def test_every_scaler_load_case_is_refused_by_tpamp_itself():
    assert_every_setup_case_refused_by_tpamp(SCALER_LOAD_MISUSE, case_ids(MISUSE_CASES))


@pytest.mark.parametrize("case", SCALER_LOAD_MISUSE, ids=[c.id for c in SCALER_LOAD_MISUSE])
def test_a_bad_scaler_state_is_refused_and_changes_nothing(case):
    assert_refused_and_unchanged(case)


def test_a_good_scaler_state_loads_every_number():
    scaler = tpamp.ModelParallelGradScaler("cpu", init_scale=2.0 ** 10, growth_interval=7)
    scaler.load_state_dict(_good_state())
    assert scaler.state_dict() == _good_state()
    # a disabled scaler loads nothing, as torch's
    off = tpamp.ModelParallelGradScaler("cpu", enabled=False)
    off.load_state_dict(_good_state(scale=NAN))
    assert off.state_dict() == {}


# ---- a scaler group on one rank only -----------------------------------------------------------


def _group_on_one_rank(rank, world):
    """Rank 0's scaler has the WORLD group, rank 1's none (the mistake): rank 1 steps alone and
    leaves; rank 0's found_inf all-reduce cannot complete."""
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.5)
    scaler = ModelParallelGradScaler(
        "cpu", init_scale=8.0, model_parallel_group=dist.group.WORLD if rank == 0 else None)
    scaler.scale(p.sum()).backward()
    try:
        scaler.step(opt)
        scaler.update()
    except RuntimeError as e:
        return "RuntimeError", str(e), p.detach().tolist(), scaler.get_scale()
    return None, "", p.detach().tolist(), scaler.get_scale()


def test_a_scaler_group_on_one_rank_only_is_named_by_the_rank_that_waits():
    (kind, msg, params, scale), rank1 = run_workers(_group_on_one_rank, 2, timeout=5)
    assert rank1[0] is None and rank1[2] == [0.5, 0.5]  # rank 1 steps alone: nothing to detect
    assert kind == "RuntimeError", (kind, msg)
    for word in ("ModelParallelGradScaler", "model_parallel_group", "[0, 1]",
                 "model_parallel_group=None"):
        assert word in msg, (word, msg)
    assert params == [1.0, 1.0] and scale == 8.0  # the params and the scale unchanged
