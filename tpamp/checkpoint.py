"""Layout-free checkpoints of the full mixed-precision state through torch.distributed.checkpoint.

tpamp's ``MixedPrecisionOptimizer.state_dict()`` is per rank and positional (Megatron-LM's
format): it resumes only on the same layout. :func:`save_checkpoint` / :func:`load_checkpoint`
write and read the same state with torch.distributed.checkpoint (DCP), keyed by the model's
*global* parameter names, each tensor in its *global* shape, so DCP reshards it: a checkpoint
written on one TP x PP x DP layout loads on another (SPEC.md section 7), and a checkpoint of a
4-rank run loads in one process. This is what Megatron-LM's dist_checkpointing and torchtitan's
DCP checkpointer do.

Usage (every rank of ``process_group`` calls both, collectively)::

    params = {global_name: param for ...}            # names do not depend on the PP stage
    tpamp.checkpoint.save_checkpoint(path, params, optimizer, extra={"iteration": it})
    extra = tpamp.checkpoint.load_checkpoint(path, params, optimizer, extra={"iteration": None})

What a checkpoint holds (flat DCP keys; ``{name}`` is a global parameter name):

=================================  ==========================================================
``model.{name}``                   the model param (fp16/bf16/fp32) in its global shape
``optimizer.main_params.{name}``   the fp32 main param of every param the optimizer updates
                                   (an fp16/bf16 param's fp32 copy, an fp32 param itself), so
                                   the masters do not depend on the run's precision
``optimizer.state.{name}.{key}``   the inner optimizer's state of that param (AdamW: exp_avg,
                                   exp_avg_sq in the param's global shape; step, 0-dim)
``optimizer.param_groups``         the hyperparameters of each param group (no ``params``)
``optimizer.grad_scaler.{key}``    the loss scaler's state_dict: scale (float32 [1]) and the
                                   growth/hysteresis trackers
``optimizer.spike_detector``       the optimizer's ``spike_detector`` state_dict (windows and
                                   spike counters), when it has one
``extra.{key}``                    the caller's values: iteration, data position, RNG state,
                                   skip counters ... (tensors, or objects stored as a 1-tuple
                                   ``(value,)``; the same on every rank, or keyed per rank)
=================================  ==========================================================

How a tensor gets its global shape (:func:`global_view`): a DTensor is saved as it is (DCP
writes each rank's shard at its offset); a Megatron-attribute param (``tensor_model_parallel``
True, ``partition_dim``, ``partition_stride`` 1) is wrapped as a DTensor ``Shard(partition_dim)``
over the TP group without copying; any other tensor is replicated (every rank holding it writes
the same key; DCP keeps one copy). A param marked ``shared=True`` (a tied copy such as the last
PP stage's output-embedding copy, SPEC section 3) is not written: its original, under the same
global name, is; it is read back from there.

Loading is all-or-nothing. First, without touching anything: the DCP metadata must exist, hold
every key this rank needs with the right global shape, and (checked over all ranks) hold
exactly this model's params; then everything is read into new buffers and checked again (main
params and model params finite, the scaler state accepted by a copy of the scaler). Only when
every rank found no fault is anything copied into the model, the main params, the optimizer
state, the scaler and returned to the caller; otherwise every rank raises
:class:`CheckpointError` naming the first faults. The new buffers double the state's memory
for the duration of the load.

Hook for other optimizers (e.g. a data-parallel-sharded ``tpamp.DistributedOptimizer``)
--------------------------------------------------------------------------------------------
:class:`tpamp.MixedPrecisionOptimizer` and :class:`tpamp.FP32Optimizer` are handled here. Any
other optimizer plugs in by exposing two methods; this module then does everything else
(keys, shared-param skipping, validation, the scaler, all-or-nothing loading)::

    def sharded_state_dict(self, model_params: Mapping[str, Tensor]) -> dict:
        '''model_params: {global name: model param}, as given to save/load_checkpoint.
        Returns {
          "main_params": {name: T},            # fp32 main params this rank holds (any part of)
          "state": {name: {key: T or object}}, # inner-optimizer state of those params
          "param_groups": [dict, ...],         # hyperparameters per group, without "params"
        }
        T is a Tensor, DTensor or ShardedTensor in the param's GLOBAL shape, sharing storage
        with the live buffers. A part of a param (a data-parallel rank's contiguous range of
        the flattened param, possibly a piece of a TP shard) is a ShardedTensor whose local
        shards are views of the flat buffer: flat_range_chunks() cuts a flat range into
        row-major boxes, sharded_tensor_from_chunks() builds the ShardedTensor (collective
        over a group that holds every piece of the param exactly once). State tensors shaped
        like the param must be sharded exactly like main_params[name]; others (AdamW's 0-dim
        step) are plain tensors, replicated. A param with no state yet has no "state" entry.'''

    def load_sharded_state_dict(self, state: dict) -> None:
        '''state: the same structure, read from the checkpoint into NEW buffers: main params
        and param-shaped state sharded like this rank's own sharded_state_dict() entries
        (built with torch.empty_like / the same ShardedTensor metadata), other state as
        saved. "state" holds exactly the checkpoint's state of each name in "main_params"
        (a name with no entry had no state when saved). Copy into the live buffers; every
        shape and key has already been checked, and the values are finite.'''

The loss scaler (``optimizer.grad_scaler``, None: none) and a spike detector
(``optimizer.spike_detector``, if any) are saved and loaded here, and so are the model params
from ``model_params`` (copied in before ``load_sharded_state_dict`` is called). Param-group
hyperparameters are restored by group index; the group counts must match.

Megatron-LM's iteration directories (``iter_0000100``) and ``latest_checkpointed_iteration.txt``
tracker: :func:`iteration_dir`, :func:`read_latest_iteration`, :func:`write_latest_iteration`.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import warnings
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from tpamp import state_formats

__all__ = [
    "CheckpointError",
    "save_checkpoint",
    "load_checkpoint",
    "global_view",
    "flat_range_chunks",
    "sharded_tensor_from_chunks",
    "iteration_dir",
    "read_latest_iteration",
    "write_latest_iteration",
]

Tensor = torch.Tensor

_MODEL = "model."
_MAIN = "optimizer.main_params."
_STATE = "optimizer.state."
_GROUPS = "optimizer.param_groups"
_SCALER = "optimizer.grad_scaler."
_SPIKES = "optimizer.spike_detector"
_EXTRA = "extra."
_MAX_LISTED = 8  # faults named in one CheckpointError


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this model/optimizer (missing or extra keys,
    wrong shapes, non-finite values, a scaler state the scaler refuses, an unreadable file).
    Raised on every rank; nothing was changed."""


