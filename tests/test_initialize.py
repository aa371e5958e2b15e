"""tpamp.initialize: config validation, the three modes, the model-parallel GradScaler."""

import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from misuse_utils import assert_every_case_refused_by_tpamp, assert_raises_naming, case_ids
from torch import nn

import tpamp
from tests.dist_utils import run_workers
from tpamp.amp_init import (
    ApexAMPConfig,
    ParallelAMPConfig,
    TorchAMPConfig,
    initialize,
    parse_amp_config,
)
from tpamp.amp_torch import ModelParallelGradScaler, TorchAMPModel, TorchAMPOptimizer
from tpamp.grad_scaler import ConstantGradScaler, DynamicGradScaler
from tpamp.model import NaiveAMPModel
from tpamp.optimizer import FP32Optimizer, MixedPrecisionOptimizer
from tpamp.parallel import initialize_model_parallel

HIDDEN, FFN, OUT = 8, 16, 4

# ---- a tiny Megatron-style TP MLP (column- then row-parallel) ------------------------------


def full_weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "ln_w": 1 + 0.1 * torch.randn(HIDDEN, generator=g, dtype=torch.float64),
        "ln_b": 0.1 * torch.randn(HIDDEN, generator=g, dtype=torch.float64),
        "w1": torch.randn(FFN, HIDDEN, generator=g, dtype=torch.float64) / HIDDEN**0.5,
        "b1": 0.1 * torch.randn(FFN, generator=g, dtype=torch.float64),
        "w2": torch.randn(OUT, FFN, generator=g, dtype=torch.float64) / FFN**0.5,
        "b2": 0.1 * torch.randn(OUT, generator=g, dtype=torch.float64),
    }


def data(seed=1, n=32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, HIDDEN, generator=g), torch.randn(n, OUT, generator=g)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        if ctx.group is not None:
            dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        if group is not None:
            dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class TPMLP(nn.Module):
    """LayerNorm -> column-parallel fc1 -> gelu -> row-parallel fc2 (+ replicated bias)."""

    def __init__(self, weights, tp_group=None, tp_rank=0, tp=1):
        super().__init__()
        part = FFN // tp
        sl = slice(tp_rank * part, (tp_rank + 1) * part)
        self.tp_group = tp_group
        self.norm = nn.LayerNorm(HIDDEN)
        self.w1 = nn.Parameter(weights["w1"][sl].float().clone())
        self.b1 = nn.Parameter(weights["b1"][sl].float().clone())
        self.w2 = nn.Parameter(weights["w2"][:, sl].float().clone())
        self.b2 = nn.Parameter(weights["b2"].float().clone())
        with torch.no_grad():
            self.norm.weight.copy_(weights["ln_w"])
            self.norm.bias.copy_(weights["ln_b"])
        if tp > 1:
            for p, dim in ((self.w1, 0), (self.b1, 0), (self.w2, 1)):
                p.tensor_model_parallel = True
                p.partition_dim = dim
                p.partition_stride = 1

    def forward(self, x):
        h = _CopyToTP.apply(self.norm(x), self.tp_group)
        h = F.gelu(F.linear(h, self.w1, self.b1))
        return _ReduceFromTP.apply(F.linear(h, self.w2), self.tp_group) + self.b2


def reference_losses(steps, lr):
    """fp64, unsharded, plain SGD: the independent reference trajectory."""
    model = TPMLP(full_weights()).double()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x, y = data()
    losses = []
    for _ in range(steps):
        loss = F.mse_loss(model(x.double()), y.double())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# ---- config --------------------------------------------------------------------------------


def test_default_config_is_parallel_mode_with_megatron_scaler_defaults():
    cfg = parse_amp_config(None)
    assert isinstance(cfg, ParallelAMPConfig)
    assert (cfg.initial_scale, cfg.min_scale, cfg.growth_factor, cfg.backoff_factor) == (
        2.0**32, 1.0, 2.0, 0.5)
    assert (cfg.growth_interval, cfg.hysteresis, cfg.clip_grad, cfg.log_num_zeros_in_grad) == (
        1000, 2, 1.0, False)
    model = nn.Linear(2, 2)
    m, opt, crit = initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert isinstance(m, NaiveAMPModel) and m.dtype == torch.float16 and crit is None
    assert isinstance(opt, MixedPrecisionOptimizer)
    s = opt.grad_scaler
    assert isinstance(s, DynamicGradScaler)
    assert s.scale.item() == 2.0**32 and s.hysteresis_tracker == 2
    assert (s.min_scale, s.growth_factor, s.backoff_factor, s.growth_interval) == (1.0, 2.0, 0.5, 1000)
    assert opt.clip_grad == 1.0 and not opt.log_num_zeros_in_grad


