"""MixedPrecisionOptimizer under model parallelism: every rank takes the same skip decision,
ranks without params or grads join every collective, and a resumed run is bit-identical."""

import io
import math

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_workers
from model_fixture import full_grads, isclose, reference_stats, round_to, shard_params

import tpamp
from tpamp.parallel import initialize_model_parallel


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _inf_on_one_rank(rank, world, bad_rank, bad_value, style):
    st = initialize_model_parallel(2, 2)
    grads = round_to(full_grads(seed=4), torch.float16)
    params = shard_params(st, grads, style=style, dtype=torch.float16, grad_scale=256.0)
    scaler = tpamp.DynamicGradScaler(initial_scale=256.0, hysteresis=1, growth_interval=1000)
    opt = tpamp.MixedPrecisionOptimizer(
        torch.optim.AdamW(list(params.values()), lr=0.1),
        grad_scaler=scaler,
        clip_grad=1.0,
        grad_stats_group=st.grad_stats_group,
        tensor_parallel_group=st.tp_group,
    )
    before = {k: _local(p).detach().clone() for k, p in params.items()}
    if rank == bad_rank:
        name = sorted(params)[-1]
        _local(params[name].grad).view(-1)[-1] = bad_value
    # the data-parallel gradient all-reduce spreads the bad value to the DP peers, as in training
    for p in params.values():
        dist.all_reduce(_local(p.grad), group=st.dp_group)
        _local(p.grad).div_(st.dims.dp)
    first = opt.step()
    unchanged = all(torch.equal(_local(p).detach(), before[k]) for k, p in params.items())
    scale_after_skip = float(scaler.scale)
    # a clean step then proceeds
    opt.zero_grad()
    for k, p in params.items():
        p.grad = torch.ones_like(p)
    second = opt.step()
    changed = all(not torch.equal(_local(p).detach(), before[k]) for k, p in params.items())
    return tuple(first), unchanged, scale_after_skip, scaler.hysteresis_tracker, second.update_successful, changed


@pytest.mark.parametrize("style", ["megatron", "dtensor"])
@pytest.mark.parametrize("bad_rank,bad_value", [(0, math.inf), (5, math.nan), (7, -math.inf), (2, math.nan)])
def test_inf_or_nan_on_one_rank_skips_the_step_on_every_rank(bad_rank, bad_value, style):
    results = run_workers(_inf_on_one_rank, 8, bad_rank, bad_value, style)
    for rank, (first, unchanged, scale, hyst, second_ok, changed) in enumerate(results):
        assert first == (False, None, None), rank
        assert unchanged, f"rank {rank} changed its params on a skipped step"
        assert scale == 128.0, (rank, scale)  # hysteresis=1: backed off at once, 256 * 0.5
        assert hyst == 0
        assert second_ok and changed, rank


def _empty_ranks(rank, world):
    # PP=4, TP=1: stages 1 and 2 own none of the toy model. Stage 1 has no params at all,
    # stage 2 a param that never gets a grad. Every rank must still join each collective.
    st = initialize_model_parallel(1, 4)
    grads = round_to(full_grads(seed=5), torch.float16)
    params = list(shard_params(st, grads, style="megatron", dtype=torch.float16, grad_scale=8.0).values())
    if st.pp_rank == 2:
        params = [torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))]
    opt = tpamp.MixedPrecisionOptimizer(
        torch.optim.SGD([{"params": params}], lr=0.0),
        grad_scaler=tpamp.DynamicGradScaler(initial_scale=8.0, hysteresis=1),
        log_num_zeros_in_grad=True,
        grad_stats_group=st.grad_stats_group,
        tensor_parallel_group=st.tp_group,
    )
    first = opt.step()
    # zero_grad as a training loop does: without it the ranks that consumed grads in the first
    # step and have no new ones would be refused by the step guard (no backward since the step)
    opt.zero_grad()
    # an overflow on the last stage only: the empty ranks skip too
    if st.pp_rank == 3:
        params[0].grad = torch.full_like(params[0], math.inf)
    second = opt.step()
    return tuple(first), tuple(second), float(opt.get_loss_scale())