# ----------------------------------------------------------------------------- global views


def _dtensor_cls():
    from torch.distributed.tensor import DTensor

    return DTensor


def _is_dtensor(t) -> bool:
    return isinstance(t, _dtensor_cls())


def _is_sharded_tensor(t) -> bool:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return isinstance(t, ShardedTensor)


def _local(t: Tensor) -> Tensor:
    return t.to_local() if _is_dtensor(t) else t


_MESHES: Dict[Tuple[int, str], Any] = {}


def _tp_mesh(group, device_type: str):
    """A 1-D DeviceMesh over ``group`` (no communication), cached per group."""
    from torch.distributed.device_mesh import DeviceMesh

    key = (id(group), device_type)
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh.from_group(group, device_type)
    return _MESHES[key]


def global_view(t: Tensor, tensor_parallel_group=None, *, name: str = "tensor"):
    """``t`` as DCP should see it: in the param's global shape, sharing ``t``'s storage.

    - a DTensor (or ShardedTensor) is returned as it is;
    - a Megatron-LM tensor-parallel param (attribute ``tensor_model_parallel=True``, with
      ``partition_dim`` and ``partition_stride`` 1) becomes a DTensor ``Shard(partition_dim)``
      over a 1-D mesh of ``tensor_parallel_group`` (even shards, TP rank order: Megatron's
      layout), global shape = local shape with ``partition_dim`` times the TP size;
    - any other tensor is returned detached: replicated, every holder writes the same key.

    Raises ValueError (naming ``name``) for a Megatron TP param without a
    ``tensor_parallel_group`` or with ``partition_stride`` != 1 (strided shards are not a box).
    """
    if _is_dtensor(t) or _is_sharded_tensor(t):
        return t.detach() if _is_dtensor(t) else t
    if not isinstance(t, Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
    # the Megatron attributes live on the Python object: read them before detaching
    is_tp = getattr(t, "tensor_model_parallel", False)
    stride = getattr(t, "partition_stride", 1)
    dim = getattr(t, "partition_dim", None)
    t = t.detach()
    if not is_tp:
        return t
    if stride != 1:
        raise ValueError(
            f"{name}: Megatron TP param with partition_stride={stride}; only 1 (one contiguous "
            "shard per TP rank) can be saved by global name"
        )
    if not isinstance(dim, int) or not 0 <= dim < t.dim():
        raise ValueError(
            f"{name}: Megatron TP param with partition_dim={dim!r} for shape {tuple(t.shape)}"
        )
    if tensor_parallel_group is None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError(
                f"{name} is a Megatron TP shard (tensor_model_parallel=True): pass "
                "tensor_parallel_group (or an optimizer that has one) so it is saved in its "
                "global shape"
            )
        return t  # one process: the shard is the whole tensor
    from torch.distributed.tensor import DTensor, Shard

    mesh = _tp_mesh(tensor_parallel_group, t.device.type)
    return DTensor.from_local(t, mesh, [Shard(dim)], run_check=False)


def _global_shape(view) -> Tuple[int, ...]:
    return tuple(view.size()) if _is_sharded_tensor(view) else tuple(view.shape)


def _empty_like(view, dtype: Optional[torch.dtype] = None):
    """New storage sharded exactly like ``view`` (Tensor, DTensor or ShardedTensor)."""
    if _is_sharded_tensor(view):
        from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

        md = copy.deepcopy(view.metadata())
        if dtype is not None:
            md.tensor_properties.dtype = dtype
        shards = [
            Shard(torch.empty_like(s.tensor, dtype=dtype), copy.deepcopy(s.metadata))
            for s in view.local_shards()
        ]
        # no communication: the global metadata is this rank's copy of view's
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, md, process_group=getattr(view, "_process_group", None)
        )
    return torch.empty_like(view.detach(), dtype=dtype)


