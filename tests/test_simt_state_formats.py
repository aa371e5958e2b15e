"""The CUDA launcher's narrow-state Adam (csrc/cuda/optimizer_step.cu, NarrowAdamFunctor: bf16 /
8-bit moments, bf16 params + int16 remainders; docs/spec.md section 9) run on CPU under the SIMT emulator
(torch.ops.tpamp_simt, tests/simt_utils.py) in every schedule order, against the CPU twin
(torch.ops.tpamp on CPU tensors) and the numpy format references of test_state_formats.py.

What must agree: the stored values with the CPU twin to float32 rounding of the update (the
AVX2 twin is compiled with fma contraction, the emulator without: 1-ulp differences occur),
then stored through the same csrc/kernels/optimizer_step.h formats (8-bit codes and block
scales, remainders) within one step of the format; a set found_inf changes nothing.
"""

from __future__ import annotations

import pytest
import simt_utils
import torch
from simt_utils import order  # noqa: F401  (fixture: every test runs in each schedule order)

from tpamp import ops

SIMT = simt_utils.load()
pytestmark = [
    pytest.mark.skipif(SIMT is None, reason=simt_utils.skip_reason()),
    pytest.mark.skipif(not ops.extension_available("cpu"), reason="CPU kernels not built"),
]
CPU = torch.ops.tpamp
F8 = torch.float8_e4m3fn
U8 = torch.uint8  # codes of the dynamic map
# a tail, a block, a block + 1, more than one warp's round (16 x 256), > one chunk (65536)
SIZES = (1, 256, 257, 4097, 65536 + 300)


def _case(seed, m_dtype, v_dtype, remainders, model_dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    params, ms, vs, steps, models, grads, msc, vsc = [], [], [], [], [], [], [], []
    for i, n in enumerate(SIZES):
        master = torch.randn(n, generator=g)
        if remainders:
            hi, lo = ops.split_remainders(master)
            params.append(lo), models.append(hi)
        else:
            params.append(master), models.append(master.to(model_dtype))
        m, a = ops.encode_moment(torch.randn(n, generator=g) * 1e-3, m_dtype)
        v, b = ops.encode_moment(torch.rand(n, generator=g) * 1e-6, v_dtype, sqrt=True)
        ms.append(m), vs.append(v)
        msc.append(a if a is not None else torch.empty(0))
        vsc.append(b if b is not None else torch.empty(0))
        steps.append(torch.tensor([3.0], dtype=torch.float64 if i % 2 else torch.float32))
        grads.append(torch.randn(n, generator=g).to(torch.bfloat16 if i % 2 else torch.float32))
    any8m = m_dtype in (F8, U8)
    any8v = v_dtype in (F8, U8)
    return [params, ms, vs, steps, models, grads], (msc if any8m else []), (vsc if any8v else [])


def _clone(lists):
    return [[t.clone() for t in lst] for lst in lists]


@pytest.mark.parametrize("m_dtype,v_dtype,remainders", [
    (torch.bfloat16, torch.bfloat16, True),
    (F8, F8, True),
    (F8, torch.bfloat16, False),
    (torch.float32, F8, False),
    (torch.float32, torch.float32, True),
    (U8, U8, True),
    (U8, F8, False),
    (torch.bfloat16, U8, False),
])
def test_narrow_adam_matches_cpu_twin(order, m_dtype, v_dtype, remainders):
    case, msc, vsc = _case(7, m_dtype, v_dtype, remainders)
    a, b = _clone(case), _clone(case)
    am, av, bm, bv = _clone([msc, vsc]) + _clone([msc, vsc])
    hyper = (1e-3, 0.9, 0.95, 1e-8, 0.1, True, False)
    scale = torch.tensor([0.5])
    SIMT.fused_adam_step_(*a, scale, torch.tensor([0.0]), None, *hyper, am, av)
    CPU.fused_adam_step_(*b, scale, torch.tensor([0.0]), None, *hyper, bm, bv)
    # Measured: a few elements (< 0.1%) differ by one float32 ulp of the update between the
    # emulated launcher (-ffp-contract=off) and the AVX2 CPU twin (g++ contracts the vector
    # v * beta2 + (1 - beta2) * g * g into an fma), as csrc/README.md allows on a GPU; their
    # stored formats then differ by at most one step of the format.
    for i in range(len(SIZES)):
        pa = ops.join_remainders(a[4][i], a[0][i]) if remainders else a[0][i]
        pb = ops.join_remainders(b[4][i], b[0][i]) if remainders else b[0][i]
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-9)
        for k, sc_a, sc_b, sq in ((1, am, bm, False), (2, av, bv, True)):
            da = ops.decode_moment(a[k][i], sc_a[i] if sc_a else None, sqrt=sq)
            db = ops.decode_moment(b[k][i], sc_b[i] if sc_b else None, sqrt=sq)
            big = float(db.abs().max())
            torch.testing.assert_close(da, db, rtol=0.15, atol=big * 2 ** -8)
    for i in range(len(SIZES)):  # and the step did change the state
        assert float(a[3][i]) == 4.0
        assert not torch.equal(a[0][i], case[0][i])


def test_narrow_adam_found_inf_changes_nothing(order):
    case, msc, vsc = _case(8, F8, F8, True)
    a = _clone(case)
    am, av = _clone([msc, vsc])
    SIMT.fused_adam_step_(*a, None, torch.tensor([1.0]), None, 1e-3, 0.9, 0.95, 1e-8, 0.0, True,
                          False, am, av)
    for k in range(6):
        for x, y in zip(a[k], case[k]):
            assert torch.equal(x.view(torch.uint8) if x.dtype == F8 else x,
                               y.view(torch.uint8) if y.dtype == F8 else y)
    assert all(torch.equal(x, y) for x, y in zip(am + av, msc + vsc))


