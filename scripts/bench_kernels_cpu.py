"""Benchmark tpamp's CPU kernels (tpamp._C_cpu_*): the grad-statistics pass against a copy.

The grad-statistics pass of a mixed-precision step -- fp16 grads -> fp32 main grads multiplied
by the inverse loss scale, with found_inf, the L2 norm statistic (sum of squares) over a norm
mask and the zero count -- over the gradients of a GPT-style model (default: 196 tensors, 102M
fp16 elements), timed side by side with a plain ``out.copy_(grad)`` of the same tensors (the
same bytes read and written), and with tpamp.ops' PyTorch path (several passes).

Method: one warm-up round, then --iters rounds; each round runs every case once, in an order
that alternates between rounds (interleaved, so drift and other load hit all cases alike). The
reported figures are medians over rounds of each case's time and of the per-round ratio
case / copy (paired). Target (set when the fused pass was written): fused pass <= 1.3x the copy.

    python scripts/bench_kernels_cpu.py [--iters 15] [--threads N] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import counts_toward_norm, transformer_shapes  # noqa: E402

import tpamp  # noqa: E402
from tpamp import _ext, ops  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=704)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--iters", type=int, default=15, help="timed rounds (default 15)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--skip-fallback", action="store_true", help="do not time the PyTorch path")
    p.add_argument("--out", default=None, help="write the results as JSON to this path")
    return p.parse_args(argv)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main(argv=None):
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if not ops.extension_available("cpu"):
        sys.exit(f"bench_kernels_cpu: the CPU kernels are not available ({_ext.status()}); build "
                 "them with `pip install --no-build-isolation -e .`")
    shapes = transformer_shapes(args.layers, args.hidden, args.vocab, args.seq)
    g = torch.Generator().manual_seed(0)
    grads = []
    for _, shape in shapes:
        x = torch.randn(shape, generator=g)
        x[torch.rand(shape, generator=g) < 0.01] = 0.0
        grads.append(x.half())
        del x
    outs = [torch.empty(t.shape, dtype=torch.float32) for t in grads]
    mask = [counts_toward_norm(name) for name, _ in shapes]
    inv_scale = torch.tensor([2.0**-16])
    numel = sum(t.numel() for t in grads)
    kw = dict(out=outs, scale=inv_scale, norm_mask=mask, norm_type=2.0, count_zeros=True)

    def copy():
        for o, t in zip(outs, grads):
            o.copy_(t)

    def fused():
        ops.grad_stats(grads, **kw)

    def fallback():
        with ops.force_fallback():
            ops.grad_stats(grads, **kw)

    cases = {"copy_ fp16->fp32": copy, "grad_stats fused (tpamp._C_cpu)": fused}
    if not args.skip_fallback:
        cases["grad_stats PyTorch path"] = fallback
    names = list(cases)

    print(f"machine: {cpu_name()}, {os.cpu_count()} logical CPUs, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}, module {_ext.status()['cpu_module']}")
    print(f"grads: {len(grads)} fp16 tensors, {numel / 1e6:.1f}M elements "
          f"({numel * 2 / 2**20:.0f} MiB fp16 -> {numel * 4 / 2**20:.0f} MiB fp32)")
    t0 = time.time()
    for fn in cases.values():  # warm-up
        fn()
    times = {n: [] for n in names}
    for r in range(args.iters):
        order = names if r % 2 == 0 else names[::-1]
        for n in order:
            start = time.perf_counter()
            cases[n]()
            times[n].append((time.perf_counter() - start) * 1e3)
    base = names[0]
    rows = []
    for n in names:
        ratios = [a / b for a, b in zip(times[n], times[base])]
        rows.append(dict(name=n, median_ms=statistics.median(times[n]),
                         median_ratio_to_copy=statistics.median(ratios),
                         gbps=numel * 6 / (statistics.median(times[n]) * 1e-3) / 1e9))
    print()
    print(f"{'case':<36} {'median ms':>10} {'GB/s':>7} {'x copy (paired median)':>24}")
    for r in rows:
        print(f"{r['name']:<36} {r['median_ms']:10.2f} {r['gbps']:7.2f} "
              f"{r['median_ratio_to_copy']:24.3f}")
    ratio = rows[1]["median_ratio_to_copy"]
    print(f"\nfused grad-stats pass: {ratio:.3f}x the copy (target <= 1.3x: "
          f"{'met' if ratio <= 1.3 else 'MISSED'}); {args.iters} interleaved rounds, "
          f"{time.time() - t0:.0f} s")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(dict(machine=cpu_name(), threads=torch.get_num_threads(),
                           torch=torch.__version__, tpamp=tpamp.__version__,
                           capability=torch.backends.cpu.get_cpu_capability(),
                           tensors=len(grads), numel=numel, args=vars(args), rows=rows,
                           times_ms=times), f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