def _local_parts(view) -> List[Tensor]:
    """The tensors this rank holds of ``view``."""
    if _is_sharded_tensor(view):
        return [s.tensor for s in view.local_shards()]
    return [_local(view)]


def _copy_into(dst, src) -> None:
    """Copy the local parts of ``src`` into those of ``dst`` (sharded alike)."""
    for d, s in zip(_local_parts(dst), _local_parts(src)):
        d.copy_(s)


# ----------------------------------------------------------------------------- flat ranges


def flat_range_chunks(shape: Sequence[int], start: int, end: int) -> List[Tuple[tuple, tuple, int]]:
    """Cut the flat range [start, end) of a row-major tensor of ``shape`` into boxes.

    Returns [(offsets, sizes, flat_offset)]: each box is ``sizes`` elements at ``offsets`` of
    the tensor, and is contiguous in memory from ``flat_offset`` (so
    ``flat[flat_offset:flat_offset + prod(sizes)].view(sizes)`` is it). At most 2 * ndim - 1
    boxes, in memory order. A data-parallel optimizer's contiguous range of a flattened param
    (Megatron-LM's DistributedOptimizer) saves as these boxes, see
    :func:`sharded_tensor_from_chunks`. Raises ValueError unless 0 <= start <= end <= numel.
    """
    shape = tuple(int(s) for s in shape)
    numel = math.prod(shape)
    if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= numel):
        raise ValueError(
            f"flat range [{start}, {end}) is not inside a tensor of {numel} elements {shape}"
        )
    return _boxes(shape, start, end)


def _boxes(shape, start, end):
    if start >= end:
        return []
    if not shape:
        return [((), (), 0)]
    inner = math.prod(shape[1:])
    first, last = start // inner, (end - 1) // inner
    s_in, e_in = start - first * inner, end - last * inner

    def row(r, a, b):
        return [((r, *o), (1, *s), r * inner + f) for o, s, f in _boxes(shape[1:], a, b)]

    if first == last and (s_in, e_in) != (0, inner):
        return row(first, s_in, e_in)
    out, tail, lo, hi = [], [], first, last + 1
    if s_in:
        out, lo = row(first, s_in, inner), first + 1
    if e_in != inner:
        tail, hi = row(last, 0, e_in), last
    if hi > lo:
        out.append(((lo,) + (0,) * (len(shape) - 1), (hi - lo, *shape[1:]), lo * inner))
    return out + tail


