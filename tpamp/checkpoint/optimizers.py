"""The optimizer side of a checkpoint, through public methods only: each optimizer's
``sharded_state_dict()`` / ``load_sharded_state_dict()`` (the hook of the package docstring), and
the record of the inner optimizer's class and param-group structure that a load checks
(``optimizer.meta``).
"""

from __future__ import annotations

import bisect
import inspect
import math
from typing import Any, Dict, Mapping, Optional

import torch

from tpamp.checkpoint.keys import MAIN, META
from tpamp.checkpoint.layout import local_part, local_parts
from tpamp.checkpoint.plan import ReadPlan

__all__ = [
    "optimizer_hooks", "inner_optimizer", "class_name", "optimizer_record", "param_group_index",
    "check_optimizer_meta", "group_value_problem", "saved_groups_in_live_order",
]

Tensor = torch.Tensor


def optimizer_hooks(optimizer, tensor_parallel_group):
    """The save's or load's handle on ``optimizer``'s two hook methods (package docstring).
    Raises TypeError for an optimizer without them."""
    if callable(getattr(optimizer, "sharded_state_dict", None)) and \
            callable(getattr(optimizer, "load_sharded_state_dict", None)):
        return _OptimizerHooks(optimizer, tensor_parallel_group)
    raise TypeError(
        f"optimizer must be a tpamp MixedPrecisionOptimizer/FP32Optimizer or have "
        f"sharded_state_dict/load_sharded_state_dict methods; got {type(optimizer).__name__}"
    )


class _OptimizerHooks:
    """An optimizer's two public hook methods (package docstring), their result checked. An
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

    def load_sharded_state_dict(self, state):
        self.opt.load_sharded_state_dict(state)


def inner_optimizer(optimizer):
    """The torch.optim optimizer a tpamp wrapper steps (``optimizer.optimizer``), or None."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else None


def class_name(obj) -> str:
    """``module.QualifiedName`` of ``obj``'s class (the optimizer record's class name)."""
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def optimizer_record(optimizer, group_of: Mapping[str, int]) -> dict:
    """The checkpoint's ``optimizer.meta``: the inner optimizer's class name and, per param
    group, its hyperparameter keys and the global names of its params (``group_of``: {name:
    group index}, agreed over all ranks); a load checks a live optimizer against it."""
    inner = inner_optimizer(optimizer)
    return {
        "optimizer": class_name(inner) if inner is not None else class_name(optimizer),
        "param_groups": [
            {"keys": sorted(k for k in g if k not in ("params", "param_names")),
             "params": sorted(n for n, gi in group_of.items() if gi == i),
             # the override key of docs/spec.md section 16, when the group has one
             **({"override_key": g["override_key"], "override": g.get("override")}
                if "override_key" in g else {}),
             # the part of a tpamp.CombinedOptimizer that steps the group, when it has one
             **({"optimizer_part": g["optimizer_part"]} if "optimizer_part" in g else {})}
            for i, g in enumerate(inner.param_groups if inner is not None else [])
        ],
    }


def saved_groups_in_live_order(optimizer, saved) -> tuple:
    """The saved param groups (hyperparameters, or the records of ``optimizer.meta``) in the
    order of the optimizer's inner groups, through its public ``align_param_groups`` (by
    override key, docs/spec.md section 16); as saved (by position) for an optimizer without
    that method. Raises ValueError naming the key of a changed override."""
    align = getattr(optimizer, "align_param_groups", None)
    return tuple(saved) if align is None else tuple(align(saved))


def param_group_index(mains: Mapping[str, Any], inner, optimizer=None,
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
            loc = local_part(p)
            if loc.numel():
                start = loc.data_ptr()
                spans.append((start, start + loc.numel() * loc.element_size(), gi, loc.device))
    spans.sort(key=lambda s: s[0])
    starts = [s[0] for s in spans]
    out = {}
    for name, view in mains.items():
        parts = [t for t in local_parts(view) if t.numel()]
        if not parts:
            continue
        ptr = parts[0].data_ptr()
        i = bisect.bisect_right(starts, ptr) - 1
        if i >= 0 and ptr < spans[i][1] and spans[i][3] == parts[0].device:
            out[name] = spans[i][2]
        elif id(model_params.get(name) if model_params is not None else None) in by_model:
            out[name] = by_model[id(model_params[name])]
    return out


def check_optimizer_meta(plan: ReadPlan, optimizer, osd, shared, model_params=None) -> None:
    """The saved optimizer's class and param-group structure against this one's (plan time)."""
    inner = inner_optimizer(optimizer)
    if inner is None:
        return
    live = class_name(inner)
    fix = ("; pass reset_optimizer_state=True to load the params and start the optimizer "
           "state afresh")
    if META not in plan.md:
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
    try:  # by override key when the groups have one, else by position
        saved_groups = saved_groups_in_live_order(optimizer, saved_groups)
    except ValueError as e:
        plan.problems.append(f"{e}{fix}")
        return
    if len(saved_groups) != len(inner.param_groups):
        plan.problems.append(
            f"the checkpoint has {len(saved_groups)} param groups, the optimizer has "
            f"{len(inner.param_groups)}{fix}"
        )
        return
    saved_of = {n: i for i, g in enumerate(saved_groups) for n in g["params"]}
    moved = [
        f"{n!r} (group {gi} here, {saved_of.get(n)} in the checkpoint)"
        for n, gi in sorted(param_group_index(osd["main_params"], inner, optimizer,
                                               model_params).items())
        if n not in shared and saved_of.get(n) != gi and MAIN + n in plan.md
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


def group_value_problem(i: int, key: str, saved, live) -> Optional[str]:
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
