"""Specification tests for the PyTorch path of tpamp.ops (docs/spec.md sections 1 and 4), on CPU.

Every expected value is computed here in float64 (or by hand): the values an op must write are
float64 products rounded once to the destination dtype by ``round_to`` below (numpy for
float32/float16, a few lines of Python for bfloat16), norms and counts are float64 / exact
integer references over those values.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tpamp import ops

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


# --------------------------------------------------------------------------------------------
# independent references


def _round_bf16(x: float) -> float:
    """Round a float64 to the nearest bfloat16 (8 significant bits, ties to even)."""
    if x == 0.0 or not math.isfinite(x):
        return x
    m, e = math.frexp(x)  # x = m * 2**e, 0.5 <= |m| < 1
    return math.ldexp(round(m * 2.0**8), e - 8)


def round_to(values, dtype) -> np.ndarray:
    """float64 values rounded once to ``dtype``, returned as float64."""
    v = np.asarray(values, dtype=np.float64)
    if dtype == torch.float32:
        return v.astype(np.float32).astype(np.float64)
    if dtype == torch.float16:
        return v.astype(np.float16).astype(np.float64)
    if dtype == torch.bfloat16:
        return np.vectorize(_round_bf16, otypes=[np.float64])(v) if v.size else v.copy()
    raise AssertionError(dtype)


class DispatchedOps(TorchDispatchMode):
    """Records the name of every operator dispatched inside the block (aten and tpamp ops,
    kernels included), so a test can see what ran without asking the code under test."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def f64(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).reshape(-1).numpy().copy()


def ref_norm_stat(arrays, p) -> float:
    """sum |x|^p over all arrays (float64), or max |x| for p = inf; 0 for nothing."""
    flat = np.concatenate([a.reshape(-1) for a in arrays]) if arrays else np.zeros(0)
    if flat.size == 0:
        return 0.0
    if p == math.inf:
        return float(np.max(np.abs(flat)))
    return float(np.sum(np.abs(flat) ** p))


def ref_tensor_norm(a, p) -> float:
    if a.size == 0:
        return 0.0
    if p == math.inf:
        return float(np.max(np.abs(a)))
    return float(np.sum(np.abs(a) ** p) ** (1.0 / p))


def ref_zeros(arrays) -> int:
    return int(sum(int(np.count_nonzero(a == 0.0)) for a in arrays))


def make(values, dtype, shape=None) -> torch.Tensor:
    """A tensor of ``dtype`` holding ``values`` (values must be exactly representable)."""
    t = torch.tensor(values, dtype=torch.float64)
    assert np.array_equal(round_to(t.numpy(), dtype), t.numpy()), "test data not representable"
    t = t.to(dtype)
    return t.reshape(shape) if shape is not None else t


def random_grad(rng: random.Random, n: int, dtype, zero_frac=0.2, scale=1.0):
    """n values exactly representable in dtype (float64-rounded here), with some zeros."""
    vals = []
    for _ in range(n):
        if rng.random() < zero_frac:
            vals.append(0.0 if rng.random() < 0.5 else -0.0)
        else:
            vals.append(rng.uniform(-1.0, 1.0) * scale)
    return make(list(round_to(vals, dtype)), dtype)


def grad_set(empty_pos: str, seed: int = 0):
    """Mixed fp32/fp16/bf16 grads with an empty tensor first, in the middle or last, and the
    norm mask (one non-empty tensor masked out)."""
    rng = random.Random(seed)
    grads = [
        random_grad(rng, 35, torch.float32, scale=3.0).reshape(7, 5),
        random_grad(rng, 33, torch.float16, scale=50.0),
        random_grad(rng, 48, torch.bfloat16, scale=2.0).reshape(4, 4, 3),
        random_grad(rng, 1, torch.float32, zero_frac=0.0),
        random_grad(rng, 20, torch.float16, scale=0.01),
    ]
    # an fp16 value that flushes to zero when unscaled by 2**-10 (2**-30 < fp16's 2**-24)
    grads[4][3] = 2.0**-20
    mask = [True, True, False, True, True]
    empty = {"first": (0, torch.float32), "middle": (2, torch.float16), "last": (5, torch.bfloat16)}
    pos, dt = empty[empty_pos]
    grads.insert(pos, torch.empty(0, dtype=dt))
    mask.insert(pos, True)
    return grads, mask