def test_narrow_adam_8bit_block_saturates_when_a_grad_square_overflows(order):
    """A finite grad element whose square overflows float32 (1e30; the largest finite bf16)
    under the emulated CUDA launcher: the 8-bit exp_avg_sq block saturates (scale FLT_MAX / 448,
    that element code 448) like the CPU twin's, instead of a NaN scale; over several steps
    every param and scale stays finite and the emulated launcher agrees with the CPU twin."""
    n = 1000
    g = torch.Generator().manual_seed(31)
    master = torch.randn(n, generator=g)
    grad = torch.randn(n, generator=g) * 1e-2
    grad[5] = 1e30
    grad[2 * 256 + 9] = -float(torch.finfo(torch.bfloat16).max)
    grad = grad.to(torch.bfloat16)
    runs = []
    for lib in (SIMT, CPU):
        hi, lo = ops.split_remainders(master)
        m, ms = ops.encode_moment(torch.randn(n, generator=torch.Generator().manual_seed(1)) * 1e-3,
                                  F8)
        v, vs = ops.encode_moment(torch.rand(n, generator=torch.Generator().manual_seed(2)) * 1e-6,
                                  F8, sqrt=True)
        step = torch.tensor([0.0])
        for _ in range(4):
            lib.fused_adam_step_([lo], [m], [v], [step], [hi], [grad], None, torch.tensor([0.0]),
                                 None, 1e-3, 0.9, 0.95, 1e-8, 0.1, True, False, [ms], [vs])
            p = ops.join_remainders(hi, lo)
            assert bool(p.isfinite().all())
            assert bool(ms.isfinite().all()) and bool(vs.isfinite().all()), (ms, vs)
        runs.append((p, m.view(torch.uint8), ms, v.view(torch.uint8), vs))
    (pa, ma, msa, va, vsa), (pb, mb, msb, vb, vsb) = runs
    sat = torch.finfo(torch.float32).max / 448.0
    assert float(vsa[0]) == float(torch.tensor(sat)) and float(vsa[2]) == float(torch.tensor(sat))
    assert int(va[5]) == 0x7E and int(va[2 * 256 + 9]) == 0x7E  # sqrt(v) >= 0: +448
    # the saturated blocks agree bit for bit; the others to float32 rounding (fma, see above)
    assert torch.equal(vsa[[0, 2]], vsb[[0, 2]])
    assert torch.equal(va[:256], vb[:256]) and torch.equal(va[512:768], vb[512:768])
    torch.testing.assert_close(vsa, vsb, rtol=1e-6, atol=0)
    torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(msa, msb, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [U8, F8])
def test_mixed_8bit_and_float32_moments_in_one_launch(order, dtype):
    """The layout min_8bit_size makes (docs/spec.md section 9): in one list, params under 4096
    elements with float32 moments (empty scales) beside 8-bit ones. Each tensor keeps its own
    format and arithmetic: the emulated launcher agrees with the CPU twin, and the float32
    entries equal the CPU twin's launch of those entries alone (float32 state throughout)."""
    g = torch.Generator().manual_seed(21)
    sizes = (300, 4096, 7, 65536 + 256, 4095)
    params, ms, vs, steps, models, grads, msc, vsc = [], [], [], [], [], [], [], []
    for n in sizes:
        master = torch.randn(n, generator=g)
        params.append(master), models.append(master.to(torch.bfloat16))
        d = dtype if n >= 4096 else torch.float32
        m, a = ops.encode_moment(torch.randn(n, generator=g) * 1e-3, d)
        v, b = ops.encode_moment(torch.rand(n, generator=g) * 1e-6, d, sqrt=True)
        ms.append(m), vs.append(v)
        msc.append(a if a is not None else torch.empty(0))
        vsc.append(b if b is not None else torch.empty(0))
        steps.append(torch.tensor([3.0]))
        grads.append(torch.randn(n, generator=g).to(torch.bfloat16))
    case = [params, ms, vs, steps, models, grads]
    a, b = _clone(case), _clone(case)
    am, av, bm, bv = _clone([msc, vsc]) + _clone([msc, vsc])
    hyper = (1e-3, 0.9, 0.95, 1e-8, 0.1, True, False)
    scale = torch.tensor([0.5])
    SIMT.fused_adam_step_(*a, scale, torch.tensor([0.0]), None, *hyper, am, av)
    CPU.fused_adam_step_(*b, scale, torch.tensor([0.0]), None, *hyper, bm, bv)
    small = [i for i, n in enumerate(sizes) if n < 4096]
    c = _clone([[lst[i] for i in small] for lst in case])
    CPU.fused_adam_step_(*c, scale, torch.tensor([0.0]), None, *hyper, [], [])
    for i, n in enumerate(sizes):
        torch.testing.assert_close(a[0][i], b[0][i], rtol=1e-6, atol=1e-9)
        for k, sc_a, sc_b, sq in ((1, am, bm, False), (2, av, bv, True)):
            assert a[k][i].dtype == b[k][i].dtype == (dtype if n >= 4096 else torch.float32)
            da = ops.decode_moment(a[k][i], sc_a[i] if n >= 4096 else None, sqrt=sq)
            db = ops.decode_moment(b[k][i], sc_b[i] if n >= 4096 else None, sqrt=sq)
            torch.testing.assert_close(da, db, rtol=0.15, atol=float(db.abs().max()) * 2 ** -8)
    for j, i in enumerate(small):  # float32 state: the fp32-only launch, to the last bit
        for k in (0, 1, 2, 4):
            assert torch.equal(b[k][i], c[k][j]), (sizes[i], k)
        for k in (0, 1, 2):
            torch.testing.assert_close(a[k][i], c[k][j], rtol=1e-6, atol=1e-12)
