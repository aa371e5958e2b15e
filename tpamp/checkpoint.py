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
``optimizer.meta``                 the inner optimizer's class and each param group's
                                   hyperparameter keys and param names (checked at load)
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

Saving is atomic. All ranks write into a new hidden directory beside the target
(``.NAME.saving-TOKEN``); when every rank's data file and DCP's ``.metadata`` are written, the
ranks checksum the data (sha256 of every tensor and object DCP wrote, and of every whole file,
each file hashed by one rank) into ``tpamp_checksums.json``; only then is the directory renamed
to its name (a checkpoint already there is swapped out in one atomic ``renameat2`` exchange,
then deleted), and only then does :func:`save_checkpoint` return on any rank. So a save that
raises (any rank: an unpicklable ``extra``, a full disk, a DCP error) or is killed part-way
leaves the directory of that name as it was: the previous checkpoint still loads,
bit-identically. A trainer writes the latest-iteration marker (:func:`write_latest_iteration`,
itself an atomic rename) after the save returned, so the marker always names a whole
checkpoint. Every fault of a save is a :class:`CheckpointError` on every rank, naming the
rank and the fault (a rank that dies makes the others' collectives fail: they raise too).

Loading is all-or-nothing, each stage agreed over all ranks before the next: (1) the manifest
and ``.metadata`` are read (``.metadata`` against its checksum); (2) every data file and every
tensor and object in it is verified against its checksum (each file by one rank), so a
truncated, extended, missing or overwritten file (finite garbage included) is refused, naming
the file and the tensor; (3) without reading data, every key this rank needs must exist with
the right global shape, the checkpoint must hold exactly this model's params (over all
ranks), and it must have been written by an optimizer of this inner optimizer's class (e.g.
``torch.optim.adamw.AdamW``) with the same param-group structure (every param in the same
group index, no hyperparameter this optimizer's groups lack); ``reset_optimizer_state=True``
is the deliberate way past this (the params, masters, scaler and detector load, the optimizer
state starts afresh); (4) everything is read into new buffers and checked (model params, main
params and optimizer state finite, hyperparameters of the live kinds, the scaler and spike
detector states accepted by copies of them, the caller's ``check_extra`` accepts the extras).
Only when every rank found no fault is anything copied into the model, the main params, the
optimizer state and groups, the scaler and the detector; otherwise every rank raises
:class:`CheckpointError` naming the first faults (rank, file, key), with nothing changed. Every
error of torch.distributed.checkpoint (whose ``CheckpointException`` is a BaseException) is
turned into that CheckpointError. Should the copying itself fail on any rank (e.g. in an
optimizer's ``load_sharded_state_dict``), every rank restores what it had from a host copy
taken just before and raises CheckpointError. The new buffers double the state's memory for
the duration of the load; the host copy takes as much host memory again.

Hook for other optimizers (e.g. a data-parallel-sharded ``tpamp.DistributedOptimizer``)
--------------------------------------------------------------------------------------------
:class:`tpamp.MixedPrecisionOptimizer` and :class:`tpamp.FP32Optimizer` are handled here. Any
other optimizer plugs in by exposing two methods; this module then does everything else
(keys, shared-param skipping, validation, the scaler, checksums, the optimizer class and
param-group check, all-or-nothing loading with rollback)::

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
        shape and key has already been checked, and the values are finite. With
        load_checkpoint(reset_optimizer_state=True), "state" is empty (drop the params'
        state) and "param_groups" are the optimizer's own. Should this raise part-way,
        load_checkpoint restores everything it had (host copies), on every rank.'''

The loss scaler (``optimizer.grad_scaler``, None: none) and a spike detector
(``optimizer.spike_detector``, if any) are saved and loaded here, and so are the model params
from ``model_params`` (copied in before ``load_sharded_state_dict`` is called). Param-group
hyperparameters are restored by group index; the group counts must match.

The param-group structure is found without the hook's help: each main param (or DP shard
box) lies in the memory of one tensor of one of the inner optimizer's param groups.

Megatron-LM's iteration directories (``iter_0000100``) and ``latest_checkpointed_iteration.txt``
tracker (:data:`TRACKER_FILENAME`): :func:`iteration_dir`, :func:`read_latest_iteration`,
:func:`write_latest_iteration`.
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import ctypes
import errno
import hashlib
import inspect
import json
import math
import os
import pickle
import shutil
import uuid
import warnings
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

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
    "TRACKER_FILENAME",
]

Tensor = torch.Tensor

_MODEL = "model."
_MAIN = "optimizer.main_params."
_STATE = "optimizer.state."
_GROUPS = "optimizer.param_groups"
_SCALER = "optimizer.grad_scaler."
_SPIKES = "optimizer.spike_detector"
_META = "optimizer.meta"
_EXTRA = "extra."
_MAX_LISTED = 8  # faults named in one CheckpointError


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded: missing or extra keys, wrong shapes,
    non-finite values, a scaler state the scaler refuses, another optimizer class or param-group
    structure, a missing, truncated or corrupted file (checksum), any error of
    torch.distributed.checkpoint (whose CheckpointException is a BaseException). The message
    names the ranks and files. Raised on every rank; nothing was changed (a failed save leaves
    the checkpoint directory as it was; a failed load leaves model and optimizer as they were)."""


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


def _optimizer_hooks(optimizer, tensor_parallel_group):
    if callable(getattr(optimizer, "sharded_state_dict", None)) and \
            callable(getattr(optimizer, "load_sharded_state_dict", None)):
        return _OptimizerHooks(optimizer, tensor_parallel_group)
    raise TypeError(
        f"optimizer must be a tpamp MixedPrecisionOptimizer/FP32Optimizer or have "
        f"sharded_state_dict/load_sharded_state_dict methods; got {type(optimizer).__name__}"
    )


class _OptimizerHooks:
    """An optimizer's two public hook methods (module docstring), their result checked. An
    optimizer whose ``sharded_state_dict`` takes a ``tensor_parallel_group`` keyword
    (MixedPrecisionOptimizer / FP32Optimizer) gets the TP group of the save or load."""

    def __init__(self, optimizer, tensor_parallel_group):
        self.opt = optimizer
        self.kwargs = {}
        try:
            takes_tp = "tensor_parallel_group" in inspect.signature(
                optimizer.sharded_state_dict).parameters
        except (TypeError, ValueError):  # no signature to read: call it with the names alone
            takes_tp = False
        if takes_tp:
            self.kwargs["tensor_parallel_group"] = tensor_parallel_group

    def sharded_state_dict(self, model_params):
        sd = self.opt.sharded_state_dict(model_params, **self.kwargs)
        missing = {"main_params", "state", "param_groups"} - set(sd)
        if missing:
            raise TypeError(
                f"{type(self.opt).__name__}.sharded_state_dict() returned no {sorted(missing)}"
            )
        return sd

    def load_sharded_state_dict(self, state, model_params):
        self.opt.load_sharded_state_dict(state)


# ----------------------------------------------------------------------------- collectives


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


def _rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _group_rank(process_group) -> int:
    return dist.get_rank(process_group) if _world(process_group) > 1 else 0


def _gather(obj, process_group) -> list:
    """[obj of every rank of process_group] (just [obj] without a process group)."""
    if _world(process_group) == 1:
        return [obj]
    out = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(out, obj, group=process_group)
    return out


def _faults_message(what: str, faults: List[str], tail: str) -> str:
    more = f" (and {len(faults) - _MAX_LISTED} more)" if len(faults) > _MAX_LISTED else ""
    return f"{what}; {tail}. " + "; ".join(faults[:_MAX_LISTED]) + more


def _agree(problems: List[str], process_group, what: str, tail: str = "nothing was changed") -> None:
    """Raise CheckpointError on every rank if any rank found a fault (a collective: every
    rank calls it, so a fault on one rank never leaves the others waiting)."""
    faults = [
        f"rank {r}: {msg}" for r, ps in _gather((_rank(), problems), process_group) for msg in ps
    ]
    if faults:
        raise CheckpointError(_faults_message(what, faults, tail))


# torch.distributed.checkpoint raises CheckpointException, a BaseException: `except Exception`
# alone would let it through as a raw traceback
def _dcp_errors() -> tuple:
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def _describe(e: BaseException, process_group=None) -> str:
    """One line per failure; a CheckpointException's failures by (global) rank."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for r, pair in sorted(failures.items()):
            exc = pair[0] if isinstance(pair, tuple) and pair else pair
            try:
                g = dist.get_global_rank(process_group, r) if process_group is not None else r
            except Exception:  # noqa: BLE001 -- only a label
                g = r
            parts.append(f"rank {g}: {type(exc).__name__}: {_first_line(exc)}")
        return "torch.distributed.checkpoint failed on " + ", ".join(parts)
    return f"{type(e).__name__}: {_first_line(e)}"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "(no message)"


# ----------------------------------------------------------------------------- checksums

_MANIFEST = "tpamp_checksums.json"  # written last into the staging directory, then renamed
_METADATA = ".metadata"  # DCP's
_FORMAT = "tpamp.checkpoint"
_HASH_BLOCK = 1 << 22


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _items_by_file(metadata) -> Dict[str, List[Tuple[int, int, str]]]:
    """{data file: [(offset, length, what)]} of every item DCP wrote (from its metadata)."""
    out: Dict[str, List[Tuple[int, int, str]]] = {}
    for index, info in metadata.storage_data.items():
        where = "" if index.offset is None else f" at {tuple(index.offset)}"
        out.setdefault(info.relative_path, []).append(
            (int(info.offset), int(info.length), f"{index.fqn!r}{where}")
        )
    for items in out.values():
        items.sort()
    return out


def _hash_file(path: str, items: Sequence[Tuple[int, int, str]]) -> dict:
    """{"size", "sha256" of the whole file, "items": [[offset, length, sha256, what]]}: one
    sequential read; every saved tensor or object gets its own checksum, so a fault names it."""
    whole = hashlib.sha256()
    out_items = []
    pos = 0
    with open(path, "rb") as f:

        def feed(n, *hashers):
            nonlocal pos
            while n > 0:
                block = f.read(min(n, _HASH_BLOCK))
                if not block:
                    raise CheckpointError(f"{path} ended at byte {pos}, before its items did")
                for h in hashers:
                    h.update(block)
                pos += len(block)
                n -= len(block)

        for offset, length, what in items:
            if offset < pos:  # overlapping items: hash this one by seeking back
                f.seek(offset)
                pos = offset
                h = hashlib.sha256()
                feed(length, h)
            else:
                feed(offset - pos, whole)
                h = hashlib.sha256()
                feed(length, whole, h)
            out_items.append([offset, length, h.hexdigest(), what])
        while True:
            block = f.read(_HASH_BLOCK)
            if not block:
                break
            whole.update(block)
            pos += len(block)
    return {"size": os.path.getsize(path), "sha256": whole.hexdigest(), "items": out_items}


def _sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_HASH_BLOCK), b""):
            h.update(block)
    return h.hexdigest()


def _verify_file(directory: str, name: str, want: dict, items) -> List[str]:
    """Faults of one data file against its manifest entry (size, each item, the whole)."""
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        return [f"data file {path} is missing"]
    size = os.path.getsize(path)
    if size != want.get("size"):
        return [
            f"data file {path} is {size} bytes, {want.get('size')} were written "
            f"({'truncated' if size < want.get('size', 0) else 'extended'})"
        ]
    try:
        got = _hash_file(path, items)
    except (OSError, CheckpointError) as e:
        return [f"data file {path} cannot be read: {type(e).__name__}: {e}"]
    saved = {(o, n): (h, w) for o, n, h, w in want.get("items", [])}
    bad = [
        w for o, n, h, w in got["items"] if saved.get((o, n), (None,))[0] != h
    ]
    if bad:
        return [
            f"data file {path}: the bytes of {', '.join(bad[:4])}"
            f"{f' and {len(bad) - 4} more' if len(bad) > 4 else ''} do not match their "
            "checksum (corrupted)"
        ]
    if got["sha256"] != want.get("sha256"):
        return [f"data file {path} does not match its checksum (corrupted outside the tensors)"]
    return []


def _write_manifest(directory: str, metadata_sha: str, files: Dict[str, dict]) -> None:
    doc = {
        "format": _FORMAT,
        "version": 1,
        "hash": "sha256",
        "metadata": {"name": _METADATA, "sha256": metadata_sha},
        "files": files,
    }
    tmp = os.path.join(directory, _MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, _MANIFEST))
    _fsync_dir(directory)


def _open_checkpoint(checkpoint_dir: str, verify_checksums: bool):
    """(DCP metadata, manifest or None, [faults]) read on this rank, changing nothing."""
    import torch.distributed.checkpoint as dcp

    if not os.path.isdir(checkpoint_dir):
        return None, None, [f"there is no checkpoint directory {checkpoint_dir!r}"]
    manifest = None
    if verify_checksums:
        path = os.path.join(checkpoint_dir, _MANIFEST)
        try:
            with open(path) as f:
                manifest = json.load(f)
            if not (isinstance(manifest, dict) and manifest.get("format") == _FORMAT
                    and isinstance(manifest.get("files"), dict)
                    and isinstance(manifest.get("metadata"), dict)):
                raise ValueError("not a tpamp checkpoint manifest")
        except FileNotFoundError:
            return None, None, [
                f"{checkpoint_dir!r} has no {_MANIFEST} (an incomplete save, or one written "
                "before tpamp stored checksums: load_checkpoint(..., verify_checksums=False) "
                "reads such a checkpoint unchecked)"
            ]
        except (OSError, ValueError) as e:
            return None, None, [f"{path} is unreadable: {type(e).__name__}: {e}"]
        md_path = os.path.join(checkpoint_dir, _METADATA)
        try:
            if _sha256_of(md_path) != manifest["metadata"].get("sha256"):
                return None, None, [f"{md_path} does not match its checksum (corrupted)"]
        except FileNotFoundError:
            return None, None, [f"{md_path} is missing: no readable DCP checkpoint (a torn save?)"]
        except OSError as e:
            return None, None, [f"{md_path} is unreadable: {type(e).__name__}: {e}"]
    try:
        metadata = dcp.FileSystemReader(checkpoint_dir).read_metadata()
    except _dcp_errors() as e:  # reported with its cause, on every rank
        return None, None, [
            f"no readable DCP checkpoint at {checkpoint_dir!r} (missing or incomplete "
            f".metadata: {_describe(e)})"
        ]
    if manifest is not None:
        want = set(_items_by_file(metadata))
        if want != set(manifest["files"]):
            return None, None, [
                f"{checkpoint_dir!r}: the data files {sorted(want)} of .metadata are not those "
                f"of {_MANIFEST} {sorted(manifest['files'])}"
            ]
    return metadata, manifest, []


def _verify_checksums(checkpoint_dir, metadata, manifest, process_group) -> List[str]:
    """This rank's share of the data files (file i: group rank i mod world), verified."""
    files = _items_by_file(metadata)
    world, me = _world(process_group), _group_rank(process_group)
    problems = []
    for i, name in enumerate(sorted(files)):
        if i % world == me:
            problems += _verify_file(checkpoint_dir, name, manifest["files"][name], files[name])
    return problems


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


def _check_dir_arg(checkpoint_dir) -> str:
    if isinstance(checkpoint_dir, bytes) or not isinstance(checkpoint_dir, (str, os.PathLike)):
        raise TypeError(f"checkpoint_dir must be a path (str), got {type(checkpoint_dir).__name__}")
    path = os.fspath(checkpoint_dir)
    if not path:
        raise ValueError("checkpoint_dir must not be empty")
    return os.path.abspath(path)


def _check_extra_arg(extra) -> None:
    if extra is None:
        return
    if not isinstance(extra, Mapping):
        raise TypeError(f"extra must be a mapping {{key: value}}, got {type(extra).__name__}")
    for k in extra:
        if not isinstance(k, str) or not k:
            raise ValueError(f"extra: keys must be non-empty strings, got {k!r}")


def _tp_group_of(optimizer, tensor_parallel_group):
    if tensor_parallel_group is not None:
        return tensor_parallel_group
    return getattr(optimizer, "tensor_parallel_group", None)


def _shared_names(model_params) -> set:
    return {n for n, p in model_params.items() if getattr(p, "shared", False)}


def _inner_optimizer(optimizer):
    """The torch.optim optimizer a tpamp wrapper steps (``optimizer.optimizer``), or None."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else None


def _class_name(obj) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _param_group_index(mains: Mapping[str, Any], inner, optimizer=None,
                       model_params: Optional[Mapping[str, Tensor]] = None) -> Dict[str, int]:
    """{name: index of the inner optimizer's param group that steps it} for the main params
    this rank holds, found by memory: a main param (or a box of a DP shard) lies inside one
    tensor of one group (a MixedPrecisionOptimizer's main param, a DistributedOptimizer's
    shard piece), whatever the wrapper. A main param that has no memory of its own (bf16
    params + remainders: its value is rebuilt for the save) is placed by the wrapper's
    ``param_group_indices()`` (id(model param) -> group) through ``model_params``."""
    if inner is None:
        return {}
    by_model = {}
    if model_params is not None and hasattr(optimizer, "param_group_indices"):
        by_model = optimizer.param_group_indices()
    spans = []
    for gi, g in enumerate(inner.param_groups):
        for p in g["params"]:
            loc = _local(p)
            if loc.numel():
                start = loc.data_ptr()
                spans.append((start, start + loc.numel() * loc.element_size(), gi, loc.device))
    spans.sort(key=lambda s: s[0])
    starts = [s[0] for s in spans]
    out = {}
    for name, view in mains.items():
        parts = [t for t in _local_parts(view) if t.numel()]
        if not parts:
            continue
        ptr = parts[0].data_ptr()
        i = bisect.bisect_right(starts, ptr) - 1
        if i >= 0 and ptr < spans[i][1] and spans[i][3] == parts[0].device:
            out[name] = spans[i][2]
        elif id(model_params.get(name) if model_params is not None else None) in by_model:
            out[name] = by_model[id(model_params[name])]
    return out


def _pickle_problem(key: str, value) -> Optional[str]:
    try:
        pickle.dumps(value)
    except Exception as e:  # noqa: BLE001 -- any pickling fault, reported
        return f"extra[{key!r}] cannot be saved (pickling it failed: {type(e).__name__}: {e})"
    return None


def _looks_like_checkpoint(path: str) -> bool:
    try:
        names = set(os.listdir(path))
    except OSError:
        return False
    return not names or _METADATA in names or _MANIFEST in names


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

    Atomic: every rank writes into a new hidden directory beside ``checkpoint_dir``
    (``.NAME.saving-TOKEN``); when every rank's data and DCP's ``.metadata`` are written, the
    ranks checksum the data files (sha256 of every saved tensor and object, and of every file)
    into ``tpamp_checksums.json``, and only then is the directory renamed to
    ``checkpoint_dir`` (an existing checkpoint there is swapped out atomically, then deleted),
    before this returns on any rank. A save that raises or is killed part-way leaves
    ``checkpoint_dir`` as it was (a previous checkpoint there still loads); its staging
    directory is removed, or, after a kill, by the next save of the same name. Write the
    latest-iteration marker (:func:`write_latest_iteration`) only after this returned.

    Args:
        checkpoint_dir: the checkpoint's directory (the same path on every rank, on a file
            system every rank sees); its parent is created. An existing directory there is
            replaced only when it is a checkpoint (or empty).
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

    Raises:
        TypeError / ValueError: bad arguments found on this rank alone (nothing written).
        CheckpointError: on every rank, naming the rank and the fault, when any rank cannot
            save (an unpicklable ``extra`` value, another path than rank 0's, a non-checkpoint
            directory in the way, a torch.distributed.checkpoint error, a failed write or
            rename, a rank that died); ``checkpoint_dir`` is as it was.
    """
    final = _check_dir_arg(checkpoint_dir)
    _check_model_params(model_params)
    _check_extra_arg(extra)
    tp_group = _tp_group_of(optimizer, tensor_parallel_group)
    hooks = _optimizer_hooks(optimizer, tp_group) if optimizer is not None else None

    # everything that can fail on one rank alone, found before anything is written
    problems: List[str] = []
    sd: Dict[str, Any] = {}
    groups_here: Dict[str, int] = {}
    try:
        sd, groups_here = _save_state_dict(model_params, optimizer, hooks, tp_group, extra)
    except Exception as e:  # noqa: BLE001 -- reported on every rank, nothing written
        problems.append(f"{type(e).__name__}: {e}")
    for k, v in (extra or {}).items():
        if not isinstance(v, Tensor):
            msg = _pickle_problem(k, v)
            if msg:
                problems.append(msg)
    parent, base = os.path.split(final)
    if os.path.lexists(final) and not (os.path.isdir(final) and not os.path.islink(final)
                                       and _looks_like_checkpoint(final)):
        problems.append(f"{final} exists and is not a checkpoint directory: not replacing it")
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        problems.append(f"cannot create {parent}: {e}")
    token = uuid.uuid4().hex[:12]
    gathered = _gather((_rank(), problems, final, token, groups_here), process_group)
    faults = [f"rank {r}: {m}" for r, ps, *_ in gathered for m in ps]
    faults += [
        f"rank {r}: checkpoint_dir {p!r}, rank {gathered[0][0]} has {final0!r}"
        for r, _, p, *_ in gathered
        for final0 in [gathered[0][2]]
        if p != final0
    ]
    group_of: Dict[str, int] = {}
    for r, _, _, _, g in gathered:
        for n, gi in g.items():
            if group_of.setdefault(n, gi) != gi:
                faults.append(f"rank {r}: {n!r} is in param group {gi}, another rank has {group_of[n]}")
    if faults:
        raise CheckpointError(_faults_message(f"not saving {final!r}", faults, "nothing was written"))
    if hooks is not None:
        inner = _inner_optimizer(optimizer)
        sd[_META] = ({
            "optimizer": _class_name(inner) if inner is not None else _class_name(optimizer),
            "param_groups": [
                {"keys": sorted(k for k in g if k != "params"),
                 "params": sorted(n for n, gi in group_of.items() if gi == i)}
                for i, g in enumerate(inner.param_groups if inner is not None else [])
            ],
        },)

    coordinator = _group_rank(process_group) == 0
    staging = os.path.join(parent, f".{base}.saving-{gathered[0][3]}")
    if coordinator:
        _clean_up_after_killed_saves(parent, base)
    _gather(None, process_group)  # nobody writes before the stale directories are gone
    try:
        _write_and_publish(sd, staging, final, coordinator, process_group)
    except BaseException:
        if coordinator:
            shutil.rmtree(staging, ignore_errors=True)
        raise


def _clean_up_after_killed_saves(parent: str, base: str) -> None:
    """Remove the staging directories of earlier saves of ``base`` that were killed part-way;
    a previous checkpoint set aside by a publish killed between its two renames (only where
    the OS has no atomic exchange) is put back first."""
    for name in sorted(os.listdir(parent)):
        path = os.path.join(parent, name)
        if name.startswith(f".{base}.old-") and not os.path.lexists(os.path.join(parent, base)):
            os.rename(path, os.path.join(parent, base))
        elif name.startswith(f".{base}.saving-") or name.startswith(f".{base}.old-"):
            shutil.rmtree(path, ignore_errors=True)


def _save_state_dict(model_params, optimizer, hooks, tp_group, extra):
    """(The flat DCP state dict of this rank, {name: param group index} of its main params)."""
    shared = _shared_names(model_params)
    sd: Dict[str, Any] = {}
    for n, p in model_params.items():
        if n not in shared:
            sd[_MODEL + n] = global_view(p, tp_group, name=n)
    groups_here: Dict[str, int] = {}
    if hooks is not None:
        osd = hooks.sharded_state_dict(model_params)
        for n, t in osd["main_params"].items():
            if n not in shared:
                sd[_MAIN + n] = t
        for n, st in osd["state"].items():
            if n not in shared:
                for k, v in st.items():
                    sd[f"{_STATE}{n}.{k}"] = v
        sd[_GROUPS] = tuple(osd["param_groups"])  # a tuple: DCP keeps it one object
        groups_here = {
            n: gi for n, gi in _param_group_index(osd["main_params"], _inner_optimizer(optimizer),
                                            optimizer, model_params).items()
            if n not in shared
        }
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
    return sd, groups_here


def _write_and_publish(sd, staging, final, coordinator, process_group) -> None:
    """DCP-save into ``staging``, checksum, rename to ``final``; CheckpointError on every rank
    (``final`` untouched) when any step fails on any rank."""
    import torch.distributed.checkpoint as dcp

    what = f"saving {final!r} failed"
    untouched = "the checkpoint directory is as it was"

    def agree(problems, lost=untouched):
        try:
            _agree(problems, process_group, what, untouched)
        except CheckpointError:
            raise
        except _dcp_errors() as e:  # a peer died: the collective itself fails
            raise CheckpointError(
                _faults_message(what, [f"rank {_rank()}: {_describe(e)} (did a rank die?)"] +
                                [f"rank {_rank()}: {m}" for m in problems], lost)
            ) from None

    problems = []
    try:
        with _single_process_quiet():
            dcp.save(sd, storage_writer=dcp.FileSystemWriter(staging), process_group=process_group)
    except _dcp_errors() as e:
        problems.append(f"writing {staging}: {_describe(e, process_group)}")
    agree(problems)

    # checksums: every rank hashes its share of the files (each once), the coordinator records
    metadata, _, faults = _open_checkpoint(staging, verify_checksums=False)
    hashes: Dict[str, dict] = {}
    if not faults:
        files = _items_by_file(metadata)
        world, me = _world(process_group), _group_rank(process_group)
        try:
            for i, name in enumerate(sorted(files)):
                if i % world == me:
                    hashes[name] = _hash_file(os.path.join(staging, name), files[name])
        except (OSError, CheckpointError) as e:
            faults.append(f"checksumming {staging}: {type(e).__name__}: {e}")
    try:
        parts = _gather((_rank(), faults, hashes), process_group)
    except _dcp_errors() as e:
        raise CheckpointError(
            _faults_message(what, [f"rank {_rank()}: {_describe(e)} (did a rank die?)"], untouched)
        ) from None
    faults = [f"rank {r}: {m}" for r, fs, _ in parts for m in fs]
    if faults:
        raise CheckpointError(_faults_message(what, faults, untouched))

    problems = []
    if coordinator:
        try:
            all_hashes = {n: h for _, _, hs in parts for n, h in hs.items()}
            _write_manifest(staging, _sha256_of(os.path.join(staging, _METADATA)), all_hashes)
            _publish(staging, final)
        except OSError as e:
            problems.append(f"publishing {staging} as {final}: {type(e).__name__}: {e}")
    # returns on no rank before the checkpoint is in place
    agree(problems, lost="the checkpoint may be in place already (rank 0 was publishing it)")


def _rename_exchange(a: str, b: str) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), b)


def _publish(staging: str, final: str) -> None:
    """Make ``staging`` visible as ``final``; a checkpoint already there is replaced in one
    atomic swap where the OS has one (else two renames, the old one kept until the second)."""
    _fsync_dir(staging)
    parent = os.path.dirname(final)
    if not os.path.lexists(final):
        os.rename(staging, final)
    elif _rename_exchange(staging, final):
        shutil.rmtree(staging, ignore_errors=True)  # now the previous checkpoint
    else:
        old = os.path.join(parent, f".{os.path.basename(final)}.old-{uuid.uuid4().hex[:12]}")
        os.rename(final, old)
        os.rename(staging, final)
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(parent)


# ----------------------------------------------------------------------------- load


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


def _files_of(metadata, keys) -> List[str]:
    keys = set(keys)
    return sorted({i.relative_path for x, i in metadata.storage_data.items() if x.fqn in keys})


def load_checkpoint(
    checkpoint_dir: str,
    model_params: Mapping[str, Tensor],
    optimizer=None,
    *,
    extra: Optional[Mapping[str, Any]] = None,
    tensor_parallel_group=None,
    process_group=None,
    strict: bool = True,
    reset_optimizer_state: bool = False,
    check_extra: Optional[Callable[[Dict[str, Any]], None]] = None,
    verify_checksums: bool = True,
) -> Dict[str, Any]:
    """Load a :func:`save_checkpoint` checkpoint, written on any layout, into this rank's
    params, optimizer (main params, state, param-group hyperparameters, loss scaler, spike
    detector); returns the requested ``extra`` values. Collective over ``process_group``.

    All-or-nothing, in this order, every stage agreed over all ranks before the next (module
    docstring): (1) the checksum manifest and DCP's ``.metadata`` (against its checksum); (2)
    the checksum of every data file and of every tensor and object in it (each file verified
    by one rank); (3) without reading data: every key, global shape, the model's param names
    (``strict``), the optimizer's class and param-group structure; (4) everything read into
    new buffers and checked (finite model params, main params and optimizer state;
    hyperparameters of the live kinds; scaler and spike detector states accepted by copies;
    ``check_extra``); (5) only then is anything copied in. A fault on any rank raises
    CheckpointError on every rank before (5). Should (5) raise on any rank (e.g. in an
    optimizer's ``load_sharded_state_dict``), every rank restores the state it had from a host
    copy taken before (5) and raises CheckpointError. The new buffers double the state's
    memory for the load; the host copy takes as much host memory again.

    Args:
        checkpoint_dir, model_params, optimizer, tensor_parallel_group, process_group: as in
            :func:`save_checkpoint`; model_params here may be another layout's.
        extra: {key: template}: a tensor template gets a new tensor of its shape and
            placement; any other template (e.g. None) gets the saved object.
        strict: also refuse a checkpoint that holds params this model (all ranks together)
            does not have.
        reset_optimizer_state: a deliberate change of optimizer (class or param groups): load
            the model params, main params, loss scaler and spike detector, but not the saved
            optimizer state or hyperparameters: the optimizer's state starts afresh and its
            param groups keep their current hyperparameters.
        check_extra: called on every rank with the loaded extras ({key: value}) before
            anything changes; an exception from it refuses the checkpoint on every rank (a
            trainer's check of its own values: data position, RNG state, ...).
        verify_checksums: False reads a checkpoint without the checksum manifest (one written
            before tpamp stored checksums) unchecked.

    Returns:
        {key: loaded value} for the keys of ``extra``.

    Raises:
        CheckpointError: on every rank, naming the ranks and files, with nothing changed: the
            checkpoint is missing, incomplete, truncated or corrupted (a checksum differs),
            lacks a key, has another shape, holds params this model does not (strict), was
            written by another optimizer class or param-group structure (without
            reset_optimizer_state), holds non-finite values, a scaler or detector state they
            refuse, or extras ``check_extra`` refuses; any error of
            torch.distributed.checkpoint.
        TypeError / ValueError: bad arguments (before any collective).
    """
    import torch.distributed.checkpoint as dcp

    path = _check_dir_arg(checkpoint_dir)
    _check_model_params(model_params)
    _check_extra_arg(extra)
    for flag, value in (("strict", strict), ("reset_optimizer_state", reset_optimizer_state),
                        ("verify_checksums", verify_checksums)):
        if not isinstance(value, bool):
            raise TypeError(f"{flag} must be a bool, got {value!r}")
    if check_extra is not None and not callable(check_extra):
        raise TypeError(f"check_extra must be callable, got {type(check_extra).__name__}")
    tp_group = _tp_group_of(optimizer, tensor_parallel_group)
    hooks = _optimizer_hooks(optimizer, tp_group) if optimizer is not None else None
    refusing = f"cannot load {path!r}"

    # (1) manifest and metadata; (2) checksums of every data file, before anything is parsed
    metadata, manifest, faults = _open_checkpoint(path, verify_checksums)
    _agree(faults, process_group, refusing)
    if manifest is not None:
        _agree(_verify_checksums(path, metadata, manifest, process_group), process_group, refusing)
    plan = _Plan(metadata)

    # (3) keys, shapes, optimizer class and groups
    plan.meta = None
    if _META in plan.md:  # every rank reads it (a collective), whether it has an optimizer or not
        meta = {_META: None}
        try:
            with _single_process_quiet():
                dcp.load(meta, storage_reader=dcp.FileSystemReader(path), process_group=process_group)
            plan.meta = meta[_META][0] if isinstance(meta[_META], tuple) else meta[_META]
        except _dcp_errors() as e:
            plan.problems.append(f"reading the optimizer record failed: {_describe(e, process_group)}")
    views = osd = scaler = detector = None
    try:  # a fault found on one rank alone must not leave the others in the next collective
        views, osd, scaler, detector = _plan_reads(
            plan, path, model_params, optimizer, hooks, tp_group, extra, reset_optimizer_state
        )
    except Exception as e:  # noqa: BLE001 -- reported on every rank
        plan.problems.append(f"{type(e).__name__}: {e}")
    if strict:
        names = set().union(*_gather(sorted(model_params), process_group))
        unknown = sorted(set(k[len(_MODEL):] for k in plan.md if k.startswith(_MODEL)) - names)
        if unknown:
            plan.problems.append(
                f"the checkpoint holds {len(unknown)} params this model does not have "
                f"(another model?), e.g. {unknown[:4]}"
            )
    _agree(plan.problems, process_group, refusing)

    # (4) read everything into the new buffers and check it
    problems: List[str] = []
    try:
        with _single_process_quiet():
            dcp.load(plan.targets, storage_reader=dcp.FileSystemReader(path),
                     process_group=process_group)
    except _dcp_errors() as e:
        problems.append(
            f"reading {', '.join(_files_of(metadata, plan.targets)[:4]) or 'nothing'} in "
            f"{path} failed: {_describe(e, process_group)}"
        )
    got = plan.targets
    if not problems:
        try:
            problems = _check_loaded(got, views, osd, scaler, detector, optimizer,
                                     reset_optimizer_state)
        except Exception as e:  # noqa: BLE001 -- reported on every rank
            problems = [f"checking the loaded values failed: {type(e).__name__}: {e}"]
    result: Dict[str, Any] = {}
    if not problems:
        result = {  # objects were saved as 1-tuples; tensors as they are
            k: got[_EXTRA + k][0] if isinstance(got[_EXTRA + k], tuple) else got[_EXTRA + k]
            for k in (extra or {})
        }
        if check_extra is not None:
            try:
                check_extra(dict(result))
            except Exception as e:  # noqa: BLE001 -- the caller's refusal, reported
                problems.append(f"check_extra refuses the extras: {type(e).__name__}: {e}")
    _agree(problems, process_group, f"refusing to load {path!r}")

    # (5) commit, or restore everything on every rank
    rollback = _Rollback(model_params, osd, optimizer, scaler, detector)
    fault: List[str] = []
    try:
        _commit(got, plan, model_params, hooks, osd, optimizer, scaler, detector,
                reset_optimizer_state)
    except BaseException as e:  # noqa: BLE001 -- restored below, then reported (or re-raised)
        fault = [f"copying the loaded state in failed ({_describe(e, process_group)})"]
        if not isinstance(e, _dcp_errors()):  # KeyboardInterrupt, SystemExit
            rollback.restore()
            raise
    try:
        _agree(fault, process_group, f"loading {path!r} failed",
               "every rank restored the state it had before")
    except BaseException as e:
        rollback.restore()
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(
            f"loading {path!r} failed; this rank restored the state it had before: "
            f"{'; '.join(fault) or _describe(e)}"
        ) from None
    return result


def _plan_reads(plan, path, model_params, optimizer, hooks, tp_group, extra, reset):
    """Plan every key this rank reads (no communication); returns (views of model_params,
    the optimizer's sharded state dict, scaler, detector) as far as they are loaded."""
    views = {n: global_view(p, tp_group, name=n) for n, p in model_params.items()}
    for n, v in views.items():
        plan.tensor(_MODEL + n, v)
    osd = scaler = detector = None
    if hooks is not None:
        osd = hooks.sharded_state_dict(model_params)
        for n, v in osd["main_params"].items():
            plan.tensor(_MAIN + n, v, torch.float32)
            if not reset:
                for k in plan.under(f"{_STATE}{n}."):
                    plan.saved(f"{_STATE}{n}.{k}", like=v)
        if not reset:
            plan.saved(_GROUPS)
            _check_optimizer_meta(plan, optimizer, osd, _shared_names(model_params),
                                  model_params)
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
                    f"{path!r} has no spike detector state; the detector starts afresh",
                    RuntimeWarning,
                    stacklevel=4,
                )
                detector = None
    for k, tmpl in (extra or {}).items():
        if isinstance(tmpl, Tensor):
            plan.tensor(_EXTRA + k, global_view(tmpl, tp_group, name=k))
        else:
            plan.saved(_EXTRA + k)
    return views, osd, scaler, detector


def _check_optimizer_meta(plan: _Plan, optimizer, osd, shared, model_params=None) -> None:
    """The saved optimizer's class and param-group structure against this one's (plan time)."""
    inner = _inner_optimizer(optimizer)
    if inner is None:
        return
    live = _class_name(inner)
    fix = ("; pass reset_optimizer_state=True to load the params and start the optimizer "
           "state afresh")
    if _META not in plan.md:
        plan.problems.append(
            f"the checkpoint does not record its optimizer class and param groups (written "
            f"before tpamp recorded them){fix}"
        )
        return
    meta = plan.meta  # read before the plan, see load_checkpoint
    if not isinstance(meta, dict) or "optimizer" not in meta or "param_groups" not in meta:
        plan.problems.append(f"the checkpoint's optimizer record is malformed: {meta!r}"[:300])
        return
    if meta["optimizer"] != live:
        plan.problems.append(
            f"the checkpoint was written by a {meta['optimizer']} optimizer, this one is a "
            f"{live}: its state and hyperparameters do not apply{fix}"
        )
        return
    saved_groups = meta["param_groups"]
    if len(saved_groups) != len(inner.param_groups):
        plan.problems.append(
            f"the checkpoint has {len(saved_groups)} param groups, the optimizer has "
            f"{len(inner.param_groups)}{fix}"
        )
        return
    saved_of = {n: i for i, g in enumerate(saved_groups) for n in g["params"]}
    moved = [
        f"{n!r} (group {gi} here, {saved_of.get(n)} in the checkpoint)"
        for n, gi in sorted(_param_group_index(osd["main_params"], inner, optimizer,
                                               model_params).items())
        if n not in shared and saved_of.get(n) != gi and _MAIN + n in plan.md
    ]
    if moved:
        plan.problems.append(
            f"the param groups differ from the checkpoint's: {', '.join(moved[:4])}"
            f"{f' and {len(moved) - 4} more' if len(moved) > 4 else ''}{fix}"
        )
    for i, (g, saved) in enumerate(zip(inner.param_groups, saved_groups)):
        unknown = sorted(set(saved["keys"]) - set(g))
        if unknown:
            plan.problems.append(
                f"param group {i} of the checkpoint has hyperparameters {unknown} that this "
                f"optimizer's group does not have{fix}"
            )


def _number(x) -> Optional[float]:
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, Tensor) and x.numel() == 1 and (x.is_floating_point() or not x.dtype.is_complex):
        return float(x.item())
    return None


def _group_value_problem(i: int, key: str, saved, live) -> Optional[str]:
    """A saved hyperparameter that is not of the live value's kind (or not finite)."""
    where = f"param group {i}: {key!r} is {saved!r} in the checkpoint"
    if isinstance(live, bool) or live is None or isinstance(live, str):
        ok = saved is None or isinstance(saved, type(live)) if live is not None else True
        return None if ok else f"{where}, expected a {type(live).__name__} like {live!r}"
    if _number(live) is not None:
        x = _number(saved)
        if x is None:
            return f"{where}, expected a number like {live!r}"
        if not math.isfinite(x):
            return f"{where}, expected a finite number"
        return None
    if isinstance(live, (tuple, list)):
        if not isinstance(saved, (tuple, list)) or len(saved) != len(live):
            return f"{where}, expected a {type(live).__name__} of {len(live)} like {live!r}"
        for a, b in zip(saved, live):
            if _number(b) is not None and (_number(a) is None or not math.isfinite(_number(a))):
                return f"{where}, expected finite numbers like {live!r}"
    return None


def _check_loaded(got, views, osd, scaler, detector, optimizer, reset) -> List[str]:
    """Faults in the values read (nothing live has been touched yet)."""
    problems = []
    for n in views:
        if _nonfinite(got[_MODEL + n]):
            problems.append(f"model param {n!r} holds inf/nan")
    if osd is not None:
        for n in osd["main_params"]:
            if _nonfinite(got[_MAIN + n]):
                problems.append(f"main param {n!r} holds inf/nan")
        if not reset:
            for key, v in got.items():
                if key.startswith(_STATE) and isinstance(v, Tensor) and _nonfinite(v):
                    problems.append(f"optimizer state {key[len(_STATE):]!r} holds inf/nan")
            groups = got[_GROUPS]
            live_groups = osd["param_groups"]
            if not isinstance(groups, tuple) or len(groups) != len(live_groups):
                count = len(groups) if isinstance(groups, tuple) else type(groups).__name__
                problems.append(
                    f"the checkpoint has {count} param groups, the optimizer has {len(live_groups)}"
                )
            else:
                for i, (saved, live) in enumerate(zip(groups, live_groups)):
                    if not isinstance(saved, dict):
                        problems.append(f"param group {i} is a {type(saved).__name__} in the checkpoint")
                        continue
                    for k, v in saved.items():
                        if k != "params" and k in live:
                            msg = _group_value_problem(i, k, v, live[k])
                            if msg:
                                problems.append(msg)
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


def _commit(got, plan, model_params, hooks, osd, optimizer, scaler, detector, reset) -> None:
    with torch.no_grad():
        for n, p in model_params.items():
            _local(p).copy_(_local(got[_MODEL + n]))
    if hooks is None:
        return
    if reset:
        groups = [dict(g) for g in osd["param_groups"]]
    else:
        groups = list(got[_GROUPS])
    state = {
        "main_params": {n: got[_MAIN + n] for n in osd["main_params"]},
        "state": {},
        "param_groups": groups,
    }
    if not reset:
        for n in osd["main_params"]:
            st = {k: got[f"{_STATE}{n}.{k}"] for k in plan.under(f"{_STATE}{n}.")}
            if st:
                state["state"][n] = st
    hooks.load_sharded_state_dict(state, model_params)
    if scaler is not None:
        scaler.load_state_dict({k: got[_SCALER + k] for k in scaler.state_dict()})
    if detector is not None:
        detector.load_state_dict(got[_SPIKES][0])


def _host_copy(t: Tensor) -> Tensor:
    return t.detach().to("cpu", copy=True)


class _Rollback:
    """Host copies of everything a load may change (model params, main params, the inner
    optimizer's state and param groups, scaler, spike detector), to restore it exactly when
    the commit fails part-way on any rank. Tensors are restored into the same objects."""

    def __init__(self, model_params, osd, optimizer, scaler, detector):
        self.tensors: List[Tuple[Tensor, Tensor]] = []
        for p in model_params.values():
            loc = _local(p)
            self.tensors.append((loc, _host_copy(loc)))
        for v in (osd or {}).get("main_params", {}).values():
            for part in _local_parts(v):
                self.tensors.append((part, _host_copy(part)))
        self.inner = _inner_optimizer(optimizer) if optimizer is not None else None
        if self.inner is not None:
            # a plain tensor is restored into the same object; anything else is a deep copy
            self.state = [
                (p, {k: ("copy", v, _host_copy(v)) if isinstance(v, Tensor) and not _is_dtensor(v)
                     else ("object", None, copy.deepcopy(v)) for k, v in st.items()})
                for p, st in self.inner.state.items()
            ]
            self.groups = [
                {k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
                for g in self.inner.param_groups
            ]
        self.scaler = scaler
        self.scaler_state = copy.deepcopy(scaler.state_dict()) if scaler is not None else None
        self.detector = detector
        self.detector_state = copy.deepcopy(detector.state_dict()) if detector is not None else None

    def restore(self) -> None:
        with torch.no_grad():
            for live, saved in self.tensors:
                live.copy_(saved)
            if self.inner is not None:
                self.inner.state.clear()
                for p, st in self.state:
                    restored = {}
                    for k, (how, obj, saved) in st.items():
                        if how == "copy":
                            obj.copy_(saved)
                            restored[k] = obj
                        else:
                            restored[k] = saved
                    self.inner.state[p] = restored
                for g, saved in zip(self.inner.param_groups, self.groups):
                    for k in [k for k in g if k != "params" and k not in saved]:
                        del g[k]
                    g.update(saved)
        if self.scaler is not None:
            self.scaler.load_state_dict(self.scaler_state)
        if self.detector is not None:
            self.detector.load_state_dict(self.detector_state)


# ----------------------------------------------------------------------------- directories


TRACKER_FILENAME = "latest_checkpointed_iteration.txt"  # Megatron-LM's name
_TRACKER = TRACKER_FILENAME


def iteration_dir(root: str, iteration: int) -> str:
    """Megatron-LM's directory of one iteration's checkpoint: ``root/iter_0000100``."""
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        raise ValueError(f"iteration must be an int >= 0, got {iteration!r}")
    return os.path.join(root, f"iter_{iteration:07d}")


def read_latest_iteration(root: str) -> Optional[int]:
    """The iteration in ``root/latest_checkpointed_iteration.txt``, or None when there is none.
    Raises ValueError when the file does not hold an int >= 0."""
    path = os.path.join(root, TRACKER_FILENAME)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{path} holds {text!r}, expected an iteration number") from None
    if value < 0:
        raise ValueError(f"{path} holds {text!r}, expected an iteration number >= 0")
    return value


def write_latest_iteration(root: str, iteration: int) -> None:
    """Record ``iteration`` as the latest complete checkpoint: write a new file, fsync, and
    rename it over the marker (atomic), so the marker always names a whole checkpoint. Call
    on one rank after :func:`save_checkpoint` returned (the checkpoint is then in place on
    every rank). Raises ValueError when ``root/iter_NNNNNNN`` is not a saved checkpoint."""
    ckpt = iteration_dir(root, iteration)  # validates
    if not os.path.isfile(os.path.join(ckpt, _METADATA)):
        raise ValueError(f"{ckpt} is not a saved checkpoint (no {_METADATA}): not recording it")
    path = os.path.join(root, TRACKER_FILENAME)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(root)
