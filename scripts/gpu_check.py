"""The Python parts of scripts/gpu_check.sh: one part per call, each writing its rows of the final
table to OUTDIR/<part>.json (and its details to stdout, which gpu_check.sh keeps as
OUTDIR/<part>.log). docs/guide/kernels.md ("Checking a GPU machine") says what each row means.

    python scripts/gpu_check.py env      --out OUTDIR [--dry-run]
    python scripts/gpu_check.py errors   --out OUTDIR [--dry-run]   # the kernels' error path
    python scripts/gpu_check.py compare  --out OUTDIR [--dry-run] [--small]  # kernels vs twin vs float64
    python scripts/gpu_check.py graph    --out OUTDIR [--dry-run]   # sync-free step in a CUDA graph
    python scripts/gpu_check.py bench    --out OUTDIR [--dry-run]   # CUDA-event timings
    python scripts/gpu_check.py table    --out OUTDIR [--dry-run]   # prints the table (last)

The table also reads the main job's OUTDIR/train/summary.json (its loss).

With --dry-run every GPU part runs on CPU stand-ins at small sizes: the "device" kernels are the
CUDA launchers under the SIMT emulator (torch.ops.tpamp_simt, when tpamp._C_simt is built; else
the CPU kernels, said in the row), graph capture is replaced by eager replay, and timings use the
host clock. A dry run's figures are labelled as such: they are not GPU figures.

A row is (part, check, status, value, target, note); status is PASS, FAIL, SKIP (with the reason
in note) or INFO (a figure with no target). Nothing is skipped silently.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import glob
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# the table needs no torch: it stays quick even when the other parts have failed
if not (__name__ == "__main__" and sys.argv[1:2] == ["table"]):
    import torch

    import tpamp
    from tpamp import _ext, ops

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    # the float64 references, shared with tests/test_simt.py
    from kernel_reference import f32, stats_ref, written_ref

PARTS = ("env", "errors", "compare", "graph", "bench", "table")
GiB = 2**30
RTOL = 2e-5  # sums of squares and norms: summation order differs (float64 partials)


# --------------------------------------------------------------------------------------------
# rows


class Rows:
    """The rows one part adds to the table, written to OUTDIR/<part>.json as they come (a part
    killed by its timeout keeps the rows it had)."""

    def __init__(self, out, part):
        self.path = os.path.join(out, f"{part}.json")
        self.part = part
        self.rows = []

    def add(self, check, status, value="", target="", note=""):
        assert status in ("PASS", "FAIL", "SKIP", "INFO"), status
        row = dict(part=self.part, check=check, status=status, value=str(value),
                   target=str(target), note=str(note))
        self.rows.append(row)
        print(f"[{status}] {check}: {value} {('(target ' + target + ')') if target else ''} {note}",
              flush=True)
        with open(self.path, "w", encoding="utf-8") as f:
            json.dump(self.rows, f, indent=1)


class Ctx:
    """Where the "device" side runs: a CUDA GPU, or (dry run) CPU stand-ins."""

    def __init__(self, args):
        self.dry = args.dry_run
        self.small = getattr(args, "small", False)
        self.out = args.out
        if self.dry:
            self.device = torch.device("cpu")
            try:
                self.dev_ops = _ext.load_simt()
                self.dev_name = "SIMT-emulated CUDA launchers (torch.ops.tpamp_simt, CPU)"
            except RuntimeError:
                self.dev_ops = torch.ops.tpamp
                self.dev_name = "CPU kernels (tpamp._C_simt not built: no launcher stand-in)"
        else:
            self.device = torch.device("cuda")
            self.dev_ops = torch.ops.tpamp
            self.dev_name = f"CUDA kernels on {torch.cuda.get_device_name(0)}"
        self.twin = torch.ops.tpamp  # on CPU tensors: the CPU kernels

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def gpu_ready():
    """None when the GPU parts can run, else the reason they cannot."""
    if not torch.cuda.is_available():
        return f"no CUDA GPU (torch {torch.__version__}, torch.cuda.is_available() is False)"
    if not ops.extension_available("cuda"):
        return f"the CUDA kernels of tpamp._C are not loaded: {_ext.status()}"
    if not ops.extension_available("cpu"):
        return f"the CPU kernels (the CPU twins) are not loaded: {_ext.status()}"
    return None


# --------------------------------------------------------------------------------------------
# env


def part_env(ctx, rows):
    info = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                python=sys.version.split()[0], torch=torch.__version__, cuda=torch.version.cuda,
                tpamp=tpamp.__version__, kernels=_ext.status(), dry_run=ctx.dry,
                cpu_capability=torch.backends.cpu.get_cpu_capability(), cpus=os.cpu_count())
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, capability=f"{p.major}.{p.minor}",
                    gpu_memory_gib=round(p.total_memory / GiB, 1))
    for tool in ("nvcc", "compute-sanitizer", "nvidia-smi"):
        info[tool] = shutil.which(tool) or (
            os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", tool)
            if os.path.exists(os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", tool))
            else None)
    try:
        from importlib.metadata import version

        info["megatron_core"] = version("megatron-core")
    except Exception:
        info["megatron_core"] = None
    print(json.dumps(info, indent=1, default=str))
    with open(os.path.join(ctx.out, "env_info.json"), "w", encoding="utf-8") as f:
        json.dump(info, f, indent=1, default=str)
    where = info.get("gpu", "no GPU") + (f" (sm {info['capability']})" if "capability" in info else "")
    rows.add("machine", "INFO", f"{where}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
             f"Python {info['python']}; {info['cpus']} CPUs")
    k = info["kernels"]
    rows.add("kernels loaded", "INFO", f"CUDA {ops.extension_available('cuda')}, "
             f"CPU {ops.extension_available('cpu')} ({k.get('cpu_module') if isinstance(k, dict) else k})")


# --------------------------------------------------------------------------------------------
# compare: every kernel against its CPU twin and a float64 reference


def make_list(seed, sizes, dtypes, offsets=(0, 1, 3), specials=True, scale=1.0):
    """CPU tensors of the given sizes, dtypes in turn, at storage offsets in turn (misaligned
    pointers); ~10% zeros, -0.0 among them; with specials one inf, one -inf, one nan."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(sizes):
        off = offsets[i % len(offsets)]
        buf = torch.randn(n + off, generator=g, dtype=torch.float64) * scale
        buf[torch.rand(n + off, generator=g) < 0.1] = 0.0
        buf[torch.rand(n + off, generator=g) < 0.02] = -0.0
        out.append(buf.to(dtypes[i % len(dtypes)])[off:])
    if specials:
        big = [t for t in out if t.numel() > 100]
        big[0][17], big[1][5], big[2][-1] = math.inf, -math.inf, math.nan
    return out


def bits(t):
    t = t.contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same_bits(a, b):
    """Every bit equal (NaN payloads may differ between devices); compared on a's device."""
    b = b.to(a.device)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.numel():
        return True
    nan = a.isnan() & b.isnan() if a.is_floating_point() else torch.zeros_like(a, dtype=torch.bool)
    return bool(((bits(a) == bits(b)) | nan).all())


