"""scripts/train_gpt.py survives a dead or hung rank under ``torchrun --max-restarts 1``
(docs/spec.md section 20, docs/guide/restart.md).

Each run is a real ``python -m torch.distributed.run --nproc-per-node 4 --max-restarts 1``
subprocess (TP 2 x PP 2, a tiny GPT, --save D --save-interval 3 --load D). The reference is the
same command with no fault: an uninterrupted run. A fault run has one rank SIGKILLed after an
iteration's step, SIGKILLed inside a save (its files written into the staging directory, the
checkpoint not published), or hung (the others fail at --dist-timeout); torchrun restarts all
four workers, which resume from the latest complete checkpoint. The restarted attempt's JSONL
log (iterations after the resume point) must equal the reference's records of the same
iterations to the last bit: losses, grad norms, loss scales, learning rates, skip and nan
flags, and the logger's counters in summary.json.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys

import pytest

from tests.dist_utils import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "train_gpt.py")
ITERS, SAVE_INTERVAL = 9, 3
TINY = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--micro-batch-size", "2", "--num-microbatches", "2",
    "--train-iters", str(ITERS), "--lr", "1e-2", "--lr-warmup-iters", "1",
    "--log-interval", "1", "--eval-interval", "0", "--data-max-bytes", "100000",
    "--no-progress",
    # the scale grows every 2 clean steps: a lost growth tracker would shift the growth
    "--initial-loss-scale", "1024", "--loss-scale-window", "2",
]
# the logger's counters and the end state in summary.json (first/final train loss are means
# over this attempt's iterations, so they differ by design)
SUMMARY_KEYS = ("skipped_iterations", "overflow_skips", "spike_skips", "spikes",
                "nan_iterations", "loss_scale_changes", "final_loss_scale")
HANG_TIMEOUT = 10.0  # --dist-timeout of the hang test, seconds


def torchrun(tmp, *args, dist_timeout=60.0, timeout=300):
    """Run train_gpt.py under torchrun --max-restarts 1 with --save/--load tmp/ckpt and
    --log-dir tmp/log; return (log records, summary, output). Asserts rc 0."""
    ckpt, log = os.path.join(tmp, "ckpt"), os.path.join(tmp, "log")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
        "--max-restarts", "1", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        SCRIPT, *TINY, "--dist-timeout", str(dist_timeout), "--save", ckpt,
        "--save-interval", str(SAVE_INTERVAL), "--load", ckpt, "--log-dir", log, *args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"train_gpt.py failed (rc {proc.returncode}):\n{out[-8000:]}"
    with open(os.path.join(log, "log.jsonl")) as f:
        records = [json.loads(line) for line in f]
    with open(os.path.join(log, "summary.json")) as f:
        summary = json.load(f)
    return records, summary, out


def comparable(record):
    return {k: v for k, v in record.items() if k != "elapsed_ms"}


def assert_resumed_exactly(reference, records, summary, out, resumed_from):
    """The fault run restarted once, resumed from ``resumed_from`` and logged exactly what
    the uninterrupted ``reference`` (records, summary) logged for the same iterations."""
    ref_records, ref_summary, _ = reference
    assert "restarted by torchrun (attempt 1)" in out, out[-4000:]
    assert f"iteration {resumed_from}," in out and "loaded checkpoint" in out, out[-4000:]
    assert [r["iteration"] for r in records] == list(range(resumed_from + 1, ITERS + 1))
    assert [comparable(r) for r in records] == [comparable(r) for r in ref_records[resumed_from:]]
    assert {k: summary[k] for k in SUMMARY_KEYS} == {k: ref_summary[k] for k in SUMMARY_KEYS}


def leftovers(tmp):
    ckpt = os.path.join(tmp, "ckpt")
    return [n for n in os.listdir(ckpt) if ".saving-" in n or ".old-" in n]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted TP 2 x PP 2 run (same flags, no fault)."""
    records, summary, out = torchrun(str(tmp_path_factory.mktemp("reference")))
    assert [r["iteration"] for r in records] == list(range(1, ITERS + 1))
    assert summary["loss_scale_changes"] >= 1  # the resumed scaler state is exercised
    return records, summary, out


