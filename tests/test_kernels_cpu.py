"""Specification tests for the CPU kernels of tpamp._C_cpu_* (torch.ops.tpamp.* on CPU tensors).

Every expected value is computed here in float64 from the inputs (test_ops.round_to rounds a
float64 value once to a dtype): the values an op must write are ``float32(x * scale)`` rounded to
the destination dtype; the statistics are float64 sums / maxima / exact counts over those values.
The kernels accumulate squares in float32 per 4096-element block and the blocks in float64, so
sums of squares are compared with a relative tolerance of 1e-6; everything else is exact.

Skipped when the CPU kernels are not built (the PyTorch path is tested by test_ops.py).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from test_ops import f64, round_to

from tpamp import _ext, ops

pytestmark = pytest.mark.skipif(
    not ops.extension_available("cpu"), reason=f"CPU kernels not built: {_ext.status()}"
)

TP = torch.ops.tpamp
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CHUNK = 65536
# around the SIMD steps (16 .. 32 elements), the fp32 sum block (4096) and the chunk (65536)
SIZES = [0, 1, 7, 15, 16, 17, 31, 32, 33, 0, 63, 65, 4095, 4096, 4097, 65535, 65536, 65537,
         131073, 3]
RTOL_SUMSQ = 1e-6


def _rand(n, dtype, gen, scale=1.0):
    return (torch.randn(n, generator=gen, dtype=torch.float64) * scale).to(dtype)


def _expected_values(grads, scale, out_dtype=None):
    """float64 arrays of float32(g * scale) rounded to the dtype written."""
    res = []
    for g in grads:
        x = f64(g)
        if scale is not None:
            x = (x * float(scale)).astype(np.float32).astype(np.float64)
        res.append(round_to(x, out_dtype or g.dtype))
    return res


def _check_stats(res, values, mask, per_tensor=True):
    found, sumsq, amax, zeros, pt = res
    counted = [v for v, m in zip(values, mask) if m]
    flat = np.concatenate(counted) if counted else np.zeros(0)
    allv = np.concatenate(values) if values else np.zeros(0)
    assert found.dtype == torch.float32 and found.shape == (1,)
    assert float(found[0]) == float(not np.all(np.isfinite(allv)))
    assert sumsq.dtype == torch.float64 and sumsq.dim() == 0
    ref_sq = float(np.sum(flat * flat))
    if math.isfinite(ref_sq):
        assert float(sumsq) == pytest.approx(ref_sq, rel=RTOL_SUMSQ, abs=0.0)
    else:
        assert not math.isfinite(float(sumsq))
    if flat.size and np.isnan(flat).any():
        assert math.isnan(float(amax))
    else:
        assert float(amax) == (float(np.max(np.abs(flat))) if flat.size else 0.0)
    assert zeros.dtype == torch.int64 and int(zeros) == int(np.sum(flat == 0.0))
    if per_tensor:
        assert pt.dtype == torch.float32 and pt.shape == (len(values),)
        for i, v in enumerate(values):
            ref = math.sqrt(float(np.sum(v * v))) if v.size else 0.0
            assert float(pt[i]) == pytest.approx(ref, rel=1e-6, abs=0.0, nan_ok=True), i


# --------------------------------------------------------------------------------------------
# grad_stats_ / grad_stats_out


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("variant", ["in_place", "out"])
def test_grad_stats_odd_sizes_around_vector_width_and_chunks(dtype, variant):
    gen = torch.Generator().manual_seed(1)
    grads = [_rand(n, dtype, gen) for n in SIZES]
    grads[4][3] = 0.0
    grads[12][-1] = -0.0
    mask = [i % 3 != 1 for i in range(len(grads))]
    scale = torch.tensor([0.25])
    if variant == "in_place":
        values = _expected_values(grads, scale)
        res = TP.grad_stats_(grads, scale, mask, True, True)
        written = grads
    else:
        values = _expected_values(grads, scale, torch.float32)
        out = [torch.full(g.shape, 7.0) for g in grads]
        before = [g.clone() for g in grads]
        res = TP.grad_stats_out(grads, scale, mask, True, True, out=out)
        written = out
        for g, b in zip(grads, before):
            assert torch.equal(g, b), "grad_stats_out changed its input"
    for w, v in zip(written, values):
        np.testing.assert_array_equal(f64(w), v)
    _check_stats(res, values, mask)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
def test_grad_stats_every_accumulator_slot_counts_zeros_and_sees_inf_and_nan(dtype):
    """The vector loop keeps four accumulators (four vector steps of up to 16 lanes each, then a
    tail by whole vector steps, then scalars): a zero, a -0.0, an inf and a NaN placed at each
    position of a 64-element group and of the block tail are counted / found exactly as the
    float64 reference of the same values."""
    gen = torch.Generator().manual_seed(11)
    n = 4096 + 64 + 40  # one full sum block, one full group, a tail of vector steps and scalars
    for pos in list(range(0, 64, 5)) + [4096 + 1, 4096 + 63, 4096 + 64 + 17, n - 1]:
        base = _rand(n, dtype, gen)
        zeros = base.clone()
        zeros[pos] = 0.0
        zeros[(pos * 7 + 3) % n] = -0.0
        res = TP.grad_stats_([zeros], None, [True], True, False)
        _check_stats(res, _expected_values([zeros], None), [True], per_tensor=False)
        assert int(res[3]) == int((zeros.double() == 0).sum()), pos
        for bad in (math.inf, -math.inf, math.nan):
            g = base.clone()
            g[pos] = bad
            found, sumsq, amax, _, _ = TP.grad_stats_([g], None, [True], True, False)
            assert float(found) == 1.0, (pos, bad)
            if math.isnan(bad):
                assert math.isnan(float(amax)) and math.isnan(float(sumsq)), pos
            else:
                assert float(amax) == math.inf, (pos, bad)


def test_grad_stats_without_scale_in_place_writes_nothing_and_counts():
    gen = torch.Generator().manual_seed(2)
    grads = [_rand(n, torch.float16, gen) for n in (100, 70000)]
    v0 = [g._version for g in grads]
    values = _expected_values(grads, None)
    res = TP.grad_stats_(grads, None, [True, True], True, True)
    _check_stats(res, values, [True, True])
    assert [g._version for g in grads] == [v + 1 for v in v0]  # marked mutated: bumped


def test_grad_stats_views_at_odd_offsets_and_mixed_dtypes():
    gen = torch.Generator().manual_seed(3)
    base16 = _rand(300001, torch.float16, gen)
    base32 = _rand(200003, torch.float32, gen)
    basebf = _rand(100007, torch.bfloat16, gen)
    grads = [base16[1:70001], basebf[3:50004], base32[5:5 + 65537], base16[70001 + 7:70001 + 7 + 33]]
    outbase = torch.zeros(400000)
    out, off = [], 1
    for g in grads:
        out.append(outbase[off:off + g.numel()])
        off += g.numel() + 3
    scale = torch.tensor([3.0])
    values = _expected_values(grads, scale, torch.float32)
    res = TP.grad_stats_out(grads, scale, [True] * 4, True, True, out=out)
    for w, v in zip(out, values):
        np.testing.assert_array_equal(f64(w), v)
    _check_stats(res, values, [True] * 4)


def test_grad_stats_empty_list_and_empty_tensors():
    res = TP.grad_stats_([], torch.tensor([2.0]), [], True, True)
    assert [float(r.sum()) for r in res] == [0.0, 0.0, 0.0, 0.0, 0.0]
    assert res[4].shape == (0,)
    grads = [torch.zeros(0, dtype=torch.float16), torch.zeros(0, 5), torch.ones(3).half()]
    res = TP.grad_stats_(grads, None, [True, True, True], True, True)
    _check_stats(res, _expected_values(grads, None), [True] * 3)


def test_grad_stats_nan_and_inf_in_one_list_nan_wins_the_max():
    gen = torch.Generator().manual_seed(4)
    grads = [_rand(n, torch.float16, gen) for n in (40, 70000, 9)]
    grads[0][5] = math.inf
    grads[1][66000] = math.nan
    grads[2][1] = -math.inf
    res = TP.grad_stats_([g.clone() for g in grads], None, [True] * 3, True, True)
    assert float(res[0]) == 1.0 and math.isnan(float(res[2]))
    _check_stats(res, _expected_values(grads, None), [True] * 3)
    # NaN outside the mask still sets found_inf, but not the max
    res = TP.grad_stats_(grads, None, [True, False, True], True, False)
    assert float(res[0]) == 1.0 and float(res[2]) == math.inf


def test_grad_stats_overflow_of_the_multiply_counts_as_found_inf():
    g = torch.tensor([60000.0, 1.0], dtype=torch.float16)
    res = TP.grad_stats_([g], torch.tensor([4.0]), [True], False, False)
    assert float(res[0]) == 1.0 and math.isinf(float(g[0])) and float(g[1]) == 4.0


def test_grad_stats_negative_zero_is_a_zero():
    g = torch.tensor([-0.0, 0.0, 1.0, -0.0] * 9, dtype=torch.bfloat16)
    res = TP.grad_stats_([g], None, [True], True, False)
    assert int(res[3]) == 27


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grad_stats_squares_beyond_fp32_give_the_finite_fp64_norm(dtype):
    gen = torch.Generator().manual_seed(5)
    # 1e20: each square overflows fp32; 1e18 * 1000 in one block: the fp32 block sum overflows
    big = [torch.full((37,), 1.0e20, dtype=dtype), torch.full((5000,), 1.0e18, dtype=dtype),
           _rand(70000, dtype, gen, scale=1e19)]
    values = _expected_values(big, None)
    res = TP.grad_stats_(big, None, [True] * 3, True, True)
    ref = float(sum(np.sum(v * v) for v in values))
    assert math.isfinite(ref) and float(res[0]) == 0.0
    assert float(res[1]) == pytest.approx(ref, rel=RTOL_SUMSQ)
    # and through the public function: a finite L2 norm, on the kernels and on the PyTorch path
    norm = tpamp_clip_norm(big)
    assert math.isfinite(norm) and norm == pytest.approx(math.sqrt(ref), rel=1e-6)
    with ops.force_fallback():
        norm = tpamp_clip_norm(big)
    assert math.isfinite(norm) and norm == pytest.approx(math.sqrt(ref), rel=1e-6)


def tpamp_clip_norm(grads):
    from tpamp.grad_stats import get_grad_norm_fp32

    return float(get_grad_norm_fp32(grads, norm_type=2.0))


def test_grad_stats_thousands_of_tiny_tensors():
    gen = torch.Generator().manual_seed(6)
    grads = [_rand(1 + i % 7, DTYPES[i % 3], gen) for i in range(3000)]
    mask = [i % 5 != 0 for i in range(3000)]
    out = [torch.empty(g.shape) for g in grads]
    values = _expected_values(grads, torch.tensor([0.5]), torch.float32)
    res = TP.grad_stats_out(grads, torch.tensor([0.5]), mask, True, True, out=out)
    _check_stats(res, values, mask)


def test_grad_stats_per_tensor_norms_ignore_the_mask():
    grads = [torch.tensor([3.0, 4.0]), torch.tensor([6.0, 8.0]), torch.tensor([0.0])]
    res = TP.grad_stats_(grads, None, [False, True, False], True, True)
    assert float(res[1]) == 100.0 and float(res[2]) == 8.0 and int(res[3]) == 0
    assert res[4].tolist() == [5.0, 10.0, 0.0]


def test_grad_stats_is_bit_identical_for_any_thread_count():
    gen = torch.Generator().manual_seed(7)
    grads = [_rand(n, torch.float16, gen) for n in (300000, 5, 131073)]
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            out = [torch.empty(g.shape) for g in grads]
            results.append(TP.grad_stats_out(grads, torch.tensor([0.1]), [True] * 3, True, True, out=out))
    finally:
        torch.set_num_threads(threads)
    for r in results[1:]:
        for a, b in zip(results[0], r):
            assert torch.equal(a, b)


def _mem_available_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


@pytest.mark.skipif(
    _mem_available_gib() < 12.0,
    reason="needs a 4 GiB fp16 tensor (2^31 + 2^17 + 5 elements) and 12 GiB of free memory",
)
def test_grad_stats_tensor_beyond_2_to_the_31_elements():
    n = 2**31 + 2**17 + 5
    small = torch.tensor([1.0, -2.0, 0.0], dtype=torch.float16)
    g = torch.full((n,), 0.5, dtype=torch.float16)
    g[2**31 + 1] = 0.0  # beyond int32 indexing
    g[-1] = 3.0
    g[2**31 - 1] = -0.0
    # read-only pass (no scale, in place: nothing to write), to keep the test fast
    res = TP.grad_stats_([small, g], None, [True, True], True, True)
    halves = n - 3
    assert float(res[0]) == 0.0
    assert float(res[1]) == (1.0 + 4.0 + 0.0) + halves * 0.25 + 9.0
    assert float(res[2]) == 3.0
    assert int(res[3]) == 1 + 2
    assert float(res[4][1]) == pytest.approx(math.sqrt(halves * 0.25 + 9.0), rel=1e-6)
    # and a write beyond 2^31 elements: scale it in place
    TP.scale_([g], torch.tensor([2.0]))
    assert float(g[-1]) == 6.0 and float(g[2**31 + 2]) == 1.0 and float(g[2**31 + 1]) == 0.0


# --------------------------------------------------------------------------------------------
# overlap and argument checks (raised on the host, before any memory is touched)


def test_overlapping_entries_are_rejected():
    a = torch.randn(100)
    with pytest.raises(RuntimeError, match=r"grads\[0\] and grads\[1\] overlap"):
        TP.grad_stats_([a, a], None, [True, True], False, False)
    with pytest.raises(RuntimeError, match="overlap"):
        TP.grad_stats_([a[:60], a[50:]], None, [True, True], False, False)
    g = [torch.randn(10).half(), torch.randn(10).half()]
    with pytest.raises(RuntimeError, match=r"out\[0\] and grads\[0\]|grads\[0\] and out\[0\]"):
        TP.grad_stats_out([a[:10]], None, [True], False, False, out=[a[:10]])
    with pytest.raises(RuntimeError, match="overlap"):
        buf = torch.zeros(15)
        TP.grad_stats_out(g, None, [True, True], False, False, out=[buf[:10], buf[5:15]])
    with pytest.raises(RuntimeError, match="overlap"):
        TP.scale_and_copy([a[:50]], [a[25:75]], None)
    with pytest.raises(RuntimeError, match="overlap"):
        TP.scale_([a, a], torch.tensor([0.5]))
    # reading the same memory twice is fine
    out = [torch.empty(100), torch.empty(100)]
    TP.grad_stats_out([a, a], None, [True, True], False, False, out=out)
    assert torch.equal(out[0], a) and torch.equal(out[1], a)


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(RuntimeError, match=r"scale must be a 1-element float32"):
        TP.scale_([torch.ones(2)], torch.ones(2))
    with pytest.raises(RuntimeError, match=r"grads\[1\] has dtype Long"):
        TP.grad_stats_([torch.ones(2), torch.ones(2, dtype=torch.long)], None, [True, True], False, False)
    with pytest.raises(RuntimeError, match=r"grads\[0\] must be non-overlapping and dense"):
        TP.grad_stats_([torch.ones(10)[::2]], None, [True], False, False)
    with pytest.raises(RuntimeError, match=r"out\[0\] has dtype Half; expected float32"):
        TP.grad_stats_out([torch.ones(2)], None, [True], False, False, out=[torch.ones(2).half()])
    with pytest.raises(RuntimeError, match="mask has 1 entries, grads has 2"):
        TP.grad_stats_([torch.ones(2), torch.ones(2)], None, [True], False, False)
    with pytest.raises(RuntimeError, match="writes a tensor that requires grad"):
        TP.scale_([torch.ones(2, requires_grad=True) * 2], torch.tensor([2.0]))


# --------------------------------------------------------------------------------------------
# scale_ / scale_and_copy


@pytest.mark.parametrize("src_dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("dst_dtype", DTYPES, ids=["to_fp32", "to_fp16", "to_bf16"])
def test_scale_and_copy_every_dtype_pair(src_dtype, dst_dtype):
    gen = torch.Generator().manual_seed(8)
    srcs = [_rand(n, src_dtype, gen) for n in (0, 1, 33, 4097, 65537)]
    for scale in (None, torch.tensor([0.3])):
        dsts = [torch.full(s.shape, 9.0, dtype=dst_dtype) for s in srcs]
        TP.scale_and_copy(srcs, dsts, scale)
        for d, v in zip(dsts, _expected_values(srcs, scale, dst_dtype)):
            np.testing.assert_array_equal(f64(d), v)


def test_scale_and_copy_same_dtype_is_bit_exact():
    src = torch.tensor([1.0, math.nan, -0.0, math.inf] * 10)
    bits = src.view(torch.int32).clone()
    bits[1] = 0x7FC00123  # a NaN payload
    src = bits.view(torch.float32)
    dst = torch.empty_like(src)
    TP.scale_and_copy([src], [dst], None)
    assert torch.equal(dst.view(torch.int32), bits)


def test_scale_in_place_and_identity():
    gen = torch.Generator().manual_seed(9)
    ts = [_rand(n, d, gen) for n, d in ((70001, torch.float16), (5, torch.bfloat16), (0, torch.float32))]
    expected = _expected_values(ts, torch.tensor([0.125]))
    TP.scale_(ts, torch.tensor([0.125]))
    for t, v in zip(ts, expected):
        np.testing.assert_array_equal(f64(t), v)
    before = [t.clone() for t in ts]
    TP.scale_(ts, torch.tensor([1.0]))
    for t, b in zip(ts, before):
        assert torch.equal(t, b)


# --------------------------------------------------------------------------------------------
# dynamic scaler: the CPU kernel against Megatron-LM's DynamicGradScaler.update, line by line


class _MegatronScaler:
    """megatron/core/optimizer/grad_scaler.py DynamicGradScaler.update, transcribed (float32
    scale as a 1-element tensor, as Megatron keeps it)."""

    def __init__(self, scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale):
        self._scale = torch.tensor([scale], dtype=torch.float32)
        self.min_scale = torch.tensor([min_scale], dtype=torch.float32)
        self.growth_factor = torch.tensor([growth_factor], dtype=torch.float32)
        self.backoff_factor = torch.tensor([backoff_factor], dtype=torch.float32)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def update(self, found_inf):
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = self._scale * self.growth_factor


def test_dynamic_scaler_update_matches_megatron_line_by_line():
    rng = np.random.default_rng(10)
    oracle = _MegatronScaler(2.0**16, 2.0, 0.5, 3, 2, 1.0)
    scale = torch.tensor([2.0**16])
    growth = torch.zeros(1, dtype=torch.int32)
    hyst = torch.full((1,), 2, dtype=torch.int32)
    for step in range(200):
        inf = bool(rng.random() < 0.4)
        oracle.update(inf)
        TP.dynamic_scaler_update_(scale, growth, hyst, torch.tensor([float(inf)]), 2.0, 0.5, 3, 2,
                                  1.0, math.inf, False)
        assert float(scale) == float(oracle._scale), step
        assert int(growth) == oracle._growth_tracker and int(hyst) == oracle._hysteresis_tracker


# --------------------------------------------------------------------------------------------
# torch custom-op contract: opcheck, fake tensors, torch.compile


def _opcheck_samples():
    gen = torch.Generator().manual_seed(11)
    g = [_rand(70001, torch.float16, gen), _rand(5, torch.float32, gen), torch.zeros(0).bfloat16()]
    out = [torch.empty(t.shape) for t in g]
    s = torch.tensor([0.5])
    i32 = dict(dtype=torch.int32)
    return [
        (TP.grad_stats_.default, (g, s, [True, False, True], True, True), {}),
        (TP.grad_stats_.default, ([t.clone() for t in g], None, [True] * 3, False, False), {}),
        (TP.grad_stats_out.default, (g, s, [True, True, False], True, True), {"out": out}),
        (TP.scale_.default, ([t.clone() for t in g], s), {}),
        (TP.scale_and_copy.default, (g, [torch.empty(t.shape).half() for t in g], s), {}),
        (TP.scale_and_copy.default, (g, [torch.empty(t.shape) for t in g], None), {}),
        (TP.dynamic_scaler_update_.default,
         (torch.tensor([4.0]), torch.zeros(1, **i32), torch.ones(1, **i32), torch.tensor([1.0]),
          2.0, 0.5, 10, 1, 1.0, math.inf, False), {}),
    ]


@pytest.mark.parametrize("case", range(7))
def test_opcheck(case):
    op, args, kwargs = _opcheck_samples()[case]
    torch.library.opcheck(op, args, kwargs)


def test_torch_compile_fullgraph_grad_stats():
    torch._dynamo.reset()

    def step(grads, outs, scale):
        st = ops.grad_stats(grads, out=outs, scale=scale, norm_type=2.0, count_zeros=True)
        return st.found_inf, st.norm_stat.sqrt(), st.num_zeros

    gen = torch.Generator().manual_seed(12)
    grads = [_rand(n, torch.float16, gen) for n in (1000, 17, 65537)]
    grads[1][3] = 0.0
    scale = torch.tensor([0.5])
    outs = [torch.empty(g.shape) for g in grads]
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    found, norm, zeros = compiled(grads, outs, scale)
    values = _expected_values(grads, scale, torch.float32)
    for o, v in zip(outs, values):
        np.testing.assert_array_equal(f64(o), v)
    ref = math.sqrt(sum(float(np.sum(v * v)) for v in values))
    assert float(found) == 0.0 and float(norm) == pytest.approx(ref, rel=1e-6)
    assert int(zeros) == sum(int(np.sum(v == 0)) for v in values)


# --------------------------------------------------------------------------------------------
# dispatch from tpamp.ops


def _spy(monkeypatch):
    calls = []

    class Spy:
        def __getattr__(self, name):
            def call(*args, **kwargs):
                calls.append((name, args, kwargs))
                return getattr(TP, name)(*args, **kwargs)

            return call

    monkeypatch.setattr(ops, "_kernels", lambda device: Spy())
    return calls


def test_dispatch_sends_only_the_tensors_a_kernel_cannot_take_to_the_fallback(monkeypatch):
    calls = _spy(monkeypatch)
    gen = torch.Generator().manual_seed(13)
    dense = _rand(2 * 3 * 4 * 5, torch.float16, gen).reshape(2, 3, 4, 5)
    cl = dense.to(memory_format=torch.channels_last)  # dense, not contiguous: a kernel takes it
    strided = _rand(40, torch.float16, gen)[::2]  # not dense: the fallback
    own = _rand(9, torch.float32, gen)  # fp32 grad that is its own out: in place
    grads = [cl, strided, own]
    outs = [torch.empty(cl.shape).to(memory_format=torch.channels_last), torch.empty(20), own]
    values = _expected_values(grads, torch.tensor([0.5]), torch.float32)
    st = ops.grad_stats(grads, out=outs, scale=torch.tensor([0.5]), norm_type=2.0,
                        count_zeros=True, per_tensor_norms=True)
    names = [c[0] for c in calls]
    assert sorted(names) == ["grad_stats_", "grad_stats_out"]
    (ip,) = [c for c in calls if c[0] == "grad_stats_"]
    (cp,) = [c for c in calls if c[0] == "grad_stats_out"]
    assert ip[1][0][0] is own and len(ip[1][0]) == 1
    assert cp[1][0][0] is cl and len(cp[1][0]) == 1
    for o, v in zip(outs, values):
        np.testing.assert_array_equal(f64(o.contiguous()), f64(torch.tensor(v)))
    ref = sum(float(np.sum(v * v)) for v in values)
    assert float(st.norm_stat) == pytest.approx(ref, rel=1e-6)
    for i, v in enumerate(values):
        assert float(st.per_tensor_norms[i]) == pytest.approx(math.sqrt(np.sum(v * v)), rel=1e-6)


def test_dispatch_checks_every_tensors_device():
    if not torch.cuda.is_available():
        meta = torch.empty(3, device="meta")
        with pytest.raises(ValueError, match=r"grads\[1\] is on meta, expected cpu"):
            ops.grad_stats([torch.ones(3), meta])
        with pytest.raises(ValueError, match=r"scale is on meta, expected cpu"):
            ops.scale_and_copy([torch.ones(3)], [torch.ones(3)], torch.empty(1, device="meta"))
        with pytest.raises(ValueError, match=r"dsts\[0\] is on meta"):
            ops.scale_and_copy([torch.ones(3)], [meta])


@pytest.mark.parametrize(
    "fused_step, expected",
    [
        (False, ("tpamp::grad_stats_out", "tpamp::scale_and_copy", "tpamp::dynamic_scaler_update_")),
        (True, ("tpamp::grad_stats_", "tpamp::fused_sgd_step_", "tpamp::dynamic_scaler_update_")),
    ],
)
def test_optimizer_step_on_cpu_runs_the_kernels(fused_step, expected):
    from torch.profiler import ProfilerActivity, profile

    from tpamp.grad_scaler import DynamicGradScaler
    from tpamp.optimizer import MixedPrecisionOptimizer

    torch.manual_seed(14)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).half()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = MixedPrecisionOptimizer(inner, grad_scaler=DynamicGradScaler(initial_scale=2.0**8),
                                  clip_grad=1.0, log_num_zeros_in_grad=True,
                                  fused_step=fused_step)
    loss = model(torch.randn(4, 8).half()).float().pow(2).sum()
    (loss * 2.0**8).backward()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        opt.step()
    names = {e.name for e in prof.events()}
    for op in expected:
        assert op in names, (op, sorted(n for n in names if "tpamp" in n))


@pytest.mark.parametrize("capability", ["default", "avx2"])
def test_other_capability_modules_give_the_same_results(capability):
    """The modules the CPU does not pick by itself, forced with ATEN_CPU_CAPABILITY."""
    code = (
        "import torch, math\n"
        "from tpamp import _ext, ops\n"
        "assert ops.extension_available(), _ext.status()\n"
        "print(_ext.status()['cpu_module'])\n"
        "g = torch.Generator().manual_seed(15)\n"
        "gr = [torch.randn(n, generator=g).to(d) for n, d in ((70001, torch.float16), (33, torch.bfloat16), (4097, torch.float32))]\n"
        "gr[0][5] = 0.0; gr[2][7] = 1e20\n"
        "out = [torch.empty(t.shape) for t in gr]\n"
        "r = torch.ops.tpamp.grad_stats_out(gr, torch.tensor([0.5]), [True] * 3, True, True, out=out)\n"
        "ref = [t.double() * 0.5 for t in gr]\n"
        "assert all(torch.equal(o.double(), e) for o, e in zip(out, ref))\n"
        "sq = sum(float((e * e).sum()) for e in ref)\n"
        "assert abs(float(r[1]) - sq) <= 1e-6 * sq, (float(r[1]), sq)\n"
        "assert float(r[2]) == max(float(e.abs().max()) for e in ref) and int(r[3]) >= 1\n"
    )
    from tpamp import _ext as ext

    if not os.path.exists(os.path.dirname(ext.__file__)):
        pytest.skip("no package dir")
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
    native = torch.backends.cpu.get_cpu_capability().lower()
    if capability == "avx2" and native not in ("avx2", "avx512"):
        pytest.skip(f"this CPU is {native}")
    root = os.path.dirname(os.path.dirname(os.path.abspath(ext.__file__)))
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split()[0] == f"tpamp._C_cpu_{capability}"
