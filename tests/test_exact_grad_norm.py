"""Order-invariant (exact) grad norm: tpamp.exact_sum and the wrappers' deterministic_grad_norm
(docs/spec.md section 23).

The independent reference is ``math.fsum`` (correctly rounded) of the squares of the values as
float64 (each square of an fp32 value is exact in float64): the exact path must equal it bit
for bit, for any split and order of the same values. The multi-process layout sweep is in
tests/test_exact_grad_norm_dist.py.
"""

from __future__ import annotations

import math
import struct

import pytest
import torch
from misuse_utils import assert_raises_naming

import tpamp
from tpamp import exact_sum, ops


def fsum_sq(tensors, scale=None):
    """Reference: the correctly rounded float64 sum of r**2 over the finite r = fp32(x * scale)."""
    vals = []
    for t in tensors:
        r = t.detach().float().reshape(-1)
        if scale is not None:
            r = r * scale
        vals += [v for v in r.tolist() if math.isfinite(v)]
    return math.fsum(v * v for v in vals)


def bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


@pytest.fixture(params=["fallback", "kernel"])
def impl(request):
    """The PyTorch fallback, and the compiled ops where this build has them."""
    if request.param == "fallback":
        with ops.force_fallback():
            yield request.param
    else:
        kernels = tpamp._ext.ops_for(torch.device("cpu"))
        if kernels is None or not hasattr(kernels, "grad_sumsq_exact"):
            pytest.skip("torch.ops.tpamp.grad_sumsq_exact is not built")
        yield request.param


def _adversarial():
    g = torch.Generator().manual_seed(46)
    tiny = 2.0 ** -149
    big = 3.4028234663852886e38  # FLT_MAX
    cases = {
        "smallest_subnormal": [torch.tensor([tiny, -tiny, tiny])],
        "subnormals": [torch.tensor([1e-40, -3e-39, 1.1754942e-38, 5e-45])],
        "near_flt_max": [torch.tensor([big, -big, big / 3, 1.0])],
        "flt_max_many": [torch.full((3000,), big)],
        "mixed_magnitudes": [(torch.randn(4000, generator=g)
                              * torch.exp(torch.randn(4000, generator=g) * 20)).float()],
        "cancel_ties": [torch.tensor([1.0, 2.0 ** -27, 2.0 ** -27, 2.0 ** -60, 3.0])],
        "one_plus_tiny": [torch.tensor([1.0] + [2.0 ** -40] * 7 + [tiny] * 5)],
        "fp16": [torch.randn(2000, generator=g).half() * 100,
                 torch.tensor([6.1e-5, 5.96e-8, 65504.0], dtype=torch.float16)],
        "bf16": [(torch.randn(2000, generator=g) * 1e30).bfloat16(),
                 torch.tensor([1e-40, 3e38], dtype=torch.bfloat16)],
        "empty_tensors": [torch.empty(0), torch.empty(3, 0), torch.tensor([2.0])],
        "nonfinite_ignored": [torch.tensor([float("inf"), float("nan"), -float("inf"), 3.0])],
        "zeros": [torch.zeros(10), torch.tensor([-0.0])],
        "no_tensors": [],
        "strided": [torch.arange(24.0).reshape(4, 6).t()[1:, ::2]],
    }
    return cases


@pytest.mark.parametrize("case", list(_adversarial()))
def test_digits_match_fsum(impl, case):
    tensors = _adversarial()[case]
    digits = exact_sum.sumsq_digits(tensors)
    assert digits.dtype == torch.float64 and tuple(digits.shape) == (26,)
    assert bool(((digits >= 0) & (digits < 2 ** 24) & (digits == digits.floor())).all())
    value = exact_sum.digits_to_double(digits)
    assert value.dtype == torch.float64 and value.dim() == 0
    assert bits(value.item()) == bits(fsum_sq(tensors)), (value.item(), fsum_sq(tensors))


@pytest.mark.parametrize("scale", [2.0 ** -16, 2.0 ** -24, 0.3, 1e-30])
def test_scale_is_fp32_multiply(impl, scale):
    g = torch.Generator().manual_seed(1)
    tensors = [(torch.randn(500, generator=g) * 1e3).half(),
               torch.randn(300, generator=g) * torch.exp(torch.randn(300, generator=g) * 30),
               torch.tensor([1e-45, 3e38, float("inf")])]
    s = torch.tensor([scale], dtype=torch.float32)
    got = exact_sum.digits_to_double(exact_sum.sumsq_digits(tensors, s)).item()
    assert bits(got) == bits(fsum_sq(tensors, s))


def test_order_and_split_invariance(impl):
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(5001, generator=g) * torch.exp(torch.randn(5001, generator=g) * 15)).float()
    ref = exact_sum.sumsq_digits([x])
    for seed in range(4):
        perm = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(seed))]
        sizes = [0, 1, 17, 1000, 0, 3983]
        pieces = list(perm.split(sizes))
        assert torch.equal(exact_sum.sumsq_digits(pieces), ref)
        # digits of parts, summed (as an all-reduce SUM does), convert to the same value
        total = sum(exact_sum.sumsq_digits([p]) for p in pieces)
        assert bits(exact_sum.digits_to_double(total).item()) == bits(
            exact_sum.digits_to_double(ref).item())


