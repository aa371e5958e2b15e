"""Specification tests for the fused CUDA kernels of tpamp._C (torch.ops.tpamp.*), on a GPU.

Every op is compared with a float64 model of what it must do, on fresh random data:

* values written: ``float32(float64(x) * float64(scale))`` (the product, rounded once to
  float32, is what the kernels compute), then rounded to the destination dtype;
* statistics of the values written: found_inf over every tensor; sum of squares, max |g| and
  the zero count over the masked-in tensors; per-tensor L2 norms over all of them.

Sums of squares are accumulated in float32 per thread (128 terms), then in float64 (block tree,
slots in order), so they are compared with a relative tolerance of 2e-5; everything else is exact.

Decided behaviour for a large scale (tested below): an element whose product overflows the
destination dtype is written as inf and sets found_inf (so gradients reported clean are finite
as stored); a sum of squares beyond the float32 range stays finite (float64 partials, a chunk
whose float32 sums overflow is summed again in float64) while found_inf stays 0 when every value
written is finite.

Skipped unless a CUDA GPU is present and tpamp._C is built.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

import tpamp
from tpamp import ops


def _kernels_available() -> bool:
    return torch.cuda.is_available() and ops.extension_available("cuda")


pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not _kernels_available(), reason="needs a CUDA GPU and the tpamp._C extension"
    ),
]

DEV = "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
# empty first, in the middle and last; single elements; sizes around the vector widths (4 fp32,
# 8 fp16/bf16 elements), the block stride and the chunk (65536 elements)
SIZES = [0, 1, 3, 7, 8, 9, 0, 31, 513, 4095, 4097, 65535, 65536, 65537, 131075, 5, 0]
TOL = dict(rtol=2e-5, atol=0.0)


@contextlib.contextmanager
def fallback():
    """Run tpamp.ops on its PyTorch path."""
    with ops.force_fallback():
        yield


@contextlib.contextmanager
def no_host_sync():
    """Any device-to-host synchronisation inside raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def gen(seed: int) -> torch.Generator:
    g = torch.Generator(device=DEV)
    g.manual_seed(seed)
    return g


def rand_tensor(n, dtype, g, *, offset=0, zeros=0.1, scale=1.0) -> torch.Tensor:
    """n normal values (about `zeros` of them exactly 0) as a contiguous view at storage offset
    `offset` elements (offset not a multiple of the vector width: a misaligned pointer)."""
    buf = torch.randn(n + offset, generator=g, device=DEV, dtype=torch.float32) * scale
    buf[torch.rand(n + offset, generator=g, device=DEV) < zeros] = 0.0
    t = buf.to(dtype)[offset:]
    assert t.is_contiguous() and t.storage_offset() == offset
    return t


def rand_list(sizes, dtypes, g, *, offsets=(0,), **kw):
    """Tensors of the given sizes, dtypes and storage offsets taken in turn."""
    return [
        rand_tensor(n, dtypes[i % len(dtypes)], g, offset=offsets[i % len(offsets)], **kw)
        for i, n in enumerate(sizes)
    ]


def written_ref(x: torch.Tensor, scale, dtype) -> torch.Tensor:
    """float64 model of one element-wise step: float32 product, then rounded to dtype."""
    if scale is None:
        return x.to(dtype)
    v = (x.double() * scale.double().reshape(())).to(torch.float32)
    return v.to(dtype)


def stats_ref(written, mask):
    """float64 statistics of the values written (see the module docstring)."""
    w64 = [w.double().reshape(-1) for w in written]
    found = any(not bool(torch.isfinite(w).all()) for w in w64)
    counted = [w for w, m in zip(w64, mask) if m]
    zero = torch.zeros((), dtype=torch.float64, device=DEV)
    sumsq = sum(((w * w).sum() for w in counted), zero)
    amax = zero
    for w in counted:
        if w.numel():
            amax = torch.maximum(amax, w.abs().max())  # propagates nan
    zeros = sum(int((w == 0).sum()) for w in counted)
    # each tensor's L2 norm, from its float64 sum of squares
    per_tensor = torch.stack([(w * w).sum() for w in w64]).sqrt()
    return dict(found=1.0 if found else 0.0, sumsq=sumsq, amax=amax, zeros=zeros,
                per_tensor=per_tensor)


def raw_grad_stats(grads, out, scale, mask, count_zeros=True, per_tensor=True):
    """The in-place op (out = []) or the out= op."""
    if len(out) == 0:
        return torch.ops.tpamp.grad_stats_(grads, scale, mask, count_zeros, per_tensor)
    return torch.ops.tpamp.grad_stats_out(grads, scale, mask, count_zeros, per_tensor, out=out)


