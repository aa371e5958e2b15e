"""scripts/train_gpt.py refuses a bad flag before it starts: on every rank, before any process
group, model or optimizer exists, exactly one rank (RANK 0) prints one line naming the flag,
its value and what is expected (no traceback), every rank exits with status 2 (argparse's
convention), within 10 s, and nothing is written (no log or checkpoint directory).

The ranks are started as torchrun starts them: two processes of the script with torchrun's
environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so that
each rank's exit status and output can be read (torchrun itself exits 1 and prints its own
report of the failed workers; one test runs under torchrun and reads that report). A flag the
checks missed would reach init_process_group and train: the subprocess timeout catches that.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from tests.dist_utils import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "train_gpt.py")
WORLD = 2
LIMIT_S = 10.0
TORCHRUN_LIMIT_S = 18.0  # below the 20 s --dist-timeout of these runs (a hang would reach it)
# a valid 2-rank run (TP 2 x PP 1): each case adds the one flag that is wrong
BASE = [
    "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1",
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "2", "--num-microbatches", "2",
    "--train-iters", "2", "--lr-warmup-iters", "1", "--eval-interval", "0",
    "--data-max-bytes", "200000",
    "--no-progress", "--dist-timeout", "20",
]


def _env(rank: int, port: int) -> dict:
    return dict(
        os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=ROOT,
        RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )


def run_ranks(args):
    """Start the script with ``args`` on WORLD ranks with torchrun's environment; returns
    ([(returncode, stdout, stderr)] by rank, wall seconds until the last rank exited)."""
    port = free_port()
    start = time.monotonic()
    procs = [
        subprocess.Popen([sys.executable, SCRIPT, *args], cwd=ROOT, env=_env(r, port),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(WORLD)
    ]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=90)
            results.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results, time.monotonic() - start


def _paths(tmp_path):
    return {
        "log": tmp_path / "log", "save": tmp_path / "ckpt", "load": tmp_path / "load",
        "empty": tmp_path / "empty.txt", "tiny": tmp_path / "tiny.txt",
        "dir": tmp_path / "a_directory", "missing": tmp_path / "no_such.txt",
    }


# (id, extra flags (a function of the paths), words the one line must hold)
CASES = [
    # the data file
    ("data-missing", lambda p: ["--data", str(p["missing"])],
     ["--data", "no_such.txt", "no such file", "expected a text file"]),
    ("data-directory", lambda p: ["--data", str(p["dir"])],
     ["--data", "a_directory", "is a directory", "expected a text file"]),
    ("data-empty", lambda p: ["--data", str(p["empty"])],
     ["--data", "empty.txt", "an empty file", "--seq-length"]),
    ("data-too-short", lambda p: ["--data", str(p["tiny"])],
     ["--data", "tiny.txt", "100 bytes", "--seq-length + 1 = 33"]),
    # remainders apply to bf16 params only
    ("remainders-fp32", lambda p: ["--store-param-remainders", "--fp32"],
     ["--store-param-remainders", "bf16", "--fp32"]),
    ("remainders-fp16", lambda p: ["--store-param-remainders", "--fp16"],
     ["--store-param-remainders", "bf16", "--fp16"]),
    ("remainders-default-fp16", lambda p: ["--store-param-remainders"],
     ["--store-param-remainders", "bf16", "--fp16"]),
    ("remainders-fsdp2", lambda p: ["--store-param-remainders", "--bf16", "--use-torch-fsdp2"],
     ["--store-param-remainders", "--use-torch-fsdp2", "fp32"]),
    ("sr-fp16", lambda p: ["--no-master-weights", "--stochastic-rounding"],
     ["--stochastic-rounding", "--bf16"]),
    ("sr-alone", lambda p: ["--bf16", "--stochastic-rounding"],
     ["--stochastic-rounding", "--no-master-weights"]),
    ("no-master-alone", lambda p: ["--bf16", "--no-master-weights"],
     ["--stochastic-rounding", "--no-master-weights"]),
    ("sr-remainders", lambda p: ["--bf16", "--no-master-weights", "--stochastic-rounding",
                                 "--store-param-remainders"],
     ["--stochastic-rounding", "--store-param-remainders"]),
    # narrow state needs the one-pass step: a loss scale that never drops below 1
    ("narrow-constant-scale-below-1", lambda p: ["--exp-avg-dtype", "fp8", "--loss-scale", "0.5"],
     ["--loss-scale", "0.5", "--exp-avg-dtype", "fp8", ">= 1"]),
    ("narrow-min-scale-below-1", lambda p: ["--exp-avg-sq-dtype", "bf16", "--min-loss-scale", "0.5"],
     ["--min-loss-scale", "0.5", "--exp-avg-sq-dtype", "bf16", ">= 1"]),
    # checks that used to run after init_process_group (or raise with a traceback per rank)
    ("fsdp2-and-distributed-optimizer", lambda p: ["--use-torch-fsdp2", "--use-distributed-optimizer"],
     ["--use-distributed-optimizer", "--use-torch-fsdp2", "exclude"]),
    ("fsdp2-with-model-chunks", lambda p: ["--use-torch-fsdp2", "--tensor-model-parallel-size", "1",
                                           "--pipeline-model-parallel-size", "2",
                                           "--pipeline-schedule", "Interleaved1F1B",
                                           "--num-layers-per-virtual-pipeline-stage", "1"],
     ["--pipeline-schedule", "Interleaved1F1B", "--use-torch-fsdp2", "one model chunk per rank"]),
    ("overlap-without-distributed-optimizer", lambda p: ["--overlap-grad-reduce"],
     ["--overlap-grad-reduce", "--use-distributed-optimizer"]),
    ("layout-does-not-divide-world", lambda p: ["--pipeline-model-parallel-size", "2"],
     ["--tensor-model-parallel-size", "2", "WORLD_SIZE"]),
    ("heads-not-divisible-by-tp", lambda p: ["--num-attention-heads", "1", "--hidden-size", "32"],
     ["--num-attention-heads", "1", "--tensor-model-parallel-size", "2"]),
    ("global-batch-not-a-multiple", lambda p: [DROP, "--num-microbatches", "--global-batch-size", "3"],
     ["--global-batch-size", "3", "micro-batch-size", "2"]),
    ("lr-zero", lambda p: ["--lr", "0"], ["--lr", "0.0", "> 0"]),
    ("log-param-grad-norms-negative", lambda p: ["--log-param-grad-norms", "-1"],
     ["--log-param-grad-norms", "-1", ">= 0"]),
    ("min-loss-scale-above-initial", lambda p: ["--min-loss-scale", "1e6"],
     ["--min-loss-scale", "1000000.0", "--initial-loss-scale 65536.0"]),
    ("spike-warmup-above-window", lambda p: ["--spike-window", "4", "--spike-warmup", "8"],
     ["--spike-warmup", "8", "--spike-window 4"]),
    ("save-interval-without-save", lambda p: [DROP, "--save", "--save-interval", "5"],
     ["--save-interval", "5", "--save"]),
    ("ckpt-step-without-load", lambda p: ["--ckpt-step", "5"], ["--ckpt-step", "5", "--load"]),
    ("ckpt-step-not-saved", lambda p: ["--load", str(p["load"]), "--ckpt-step", "1"],
     ["--ckpt-step", "1", "iter_0000001"]),
    # argparse's own checks print one line on one rank too
    ("argparse-bad-choice", lambda p: ["--exp-avg-dtype", "fp4"], ["--exp-avg-dtype", "fp4"]),
]


DROP = object()  # in a case's flags: the next flag is left out (with its value)


def _without(flags, flag):
    """``flags`` without ``flag`` and its value."""
    i = flags.index(flag)
    return flags[:i] + flags[i + 2:]


def command_line(case_flags, paths):
    """BASE, the log and checkpoint directories, then the case's flags: a flag the case gives
    replaces BASE's; ``DROP, flag`` leaves ``flag`` out."""
    flags = [*BASE, "--log-dir", str(paths["log"]), "--save", str(paths["save"])]
    extra, i = case_flags(paths), 0
    while i < len(extra):
        if extra[i] is DROP:
            flags, i = _without(flags, extra[i + 1]), i + 2
            continue
        if extra[i].startswith("--") and extra[i] in flags:  # BASE's flags all take a value
            flags = _without(flags, extra[i])
        flags.append(extra[i])
        i += 1
    return flags