def test_ranks_without_params_or_grads_join_every_collective():
    ref_l2, _, _, ref_zeros = reference_stats(round_to(full_grads(seed=5), torch.float16))
    results = run_workers(_empty_ranks, 4, timeout=20)
    for rank, (first, second, scale) in enumerate(results):
        ok, norm, zeros = first
        assert ok and isclose(norm, ref_l2) and zeros == ref_zeros, (rank, first)
        assert second == (False, None, None), (rank, second)
        assert scale == 4.0


def _build(st, seed):
    """A TP=2 MLP (torch tensor parallel on DTensors) in fp16 with an fp32 LayerNorm."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8), torch.nn.LayerNorm(8)
    )
    parallelize_module(model, st.tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    model[0].half()
    model[2].half()
    return model


def _train(model, opt, st, steps, start, inf_steps):
    results = []
    for it in range(start, start + steps):
        g = torch.Generator().manual_seed(100 + it)
        x = torch.randn(4, 8, generator=g).half()
        y = torch.randn(4, 8, generator=g)
        h = model[2](model[1](model[0](x)))
        out = model[3](h.float())
        loss = ((out - y) ** 2).mean()
        opt.scale_loss(loss).backward()
        if it in inf_steps and st.tp_rank == 1:
            model[0].weight.grad.to_local().view(-1)[0] = math.inf
        results.append(tuple(opt.step()))
        opt.zero_grad()
    return results


def _resume(rank, world):
    st = initialize_model_parallel(2, 1)
    kwargs = dict(clip_grad=0.5, log_num_zeros_in_grad=True,
                  grad_stats_group=st.grad_stats_group, tensor_parallel_group=st.tp_group)
    inf_steps = {2, 6}

    def make(seed):
        model = _build(st, seed)
        scaler = tpamp.DynamicGradScaler(initial_scale=2.0**10, growth_interval=3, hysteresis=2)
        opt = tpamp.MixedPrecisionOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-2), grad_scaler=scaler, **kwargs)
        return model, opt

    model, opt = make(0)
    full = _train(model, opt, st, 8, 0, inf_steps)
    want = {k: _local(v).detach().clone() for k, v in model.state_dict().items()}
    want_scaler = opt.grad_scaler.state_dict()

    model, opt = make(0)
    part = _train(model, opt, st, 4, 0, inf_steps)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buf)
    del model, opt
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=False)
    model, opt = make(seed=123)  # different init: everything must come from the checkpoint
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    part += _train(model, opt, st, 4, 4, inf_steps)
    got = {k: _local(v).detach() for k, v in model.state_dict().items()}
    same = all(torch.equal(got[k], want[k]) for k in want)
    scaler_same = opt.grad_scaler.state_dict() == {**want_scaler, "scale": opt.grad_scaler.state_dict()["scale"]} and torch.equal(
        opt.grad_scaler.state_dict()["scale"], want_scaler["scale"])
    return full, part, same, scaler_same


def test_resumed_run_equals_uninterrupted_run_bit_for_bit():
    results = run_workers(_resume, 2)
    for rank, (full, part, same, scaler_same) in enumerate(results):
        assert full == part, (rank, full, part)
        assert [r[0] for r in full].count(False) >= 1  # the trace really skipped a step
        assert same, f"rank {rank}: params differ after resume"
        assert scaler_same


def _replicate_grad_for_sharded_param(rank, world):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    st = initialize_model_parallel(2, 1)
    full = torch.arange(8.0).reshape(4, 2)
    grad_full = torch.arange(8.0).reshape(4, 2) / 8
    p = torch.nn.Parameter(DTensor.from_local(full.chunk(2)[rank].half(), st.tp_mesh, [Shard(0)]))
    # as DTensor's embedding backward gives it: the full grad, replicated
    p.grad = DTensor.from_local(grad_full.half(), st.tp_mesh, [Replicate()])
    opt = tpamp.MixedPrecisionOptimizer(
        torch.optim.SGD([p], lr=1.0), grad_scaler=tpamp.ConstantGradScaler(1.0),
        grad_stats_group=st.grad_stats_group, tensor_parallel_group=st.tp_group)
    ok, norm, _ = opt.step()
    return ok, norm, p.to_local().detach().float(), (full - grad_full).chunk(2)[rank]


def test_dtensor_grad_with_other_placements_is_placed_like_its_param():
    for ok, norm, got, want in run_workers(_replicate_grad_for_sharded_param, 2):
        assert ok and isclose(norm, float((torch.arange(8.0) / 8).norm()))
        assert torch.equal(got, want)
