"""Replica agreement: do the ranks that must hold equal copies of a tensor still hold them,
bit for bit?

Under data parallelism every DP replica holds the same model params, and (unless a distributed
optimizer shards them) the same fp32 masters and optimizer state; under tensor parallelism a
param that is not ``tensor_model_parallel`` (layer norms, row-parallel biases) is duplicated on
every TP rank. A silent data corruption (a bit flipped in memory or by a faulty core), a rank
that skipped a step the others took, or a bug in a custom collective makes one copy drift, and
nothing in the step notices: the replicas go on training different models. :func:`check_replicas`
finds it.

How. For every param, each tensor this rank holds for it (:meth:`MixedPrecisionOptimizer.replica_tensors`:
the model param, the fp32 master, every optimizer state tensor, narrow formats' raw codes and
scales) gets a 64-bit checksum of its raw bytes, computed on the tensor's device with integer
arithmetic only (the bytes as 32-bit words, each word mixed with its position by a bijective
integer hash, two independent 32-bit lanes summed: any change of one element changes both
lanes; no host copy of a tensor). The checksums of a group are compared in one small
``all_gather`` per group (the data-parallel group for everything replicated over DP; the
tensor-parallel group for the TP duplicates; the expert groups for expert params when the
expert layout differs). Only on a mismatch, a second round inside that group finds the first
differing element: per-block checksums (``block_size`` words) in one ``all_gather``, then the raw
bytes of the first differing block in one more. Every rank then agrees on the verdict (one
all-reduce of a flag over ``group``, the world by default, and on a mismatch one
``all_gather_object`` of the records), so every rank raises or warns alike and none hangs.

What is compared. MixedPrecisionOptimizer / FP32Optimizer: every tensor over DP; the TP
duplicates' tensors over TP. :class:`tpamp.DistributedOptimizer` and
:class:`tpamp.LayerWiseDistributedOptimizer` shard the masters and optimizer state over DP:
nothing replicated to compare there, so only the model params are (over DP, and the TP
duplicates over TP). A DTensor param on the 1-D TP mesh (torch's tensor parallelism) is a TP
duplicate when all its placements are Replicate; DTensors on a larger mesh (FSDP2, sharded over
DP) are refused: their shards are not copies.
Tied params (the word embedding and the last stage's output-layer copy) are not compared across
pipeline stages.

Usage::

    checker = tpamp.replicas.ReplicaChecker(opt, interval=100, on_mismatch="raise",
                                            parallel_state=st)
    for it in range(1, iters + 1):
        ...; opt.step(); opt.zero_grad()
        checker.maybe_check(it)   # every 100th iteration; raises ReplicaMismatchError

    # ReplicaMismatchError: replicas disagree at iteration 300: blocks.1.ln1.weight main_param
    # over the data-parallel group: rank 3 [tp 1, pp 0, dp 1] differs from rank 1
    # [tp 1, pp 0, dp 0] in elements [17, 18) of 256 (first at 17)

The idea of a periodic cross-replica checksum is Megatron-LM's ``--check-weight-hash-across-dp-replicas-interval``
(one SHA-256 of each model param on the host over DP); this one also covers the masters, the
optimizer state and the TP duplicates, runs on the device, and names where the copies differ.
"""

from __future__ import annotations

import hashlib
import warnings
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from tpamp._checks import check_group_member, check_int
from tpamp.common import collective_device, is_dtensor
from tpamp.grad_stats import is_expert_param

__all__ = [
    "ReplicaMismatch",
    "ReplicaMismatchError",
    "ReplicaChecker",
    "check_replicas",
    "tensor_checksum",
    "is_tp_duplicate",
    "flip_bit",
    "ON_MISMATCH",
]

Tensor = torch.Tensor
ON_MISMATCH = ("raise", "warn")
_M32 = 0xFFFFFFFF
_CHUNK = 1 << 22  # words hashed per pass (bounds the int64 scratch: 32 MiB per lane)
# odd 31-bit multipliers (products with 32-bit values stay below 2**63: no int64 overflow)
_POS = (0x1E3779B1, 0x3C6EF35F)
_MUL = ((0x45D9F3B, 0x119DE1F3), (0x2C1B3C6D, 0x297A2D39))