def check_stats(result, ref, n):
    found_inf, sumsq, amax, zeros, per_tensor = result
    assert found_inf.shape == (1,) and found_inf.dtype == torch.float32
    assert sumsq.shape == () and sumsq.dtype == torch.float64
    assert amax.shape == () and amax.dtype == torch.float32
    assert zeros.shape == () and zeros.dtype == torch.int64
    assert per_tensor.shape == (n,) and per_tensor.dtype == torch.float32
    assert found_inf.item() == ref["found"]
    torch.testing.assert_close(sumsq, ref["sumsq"], equal_nan=True, **TOL)
    torch.testing.assert_close(amax, ref["amax"].float(), rtol=0, atol=0, equal_nan=True)
    assert zeros.item() == ref["zeros"]
    torch.testing.assert_close(per_tensor, ref["per_tensor"].float(), equal_nan=True, **TOL)


def assert_bitwise_equal(got: torch.Tensor, want: torch.Tensor):
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def scalar(v: float) -> torch.Tensor:
    return torch.tensor([v], dtype=torch.float32, device=DEV)


# --------------------------------------------------------------------------------------------
# grad_stats


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("to_fp32", [False, True], ids=["in_place", "to_fp32"])
@pytest.mark.parametrize("scale_value", [None, 2.0**-13, 0.3, 0.0, 1.0])
def test_grad_stats_writes_and_measures_like_float64(dtype, to_fp32, scale_value):
    g = gen(1)
    grads = rand_list(SIZES, [dtype], g, offsets=(0, 1, 8, 3))
    mask = [i % 3 != 1 for i in range(len(grads))]
    scale = None if scale_value is None else scalar(scale_value)
    originals = [t.clone() for t in grads]
    out_dtype = torch.float32 if to_fp32 else dtype
    want = [written_ref(x, scale, out_dtype) for x in originals]
    out = [torch.full_like(x, float("nan"), dtype=torch.float32) for x in grads] if to_fp32 else []

    result = raw_grad_stats(grads, out, scale, mask)

    written = out if to_fp32 else grads
    for got, w in zip(written, want):
        assert_bitwise_equal(got, w)
    if to_fp32:  # the inputs are left alone
        for x, o in zip(grads, originals):
            assert_bitwise_equal(x, o)
    check_stats(result, stats_ref(want, mask), len(grads))


def test_grad_stats_mixed_dtypes_keep_the_callers_order():
    g = gen(2)
    sizes = [70000, 0, 9, 65536, 1, 300, 0, 131073, 17]
    grads = rand_list(sizes, DTYPES, g, offsets=(0, 2, 8))
    mask = [True, True, False, True, False, True, True, True, False]
    scale = scalar(0.125)
    out = [torch.empty(x.shape, dtype=torch.float32, device=DEV) for x in grads]
    want = [written_ref(x, scale, torch.float32) for x in grads]
    result = raw_grad_stats(grads, out, scale, mask)
    for got, w in zip(out, want):
        assert_bitwise_equal(got, w)
    check_stats(result, stats_ref(want, mask), len(grads))