@pytest.mark.parametrize(
    "fp16,match",
    [
        (dict(mode="parallel", clip_grad_norm=1.0), r"unknown key 'clip_grad_norm'.*did you mean 'clip_grad'"),
        (dict(initial_scael=2.0), r"unknown key 'initial_scael'.*'initial_scale'"),
        (dict(mode="torch", initial_scale=2.0), r"mode='torch'.*unknown key 'initial_scale'.*'init_scale'"),
        (dict(mode="apex", opt_level="O1", bogus=1), r"mode='apex'.*unknown key 'bogus'"),
        (dict(mode="fp8"), r"unknown mode 'fp8'"),
        (dict(dtype="fp64"), r"dtype.*'fp64'"),
        (dict(growth_factor=1.0), r"growth_factor must be > 1.*1.0"),
        (dict(backoff_factor=1.5), r"backoff_factor must be < 1"),
        (dict(hysteresis=0), r"hysteresis must be an int >= 1, got 0"),
        (dict(clip_grad=-1.0), r"clip_grad must be >= 0"),
        (dict(initial_scale=float("inf")), r"initial_scale must be finite"),
        (dict(min_scale=8.0, initial_scale=4.0), r"min_scale 8.0 > initial_scale 4.0"),
        (dict(mode="torch", dtype="tf32"), r"mode='torch'.*dtype must be one of"),
        (dict(mode="apex", opt_level="O4"), r"opt_level must be one of .*'O4'"),
    ],
)
def test_bad_config_raises_value_error_naming_the_key_or_value(fp16, match):
    with pytest.raises(ValueError, match=match):
        parse_amp_config(fp16)


@pytest.mark.parametrize(
    "fp16,match",
    [
        (dict(growth_interval=2.5), r"growth_interval must be an int.*2\.5"),
        (dict(initial_scale="8"), r"initial_scale must be a real number.*'8'"),
        (dict(clip_grad=True), r"clip_grad must be a real number.*True"),
        (dict(log_num_zeros_in_grad="yes"), r"log_num_zeros_in_grad must be True or False.*'yes'"),
        (dict(mode="torch", enabled=1), r"mode='torch'.*enabled must be True or False.*1"),
    ],
)
def test_config_value_of_the_wrong_type_raises_type_error_naming_the_key(fp16, match):
    with pytest.raises(TypeError, match=match):
        parse_amp_config(fp16)


def test_config_accepts_dataclasses_aliases_and_rejects_other_types():
    assert isinstance(parse_amp_config(dict(mode="naive")), ParallelAMPConfig)  # Colossal-AI
    assert isinstance(parse_amp_config(dict(mode="TORCH")), TorchAMPConfig)
    cfg = TorchAMPConfig(init_scale=8.0)
    assert parse_amp_config(cfg) is cfg
    cfg.growth_interval = 0  # changed after construction: validated again
    with pytest.raises(ValueError, match="growth_interval"):
        parse_amp_config(cfg)
    with pytest.raises(TypeError, match="fp16 must be a dict"):
        parse_amp_config("parallel")
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="ParallelState"):
        initialize(model, opt, parallel="tp=2")
    with pytest.raises(TypeError, match="optimizer"):
        initialize(model, None)


def test_parallel_mode_picks_the_optimizer_wrapper_and_scaler_from_dtype():
    def build(**fp16):
        model = nn.Linear(2, 2)
        return initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), fp16=fp16)

    m, opt, _ = build(dtype="torch.bfloat16")
    assert isinstance(opt, MixedPrecisionOptimizer) and opt.grad_scaler is None
    assert m.model.weight.dtype == torch.bfloat16
    m, opt, _ = build(dtype="bf16", loss_scale=128.0)
    assert isinstance(opt.grad_scaler, ConstantGradScaler) and opt.get_loss_scale().item() == 128.0
    m, opt, _ = build(dtype="fp32")
    assert isinstance(opt, FP32Optimizer) and m.model.weight.dtype == torch.float32
    flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    m, opt, _ = build(dtype="torch.tf32")
    try:
        assert isinstance(opt, FP32Optimizer) and torch.backends.cuda.matmul.allow_tf32
    finally:
        m.release()
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == flags


def test_torch_mode_rejects_fp16_params():
    model = nn.Linear(2, 2).half()
    with pytest.raises(ValueError, match="expects fp32 params.*'weight'"):
        initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), fp16=dict(mode="torch"))


def test_apex_mode_without_apex_raises_a_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "apex", None)  # `import apex` fails as when not installed
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ImportError) as e:
        initialize(model, opt, fp16=dict(mode="apex", opt_level="O2", loss_scale="dynamic"))
    msg = str(e.value)
    assert "NVIDIA apex is not installed" in msg
    assert "'parallel'" in msg and "'torch'" in msg
    assert model.weight.dtype == torch.float32  # nothing was changed


