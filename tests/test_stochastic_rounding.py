"""bf16 params without masters, written with stochastic rounding (docs/spec.md section 21):
``master_weights=False, stochastic_rounding=True``.

Independent references: numpy (uint64/uint32 arithmetic) for the counter-based hash of the
random bits, a float64 statement of the rounding rule (the bf16 neighbours of x and the
fraction of the way between them), the fp32-master step of the same launcher for the update
(the stochastic step must equal it, rounded by the rule), an unsharded single-process run for
the DP / ZeRO-1 layouts, and the mean of many roundings against the float32 value.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from dist_utils import run_workers

import tpamp
from tpamp import ops
from tpamp import state_formats as sf

BF16 = torch.bfloat16
KERNEL = ops.extension_available("cpu")
# a tail, a block + 1, more than one chunk (65536) and one SIMD register around it
SIZES = (1, 257, 4097, 65536 + 300)
HYPER = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
             decoupled_weight_decay=True)
BF16_MAX = 3.3895313892515355e38  # bits 0x7f7f0000


# -- numpy references ----------------------------------------------------------------------

def _np_mix64(z):
    with np.errstate(over="ignore"):
        z = np.uint64(z) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _np_bits(key, step, index):
    """splitmix64 / lowbias32 as written in docs/spec.md section 21, in numpy uint arithmetic."""
    index = np.asarray(index, dtype=np.uint64)
    stream = _np_mix64(np.uint64(key) ^ _np_mix64(np.uint64(step)))
    salt = (_np_mix64(stream ^ (index >> np.uint64(32))) >> np.uint64(32)).astype(np.uint32)
    x = (index & np.uint64(0xFFFFFFFF)).astype(np.uint32) ^ salt
    with np.errstate(over="ignore"):
        x ^= x >> np.uint32(16)
        x *= np.uint32(0x7FEB352D)
        x ^= x >> np.uint32(15)
        x *= np.uint32(0x846CA68B)
        x ^= x >> np.uint32(16)
    return (x >> np.uint32(16)).astype(np.int64)


def _np_round(x, r):
    """float64 statement of the rule: |x| between its bf16 neighbours lo <= |x| < lo + ulp goes
    up with probability frac = (|x| - lo) / ulp, i.e. when r >= 2^16 (1 - frac); |x| >= the
    largest finite bf16, inf, NaN: round to nearest even (torch's own cast)."""
    x = np.asarray(x, dtype=np.float32)
    out = np.empty(x.shape, dtype=np.float64)
    for i, (v, b) in enumerate(zip(x.astype(np.float64), r)):
        if not math.isfinite(v) or abs(v) >= BF16_MAX:
            out[i] = torch.tensor(float(v), dtype=torch.float32).to(BF16).double().item()
            continue
        a = abs(v)
        if a == 0.0:
            out[i] = v
            continue
        e = max(math.floor(math.log2(a)), -126)
        if 2.0 ** (e + 1) <= a:  # log2 rounding at a binade edge
            e += 1
        ulp = 2.0 ** (e - 7)
        lo = math.floor(a / ulp) * ulp
        frac = (a - lo) / ulp
        up = b + frac * 65536 >= 65536
        out[i] = math.copysign(lo + ulp if up else lo, v)
    return out


def _specials():
    vals = [0.0, -0.0, 1.0, -1.0, 1.0 + 2**-8, 1.0 + 2**-20, -(1.0 + 2**-9 + 2**-12), 3e-39,
            -1e-40, 1e-45, 2.0**-126, BF16_MAX, -BF16_MAX, 3.39e38, 3.4e38, -3.402e38,
            float("inf"), float("-inf"), 1.9999999, 65504.0, 1e-30]
    return torch.tensor(vals, dtype=torch.float32)


def test_random_bits_match_numpy_hash():
    """stochastic_rounding_bits (the reference of the three launchers) = the numpy hash,
    including global indices across 2^32 (another salt)."""
    idx = torch.cat([torch.arange(0, 3000), torch.arange(2**32 - 700, 2**32 + 700),
                     torch.tensor([2**40 + 5, 2**62])])
    for key, step in ((0, 1), (sf.stochastic_rounding_key(1234, "layer.0.weight"), 17),
                      (2**63 - 1, 2**31 + 3)):
        got = sf.stochastic_rounding_bits(key, step, idx)
        assert torch.equal(got, torch.from_numpy(_np_bits(key, step, idx.numpy())))
        assert int(got.min()) >= 0 and int(got.max()) < 2**16
    # the 16 bits are uniform enough: every value of the top 4 bits is about as frequent
    bits = sf.stochastic_rounding_bits(7, 3, torch.arange(1 << 16))
    counts = torch.bincount(bits >> 12, minlength=16).float()
    assert float((counts / counts.mean() - 1).abs().max()) < 0.05


def test_rounding_rule_matches_float64_reference():
    gen = torch.Generator().manual_seed(3)
    x = torch.cat([_specials(), torch.randn(5000, generator=gen) * 10.0 ** torch.randint(
        -40, 38, (5000,), generator=gen).float()])
    r = torch.randint(0, 2**16, x.shape, generator=gen)
    r[:4] = torch.tensor([0, 65535, 32768, 1])
    got = sf.round_bf16_stochastic(x, r)
    assert got.dtype == BF16
    ref = _np_round(x.numpy(), r.numpy())
    g64 = got.double().numpy()
    same = (g64 == ref) | (np.isnan(g64) & np.isnan(ref))
    assert same.all(), (x[~torch.from_numpy(same)][:5], got[~torch.from_numpy(same)][:5])
    # signs of zeros kept, NaN stays NaN of its sign, overflow only where RTN overflows
    assert torch.equal(got[:2].view(torch.int16), x[:2].to(BF16).view(torch.int16))
    nan = torch.tensor([float("nan"), -float("nan")])
    out = sf.round_bf16_stochastic(nan, torch.tensor([65535, 65535]))
    assert out.isnan().all() and torch.signbit(out[1]) and not torch.signbit(out[0])
    big = torch.tensor([3.39e38, 3.3895e38, -3.3896e38])
    for rr in (0, 65535):
        o = sf.round_bf16_stochastic(big, torch.full((3,), rr))
        assert torch.equal(o.isinf(), big.to(BF16).isinf())


# -- the step on every launcher ------------------------------------------------------------

def _case(seed, m_dtype, v_dtype):
    gen = torch.Generator().manual_seed(seed)
    params, grads, ms, vs, steps, msc, vsc, rows = [], [], [], [], [], [], [], []
    for i, n in enumerate(SIZES):
        params.append(torch.randn(n, generator=gen).to(BF16))
        grads.append((torch.randn(n, generator=gen) * 1e-2).to(BF16 if i % 2 else torch.float32))
        m, a = sf.encode_moment(torch.randn(n, generator=gen) * 1e-3, m_dtype)
        v, b = sf.encode_moment(torch.rand(n, generator=gen) * 1e-5, v_dtype, sqrt=True)
        ms.append(m), vs.append(v), msc.append(a), vsc.append(b)
        steps.append(torch.tensor([4.0], dtype=torch.float64 if i % 2 else torch.float32))
        rows.append((sf.stochastic_rounding_key(seed, f"p{i}"), 1000 * i + (2**32 - 3000 if i == 3 else 0)))
    return params, grads, ms, vs, steps, msc, vsc, rows


def _clone(xs):
    return [None if t is None else t.clone() for t in xs]


def _run(op_kind, case, sr=True, simt=None):
    """One step of the case through op_kind ('kernel', 'reference', 'simt'); sr=False steps
    fp32 masters (the widened bf16 params) with the same moments: the update to round."""
    params, grads, ms, vs, steps, msc, vsc, rows = case
    p = _clone(params) if sr else [t.float() for t in params]
    m, v, st, a, b = _clone(ms), _clone(vs), _clone(steps), _clone(msc), _clone(vsc)
    any_a = any(t is not None for t in a)
    any_b = any(t is not None for t in b)
    if op_kind == "reference":
        ops._adam_step_torch(p, grads, m, v, st, None, None, None, None, HYPER["lr"],
                             HYPER["beta1"], HYPER["beta2"], HYPER["eps"],
                             HYPER["weight_decay"], True, False,
                             scale_lists=(a if any_a else [], b if any_b else []),
                             sr_rows=tuple(rows) if sr else None)
    elif op_kind == "kernel":
        ops.fused_adam_step_(p, grads, m, v, st, exp_avg_scales=a, exp_avg_sq_scales=b,
                             stochastic_rounding=rows if sr else None, **HYPER)
    else:
        empty = torch.empty(0)
        simt.fused_adam_step_(
            p, m, v, st, [], grads, None, None, None, HYPER["lr"], HYPER["beta1"],
            HYPER["beta2"], HYPER["eps"], HYPER["weight_decay"], True, False,
            [t if t is not None else empty for t in a] if any_a else [],
            [t if t is not None else empty for t in b] if any_b else [],
            torch.tensor(rows, dtype=torch.int64) if sr else None)
    return p, m, v, st


def _step_counts(case):
    return [int(s.item()) + 1 for s in case[4]]


def _check_sr_equals_rounded_update(kind, case, simt=None):
    """The stochastic step of a launcher = its fp32-master step's update rounded by the rule
    with the reference bits; moments and step counts identical. Returns the params."""
    p_sr, m_sr, v_sr, st_sr = _run(kind, case, True, simt)
    p32, m32, v32, st32 = _run(kind, case, False, simt)
    for i, (row, step) in enumerate(zip(case[7], _step_counts(case))):
        want = sf.stochastic_round_bf16(p32[i], row[0], step, row[1])
        assert torch.equal(p_sr[i].view(torch.int16), want.view(torch.int16)), (kind, i)
        assert torch.equal(m_sr[i], m32[i]) and torch.equal(v_sr[i], v32[i]), (kind, i)
        assert torch.equal(st_sr[i], st32[i])
    return p_sr, p32


MOMENTS = [(torch.float32, torch.float32), (BF16, BF16), (torch.uint8, torch.uint8)]


@pytest.mark.parametrize("m_dtype,v_dtype", MOMENTS)
def test_reference_and_kernel_round_the_fp32_update(m_dtype, v_dtype):
    case = _case(5, m_dtype, v_dtype)
    ref_p, ref32 = _check_sr_equals_rounded_update("reference", case)
    if not KERNEL:
        pytest.skip("CPU kernels not built")
    ker_p, ker32 = _check_sr_equals_rounded_update("kernel", case)
    # across implementations: bitwise wherever their fp32 updates agree (they may differ by
    # one float32 ulp: fma contraction), which is nearly everywhere
    agree = total = 0
    for a, b, a32, b32 in zip(ref_p, ker_p, ref32, ker32):
        same32 = a32 == b32
        assert torch.equal(a[same32].view(torch.int16), b[same32].view(torch.int16))
        agree += int(same32.sum())
        total += a.numel()
    assert agree >= 0.99 * total


def test_emulated_cuda_launcher_matches_cpu(monkeypatch):
    import simt_utils

    simt = simt_utils.load()
    if simt is None or not KERNEL:
        pytest.skip("SIMT module or CPU kernels not built")
    for order in simt_utils.ORDERS:
        monkeypatch.setenv("TPAMP_SIMT_ORDER", order)
        monkeypatch.setenv("TPAMP_SIMT_SEED", "20261125")
        for m_dtype, v_dtype in MOMENTS:
            case = _case(9, m_dtype, v_dtype)
            simt_p, simt32 = _check_sr_equals_rounded_update("simt", case, simt)
            cpu_p, cpu32 = _run("kernel", case)[0], _run("kernel", case, False)[0]
            for a, b, a32, b32 in zip(simt_p, cpu_p, simt32, cpu32):
                same32 = a32 == b32
                assert int(same32.sum()) >= 0.99 * a.numel()
                assert torch.equal(a[same32].view(torch.int16), b[same32].view(torch.int16))


@pytest.mark.parametrize("capability", ["default", "avx2"])
def test_other_cpu_modules_give_the_same_bits(capability):
    """The CPU modules the machine does not pick itself (ATEN_CPU_CAPABILITY): the same bits
    as the reference wherever the fp32 updates agree."""
    if not KERNEL:
        pytest.skip("CPU kernels not built")
    native = torch.backends.cpu.get_cpu_capability().lower()
    if capability == "avx2" and native not in ("avx2", "avx512"):
        pytest.skip(f"this CPU is {native}")
    code = (
        "import sys, torch\n"
        "sys.path.insert(0, 'tests')\n"
        "from tpamp import _ext\n"
        "import test_stochastic_rounding as t\n"
        "print(_ext.status()['cpu_module'])\n"
        "for md in t.MOMENTS:\n"
        "    t._check_sr_equals_rounded_update('kernel', t._case(7, *md))\n"
        "print('ok')\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True,
                         text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout.split()
    assert out[0] == f"tpamp._C_cpu_{capability}" and out[-1] == "ok", res.stdout


def test_found_inf_changes_nothing():
    if not KERNEL:
        pytest.skip("CPU kernels not built")
    params, grads, ms, vs, steps, msc, vsc, rows = _case(2, BF16, BF16)
    p, m, st = _clone(params), _clone(ms), _clone(steps)
    ops.fused_adam_step_(p, grads, m, _clone(vs), st, found_inf=torch.tensor([1.0]),
                         stochastic_rounding=rows, **HYPER)
    assert all(torch.equal(a, b) for a, b in zip(p + m + st, params + ms + steps))


# -- the wrappers -----------------------------------------------------------------------

def _model(seed=0, n=4096):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 40)).to(BF16)