def within_ulps(a, b, ulps=2):
    """float32 within `ulps` units in the last place, or 1e-7 apart (near 0)."""
    a, b = a.cpu(), b.cpu()
    if a.shape != b.shape:
        return False
    if not a.numel():
        return True
    d = (bits(a).long() - bits(b).long()).abs()
    return bool(((d <= ulps) | ((a - b).abs() <= 1e-7)).all())


def close(x, ref, rel):
    if math.isnan(ref):
        return math.isnan(x)
    if math.isinf(ref):
        return x == ref
    return abs(x - ref) <= rel * abs(ref)


def stats_agree(res, ref, with_norms=True):
    found, sumsq, amax, zeros, norms = (r.cpu() for r in res)
    rfound, rsumsq, ramax, rzeros, rnorms = ref
    problems = []
    if float(found[0]) != float(rfound):
        problems.append(f"found_inf {float(found[0])} != {float(rfound)}")
    if math.isfinite(rsumsq):
        if not close(float(sumsq), rsumsq, RTOL):
            problems.append(f"sumsq {float(sumsq)!r} vs {rsumsq!r}")
    elif math.isfinite(float(sumsq)):
        problems.append(f"sumsq {float(sumsq)!r} finite, reference {rsumsq!r}")
    if not (math.isnan(ramax) and math.isnan(float(amax))) and float(amax) != ramax:
        problems.append(f"amax {float(amax)!r} vs {ramax!r}")
    if int(zeros) != rzeros:
        problems.append(f"zeros {int(zeros)} vs {rzeros}")
    if with_norms and norms.numel():
        for i, r in enumerate(rnorms):
            if not close(float(norms[i]), r, RTOL):
                problems.append(f"norm[{i}] {float(norms[i])!r} vs {r!r}")
                break
    return problems


class Tally:
    """Cases of one op family: all must agree; the first failures are kept for the row."""

    def __init__(self, rows, check, what):
        self.rows, self.check, self.what = rows, check, what
        self.n, self.failures = 0, []

    def case(self, name, problems):
        self.n += 1
        if problems:
            self.failures.append(f"{name}: {'; '.join(problems[:3])}")
            print(f"  FAIL {self.check} {name}: {problems}", flush=True)
        else:
            print(f"  ok   {self.check} {name}", flush=True)

    def run(self, name, fn):
        try:
            self.case(name, fn())
        except Exception as e:  # a crash is a failure of that case, the others still run
            traceback.print_exc()
            self.case(name, [f"raised {type(e).__name__}: {e}"])

    def done(self, note=""):
        if self.failures:
            self.rows.add(self.check, "FAIL", f"{len(self.failures)} of {self.n} cases differ",
                          self.what, " | ".join(self.failures[:2]))
        else:
            self.rows.add(self.check, "PASS", f"{self.n} cases agree", self.what, note)


def on(ts, device):
    """Copies of CPU tensors on `device` at the same storage offsets (misaligned stays so)."""
    out = []
    for t in ts:
        off = t.storage_offset()
        buf = torch.empty(t.numel() + off, dtype=t.dtype, device=device)
        v = buf[off:].view(t.shape)
        v.copy_(t)
        out.append(v)
    return out


def clones(ts):
    return [t.clone() for t in ts]


def compare_grad_stats(ctx, rows, sizes):
    dev, D, T = ctx.device, ctx.dev_ops, ctx.twin
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    tally = Tally(rows, "grad_stats: device = CPU twin = float64",
                  "values bitwise; found_inf, amax, zeros exact; sumsq, norms rel 2e-5")
    cases = []
    variants = ("mixed", "fp16") if ctx.dry else ("mixed", "fp32", "fp16", "bf16")
    scales = (None, 1.0 / 64, 2.0**40) if ctx.dry else (None, 1.0 / 64, 1.0, 0.0, 2.0**40)
    for variant in variants:
        dts = dtypes if variant == "mixed" else (dict(fp32=dtypes[0], fp16=dtypes[1], bf16=dtypes[2])[variant],)
        for specials in (False, True):
            for scale in scales:
                cases.append((variant, dts, specials, scale))
    for k, (variant, dts, specials, scale) in enumerate(cases):
        grads = make_list(100 + k, sizes, dts, specials=specials)
        mask = [i % 4 != 1 for i in range(len(grads))]
        sc = None if scale is None else torch.tensor([scale], dtype=torch.float32)

        def one(grads=grads, mask=mask, sc=sc, scale=scale):
            problems = []
            # out= (fp16/bf16 -> fp32 main grads) and in place
            for mode in ("out", "inplace"):
                src_d, src_t = on(grads, dev), clones(grads)
                if mode == "out":
                    out_d = [torch.empty(g.shape, dtype=torch.float32, device=dev) for g in grads]
                    out_t = [torch.empty(g.shape, dtype=torch.float32) for g in grads]
                    rd = D.grad_stats_out(src_d, None if sc is None else sc.to(dev), mask, True, True, out=out_d)
                    rt = T.grad_stats_out(src_t, sc, mask, True, True, out=out_t)
                    dst = torch.float32
                else:
                    rd = D.grad_stats_(src_d, None if sc is None else sc.to(dev), mask, True, True)
                    rt = T.grad_stats_(src_t, sc, mask, True, True)
                    out_d, out_t, dst = src_d, src_t, None
                written = [written_ref(g, scale, dst or g.dtype) for g in grads]
                for i in range(len(grads)):
                    if not same_bits(out_d[i], out_t[i]):
                        problems.append(f"{mode}: tensor {i} differs from the CPU twin")
                        break
                    if not same_bits(out_d[i], written[i]):
                        problems.append(f"{mode}: tensor {i} differs from float64")
                        break
                ref = stats_ref(written, mask)
                problems += [f"{mode} device: {p}" for p in stats_agree(rd, ref)]
                problems += [f"{mode} twin: {p}" for p in stats_agree(rt, ref)]
            return problems

        tally.run(f"{variant} specials={specials} scale={scale}", one)
    # empty list (tpamp.ops answers it without a launch), all-empty tensors, many tensors (several
    # launches)
    def empty_and_many():
        problems = []
        if not ctx.dry:
            r = ops.grad_stats([], norm_type=2.0, count_zeros=True, device=dev)
            if r.found_inf.device.type != dev.type or float(r.found_inf.sum()) != 0.0:
                problems.append(f"empty list: {r}")
        for grads in ([torch.zeros(0), torch.zeros(0, dtype=torch.float16)],
                      make_list(7, [1 + i % 9 for i in range(100 if ctx.dry else 700)], dtypes,
                                specials=False)):
            mask = [True] * len(grads)
            rd = D.grad_stats_(on(grads, dev), None, mask, True, True)
            rt = T.grad_stats_(clones(grads), None, mask, True, True)
            ref = stats_ref(grads, mask)
            problems += [f"{len(grads)} tensors device: {p}" for p in stats_agree(rd, ref)]
            problems += [f"{len(grads)} tensors twin: {p}" for p in stats_agree(rt, ref)]
        return problems

    tally.run("empty list, empty tensors, many tensors", empty_and_many)
    tally.done()