def _check_refused(results, wall, words, paths):
    for rank, (rc, out, err) in enumerate(results):
        assert rc == 2, f"rank {rank} exited {rc}:\n{out[-2000:]}\n{err[-4000:]}"
        assert "Traceback" not in out + err, f"rank {rank}:\n{err[-4000:]}"
        assert out == "", f"rank {rank} printed to stdout:\n{out[-2000:]}"
    assert results[1][2] == "", f"rank 1 printed:\n{results[1][2]}"
    lines = results[0][2].splitlines()
    assert len(lines) == 1, f"rank 0 printed {len(lines)} lines:\n{results[0][2]}"
    line = lines[0]
    assert line.startswith("train_gpt.py: error: "), line
    for w in words:
        assert w in line, (w, line)
    assert wall < LIMIT_S, f"{wall:.1f} s to refuse a bad flag: {line}"
    assert not paths["log"].exists() and not paths["save"].exists(), "something was written"


@pytest.mark.parametrize("case_id,case_flags,words", CASES, ids=[c[0] for c in CASES])
def test_a_bad_flag_is_refused_by_one_line_on_one_rank_with_status_2(tmp_path, case_id,
                                                                      case_flags, words):
    paths = _paths(tmp_path)
    paths["empty"].write_bytes(b"")
    paths["tiny"].write_bytes(b"x" * 100)
    paths["dir"].mkdir()
    paths["load"].mkdir()
    results, wall = run_ranks(command_line(case_flags, paths))
    _check_refused(results, wall, words, paths)


