"""scripts/train_gpt.py end to end: 4 CPU ranks under torchrun, a tiny GPT, a few iterations.

Each test launches ``python -m torch.distributed.run --nproc-per-node 4`` in a subprocess with a
timeout and reads the JSONL log and summary.json that the logging rank writes.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tests.dist_utils import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "train_gpt.py")
SPEC_FIELDS = ("iteration", "loss", "lr", "loss_scale", "grad_norm", "num_zeros", "skipped", "nan")
ITERS = 8
TINY = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "2", "--num-microbatches", "2",
    "--train-iters", str(ITERS), "--lr", "1e-2", "--lr-warmup-iters", "1",
    "--log-interval", "2", "--eval-interval", "4", "--eval-iters", "1",
    "--data-max-bytes", "200000", "--no-progress", "--dist-timeout", "60",
]


def run_train(log_dir, *args, nproc=4, timeout=240):
    """Run the training script on ``nproc`` gloo ranks; return (records, summary, output)."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        SCRIPT, *TINY, "--log-dir", str(log_dir), *args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"train_gpt.py failed (rc {proc.returncode}):\n{out[-6000:]}"
    with open(os.path.join(log_dir, "log.jsonl")) as f:
        records = [json.loads(line) for line in f]
    with open(os.path.join(log_dir, "summary.json")) as f:
        summary = json.load(f)
    return records, summary, proc.stdout


def check_records(records, *, loss_scaling: bool):
    """Every iteration logged once, in order, with SPEC section 5's fields and sane values."""
    assert [r["iteration"] for r in records] == list(range(1, ITERS + 1))
    for r in records:
        missing = [k for k in SPEC_FIELDS if k not in r]
        assert not missing, f"iteration {r['iteration']}: missing {missing} in {r}"
        assert r["nan"] is False and math.isfinite(r["loss"]), r
        assert 0.0 < r["loss"] < 8.0, r
        assert isinstance(r["skipped"], bool)
        assert r["lr"] > 0.0 and math.isfinite(r["lr"])
        assert r["loss_scale"] > 0.0 and math.isfinite(r["loss_scale"])
        if r["skipped"]:
            assert r["grad_norm"] is None and r["num_zeros"] is None, r
        else:
            assert math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0.0, r
        if not loss_scaling:
            assert r["loss_scale"] == 1.0, r
    # byte-level: an untrained model predicts ~uniformly over 256 bytes
    assert abs(records[0]["loss"] - math.log(256)) < 0.5, records[0]
    assert sum(not r["skipped"] for r in records) >= ITERS // 2, "most steps were skipped"


def assert_loss_falls(records):
    last = (records[-1]["loss"] + records[-2]["loss"]) / 2
    assert last < records[0]["loss"] - 0.5, [r["loss"] for r in records]


def test_fp16_tp2_pp2_logs_spec_fields_and_loss_falls(tmp_path):
    records, summary, stdout = run_train(tmp_path, "--log-num-zeros-in-grad")
    check_records(records, loss_scaling=True)
    assert records[0]["loss_scale"] == 2.0**16
    for r in records:
        if not r["skipped"]:
            assert isinstance(r["num_zeros"], int) and r["num_zeros"] >= 0, r
    assert_loss_falls(records)
    assert math.isfinite(records[3]["val_loss"]) and math.isfinite(records[-1]["val_loss"])
    assert summary["iterations"] == ITERS
    assert summary["skipped_iterations"] == sum(r["skipped"] for r in records)
    assert (summary["tp"], summary["pp"], summary["dp"]) == (2, 2, 1)
    assert summary["final_validation_loss"] < math.log(256)
    # the Megatron-style line, printed by one rank only, and the closing summary
    assert stdout.count(f" iteration        2/       {ITERS} |") == 1, stdout
    assert "loss scale: 65536.0 |" in stdout and "number of skipped iterations:" in stdout
    assert stdout.count("done: ") == 1


@pytest.mark.parametrize("precision", ["--bf16", "--fp32"])
def test_bf16_and_fp32_runs_train_without_loss_scaling(tmp_path, precision):
    records, summary, _ = run_train(tmp_path, precision)
    check_records(records, loss_scaling=False)
    assert summary["dtype"] == {"--bf16": "bfloat16", "--fp32": "float32"}[precision]
    assert summary["skipped_iterations"] == 0 and summary["loss_scale_changes"] == 0
    assert_loss_falls(records)


def test_fp32_losses_and_grad_norms_do_not_depend_on_the_layout(tmp_path):
    """TP 2 x PP 2 (tied head copy on the last stage) and DP 4 (pp 1: the head is the
    embedding) see the same global batches and the same initial model, so in fp32 they must
    compute the same losses and the same global grad norms (tied weight counted once)."""
    tp_pp, _, _ = run_train(tmp_path / "tp2pp2", "--fp32")
    dp, summary, _ = run_train(
        tmp_path / "dp4", "--fp32", "--tensor-model-parallel-size", "1",
        "--pipeline-model-parallel-size", "1", "--micro-batch-size", "1",
        "--num-microbatches", "1",
    )
    assert (summary["tp"], summary["pp"], summary["dp"]) == (1, 1, 4)
    for a, b in zip(tp_pp, dp):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-5), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (a, b)
        if "val_loss" in a:
            assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-5), (a, b)
