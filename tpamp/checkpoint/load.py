"""load_checkpoint: all-or-nothing, each stage agreed over all ranks before the next (checksums;
keys, shapes, optimizer record; values read into new buffers and checked; commit, or roll back
on every rank).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable, Dict, List, Mapping, Optional

import torch

from tpamp.checkpoint.arguments import (
    check_dir_arg,
    check_extra_arg,
    check_model_params,
    shared_names,
    tp_group_of,
)
from tpamp.checkpoint.errors import (
    CheckpointError,
    agree_on_faults,
    dcp_errors,
    describe,
    gather_objects,
    single_process_quiet,
)
from tpamp.checkpoint.keys import EXTRA, GROUPS, MAIN, META, MODEL, SCALER, SPIKES, STATE, state_key
from tpamp.checkpoint.layout import global_view, local_part, local_parts
from tpamp.checkpoint.optimizers import (
    check_optimizer_meta,
    group_value_problem,
    optimizer_hooks,
    saved_groups_in_live_order,
)
from tpamp.checkpoint.plan import ReadPlan, files_of
from tpamp.checkpoint.rollback import Rollback
from tpamp.checkpoint.storage import open_checkpoint, verify_data_files

__all__ = ["load_checkpoint"]

Tensor = torch.Tensor


def _nonfinite(view) -> bool:
    return any(p.is_floating_point() and not bool(torch.isfinite(p).all()) for p in local_parts(view))


def load_checkpoint(checkpoint_dir: str, model_params: Mapping[str, Tensor], optimizer=None, *,
                    extra: Optional[Mapping[str, Any]] = None, tensor_parallel_group=None,
                    process_group=None, strict: bool = True, reset_optimizer_state: bool = False,
                    check_extra: Optional[Callable[[Dict[str, Any]], None]] = None,
                    verify_checksums: bool = True) -> Dict[str, Any]:
    """Load a :func:`save_checkpoint` checkpoint, written on any layout, into this rank's
    params, optimizer (main params, state, param-group hyperparameters, loss scaler, spike
    detector); returns the requested ``extra`` values. Collective: every rank of
    ``process_group`` must call it.

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

    path = check_dir_arg(checkpoint_dir)
    check_model_params(model_params)
    check_extra_arg(extra)
    for flag, value in (("strict", strict), ("reset_optimizer_state", reset_optimizer_state),
                        ("verify_checksums", verify_checksums)):
        if not isinstance(value, bool):
            raise TypeError(f"{flag} must be a bool, got {value!r}")
    if check_extra is not None and not callable(check_extra):
        raise TypeError(f"check_extra must be callable, got {type(check_extra).__name__}")
    tp_group = tp_group_of(optimizer, tensor_parallel_group)
    hooks = optimizer_hooks(optimizer, tp_group) if optimizer is not None else None
    refusing = f"cannot load {path!r}"

    # (1) manifest and metadata; (2) checksums of every data file, before anything is parsed
    metadata, manifest, faults = open_checkpoint(path, verify_checksums)
    agree_on_faults(faults, process_group, refusing)
    if manifest is not None:
        agree_on_faults(verify_data_files(path, metadata, manifest, process_group), process_group, refusing)
    plan = ReadPlan(metadata)

    # (3) keys, shapes, optimizer class and groups
    plan.meta = None
    if META in plan.md:  # every rank reads it (a collective), whether it has an optimizer or not
        meta = {META: None}
        try:
            with single_process_quiet():
                dcp.load(meta, storage_reader=dcp.FileSystemReader(path), process_group=process_group)
            plan.meta = meta[META][0] if isinstance(meta[META], tuple) else meta[META]
        except dcp_errors() as e:
            plan.problems.append(f"reading the optimizer record failed: {describe(e, process_group)}")
    views = osd = scaler = detector = None
    try:  # a fault found on one rank alone must not leave the others in the next collective
        views, osd, scaler, detector = _plan_reads(
            plan, path, model_params, optimizer, hooks, tp_group, extra, reset_optimizer_state
        )
    except Exception as e:  # noqa: BLE001 -- reported on every rank
        plan.problems.append(f"{type(e).__name__}: {e}")
    if strict:
        names = set().union(*gather_objects(sorted(model_params), process_group))
        unknown = sorted(set(k[len(MODEL):] for k in plan.md if k.startswith(MODEL)) - names)
        if unknown:
            plan.problems.append(
                f"the checkpoint holds {len(unknown)} params this model does not have "
                f"(another model?), e.g. {unknown[:4]}"
            )
    agree_on_faults(plan.problems, process_group, refusing)

    # (4) read everything into the new buffers and check it
    problems: List[str] = []
    try:
        with single_process_quiet():
            dcp.load(plan.targets, storage_reader=dcp.FileSystemReader(path),
                     process_group=process_group)
    except dcp_errors() as e:
        problems.append(
            f"reading {', '.join(files_of(metadata, plan.targets)[:4]) or 'nothing'} in "
            f"{path} failed: {describe(e, process_group)}"
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
            k: got[EXTRA + k][0] if isinstance(got[EXTRA + k], tuple) else got[EXTRA + k]
            for k in (extra or {})
        }
        if check_extra is not None:
            try:
                check_extra(dict(result))
            except Exception as e:  # noqa: BLE001 -- the caller's refusal, reported
                problems.append(f"check_extra refuses the extras: {type(e).__name__}: {e}")
    agree_on_faults(problems, process_group, f"refusing to load {path!r}")

    # (5) commit, or restore everything on every rank
    rollback = Rollback(model_params, osd, optimizer, scaler, detector)
    fault: List[str] = []
    try:
        _commit(got, plan, model_params, hooks, osd, optimizer, scaler, detector,
                reset_optimizer_state)
    except BaseException as e:  # noqa: BLE001 -- restored below, then reported (or re-raised)
        fault = [f"copying the loaded state in failed ({describe(e, process_group)})"]
        if not isinstance(e, dcp_errors()):  # KeyboardInterrupt, SystemExit
            rollback.restore()
            raise
    try:
        agree_on_faults(fault, process_group, f"loading {path!r} failed",
               "every rank restored the state it had before")
    except BaseException as e:
        rollback.restore()
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(
            f"loading {path!r} failed; this rank restored the state it had before: "
            f"{'; '.join(fault) or describe(e)}"
        ) from None
    return result


