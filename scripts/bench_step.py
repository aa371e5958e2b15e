"""Benchmark one optimizer step: tpamp.MixedPrecisionOptimizer vs megatron-core vs torch.amp vs
a bare AdamW.

A benchmark, not a test. The approaches step the same synthetic transformer-shaped model
(default about 100M elements in about 200 tensors) with the same gradients, interleaved
round-robin over repetitions (A, B, C, A, B, C, ...) so that machine noise hits all alike.
Every AdamW names its implementation (torch 2.13's default on CPU is the for-loop, not foreach):

  tpamp-fused       fp16 model params, fp16 grads; tpamp.MixedPrecisionOptimizer(AdamW for-loop)
                    with a DynamicGradScaler, on its default one-pass path: a read-only pass over
                    the fp16 grads (found_inf, norm, zeros), the all-reduce over the grad-stats
                    group (a one-rank process group, so the collective path runs), scaler update,
                    then tpamp.ops.fused_adam_step_: grad x 1/scale x clip coefficient, AdamW on
                    the fp32 main params and state, fp16 model params written, in one pass.
  tpamp-fused-in-fused  the same wrapping AdamW(fused=True) (the inner step() is not called on
                    the one-pass path; this checks that the inner implementation does not matter).
  tpamp-generic     the same wrapper with fused_step=False around AdamW(fused=True): fp32 main
                    grads, clip pass, the inner optimizer's step, copy to the model params.
  megatron          megatron-core's Float16OptimizerWithFloat16Params around AdamW(fused=True),
                    its DynamicGradScaler, clip and zero count, on CPU tensors via
                    scripts/megatron_cpu.py (a TorchFunctionMode maps device "cuda" to cpu; its
                    PyTorch fallbacks of multi_tensor_applier run). Needs megatron-core
                    installed (a separate venv); skipped with a note otherwise.
  torch.amp         fp32 params, fp32 grads (as torch.amp users have them): torch.amp.GradScaler
                    + scaler.unscale_ + clip_grad_norm_ + scaler.step(AdamW(fused=True)) +
                    scaler.update(). No zero count, no collective (single process).
  bare              fp32 params, fp32 grads, AdamW(fused=True).step() alone (the floor).

Only the step itself is timed
(with a device synchronize around it on CUDA); restoring the gradients the step consumed
(tpamp: re-attach the pre-made fp16 grads, no copy needed; torch.amp: copy them back into the
fp32 .grad buffers, which unscale_/clip modify in place) happens outside the timed region.

Run::

    python scripts/bench_step.py --threads 2                       # ~100M elements, 200 tensors
    python scripts/bench_step.py --numel 5e6 --tensors 40 --reps 5 # quick
    python scripts/bench_step.py --device cuda --json out.json

Prints the machine (CPU model, threads, torch version, load average before and after), a table
(median, min, mean, max wall time of the timed reps per approach, median process CPU time), the
ratios of each tpamp approach to bare, megatron and torch.amp, and the analytic memory per
approach (bytes per param held at the step).
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
    """tpamp.MixedPrecisionOptimizer around AdamW; ``fused_inner``: AdamW(fused=True), else the
    for-loop; ``fused_step``: the wrapper's one-pass path (default) or the generic one."""

    def __init__(self, name, shapes, fp16_grads, device, args, group, *, fused_inner, fused_step):
        self.name = name
        self.fused_step = fused_step
        self.params = make_params(shapes, torch.float16, device)
        self.fp16_grads = fp16_grads
        impl = dict(fused=True) if fused_inner else dict(foreach=False)
        inner = torch.optim.AdamW(self.params, lr=1e-4, weight_decay=0.01, **impl)
        self.opt = tpamp.MixedPrecisionOptimizer(
            inner,
            grad_scaler=tpamp.DynamicGradScaler(
                initial_scale=LOSS_SCALE, growth_interval=10**6, device=device
            ),
            clip_grad=args.clip_grad,
            log_num_zeros_in_grad=args.log_num_zeros,
            grad_stats_group=group,
            fused_step=fused_step,
        )
        self.last = None

    def prepare(self):
        self.opt.zero_grad()
        # step() only reads the model grads, so the pre-made tensors are re-attached as they are.
        for p, g in zip(self.params, self.fp16_grads):
            p.grad = g

    def step(self):
        self.last = self.opt.step()
        if not self.last.update_successful:
            raise RuntimeError(f"{self.name} skipped the step (inf/nan in the synthetic grads?)")

    def bytes_per_param(self):
        # fp16 params 2 + fp16 grads 2 (released by the step) + fp32 main params 4 + AdamW
        # exp_avg, exp_avg_sq 8; the generic path adds fp32 main grads 4 (kept until zero_grad)
        return {"params": 2 + 4, "grads": 2 + (0 if self.fused_step else 4), "optimizer_state": 8}


