"""Narrow Adam state (docs/spec.md section 9): bf16 / 8-bit moments and bf16 params + int16 remainders in the
one-pass step, on tpamp.ops.fused_adam_step_ and both optimizer wrappers.

References, independent of the code under test:
* the formats, written here with numpy bit operations (round to nearest even for bf16, the
  remainder split/join) and torch's own float32 -> float8_e4m3fn conversion (c10's, not ours);
* the fp32-state step (tpamp's kernel with float32 state, itself checked against torch.optim in
  test_fused_step.py) on the decoded state: a narrow step must equal it bit for bit, then
  stored in the narrow format;
* for remainders, the fp32-master step over hundreds of steps: the rebuilt master (numpy) must
  equal its master bit for bit at every step.
"""

from __future__ import annotations

import copy
import io

import numpy as np
import pytest
import torch
from dist_utils import freeze, fused_step_built, run_workers, tensor_bytes
from dist_utils import fused_step_built as _kernel_built
from misuse_utils import refused_construction

import tpamp
from tpamp import ops, state_formats

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
             decoupled_weight_decay=True)
SIZES = [1, 31, 256, 257, 1000, 65536 + 300]  # tails, a block, a block + 1, > one chunk




# -- independent format references (numpy) ---------------------------------------------------

def _np_bits(x: torch.Tensor) -> np.ndarray:
    return x.detach().float().contiguous().numpy().view(np.uint32).reshape(-1)


def _np_bf16_rne(x: torch.Tensor) -> np.ndarray:
    """float32 -> bf16 bits as documented in csrc/kernels/optimizer_step.h: round to nearest
    even; a NaN keeps its sign and high mantissa bits and is made quiet (| 0x0040)."""
    u = _np_bits(x).astype(np.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, (u >> 16) | 0x0040, (u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _assert_moment_bits(got: np.ndarray, want: np.ndarray, stored: torch.Tensor,
                        grad: torch.Tensor, where: int) -> None:
    """got == want bit for bit (uint16 bf16 or uint32 float32 bits), except in the lanes where
    both the stored moment and the grad are NaN. A sum of two NaNs carries one of their
    payloads, and IEEE 754 leaves open which: x86 takes the first operand's, and the compiler
    orders the operands (the DEFAULT module built against torch 2.15's headers ordered them
    otherwise than the fp32-state path). There got must be a NaN with the quieted bits of one of
    the two inputs, never a new or a finite value."""
    narrow = got.dtype == np.uint16
    s = stored.contiguous().view(torch.int16 if narrow else torch.int32).numpy().reshape(-1)
    s = s.view(np.uint16 if narrow else np.uint32)
    quiet = np.uint16(0x0040) if narrow else np.uint32(0x00400000)
    g32 = _np_bits(grad)
    g = ((g32 >> 16).astype(np.uint16) if narrow else g32) | quiet
    both = stored.float().isnan().numpy().reshape(-1) & grad.float().isnan().numpy().reshape(-1)
    assert np.array_equal(got[~both], want[~both]), where
    assert np.all((got[both] == (s[both] | quiet)) | (got[both] == g[both])), where


def _np_join(param_bf16: torch.Tensor, rem: torch.Tensor) -> np.ndarray:
    hi = param_bf16.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1)
    lo = rem.contiguous().numpy().reshape(-1).astype(np.int64)
    return ((hi.astype(np.int64) << 16) + lo).astype(np.uint64).astype(np.uint32) & 0xFFFFFFFF


def _np_half_away(master: torch.Tensor) -> np.ndarray:
    """bf16 bits of the master rounded to nearest, ties away from zero (in bit space)."""
    return ((_np_bits(master).astype(np.uint64) + 0x8000) >> 16).astype(np.uint16)


def _ref_fp8(x: torch.Tensor, sqrt: bool):
    """(codes as uint8, scales) by the documented rule, with torch's e4m3fn conversion."""
    flat = x.detach().double().reshape(-1)
    if sqrt:  # float64 sqrt rounded once to float32: the correctly rounded float32 sqrt
        flat = flat.sqrt()
    flat = flat.float()
    codes, scales = [], []
    for b in range(0, flat.numel(), 256):
        blk = flat[b:b + 256]
        amax = float(blk.abs().max())
        if amax == 0.0:
            scales.append(0.0)
            codes.append(torch.zeros(blk.numel(), dtype=torch.uint8))
            continue
        if amax == float("inf"):  # saturated block: FLT_MAX / 448; inf -> +-448 (code 0x7e)
            fmax = torch.tensor(torch.finfo(torch.float32).max, dtype=torch.float32)
            scales.append(float(fmax / 448.0))
            finite = (blk * (torch.tensor(448.0, dtype=torch.float32) / fmax)).to(
                torch.float8_e4m3fn).view(torch.uint8)
            sat = torch.where(blk > 0, 0x7E, 0xFE).to(torch.uint8)
            codes.append(torch.where(blk.isinf(), sat, finite))
            continue
        a32 = torch.tensor(amax, dtype=torch.float32)
        scales.append(float(a32 / 448.0))
        inv = torch.tensor(448.0, dtype=torch.float32) / a32
        codes.append((blk * inv).to(torch.float8_e4m3fn).view(torch.uint8))
    return torch.cat(codes), torch.tensor(scales, dtype=torch.float32)


def test_format_helpers_match_independent_references():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=gen) * torch.logspace(-6, 2, 1000)
    x[::97] = 0.0
    # bf16: round to nearest even
    assert np.array_equal(ops.encode_moment(x, torch.bfloat16)[0].view(torch.int16).numpy()
                          .view(np.uint16), _np_bf16_rne(x))
    # remainders: exact, param = ties away from zero
    hi, lo = ops.split_remainders(x)
    assert np.array_equal(_np_join(hi, lo), _np_bits(x))
    assert np.array_equal(ops.join_remainders(hi, lo).numpy().view(np.uint32), _np_bits(x))
    assert np.array_equal(hi.view(torch.int16).numpy().view(np.uint16), _np_half_away(x))
    # a tie: low half exactly 0x8000 with an even high half goes up, RNE would stay
    tie = torch.tensor([0x3F808000], dtype=torch.int32).view(torch.float32)
    assert ops.split_remainders(tie)[0].view(torch.int16).item() == 0x3F81
    assert tie.to(torch.bfloat16).view(torch.int16).item() == 0x3F80
    # 8-bit, blockwise, sqrt for exp_avg_sq
    for sq in (False, True):
        y = x.abs() if sq else x
        codes, scales = ops.encode_moment(y, torch.float8_e4m3fn, sqrt=sq)
        rc, rs = _ref_fp8(y, sq)
        assert torch.equal(codes.view(torch.uint8), rc)
        assert torch.equal(scales, rs)
        back = ops.decode_moment(codes, scales, sqrt=sq)
        expect = (rc.view(torch.float8_e4m3fn).float()
                  * torch.repeat_interleave(rs, 256)[:1000])
        expect = expect * expect if sq else expect
        assert torch.equal(back, expect)
        # the error bound of e4m3 (3 mantissa bits: half an ulp is 2^-4 relative; subnormal
        # codes: 2^-10 of a code unit) of each value of the quantized quantity r (sqrt for v)
        r = y.sqrt() if sq else y
        rmax = torch.repeat_interleave(r.reshape(-1).abs().reshape(-1)[:1000].new_tensor(
            [float(r[b:b + 256].abs().max()) for b in range(0, 1000, 256)]), 256)[:1000]
        dr = r.abs() * 2.0 ** -4 + rmax / 448.0 * 2.0 ** -10
        tol = (2 * r.abs() * dr + dr * dr) if sq else dr
        assert bool(((back - y).abs() <= tol * 1.001 + 1e-30).all())


def _param_and_model(master: torch.Tensor, remainders: bool):
    """(the tensor the kernel steps, the bf16 model param) for a float32 master: int16
    remainder + bf16 param, or the master itself + its bf16 copy."""
    if remainders:
        hi, lo = ops.split_remainders(master)
        return lo, hi
    return master, master.to(torch.bfloat16)


def _masters(params, models, remainders: bool):
    """Independent float32 copies of the masters the kernel steps (rebuilt from remainders)."""
    return [ops.join_remainders(m, p) if remainders else p.clone()
            for p, m in zip(params, models)]


# -- the op: narrow state == fp32 state on the decoded values, then stored -------------------