def test_unnormalized_digits_convert_correctly(impl):
    """digits_to_double takes any non-negative integers < 2**53 (a SUM over ranks)."""
    rng = torch.Generator().manual_seed(3)
    for _ in range(50):
        d = torch.randint(0, 2 ** 52, (26,), generator=rng, dtype=torch.int64)
        d[torch.randint(0, 26, (20,), generator=rng)] = 0
        exact = sum(int(v) << (24 * i) for i, v in enumerate(d.tolist()))
        ref = _round_big(exact, -298)
        got = exact_sum.digits_to_double(d.double()).item()
        assert bits(got) == bits(ref)
    # chains of 2**24 - 1 with a carry running through them, and ties
    d = torch.zeros(26, dtype=torch.float64)
    d[3:20] = 2 ** 24 - 1
    d[2] = 2 ** 25
    assert bits(exact_sum.digits_to_double(d).item()) == bits(
        _round_big(sum(int(v) << (24 * i) for i, v in enumerate(d.tolist())), -298))
    tie = (1 << 53) + 1  # 54 bits: 2**53 + 1 is a tie between 2**53 and 2**53 + 2
    d = torch.tensor([float((tie >> (24 * i)) & 0xFFFFFF) for i in range(26)], dtype=torch.float64)
    assert bits(exact_sum.digits_to_double(d).item()) == bits(math.ldexp(2.0 ** 53, -298))


def _round_big(x: int, exp: int) -> float:
    """x * 2**exp correctly rounded to float64 (Python's int / int true division rounds
    correctly)."""
    return x / (1 << -exp) if exp < 0 else float(x << exp)


def test_no_host_sync_and_device():
    x = torch.randn(10)
    d = exact_sum.sumsq_digits([x])
    assert d.device == x.device
    assert exact_sum.sumsq_digits([], device=torch.device("cpu")).abs().sum().item() == 0


MISUSE = [
    ("not_a_tensor", lambda: exact_sum.sumsq_digits([1.0]), TypeError, ["tensors[0]"]),
    ("int_dtype", lambda: exact_sum.sumsq_digits([torch.ones(2, dtype=torch.int32)]), TypeError,
     ["torch.int32"]),
    ("float64_input", lambda: exact_sum.sumsq_digits([torch.ones(2, dtype=torch.float64)]),
     TypeError, ["torch.float64"]),
    ("scale_dtype", lambda: exact_sum.sumsq_digits([torch.ones(2)], torch.ones(1).double()),
     ValueError, ["scale", "float32"]),
    ("scale_shape", lambda: exact_sum.sumsq_digits([torch.ones(2)], torch.ones(2)), ValueError,
     ["scale"]),
    ("digits_dtype", lambda: exact_sum.digits_to_double(torch.zeros(26)), TypeError, ["float64"]),
    ("digits_shape", lambda: exact_sum.digits_to_double(torch.zeros(25).double()), ValueError,
     ["shape"]),
    ("digits_type", lambda: exact_sum.digits_to_double([0.0] * 26), TypeError, ["digits"]),
]


@pytest.mark.parametrize("case", MISUSE, ids=[c[0] for c in MISUSE])
def test_misuse(case):
    cid, call, exc, words = case
    assert_raises_naming(cid, call, exc, words)


# -- the wrappers' option ---------------------------------------------------------------------

def _opt(det, *, fused=True, dtype=torch.float32, norm_type=2.0, sizes=(5, 300, 0, 77), seed=0,
         order=None):
    g = torch.Generator().manual_seed(seed)
    spread = 2.0 if dtype == torch.float16 else 6.0  # fp16 grads stay below its max (65504)
    grads = [(torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * spread))
             .to(dtype) for n in sizes]
    order = list(range(len(sizes))) if order is None else order
    params = [torch.nn.Parameter(torch.zeros(sizes[i], dtype=dtype)) for i in order]
    inner = torch.optim.SGD(params, lr=1.0)
    cls = tpamp.FP32Optimizer if dtype == torch.float32 else tpamp.MixedPrecisionOptimizer
    scaler = tpamp.DynamicGradScaler(initial_scale=2.0 ** 8, min_scale=1.0) \
        if dtype == torch.float16 else None
    kw = {} if scaler is None else {"grad_scaler": scaler}
    opt = cls(inner, clip_grad=1.0, norm_type=norm_type, fused_step=fused,
              deterministic_grad_norm=det, log_num_zeros_in_grad=True, **kw)
    for p, i in zip(params, order):
        p.grad = grads[i].clone()
    return opt, grads, params