def test_apex_config_passes_opt_level_and_given_options_through():
    cfg = parse_amp_config(dict(mode="apex", opt_level="O2", keep_batchnorm_fp32=True, loss_scale=128.0))
    assert isinstance(cfg, ApexAMPConfig)
    assert cfg.apex_kwargs() == {"opt_level": "O2", "keep_batchnorm_fp32": True, "loss_scale": 128.0}


# ---- every mode trains a TP=2 model --------------------------------------------------------


MODES = {
    "parallel-fp16": (dict(mode="parallel", initial_scale=2.0**10, clip_grad=0.0), 2e-2),
    "parallel-bf16": (dict(mode="parallel", dtype="torch.bfloat16", clip_grad=0.0), 5e-2),
    "torch-fp16": (dict(mode="torch", init_scale=2.0**10), 2e-2),
    "torch-bf16": (dict(mode="torch", dtype="bf16", init_scale=2.0**10), 5e-2),
}


def _train_worker(rank, world_size, fp16, steps, lr):
    ps = initialize_model_parallel(world_size)  # TP = world size
    torch.manual_seed(0)
    model = TPMLP(full_weights(), ps.tp_group, ps.tp_rank, ps.dims.tp)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    model, opt, crit = initialize(model, opt, nn.MSELoss(), fp16=fp16, parallel=ps)
    x, y = data()
    losses, results = [], []
    for _ in range(steps):
        loss = crit(model(x), y)
        assert loss.dtype == torch.float32
        opt.scale_loss(loss).backward()
        results.append(opt.step())
        opt.zero_grad()
        losses.append(loss.item())
    # replicated params must stay identical on both TP ranks
    inner = model.model
    for p in (inner.norm.weight, inner.norm.bias, inner.b2):
        others = [torch.empty_like(p) for _ in range(world_size)]
        dist.all_gather(others, p.detach().contiguous())
        assert all(torch.equal(o, others[0]) for o in others)
    return losses, [tuple(r) for r in results]


@pytest.mark.parametrize("name", sorted(MODES))
def test_each_mode_trains_a_tp2_model_along_the_fp64_reference(name):
    fp16, tol = MODES[name]
    steps, lr = 4, 0.2
    ref = reference_losses(steps, lr)
    results = run_workers(_train_worker, 2, fp16, steps, lr)
    (l0, r0), (l1, r1) = results
    assert l0 == l1 and r0 == r1  # both TP ranks see one loss and take the same decisions
    assert all(r[0] for r in r0), r0  # no skipped step at this scale
    assert ref[-1] < ref[0] and l0[-1] < l0[0]
    for got, want in zip(l0, ref):
        assert abs(got - want) <= tol * abs(want), (l0, ref)


# ---- model-parallel GradScaler --------------------------------------------------------------


def _overflow_worker(rank, world_size, use_tpamp):
    ps = initialize_model_parallel(world_size)
    torch.manual_seed(0)
    model = TPMLP(full_weights(), ps.tp_group, ps.tp_rank, ps.dims.tp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if use_tpamp:
        scaler = ModelParallelGradScaler("cpu", init_scale=2.0**8,
                                         model_parallel_group=ps.model_parallel_group)
    else:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    x, y = data()
    stepped = []
    for it in range(3):
        before = [p.detach().clone() for p in model.parameters()]
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        loss = F.mse_loss(out.float(), y)
        scaler.scale(loss).backward()
        if it == 1 and rank == 1:
            model.w1.grad[0, 0] = float("inf")  # only TP rank 1 overflows
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        changed = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
        stepped.append((changed, scaler.get_scale()))
    return stepped


def test_model_parallel_grad_scaler_skips_the_same_steps_on_every_tp_rank():
    r0, r1 = run_workers(_overflow_worker, 2, True)
    assert r0 == r1
    assert [s for s, _ in r0] == [True, False, True]  # iteration 1 skipped on both ranks
    assert r0[1][1] == r0[0][1] * 0.5  # and both backed off


def test_plain_torch_grad_scaler_ranks_disagree_when_one_overflows():
    r0, r1 = run_workers(_overflow_worker, 2, False)
    assert r0[1][0] is True and r1[1][0] is False  # rank 0 stepped, rank 1 skipped
    assert r0[1][1] != r1[1][1]  # and their loss scales diverged


def _torch_amp_loop(scaler, accumulate, overflow_at):
    torch.manual_seed(0)
    model = TPMLP(full_weights())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = data()
    scales = []
    for it in range(4):
        for micro in range(accumulate):
            xs = x[micro::accumulate]
            ys = y[micro::accumulate]
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(xs).float(), ys) / accumulate
            scaler.scale(loss).backward()
        if it == overflow_at:
            model.b2.grad[0] = float("nan")
        scaler.unscale_(opt)  # clip on unscaled grads, as the torch.amp recipe
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return [p.detach().clone() for p in model.parameters()], scales, scaler.state_dict()


