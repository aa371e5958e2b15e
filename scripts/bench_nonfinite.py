"""Benchmark the non-finite attribution (docs/spec.md section 10) and the logging step: what they cost.

A benchmark, not a test. Three measurements, each as interleaved rounds (A, B, ..., A, B, ...)
of the timed optimizer step only (grads re-attached outside the timed region), medians and the
median of per-round ratios ("paired": the two steps of one round run milliseconds apart, so slow
swings of the shared machine's load cancel):

1. ``pgn``: MixedPrecisionOptimizer(AdamW for-loop, DynamicGradScaler, clip 1.0) on a GPT-shaped
   fp16 model (default 20M elements), one-rank gloo group: the plain one-pass step, the one-pass
   step with ``param_grad_norms=True`` (the per-tensor norms from the same grad-stats pass; one
   more all-reduce), and the generic path with ``param_grad_norms=True`` (what the logging
   step cost before: fused_step=False).
2. ``clean-mpo``: the clean-step overhead of the attribution in MixedPrecisionOptimizer: the
   one-pass step as it is vs. the same step with ``_note_nonfinite`` replaced by a no-op (the
   attribution's only clean-step work is that call: a branch and an assignment).
3. ``clean-dist``: the same for DistributedOptimizer at DP=2 (two gloo processes on this
   machine; rank 0's times), plus the cost of a skipped step with the attribution (inf in one
   grad on rank 1: a per-param count of the local grads and one all_gather_object) against a
   skipped step without it.

Run::

    python scripts/bench_nonfinite.py --threads 2                # ~20M elements
    python scripts/bench_nonfinite.py --numel 2e6 --reps 5       # quick
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, os.pardir, "tests"))
from bench_step import LOSS_SCALE, make_fp16_grads, make_params, transformer_shapes  # noqa: E402

import tpamp  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=float, default=20e6)
    p.add_argument("--tensors", type=int, default=100)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--only", default="pgn,clean-mpo,clean-dist")
    return p.parse_args(argv)


def _mpo(shapes, fused_step=True, group=None):
    params = make_params(shapes, torch.float16, "cpu")
    opt = tpamp.MixedPrecisionOptimizer(
        torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, foreach=False),
        grad_scaler=tpamp.DynamicGradScaler(initial_scale=LOSS_SCALE, growth_interval=10**6),
        clip_grad=1.0, grad_stats_group=group, fused_step=fused_step,
        param_names=[(f"p{i}", p) for i, p in enumerate(params)],
    )
    return params, opt


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _rounds(approaches, reps, warmup):
    """approaches: {name: (prepare, step)}; returns {name: [seconds]} of the timed reps."""
    times = {k: [] for k in approaches}
    for r in range(warmup + reps):
        for name, (prepare, step) in approaches.items():
            prepare()
            t = _timed(step)
            if r >= warmup:
                times[name].append(t)
    return times


def _report(times, pairs):
    for name, ts in times.items():
        print(f"  {name:<34} median {1e3 * statistics.median(ts):8.1f} ms  min {1e3 * min(ts):8.1f} ms")
    for a, b in pairs:
        paired = statistics.median(x / y for x, y in zip(times[a], times[b]))
        ratio = statistics.median(times[a]) / statistics.median(times[b])
        print(f"  {a} / {b}: paired median {paired:.3f}x, of medians {ratio:.3f}x, "
              f"of minima {min(times[a]) / min(times[b]):.3f}x")


def bench_pgn(shapes, grads, args, group):
    params_a, plain = _mpo(shapes, group=group)
    params_b, fused_pgn = _mpo(shapes, group=group)
    params_c, generic_pgn = _mpo(shapes, fused_step=False, group=group)
    fused_pgn.track_param_grad_norms()
    generic_pgn.track_param_grad_norms()

    def attach(params, opt):
        def prepare():
            opt.zero_grad()
            for p, g in zip(params, grads):
                p.grad = g
        return prepare

    def check(res):
        assert res.update_successful

    times = _rounds({
        "plain one-pass step": (attach(params_a, plain), lambda: check(plain.step())),
        "one-pass, param_grad_norms=True": (
            attach(params_b, fused_pgn), lambda: check(fused_pgn.step(param_grad_norms=True))),
        "generic, param_grad_norms=True": (
            attach(params_c, generic_pgn), lambda: check(generic_pgn.step(param_grad_norms=True))),
    }, args.reps, args.warmup)
    print("param_grad_norms (the logging step):")
    _report(times, [("one-pass, param_grad_norms=True", "plain one-pass step"),
                    ("generic, param_grad_norms=True", "plain one-pass step")])


def bench_clean_mpo(shapes, grads, args, group):
    params_a, with_attr = _mpo(shapes, group=group)
    params_b, without = _mpo(shapes, group=group)
    without._note_nonfinite = lambda *a, **k: None  # the step minus the attribution

    def attach(params, opt):
        def prepare():
            opt.zero_grad()
            for p, g in zip(params, grads):
                p.grad = g
        return prepare

    times = _rounds({
        "one-pass step (attribution on)": (attach(params_a, with_attr), with_attr.step),
        "one-pass step (attribution off)": (attach(params_b, without), without.step),
    }, args.reps, args.warmup)
    print("clean-step overhead, MixedPrecisionOptimizer:")
    _report(times, [("one-pass step (attribution on)", "one-pass step (attribution off)")])


def _dist_worker(rank, world, shapes, args):
    torch.set_num_threads(max(1, args.threads // world))
    grads = make_fp16_grads(shapes, "cpu")
    bad = [g.clone() for g in grads]
    bad[len(bad) // 2].view(-1)[7] = float("inf")

    def make():
        params = make_params(shapes, torch.float16, "cpu")
        opt = tpamp.DistributedOptimizer(
            torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, foreach=False),
            grad_scaler=tpamp.DynamicGradScaler(initial_scale=LOSS_SCALE, growth_interval=10**6,
                                                hysteresis=10**6),
            clip_grad=1.0, data_parallel_group=dist.group.WORLD,
            param_names=[(f"p{i}", p) for i, p in enumerate(params)],
        )
        return params, opt

    (pa, on), (pb, off) = make(), make()
    off._note_nonfinite = lambda *a, **k: setattr(off, "last_nonfinite", [])

    def attach(params, opt, src):
        def prepare():
            opt.zero_grad()
            for p, g in zip(params, src):
                p.grad = g
            dist.barrier()
        return prepare

    clean = _rounds({
        "dist step (attribution on)": (attach(pa, on, grads), on.step),
        "dist step (attribution off)": (attach(pb, off, grads), off.step),
    }, args.reps, args.warmup)
    src = bad if rank == 1 else grads
    skipped = _rounds({
        "skipped dist step (attribution on)": (attach(pa, on, src), on.step),
        "skipped dist step (attribution off)": (attach(pb, off, src), off.step),
    }, args.reps, args.warmup)
    assert on.last_nonfinite and on.last_nonfinite[0].dp_rank == 1, on.last_nonfinite
    return clean, skipped


def bench_clean_dist(shapes, args):
    from dist_utils import run_workers

    (clean, skipped), _ = run_workers(_dist_worker, 2, shapes, args, timeout=1200)
    print("clean-step overhead, DistributedOptimizer DP=2 (rank 0):")
    _report(clean, [("dist step (attribution on)", "dist step (attribution off)")])
    print("skipped step, DistributedOptimizer DP=2 (rank 0; inf in one grad on DP rank 1):")
    _report(skipped, [("skipped dist step (attribution on)", "skipped dist step (attribution off)")])


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    shapes, hidden, layers, vocab = transformer_shapes(int(args.numel), args.tensors)
    numel = sum(torch.Size(s).numel() for s in shapes)
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC | "
          f"{platform.processor() or platform.machine()} | {os.cpu_count()} CPUs | torch "
          f"{torch.__version__} | {args.threads} threads | kernels "
          f"{'on' if tpamp.ops.extension_available() else 'off'} | load {os.getloadavg()[0]:.2f}")
    print(f"model: {numel / 1e6:.1f}M elements in {len(shapes)} tensors (hidden {hidden}, "
          f"{layers} layers) | {args.reps} rounds after {args.warmup} warm-up")
    only = set(args.only.split(","))
    group = None
    if only & {"pgn", "clean-mpo"}:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        from dist_utils import free_port

        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
        group = dist.new_group([0])
        grads = make_fp16_grads(shapes, "cpu")
        if "pgn" in only:
            bench_pgn(shapes, grads, args, group)
        if "clean-mpo" in only:
            bench_clean_mpo(shapes, grads, args, group)
        dist.destroy_process_group()
    if "clean-dist" in only:
        bench_clean_dist(shapes, args)
    print(f"load after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