def test_under_torchrun_each_worker_exits_2_and_the_line_is_printed_once(tmp_path):
    """torchrun itself reports the failed workers (its own traceback and exit status 1): a
    worker exited with 2 within the time limit, and the message came once."""
    paths = _paths(tmp_path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), SCRIPT,
           *command_line(lambda p: ["--data", str(p["missing"])], paths)]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=ROOT)
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    wall = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert out.count("train_gpt.py: error: --data ") == 1, out
    # the first worker to exit is reported with status 2 (torchrun then stops the other)
    assert "exitcode  : 2" in out, out
    # not a speed target: torchrun's own start (importing torch twice) takes seconds more on a
    # loaded 2-core machine; what this bounds is a worker left waiting for the other at a
    # collective until the process-group timeout
    assert wall < TORCHRUN_LIMIT_S, f"{wall:.1f} s"
    assert not paths["log"].exists() and not paths["save"].exists()


def test_the_checkpoint_layout_read_before_torch_is_tpamp_checkpoints():
    """gpt_checkpoint reads Megatron-LM's layout with the standard library (for the checks
    before torch is imported): the same names and tracker reading as tpamp.checkpoint."""

    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import gpt_checkpoint

    from tpamp import checkpoint as ckpt

    assert gpt_checkpoint.TRACKER_FILENAME == ckpt.TRACKER_FILENAME
    for it in (0, 7, 1234567):
        assert os.path.join("r", gpt_checkpoint.ITERATION_DIR.format(it)) == ckpt.iteration_dir("r", it)


@pytest.mark.parametrize("text", ["12", " 40\n", "x1", "-3", "", "1.5"])
def test_the_tracker_file_reads_as_tpamp_checkpoint_reads_it(tmp_path, text):
    import argparse

    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import gpt_checkpoint

    from tpamp import checkpoint as ckpt

    (tmp_path / ckpt.TRACKER_FILENAME).write_text(text)
    args = argparse.Namespace(load=str(tmp_path), ckpt_step=None)
    try:
        want = ckpt.read_latest_iteration(str(tmp_path))
    except ValueError:
        with pytest.raises(ValueError, match="expected an iteration number"):
            gpt_checkpoint.resume_iteration(args)
    else:
        assert gpt_checkpoint.resume_iteration(args) == want


