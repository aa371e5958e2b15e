"""The all-or-nothing load of the tpamp optimizer wrappers, and the checks of a state dict it
runs before anything changes (a failed load leaves the wrapper as it was). Every error names
the key, the bad value and what was expected.
"""

from __future__ import annotations

import warnings
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from tpamp._checks import check_mapping
from tpamp._guards import gather_rows, reset_step_guard
from tpamp.common import local_tensor
from tpamp.hyperparameters import check_group_hyperparameters, group_optimizers
from tpamp.param_groups import OVERRIDE_KEY, match_saved_groups
from tpamp.state_formats import check_saved_scales, restore_code_dtypes

Tensor = torch.Tensor

__all__ = [
    "NARROW_STATE_KEYS",
    "align_inner_state",
    "align_saved_groups",
    "load_inner_state",
    "check_finite",
    "check_inner_optimizer_state",
    "check_optimizer_state_dict",
    "check_wrapper_state",
    "load_wrapper_state",
    "match_saved_tensors",
]


# ---- state dicts ----------------------------------------------------------------------------

# torch.optim state entries that hold one value per param element (shape of the param)
_PER_ELEMENT_STATE = frozenset({
    "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta",
    "sum", "ax", "prev", "step_size", "grad_avg", "exp_inf", "mu_product_buffer",
})
# tpamp's per-block scales of 8-bit moments (8-bit optimizer state): present or not by configuration, so
# their presence does not mark another optimizer class
NARROW_STATE_KEYS = frozenset({"exp_avg_scale", "exp_avg_sq_scale"})


def _keys_filled_on_load(cls) -> set:
    """Param-group keys that ``cls.__setstate__`` fills in by itself when a state dict from an
    older torch lacks them (so their absence is not a sign of another optimizer class)."""
    try:
        probe = cls.__new__(cls)
        probe.__setstate__({"defaults": {}, "state": {}, "param_groups": [{"params": []}]})
        return set(probe.param_groups[0])
    except Exception:
        return set()


def _all_finite(tensors: Sequence[Tensor]) -> List[bool]:
    """One host read for the finiteness of many tensors (a load-time sync, never in a step)."""
    if not tensors:
        return []
    flags = [torch.isfinite(local_tensor(t).float() if local_tensor(t).element_size() == 1 else local_tensor(t))
             .all().reshape(1).cpu() for t in tensors]
    return torch.cat(flags).tolist()


