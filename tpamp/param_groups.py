"""Param-group overrides: the inner optimizer's param groups built from named params, with
Megatron-core's names (``ParamKey``, ``ParamGroupOverride``, ``lr_mult``, ``wd_mult``,
``max_lr``/``min_lr``, ``decoupled_lr``) and its default of no weight decay for biases and
1-D params (norm weights). docs/spec.md section 16.

Usage::

    groups = tpamp.build_param_groups(
        model.named_parameters(), lr=3e-4, weight_decay=0.1,
        overrides={tpamp.ParamKey(name="*.router.*"): tpamp.ParamGroupOverride(lr_mult=0.1)},
    )
    optimizer = tpamp.MixedPrecisionOptimizer(torch.optim.AdamW(groups), grad_scaler=scaler)

Every group carries an **override key** (``group["override_key"]``: ``"default"`` or the
definitions of the ParamKeys that matched, joined by ``" + "``) and the override's values
(``group["override"]``); the loads of every wrapper and of ``tpamp.checkpoint`` match a saved
group to a live one by that key, not by position (:func:`match_saved_groups`).
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from tpamp.hyperparameters import check_option_values

__all__ = [
    "DEFAULT_OVERRIDE_KEY",
    "OVERRIDE_KEY",
    "ParamGroupOverride",
    "ParamKey",
    "build_param_groups",
    "group_hyperparameters",
    "match_saved_groups",
]

Tensor = torch.Tensor

OVERRIDE_KEY = "override_key"  # the param-group entry that names a group's override
DEFAULT_OVERRIDE_KEY = "default"  # the key of the group of params no override matched
# group entries that describe membership, not hyperparameters (never copied between groups)
_MEMBERSHIP = ("params", "param_names")
# option names an override may not set: membership, tpamp's own entries, and the two
# hyperparameters an override sets through max_lr / lr_mult and wd_mult
_RESERVED = frozenset({*_MEMBERSHIP, OVERRIDE_KEY, "override", "lr", "weight_decay",
                       "initial_lr", "lr_mult", "wd_mult", "max_lr", "min_lr"})


def _as_tuple(what: str, value, kind) -> tuple:
    items = (value,) if isinstance(value, kind) else value
    if not isinstance(items, (tuple, list)) or not all(
            isinstance(v, kind) and not isinstance(v, bool) for v in items):
        raise TypeError(f"ParamKey.{what} must be a {kind.__name__} or a tuple of them, got {value!r}")
    return tuple(items)


@dataclass(frozen=True)
class ParamKey:
    """Which params an override applies to (Megatron-core's ``ParamKey``): a param matches
    when ANY criterion given matches.

    Args:
        name: glob pattern(s) (``fnmatch``, Unix shell syntax) on the param's name, e.g.
            ``"*.bias"`` or ``("embedding.*", "output_layer.weight")``.
        attr: attribute name(s); matches a param on which ``getattr(param, attr, False)`` is
            true (Megatron's ``is_embedding_or_output_parameter``).
        ndim: number(s) of dimensions, e.g. ``1`` for biases and norm weights. For a DTensor or
            a Megatron TP shard this is the global and local ndim alike.
        predicate: ``fn(param, name) -> bool``; needs ``predicate_name``, the stable text that
            stands for it in the override key (a function has no stable text of its own).
        predicate_name: see ``predicate``.

    Raises TypeError for a criterion of the wrong type, ValueError for a key with no criterion
    or a predicate without a name."""

    name: Union[str, Tuple[str, ...]] = ()
    attr: Union[str, Tuple[str, ...]] = ()
    ndim: Union[int, Tuple[int, ...]] = ()
    predicate: Optional[Callable[[Tensor, str], bool]] = field(default=None, compare=False,
                                                                 hash=False)
    predicate_name: str = ""

    def __post_init__(self):
        object.__setattr__(self, "name", _as_tuple("name", self.name, str))
        object.__setattr__(self, "attr", _as_tuple("attr", self.attr, str))
        object.__setattr__(self, "ndim", _as_tuple("ndim", self.ndim, int))
        if self.predicate is not None and not callable(self.predicate):
            raise TypeError(f"ParamKey.predicate must be callable, got {self.predicate!r}")
        if not isinstance(self.predicate_name, str):
            raise TypeError(f"ParamKey.predicate_name must be a str, got {self.predicate_name!r}")
        if (self.predicate is None) != (not self.predicate_name):
            raise ValueError(
                "ParamKey: give a predicate together with a predicate_name (the stable text of "
                f"the override key), got predicate={self.predicate!r}, "
                f"predicate_name={self.predicate_name!r}"
            )
        if not (self.name or self.attr or self.ndim or self.predicate is not None):
            raise ValueError("ParamKey needs at least one of name, attr, ndim or predicate")

    def matches(self, param: Tensor, name: str) -> bool:
        """Whether ``param`` (named ``name``) matches any criterion of this key."""
        return (any(fnmatch.fnmatchcase(name, pattern) for pattern in self.name)
                or any(getattr(param, a, False) for a in self.attr)
                or param.dim() in self.ndim
                or (self.predicate is not None and bool(self.predicate(param, name))))

    def describe(self) -> str:
        """The key's definition as stable text (part of the override key), e.g.
        ``"name=*.bias|ndim=1"``."""
        parts = [f"name={','.join(self.name)}" if self.name else "",
                 f"attr={','.join(self.attr)}" if self.attr else "",
                 f"ndim={','.join(map(str, self.ndim))}" if self.ndim else "",
                 f"predicate={self.predicate_name}" if self.predicate_name else ""]
        return "|".join(p for p in parts if p)


def _check_number(where: str, value, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"{where} must be a finite number {'> 0' if positive else '>= 0'}, "
                         f"got {value!r}")
    return float(value)


@dataclass(frozen=True)
class ParamGroupOverride:
    """What an override changes for the params its :class:`ParamKey` matches (the fields of
    Megatron-core's ``ParamGroupOverride``; None: unchanged).

    Args:
        max_lr: the group's own peak learning rate instead of ``lr`` (Megatron's
            ``decoupled_lr`` for the embedding and output layer is one).
        min_lr: the group's own end of the decay (kept in ``group["min_lr"]`` for a scheduler
            that reads it; torch's schedulers do not).
        lr_mult: multiplies the group's learning rate (``group["lr"] = max_lr * lr_mult``).
        wd_mult: multiplies the weight decay (``group["weight_decay"] = weight_decay *
            wd_mult``; 0.0 for no weight decay).
        options: other hyperparameters of the torch optimizer for these params (e.g.
            ``{"eps": 1e-10}``), given as a dict or (name, value) pairs.

    Raises TypeError / ValueError for a value that is not a finite number >= 0 (lr > 0), a
    min_lr above max_lr, an option that names a membership entry or a field above or is given twice, and an option
    value that breaks the rules every torch optimizer shares (:func:`tpamp.hyperparameters.
    check_option_values`: every number finite, ``eps`` > 0, ``betas`` in [0, 1), ``momentum``
    >= 0, ...); the optimizer class's own rules apply when the groups reach it."""

    max_lr: Optional[float] = None
    min_lr: Optional[float] = None
    lr_mult: Optional[float] = None
    wd_mult: Optional[float] = None
    options: Tuple[Tuple[str, Any], ...] = ()

    def __post_init__(self):
        for f in ("max_lr", "min_lr", "lr_mult", "wd_mult"):
            v = getattr(self, f)
            if v is not None:
                object.__setattr__(self, f, _check_number(f"ParamGroupOverride.{f}", v,
                                                          positive=f == "max_lr"))
        if self.max_lr is not None and self.min_lr is not None and self.min_lr > self.max_lr:
            raise ValueError(f"ParamGroupOverride.min_lr={self.min_lr!r} is above max_lr="
                             f"{self.max_lr!r}: the schedule decays from max_lr to min_lr")
        opts = self.options
        if isinstance(opts, Mapping):
            opts = tuple(opts.items())
        if not isinstance(opts, (tuple, list)) or not all(
                isinstance(o, (tuple, list)) and len(o) == 2 and isinstance(o[0], str) for o in opts):
            raise TypeError(f"ParamGroupOverride.options must be a dict of name -> value, got {opts!r}")
        bad = sorted({k for k, _ in opts} & _RESERVED)
        if bad:
            raise ValueError(
                f"ParamGroupOverride.options may not set {bad}: use max_lr / lr_mult for the "
                "learning rate and wd_mult for weight decay"
            )
        names = [k for k, _ in opts]
        twice = sorted({k for k in names if names.count(k) > 1})
        if twice:
            raise ValueError(f"ParamGroupOverride.options sets {twice} twice")
        # the values torch would check only in a constructor (tpamp.hyperparameters)
        check_option_values(dict(opts), "ParamGroupOverride.options")
        object.__setattr__(self, "options", tuple(sorted((k, v) for k, v in opts)))

    @classmethod
    def of(cls, value) -> "ParamGroupOverride":
        """``value`` as an override: itself, or a dict of the fields (Megatron's TypedDict
        form), other keys going to ``options``. TypeError for anything else."""
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            fields = {k: v for k, v in value.items() if k in ("max_lr", "min_lr", "lr_mult", "wd_mult")}
            extra = {k: v for k, v in value.items() if k not in fields and k != "options"}
            extra.update(dict(value.get("options", ())))
            return cls(**fields, options=extra)
        raise TypeError(f"an override must be a ParamGroupOverride or a dict, got {type(value).__name__}")

    def as_dict(self) -> Dict[str, Any]:
        """The fields set (not None) and the options, one flat dict."""
        out = {f: getattr(self, f) for f in ("max_lr", "min_lr", "lr_mult", "wd_mult")
               if getattr(self, f) is not None}
        out.update(self.options)
        return out


# Megatron-core's defaults
NO_WEIGHT_DECAY_KEY = ParamKey(name="*.bias", ndim=1)  # biases and 1-D params (norm weights)
DECOUPLED_LR_KEY = ParamKey(attr="is_embedding_or_output_parameter")


def _named(named_params) -> List[Tuple[str, Tensor]]:
    if isinstance(named_params, Mapping):
        named_params = named_params.items()
    out, seen_names, seen_ids = [], set(), {}
    for item in named_params:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], Tensor)):
            raise TypeError(
                "named_params must give (name, param) pairs (model.named_parameters()), got "
                f"{type(item).__name__}"
            )
        name, p = item
        if name in seen_names:
            raise ValueError(f"named_params lists the name {name!r} twice")
        if id(p) in seen_ids:
            raise ValueError(
                f"named_params lists one param as {seen_ids[id(p)]!r} and {name!r}: each param "
                "goes into exactly one group (tied params: give one name)"
            )
        seen_names.add(name)
        seen_ids[id(p)] = name
        if p.requires_grad:
            out.append((name, p))
    return out


