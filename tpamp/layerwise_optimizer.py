"""Layer-wise distributed optimizer: whole params and their optimizer state owned by one
data-parallel rank each (Megatron-core's LayerWiseDistributedOptimizer,
megatron/core/optimizer/layer_wise_optimizer.py), for optimizers that need whole matrices
(torch.optim.Muon, torch.optim.Adafactor), which the flat-range shards of
:class:`tpamp.DistributedOptimizer` cannot serve.

Usage::

    st = tpamp.parallel.initialize_model_parallel(tp, pp)
    opt = tpamp.LayerWiseDistributedOptimizer(
        torch.optim.Muon(model.parameters(), lr=0.02),
        grad_scaler=tpamp.DynamicGradScaler(initial_scale=2.0**16), clip_grad=1.0,
        data_parallel_group=st.dp_group,
        grad_stats_group=dist.group.WORLD,        # TP x PP x DP
        tensor_parallel_group=st.tp_group,
        param_names=model.named_parameters())
    opt.scale_loss(loss).backward()      # do NOT all-reduce the grads over DP yourself
    update_successful, grad_norm, num_zeros = opt.step()
    opt.zero_grad()

Ownership (:func:`layerwise_owners`): each trainable param goes whole to one DP rank, by
greedy longest-processing-time packing of its cost -- for a param of 2 or more dims with
m = shape[0] and n = the product of the other dims, m * n * min(m, n) (the flops of one
Newton-Schulz iteration, as Megatron-core balances Muon); numel for 0-D and 1-D params -- in
order of decreasing cost (ties: the lower param index), each to the DP rank with the least
cost so far (ties: the lower rank). It depends only on the params' local shapes in param-group
order, so every DP rank computes the same owners, and so do TP peers (whose even shards have
the same local shapes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from tpamp import _peer_settings, _validation, ops, state_formats
from tpamp.common import local_tensor, placed_like
from tpamp.grad_scaler import MegatronGradScaler
from tpamp.grad_stats import counts_toward_norm
from tpamp.nonfinite import param_name_map, rank_coords
from tpamp.optimizer import (
    MixedPrecisionOptimizer,
    StepGrads,
    check_wrapper_args,
    clear_grad,
    param_dtype_error,
)
from tpamp.parallel import resolve_tensor_parallel_group

__all__ = ["LayerWiseDistributedOptimizer", "layerwise_owners", "layerwise_cost"]

Tensor = torch.Tensor
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def layerwise_cost(shape: Sequence[int]) -> int:
    """The balancing cost of a param of local shape ``shape``: m * n * min(m, n) for 2 or
    more dims (m = shape[0], n = the product of the others: one Newton-Schulz iteration's
    flops, up to a constant), numel for 0-D and 1-D params (an elementwise update)."""
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2:
        return math.prod(shape)
    m, n = shape[0], math.prod(shape[1:])
    return m * n * min(m, n)


def layerwise_owners(shapes: Sequence[Sequence[int]], dp_size: int) -> List[int]:
    """The owning DP rank (0 .. dp_size-1) of each param, given the params' local shapes in
    param-group order: greedy longest-processing-time packing by :func:`layerwise_cost` (largest
    cost first, ties by index; each to the least-loaded rank, ties to the lower rank).
    Deterministic: the same shapes give the same owners on every rank. Raises ValueError for
    dp_size < 1."""
    _validation.check_int("dp_size", dp_size, low=1)
    costs = [layerwise_cost(s) for s in shapes]
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    loads = [0] * dp_size
    owners = [0] * len(costs)
    for i in order:
        r = min(range(dp_size), key=lambda k: (loads[k], k))
        owners[i] = r
        loads[r] += costs[i]
    return owners


@dataclass
class _GradBucket:
    """The fp32 grads of the params one DP rank owns, laid out flat in param-group order, then
    one has-a-grad flag per param (summed by the reduce: > 0 when any DP rank had a grad)."""

    owner: int
    params: List[Tensor]
    offsets: List[Tuple[int, int]]
    numel: int  # grads only; the flags follow
    data: Tensor  # [numel + len(params)] fp32


@dataclass
class _ParamBucket:
    """The model params of one dtype that one DP rank owns, flat: the broadcast's buffer."""

    owner: int
    dtype: torch.dtype
    params: List[Tensor] = field(default_factory=list)
    offsets: List[Tuple[int, int]] = field(default_factory=list)
    data: Optional[Tensor] = None