def test_grad_stats_more_tensors_than_one_launch_holds():
    g = gen(3)
    n = 3000
    sizes = torch.randint(0, 700, (n,), generator=torch.Generator().manual_seed(3)).tolist()
    sizes[0] = sizes[n // 2] = sizes[-1] = 0
    grads = rand_list(sizes, DTYPES, g, offsets=(0, 0, 5))
    mask = [(i * 7) % 5 != 0 for i in range(n)]
    scale = scalar(2.0**-7)
    out = [torch.empty(x.shape, dtype=torch.float32, device=DEV) for x in grads]
    want = [written_ref(x, scale, torch.float32) for x in grads]
    result = raw_grad_stats(grads, out, scale, mask)
    for got, w in zip(out, want):
        assert_bitwise_equal(got, w)
    check_stats(result, stats_ref(want, mask), n)


def test_grad_stats_handles_shapes_and_zero_dim_tensors():
    g = gen(4)
    grads = [
        torch.randn((), generator=g, device=DEV),
        torch.randn(3, 0, 4, generator=g, device=DEV).half(),
        torch.randn(17, 33, generator=g, device=DEV).bfloat16(),
        torch.randn(2, 3, 5, 7, generator=g, device=DEV),
    ]
    mask = [True] * 4
    want = [x.clone() for x in grads]
    result = raw_grad_stats(grads, [], None, mask)
    for got, w in zip(grads, want):
        assert_bitwise_equal(got, w)
    check_stats(result, stats_ref(want, mask), 4)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("where", ["first", "last"])
def test_grad_stats_flags_inf_and_nan_at_either_end_of_a_tensor(dtype, bad, where):
    g = gen(5)
    grads = rand_list([65537, 1000, 33], [dtype], g)
    grads[1][0 if where == "first" else -1] = bad
    mask = [True, True, True]
    want = [x.clone() for x in grads]
    result = raw_grad_stats(grads, [], None, mask)
    ref = stats_ref(want, mask)
    assert ref["found"] == 1.0
    check_stats(result, ref, 3)
    if math.isnan(bad):
        assert math.isnan(result[1].item()) and math.isnan(result[2].item())
    else:
        assert result[1].item() == math.inf and result[2].item() == math.inf


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_nonfinite_in_a_masked_out_tensor_sets_found_inf_but_not_the_norm(dtype, bad):
    g = gen(6)
    grads = rand_list([4097, 9, 65536], [dtype], g)
    grads[1][4] = bad
    mask = [True, False, True]
    out = [torch.empty(x.shape, dtype=torch.float32, device=DEV) for x in grads]
    want = [written_ref(x, None, torch.float32) for x in grads]
    result = raw_grad_stats(grads, out, None, mask)
    assert result[0].item() == 1.0
    assert math.isfinite(result[1].item()) and math.isfinite(result[2].item())
    check_stats(result, stats_ref(want, mask), 3)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_scale_zero_turns_inf_into_nan_and_flags_it(dtype):
    g = gen(7)
    grads = rand_list([100, 65537], [dtype], g)
    grads[1][-1] = math.inf
    out = [torch.empty(x.shape, dtype=torch.float32, device=DEV) for x in grads]
    result = raw_grad_stats(grads, out, scalar(0.0), [True, True])
    assert result[0].item() == 1.0
    assert math.isnan(out[1][-1].item())
    assert int((out[0] == 0).sum()) == 100  # 0 * finite = (signed) zero


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("to_fp32", [False, True], ids=["in_place", "to_fp32"])
def test_huge_scale_overflow_is_inf_in_the_output_and_found_inf(dtype, to_fp32):
    """scale 1e30: fp16 values overflow (found_inf); fp32/bf16 values stay finite (found_inf 0)
    and their sum of squares, beyond float32, is the finite float64 one."""
    g = gen(8)
    grads = rand_list([4099, 65536], [dtype], g, zeros=0.0)
    originals = [x.clone() for x in grads]
    scale = scalar(1e30)
    out_dtype = torch.float32 if to_fp32 else dtype
    out = [torch.empty(x.shape, dtype=torch.float32, device=DEV) for x in grads] if to_fp32 else []
    want = [written_ref(x, scale, out_dtype) for x in originals]
    result = raw_grad_stats(grads, out, scale, [True, True])
    for got, w in zip(out if to_fp32 else grads, want):
        assert_bitwise_equal(got, w)
    ref = stats_ref(want, [True, True])
    check_stats(result, ref, 2)
    overflow = out_dtype == torch.float16
    assert result[0].item() == (1.0 if overflow else 0.0)
    assert (result[1].item() == math.inf) == overflow


def test_grad_stats_of_all_empty_tensors_is_zero():
    grads = [torch.empty(0, device=DEV), torch.empty(0, 3, device=DEV).half()]
    found_inf, sumsq, amax, zeros, pt = raw_grad_stats(grads, [], scalar(0.5), [True, True])
    assert found_inf.item() == 0.0 and sumsq.item() == 0.0 and amax.item() == 0.0
    assert zeros.item() == 0 and pt.tolist() == [0.0, 0.0]
    found_inf, sumsq, amax, zeros, pt = raw_grad_stats([], [], scalar(0.5), [])
    assert found_inf.device.type == "cuda" and pt.shape == (0,)
    assert found_inf.item() == 0.0 and sumsq.item() == 0.0 and zeros.item() == 0


def test_grad_stats_is_deterministic():
    g = gen(9)
    grads = rand_list([1 << 20, 300000, 77], DTYPES, g)
    out = [torch.empty(x.shape, dtype=torch.float32, device=DEV) for x in grads]
    first = raw_grad_stats(grads, out, scalar(0.7), [True, True, True])
    for _ in range(3):
        again = raw_grad_stats(grads, out, scalar(0.7), [True, True, True])
        for a, b in zip(first, again):
            assert_bitwise_equal(a, b)


def test_grad_stats_without_count_zeros_reports_zero():
    grads = [torch.zeros(100, device=DEV)]
    assert raw_grad_stats(grads, [], None, [True], count_zeros=False)[3].item() == 0
    assert raw_grad_stats(grads, [], None, [True], count_zeros=True)[3].item() == 100


def test_grad_stats_runs_on_the_current_stream():
    g = gen(10)
    x = torch.randn(1 << 22, generator=g, device=DEV)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.fill_(2.0)  # queued on `side`; the kernel must run after it
        found_inf, sumsq, amax, zeros, _ = raw_grad_stats([x], [], None, [True])
    torch.cuda.synchronize()
    assert sumsq.item() == pytest.approx(4.0 * x.numel(), rel=1e-6)
    assert amax.item() == 2.0


def test_tensor_of_more_than_2_pow_31_elements():
    free, _ = torch.cuda.mem_get_info()
    n = 2**31 + 9
    if free < 3 * n * 2:
        pytest.skip(f"needs {3 * n * 2 / 2**30:.1f} GiB of free GPU memory")
    x = torch.zeros(n, dtype=torch.float16, device=DEV)
    x[2**31 + 3] = 3.0
    x[-1] = 2.0
    found_inf, sumsq, amax, zeros, pt = raw_grad_stats([x], [], None, [True])
    assert found_inf.item() == 0.0
    assert sumsq.item() == 13.0 and amax.item() == 3.0 and zeros.item() == n - 2
    assert pt.item() == pytest.approx(math.sqrt(13.0), rel=1e-6)
    torch.ops.tpamp.scale_([x], scalar(0.5))
    assert x[2**31 + 3].item() == 1.5 and x[-1].item() == 1.0 and x[2**31].item() == 0.0
    x[-1] = math.inf
    assert raw_grad_stats([x], [], None, [True])[0].item() == 1.0
    del x
    torch.cuda.empty_cache()


def test_grad_stats_rejects_bad_inputs_naming_them():
    a = torch.ones(4, device=DEV)
    with pytest.raises(RuntimeError, match=r"grads\[1\] is on cpu"):
        raw_grad_stats([a, torch.ones(4)], [], None, [True, True])
    with pytest.raises(RuntimeError, match=r"grads\[0\] has dtype Int"):
        raw_grad_stats([a.int()], [], None, [True])
    with pytest.raises(RuntimeError, match=r"out\[0\] has shape \[5\]"):
        raw_grad_stats([a], [torch.ones(5, device=DEV)], None, [True])
    with pytest.raises(RuntimeError, match=r"out\[0\] has dtype Half"):
        raw_grad_stats([a], [a.half()], None, [True])
    with pytest.raises(RuntimeError, match=r"mask has 2 entries"):
        raw_grad_stats([a], [], None, [True, False])
    with pytest.raises(RuntimeError, match=r"scale must be a 1-element float32"):
        raw_grad_stats([a], [], torch.ones(2, device=DEV), [True])
    with pytest.raises(RuntimeError, match=r"grads\[0\] must be non-overlapping and dense"):
        raw_grad_stats([torch.ones(4, 4, device=DEV)[:, ::2]], [], None, [True])
    with pytest.raises(RuntimeError, match=r"overlap in memory"):
        buf = torch.ones(10, device=DEV)
        raw_grad_stats([buf[:8]], [buf[2:]], None, [True])


def test_grad_stats_nan_and_inf_in_one_list_nan_wins():
    g = gen(20)
    grads = rand_list([70000, 33, 4097], DTYPES, g)
    grads[0][5] = math.inf
    grads[1][7] = math.nan
    grads[2][-1] = -math.inf
    want = [x.clone() for x in grads]
    result = raw_grad_stats(grads, [], None, [True] * 3)
    assert result[0].item() == 1.0 and math.isnan(result[2].item())
    check_stats(result, stats_ref(want, [True] * 3), 3)


def test_grad_stats_negative_zero_is_counted_as_zero():
    x = torch.tensor([-0.0, 0.0, 1.0, -0.0] * 5000, device=DEV).half()
    assert raw_grad_stats([x], [], None, [True])[3].item() == 15000
    out = [torch.empty(x.shape, device=DEV)]
    assert raw_grad_stats([x], out, scalar(3.0), [True])[3].item() == 15000


def test_grad_stats_multi_chunk_tensors_around_a_launch_boundary():
    """A launch's table holds 90 (input, output) tensors: multi-chunk tensors as the last entry
    of the first launch and the first of the second."""
    g = gen(21)
    sizes = [5] * 89 + [3 * 65536 + 7, 2 * 65536 + 1, 11]
    grads = rand_list(sizes, DTYPES, g, offsets=(0, 1, 8))
    mask = [i % 4 != 3 for i in range(len(grads))]
    scale = scalar(0.25)
    out = [torch.empty(x.shape, device=DEV) for x in grads]
    want = [written_ref(x, scale, torch.float32) for x in grads]
    result = raw_grad_stats(grads, out, scale, mask)
    for got, w in zip(out, want):
        assert_bitwise_equal(got, w)
    check_stats(result, stats_ref(want, mask), len(grads))


def test_tensor_beyond_2_pow_31_after_other_tensors_misaligned_with_fp32_out():
    free, _ = torch.cuda.mem_get_info()
    n = 2**31 + 2**16 + 3
    if free < n * (2 + 4) + 2**30:
        pytest.skip(f"needs {(n * 6 + 2**30) / 2**30:.1f} GiB of free GPU memory")
    buf = torch.zeros(n + 1, dtype=torch.float16, device=DEV)
    big = buf[1:]  # misaligned view
    big[2**31 + 5] = 3.0
    big[-1] = -2.0
    big[7] = 1.0
    small = [torch.tensor([1.0, 2.0], device=DEV).half(), torch.tensor([4.0], device=DEV)]
    grads = small + [big]
    outs = [torch.empty(x.shape, device=DEV) for x in grads]
    found_inf, sumsq, amax, zeros, pt = raw_grad_stats(grads, outs, scalar(2.0), [True] * 3)
    assert found_inf.item() == 0.0
    assert sumsq.item() == (4.0 + 16.0 + 64.0) + (36.0 + 16.0 + 4.0)
    assert amax.item() == 8.0 and zeros.item() == n - 3
    assert outs[2][2**31 + 5].item() == 6.0 and outs[2][-1].item() == -4.0
    assert outs[2][2**31 + 4].item() == 0.0
    del buf, big, grads, outs
    torch.cuda.empty_cache()


def test_grad_stats_waits_for_a_delayed_side_stream():
    """The fill is queued after ~50 ms of GPU sleep on a side stream; the kernel, on the same
    (current) stream, must see the filled values."""
    g = gen(22)
    x = torch.randn(1 << 22, generator=g, device=DEV)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # cycles: tens of milliseconds
        x.fill_(2.0)
        found_inf, sumsq, amax, zeros, _ = raw_grad_stats([x], [], None, [True])
    torch.cuda.synchronize()
    assert sumsq.item() == 4.0 * x.numel() and amax.item() == 2.0


def test_duplicate_and_overlapping_entries_are_rejected():
    a = torch.ones(100, device=DEV)
    with pytest.raises(RuntimeError, match=r"grads\[0\] and grads\[1\] overlap"):
        raw_grad_stats([a, a], [], scalar(0.5), [True, True])
    g = [torch.ones(10, device=DEV).half(), torch.ones(10, device=DEV).half()]
    buf = torch.zeros(15, device=DEV)
    with pytest.raises(RuntimeError, match="overlap"):
        raw_grad_stats(g, [buf[:10], buf[5:]], None, [True, True])
    with pytest.raises(RuntimeError, match="overlap"):
        torch.ops.tpamp.scale_([a, a[10:20]], scalar(0.5))
    assert a.sum().item() == 100.0  # rejected before any kernel ran


def test_scale_of_exactly_one_in_place_leaves_values_and_nan_payloads():
    x = torch.tensor([1.0, math.nan, -0.0, math.inf] * 1000, device=DEV)
    bits = x.view(torch.int32).clone()
    bits[1] = 0x7FC00123
    x = bits.view(torch.float32)
    torch.ops.tpamp.scale_([x], scalar(1.0))
    assert torch.equal(x.view(torch.int32), bits)


def test_scaler_update_matches_megatron_line_by_line():
    from test_kernels_cpu import _MegatronScaler

    rng = torch.Generator().manual_seed(23)
    flags = (torch.rand(200, generator=rng) < 0.4).tolist()
    oracle = _MegatronScaler(2.0**16, 2.0, 0.5, 3, 2, 1.0)
    scale = torch.tensor([2.0**16], device=DEV)
    growth = torch.zeros(1, dtype=torch.int32, device=DEV)
    hyst = torch.full((1,), 2, dtype=torch.int32, device=DEV)
    for step, inf in enumerate(flags):
        oracle.update(inf)
        torch.ops.tpamp.dynamic_scaler_update_(scale, growth, hyst, scalar(float(inf)), 2.0, 0.5,
                                               3, 2, 1.0, math.inf, False)
        assert scale.item() == oracle._scale.item(), step
        assert growth.item() == oracle._growth_tracker
        assert hyst.item() == oracle._hysteresis_tracker


# --------------------------------------------------------------------------------------------
# the dispatch layer (tpamp.ops) against its PyTorch path


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("with_out", [False, True], ids=["in_place", "to_fp32"])
def test_ops_grad_stats_matches_the_pytorch_path(norm_type, with_out):
    g = gen(11)
    sizes = [0, 3000, 65537, 1, 0, 9, 200000]
    dtypes = DTYPES if with_out else [torch.float32]
    grads = rand_list(sizes, dtypes, g, offsets=(0, 3))
    grads[3][0] = math.inf  # in a masked-out tensor
    mask = [True, True, True, False, True, True, True]
    scale = scalar(2.0**-10)
    copies = [x.clone() for x in grads]
    outs_a = [torch.empty(x.shape, device=DEV) for x in grads] if with_out else None
    outs_b = [torch.empty(x.shape, device=DEV) for x in grads] if with_out else None
    kw = dict(scale=scale, norm_mask=mask, norm_type=norm_type, count_zeros=True,
              per_tensor_norms=True)
    fused = ops.grad_stats(grads, out=outs_a, **kw)
    with fallback():
        torch_path = ops.grad_stats(copies, out=outs_b, **kw)
    for a, b in zip(outs_a if with_out else grads, outs_b if with_out else copies):
        assert_bitwise_equal(a, b)
    assert fused.found_inf.item() == torch_path.found_inf.item() == 1.0
    torch.testing.assert_close(fused.norm_stat, torch_path.norm_stat, **TOL)
    assert fused.num_zeros.item() == torch_path.num_zeros.item()
    torch.testing.assert_close(fused.per_tensor_norms, torch_path.per_tensor_norms, equal_nan=True,
                               **TOL)


def test_ops_grad_stats_takes_dense_layouts_and_sends_strided_grads_to_the_pytorch_path():
    g = gen(12)
    x = torch.randn(64, 48, generator=g, device=DEV).t()  # dense, not contiguous: the kernel
    y = torch.randn(64, 48, generator=g, device=DEV)[:, ::3]  # not dense: the PyTorch path
    stats = ops.grad_stats([x, y], norm_type=2.0, count_zeros=True)
    ref = (x.double() ** 2).sum() + (y.double() ** 2).sum()
    torch.testing.assert_close(stats.norm_stat, ref, **TOL)


# --------------------------------------------------------------------------------------------
# scale_and_copy


@pytest.mark.parametrize("src_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("dst_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("scale_value", [None, 0.37, 0.0, 1.0, 1e30])
def test_scale_and_copy_casts_the_float32_product(src_dtype, dst_dtype, scale_value):
    g = gen(13)
    srcs = rand_list(SIZES, [src_dtype], g, offsets=(0, 1, 8))
    dst_offsets = [1 if i % 4 == 2 else 0 for i in range(len(srcs))]  # some misaligned dsts
    dsts = [
        torch.full((x.numel() + k,), 7.0, dtype=dst_dtype, device=DEV)[k:].view(x.shape)
        for x, k in zip(srcs, dst_offsets)
    ]
    scale = None if scale_value is None else scalar(scale_value)
    originals = [x.clone() for x in srcs]
    torch.ops.tpamp.scale_and_copy(srcs, dsts, scale)
    for d, x in zip(dsts, originals):
        assert_bitwise_equal(d, written_ref(x, scale, dst_dtype))
    for x, o in zip(srcs, originals):
        assert_bitwise_equal(x, o)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("scale_value", [None, 0.37, 1e30])
def test_scale_and_copy_in_place(dtype, scale_value):
    g = gen(14)
    xs = rand_list(SIZES, [dtype], g, offsets=(0, 1))
    xs[3][0] = math.nan
    scale = None if scale_value is None else scalar(scale_value)
    want = [written_ref(x, scale, dtype) for x in xs]
    ops.scale_and_copy(xs, xs, scale)  # scale_ in place; None: nothing to do
    for x, w in zip(xs, want):
        assert_bitwise_equal(x, w)


def test_scale_and_copy_many_mixed_tensors_matches_the_pytorch_path():
    g = gen(15)
    n = 2500
    sizes = torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(15)).tolist()
    srcs = rand_list(sizes, [torch.float32], g)
    dst_dtypes = [DTYPES[i % 3] for i in range(n)]
    a = [torch.empty(x.shape, dtype=d, device=DEV) for x, d in zip(srcs, dst_dtypes)]
    b = [torch.empty(x.shape, dtype=d, device=DEV) for x, d in zip(srcs, dst_dtypes)]
    scale = scalar(0.61)
    ops.scale_and_copy(srcs, a, scale)
    with fallback():
        ops.scale_and_copy(srcs, b, scale)
    for x, y in zip(a, b):
        assert_bitwise_equal(x, y)
    # fp32 in place (the grad clip) and the plain cast-copy (main -> model params)
    c = [x.clone() for x in srcs]
    d = [x.clone() for x in srcs]
    ops.scale_and_copy(c, c, scale)
    with fallback():
        ops.scale_and_copy(d, d, scale)
    for x, y in zip(c, d):
        assert_bitwise_equal(x, y)
    ops.scale_and_copy(srcs, a)
    with fallback():
        ops.scale_and_copy(srcs, b)
    for x, y in zip(a, b):
        assert_bitwise_equal(x, y)


def test_scale_and_copy_rejects_bad_inputs_naming_them():
    a = torch.ones(4, device=DEV)
    with pytest.raises(RuntimeError, match=r"dsts has 2 tensors, srcs has 1"):
        torch.ops.tpamp.scale_and_copy([a], [a, a], None)
    with pytest.raises(RuntimeError, match=r"dsts\[0\] has shape \[3\]"):
        torch.ops.tpamp.scale_and_copy([a], [torch.ones(3, device=DEV)], None)
    with pytest.raises(RuntimeError, match=r"dsts\[0\] has dtype Double"):
        torch.ops.tpamp.scale_and_copy([a], [a.double()], None)
    with pytest.raises(RuntimeError, match=r"scale is on cpu"):
        torch.ops.tpamp.scale_and_copy([a], [torch.ones(4, device=DEV)], torch.ones(1))
    with pytest.raises(RuntimeError, match=r"srcs\[0\] and dsts\[0\] overlap|dsts\[0\] and srcs\[0\] overlap"):
        torch.ops.tpamp.scale_and_copy([a], [a], None)


# --------------------------------------------------------------------------------------------
# dynamic scaler update


def test_scaler_update_follows_the_worked_trace_on_the_device():
    """docs/spec.md section 1: hysteresis=2, growth_interval=3, initial 8, min 1."""
    scaler = tpamp.DynamicGradScaler(
        initial_scale=8.0, min_scale=1.0, growth_interval=3, hysteresis=2, device=DEV
    )
    inf, ok = scalar(1.0), scalar(0.0)
    trace = [
        (inf, 8.0, 0, 1), (inf, 4.0, 0, 0), (inf, 2.0, 0, -1), (ok, 2.0, 1, -1),
        (ok, 2.0, 2, -1), (inf, 1.0, 0, -2), (ok, 1.0, 1, -2), (ok, 1.0, 2, -2),
        (ok, 2.0, 0, 2),
    ]
    for step, (flag, scale, growth, hyst) in enumerate(trace):
        scaler.update(flag)
        got = (scaler.scale.item(), scaler.growth_tracker, scaler.hysteresis_tracker)
        assert got == (scale, growth, hyst), f"step {step}"


CONFIGS = [
    dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=3, hysteresis=2, min_scale=1.0,
         max_scale=None, consecutive_hysteresis=False),
    dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=2, hysteresis=3, min_scale=4.0,
         max_scale=64.0, consecutive_hysteresis=True),
    dict(growth_factor=1.7, backoff_factor=0.37, growth_interval=1, hysteresis=1,
         min_scale=0.3, max_scale=1e7, consecutive_hysteresis=False),
    dict(growth_factor=3.3, backoff_factor=0.9, growth_interval=4, hysteresis=2,
         min_scale=1e-3, max_scale=None, consecutive_hysteresis=True),
]


