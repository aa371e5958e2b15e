"""Specification tests for the exact sum-of-squares kernels (csrc/kernels/exact_sumsq.h):
``torch.ops.tpamp.grad_sumsq_exact`` and ``torch.ops.tpamp.exact_sumsq_to_double`` on CPU (the CPU
kernels) and the CUDA launchers under the SIMT emulator (``torch.ops.tpamp_simt``, every schedule
order), against a pure-Python big-integer reference written here.

Reference: each value r = float32(float(x) * scale) (the float64 product of two float32 numbers
is exact, rounded once to float32), skipped when not finite; r = n / 2^k (``as_integer_ratio``),
so r^2 * 2^298 = n^2 * 2^(298 - 2k) is an integer; X is their sum (Python ints), its digits
X's base-2^24 digits (the 26th holding the rest); the float64 of digits d is
``sum(d[i] << 24 i) / 2**298`` (CPython's int / int is correctly rounded), cross-checked with
``math.fsum`` of the float64 squares (exact in float64). Everything is compared exactly.
"""

from __future__ import annotations

import collections
import math
import os
import random
import subprocess
import sys

import pytest
import simt_utils
import torch
from simt_utils import order  # noqa: F401  (fixture: every SIMT test runs in each schedule order)

from tpamp import _ext, ops

pytestmark = pytest.mark.skipif(
    not ops.extension_available("cpu"), reason=f"CPU kernels not built: {_ext.status()}"
)

TP = torch.ops.tpamp  # the kernels of the tensors' device
CPU = TP  # on CPU tensors: the CPU kernels
SIMT = simt_utils.load()
needs_simt = pytest.mark.skipif(SIMT is None, reason=simt_utils.skip_reason())
DIGITS = 26
BASE_BITS = 24
UNIT = 298  # digit i weighs 2^(24 i - 298)
FLT_MAX = 3.4028234663852886e38
FLT_TRUE_MIN = 2.0**-149
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CHUNK = 65536


# ---------------------------------------------------------------------------------------------
# the reference (Python integers)


def r_values(tensors, scale=None):
    """The values the op squares, as Python floats: float32(float(x) * scale)."""
    out = []
    for t in tensors:
        v = t.detach().reshape(-1).double()
        if scale is not None:
            v = v * float(scale)
        out.extend(v.to(torch.float32).double().tolist())
    return out


def exact_int(values):
    """X = sum of r^2 * 2^298 over the finite values (an integer)."""
    x = 0
    for r, count in collections.Counter(values).items():
        if not math.isfinite(r) or r == 0.0:
            continue
        n, d = r.as_integer_ratio()
        k = d.bit_length() - 1  # d = 2^k, k <= 149
        x += count * ((n * n) << (UNIT - 2 * k))
    return x


def to_digits(x):
    return [float((x >> (BASE_BITS * i)) & ((1 << BASE_BITS) - 1)) for i in range(DIGITS - 1)] + [
        float(x >> (BASE_BITS * (DIGITS - 1)))
    ]


def from_digits(digits):
    ds = [int(d) for d in digits]
    assert all(float(i) == float(d) for i, d in zip(ds, digits))
    return sum(d << (BASE_BITS * i) for i, d in enumerate(ds))


def ref_double(x):
    return x / (1 << UNIT)  # int / int: correctly rounded


def digits_tensor(ds):
    return torch.tensor([float(d) for d in ds], dtype=torch.float64)


def assert_digits(res, values, what=""):
    """res (float64 [26]) is the normalized digit vector of the exact sum of squares of values."""
    assert res.dtype == torch.float64 and res.shape == (DIGITS,), (what, res.dtype, res.shape)
    x = exact_int(values)
    got = res.tolist()
    assert got == to_digits(x), (what, got, to_digits(x))
    return x


# ---------------------------------------------------------------------------------------------
# the inputs


