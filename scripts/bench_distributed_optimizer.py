"""Benchmark tpamp.DistributedOptimizer: fp32 state bytes per rank, and the DP step time.

A benchmark, not a test. Ranks are fork-started processes on one machine with a gloo process
group (tcp://127.0.0.1), one thread each.

1. Memory: for DP = 1, 2, 4 (``--dps``), every rank builds the same fp16 model (``--numel``
   elements in ``--tensors`` tensors of odd sizes), takes one AdamW step with
   ``tpamp.DistributedOptimizer`` and reports the bytes of fp32 state it holds (main params +
   every tensor of the inner optimizer's state, counted from ``optimizer.param_groups`` and
   ``optimizer.state``); then the same for ``tpamp.MixedPrecisionOptimizer`` (every rank holds
   all of it). The target set for the distributed optimizer at DP=d: <= 1.05 x 12 N / d + 1 MiB for AdamW.
2. Step time at DP=2 (``--time-dp``): the DP gradient reduction plus the optimizer step, two
   approaches interleaved round-robin over ``--reps`` rounds on the same fp16 grads:

     dist  DistributedOptimizer.step(): grads -> fp32 bucket buffers, reduce-scatter (mean),
           unscale + found_inf + norm over the shard, clip, AdamW on the shard, cast, all-gather
           of the fp16 params.
     mpo   the hand all-reduce of scripts/train_gpt.py (one flat fp32 buffer, all_reduce SUM,
           divide, copy back) + MixedPrecisionOptimizer.step() (full AdamW on every rank).

     det   (with ``--deterministic``) DistributedOptimizer(deterministic_grad_reduction=True):
           the DP-rank-ordered reduce-scatter (one all-to-all and an ordered sum); its cost is
           the paired median det/dist.
     base  (with ``--baseline REV``) DistributedOptimizer as tpamp/distributed_optimizer.py was
           at git revision REV (loaded from ``git show``, the rest of tpamp from this tree),
           for a before/after comparison in the same run.

   Both with a DynamicGradScaler, clip_grad=1.0 and the zero count. Only reduce + step is
   timed; re-attaching the pre-made fp16 grads happens outside. Rank 0 reports medians and the
   paired median (median over rounds of the per-round ratio dist/mpo, and base/mpo).

Run::

    python scripts/bench_distributed_optimizer.py                      # defaults below
    python scripts/bench_distributed_optimizer.py --numel 2e6 --reps 10 --json out.json
    python scripts/bench_distributed_optimizer.py --numel 2e7 --dps 2 --baseline main
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

LOSS_SCALE = 2.0**12


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=float, default=8e6, help="model elements")
    p.add_argument("--tensors", type=int, default=48)
    p.add_argument("--dps", default="1,2,4", help="DP sizes for the memory table")
    p.add_argument("--time-dp", type=int, default=2)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--bucket-size", type=float, default=None, help="elements per bucket")
    p.add_argument("--baseline", default=None, metavar="REV",
                   help="also time DistributedOptimizer as of this git revision, interleaved")
    p.add_argument("--json", default=None)
    p.add_argument("--deterministic", action="store_true",
                   help="also time deterministic_grad_reduction=True ('det'; paired det/dist)")
    return p.parse_args(argv)


def model_shapes(numel: int, tensors: int):
    """Odd sizes (shard boundaries fall inside params), summing to about ``numel``."""
    per = max(1, numel // tensors)
    shapes = []
    for i in range(tensors):
        rows = 3 + 2 * (i % 7)
        shapes.append((rows, max(1, per // rows) | 1))
    return shapes


BASELINE = None  # the module of --baseline's DistributedOptimizer
DETERMINISTIC = False  # --deterministic: also time deterministic_grad_reduction=True


def load_baseline(rev: str):
    """tpamp/distributed_optimizer.py at git revision ``rev``, imported as a separate module."""
    import importlib.util
    import subprocess
    import tempfile

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
    src = subprocess.run(["git", "-C", root, "show", f"{rev}:tpamp/distributed_optimizer.py"],
                         check=True, capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "baseline_distributed_optimizer.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("baseline_distributed_optimizer", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    try:
        spec.loader.exec_module(mod)
    except ImportError as e:  # e.g. a private helper that has moved since REV
        raise SystemExit(
            f"--baseline {rev}: tpamp/distributed_optimizer.py at {rev} does not import against "
            f"this tree's tpamp ({e}). Only that one file is taken from {rev}; for an older "
            f"revision run this script from a worktree of it (`git worktree add DIR {rev}`, "
            f"build there) and compare the two reports, which are then not paired."
        ) from e
    return mod


def build(kind, shapes, dp_group, bucket_size):
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(s, generator=g) * 0.02).half()) for s in shapes]
    groups = [{"params": [p for i, p in enumerate(params) if i % 4], "weight_decay": 0.1},
              {"params": [p for i, p in enumerate(params) if not i % 4], "weight_decay": 0.0}]
    adamw = torch.optim.AdamW(groups, lr=1e-4)
    kw = dict(grad_scaler=tpamp.DynamicGradScaler(initial_scale=LOSS_SCALE), clip_grad=1.0,
              log_num_zeros_in_grad=True)
    if kind == "det":
        kw["deterministic_grad_reduction"] = True
    if kind in ("dist", "base", "det"):
        cls = BASELINE.DistributedOptimizer if kind == "base" else tpamp.DistributedOptimizer
        opt = cls(adamw, data_parallel_group=dp_group, bucket_size=bucket_size, **kw)
    else:
        opt = tpamp.MixedPrecisionOptimizer(adamw, grad_stats_group=None, **kw)
    return params, opt


def make_grads(params, rank):
    g = torch.Generator().manual_seed(1 + rank)
    return [(torch.randn(p.shape, generator=g) * 1e-3 * LOSS_SCALE).half() for p in params]


def fp32_state_bytes(opt) -> int:
    """Main params + every non-scalar state tensor of the inner optimizer, in bytes."""
    inner = opt.optimizer
    total = sum(p.numel() * p.element_size() for g in inner.param_groups for p in g["params"])
    for st in inner.state.values():
        total += sum(v.numel() * v.element_size() for v in st.values()
                     if torch.is_tensor(v) and v.dim() > 0)
    return total


def hand_all_reduce(params, group, dp):
    """scripts/train_gpt.py's DP all-reduce: one flat fp32 buffer, SUM, divide, copy back."""
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dp
    for g, new in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(new.view_as(g))


