"""DistributedOptimizer (fp32 main params and state sharded over DP) against independent
references: MixedPrecisionOptimizer fed the DP-averaged gradient in one process, and the fp64
norm and zero count of the unsharded model's DP-averaged gradient."""

import math

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_workers
from model_fixture import FULL_MODEL, full_grads, local_slice, reference_stats, shard_params

import tpamp
from tpamp.parallel import initialize_model_parallel

# odd sizes: with DP 2 or 4 the shard boundaries fall inside params
SHAPES = {"w1": (7, 5), "b1": (7,), "w2": (3, 7), "b2": (3,), "ln": (13,), "w3": (5, 3)}
EPS = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 2.0**-23}


def _values(dtype):
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=g).to(dtype) for k, s in SHAPES.items()}


def _grad(name, shape, rank, step):
    """float64 grad of one DP rank: multiples of 1/16 with <= 7 significant bits (exact in
    fp16, bf16 and fp32, and so is the sum of four of them, scaled by a power of two); a quarter
    of the elements are zero on every rank, so the DP mean has exact zeros."""
    i = list(SHAPES).index(name)
    g = torch.Generator().manual_seed(1000 * step + 10 * i + rank)
    t = torch.round(torch.randn(shape, generator=g, dtype=torch.float64).clamp(-3.9, 3.9) * 16) / 16
    zeros = torch.rand(shape, generator=torch.Generator().manual_seed(1000 * step + i)) < 0.25
    return torch.where(zeros, torch.zeros_like(t), t)


