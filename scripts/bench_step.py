"""Benchmark one optimizer step: tpamp.MixedPrecisionOptimizer vs torch.amp vs a bare AdamW.

A benchmark, not a test. Three approaches step the same synthetic transformer-shaped model
(default about 100M elements in about 200 tensors) with the same gradients, interleaved
round-robin over repetitions (A, B, C, A, B, C, ...) so that machine noise hits all three alike:

  tpamp     fp16 model params, fp16 grads; tpamp.MixedPrecisionOptimizer(AdamW) with a
            DynamicGradScaler: grad copy fp16 -> fp32 main grads, unscale + found_inf, the
            all-reduce over the grad-stats group (a one-rank process group, so the collective
            path runs), scaler update, grad norm, clip, zero count (--log-num-zeros), inner
            AdamW step, copy main params -> fp16 model params.
  torch.amp fp32 params, fp32 grads (as torch.amp users have them): torch.amp.GradScaler on the
            device + scaler.unscale_ + torch.nn.utils.clip_grad_norm_ + scaler.step(AdamW) +
            scaler.update(). No zero count, no collective (single process).
  bare      fp32 params, fp32 grads, AdamW.step() alone (the floor).

All AdamW instances use the default (foreach) implementation. Only the step itself is timed
(with a device synchronize around it on CUDA); restoring the gradients the step consumed
(tpamp: re-attach the pre-made fp16 grads, no copy needed; torch.amp: copy them back into the
fp32 .grad buffers, which unscale_/clip modify in place) happens outside the timed region.

Run::

    python scripts/bench_step.py --threads 2                       # ~100M elements, 200 tensors
    python scripts/bench_step.py --numel 5e6 --tensors 40 --reps 5 # quick
    python scripts/bench_step.py --device cuda --json out.json

Prints the machine (CPU model, threads, torch version, load average before and after), a table
(median, min, mean, max wall time of the timed reps per approach, median process CPU time), the
ratios tpamp/torch.amp and tpamp/bare-AdamW and the analytic persistent memory per approach.
Ratios are given four ways: of the medians, of the minima, the median over rounds of the
per-round ratio ("paired": the approaches of one round run seconds apart, so slow swings of the
machine's load cancel), and of the median CPU times. On a shared machine the minima and the
paired ratios are the figures to trust; on a quiet one all four agree.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
import tpamp  # noqa: E402
from tpamp import ops  # noqa: E402

LOSS_SCALE = 2.0**16
GRAD_STD = 1e-3  # gradient units; the fp16 grads hold GRAD_STD * LOSS_SCALE * N(0, 1)


# -- synthetic model ------------------------------------------------------------------------


def transformer_shapes(numel: int, tensors: int):
    """Shapes of a GPT-like model with about ``numel`` elements in about ``tensors`` tensors.

    Per layer 12 tensors (QKV weight/bias, attention proj weight/bias, two LayerNorms' weight and
    bias, MLP fc1 weight/bias, fc2 weight/bias: ~12 h^2 elements), plus word embedding (about
    20% of the elements), position embedding (1024 x h) and the final LayerNorm.
    Returns (shapes, hidden, layers, vocab).
    """
    layers = max(1, (tensors - 4) // 12)
    hidden = math.sqrt(0.8 * numel / (12 * layers))
    hidden = max(8, int(round(hidden / 8)) * 8 if hidden >= 64 else int(round(hidden)))
    vocab = max(16, int(round(0.2 * numel / hidden)))
    h = hidden
    shapes = [(vocab, h), (1024, h)]
    for _ in range(layers):
        shapes += [
            (h,), (h,),  # input LayerNorm
            (3 * h, h), (3 * h,),  # QKV
            (h, h), (h,),  # attention output projection
            (h,), (h,),  # post-attention LayerNorm
            (4 * h, h), (4 * h,),  # MLP fc1
            (h, 4 * h), (h,),  # MLP fc2
        ]
    shapes += [(h,), (h,)]  # final LayerNorm
    return shapes, hidden, layers, vocab


def make_fp16_grads(shapes, device, seed=0):
    """Pre-made scaled fp16 grads (finite; a few exact zeros as in real grads)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    for s in shapes:
        t = torch.randn(s, generator=g, dtype=torch.float32)
        t.mul_(GRAD_STD * LOSS_SCALE)
        out.append(t.to(device=device, dtype=torch.float16))
    # word embedding: rows of tokens absent from the batch have zero grad
    emb = out[0]
    emb[: emb.shape[0] // 10].zero_()
    return out


def make_params(shapes, dtype, device, seed=1):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [
        torch.nn.Parameter((torch.randn(s, generator=g) * 0.02).to(device=device, dtype=dtype))
        for s in shapes
    ]


# -- approaches ---------------------------------------------------------------------------------


class TpampBench:
    name = "tpamp"

    def __init__(self, shapes, fp16_grads, device, args, group):
        self.params = make_params(shapes, torch.float16, device)
        self.fp16_grads = fp16_grads
        inner = torch.optim.AdamW(self.params, lr=1e-4, weight_decay=0.01)
        self.opt = tpamp.MixedPrecisionOptimizer(
            inner,
            grad_scaler=tpamp.DynamicGradScaler(
                initial_scale=LOSS_SCALE, growth_interval=10**6, device=device
            ),
            clip_grad=args.clip_grad,
            log_num_zeros_in_grad=args.log_num_zeros,
            grad_stats_group=group,
        )
        self.last = None

    def prepare(self):
        self.opt.zero_grad()
        # step() only reads the model grads (copies them into fresh fp32 main grads), so the
        # pre-made tensors can be re-attached as they are.
        for p, g in zip(self.params, self.fp16_grads):
            p.grad = g

    def step(self):
        self.last = self.opt.step()
        if not self.last.update_successful:
            raise RuntimeError("tpamp skipped the step (inf/nan in the synthetic grads?)")

    def persistent_bytes(self, n):
        # fp16 params + fp16 grads (freed during the step) + fp32 main params + fp32 main grads
        # + AdamW exp_avg, exp_avg_sq
        return {"params": 2 * n + 4 * n, "grads": 2 * n + 4 * n, "optimizer_state": 8 * n}


class TorchAmpBench:
    name = "torch.amp"

    def __init__(self, shapes, fp16_grads, device, args):
        self.params = make_params(shapes, torch.float32, device)
        self.fp16_grads = fp16_grads
        for p in self.params:
            p.grad = torch.empty_like(p)
        self.opt = torch.optim.AdamW(self.params, lr=1e-4, weight_decay=0.01)
        self.scaler = torch.amp.GradScaler(device.type, init_scale=LOSS_SCALE, growth_interval=10**6)
        # GradScaler creates its scale lazily in scale(); do it once here as a loss would.
        self.scaler.scale(torch.ones((), device=device))
        self.clip = args.clip_grad

    def prepare(self):
        # unscale_ and the clip modify .grad in place: restore the scaled grads (same values
        # as tpamp's, cast fp16 -> fp32).
        torch._foreach_copy_([p.grad for p in self.params], self.fp16_grads)

    def step(self):
        self.scaler.unscale_(self.opt)
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip, foreach=True)
        self.scaler.step(self.opt)
        self.scaler.update()

    def persistent_bytes(self, n):
        return {"params": 4 * n, "grads": 4 * n, "optimizer_state": 8 * n}