@pytest.mark.parametrize("config", CONFIGS, ids=[f"config{i}" for i in range(len(CONFIGS))])
def test_scaler_update_kernel_matches_the_pytorch_path_bit_for_bit(config):
    steps = torch.rand(300, generator=torch.Generator().manual_seed(16)) < 0.35
    state = {}
    for name, use_fallback in (("kernel", False), ("torch", True)):
        scale = torch.tensor([1024.0], device=DEV)
        growth = torch.zeros(1, dtype=torch.int32, device=DEV)
        hyst = torch.full((1,), config["hysteresis"], dtype=torch.int32, device=DEV)
        history = []
        ctx = fallback() if use_fallback else contextlib.nullcontext()
        with ctx:
            for i, overflow in enumerate(steps.tolist()):
                flag = scalar(math.nan if (overflow and i % 7 == 0) else float(overflow))
                ops.dynamic_scaler_update_(scale, growth, hyst, flag, **config)
                history.append(torch.cat([scale.view(torch.int32), growth, hyst]))
        state[name] = torch.stack(history)
    assert torch.equal(state["kernel"], state["torch"])


def test_scaler_update_rejects_bad_inputs_naming_them():
    scale = torch.tensor([8.0], device=DEV)
    growth = torch.zeros(1, dtype=torch.int32, device=DEV)
    hyst = torch.ones(1, dtype=torch.int32, device=DEV)
    args = (2.0, 0.5, 10, 2, 1.0, math.inf, False)
    with pytest.raises(RuntimeError, match=r"growth_tracker must be a 1-element Int"):
        torch.ops.tpamp.dynamic_scaler_update_(scale, growth.long(), hyst, scalar(0.0), *args)
    with pytest.raises(RuntimeError, match=r"found_inf is on cpu"):
        torch.ops.tpamp.dynamic_scaler_update_(scale, growth, hyst, torch.zeros(1), *args)


