"""Resuming scripts/train_gpt.py from a torch.distributed.checkpoint checkpoint (docs/spec.md section 7).

One TP 2 x PP 2 run saves at iteration K and goes on to the end: that uninterrupted run is the
reference. Resumed from K on the same layout, the losses, grad norms and loss scales of K+1..
are bit-identical to it; resumed on TP 1 x PP 1 (one process) and TP 2 x PP 1 x DP 2, the loss
scale is the same and the losses agree to fp16 rounding (the reduction order differs).

The ranks run ``train_gpt.main`` in fork-started processes (no interpreter start-up per rank);
``main`` joins the gloo group through the usual torchrun environment variables.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback

import pytest
import torch._dynamo  # noqa: F401 -- DTensor imports it lazily: once here, not in every rank
import torch.multiprocessing as mp

from tests.dist_utils import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import train_gpt  # noqa: E402

ITERS, K = 6, 3
# global batch 4 on every layout, so the data stream is the same
TINY = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--train-iters", str(ITERS), "--lr", "1e-2", "--lr-warmup-iters", "1",
    "--log-interval", "100", "--eval-interval", "0", "--data-max-bytes", "100000",
    "--no-progress", "--dist-timeout", "60",
    # the scale grows every 2 clean steps: a lost growth tracker would shift the growth
    "--initial-loss-scale", "1024", "--loss-scale-window", "2",
]


def _rank_main(rank, world, port, argv, queue):
    try:
        os.environ.update(
            RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        )
        train_gpt.main(argv)
        queue.put((rank, None))
    except BaseException as e:  # every rank reports its own failure
        queue.put((rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        os._exit(0)


def train(log_dir, *args, world=4, timeout=120.0):
    """Run train_gpt.main on ``world`` fork-started ranks; return the JSONL records."""
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    argv = [*TINY, "--log-dir", str(log_dir), *args]
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, argv, queue)) for r in range(world)]
    for p in procs:
        p.start()
    errors, done, deadline = [], 0, time.monotonic() + timeout
    while done < world and time.monotonic() < deadline:
        if queue.empty():
            if not any(p.is_alive() for p in procs) and queue.empty():
                break
            time.sleep(0.01)
            continue
        rank, err = queue.get()
        done += 1
        if err:
            errors.append(f"--- rank {rank} ---\n{err}")
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    assert not errors, "\n".join(errors)
    assert done == world, f"{done}/{world} ranks finished within {timeout:.0f}s"
    with open(os.path.join(log_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """The reference: TP 2 x PP 2, saving at K (and at the end), run to the end."""
    base = tmp_path_factory.mktemp("ckpt")
    records = train(base / "log", "--save", str(base / "ckpt"), "--save-interval", str(K))
    assert [r["iteration"] for r in records] == list(range(1, ITERS + 1))
    return base / "ckpt", records


def test_checkpoint_directories_follow_megatron(saved_run):
    ckpt_dir, _ = saved_run
    assert open(ckpt_dir / "latest_checkpointed_iteration.txt").read().strip() == str(ITERS)
    for it in (K, ITERS):
        assert (ckpt_dir / f"iter_{it:07d}" / ".metadata").is_file()
        assert (ckpt_dir / f"iter_{it:07d}" / "tpamp_checksums.json").is_file()
    # the saves' staging directories were renamed into place: nothing else is left
    assert sorted(os.listdir(ckpt_dir)) == [
        f"iter_{K:07d}", f"iter_{ITERS:07d}", "latest_checkpointed_iteration.txt"
    ]


def test_the_pp_stages_save_the_names_of_the_unsplit_model(saved_run):
    """Block 1 lives on PP stage 1 and the tied head copy on the last stage; the checkpoint
    names them as the one-stage model does (no head copy: it is wte.weight)."""
    import gpt_model
    import torch.distributed.checkpoint as dcp

    ckpt_dir, _ = saved_run
    keys = dcp.FileSystemReader(str(ckpt_dir / f"iter_{K:07d}")).read_metadata().state_dict_metadata
    cfg = gpt_model.GPTConfig(seq_length=16, hidden_size=32, num_layers=2, num_attention_heads=4)
    whole = {n for n, _ in gpt_model.GPTStage(cfg).named_parameters()}
    assert {k[len("model."):] for k in keys if k.startswith("model.")} == whole
    assert {k[len("optimizer.main_params."):] for k in keys if k.startswith("optimizer.main_params.")} == whole


def test_resume_on_the_same_layout_is_bit_identical(saved_run, tmp_path):
    ckpt_dir, ref = saved_run
    got = train(tmp_path, "--load", str(ckpt_dir), "--ckpt-step", str(K))
    assert [r["iteration"] for r in got] == list(range(K + 1, ITERS + 1))
    for a, b in zip(ref[K:], got):
        for key in ("loss", "grad_norm", "loss_scale", "skipped"):
            assert a[key] == b[key], (key, a, b)
    # the loss scale grew after the checkpoint exactly as in the uninterrupted run
    assert {r["loss_scale"] for r in ref} != {ref[0]["loss_scale"]}


def test_resume_under_another_pipeline_schedule_is_bit_identical(saved_run, tmp_path):
    """Saved under 1F1B (the default), resumed under GPipe on the same layout: the microbatch
    grads are accumulated in the same order, so the numbers are the same to the bit."""
    ckpt_dir, ref = saved_run
    got = train(tmp_path, "--load", str(ckpt_dir), "--ckpt-step", str(K),
                "--pipeline-schedule", "GPipe")
    assert [r["iteration"] for r in got] == list(range(K + 1, ITERS + 1))
    for a, b in zip(ref[K:], got):
        for key in ("loss", "grad_norm", "loss_scale", "skipped"):
            assert a[key] == b[key], (key, a, b)


@pytest.mark.parametrize(
    "layout, world",
    [
        (["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"], 1),
        (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1"], 4),
        (["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
          "--pipeline-schedule", "GPipe"], 4),
    ],
    ids=["tp1_pp1", "tp2_pp1_dp2", "tp1_pp2_dp2_gpipe"],
)
def test_resume_on_another_layout_continues(saved_run, tmp_path, layout, world):
    ckpt_dir, ref = saved_run
    got = train(tmp_path, "--load", str(ckpt_dir), "--ckpt-step", str(K), *layout, world=world)
    assert [r["iteration"] for r in got] == list(range(K + 1, ITERS + 1))
    # the scaler state came back: the same scale, growing at the same iterations
    assert [r["loss_scale"] for r in got] == [r["loss_scale"] for r in ref[K:]]
    fp16_eps = 2.0**-10
    for a, b in zip(ref[K:], got):
        assert not b["skipped"] and math.isfinite(b["loss"]) and math.isfinite(b["grad_norm"])
        assert b["loss"] == pytest.approx(a["loss"], rel=fp16_eps), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=fp16_eps), (a, b)
    # the tolerance is far below what training moved: an untrained model's loss is not in it
    fresh_loss = ref[0]["loss"]
    assert abs(got[0]["loss"] - fresh_loss) > 100 * fp16_eps * fresh_loss, "weights not loaded?"


def test_a_resume_that_does_not_fit_the_run_is_refused_before_anything_loads(saved_run, tmp_path):
    """The trainer's own values (global batch size, data position, RNG, scheduler) are checked
    inside the all-or-nothing load (check_extra), so the refusal is a CheckpointError."""
    ckpt_dir, _ = saved_run
    one = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"]
    with pytest.raises(AssertionError, match=r"CheckpointError: .*global batch size 4, this run has 8"):
        train(tmp_path, "--load", str(ckpt_dir), "--ckpt-step", str(K), *one,
              "--global-batch-size", "8", world=1)
