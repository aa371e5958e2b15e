"""Benchmark the optimizer-state storage options (docs/spec.md section 9): bytes per parameter and step time.

A benchmark, not a test. For DP = 1, 2, 4 (``--dps``), ranks are fork-started processes with a
gloo group over tcp://127.0.0.1, ``--threads`` intra-op threads each (default 1, so that 4 ranks
fit 2 cores alike; ``--threads 2`` at DP 1 is what torch uses by default on such a machine).
Every rank builds one bf16 model per
configuration (``--numel`` elements in ``--tensors`` tensors of odd sizes, two param groups, as
scripts/bench_distributed_optimizer.py) wrapped in ``tpamp.DistributedOptimizer`` (AdamW,
clip_grad=1.0, zero count on, the one-pass fused step) with the state stored as:

    fp32      exp_avg / exp_avg_sq float32, fp32 main params (today's default)
    bf16      both moments bfloat16
    bf16+rem  both moments bfloat16, bf16 params + int16 remainders (no fp32 master)
    u8        both moments 8-bit (uint8 codes of the dynamic map, one float32 scale per 256)
    u8+rem    uint8 moments + remainders
    fp8       both moments 8-bit (float8_e4m3fn codes, one float32 scale per 256 elements)
    fp8+rem   8-bit moments + remainders
    sr        float32 moments, bf16 params without master, stochastic rounding (section 21)
    bf16+sr   bf16 moments, bf16 params without master, stochastic rounding

Reported per DP size (rank 0; every rank holds the same amount up to padding):
* ``optimizer_state_bytes()`` / N: main params or remainders + moments (+ scales) per model
  parameter on this rank; with the bf16 param and its bf16 main_grad (``--grad-reduce-in-bf16``;
  the default reduces in fp32, 4 bytes) the whole per-param footprint is param + grad + this.
* step time of ``step()`` (reduce-scatter, statistics, one-pass update, all-gather), the
  configurations interleaved round-robin over ``--reps`` rounds on the same bf16 grads; medians
  and the paired median of each configuration's ratio to fp32 in the same round.

With ``--kernel``, only the one-pass kernel is timed: ``tpamp.ops.fused_adam_step_`` on one
flat tensor of ``--numel`` bf16 params (bf16 grads, AdamW), ``--threads`` threads, no wrapper and no
collective, the configurations interleaved over ``--reps`` rounds (median and paired ratio to
fp32 as above). It isolates the cost of reading and writing each storage format.

Run::

    python scripts/bench_state_formats.py                   # defaults below
    python scripts/bench_state_formats.py --kernel --numel 4e6 --reps 21
    python scripts/bench_state_formats.py --numel 2e6 --reps 5 --dps 1,2 --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
import tpamp  # noqa: E402

CONFIGS = {
    "fp32": dict(),
    "bf16": dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16),
    "bf16+rem": dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16,
                     store_param_remainders=True),
    "u8": dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8),
    "u8+rem": dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8,
                   store_param_remainders=True),
    "fp8": dict(exp_avg_dtype=torch.float8_e4m3fn, exp_avg_sq_dtype=torch.float8_e4m3fn),
    "fp8+rem": dict(exp_avg_dtype=torch.float8_e4m3fn, exp_avg_sq_dtype=torch.float8_e4m3fn,
                    store_param_remainders=True),
    "sr": dict(master_weights=False, stochastic_rounding=True, stochastic_rounding_seed=1),
    "bf16+sr": dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16,
                    master_weights=False, stochastic_rounding=True, stochastic_rounding_seed=1),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=float, default=4e6, help="model elements")
    p.add_argument("--tensors", type=int, default=24)
    p.add_argument("--dps", default="1,2,4")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="reduce grads in bf16 (2-byte main_grad) instead of fp32")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--kernel", action="store_true",
                   help="time the fused step op alone (one tensor, no DP; --dps is ignored)")
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads of each rank (and of --kernel); default 1")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.threads < 1:
        p.error(f"--threads: expected a positive thread count, got {args.threads}")
    unknown = [c for c in args.configs.split(",") if c not in CONFIGS]
    if unknown:  # refused here: a worker's KeyError would leave its peers waiting
        p.error(f"--configs: unknown {unknown}; expected names from {sorted(CONFIGS)}")
    return args


def _sizes(numel, tensors):
    base = numel // tensors
    sizes = [base + (i * 7919) % 1013 - 506 for i in range(tensors)]
    sizes[-1] += numel - sum(sizes)
    return sizes


def _worker(rank, world, port, args, queue):
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))
    try:
        numel = int(args.numel)
        sizes = _sizes(numel, args.tensors)
        names = args.configs.split(",")
        gen = torch.Generator().manual_seed(0)
        init = [(torch.randn(n, generator=gen) * 0.02).to(torch.bfloat16) for n in sizes]
        grads = [(torch.randn(n, generator=gen) * 1e-3).to(torch.bfloat16) for n in sizes]
        opts, models = {}, {}
        for name in names:
            params = [torch.nn.Parameter(t.clone()) for t in init]
            groups = [{"params": params[0::2], "weight_decay": 0.1},
                      {"params": params[1::2], "weight_decay": 0.0}]
            inner = torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.95))
            opts[name] = tpamp.DistributedOptimizer(
                inner, clip_grad=1.0, log_num_zeros_in_grad=True,
                data_parallel_group=dist.group.WORLD,
                grad_reduce_in_fp32=not args.grad_reduce_in_bf16, **CONFIGS[name])
            models[name] = params
        times = {n: [] for n in names}
        for r in range(args.warmup + args.reps):
            for name in names:
                for p, g in zip(models[name], grads):
                    p.main_grad.copy_(g)
                dist.barrier()
                t0 = time.perf_counter()
                ok = opts[name].step().update_successful
                dt = time.perf_counter() - t0
                assert ok
                if r >= args.warmup:
                    times[name].append(dt * 1e3)
        out = {}
        for name in names:
            ratios = [a / b for a, b in zip(times[name], times["fp32"])] if "fp32" in times else []
            out[name] = {
                "state_bytes": opts[name].optimizer_state_bytes(),
                "bytes_per_param": opts[name].optimizer_state_bytes() / numel,
                "median_ms": statistics.median(times[name]),
                "min_ms": min(times[name]),
                "paired_ratio_vs_fp32": statistics.median(ratios) if ratios else None,
            }
        if rank == 0:
            queue.put(out)
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kernel_bench(args):
    """The op alone: {config: {"median_ms", "min_ms", "paired_ratio_vs_fp32"}}."""
    from tpamp import ops

    torch.set_num_threads(args.threads)
    n = int(args.numel)
    gen = torch.Generator().manual_seed(0)
    master = torch.randn(n, generator=gen) * 0.02
    grad = (torch.randn(n, generator=gen) * 1e-3).to(torch.bfloat16)
    states = {}
    for name in args.configs.split(","):
        cfg = CONFIGS[name]
        m_dtype = cfg.get("exp_avg_dtype", torch.float32)
        v_dtype = cfg.get("exp_avg_sq_dtype", torch.float32)
        if cfg.get("stochastic_rounding"):  # the bf16 param itself, stepped in place
            model, param = None, master.to(torch.bfloat16)
        elif cfg.get("store_param_remainders"):
            model, param = ops.split_remainders(master)
        else:
            model, param = master.to(torch.bfloat16), master.clone()
        st = {"param": param, "model": model, "step": torch.zeros(())}
        for key, dtype in (("m", m_dtype), ("v", v_dtype)):
            st[key] = torch.zeros(n, dtype=dtype)
            st[key + "_scales"] = (torch.zeros(ops.moment_blocks(n))
                                   if dtype in (torch.float8_e4m3fn, torch.uint8) else None)
        states[name] = st

    def step(st):
        sr = st["model"] is None
        ops.fused_adam_step_([st["param"]], [grad], [st["m"]], [st["v"]], [st["step"]],
                             model_params=None if sr else [st["model"]],
                             stochastic_rounding=[(12345, 0)] if sr else None,
                             lr=1e-4, beta1=0.9, beta2=0.95,
                             eps=1e-8, weight_decay=0.1, decoupled_weight_decay=True,
                             exp_avg_scales=[st["m_scales"]], exp_avg_sq_scales=[st["v_scales"]])

    times = {name: [] for name in states}
    for r in range(args.warmup + args.reps):
        for name, st in states.items():
            t0 = time.perf_counter()
            step(st)
            if r >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    out = {}
    for name, ts in times.items():
        ratio = (statistics.median(a / b for a, b in zip(ts, times["fp32"]))
                 if "fp32" in times else None)
        out[name] = {"median_ms": statistics.median(ts) * 1e3, "min_ms": min(ts) * 1e3,
                     "paired_ratio_vs_fp32": ratio}
    return out


def _print_table(title, out, with_bytes):
    """One result table: per configuration (state bytes/param,) median, min, paired x fp32."""
    print(title)
    digits = 1 if with_bytes else 2
    head = f"  {'config':<9}" + (f" {'state B/param':>13}" if with_bytes else "")
    print(f"{head} {'median ms':>10} {'min ms':>8} {'x fp32':>7}")
    for name, r in out.items():
        ratio = r["paired_ratio_vs_fp32"]
        cells = f"  {name:<9}" + (f" {r['bytes_per_param']:>13.3f}" if with_bytes else "")
        print(f"{cells} {r['median_ms']:>10.{digits}f} {r['min_ms']:>8.{digits}f} "
              f"{ratio if ratio is not None else float('nan'):>7.2f}")


def main(argv=None):
    args = parse_args(argv)
    results = {}
    if args.kernel:
        results["kernel"] = _kernel_bench(args)
        _print_table(f"kernel: fused_adam_step_ on {int(args.numel):,} bf16 params, "
                     f"{args.threads} thread(s)",
                     results["kernel"], with_bytes=False)
    dps = [] if args.kernel else [int(x) for x in args.dps.split(",")]
    ctx = mp.get_context("fork")
    for d in dps:
        queue = ctx.SimpleQueue()
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, d, port, args, queue)) for r in range(d)]
        for p in procs:
            p.start()
        out = queue.get()
        for p in procs:
            p.join(timeout=600)
            if p.exitcode != 0:
                raise SystemExit(f"rank exited with {p.exitcode}")
        results[d] = out
        _print_table(f"DP {d}: N = {int(args.numel):,} bf16 params per replica, rank 0, "
                     f"{args.threads} thread(s) per rank", out,
                     with_bytes=True)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "load_avg": os.getloadavg(), "torch": torch.__version__, "args": vars(args),
    }
    print(f"load average after: {meta['load_avg']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
