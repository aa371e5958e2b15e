"""Benchmark the cost of per-parameter update norms on a logging step (a paired micro-run).

A benchmark, not a test. Three copies of one bf16 model, each under its own
tpamp.MixedPrecisionOptimizer(AdamW) with the same gradients, stepped round-robin (A, B, C, A,
B, C, ...) so that machine noise hits all alike:

  plain                 opt.step()                                   (a non-logging step)
  grad norms            opt.step(param_grad_norms=True)
  grad + update norms   opt.step(param_grad_norms=True, param_update_norms=True)
                        (tpamp/update_norms.py: a copy of the fp32 masters before the update, a
                        statistics pass over (old - new) and new after it, one more all-reduce)

Prints the median and minimum wall time of each and the median over rounds of the per-round
ratio to ``plain`` ("paired": trust it, and the ratio of minima, on a shared machine).

    python scripts/bench_update_norms.py --numel 1e7 --tensors 40 --reps 11 --path fused
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import tpamp


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=float, default=1e7, help="about how many elements")
    p.add_argument("--tensors", type=int, default=40)
    p.add_argument("--reps", type=int, default=11, help="timed rounds (after 3 untimed)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--path", choices=["fused", "generic"], default="fused",
                   help="the one-pass step (fused_step=True) or the generic one")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = max(1, int(args.numel / args.tensors) // 1024)
    shapes = [(rows, 1024)] * args.tensors
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=g).to(torch.bfloat16) for s in shapes]

    def make():
        params = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(1))
                                     .to(torch.bfloat16)) for s in shapes]
        opt = tpamp.MixedPrecisionOptimizer(torch.optim.AdamW(params, lr=1e-4), clip_grad=1.0,
                                            fused_step=args.path == "fused")
        opt.track_param_grad_norms([(f"p{i}", q) for i, q in enumerate(params)])
        return params, opt

    variants = {"plain": {}, "grad norms": dict(param_grad_norms=True),
                "grad + update norms": dict(param_grad_norms=True, param_update_norms=True)}
    runs = {k: make() for k in variants}
    times = {k: [] for k in variants}
    for r in range(args.reps + 3):
        for k, kwargs in variants.items():
            params, opt = runs[k]
            for q, grad in zip(params, grads):
                q.grad = grad
            t0 = time.perf_counter()
            opt.step(**kwargs)
            if r >= 3:
                times[k].append(time.perf_counter() - t0)
    base = times["plain"]
    print(f"{rows * 1024 * args.tensors:.2e} bf16 elements in {args.tensors} tensors, AdamW, "
          f"{args.path} path, {args.threads} thread(s), {args.reps} rounds")
    for k, ts in times.items():
        paired = statistics.median(t / b for t, b in zip(ts, base))
        print(f"  {k:20s} median {1e3 * statistics.median(ts):8.1f} ms  min {1e3 * min(ts):8.1f} "
              f"ms  paired ratio {paired:.3f}  ratio of minima {min(ts) / min(base):.3f}")


if __name__ == "__main__":
    main()