def _plan_reads(plan, path, model_params, optimizer, hooks, tp_group, extra, reset):
    """Plan every key this rank reads (no communication); returns (views of model_params,
    the optimizer's sharded state dict, scaler, detector) as far as they are loaded."""
    views = {n: global_view(p, tp_group, name=n) for n, p in model_params.items()}
    for n, v in views.items():
        plan.tensor(MODEL + n, v)
    osd = scaler = detector = None
    if hooks is not None:
        osd = hooks.sharded_state_dict(model_params)
        for n, v in osd["main_params"].items():
            plan.tensor(MAIN + n, v, torch.float32)
            if not reset:
                for k in plan.under(state_key(n, "")):
                    plan.saved(state_key(n, k), like=v)
        if not reset:
            plan.saved(GROUPS)
            check_optimizer_meta(plan, optimizer, osd, shared_names(model_params),
                                  model_params)
        scaler = getattr(optimizer, "grad_scaler", None)
        if scaler is not None:
            saved_keys = set(plan.under(SCALER))
            want = set(scaler.state_dict())
            if saved_keys != want:
                plan.problems.append(
                    f"the checkpoint's loss scaler state has keys {sorted(saved_keys)}, "
                    f"{type(scaler).__name__} expects {sorted(want)}"
                )
            for k in sorted(want & saved_keys):
                plan.saved(SCALER + k)
        detector = getattr(optimizer, "spike_detector", None)
        if detector is not None:
            if SPIKES in plan.md:
                plan.saved(SPIKES)
            else:
                warnings.warn(
                    f"{path!r} has no spike detector state; the detector starts afresh",
                    RuntimeWarning,
                    stacklevel=4,
                )
                detector = None
    for k, tmpl in (extra or {}).items():
        if isinstance(tmpl, Tensor):
            plan.tensor(EXTRA + k, global_view(tmpl, tp_group, name=k))
        else:
            plan.saved(EXTRA + k)
    return views, osd, scaler, detector


