"""Per-parameter update norms (tpamp/update_norms.py, ``step(param_update_norms=True)``) equal a
float64 reference of master_new - master_old: single process on every step path (fp32 and bf16
params, one-pass and generic, stochastic rounding, remainders), and under TP 2 x DP 2 and
TP 2 x PP 2 x DP 2 with the DistributedOptimizer against the unsharded model's AdamW step worked
in float64. Steps that do not ask for them do no extra work."""

import math

import pytest
import torch
import torch.distributed as dist
from dist_utils import fused_step_built, run_workers
from model_fixture import FULL_MODEL, full_grads, round_to, shard_params

import tpamp
from tpamp import update_norms
from tpamp.parallel import initialize_model_parallel

NAMES = ["0.weight", "0.bias", "1.weight", "1.bias"]


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(37, 19), torch.nn.Linear(19, 5)).to(dtype)


def _masters(opt, model):
    """float64 copies of every param's master through public API: the fp32 param itself, or
    the fp32 masters that state_dict saves (rebuilt from remainders; the bf16 value itself
    under stochastic rounding)."""
    if model[0].weight.dtype == torch.float32:
        return [p.detach().double().clone() for p in model.parameters()]
    saved = opt.state_dict()["fp32_from_fp16_params"]
    return [t.detach().double().clone() for group in saved for t in group]


CASES = {
    "fp32-onepass": (torch.float32, dict(fused_step=True)),
    "fp32-generic": (torch.float32, dict(fused_step=False)),
    "bf16-onepass": (torch.bfloat16, dict(fused_step=True)),
    "bf16-generic": (torch.bfloat16, dict(fused_step=False)),
    "bf16-remainders": (torch.bfloat16, dict(store_param_remainders=True)),
    "bf16-stochastic-rounding": (torch.bfloat16, dict(master_weights=False,
                                                      stochastic_rounding=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_update_norms_equal_the_fp64_difference_of_the_masters(case):
    dtype, kwargs = CASES[case]
    if kwargs.get("fused_step", True) and not fused_step_built():
        pytest.skip("one-pass kernels not built")
    model = _model(dtype)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    opt = (tpamp.FP32Optimizer(inner, **kwargs) if dtype == torch.float32
           else tpamp.MixedPrecisionOptimizer(inner, **kwargs))
    tracker = opt.track_param_grad_norms(model.named_parameters())
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g).to(dtype)
        old = _masters(opt, model)
        logging = step != 1
        assert opt.step(param_update_norms=logging).update_successful
        new = _masters(opt, model)
        if not logging:
            assert tracker.update_norms is None and tracker.update_ratios is None
            continue
        assert list(tracker.update_norms) == NAMES and list(tracker.update_ratios) == NAMES
        for name, a, b in zip(NAMES, old, new):
            want = float((b - a).norm())
            assert want > 0
            assert tracker.update_norms[name] == pytest.approx(want, rel=1e-5), (step, name)
            assert tracker.update_ratios[name] == pytest.approx(want / float(b.norm()), rel=1e-5)


def test_a_skipped_step_has_no_update_norms_and_a_later_one_has_them():
    model = _model(torch.float16)
    opt = tpamp.MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                        grad_scaler=tpamp.ConstantGradScaler(4.0))
    tracker = opt.track_param_grad_norms(model.named_parameters())
    for p in model.parameters():
        p.grad = torch.full_like(p, 2.0)
    model[1].bias.grad[0] = math.inf
    assert not opt.step(param_update_norms=True).update_successful
    assert tracker.update_norms is None
    for p in model.parameters():
        p.grad = torch.full_like(p, 2.0)
    assert opt.step(param_update_norms=True).update_successful
    # SGD: update = lr x grad / scale = 0.5 x 0.5 per element (exact in fp32)
    for name, p in model.named_parameters():
        assert tracker.update_norms[name] == pytest.approx(0.25 * p.numel() ** 0.5, rel=1e-6)


def test_sync_free_steps_report_update_norms_too():
    if not fused_step_built():
        pytest.skip("one-pass kernels not built")
    model = _model(torch.bfloat16)
    opt = tpamp.MixedPrecisionOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.5, fused=True), sync_free=True)
    tracker = opt.track_param_grad_norms(model.named_parameters())
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.25)
    opt.step(param_update_norms=True)
    for name, p in model.named_parameters():
        assert tracker.update_norms[name] == pytest.approx(0.125 * p.numel() ** 0.5, rel=1e-6)


