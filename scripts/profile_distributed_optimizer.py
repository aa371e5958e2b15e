"""Where DistributedOptimizer.step's time goes: wall-clock per phase on rank 0, and the gloo
collectives it can use, on the model of scripts/bench_distributed_optimizer.py (fp16, AdamW,
DynamicGradScaler, clip 1.0, zero count; ranks fork-started, gloo over tcp://127.0.0.1, one
thread each). A profile, not a test.

1. phases: the step's methods (grads into the buckets, starting / finishing the reduce-scatter,
   the statistics pass, the statistics all-reduce, the one-pass update, the gather) are wrapped
   in timers; medians over ``--steps`` steps. With ``--baseline REV`` the DistributedOptimizer
   of git revision REV too (as in bench_distributed_optimizer.py), interleaved step by step.
2. collectives (``--collectives``): the same bytes through gloo's all_reduce, reduce_scatter
   (tensor and list forms), all_gather (tensor and list forms) and isend/irecv at DP 2,
   interleaved, plus a fp16 -> fp32 add_ (which casts through a whole-size temporary) against
   copy_.

Run::

    python scripts/profile_distributed_optimizer.py --numel 2e7 --steps 5 --collectives
    python scripts/profile_distributed_optimizer.py --numel 2e7 --steps 5 --baseline main
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_distributed_optimizer as bench  # noqa: E402  (also puts the repo on sys.path)

import tpamp.distributed_optimizer as dopt  # noqa: E402

PHASES = ("_accumulate", "_start_reduce", "_sync_grads", "_fused_grads", "_grad_stats", "_reduce",
          "_fused_update", "_gather_model_params")
TIMES: dict = collections.defaultdict(float)


def _timed(name, fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name] += time.perf_counter() - t
    return wrapper


def phases_worker(rank, world, shapes, steps):
    kinds = ("dist",) + (("base",) if bench.BASELINE is not None else ())
    built = {}
    for kind in kinds:
        cls = dopt.DistributedOptimizer if kind == "dist" else bench.BASELINE.DistributedOptimizer
        for name in PHASES:
            if hasattr(cls, name):  # a baseline from before a rename lacks some
                setattr(cls, name, _timed(name, getattr(cls, name)))
        built[kind] = bench.build(kind, shapes, dist.group.WORLD, None)
    grads = bench.make_grads(built["dist"][0], rank)
    rows = {k: [] for k in kinds}
    for it in range(steps + 1):
        for kind, (params, opt) in built.items():
            opt.zero_grad()
            for p, g in zip(params, grads):
                p.grad = g
            dist.barrier()
            TIMES.clear()
            t = time.perf_counter()
            assert opt.step().update_successful
            total = time.perf_counter() - t
            if it:  # the first step allocates the optimizer state
                rows[kind].append({**TIMES, "step (total)": total})
    return {kind: {k: statistics.median(r[k] for r in rs) * 1e3 for k in rs[0]}
            for kind, rs in rows.items()}


def collectives_worker(rank, world, n, reps):
    warnings.simplefilter("ignore")  # the deprecated names
    x, out = torch.randn(n), torch.empty(n // 2)
    h, ho = torch.randn(n).half(), torch.empty(n // 2).half()
    other = 1 - rank

    def p2p_reduce_scatter():
        ch = x.chunk(2)
        works = [dist.irecv(out, src=other), dist.isend(ch[other], dst=other)]
        for w in works:
            w.wait()
        out.add_(ch[rank])

    def p2p_all_gather():
        ch = h.chunk(2)
        works = [dist.irecv(ch[other], src=other), dist.isend(ch[rank], dst=other)]
        for w in works:
            w.wait()

    fns = {
        "fp32 all_reduce (n)": lambda: dist.all_reduce(x),
        "fp32 reduce_scatter_tensor (n -> n/2)": lambda: dist.reduce_scatter_tensor(out, x),
        "fp32 reduce_scatter list (n -> n/2)": lambda: dist.reduce_scatter(out, list(x.chunk(2))),
        "fp32 isend/irecv reduce-scatter + add": p2p_reduce_scatter,
        "fp16 all_gather_into_tensor (n/2 -> n)": lambda: dist.all_gather_into_tensor(h, ho),
        "fp16 all_gather list (n/2 -> n)": lambda: dist.all_gather(list(h.chunk(2)), ho),
        "fp16 isend/irecv all-gather": p2p_all_gather,
        "fp32 += fp16 (add_, n)": lambda: x.add_(h),
        "fp32 <- fp16 (copy_, n)": lambda: x.copy_(h),
    }
    res = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            dist.barrier()
            t = time.perf_counter()
            f()
            res[k].append(time.perf_counter() - t)
    return {k: (statistics.median(v[1:]) * 1e3, min(v[1:]) * 1e3) for k, v in res.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=float, default=2e7)
    p.add_argument("--tensors", type=int, default=48)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--collectives", action="store_true")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--baseline", default=None, metavar="REV")
    args = p.parse_args(argv)
    if args.baseline:
        bench.BASELINE = bench.load_baseline(args.baseline)
    shapes = bench.model_shapes(int(args.numel), args.tensors)
    print(f"{bench.machine()}; load {os.getloadavg()[0]:.1f}")
    res = bench.launch(phases_worker, 2, shapes, args.steps)[0]
    print(f"DistributedOptimizer.step at DP 2, {sum(torch.Size(s).numel() for s in shapes):,} "
          f"fp16 elements, rank 0, median of {args.steps} steps (ms; nested: "
          "_sync_grads includes _accumulate and _start_reduce):")
    print(f"  {'':24s} {'this tree':>9s}" + (f" {args.baseline:>9s}" if args.baseline else ""))
    for k, v in res["dist"].items():
        base = f" {res['base'].get(k, math.nan):9.1f}" if "base" in res else ""
        print(f"  {k:24s} {v:9.1f}{base}")
    if args.collectives:
        res = bench.launch(collectives_worker, 2, int(args.numel), args.reps)[0]
        print(f"gloo at DP 2, n = {int(args.numel):,}, rank 0, {args.reps} interleaved rounds "
              "(median / min ms):")
        for k, (med, lo) in res.items():
            print(f"  {k:40s} {med:9.1f} {lo:9.1f}")
    print(f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