def _state(n, gen, m_dtype, v_dtype):
    m = torch.randn(n, generator=gen) * 1e-3
    v = torch.rand(n, generator=gen) * 1e-6
    sm, ms = ops.encode_moment(m, m_dtype)
    sv, vs = ops.encode_moment(v, v_dtype, sqrt=True)
    return sm, ms, sv, vs


@pytest.mark.parametrize("m_dtype,v_dtype", [
    (torch.bfloat16, torch.bfloat16), (torch.float8_e4m3fn, torch.float8_e4m3fn),
    (torch.bfloat16, torch.float8_e4m3fn), (torch.float32, torch.bfloat16),
])
@pytest.mark.parametrize("remainders", [False, True])
def test_narrow_step_equals_fp32_step_on_decoded_state(m_dtype, v_dtype, remainders):
    if not _kernel_built():
        pytest.skip("tpamp._C with the fused step kernels is not built")
    gen = torch.Generator().manual_seed(1)
    params, models, grads, ms, vs, mscale, vscale, steps = [], [], [], [], [], [], [], []
    for n in SIZES:
        master = torch.randn(n, generator=gen)
        grads.append(torch.randn(n, generator=gen).to(torch.bfloat16))
        sm, a, sv, b = _state(n, gen, m_dtype, v_dtype)
        ms.append(sm), vs.append(sv), mscale.append(a), vscale.append(b)
        steps.append(torch.tensor(4.0))
        param, model = _param_and_model(master, remainders)
        params.append(param), models.append(model)
    # the reference: fp32 state decoded (exactly) from the narrow one, tpamp's fp32-state step
    ref_p = _masters(params, models, remainders)
    ref_m = [ops.decode_moment(m, s) for m, s in zip(ms, mscale)]
    ref_v = [ops.decode_moment(v, s, sqrt=True) for v, s in zip(vs, vscale)]
    ref_models = [m.clone() for m in models]
    ref_steps = [s.clone() for s in steps]
    scale = torch.tensor([0.5])
    ops.fused_adam_step_(ref_p, grads, ref_m, ref_v, ref_steps, model_params=ref_models,
                         grad_scale=scale, **HYPER)
    ops.fused_adam_step_(params, grads, ms, vs, steps, model_params=models, grad_scale=scale,
                         exp_avg_scales=mscale, exp_avg_sq_scales=vscale, **HYPER)
    for i in range(len(SIZES)):
        if remainders:
            assert np.array_equal(_np_join(models[i], params[i]), _np_bits(ref_p[i])), i
            assert np.array_equal(models[i].view(torch.int16).numpy().view(np.uint16),
                                  _np_half_away(ref_p[i])), i
        else:
            assert torch.equal(params[i], ref_p[i]), i
            assert torch.equal(models[i], ref_models[i]), i
        for stored, sc, ref, sq in ((ms[i], mscale[i], ref_m[i], False),
                                    (vs[i], vscale[i], ref_v[i], True)):
            if stored.dtype == torch.float32:
                assert torch.equal(stored, ref), i
            elif stored.dtype == torch.bfloat16:
                assert np.array_equal(stored.view(torch.int16).numpy().view(np.uint16),
                                      _np_bf16_rne(ref)), i
            else:
                rc, rs = _ref_fp8(ref, sq)
                assert torch.equal(stored.view(torch.uint8), rc), i
                assert torch.equal(sc, rs), i
        assert float(steps[i]) == 5.0