POW2_SCALE = 2.0**-10  # inverse loss scale 1/1024: products are exact before the final rounding


# --------------------------------------------------------------------------------------------
# grad_stats


@pytest.mark.parametrize("norm_type", [2.0, math.inf, 3.0, 1.0])
@pytest.mark.parametrize("empty_pos", ["first", "middle", "last"])
def test_grad_stats_in_place_unscale_mixed_dtypes_matches_float64_reference(empty_pos, norm_type):
    grads, mask = grad_set(empty_pos)
    before = [f64(g) for g in grads]
    expected = [round_to(b * POW2_SCALE, g.dtype) for b, g in zip(before, grads)]
    st = ops.grad_stats(
        grads,
        scale=torch.tensor([POW2_SCALE], dtype=torch.float32),
        norm_mask=mask,
        norm_type=norm_type,
        count_zeros=True,
        per_tensor_norms=True,
    )
    for i, (g, e) in enumerate(zip(grads, expected)):
        assert np.array_equal(f64(g), e), f"grad {i} ({g.dtype}) not unscaled in place"
    counted = [e for e, m in zip(expected, mask) if m]
    assert st.found_inf.dtype == torch.float32 and tuple(st.found_inf.shape) == (1,)
    assert float(st.found_inf[0]) == 0.0
    wide = torch.float32 if norm_type == math.inf else torch.float64  # a sum of |g|^p: fp64
    assert st.norm_stat.dtype == wide and st.norm_stat.dim() == 0
    assert float(st.norm_stat) == pytest.approx(ref_norm_stat(counted, norm_type), rel=1e-5)
    assert st.num_zeros.dtype == torch.int64 and st.num_zeros.dim() == 0
    assert int(st.num_zeros) == ref_zeros(counted)
    assert st.per_tensor_norms.dtype == torch.float32
    assert tuple(st.per_tensor_norms.shape) == (len(grads),)
    ref_pt = [ref_tensor_norm(e, norm_type) for e in expected]  # mask ignored
    assert st.per_tensor_norms.double().tolist() == pytest.approx(ref_pt, rel=1e-5, abs=1e-30)


def test_zero_count_includes_values_flushed_to_zero_by_unscale_and_negative_zero():
    g = make([2.0**-20, -0.0, 0.0, 1.0, 2.0**-14], torch.float16)
    st = ops.grad_stats([g], scale=torch.tensor([POW2_SCALE]), count_zeros=True, norm_type=2.0)
    # 2**-30 -> 0 in fp16; -0 and 0 are zeros; 2**-24 is fp16's smallest subnormal: not zero
    assert f64(g).tolist() == [0.0, 0.0, 0.0, 2.0**-10, 2.0**-24]
    assert int(st.num_zeros) == 3


