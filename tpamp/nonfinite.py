"""Where an inf or NaN came from: per-parameter attribution of a skipped step's non-finite
gradients, and an opt-in tracer of non-finite (or nearly overflowing) activations.

Gradients. On a step whose found_inf is set, tpamp's optimizers count the inf and NaN elements
of each local gradient (one pass over this rank's grads, taken only on that rare step: a clean
step costs nothing beyond the grad-stats pass it already runs) and gather the non-empty counts
over the grad-stats group in one small collective (``all_gather_object``), so every rank of the
group holds the same list of :class:`NonFiniteGrad` records in ``optimizer.last_nonfinite``:
the parameter's (global) name, the tensor-, pipeline- and data-parallel rank whose gradient held
the values, and the counts. :class:`tpamp.DistributedOptimizer` counts the local gradients
before the data-parallel reduce-scatter mixes the DP ranks (its grad buffer still holds them),
so the DP rank is the one where the value arose. Megatron-LM, DeepSpeed and torch.amp report
only that a step was skipped.

Activations. :class:`NonFiniteTracer` (opt-in, not for every step: it reads every module's
output on the host) hooks every module of a model and finds the first module in execution order
whose forward output, or whose backward gradient (w.r.t. its output or its inputs), is
non-finite or, for fp16/bf16 tensors, within a factor ``margin`` of the dtype's largest value;
:meth:`NonFiniteTracer.result` agrees on the earliest finding along the pipeline over a group.
The single-process idea is HF Transformers' ``DebugUnderflowOverflow``.

Usage::

    opt = tpamp.MixedPrecisionOptimizer(inner, ..., param_names=stage.global_named_parameters(),
                                        parallel_state=st)
    ok, norm, zeros = opt.step()
    if not ok:
        print(tpamp.nonfinite.describe(opt.last_nonfinite))
        # inf in blocks.3.mlp.fc2.weight [tp 1, pp 1, dp 0] and 2 more

    with tpamp.NonFiniteTracer(stage, parallel_state=st) as tracer:
        ...forward/backward of one iteration...
    finding = tracer.result(group=dist.group.WORLD)   # the same on every rank, or None
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from tpamp._checks import check_param_names, check_real

__all__ = [
    "NonFiniteGrad",
    "ExpertNonFiniteGrad",
    "nonfinite_record",
    "NonFiniteActivation",
    "NonFiniteTracer",
    "RankCoords",
    "rank_coords",
    "expert_rank_coords",
    "count_nonfinite",
    "gather_nonfinite",
    "describe",
    "param_name_map",
    "local_records",
]

Tensor = torch.Tensor


class RankCoords(NamedTuple):
    """This rank's (tp_rank, pp_rank, dp_rank) and global ``rank``; a coordinate that is not
    known (no group or parallel state given) is None. For expert params
    (:func:`expert_rank_coords`) tp_rank and dp_rank are the expert-TP and expert-data-parallel
    ranks and ``ep_rank`` the expert-parallel rank (None for dense params)."""

    tp_rank: Optional[int]
    pp_rank: Optional[int]
    dp_rank: Optional[int]
    rank: int
    ep_rank: Optional[int] = None


def rank_coords(parallel_state=None, *, tensor_parallel_group=None, data_parallel_group=None) -> RankCoords:
    """This rank's coordinates: from a :class:`tpamp.parallel.ParallelState` when given (all
    three), else the TP rank from ``tensor_parallel_group`` (0 without one) and the DP rank from
    ``data_parallel_group`` (None without one), the PP rank None. Raises TypeError for a
    parallel_state that is not a ParallelState."""
    from tpamp.parallel import ParallelState

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if parallel_state is not None:
        if not isinstance(parallel_state, ParallelState):
            raise TypeError(
                "parallel_state must be a tpamp.parallel.ParallelState (from "
                f"initialize_model_parallel), got {type(parallel_state).__name__}"
            )
        return RankCoords(parallel_state.tp_rank, parallel_state.pp_rank, parallel_state.dp_rank, rank)
    tp = dist.get_rank(tensor_parallel_group) if tensor_parallel_group is not None else 0
    dp = dist.get_rank(data_parallel_group) if data_parallel_group is not None else None
    return RankCoords(tp, None, dp, rank)


def expert_rank_coords(parallel_state=None, *, expert_tensor_parallel_group=None) -> RankCoords:
    """This rank's coordinates in the expert layout (docs/spec.md section 19): expert-TP rank,
    PP rank, expert-data-parallel rank and EP rank from a :class:`tpamp.parallel.ParallelState`;
    without one the expert-TP rank from ``expert_tensor_parallel_group`` (0 without one) and the
    others None."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if parallel_state is not None:
        st = parallel_state
        return RankCoords(st.expert_tp_rank, st.pp_rank, st.expert_dp_rank, rank, st.ep_rank)
    tp = dist.get_rank(expert_tensor_parallel_group) if expert_tensor_parallel_group is not None else 0
    return RankCoords(tp, None, None, rank, None)


