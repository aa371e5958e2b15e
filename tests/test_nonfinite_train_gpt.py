"""scripts/train_gpt.py names the culprit of its skipped steps (log line and JSONL) with
MixedPrecisionOptimizer on TP2 x PP2 and with the DistributedOptimizer on TP2 x PP2 x DP2, and
--trace-nonfinite logs the agreed activation finding. A loss scale of 1e12 makes the first
steps overflow in backward for sure (the fp16 logits' grads): the last stage holds the first
record, and clean steps carry none."""

from __future__ import annotations

from test_train_gpt import run_train

HUGE_SCALE = ["--initial-loss-scale", "1e12", "--hysteresis", "1", "--train-iters", "3", "--eval-interval", "0"]


def _global_names(num_layers=2):
    names = {"wte.weight", "wpe.weight", "head_weight", "ln_f.weight", "ln_f.bias"}
    for i in range(num_layers):
        for part in ("ln_1", "ln_2", "attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"):
            names |= {f"blocks.{i}.{part}.weight", f"blocks.{i}.{part}.bias"}
    return names


def _check_culprits(records, stdout, dp, num_layers=2):
    skipped = [r for r in records if r["skipped"]]
    assert skipped, "a loss scale of 1e12 must overflow"
    names = _global_names(num_layers)
    for r in records:
        if not r["skipped"]:
            assert "nonfinite" not in r, r
            continue
        info = r["nonfinite"]
        assert 1 <= len(info["first"]) <= 16 and info["total"] >= len(info["first"])
        for c in info["first"]:
            assert c["name"] in names, c
            assert c["tp_rank"] in (0, 1) and c["pp_rank"] in (0, 1) and c["dp_rank"] in range(dp)
            assert c["num_inf"] + c["num_nan"] > 0
        first = info["first"][0]
        assert first["pp_rank"] == 1, first  # the overflow arises in the last stage's backward
        line = (f"skipped: {'inf and nan' if first['num_inf'] and first['num_nan'] else 'nan' if first['num_nan'] else 'inf'} "
                f"in {first['name']} [tp {first['tp_rank']}, pp 1, dp {first['dp_rank']}]")
        assert f" iteration {r['iteration']:8d}/" in stdout and line in stdout, (line, stdout[-3000:])


def test_main_job_names_the_culprit_and_traces_after_a_skip(tmp_path):
    records, summary, stdout = run_train(tmp_path, *HUGE_SCALE, "--trace-nonfinite", "after-skip",
                                         timeout=600)
    _check_culprits(records, stdout, dp=1)
    assert summary["nonfinite_culprits"] and summary["nonfinite_culprits"][0][0] in _global_names()
    traced = [r for r in records if "nonfinite_activation" in r]
    # armed exactly on the iterations after a skipped one
    after_skip = {r["iteration"] + 1 for r in records if r["skipped"]}
    assert {r["iteration"] for r in traced} == after_skip & {r["iteration"] for r in records}
    found = [r["nonfinite_activation"] for r in traced if r["nonfinite_activation"]]
    assert found, "the tracer saw nothing on an iteration that overflowed again"
    for f in found:
        assert f["phase"] in ("forward", "backward") and f["pp_rank"] in (0, 1)
        assert f["problem"] in ("inf", "nan", "near overflow")
    assert "activation trace: " in stdout


def test_main_job_with_the_distributed_optimizer_names_the_culprit_on_dp2(tmp_path):
    records, _, stdout = run_train(
        tmp_path, *HUGE_SCALE, "--use-distributed-optimizer", nproc=8, timeout=900,
    )
    _check_culprits(records, stdout, dp=2)


def test_main_job_names_the_culprit_under_an_interleaved_schedule(tmp_path):
    """TP 2 x PP 2 with Interleaved1F1B, 2 model chunks per rank (4 layers): the skip is agreed
    by every rank, the culprits carry the global names of the one-stage model and the last
    stage's ranks first, and the tracer armed after the skip reports a finding."""
    records, _, stdout = run_train(
        tmp_path, *HUGE_SCALE, "--num-layers", "4", "--pipeline-schedule", "Interleaved1F1B",
        "--num-layers-per-virtual-pipeline-stage", "1", "--trace-nonfinite", "after-skip",
        timeout=600,
    )
    _check_culprits(records, stdout, dp=1, num_layers=4)
    found = [r["nonfinite_activation"] for r in records if r.get("nonfinite_activation")]
    assert found and all(f["phase"] in ("forward", "backward") for f in found), records


def test_main_job_with_fsdp2_names_the_culprit_by_global_name_and_layout(tmp_path):
    """--use-torch-fsdp2 on TP 2 x DP 2: an inf injected into one element of
    blocks.0.mlp.fc1.weight's local grad on global rank 1 (TP rank 1, DP rank 0 in Megatron's
    rank order, TP fastest) at iteration 2 skips that step on every rank, and the log names the
    param by its global name with the rank's coordinates, not "group1.param3 [tp 0, pp ?, dp ?]"."""
    name = "blocks.0.mlp.fc1.weight"
    records, summary, stdout = run_train(
        tmp_path, "--use-torch-fsdp2", "--tensor-model-parallel-size", "2",
        "--pipeline-model-parallel-size", "1", "--train-iters", "3", "--eval-interval", "0",
        "--initial-loss-scale", "1024",
        "--inject-inf-grad", f"2:1:{name}", timeout=600,
    )
    assert (summary["tp"], summary["pp"], summary["dp"]) == (2, 1, 2)
    assert [r["skipped"] for r in records] == [False, True, False], records
    first = records[1]["nonfinite"]["first"]
    assert len(first) == 1 and records[1]["nonfinite"]["total"] == 1, records[1]
    c = first[0]
    assert (c["name"], c["rank"], c["tp_rank"], c["pp_rank"], c["dp_rank"]) == (name, 1, 1, 0, 0), c
    assert c["num_inf"] == 1 and c["num_nan"] == 0, c
    assert f"skipped: inf in {name} [tp 1, pp 0, dp 0]" in stdout, stdout[-3000:]