def _wrap(model, lr=1e-3, **kw):
    inner = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    return tpamp.MixedPrecisionOptimizer(
        inner, param_names=list(model.named_parameters()), **kw)


SR = dict(master_weights=False, stochastic_rounding=True, stochastic_rounding_seed=1234)


def _train(model, opt, steps, seed=11, start=0):
    gen = torch.Generator().manual_seed(seed)
    for i in range(start + steps):
        grads = [(torch.randn(p.shape, generator=gen) * 1e-2).to(BF16) for p in model.parameters()]
        if i < start:
            continue
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        assert opt.step().update_successful
        opt.zero_grad()


def test_wrapper_steps_like_the_fp32_update_rounded_and_repeats():
    """A wrapper step = the fp32-master step of the same values (FP32 masters = the bf16
    params), rounded with the bits of (seed, param name, step, index); same seed -> same bits,
    another seed -> other bits; no fp32 state is kept."""
    runs = []
    for seed in (1234, 1234, 99):
        model = _model()
        opt = _wrap(model, **dict(SR, stochastic_rounding_seed=seed))
        _train(model, opt, 3)
        runs.append([p.detach().clone() for p in model.parameters()])
        n = sum(p.numel() for p in model.parameters())
        assert opt.optimizer_state_bytes() <= 8 * n + 64  # fp32 moments, no master
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))
    assert not all(torch.equal(a, b) for a, b in zip(runs[0], runs[2]))
    # one step against the fp32-master update of the same bf16 values, rounded by the rule
    model, ref_model = _model(), _model()
    opt = _wrap(model, **SR)
    inner = torch.optim.AdamW([p.detach().float().requires_grad_() for p in ref_model.parameters()],
                              lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    _train(model, opt, 1)
    gen = torch.Generator().manual_seed(11)
    for (name, _), q in zip(ref_model.named_parameters(), inner.param_groups[0]["params"]):
        q.grad = (torch.randn(q.shape, generator=gen) * 1e-2).to(BF16).float()
    inner.step()
    for (name, p), q in zip(model.named_parameters(), inner.param_groups[0]["params"]):
        want = sf.stochastic_round_bf16(q.detach(), sf.stochastic_rounding_key(1234, name), 1)
        diff = (p.view(torch.int16) != want.view(torch.int16)).float().mean()
        assert float(diff) <= 1e-3, name  # torch.optim's own fp32 arithmetic (foreach=False)


def test_unbiased_where_round_to_nearest_is_stuck():
    """Updates far below half a bf16 ulp: round-to-nearest without a master never moves the
    param; the mean of many stochastic roundings follows the fp32-master trajectory."""
    n, steps, lr = 8192, 200, 2e-4
    model = torch.nn.Linear(n, 1, bias=False).to(BF16)
    with torch.no_grad():
        model.weight.fill_(1.0)  # bf16 ulp at 1 is 2^-7: half an ulp is 20x lr
    ref = torch.nn.Linear(n, 1, bias=False)
    with torch.no_grad():
        ref.weight.fill_(1.0)
    opt = _wrap(model, lr=lr, **SR)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    rtn = np.float32(1.0)
    for _ in range(steps):
        model.weight.grad = torch.full_like(model.weight, 0.5)
        ref.weight.grad = torch.full_like(ref.weight, 0.5)
        opt.step()
        ref_opt.step()
        # round to nearest without master: 1 - lr * ~1.0 rounds back to 1.0 every step
        rtn = np.float32(torch.tensor(float(rtn) * (1 - lr * 0.1) - lr).to(BF16).item())
    target = float(ref.weight.detach().mean())
    moved = 1.0 - target
    assert moved > 0.03
    sr_err = abs(float(model.weight.detach().float().mean()) - target)
    rtn_err = abs(float(rtn) - target)
    assert rtn_err > 0.95 * moved  # stuck at 1.0
    assert sr_err < 0.02 * moved, (sr_err, moved)


def test_state_dict_resume_is_exact_and_formats_convert():
    model = _model()
    opt = _wrap(model, **SR)
    _train(model, opt, 6)
    straight = [p.detach().clone() for p in model.parameters()]
    model2 = _model()
    opt2 = _wrap(model2, **SR)
    _train(model2, opt2, 3)
    sd = opt2.state_dict()
    assert all(t.dtype == torch.float32 for g in sd["fp32_from_fp16_params"] for t in g)
    model3 = _model(seed=5)
    opt3 = _wrap(model3, **SR)
    opt3.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(model3.parameters(), model2.parameters()))
    _train(model3, opt3, 3, start=3)
    assert all(torch.equal(a, b) for a, b in zip(straight, model3.parameters()))
    # into fp32 masters, and back: the masters are the bf16 values exactly
    model4 = _model(seed=6)
    opt4 = _wrap(model4, store_param_remainders=True, exp_avg_dtype=BF16)
    opt4.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(model4.parameters(), model2.parameters()))
    sd4 = opt4.state_dict()
    model5 = _model(seed=7)
    opt5 = _wrap(model5, **SR)
    opt5.load_state_dict(sd4)
    assert all(torch.equal(a, b) for a, b in zip(model5.parameters(), model2.parameters()))