class ReplicaMismatch(NamedTuple):
    """Copies of one tensor that differ across the ranks that must hold equal ones.

    name: the param's name (the optimizer's ``param_names``, as ``last_nonfinite`` uses).
    tensor: which of its tensors: ``"param"`` (the model param), ``"main_param"`` (the fp32
    master), ``"param_remainder"``, or an optimizer state key (``"exp_avg"``, ...); ``"layout"``
    when the ranks do not even hold the same list of tensors (``detail`` says how).
    group: ``"data-parallel"``, ``"tensor-parallel"``, ``"expert-data-parallel"`` or
    ``"expert-tensor-parallel"``: the group over which the copies must agree.
    ranks: the global ranks whose copy differs from the majority's (with no strict majority,
    e.g. 2 replicas, every rank of the group). others: the global ranks that hold the majority
    copy (empty without a majority). start, stop: the first differing element range of this
    rank-local tensor flattened (elements ``[start, stop)`` of the first differing block: for
    one flipped bit, ``stop == start + 1``); numel: its number of elements. where: the
    coordinates of each rank in ``ranks`` (``"[tp 1, pp 0, dp 1]"``, or ``""`` without a
    parallel state), detail: more text (for ``"layout"``).
    """

    name: str
    tensor: str
    group: str
    ranks: Tuple[int, ...]
    others: Tuple[int, ...]
    start: int
    stop: int
    numel: int
    where: Tuple[str, ...] = ()
    detail: str = ""

    def as_record(self) -> dict:
        """A JSON-ready dict of the fields."""
        d = self._asdict()
        d["ranks"], d["others"], d["where"] = list(self.ranks), list(self.others), list(self.where)
        return d

    def __str__(self) -> str:
        def show(ranks, where=()):
            return ", ".join(f"rank {r}{' ' + w if w else ''}" for r, w in
                             zip(ranks, list(where) + [""] * len(ranks)))
        if self.tensor == "layout":
            return f"{self.name}: the {self.group} ranks {show(self.ranks)} hold different tensors ({self.detail})"
        who = (f"{show(self.ranks, self.where)} differs from {show(self.others)}" if self.others
               else f"{show(self.ranks, self.where)} disagree")
        return (f"{self.name} {self.tensor} over the {self.group} group: {who} in elements "
                f"[{self.start}, {self.stop}) of {self.numel} (first at {self.start})")


class ReplicaMismatchError(RuntimeError):
    """Raised (on every rank alike) by :meth:`ReplicaChecker.check` with ``on_mismatch="raise"``;
    ``mismatches`` holds the :class:`ReplicaMismatch` records and ``iteration`` the iteration."""

    def __init__(self, mismatches: Sequence[ReplicaMismatch], iteration=None):
        self.mismatches = list(mismatches)
        self.iteration = iteration
        super().__init__(describe(self.mismatches, iteration))


def describe(mismatches: Sequence[ReplicaMismatch], iteration=None) -> str:
    """One line per record, after a header naming the iteration."""
    at = f" at iteration {iteration}" if iteration is not None else ""
    return f"replicas disagree{at}: " + "; ".join(str(m) for m in mismatches)


# ------------------------------------------------------------------------ checksums


def _words(t: Tensor) -> Tensor:
    """The raw bytes of ``t`` (any dtype, contiguous or not) as a 1-D int64 tensor of 32-bit
    words in [0, 2**32) (a tail of 1-3 bytes as one word per byte), on ``t``'s device."""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    n4 = b.numel() // 4
    words = b[: n4 * 4].view(torch.int32).to(torch.int64) & _M32
    if b.numel() % 4:
        words = torch.cat([words, b[n4 * 4:].to(torch.int64)])
    return words


def _mix(words: Tensor, first: int, lane: int) -> Tensor:
    """A bijective 32-bit hash of each word xor-ed with its position (``first`` = the
    position of ``words[0]``), in int64 arithmetic that never overflows."""
    pos = torch.arange(first, first + words.numel(), dtype=torch.int64, device=words.device)
    x = words ^ ((pos * _POS[lane]) & _M32)
    c1, c2 = _MUL[lane]
    x = x ^ (x >> 16)
    x = (x * c1) & _M32
    x = x ^ (x >> 15)
    x = (x * c2) & _M32
    return x ^ (x >> 16)


