"""Grad-norm logs worth reading: per-parameter norms and spikes in the logger, the main job's
wiring (per-parameter norms adding up, the LR schedule on skipped steps), and the picture."""

import io
import json
import math
import os
import sys

import pytest
from test_train_gpt import ITERS, ROOT, run_train

import tpamp
from tpamp.param_norms import root_sum_square

NORMS = {"wte.weight": 0.5, "blocks.0.attn.qkv.weight": 2.0, "blocks.1.mlp.fc1.bias": 1.0}


def _logger(tmp_path, top_k):
    out = io.StringIO()
    log = tpamp.TrainingLogger(
        4, log_interval=2, jsonl_path=str(tmp_path / "log.jsonl"), stream=out,
        param_grad_norms_top_k=top_k,
    )
    return log, out


def test_top_k_param_norms_in_the_record_in_model_order_and_a_block_largest_first(tmp_path):
    log, out = _logger(tmp_path, 2)
    rec = log.record(2, 2.0, 1e-3, 8.0, tpamp.StepResult(True, 2.3, None), param_grad_norms=NORMS)
    # the two largest, kept in model order
    assert list(rec["param_grad_norms"].items()) == [
        ("blocks.0.attn.qkv.weight", 2.0), ("blocks.1.mlp.fc1.bias", 1.0)
    ]
    lines = out.getvalue().splitlines()
    assert lines[1] == "   param grad norms (top 2 of 3):"
    assert lines[2].split() == ["blocks.0.attn.qkv.weight", "2.0000E+00"]
    assert lines[3].split() == ["blocks.1.mlp.fc1.bias", "1.0000E+00"]
    # an overflowing param leads (inf first) and is written as null
    rec = log.record(3, 2.0, 1e-3, 8.0, tpamp.StepResult(False, None, None),
                     param_grad_norms=dict(NORMS, **{"wte.weight": math.inf}))
    assert rec["param_grad_norms"] == {"wte.weight": None, "blocks.0.attn.qkv.weight": 2.0}
    log.close()
    assert json.loads(open(tmp_path / "log.jsonl").readlines()[1])["param_grad_norms"]["wte.weight"] is None
    assert log.summary()["param_grad_norm_leaders"] == [
        ["blocks.0.attn.qkv.weight", 1], ["wte.weight", 1]
    ]


def test_spike_skips_are_counted_apart_from_overflow_skips(tmp_path):
    log, out = _logger(tmp_path, None)
    spike = tpamp.SpikeDecision(9.0, 2.0, 12.0, 0.5, spike=True, skipped=True)
    clean = tpamp.SpikeDecision(1.0, 2.0, 0.1, 0.2)
    overflow = tpamp.SpikeDecision(overflow=True)
    log.record(1, 2.0, 1e-3, 8.0, tpamp.StepResult(False, None, None), spike=overflow)
    rec = log.record(2, 2.0, 1e-3, 8.0, tpamp.StepResult(False, None, None), spike=spike)
    log.record(3, 2.0, 1e-3, 8.0, tpamp.StepResult(True, 1.0, None), spike=clean)
    log.record(4, 2.0, 1e-3, 8.0, tpamp.StepResult(True, 1.0, None),
               spike=tpamp.SpikeDecision(5.0, 2.0, 7.0, 0.1, spike=True))  # logged only
    log.close()
    assert rec["spike"] == dict(spike._asdict()) and rec["skipped"] is True
    lines = out.getvalue().splitlines()
    assert "number of skipped iterations:   2 | number of nan iterations:   0 | " \
           "number of spike skips:   1 |" in lines[0]
    assert "number of spike skips:   0 |" in lines[1]
    s = log.summary()
    assert (s["skipped_iterations"], s["overflow_skips"], s["spike_skips"], s["spikes"]) == (2, 1, 1, 2)


def test_gpt_stage_names_use_the_global_layer_index_under_any_pipeline_split():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import gpt_model

    cfg = gpt_model.GPTConfig(seq_length=8, hidden_size=16, num_layers=4, num_attention_heads=2)
    whole = [n for n, _ in gpt_model.GPTStage(cfg, 1, 0).global_named_parameters()]
    stages = [
        [n for n, p in gpt_model.GPTStage(cfg, 2, r).global_named_parameters()
         if not getattr(p, "shared", False)]
        for r in range(2)
    ]
    assert not set(stages[0]) & set(stages[1])
    assert stages[0] + stages[1] == whole  # the same names, in the same order
    assert "blocks.3.mlp.fc2.weight" in stages[1] and "blocks.2.ln_1.bias" in stages[1]


# ----------------------------------------------------------------------------- the main job


@pytest.fixture(scope="module")
def main_job_run(tmp_path_factory):
    """One real 4-rank TP2 x PP2 run with all per-parameter norms, spike skipping on, and a
    large initial loss scale so that the first steps overflow and are skipped."""
    log_dir = tmp_path_factory.mktemp("run")
    records, summary, stdout = run_train(
        log_dir, "--log-param-grad-norms", "1000", "--skip-grad-norm-spikes",
        "--initial-loss-scale", str(2.0**19), "--hysteresis", "1", "--log-interval", "1",
    )
    return log_dir, records, summary, stdout