@pytest.mark.parametrize("m_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("remainders", [False, True])
def test_bf16_moments_keep_the_format_for_nan_and_inf(m_dtype, remainders):
    """Grads with NaN and +-inf (no found_inf: the step runs) in vectors that also hold finite
    lanes, in tails and in whole vectors, and stored moments that are NaNs with payloads: the bf16
    moments hold exactly the documented bits of the fp32-state step's values (a NaN's sign and
    payload too, whatever the CPU capability; where the stored moment and the grad are both NaN,
    either one's: _assert_moment_bits), finite lanes beside them are untouched."""
    if not _kernel_built():
        pytest.skip("tpamp._C with the fused step kernels is not built")
    gen = torch.Generator().manual_seed(5)
    params, models, grads, ms, vs, steps = [], [], [], [], [], []
    for n in SIZES:
        master = torch.randn(n, generator=gen)
        g = torch.randn(n, generator=gen)
        bad = torch.randperm(n, generator=gen)[: max(1, n // 50)]
        g[bad] = torch.tensor([float("nan"), float("inf"), -float("inf"), -float("nan")]).repeat(
            bad.numel())[: bad.numel()]
        if n >= 64:
            g[32:48] = float("nan")  # a whole vector (AVX2: 16 lanes) of NaN
        grads.append(g.to(torch.bfloat16))
        m = (torch.randn(n, generator=gen) * 1e-3).to(m_dtype)
        v = (torch.rand(n, generator=gen) * 1e-6).to(torch.bfloat16)
        # stored NaNs with payloads and signs (torch's own conversion writes 0xffff for every
        # NaN; the documented format keeps sign and payload): quiet, signalling, negative
        at = torch.randperm(n, generator=gen)[: max(1, n // 40)]
        nan16 = torch.tensor([0x7FC1, 0x7F81, -0x0060], dtype=torch.int16)  # -0x60 = 0xffa0
        v.view(torch.int16)[at] = nan16.repeat(at.numel())[: at.numel()]
        if m_dtype == torch.bfloat16:
            m.view(torch.int16)[at.flip(0)] = nan16.repeat(at.numel())[: at.numel()]
        else:
            m.view(torch.int32)[at.flip(0)] = 0x7FC12345
        ms.append(m), vs.append(v), steps.append(torch.tensor(2.0))
        param, model = _param_and_model(master, remainders)
        params.append(param), models.append(model)
    ref_p = _masters(params, models, remainders)
    ref_m = [m.float().clone() for m in ms]  # .float() of a float32 tensor is the tensor
    ref_v = [v.float() for v in vs]
    ms_in, vs_in = [m.clone() for m in ms], [v.clone() for v in vs]
    ref_models = [m.clone() for m in models]
    ops.fused_adam_step_(ref_p, grads, ref_m, ref_v, [s.clone() for s in steps],
                         model_params=ref_models, **HYPER)
    ops.fused_adam_step_(params, grads, ms, vs, steps, model_params=models, **HYPER)
    for i in range(len(SIZES)):
        assert bool(ref_v[i].isnan().any()), i  # the case is exercised
        if remainders:
            assert np.array_equal(_np_join(models[i], params[i]), _np_bits(ref_p[i])), i
        else:
            assert np.array_equal(_np_bits(params[i]), _np_bits(ref_p[i])), i
        if m_dtype == torch.bfloat16:
            _assert_moment_bits(ms[i].view(torch.int16).numpy().view(np.uint16),
                                _np_bf16_rne(ref_m[i]), ms_in[i], grads[i], i)
        else:
            _assert_moment_bits(_np_bits(ms[i]), _np_bits(ref_m[i]), ms_in[i], grads[i], i)
        _assert_moment_bits(vs[i].view(torch.int16).numpy().view(np.uint16),
                            _np_bf16_rne(ref_v[i]), vs_in[i], grads[i], i)


def test_remainders_bit_identical_to_fp32_masters_over_hundreds_of_steps():
    """300 steps, fresh random grads each step (the same for both runs): the master rebuilt
    from param + remainder equals the fp32-master run's master bit for bit at every step, and
    the bf16 params differ from it only at exact ties (low half 0x8000), by one ulp."""
    if not _kernel_built():
        pytest.skip("tpamp._C with the fused step kernels is not built")
    gen = torch.Generator().manual_seed(2)
    sizes = [3, 257, 70000]
    masters = [torch.randn(n, generator=gen) * 0.02 for n in sizes]
    models_a = [m.to(torch.bfloat16) for m in masters]
    split = [ops.split_remainders(m) for m in masters]
    models_b = [h for h, _ in split]
    rems = [low for _, low in split]
    state_a = [(torch.zeros(n), torch.zeros(n), torch.tensor(0.0)) for n in sizes]
    state_b = [(torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16),
                torch.tensor(0.0)) for n in sizes]
    state_a2 = [(torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16),
                 torch.tensor(0.0)) for n in sizes]
    masters_a2 = [m.clone() for m in masters]
    models_a2 = [m.to(torch.bfloat16) for m in masters]
    ties = 0
    for step in range(300):
        grads = [(torch.randn(n, generator=gen) * 1e-2).to(torch.bfloat16) for n in sizes]
        ops.fused_adam_step_(masters, grads, [s[0] for s in state_a], [s[1] for s in state_a],
                             [s[2] for s in state_a], model_params=models_a, **HYPER)
        # bf16 moments with fp32 masters vs bf16 moments with remainders: bit-identical
        ops.fused_adam_step_(masters_a2, grads, [s[0] for s in state_a2],
                             [s[1] for s in state_a2], [s[2] for s in state_a2],
                             model_params=models_a2, **HYPER)
        ops.fused_adam_step_(rems, grads, [s[0] for s in state_b], [s[1] for s in state_b],
                             [s[2] for s in state_b], model_params=models_b, **HYPER)
        for i in range(len(sizes)):
            assert np.array_equal(_np_join(models_b[i], rems[i]), _np_bits(masters_a2[i])), \
                (step, i)
            for k in (0, 1):
                assert torch.equal(state_b[i][k], state_a2[i][k]), (step, i, k)
            hb = models_b[i].view(torch.int16).numpy().view(np.uint16)
            assert np.array_equal(hb, _np_half_away(masters_a2[i])), (step, i)
            ha = models_a2[i].view(torch.int16).numpy().view(np.uint16)
            diff = ha != hb
            low = _np_bits(masters_a2[i]) & 0xFFFF
            assert np.all(low[diff] == 0x8000), (step, i)
            ties += int(diff.sum())
    # the fp32-state run is the same algorithm: its masters stay close to the bf16-moment run's
    for a, b in zip(masters, masters_a2):
        assert torch.allclose(a, b, rtol=0, atol=2e-3)


BF16_MAX = float(torch.finfo(torch.bfloat16).max)  # 3.3895e38


def _overflow_case(n=1000):
    """8-bit moments of n elements and a bf16 grad with one element 1e30 in block 0 and one
    the largest finite bf16 in block 2 (their squares overflow float32; all else small)."""
    gen = torch.Generator().manual_seed(21)
    master = torch.randn(n, generator=gen)
    grad = (torch.randn(n, generator=gen) * 1e-2)
    grad[5] = 1e30
    grad[2 * 256 + 9] = -BF16_MAX
    grad = grad.to(torch.bfloat16)
    sm, ms, sv, vs = _state(n, gen, torch.float8_e4m3fn, torch.float8_e4m3fn)
    return master, grad, sm, ms, sv, vs


@pytest.mark.parametrize("remainders", [False, True])
def test_8bit_moments_stay_finite_when_a_grad_square_overflows(path, remainders):
    """A finite bf16 grad element whose square overflows float32 (1e30; the largest finite
    bf16) makes its exp_avg_sq inf in float32 (the fp32-state step's value: that element's
    update is 0). The 8-bit block saturates (scale FLT_MAX / 448, the inf element code 448)
    instead of writing a NaN scale, so over several steps every param and every scale stays
    finite, and each step equals the fp32-state step on the decoded state, stored by the
    documented rule (``_ref_fp8``)."""
    master, grad, sm, ms, sv, vs = _overflow_case()
    param, model = _param_and_model(master, remainders)
    step = torch.tensor(0.0)
    fmax = torch.tensor(torch.finfo(torch.float32).max)
    for k in range(4):
        ref_p = _masters([param], [model], remainders)
        ref_m = [ops.decode_moment(sm, ms)]
        ref_v = [ops.decode_moment(sv, vs, sqrt=True)]
        ref_step = [step.clone()]
        # the reference: the fp32-state step (same path) on the decoded state
        ops.fused_adam_step_(ref_p, [grad], ref_m, ref_v, ref_step, **HYPER)
        ops.fused_adam_step_([param], [grad], [sm], [sv], [step],
                             model_params=[model] if remainders else None,
                             exp_avg_scales=[ms], exp_avg_sq_scales=[vs], **HYPER)
        got = ops.join_remainders(model, param) if remainders else param
        assert bool(got.isfinite().all()), k
        assert torch.equal(got, ref_p[0]), k
        assert bool(ms.isfinite().all()) and bool(vs.isfinite().all()), (k, ms, vs)
        rc, rs = _ref_fp8(ref_v[0], True)
        assert torch.equal(sv.view(torch.uint8), rc), k
        assert torch.equal(vs, rs), k
        rc, rs = _ref_fp8(ref_m[0], False)
        assert torch.equal(sm.view(torch.uint8), rc), k
        assert torch.equal(ms, rs), k
        # the overflowing elements' blocks saturate; the others do not
        assert float(vs[0]) == float(fmax / 448.0) and float(vs[2]) == float(fmax / 448.0)
        assert float(vs[1]) < 1.0 and float(vs[3]) < 1.0
        # and read back as the fp32 state holds them: inf exp_avg_sq
        back = ops.decode_moment(sv, vs, sqrt=True)
        assert float(back[5]) == float("inf") and float(back[2 * 256 + 9]) == float("inf")
    from tpamp import state_formats

    assert state_formats.SATURATED_SCALE == float(fmax / 448.0)


def test_encode_moment_saturates_inf_and_keeps_nan():
    """encode_moment (the kernels' reference): an inf block saturates (finite scale, +-448),
    a NaN block keeps a NaN scale (a NaN cannot come from a finite grad), zeros scale 0."""
    x = torch.zeros(3 * 256)
    x[0], x[1], x[2] = float("inf"), float("-inf"), 1e30
    x[256] = float("nan")
    codes, scales = ops.encode_moment(x, torch.float8_e4m3fn)
    fmax = torch.tensor(torch.finfo(torch.float32).max)
    assert float(scales[0]) == float(fmax / 448.0)
    assert codes.view(torch.uint8)[:3].tolist() == [0x7E, 0xFE, 0x00]  # 1e30 / 7.6e35 -> 0
    assert bool(scales[1].isnan()) and float(scales[2]) == 0.0
    rc, rs = _ref_fp8(torch.cat([x[:256], x[512:]]), False)
    assert torch.equal(codes.view(torch.uint8)[:256], rc[:256])


def test_op_rejects_bad_narrow_state(path):
    p = torch.zeros(300)
    g = torch.zeros(300)
    step = [torch.tensor(0.0)]
    m8 = torch.zeros(300, dtype=torch.float8_e4m3fn)
    with pytest.raises((ValueError, RuntimeError), match="scale"):
        ops.fused_adam_step_([p], [g], [m8], [torch.zeros(300)], step, **HYPER)
    with pytest.raises((ValueError, RuntimeError), match="2 elements|elements"):
        ops.fused_adam_step_([p], [g], [m8], [torch.zeros(300)], step,
                             exp_avg_scales=[torch.zeros(1)], **HYPER)
    with pytest.raises((TypeError, RuntimeError), match="bfloat16"):
        ops.fused_adam_step_([torch.zeros(300, dtype=torch.int16)], [g], [torch.zeros(300)],
                             [torch.zeros(300)], step,
                             model_params=[torch.zeros(300, dtype=torch.float16)], **HYPER)
    with pytest.raises((TypeError, RuntimeError), match="dtype"):
        ops.fused_adam_step_([p], [g], [torch.zeros(300, dtype=torch.float16)],
                             [torch.zeros(300)], step, **HYPER)


def test_reference_path_matches_kernel_on_narrow_state():
    """The PyTorch reference (no extension) and the kernel agree on narrow state: bf16 and
    remainders to float32 rounding of the update (torch.lerp vs fma), 8-bit codes within one
    code step."""
    if not _kernel_built():
        pytest.skip("tpamp._C with the fused step kernels is not built")
    gen = torch.Generator().manual_seed(3)
    n = 1000
    master = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen).to(torch.bfloat16)]
    runs = []
    for force in (False, True):
        hi, lo = ops.split_remainders(master)
        sm, a, sv, b = _state(n, torch.Generator().manual_seed(4), torch.float8_e4m3fn,
                              torch.bfloat16)
        with ops.force_fallback(force):
            ops.fused_adam_step_([lo], grads, [sm], [sv], [torch.tensor(1.0)], model_params=[hi],
                                 exp_avg_scales=[a], exp_avg_sq_scales=[None], **HYPER)
        runs.append((ops.join_remainders(hi, lo), ops.decode_moment(sm, a), sv.float()))
    (p0, m0, v0), (p1, m1, v1) = runs
    torch.testing.assert_close(p0, p1, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(v0, v1, rtol=8e-3, atol=0)
    torch.testing.assert_close(m0, m1, rtol=0.07, atol=float(m0.abs().max()) * 2 ** -9)


# -- the module's place, the generic-path refusal and the DTensor wrapping -------------------

def _imported_modules(module) -> set:
    """Every module name ``module``'s source imports (``from tpamp import x`` as tpamp.x),
    at any depth (inside functions too), read from the file with ast."""
    import ast
    import pathlib

    names = set()
    for node in ast.walk(ast.parse(pathlib.Path(module.__file__).read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            if node.module == "tpamp":
                names |= {"tpamp." + a.name for a in node.names}
    return names


def test_state_formats_imports_no_tpamp_module_but_common():
    """tpamp.ops imports the formats, never the reverse: the formats module reads torch,
    tpamp.common and the generated data of its dynamic maps only."""
    from tpamp import state_formats

    tpamp_names = {n for n in _imported_modules(state_formats) if n.split(".")[0] == "tpamp"}
    assert tpamp_names == {"tpamp.common", "tpamp._dynamic_map_table"}
    assert "tpamp.state_formats" in _imported_modules(ops)


def test_refuse_generic_step_names_the_options():
    from types import SimpleNamespace

    from tpamp import state_formats

    default = SimpleNamespace(exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32,
                              store_param_remainders=False)
    assert state_formats.refuse_generic_step(default) is None
    assert state_formats.refuse_generic_step(object()) is None  # no options: the defaults
    for kw in ({"exp_avg_dtype": torch.bfloat16}, {"exp_avg_sq_dtype": torch.float8_e4m3fn},
               {"store_param_remainders": True}):
        wrapper = SimpleNamespace(**{**vars(default), **kw})
        with pytest.raises(RuntimeError, match="generic path") as info:
            state_formats.refuse_generic_step(wrapper)
        key, value = next(iter(kw.items()))
        assert f"{key}={value}" in str(info.value)


def _dtensor_worker(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from tpamp import state_formats as sf

    mesh = init_device_mesh("cpu", (world_size,))
    rows = 3  # per rank; the global main is [rows * world_size, 300], rank r holds rows r*3..
    full = torch.randn(rows * world_size, 300, generator=torch.Generator().manual_seed(11))
    local_main = full[rank * rows:(rank + 1) * rows].clone()
    main = DTensor.from_local(local_main, mesh, [Shard(0)], run_check=False)

    # dtensor_like: this rank's data, no copy, the main's mesh, placements and global shape
    local = torch.arange(rows * 300, dtype=torch.float32).reshape(rows, 300) + 1000 * rank
    wrapped = sf.dtensor_like(local, main)
    assert isinstance(wrapped, DTensor) and wrapped.to_local().data_ptr() == local.data_ptr()
    assert wrapped.device_mesh == mesh and tuple(wrapped.placements) == (Shard(0),)
    assert wrapped.shape == main.shape and wrapped.stride() == main.stride()
    assert sf.dtensor_like(local, local_main) is local  # a plain main: the tensor itself
    gathered = wrapped.full_tensor()  # every rank's block in rank order
    expect = torch.cat([torch.arange(rows * 300, dtype=torch.float32).reshape(rows, 300) + 1000 * r
                        for r in range(world_size)])
    assert torch.equal(gathered, expect)

    # moments_like: moments become DTensors like the main; scales and step stay local
    state = sf.new_adam_state(local_main, torch.float32, torch.bfloat16, torch.float8_e4m3fn)
    out = sf.moments_like(state, main)
    assert out is not state and set(out) == set(state)
    for k in ("exp_avg", "exp_avg_sq"):
        assert isinstance(out[k], DTensor) and out[k].to_local().data_ptr() == state[k].data_ptr()
        assert tuple(out[k].placements) == (Shard(0),) and out[k].shape == main.shape
    for k in ("step", "exp_avg_sq_scale"):
        assert out[k] is state[k] and not isinstance(out[k], DTensor)
    assert sf.moments_like(out, main)["exp_avg"] is out["exp_avg"]  # already DTensors: kept
    assert sf.moments_like(state, local_main) is state

    # master_from_remainder: the exact master of this rank's shard, as a DTensor like the main
    hi, lo = sf.split_remainders(local_main)
    model = DTensor.from_local(hi, mesh, [Shard(0)], run_check=False)
    master = sf.master_from_remainder(model, lo, main)
    assert isinstance(master, DTensor) and tuple(master.placements) == (Shard(0),)
    assert torch.equal(master.to_local().view(torch.int32), local_main.view(torch.int32))
    assert torch.equal(sf.master_from_remainder(hi, lo, local_main).view(torch.int32),
                       local_main.view(torch.int32))

    # layout_free_state: 8-bit moments decoded to float32 DTensors, without their scales
    codes, scales = sf.encode_moment(local_main.abs(), torch.float8_e4m3fn, sqrt=True)
    saved = sf.layout_free_state({"step": state["step"], "exp_avg": out["exp_avg"],
                                  "exp_avg_sq": sf.dtensor_like(codes, main),
                                  "exp_avg_sq_scale": scales})
    assert set(saved) == {"step", "exp_avg", "exp_avg_sq"}
    assert isinstance(saved["exp_avg_sq"], DTensor) and saved["exp_avg_sq"].shape == main.shape
    assert torch.equal(saved["exp_avg_sq"].to_local(), sf.decode_moment(codes, scales, sqrt=True))
    return True


def test_dtensor_wrapping_keeps_local_data_mesh_and_placements():
    assert run_workers(_dtensor_worker, 2, timeout=60.0) == [True, True]


# -- the wrappers ---------------------------------------------------------------------------

def _model(dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(40, 300), torch.nn.Linear(300, 7)).to(dtype)


def _wrap(model, **kw):
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    return tpamp.MixedPrecisionOptimizer(inner, **kw)


def _set_grads(model, gen, scale=1e-2):
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=gen) * scale).to(p.dtype)


def test_wrapper_options_are_checked_before_anything_changes():
    m = _model()
    sgd = torch.optim.SGD(m.parameters(), lr=0.1)
    params_before = list(sgd.param_groups[0]["params"])
    with pytest.raises(ValueError, match="one-pass fused Adam"):
        tpamp.MixedPrecisionOptimizer(sgd, exp_avg_dtype=torch.bfloat16)
    assert sgd.param_groups[0]["params"] == params_before  # nothing converted
    with pytest.raises(ValueError, match="fused_step=False"):
        _wrap(_model(), store_param_remainders=True, fused_step=False)
    with pytest.raises(ValueError, match="exp_avg_sq_dtype must be one of"):
        _wrap(_model(), exp_avg_sq_dtype=torch.float16)
    with pytest.raises(ValueError, match="float16 params"):
        _wrap(_model(torch.float16), store_param_remainders=True,
              grad_scaler=tpamp.ConstantGradScaler(1.0))
    with pytest.raises(TypeError, match="bool"):
        _wrap(_model(), store_param_remainders=1)


def test_generic_path_refuses_narrow_state_and_changes_nothing():
    m = _model()
    opt = _wrap(m, exp_avg_dtype=torch.bfloat16, store_param_remainders=True)
    gen = torch.Generator().manual_seed(5)
    _set_grads(m, gen)
    opt.step()
    _set_grads(m, gen)
    before = [p.detach().clone() for p in m.parameters()]
    opt.optimizer.register_step_pre_hook(lambda *a: None)
    with pytest.raises(RuntimeError, match="generic path"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))


def _train(m, opt, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        _set_grads(m, gen)
        assert opt.step().update_successful


def test_wrapper_remainders_bit_identical_to_fp32_masters_and_state_bytes():
    """MixedPrecisionOptimizer, 200 steps of the same hand-set grads: with remainders the
    rebuilt masters equal the fp32-master optimizer's bit for bit; 12 -> 6 bytes/param."""
    ma, mb = _model(), _model()
    a = _wrap(ma, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    b = _wrap(mb, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16,
              store_param_remainders=True)
    gen_a, gen_b = torch.Generator().manual_seed(6), torch.Generator().manual_seed(6)
    for _ in range(120):
        _set_grads(ma, gen_a)
        _set_grads(mb, gen_b)
        a.step(), b.step()
    sa, sb = a.state_dict(), b.state_dict()
    for x, y in zip(sa["fp32_from_fp16_params"][0], sb["fp32_from_fp16_params"][0]):
        assert np.array_equal(_np_bits(x), _np_bits(y))
    n = sum(p.numel() for p in ma.parameters())
    assert b.optimizer_state_bytes() == 6 * n + 4 * len(list(mb.parameters()))
    assert a.optimizer_state_bytes() == 8 * n + 4 * len(list(ma.parameters()))
    m8 = _model()
    c = _wrap(m8, exp_avg_dtype=torch.float8_e4m3fn, exp_avg_sq_dtype=torch.float8_e4m3fn,
              min_8bit_size=0,
              store_param_remainders=True)
    _train(m8, c, 1, 0)
    blocks = sum(ops.moment_blocks(p.numel()) for p in m8.parameters())
    assert c.optimizer_state_bytes() == 4 * n + 8 * blocks + 4 * len(list(m8.parameters()))
    assert c.optimizer_state_bytes() / n < 4.2  # 2 + 2 x (1 + 4/256) bytes


CONFIGS = {
    "fp32": dict(),
    "bf16": dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16),
    "bf16+rem": dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16,
                     store_param_remainders=True),
    "8bit+rem": dict(exp_avg_dtype=torch.float8_e4m3fn, exp_avg_sq_dtype=torch.float8_e4m3fn,
                     store_param_remainders=True, min_8bit_size=0),
}
# (min_8bit_size=0 in the 8-bit configurations of this file: every param 8-bit, the layout these
# tests check; the default rule, small params in float32, is tests/test_min_8bit_size.py's)


def _decoded_state(opt):
    out = []
    for group in opt.optimizer.param_groups:
        for p in group["params"]:
            st = opt.optimizer.state[p]
            out.append((ops.decode_moment(st["exp_avg"], st.get("exp_avg_scale")),
                        ops.decode_moment(st["exp_avg_sq"], st.get("exp_avg_sq_scale"), sqrt=True),
                        float(st["step"])))
    return out


@pytest.mark.parametrize("src", list(CONFIGS))
@pytest.mark.parametrize("dst", list(CONFIGS))
def test_state_dict_converts_between_configurations(src, dst):
    ms, md = _model(seed=1), _model(seed=2)
    a = _wrap(ms, **CONFIGS[src])
    _train(ms, a, 3, 7)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    b = _wrap(md, **CONFIGS[dst])
    b.load_state_dict(saved)
    # masters: exact both ways
    for x, y in zip(a.state_dict()["fp32_from_fp16_params"][0],
                    b.state_dict()["fp32_from_fp16_params"][0]):
        assert torch.equal(x, y)
    # stored in dst's dtypes; values exact when dst holds src's values, else dst's rounding
    for group in b.optimizer.param_groups:
        for p in group["params"]:
            st = b.optimizer.state[p]
            assert st["exp_avg"].dtype == CONFIGS[dst].get("exp_avg_dtype", torch.float32)
            assert st["exp_avg_sq"].dtype == CONFIGS[dst].get("exp_avg_sq_dtype", torch.float32)
    for (m1, v1, s1), (m2, v2, s2) in zip(_decoded_state(a), _decoded_state(b)):
        assert s1 == s2
        if dst == src or dst == "fp32" or (src == "8bit+rem" and dst.startswith("bf16") and False):
            if dst == src and dst.startswith("8bit"):
                assert torch.equal(m1, m2) and torch.equal(v1, v2)
            elif dst == "fp32" or dst == src:
                assert torch.equal(m1, m2) and torch.equal(v1, v2)
        elif dst.startswith("bf16"):
            assert torch.equal(m2, m1.to(torch.bfloat16).float())
            assert torch.equal(v2, v1.to(torch.bfloat16).float())
        else:  # -> 8-bit: blockwise quantization of src's values
            c, s = ops.encode_moment(m1, torch.float8_e4m3fn)
            assert torch.equal(m2, ops.decode_moment(c, s))
    # and it trains on
    _train(md, b, 2, 8)


def test_resume_with_narrow_state_is_bit_identical():
    cfg = CONFIGS["8bit+rem"]
    m1, m2 = _model(seed=3), _model(seed=3)
    a = _wrap(m1, **cfg)
    _train(m1, a, 4, 9)
    buf = io.BytesIO()
    torch.save({"opt": a.state_dict(), "model": m1.state_dict()}, buf)
    _train(m1, a, 3, 10)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    m2.load_state_dict(saved["model"])
    b = _wrap(m2, **cfg)
    b.load_state_dict(saved["opt"])
    _train(m2, b, 3, 10)
    for x, y in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(x, y)
    for (a1, b1, c1), (a2, b2, c2) in zip(_decoded_state(a), _decoded_state(b)):
        assert torch.equal(a1, a2) and torch.equal(b1, b2) and c1 == c2


# -- DistributedOptimizer, DP 2 and 4, bf16 and fp16 models ----------------------------------

CONFIGS["8bit"] = dict(exp_avg_dtype=torch.float8_e4m3fn, exp_avg_sq_dtype=torch.float8_e4m3fn,
                       min_8bit_size=0)
# the uint8 (dynamic map) format
CONFIGS["u8"] = dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8, min_8bit_size=0)
CONFIGS["u8+rem"] = dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8,
                         store_param_remainders=True, min_8bit_size=0)


