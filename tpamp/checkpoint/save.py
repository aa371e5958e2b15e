"""save_checkpoint: this rank's flat DCP state dict, every rank's faults agreed before anything is
written, the DCP write into the staging directory, checksums, the atomic publish.
"""

from __future__ import annotations

import os
import pickle
import shutil
import uuid
from typing import Any, Dict, List, Mapping, Optional

import torch

from tpamp.checkpoint.arguments import (
    check_dir_arg,
    check_extra_arg,
    check_model_params,
    shared_names,
    tp_group_of,
)
from tpamp.checkpoint.directories import (
    clean_up_after_killed_saves,
    looks_like_checkpoint,
    publish,
)
from tpamp.checkpoint.errors import (
    CheckpointError,
    agree_on_faults,
    dcp_errors,
    describe,
    faults_message,
    gather_objects,
    global_rank,
    group_rank,
    single_process_quiet,
    world_size,
)
from tpamp.checkpoint.keys import EXTRA, GROUPS, MAIN, META, MODEL, SCALER, SPIKES, state_key
from tpamp.checkpoint.layout import global_view
from tpamp.checkpoint.optimizers import (
    inner_optimizer,
    optimizer_hooks,
    optimizer_record,
    param_group_index,
)
from tpamp.checkpoint.storage import (
    METADATA,
    hash_file,
    items_by_file,
    open_checkpoint,
    sha256_of,
    write_manifest,
)

__all__ = ["save_checkpoint"]

Tensor = torch.Tensor


def _pickle_problem(key: str, value) -> Optional[str]:
    try:
        pickle.dumps(value)
    except Exception as e:  # noqa: BLE001 -- any pickling fault, reported
        return f"extra[{key!r}] cannot be saved (pickling it failed: {type(e).__name__}: {e})"
    return None