# --------------------------------------------------------------------------------------------
# no host synchronisation


def test_ops_make_no_host_sync():
    g = gen(17)
    grads = rand_list([1000, 0, 65537, 9], DTYPES, g)
    outs = [torch.empty(x.shape, device=DEV) for x in grads]
    mains = [torch.randn(x.shape, generator=g, device=DEV) for x in grads]
    models = [torch.empty(x.shape, dtype=x.dtype, device=DEV) for x in grads]
    scaler = tpamp.DynamicGradScaler(initial_scale=2.0**16, device=DEV)
    kw = dict(norm_mask=[True, False, True, True], count_zeros=True, per_tensor_norms=True)
    ops.grad_stats(grads, out=outs, scale=scaler.inv_scale, norm_type=2.0, **kw)  # warm-up
    with no_host_sync():
        stats = ops.grad_stats(grads, out=outs, scale=scaler.inv_scale, norm_type=2.0, **kw)
        ops.grad_stats(outs, norm_type=math.inf, **kw)
        ops.grad_stats(outs, scale=scaler.inv_scale, norm_type=None)
        scaler.update(stats.found_inf)
        ops.scale_and_copy(outs, outs, stats.norm_stat.reshape(1).float())
        ops.scale_and_copy(mains, models)
        ops.scale_and_copy(mains, models, scaler.scale)
    torch.cuda.synchronize()


