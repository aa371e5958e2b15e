"""Model side of mixed precision: a half-precision model wrapper with fp32 islands.

Semantics follow InternEvo's ``NaiveAMPModel`` / ``set_fp32_attr_to_module``
(internlm/core/naive_amp.py, itself from Colossal-AI's naive amp), with these differences:

* fp32 islands are never round-tripped through the half dtype: InternEvo casts the whole model
  and casts islands back (losing their low mantissa bits); tpamp leaves them alone.
* every floating input is cast to the model dtype (InternEvo casts fp32 only), and inputs nested
  in lists, tuples and dicts are cast too.
* buffer averaging skips integer buffers (e.g. BatchNorm's ``num_batches_tracked``).
* under pipeline parallelism only the last stage casts outputs to fp32 (``is_last_stage``).
* the dtype may be ``"torch.tf32"``: fp32 params with TF32 matmuls/convolutions, whose global
  flags are restored by :meth:`NaiveAMPModel.release` (or leaving its ``with`` block).

Usage::

    model = tpamp.NaiveAMPModel(model, dtype="torch.bfloat16", data_parallel_group=ps.dp_group,
                                is_last_stage=ps.is_last_stage)
    loss = criterion(model(tokens), labels)    # outputs are fp32 on the last stage
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = [
    "NaiveAMPModel",
    "set_fp32_attr_to_module",
    "module_has_fp32_attr",
    "parse_dtype",
    "TF32Flags",
    "tf32_enabled",
]

_FP32_ATTR = "is_fp32_module"  # InternEvo's attribute name, so modules marked there work here
_HALF_DTYPES = (torch.float16, torch.bfloat16)

# name -> (param dtype, tf32)
_DTYPE_NAMES = {
    "torch.float16": (torch.float16, False),
    "torch.half": (torch.float16, False),
    "float16": (torch.float16, False),
    "half": (torch.float16, False),
    "fp16": (torch.float16, False),
    "torch.bfloat16": (torch.bfloat16, False),
    "bfloat16": (torch.bfloat16, False),
    "bf16": (torch.bfloat16, False),
    "torch.float32": (torch.float32, False),
    "torch.float": (torch.float32, False),
    "float32": (torch.float32, False),
    "float": (torch.float32, False),
    "fp32": (torch.float32, False),
    "torch.tf32": (torch.float32, True),
    "tf32": (torch.float32, True),
}


def parse_dtype(dtype: Union[str, torch.dtype]) -> Tuple[torch.dtype, bool]:
    """Resolve a model dtype given as a torch dtype or a string.

    Returns ``(param_dtype, tf32)``: ``"torch.tf32"``/``"tf32"`` gives ``(torch.float32, True)``,
    meaning fp32 params with TF32 matmuls. Accepted strings: "torch.float16", "torch.half",
    "torch.bfloat16", "torch.float32", "torch.float", "torch.tf32" (InternEvo's spellings) and
    the aliases "fp16", "half", "float16", "bf16", "bfloat16", "fp32", "float", "float32",
    "tf32". Accepted dtypes: torch.float16, torch.bfloat16, torch.float32.

    Raises ValueError naming the value and the accepted ones.
    """
    if isinstance(dtype, torch.dtype):
        if dtype in (torch.float16, torch.bfloat16, torch.float32):
            return dtype, False
        raise ValueError(
            f"unsupported model dtype {dtype}; accepted: torch.float16, torch.bfloat16, "
            f"torch.float32 or one of the strings {sorted(_DTYPE_NAMES)}"
        )
    if isinstance(dtype, str) and dtype.strip().lower() in _DTYPE_NAMES:
        return _DTYPE_NAMES[dtype.strip().lower()]
    raise ValueError(
        f"unknown model dtype {dtype!r}; accepted: {sorted(_DTYPE_NAMES)} "
        "or torch.float16 / torch.bfloat16 / torch.float32"
    )


class TF32Flags:
    """Turns TF32 on for cuBLAS matmuls and cuDNN (``torch.backends.cuda.matmul.allow_tf32``,
    ``torch.backends.cudnn.allow_tf32``) and puts the previous values back on :meth:`restore`.

    Usable as a context manager. The flags are process-global: nested users must restore in
    reverse order (a ``with`` statement does). ``enable()`` twice without ``restore()`` keeps
    the first saved values. On CPU the flags change nothing numerically but are still set.
    """

    def __init__(self):
        self._saved: Optional[Tuple[bool, bool]] = None

    @property
    def active(self) -> bool:
        return self._saved is not None

    def enable(self) -> "TF32Flags":
        if self._saved is None:
            self._saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        return self

    def restore(self) -> None:
        if self._saved is None:
            return
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self._saved
        self._saved = None

    def __enter__(self) -> "TF32Flags":
        return self.enable()

    def __exit__(self, *exc) -> None:
        self.restore()


def tf32_enabled() -> TF32Flags:
    """Context manager: TF32 matmuls and convolutions inside, the previous flags after."""
    return TF32Flags()


def set_fp32_attr_to_module(module: nn.Module) -> nn.Module:
    """Mark ``module`` to stay fp32 inside a half-precision :class:`NaiveAMPModel` (an "fp32 island").

    Its params and buffers (and those of its submodules) are not cast by NaiveAMPModel; the
    wrapper adds hooks so that its floating inputs (args and kwargs, nested) are cast to fp32 and
    its floating outputs back to the model dtype. :class:`tpamp.MixedPrecisionOptimizer` treats
    its params as fp32 params (no master copy; they still count in found_inf, the grad norm and
    the zero count). Same attribute as InternEvo (``is_fp32_module``). Mark before wrapping.
    Returns the module.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"set_fp32_attr_to_module expects an nn.Module, got {type(module).__name__}")
    setattr(module, _FP32_ATTR, True)
    return module


