"""Matrix optimizers under tensor parallelism with the unsharded model's math (docs/spec.md
section 17), and the check that no optimizer silently does other math over sharded params.

``torch.optim.Muon`` orthogonalises each whole 2-D update (Newton-Schulz) and scales its lr by the
matrix's shape; ``torch.optim.Adafactor`` factors the second moment into row and column means
and scales by the param's RMS. Over a tensor-parallel shard each rank would see its slice only.
:class:`TensorParallelMuon` and :class:`TensorParallelAdafactor` are those torch classes (same
arguments, same state keys) whose step reads each param's layout -- a Megatron TP param
(``tensor_model_parallel``, ``partition_dim``, stride 1) over ``tensor_parallel_group``, or a
DTensor with one ``Shard(d)`` placement on a 1-D mesh -- and communicates what the whole matrix
needs, so that the result equals the torch class stepping the unsharded param:

* Muon, ``tp_mode`` (Megatron-core's ``--muon-tp-mode``):
  ``"duplicated"`` (default): all-gather the momentum update, the full Newton-Schulz on every TP
  rank, keep the own slice (bit-identical to the unsharded torch step in the same dtype);
  ``"distributed"``: keep the shard, all-reduce the Gram matrix of each Newton-Schulz iteration
  (the product over the sharded dim; equal to bf16 rounding, as the torch step is done in
  bf16); ``"blockwise"``: each shard orthogonalised alone -- other math, which depends on the TP
  size and layout; only on request. The lr adjustment uses the global shape in every mode.
  The momentum buffer stays sharded.
* Adafactor: the row and column means of grad**2, the mean of the row factor and the norms of
  the param and of the update are reduced over the TP group (small all-reduces); the factored
  state stays sharded along the split dim.

torch's Newton-Schulz and lr adjustment are private to torch/optim/_muon.py, so the same ops
are written here (``_newton_schulz``, ``_adjust_lr``); tests/test_matrix_optimizers.py holds
them bit-identical to torch.optim.Muon on whole params. Adafactor's step is re-done with the
reductions and tested against torch.optim.Adafactor.

:func:`is_elementwise_optimizer` / :func:`declare_elementwise` say which inner optimizers work
on any slice of a param alone (SGD, Adam, ...); :func:`check_sharded_math` (called by every
tpamp wrapper at construction) refuses any other optimizer over sharded params unless it is
tensor-parallel aware (the two classes here, :class:`CombinedOptimizer` of such parts).

:class:`CombinedOptimizer` steps several torch optimizers as one (e.g. Muon for the hidden
matrices and AdamW for the rest), so one tpamp wrapper gives them one loss scaler, one
found_inf, one grad norm and one clip; :func:`split_muon_params` splits named params Megatron's
way and :func:`muon_with_adamw` builds the pair.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from tpamp import _load
from tpamp._checks import check_group_member
from tpamp.common import is_dtensor, local_tensor
from tpamp.hyperparameters import (
    check_group_hyperparameters,
    check_optimizer_hyperparameters,
    group_optimizer_classes,
)
from tpamp.param_groups import match_saved_groups

__all__ = [
    "MUON_TP_MODES",
    "CombinedOptimizer",
    "TensorParallelAdafactor",
    "TensorParallelMuon",
    "check_sharded_math",
    "declare_elementwise",
    "is_elementwise_optimizer",
    "muon_with_adamw",
    "split_muon_params",
]

Tensor = torch.Tensor
MUON_TP_MODES = ("duplicated", "distributed", "blockwise")

# torch.optim classes whose update of each element reads only that element's grad and state
# (so any slice of a param, a TP shard or a flat piece, steps as the whole param would).
_ELEMENTWISE: set = {
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
    torch.optim.RMSprop, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
    torch.optim.Adadelta, torch.optim.ASGD, torch.optim.Rprop,
}


def declare_elementwise(cls: type) -> type:
    """Declare an optimizer class elementwise: its update of each param element reads only that
    element's grad and state (no norm, no matrix product, no shape), so tpamp may step it over
    TP shards, DTensor shards and DistributedOptimizer's flat pieces. Subclasses inherit it.
    Returns ``cls`` (usable as a class decorator). Raises TypeError for anything but a
    subclass of torch.optim.Optimizer."""
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"declare_elementwise takes a torch.optim.Optimizer subclass, got {cls!r}")
    _ELEMENTWISE.add(cls)
    return cls


def is_elementwise_optimizer(optimizer) -> bool:
    """True if ``optimizer`` (an instance or a class) is known to update each element from that
    element alone: an instance of torch's SGD, Adam, AdamW, Adagrad, RMSprop, Adamax, NAdam,
    RAdam, Adadelta, ASGD, Rprop or of a class given to :func:`declare_elementwise` (subclasses
    included), or a :class:`CombinedOptimizer` whose parts all are. Muon, Adafactor, LBFGS and
    unknown classes are not."""
    if isinstance(optimizer, CombinedOptimizer):
        return all(is_elementwise_optimizer(o) for o in optimizer.optimizers)
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    return any(issubclass(cls, known) for known in _ELEMENTWISE)


def _is_sharded(param: Tensor) -> bool:
    """A TP shard (Megatron attribute) or any DTensor with a Shard placement (TP or FSDP)."""
    if getattr(param, "tensor_model_parallel", False):
        return True
    return is_dtensor(param) and any(pl.is_shard() for pl in param.placements)


def check_sharded_math(optimizer, *, flat_pieces: bool = False) -> None:
    """Refuse an inner optimizer that would silently do other math than on the unsharded model.

    Called by every tpamp wrapper before anything changes (MixedPrecisionOptimizer's shared
    core). ``flat_pieces``: the wrapper steps the inner optimizer over flat pieces of its
    params (tpamp.DistributedOptimizer). An elementwise optimizer (:func:`is_elementwise_optimizer`)
    is always accepted; a tensor-parallel-aware one (attribute ``tensor_parallel_aware`` True:
    :class:`TensorParallelMuon`, :class:`TensorParallelAdafactor`) over TP/DTensor shards but not
    over flat pieces; any other optimizer only over unsharded params.

    Raises:
        TypeError: anything but a torch.optim.Optimizer;
        ValueError: naming the optimizer class, one offending param and what to use instead.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"check_sharded_math takes a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if isinstance(optimizer, CombinedOptimizer):
        for part in optimizer.optimizers:
            check_sharded_math(part, flat_pieces=flat_pieces)
        return
    if is_elementwise_optimizer(optimizer):
        return
    name = type(optimizer).__name__
    params = [(gi, pi, p) for gi, g in enumerate(optimizer.param_groups)
              for pi, p in enumerate(g["params"])]
    if flat_pieces and params:
        raise ValueError(
            f"{name} is not known to be elementwise, and tpamp.DistributedOptimizer steps it over "
            "flat pieces of the params (a piece is not a matrix): its math would silently differ "
            "from the unsharded model's. If its update of each element reads only that element's "
            f"grad and state, declare it: tpamp.declare_elementwise({name}); for a matrix "
            "optimizer (Muon, Adafactor) use tpamp.MixedPrecisionOptimizer with "
            "tpamp.TensorParallelMuon / tpamp.TensorParallelAdafactor (docs/spec.md section 17)")
    if getattr(optimizer, "tensor_parallel_aware", False):
        return
    for gi, pi, p in params:
        if _is_sharded(p):
            where = (f"placements {tuple(p.placements)}" if is_dtensor(p)
                     else f"tensor_model_parallel=True, partition_dim={getattr(p, 'partition_dim', None)}")
            raise ValueError(
                f"{name} is not known to be elementwise, and param {pi} of group {gi} (local "
                f"shape {tuple(local_tensor(p).shape)}, {where}) is sharded: stepping each shard "
                "alone would silently differ from the unsharded model's math. For Muon use "
                "tpamp.TensorParallelMuon(..., tp_mode='duplicated'|'distributed'|'blockwise'), "
                "for Adafactor tpamp.TensorParallelAdafactor; if the optimizer's update of each "
                "element reads only that element's grad and state, declare it: "
                f"tpamp.declare_elementwise({name}) (docs/spec.md section 17)")