def test_steps_without_update_norms_copy_nothing(monkeypatch):
    """A step not asking for them makes no snapshot and no norm pass (0 cost), and leaves None."""
    calls = []
    real = update_norms.snapshot_masters
    monkeypatch.setattr(update_norms, "snapshot_masters",
                        lambda masters: calls.append(len(masters)) or real(masters))
    model = _model(torch.bfloat16)
    opt = tpamp.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    tracker = opt.track_param_grad_norms(model.named_parameters())
    for logging in (False, True, False, False):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step(param_grad_norms=True, param_update_norms=logging)
        assert (tracker.update_norms is not None) == logging
        assert tracker.norms is not None  # the grad norms are independent of it
    assert calls == [4]


@pytest.mark.parametrize("bad,exc", [("yes", TypeError), (1, TypeError), (None, TypeError),
                                     (torch.tensor(True), TypeError)])
def test_param_update_norms_must_be_a_bool(bad, exc):
    model = _model(torch.bfloat16)
    opt = tpamp.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    opt.track_param_grad_norms(model.named_parameters())
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(exc, match="param_update_norms must be a bool"):
        opt.step(param_update_norms=bad)
    for a, p in zip(before, model.parameters()):
        assert torch.equal(a, p)  # refused before anything changed


def test_param_update_norms_without_a_tracker_is_refused():
    model = _model(torch.bfloat16)
    opt = tpamp.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="param_update_norms=True.*track_param_grad_norms"):
        opt.step(param_update_norms=True)


def test_reduce_update_norms_refuses_mismatched_lengths():
    model = _model(torch.bfloat16)
    opt = tpamp.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    tracker = opt.track_param_grad_norms(model.named_parameters())
    with pytest.raises(ValueError, match="3 update norms and 4 param norms for 4 params"):
        tracker.reduce_update_norms(torch.ones(3), torch.ones(4), list(model.parameters()),
                                    [True] * 4)


# ---- TP 2 x (PP 2 x) DP 2, DistributedOptimizer and MixedPrecisionOptimizer -------------------

LR, WD, EPS = 0.25, 0.1, 1e-8


def _values():
    g = torch.Generator().manual_seed(7)
    return {k: torch.randn(shape, generator=g, dtype=torch.float64)
            for k, (shape, _, _) in FULL_MODEL.items()}


def _parallel_worker(rank, world, tp, pp, cases):
    st = initialize_model_parallel(tp, pp)
    out = []
    for distributed, fused in cases:
        dp_grads = [full_grads(seed=30 + r) for r in range(st.dims.dp)]  # exact in fp16
        scale = 2.0**8
        params = shard_params(st, dp_grads[st.dp_rank], style="megatron", dtype=torch.float16,
                              grad_scale=scale, values=_values())
        inner = torch.optim.AdamW(list(params.values()), lr=LR, weight_decay=WD, eps=EPS)
        if distributed:
            opt = tpamp.DistributedOptimizer(
                inner, grad_scaler=tpamp.ConstantGradScaler(scale), fused_step=fused,
                data_parallel_group=st.dp_group, grad_stats_group=dist.group.WORLD,
                tensor_parallel_group=st.tp_group, param_names=params.items())
        else:  # each DP rank its own grads, reduced over TP x PP only (no DP)
            opt = tpamp.MixedPrecisionOptimizer(
                inner, grad_scaler=tpamp.ConstantGradScaler(scale), fused_step=fused,
                grad_stats_group=st.model_parallel_group, tensor_parallel_group=st.tp_group)
        tracker = opt.track_param_grad_norms(params.items())
        assert opt.step(param_grad_norms=True, param_update_norms=True).update_successful
        out.append((st.dp_rank, dict(tracker.update_norms), dict(tracker.update_ratios)))
    return out