class MegatronBench:
    """megatron-core's Float16OptimizerWithFloat16Params around AdamW(fused=True), on CPU."""

    name = "megatron"

    def __init__(self, shapes, fp16_grads, device, args, group):
        from megatron_cpu import CudaAsCpu, make_megatron_fp16_optimizer

        self.mode = CudaAsCpu()
        self.params = make_params(shapes, torch.float16, device)
        self.fp16_grads = fp16_grads
        with self.mode:
            self.opt = make_megatron_fp16_optimizer(
                torch.optim.AdamW(self.params, lr=1e-4, weight_decay=0.01, fused=True), group,
                clip_grad=args.clip_grad, log_num_zeros_in_grad=args.log_num_zeros,
                initial_scale=LOSS_SCALE, growth_interval=10**6,
            )

    def prepare(self):
        self.opt.zero_grad()
        for p, g in zip(self.params, self.fp16_grads):
            p.grad = g  # megatron copies .grad.float() into fp32 main grads, then drops .grad

    def step(self):
        with self.mode:
            ok, _, _ = self.opt.step()
        if not ok:
            raise RuntimeError("megatron skipped the step")

    def bytes_per_param(self):
        # fp16 params 2 + fp16 grads 2 + fp32 main params 4 + fp32 main grads 4 + AdamW state 8
        return {"params": 2 + 4, "grads": 2 + 4, "optimizer_state": 8}


class TorchAmpBench:
    name = "torch.amp"

    def __init__(self, shapes, fp16_grads, device, args):
        self.params = make_params(shapes, torch.float32, device)
        self.fp16_grads = fp16_grads
        for p in self.params:
            p.grad = torch.empty_like(p)
        self.opt = torch.optim.AdamW(self.params, lr=1e-4, weight_decay=0.01, fused=True)
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

    def bytes_per_param(self):
        return {"params": 4, "grads": 4, "optimizer_state": 8}


class BareAdamWBench:
    name = "bare"

    def __init__(self, shapes, fp16_grads, device, args):
        self.params = make_params(shapes, torch.float32, device)
        for p, g in zip(self.params, fp16_grads):
            p.grad = g.float().mul_(1.0 / LOSS_SCALE)  # AdamW does not modify grads
        self.opt = torch.optim.AdamW(self.params, lr=1e-4, weight_decay=0.01, fused=True)

    def prepare(self):
        pass

    def step(self):
        self.opt.step()

    def bytes_per_param(self):
        return {"params": 4, "grads": 4, "optimizer_state": 8}


APPROACHES = "tpamp-fused,tpamp-fused-in-fused,tpamp-generic,megatron,torch.amp,bare"