def compare_copies(ctx, rows, sizes):
    dev, D, T = ctx.device, ctx.dev_ops, ctx.twin
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    tally = Tally(rows, "scale_and_copy, scale_, scaler update: device = twin = float64",
                  "bitwise")
    for src in dtypes:
        srcs = make_list(4, sizes, (src,), specials=True)
        for dst in dtypes:
            for scale in (None, 0.3, 2.0**20):
                def one(srcs=srcs, dst=dst, scale=scale):
                    sc = None if scale is None else torch.tensor([scale])
                    a = [torch.empty(s.shape, dtype=dst, device=dev) for s in srcs]
                    b = [torch.empty(s.shape, dtype=dst) for s in srcs]
                    D.scale_and_copy(on(srcs, dev), a, None if sc is None else sc.to(dev))
                    T.scale_and_copy(clones(srcs), b, sc)
                    for i, s in enumerate(srcs):
                        if not same_bits(a[i], b[i]):
                            return [f"tensor {i} differs from the CPU twin"]
                        if not same_bits(a[i], written_ref(s, scale, dst)):
                            return [f"tensor {i} differs from float64"]
                    return []

                tally.run(f"scale_and_copy {src}->{dst} scale={scale}", one)

        def scale_(srcs=srcs):
            problems = []
            for scale in (-1.5, 1.0, 0.0):
                a, b = on(srcs, dev), clones(srcs)
                D.scale_(a, torch.tensor([scale], device=dev))
                T.scale_(b, torch.tensor([scale]))
                for i, s in enumerate(srcs):
                    ref = s if scale == 1.0 else written_ref(s, scale, s.dtype)
                    if not (same_bits(a[i], b[i]) and same_bits(a[i], ref)):
                        problems.append(f"scale {scale}: tensor {i}")
                        break
                    if scale == 1.0 and not torch.equal(bits(a[i].cpu()), bits(s)):
                        problems.append("a scale of 1 changed bits (NaN payload?)")
                        break
            return problems

        tally.run(f"scale_ {src}", scale_)

    def scaler():
        st = {k: [torch.tensor([2.0**16]), torch.tensor([0], dtype=torch.int32),
                  torch.tensor([2], dtype=torch.int32)] for k in ("dev", "cpu")}
        st["dev"] = [t.to(dev) for t in st["dev"]]
        for step, bad in enumerate([0, 0, 1, 0, 1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0]):
            for k, op in (("dev", D), ("cpu", T)):
                s, g, h = st[k]
                op.dynamic_scaler_update_(s, g, h, torch.tensor([float(bad)], device=s.device),
                                          2.0, 0.5, 3, 2, 1.0, math.inf, False)
            if not all(torch.equal(x.cpu(), y) for x, y in zip(st["dev"], st["cpu"])):
                return [f"step {step}: device {[x.tolist() for x in st['dev']]} != twin"]
        return []

    tally.run("dynamic_scaler_update_ 16-step trace", scaler)
    tally.done()


def adam_case(seed, sizes, model=None):
    model = model or torch.float16
    g = torch.Generator().manual_seed(seed)
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    params, ms, vs, steps, models, grads = [], [], [], [], [], []
    for i, n in enumerate(sizes):
        off = i % 3
        params.append(torch.randn(n + off, generator=g)[off:])
        ms.append(torch.randn(n, generator=g) * 0.1)
        vs.append(torch.rand(n, generator=g) * 0.01)
        steps.append(torch.tensor(float(i % 4 + 1), dtype=torch.float64 if i % 2 else torch.float32))
        models.append(torch.zeros(n, dtype=model if i % 2 else torch.bfloat16))
        grads.append((torch.randn(n, generator=g) * 64).to(dtypes[i % 3]))
    return [params, ms, vs, steps, models, grads]


def adam_ref(p, m, v, step, g, scale, lr, b1, b2, eps, wd, decoupled):
    """torch.optim.Adam(W)'s formulas in float64 from the same inputs (one step)."""
    p, m, v, g = p.double(), m.double(), v.double(), g.double() * scale
    if wd and not decoupled:
        g = g + wd * p
    if wd and decoupled:
        p = p * (1 - lr * wd)
    m = m + (g - m) * (1 - b1)
    v = v * b2 + (1 - b2) * g * g
    t = step + 1
    return p - lr / (1 - b1 ** t) * m / (v.sqrt() / math.sqrt(1 - b2 ** t) + eps), m, v


