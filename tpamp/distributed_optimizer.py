"""Distributed optimizer: fp32 main params and optimizer state sharded over data parallelism
(Megatron-LM's DistributedOptimizer, megatron/core/optimizer/distrib_optimizer.py; ZeRO stage 1).

Usage::

    st = tpamp.parallel.initialize_model_parallel(tp, pp)
    opt = tpamp.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=3e-4),
        grad_scaler=tpamp.DynamicGradScaler(initial_scale=2.0**16), clip_grad=1.0,
        data_parallel_group=st.dp_group,
        grad_stats_group=dist.group.WORLD,        # TP x PP x DP
        tensor_parallel_group=st.tp_group,
        param_names=model.named_parameters())
    opt.scale_loss(loss).backward()      # do NOT all-reduce the grads over DP yourself
    update_successful, grad_norm, num_zeros = opt.step()
    opt.zero_grad()

Layout (as Megatron's): the model params of one dtype are laid out, in reverse order of the
param groups (the order in which backward produces their grads), in flat buffers cut into
buckets of about ``bucket_size`` elements. Each bucket is padded to a multiple of the DP size d
and DP rank r owns its elements [r * n / d, (r + 1) * n / d): a contiguous range that may begin
or end inside a param. For its range alone a rank keeps the fp32 main params (views of one fp32
shard buffer per bucket) and the inner optimizer's state.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from tpamp import _peer_settings, _validation, ops, state_formats
from tpamp.common import local_tensor, placed_like
from tpamp.dp_collectives import all_gather_tensor, start_all_gather, start_reduce_scatter, uses_ring
from tpamp.grad_scaler import MegatronGradScaler
from tpamp.grad_stats import is_expert_param
from tpamp.nonfinite import param_name_map, rank_coords
from tpamp.optimizer import (
    MixedPrecisionOptimizer,
    StepGrads,
    check_fp16_scaler,
    clear_grad,
    param_dtype_error,
)
from tpamp.parallel import ParallelState, default_groups, resolve_tensor_parallel_group
from tpamp.param_groups import group_hyperparameters

__all__ = ["DistributedOptimizer"]

Tensor = torch.Tensor
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# grads of another dtype are added into main_grad in chunks of this many elements, so the
# cast goes through a small temporary (not one the size of the grad: page faults on CPU)
_ADD_CHUNK = 1 << 18


@dataclass
class _Piece:
    """The part of one model param that lies in this rank's shard of one bucket.

    ``param_range``: [start, end) in the param's flattened local tensor; ``shard_range``: the
    same elements' [start, end) in the bucket's shard; ``main``: the fp32 main param (a 1-D
    view of the bucket's main shard buffer) that the inner optimizer steps."""

    param: Tensor
    name: str
    group_index: int
    param_range: Tuple[int, int]
    shard_range: Tuple[int, int]
    bucket_range: Tuple[int, int] = (0, 0)  # the whole param's [start, end) in its bucket
    main: Optional[Tensor] = None
    counts: bool = True


@dataclass
class _Bucket:
    """Params of one dtype laid out in one flat buffer (padded to a multiple of the DP size)."""

    dtype: torch.dtype
    params: List[Tensor]
    offsets: List[Tuple[int, int]]  # [start, end) of each param in the bucket
    numel: int  # padded
    shard_size: int
    grad_data: Tensor  # [numel], fp32 or the model dtype: main_grad views of the params
    main_shard: Tensor  # [shard_size] fp32 main params of this rank's range
    # [shard_size] fp32 main grads: the reduce-scatter's output for fp32 reduces over more
    # than one rank; else made by the first step that needs it (the generic path's unscale
    # output; the one-pass step reads reduce_out itself; see _generic_grads)
    grad_shard: Optional[Tensor]
    # [shard_size] grad_shard, or a model-dtype buffer that is cast into it; grad_data itself
    # when the bucket's group has one rank
    reduce_out: Tensor
    pieces: List[_Piece] = field(default_factory=list)
    # [numel] model dtype: the all-gather's output, and the storage of the params it can hold
    # (see _make_bucket)
    param_data: Optional[Tensor] = None
    param_shard: Optional[Tensor] = None  # [shard_size] model dtype: its input
    handle: Optional[object] = None
    ready: set = field(default_factory=set)
    deferred: bool = False  # reduce-scattered by step(), never by the backward hooks
    index: int = 0  # position in the optimizer's bucket list (the ring collectives' tag)
    written: set = field(default_factory=set)  # params whose main_grad was written since zeroed
    scratch: Optional[Tensor] = None  # [shard_size] partial sums (gloo ring, d > 2)
    # [size, shard_size] every rank's chunk of this rank's shard (deterministic_grad_reduction)
    ordered_recv: Optional[Tensor] = None
    # the group this bucket is reduced and sharded over: DP, or expert-DP for expert params
    group: Optional[object] = None
    size: int = 1  # its number of ranks
    rank: int = 0  # this rank's index in it
    ring: bool = False  # gloo on CPU: isend/irecv rings (tpamp.dp_collectives)
    expert: bool = False


class DistributedOptimizer(MixedPrecisionOptimizer):
    """fp32 main params and optimizer state sharded over the data-parallel group
    (Megatron-LM's DistributedOptimizer; docs/spec.md section 8).

    The interface and step order are those of :class:`tpamp.MixedPrecisionOptimizer`
    (docs/spec.md section 2), with the data-parallel gradient reduction done by ``step()`` itself:

    0. during backward, each param's grad is added into its ``main_grad`` (a view of a flat,
       bucketed buffer: fp32 with ``grad_reduce_in_fp32``, else the model dtype) and ``.grad``
       is released; a grad set by hand (``p.grad = ...``) is added in ``step()``. With
       ``overlap_grad_reduce`` a bucket's reduce-scatter starts as soon as the grads of all its
       params have arrived (async; use :meth:`no_sync` for all but the last microbatch).
    1. every bucket is reduce-scattered (SUM) over ``data_parallel_group`` (d ranks) and
       multiplied by 1/d (in the unscale pass of step 2 for fp32 buckets; before the sum, as
       Megatron-LM does, for fp16/bf16 ones): this rank's shard of the DP-mean gradient lands in
       its fp32 main grads.
       **The caller must not reduce grads over DP itself** (a caller's all-reduce cannot be
       detected and would be applied twice).
    2-5. unscale by 1/loss_scale and found_inf over the shard, reduced with the norm and zero
       statistics over ``grad_stats_group`` (TP x PP x DP: an inf on one DP rank's grad makes
       every rank skip), ``grad_scaler.update``, skip on found_inf (params unchanged).
    6-7. grad_norm and num_zeros: each element of the model's gradient counts once (DP shards
       are disjoint; TP duplicates count on TP rank 0; ``shared`` params not at all), so they
       equal MixedPrecisionOptimizer's to fp32 rounding. Clip on the shard.
    8. the inner optimizer steps the shard's main params; they are cast to the model dtype and
       all-gathered over DP into the model params.

    A :class:`tpamp.MixedPrecisionOptimizer` (``isinstance`` holds, as Megatron-core's
    DistributedOptimizer is a MixedPrecisionOptimizer): it inherits the loss scale, the one
    ``step()`` and its guards, the skip decision, the spike detector, ``last_nonfinite`` and the
    one-pass path, and supplies only what differs through the step's hooks: the gradient
    buckets and their reduce-scatter (``_sync_grads``), the 1/d of the DP mean
    (``_grad_scale``), the shard views the step reads (``_generic_grads`` /
    ``_fused_grads``), the pre-reduce grads for ``last_nonfinite`` and the all-gather of the
    new params (``_finish_params``); the reduce-scatter and all-gather themselves live in
    :mod:`tpamp.dp_collectives`. Construction sets the shared settings through the same core
    but makes no whole-param fp32 copy (MixedPrecisionOptimizer's ``__init__`` is not run):
    the main params are this rank's shard pieces, and the methods tied to whole-param copies
    (state dicts, ``reload_model_params``, ``zero_grad``, ``main_params_by_group``,
    ``named_model_params``, ``track_param_grad_norms``) are this class's own.

    Differences from MixedPrecisionOptimizer: a param whose grad never arrived has a zero
    gradient (its main_grad), not none, so it is stepped (e.g. weight decay) and its zeros are
    counted, as in Megatron-LM; there is no ``sync_free`` mode (the step reads found_inf, the
    norm and the zeros on the host once, after the collective); ``state_dict()`` is this rank's
    shard and resumes on the same layout only (``tpamp.checkpoint`` changes layouts through
    :meth:`sharded_state_dict`).

    Args:
        optimizer: a ``torch.optim.Optimizer`` over the model params (any param groups, which
            keep their hyperparameters). Its groups are changed in place to hold this rank's
            fp32 main-param pieces (1-D tensors); ``.optimizer`` and ``param_groups`` reach it,
            so an LR scheduler on either changes the inner groups. Existing per-param state
            (tensors shaped like the param) is sliced to the shard. Params with
            requires_grad=False are left out (never stepped, never gathered).
        grad_scaler: a tpamp loss scaler; required when any param is fp16.
        clip_grad: max global grad norm (gradient units); 0 disables clipping.
        norm_type: p of the norm (>= 1, or ``math.inf``).
        log_num_zeros_in_grad: count zeros in the filtered gradient each step.
        deterministic_grad_norm: a grad norm with the same bits for any layout (any ZeRO-1
            sharding, TP x PP x DP x EP split) of the same global grads: an exact sum of
            squares, as for MixedPrecisionOptimizer (docs/spec.md section 23).
        deterministic_grad_reduction: reduce-scatter each bucket's grads so that every element
            is the sum of the ranks' values in DP-rank order, ``((g_0 + g_1) + g_2) + ...``:
            the same bits whatever the ring position, bucket boundaries and run (one
            all-to-all and an ordered sum instead of the ring; a receive buffer the size of
            the bucket while it runs). With 2 ranks every SUM already has these bits and
            nothing changes (docs/spec.md section 23). Default False.
        data_parallel_group: this rank's DP group (a one-rank group for DP=1); None: the DP x CP
            group of ``parallel_state``, else of the initialized parallel state
            (megatron-core's, or tpamp's last initialize_model_parallel; docs/spec.md section
            22), else ValueError.
        grad_stats_group: the TP x PP x DP group for found_inf, norm and zeros
            (``torch.distributed.group.WORLD`` with ``tpamp.parallel`` layouts); None means
            ``data_parallel_group`` (a model without TP or PP).
        tensor_parallel_group: the TP group, to count TP-replicated params once.
        grad_reduce_in_fp32: accumulate and reduce-scatter grads in fp32 (default); False
            accumulates and reduces in the model dtype, as Megatron-LM can.
        overlap_grad_reduce: start each bucket's reduce-scatter from backward hooks.
        deferred_reduce_params: params whose gradient the caller changes after backward and
            before ``step()`` -- the tied word embedding, whose two copies' grads (first and
            last pipeline stage) must be summed over the embedding group before the DP
            reduce-scatter, on their ``main_grad``. Each gets a bucket of its own that the
            backward hooks never start (so every other bucket still overlaps); step() reduces
            it. Without overlap_grad_reduce every bucket waits for step() anyway.
        bucket_size: elements per bucket (a bucket closes at the first param boundary at or
            after it); None: one bucket per model dtype.
        param_names: ``model.named_parameters()`` (pairs) or a dict param -> name, used in
            error messages and as checkpoint keys (global names); default
            ``"param_groups.<g>.<i>"``.
        skip_nonfinite: without a scaler, still skip steps with non-finite grads (default).
        check_params_across_dp: compare a float64 checksum of every param across DP once at
            construction.
        spike_detector: a :class:`tpamp.SpikeDetector`, as for MixedPrecisionOptimizer: it
            judges the grad norm reduced over ``grad_stats_group`` (TP x PP x DP) and the loss;
            a spike skip changes no shard, no state and not the loss scale.
        fused_step: when MixedPrecisionOptimizer's fused path would apply (the same rule: an
            exact torch.optim Adam, AdamW or SGD with options the one-pass kernel supports, no
            step hooks, a scaler that never drops below 1), steps 2 and 6-8 run on the shard
            views with the kernels (``tpamp.ops.grad_stats`` read-only over the reduced grad
            shards, then ``tpamp.ops.fused_adam_step_``/``fused_sgd_step_``): the grads are
            multiplied by ONE device factor, 1/d (fp32 reduce) x 1/loss scale x clip
            coefficient, the fp32 shard main params and torch.optim's state (same keys, so
            state_dict and sharded checkpoints are unchanged) are updated, and the model-dtype
            shard that is all-gathered is written in the same pass (no separate cast). No
            fp32 main grads are filled (the inner params' ``.grad`` is None after the step).
            Results equal the generic path's to float32 rounding; the skip decisions are the
            same (found_inf, the norm and the zeros are still read on the host once, before
            the update). False: always the generic path (inner ``optimizer.step()``).
        parallel_state: a :class:`tpamp.parallel.ParallelState`: this rank's TP, PP and DP
            ranks for ``last_nonfinite`` records (default: TP rank from tensor_parallel_group,
            DP rank from data_parallel_group, PP rank None); with expert params
            (:func:`tpamp.is_expert_param`, docs/spec.md section 19) also their
            expert-data-parallel, expert-TP and EP groups. Under context parallelism pass
            ``data_parallel_group=parallel_state.dp_cp_group``.
        expert_data_parallel_group: the group over which expert params are reduce-scattered
            and sharded, in buckets of their own (default:
            ``parallel_state.expert_data_parallel_group``; required when there are expert
            params). Their sum over it is scaled by 1/d with d the size of
            data_parallel_group, as Megatron-core's DDP does, so both parts are the gradient
            of the mean loss. Their statistics share grad_stats_group (it spans every rank).
        expert_tensor_parallel_group: the expert-TP group, to count expert params replicated
            over expert-TP once (default: ``parallel_state.expert_tp_group``, else
            tensor_parallel_group).
        exp_avg_dtype, exp_avg_sq_dtype, store_param_remainders: narrow optimizer state, as for
            MixedPrecisionOptimizer (:mod:`tpamp.state_formats`), on this rank's shard: bf16 /
            8-bit moments (8-bit blocks of 256 elements start at each piece's first element),
            and for bf16 buckets an int16 remainder shard instead of the fp32 main shard (the
            bf16 all-gather input shard then holds the masters' high halves between steps).
            They need the fused path; a step that would take the generic one raises
            RuntimeError before anything changes. :meth:`optimizer_state_bytes` counts them.
        min_8bit_size: as for MixedPrecisionOptimizer (docs/spec.md section 9), decided on the
            whole param's element count, never on a shard piece's, so every DP rank stores a
            param's moments in the same dtype.
        master_weights, stochastic_rounding, stochastic_rounding_seed: as for
            MixedPrecisionOptimizer (docs/spec.md section 21): ``master_weights=False,
            stochastic_rounding=True`` keeps no main shard for bf16 buckets; the bf16
            all-gather input shard is the param, stepped in place with stochastic rounding
            whose random bits depend on each element's index in its whole param (not on the
            shard layout), so every DP size gives the bits of DP 1.

    Attributes:
        last_nonfinite: as MixedPrecisionOptimizer's (tpamp/nonfinite.py), but each param's
            inf/NaN is counted in this rank's LOCAL gradient, before the reduce-scatter mixes
            the DP ranks (the grad buffer, which the reduce-scatter only reads): the record's
            dp_rank is the rank where the value arose. Names are ``param_names``.

    Raises:
        TypeError: optimizer is not a torch.optim.Optimizer; a param is not float32/16/bf16.
        ValueError: data_parallel_group is None or this rank is not in a group; the
            grad_stats_group is smaller than DP x TP; fp16 params without a grad_scaler; bad
            clip_grad, norm_type or bucket_size; an inner optimizer already wrapped or a
            spike_detector used by another optimizer; an inner optimizer not known to be
            elementwise (it steps flat pieces, not matrices: :func:`tpamp.check_sharded_math`,
            docs/spec.md section 17); params that differ across DP ranks at
            construction (the first differing param is named); settings that differ across
            the grad-stats group or a bucket layout that differs across DP (checked at
            construction, a collective over both groups, and again at the first step after a
            load; every rank raises the same error, and the inner optimizer is left as it
            was).
        From ``step()``: the shared step guard (tpamp._validation.guard_step), as
        MixedPrecisionOptimizer's: RuntimeError when the inner param groups changed after
        wrapping or no backward (or zero_grad) ran since the last step; TypeError/ValueError
        for a grad of the wrong dtype, shape or device -- all before anything changes.
    """

    # the fp32 masters and optimizer state are sharded over DP: tpamp.replicas compares
    # only the model params across DP replicas
    replicated_state = False

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        data_parallel_group=None,
        grad_stats_group=None,
        tensor_parallel_group=None,
        grad_scaler: Optional[MegatronGradScaler] = None,
        clip_grad: float = 0.0,
        norm_type: float = 2.0,
        log_num_zeros_in_grad: bool = False,
        grad_reduce_in_fp32: bool = True,
        overlap_grad_reduce: bool = False,
        deferred_reduce_params=None,
        bucket_size: Optional[int] = None,
        skip_nonfinite: bool = True,
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
        store_param_remainders: bool = False,
        spike_detector=None,
        check_params_across_dp: bool = True,
        fused_step: bool = True,
        param_names=None,
        parallel_state=None,
        expert_data_parallel_group=None,
        expert_tensor_parallel_group=None,
        master_weights: bool = True,
        stochastic_rounding: bool = False,
        stochastic_rounding_seed: int = 0,
        min_8bit_size: Optional[int] = None,
        deterministic_grad_norm: bool = False,
        deterministic_grad_reduction: bool = False,
    ):
        _validation.check_bool("deterministic_grad_reduction", deterministic_grad_reduction)
        for gi, group in enumerate(getattr(optimizer, "param_groups", [])):
            for pi, p in enumerate(group["params"]):
                if hasattr(p, "grad_added_to_main_grad") and getattr(p, "main_grad", None) \
                        is not None:  # megatron-core's DDP made its buffer and hooks
                    raise ValueError(
                        f"param {pi} of param group {gi} is in megatron-core's "
                        "DistributedDataParallel (its main_grad buffer and grad hooks): that "
                        "DDP reduces the grads, so this optimizer would take them from it and "
                        "reduce them again; use tpamp.megatron.get_megatron_optimizer(config, "
                        "model_chunks), whose distributed optimizer steps megatron's buffers")
        options = (exp_avg_dtype, exp_avg_sq_dtype, store_param_remainders)
        state_options = self._check_core_args(optimizer, grad_scaler, clip_grad, fused_step, *options,
                                              flat_pieces=True)
        min_8bit_size = state_formats.check_min_8bit_size(min_8bit_size, *state_options[:2])
        master_options = self._check_master_args(
            optimizer, grad_scaler, fused_step, master_weights, stochastic_rounding,
            stochastic_rounding_seed, store_param_remainders)
        _validation.check_int("bucket_size", bucket_size, low=1, allow_none=True)
        if data_parallel_group is None:  # the initialized parallel state's (spec section 22)
            if isinstance(parallel_state, ParallelState):
                data_parallel_group = (parallel_state.dp_cp_group if parallel_state.dp_cp_group
                                       is not None else parallel_state.dp_group)
            else:
                found = default_groups()
                data_parallel_group = found["dp"] if found is not None else None
        if data_parallel_group is None:
            raise ValueError(
                "data_parallel_group must be this rank's data-parallel process group (a group "
                "of one rank for DP=1), got None and no parallel state is initialized "
                "(megatron.core.parallel_state or tpamp.parallel.initialize_model_parallel)"
            )
        _validation.check_group_member(data_parallel_group, "data_parallel_group")
        tensor_parallel_group, grad_stats_group = resolve_tensor_parallel_group(
            [p for g in optimizer.param_groups for p in g["params"]], tensor_parallel_group,
            grad_stats_group, owner="DistributedOptimizer", default_stats_group="world",
            parallel_state=parallel_state)
        if grad_stats_group is None:
            grad_stats_group = data_parallel_group
        _validation.check_group_member(grad_stats_group, "grad_stats_group")
        _validation.check_group_member(tensor_parallel_group, "tensor_parallel_group")
        _validation.check_group_member(expert_data_parallel_group, "expert_data_parallel_group")
        _peer_settings.check_parallel_groups(  # the layout's groups, before any collective
            parallel_state, data_parallel_group=data_parallel_group,
            tensor_parallel_group=tensor_parallel_group,
            expert_data_parallel_group=expert_data_parallel_group,
            expert_tensor_parallel_group=expert_tensor_parallel_group)
        self._init_core(  # sync_free: the step reads the host once (class docstring)
            optimizer, grad_scaler=grad_scaler, clip_grad=clip_grad, norm_type=norm_type,
            log_num_zeros_in_grad=log_num_zeros_in_grad, grad_stats_group=grad_stats_group,
            tensor_parallel_group=tensor_parallel_group, skip_nonfinite=skip_nonfinite,
            sync_free=False, spike_detector=spike_detector, fused_step=fused_step,
            state_options=state_options, parallel_state=parallel_state,
            expert_tensor_parallel_group=expert_tensor_parallel_group,
            master_options=master_options, deterministic_grad_norm=deterministic_grad_norm,
        )
        self.min_8bit_size = min_8bit_size  # decided per whole param (_shard_optimizer)
        self.data_parallel_group = data_parallel_group
        self.grad_reduce_in_fp32 = bool(grad_reduce_in_fp32)
        self.overlap_grad_reduce = bool(overlap_grad_reduce)
        self.deterministic_grad_reduction = deterministic_grad_reduction
        self.bucket_size = bucket_size
        self._dp_size = dist.get_world_size(data_parallel_group)
        self._dp_rank = dist.get_rank(data_parallel_group)
        tp_size = dist.get_world_size(tensor_parallel_group) if tensor_parallel_group else 1
        stats_size = dist.get_world_size(grad_stats_group)
        if stats_size % (self._dp_size * tp_size):
            raise ValueError(
                f"grad_stats_group has {stats_size} ranks; it must span TP x PP x DP, a multiple "
                f"of DP {self._dp_size} x TP {tp_size} (pass torch.distributed.group.WORLD for "
                "a tpamp.parallel layout)"
            )
        self._sync_disabled = False
        self._hooks = []
        self._coords = rank_coords(parallel_state, tensor_parallel_group=tensor_parallel_group,
                                   data_parallel_group=data_parallel_group)

        names = param_name_map(param_names)
        entries, frozen, has_fp16 = [], [], False  # entries: (param, name, group index)
        seen = set()
        for gi, group in enumerate(optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                if id(p) in seen:
                    raise ValueError(f"param {pi} of param group {gi} appears twice")
                seen.add(id(p))
                if p.dtype not in _FLOAT_DTYPES:
                    raise TypeError(param_dtype_error(gi, pi, p))
                if not p.requires_grad:
                    frozen.append(p)  # never has a grad: left out, as MixedPrecisionOptimizer does
                    continue

                has_fp16 |= p.dtype == torch.float16
                entries.append((p, names.get(id(p), f"param_groups.{gi}.{pi}"), gi))
        self._init_expert_dp(entries, parallel_state, expert_data_parallel_group)
        self._deferred = self._check_deferred(deferred_reduce_params, entries)
        check_fp16_scaler(has_fp16, grad_scaler)
        self._names = {id(p): n for p, n, _ in entries}
        self._name_position = {n: i for i, n in enumerate(names.values())}  # param_names' order
        self._model_params = [p for p, _, _ in entries]
        self._set_device(local_tensor(entries[0][0]).device if entries else torch.device("cpu"))
        # gloo on CPU: reduce-scatter and all-gather by isend/irecv rings (tpamp.dp_collectives)
        self._ring_p2p = uses_ring(data_parallel_group, self._device)
        if check_params_across_dp:
            dense = [e for e in entries if id(e[0]) not in self._expert_ids]
            experts = [e for e in entries if id(e[0]) in self._expert_ids]
            if self._dp_size > 1:
                self._check_params_match_across_dp(dense, data_parallel_group)
            if experts and dist.get_world_size(self.expert_data_parallel_group) > 1:
                self._check_params_match_across_dp(experts, self.expert_data_parallel_group)
        old_main_grads = {id(p): getattr(p, "main_grad", None) for p, _, _ in entries}
        self._buckets = self._build_buckets(entries)
        try:
            # the shared cross-rank settings check, here rather than at the first step: a
            # different overlap_grad_reduce or bucket layout would already mismatch the
            # collectives of the first backward
            _validation.agree_on_settings(self)
        except BaseException:
            for p, _, _ in entries:  # _build_buckets' only change to the params
                if old_main_grads[id(p)] is None:
                    del p.main_grad
                else:
                    p.main_grad = old_main_grads[id(p)]
            raise
        self._shard_optimizer(entries)
        self._bucket_of = {id(p): b for b in self._buckets for p in b.params}
        for p, _, _ in entries:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))
        # the shared guards: wrapping again refused, late param groups refused, detector bound
        _validation.register_wrapper(self)

    # -- construction ---------------------------------------------------------------------

    def _check_params_match_across_dp(self, entries, group) -> None:
        """A float64 checksum per param (sum and position-weighted sum), compared bitwise
        across ``group`` (DP; expert-DP for expert params): every rank raises the same error
        naming the first differing param."""
        header = torch.tensor(
            [len(entries), sum(local_tensor(p).numel() for p, _, _ in entries)],
            dtype=torch.float64, device=self._device,
        )
        both = torch.cat([header, -header])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        if not torch.equal(both[:2], -both[2:]):
            raise ValueError(
                "the model differs across data-parallel ranks: (number of params, elements) "
                f"ranges over {both[:2].tolist()} (max) and {(-both[2:]).tolist()} (min)"
            )
        sums = []
        for p, _, _ in entries:
            x = local_tensor(p).detach().reshape(-1).double()
            w = torch.arange(1, x.numel() + 1, dtype=torch.float64, device=x.device)
            sums.append(torch.stack([x.sum(), torch.dot(x, w)]))
        local = torch.stack(sums) if sums else torch.zeros(0, 2, dtype=torch.float64)
        gathered = torch.empty((dist.get_world_size(group),) + tuple(local.shape), dtype=torch.float64,
                               device=local.device)
        all_gather_tensor(gathered.view(-1), local.reshape(-1).contiguous(), group=group)
        bits = gathered.view(torch.int64)
        differs = (bits != bits[0:1]).any(dim=2).any(dim=0)
        if bool(differs.any()):
            i = int(differs.nonzero()[0])
            p, name, _ = entries[i]
            raise ValueError(
                f"params differ across data-parallel ranks at construction: first differing "
                f"param is {name!r} (local shape {tuple(local_tensor(p).shape)}); every DP rank "
                "must start from the same model (seed alike or broadcast from DP rank 0)"
            )

    def _init_expert_dp(self, entries, parallel_state, expert_data_parallel_group) -> None:
        """Expert params (docs/spec.md section 19) are reduced and sharded over the
        expert-data-parallel group (``expert_data_parallel_group``, default the
        parallel_state's); ValueError, naming the first expert param, when there are expert
        params and no such group."""
        _validation.check_group_member(expert_data_parallel_group, "expert_data_parallel_group")
        if expert_data_parallel_group is None and parallel_state is not None:
            expert_data_parallel_group = parallel_state.expert_data_parallel_group
        self._expert_ids = {id(p) for p, _, _ in entries if is_expert_param(p)}
        self.expert_data_parallel_group = expert_data_parallel_group
        self.expert_parallel_group = parallel_state.ep_group if parallel_state is not None else None
        if self._expert_ids and expert_data_parallel_group is None:
            first = next(n for p, n, _ in entries if id(p) in self._expert_ids)
            raise ValueError(
                f"DistributedOptimizer got expert params ({first!r} and "
                f"{len(self._expert_ids) - 1} more) but no expert-data-parallel group: pass "
                "parallel_state= (or expert_data_parallel_group=)"
            )

    @staticmethod
    def _check_deferred(params, entries) -> set:
        """ids of ``deferred_reduce_params``: trainable params of this optimizer (TypeError /
        ValueError naming the position otherwise)."""
        if params is None:
            return set()
        params = _validation.check_tensor_list("deferred_reduce_params", params)
        mine = {id(p) for p, _, _ in entries}
        for i, p in enumerate(params):
            if id(p) not in mine:
                raise ValueError(
                    f"deferred_reduce_params[{i}] (shape {tuple(p.shape)}) is not a trainable "
                    "param of this optimizer's param groups"
                )
        return {id(p) for p in params}

    def _build_buckets(self, entries) -> List[_Bucket]:
        dense = [e for e in entries if id(e[0]) not in self._expert_ids]
        buckets = self._buckets_of(dense, self.data_parallel_group, self._ring_p2p, False)
        experts = [e for e in entries if id(e[0]) in self._expert_ids]
        if experts:  # buckets of their own, over the expert-data-parallel group
            g = self.expert_data_parallel_group
            buckets += self._buckets_of(experts, g, uses_ring(g, self._device), True)
        for i, b in enumerate(buckets):
            b.index = i
        return buckets

    def _buckets_of(self, entries, group, ring, expert) -> List[_Bucket]:
        """The buckets of ``entries``, reduced and sharded over ``group``."""
        info = (group, dist.get_world_size(group), dist.get_rank(group), ring, expert)
        by_dtype: Dict[torch.dtype, list] = {}
        for p, _, _ in reversed(entries):  # backward produces the last params' grads first
            by_dtype.setdefault(p.dtype, []).append(p)
        buckets = []
        for dtype, params in by_dtype.items():
            cur: list = []
            size = 0
            for p in params:
                if id(p) in self._deferred:  # a bucket of its own, reduced by step()
                    if cur:
                        buckets.append(self._make_bucket(dtype, cur, info))
                        cur, size = [], 0
                    buckets.append(self._make_bucket(dtype, [p], info))
                    buckets[-1].deferred = True
                    continue
                cur.append(p)
                size += local_tensor(p).numel()
                if self.bucket_size is not None and size >= self.bucket_size:
                    buckets.append(self._make_bucket(dtype, cur, info))
                    cur, size = [], 0
            if cur:
                buckets.append(self._make_bucket(dtype, cur, info))
        return buckets

    def _make_bucket(self, dtype, params, info) -> _Bucket:
        group, d, r, ring, expert = info
        offsets, start = [], 0
        for p in params:
            n = local_tensor(p).numel()
            offsets.append((start, start + n))
            start += n
        numel = max(d, -(-start // d) * d)
        shard = numel // d
        grad_dtype = torch.float32 if self.grad_reduce_in_fp32 else dtype
        dev = self._device
        grad_data = torch.zeros(numel, dtype=grad_dtype, device=dev)
        remainders = self.store_param_remainders and dtype == torch.bfloat16
        grad_shard = None
        if d == 1:  # one rank: the buffer is its own reduce-scatter output (no copy)
            reduce_out = grad_data
        elif grad_dtype == torch.float32:
            reduce_out = grad_shard = torch.zeros(shard, dtype=torch.float32, device=dev)
        else:
            reduce_out = torch.zeros(shard, dtype=grad_dtype, device=dev)
        bucket = _Bucket(
            dtype=dtype, params=list(params), offsets=offsets, numel=numel, shard_size=shard,
            grad_data=grad_data,
            # int16 remainders of the bf16 param_shard with store_param_remainders
            main_shard=torch.zeros(shard, dtype=torch.int16 if remainders else torch.float32,
                                   device=dev),
            grad_shard=grad_shard, reduce_out=reduce_out,
            group=group, size=d, rank=r, ring=ring, expert=expert,
        )
        sr = self.stochastic_rounding and dtype == torch.bfloat16
        if dtype != torch.float32:
            # The all-gather buffer; this rank's chunk is the gather's input (an in-place
            # gather, as Megatron-LM's), written by the step. With remainders it holds the
            # masters' high halves, with stochastic rounding the param itself, stepped in place
            # (no master, docs/spec.md section 21): a bf16 shard kept between steps.
            bucket.param_data = torch.zeros(numel, dtype=dtype, device=dev)
            bucket.param_shard = bucket.param_data[r * shard:(r + 1) * shard]
            with torch.no_grad():
                for p, (a, b) in zip(params, offsets):
                    bucket.param_data[a:b].copy_(local_tensor(p).detach().reshape(-1))
                    if type(p) is torch.nn.Parameter and p.is_contiguous():
                        # the param's storage becomes its slot of the buffer (Megatron-LM's
                        # params are views of their bucket's buffer): the gather (or, on one
                        # rank, the step itself) writes the param, no copy after it. A param
                        # given other storage later (p.data = ...) is copied into again.
                        p.data = bucket.param_data[a:b].view(p.shape)
        if sr:  # the main shard is that same tensor
            bucket.main_shard = bucket.param_shard
        for p, (a, b) in zip(params, offsets):
            # Megatron-LM's main_grad convention: the param's slot in the grad buffer
            p.main_grad = grad_data[a:b].view(local_tensor(p).shape)
        return bucket

    def _shard_optimizer(self, entries) -> None:
        """Create this rank's main-param pieces and put them in the inner optimizer's groups."""
        info = {id(p): (name, gi) for p, name, gi in entries}
        lo_hi = lambda b: (b.rank * b.shard_size, (b.rank + 1) * b.shard_size)
        new_groups: List[List[Tensor]] = [[] for _ in self.optimizer.param_groups]
        by_param: Dict[int, List[_Piece]] = {}
        for b in self._buckets:
            lo, hi = lo_hi(b)
            for p, (a, e) in zip(b.params, b.offsets):
                s, t = max(a, lo), min(e, hi)
                if s >= t:
                    continue
                name, gi = info[id(p)]
                piece = _Piece(p, name, gi, (s - a, t - a), (s - lo, t - lo), (a, e))
                piece.counts = self._counts(p)
                # fp32 masters from the param; a remainder (0: master = bf16 value) or
                # stochastic-rounding bucket's bf16 shard already holds it (_make_bucket)
                if b.main_shard.dtype == torch.float32:
                    with torch.no_grad():
                        flat = local_tensor(p).detach().reshape(-1)
                        b.main_shard[s - lo:t - lo].copy_(flat[s - a:t - a])
                if b.main_shard.dtype != torch.float32:  # no fp32 storage: a placeholder key
                    piece.main = torch.nn.Parameter(
                        torch.zeros((), device=b.main_shard.device).expand(t - s),
                        requires_grad=True)
                    if b.main_shard.dtype == torch.int16:
                        self._remainders[id(piece.main)] = b.main_shard[s - lo:t - lo]
                    else:  # stochastic rounding: the param's bf16 shard, its global index
                        self._sr_params[id(piece.main)] = b.param_shard[s - lo:t - lo]
                        self._sr_rows[id(piece.main)] = (state_formats.stochastic_rounding_key(
                            self.stochastic_rounding_seed, name), s - a)
                else:
                    piece.main = torch.nn.Parameter(b.main_shard[s - lo:t - lo],
                                                    requires_grad=True)
                if b.grad_shard is not None:
                    piece.main.grad = b.grad_shard[s - lo:t - lo]
                # min_8bit_size decides on the whole param: every DP rank's pieces alike
                self._whole_numel[id(piece.main)] = p.numel()
                b.pieces.append(piece)
                by_param.setdefault(id(p), []).append(piece)
        # keep the user's order inside each group: params in group order, pieces in range order
        state = self.optimizer.state
        for p, _, gi in entries:
            old = state.pop(p, None)
            for piece in sorted(by_param.get(id(p), []), key=lambda q: q.param_range):
                new_groups[gi].append(piece.main)
                if old:
                    state[piece.main] = _slice_state(old, p, piece.param_range)
        param_of = {id(q.main): q.param for b in self._buckets for q in b.pieces}
        for group, params in zip(self.optimizer.param_groups, new_groups):
            if "param_names" in group:  # torch.optim's names: one per piece (its param's)
                name_of = {id(p): n for p, n in zip(group["params"], group["param_names"])}
                group["param_names"] = [name_of[id(param_of[id(m)])] for m in params]
            group["params"] = params
        self._pieces = [q for b in self._buckets for q in b.pieces]

    # -- public interface -----------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self):
        """Within this context the backward hooks only accumulate grads and start no
        reduce-scatter (all but the last microbatch of a step, with overlap_grad_reduce)."""
        old, self._sync_disabled = self._sync_disabled, True
        try:
            yield
        finally:
            self._sync_disabled = old

    @_validation.guard_zero_grad
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the grad buffers (``main_grad`` of every model param) and release model
        ``.grad`` (set_to_none) or zero it. Waits for any reduce-scatter still in flight."""
        for b in self._buckets:
            if b.handle is not None:
                b.handle.wait()
                b.handle = None
            b.ready.clear()
            b.grad_data.zero_()
            b.written.clear()
            for p in b.params:
                clear_grad(p, set_to_none)

    def reload_model_params(self) -> None:
        """Copy model params -> this rank's main-param shard (after the model's weights were
        changed, e.g. loaded from a checkpoint)."""
        with torch.no_grad():
            srcs, dsts = [], []
            for q in self._pieces:
                a, b = q.param_range
                srcs.append(local_tensor(q.param).detach().reshape(-1)[a:b])
                rem = self._remainders.get(id(q.main))
                if id(q.main) in self._sr_params:  # the bf16 value itself (no master)
                    dsts.append(self._sr_params[id(q.main)])
                elif rem is None:
                    dsts.append(q.main.detach())
                else:  # the bf16 value itself, remainder 0
                    dsts.append(self._bucket_of[id(q.param)].param_shard[
                        q.shard_range[0]:q.shard_range[1]])
                    rem.zero_()
            ops.scale_and_copy(srcs, dsts)

    def _on_grad_ready(self, param: Tensor) -> None:
        """Post-accumulate-grad hook: grad -> main_grad; maybe start the bucket's reduce."""
        bucket = self._bucket_of[id(param)]
        self._accumulate(param, bucket)
        if self.overlap_grad_reduce and not self._sync_disabled and not bucket.deferred:
            bucket.ready.add(id(param))
            if len(bucket.ready) == len(bucket.params):
                self._start_reduce(bucket)

    def _accumulate(self, param: Tensor, bucket: _Bucket) -> None:
        grad = param.grad
        if grad is None:
            return
        if bucket.handle is not None:
            raise RuntimeError(
                f"a grad of {self._names[id(param)]!r} arrived after its bucket's "
                "reduce-scatter started; with overlap_grad_reduce=True run all but the last "
                "microbatch's backward under optimizer.no_sync()"
            )
        grad = local_tensor(placed_like(grad, param))
        main_grad = param.main_grad
        with torch.no_grad():
            if id(param) not in bucket.written:  # the slot is zero (zero_grad): 0 + g is g
                main_grad.copy_(grad)
                bucket.written.add(id(param))
            elif grad.dtype == main_grad.dtype or not grad.is_contiguous() or (
                    grad.shape != main_grad.shape):
                main_grad.add_(grad)
            else:  # fp16/bf16 into fp32: cast chunk by chunk, no grad-sized temporary
                flat, src = main_grad.view(-1), grad.view(-1)
                for i in range(0, flat.numel(), _ADD_CHUNK):
                    flat[i:i + _ADD_CHUNK].add_(src[i:i + _ADD_CHUNK])
        param.grad = None

    def _start_reduce(self, bucket: _Bucket) -> None:
        if self._dp_size > 1 and not self.grad_reduce_in_fp32:
            # a half-precision sum could overflow: scale by 1/d before it, as Megatron-LM does
            # (an fp32 sum cannot: there 1/d joins the unscale pass of step(), no extra pass).
            # Expert buckets too: their sum over expert-DP times 1/d (the dense DP size) is
            # the gradient of the mean loss, as Megatron-core's DDP scales them
            bucket.grad_data.mul_(1.0 / self._dp_size)
        if bucket.ring and bucket.size > 2 and bucket.scratch is None:
            bucket.scratch = torch.empty_like(bucket.reduce_out)
        if self.deterministic_grad_reduction and bucket.size > 2 and bucket.ordered_recv is None:
            bucket.ordered_recv = bucket.grad_data.new_empty((bucket.size, bucket.shard_size))
        bucket.handle = start_reduce_scatter(
            bucket.group, bucket.grad_data, bucket.reduce_out, 2 * bucket.index,
            ring=bucket.ring, scratch=bucket.scratch,
            ordered_recv=bucket.ordered_recv if self.deterministic_grad_reduction else None)

    def grad_sources(self):
        """(name, model param, grad) for every gradient the next step() reads: each param's
        ``main_grad`` (its slot in the bucket's grad buffer) and a ``.grad`` set by hand. The
        step guard (tpamp._validation.guard_step) checks them before the step changes
        anything, and that one changed (a backward or zero_grad) since the last step."""
        out = []
        for b in self._buckets:
            for p in b.params:
                name = self._names[id(p)]
                out.append((f"{name!r} (main_grad)", p, p.main_grad))
                if p.grad is not None:
                    out.append((repr(name), p, p.grad))
        return out

    def param_group_indices(self) -> Dict[int, int]:
        """id(model param) -> index of the inner optimizer's param group that steps its pieces
        on this rank (params with no piece here are absent)."""
        return {id(q.param): q.group_index for q in self._pieces}

    def main_params_by_group(self) -> List[List[Tensor]]:
        """Per inner param group, this rank's fp32 main-param pieces (1-D views of the main
        shards; storage-free placeholders for remainder buckets), in the group's order."""
        return [list(g["params"]) for g in self.optimizer.param_groups]

    def named_model_params(self) -> List[tuple]:
        """(name, model param) of every trained param (requires_grad) in param-group order:
        the ``param_names`` given at construction, ``param_groups.<g>.<i>`` for the others."""
        return [(self._names[id(p)], p) for p in self._model_params]

    def bucket_layout(self) -> List[Tuple[str, int]]:
        """(model dtype, padded number of elements) of each bucket, in reduce order; every DP
        rank must have the same (checked across DP on the first step)."""
        return [(str(b.dtype), b.numel) for b in self._buckets]

    def track_param_grad_norms(self, named_params):
        """Per-parameter grad norms, as :meth:`tpamp.MixedPrecisionOptimizer.track_param_grad_norms`
        (the same meaning: the norm of each param's full, DP-mean, unscaled gradient before
        clipping; TP shards combined over TP, TP duplicates once, ``shared`` copies not at
        all): a param whose flat range is split across DP shards has its pieces' p-th powers
        summed over the grad-stats group (TP x PP x DP) before the root, with the one
        all-reduce the tracker always does. named_params: (global name, model param) pairs,
        the same names on every DP rank. A collective over the grad-stats group and one over
        the data-parallel group (every rank calls it once). Steps with
        ``param_grad_norms=True`` take the step's usual path (one-pass when it applies)."""
        from tpamp.param_norms import ParamGradNormTracker

        self.param_norm_tracker = ParamGradNormTracker(
            self, named_params, mains=[(q.main, q.param) for q in self._pieces],
            model_params=self._model_params,
            data_parallel_group=self.data_parallel_group,
        )
        return self.param_norm_tracker

    # -- the step: MixedPrecisionOptimizer.step with the hooks of a sharded optimizer --------

    def _sync_grads(self) -> None:
        """Step 1: grads set by hand go into main_grad, every bucket not yet reduced is
        reduce-scattered, and all are waited for."""
        for b in self._buckets:
            if b.handle is None:
                for p in b.params:
                    self._accumulate(p, b)
                self._start_reduce(b)
            elif any(p.grad is not None for p in b.params):
                p = next(p for p in b.params if p.grad is not None)
                self._accumulate(p, b)  # raises: the bucket was already sent
        for b in self._buckets:
            b.handle.wait()
            b.handle = None
            b.ready.clear()

    def _grad_scale(self) -> Optional[Tensor]:
        """1/loss scale, times 1/d for an fp32 reduce over d > 1 DP ranks (the mean over DP;
        a model-dtype reduce was scaled by 1/d before the sum), float32 [1]; None for 1."""
        scale = super()._grad_scale()
        if self.grad_reduce_in_fp32 and self._dp_size > 1:  # the mean over DP: 1/d (<= 1)
            scale = (scale if scale is not None else self._one) * (1.0 / self._dp_size)
        return scale

    def _generic_grads(self, scale: Optional[Tensor]) -> StepGrads:
        """Generic path: the reduced grad shards (fp32, or the model dtype) are read by the
        unscale pass, which writes each piece's fp32 main grad (a view of the bucket's fp32
        grad shard: in place for fp32 reduces over more than one rank)."""
        srcs, outs, mask, mains = [], [], [], []
        for b in self._buckets:
            if b.grad_shard is None:
                b.grad_shard = torch.zeros(b.shard_size, dtype=torch.float32,
                                           device=self._device)
            for q in b.pieces:
                s, t = q.shard_range
                q.main.grad = out = b.grad_shard[s:t]  # the inner zero_grad may drop it
                # the same tensor object when reduced in fp32: grad_stats then works in place
                srcs.append(out if b.reduce_out is b.grad_shard else b.reduce_out[s:t])
                outs.append(out)
                mask.append(q.counts)
                mains.append(q.main)
        return StepGrads(False, scale, srcs, mask, mains, outs=outs)

    def _fused_grads(self, scale: Optional[Tensor]) -> StepGrads:
        """One-pass path: per inner param group, (main piece, its slice of the model-dtype
        all-gather input or None for fp32 buckets, reduced grad slice, counts toward the norm);
        the grads, mask and pieces in bucket and piece order. No fp32 main grads are filled."""
        entries: List[list] = [[] for _ in self.optimizer.param_groups]
        grads, mask, mains = [], [], []
        for b in self._buckets:
            half = self._gather_buffers(b) is not b.main_shard
            for q in b.pieces:
                s, t = q.shard_range
                q.main.grad = None  # no fp32 main grads on this path
                g = b.reduce_out[s:t]
                entries[q.group_index].append(
                    (q.main, b.param_shard[s:t] if half else None, g, q.counts))
                grads.append(g)
                mask.append(q.counts)
                mains.append(q.main)
        return StepGrads(True, scale, grads, mask, mains, entries=entries)

    def _nonfinite_grads(self, grads: StepGrads):
        """(names, tensors) in model order: each param's local gradient as this rank
        accumulated it, before the DP reduce-scatter (its slot of the grad buffer, which the
        reduce-scatter only reads), so a non-finite value is attributed to the DP rank where it
        arose (``last_nonfinite``)."""
        slot = {id(p): (b, a, e) for b in self._buckets for p, (a, e) in zip(b.params, b.offsets)}
        names, tensors = [], []
        for pid, name in self._names.items():  # model (param group) order
            b, a, e = slot[pid]
            names.append(name)
            tensors.append(b.grad_data[a:e])
        return names, tensors

    def _finish_params(self, grads: StepGrads, updated: bool) -> None:
        """Step 8's second half: the main shards (cast to the model dtype, unless the one-pass
        kernel wrote it) all-gathered over DP into the model params; nothing after a skip."""
        if updated:
            self._gather_model_params(cast=not grads.fused)

    def _gather_buffers(self, b: _Bucket) -> Tensor:
        """The bucket's all-gather output and input (kept between steps: no allocation, no
        page faults per step); returns the input: ``b.main_shard`` itself for fp32 params,
        else this rank's chunk of the output (an in-place all-gather, as Megatron-LM's; made
        with the bucket, see _make_bucket)."""
        if b.param_data is None:  # fp32 params, at their first gather
            b.param_data = torch.empty(b.numel, dtype=b.dtype, device=self._device)
            b.param_shard = b.main_shard
        return b.param_shard

    def _gather_model_params(self, cast: bool = True) -> None:
        """Step 8's second half: main shard -> model dtype (skipped with cast=False: the
        one-pass step wrote it), all-gather over DP, copy into the model params (one cast
        pass, one collective per bucket, one copy pass)."""
        for b in self._buckets:
            self._gather_buffers(b)
        if cast:
            casts = [b for b in self._buckets if b.param_shard is not b.main_shard
                     and b.main_shard.dtype == torch.float32]  # remainders: already bf16
            ops.scale_and_copy([b.main_shard for b in casts], [b.param_shard for b in casts])
        handles = []
        for b in self._buckets:
            d, r = b.size, b.rank
            own = b.param_data[r * b.shard_size:(r + 1) * b.shard_size]
            if (b.ring or d == 1) and b.param_shard.data_ptr() != own.data_ptr():
                # fp32 params (the main shard is the input): into this rank's chunk of the
                # in-place gather (an fp16 / bf16 bucket's shard is that chunk already)
                own.copy_(b.param_shard)
            handles.append(start_all_gather(b.group, b.param_data,
                                            b.param_shard, 2 * b.index + 1, ring=b.ring))
        srcs, dsts = [], []
        for b, h in zip(self._buckets, handles):
            h.wait()
            full = b.param_data
            for p, (a, e) in zip(b.params, b.offsets):
                dst = local_tensor(p).detach()
                src = full[a:e]
                if dst.data_ptr() == src.data_ptr():  # the param is its slot (_make_bucket)
                    continue
                srcs.append(src.view(dst.shape))
                dsts.append(dst)
        if srcs:
            ops.scale_and_copy(srcs, dsts)

    # -- introspection ----------------------------------------------------------------------

    def shard_ranges(self) -> Dict[str, List[Tuple[int, int]]]:
        """name -> this rank's [start, end) ranges of the param's flattened local tensor."""
        out: Dict[str, List[Tuple[int, int]]] = {}
        for q in self._pieces:
            out.setdefault(q.name, []).append(q.param_range)
        return out

    def _main_param_bytes(self) -> int:
        return sum(b.main_shard.numel() * b.main_shard.element_size() for b in self._buckets
                   if b.main_shard is not b.param_shard)  # no master: the param's own shard

    def fp32_state_bytes(self) -> int:
        """The old name of :meth:`optimizer_state_bytes` (one implementation; this name now
        also counts the 0-dim state tensors, such as Adam's step counts, that it left out)."""
        return self.optimizer_state_bytes()

    def _update_norm_masters(self, grads) -> List[Tensor]:
        """Per entry of ``grads.mains`` (this rank's pieces), its fp32 master (a view of the
        main shard, or rebuilt from param shard + remainder / the bf16 value): the values the
        per-parameter update norms compare (tpamp/update_norms.py)."""
        piece_of = {id(q.main): q for q in self._pieces}
        return [self._piece_master(piece_of[id(m)]) for m in grads.mains]

    def _piece_master(self, q: _Piece) -> Tensor:
        """The fp32 master of a piece (a view; rebuilt from param + remainder: a new tensor)."""
        if id(q.main) in self._sr_params:  # no master: the bf16 value (a new tensor)
            return self._sr_params[id(q.main)].float()
        rem = self._remainders.get(id(q.main))
        if rem is None:
            return q.main.detach()
        s, t = q.shard_range
        return ops.join_remainders(self._bucket_of[id(q.param)].param_shard[s:t], rem)

    def _set_piece_master(self, q: _Piece, value: Tensor) -> None:
        """q's fp32 master = value (split exactly into param + remainder for remainders)."""
        if id(q.main) in self._sr_params:  # no master: rounded to nearest into bf16
            self._sr_params[id(q.main)].copy_(value.to(self._sr_params[id(q.main)].device))
            return
        rem = self._remainders.get(id(q.main))
        if rem is None:
            q.main.copy_(value)
            return
        s, t = q.shard_range
        hi, lo = ops.split_remainders(value.to(rem.device))
        self._bucket_of[id(q.param)].param_shard[s:t].copy_(hi)
        rem.copy_(lo)

    # -- sharded checkpoints (tpamp.checkpoint, torch.distributed.checkpoint) -------------

    def sharded_state_dict(self, model_params) -> Dict:
        """The hook of ``tpamp.checkpoint``: this rank's main params and inner state keyed by
        the global names of ``model_params`` ({global name: model param}), each a 1-piece
        ShardedTensor of the param's GLOBAL shape whose local shards are views of this rank's
        flat range (cut into row-major boxes), so torch.distributed.checkpoint writes and reads
        them in place and a checkpoint loads on any layout, with or without this optimizer.

        Returns {"main_params": {name: ShardedTensor}, "state": {name: {key: ShardedTensor or
        the 0-dim tensor/object as torch.optim keeps it}}, "param_groups": [hyperparameters]}.
        A TP shard's boxes are offset by its TP position (DTensor Shard(d) or Megatron
        ``partition_dim``, even shards); the metadata of the other ranks' boxes is computed
        here (every rank knows the layout), so no communication happens. Raises ValueError for
        a param of this optimizer that is missing from model_params."""
        names = {id(p): n for n, p in model_params.items()}
        mains, state, by_name = {}, {}, {}
        for q in self._pieces:
            name = names.get(id(q.param))
            if name is None:
                raise ValueError(
                    f"the optimizer updates {q.name!r} (local shape "
                    f"{tuple(local_tensor(q.param).shape)}), which is not in model_params: give "
                    "every trained param a global name"
                )
            if name in by_name:
                raise ValueError(f"{name!r}: two pieces of one param on one rank")
            by_name[name] = q
            mains[name] = self._sharded_view(q, self._piece_master(q))
            st = self.optimizer.state.get(q.main)
            if st:
                st = state_formats.layout_free_state(st)  # 8-bit moments as float32 values
                state[name] = {
                    k: self._sharded_view(q, v) if isinstance(v, Tensor) and v.shape == q.main.shape
                    else v
                    for k, v in st.items()
                }
        self._ckpt_pieces = by_name
        groups = [group_hyperparameters(g) for g in self.optimizer.param_groups]
        return {"main_params": mains, "state": state, "param_groups": groups}

    def load_sharded_state_dict(self, state: Dict) -> None:
        """The hook of ``tpamp.checkpoint``: copy ``state`` (the structure of
        :meth:`sharded_state_dict`, read into new buffers sharded like it) into the main
        shards, the inner optimizer's state and param groups, then all-gather the model params
        (collective over DP)."""
        pieces = getattr(self, "_ckpt_pieces", None)
        if pieces is None:
            raise RuntimeError("load_sharded_state_dict needs a sharded_state_dict() call first")
        inner = self.optimizer
        with torch.no_grad():
            for name, q in pieces.items():
                self._set_piece_master(q, _flat_local(state["main_params"][name]))
                new = {}
                for k, v in state["state"].get(name, {}).items():
                    if _is_sharded(v):
                        v = _flat_local(v).float()
                    elif isinstance(v, Tensor):
                        v = v.to(_scalar_device(k, inner.state.get(q.main, {}), q,
                                                inner.param_groups[q.group_index]))
                    new[k] = v
                if new:
                    inner.state[q.main] = new
                else:
                    inner.state.pop(q.main, None)
            for g, saved in zip(inner.param_groups, state["param_groups"]):  # in live order
                g.update(group_hyperparameters(saved))
            self._convert_state()  # moments into this optimizer's configured dtypes
            self._gather_model_params()
        # as after load_state_dict: a fresh step guard, settings compared again at the next step
        _validation.reset_step_guard(self, settings=True)

    def _sharded_view(self, q: _Piece, flat: Tensor):
        """``flat`` (1-D, the piece's elements) as a ShardedTensor of the param's global shape."""
        from torch.distributed._shard.metadata import ShardMetadata
        from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
        from torch.distributed._shard.sharded_tensor.metadata import (
            ShardedTensorMetadata,
            TensorProperties,
        )

        from tpamp.checkpoint import flat_range_chunks

        local = local_tensor(q.param)
        bucket = self._bucket_of[id(q.param)]
        tp_group = self.expert_tensor_parallel_group if bucket.expert else self.tensor_parallel_group
        global_shape, tp_peers = _tp_layout(q.param, tp_group)
        if bucket.expert:  # and the EP peers' experts beside them (expert_dim)
            global_shape, tp_peers = _ep_layout(q.param, global_shape, tp_peers,
                                                self.expert_parallel_group)
        dp_ranks = dist.get_process_group_ranks(bucket.group)
        me = dist.get_rank()
        a, e = q.bucket_range
        shards_md, local_shards = [], []
        dev = flat.device
        for peer, tp_off in tp_peers:
            for i in range(bucket.size):
                lo = max(a, i * bucket.shard_size)
                hi = min(e, (i + 1) * bucket.shard_size)
                if lo >= hi:
                    continue
                rank = peer + dp_ranks[i] - me  # the grid position (TP peer, DP rank i)
                mine = peer == me and i == bucket.rank
                for off, sizes, fo in flat_range_chunks(local.shape, lo - a, hi - a):
                    md = ShardMetadata([o + t for o, t in zip(off, tp_off)], list(sizes),
                                       f"rank:{rank}/{dev}")
                    shards_md.append(md)
                    if mine:
                        start = fo - q.param_range[0]
                        box = flat[start:start + math.prod(sizes)].view(sizes)
                        local_shards.append(Shard(box, md))
        props = TensorProperties(dtype=flat.dtype, layout=torch.strided, requires_grad=False,
                                 memory_format=torch.contiguous_format, pin_memory=False)
        md = ShardedTensorMetadata(shards_md, torch.Size(global_shape), props)
        return ShardedTensor._init_from_local_shards_and_global_metadata(local_shards, md)

    # -- checkpointing (same layout: torch.save of each rank's dict) ----------------------

    def state_dict(self) -> Dict:
        """This rank's shard: {'optimizer': inner state dict, 'grad_scaler': scaler state,
        'shard_main_params': per bucket its fp32 main shard, 'layout': DP size and rank and
        each bucket's padded size} ('spike_detector' with a detector). For another layout use
        the sharded checkpoint path."""
        return super().state_dict()

    def _main_param_state(self) -> Dict:
        return {
            "shard_main_params": [self._bucket_master(b) for b in self._buckets],
            "layout": self._layout(),
        }

    def _bucket_master(self, b: _Bucket) -> Tensor:
        """A bucket's fp32 main shard (a copy; rebuilt from param + remainder shards)."""
        if b.main_shard.dtype == torch.int16:
            return ops.join_remainders(b.param_shard, b.main_shard)
        # a copy (bf16 without master: its value in float32)
        return b.main_shard.detach().to(torch.float32, copy=True)

    def _layout(self) -> Dict:
        return {
            "dp_size": self._dp_size,
            "dp_rank": self._dp_rank,
            "bucket_numels": [b.numel for b in self._buckets],
        }

    def load_state_dict(self, state_dict: Dict) -> None:
        """Restore this rank's shard saved by :meth:`state_dict` on the same layout, then
        all-gather the model params (a collective over DP).

        All or nothing, with MixedPrecisionOptimizer's one load path
        (``tpamp._validation.load_wrapper_state``): the layout, the inner optimizer state
        (param counts, the optimizer class's hyperparameters -- an SGD state dict is refused by
        an Adam -- state keys, shard-shaped state, finite values), the scaler state against the
        scaler's config, the spike detector's state and the main shards (float32, one per
        bucket of this rank's shard length, finite) are all checked before anything changes,
        and the DP ranks agree (one all-gather of a flag) before any of them loads, so a state
        dict refused on one DP rank is loaded on none. Raises TypeError for a non-dict (None
        included) or a value of the wrong type, KeyError for a missing key, ValueError for a
        value that does not fit or a different layout (DP size, rank or buckets), each naming
        the key; the other DP ranks raise ValueError naming the rank that refused."""

        def check_layout():
            _validation.check_mapping("state_dict", state_dict)
            if "layout" not in state_dict:
                raise KeyError("distributed optimizer state_dict has no 'layout' entry")
            layout = _validation.check_mapping("state_dict['layout']", state_dict["layout"])
            if dict(layout) != self._layout():
                raise ValueError(
                    f"state_dict was saved on layout {dict(layout)}, this optimizer has "
                    f"{self._layout()}; load a sharded (torch.distributed.checkpoint) "
                    "checkpoint to change layouts"
                )

        # remainder buckets (int16 main shard): the saved fp32 shard lands in a scratch
        # tensor, then is split exactly into the bf16 param shard + remainder
        scratch = {i: torch.empty(b.shard_size, dtype=torch.float32, device=self._device)
                   for i, b in enumerate(self._buckets) if b.main_shard.dtype != torch.float32}

        def after_copy():
            for i, t in scratch.items():
                b = self._buckets[i]
                if b.main_shard is b.param_shard:  # no master: rounded to nearest into bf16
                    b.param_shard.copy_(t)
                    continue
                hi, lo = ops.split_remainders(t)
                b.param_shard.copy_(hi)
                b.main_shard.copy_(lo)
            self._convert_state()  # moments into this optimizer's configured dtypes
            self._gather_model_params()

        _validation.load_wrapper_state(
            self, state_dict, mains_key="shard_main_params",
            match_mains=lambda saved: _validation.match_saved_tensors(
                "state_dict['shard_main_params']", saved,
                [scratch.get(i, b.main_shard) for i, b in enumerate(self._buckets)],
                unit="bucket", item="main shard"),
            after_copy=after_copy,
            before=check_layout, agree_group=self.data_parallel_group,
            per_group_mains=False,  # main shards per bucket: same layout, same group order
        )


def _is_sharded(t) -> bool:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return isinstance(t, ShardedTensor)


def _flat_local(view) -> Tensor:
    """This rank's elements of a ShardedTensor built by ``_sharded_view``, in flat order."""
    parts = [s.tensor.reshape(-1) for s in view.local_shards()]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _scalar_device(key, old, piece, group):
    """Where torch.optim keeps a non-param-shaped state tensor (AdamW's step: on the CPU
    unless capturable or fused)."""
    if key in old and isinstance(old[key], Tensor):
        return old[key].device
    if group.get("capturable") or group.get("fused"):
        return piece.main.device
    return torch.device("cpu")


def _tp_layout(param: Tensor, tp_group):
    """(global shape, [(global rank of TP peer j, offsets of its local tensor)]) of a param:
    a TP shard (DTensor with one Shard(d) placement, or Megatron ``tensor_model_parallel``
    with ``partition_dim`` d and stride 1; even shards) lists every TP peer in TP rank order;
    anything else is replicated and lists this rank only, at offset 0."""
    local = tuple(local_tensor(param).shape)
    me = dist.get_rank()
    dim, peers = None, [me]
    if local_tensor(param) is not param:  # DTensor
        shard_dims = [pl.dim for pl in param.placements if pl.is_shard()]
        if len(shard_dims) > 1 or param.device_mesh.ndim != 1:
            raise ValueError(f"a DTensor param with placements {param.placements} on a "
                             f"{param.device_mesh.ndim}-D mesh cannot be saved by flat range")
        if shard_dims:
            dim = shard_dims[0]
            peers = param.device_mesh.mesh.flatten().tolist()
            if tuple(param.shape)[dim] != local[dim] * param.device_mesh.size():
                raise ValueError(f"uneven DTensor shards (global {tuple(param.shape)}, local "
                                 f"{local}) cannot be saved by flat range")
    elif getattr(param, "tensor_model_parallel", False):
        if getattr(param, "partition_stride", 1) != 1:
            raise ValueError("a Megatron TP param with partition_stride != 1 cannot be saved")
        dim = param.partition_dim
        if tp_group is not None:
            peers = dist.get_process_group_ranks(tp_group)
    if dim is None:
        return local, [(me, (0,) * len(local))]
    shape = list(local)
    shape[dim] *= len(peers)
    return tuple(shape), [
        (r, tuple(j * local[dim] if d == dim else 0 for d in range(len(local))))
        for j, r in enumerate(peers)
    ]


def _ep_layout(param: Tensor, shape, peers, ep_group):
    """_tp_layout's (global shape, [(global rank, offsets)]) widened over the EP peers of an
    expert param stacked over its local experts (``expert_dim``, tpamp.mark_expert_param): EP
    peer j holds the experts at offset j * (local experts) along expert_dim. A param without
    expert_dim is one expert's, under its own global name: unchanged."""
    dim = getattr(param, "expert_dim", None)
    if dim is None:
        return shape, peers
    if ep_group is None:
        raise ValueError("an expert param stacked over experts (expert_dim) needs the EP group "
                         "to be saved by flat range: pass parallel_state= to the optimizer")
    me = dist.get_rank()
    ep_ranks = dist.get_process_group_ranks(ep_group)
    n = local_tensor(param).shape[dim]
    shape = list(shape)
    shape[dim] = n * len(ep_ranks)
    out = []
    for j, r in enumerate(ep_ranks):
        for peer, off in peers:
            off = list(off)
            off[dim] += j * n
            out.append((peer + r - me, tuple(off)))
    return tuple(shape), out


def _slice_state(old: dict, param: Tensor, param_range: Tuple[int, int]) -> dict:
    """Existing optimizer state of a model param, cut to one piece (fp32)."""
    a, b = param_range
    shape = local_tensor(param).shape
    out = {}
    for k, v in old.items():
        if isinstance(v, Tensor) and v.shape == shape:
            out[k] = local_tensor(v).detach().reshape(-1)[a:b].float().clone()
        else:
            out[k] = v.clone() if isinstance(v, Tensor) else v
    return out