# -- a param's tensor-parallel layout ---------------------------------------------------------


class _Layout:
    """How one param is split: ``dim`` (None: whole), the group, its size and this rank's index,
    the global shape."""

    def __init__(self, param: Tensor, tensor_parallel_group, who: str):
        local = tuple(local_tensor(param).shape)
        self.dim, self.group, self.size, self.rank = None, None, 1, 0
        self.shape = local
        if is_dtensor(param):
            shard = [pl for pl in param.placements if pl.is_shard()]
            if not shard:
                return
            mesh = param.device_mesh
            if mesh.ndim != 1 or len(shard) != 1:
                raise ValueError(
                    f"{who}: a DTensor param with placements {tuple(param.placements)} on a "
                    f"{mesh.ndim}-D mesh; only one Shard(d) on a 1-D tensor-parallel mesh is "
                    "supported (FSDP-sharded params need a layer-wise optimizer)")
            self.dim, self.group = shard[0].dim % len(local), mesh.get_group(0)
            self.shape = tuple(param.shape)
        elif getattr(param, "tensor_model_parallel", False):
            if getattr(param, "partition_stride", 1) != 1:
                raise ValueError(f"{who}: a Megatron TP param with partition_stride "
                                 f"{param.partition_stride} (only 1 is supported)")
            if tensor_parallel_group is None:
                raise ValueError(
                    f"{who}: a Megatron TP param (tensor_model_parallel=True) needs "
                    "tensor_parallel_group (the TP process group), got None")
            dim = getattr(param, "partition_dim", None)
            if isinstance(dim, bool) or not isinstance(dim, int) or not 0 <= dim < len(local):
                raise ValueError(
                    f"{who}: a Megatron TP param (tensor_model_parallel=True) of shape {local} "
                    f"with partition_dim={dim!r}; expected an int in [0, {len(local)}): the "
                    "dim along which the TP ranks split it")
            self.dim, self.group = dim, tensor_parallel_group
            shape = list(local)
            shape[self.dim] *= dist.get_world_size(tensor_parallel_group)
            self.shape = tuple(shape)
        else:
            return
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        if self.shape[self.dim] != local[self.dim] * self.size:
            raise ValueError(f"{who}: uneven TP shards (global shape {self.shape}, local {local} "
                             f"over {self.size} ranks) are not supported")

    @classmethod
    def whole(cls, t: Tensor) -> "_Layout":
        """The layout of an unsplit tensor."""
        return cls(t, None, "")

    def with_local(self, t: Tensor) -> "_Layout":
        """The same split of another local tensor ``t`` (e.g. the Q rows of a shard)."""
        out = _Layout.whole(t)
        out.dim, out.group, out.size, out.rank = self.dim, self.group, self.size, self.rank
        shape = list(t.shape)
        shape[self.dim] *= self.size
        out.shape = tuple(shape)
        return out

    def all_reduce(self, t: Tensor) -> Tensor:
        if self.size > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def gather(self, t: Tensor) -> Tensor:
        """The whole tensor from every rank's slice along ``dim`` (rank order)."""
        if self.dim is None or self.size == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=self.dim)

    def own(self, t: Tensor) -> Tensor:
        """This rank's slice of a whole tensor."""
        if self.dim is None or self.size == 1:
            return t
        return t.chunk(self.size, dim=self.dim)[self.rank]


def _scalar(x) -> float:
    return float(x.item()) if isinstance(x, Tensor) else float(x)


def _checked_state_dict(opt: torch.optim.Optimizer, state_dict, keep: Sequence[str] = ()) -> dict:
    """``state_dict`` checked against ``opt`` before anything changes (the wrappers' check,
    :func:`tpamp._load.check_inner_optimizer_state`: group and param counts, the class's
    hyperparameter keys and values, state keys, shapes and finiteness), with the entries
    ``keep`` that a saved group lacks (a torch.optim state dict has no tp_mode) taken from the
    live group. A new dict; the caller's is not changed."""
    _load.check_inner_optimizer_state(opt, state_dict, "state_dict")
    groups = []
    for saved, live in zip(state_dict["param_groups"], opt.param_groups):
        g = dict(saved)
        for k in keep:
            if k not in g:
                g[k] = live[k]
        groups.append(g)
    return {**state_dict, "param_groups": groups}


def _numel(shape) -> int:
    return math.prod(shape)


# -- Muon ---------------------------------------------------------------------------------------