def test_main_job_param_norms_add_up_to_the_grad_norm_with_global_layer_names(main_job_run):
    _, records, summary, stdout = main_job_run
    checked = 0
    for r in records:
        norms = r["param_grad_norms"]
        # TINY has 2 layers on 2 stages: each block is named by its global index
        assert {"wte.weight", "wpe.weight", "ln_f.weight", "blocks.0.attn.qkv.weight",
                "blocks.1.mlp.fc2.bias"} <= set(norms), sorted(norms)
        assert not any(n.startswith("head") for n in norms)  # the tied copy counts once
        if r["grad_norm"] is not None:
            assert root_sum_square(norms.values()) == pytest.approx(r["grad_norm"], rel=1e-5), r
            checked += 1
    assert checked >= ITERS // 2
    assert "param grad norms (top 28 of 28):" in stdout
    assert summary["spike_policy"] == "skip" and summary["spike_skips"] == 0  # normal run
    leaders = summary["param_grad_norm_leaders"]
    assert leaders and sum(n for _, n in leaders) <= ITERS and leaders[0][0] in records[-1]["param_grad_norms"]


def test_main_job_lr_schedule_advances_only_on_successful_steps(main_job_run):
    _, records, summary, _ = main_job_run
    skipped = [r["skipped"] for r in records]
    assert skipped[0] and not all(skipped), skipped  # the large scale overflowed at first
    assert summary["overflow_skips"] == sum(skipped) and summary["loss_scale_changes"] >= 1
    # TINY: lr 1e-2, warm-up 1 iteration, cosine to min-lr 2e-4 at ITERS (train_gpt.lr_at)
    done = 0
    for r in records:
        step = done + 1  # the schedule's position: successful steps so far + 1
        frac = (step - 1) / (ITERS - 1)
        want = 1e-2 if step <= 1 else 2e-4 + 0.5 * (1e-2 - 2e-4) * (1 + math.cos(math.pi * frac))
        assert r["lr"] == pytest.approx(want, rel=1e-9), (r["iteration"], r["lr"], want)
        done += not r["skipped"]


def test_plot_of_a_real_log_is_a_readable_png(main_job_run, capsys):
    plt = pytest.importorskip("matplotlib.pyplot")
    from tpamp.plot import main as plot_main  # python -m tpamp.plot LOG -o OUT

    log_dir, _, _, _ = main_job_run
    out = os.path.join(log_dir, "plot.png")
    assert plot_main([os.path.join(log_dir, "log.jsonl"), "-o", out]) == 0
    assert capsys.readouterr().out.strip() == out
    img = plt.imread(out)  # H x W x 4 floats in [0, 1]
    h, w = img.shape[:2]
    assert w >= 800 and h >= 600, img.shape
    gray = img[..., :3].mean(axis=2)
    assert (gray < 0.9).mean() > 0.05, "the picture is (nearly) blank"
    assert img[..., :3].std(axis=2).max() > 0.2, "no coloured lines or heatmap"


def test_plot_refuses_a_log_that_is_not_json(tmp_path, capsys):
    from tpamp.plot import main as plot_main

    bad = tmp_path / "log.jsonl"
    bad.write_text('{"iteration": 1}\nnot json\n')
    assert plot_main([str(bad)]) == 2
    assert "log.jsonl:2: not a JSON record" in capsys.readouterr().err