def compare_steps(ctx, rows, sizes):
    dev, D, T = ctx.device, ctx.dev_ops, ctx.twin
    tally = Tally(rows, "fused_adam_step_ / fused_sgd_step_: device = twin = float64",
                  "Adam <= 2 ulps of the twin, float64 rel 3e-6; SGD bitwise")
    for decoupled in (True, False):
        def adam(decoupled=decoupled):
            case = adam_case(5, sizes)
            a, b = [on(x, dev) for x in case], [clones(x) for x in case]
            hyper = (1e-3, 0.9, 0.999, 1e-8, 0.01, decoupled, False)
            D.fused_adam_step_(*a, torch.tensor([1 / 64], device=dev), torch.tensor([0.0], device=dev),
                               torch.tensor([2e-3], device=dev), *hyper, [], [])
            T.fused_adam_step_(*b, torch.tensor([1 / 64]), torch.tensor([0.0]), torch.tensor([2e-3]),
                               *hyper, [], [])
            problems = []
            for i in range(len(sizes)):
                if not torch.equal(a[3][i].cpu(), b[3][i]):
                    problems.append(f"step count {i}")
                for k, what in ((0, "param"), (1, "exp_avg"), (2, "exp_avg_sq")):
                    if not within_ulps(a[k][i], b[k][i]):
                        problems.append(f"{what} {i} vs twin")
                rp, rm, rv = adam_ref(case[0][i], case[1][i], case[2][i], float(case[3][i]),
                                      case[5][i], 1 / 64, 2e-3, 0.9, 0.999, 1e-8, 0.01, decoupled)
                for k, r, atol in ((0, rp, 1e-7), (1, rm, 3e-8), (2, rv, 1e-12)):
                    if not torch.allclose(a[k][i].cpu().double(), r, rtol=3e-6, atol=atol):
                        problems.append(f"state {k} of param {i} vs float64")
                if not torch.equal(a[4][i].cpu(), a[0][i].cpu().to(a[4][i].dtype)):
                    problems.append(f"model param {i} is not the cast of the master")
            return problems

        tally.run(f"{'AdamW' if decoupled else 'Adam'} fp32 masters, fp16/bf16/fp32 grads", adam)

    def found_inf():
        case = adam_case(6, sizes)
        a = [on(x, dev) for x in case]
        D.fused_adam_step_(*a, torch.tensor([0.5], device=dev), torch.tensor([1.0], device=dev), None,
                           1e-3, 0.9, 0.999, 1e-8, 0.0, True, False, [], [])
        return [f"list {k} changed" for k in range(6)
                if not all(torch.equal(x.cpu(), y) for x, y in zip(a[k], case[k]))]

    tally.run("Adam with found_inf set changes nothing", found_inf)

    # narrow formats (bf16 / float8_e4m3fn / uint8 moments, int16 remainders)
    F8, U8 = torch.float8_e4m3fn, torch.uint8
    for m_dt, v_dt, rem in ((torch.bfloat16, torch.bfloat16, True), (F8, F8, True),
                            (F8, torch.bfloat16, False), (torch.float32, F8, False),
                            (U8, U8, True), (U8, F8, False), (torch.bfloat16, U8, False)):
        def narrow(m_dt=m_dt, v_dt=v_dt, rem=rem):
            g = torch.Generator().manual_seed(7)
            lists = [[] for _ in range(6)]
            msc, vsc = [], []
            nsizes = [n for n in sizes if n] + [256, 257]
            for i, n in enumerate(nsizes):
                master = torch.randn(n, generator=g)
                if rem:
                    hi, lo = ops.split_remainders(master)
                    lists[0].append(lo), lists[4].append(hi)
                else:
                    lists[0].append(master), lists[4].append(master.to(torch.bfloat16))
                m, sa = ops.encode_moment(torch.randn(n, generator=g) * 1e-3, m_dt)
                v, sb = ops.encode_moment(torch.rand(n, generator=g) * 1e-6, v_dt, sqrt=True)
                lists[1].append(m), lists[2].append(v)
                msc.append(sa if sa is not None else torch.empty(0))
                vsc.append(sb if sb is not None else torch.empty(0))
                lists[3].append(torch.tensor([3.0], dtype=torch.float64 if i % 2 else torch.float32))
                lists[5].append(torch.randn(n, generator=g).to(torch.bfloat16 if i % 2 else torch.float32))
            msc = msc if m_dt in (F8, U8) else []
            vsc = vsc if v_dt in (F8, U8) else []
            a, b = [on(x, dev) for x in lists], [clones(x) for x in lists]
            am, av = on(msc, dev), on(vsc, dev)
            bm, bv = clones(msc), clones(vsc)
            hyper = (1e-3, 0.9, 0.95, 1e-8, 0.1, True, False)
            D.fused_adam_step_(*a, torch.tensor([0.5], device=dev), torch.tensor([0.0], device=dev),
                               None, *hyper, am, av)
            T.fused_adam_step_(*b, torch.tensor([0.5]), torch.tensor([0.0]), None, *hyper, bm, bv)
            problems = []
            for i in range(len(nsizes)):
                pa = ops.join_remainders(a[4][i].cpu(), a[0][i].cpu()) if rem else a[0][i].cpu()
                pb = ops.join_remainders(b[4][i], b[0][i]) if rem else b[0][i]
                if not torch.allclose(pa, pb, rtol=1e-6, atol=1e-9):
                    problems.append(f"param {i}")
                for k, sa, sb, sq in ((1, am, bm, False), (2, av, bv, True)):
                    da = ops.decode_moment(a[k][i].cpu(), sa[i].cpu() if sa else None, sqrt=sq)
                    db = ops.decode_moment(b[k][i], sb[i] if sb else None, sqrt=sq)
                    big = float(db.abs().max())
                    if not torch.allclose(da, db, rtol=0.15, atol=big * 2**-8):
                        problems.append(f"moment {k} of param {i}")
                if float(a[3][i].cpu()) != 4.0:
                    problems.append(f"step count {i}")
            return problems

        tally.run(f"narrow Adam m={m_dt} v={v_dt} remainders={rem}", narrow)

    def stochastic_rounding():
        g = torch.Generator().manual_seed(9)
        nsizes = [n for n in sizes if n]
        params = [torch.randn(n, generator=g).to(torch.bfloat16) for n in nsizes]
        ms = [torch.zeros(n) for n in nsizes]
        vs = [torch.zeros(n) for n in nsizes]
        steps = [torch.tensor([0.0]) for _ in nsizes]
        grads = [torch.randn(n, generator=g).to(torch.bfloat16) for n in nsizes]
        sr = torch.tensor([[12345 + i, 7 * i] for i in range(len(nsizes))], dtype=torch.int64)
        a = [on(x, dev) for x in (params, ms, vs, steps)] + [[], on(grads, dev)]
        b = [clones(x) for x in (params, ms, vs, steps)] + [[], clones(grads)]
        hyper = (1e-2, 0.9, 0.999, 1e-8, 0.0, True, False)
        D.fused_adam_step_(*a, None, None, None, *hyper, [], [], sr.to(dev))
        T.fused_adam_step_(*b, None, None, None, *hyper, [], [], sr)
        return [f"bf16 param {i}" for i in range(len(nsizes)) if not same_bits(a[0][i], b[0][i])]

    tally.run("AdamW bf16 params with stochastic rounding (no masters)", stochastic_rounding)

    for momentum, nesterov in ((0.0, False), (0.9, False), (0.9, True)):
        def sgd(momentum=momentum, nesterov=nesterov):
            params, _, _, _, models, grads = adam_case(8, sizes)
            bufs = [torch.randn(p.shape) for p in params] if momentum else []
            first = [i % 2 == 0 for i in range(len(params))]
            a = [on(params, dev), on(bufs, dev), on(models, dev), on(grads, dev)]
            b = [clones(params), clones(bufs), clones(models), clones(grads)]
            D.fused_sgd_step_(*a, first, torch.tensor([0.25], device=dev), torch.tensor([0.0], device=dev),
                              None, 0.05, momentum, 0.1, 1e-4, nesterov, False)
            T.fused_sgd_step_(*b, first, torch.tensor([0.25]), torch.tensor([0.0]), None, 0.05,
                              momentum, 0.1, 1e-4, nesterov, False)
            return [f"list {k} tensor {i}" for k in range(3)
                    for i, (x, y) in enumerate(zip(a[k], b[k])) if not same_bits(x, y)]

        tally.run(f"SGD momentum={momentum} nesterov={nesterov}", sgd)
    tally.done()


def exact_sumsq_ref(values):
    """The exact sum of squares of the finite float32 values (Python floats) as an integer in
    units of 2^-298 (r = n / 2^k: r^2 2^298 = n^2 2^(298 - 2k)), and its 26 base-2^24 digits."""
    x = 0
    for r, count in collections.Counter(values).items():
        if math.isfinite(r) and r != 0.0:
            n, d = r.as_integer_ratio()
            x += count * ((n * n) << (298 - 2 * (d.bit_length() - 1)))
    digits = [float((x >> (24 * i)) & 0xFFFFFF) for i in range(25)] + [float(x >> 600)]
    return x, digits


