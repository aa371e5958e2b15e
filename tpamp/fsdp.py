"""tpamp under PyTorch-native FSDP2 (``torch.distributed.fsdp.fully_shard``) and DTensor TP.

The layout torchtitan builds: a 2-D DeviceMesh ``(dp, tp)``; tensor parallelism with
``parallelize_module`` on ``mesh["tp"]``, then ``fully_shard`` of each block and of the root on
``mesh["dp"]`` with ``MixedPrecisionPolicy(param_dtype=fp16/bf16, reduce_dtype=float32)``.
FSDP2 keeps every param as an fp32 DTensor sharded over DP (``Shard(0)``; TP params on the 2-D
mesh, e.g. ``(_StridedShard(0), Shard(0))``), all-gathers it in fp16/bf16 for forward and
backward, and reduce-scatters the grads in fp32 into ``param.grad`` (sharded like the param,
divided by the DP size). Those sharded fp32 params are the master weights: tpamp wraps the
optimizer with :class:`tpamp.FP32Optimizer` (no second fp32 copy) and supplies what FSDP2 does
not have:

* the dynamic loss scale with hysteresis and min scale (:class:`tpamp.DynamicGradScaler`,
  Megatron-LM's semantics): ``opt.scale_loss(loss).backward()`` runs the fp16 backward on the
  scaled loss; ``step()`` unscales the fp32 sharded grads;
* the inf/nan decision agreed over the whole mesh: the grad-stats group is every rank of the
  mesh (TP x DP, or PP x DP x TP under a pipeline), so an inf in one DP rank's shard skips the step on every rank, nothing changed;
* the global grad norm (clipping), zero count and per-parameter grad norms with every element
  counted once: a DP shard counts on its rank, a TP shard on its rank, a param replicated over
  TP (FSDP2 shards it over the DP mesh only, e.g. a LayerNorm weight) on TP rank 0 only
  (tpamp.grad_stats.is_tensor_parallel_shard);
* the spike detector (``spike_detector=``) and the checkpoints of
  :func:`tpamp.checkpoint.save_checkpoint` / ``load_checkpoint`` (torch.distributed.checkpoint;
  FSDP2's DTensors are saved as they are, in global shapes, with the optimizer state and the
  loss scaler; all-or-nothing load).

Usage (every rank)::

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], plan)                   # TP first
    policy = tpamp.fsdp.mixed_precision_policy(torch.float16)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"], mp_policy=policy)
    fully_shard(model, mesh=mesh["dp"], mp_policy=policy)
    opt = tpamp.fsdp.fully_shard_optimizer(
        torch.optim.AdamW(model.parameters(), lr=3e-4), mesh,
        grad_scaler=tpamp.DynamicGradScaler(initial_scale=2.0**16, hysteresis=2),
        clip_grad=1.0, log_num_zeros_in_grad=True)
    tracker = tpamp.fsdp.track_param_grad_norms(opt, model.named_parameters())
    loss = loss_fn(model(x), y)
    opt.scale_loss(loss).backward()
    result = opt.step(param_grad_norms=True)    # StepResult; tracker.norms {name: norm}
    opt.zero_grad()

A forward with no backward (evaluation) leaves FSDP2's root module unsharded: call
``model.reshard()`` after it, before the next ``named_parameters()`` (e.g. a checkpoint).

Pipeline parallelism: give the whole ``(pp, dp, tp)`` mesh (``ParallelState.mesh``); each stage
is fully_shard'ed on its own ``mesh["dp"]`` (TP on ``mesh["tp"]``) and the grad-stats group is
every rank of the mesh, so an inf on one stage's shard skips the step on every rank and the grad
norm and zero count cover every stage. Run the stages under ``torch.distributed.pipelining``
(``PipelineStage`` knows FSDP2's no-sync); a tied copy on another stage (the last stage's head
copy of the word embedding) is marked ``shared = True`` and its grad summed with its twin's by
the caller (local shards: both have the same DP x TP placements). scripts/train_gpt.py
``--use-torch-fsdp2 --pipeline-model-parallel-size 2`` is the worked example.

Mixture-of-experts (docs/spec.md section 19), torchtitan's layout: expert params stacked over
the experts are DTensors ``Shard(expert_dim)`` on ``ParallelState.expert_mesh["ep"]`` (each EP
rank its experts); :func:`fully_shard_experts` shards their module over the expert-data-parallel
dim ``expert_mesh["edp"]`` (FSDP2 makes them 2-D DTensors on ``expert_mesh["edp", "ep"]``) with
the gradient divide factor of the dense params' DP size, so that expert grads end at 1/dp like
dense ones (Megatron-LM's convention); dense params are fully_shard'ed on the DP mesh as above.
Give ``fully_shard_optimizer(..., expert_mesh=state.expert_mesh)``: every rank holds a distinct
piece of every expert param, so found_inf, the grad norm and the zero count of dense and expert
params are reduced together over every rank (one found_inf, one norm, one clip coefficient,
zeros added), an expert param replicated over expert-TP counted on expert-TP rank 0. Checkpoints
save the expert DTensors in their global shape (placements over EDP and EP), so a checkpoint
saved at EP 2 loads at EP 1 (or under the other wrappers).

Not covered: HSDP (a ``Replicate`` DP dim: its replicas would be counted twice); context
parallelism (a mesh with a ``cp`` dim is refused).
"""