# --------------------------------------------------------------------------------------------
# the optimizer step (docs/spec.md section 2) with and without the extension


def _make_params(seed):
    g = torch.Generator().manual_seed(seed)
    shapes = [(96, 64), (64,), (33, 7), (1,), (300, 129), (5, 5)]
    dtypes = [torch.float16, torch.float16, torch.bfloat16, torch.float32, torch.float16,
              torch.float32]
    params = []
    for shape, dtype in zip(shapes, dtypes):
        p = torch.nn.Parameter((torch.randn(shape, generator=g) * 0.05).to(DEV, dtype))
        params.append(p)
    params[2].tensor_model_parallel = True
    params[5].shared = True  # a tied copy: left out of the norm and the zero count
    return params


def _grads_for_step(params, step, loss_scale):
    g = torch.Generator(device=DEV).manual_seed(1000 + step)
    grads = []
    for i, p in enumerate(params):
        x = torch.randn(p.shape, generator=g, device=DEV) * 0.1
        x[torch.rand(p.shape, generator=g, device=DEV) < 0.05] = 0.0
        if step == 3 and i == 4:
            x.view(-1)[-1] = math.inf  # an overflow: the step is skipped
        grads.append((x * loss_scale).to(p.dtype))
    return grads


def _run_training(use_extension, steps=7, sync_free=False):
    params = _make_params(0)
    inner = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, fused=sync_free or None)
    scaler = tpamp.DynamicGradScaler(
        initial_scale=2.0**10, growth_interval=2, hysteresis=1, device=DEV
    )
    opt = tpamp.MixedPrecisionOptimizer(
        inner, grad_scaler=scaler, clip_grad=1.0, log_num_zeros_in_grad=True, sync_free=sync_free
    )
    results, scales = [], []
    ctx = contextlib.nullcontext() if use_extension else fallback()
    with ctx:
        for step in range(steps):
            for p, gr in zip(params, _grads_for_step(params, step, opt.get_loss_scale())):
                p.grad = gr
            results.append(opt.step())
            scales.append(opt.get_loss_scale().clone())
            opt.zero_grad()
    mains = [p.detach().clone() for group in opt.param_groups for p in group["params"]]
    return results, scales, [p.detach().clone() for p in params], mains


