"""Non-finite attribution in one process and the logs of it (tpamp/nonfinite.py, docs/spec.md
section 5): names, the records a step leaves, the JSONL record, the line, TensorBoard, the plot,
and the activation tracer (single process and a 2-stage pipeline)."""

from __future__ import annotations

import io
import json
import math
import os

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_workers
from misuse_utils import refused_construction

import tpamp
from tpamp.nonfinite import NonFiniteGrad, NonFiniteTracer, describe


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).half()


def _grads(model, value=0.5):
    for p in model.parameters():
        p.grad = torch.full_like(p, value)


# -- optimizer records -----------------------------------------------------------------------


@pytest.mark.parametrize("fused", [True, False])
def test_skipped_step_names_the_param_and_counts(fused):
    model = _model()
    opt = tpamp.MixedPrecisionOptimizer(
        torch.optim.AdamW(model.parameters(), lr=0.1), grad_scaler=tpamp.ConstantGradScaler(8.0),
        param_names=model.named_parameters(), fused_step=fused,
    )
    _grads(model)
    assert opt.step().update_successful and opt.last_nonfinite == []
    _grads(model)
    model[1].weight.grad[0, 1] = math.inf
    model[1].weight.grad[1, 2] = -math.inf
    model[0].bias.grad[3] = math.nan
    before = [p.detach().clone() for p in model.parameters()]
    ok, norm, zeros = opt.step()  # still Megatron's 3-tuple
    assert (ok, norm, zeros) == (False, None, None)
    # backward order (the last layer first); no parallel state: tp 0, pp and dp unknown
    assert opt.last_nonfinite == [
        NonFiniteGrad("1.weight", 0, None, None, 2, 0, 0),
        NonFiniteGrad("0.bias", 0, None, None, 0, 1, 0),
    ]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert describe(opt.last_nonfinite) == "inf in 1.weight [tp 0, pp ?, dp ?] and 1 more"


def test_unnamed_params_get_group_and_index_names():
    a, b, c = (torch.nn.Parameter(torch.ones(2, dtype=torch.float16)) for _ in range(3))
    opt = tpamp.MixedPrecisionOptimizer(
        torch.optim.SGD([{"params": [a, b]}, {"params": [c]}], lr=0.1),
        grad_scaler=tpamp.ConstantGradScaler(1.0), param_names=[("first", a)],
    )
    assert [n for n, _ in opt.named_model_params()] == ["first", "group0.param1", "group1.param0"]
    for p in (a, b, c):
        p.grad = torch.ones_like(p)
    c.grad[1] = math.nan
    opt.step()
    assert [r.name for r in opt.last_nonfinite] == ["group1.param0"]


@pytest.mark.parametrize("bad", [42, [("x", 1.0)], [(1, torch.ones(1))], {"p": "name"}])
def test_bad_param_names_are_refused_before_anything_changes(bad):
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="param_names must be"):
        tpamp.MixedPrecisionOptimizer(inner, grad_scaler=tpamp.ConstantGradScaler(1.0), param_names=bad)
    assert all(p.dtype == torch.float16 for g in inner.param_groups for p in g["params"])


def test_bad_parallel_state_is_refused():
    model = _model()
    with pytest.raises(TypeError, match="parallel_state must be a tpamp.parallel.ParallelState"):
        tpamp.MixedPrecisionOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            grad_scaler=tpamp.ConstantGradScaler(1.0), parallel_state=(0, 0, 0),
        )


def test_not_skipped_nonfinite_step_is_attributed_and_sync_free_is_not():
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = tpamp.MixedPrecisionOptimizer(
        torch.optim.SGD([p], lr=0.1), skip_nonfinite=False, param_names=[("w", p)],
    )
    p.grad = torch.tensor([1.0, math.inf, 2.0, math.inf], dtype=torch.bfloat16)
    assert opt.step().update_successful  # taken on purpose (skip_nonfinite=False)
    assert opt.last_nonfinite == [NonFiniteGrad("w", 0, None, None, 2, 0, 0)]

    q = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    opt2 = tpamp.MixedPrecisionOptimizer(
        torch.optim.SGD([q], lr=0.1, fused=True), grad_scaler=tpamp.ConstantGradScaler(1.0),
        sync_free=True,
    )
    q.grad = torch.full_like(q, math.nan)
    opt2.step()
    assert opt2.last_nonfinite is None  # no host read in a sync-free step: not determined