def param_name_map(param_names) -> Dict[int, str]:
    """{id(param): name} from ``model.named_parameters()`` ((name, param) pairs) or a dict
    param -> name (None: {}). Raises TypeError for an entry that is not (str, Tensor),
    ValueError for an empty name, a name given to two params or a param given two names
    (:func:`tpamp._checks.check_param_names`, the grad-norm tracker's rules)."""
    if param_names is None:
        return {}
    if isinstance(param_names, dict):
        items = [(n, p) for p, n in param_names.items()]
    else:
        try:
            items = list(param_names)
        except TypeError:
            raise TypeError(
                "param_names must be model.named_parameters() ((name, param) pairs) or a dict "
                f"param -> name, got {type(param_names).__name__}"
            ) from None
    out: Dict[int, str] = {}
    for item in items:
        if not (isinstance(item, (tuple, list)) and len(item) == 2
                and isinstance(item[0], str) and isinstance(item[1], Tensor)):
            raise TypeError(
                "param_names must be model.named_parameters() ((name, param) pairs) or a dict "
                f"param -> name; got an entry {item!r:.80}"
            )
        out.setdefault(id(item[1]), item[0])
    check_param_names(items)  # as the grad-norm tracker: no empty or duplicate names
    return out


def _where(tp, pp, dp, ep=None, expert=False) -> str:
    show = lambda v: "?" if v is None else str(v)
    if expert:  # an expert param: its EP rank, and the expert-TP / expert-DP ranks
        return f"[ep {show(ep)}, etp {show(tp)}, pp {show(pp)}, edp {show(dp)}]"
    return f"[tp {show(tp)}, pp {show(pp)}, dp {show(dp)}]"


class NonFiniteGrad(NamedTuple):
    """One parameter whose local gradient held inf or NaN on one rank at a step.

    name: the parameter's name (``param_names=`` of the optimizer; global across pipeline
    stages when the caller names them so; default ``"group<g>.param<i>"``). tp_rank, pp_rank,
    dp_rank: the coordinates of the rank that held the values (None when not known: pass
    ``parallel_state=``). num_inf, num_nan: how many elements of that rank's local gradient
    (its TP shard; for the distributed optimizer, its gradient before the DP reduce-scatter)
    were +-inf and NaN. rank: the global rank. An expert param's record is an
    :class:`ExpertNonFiniteGrad` (the same fields and its EP rank).
    """

    name: str
    tp_rank: Optional[int]
    pp_rank: Optional[int]
    dp_rank: Optional[int]
    num_inf: int
    num_nan: int
    rank: int = 0

    expert = False

    @property
    def kind(self) -> str:
        """"inf", "nan" or "inf and nan"."""
        if self.num_inf and self.num_nan:
            return "inf and nan"
        return "nan" if self.num_nan else "inf"

    def where(self) -> str:
        """"[tp 1, pp 1, dp 0]" ("?" for an unknown coordinate)."""
        return _where(self.tp_rank, self.pp_rank, self.dp_rank)

    def as_record(self) -> dict:
        """A JSON-ready dict of the fields."""
        return self._asdict()

    def __str__(self) -> str:
        return f"{self.kind} in {self.name} {self.where()}"


class ExpertNonFiniteGrad(NamedTuple):
    """:class:`NonFiniteGrad` of an expert param (:func:`tpamp.is_expert_param`, docs/spec.md
    section 19): the same fields, where tp_rank and dp_rank are the expert-TP and
    expert-data-parallel ranks, and ``ep_rank``, the expert-parallel rank of the rank whose
    gradient held the values (None when not known: pass ``parallel_state=``)."""

    name: str
    tp_rank: Optional[int]
    pp_rank: Optional[int]
    dp_rank: Optional[int]
    num_inf: int
    num_nan: int
    rank: int = 0
    ep_rank: Optional[int] = None

    expert = True
    kind = NonFiniteGrad.kind

    def where(self) -> str:
        """"[ep 1, etp 0, pp 1, edp 0]" ("?" for an unknown coordinate)."""
        return _where(self.tp_rank, self.pp_rank, self.dp_rank, self.ep_rank, expert=True)

    def as_record(self) -> dict:
        """A JSON-ready dict of the fields."""
        return self._asdict()

    def __str__(self) -> str:
        return f"{self.kind} in {self.name} {self.where()}"