def sharded_tensor_from_chunks(
    pieces: Sequence[Tuple[Tensor, Sequence[int]]],
    global_shape: Sequence[int],
    process_group=None,
):
    """A ShardedTensor of global shape ``global_shape`` whose local shards are ``pieces``:
    (tensor, offsets) pairs, each tensor a box of the global tensor at ``offsets`` (views into
    a flat buffer keep sharing its storage). Collective: every rank of ``process_group``
    (default: the world) calls it, with its own pieces (possibly none); together they must
    cover the tensor exactly once (torch's ``init_from_local_shards`` checks, raising
    ValueError). Use :func:`flat_range_chunks` to cut a flat range into boxes.
    """
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    rank = dist.get_rank()  # placements name global ranks
    shards = [
        Shard(t, ShardMetadata(list(off), list(t.shape), f"rank:{rank}/{t.device}"))
        for t, off in pieces
    ]
    return init_from_local_shards(shards, *global_shape, process_group=process_group)


# ----------------------------------------------------------------------------- optimizers


class _MixedPrecisionHooks:
    """The hook of the module docstring for MixedPrecisionOptimizer / FP32Optimizer: every
    param the inner optimizer updates has a main param (the fp32 copy of an fp16/bf16 param,
    or the fp32 param itself), so ``optimizer.main_params`` holds the fp32 master of every
    param, whatever its precision in this run."""

    def __init__(self, optimizer, tensor_parallel_group):
        self.opt = optimizer
        self.tp_group = tensor_parallel_group

    def _mains(self, model_params: Mapping[str, Tensor]):
        """[(name, main param)] in param-group order."""
        names = {id(p): n for n, p in model_params.items()}
        out = []
        for pairs, fp32s in zip(self.opt._half_pairs, self.opt._fp32_params):
            for model, main in list(pairs) + [(p, p) for p in fp32s]:
                name = names.get(id(model))
                if name is None:
                    raise ValueError(
                        f"the optimizer updates a param of shape {tuple(model.shape)} that is not "
                        "in model_params: give every trained param a global name"
                    )
                out.append((name, main))
        return out

    def sharded_state_dict(self, model_params):
        mains, state = {}, {}
        remainders = getattr(self.opt, "_remainders", {})
        model_of = {id(main): model for pairs in self.opt._half_pairs for model, main in pairs}
        for name, main in self._mains(model_params):
            if id(main) in remainders:  # the fp32 master, rebuilt exactly (a new tensor)
                master = self.opt._master_value(main, model_of[id(main)])
                view = global_view(master, self.tp_group, name=name)
            else:
                view = global_view(main, self.tp_group, name=name)
            mains[name] = view
            st = self.opt.optimizer.state.get(main)
            if st:
                st = state_formats.layout_free_state(st)  # 8-bit moments as float32 values
                state[name] = {k: self._state_view(v, main, view) for k, v in st.items()}
        groups = [
            {k: v for k, v in g.items() if k != "params"} for g in self.opt.optimizer.param_groups
        ]
        return {"main_params": mains, "state": state, "param_groups": groups}

    @staticmethod
    def _state_view(v, main, view):
        if isinstance(v, Tensor) and not _is_dtensor(v) and view is not main and _is_dtensor(view) \
                and tuple(v.shape) == tuple(main.shape):
            from torch.distributed.tensor import DTensor

            return DTensor.from_local(v, view.device_mesh, view.placements, run_check=False)
        return v

    def load_sharded_state_dict(self, state, model_params):
        inner = self.opt.optimizer
        group_of = {}
        for g in inner.param_groups:
            for p in g["params"]:
                group_of[id(p)] = g
        remainders = getattr(self.opt, "_remainders", {})
        model_of = {id(main): model for pairs in self.opt._half_pairs for model, main in pairs}
        for name, main in self._mains(model_params):
            if name in state["main_params"]:
                with torch.no_grad():
                    saved = _local(state["main_params"][name])
                    rem = remainders.get(id(main))
                    if rem is None:
                        _local(main).copy_(saved)
                    else:  # exact: the fp32 master split into bf16 param + remainder
                        from tpamp import ops

                        hi, lo = ops.split_remainders(saved.to(rem.device))
                        _local(model_of[id(main)].detach()).copy_(hi)
                        rem.copy_(lo)
            old = inner.state.get(main, {})
            new = {}
            for k, v in state["state"].get(name, {}).items():
                if isinstance(v, Tensor):
                    if _is_dtensor(v) and not _is_dtensor(main):
                        v = v.to_local()
                    elif not _is_dtensor(v) and tuple(v.shape) != tuple(main.shape):
                        v = v.to(self._scalar_device(k, old, main, group_of.get(id(main), {})))
                new[k] = v
            if new:
                inner.state[main] = new
            else:
                inner.state.pop(main, None)
        for g, saved in zip(inner.param_groups, state["param_groups"]):
            g.update({k: v for k, v in saved.items() if k != "params"})
        with torch.no_grad():  # the model params are fp16/bf16 of the loaded main params
            from tpamp import ops

            mains, models = self.opt._pair_locals()
            if mains:
                ops.scale_and_copy(mains, models)
            if hasattr(self.opt, "_convert_state"):
                self.opt._convert_state()  # moments into this optimizer's configured dtypes

    @staticmethod
    def _scalar_device(key, old, main, group):
        """Where torch.optim keeps a non-param-shaped state tensor (AdamW's step: on the CPU
        unless capturable or fused)."""
        if key in old and isinstance(old[key], Tensor):
            return old[key].device
        if group.get("capturable") or group.get("fused"):
            return _local(main).device
        return torch.device("cpu")