def check_inner_optimizer_state(optimizer, state_dict, where: str = "state_dict['optimizer']") -> None:
    """Check a ``torch.optim`` state dict against ``optimizer`` without loading it: the same
    number of param groups and params per group, the optimizer class's hyperparameters present
    in every group (an SGD state dict lacks Adam's ``betas``; for a :class:`tpamp.
    CombinedOptimizer` the class of the part that steps the group) with values its rules accept
    (:mod:`tpamp.hyperparameters`: a finite lr, eps > 0, ...), state entries for listed params
    only, with the keys of the current state (when there is one) and per-element tensors of the
    param's shape, all floating-point state finite, and 8-bit moments with their per-block
    scales (:func:`tpamp.state_formats.check_saved_scales`: present, shape, finite, >= 0 except
    a uint8 exp_avg_sq's blocks holding inf).
    Raises TypeError/KeyError/ValueError naming the key."""
    check_mapping(where, state_dict)
    for key in ("state", "param_groups"):
        if key not in state_dict:
            raise KeyError(f"{where} has no {key!r} entry (not a torch.optim state dict)")
    state, groups = state_dict["state"], state_dict["param_groups"]
    check_mapping(f"{where}['state']", state)
    if not isinstance(groups, (list, tuple)):
        raise TypeError(f"{where}['param_groups'] must be a list, got {type(groups).__name__}")
    mine = optimizer.param_groups
    if len(groups) != len(mine):
        raise ValueError(
            f"{where}['param_groups'] has {len(groups)} param groups, this optimizer has {len(mine)}"
        )
    cls = type(optimizer)
    owners = group_optimizers(optimizer)  # the part of a CombinedOptimizer that steps a group
    by_id = {}
    for gi, (saved, group, owner) in enumerate(zip(groups, mine, owners)):
        gwhere = f"{where}['param_groups'][{gi}]"
        needed = set(getattr(owner, "defaults", {})) - _keys_filled_on_load(type(owner))
        check_mapping(gwhere, saved)
        if "params" not in saved:
            raise KeyError(f"{gwhere} has no 'params' entry")
        ids = saved["params"]
        if not isinstance(ids, (list, tuple)):
            raise TypeError(f"{gwhere}['params'] must be a list of ids, got {type(ids).__name__}")
        if len(ids) != len(group["params"]):
            raise ValueError(
                f"{gwhere}['params'] lists {len(ids)} params, this optimizer's group {gi} has "
                f"{len(group['params'])}"
            )
        missing = needed - set(saved)
        if missing:
            raise ValueError(
                f"{gwhere} lacks {sorted(missing)}, which {type(owner).__name__} needs: is this "
                f"the state dict of another optimizer class (it has "
                f"{sorted(k for k in saved if k != 'params')})?"
            )
        # the values too: torch checks them only in its constructor (tpamp.hyperparameters)
        check_group_hyperparameters(type(owner), saved, gwhere)
        for pid, p in zip(ids, group["params"]):
            by_id[pid] = p
    to_check, names = [], []
    for pid, entry in state.items():
        swhere = f"{where}['state'][{pid!r}]"
        if pid not in by_id:
            raise ValueError(f"{swhere}: no param group lists a param with id {pid!r}")
        check_mapping(swhere, entry)
        p = by_id[pid]
        current = optimizer.state.get(p) or {}
        if current and set(current) - NARROW_STATE_KEYS != set(entry) - NARROW_STATE_KEYS:
            raise ValueError(
                f"{swhere} has keys {sorted(entry)}, this {cls.__name__}'s state for that param "
                f"has {sorted(current)}: is this the state dict of another optimizer class?"
            )
        for k, v in entry.items():
            if not isinstance(v, Tensor):
                continue
            cur = current.get(k) if k not in NARROW_STATE_KEYS else None  # checked below
            expected = tuple(cur.shape) if isinstance(cur, Tensor) else (
                tuple(p.shape) if k in _PER_ELEMENT_STATE else None
            )
            if expected is not None and v.dim() > 0 and tuple(v.shape) != expected:
                raise ValueError(
                    f"{swhere}[{k!r}] has shape {tuple(v.shape)}, expected {expected} (the "
                    "param's): a state dict of another model?"
                )
            if v.is_floating_point():
                to_check.append(v)
                names.append(f"{swhere}[{k!r}]")
    for name, ok in zip(names, _all_finite(to_check)):
        if not ok:
            raise ValueError(f"{name} holds inf or nan values; refusing to load it")
    # 8-bit moments and their scales, in any configuration (every loader converts them)
    check_saved_scales(state, f"{where}['state']")


def _prefixed(prefix: str, fn, *args):
    """Run an object's own check, naming the wrapper's key in its error."""
    try:
        return fn(*args)
    except (TypeError, KeyError, ValueError) as e:
        msg = e.args[0] if e.args else str(e)
        raise type(e)(f"{prefix}: {msg}") from e


# ---- the all-or-nothing load of every optimizer wrapper ------------------------------------


def match_saved_tensors(where: str, saved, targets, *, unit: str = "param group",
                        item: str = "main param") -> List[Tuple[str, Tensor, Tensor]]:
    """Match saved main params against this wrapper's: ``targets`` is a list of tensors or a
    list (per param group) of lists of tensors, ``saved`` must have the same structure, each
    a float32 tensor of the target's shape (global and local). Returns (key, saved, target)
    triples; raises TypeError / ValueError naming the key. Finiteness: :func:`check_finite`."""
    nested = bool(targets) and isinstance(targets[0], (list, tuple))
    if not isinstance(saved, (list, tuple)):
        raise TypeError(
            f"{where} must be a list{' (per ' + unit + ') of lists' if nested else ''} of "
            f"tensors, got {type(saved).__name__}"
        )
    if not nested and targets == [] and saved and isinstance(saved[0], (list, tuple)):
        nested = True
    if len(saved) != len(targets):
        raise ValueError(
            f"{where} has {item}s for {len(saved)} {unit}s, this optimizer has {len(targets)}"
            if nested else
            f"{where} has {len(saved)} {item}s, this optimizer has {len(targets)}"
        )
    out = []
    groups = zip(saved, targets) if nested else [(saved, targets)]
    for gi, (saved_group, target_group) in enumerate(groups):
        gwhere = f"{where}[{gi}]" if nested else where
        if not isinstance(saved_group, (list, tuple)):
            raise TypeError(f"{gwhere} must be a list of tensors, got {type(saved_group).__name__}")
        if len(saved_group) != len(target_group):
            raise ValueError(
                f"{unit} {gi}: {gwhere} has {len(saved_group)} {item}s, this optimizer has "
                f"{len(target_group)}"
            )
        for i, (s, t) in enumerate(zip(saved_group, target_group)):
            name = f"{gwhere}[{i}]"
            if not isinstance(s, Tensor):
                raise TypeError(f"{name} must be a tensor, got {type(s).__name__}")
            if s.dtype != torch.float32:
                raise ValueError(f"{name} has dtype {s.dtype}; {item}s are torch.float32")
            if tuple(s.shape) != tuple(t.shape) or tuple(local_tensor(s).shape) != tuple(local_tensor(t).shape):
                raise ValueError(
                    f"{unit + ' ' + str(gi) + ', ' if nested else ''}{item} {i}: saved shape "
                    f"{tuple(s.shape)} != {tuple(t.shape)} ({name})"
                )
            out.append((name, s, t))
    return out


