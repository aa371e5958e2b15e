"""The parallel layout: one place that builds and hands out process groups.

Dense layout (attention, embeddings, every param that is not an expert's). Rank order follows
Megatron-LM's ``parallel_state`` (order ``tp-cp-ep-dp-pp`` with ep = 1 for dense params):
tensor-parallel (TP) ranks vary fastest, then context-parallel (CP), then data-parallel (DP),
then pipeline-parallel (PP)::

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

(with cp = 1 this is Megatron's classic ``pp_rank * (dp * tp) + dp_rank * tp + tp_rank``).

Expert layout (mixture-of-experts expert params). The same ranks decomposed again, as
Megatron-core's second ``RankGenerator`` does (order ``tp-ep-dp-pp`` with the expert-TP size in
place of TP and no CP)::

    rank = ((pp_rank * edp + edp_rank) * ep + ep_rank) * etp + etp_rank

with ``etp = expert_tensor_parallel_size`` (default: TP), ``ep = expert_model_parallel_size``
and the expert-data-parallel size ``edp = world_size / (etp * ep * pp)``. Both decompositions
share the PP groups (each stage holds whole layers, dense and expert).

The dense layout is held as a :class:`torch.distributed.device_mesh.DeviceMesh` of shape
``(pp, dp, tp)`` with dim names ``("pp", "dp", "tp")``, or ``(pp, dp, cp, tp)`` with names
``("pp", "dp", "cp", "tp")`` when cp > 1; the expert layout as a second DeviceMesh of shape
``(pp, edp, ep, etp)`` with names ``("pp", "edp", "ep", "etp")`` (``ParallelState.expert_mesh``;
put expert DTensors on ``expert_mesh["ep"]``). From them come the groups (Megatron's names in
brackets):

* ``tp_group``, ``cp_group``, ``dp_group``, ``pp_group``; ``dp_cp_group`` (DP x CP, the group
  over which dense grads are reduced and dense optimizer state is sharded, Megatron's
  ``get_data_parallel_group(with_context_parallel=True)``);
* ``model_parallel_group`` (TP x PP: the ranks that share one DP and CP index, the default
  grad-stats group of :class:`tpamp.MixedPrecisionOptimizer`) and the ``embedding_group`` (first
  and last PP stage, for tied word embeddings as in Megatron-LM);
* ``ep_group`` (the ranks that hold different experts; Megatron's
  ``get_expert_model_parallel_group()``), ``expert_tp_group`` (``get_expert_tensor_parallel_group``),
  ``expert_model_parallel_group`` (expert-TP x EP x PP, ``get_ranks('tp-ep-pp')``, Megatron's
  ``get_expert_tensor_model_pipeline_parallel_group()``: the grad-stats group of expert params),
  ``expert_data_parallel_group`` (``get_expert_data_parallel_group()``: the ranks that hold the
  same experts; expert grads are reduced and expert optimizer state sharded over it).

A size-1 dimension still has its groups (one rank each), so ``dist.get_world_size(cp_group)``
is 1, never the world.

Timeouts. Every group built here gets one timeout (``initialize_model_parallel(timeout=...)``,
by default the default process group's, i.e. ``init_process_group(timeout=...)``), as
Megatron-LM gives its ``--distributed-timeout-minutes`` to every group. torch.distributed's
own default for a new group is 30 minutes whatever the default group has, so without this a
model-parallel peer that is alive but never joins would hang the others for half an hour.
What a user sees when a peer fails (gloo; NCCL aborts the process the same way once its
watchdog fires):

* a peer that crashed (its process exited): the other ranks' next collective on a shared group
  raises ``RuntimeError`` at once or within the timeout (gloo: "Connection closed by peer" /
  "Connection reset by peer");
* a peer that is alive but never joins (hung, or it caught an exception and went on to other
  work): the waiting ranks raise ``RuntimeError`` ("Timed out waiting <timeout> ms for recv
  operation ..." under gloo) after the group's timeout;
* ranks of one grad-stats group whose optimizer settings differ: the first ``step()`` raises
  the same ``ValueError`` on every rank (one small all-gather), before any collective that the
  difference would desynchronise.
After such an error the process groups cannot be trusted: end the job (torchrun restarts it).
"""

