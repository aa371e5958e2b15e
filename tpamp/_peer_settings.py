"""What the cross-rank settings check compares between peers, beyond the wrapper's own
settings (docs/spec.md section 2.4): the inner optimizer's hyperparameters per param group and
the params' layout; and the check of the groups a wrapper is given against its
``parallel_state`` (section 19).

**Peers.** Ranks that step the same params with the same math must hold the same param groups
with the same hyperparameters: the ranks of each group a wrapper reduces over -- tensor-parallel
(the wrapper's and the inner optimizer's, e.g. ``TensorParallelMuon(tensor_parallel_group=)``),
data-parallel (DP, or DP x CP), expert-tensor-parallel, expert-data-parallel and
expert-parallel. Pipeline stages hold other layers: ranks of different stages are never
compared. TP peers also hold the same params in the same layout (local shape, dtype,
``tensor_model_parallel``, ``partition_dim``, ``partition_stride``; a DTensor's global shape
and placements): even TP shards.

**In the one all-gather.** :func:`payload` is appended to the settings row that
``tpamp._guards.agree_on_settings`` all-gathers: per peer kind, an id of this rank's group of
that kind (a 52-bit hash of its global ranks; -1 for none or one rank), and three 52-bit
digests (hyperparameters, dense layout, expert layout; the layouts as int64 numbers, fast). Every rank receives every row, so every
rank finds the same mismatches (:func:`mismatches`): rows with the same id of a kind are peers
and must carry the same digests. Only when one differs does a second collective (one
``all_gather_object`` of the full descriptions, :func:`explain`) find the first option that
differs, so that every rank raises the same ValueError naming the option, the group, the ranks
and each rank's value.

Hyperparameters are compared by value: numbers exactly (``repr`` of the float), strings, None,
tuples and dicts element by element, a tensor (a tensor ``lr``) by dtype, shape and values (not
its device), a ``torch.device`` by its type; an object of another type by its class name only
(its ``repr`` may hold an address).
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from tpamp.common import is_dtensor, local_tensor
from tpamp.grad_stats import is_expert_param

__all__ = ["PEER_KINDS", "check_inner_groups", "check_parallel_groups", "check_partition_dims",
           "describe", "explain", "mismatches", "payload"]

Tensor = torch.Tensor

# (label, what is compared): "hp" hyperparameters, "dense" / "expert" the params' layout
PEER_KINDS = (
    ("tensor-parallel", ("hp", "dense", "expert-if-same")),
    ("inner optimizer's tensor-parallel", ("hp", "dense", "expert-if-same")),
    ("data-parallel", ("hp",)),
    ("expert-tensor-parallel", ("hp", "expert")),
    ("expert-data-parallel", ("hp",)),
    ("expert-parallel", ("hp",)),
)
_DIGESTS = ("hp", "dense", "expert")
_MEMBERSHIP = ("params", "param_names")  # group entries that are not hyperparameters


def _bits52_bytes(data: bytes) -> float:
    """A 52-bit hash of ``data``, exact in a float64."""
    return float(int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 12)


def _bits52(text: str) -> float:
    """A 52-bit hash of ``text``, exact in a float64."""
    return _bits52_bytes(text.encode())


def _ranks(group) -> Optional[Tuple[int, ...]]:
    if group is None or not dist.is_initialized():
        return None
    ranks = tuple(dist.get_process_group_ranks(group))
    return ranks if len(ranks) > 1 else None


def _inner_tp_group(optimizer):
    parts = getattr(optimizer, "optimizers", None) or [optimizer]
    for part in parts:
        group = getattr(part, "tensor_parallel_group", None)
        if group is not None:
            return group
    return None


def _peer_groups(wrapper) -> List[Optional[Tuple[int, ...]]]:
    """This rank's group of each kind of PEER_KINDS, as its global ranks (None: none)."""
    state = getattr(wrapper, "parallel_state", None)
    ep = getattr(wrapper, "expert_parallel_group", None)
    if ep is None and state is not None:
        ep = state.ep_group
    dp = getattr(wrapper, "data_parallel_group", None)
    if dp is None:  # tpamp.fsdp.fully_shard_optimizer: the group its params are sharded over
        dp = getattr(wrapper, "fsdp_data_parallel_group", None)
    groups = [
        getattr(wrapper, "tensor_parallel_group", None),
        _inner_tp_group(wrapper.optimizer),
        dp,
        getattr(wrapper, "expert_tensor_parallel_group", None),
        getattr(wrapper, "expert_data_parallel_group", None),
        ep,
    ]
    return [_ranks(g) for g in groups]


# ---- what is compared ---------------------------------------------------------------------