from __future__ import annotations

import weakref
from typing import Iterable, Optional, Tuple

import torch
import torch.distributed as dist

from tpamp.grad_stats import is_expert_param
from tpamp.optimizer import FP32Optimizer
from tpamp.param_norms import ParamGradNormTracker

__all__ = [
    "mixed_precision_policy", "fully_shard_optimizer", "fully_shard_experts",
    "track_param_grad_norms",
]

Tensor = torch.Tensor
_POLICY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# optimizer built by fully_shard_optimizer -> the DP group of its mesh
_DP_GROUPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def mixed_precision_policy(dtype: torch.dtype):
    """FSDP2's ``MixedPrecisionPolicy`` for training in ``dtype`` on fp32 master weights:
    params all-gathered in ``dtype`` (float16/bfloat16; None for float32), grads reduced in
    float32 (as Megatron-LM reduces in fp32 with ``--accumulate-allreduce-grads-in-fp32``).
    Raises ValueError for another dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if dtype not in _POLICY_DTYPES:
        raise ValueError(f"dtype must be one of {_POLICY_DTYPES}, got {dtype!r}")
    return MixedPrecisionPolicy(
        param_dtype=None if dtype == torch.float32 else dtype, reduce_dtype=torch.float32
    )


def _mesh_dims(mesh, tp_dim: str, pp_dim: str = "pp") -> Tuple[Optional[str], str, Optional[str]]:
    """(pp dim or None, dp dim, tp dim or None) of a 1-, 2- or 3-D named mesh."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed DeviceMesh, got {type(mesh).__name__}")
    names = tuple(mesh.mesh_dim_names or ())
    expected = (f"a named 1-D DP mesh, a 2-D (dp, {tp_dim!r}) or ({pp_dim!r}, dp) mesh or a 3-D "
                f"({pp_dim!r}, dp, {tp_dim!r}) mesh")
    if mesh.ndim not in (1, 2, 3) or len(names) != mesh.ndim or len(set(names)) != len(names):
        raise ValueError(f"mesh must be {expected}, got {mesh.ndim} dims named {names}")
    pp = pp_dim if pp_dim in names else None
    tp = tp_dim if tp_dim in names else None
    rest = [n for n in names if n not in (pp, tp)]
    if len(rest) != 1:
        raise ValueError(
            f"mesh must be {expected}, got dims {names}: expected exactly one DP dim besides "
            f"{pp_dim!r} (pp_dim) and {tp_dim!r} (tp_dim)"
        )
    return pp, rest[0], tp


def _param_mesh(mesh, pp: Optional[str], dp: str, tp: Optional[str]):
    """The (sub-)mesh the params of this rank's model are sharded on: ``mesh`` without its PP
    dim (this rank's pipeline stage), i.e. ``mesh[dp]`` or ``mesh[dp, tp]``."""
    if pp is None:
        return mesh
    return mesh[dp, tp] if tp is not None else mesh[dp]


def _mesh_group(mesh):
    """A process group of every rank of ``mesh`` (the default group when the mesh is the world;
    otherwise ``dist.new_group``, a collective of every rank of the default group)."""
    ranks = sorted(mesh.mesh.flatten().tolist())
    if ranks == list(range(dist.get_world_size())):
        return dist.group.WORLD
    return dist.new_group(ranks)


def _describe_mesh(mesh) -> str:
    names = tuple(mesh.mesh_dim_names or ())
    return (f"DeviceMesh(dims {names}, sizes {tuple(mesh.mesh.shape)}, ranks {mesh.mesh.tolist()}, "
            f"{mesh.device_type!r})")