def _newton_schulz(x: Tensor, coefficients, steps: int, eps: float, group=None,
                   shard_dim: Optional[int] = None) -> Tensor:
    """torch.optim.Muon's orthogonalisation (the same ops in the same order, bf16) of a matrix
    that is whole (``group`` None) or split along ``shard_dim`` over ``group``; then the Gram
    matrix of each iteration is the product over the split dim, reduced in fp32."""
    a, b, c = coefficients
    sharded = group is not None and dist.get_world_size(group) > 1
    y = x.bfloat16()
    rows, cols = x.shape
    if sharded:  # the orientation of the whole matrix
        n = dist.get_world_size(group)
        rows, cols = (rows * n, cols) if shard_dim == 0 else (rows, cols * n)
    transposed = rows > cols
    if transposed:
        y = y.T
        shard_dim = None if shard_dim is None else 1 - shard_dim
    if not sharded:
        y.div_(y.norm().clamp(min=eps))
        for _ in range(steps):
            gram = y @ y.T
            gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            y = torch.addmm(y, gram_update, y, beta=a)
    else:
        sq = y.float().square().sum()
        dist.all_reduce(sq, group=group)
        y.div_(sq.sqrt().to(y.dtype).clamp(min=eps))
        for _ in range(steps):
            if shard_dim == 1:  # split along the long dim: the small Gram y y^T, summed
                gram = y.float() @ y.float().T
                dist.all_reduce(gram, group=group)
                gram = gram.to(y.dtype)
                gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
                y = torch.addmm(y, gram_update, y, beta=a)
            else:  # split along the short dim: y (y^T y) has the same polynomial
                gram = y.float().T @ y.float()
                dist.all_reduce(gram, group=group)
                gram = gram.to(y.dtype)
                gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
                y = torch.addmm(y, y, gram_update, beta=a)
    return y.T if transposed else y


def _adjust_lr(lr: float, adjust_lr_fn: Optional[str], shape) -> float:
    """torch.optim.Muon's lr adjustment of an (A, B) matrix."""
    a, b = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, a / b))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(a, b))
    return lr


def _check_qkv(sizes, rows: int, who: str) -> Tuple[int, ...]:
    if sizes is None:
        return None
    if (not isinstance(sizes, (tuple, list)) or len(sizes) < 2
            or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes)):
        raise ValueError(f"{who}: qkv_split_sizes must be a tuple of >= 2 positive ints (the "
                         f"rows of Q, K, V in one block), got {sizes!r}")
    if rows % sum(sizes):
        raise ValueError(f"{who}: qkv_split_sizes {tuple(sizes)} (sum {sum(sizes)}) do not tile "
                         f"the param's {rows} global rows")
    return tuple(sizes)


def _qkv_views(x: Tensor, sizes) -> List[Tensor]:
    """The Q, K, V matrices of a fused [blocks x sum(sizes), cols] weight: component i is the
    rows [off_i, off_i + sizes[i]) of every block, stacked."""
    cols = x.shape[1]
    blocks = x.reshape(-1, sum(sizes), cols)
    out, off = [], 0
    for s in sizes:
        out.append(blocks[:, off:off + s, :].reshape(-1, cols))
        off += s
    return out


def _qkv_join(parts: List[Tensor], sizes, like: Tensor) -> Tensor:
    cols = like.shape[1]
    n_blocks = like.shape[0] // sum(sizes)
    return torch.cat([p.reshape(n_blocks, s, cols) for p, s in zip(parts, sizes)],
                     dim=1).reshape(like.shape)