def make_list(seed, sizes, dtypes=DTYPES, offsets=(0, 1, 3), specials=True):
    """Tensors of the given sizes, dtypes in turn, as views at storage offsets in turn (odd
    offsets: misaligned pointers), values spread over many binades (randn times 2^k, k in
    [-40, 40]), ~10% zeros (-0.0 among them); with specials, inf, -inf and NaN in separate
    tensors and the float32 extremes (2^-149, FLT_MAX, a subnormal) in the float32 ones."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(sizes):
        off = offsets[i % len(offsets)]
        k = torch.randint(-40, 41, (n + off,), generator=g).double()
        buf = torch.randn(n + off, generator=g, dtype=torch.float64) * torch.exp2(k)
        buf[torch.rand(n + off, generator=g) < 0.1] = 0.0
        buf[torch.rand(n + off, generator=g) < 0.02] = -0.0
        out.append(buf.to(dtypes[i % len(dtypes)])[off:])
    if specials:
        big = [t for t in out if t.numel() > 100]
        big[0][17] = math.inf
        big[1][5] = -math.inf
        big[2][99] = math.nan
        f32 = [t for t in out if t.dtype == torch.float32 and t.numel() > 10]
        for t in f32:
            t[1], t[2], t[3], t[4] = FLT_TRUE_MIN, -FLT_MAX, FLT_MAX, -3.0e-39
    return out


SIZES = (0, 1, 3, 7, 8, 9, 0, 31, 513, 4097, 65537, 131075, 5, 0)


def ops_under_test():
    """(name, op namespace): the CPU kernels, and the emulated CUDA launchers when built."""
    out = [("cpu", CPU)]
    if SIMT is not None:
        out.append(("simt", SIMT))
    return out


# ---------------------------------------------------------------------------------------------
# the reference itself, on hand-worked cases


def test_reference_on_hand_worked_values():
    assert exact_int([FLT_TRUE_MIN]) == 1  # (2^-149)^2 = 2^-298: one unit
    assert exact_int([1.0]) == 1 << 298
    assert exact_int([-3.0, math.nan, math.inf]) == 9 << 298
    assert to_digits(1 << 298) == [0.0] * 12 + [float(1 << 10)] + [0.0] * 13  # 298 = 12 * 24 + 10
    assert ref_double(exact_int([0.1, 3.0])) == math.fsum([0.1**2, 9.0])


# ---------------------------------------------------------------------------------------------
# grad_sumsq_exact


def check_sumsq(op, tensors, scale=None, what=""):
    res = op.grad_sumsq_exact(tensors, scale)
    values = r_values(tensors, scale)
    x = assert_digits(res, values, what)
    # the conversion, and the design's independent reference: math.fsum of the float64 squares
    conv = op.exact_sumsq_to_double(res)
    assert conv.dtype == torch.float64 and conv.shape == ()
    assert float(conv) == ref_double(x), what
    assert float(conv) == math.fsum(r * r for r in values if math.isfinite(r)), what
    return res


@pytest.mark.parametrize("scale", [None, 0.37, 2.0**-20, 2.0**20, 0.0])
def test_cpu_adversarial_list(scale):
    ts = make_list(1, SIZES)
    sc = None if scale is None else torch.tensor(scale, dtype=torch.float32)
    check_sumsq(CPU, ts, sc, f"scale {scale}")


@needs_simt
@pytest.mark.parametrize("scale", [None, 0.37, 2.0**-20])
def test_simt_adversarial_list_matches_cpu_and_reference(order, scale):
    ts = make_list(1, SIZES)
    sc = None if scale is None else torch.tensor([scale], dtype=torch.float32)
    a = check_sumsq(SIMT, ts, sc, f"{order} scale {scale}")
    b = CPU.grad_sumsq_exact(ts, sc)
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_extremes_of_each_dtype(dtype):
    fi = torch.finfo(dtype)
    vals = [fi.max, -fi.max, fi.tiny, fi.smallest_normal / 2, fi.tiny * fi.eps, -0.0, 0.0, 1.0,
            math.inf, -math.inf, math.nan, fi.eps, 1.0 + fi.eps]
    t = torch.tensor(vals, dtype=torch.float64).to(dtype)
    for name, op in ops_under_test():
        check_sumsq(op, [t], None, f"{name} {dtype}")
        check_sumsq(op, [t], torch.tensor(3.0), f"{name} {dtype} scale 3 (fp32 overflow skipped)")


def test_full_chunks_of_the_largest_mantissa_fill_a_bin_to_its_bound():
    """65536 values with M = 2^24 - 1 in one exponent: a chunk's bin reaches
    2^16 (2^24 - 1)^2 < 2^64, the uint64 bound; three chunks and a tail, in every dtype."""
    v = (2**24 - 1) * 2.0**-23  # largest float32 below 2
    for name, op in ops_under_test():
        for dtype, val in ((torch.float32, v), (torch.float32, FLT_MAX),
                           (torch.float16, 65504.0), (torch.bfloat16, 3.3895313892515355e38)):
            t = torch.full((3 * CHUNK + 5,), val, dtype=torch.float64).to(dtype)
            check_sumsq(op, [t], None, f"{name} {dtype} {val}")


def test_empty_list_and_empty_tensors():
    for name, op in ops_under_test():
        res = op.grad_sumsq_exact([], torch.tensor(2.0))
        assert res.tolist() == [0.0] * DIGITS, name
        assert float(op.exact_sumsq_to_double(res)) == 0.0
        res = op.grad_sumsq_exact([torch.empty(0), torch.empty(0, 3, dtype=torch.float16)], None)
        assert res.tolist() == [0.0] * DIGITS, name
        res = op.grad_sumsq_exact([torch.zeros(5), torch.tensor([math.nan, -0.0])], None)
        assert res.tolist() == [0.0] * DIGITS, name


def split_and_shuffle(whole, gen, pieces):
    """The values of `whole` permuted and cut into `pieces` tensors of random sizes (empty ones
    too; views of one buffer at odd offsets), in random order."""
    flat = whole.reshape(-1)[torch.randperm(whole.numel(), generator=gen)]
    cuts = sorted(torch.randint(0, flat.numel() + 1, (pieces - 1,), generator=gen).tolist())
    sizes = [b - a for a, b in zip([0] + cuts, cuts + [flat.numel()])]
    parts = list(torch.split(flat, sizes))
    return [parts[i] for i in torch.randperm(len(parts), generator=gen).tolist()]


@pytest.mark.parametrize("dtype", DTYPES)
def test_any_split_and_order_of_the_same_values_gives_identical_digits(dtype):
    """The order invariance the op exists for: one tensor, 2 tensors, 250 tensors (more than one
    CUDA launch holds), in shuffled orders: the same digits, bit for bit, on both launchers."""
    (whole,) = make_list(7, [3 * CHUNK + 123], dtypes=(dtype,), offsets=(0,), specials=False)
    whole[10:20] = torch.tensor([math.inf, math.nan] * 5, dtype=dtype)
    ref = CPU.grad_sumsq_exact([whole], None)
    assert_digits(ref, whole.double().tolist(), "whole")
    gen = torch.Generator().manual_seed(3)
    for pieces in (2, 17, 250):
        split = split_and_shuffle(whole, gen, pieces)
        for name, op in ops_under_test():
            assert torch.equal(op.grad_sumsq_exact(split, None), ref), (name, pieces)


@needs_simt
def test_simt_many_tensors_and_orders(order):
    rng = random.Random(11)
    ts = make_list(5, [rng.randrange(0, 700) for _ in range(260)] + [CHUNK + 1],
                   offsets=(0, 1, 2, 3), specials=True)
    sc = torch.tensor([1.5])
    a = check_sumsq(SIMT, ts, sc, order)
    assert torch.equal(a, CPU.grad_sumsq_exact(ts, sc))


def test_cpu_result_does_not_depend_on_the_thread_count():
    ts = make_list(9, [5 * CHUNK + 7, 3, CHUNK, 2 * CHUNK - 1], specials=True)
    before = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(CPU.grad_sumsq_exact(ts, torch.tensor([0.75])))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(r, results[0]) for r in results)
    assert_digits(results[0], r_values(ts, torch.tensor(0.75)))


def test_digits_are_normalized_and_sum_over_ranks_exactly():
    """Each digit an integer in [0, 2^24); the sum of several ranks' digit vectors (as an
    all_reduce SUM gives it, not normalized) converts to the float64 of the whole."""
    ts = make_list(21, [1000, 2000, 3000, 4000], specials=False)
    parts = [CPU.grad_sumsq_exact([t], None) for t in ts]
    for p in parts:
        assert all(0 <= d < 2**24 and d == int(d) for d in p.tolist())
    summed = torch.stack(parts).sum(0)
    whole = r_values(ts)
    for name, op in ops_under_test():
        assert float(op.exact_sumsq_to_double(summed)) == ref_double(exact_int(whole)), name


# ---------------------------------------------------------------------------------------------
# exact_sumsq_to_double on adversarial digit vectors


def adversarial_integers(rng):
    """Integers X (< 2^(24 * 25 + 53)) at the rounding edges of float64."""
    xs = [0, 1, 2**53 - 1, 2**53, 2**53 + 1, 2**54 - 1, 2**54 + 1, 2**54 + 2, 2**54 + 3,
          (1 << 600) - 1, 1 << 600]
    for _ in range(60):
        L = rng.randrange(54, 620)
        m = rng.getrandbits(53) | (1 << 52)
        shift = L - 53
        base = m << shift
        half = 1 << (shift - 1) if shift > 0 else 0
        xs += [base, base + half, base + half - 1, base + half + 1, base - 1 if base else 0]
        if shift > 30:  # a tie with one sticky bit far below
            xs.append(base + half + (1 << rng.randrange(0, shift - 25)))
    xs += [((1 << 53) - 1) << 300, (((1 << 53) - 1) << 300) + (1 << 299)]  # rounds up to 2^353
    return xs


def unnormalized(x, rng):
    """X's base-2^24 digits, then parts of each digit moved one digit down (x 2^24), keeping
    every digit an integer below 2^53: another vector with the same value."""
    ds = [int(d) for d in to_digits(x)]
    for i in range(DIGITS - 1, 0, -1):
        t = rng.randrange(0, min(ds[i], 2**28) + 1)
        if (ds[i - 1] + (t << 24)) < 2**53:
            ds[i] -= t
            ds[i - 1] += t << 24
    assert from_digits(ds) == x
    return ds


def test_conversion_rounds_correctly():
    rng = random.Random(5)
    xs = adversarial_integers(rng)
    for name, op in ops_under_test():
        for x in xs:
            expected = ref_double(x)
            for ds in (to_digits(x), unnormalized(x, rng)):
                got = float(op.exact_sumsq_to_double(digits_tensor(ds)))
                assert got == expected, (name, x, ds, got, expected)


def test_conversion_of_the_largest_digits():
    """Every digit 2^53 - 1: the largest input; finite and correctly rounded."""
    ds = [2.0**53 - 1] * DIGITS
    for name, op in ops_under_test():
        got = float(op.exact_sumsq_to_double(digits_tensor(ds)))
        assert got == ref_double(from_digits(ds)), name
    # a strided (non-contiguous) view is read by value
    t = torch.zeros(2 * DIGITS, dtype=torch.float64)[::2]
    t[12] = 2.0**10
    assert float(CPU.exact_sumsq_to_double(t)) == 1.0


@pytest.mark.parametrize("bad", [-1.0, 0.5, 2.0**53, math.nan, math.inf, -math.inf])
def test_conversion_of_digits_that_are_not_integers_in_range(bad):
    ds = digits_tensor([0.0] * DIGITS)
    ds[3] = bad
    with pytest.raises(RuntimeError, match=r"digits\[3\] is .*expected an integer in \[0, 2\^53\)"):
        CPU.exact_sumsq_to_double(ds)
    if SIMT is not None:  # a CUDA kernel cannot raise without a host sync: NaN
        assert math.isnan(float(SIMT.exact_sumsq_to_double(ds)))


# ---------------------------------------------------------------------------------------------
# misuse


def test_misuse_is_refused_with_the_bad_value():
    for name, op in ops_under_test():
        with pytest.raises(RuntimeError, match=r"tensors\[1\] has dtype Int"):
            op.grad_sumsq_exact([torch.ones(3), torch.ones(3, dtype=torch.int32)], None)
        with pytest.raises(RuntimeError, match=r"tensors\[1\] has dtype Double"):
            op.grad_sumsq_exact([torch.ones(3), torch.ones(3, dtype=torch.float64)], None)
        with pytest.raises(RuntimeError, match=r"scale must be a 1-element float32 tensor"):
            op.grad_sumsq_exact([torch.ones(3)], torch.tensor([1.0, 2.0]))
        with pytest.raises(RuntimeError, match=r"scale must be a 1-element float32 tensor"):
            op.grad_sumsq_exact([torch.ones(3)], torch.tensor(1.0, dtype=torch.float64))
        with pytest.raises(RuntimeError, match=r"tensors\[0\] must be non-overlapping and dense"):
            op.grad_sumsq_exact([torch.ones(4, 4)[:, ::2]], None)
        with pytest.raises(RuntimeError, match=r"digits must be a float64 tensor of shape \[26\]"):
            op.exact_sumsq_to_double(torch.zeros(25, dtype=torch.float64))
        with pytest.raises(RuntimeError, match=r"digits must be a float64 tensor of shape \[26\]"):
            op.exact_sumsq_to_double(torch.zeros(26, dtype=torch.float32))
        with pytest.raises(RuntimeError, match=r"digits must be a float64 tensor of shape \[26\]"):
            op.exact_sumsq_to_double(torch.zeros(2, 13, dtype=torch.float64))
    # no tensor at all: nothing says the device
    with pytest.raises(RuntimeError):
        CPU.grad_sumsq_exact([], None)


def test_inputs_are_not_written():
    ts = make_list(2, [100, 70000, 9], specials=False)
    ts[1][5], ts[1][6] = math.inf, math.nan
    before = [t.clone() for t in ts]
    versions = [t._version for t in ts]
    for _, op in ops_under_test():
        op.grad_sumsq_exact(ts, torch.tensor(0.5))
    for t, b, v in zip(ts, before, versions):
        assert torch.equal(t.view(-1).view(torch.int16 if t.element_size() == 2 else torch.int32),
                           b.view(-1).view(torch.int16 if b.element_size() == 2 else torch.int32))
        assert t._version == v


def test_opcheck():
    ts = make_list(3, [5, 70, 0], specials=False)
    torch.library.opcheck(CPU.grad_sumsq_exact, (ts, torch.tensor(0.5)))
    torch.library.opcheck(CPU.exact_sumsq_to_double, (CPU.grad_sumsq_exact(ts, None),))


CAPABILITY_CASE = (
    "import torch, math\n"
    "g = torch.Generator().manual_seed(15)\n"
    "ts = [(torch.randn(n, generator=g, dtype=torch.float64)\n"
    "       * 2.0 ** torch.randint(-60, 60, (n,), generator=g)).to(d)\n"
    "      for n, d in ((70001, torch.float16), (33, torch.bfloat16), (4097, torch.float32))]\n"
    "ts[2][7] = 1e30; ts[2][8] = 1e-44; ts[0][3] = math.inf\n"
    "r = torch.ops.tpamp.grad_sumsq_exact(ts, torch.tensor([0.37]))\n"
    "result = [r.tolist(), float(torch.ops.tpamp.exact_sumsq_to_double(r))]\n"
)


@pytest.mark.parametrize("capability", ["default", "avx2"])
def test_other_capability_modules_give_identical_digits(capability):
    """The CPU modules the CPU does not pick by itself (ATEN_CPU_CAPABILITY), in a subprocess,
    against this process's module: the sum is exact, so every bit is equal."""
    native = torch.backends.cpu.get_cpu_capability().lower()
    if capability == "avx2" and native not in ("avx2", "avx512"):
        pytest.skip(f"this CPU is {native}")
    if capability == native:
        pytest.skip("the module this process runs")
    code = (
        "from tpamp import _ext, ops\n"
        "assert ops.extension_available(), _ext.status()\n"
        "print(_ext.status()['cpu_module'])\n"
        + CAPABILITY_CASE + "print(repr(result))\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(_ext.__file__)))
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    module, printed = res.stdout.split("\n", 1)
    assert module == f"tpamp._C_cpu_{capability}"
    here = {}
    exec(CAPABILITY_CASE, here)
    assert printed.strip() == repr(here["result"])


# ---------------------------------------------------------------------------------------------
# the CUDA kernels on a GPU (pytest -m cuda; scripts/gpu_check.sh runs them)

cuda_only = pytest.mark.skipif(
    not (torch.cuda.is_available() and ops.extension_available("cuda")),
    reason="needs a CUDA GPU and tpamp._C built with CUDA")


def on_cuda(ts):
    """Copies on the GPU at the same storage offsets (misaligned stays so)."""
    out = []
    for t in ts:
        buf = torch.empty(t.numel() + t.storage_offset(), dtype=t.dtype, device="cuda")
        v = buf[t.storage_offset():].view(t.shape)
        v.copy_(t)
        out.append(v)
    return out


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("scale", [None, 0.37, 2.0**-20, 2.0**20])
@pytest.mark.parametrize("sizes", [SIZES, SIZES + (1_000_003, 4 * CHUNK)])
def test_cuda_matches_cpu_and_reference(scale, sizes):
    ts = make_list(1, sizes)
    sc = None if scale is None else torch.tensor([scale], dtype=torch.float32)
    res = TP.grad_sumsq_exact(on_cuda(ts), None if sc is None else sc.cuda())
    assert res.device.type == "cuda"
    assert torch.equal(res.cpu(), CPU.grad_sumsq_exact(ts, sc))
    x = assert_digits(res.cpu(), r_values(ts, sc))
    conv = TP.exact_sumsq_to_double(res)
    assert conv.device.type == "cuda" and float(conv) == ref_double(x)


@pytest.mark.cuda
@cuda_only
def test_cuda_any_split_and_order_and_no_host_sync():
    (whole,) = make_list(7, [3 * CHUNK + 123], dtypes=(torch.bfloat16,), offsets=(0,),
                         specials=False)
    values = whole.double().tolist()
    gen = torch.Generator().manual_seed(3)
    splits = [on_cuda(split_and_shuffle(whole, gen, p)) for p in (1, 17, 250)]
    scale = torch.tensor(0.5, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        results = [TP.grad_sumsq_exact(s, scale) for s in splits]
        convs = [TP.exact_sumsq_to_double(r) for r in results]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = CPU.grad_sumsq_exact([whole], torch.tensor(0.5))
    assert all(torch.equal(r.cpu(), ref) for r in results)
    assert len({float(c) for c in convs}) == 1
    assert float(convs[0]) == ref_double(exact_int([v * 0.5 for v in values]))
    bad = torch.zeros(DIGITS, dtype=torch.float64, device="cuda")
    bad[3] = -1.0
    assert math.isnan(float(TP.exact_sumsq_to_double(bad)))