@pytest.mark.parametrize("norm_type", [2.0, math.inf, 3.0])
@pytest.mark.parametrize("empty_pos", ["first", "middle", "last"])
def test_grad_stats_with_fp32_out_writes_scaled_copy_and_takes_stats_on_it(empty_pos, norm_type):
    grads, mask = grad_set(empty_pos, seed=1)
    scale = np.float32(1.0 / 3000.0)  # not a power of two
    before = [f64(g) for g in grads]
    outs = [torch.full(g.shape, float("nan"), dtype=torch.float32) for g in grads]
    # one fp32 grad is its own out: done in place
    inplace_i = next(i for i, g in enumerate(grads) if g.dtype == torch.float32 and g.numel() > 1)
    outs[inplace_i] = grads[inplace_i]
    st = ops.grad_stats(
        grads, out=outs, scale=torch.tensor([float(scale)], dtype=torch.float32),
        norm_mask=mask, norm_type=norm_type, count_zeros=True, per_tensor_norms=True,
    )
    # float32(grad * scale): the product of a <=24-bit and a 24-bit mantissa is exact in float64
    expected = [round_to(b * float(scale), torch.float32) for b in before]
    for i, (o, e) in enumerate(zip(outs, expected)):
        assert o.dtype == torch.float32
        assert np.array_equal(f64(o), e), f"out {i} (from {grads[i].dtype})"
    for i, (g, b) in enumerate(zip(grads, before)):
        if i != inplace_i:
            assert np.array_equal(f64(g), b), f"source grad {i} was modified"
    counted = [e for e, m in zip(expected, mask) if m]
    assert float(st.found_inf[0]) == 0.0
    assert float(st.norm_stat) == pytest.approx(ref_norm_stat(counted, norm_type), rel=1e-5)
    assert int(st.num_zeros) == ref_zeros(counted)
    ref_pt = [ref_tensor_norm(e, norm_type) for e in expected]
    assert st.per_tensor_norms.double().tolist() == pytest.approx(ref_pt, rel=1e-5, abs=1e-30)


@pytest.mark.parametrize("use_out", [False, True], ids=["in-place", "fp32-out"])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("where", ["fp32", "fp16", "bf16"])
def test_found_inf_counts_a_non_finite_value_in_a_masked_out_tensor(where, bad, use_out):
    rng = random.Random(3)
    grads = [
        random_grad(rng, 10, torch.float32),
        random_grad(rng, 10, torch.float16),
        random_grad(rng, 10, torch.bfloat16),
    ]
    idx = list(DTYPES).index(where)
    grads[idx][4] = bad
    mask = [i != idx for i in range(3)]
    before = [f64(g) for g in grads]
    outs = [torch.empty(g.shape, dtype=torch.float32) for g in grads] if use_out else None
    st = ops.grad_stats(
        grads, out=outs, scale=torch.tensor([0.5]), norm_mask=mask, norm_type=2.0,
        count_zeros=True,
    )
    assert float(st.found_inf[0]) == 1.0
    written_dtype = (lambda g: torch.float32) if use_out else (lambda g: g.dtype)
    counted = [round_to(b * 0.5, written_dtype(g)) for b, g, m in zip(before, grads, mask) if m]
    assert float(st.norm_stat) == pytest.approx(ref_norm_stat(counted, 2.0), rel=1e-5)
    assert int(st.num_zeros) == ref_zeros(counted)


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_found_inf_with_non_finite_in_counted_tensor_and_without_scale(bad):
    g = make([1.0, 2.0, 3.0], torch.float32)
    g[1] = bad
    st = ops.grad_stats([make([0.5], torch.float16), g], norm_type=2.0)
    assert float(st.found_inf[0]) == 1.0


def test_found_inf_is_zero_for_finite_grads_including_dtype_max():
    grads = [make([65504.0, -65504.0], torch.float16), make([2.0**127], torch.float32),
             make([-(2.0**127)], torch.bfloat16)]
    st = ops.grad_stats(grads, scale=torch.tensor([1.0]))
    assert float(st.found_inf[0]) == 0.0


@pytest.mark.parametrize(
    "dtype,value", [(torch.float16, 40000.0), (torch.float32, 2.0**127)], ids=["fp16", "fp32"]
)
def test_in_place_scale_that_overflows_sets_found_inf(dtype, value):
    # found_inf is a statistic of the values written: value * 2 overflows the dtype in place,
    # so the written gradient is inf and the flag must say so (a loss scale < 1 gives
    # an inverse scale > 1; min_scale < 1 is allowed)
    g = make([value, 1.0], dtype)
    st = ops.grad_stats([g], scale=torch.tensor([2.0]))
    assert math.isinf(f64(g)[0])
    assert float(st.found_inf[0]) == 1.0