def check_finite(named: Sequence[Tuple[str, Tensor]]) -> None:
    """ValueError naming the first (key, tensor) that holds inf or nan (one host read)."""
    for (name, _), ok in zip(named, _all_finite([t for _, t in named])):
        if not ok:
            raise ValueError(
                f"{name} holds inf or nan values (a corrupted checkpoint?); refusing to load it"
            )


def _group_alignment(optimizer, inner_sd, fixed_layout: Optional[str] = None):
    """(for each live group the index of its saved group, for each live group the saved index
    of each of its params or None for the same order), or None when there is nothing to
    reorder or the groups load by position (either side has a group without an override key,
    or the state dict is malformed: the checks that follow name it). ``fixed_layout``: the
    wrapper's name when it cannot reorder (any reordering is then a ValueError)."""
    if not isinstance(inner_sd, dict):
        return None
    saved = inner_sd.get("param_groups")
    if not isinstance(saved, (list, tuple)) or not all(isinstance(g, dict) for g in saved):
        return None
    live = optimizer.param_groups
    # an optimizer of parts (tpamp.CombinedOptimizer) matches the saved groups to its parts
    by_part = getattr(optimizer, "saved_group_order", None)
    perm = by_part(inner_sd) if callable(by_part) else None
    if perm is None:
        perm = match_saved_groups(saved, live, "the state_dict")
    if perm is None:
        return None
    if fixed_layout is not None:
        if perm == list(range(len(perm))) and all(
                list(saved[j].get("param_names") or []) == list(g.get("param_names") or [])
                for j, g in zip(perm, live)):
            return None
        raise ValueError(
            f"the state_dict's param groups or their params are in another order (override "
            f"keys {[g[OVERRIDE_KEY] for g in saved]} there, {[g[OVERRIDE_KEY] for g in live]} "
            f"here): {fixed_layout}.state_dict loads on the same layout only; load a sharded "
            "checkpoint (tpamp.checkpoint), which maps by name"
        )
    orders: List[Optional[List[int]]] = []
    for j, g in zip(perm, live):
        s_names, l_names = saved[j].get("param_names"), g.get("param_names")
        if not isinstance(s_names, (list, tuple)) or l_names is None or list(s_names) == list(l_names):
            orders.append(None)
            continue
        if sorted(s_names) != sorted(l_names) or len(set(l_names)) != len(l_names):
            raise ValueError(
                f"param group {g[OVERRIDE_KEY]!r}: the state_dict's params "
                f"{sorted(set(s_names) - set(l_names))[:4]} are not in this group, its params "
                f"{sorted(set(l_names) - set(s_names))[:4]} are not in the state_dict's"
            )
        orders.append([list(s_names).index(n) for n in l_names])
    if perm == list(range(len(perm))) and all(o is None for o in orders):
        return None
    return perm, orders


def _reordered_inner(inner_sd, perm, orders) -> dict:
    saved = inner_sd["param_groups"]
    new_groups = []
    for j, o in zip(perm, orders):
        s = dict(saved[j])
        ids = s.get("params")
        if o is not None and isinstance(ids, (list, tuple)) and len(ids) == len(o):
            s["params"] = [ids[k] for k in o]
            s["param_names"] = [saved[j]["param_names"][k] for k in o]
        new_groups.append(s)
    return {**inner_sd, "param_groups": new_groups}