def _dist_worker(rank, world_size, steps):
    import torch.distributed as dist

    model, ref_model = _model(), _model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    dp = dist.new_group(list(range(world_size)))
    opt = tpamp.DistributedOptimizer(inner, data_parallel_group=dp, bucket_size=3000,
                                      param_names=list(model.named_parameters()), **SR)
    ref = _wrap(ref_model, **SR)  # DP 1, unsharded
    gen = torch.Generator().manual_seed(11)
    for _ in range(steps):
        grads = [(torch.randn(p.shape, generator=gen) * 1e-2).to(BF16) for p in model.parameters()]
        for p, g in zip(model.parameters(), grads):
            p.main_grad.copy_(g)  # the same grad on every rank: its DP mean is g exactly
        for p, g in zip(ref_model.parameters(), grads):
            p.grad = g.clone()
        assert opt.step().update_successful
        ref.step()
        opt.zero_grad()
    same = all(torch.equal(p.view(torch.int16), q.view(torch.int16))
               for p, q in zip(model.parameters(), ref_model.parameters()))
    n = sum(p.numel() for p in model.parameters())
    per_param = opt.optimizer_state_bytes() / n
    sd = opt.state_dict()
    before = [p.detach().clone() for p in model.parameters()]
    opt.load_state_dict(sd)
    reload_same = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return same, per_param, reload_same


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_zero1_layouts_agree_bitwise_with_dp1(world_size):
    if not KERNEL:
        pytest.skip("CPU kernels not built")
    for same, per_param, reload_same in run_workers(_dist_worker, world_size, 4, timeout=60):
        assert same
        assert per_param <= 8 / world_size + 0.2, per_param  # fp32 moments only, no master
        assert reload_same