def test_norm_of_fp16_values_accumulates_wider_than_fp16():
    g = torch.full((4096,), 60000.0, dtype=torch.float16)  # 60000**2 overflows fp16
    st = ops.grad_stats([g], norm_type=2.0, per_tensor_norms=True)
    assert float(st.norm_stat) == pytest.approx(4096 * 60000.0**2, rel=1e-5)
    assert float(st.per_tensor_norms[0]) == pytest.approx(64 * 60000.0, rel=1e-5)
    assert float(st.found_inf[0]) == 0.0


def test_norm_of_bf16_values_accumulates_wider_than_bf16():
    g = torch.ones(4097, dtype=torch.bfloat16)  # a bf16 running sum stalls at 256
    st = ops.grad_stats([g], norm_type=2.0)
    assert float(st.norm_stat) == pytest.approx(4097.0, rel=1e-6)
    st1 = ops.grad_stats([g], norm_type=1.0)
    assert float(st1.norm_stat) == pytest.approx(4097.0, rel=1e-6)


def test_inf_norm_is_max_abs_over_masked_in_tensors_only():
    grads = [
        make([1.0, -7.0], torch.float32),
        make([-100.0], torch.float16),  # masked out
        make([6.5, -0.0], torch.bfloat16),
    ]
    st = ops.grad_stats(grads, norm_type=math.inf, norm_mask=[True, False, True],
                        per_tensor_norms=True)
    assert float(st.norm_stat) == 7.0
    assert st.per_tensor_norms.tolist() == [7.0, 100.0, 6.5]


def test_hand_worked_small_example():
    # masked in: [3, -4] (fp32) and [0, 12] (fp16); masked out: [5, 0] (bf16)
    grads = [make([3.0, -4.0], torch.float32), make([5.0, 0.0], torch.bfloat16),
             make([0.0, 12.0], torch.float16)]
    st = ops.grad_stats(grads, norm_type=2.0, norm_mask=[True, False, True], count_zeros=True,
                        per_tensor_norms=True)
    assert float(st.norm_stat) == 9.0 + 16.0 + 144.0
    assert int(st.num_zeros) == 1
    assert st.per_tensor_norms.tolist() == [5.0, 5.0, 12.0]
    assert float(st.found_inf[0]) == 0.0


@pytest.mark.parametrize("norm_type", [2.0, math.inf, 3.0])
def test_norms_allow_empty_tensors_which_contribute_zero(norm_type):
    # docs/spec.md section 4: "any sizes, empty tensors allowed"; hand-worked: |-5| is the largest
    grads = [make([3.0, -4.0], torch.float32), torch.empty(0, dtype=torch.float16),
             make([-5.0], torch.bfloat16), torch.empty(2, 0)]
    st = ops.grad_stats(grads, norm_type=norm_type, per_tensor_norms=True, count_zeros=True)
    expected = {2.0: 9.0 + 16.0 + 25.0, math.inf: 5.0, 3.0: 27.0 + 64.0 + 125.0}[norm_type]
    assert float(st.norm_stat) == pytest.approx(expected, rel=1e-6)
    pt = {2.0: [5.0, 0.0, 5.0, 0.0], math.inf: [4.0, 0.0, 5.0, 0.0],
          3.0: [91.0 ** (1 / 3), 0.0, 5.0, 0.0]}[norm_type]
    assert st.per_tensor_norms.double().tolist() == pytest.approx(pt, rel=1e-6)
    assert int(st.num_zeros) == 0


def test_per_tensor_norms_default_to_l2_without_norm_type():
    grads = [make([3.0, 4.0], torch.float32), make([], torch.float16), make([-6.0, 8.0], torch.bfloat16)]
    st = ops.grad_stats(grads, per_tensor_norms=True)
    assert st.per_tensor_norms.tolist() == [5.0, 0.0, 10.0]


