"""tpamp.pipelining: PipelineLoss (microbatch division and loss scale inside a schedule's
loss_fn, scale_grads=False) and NoSyncPipelineStage (no_sync for all but the last backward of
a step), against a single-process reference computed by hand with plain autograd."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tpamp
from tests.dist_utils import run_workers
from tpamp.pipelining import NoSyncPipelineStage, PipelineLoss

M, MB, H, SCALE = 4, 3, 8, 8.0


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(H, H), nn.Tanh(), nn.Linear(H, H), nn.Tanh(),
                         nn.Linear(H, H), nn.Tanh(), nn.Linear(H, H))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(M * MB, H, generator=g), torch.randn(M * MB, H, generator=g)


def _optimizer(params, scale=SCALE):
    return tpamp.FP32Optimizer(torch.optim.SGD(params, lr=0.1),
                               grad_scaler=tpamp.ConstantGradScaler(scale))


def test_pipeline_loss_divides_by_the_microbatches_and_applies_the_loss_scale():
    opt = _optimizer([nn.Parameter(torch.zeros(2))], scale=SCALE)
    loss = PipelineLoss(F.mse_loss, M, opt)
    out, target = torch.tensor([1.0, 2.0]), torch.tensor([0.0, 0.0])
    got = loss(out, target)
    assert got.item() == pytest.approx((1.0 + 4.0) / 2 / M * SCALE, rel=1e-7)
    assert loss.unscale([got])[0].item() == pytest.approx(2.5, rel=1e-7)
    # the scale the losses were multiplied by, passed explicitly
    assert loss.unscale([got * 2], torch.tensor([2 * SCALE]))[0].item() == pytest.approx(2.5)
    plain = PipelineLoss(F.mse_loss, M)  # no optimizer: scale 1
    assert plain(out, target).item() == pytest.approx(2.5 / M)
    assert plain.loss_scale().item() == 1.0


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(loss_fn=3, num_microbatches=2), TypeError, "loss_fn must be callable"),
        (dict(loss_fn=F.mse_loss, num_microbatches="2"), TypeError, "num_microbatches.*str '2'"),
        (dict(loss_fn=F.mse_loss, num_microbatches=True), TypeError, "num_microbatches.*bool"),
        (dict(loss_fn=F.mse_loss, num_microbatches=0), ValueError, "num_microbatches must be >= 1, got 0"),
    ],
)
def test_pipeline_loss_refuses_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        PipelineLoss(**kwargs)


def test_pipeline_loss_refuses_a_loss_that_is_not_a_float_tensor():
    loss = PipelineLoss(lambda o, t: torch.tensor(3), 2)
    with pytest.raises(TypeError, match="floating-point tensor, got Tensor of torch.int64"):
        loss(torch.zeros(1), torch.zeros(1))


def test_no_sync_stage_refuses_a_no_sync_that_is_not_callable():
    with pytest.raises(TypeError, match="no_sync must be callable or None, got int"):
        NoSyncPipelineStage(nn.Linear(2, 2), 0, 1, torch.device("cpu"), no_sync=3)


def _reference():
    """Plain autograd on the whole model: the mean of the M microbatch losses, times SCALE."""
    model = _model()
    x, y = _data()
    losses = [F.mse_loss(model(xb), yb) for xb, yb in zip(x.split(MB), y.split(MB))]
    (torch.stack(losses).mean() * SCALE).backward()
    return [v.item() for v in losses], {n: p.grad.clone() for n, p in model.named_parameters()}


def _two_stage_worker(rank, world, schedule_name):
    from torch.distributed.pipelining.schedules import get_schedule_class

    full = _model()
    part = nn.Sequential(*list(full)[:4]) if rank == 0 else nn.Sequential(*list(full)[4:])
    offset = 0 if rank == 0 else 4
    opt = _optimizer(list(part.parameters()))
    entered = []

    @contextlib.contextmanager
    def no_sync():
        entered.append(1)
        yield

    example_in = torch.empty(MB, H, requires_grad=rank == 1)
    example_out = torch.empty(MB, H, requires_grad=True)
    stage = NoSyncPipelineStage(part, rank, world, torch.device("cpu"), input_args=(example_in,),
                                output_args=(example_out,), no_sync=no_sync)
    loss = PipelineLoss(F.mse_loss, M, opt)
    schedule = get_schedule_class(schedule_name)(stage, n_microbatches=M, loss_fn=loss,
                                                 scale_grads=False)
    x, y = _data()
    losses = []
    if rank == 0:
        schedule.step(x)
    else:
        schedule.step(target=y, losses=losses)
    grads = {f"{int(n.split('.')[0]) + offset}.{n.split('.', 1)[1]}": p.grad.clone()
             for n, p in part.named_parameters()}
    return [v.item() for v in loss.unscale(losses)], grads, len(entered)


@pytest.mark.parametrize("schedule_name", ["1F1B", "GPipe"])
def test_two_stage_schedule_matches_plain_autograd(schedule_name):
    ref_losses, ref_grads = _reference()
    results = run_workers(_two_stage_worker, 2, schedule_name, timeout=60)
    assert results[0][0] == [] and results[1][0] == pytest.approx(ref_losses, rel=1e-6)
    got = {**results[0][1], **results[1][1]}
    assert set(got) == set(ref_grads)
    for name, ref in ref_grads.items():  # the grads of SCALE * mean loss: no 1/M left out
        torch.testing.assert_close(got[name], ref, rtol=1e-5, atol=1e-6, msg=name)
    # every backward but the last of the step ran under no_sync, on each stage
    assert [r[2] for r in results] == [M - 1, M - 1]


@pytest.mark.parametrize("optimizer, name", [
    ("adam", "str"),
    (torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1), "SGD"),
    (3.0, "float"),
])
def test_pipeline_loss_refuses_an_optimizer_without_a_loss_scale(optimizer, name):
    """main e82d3a5: accepted, then a raw AttributeError at the first call."""
    with pytest.raises(TypeError, match=rf"optimizer must be a tpamp optimizer .*\({name}\)"):
        PipelineLoss(F.mse_loss, M, optimizer)


def test_pipeline_loss_unscale_takes_a_number_scale_and_refuses_a_bad_one():
    """main e82d3a5: a float loss_scale raised a raw AttributeError ('float' has no reshape)."""
    loss = PipelineLoss(F.mse_loss, M)
    losses = [torch.tensor(2.5 / M * 8.0), torch.tensor(1.0 / M * 8.0)]
    # an independent reference: x * M / scale by hand
    assert [x.item() for x in loss.unscale(losses, 8.0)] == [2.5, 1.0]
    assert [x.item() for x in loss.unscale(losses, 8)] == [2.5, 1.0]
    for bad, exc, words in [(math.nan, ValueError, "loss_scale must be not nan"),
                            (0.0, ValueError, "loss_scale must be finite and > 0"),
                            (1e39, ValueError, "float32"),
                            ("8", TypeError, "loss_scale must be a real number"),
                            (torch.ones(2), TypeError, r"loss_scale must be a number or a one-element")]:
        with pytest.raises(exc, match=words):
            loss.unscale(losses, bad)
    with pytest.raises(TypeError, match=r"losses\[1\] must be a tensor, got 2.0"):
        loss.unscale([losses[0], 2.0], 8.0)
    with pytest.raises(TypeError, match="losses must be a list"):
        loss.unscale(losses[0], 8.0)
