"""scripts/train_gpt.py with --check-replicas-interval: a bit flipped by --inject-bitflip-* in one
rank's tensor is found at the iteration of the flip and named (param, tensor, group, ranks,
element) on one line, the run stopping with status 3 (raise) or going on with the records in the
JSONL log (warn); the iterations before the flip carry an empty list (no false positive).
TP 2 x DP 2 on 4 gloo ranks, a tiny GPT (tests/test_train_gpt.py's TINY)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from test_train_gpt import ROOT, SCRIPT, TINY, run_train

from tests.dist_utils import free_port

TP2_DP2 = ["--pipeline-model-parallel-size", "1"]  # TINY's TP 2 on 4 ranks: DP 2
ITERS = ["--train-iters", "5", "--eval-interval", "0"]


def _where(rank):  # tpamp.parallel's dense layout with PP 1: rank = dp * 2 + tp
    return f"[tp {rank % 2}, pp 0, dp {rank // 2}]"


def test_warn_logs_the_flipped_master_and_goes_on(tmp_path):
    records, _, out = run_train(
        tmp_path, *TP2_DP2, *ITERS, "--check-replicas-interval", "1", "--on-replica-mismatch",
        "warn", "--inject-bitflip-at-iteration", "3", "--inject-fault-rank", "2",
        "--inject-bitflip-target", "main_param", "--inject-bitflip-param", "blocks.0.ln_1.weight",
        timeout=600)
    assert [r["iteration"] for r in records] == [1, 2, 3, 4, 5]
    assert records[0]["replica_mismatches"] == [] and records[1]["replica_mismatches"] == []
    # the hidden size is 32: element 16 of the LayerNorm weight, the top mantissa bit (22)
    got = records[2]["replica_mismatches"]
    want = {("data-parallel", (0, 2)), ("tensor-parallel", (2, 3))}
    assert {(m["group"], tuple(m["ranks"])) for m in got} == want, got
    for m in got:
        assert (m["name"], m["tensor"], m["start"], m["stop"], m["numel"]) == (
            "blocks.0.ln_1.weight", "main_param", 16, 17, 32), m
        assert m["where"] == [_where(r) for r in m["ranks"]]
    # warn: the run goes on; the corrupted master keeps its replicas apart from then on
    assert all(r["replica_mismatches"] for r in records[3:])


def test_raise_stops_every_rank_with_one_line_naming_the_grad_flip(tmp_path):
    """A flipped bit in rank 1's grad of a TP-sharded weight, before the step: its master and
    moments differ from its DP replica's (rank 3) after the step; rank 1's TP
    peer holds another shard, so only DP sees it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), SCRIPT, *TINY,
           "--log-dir", str(tmp_path), *TP2_DP2, *ITERS, "--check-replicas-interval", "2",
           "--inject-bitflip-at-iteration", "2", "--inject-fault-rank", "1",
           "--inject-bitflip-target", "grad", "--inject-bitflip-param", "blocks.1.mlp.fc1.weight"]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "exitcode: 3" in out or "exitcode  : 3" in out, out[-3000:]
    lines = [ln for ln in out.splitlines() if ln.startswith("train_gpt.py: error: replicas disagree")]
    assert len(lines) == 1, out[-3000:]
    line = lines[0]
    assert line.startswith("train_gpt.py: error: replicas disagree at iteration 2: "), line
    m = re.search(r"bit (\d+) of element (\d+) of blocks\.1\.mlp\.fc1\.weight grad", out)
    assert m, out[-3000:]
    element = int(m.group(2))
    # (the fp16 model param may round to the same value: Adam's first step is ~lr * sign(g))
    for tensor in ("main_param", "exp_avg", "exp_avg_sq"):
        assert (f"blocks.1.mlp.fc1.weight {tensor} over the data-parallel group: rank 1 "
                f"{_where(1)}, rank 3 {_where(3)} disagree in elements [{element}, "
                f"{element + 1})") in line, (tensor, line)
    assert "tensor-parallel" not in line


@pytest.mark.parametrize("flags, words", [
    (["--check-replicas-interval", "-1"], ["--check-replicas-interval", "-1", ">= 0"]),
    (["--check-replicas-interval", "1", "--use-torch-fsdp2"],
     ["--check-replicas-interval", "--use-torch-fsdp2"]),
    (["--inject-bitflip-at-iteration", "0"], ["--inject-bitflip-at-iteration", "0", "--train-iters"]),
    (["--inject-bitflip-at-iteration", "1", "--inject-fault-rank", "9"],
     ["--inject-fault-rank", "9", "WORLD_SIZE"]),
    (["--inject-bitflip-param", "wte.weight"], ["--inject-bitflip-param", "--inject-bitflip-at-iteration"]),
    (["--inject-bitflip-at-iteration", "1", "--inject-bitflip-target", "exp_avg",
      "--use-distributed-optimizer"], ["--inject-bitflip-target", "exp_avg", "sharded"]),
    (["--inject-bitflip-at-iteration", "1", "--fp32"], ["--inject-bitflip-target", "main_param",
                                                        "--fp32"]),
    (["--inject-bitflip-target", "moment"], ["--inject-bitflip-target", "moment"]),
    (["--check-replicas-interval", "x"], ["--check-replicas-interval", "'x'"]),
])
def test_bad_replica_flags_refused_with_one_line(monkeypatch, capsys, flags, words):
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import train_gpt

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(SystemExit) as info:
        train_gpt.parse_args([*TINY, *flags])
    assert info.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("train_gpt.py: error: "), err
    for w in words:
        assert w in err[0], (w, err[0])