from __future__ import annotations

import datetime
import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from tpamp._checks import check_int

__all__ = ["ParallelDims", "ParallelState", "default_groups", "initialize_model_parallel",
           "resolve_tensor_parallel_group"]

_DIM_NAMES = ("pp", "dp", "tp")
_DIM_NAMES_CP = ("pp", "dp", "cp", "tp")
EXPERT_DIM_NAMES = ("pp", "edp", "ep", "etp")


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the parallel dimensions (module docstring for the rank order).

    tp, pp, dp, cp: the dense layout's tensor-, pipeline-, data- and context-parallel sizes;
    ``dp=None`` means "whatever is left": ``world_size // (tp * cp * pp)``. ep: the
    expert-model-parallel size (experts split over ep ranks); etp: the expert-tensor-parallel
    size (``None``: the same as tp; resolved to an int on construction). The expert-data-parallel
    size ``edp = world_size // (etp * ep * pp)`` follows. Raises TypeError for a size that is not
    an int, ValueError, naming the numbers, when a size is < 1 or the sizes do not multiply out
    to world_size.
    """

    tp: int = 1
    pp: int = 1
    dp: Optional[int] = None
    world_size: int = 1
    cp: int = 1
    ep: int = 1
    etp: Optional[int] = None

    def __post_init__(self):
        for name in ("tp", "pp", "world_size", "cp", "ep"):
            check_int(name, getattr(self, name), low=1)
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        else:
            check_int("etp", self.etp, low=1)
        model = self.tp * self.cp * self.pp
        what = "tp * pp" if self.cp == 1 else "tp * cp * pp"
        sizes = f"{self.tp} * {self.pp}" if self.cp == 1 else f"{self.tp} * {self.cp} * {self.pp}"
        if self.dp is None:
            if self.world_size % model != 0:
                raise ValueError(
                    f"world_size {self.world_size} is not divisible by {what} = {sizes} = {model}"
                )
            object.__setattr__(self, "dp", self.world_size // model)
        else:
            check_int("dp", self.dp, low=1)
        if model * self.dp != self.world_size:
            if self.cp == 1:
                lhs = f"tp * pp * dp = {self.tp} * {self.pp} * {self.dp}"
            else:
                lhs = f"tp * cp * pp * dp = {self.tp} * {self.cp} * {self.pp} * {self.dp}"
            raise ValueError(
                f"{lhs} = {model * self.dp} does not equal world_size {self.world_size}"
            )
        expert = self.etp * self.ep * self.pp
        if self.world_size % expert != 0:
            raise ValueError(
                f"world_size {self.world_size} is not divisible by etp * ep * pp = "
                f"{self.etp} * {self.ep} * {self.pp} = {expert} (expert_tensor_parallel_size * "
                f"expert_model_parallel_size * pipeline_model_parallel_size)"
            )

    @property
    def edp(self) -> int:
        """The expert-data-parallel size: world_size // (etp * ep * pp)."""
        return self.world_size // (self.etp * self.ep * self.pp)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside [0, {self.world_size})")

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of a global rank in Megatron order."""
        pp_rank, dp_rank, _, tp_rank = self.dense_coords(rank)
        return pp_rank, dp_rank, tp_rank

    def dense_coords(self, rank: int) -> tuple[int, int, int, int]:
        """(pp_rank, dp_rank, cp_rank, tp_rank) of a global rank (dense layout, tp fastest)."""
        self._check_rank(rank)
        tp_rank = rank % self.tp
        cp_rank = (rank // self.tp) % self.cp
        dp_rank = (rank // (self.tp * self.cp)) % self.dp
        pp_rank = rank // (self.tp * self.cp * self.dp)
        return pp_rank, dp_rank, cp_rank, tp_rank

    def expert_coords(self, rank: int) -> tuple[int, int, int, int]:
        """(pp_rank, edp_rank, ep_rank, etp_rank) of a global rank (expert layout, etp fastest)."""
        self._check_rank(rank)
        etp_rank = rank % self.etp
        ep_rank = (rank // self.etp) % self.ep
        edp_rank = (rank // (self.etp * self.ep)) % self.edp
        pp_rank = rank // (self.etp * self.ep * self.edp)
        return pp_rank, edp_rank, ep_rank, etp_rank

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int, cp_rank: int = 0) -> int:
        """The global rank at these dense coordinates."""
        return ((pp_rank * self.dp + dp_rank) * self.cp + cp_rank) * self.tp + tp_rank

    def dense_grid(self) -> torch.Tensor:
        """Global ranks as an int64 tensor of shape (pp, dp, cp, tp)."""
        return torch.arange(self.world_size).reshape(self.pp, self.dp, self.cp, self.tp)

    def expert_grid(self) -> torch.Tensor:
        """Global ranks as an int64 tensor of shape (pp, edp, ep, etp)."""
        return torch.arange(self.world_size).reshape(self.pp, self.edp, self.ep, self.etp)


@dataclass
class ParallelState:
    """Process groups of one rank in the dense and the expert layout (module docstring).

    Attributes: ``dims`` (:class:`ParallelDims`), ``mesh`` (the dense DeviceMesh ``(pp, dp, tp)``,
    or ``(pp, dp, cp, tp)`` when cp > 1), ``tp_mesh`` (the 1-D TP sub-mesh, for
    ``torch.distributed.tensor.parallel``), ``expert_mesh`` (``(pp, edp, ep, etp)``), the groups
    ``tp_group``, ``pp_group``, ``dp_group``, ``cp_group``, ``dp_cp_group``,
    ``model_parallel_group`` (TP x PP), ``embedding_group`` (first and last PP stage of this
    rank's TP, CP and DP index; None when pp == 1), ``ep_group``, ``expert_tp_group``,
    ``expert_model_parallel_group`` (expert-TP x EP x PP), ``expert_data_parallel_group``, and
    this rank's ``tp_rank``, ``pp_rank``, ``dp_rank``, ``cp_rank``, ``ep_rank``,
    ``expert_tp_rank``, ``expert_dp_rank``. With cp = ep = 1 and etp = tp the expert groups are
    the dense ones (the same objects): ``expert_model_parallel_group is model_parallel_group``.
    """

    dims: ParallelDims
    mesh: DeviceMesh
    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    model_parallel_group: dist.ProcessGroup
    embedding_group: Optional[dist.ProcessGroup]
    rank: int
    _pp_ranks: list = field(default_factory=list)
    cp_group: Optional[dist.ProcessGroup] = None
    dp_cp_group: Optional[dist.ProcessGroup] = None
    ep_group: Optional[dist.ProcessGroup] = None
    expert_tp_group: Optional[dist.ProcessGroup] = None
    expert_model_parallel_group: Optional[dist.ProcessGroup] = None
    expert_data_parallel_group: Optional[dist.ProcessGroup] = None
    expert_mesh: Optional[DeviceMesh] = None

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def pp_rank(self) -> int:
        return self.dims.dense_coords(self.rank)[0]

    @property
    def dp_rank(self) -> int:
        return self.dims.dense_coords(self.rank)[1]

    @property
    def cp_rank(self) -> int:
        return self.dims.dense_coords(self.rank)[2]

    @property
    def tp_rank(self) -> int:
        return self.dims.dense_coords(self.rank)[3]

    @property
    def expert_dp_rank(self) -> int:
        return self.dims.expert_coords(self.rank)[1]

    @property
    def ep_rank(self) -> int:
        return self.dims.expert_coords(self.rank)[2]

    @property
    def expert_tp_rank(self) -> int:
        return self.dims.expert_coords(self.rank)[3]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.dims.pp - 1

    @property
    def pp_ranks(self) -> list[int]:
        """Global ranks of this rank's pipeline, stage 0 first (for send/recv)."""
        return list(self._pp_ranks)

    @property
    def grad_stats_group(self) -> dist.ProcessGroup:
        """The group over which found_inf, grad norm and zeros of dense params are reduced
        (model-parallel, TP x PP)."""
        return self.model_parallel_group

    @property
    def expert_grad_stats_group(self) -> Optional[dist.ProcessGroup]:
        """The group over which the grad statistics of expert params are reduced (the expert
        model-parallel group, expert-TP x EP x PP)."""
        return self.expert_model_parallel_group

    @property
    def expert_tensor_model_pipeline_parallel_group(self) -> Optional[dist.ProcessGroup]:
        """Megatron-core's name for :attr:`expert_model_parallel_group` (expert-TP x EP x PP)."""
        return self.expert_model_parallel_group

    @property
    def has_expert_layout(self) -> bool:
        """True when the expert layout differs from the dense one (ep > 1 or etp != tp): expert
        params then need their own groups. False: the expert groups are the dense ones."""
        d = self.dims
        return d.ep > 1 or d.etp != d.tp


# weak references to the ParallelState the last initialize_model_parallel of this process made
# and to the default group it was made on (stale once either is gone)
_LAST: Optional[tuple] = None


def default_groups() -> Optional[dict]:
    """The groups of the initialized parallel state, for wrappers given none (docs/spec.md
    section 22): megatron-core's ``parallel_state`` when megatron-core is imported and its
    model parallel is initialized (it is never imported here), else the ParallelState of this
    process's last :func:`initialize_model_parallel` while it and its default group live (it
    is held weakly: keep the returned state); None when neither. Returns {"tp": TP group, "model_parallel": TP x PP group, "source": a name}."""
    import sys

    mpu = sys.modules.get("megatron.core.parallel_state")
    if mpu is not None and dist.is_initialized():
        try:
            ready = mpu.model_parallel_is_initialized()
        except Exception:  # an older or partly imported megatron-core
            ready = False
        if ready:
            return {"tp": mpu.get_tensor_model_parallel_group(),
                    "model_parallel": mpu.get_model_parallel_group(),
                    "dp": mpu.get_data_parallel_group(with_context_parallel=True),
                    "source": "megatron.core.parallel_state"}
    if _LAST is not None and dist.is_initialized():
        state, default = _LAST[0](), _LAST[1]()
        if state is not None and dist.distributed_c10d._get_default_group() is default:
            return {"tp": state.tp_group, "model_parallel": state.model_parallel_group,
                    "dp": state.dp_cp_group if state.dp_cp_group is not None else state.dp_group,
                    "source": "tpamp.parallel.initialize_model_parallel"}
    return None


def resolve_tensor_parallel_group(params, tensor_parallel_group, grad_stats_group, *,
                                  owner: str, default_stats_group: str = "model_parallel",
                                  parallel_state: Optional["ParallelState"] = None):
    """The (tensor_parallel_group, grad_stats_group) a wrapper uses (docs/spec.md section 22).

    Given a TP group: both as given. Else, when a param carries Megatron's
    ``tensor_model_parallel=True`` and the job has more than one rank, the TP group of the
    wrapper's ``parallel_state`` when given, else of the initialized parallel state
    (:func:`default_groups`) and, when grad_stats_group is None
    too, its model-parallel group (``default_stats_group="world"``: every rank, for a
    distributed optimizer); with no parallel state initialized that is a ValueError naming
    ``owner`` and the param (each TP rank would otherwise count its own norm and take its own
    skip decision, silently). Params without the attribute: both as given."""
    if tensor_parallel_group is not None:
        return tensor_parallel_group, grad_stats_group
    marked = next((p for p in params if getattr(p, "tensor_model_parallel", False)), None)
    if marked is None or not dist.is_initialized() or dist.get_world_size() == 1:
        return tensor_parallel_group, grad_stats_group
    if parallel_state is not None and not isinstance(parallel_state, ParallelState):
        return tensor_parallel_group, grad_stats_group  # the wrapper's own check names it
    found = default_groups() if parallel_state is None else {
        "tp": parallel_state.tp_group, "model_parallel": parallel_state.model_parallel_group}
    if found is None:
        raise ValueError(
            f"{owner}: a param of shape {tuple(marked.shape)} carries Megatron's "
            "tensor_model_parallel=True but no tensor_parallel_group was given and no parallel "
            "state is initialized (megatron.core.parallel_state or "
            "tpamp.parallel.initialize_model_parallel): pass tensor_parallel_group= and "
            "grad_stats_group= (the TP and model-parallel groups), or initialize one")
    if grad_stats_group is None:
        grad_stats_group = found["model_parallel"] if default_stats_group == "model_parallel" \
            else dist.group.WORLD
    return found["tp"], grad_stats_group


def _new_groups(dims: ParallelDims, rank: int, rank_lists, timeout=None,
                local_if_single: bool = False) -> Optional[dist.ProcessGroup]:
    """Create one group per rank list (every rank must create every group, in order) and
    return the one that holds ``rank``. With ``local_if_single``, one-rank groups are created
    by their rank alone (``use_local_synchronization``: no world-wide round trip, and no change
    to the group counter that the other groups' names come from); used for the groups that a
    TP x PP x DP layout did not have before (CP and EP of size 1)."""
    if local_if_single and all(len(r) == 1 for r in rank_lists):
        return dist.new_group([rank], timeout=timeout, use_local_synchronization=True)
    mine = None
    for ranks in rank_lists:
        g = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            mine = g
    return mine


def _lists(grid: torch.Tensor, dims_in_group) -> list:
    """Rank lists of the groups that vary over ``dims_in_group`` (axes of ``grid``), one per
    index of the other axes, ranks in grid order (Megatron's generate_masked_orthogonal_rank_groups
    for a grid whose axes run slowest to fastest)."""
    keep = [d for d in range(grid.dim()) if d not in dims_in_group]
    moved = grid.permute(*keep, *dims_in_group)
    size = 1
    for d in dims_in_group:
        size *= grid.shape[d]
    return moved.reshape(-1, size).tolist()


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    data_parallel_size: Optional[int] = None,
    *,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: Optional[int] = None,
    mesh: Optional[DeviceMesh] = None,
    device_type: Optional[str] = None,
    timeout: Optional[datetime.timedelta] = None,
) -> ParallelState:
    """Build the groups of the dense and the expert layout on the default process group.

    Either give the sizes (Megatron order, see the module docstring) or a dense ``mesh``: a
    DeviceMesh with dim names ``("pp", "dp", "tp")`` or ``("pp", "dp", "cp", "tp")`` (sizes are
    then read from it; ``context_parallel_size`` must then be left at 1 or match). The expert
    layout comes from ``expert_model_parallel_size`` (EP, default 1) and
    ``expert_tensor_parallel_size`` (expert TP, default: the TP size), as Megatron-core's
    ``initialize_model_parallel``. Every rank must call this collectively. ``device_type``
    defaults to "cuda" when the backend is NCCL, else "cpu".

    ``timeout`` (a positive ``datetime.timedelta``; default: the default process group's) is
    given to every group built here: the groups of both meshes (built with
    ``new_group(timeout=...)`` and assembled with ``DeviceMesh.from_group``), the
    model-parallel, DP x CP, expert and embedding groups. A collective on one of them that a
    peer does not join raises RuntimeError after ``timeout`` (module docstring). With a
    ``mesh`` given, its groups are the caller's and keep their own timeouts.

    With cp = ep = 1 and etp = tp (the default) the dense groups are exactly those of a
    TP x PP x DP layout and the expert groups are the same group objects.

    Raises RuntimeError when torch.distributed is not initialized, TypeError for a size that is
    not an int, ValueError, naming the numbers, when the sizes do not multiply out to the
    world size (dense: tp * cp * pp * dp; expert: etp * ep * pp must divide it) or the mesh's
    dim names are not one of the above, TypeError/ValueError for a timeout that is not a
    positive timedelta.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call init_process_group first")
    if timeout is None:
        timeout = default_group_timeout()
    elif not isinstance(timeout, datetime.timedelta):
        raise TypeError(
            f"timeout must be a datetime.timedelta, got {timeout!r} ({type(timeout).__name__})"
        )
    elif timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    check_int("context_parallel_size", context_parallel_size, low=1)
    check_int("expert_model_parallel_size", expert_model_parallel_size, low=1)
    if expert_tensor_parallel_size is not None:
        check_int("expert_tensor_parallel_size", expert_tensor_parallel_size, low=1)
    if mesh is not None:
        names = tuple(mesh.mesh_dim_names or ())
        if names not in (_DIM_NAMES, _DIM_NAMES_CP):
            raise ValueError(
                f"mesh dim names must be {_DIM_NAMES} or {_DIM_NAMES_CP} (Megatron order), "
                f"got {mesh.mesh_dim_names}"
            )
        shape = dict(zip(names, (int(s) for s in mesh.mesh.shape)))
        cp = shape.get("cp", 1)
        if context_parallel_size not in (1, cp):
            raise ValueError(
                f"context_parallel_size {context_parallel_size} does not match the mesh's "
                f"cp size {cp}"
            )
        dims = ParallelDims(
            tp=shape["tp"], pp=shape["pp"], dp=shape["dp"], world_size=world_size, cp=cp,
            ep=expert_model_parallel_size, etp=expert_tensor_parallel_size,
        )
        expected = torch.arange(world_size).reshape(tuple(mesh.mesh.shape))
        if not torch.equal(mesh.mesh.cpu(), expected):
            raise ValueError(
                f"mesh ranks are not in Megatron order (tp fastest, then {'cp, ' if cp > 1 else ''}"
                f"dp, then pp): got {mesh.mesh.tolist()}"
            )
    else:
        dims = ParallelDims(
            tp=tensor_model_parallel_size,
            pp=pipeline_model_parallel_size,
            dp=data_parallel_size,
            world_size=world_size,
            cp=context_parallel_size,
            ep=expert_model_parallel_size,
            etp=expert_tensor_parallel_size,
        )
        mesh = _mesh_with_timeout(dims, rank, device_type, timeout)

    tp_group = mesh.get_group("tp")
    dp_group = mesh.get_group("dp")
    pp_group = mesh.get_group("pp")
    grid = dims.dense_grid()  # (pp, dp, cp, tp)
    # model-parallel: all (pp, tp) for one (dp, cp) index
    model_parallel_group = _new_groups(dims, rank, _lists(grid, (0, 3)), timeout)
    embedding_group = None
    if dims.pp > 1:
        emb_lists = [
            [int(grid[0, d, c, t]), int(grid[-1, d, c, t])]
            for d in range(dims.dp) for c in range(dims.cp) for t in range(dims.tp)
        ]
        embedding_group = _new_groups(dims, rank, emb_lists, timeout)
    if dims.cp > 1:
        cp_group = mesh.get_group("cp")
        dp_cp_group = _new_groups(dims, rank, _lists(grid, (1, 2)), timeout)
    else:
        cp_group = _new_groups(dims, rank, _lists(grid, (2,)), timeout, local_if_single=True)
        dp_cp_group = dp_group
    expert = _expert_groups(dims, rank, device_type, timeout, mesh, model_parallel_group,
                            dp_cp_group, cp_group)
    pp_rank, dp_rank, cp_rank, tp_rank = dims.dense_coords(rank)
    state = ParallelState(
        dims=dims,
        mesh=mesh,
        tp_group=tp_group,
        pp_group=pp_group,
        dp_group=dp_group,
        model_parallel_group=model_parallel_group,
        embedding_group=embedding_group,
        rank=rank,
        _pp_ranks=grid[:, dp_rank, cp_rank, tp_rank].tolist(),
        cp_group=cp_group,
        dp_cp_group=dp_cp_group,
        **expert,
    )
    global _LAST  # weak: holding the groups here would change the process's teardown
    _LAST = (weakref.ref(state), weakref.ref(dist.distributed_c10d._get_default_group()))
    return state


def _expert_groups(dims, rank, device_type, timeout, mesh, model_parallel_group, dp_cp_group,
                   cp_group) -> dict:
    """The expert layout's groups and mesh. Groups whose rank lists equal a dense group's are
    that group (so a dense-only layout builds nothing new but the one-rank EP groups)."""
    egrid = dims.expert_grid()  # (pp, edp, ep, etp)
    pp_group = mesh.get_group("pp")
    if dims.etp == dims.tp:
        etp_group = mesh.get_group("tp")
    else:
        etp_group = _new_groups(dims, rank, _lists(egrid, (3,)), timeout)
    if dims.ep == 1 and dims.cp == 1:
        ep_group = cp_group  # both one-rank groups of this rank
    else:
        ep_group = _new_groups(dims, rank, _lists(egrid, (2,)), timeout, local_if_single=True)
    same = dims.ep == 1 and dims.etp == dims.tp  # then edp == dp * cp, in the same order
    if same:
        emp_group, edp_group = model_parallel_group, dp_cp_group
    else:
        emp_group = _new_groups(dims, rank, _lists(egrid, (0, 2, 3)), timeout)
        edp_group = _new_groups(dims, rank, _lists(egrid, (1,)), timeout)
    expert_mesh = DeviceMesh.from_group(
        [pp_group, edp_group, ep_group, etp_group], device_type, mesh=egrid,
        mesh_dim_names=EXPERT_DIM_NAMES,
    )
    return dict(
        ep_group=ep_group,
        expert_tp_group=etp_group,
        expert_model_parallel_group=emp_group,
        expert_data_parallel_group=edp_group,
        expert_mesh=expert_mesh,
    )


def default_group_timeout() -> datetime.timedelta:
    """The timeout of the default process group (what ``init_process_group(timeout=...)`` set),
    or torch's default for its backend when the backend does not expose it."""
    pg = dist.distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout
        except Exception:  # no backend for this device, or no options exposed
            continue
    return dist.distributed_c10d._get_default_timeout(dist.get_backend())


def _mesh_with_timeout(dims: ParallelDims, rank: int, device_type: str, timeout) -> DeviceMesh:
    """The dense DeviceMesh, ``(pp, dp, tp)`` (or ``(pp, dp, cp, tp)`` when cp > 1), with its
    dims' groups built by ``new_group`` with ``timeout`` (``init_device_mesh`` would give them
    torch's 30-minute default)."""
    grid = dims.dense_grid()  # (pp, dp, cp, tp)
    axes = (0, 1, 3) if dims.cp == 1 else (0, 1, 2, 3)
    names = _DIM_NAMES if dims.cp == 1 else _DIM_NAMES_CP
    groups = [_new_groups(dims, rank, _lists(grid, (a,)), timeout) for a in axes]
    shape = tuple(grid.shape[a] for a in axes)
    return DeviceMesh.from_group(groups, device_type, mesh=grid.reshape(shape),
                                 mesh_dim_names=names)
