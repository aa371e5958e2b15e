"""Megatron-LM in one import: megatron-core's ``get_megatron_optimizer`` built on tpamp.

Usage (Megatron-LM's training.py, or any loop wired as it is)::

    # from megatron.core.optimizer import get_megatron_optimizer
    from tpamp.megatron import get_megatron_optimizer

    optimizer = get_megatron_optimizer(OptimizerConfig(fp16=True, ...), model_chunks)

``model_chunks`` are megatron-core's ``DistributedDataParallel`` modules (each one's
``ddp_config`` is read) or plain modules. The returned :class:`MegatronOptimizer` has the
interface Megatron-LM's training loop calls (megatron/core/optimizer/optimizer.py's
MegatronOptimizer: ``step()`` -> (update_successful, grad_norm, num_zeros_in_grad),
``scale_loss``, ``get_loss_scale``, ``zero_grad``, ``param_groups``, ``state_dict`` /
``load_state_dict``, ``sharded_state_dict`` for dist-checkpointing, ``save_parameter_state``
/ ``load_parameter_state``, ``prepare_grads`` / ``step_with_ready_grads``, ``get_grad_norm``,
``clip_grad_norm``, ``count_zeros``, ``offload_to_cpu`` / ``restore_from_cpu`` ...); the step
itself is tpamp's (:class:`tpamp.MixedPrecisionOptimizer`, docs/spec.md section 2).

What is read (docs/migration.md "Megatron-LM in one import" lists what differs):

* OptimizerConfig: ``optimizer`` ("adam": torch.optim.AdamW with decoupled_weight_decay, else
  Adam; "sgd": SGD with sgd_momentum), ``lr``, ``min_lr``, ``weight_decay``, ``adam_beta1/2``,
  ``adam_eps``, ``clip_grad``, ``log_num_zeros_in_grad``, ``fp16`` / ``bf16``, ``loss_scale``
  (a ConstantGradScaler), ``initial_loss_scale``, ``min_loss_scale``, ``loss_scale_window``
  (the growth interval), ``hysteresis``, ``use_distributed_optimizer``. Param groups are
  megatron-core's own (``config_overrides``, default: its standard overrides; the keys
  ``wd_mult``, ``lr_mult``, ``max_lr``, ``min_lr``, ``is_decoupled_lr``, ``default_config``
  that OptimizerParamScheduler and training.py read).
* each chunk's DistributedDataParallelConfig: ``use_distributed_optimizer`` (must equal the
  OptimizerConfig's), ``grad_reduce_in_fp32`` and ``overlap_grad_reduce`` (megatron's DDP
  reduces; tpamp reads the reduced ``main_grad`` buffers).
* groups (megatron-core's parallel_state, or ``pg_collection``): found_inf, norm and zeros are
  reduced over the model-parallel group (distributed optimizer: the distributed-optimizer
  instance's group, TP x PP x DP), TP duplicates counted on TP rank 0 only.

Under megatron's DDP with ``use_distributed_optimizer=True`` the optimizer uses megatron's own
param and grad buffers, as megatron-core's DistributedOptimizer does: DP rank r owns
[r * n / d, (r + 1) * n / d) of every bucket; tpamp keeps fp32 main params and optimizer state
for that range alone (views of megatron's buffers are its model params), steps them after
megatron's reduce-scatter (overlapped with backward or not) and writes the new values into
megatron's param buffer, whose all-gather (``start_param_sync``) gives every rank the params.

Raises (at construction) ImportError without megatron-core, ValueError for an option that
cannot apply (named): an optimizer other than adam / sgd, ``use_precision_aware_optimizer``,
``optimizer_cpu_offload``, ``optimizer_cuda_graph``, ``overlap_param_gather_with_optimizer_step``,
``dump_param_to_param_group_map``; chunks whose DDP configs differ, a DDP
``use_distributed_optimizer`` that differs from the OptimizerConfig's, the distributed optimizer
without megatron's DDP, megatron-FSDP, ``overlap_param_gather``, more than one
distributed-optimizer instance; expert (``allreduce=False``) params.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from tpamp import exact_sum
from tpamp.grad_scaler import ConstantGradScaler, DynamicGradScaler
from tpamp.grad_stats import counts_toward_norm
from tpamp.optimizer import FP32Optimizer, MixedPrecisionOptimizer

__all__ = ["MegatronOptimizer", "get_megatron_optimizer"]

Tensor = torch.Tensor
_HALF = (torch.float16, torch.bfloat16)
# Megatron's param attributes the norm filters read, copied to buffer pieces. A piece is a flat
# range of its param: a TP one is split along its only dim (partition_dim 0, stride 1), not the
# param's partition_dim (the settings check refuses one outside [0, ndim)); checkpoints read the
# model params.
_ATTRS = ("tensor_model_parallel", "shared", "allreduce")
_PIECE_TP_ATTRS = {"partition_dim": 0, "partition_stride": 1}
# OptimizerConfig options tpamp cannot honour: an error, never a silent difference
FORMAT_KEY = "tpamp_megatron_optimizer"  # marks tpamp.megatron's checkpoint format
_UNSUPPORTED = ("use_precision_aware_optimizer", "optimizer_cpu_offload", "optimizer_cuda_graph",
                "overlap_param_gather_with_optimizer_step")


def _megatron():
    try:
        import megatron.core.optimizer as mopt
        from megatron.core import parallel_state
        from megatron.core.process_groups_config import ProcessGroupCollection
    except ImportError as e:
        raise ImportError(
            f"tpamp.megatron needs megatron-core ({e}); install it with "
            "`pip install megatron-core` (>= 0.17 on Python 3.11: --ignore-requires-python)"
        ) from e
    return mopt, parallel_state, ProcessGroupCollection


def get_megatron_optimizer(
    config,
    model_chunks,
    config_overrides=None,
    use_gloo_process_groups: bool = True,
    pg_collection=None,
    dump_param_to_param_group_map: Optional[str] = None,
    *,
    deterministic_grad_norm: Optional[bool] = None,
) -> "MegatronOptimizer":
    """megatron-core's ``get_megatron_optimizer`` (megatron/core/optimizer/__init__.py, same
    signature) returning a tpamp :class:`MegatronOptimizer` (module docstring: what is read,
    what raises). ``model_chunks``: a list of megatron-core modules (DDP-wrapped or not);
    megatron-core's parallel_state must be initialized unless ``pg_collection`` is given.

    deterministic_grad_norm (tpamp's, keyword only): the bitwise layout-independent grad norm
    of :class:`tpamp.MixedPrecisionOptimizer` (docs/spec.md section 23), also for
    :meth:`MegatronOptimizer.get_grad_norm` / ``clip_grad_norm`` before a step. None
    (default): on when a chunk's TransformerConfig has ``deterministic_mode=True``
    (Megatron-LM's ``--deterministic-mode``). TypeError for another type."""
    mopt, mpu, PGC = _megatron()
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    if not chunks:
        raise ValueError("model_chunks is empty: give the model chunks to optimize")
    if config.optimizer not in ("adam", "sgd"):
        raise ValueError(f"OptimizerConfig.optimizer={config.optimizer!r}: tpamp.megatron "
                         "builds 'adam' and 'sgd' (megatron-core's standard optimizers)")
    for name in _UNSUPPORTED:
        if getattr(config, name, False):
            raise ValueError(f"OptimizerConfig.{name}=True is not supported by tpamp.megatron "
                             "(use megatron-core's own optimizer for it)")
    if dump_param_to_param_group_map is not None:
        raise ValueError("dump_param_to_param_group_map is not supported by tpamp.megatron")
    if deterministic_grad_norm is None:
        deterministic_grad_norm = any(
            bool(getattr(getattr(c, "config", None), "deterministic_mode", False))
            for c in chunks)
    elif not isinstance(deterministic_grad_norm, bool):
        raise TypeError(f"deterministic_grad_norm must be a bool or None, got "
                        f"{deterministic_grad_norm!r} ({type(deterministic_grad_norm).__name__})")
    ddp = _ddp_config(chunks, config)
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if p.requires_grad and not getattr(p, "allreduce", True):
                raise ValueError(f"param {name!r} is an expert param (allreduce=False): "
                                 "tpamp.megatron does not build expert-parallel optimizers yet")
    if config_overrides is None:
        config_overrides = mopt.get_standard_config_overrides(config)
    groups = PGC.setup_process_groups_for_optimizer(pg_collection, chunks, use_gloo_process_groups)
    tp_group = getattr(pg_collection, "tp", None) if pg_collection is not None else None
    if tp_group is None:
        tp_group = mpu.get_tensor_model_parallel_group()
    param_groups = _param_groups(chunks, config, config_overrides)
    names = _param_names(chunks)
    scaler = None
    if config.loss_scale:
        scaler = ConstantGradScaler(config.loss_scale)
    elif config.fp16:
        scaler = DynamicGradScaler(
            initial_scale=config.initial_loss_scale, min_scale=config.min_loss_scale,
            growth_factor=2.0, backoff_factor=0.5, growth_interval=config.loss_scale_window,
            hysteresis=config.hysteresis)
    distributed = bool(config.use_distributed_optimizer)
    if distributed:
        grad_stats_group = groups["intra_dist_opt_group"]
        pieces = _buffer_pieces(chunks)
        inner_groups, core_names = [], {}
        for g in param_groups:
            ps = []
            for p in g["params"]:
                for piece in pieces.get(id(p), ()):
                    ps.append(piece.tensor)
                    core_names[piece.tensor] = f"{names[id(p)]}[{piece.start}:{piece.end}]"
            inner_groups.append({**g, "params": ps})
    else:
        grad_stats_group = groups["mp_group"]
        pieces = {}
        inner_groups = param_groups
        core_names = {p: names[id(p)] for g in param_groups for p in g["params"]}
    # (model param, the core's model tensor) in inner-optimizer order, taken before the core
    # puts its fp32 main params into these groups
    owner = {id(pc.tensor): pc.param for ps in pieces.values() for pc in ps}
    order = [(owner.get(id(t), t), t) for g in inner_groups for t in g["params"]]
    inner = _inner_optimizer(config, inner_groups)
    kw = dict(clip_grad=config.clip_grad, log_num_zeros_in_grad=config.log_num_zeros_in_grad,
              grad_stats_group=grad_stats_group, tensor_parallel_group=tp_group,
              param_names=core_names, deterministic_grad_norm=deterministic_grad_norm)
    if config.fp16 or config.bf16 or distributed:
        core = MixedPrecisionOptimizer(inner, grad_scaler=scaler, **kw)
    else:
        core = FP32Optimizer(inner, **kw)
    return MegatronOptimizer(core, config, chunks, ddp_config=ddp, pieces=pieces, order=order,
                             names=names)


def _param_groups(chunks, config, overrides) -> List[dict]:
    """megatron-core's param groups (megatron/core/optimizer/__init__.py, _get_param_groups,
    with its public helpers): params keyed by their merged overrides, the keys gathered over
    all ranks (dist-checkpointing needs the same groups everywhere), sorted with the default
    group first; each group carries wd_mult, lr_mult, is_decoupled_lr, max_lr, min_lr,
    default_config, is_expert_parallel and the override's own keys."""
    from megatron.core.optimizer_param_scheduler import (
        combine_param_group_overrides,
        param_group_override_to_tuple,
    )

    params_map: Dict[tuple, list] = {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if not param.requires_grad:
                continue
            matched = [o for k, o in (overrides or {}).items() if k.matches(param, name)]
            override = combine_param_group_overrides(matched) if matched else None
            key = (param_group_override_to_tuple(override), not getattr(param, "allreduce", True))
            params_map.setdefault(key, []).append(param)
    keys = list(params_map)
    if dist.is_initialized():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, keys)
        for ks in gathered:
            keys += [k for k in ks if k not in keys]
    groups = []
    for key in sorted(keys, key=lambda x: (x[0] is not None, x[0])):
        override_tuple, expert = key
        override = dict(override_tuple) if override_tuple else {}
        groups.append({
            "params": params_map.get(key, []), "is_expert_parallel": expert,
            # training.py logs the lr of a group that keeps the default schedule
            "default_config": not override or not any("lr" in k for k in override),
            "wd_mult": 1.0, "lr_mult": 1.0, "is_decoupled_lr": False,
            "max_lr": config.lr, "min_lr": config.min_lr, **override,
        })
    return groups


def _ddp_config(chunks, config):
    """The chunks' common DistributedDataParallelConfig (None without megatron's DDP), checked
    against the OptimizerConfig."""
    cfgs = [getattr(c, "ddp_config", None) for c in chunks]
    if any((c is None) != (cfgs[0] is None) for c in cfgs):
        raise ValueError("some model chunks are wrapped in megatron's DistributedDataParallel "
                         "and some are not: wrap all or none")
    ddp = cfgs[0]
    if ddp is None:
        if config.use_distributed_optimizer:
            raise ValueError("OptimizerConfig.use_distributed_optimizer=True needs the chunks "
                             "wrapped in megatron-core's DistributedDataParallel with "
                             "DistributedDataParallelConfig(use_distributed_optimizer=True) "
                             "(its buffers hold the sharded grads and params)")
        return None
    for i, c in enumerate(cfgs):
        if c != ddp:
            raise ValueError(f"model chunk {i}'s DistributedDataParallelConfig differs from "
                             f"chunk 0's: {c} vs {ddp}")
    if bool(ddp.use_distributed_optimizer) != bool(config.use_distributed_optimizer):
        raise ValueError(
            f"DistributedDataParallelConfig.use_distributed_optimizer="
            f"{ddp.use_distributed_optimizer} but OptimizerConfig.use_distributed_optimizer="
            f"{config.use_distributed_optimizer}: they must agree (the DDP reduce-scatters "
            "for the distributed optimizer, all-reduces otherwise)")
    if getattr(ddp, "use_megatron_fsdp", False):
        raise ValueError("DistributedDataParallelConfig.use_megatron_fsdp=True is not supported "
                         "by tpamp.megatron (use tpamp.fsdp for FSDP2)")
    if ddp.use_distributed_optimizer and getattr(ddp, "overlap_param_gather", False):
        raise ValueError("DistributedDataParallelConfig.overlap_param_gather=True is not "
                         "supported by tpamp.megatron: the params are all-gathered after step()")
    if getattr(ddp, "num_distributed_optimizer_instances", 1) != 1:
        raise ValueError(f"DistributedDataParallelConfig.num_distributed_optimizer_instances="
                         f"{ddp.num_distributed_optimizer_instances}: tpamp.megatron supports 1")
    return ddp


def _param_names(chunks) -> Dict[int, str]:
    """id(param) -> its name (``chunk<i>.`` in front with several chunks)."""
    out = {}
    for i, chunk in enumerate(chunks):
        prefix = f"chunk{i}." if len(chunks) > 1 else ""
        for name, p in chunk.named_parameters():
            out.setdefault(id(p), prefix + name)
    return out


def _inner_optimizer(config, groups) -> torch.optim.Optimizer:
    """The torch optimizer megatron-core builds without Apex / Transformer Engine."""
    if config.optimizer == "adam":
        cls = torch.optim.AdamW if config.decoupled_weight_decay else torch.optim.Adam
        return cls(groups, lr=config.lr, weight_decay=config.weight_decay,
                   betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps)
    return torch.optim.SGD(groups, lr=config.lr, weight_decay=config.weight_decay,
                           momentum=config.sgd_momentum)


class _Piece:
    """This DP rank's part of one model param in megatron's buffers: ``tensor`` (a leaf
    sharing storage with the bucket's param buffer, its ``main_grad`` the same range of the
    grad buffer) holds elements [start, end) of the flattened param."""

    __slots__ = ("param", "tensor", "start", "end", "group", "bucket", "shard")

    def __init__(self, param, tensor, start, end, group, bucket, shard):
        self.param, self.tensor, self.start, self.end = param, tensor, start, end
        self.group, self.bucket, self.shard = group, bucket, shard


def _buffer_pieces(chunks) -> Dict[int, List[_Piece]]:
    """id(model param) -> its pieces in this DP rank's shards of megatron's buffers (the ranges
    megatron-core's DistributedOptimizer owns: _build_model_gbuf_range)."""
    out: Dict[int, List[_Piece]] = {}
    for chunk in chunks:
        for buf in list(getattr(chunk, "buffers", [])) + list(
                getattr(chunk, "expert_parallel_buffers", [])):
            group = buf.data_parallel_group
            d, r = group.size(), group.rank()
            for bucket in buf.buckets:
                if bucket.param_data is None:
                    raise ValueError("megatron's DDP made no param buffer for a bucket "
                                     "(use_distributed_optimizer=True makes one)")
                n = bucket.grad_data.numel()
                size = n // d
                lo, hi = r * size, (r + 1) * size
                for p in bucket.params_list:
                    start, end = bucket.param_to_index[p]
                    a, b = max(start, lo), min(end, hi)
                    if a >= b:
                        continue
                    with torch.no_grad():
                        t = torch.nn.Parameter(bucket.param_data[a:b], requires_grad=True)
                    t.main_grad = bucket.grad_data[a:b]
                    for attr in _ATTRS:
                        if hasattr(p, attr):
                            setattr(t, attr, getattr(p, attr))
                    if getattr(p, "tensor_model_parallel", False):
                        for attr, value in _PIECE_TP_ATTRS.items():
                            setattr(t, attr, value)
                    out.setdefault(id(p), []).append(
                        _Piece(p, t, a - start, b - start, group, bucket, (lo, hi)))
    return out


class MegatronOptimizer:
    """The optimizer :func:`get_megatron_optimizer` returns: a tpamp core optimizer
    (``tpamp_optimizer``: :class:`tpamp.MixedPrecisionOptimizer` or :class:`tpamp.FP32Optimizer`)
    behind megatron-core's MegatronOptimizer interface, as Megatron-LM's training loop calls it.

    Attributes: ``config`` (the OptimizerConfig), ``model_chunks``, ``ddp_config``,
    ``is_stub_optimizer`` (False), ``optimizer`` (the inner torch optimizer over the fp32 main
    params), ``param_groups``, ``state``.
    """

    is_stub_optimizer = False

    def __init__(self, core, config, model_chunks, *, ddp_config, pieces, order, names):
        self.tpamp_optimizer = core
        self.config = config
        self.model_chunks = list(model_chunks)
        self.ddp_config = ddp_config
        self.distributed = bool(config.use_distributed_optimizer)
        self._pieces = pieces
        self._names = names
        self._order: List[Tuple[Tensor, Tensor]] = order  # (model param, core model tensor)
        self._last = None  # the StepResult of the step prepare_grads ran
        self._home = None

    # -- what training.py reads ----------------------------------------------------------

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.tpamp_optimizer.optimizer

    @property
    def param_groups(self) -> List[dict]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def chained_optimizers(self) -> list:
        """[self]: megatron-core returns a ChainedOptimizer; code that walks its parts works."""
        return [self]

    def get_parameters(self) -> List[Tensor]:
        """The params the inner optimizer steps (fp32 main params; with the distributed
        optimizer this rank's shard pieces), in param-group order (Megatron's get_parameters)."""
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def get_grad_stats_parallel_group(self):
        """The group over which found_inf, the grad norm and zeros are reduced."""
        return self.tpamp_optimizer.grad_stats_group

    def get_loss_scale(self) -> Tensor:
        """The loss scale, float32 [1] (1.0 without a scaler)."""
        return self.tpamp_optimizer.get_loss_scale()

    def scale_loss(self, loss: Tensor) -> Tensor:
        """loss x loss scale (Megatron's ``config.grad_scale_func``)."""
        return self.tpamp_optimizer.scale_loss(loss)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the main params' and model params' ``.grad`` (``main_grad`` buffers are the
        DDP's: Megatron-LM zeroes them with ``model_chunk.zero_grad_buffer()``)."""
        self.tpamp_optimizer.zero_grad(set_to_none)
        self._last = None

    def reload_model_params(self, state_dict=None) -> None:
        """Copy the model params into the fp32 main params (after the model was loaded)."""
        self.tpamp_optimizer.reload_model_params()

    # -- the step ----------------------------------------------------------------------

    @torch.no_grad()
    def step(self):
        """tpamp's step over the reduced grads (docs/spec.md section 2): unscale, found_inf
        agreed over the grad-stats group, scaler update, skip, norm, clip by
        ``config.clip_grad``, update; with the distributed optimizer then megatron's param
        all-gather. Returns (update_successful, grad_norm float or None, num_zeros int or
        None), as megatron-core's step does."""
        self.prepare_grads()
        ok = self.step_with_ready_grads()
        res = self._last
        return ok, res.grad_norm, res.num_zeros_in_grad

    def prepare_grads(self) -> bool:
        """Megatron's first half of step(); returns found_inf (True: the step is skipped).
        tpamp's step is one pass, so this runs all of it (the params change here); then
        :meth:`step_with_ready_grads` finishes it (param all-gather) and
        :meth:`get_grad_norm` / :meth:`count_zeros` report its values."""
        self._last = self.tpamp_optimizer.step()
        return not bool(self._last.update_successful)

    def step_with_ready_grads(self) -> bool:
        """Megatron's second half of step(): with the distributed optimizer the all-gather of
        the updated params (megatron's ``start_param_sync``); returns update_successful.
        Raises RuntimeError without :meth:`prepare_grads` first."""
        if self._last is None:
            raise RuntimeError("step_with_ready_grads() needs prepare_grads() first (or call "
                               "step())")
        ok = bool(self._last.update_successful)
        if ok and self.distributed:
            for chunk in self.model_chunks:
                chunk.start_param_sync()
        return ok

    # -- grad statistics outside step() ------------------------------------------------

    def get_main_grads_for_grad_norm(self) -> List[Tensor]:
        """The gradients the norm counts, as the step reads them (``main_grad`` buffers,
        loss-scaled; with the distributed optimizer this rank's reduced shard): shared
        params and TP duplicates on TP ranks > 0 left out (Megatron's filter)."""
        core = self.tpamp_optimizer
        tp_rank = dist.get_rank(core.tensor_parallel_group) \
            if core.tensor_parallel_group is not None else 0
        out = []
        for model, t in self._order:
            src = self._core_model(model, t)
            g = getattr(src, "main_grad", None)
            if g is None:
                g = src.grad
            if g is not None and counts_toward_norm(src, tp_rank, core.tensor_parallel_group):
                out.append(g)
        return out

    def _core_model(self, model, t):
        return t if self.distributed else model

    def get_grad_norm(self) -> float:
        """The last step's grad norm after :meth:`prepare_grads`; before it, the 2-norm of
        :meth:`get_main_grads_for_grad_norm` / loss scale, reduced over the grad-stats group
        (float; the square root taken in float64, as Megatron does)."""
        if self._last is not None:
            return self._last.grad_norm
        return self._norm_now()

    def _norm_now(self) -> float:
        grads = self.get_main_grads_for_grad_norm()
        dev = self.get_loss_scale().device
        group = self.get_grad_stats_parallel_group()
        scale = float(self.get_loss_scale().item())
        if self.tpamp_optimizer.deterministic_grad_norm:  # exact digits (tpamp.exact_sum)
            digits = exact_sum.sumsq_digits([g.detach() for g in grads], device=dev)
            if group is not None:
                dist.all_reduce(digits, group=group)  # float64 SUM of integers: exact
            return math.sqrt(exact_sum.digits_to_double(digits).item()) / scale
        total = torch.zeros(1, dtype=torch.float64, device=dev)
        for g in grads:
            total += g.detach().double().pow(2).sum()
        if group is not None:
            dist.all_reduce(total, group=group)
        return math.sqrt(total.item()) / scale

    def clip_grad_norm(self, clip_grad: float) -> float:
        """Megatron's clip_grad_norm: after :meth:`prepare_grads` the step already clipped by
        ``config.clip_grad`` and this returns its norm; before it, the norm of the current
        grads, and the ``main_grad`` buffers are multiplied by clip_grad / (norm + 1e-6) when
        that is < 1 (coefficient in float64, as Megatron computes it)."""
        if self._last is not None:
            return self._last.grad_norm
        norm = self._norm_now()
        coeff = clip_grad / (norm + 1.0e-6)
        if clip_grad > 0.0 and math.isfinite(norm) and coeff < 1.0:
            for model, t in self._order:
                src = self._core_model(model, t)
                g = getattr(src, "main_grad", None)
                if g is None:
                    g = src.grad
                if g is not None:
                    g.mul_(coeff)
        return norm

    def count_zeros(self) -> int:
        """The last step's zero count after :meth:`prepare_grads` (None unless
        ``log_num_zeros_in_grad``); before it, the zeros of the counted grads over the
        grad-stats group."""
        if self._last is not None:
            return self._last.num_zeros_in_grad
        grads = self.get_main_grads_for_grad_norm()
        dev = self.get_loss_scale().device
        total = torch.zeros(1, dtype=torch.float64, device=dev)
        for g in grads:
            total += (g == 0).sum()
        group = self.get_grad_stats_parallel_group()
        if group is not None:
            dist.all_reduce(total, group=group)
        return int(total.item())

    # -- memory (Megatron's RL offload) ------------------------------------------------

    def offload_to_cpu(self) -> None:
        """Move the main params and the optimizer state to host memory in place (the same
        tensor objects; ``.data`` moves), as megatron-core's offload_to_cpu does."""
        for t in self._state_tensors():
            if self._home is None:
                self._home = t.device
            t.data = t.data.cpu()

    def restore_from_cpu(self) -> None:
        """Undo :meth:`offload_to_cpu` (back to the device they were on)."""
        if self._home is None:
            return
        for t in self._state_tensors():
            t.data = t.data.to(self._home)

    def _state_tensors(self):
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                yield p
                for v in self.optimizer.state.get(p, {}).values():
                    if isinstance(v, Tensor) and v.dim() > 0:
                        yield v

    # -- checkpoints ---------------------------------------------------------------------
    # One model-space format for both layouts: per trained param, its fp32 main value and
    # optimizer state in the param's own (TP-local) shape; the distributed optimizer's pieces
    # are gathered over DP first (as megatron-core's "fully_reshardable" format), so a
    # checkpoint loads at another DP size or into the other layout.

    def state_dict(self) -> dict:
        """Without the distributed optimizer the tpamp core's state dict (inner optimizer,
        loss scaler, fp32 main params: Megatron's Float16Optimizer keys); with it, the
        DP-rank-independent part only (param groups' hyperparameters, loss scaler): the param
        state goes through :meth:`save_parameter_state` or :meth:`sharded_state_dict`, as
        with megatron-core's DistributedOptimizer."""
        core = self.tpamp_optimizer
        if not self.distributed:
            return core.state_dict()
        return {"param_groups": self._hyper(),
                "grad_scaler": core.grad_scaler.state_dict() if core.grad_scaler else None}

    def _hyper(self) -> List[dict]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]

    def load_state_dict(self, state_dict: dict) -> None:
        """Load what :meth:`state_dict` gave, or what dist-checkpointing read back for
        :meth:`sharded_state_dict`. All or nothing (the tpamp core's load checks every value
        before anything changes): TypeError / KeyError / ValueError naming the bad entry."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        if FORMAT_KEY in state_dict:
            self._load_model_space(state_dict, self._keys_for("load_state_dict"))
            return
        core = self.tpamp_optimizer
        if not self.distributed:
            core.load_state_dict(state_dict)
            return
        for key in ("param_groups", "grad_scaler"):
            if key not in state_dict:
                raise KeyError(f"state_dict[{key!r}] is missing (the distributed optimizer's "
                               "state_dict() format)")
        base = core.state_dict()
        self._set_hyper(base, state_dict["param_groups"])
        base["grad_scaler"] = state_dict["grad_scaler"]
        core.load_state_dict(base)

    def _state_keys(self) -> List[str]:
        """The param-shaped state keys of the inner optimizer (the same on every rank)."""
        inner = self.optimizer
        if isinstance(inner, torch.optim.SGD):
            return ["momentum_buffer"] if any(g["momentum"] for g in inner.param_groups) else []
        keys = ["exp_avg", "exp_avg_sq"]
        if any(g.get("amsgrad") for g in inner.param_groups):
            keys.append("max_exp_avg_sq")
        return keys

    def _common_step(self) -> float:
        """The inner optimizer's step count (the same for every param: all step together),
        agreed over all ranks (a rank may hold no state)."""
        step = 0.0
        for st in self.optimizer.state.values():
            if "step" in st:
                step = float(st["step"])
                break
        if dist.is_initialized():
            t = torch.tensor([step], dtype=torch.float64, device=self.get_loss_scale().device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            step = float(t.item())
        return step

    def _model_space(self, zeros: bool = False) -> List[Tuple[Tensor, Dict[str, Tensor]]]:
        """[(model param, {"fp32_param" (half params only), state key: float32 tensor in the
        param's local shape})] for every trained param; ``zeros``: new zero tensors (a load
        target, no communication). The distributed optimizer's pieces are gathered over each
        buffer's DP group (one all-reduce per group)."""
        inner = self.optimizer
        keys = self._state_keys()
        mains = [p for g in inner.param_groups for p in g["params"]]
        dev = self.get_loss_scale().device

        def fresh(p):
            d = {k: torch.zeros(p.shape, dtype=torch.float32, device=dev) for k in keys}
            if p.dtype in _HALF:
                d["fp32_param"] = torch.zeros(p.shape, dtype=torch.float32, device=dev)
            return d

        if zeros:
            return [(model, fresh(model)) for model in self._trained_params()]
        if not self.distributed:
            out = []
            for (model, t), m in zip(self._order, mains):
                st = inner.state.get(m, {})
                vals = {k: st[k].detach() if k in st else torch.zeros_like(m) for k in keys}
                if model.dtype in _HALF:
                    vals["fp32_param"] = m.detach()
                out.append((model, vals))
            return out
        main_of = {id(t): m for (_, t), m in zip(self._order, mains)}
        piece_of = {id(pc.param): pc for ps in self._pieces.values() for pc in ps}
        rows = ["fp32_param"] + keys
        by_group: Dict[object, list] = {}
        for chunk in self.model_chunks:
            for buf in chunk.buffers:
                for bucket in buf.buckets:
                    by_group.setdefault(buf.data_parallel_group, []).extend(bucket.params_list)
        values = {}
        for group, params in by_group.items():
            flat = torch.zeros(len(rows), sum(p.numel() for p in params), dtype=torch.float32,
                               device=dev)
            off = 0
            for p in params:
                pc = piece_of.get(id(p))
                if pc is not None:
                    m = main_of[id(pc.tensor)]
                    st = inner.state.get(m, {})
                    sl = slice(off + pc.start, off + pc.end)
                    flat[0, sl] = m.detach().float()
                    for j, k in enumerate(keys):
                        if k in st:
                            flat[1 + j, sl] = st[k].detach()
                off += p.numel()
            dist.all_reduce(flat, group=group)
            off = 0
            for p in params:
                vals = {k: flat[i, off:off + p.numel()].view(p.shape) for i, k in enumerate(rows)}
                if p.dtype not in _HALF:
                    del vals["fp32_param"]
                values[id(p)] = vals
                off += p.numel()
        return [(model, values[id(model)]) for model in self._trained_params()]

    def _trained_params(self) -> List[Tensor]:
        """Every model param this optimizer trains: with the distributed optimizer every param
        in megatron's buffers (also those whose whole range another DP rank owns: all DP ranks
        gather them, and DP rank 0 writes them as the main replica)."""
        if not self.distributed:
            return [model for model, _ in self._order]
        return [p for chunk in self.model_chunks for buf in chunk.buffers
                for bucket in buf.buckets for p in bucket.params_list]

    def _load_model_space(self, saved: dict, key_of: Dict[int, str]) -> None:
        """Load {FORMAT_KEY, "param_groups", "grad_scaler", "step", "param_state": {key:
        {name: tensor}}} through the core's all-or-nothing load (every entry checked first)."""
        for k in ("param_groups", "grad_scaler", "step", "param_state"):
            if k not in saved:
                raise KeyError(f"the optimizer checkpoint has no {k!r} entry")
        states = saved["param_state"]
        keys = self._state_keys()
        core = self.tpamp_optimizer
        base = core.state_dict()
        new_state, half_mains = {}, [[] for _ in self.optimizer.param_groups]
        index = 0
        step = torch.tensor(float(saved["step"]), dtype=torch.float32)
        for gi, g in enumerate(self.optimizer.param_groups):
            for _ in g["params"]:
                model, t = self._order[index]
                name = key_of[id(model)]
                entry = states.get(name)
                need = keys + (["fp32_param"] if model.dtype in _HALF else [])
                if not isinstance(entry, dict) or any(k not in entry for k in need):
                    raise KeyError(f"the optimizer checkpoint lacks {need} of param {name!r}")
                for k in need:
                    v = entry[k]
                    if not isinstance(v, Tensor) or tuple(v.shape) != tuple(model.shape):
                        raise ValueError(
                            f"the optimizer checkpoint's {k} of param {name!r} has shape "
                            f"{tuple(getattr(v, 'shape', ()))}, expected {tuple(model.shape)}")
                piece = self._piece_range(model, t)
                vals = {k: self._local(entry[k], piece) for k in need}
                if model.dtype in _HALF:
                    half_mains[gi].append(vals.pop("fp32_param"))
                if keys and float(saved["step"]) > 0:
                    new_state[index] = {"step": step.clone(), **vals}
                index += 1
        base["optimizer"]["state"] = new_state
        self._set_hyper(base, saved["param_groups"])
        base["grad_scaler"] = saved["grad_scaler"]
        base["fp32_from_fp16_params"] = half_mains
        core.load_state_dict(base)
        if self.distributed:  # every DP rank's params from the loaded main params
            for chunk in self.model_chunks:
                chunk.start_param_sync(force_sync=True)

    def _piece_range(self, model, t) -> Optional[Tuple[int, int]]:
        if not self.distributed:
            return None
        for pc in self._pieces.get(id(model), ()):
            if pc.tensor is t:
                return pc.start, pc.end
        return None

    @staticmethod
    def _local(v: Tensor, piece) -> Tensor:
        v = v.detach().float()
        return v if piece is None else v.reshape(-1)[piece[0]:piece[1]].clone()

    def _set_hyper(self, base: dict, saved_groups) -> None:
        live = base["optimizer"]["param_groups"]
        if not isinstance(saved_groups, (list, tuple)) or len(saved_groups) != len(live):
            raise ValueError(
                f"the checkpoint has {len(saved_groups) if isinstance(saved_groups, (list, tuple)) else saved_groups!r} "
                f"param groups, this optimizer {len(live)} (megatron-core's grouping of the "
                "same model and config_overrides gives the same groups)")
        base["optimizer"]["param_groups"] = [
            {**g, **{k: v for k, v in s.items() if k != "params"}} for g, s in zip(live, saved_groups)]

    def _keys_for(self, what: str) -> Dict[int, str]:
        keys = getattr(self, "_ckpt_keys", None)
        if keys is None:
            raise RuntimeError(f"{what}: call sharded_state_dict(model_sharded_state_dict, "
                               "is_loading=True) first (it names the params)")
        return keys

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False,
                           metadata=None, **_unused) -> dict:
        """Megatron dist-checkpointing's optimizer state, for
        ``dist_checkpointing.save({"optimizer": opt.sharded_state_dict(model_sd), ...})``: every
        trained param's fp32 main value and optimizer state as ShardedTensors made from the
        param's own ShardedTensor in ``model_sharded_state_dict`` (keys
        ``optimizer.state.<state key>.<param key>``, megatron's make_sharded_optimizer_tensor;
        with the distributed optimizer the whole param, gathered over DP, so a checkpoint loads
        at another DP size and into either layout: megatron's "fully_reshardable" idea; any
        ``metadata`` sharding type is ignored), and as common state the step count, the param
        groups' hyperparameters and the loss scaler's state. ``is_loading``: zero tensors of
        the same shapes, no communication. Give what dist-checkpointing loads back to
        :meth:`load_state_dict`. Raises ValueError naming the param for a trained param that
        is not in ``model_sharded_state_dict``."""
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
        from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

        by_id = {}
        for v in nested_values(model_sharded_state_dict):
            if isinstance(v, (ShardedTensor, ShardedTensorFactory)):
                by_id.setdefault(id(v.data), v)
        sharded, keys = {}, {}
        for model, vals in self._model_space(zeros=is_loading):
            sh = by_id.get(id(model))
            if sh is None:
                raise ValueError(
                    f"param {self._names.get(id(model), '?')!r} (shape {tuple(model.shape)}) is "
                    "trained by this optimizer but not in model_sharded_state_dict: pass "
                    "model.sharded_state_dict() of every model chunk")
            name = self._names[id(model)]  # unique here (a ShardedTensor key may repeat:
            keys[id(model)] = name  # megatron stacks the layers' params under one key)
            sharded[name] = {k: make_sharded_optimizer_tensor(sh, v, f"optimizer.state.{k}")
                             for k, v in vals.items()}
        self._ckpt_keys = keys
        core = self.tpamp_optimizer
        return {FORMAT_KEY: 1, "param_state": sharded, "param_groups": self._hyper(),
                "step": self._common_step() if not is_loading else 0.0,
                "grad_scaler": core.grad_scaler.state_dict() if core.grad_scaler else None}

    def save_parameter_state(self, filename: str) -> None:
        """The distributed optimizer's param state (fp32 main value and optimizer state of
        every trained param, gathered over DP) and its common state, written by DP rank 0 to
        ``filename`` (torch.save), as megatron-core's save_parameter_state; every DP rank
        calls it. Keyed by param name (the same at every DP rank of one TP / PP position)."""
        state = self._file_state()
        group = self._dp_group()
        if group is None or dist.get_rank(group) == 0:
            torch.save(state, filename)

    def _file_state(self) -> dict:
        core = self.tpamp_optimizer
        return {FORMAT_KEY: 1, "param_state": {self._names[id(m)]: {k: v.clone() for k, v in
                                                                   vals.items()}
                                               for m, vals in self._model_space()},
                "param_groups": self._hyper(), "step": self._common_step(),
                "grad_scaler": core.grad_scaler.state_dict() if core.grad_scaler else None}

    def _dp_group(self):
        for chunk in self.model_chunks:
            for buf in getattr(chunk, "buffers", []):
                return buf.data_parallel_group
        return None

    def load_parameter_state(self, filename: str, *, update_legacy_format: bool = False) -> None:
        """Load :meth:`save_parameter_state`'s file: every rank reads it and keeps its own
        range (all or nothing, as :meth:`load_state_dict`)."""
        saved = torch.load(filename, map_location="cpu", weights_only=True)
        if not isinstance(saved, dict) or FORMAT_KEY not in saved:
            raise ValueError(f"{filename} is not a tpamp.megatron parameter-state file")
        self._load_model_space(saved, dict(self._names))
