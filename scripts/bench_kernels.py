"""Benchmark tpamp's fused CUDA kernels (tpamp._C) on one GPU.

What is measured (CUDA events around 10 back-to-back calls, so Python and launch time on the host
are not counted as kernel time; warm-up; median of --iters samples; every input is far larger
than the L2 cache, so each run streams from device memory):

1. device-to-device copy bandwidth (a 1 GiB ``copy_``): the ceiling for a streaming kernel;
2. the grad-statistics pass over the gradients of a GPT-style model (default: 220 tensors,
   1.9 GiB of fp16/bf16 grads): fp16/bf16 grads -> fp32 main grads, multiplied by the inverse
   loss scale, with found_inf, the L2 norm statistic and the zero count over a norm mask -- the
   fused kernel (targets: >= 85% of the copy bandwidth) against the same work done with PyTorch
   ops (_foreach_copy_, _amp_foreach_non_finite_check_and_unscale_, _foreach_norm,
   count_nonzero per tensor; target: fused >= 2x faster) and against tpamp.ops' PyTorch path;
3. the fp32 in-place pass (main_grad buffers) and the fp32 -> fp16 param copy (scale_and_copy);
4. the whole MixedPrecisionOptimizer step (fused AdamW inner optimizer) with and without the
   extension (tpamp.ops.force_fallback).

Prints a table and, with --out PATH, writes the numbers as JSON. Exits with a message when there
is no GPU or the extension is not built.

    python scripts/bench_kernels.py --out bench_kernels.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time

import torch

import tpamp
from tpamp import ops

GiB = 2**30


# --------------------------------------------------------------------------------------------
# configuration


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=18, help="transformer layers (default 18)")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size (default 2048)")
    p.add_argument("--vocab", type=int, default=50304, help="vocabulary size (default 50304)")
    p.add_argument("--seq", type=int, default=2048, help="positions of the position embedding")
    p.add_argument("--dtypes", default="fp16,bf16", help="grad dtypes to run (default fp16,bf16)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--step-layers", type=int, default=None,
                   help="layers of the model for the optimizer-step benchmark (default --layers)")
    p.add_argument("--skip-step", action="store_true", help="skip the optimizer-step benchmark")
    p.add_argument("--out", default=None, help="write the results as JSON to this path")
    return p.parse_args(argv)


def transformer_shapes(layers, hidden, vocab, seq):
    """(name, shape) of every parameter of a GPT-style model (Megatron layout, biases on)."""
    h = hidden
    shapes = [("embedding.word", (vocab, h)), ("embedding.position", (seq, h))]
    for i in range(layers):
        pre = f"layers.{i}."
        shapes += [
            (pre + "ln1.weight", (h,)), (pre + "ln1.bias", (h,)),
            (pre + "attn.qkv.weight", (3 * h, h)), (pre + "attn.qkv.bias", (3 * h,)),
            (pre + "attn.proj.weight", (h, h)), (pre + "attn.proj.bias", (h,)),
            (pre + "ln2.weight", (h,)), (pre + "ln2.bias", (h,)),
            (pre + "mlp.fc1.weight", (4 * h, h)), (pre + "mlp.fc1.bias", (4 * h,)),
            (pre + "mlp.fc2.weight", (h, 4 * h)), (pre + "mlp.fc2.bias", (h,)),
        ]
    shapes += [("final_ln.weight", (h,)), ("final_ln.bias", (h,))]
    return shapes


def counts_toward_norm(name):
    """The mask of a tensor-parallel rank > 0: params replicated across TP ranks (layer norms,
    biases of row-parallel layers) are counted on TP rank 0 only."""
    return not ("ln" in name or name.endswith("proj.bias") or name.endswith("fc2.bias"))


# --------------------------------------------------------------------------------------------
# timing


def time_cuda(fn, warmup, iters, calls=10):
    """Median milliseconds of one fn() call: each of the ``iters`` samples times ``calls``
    back-to-back calls between two CUDA events on the current stream and divides by ``calls``,
    so the host time of launching (Python, dispatch) overlaps the GPU work instead of being
    counted as kernel time, as it would be with one call between the events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def gbps(nbytes, ms):
    return nbytes / (ms * 1e-3) / 1e9


# --------------------------------------------------------------------------------------------
# the work


