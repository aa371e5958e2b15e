"""The CUDA launchers of csrc/cuda/, run on CPU under the SIMT emulator (torch.ops.tpamp_simt.*,
module tpamp._C_simt), against the CPU twin (torch.ops.tpamp.* on CPU) and float64 references,
under every schedule order (forward, reverse, random).

What must agree: every value written bit for bit with the CPU twin and with the float64 model
``float32(x * scale)`` rounded to the destination dtype; found_inf, max |g| and zero counts exactly;
sums of squares and per-tensor norms to rel 2e-5 of the float64 sums (summation order differs);
optimizer steps with the CPU twin bit for bit for SGD (every a * b + c an explicit fma) and within
2 ulps for Adam (compilers may contract its other a * b + c into fmas, g++ in the CPU twin's AVX2
build as nvcc on a GPU; csrc/README.md), and to float32 rounding of a float64 model; a set
found_inf changes nothing.
"""

from __future__ import annotations

import math

import pytest
import simt_utils
import torch
from kernel_reference import stats_ref, written_ref
from simt_utils import order  # noqa: F401  (fixture: every test runs in each schedule order)

from tpamp import ops

SIMT = simt_utils.load()
pytestmark = [
    pytest.mark.skipif(SIMT is None, reason=simt_utils.skip_reason()),
    pytest.mark.skipif(not ops.extension_available("cpu"), reason="CPU kernels not built"),
]
CPU = torch.ops.tpamp
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# empty first, in the middle and last; around the vector widths (4 fp32 / 8 16-bit elements), the
# block stride (512) and the chunk (65536 elements = one block); 131075: three blocks
SIZES = (0, 1, 3, 7, 8, 9, 0, 31, 513, 4097, 65537, 131075, 5, 0)
RTOL = 2e-5