class TensorParallelMuon(torch.optim.Muon):
    """``torch.optim.Muon`` with the unsharded math over tensor-parallel shards.

    Same arguments, defaults and state (``momentum_buffer``, the shape of the local param) as
    torch.optim.Muon, plus:

    Args:
        tp_mode: ``"duplicated"`` (default), ``"distributed"`` or ``"blockwise"``
            (Megatron-core's ``--muon-tp-mode``; module docstring). A per-group option too.
        tensor_parallel_group: the TP process group of Megatron-attribute params
            (``tensor_model_parallel``, ``partition_dim``); DTensor params use their mesh's.
        qkv_split_sizes (param-group option, default None): for a fused QKV weight of global
            shape [blocks x sum(sizes), cols], the rows of Q, K and V in one block (e.g.
            ``(h, h, h)`` for [Q; K; V], or Megatron's interleaved GQA layout
            ``(heads_per_group * head_dim, head_dim, head_dim)``): Q, K and V are orthogonalised
            separately, each with the lr adjustment of its own shape, as the unsharded model
            with three separate weights would be. Put the QKV weight in its own param group.

    Every param is 2-D (as torch.optim.Muon requires); a sharded param splits evenly along one
    dim. Math: momentum (elementwise on the shard), the Newton-Schulz orthogonalisation of the
    whole update in bf16 (as torch's), decoupled weight decay, lr adjusted by the GLOBAL shape
    (``adjust_lr_fn``). tp_mode "duplicated" equals torch.optim.Muon on the unsharded param
    bit for bit in the same dtype; "distributed" to bf16 rounding of the Newton-Schulz
    iteration; "blockwise" is other math (each shard orthogonalised alone).
    Collectives per sharded matrix per step: duplicated one all-gather of the fp32 update;
    distributed 1 + ns_steps all-reduces (a scalar and the Gram matrix: the short side
    squared when the long side is split); blockwise none. Unsharded params: none.

    Momentum norms (for the per-parameter update statistics, tpamp/update_norms.py): with
    ``record_momentum_norms = True`` a step fills ``momentum_norms``, [(param, float32 0-dim
    tensor)] of the local L2 norm of each stepped param's momentum update before the
    orthogonalisation (``grad.lerp(buf, momentum)`` with nesterov, else the buffer), on the
    param's device, nothing read on the host; the tpamp wrappers set it on the steps with
    ``param_update_norms=True`` and combine the shards' norms over TP. Off (the default), a step
    does no extra work and leaves ``momentum_norms`` None.

    Raises:
        ValueError: a bad tp_mode, qkv_split_sizes that do not tile the rows, a Megatron TP
            param without tensor_parallel_group, an uneven or multi-dim shard, a DTensor not on
            a 1-D mesh; qkv_split_sizes with tp_mode "distributed" when a shard does not hold
            whole blocks. And what torch.optim.Muon raises.
    """

    tensor_parallel_aware = True

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1,
                 momentum: float = 0.95, nesterov: bool = True, ns_coefficients=None,
                 eps: float = 1e-7, ns_steps: int = 5, adjust_lr_fn: Optional[str] = None, *,
                 tp_mode: str = "duplicated", tensor_parallel_group=None):
        kwargs = {} if ns_coefficients is None else {"ns_coefficients": tuple(ns_coefficients)
                                                     if isinstance(ns_coefficients, list)
                                                     else ns_coefficients}
        # the defaults before torch's constructor reads them (it compares them with numbers)
        self._check_group(dict(lr=lr, weight_decay=weight_decay, momentum=momentum,
                               nesterov=nesterov, eps=eps, ns_steps=ns_steps,
                               adjust_lr_fn=adjust_lr_fn, tp_mode=tp_mode, **kwargs), "defaults")
        check_group_member(tensor_parallel_group, "tensor_parallel_group")
        # read by add_param_group, which torch's constructor calls for every group
        self.tensor_parallel_group = tensor_parallel_group
        self._tp_mode = tp_mode
        self.record_momentum_norms = False
        self.momentum_norms: Optional[List[Tuple[Tensor, Tensor]]] = None
        super().__init__(params, lr=lr, weight_decay=weight_decay, momentum=momentum,
                         nesterov=nesterov, eps=eps, ns_steps=ns_steps,
                         adjust_lr_fn=adjust_lr_fn, **kwargs)

    def add_param_group(self, param_group: dict) -> None:
        """torch's, after checking the group as it will be stepped (the defaults filled in,
        before anything changes): the hyperparameters (:mod:`tpamp.hyperparameters`: momentum
        in [0, 1), eps > 0, three ns_coefficients, ns_steps in [0, 100), a finite lr >= 0,
        ...), tp_mode, qkv_split_sizes and each param's layout. Used by the constructor for
        every group and for a group added later alike."""
        gi = len(getattr(self, "param_groups", ()))
        group = {**self.defaults, "tp_mode": self._tp_mode, "qkv_split_sizes": None,
                 **(param_group if isinstance(param_group, Mapping) else {})}
        self._check_group(group, gi)
        params = param_group.get("params") if isinstance(param_group, Mapping) else None
        if isinstance(params, (list, tuple)):
            for pi, p in enumerate(params):
                if isinstance(p, Tensor):
                    self._check_param(p, group, f"TensorParallelMuon param {pi} of group {gi}")
        param_group = dict(param_group) if isinstance(param_group, Mapping) else param_group
        if isinstance(param_group, dict):
            param_group.setdefault("tp_mode", self._tp_mode)
            param_group.setdefault("qkv_split_sizes", None)
        super().add_param_group(param_group)

    @staticmethod
    def _check_group(group: Mapping, gi, read_tensors: bool = True) -> None:
        where = (f"TensorParallelMuon param group {gi}" if isinstance(gi, int)
                 else f"TensorParallelMuon {gi}")
        check_group_hyperparameters(TensorParallelMuon, group, where, read_tensors=read_tensors)
        if group.get("tp_mode") not in MUON_TP_MODES:
            raise ValueError(f"{where}: tp_mode must be one of {MUON_TP_MODES}, "
                             f"got {group.get('tp_mode')!r}")

    def _check_param(self, p: Tensor, group: Mapping, who: str) -> None:
        if p.dim() != 2:  # torch.optim.Muon's rule (its constructor checks only its own groups)
            raise ValueError(f"{who}: Muon only supports 2D parameters, got one of shape "
                             f"{tuple(p.shape)}")
        layout = _Layout(p, self.tensor_parallel_group, who)
        sizes = _check_qkv(group["qkv_split_sizes"], layout.shape[0], who)
        if (sizes is not None and group["tp_mode"] != "duplicated"
                and layout.dim == 0 and (layout.shape[0] // sum(sizes)) % layout.size):
            raise ValueError(
                f"{who}: qkv_split_sizes {sizes} with tp_mode {group['tp_mode']!r} "
                f"need whole blocks on each of the {layout.size} TP ranks "
                f"({layout.shape[0] // sum(sizes)} blocks); use tp_mode='duplicated'")

    def load_state_dict(self, state_dict) -> None:
        """torch's load, checked first (nothing changes when refused): the saved groups'
        hyperparameters by this class's rules (:mod:`tpamp.hyperparameters`), tp_mode and
        qkv_split_sizes. A state dict of ``torch.optim.Muon`` (its groups have no tp_mode
        or qkv_split_sizes) loads: each group keeps its live tp_mode and qkv_split_sizes."""
        state_dict = _checked_state_dict(self, state_dict, ("tp_mode", "qkv_split_sizes"))
        for gi, saved in enumerate(state_dict["param_groups"]):
            self._check_group(saved, gi)
            for pi, p in enumerate(self.param_groups[gi]["params"]):
                self._check_param(p, saved, f"TensorParallelMuon param {pi} of group {gi}")
        super().load_state_dict(state_dict)

    @torch.no_grad()
    def step(self, closure=None):
        """One Muon step of every param with a grad (class docstring); returns closure().
        The groups' hyperparameters are checked first (values set since construction, e.g. by
        a scheduler; a tensor lr on an accelerator is not read); a param of no element is left
        alone."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # everything checked before any param changes: the groups' values (set since, e.g. by a
        # scheduler), each layout and qkv_split_sizes
        todo = []
        for gi, group in enumerate(self.param_groups):
            self._check_group(group, gi, read_tensors=False)
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if p.grad.is_sparse or torch.is_complex(p):
                    raise RuntimeError("Muon does not support sparse gradients or complex params")
                who = f"TensorParallelMuon param {pi} of group {gi}"
                layout = _Layout(p, self.tensor_parallel_group, who)
                _check_qkv(group["qkv_split_sizes"], layout.shape[0], who)
                if _numel(layout.shape):  # no element: nothing to update (every TP rank)
                    todo.append((group, p, layout))
        record = self.record_momentum_norms
        if type(record) is not bool:
            raise TypeError("TensorParallelMuon.record_momentum_norms must be a bool, got "
                            f"{type(record).__name__} {record!r}")
        self.momentum_norms = [] if record else None
        for group, p, layout in todo:
            lr, wd, mu = _scalar(group["lr"]), group["weight_decay"], group["momentum"]
            param, grad = local_tensor(p), local_tensor(p.grad)
            state = self.state[p]
            if "momentum_buffer" not in state:  # a DTensor like the param's for a DTensor
                state["momentum_buffer"] = torch.zeros_like(p.grad)
            buf = local_tensor(state["momentum_buffer"])
            buf.lerp_(grad, 1 - mu)
            update = grad.lerp(buf, mu) if group["nesterov"] else buf
            if record:
                self.momentum_norms.append(
                    (p, torch.linalg.vector_norm(update, dtype=torch.float32)))
            sizes = group["qkv_split_sizes"]
            param.mul_(1 - lr * wd)
            if sizes is None:
                ortho = self._orthogonalise(update, layout, group)
                param.add_(ortho, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], layout.shape))
            else:
                param.sub_(self._qkv_delta(update, layout, group, lr, sizes))
        return loss

    @staticmethod
    def _orthogonalise(update: Tensor, layout: _Layout, group: dict) -> Tensor:
        """The orthogonalised update (bf16) of this rank's slice of one matrix."""
        mode = group["tp_mode"]
        ns = (group["ns_coefficients"], group["ns_steps"], group["eps"])
        if mode == "blockwise" or layout.dim is None:
            return _newton_schulz(update, *ns)
        if mode == "duplicated":
            return layout.own(_newton_schulz(layout.gather(update), *ns))
        return _newton_schulz(update, *ns, group=layout.group, shard_dim=layout.dim)

    @classmethod
    def _qkv_delta(cls, update: Tensor, layout: _Layout, group: dict, lr: float, sizes) -> Tensor:
        """lr x the orthogonalised update of this rank's slice of a fused QKV weight: Q, K and
        V each orthogonalised and lr-adjusted as a matrix of its own (global) shape."""
        cols = layout.shape[1]
        n_blocks = layout.shape[0] // sum(sizes)

        def scaled(parts, dtype):
            return [o.to(dtype) * _adjust_lr(lr, group["adjust_lr_fn"], (n_blocks * s, cols))
                    for o, s in zip(parts, sizes)]

        if group["tp_mode"] == "duplicated" and layout.dim is not None:
            whole = layout.gather(update)
            outs = [cls._orthogonalise(q, _Layout.whole(q), group)
                    for q in _qkv_views(whole, sizes)]
            return layout.own(_qkv_join(scaled(outs, update.dtype), sizes, whole))
        outs = []
        for q in _qkv_views(update, sizes):
            piece = _Layout.whole(q) if layout.dim is None else layout.with_local(q)
            outs.append(cls._orthogonalise(q, piece, group))
        return _qkv_join(scaled(outs, update.dtype), sizes, update)


# -- Adafactor ----------------------------------------------------------------------------------


class TensorParallelAdafactor(torch.optim.Adafactor):
    """``torch.optim.Adafactor`` with the unsharded math over tensor-parallel shards.

    Same arguments and state (``step``; ``row_var`` / ``col_var`` of the local shard's shape
    with the last / second-last dim 1 for a param of >= 2 dims, ``variance`` for a vector) as
    torch.optim.Adafactor, plus ``tensor_parallel_group`` (the TP group of Megatron-attribute
    params; DTensor params use their mesh's). Reduced over the TP group, as the unsharded
    param's step reads them: the row means of grad**2 when the last dim is split, the column
    means and the mean of the row factor when the second-last dim is split, the param's norm
    (the relative step size) and the update's norm (the clipping threshold ``d``) -- at most
    four all-reduces per sharded param per step, of a row or column vector and of scalars.
    ``foreach`` is ignored (one param at a time, as torch's single-tensor path). Equal to
    torch.optim.Adafactor on the unsharded param to fp32 rounding (the order of the sums
    differs). ``eps[0]`` None means the machine epsilon of the param's dtype, as torch's:
    float32 for tpamp's main params.

    Raises:
        ValueError: as :class:`TensorParallelMuon` for a layout it cannot step; and what
            torch.optim.Adafactor raises.
    """

    tensor_parallel_aware = True

    def __init__(self, params, lr=1e-2, beta2_decay: float = -0.8, eps=(None, 1e-3),
                 d: float = 1.0, weight_decay: float = 0.0, *, foreach=None,
                 maximize: bool = False, tensor_parallel_group=None):
        check_group_hyperparameters(  # the defaults before torch's constructor reads them
            TensorParallelAdafactor, dict(lr=lr, beta2_decay=beta2_decay, eps=eps, d=d,
                                          weight_decay=weight_decay, foreach=foreach,
                                          maximize=maximize), "TensorParallelAdafactor defaults")
        check_group_member(tensor_parallel_group, "tensor_parallel_group")
        self.tensor_parallel_group = tensor_parallel_group  # read by add_param_group
        super().__init__(params, lr=lr, beta2_decay=beta2_decay, eps=eps, d=d,
                         weight_decay=weight_decay, foreach=foreach, maximize=maximize)

    def add_param_group(self, param_group: dict) -> None:
        """torch's, after checking the group as it will be stepped (the defaults filled in,
        before anything changes): the hyperparameters (:mod:`tpamp.hyperparameters`: eps1
        None or > 0, eps2 >= 0, beta2_decay <= 0, d >= 1, a finite lr >= 0, ...) and each
        param's layout. Used by the constructor for every group and for a group added later."""
        gi = len(getattr(self, "param_groups", ()))
        if isinstance(param_group, Mapping):
            check_group_hyperparameters(TensorParallelAdafactor, {**self.defaults, **param_group},
                                        f"TensorParallelAdafactor param group {gi}")
            params = param_group.get("params")
            for pi, p in enumerate(params if isinstance(params, (list, tuple)) else ()):
                if isinstance(p, Tensor):
                    _Layout(p, self.tensor_parallel_group,
                            f"TensorParallelAdafactor param {pi} of group {gi}")
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict) -> None:
        """torch's load, checked first (nothing changes when refused): group and param counts,
        state keys, shapes and finiteness, and the saved groups' hyperparameters by this
        class's rules (:mod:`tpamp.hyperparameters`). A ``torch.optim.Adafactor`` state dict
        loads (same keys)."""
        super().load_state_dict(_checked_state_dict(self, state_dict))

    @torch.no_grad()
    def step(self, closure=None):
        """One Adafactor step of every param with a grad (class docstring); returns closure().
        The groups' hyperparameters are checked first (values set since construction, e.g.
        by a scheduler; a tensor lr on an accelerator is not read); a param of no element is
        left alone."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        todo = []  # everything checked before any param changes
        for gi, group in enumerate(self.param_groups):
            check_group_hyperparameters(TensorParallelAdafactor, group,
                                        f"TensorParallelAdafactor param group {gi}",
                                        read_tensors=False)
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if p.grad.is_sparse or torch.is_complex(p):
                    raise RuntimeError(
                        "Adafactor does not support sparse gradients or complex params")
                layout = _Layout(p, self.tensor_parallel_group,
                                 f"TensorParallelAdafactor param {pi} of group {gi}")
                if _numel(layout.shape):  # no element: nothing to update
                    todo.append((group, p, layout))
        for group, p, layout in todo:
            eps1, eps2 = group["eps"]
            self._step_param(p, layout, group, _scalar(group["lr"]), eps1, eps2)
        return loss

    def _step_param(self, p: Tensor, layout: _Layout, group: dict, lr: float, eps1, eps2):
        param, grad = local_tensor(p), local_tensor(p.grad)
        if group["maximize"]:
            grad = -grad
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            if grad.dim() > 1:
                state["row_var"] = _placed(p, grad.new_zeros(grad.shape[:-1] + (1,)))
                state["col_var"] = _placed(p, grad.new_zeros(grad.shape[:-2] + (1,)
                                                             + grad.shape[-1:]))
            else:
                state["variance"] = torch.zeros_like(p.grad)
        elif grad.dim() > 1:
            for key in ("row_var", "col_var"):
                state[key] = _own_factor(p, layout, state[key], grad, key)
        if eps1 is None:
            eps1 = torch.finfo(param.dtype).eps
        step_t = state["step"]
        step_t += 1
        step = step_t.item()
        one_minus_beta2_t = step ** group["beta2_decay"]
        rho_t = min(lr, 1 / (step ** 0.5))
        sq = layout.all_reduce(param.float().square().sum().to(param.dtype).reshape(1))
        numel = math.prod(layout.shape)
        alpha = max(eps2, sq.sqrt().item() / (numel ** 0.5)) * rho_t
        if group["weight_decay"] != 0:
            param.mul_(1 - lr * group["weight_decay"])
        nd = grad.dim()
        if nd > 1:
            row_var, col_var = local_tensor(state["row_var"]), local_tensor(state["col_var"])
            row_mean = torch.norm(grad, dim=-1, keepdim=True).square_()
            if layout.dim == nd - 1:
                layout.all_reduce(row_mean)
            row_var.lerp_(row_mean.div_(layout.shape[-1]), one_minus_beta2_t)
            col_mean = torch.norm(grad, dim=-2, keepdim=True).square_()
            if layout.dim == nd - 2:
                layout.all_reduce(col_mean)
            col_var.lerp_(col_mean.div_(layout.shape[-2]), one_minus_beta2_t)
            var_estimate = row_var @ col_var
            row_sum = row_var.sum(dim=-2, keepdim=True)
            if layout.dim == nd - 2:
                layout.all_reduce(row_sum)
            var_estimate.div_(row_sum.div_(layout.shape[-2]).clamp_(min=eps1))
        else:
            variance = local_tensor(state["variance"])
            variance.lerp_(grad * grad, one_minus_beta2_t)
            var_estimate = variance.clone()
        update = var_estimate.clamp_(min=eps1 * eps1).rsqrt_()
        update.mul_(grad)
        usq = update.float().square().sum().to(update.dtype).reshape(1)
        if layout.dim is not None:
            layout.all_reduce(usq)
        denom = max(1.0, usq.sqrt().item() / ((numel ** 0.5) * group["d"]))
        param.add_(update, alpha=-alpha / denom)


def _placed(p: Tensor, local: Tensor) -> Tensor:
    """A factored state of this rank's shard: for a DTensor param, a DTensor with the param's
    placements along the dims where it has the shard's size, else replicated (so that a
    checkpoint holds its global shape)."""
    if not is_dtensor(p):
        return local
    from torch.distributed.tensor import DTensor, Replicate

    shard = local_tensor(p)
    placements = [pl if not pl.is_shard() or local.shape[pl.dim] == shard.shape[pl.dim]
                  else Replicate() for pl in p.placements]
    return DTensor.from_local(local, p.device_mesh, placements, run_check=False)


def _own_factor(p: Tensor, layout: _Layout, factor: Tensor, grad: Tensor, key: str) -> Tensor:
    """A factored state loaded whole (a checkpoint gives the global row factor of a row-split
    param): this rank's slice of it; as it is when it already has the local shape."""
    local = local_tensor(factor)
    want = list(grad.shape)
    want[-1 if key == "row_var" else -2] = 1
    if list(local.shape) == want or layout.dim is None:
        return factor
    whole = list(want)
    whole[layout.dim] = layout.shape[layout.dim] if want[layout.dim] != 1 else 1
    if list(local.shape) != whole:
        raise ValueError(f"TensorParallelAdafactor: state {key!r} of shape "
                         f"{tuple(local.shape)}, expected {tuple(want)} (this shard) or "
                         f"{tuple(whole)} (the whole param)")
    return _placed(p, layout.own(local).clone())