@pytest.mark.parametrize("kw,exc,match", [
    (dict(stochastic_rounding=True), ValueError, "master_weights=False"),
    (dict(master_weights=False), ValueError, "needs stochastic_rounding=True"),
    (dict(master_weights=False, stochastic_rounding=True, store_param_remainders=True),
     ValueError, "store_param_remainders"),
    (dict(stochastic_rounding=1, master_weights=False), TypeError, "must be a bool"),
    (dict(master_weights=0), TypeError, "must be a bool"),
    (dict(stochastic_rounding_seed=3), ValueError, "stochastic rounding, which is off"),
    (dict(SR, stochastic_rounding_seed=-1), ValueError, r"\[0, 2\^63\)"),
    (dict(SR, stochastic_rounding_seed=1.5), TypeError, "must be an int"),
    (dict(SR, fused_step=False), ValueError, "one-pass fused Adam"),
])
def test_refusals(kw, exc, match):
    model = _model()
    with pytest.raises(exc, match=match):
        _wrap(model, **kw)


def test_refusals_of_params_and_optimizers():
    fp16 = torch.nn.Linear(4, 4).half()
    with pytest.raises(ValueError, match="float16"):
        tpamp.MixedPrecisionOptimizer(torch.optim.AdamW(fp16.parameters()),
                                      grad_scaler=tpamp.ConstantGradScaler(4.0), **SR)
    fp32 = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="no trainable bf16 param"):
        tpamp.MixedPrecisionOptimizer(torch.optim.AdamW(fp32.parameters()), **SR)
    bf = torch.nn.Linear(4, 4).to(BF16)
    with pytest.raises(ValueError, match="one-pass fused Adam"):
        tpamp.MixedPrecisionOptimizer(torch.optim.SGD(bf.parameters(), lr=0.1), **SR)
    with pytest.raises(ValueError, match="amsgrad"):
        tpamp.MixedPrecisionOptimizer(torch.optim.Adam(bf.parameters(), amsgrad=True), **SR)
    with pytest.raises(ValueError, match="drop below 1"):
        tpamp.MixedPrecisionOptimizer(torch.optim.Adam(bf.parameters()),
                                      grad_scaler=tpamp.DynamicGradScaler(
                                          initial_scale=4.0, min_scale=0.5), **SR)
    # a step that would take the generic path (a step hook) raises before changing anything
    opt = tpamp.MixedPrecisionOptimizer(torch.optim.Adam(bf.parameters()), **SR)
    opt.optimizer.register_step_pre_hook(lambda *a: None)
    for p in bf.parameters():
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in bf.parameters()]
    with pytest.raises(RuntimeError, match="master_weights=False"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, bf.parameters()))


