"""Per-parameter grad norms under TP x PP, from the optimizer's grad-stats pass.

The norm of each parameter's full gradient (docs/spec.md section 5): a tensor-parallel shard's
local norms are combined over the TP group, a replicated (TP-duplicated) param counts once (TP
rank 0), a ``shared`` tied copy (the last stage's output-head copy of the word embedding) not at
all -- the filter of the global grad norm (tpamp.grad_stats), so for the L2 norm the
root-sum-square of the per-parameter norms is the global grad norm. Each pipeline stage reports
its own params; names must be unique in the whole model (e.g. the global layer index,
``blocks.7.mlp.fc1.weight``, not the stage-local one).

No extra read of the gradients: the optimizer asks its one fused grad-stats pass for the
per-tensor norms (``tpamp.ops.grad_stats(per_tensor_norms=True)``) on the steps where they are
wanted, and this module adds one all-reduce of a float64 vector with one entry per named param of
the whole model over the grad-stats group. Megatron-LM has no per-parameter norms upstream.

Usage::

    tracker = opt.track_param_grad_norms(named_params)   # (global name, model param) pairs
    result = opt.step(param_grad_norms=True)              # on every rank of the group alike
    tracker.norms      # {name: float} for every param of the whole model, model order
    tracker.top_k(8)   # the 8 largest, largest first
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from tpamp.common import collective_device, local_tensor
from tpamp.grad_stats import is_expert_param

__all__ = ["ParamGradNormTracker", "root_sum_square", "top_k"]

Tensor = torch.Tensor


def root_sum_square(norms: Iterable[float], norm_type: float = 2.0) -> float:
    """The global p-norm from per-parameter p-norms: (sum n^p)^(1/p), max for p = inf
    (float64 on the host)."""
    norms = [float(n) for n in norms]
    if norm_type == math.inf:
        return max(norms, default=0.0)
    return math.fsum(n ** norm_type for n in norms) ** (1.0 / norm_type)


def top_k(norms: Dict[str, float], k: Optional[int]) -> Dict[str, float]:
    """The ``k`` largest of {name: norm} (None: all), largest first; non-finite norms (a
    param whose gradient overflowed) come first."""

    def key(kv):
        v = kv[1]
        return (0, 0.0) if not math.isfinite(v) else (1, -v)

    return dict(sorted(norms.items(), key=key)[: len(norms) if k is None else k])


def _named_pairs(named_params) -> List[Tuple[str, Tensor]]:
    """(name, param) pairs from ``model.named_parameters()`` (or any iterable of pairs), a dict
    {name: param} (e.g. ``dict(model.named_parameters())``) or a dict {param: name} (as
    ``param_names=`` takes). TypeError with what to pass for anything else."""
    hint = ("named_params must be (name, param) pairs such as model.named_parameters(), or a "
            "dict {name: param} / {param: name}")
    if isinstance(named_params, (str, bytes, Tensor)):
        raise TypeError(f"{hint}; got {type(named_params).__name__}")
    if isinstance(named_params, Mapping):
        pairs = list(named_params.items())
        if all(isinstance(k, Tensor) and isinstance(v, str) for k, v in pairs):
            return [(v, k) for k, v in pairs]
        if not all(isinstance(k, str) and isinstance(v, Tensor) for k, v in pairs):
            bad = next(kv for kv in pairs if not (isinstance(kv[0], str) and isinstance(kv[1], Tensor)))
            raise TypeError(f"{hint}; got a dict with the entry ({type(bad[0]).__name__}: "
                            f"{type(bad[1]).__name__})")
        return pairs
    try:
        items = list(named_params)
    except TypeError:
        raise TypeError(f"{hint}; got {type(named_params).__name__}") from None
    for item in items:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[1], Tensor)):
            raise TypeError(f"{hint} (pass model.named_parameters() or a dict's .items()); got "
                            f"an entry {item!r:.80}")
    return [tuple(item) for item in items]


class ParamGradNormTracker:
    """Names the optimizer's params and reduces their per-tensor grad norms over the group.

    Built by :meth:`tpamp.MixedPrecisionOptimizer.track_param_grad_norms`. Collective: every
    rank of the optimizer's grad-stats group must call it, once (and then every step with
    ``param_grad_norms=True`` on every rank alike). Attributes after a step with
    ``param_grad_norms=True``: :attr:`norms` ({name: float}, gradient units, unscaled and
    before clipping, in model order: the group's ranks in order, each rank's params in the
    order of ``named_params``); inf or nan for a param whose gradient overflowed on that step (which
    shows where an overflow came from). ``names``: every name of the whole model.
    After a step with ``param_update_norms=True`` (tpamp/update_norms.py): :attr:`update_norms`
    ({name: ||master_new - master_old||}, param units), :attr:`update_ratios` ({name:
    ||update|| / ||master_new||}) and, for TensorParallelMuon params, :attr:`momentum_norms`
    ({name: momentum norm before orthogonalisation}); None after a skipped step or a step that
    did not ask.

    ``data_parallel_group``: a group whose ranks hold pieces of the same params (FSDP2 shards
    every param over DP: tpamp.fsdp.track_param_grad_norms), so they give the same names too.

    Raises ValueError when a (non-shared) param of the optimizer has no name, a name is given
    twice on one rank, or the same name comes from two ranks of different shard groups (two
    pipeline stages using stage-local names).
    """

    def __init__(self, optimizer, named_params: Iterable[Tuple[str, Tensor]], *, mains=None,
                 model_params=None, data_parallel_group=None):
        """optimizer: the wrapper (its ``norm_type``, ``grad_stats_group``,
        ``tensor_parallel_group`` and inner ``param_groups`` are read). named_params: (name,
        model param) pairs. mains: (tensor the inner optimizer steps, model param it belongs to)
        pairs -- an fp32 main copy, a DistributedOptimizer's shard piece (several pieces of one
        param on different DP ranks are summed over the group like TP shards), or the param
        itself (the default: every inner param is a model param). model_params: the model
        params this rank names (default: those of ``mains``; a DistributedOptimizer passes
        every trainable param, also one with no piece on this rank). data_parallel_group: the
        group over which a DistributedOptimizer shards (its ranks hold the same names).
        named_params may also be a dict {name: param} or {param: name}; anything else raises
        TypeError saying what to pass."""
        self.optimizer = optimizer
        self.norm_type = optimizer.norm_type
        group = optimizer.grad_stats_group
        # expert params (docs/spec.md section 19): under EP > 1 each EP rank's part is its own
        # entry, "<name> [ep <rank>]", reduced over the expert grad-stats group
        ep_size = getattr(optimizer, "expert_parallel_size", None) or 1
        ep_coords = getattr(optimizer, "expert_rank_coords", None)
        ep_rank = ep_coords.ep_rank if ep_coords is not None else None
        self._expert_names: set = set()
        # model param -> name; the optimizer holds main params (fp32 copies) for fp16/bf16 ones
        by_id: Dict[int, str] = {}
        position: Dict[str, int] = {}  # the caller's (module) order
        for name, p in _named_pairs(named_params):
            if not isinstance(name, str) or not name:
                raise ValueError(f"param names must be non-empty strings, got {name!r}")
            if is_expert_param(p) and ep_size > 1:
                name = f"{name} [ep {'?' if ep_rank is None else ep_rank}]"
                self._expert_names.add(name)
            if id(p) in by_id and by_id[id(p)] != name:
                raise ValueError(f"one param is named both {by_id[id(p)]!r} and {name!r}")
            by_id[id(p)] = name
            position.setdefault(name, len(position))
        if mains is None:
            mains = [(p, p) for g in optimizer.param_groups for p in g["params"]]
        mains = list(mains)
        models, seen = [], set()
        for model in (model_params if model_params is not None else [m for _, m in mains]):
            if id(model) not in seen:
                seen.add(id(model))
                models.append(model)
        self._name_of_main: Dict[int, str] = {}
        local_names: List[str] = []
        unnamed = 0
        for model in models:
            if getattr(model, "shared", False):
                continue  # a tied copy: its twin is counted (and named) elsewhere
            name = by_id.get(id(model))
            if name is None:
                unnamed += 1
                continue
            if name in local_names:
                raise ValueError(f"param name {name!r} is given to two params on this rank")
            local_names.append(name)
        if unnamed:
            raise ValueError(
                f"{unnamed} param(s) of the optimizer have no name in named_params; name every "
                "param that is not a shared tied copy (their norms must add up to the grad norm)"
            )
        for main, model in mains:
            name = by_id.get(id(model))
            if name is not None and not getattr(model, "shared", False):
                self._name_of_main[id(main)] = name
        local_names.sort(key=position.__getitem__)
        self._apart = bool(getattr(optimizer, "experts_apart", False))
        if self._apart:  # dense names over the dense group, expert names over the expert one
            dense = _gather_names([n for n in local_names if n not in self._expert_names],
                                  group, optimizer.tensor_parallel_group, data_parallel_group)
            experts = _gather_names([n for n in local_names if n in self._expert_names],
                                    optimizer.expert_grad_stats_group,
                                    optimizer.expert_tensor_parallel_group, None)
            self._num_dense = len(dense)
            self.names = dense + experts
        else:
            self.names = _gather_names(local_names, group, optimizer.tensor_parallel_group,
                                       data_parallel_group)
        self._slot = {name: i for i, name in enumerate(self.names)}
        self.norms: Optional[Dict[str, float]] = None
        # step(param_update_norms=True): {name: ||update||}, {name: ||update|| / ||param||}
        self.update_norms: Optional[Dict[str, float]] = None
        self.update_ratios: Optional[Dict[str, float]] = None
        # ... and of a TensorParallelMuon's params, {name: momentum norm before orthogonalising}
        self.momentum_norms: Optional[Dict[str, float]] = None

    def reduce(self, per_tensor_norms: Tensor, grads: Sequence[Tensor], mask: Sequence[bool]) -> Dict[str, float]:
        """Combine this rank's per-tensor norms into :attr:`norms` (called by the optimizer's
        step; every rank of the grad-stats group must call it alike).

        per_tensor_norms: float32 [len(grads)], the p-norm of each local gradient tensor (the
        grad-stats pass). grads: those local tensors (the main grads, in the pass's order).
        mask: per tensor, whether it counts toward the global norm on this rank. One
        all-reduce (SUM of p-th powers, MAX for p = inf) of float64 [len(names)]; then one
        host read."""
        if len(grads) != per_tensor_norms.numel() or len(mask) != len(grads):
            raise ValueError(
                f"{per_tensor_norms.numel()} per-tensor norms for {len(grads)} grads and "
                f"{len(mask)} mask entries"
            )
        slot_of_grad = {}
        for g in self.optimizer.param_groups:
            for main in g["params"]:
                name = self._name_of_main.get(id(main))
                if name is not None and main.grad is not None:
                    slot_of_grad[id(local_tensor(main.grad))] = self._slot[name]
        return self._reduce_slots(per_tensor_norms, [slot_of_grad.get(id(g)) for g in grads], mask)

    def reduce_params(self, per_tensor_norms: Tensor, params: Sequence[Tensor], mask: Sequence[bool]) -> Dict[str, float]:
        """:meth:`reduce` for norms listed by param instead of by grad tensor (the one-pass
        step, which makes no main grads): params[i] is the optimizer's (main) param whose local
        gradient has the norm per_tensor_norms[i] (float32 [len(params)], unscaled)."""
        if len(params) != per_tensor_norms.numel() or len(mask) != len(params):
            raise ValueError(
                f"{per_tensor_norms.numel()} per-tensor norms for {len(params)} params and "
                f"{len(mask)} mask entries"
            )
        names = [self._name_of_main.get(id(p)) for p in params]
        return self._reduce_slots(
            per_tensor_norms, [None if n is None else self._slot[n] for n in names], mask
        )

    def clear_update_norms(self) -> None:
        """Forget the last step's update norms (the optimizer calls it at every step, so a
        skipped or untracked step leaves None, never a stale value)."""
        self.update_norms = None
        self.update_ratios = None
        self.momentum_norms = None

    def reduce_update_norms(self, update_norms: Tensor, param_norms: Tensor,
                            params: Sequence[Tensor], mask: Sequence[bool], *,
                            momentum: Optional[Tuple[Tensor, Sequence[bool]]] = None,
                            ) -> Dict[str, float]:
        """Combine this rank's per-tensor update norms into :attr:`update_norms` and
        :attr:`update_ratios` (called by the optimizer's step with ``param_update_norms=True``;
        every rank of the grad-stats group must call it alike; tpamp/update_norms.py).

        update_norms, param_norms: float32 [len(params)], the L2 norms of each local master's
        change on this step and of its new value; params: the optimizer's (main) params they
        belong to; mask: per param, whether it counts (the grad-norm filter). Squares summed
        per name over the group (always L2, whatever ``norm_type``) with one all-reduce of
        float64 [2 x len(names)]; then one host read. The ratio is 0 for a param whose new
        value is all zeros and unchanged, inf when it changed. momentum: (float32
        [len(params)] momentum norms, [whether param i has one]) of a TensorParallelMuon's params
        (tpamp.update_norms.momentum_norms_of): :attr:`momentum_norms` gets the names some
        rank has one for (reduced alike, in the same all-reduce); None when no name has."""
        n = len(params)
        if update_norms.numel() != n or param_norms.numel() != n or len(mask) != n:
            raise ValueError(
                f"{update_norms.numel()} update norms and {param_norms.numel()} param norms for "
                f"{n} params and {len(mask)} mask entries"
            )
        names = [self._name_of_main.get(id(p)) for p in params]
        slots = [None if name is None else self._slot[name] for name in names]
        if momentum is None:
            momentum = (torch.zeros_like(update_norms), [False] * n)
        mom, has = momentum
        if mom.numel() != n or len(has) != n:
            raise ValueError(f"{mom.numel()} momentum norms and {len(has)} flags for {n} params")
        has_t = torch.tensor([float(h) for h in has], dtype=torch.float64,
                             device=update_norms.device)
        stacked = torch.stack([update_norms.reshape(-1), param_norms.reshape(-1),
                               mom.reshape(-1).to(update_norms.device)]).double().pow(2)
        vec = self._sum_slots(torch.cat([stacked, has_t[None]]), slots, mask, 2.0)
        upd, par, mom_sq, counts = vec.tolist()
        upd, par = [math.sqrt(v) for v in upd], [math.sqrt(v) for v in par]
        self.momentum_norms = {name: math.sqrt(v) for name, v, c in
                               zip(self.names, mom_sq, counts) if c > 0} or None
        self.update_norms = dict(zip(self.names, upd))
        self.update_ratios = {
            name: (u / p if p > 0 else (0.0 if u == 0 else math.inf))
            for name, u, p in zip(self.names, upd, par)
        }
        return self.update_norms

    def _reduce_slots(self, per_tensor_norms: Tensor, slot_of: Sequence[Optional[int]], mask: Sequence[bool]) -> Dict[str, float]:
        """The shared half of reduce/reduce_params: slot_of[i] is the name slot of tensor i
        (None: unnamed, e.g. a shared tied copy)."""
        p = self.norm_type
        values = per_tensor_norms.double().reshape(1, -1)
        vec = self._sum_slots(values if p == math.inf else values.pow(p), slot_of, mask, p)[0]
        if p != math.inf:
            vec = vec.pow(1.0 / p)
        self.norms = dict(zip(self.names, vec.tolist()))
        return self.norms

    def _sum_slots(self, values: Tensor, slot_of: Sequence[Optional[int]], mask: Sequence[bool],
                   norm_type: float) -> Tensor:
        """values: float64 [k, n tensors] (p-th powers, or norms for p = inf) -> float64
        [k, len(names)] reduced over the grad-stats group (SUM, MAX for p = inf; the expert
        names over the expert group when experts are apart), one all-reduce per group."""
        rows, slots = [], []
        for i, (slot, counts) in enumerate(zip(slot_of, mask)):
            if counts and slot is not None:
                rows.append(i)
                slots.append(slot)
        device = values.device
        k = values.shape[0]
        vec = torch.zeros(k, len(self.names), dtype=torch.float64, device=device)
        if rows:
            picked = values[:, torch.tensor(rows, device=device)]
            index = torch.tensor(slots, device=device)
            if norm_type == math.inf:
                vec.scatter_reduce_(1, index.expand(k, -1), picked, reduce="amax")
            else:
                vec.index_add_(1, index, picked)
        group = self.optimizer.grad_stats_group
        op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
        if self._apart:  # the dense entries over the dense group, the expert ones over theirs
            n = self._num_dense
            dense, experts = vec[:, :n].contiguous(), vec[:, n:].contiguous()
            if group is not None:
                dist.all_reduce(dense, op=op, group=group)
            if self.optimizer.expert_grad_stats_group is not None:
                dist.all_reduce(experts, op=op, group=self.optimizer.expert_grad_stats_group)
            vec = torch.cat([dense, experts], dim=1)
        elif group is not None:
            dist.all_reduce(vec, op=op, group=group)
        return vec

    def top_k(self, k: Optional[int]) -> Dict[str, float]:
        """The ``k`` largest of :attr:`norms` (:func:`top_k`); {} before any step."""
        return top_k(self.norms or {}, k)

def _gather_names(local_names: List[str], group, tp_group, dp_group=None) -> List[str]:
    """Every rank's names, deduplicated, in rank order. TP peers hold the same names (their
    shards of one param), and so do the DP peers of a DistributedOptimizer (``dp_group``: their
    shards of one model); the same name from ranks of different TP x DP groups is an error."""
    if group is None:
        return list(local_names)
    tp_key = min(dist.get_process_group_ranks(tp_group)) if tp_group is not None else dist.get_rank()
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        # one key per (TP x DP) block: the smallest TP-group leader among the DP peers
        key = torch.tensor([tp_key], dtype=torch.int64, device=collective_device(dp_group))
        dist.all_reduce(key, op=dist.ReduceOp.MIN, group=dp_group)
        tp_key = int(key.item())
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (tp_key, local_names), group=group)
    names, owner = [], {}
    for key, rank_names in gathered:
        for name in rank_names:
            if name not in owner:
                owner[name] = key
                names.append(name)
            elif owner[name] != key:
                raise ValueError(
                    f"param name {name!r} comes from two TP groups (led by global ranks "
                    f"{owner[name]} and {key}): names must be unique in the whole model (use "
                    "the global layer index, not the pipeline stage's local one)"
                )
    return names