def module_has_fp32_attr(module: nn.Module) -> bool:
    """True if ``module`` was marked by :func:`set_fp32_attr_to_module`."""
    return bool(getattr(module, _FP32_ATTR, False))


def _cast_floating(obj: Any, dtype: torch.dtype, from_dtypes: Optional[tuple] = None) -> Any:
    """Cast floating tensors in ``obj`` (a tensor or lists/tuples/namedtuples/dicts of them) to
    ``dtype``; with ``from_dtypes`` only tensors of those dtypes. Other objects (integer and
    bool tensors included) are returned as they are. Casts are differentiable."""
    if isinstance(obj, torch.Tensor):
        if (
            obj.is_floating_point()
            and obj.dtype != dtype
            and (from_dtypes is None or obj.dtype in from_dtypes)
        ):
            return obj.to(dtype)
        return obj
    if isinstance(obj, dict):
        items = [(k, _cast_floating(v, dtype, from_dtypes)) for k, v in obj.items()]
        out = copy.copy(obj)  # keeps the mapping type (OrderedDict, defaultdict's factory)
        out.clear()
        out.update(items)
        return out
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_cast_floating(v, dtype, from_dtypes) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_floating(v, dtype, from_dtypes) for v in obj)
    return obj


def _cast_module_tensors_(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast ``module``'s own (non-recursive) floating params and buffers to ``dtype`` in place,
    keeping the Parameter objects (so optimizers and Megatron attributes still see them)."""

    def fn(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() else t

    module._apply(fn, recurse=False)


class NaiveAMPModel(nn.Module):
    """Run ``model`` in half precision (or fp32/TF32) with fp32 at its boundary.

    Args:
        model: the module to wrap. Its floating params and buffers are cast to ``dtype`` in
            place (same Parameter objects), except those inside modules marked with
            :func:`set_fp32_attr_to_module`, which stay (or are made) fp32.
        output_to_fp32: cast fp16/bf16 outputs (tensors, nested in lists/tuples/dicts) to fp32.
        dtype: torch.float16 (default), torch.bfloat16, torch.float32, or a string accepted by
            :func:`parse_dtype` ("torch.bfloat16", "bf16", "torch.tf32", ...). "torch.tf32"
            keeps fp32 params and turns TF32 on until :meth:`release` (or the end of a ``with``
            block) restores the previous flags.
        sync_buffer: before each training forward (and the first forward after ``eval()``),
            average the floating buffers (e.g. BatchNorm running stats) over
            ``data_parallel_group``. Integer buffers are left alone.
        data_parallel_group: the DP process group; None (or a group of size 1) means no
            averaging.
        is_last_stage: pipeline parallelism: only the last stage casts its outputs to fp32;
            other stages send activations in ``dtype`` (pass ``ParallelState.is_last_stage``).

    Forward: every floating tensor in args and kwargs (nested lists/tuples/namedtuples/dicts)
    is cast to ``dtype``; integer/bool tensors and other objects pass through unchanged.

    Raises ValueError for an unknown dtype, TypeError if ``model`` is not an nn.Module.
    """

    def __init__(
        self,
        model: nn.Module,
        output_to_fp32: bool = True,
        dtype: Union[str, torch.dtype] = torch.float16,
        sync_buffer: bool = True,
        data_parallel_group: Optional[dist.ProcessGroup] = None,
        *,
        is_last_stage: bool = True,
    ):
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"NaiveAMPModel expects an nn.Module, got {type(model).__name__}")
        self.dtype, self.tf32 = parse_dtype(dtype)
        self.model = model
        self.output_to_fp32 = bool(output_to_fp32)
        self.is_last_stage = bool(is_last_stage)
        self._process_group = data_parallel_group
        self._dp_world_size = (
            dist.get_world_size(data_parallel_group)
            if data_parallel_group is not None and dist.is_available() and dist.is_initialized()
            else 1
        )
        self._sync_buffer = bool(sync_buffer) and self._dp_world_size > 1
        self._first_eval_run = False
        self._tf32_flags = TF32Flags()
        self._hook_handles = []

        self._cast_model(self.model)
        if self.dtype != torch.float32:
            self._register_fp32_island_hooks()
        if self.tf32:
            self._tf32_flags.enable()

    # ---- construction -------------------------------------------------------------------
    def _cast_model(self, root: nn.Module) -> None:
        # Walk top-down; a marked module and everything under it stays fp32.
        stack = [(root, False)]
        while stack:
            module, in_island = stack.pop()
            in_island = in_island or module_has_fp32_attr(module)
            _cast_module_tensors_(module, torch.float32 if in_island else self.dtype)
            stack.extend((child, in_island) for child in module.children())

    def _outermost_islands(self):
        islands, stack = [], [self.model]
        while stack:
            module = stack.pop()
            if module_has_fp32_attr(module):
                islands.append(module)  # nested islands already run in fp32: no hooks there
                continue
            stack.extend(module.children())
        return islands

    def _register_fp32_island_hooks(self) -> None:
        model_dtype = self.dtype

        def to_fp32(module, args, kwargs):
            return _cast_floating(args, torch.float32), _cast_floating(kwargs, torch.float32)

        def to_model_dtype(module, args, output):
            return _cast_floating(output, model_dtype)

        for island in self._outermost_islands():
            # prepend: the island's own pre-hooks already see fp32 inputs
            self._hook_handles.append(
                island.register_forward_pre_hook(to_fp32, with_kwargs=True, prepend=True)
            )
            self._hook_handles.append(island.register_forward_hook(to_model_dtype))

    # ---- properties ---------------------------------------------------------------------
    @property
    def sync_buffer(self) -> bool:
        """Whether floating buffers are averaged over the DP group before forward."""
        return self._sync_buffer

    @property
    def casts_outputs_to_fp32(self) -> bool:
        """output_to_fp32 and this is the last pipeline stage."""
        return self.output_to_fp32 and self.is_last_stage

    # ---- buffers ------------------------------------------------------------------------
    def _reduce_module_buffers(self) -> None:
        by_dtype = defaultdict(list)
        for buf in self.model.buffers():
            if buf is not None and buf.is_floating_point():
                by_dtype[(buf.device, buf.dtype)].append(buf)
        for bufs in by_dtype.values():
            flat = _flatten_dense_tensors(bufs)
            flat.div_(self._dp_world_size)  # divide first: a sum of fp16 stats may overflow
            dist.all_reduce(flat, group=self._process_group)
            for buf, synced in zip(bufs, _unflatten_dense_tensors(flat, bufs)):
                buf.copy_(synced)

    def train(self, mode: bool = True) -> "NaiveAMPModel":
        # InternEvo: buffers are synced in the first eval forward after training.
        if not mode and self._sync_buffer and self.training:
            self._first_eval_run = True
        return super().train(mode)

    # ---- forward ------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self._sync_buffer and (self.training or self._first_eval_run):
            with torch.no_grad():
                self._reduce_module_buffers()
            self._first_eval_run = False
        args = _cast_floating(args, self.dtype)
        kwargs = _cast_floating(kwargs, self.dtype)
        out = self.model(*args, **kwargs)
        if self.casts_outputs_to_fp32:
            out = _cast_floating(out, torch.float32, from_dtypes=_HALF_DTYPES)
        return out

    # ---- release ------------------------------------------------------------------------
    def release(self) -> None:
        """Restore the TF32 flags this wrapper set (dtype "torch.tf32"); idempotent. The model
        stays usable (in plain fp32 after release)."""
        self._tf32_flags.restore()

    def __enter__(self) -> "NaiveAMPModel":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def extra_repr(self) -> str:
        dtype = "tf32" if self.tf32 else str(self.dtype)
        return (
            f"dtype={dtype}, output_to_fp32={self.output_to_fp32}, "
            f"is_last_stage={self.is_last_stage}, sync_buffer={self._sync_buffer}"
        )