# ----------------------------------------------------------------------------- in process


def _train_gpt():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import train_gpt

    return train_gpt


PP2 = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2"]
IN_PROCESS = [
    ("valid-fraction-one", ["--valid-fraction", "1"], ["--valid-fraction", "1.0", "0 < fraction < 1"]),
    ("data-max-bytes-too-small", ["--data-max-bytes", "40"],
     ["--data-max-bytes", "40", "--seq-length + 1 = 33"]),
    ("loss-scale-beyond-float32", ["--loss-scale", "1e39"], ["--loss-scale", "1e+39", "float32"]),
    ("hysteresis-zero", ["--hysteresis", "0"], ["--hysteresis", "0", ">= 1"]),
    ("spike-threshold-zero", ["--spike-threshold", "0"], ["--spike-threshold", "0.0", "> 0"]),
    ("eval-iters-zero", ["--eval-iters", "0"], ["--eval-iters", "0", ">= 1"]),
    ("dist-timeout-zero", ["--dist-timeout", "0"], ["--dist-timeout", "0.0", "> 0"]),
    ("decoupled-lr-zero", ["--decoupled-lr", "0"], ["--decoupled-lr", "0.0", "> 0"]),
    ("decoupled-min-lr-alone", ["--decoupled-min-lr", "1e-4"],
     ["--decoupled-min-lr", "0.0001", "--decoupled-lr"]),
    ("decoupled-lr-below-its-end", ["--decoupled-lr", "1e-5", "--min-lr", "1e-4"],
     ["--decoupled-lr", "1e-05", "0.0001", "--min-lr"]),
    ("min-lr-above-lr", ["--lr", "1e-3", "--min-lr", "1e-2"], ["--min-lr", "0.01", "--lr 0.001"]),
    # --optimizer muon (docs/spec.md section 17): the momentum is an average, < 1
    ("muon-momentum-one", ["--optimizer", "muon", "--muon-momentum", "1"],
     ["--muon-momentum", "1.0", "[0, 1)"]),
    ("muon-momentum-inf", ["--optimizer", "muon", "--muon-momentum", "inf"],
     ["--muon-momentum", "inf", "[0, 1)"]),
    ("num-layers-not-split-evenly", ["--tensor-model-parallel-size", "1",
                                     "--pipeline-model-parallel-size", "2", "--num-layers", "3"],
     ["--num-layers", "3", "--pipeline-model-parallel-size 2"]),
    ("tp-not-dividing-the-vocabulary", ["--tensor-model-parallel-size", "3",
                                        "--num-attention-heads", "3", "--hidden-size", "33"],
     ["--tensor-model-parallel-size", "3", "256"]),
    # which params keep 8-bit moments (docs/spec.md section 9)
    ("min-8bit-size-negative", ["--exp-avg-dtype", "uint8", "--min-8bit-size", "-1"],
     ["--min-8bit-size", "-1", ">= 0"]),
    ("min-8bit-size-without-8bit-moments", ["--exp-avg-dtype", "bf16", "--min-8bit-size", "0"],
     ["--min-8bit-size", "0", "uint8 or fp8"]),
    # torch.distributed.pipelining's schedules (PP 2 x TP 1 on the 2 ranks)
    ("schedule-unknown", ["--pipeline-schedule", "ZBVZeroBubble"],
     ["--pipeline-schedule", "ZBVZeroBubble", "1F1B", "Interleaved1F1B"]),
    ("interleaved-without-virtual-stages", PP2 + ["--pipeline-schedule", "Interleaved1F1B"],
     ["--num-layers-per-virtual-pipeline-stage", "None", "Interleaved1F1B"]),
    ("interleaved-with-pipeline-size-1", ["--pipeline-schedule", "LoopedBFS",
                                          "--num-layers-per-virtual-pipeline-stage", "1"],
     ["--pipeline-model-parallel-size", "1", ">= 2"]),
    ("virtual-stages-not-dividing-the-layers", PP2 + [
        "--pipeline-schedule", "Interleaved1F1B", "--num-layers", "4",
        "--num-layers-per-virtual-pipeline-stage", "3"],
     ["--num-layers-per-virtual-pipeline-stage", "3", "--num-layers 4"]),
    ("virtual-stages-with-a-single-stage-schedule", PP2 + [
        "--pipeline-schedule", "GPipe", "--num-layers-per-virtual-pipeline-stage", "1"],
     ["--num-layers-per-virtual-pipeline-stage", "1", "GPipe", "one model chunk"]),
    ("1f1b-fewer-microbatches-than-stages", PP2 + ["--num-microbatches", "1"],
     ["--pipeline-schedule", "1F1B", "1 microbatches", "pipeline size 2", "GPipe"]),
    ("interleaved-microbatches-not-in-rounds", PP2 + [
        "--pipeline-schedule", "Interleaved1F1B", "--num-layers", "4",
        "--num-layers-per-virtual-pipeline-stage", "1", "--num-microbatches", "5"],
     ["--pipeline-schedule", "Interleaved1F1B", "5 microbatches", "max(1, M // 2)"]),
]


