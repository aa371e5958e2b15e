"""The logs a user reads (docs/spec.md section 5)."""

import io
import json
import math

import pytest
import torch
from misuse_utils import assert_every_case_refused_by_tpamp, assert_raises_naming, case_ids

import tpamp


def _run(tmp_path, tb=False):
    out = io.StringIO()
    log = tpamp.TrainingLogger(
        6, log_interval=3, jsonl_path=str(tmp_path / "sub" / "log.jsonl"),
        tensorboard_dir=str(tmp_path / "tb") if tb else None, stream=out,
    )
    steps = [
        (1, 2.0, 65536.0, tpamp.StepResult(True, 1.5, 10)),
        (2, 1.9, 65536.0, tpamp.StepResult(False, None, None)),
        (3, math.nan, 32768.0, tpamp.StepResult(False, None, None)),
        (4, 1.7, 32768.0, tpamp.StepResult(True, 0.5, None)),
        (5, 1.6, 32768.0, tpamp.StepResult(True, 0.4, 7)),
        (6, 1.5, 65536.0, tpamp.StepResult(True, 0.3, 3)),
    ]
    for it, loss, scale, res in steps:
        log.record(it, loss, 1e-3, scale, res)
    log.close()
    return log, out.getvalue(), steps


def test_jsonl_has_a_record_per_iteration_with_spec_fields(tmp_path):
    log, _, steps = _run(tmp_path)
    recs = [json.loads(line) for line in open(tmp_path / "sub" / "log.jsonl")]
    assert [r["iteration"] for r in recs] == [s[0] for s in steps]
    for r, (it, loss, scale, res) in zip(recs, steps):
        assert set(r) >= {"iteration", "loss", "lr", "loss_scale", "grad_norm", "num_zeros", "skipped", "nan"}
        assert r["skipped"] is (not res.update_successful)
        assert r["grad_norm"] == res.grad_norm and r["num_zeros"] == res.num_zeros_in_grad
        assert r["loss_scale"] == scale and r["lr"] == 1e-3
        assert r["nan"] is (not math.isfinite(loss))
        assert r["loss"] == (loss if math.isfinite(loss) else None)
    assert log.skipped_iters == 2 and log.nan_iters == 1 and log.loss_scale_changes == 2


def test_megatron_line_every_log_interval(tmp_path):
    _, text, _ = _run(tmp_path)
    lines = text.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(" iteration        3/       6 |")
    assert "loss scale: 32768.0 |" in lines[0]
    assert "number of skipped iterations:   2 |" in lines[0]
    assert "number of nan iterations:   1 |" in lines[0]
    assert "grad norm: 0.300 | num zeros: 3 |" in lines[1]
    assert "number of skipped iterations:   0 |" in lines[1]


def test_tensorboard_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _run(tmp_path, tb=True)
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss-scale", "grad-norm", "num-zeros"} <= tags
    assert [e.step for e in acc.Scalars("grad-norm")] == [1, 4, 5, 6]
    assert [e.value for e in acc.Scalars("num-zeros")] == [10, 7, 3]


def test_bad_log_interval_is_rejected():
    with pytest.raises(ValueError, match="log_interval must be an int >= 1, got 0"):
        tpamp.TrainingLogger(10, log_interval=0)


# ---- misuse: each bad argument or loaded value raises the documented exception type, with a
# message that names the argument or key (docs/spec.md section 14); runner: tests/misuse_utils.py


def _logger_record(*args, **extra):
    defaults = [1, 2.5, 1e-3, 1024.0, tpamp.StepResult(True, 0.5, None)]
    for i, a in enumerate(args):
        if a is not _KEEP:
            defaults[i] = a
    tpamp.TrainingLogger(10, stream=open("/dev/null", "w")).record(*defaults, **extra)


_KEEP = object()