def memory_worker(rank, world, shapes, bucket_size):
    n = sum(torch.Size(s).numel() for s in shapes)
    out = {}
    for kind in ("dist", "mpo"):
        params, opt = build(kind, shapes, dist.group.WORLD, bucket_size)
        for p, g in zip(params, make_grads(params, rank)):
            p.grad = g
        if kind == "mpo":
            hand_all_reduce(params, dist.group.WORLD, world)
        assert opt.step().update_successful
        out[kind] = fp32_state_bytes(opt)
        del params, opt
    return {"dp": world, "numel": n, **out}


def time_worker(rank, world, shapes, bucket_size, reps, warmup):
    kinds = ("dist", "mpo") + (("base",) if BASELINE is not None else ()) + (
        ("det",) if DETERMINISTIC else ())
    built = {k: build(k, shapes, dist.group.WORLD, bucket_size) for k in kinds}
    grads = make_grads(built["dist"][0], rank)
    times = {k: [] for k in built}
    for it in range(warmup + reps):
        for kind, (params, opt) in built.items():
            opt.zero_grad()
            for p, g in zip(params, grads):
                p.grad = g.clone() if kind == "mpo" else g  # the hand all-reduce writes in place
            dist.barrier()
            t0 = time.perf_counter()
            if kind == "mpo":
                hand_all_reduce(params, dist.group.WORLD, world)
            ok = opt.step().update_successful
            dt = time.perf_counter() - t0
            assert ok
            if it >= warmup:
                times[kind].append(dt)
    if "base" in built:  # the same grads, the same number of steps: the same model params?
        times["same_params_as_base"] = all(
            torch.equal(a, b) for a, b in zip(built["dist"][0], built["base"][0]))
    return times


def _worker(rank, world, port, fn, args, queue):
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=600))
        queue.put((rank, fn(rank, world, *args)))
    except BaseException as e:  # noqa: BLE001 -- reported by the parent
        queue.put((rank, e))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os._exit(0)