def _captured_norm(opt, monkeypatch):
    """Run one step, returning (StepResult, the float64 norm the clip used)."""
    seen = []
    root = type(opt)._root

    def spy(self, norm_stat, finite_p):
        out = root(self, norm_stat, finite_p)
        seen.append(out.item())
        return out

    monkeypatch.setattr(type(opt), "_root", spy)
    result = opt.step()
    return result, seen[-1]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_option_norm_equals_fsum(monkeypatch, fused, dtype):
    opt, grads, _ = _opt(True, fused=fused, dtype=dtype)
    scale = None if dtype != torch.float16 else torch.tensor([2.0 ** -8])
    result, norm64 = _captured_norm(opt, monkeypatch)
    assert result.update_successful
    ref = math.sqrt(fsum_sq(grads, scale))
    assert bits(norm64) == bits(ref)
    assert result.grad_norm == float(torch.tensor(ref).float())
    assert result.num_zeros_in_grad == sum(int((g == 0).sum()) for g in grads)


def test_option_same_bits_for_any_order_and_split(monkeypatch):
    """The same values in other params, orders and paths: the same float64 norm (the default
    path is within float rounding of it)."""
    got = set()
    for order in ([0, 1, 2, 3], [3, 1, 0, 2], [2, 3, 1, 0]):
        for fused in (False, True):
            opt, grads, _ = _opt(True, fused=fused, order=order)
            got.add(bits(_captured_norm(opt, monkeypatch)[1]))
            monkeypatch.undo()
    assert len(got) == 1
    ref = math.sqrt(fsum_sq(grads))
    assert got == {bits(ref)}
    opt, _, _ = _opt(False, fused=False, order=[3, 1, 0, 2])
    default = _captured_norm(opt, monkeypatch)[1]
    assert default == pytest.approx(ref, rel=1e-6)  # float32 accumulation: close, not exact


def test_option_inf_norm_allowed(monkeypatch):
    opt, grads, _ = _opt(True, norm_type=math.inf)
    result, norm64 = _captured_norm(opt, monkeypatch)
    assert norm64 == max(float(g.abs().max()) for g in grads if g.numel())


def test_option_off_by_default():
    opt, _, _ = _opt(False)
    assert opt.deterministic_grad_norm is False


WRAPPER_MISUSE = [
    ("not_bool", dict(deterministic_grad_norm=1), TypeError, ["deterministic_grad_norm"]),
    ("string", dict(deterministic_grad_norm="yes"), TypeError, ["deterministic_grad_norm"]),
    ("norm_type_1_5", dict(deterministic_grad_norm=True, norm_type=1.5), ValueError,
     ["deterministic_grad_norm", "norm_type"]),
    ("norm_type_1", dict(deterministic_grad_norm=True, norm_type=1.0), ValueError,
     ["deterministic_grad_norm", "norm_type"]),
]


@pytest.mark.parametrize("case", WRAPPER_MISUSE, ids=[c[0] for c in WRAPPER_MISUSE])
def test_wrapper_misuse(case):
    cid, kw, exc, words = case
    p = torch.nn.Parameter(torch.zeros(3))
    inner = torch.optim.SGD([p], lr=1.0)
    assert_raises_naming(cid, lambda: tpamp.FP32Optimizer(inner, **kw), exc, words)
    # nothing changed: the inner optimizer can still be wrapped
    tpamp.FP32Optimizer(inner)


def test_digits_are_the_exact_integer(impl):
    """The digits equal the exact sum of squares in units of 2**-298 (Python integers)."""
    from fractions import Fraction

    g = torch.Generator().manual_seed(11)
    x = (torch.randn(3000, generator=g) * torch.exp(torch.randn(3000, generator=g) * 25)).float()
    x = torch.cat([x, torch.tensor([2.0 ** -149, 3.4028234663852886e38, float("nan")])])
    exact = sum(Fraction(v) ** 2 for v in x.tolist() if math.isfinite(v)) * 2 ** 298
    assert exact.denominator == 1
    d = exact_sum.sumsq_digits([x]).tolist()
    assert all(v == int(v) for v in d)
    assert sum(int(v) << (24 * i) for i, v in enumerate(d)) == exact.numerator


def test_more_elements_than_one_piece(impl, monkeypatch):
    """More elements than one piece of the fallback (pieces made small here), all near
    FLT_MAX or all the smallest subnormal: the exact total n * r**2, rounded once."""
    from fractions import Fraction

    monkeypatch.setattr(exact_sum, "_CHUNK", 1000)
    n = 3005
    for r in (3.4028234663852886e38, 2.0 ** -149, 1.0 + 2.0 ** -23):
        x = torch.full((n,), r, dtype=torch.float32)
        got = exact_sum.digits_to_double(exact_sum.sumsq_digits([x])).item()
        want = Fraction(r) ** 2 * n
        assert bits(got) == bits(want.numerator / want.denominator)


def test_option_with_sync_free():
    """sync_free: the exact norm is converted on the device and reported as a 0-dim tensor."""
    g = torch.Generator().manual_seed(5)
    grads = [torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 6)
             for n in (7, 130)]
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (7, 130)]
    opt = tpamp.FP32Optimizer(torch.optim.Adam(params, lr=1e-3, fused=True), sync_free=True,
                              deterministic_grad_norm=True)
    for p, gr in zip(params, grads):
        p.grad = gr.clone()
    result = opt.step()
    assert isinstance(result.grad_norm, torch.Tensor)
    assert result.grad_norm.item() == float(torch.tensor(math.sqrt(fsum_sq(grads))).float())