def nonfinite_record(r):
    """A record from its tuple or ``as_record()`` dict: an :class:`ExpertNonFiniteGrad` when it
    has an ``ep_rank`` (8 fields), else a :class:`NonFiniteGrad`."""
    if isinstance(r, dict):
        return ExpertNonFiniteGrad(**r) if "ep_rank" in r else NonFiniteGrad(**r)
    r = tuple(r)
    return ExpertNonFiniteGrad(*r) if len(r) == len(ExpertNonFiniteGrad._fields) else NonFiniteGrad(*r)


def describe(records: Sequence[NonFiniteGrad]) -> str:
    """"inf in blocks.3.mlp.fc2.weight [tp 1, pp 1, dp 0] and 2 more" ("" for no records)."""
    if not records:
        return ""
    first = str(records[0])
    return first if len(records) == 1 else f"{first} and {len(records) - 1} more"


def count_nonfinite(tensors: Sequence[Tensor]) -> List[Tuple[int, int]]:
    """(number of inf, number of NaN) elements of each tensor (any float dtype, one device),
    read on the host once. A pass over the tensors: for the rare step that found an overflow."""
    if not tensors:
        return []
    counts = torch.stack(
        [torch.stack([torch.isinf(t).sum(), torch.isnan(t).sum()]) for t in tensors]
    )
    return [(int(a), int(b)) for a, b in counts.tolist()]


def local_records(names: Sequence[str], tensors: Sequence[Tensor], coords: RankCoords, *,
                  expert_names=(), expert_coords: Optional[RankCoords] = None) -> List[NonFiniteGrad]:
    """The records of this rank: one per tensor holding inf or NaN, in the given order. A name
    in ``expert_names`` is an expert param's: its record takes ``expert_coords`` (EP rank,
    expert-TP and expert-DP ranks; default ``coords``) and ``expert=True``."""
    if len(names) != len(tensors):
        raise ValueError(f"{len(names)} names for {len(tensors)} tensors")
    out = []
    for name, (n_inf, n_nan) in zip(names, count_nonfinite(tensors)):
        if n_inf or n_nan:
            if name in expert_names:
                c = expert_coords if expert_coords is not None else coords
                out.append(ExpertNonFiniteGrad(name, c.tp_rank, c.pp_rank, c.dp_rank, n_inf,
                                               n_nan, c.rank, c.ep_rank))
            else:
                out.append(NonFiniteGrad(name, coords.tp_rank, coords.pp_rank, coords.dp_rank,
                                         n_inf, n_nan, coords.rank))
    return out


def gather_nonfinite(records: Sequence[NonFiniteGrad], group, *more_groups) -> List[NonFiniteGrad]:
    """Every rank's records, the same list on every rank of ``group`` (one
    ``all_gather_object``. Collective: every rank of ``group`` must call it, also one with no
    records), in
    backward order: the last pipeline stage first, and each rank's records in reverse of the
    order given (pass them in model order: backward produces the last layers' grads first), then
    by TP and DP rank. So the first record is the most downstream parameter, where an overflow
    in the backward pass usually arises before it spreads upstream as inf/NaN. ``group`` None:
    this rank's records only, in that order. ``more_groups`` (e.g. the expert grad-stats group,
    docs/spec.md section 19): what was gathered is gathered again over each, in turn, and each
    rank's records are kept once."""
    mine = [(i, tuple(r)) for i, r in enumerate(records)]
    gathered = [mine]
    for g in (group,) + tuple(more_groups):
        if g is not None and dist.is_available() and dist.is_initialized():
            flat_mine = [item for rank_records in gathered for item in rank_records]
            gathered = [None] * dist.get_world_size(g)
            dist.all_gather_object(gathered, flat_mine, group=g)
    seen, flat = set(), []
    for rank_records in gathered:
        for i, r in rank_records:
            rec = nonfinite_record(r)
            if (rec.rank, i, rec.name) not in seen:
                seen.add((rec.rank, i, rec.name))
                flat.append((i, rec))

    def key(item):
        i, r = item
        return (-(r.pp_rank or 0), r.rank if r.pp_rank is None else 0, -i,
                r.tp_rank or 0, r.dp_rank or 0, r.rank)

    return [r for _, r in sorted(flat, key=key)]