def _dist_worker(rank, world_size, cfg_name, dtype):
    import torch.distributed as dist

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(40, 300), torch.nn.Linear(300, 7)).to(dtype)

    model, ref_model = build(), build()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    dp = dist.new_group(list(range(world_size)))
    def scaler():  # fp16 needs one; 4.0: exact powers of two, no overflow here
        return tpamp.ConstantGradScaler(4.0) if dtype == torch.float16 else None

    opt = tpamp.DistributedOptimizer(inner, data_parallel_group=dp, bucket_size=5000,
                                     grad_scaler=scaler(), **CONFIGS[cfg_name])
    # the reference: the same configuration unsharded on one rank (MixedPrecisionOptimizer,
    # itself checked against the independent references above)
    ref = _wrap(ref_model, grad_scaler=scaler(), **CONFIGS[cfg_name])
    gen = torch.Generator().manual_seed(11)
    for _ in range(5):
        grads = [(torch.randn(p.shape, generator=gen) * 1e-2).to(dtype)
                 for p in model.parameters()]
        for p, g in zip(model.parameters(), grads):
            p.main_grad.copy_(g)  # the same grad on every rank: its DP mean is g exactly
        for p, g in zip(ref_model.parameters(), grads):
            p.grad = g.clone()
        assert opt.step().update_successful
        ref.step()
        opt.zero_grad()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        if cfg_name.startswith(("8bit", "u8")):
            # 8-bit blocks follow the shards (other block boundaries than one rank's): close
            torch.testing.assert_close(p.float(), q.float(), rtol=0,
                                       atol=2e-2 * float(q.abs().max()) + 1e-3)
        else:  # elementwise formats: the shard layout changes nothing, bit for bit
            assert torch.equal(p, q)
    n = sum(p.numel() for p in model.parameters())
    per_param = opt.optimizer_state_bytes() / n
    expect = {"fp32": 12, "bf16": 8, "bf16+rem": 6, "8bit": 6.1, "8bit+rem": 4.1, "u8": 6.1,
              "u8+rem": 4.1}[cfg_name]
    assert per_param <= expect / world_size + 0.2, per_param
    # save/load (same layout) round trip keeps every bit
    sd = opt.state_dict()
    before = [p.detach().clone() for p in model.parameters()]
    opt.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("cfg_name,world_size,dtype", [
    ("bf16+rem", 2, torch.bfloat16), ("8bit+rem", 2, torch.bfloat16),
    ("bf16+rem", 4, torch.bfloat16), ("8bit+rem", 4, torch.bfloat16),
    ("bf16", 2, torch.float16), ("8bit", 4, torch.float16),
    ("u8+rem", 2, torch.bfloat16), ("u8", 4, torch.float16),
])
def test_distributed_optimizer_narrow_state(cfg_name, world_size, dtype):
    if not _kernel_built():
        pytest.skip("tpamp._C with the fused step kernels is not built")
    run_workers(_dist_worker, world_size, cfg_name, dtype, timeout=60.0)