def make_bench(name, shapes, fp16_grads, device, args, group):
    """The approach ``name`` (module docstring), or None with a note when it cannot run here."""
    if name == "tpamp-fused":
        return TpampBench(name, shapes, fp16_grads, device, args, group, fused_inner=False,
                          fused_step=True)
    if name == "tpamp-fused-in-fused":
        return TpampBench(name, shapes, fp16_grads, device, args, group, fused_inner=True,
                          fused_step=True)
    if name == "tpamp-generic":
        return TpampBench(name, shapes, fp16_grads, device, args, group, fused_inner=True,
                          fused_step=False)
    if name == "megatron":
        try:
            import megatron.core  # noqa: F401
        except ImportError as e:
            print(f"megatron: skipped ({e}; install megatron-core in a separate venv and run "
                  "this script with its python)")
            return None
        return MegatronBench(shapes, fp16_grads, device, args, group)
    if name == "torch.amp":
        return TorchAmpBench(shapes, fp16_grads, device, args)
    if name == "bare":
        return BareAdamWBench(shapes, fp16_grads, device, args)
    sys.exit(f"--only: unknown approach {name!r} (choose from {APPROACHES})")


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


def _megatron_version():
    try:
        from importlib.metadata import version

        return version("megatron-core")
    except Exception:
        return None


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
    p.add_argument("--only", default=APPROACHES,
                   help=f"comma list of approaches to run (default: all of {APPROACHES})")
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
            "tpamp_kernels": ops.extension_available(device),
            "megatron_core": _megatron_version(),
        }
        print(f"machine: {machine['cpu']} ({machine['cpu_count']} logical CPUs), torch {machine['torch']}, "
              f"{machine['torch_threads']} threads, device {machine['device']}, tpamp kernels "
              f"{'loaded' if machine['tpamp_kernels'] else 'NOT built (PyTorch fallback)'}, "
              f"megatron-core {machine['megatron_core']}")
        print(f"load average before: {load_before}")
        print(f"model: {n:,} elements in {len(shapes)} tensors (hidden {hidden}, {layers} layers, "
              f"vocab {vocab}); clip_grad {args.clip_grad}, log_num_zeros {args.log_num_zeros}, "
              f"{args.warmup} warm-up + {args.reps} timed reps each, interleaved; process group "
              f"{backend} world_size 1")

        fp16_grads = make_fp16_grads(shapes, device)
        wanted = [w.strip() for w in args.only.split(",") if w.strip()]
        benches = [b for b in (make_bench(w, shapes, fp16_grads, device, args, group)
                               for w in wanted) if b is not None]

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
                "bytes_per_param": b.bytes_per_param(),
            }
        print()
        print(f"{'approach':<22} {'median ms':>10} {'min ms':>10} {'mean ms':>10} {'max ms':>10}"
              f" {'CPU med ms':>11}  {'bytes/param':>11}")
        for name, r in rows.items():
            mem = sum(r["bytes_per_param"].values())
            print(f"{name:<22} {r['median_ms']:>10.1f} {r['min_ms']:>10.1f} {r['mean_ms']:>10.1f} "
                  f"{r['max_ms']:>10.1f} {r['cpu_median_ms']:>11.1f}  {mem:>11}")
        print("(bytes/param: params + grads + optimizer state held at the step, analytic; CPU: "
              "process CPU time, all threads)")
        ratios = {}
        for mine in [name for name in rows if name.startswith("tpamp")]:
            for other in ("bare", "megatron", "torch.amp"):
                if other in rows:
                    key = f"{mine}/{other}"
                    # paired: the two approaches' times in the same round (seconds apart), so
                    # slow swings of the machine's load cancel; the median over rounds
                    paired = [a / b for a, b in zip(times[mine], times[other])]
                    ratios[key] = {
                        "median": rows[mine]["median_ms"] / rows[other]["median_ms"],
                        "min": rows[mine]["min_ms"] / rows[other]["min_ms"],
                        "paired_median": statistics.median(paired),
                        "cpu_median": rows[mine]["cpu_median_ms"] / rows[other]["cpu_median_ms"],
                    }
                    r = ratios[key]
                    print(f"{key:<34} paired median {r['paired_median']:.2f}x   median "
                          f"{r['median']:.2f}x   min {r['min']:.2f}x   CPU-time median "
                          f"{r['cpu_median']:.2f}x")
        for b in benches:
            if getattr(b, "last", None) is not None:
                print(f"{b.name} last step: grad_norm {b.last.grad_norm:.4g}, num_zeros "
                      f"{b.last.num_zeros_in_grad}")
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