def tensor_checksum(t: Tensor) -> Tensor:
    """The 64-bit checksum of ``t``'s raw bytes: an int64 tensor [2] (two 32-bit lanes, each
    the sum mod 2**32 of a bijective hash of every 32-bit word mixed with its position) on
    ``t``'s device; no host copy and no host read. Bit-exact: equal bytes give equal
    checksums on any device; a change of one word always changes both lanes. Any dtype (a
    DTensor: its local data)."""
    if is_dtensor(t):
        t = t.to_local()
    words = _words(t)
    out = torch.zeros(2, dtype=torch.int64, device=words.device)
    for first in range(0, max(words.numel(), 1), _CHUNK):
        chunk = words[first: first + _CHUNK]
        for lane in (0, 1):
            out[lane] = (out[lane] + _mix(chunk, first, lane).sum()) & _M32
    return out


def _block_checksums(t: Tensor, block: int) -> Tensor:
    """Lane-0 checksums of each ``block`` words of ``t`` (int64 [ceil(words / block)])."""
    words = _words(t)
    n = words.numel()
    h = _mix(words, 0, 0)
    pad = (-n) % block
    if pad:
        h = torch.cat([h, h.new_zeros(pad)])
    return h.reshape(-1, block).sum(dim=1) & _M32


def flip_bit(t: Tensor, index: int, bit: int) -> None:
    """Flip bit ``bit`` (0 = least significant) of element ``index`` of ``t`` flattened, in
    place (a fault injector for tests and for the main job's ``--inject-bitflip-*`` flags).
    TypeError / ValueError for a non-int or out-of-range index or bit, or a non-contiguous
    tensor."""
    if is_dtensor(t):
        t = t.to_local()
    if not t.is_contiguous():
        raise ValueError("flip_bit needs a contiguous tensor")
    index = check_int("index", index, low=0, high=max(t.numel() - 1, 0))
    bit = check_int("bit", bit, low=0, high=8 * t.element_size() - 1)
    b = t.detach().reshape(-1).view(torch.uint8)
    pos = index * t.element_size() + bit // 8  # little-endian: byte 0 holds the low bits
    b[pos] ^= 1 << (bit % 8)


# ------------------------------------------------------------------------ the check


def _group_ranks(group) -> List[int]:
    return list(dist.get_process_group_ranks(group)) if group is not None else [dist.get_rank()]


def _signature_words(rows) -> List[int]:
    """Two 31-bit words naming the list of compared tensors (names, kinds, dtypes, shapes)."""
    text = "\n".join(f"{n}|{k}|{t.dtype}|{tuple(t.shape)}" for n, k, t in rows)
    d = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return [int.from_bytes(d[:4], "little") & 0x7FFFFFFF, int.from_bytes(d[4:], "little") & 0x7FFFFFFF]


def _split(values: Sequence) -> tuple:
    """(minority indices, majority indices) of equal-value classes: the majority is the unique
    largest class holding more than half; without one, every index is in the minority."""
    classes = {}
    for i, v in enumerate(values):
        classes.setdefault(v, []).append(i)
    if len(classes) == 1:
        return [], list(range(len(values)))
    biggest = max(classes.values(), key=len)
    if 2 * len(biggest) > len(values):
        return [i for i in range(len(values)) if i not in biggest], biggest
    return list(range(len(values))), []


def _all_gather(t: Tensor, group) -> List[Tensor]:
    dev = collective_device(group)
    t = t.to(dev)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return [o.cpu() for o in out]