def compare_exact(ctx, rows, sizes):
    """grad_sumsq_exact (the normalized digits of the exact sum of squares) and
    exact_sumsq_to_double against the CPU twin and a Python big-integer reference: bit for bit,
    and the same digits for the same values split and ordered otherwise."""
    dev, D, T = ctx.device, ctx.dev_ops, ctx.twin
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    tally = Tally(rows, "grad_sumsq_exact, exact_sumsq_to_double: device = twin = exact",
                  "digits and the float64 bitwise; any split or order the same")
    for k, (dts, scale) in enumerate([(dtypes, None), (dtypes, 0.37), ((dtypes[0],), 2.0**-20),
                                      ((dtypes[1],), 2.0**20), ((dtypes[2],), None)]):
        ts = make_list(200 + k, sizes, dts, specials=True)
        # the float32 extremes: 2^-149, FLT_MAX, a subnormal
        for t in [t for t in ts if t.dtype == torch.float32 and t.numel() > 4]:
            t[1], t[2], t[3] = 2.0**-149, -3.4028234663852886e38, -3.0e-39

        def one(ts=ts, scale=scale):
            sc = None if scale is None else torch.tensor([scale], dtype=torch.float32)
            rd = D.grad_sumsq_exact(on(ts, dev), None if sc is None else sc.to(dev))
            rt = T.grad_sumsq_exact(clones(ts), sc)
            values = []
            for t in ts:
                v = t.double().reshape(-1) if scale is None else t.double().reshape(-1) * f32(scale)
                values += v.to(torch.float32).double().tolist()
            x, digits = exact_sumsq_ref(values)
            problems = []
            if rd.cpu().tolist() != digits:
                problems.append("device digits differ from the big-integer reference")
            if rt.tolist() != digits:
                problems.append("twin digits differ from the big-integer reference")
            cd = float(D.exact_sumsq_to_double(rd).cpu())
            ct = float(T.exact_sumsq_to_double(rt))
            ref = x / (1 << 298)  # correctly rounded
            if not (cd == ct == ref == math.fsum(r * r for r in values if math.isfinite(r))):
                problems.append(f"to_double: device {cd!r}, twin {ct!r}, reference {ref!r}")
            # the same values as one tensor per dtype, reversed: the same digits
            merged = [torch.cat([t.reshape(-1) for t in ts if t.dtype == d]).flip(0)
                      for d in dtypes if any(t.dtype == d for t in ts)][::-1]
            rm = D.grad_sumsq_exact(on(merged, dev), None if sc is None else sc.to(dev))
            if not torch.equal(rm.cpu(), rd.cpu()):
                problems.append("another split and order gave other digits")
            return problems

        tally.run(f"{'mixed' if len(dts) > 1 else dts[0]} scale={scale}", one)
    tally.done()


def compare_huge(ctx, rows):
    """grad_stats_ over a list of > 2^31 elements in total (one tensor alone > 2^31), against
    the CPU twin and float64 computed chunk by chunk."""
    check = "grad_stats over > 2^31 elements: device = CPU twin = float64"
    if ctx.dry:
        rows.add(check, "SKIP", note="dry run: > 2^31 elements (4 GiB of fp16) is for the GPU run")
        return
    n_big, n_small = 2**31 + 9, 4097
    need = (n_big + n_small) * 2
    free, _ = torch.cuda.mem_get_info()
    try:
        avail_host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError):
        avail_host = 0
    if free < 3 * need or avail_host < 4 * need:
        rows.add(check, "SKIP", note=f"needs {3 * need / GiB:.0f} GiB free on the GPU "
                 f"(free {free / GiB:.0f}) and {4 * need / GiB:.0f} GiB on the host (free {avail_host / GiB:.0f})")
        return
    tally = Tally(rows, check, "values bitwise; found_inf, zeros exact; sumsq rel 2e-5")

    def one():
        g = torch.Generator(device="cuda").manual_seed(3)
        small = torch.randn(n_small, generator=g, device="cuda").half()
        big = torch.empty(n_big, dtype=torch.float16, device="cuda")
        chunk = 2**28
        for s in range(0, n_big, chunk):
            e = min(n_big, s + chunk)
            big[s:e] = torch.randn(e - s, generator=g, device="cuda").half()
        big[n_big - 3] = math.inf  # past the 2^31 boundary
        big[2**31 - 1] = 0.0
        src_small, src_big = small.clone(), big.clone()  # pristine copies (the op is in place)
        host_small, host_big = small.cpu(), big.cpu()  # the twin's inputs
        scale = 0.5
        rd = ctx.dev_ops.grad_stats_([small, big], torch.tensor([scale], device="cuda"), [True, True],
                                     True, False)
        rt = ctx.twin.grad_stats_([host_small, host_big], torch.tensor([scale]), [True, True], True,
                                  False)
        ctx.sync()
        problems = []
        zeros = 0
        # float64 model on the GPU, chunk by chunk; the twin's chunks are compared there too
        for src, dst_d, dst_t in ((src_small, small, host_small), (src_big, big, host_big)):
            for s in range(0, src.numel(), chunk):
                e = min(src.numel(), s + chunk)
                w = written_ref(src[s:e], scale, torch.float16)
                if not same_bits(w, dst_d[s:e]):
                    problems.append(f"values [{s}:{e}] differ from float64")
                if not same_bits(w, dst_t[s:e]):
                    problems.append(f"twin values [{s}:{e}] differ from float64")
                zeros += int((w == 0).sum())
        for who, r in (("device", rd), ("twin", rt)):
            if float(r[0].cpu()[0]) != 1.0:
                problems.append(f"{who}: found_inf not set")
            if int(r[3].cpu()) != zeros:
                problems.append(f"{who}: zeros {int(r[3].cpu())} vs {zeros}")
            if math.isfinite(float(r[1].cpu())):
                problems.append(f"{who}: sumsq finite with an inf in the list")
        return problems

    tally.run(f"[{n_small}, {n_big}] fp16, inf past 2^31, scale 0.5", one)
    tally.done()


# --------------------------------------------------------------------------------------------
# errors: a rejected call must raise, not crash. Each launcher formats the bad value into its
# message (c10::str, std::ostream); a module linked with its own copy of libstdc++ crashes there
# (the first GPU run, 2026-11-27: SIGSEGV in std::ostream inside tpamp._C), which would kill
# every later test that checks an error. Each probe runs in its own process.

_ERROR_PROBE = """
import sys, torch
from tpamp import ops
ops.extension_available()  # loads the kernel modules
x = torch.ones(4, device=sys.argv[1])
try:
    torch.ops.tpamp.grad_stats_([x], None, [True, True], True, True)
except RuntimeError as e:
    print("RAISED:", str(e).splitlines()[0])
else:
    print("NO ERROR")
"""


def _toolchain_facts():
    """What says whether a module carries its own C++ runtime: the compiler, and per built module
    whether it needs the shared libstdc++ and whether libstdc++'s own code is inside it."""
    facts = [f"CXX={os.environ.get('CXX', '(unset: c++)')}"]
    readelf, nm = shutil.which("readelf"), shutil.which("nm")
    for path in sorted(glob.glob(os.path.join(ROOT, "tpamp", "_C*.so"))):
        name = os.path.basename(path).split(".")[0]
        bits = []
        if readelf:
            dyn = subprocess.run([readelf, "-d", path], capture_output=True, text=True).stdout
            bits.append("needs libstdc++.so" if "libstdc++.so" in dyn else "NO libstdc++.so needed")
        if nm:
            syms = subprocess.run([nm, "-C", "--defined-only", path], capture_output=True,
                                  text=True, errors="replace").stdout
            inside = sum(k in syms for k in ("read_utf8_code_point", "std::locale::_Impl::"))
            bits.append(f"libstdc++ code inside: {'yes' if inside else 'no'}")
        facts.append(f"{name}: {', '.join(bits) or 'no readelf/nm'}")
    return "; ".join(facts)


