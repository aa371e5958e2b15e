"""The main job's mixture of experts (scripts/gpt_model.py MoEMLP, scripts/train_gpt.py flags).

- One MoE layer, forward and backward, against a single-process float64 reference written here
  token by token (router softmax over the top-k logits, expert MLPs, the switch load-balancing
  loss): in one process (EP 1), and on 4 gloo ranks as TP 2 x EP 2 (tokens dispatched by
  all-to-all, experts TP-sharded).
- End to end (torchrun, 4 CPU ranks, fp32): EP 2 gives the losses of EP 1 on the same global
  model and data; with the expert grad statistics (tpamp.is_expert_param) also the same grad
  norms and zero counts, on TP 2 and on PP 2; a checkpoint saved at EP 2 resumes at EP 1; an
  inf in one expert's grad on one rank skips the step on every rank and names that expert.
"""

from __future__ import annotations

import inspect
import math
import os
import sys

import pytest
import torch

import tpamp
from tests.dist_utils import run_workers
from tests.test_train_gpt import run_train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from gpt_model import (  # noqa: E402
    ExpertParallel,
    GPTConfig,
    MoEAuxLossAutoScaler,
    MoEMLP,
    is_expert_param,
)

E, K, H, COEFF = 4, 2, 16, 0.01
# the expert grad statistics of tpamp's optimizers (found_inf, norm, zeros over the expert
# groups: docs/spec.md section 19)
EXPERT_STATS = "expert_grad_stats_group" in inspect.signature(
    tpamp.MixedPrecisionOptimizer.__init__).parameters
EXPERT_DISTOPT = "expert_data_parallel_group" in inspect.signature(
    tpamp.DistributedOptimizer.__init__).parameters
needs_expert_stats = pytest.mark.skipif(
    not EXPERT_STATS, reason="needs tpamp's expert grad statistics (expert_grad_stats_group)"
)


def _cfg():
    return GPTConfig(vocab_size=256, seq_length=8, hidden_size=H, num_layers=1,
                     num_attention_heads=2, num_experts=E, moe_router_topk=K,
                     moe_aux_loss_coeff=COEFF)


def _weights(seed=0):
    """The full layer in float64: router [E, H], per expert (w1 [4H, H], b1, w2 [H, 4H], b2)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, s=0.3):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * s)

    router = r(E, H, s=1.0)
    experts = [(r(4 * H, H), r(4 * H, s=0.1), r(H, 4 * H), r(H, s=0.1)) for _ in range(E)]
    return router, experts


def _inputs(dp_rank, n=12, seed=1):
    g = torch.Generator().manual_seed(seed + dp_rank)
    x = torch.randn(1, n, H, generator=g, dtype=torch.float64)
    w = torch.randn(1, n, H, generator=g, dtype=torch.float64)  # loss = sum(out * w) + aux
    return x, w


def _gelu_tanh(u):
    return 0.5 * u * (1 + torch.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u**3)))


def reference(x, router, experts):
    """float64, token by token: (out [N, H], aux loss)."""
    x = x.reshape(-1, H)
    n = x.shape[0]
    logits = x @ router.T
    out, counts = [], [0] * E
    for t in range(n):
        top = sorted(range(E), key=lambda e: -float(logits[t, e].detach()))[:K]
        z = logits[t, top]
        p = torch.exp(z - z.max()) / torch.exp(z - z.max()).sum()
        y = torch.zeros(H, dtype=torch.float64)
        for j, e in enumerate(top):
            w1, b1, w2, b2 = experts[e]
            y = y + p[j] * (_gelu_tanh(x[t] @ w1.T + b1) @ w2.T + b2)
            counts[e] += 1
        out.append(y)
    probs = torch.softmax(logits, dim=-1)
    aux = COEFF * E / (K * n * n) * sum(probs[:, e].sum() * counts[e] for e in range(E))
    return torch.stack(out), aux


def _reference_grads(dp_rank, router, experts):
    """(out, x grad, router grad, per-expert grads) of the reference for one DP rank's tokens."""
    x, w = _inputs(dp_rank)
    x = x.clone().requires_grad_(True)
    router = router.clone().requires_grad_(True)
    experts = [tuple(t.clone().requires_grad_(True) for t in ex) for ex in experts]
    out, aux = reference(x, router, experts)
    ((out * w.reshape(-1, H)).sum() + aux).backward()
    return out.detach(), x.grad.reshape(-1, H), router.grad, [[t.grad for t in ex] for ex in experts]