def _optimizer_hooks(optimizer, tensor_parallel_group):
    if hasattr(optimizer, "sharded_state_dict") and hasattr(optimizer, "load_sharded_state_dict"):
        return _ExternalHooks(optimizer)
    from tpamp.optimizer import MixedPrecisionOptimizer

    if isinstance(optimizer, MixedPrecisionOptimizer):
        return _MixedPrecisionHooks(optimizer, tensor_parallel_group)
    raise TypeError(
        f"optimizer must be a tpamp MixedPrecisionOptimizer/FP32Optimizer or have "
        f"sharded_state_dict/load_sharded_state_dict methods; got {type(optimizer).__name__}"
    )


class _ExternalHooks:
    def __init__(self, optimizer):
        self.opt = optimizer

    def sharded_state_dict(self, model_params):
        sd = self.opt.sharded_state_dict(model_params)
        missing = {"main_params", "state", "param_groups"} - set(sd)
        if missing:
            raise TypeError(
                f"{type(self.opt).__name__}.sharded_state_dict() returned no {sorted(missing)}"
            )
        return sd

    def load_sharded_state_dict(self, state, model_params):
        self.opt.load_sharded_state_dict(state)


# ----------------------------------------------------------------------------- save


def _check_model_params(model_params) -> None:
    if not isinstance(model_params, Mapping):
        raise TypeError(
            f"model_params must be a mapping {{global name: param}}, got {type(model_params).__name__}"
        )
    for n, p in model_params.items():
        if not isinstance(n, str) or not n:
            raise ValueError(f"model_params: names must be non-empty strings, got {n!r}")
        if not isinstance(p, Tensor):
            raise TypeError(f"model_params[{n!r}] is a {type(p).__name__}, not a tensor")


def _tp_group_of(optimizer, tensor_parallel_group):
    if tensor_parallel_group is not None:
        return tensor_parallel_group
    return getattr(optimizer, "tensor_parallel_group", None)


def _shared_names(model_params) -> set:
    return {n for n, p in model_params.items() if getattr(p, "shared", False)}


def save_checkpoint(
    checkpoint_dir: str,
    model_params: Mapping[str, Tensor],
    optimizer=None,
    *,
    extra: Optional[Mapping[str, Any]] = None,
    tensor_parallel_group=None,
    process_group=None,
) -> None:
    """Write the model params, the optimizer's main params and state, its loss scaler and
    ``extra`` to ``checkpoint_dir`` with torch.distributed.checkpoint (keys: module docstring).

    Collective over ``process_group`` (default: the world; no process group: one process).

    Args:
        checkpoint_dir: a directory (created); DCP writes one file per rank and ``.metadata``.
        model_params: {global name: model param} of this rank, names that do not depend on the
            layout (e.g. ``blocks.7.attn.qkv.weight`` whatever PP stage holds block 7). Params
            marked ``shared=True`` are not written (their original is, under the same name).
        optimizer: a tpamp MixedPrecisionOptimizer / FP32Optimizer, an optimizer with the
            module docstring's hook, or None (model params only).
        extra: {key: value}: picklable objects or tensors, written as ``extra.{key}``. A key
            written by several ranks is kept once: give per-rank values per-rank keys.
        tensor_parallel_group: the TP group for Megatron-attribute params (default: the
            optimizer's ``tensor_parallel_group``).
        process_group: the ranks that save together.

    Raises TypeError/ValueError for bad arguments (before anything is written).
    """
    import torch.distributed.checkpoint as dcp

    _check_model_params(model_params)
    tp_group = _tp_group_of(optimizer, tensor_parallel_group)
    shared = _shared_names(model_params)
    sd: Dict[str, Any] = {}
    for n, p in model_params.items():
        if n not in shared:
            sd[_MODEL + n] = global_view(p, tp_group, name=n)
    if optimizer is not None:
        osd = _optimizer_hooks(optimizer, tp_group).sharded_state_dict(model_params)
        for n, t in osd["main_params"].items():
            if n not in shared:
                sd[_MAIN + n] = t
        for n, st in osd["state"].items():
            if n not in shared:
                for k, v in st.items():
                    sd[f"{_STATE}{n}.{k}"] = v
        sd[_GROUPS] = tuple(osd["param_groups"])  # a tuple: DCP keeps it one object
        scaler = getattr(optimizer, "grad_scaler", None)
        if scaler is not None:
            for k, v in scaler.state_dict().items():
                sd[_SCALER + k] = v
        detector = getattr(optimizer, "spike_detector", None)
        if detector is not None:  # the same on every rank: it judges all-reduced numbers
            sd[_SPIKES] = (detector.state_dict(),)
    for k, v in (extra or {}).items():
        # a non-tensor is wrapped in a 1-tuple, which DCP keeps whole (it would split a dict)
        sd[_EXTRA + k] = v if isinstance(v, Tensor) else (v,)
    os.makedirs(checkpoint_dir, exist_ok=True)
    with _single_process_quiet():
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(checkpoint_dir), process_group=process_group)