def _same_mesh(a, b) -> bool:
    """Same dim names, sizes, ranks (in mesh order) and device type."""
    return (tuple(a.mesh_dim_names or ()) == tuple(b.mesh_dim_names or ())
            and a.device_type == b.device_type and a.mesh.tolist() == b.mesh.tolist())


_EXPERT_DIMS = ("pp", "edp", "ep", "etp")


def _expert_param_meshes(expert_mesh, mesh) -> list:
    """The meshes an expert param of this rank's stage may have after :func:`fully_shard_experts`:
    ``expert_mesh["edp", "ep"]`` and ``expert_mesh["edp", "ep", "etp"]`` (stacked experts),
    ``expert_mesh["edp"]`` and ``expert_mesh["edp", "etp"]`` (one expert's param; index 3 is
    read by :func:`_is_edp_tp_mesh`). Raises TypeError /
    ValueError for an expert mesh that is not ``ParallelState.expert_mesh``-like or covers other
    ranks than ``mesh``."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(expert_mesh, DeviceMesh):
        raise TypeError(
            f"expert_mesh must be a DeviceMesh (ParallelState.expert_mesh), got "
            f"{type(expert_mesh).__name__}"
        )
    names = tuple(expert_mesh.mesh_dim_names or ())
    if names != _EXPERT_DIMS:
        raise ValueError(
            f"expert_mesh must have dims {_EXPERT_DIMS} (ParallelState.expert_mesh), got {names}"
        )
    if sorted(expert_mesh.mesh.flatten().tolist()) != sorted(mesh.mesh.flatten().tolist()):
        raise ValueError(
            f"expert_mesh {_describe_mesh(expert_mesh)} does not cover the ranks of mesh "
            f"{_describe_mesh(mesh)}: dense and expert params must be laid out on the same ranks"
        )
    return [expert_mesh["edp", "ep"], expert_mesh["edp", "ep", "etp"], expert_mesh["edp"],
            expert_mesh["edp", "etp"]]


def _check_fsdp_params(optimizer, dp_dim: str, mesh=None, tp_dim: Optional[str] = None,
                       given=None, expert_meshes=None) -> None:
    from torch.distributed.tensor import DTensor

    # the meshes a param of a model sharded on ``mesh`` (without its PP dim) may have: the
    # mesh itself (DP only, or a TP param sharded over DP too) or, with a TP dim, its DP
    # sub-mesh (a param replicated over TP that fully_shard shards over mesh[dp] only)
    allowed = [] if mesh is None else [mesh] + ([mesh[dp_dim]] if tp_dim is not None else [])

    for gi, group in enumerate(getattr(optimizer, "param_groups", [])):
        for pi, p in enumerate(group["params"]):
            where = f"param {pi} of param group {gi}"
            if not isinstance(p, DTensor):
                raise TypeError(
                    f"{where} is a {type(p).__name__}, not a DTensor sharded by fully_shard: "
                    "call fully_shard on the model before building the optimizer"
                )
            if is_expert_param(p):
                if expert_meshes is None:
                    raise ValueError(
                        f"{where} is an expert param (tpamp.is_expert_param: allreduce=False or "
                        f"an 'ep' mesh dim {tuple(p.device_mesh.mesh_dim_names or ())}): pass "
                        "expert_mesh=state.expert_mesh (ParallelState) and shard the experts "
                        "with tpamp.fsdp.fully_shard_experts (docs/spec.md section 19)"
                    )
                _check_expert_param(p, where, expert_meshes)
            if p.dtype != torch.float32:
                raise TypeError(
                    f"{where} has dtype {p.dtype}; fully_shard's sharded params are the fp32 "
                    "master weights: keep the model fp32 and give the compute dtype to "
                    "MixedPrecisionPolicy(param_dtype=...) (tpamp.fsdp.mixed_precision_policy)"
                )
            if is_expert_param(p):
                continue  # checked above, on its expert mesh
            if allowed and not any(_same_mesh(p.device_mesh, m) for m in allowed):
                raise ValueError(
                    f"{where} was sharded on {_describe_mesh(p.device_mesh)}, but "
                    f"fully_shard_optimizer was given {_describe_mesh(given or mesh)}"
                    + (f" (this stage's sub-mesh {_describe_mesh(mesh)})"
                       if given is not None and given is not mesh else "")
                    + (f" (DP sub-mesh {_describe_mesh(allowed[1])})" if len(allowed) > 1 else "")
                    + ": pass the mesh the model was fully_shard'ed (and tensor-parallelized) "
                    "on; with another mesh the grad norm, zero count and inf/nan decision would "
                    "miss other ranks' shards"
                )
            names = tuple(p.device_mesh.mesh_dim_names or ())
            # Shard, or _StridedShard (fully_shard over a TP-sharded dim 0: not a Shard
            # subclass, is_shard() False): both have a tensor dim, Replicate/Partial do not
            if dp_dim not in names or getattr(p.placements[names.index(dp_dim)], "dim", None) is None:
                raise ValueError(
                    f"{where} is not sharded over the DP mesh dim {dp_dim!r} (mesh dims {names}, "
                    f"placements {tuple(p.placements)}); expected fully_shard's Shard on "
                    f"{dp_dim!r} (HSDP's Replicate is not supported)"
                )


def _is_edp_tp_mesh(mesh, edp_etp) -> bool:
    """An ("edp", "tp") mesh on the ranks of ``expert_mesh["edp", "etp"]``: an expert param of a
    TP plan on the dense TP mesh (expert-TP = TP), fully_shard'ed over the expert-DP dim."""
    return (tuple(mesh.mesh_dim_names or ()) == ("edp", "tp")
            and mesh.device_type == edp_etp.device_type
            and mesh.mesh.tolist() == edp_etp.mesh.tolist())


