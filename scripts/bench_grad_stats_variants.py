"""Variants of the CUDA grad-stats pass (csrc/cuda/grad_stats.cu), timed against a device copy of
the same bytes on a GPU: the tuning knobs TPAMP_GS_FUSED_TAIL (the chunk's four results reduced
with one barrier, 1, or with four block reductions, 0) and TPAMP_GS_UNROLL (16-byte loads in
flight per thread). Each variant is grad_stats.cu compiled on its own by
torch.utils.cpp_extension (about 40 s each, built in parallel processes); all must give the bits
of the first (old_u4: the code before the one-barrier tail) on an adversarial list before any is
timed. The sizes and the copy match scripts/gpu_check.py's "grad-stats pass / copy bandwidth".

    TORCH_CUDA_ARCH_LIST=9.0 python scripts/bench_grad_stats_variants.py     # GPU only, ~3 min

Prints, per input dtype, each variant's median ms (15 rounds of 5 calls, interleaved with the
copy) and its median fraction of the copy's bandwidth (paired per round).
"""
import math
import os
import statistics
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {"old_u4": (0, 4), "fused_u4": (1, 4), "old_u8": (0, 8), "fused_u8": (1, 8), "fused_u2": (1, 2)}
WRAP = r'''
#include <torch/extension.h>
#include "ops.h"
std::vector<at::Tensor> gs(std::vector<at::Tensor> g, std::optional<at::Tensor> s, std::vector<bool> mask,
                           bool cz, bool pt, std::vector<at::Tensor> out) {
  c10::List<bool> l;
  for (bool b : mask) l.push_back(b);
  auto r = tpamp::cuda::grad_stats_out(g, s, l, cz, pt, out);
  return {std::get<0>(r), std::get<1>(r), std::get<2>(r), std::get<3>(r), std::get<4>(r)};
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("gs", &gs); }
'''


def build(name):
    from torch.utils.cpp_extension import load
    tail, unroll = VARIANTS[name]
    d = f"/tmp/gsv/{name}"
    os.makedirs(d, exist_ok=True)
    # rewritten only when it changed: a newer mtime makes ninja recompile it (~40 s each)
    if not os.path.exists(f"{d}/wrap.cpp") or open(f"{d}/wrap.cpp").read() != WRAP:
        with open(f"{d}/wrap.cpp", "w") as f:
            f.write(WRAP)
    return load(name=f"gsv_{name}", sources=[f"{d}/wrap.cpp", f"{ROOT}/csrc/cuda/grad_stats.cu"],
                extra_include_paths=[f"{ROOT}/csrc"], build_directory=d, verbose=False,
                extra_cflags=["-O3", "-DTPAMP_WITH_CUDA"],
                extra_cuda_cflags=["-O3", "-lineinfo", "-DTPAMP_WITH_CUDA",
                                   f"-DTPAMP_GS_FUSED_TAIL={tail}", f"-DTPAMP_GS_UNROLL={unroll}"])


def bench():
    sys.path.insert(0, f"{ROOT}/scripts")
    from gpu_check import grad_shapes
    mods = {}
    for name in VARIANTS:
        try:
            mods[name] = build(name)
        except Exception as e:  # noqa: BLE001
            print(f"variant {name}: build failed: {e}"[:400], flush=True)
    dev = torch.device("cuda")
    # correctness first: every variant gives the old one's bits on an adversarial list
    g = torch.Generator(device="cpu").manual_seed(0)
    for dt in (torch.float16, torch.bfloat16, torch.float32):
        sizes = [0, 1, 7, 65536, 65537, 300001, 1 << 20]
        grads = [(torch.randn(n, generator=g) * 100).to(dt).to(dev) for n in sizes]
        grads[3][5] = 0
        grads[4][100:200] = 0
        ref = None
        for name, m in mods.items():
            for case in ("plain", "inf", "nan"):
                gg = [x.clone() for x in grads]
                if case == "inf":
                    gg[5][17] = math.inf
                if case == "nan":
                    gg[6][99] = math.nan
                outs = [torch.empty(x.shape, device=dev) for x in gg]
                r = m.gs(gg, torch.tensor([0.5], device=dev), [i % 2 == 0 for i in range(len(gg))],
                         True, True, outs)
                key = (dt, case)
                vals = [t.cpu() for t in r] + [torch.cat(outs).cpu()]
                if ref is None:
                    ref = {}
                if key not in ref:
                    ref[key] = (name, vals)
                else:
                    same = all(torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())) for a, b in zip(ref[key][1], vals))
                    print(f"bits {name} vs {ref[key][0]} {dt} {case}: {'SAME' if same else 'DIFFER'}", flush=True)
    free, _ = torch.cuda.mem_get_info()
    numel = int(min(free * 0.45 / 12, 4e9))
    for dt in (torch.float16, torch.bfloat16):
        shapes = grad_shapes(numel if dt == torch.float16 else numel // 2, 4096)
        n = sum(math.prod(s) for s in shapes)
        grads = [torch.randn(s, device=dev).to(dt) for s in shapes]
        outs = [torch.empty(s, dtype=torch.float32, device=dev) for s in shapes]
        mask = [i % 12 not in (4, 5, 9, 10, 11) for i in range(len(shapes))]
        inv = torch.tensor([2.0**-16], device=dev)
        nbytes = n * 6
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        fns = {"copy": lambda s=src, d=dst: d.copy_(s)}
        for name, m in mods.items():
            fns[name] = (lambda m=m, g=grads, o=outs: m.gs(g, inv, mask, True, False, o))
        for fn in fns.values():
            for _ in range(3):
                fn()
        torch.cuda.synchronize()
        times = {k: [] for k in fns}
        for _ in range(15):
            for k, fn in fns.items():
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(5):
                    fn()
                b.record()
                b.synchronize()
                times[k].append(a.elapsed_time(b) / 5)
        print(f"{dt}: {len(shapes)} tensors, {n / 1e6:.0f}M elements, {nbytes / 2**30:.2f} GiB moved", flush=True)
        for k, t in times.items():
            frac = statistics.median([c / x for c, x in zip(times["copy"], t)])
            print(f"  {k:10s} median {statistics.median(t):.3f} ms  copy/this {100 * frac:.1f}%  "
                  f"{nbytes / statistics.median(t) / 1e9:.0f} GB/s", flush=True)
        grads = outs = src = dst = fns = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    if sys.argv[1:2] == ["build"]:
        build(sys.argv[2])
        print("built", sys.argv[2])
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_grad_stats_variants.py: needs a CUDA GPU")
        procs = [subprocess.Popen([sys.executable, __file__, "build", v]) for v in VARIANTS]
        for pr in procs:
            pr.wait()
        bench()