# ----------------------------------------------------------------------------- load


@contextlib.contextmanager
def _single_process_quiet():
    """Without a process group DCP warns that it assumes one process: that is meant here."""
    with warnings.catch_warnings():
        if not (dist.is_available() and dist.is_initialized()):
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _world(process_group) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(process_group)


def _gather(obj, process_group) -> list:
    """[obj of every rank of process_group] (just [obj] without a process group)."""
    if _world(process_group) == 1:
        return [obj]
    out = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(out, obj, group=process_group)
    return out


def _agree(problems: List[str], process_group, what: str) -> None:
    """Raise CheckpointError on every rank if any rank found a fault."""
    rank = dist.get_rank() if _world(process_group) > 1 else 0
    faults = [f"rank {r}: {msg}" for r, ps in _gather((rank, problems), process_group) for msg in ps]
    if faults:
        more = f" (and {len(faults) - _MAX_LISTED} more)" if len(faults) > _MAX_LISTED else ""
        raise CheckpointError(
            f"{what}; nothing was changed. " + "; ".join(faults[:_MAX_LISTED]) + more
        )


def _read_metadata(checkpoint_dir: str):
    import torch.distributed.checkpoint as dcp

    try:
        return dcp.FileSystemReader(checkpoint_dir).read_metadata(), None
    except Exception as e:  # noqa: BLE001 -- reported with its cause, on every rank
        return None, (
            f"no readable DCP checkpoint at {checkpoint_dir!r} (missing or incomplete "
            f".metadata: {type(e).__name__}: {e})"
        )


def _covered(md) -> bool:
    """The saved chunks add up to the whole tensor (a torn write would not)."""
    total = sum(math.prod(c.sizes) for c in md.chunks)
    return total == math.prod(md.size)


class _Plan:
    """The keys this rank reads, their new buffers, and the faults found on the way."""

    def __init__(self, metadata):
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        self.md = metadata.state_dict_metadata
        self.bytes_cls = BytesStorageMetadata
        self.targets: Dict[str, Any] = {}
        self.problems: List[str] = []

    def _entry(self, key):
        e = self.md.get(key)
        if e is None:
            self.problems.append(f"the checkpoint has no {key!r}")
        return e

    def tensor(self, key, view, dtype=None) -> None:
        """Read ``key`` into a new buffer sharded like ``view``."""
        e = self._entry(key)
        if e is None:
            return
        if isinstance(e, self.bytes_cls):
            self.problems.append(f"{key!r} is an object in the checkpoint, expected a tensor")
            return
        want = _global_shape(view)
        if tuple(e.size) != want:
            self.problems.append(
                f"{key!r} has shape {tuple(e.size)} in the checkpoint, expected {want}"
            )
            return
        if not _covered(e):
            self.problems.append(f"{key!r}: the saved chunks do not cover the tensor (incomplete)")
            return
        self.targets[key] = _empty_like(view, dtype)

    def saved(self, key, like=None) -> None:
        """Read ``key`` as saved: an object, or a tensor (sharded like ``like`` when it has
        like's global shape, else a plain full tensor of the saved dtype)."""
        e = self._entry(key)
        if e is None:
            return
        if isinstance(e, self.bytes_cls):
            self.targets[key] = None  # DCP puts the loaded object here
        elif not _covered(e):
            self.problems.append(f"{key!r}: the saved chunks do not cover the tensor (incomplete)")
        elif like is not None and tuple(e.size) == _global_shape(like):
            self.targets[key] = _empty_like(like, e.properties.dtype)
        else:
            self.targets[key] = torch.empty(tuple(e.size), dtype=e.properties.dtype)

    def under(self, prefix: str) -> List[str]:
        """Suffixes of the checkpoint's keys ``prefix + suffix`` that hold no further dot."""
        n = len(prefix)
        return sorted(k[n:] for k in self.md if k.startswith(prefix) and "." not in k[n:])


