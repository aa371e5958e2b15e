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
    any8m = m_dtype == F8
    any8v = v_dtype == F8
    return [params, ms, vs, steps, models, grads], (msc if any8m else []), (vsc if any8v else [])


def _clone(lists):
    return [[t.clone() for t in lst] for lst in lists]


@pytest.mark.parametrize("m_dtype,v_dtype,remainders", [
    (torch.bfloat16, torch.bfloat16, True),
    (F8, F8, True),
    (F8, torch.bfloat16, False),
    (torch.float32, F8, False),
    (torch.float32, torch.float32, True),
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
