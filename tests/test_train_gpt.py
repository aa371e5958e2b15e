"""scripts/train_gpt.py end to end: 4 CPU ranks under torchrun, a tiny GPT, a few iterations.

Each end-to-end test launches ``python -m torch.distributed.run --nproc-per-node 4`` in a
subprocess with a timeout and reads the JSONL log and summary.json that the logging rank writes.
The GPTStage tests run one stage in process (no process group: no TP sharding).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tests.dist_utils import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "train_gpt.py")
NUMERICS = [
    "--fp32-residual-connection", "--attention-softmax-in-fp32", "--fp16-lm-cross-entropy",
    "--fp32-final-layernorm",
]
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
    """Every iteration logged once, in order, with docs/spec.md section 5's fields and sane values."""
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


def test_fp16_megatron_numerics_flags_tp2_pp2_train(tmp_path):
    """All of Megatron's fp16 numerics flags at once (fp32 residual stream, so fp32 activations
    between the pipeline stages; fp32 attention softmax; fp16 vocab-parallel cross-entropy) and
    the fp32 final LayerNorm island: the run trains and logs every field."""
    records, summary, stdout = run_train(tmp_path, *NUMERICS)
    check_records(records, loss_scaling=True)
    assert_loss_falls(records)
    assert math.isfinite(records[-1]["val_loss"])
    assert math.isfinite(summary["final_validation_loss"])
    assert (summary["tp"], summary["pp"], summary["dp"]) == (2, 2, 1)
    for flag in NUMERICS:
        name = flag[2:].replace("-", "_")
        assert summary[name] is True, summary
        assert f"+{name}" in stdout
    assert stdout.count("done: ") == 1


@pytest.mark.parametrize("precision", ["--bf16", "--fp32"])
def test_bf16_and_fp32_runs_train_without_loss_scaling(tmp_path, precision):
    records, summary, _ = run_train(tmp_path, precision)
    check_records(records, loss_scaling=False)
    assert summary["dtype"] == {"--bf16": "bfloat16", "--fp32": "float32"}[precision]
    assert summary["skipped_iterations"] == 0 and summary["loss_scale_changes"] == 0
    assert summary["deterministic_grad_norm"] is False  # off unless --deterministic-mode
    assert summary["deterministic_grad_reduction"] is False
    assert_loss_falls(records)


def test_deterministic_mode_reaches_the_optimizer_and_the_run_trains(tmp_path):
    """--deterministic-mode (Megatron-LM's name; --deterministic too) builds the optimizer with
    deterministic_grad_norm=True (the summary reads the optimizer's attribute) under the
    distributed optimizer, and the fp16 run with its loss scaler trains as usual."""
    records, summary, _ = run_train(tmp_path, "--deterministic", "--use-distributed-optimizer",
                                    "--tensor-model-parallel-size", "1", nproc=2)
    check_records(records, loss_scaling=True)
    assert summary["deterministic_grad_norm"] is True and summary["distributed_optimizer"] is True
    assert summary["deterministic_grad_reduction"] is True
    assert (summary["tp"], summary["pp"], summary["dp"]) == (1, 2, 1)


def test_fp32_losses_and_grad_norms_do_not_depend_on_the_layout(tmp_path):
    """TP 2 x PP 2 (vocab-parallel embedding and tied head copy on the last stage, vocab-parallel
    cross-entropy over TP), DP 4 (pp 1, tp 1: the head is the embedding) and PP 2 x DP 2 with
    --use-distributed-optimizer see the same global batches and the same initial model, so in
    fp32 they must compute the same losses and the same global grad norms (tied weight counted
    once). The TP x PP run also has the fp16 numerics flags on, which must change nothing in
    fp32."""
    tp_pp, _, _ = run_train(tmp_path / "tp2pp2", "--fp32", *NUMERICS)
    dp, summary, _ = run_train(
        tmp_path / "dp4", "--fp32", "--tensor-model-parallel-size", "1",
        "--pipeline-model-parallel-size", "1", "--micro-batch-size", "1",
        "--num-microbatches", "1",
    )
    assert (summary["tp"], summary["pp"], summary["dp"]) == (1, 1, 4)
    # PP 2 x DP 2 with the distributed optimizer (grads reduce-scattered in its step, tied
    # embedding grads summed in its main_grad buffers, fp32 state sharded over DP)
    dist_opt, summary, _ = run_train(
        tmp_path / "pp2dp2", "--fp32", "--tensor-model-parallel-size", "1",
        "--micro-batch-size", "1", "--use-distributed-optimizer",
    )
    assert (summary["tp"], summary["pp"], summary["dp"]) == (1, 2, 2)
    assert summary["distributed_optimizer"] is True
    for a, b in [*zip(tp_pp, dp), *zip(tp_pp, dist_opt)]:
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-5), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (a, b)
        if "val_loss" in a:
            assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-5), (a, b)


