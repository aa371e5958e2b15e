"""scripts/train_gpt.py with ``--optimizer muon`` (docs/spec.md section 17): Muon for the hidden
matrices (Q, K, V apart) and AdamW for the rest, in one tpamp wrapper, trains on TP 2 x PP 2
(fp16, dynamic loss scaling); the flag combinations that cannot apply are refused before start."""

import pytest

from tests.test_train_gpt import check_records, run_train
from tests.test_train_gpt_flags import BASE, run_ranks


def test_muon_trains_on_tp2_pp2(tmp_path):  # the default --muon-tp-mode duplicated
    records, summary, _ = run_train(tmp_path, "--optimizer", "muon", "--initial-loss-scale", "256")
    check_records(records, loss_scaling=True)
    assert summary["optimizer"] == "muon" and summary["tp"] == 2 and summary["pp"] == 2
    assert summary["skipped_iterations"] == 0
    assert summary["final_train_loss"] < summary["first_train_loss"] - 0.5, summary


def test_muon_trains_with_the_layerwise_distributed_optimizer_on_tp2_dp2(tmp_path):
    # Muon's TP mode inside tpamp.LayerWiseDistributedOptimizer: whole matrices per DP rank
    records, summary, _ = run_train(
        tmp_path, "--optimizer", "muon", "--use-distributed-optimizer",
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1",
        "--initial-loss-scale", "256")
    check_records(records, loss_scaling=True)
    assert summary["optimizer"] == "muon" and summary["tp"] == 2 and summary["dp"] == 2, summary
    assert summary["skipped_iterations"] == 0
    assert summary["final_train_loss"] < summary["first_train_loss"] - 0.5, summary


@pytest.mark.parametrize("flags,message", [
    (["--use-distributed-optimizer", "--overlap-grad-reduce"], "expected no --overlap-grad-reduce"),
    (["--exp-avg-dtype", "bf16"], "narrow optimizer state"),
    (["--muon-num-ns-steps", "0"], "expected an int from 1 to 99"),
])
def test_muon_refuses_what_cannot_apply(flags, message):
    results, _ = run_ranks([*BASE, "--optimizer", "muon", *flags])
    assert all(rc == 2 for rc, _, _ in results), results
    assert message in results[0][2], results[0][2]