def test_op_refuses_bad_stochastic_rounding_arguments():
    p = [torch.zeros(5, dtype=BF16)]
    g = [torch.zeros(5)]
    m, v, s = [torch.zeros(5)], [torch.zeros(5)], [torch.zeros(1)]
    with pytest.raises(TypeError, match="needs stochastic_rounding"):
        ops.fused_adam_step_(p, g, m, v, s, **HYPER)
    with pytest.raises(ValueError, match="0 <= key < 2\\^63"):
        ops.fused_adam_step_(p, g, m, v, s, stochastic_rounding=[(-1, 0)], **HYPER)
    with pytest.raises(TypeError, match="pair of ints"):
        ops.fused_adam_step_(p, g, m, v, s, stochastic_rounding=[(1.0, 0)], **HYPER)
    with pytest.raises(ValueError, match="own model params"):
        ops.fused_adam_step_(p, g, m, v, s, model_params=[torch.zeros(5, dtype=BF16)],
                             stochastic_rounding=[(1, 0)], **HYPER)
    if KERNEL:
        with pytest.raises(RuntimeError, match="stochastic_rounding must be a contiguous int64"):
            torch.ops.tpamp.fused_adam_step_(p, m, v, s, [], g, None, None, None, 1e-3, 0.9,
                                             0.99, 1e-8, 0.0, True, False, [], [],
                                             torch.zeros(1, 3, dtype=torch.int64))