def _adamw_first_step_reference(grad):
    """The unsharded params after AdamW's first step, in float64: m_hat = g, sqrt(v_hat) = |g|."""
    old = {k: v.half().double() for k, v in _values().items()}  # the fp16 params' values
    return old, {k: old[k] * (1 - LR * WD) - LR * grad[k] / (grad[k].abs() + EPS) for k in old}


LAYOUTS = {  # (tp, pp, world, [(DistributedOptimizer, one-pass step)])
    "tp2-dp2": (2, 1, 4, [(True, True), (True, False), (False, True)]),
    "tp2-pp2-dp2": (2, 2, 8, [(True, True), (True, False)]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_update_norms_equal_the_unsharded_fp64_adamw_update(layout):
    """Each param's update norm is that of the whole (unsharded) param: TP shards and DP pieces
    summed, the TP-replicated params once, the tied head copy (shared, last stage) not at all."""
    tp, pp, world, cases = LAYOUTS[layout]
    results = run_workers(_parallel_worker, world, tp, pp, cases, timeout=120)
    dp_grads = [round_to(full_grads(seed=30 + r), torch.float16) for r in range(2)]
    mean = {k: (dp_grads[0][k] + dp_grads[1][k]) / 2 for k in dp_grads[0]}
    for per_rank in results:
        for (distributed, _), (dp_rank, norms, ratios) in zip(cases, per_rank):
            grad = mean if distributed else dp_grads[dp_rank]  # else: no DP reduce
            old, new = _adamw_first_step_reference(grad)
            assert list(norms) == list(FULL_MODEL)
            for k in FULL_MODEL:
                want = float((new[k] - old[k]).norm())
                assert norms[k] == pytest.approx(want, rel=2e-5), (layout, k, norms[k], want)
                assert ratios[k] == pytest.approx(want / float(new[k].norm()), rel=2e-5)


# ---- TensorParallelMuon: the momentum norm before the orthogonalisation -----------------------


def test_muon_momentum_norms_equal_the_fp64_momentum_of_torch_muon_math():
    """Muon (nesterov) on the 2-D weights, AdamW on the biases, in one CombinedOptimizer: the
    weights get momentum norms (the nesterov update (1-mu) g + mu buf, buf = mu buf + (1-mu) g,
    worked in float64), the biases none; both get update norms."""
    model = _model(torch.bfloat16)
    weights = [model[0].weight, model[1].weight]
    biases = [model[0].bias, model[1].bias]
    mu = 0.9
    muon = tpamp.TensorParallelMuon(weights, lr=0.02, momentum=mu)
    inner = tpamp.CombinedOptimizer([muon, torch.optim.AdamW(biases, lr=1e-2)])
    opt = tpamp.MixedPrecisionOptimizer(inner)
    tracker = opt.track_param_grad_norms(model.named_parameters())
    g = torch.Generator().manual_seed(2)
    buf = {n: 0.0 for n in NAMES}
    for step in range(3):
        grads = {n: torch.randn(p.shape, generator=g).to(torch.bfloat16)
                 for n, p in model.named_parameters()}
        for n, p in model.named_parameters():
            p.grad = grads[n].clone()
        logging = step != 1
        opt.step(param_update_norms=logging)
        assert muon.record_momentum_norms is False  # switched on for the step only
        want = {}
        for n in ("0.weight", "1.weight"):
            gd = grads[n].double()
            buf[n] = mu * buf[n] + (1 - mu) * gd
            want[n] = float(((1 - mu) * gd + mu * buf[n]).norm())
        if not logging:
            assert tracker.momentum_norms is None and muon.momentum_norms is None
            continue
        assert set(tracker.momentum_norms) == {"0.weight", "1.weight"}
        assert set(tracker.update_norms) == set(NAMES)
        for n, w in want.items():
            assert tracker.momentum_norms[n] == pytest.approx(w, rel=1e-5), (step, n)


def test_muon_record_momentum_norms_must_be_a_bool():
    w = torch.nn.Parameter(torch.ones(3, 2))
    muon = tpamp.TensorParallelMuon([w], lr=0.02)
    w.grad = torch.ones(3, 2)
    muon.record_momentum_norms = "yes"
    with pytest.raises(TypeError, match="record_momentum_norms must be a bool, got str"):
        muon.step()
    assert torch.equal(w, torch.ones(3, 2))  # refused before the param changed