# -- activation tracing ------------------------------------------------------------------------


class NonFiniteActivation(NamedTuple):
    """What :class:`NonFiniteTracer` found: the first module (in execution order on its rank)
    with a non-finite or nearly overflowing tensor.

    module: the module's name (``names=`` of the tracer; default its qualified name in the
    traced model, "" for the model itself). phase: "forward" (its output) or "backward" (the
    gradient w.r.t. its output, "grad_output", or an input, "grad_input"). tensor: "output",
    "grad_output" or "grad_input". micro_batch: 0-based count of the traced model's forward calls
    since the tracer was attached (or reset). problem: "inf", "nan" or "near overflow" (finite
    but |x| >= finfo(dtype).max / margin). max_abs: the tensor's largest finite |x| (float, the
    tensor's units; nan when none is finite). dtype: the tensor's dtype as a string. tp_rank,
    pp_rank, dp_rank, rank: the rank's coordinates. order: the hook's position in this rank's
    execution order (0-based).
    """

    module: str
    phase: str
    tensor: str
    micro_batch: int
    problem: str
    max_abs: float
    dtype: str
    tp_rank: Optional[int]
    pp_rank: Optional[int]
    dp_rank: Optional[int]
    rank: int
    order: int

    def where(self) -> str:
        return _where(self.tp_rank, self.pp_rank, self.dp_rank)

    def as_record(self) -> dict:
        d = self._asdict()
        if not math.isfinite(d["max_abs"]):
            d["max_abs"] = None
        return d

    def __str__(self) -> str:
        return (
            f"{self.problem} in the {self.phase} {self.tensor} of {self.module or '<model>'} "
            f"(micro-batch {self.micro_batch}, {self.dtype}) {self.where()}"
        )

    def pipeline_key(self):
        """Earliest along the pipeline first: forward before backward; within forward the
        lower micro-batch, then the earlier stage; within backward the lower micro-batch, then
        the later stage (backward runs from the last stage); then execution order, then rank."""
        pp = self.pp_rank if self.pp_rank is not None else 0
        phase = 0 if self.phase == "forward" else 1
        return (phase, self.micro_batch, pp if phase == 0 else -pp, self.order, self.rank)