MISUSE_CASES = [
    # TrainingLogger
    ("log-result-None", lambda: _logger_record(_KEEP, _KEEP, _KEEP, _KEEP, None), TypeError, ["result", "None"]),
    ("log-result-pair", lambda: _logger_record(_KEEP, _KEEP, _KEEP, _KEEP, (True, 1.0)), TypeError, ["result", "tuple"]),
    ("log-result-str", lambda: _logger_record(_KEEP, _KEEP, _KEEP, _KEEP, "ok!"), TypeError, ["result", "str"]),
    ("log-loss-str", lambda: _logger_record(_KEEP, "2.5"), TypeError, ["loss", "'2.5'"]),
    ("log-lr-None", lambda: _logger_record(_KEEP, _KEEP, None), TypeError, ["lr", "None"]),
    ("log-loss_scale-list", lambda: _logger_record(_KEEP, _KEEP, _KEEP, [1024.0]), TypeError, ["loss_scale", "list"]),
    ("log-iteration-float", lambda: _logger_record(1.5), TypeError, ["iteration", "1.5"]),
    ("log-grad_norm-str", lambda: _logger_record(_KEEP, _KEEP, _KEEP, _KEEP, (True, "0.5", None)), TypeError, ["grad_norm", "'0.5'"]),
    ("log-extra-object", lambda: _logger_record(tokens=object()), TypeError, ["tokens"]),
    ("log-log_interval-0", lambda: tpamp.TrainingLogger(10, log_interval=0), ValueError, ["log_interval", "0"]),
    ("log-train_iters-negative", lambda: tpamp.TrainingLogger(-1), ValueError, ["train_iters", "-1"]),
]


def test_every_case_is_refused_by_tpamp_itself():
    """Ids distinct; each case refused inside tpamp itself (tests/misuse_utils.py)."""
    assert_every_case_refused_by_tpamp(MISUSE_CASES)


@pytest.mark.parametrize("case_id,call,exc,words", MISUSE_CASES, ids=case_ids(MISUSE_CASES))
def test_misuse_raises_a_clear_error_naming_the_argument(case_id, call, exc, words):
    assert_raises_naming(case_id, call, exc, words)


# ---- no bad value in the log: skipped sync_free steps and non-finite values are null, never Infinity ----


def _strict_json(line: str):
    def refuse(name):
        raise ValueError(f"non-JSON constant {name} in the log")

    return json.loads(line, parse_constant=refuse)


def test_sync_free_skipped_step_reports_sentinels_and_the_log_has_null(tmp_path):
    q = torch.nn.Parameter(torch.ones(3))
    opt = tpamp.MixedPrecisionOptimizer(
        torch.optim.Adam([q], lr=1.0, fused=True), grad_scaler=tpamp.ConstantGradScaler(4.0),
        sync_free=True, log_num_zeros_in_grad=True)
    q.grad = torch.tensor([4.0, math.inf, 0.0])
    skipped = opt.step()
    opt.zero_grad()
    q.grad = torch.tensor([12.0, 16.0, 0.0])  # unscaled: [3, 4, 0], norm 5, one zero
    clean = opt.step()
    assert not bool(skipped.update_successful)
    assert math.isnan(float(skipped.grad_norm)) and int(skipped.num_zeros_in_grad) == -1
    assert bool(clean.update_successful)
    assert float(clean.grad_norm) == 5.0 and int(clean.num_zeros_in_grad) == 1
    path = tmp_path / "log.jsonl"
    with tpamp.TrainingLogger(2, jsonl_path=str(path), stream=open("/dev/null", "w")) as log:
        log.record(1, 2.0, 1e-3, 4.0, skipped)
        log.record(2, 1.5, 1e-3, 4.0, clean)
    first, second = [_strict_json(line) for line in path.read_text().splitlines()]
    assert first["grad_norm"] is None and first["num_zeros"] is None and first["skipped"] is True
    assert second["grad_norm"] == 5.0 and second["num_zeros"] == 1 and second["skipped"] is False


def test_logger_never_writes_non_json(tmp_path):
    path = tmp_path / "log.jsonl"
    with tpamp.TrainingLogger(3, jsonl_path=str(path), stream=open("/dev/null", "w")) as log:
        # a step that was not skipped (skip_nonfinite=False) with an inf norm, an inf scale
        log.record(1, math.inf, math.nan, math.inf, (True, math.inf, 3),
                   extra_norms={"w": math.nan, "b": 1.0}, tokens=torch.tensor(7))
    (rec,) = [_strict_json(line) for line in path.read_text().splitlines()]
    assert rec["loss"] is None and rec["nan"] is True
    assert rec["lr"] is None and rec["loss_scale"] is None and rec["grad_norm"] is None
    assert rec["num_zeros"] == 3
    assert rec["extra_norms"] == {"w": None, "b": 1.0} and rec["tokens"] == 7
