"""Outliers in the uint8 moment format (docs/spec.md section 9).

torchao's AdamW8bit format (and tpamp's before this) reads a positive exp_avg_sq far below its
block's max back as 0 (a grad element of 1e4 in a block of 256 made its neighbours step by
exp_avg / eps: 0.24-0.43 in 3 steps at lr 1e-3, against 0.0039 with float32 state), and saturates
a block holding inf to FLT_MAX (a grad element of 1e30, whose square overflows float32, moved its
param by ~1e6; float32 state: 0). tpamp's uint8 exp_avg_sq reads code 0 as the smallest positive
entry and keeps +inf (a negative block scale, code 255); these tests hold every path to it:

* the movement of the outlier's param and of its block neighbours against torch.optim.AdamW with
  float32 state (an independent reference): the outlier no more than float32 state moves it, a
  neighbour no more than 2x;
* the encode of a block holding inf against the rule written again in numpy (test_dynamic_map);
* the PyTorch reference, the CPU kernel (its one-pass loop and its block loop) and the emulated
  CUDA launcher bit for bit on several steps with such blocks;
* checkpoints: negative scales load only where they mean a block holding inf.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import simt_utils
import torch
from simt_utils import order  # noqa: F401  (fixture: the SIMT tests run in each schedule order)
from test_dynamic_map import numpy_encode

import tpamp
from tpamp import ops
from tpamp import state_formats as sf

U8 = torch.uint8
SIMT = simt_utils.load()
LR = 1e-3
HYPER = dict(lr=LR, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
             decoupled_weight_decay=True)
F32 = np.float32


def _step_reference(p, g, m, v, ms, vs, st, model=None):
    with ops.force_fallback():
        ops.fused_adam_step_([p], [g], [m], [v], [st], model_params=model,
                             exp_avg_scales=[ms], exp_avg_sq_scales=[vs], **HYPER)


def _step_cpu(p, g, m, v, ms, vs, st, model=None):
    torch.ops.tpamp.fused_adam_step_([p], [m], [v], [st], model or [], [g], None, None, None,
                                     LR, 0.9, 0.999, 1e-8, 0.0, True, False, [ms], [vs])


def _step_simt(p, g, m, v, ms, vs, st, model=None):
    SIMT.fused_adam_step_([p], [m], [v], [st], model or [], [g], None, None, None, LR, 0.9,
                          0.999, 1e-8, 0.0, True, False, [ms], [vs])


PATHS = {"reference": _step_reference, "cpu": _step_cpu, "simt": _step_simt}


def _path(name):
    if name == "cpu" and not ops.extension_available("cpu"):
        pytest.skip("CPU kernels not built")
    if name == "simt" and SIMT is None:
        if simt_utils.REQUIRED:
            raise RuntimeError(simt_utils.skip_reason())
        pytest.skip(simt_utils.skip_reason())
    return PATHS[name]


def _grads(n, steps, idx, big, every, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for k in range(steps):
        g = torch.randn(n, generator=gen)
        if k == 0 or every:
            g[idx] = big
        out.append(g)
    return out


def _moves_fp32(p0, grads):
    """|param change| after the steps with float32 state: torch.optim.AdamW (for-loop)."""
    p = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([p], lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                            foreach=False)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return (p.detach() - p0).abs()


def _moves_u8(step, p0, grads):
    n = p0.numel()
    p = p0.clone()
    m, v = torch.zeros(n, dtype=U8), torch.zeros(n, dtype=U8)
    ms, vs = torch.zeros(sf.moment_blocks(n)), torch.zeros(sf.moment_blocks(n))
    st = torch.zeros(1)
    for g in grads:
        step(p, g, m, v, ms, vs, st)
    return (p - p0).abs(), (m, ms, v, vs)


N, IDX = 1024, 300  # 4 blocks; the outlier in block 1
NEIGHBOURS = torch.zeros(N, dtype=torch.bool)
NEIGHBOURS[256:512] = True
NEIGHBOURS[IDX] = False


@pytest.mark.parametrize("every", [False, True], ids=["once", "every_step"])
@pytest.mark.parametrize("path", list(PATHS))
def test_outlier_neighbours_move_at_most_twice_fp32(path, every):
    """One grad element of 1e4 in a block (at the first step, or at every step), 3 steps at lr
    1e-3: no neighbour in its block moves more than 2x the largest move of a neighbour under
    float32 state, and their exp_avg_sq reads back positive (torchao's format reads it 0: the
    neighbours moved ~100x float32 state's); the outlier moves no more than 2x either."""
    step = _path(path)
    p0 = torch.randn(N, generator=torch.Generator().manual_seed(1))
    grads = _grads(N, 3, IDX, 1e4, every)
    d32 = _moves_fp32(p0, grads)
    d8, (m, ms, v, vs) = _moves_u8(step, p0, grads)
    assert float(d8[NEIGHBOURS].max()) <= 2 * float(d32[NEIGHBOURS].max()), (
        float(d8[NEIGHBOURS].max()), float(d32[NEIGHBOURS].max()))
    assert float(d8[IDX]) <= 2 * float(d32[IDX])
    others = torch.ones(N, dtype=torch.bool)
    others[256:512] = False
    assert float(d8[others].max()) <= 2 * float(d32[others].max())
    back = sf.decode_moment(v, vs, sqrt=True)
    assert bool((back[NEIGHBOURS] > 0).all())


@pytest.mark.parametrize("big", [1e30, 3.3895313892515355e38], ids=["1e30", "bf16_max"])
@pytest.mark.parametrize("every", [False, True], ids=["once", "every_step"])
@pytest.mark.parametrize("path", list(PATHS))
def test_overflowing_grad_element_moves_its_param_as_fp32(path, every, big):
    """A finite grad element whose square overflows float32 (1e30, the largest bf16): float32
    state holds exp_avg_sq = inf and never moves that param again (update exp_avg / inf = 0).
    uint8 state moves it exactly as much (0), keeps its exp_avg_sq +inf (code 255 in a block of
    negative scale) and its block neighbours finite, positive and moving no more than 2x what
    float32 state moves them (the format before this saturated the block to FLT_MAX: the
    outlier moved ~1e6)."""
    step = _path(path)
    p0 = torch.randn(N, generator=torch.Generator().manual_seed(2))
    grads = _grads(N, 3, IDX, big, every)
    d32 = _moves_fp32(p0, grads)
    d8, (m, ms, v, vs) = _moves_u8(step, p0, grads)
    assert float(d32[IDX]) == 0.0
    assert float(d8[IDX]) == 0.0
    assert bool(d8.isfinite().all())
    assert float(d8[NEIGHBOURS].max()) <= 2 * float(d32[NEIGHBOURS].max())
    assert float(vs[1]) < 0 and int(v[IDX]) == 255
    assert bool((vs[[0, 2, 3]] > 0).all())
    back = sf.decode_moment(v, vs, sqrt=True)
    assert float(back[IDX]) == math.inf
    assert bool(back[NEIGHBOURS].isfinite().all()) and bool((back[NEIGHBOURS] > 0).all())
    # the neighbours keep their precision: within one code step of float32 state's exp_avg_sq
    v32 = torch.zeros(N)
    for k, g in enumerate(grads):
        v32 = v32 * 0.999 + 0.001 * g * g
    rel = (back[NEIGHBOURS] / v32[NEIGHBOURS] - 1).abs()
    assert float(rel.max()) < 0.5


def _numpy_encode_inf_block(x):
    """The exp_avg_sq rule for a block holding +inf (no NaN), written again: d = the largest
    finite |x| (at least 2^-126); codes = the nearest map entry of x / d (numpy_encode of the
    block with its infinities replaced by +-d, so that its max is d) capped at 254; +inf 255;
    scale -d."""
    finite = np.isfinite(x)
    d = max(float(np.abs(x[finite]).max()) if finite.any() else 0.0, 2.0 ** -126)
    codes, scales = numpy_encode(np.where(finite, x, np.sign(x) * F32(d)).astype(F32), False,
                                 sf.dynamic_map(False).numpy())
    assert scales[0] == F32(d)
    codes = np.where(x == np.inf, 255, np.minimum(codes, 254))
    return codes, -F32(d)


def test_reference_encode_of_a_block_holding_inf():
    """encode_moment (exp_avg_sq) on blocks holding +inf: the rule above; decode_moment reads
    +inf back at code 255 and map[code] * d elsewhere; exp_avg keeps the FLT_MAX saturation."""
    gen = torch.Generator().manual_seed(3)
    x = torch.rand(4 * 256, generator=gen) ** 6
    x[7] = math.inf
    x[256 + 200] = math.inf
    x[256 + 3] = 1e38  # the finite max above 2^126: divided, not multiplied by a reciprocal
    x[512:768] = 0.0
    x[600] = math.inf  # inf among zeros: d = 2^-126
    x[768 + 5] = -math.inf  # -inf (never an exp_avg_sq) reads the smallest positive value
    codes, scales = sf.encode_moment(x, U8, sqrt=True)
    for b in range(4):
        blk = x[256 * b: 256 * (b + 1)].numpy()
        rc, rs = _numpy_encode_inf_block(blk)
        np.testing.assert_array_equal(codes[256 * b: 256 * (b + 1)].numpy(), rc)
        assert float(scales[b]) == float(rs)
    back = sf.decode_moment(codes, scales, sqrt=True)
    q = sf.dynamic_map(False).numpy().copy()
    q[0] = q[1]
    expect = (q[codes.numpy().astype(np.int64)]
              * np.repeat(-scales.numpy(), 256)).astype(F32)
    expect[codes.numpy() == 255] = np.inf
    np.testing.assert_array_equal(back.numpy(), expect)
    # exp_avg (the signed map): saturated to FLT_MAX as before
    c, s = sf.encode_moment(torch.tensor([1.0, math.inf, -2.0]), U8)
    assert float(s[0]) == torch.finfo(torch.float32).max and int(c[1]) == 255


def test_code_zero_reads_the_smallest_positive_value():
    """exp_avg_sq code 0 reads map[1] * scale where the scale is positive (0 in an all-zero
    block); exp_avg's code for 0 still reads 0. The codes are torchao's."""
    codes = torch.tensor([0, 1, 255] + [0] * 253 + [0] * 256, dtype=U8)
    scales = torch.tensor([2.0, 0.0])
    back = sf.decode_moment(codes, scales, sqrt=True)
    q1 = float(sf.dynamic_map(False)[1])
    assert float(back[0]) == float(torch.tensor(q1) * 2.0) == float(back[1])
    assert float(back[2]) == 2.0
    assert bool((back[256:] == 0).all())
    zero = int(torch.nonzero(sf.dynamic_map(True) == 0)[0])
    m = sf.decode_moment(torch.full((256,), zero, dtype=U8), torch.tensor([3.0]))
    assert bool((m == 0).all())


def _case(n=65536 + 700, seed=4):
    """A state over 2 chunks after one step from zeros with outliers: 1e30 (inf exp_avg_sq) in
    blocks of both chunks, 1e4 in others, exact zeros in a block; the grads of 4 more steps."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen) * 0.02
    grads = []
    for k in range(5):
        g = torch.randn(n, generator=gen) * 1e-2
        g[[5, 256 * 3 + 1, 65536 + 300]] = 1e30
        g[[256 * 5 + 9, 65536 + 512 + 4]] = 1e4
        g[256 * 7: 256 * 8] = 0.0
        if k == 3:
            g[256 * 9 + 2] = 1e30  # a new inf block later on
        grads.append(g)
    return p, grads


@pytest.mark.parametrize("mixed", [False, True], ids=["u8_both", "u8_v_fp32_m"])
def test_paths_agree_bit_for_bit(mixed):
    """The PyTorch reference, the CPU kernel (both moments uint8: its one-pass loop, blocks
    holding inf through its block loop; uint8 exp_avg_sq with float32 exp_avg: its block loop)
    and the emulated CUDA launcher give the same bits over 5 steps with blocks holding inf."""
    runs = {}
    for name in PATHS:
        if (name == "cpu" and not ops.extension_available("cpu")) or (
                name == "simt" and SIMT is None):
            continue
        p, grads = _case()
        n = p.numel()
        m = torch.zeros(n) if mixed else torch.zeros(n, dtype=U8)
        v = torch.zeros(n, dtype=U8)
        ms, vs = torch.zeros(sf.moment_blocks(n)), torch.zeros(sf.moment_blocks(n))
        st = torch.zeros(1)
        for g in grads:
            _run_mixed(name, p, g, m, v, ms, vs, st, mixed)
        runs[name] = [p, m, v, ms, vs]
    if SIMT is None and simt_utils.REQUIRED:
        raise RuntimeError(simt_utils.skip_reason())
    ref = runs.pop("reference")
    assert float(ref[4].min()) < 0  # blocks holding inf are there
    assert bool(ref[0].isfinite().all())
    for name, got in runs.items():
        for a, b in zip(ref, got):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


def _run_mixed(name, p, g, m, v, ms, vs, st, mixed):
    mscales = [torch.empty(0)] if mixed else [ms]
    if name == "reference":
        with ops.force_fallback():
            ops.fused_adam_step_([p], [g], [m], [v], [st],
                                 exp_avg_scales=None if mixed else [ms],
                                 exp_avg_sq_scales=[vs], **HYPER)
        return
    op = torch.ops.tpamp.fused_adam_step_ if name == "cpu" else SIMT.fused_adam_step_
    op([p], [m], [v], [st], [], [g], None, None, None, LR, 0.9, 0.999, 1e-8, 0.0, True, False,
       mscales, [vs])


# -- through the wrapper, and checkpoints ---------------------------------------------------


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 80), torch.nn.Linear(80, 8)).to(torch.bfloat16)


def _wrap(model, **kw):
    inner = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), weight_decay=0.0)
    return tpamp.MixedPrecisionOptimizer(inner, **kw)


U8_CFG = dict(exp_avg_dtype=U8, exp_avg_sq_dtype=U8, min_8bit_size=0)


@pytest.mark.parametrize("big", [1e30, math.inf], ids=["1e30", "inf"])
def test_wrapper_outlier_moves_as_fp32(big):
    """MixedPrecisionOptimizer with uint8 moments, a grad element of 1e30 (or inf) in the first
    weight for 3 steps: that param moves exactly as with float32 state (1e30: 0, exp_avg_sq inf;
    inf: the step is skipped by both), every param stays finite; a state dict round trip keeps
    the negative scale, and an fp32-state optimizer loading it reads exp_avg_sq inf there."""
    if not ops.extension_available("cpu"):
        pytest.skip("CPU kernels not built")
    m8, m32 = _model(), _model()
    a, b = _wrap(m8, **U8_CFG), _wrap(m32)
    gen8, gen32 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    w8_0 = m8[0].weight.detach().float().clone().view(-1)
    for _ in range(3):
        for m, gen in ((m8, gen8), (m32, gen32)):
            for p in m.parameters():
                p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(p.dtype)
            m[0].weight.grad.view(-1)[3] = big
        ra, rb = a.step(), b.step()
        assert ra.update_successful == rb.update_successful
    w8, w32 = m8[0].weight.detach().float().view(-1), m32[0].weight.detach().float().view(-1)
    assert float((w8[3] - w8_0[3]).abs()) == float((w32[3] - w8_0[3]).abs())
    assert all(bool(p.isfinite().all()) for p in m8.parameters())
    if big == math.inf:
        return
    main = a.optimizer.param_groups[0]["params"][0]
    st = a.optimizer.state[main]
    assert float(st["exp_avg_sq_scale"][0]) < 0 and int(st["exp_avg_sq"].view(-1)[3]) == 255
    sd = a.state_dict()
    c = _wrap(_model(), **U8_CFG)
    c.load_state_dict(sd)
    st2 = c.optimizer.state[c.optimizer.param_groups[0]["params"][0]]
    assert torch.equal(st2["exp_avg_sq_scale"], st["exp_avg_sq_scale"])
    assert torch.equal(st2["exp_avg_sq"], st["exp_avg_sq"])
    d = _wrap(_model())
    d.load_state_dict(sd)
    v32 = d.optimizer.state[d.optimizer.param_groups[0]["params"][0]]["exp_avg_sq"]
    assert float(v32.view(-1)[3]) == math.inf and bool(v32.view(-1)[4:].isfinite().all())


def test_saved_negative_scales_load_only_for_uint8_exp_avg_sq():
    """check_saved_scales: a negative scale is a uint8 exp_avg_sq block holding inf; on
    exp_avg, or on float8_e4m3fn moments, it is refused before anything changes."""
    codes = torch.zeros(300, dtype=U8)
    ok = {0: {"exp_avg": codes, "exp_avg_scale": torch.tensor([1.0, 2.0]),
              "exp_avg_sq": codes, "exp_avg_sq_scale": torch.tensor([-1.0, 2.0])}}
    sf.check_saved_scales(ok)
    bad = {0: {"exp_avg": codes, "exp_avg_scale": torch.tensor([-1.0, 2.0])}}
    with pytest.raises(ValueError, match="negative scales"):
        sf.check_saved_scales(bad)
    e4 = torch.zeros(300, dtype=torch.float8_e4m3fn)
    bad = {0: {"exp_avg_sq": e4, "exp_avg_sq_scale": torch.tensor([-1.0, 2.0])}}
    with pytest.raises(ValueError, match="negative scales"):
        sf.check_saved_scales(bad)
    bad = {0: {"exp_avg_sq": codes, "exp_avg_sq_scale": torch.tensor([-math.inf, 2.0])}}
    with pytest.raises(ValueError, match="non-finite"):
        sf.check_saved_scales(bad)
