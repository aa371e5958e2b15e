"""scripts/gpu_check.sh, the one-command check of a GPU machine, kept from rotting on CPU: its dry
run (CPU stand-ins: the SIMT-emulated CUDA launchers where tpamp._C_simt is built, else the CPU
kernels; small sizes) must run every step and pass; its table must report a failing comparison
as FAIL and exit 1; a step that would overrun the budget is skipped with a line saying so.
Nothing here is timed (the dry run's own budget is 55 s; this test gives it more)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tpamp import ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.sh")
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import gpu_check  # noqa: E402


def run_check(out, *args, env=None, timeout=180):
    e = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", **(env or {}))
    proc = subprocess.run(["bash", SCRIPT, *args, str(out)], cwd=ROOT, env=e, capture_output=True,
                          text=True, timeout=timeout)
    return proc, proc.stdout + proc.stderr


def table(out):
    with open(os.path.join(out, "table.json"), encoding="utf-8") as f:
        return json.load(f)


@pytest.mark.skipif(not ops.extension_available("cpu"), reason="the dry run needs the CPU kernels")
def test_dry_run_runs_every_step_and_passes(tmp_path):
    # a budget above the dry run's own 55 s: no timed test (a busy machine must not fail it);
    # its usual time is in the table's "step total" row
    proc, out = run_check(tmp_path, "--dry-run", env={"GPU_CHECK_BUDGET_S": "400"}, timeout=480)
    assert proc.returncode == 0, out[-6000:]
    rows = table(tmp_path)
    by_check = {r["check"]: r for r in rows}
    failed = [r for r in rows if r["status"] == "FAIL"]
    assert not failed, failed
    # every step ran within the budget (none skipped for time), and each left its rows
    steps = {r["check"][5:]: r for r in rows if r["check"].startswith("step ")}
    for name in ("build", "cuda_tests", "parts", "train_run"):
        assert steps[name]["status"] == "PASS", steps[name]
    for name in ("memcheck", "racecheck"):
        assert steps[name]["status"] == "SKIP" and "compute-sanitizer needs a GPU" in steps[name]["note"]
    for check in ("grad_stats: device = CPU twin = float64",
                  "scale_and_copy, scale_, scaler update: device = twin = float64",
                  "fused_adam_step_ / fused_sgd_step_: device = twin = float64",
                  "grad_sumsq_exact, exact_sumsq_to_double: device = twin = exact",
                  "sync-free step: graph replay = eager", "train_gpt.py short run",
                  "error path: cpu launcher raises, does not crash"):
        assert by_check[check]["status"] == "PASS", by_check[check]
    # the timings are dry-run figures, labelled so, never GPU ones
    for check in ("grad-stats pass / copy bandwidth", "one-pass AdamW step / AdamW(fused=True) fp32"):
        assert by_check[check]["status"] == "INFO" and "not a GPU figure" in by_check[check]["note"]
    assert by_check["grad_stats over > 2^31 elements: device = CPU twin = float64"]["status"] == "SKIP"
    # the table is what the command prints last
    assert out.rstrip().splitlines()[-1].startswith("== ") and " 0 failed" in out.rstrip().splitlines()[-1]
    assert os.path.exists(tmp_path / "train" / "summary.json")


def test_a_step_past_the_budget_is_skipped_with_a_line(tmp_path):
    proc, out = run_check(tmp_path, "--dry-run", env={"GPU_CHECK_BUDGET_S": "5"}, timeout=60)
    assert proc.returncode == 0, out[-3000:]
    steps = [r for r in table(tmp_path) if r["check"].startswith("step ") and r["check"] != "step total"]
    assert steps and all(r["status"] == "SKIP" for r in steps), steps
    assert all(r["note"] for r in steps)  # never silently
    assert "no time left in the 5 s budget" in out


def test_usage_errors(tmp_path):
    proc = subprocess.run(["bash", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "usage" in proc.stderr
    proc = subprocess.run(["bash", SCRIPT, "--fast", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 2 and "--fast" in proc.stderr


def test_table_reports_a_failed_step_and_row_and_exits_1(tmp_path):
    (tmp_path / "steps.tsv").write_text("compare\t1\t3\tsee compare.log\n")
    (tmp_path / "compare.json").write_text(json.dumps([dict(
        part="compare", check="grad_stats", status="FAIL", value="1 of 2 cases differ", target="bitwise",
        note="x")]))
    assert gpu_check.main(["table", "--out", str(tmp_path)]) == 1
    statuses = [r["status"] for r in table(tmp_path)]
    assert statuses == ["FAIL", "FAIL"]


class _OffByOneUlp:
    """The CPU kernels, with one bit of scale_and_copy's last output flipped: a broken "device"."""

    def __getattr__(self, name):
        return getattr(torch.ops.tpamp, name)

    def scale_and_copy(self, srcs, dsts, scale):
        torch.ops.tpamp.scale_and_copy(srcs, dsts, scale)
        for d in reversed(dsts):
            if d.numel():
                flat = d.view(-1).view(torch.int16 if d.element_size() == 2 else torch.int32)
                flat[0] ^= 1
                break


@pytest.mark.skipif(not ops.extension_available("cpu"), reason="needs the CPU kernels")
def test_comparison_fails_on_a_one_bit_difference(tmp_path):
    ctx = gpu_check.Ctx(type("A", (), dict(dry_run=True, out=str(tmp_path)))())
    ctx.dev_ops = _OffByOneUlp()
    rows = gpu_check.Rows(str(tmp_path), "compare")
    gpu_check.compare_copies(ctx, rows, [0, 3, 101, 203, 305])
    assert rows.rows[-1]["status"] == "FAIL"
    assert "scale_and_copy" in rows.rows[-1]["note"] and "differs" in rows.rows[-1]["note"]


def test_the_error_path_probe_reports_a_crash_with_the_toolchain(tmp_path, monkeypatch):
    """A probe process that dies by a signal (as tpamp._C did on the first GPU machine, SIGSEGV
    while formatting an error message) is a FAIL row naming the signal and the toolchain facts,
    not a crash of the check; a probe that does not raise is a FAIL too."""
    import argparse

    if not ops.extension_available("cpu"):
        pytest.skip("the CPU kernels are not built (the probe row is then a SKIP)")
    monkeypatch.setattr(gpu_check, "_ERROR_PROBE",
                        "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    ctx = argparse.Namespace(dry=True)
    rows = gpu_check.Rows(str(tmp_path), "errors")
    gpu_check.part_errors(ctx, rows)
    (row,) = rows.rows
    assert row["status"] == "FAIL" and row["value"] == "crashed (signal 11)", row
    assert row["note"].startswith("CXX=") and "_C" in row["note"], row
    monkeypatch.setattr(gpu_check, "_ERROR_PROBE", "print('NO ERROR')")
    rows = gpu_check.Rows(str(tmp_path), "errors")
    gpu_check.part_errors(ctx, rows)
    assert rows.rows[0]["status"] == "FAIL" and "NO ERROR" in rows.rows[0]["value"], rows.rows