# -- torch.distributed.checkpoint (tpamp.checkpoint): layout- and configuration-free ---------

@pytest.mark.parametrize("src,dst", [("8bit+rem", "fp32"), ("fp32", "bf16+rem"),
                                     ("bf16+rem", "8bit+rem"), ("8bit+rem", "8bit+rem"),
                                     ("u8+rem", "fp32"), ("bf16+rem", "u8+rem"),
                                     ("u8+rem", "u8+rem")])
def test_dcp_checkpoint_converts_between_configurations(tmp_path, src, dst):
    from tpamp.checkpoint import load_checkpoint, save_checkpoint

    ms, md = _model(seed=4), _model(seed=5)
    a = _wrap(ms, **CONFIGS[src])
    _train(ms, a, 3, 12)
    save_checkpoint(str(tmp_path), dict(ms.named_parameters()), a)
    b = _wrap(md, **CONFIGS[dst])
    load_checkpoint(str(tmp_path), dict(md.named_parameters()), b)
    for x, y in zip(a.state_dict()["fp32_from_fp16_params"][0],
                    b.state_dict()["fp32_from_fp16_params"][0]):
        assert torch.equal(x, y)  # masters exact, whatever the configurations
    for (m1, v1, s1), (m2, v2, s2) in zip(_decoded_state(a), _decoded_state(b)):
        assert s1 == s2
        if dst == "fp32":
            assert torch.equal(m1, m2) and torch.equal(v1, v2)
        elif dst == "bf16+rem":
            assert torch.equal(m2, m1.to(torch.bfloat16).float())
        else:  # 8-bit: the same values up to one re-quantization (exact codes for 8-bit src)
            c, s = ops.encode_moment(m1, CONFIGS[dst]["exp_avg_dtype"])
            torch.testing.assert_close(m2, ops.decode_moment(c, s), rtol=1e-6, atol=0)
    for group in b.optimizer.param_groups:
        for p in group["params"]:
            assert b.optimizer.state[p]["exp_avg"].dtype == CONFIGS[dst].get(
                "exp_avg_dtype", torch.float32)
    _train(md, b, 2, 13)