def test_all_tensors_masked_out_give_zero_norm_and_zero_count():
    grads = [make([1.0, 0.0], torch.float32), make([0.0], torch.float16)]
    st = ops.grad_stats(grads, norm_mask=[False, False], norm_type=2.0, count_zeros=True)
    assert float(st.norm_stat) == 0.0
    assert int(st.num_zeros) == 0


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_empty_grad_list_gives_zero_stats(norm_type):
    st = ops.grad_stats([], norm_type=norm_type, count_zeros=True, per_tensor_norms=True)
    assert st.found_inf.tolist() == [0.0]
    assert float(st.norm_stat) == 0.0
    assert int(st.num_zeros) == 0
    assert tuple(st.per_tensor_norms.shape) == (0,)


def test_only_empty_tensors_give_zero_stats():
    grads = [torch.empty(0, dtype=d) for d in DTYPES.values()] + [torch.empty(3, 0)]
    st = ops.grad_stats(grads, scale=torch.tensor([0.5]), norm_type=2.0, count_zeros=True,
                        per_tensor_norms=True)
    assert st.found_inf.tolist() == [0.0]
    assert float(st.norm_stat) == 0.0
    assert int(st.num_zeros) == 0
    assert st.per_tensor_norms.tolist() == [0.0] * 4


def test_zero_count_is_exact_for_large_tensors():
    g = torch.zeros(3 * 2**20 + 5, dtype=torch.float16)
    g[::7] = 1.0
    st = ops.grad_stats([g], count_zeros=True)
    n = 3 * 2**20 + 5
    assert int(st.num_zeros) == n - len(range(0, n, 7))


# --------------------------------------------------------------------------------------------
# scale_and_copy


def test_scale_and_copy_in_place_mixed_dtypes_power_of_two():
    rng = random.Random(5)
    ts = [random_grad(rng, 17, d, scale=10.0) for d in DTYPES.values()] + [torch.empty(0)]
    before = [f64(t) for t in ts]
    ops.scale_and_copy(ts, ts, torch.tensor([0.25]))
    for t, b in zip(ts, before):
        assert np.array_equal(f64(t), round_to(b * 0.25, t.dtype)), t.dtype


