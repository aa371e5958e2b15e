"""The hyperparameters of a torch optimizer's param groups, checked wherever they arrive.

torch.optim checks its hyperparameters only in each class's constructor, and only the
defaults: a param group given as a dict with its own values, a group added later
(``add_param_group``), a value loaded by ``load_state_dict`` or one set between steps (an lr
scheduler, a user) is never checked, and some values torch accepts make the first step write
nan into the params (Adam's ``eps=0`` over a zero gradient divides 0 by 0; Muon's
``momentum >= 1`` grows the momentum without bound; an infinite lr times a zero update is nan).
tpamp checks them with the rules below (docs/spec.md section 14):

* at a :class:`tpamp.ParamGroupOverride`'s ``options`` (the name rules, no class known yet);
* when a group joins :class:`tpamp.TensorParallelMuon` / :class:`tpamp.TensorParallelAdafactor`
  (constructor and ``add_param_group``), at each of their steps and loads;
* when a tpamp wrapper is built around any inner optimizer, at every wrapper step (host values
  only: a tensor lr on an accelerator is read at construction and load, never in a step), and
  in every wrapper load (the saved groups, before anything changes).

Rules, by option name (a group's entry of that name, for a class this module knows, i.e. a
torch.optim class or a subclass; an unknown class gets only the ``lr`` rule):

* ``lr``: a real number (or a one-element tensor), finite and >= 0;
* ``weight_decay``, ``lr_decay``, ``initial_accumulator_value``, ``alpha``,
  ``momentum_decay``, ``dampening``: finite and >= 0; ``momentum``: finite, >= 0 (and < 1 for
  Muon, whose momentum is an average: ``buf.lerp_(grad, 1 - momentum)``); ``rho``: in [0, 1];
* ``eps``: a number: finite and > 0 (it is added to, or is the floor of, a denominator that a
  zero gradient makes 0); Adafactor's pair ``(eps1, eps2)``: eps1 None (the dtype's epsilon)
  or finite > 0 (the floor of the second moment whose rsqrt a zero gradient would make inf),
  eps2 finite >= 0;
* ``betas``: each in [0, 1); ``beta2_decay``: finite <= 0; ``d``: finite >= 1;
* ``ns_coefficients``: three finite numbers; ``ns_steps``: an int in [0, 100) (torch's bound);
  ``adjust_lr_fn``: None, ``"original"`` or ``"match_rms_adamw"``;
* ``nesterov``, ``maximize``, ``amsgrad``, ``centered``, ``capturable``, ``differentiable``,
  ``decoupled_weight_decay``: True or False; ``foreach``, ``fused``: True, False or None.

TypeError for a wrong type, ValueError for a value out of range; every message names where the
value is (the group and the key), the value and what was expected. What cannot be checked: an
optimizer class tpamp does not know (only its ``lr``), and a finite lr so large that a step
overflows the params (no value check can tell); docs/spec.md section 14.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Mapping
from typing import Callable, Dict, List, Optional, Sequence

import torch

__all__ = [
    "check_group_hyperparameters",
    "check_optimizer_hyperparameters",
    "check_option_values",
    "check_saved_group_hyperparameters",
    "group_optimizer_classes",
    "group_optimizers",
]

Tensor = torch.Tensor

# the classes whose options follow the rules of this module (and their subclasses)
_KNOWN = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
          torch.optim.RMSprop, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
          torch.optim.Adadelta, torch.optim.Muon, torch.optim.Adafactor)
_ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
_BOOL_OPTIONS = ("nesterov", "maximize", "amsgrad", "centered", "capturable", "differentiable",
                 "decoupled_weight_decay")
_BOOL_OR_NONE_OPTIONS = ("foreach", "fused")


def _label(where: str, idx) -> str:
    return where if idx is None else f"{where}[{idx}]"


def _value(where: str, value, read_tensors: bool, idx=None):
    """A real number from ``value`` (a one-element tensor read on the host, or None when it
    lives on an accelerator and ``read_tensors`` is False: no sync)."""
    where = _label(where, idx)
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.dtype.is_complex or value.dtype == torch.bool:
            raise TypeError(f"{where} must be a real number or a one-element tensor, got a "
                            f"tensor of shape {tuple(value.shape)} and dtype {value.dtype}")
        if value.device.type != "cpu" and not read_tensors:
            return None
        return float(value.detach().reshape(()).item())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where} must be a real number, got {value!r} ({type(value).__name__})")
    return float(value)


def _real(where, value, read_tensors, *, idx=None, low=None, low_open=False, high=None,
          high_open=False) -> None:
    v = value if type(value) is float else _value(where, value, read_tensors, idx)
    if v is None:
        return
    ok = (math.isfinite(v)
          and (low is None or (v > low if low_open else v >= low))
          and (high is None or (v < high if high_open else v <= high)))
    if ok:  # the message only for a refusal (this runs at every step)
        return
    bounds = []
    if low is not None:
        bounds.append(f"{'>' if low_open else '>='} {low}")
    if high is not None:
        bounds.append(f"{'<' if high_open else '<='} {high}")
    raise ValueError(f"{_label(where, idx)} must be finite"
                     f"{' and ' + ' and '.join(bounds) if bounds else ''}"
                     f", got {v!r}")


def _int(where, value, low, high_open) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{where} must be an int, got {value!r} ({type(value).__name__})")
    if not low <= value < high_open:
        raise ValueError(f"{where} must be an int in [{low}, {high_open}), got {value!r}")


def _seq(where, value, n: Optional[int]) -> Sequence:
    if not isinstance(value, (tuple, list)):
        raise TypeError(f"{where} must be a tuple, got {value!r} ({type(value).__name__})")
    if n is not None and len(value) != n:
        raise ValueError(f"{where} must have {n} entries, got {len(value)}: {tuple(value)!r}")
    return value


def _eps(where, value, read, cls) -> None:
    if isinstance(value, (tuple, list)) or (cls is not None and issubclass(cls, torch.optim.Adafactor)):
        eps1, eps2 = _seq(where, value, 2)
        if eps1 is not None:
            _real(where, eps1, read, idx=0, low=0.0, low_open=True)
        _real(where, eps2, read, idx=1, low=0.0)
        return
    _real(where, value, read, low=0.0, low_open=True)


def _betas(where, value, read, cls) -> None:
    for i, b in enumerate(_seq(where, value, 2 if cls is not None else None)):
        _real(where, b, read, idx=i, low=0.0, high=1.0, high_open=True)


def _momentum(where, value, read, cls) -> None:
    muon = cls is not None and issubclass(cls, torch.optim.Muon)
    _real(where, value, read, low=0.0, high=1.0 if muon else None, high_open=muon)


def _ns_coefficients(where, value, read, cls) -> None:
    for i, c in enumerate(_seq(where, value, 3)):
        _real(where, c, read, idx=i)


def _adjust_lr_fn(where, value, read, cls) -> None:
    if value not in _ADJUST_LR_FNS:
        raise ValueError(f"{where} must be one of {_ADJUST_LR_FNS}, got {value!r}")


def _nonneg(where, value, read, cls) -> None:
    _real(where, value, read, low=0.0)


_RULES: Dict[str, Callable] = {
    "lr": _nonneg,
    "weight_decay": _nonneg, "lr_decay": _nonneg, "initial_accumulator_value": _nonneg,
    "alpha": _nonneg, "momentum_decay": _nonneg, "dampening": _nonneg,
    "momentum": _momentum,
    "rho": lambda w, v, r, c: _real(w, v, r, low=0.0, high=1.0),
    "eps": _eps,
    "betas": _betas,
    "beta2_decay": lambda w, v, r, c: _real(w, v, r, high=0.0),
    "d": lambda w, v, r, c: _real(w, v, r, low=1.0),
    "ns_coefficients": _ns_coefficients,
    "ns_steps": lambda w, v, r, c: _int(w, v, 0, 100),
    "adjust_lr_fn": _adjust_lr_fn,
}


_LR_RULE = (("lr", _nonneg),)
# "[key]" of each option name, the start of a refusal's message (made once, not per step)
_KEY_LABEL = {n: f"[{n!r}]" for n in (*_RULES, *_BOOL_OPTIONS, *_BOOL_OR_NONE_OPTIONS)}


def _bool(where, value, allow_none: bool) -> None:
    if not (isinstance(value, bool) or (allow_none and value is None)):
        raise TypeError(f"{where} must be True or False{' or None' if allow_none else ''}, "
                        f"got {value!r} ({type(value).__name__})")


@functools.lru_cache(maxsize=None)
def _known(cls) -> bool:
    return isinstance(cls, type) and issubclass(cls, _KNOWN)


def check_group_hyperparameters(cls, group: Mapping, where: str = "param group", *,
                                read_tensors: bool = True) -> None:
    """Check the hyperparameters of one param group (a dict) for optimizer class ``cls`` by the
    rules of the module docstring: every rule whose option the group has, for a class this
    module knows (a torch.optim class or a subclass), else only ``lr``. ``read_tensors``
    False: a tensor on an accelerator is not read (no host sync; a step's check). Changes
    nothing. Raises TypeError / ValueError naming ``where``, the key and the value."""
    if not isinstance(group, Mapping):
        raise TypeError(f"{where} must be a dict, got {type(group).__name__}")
    known = _known(cls)
    try:  # the rules name only the key (no string work per step); the group is added below
        for name, rule in (_RULES.items() if known else _LR_RULE):
            if name in group:
                rule(_KEY_LABEL[name], group[name], read_tensors, cls)
        if known:
            for name in _BOOL_OPTIONS:
                if name in group and type(group[name]) is not bool:
                    _bool(_KEY_LABEL[name], group[name], False)
            for name in _BOOL_OR_NONE_OPTIONS:
                if name in group and group[name] is not None and type(group[name]) is not bool:
                    _bool(_KEY_LABEL[name], group[name], True)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{where}{e.args[0] if e.args else ''}") from None


def check_option_values(options: Mapping, where: str = "options") -> None:
    """The options of a param-group override (``ParamGroupOverride(options=...)``), before any
    optimizer class is known: every real number (also inside tuples) finite, and the name rules
    of the module docstring that hold for every optimizer (``eps`` > 0 or Adafactor's pair,
    ``betas`` in [0, 1), ``momentum`` >= 0, ``ns_steps``, ``ns_coefficients``,
    ``adjust_lr_fn``, the bool options). The class's own rules (Muon's momentum < 1, say)
    apply when the group joins its optimizer. Raises TypeError / ValueError naming the option."""
    for name, value in options.items():
        w = f"{where}[{name!r}]"
        _finite_leaves(w, value)
        if name in _RULES:
            _RULES[name](w, value, True, None)
        elif name in _BOOL_OPTIONS:
            _bool(w, value, False)
        elif name in _BOOL_OR_NONE_OPTIONS:
            _bool(w, value, True)


def _finite_leaves(where, value) -> None:
    if isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            _finite_leaves(f"{where}[{i}]", v)
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        if not math.isfinite(float(value)):
            raise ValueError(f"{where} must be finite, got {float(value)!r}")


def group_optimizers(optimizer) -> List[torch.optim.Optimizer]:
    """The optimizer that steps each of ``optimizer``'s param groups, in order: itself, or for
    an optimizer of parts (:class:`tpamp.CombinedOptimizer`: an ``optimizers`` list whose
    groups are the combined one's, in order) the part of each group."""
    parts = getattr(optimizer, "optimizers", None)
    if isinstance(parts, (list, tuple)) and parts and all(
            isinstance(o, torch.optim.Optimizer) for o in parts):
        out = []
        for part in parts:
            out += group_optimizers(part)
        if len(out) == len(optimizer.param_groups):
            return out
    return [optimizer] * len(optimizer.param_groups)


def group_optimizer_classes(optimizer) -> List[type]:
    """The class of :func:`group_optimizers`' optimizer of each param group."""
    return [type(o) for o in group_optimizers(optimizer)]


def check_optimizer_hyperparameters(optimizer, *, read_tensors: bool = True) -> None:
    """:func:`check_group_hyperparameters` of each of ``optimizer``'s live param groups, each
    by the class that steps it (:func:`group_optimizer_classes`). Changes nothing."""
    for gi, (cls, group) in enumerate(zip(group_optimizer_classes(optimizer),
                                          optimizer.param_groups)):
        check_group_hyperparameters(cls, group, f"{cls.__name__} param group {gi}",
                                    read_tensors=read_tensors)


def check_saved_group_hyperparameters(optimizer, saved_groups, where: str) -> None:
    """The saved param groups of a state dict ``optimizer`` will load (in its group order, one
    for each live group; the count is the caller's check), each by the rules of the class that
    will step it. Changes nothing."""
    if not isinstance(saved_groups, (list, tuple)):
        return
    for gi, (cls, saved) in enumerate(zip(group_optimizer_classes(optimizer), saved_groups)):
        if isinstance(saved, Mapping):
            check_group_hyperparameters(cls, saved, f"{where}[{gi}]")