# -- one optimizer of several parts (Muon + AdamW) ------------------------------------------


PART_KEY = "optimizer_part"  # the param-group entry naming the CombinedOptimizer part of a group


class CombinedOptimizer(torch.optim.Optimizer):
    """Several torch optimizers over disjoint params, stepped as one ``torch.optim.Optimizer``.

    ``param_groups`` is the parts' groups in order (the same dicts: an lr scheduler or a tpamp
    wrapper that changes a group changes the part's), ``state`` one dict shared by the parts,
    ``step()`` steps each part in order, ``state_dict()`` / ``load_state_dict()`` are torch's over
    all groups (the parts keep pointing at the loaded groups and state). Wrapped once by a tpamp
    wrapper (:class:`tpamp.MixedPrecisionOptimizer`), the parts share one loss scaler, one
    found_inf, one grad norm, one clip and one skip decision (Megatron-core's ChainedOptimizer
    chains whole wrappers instead; here the parts are inner optimizers). Parts with no params
    are left out.

    Each part has a key: the name it is given (``optimizers`` as a dict ``{name: part}``), else
    its class name (``"TensorParallelMuon"``, ``"AdamW"``; a second part of one class
    ``"AdamW#1"``, and so on). Every group of a part holds it as ``group["optimizer_part"]``, so
    ``load_state_dict`` (and every tpamp wrapper's load) matches the saved groups to the parts by
    key, not by position: parts given in another order load as they were saved. Within a part,
    groups with override keys (:func:`tpamp.build_param_groups`) are matched by key, others by
    position. A state dict without part keys (written before they existed, or by another
    optimizer) loads by position, and each saved group is checked against the class of the
    part that will step it. A :class:`CombinedOptimizer` given as a part is replaced by its
    parts (keys ``"name.key"`` when named): the combined optimizer is flat, one state, one
    ``state_dict`` of every part's state. Drive the parts through the combined optimizer only
    (a part's own ``state_dict()`` would see the other parts' state).

    Args:
        optimizers: the parts (torch.optim.Optimizer instances, disjoint params), a list or a
            dict ``{name: part}``.

    Raises:
        TypeError: a part that is not a torch.optim.Optimizer, a name that is not a non-empty
            str; ValueError: no part with params, a param in two parts, two parts with one key,
            a group's hyperparameter refused by :mod:`tpamp.hyperparameters` (torch checked
            only each part's constructor defaults: a group's own eps 0, say).
    """

    def __init__(self, optimizers):
        if isinstance(optimizers, torch.optim.Optimizer):
            raise TypeError("CombinedOptimizer takes a list (or a dict) of optimizers, got one "
                            f"{type(optimizers).__name__}: pass [optimizer]")
        if isinstance(optimizers, Mapping):
            named = list(optimizers.items())
            for name, _ in named:
                if not isinstance(name, str) or not name or "#" in name:
                    raise TypeError(f"CombinedOptimizer part names must be non-empty strs "
                                    f"without '#', got {name!r}")
        elif isinstance(optimizers, (str, bytes)) or not isinstance(optimizers, Iterable):
            raise TypeError("CombinedOptimizer takes a list (or a dict) of torch optimizers, "
                            f"got {type(optimizers).__name__}")
        else:
            named = [(None, opt) for opt in optimizers]
        flat = []
        for i, (name, opt) in enumerate(named):
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"CombinedOptimizer part {name if name else i} must be a "
                                f"torch.optim.Optimizer, got {type(opt).__name__}")
            if isinstance(opt, CombinedOptimizer):  # nested: its parts, one flat state
                flat += [(f"{name}.{k}" if name else k, sub)
                         for k, sub in zip(opt.part_keys, opt.optimizers)]
            elif any(g["params"] for g in opt.param_groups):
                flat.append((name, opt))
        if not flat:
            raise ValueError("CombinedOptimizer needs at least one part with params")
        named_keys = [name for name, _ in flat if name is not None]
        twice = sorted({k for k in named_keys if named_keys.count(k) > 1})
        if twice:
            raise ValueError(f"CombinedOptimizer: two parts have the key(s) {twice}")
        keys, seen = [], {}
        for name, opt in flat:  # an unnamed part: its class name, '#n' for the n-th repeat
            key = name
            while key is None or (name is None and key in named_keys):
                base = type(opt).__name__
                n = seen.get(base, 0)
                seen[base] = n + 1
                key = base if n == 0 else f"{base}#{n}"
            keys.append(key)
        parts = [opt for _, opt in flat]
        owner: Dict[int, int] = {}
        for i, opt in enumerate(parts):
            for g in opt.param_groups:
                for p in g["params"]:
                    j = owner.setdefault(id(p), i)
                    if j != i:
                        raise ValueError(
                            f"CombinedOptimizer: a param of shape {tuple(p.shape)} is in parts "
                            f"{keys[j]!r} and {keys[i]!r}; the parts must hold disjoint params")
        for key, opt in zip(keys, parts):  # torch checked only each constructor's defaults
            for gi, (cls, g) in enumerate(zip(group_optimizer_classes(opt), opt.param_groups)):
                check_group_hyperparameters(cls, g, f"CombinedOptimizer part {key!r} param group {gi}")
        self.optimizers: List[torch.optim.Optimizer] = parts
        self.part_keys: List[str] = keys
        groups = [g for opt in parts for g in opt.param_groups]
        super().__init__(groups, {})  # the same dicts: add_param_group refuses a shared param
        for key, opt in zip(keys, parts):
            for g in opt.param_groups:
                g[PART_KEY] = key
        state = self.state
        for opt in parts:
            state.update(opt.state)
            opt.state = state
        self._sizes = [len(opt.param_groups) for opt in parts]

    @torch.no_grad()
    def step(self, closure=None):
        """Step every part (closure evaluated once, before the parts step). The groups'
        hyperparameters are checked first, each by its part's class
        (:mod:`tpamp.hyperparameters`; a tensor lr on an accelerator is not read)."""
        check_optimizer_hyperparameters(self, read_tensors=False)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers:
            opt.step()
        return loss

    def saved_group_order(self, state_dict, where: str = "the state_dict") -> Optional[List[int]]:
        """For each live param group, the index of the saved group of ``state_dict`` it loads
        from, matched by part key (``group["optimizer_part"]``) and within a part by override
        key (else by position); None when a saved group has no part key (load by position) or
        ``state_dict`` is malformed (the load's checks name it). Raises ValueError naming the
        keys when the saved parts are not this optimizer's parts or a part's groups differ."""
        saved = state_dict.get("param_groups") if isinstance(state_dict, Mapping) else None
        if not isinstance(saved, (list, tuple)) or not all(
                isinstance(g, Mapping) and isinstance(g.get(PART_KEY), str) for g in saved):
            return None
        saved_keys = [g[PART_KEY] for g in saved]
        if set(saved_keys) != set(self.part_keys):
            raise ValueError(
                f"{where}'s optimizer parts {sorted(set(saved_keys))} are not this "
                f"CombinedOptimizer's {sorted(self.part_keys)}: a state dict of other parts")
        perm, at = [], 0
        for key, n in zip(self.part_keys, self._sizes):
            idx = [i for i, k in enumerate(saved_keys) if k == key]
            live = self.param_groups[at:at + n]
            at += n
            if len(idx) != n:
                raise ValueError(f"{where}'s part {key!r} has {len(idx)} param groups, "
                                 f"this CombinedOptimizer's has {n}")
            sub = match_saved_groups([saved[i] for i in idx], live, where)
            perm += [idx[j] for j in (sub if sub is not None else range(n))]
        return perm

    def load_state_dict(self, state_dict) -> None:
        """torch's load over all groups, after the checks of every tpamp load (nothing changes
        when refused): the saved groups matched to the parts by key (:meth:`saved_group_order`),
        group and param counts, each saved group against the class of the part that steps it
        (its hyperparameter keys and values), state keys, shapes and finiteness. Then the parts
        take the loaded groups and state; entries of a live group that the saved one lacks
        (a part key, a TensorParallelMuon's tp_mode) are kept."""
        state_dict = _load.align_inner_state(self, state_dict)
        _load.check_inner_optimizer_state(self, state_dict, "state_dict")
        live_entries = [dict(g) for g in self.param_groups]
        super().load_state_dict(state_dict)
        for g, before in zip(self.param_groups, live_entries):
            for k, v in before.items():
                g.setdefault(k, v)
        at = 0
        for opt, n in zip(self.optimizers, self._sizes):
            opt.param_groups = self.param_groups[at:at + n]
            opt.state = self.state
            at += n

    def add_param_group(self, param_group: dict) -> None:
        """Only while constructing (a new group must belong to one part: add it to that part
        before combining)."""
        if getattr(self, "optimizers", None) is not None and hasattr(self, "_sizes"):
            raise RuntimeError("CombinedOptimizer.add_param_group: add the group to a part "
                               "before combining the parts")
        super().add_param_group(param_group)


