"""Benchmark tpamp.LayerWiseDistributedOptimizer against the replicated step at DP 2: step
time (paired, interleaved) and bytes of optimizer state per parameter element.

A benchmark, not a test. Ranks are fork-started processes on one machine with a gloo process
group (tcp://127.0.0.1), one thread each (``--device cuda``: NCCL, one GPU per rank).

Model: ``--layers`` square ``--hidden`` x ``--hidden`` matrices and a 4x-wide MLP pair per layer
(the 2-D params Muon orthogonalizes), fp16 or bf16 (``--dtype``), seeded alike on every rank.
Each round times, on the same pre-made grads (re-attached outside the timer):

  layerwise  LayerWiseDistributedOptimizer.step(): grads -> owner buckets, reduce to the owner,
             unscale + found_inf + norm, clip, the inner step on the owned params only, cast,
             broadcast from the owners.
  replicated the hand all-reduce of scripts/train_gpt.py (one flat fp32 buffer, all_reduce SUM,
             divide, copy back) + MixedPrecisionOptimizer.step() (the inner step on every
             param on every rank).

The two alternate within each round (ABBA order across rounds); rank 0 reports medians and the
paired median of the per-round ratio layerwise/replicated. State bytes: each wrapper's
``optimizer_state_bytes()`` (fp32 main params + inner state) after one step, per rank, divided
by the model's element count.

Run::

    python scripts/bench_layerwise.py                                   # Muon, defaults below
    python scripts/bench_layerwise.py --optimizer adafactor --reps 20 --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
from bench_distributed_optimizer import launch, machine  # noqa: E402  (scripts/)

import tpamp  # noqa: E402

LOSS_SCALE = 2.0**12
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--optimizer", choices=("muon", "adafactor", "adamw"), default="muon")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def model_shapes(hidden: int, layers: int):
    per_layer = [(3 * hidden, hidden), (hidden, hidden), (4 * hidden, hidden), (hidden, 4 * hidden)]
    return per_layer * layers


def inner(name, params):
    if name == "muon":
        return torch.optim.Muon(params, lr=0.02, weight_decay=0.1)
    if name == "adafactor":
        return torch.optim.Adafactor(params, lr=0.01)
    return torch.optim.AdamW(params, lr=1e-3)


def build(kind, args, shapes, device):
    g = torch.Generator().manual_seed(0)
    dtype = DTYPES[args.dtype]
    params = [torch.nn.Parameter((torch.randn(s, generator=g) * 0.02).to(device, dtype))
              for s in shapes]
    scaler = tpamp.DynamicGradScaler(initial_scale=LOSS_SCALE) if dtype == torch.float16 else None
    kw = dict(grad_scaler=scaler, clip_grad=1.0, log_num_zeros_in_grad=True)
    opt = inner(args.optimizer, params)
    if kind == "layerwise":
        return params, tpamp.LayerWiseDistributedOptimizer(
            opt, data_parallel_group=dist.group.WORLD, **kw)
    return params, tpamp.MixedPrecisionOptimizer(opt, grad_stats_group=dist.group.WORLD, **kw)


def hand_all_reduce(params, dp):
    """scripts/train_gpt.py's DP all-reduce: one flat fp32 buffer, SUM, divide, copy back."""
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat)
    flat /= dp
    for g, new in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(new.view_as(g))


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def worker(rank, world, args, shapes):
    device = torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    built = {k: build(k, args, shapes, device) for k in ("layerwise", "replicated")}
    g = torch.Generator().manual_seed(1 + rank)
    scale = LOSS_SCALE if args.dtype == "fp16" else 1.0
    grads = [(torch.randn(s, generator=g) * 1e-3 * scale).to(device, DTYPES[args.dtype])
             for s in shapes]
    times = {k: [] for k in built}
    bytes_ = {}
    for it in range(args.warmup + args.reps):
        order = list(built) if it % 2 == 0 else list(reversed(built))  # ABBA
        for kind in order:
            params, opt = built[kind]
            opt.zero_grad()
            for p, gr in zip(params, grads):
                p.grad = gr.clone()
            sync(device)
            dist.barrier()
            t0 = time.perf_counter()
            if kind == "replicated":
                hand_all_reduce(params, world)
            ok = opt.step().update_successful
            sync(device)
            dt = time.perf_counter() - t0
            assert ok
            if it >= args.warmup:
                times[kind].append(dt)
        if it == 0:
            bytes_ = {k: o.optimizer_state_bytes() for k, (_, o) in built.items()}
    return {"times": times, "bytes": bytes_}


def main(argv=None):
    args = parse_args(argv)
    shapes = model_shapes(args.hidden, args.layers)
    n = sum(torch.Size(s).numel() for s in shapes)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    report = {"machine": machine(), "date": now,
              "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
              "numel": n, "tensors": len(shapes), "load_before": os.getloadavg()[0],
              **{k: getattr(args, k) for k in ("optimizer", "hidden", "layers", "dtype", "dp",
                                               "reps", "device")}}
    print(f"{report['machine']}\nmodel: {n:,} {args.dtype} elements in {len(shapes)} matrices; "
          f"torch.optim.{inner(args.optimizer, [torch.zeros(1, 1, requires_grad=True)]).__class__.__name__}"
          f", DP {args.dp}", flush=True)
    res = launch(worker, args.dp, args, shapes)
    times = res[0]["times"]
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    paired = statistics.median(a / b for a, b in zip(times["layerwise"], times["replicated"]))
    per_rank = {k: [r["bytes"][k] for r in res] for k in ("layerwise", "replicated")}
    report.update(median_ms=med, min_ms={k: min(v) * 1e3 for k, v in times.items()},
                  paired_layerwise_over_replicated=paired, state_bytes_per_rank=per_rank,
                  state_bytes_per_param={k: max(v) / n for k, v in per_rank.items()},
                  load_after=os.getloadavg()[0])
    print(f"\nstep time at DP={args.dp}, {args.reps} interleaved rounds (ABBA), rank 0:")
    print(f"  layer-wise (reduce to owner + owned step + broadcast): median "
          f"{med['layerwise']:.1f} ms, min {report['min_ms']['layerwise']:.1f} ms")
    print(f"  replicated (all-reduce + every param's step):          median "
          f"{med['replicated']:.1f} ms, min {report['min_ms']['replicated']:.1f} ms")
    print(f"  paired median layerwise/replicated: {paired:.3f}x   (load "
          f"{report['load_before']:.2f} -> {report['load_after']:.2f})")
    print("\noptimizer state (fp32 main params + inner state), bytes per model element, the "
          "largest rank:")
    for k, v in per_rank.items():
        print(f"  {k:>10}: {max(v) / n:.3f} B/param  (per rank {v})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