class NonFiniteTracer:
    """Hooks on every module of ``model`` that find the first non-finite (or nearly overflowing
    fp16/bf16) forward output or backward gradient (opt-in activation tracing).

    Forward: a forward hook on every module checks each floating-point tensor of its output.
    Backward: hooks on those output tensors (the gradient w.r.t. the module's output,
    ``grad_output``) and on the module's floating-point inputs that require grad (``grad_input``;
    a tensor hook, so an input used by several modules is seen with its summed gradient). A
    tensor is flagged when it holds inf or NaN, or, when it is float16 or bfloat16 and
    ``margin`` is not None, when max |x| >= finfo(dtype).max / margin. Each check reads one
    value on the host (a device sync per module output): arm it for the iterations to look at,
    e.g. the one after a skipped step, not for every step.

    Only the first finding of each rank is kept (:attr:`first`); :meth:`result` agrees on the
    earliest one along the pipeline over a group (the same :class:`NonFiniteActivation` on
    every rank). Use as a context manager (``with NonFiniteTracer(model) as t:``) or
    :meth:`attach` / :meth:`detach`.

    Args:
        model: the ``torch.nn.Module`` (e.g. this rank's pipeline stage).
        names: {qualified module name in ``model``: name to report}, or a function
            qualified name -> reported name (e.g. with the global layer index); default: the
            qualified name itself.
        margin: flag fp16/bf16 tensors within this factor of the dtype's max (> 1; default 2:
            |x| >= 32752 in fp16), or None to flag inf/NaN only.
        parallel_state: a :class:`tpamp.parallel.ParallelState` for the rank coordinates (or
            give ``tensor_parallel_group`` / ``data_parallel_group``).
        backward: also trace the backward pass (default True).

    Raises TypeError when model is not a Module or names is neither a dict nor callable,
    TypeError when margin is not a number (or None), ValueError when it is not finite and > 1.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        names=None,
        margin: Optional[float] = 2.0,
        parallel_state=None,
        tensor_parallel_group=None,
        data_parallel_group=None,
        backward: bool = True,
    ):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        check_real("margin", margin, low=1.0, low_inclusive=False, allow_none=True)
        if names is None:
            rename: Callable[[str], str] = lambda n: n
        elif isinstance(names, dict):
            rename = lambda n: names.get(n, n)
        elif callable(names):
            rename = names
        else:
            raise TypeError(f"names must be a dict or a callable, got {type(names).__name__}")
        self.model = model
        self.margin = None if margin is None else float(margin)
        self.backward = bool(backward)
        self.coords = rank_coords(parallel_state, tensor_parallel_group=tensor_parallel_group,
                                  data_parallel_group=data_parallel_group)
        self._names = {m: rename(n) for n, m in model.named_modules()}
        self._handles: list = []
        self.first: Optional[NonFiniteActivation] = None
        self.micro_batch = -1
        self._order = 0

    # -- attach / detach -------------------------------------------------------------------

    def attach(self) -> "NonFiniteTracer":
        """Put the hooks on every module (again after :meth:`detach`); clears the finding."""
        if self._handles:
            return self
        self.reset()
        for module in self.model.modules():
            self._handles.append(module.register_forward_hook(self._forward_hook))
        self._handles.append(self.model.register_forward_pre_hook(self._count_micro_batch))
        return self

    def detach(self) -> None:
        """Remove the hooks (tensor hooks already placed on this iteration's tensors still
        report into this tracer until those tensors are freed)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def reset(self) -> None:
        """Forget the finding and restart the micro-batch count."""
        self.first = None
        self.micro_batch = -1
        self._order = 0

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def __enter__(self) -> "NonFiniteTracer":
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    # -- hooks -----------------------------------------------------------------------------

    def _count_micro_batch(self, module, args):
        self.micro_batch += 1

    def _forward_hook(self, module, args, output):
        name = self._names.get(module, "?")
        mb = max(self.micro_batch, 0)
        for t in _float_tensors(output):
            self._check(t, name, "forward", "output", mb)
            if self.backward and t.requires_grad:
                t.register_hook(self._grad_hook(name, "grad_output", mb))
        if self.backward and torch.is_grad_enabled():
            for t in _float_tensors(args):
                if t.requires_grad:
                    t.register_hook(self._grad_hook(name, "grad_input", mb))

    def _grad_hook(self, name: str, which: str, mb: int):
        def hook(grad):
            if grad is not None:
                self._check(grad, name, "backward", which, mb)
            return None

        return hook

    def _check(self, t: Tensor, name: str, phase: str, which: str, mb: int) -> None:
        order = self._order
        self._order += 1
        if self.first is not None or t.numel() == 0:
            return
        t = _local(t).detach()
        finfo = torch.finfo(t.dtype)
        near = self.margin is not None and t.dtype in (torch.float16, torch.bfloat16)
        # one host read: counts of inf and nan, and the largest finite |x|
        a = t.abs()
        finite_max = torch.where(torch.isfinite(a), a, torch.zeros((), dtype=a.dtype, device=a.device)).max()
        stats = torch.stack([
            torch.isinf(t).sum().double(), torch.isnan(t).sum().double(), finite_max.double(),
        ]).tolist()
        n_inf, n_nan, biggest = stats
        if n_nan:
            problem = "nan"
        elif n_inf:
            problem = "inf"
        elif near and biggest >= finfo.max / self.margin:
            problem = "near overflow"
        else:
            return
        c = self.coords
        self.first = NonFiniteActivation(
            name, phase, which, mb, problem, float(biggest), str(t.dtype).replace("torch.", ""),
            c.tp_rank, c.pp_rank, c.dp_rank, c.rank, order,
        )

    # -- result ----------------------------------------------------------------------------

    def result(self, group=None) -> Optional[NonFiniteActivation]:
        """The earliest finding along the pipeline over ``group`` (collective: every rank of
        ``group`` must call it; one ``all_gather_object``), the same on every rank; None when no rank found
        anything. group None: this rank's :attr:`first`."""
        found = [self.first] if self.first is not None else []
        if group is not None and dist.is_available() and dist.is_initialized():
            gathered: List[Optional[tuple]] = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, tuple(self.first) if self.first else None, group=group)
            found = [NonFiniteActivation(*g) for g in gathered if g is not None]
        if not found:
            return None
        return min(found, key=NonFiniteActivation.pipeline_key)


def _local(t: Tensor) -> Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _float_tensors(obj) -> Iterable[Tensor]:
    """The floating-point tensors in a module's output or inputs (tensors, tuples, lists, dicts)."""
    if isinstance(obj, Tensor):
        if obj.is_floating_point():
            yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _float_tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _float_tensors(o)