def _first_difference(t: Tensor, group, minority: List[int], majority: List[int], block: int):
    """(start, stop) of the first differing element range of ``t`` within the group: per-block
    checksums, then the raw bytes of the first differing block (two all_gathers, every member
    alike)."""
    blocks = _all_gather(_block_checksums(t, block), group)
    ref = majority[0] if majority else minority[0]
    odd = minority if majority else minority[1:]
    stacked = torch.stack(blocks)
    differs = (stacked[odd] != stacked[ref]).any(dim=0)
    idx = torch.nonzero(differs).reshape(-1)
    if idx.numel() == 0:  # the blocks' lane-0 sums agree (the other lane differs): compare all
        first_block, nblocks = 0, stacked.shape[1]
    else:
        first_block, nblocks = int(idx[0]), 1
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    lo, hi = first_block * block * 4, (first_block + nblocks) * block * 4
    got = torch.stack(_all_gather(raw[lo:hi].clone(), group))  # equal sizes: layouts agreed
    bad = torch.nonzero((got[odd] != got[ref]).any(dim=0)).reshape(-1)
    if bad.numel() == 0:
        return 0, t.numel()
    es = t.element_size()
    return (lo + int(bad[0])) // es, (lo + int(bad[-1])) // es + 1


def _coords_text(parallel_state, rank: int) -> str:
    if parallel_state is None:
        return ""
    pp, dp, _cp, tp = parallel_state.dims.dense_coords(rank)
    return f"[tp {tp}, pp {pp}, dp {dp}]"


def is_tp_duplicate(p: Tensor) -> bool:
    """Whether every TP rank holds a whole copy of ``p``: not ``tensor_model_parallel``
    (Megatron's attribute) and, for a DTensor on the TP mesh, every placement Replicate."""
    if getattr(p, "tensor_model_parallel", False):
        return False
    if is_dtensor(p):
        return all(pl.is_replicate() for pl in p.placements)
    return True


def _comparison_groups(optimizer, data_parallel_group, tensor_parallel_group, parallel_state):
    """[(label, group, which(model param) -> bool)] in a fixed order (every rank the same)."""
    expert_apart = parallel_state is not None and parallel_state.has_expert_layout
    dense = (lambda p: not is_expert_param(p)) if expert_apart else (lambda p: True)
    dup = is_tp_duplicate
    out = [("data-parallel", data_parallel_group, dense),
           ("tensor-parallel", tensor_parallel_group, lambda p: dense(p) and dup(p))]
    if expert_apart:
        out += [("expert-data-parallel", parallel_state.expert_data_parallel_group, is_expert_param),
                ("expert-tensor-parallel", parallel_state.expert_tp_group,
                 lambda p: is_expert_param(p) and dup(p))]
    return [(label, g, which) for label, g, which in out
            if g is not None and dist.get_world_size(g) > 1]


def check_replicas(optimizer, *, data_parallel_group=None, tensor_parallel_group=None,
                   parallel_state=None, group=None, block_size: int = 4096) -> List[ReplicaMismatch]:
    """Compare, bit for bit, the copies of every replicated tensor of ``optimizer`` across the
    ranks that must hold equal ones (module docstring); returns the :class:`ReplicaMismatch`
    records, the same list on every rank of ``group`` ([] when all agree). A collective: every
    rank of ``group`` calls it at the same point.

    Args:
        optimizer: a tpamp wrapper (:class:`tpamp.MixedPrecisionOptimizer`, FP32Optimizer,
            DistributedOptimizer, LayerWiseDistributedOptimizer).
        data_parallel_group, tensor_parallel_group: the groups over which copies must agree
            (default: ``parallel_state``'s ``dp_group`` / ``tp_group``, else the optimizer's
            ``data_parallel_group`` / ``tensor_parallel_group``; None or a group of one rank:
            nothing to compare there).
        parallel_state: a :class:`tpamp.parallel.ParallelState`: the default groups, the expert
            groups (expert params are compared over the expert-DP and expert-TP groups when the
            expert layout differs) and the coordinates shown for each rank.
        group: the group that agrees on the verdict (default: the world).
        block_size: 32-bit words per block of the second round (int >= 1).

    Cost: one checksum pass over every compared tensor (reads each byte once, on its device),
    one all_gather of 2 int64 per tensor per group, one all-reduce of one int; more only on a
    mismatch.

    Raises TypeError for an optimizer that is not a tpamp wrapper or a bad group, ValueError
    for DTensor params on a mesh of more than one dimension (FSDP2) or a bad block_size.
    """
    block_size = check_int("block_size", block_size, low=1)
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("check_replicas is a collective: initialize torch.distributed first")
    dp, tp = _resolve_groups(optimizer, data_parallel_group, tensor_parallel_group, parallel_state)
    rows_all = optimizer.replica_tensors()
    for name, model, _ in rows_all:
        if is_dtensor(model) and model.device_mesh.ndim != 1:
            raise ValueError(
                f"check_replicas: param {name!r} is a DTensor on a {model.device_mesh.ndim}-D "
                "mesh (FSDP2 shards params over DP): its shards are not copies of each other; "
                "replica checks support replicated params (plain tensors, or DTensors on the "
                "1-D TP mesh)")
    found: List[ReplicaMismatch] = []
    for label, g, which in _comparison_groups(optimizer, dp, tp, parallel_state):
        rows = [(name, kind, t) for name, model, tensors in rows_all if which(model)
                for kind, t in tensors.items()]
        found += _check_group(rows, label, g, parallel_state, block_size)
    return _agree(found, group)