def _groups(params):
    return [
        {"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0, "lr": 5e-3},
    ]


def _scaler(dtype):
    if dtype != torch.float16:
        return None
    return tpamp.DynamicGradScaler(initial_scale=2.0**8, hysteresis=1, growth_interval=2)


def _inner(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(_groups(params), lr=1e-2, momentum=0.9, nesterov=True)
    return torch.optim.AdamW(_groups(params), lr=1e-2)


def _vs_reference(rank, world, cases, steps, inf_step):
    return [_vs_reference_one(rank, world, *case, steps, inf_step, fused)
            for case in cases for fused in (True, False)]


def _vs_reference_one(rank, world, dtype, bucket_size, reduce_in_fp32, kind, steps, inf_step,
                      fused):
    vals = _values(dtype)
    mine = {k: torch.nn.Parameter(v.clone()) for k, v in vals.items()}
    ref = {k: torch.nn.Parameter(v.clone()) for k, v in vals.items()}
    kw = dict(clip_grad=4.0, log_num_zeros_in_grad=True)
    opt = tpamp.DistributedOptimizer(
        _inner(kind, mine), grad_scaler=_scaler(dtype),
        data_parallel_group=dist.group.WORLD, bucket_size=bucket_size,
        grad_reduce_in_fp32=reduce_in_fp32, param_names=mine.items(), fused_step=fused, **kw)
    ref_cls = tpamp.FP32Optimizer if dtype == torch.float32 else tpamp.MixedPrecisionOptimizer
    # the reference is torch.optim's own step (not the one-pass kernel)
    ref_opt = ref_cls(_inner(kind, ref), grad_scaler=_scaler(dtype), fused_step=False, **kw)
    results, ref_results = [], []
    for step in range(steps):
        scale = float(opt.get_loss_scale())
        assert scale == float(ref_opt.get_loss_scale())
        for k, p in mine.items():
            g = _grad(k, SHAPES[k], rank, step) * scale
            if step == inf_step and rank == world - 1 and k == "w2":
                g[1, 2] = math.inf  # one rank's local grad only
            p.grad = g.to(dtype)
        for k, p in ref.items():  # the reference sees the DP mean, computed here in fp64
            mean = sum(_grad(k, SHAPES[k], r, step) for r in range(world)) / world * scale
            if step == inf_step and k == "w2":
                mean[1, 2] = math.inf
            p.main_grad = mean.float()
        if step == 3:  # a schedule through the wrapper's param_groups reaches the shard's groups
            for wrapper in (opt, ref_opt):
                for group in wrapper.param_groups:
                    group["lr"] *= 0.5
        results.append(tuple(opt.step()))
        ref_results.append(tuple(ref_opt.step()))
        # the fused path fills no fp32 main grads; the generic one steps through them
        took_fused = all(p.grad is None for g in opt.param_groups for p in g["params"])
        assert took_fused == fused or not results[-1][0], (fused, step)
        opt.zero_grad()
        ref_opt.zero_grad()
    return (results, ref_results, {k: _np(p) for k, p in mine.items()},
            {k: _np(p) for k, p in ref.items()})


# (model dtype, bucket_size, grad_reduce_in_fp32, inner optimizer) per DP size; each case runs
# with fused_step True and False
CASES = {
    1: [(torch.float16, None, True, "adamw"), (torch.bfloat16, 30, False, "adamw"),
        (torch.bfloat16, None, True, "sgd")],
    2: [(torch.float16, None, True, "adamw"), (torch.float32, 25, True, "adamw"),
        (torch.bfloat16, 30, True, "sgd")],
    4: [(torch.float16, 40, False, "adamw"), (torch.bfloat16, 40, True, "adamw")],
}


@pytest.mark.parametrize("world", sorted(CASES))
def test_matches_mixed_precision_optimizer_fed_dp_averaged_grads(world):
    per_rank = run_workers(_vs_reference, world, CASES[world], 5, 2)
    runs = [(case, fused) for case in CASES[world] for fused in (True, False)]
    for (case, fused), out in zip(runs, zip(*per_rank)):
        _check_vs_reference(case[0], out)


def _check_vs_reference(dtype, out):
    for rank, (got, want, params, ref_params) in enumerate(out):
        assert [r[0] for r in got] == [r[0] for r in want] == [True, True, False, True, True], rank
        for (ok, norm, zeros), (_, ref_norm, ref_zeros) in zip(got, want):
            if ok:
                assert math.isclose(norm, ref_norm, rel_tol=1e-6), (rank, norm, ref_norm)
                assert zeros == ref_zeros and zeros > 0, (rank, zeros, ref_zeros)
            else:
                assert (norm, zeros) == (None, None)
        assert any(r[1] > 4.0 for r in got if r[0]), "the trace never clipped"
        for k in SHAPES:  # within one ulp of the model dtype
            got, want = torch.from_numpy(params[k]), torch.from_numpy(ref_params[k])
            torch.testing.assert_close(got, want, rtol=EPS[dtype], atol=1e-30)
    for k in SHAPES:  # every DP rank holds the same model params after the all-gather
        assert all((o[2][k] == out[0][2][k]).all() for o in out)


def _one_rank(rank, world, reduce_in_fp32, fused, transposed, rebind=False):
    """DP 1, bf16 params (with ``transposed``, w1 a transposed, non-contiguous view; with
    ``rebind``, w2 given new storage after construction): the step of main_grad, which it must
    leave as accumulated, against torch.optim's AdamW through MixedPrecisionOptimizer (the
    reference), and the params stepped where they are."""
    vals = _values(torch.bfloat16)
    vals["w1"] = vals["w1"].t().contiguous()  # (5, 7)
    mine = {k: torch.nn.Parameter(v.clone()) for k, v in vals.items()}
    if transposed:  # strides (1, 5)
        mine["w1"] = torch.nn.Parameter(vals["w1"].t().contiguous().t())
    ref = {k: torch.nn.Parameter(v.clone()) for k, v in vals.items()}
    opt = tpamp.DistributedOptimizer(
        _inner("adamw", mine), data_parallel_group=dist.group.WORLD, clip_grad=4.0,
        grad_reduce_in_fp32=reduce_in_fp32, fused_step=fused)
    if rebind:
        with torch.no_grad():
            mine["w2"].data = mine["w2"].detach().clone()
    ptrs = {k: p.data_ptr() for k, p in mine.items()}
    ref_opt = tpamp.MixedPrecisionOptimizer(_inner("adamw", ref), clip_grad=4.0,
                                            fused_step=False)
    kept = []
    for step in range(3):
        for k in mine:
            g = _grad(k, SHAPES[k], rank, step)
            g = g.t() if k == "w1" else g
            mine[k].main_grad.copy_(g)  # exact in bf16 and fp32
            ref[k].main_grad = g.float()
        fed = {k: p.main_grad.double().clone() for k, p in mine.items()}
        ok_mine, ok_ref = opt.step()[0], ref_opt.step()[0]
        assert ok_mine and ok_ref
        kept.append(all(torch.equal(mine[k].main_grad.double(), fed[k]) for k in mine))
        opt.zero_grad()
        ref_opt.zero_grad()
    assert mine["w1"].is_contiguous() != transposed
    # the one-pass step reads the grad buffer itself: no fp32 grad shard is ever made
    shards = {b.grad_shard is not None for b in opt._buckets}
    assert shards == {not fused}, shards
    return (kept, all(p.data_ptr() == ptrs[k] for k, p in mine.items()),
            {k: _np(p) for k, p in mine.items()}, {k: _np(p) for k, p in ref.items()})


@pytest.mark.parametrize("transposed,rebind", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("reduce_in_fp32", [True, False])
@pytest.mark.parametrize("fused", [True, False])
def test_one_dp_rank_steps_params_in_place_and_leaves_main_grad_as_accumulated(
        reduce_in_fp32, fused, transposed, rebind):
    kept, in_place, params, ref_params = run_workers(_one_rank, 1, reduce_in_fp32, fused,
                                                     transposed, rebind)[0]
    assert kept == [True, True, True]
    assert in_place
    init = _values(torch.bfloat16)
    init["w1"] = init["w1"].t()
    for k in SHAPES:
        got, want = torch.from_numpy(params[k]), torch.from_numpy(ref_params[k])
        assert not torch.equal(got, init[k].double()), k  # the step moved every param
        torch.testing.assert_close(got, want, rtol=EPS[torch.bfloat16], atol=1e-30)


def _layout_norm(rank, world, tp, pp, styles):
    st = initialize_model_parallel(tp, pp)
    return [_layout_norm_one(st, tp, style) for style in styles]


def _layout_norm_one(st, tp, style):
    scale = 2.0**8
    dp_grads = [full_grads(seed=20 + r) for r in range(st.dims.dp)]  # exact in fp16
    values = {k: torch.zeros_like(v) for k, v in dp_grads[0].items()}
    params = shard_params(st, dp_grads[st.dp_rank], style=style, dtype=torch.float16,
                          grad_scale=scale, values=values)
    opt = tpamp.DistributedOptimizer(
        torch.optim.SGD(list(params.values()), lr=1.0),
        grad_scaler=tpamp.ConstantGradScaler(scale), clip_grad=1.0, log_num_zeros_in_grad=True,
        data_parallel_group=st.dp_group, grad_stats_group=dist.group.WORLD,
        tensor_parallel_group=st.tp_group, param_names=params.items())
    ok, norm, zeros = opt.step()
    # SGD(lr=1) from zero params: every model param is -coeff * its DP-mean grad
    mean = {k: sum(g[k] for g in dp_grads) / len(dp_grads) for k in dp_grads[0]}
    ref_l2, _, _, ref_zeros = reference_stats(mean)
    coeff = min(1.0, 1.0 / (ref_l2 + 1e-6))
    for name, p in params.items():
        src = "embed" if name == "head" else name
        want = -coeff * local_slice(mean[src], FULL_MODEL[src][2], tp, st.tp_rank)
        got = p.to_local() if hasattr(p, "to_local") else p
        torch.testing.assert_close(got.detach().double(), want, rtol=2.0**-10, atol=0)
    return ok, norm, zeros, ref_l2, ref_zeros


@pytest.mark.parametrize("tp,pp,styles", [(2, 1, ("dtensor", "megatron")), (1, 2, ("megatron",))])
def test_tp_or_pp_by_dp2_norm_and_zeros_equal_the_unsharded_fp64_reference(tp, pp, styles):
    """Each element of the model's gradient counts once: DP shards once, TP duplicates once, the
    tied head copy (``shared``, last stage) not at all."""
    for per_style in run_workers(_layout_norm, 4, tp, pp, styles):
        for ok, norm, zeros, ref_l2, ref_zeros in per_style:
            assert ok and math.isclose(norm, ref_l2, rel_tol=1e-6), (norm, ref_l2)
            assert zeros == ref_zeros
            assert ref_l2 > 1.0  # the step clipped


def _mlp(dtype):
    torch.manual_seed(3)
    return torch.nn.Sequential(
        torch.nn.Linear(9, 13), torch.nn.Tanh(), torch.nn.Linear(13, 11), torch.nn.Tanh(),
        torch.nn.Linear(11, 3)).to(dtype)


def _train_mlp(rank, dtype, overlap, steps=3, microbatches=2):
    model = _mlp(dtype)
    opt = tpamp.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), grad_scaler=_scaler(dtype),
        clip_grad=1.0, data_parallel_group=dist.group.WORLD, overlap_grad_reduce=overlap,
        bucket_size=30, param_names=model.named_parameters())
    started = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        for mb in range(microbatches):
            x = torch.randn(4, 9, generator=g).to(dtype)
            loss = model(x).float().pow(2).mean() / microbatches
            last = mb == microbatches - 1
            with (opt.no_sync() if not last else torch.enable_grad()):
                opt.scale_loss(loss).backward()
        started.append(all(b.handle is not None for b in opt._buckets))
        assert tuple(opt.step())[0]
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], started, len(opt._buckets)