def test_spike_skip_has_no_nonfinite_records():
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    det = tpamp.SpikeDetector("skip", threshold=3.0, window=8, warmup=4)
    opt = tpamp.MixedPrecisionOptimizer(
        torch.optim.SGD([p], lr=1e-6), grad_scaler=tpamp.ConstantGradScaler(1.0),
        spike_detector=det,
    )
    for i in range(6):
        p.grad = torch.full_like(p, 1.0 + 0.01 * (i % 2))
        assert opt.step().update_successful
    p.grad = torch.full_like(p, 1000.0)
    assert not opt.step().update_successful and det.last.skipped
    assert opt.last_nonfinite == []


@pytest.mark.parametrize("fused", [True, False])
def test_param_grad_norms_on_both_paths_equal_fp64(fused):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3)).half()
    opt = tpamp.MixedPrecisionOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3), grad_scaler=tpamp.ConstantGradScaler(64.0),
        param_names=model.named_parameters(), fused_step=fused,
    )
    tracker = opt.track_param_grad_norms()  # the construction's names
    grads = {n: (torch.randn(p.shape) * 64).half() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.grad = grads[n].clone()
    result = opt.step(param_grad_norms=True)
    ref = {n: float((g.double() / 64.0).norm()) for n, g in grads.items()}
    assert list(tracker.norms) == list(ref)
    for n in ref:
        assert math.isclose(tracker.norms[n], ref[n], rel_tol=1e-6), n
    assert math.isclose(result.grad_norm, math.sqrt(sum(v * v for v in ref.values())), rel_tol=1e-6)
    # the one-pass path makes no fp32 main grads: it was the path taken
    assert all((p.grad is None) == fused for g in opt.param_groups for p in g["params"])


# -- logs ------------------------------------------------------------------------------------


def _culprits(n):
    return [NonFiniteGrad(f"blocks.{i}.mlp.fc2.weight", 1, 1, 0, 3 + i, 0, 6) for i in range(n)]


def test_logger_record_line_and_summary(tmp_path):
    out = io.StringIO()
    log = tpamp.TrainingLogger(4, log_interval=2, jsonl_path=str(tmp_path / "log.jsonl"), stream=out)
    log.record(1, 2.0, 1e-3, 65536.0, tpamp.StepResult(False, None, None), nonfinite=_culprits(1))
    log.record(2, 2.0, 1e-3, 32768.0, tpamp.StepResult(False, None, None), nonfinite=_culprits(20))
    log.record(3, 1.9, 1e-3, 32768.0, tpamp.StepResult(True, 0.5, None), nonfinite=[])
    log.record(4, 1.8, 1e-3, 32768.0, tpamp.StepResult(True, 0.4, None))
    log.close()
    lines = out.getvalue().splitlines()
    # iteration 1 is between intervals: its own line, at once
    assert lines[0].endswith("| skipped: inf in blocks.0.mlp.fc2.weight [tp 1, pp 1, dp 0] |")
    assert lines[0].startswith(" iteration        1/       4 |")
    assert lines[1].endswith(
        "| skipped: inf in blocks.0.mlp.fc2.weight [tp 1, pp 1, dp 0] and 19 more |"
    )
    assert "skipped:" not in lines[2] and len(lines) == 3
    recs = [json.loads(x) for x in open(tmp_path / "log.jsonl")]
    assert recs[0]["nonfinite"] == {
        "total": 1,
        "first": [{"name": "blocks.0.mlp.fc2.weight", "tp_rank": 1, "pp_rank": 1, "dp_rank": 0,
                   "num_inf": 3, "num_nan": 0, "rank": 6}],
    }
    assert recs[1]["nonfinite"]["total"] == 20 and len(recs[1]["nonfinite"]["first"]) == 16
    assert [r["name"] for r in recs[1]["nonfinite"]["first"]] == [f"blocks.{i}.mlp.fc2.weight" for i in range(16)]
    assert "nonfinite" not in recs[2] and "nonfinite" not in recs[3]
    assert log.summary()["nonfinite_culprits"] == [["blocks.0.mlp.fc2.weight", 2]]


def test_logger_refuses_a_bad_nonfinite_before_counting():
    log = tpamp.TrainingLogger(2, stream=io.StringIO())
    with pytest.raises(TypeError, match="nonfinite must be"):
        log.record(1, 1.0, 1e-3, 1.0, (False, None, None), nonfinite="fc.weight")
    with pytest.raises(TypeError, match=r"nonfinite\[0\] is not"):
        log.record(1, 1.0, 1e-3, 1.0, (False, None, None), nonfinite=[("fc.weight",)])
    assert log.skipped_iters == 0


def test_tensorboard_gets_the_count(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = tpamp.TrainingLogger(3, log_interval=3, tensorboard_dir=str(tmp_path), stream=io.StringIO())
    log.record(1, 2.0, 1e-3, 8.0, (False, None, None), nonfinite=_culprits(3))
    log.record(2, 2.0, 1e-3, 4.0, (True, 1.0, None), nonfinite=[])
    log.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("nonfinite-params")] == [(1, 3.0), (2, 0.0)]


def test_plot_labels_overflow_skips_with_the_culprit(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    from tpamp import plot

    log = tpamp.TrainingLogger(4, log_interval=4, jsonl_path=str(tmp_path / "log.jsonl"), stream=io.StringIO())
    log.record(1, 2.0, 1e-3, 8.0, (True, 1.0, None))
    log.record(2, 2.0, 1e-3, 8.0, (False, None, None), nonfinite=_culprits(3))
    log.record(3, 1.9, 1e-3, 4.0, (True, 0.9, None))
    log.close()
    texts = []
    real = matplotlib.axes.Axes.annotate
    monkeypatch.setattr(matplotlib.axes.Axes, "annotate",
                        lambda self, text, *a, **k: texts.append(text) or real(self, text, *a, **k))
    out = str(tmp_path / "plot.png")
    assert plot.main([str(tmp_path / "log.jsonl"), "-o", out]) == 0
    assert texts == ["blocks.0.mlp.fc2.weight [tp 1, pp 1, dp 0] +2"]
    assert os.path.getsize(out) > 1000


# -- activation tracer -----------------------------------------------------------------------


def _mlp(scale_layer=None, factor=1.0):
    torch.manual_seed(3)
    m = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
        torch.nn.Linear(16, 4),
    ).half()
    if scale_layer is not None:
        with torch.no_grad():
            m[scale_layer].weight.mul_(factor)
    return m


def test_tracer_names_the_layer_whose_fp16_output_overflows():
    m = _mlp(scale_layer=2, factor=1e5)
    x = torch.randn(5, 8).half()
    with NonFiniteTracer(m) as tracer:
        m(x).float().sum().backward()
    f = tracer.first
    assert (f.module, f.phase, f.tensor, f.micro_batch) == ("2", "forward", "output", 0)
    assert f.problem in ("inf", "near overflow") and f.dtype == "float16"
    assert not tracer.attached


def test_tracer_finds_a_backward_overflow_and_a_clean_run_reports_nothing():
    m = _mlp()
    x = torch.randn(5, 8).half()
    with NonFiniteTracer(m, names=lambda n: f"net.{n}" if n else "net") as tracer:
        m(x).float().sum().backward()
    assert tracer.first is None and tracer.result() is None
    with NonFiniteTracer(m, names=lambda n: f"net.{n}" if n else "net") as tracer:
        (m(x).float().sum() * 1e6).backward()  # the loss scale too large: grads overflow
    f = tracer.first
    # backward reaches the last layer first: the grad w.r.t. its output is 1e6 -> inf in fp16
    assert (f.module, f.phase, f.tensor) == ("net.4", "backward", "grad_output")
    assert f.problem in ("inf", "near overflow")


@pytest.mark.parametrize("margin,error,match", [
    (0.5, ValueError, "margin must be > 1.0, got 0.5"),
    (1, ValueError, "margin must be > 1.0, got 1.0"),
    (float("inf"), ValueError, "margin must be finite, got inf"),
    ("2", TypeError, "margin must be a real number or None, got '2'"),
])
def test_tracer_refuses_a_bad_margin(margin, error, match):
    with pytest.raises(error, match=match):
        NonFiniteTracer(_mlp(), margin=margin)


def _pipeline_worker(rank, world):
    """2 pipeline stages (1 rank each); stage 1's second layer is scaled to overflow in fp16 in
    every micro-batch; stage 0 only overflows on micro-batch 1 (a scaled input): the earliest
    along the pipeline is stage 1's forward of micro-batch 0."""
    st = tpamp.parallel.initialize_model_parallel(1, 2)
    torch.manual_seed(7 + st.pp_rank)
    stage = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).half()
    if st.pp_rank == 1:  # layers.2 = x + 1 (about 1), layers.3 = 6e4 x sum: > fp16's max
        with torch.no_grad():
            stage[0].weight.copy_(torch.eye(8))
            stage[0].bias.fill_(1.0)
            stage[1].weight.fill_(6e4)
    layer0 = 2 * st.pp_rank
    names = lambda n: f"layers.{layer0 + int(n)}" if n else f"stage{st.pp_rank}"
    tracer = NonFiniteTracer(stage, names=names, parallel_state=st)
    tracer.attach()
    for mb in range(2):
        if st.pp_rank == 0:
            x = torch.randn(4, 8).half() * (1e5 if mb == 1 else 1.0)
            dist.send(stage(x).detach(), dst=1)
        else:
            x = torch.empty(4, 8, dtype=torch.float16)
            dist.recv(x, src=0)
            stage(x)
    tracer.detach()
    return tuple(tracer.first) if tracer.first else None, tuple(tracer.result(dist.group.WORLD))