def _resolve_groups(optimizer, dp, tp, parallel_state):
    from tpamp.optimizer import MixedPrecisionOptimizer
    from tpamp.parallel import ParallelState

    if not isinstance(optimizer, MixedPrecisionOptimizer):
        raise TypeError(f"optimizer must be a tpamp optimizer wrapper (MixedPrecisionOptimizer, "
                        f"FP32Optimizer, DistributedOptimizer, ...), got {type(optimizer).__name__}")
    if parallel_state is not None and not isinstance(parallel_state, ParallelState):
        raise TypeError("parallel_state must be a tpamp.parallel.ParallelState, got "
                        f"{type(parallel_state).__name__}")
    if dp is None:
        dp = (parallel_state.dp_group if parallel_state is not None
              else getattr(optimizer, "data_parallel_group", None))
    if tp is None:
        tp = (parallel_state.tp_group if parallel_state is not None
              else optimizer.tensor_parallel_group)
    check_group_member(dp, "data_parallel_group")
    check_group_member(tp, "tensor_parallel_group")
    return dp, tp


def _check_group(rows, label, g, parallel_state, block_size) -> List[ReplicaMismatch]:
    ranks = _group_ranks(g)
    device = rows[0][2].device if rows else collective_device(g)
    local = torch.tensor(_signature_words(rows), dtype=torch.int64, device=device)
    sums = [local] + [tensor_checksum(t).to(device) for _, _, t in rows]
    gathered = torch.stack(_all_gather(torch.cat(sums), g))  # [ranks, 2 + 2 * len(rows)]
    sig = [tuple(r[:2].tolist()) for r in gathered]
    minority, majority = _split(sig)
    if minority:  # different lists of tensors: their checksums cannot be paired
        return [ReplicaMismatch("<all params>", "layout", label, tuple(ranks[i] for i in minority),
                                tuple(ranks[i] for i in majority), 0, 0, 0, detail=(
                                    "names, kinds, dtypes or shapes of the compared tensors differ"))]
    out = []
    per = gathered[:, 2:].reshape(len(ranks), len(rows), 2)
    for i, (name, kind, t) in enumerate(rows):
        values = [tuple(per[r, i].tolist()) for r in range(len(ranks))]
        minority, majority = _split(values)
        if not minority:
            continue
        start, stop = _first_difference(t, g, minority, majority, block_size)
        bad = tuple(ranks[j] for j in minority)
        out.append(ReplicaMismatch(
            name, kind, label, bad, tuple(ranks[j] for j in majority), start, stop, t.numel(),
            tuple(_coords_text(parallel_state, r) for r in bad)))
    return out