def make_grads(shapes, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    grads = []
    for _, shape in shapes:
        x = torch.randn(shape, generator=g, device="cuda", dtype=torch.float32)
        x[torch.rand(shape, generator=g, device="cuda") < 0.01] = 0.0
        grads.append(x.to(dtype))
        del x
    return grads


def torch_ops_grad_stats(grads, outs, inv_scale, mask):
    """The same work as the fused pass, done with PyTorch's multi-tensor and amp ops."""
    found_inf = torch.zeros(1, dtype=torch.float32, device="cuda")
    torch._foreach_copy_(outs, grads)
    torch._amp_foreach_non_finite_check_and_unscale_(outs, found_inf, inv_scale)
    counted = [o for o, m in zip(outs, mask) if m]
    sumsq = torch.stack(torch._foreach_norm(counted, 2.0)).double().square().sum()
    zeros = torch.zeros((), dtype=torch.int64, device="cuda")
    for o in counted:
        zeros += o.numel() - torch.count_nonzero(o)
    return found_inf, sumsq, zeros


def bench_copy(args):
    src = torch.empty(GiB // 2, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = time_cuda(lambda: dst.copy_(src), args.warmup, args.iters)
    nbytes = 2 * src.numel() * src.element_size()

    return dict(name="device-to-device copy (1 GiB)", ms=ms, bytes=nbytes, gbps=gbps(nbytes, ms))


def bench_grad_stats(args, shapes, dtype_name):
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]
    grads = make_grads(shapes, dtype)
    outs = [torch.empty(g.shape, dtype=torch.float32, device="cuda") for g in grads]
    mask = [counts_toward_norm(name) for name, _ in shapes]
    inv_scale = torch.tensor([2.0**-16], device="cuda")
    numel = sum(g.numel() for g in grads)
    nbytes = numel * (grads[0].element_size() + 4)  # read the grad, write the fp32 main grad
    kw = dict(out=outs, scale=inv_scale, norm_mask=mask, norm_type=2.0, count_zeros=True)

    fused = time_cuda(lambda: ops.grad_stats(grads, **kw), args.warmup, args.iters)
    baseline = time_cuda(lambda: torch_ops_grad_stats(grads, outs, inv_scale, mask),
                         args.warmup, args.iters)
    with ops.force_fallback():
        fallback = time_cuda(lambda: ops.grad_stats(grads, **kw), args.warmup, args.iters)
    rows = [
        dict(name=f"grad_stats {dtype_name}->fp32 fused", ms=fused),
        dict(name=f"grad_stats {dtype_name}->fp32 torch ops", ms=baseline),
        dict(name=f"grad_stats {dtype_name}->fp32 tpamp.ops torch path", ms=fallback),
    ]
    for r in rows:
        r.update(bytes=nbytes, gbps=gbps(nbytes, r["ms"]), tensors=len(grads), numel=numel)

    torch.cuda.empty_cache()
    return rows


def bench_fp32_passes(args, shapes):
    mains = make_grads(shapes, torch.float32, seed=1)
    models = [torch.empty(m.shape, dtype=torch.float16, device="cuda") for m in mains]
    mask = [counts_toward_norm(name) for name, _ in shapes]
    inv_scale = torch.tensor([0.5], device="cuda")
    numel = sum(m.numel() for m in mains)
    rows = []
    ms = time_cuda(lambda: ops.grad_stats(mains, scale=inv_scale, norm_mask=mask, norm_type=2.0,
                                          count_zeros=True), args.warmup, args.iters)
    rows.append(dict(name="grad_stats fp32 in place (main_grad) fused", ms=ms, bytes=numel * 8))
    ms = time_cuda(lambda: ops.scale_and_copy(mains, models), args.warmup, args.iters)
    rows.append(dict(name="scale_and_copy fp32->fp16 (params) fused", ms=ms, bytes=numel * 6))
    for r in rows:
        r.update(gbps=gbps(r["bytes"], r["ms"]), tensors=len(mains), numel=numel)

    torch.cuda.empty_cache()
    return rows


def bench_step(args, shapes):
    g = torch.Generator(device="cuda").manual_seed(2)
    params = [torch.nn.Parameter(torch.randn(s, generator=g, device="cuda").half() * 0.02)
              for _, s in shapes]
    grads = [torch.randn(p.shape, generator=g, device="cuda").half() for p in params]
    inner = torch.optim.AdamW(params, lr=1e-4, fused=True)
    opt = tpamp.MixedPrecisionOptimizer(
        inner, grad_scaler=tpamp.ConstantGradScaler(2.0**16, device="cuda"), clip_grad=1.0,
        log_num_zeros_in_grad=True,
    )

    def step():
        for p, gr in zip(params, grads):
            p.grad = gr
        opt.step()

    rows = []
    for label, force in (("with tpamp._C", False), ("PyTorch path", True)):
        with ops.force_fallback(force):
            ms = time_cuda(step, args.warmup, max(5, args.iters // 2))
        rows.append(dict(name=f"MixedPrecisionOptimizer.step {label}", ms=ms,
                         tensors=len(params), numel=sum(p.numel() for p in params)))

    torch.cuda.empty_cache()
    return rows


# --------------------------------------------------------------------------------------------


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_kernels: no CUDA GPU is available (torch.cuda.is_available() is False); "
                 "this benchmark needs one.")
    if not ops.extension_available("cuda"):
        from tpamp import _ext

        sys.exit(f"bench_kernels: the CUDA kernels of tpamp._C are not available "
                 f"({_ext.status()}); build them with `pip install --no-build-isolation -e .` "
                 "with a CUDA build of torch and nvcc (CPU kernels: scripts/bench_kernels_cpu.py)")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if d not in ("fp16", "bf16"):
            sys.exit(f"bench_kernels: --dtypes takes fp16 and/or bf16, got {d!r}")

    shapes = transformer_shapes(args.layers, args.hidden, args.vocab, args.seq)
    numel = sum(math.prod(s) for _, s in shapes)
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name} ({props.total_memory / GiB:.0f} GiB), torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}")
    print(f"model: {len(shapes)} tensors, {numel / 1e6:.0f}M elements "
          f"({numel * 2 / GiB:.2f} GiB as fp16), layers={args.layers} hidden={args.hidden}")
    t0 = time.time()

    copy = bench_copy(args)
    rows = [copy]
    summary = {}
    for d in dtypes:
        fused, baseline, fallback = bench_grad_stats(args, shapes, d)
        rows += [fused, baseline, fallback]
        summary[d] = dict(
            fraction_of_copy_bandwidth=fused["gbps"] / copy["gbps"],
            speedup_vs_torch_ops=baseline["ms"] / fused["ms"],
            speedup_vs_tpamp_torch_path=fallback["ms"] / fused["ms"],
        )
    rows += bench_fp32_passes(args, shapes)
    if not args.skip_step:
        layers = args.step_layers if args.step_layers is not None else args.layers
        step_rows = bench_step(args, transformer_shapes(layers, args.hidden, args.vocab, args.seq))
        rows += step_rows
        summary["optimizer_step_speedup"] = step_rows[1]["ms"] / step_rows[0]["ms"]

    print()
    print(f"{'case':<52} {'median ms':>10} {'GB/s':>8} {'% copy':>7}")
    for r in rows:
        bw = r.get("gbps")
        bw_s = f"{bw:8.0f}" if bw is not None else f"{'':>8}"
        pct = f"{100 * bw / copy['gbps']:6.1f}%" if bw is not None else f"{'':>7}"
        print(f"{r['name']:<52} {r['ms']:10.3f} {bw_s} {pct}")
    print()
    for d in dtypes:
        s = summary[d]
        ok_bw = s["fraction_of_copy_bandwidth"] >= 0.85
        ok_speed = s["speedup_vs_torch_ops"] >= 2.0
        print(f"{d}: fused pass at {100 * s['fraction_of_copy_bandwidth']:.1f}% of copy bandwidth "
              f"(target 85%: {'met' if ok_bw else 'MISSED'}), "
              f"{s['speedup_vs_torch_ops']:.2f}x the torch ops (target 2x: "
              f"{'met' if ok_speed else 'MISSED'})")
    if "optimizer_step_speedup" in summary:
        print(f"optimizer step: {summary['optimizer_step_speedup']:.2f}x faster with tpamp._C")
    print(f"(benchmark took {time.time() - t0:.0f} s)")

    if args.out:
        result = dict(
            device=props.name, torch=torch.__version__, cuda=torch.version.cuda,
            python=platform.python_version(), tpamp=tpamp.__version__, args=vars(args),
            tensors=len(shapes), numel=numel, rows=rows, summary=summary,
        )
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