def test_tracer_agrees_on_the_earliest_finding_along_the_pipeline():
    results = run_workers(_pipeline_worker, 2, timeout=60)
    own0, own1 = results[0][0], results[1][0]
    assert own0[:4] == ("layers.0", "forward", "output", 1)  # stage 0: only micro-batch 1
    assert own1[:4] == ("layers.3", "forward", "output", 0)
    for _, agreed in results:
        assert agreed[:4] == ("layers.3", "forward", "output", 0)
        assert agreed[7:10] == (0, 1, 0)  # tp, pp, dp of stage 1's rank


# ---- names for last_nonfinite: the grad-norm tracker's rules, in every wrapper -------------------


def _names_cases():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)).to(torch.bfloat16)
    w0, b0, w1, b1 = model.parameters()
    return model, [
        ("duplicate-name", [("w", w0), ("w", b0), ("x", w1), ("y", b1)],
         ["'w'", "two different params"]),
        ("empty-name", [("", w0), ("b0", b0)], ["non-empty", "''"]),
        ("two-names", [("a", w0), ("b", w0)], ["named both", "'a'", "'b'"]),
        ("dict-duplicate", {w0: "same", b0: "same"}, ["'same'", "two different params"]),
    ]


@pytest.mark.parametrize("case", [c[0] for c in _names_cases()[1]])
def test_param_names_for_last_nonfinite_are_checked_as_the_tracker_checks_them(case):
    from tpamp.nonfinite import param_name_map

    model, cases = _names_cases()
    names, words = {c[0]: (c[1], c[2]) for c in cases}[case]
    inner = torch.optim.AdamW(model.parameters(), lr=0.1)
    refused_construction(
        lambda: tpamp.MixedPrecisionOptimizer(inner, param_names=names), inner,
        list(model.parameters()), ValueError, ["param_names", *words])
    with pytest.raises(ValueError, match="param_names"):
        param_name_map(names)
    # the tracker refuses the same names
    if not isinstance(names, dict):
        opt = tpamp.MixedPrecisionOptimizer(inner)
        with pytest.raises(ValueError):
            opt.track_param_grad_norms(names)