def _check_expert_param(p, where: str, expert_meshes) -> None:
    """An expert param must be a DTensor of :func:`fully_shard_experts`: a stack of experts on
    ``expert_mesh["edp", "ep"(, "etp")]`` with a shard over "edp" and "ep", or one expert's
    param (named by its global expert index) on ``expert_mesh["edp"(, "etp")]``, sharded over
    "edp" and carrying no ``expert_dim`` (a stack without its "ep" dim would be saved in the
    shape of this rank's experts, not the global one)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor) or not (
            any(_same_mesh(p.device_mesh, m) for m in expert_meshes)
            or _is_edp_tp_mesh(p.device_mesh, expert_meshes[3])):
        got = _describe_mesh(p.device_mesh) if isinstance(p, DTensor) else type(p).__name__
        raise ValueError(
            f"{where} is an expert param sharded on {got}, expected "
            f"{_describe_mesh(expert_meshes[0])} (or with 'etp'; one expert's param: "
            f"{_describe_mesh(expert_meshes[2])}): put the stacked experts on "
            "expert_mesh['ep'] (Shard(expert_dim)) and shard their module with "
            "tpamp.fsdp.fully_shard_experts; otherwise the grad statistics would miss or double "
            "count expert shards"
        )
    names = tuple(p.device_mesh.mesh_dim_names)
    if "ep" not in names and getattr(p, "expert_dim", None) is not None:
        raise ValueError(
            f"{where} is a stack of experts (expert_dim={p.expert_dim}) on "
            f"{_describe_mesh(p.device_mesh)} without an 'ep' dim: put it on expert_mesh['ep'] "
            "(Shard(expert_dim)) before fully_shard_experts, so that it has its global shape"
        )
    for dim in ("edp", "ep") if "ep" in names else ("edp",):
        if getattr(p.placements[names.index(dim)], "dim", None) is None:
            raise ValueError(
                f"{where} is an expert param not sharded over {dim!r} (placements "
                f"{tuple(p.placements)}): expected Shard on 'ep' (the experts) and fully_shard's "
                "Shard on 'edp'"
            )


def fully_shard_experts(module: torch.nn.Module, expert_mesh, data_parallel_size: int,
                        **fully_shard_kwargs):
    """``fully_shard(module, mesh=expert_mesh["edp"], **fully_shard_kwargs)`` for a module of
    expert params (stacked experts as DTensors ``Shard(expert_dim)`` on ``expert_mesh["ep"]``),
    with the gradient divide factor ``data_parallel_size`` instead of FSDP2's default (the EDP
    size): each expert's grad is summed over the tokens of its EP group's ranks by the token
    dispatch, then over EDP by the reduce-scatter, so dividing by the dense DP size (x CP) makes
    expert grads end at 1/dp like dense ones (Megatron-LM scales expert grads by edp/dp).
    On gloo (no PREMUL_SUM) the reduce-scatter is a SUM followed by the division. Returns
    ``module`` (now an FSDPModule; its params are DTensors on ``expert_mesh["edp", "ep"]``). Call it before ``fully_shard`` of the enclosing modules.

    expert_mesh: ``ParallelState.expert_mesh`` (dims pp, edp, ep, etp) or this stage's slice of
        it with an "edp" dim. data_parallel_size: the dense params' DP (x CP) size, a positive int.
    Raises TypeError for a module that is not an nn.Module or a data_parallel_size that is not
    an int; ValueError for a data_parallel_size < 1 or a mesh without an "edp" dim.
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(expert_mesh, DeviceMesh):
        raise TypeError(f"expert_mesh must be a DeviceMesh, got {type(expert_mesh).__name__}")
    if "edp" not in tuple(expert_mesh.mesh_dim_names or ()):
        raise ValueError(
            f"expert_mesh must have an 'edp' dim (ParallelState.expert_mesh), got dims "
            f"{expert_mesh.mesh_dim_names}"
        )
    if isinstance(data_parallel_size, bool) or not isinstance(data_parallel_size, int):
        raise TypeError(
            f"data_parallel_size must be an int, got {type(data_parallel_size).__name__}"
        )
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
    fully_shard(module, mesh=expert_mesh["edp"], **fully_shard_kwargs)
    module.set_gradient_divide_factor(float(data_parallel_size))
    if dist.get_backend(expert_mesh["edp"].get_group()) == "gloo":
        # gloo has no PREMUL_SUM: a SUM reduce-scatter, then the division on each shard
        module.set_force_sum_reduction_for_comms(True)
    return module


