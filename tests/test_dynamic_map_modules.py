"""The uint8 moment format (docs/spec.md section 9) in every CPU capability module: the AVX-512
and AVX2 decade-piece arithmetic (AVX-512: with the VBMI byte-permute decode where the CPU has it,
and with it turned off by TPAMP_DISABLE_VBMI=1), the scalar path of the default module
(csrc/cpu/dynamic_map_simd.h) give the codes of the rule written again in numpy
(tests/test_dynamic_map.py: nearest map entry by exhaustive search) at every float32 threshold
of both maps and at its neighbours, on random blocks, short blocks, all-zero blocks, -0.0,
subnormals, +-inf and NaN; and the bits of the emulated CUDA launcher (the table search of
csrc/kernels/optimizer_step.h, unchanged) on the same steps. Each module runs in a subprocess
(ATEN_CPU_CAPABILITY selects it; "avx512-novbmi" is the AVX-512 module with
TPAMP_DISABLE_VBMI=1); modules this CPU cannot run are skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import simt_utils
import torch
from test_dynamic_map import numpy_encode

from tpamp import ops
from tpamp import state_formats as sf

U8 = torch.uint8
SIMT = simt_utils.load()
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
F32 = np.float32


def qmap(signed):
    """The float32 map (torchao's values; test_dynamic_map.py checks them against numpy's)."""
    return sf.dynamic_map(signed).numpy()


def _code(q, y):
    """The rule on a float32 array y (no NaN): largest c with q[c] <= y (0 when none), up one
    when y - q[c] >= (q[c+1] - q[c]) * 0.5 in float32; q the 256 float32 entries."""
    c = np.maximum(np.searchsorted(q, y, side="right") - 1, 0)
    cu = np.minimum(c + 1, 255)
    with np.errstate(invalid="ignore", over="ignore"):
        up = ((y - q[c]).astype(F32) >= ((q[cu] - q[c]).astype(F32) * F32(0.5))) & (c < 255)
    return c + up


def _ordered(y):
    b = y.astype(F32).view(np.int32).astype(np.int64)
    return np.where(b < 0, -(b & 0x7FFFFFFF) - 1, b)


def _from_ordered(k):
    b = np.where(k < 0, -(k + 1) | np.int64(-(1 << 31)), k)
    return b.astype(np.int32).view(F32)


def thresholds(signed):
    """T[c], c = 0..254: the smallest float32 whose code is above c (bisection over the float32
    bit patterns, all c at once); independent of the kernels' tables."""
    q = qmap(signed)
    c = np.arange(255)
    lo = np.full(255, _ordered(np.array([-np.inf]))[0])
    hi = np.full(255, _ordered(np.array([np.inf]))[0])
    while np.any(hi - lo > 1):
        mid = (lo + hi) // 2
        above = _code(q, _from_ordered(mid)) > c
        hi, lo = np.where(above, mid, hi), np.where(above, lo, mid)
    t = _from_ordered(hi)
    assert np.all(_code(q, t) > c) and np.all(_code(q, _from_ordered(hi - 1)) <= c)
    return t


def _neighbours(t, k=2):
    """t and its k float32 neighbours on each side."""
    key = _ordered(t)
    return np.concatenate([_from_ordered(key + d) for d in range(-k, k + 1)])


def _signed_blocks():
    """exp_avg values (the step stores the grad itself): every threshold and its neighbours in
    blocks with max |x| = 1 (so y = x), the same scaled by 2^-20 (y = x / absmax again exactly),
    random blocks over many magnitudes, -0.0 and subnormals, a zero block, a short last block."""
    y = _neighbours(thresholds(True))
    y = y[np.abs(y) <= 1]
    per = 255
    pad = -y.size % per
    y = np.concatenate([y, np.zeros(pad, F32)]).reshape(-1, per)
    blocks = np.concatenate([np.ones((y.shape[0], 1), F32), y], axis=1)
    scaled = blocks * F32(2.0 ** -20)
    g = np.random.default_rng(0)
    rnd = (g.standard_normal((64, 256)) * 10.0 ** g.uniform(-18, 18, (64, 1))).astype(F32)
    rnd[3, ::2] = -0.0
    rnd[4] = 0.0
    rnd[5, :] = np.float32(1e-45) * np.arange(256, dtype=F32)  # subnormals
    rnd[6, :] = -rnd[5, :]
    x = np.concatenate([blocks.reshape(-1), scaled.reshape(-1), rnd.reshape(-1)])
    return x[: x.size - 37]  # a short last block


