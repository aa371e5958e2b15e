"""torch.amp (autocast + GradScaler) made safe for model parallelism.

Under tensor or pipeline parallelism each rank holds different gradients. A plain
``torch.amp.GradScaler`` checks only its own rank's grads, so when one TP rank overflows it
skips its step while its peers step: the shards of one weight matrix diverge, and so do the loss
scales. :class:`ModelParallelGradScaler` all-reduces ``found_inf`` over the model-parallel group
before the skip decision, so every rank skips the same steps and keeps the same scale.

Usage (what ``tpamp.initialize(..., fp16=dict(mode="torch"))`` builds)::

    scaler = ModelParallelGradScaler("cuda", model_parallel_group=ps.model_parallel_group)
    with torch.autocast("cuda", dtype=torch.float16):
        loss = criterion(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)       # skipped on every rank if any rank overflowed
    scaler.update()
"""

from __future__ import annotations

import copy
import os
import uuid
import weakref
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
from torch import nn

from tpamp import _validation
from tpamp._validation import check_norm_type as _check_norm_type
from tpamp.grad_stats import (
    clip_grad_by_total_norm_fp32,
    count_zeros_fp32,
    filter_grads_for_norm,
    get_grad_norm_fp32,
)
from tpamp.optimizer import OptimizerWrapper, StepResult
from tpamp.parallel import resolve_tensor_parallel_group

__all__ = ["ModelParallelGradScaler", "TorchAMPModel", "TorchAMPLoss", "TorchAMPOptimizer"]

# The groups of the scalers this process has pickled, by the token in the pickled state: an
# unpickle in this process finds its own group again (weak: a collected group is gone).
_PICKLED_GROUPS: "weakref.WeakValueDictionary[str, dist.ProcessGroup]" = (
    weakref.WeakValueDictionary()
)


def _live_member_group(group) -> bool:
    # still a registered group of the current world, with this rank a member
    try:
        return dist.is_initialized() and dist.get_rank(group) >= 0
    except (ValueError, RuntimeError, KeyError):  # destroyed / not registered any more
        return False