def fully_shard_optimizer(optimizer: torch.optim.Optimizer, mesh, *, tp_dim: str = "tp",
                          pp_dim: str = "pp", expert_mesh=None, **kwargs) -> FP32Optimizer:
    """:class:`tpamp.FP32Optimizer` around ``optimizer`` for ``fully_shard``'ed params: the
    fp32 sharded DTensor params are the master weights (no copy is made) and found_inf, the
    grad norm, the zero count and per-parameter norms are reduced over every rank of ``mesh``.

    optimizer: a torch.optim.Optimizer over the params of a model already sharded with
        ``fully_shard`` (fp32 DTensors, Shard on the DP dim of ``mesh``).
    mesh: the DeviceMesh of the model's layout: 1-D (DP only; any dim name but ``tp_dim`` /
        ``pp_dim``), 2-D with a dim named ``tp_dim`` (TP x FSDP) or ``pp_dim`` (PP x FSDP),
        or 3-D ``(pp, dp, tp)`` (tpamp.parallel's mesh, ``ParallelState.mesh``); the dim that
        is neither is DP. Without a PP dim the params must be sharded on ``mesh`` (a sub-mesh
        of a larger mesh is fine, e.g. ``mesh["dp", "tp"]``); with one, each pipeline stage's
        params are sharded on its own sub-mesh without the PP dim (``mesh["dp", "tp"]`` /
        ``mesh["dp"]`` as seen from the rank) and the grad-stats group is every rank of the
        whole mesh: found_inf, the grad norm, the zero count and per-parameter norms are
        agreed over PP x DP x TP, each stage's params counted on its own ranks. A tied copy on
        another stage (the last stage's output head of the word embedding) must carry
        ``shared = True`` (set it again after ``fully_shard``, which makes new params) so that
        it is counted once, as in :mod:`tpamp.grad_stats`.
    tp_dim: the name of the TP dim. pp_dim: the name of the PP dim.
    expert_mesh: with expert params (:func:`tpamp.is_expert_param`), ``ParallelState.expert_mesh``
        (dims pp, edp, ep, etp, on the ranks of ``mesh``); the expert params must be DTensors on
        ``expert_mesh["edp", "ep"(, "etp")]`` as :func:`fully_shard_experts` makes them (stacked
        experts), or on ``expert_mesh["edp"(, "etp")]`` (or "edp" x the dense "tp" dim on the
        same ranks, expert-TP = TP) for a param of one expert named by its
        global expert index (mark it again with :func:`tpamp.mark_expert_param` after
        fully_shard, which makes new params). Dense
        and expert statistics are reduced over every rank of ``mesh`` together (each rank holds
        a distinct piece of each expert param); an expert param replicated over expert-TP counts
        on expert-TP rank 0 (``expert_tensor_parallel_group`` is set from ``expert_mesh["etp"]``).
        Pass ``parallel_state=`` and ``param_names=`` (kwargs) to name expert params with their
        EP rank in ``last_nonfinite``.
    kwargs: the other arguments of :class:`tpamp.MixedPrecisionOptimizer` (grad_scaler,
        clip_grad, norm_type, log_num_zeros_in_grad, skip_nonfinite, spike_detector,
        fused_step, sync_free, deterministic_grad_norm), with its guards (step guard, cross-rank
        settings check).

    Returns the :class:`tpamp.FP32Optimizer`; its ``fsdp_data_parallel_group`` is the mesh's DP
    group, across which the first step's settings check compares the inner optimizer's
    hyperparameters (the DP ranks hold shards of the same params).

    Collective: every rank of ``mesh`` must call it (when ``mesh`` does not span the whole
    default group, a ``new_group``: then every rank of the default group).
    Raises TypeError for a mesh that is not a DeviceMesh or a param that is not an fp32
    DTensor; ValueError for a mesh of other dims, a param sharded on another mesh than
    ``mesh`` (or its stage's sub-mesh without the PP dim, and with a TP dim its DP
    sub-mesh; dims, sizes and ranks compared, both meshes named), a param not sharded over the DP dim, or grad_stats_group / tensor_parallel_group
    given (this function sets them; also expert_grad_stats_group /
    expert_tensor_parallel_group), an expert param without ``expert_mesh``, on another mesh than
    those above or not sharded over "edp" (and "ep"), an ``expert_mesh`` without the dims
    (pp, edp, ep, etp) or on other ranks than ``mesh`` (TypeError if it is not a DeviceMesh).
    Nothing is changed when it raises.
    """
    for key in ("grad_stats_group", "tensor_parallel_group", "expert_grad_stats_group",
                "expert_tensor_parallel_group"):
        if key in kwargs:
            raise ValueError(f"fully_shard_optimizer sets {key} from the mesh; do not pass it")
    pp, dp_dim, tp = _mesh_dims(mesh, tp_dim, pp_dim)
    param_mesh = _param_mesh(mesh, pp, dp_dim, tp)
    expert_meshes = None if expert_mesh is None else _expert_param_meshes(expert_mesh, mesh)
    _check_fsdp_params(optimizer, dp_dim, param_mesh, tp, given=mesh, expert_meshes=expert_meshes)
    tp_group = mesh[tp].get_group() if tp is not None else None
    dp_group = mesh[dp_dim].get_group() if mesh.ndim > 1 else mesh.get_group()
    group = _mesh_group(mesh)
    if expert_mesh is not None:
        # one group for both: every rank holds a distinct piece of each dense and expert param
        kwargs["expert_grad_stats_group"] = group
        kwargs["expert_tensor_parallel_group"] = expert_mesh["etp"].get_group()
    opt = FP32Optimizer(
        optimizer, grad_stats_group=group, tensor_parallel_group=tp_group, **kwargs
    )
    _DP_GROUPS[opt] = dp_group
    # the DP ranks hold shards of the same params: the cross-rank settings check compares the
    # inner optimizer's hyperparameters across them (tpamp._peer_settings; docs/spec.md 2.4)
    opt.fsdp_data_parallel_group = dp_group
    return opt