def _unsigned_blocks():
    """exp_avg_sq values v = g * g (exact in float32 for the grads chosen): for every threshold
    t of the unsigned map and its neighbours, a block [G, g] whose y = fl(fl(g^2) / fl(G^2))
    is exactly that value (a search over G and g near sqrt(t * G^2)); so the step
    encodes y at every threshold. Returns the grads."""
    targets = _neighbours(thresholds(False))
    targets = targets[(targets > 0) & (targets <= 1)]
    grads = []
    # G off the powers of two, so that fl(g^2) / G^2 does not stay on g^2's lattice
    big = np.concatenate([_from_ordered(_ordered(np.array([b], F32)) + np.arange(16))
                          for b in (0.75, 0.6, 0.9, 0.55, 0.8)])
    a = (big * big).astype(F32)
    for t in targets:
        found = None
        for gb, ab in zip(big, a):
            c = F32(np.sqrt(np.float64(t) * np.float64(ab)))
            key = _ordered(np.array([c]))[0]
            cand = _from_ordered(key + np.arange(-12, 13))
            ys = ((cand * cand).astype(F32) / ab).astype(F32)
            hit = np.nonzero(ys.view(np.int32) == np.array([t], F32).view(np.int32)[0])[0]
            if hit.size:
                found = (gb, cand[hit[0]])
                break
        assert found is not None, t
        grads.append(found)
    g = np.zeros((len(grads), 256), F32)
    g[:, 0] = [p[0] for p in grads]
    g[:, 1] = [p[1] for p in grads]
    return g.reshape(-1), targets


CHILD = r"""
import sys, torch
from tpamp import _ext, ops
torch.set_num_threads(1)
ops.extension_available()
inp = torch.load(sys.argv[1])
out = {"module": _ext.status()["cpu_module"]}
def step(g, m, v, ms, vs, beta1, beta2, lr):
    p = torch.zeros(g.numel())
    torch.ops.tpamp.fused_adam_step_([p], [m], [v], [torch.zeros(1)], [], [g], None, None, None,
                                     lr, beta1, beta2, 1e-8, 0.0, True, False, [ms], [vs])
    return p
for name, g in inp["grads"].items():
    n = g.numel(); nb = ops.moment_blocks(n)
    m, v = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    ms, vs = torch.zeros(nb), torch.zeros(nb)
    step(g, m, v, ms, vs, 0.0, 0.0, 1e-3)  # exp_avg = g, exp_avg_sq = g * g, exactly
    out[name] = [m.clone(), ms.clone(), v.clone(), vs.clone()]
    # beta1 = beta2 = 1: the moments decoded and encoded again unchanged in value
    step(g, m, v, ms, vs, 1.0, 1.0, 0.0)
    out[name + "/again"] = [m.clone(), ms.clone(), v.clone(), vs.clone()]
    # a usual step on the stored state: decode, update, encode
    p = step(g, m, v, ms, vs, 0.9, 0.95, 1e-3)
    out[name + "/step"] = [m, ms, v, vs, p]
    # three steps from zero state with torch's default betas (exp_avg_sq blocks holding inf
    # where g * g overflows: negative scales, read back through the block loop)
    m, v = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    ms, vs = torch.zeros(nb), torch.zeros(nb)
    for _ in range(3):
        step(g, m, v, ms, vs, 0.9, 0.999, 1e-3)
    out[name + "/usual"] = [m, ms, v, vs]
torch.save(out, sys.argv[2])
"""