@pytest.mark.parametrize("case_id,flags,words", IN_PROCESS, ids=[c[0] for c in IN_PROCESS])
def test_parse_args_refuses_in_process_with_one_line_on_rank_0(monkeypatch, capsys, case_id,
                                                                flags, words):
    train_gpt = _train_gpt()
    world = "3" if case_id == "tp-not-dividing-the-vocabulary" else str(WORLD)
    for rank, printed in ((0, True), (1, False)):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", world)
        argv = [f for f in BASE]
        for f in flags:
            if f.startswith("--") and f in argv:
                argv = _without(argv, f)
        with pytest.raises(SystemExit) as info:
            train_gpt.parse_args([*argv, *flags])
        assert info.value.code == 2
        out, err = capsys.readouterr()
        assert out == ""
        if not printed:
            assert err == "", err
            continue
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("train_gpt.py: error: "), err
        for w in words:
            assert w in lines[0], (w, lines[0])


@pytest.mark.parametrize("tracker, words", [("6", ["--load", "iteration 6", "--train-iters 2"]),
                                            ("2", ["--load", "iteration 2", "--train-iters 2"]),
                                            ("soon", ["--load", "'soon'", "iteration number"])])
def test_a_load_directory_with_nothing_left_to_train_is_refused(monkeypatch, capsys, tmp_path,
                                                                 tracker, words):
    train_gpt = _train_gpt()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(WORLD))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text(tracker)
    with pytest.raises(SystemExit) as info:
        train_gpt.parse_args([*BASE, "--load", str(tmp_path)])
    assert info.value.code == 2
    line = capsys.readouterr().err.strip()
    for w in words:
        assert w in line, (w, line)


def test_the_flags_of_a_run_that_can_start_are_accepted(monkeypatch, capsys, tmp_path):
    train_gpt = _train_gpt()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(WORLD))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")
    args = train_gpt.parse_args([*BASE, "--bf16", "--store-param-remainders", "--exp-avg-dtype",
                                 "fp8", "--load", str(tmp_path), "--log-dir", str(tmp_path / "l")])
    assert args.store_param_remainders and args.exp_avg_dtype == "fp8"
    assert args.min_8bit_size is None  # the library's default rule
    assert train_gpt.parse_args([*BASE, "--exp-avg-sq-dtype", "uint8", "--min-8bit-size", "0",
                                 "--load", str(tmp_path)]).min_8bit_size == 0
    assert capsys.readouterr() == ("", "")
    assert not (tmp_path / "l").exists()


def _help_blocks(text):
    """{flag: its help block} from argparse's --help output (a block: the option line and its
    indented continuation lines)."""
    blocks, flag = {}, None
    for line in text.splitlines():
        m = re.match(r"^  (-[-\w]+)", line)
        if m:
            flag = m.group(1)
            blocks[flag] = line
        elif flag is not None and line.startswith("    "):
            blocks[flag] += " " + line.strip()
        else:
            flag = None
    return {f: " ".join(b.split()) for f, b in blocks.items()}