def _np(t):
    """float64 numpy copy (worker results travel by pickle, not shared memory)."""
    return t.detach().double().numpy().copy()


def _overlap(rank, world):
    return [_overlap_one(rank, dtype) for dtype in (torch.float16, torch.bfloat16, torch.float32)]


def _overlap_one(rank, dtype):
    on, started_on, nbuckets = _train_mlp(rank, dtype, True)
    off, started_off, _ = _train_mlp(rank, dtype, False)
    same = all(torch.equal(a, b) for a, b in zip(on, off))
    # a second backward into an already-sent bucket is refused, not silently dropped
    model = _mlp(dtype)
    opt = tpamp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), grad_scaler=_scaler(dtype),
        data_parallel_group=dist.group.WORLD, overlap_grad_reduce=True)
    x = torch.ones(2, 9, dtype=dtype)
    model(x).float().sum().backward()
    try:
        model(x).float().sum().backward()
        err = None
    except RuntimeError as e:
        err = str(e)
    opt.zero_grad()
    return same, started_on, started_off, nbuckets, err


def test_overlap_grad_reduce_gives_identical_params_in_fp16_bf16_fp32():
    for same, started_on, started_off, nbuckets, err in sum(run_workers(_overlap, 2), []):
        assert same
        assert all(started_on) and not any(started_off)  # the reduce-scatters began in backward
        assert nbuckets >= 3
        assert err is not None and "no_sync" in err