def _nonfinite(view) -> bool:
    return any(p.is_floating_point() and not bool(torch.isfinite(p).all()) for p in _local_parts(view))


def load_checkpoint(
    checkpoint_dir: str,
    model_params: Mapping[str, Tensor],
    optimizer=None,
    *,
    extra: Optional[Mapping[str, Any]] = None,
    tensor_parallel_group=None,
    process_group=None,
    strict: bool = True,
) -> Dict[str, Any]:
    """Load a :func:`save_checkpoint` checkpoint, written on any layout, into this rank's
    params, optimizer (main params, state, param-group hyperparameters, loss scaler); returns
    the requested ``extra`` values. All-or-nothing (module docstring). Collective over
    ``process_group``.

    Args:
        checkpoint_dir, model_params, optimizer, tensor_parallel_group, process_group: as in
            :func:`save_checkpoint`; model_params here may be another layout's.
        extra: {key: template}: a tensor template gets a new tensor of its shape and
            placement; any other template (e.g. None) gets the saved object.
        strict: also refuse a checkpoint that holds params this model (all ranks together)
            does not have.

    Returns:
        {key: loaded value} for the keys of ``extra``.

    Raises:
        CheckpointError: on every rank, before anything changed, when the checkpoint is
            missing or incomplete, lacks a key, has another shape, holds params this model
            does not (strict), holds non-finite main or model params, a scaler state the
            scaler refuses, or a param-group count other than the optimizer's.
        TypeError / ValueError: bad arguments.
    """
    import torch.distributed.checkpoint as dcp

    _check_model_params(model_params)
    tp_group = _tp_group_of(optimizer, tensor_parallel_group)
    metadata, fault = _read_metadata(checkpoint_dir)
    _agree([fault] if fault else [], process_group, f"cannot load {checkpoint_dir!r}")
    plan = _Plan(metadata)

    views = {n: global_view(p, tp_group, name=n) for n, p in model_params.items()}
    for n, v in views.items():
        plan.tensor(_MODEL + n, v)
    hooks = osd = scaler = detector = None
    if optimizer is not None:
        hooks = _optimizer_hooks(optimizer, tp_group)
        osd = hooks.sharded_state_dict(model_params)
        for n, v in osd["main_params"].items():
            plan.tensor(_MAIN + n, v, torch.float32)
            for k in plan.under(f"{_STATE}{n}."):
                plan.saved(f"{_STATE}{n}.{k}", like=v)
        plan.saved(_GROUPS)
        scaler = getattr(optimizer, "grad_scaler", None)
        if scaler is not None:
            saved_keys = set(plan.under(_SCALER))
            want = set(scaler.state_dict())
            if saved_keys != want:
                plan.problems.append(
                    f"the checkpoint's loss scaler state has keys {sorted(saved_keys)}, "
                    f"{type(scaler).__name__} expects {sorted(want)}"
                )
            for k in sorted(want & saved_keys):
                plan.saved(_SCALER + k)
        detector = getattr(optimizer, "spike_detector", None)
        if detector is not None:
            if _SPIKES in plan.md:
                plan.saved(_SPIKES)
            else:
                warnings.warn(
                    f"{checkpoint_dir!r} has no spike detector state; the detector starts afresh",
                    RuntimeWarning,
                    stacklevel=2,
                )
                detector = None
    for k, tmpl in (extra or {}).items():
        if isinstance(tmpl, Tensor):
            plan.tensor(_EXTRA + k, global_view(tmpl, tp_group, name=k))
        else:
            plan.saved(_EXTRA + k)
    if strict:
        names = set().union(*_gather(sorted(model_params), process_group))
        unknown = sorted(set(k[len(_MODEL):] for k in plan.md if k.startswith(_MODEL)) - names)
        if unknown:
            plan.problems.append(
                f"the checkpoint holds {len(unknown)} params this model does not have "
                f"(another model?), e.g. {unknown[:4]}"
            )
    _agree(plan.problems, process_group, f"cannot load {checkpoint_dir!r}")

    # read everything into the new buffers
    problems: List[str] = []
    try:
        with _single_process_quiet():
            dcp.load(
                plan.targets,
                storage_reader=dcp.FileSystemReader(checkpoint_dir),
                process_group=process_group,
            )
    except Exception as e:  # noqa: BLE001 -- DCP raises on every rank alike
        problems.append(f"reading failed: {type(e).__name__}: {e}")
    got = plan.targets
    if not problems:
        problems = _check_loaded(got, views, osd, scaler, detector)
    _agree(problems, process_group, f"refusing to load {checkpoint_dir!r}")

    # commit
    with torch.no_grad():
        for n, p in model_params.items():
            _local(p).copy_(_local(got[_MODEL + n]))
    if hooks is not None:
        state = {
            "main_params": {n: got[_MAIN + n] for n in osd["main_params"]},
            "state": {},
            "param_groups": list(got[_GROUPS]),
        }
        for n in osd["main_params"]:
            st = {k: got[f"{_STATE}{n}.{k}"] for k in plan.under(f"{_STATE}{n}.")}
            if st:
                state["state"][n] = st
        hooks.load_sharded_state_dict(state, model_params)
        if scaler is not None:
            scaler.load_state_dict({k: got[_SCALER + k] for k in scaler.state_dict()})
        if detector is not None:
            detector.load_state_dict(got[_SPIKES][0])
    # objects were saved as 1-tuples; tensors as they are
    return {
        k: got[_EXTRA + k][0] if isinstance(got[_EXTRA + k], tuple) else got[_EXTRA + k]
        for k in (extra or {})
    }