def test_tensorboard_gets_the_top_k_param_norms(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = tpamp.TrainingLogger(2, tensorboard_dir=str(tmp_path / "tb"), param_grad_norms_top_k=2,
                               stream=io.StringIO())
    log.record(1, 2.0, 1e-3, 8.0, tpamp.StepResult(True, 2.3, None), param_grad_norms=NORMS)
    log.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = {t for t in acc.Tags()["scalars"] if t.startswith("grad-norm/")}
    assert tags == {"grad-norm/blocks.0.attn.qkv.weight", "grad-norm/blocks.1.mlp.fc1.bias"}
    assert acc.Scalars("grad-norm/blocks.0.attn.qkv.weight")[0].value == 2.0


# ------------------------------------------------------------ per-parameter update norms

UPDATES = {"wte.weight": 0.01, "blocks.0.attn.qkv.weight": 0.5, "blocks.1.mlp.fc1.bias": 0.02}
RATIOS = {"wte.weight": 1e-3, "blocks.0.attn.qkv.weight": math.inf, "blocks.1.mlp.fc1.bias": 4e-3}


def test_update_norms_in_the_record_top_k_by_update_in_model_order_with_ratios(tmp_path):
    log, out = _logger(tmp_path, 2)
    rec = log.record(2, 2.0, 1e-3, 8.0, tpamp.StepResult(True, 2.3, None), param_grad_norms=NORMS,
                     param_update_norms=UPDATES, param_update_ratios=RATIOS)
    log.close()
    assert list(rec["param_update_norms"].items()) == [
        ("blocks.0.attn.qkv.weight", 0.5), ("blocks.1.mlp.fc1.bias", 0.02)]
    assert rec["param_update_ratios"] == {"blocks.0.attn.qkv.weight": None,  # inf -> null
                                          "blocks.1.mlp.fc1.bias": 4e-3}
    saved = json.loads(open(tmp_path / "log.jsonl").read())
    assert saved["param_update_norms"] == rec["param_update_norms"]
    lines = out.getvalue().splitlines()
    at = lines.index("   param update norms (top 2 of 3; update / param):")
    assert lines[at + 1].split() == ["blocks.0.attn.qkv.weight", "5.0000E-01", "inf"] or \
        lines[at + 1].split()[:2] == ["blocks.0.attn.qkv.weight", "5.0000E-01"]
    assert lines[at + 2].split() == ["blocks.1.mlp.fc1.bias", "2.0000E-02", "4.0000E-03"]


def test_muon_momentum_norms_of_the_top_k_update_params_in_the_record(tmp_path):
    log, _ = _logger(tmp_path, 2)
    rec = log.record(2, 2.0, 1e-3, 8.0, tpamp.StepResult(True, 2.3, None),
                     param_update_norms=UPDATES, param_update_ratios=RATIOS,
                     param_momentum_norms={"blocks.0.attn.qkv.weight": 3.0, "wte.weight": 1.0})
    log.close()
    assert rec["param_momentum_norms"] == {"blocks.0.attn.qkv.weight": 3.0}  # wte: not top 2
    with pytest.raises(ValueError, match="param_momentum_norms needs param_update_norms"):
        log.record(3, 2.0, 1e-3, 8.0, tpamp.StepResult(True, 2.3, None),
                   param_momentum_norms={"wte.weight": 1.0})


def test_update_ratios_without_their_norms_are_refused(tmp_path):
    log, _ = _logger(tmp_path, 2)
    with pytest.raises(ValueError, match="param_update_ratios needs param_update_norms"):
        log.record(2, 2.0, 1e-3, 8.0, tpamp.StepResult(True, 2.3, None), param_update_ratios=RATIOS)
    with pytest.raises(ValueError, match="param_update_ratios needs param_update_norms"):
        log.record(2, 2.0, 1e-3, 8.0, tpamp.StepResult(True, 2.3, None),
                   param_update_norms={"wte.weight": 1.0}, param_update_ratios=RATIOS)
    log.close()


def test_tensorboard_gets_the_top_k_update_norms_and_ratios(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = tpamp.TrainingLogger(2, tensorboard_dir=str(tmp_path / "tb"), param_grad_norms_top_k=2,
                               stream=io.StringIO())
    log.record(1, 2.0, 1e-3, 8.0, tpamp.StepResult(True, 2.3, None),
               param_update_norms=UPDATES, param_update_ratios=RATIOS)
    log.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = {t for t in acc.Tags()["scalars"] if t.startswith("update-")}
    assert tags == {"update-norm/blocks.0.attn.qkv.weight", "update-norm/blocks.1.mlp.fc1.bias",
                    "update-ratio/blocks.1.mlp.fc1.bias"}  # an inf ratio is not written
    assert acc.Scalars("update-norm/blocks.0.attn.qkv.weight")[0].value == 0.5


def test_main_job_logs_update_norms_on_successful_steps_only(main_job_run):
    _, records, _, stdout = main_job_run
    checked = 0
    for r in records:
        if r["skipped"]:
            assert "param_update_norms" not in r
            continue
        norms, ratios = r["param_update_norms"], r["param_update_ratios"]
        assert set(norms) == set(r["param_grad_norms"]) and list(ratios) == list(norms)
        assert not any(n.startswith("head") for n in norms)
        assert all(v is not None and v > 0 for v in norms.values()), norms
        assert all(v is not None and v > 0 for v in ratios.values()), ratios  # 1 for a 0-init bias
        checked += 1
    assert checked >= ITERS // 2
    assert "param update norms (top 28 of 28; update / param):" in stdout


def test_plot_draws_the_update_heatmap_next_to_the_grad_norm_one(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from tpamp.plot import plot_log

    records = []
    for i in range(1, 9):
        rec = {"iteration": i, "loss": 3.0 / i, "grad_norm": 1.0, "loss_scale": 8.0,
               "param_grad_norms": {n: v * i for n, v in NORMS.items()}}
        if i % 2 == 0:
            rec["param_update_norms"] = {n: v * i for n, v in UPDATES.items()}
            rec["param_update_ratios"] = {n: 1e-3 * i for n in UPDATES}
        records.append(rec)
    with_updates = plot_log(records, str(tmp_path / "a.png"))
    without = plot_log([{k: v for k, v in r.items() if not k.startswith("param_update")}
                        for r in records], str(tmp_path / "b.png"))
    # one more panel (the update heatmap) makes the picture taller
    assert plt.imread(with_updates).shape[0] > plt.imread(without).shape[0]
