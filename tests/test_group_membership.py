"""A group this rank is not a member of is refused, naming the argument (docs/spec.md sections
1-3): one 4-rank gloo run (tests/dist_utils) tries every public constructor and function that
takes a process group (the optimizer wrappers, the grad statistics, ModelParallelGradScaler,
TorchAMPOptimizer, TensorParallelMuon, TensorParallelAdafactor) on a rank outside the group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_workers

import tpamp


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
    attempt("tp_muon", lambda: tpamp.TensorParallelMuon(
        [torch.nn.Parameter(torch.zeros(2, 2))], tensor_parallel_group=group01))
    attempt("tp_adafactor", lambda: tpamp.TensorParallelAdafactor(
        [torch.nn.Parameter(torch.zeros(2, 2))], tensor_parallel_group=group01))
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
        ("tp_muon", "tensor_parallel_group"),
        ("tp_adafactor", "tensor_parallel_group"),
    ],
)
def test_group_this_rank_is_not_in_raises_value_error_naming_it(not_member_results, case, group_name):
    kind, msg = not_member_results[case]
    assert kind == "ValueError", (case, kind, msg)
    assert group_name in msg, msg