def _check_groups(groups, live_groups, optimizer) -> List[str]:
    """Faults of the saved param groups' hyperparameters against the live ones, the saved
    groups matched by override key when they have one (docs/spec.md section 16)."""
    if isinstance(groups, tuple) and all(isinstance(g, dict) for g in groups):
        try:
            groups = saved_groups_in_live_order(optimizer, groups)
        except ValueError as e:
            return [str(e)]
    if not isinstance(groups, tuple) or len(groups) != len(live_groups):
        count = len(groups) if isinstance(groups, tuple) else type(groups).__name__
        return [f"the checkpoint has {count} param groups, the optimizer has {len(live_groups)}"]
    problems = []
    for i, (saved, live) in enumerate(zip(groups, live_groups)):
        if not isinstance(saved, dict):
            problems.append(f"param group {i} is a {type(saved).__name__} in the checkpoint")
            continue
        for k, v in saved.items():
            if k != "params" and k in live:
                msg = group_value_problem(i, k, v, live[k])
                if msg:
                    problems.append(msg)
    # the values by the optimizer class's rules (a finite lr, eps > 0, ...), through its hook
    check = getattr(optimizer, "check_saved_param_groups", None)
    if not problems and callable(check):
        try:
            check(groups)
        except (TypeError, ValueError) as e:
            problems.append(str(e))
    return problems


def _check_loaded(got, views, osd, scaler, detector, optimizer, reset) -> List[str]:
    """Faults in the values read (nothing live has been touched yet)."""
    problems = []
    for n in views:
        if _nonfinite(got[MODEL + n]):
            problems.append(f"model param {n!r} holds inf/nan")
    if osd is not None:
        for n in osd["main_params"]:
            if _nonfinite(got[MAIN + n]):
                problems.append(f"main param {n!r} holds inf/nan")
        if not reset:
            for key, v in got.items():
                if key.startswith(STATE) and isinstance(v, Tensor) and _nonfinite(v):
                    problems.append(f"optimizer state {key[len(STATE):]!r} holds inf/nan")
            problems += _check_groups(got[GROUPS], osd["param_groups"], optimizer)
    if scaler is not None:
        trial = copy.deepcopy(scaler)
        try:
            trial.load_state_dict({k: got[SCALER + k] for k in scaler.state_dict()})
        except Exception as e:  # noqa: BLE001 -- the scaler's own validation, reported
            problems.append(f"the loss scaler refuses the saved state: {type(e).__name__}: {e}")
    if detector is not None:
        try:
            copy.deepcopy(detector).load_state_dict(got[SPIKES][0])
        except Exception as e:  # noqa: BLE001 -- the detector's own validation, reported
            problems.append(f"the spike detector refuses the saved state: {type(e).__name__}: {e}")
    return problems


def _commit(got, plan, model_params, hooks, osd, optimizer, scaler, detector, reset) -> None:
    with torch.no_grad():
        for n, p in model_params.items():
            local_part(p).copy_(local_part(got[MODEL + n]))
    if hooks is None:
        return
    if reset:
        groups = [dict(g) for g in osd["param_groups"]]
    else:
        groups = list(saved_groups_in_live_order(optimizer, got[GROUPS]))
    state = {
        "main_params": {n: got[MAIN + n] for n in osd["main_params"]},
        "state": {},
        "param_groups": groups,
    }
    if not reset:
        for n in osd["main_params"]:
            st = {k: got[state_key(n, k)] for k in plan.under(state_key(n, ""))}
            if st:
                state["state"][n] = st
    hooks.load_sharded_state_dict(state)
    if scaler is not None:
        scaler.load_state_dict({k: got[SCALER + k] for k in scaler.state_dict()})
    if detector is not None:
        detector.load_state_dict(got[SPIKES][0])
