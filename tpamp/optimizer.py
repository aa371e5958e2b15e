"""Optimizer wrappers with fp32 main params (Megatron-LM's Float16OptimizerWithFloat16Params and
FP32Optimizer, megatron/core/optimizer/optimizer.py), with found_inf, grad norm and zero count
reduced over the model-parallel group so that every rank takes the same decision.

Usage::

    st = tpamp.parallel.initialize_model_parallel(tp, pp)
    opt = tpamp.MixedPrecisionOptimizer(
        torch.optim.AdamW(model.parameters(), lr=3e-4),
        grad_scaler=tpamp.DynamicGradScaler(initial_scale=2.0**16),
        clip_grad=1.0, log_num_zeros_in_grad=True,
        grad_stats_group=st.model_parallel_group, tensor_parallel_group=st.tp_group)
    opt.scale_loss(loss).backward()
    update_successful, grad_norm, num_zeros = opt.step()
    opt.zero_grad()
"""

from __future__ import annotations

import functools
import math
import numbers
import operator
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.optim.optimizer as _torch_optimizer

from tpamp import (
    _peer_settings,
    _validation,
    exact_sum,
    hyperparameters,
    matrix_optimizers,
    ops,
    parallel,
    state_formats,
    update_norms,
)
from tpamp.common import FUSED_KINDS, collective_device, is_dtensor, local_tensor, placed_like
from tpamp.grad_scaler import MegatronGradScaler
from tpamp.grad_stats import clip_coefficient, counts_toward_norm, is_expert_param
from tpamp.nonfinite import expert_rank_coords, gather_nonfinite, local_records, rank_coords
from tpamp.nonfinite import param_name_map as nonfinite_names
from tpamp.param_groups import group_hyperparameters, match_saved_groups
from tpamp.spikes import GradSpikeError

__all__ = ["StepResult", "MixedPrecisionOptimizer", "FP32Optimizer"]

Tensor = torch.Tensor
_HALF_DTYPES = (torch.float16, torch.bfloat16)
# Megatron-LM's tensor-parallel attributes, copied to the main param so filters see them.
_COPIED_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride", "shared",
                 "allreduce", "expert_dim", "expert_mesh")


class StepResult(NamedTuple):
    """What :meth:`MixedPrecisionOptimizer.step` did; unpacks like Megatron-LM's 3-tuple.

    update_successful: False when the step was skipped for an inf/nan gradient on any rank.
    grad_norm: global norm of the filtered, unscaled main grads before clipping (float, gradient
        units), None when skipped.
    num_zeros_in_grad: zeros in the filtered grads over the grad-stats group (int), None when
        skipped or not requested (log_num_zeros_in_grad=False). Counted on the raw (loss-scaled)
        grads on every step path, so an fp32/bf16 element that only underflows to 0 at
        x / loss scale is not a zero.
    """

    update_successful: bool
    grad_norm: Optional[float]
    num_zeros_in_grad: Optional[int]


@dataclass
class StepGrads:
    """The gradients of one step as a wrapper's hooks hand them to the shared step
    (:meth:`MixedPrecisionOptimizer.step`); an internal record, not part of the public API.

    fused: the one-pass path (``entries`` set) or the generic one (``outs`` set).
    scale: float32 [1] on the device: what the grads are multiplied by (1/loss scale, times
        1/d for a DistributedOptimizer's fp32 reduce), or None for 1.
    grads: the local tensors the statistics pass reads (any float dtype).
    mask: for each grad, whether it counts toward the norm and the zero count.
    mains: for each grad, the main param (or main-param piece) it updates.
    outs: generic path: the fp32 main grads the unscale pass writes (the clip's targets).
    entries: one-pass path: per inner param group, (main, model-dtype output or None, grad,
        mask) as the kernels take them.
    """

    fused: bool
    scale: Optional[Tensor]
    grads: List[Tensor]
    mask: List[bool]
    mains: List[Tensor]
    outs: Optional[List[Tensor]] = None
    entries: Optional[list] = None


class OptimizerWrapper:
    """Gives a wrapper the inner optimizer's ``param_groups`` and ``state`` (``self.optimizer``)."""

    optimizer: torch.optim.Optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state


