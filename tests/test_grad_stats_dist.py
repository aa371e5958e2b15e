"""Grad norm and zero count under TP x PP x DP equal those of the unsharded model (fp64)."""

import math

import pytest
import torch
from dist_utils import run_workers
from model_fixture import full_grads, isclose, reference_stats, round_to, shard_params

import tpamp
from tpamp.parallel import initialize_model_parallel

LAYOUTS = [(2, 2, 2), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2)]


def _standalone_stats(rank, world, tp, pp, style):
    st = initialize_model_parallel(tp, pp)
    grads = round_to(full_grads(seed=1), torch.float32)
    params = list(shard_params(st, grads, style=style).values())
    filtered = tpamp.filter_grads_for_norm(params, st.tp_group)
    l2 = tpamp.get_grad_norm_fp32(filtered, 2.0, st.grad_stats_group)
    linf = tpamp.get_grad_norm_fp32(filtered, math.inf, st.grad_stats_group)
    l3 = tpamp.get_grad_norm_fp32(filtered, 3.0, st.grad_stats_group)
    zeros = tpamp.count_zeros_fp32(params, st.grad_stats_group, st.tp_group)
    assert l2.dtype == torch.float32 and l2.dim() == 0
    assert zeros.dtype == torch.int64 and zeros.dim() == 0
    return float(l2), float(linf), float(l3), int(zeros)


@pytest.mark.parametrize("style", ["megatron", "dtensor"])
@pytest.mark.parametrize("tp,pp,dp", LAYOUTS)
def test_grad_norm_and_zeros_equal_unsharded_fp64_reference(tp, pp, dp, style):
    ref_l2, ref_inf, ref_l3, ref_zeros = reference_stats(round_to(full_grads(seed=1), torch.float32))
    results = run_workers(_standalone_stats, tp * pp * dp, tp, pp, style)
    for rank, (l2, linf, l3, zeros) in enumerate(results):
        assert isclose(l2, ref_l2), (rank, l2, ref_l2)
        assert isclose(linf, ref_inf), (rank, linf, ref_inf)
        assert isclose(l3, ref_l3), (rank, l3, ref_l3)
        assert zeros == ref_zeros, (rank, zeros, ref_zeros)


def _counted_without_tp_group(rank, world, style):
    # Without the TP group every rank counts its replicated params: TP duplicates are
    # counted twice, which the test compares against a hand-built double count.
    st = initialize_model_parallel(2, 1)
    grads = round_to(full_grads(seed=2), torch.float32)
    params = list(shard_params(st, grads, style=style).values())
    filtered = tpamp.filter_grads_for_norm(params, None)
    return float(tpamp.get_grad_norm_fp32(filtered, 2.0, st.grad_stats_group))


@pytest.mark.parametrize("style", ["megatron", "dtensor"])
def test_replicated_params_count_once_only_with_the_tp_group(style):
    grads = round_to(full_grads(seed=2), torch.float32)
    from model_fixture import FULL_MODEL

    sq_rep = sum(float(grads[n].pow(2).sum()) for n, (_, _, k) in FULL_MODEL.items() if k == "rep")
    sq_all = sum(float(g.pow(2).sum()) for g in grads.values())
    doubled = math.sqrt(sq_all + sq_rep)
    got = run_workers(_counted_without_tp_group, 2, style)
    for v in got:
        assert isclose(v, doubled)


def _optimizer_stats(rank, world, tp, pp, style, dtype, clip_fraction):
    st = initialize_model_parallel(tp, pp)
    scale = 2.0**8
    grads = round_to(full_grads(seed=3), dtype)
    ref_l2, _, _, ref_zeros = reference_stats(grads)
    values = {k: torch.zeros_like(v) for k, v in grads.items()}
    params = shard_params(st, grads, style=style, dtype=dtype, grad_scale=scale, values=values)
    scaler = tpamp.ConstantGradScaler(scale) if dtype == torch.float16 else None
    clip = ref_l2 * clip_fraction
    opt = tpamp.MixedPrecisionOptimizer(
        torch.optim.SGD(list(params.values()), lr=1.0),
        grad_scaler=scaler,
        clip_grad=clip,
        log_num_zeros_in_grad=True,
        grad_stats_group=st.grad_stats_group,
        tensor_parallel_group=st.tp_group,
    )
    if scaler is None:  # bf16: fold the loss scale back out by hand, no scaler to do it
        for p in params.values():
            p.grad.div_(scale)
    ok, norm, zeros = opt.step()
    coeff = min(1.0, clip / (ref_l2 + 1e-6))
    # SGD(lr=1) from zero params: main param = -coeff * grad; check against the fp64 reference
    from model_fixture import FULL_MODEL, local_slice

    for name, p in params.items():
        src = "embed" if name == "head" else name
        expect = -coeff * local_slice(grads[src], FULL_MODEL[src][2], tp, st.tp_rank)
        got = p.to_local() if hasattr(p, "to_local") else p
        # the model param is the fp16/bf16 rounding of the fp32 main param: within one ulp
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(got.detach().double(), expect, rtol=eps, atol=0)
    return ok, norm, zeros, ref_l2, ref_zeros, coeff


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("style", ["megatron", "dtensor"])
def test_optimizer_step_reports_unsharded_norm_and_zeros_and_clips_on_8_ranks(style, dtype):
    results = run_workers(_optimizer_stats, 8, 2, 2, style, dtype, 0.5)
    for ok, norm, zeros, ref_l2, ref_zeros, coeff in results:
        assert ok is True
        assert isclose(norm, ref_l2), (norm, ref_l2)
        assert zeros == ref_zeros
        assert coeff < 1.0