# ----------------------------------------------------------------------------- GPTStage in process


def _gpt_model():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import gpt_model

    return gpt_model


def _tiny_stage(dtype, **flags):
    gm = _gpt_model()
    cfg = gm.GPTConfig(seq_length=16, hidden_size=32, num_layers=2, num_attention_heads=4, **flags)
    stage = gm.GPTStage(cfg)
    stage.init_weights(7)
    return stage.cast_(dtype)


def test_stage_fp32_island_and_fp32_residual_stream_dtypes():
    stage = _tiny_stage(torch.float16, fp32_residual_connection=True, fp32_final_layernorm=True)
    assert all(p.dtype == torch.float32 for p in stage.ln_f.parameters())
    others = [p for n, p in stage.named_parameters() if not n.startswith("ln_f.")]
    assert others and all(p.dtype == torch.float16 for p in others)
    assert stage.model_dtype == torch.float16
    tokens = torch.randint(256, (2, 16), generator=torch.Generator().manual_seed(0))
    seen = []
    stage.blocks[0].register_forward_hook(lambda m, a, out: seen.append((a[0].dtype, out.dtype)))
    logits = stage(tokens)
    assert seen == [(torch.float32, torch.float32)]  # the residual stream is fp32
    assert logits.dtype == torch.float16 and logits.shape == (2, 16, 256)
    assert torch.isfinite(logits).all()

    plain = _tiny_stage(torch.float16)
    assert all(p.dtype == torch.float16 for p in plain.parameters())
    plain.blocks[0].register_forward_hook(lambda m, a, out: seen.append((a[0].dtype, out.dtype)))
    plain(tokens)
    assert seen[-1] == (torch.float16, torch.float16)


@pytest.mark.parametrize("softmax_in_fp32", [False, True])
def test_stage_explicit_attention_matches_sdpa(softmax_in_fp32):
    """The explicit scale_mask_softmax attention is causal softmax(q k^T / sqrt(d)) v: in fp32
    it matches F.scaled_dot_product_attention; in fp16 it stays close to it."""
    gm = _gpt_model()
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-2)):
        stage = _tiny_stage(dtype, attention_softmax_in_fp32=softmax_in_fp32)
        attn = stage.blocks[0].attn
        x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
        got = attn(x).float()
        qkv = gm.linear(x.float(), attn.qkv.weight.float(), attn.qkv.bias.float())
        q, k, v = (z.transpose(1, 2) for z in qkv.view(2, 16, -1, 3, 8).unbind(dim=3))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(2, 16, -1)
        want = gm.linear(y, attn.proj.weight.float(), attn.proj.bias.float())
        assert torch.allclose(got, want, rtol=tol, atol=tol), (dtype, (got - want).abs().max())


def test_distributed_optimizer_with_overlap_logs_the_same_param_grad_norms(tmp_path):
    """PP 2 x DP 2 in fp32: MixedPrecisionOptimizer (hand DP all-reduce) and
    DistributedOptimizer with --overlap-grad-reduce (reduce-scatters started in backward; the
    tied embedding's bucket waits for its sum over the embedding group) see the same batches
    and model, so they log the same losses, grad norms and per-parameter grad norms (a param
    split across DP shards summed over DP), and the per-parameter norms add up to the grad
    norm (the tied copy counted once)."""
    flags = ["--fp32", "--tensor-model-parallel-size", "1", "--micro-batch-size", "1",
             "--log-param-grad-norms", "1000"]
    mpo, _, _ = run_train(tmp_path / "mpo", *flags)
    dist_opt, summary, _ = run_train(tmp_path / "dist", *flags, "--use-distributed-optimizer",
                                     "--overlap-grad-reduce")
    assert summary["distributed_optimizer"] is True
    logged = 0
    for a, b in zip(mpo, dist_opt):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-5), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (a, b)
        if a.get("param_grad_norms"):
            logged += 1
            na, nb = a["param_grad_norms"], b["param_grad_norms"]
            assert set(na) == set(nb) and len(na) > 4
            for name in na:
                assert nb[name] == pytest.approx(na[name], rel=1e-4, abs=1e-7), name
            assert math.sqrt(sum(v * v for v in nb.values())) == pytest.approx(b["grad_norm"], rel=1e-4)
    assert logged == ITERS // 2  # every --log-interval 2
