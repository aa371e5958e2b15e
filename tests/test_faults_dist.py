"""Multi-rank faults end in errors, never in hangs (docs/spec.md section 12; tpamp.parallel's docstring says
what a user sees). Fork-started gloo ranks (tests/dist_utils) with timeouts of a few seconds:

* ranks of one grad-stats group whose settings differ get the same ValueError on every rank at
  the first step, before a collective could desynchronise;
* every group initialize_model_parallel builds carries its timeout (default: the default
  group's), so a peer that is alive but never joins ends in a RuntimeError after seconds;
* a crashed peer, and a peer that swallows an exception and goes elsewhere, end the same way.
"""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_workers

import tpamp
from tpamp.parallel import initialize_model_parallel

SHORT = 2.0  # seconds: the default group's timeout in these runs


def _optimizer(st, **overrides):
    kw = dict(norm_type=2.0, log_num_zeros_in_grad=False, hysteresis=2)
    kw.update(overrides)
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    scaler = tpamp.DynamicGradScaler(initial_scale=8.0, hysteresis=kw.pop("hysteresis"))
    opt = tpamp.MixedPrecisionOptimizer(
        torch.optim.SGD([p], lr=0.1), grad_scaler=scaler,
        grad_stats_group=st.grad_stats_group, tensor_parallel_group=st.tp_group, **kw)
    return p, opt


def _one_step(p, opt):
    p.grad = torch.full((4,), 8.0, dtype=torch.float16)  # a grad of ones, times the loss scale 8
    return opt.step()


MISMATCHES = [  # (setting, the value on the last rank, how the message shows it)
    ("log_num_zeros_in_grad", True, "rank 1: 1"),
    ("norm_type", float("inf"), "rank 1: inf"),
    ("hysteresis", 3, "rank 1: 3"),
]


def _settings_checks(rank, world):
    st = initialize_model_parallel(world, 1)
    p, opt = _optimizer(st, log_num_zeros_in_grad=True)
    out = {"matching": tuple(_one_step(p, opt))}
    for setting, value, _ in MISMATCHES:  # each case: a fresh optimizer, so a first step
        p, opt = _optimizer(st, **({setting: value} if rank == world - 1 else {}))
        try:
            _one_step(p, opt)
        except ValueError as e:
            out[setting] = ("ValueError", str(e))
        except Exception as e:  # anything else (a gloo error) fails the check below
            out[setting] = (type(e).__name__, str(e))
        else:
            out[setting] = (None, None)
    # the torch.amp path: TorchAMPOptimizer with a ModelParallelGradScaler
    q = torch.nn.Parameter(torch.ones(4))
    interval = 100 if rank == world - 1 else 2000
    scaler = tpamp.ModelParallelGradScaler("cpu", growth_interval=interval,
                                           model_parallel_group=st.model_parallel_group)
    topt = tpamp.TorchAMPOptimizer(torch.optim.SGD([q], lr=0.1), scaler,
                                   grad_stats_group=st.grad_stats_group)
    topt.scale_loss(q.sum()).backward()
    try:
        topt.step()
    except ValueError as e:
        out["torch_amp"] = ("ValueError", str(e))
    except Exception as e:
        out["torch_amp"] = (type(e).__name__, str(e))
    else:
        out["torch_amp"] = (None, None)
    return out


@pytest.fixture(scope="module")
def settings_results():
    return run_workers(_settings_checks, 2, timeout=SHORT)


@pytest.mark.parametrize("setting,value,shown", MISMATCHES, ids=[m[0] for m in MISMATCHES])
def test_settings_that_differ_across_ranks_raise_the_same_error_on_every_rank(
    settings_results, setting, value, shown
):
    results = [r[setting] for r in settings_results]
    assert {kind for kind, _ in results} == {"ValueError"}, results
    msgs = {msg for _, msg in results}
    assert len(msgs) == 1, results  # the same message on every rank
    msg = msgs.pop()
    assert msg.startswith(f"{setting} differs"), msg
    assert shown in msg and "rank 0:" in msg, msg