def track_param_grad_norms(optimizer, named_params: Iterable[Tuple[str, Tensor]]):
    """Per-parameter grad norms for a :func:`fully_shard_optimizer` (the FSDP2 counterpart of
    ``optimizer.track_param_grad_norms``): every rank of the mesh holds a piece of every param,
    so all give the same names. Returns the :class:`tpamp.param_norms.ParamGradNormTracker`,
    also set as ``optimizer.param_norm_tracker``; after ``optimizer.step(param_grad_norms=True)``
    its ``norms`` are {name: norm of the full, unsharded gradient} on every rank.

    Collective: every rank of the optimizer's mesh must call it, once, with the same names
    (a rank that skips it leaves the others waiting in the first tracked step). Raises
    ValueError for an optimizer that :func:`fully_shard_optimizer` did not build, and as the
    tracker does (:class:`tpamp.param_norms.ParamGradNormTracker`)."""
    if optimizer not in _DP_GROUPS:
        raise ValueError(
            "track_param_grad_norms takes an optimizer built by tpamp.fsdp.fully_shard_optimizer, "
            f"got {type(optimizer).__name__}"
        )
    tracker = ParamGradNormTracker(
        optimizer, named_params, data_parallel_group=_DP_GROUPS[optimizer]
    )
    optimizer.param_norm_tracker = tracker
    return tracker