@pytest.mark.parametrize("dst", [dict(SR), dict(), dict(SR, exp_avg_dtype=BF16,
                                                       exp_avg_sq_dtype=BF16)])
def test_dcp_checkpoint_saves_the_bf16_values_and_resumes_exactly(tmp_path, dst):
    """tpamp.checkpoint (torch.distributed.checkpoint): the saved masters are the bf16 values;
    a stochastic-rounding run resumed from it continues bit for bit; other configurations
    load the same values exactly."""
    from tpamp.checkpoint import load_checkpoint, save_checkpoint

    straight = _model()
    opt = _wrap(straight, **SR)
    _train(straight, opt, 5)
    ms, md = _model(), _model(seed=3)
    a = _wrap(ms, **SR)
    _train(ms, a, 3)
    save_checkpoint(str(tmp_path), dict(ms.named_parameters()), a)
    b = _wrap(md, **dst)
    load_checkpoint(str(tmp_path), dict(md.named_parameters()), b)
    for x, y in zip(a.state_dict()["fp32_from_fp16_params"][0],
                    b.state_dict()["fp32_from_fp16_params"][0]):
        assert torch.equal(x, y)
    assert all(torch.equal(p, q) for p, q in zip(ms.parameters(), md.parameters()))
    if dst == SR:
        _train(md, b, 2, start=3)
        assert all(torch.equal(p, q) for p, q in zip(straight.parameters(), md.parameters()))