def test_scale_and_copy_in_place_fp32_arbitrary_coefficient():
    rng = random.Random(6)
    t = random_grad(rng, 64, torch.float32, scale=5.0)
    before = f64(t)
    coeff = np.float32(0.3712345)
    ops.scale_and_copy([t], [t], torch.tensor([float(coeff)]))
    assert np.array_equal(f64(t), round_to(before * float(coeff), torch.float32))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_scale_and_copy_in_place_half_arbitrary_coefficient_within_one_ulp(dtype):
    rng = random.Random(7)
    t = random_grad(rng, 64, dtype, scale=5.0, zero_frac=0.0)
    before = f64(t)
    coeff = float(np.float32(0.3712345))
    ops.scale_and_copy([t], [t], torch.tensor([coeff]))
    ulp = 2.0**-10 if dtype == torch.float16 else 2.0**-7
    np.testing.assert_allclose(f64(t), before * coeff, rtol=ulp, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_cast_copy_fp32_to_half_rounds_to_nearest(dtype):
    vals = [1.0, -2.5, 0.1, 1.0 / 3.0, 1234.5678, -0.0, 3.0e-3, 1.0 + 2.0**-12]
    src = make(list(round_to(vals, torch.float32)), torch.float32)
    dst = torch.full((len(vals),), float("nan"), dtype=dtype)
    ops.scale_and_copy([src], [dst])
    assert np.array_equal(f64(dst), round_to(f64(src), dtype))
    assert np.array_equal(f64(src), round_to(vals, torch.float32))  # source untouched


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_cast_copy_half_to_fp32_is_exact(dtype):
    rng = random.Random(8)
    src = random_grad(rng, 40, dtype, scale=100.0).reshape(8, 5)
    dst = torch.full((8, 5), float("nan"))
    ops.scale_and_copy([src, torch.empty(0, dtype=dtype)], [dst, torch.empty(0)])
    assert np.array_equal(f64(dst), f64(src))


def test_cast_copy_fp32_to_fp16_scales_before_casting():
    # 1e6 does not fit fp16, 1e6 / 16 = 62500 does: the scale applies to the fp32 value
    src = make([1.0e6, -3.0e5, 2.0], torch.float32)
    dst = torch.empty(3, dtype=torch.float16)
    ops.scale_and_copy([src], [dst], torch.tensor([1.0 / 16.0]))
    assert np.array_equal(f64(dst), round_to([62500.0, -18750.0, 0.125], torch.float16))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_cast_copy_half_to_fp32_with_scale_computes_in_fp32(dtype):
    # dst = float32(src * scale): the product is exact in fp32 here, not rounded to fp16/bf16
    big = 60000.0 if dtype == torch.float16 else 2.0**120
    vals = [1.0 + 2.0**-7, -(1.0 + 2.0**-7) * 3.0, 1.5, big]
    src = make(list(round_to(vals, dtype)), dtype)
    dst = torch.empty(4, dtype=torch.float32)
    scale = 1.5
    ops.scale_and_copy([src], [dst], torch.tensor([scale]))
    expected = round_to(f64(src) * scale, torch.float32)
    assert np.array_equal(f64(dst), expected), (f64(dst), expected)


def test_cast_copy_fp16_to_fp32_scale_up_does_not_overflow_fp16():
    src = make([60000.0, -65504.0], torch.float16)
    dst = torch.empty(2, dtype=torch.float32)
    ops.scale_and_copy([src], [dst], torch.tensor([4.0]))
    assert f64(dst).tolist() == [240000.0, -262016.0]


def test_scale_and_copy_empty_lists_is_a_no_op(path):
    """Empty srcs and dsts, with and without a scale, on the kernels and the PyTorch path:
    returns None, raises nothing, runs no tensor op at all (no kernel, no allocation, no
    write) and leaves the scale as it was (values and version counter against a snapshot)."""
    scale = torch.tensor([0.5])
    snapshot, version = scale.clone(), scale._version
    for args in (([], [], scale), ([], []), ((), (), scale)):
        with DispatchedOps() as seen:
            assert ops.scale_and_copy(*args) is None
        assert seen.names == []
    assert torch.equal(scale, snapshot) and scale._version == version


def test_scale_and_copy_length_mismatch_raises():
    with pytest.raises(ValueError, match=r"\b2\b.*\b1\b|\b1\b.*\b2\b"):
        ops.scale_and_copy([torch.ones(1), torch.ones(1)], [torch.ones(1)])


# --------------------------------------------------------------------------------------------
# dynamic_scaler_update_


def _scaler_tensors(initial, hysteresis):
    return (torch.tensor([initial], dtype=torch.float32), torch.zeros(1, dtype=torch.int32),
            torch.full((1,), hysteresis, dtype=torch.int32))


def _run_update_trace(trace, flag_form, **kw):
    scale, growth, hyst = _scaler_tensors(kw.pop("initial"), kw["hysteresis"])
    for step, (inf, e_scale, e_growth, e_hyst) in enumerate(trace, 1):
        ops.dynamic_scaler_update_(scale, growth, hyst, flag_form(inf), **kw)
        got = (float(scale[0]), int(growth[0]), int(hyst[0]))
        assert got == (e_scale, e_growth, e_hyst), f"step {step}: {got}"
    assert scale.dtype == torch.float32 and growth.dtype == torch.int32
    assert hyst.dtype == torch.int32


FLAG_FORMS = {
    "f32[1]": lambda inf: torch.tensor([1.0 if inf else 0.0]),
    "f32[]": lambda inf: torch.tensor(1.0 if inf else 0.0),
    "bool[1]": lambda inf: torch.tensor([inf]),
}

# docs/spec.md section 1's worked trace (hysteresis=2, growth_interval=3, initial 8, min 1)
SPEC_TRACE = [
    (True, 8.0, 0, 1), (True, 4.0, 0, 0), (True, 2.0, 0, -1), (False, 2.0, 1, -1),
    (False, 2.0, 2, -1), (True, 1.0, 0, -2), (False, 1.0, 1, -2), (False, 1.0, 2, -2),
    (False, 2.0, 0, 2),
]


@pytest.mark.parametrize("form", list(FLAG_FORMS))
def test_dynamic_scaler_update_follows_spec_worked_trace(form):
    _run_update_trace(
        SPEC_TRACE, FLAG_FORMS[form], initial=8.0, growth_factor=2.0, backoff_factor=0.5,
        growth_interval=3, hysteresis=2, min_scale=1.0, max_scale=None,
        consecutive_hysteresis=False,
    )


def test_dynamic_scaler_update_consecutive_hysteresis_min_and_max_clamps():
    # hysteresis=2, growth_interval=2, initial 6, min 2, max 20, consecutive
    trace = [
        (True, 6.0, 0, 1),
        (False, 6.0, 1, 2),  # a clean step refills hysteresis
        (True, 6.0, 0, 1),
        (True, 3.0, 0, 0),
        (True, 2.0, 0, -1),  # 1.5 clamped to min 2
        (False, 2.0, 1, 2),
        (False, 4.0, 0, 2),
        (False, 4.0, 1, 2),
        (False, 8.0, 0, 2),
        (False, 8.0, 1, 2),
        (False, 16.0, 0, 2),
        (False, 16.0, 1, 2),
        (False, 20.0, 0, 2),  # 32 clamped to max 20
    ]
    _run_update_trace(
        trace, FLAG_FORMS["f32[1]"], initial=6.0, growth_factor=2.0, backoff_factor=0.5,
        growth_interval=2, hysteresis=2, min_scale=2.0, max_scale=20.0,
        consecutive_hysteresis=True,
    )


class _BrokenExtensionFinder:
    """A tpamp._C that exists but fails to load, as one built against another torch does."""

    def find_spec(self, name, path=None, target=None):
        import importlib.machinery

        if name != "tpamp._C":
            return None
        return importlib.machinery.ModuleSpec(name, self)

    def create_module(self, spec):
        raise ImportError("tpamp/_C.so: undefined symbol: _ZN3c106detail14torchCheckFailEPKc")

    def exec_module(self, module):  # pragma: no cover - create_module raises first
        pass


def _fresh_extension_state(monkeypatch):
    """tpamp._ext as before its first load (restored after the test)."""
    from tpamp import _ext

    for name, value in (("_loaded", False), ("_frontend_error", None), ("_cpu_module", None),
                        ("_cpu_error", None), ("_with_cuda", False), ("_cuda_ok", {}),
                        ("_warned", set())):
        monkeypatch.setattr(_ext, name, value)
    return _ext


def test_extension_built_for_another_torch_is_ignored_with_a_warning(monkeypatch):
    import sys

    from tpamp import ops

    _fresh_extension_state(monkeypatch)
    monkeypatch.setattr(sys, "meta_path", [_BrokenExtensionFinder()] + sys.meta_path)
    monkeypatch.delitem(sys.modules, "tpamp._C", raising=False)
    with pytest.warns(RuntimeWarning, match="undefined symbol") as record:
        assert ops.extension_available() is False
        # and the PyTorch path still works, without a second warning
        stats = ops.grad_stats([torch.tensor([3.0, 4.0])], norm_type=2.0)
    assert len([w for w in record if "tpamp" in str(w.message)]) == 1
    assert float(stats.norm_stat) == 25.0


def test_scale_at_most_one_hint_gives_the_same_results():
    from tpamp import ops

    g = torch.Generator().manual_seed(7)
    for bad in (None, math.inf, math.nan):
        grads = [torch.randn(n, generator=g).to(dt) for n, dt in ((5, torch.float16), (0, torch.float32), (9, torch.bfloat16))]
        if bad is not None:
            grads[2][4] = bad
        scale = torch.tensor([2.0**-10])
        res = []
        for hint in (False, True):
            outs = [torch.empty(t.shape) for t in grads]
            st = ops.grad_stats(grads, out=outs, scale=scale, norm_type=2.0, count_zeros=True, scale_at_most_one=hint)
            res.append((st, outs))
        (a, oa), (b, ob) = res
        assert torch.equal(a.found_inf, b.found_inf) and float(a.found_inf) == (bad is not None)
        assert torch.equal(a.num_zeros, b.num_zeros)
        torch.testing.assert_close(a.norm_stat, b.norm_stat, rtol=0, atol=0, equal_nan=True)
        for x, y in zip(oa, ob):
            torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)