def _inputs():
    g_signed = torch.from_numpy(_signed_blocks())
    g_unsigned, _ = _unsigned_blocks()
    special = torch.randn(256 * 6 + 11, generator=torch.Generator().manual_seed(1))
    special[5] = float("inf")  # block 0: exp_avg and exp_avg_sq NaN (inf * 0 in the lerps)
    special[256 + 7] = float("nan")  # block 1: NaN
    special[512 + 3] = -float("inf")
    special[768:1024] = -0.0
    special[1024:1280] = 1e30  # squares overflow: torch.lerp(0, inf, 1) = NaN in exp_avg_sq
    overflow = torch.randn(65536 + 256 * 3 + 11, generator=torch.Generator().manual_seed(2))
    overflow[[3, 256 + 255, 65536 + 256 + 7]] = 1e30  # exp_avg_sq inf with beta2 < 1
    overflow[[256 * 4 + 1, 65536 + 5]] = 1e4
    overflow[256 * 6: 256 * 7] = 0.0
    overflow[256 * 7: 256 * 8] = 1e-30  # g * g underflows to 0 beside
    overflow[256 * 7 + 9] = 1e30
    return {"signed": g_signed, "unsigned": torch.from_numpy(g_unsigned), "special": special,
            "overflow": overflow}


def _run_module(capability, inputs, tmp_path):
    path_in, path_out = tmp_path / "in.pt", tmp_path / f"out_{capability}.pt"
    torch.save({"grads": inputs}, path_in)
    module, _, variant = capability.partition("-")
    env = dict(os.environ, ATEN_CPU_CAPABILITY=module, PYTHONPATH=ROOT)
    env.pop("TPAMP_DISABLE_VBMI", None)
    if variant == "novbmi":
        env["TPAMP_DISABLE_VBMI"] = "1"
    res = subprocess.run([sys.executable, "-c", CHILD, str(path_in), str(path_out)], env=env,
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = torch.load(path_out)
    if out["module"] != f"tpamp._C_cpu_{module}":
        pytest.skip(f"{capability} module not loaded on this CPU ({out['module']})")
    return out


def _simt(inputs):
    out = {}
    call = SIMT.fused_adam_step_

    def step(g, m, v, ms, vs, beta1, beta2, lr):
        p = torch.zeros(g.numel())
        call([p], [m], [v], [torch.zeros(1)], [], [g], None, None, None, lr, beta1, beta2,
             1e-8, 0.0, True, False, [ms], [vs])
        return p

    for name, g in inputs.items():
        n = g.numel()
        nb = ops.moment_blocks(n)
        m, v = torch.zeros(n, dtype=U8), torch.zeros(n, dtype=U8)
        ms, vs = torch.zeros(nb), torch.zeros(nb)
        step(g, m, v, ms, vs, 0.0, 0.0, 1e-3)
        out[name] = [m.clone(), ms.clone(), v.clone(), vs.clone()]
        step(g, m, v, ms, vs, 1.0, 1.0, 0.0)
        out[name + "/again"] = [m.clone(), ms.clone(), v.clone(), vs.clone()]
        m, v = torch.zeros(n, dtype=U8), torch.zeros(n, dtype=U8)
        ms, vs = torch.zeros(nb), torch.zeros(nb)
        for _ in range(3):
            step(g, m, v, ms, vs, 0.9, 0.999, 1e-3)
        out[name + "/usual"] = [m, ms, v, vs]
    return out


def _bits_equal(a, b):
    if a.dtype == torch.float32:
        return torch.equal(a.view(torch.int32), b.view(torch.int32))
    return torch.equal(a, b)


@pytest.fixture(scope="module")
def inputs():
    return _inputs()


@pytest.mark.skipif(not ops.extension_available("cpu"), reason="CPU kernels not built")
@pytest.mark.parametrize("capability", ["default", "avx2", "avx512", "avx512-novbmi"])
def test_module_encodes_as_the_rule(capability, inputs, tmp_path):
    native = torch.backends.cpu.get_cpu_capability().lower()
    if capability.startswith("avx512") and native != "avx512":
        pytest.skip(f"this CPU is {native}")
    if capability == "avx2" and native not in ("avx2", "avx512"):
        pytest.skip(f"this CPU is {native}")
    out = _run_module(capability, inputs, tmp_path)
    # the exact step against the numpy rule: every signed threshold (exp_avg = g) and every
    # unsigned one (exp_avg_sq = g * g)
    for name in ("signed", "unsigned"):
        x = inputs[name].numpy()
        m, ms, v, vs = out[name]
        rc, rs = numpy_encode(x, True, qmap(True))
        np.testing.assert_array_equal(m.numpy(), rc)
        np.testing.assert_array_equal(ms.numpy(), rs)
        rc, rs = numpy_encode((x * x).astype(F32), False, qmap(False))
        np.testing.assert_array_equal(v.numpy(), rc)
        np.testing.assert_array_equal(vs.numpy(), rs)
    # the unsigned thresholds are there: block b's element 1 encodes to y = its target exactly
    _, targets = _unsigned_blocks()
    v = out["unsigned"][2].numpy().reshape(-1, 256)[:, 1]
    np.testing.assert_array_equal(v, _code(qmap(False), targets))
    # decode and encode again (beta1 = beta2 = 1): the numpy rule on map[code] * scale
    for name in ("signed", "unsigned"):
        m0, ms0, v0, vs0 = out[name]
        m1, ms1, v1, vs1 = out[name + "/again"]
        for c0, s0, c1, s1, signed in ((m0, ms0, m1, ms1, True), (v0, vs0, v1, vs1, False)):
            q = qmap(signed).copy()
            if not signed:
                q[0] = q[1]  # exp_avg_sq's code 0 reads as code 1's entry
            vals = (q[c0.numpy().astype(np.int64)]
                    * np.repeat(s0.numpy(), 256)[: c0.numel()]).astype(F32)
            rc, rs = numpy_encode(vals, signed, qmap(signed))
            np.testing.assert_array_equal(c1.numpy(), rc)
            np.testing.assert_array_equal(s1.numpy(), rs)
    if SIMT is None:
        if simt_utils.REQUIRED:
            raise RuntimeError(simt_utils.skip_reason())
        return
    # the emulated CUDA launcher (the table search of optimizer_step.h): every bit equal, inf
    # blocks included. A block holding NaN has a NaN scale whose sign differs between the
    # vectorized modules (at::vec::maximum's all-ones NaN) and the scalar ones (as before this
    # encode): there only the rule itself is checked (codes 0 or 255, NaN scale).
    ref = _simt(inputs)
    for key, (am, ams, av, avs) in ref.items():
        bm, bms, bv, bvs = out[key][:4]
        for ac, asc, bc, bsc in ((am, ams, bm, bms), (av, avs, bv, bvs)):
            nan_block = torch.isnan(bsc)
            assert torch.equal(nan_block, torch.isnan(asc)), (capability, key)
            assert _bits_equal(asc[~nan_block], bsc[~nan_block]), (capability, key)
            keep = ~nan_block.repeat_interleave(256)[: ac.numel()]
            assert torch.equal(ac[keep], bc[keep]), (capability, key)
            assert bool(((bc[~keep] == 0) | (bc[~keep] == 255)).all()), (capability, key)
    # the special cases are there: NaN blocks of exp_avg (0 * inf in the lerp) and of
    # exp_avg_sq (the uint8 step's lerp is torch.lerp's, and torch.lerp(0, inf, 1) is NaN, as
    # in torchao's AdamW8bit); the saturation of an inf block (scale FLT_MAX) is checked on the
    # encode itself in test_dynamic_map.py
    assert torch.isnan(out["special"][1]).any()
    assert torch.isnan(out["special"][3]).any()
    # and exp_avg_sq blocks holding inf after usual steps (negative scales: 1e30's block)
    assert bool((out["overflow/usual"][3] < 0).any())


@pytest.mark.skipif(not ops.extension_available("cpu"), reason="CPU kernels not built")
def test_modules_agree_on_a_usual_step(inputs, tmp_path):
    """Decode, update, encode with beta1 = 0.9, beta2 = 0.95 on the stored state: the same codes
    and scales in every module this CPU runs (the moments' float32 math is the same in each;
    the param update is not compared: its division is rounded differently in the default
    module's emulated vectors)."""
    native = torch.backends.cpu.get_cpu_capability().lower()
    caps = {"avx512": ["default", "avx2", "avx512", "avx512-novbmi"],
            "avx2": ["default", "avx2"]}.get(
        native, ["default"])
    outs = [_run_module(c, inputs, tmp_path) for c in caps]
    for key in outs[0]:
        # (NaN blocks: see above; the first steps of "overflow" have beta2 = 0, whose lerp
        # makes 0 * inf)
        if ((key.endswith("/step") and not key.startswith(("special", "overflow")))
                or (key.endswith("/usual") and not key.startswith("special"))):
            for other in outs[1:]:
                for a, b in zip(outs[0][key][:4], other[key][:4]):
                    assert _bits_equal(a, b), (key, other["module"])
