"""Run megatron-core's Float16OptimizerWithFloat16Params on CPU tensors, as a reference and a
benchmark baseline (megatron-core is not a tpamp dependency: install it in a separate venv).

megatron-core writes ``device='cuda'`` into its tensors and checks ``param.type()`` against
``'torch.cuda.HalfTensor'``. :class:`CudaAsCpu`, a ``TorchFunctionMode``, runs that code unchanged
on CPU tensors: a ``device`` argument naming CUDA becomes ``cpu``, ``Tensor.type()`` of a CPU tensor
answers with the CUDA type name, and ``Tensor.cuda()`` returns the tensor itself. Without Apex or
Transformer Engine megatron-core uses its own PyTorch fallbacks (multi_tensor_applier, l2 norm,
scale), which is what runs here. The mode intercepts every torch call made while it is active,
which adds a few microseconds per call to megatron's time (see docs/benchmarks-log.md).

Usage (one process, a one-rank gloo group for megatron's all-reduces)::

    with CudaAsCpu():
        opt = make_megatron_fp16_optimizer(torch.optim.AdamW(params, ...), group, clip_grad=1.0,
                                           log_num_zeros_in_grad=True, initial_scale=2.0**16)
        ok, grad_norm, num_zeros = opt.step()
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

_CUDA_TYPE_NAMES = {
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float32: "torch.cuda.FloatTensor",
}


def _cpu_if_cuda(device):
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cpu")
    d = torch.device(device)
    return torch.device("cpu") if d.type == "cuda" else device


class CudaAsCpu(TorchFunctionMode):
    """Map CUDA devices to CPU for code written for CUDA (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            t = args[0]
            if t.device.type == "cpu" and t.dtype in _CUDA_TYPE_NAMES:
                return _CUDA_TYPE_NAMES[t.dtype]
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs:
            kwargs["device"] = _cpu_if_cuda(kwargs["device"])
        return func(*args, **kwargs)


class _NoStream:
    """What megatron's DDP asks of torch.cuda.current_stream() on CPU: no-op waits."""

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass

    def record_event(self, event=None):
        return event


def install_cuda_shims() -> None:
    """The three torch.cuda functions megatron-core calls unconditionally, answered for CPU
    ranks: ``current_device()`` 0 (passed as ``device=``, which :class:`CudaAsCpu` maps to
    cpu), ``current_stream()`` an object with no-op ``wait_event`` / ``wait_stream`` (DDP's
    start_grad_sync) and ``synchronize()`` a no-op. Call once per process before building
    megatron-core objects; tpamp itself needs none of them."""
    torch.cuda.current_device = lambda: 0
    torch.cuda.current_stream = lambda device=None: _NoStream()
    torch.cuda.synchronize = lambda device=None: None


def make_megatron_fp16_optimizer(
    inner: torch.optim.Optimizer,
    group,
    *,
    clip_grad: float,
    log_num_zeros_in_grad: bool,
    initial_scale: float,
    min_scale: float = 1.0,
    growth_interval: int = 1000,
    hysteresis: int = 2,
    bf16: bool = False,
):
    """megatron-core's Float16OptimizerWithFloat16Params around ``inner`` (whose params are the
    fp16/bf16 model params), with its DynamicGradScaler, reducing over ``group``. Call inside
    :class:`CudaAsCpu`. Raises ImportError without megatron-core."""
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
    from megatron.core.optimizer.optimizer_config import OptimizerConfig

    config = OptimizerConfig(
        optimizer="adam",
        fp16=not bf16,
        bf16=bf16,
        clip_grad=clip_grad,
        log_num_zeros_in_grad=log_num_zeros_in_grad,
    )
    scaler = DynamicGradScaler(
        initial_scale=initial_scale,
        min_scale=min_scale,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=growth_interval,
        hysteresis=hysteresis,
    )
    opt = Float16OptimizerWithFloat16Params(inner, config, scaler, lambda _: None)
    opt.grad_stats_parallel_group = group  # megatron's override of the model-parallel group
    opt.tp_group = group
    return opt
