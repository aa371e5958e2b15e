"""One front door: ``tpamp.initialize(model, optimizer, criterion, fp16=dict(mode=...), parallel=...)``.

Colossal-AI's three amp modes (colossalai/amp: ``convert_to_amp(model, optimizer, criterion,
mode, amp_config)``), model-parallel aware:

* ``mode="parallel"`` (default; Colossal-AI's "naive", also accepted): :class:`tpamp.NaiveAMPModel`
  + :class:`tpamp.MixedPrecisionOptimizer` (fp32 main params, Megatron's dynamic loss scaler with
  hysteresis, found_inf / grad norm / zeros over the model-parallel group). Config:
  :class:`ParallelAMPConfig`.
* ``mode="torch"``: ``torch.autocast`` around forward (and the criterion) and a
  :class:`tpamp.ModelParallelGradScaler` (a torch.amp.GradScaler whose found_inf is all-reduced
  over the model-parallel group). Config: :class:`TorchAMPConfig`.
* ``mode="apex"``: NVIDIA apex's ``amp.initialize`` with ``opt_level`` and its options passed
  through, when apex is installed. Config: :class:`ApexAMPConfig`.

The config is a plain dict (``mode`` key + the mode's keys) or one of the dataclasses. Unknown
keys and bad values raise ValueError naming them, a value of the wrong type (a string or a bool
for a number, a number for a flag) TypeError.

Training loop (modes "parallel" and "torch")::

    model, optimizer, criterion = tpamp.initialize(model, optimizer, criterion,
                                                   fp16=dict(mode="parallel"), parallel=ps)
    loss = criterion(model(x), y)
    optimizer.scale_loss(loss).backward()
    update_successful, grad_norm, num_zeros = optimizer.step()
    optimizer.zero_grad()

(mode "apex": ``optimizer.backward(loss)`` instead of ``scale_loss(loss).backward()``.)
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Optional, Union

import torch
from torch import nn

from tpamp._checks import check_bool, check_f32_scale, check_int, check_real
from tpamp.amp_torch import ModelParallelGradScaler, TorchAMPLoss, TorchAMPModel, TorchAMPOptimizer
from tpamp.grad_scaler import ConstantGradScaler, DynamicGradScaler
from tpamp.model import NaiveAMPModel, parse_dtype
from tpamp.optimizer import FP32Optimizer, MixedPrecisionOptimizer, OptimizerWrapper
from tpamp.parallel import ParallelState

__all__ = [
    "initialize",
    "AMPComponents",
    "ParallelAMPConfig",
    "TorchAMPConfig",
    "ApexAMPConfig",
    "ApexAMPOptimizer",
    "parse_amp_config",
]

DType = Union[str, torch.dtype]


# ---- validation helpers ---------------------------------------------------------------------


def _where(cfg, name: str) -> str:
    return f"fp16 config (mode={cfg.MODE!r}): {name}"


def _real(cfg, name: str, *, low=None, low_inclusive=True, high=None, high_inclusive=False,
          allow_none=False, allow_inf=False, float32=False) -> None:
    # TypeError for a non-number, ValueError for a bad value (tpamp._checks), naming the key
    where = _where(cfg, name)
    value = check_real(where, getattr(cfg, name), low=low, low_inclusive=low_inclusive,
                       high=high, high_inclusive=high_inclusive, allow_inf=allow_inf,
                       allow_none=allow_none)
    if float32 and value is not None:  # a loss scale is stored in float32: 1e39 is inf there
        check_f32_scale(where, value)


def _int(cfg, name: str, low: int) -> None:
    check_int(_where(cfg, name), getattr(cfg, name), low=low)


def _bool(cfg, name: str) -> None:
    check_bool(_where(cfg, name), getattr(cfg, name))


def _dtype(cfg, name: str, allowed=None) -> None:
    value = getattr(cfg, name)
    try:
        dtype, tf32 = parse_dtype(value)
    except ValueError as e:
        raise ValueError(f"fp16 config (mode={cfg.MODE!r}): {name}: {e}") from None
    if allowed is not None and (tf32 or dtype not in allowed):
        raise ValueError(
            f"fp16 config (mode={cfg.MODE!r}): {name} must be one of "
            f"{[str(d) for d in allowed]}, got {value!r}"
        )


# ---- configs --------------------------------------------------------------------------------


@dataclass
class ParallelAMPConfig:
    """mode="parallel": NaiveAMPModel + MixedPrecisionOptimizer with Megatron-LM's defaults.

    dtype: model dtype (torch dtype or string, see :func:`tpamp.parse_dtype`); fp16 (default)
        uses the dynamic loss scaler below; bf16 uses none unless ``loss_scale`` is given
        (Megatron); "torch.float32"/"torch.tf32" use :class:`tpamp.FP32Optimizer`.
    initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis,
    max_scale, consecutive_hysteresis: :class:`tpamp.DynamicGradScaler` (Megatron: 2**32, 1, 2,
        0.5, 1000, 2).
    loss_scale: a constant loss scale (Megatron's --loss-scale) instead of the dynamic one.
    clip_grad: max global grad norm, 0 = off (Megatron's --clip-grad, default 1.0).
    norm_type: p of the grad norm. log_num_zeros_in_grad: count zeros in grads each step.
    output_to_fp32, sync_buffer: :class:`tpamp.NaiveAMPModel`.
    """

    MODE: ClassVar[str] = "parallel"
    dtype: DType = torch.float16
    initial_scale: float = 2.0**32
    min_scale: float = 1.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    max_scale: Optional[float] = None
    consecutive_hysteresis: bool = False
    loss_scale: Optional[float] = None
    clip_grad: float = 1.0
    norm_type: float = 2.0
    log_num_zeros_in_grad: bool = False
    output_to_fp32: bool = True
    sync_buffer: bool = True

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        _dtype(self, "dtype")
        _real(self, "initial_scale", low=0, low_inclusive=False, float32=True)
        _real(self, "min_scale", low=0, low_inclusive=False, float32=True)
        _real(self, "growth_factor", low=1, low_inclusive=False)
        _real(self, "backoff_factor", low=0, low_inclusive=False, high=1)
        _int(self, "growth_interval", 1)
        _int(self, "hysteresis", 1)
        _real(self, "max_scale", low=0, low_inclusive=False, allow_none=True, float32=True)
        _bool(self, "consecutive_hysteresis")
        _real(self, "loss_scale", low=0, low_inclusive=False, allow_none=True, float32=True)
        _real(self, "clip_grad", low=0)
        _real(self, "norm_type", low=1, allow_inf=True)
        _bool(self, "log_num_zeros_in_grad")
        _bool(self, "output_to_fp32")
        _bool(self, "sync_buffer")
        if self.min_scale > self.initial_scale:
            raise ValueError(
                f"fp16 config (mode='parallel'): min_scale {self.min_scale} > initial_scale "
                f"{self.initial_scale}"
            )


@dataclass
class TorchAMPConfig:
    """mode="torch": torch.autocast + :class:`tpamp.ModelParallelGradScaler`.

    dtype: autocast dtype, torch.float16 (default) or torch.bfloat16 (strings accepted).
    init_scale, growth_factor, backoff_factor, growth_interval, enabled: torch.amp.GradScaler's
        arguments and defaults (2**16, 2, 0.5, 2000, True). enabled=False turns off autocast
        and scaling (plain fp32 training through the same interface).
    device_type: autocast/scaler device type; None = the model params' device type.
    clip_grad (0 = off), norm_type, log_num_zeros_in_grad: as in mode "parallel", with the
        norm over the model-parallel group.
    """

    MODE: ClassVar[str] = "torch"
    dtype: DType = torch.float16
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True
    device_type: Optional[str] = None
    clip_grad: float = 0.0
    norm_type: float = 2.0
    log_num_zeros_in_grad: bool = False

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        _dtype(self, "dtype", allowed=(torch.float16, torch.bfloat16))
        _real(self, "init_scale", low=0, low_inclusive=False, float32=True)
        _real(self, "growth_factor", low=1, low_inclusive=False)
        _real(self, "backoff_factor", low=0, low_inclusive=False, high=1)
        _int(self, "growth_interval", 1)
        _bool(self, "enabled")
        if self.device_type is not None and not isinstance(self.device_type, str):
            raise ValueError(
                f"fp16 config (mode='torch'): device_type must be a str such as 'cuda' or "
                f"'cpu', got {self.device_type!r}"
            )
        _real(self, "clip_grad", low=0)
        _real(self, "norm_type", low=1, allow_inf=True)
        _bool(self, "log_num_zeros_in_grad")


_APEX_OPT_LEVELS = ("O0", "O1", "O2", "O3")


@dataclass
class ApexAMPConfig:
    """mode="apex": NVIDIA apex ``amp.initialize(model, optimizer, opt_level=..., **options)``.

    opt_level: "O0".."O3" (default "O1", Colossal-AI's). The other fields are apex's own
    keyword arguments, passed through only when not None (apex's defaults otherwise):
    cast_model_type, patch_torch_functions, keep_batchnorm_fp32, master_weights, loss_scale,
    cast_model_outputs, num_losses, verbosity, min_loss_scale, max_loss_scale.
    """

    MODE: ClassVar[str] = "apex"
    opt_level: str = "O1"
    cast_model_type: Optional[Any] = None
    patch_torch_functions: Optional[bool] = None
    keep_batchnorm_fp32: Optional[Any] = None
    master_weights: Optional[bool] = None
    loss_scale: Optional[Any] = None
    cast_model_outputs: Optional[Any] = None
    num_losses: Optional[int] = None
    verbosity: Optional[int] = None
    min_loss_scale: Optional[float] = None
    max_loss_scale: Optional[float] = None

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        if self.opt_level not in _APEX_OPT_LEVELS:
            raise ValueError(
                f"fp16 config (mode='apex'): opt_level must be one of {_APEX_OPT_LEVELS}, got "
                f"{self.opt_level!r}"
            )
        if self.num_losses is not None:
            _int(self, "num_losses", 1)

    def apex_kwargs(self) -> dict:
        out = {"opt_level": self.opt_level}
        for f in dataclasses.fields(self):
            if f.name != "opt_level" and getattr(self, f.name) is not None:
                out[f.name] = getattr(self, f.name)
        return out


_CONFIGS = {"parallel": ParallelAMPConfig, "torch": TorchAMPConfig, "apex": ApexAMPConfig}
_MODE_ALIASES = {"naive": "parallel"}  # Colossal-AI's AMP_TYPE.NAIVE


def _normalize_mode(mode) -> str:
    raw = mode
    if isinstance(mode, enum.Enum):  # Colossal-AI's AMP_TYPE
        mode = mode.value
    if isinstance(mode, str):
        m = mode.strip().lower()
        m = _MODE_ALIASES.get(m, m)
        if m in _CONFIGS:
            return m
    raise ValueError(
        f"fp16 config: unknown mode {raw!r}; accepted: 'parallel' (default; alias 'naive'), "
        "'torch', 'apex'"
    )


def parse_amp_config(fp16=None):
    """Turn ``fp16`` (None, a dict with an optional ``mode`` key, or a config dataclass) into a
    validated :class:`ParallelAMPConfig` / :class:`TorchAMPConfig` / :class:`ApexAMPConfig`.

    Raises ValueError for an unknown mode, an unknown key (naming it, with the accepted keys
    and the closest match) or a bad value; TypeError for anything else than a dict/dataclass.
    """
    if fp16 is None:
        return ParallelAMPConfig()
    if isinstance(fp16, tuple(_CONFIGS.values())):
        fp16.validate()  # fields may have been changed after construction
        return fp16
    if not isinstance(fp16, Mapping):
        raise TypeError(
            "fp16 must be a dict (e.g. dict(mode='parallel', initial_scale=2**16)), a "
            f"ParallelAMPConfig/TorchAMPConfig/ApexAMPConfig or None; got {type(fp16).__name__}"
        )
    options = dict(fp16)
    for key in options:
        if not isinstance(key, str):
            raise ValueError(f"fp16 config keys must be strings, got {key!r}")
    mode = _normalize_mode(options.pop("mode", "parallel"))
    cls = _CONFIGS[mode]
    accepted = [f.name for f in dataclasses.fields(cls)]
    for key in options:
        if key not in accepted:
            close = difflib.get_close_matches(key, accepted, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"fp16 config (mode={mode!r}): unknown key {key!r}{hint}; accepted keys: "
                f"{['mode'] + accepted}"
            )
    return cls(**options)


# ---- apex ------------------------------------------------------------------------------------


def _import_apex_amp():
    try:
        from apex import amp  # type: ignore[import-not-found]
    except ImportError as e:
        raise ImportError(
            "fp16 mode='apex' needs NVIDIA apex (https://github.com/NVIDIA/apex, built from "
            "source; it is not on PyPI, and the PyPI package named 'apex' is unrelated), and "
            f"NVIDIA apex is not installed ({e}). Modes 'parallel' and 'torch' need nothing extra: "
            "use fp16=dict(mode='parallel') or fp16=dict(mode='torch')."
        ) from e
    return amp


class ApexAMPOptimizer(OptimizerWrapper):
    """An optimizer returned by apex ``amp.initialize`` (Colossal-AI's ApexAMPOptimizer):
    ``backward(loss)`` runs ``with amp.scale_loss(loss, optimizer) as s: s.backward()``; apex
    decides overflow skips inside its patched ``step()``, so ``step()`` returns what that returns
    (tpamp cannot report apex's skips)."""

    def __init__(self, optimizer, amp_module):
        self.optimizer = optimizer
        self._amp = amp_module

    def backward(self, loss: torch.Tensor) -> None:
        with self._amp.scale_loss(loss, self.optimizer) as scaled:
            scaled.backward()

    def scale_loss(self, loss):
        raise NotImplementedError(
            "apex scales the loss inside a context manager: call optimizer.backward(loss)"
        )

    def step(self, *args, **kwargs):
        return self.optimizer.step(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return {"optimizer": self.optimizer.state_dict(), "amp": self._amp.state_dict()}

    def load_state_dict(self, state_dict) -> None:
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self._amp.load_state_dict(state_dict["amp"])


# ---- the front door --------------------------------------------------------------------------


class AMPComponents(NamedTuple):
    """What :func:`initialize` returns; unpacks as ``model, optimizer, criterion``."""

    model: Any
    optimizer: Any
    criterion: Any


def _param_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    criterion=None,
    *,
    fp16=None,
    parallel: Optional[ParallelState] = None,
) -> AMPComponents:
    """Wrap ``model``, ``optimizer`` (built over ``model``'s params) and ``criterion`` for mixed
    precision, following Colossal-AI's ``fp16=dict(mode=...)`` (module docstring).

    Args:
        model: the (model-parallel) module; its params are cast in place in mode "parallel"
            (the optimizer keeps referring to the same Parameter objects).
        optimizer: a ``torch.optim.Optimizer`` over ``model``'s params.
        criterion: optional loss module/function; wrapped in autocast in mode "torch",
            returned as it is otherwise.
        fp16: None (= mode "parallel" with Megatron's defaults), a dict such as
            ``dict(mode="torch", init_scale=2**16)`` or a config dataclass
            (:class:`ParallelAMPConfig`, :class:`TorchAMPConfig`, :class:`ApexAMPConfig`).
        parallel: a :class:`tpamp.parallel.ParallelState`, giving the DP group (buffer sync),
            the model-parallel group (found_inf, grad norm, zeros), the TP group (counting TP
            duplicates once) and whether this is the last pipeline stage (output cast); None
            for a single process (no reduction).

    Returns :class:`AMPComponents` ``(model, optimizer, criterion)``:
        "parallel": (NaiveAMPModel, MixedPrecisionOptimizer or FP32Optimizer for fp32/tf32,
        criterion); "torch": (TorchAMPModel, TorchAMPOptimizer, TorchAMPLoss or None);
        "apex": (apex's model, ApexAMPOptimizer, criterion).

    Raises:
        ValueError: unknown mode/key or bad value in ``fp16``; fp16 params in mode "torch"
            (autocast wants fp32 params).
        TypeError: model/optimizer/parallel of the wrong type.
        ImportError: mode "apex" without NVIDIA apex installed.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if parallel is not None and not isinstance(parallel, ParallelState):
        raise TypeError(
            f"parallel must be a tpamp.parallel.ParallelState or None, got {type(parallel).__name__}"
        )
    cfg = parse_amp_config(fp16)
    if isinstance(cfg, ParallelAMPConfig):
        return _init_parallel(model, optimizer, criterion, cfg, parallel)
    if isinstance(cfg, TorchAMPConfig):
        return _init_torch(model, optimizer, criterion, cfg, parallel)
    return _init_apex(model, optimizer, criterion, cfg)


def _groups(parallel: Optional[ParallelState]):
    if parallel is None:
        return None, None, None, True
    return (
        parallel.dp_group,
        parallel.model_parallel_group,
        parallel.tp_group,
        parallel.is_last_stage,
    )


def _init_parallel(model, optimizer, criterion, cfg: ParallelAMPConfig, parallel):
    dp_group, mp_group, tp_group, last = _groups(parallel)
    dtype, _ = parse_dtype(cfg.dtype)
    amp_model = NaiveAMPModel(
        model,
        output_to_fp32=cfg.output_to_fp32,
        dtype=cfg.dtype,
        sync_buffer=cfg.sync_buffer,
        data_parallel_group=dp_group,
        is_last_stage=last,
    )
    device = _param_device(model)
    if cfg.loss_scale is not None:
        scaler = ConstantGradScaler(cfg.loss_scale, device=device)
    elif dtype == torch.float16:
        scaler = DynamicGradScaler(
            initial_scale=cfg.initial_scale,
            min_scale=cfg.min_scale,
            growth_factor=cfg.growth_factor,
            backoff_factor=cfg.backoff_factor,
            growth_interval=cfg.growth_interval,
            hysteresis=cfg.hysteresis,
            max_scale=cfg.max_scale,
            consecutive_hysteresis=cfg.consecutive_hysteresis,
            device=device,
        )
    else:
        scaler = None  # bf16 / fp32: no loss scaling (Megatron)
    kwargs = dict(
        grad_scaler=scaler,
        clip_grad=cfg.clip_grad,
        norm_type=cfg.norm_type,
        log_num_zeros_in_grad=cfg.log_num_zeros_in_grad,
        grad_stats_group=mp_group,
        tensor_parallel_group=tp_group,
    )
    wrapper = FP32Optimizer if dtype == torch.float32 else MixedPrecisionOptimizer
    return AMPComponents(amp_model, wrapper(optimizer, **kwargs), criterion)


def _init_torch(model, optimizer, criterion, cfg: TorchAMPConfig, parallel):
    for name, p in model.named_parameters():
        if p.dtype == torch.float16:
            raise ValueError(
                f"fp16 mode='torch' expects fp32 params (autocast casts per op, GradScaler "
                f"refuses fp16 grads); param {name!r} is float16. Use mode='parallel' for a "
                "half-precision model."
            )
    _, mp_group, tp_group, _ = _groups(parallel)
    dtype, _ = parse_dtype(cfg.dtype)
    device_type = cfg.device_type or _param_device(model).type
    scaler = ModelParallelGradScaler(
        device_type,
        init_scale=cfg.init_scale,
        growth_factor=cfg.growth_factor,
        backoff_factor=cfg.backoff_factor,
        growth_interval=cfg.growth_interval,
        enabled=cfg.enabled,
        model_parallel_group=mp_group,
    )
    amp_model = TorchAMPModel(model, device_type, dtype, enabled=cfg.enabled)
    amp_criterion = (
        TorchAMPLoss(criterion, device_type, dtype, enabled=cfg.enabled)
        if criterion is not None
        else None
    )
    amp_optimizer = TorchAMPOptimizer(
        optimizer,
        scaler,
        clip_grad=cfg.clip_grad,
        norm_type=cfg.norm_type,
        log_num_zeros_in_grad=cfg.log_num_zeros_in_grad,
        grad_stats_group=mp_group,
        tensor_parallel_group=tp_group,
    )
    return AMPComponents(amp_model, amp_optimizer, amp_criterion)


def _init_apex(model, optimizer, criterion, cfg: ApexAMPConfig):
    amp = _import_apex_amp()
    model, optimizer = amp.initialize(model, optimizer, **cfg.apex_kwargs())
    return AMPComponents(model, ApexAMPOptimizer(optimizer, amp), criterion)