def test_param_names_accepts_named_parameters_and_a_repeated_pair():
    from tpamp.nonfinite import param_name_map

    model = torch.nn.Linear(3, 2)
    pairs = list(model.named_parameters())
    assert param_name_map(pairs + pairs[:1]) == {id(p): n for n, p in pairs}


def _dist_names_worker(rank, world_size):
    import torch.distributed as dist

    from tpamp._guards import wrapped_by

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)).to(torch.bfloat16)
    w0, b0, w1, b1 = model.parameters()
    inner = torch.optim.AdamW(model.parameters(), lr=0.1)
    dp = dist.new_group(list(range(world_size)))
    out = []
    for names in ([("w", w0), ("w", b0), ("x", w1), ("y", b1)], [("", w0)]):
        try:
            tpamp.DistributedOptimizer(inner, data_parallel_group=dp, param_names=names)
            out.append(None)
        except ValueError as e:
            out.append(str(e))
    return out, wrapped_by(inner) is None


def test_distributed_optimizer_param_names_are_checked_too():
    """The same rules in DistributedOptimizer (DP 2, forked gloo ranks), nothing wrapped."""
    from dist_utils import run_workers

    for msgs, unwrapped in run_workers(_dist_names_worker, 2, timeout=60.0):
        assert unwrapped
        assert msgs[0] is not None and "'w'" in msgs[0] and "two different params" in msgs[0]
        assert msgs[1] is not None and "non-empty" in msgs[1]