class BareAdamWBench:
    name = "bare AdamW"

    def __init__(self, shapes, fp16_grads, device, args):
        self.params = make_params(shapes, torch.float32, device)
        for p, g in zip(self.params, fp16_grads):
            p.grad = g.float().mul_(1.0 / LOSS_SCALE)  # AdamW does not modify grads
        self.opt = torch.optim.AdamW(self.params, lr=1e-4, weight_decay=0.01)

    def prepare(self):
        pass

    def step(self):
        self.opt.step()

    def persistent_bytes(self, n):
        return {"params": 4 * n, "grads": 4 * n, "optimizer_state": 8 * n}


# -- machine ----------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def loadavg():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fmt_bytes(b):
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"


# -- main -------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=float, default=100e6, help="about how many elements (default 1e8)")
    p.add_argument("--tensors", type=int, default=200, help="about how many tensors (default 200)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--backend", default=None, help="process-group backend (default gloo on cpu, nccl on cuda)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--log-num-zeros", action=argparse.BooleanOptionalAction, default=True,
                   help="tpamp counts zeros in the grads (default on)")
    p.add_argument("--warmup", type=int, default=5, help="untimed reps per approach (default 5)")
    p.add_argument("--reps", type=int, default=20, help="timed reps per approach (default 20)")
    p.add_argument("--only", default="tpamp,torch.amp,bare",
                   help="comma list of approaches to run (tpamp, torch.amp, bare)")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit("--device cuda: CUDA is not available")
        device = torch.device("cuda", torch.cuda.current_device())
    backend = args.backend or ("nccl" if device.type == "cuda" else "gloo")
    load_before = loadavg()

    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    group = dist.group.WORLD
    try:
        shapes, hidden, layers, vocab = transformer_shapes(int(args.numel), args.tensors)
        n = sum(math.prod(s) for s in shapes)
        machine = {
            "cpu": cpu_model(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            # tpamp._C is a CUDA extension: only asked about on CUDA
            "tpamp_extension": ops.extension_available(device),
        }
        print(f"machine: {machine['cpu']} ({machine['cpu_count']} logical CPUs), torch {machine['torch']}, "
              f"{machine['torch_threads']} threads, device {machine['device']}"
              + (f", tpamp._C {'loaded' if machine['tpamp_extension'] else 'not built'}"
                 if device.type == "cuda" else ""))
        print(f"load average before: {load_before}")
        print(f"model: {n:,} elements in {len(shapes)} tensors (hidden {hidden}, {layers} layers, "
              f"vocab {vocab}); clip_grad {args.clip_grad}, log_num_zeros {args.log_num_zeros}, "
              f"{args.warmup} warm-up + {args.reps} timed reps each, interleaved; process group "
              f"{backend} world_size 1")

        fp16_grads = make_fp16_grads(shapes, device)
        wanted = [w.strip() for w in args.only.split(",") if w.strip()]
        benches = []
        for w in wanted:
            if w == "tpamp":
                benches.append(TpampBench(shapes, fp16_grads, device, args, group))
            elif w in ("torch.amp", "amp"):
                benches.append(TorchAmpBench(shapes, fp16_grads, device, args))
            elif w in ("bare", "adamw"):
                benches.append(BareAdamWBench(shapes, fp16_grads, device, args))
            else:
                sys.exit(f"--only: unknown approach {w!r}")

        times = {b.name: [] for b in benches}
        cpu_times = {b.name: [] for b in benches}
        t_start = time.perf_counter()
        for rep in range(args.warmup + args.reps):
            for b in benches:
                b.prepare()
                sync(device)
                c0 = time.process_time()
                t0 = time.perf_counter()
                b.step()
                sync(device)
                dt = time.perf_counter() - t0
                dc = time.process_time() - c0
                if rep >= args.warmup:
                    times[b.name].append(dt)
                    cpu_times[b.name].append(dc)
            if rep == args.warmup - 1 or rep == args.warmup + args.reps - 1 or (rep + 1) % 5 == 0:
                print(f"  rep {rep + 1}/{args.warmup + args.reps} "
                      f"({time.perf_counter() - t_start:.0f} s)", flush=True)
        load_after = loadavg()

        rows = {}
        for b in benches:
            ts = times[b.name]
            rows[b.name] = {
                "median_ms": statistics.median(ts) * 1e3,
                "min_ms": min(ts) * 1e3,
                "mean_ms": statistics.fmean(ts) * 1e3,
                "max_ms": max(ts) * 1e3,
                "times_ms": [t * 1e3 for t in ts],
                # CPU time of the process (all threads) during the step
                "cpu_median_ms": statistics.median(cpu_times[b.name]) * 1e3,
                "cpu_times_ms": [t * 1e3 for t in cpu_times[b.name]],
                "memory_bytes": b.persistent_bytes(n),
            }
        print()
        print(f"{'approach':<12} {'median ms':>10} {'min ms':>10} {'mean ms':>10} {'max ms':>10}"
              f" {'CPU med ms':>11}  {'params+grads+state':>18}")
        for name, r in rows.items():
            mem = sum(r["memory_bytes"].values())
            print(f"{name:<12} {r['median_ms']:>10.1f} {r['min_ms']:>10.1f} {r['mean_ms']:>10.1f} "
                  f"{r['max_ms']:>10.1f} {r['cpu_median_ms']:>11.1f}  {fmt_bytes(mem):>18}")
        print("(params+grads+state: analytic persistent bytes; CPU: process CPU time, all threads)")
        ratios = {}
        if "tpamp" in rows:
            for other in ("torch.amp", "bare AdamW"):
                if other in rows:
                    key = f"tpamp/{other}"
                    # paired: the two approaches' times in the same round (seconds apart), so
                    # slow swings of the machine's load cancel; the median over rounds
                    paired = [a / b for a, b in zip(times["tpamp"], times[other])]
                    ratios[key] = {
                        "median": rows["tpamp"]["median_ms"] / rows[other]["median_ms"],
                        "min": rows["tpamp"]["min_ms"] / rows[other]["min_ms"],
                        "paired_median": statistics.median(paired),
                        "cpu_median": rows["tpamp"]["cpu_median_ms"] / rows[other]["cpu_median_ms"],
                    }
                    r = ratios[key]
                    print(f"{key:<18} median {r['median']:.2f}x   min {r['min']:.2f}x   "
                          f"paired median {r['paired_median']:.2f}x   CPU-time median {r['cpu_median']:.2f}x")
        if "tpamp" in rows:
            last = benches[[b.name for b in benches].index("tpamp")].last
            print(f"tpamp last step: grad_norm {last.grad_norm:.4g}, num_zeros {last.num_zeros_in_grad}")
        print(f"load average after: {load_after}")

        if args.json:
            out = {
                "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
                "machine": machine,
                "load_average_before": load_before,
                "load_average_after": load_after,
                "model": {"numel": n, "tensors": len(shapes), "hidden": hidden, "layers": layers,
                          "vocab": vocab},
                "settings": {"device": args.device, "backend": backend, "clip_grad": args.clip_grad,
                             "log_num_zeros": args.log_num_zeros, "warmup": args.warmup,
                             "reps": args.reps},
                "results": rows,
                "ratios": ratios,
            }
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
            print(f"wrote {args.json}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