def _check_loaded(got, views, osd, scaler, detector) -> List[str]:
    """Faults in the values read (nothing live has been touched yet)."""
    problems = []
    for n in views:
        if _nonfinite(got[_MODEL + n]):
            problems.append(f"model param {n!r} holds inf/nan")
    if osd is not None:
        for n in osd["main_params"]:
            if _nonfinite(got[_MAIN + n]):
                problems.append(f"main param {n!r} holds inf/nan")
        groups = got[_GROUPS]
        if not isinstance(groups, tuple) or len(groups) != len(osd["param_groups"]):
            count = len(groups) if isinstance(groups, tuple) else type(groups).__name__
            problems.append(
                f"the checkpoint has {count} param groups, the optimizer has {len(osd['param_groups'])}"
            )
    if scaler is not None:
        trial = copy.deepcopy(scaler)
        try:
            trial.load_state_dict({k: got[_SCALER + k] for k in scaler.state_dict()})
        except Exception as e:  # noqa: BLE001 -- the scaler's own validation, reported
            problems.append(f"the loss scaler refuses the saved state: {type(e).__name__}: {e}")
    if detector is not None:
        try:
            copy.deepcopy(detector).load_state_dict(got[_SPIKES][0])
        except Exception as e:  # noqa: BLE001 -- the detector's own validation, reported
            problems.append(f"the spike detector refuses the saved state: {type(e).__name__}: {e}")
    return problems


# ----------------------------------------------------------------------------- directories


_TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's name


def iteration_dir(root: str, iteration: int) -> str:
    """Megatron-LM's directory of one iteration's checkpoint: ``root/iter_0000100``."""
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        raise ValueError(f"iteration must be an int >= 0, got {iteration!r}")
    return os.path.join(root, f"iter_{iteration:07d}")


def read_latest_iteration(root: str) -> Optional[int]:
    """The iteration in ``root/latest_checkpointed_iteration.txt``, or None when there is none.
    Raises ValueError when the file does not hold an int."""
    path = os.path.join(root, _TRACKER)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{path} holds {text!r}, expected an iteration number") from None


def write_latest_iteration(root: str, iteration: int) -> None:
    """Record ``iteration`` as the latest complete checkpoint (atomic rename; call on one rank
    after :func:`save_checkpoint` returned)."""
    iteration_dir(root, iteration)  # validates
    path = os.path.join(root, _TRACKER)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"{iteration}\n")
    os.replace(tmp, path)