def _dcp_worker(rank, world_size, path):
    import torch.distributed as dist

    from tpamp.checkpoint import load_checkpoint, save_checkpoint

    dp = dist.new_group(list(range(world_size)))

    def build(seed):
        model = _model(seed)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95),
                                  weight_decay=0.1)
        return model, tpamp.DistributedOptimizer(
            inner, data_parallel_group=dp, bucket_size=3000,
            param_names=list(model.named_parameters()), **SR)

    def train(model, opt, steps, start=0):
        gen = torch.Generator().manual_seed(11)
        for i in range(start + steps):
            grads = [(torch.randn(p.shape, generator=gen) * 1e-2).to(BF16)
                     for p in model.parameters()]
            if i < start:
                continue
            for p, g in zip(model.parameters(), grads):
                p.main_grad.copy_(g)
            assert opt.step().update_successful
            opt.zero_grad()

    straight, opt_a = build(0)
    train(straight, opt_a, 5)
    saved, opt_b = build(0)
    train(saved, opt_b, 3)
    save_checkpoint(path, dict(saved.named_parameters()), opt_b)
    resumed, opt_c = build(3)
    load_checkpoint(path, dict(resumed.named_parameters()), opt_c)
    loaded = all(torch.equal(p, q) for p, q in zip(saved.parameters(), resumed.parameters()))
    train(resumed, opt_c, 2, start=3)
    return loaded, all(torch.equal(p, q) for p, q in zip(straight.parameters(),
                                                          resumed.parameters()))


def test_zero1_dcp_checkpoint_resumes_exactly(tmp_path):
    if not KERNEL:
        pytest.skip("CPU kernels not built")
    for loaded, resumed in run_workers(_dcp_worker, 2, str(tmp_path), timeout=60):
        assert loaded and resumed


def _settings_worker(rank, world_size):
    import torch.distributed as dist

    model = _model()
    group = dist.new_group(list(range(world_size)))
    opt = _wrap(model, grad_stats_group=group, **dict(SR, stochastic_rounding_seed=7 + rank))
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-2)
    try:
        opt.step()
    except ValueError as e:
        return str(e)
    return None


def test_ranks_with_different_seeds_refuse_the_first_step():
    """DP ranks must round alike: the settings check of the first step names the seed."""
    for msg in run_workers(_settings_worker, 2, timeout=30):
        assert msg is not None and "stochastic_rounding_seed" in msg, msg


@pytest.mark.parametrize("m_dtype", [torch.float32, BF16])
def test_opcheck_fused_adam_step_with_stochastic_rounding(m_dtype):
    """torch.library.opcheck on the op's stochastic-rounding path: the schema marks the bf16
    params (stepped in place), the moments and the step counts as written, and the fake impl
    accepts the trailing int64 [n, 2] tensor of (key, first index) rows."""
    if not KERNEL:
        pytest.skip("CPU kernels not built")
    gen = torch.Generator().manual_seed(21)
    sizes = (5, 300, 0)
    params = [torch.randn(n, generator=gen).to(BF16) for n in sizes]
    grads = [(torch.randn(n, generator=gen) * 1e-2).to(BF16) for n in sizes]
    ms = [(torch.randn(n, generator=gen) * 1e-3).to(m_dtype) for n in sizes]
    vs = [(torch.rand(n, generator=gen) * 1e-6).to(m_dtype) for n in sizes]
    rows = torch.tensor([(sf.stochastic_rounding_key(3, f"p{i}"), 17 * i)
                         for i in range(len(sizes))], dtype=torch.int64)
    args = (params, ms, vs, [torch.tensor(3.0) for _ in sizes], [], grads, torch.tensor([0.5]),
            torch.zeros(1), None, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, False, [], [], rows)
    torch.library.opcheck(torch.ops.tpamp.fused_adam_step_, args)
