"""Replica agreement (tpamp.replicas): one flipped bit in one rank's master, moment, model param
or gradient is found and named exactly -- the param, the tensor, the ranks and the element range
-- by every rank alike; clean replicas give no false positive.

The expected records are written down from the injection (which rank, which param, which
element), never computed by tpamp. The checksum is compared against a pure-Python reference of
its documented definition.
"""

from __future__ import annotations

import struct
import warnings

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_workers
from misuse_utils import assert_every_case_refused_by_tpamp, assert_raises_naming, case_ids

import tpamp
from tpamp.replicas import (
    ReplicaChecker,
    ReplicaMismatch,
    ReplicaMismatchError,
    check_replicas,
    flip_bit,
    tensor_checksum,
)

M32 = 0xFFFFFFFF


# ----------------------------------------------------------------- the checksum, single process


def _reference_checksum(t: torch.Tensor):
    """The documented definition in plain Python ints: the bytes as little-endian 32-bit words
    (a 1-3 byte tail one word per byte), each xor-ed with (position * P) mod 2**32 and mixed
    (x ^= x >> 16; x *= c1; x ^= x >> 15; x *= c2; x ^= x >> 16, mod 2**32), summed mod 2**32."""
    data = t.contiguous().reshape(-1).view(torch.uint8).tolist()
    n4 = len(data) // 4
    words = [int.from_bytes(bytes(data[4 * i: 4 * i + 4]), "little") for i in range(n4)]
    words += data[4 * n4:]
    lanes = []
    for p, (c1, c2) in ((0x1E3779B1, (0x45D9F3B, 0x119DE1F3)), (0x3C6EF35F, (0x2C1B3C6D, 0x297A2D39))):
        total = 0
        for i, w in enumerate(words):
            x = w ^ ((i * p) & M32)
            x ^= x >> 16
            x = (x * c1) & M32
            x ^= x >> 15
            x = (x * c2) & M32
            x ^= x >> 16
            total = (total + x) & M32
        lanes.append(total)
    return lanes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.uint8,
                                   torch.int16, torch.float8_e4m3fn, torch.int64])
@pytest.mark.parametrize("n", [0, 1, 3, 257])
def test_checksum_matches_reference(dtype, n):
    t = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 50).to(dtype)
    assert tensor_checksum(t).tolist() == _reference_checksum(t)


def test_checksum_sees_every_single_bit_and_a_swap():
    t = torch.randn(7, generator=torch.Generator().manual_seed(0))
    base = tensor_checksum(t).tolist()
    for i in range(7):
        for bit in range(32):
            u = t.clone()
            flip_bit(u, i, bit)
            got = tensor_checksum(u).tolist()
            assert got[0] != base[0] and got[1] != base[1], (i, bit)
    swapped = t.clone()
    swapped[[0, 1]] = t[[1, 0]]
    assert tensor_checksum(swapped).tolist() != base
    # a non-contiguous view: the checksum of its values, as a contiguous copy has
    m = torch.randn(6, 5).t()
    assert tensor_checksum(m).tolist() == tensor_checksum(m.contiguous()).tolist()


def test_flip_bit_against_struct():
    t = torch.tensor([1.5, -2.25, 3.0], dtype=torch.float32)
    flip_bit(t, 1, 31)  # the sign bit
    assert t.tolist() == [1.5, 2.25, 3.0]
    flip_bit(t, 2, 0)  # the lowest mantissa bit
    want = struct.unpack("<f", (struct.unpack("<I", struct.pack("<f", 3.0))[0] ^ 1).to_bytes(4, "little"))[0]
    assert t[2].item() == want
    h = torch.tensor([1.0, 1.0], dtype=torch.float16)
    flip_bit(h, 0, 10)  # fp16: the lowest exponent bit, 1.0 -> 0.5
    assert h.tolist() == [0.5, 1.0]


MISUSE = [
    ("flip-index-type", lambda: flip_bit(torch.zeros(3), 1.0, 0), TypeError, ["index"]),
    ("flip-index-range", lambda: flip_bit(torch.zeros(3), 3, 0), ValueError, ["index", "3"]),
    ("flip-bit-range", lambda: flip_bit(torch.zeros(3, dtype=torch.float16), 0, 16), ValueError,
     ["bit", "16"]),
    ("flip-noncontiguous", lambda: flip_bit(torch.zeros(3, 4).t(), 0, 0), ValueError,
     ["contiguous"]),
]


@pytest.mark.parametrize("case_id, call, exc, words", MISUSE, ids=case_ids(MISUSE))
def test_misuse(case_id, call, exc, words):
    assert_raises_naming(case_id, call, exc, words)