def align_inner_state(optimizer, inner_sd):
    """A ``torch.optim`` state dict with its param groups in ``optimizer``'s order, matched by
    override key (:func:`tpamp.param_groups.match_saved_groups`, docs/spec.md section 16), and
    the params of each group in the live group's order, matched by ``param_names`` when both
    groups have them (the state follows its params' ids). A new dict; ``inner_sd`` itself
    when there is nothing to reorder, when either side has a group without an override key
    (by position, as before overrides existed) or when it is malformed (the checks that follow
    name it). Raises ValueError naming the key for a changed override or a group whose saved
    names differ from the live ones."""
    al = _group_alignment(optimizer, inner_sd)
    return inner_sd if al is None else _reordered_inner(inner_sd, *al)


def align_saved_groups(wrapper, state_dict, *, mains_key: str, per_group_mains: bool = True):
    """A wrapper's state dict with the inner optimizer's state realigned by
    :func:`align_inner_state`; with ``per_group_mains`` the per-group lists under
    ``mains_key`` (MixedPrecisionOptimizer's ``fp32_from_fp16_params``, the main params of a
    group's fp16/bf16 params in group order) are reordered alike. A new dict (the caller's is
    not changed), or ``state_dict`` itself as align_inner_state. Without ``per_group_mains``
    (DistributedOptimizer: main shards per bucket, not per group) any reordering is a
    ValueError that points to tpamp.checkpoint."""
    if not isinstance(state_dict, dict):
        return state_dict
    inner_sd = state_dict.get("optimizer")
    al = _group_alignment(wrapper.optimizer, inner_sd,
                          None if per_group_mains else type(wrapper).__name__)
    if al is None:
        return state_dict
    perm, orders = al
    out = {**state_dict, "optimizer": _reordered_inner(inner_sd, perm, orders)}
    mains = state_dict.get(mains_key)
    if isinstance(mains, (list, tuple)) and len(mains) == len(inner_sd["param_groups"]) and \
            all(isinstance(m, (list, tuple)) for m in mains):
        by_group = wrapper.main_params_by_group()
        new_mains = []
        for gi, (j, o, g) in enumerate(zip(perm, orders, wrapper.optimizer.param_groups)):
            m = list(mains[j])
            if o is not None:  # the group's main params are those of its fp16/bf16 params
                half = {id(x) for x in by_group[gi]}
                live_pos = [p for p, x in enumerate(g["params"]) if id(x) in half]
                rank = {sp: r for r, sp in enumerate(sorted(o[p] for p in live_pos))}
                if len(m) == len(rank):
                    m = [m[rank[o[p]]] for p in live_pos]
            new_mains.append(m)
        out[mains_key] = new_mains
    return out


def load_inner_state(optimizer, inner_sd) -> None:
    """``optimizer.load_state_dict(inner_sd)`` (checked and aligned before), keeping the
    entries of a live group that the saved group lacks (torch.optim keeps only the saved
    group's: an ``override_key`` added since, say), and 8-bit moment codes as the codes they
    are (torch.optim casts them to float32: state_formats.restore_code_dtypes)."""
    live_entries = [dict(g) for g in optimizer.param_groups]
    optimizer.load_state_dict(inner_sd)
    restore_code_dtypes(optimizer, inner_sd)
    for g, before_load in zip(optimizer.param_groups, live_entries):
        for k, v in before_load.items():
            g.setdefault(k, v)


def check_wrapper_state(wrapper, state_dict, *, mains_key: str, match_mains,
                        extra_keys: Sequence[str] = ()) -> List[Tuple[str, Tensor, Tensor]]:
    """Everything a wrapper's ``load_state_dict`` will load, checked before it changes
    anything (shared by MixedPrecisionOptimizer and DistributedOptimizer): a dict (TypeError,
    also for None) with ``optimizer``, ``mains_key`` and ``extra_keys`` (KeyError); the inner
    optimizer state against the inner optimizer (:func:`check_inner_optimizer_state`: group
    and param counts, the class's hyperparameters, state keys and shapes, finite values); the
    scaler state against the scaler's config; the spike detector's state against the
    detector; the main params (``match_mains(saved) -> [(key, saved, target)]``, then float32,
    shapes and finiteness). Returns the matched main params."""
    check_mapping("state_dict", state_dict)
    for key in ("optimizer", mains_key, *extra_keys):
        if key not in state_dict:
            raise KeyError(f"optimizer state_dict has no {key!r} entry")
    check_inner_optimizer_state(wrapper.optimizer, state_dict["optimizer"])
    scaler = getattr(wrapper, "grad_scaler", None)
    scaler_state = state_dict.get("grad_scaler")
    if scaler is not None and scaler_state is not None:
        _prefixed("state_dict['grad_scaler']", scaler.check_state_dict, scaler_state)
    detector = getattr(wrapper, "spike_detector", None)
    spike_state = state_dict.get("spike_detector")
    if detector is not None and spike_state is not None:
        _prefixed("state_dict['spike_detector']", detector.check_state_dict, spike_state)
    pairs = match_mains(state_dict[mains_key])
    check_finite([(name, s) for name, s, _ in pairs])
    return pairs