def _memory(rank, world):
    shapes = [(333, 7), (1001,), (17, 129), (257,)]
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).half()) for s in shapes]
    n = sum(p.numel() for p in params)
    opt = tpamp.DistributedOptimizer(
        torch.optim.AdamW(params, lr=1e-3), grad_scaler=tpamp.ConstantGradScaler(1.0),
        data_parallel_group=dist.group.WORLD)
    for p in params:
        p.grad = torch.ones_like(p)
    assert opt.step()[0]
    mains = [p for grp in opt.optimizer.param_groups for p in grp["params"]]
    main_numel = sum(p.numel() for p in mains)
    state = sum(v.numel() * v.element_size() for s in opt.optimizer.state.values()
                for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    return n, main_numel, main_numel * 4 + state, all(p.dtype == torch.float32 for p in mains)


def test_fp32_state_per_rank_is_one_dp_th_of_the_unsharded_optimizers():
    out = run_workers(_memory, 4)
    n = out[0][0]
    assert sum(o[1] for o in out) == n  # each element is owned by exactly one DP rank
    for _, _, nbytes, fp32 in out:
        assert fp32
        assert nbytes <= 1.05 * 12 * n / 4 + 2**20, (nbytes, 12 * n)


def _errors(rank, world):
    msgs = {}
    p = torch.nn.Parameter(torch.full((5,), float(rank == 1)).half())  # differs on rank 1
    q = torch.nn.Parameter(torch.zeros(3).half())
    try:
        tpamp.DistributedOptimizer(
            torch.optim.SGD([q, p], lr=1.0), grad_scaler=tpamp.ConstantGradScaler(1.0),
            data_parallel_group=dist.group.WORLD, param_names={p: "layer.weight", q: "layer.bias"})
    except ValueError as e:
        msgs["differ"] = str(e)
    only_rank0 = dist.new_group([0])
    try:
        tpamp.DistributedOptimizer(
            torch.optim.SGD([q], lr=1.0), grad_scaler=tpamp.ConstantGradScaler(1.0),
            data_parallel_group=only_rank0)
        msgs["member"] = None
    except ValueError as e:
        msgs["member"] = str(e)
    for key, kw in {"fp16": {}, "none": dict(data_parallel_group=None)}.items():
        kw.setdefault("data_parallel_group", dist.group.WORLD)
        try:
            tpamp.DistributedOptimizer(torch.optim.SGD([q], lr=1.0), **kw)
        except ValueError as e:
            msgs[key] = str(e)
    try:
        tpamp.DistributedOptimizer(
            torch.optim.SGD([q], lr=1.0), grad_scaler=tpamp.ConstantGradScaler(1.0),
            data_parallel_group=dist.group.WORLD, tensor_parallel_group=dist.group.WORLD)
    except ValueError as e:
        msgs["stats"] = str(e)
    inner = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3).half())], lr=1.0)
    tpamp.DistributedOptimizer(inner, grad_scaler=tpamp.ConstantGradScaler(1.0),
                               data_parallel_group=dist.group.WORLD)
    for key, wrap in {"twice": tpamp.DistributedOptimizer,
                      "then_mpo": tpamp.MixedPrecisionOptimizer}.items():
        kw = dict(data_parallel_group=dist.group.WORLD) if key == "twice" else {}
        try:
            wrap(inner, grad_scaler=tpamp.ConstantGradScaler(1.0), **kw)
            msgs[key] = None
        except ValueError as e:
            msgs[key] = str(e)
    return msgs