def _dist_ckpt_worker(rank, world_size, path, src, dst):
    import torch.distributed as dist

    from tpamp.checkpoint import load_checkpoint, save_checkpoint

    dp = dist.new_group(list(range(world_size)))

    def build(seed, cfg):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(40, 300), torch.nn.Linear(300, 7)).to(torch.bfloat16)
        inner = torch.optim.AdamW(m.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
        return m, tpamp.DistributedOptimizer(inner, data_parallel_group=dp, bucket_size=5000,
                                             param_names=m.named_parameters(), **CONFIGS[cfg])

    ma, a = build(0, src)
    gen = torch.Generator().manual_seed(14)
    for _ in range(3):
        for p in ma.parameters():
            p.main_grad.copy_((torch.randn(p.shape, generator=gen) * 1e-2).to(torch.bfloat16))
        assert a.step().update_successful
    save_checkpoint(path, dict(ma.named_parameters()), a)
    mb, b = build(1, dst)
    load_checkpoint(path, dict(mb.named_parameters()), b)
    for x, y in zip(a.state_dict()["shard_main_params"], b.state_dict()["shard_main_params"]):
        assert torch.equal(x, y)  # the fp32 masters of this rank's shard, exactly
    for x, y in zip(ma.parameters(), mb.parameters()):  # equal but at ties (RNE vs away)
        torch.testing.assert_close(y.float(), x.float(), rtol=2 ** -7, atol=0)
    sa, sb = a.optimizer.state, b.optimizer.state
    for pa, pb in zip(a.optimizer.param_groups[0]["params"], b.optimizer.param_groups[0]["params"]):
        ma_ = ops.decode_moment(sa[pa]["exp_avg"], sa[pa].get("exp_avg_scale"))
        mb_ = ops.decode_moment(sb[pb]["exp_avg"], sb[pb].get("exp_avg_scale"))
        assert sb[pb]["exp_avg"].dtype == CONFIGS[dst].get("exp_avg_dtype", torch.float32)
        torch.testing.assert_close(mb_, ma_, rtol=0.07, atol=float(ma_.abs().max()) * 2 ** -8)
    return [p.detach().float().clone() for p in ma.parameters()]


def test_distributed_optimizer_dcp_converts_configurations_and_layouts(tmp_path):
    """DP 2 with 8-bit moments + remainders -> DP 2 with fp32 state (same masters, moments
    decoded), then the same checkpoint into one process with MixedPrecisionOptimizer + bf16."""
    if not _kernel_built():
        pytest.skip("tpamp._C with the fused step kernels is not built")
    from tpamp.checkpoint import load_checkpoint

    path = str(tmp_path)
    out = run_workers(_dist_ckpt_worker, 2, path, "8bit+rem", "fp32", timeout=120.0)
    torch.manual_seed(2)
    m = _model(seed=2)
    opt = _wrap(m, **CONFIGS["bf16+rem"])
    load_checkpoint(path, dict(m.named_parameters()), opt)
    masters = opt.state_dict()["fp32_from_fp16_params"][0]
    for x, y in zip(m.parameters(), out[0]):
        torch.testing.assert_close(x.float(), y, rtol=0, atol=float(y.abs().max()) * 2 ** -7)
    assert all(torch.isfinite(t).all() for t in masters)
    for p in opt.optimizer.param_groups[0]["params"]:
        assert opt.optimizer.state[p]["exp_avg"].dtype == torch.bfloat16
    _train(m, opt, 2, 15)


# -- the other CPU capability modules ------------------------------------------------------

def test_narrow_state_on_the_default_capability_module():
    """The tests above that compare the narrow-state kernel with the independent references,
    run again with the module compiled for the DEFAULT capability (forced with
    ATEN_CPU_CAPABILITY; its block loops are compiled without AVX, and x86's DEFAULT path uses
    scalar code in places the AVX2/AVX-512 modules vectorize)."""
    import os
    import subprocess
    import sys

    if not _kernel_built():
        pytest.skip("tpamp._C with the fused step kernels is not built")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    probe = subprocess.run(
        [sys.executable, "-c", "from tpamp import _ext, ops; ops.extension_available(); "
         "print(_ext.status()['cpu_module'])"],
        env=env, cwd=os.path.dirname(here), capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-2000:]
    if probe.stdout.split()[-1] != "tpamp._C_cpu_default":
        pytest.skip(f"the DEFAULT module is not built ({probe.stdout.strip()})")
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
         "narrow_step_equals or nan_and_inf or hundreds or reference_path"],
        env=env, cwd=os.path.dirname(here), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    summary = [line for line in res.stdout.splitlines() if " passed" in line][-1]
    assert "skipped" not in summary and "deselected" in summary, summary  # all of them ran


@pytest.mark.parametrize("cfg", ["bf16+rem", "8bit", "8bit+rem"])
def test_opcheck_fused_adam_step_with_narrow_state(cfg):
    """torch.library.opcheck on the narrow-state path of the op (test_fused_step.py checks the
    float32 one): the schema marks what this path writes too (remainders, bf16 model params,
    bf16/8-bit moments and their per-block scales), and the fake impl agrees."""
    if not _kernel_built():
        pytest.skip("tpamp._C with the fused step kernels is not built")
    gen = torch.Generator().manual_seed(12)
    opts = CONFIGS[cfg]
    m_dtype, v_dtype = opts["exp_avg_dtype"], opts["exp_avg_sq_dtype"]
    params, models, ms, vs, mscales, vscales, grads = [], [], [], [], [], [], []
    for n in (5, 300, 0):
        param, model = _param_and_model(torch.randn(n, generator=gen),
                                        opts.get("store_param_remainders", False))
        params.append(param), models.append(model)
        grads.append(torch.randn(n, generator=gen).to(torch.bfloat16))
        m, a = ops.encode_moment(torch.randn(n, generator=gen) * 1e-3, m_dtype)
        v, b = ops.encode_moment(torch.rand(n, generator=gen) * 1e-6, v_dtype, sqrt=True)
        ms.append(m), vs.append(v), mscales.append(a), vscales.append(b)
    def op_scales(scales, moments):  # the op's form (tpamp.ops._scale_list)
        if all(m.dtype != torch.float8_e4m3fn for m in moments):
            return []
        return [sc if sc is not None else torch.empty(0) for sc in scales]

    args = (params, ms, vs, [torch.tensor(3.0) for _ in params], models, grads,
            torch.tensor([0.5]), torch.zeros(1), None, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, False,
            op_scales(mscales, ms), op_scales(vscales, vs))
    op = torch.ops.tpamp.fused_adam_step_
    if m_dtype != torch.float8_e4m3fn:
        torch.library.opcheck(op, args)
        return
    # opcheck's test_schema compares tensors with arithmetic torch has no float8 CPU kernel
    # for; the other utilities run, and the schema's claim is checked by hand: the inputs it
    # does not mark as written (grads, grad_scale, found_inf) keep every bit
    torch.library.opcheck(op, args, test_utils=("test_autograd_registration", "test_faketensor",
                                                "test_aot_dispatch_dynamic"))
    read_only = list(grads) + [args[6], args[7]]  # bf16 grads, float32 scale and found_inf
    read_only_before = [t.clone() for t in read_only]

    def raw(ts):  # comparable copies (torch.equal has no float8 kernel either)
        return [t.view(torch.uint8).clone() if t.dtype == torch.float8_e4m3fn else t.clone()
                for t in ts]

    state_before = raw(ms + mscales)
    op(*args)
    assert all(torch.equal(a, b) for a, b in zip(read_only, read_only_before))
    # and the 8-bit state it marks is in fact written (codes or scales change)
    assert any(not torch.equal(a, b) for a, b in zip(raw(ms + mscales), state_before))