def part_errors(ctx, rows):
    """A call each launcher rejects (mask longer than the list) must raise RuntimeError naming
    the bad value, in a process of its own."""
    devices = ["cpu"] if ctx.dry else ["cpu", "cuda"]
    for dev in devices:
        check = f"error path: {dev} launcher raises, does not crash"
        want = "mask has 2 entries, grads has 1"
        if dev == "cpu" and not ops.extension_available("cpu"):
            rows.add(check, "SKIP", note=f"the CPU kernels are not built: {_ext.status()}")
            continue
        if dev == "cuda" and gpu_ready():
            rows.add(check, "SKIP", note=gpu_ready())
            continue
        try:
            r = subprocess.run([sys.executable, "-c", _ERROR_PROBE, dev], capture_output=True,
                               text=True, timeout=120, cwd=ROOT)
        except subprocess.TimeoutExpired:
            rows.add(check, "FAIL", "hung (120 s)", "RuntimeError naming the value")
            continue
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith(("RAISED", "NO ERROR"))), "")
        if r.returncode == 0 and line.startswith("RAISED") and want in line:
            rows.add(check, "PASS", line[len("RAISED: "):][:90], "RuntimeError naming the value")
        else:
            how = (f"crashed (signal {-r.returncode})" if r.returncode < 0 else
                   f"rc {r.returncode}: {line or r.stderr.strip().splitlines()[-1:]}")
            rows.add(check, "FAIL", how, "RuntimeError naming the value", _toolchain_facts()[:600])
            print(r.stderr[-3000:], flush=True)


def part_compare(ctx, rows):
    if not ctx.dry:
        why = gpu_ready()
        if why:
            rows.add("kernel comparisons", "SKIP", note=why)
            return
    if not ops.extension_available("cpu"):
        rows.add("kernel comparisons", "SKIP", note=f"the CPU kernels are not built: {_ext.status()}")
        return
    rows.add("compared", "INFO", f"device side: {ctx.dev_name}; twin: CPU kernels "
             f"({_ext.status().get('cpu_module')}); reference: float64")
    if ctx.dry or ctx.small:
        sizes = [0, 1, 3, 9, 0, 31, 201, 513, 1031, 5, 0]
    else:
        # empty first, in the middle and last; around the vector widths, the block stride, the
        # chunk (65536) and several chunks
        sizes = [0, 1, 3, 7, 8, 9, 0, 31, 513, 4095, 4097, 65535, 65536, 65537, 131075,
                 1_000_003, 5, 0]
    compare_grad_stats(ctx, rows, sizes)
    compare_copies(ctx, rows, sizes)
    compare_exact(ctx, rows, [n for n in sizes if n < 200_000])
    compare_steps(ctx, rows, [n for n in sizes if n < 200_000])
    if ctx.small:
        rows.add("grad_stats over > 2^31 elements: device = CPU twin = float64", "SKIP",
                 note="--small (the run under compute-sanitizer): the dry run's sizes")
    else:
        compare_huge(ctx, rows)


# --------------------------------------------------------------------------------------------
# graph: the sync-free step captured in a CUDA graph and replayed


def _sync_free_setup(device, shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter((torch.randn(s, generator=g) * 0.02).half().to(device)) for s in shapes]
    inner = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)
    opt = tpamp.MixedPrecisionOptimizer(
        inner, grad_scaler=tpamp.DynamicGradScaler(initial_scale=2.0**12, growth_interval=3,
                                                   device=device),
        clip_grad=1.0, log_num_zeros_in_grad=True, sync_free=True)
    return params, opt


def _grads_for(step, shapes, device, bad_step):
    g = torch.Generator().manual_seed(1000 + step)
    out = [(torch.randn(s, generator=g) * 8).half().to(device) for s in shapes]
    if step == bad_step:
        out[1].view(-1)[3] = math.inf  # overflow: the step is skipped on the device
    return out


def part_graph(ctx, rows):
    check = "sync-free step: graph replay = eager"
    if not ctx.dry:
        why = gpu_ready()
        if why:
            rows.add(check, "SKIP", note=why)
            return
    dev = ctx.device
    shapes = [(64, 48), (48,), (1000,), (3, 5, 7), (0,)] if ctx.dry else \
        [(4096, 1024), (1024,), (1_000_003,), (3, 5, 7), (0,), (8192, 256)]
    steps, bad = 8, 4
    pa, oa = _sync_free_setup(dev, shapes)  # replayed
    pb, ob = _sync_free_setup(dev, shapes)  # eager
    static = [torch.zeros(s, dtype=torch.float16, device=dev) for s in shapes]

    def step_a():
        # the step releases the fp16 .grad it consumed: the static grads are attached again
        # (on the host: a replayed graph reads the same tensors)
        for p, s in zip(pa, static):
            p.grad = s
        return oa.step()

    def eager_b(grads):
        for p, gr in zip(pb, grads):
            p.grad = gr
        return ob.step()

    try:
        # warm-up: the first step creates the optimizer state (torch's rule: warm up on a side
        # stream before capturing)
        warm = [_grads_for(-1 - k, shapes, dev, None) for k in range(2)]
        side = torch.cuda.Stream() if dev.type == "cuda" else None
        with (torch.cuda.stream(side) if side is not None else contextlib.nullcontext()):
            for w in warm:
                for s, x in zip(static, w):
                    s.copy_(x)
                step_a()
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)
        for w in warm:
            eager_b(w)
        if dev.type == "cuda":
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                result = step_a()
            replay = graph.replay
            how = "captured once, replayed"
        else:
            result = None
            replay = step_a
            how = "dry run: eager calls stand in for graph replay"
        problems = []
        for step in range(steps):
            grads = _grads_for(step, shapes, dev, bad)
            for s, x in zip(static, grads):
                s.copy_(x)
            r = replay()
            result = r if r is not None else result
            rb = eager_b(grads)
            ctx.sync()
            if not all(torch.equal(x, y) for x, y in zip(pa, pb)):
                problems.append(f"step {step}: model params differ")
            if not torch.equal(oa.get_loss_scale(), ob.get_loss_scale()):
                problems.append(f"step {step}: loss scale {float(oa.get_loss_scale())} vs "
                                f"{float(ob.get_loss_scale())}")
            if bool(result.update_successful) != bool(rb.update_successful):
                problems.append(f"step {step}: update_successful differs")
            if step == bad and bool(rb.update_successful):
                problems.append(f"step {step}: the overflow step was not skipped")
        mains_a = [p for g in oa.param_groups for p in g["params"]]
        mains_b = [p for g in ob.param_groups for p in g["params"]]
        if not all(torch.equal(x, y) for x, y in zip(mains_a, mains_b)):
            problems.append("fp32 main params differ")
        if problems:
            rows.add(check, "FAIL", f"{steps} steps ({how})", "bitwise equal, overflow skipped",
                     "; ".join(problems[:3]))
        else:
            rows.add(check, "PASS", f"{steps} steps incl. 1 overflow skip ({how})",
                     "bitwise equal, overflow skipped")
    except Exception as e:
        traceback.print_exc()
        rows.add(check, "FAIL", "raised", "bitwise equal, overflow skipped", f"{type(e).__name__}: {e}"[:300])


# --------------------------------------------------------------------------------------------
# bench: CUDA-event medians