# the defaults docs/guide/main_job.md and README promise (TP 2 x PP 2, the 3.26M-param model,
# 300 iterations, Megatron's loss-scaling defaults)
DOCUMENTED_DEFAULTS = {
    "--tensor-model-parallel-size": "2", "--pipeline-model-parallel-size": "2",
    "--num-layers": "4", "--hidden-size": "256", "--num-attention-heads": "8",
    "--seq-length": "128", "--train-iters": "300", "--lr-warmup-iters": "20",
    "--micro-batch-size": "4", "--initial-loss-scale": "65536.0", "--hysteresis": "2",
    "--loss-scale-window": "1000", "--seed": "1234", "--exp-avg-dtype": "fp32",
}
# flags whose default is "not set" (None: off, or decided by other flags as their help says)
NOT_SET = {"--num-layers-per-virtual-pipeline-stage", "--loss-scale", "--log-dir", "--save",
           "--save-interval", "--load", "--ckpt-step", "--inject-inf-grad",
           "--inject-exit-at-iteration", "--inject-hang-at-iteration"}


def test_help_shows_the_default_of_every_flag_that_takes_a_value(monkeypatch, capsys):
    """main_job.md: "--help lists every flag with its default"."""
    train_gpt = _train_gpt()
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as info:
        train_gpt.parse_args(["--help"])
    assert info.value.code == 0
    blocks = _help_blocks(capsys.readouterr().out)
    assert len(blocks) > 60, blocks
    for flag, value in DOCUMENTED_DEFAULTS.items():
        assert f"(default: {value})" in blocks[flag] or f"default: {value}" in blocks[flag], (
            flag, blocks[flag])
    for flag, block in blocks.items():
        takes_value = re.match(r"^-[-\w]+ ([A-Z][A-Z0-9_]*|\{[^}]*\})( |$)", block)  # METAVAR / {a,b}
        if flag in NOT_SET or not takes_value:
            continue
        assert "default" in block, f"--help shows no default for {flag}: {block!r}"


@pytest.mark.parametrize("iters, warmup, decoupled, reached", [
    (5, 20, None, ["0.0005 of --lr 0.002"]),  # 2e-3 * 5 / 20, by hand
    (3, 4, "1e-3", ["0.0015 of --lr 0.002", "0.00075 of --decoupled-lr 0.001"]),
    (20, 20, None, None), (21, 20, None, None), (2, 0, None, None),
])
def test_a_run_that_ends_inside_the_warmup_is_warned_about_on_rank_0(
        monkeypatch, capsys, iters, warmup, decoupled, reached):
    """The run goes on (the flags are valid), but rank 0 prints one warning line naming both
    flags and the peak lr the run reaches: lr_at's linear warm-up reaches --lr at iteration
    --lr-warmup-iters, so a shorter run never does."""
    train_gpt = _train_gpt()
    flags = _without(_without(BASE, "--train-iters"), "--lr-warmup-iters") + [
        "--train-iters", str(iters), "--lr-warmup-iters", str(warmup)]
    if decoupled is not None:
        flags += ["--decoupled-lr", decoupled]
    monkeypatch.setenv("WORLD_SIZE", str(WORLD))
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        args = train_gpt.parse_args(flags)
        assert (args.train_iters, args.lr_warmup_iters) == (iters, warmup)
        out, err = capsys.readouterr()
        assert out == ""
        if reached is None or rank == 1:
            assert err == "", err
            continue
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("train_gpt.py: warning: "), err
        for w in [f"--train-iters {iters}", f"--lr-warmup-iters {warmup}", *reached]:
            assert w in lines[0], (w, lines[0])
        peak = max(train_gpt.lr_at(it, args) for it in range(1, iters + 1))
        assert peak == pytest.approx(float(reached[0].split()[0]), rel=1e-3)