class LayerWiseDistributedOptimizer(MixedPrecisionOptimizer):
    """Whole params, their fp32 main params and their optimizer state owned by one DP rank each
    (Megatron-core's LayerWiseDistributedOptimizer; docs/spec.md section 18), for optimizers
    that are not elementwise (torch.optim.Muon orthogonalizes each whole 2-D update,
    torch.optim.Adafactor factors the second moment into row and column statistics), and for
    any other torch optimizer.

    The interface and step order are those of :class:`tpamp.MixedPrecisionOptimizer`
    (docs/spec.md section 2), which this class is (``isinstance`` holds): it inherits the loss
    scale, the one ``step()`` and its guards, the skip decision, the spike detector,
    ``last_nonfinite``, clipping, the one-pass path (Adam/AdamW/SGD) and the checkpoint hooks,
    and supplies only the step's hooks:

    0. construction: the owner of every trainable param is :func:`layerwise_owners` of the
       local shapes (module docstring); the inner optimizer's param groups keep only this
       rank's owned params (a group may become empty; its hyperparameters stay), existing state
       of the others is dropped, and MixedPrecisionOptimizer's construction makes fp32 main
       params for the owned fp16/bf16 ones only.
    1. ``_sync_grads``: every trainable param's gradient (``main_grad`` when it has one, else
       ``.grad``; any float dtype) is copied as fp32 into its owner's flat bucket (a zero
       slot when it has none), model ``.grad`` is released, and each owner's bucket is
       **reduced** (SUM, ``torch.distributed.reduce``) to the owner over
       ``data_parallel_group``: one collective per DP rank per step. The reduces carry about
       (d-1)/d of the gradient bytes per rank, as a reduce-scatter does, half an all-reduce's;
       the other ranks never need these sums. With each slot goes a has-a-grad
       flag: a param that no DP rank has a grad for is not stepped, as in
       MixedPrecisionOptimizer.
    2. ``_grad_scale``: 1/loss scale x 1/d (the DP mean), applied by the unscale pass on the
       owner's fp32 sums in place (they are the owned main params' grads).
    3-7. found_inf, grad norm and zero count over the owned grads, reduced over
       ``grad_stats_group`` (TP x PP x DP): every param is counted once (on its owner; TP
       duplicates on TP rank 0, ``shared`` copies not at all), so they equal
       MixedPrecisionOptimizer's on the DP-mean gradient to fp32 rounding and every rank takes
       the same skip decision (an inf on any DP rank reaches the owner's sum).
    8. the inner optimizer steps the owned params (whole tensors: the unsharded math of any
       optimizer); the owned fp16/bf16 params get their main params' values, then
       ``_finish_params`` **broadcasts** each owner's params over ``data_parallel_group``
       (one flat buffer per owner and model dtype). A skipped step broadcasts nothing.

    Memory: main params and optimizer state exist for the owned params only (about 1/d of
    MixedPrecisionOptimizer's, as balanced as the costs allow; :meth:`optimizer_state_bytes`).
    Besides, every rank keeps, allocated once, an fp32 gradient buffer of the whole model (one
    flat bucket per owner: the reduces' inputs, the owner's sums; as DistributedOptimizer's grad
    buffer) and a model-dtype broadcast buffer of the whole model. With tensor parallelism each rank
    holds its TP shard and the inner optimizer sees the local shard (a non-elementwise
    optimizer then needs its TP mode, docs/spec.md section 18); ownership is by param index
    and local shape, so TP peers own the same params. Under pipeline parallelism each stage's
    DP group balances its own params; a tied embedding's two copies are summed by the caller
    on their grads before ``step()`` (the reduce happens in ``step()``, never in backward).

    Differences from MixedPrecisionOptimizer: ``main_params_by_group``, ``state_dict`` and the
    checkpoint hooks hold this rank's owned params only (``state_dict`` resumes on the same DP
    layout: its ``layout`` entry is checked; :mod:`tpamp.checkpoint` changes layouts, also
    from and to MixedPrecisionOptimizer); after ``step()`` no model param has a ``.grad``;
    ``last_nonfinite`` records name the owner's DP rank (the reduce leaves no per-rank grads);
    no ``sync_free`` and no narrow state options (exp_avg_dtype, store_param_remainders).

    Args:
        optimizer: a ``torch.optim.Optimizer`` over the model params (any param groups).
        data_parallel_group: this rank's DP group (required; a one-rank group for DP=1).
        grad_stats_group: the TP x PP x DP group for found_inf, norm and zeros
            (``torch.distributed.group.WORLD`` with ``tpamp.parallel`` layouts); None means
            ``data_parallel_group`` (a model without TP or PP), or WORLD when the TP group
            comes from the parallel state (below).
        tensor_parallel_group: the TP group, to count TP-replicated params once. None with
            params that carry Megatron's ``tensor_model_parallel=True``: the TP group of
            ``parallel_state`` or of the initialized parallel state, else ValueError on every
            rank (docs/spec.md section 22).
        grad_scaler, clip_grad, norm_type, log_num_zeros_in_grad, skip_nonfinite,
        spike_detector, fused_step, param_names, parallel_state, deterministic_grad_norm: as for
            MixedPrecisionOptimizer (``param_names`` also names the params this rank does not
            own, in error messages).
        check_params_across_dp: compare a float64 checksum of every param across DP once at
            construction (one all-gather), as DistributedOptimizer does.

    Raises:
        TypeError: optimizer is not a torch.optim.Optimizer; a param is not float32/16/bf16.
        ValueError: data_parallel_group is None or this rank is not in a group; the
            grad_stats_group is not a multiple of DP x TP; the owners differ across the TP
            group (uneven TP shards); params that differ across DP (the first is named); and
            everything MixedPrecisionOptimizer raises (the inner optimizer's groups are then
            restored). From ``step()``: the shared step guard, and
            on the first step ValueError when the owned-param layout differs across DP (the
            ranks hold different params).
    """

    # the fp32 masters and optimizer state are sharded over DP: tpamp.replicas compares
    # only the model params across DP replicas
    replicated_state = False

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        data_parallel_group,
        grad_stats_group=None,
        tensor_parallel_group=None,
        grad_scaler: Optional[MegatronGradScaler] = None,
        clip_grad: float = 0.0,
        norm_type: float = 2.0,
        log_num_zeros_in_grad: bool = False,
        skip_nonfinite: bool = True,
        spike_detector=None,
        fused_step: bool = True,
        param_names=None,
        parallel_state=None,
        check_params_across_dp: bool = True,
        deterministic_grad_norm: bool = False,
    ):
        check_wrapper_args(optimizer, grad_scaler, clip_grad)
        if data_parallel_group is None:
            raise ValueError(
                "data_parallel_group must be this rank's data-parallel process group (a group "
                "of one rank for DP=1), got None"
            )
        _validation.check_group_member(data_parallel_group, "data_parallel_group")
        # TP params with no TP group: the parallel state's groups, else a ValueError, on every
        # rank alike (all params are looked at, before the unowned ones are set aside)
        tensor_parallel_group, grad_stats_group = resolve_tensor_parallel_group(
            [p for g in optimizer.param_groups for p in g["params"]], tensor_parallel_group,
            grad_stats_group, owner="LayerWiseDistributedOptimizer", default_stats_group="world",
            parallel_state=parallel_state)
        if grad_stats_group is None:
            grad_stats_group = data_parallel_group
        _validation.check_group_member(grad_stats_group, "grad_stats_group")
        _validation.check_group_member(tensor_parallel_group, "tensor_parallel_group")
        _peer_settings.check_parallel_groups(  # the layout's groups, before any collective
            parallel_state, data_parallel_group=data_parallel_group,
            tensor_parallel_group=tensor_parallel_group)
        dp_size = dist.get_world_size(data_parallel_group)
        tp_size = dist.get_world_size(tensor_parallel_group) if tensor_parallel_group else 1
        stats_size = dist.get_world_size(grad_stats_group)
        if stats_size % (dp_size * tp_size):
            raise ValueError(
                f"grad_stats_group has {stats_size} ranks; it must span TP x PP x DP, a multiple "
                f"of DP {dp_size} x TP {tp_size} (pass torch.distributed.group.WORLD for "
                "a tpamp.parallel layout)"
            )
        if isinstance(param_names, dict):
            param_names = [(n, p) for p, n in param_names.items()]
        elif param_names is not None:
            param_names = list(param_names)  # read twice (a generator would be spent)
        names = param_name_map(param_names)
        # the params a MixedPrecisionOptimizer steps: fp32 ones, trainable fp16/bf16 ones, with
        # MixedPrecisionOptimizer's default names from their positions before any is removed
        entries: List[Tuple[Tensor, int]] = []
        seen = set()
        for gi, group in enumerate(optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.dtype not in _FLOAT_DTYPES:
                    raise TypeError(param_dtype_error(gi, pi, p))
                if id(p) in seen:
                    raise ValueError(f"param {pi} of param group {gi} appears twice")
                seen.add(id(p))
                if p.dtype == torch.float32 or p.requires_grad:
                    entries.append((p, gi))
                    names.setdefault(id(p), f"group{gi}.param{pi}")
        given = {id(q) for _, q in param_names or []}
        named = list(param_names or []) + [(names[id(p)], p) for p, _ in entries
                                           if id(p) not in given]
        owners = layerwise_owners([tuple(local_tensor(p).shape) for p, _ in entries], dp_size)
        if tp_size > 1:
            _check_owners_across_tp(owners, entries, tensor_parallel_group)
        if check_params_across_dp and dp_size > 1:
            _check_params_across_dp(entries, names, data_parallel_group)
        dp_rank = dist.get_rank(data_parallel_group)
        others = {id(p) for (p, _), o in zip(entries, owners) if o != dp_rank}
        saved_groups = [list(g["params"]) for g in optimizer.param_groups]
        saved_state = {p: optimizer.state[p] for p, _ in entries
                       if id(p) in others and p in optimizer.state}
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) not in others]
        for p in saved_state:
            del optimizer.state[p]
        try:
            super().__init__(
                optimizer, grad_scaler=grad_scaler, clip_grad=clip_grad, norm_type=norm_type,
                log_num_zeros_in_grad=log_num_zeros_in_grad, grad_stats_group=grad_stats_group,
                tensor_parallel_group=tensor_parallel_group, skip_nonfinite=skip_nonfinite,
                sync_free=False, spike_detector=spike_detector, fused_step=fused_step,
                param_names=named, parallel_state=parallel_state,
                deterministic_grad_norm=deterministic_grad_norm,
            )
        except BaseException:
            for group, params in zip(optimizer.param_groups, saved_groups):
                group["params"] = params
            optimizer.state.update(saved_state)
            raise
        self.data_parallel_group = data_parallel_group
        # the DistributedOptimizer settings the cross-rank check compares (no buckets here)
        self.grad_reduce_in_fp32, self.overlap_grad_reduce, self.bucket_size = True, False, None
        self._dp_size, self._dp_rank = dp_size, dp_rank
        self._dp_ranks = dist.get_process_group_ranks(data_parallel_group)
        self._coords = rank_coords(parallel_state, tensor_parallel_group=tensor_parallel_group,
                                   data_parallel_group=data_parallel_group)
        self._entries = entries
        self._owners = owners
        self._owner_of = {id(p): o for (p, _), o in zip(entries, owners)}
        self._names = {id(p): names[id(p)] for p, _ in entries}
        if entries:
            self._set_device(local_tensor(entries[0][0]).device)
        self._grad_buckets = self._make_grad_buckets()
        self._param_buckets = self._make_param_buckets()
        self._reduced: Dict[int, Tensor] = {}  # id(model param) -> its DP-summed fp32 grad

    # -- construction ---------------------------------------------------------------------

    def _make_grad_buckets(self) -> List[_GradBucket]:
        """One fp32 buffer per DP rank (its owned params), allocated once. Non-owners fill
        theirs each step as the reduce's input."""
        out = []
        for o in range(self._dp_size):
            params = [p for (p, _), w in zip(self._entries, self._owners) if w == o]
            offsets, n = [], 0
            for p in params:
                k = local_tensor(p).numel()
                offsets.append((n, n + k))
                n += k
            data = torch.zeros(n + len(params), dtype=torch.float32, device=self._device)
            out.append(_GradBucket(o, params, offsets, n, data))
        return out

    def _make_param_buckets(self) -> List[_ParamBucket]:
        """One model-dtype buffer per (owner, dtype), in owner then dtype order."""
        out: Dict[Tuple[int, torch.dtype], _ParamBucket] = {}
        for (p, _), o in zip(self._entries, self._owners):
            b = out.setdefault((o, p.dtype), _ParamBucket(o, p.dtype))
            start = b.offsets[-1][1] if b.offsets else 0
            b.params.append(p)
            b.offsets.append((start, start + local_tensor(p).numel()))
        buckets = [out[k] for k in sorted(out, key=lambda k: (k[0], str(k[1])))]
        if self._dp_size > 1:
            for b in buckets:
                b.data = torch.empty(b.offsets[-1][1], dtype=b.dtype, device=self._device)
        return buckets

    # -- public interface -----------------------------------------------------------------

    def owners(self) -> Dict[str, int]:
        """{param name: owning DP rank} of every trainable param, in param-group order (the
        same on every DP rank)."""
        return {self._names[id(p)]: o for (p, _), o in zip(self._entries, self._owners)}

    def bucket_layout(self) -> List[Tuple[str, int]]:
        """(model dtype, elements) of each (owner, dtype) broadcast buffer, in owner order;
        every DP rank must have the same (checked across DP on the first step)."""
        return [(str(b.dtype), b.offsets[-1][1]) for b in self._param_buckets]

    @_validation.guard_zero_grad
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the grads of every trainable model param (owned or not) and of the owned main
        params (``main_grad`` buffers belong to whoever attached them and are left alone)."""
        super().zero_grad(set_to_none)
        for p, _ in self._entries:
            clear_grad(p, set_to_none)

    def grad_sources(self):
        """(name, model param, grad) for every gradient the next step() reads: each trainable
        param's ``main_grad`` when it has one, else its ``.grad`` (owned or not: every DP rank
        contributes to the owner's reduce)."""
        out = []
        for p, _ in self._entries:
            grad = getattr(p, "main_grad", None)
            if grad is None:
                grad = p.grad
            if grad is not None:
                out.append((repr(self._names[id(p)]), p, grad))
        return out

    def named_model_params(self) -> List[tuple]:
        """(name, model param) of every trainable param (owned or not), in param-group order:
        the ``param_names`` given at construction, ``group<g>.param<i>`` for the others (their
        positions in the groups as given)."""
        return [(self._names[id(p)], p) for p, _ in self._entries]

    def track_param_grad_norms(self, named_params=None):
        """Per-parameter grad norms, as :meth:`tpamp.MixedPrecisionOptimizer.track_param_grad_norms`
        (the norm of each param's full, DP-mean, unscaled gradient before clipping; TP shards
        combined over TP, TP duplicates once, ``shared`` copies not at all): each param's norm
        is taken on its owner and the others add nothing to the tracker's one all-reduce over
        the grad-stats group. named_params: (global name, model param) pairs, the same names on
        every DP rank; None: the ``param_names`` given at construction. A collective over the
        grad-stats group and the data-parallel group (every rank calls it once)."""
        from tpamp.param_norms import ParamGradNormTracker

        if named_params is None:
            named_params = self.named_model_params()
        mains = [(main, model) for pairs in self._half_pairs for model, main in pairs]
        mains += [(p, p) for fp32s in self._fp32_params for p in fp32s]
        self.param_norm_tracker = ParamGradNormTracker(
            self, named_params, mains=mains, model_params=[p for p, _ in self._entries],
            data_parallel_group=self.data_parallel_group)
        return self.param_norm_tracker

    # -- the step: MixedPrecisionOptimizer.step with the hooks of a layer-wise optimizer ---

    def _sync_grads(self) -> None:
        """Step 1: every grad into its owner's fp32 bucket, then one reduce per owner over DP;
        remembers this rank's reduced grads (those some DP rank had)."""
        handles = []
        for b in self._grad_buckets:
            flags = []
            for p, (s, e) in zip(b.params, b.offsets):
                grad = getattr(p, "main_grad", None)
                if grad is None:
                    grad = p.grad
                slot = b.data[s:e]
                if grad is None:
                    slot.zero_()
                else:
                    slot.copy_(local_tensor(placed_like(grad, p)).reshape(-1))
                flags.append(0.0 if grad is None else 1.0)
                p.grad = None
            if flags:  # one host-to-device copy per bucket
                b.data[b.numel:].copy_(torch.tensor(flags, dtype=torch.float32))
            if self._dp_size > 1 and b.params:
                handles.append(dist.reduce(b.data, dst=self._dp_ranks[b.owner], op=dist.ReduceOp.SUM,
                                           group=self.data_parallel_group, async_op=True))
        for h in handles:
            h.wait()
        mine = self._grad_buckets[self._dp_rank]
        had = mine.data[mine.numel:].tolist() if mine.params else []
        self._reduced = {
            id(p): mine.data[s:e].view(local_tensor(p).shape)
            for p, (s, e), f in zip(mine.params, mine.offsets, had) if f > 0
        }

    def _grad_scale(self) -> Optional[Tensor]:
        """1/loss scale, times 1/d (the mean over d > 1 DP ranks), float32 [1]; None for 1."""
        scale = super()._grad_scale()
        if self._dp_size > 1:
            scale = (scale if scale is not None else self._one) * (1.0 / self._dp_size)
        return scale

    def _owned(self):
        """Per inner param group, [(main param, model param or None for fp32)] owned here."""
        return [[(main, model) for model, main in pairs] + [(p, None) for p in fp32s]
                for pairs, fp32s in zip(self._half_pairs, self._fp32_params)]

    def _generic_grads(self, scale: Optional[Tensor]) -> StepGrads:
        """Generic path: each owned param's DP-summed fp32 grad is its main param's grad, and
        the unscale pass scales it in place (as a Megatron fp32 main_grad)."""
        srcs, mask, mains = [], [], []
        for group in self._owned():
            for main, model in group:
                grad = self._reduced.get(id(model if model is not None else main))
                if grad is None:
                    main.grad = None
                    continue
                main.grad = state_formats.dtensor_like(grad, main)
                srcs.append(local_tensor(main.grad))  # (a DTensor's local view of the same memory)
                mask.append(counts_toward_norm(main, self._tp_rank, self.tensor_parallel_group))
                mains.append(main)
        return StepGrads(False, scale, srcs, mask, mains, outs=srcs)

    def _fused_grads(self, scale: Optional[Tensor]) -> StepGrads:
        """One-pass path: per inner param group, (main, model param or None, DP-summed fp32
        grad, counts toward the norm); no fp32 main grads are filled."""
        entries = []
        for group in self._owned():
            rows = []
            for main, model in group:
                main.grad = None
                grad = self._reduced.get(id(model if model is not None else main))
                if grad is not None:
                    rows.append((main, model, grad,
                                 counts_toward_norm(main, self._tp_rank,
                                                    self.tensor_parallel_group)))
            entries.append(rows)
        flat = [e for rows in entries for e in rows]
        return StepGrads(True, scale, [e[2] for e in flat], [e[3] for e in flat],
                         [e[0] for e in flat], entries=entries)

    def _finish_params(self, grads: StepGrads, updated: bool) -> None:
        """Step 8's second half: owned main params -> owned model params (the one-pass kernel
        wrote them itself), then each owner's params broadcast over DP; nothing moves after a
        skip. No model param or owned main param keeps a grad."""
        super()._finish_params(grads, updated)
        for group in self._owned():
            for main, _ in group:
                main.grad = None
        self._reduced = {}
        if updated:
            self._broadcast_params()

    def _broadcast_params(self) -> None:
        """Each owner's model params, packed per dtype, broadcast over DP and unpacked."""
        if self._dp_size == 1:
            return
        handles = []
        with torch.no_grad():
            for b in self._param_buckets:
                if b.owner == self._dp_rank:
                    ops.scale_and_copy([local_tensor(p.detach()).reshape(-1) for p in b.params],
                                       [b.data[s:e] for s, e in b.offsets])
                handles.append(dist.broadcast(b.data, src=self._dp_ranks[b.owner],
                                              group=self.data_parallel_group, async_op=True))
            srcs, dsts = [], []
            for b, h in zip(self._param_buckets, handles):
                h.wait()
                if b.owner == self._dp_rank:
                    continue
                for p, (s, e) in zip(b.params, b.offsets):
                    dst = local_tensor(p.detach())
                    srcs.append(b.data[s:e].view(dst.shape))
                    dsts.append(dst)
            if srcs:
                ops.scale_and_copy(srcs, dsts)

    # -- checkpointing (same layout: torch.save of each rank's dict) ----------------------

    def _main_param_state(self) -> Dict:
        return {**super()._main_param_state(), "layout": self._layout()}

    def _layout(self) -> Dict:
        return {"dp_size": self._dp_size, "dp_rank": self._dp_rank, "owners": list(self._owners)}

    def state_dict(self) -> Dict:
        """This rank's part: MixedPrecisionOptimizer's keys for the owned params
        ('optimizer', 'grad_scaler', 'fp32_from_fp16_params', 'spike_detector' with a
        detector) and 'layout' (DP size, DP rank, the owner of each param). For another
        layout use :mod:`tpamp.checkpoint`."""
        return super().state_dict()

    def load_state_dict(self, state_dict: Dict) -> None:
        """Restore this rank's part saved by :meth:`state_dict` on the same layout, then
        broadcast the owners' params over DP (a collective over DP). All or nothing, as
        MixedPrecisionOptimizer's (tpamp._validation.load_wrapper_state), and the DP ranks
        agree before any of them loads. Raises TypeError / KeyError / ValueError naming the
        key, ValueError for another layout."""

        def check_layout():
            _validation.check_mapping("state_dict", state_dict)
            if "layout" not in state_dict:
                raise KeyError("layer-wise optimizer state_dict has no 'layout' entry")
            layout = dict(_validation.check_mapping("state_dict['layout']", state_dict["layout"]))
            if layout != self._layout():
                raise ValueError(
                    f"state_dict was saved on layout {layout}, this optimizer has "
                    f"{self._layout()}; load a tpamp.checkpoint checkpoint to change layouts"
                )

        def after_copy():
            self._copy_mains_to_model()
            self._broadcast_params()

        _validation.load_wrapper_state(
            self, state_dict, mains_key="fp32_from_fp16_params",
            match_mains=lambda saved: _validation.match_saved_tensors(
                "state_dict['fp32_from_fp16_params']", saved, self.main_params_by_group()),
            after_copy=after_copy, before=check_layout, agree_group=self.data_parallel_group,
        )