# Megatron-core (megatron/core/optimizer/__init__.py, get_megatron_muon_optimizer): Muon for the
# linear weights of the hidden layers; AdamW for embeddings, the output layer and non-2-D params.
_ADAMW_NAMES = ("*embedding*", "*wte*", "*wpe*", "*output_layer*", "*lm_head*", "head*",
                "*.head*")


def split_muon_params(named_params: Iterable[Tuple[str, Tensor]], *,
                      adamw_names: Sequence[str] = _ADAMW_NAMES,
                      is_adamw: Optional[Callable[[str, Tensor], bool]] = None,
                      ) -> Tuple[List[Tensor], List[Tensor]]:
    """Split named params Megatron's way: (Muon params, AdamW params).

    AdamW gets every param that is not 2-D, every param whose name matches a glob of
    ``adamw_names`` (default: embeddings ``*embedding*``, ``*wte*``, ``*wpe*``, the output layer
    ``*output_layer*``, ``*lm_head*``, ``head*``, ``*.head*``), and every param for which ``is_adamw(name,
    param)`` is True; Muon gets the rest (the hidden layers' linear weights). Params without
    requires_grad are left out. Order is kept.

    Raises:
        TypeError: an item that is not a (str, Tensor) pair, ``adamw_names`` that is not a
            tuple or list of strs (a bare str would be read letter by letter), an ``is_adamw``
            that is neither None nor callable.
    """
    if not (isinstance(adamw_names, (tuple, list)) and all(isinstance(g, str) for g in adamw_names)):
        raise TypeError(f"adamw_names must be a tuple or list of glob strs, got {adamw_names!r:.80}"
                        f" ({type(adamw_names).__name__})")
    if is_adamw is not None and not callable(is_adamw):
        raise TypeError(f"is_adamw must be callable or None, got {type(is_adamw).__name__}")
    muon, adamw = [], []
    for item in named_params:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], Tensor)):
            raise TypeError(f"split_muon_params takes (name, param) pairs, got {item!r}")
        name, p = item
        if not p.requires_grad:
            continue
        to_adamw = (p.dim() != 2 or any(fnmatch.fnmatchcase(name, g) for g in adamw_names)
                    or (is_adamw is not None and is_adamw(name, p)))
        (adamw if to_adamw else muon).append(p)
    return muon, adamw


