"""float64 references of the grad-stats kernels, shared by the tests of the emulated CUDA
launchers (tests/test_simt.py) and by the GPU check (scripts/gpu_check.py, which puts tests/ on
sys.path): what a kernel writes and the statistics of what it wrote, computed independently of
the kernels in float64."""

from __future__ import annotations

import math

import torch


def f32(x) -> float:
    """x rounded to float32 (a Python float or a one-element tensor), as the kernels get it."""
    return float(torch.tensor(float(x), dtype=torch.float32))


def written_ref(x, scale, dtype):
    """float64 model: float32(x * scale) (exact product, rounded once), then rounded to dtype;
    the scale is the float32 the kernels get (None: no scale)."""
    v = x.double() if scale is None else x.double() * f32(scale)
    return v.to(torch.float32).to(dtype)


def stats_ref(values, mask):
    """(found_inf, sum of squares, max |v|, zeros, per-tensor L2 norms) of ``values`` in float64;
    the sum, max and zeros over the tensors whose ``mask`` entry is true, found_inf and the norms
    over all. max |v| is NaN when a counted value is NaN."""
    found = any(not bool(torch.isfinite(v).all()) for v in values)
    counted = [v.double().reshape(-1) for v, m in zip(values, mask) if m]
    flat = torch.cat(counted) if counted else torch.zeros(0, dtype=torch.float64)
    sumsq = float((flat * flat).sum())
    amax = float(flat.abs().max()) if flat.numel() else 0.0
    if flat.numel() and bool(flat.isnan().any()):
        amax = math.nan
    zeros = int((flat == 0).sum())
    norms = [math.sqrt(float((v.double() ** 2).sum())) if v.numel() else 0.0 for v in values]
    return found, sumsq, amax, zeros, norms