# -- a grad whose square overflows float32, through the wrappers ----------------------------

def _overflow_grads(model, gen, step, big=BF16_MAX):
    """Small grads plus, on the first Linear's weight, 1e30 in one 256-block and -``big`` (the
    largest finite bf16) in another (every step, so the blocks stay saturated)."""
    grads = [(torch.randn(p.shape, generator=gen) * 1e-2) for p in model.parameters()]
    w = grads[0].view(-1)
    w[3] = 1e30
    w[700] = -big  # (alternating signs would overflow g - exp_avg in float32 moments too)
    return [g.to(torch.bfloat16) for g in grads]


def _assert_8bit_state_finite(opt, params):
    for p in params:
        st = opt.optimizer.state[p]
        assert bool(st["exp_avg_scale"].isfinite().all())
        assert bool(st["exp_avg_sq_scale"].isfinite().all())
        assert bool(ops.decode_moment(st["exp_avg"], st["exp_avg_scale"]).isfinite().all())


@pytest.mark.parametrize("cfg", ["8bit", "8bit+rem"])
def test_wrapper_8bit_keeps_params_finite_when_a_grad_square_overflows(cfg):
    """MixedPrecisionOptimizer with 8-bit moments, 5 steps with 1e30 and the largest finite bf16
    in the grads: every param stays finite (as with float32 moments, where the overflowing
    elements' exp_avg_sq is inf and their update 0) and every 8-bit scale is finite."""
    if not _kernel_built():
        pytest.skip("tpamp._C with the fused step kernels is not built")
    m8, m32 = _model(seed=4), _model(seed=4)
    a = _wrap(m8, **CONFIGS[cfg])
    b = _wrap(m32)
    gen_a, gen_b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    w0 = next(m8.parameters()).detach().clone()
    for k in range(5):
        for m, gen in ((m8, gen_a), (m32, gen_b)):
            for p, g in zip(m.parameters(), _overflow_grads(m, gen, k)):
                p.grad = g
        assert a.step().update_successful and b.step().update_successful
        assert all(bool(p.isfinite().all()) for p in m8.parameters()), k
        assert all(bool(p.isfinite().all()) for p in m32.parameters()), k
        _assert_8bit_state_finite(a, a.optimizer.param_groups[0]["params"])
    w = next(m8.parameters()).detach().view(-1)
    # the overflowing elements are not updated (exp_avg_sq inf) apart from weight decay, as
    # with float32 moments
    w32 = next(m32.parameters()).detach().view(-1)
    assert torch.equal(w[[3, 700]], w32[[3, 700]])
    assert not torch.equal(w, w0.view(-1))


def _overflow_dist_worker(rank, world_size):
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 300),
                                torch.nn.Linear(300, 7)).to(torch.bfloat16)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    dp = dist.new_group(list(range(world_size)))
    opt = tpamp.DistributedOptimizer(inner, data_parallel_group=dp, bucket_size=5000,
                                     **CONFIGS["8bit+rem"])
    gen = torch.Generator().manual_seed(11)
    for k in range(4):
        # the same on every rank: the DP mean is g exactly. Half the largest bf16: the DP sum
        # of two largest bf16 would be inf (a real overflow, skipped by found_inf)
        for p, g in zip(model.parameters(), _overflow_grads(model, gen, k, big=BF16_MAX / 2)):
            p.main_grad.copy_(g)
        assert opt.step().update_successful
        opt.zero_grad()
        assert all(bool(p.isfinite().all()) for p in model.parameters()), (rank, k)
        for st in opt.optimizer.state.values():
            for key in ("exp_avg_scale", "exp_avg_sq_scale"):
                assert bool(st[key].isfinite().all()), (rank, k, key)
    return True


def test_distributed_optimizer_8bit_keeps_params_finite_when_a_grad_square_overflows():
    if not _kernel_built():
        pytest.skip("tpamp._C with the fused step kernels is not built")
    assert run_workers(_overflow_dist_worker, 2, timeout=60.0) == [True, True]


def _bad_scales_dist_worker(rank, world_size, src, dst):
    """DistributedOptimizer at DP 2: rank 0's state dict loses its 8-bit scale keys (src
    8-bit) or gains a short one; rank 0 refuses with KeyError / ValueError naming the key, rank
    1 with ValueError naming rank 0, and neither changed anything."""
    import torch.distributed as dist
    from dist_utils import freeze, tensor_bytes

    def build(cfg, seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(40, 300),
                                    torch.nn.Linear(300, 7)).to(torch.bfloat16)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
        opt = tpamp.DistributedOptimizer(inner, data_parallel_group=dp, bucket_size=5000,
                                         **CONFIGS[cfg])
        gen = torch.Generator().manual_seed(seed)
        for _ in range(2):
            for p in model.parameters():
                p.main_grad.copy_(torch.randn(p.shape, generator=gen) * 1e-2)
            assert opt.step().update_successful
            opt.zero_grad()
        return model, opt

    dp = dist.new_group(list(range(world_size)))
    _, a = build(src, 1)
    sd = a.state_dict()
    if rank == 0:
        for entry in sd["optimizer"]["state"].values():
            if src == "8bit":
                entry.pop("exp_avg_scale", None)
            else:
                entry["exp_avg_scale"] = torch.ones(1)
    model, b = build(dst, 2)
    before = ([tensor_bytes(p) for p in model.parameters()], freeze(b.state_dict()))
    try:
        b.load_state_dict(sd)
        err = None
    except (KeyError, ValueError) as e:
        err = (type(e).__name__, str(e))
    after = ([tensor_bytes(p) for p in model.parameters()], freeze(b.state_dict()))
    return err, before == after


@pytest.mark.parametrize("src,dst", [("8bit", "fp32"), ("8bit", "8bit+rem"), ("fp32", "8bit")])
def test_distributed_optimizer_refuses_bad_8bit_scales_on_every_rank(src, dst):
    if not _kernel_built():
        pytest.skip("tpamp._C with the fused step kernels is not built")
    (err0, same0), (err1, same1) = run_workers(_bad_scales_dist_worker, 2, src, dst, timeout=60.0)
    assert same0 and same1
    assert err0[0] == ("KeyError" if src == "8bit" else "ValueError")
    assert "exp_avg_scale" in err0[1]
    assert err1[0] == "ValueError" and "refused on rank(s) [0]" in err1[1]


# ---- misuse around narrow state: bad 8-bit state dicts and options that cannot apply are refused before anything changes (docs/spec.md sections 9 and 2.4) ----


F8 = torch.float8_e4m3fn


NARROW_CONFIGS = {
    "fp32": dict(),
    "bf16": dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16),
    "8bit": dict(exp_avg_dtype=F8, exp_avg_sq_dtype=F8, min_8bit_size=0),
    "8bit+rem": dict(exp_avg_dtype=F8, exp_avg_sq_dtype=F8, store_param_remainders=True,
                     min_8bit_size=0),
}


needs_kernel = pytest.mark.skipif(not fused_step_built(),
                                  reason="tpamp._C with the fused step kernels is not built")


def _small_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(20, 300), torch.nn.Linear(300, 3)).to(torch.bfloat16)


def _trained(cfg, seed=0, steps=2):
    model = _small_model(seed)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    opt = tpamp.MixedPrecisionOptimizer(inner, **NARROW_CONFIGS[cfg])
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(p.dtype)
        assert opt.step().update_successful
    return model, opt


def _saved(opt):
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _picture(model, opt):
    return ([tensor_bytes(p) for p in model.parameters()], freeze(opt.state_dict()))


def _refused(model, opt, call, exc, words):
    before = _picture(model, opt)
    with pytest.raises(exc) as info:
        call()
    msg = str(info.value)
    for w in words:
        assert w in msg, (w, msg)
    assert _picture(model, opt) == before  # nothing changed
    return msg


def _first_entry(sd):
    return next(iter(sd["optimizer"]["state"].values()))


def _short_scale(sd):
    e = _first_entry(sd)
    e["exp_avg_scale"] = e["exp_avg_scale"][:-1].clone()
    return sd


def _no_scales(sd):
    for e in sd["optimizer"]["state"].values():
        e.pop("exp_avg_scale"), e.pop("exp_avg_sq_scale")
    return sd