def test_model_parallel_grad_scaler_matches_torch_amp_with_accumulation_and_unscale():
    kw = dict(init_scale=2.0**6, growth_interval=2)
    ref = _torch_amp_loop(torch.amp.GradScaler("cpu", **kw), 2, overflow_at=1)
    got = _torch_amp_loop(ModelParallelGradScaler("cpu", **kw), 2, overflow_at=1)
    assert all(torch.equal(a, b) for a, b in zip(ref[0], got[0]))
    assert ref[1] == got[1] and ref[2] == got[2]
    assert ref[1][1] == kw["init_scale"] * 0.5  # the overflow happened and backed off


def _found_inf_worker(rank, world_size):
    # a rank whose optimizer holds no grads still joins the all-reduce and learns of the overflow
    ps = initialize_model_parallel(world_size)
    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = ModelParallelGradScaler("cpu", init_scale=4.0, model_parallel_group=ps.model_parallel_group)
    loss = scaler.scale((p * 2).sum())
    if rank == 0:
        loss.backward()
        p.grad[1] = float("inf")
    scaler.unscale_(opt)
    found = scaler.found_inf(opt).item()
    scaler.step(opt)
    scaler.update()
    return found, scaler.get_scale(), p.detach().tolist()


def test_a_rank_without_grads_joins_the_found_inf_reduction():
    (f0, s0, p0), (f1, s1, p1) = run_workers(_found_inf_worker, 2)
    assert f0 > 0 and f1 > 0 and s0 == s1 == 2.0
    assert p0 == p1 == [1.0, 1.0, 1.0]


def test_torch_mode_optimizer_reports_skips_norm_and_zeros():
    torch.manual_seed(0)
    model = TPMLP(full_weights())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    m, o, crit = initialize(model, opt, nn.MSELoss(),
                            fp16=dict(mode="torch", init_scale=2.0**8, log_num_zeros_in_grad=True))
    assert isinstance(m, TorchAMPModel) and isinstance(o, TorchAMPOptimizer)
    x, y = data()
    loss = crit(m(x), y)
    o.scale_loss(loss).backward()
    # independent reference: the unscaled grads' norm and zero count, computed before the step
    grads = [p.grad.double() / 2.0**8 for p in model.parameters()]
    ref_norm = torch.cat([g.flatten() for g in grads]).norm().item()
    ref_zeros = sum(int((g == 0).sum()) for g in grads)
    ok, norm, zeros = o.step()
    o.zero_grad()
    assert ok and zeros == ref_zeros
    assert norm == pytest.approx(ref_norm, rel=1e-5)
    o.scale_loss(crit(m(x), y)).backward()
    model.w1.grad[0, 0] = float("inf")
    assert tuple(o.step()) == (False, None, None)
    assert o.get_loss_scale().item() == 2.0**7


# ---- misuse: each bad argument or loaded value raises the documented exception type, with a
# message that names the argument or key (docs/spec.md section 14); runner: tests/misuse_utils.py


MISUSE_CASES = [
    # tpamp.initialize configs: scales validated in float32 too
    ("cfg-initial_scale-1e39", lambda: tpamp.parse_amp_config(dict(initial_scale=1e39)), ValueError, ["initial_scale", "float32"]),
    ("cfg-min_scale-1e-50", lambda: tpamp.parse_amp_config(dict(min_scale=1e-50, initial_scale=1.0)), ValueError, ["min_scale", "float32"]),
    ("cfg-max_scale-1e39", lambda: tpamp.parse_amp_config(dict(max_scale=1e39)), ValueError, ["max_scale", "float32"]),
    ("cfg-loss_scale-1e39", lambda: tpamp.parse_amp_config(dict(loss_scale=1e39)), ValueError, ["loss_scale", "float32"]),
    ("cfg-torch-init_scale-1e39", lambda: tpamp.parse_amp_config(dict(mode="torch", init_scale=1e39)), ValueError, ["init_scale", "float32"]),
]


def test_every_case_is_refused_by_tpamp_itself():
    """Ids distinct; each case refused inside tpamp itself (tests/misuse_utils.py)."""
    assert_every_case_refused_by_tpamp(MISUSE_CASES)


@pytest.mark.parametrize("case_id,call,exc,words", MISUSE_CASES, ids=case_ids(MISUSE_CASES))
def test_misuse_raises_a_clear_error_naming_the_argument(case_id, call, exc, words):
    assert_raises_naming(case_id, call, exc, words)
