"""The uint8 moment format (the dynamic quantization map, docs/spec.md section 9): its map and
encode against an independent numpy re-implementation (bitsandbytes' create_dynamic_map written
again here, nearest entry by exhaustive search), against torchao's quantization of the same
blocks when torchao imports (skipped otherwise), in the PyTorch reference
(tpamp.state_formats), the CPU kernel (torch.ops.tpamp) and the emulated CUDA launcher
(torch.ops.tpamp_simt) in every schedule order; conversions to and from the other formats; the
drift of a short AdamW run against the e4m3 format.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import simt_utils
import torch
from simt_utils import order  # noqa: F401  (fixture: every test runs in each schedule order)

import tpamp
from tpamp import ops
from tpamp import state_formats as sf

U8 = torch.uint8
SIMT = simt_utils.load()
needs_cpu_kernel = pytest.mark.skipif(not ops.extension_available("cpu"),
                                      reason="CPU kernels not built")
needs_simt = pytest.mark.skipif(SIMT is None, reason=simt_utils.skip_reason())


# -- the independent reference ------------------------------------------------------------------


def numpy_map(signed: bool) -> np.ndarray:
    """bitsandbytes' create_dynamic_map(signed, 7 exponent bits, 8 bits), written again with
    numpy: decade i = 0..6 holds the midpoints of 2^i (signed, each with its negative) or
    2^(i+1) (unsigned) equal steps of [0.1, 1], times 10^(i-6); plus 0 and 1; sorted."""
    vals = [0.0, 1.0]
    for i in range(7):
        k = 2 ** i if signed else 2 ** (i + 1)
        edges = 0.1 + 0.9 * np.arange(k + 1, dtype=np.float64) / k
        mids = (edges[:-1] + edges[1:]) / 2 * 10.0 ** (i - 6)
        vals += list(mids) + (list(-mids) if signed else [])
    return np.sort(np.array(vals, dtype=np.float64)).astype(np.float32)


def numpy_encode(x: np.ndarray, signed: bool, q=None):
    """codes, scales of float32 x (1-D) by the definition: blocks of 256, scale = max |x|,
    y = x / scale in float32 (an all-zero block: 0); c = the largest code with q[c] <= y (0 when
    none; exhaustive search over the 256 entries), plus one when y - q[c] >= (q[c+1] - q[c]) / 2
    in float32 (torchao's rounding rule). q: the float32 map (default :func:`numpy_map`)."""
    q = (numpy_map(signed) if q is None else np.asarray(q)).astype(np.float32)
    n = x.size
    nb = -(-n // 256)
    xp = np.zeros(nb * 256, dtype=np.float32)
    xp[:n] = x
    blocks = xp.reshape(nb, 256)
    scale = np.abs(blocks).max(axis=1).astype(np.float32)
    div = np.where(scale > 0, scale, np.float32(1)).astype(np.float32)
    y = (blocks / div[:, None]).astype(np.float32).reshape(-1)
    c = np.maximum((q[None, :] <= y[:, None]).sum(axis=1) - 1, 0)
    up_ok = c < 255
    cu = np.minimum(c + 1, 255)
    half = ((q[cu] - q[c]).astype(np.float32) * np.float32(0.5)).astype(np.float32)
    up = ((y - q[c]).astype(np.float32) >= half) & up_ok
    codes = (c + up).astype(np.uint8)
    return codes[:n], scale


def _blocks(seed, n=256 * 24):
    """Values over many magnitudes, signs, an all-zero block and exact map entries."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-9, 3, n // 256).repeat_interleave(256)
    x[256:512] = 0.0
    x[512:768] = x[512:768] ** 3  # heavy tails: most of the block far below its max
    return x


# -- the map --------------------------------------------------------------------------------


@pytest.mark.parametrize("signed", [True, False])
def test_map_is_the_dynamic_map(signed):
    q = sf.dynamic_map(signed)
    assert q.dtype == torch.float32 and q.shape == (256,)
    ref = numpy_map(signed)
    # numpy's float64 construction and torchao's float32 one (three float32 roundings) agree
    # to a few float32 ulps
    np.testing.assert_allclose(q.numpy(), ref, rtol=2 ** -21, atol=0)
    assert float(q[-1]) == 1.0 and (q[1:] > q[:-1]).all()
    assert (float(q[0]) == 0.0) == (not signed)
    if signed:
        assert int((q < 0).sum()) == 127 and float(q[0]) == pytest.approx(-0.99296875)


@pytest.mark.parametrize("signed", [True, False])
def test_map_equals_torchao(signed):
    quant_utils = pytest.importorskip("torchao.optim.quant_utils")
    ref = torch.tensor(quant_utils.create_dynamic_map(signed), dtype=torch.float32)
    # torchao's construction on this machine, whatever its capability
    assert torch.equal(sf.create_dynamic_map(signed), ref)
    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        assert torch.equal(sf.dynamic_map(signed), ref)


@pytest.mark.parametrize("signed", [True, False])
def test_fixed_map_is_the_construction_at_avx512(signed):
    """dynamic_map is fixed (the kernels' tables); torch's float32 construction gives it
    bit for bit at the AVX-512 capability, and within two float32 ulps per entry elsewhere
    (measured at the default capability: 2)."""
    fixed, built = sf.dynamic_map(signed), sf.create_dynamic_map(signed)
    ulps = (fixed.view(torch.int32).long() - built.view(torch.int32).long()).abs()
    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        assert int(ulps.max()) == 0
    assert int(ulps.max()) <= 2


# -- encode and decode: the reference --------------------------------------------------------


@pytest.mark.parametrize("signed", [True, False])
def test_reference_encode_matches_numpy(signed):
    x = _blocks(1)
    if not signed:
        x = x * x
    codes, scales = sf.encode_moment(x, U8, sqrt=not signed)
    rc, rs = numpy_encode(x.numpy(), signed)
    assert codes.dtype == U8
    np.testing.assert_array_equal(scales.numpy(), rs)
    np.testing.assert_array_equal(codes.numpy(), rc)
    # decode: map[code] x scale (exp_avg_sq: code 0 reads as code 1's entry)
    back = sf.decode_moment(codes, scales, sqrt=not signed)
    q = numpy_map(signed)
    if not signed:
        q[0] = q[1]
    expect = q[rc] * np.repeat(rs, 256)[: x.numel()]
    np.testing.assert_allclose(back.numpy(), expect, rtol=2 ** -20, atol=0)  # map: a few ulps


@pytest.mark.parametrize("signed", [True, False])
def test_reference_encode_matches_torchao(signed):
    qu = pytest.importorskip("torchao.optim.quant_utils")
    x = _blocks(2).view(-1, 256)
    if not signed:
        x = x * x
    big = x.abs().amax(1) >= 1e-12  # torchao clips a block's scale at 1e-12; we do not
    x = x[big]
    xs, scale = qu.scale_tensor(x, 256)
    qmap = torch.tensor(qu.create_dynamic_map(signed), dtype=torch.float32)
    expect = qu.quantize_8bit_with_qmap(xs, qmap)
    codes, scales = sf.encode_moment(x, U8, sqrt=not signed)
    assert torch.equal(codes, expect)
    assert torch.equal(scales, scale)


def test_reference_encode_edge_values():
    q = sf.dynamic_map(True)
    mids = (q[1:] + q[:-1]) / 2
    # every entry, every midpoint and its float32 neighbours, +-1, in one block with max 1
    vals = torch.cat([q, mids, torch.nextafter(mids, torch.tensor(2.0)),
                      torch.nextafter(mids, torch.tensor(-2.0)), torch.tensor([-1.0, 1.0])])
    vals = torch.cat([vals, torch.zeros(-vals.numel() % 256)])
    codes, scales = sf.encode_moment(vals, U8)
    rc, rs = numpy_encode(vals.numpy(), True, q.numpy())
    np.testing.assert_array_equal(codes.numpy(), rc)
    # an entry encodes to itself
    assert torch.equal(codes[:256].long(), torch.arange(256))
    # inf saturates to the largest / most negative code with a finite scale
    x = torch.tensor([1.0, -float("inf"), float("inf"), 2.0])
    c, s = sf.encode_moment(x, U8)
    assert c.tolist()[1:3] == [0, 255] and float(s[0]) == torch.finfo(torch.float32).max


# -- the kernels: the encode of a step whose moments are exact (beta1 = beta2 = 0) --------


def _exact_step(call, x):
    """One AdamW step with beta1 = beta2 = 0, grad x: exp_avg = x and exp_avg_sq = x * x
    exactly, stored as uint8; returns (m codes, m scales, v codes, v scales)."""
    n = x.numel()
    nb = ops.moment_blocks(n)
    p, g = torch.zeros(n), x.clone()
    m, v = torch.zeros(n, dtype=U8), torch.zeros(n, dtype=U8)
    ms, vs = torch.zeros(nb), torch.zeros(nb)
    call([p], [m], [v], [torch.zeros(1)], [], [g], None, None, None,
         1e-3, 0.0, 0.0, 1e-8, 0.0, True, False, [ms], [vs])
    return m, ms, v, vs


def _check_exact_step(out, x):
    m, ms, v, vs = out
    rc, rs = numpy_encode(x.numpy(), True, sf.dynamic_map(True).numpy())
    np.testing.assert_array_equal(ms.numpy(), rs)
    np.testing.assert_array_equal(m.numpy(), rc)
    sq = (x * x).numpy()
    rc, rs = numpy_encode(sq, False, sf.dynamic_map(False).numpy())
    np.testing.assert_array_equal(vs.numpy(), rs)
    np.testing.assert_array_equal(v.numpy(), rc)


def _kernel_input():
    x = _blocks(3, n=256 * 20)[: 256 * 20 - 37]  # a short last block
    return x.clamp(-1e18, 1e18)  # squares stay finite


@needs_cpu_kernel
def test_cpu_kernel_encode_matches_numpy():
    x = _kernel_input()
    _check_exact_step(_exact_step(torch.ops.tpamp.fused_adam_step_, x), x)


@needs_simt
def test_simt_kernel_encode_matches_numpy(order):
    x = _kernel_input()
    _check_exact_step(_exact_step(SIMT.fused_adam_step_, x), x)


def _state_case(seed, n=4097 + 65536):
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g)
    m, ms = sf.encode_moment(torch.randn(n, generator=g) * 1e-3, U8)
    v, vs = sf.encode_moment(torch.rand(n, generator=g) * 1e-6, U8, sqrt=True)
    hi, lo = sf.split_remainders(master)
    grad = torch.randn(n, generator=g).to(torch.bfloat16)
    return [lo, m, v, torch.tensor([3.0]), hi, grad, ms, vs]


@needs_cpu_kernel
def test_cpu_kernel_step_matches_reference():
    a = _state_case(4)
    b = [t.clone() for t in a]
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                 decoupled_weight_decay=True)
    for args, fallback in ((a, False), (b, True)):
        lo, m, v, st, hi, grad, ms, vs = args
        if fallback:
            with ops.force_fallback():
                ops.fused_adam_step_([lo], [grad], [m], [v], [st], model_params=[hi],
                                     exp_avg_scales=[ms], exp_avg_sq_scales=[vs], **hyper)
        else:
            ops.fused_adam_step_([lo], [grad], [m], [v], [st], model_params=[hi],
                                 exp_avg_scales=[ms], exp_avg_sq_scales=[vs], **hyper)
    pa, pb = sf.join_remainders(a[4], a[0]), sf.join_remainders(b[4], b[0])
    torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-9)
    for k, sq in ((1, False), (2, True)):
        da = sf.decode_moment(a[k], a[6 if k == 1 else 7], sqrt=sq)
        db = sf.decode_moment(b[k], b[6 if k == 1 else 7], sqrt=sq)
        # equal codes except where a 1-ulp update difference crosses a rounding boundary
        assert (a[k] != b[k]).float().mean() < 1e-3
        torch.testing.assert_close(da, db, rtol=0.02, atol=float(db.abs().max()) * 2 ** -7)
    assert float(a[3]) == 4.0


@needs_simt
@pytest.mark.parametrize("remainders", [False, True])
def test_simt_launcher_matches_cpu_twin(order, remainders):
    if not ops.extension_available("cpu"):
        pytest.skip("CPU kernels not built")
    lo, m, v, st, hi, grad, ms, vs = _state_case(5)
    if remainders:
        params, models = [lo], [hi]
    else:
        params, models = [sf.join_remainders(hi, lo)], [hi]
    case = [params, [m], [v], [st], models, [grad]]
    a = [[t.clone() for t in lst] for lst in case]
    b = [[t.clone() for t in lst] for lst in case]
    am, av, bm, bv = [ms.clone()], [vs.clone()], [ms.clone()], [vs.clone()]
    hyper = (1e-3, 0.9, 0.95, 1e-8, 0.1, True, False)
    scale = torch.tensor([0.5])
    SIMT.fused_adam_step_(*a, scale, torch.tensor([0.0]), None, *hyper, am, av)
    torch.ops.tpamp.fused_adam_step_(*b, scale, torch.tensor([0.0]), None, *hyper, bm, bv)
    pa = sf.join_remainders(a[4][0], a[0][0]) if remainders else a[0][0]
    pb = sf.join_remainders(b[4][0], b[0][0]) if remainders else b[0][0]
    torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-9)
    for k, sa, sb, sq in ((1, am, bm, False), (2, av, bv, True)):
        assert (a[k][0] != b[k][0]).float().mean() < 1e-3  # 1-ulp fma differences only
        torch.testing.assert_close(sf.decode_moment(a[k][0], sa[0], sqrt=sq),
                                   sf.decode_moment(b[k][0], sb[0], sqrt=sq),
                                   rtol=0.02, atol=float(sb[0].max()) * 2 ** -7)
    assert float(a[3][0]) == 4.0


# -- the wrapper: state, conversions, bytes, drift ------------------------------------------

CONFIGS = {
    "fp32": dict(),
    "bf16": dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16),
    "uint8": dict(exp_avg_dtype=U8, exp_avg_sq_dtype=U8, min_8bit_size=0),
    "uint8+rem": dict(exp_avg_dtype=U8, exp_avg_sq_dtype=U8, store_param_remainders=True,
                      min_8bit_size=0),
    "e4m3": dict(exp_avg_dtype=torch.float8_e4m3fn, exp_avg_sq_dtype=torch.float8_e4m3fn,
                 min_8bit_size=0),
}
# (min_8bit_size=0: every param 8-bit, the layout these tests check; the default rule, small
# params in float32, is tests/test_min_8bit_size.py's)


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(24, 300), torch.nn.Linear(300, 5)).to(
        torch.bfloat16)


def _wrap(model, **kw):
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    return tpamp.MixedPrecisionOptimizer(inner, **kw)


def _train(model, opt, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 24, generator=gen).to(torch.bfloat16)
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        opt.step()


def _values(opt):
    out = []
    for group in opt.optimizer.param_groups:
        for p in group["params"]:
            st = opt.optimizer.state[p]
            out.append((st["exp_avg"].dtype,
                        sf.decode_moment(st["exp_avg"], st.get("exp_avg_scale")),
                        sf.decode_moment(st["exp_avg_sq"], st.get("exp_avg_sq_scale"),
                                         sqrt=True)))
    return out


@pytest.mark.parametrize("src,dst", [("uint8", "fp32"), ("fp32", "uint8"), ("uint8", "bf16"),
                                     ("bf16", "uint8+rem"), ("e4m3", "uint8"),
                                     ("uint8+rem", "e4m3"), ("uint8", "uint8+rem")])
def test_state_dict_converts(src, dst):
    ms, md = _model(1), _model(2)
    a = _wrap(ms, **CONFIGS[src])
    _train(ms, a, 3, 7)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = _wrap(md, **CONFIGS[dst])
    b.load_state_dict(torch.load(buf, weights_only=False))
    want = CONFIGS[dst].get("exp_avg_dtype", torch.float32)
    for (_, m1, v1), (dt, m2, v2) in zip(_values(a), _values(b)):
        assert dt == want
        if dst == "fp32" or src.split("+")[0] == dst.split("+")[0]:
            assert torch.equal(m1, m2) and torch.equal(v1, v2)  # exact
        else:  # dst's own encode of src's float32 values
            c, s = sf.encode_moment(m1, want)
            assert torch.equal(m2, sf.decode_moment(c, s))
            c, s = sf.encode_moment(v1, want, sqrt=True)
            assert torch.equal(v2, sf.decode_moment(c, s, sqrt=True))
    _train(md, b, 2, 8)  # and it trains on


def test_uint8_state_layout_and_bytes():
    model = _model(3)
    opt = _wrap(model, **CONFIGS["uint8+rem"])
    _train(model, opt, 1, 0)
    n = sum(p.numel() for p in model.parameters())
    blocks = sum(ops.moment_blocks(p.numel()) for p in model.parameters())
    for group in opt.optimizer.param_groups:
        for p in group["params"]:
            st = opt.optimizer.state[p]
            assert st["exp_avg"].dtype == U8 and st["exp_avg_sq"].dtype == U8
            assert st["exp_avg_scale"].dtype == torch.float32
            assert st["exp_avg_scale"].numel() == ops.moment_blocks(st["exp_avg"].numel())
    # remainders (2) + two uint8 moments (1 each) + a float32 scale per 256 per moment + steps
    nparams = len(list(model.parameters()))
    assert opt.optimizer_state_bytes() == 4 * n + 8 * blocks + 4 * nparams


def test_uint8_drifts_less_than_e4m3():
    """A short AdamW run: uint8 state stays closer to the fp32-state run than e4m3 state
    (scripts/bench_state_drift.py measures the full 200-step comparison)."""
    def run(cfg):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(64, 256) * 0.02)
        opt = tpamp.FP32Optimizer(torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01),
                                  clip_grad=1.0, **CONFIGS[cfg])
        gen = torch.Generator().manual_seed(1)
        for _ in range(40):
            p.grad = (torch.randn(64, 256, generator=gen) * 0.01).to(torch.bfloat16).float()
            opt.step()
        return p.detach().clone()

    ref = run("fp32")
    torch.manual_seed(0)
    init = torch.randn(64, 256) * 0.02
    move = (ref - init).abs().mean()
    d8 = float((run("uint8") - ref).abs().mean() / move)
    de = float((run("e4m3") - ref).abs().mean() / move)
    assert d8 < 0.5 * de, (d8, de)
    assert d8 < 0.05
