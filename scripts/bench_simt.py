"""Throughput of the CUDA launchers under the SIMT emulator (torch.ops.tpamp_simt.*, module
tpamp._C_simt or a sanitizer variant), next to the CPU twin, on one gradient list; medians of
interleaved rounds. Test infrastructure cost, not a kernel benchmark: it says how large the inputs
of tests/test_simt*.py can be.

    TPAMP_BUILD_SIMT=1 pip install --no-build-isolation -e .
    python scripts/bench_simt.py [--numel 1048576] [--rounds 5] [--variant thread]

(a sanitizer variant needs its runtime preloaded, see csrc/README.md)."""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from tpamp import _ext


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=1 << 20, help="elements in the list (fp16)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variant", default=None, help="'' (default), thread or address")
    args = ap.parse_args()
    simt = _ext.load_simt(args.variant)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    sizes = [args.numel // 4, args.numel // 2, args.numel // 4]
    grads = [torch.randn(n, generator=g).half() for n in sizes]
    scale = torch.tensor([0.5])
    mask = [True] * len(grads)
    params = [torch.randn(n, generator=g) for n in sizes]
    state = [[torch.zeros(n) for n in sizes] for _ in range(2)]
    steps = [torch.zeros(1) for _ in sizes]

    def stats(ops):
        outs = [torch.empty(n) for n in sizes]
        ops.grad_stats_out(grads, scale, mask, True, True, out=outs)

    def adam(ops):
        ops.fused_adam_step_(params, state[0], state[1], steps, [], grads, scale, None, None,
                             1e-3, 0.9, 0.999, 1e-8, 0.0, True, False, [], [])

    for order in ("forward", "random"):
        os.environ["TPAMP_SIMT_ORDER"] = order
        for name, fn in (("grad_stats_out", stats), ("fused_adam_step_", adam)):
            times = {"simt": [], "cpu": []}
            for _ in range(args.rounds):
                for key, ops in (("simt", simt), ("cpu", torch.ops.tpamp)):
                    t0 = time.perf_counter()
                    fn(ops)
                    times[key].append(time.perf_counter() - t0)
            s, c = statistics.median(times["simt"]), statistics.median(times["cpu"])
            print(f"{name:17s} order={order:7s} {args.numel} elements: emulated "
                  f"{args.numel / s / 1e6:7.1f} M/s ({s * 1e3:8.1f} ms), CPU twin (1 thread) "
                  f"{args.numel / c / 1e6:7.1f} M/s; ratio {s / c:6.1f}x")


if __name__ == "__main__":
    main()