def test_a_rank_killed_after_an_iteration_restarts_and_resumes_exactly(reference, tmp_path):
    # rank 1 dies after iteration 5's step: iteration 3's checkpoint is the latest complete
    records, summary, out = torchrun(str(tmp_path), "--inject-exit-at-iteration", "5",
                                     "--inject-fault-rank", "1")
    assert "[rank 1] injected fault: SIGKILL" in out
    assert_resumed_exactly(reference, records, summary, out, resumed_from=3)
    assert leftovers(str(tmp_path)) == []


def test_a_hung_rank_fails_the_others_at_the_dist_timeout_and_the_job_restarts(
        reference, tmp_path):
    # rank 3 sleeps after iteration 4's step; the others' next collective fails at
    # --dist-timeout, torchrun stops the attempt (the hung rank too) and restarts it
    records, summary, out = torchrun(str(tmp_path), "--inject-hang-at-iteration", "4",
                                     "--inject-fault-rank", "3", dist_timeout=HANG_TIMEOUT)
    hung = re.search(r"\[rank 3\] injected fault: hang at ([0-9.]+)", out)
    assert hung, out[-4000:]
    # torchrun's log line of the first failed worker: "E1124 21:44:04.289000 ... failed (exitcode"
    failed = re.search(r"^E(\d{4} \d\d:\d\d:\d\d\.\d+) .*failed \(exitcode", out, re.M)
    assert failed, out[-4000:]
    hung_at = datetime.datetime.fromtimestamp(float(hung.group(1)))
    failed_at = datetime.datetime.strptime(f"{hung_at.year}{failed.group(1)}", "%Y%m%d %H:%M:%S.%f")
    waited = (failed_at - hung_at).total_seconds()
    # the timeout, plus what a loaded 2-core machine adds; not the 300 s default nor forever
    assert 0 < waited < HANG_TIMEOUT + 60, waited
    assert_resumed_exactly(reference, records, summary, out, resumed_from=3)


