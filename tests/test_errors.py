"""Bad input gives a clear error naming the offending value (docs/spec.md sections 1-3).

Single-process checks for the optimizer wrappers, and 4-rank gloo checks (tests/dist_utils) for
layouts that do not fit the world size and groups this rank is not a member of.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_workers

import tpamp
from tpamp.parallel import ParallelDims, initialize_model_parallel


def _params(*dtypes, requires_grad=True):
    return [torch.nn.Parameter(torch.zeros(3, dtype=d), requires_grad=requires_grad) for d in dtypes]


def _all_of(*words) -> str:
    """Regex matching a message that contains every one of ``words`` as a separate token."""
    return "(?s)" + "".join(rf"(?=.*(?<![\w.]){w}(?![\w]))" for w in words)


# --------------------------------------------------------------------------------------------
# MixedPrecisionOptimizer / FP32Optimizer construction


def test_fp16_params_without_scaler_raise_value_error():
    opt = torch.optim.SGD(_params(torch.float16, torch.float32), lr=0.1)
    with pytest.raises(ValueError, match=r"(?i)scaler"):
        tpamp.MixedPrecisionOptimizer(opt)


def test_fp16_params_with_explicit_none_scaler_raise_value_error():
    opt = torch.optim.SGD(_params(torch.float16), lr=0.1)
    with pytest.raises(ValueError, match=r"(?i)scaler"):
        tpamp.MixedPrecisionOptimizer(opt, grad_scaler=None, clip_grad=1.0)


@pytest.mark.parametrize("dtypes", [(torch.bfloat16,), (torch.float32,), (torch.bfloat16, torch.float32)])
def test_bf16_and_fp32_params_need_no_scaler(dtypes):
    opt = torch.optim.SGD(_params(*dtypes), lr=0.1)
    wrapped = tpamp.MixedPrecisionOptimizer(opt)
    assert len(wrapped.param_groups[0]["params"]) == len(dtypes)


def test_fp16_params_with_a_scaler_are_accepted():
    opt = torch.optim.SGD(_params(torch.float16), lr=0.1)
    wrapped = tpamp.MixedPrecisionOptimizer(opt, grad_scaler=tpamp.ConstantGradScaler(8.0))
    assert wrapped.param_groups[0]["params"][0].dtype == torch.float32


@pytest.mark.parametrize(
    "dtype", [torch.float64, torch.int64, torch.int32, torch.complex64],
    ids=["float64", "int64", "int32", "complex64"],
)
def test_unsupported_param_dtype_raises_type_error_naming_it(dtype):
    if dtype.is_floating_point or dtype.is_complex:
        bad = torch.nn.Parameter(torch.zeros(3, dtype=dtype))
    else:
        bad = torch.nn.Parameter(torch.zeros(3, dtype=dtype), requires_grad=False)
    opt = torch.optim.SGD([bad] + _params(torch.float32), lr=0.1)
    with pytest.raises(TypeError, match=str(dtype).replace(".", r"\.")):
        tpamp.MixedPrecisionOptimizer(opt, grad_scaler=tpamp.ConstantGradScaler(1.0))


def test_unsupported_param_dtype_in_second_param_group_raises_type_error():
    opt = torch.optim.SGD(
        [{"params": _params(torch.float32)}, {"params": _params(torch.float64)}], lr=0.1
    )
    with pytest.raises(TypeError, match=r"torch\.float64"):
        tpamp.MixedPrecisionOptimizer(opt)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64],
                         ids=["float16", "bfloat16", "float64"])
def test_fp32_optimizer_with_non_fp32_param_raises_type_error_naming_the_dtype(dtype):
    opt = torch.optim.SGD(_params(torch.float32, dtype), lr=0.1)
    with pytest.raises(TypeError, match=str(dtype).replace(".", r"\.")):
        tpamp.FP32Optimizer(opt)


def test_fp32_optimizer_over_fp32_params_is_accepted():
    opt = torch.optim.SGD(_params(torch.float32, torch.float32), lr=0.1)
    wrapped = tpamp.FP32Optimizer(opt, clip_grad=1.0)
    assert wrapped.param_groups[0]["params"] == opt.param_groups[0]["params"]


@pytest.mark.parametrize(
    "clip,shown",
    [(-1.0, r"-1\.0"), (-0.25, r"-0\.25"), (float("nan"), "nan"), (float("inf"), "inf")],
    ids=["-1", "-0.25", "nan", "inf"],
)
@pytest.mark.parametrize("cls", ["MixedPrecisionOptimizer", "FP32Optimizer"])
def test_bad_clip_grad_raises_value_error_naming_it(cls, clip, shown):
    opt = torch.optim.SGD(_params(torch.float32), lr=0.1)
    with pytest.raises(ValueError, match=_all_of("clip_grad", shown)):
        getattr(tpamp, cls)(opt, clip_grad=clip)


@pytest.mark.parametrize(
    "norm_type,shown",
    [(0.5, r"0\.5"), (0.0, r"0(\.0)?"), (-2.0, r"-2(\.0)?"), (float("nan"), "nan")],
    ids=["0.5", "0", "-2", "nan"],
)
def test_bad_norm_type_raises_value_error_naming_it(norm_type, shown):
    opt = torch.optim.SGD(_params(torch.float32), lr=0.1)
    with pytest.raises(ValueError, match=_all_of("norm_type", shown)):
        tpamp.MixedPrecisionOptimizer(opt, norm_type=norm_type)


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, math.inf])
def test_valid_norm_types_are_accepted(norm_type):
    opt = torch.optim.SGD(_params(torch.float32), lr=0.1)
    assert tpamp.MixedPrecisionOptimizer(opt, norm_type=norm_type).norm_type == norm_type


def test_grad_norm_functions_reject_bad_norm_type():
    g = [torch.ones(3)]
    with pytest.raises(ValueError, match=_all_of("norm_type", r"0\.5")):
        tpamp.get_grad_norm_fp32(g, norm_type=0.5)


class _NotAnOptimizer:
    param_groups = [{"params": []}]

    def step(self):
        pass


@pytest.mark.parametrize(
    "obj,name",
    [(_NotAnOptimizer(), "_NotAnOptimizer"), ([torch.zeros(1)], "list"), (None, "NoneType")],
    ids=["duck-typed", "list", "None"],
)
@pytest.mark.parametrize("cls", ["MixedPrecisionOptimizer", "FP32Optimizer"])
def test_non_optimizer_raises_type_error_naming_its_type(cls, obj, name):
    with pytest.raises(TypeError, match=name):
        getattr(tpamp, cls)(obj)


# --------------------------------------------------------------------------------------------
# tpamp.parallel: a layout that does not multiply to the world size


def test_parallel_dims_not_multiplying_to_world_size_raise_value_error_showing_numbers():
    with pytest.raises(ValueError, match=_all_of("3", "2", "8")):
        ParallelDims(tp=3, pp=2, world_size=8)


def test_parallel_dims_with_explicit_dp_mismatch_raise_value_error_showing_numbers():
    with pytest.raises(ValueError, match=_all_of("2", "3", "16")):
        ParallelDims(tp=2, pp=2, dp=3, world_size=16)


def test_parallel_dims_that_fit_are_accepted():
    d = ParallelDims(tp=2, pp=2, world_size=8)
    assert (d.tp, d.pp, d.dp, d.world_size) == (2, 2, 2, 8)


def _init_tp3_on_4(rank, world_size):
    try:
        initialize_model_parallel(3, 1)
    except ValueError as e:
        return "ValueError", str(e)
    except Exception as e:  # a different error type is a failure of the check below
        return type(e).__name__, str(e)
    return None, None


def test_initialize_model_parallel_tp3_on_4_ranks_raises_value_error_showing_numbers():
    import re

    results = run_workers(_init_tp3_on_4, 4)
    for rank, (kind, msg) in enumerate(results):
        assert kind == "ValueError", (rank, kind, msg)
        assert re.search(_all_of("3", "4"), msg), (rank, msg)


# --------------------------------------------------------------------------------------------
# a group this rank is not a member of


def _not_member_checks(rank, world_size):
    group01 = dist.new_group([0, 1])  # every rank takes part in creating it
    out = {}
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.ones(3)
    if rank == 0:  # a member: the same construction is accepted
        tpamp.MixedPrecisionOptimizer(torch.optim.SGD([p], lr=0.1), grad_stats_group=group01)
        out["member_ok"] = True
    if rank != 2:
        dist.barrier()  # stay until rank 2 is done: an early exit can break group01's set-up
        return out

    def attempt(name, fn):
        try:
            fn()
        except Exception as e:
            out[name] = (type(e).__name__, str(e))
        else:
            out[name] = (None, None)

    attempt("optimizer", lambda: tpamp.MixedPrecisionOptimizer(
        torch.optim.SGD([p], lr=0.1), grad_stats_group=group01))
    attempt("fp32_optimizer", lambda: tpamp.FP32Optimizer(
        torch.optim.SGD([p], lr=0.1), grad_stats_group=group01))
    attempt("optimizer_tp", lambda: tpamp.MixedPrecisionOptimizer(
        torch.optim.SGD([p], lr=0.1), tensor_parallel_group=group01))
    attempt("grad_norm", lambda: tpamp.get_grad_norm_fp32([p.grad], 2.0, group01))
    attempt("grad_norm_kw", lambda: tpamp.get_grad_norm_fp32([p.grad], grad_stats_group=group01))
    attempt("count_zeros", lambda: tpamp.count_zeros_fp32([p], grad_stats_group=group01))
    attempt("count_zeros_tp", lambda: tpamp.count_zeros_fp32([p], tensor_parallel_group=group01))
    attempt("filter_tp", lambda: tpamp.filter_grads_for_norm([p], tensor_parallel_group=group01))
    attempt("mp_grad_scaler", lambda: tpamp.ModelParallelGradScaler(
        "cpu", model_parallel_group=group01))
    attempt("torch_amp_optimizer", lambda: tpamp.TorchAMPOptimizer(
        torch.optim.SGD([p], lr=0.1), tpamp.ModelParallelGradScaler("cpu"),
        grad_stats_group=group01))
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def not_member_results():
    results = run_workers(_not_member_checks, 4)
    assert results[0] == {"member_ok": True}
    return results[2]


@pytest.mark.parametrize(
    "case,group_name",
    [
        ("optimizer", "grad_stats_group"),
        ("fp32_optimizer", "grad_stats_group"),
        ("grad_norm", "grad_stats_group"),
        ("grad_norm_kw", "grad_stats_group"),
        ("count_zeros", "grad_stats_group"),
        ("optimizer_tp", "tensor_parallel_group"),
        ("count_zeros_tp", "tensor_parallel_group"),
        ("filter_tp", "tensor_parallel_group"),
        ("mp_grad_scaler", "model_parallel_group"),
        ("torch_amp_optimizer", "grad_stats_group"),
    ],
)
def test_group_this_rank_is_not_in_raises_value_error_naming_it(not_member_results, case, group_name):
    kind, msg = not_member_results[case]
    assert kind == "ValueError", (case, kind, msg)
    assert group_name in msg, msg