def make_list(seed, sizes=SIZES, dtypes=DTYPES, offsets=(0, 1, 3), specials=True, scale=1.0):
    """Tensors of the given sizes, dtypes in turn, as views at storage offsets in turn (odd
    offsets: misaligned pointers); about 10% zeros, -0.0 among them; with specials, one inf, one
    -inf and one NaN in separate tensors."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(sizes):
        off = offsets[i % len(offsets)]
        buf = torch.randn(n + off, generator=g, dtype=torch.float64) * scale
        buf[torch.rand(n + off, generator=g) < 0.1] = 0.0
        buf[torch.rand(n + off, generator=g) < 0.02] = -0.0
        t = buf.to(dtypes[i % len(dtypes)])[off:]
        out.append(t)
    if specials:
        big = [t for t in out if t.numel() > 100]
        big[0][17] = math.inf
        big[1][5] = -math.inf
        big[2][99] = math.nan
    return out


def clone(ts):
    return [t.clone() for t in ts]


def assert_bitwise(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    if a.numel():
        ai = a.contiguous().view(torch.int16 if a.element_size() == 2 else torch.int32)
        bi = b.contiguous().view(torch.int16 if b.element_size() == 2 else torch.int32)
        # NaN payloads may differ between devices; every other bit must agree
        nan = a.isnan() & b.isnan()
        assert bool(((ai == bi) | nan).all()), what


def assert_ulp(a, b, what, ulps=1):
    """float32 a and b within `ulps` units in the last place, or 1e-7 apart (near 0)."""
    assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape, what
    if a.numel():
        ai = a.contiguous().view(torch.int32).long()
        bi = b.contiguous().view(torch.int32).long()
        close = (ai - bi).abs() <= ulps
        # near 0 (cancellation in lerp / L2), one rounding apart is many ulps of the result
        close |= (a - b).abs() <= 1e-7
        assert bool(close.all()), (what, int((ai - bi).abs().max()))


def check_stats(res, ref, what):
    found, sumsq, amax, zeros, norms = res
    rfound, rsumsq, ramax, rzeros, rnorms = ref
    assert float(found[0]) == float(rfound), what
    if math.isfinite(rsumsq):
        assert float(sumsq) == pytest.approx(rsumsq, rel=RTOL, abs=0.0), what
    else:
        assert not math.isfinite(float(sumsq)), what
    if math.isnan(ramax):
        assert math.isnan(float(amax)), what
    else:
        assert float(amax) == ramax, what
    assert int(zeros) == rzeros, what
    if norms.numel():
        for i, r in enumerate(rnorms):
            assert float(norms[i]) == pytest.approx(r, rel=RTOL, abs=0.0, nan_ok=True), (what, i)


def test_every_op_has_an_emulated_twin_with_the_same_schema():
    names = sorted(n.split("::")[1] for n in torch._C._dispatch_get_all_op_names()
                   if n.startswith("tpamp::"))
    assert len(names) >= 7
    for name in names:
        a = str(getattr(CPU, name).default._schema)
        b = str(getattr(SIMT, name).default._schema)
        assert b == a.replace("tpamp::", "tpamp_simt::", 1), name
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"tpamp_simt::{name}", "CPU"), name


@pytest.mark.parametrize("variant", ["in_place_scaled", "in_place_unscaled", "out_scaled",
                                     "out_unscaled"])
def test_grad_stats_adversarial_list(order, variant):
    grads = make_list(1)
    scale = torch.tensor([0.37], dtype=torch.float32) if "unscaled" not in variant else None
    mask = [i % 3 != 1 for i in range(len(grads))]
    if variant.startswith("in_place"):
        a, b = clone(grads), clone(grads)
        ra = SIMT.grad_stats_(a, scale, mask, True, True)
        rb = CPU.grad_stats_(b, scale, mask, True, True)
        written = [written_ref(g, scale, g.dtype) for g in grads]
    else:
        a = [torch.full_like(g, 7.0, dtype=torch.float32) for g in grads]
        b = [torch.full_like(g, 7.0, dtype=torch.float32) for g in grads]
        ra = SIMT.grad_stats_out(grads, scale, mask, True, True, out=a)
        rb = CPU.grad_stats_out(grads, scale, mask, True, True, out=b)
        written = [written_ref(g, scale, torch.float32) for g in grads]
    for i in range(len(grads)):
        assert_bitwise(a[i], b[i], f"{variant} tensor {i} vs the CPU twin")
        assert_bitwise(a[i], written[i], f"{variant} tensor {i} vs float64")
    ref = stats_ref(written, mask)
    check_stats(ra, ref, f"{variant} SIMT")
    check_stats(rb, ref, f"{variant} CPU")
    for x, y in zip(ra, rb):
        if x.numel() and x.dtype != torch.float64 and x.dtype != torch.float32:
            assert torch.equal(x, y)


def test_grad_stats_without_zero_count_and_per_tensor(order):
    grads = make_list(2, sizes=(65537, 3, 0, 700), specials=False)
    mask = [True, False, True, True]
    res = SIMT.grad_stats_(clone(grads), None, mask, False, False)
    found, sumsq, amax, zeros, norms = res
    assert int(zeros) == 0 and norms.shape == (0,)
    ref = stats_ref([g.float() for g in grads], mask)
    assert float(found[0]) == 0.0 and float(amax) == ref[2]
    assert float(sumsq) == pytest.approx(ref[1], rel=RTOL)


def test_grad_stats_squares_beyond_fp32_are_summed_again_in_fp64(order):
    """The fp32-overflow redo: every value finite, squares beyond fp32: finite fp64 sum."""
    grads = [torch.full((70000,), 3e19, dtype=torch.float32), torch.full((9,), -2e19)]
    ref = stats_ref(grads, [True, True])
    assert math.isfinite(ref[1]) and ref[1] > 3.4e38
    for op in (SIMT, CPU):
        found, sumsq, amax, zeros, norms = op.grad_stats_(clone(grads), None, [True, True], True,
                                                          True)
        assert float(found[0]) == 0.0
        assert float(sumsq) == pytest.approx(ref[1], rel=RTOL)
        assert float(amax) == 3e19 or float(amax) == float(torch.tensor(3e19))
    # and after a multiply that overflows float16, found_inf is set
    h = [torch.full((100,), 300.0, dtype=torch.float16)]
    found = SIMT.grad_stats_(h, torch.tensor([1000.0]), [True], True, False)[0]
    assert float(found[0]) == 1.0 and bool(torch.isinf(h[0]).all())


def test_grad_stats_empty_list_and_many_tensors_need_several_launches(order):
    scale = torch.tensor([2.0])
    found, sumsq, amax, zeros, norms = SIMT.grad_stats_([], scale, [], True, True)
    assert float(found[0]) == 0.0 and float(sumsq) == 0.0 and int(zeros) == 0
    assert norms.shape == (0,)
    # 250 tensors: more than one launch's table holds (90 at depth 2)
    grads = make_list(3, sizes=[(i * 7) % 13 for i in range(250)], specials=False)
    mask = [i % 2 == 0 for i in range(250)]
    a, b = clone(grads), clone(grads)
    ra = SIMT.grad_stats_(a, scale, mask, True, True)
    rb = CPU.grad_stats_(b, scale, mask, True, True)
    written = [written_ref(g, scale, g.dtype) for g in grads]
    for i in range(250):
        assert_bitwise(a[i], written[i], i)
    check_stats(ra, stats_ref(written, mask), "250 tensors")
    assert torch.equal(ra[4], rb[4]) or torch.allclose(ra[4], rb[4], rtol=RTOL, atol=0)


@pytest.mark.parametrize("src", DTYPES, ids=["fp32", "fp16", "bf16"])
def test_scale_and_copy_every_dtype_pair_and_scale_(order, src):
    srcs = make_list(4, sizes=(0, 5, 4097, 65537, 9), dtypes=(src,), specials=False)
    for dst in DTYPES:
        for scale in (None, torch.tensor([0.3])):
            a = [torch.empty_like(s, dtype=dst) for s in srcs]
            b = [torch.empty_like(s, dtype=dst) for s in srcs]
            SIMT.scale_and_copy(srcs, a, scale)
            CPU.scale_and_copy(srcs, b, scale)
            for i, s in enumerate(srcs):
                assert_bitwise(a[i], b[i], (src, dst, i))
                assert_bitwise(a[i], written_ref(s, scale, dst), (src, dst, i))
    # scale_ in place; a scale of exactly 1 leaves every bit (NaN payloads too) as it was
    a, b = clone(srcs), clone(srcs)
    SIMT.scale_(a, torch.tensor([-1.5]))
    CPU.scale_(b, torch.tensor([-1.5]))
    for i, s in enumerate(srcs):
        assert_bitwise(a[i], b[i], i)
        assert_bitwise(a[i], written_ref(s, torch.tensor([-1.5]), s.dtype), i)
    c = clone(srcs)
    SIMT.scale_(c, torch.tensor([1.0]))
    for x, y in zip(c, srcs):
        assert torch.equal(x.view(torch.int16 if x.element_size() == 2 else torch.int32),
                           y.view(torch.int16 if y.element_size() == 2 else torch.int32))


def test_dynamic_scaler_sequence_matches_the_cpu_twin(order):
    state = {k: (torch.tensor([2.0 ** 16]), torch.tensor([0], dtype=torch.int32),
                 torch.tensor([2], dtype=torch.int32)) for k in ("simt", "cpu")}
    pattern = [0, 0, 1, 0, 1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0]
    for step, bad in enumerate(pattern):
        for k, op in (("simt", SIMT), ("cpu", CPU)):
            s, g, h = state[k]
            op.dynamic_scaler_update_(s, g, h, torch.tensor([float(bad)]), 2.0, 0.5, 3, 2, 1.0,
                                      math.inf, False)
        for x, y in zip(state["simt"], state["cpu"]):
            assert torch.equal(x, y), step


def adam_case(seed, n_params=7, sizes=(1, 9, 513, 65537, 0, 31, 4097), model=torch.float16):
    g = torch.Generator().manual_seed(seed)
    params, ms, vs, steps, models, grads = [], [], [], [], [], []
    for i in range(n_params):
        n = sizes[i % len(sizes)]
        off = i % 3
        p = torch.randn(n + off, generator=g)[off:]
        params.append(p)
        ms.append(torch.randn(n, generator=g) * 0.1)
        vs.append(torch.rand(n, generator=g) * 0.01)
        steps.append(torch.tensor(float(i % 4 + 1), dtype=torch.float64 if i % 2 else torch.float32))
        if model is not None:
            models.append(torch.zeros(n, dtype=model if i % 2 else torch.bfloat16))
        grads.append((torch.randn(n, generator=g) * 64).to(DTYPES[i % 3]))
    return params, ms, vs, steps, models, grads


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
    denom = v.sqrt() / math.sqrt(1 - b2 ** t) + eps
    return p - lr / (1 - b1 ** t) * m / denom, m, v


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_fused_adam_step_matches_cpu_twin_and_float64(order, decoupled):
    case = adam_case(5)
    a = [clone(x) for x in case]
    b = [clone(x) for x in case]
    scale = torch.tensor([1.0 / 64])
    lr_t = torch.tensor([2e-3])
    hyper = (1e-3, 0.9, 0.999, 1e-8, 0.01, decoupled, False)
    SIMT.fused_adam_step_(*a, scale, torch.tensor([0.0]), lr_t, *hyper, [], [])
    CPU.fused_adam_step_(*b, scale, torch.tensor([0.0]), lr_t, *hyper, [], [])
    # the step counts bit for bit; the rest within 2 ulps: g++ contracts Adam's other a * b + c
    # (v * beta2 + (1 - beta2) * g * g, L2's g + p * wd) into fmas in the CPU twin's AVX2 build
    # (as nvcc does on a GPU), not in the emulated launcher (measured: <= 1 ulp for AdamW)
    for i in range(len(a[0])):
        assert torch.equal(a[3][i], b[3][i]), ("step", i)
        assert_ulp(a[1][i], b[1][i], ("exp_avg", i), ulps=2)
        assert_ulp(a[2][i], b[2][i], ("exp_avg_sq", i), ulps=2)
        assert_ulp(a[0][i], b[0][i], ("param", i), ulps=2)
    params, ms, vs, steps, models, grads = case
    for i in range(len(params)):
        assert float(a[3][i]) == float(steps[i]) + 1 and a[3][i].dtype == steps[i].dtype
        rp, rm, rv = adam_ref(params[i], ms[i], vs[i], float(steps[i]), grads[i], 1.0 / 64,
                              float(lr_t), 0.9, 0.999, 1e-8, 0.01, decoupled)
        torch.testing.assert_close(a[0][i].double(), rp, rtol=3e-6, atol=1e-7)
        torch.testing.assert_close(a[1][i].double(), rm, rtol=3e-6, atol=3e-8)
        torch.testing.assert_close(a[2][i].double(), rv, rtol=3e-6, atol=1e-12)
        assert torch.equal(a[4][i], a[0][i].to(a[4][i].dtype))


def test_fused_adam_step_with_found_inf_changes_nothing(order):
    case = adam_case(6)
    a = [clone(x) for x in case]
    SIMT.fused_adam_step_(*a, torch.tensor([0.5]), torch.tensor([1.0]), None, 1e-3, 0.9, 0.999,
                          1e-8, 0.0, True, False, [], [])
    for k in range(6):
        for x, y in zip(a[k], case[k]):
            assert torch.equal(x, y)


def test_fused_adam_step_many_params_and_steps_need_several_launches(order):
    """400 params: 9 step launches (48 a table) and 2 step-count launches (384 a table); float32
    and float64 step counts mixed."""
    n = 400
    g = torch.Generator().manual_seed(7)
    params = [torch.randn(1 + i % 3, generator=g) for i in range(n)]
    grads = [torch.randn(p.shape, generator=g) for p in params]
    steps = [torch.tensor(float(i % 5), dtype=torch.float64 if i % 3 else torch.float32)
             for i in range(n)]
    ms = [torch.zeros_like(p) for p in params]
    vs = [torch.zeros_like(p) for p in params]
    a = [clone(params), clone(ms), clone(vs), clone(steps), [], grads]
    b = [clone(params), clone(ms), clone(vs), clone(steps), [], grads]
    SIMT.fused_adam_step_(*a, None, None, None, 1e-2, 0.9, 0.99, 1e-8, 0.0, True, True, [], [])
    CPU.fused_adam_step_(*b, None, None, None, 1e-2, 0.9, 0.99, 1e-8, 0.0, True, True, [], [])
    for k in range(3):
        for x, y in zip(a[k], b[k]):
            assert_ulp(x, y, k)  # within 1 ulp: see the test above
    for x, y in zip(a[3], b[3]):
        assert torch.equal(x, y)
    for i in range(n):
        assert float(a[3][i]) == float(steps[i]) + 1


@pytest.mark.parametrize("momentum,nesterov", [(0.0, False), (0.9, False), (0.9, True)])
def test_fused_sgd_step_matches_cpu_twin(order, momentum, nesterov):
    case = adam_case(8)
    params, _, _, _, models, grads = case
    bufs = [torch.randn(p.shape) for p in params] if momentum else []
    first = [i % 2 == 0 for i in range(len(params))]
    a = [clone(params), clone(bufs), clone(models), grads]
    b = [clone(params), clone(bufs), clone(models), grads]
    args = (first, torch.tensor([0.25]), torch.tensor([0.0]), None, 0.05, momentum, 0.1, 1e-4,
            nesterov, False)
    SIMT.fused_sgd_step_(*a, *args)
    CPU.fused_sgd_step_(*b, *args)
    for k in range(3):
        for i, (x, y) in enumerate(zip(a[k], b[k])):
            assert_bitwise(x, y, (k, i))
    # found_inf set: nothing changes
    c = [clone(params), clone(bufs), clone(models), grads]
    SIMT.fused_sgd_step_(*c, first, None, torch.tensor([float("inf")]), None, 0.05, momentum,
                         0.1, 1e-4, nesterov, False)
    for k in range(3):
        for x, y in zip(c[k], [params, bufs, models][k]):
            assert torch.equal(x, y)


# ---------------------------------------------------------------------------------------------
# The fixes from the review of the SIMT emulator, on the emulated CUDA launchers and the CPU twin alike.


def test_fma_is_rounded_once_on_every_launcher(order):
    """SGD without momentum: p = fma(g, -lr, p). float64 computes g * lr exactly and, with p of a
    close magnitude, the sum exactly, so float32(...) is the single-rounding fma; a * b + c rounded
    twice differs for some elements (checked, so this test can fail)."""
    g = torch.Generator().manual_seed(11)
    p = torch.rand(4099, generator=g) + 1.0
    grad = torch.rand(4099, generator=g) + 1.0
    lr = 0.1
    lr32 = float(torch.tensor(-lr, dtype=torch.float32))
    ref = (grad.double() * lr32 + p.double()).float()
    twice = (grad * lr32) + p
    assert int((ref != twice).sum()) > 0
    for op in (SIMT, CPU):
        q = p.clone()
        op.fused_sgd_step_([q], [], [], [grad], [False], None, None, None, lr, 0.0, 0.0, 0.0,
                           False, False)
        assert torch.equal(q, ref)


def test_empty_params_are_validated_before_returning(order):
    for op in (SIMT, CPU):
        with pytest.raises(RuntimeError, match="grads has 1 tensors, params has 0|shape"):
            op.fused_adam_step_([], [], [], [], [], [torch.zeros(3)], None, None, None, 1e-3,
                                0.9, 0.999, 1e-8, 0.0, True, False, [], [])
        with pytest.raises(RuntimeError, match="found_inf must be a 1-element float32"):
            op.fused_sgd_step_([], [], [], [], [], None, torch.zeros(2), None, 0.1, 0.0, 0.0,
                               0.0, False, False)
        with pytest.raises(RuntimeError, match="first_step has 1 entries, params has 0"):
            op.fused_sgd_step_([], [], [], [], [True], None, torch.zeros(1), None, 0.1, 0.0,
                               0.0, 0.0, False, False)
        # a valid empty step is a no-op on both
        op.fused_adam_step_([], [], [], [], [], [], torch.ones(1), torch.zeros(1), None, 1e-3,
                            0.9, 0.999, 1e-8, 0.0, True, False, [], [])


def test_a_scalar_sharing_memory_with_a_written_tensor_is_refused(order):
    for op in (SIMT, CPU):
        x = torch.ones(10)
        buf = torch.ones(11)
        s = buf[10:]
        y = buf[:10]
        with pytest.raises(RuntimeError, match=r"scale and tensors\[1\] overlap"):
            op.scale_([x, buf], s)
        with pytest.raises(RuntimeError, match=r"scale and grads\[0\] overlap"):
            op.grad_stats_([buf], s, [True], True, False)
        with pytest.raises(RuntimeError, match=r"scale and out\[0\] overlap"):
            op.grad_stats_out([x], s, [True], True, False, out=[buf[1:]])
        with pytest.raises(RuntimeError, match=r"scale and dsts\[0\] overlap"):
            op.scale_and_copy([y.clone()], [buf[1:]], s)
        assert torch.equal(buf, torch.ones(11)) and torch.equal(x, torch.ones(10))
        # reading a scalar that is part of a read-only list is fine
        op.scale_and_copy([buf], [torch.empty(11)], s)
        p = torch.zeros(5)
        with pytest.raises(RuntimeError, match=r"found_inf and params\[0\] overlap"):
            op.fused_adam_step_([p], [torch.zeros(5)], [torch.zeros(5)], [torch.zeros(1)], [],
                                [torch.ones(5)], None, p[2:3], None, 1e-3, 0.9, 0.999, 1e-8, 0.0,
                                True, False, [], [])
        mb = torch.zeros(5)
        with pytest.raises(RuntimeError, match=r"lr_tensor and momentum_buffers\[0\] overlap"):
            op.fused_sgd_step_([torch.zeros(5)], [mb], [], [torch.ones(5)], [False], None, None,
                               mb[4:], 0.1, 0.9, 0.0, 0.0, False, False)
        st = torch.zeros(1)
        with pytest.raises(RuntimeError, match=r"grad_scale and steps\[0\] overlap"):
            op.fused_adam_step_([torch.zeros(5)], [torch.zeros(5)], [torch.zeros(5)], [st], [],
                                [torch.ones(5)], st, None, None, 1e-3, 0.9, 0.999, 1e-8, 0.0,
                                True, False, [], [])
        sc = torch.ones(1)
        with pytest.raises(RuntimeError, match="found_inf and scale"):
            op.dynamic_scaler_update_(sc, torch.zeros(1, dtype=torch.int32),
                                      torch.ones(1, dtype=torch.int32), sc, 2.0, 0.5, 10, 1, 1.0,
                                      math.inf, False)
        assert float(sc) == 1.0 and torch.equal(p, torch.zeros(5))