def test_a_rank_killed_during_a_save_with_the_distributed_optimizer_resumes_exactly(tmp_path):
    # rank 0 (the save's coordinator) dies inside iteration 6's save, its files written into
    # the staging directory: the checkpoint of 6 is never published, the job resumes from 3
    # and the restart removes the staging directory before anything is loaded
    flags = ("--use-distributed-optimizer",)
    reference = torchrun(str(tmp_path / "reference"), *flags)
    records, summary, out = torchrun(
        str(tmp_path / "fault"), *flags, "--inject-exit-at-iteration", "6",
        "--inject-fault-rank", "0", "--inject-fault-during-save")
    assert "[rank 0] injected fault: SIGKILL" in out
    assert re.search(r"removed \S+/\.iter_0000006\.saving-[0-9a-f]+ \(left by a save", out), \
        out[-4000:]
    assert_resumed_exactly(reference, records, summary, out, resumed_from=3)
    assert leftovers(str(tmp_path / "fault")) == []
    with open(os.path.join(tmp_path, "fault", "ckpt", "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == str(ITERS)


# ----------------------------------------------------------------------------- in process


def test_clean_up_interrupted_saves_removes_staging_and_puts_a_set_aside_checkpoint_back(tmp_path):
    from tpamp.checkpoint import clean_up_interrupted_saves

    root = str(tmp_path)
    for name in ("iter_0000003", ".iter_0000006.saving-0123456789ab",
                 ".iter_0000003.saving-deadbeef0000", ".iter_0000009.old-00000000cafe",
                 ".iter_0000003.old-0000000000aa", "keep.saving-0123", ".hidden"):
        os.makedirs(os.path.join(root, name))
    with open(os.path.join(root, ".iter_0000009.old-00000000cafe", "marker"), "w") as f:
        f.write("9")
    removed = clean_up_interrupted_saves(root)
    assert removed == sorted([".iter_0000006.saving-0123456789ab", ".iter_0000003.saving-deadbeef0000",
                              ".iter_0000009.old-00000000cafe", ".iter_0000003.old-0000000000aa"])
    # iter_0000009 was missing: its set-aside copy is put back; iter_0000003 exists: the old
    # copy is removed; names that are not a save's leftovers stay
    assert sorted(os.listdir(root)) == [".hidden", "iter_0000003", "iter_0000009", "keep.saving-0123"]
    assert open(os.path.join(root, "iter_0000009", "marker")).read() == "9"
    assert clean_up_interrupted_saves(root) == []
    assert clean_up_interrupted_saves(str(tmp_path / "missing")) == []


@pytest.mark.parametrize("root, exc, words", [
    (b"/tmp", TypeError, r"root must be a path \(str or os.PathLike\), got b'/tmp' \(bytes\)"),
    (None, TypeError, r"root must be a path .*\(NoneType\)"),
    (3, TypeError, r"root must be a path .*\(int\)"),
    ("", ValueError, "root must not be empty"),
])
def test_clean_up_interrupted_saves_refuses_a_root_that_is_not_a_str_path(tmp_path, root, exc, words):
    """main e82d3a5: bytes listed the directory as bytes and failed in its regex (raw TypeError);
    a PathLike is accepted."""
    from tpamp.checkpoint import clean_up_interrupted_saves

    os.makedirs(tmp_path / ".iter_0000001.saving-0123456789ab")
    with pytest.raises(exc, match=words):
        clean_up_interrupted_saves(root)
    assert os.listdir(tmp_path) == [".iter_0000001.saving-0123456789ab"]
    assert clean_up_interrupted_saves(tmp_path) == [".iter_0000001.saving-0123456789ab"]


def test_the_tracker_helpers_refuse_a_root_or_iteration_of_the_wrong_type(tmp_path):
    """main e82d3a5: raw os.path errors ("Can't mix strings and bytes", "expected str, bytes
    or os.PathLike object") and a ValueError for a float or bool iteration."""
    from tpamp.checkpoint import iteration_dir, read_latest_iteration, write_latest_iteration

    root = str(tmp_path)
    for call in (lambda: iteration_dir(root.encode(), 3), lambda: iteration_dir(None, 3),
                 lambda: read_latest_iteration(root.encode()), lambda: read_latest_iteration(None),
                 lambda: write_latest_iteration(root.encode(), 3)):
        with pytest.raises(TypeError, match=r"root must be a (str )?path"):
            call()
    for it in (3.0, True, "3"):
        with pytest.raises(TypeError, match=rf"iteration must be an int >= 0, got {it!r}"):
            iteration_dir(root, it)
    with pytest.raises(ValueError, match="iteration must be an int >= 0, got -1"):
        write_latest_iteration(root, -1)
    assert os.listdir(root) == []
    assert iteration_dir(tmp_path, 7) == os.path.join(root, "iter_0000007")  # a PathLike


def _flag_error(monkeypatch, capsys, *flags):
    """parse_args of one process (WORLD_SIZE 4 as torchrun would set) with ``flags``: the
    exit status and the line on stderr."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import train_gpt

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as e:
        train_gpt.parse_args([*TINY, "--save", "unused-dir", "--save-interval", "3", *flags])
    return e.value.code, capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (("--inject-fault-during-save",),
     "--inject-fault-during-save True: expected --inject-exit-at-iteration N or "
     "--inject-hang-at-iteration N with it"),
    (("--inject-exit-at-iteration", "0"),
     "--inject-exit-at-iteration 0: expected an iteration from 1 to --train-iters 9"),
    (("--inject-hang-at-iteration", "10"),
     "--inject-hang-at-iteration 10: expected an iteration from 1 to --train-iters 9"),
    (("--inject-exit-at-iteration", "2", "--inject-fault-rank", "4"),
     "--inject-fault-rank 4: expected a rank from 0 to 3 (WORLD_SIZE 4)"),
    (("--inject-exit-at-iteration", "4", "--inject-fault-during-save"),
     "--inject-fault-during-save True: iteration 4 saves no checkpoint"),
    (("--inject-exit-at-iteration", "2", "--inject-hang-at-iteration", "3"),
     "not allowed with argument"),
])
def test_a_bad_fault_injection_flag_exits_2_naming_it(monkeypatch, capsys, flags, message):
    code, err = _flag_error(monkeypatch, capsys, *flags)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
