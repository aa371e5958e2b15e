"""The TP x PP x DP layout: one place that builds and hands out process groups.

Rank order follows Megatron-LM's ``parallel_state``: tensor-parallel (TP) ranks vary fastest,
then data-parallel (DP), then pipeline-parallel (PP)::

    rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank

The layout is held as a :class:`torch.distributed.device_mesh.DeviceMesh` of shape
``(pp, dp, tp)`` with dim names ``("pp", "dp", "tp")``. From it come the TP, PP and DP groups,
the model-parallel group (TP x PP: the ranks that share one DP index, the default grad-stats
group of :class:`tpamp.MixedPrecisionOptimizer`) and the embedding group (first and last PP
stage, for tied word embeddings as in Megatron-LM).

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
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from tpamp._checks import check_int

__all__ = ["ParallelDims", "ParallelState", "initialize_model_parallel"]

_DIM_NAMES = ("pp", "dp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the tensor-, pipeline- and data-parallel dimensions.

    ``dp=None`` means "whatever is left": ``world_size // (tp * pp)``. Raises ValueError, naming
    the numbers, when a size is not a positive int or the sizes do not multiply to world_size.
    """

    tp: int = 1
    pp: int = 1
    dp: Optional[int] = None
    world_size: int = 1

    def __post_init__(self):
        for name in ("tp", "pp", "world_size"):
            check_int(name, getattr(self, name), low=1)
        if self.dp is None:
            if self.world_size % (self.tp * self.pp) != 0:
                raise ValueError(
                    f"world_size {self.world_size} is not divisible by tp * pp = "
                    f"{self.tp} * {self.pp} = {self.tp * self.pp}"
                )
            object.__setattr__(self, "dp", self.world_size // (self.tp * self.pp))
        else:
            check_int("dp", self.dp, low=1)
        if self.tp * self.pp * self.dp != self.world_size:
            raise ValueError(
                f"tp * pp * dp = {self.tp} * {self.pp} * {self.dp} = "
                f"{self.tp * self.pp * self.dp} does not equal world_size {self.world_size}"
            )

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of a global rank in Megatron order."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside [0, {self.world_size})")
        tp_rank = rank % self.tp
        dp_rank = (rank // self.tp) % self.dp
        pp_rank = rank // (self.tp * self.dp)
        return pp_rank, dp_rank, tp_rank

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.dp * self.tp + dp_rank * self.tp + tp_rank


@dataclass
class ParallelState:
    """Process groups of one rank in a TP x PP x DP layout (see the module docstring).

    Attributes: ``dims`` (:class:`ParallelDims`), ``mesh`` (3-D DeviceMesh ``(pp, dp, tp)``),
    ``tp_mesh`` (the 1-D TP sub-mesh, for ``torch.distributed.tensor.parallel``), the groups
    ``tp_group``, ``pp_group``, ``dp_group``, ``model_parallel_group`` (TP x PP) and
    ``embedding_group`` (first and last PP stage of this rank's TP and DP index; None when
    pp == 1), and this rank's ``tp_rank``, ``pp_rank``, ``dp_rank``.
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

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def pp_rank(self) -> int:
        return self.dims.coords(self.rank)[0]

    @property
    def dp_rank(self) -> int:
        return self.dims.coords(self.rank)[1]

    @property
    def tp_rank(self) -> int:
        return self.dims.coords(self.rank)[2]

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
        """The group over which found_inf, grad norm and zeros are reduced (model-parallel)."""
        return self.model_parallel_group


def _new_groups(dims: ParallelDims, rank: int, rank_lists, timeout=None) -> Optional[dist.ProcessGroup]:
    """Create one group per rank list (every rank must create every group, in order) and
    return the one that holds ``rank``."""
    mine = None
    for ranks in rank_lists:
        g = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            mine = g
    return mine


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    data_parallel_size: Optional[int] = None,
    *,
    mesh: Optional[DeviceMesh] = None,
    device_type: Optional[str] = None,
    timeout: Optional[datetime.timedelta] = None,
) -> ParallelState:
    """Build the groups of a TP x PP x DP layout on the default process group.

    Either give the sizes (Megatron order, see the module docstring) or a ``mesh``: a 3-D
    DeviceMesh with dim names ``("pp", "dp", "tp")`` (sizes are then read from it). Every rank
    must call this collectively. ``device_type`` defaults to "cuda" when the backend is NCCL,
    else "cpu".

    ``timeout`` (a positive ``datetime.timedelta``; default: the default process group's) is
    given to every group built here: the TP, PP and DP groups of the mesh (built with
    ``new_group(timeout=...)`` and assembled with ``DeviceMesh.from_group``), the
    model-parallel and the embedding group. A collective on one of them that a peer does not
    join raises RuntimeError after ``timeout`` (module docstring). With a ``mesh`` given, its
    groups are the caller's and keep their own timeouts.

    Raises RuntimeError when torch.distributed is not initialized, ValueError when the sizes do
    not multiply to the world size or the mesh's dim names are not ("pp", "dp", "tp"),
    TypeError/ValueError for a timeout that is not a positive timedelta.
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
    if mesh is not None:
        if tuple(mesh.mesh_dim_names or ()) != _DIM_NAMES:
            raise ValueError(
                f"mesh dim names must be {_DIM_NAMES} (Megatron order), got {mesh.mesh_dim_names}"
            )
        pp, dp, tp = mesh.mesh.shape
        dims = ParallelDims(tp=int(tp), pp=int(pp), dp=int(dp), world_size=world_size)
        expected = torch.arange(world_size).reshape(pp, dp, tp)
        if not torch.equal(mesh.mesh.cpu(), expected):
            raise ValueError(
                "mesh ranks are not in Megatron order (tp fastest, then dp, then pp): "
                f"got {mesh.mesh.tolist()}"
            )
    else:
        dims = ParallelDims(
            tp=tensor_model_parallel_size,
            pp=pipeline_model_parallel_size,
            dp=data_parallel_size,
            world_size=world_size,
        )
        if device_type is None:
            device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        mesh = _mesh_with_timeout(dims, rank, device_type, timeout)

    tp_group = mesh.get_group("tp")
    dp_group = mesh.get_group("dp")
    pp_group = mesh.get_group("pp")
    grid = torch.arange(world_size).reshape(dims.pp, dims.dp, dims.tp)
    # model-parallel: all (pp, tp) for one dp index
    mp_lists = [grid[:, d, :].flatten().tolist() for d in range(dims.dp)]
    model_parallel_group = _new_groups(dims, rank, mp_lists, timeout)
    embedding_group = None
    if dims.pp > 1:
        emb_lists = [
            [int(grid[0, d, t]), int(grid[-1, d, t])] for d in range(dims.dp) for t in range(dims.tp)
        ]
        embedding_group = _new_groups(dims, rank, emb_lists, timeout)
    pp_rank, dp_rank, tp_rank = dims.coords(rank)
    return ParallelState(
        dims=dims,
        mesh=mesh,
        tp_group=tp_group,
        pp_group=pp_group,
        dp_group=dp_group,
        model_parallel_group=model_parallel_group,
        embedding_group=embedding_group,
        rank=rank,
        _pp_ranks=grid[:, dp_rank, tp_rank].tolist(),
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
    """The (pp, dp, tp) DeviceMesh with its three dims' groups built by ``new_group`` with
    ``timeout`` (``init_device_mesh`` would give them torch's 30-minute default)."""
    grid = torch.arange(dims.world_size).reshape(dims.pp, dims.dp, dims.tp)
    pp_lists = [grid[:, d, t].tolist() for d in range(dims.dp) for t in range(dims.tp)]
    dp_lists = [grid[p, :, t].tolist() for p in range(dims.pp) for t in range(dims.tp)]
    tp_lists = [grid[p, d, :].tolist() for p in range(dims.pp) for d in range(dims.dp)]
    groups = [_new_groups(dims, rank, lists, timeout) for lists in (pp_lists, dp_lists, tp_lists)]
    return DeviceMesh.from_group(groups, device_type, mesh=grid, mesh_dim_names=_DIM_NAMES)