def _nan_scale(sd):
    _first_entry(sd)["exp_avg_sq_scale"][0] = float("nan")
    return sd


def _negative_scale(sd):
    _first_entry(sd)["exp_avg_scale"][0] = -1.0
    return sd


def _stray_scale(sd):  # a float32 state dict with a scale key: not 8-bit codes
    e = _first_entry(sd)
    e["exp_avg_scale"] = torch.ones(state_formats.moment_blocks(e["exp_avg"].numel()))
    return sd


def _scale_list(sd):
    _first_entry(sd)["exp_avg_scale"] = [1.0]
    return sd


SCALE_CASES = [
    # (source config, edit, exception, words)
    ("8bit", _short_scale, ValueError, ["exp_avg_scale", "shape", "one per block"]),
    ("8bit", _no_scales, KeyError, ["exp_avg", "8-bit", "exp_avg_scale"]),
    ("8bit", _nan_scale, ValueError, ["exp_avg_sq_scale", "nan"]),
    ("8bit", _negative_scale, ValueError, ["exp_avg_scale", "negative", "-1.0"]),
    ("fp32", _stray_scale, ValueError, ["exp_avg_scale", "not float8_e4m3fn codes"]),
    ("8bit", _scale_list, TypeError, ["exp_avg_scale", "tensor", "list"]),
]


@needs_kernel
@pytest.mark.parametrize("dst", list(NARROW_CONFIGS))
@pytest.mark.parametrize("src,edit,exc,words", SCALE_CASES, ids=[c[1].__name__ for c in SCALE_CASES])
def test_narrow_state_dict_refused_before_anything_changes(src, edit, exc, words, dst):
    """Into every configuration (an fp32-moment optimizer loading an 8-bit dict and the
    reverse): the refused load leaves params and state as they were, and the next step runs."""
    _, src_opt = _trained(src, seed=1)
    sd = edit(_saved(src_opt))
    model, opt = _trained(dst, seed=2)
    _refused(model, opt, lambda: opt.load_state_dict(sd), exc, words)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    assert opt.step().update_successful  # still usable
    assert all(bool(p.isfinite().all()) for p in model.parameters())


@needs_kernel
@pytest.mark.parametrize("dst", list(NARROW_CONFIGS))
def test_untouched_8bit_state_dict_loads_into_every_configuration(dst):
    """The checks refuse nothing valid: an 8-bit dict (fresh zero-scale blocks included) loads
    everywhere and decodes to its saved values."""
    _, src_opt = _trained("8bit", seed=1)
    sd = _saved(src_opt)
    model, opt = _trained(dst, seed=2)
    opt.load_state_dict(copy.deepcopy(sd))
    for pid, entry in sd["optimizer"]["state"].items():
        p = opt.optimizer.param_groups[0]["params"][pid]
        st = opt.optimizer.state[p]
        saved = state_formats.decode_moment(entry["exp_avg"], entry["exp_avg_scale"])
        got = state_formats.decode_moment(st["exp_avg"], st.get("exp_avg_scale"))
        if dst.startswith("8bit") or dst == "fp32":
            assert torch.equal(got, saved)
        else:
            assert torch.equal(got, saved.to(torch.bfloat16).float())


def test_check_saved_scales_accepts_codes_cast_to_float32():
    """torch.optim's own load casts 8-bit codes to the param dtype: float32 code values with
    their scales are the codes still (exact), not a stray scale."""
    codes, scales = state_formats.encode_moment(torch.linspace(-1, 1, 300), F8)
    state_formats.check_saved_scales({0: {"exp_avg": codes.float(), "exp_avg_scale": scales}})
    with pytest.raises(ValueError, match="not float8_e4m3fn codes"):
        state_formats.check_saved_scales(
            {0: {"exp_avg": codes.float() + 0.01, "exp_avg_scale": scales}})
    with pytest.raises(ValueError, match="scales without their 8-bit moment"):
        state_formats.check_saved_scales({0: {"exp_avg_scale": scales}})


@pytest.mark.parametrize("cls", ["MixedPrecisionOptimizer", "FP32Optimizer"])
def test_remainders_without_bf16_params_are_refused(cls):
    """fp32 params are their own masters: store_param_remainders would do nothing."""
    model = torch.nn.Linear(4, 3)
    inner = torch.optim.AdamW(model.parameters(), lr=0.1)
    refused_construction(
        lambda: getattr(tpamp, cls)(inner, store_param_remainders=True), inner,
        list(model.parameters()), ValueError,
        ["store_param_remainders=True", "no trainable bf16 param", "torch.float32",
         "store_param_remainders=False"])
    getattr(tpamp, cls)(inner)  # without it: accepted


def test_remainders_with_bf16_and_fp32_params_apply_to_the_bf16_ones():
    bf, fp = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16)), torch.nn.Parameter(torch.ones(3))
    opt = tpamp.MixedPrecisionOptimizer(torch.optim.AdamW([bf, fp], lr=0.1),
                                        store_param_remainders=True)
    assert opt.store_param_remainders


@pytest.mark.parametrize("option", ["amsgrad", "capturable", "differentiable"])
@pytest.mark.parametrize("cfg", ["bf16", "8bit", "8bit+rem"])
def test_narrow_state_with_an_adam_option_the_one_pass_step_lacks_is_refused(option, cfg):
    model = _small_model()
    inner = torch.optim.Adam(model.parameters(), lr=0.1, **{option: True})
    refused_construction(
        lambda: tpamp.MixedPrecisionOptimizer(inner, **NARROW_CONFIGS[cfg]), inner,
        list(model.parameters()), ValueError,
        [f"{option}=True", "param group 0", f"pass {option}=False to Adam"])


_LOW_SCALERS = [
    (lambda: tpamp.DynamicGradScaler(initial_scale=8.0, min_scale=0.5), "min_scale=0.5"),
    (lambda: tpamp.ConstantGradScaler(0.25), "scale=0.25"),
]


@pytest.mark.parametrize("make,setting", _LOW_SCALERS, ids=["dynamic", "constant"])
@pytest.mark.parametrize("cfg", ["bf16", "8bit+rem"])
def test_check_narrow_state_scaler_names_the_setting(make, setting, cfg):
    from tpamp._checks import check_narrow_state_scaler

    opts = NARROW_CONFIGS[cfg]
    args = (opts["exp_avg_dtype"], opts["exp_avg_sq_dtype"],
            opts.get("store_param_remainders", False))
    scaler = make()
    before = freeze(scaler.state_dict())
    with pytest.raises(ValueError, match="never drops below 1") as info:
        check_narrow_state_scaler(scaler, *args)
    assert setting in str(info.value) and type(scaler).__name__ in str(info.value)
    assert freeze(scaler.state_dict()) == before
    # accepted: float32 state with that scaler; narrow state without a scaler or with one >= 1
    check_narrow_state_scaler(scaler, torch.float32, torch.float32, False)
    check_narrow_state_scaler(None, *args)
    check_narrow_state_scaler(tpamp.DynamicGradScaler(initial_scale=8.0, min_scale=1.0), *args)
    check_narrow_state_scaler(tpamp.ConstantGradScaler(1.0), *args)


def test_narrow_state_with_a_scaler_below_one_is_refused_at_construction():
    model = _small_model()
    inner = torch.optim.AdamW(model.parameters(), lr=0.1)
    refused_construction(
        lambda: tpamp.MixedPrecisionOptimizer(
            inner, grad_scaler=tpamp.DynamicGradScaler(initial_scale=8.0, min_scale=0.5),
            **NARROW_CONFIGS["8bit"]),
        inner, list(model.parameters()), ValueError, ["min_scale=0.5", "never drops below 1"])


@needs_kernel
def test_param_grad_norms_work_with_narrow_state():
    """step(param_grad_norms=True) takes the one-pass path with narrow state (no refusal): the
    norms equal the grads' own norms, and the params moved."""
    model, opt = _trained("8bit+rem", steps=1)
    tracker = opt.track_param_grad_norms(model.named_parameters())
    gen = torch.Generator().manual_seed(9)
    grads = {n: (torch.randn(p.shape, generator=gen) * 1e-2).to(p.dtype)
             for n, p in model.named_parameters()}
    before = [p.detach().clone() for p in model.parameters()]
    for n, p in model.named_parameters():
        p.grad = grads[n].clone()
    assert opt.step(param_grad_norms=True).update_successful
    for n, g in grads.items():
        assert tracker.norms[n] == pytest.approx(float(g.double().norm()), rel=1e-5)
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