def _canonical(v):
    """A comparable, hashable picture of a hyperparameter value (module docstring)."""
    if isinstance(v, Tensor):
        t = local_tensor(v).detach()
        return ("tensor", str(t.dtype), tuple(t.shape),
                tuple(repr(float(x)) for x in t.reshape(-1).cpu().double().tolist()))
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return ("float", repr(v))
    if isinstance(v, (tuple, list)):
        return tuple(_canonical(x) for x in v)
    if isinstance(v, dict):
        return ("dict",) + tuple(sorted((str(k), _canonical(x)) for k, x in v.items()))
    if isinstance(v, torch.dtype):
        return str(v)
    if isinstance(v, torch.device):  # each rank has its own device index
        return ("device", v.type)
    return ("object", f"{type(v).__module__}.{type(v).__qualname__}")


def _shown(v) -> str:
    if isinstance(v, Tensor):
        t = local_tensor(v).detach()
        values = t.reshape(-1).cpu().tolist()
        inner = values[0] if t.dim() == 0 else values
        return f"tensor({inner!r}, dtype={t.dtype})"
    if v is None or isinstance(v, (bool, int, float, str, torch.dtype, torch.device)):
        return repr(v)
    if isinstance(v, (tuple, list)):
        parts = ", ".join(_shown(x) for x in v)
        return f"({parts}{',' if len(v) == 1 else ''})" if isinstance(v, tuple) else f"[{parts}]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k!r}: {_shown(x)}" for k, x in v.items()) + "}"
    return f"a {type(v).__qualname__}"


_PLAIN_FIELDS = ("dtype", "requires_grad", "local shape", "tensor_model_parallel",
                 "partition_dim", "partition_stride")
_DTENSOR_FIELDS = ("dtype", "requires_grad", "global shape", "placements")


def _layout(p: Tensor) -> Tuple[Tuple[str, ...], tuple]:
    """(field names, values) of one param's layout that TP peers share."""
    if is_dtensor(p):
        return _DTENSOR_FIELDS, (str(p.dtype), bool(p.requires_grad), tuple(p.shape),
                                 tuple(str(pl) for pl in p.placements))
    tp = bool(getattr(p, "tensor_model_parallel", False))
    return _PLAIN_FIELDS, (str(p.dtype), bool(p.requires_grad), tuple(p.shape), tp,
                           getattr(p, "partition_dim", None) if tp else None,
                           getattr(p, "partition_stride", 1) if tp else None)


_CODES: Dict[str, int] = {}


def _code(text: str) -> int:
    """A 52-bit number for a string (the same on every rank; cached)."""
    code = _CODES.get(text)
    if code is None:
        code = _CODES[text] = int(_bits52(text))
    return code


def _layout_ints(p: Tensor, out: array) -> None:
    """Append one param's layout as int64 numbers (what :func:`_layout` holds; fast: the
    digest of every param is taken on each rank's first step)."""
    shape = p.shape
    if is_dtensor(p):
        out.extend((-2, _code(str(p.dtype)), int(p.requires_grad), len(shape), *shape,
                    _code(repr(tuple(str(pl) for pl in p.placements)))))
        return
    tp = getattr(p, "tensor_model_parallel", False)
    if tp:
        dim, stride = getattr(p, "partition_dim", None), getattr(p, "partition_stride", 1)
        extra = (dim if isinstance(dim, int) else _code(repr(dim)),
                 stride if isinstance(stride, int) else _code(repr(stride)))
    else:
        extra = (-1, -1)
    out.extend((-3, _code(str(p.dtype)), int(p.requires_grad), len(shape), *shape,
                int(bool(tp)), *extra))


def _named_params(wrapper) -> List[Tuple[str, Tensor]]:
    named = getattr(wrapper, "named_model_params", None)
    if named is not None:
        return list(named())
    return [(f"param {pi} of param group {gi}", p)
            for gi, g in enumerate(wrapper.optimizer.param_groups)
            for pi, p in enumerate(g["params"])]


def _hyperparameters(wrapper) -> list:
    """Per param group of the inner optimizer, [(key, canonical value, shown value)] of every
    entry but the params (and their names)."""
    return [[(str(k), _canonical(v), _shown(v)) for k, v in sorted(
        group.items(), key=lambda kv: str(kv[0])) if k not in _MEMBERSHIP]
        for group in wrapper.optimizer.param_groups]


def describe(wrapper) -> Dict[str, list]:
    """This rank's description (taken only on a mismatch, for the message): ``"hp"``: per
    param group of the inner optimizer, [(key, canonical value, shown value)];
    ``"dense"`` / ``"expert"``: per model param of that kind, (name, field names, values)."""
    dense, expert = [], []
    for name, p in _named_params(wrapper):
        (expert if is_expert_param(p) else dense).append((str(name), *_layout(p)))
    return {"hp": _hyperparameters(wrapper), "dense": dense, "expert": expert}