# --------------------------------------------------------------------------------------------
# force_fallback


def _kernel_ops_run(fn) -> list:
    """The tpamp kernels (torch.ops.tpamp.*) that ``fn()`` dispatches in this thread."""
    with DispatchedOps() as seen:
        fn()
    return [n for n in seen.names if n.startswith("tpamp.")]


def _one_grad_stats():
    grads = [torch.tensor([3.0, -4.0, 0.0]), torch.tensor([1.0, 2.0], dtype=torch.bfloat16)]
    return ops.grad_stats(grads, norm_type=2.0, count_zeros=True)


@pytest.fixture
def cpu_kernels():
    if not ops.extension_available():
        pytest.skip("tpamp._C* (CPU kernels) is not built")


def test_force_fallback_runs_the_pytorch_path_inside_only(cpu_kernels):
    assert _kernel_ops_run(_one_grad_stats) == ["tpamp.grad_stats_.default"]
    with ops.force_fallback():
        assert ops.fallback_forced()
        assert _kernel_ops_run(_one_grad_stats) == []
        st = _one_grad_stats()
    # same results on the PyTorch path: 9 + 16 + 1 + 4 = 30, one zero
    assert float(st.norm_stat) == 30.0 and int(st.num_zeros) == 1 and float(st.found_inf) == 0.0
    assert not ops.fallback_forced()
    assert _kernel_ops_run(_one_grad_stats) == ["tpamp.grad_stats_.default"]