class ModelParallelGradScaler(torch.amp.GradScaler):
    """A ``torch.amp.GradScaler`` whose inf/nan check is agreed over the model-parallel group.

    Same algorithm, arguments and defaults as ``torch.amp.GradScaler`` (``init_scale=2**16``,
    ``growth_factor=2``, ``backoff_factor=0.5``, ``growth_interval=2000``, ``enabled``): the
    scale is multiplied by ``backoff_factor`` after a step with an inf/nan gradient (which is
    skipped) and by ``growth_factor`` after ``growth_interval`` clean steps in a row. Gradient
    accumulation, ``unscale_`` before clipping, sparse grads, several optimizers, optimizers
    that unscale themselves (``fused=True``), ``state_dict`` and pickling work as in torch.amp.

    The one difference in arithmetic: when this rank's grads have been checked (in
    ``unscale_``, or in ``step`` for optimizers that unscale themselves), the per-device
    ``found_inf`` flags (``optimizer_state["found_inf_per_device"]``) are summed into one
    float32 flag on the device of the ``found_inf`` tensor torch passes in (the scale's device;
    the flag has that tensor's shape: () from torch, any one-element shape such as (1,) from a
    direct ``_unscale_grads_`` call) and all-reduced with MAX over ``model_parallel_group``;
    that flag replaces the per-device ones, so ``step`` (skip or not) and ``update`` (back off
    or grow) decide identically on every rank. Every rank of the group must call
    ``unscale_``/``step`` for each optimizer, also a rank whose optimizer holds no grads (it
    contributes 0).

    Copies and pickling. ``copy.deepcopy`` gives a scaler with the same numbers (scale, growth
    tracker, factors, interval, enabled, device) that shares this scaler's group (a
    ProcessGroup is a live connection: it is never copied). ``pickle`` (and ``torch.save``)
    cannot carry a group: the pickled scaler keeps every number but not the group, and a scaler
    that had one comes back *detached*: its ``unscale_``, ``step`` and ``update`` raise
    RuntimeError until :meth:`set_model_parallel_group` attaches a group again (on every rank),
    so it never silently stops agreeing with its peers. ``scale``, ``state_dict``,
    ``load_state_dict`` and the getters work while detached. Loaded in the process that pickled
    it (same pid, a per-pairing token found in a module registry of weak references), it gets
    the very same group back, not detached, if that group is still registered with this rank in
    it (another process, a destroyed group, a forged token: detached). (A disabled scaler checks
    nothing: it comes back without the group and not detached.) A scaler created without a group
    pickles and unpickles exactly as ``torch.amp.GradScaler``. As in torch, pickling and deep
    copy are allowed only between iterations (before the first ``unscale_``/``step`` or after
    ``update``); in the middle of one they raise torch's AssertionError.

    Args:
        device: device type of the grads and the scale, e.g. "cuda" or "cpu".
        model_parallel_group: the TP x PP group (``ParallelState.model_parallel_group``);
            None means no reduction (then it behaves exactly like torch.amp.GradScaler).

    Raises TypeError (naming the argument) for a non-number init_scale, growth_factor or
    backoff_factor, a non-int growth_interval, a non-bool enabled, a device that is not a str,
    or a group that is not a ProcessGroup; ValueError unless init_scale is finite and > 0 in
    float32, growth_factor > 1, 0 < backoff_factor < 1, growth_interval in [1, 2**31 - 1], and
    for a model_parallel_group this rank is not a member of. ``load_state_dict`` checks what
    it loads by the same rules (:meth:`check_state_dict`) before any number changes. On a
    detached scaler
    (unpickled, see above) ``unscale_``, ``step`` and ``update`` raise RuntimeError naming
    :meth:`set_model_parallel_group`.
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        model_parallel_group: Optional[dist.ProcessGroup] = None,
    ):
        if not isinstance(device, str):
            raise TypeError(f"device must be a device type string such as 'cuda' or 'cpu', got "
                            f"{device!r} ({type(device).__name__})")
        _validation.check_f32_scale("init_scale", init_scale)
        _validation.check_real("growth_factor", growth_factor, low=1.0, low_inclusive=False)
        _validation.check_real("backoff_factor", backoff_factor, low=0.0, low_inclusive=False,
                               high=1.0, high_inclusive=False)
        _validation.check_int("growth_interval", growth_interval, low=1, high=2**31 - 1)
        _validation.check_bool("enabled", enabled)
        _validation.check_group_member(model_parallel_group, "model_parallel_group")
        super().__init__(
            device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        self._model_parallel_group = model_parallel_group
        self._group_detached = False
        self._group_token: Optional[str] = None  # set when pickled with a group
        self._last_found_inf: Dict[int, torch.Tensor] = {}  # found_inf() after update()

    # ---- the group -------------------------------------------------------------------------

    @property
    def model_parallel_group(self) -> Optional[dist.ProcessGroup]:
        """The group ``found_inf`` is all-reduced over (None: no reduction). Assigning to it
        is :meth:`set_model_parallel_group`."""
        return self._model_parallel_group

    @model_parallel_group.setter
    def model_parallel_group(self, group: Optional[dist.ProcessGroup]) -> None:
        self.set_model_parallel_group(group)

    def set_model_parallel_group(self, group: Optional[dist.ProcessGroup]) -> None:
        """Attach ``group`` (a ProcessGroup this rank is a member of, or None for no
        reduction), e.g. after unpickling a scaler that had one. Call it on every rank of the
        group, between iterations. Raises TypeError for a non-group, ValueError when this rank
        is not a member."""
        _validation.check_group_member(group, "model_parallel_group")
        self._model_parallel_group = group
        self._group_detached = False
        self._group_token = None  # a new scaler-group pairing

    def is_detached(self) -> bool:
        """True for a scaler unpickled without the group it had (see the class docstring):
        ``unscale_``/``step``/``update`` raise until :meth:`set_model_parallel_group`."""
        return self._group_detached

    def _require_group(self, what: str) -> None:
        if self._group_detached:
            raise RuntimeError(
                f"ModelParallelGradScaler.{what}: this scaler was unpickled without its "
                "model_parallel_group (a ProcessGroup cannot be pickled), so it cannot agree "
                "found_inf with its peers; call scaler.set_model_parallel_group(group) on every "
                "rank first (set_model_parallel_group(None) to run without a group)"
            )

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self._require_group("unscale_")
        return super().unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any):
        self._require_group("step")
        return super().step(optimizer, *args, **kwargs)

    def scale(self, outputs):
        self._last_found_inf = {}  # a new iteration: the previous one's found_inf is over
        return super().scale(outputs)

    def update(self, new_scale=None) -> None:
        self._require_group("update")
        # torch's update() forgets this iteration's per-optimizer flags; found_inf() keeps
        # answering for it until the next scale() / unscale_() / step()
        last = {key: self._summed_flag(state["found_inf_per_device"])
                for key, state in self._optimizer_states().items()
                if state["found_inf_per_device"]} if self._enabled else {}
        super().update(new_scale)
        self._last_found_inf = last

    # ---- copies ----------------------------------------------------------------------------

    def __getstate__(self) -> Dict[str, Any]:
        # torch's: refuses mid-iteration, keeps scale and growth tracker as numbers
        state = super().__getstate__()
        state.pop("_last_found_inf", None)  # the last iteration's flags: not state to carry
        group = state.get("_model_parallel_group")
        state["_group_token"] = None
        if group is not None:
            state["_model_parallel_group"] = None
            # a disabled scaler checks nothing, so it has nothing to agree on
            state["_group_detached"] = bool(state.get("_enabled", True))
            if state["_group_detached"]:
                if getattr(self, "_group_token", None) is None:
                    self._group_token = uuid.uuid4().hex
                _PICKLED_GROUPS[self._group_token] = group
                state["_group_token"] = self._group_token
                state["_group_pid"] = os.getpid()
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        state = dict(state)
        state.pop("_last_found_inf", None)
        # a state pickled before the group became a property held it as model_parallel_group
        state.setdefault("_model_parallel_group", state.pop("model_parallel_group", None))
        state.setdefault("_group_detached", False)
        token, pid = state.pop("_group_token", None), state.pop("_group_pid", None)
        state["_group_token"] = None
        if state["_group_detached"] and state["_model_parallel_group"] is None:
            # same process only: the token names the very group this scaler was pickled with
            group = _PICKLED_GROUPS.get(token) if isinstance(token, str) else None
            if pid == os.getpid() and group is not None and _live_member_group(group):
                state.update(_model_parallel_group=group, _group_detached=False,
                             _group_token=token)
        super().__setstate__(state)
        self._last_found_inf = {}

    def __deepcopy__(self, memo: Dict[int, Any]) -> "ModelParallelGradScaler":
        group = self._model_parallel_group
        state = super().__getstate__()  # torch's pickled state, the group still in it
        state.pop("_last_found_inf", None)
        if group is not None:
            memo[id(group)] = group  # shared, never copied
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(state, memo))
        return new

    # ---- state dicts ------------------------------------------------------------------------

    def check_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Check a state dict :meth:`load_state_dict` would load, changing nothing: a dict with
        torch.amp.GradScaler's keys (``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker``) whose values pass this class's constructor
        checks (scale finite and > 0 in float32, growth_factor > 1, backoff_factor in (0, 1),
        growth_interval in [1, 2**31 - 1]) and a growth tracker in [0, growth_interval - 1].
        An empty dict (a disabled scaler's) is left to torch's RuntimeError; a disabled scaler
        loads nothing and checks only that it is a dict. Raises TypeError / KeyError /
        ValueError naming the key and the value."""
        _validation.check_mapping("state_dict", state_dict)
        if self.is_enabled() and len(state_dict):
            _check_torch_scaler_state(state_dict, "state_dict")

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """torch.amp.GradScaler's load after :meth:`check_state_dict` (all or nothing: a
        refused state dict changes no number of this scaler)."""
        self.check_state_dict(state_dict)
        super().load_state_dict(state_dict)

    # ---- the agreed found_inf ----------------------------------------------------------------

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        # torch.amp calls this from unscale_ and from _check_inf_per_device (optimizers with
        # _step_supports_amp_scaling); both feed step()'s skip decision and update().
        self._require_group("unscale_")  # before any grad is touched
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        if self._model_parallel_group is None:
            return per_device
        # found_inf's own shape: () from torch, (1,) or any one-element shape from a caller
        combined = torch.zeros(found_inf.shape, dtype=torch.float32, device=found_inf.device)
        for flag in per_device.values():
            combined += flag.to(combined.device).reshape(combined.shape)
        try:
            dist.all_reduce(combined, op=dist.ReduceOp.MAX, group=self._model_parallel_group)
        except RuntimeError as e:  # a peer that never joins: gloo's timeout or closed connection
            ranks = dist.get_process_group_ranks(self._model_parallel_group)
            raise RuntimeError(
                f"ModelParallelGradScaler: the found_inf all-reduce over model_parallel_group "
                f"(ranks {ranks}) failed: {e}. Every rank of that group must give its scaler "
                "the same model_parallel_group and call unscale_/step together: a rank whose "
                "scaler has model_parallel_group=None (or another group), or that crashed, "
                "never joins. The scale and the params are unchanged (the grads are already "
                "unscaled: end the job, the process groups cannot be trusted)") from e
        return {combined.device: combined}

    def found_inf(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """This iteration's found_inf for ``optimizer``: a 0-dim float32 tensor on the scale's
        device, > 0 when any rank of the group had an inf/NaN grad (the step is then skipped),
        0 otherwise.

        Known from ``unscale_(optimizer)`` or ``step(optimizer)`` on, and still after
        ``update()`` (which clears torch's per-iteration state), until the next iteration's
        ``scale()``. A disabled scaler (``enabled=False``, or "cuda" without CUDA, as in
        torch.amp) checks nothing and never skips: 0.0 on the CPU, as its ``get_scale()`` is 1.0.
        Raises RuntimeError naming ``unscale_``/``step`` when this iteration has not checked
        ``optimizer``'s grads yet (none of the above)."""
        if not self._enabled:
            return torch.zeros((), dtype=torch.float32)
        state = self._optimizer_states().get(id(optimizer))  # .get: never adds an entry
        if state is not None and state["found_inf_per_device"]:
            return self._summed_flag(state["found_inf_per_device"])
        last = self._last_found_inf.get(id(optimizer))
        if last is not None:
            return last
        raise RuntimeError(
            "ModelParallelGradScaler.found_inf: this iteration has not checked this optimizer's "
            "grads yet; call it after scaler.unscale_(optimizer) or scaler.step(optimizer) (it "
            "stays known after update(), until the next scale())")

    def _optimizer_states(self) -> Dict[int, Dict[str, Any]]:
        return self._per_optimizer_states  # torch's, per id(optimizer), reset by update()

    def _summed_flag(self, per_device) -> torch.Tensor:
        flags = [f.to(self._scale.device).reshape(()) for f in per_device.values()]
        return torch.stack(flags).sum()


class _AutocastCall(nn.Module):
    """Calls the wrapped callable, held in attribute ``_target``, under
    ``torch.autocast(device_type, dtype, enabled)``."""

    _target: str

    def __init__(self, device_type: str, dtype: torch.dtype, enabled: bool):
        super().__init__()
        self.device_type = device_type
        self.dtype = dtype
        self.enabled = enabled

    def forward(self, *args, **kwargs):
        with torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled):
            return getattr(self, self._target)(*args, **kwargs)