def save_checkpoint(checkpoint_dir: str, model_params: Mapping[str, Tensor], optimizer=None, *,
                    extra: Optional[Mapping[str, Any]] = None, tensor_parallel_group=None,
                    process_group=None) -> None:
    """Write the model params, the optimizer's main params and state, its loss scaler and
    ``extra`` to ``checkpoint_dir`` with torch.distributed.checkpoint (keys: package docstring).

    Collective: every rank of ``process_group`` must call it (default: the world; no process
    group: one process).

    Atomic: every rank writes into a new hidden directory beside ``checkpoint_dir``
    (``.NAME.saving-TOKEN``); when every rank's data and DCP's ``.metadata`` are written, the
    ranks checksum the data files (sha256 of every saved tensor and object, and of every file)
    into ``tpamp_checksums.json``, and only then is the directory renamed to
    ``checkpoint_dir`` (an existing checkpoint there is swapped out atomically, then deleted),
    before this returns on any rank. A save that raises or is killed part-way leaves
    ``checkpoint_dir`` as it was (a previous checkpoint there still loads); its staging
    directory is removed, or, after a kill, by the next save of the same name (or by
    :func:`~tpamp.checkpoint.clean_up_interrupted_saves` when a job restarts). Write the
    latest-iteration marker (:func:`write_latest_iteration`) only after this returned.

    Args:
        checkpoint_dir: the checkpoint's directory (the same path on every rank, on a file
            system every rank sees); its parent is created. An existing directory there is
            replaced only when it is a checkpoint (or empty).
        model_params: {global name: model param} of this rank, names that do not depend on the
            layout (e.g. ``blocks.7.attn.qkv.weight`` whatever PP stage holds block 7). Params
            marked ``shared=True`` are not written (their original is, under the same name).
        optimizer: a tpamp MixedPrecisionOptimizer / FP32Optimizer, an optimizer with the
            package docstring's hook, or None (model params only).
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
    final = check_dir_arg(checkpoint_dir)
    check_model_params(model_params)
    check_extra_arg(extra)
    tp_group = tp_group_of(optimizer, tensor_parallel_group)
    hooks = optimizer_hooks(optimizer, tp_group) if optimizer is not None else None

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
                                       and looks_like_checkpoint(final)):
        problems.append(f"{final} exists and is not a checkpoint directory: not replacing it")
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        problems.append(f"cannot create {parent}: {e}")
    token = uuid.uuid4().hex[:12]
    gathered = gather_objects((global_rank(), problems, final, token, groups_here), process_group)
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
        raise CheckpointError(faults_message(f"not saving {final!r}", faults, "nothing was written"))
    if hooks is not None:
        sd[META] = (optimizer_record(optimizer, group_of),)

    coordinator = group_rank(process_group) == 0
    staging = os.path.join(parent, f".{base}.saving-{gathered[0][3]}")
    if coordinator:
        clean_up_after_killed_saves(parent, base)
    gather_objects(None, process_group)  # nobody writes before the stale directories are gone
    try:
        _write_and_publish(sd, staging, final, coordinator, process_group)
    except BaseException:
        if coordinator:
            shutil.rmtree(staging, ignore_errors=True)
        raise


def _save_state_dict(model_params, optimizer, hooks, tp_group, extra):
    """(The flat DCP state dict of this rank, {name: param group index} of its main params)."""
    shared = shared_names(model_params)
    sd: Dict[str, Any] = {}
    for n, p in model_params.items():
        if n not in shared:
            sd[MODEL + n] = global_view(p, tp_group, name=n)
    groups_here: Dict[str, int] = {}
    if hooks is not None:
        osd = hooks.sharded_state_dict(model_params)
        for n, t in osd["main_params"].items():
            if n not in shared:
                sd[MAIN + n] = t
        for n, st in osd["state"].items():
            if n not in shared:
                for k, v in st.items():
                    sd[state_key(n, k)] = v
        sd[GROUPS] = tuple(osd["param_groups"])  # a tuple: DCP keeps it one object
        groups_here = {
            n: gi for n, gi in param_group_index(osd["main_params"], inner_optimizer(optimizer),
                                            optimizer, model_params).items()
            if n not in shared
        }
        scaler = getattr(optimizer, "grad_scaler", None)
        if scaler is not None:
            for k, v in scaler.state_dict().items():
                sd[SCALER + k] = v
        detector = getattr(optimizer, "spike_detector", None)
        if detector is not None:  # the same on every rank: it judges all-reduced numbers
            sd[SPIKES] = (detector.state_dict(),)
    for k, v in (extra or {}).items():
        # a non-tensor is wrapped in a 1-tuple, which DCP keeps whole (it would split a dict)
        sd[EXTRA + k] = v if isinstance(v, Tensor) else (v,)
    return sd, groups_here


def _write_and_publish(sd, staging, final, coordinator, process_group) -> None:
    """DCP-save into ``staging``, checksum, rename to ``final``; CheckpointError on every rank
    (``final`` untouched) when any step fails on any rank."""
    import torch.distributed.checkpoint as dcp

    what = f"saving {final!r} failed"
    untouched = "the checkpoint directory is as it was"

    def agree(problems, lost=untouched):
        try:
            agree_on_faults(problems, process_group, what, untouched)
        except CheckpointError:
            raise
        except dcp_errors() as e:  # a peer died: the collective itself fails
            raise CheckpointError(
                faults_message(what, [f"rank {global_rank()}: {describe(e)} (did a rank die?)"] +
                                [f"rank {global_rank()}: {m}" for m in problems], lost)
            ) from None

    problems = []
    try:
        with single_process_quiet():
            dcp.save(sd, storage_writer=dcp.FileSystemWriter(staging), process_group=process_group)
    except dcp_errors() as e:
        problems.append(f"writing {staging}: {describe(e, process_group)}")
    agree(problems)

    # checksums: every rank hashes its share of the files (each once), the coordinator records
    metadata, _, faults = open_checkpoint(staging, verify_checksums=False)
    hashes: Dict[str, dict] = {}
    if not faults:
        files = items_by_file(metadata)
        world, me = world_size(process_group), group_rank(process_group)
        try:
            for i, name in enumerate(sorted(files)):
                if i % world == me:
                    hashes[name] = hash_file(os.path.join(staging, name), files[name])
        except (OSError, CheckpointError) as e:
            faults.append(f"checksumming {staging}: {type(e).__name__}: {e}")
    try:
        parts = gather_objects((global_rank(), faults, hashes), process_group)
    except dcp_errors() as e:
        raise CheckpointError(
            faults_message(what, [f"rank {global_rank()}: {describe(e)} (did a rank die?)"], untouched)
        ) from None
    faults = [f"rank {r}: {m}" for r, fs, _ in parts for m in fs]
    if faults:
        raise CheckpointError(faults_message(what, faults, untouched))

    problems = []
    if coordinator:
        try:
            all_hashes = {n: h for _, _, hs in parts for n, h in hs.items()}
            write_manifest(staging, sha256_of(os.path.join(staging, METADATA)), all_hashes)
            publish(staging, final)
        except OSError as e:
            problems.append(f"publishing {staging} as {final}: {type(e).__name__}: {e}")
    # returns on no rank before the checkpoint is in place
    agree(problems, lost="the checkpoint may be in place already (rank 0 was publishing it)")
