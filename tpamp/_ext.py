"""Loading of tpamp's kernels (the extension modules built from csrc/) and their fake impls.

* ``tpamp._C``: the schemas of ``torch.ops.tpamp.*`` and, in a CUDA build, the CUDA kernels.
* ``tpamp._C_cpu_<capability>``: the CPU kernels, compiled once per at::vec CPU capability
  (default, avx2, avx512). The one loaded is the best that torch reports for this CPU
  (``torch.backends.cpu.get_cpu_capability()``, which honours ``ATEN_CPU_CAPABILITY``), so a
  build runs correctly on any machine and at full SIMD width where the CPU has it.

Each device type is checked once, at first use: the CPU module loads, or a CUDA device runs one
tiny kernel (a build without a kernel image for that GPU fails here, not in a training step).
Whatever fails is said once, in one RuntimeWarning, and those tensors take the PyTorch path of
tpamp.ops. The fake (meta) implementations that torch.compile traces with are registered here.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import warnings
from typing import Dict, Optional

import torch

__all__ = ["load_simt", "ops_for", "status"]

_CPU_ORDER = {
    # torch's capability -> the modules that can run on it, best first
    "AVX512": ("avx512", "avx2", "default"),
    "AVX2": ("avx2", "default"),
}

_loaded = False
_frontend_error: Optional[str] = None
_cpu_module: Optional[str] = None  # e.g. "tpamp._C_cpu_avx2"
_cpu_error: Optional[str] = None
_with_cuda = False
_cuda_ok: Dict[int, bool] = {}  # device index -> the probe passed
_warned = set()


def _warn_once(key: str, message: str) -> None:
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=4)


def _load() -> None:
    """Imports tpamp._C and this CPU's capability module, once."""
    global _loaded, _frontend_error, _cpu_module, _cpu_error, _with_cuda
    if _loaded:
        return
    _loaded = True
    note = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_kernels_not_built.txt")
    install_note = ""
    if os.path.exists(note):
        with open(note, encoding="utf-8") as f:
            install_note = " At install: " + " ".join(f.read().split())
    if importlib.util.find_spec("tpamp._C") is None:
        _frontend_error = (
            "tpamp._C is not built (install with `pip install --no-build-isolation -e .`)."
            + install_note
        )
        return
    try:
        frontend = importlib.import_module("tpamp._C")  # defines torch.ops.tpamp.*
    except Exception as e:  # e.g. undefined symbols: built against a different torch
        _frontend_error = f"tpamp._C could not be loaded ({e}); rebuild tpamp against torch {torch.__version__}"
        return
    _with_cuda = bool(getattr(frontend, "with_cuda", 0))
    _register_fakes()

    capability = torch.backends.cpu.get_cpu_capability()
    candidates = _CPU_ORDER.get(capability, ("default",))
    errors = []
    for cap in candidates:
        name = f"tpamp._C_cpu_{cap}"
        if importlib.util.find_spec(name) is None:
            errors.append(f"{name} is not built")
            continue
        try:
            importlib.import_module(name)  # registers the CPU kernels
        except Exception as e:
            errors.append(f"{name} could not be loaded ({e})")
            continue
        _cpu_module = name
        break
    if _cpu_module is None:
        _cpu_error = (
            f"no CPU kernel module loads for CPU capability {capability}: " + "; ".join(errors)
            + "." + install_note
        )