class TorchAMPModel(_AutocastCall):
    """Runs ``model``'s forward under ``torch.autocast(device_type, dtype)`` (Colossal-AI's
    TorchAMPModel). Params stay fp32; outputs are in whatever dtype autocast produced."""

    _target = "model"

    def __init__(self, model: nn.Module, device_type: str, dtype: torch.dtype = torch.float16,
                 enabled: bool = True):
        super().__init__(device_type, dtype, enabled)
        self.model = model


class TorchAMPLoss(_AutocastCall):
    """Calls ``criterion`` under autocast (Colossal-AI's TorchAMPLoss); autocast runs losses such
    as cross_entropy in fp32."""

    _target = "criterion"

    def __init__(self, criterion, device_type: str, dtype: torch.dtype = torch.float16,
                 enabled: bool = True):
        super().__init__(device_type, dtype, enabled)
        self.criterion = criterion


class TorchAMPOptimizer(OptimizerWrapper):
    """A torch optimizer driven by a :class:`ModelParallelGradScaler`, with the interface of
    :class:`tpamp.MixedPrecisionOptimizer` (``scale_loss``, ``step() -> StepResult``,
    ``zero_grad``, ``get_loss_scale``, ``state_dict``), so loops work the same in each mode.

    ``step()``: ``scaler.unscale_`` (grads of every rank checked, found_inf all-reduced over
    the model-parallel group); if no rank overflowed, the grad norm over ``grad_stats_group``
    (TP duplicates counted once, as :func:`tpamp.get_grad_norm_fp32`), clipping when
    ``clip_grad > 0`` and the zero count when ``log_num_zeros_in_grad``; then ``scaler.step``
    and ``scaler.update``. Returns ``StepResult(update_successful, grad_norm, num_zeros)``
    ((False, None, None) for a skipped step). Gradient accumulation: call ``backward`` (or
    ``scale_loss(loss).backward()``) for each micro-batch, then ``step()`` once.

    Params that carry Megatron's ``tensor_model_parallel=True`` with no tensor_parallel_group
    take the TP and model-parallel groups of the initialized parallel state (docs/spec.md
    section 22), as the other wrappers do.

    Raises TypeError for an optimizer that is not a ``torch.optim.Optimizer`` or a scaler that
    is not a ``torch.amp.GradScaler``; ValueError for a clip_grad that is not a finite number
    >= 0, a norm_type below 1 or nan, a group this rank is not a member of, TP params with no
    TP group and no parallel state, or a TP group of more than one rank with an enabled scaler
    that reduces found_inf over no group (each TP rank would skip on its own). ``step()``
    raises RuntimeError when called again without a new backward, and (first step) ValueError
    on every rank when the ranks of the grad-stats group disagree on these settings.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        scaler: ModelParallelGradScaler,
        *,
        clip_grad: float = 0.0,
        norm_type: float = 2.0,
        log_num_zeros_in_grad: bool = False,
        grad_stats_group=None,
        tensor_parallel_group=None,
    ):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(
                "scaler must be a tpamp.ModelParallelGradScaler (or torch.amp.GradScaler), got "
                f"{type(scaler).__name__}"
            )
        _validation.check_real("clip_grad", clip_grad, low=0.0)
        _check_norm_type(norm_type)
        _validation.check_group_member(grad_stats_group, "grad_stats_group")
        _validation.check_group_member(tensor_parallel_group, "tensor_parallel_group")
        tensor_parallel_group, grad_stats_group = resolve_tensor_parallel_group(
            [p for g in optimizer.param_groups for p in g["params"]], tensor_parallel_group,
            grad_stats_group, owner="TorchAMPOptimizer")
        if (tensor_parallel_group is not None and dist.get_world_size(tensor_parallel_group) > 1
                and scaler.is_enabled() and getattr(scaler, "model_parallel_group", None) is None):
            raise ValueError(
                "TorchAMPOptimizer: the params are split over a tensor-parallel group of "
                f"{dist.get_world_size(tensor_parallel_group)} ranks but the scaler reduces "
                "found_inf over no group, so each TP rank would take its own skip decision: "
                "build the scaler as tpamp.ModelParallelGradScaler(..., model_parallel_group="
                "<the TP x PP group, as grad_stats_group>)")
        self.optimizer = optimizer
        self.scaler = scaler
        self.clip_grad = float(clip_grad)
        self.norm_type = float(norm_type)
        self.log_num_zeros_in_grad = bool(log_num_zeros_in_grad)
        self.grad_stats_group = grad_stats_group
        self.tensor_parallel_group = tensor_parallel_group

    def _params(self):
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def get_loss_scale(self) -> torch.Tensor:
        """The loss scale as a float32 tensor of shape [1] (1.0 when disabled)."""
        scale = self.scaler._get_scale_async() if self.scaler.is_enabled() else None
        if scale is None:
            return torch.tensor([self.scaler.get_scale()], dtype=torch.float32)
        return scale.reshape(1)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """loss * scale (TypeError unless loss is a floating-point tensor)."""
        _validation.check_loss(loss)
        return self.scaler.scale(loss)

    def backward(self, loss: torch.Tensor) -> None:
        self.scale_loss(loss).backward()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @_validation.guard_step
    def step(self) -> StepResult:
        if not self.scaler.is_enabled():
            found = False
        else:
            self.scaler.unscale_(self.optimizer)
            found = bool(self.scaler.found_inf(self.optimizer).item() > 0)
        grad_norm = num_zeros = None
        if not found:
            params = self._params()
            grads = filter_grads_for_norm(params, self.tensor_parallel_group)
            total = get_grad_norm_fp32(grads, self.norm_type, self.grad_stats_group)
            if self.clip_grad > 0:
                clip_grad_by_total_norm_fp32(params, self.clip_grad, total)
            if self.log_num_zeros_in_grad:
                num_zeros = int(
                    count_zeros_fp32(params, self.grad_stats_group, self.tensor_parallel_group)
                )
            grad_norm = float(total)
        self.scaler.step(self.optimizer)  # skips by itself on the same (all-reduced) flag
        self.scaler.update()
        if found:
            return StepResult(False, None, None)
        return StepResult(True, grad_norm, num_zeros)

    def state_dict(self) -> Dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "grad_scaler": self.scaler.state_dict()}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore {'optimizer': inner state, 'grad_scaler': scaler state}; all or nothing:
        both are checked (TypeError/KeyError/ValueError naming the key) before either loads.
        Param groups with override keys are matched by key and their params by name
        (``tpamp._load.align_inner_state``, docs/spec.md section 16)."""
        _validation.check_mapping("state_dict", state_dict)
        if "optimizer" not in state_dict:
            raise KeyError("optimizer state_dict has no 'optimizer' entry")
        # param groups with override keys by key, not by position (docs/spec.md section 16)
        inner = _validation.align_inner_state(self.optimizer, state_dict["optimizer"])
        _validation.check_inner_optimizer_state(self.optimizer, inner)
        scaler_state = state_dict.get("grad_scaler")
        if scaler_state:
            _check_torch_scaler_state(scaler_state)
        elif scaler_state is not None:
            _validation.check_mapping("state_dict['grad_scaler']", scaler_state)
        _validation.load_inner_state(self.optimizer, inner)
        if scaler_state:
            self.scaler.load_state_dict(scaler_state)


def _check_torch_scaler_state(state: Dict[str, Any], where: str = "state_dict['grad_scaler']") -> None:
    """A torch.amp.GradScaler state dict: the keys it writes, with values its constructor
    (ModelParallelGradScaler's checks) accepts and a growth tracker below the interval."""
    _validation.check_mapping(where, state)
    keys = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
    missing = keys - set(state)
    if missing:
        raise KeyError(f"{where} is missing {sorted(missing)} (not a torch.amp.GradScaler state)")
    _validation.check_f32_scale(f"{where}['scale']", state["scale"])
    _validation.check_real(f"{where}['growth_factor']", state["growth_factor"], low=1.0,
                           low_inclusive=False)
    _validation.check_real(f"{where}['backoff_factor']", state["backoff_factor"], low=0.0,
                           low_inclusive=False, high=1.0, high_inclusive=False)
    interval = _validation.check_int(f"{where}['growth_interval']", state["growth_interval"], low=1,
                                     high=2**31 - 1)
    _validation.check_int(f"{where}['_growth_tracker']", state["_growth_tracker"], low=0,
                          high=interval - 1)