def test_bad_input_gets_clear_errors():
    out = run_workers(_errors, 2)
    for rank, msgs in enumerate(out):
        assert "'layer.weight'" in msgs["differ"] and "data-parallel" in msgs["differ"]
        assert ("not a member" in (msgs["member"] or "")) == (rank == 1), msgs["member"]
        assert "loss scaler" in msgs["fp16"]
        assert "data_parallel_group" in msgs["none"] and "None" in msgs["none"]
        assert "grad_stats_group has 2 ranks" in msgs["stats"]
        # one inner optimizer, one wrapper: a second would step copies that never reach the model
        assert "already wrapped by a tpamp DistributedOptimizer" in (msgs["twice"] or "")
        assert "already wrapped by a tpamp DistributedOptimizer" in (msgs["then_mpo"] or "")


def _resume_same_layout(rank, world):
    import io

    def make(offset):
        params = {k: torch.nn.Parameter(v.clone() + offset)
                  for k, v in _values(torch.bfloat16).items()}
        opt = tpamp.DistributedOptimizer(
            torch.optim.AdamW(_groups(params), lr=1e-2), clip_grad=4.0,
            data_parallel_group=dist.group.WORLD, bucket_size=40)
        return params, opt

    def train(params, opt, start, n):
        for step in range(start, start + n):
            for k, p in params.items():
                p.grad = _grad(k, SHAPES[k], rank, step).to(p.dtype)
            opt.step()
            opt.zero_grad()

    params, opt = make(0.0)
    train(params, opt, 0, 2)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    train(params, opt, 2, 2)
    want = {k: _np(p) for k, p in params.items()}
    params, opt = make(1.0)  # another init: everything must come from the state dict
    buf.seek(0)
    opt.load_state_dict(torch.load(buf, weights_only=False))
    train(params, opt, 2, 2)
    return all((_np(p) == want[k]).all() for k, p in params.items())


def test_state_dict_resume_on_the_same_layout_is_bit_identical():
    assert all(run_workers(_resume_same_layout, 2))


def _spike_skip(rank, world):
    return [_spike_skip_one(rank, fused) for fused in (True, False)]


def _spike_skip_one(rank, fused):
    vals = _values(torch.float16)
    mine = {k: torch.nn.Parameter(v.clone()) for k, v in vals.items()}
    scaler = tpamp.DynamicGradScaler(initial_scale=2.0**4, hysteresis=1, growth_interval=1)
    opt = tpamp.DistributedOptimizer(
        torch.optim.AdamW(_groups(mine), lr=1e-2), grad_scaler=scaler,
        data_parallel_group=dist.group.WORLD, param_names=mine.items(),
        spike_detector=tpamp.SpikeDetector("skip", threshold=3.0, window=4, warmup=3,
                                           watch=("grad_norm",)),
        fused_step=fused)
    skipped = []
    for step in range(5):
        scale = float(opt.get_loss_scale())
        for k, p in mine.items():
            g = _grad(k, SHAPES[k], rank, step)
            if step == 4 and rank == 0:
                g = g * 50.0  # one rank spikes (still finite in fp16): the reduced norm is ~25x
            p.grad = (g * scale).to(torch.float16)
        before = ({k: p.detach().clone() for k, p in mine.items()},
                  float(opt.get_loss_scale()), scaler.growth_tracker)
        result = opt.step()
        opt.zero_grad()
        skipped.append(not result.update_successful)
    after = ({k: p.detach().clone() for k, p in mine.items()}, float(opt.get_loss_scale()),
             scaler.growth_tracker)
    params_same = all(torch.equal(before[0][k], after[0][k]) for k in mine)
    return skipped, params_same, before[1] == after[1], opt.spike_detector.spike_skips


def test_a_grad_norm_spike_is_skipped_on_every_dp_rank_with_the_scale_untouched():
    # growth_interval=1: a clean step doubles the scale, so a restored scaler shows
    out = run_workers(_spike_skip, 2)
    for skipped, params_same, scale_same, spike_skips in (r for rank in out for r in rank):
        assert skipped == [False, False, False, False, True]
        assert params_same and scale_same and spike_skips == 1