def _override_pairs(overrides) -> List[Tuple[ParamKey, ParamGroupOverride]]:
    items = overrides.items() if isinstance(overrides, Mapping) else overrides
    out, seen = [], {}
    for item in items:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], ParamKey)):
            raise TypeError(
                "overrides must be a dict {ParamKey: ParamGroupOverride} or (ParamKey, "
                f"ParamGroupOverride) pairs, got {item!r}"[:300]
            )
        key, ov = item[0], ParamGroupOverride.of(item[1])
        text = key.describe()
        if text in seen:
            raise ValueError(f"two overrides have the same ParamKey {text!r}")
        seen[text] = True
        out.append((key, ov))
    return out


def build_param_groups(
    named_params: Union[Iterable[Tuple[str, Tensor]], Mapping[str, Tensor]],
    *,
    lr: float,
    weight_decay: float = 0.0,
    min_lr: Optional[float] = None,
    overrides: Union[Mapping[ParamKey, Any], Sequence[Tuple[ParamKey, Any]]] = (),
    no_weight_decay_for_1d: bool = True,
    decoupled_lr: Optional[float] = None,
    decoupled_min_lr: Optional[float] = None,
    decoupled_lr_key: ParamKey = DECOUPLED_LR_KEY,
    allow_unmatched: bool = False,
    process_group=None,
) -> List[Dict[str, Any]]:
    """The param groups of a torch optimizer (pass the list to its constructor) for the
    trainable params of ``named_params``, with Megatron-core's overrides
    (``megatron.core.optimizer._get_param_groups``).

    Each param gets the overrides whose :class:`ParamKey` matches it, merged (two that set one
    field to different values are an error); params with the same matched keys form one group.
    Built in, before ``overrides``: with ``no_weight_decay_for_1d`` (Megatron's default) biases
    (``*.bias``) and 1-D params get ``wd_mult=0.0``; with ``decoupled_lr`` the params that
    ``decoupled_lr_key`` matches (Megatron: ``is_embedding_or_output_parameter``, the
    embedding and output layer) get ``max_lr=decoupled_lr`` (and ``min_lr=decoupled_min_lr``).

    Each group dict: ``params`` (in ``named_params`` order), ``param_names`` (torch.optim's
    key), ``lr`` (= max_lr * lr_mult), ``weight_decay`` (= weight_decay * wd_mult),
    ``override_key`` (``"default"`` or the matched keys' :meth:`ParamKey.describe` joined by
    ``" + "`` in override order), ``override`` (the merged override's fields), Megatron's
    ``lr_mult``, ``wd_mult``, ``max_lr``, ``min_lr`` (for a scheduler that reads them: the
    group's lr is ``schedule(max_lr, min_lr) * lr_mult``), ``default_config`` (True unless the
    override sets an lr field: the group whose lr Megatron-LM logs) and the overrides'
    options. torch.optim
    keeps the extra entries and ignores them. Order: the default group first, then by override
    key (the same on every rank and run). With ``process_group`` (e.g. the world, for pipeline
    stages that hold different params) the keys are gathered over it (one all_gather_object)
    and every rank gets every group, empty ones included, as Megatron does, so that group
    indices agree across ranks.

    Args:
        named_params: (name, param) pairs or a {name: param} dict; frozen params
            (requires_grad=False) are left out.
        lr, weight_decay, min_lr: the defaults (lr > 0, weight_decay >= 0).
        allow_unmatched: True lets an override in ``overrides`` match no param (otherwise a
            ValueError; the built-in ones may always match nothing).

    Raises TypeError for a wrong type, ValueError for a name or param listed twice, a group
    whose min_lr is above its max_lr (Megatron's scheduler asserts max_lr >= min_lr), two
    overrides with one key, conflicting overrides of one param (naming the param, both keys
    and the field) and an override that matches nothing."""
    lr = _check_number("lr", lr, positive=True)
    weight_decay = _check_number("weight_decay", weight_decay)
    if min_lr is not None:
        min_lr = _check_number("min_lr", min_lr)
        if min_lr > lr:
            raise ValueError(f"min_lr={min_lr!r} is above lr={lr!r}: the schedule decays from "
                             "lr to min_lr (Megatron's scheduler: max_lr >= min_lr)")
    if not isinstance(decoupled_lr_key, ParamKey):
        raise TypeError(f"decoupled_lr_key must be a ParamKey, got {type(decoupled_lr_key).__name__}")
    if decoupled_min_lr is not None and decoupled_lr is None:
        raise ValueError("decoupled_min_lr applies only with decoupled_lr")
    params = _named(named_params)
    builtin: List[Tuple[ParamKey, ParamGroupOverride]] = []
    if no_weight_decay_for_1d:
        builtin.append((NO_WEIGHT_DECAY_KEY, ParamGroupOverride(wd_mult=0.0)))
    if decoupled_lr is not None:
        builtin.append((decoupled_lr_key, ParamGroupOverride(max_lr=decoupled_lr,
                                                             min_lr=decoupled_min_lr)))
    user = _override_pairs(overrides)
    every = builtin + user
    texts = [k.describe() for k, _ in every]
    if len(set(texts)) != len(texts):
        dup = sorted({t for t in texts if texts.count(t) > 1})
        raise ValueError(f"an override in overrides has the key of a built-in one: {dup} "
                         "(turn the built-in off: no_weight_decay_for_1d=False / decoupled_lr=None)")
    used = [False] * len(every)
    groups: Dict[str, Dict[str, Any]] = {}
    for name, p in params:
        merged: Dict[str, Any] = {}
        source: Dict[str, str] = {}
        matched = []
        for i, (key, ov) in enumerate(every):
            if not key.matches(p, name):
                continue
            used[i] = True
            matched.append(texts[i])
            for f, v in ov.as_dict().items():
                if f in merged and merged[f] != v:
                    raise ValueError(
                        f"param {name!r} is matched by the override {source[f]!r} ({f}={merged[f]!r}) "
                        f"and the override {texts[i]!r} ({f}={v!r}), which conflict: narrow one "
                        "key or give both the same value"
                    )
                merged[f], source[f] = v, texts[i]
        key = " + ".join(matched) if matched else DEFAULT_OVERRIDE_KEY
        g = groups.get(key)
        if g is None:
            g = groups[key] = _new_group(key, merged, lr, weight_decay, min_lr)
        g["params"].append(p)
        g["param_names"].append(name)
    unmatched = [texts[i] for i in range(len(builtin), len(every)) if not used[i]]
    if unmatched and not allow_unmatched:
        raise ValueError(f"the override(s) {unmatched} match no trainable param (pass "
                         "allow_unmatched=True to allow it)")
    if process_group is not None:
        import torch.distributed as dist

        mine = [(k, g["override"]) for k, g in groups.items()]
        gathered: List[Any] = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(gathered, mine, group=process_group)
        for rank_groups in gathered:
            for k, merged in rank_groups:
                if k not in groups:
                    groups[k] = _new_group(k, merged, lr, weight_decay, min_lr)
    order = sorted(groups, key=lambda k: (k != DEFAULT_OVERRIDE_KEY, k))
    return [groups[k] for k in order]