def _load(layer, router, experts):
    with torch.no_grad():
        layer.router.weight.copy_(router)
        for e, ex in layer.experts.items():
            w1, b1, w2, b2 = experts[int(e)]
            ex.fc1.weight.copy_(w1)
            ex.fc1.bias.copy_(b1)
            ex.fc2.weight.copy_(w2)
            ex.fc2.bias.copy_(b2)


def _expert_grads(layer):
    out = {}
    for e, ex in layer.experts.items():
        grads = [ex.fc1.weight.grad, ex.fc1.bias.grad, ex.fc2.weight.grad, ex.fc2.bias.grad]
        out[int(e)] = [g.full_tensor() if hasattr(g, "full_tensor") else g for g in grads]
    return out


def test_moe_layer_matches_the_float64_reference_in_one_process():
    router, experts = _weights()
    layer = MoEMLP(_cfg()).double()
    _load(layer, router, experts)
    MoEAuxLossAutoScaler.set_loss_scale(1.0)
    x, w = _inputs(0)
    x = x.clone().requires_grad_(True)
    out = layer(x)
    (out * w).sum().backward()
    ref_out, ref_x, ref_router, ref_experts = _reference_grads(0, router, experts)
    torch.testing.assert_close(out.reshape(-1, H), ref_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(x.grad.reshape(-1, H), ref_x, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(layer.router.weight.grad, ref_router, rtol=1e-10, atol=1e-12)
    for e, grads in _expert_grads(layer).items():
        for got, want in zip(grads, ref_experts[e]):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # expert params are marked as Megatron marks them, with their global index
    marked = [p for p in layer.parameters() if is_expert_param(p)]
    assert len(marked) == 4 * E and not is_expert_param(layer.router.weight)
    assert sorted({p.expert_index for p in marked}) == list(range(E))


def _tp2_ep2_worker(rank, world):
    import train_gpt
    from gpt_model import parallelize_stage  # noqa: F401 (the plan's styles)
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    st = train_gpt.model_parallel_state(2, 1, 2)  # TP 2 x DP 2, EP 2 = the DP ranks
    assert (st.ep_rank, st.dp_rank, st.tp_rank) == (rank // 2, rank // 2, rank % 2)
    router, experts = _weights()
    layer = MoEMLP(_cfg(), ExpertParallel(2, st.ep_rank, st.ep_group)).double()
    _load(layer, router, experts)
    plan = {}
    for e in layer.experts:
        plan[f"experts.{e}.fc1"] = ColwiseParallel()
        plan[f"experts.{e}.fc2"] = RowwiseParallel()
    parallelize_module(layer, st.tp_mesh, plan, src_data_rank=None)
    MoEAuxLossAutoScaler.set_loss_scale(1.0)
    x, w = _inputs(st.dp_rank)
    x = x.clone().requires_grad_(True)
    out = layer(x)
    (out * w).sum().backward()
    return dict(dp=st.dp_rank, ep=st.ep_rank, out=out.detach().reshape(-1, H), x=x.grad.reshape(-1, H),
                router=layer.router.weight.grad, experts=_expert_grads(layer))


def test_moe_layer_on_tp2_x_ep2_matches_the_float64_reference():
    """4 ranks: TP 2 x DP 2 with EP 2 over the DP ranks (rank r holds experts 2r, 2r + 1 of
    the EP group, each TP-sharded). Each DP rank's output, input grad and router grad are the
    reference's for its own tokens; an expert's grad is the sum of both DP ranks' reference
    grads (its tokens came from both)."""
    results = run_workers(_tp2_ep2_worker, 4, timeout=60)
    router, experts = _weights()
    refs = [_reference_grads(d, router, experts) for d in range(2)]
    tol = dict(rtol=1e-9, atol=1e-11)
    for r in results:
        out, xg, rg, _ = refs[r["dp"]]
        torch.testing.assert_close(r["out"], out, **tol)
        torch.testing.assert_close(r["x"], xg, **tol)
        torch.testing.assert_close(r["router"], rg, **tol)
        assert sorted(r["experts"]) == [2 * r["ep"], 2 * r["ep"] + 1]
        for e, grads in r["experts"].items():
            for j, got in enumerate(grads):
                torch.testing.assert_close(got, refs[0][3][e][j] + refs[1][3][e][j], **tol)


# ----------------------------------------------------------------------------- end to end

MOE = ["--fp32", "--num-experts", "4", "--moe-aux-loss-coeff", "0.01", "--log-interval", "1",
       "--log-num-zeros-in-grad", "--eval-interval", "0", "--train-iters", "6"]


def _series(records, key):
    return [r[key] for r in records]


def _assert_same(a, b, keys, tol=1e-5):
    """Each key equal in every record (floats to ``tol``). ``num_zeros``: equal up to 2 elements.
    The grad of the attention's key bias is exactly 0 in exact arithmetic (softmax is invariant
    to a constant added to a row of scores), so its computed elements are rounding noise around
    0, and whether one of them is exactly 0.0 depends on the summation order, which EP changes
    (an expert's tokens from both DP ranks in one matmul); the counts that EP could get wrong
    (an expert without tokens: 8352 exact zeros here, counted once) are far larger."""
    for key in keys:
        for ra, rb in zip(a, b):
            va, vb = ra[key], rb[key]
            if key == "num_zeros" and va is not None and vb is not None:
                assert abs(va - vb) <= 2, (key, ra, rb)
            elif isinstance(va, float) and isinstance(vb, float):
                assert math.isclose(va, vb, rel_tol=tol, abs_tol=tol), (key, ra, rb)
            else:
                assert va == vb, (key, ra, rb)
    assert len(a) == len(b)


TP2 = ["--pipeline-model-parallel-size", "1"]  # TP 2 x DP 2
PP2 = ["--tensor-model-parallel-size", "1"]  # PP 2 x DP 2
EP2 = ["--expert-model-parallel-size", "2"]
_RUNS: dict = {}


@pytest.fixture
def train(tmp_path_factory):
    """run_train(*MOE, *flags) once per set of flags in this module (runs are shared between
    tests: each is a few torchrun launches). Returns (records, summary, stdout)."""

    def run(*flags):
        if flags not in _RUNS:
            _RUNS[flags] = run_train(tmp_path_factory.mktemp("run"), *MOE, *flags)
        return _RUNS[flags]

    return run


@needs_expert_stats
@pytest.mark.parametrize("layout", [TP2, PP2], ids=["tp2", "pp2"])
def test_ep2_gives_the_losses_grad_norms_and_zeros_of_ep1(train, layout):
    """fp32, clipping at 1.0: the loss, grad norm (dense and expert parts combined, which sets
    the clip coefficient) and zero count of every iteration are EP 1's, on TP 2 x DP 2 and on
    PP 2 x DP 2; nothing is skipped."""
    one, _, _ = train(*layout)
    two, s2, out = train(*layout, *EP2)
    _assert_same(one, two, ["loss", "grad_norm", "num_zeros", "skipped"])
    assert not any(_series(two, "skipped"))
    assert (s2["num_experts"], s2["ep"], s2["dp"]) == (4, 2, 2)
    assert "MoE 4 experts top-2" in out and "(EP 2)" in out


@pytest.mark.skipif(not EXPERT_DISTOPT, reason="needs the distributed optimizer's expert "
                    "groups (expert_data_parallel_group)")
def test_ep2_with_the_distributed_optimizer_matches_ep1(train):
    one, _, _ = train(*TP2, "--use-distributed-optimizer")
    two, _, _ = train(*TP2, "--use-distributed-optimizer", *EP2)
    _assert_same(one, two, ["loss", "grad_norm", "num_zeros", "skipped"])


@needs_expert_stats
def test_ep2_under_fsdp2_gives_the_losses_grad_norms_and_zeros_of_ep2_without(train):
    """DP 4, EP 2, fp32: FSDP2 (dense params over DP, each expert's MLP over expert-DP with the
    grads divided by dp; tpamp.fsdp.fully_shard_experts) gives the losses, grad norms and zero
    counts of the same run without FSDP2; the loss falls and nothing is skipped."""
    dp4 = ("--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", *EP2)
    plain, _, _ = train(*dp4)
    fsdp, _, out = train(*dp4, "--use-torch-fsdp2")
    _assert_same(plain, fsdp, ["loss", "grad_norm", "num_zeros", "skipped"])
    assert not any(_series(fsdp, "skipped"))
    assert fsdp[-1]["loss"] < fsdp[0]["loss"] - 0.5, out[-2000:]
    assert "FSDP2" in out


@needs_expert_stats
def test_a_checkpoint_saved_at_ep2_resumes_at_ep1(train, tmp_path):
    """Save at iteration 3 of an EP 2 run, resume on EP 1 (--ckpt-step 3): iterations 4-6 are
    those of the uninterrupted EP 1 run (expert params and their optimizer state are named by
    the global expert index, so they re-map by name)."""
    full, _, _ = train(*TP2)
    ckpt = str(tmp_path / "ckpt")
    # the whole 6 iterations (the LR schedule depends on --train-iters), saved at 3 and 6
    run_train(tmp_path / "a", *MOE, *TP2, *EP2, "--save", ckpt, "--save-interval", "3")
    resumed, _, out = run_train(tmp_path / "b", *MOE, *TP2, "--load", ckpt, "--ckpt-step", "3")
    assert [r["iteration"] for r in resumed] == [4, 5, 6], out
    _assert_same(full[3:], resumed, ["loss", "grad_norm", "num_zeros"])


@needs_expert_stats
def test_an_inf_in_one_experts_grad_on_one_rank_skips_on_every_rank_and_names_it(tmp_path):
    """TP 2 x DP 2, EP 2: global rank 2 (DP 1 = EP rank 1, expert-DP 0, TP 0) holds experts 2
    and 3; an inf put into expert 3's fc1 weight grad there, after the grad reductions, skips
    iteration 2 on every rank (the log's records and lines come from rank 0, which holds
    experts 0 and 1), and the record and the line name the param with its EP rank."""
    name = "blocks.0.mlp.experts.3.fc1.weight"
    records, _, out = run_train(tmp_path, *MOE, *TP2, *EP2, "--inject-inf-grad", f"2:2:{name}")
    assert _series(records, "skipped") == [False, True, False, False, False, False], out
    culprits = records[1]["nonfinite"]["first"]
    assert culprits[0]["name"] == name, culprits
    # an expert param's record: expert-TP and expert-DP ranks, and its EP rank
    assert (culprits[0]["ep_rank"], culprits[0]["tp_rank"], culprits[0]["dp_rank"]) == (1, 0, 0)
    assert culprits[0]["num_inf"] == 1, culprits
    assert f"in {name} [ep 1" in out, out[-3000:]


# ----------------------------------------------------------------------------- flags

# 4 ranks, TP 2 x PP 1 (DP 2): each case is refused by validate_args with one line naming it
FLAG_BASE = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1",
             "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
             "--seq-length", "32", "--train-iters", "2", "--data-max-bytes", "200000"]
BAD_FLAGS = [
    (["--num-experts", "0"], ["--num-experts", "0", ">= 1"]),
    (["--num-experts", "4", "--moe-router-topk", "5"], ["--moe-router-topk", "5", "--num-experts 4"]),
    (["--num-experts", "4", "--moe-aux-loss-coeff", "-1"], ["--moe-aux-loss-coeff", "-1.0", ">= 0"]),
    (["--num-experts", "3", "--expert-model-parallel-size", "2"],
     ["--expert-model-parallel-size", "2", "divisor of --num-experts 3"]),
    (["--num-experts", "4", "--expert-model-parallel-size", "4"],
     ["--expert-model-parallel-size", "4", "data-parallel size 2"]),
    (["--num-experts", "4", "--expert-tensor-parallel-size", "1"],
     ["--expert-tensor-parallel-size", "1", "--tensor-model-parallel-size 2"]),
    (["--expert-model-parallel-size", "2"], ["--expert-model-parallel-size", "2", "--num-experts N"]),
    (["--moe-router-topk", "1"], ["--moe-router-topk", "1", "--num-experts N"]),
    (["--num-experts", "4", "--use-torch-fsdp2", "--tensor-model-parallel-size", "2",
      "--pipeline-model-parallel-size", "1"],
     ["--use-torch-fsdp2", "--num-experts", "--tensor-model-parallel-size 1"]),
    (["--num-experts", "4", "--use-torch-fsdp2", "--tensor-model-parallel-size", "1",
      "--pipeline-model-parallel-size", "1", "--log-param-grad-norms", "3"],
     ["--log-param-grad-norms", "--use-torch-fsdp2"]),
    (["--inject-inf-grad", "2:wte.weight"], ["--inject-inf-grad", "ITER:RANK:NAME"]),
    (["--inject-inf-grad", "2:4:wte.weight"], ["--inject-inf-grad", "below the 4 ranks"]),
]


def _parse(monkeypatch, flags):
    import train_gpt

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    return train_gpt.parse_args([*FLAG_BASE, *flags])


@pytest.mark.parametrize("flags,words", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_a_bad_moe_flag_is_refused_with_one_line(monkeypatch, capsys, flags, words):
    with pytest.raises(SystemExit) as info:
        _parse(monkeypatch, flags)
    assert info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("train_gpt.py: error: "), lines
    for w in words:
        assert w in lines[0], (w, lines[0])


def test_moe_flags_take_megatrons_defaults(monkeypatch):
    args = _parse(monkeypatch, ["--num-experts", "4", "--expert-model-parallel-size", "2"])
    assert (args.moe_router_topk, args.moe_aux_loss_coeff, args.expert_tensor_parallel_size) \
        == (2, 0.0, 2)
    dense = _parse(monkeypatch, [])
    assert dense.num_experts is None and dense.expert_model_parallel_size == 1