def _probe_cuda(index: int) -> bool:
    """One tiny launch on CUDA device `index`: False (with a warning) if no kernel image fits."""
    ok = False
    why = ""
    try:
        with torch.cuda.device(index):
            x = torch.full((3,), 3.0, device=f"cuda:{index}")
            s = torch.full((1,), 2.0, device=f"cuda:{index}")
            torch.ops.tpamp.scale_([x], s)
            ok = bool(torch.equal(x.cpu(), torch.full((3,), 6.0)))
            why = "" if ok else "the probe kernel computed a wrong result"
    except Exception as e:  # e.g. "no kernel image is available for execution on the device"
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if not ok:
        cap = ".".join(map(str, torch.cuda.get_device_capability(index)))
        _warn_once(
            f"cuda:{index}",
            f"tpamp: the CUDA kernels of tpamp._C do not run on cuda:{index} (compute capability "
            f"{cap}): {why}. Using the PyTorch fallback on this device; rebuild with "
            f"TORCH_CUDA_ARCH_LIST including {cap}.",
        )
    return ok


def ops_for(device: torch.device):
    """``torch.ops.tpamp`` when the kernels run on ``device``'s type, else None (after one
    warning saying why)."""
    _load()
    if _frontend_error is not None:
        _warn_once("frontend", f"tpamp: {_frontend_error}. Using the PyTorch fallback.")
        return None
    if device.type == "cpu":
        if _cpu_module is None:
            _warn_once("cpu", f"tpamp: {_cpu_error}. Using the PyTorch fallback on CPU.")
            return None
        return torch.ops.tpamp
    if device.type == "cuda":
        if not _with_cuda:
            _warn_once(
                "cuda",
                "tpamp: tpamp._C was built without CUDA kernels (torch was not a CUDA build or "
                "nvcc was not found at install time). Using the PyTorch fallback on CUDA.",
            )
            return None
        if not torch.cuda.is_available():
            return None
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in _cuda_ok:
            _cuda_ok[index] = _probe_cuda(index)
        return torch.ops.tpamp if _cuda_ok[index] else None
    return None


def status() -> Dict[str, object]:
    """What is loaded: {'frontend': error or None, 'cpu_module': name or None, 'cpu_error',
    'with_cuda': bool, 'cuda_devices_ok': {index: bool}}."""
    _load()
    return {
        "frontend_error": _frontend_error,
        "cpu_module": _cpu_module,
        "cpu_error": _cpu_error,
        "with_cuda": _with_cuda,
        "cuda_devices_ok": dict(_cuda_ok),
    }


# ---------------------------------------------------------------------------------------------
# The emulated CUDA launchers (test infrastructure; csrc/simt/, built with TPAMP_BUILD_SIMT=1).

_simt_lib = None  # the torch.library.Library defining torch.ops.tpamp_simt.*
_simt_module: Optional[str] = None
SIMT_VARIANTS = ("", "thread", "address")


def load_simt(variant: Optional[str] = None):
    """Loads ``tpamp._C_simt`` (``variant`` "thread" or "address": ``tpamp._C_simt_<variant>``,
    the ThreadSanitizer / AddressSanitizer build; None: ``$TPAMP_SIMT_VARIANT``, default the plain
    one) and returns ``torch.ops.tpamp_simt``: for every op of ``torch.ops.tpamp`` an op of the
    same name and schema whose CPU kernel is the CUDA launcher of csrc/cuda/ running on CPU
    tensors under the SIMT emulator (schedule order: ``$TPAMP_SIMT_ORDER``, forward, reverse or
    random, read at each launch). One variant per process. Raises RuntimeError when tpamp._C or
    the module is not built (build with ``TPAMP_BUILD_SIMT=1``), ValueError for an unknown
    variant."""
    global _simt_lib, _simt_module
    if variant is None:
        variant = os.environ.get("TPAMP_SIMT_VARIANT", "")
    if variant not in SIMT_VARIANTS:
        raise ValueError(f"tpamp: SIMT variant {variant!r}; expected one of {SIMT_VARIANTS}")
    name = "tpamp._C_simt" + (f"_{variant}" if variant else "")
    if _simt_module is not None:
        if _simt_module != name:
            raise RuntimeError(f"tpamp: {_simt_module} is loaded; {name} needs its own process")
        return torch.ops.tpamp_simt
    _load()
    if _frontend_error is not None:
        raise RuntimeError(f"tpamp: {_frontend_error}")
    if importlib.util.find_spec(name) is None:
        raise RuntimeError(
            f"tpamp: {name} is not built (build with TPAMP_BUILD_SIMT=1"
            + (f" TPAMP_SIMT_SANITIZE={variant}" if variant else "") + ")"
        )
    # The schemas: torch.ops.tpamp's own, under the namespace tpamp_simt.
    lib = torch.library.Library("tpamp_simt", "DEF")
    for op_name in sorted(torch._C._dispatch_get_all_op_names()):
        if not op_name.startswith("tpamp::"):
            continue
        schema = str(getattr(torch.ops.tpamp, op_name[len("tpamp::"):]).default._schema)
        lib.define(schema[len("tpamp::"):])
    importlib.import_module(name)  # registers the CPU kernels of torch.ops.tpamp_simt.*
    _simt_lib, _simt_module = lib, name
    return torch.ops.tpamp_simt