def payload(wrapper) -> List[float]:
    """The floats appended to the settings row: per PEER_KINDS an id of this rank's group,
    then the digests of the hyperparameters and of the dense and expert params' layout (by
    position: names may differ per rank, experts named by their global index)."""
    hp = _bits52(repr([[(k, c) for k, c, _ in g] for g in _hyperparameters(wrapper)]))
    dense, expert = array("q"), array("q")
    for _, p in _named_params(wrapper):
        _layout_ints(p, expert if is_expert_param(p) else dense)
    ids = [-1.0 if r is None else _bits52(repr(r)) for r in _peer_groups(wrapper)]
    return ids + [hp, _bits52_bytes(dense.tobytes()), _bits52_bytes(expert.tobytes())]


def mismatches(rows: Sequence[Sequence[float]], ranks: Sequence[int]) -> List[tuple]:
    """From every rank's payload (``rows``, one per global rank of ``ranks``): the (kind label,
    peers' global ranks, what) whose digests differ among peers, in PEER_KINDS order."""
    n = len(PEER_KINDS)
    found = []
    for k, (label, compared) in enumerate(PEER_KINDS):
        peers: Dict[float, List[int]] = {}
        for i, row in enumerate(rows):
            if row[k] != -1.0:
                peers.setdefault(row[k], []).append(i)
        for members in peers.values():
            if len(members) < 2:
                continue
            for what in compared:
                name = what
                if what == "expert-if-same":  # expert layout over TP when expert-TP is TP
                    if any(rows[i][3] != rows[i][k] for i in members):
                        continue
                    name = "expert"
                col = [rows[i][n + _DIGESTS.index(name)] for i in members]
                if any(c != col[0] for c in col):
                    found.append((label, [ranks[i] for i in members], name))
    return found


def _first_difference(descriptions: List[Dict[str, list]], what: str) -> str:
    """The first option (or param layout) that differs among ``descriptions`` (peers'), as
    "<thing> differs ... (rank r: value, ...)" without the rank list filled in."""
    parts = [d[what] for d in descriptions]
    noun = "param groups of the inner optimizer" if what == "hp" else f"{what} params"
    counts = [len(p) for p in parts]
    if any(c != counts[0] for c in counts):
        return f"the number of {noun}", [str(c) for c in counts]
    for i in range(counts[0]):
        items = [p[i] for p in parts]
        if what == "hp":
            keys = [[k for k, _, _ in g] for g in items]
            if any(k != keys[0] for k in keys):
                return (f"the options of param group {i}",
                        [str(sorted(k)) for k in keys])
            for j, (key, _, _) in enumerate(items[0]):
                values = [g[j][1] for g in items]
                if any(v != values[0] for v in values):
                    return f"{key!r} of param group {i}", [g[j][2] for g in items]
        else:
            name = items[0][0]
            layouts = [dict(zip(fields, values)) for _, fields, values in items]
            for field in items[0][1]:
                values = [lay.get(field) for lay in layouts]
                if any(v != values[0] for v in values):
                    return (f"the {field} of {what} param {i} ({name!r})",
                            [repr(v) for v in values])
            if any(lay != layouts[0] for lay in layouts):
                return (f"the layout of {what} param {i} ({name!r})",
                        [repr(lay) for lay in layouts])
    return f"the {noun}", ["(differs)"] * len(parts)


def explain(found: List[tuple], wrapper, group, ranks: Sequence[int]):
    """Collective over ``group`` (global ``ranks``), on a mismatch only: gather every rank's
    :func:`describe` and return the ValueError (the same on every rank) for the first of
    ``found``."""
    every: List[Optional[Dict[str, list]]] = [None] * len(ranks)
    dist.all_gather_object(every, describe(wrapper), group=group)
    label, members, what = found[0]
    by_rank = dict(zip(ranks, every))
    thing, values = _first_difference([by_rank[r] for r in members], what)
    per_rank = ", ".join(f"rank {r}: {v}" for r, v in zip(members, values))
    if what == "hp":
        why = ("these ranks step the same params, so the inner optimizers must use the same "
               "hyperparameters (otherwise the gathered model mixes both settings, or the "
               "ranks run different collectives); set them alike on every rank")
    else:
        why = ("TP peers must hold the same params in the same layout: even shards of the "
               "same global shape, the same dtype, tensor_model_parallel, partition_dim and "
               "partition_stride")
    return ValueError(
        f"{thing} differs across the {len(members)} ranks of the {label} group {list(members)} "
        f"({per_rank}); {why}"
    )


# ---- layout checks at construction -----------------------------------------------------------