def test_misuse_refused_by_tpamp():
    assert_every_case_refused_by_tpamp(MISUSE)


def test_record_text():
    m = ReplicaMismatch("blocks.0.ln.weight", "exp_avg", "data-parallel", (3,), (0, 1, 2), 17, 18,
                        256, ("[tp 1, pp 0, dp 1]",))
    assert str(m) == ("blocks.0.ln.weight exp_avg over the data-parallel group: rank 3 "
                      "[tp 1, pp 0, dp 1] differs from rank 0, rank 1, rank 2 in elements "
                      "[17, 18) of 256 (first at 17)")
    assert m.as_record()["ranks"] == [3]


# ----------------------------------------------------------------- multi-process

def _params(st, dtype):
    """A TP-sharded weight (its values differ per TP rank) and a TP-duplicated LayerNorm
    weight, the same on every DP replica."""
    g = torch.Generator().manual_seed(100 + st.tp_rank)
    w = torch.nn.Parameter(torch.randn(64, 40, generator=g).to(dtype))
    w.tensor_model_parallel, w.partition_dim, w.partition_stride = True, 0, 1
    ln = torch.nn.Parameter(torch.ones(300, dtype=dtype))
    return [("layers.0.fc.weight", w), ("layers.0.ln.weight", ln)]


def _set_grads(named, st, step):
    for name, p in named:
        seed = 1000 * step + (st.tp_rank if getattr(p, "tensor_model_parallel", False) else 7)
        p.grad = (torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.1).to(p.dtype)


def _build(st, named, kind, **kw):
    inner = torch.optim.AdamW([p for _, p in named], lr=1e-2)
    if kind == "distributed":
        return tpamp.DistributedOptimizer(
            inner, grad_scaler=tpamp.ConstantGradScaler(1.0), data_parallel_group=st.dp_group,
            grad_stats_group=dist.group.WORLD,
            param_names=named, parallel_state=st, **kw)
    return tpamp.MixedPrecisionOptimizer(
        inner, grad_scaler=tpamp.ConstantGradScaler(1.0), grad_stats_group=st.model_parallel_group,
        tensor_parallel_group=st.tp_group, param_names=named, parallel_state=st, **kw)


def _flip_worker(rank, world, tp, steps, targets, kind, opts):
    """``steps`` clean steps, then for each target (global rank, tensor, element, bit, param
    name): on that rank flip the bit of that element of the param's tensor, check, flip it
    back; a "grad" target flips the grad before one more step (last: it cannot be undone).
    Returns (the clean check, [the records of each target])."""
    st = tpamp.parallel.initialize_model_parallel(tp, 1)
    named = _params(st, torch.float16)
    opt = _build(st, named, kind, **opts)
    for step in range(steps):
        _set_grads(named, st, step)
        opt.step()
        opt.zero_grad()
    clean = [tuple(m) for m in check_replicas(opt, parallel_state=st)]
    found = []
    for frank, what, index, bit, pname in targets:
        if what == "grad":
            _set_grads(named, st, steps)
            if rank == frank:
                flip_bit(dict(named)[pname].grad, index, bit)
            opt.step()
            opt.zero_grad()
            found.append([tuple(m) for m in check_replicas(opt, parallel_state=st)])
            continue
        tensors = {n: t for n, _, t in opt.replica_tensors()}[pname]
        if rank == frank:
            flip_bit(tensors[what], index, bit)
        found.append([tuple(m) for m in check_replicas(opt, parallel_state=st)])
        if rank == frank:
            flip_bit(tensors[what], index, bit)
        assert check_replicas(opt, parallel_state=st) == []  # flipped back: clean again
    return clean, found


def _dp_ranks(tp, world, rank):
    return tuple(r for r in range(world) if r % tp == rank % tp)


def _tp_ranks(tp, rank):
    return tuple(range(rank - rank % tp, rank - rank % tp + tp))


def _where(tp, r):
    return f"[tp {r % tp}, pp 0, dp {r // tp}]"


DP2_TARGETS = [("main_param", 0), ("exp_avg", 30), ("exp_avg_sq", 3), ("param", 15),
               ("step", 20)]


def test_dp2_flip_named():
    """DP 2: the two replicas disagree; both named (no majority of two), the element exact;
    master, both moments, the model param and the step count."""
    targets = [(1, what, 0 if what == "step" else 37, bit, "layers.0.fc.weight")
               for what, bit in DP2_TARGETS]
    out = run_workers(_flip_worker, 2, 1, 2, targets, "mpo", {}, timeout=60)
    want = [[("layers.0.fc.weight", what, "data-parallel", (0, 1), (), index, index + 1,
              1 if what == "step" else 64 * 40, (_where(1, 0), _where(1, 1)), "")]
            for _, what, index, _, _ in targets]
    for clean, found in out:
        assert clean == []
        assert found == want