def time_pair(fns, ctx, warmup, rounds, calls):
    """Per round, each fn timed over `calls` back-to-back calls (CUDA events; dry run: the host
    clock), in turn; returns (median ms per call of each fn, ratios, the times), ratios[k] being
    the median over rounds of time(fns[0]) / time(fns[k]) (paired: one round's calls run
    seconds apart, so slow drifts of the machine cancel)."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    ctx.sync()
    times = [[] for _ in fns]
    for _ in range(rounds):
        for k, fn in enumerate(fns):
            if ctx.device.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(calls):
                    fn()
                b.record()
                b.synchronize()
                times[k].append(a.elapsed_time(b) / calls)
            else:
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                times[k].append((time.perf_counter() - t0) * 1e3 / calls)
    medians = [statistics.median(t) for t in times]
    ratios = [statistics.median([x / y for x, y in zip(times[0], t)]) for t in times]
    return medians, ratios, times


def grad_shapes(numel, hidden):
    """GPT-like tensors (QKV, proj, fc1, fc2 weights and their biases, layer norms) adding up to
    about `numel` elements."""
    h = hidden
    layer = [(3 * h, h), (3 * h,), (h, h), (h,), (h,), (h,), (4 * h, h), (4 * h,), (h, 4 * h), (h,),
             (h,), (h,)]
    per = sum(math.prod(s) for s in layer)
    shapes = []
    for _ in range(max(1, numel // per)):
        shapes += layer
    return shapes


def part_bench(ctx, rows, args):
    if not ctx.dry:
        why = gpu_ready()
        if why:
            rows.add("timings", "SKIP", note=why)
            return
    dev = ctx.device
    label = "dry run, CPU host clock: not a GPU figure" if ctx.dry else "CUDA events"
    if ctx.dry:
        numel, hidden, rounds, calls, warmup = 200_000, 64, 3, 2, 1
    else:
        free, _ = torch.cuda.mem_get_info()
        # the stats pass holds 2 + 4 bytes per element (fp16 grads, fp32 outputs) and the copy
        # 2 x 3: fill about 45% of the free memory (far beyond the 50 MiB L2)
        numel = int(min(free * 0.45 / 12, 4e9))
        hidden, rounds, calls, warmup = 4096, args.rounds, 5, 3
    shapes = grad_shapes(numel, hidden)
    numel = sum(math.prod(s) for s in shapes)
    print(f"grad-stats pass: {len(shapes)} tensors, {numel / 1e6:.0f}M elements ({label})", flush=True)

    bench_stats(ctx, rows, shapes, numel, warmup, rounds, calls, label)
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    # 2. the one-pass fp16 -> fp32-master AdamW step against AdamW(fused=True) on fp32 params
    if ctx.dry:
        n_step = 200_000
    else:
        free, _ = torch.cuda.mem_get_info()
        # one-pass: 4 (master) + 8 (moments) + 2 (fp16 grad) + 2 (model) bytes; AdamW: 4 x 4
        n_step = int(min(free * 0.4 / 32, 1.5e9))
    sshapes = grad_shapes(n_step, hidden)
    bench_adam(ctx, rows, sshapes, warmup, rounds, calls, label)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    bench_megatron(ctx, rows, sshapes[: max(12, len(sshapes) // 2)], warmup, rounds, label)


def bench_stats(ctx, rows, shapes, numel, warmup, rounds, calls, label):
    """The grad-stats pass (fp16 grads -> fp32 main grads x 1/scale, found_inf, L2 statistic over
    a mask, zero count) against a device-to-device copy of the same bytes, paired."""
    dev = ctx.device
    try:
        grads = [torch.randn(s, device=dev).half() for s in shapes]
        outs = [torch.empty(s, dtype=torch.float32, device=dev) for s in shapes]
        mask = [i % 12 not in (4, 5, 9, 10, 11) for i in range(len(shapes))]
        inv = torch.tensor([2.0**-16], device=dev)
        nbytes = numel * 6  # read 2, write 4
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)

        def stats():
            ops.grad_stats(grads, out=outs, scale=inv, norm_mask=mask, norm_type=2.0, count_zeros=True)

        (t_copy, t_stats), (_, r_stats), _ = time_pair([lambda: dst.copy_(src), stats], ctx,
                                                       warmup, rounds, calls)
        frac = r_stats  # median over rounds of copy_ms / stats_ms for the same bytes
        status = "INFO" if ctx.dry else ("PASS" if frac >= 0.85 else "FAIL")
        rows.add("grad-stats pass / copy bandwidth", status,
                 f"{100 * frac:.1f}% (stats {t_stats:.3f} ms, copy {t_copy:.3f} ms, "
                 f"{nbytes / GiB:.2f} GiB; copy {nbytes / (t_copy * 1e-3) / 1e9:.0f} GB/s)",
                 ">= 85%", label)
    except Exception as e:
        traceback.print_exc()
        rows.add("grad-stats pass / copy bandwidth", "FAIL", "raised", ">= 85%", f"{type(e).__name__}: {e}"[:300])


def bench_adam(ctx, rows, sshapes, warmup, rounds, calls, label):
    """tpamp.ops.fused_adam_step_ (fp16 grads x scale, fp32 masters and moments, fp16 model
    params written) against torch.optim.AdamW(fused=True).step() on fp32 params, paired."""
    dev = ctx.device
    n_step = sum(math.prod(s) for s in sshapes)
    try:
        masters = [torch.randn(s, device=dev) * 0.02 for s in sshapes]
        models = [m.half() for m in masters]
        g16 = [torch.randn(s, device=dev).half() for s in sshapes]
        m1 = [torch.zeros_like(m) for m in masters]
        v1 = [torch.zeros_like(m) for m in masters]
        st = [torch.zeros((), device=dev) for _ in masters]
        scale = torch.tensor([2.0**-16], device=dev)
        found = torch.zeros(1, device=dev)
        fp32 = [torch.nn.Parameter(m.clone()) for m in masters]
        for p in fp32:
            p.grad = torch.randn_like(p) * 1e-3
        adamw = torch.optim.AdamW(fp32, lr=1e-4, weight_decay=0.01, fused=True)

        def one_pass():
            ops.fused_adam_step_(masters, g16, m1, v1, st, model_params=models, grad_scale=scale,
                                 found_inf=found, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8,
                                 weight_decay=0.01, decoupled_weight_decay=True)

        (t_one, t_fused), (_, r), _ = time_pair([one_pass, adamw.step], ctx, warmup, rounds,
                                                max(1, calls // 2))
        ratio = r  # median over rounds of one_pass_ms / fused_ms
        status = "INFO" if ctx.dry else ("PASS" if ratio <= 1.1 else "FAIL")
        rows.add("one-pass AdamW step / AdamW(fused=True) fp32", status,
                 f"{ratio:.3f}x paired (one-pass {t_one:.3f} ms, fused {t_fused:.3f} ms, "
                 f"{n_step / 1e6:.0f}M params; 28 bytes/param each)", "<= 1.1x", label)
    except Exception as e:
        traceback.print_exc()
        rows.add("one-pass AdamW step / AdamW(fused=True) fp32", "FAIL", "raised", "<= 1.1x",
                 f"{type(e).__name__}: {e}"[:300])


def bench_megatron(ctx, rows, shapes, warmup, rounds, label):
    """The whole tpamp step (MixedPrecisionOptimizer, DynamicGradScaler, clip, zero count, the
    one-pass path) against megatron-core's Float16OptimizerWithFloat16Params around
    AdamW(fused=True) with the same settings, paired."""
    check = "tpamp step / megatron-core Float16Optimizer step"
    if ctx.dry:
        rows.add(check, "SKIP", note="dry run: megatron-core's optimizer needs CUDA (its CPU "
                 "run is scripts/bench_step.py with scripts/megatron_cpu.py)")
        return
    try:
        import megatron.core  # noqa: F401
        from megatron.core.optimizer.grad_scaler import DynamicGradScaler
        from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
        from megatron.core.optimizer.optimizer_config import OptimizerConfig
    except Exception as e:
        rows.add(check, "SKIP", note=f"megatron-core is not importable ({type(e).__name__}: {e}); "
                 "carry its wheel (docs/guide/kernels.md)")
        return
    import torch.distributed as dist

    dev = ctx.device
    try:
        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29517")
            dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev if dev.index is not None
                                    else torch.device("cuda", 0))
        group = dist.new_group([0])
        g = torch.Generator(device=dev).manual_seed(0)
        grads = [(torch.randn(s, generator=g, device=dev) * (1e-3 * 2**16)).half() for s in shapes]

        def params():
            g = torch.Generator(device=dev).manual_seed(1)
            return [torch.nn.Parameter((torch.randn(s, generator=g, device=dev) * 0.02).half())
                    for s in shapes]

        pt = params()
        ot = tpamp.MixedPrecisionOptimizer(
            torch.optim.AdamW(pt, lr=1e-4, weight_decay=0.01, fused=True),
            grad_scaler=tpamp.DynamicGradScaler(initial_scale=2.0**16, growth_interval=10**6, device=dev),
            clip_grad=1.0, log_num_zeros_in_grad=True, grad_stats_group=group)
        pm = params()
        config = OptimizerConfig(optimizer="adam", fp16=True, bf16=False, clip_grad=1.0,
                                 log_num_zeros_in_grad=True)
        scaler = DynamicGradScaler(initial_scale=2.0**16, min_scale=1.0, growth_factor=2.0,
                                   backoff_factor=0.5, growth_interval=10**6, hysteresis=2)
        om = Float16OptimizerWithFloat16Params(
            torch.optim.AdamW(pm, lr=1e-4, weight_decay=0.01, fused=True), config, scaler,
            lambda _: None)
        om.grad_stats_parallel_group = group
        om.tp_group = group

        def tp_step():
            for p, gr in zip(pt, grads):
                p.grad = gr
            ot.step()

        def mg_step():
            for p, gr in zip(pm, grads):
                p.grad = gr
            om.step()

        (t_t, t_m), (_, r), _ = time_pair([tp_step, mg_step], ctx, warmup, rounds, 1)
        ratio = r  # median over rounds of tpamp_ms / megatron_ms
        from importlib.metadata import version

        rows.add(check, "PASS" if ratio <= 0.5 else "FAIL",
                 f"{ratio:.3f}x paired (tpamp {t_t:.2f} ms, megatron-core {version('megatron-core')} "
                 f"{t_m:.2f} ms, {sum(math.prod(s) for s in shapes) / 1e6:.0f}M params)", "<= 0.5x", label)
    except Exception as e:
        traceback.print_exc()
        rows.add(check, "FAIL", "raised", "<= 0.5x", f"{type(e).__name__}: {e}"[:300])


# --------------------------------------------------------------------------------------------
# train: the main job's summary


def part_train(ctx, rows):
    d = os.path.join(ctx.out, "train")
    path = os.path.join(d, "summary.json")
    where = "CPU, gloo, world 1 (dry run)" if ctx.dry else "1 GPU, NCCL, world 1"
    if not os.path.exists(path):
        rows.add("train_gpt.py short run", "FAIL", "no summary.json", "finite falling loss",
                 f"{where}; see train.log")
        return
    with open(path, encoding="utf-8") as f:
        s = json.load(f)
    first, last, val = s.get("first_train_loss"), s.get("final_train_loss"), s.get("final_validation_loss")
    ok = all(isinstance(x, (int, float)) and math.isfinite(x) for x in (first, last, val)) and last < first
    rows.add("train_gpt.py short run", "PASS" if ok else "FAIL",
             f"loss {first:.4f} -> {last:.4f}, validation {val:.4f}, {s.get('iterations')} it in "
             f"{s.get('wall_time_s')} s, skipped {s.get('skipped_iterations')}, {s.get('dtype')}",
             "finite, falling", where)


# --------------------------------------------------------------------------------------------
# table


def part_table(ctx):
    steps = []
    path = os.path.join(ctx.out, "steps.tsv")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            steps = [line.rstrip("\n").split("\t") for line in f if line.strip()]
    if any(s[0] == "train_run" and s[1] != "skip" for s in steps):
        part_train(ctx, Rows(ctx.out, "train_run"))  # the main job's loss, from its summary.json
    rows = []
    for name, rc, secs, note in steps:
        status = "INFO" if name == "total" else "PASS" if rc == "0" else "SKIP" if rc == "skip" else "FAIL"
        rows.append(dict(part=name, check=f"step {name}", status=status, value=f"rc {rc}, {secs} s",
                         target="", note=note))
        # the dry run's one Python step "parts" wrote the rows of env, errors, compare, graph
        # and bench; the sanitizer steps' rows are in their own folders (not in the table)
        for part in (("env", "errors", "compare", "graph", "bench") if name == "parts" else (name,)):
            p = os.path.join(ctx.out, f"{part}.json")
            if os.path.exists(p):
                with open(p, encoding="utf-8") as f:
                    rows += json.load(f)
    counts = {k: sum(r["status"] == k for r in rows) for k in ("PASS", "FAIL", "SKIP", "INFO")}
    with open(os.path.join(ctx.out, "table.json"), "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=1)
    w = max([len(r["check"]) for r in rows] + [10])
    print()
    print(f"== gpu_check: {ctx.out} ({'DRY RUN: CPU stand-ins, no GPU figure' if ctx.dry else 'GPU run'})")
    print(f"{'status':<6}  {'check':<{w}}  value [target] note")
    for r in rows:
        tgt = f" [target {r['target']}]" if r["target"] else ""
        note = f"  -- {r['note']}" if r["note"] else ""
        print(f"{r['status']:<6}  {r['check']:<{w}}  {r['value']}{tgt}{note}")
    print(f"== {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped, "
          f"{counts['INFO']} info")
    return 1 if counts["FAIL"] else 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("parts", nargs="+", choices=PARTS, metavar="PART",
                   help=f"one or more of {', '.join(PARTS)} (run in this order, in one process)")
    p.add_argument("--out", required=True, help="the output folder (gpu_check.sh's argument)")
    p.add_argument("--dry-run", action="store_true", help="CPU stand-ins, small sizes")
    p.add_argument("--rounds", type=int, default=15, help="bench: timed rounds (default 15)")
    p.add_argument("--small", action="store_true",
                   help="compare: the dry run's sizes on the GPU (the run under compute-sanitizer)")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.parts == ["table"]:
        return part_table(argparse.Namespace(out=args.out, dry=args.dry_run))
    if "table" in args.parts:
        p.error("table runs alone (it is the last step)")
    ctx = Ctx(args)
    failed = False
    for part in args.parts:
        torch.manual_seed(0)
        rows = Rows(args.out, part)
        {"env": part_env, "errors": part_errors, "compare": part_compare, "graph": part_graph,
         "bench": lambda c, r: part_bench(c, r, args)}[part](ctx, rows)
        failed |= any(r["status"] == "FAIL" for r in rows.rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