def load_wrapper_state(wrapper, state_dict, *, mains_key: str, match_mains, after_copy,
                       extra_keys: Sequence[str] = (), before=None, agree_group=None,
                       per_group_mains: bool = True) -> None:
    """The one all-or-nothing load of the optimizer wrappers: ``before()`` (the wrapper's own
    checks, e.g. a layout), :func:`check_wrapper_state`; with ``agree_group`` (a group whose
    ranks load together and run a collective in ``after_copy``) one all-gather of a refused
    flag, so that a state dict refused on one rank is loaded on none (the others raise
    ValueError naming it); then (nothing can fail any more) the spike detector, the inner
    optimizer, the loss scaler (a RuntimeWarning when one side has no scaler state) and the
    main params, then ``after_copy()`` (main params -> model params). The step guard is reset
    and the settings are compared across ranks again at the next step. Param groups with
    override keys are matched by key, not by position (:func:`align_saved_groups`; ``match_mains``
    then gets the realigned main params); entries of a live group that the saved group lacks
    (e.g. an ``override_key`` added since) are kept."""
    error = None
    try:
        if before is not None:
            before()
        state_dict = align_saved_groups(wrapper, state_dict, mains_key=mains_key,
                                        per_group_mains=per_group_mains)
        pairs = check_wrapper_state(wrapper, state_dict, mains_key=mains_key,
                                    match_mains=match_mains, extra_keys=extra_keys)
    except (TypeError, KeyError, ValueError) as e:
        error = e
    if agree_group is not None and dist.is_initialized() and dist.get_world_size(agree_group) > 1:
        flags = gather_rows([1.0 if error is not None else 0.0], agree_group)
        if error is not None:
            raise error
        refused = [r for r, row in zip(dist.get_process_group_ranks(agree_group), flags) if row[0]]
        if refused:
            raise ValueError(
                f"the state_dict was refused on rank(s) {refused} of the group that loads "
                "together (see the error there); nothing was loaded on any rank"
            )
    elif error is not None:
        raise error
    detector = getattr(wrapper, "spike_detector", None)
    if detector is not None and state_dict.get("spike_detector") is not None:
        detector.load_state_dict(state_dict["spike_detector"])
    load_inner_state(wrapper.optimizer, state_dict["optimizer"])
    scaler = getattr(wrapper, "grad_scaler", None)
    scaler_state = state_dict.get("grad_scaler")
    if scaler is not None:
        if scaler_state is None:
            warnings.warn("the checkpoint has no grad_scaler state; the loss scaler starts afresh",
                          RuntimeWarning, stacklevel=3)
        else:
            scaler.load_state_dict(scaler_state)
    elif scaler_state:
        warnings.warn(
            "the checkpoint has grad_scaler state but this optimizer has no loss scaler; the "
            "saved loss scale is not used", RuntimeWarning, stacklevel=3,
        )
    with torch.no_grad():
        for _, s, target in pairs:
            local_tensor(target).copy_(local_tensor(s))
        after_copy()
    reset_step_guard(wrapper, settings=True)


def check_optimizer_state_dict(wrapper, state_dict) -> None:
    """:meth:`MixedPrecisionOptimizer.load_state_dict`'s checks (:func:`check_wrapper_state`
    with its ``fp32_from_fp16_params``), without loading."""
    state_dict = align_saved_groups(wrapper, state_dict, mains_key="fp32_from_fp16_params")
    check_wrapper_state(
        wrapper, state_dict, mains_key="fp32_from_fp16_params",
        match_mains=lambda saved: match_saved_tensors(
            "state_dict['fp32_from_fp16_params']", saved, wrapper.main_params_by_group()),
    )