def _new_group(key, merged, lr, weight_decay, min_lr) -> Dict[str, Any]:
    max_lr = merged.get("max_lr", lr)
    end = merged.get("min_lr", min_lr)
    if end is not None and end > max_lr:
        raise ValueError(f"the group {key!r} decays from max_lr={max_lr!r} to min_lr={end!r}, "
                         "which is above it: give the override a min_lr <= its max_lr")
    lr_mult = merged.get("lr_mult", 1.0)
    wd_mult = merged.get("wd_mult", 1.0)
    group = {
        "params": [], "param_names": [],
        "lr": max_lr * lr_mult, "weight_decay": weight_decay * wd_mult,
        OVERRIDE_KEY: key, "override": dict(merged),
        "lr_mult": lr_mult, "wd_mult": wd_mult, "max_lr": max_lr,
        "min_lr": merged.get("min_lr", min_lr),
        # Megatron-LM's flag of a group on the default lr schedule (no override naming an lr
        # field): training.py logs that group's lr (get_canonical_lr_for_logging)
        "default_config": not any("lr" in k for k in merged),
    }
    group.update({k: v for k, v in merged.items()
                  if k not in ("max_lr", "min_lr", "lr_mult", "wd_mult")})
    return group


def group_hyperparameters(group: Mapping[str, Any]) -> Dict[str, Any]:
    """A param group's entries without its membership (``params``, ``param_names``): what a
    checkpoint saves as the group's hyperparameters and a load copies into the live group."""
    return {k: v for k, v in group.items() if k not in _MEMBERSHIP}