def _agree(found: List[ReplicaMismatch], group) -> List[ReplicaMismatch]:
    """The same records on every rank of ``group``: a flag all-reduce, then (only when some
    rank found one) an all_gather_object of the records."""
    flag = torch.tensor([1 if found else 0], dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if not int(flag.item()):
        return []
    lists = [None] * dist.get_world_size(group)
    dist.all_gather_object(lists, [tuple(m) for m in found], group=group)
    seen, out = set(), []
    for records in lists:
        for r in records:
            if r not in seen:
                seen.add(r)
                out.append(ReplicaMismatch(*r))
    return out


class ReplicaChecker:
    """:func:`check_replicas` every ``interval`` iterations, with a policy.

    Args:
        optimizer: a tpamp optimizer wrapper.
        interval: check at every iteration divisible by it (int >= 1).
        on_mismatch: ``"raise"`` (:class:`ReplicaMismatchError` on every rank) or ``"warn"``
            (a ``RuntimeWarning`` on every rank; training goes on).
        data_parallel_group, tensor_parallel_group, parallel_state, group, block_size: as
            :func:`check_replicas`.

    Construction is a collective over ``group``: the ranks' interval, on_mismatch and
    block_size must agree (one all_gather_object), else ValueError on every rank naming the
    ranks and values -- a rank checking at other iterations would hang its peers.

    Attributes: ``last`` (the records of the last check, [] when clean, None before any);
    ``history`` ((iteration, records) of every check that found a mismatch).

    Raises TypeError for a non-int interval or block_size or a non-str on_mismatch, ValueError
    for interval < 1 or an on_mismatch other than "raise" / "warn".
    """

    def __init__(self, optimizer, interval: int, *, on_mismatch: str = "raise",
                 data_parallel_group=None, tensor_parallel_group=None, parallel_state=None,
                 group=None, block_size: int = 4096):
        self.interval = check_int("interval", interval, low=1)
        if not isinstance(on_mismatch, str):
            raise TypeError(f"on_mismatch must be one of {ON_MISMATCH}, got "
                            f"{type(on_mismatch).__name__}")
        if on_mismatch not in ON_MISMATCH:
            raise ValueError(f"on_mismatch must be one of {ON_MISMATCH}, got {on_mismatch!r}")
        self.on_mismatch = on_mismatch
        self.block_size = check_int("block_size", block_size, low=1)
        dp, tp = _resolve_groups(optimizer, data_parallel_group, tensor_parallel_group,
                                 parallel_state)
        check_group_member(group, "group")
        self.optimizer, self.parallel_state, self.group = optimizer, parallel_state, group
        self.data_parallel_group, self.tensor_parallel_group = dp, tp
        self.last: Optional[List[ReplicaMismatch]] = None
        self.history: list = []
        self._agree_on_settings()

    def _agree_on_settings(self) -> None:
        mine = (self.interval, self.on_mismatch, self.block_size)
        if not dist.is_initialized():
            return
        rows = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(rows, mine, group=self.group)
        ranks = _group_ranks(self.group) if self.group is not None else list(range(len(rows)))
        if any(r != rows[0] for r in rows):
            shown = ", ".join(f"rank {rk}: interval={r[0]}, on_mismatch={r[1]!r}, block_size={r[2]}"
                              for rk, r in zip(ranks, rows))
            raise ValueError(f"ReplicaChecker settings differ across ranks ({shown}); every rank "
                             "must check at the same iterations with the same policy")

    def check(self, iteration=None) -> List[ReplicaMismatch]:
        """Check now (a collective over ``group``); returns the records and applies the policy
        (raise or warn) when there are any."""
        found = check_replicas(
            self.optimizer, data_parallel_group=self.data_parallel_group,
            tensor_parallel_group=self.tensor_parallel_group, parallel_state=self.parallel_state,
            group=self.group, block_size=self.block_size)
        self.last = found
        if found:
            self.history.append((iteration, found))
            if self.on_mismatch == "raise":
                raise ReplicaMismatchError(found, iteration)
            warnings.warn(describe(found, iteration), RuntimeWarning, stacklevel=2)
        return found

    def maybe_check(self, iteration: int) -> Optional[List[ReplicaMismatch]]:
        """:meth:`check` when ``iteration`` is a multiple of ``interval`` (returns its records),
        else nothing (None). ``iteration``: an int >= 0, the same on every rank."""
        iteration = check_int("iteration", iteration, low=0)
        if iteration % self.interval:
            return None
        return self.check(iteration)