def test_optimizer_step_is_the_same_with_and_without_the_extension():
    res_a, scales_a, model_a, main_a = _run_training(use_extension=True)
    res_b, scales_b, model_b, main_b = _run_training(use_extension=False)
    assert [r.update_successful for r in res_a] == [r.update_successful for r in res_b]
    assert not res_a[3].update_successful
    for ra, rb in zip(res_a, res_b):
        assert ra.num_zeros_in_grad == rb.num_zeros_in_grad
        if ra.grad_norm is None:
            assert rb.grad_norm is None
        else:
            assert ra.grad_norm == pytest.approx(rb.grad_norm, rel=2e-5)
    for sa, sb in zip(scales_a, scales_b):
        assert torch.equal(sa, sb)
    for a, b in zip(main_a, main_b):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(model_a, model_b):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def test_sync_free_optimizer_step_makes_no_host_sync():
    params = _make_params(1)
    inner = torch.optim.AdamW(params, lr=1e-2, fused=True)
    scaler = tpamp.DynamicGradScaler(initial_scale=2.0**10, device=DEV)
    opt = tpamp.MixedPrecisionOptimizer(
        inner, grad_scaler=scaler, clip_grad=1.0, log_num_zeros_in_grad=True, sync_free=True
    )
    for step in range(5):  # step 3 overflows and is skipped on the device
        for p, gr in zip(params, _grads_for_step(params, step, opt.get_loss_scale())):
            p.grad = gr
        if step == 0:
            opt.step()  # the first step creates the optimizer state
        else:
            with no_host_sync():
                result = opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    assert bool(result.update_successful)
    assert math.isfinite(float(result.grad_norm))