# ---------------------------------------------------------------------------------------------
# Fake (meta) implementations: shapes, dtypes and devices of each op's outputs, for FakeTensor
# tracing (torch.compile, torch.library.opcheck). Mutated inputs keep their metadata.


def _register_fakes() -> None:
    lib = torch.library

    def stats_outputs(grads, scale, per_tensor):
        device = grads[0].device if len(grads) else scale.device
        f32 = dict(dtype=torch.float32, device=device)
        return (
            torch.empty(1, **f32),  # found_inf
            torch.empty((), dtype=torch.float64, device=device),  # sum of squares
            torch.empty((), **f32),  # max |g|
            torch.empty((), dtype=torch.int64, device=device),  # zero count
            torch.empty(len(grads) if per_tensor else 0, **f32),  # per-tensor L2 norms
        )

    @lib.register_fake("tpamp::grad_stats_")
    def _grad_stats_(grads, scale, mask, count_zeros, per_tensor):
        return stats_outputs(grads, scale, per_tensor)

    @lib.register_fake("tpamp::grad_stats_out")
    def _grad_stats_out(grads, scale, mask, count_zeros, per_tensor, *, out):
        return stats_outputs(grads, scale, per_tensor)

    @lib.register_fake("tpamp::scale_")
    def _scale_(tensors, scale):
        return None

    @lib.register_fake("tpamp::scale_and_copy")
    def _scale_and_copy(srcs, dsts, scale):
        return None

    @lib.register_fake("tpamp::dynamic_scaler_update_")
    def _dynamic_scaler_update_(scale, growth_tracker, hysteresis_tracker, found_inf,
                                growth_factor, backoff_factor, growth_interval, hysteresis,
                                min_scale, max_scale, consecutive):
        return None

    @lib.register_fake("tpamp::fused_adam_step_")
    def _fused_adam_step_(params, exp_avgs, exp_avg_sqs, steps, model_params, grads, grad_scale,
                          found_inf, lr_tensor, lr, beta1, beta2, eps, weight_decay,
                          decoupled_weight_decay, maximize, exp_avg_scales,
                          exp_avg_sq_scales, stochastic_rounding=None):
        return None

    @lib.register_fake("tpamp::fused_sgd_step_")
    def _fused_sgd_step_(params, momentum_buffers, model_params, grads, first_step, grad_scale,
                         found_inf, lr_tensor, lr, momentum, dampening, weight_decay, nesterov,
                         maximize):
        return None

    @lib.register_fake("tpamp::grad_sumsq_exact")
    def _grad_sumsq_exact(tensors, scale):
        device = tensors[0].device if len(tensors) else scale.device
        return torch.empty(26, dtype=torch.float64, device=device)  # base-2^24 digits

    @lib.register_fake("tpamp::exact_sumsq_to_double")
    def _exact_sumsq_to_double(digits):
        return torch.empty((), dtype=torch.float64, device=digits.device)