def test_torch_amp_optimizer_settings_are_checked_across_ranks_too(settings_results):
    results = [r["torch_amp"] for r in settings_results]
    assert {kind for kind, _ in results} == {"ValueError"}, results
    assert len({msg for _, msg in results}) == 1, results
    assert "growth_interval differs" in results[0][1] and "rank 1: 100" in results[0][1]


def test_matching_settings_pass_the_check_and_step(settings_results):
    for r in settings_results:
        ok, norm, zeros = r["matching"]
        # a replicated param of four ones, counted on TP rank 0 only
        assert ok and norm == 2.0 and zeros == 0


def _group_timeouts(rank, world, explicit):
    timeout = datetime.timedelta(seconds=explicit) if explicit else None
    st = initialize_model_parallel(2, 2, timeout=timeout)
    groups = {"tp": st.tp_group, "pp": st.pp_group, "dp": st.dp_group,
              "model_parallel": st.model_parallel_group, "embedding": st.embedding_group,
              "mesh tp": st.tp_mesh.get_group()}
    # the gloo backend's own setting (torch has no public getter for a group's timeout)
    return {name: g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
            for name, g in groups.items()}


@pytest.mark.parametrize("explicit", [None, 1.5], ids=["default-group-timeout", "explicit"])
def test_every_group_carries_the_timeout(explicit):
    for per_group in run_workers(_group_timeouts, 4, explicit, timeout=SHORT):
        expected = explicit or SHORT
        assert per_group == dict.fromkeys(per_group, expected), per_group


def _hung_peer(rank, world):
    st = initialize_model_parallel(world, 1)  # the groups inherit the default group's timeout
    p, opt = _optimizer(st)
    _one_step(p, opt)  # both ranks: settings agreed, one real step
    if rank == 1:
        # alive but never joins the next step; the peer must not wait for it
        time.sleep(SHORT + 3.0)  # it exits after that: the peer must have timed out before
        return "slept", ""
    try:
        _one_step(p, opt)
    except RuntimeError as e:
        return "RuntimeError", str(e)
    return "stepped", ""  # it waited for the sleeper: the group has no usable timeout


def test_a_hung_peer_ends_in_a_runtime_error_not_a_hang():
    (kind, msg), (peer, _) = run_workers(_hung_peer, 2, timeout=SHORT)
    assert peer == "slept"
    assert kind == "RuntimeError", (kind, msg)
    # a timeout, not the sleeper's exit closing the connection (a 30-minute group would have
    # waited until then); gloo says "Timed out waiting 2000ms for recv operation"
    assert "timed out" in msg.lower(), msg


def _crashed_peer(rank, world):
    st = initialize_model_parallel(world, 1)
    p, opt = _optimizer(st)
    _one_step(p, opt)
    if rank == 1:
        return "crashed", ""  # the harness then tears down this process: its sockets close
    time.sleep(0.5)
    try:
        _one_step(p, opt)
    except RuntimeError as e:
        return "RuntimeError", str(e)
    return "stepped", ""


def test_a_crashed_peer_ends_in_a_runtime_error():
    (kind, msg), (peer, _) = run_workers(_crashed_peer, 2, timeout=SHORT)
    assert peer == "crashed"
    assert kind == "RuntimeError", (kind, msg)


def _swallowing_peer(rank, world):
    st = initialize_model_parallel(world, 1)
    p, opt = _optimizer(st)
    _one_step(p, opt)
    if rank == 1:
        try:
            opt.scale_loss(None)  # a local error, raised before any collective...
        except TypeError:
            pass  # ...swallowed; the rank skips the step and goes on to other collective work
        try:
            dist.barrier()
        except RuntimeError as e:
            return "swallowed; barrier: RuntimeError", str(e)
        return "swallowed; barrier passed", ""
    try:
        _one_step(p, opt)
    except RuntimeError as e:
        return "RuntimeError", str(e)
    return "stepped", ""


def test_a_rank_that_swallows_an_exception_leaves_its_peer_a_runtime_error():
    (kind, msg), (peer, _) = run_workers(_swallowing_peer, 2, timeout=SHORT)
    assert kind == "RuntimeError", (kind, msg)
    assert peer.startswith("swallowed"), peer