def check_partition_dims(optimizer) -> None:
    """ValueError for a Megatron TP param (``tensor_model_parallel=True``) of the inner
    optimizer whose ``partition_dim`` is not an int in [0, ndim) (Megatron sets 0 or 1 on
    a 2-D weight): a dim taken modulo ndim would split another dim than the one sharded."""
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            if not getattr(p, "tensor_model_parallel", False) or is_dtensor(p):
                continue
            dim = getattr(p, "partition_dim", None)
            if isinstance(dim, bool) or not isinstance(dim, int) or not 0 <= dim < p.dim():
                raise ValueError(
                    f"param {pi} of param group {gi} (shape {tuple(p.shape)}) is a Megatron TP "
                    f"shard (tensor_model_parallel=True) with partition_dim={dim!r}; expected "
                    f"an int in [0, {p.dim()}): the dim along which the TP ranks split it")


def check_inner_groups(optimizer, tensor_parallel_group) -> None:
    """ValueError when the inner optimizer (or a part of a CombinedOptimizer) has a
    ``tensor_parallel_group`` (TensorParallelMuon, TensorParallelAdafactor) of other ranks
    than the wrapper's: the two would count and reduce over different TP peers."""
    if tensor_parallel_group is None or not dist.is_initialized():
        return
    want = _group_ranks(tensor_parallel_group)
    for part in getattr(optimizer, "optimizers", None) or [optimizer]:
        group = getattr(part, "tensor_parallel_group", None)
        if group is None or not isinstance(group, dist.ProcessGroup):
            continue
        ranks = _group_ranks(group)
        if sorted(ranks) != sorted(want):
            raise ValueError(
                f"the inner {type(part).__name__}'s tensor_parallel_group (ranks {ranks}) is "
                f"not the wrapper's tensor_parallel_group (ranks {want}): both must be the "
                "same TP group")


def _group_ranks(group) -> List[int]:
    return list(dist.get_process_group_ranks(group))


def check_parallel_groups(parallel_state, **given) -> None:
    """The groups a wrapper is given, against its ``parallel_state`` (docs/spec.md section
    19), before any collective; a group given as None is not checked. ValueError naming the
    argument, both rank lists and the group to pass:

    * ``data_parallel_group``: the DP x CP group (``parallel_state.dp_cp_group``; the DP
      group when cp = 1): dense grads are reduced over DP and CP (Megatron-core), so a DP
      group without the CP ranks would leave the CP ranks' grads unsummed;
    * ``tensor_parallel_group``: ``parallel_state.tp_group``;
    * ``expert_data_parallel_group`` / ``expert_tensor_parallel_group``: the parallel state's
      groups of those names (``expert_tp_group``);
    * ``expert_grad_stats_group``: a group holding every rank of
      ``parallel_state.expert_model_parallel_group`` (expert-TP x EP x PP; a wider group such
      as every rank is allowed).
    """
    from tpamp.parallel import ParallelState

    if not isinstance(parallel_state, ParallelState) or not dist.is_initialized():
        return  # None; another type is refused by the wrapper's own check (TypeError)
    exact = {
        "data_parallel_group": ("dp_cp_group", parallel_state.dp_cp_group),
        "tensor_parallel_group": ("tp_group", parallel_state.tp_group),
        "expert_data_parallel_group": ("expert_data_parallel_group",
                                       parallel_state.expert_data_parallel_group),
        "expert_tensor_parallel_group": ("expert_tp_group", parallel_state.expert_tp_group),
    }
    for arg, group in given.items():
        if group is None:
            continue
        ranks = _group_ranks(group)
        if arg == "expert_grad_stats_group":
            need = parallel_state.expert_model_parallel_group
            if need is not None and not set(_group_ranks(need)) <= set(ranks):
                raise ValueError(
                    f"expert_grad_stats_group (ranks {ranks}) does not hold every rank of "
                    f"parallel_state.expert_model_parallel_group (ranks {_group_ranks(need)}, "
                    "expert-TP x EP x PP): expert grad statistics would miss ranks; pass that "
                    "group (or a wider one) or leave expert_grad_stats_group None")
            continue
        name, want = exact[arg]
        if want is None:
            continue
        want_ranks = _group_ranks(want)
        if sorted(ranks) == sorted(want_ranks):
            continue
        if arg == "data_parallel_group" and parallel_state.dims.cp > 1:
            raise ValueError(
                f"data_parallel_group (ranks {ranks}) is not parallel_state.dp_cp_group (ranks "
                f"{want_ranks}) although parallel_state has cp = {parallel_state.dims.cp}: the "
                "context-parallel ranks' grads would never be summed and the replicas would "
                "drift apart; pass data_parallel_group=parallel_state.dp_cp_group "
                "(Megatron-core reduces dense grads over DP x CP)")
        raise ValueError(
            f"{arg} (ranks {ranks}) is not parallel_state.{name} (ranks {want_ranks}): the "
            f"wrapper would reduce over other ranks than the layout's; pass "
            f"{arg}=parallel_state.{name} (or leave it None where that is the default)")