def test_force_fallback_nests_and_ends_on_an_exception(cpu_kernels):
    with ops.force_fallback():
        with ops.force_fallback():
            assert _kernel_ops_run(_one_grad_stats) == []
        assert _kernel_ops_run(_one_grad_stats) == []  # the outer block is still active
        with ops.force_fallback(False):  # enabled=False does not turn the kernels back on
            assert _kernel_ops_run(_one_grad_stats) == []
    assert _kernel_ops_run(_one_grad_stats) != []
    with pytest.raises(KeyError):
        with ops.force_fallback():
            raise KeyError("inside")
    assert not ops.fallback_forced() and _kernel_ops_run(_one_grad_stats) != []
    with ops.force_fallback(enabled=False):
        assert _kernel_ops_run(_one_grad_stats) != []


def test_force_fallback_refuses_a_non_bool():
    with pytest.raises(TypeError, match="enabled must be a bool, got int"):
        with ops.force_fallback(1):
            pass


def test_force_fallback_is_process_wide_and_thread_safe(cpu_kernels):
    import threading

    entered, release = threading.Event(), threading.Event()

    def hold():
        with ops.force_fallback():
            entered.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert entered.wait(30)
        assert _kernel_ops_run(_one_grad_stats) == []  # another thread's block applies here too
    finally:
        release.set()
        holder.join(30)
    assert _kernel_ops_run(_one_grad_stats) != []

    errors = []

    def churn():
        try:
            for _ in range(300):
                with ops.force_fallback():
                    with ops.force_fallback():
                        assert ops.fallback_forced()
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=churn) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and not ops.fallback_forced()
    assert _kernel_ops_run(_one_grad_stats) == ["tpamp.grad_stats_.default"]
