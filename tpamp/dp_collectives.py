"""The data-parallel collectives of :class:`tpamp.DistributedOptimizer`: the reduce-scatter of a
flat gradient buffer and the all-gather of a flat param buffer over the DP group, each started
asynchronously and finished by the handle's ``wait()``.

Over a gloo group on CPU they run as a ring of isend/irecv (:class:`RingCollective`): gloo's own
reduce_scatter_tensor and all_gather_into_tensor copy their whole input and output through
temporaries (on this project's 2-core machine, DP 2, 20M fp32 elements: reduce_scatter_tensor
~5x and all_gather_into_tensor ~7x the time of the same bytes moved by isend/irecv;
docs/benchmarks.md). Other backends (NCCL) keep torch.distributed's collectives; a one-rank group
copies (reduce-scatter) or does nothing (all-gather) and returns a finished handle.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

__all__ = [
    "RingCollective",
    "OrderedReduceScatter",
    "Finished",
    "reduce_scatter_tensor",
    "all_gather_tensor",
    "uses_ring",
    "start_reduce_scatter",
    "start_all_gather",
]

Tensor = torch.Tensor

# torch 2.13 renamed reduce_scatter_tensor / all_gather_into_tensor to reduce_scatter_single /
# all_gather_single (the old names then warn); torch 2.11 has only the old names
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class RingCollective:
    """A reduce-scatter (SUM) or an all-gather over a gloo group by isend/irecv around the
    ring (the bandwidth-optimal ring algorithm: d - 1 steps of n / d elements each way).

    ``chunks``: [d, n / d] view of the flat buffer (reduce-scatter: the input, left unchanged;
    all-gather: the output, whose chunk r is this rank's input). Reduce-scatter: ``out``
    [n / d] receives the sum of chunk r over the ranks; the partial sums of the other chunks
    pass through ``out`` and ``scratch`` [n / d] (d > 2 only) in turn. The first step is posted
    at construction (async); ``wait()`` runs the rest. With d = 2 the sum is theirs + mine: the
    same bits as any SUM of two. ``tag`` tells concurrent rings on one group apart."""

    def __init__(self, group, chunks: Tensor, tag: int, out: Optional[Tensor] = None,
                 scratch: Optional[Tensor] = None):
        self.group, self.chunks, self.tag, self.out, self.scratch = group, chunks, tag, out, scratch
        self.d = chunks.shape[0]
        self.r = dist.get_rank(group)
        self.step, self.works = 0, []
        self.sent = None
        self._post()

    def _post(self) -> None:
        d, r, s, chunks = self.d, self.r, self.step, self.chunks
        nxt, prv = (r + 1) % d, (r - 1) % d
        if self.out is None:  # all-gather: pass chunk r - s on, receive chunk r - s - 1
            send, recv = chunks[(r - s) % d], chunks[(r - s - 1) % d]
        else:  # reduce-scatter: pass the partial sum of chunk r - s - 1 on
            send = chunks[(r - 1) % d] if s == 0 else self.sent
            recv = self.out if (d - 2 - s) % 2 == 0 else self.scratch  # ends in out
        self.recv = recv
        self.works = [dist.irecv(recv, group=self.group, group_src=prv, tag=self.tag),
                      dist.isend(send, group=self.group, group_dst=nxt, tag=self.tag)]

    def wait(self) -> None:
        while True:
            for w in self.works:
                w.wait()
            self.works = []
            if self.out is not None:  # add this rank's own part of the received chunk
                self.recv.add_(self.chunks[(self.r - self.step - 2) % self.d])
                self.sent = self.recv
            self.step += 1
            if self.step == self.d - 1:
                return
            self._post()


class OrderedReduceScatter:
    """A SUM reduce-scatter whose bits do not depend on ring position, bucket boundaries or run:
    chunk r of every rank goes to rank r (one all-to-all), which adds the d chunks in group-rank
    order, ``((c_0 + c_1) + c_2) + ...``, in the buffer's dtype. Each rank sends and receives
    (d - 1) n / d elements, as in the ring; ``recv`` [d, n / d] (the bucket's size) holds the
    chunks until ``wait()``. A ring adds chunk r starting at rank r + 1, so for d > 2 its sums
    differ from rank to rank in their rounding (for d = 2, any SUM of two has the same bits)."""

    def __init__(self, group, data: Tensor, out: Tensor, recv: Tensor):
        self.out, self.recv = out, recv
        self.work = dist.all_to_all_single(recv.view(-1), data, group=group, async_op=True)

    def wait(self) -> None:
        self.work.wait()
        self.out.copy_(self.recv[0])
        for chunk in self.recv[1:]:
            self.out.add_(chunk)


class Finished:
    """The handle of a collective that finished at once (a one-rank group)."""

    def wait(self) -> None:
        pass


def uses_ring(group, device: torch.device) -> bool:
    """Whether the collectives of ``group`` for tensors on ``device`` run as isend/irecv rings:
    more than one rank, CPU tensors and a gloo backend."""
    return (dist.get_world_size(group) > 1 and device.type == "cpu"
            and "gloo" in str(dist.get_backend(group)))


def start_reduce_scatter(group, data: Tensor, out: Tensor, tag: int, *, ring: bool,
                         scratch: Optional[Tensor] = None, ordered_recv: Optional[Tensor] = None):
    """Start the SUM reduce-scatter of the flat ``data`` [n] (n a multiple of the group size d)
    into ``out`` [n / d] (this rank's chunk; the same dtype and device; for d = 1 it may be
    ``data`` itself: nothing to do). ``ring``: by
    :class:`RingCollective` (see :func:`uses_ring`; ``scratch`` [n / d] needed when d > 2).
    ``ordered_recv`` [d, n / d] (d > 2): by :class:`OrderedReduceScatter` instead, the sum in
    group-rank order. Returns a handle whose ``wait()`` finishes it."""
    d = dist.get_world_size(group)
    if ordered_recv is not None and d > 2:
        return OrderedReduceScatter(group, data, out, ordered_recv)
    if ring:
        return RingCollective(group, data.view(d, -1), tag, out=out, scratch=scratch)
    if d == 1:
        if out is not data:  # (a one-rank caller may pass the buffer as its own output)
            out.copy_(data)
        return Finished()
    return reduce_scatter_tensor(out, data, group=group, async_op=True)


def start_all_gather(group, data: Tensor, shard: Tensor, tag: int, *, ring: bool):
    """Start the all-gather of every rank's ``shard`` [n / d] into the flat ``data`` [n].
    With ``ring`` (or a one-rank group) the input must already be this rank's chunk of ``data``
    (an in-place gather, copied there by the caller). Returns a handle with ``wait()``."""
    d = dist.get_world_size(group)
    if ring:
        return RingCollective(group, data.view(d, -1), tag)
    if d == 1:
        return Finished()
    return all_gather_tensor(data, shard, group=group, async_op=True)