def muon_with_adamw(named_params: Iterable[Tuple[str, Tensor]], *, lr: float,
                    weight_decay: float = 0.1, momentum: float = 0.95, nesterov: bool = True,
                    ns_steps: int = 5, adjust_lr_fn: Optional[str] = None,
                    tp_mode: str = "duplicated", tensor_parallel_group=None,
                    adamw_lr: Optional[float] = None, adamw_betas=(0.9, 0.999),
                    adamw_eps: float = 1e-8, adamw_weight_decay: Optional[float] = None,
                    qkv_split_sizes: Optional[Dict[str, Tuple[int, ...]]] = None,
                    adamw_names: Sequence[str] = _ADAMW_NAMES,
                    ) -> CombinedOptimizer:
    """A :class:`CombinedOptimizer` of :class:`TensorParallelMuon` (the hidden 2-D matrices,
    :func:`split_muon_params`) and ``torch.optim.AdamW`` (the rest), to wrap once in a tpamp
    wrapper. AdamW takes ``adamw_lr`` (default ``lr``) and ``adamw_weight_decay`` (default
    ``weight_decay``) for its params of >= 2 dims (embeddings, output layer) and no weight
    decay for the 1-D ones (biases, norms: Megatron's default), in two param groups. ``qkv_split_sizes``: param name -> Q/K/V row sizes of a fused QKV weight
    (:class:`TensorParallelMuon`); each such weight gets its own Muon param group.

    Raises:
        TypeError: qkv_split_sizes that is not a dict, adamw_betas that is not a pair;
        ValueError: a qkv_split_sizes name that is not a Muon param; what the parts and
            :class:`CombinedOptimizer` raise (every hyperparameter checked by
            :mod:`tpamp.hyperparameters`: a finite lr, momentum in [0, 1), eps > 0, ...).
    """
    named = list(named_params)
    muon_params, adamw_params = split_muon_params(named, adamw_names=adamw_names)
    if qkv_split_sizes is not None and not isinstance(qkv_split_sizes, Mapping):
        raise TypeError("qkv_split_sizes must be a dict {param name: (q, k, v) rows} or None, "
                        f"got {type(qkv_split_sizes).__name__}")
    if not (isinstance(adamw_betas, (tuple, list)) and len(adamw_betas) == 2):
        raise TypeError(f"adamw_betas must be a pair (beta1, beta2), got {adamw_betas!r:.80}")
    wd = weight_decay if adamw_weight_decay is None else adamw_weight_decay
    check_group_hyperparameters(  # before any part is built (torch's own words otherwise)
        torch.optim.AdamW, {"lr": lr if adamw_lr is None else adamw_lr, "betas": adamw_betas,
                            "eps": adamw_eps, "weight_decay": wd}, "muon_with_adamw AdamW options")
    qkv = dict(qkv_split_sizes or {})
    ids = {id(p) for p in muon_params}
    by_name = {n: p for n, p in named}
    for n in qkv:
        if n not in by_name or id(by_name[n]) not in ids:
            raise ValueError(f"qkv_split_sizes names {n!r}, which is not a Muon param "
                             "(a trainable 2-D hidden weight)")
    qkv_ids = {id(by_name[n]): sizes for n, sizes in qkv.items()}
    groups = [{"params": [p for p in muon_params if id(p) not in qkv_ids]}]
    groups += [{"params": [by_name[n]], "qkv_split_sizes": tuple(s)} for n, s in qkv.items()]
    groups = [g for g in groups if g["params"]]
    parts = []
    if groups:
        parts.append(TensorParallelMuon(
            groups, lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn, tp_mode=tp_mode,
            tensor_parallel_group=tensor_parallel_group))
    adamw_groups = [{"params": [p for p in adamw_params if p.dim() >= 2], "weight_decay": wd},
                    {"params": [p for p in adamw_params if p.dim() < 2], "weight_decay": 0.0}]
    adamw_groups = [g for g in adamw_groups if g["params"]]
    if adamw_groups:
        parts.append(torch.optim.AdamW(
            adamw_groups, lr=lr if adamw_lr is None else adamw_lr, betas=tuple(adamw_betas),
            eps=adamw_eps))
    return CombinedOptimizer(parts)