class MixedPrecisionOptimizer(OptimizerWrapper):
    """Wrap any ``torch.optim.Optimizer`` with fp32 main params for its fp16/bf16 params.

    Construction replaces every fp16/bf16 param with requires_grad, inside the wrapped
    optimizer's param groups, by an fp32 main param (a detached fp32 clone; a DTensor with the
    same mesh and placements for a DTensor param), moves any existing optimizer state to it and
    copies the Megatron attributes ``tensor_model_parallel``, ``partition_dim``,
    ``partition_stride`` and ``shared``. fp32 params are used as they are (no copy).

    This class is also the core of every tpamp optimizer wrapper, as Megatron-core's
    MixedPrecisionOptimizer is: :class:`FP32Optimizer` and :class:`tpamp.DistributedOptimizer`
    subclass it and inherit the loss scale (``get_loss_scale``, ``scale_loss``, ``backward``),
    the one ``step()`` -- statistics pass, collective, scaler update, skip decision, spike
    detector, ``last_nonfinite``, clip, update, the sync-free tail and the one-pass path,
    written once -- its guards, ``optimizer_state_bytes`` and the common keys of
    ``state_dict``. A subclass supplies only what differs, through the step's hooks
    (``_sync_grads``, ``_grad_scale``, ``_generic_grads`` / ``_fused_grads``,
    ``_nonfinite_grads``, ``_finish_params``), so a feature added to the step reaches all three.

    ``step()`` (docs/spec.md section 2), in this order:

    1. main.grad = fp32(model.main_grad if present else model.grad); model grads are released;
    2. every main grad is multiplied by 1/loss_scale and checked for inf/nan (found_inf over
       all grads) -- one fused pass that also takes the norm and zero statistics;
    3. found_inf (with the norm and zero statistics) is all-reduced over ``grad_stats_group``;
       every rank joins, also one holding no params or no grads;
    4. ``grad_scaler.update(found_inf)`` on the device;
    5. if found_inf: skip (no inner step, params unchanged), return (False, None, None). Without
       a scaler (bf16/fp32) non-finite steps are skipped too, unless skip_nonfinite=False;
       with a ``spike_detector`` whose policy is "skip", a spike is skipped the same way and
       the scaler is put back as it was before step 4 (tpamp/spikes.py);
    6. grad_norm over the filtered grads (tpamp.grad_stats); clip when clip_grad > 0;
    7. num_zeros if log_num_zeros_in_grad;
    8. inner optimizer step; main params are cast-copied to the model params;
    9. return :class:`StepResult` (True, grad_norm, num_zeros).

    A step reads the device once (found_inf, norm and zeros in one transfer after the
    collective), as Megatron-LM does.

    Args:
        optimizer: the inner ``torch.optim.Optimizer`` over the model params.
        grad_scaler: a :class:`tpamp.MegatronGradScaler`; required when any param is fp16.
        clip_grad: max global grad norm (gradient units); 0 disables clipping.
        norm_type: p of the norm (>= 1, or ``math.inf``).
        log_num_zeros_in_grad: count zeros in the filtered main grads each step.
        grad_stats_group: group for found_inf, norm and zeros (the model-parallel group,
            ``tpamp.parallel.ParallelState.model_parallel_group``); None: no reduction.
        tensor_parallel_group: the TP group, to count replicated params on TP rank 0 only.
        skip_nonfinite: without a scaler, still skip steps with non-finite grads (default).
        sync_free: never read the device in step(): the skip is decided on the device by a
            fused inner optimizer (``fused=True``; it receives ``found_inf`` as torch.amp's
            GradScaler passes it), the clip coefficient is computed on the device, and
            StepResult holds device tensors (update_successful: bool 0-dim, grad_norm: float32
            0-dim, num_zeros_in_grad: int64 0-dim or None); a skipped step reports grad_norm
            nan and num_zeros_in_grad -1 (sentinels; :class:`tpamp.TrainingLogger` writes
            null). The min-scale stall is then not checked in step (read
            ``grad_scaler.overflow_at_min_scale()`` when convenient).
        spike_detector: a :class:`tpamp.SpikeDetector` judging each step's reduced grad norm
            and loss after step 5 (log, skip or raise; tpamp/spikes.py); its state is saved in
            state_dict()["spike_detector"]. Not with sync_free (it decides on the host). Bound
            to this optimizer: another optimizer given the same detector is refused. Policy
            "raise" puts the scaler back as it was before step 4 (as "skip" does) and raises.
        fused_step: for a torch.optim.Adam, AdamW or SGD whose options the one-pass kernel
            supports (no amsgrad/capturable/differentiable, float betas, no step hooks; lr a
            float or a tensor) and a scaler that never drops below 1, steps 1, 6 (clip) and 8
            run as ONE pass per param (``tpamp.ops.fused_adam_step_``/``fused_sgd_step_``):
            read the model grad (or fp32 main_grad), multiply by 1/loss scale x clip
            coefficient, update the fp32 main param and torch.optim's state (same keys and
            format), write the fp16/bf16 model param. No fp32 main grads are made or kept
            (``main.grad`` stays None); the statistics pass before it only reads the grads.
            Results equal the inner optimizer's to float32 rounding. False: always the
            generic path (inner ``optimizer.step()``). Other optimizers, subclasses and
            options take the generic path whatever this flag
            says; both paths keep the same state, so they can alternate. The step count of a
            new state lives on the params' device (as torch.optim's fused Adam keeps it; a
            plain torch optimizer loads it as it is). With sync_free, SGD with momentum reads
            found_inf on the host once, at its buffers' first step (a skipped first step must
            leave no buffer behind).
        exp_avg_dtype, exp_avg_sq_dtype: how Adam's moments are stored: torch.float32
            (default), torch.bfloat16 or torch.float8_e4m3fn (8-bit, one float32 scale per
            256 elements); store_param_remainders: for bf16 params, keep an int16 remainder
            instead of an fp32 master (the master is rebuilt exactly in the kernel). Names,
            formats and conversions: :mod:`tpamp.state_formats` (Megatron-core's
            precision-aware optimizer, Transformer Engine's FusedAdam). They need the one-pass
            step (an exact torch.optim.Adam/AdamW, fused_step=True, no amsgrad/capturable/
            differentiable, a loss scaler that never drops below 1, and for
            store_param_remainders a trainable bf16 param): construction raises ValueError
            naming the option otherwise, and a step that would still take the generic path
            (step hooks, an option set after construction) raises RuntimeError instead;
            ``step(param_grad_norms=True)`` works with them. :meth:`optimizer_state_bytes` counts what they save.
        min_8bit_size: with an 8-bit ``exp_avg_dtype`` / ``exp_avg_sq_dtype``, a param with
            fewer elements keeps that moment in float32 (bitsandbytes' option; None: 4096, the
            rule of bitsandbytes and torchao's AdamW8bit; 0: every param 8-bit). The count is
            the whole param's (a DTensor's global numel). :meth:`moment_dtypes` gives a param's
            stored dtypes. TypeError for a non-int, ValueError for a negative one or one given
            without an 8-bit moment dtype (docs/spec.md section 9).
        master_weights, stochastic_rounding, stochastic_rounding_seed: ``master_weights=False,
            stochastic_rounding=True`` keeps no fp32 master and no remainder for bf16 params
            (Megatron-core's precision-aware optimizer names; torchao's
            ``bf16_stochastic_round``): the one-pass step widens the bf16 param to float32,
            updates it and writes it back with stochastic rounding, the random bits a hash of
            (``stochastic_rounding_seed``, the param's name, the step count, the element's index
            in the param), so runs repeat and DP ranks and ZeRO-1 layouts agree bitwise
            (docs/spec.md section 21; name params with ``param_names`` for keys that differ
            between pipeline stages). 2 bytes per parameter plus the moments. Construction
            raises TypeError for a non-bool option or non-int seed, ValueError for
            stochastic_rounding with master_weights=True, master_weights=False without
            stochastic_rounding, with store_param_remainders, fp16 params, no trainable bf16
            param, a non-Adam or non-fused inner optimizer, or a loss scaler that may drop below
            1 (:func:`tpamp.state_formats.check_master_options`).
        param_names: ``model.named_parameters()`` ((name, param) pairs) or a dict param ->
            name, as DistributedOptimizer takes: the names of ``last_nonfinite`` records (and
            the default of :meth:`track_param_grad_norms`). Under pipeline parallelism give
            global names (e.g. the global layer index); unnamed params are
            ``"group<g>.param<i>"`` (param group g, index i).
        parallel_state: a :class:`tpamp.parallel.ParallelState`: this rank's TP, PP and DP
            ranks for ``last_nonfinite`` records; without it the TP rank comes from
            tensor_parallel_group and the PP and DP ranks are None. It also gives the expert
            params' groups (docs/spec.md section 19): ``expert_model_parallel_group`` and
            ``expert_tp_group`` (unless given below) and the EP ranks of their records.
        expert_grad_stats_group: the group over which the statistics of expert params
            (:func:`tpamp.is_expert_param`) are reduced: the expert model-parallel group,
            expert-TP x EP x PP (default: ``parallel_state.expert_model_parallel_group`` when
            grad_stats_group is ``parallel_state.model_parallel_group``, else
            grad_stats_group, e.g. a group of every rank under FSDP2). When it
            differs from grad_stats_group, found_inf is OR-ed over both groups, the norm is
            sqrt(dense^2 + expert^2) with each part reduced over its group, zeros add, and one
            clip coefficient scales both (Megatron-core's ChainedOptimizer); one extra
            read-only pass over the expert grads and one extra all-reduce per step.
        expert_tensor_parallel_group: the expert-TP group, to count expert params replicated
            over expert-TP once (default: ``parallel_state.expert_tp_group``, else
            tensor_parallel_group).
        deterministic_grad_norm: make the grad norm bitwise reproducible across layouts
            (docs/spec.md section 23; the grad-norm part of Megatron-LM's
            ``--deterministic-mode``): with p = 2 the sum of squares is accumulated EXACTLY
            (an integer in base-2**24 digits, :mod:`tpamp.exact_sum`), summed over the
            grad-stats group(s) as 26 float64 digits in the same one all-reduce as found_inf
            and the zeros, dense and expert parts added as digits, and rounded once to float64
            (the correctly rounded sum of the squares of the fp32 unscaled grads). So the
            norm, the clip coefficient, the skip decision and the update are the same bits for
            any split of the same global grads over TP, PP, DP (ZeRO-1 shards, layer-wise
            owners), EP and CP, and for the generic and one-pass paths. Costs one extra
            read-only pass over the grads and a 26-value wider all-reduce; the one-pass update
            itself is unchanged. The inf norm, found_inf and zeros are order-invariant anyway.
            Default False (no extra work). TypeError for a non-bool, ValueError with a
            norm_type other than 2 or inf; must agree over the grad-stats group (checked on
            the first step).

    Attributes:
        last_nonfinite: after each step, the :class:`tpamp.NonFiniteGrad` records of every
            param whose grad held inf or NaN on some rank of the grad-stats group (name, that
            rank's TP/PP/DP coordinates, counts), the same list on every rank, in backward
            order as far as names tell it (the last pipeline stage first, each rank's params in
            reverse of the param_names order; tpamp/nonfinite.py); [] after a
            clean step; None after a ``sync_free`` step (no host read to decide on). A clean
            step does no extra work for it; a step with found_inf counts inf/NaN per local
            grad and gathers the records in one ``all_gather_object`` over the group.

    Raises:
        TypeError: optimizer is not a torch.optim.Optimizer, or a param has a dtype other than
            float32/float16/bfloat16 (checked for every group before anything is converted).
        ValueError: fp16 params without a grad_scaler; bad clip_grad or norm_type; a group that
            this rank is not a member of; an inner optimizer that is already wrapped; a
            spike_detector already used by another optimizer; an inner optimizer not known to
            be elementwise over sharded params (TP attributes, DTensor shards), unless it is
            tensor-parallel aware (:func:`tpamp.check_sharded_math`, docs/spec.md section 17). TypeError for param_names that
            are not (str, Tensor) pairs or a dict, or a parallel_state that is not a
            ParallelState.
        From ``step()``, the step guard shared with DistributedOptimizer
        (tpamp._validation.guard_step), all before the scaler or any state moves:
        RuntimeError when the inner optimizer's param groups changed after wrapping, or when
        no gradient changed (no backward, no zero_grad) since the last step consumed
        gradients -- also with plain fp16/bf16 ``.grad``, which the step releases (as
        torch.amp.GradScaler refuses a second step); TypeError/ValueError for a grad (or
        ``main_grad``) of the wrong dtype, shape or device, naming the param; on the first
        step (and the first after a load), ValueError on every rank of the grad-stats group
        when the ranks' norm_type, deterministic_grad_norm, log_num_zeros_in_grad, clip_grad, skip_nonfinite,
        loss-scaler or spike-detector settings differ (one small all-gather,
        tpamp._validation.agree_on_settings). GradSpikeError for a spike with policy "raise"
        (the scaler as before the step; the grads count as consumed).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        grad_scaler: Optional[MegatronGradScaler] = None,
        clip_grad: float = 0.0,
        norm_type: float = 2.0,
        log_num_zeros_in_grad: bool = False,
        grad_stats_group=None,
        tensor_parallel_group=None,
        skip_nonfinite: bool = True,
        sync_free: bool = False,
        spike_detector=None,
        fused_step: bool = True,
        param_names=None,
        parallel_state=None,
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
        store_param_remainders: bool = False,
        expert_grad_stats_group=None,
        expert_tensor_parallel_group=None,
        master_weights: bool = True,
        stochastic_rounding: bool = False,
        stochastic_rounding_seed: int = 0,
        min_8bit_size: Optional[int] = None,
        deterministic_grad_norm: bool = False,
    ):
        state_options = self._check_core_args(
            optimizer, grad_scaler, clip_grad, fused_step, exp_avg_dtype, exp_avg_sq_dtype,
            store_param_remainders)
        min_8bit_size = state_formats.check_min_8bit_size(min_8bit_size, *state_options[:2])
        master_options = self._check_master_args(
            optimizer, grad_scaler, fused_step, master_weights, stochastic_rounding,
            stochastic_rounding_seed, store_param_remainders)
        names = nonfinite_names(param_names)  # checked before anything changes
        tensor_parallel_group, grad_stats_group = parallel.resolve_tensor_parallel_group(
            [p for g in optimizer.param_groups for p in g["params"]], tensor_parallel_group,
            grad_stats_group, owner=type(self).__name__, parallel_state=parallel_state)
        _validation.check_group_member(grad_stats_group, "grad_stats_group")
        _validation.check_group_member(tensor_parallel_group, "tensor_parallel_group")
        coords = rank_coords(parallel_state, tensor_parallel_group=tensor_parallel_group)
        _peer_settings.check_parallel_groups(  # the layout's groups, before any collective
            parallel_state, tensor_parallel_group=tensor_parallel_group,
            expert_grad_stats_group=expert_grad_stats_group,
            expert_tensor_parallel_group=expert_tensor_parallel_group)
        _peer_settings.check_inner_groups(optimizer, tensor_parallel_group)
        if (parallel_state is not None and expert_grad_stats_group is None
                and _same_group(grad_stats_group, parallel_state.model_parallel_group)):
            # the expert model-parallel group beside the dense model-parallel one (Megatron-core)
            expert_grad_stats_group = parallel_state.expert_model_parallel_group
        self._init_core(
            optimizer, grad_scaler=grad_scaler, clip_grad=clip_grad, norm_type=norm_type,
            log_num_zeros_in_grad=log_num_zeros_in_grad, grad_stats_group=grad_stats_group,
            tensor_parallel_group=tensor_parallel_group, skip_nonfinite=skip_nonfinite,
            sync_free=sync_free, spike_detector=spike_detector, fused_step=fused_step,
            state_options=state_options, expert_grad_stats_group=expert_grad_stats_group,
            expert_tensor_parallel_group=expert_tensor_parallel_group,
            parallel_state=parallel_state, master_options=master_options,
            deterministic_grad_norm=deterministic_grad_norm,
        )
        self.min_8bit_size = min_8bit_size

        # (model param, main param) for each fp16/bf16 param, per group; fp32 params per group
        self._half_pairs: List[List[tuple]] = []
        self._fp32_params: List[List[Tensor]] = []
        has_fp16 = False
        for gi, group in enumerate(optimizer.param_groups):
            pairs, fp32s = [], []
            for pi, param in enumerate(group["params"]):
                if param.dtype in _HALF_DTYPES and param.requires_grad:
                    has_fp16 |= param.dtype == torch.float16
                    if self.stochastic_rounding:  # bf16 (checked): no master, no remainder
                        main = _remainder_placeholder(param)
                        self._sr_params[id(main)] = local_tensor(param.detach())
                    elif self.store_param_remainders:  # bf16 (checked): no fp32 master
                        main = _remainder_placeholder(param)
                        self._remainders[id(main)] = torch.zeros_like(
                            local_tensor(param.detach()), dtype=torch.int16)
                    else:
                        main = self._make_main_param(param)
                    group["params"][pi] = main
                    if param in optimizer.state:
                        optimizer.state[main] = _state_to_fp32(optimizer.state.pop(param))
                    pairs.append((param, main))
                elif param.dtype == torch.float32:
                    fp32s.append(param)
                elif param.dtype in _HALF_DTYPES:
                    pass  # frozen (requires_grad=False): never has a grad, needs no main copy
                else:
                    raise TypeError(param_dtype_error(gi, pi, param))
            self._half_pairs.append(pairs)
            self._fp32_params.append(fp32s)
        check_fp16_scaler(has_fp16, grad_scaler)
        self._set_device(self._pick_device())
        self._init_param_names(names, coords)
        self._sr_rows = {main_id: (state_formats.stochastic_rounding_key(
            self.stochastic_rounding_seed, self._param_name[main_id]), 0)
            for main_id in self._sr_params}
        _validation.register_wrapper(self)

    # -- the core every wrapper shares (FP32Optimizer, DistributedOptimizer) -------------

    @staticmethod
    def _check_core_args(optimizer, grad_scaler, clip_grad, fused_step, exp_avg_dtype,
                         exp_avg_sq_dtype, store_param_remainders, *,
                         flat_pieces: bool = False) -> tuple:
        """The arguments every wrapper checks first, before anything changes: those of
        :func:`check_wrapper_args`, that the inner optimizer does the unsharded math over
        sharded params (:func:`tpamp.matrix_optimizers.check_sharded_math`; ``flat_pieces``:
        the wrapper steps it over flat pieces of the params, as DistributedOptimizer does) and
        the narrow-state options; returns the options (exp_avg_dtype, exp_avg_sq_dtype,
        store_param_remainders) as tpamp.state_formats normalises them."""
        check_wrapper_args(optimizer, grad_scaler, clip_grad)
        matrix_optimizers.check_sharded_math(optimizer, flat_pieces=flat_pieces)
        _peer_settings.check_partition_dims(optimizer)
        options = state_formats.check_state_options(
            optimizer, FUSED_KINDS.get(type(optimizer)), bool(fused_step), exp_avg_dtype,
            exp_avg_sq_dtype, store_param_remainders,
            {p.dtype for g in optimizer.param_groups for p in g["params"]
             if p.dtype in _HALF_DTYPES and p.requires_grad},
        )
        _validation.check_narrow_state_scaler(grad_scaler, *options)
        return options

    @staticmethod
    def _check_master_args(optimizer, grad_scaler, fused_step, master_weights,
                           stochastic_rounding, stochastic_rounding_seed,
                           store_param_remainders) -> tuple:
        """``master_weights``, ``stochastic_rounding``, ``stochastic_rounding_seed`` checked by
        :func:`tpamp.state_formats.check_master_options` (docs/spec.md section 21), and a loss
        scaler that never drops below 1 (the one-pass step's condition); returns them."""
        options = state_formats.check_master_options(
            optimizer, FUSED_KINDS.get(type(optimizer)), bool(fused_step), master_weights,
            stochastic_rounding, stochastic_rounding_seed, store_param_remainders,
            {p.dtype for g in optimizer.param_groups for p in g["params"]
             if p.dtype in _HALF_DTYPES and p.requires_grad},
        )
        if options[1] and grad_scaler is not None and not getattr(
                grad_scaler, "never_below_one", True):
            raise ValueError(
                f"master_weights=False, stochastic_rounding=True are kept only by the one-pass "
                f"fused step, which needs a loss scaler that never drops below 1; this "
                f"{type(grad_scaler).__name__} may drop below 1 (give it a minimum scale >= 1)")
        return options

    def _init_core(self, optimizer, *, grad_scaler, clip_grad, norm_type, log_num_zeros_in_grad,
                   grad_stats_group, tensor_parallel_group, skip_nonfinite, sync_free,
                   spike_detector, fused_step, state_options, expert_grad_stats_group=None,
                   expert_tensor_parallel_group=None, parallel_state=None,
                   master_options=(True, False, 0), deterministic_grad_norm=False) -> None:
        """The settings of the step every wrapper shares (after :meth:`_check_core_args` and
        the subclass's own checks; ValueError for a bad norm_type, a sync_free inner optimizer
        that cannot skip on the device, or a detector that cannot be used)."""
        self.norm_type = _validation.check_norm_type(norm_type)
        # docs/spec.md section 23: an exact, order-invariant sum of squares (tpamp.exact_sum)
        self.deterministic_grad_norm = exact_sum.check_deterministic_grad_norm(
            deterministic_grad_norm, self.norm_type)
        self.optimizer = optimizer
        self.grad_scaler = grad_scaler
        self.clip_grad = float(clip_grad)
        self.log_num_zeros_in_grad = bool(log_num_zeros_in_grad)
        self.grad_stats_group = grad_stats_group
        self.tensor_parallel_group = tensor_parallel_group
        self.skip_nonfinite = bool(skip_nonfinite)
        self.sync_free = bool(sync_free)
        if self.sync_free and not getattr(optimizer, "_step_supports_amp_scaling", False):
            raise ValueError(
                f"sync_free=True needs an inner optimizer that skips on a device found_inf "
                f"(fused=True Adam/AdamW/SGD); got {type(optimizer).__name__} without "
                "_step_supports_amp_scaling"
            )
        self.exp_avg_dtype, self.exp_avg_sq_dtype, self.store_param_remainders = state_options
        # min_8bit_size (docs/spec.md section 9): set by the wrapper after this; a
        # DistributedOptimizer's pieces map id(piece main) -> its whole param's numel
        self.min_8bit_size = 0
        self._whole_numel: Dict[int, int] = {}
        self._tp_rank = _validation.tp_rank(tensor_parallel_group)
        self.spike_detector = _validation.check_spike_detector(spike_detector, self.sync_free)
        self.param_norm_tracker = None  # set by track_param_grad_norms
        self.fused_step = bool(fused_step)
        self._fused_kind = _FUSED_KINDS.get(type(optimizer)) if self.fused_step else None
        # store_param_remainders: id(main placeholder) -> int16 remainder (local tensor)
        self._remainders: Dict[int, Tensor] = {}
        # master_weights=False, stochastic_rounding=True (docs/spec.md section 21):
        # id(main placeholder) -> the bf16 tensor the kernel steps in place (the model param's
        # local data, or a DistributedOptimizer's param shard slice), and -> its (hash key,
        # global index of its first element) for the kernel's random bits
        self.master_weights, self.stochastic_rounding, self.stochastic_rounding_seed = \
            master_options
        self._sr_params: Dict[int, Tensor] = {}
        self._sr_rows: Dict[int, tuple] = {}
        self.last_nonfinite: Optional[list] = []
        self._init_experts(expert_grad_stats_group, expert_tensor_parallel_group, parallel_state)

    def _init_experts(self, expert_grad_stats_group, expert_tensor_parallel_group,
                      parallel_state) -> None:
        """The expert params' groups (docs/spec.md section 19): ``expert_grad_stats_group``
        (None: the grad-stats group) and ``expert_tensor_parallel_group`` (None: the
        parallel_state's expert-TP group, else the TP group). Expert params are told apart
        only when a group differs from the dense one, so a dense-only setup steps exactly as
        before (no extra pass, no extra collective)."""
        _validation.check_group_member(expert_grad_stats_group, "expert_grad_stats_group")
        _validation.check_group_member(expert_tensor_parallel_group, "expert_tensor_parallel_group")
        if expert_tensor_parallel_group is None:
            expert_tensor_parallel_group = (parallel_state.expert_tp_group if parallel_state
                                            is not None else self.tensor_parallel_group)
        if expert_grad_stats_group is None:
            expert_grad_stats_group = self.grad_stats_group
        self.expert_grad_stats_group = expert_grad_stats_group
        self.expert_tensor_parallel_group = expert_tensor_parallel_group
        self._expert_tp_rank = _validation.tp_rank(expert_tensor_parallel_group)
        # public for tpamp.param_norms: expert statistics reduced over their own group
        self.experts_apart = not _same_group(expert_grad_stats_group, self.grad_stats_group)
        self._expert_tp_apart = not _same_group(expert_tensor_parallel_group,
                                                self.tensor_parallel_group)
        self.expert_rank_coords = expert_rank_coords(
            parallel_state, expert_tensor_parallel_group=expert_tensor_parallel_group)
        self.expert_parallel_size = parallel_state.dims.ep if parallel_state is not None else None
        # the EP peers, whose settings the cross-rank check compares (tpamp._peer_settings)
        self.expert_parallel_group = parallel_state.ep_group if parallel_state is not None else None

    def _counts(self, param: Tensor) -> bool:
        """Whether ``param``'s grad counts toward the norm and zeros on this rank: TP
        duplicates on (expert-)TP rank 0 only, shared tied copies never (tpamp.grad_stats)."""
        if self._expert_tp_apart and is_expert_param(param):
            return counts_toward_norm(param, self._expert_tp_rank, self.expert_tensor_parallel_group)
        return counts_toward_norm(param, self._tp_rank, self.tensor_parallel_group)

    def _set_device(self, device: torch.device) -> None:
        """The device of the step's statistics (the params'); the loss scaler moves there."""
        self._device = device
        if self.grad_scaler is not None and self.grad_scaler.device != device:
            self.grad_scaler.to(device)
        self._one = torch.ones(1, dtype=torch.float32, device=device)

    # -- construction helpers -------------------------------------------------------------

    @staticmethod
    def _make_main_param(param: Tensor) -> Tensor:
        main = torch.nn.Parameter(param.detach().to(torch.float32, copy=True), requires_grad=True)
        for attr in _COPIED_ATTRS:
            if hasattr(param, attr):
                setattr(main, attr, getattr(param, attr))
        return main

    def _pick_device(self) -> torch.device:
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                return local_tensor(p).device
        return collective_device(self.grad_stats_group)

    # -- public interface -----------------------------------------------------------------

    def get_loss_scale(self) -> Tensor:
        """The loss scale: float32 tensor of shape [1] on the params' device (1.0 without a
        scaler)."""
        return self.grad_scaler.scale if self.grad_scaler is not None else self._one

    def scale_loss(self, loss: Tensor) -> Tensor:
        """loss * loss_scale, keeping loss's shape; call ``.backward()`` on the result.
        Raises TypeError unless loss is a floating-point tensor."""
        _validation.check_loss(loss)
        return loss * self.get_loss_scale().reshape(())

    def backward(self, loss: Tensor) -> None:
        """``scale_loss(loss).backward()`` (apex's ``optimizer.backward(loss)`` spelling)."""
        self.scale_loss(loss).backward()

    @_validation.guard_zero_grad
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the grads of model params and main params (``main_grad`` buffers belong to the
        data-parallel wrapper that attached them and are left alone, as in Megatron-LM)."""
        for pairs, fp32s in zip(self._half_pairs, self._fp32_params):
            for model, main in pairs:
                clear_grad(model, set_to_none)
                clear_grad(main, set_to_none)
            for p in fp32s:
                clear_grad(p, set_to_none)

    def reload_model_params(self) -> None:
        """Copy model params -> main params (after the model's weights were changed, e.g. a
        checkpoint loaded into the model); with store_param_remainders the remainders are
        zeroed (the master becomes the bf16 value)."""
        srcs, dsts = self._pair_locals()
        with torch.no_grad():
            ops.scale_and_copy(dsts, srcs)
            for rem in self._remainders.values():
                rem.zero_()

    def optimizer_state_bytes(self) -> int:
        """Bytes this rank holds of main params (fp32 masters of fp16/bf16 params, or their
        int16 remainders; a DistributedOptimizer's main shards) and inner optimizer state
        (every tensor, every dtype: moments, 8-bit scales, step counts). fp32 params of a
        MixedPrecisionOptimizer are their own masters and are not counted."""
        total = self._main_param_bytes()
        for st in self.optimizer.state.values():
            total += sum(local_tensor(v).numel() * v.element_size()
                         for v in st.values() if isinstance(v, Tensor))
        return total

    def _main_param_bytes(self) -> int:
        total = sum(r.numel() * r.element_size() for r in self._remainders.values())
        for pairs in self._half_pairs:
            for _, main in pairs:
                if id(main) not in self._remainders and id(main) not in self._sr_params:
                    total += local_tensor(main).numel() * 4
        return total

    def _master_value(self, main: Tensor, model: Tensor) -> Tensor:
        """The fp32 master of a pair as a tensor like ``main`` (rebuilt from the remainder)."""
        if id(main) in self._sr_params:  # no master: the bf16 param's value, exactly
            return state_formats.dtensor_like(local_tensor(model.detach()).float(), main)
        rem = self._remainders.get(id(main))
        if rem is None:
            return main.detach().clone()
        return state_formats.master_from_remainder(model, rem, main)

    def _pair_locals(self):
        models, mains = [], []
        for pairs in self._half_pairs:
            for model, main in pairs:
                if id(main) in self._remainders or id(main) in self._sr_params:
                    continue  # the model param holds the master (or its high half) itself
                models.append(local_tensor(model.data if not _is_dtensor(model) else model))
                mains.append(local_tensor(main.data if not _is_dtensor(main) else main))
        return mains, models

    def track_param_grad_norms(self, named_params=None):
        """Name this rank's params for per-parameter grad norms; returns the
        :class:`tpamp.param_norms.ParamGradNormTracker` (``.norms`` after a step with
        ``param_grad_norms=True``). named_params: (name, model param) pairs, names unique in the
        whole model; None: the ``param_names`` given at construction. A collective over the
        grad-stats group (every rank calls it once)."""
        from tpamp.param_norms import ParamGradNormTracker

        if named_params is None:
            named_params = self.named_model_params()
        mains = [(main, model) for pairs in self._half_pairs for model, main in pairs]
        mains += [(p, p) for fp32s in self._fp32_params for p in fp32s]
        self.param_norm_tracker = ParamGradNormTracker(self, named_params, mains=mains)
        return self.param_norm_tracker

    def grad_sources(self):
        """(name, model param, grad) for every gradient the next step() reads: a model param's
        ``main_grad`` when it has one, else its ``.grad``; an fp32 param's ``main_grad`` or
        ``.grad``. The step guard (tpamp._validation.guard_step) checks their shape, dtype and
        device before the step changes anything, and that one changed since the last step."""
        out = []
        append = out.append
        for name, model in self._step_rows()[0]:
            grad = getattr(model, "main_grad", None)
            if grad is None:
                grad = model.grad
            if grad is not None:
                append((name, model, grad))
        return out

    def _step_rows(self) -> tuple:
        """What every step walks, made once (the params are fixed after construction: the step
        guard refuses changed param groups): ([(source name, model param)] in the order of
        :meth:`grad_sources`, and per param group ([(main, model, counts toward the norm)] of
        its fp16/bf16 params, [(param, counts)] of its fp32 params))."""
        rows = self.__dict__.get("_rows_cache")
        if rows is None or rows[0] is not self._half_pairs or rows[1] is not self._fp32_params:
            sources, groups = [], []
            for gi, (pairs, fp32s) in enumerate(zip(self._half_pairs, self._fp32_params)):
                sources += [(_source_name(model.dtype, i, gi), model)
                            for i, (model, _) in enumerate(pairs)]
                sources += [(_source_name(None, i, gi), p) for i, p in enumerate(fp32s)]
                groups.append(([(main, model, self._counts(main)) for model, main in pairs],
                               [(p, self._counts(p)) for p in fp32s]))
            rows = self._rows_cache = (self._half_pairs, self._fp32_params, (sources, groups))
        return rows[2]

    def param_group_indices(self) -> Dict[int, int]:
        """id(model param) -> index of the inner optimizer's param group that steps it (through
        its main param, or itself for an fp32 param), for the params this optimizer steps
        (checkpoints record the param-group structure by name with it)."""
        out: Dict[int, int] = {}
        for gi, (pairs, fp32s) in enumerate(zip(self._half_pairs, self._fp32_params)):
            for model, _ in pairs:
                out[id(model)] = gi
            for p in fp32s:
                out[id(p)] = gi
        return out

    def main_params_by_group(self) -> List[List[Tensor]]:
        """Per param group, the fp32 main params of its fp16/bf16 params (what state_dict saves
        as ``fp32_from_fp16_params``)."""
        return [[main for _, main in pairs] for pairs in self._half_pairs]

    # -- the step: one template, the hooks below differ per wrapper ------------------------

    @_validation.guard_step
    @torch.no_grad()
    def step(self, closure=None, *, param_grad_norms: bool = False,
             param_update_norms: bool = False) -> StepResult:
        """One optimizer step (class docstring); returns :class:`StepResult`.

        param_grad_norms: also compute the per-parameter grad norms from the same pass (one
        extra all-reduce; needs :meth:`track_param_grad_norms`; the same value on every rank).
        param_update_norms: also compute each param's update norm ||master_new - master_old||
        and ||master_new|| (the tracker's ``update_norms`` / ``update_ratios``; None after a
        skipped step; tpamp/update_norms.py): one copy of the masters before the update, one
        statistics pass and one more all-reduce, on this step only. Needs
        :meth:`track_param_grad_norms`; a bool, alike on every rank.

        The one step of every tpamp optimizer wrapper (FP32Optimizer and DistributedOptimizer
        inherit it): the gradients come from the hooks :meth:`_sync_grads`,
        :meth:`_grad_scale`, :meth:`_generic_grads` / :meth:`_fused_grads`, and the new values
        go back to the model by :meth:`_finish_params`; the statistics, the collective, the
        scaler update, the skip decision, the non-finite records, the clip and the update are
        written here once."""
        if closure is not None:
            raise ValueError("closure is not supported: compute the loss before step()")
        if param_grad_norms and self.param_norm_tracker is None:
            raise ValueError("step(param_grad_norms=True) needs track_param_grad_norms() first")
        if type(param_update_norms) is not bool:
            raise TypeError("param_update_norms must be a bool, got "
                            f"{type(param_update_norms).__name__} {param_update_norms!r}")
        if param_update_norms and self.param_norm_tracker is None:
            raise ValueError("step(param_update_norms=True) needs track_param_grad_norms() first")
        if self.param_norm_tracker is not None:
            self.param_norm_tracker.clear_update_norms()
        self.last_nonfinite = None  # set by the steps that read the device (not sync_free)
        fused = self._fused_step_usable()
        if not fused:
            state_formats_refuse_generic(self)  # narrow state needs the one-pass path
        self._sync_grads()
        scale = self._grad_scale()  # this step's, taken before grad_scaler.update changes it
        grads = self._fused_grads(scale) if fused else self._generic_grads(scale)
        finite_p = self.norm_type != math.inf
        stats = self._grad_stats(grads, finite_p, param_grad_norms)
        expert = self._expert_stats(grads, finite_p) if self.experts_apart else None
        exact = self.deterministic_grad_norm and finite_p
        if exact:  # the sums of squares as exact digits (float64 [26]), reduced as they are
            stats, expert = self._exact_stats(grads, stats, expert)
        found_inf, norm_stat, num_zeros = self._reduce(stats, finite_p, expert)
        if exact:  # one correctly rounded conversion of the global exact sum
            norm_stat = exact_sum.digits_to_double(norm_stat.reshape(-1))
        if param_grad_norms:
            self._reduce_param_norms(grads, stats)
        spikes = self.spike_detector
        scaler_before = spikes.snapshot_scaler(self.grad_scaler) if spikes is not None else None
        at_min = None
        if self.grad_scaler is not None:
            self.grad_scaler.update(found_inf)
            at_min = self.grad_scaler.overflow_at_min_scale()
        norm = self._root(norm_stat, finite_p)
        if self.sync_free:
            return self._finish_on_device(grads, found_inf, norm, num_zeros, param_update_norms)
        skip, grad_norm, zeros = self._read_and_decide(  # reported in float32, as sync_free
            found_inf, norm.float(), num_zeros, at_min, scaler_before)
        self._note_nonfinite(found_inf, skip, lambda: self._nonfinite_grads(grads))
        if skip:  # overflow or spike: no main param, state or model param changes
            self._finish_params(grads, updated=False)
            return StepResult(False, None, None)
        clip = (
            self.clip_grad > 0.0
            and bool(grads.grads)
            and math.isfinite(grad_norm)
            and self.clip_grad / (grad_norm + 1.0e-6) < 1.0  # Megatron: clip only when < 1
        )
        self._update(grads, norm, clip, None, param_update_norms)
        return StepResult(True, float(grad_norm), zeros)

    def _grad_stats(self, grads: StepGrads, finite_p: bool, per_tensor: bool) -> ops.GradStats:
        """Step 2: found_inf, the norm statistic and the zero count of the unscaled grads (and
        each tensor's norm with ``per_tensor``). Generic path: one pass that also writes the
        grads x ``scale`` into the main grads; one-pass path: a read-only pass over the raw
        grads, rescaled afterwards (the scale is <= 1, so found_inf and zeros are the same)."""
        mask = self._dense_mask(grads)
        if grads.fused:
            stats = ops.grad_stats(
                grads.grads, norm_mask=mask, norm_type=self.norm_type,
                count_zeros=self.log_num_zeros_in_grad, per_tensor_norms=per_tensor,
                device=self._device,
            )
            return self._unscaled_stats(stats, grads.scale, finite_p)
        scale = grads.scale
        raw_zeros = self._raw_zeros(grads.grads, mask, scale)  # before the unscale
        stats = ops.grad_stats(
            grads.grads, out=grads.outs, scale=scale, norm_mask=mask,
            norm_type=self.norm_type,
            count_zeros=self.log_num_zeros_in_grad and raw_zeros is None,
            scale_at_most_one=scale is not None
            and (self.grad_scaler is None or self.grad_scaler.never_below_one),
            per_tensor_norms=per_tensor, device=self._device,
        )
        return stats if raw_zeros is None else stats._replace(num_zeros=raw_zeros)

    def _expert_flags(self, grads: StepGrads) -> List[bool]:
        return [is_expert_param(m) for m in grads.mains]

    def _dense_mask(self, grads: StepGrads) -> List[bool]:
        """The norm mask of the dense statistics: all counted grads, or (expert params apart,
        docs/spec.md section 19) the counted grads of dense params."""
        if not self.experts_apart:
            return grads.mask
        return [m and not e for m, e in zip(grads.mask, self._expert_flags(grads))]

    def _expert_stats(self, grads: StepGrads, finite_p: bool) -> ops.GradStats:
        """The norm statistic and zero count of the counted expert grads, unscaled, from a
        read-only pass over the expert grads alone (found_inf came from the first pass over
        every grad). Only when the expert params' grad-stats group differs from the dense one."""
        flags = self._expert_flags(grads)
        pick = [i for i, e in enumerate(flags) if e]
        mask = [grads.mask[i] for i in pick]
        if grads.fused:
            srcs = [grads.grads[i] for i in pick]
            stats = ops.grad_stats(srcs, norm_mask=mask, norm_type=self.norm_type,
                                   count_zeros=self.log_num_zeros_in_grad, check_finite=False,
                                   device=self._device)
            return self._unscaled_stats(stats, grads.scale, finite_p)
        outs = [grads.outs[i] for i in pick]  # unscaled by the first pass
        raw_zeros = self._raw_zeros([grads.grads[i] for i in pick], mask, grads.scale)
        stats = ops.grad_stats(outs, norm_mask=mask, norm_type=self.norm_type,
                               count_zeros=self.log_num_zeros_in_grad and raw_zeros is None,
                               check_finite=False, device=self._device)
        return stats if raw_zeros is None else stats._replace(num_zeros=raw_zeros)

    def _exact_stats(self, grads: StepGrads, stats: ops.GradStats, expert):
        """deterministic_grad_norm (p = 2): the norm statistics replaced by the exact digits of
        the counted grads' sum of squares (tpamp.exact_sum; one extra read pass, dense and
        expert parts apart). The values squared are the unscaled grads the generic path writes
        (``fp32(g * 1/loss_scale)``); the one-pass path reads the raw grads with that scale,
        so both paths give the same digits."""
        if grads.fused:
            tensors, scale = grads.grads, grads.scale
        else:
            tensors, scale = grads.outs, None
        dense = exact_sum.masked_sumsq_digits(tensors, self._dense_mask(grads), scale,
                                              self._device)
        stats = stats._replace(norm_stat=dense)
        if expert is not None:
            flags = self._expert_flags(grads)
            mask = [m and e for m, e in zip(grads.mask, flags)]
            expert = expert._replace(norm_stat=exact_sum.masked_sumsq_digits(
                tensors, mask, scale, self._device))
        return stats, expert

    def _reduce_param_norms(self, grads: StepGrads, stats: ops.GradStats) -> None:
        """The per-parameter norms of this step (param_norms.ParamGradNormTracker)."""
        if grads.fused:  # of the raw grads: ||g x s|| = s ||g|| gives the unscaled grads' norms
            per_tensor = stats.per_tensor_norms
            if grads.scale is not None:
                per_tensor = per_tensor * grads.scale
            self.param_norm_tracker.reduce_params(per_tensor, grads.mains, grads.mask)
        else:
            self.param_norm_tracker.reduce(stats.per_tensor_norms, grads.outs, grads.mask)

    def _finish_on_device(self, grads: StepGrads, found_inf, norm, num_zeros,
                          with_update_norms: bool = False) -> StepResult:
        """Steps 5-9 with no host read (sync_free): the skip is decided on the device (the
        fused inner optimizer or the one-pass kernel takes found_inf), the clip coefficient is
        computed there (a non-finite norm gives 1: a skipped step never turns grads into nan),
        and a skipped step reports the sentinels nan and -1 (TrainingLogger writes null), as
        the host cannot be asked for None without a sync."""
        skip = found_inf.reshape(1).float()
        if self.grad_scaler is None and not self.skip_nonfinite:
            skip = torch.zeros_like(skip)
        self._update(grads, norm, self.clip_grad > 0.0 and bool(grads.grads), skip, with_update_norms)
        skipped = skip.reshape(()) != 0
        norm = norm.float()  # the reported norm: float32 0-dim (the clip used float64)
        norm = torch.where(skipped, torch.full_like(norm, math.nan), norm).reshape(())
        zeros = None
        if num_zeros is not None:
            zeros = num_zeros.reshape(()).to(torch.int64)
            zeros = torch.where(skipped, torch.full_like(zeros, -1), zeros)
        return StepResult(~skipped, norm, zeros)

    def _update(self, grads: StepGrads, norm: Tensor, clip: bool,
                found_inf: Optional[Tensor], with_update_norms: bool = False) -> None:
        """Step 8: clip (coefficient from ``norm``), step the main params and state, and
        give the model its new params. ``found_inf`` (sync_free): the device flag on which the
        update skips itself; None: the step was decided on the host. ``with_update_norms``: also
        the per-parameter update norms (a copy of the masters before, a pass after)."""
        if not with_update_norms:
            self._update_params(grads, norm, clip, found_inf)
            return
        before = update_norms.snapshot_masters(self._update_norm_masters(grads))
        recorders = [] if grads.fused else update_norms.momentum_recorders(self.optimizer)
        for opt in recorders:  # Muon: its momentum norms, on this step only
            opt.record_momentum_norms = True
        try:
            self._update_params(grads, norm, clip, found_inf)
        finally:
            for opt in recorders:
                opt.record_momentum_norms = False
        upd, par = update_norms.update_and_param_norms(
            before, self._update_norm_masters(grads), self._device)
        momentum = update_norms.momentum_norms_of(recorders, grads.mains, upd.device)
        self.param_norm_tracker.reduce_update_norms(upd, par, grads.mains, grads.mask,
                                                    momentum=momentum)

    def _update_norm_masters(self, grads: StepGrads) -> List[Tensor]:
        """Per entry of ``grads.mains``, its fp32 master's current value as a local tensor
        (a view of the main param, or a new tensor rebuilt from param + remainder / the bf16
        value of stochastic rounding): what tpamp/update_norms.py compares before and after."""
        special = self._remainders or self._sr_params
        model_of = ({id(main): model for pairs in self._half_pairs for model, main in pairs}
                    if special else {})
        out = []
        for main in grads.mains:
            if id(main) in self._remainders or id(main) in self._sr_params:
                out.append(local_tensor(self._master_value(main, model_of[id(main)])))
            else:
                out.append(local_tensor(main.detach()))
        return out

    def _update_params(self, grads: StepGrads, norm: Tensor, clip: bool,
                       found_inf: Optional[Tensor]) -> None:
        """:meth:`_update` without the update norms."""
        if grads.fused:  # one pass: unscale x clip, update main params + state, write models
            mult = self._grad_multiplier(grads.scale, norm, clip)
            self._fused_update(grads.entries, mult, found_inf)
        else:
            if clip and grads.outs:
                ops.scale_and_copy(grads.outs, grads.outs, clip_coefficient(self.clip_grad, norm))
            inner = self.optimizer
            if found_inf is None:
                inner.step()
            else:  # as torch.amp's GradScaler hands it to a fused optimizer
                inner.found_inf, inner.grad_scale = found_inf.reshape(()), None
                try:
                    inner.step()
                finally:
                    del inner.found_inf, inner.grad_scale
        self._finish_params(grads, updated=True)

    # -- the hooks (MixedPrecisionOptimizer's: one fp32 main copy per fp16/bf16 param) -----

    def _sync_grads(self) -> None:
        """Make every gradient of this step readable (DistributedOptimizer: its reduce-scatter)."""

    def _grad_scale(self) -> Optional[Tensor]:
        """The factor the gradients are multiplied by (1/loss scale; None for 1), float32 [1]."""
        return self.grad_scaler.inv_scale.reshape(1) if self.grad_scaler is not None else None

    def _generic_grads(self, scale: Optional[Tensor]) -> StepGrads:
        """Step 1 of the generic path: point main params at their gradient buffers (an fp32
        ``main_grad`` or grad in place, as Megatron does; else a new fp32 main grad) and release
        the model grads. The unscale pass reads ``grads`` and writes ``outs`` (the main grads)."""
        srcs, outs, mask, mains = [], [], [], []
        for pairs, fp32s in zip(self._half_pairs, self._fp32_params):
            for model, main in pairs:
                grad = _model_grad(model)
                if grad is None:
                    main.grad = None
                    continue
                if grad.dtype == torch.float32:
                    main.grad = grad  # a main_grad buffer: used in place, as Megatron does
                    src = out = local_tensor(grad)
                else:
                    main.grad = torch.empty_like(main)
                    src, out = local_tensor(grad), local_tensor(main.grad)
                model.grad = None
                srcs.append(src)
                outs.append(out)
                mask.append(self._counts(main))
                mains.append(main)
            for p in fp32s:
                main_grad = getattr(p, "main_grad", None)
                if main_grad is not None:
                    p.grad = main_grad
                if p.grad is None:
                    continue
                p.grad = _fp32_grad(p.grad, p)
                srcs.append(local_tensor(p.grad))
                outs.append(srcs[-1])
                mask.append(self._counts(p))
                mains.append(p)
        return StepGrads(False, scale, srcs, mask, mains, outs=outs)

    def _fused_grads(self, scale: Optional[Tensor]) -> StepGrads:
        """Step 1 of the one-pass path: per param group, (main param, model param or None for
        an fp32 param, local grad, counts toward the norm) for every param with a gradient;
        nothing is copied, no fp32 main grad is made."""
        entries, grads, mask, mains = [], [], [], []
        plain = torch.Tensor
        for half_rows, fp32_rows in self._step_rows()[1]:
            group = []
            for main, model, counts in half_rows:
                if main.grad is not None:
                    main.grad = None
                grad = getattr(model, "main_grad", None)  # _model_grad, a plain grad inline
                if grad is None:
                    grad = model.grad
                if grad is not None:
                    if type(grad) is not plain:  # a DTensor (or a subclass): placed
                        grad = local_tensor(_placed_like(grad, model))
                    group.append((main, model, grad, counts))
                    grads.append(grad)
                    mask.append(counts)
                    mains.append(main)
            for p, counts in fp32_rows:
                grad = _model_grad(p)
                if grad is not None:
                    grad = local_tensor(_fp32_grad(grad, p))
                    group.append((p, None, grad, counts))
                    grads.append(grad)
                    mask.append(counts)
                    mains.append(p)
            entries.append(group)
        return StepGrads(True, scale, grads, mask, mains, entries=entries)

    def _nonfinite_grads(self, grads: StepGrads):
        """(names, local gradients) counted for ``last_nonfinite`` after a step with
        found_inf: this step's grads (unscaled on the generic path, raw on the one-pass one)."""
        names = [self._param_name[id(m)] for m in grads.mains]
        return names, grads.grads if grads.fused else grads.outs

    def _finish_params(self, grads: StepGrads, updated: bool) -> None:
        """After the update (``updated``) or a skip: main params -> model params (the
        one-pass kernel wrote them itself), and the model grads are released."""
        if updated and not grads.fused:
            self._copy_mains_to_model()
        if grads.fused:  # the generic path released them in _generic_grads
            self._release_model_grads()

    def _read_and_decide(self, found_inf, norm, num_zeros, at_min, scaler_before):
        """The one host read of a step (found_inf, norm, zeros and the scaler's stall flag in one
        transfer) and step 5's decision: returns (skip, grad_norm float, num_zeros int or None).
        An overflow (with a scaler, or skip_nonfinite) or a spike-detector skip is a skip; a
        spike skip puts the loss scaler back to ``scaler_before``."""
        parts = [found_inf.reshape(1).double(), norm.reshape(1).double()]
        if num_zeros is not None:
            parts.append(num_zeros.reshape(1).double())
        if at_min is not None:
            parts.append(at_min.reshape(1).to(device=found_inf.device, dtype=torch.float64))
        host = torch.cat(parts).tolist()
        found = host[0] > 0
        if at_min is not None and host[-1] > 0:  # overflow at min_scale, or growth capped
            self.grad_scaler.report_overflow_at_min_scale()
        spikes = self.spike_detector
        if spikes is not None:  # a spike skip: as an overflow skip, but the scaler is restored
            loss = spikes.reduce_loss(self.grad_stats_group, self._device)
            try:
                decision = spikes.decide(host[1], loss, overflow=found)
            except GradSpikeError:  # policy "raise": the scaler as before the step, too
                spikes.restore_scaler(self.grad_scaler, scaler_before)
                raise
            if decision.skipped:
                spikes.restore_scaler(self.grad_scaler, scaler_before)
                return True, None, None
        if found and (self.grad_scaler is not None or self.skip_nonfinite):
            return True, None, None
        zeros = int(round(host[2])) if num_zeros is not None else None
        return False, host[1], zeros

    def _raw_zeros(self, srcs, mask, scale) -> Optional[Tensor]:
        """The zero count of the raw (loss-scaled) grads, as the one-pass path counts them, for
        the generic path that multiplies by ``scale`` before counting: one read-only pass
        (only with log_num_zeros_in_grad and a scale). None when the unscale pass may count
        (no multiply, so raw and unscaled zeros are the same). An element that only becomes 0
        at x * (1/scale) (a float32 or bfloat16 value below ~1.4e-45 x scale) is not a zero on
        either path."""
        if not self.log_num_zeros_in_grad or scale is None:
            return None
        return ops.grad_stats(srcs, norm_mask=mask, count_zeros=True, check_finite=False,
                              device=self._device).num_zeros

    def _root(self, norm_stat: Tensor, finite_p: bool) -> Tensor:
        """Reduced norm statistic -> norm, float64 on the device (p-th root taken in float64 and
        kept there for the clip coefficient, as Megatron-LM does)."""
        if not finite_p:
            return norm_stat.double()
        return norm_stat.double().pow(1.0 / self.norm_type)

    def _reduce(self, stats: ops.GradStats, finite_p: bool, expert=None):
        """Step 3: one collective for found_inf (as a SUM of flags), the norm statistic and the
        zero count when p is finite; MAX for found_inf and max |g| with an inf norm.

        With ``expert`` (the expert params' statistics, their groups apart; docs/spec.md
        section 19), as Megatron-core's ChainedOptimizer: the dense part is reduced over the
        grad-stats group, then the expert part, with the dense result's found_inf, over the
        expert grad-stats group; found_inf is the OR of both (every rank of both groups
        agrees), norm statistics and zeros add (the norm is sqrt(dense^2 + expert^2) for p = 2,
        the max of both maxima for p = inf)."""
        group = self.grad_stats_group
        found_inf = stats.found_inf.reshape(1)
        norm_stat = stats.norm_stat.reshape(-1)  # [1], or the exact digits [26]
        num_zeros = stats.num_zeros
        if expert is not None:
            found_inf, norm_stat, num_zeros = self._reduce_part(
                found_inf, norm_stat, num_zeros, group, finite_p)
            e_found, e_norm, e_zeros = self._reduce_part(
                found_inf, expert.norm_stat.reshape(-1), expert.num_zeros,
                self.expert_grad_stats_group, finite_p)
            if finite_p:
                norm_stat = norm_stat.double() + e_norm.double()
            else:
                norm_stat = torch.maximum(norm_stat.float(), e_norm.float())
            if num_zeros is not None:
                num_zeros = num_zeros.reshape(()) + e_zeros.reshape(()).to(num_zeros.dtype)
            return e_found, norm_stat, num_zeros
        return self._reduce_part(found_inf, norm_stat, num_zeros, group, finite_p)

    @staticmethod
    def _reduce_part(found_inf, norm_stat, num_zeros, group, finite_p: bool):
        """found_inf, the norm statistic (1 value, or the 26 exact digits of
        deterministic_grad_norm: a float64 SUM of integers below 2**53 is exact) and the zero
        count reduced over one group, in one collective for finite p."""
        if group is None:
            return found_inf, norm_stat, num_zeros
        if finite_p:
            n = norm_stat.numel()
            parts = [found_inf.double(), norm_stat.double()]
            if num_zeros is not None:
                parts.append(num_zeros.reshape(1).double())  # exact below 2**53
            buf = torch.cat(parts)
            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
            zeros = buf[1 + n] if num_zeros is not None else None
            return (buf[0:1] > 0).float(), buf[1:1 + n], zeros
        buf = torch.cat([found_inf, norm_stat])
        dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)
        if num_zeros is not None:
            num_zeros = num_zeros.clone()
            dist.all_reduce(num_zeros, op=dist.ReduceOp.SUM, group=group)
        return buf[0:1], buf[1:2], num_zeros

    # -- one-pass (fused) step ------------------------------------------------------------

    def _fused_step_usable(self) -> bool:
        """The fused path applies this step: a supported inner optimizer and options (checked
        per step: param groups and hooks may change), and a scaler whose 1/scale is <= 1 (so
        the statistics of the raw grads, scaled afterwards, equal those of the unscaled ones)."""
        kind = self._fused_kind
        if kind is None:
            return False
        if self.grad_scaler is not None and not self.grad_scaler.never_below_one:
            return False
        inner = self.optimizer
        if (
            inner._optimizer_step_pre_hooks
            or inner._optimizer_step_post_hooks
            or _torch_optimizer._global_optimizer_pre_hooks
            or _torch_optimizer._global_optimizer_post_hooks
        ):
            return False  # hooks expect the inner optimizer's step() to run
        return all(_fused_group_supported(kind, group) for group in inner.param_groups)

    def _unscaled_stats(
        self, stats: ops.GradStats, inv_scale: Optional[Tensor], finite_p: bool
    ) -> ops.GradStats:
        """Statistics of the raw (loss-scaled) grads -> those of grads x 1/scale: the norm
        statistic times (1/scale)^p (max |g| times 1/scale); found_inf and zeros are the same
        because 1/scale <= 1 is finite (checked in _fused_step_usable)."""
        if inv_scale is None or stats.norm_stat is None:
            return stats
        inv = inv_scale.reshape(()).double()
        if finite_p:
            norm_stat = stats.norm_stat.double() * inv.pow(self.norm_type)
        else:
            norm_stat = (stats.norm_stat.double() * inv).float()
        return stats._replace(norm_stat=norm_stat)

    def _grad_multiplier(
        self, inv_scale: Optional[Tensor], norm: Tensor, clip: bool
    ) -> Optional[Tensor]:
        """1/loss scale x clip coefficient as float32 [1] on the device (None: 1)."""
        mult = inv_scale
        if clip:
            coeff = clip_coefficient(self.clip_grad, norm)
            mult = coeff if mult is None else mult * coeff
        return mult

    def _fused_update(self, entries, grad_scale: Optional[Tensor], found_inf: Optional[Tensor]):
        """The one-pass step of every param group (model params and fp32 params apart)."""
        inner = self.optimizer
        for group, group_entries in zip(inner.param_groups, entries):
            half = [e for e in group_entries if e[1] is not None]
            full = [e for e in group_entries if e[1] is None]
            for part in (half, full):
                if part:
                    if self._fused_kind == "adam":
                        self._fused_adam(group, part, grad_scale, found_inf)
                    else:
                        self._fused_sgd(group, part, grad_scale, found_inf)
        if hasattr(inner.step, "_wrapped_by_lr_sched"):
            inner._opt_called = True  # what an lr scheduler's step() checks for

    def moment_dtypes(self, main: Tensor) -> tuple:
        """(exp_avg dtype, exp_avg_sq dtype) this optimizer stores for the inner optimizer's
        param ``main`` (a main param, its placeholder or a DistributedOptimizer's piece):
        the configured ``exp_avg_dtype`` / ``exp_avg_sq_dtype``, an 8-bit one replaced by
        torch.float32 when the whole param has fewer than ``min_8bit_size`` elements
        (:func:`tpamp.state_formats.param_moment_dtypes`; a DTensor's global numel, a ZeRO-1
        piece's whole param's numel, so every DP rank decides alike)."""
        m_dtype = getattr(self, "exp_avg_dtype", torch.float32)
        v_dtype = getattr(self, "exp_avg_sq_dtype", torch.float32)
        limit = getattr(self, "min_8bit_size", 0)
        if not limit:
            return m_dtype, v_dtype
        numel = getattr(self, "_whole_numel", {}).get(id(main))
        return state_formats.param_moment_dtypes(
            main.numel() if numel is None else numel, m_dtype, v_dtype, limit)

    def _fused_adam(self, group, part, grad_scale, found_inf):
        inner = self.optimizer
        mains, exp_avgs, exp_avg_sqs, steps = [], [], [], []
        m_scales, v_scales = [], []
        remainders = getattr(self, "_remainders", {})
        m_dtype = getattr(self, "exp_avg_dtype", torch.float32)
        v_dtype = getattr(self, "exp_avg_sq_dtype", torch.float32)
        narrow = m_dtype != torch.float32 or v_dtype != torch.float32
        per_param = narrow and getattr(self, "min_8bit_size", 0) > 0
        sr_params = getattr(self, "_sr_params", {})
        # (a DistributedOptimizer's part may hold bf16 pieces without master and fp32 pieces:
        # each fp32 entry gets a row the kernel ignores)
        sr_rows = [] if sr_params and any(id(e[0]) in sr_params for e in part) else None
        f32 = torch.float32
        state_of, rem_of = inner.state, remainders.get
        # fp32 state (the default configuration): a param whose state is already plain float32
        # tensors of torch.optim's layout takes the short branch below (no remainder, no
        # stochastic rounding, no 8-bit scales, not a DTensor); everything else the full one
        plain = not narrow and not remainders and sr_rows is None
        key = (id(group), part[0][1] is None)
        lists = self._cached_adam_lists(key, part) if plain else None
        if lists is not None:  # the same params, state and tensors as the last step
            self._adam_kernel(group, part, *lists, None, None, None, grad_scale, found_inf)
            return
        short = 0  # entries that took the short branch
        for main, _, _, _ in part:
            state = state_of[main]
            if plain and state and type(main) in _PLAIN_TENSORS:
                m_t, v_t, step_t = state.get("exp_avg"), state.get("exp_avg_sq"), state.get("step")
                if (
                    type(m_t) is torch.Tensor and type(v_t) is torch.Tensor
                    and type(step_t) is torch.Tensor
                    and m_t.dtype is f32 and v_t.dtype is f32
                    and step_t.device == main.device
                    and "exp_avg_scale" not in state and "exp_avg_sq_scale" not in state
                ):
                    mains.append(main)
                    exp_avgs.append(m_t)
                    exp_avg_sqs.append(v_t)
                    steps.append(step_t)
                    short += 1
                    continue
            rem = rem_of(id(main))
            local = rem if rem is not None else local_tensor(main)  # what the kernel steps
            if id(main) in sr_params:  # the bf16 param itself (stochastic rounding)
                local = sr_params[id(main)]
            if sr_rows is not None:
                sr_rows.append(self._sr_rows.get(id(main), (0, 0)))
            if per_param:  # min_8bit_size: small params keep float32 moments
                m_dtype, v_dtype = self.moment_dtypes(main)
            if len(state) == 0:  # torch.optim.Adam's _init_group, with the step on the device
                if narrow:
                    state.update(state_formats.moments_like(state_formats.new_adam_state(
                        local, _scalar_dtype(), m_dtype, v_dtype), main))
                else:
                    state["step"] = torch.zeros((), dtype=_scalar_dtype(), device=local.device)
                    # laid out as the tensor the kernel steps (a remainder or a bf16 param of
                    # stochastic rounding has the param's strides; its placeholder main has none)
                    like = main if local is main else state_formats.dtensor_like(local, main)
                    state["exp_avg"] = torch.zeros_like(like, dtype=f32,
                                                        memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(like, dtype=f32,
                                                           memory_format=torch.preserve_format)
            else:
                if state["step"].device != local.device:
                    state["step"] = state["step"].to(local.device)  # once, after a CPU load
                if narrow:
                    convert = state_formats.needs_conversion(state, m_dtype, v_dtype)
                else:  # fp32 moments: a quick look first (needs_conversion only if it may)
                    m_t, v_t = state.get("exp_avg"), state.get("exp_avg_sq")
                    convert = (
                        m_t is None or v_t is None or m_t.dtype != f32 or v_t.dtype != f32
                        or "exp_avg_scale" in state or "exp_avg_sq_scale" in state
                    ) and state_formats.needs_conversion(state, m_dtype, v_dtype)
                if convert:  # loaded otherwise
                    new = state_formats.convert_adam_state(
                        {k: local_tensor(v) for k, v in state.items()}, local, m_dtype, v_dtype)
                    state.clear()
                    state.update(state_formats.moments_like(new, main))
            mains.append(local)
            exp_avgs.append(local_tensor(state["exp_avg"]))
            exp_avg_sqs.append(local_tensor(state["exp_avg_sq"]))
            steps.append(state["step"])
            if narrow:  # fp32 moments have no scales (converted above where loaded otherwise)
                m_scales.append(state.get("exp_avg_scale"))
                v_scales.append(state.get("exp_avg_sq_scale"))
        models = [local_tensor(e[1]) for e in part] if part[0][1] is not None else None
        if sr_rows is not None:
            models = None  # the bf16 params are stepped in place
        if plain and short == len(part) and (models is None or all(
                type(m) is torch.Tensor or type(m) is torch.nn.Parameter for m in models)):
            self._keep_adam_lists(key, part, mains, exp_avgs, exp_avg_sqs, steps, models)
        self._adam_kernel(group, part, mains, exp_avgs, exp_avg_sqs, steps, models,
                          m_scales if narrow else None, v_scales if narrow else None, sr_rows,
                          grad_scale, found_inf)

    def _adam_kernel(self, group, part, mains, exp_avgs, exp_avg_sqs, steps, models, m_scales,
                     v_scales, sr_rows, grad_scale, found_inf) -> None:
        """One ``ops.fused_adam_step_`` call over one part of a param group."""
        beta1, beta2 = group["betas"]
        ops.fused_adam_step_(
            mains, [e[2] for e in part], exp_avgs, exp_avg_sqs, steps,
            exp_avg_scales=m_scales, exp_avg_sq_scales=v_scales, stochastic_rounding=sr_rows,
            model_params=models, grad_scale=grad_scale, found_inf=found_inf,
            lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
            weight_decay=group["weight_decay"],
            decoupled_weight_decay=group.get("decoupled_weight_decay", False)
            or isinstance(self.optimizer, torch.optim.AdamW),
            maximize=group["maximize"],
        )

    # The fp32-state lists of the last step, per (param group, part): a step over the same
    # params whose state holds the same dicts of the same sizes with the same tensors
    # (compared by identity, a few C-level passes) reuses them instead of looking at each
    # param's state again; anything else -- a load (new state dict), a state or tensor
    # replaced, a conversion, new params -- takes the full loop, which rebuilds them.

    def _keep_adam_lists(self, key, part, mains, exp_avgs, exp_avg_sqs, steps, models) -> None:
        state_of = self.optimizer.state
        dicts = [state_of[m] for m in mains]
        cache = self.__dict__.setdefault("_adam_lists", {})
        if len(cache) >= 2 * len(self.optimizer.param_groups):  # parts of groups gone: drop
            cache.clear()
        cache[key] = (state_of, list(state_of), list(state_of.values()), mains, dicts,
                      list(map(len, dicts)), exp_avgs, exp_avg_sqs, steps,
                      [e[1] for e in part], models)

    def _cached_adam_lists(self, key, part) -> Optional[tuple]:
        """(mains, exp_avgs, exp_avg_sqs, steps, models) of the last step when nothing they
        were built from changed (the comment above), else None."""
        entry = self.__dict__.get("_adam_lists", {}).get(key)
        if entry is None:
            return None
        (state_of, keys, values, mains, dicts, sizes, exp_avgs, exp_avg_sqs, steps, sources,
         models) = entry
        same = _same_objects
        if self.optimizer.state is not state_of or len(part) != len(mains):
            return None
        if not same([e[0] for e in part], mains):
            return None
        # the same keys with the same dicts (no tensor hashed): each main's dict as kept
        if not (same(state_of, keys) and same(state_of.values(), values)):
            return None
        if list(map(len, dicts)) != sizes:
            return None
        try:
            if not (same(map(_EXP_AVG, dicts), exp_avgs)
                    and same(map(_EXP_AVG_SQ, dicts), exp_avg_sqs)
                    and same(map(_STEP, dicts), steps)):
                return None
        except KeyError:
            return None
        if models is not None and not same([e[1] for e in part], sources):
            return None
        return mains, exp_avgs, exp_avg_sqs, steps, models

    def _fused_sgd(self, group, part, grad_scale, found_inf):
        inner = self.optimizer
        mains = [local_tensor(e[0]) for e in part]
        bufs, first = None, None
        if group["momentum"] != 0:
            bufs, first = [], []
            for main, _, _, _ in part:
                buf = inner.state[main].get("momentum_buffer")
                first.append(buf is None)
                bufs.append(buf if buf is not None else torch.empty_like(main))
            if any(first) and found_inf is not None and bool(found_inf.item()):
                return  # a skipped first step must not leave buffers behind (one host read)
        models = [local_tensor(e[1]) for e in part] if part[0][1] is not None else None
        ops.fused_sgd_step_(
            mains, [e[2] for e in part], [local_tensor(b) for b in bufs] if bufs else None,
            first_step=first, model_params=models, grad_scale=grad_scale, found_inf=found_inf,
            lr=group["lr"], momentum=group["momentum"], dampening=group["dampening"],
            weight_decay=group["weight_decay"], nesterov=group["nesterov"],
            maximize=group["maximize"],
        )
        if bufs is not None:
            for (main, _, _, _), buf in zip(part, bufs):
                inner.state[main]["momentum_buffer"] = buf

    def _release_model_grads(self) -> None:
        """Step 1's release of the model grads (main_grad buffers belong to their owner)."""
        for pairs in self._half_pairs:
            for model, _ in pairs:
                model.grad = None

    # -- non-finite attribution (tpamp/nonfinite.py) --------------------------------------

    def _init_param_names(self, names: Dict[int, str], coords) -> None:
        """Name every trained param (main param id -> the name of its model param, default
        ``group<g>.param<i>``) and keep this rank's coordinates for NonFiniteGrad records."""
        model_of = {id(main): model for pairs in self._half_pairs for model, main in pairs}
        self._param_name: Dict[int, str] = {}
        self._named_model_params: List[tuple] = []
        for gi, group in enumerate(self.optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                model = model_of.get(id(p), p)
                name = names.get(id(model), f"group{gi}.param{pi}")
                self._param_name[id(p)] = name
                self._named_model_params.append((name, model))
        self._coords = coords
        # model order for the records: the order of param_names (named params), then the rest
        self._name_position = {n: i for i, n in enumerate(names.values())}
        self.last_nonfinite: Optional[list] = []

    def named_model_params(self) -> List[tuple]:
        """(name, model param) of every param of the inner optimizer's groups, in group order:
        the ``param_names`` given at construction, ``group<g>.param<i>`` for the others."""
        return list(self._named_model_params)

    # Whether every data-parallel replica holds the whole fp32 masters and optimizer state
    # (False for the wrappers that shard them over DP: DistributedOptimizer, the layer-wise one)
    replicated_state = True

    def replica_tensors(self) -> List[tuple]:
        """(name, model param, {what: local tensor}) of every param of the inner optimizer's
        groups, in :meth:`named_model_params` order, with the tensors this rank holds for it:
        ``"param"`` (the model param), ``"main_param"`` (the fp32 master of an fp16/bf16
        param), ``"param_remainder"`` (``store_param_remainders``' int16 remainder) and every
        tensor of the inner optimizer's state of the param (``"exp_avg"``, ``"exp_avg_sq"``,
        ``"step"``, the 8-bit formats' codes and scales, ...: live tensors, any dtype). Where
        ``replicated_state`` is False only ``"param"`` (the state is sharded over DP). What
        :mod:`tpamp.replicas` compares across the ranks that hold equal copies."""
        if not self.replicated_state:
            return [(name, model, {"param": local_tensor(model.detach())})
                    for name, model in self.named_model_params()]
        mains = {id(model): main for pairs in self._half_pairs for model, main in pairs}
        out = []
        for name, model in self.named_model_params():
            tensors = {"param": local_tensor(model.detach())}
            main = mains.get(id(model))
            if main is not None and id(main) in self._remainders:
                tensors["param_remainder"] = self._remainders[id(main)]
            elif main is not None and id(main) not in self._sr_params:
                tensors["main_param"] = local_tensor(main.detach())
            state = self.optimizer.state.get(main if main is not None else model, {})
            for key, value in state.items():
                if isinstance(value, Tensor):
                    tensors[str(key)] = local_tensor(value.detach())
            out.append((name, model, tensors))
        return out

    def _note_nonfinite(self, found_inf, skip: bool, local_grads) -> None:
        """``last_nonfinite`` after the step's host read: [] on a clean step (no extra work:
        a step that is not skipped had no inf/nan unless non-finite steps are taken,
        skip_nonfinite=False without a scaler); when found_inf is set, every rank counts inf
        and NaN per local grad (``local_grads()`` -> (names, tensors)) and the records are
        gathered over the grad-stats group (tpamp.nonfinite). found_inf is agreed over the
        group, so every rank joins or none does."""
        if not skip and (self.grad_scaler is not None or self.skip_nonfinite):
            self.last_nonfinite = []
            return
        if not bool(found_inf.reshape(-1)[0].item()):  # a spike skip (already synchronised)
            self.last_nonfinite = []
            return
        names, tensors = local_grads()
        expert = self._expert_names()
        records = local_records(names, tensors, self._coords, expert_names=expert,
                                expert_coords=self.expert_rank_coords)
        position = self._name_position  # model order (param_names'), as backward order needs
        records.sort(key=lambda r: position.get(r.name, len(position)))
        more = (self.expert_grad_stats_group,) if self.experts_apart else ()
        self.last_nonfinite = gather_nonfinite(records, self.grad_stats_group, *more)

    def _expert_names(self) -> set:
        """Names of this rank's expert params (their last_nonfinite records carry the EP rank)."""
        return {n for n, p in self.named_model_params() if is_expert_param(p)}

    # -- checkpointing --------------------------------------------------------------------

    def state_dict(self) -> Dict:
        """{'optimizer': inner state dict, 'grad_scaler': scaler state (None without one),
        'fp32_from_fp16_params': per param group, the list of main params (tensors)}, and
        'spike_detector' with a detector."""
        state = {
            "optimizer": self.optimizer.state_dict(),
            "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler is not None else None,
            **self._main_param_state(),
        }
        if self.spike_detector is not None:  # tpamp's own key beside Megatron's three
            state["spike_detector"] = self.spike_detector.state_dict()
        return state

    def _main_param_state(self) -> Dict:
        return {
            "fp32_from_fp16_params": [  # fp32 (Megatron's format), rebuilt from remainders
                [self._master_value(main, model) for model, main in pairs]
                for pairs in self._half_pairs
            ],
        }

    def load_state_dict(self, state_dict: Dict) -> None:
        """Restore the inner optimizer, the scaler and the main params, then copy the main
        params to the model params, so a resumed run continues bit-identically.

        All or nothing, through the load path shared with DistributedOptimizer
        (tpamp._validation.load_wrapper_state): everything is checked before anything changes
        (inner optimizer state against this optimizer: group and param counts, the optimizer
        class's hyperparameters, state shapes, finite values; scaler state against the
        scaler's config; the spike detector's state, SpikeDetector.check_state_dict; main
        params float32, of the right shapes and finite). Raises TypeError for a non-dict (None
        included) or a value of the wrong type, KeyError for a missing key, ValueError for a
        value that does not fit, each naming the key; a failed load leaves the optimizer,
        scaler, detector and params unchanged. The next step compares the settings across
        ranks again. State saved with other storage options (moment dtypes, remainders) is
        converted to this optimizer's (:mod:`tpamp.state_formats`)."""
        # with store_param_remainders a main param is a storage-free placeholder: its saved
        # fp32 value lands in a scratch tensor, then is split into bf16 param + remainder
        scratch: Dict[int, Tensor] = {}

        def targets():
            out = []
            for pairs in self._half_pairs:
                group = []
                for _, main in pairs:
                    held = self._remainders.get(id(main), self._sr_params.get(id(main)))
                    if held is not None:  # no fp32 storage: the saved master lands here
                        t = scratch.setdefault(id(main), torch.empty(
                            main.shape, dtype=torch.float32, device=held.device))
                        group.append(t)
                    else:
                        group.append(main)
                out.append(group)
            return out

        _validation.load_wrapper_state(
            self, state_dict, mains_key="fp32_from_fp16_params",
            match_mains=lambda saved: _validation.match_saved_tensors(
                "state_dict['fp32_from_fp16_params']", saved, targets()),
            after_copy=lambda: self._after_load_copy(scratch),
        )

    def _after_load_copy(self, scratch: Dict[int, Tensor]) -> None:
        for pairs in self._half_pairs:
            for model, main in pairs:
                rem = self._remainders.get(id(main))
                if rem is not None:  # exact: the fp32 master split into bf16 param + remainder
                    hi, lo = ops.split_remainders(local_tensor(scratch[id(main)]))
                    local_tensor(model.detach()).copy_(hi)
                    rem.copy_(lo)
                elif id(main) in self._sr_params:  # no master: rounded to nearest (exact for
                    # a master saved by a stochastic-rounding run: its values are bf16)
                    self._sr_params[id(main)].copy_(local_tensor(scratch[id(main)]))
        self._copy_mains_to_model()
        self._convert_state()

    def _copy_mains_to_model(self) -> None:
        mains, models = self._pair_locals()
        ops.scale_and_copy(mains, models)

    def _convert_state(self) -> None:
        """Inner Adam state stored in this optimizer's moment dtypes (after a load that may
        come from another configuration; torch.optim's load casts state to the param dtype).
        Every load calls it: the Adam lists kept from the last step are dropped here, so the
        state tensors a load replaced are not held until the next step."""
        self.__dict__.pop("_adam_lists", None)
        if self._fused_kind != "adam":
            return
        for group in self.optimizer.param_groups:
            for main in group["params"]:
                state = self.optimizer.state.get(main)
                m_dtype, v_dtype = self.moment_dtypes(main)
                if not state or not state_formats.needs_conversion(state, m_dtype, v_dtype):
                    continue
                rem = self._remainders.get(id(main), self._sr_params.get(id(main)))
                like = rem if rem is not None else local_tensor(main)
                new = state_formats.convert_adam_state(
                    {k: local_tensor(v) for k, v in state.items()}, like, m_dtype, v_dtype)
                state.clear()
                state.update(state_formats.moments_like(new, main))

    # -- checkpoint interface (tpamp.checkpoint calls these) --
    # (kept self-contained: sharded_state_dict / load_sharded_state_dict and their helpers,
    # mirroring DistributedOptimizer's; tpamp.checkpoint reaches no private state)

    def sharded_state_dict(self, model_params, *, tensor_parallel_group=None) -> Dict:
        """The hook of ``tpamp.checkpoint``: the fp32 master of every param this optimizer
        updates (an fp16/bf16 param's main param, an fp32 param itself; with
        store_param_remainders the master rebuilt exactly from bf16 param + remainder, a new
        tensor), its inner optimizer state and the param groups' hyperparameters, keyed by the
        global names of ``model_params`` ({global name: model param}).

        Each tensor is in the param's GLOBAL shape (``tpamp.checkpoint.global_view``): a DTensor
        as it is, a Megatron TP param (``tensor_model_parallel``) as a DTensor
        ``Shard(partition_dim)`` over ``tensor_parallel_group`` (default: this optimizer's),
        anything else replicated; sharing storage with the live buffers (but for rebuilt
        masters). State tensors shaped like the param are placed like its main param; 8-bit
        moments are given as float32 values (``state_formats.layout_free_state``).

        Returns {"main_params": {name: T}, "state": {name: {key: T or object}} (a param
        without state has no entry), "param_groups": [hyperparameters without "params"]}.
        No communication. Raises ValueError for a param of this optimizer missing from
        model_params, and as ``global_view`` does (a Megatron TP param without a TP group)."""
        from tpamp.checkpoint import global_view

        tp_group = self.tensor_parallel_group if tensor_parallel_group is None \
            else tensor_parallel_group
        named = self._ckpt_named_mains(model_params)
        model_of = {id(main): model for pairs in self._half_pairs for model, main in pairs}
        mains, state = {}, {}
        for name, main in named:
            if id(main) in self._remainders or id(main) in self._sr_params:
                # the fp32 master, rebuilt exactly (a new tensor; the bf16 value without master)
                view = global_view(self._master_value(main, model_of[id(main)]), tp_group,
                                   name=name)
            else:
                view = global_view(main, tp_group, name=name)
            mains[name] = view
            st = self.optimizer.state.get(main)
            if st:
                st = state_formats.layout_free_state(st)  # 8-bit moments as float32 values
                state[name] = {k: self._ckpt_state_view(v, main, view) for k, v in st.items()}
        self._ckpt_named = named
        groups = [group_hyperparameters(g) for g in self.optimizer.param_groups]
        return {"main_params": mains, "state": state, "param_groups": groups}

    def load_sharded_state_dict(self, state: Dict) -> None:
        """The hook of ``tpamp.checkpoint``: copy ``state`` (the structure of
        :meth:`sharded_state_dict`, read into new buffers placed like it; values already
        checked by the caller) into the main params (split into bf16 param + remainder with
        store_param_remainders), the inner optimizer's state (a param with no entry loses its
        state) and the param groups' hyperparameters (by group index), then copy the main
        params into the fp16/bf16 model params and convert the moments into this optimizer's
        dtypes. Raises RuntimeError without a :meth:`sharded_state_dict` call before (it names
        the params)."""
        named = getattr(self, "_ckpt_named", None)
        if named is None:
            raise RuntimeError("load_sharded_state_dict needs a sharded_state_dict() call first")
        inner = self.optimizer
        group_of = {id(p): g for g in inner.param_groups for p in g["params"]}
        model_of = {id(main): model for pairs in self._half_pairs for model, main in pairs}
        for name, main in named:
            if name in state["main_params"]:
                with torch.no_grad():
                    saved = local_tensor(state["main_params"][name])
                    rem = self._remainders.get(id(main))
                    if id(main) in self._sr_params:  # no master: rounded to nearest into bf16
                        self._sr_params[id(main)].copy_(saved.to(self._sr_params[id(main)].device))
                    elif rem is None:
                        local_tensor(main).copy_(saved)
                    else:  # exact: the fp32 master split into bf16 param + remainder
                        hi, lo = ops.split_remainders(saved.to(rem.device))
                        local_tensor(model_of[id(main)].detach()).copy_(hi)
                        rem.copy_(lo)
            old = inner.state.get(main, {})
            new = {}
            for k, v in state["state"].get(name, {}).items():
                if isinstance(v, Tensor):
                    if _is_dtensor(v) and not _is_dtensor(main):
                        v = v.to_local()
                    elif not _is_dtensor(v) and tuple(v.shape) != tuple(main.shape):
                        v = v.to(self._ckpt_scalar_device(k, old, main, group_of.get(id(main), {})))
                new[k] = v
            if new:
                inner.state[main] = new
            else:
                inner.state.pop(main, None)
        for g, saved in zip(inner.param_groups, state["param_groups"]):  # in live order
            g.update(group_hyperparameters(saved))
        with torch.no_grad():  # the model params are fp16/bf16 of the loaded main params
            mains, models = self._pair_locals()
            if mains:
                ops.scale_and_copy(mains, models)
            self._convert_state()  # moments into this optimizer's configured dtypes

    def align_param_groups(self, saved_groups, where: str = "the checkpoint") -> tuple:
        """The hook of ``tpamp.checkpoint`` (and any loader of saved param groups): the saved
        groups (dicts with ``override_key``, one per inner param group) in the order of this
        optimizer's inner groups, matched by override key (docs/spec.md section 16); as given
        (by position) when either side has a group without one. Raises ValueError naming the
        key for a key that is new or gone, or an override whose values differ (a changed
        override); :func:`tpamp.param_groups.match_saved_groups`. An inner optimizer of parts
        (:class:`tpamp.CombinedOptimizer`) matches them to its parts by part key first."""
        saved_groups = list(saved_groups)
        by_part = getattr(self.optimizer, "saved_group_order", None)
        perm = by_part({"param_groups": saved_groups}, where) if callable(by_part) else None
        if perm is None:
            perm = match_saved_groups(saved_groups, self.optimizer.param_groups, where)
        return tuple(saved_groups) if perm is None else tuple(saved_groups[j] for j in perm)

    def check_saved_param_groups(self, saved_groups, where: str = "the checkpoint") -> None:
        """The hook of ``tpamp.checkpoint``: the hyperparameter values of saved param groups
        (aligned by :meth:`align_param_groups`, one per inner group), each by the rules of the
        class that steps it (:mod:`tpamp.hyperparameters`: a finite lr, eps > 0, Muon's
        momentum < 1, ...). Raises TypeError / ValueError naming the group and key; changes
        nothing."""
        hyperparameters.check_saved_group_hyperparameters(self.optimizer, list(saved_groups),
                                                          f"{where}'s param_groups")

    def _ckpt_named_mains(self, model_params) -> List[tuple]:
        """[(global name, main param)] in param-group order."""
        names = {id(p): n for n, p in model_params.items()}
        out = []
        for pairs, fp32s in zip(self._half_pairs, self._fp32_params):
            for model, main in list(pairs) + [(p, p) for p in fp32s]:
                name = names.get(id(model))
                if name is None:
                    raise ValueError(
                        f"the optimizer updates a param of shape {tuple(model.shape)} that is not "
                        "in model_params: give every trained param a global name"
                    )
                out.append((name, main))
        return out

    @staticmethod
    def _ckpt_state_view(v, main, view):
        """A state tensor placed like the main param's global view when it is param-shaped, or
        has the param's dims and its local size along every split dim (a factored state such
        as Adafactor's row factor of a row-split param: docs/spec.md section 17); any other
        as it is (replicated)."""
        if isinstance(v, Tensor) and not _is_dtensor(v) and view is not main \
                and _is_dtensor(view) and v.dim() == main.dim() and v.dim() > 0 \
                and all(v.shape[pl.dim] == main.shape[pl.dim]
                        for pl in view.placements if pl.is_shard()):
            from torch.distributed.tensor import DTensor

            return DTensor.from_local(v, view.device_mesh, view.placements, run_check=False)
        return v

    @staticmethod
    def _ckpt_scalar_device(key, old, main, group):
        """Where torch.optim keeps a non-param-shaped state tensor (AdamW's step: on the CPU
        unless capturable or fused)."""
        if key in old and isinstance(old[key], Tensor):
            return old[key].device
        if group.get("capturable") or group.get("fused"):
            return local_tensor(main).device
        return torch.device("cpu")

    # -- end of the checkpoint interface --


class FP32Optimizer(MixedPrecisionOptimizer):
    """The same interface for fp32 models (Megatron-LM's FP32Optimizer): no main copy; grad
    norm, clipping, zero count and the non-finite skip of :class:`MixedPrecisionOptimizer`.
    A grad_scaler is optional (usually None: loss scale 1). Raises TypeError for a param that
    is not float32."""

    def __init__(self, optimizer: torch.optim.Optimizer, **kwargs):
        for gi, group in enumerate(getattr(optimizer, "param_groups", [])):
            for pi, p in enumerate(group["params"]):
                if p.dtype != torch.float32:
                    raise TypeError(
                        f"FP32Optimizer: param {pi} of param group {gi} has dtype {p.dtype}; "
                        "expected float32 (use MixedPrecisionOptimizer for fp16/bf16 params)"
                    )
        super().__init__(optimizer, **kwargs)


def check_wrapper_args(optimizer, grad_scaler, clip_grad) -> None:
    """The arguments every tpamp optimizer wrapper shares, checked before anything changes:
    a torch.optim.Optimizer not wrapped yet whose params have supported dtypes (TypeError /
    ValueError), a tpamp scaler or None (TypeError), clip_grad a finite number >= 0 (TypeError
    for a non-number, ValueError for nan, inf or a negative value), and the hyperparameters
    of every param group (:mod:`tpamp.hyperparameters`: a finite lr, eps > 0, ...)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if grad_scaler is not None and not isinstance(grad_scaler, MegatronGradScaler):
        raise TypeError(
            "grad_scaler must be a tpamp ConstantGradScaler or DynamicGradScaler, got "
            f"{type(grad_scaler).__name__}"
        )
    _validation.check_wrappable(optimizer)
    _validation.check_real("clip_grad", clip_grad, low=0.0)
    # every group's values, which torch checks only for its constructor's defaults
    hyperparameters.check_optimizer_hyperparameters(optimizer)


def check_fp16_scaler(has_fp16: bool, grad_scaler) -> None:
    """ValueError when fp16 params come without a loss scaler."""
    if has_fp16 and grad_scaler is None:
        raise ValueError(
            "fp16 params need a loss scaler (grad_scaler=DynamicGradScaler() or "
            "ConstantGradScaler(scale)); got grad_scaler=None"
        )


@functools.lru_cache(maxsize=None)
def _source_name(dtype: Optional[torch.dtype], index: int, group: int) -> str:
    """The name of a gradient in :meth:`MixedPrecisionOptimizer.grad_sources` ("torch.float16
    param 3 of param group 0"; ``dtype`` None: "fp32 param 0 of param group 1"), cached: the
    step guard reads the sources every step, and formatting 196 names with their dtypes took
    ~25 us of the step's ~1 ms of host work."""
    kind = "fp32" if dtype is None else str(dtype)
    return f"{kind} param {index} of param group {group}"


def param_dtype_error(gi: int, pi: int, param: Tensor) -> str:
    """The TypeError message for a param of an unsupported dtype."""
    return (f"param {pi} of param group {gi} has dtype {param.dtype}; "
            "expected float32, float16 or bfloat16")


def _model_grad(p: Tensor) -> Optional[Tensor]:
    """The gradient a step reads for p: its ``main_grad`` when it has one, else ``.grad``,
    placed like p (a DTensor grad gets p's placements); None when it has neither."""
    grad = getattr(p, "main_grad", None)
    if grad is None:
        grad = p.grad
    return None if grad is None else _placed_like(grad, p)


def _fp32_grad(grad: Tensor, p: Tensor) -> Tensor:
    """An fp32 param's gradient, placed like it; TypeError unless it is float32."""
    grad = _placed_like(grad, p)
    if local_tensor(grad).dtype != torch.float32:
        raise TypeError(
            f"an fp32 param has a {local_tensor(grad).dtype} gradient; expected float32")
    return grad


def clear_grad(p: Tensor, set_to_none: bool) -> None:
    """Release p's ``.grad`` (set_to_none) or zero it in place (detached), as
    ``torch.optim.Optimizer.zero_grad`` does; nothing when it has none."""
    if p.grad is None:
        return
    if set_to_none:
        p.grad = None
    else:
        p.grad.detach_()
        p.grad.zero_()


def _remainder_placeholder(param: Tensor) -> Tensor:
    """The inner optimizer's param for a bf16 param kept as param + remainder: float32, the
    param's shape (a DTensor with its mesh and placements), but no storage of its own (an
    expanded 0-dim zero): the state is keyed by it, the kernel never touches it."""
    local = local_tensor(param.detach())
    data = torch.zeros((), dtype=torch.float32, device=local.device).expand(local.shape)
    data = state_formats.dtensor_like(data, param)
    main = torch.nn.Parameter(data, requires_grad=True)
    for attr in _COPIED_ATTRS:
        if hasattr(param, attr):
            setattr(main, attr, getattr(param, attr))
    return main


# the old name (tpamp.distributed_optimizer imports it from here)
state_formats_refuse_generic = state_formats.refuse_generic_step


def _state_to_fp32(state: dict) -> dict:
    """Optimizer state of an fp16/bf16 param, moved to its fp32 main param."""
    return {
        k: v.float() if isinstance(v, Tensor) and v.dtype in _HALF_DTYPES else v
        for k, v in state.items()
    }


# this module's short names for the shared helpers (tpamp.common)
_FUSED_KINDS = FUSED_KINDS
_placed_like = placed_like
_is_dtensor = is_dtensor


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _fused_group_supported(kind: str, group: dict) -> bool:
    """The options of one param group that the one-pass kernels implement."""
    lr = group.get("lr")
    lr_ok = _is_number(lr) or (isinstance(lr, Tensor) and lr.numel() == 1 and not lr.requires_grad)
    if not lr_ok or group.get("differentiable", False) or not _is_number(group.get("weight_decay")):
        return False
    if kind == "adam":
        betas = group.get("betas", ())
        return (
            not group.get("amsgrad", False)
            and not group.get("capturable", False)
            and len(betas) == 2
            and all(_is_number(b) for b in betas)
            and _is_number(group.get("eps"))
        )
    return _is_number(group.get("momentum")) and _is_number(group.get("dampening"))


# the classes of a plain (not DTensor) main param: _fused_adam's short branch
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_EXP_AVG = operator.itemgetter("exp_avg")
_EXP_AVG_SQ = operator.itemgetter("exp_avg_sq")
_STEP = operator.itemgetter("step")


def _same_objects(a, b) -> bool:
    """Whether the iterables a and b hold the very same objects in the same order (b a list)."""
    a = list(a)
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _scalar_dtype() -> torch.dtype:
    """torch.optim's dtype for the step count (float32; float64 under a float64 default)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _same_group(a, b) -> bool:
    """The same process group (object), or two groups of the same ranks; None only equals None."""
    if a is b:
        return True
    if a is None or b is None:
        return False
    return dist.get_process_group_ranks(a) == dist.get_process_group_ranks(b)
