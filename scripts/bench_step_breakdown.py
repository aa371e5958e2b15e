"""Where the time of the one-pass fp32-state step goes: the statistics pass, the step kernel and
the host work around them, beside a bare ``torch.optim.AdamW(fused=True).step()``.

A benchmark, not a test. One process builds the model of scripts/bench_revision.py (fp16 params
and grads, ``--numel`` elements in ``--tensors`` tensors; AdamW lr 1e-4, weight decay 0.01 behind a
DynamicGradScaler, clip_grad 1.0 and the zero count) and times, in rotating order, ``--reps``
times each (fresh grads before every call, outside the timer):

- ``step``: ``MixedPrecisionOptimizer.step()`` (the whole one-pass step);
- ``stats``: ``tpamp.ops.grad_stats`` as the step calls it (read-only pass, norm and zeros);
- ``kernel``: ``tpamp.ops.fused_adam_step_`` on the optimizer's own lists (the update pass);
- ``bare``: ``torch.optim.AdamW(fused=True).step()`` on fp32 params and grads of the same sizes;
- ``host``: the whole step on ``--tensors`` tensors of ``--host-numel`` elements each (the work
  per tensor that does not grow with the size).

The given grads stay referenced until the timer has stopped, in every case: the tpamp step
releases the model grads it consumed (as Megatron-LM's does), ``AdamW.step()`` leaves that to
``zero_grad()``, and freeing ~200 MB of grads (glibc returning the pages) costs 1-2 ms on this
machine; neither side is timed with it.

It prints the minimum and the median of each in ms (wall and thread CPU time) and the ratios of
the minima. Run from the repository root with the kernels built::

    OMP_NUM_THREADS=1 python scripts/bench_step_breakdown.py --numel 2e7 --threads 1
    OMP_NUM_THREADS=2 python scripts/bench_step_breakdown.py --numel 1e8 --threads 2 --reps 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import tpamp
from tpamp import ops


def _model(numel: int, ntensors: int, fp32: bool = False):
    torch.manual_seed(0)
    sizes = [numel // ntensors + (i * 37) % 101 for i in range(ntensors)]
    params = [torch.nn.Parameter(torch.randn(n).half()) for n in sizes]
    grads = [torch.randn(n).half() * 1e-2 for n in sizes]
    if fp32:
        params = [torch.nn.Parameter(p.detach().float()) for p in params]
        grads = [g.float() for g in grads]
    return params, grads


def _tpamp_opt(params):
    return tpamp.MixedPrecisionOptimizer(
        torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01),
        grad_scaler=tpamp.DynamicGradScaler(initial_scale=1.0), clip_grad=1.0,
        log_num_zeros_in_grad=True)


@torch.no_grad()
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=float, default=2e7)
    p.add_argument("--tensors", type=int, default=196)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=12)
    p.add_argument("--host-numel", type=int, default=100)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    numel = int(args.numel)

    params, grads = _model(numel, args.tensors)
    opt = _tpamp_opt(params)
    bare_params, bare_grads = _model(numel, args.tensors, fp32=True)
    bare = torch.optim.AdamW(bare_params, lr=1e-4, weight_decay=0.01, fused=True)
    small_params, small_grads = _model(args.host_numel * args.tensors, args.tensors)
    small = _tpamp_opt(small_params)

    held = []  # the given grads, released after the timer (module docstring)

    def give(ps, gs):
        for q, g in zip(ps, gs):
            q.grad = g.clone()
        held[:] = [q.grad for q in ps]

    give(params, grads)
    opt.step()  # state made; the kernel's lists below are the optimizer's own
    inner = opt.optimizer
    mains = [m for group in opt.main_params_by_group() for m in group]
    states = [inner.state[m] for m in mains]
    mask = [True] * len(mains)

    def run_step():
        give(params, grads)
        return lambda: opt.step()

    def run_stats():
        gs = [g.clone() for g in grads]
        return lambda: ops.grad_stats(gs, norm_mask=mask, norm_type=2.0, count_zeros=True)

    def run_kernel():
        gs = [g.clone() for g in grads]
        return lambda: ops.fused_adam_step_(
            mains, gs, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
            [s["step"] for s in states], model_params=[q.data for q in params],
            grad_scale=torch.ones(1), lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8,
            weight_decay=0.01, decoupled_weight_decay=True)

    def run_bare():
        give(bare_params, bare_grads)
        return lambda: bare.step()

    def run_host():
        give(small_params, small_grads)
        return lambda: small.step()

    cases = {"step": run_step, "stats": run_stats, "kernel": run_kernel, "bare": run_bare,
             "host": run_host}
    wall = {k: [] for k in cases}
    cpu = {k: [] for k in cases}
    names = list(cases)
    for r in range(args.reps + 2):
        for k in names[r % len(names):] + names[:r % len(names)]:  # rotating order
            fn = cases[k]()
            t0, c0 = time.perf_counter(), time.thread_time()
            fn()
            t1, c1 = time.perf_counter(), time.thread_time()
            held.clear()
            if r >= 2:
                wall[k].append((t1 - t0) * 1e3)
                cpu[k].append((c1 - c0) * 1e3)
    out = {"numel": numel, "tensors": args.tensors, "threads": args.threads,
           "torch": torch.__version__}
    for k in names:
        out[k] = {"min_ms": min(wall[k]), "median_ms": statistics.median(wall[k]),
                  "min_thread_cpu_ms": min(cpu[k])}
        print(f"{k:>6}: min {min(wall[k]):8.2f} ms, median {statistics.median(wall[k]):8.2f} ms,"
              f" min main-thread CPU {min(cpu[k]):8.2f} ms")
    b = out["bare"]["min_ms"]
    print(f"step / bare {out['step']['min_ms'] / b:.3f}; stats / bare "
          f"{out['stats']['min_ms'] / b:.3f}; kernel / bare {out['kernel']['min_ms'] / b:.3f}; "
          f"step - stats - kernel {out['step']['min_ms'] - out['stats']['min_ms'] - out['kernel']['min_ms']:.2f} ms;"
          f" host (small tensors) {out['host']['min_ms']:.2f} ms")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