def match_saved_groups(saved: Sequence[Mapping], live: Sequence[Mapping],
                       where: str = "the checkpoint") -> Optional[List[int]]:
    """For each live param group, the index of the saved group it loads from, matched by
    override key (docs/spec.md section 16); None when either side has a group without an
    ``override_key`` (positional, as before overrides existed).

    Raises ValueError naming the key for: a key twice on one side, a live key the checkpoint
    lacks or a saved key this optimizer lacks (a changed override), and a saved group whose
    ``override`` fields differ from the live group's."""
    def keys_of(groups):
        ks = [g.get(OVERRIDE_KEY) if isinstance(g, Mapping) else None for g in groups]
        return ks if ks and all(isinstance(k, str) for k in ks) else None

    saved_keys, live_keys = keys_of(saved), keys_of(live)
    if saved_keys is None or live_keys is None:
        return None
    for side, ks in (("the checkpoint", saved_keys), ("this optimizer", live_keys)):
        dup = sorted({k for k in ks if ks.count(k) > 1})
        if dup:
            raise ValueError(f"{side} has two param groups with the override key(s) {dup}")
    new = [k for k in live_keys if k not in saved_keys]
    gone = [k for k in saved_keys if k not in live_keys]
    if new or gone:
        raise ValueError(
            f"the param-group overrides differ from {where}'s: "
            + "; ".join(([f"override key(s) {new} not in {where}"] if new else [])
                        + ([f"{where}'s override key(s) {gone} not in this optimizer"] if gone else []))
            + " (a changed override: build the groups as when it was saved)"
        )
    perm = [saved_keys.index(k) for k in live_keys]
    changed = []
    for k, i, g in zip(live_keys, perm, live):
        s_ov, l_ov = saved[i].get("override"), g.get("override")
        if s_ov == l_ov:
            continue
        if not (isinstance(s_ov, Mapping) and isinstance(l_ov, Mapping)):
            changed.append(f"the override {k!r} is {s_ov!r} in {where}, {l_ov!r} here")
            continue
        for f in sorted(set(s_ov) | set(l_ov)):
            if s_ov.get(f) != l_ov.get(f):
                changed.append(f"the override {k!r} has {f}={s_ov.get(f)!r} in {where}, "
                               f"{f}={l_ov.get(f)!r} here")
    if changed:
        raise ValueError("; ".join(changed) + " (a changed override: its hyperparameters differ "
                         "from the saved ones)")
    return perm