def _check_params_across_dp(entries, names, dp_group) -> None:
    """ValueError on every DP rank when the DP ranks hold different params (count, shapes or
    values: a float64 sum and position-weighted sum per param, compared bitwise), naming the
    first that differs: a non-owner's param is only replaced by its owner's after a step."""
    rows = [float(len(entries))]
    for p, _ in entries:
        x = local_tensor(p).detach().reshape(-1).double()
        w = torch.arange(1, x.numel() + 1, dtype=torch.float64, device=x.device)
        rows += [float(x.numel()), float(x.sum()), float(torch.dot(x, w))]
    sizes = _validation.gather_rows([float(len(rows))], dp_group)
    if any(r != sizes[0] for r in sizes):
        raise ValueError(
            "the model differs across data-parallel ranks: numbers of params "
            f"{[int((r[0] - 1) / 3) for r in sizes]}; every DP rank must hold the same params")
    table = _validation.gather_rows(rows, dp_group)
    for i, (p, gi) in enumerate(entries):
        col = [tuple(r[1 + 3 * i:4 + 3 * i]) for r in table]
        if any(c != col[0] for c in col):
            name = names.get(id(p), f"param {i} (param group {gi})")
            raise ValueError(
                f"params differ across data-parallel ranks at construction: first differing "
                f"param is {name!r} (local shape {tuple(local_tensor(p).shape)}); every DP rank "
                "must start from the same model (seed alike or broadcast from DP rank 0)")


def _check_owners_across_tp(owners: List[int], entries, tp_group) -> None:
    """ValueError on every TP rank when the TP peers computed different owners (their local
    shapes differ: uneven TP shards or different params)."""
    weighted = float(sum((i + 1) * (o + 1) for i, o in enumerate(owners)))
    numel = float(sum(local_tensor(p).numel() for p, _ in entries))
    rows = _validation.gather_rows([float(len(owners)), numel, weighted], tp_group)
    if any(row != rows[0] for row in rows):
        raise ValueError(
            "the layer-wise owners differ across the tensor-parallel group (params, elements, "
            f"owner checksum per TP rank: {rows}); every TP rank must hold even shards of the "
            "same params in the same order"
        )