def launch(fn, world, *args):
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get() for _ in range(world))
    for p in procs:
        p.join()
    for r in range(world):
        if isinstance(results[r], BaseException):
            raise RuntimeError(f"rank {r} failed") from results[r]
    return [results[r] for r in range(world)]


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} logical CPUs, {platform.system()}, Python "
            f"{platform.python_version()}, torch {torch.__version__}")


def main(argv=None):
    args = parse_args(argv)
    global BASELINE, DETERMINISTIC
    DETERMINISTIC = args.deterministic  # before the fork: every rank has it
    if args.baseline:
        BASELINE = load_baseline(args.baseline)  # before the fork: every rank has it
    shapes = model_shapes(int(args.numel), args.tensors)
    bucket = int(args.bucket_size) if args.bucket_size else None
    n = sum(torch.Size(s).numel() for s in shapes)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    report = {"machine": machine(), "date": now,
              "command": " ".join([os.path.basename(sys.executable)] + sys.argv), "numel": n,
              "tensors": len(shapes), "load_before": os.getloadavg()[0]}
    print(f"{report['machine']}\nmodel: {n:,} fp16 elements in {len(shapes)} tensors; AdamW",
          flush=True)

    print("\nfp32 state per rank (main params + AdamW state), bytes:")
    print(f"{'DP':>3} | {'MixedPrecisionOptimizer':>24} | {'DistributedOptimizer':>21} | "
          f"{'target 1.05*12N/d+1MiB':>22} | ratio to 12N/d")
    rows = []
    for dp in (int(d) for d in args.dps.split(",")):
        res = launch(memory_worker, dp, shapes, bucket)
        worst = max(r["dist"] for r in res)
        target = 1.05 * 12 * n / dp + 2**20
        rows.append({"dp": dp, "mpo": res[0]["mpo"], "dist_max": worst, "target": target})
        print(f"{dp:>3} | {res[0]['mpo']:>24,} | {worst:>21,} | {int(target):>22,} | "
              f"{worst / (12 * n / dp):.4f}", flush=True)
    report["memory"] = rows

    times = launch(time_worker, args.time_dp, shapes, bucket, args.reps, args.warmup)[0]
    same = times.pop("same_params_as_base", None)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    paired = statistics.median(a / b for a, b in zip(times["dist"], times["mpo"]))
    if "base" in times:
        report["paired_base_over_mpo"] = statistics.median(
            a / b for a, b in zip(times["base"], times["mpo"]))
        report["paired_dist_over_base"] = statistics.median(
            a / b for a, b in zip(times["dist"], times["base"]))
        report["baseline"] = args.baseline
        report["same_params_as_base"] = same
    report.update(time_dp=args.time_dp, reps=args.reps, median_ms=med,
                  min_ms={k: min(v) * 1e3 for k, v in times.items()}, paired_dist_over_mpo=paired,
                  load_after=os.getloadavg()[0])
    print(f"\nstep time at DP={args.time_dp} (gloo, 1 thread per rank), {args.reps} interleaved "
          f"rounds, rank 0:")
    print(f"  DistributedOptimizer.step (reduce-scatter + shard step + all-gather): median "
          f"{med['dist']:.1f} ms, min {report['min_ms']['dist']:.1f} ms")
    print(f"  hand all-reduce + MixedPrecisionOptimizer.step:                      median "
          f"{med['mpo']:.1f} ms, min {report['min_ms']['mpo']:.1f} ms")
    if "base" in times:
        print(f"  DistributedOptimizer.step as of {args.baseline}:{' ' * 30}median "
              f"{med['base']:.1f} ms, min {report['min_ms']['base']:.1f} ms")
        print(f"  paired median base/mpo: {report['paired_base_over_mpo']:.3f}x, dist/base: "
              f"{report['paired_dist_over_base']:.3f}x; model params bit-identical to "
              f"{args.baseline}'s after the run (rank 0): {same}")
    if "det" in times:
        report["paired_det_over_dist"] = statistics.median(
            a / b for a, b in zip(times["det"], times["dist"]))
        print(f"  DistributedOptimizer.step, deterministic_grad_reduction=True:        median "
              f"{med['det']:.1f} ms, min {report['min_ms']['det']:.1f} ms; paired det/dist: "
              f"{report['paired_det_over_dist']:.3f}x")
    print(f"  paired median dist/mpo: {paired:.3f}x   (load {report['load_before']:.2f} -> "
          f"{report['load_after']:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