def test_dp4_majority_names_the_rank():
    """DP 4: three replicas agree, the fourth is named alone, the others as majority."""
    targets = [(2, "main_param", 299, 5, "layers.0.ln.weight"),
               (0, "exp_avg_sq", 0, 31, "layers.0.ln.weight"),
               (3, "param", 150, 1, "layers.0.ln.weight")]
    out = run_workers(_flip_worker, 4, 1, 2, targets, "mpo", {}, timeout=60)
    want = [[("layers.0.ln.weight", what, "data-parallel", (r,),
              tuple(o for o in range(4) if o != r), i, i + 1, 300, (_where(1, r),), "")]
            for r, what, i, _, _ in targets]
    for clean, found in out:
        assert clean == [] and found == want


def test_tp2_dp2_flips_named():
    """TP 2 x DP 2: a flipped bit in a TP-duplicated LayerNorm master is seen over its DP pair
    and its TP pair (the rank in both is the corrupted one); a TP-sharded weight differs across
    TP by design, so a flip there is reported over DP only. Every rank holds every record."""
    targets = [(0, "main_param", 123, 9, "layers.0.ln.weight"),
               (3, "main_param", 123, 9, "layers.0.ln.weight"),
               (1, "exp_avg", 2000, 12, "layers.0.fc.weight")]
    out = run_workers(_flip_worker, 4, 2, 2, targets, "mpo", {}, timeout=60)
    want = []
    for frank in (0, 3):
        dp, tpr = _dp_ranks(2, 4, frank), _tp_ranks(2, frank)
        want.append(sorted([
            ("layers.0.ln.weight", "main_param", "data-parallel", dp, (), 123, 124, 300,
             tuple(_where(2, r) for r in dp), ""),
            ("layers.0.ln.weight", "main_param", "tensor-parallel", tpr, (), 123, 124, 300,
             tuple(_where(2, r) for r in tpr), ""),
        ]))
    want.append([("layers.0.fc.weight", "exp_avg", "data-parallel", (1, 3), (), 2000, 2001,
                  2560, (_where(2, 1), _where(2, 3)), "")])
    for clean, found in out:
        assert clean == [] and [sorted(f) for f in found] == want
        for frank, f in zip((0, 3), found):
            assert set(f[0][3]) & set(f[1][3]) == {frank}


def test_grad_flip_reaches_every_stepped_tensor():
    """A bit flipped in one replica's grad before the step: its master, both moments and the
    model param differ after it, at that element (the step count does not)."""
    out = run_workers(_flip_worker, 2, 1, 2, [(0, "grad", 5, 9, "layers.0.ln.weight")], "mpo",
                      {}, timeout=60)
    for clean, (found,) in out:
        assert clean == []
        got = {(f[0], f[1], f[3], f[5], f[6]) for f in found}
        assert got == {("layers.0.ln.weight", k, (0, 1), 5, 6)
                       for k in ("main_param", "exp_avg", "exp_avg_sq", "param")}


def test_narrow_state_flip_named():
    """bf16 moments (tpamp.state_formats): the raw bytes are compared."""
    out = run_workers(_flip_worker, 2, 1, 2, [(1, "exp_avg", 41, 2, "layers.0.ln.weight")],
                      "mpo", {"exp_avg_dtype": torch.bfloat16}, timeout=60)
    for clean, (found,) in out:
        assert clean == [] and [f[:7] for f in found] == [
            ("layers.0.ln.weight", "exp_avg", "data-parallel", (0, 1), (), 41, 42)]


def test_distributed_optimizer_compares_model_params_only():
    """DistributedOptimizer shards the masters and moments over DP: only the model params are
    replicas, and only they are listed (replicated_state False). A flipped model param is
    found."""
    out = run_workers(_flip_worker, 2, 1, 2, [(1, "param", 77, 14, "layers.0.fc.weight")],
                      "distributed", {}, timeout=60)
    for clean, (found,) in out:
        assert clean == [] and [f[:7] for f in found] == [
            ("layers.0.fc.weight", "param", "data-parallel", (0, 1), (), 77, 78)]


def _clean_worker(rank, world, steps):
    st = tpamp.parallel.initialize_model_parallel(2, 1)
    named = _params(st, torch.float16)
    opt = _build(st, named, "mpo")
    checker = ReplicaChecker(opt, 1, parallel_state=st)
    for step in range(steps):
        _set_grads(named, st, step)
        opt.step()
        opt.zero_grad()
        checker.maybe_check(step + 1)
    return checker.history


def test_no_false_positive_over_clean_steps():
    assert run_workers(_clean_worker, 4, 200, timeout=120) == [[]] * 4


def _policy_worker(rank, world, policy):
    st = tpamp.parallel.initialize_model_parallel(1, 1)
    named = _params(st, torch.float16)
    opt = _build(st, named, "mpo")
    checker = ReplicaChecker(opt, 2, on_mismatch=policy, parallel_state=st)
    _set_grads(named, st, 0)
    opt.step()
    if rank == 1:
        flip_bit(opt.replica_tensors()[1][2]["main_param"], 3, 4)
    assert checker.maybe_check(1) is None  # not a multiple of 2: no check, no collective
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            checker.maybe_check(2)
    except ReplicaMismatchError as e:
        return "raised", e.iteration, str(e)
    return "warned", [str(w.message) for w in caught], len(checker.history)


def test_policies_raise_and_warn_on_every_rank():
    text = ("replicas disagree at iteration 2: layers.0.ln.weight main_param over the "
            "data-parallel group: rank 0 [tp 0, pp 0, dp 0], rank 1 [tp 0, pp 0, dp 1] "
            "disagree in elements [3, 4) of 300 (first at 3)")
    assert run_workers(_policy_worker, 2, "raise", timeout=60) == [("raised", 2, text)] * 2
    assert run_workers(_policy_worker, 2, "warn", timeout=60) == [("warned", [text], 1)] * 2


def _settings_worker(rank, world, interval, policy):
    st = tpamp.parallel.initialize_model_parallel(1, 1)
    opt = _build(st, _params(st, torch.float16), "mpo")
    try:
        ReplicaChecker(opt, interval[rank], on_mismatch=policy[rank], parallel_state=st)
    except ValueError as e:
        return str(e)
    return None


def test_per_rank_settings_mismatch_refused_on_every_rank():
    out = run_workers(_settings_worker, 2, (100, 50), ("raise", "raise"), timeout=60)
    assert all(o is not None and "interval=100" in o and "interval=50" in o for o in out)
    out = run_workers(_settings_worker, 2, (10, 10), ("raise", "warn"), timeout=60)
    assert all(o is not None and "'warn'" in o for o in out)


def _misuse_worker(rank, world):
    st = tpamp.parallel.initialize_model_parallel(1, 1)
    opt = _build(st, _params(st, torch.float16), "mpo")
    calls = {
        "interval-float": lambda: ReplicaChecker(opt, 2.0),
        "interval-zero": lambda: ReplicaChecker(opt, 0),
        "interval-negative": lambda: ReplicaChecker(opt, -1),
        "interval-bool": lambda: ReplicaChecker(opt, True),
        "on-mismatch-value": lambda: ReplicaChecker(opt, 1, on_mismatch="stop"),
        "on-mismatch-type": lambda: ReplicaChecker(opt, 1, on_mismatch=None),
        "optimizer-type": lambda: ReplicaChecker(opt.optimizer, 1),
        "group-type": lambda: ReplicaChecker(opt, 1, data_parallel_group="dp"),
        "state-type": lambda: check_replicas(opt, parallel_state=object()),
        "block-size": lambda: check_replicas(opt, block_size=0),
        "iteration-type": lambda: ReplicaChecker(opt, 1).maybe_check(1.5),
    }
    out = {}
    for key, call in calls.items():
        try:
            call()
            out[key] = None
        except Exception as e:  # noqa: BLE001 - reported to the parent
            out[key] = (type(e).__name__, str(e))
    return out


def test_checker_misuse():
    out = run_workers(_misuse_worker, 2, timeout=60)[0]
    want = {
        "interval-float": ("TypeError", "interval"), "interval-zero": ("ValueError", "interval"),
        "interval-negative": ("ValueError", "-1"), "interval-bool": ("TypeError", "interval"),
        "on-mismatch-value": ("ValueError", "'stop'"), "on-mismatch-type": ("TypeError", "NoneType"),
        "optimizer-type": ("TypeError", "AdamW"), "group-type": ("TypeError", "data_parallel_group"),
        "state-type": ("TypeError", "ParallelState"), "block-size": ("ValueError", "block_size"),
        "iteration-type": ("TypeError", "iteration"),
    }
    for key, (exc, word) in want.items():
        assert out[key] is not None and out[key][0] == exc and word in out[key][1], (key, out[key])


def test_check_replicas_needs_a_process_group():
    opt = tpamp.FP32Optimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1))
    with pytest.raises(RuntimeError, match="torch.distributed"):
        check_replicas(opt)
