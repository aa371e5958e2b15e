"""The shared guards on DistributedOptimizer (docs/spec.md section 2.4), on 2 gloo ranks (DP 2): the step
guard, the all-or-nothing load (validated, and agreed by the DP ranks), the cross-rank
settings check (also for MixedPrecisionOptimizer and the spike detector's settings), and
per-parameter grad norms with the same meaning as MixedPrecisionOptimizer's.

All misuse cases run in ONE pair of worker processes (module fixture); each reports the
exception type and message of every rank and whether its state (params, main_grad buffers,
state_dict bytes) is unchanged after the refusal; the parametrized tests then check them."""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
import torch.distributed as dist
from dist_utils import freeze, run_workers, tensor_bytes
from misuse_utils import set_in as _set_in

import tpamp
from tpamp._guards import wrapped_by

NAN = math.nan
SHAPES = {"w": (5, 3), "b": (7,)}  # 22 elements: with DP 2 a shard boundary inside "w"


def _picture(opt, params):
    out = [freeze(opt.state_dict())]
    for p in params.values():
        out.append(tensor_bytes(p))
        g = getattr(p, "main_grad", None)
        out.append(tensor_bytes(g) if isinstance(g, torch.Tensor) else repr(g))
    if getattr(opt, "spike_detector", None) is not None:
        out.append(freeze(opt.spike_detector.state_dict()))
    return out


def _params(dtype=torch.float16):
    g = torch.Generator().manual_seed(0)
    return {k: torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for k, s in SHAPES.items()}


def _do(params=None, inner=torch.optim.Adam, scaler=None, spike=None, **kw):
    params = params if params is not None else _params()
    sc = tpamp.DynamicGradScaler(**{"initial_scale": 8.0, "growth_interval": 2, "hysteresis": 1,
                                    **(scaler or {})})
    det = tpamp.SpikeDetector(**spike) if spike is not None else None
    opt = tpamp.DistributedOptimizer(
        inner([params["w"], params["b"]], lr=0.1), grad_scaler=sc, spike_detector=det,
        data_parallel_group=dist.group.WORLD, param_names=params.items(), **kw)
    return opt, params


def _backward(opt, params, rank=0, value=1.0):
    loss = sum((p.float() * (value + rank)).sum() for p in params.values())
    opt.scale_loss(loss).backward()


def _stepped(**kw):
    opt, params = _do(**kw)
    _backward(opt, params, dist.get_rank())
    opt.step()
    opt.zero_grad()
    return opt, params, copy.deepcopy(opt.state_dict())


# ---- DistributedOptimizer misuse: (id, setup(rank) -> (opt, params, call), exc, words) --------
# words: one list for every rank, or {rank: list}


def _step_twice(fused):
    def setup(rank):
        opt, params = _do(fused_step=fused)
        _backward(opt, params, rank)
        opt.step()
        return opt, params, opt.step
    return setup


def _late_group(rank):
    opt, params = _do()
    _backward(opt, params, rank)
    opt.optimizer.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
    return opt, params, opt.step


def _main_grad(value):
    def setup(rank):
        opt, params = _do()
        _backward(opt, params, rank)
        params["b"].main_grad = value
        return opt, params, opt.step
    return setup


def _norms_without_tracker(rank):
    opt, params = _do()
    _backward(opt, params, rank)
    return opt, params, lambda: opt.step(param_grad_norms=True)


def _load(edit, on_rank=None, **kw):
    def setup(rank):
        opt, params, sd = _stepped(**kw)
        bad = edit(sd) if on_rank is None or rank == on_rank else sd
        return opt, params, lambda: opt.load_state_dict(bad)
    return setup


def _drop(key):
    def edit(sd):
        del sd[key]
        return sd
    return edit


def _sgd_into_adam(sd):
    sgd, params = _do(inner=lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9))
    _backward(sgd, params, dist.get_rank())
    sgd.step()
    sd["optimizer"] = copy.deepcopy(sgd.state_dict()["optimizer"])
    return sd


def _edit_first_state(key, fn):
    def edit(sd):
        st = next(iter(sd["optimizer"]["state"].values()))
        st[key] = fn(st[key])
        return sd
    return edit


def _nan_at_0(t):
    t = t.clone()
    t.view(-1)[0] = NAN
    return t


def _deferred(value):
    def setup(rank):
        params = _params()
        inner = torch.optim.Adam(list(params.values()), lr=0.1)
        before = [id(p) for p in inner.param_groups[0]["params"]]

        class Watch:  # the inner optimizer keeps its params (nothing converted or sharded)
            def state_dict(self):
                return {"params": [id(p) for p in inner.param_groups[0]["params"]] == before,
                        "wrapped": wrapped_by(inner)}

        def call():
            tpamp.DistributedOptimizer(inner, data_parallel_group=dist.group.WORLD,
                                       grad_scaler=tpamp.ConstantGradScaler(2.0),
                                       deferred_reduce_params=value(params))
        return Watch(), {}, call
    return setup


def _detector_shared(rank):
    det = tpamp.SpikeDetector("skip")
    params = _params()
    mpo = tpamp.MixedPrecisionOptimizer(torch.optim.SGD([params["w"]], lr=0.1),
                                        grad_scaler=tpamp.ConstantGradScaler(2.0), spike_detector=det)
    inner = torch.optim.Adam([params["b"]], lr=0.1)

    class Watch:
        def state_dict(self):
            return {"owner": det.owner is mpo, "inner": inner.param_groups[0]["params"][0] is params["b"],
                    "wrapped": wrapped_by(inner)}

    def call():
        tpamp.DistributedOptimizer(inner, grad_scaler=tpamp.ConstantGradScaler(2.0),
                                   data_parallel_group=dist.group.WORLD, spike_detector=det)
    return Watch(), {}, call


def _track_unnamed(rank):
    opt, params = _do()
    return opt, params, lambda: opt.track_param_grad_norms([("w", params["w"])])


def _wrap_twice(rank):
    opt, params = _do()
    return opt, params, lambda: tpamp.DistributedOptimizer(
        opt.optimizer, grad_scaler=tpamp.ConstantGradScaler(2.0), data_parallel_group=dist.group.WORLD)


SPIKE = dict(policy="skip", window=4, warmup=2)

DO_CASES = [
    ("do-step-twice-fused", _step_twice(True), RuntimeError, ["step", "backward"]),
    ("do-step-twice-generic", _step_twice(False), RuntimeError, ["step", "backward"]),
    ("do-late-param-group", _late_group, RuntimeError, ["param_groups", "wrapped"]),
    ("do-main-grad-shape", _main_grad(torch.ones(3)), ValueError, ["'b'", "main_grad", "shape", "(3,)", "(7,)"]),
    ("do-main-grad-int", _main_grad(torch.ones(7, dtype=torch.int32)), TypeError, ["'b'", "torch.int32"]),
    ("do-main-grad-list", _main_grad([0.0] * 7), TypeError, ["'b'", "list"]),
    ("do-step-norms-without-tracker", _norms_without_tracker, ValueError, ["track_param_grad_norms"]),
    ("do-load-None", _load(lambda sd: None), TypeError, ["state_dict", "None"]),
    ("do-load-list", _load(lambda sd: [sd]), TypeError, ["state_dict", "list"]),
    ("do-load-missing-layout", _load(_drop("layout")), KeyError, ["layout"]),
    ("do-load-missing-optimizer", _load(_drop("optimizer")), KeyError, ["optimizer"]),
    ("do-load-missing-shards", _load(_drop("shard_main_params")), KeyError, ["shard_main_params"]),
    ("do-load-layout-other-dp", _load(_set_in(["layout", "dp_size"], 4)), ValueError, ["layout", "4"]),
    ("do-load-layout-str", _load(_set_in(["layout"], "dp2")), TypeError, ["layout", "str"]),
    ("do-load-scaler-nan", _load(_set_in(["grad_scaler", "scale"], torch.tensor([NAN]))), ValueError, ["grad_scaler", "scale", "nan"]),
    ("do-load-scaler-below-min", _load(_set_in(["grad_scaler", "scale"], torch.tensor([0.5]))), ValueError, ["grad_scaler", "min_scale"]),
    ("do-load-scaler-hysteresis-str", _load(_set_in(["grad_scaler", "hysteresis_tracker"], "1")), TypeError, ["grad_scaler", "hysteresis_tracker"]),
    ("do-load-shard-short", _load(_set_in(["shard_main_params", 0], lambda t: t[:-1].clone())), ValueError, ["shard_main_params", "shape"]),
    ("do-load-shard-fp16", _load(_set_in(["shard_main_params", 0], lambda t: t.half())), ValueError, ["shard_main_params", "torch.float16"]),
    ("do-load-shard-nan", _load(_set_in(["shard_main_params", 0], _nan_at_0)), ValueError, ["shard_main_params", "nan"]),
    ("do-load-shard-extra-bucket", _load(_set_in(["shard_main_params"], lambda xs: xs + xs)), ValueError, ["shard_main_params", "2", "1"]),
    ("do-load-shards-tensor", _load(_set_in(["shard_main_params"], lambda xs: xs[0])), TypeError, ["shard_main_params", "Tensor"]),
    ("do-load-sgd-into-adam", _load(_sgd_into_adam), ValueError, ["betas", "Adam"]),
    ("do-load-exp-avg-nan", _load(_edit_first_state("exp_avg", _nan_at_0)), ValueError, ["exp_avg", "nan"]),
    ("do-load-exp-avg-shape", _load(_edit_first_state("exp_avg", lambda t: torch.zeros(t.numel() + 1))), ValueError, ["exp_avg", "shape"]),
    ("do-load-spike-nan", _load(_set_in(["spike_detector", "windows", "grad_norm"], [NAN]), spike=SPIKE), ValueError, ["spike_detector", "nan"]),
    ("do-load-spike-str", _load(_set_in(["spike_detector", "steps_seen"], "1"), spike=SPIKE), TypeError, ["spike_detector", "steps_seen"]),
    ("do-load-refused-on-rank-1", _load(_set_in(["grad_scaler", "scale"], torch.tensor([NAN])), on_rank=1), ValueError,
     {0: ["refused", "[1]", "nothing"], 1: ["grad_scaler", "nan"]}),
    ("do-deferred-not-a-param", _deferred(lambda ps: [torch.nn.Parameter(torch.ones(2))]), ValueError, ["deferred_reduce_params", "0"]),
    ("do-deferred-wrong-type", _deferred(lambda ps: ["w"]), TypeError, ["deferred_reduce_params", "str"]),
    ("do-detector-shared-with-mpo", _detector_shared, ValueError, ["SpikeDetector", "MixedPrecisionOptimizer"]),
    ("do-track-unnamed-param", _track_unnamed, ValueError, ["name"]),
    ("do-wrap-twice", _wrap_twice, ValueError, ["already", "wrapped"]),
]


# ---- settings that differ across ranks: (id, rank 0 kwargs, rank 1 kwargs, words) -----------

SETTINGS_CASES = [
    ("xr-clip_grad", dict(clip_grad=1.0), dict(clip_grad=2.0), ["clip_grad", "rank 0: 1", "rank 1: 2"]),
    ("xr-norm_type", dict(norm_type=2.0), dict(norm_type=math.inf), ["norm_type", "inf"]),
    ("xr-zeros", dict(log_num_zeros_in_grad=True), dict(), ["log_num_zeros_in_grad"]),
    ("xr-hysteresis", dict(scaler={"hysteresis": 1}), dict(scaler={"hysteresis": 2}), ["hysteresis", "rank 1: 2"]),
    ("xr-growth_interval", dict(), dict(scaler={"growth_interval": 3}), ["growth_interval", "3"]),
    ("xr-bucket_size", dict(), dict(bucket_size=4), ["bucket_size", "None", "4"]),
    ("xr-overlap", dict(overlap_grad_reduce=True), dict(), ["overlap_grad_reduce"]),
    ("xr-reduce-fp32", dict(grad_reduce_in_fp32=False), dict(), ["grad_reduce_in_fp32"]),
    ("xr-det-reduction", dict(deterministic_grad_reduction=True), dict(), ["deterministic_grad_reduction"]),
    ("xr-spike-present", dict(spike=SPIKE), dict(), ["spike_detector", "None"]),
    ("xr-spike-policy", dict(spike=SPIKE), dict(spike={**SPIKE, "policy": "raise"}), ["spike policy", "skip", "raise"]),
    ("xr-spike-window", dict(spike=SPIKE), dict(spike={**SPIKE, "window": 8}), ["spike window", "4", "8"]),
    ("xr-spike-threshold", dict(spike=SPIKE), dict(spike={**SPIKE, "threshold": 3.0}), ["spike threshold", "3"]),
    ("xr-spike-watch", dict(spike=SPIKE), dict(spike={**SPIKE, "watch": ("grad_norm",)}), ["spike watch", "grad_norm"]),
    ("xr-bucket-layout", dict(deferred=True), dict(), ["bucket layout", "2 buckets", "1 buckets"]),
    ("xr-mpo-clip_grad", dict(mpo=True, clip_grad=1.0), dict(mpo=True), ["clip_grad"]),
    ("xr-mpo-hysteresis", dict(mpo=True), dict(mpo=True, scaler={"hysteresis": 3}), ["hysteresis", "3"]),
    ("xr-mpo-spike-policy", dict(mpo=True, spike=SPIKE), dict(mpo=True, spike={**SPIKE, "policy": "log"}), ["spike policy", "log", "skip"]),
    # the inner optimizer's hyperparameters between DP replicas (docs/spec.md section 2.4)
    ("xr-betas", dict(), dict(inner={"betas": (0.8, 0.999)}), ["'betas'", "param", "group", "0", "data-parallel", "rank 0: (0.9, 0.999)", "rank 1: (0.8, 0.999)"]),
    ("xr-lr", dict(), dict(inner={"lr": 0.2}), ["'lr'", "data-parallel", "rank 0: 0.1", "rank 1: 0.2"]),
    ("xr-amsgrad", dict(), dict(inner={"amsgrad": True}), ["'amsgrad'", "data-parallel", "False", "True"]),
    ("xr-mpo-tp-lr", dict(mpo=True, tp=True), dict(mpo=True, tp=True, inner={"lr": 0.2}), ["'lr'", "tensor-parallel", "0.1", "0.2"]),
]


def _settings_setup(kw):
    """The call builds the wrapper (a DistributedOptimizer checks the settings there: a
    different overlap_grad_reduce would already mismatch the first backward's collectives),
    runs a backward and steps (a MixedPrecisionOptimizer checks at its first step). Watched:
    the model params' bytes, their main_grad attribute and the inner optimizer's params."""
    kw = dict(kw)
    is_mpo = kw.get("mpo", False)
    params = _params()
    inner = torch.optim.Adam(list(params.values()), **{"lr": 0.1, **kw.pop("inner", {})})
    before = list(inner.param_groups[0]["params"])

    class Watch:
        def state_dict(self):
            # (a MixedPrecisionOptimizer's construction replaced them by main params: its
            # refusal comes at the step, which must change neither the params nor the scale)
            same = all(a is b for a, b in zip(inner.param_groups[0]["params"], before))
            return {"inner": same or is_mpo,
                    "main_grad": [hasattr(p, "main_grad") for p in params.values()]}

    def call():
        spike = kw.pop("spike", None)
        det = tpamp.SpikeDetector(**spike) if spike else None
        scaler = tpamp.DynamicGradScaler(**{"initial_scale": 8.0, "hysteresis": 1, **kw.pop("scaler", {})})
        if kw.pop("tp", False):  # both ranks TP peers (the params then replicated over TP)
            kw["tensor_parallel_group"] = dist.group.WORLD
        if kw.pop("mpo", False):
            opt = tpamp.MixedPrecisionOptimizer(inner, grad_scaler=scaler, spike_detector=det,
                                                grad_stats_group=dist.group.WORLD, **kw)
        else:
            if kw.pop("deferred", False):
                kw["deferred_reduce_params"] = [params["w"]]
            opt = tpamp.DistributedOptimizer(inner, grad_scaler=scaler, spike_detector=det,
                                             data_parallel_group=dist.group.WORLD, **kw)
        _backward(opt, params, dist.get_rank())
        opt.step()
    return Watch(), params, call


def _run_case(setup, rank):
    opt, params, call = setup(rank)
    before = _picture(opt, params)
    try:
        call()
    except Exception as e:  # reported, not raised: the next case runs
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        return type(e).__name__, str(msg), _picture(opt, params) == before
    return None, "", _picture(opt, params) == before


def _all_cases(rank, world):
    torch.manual_seed(0)
    out = {}
    for cid, setup, _, _ in DO_CASES:
        out[cid] = _run_case(setup, rank)
    for cid, kw0, kw1, _ in SETTINGS_CASES:
        out[cid] = _run_case(lambda r: _settings_setup(kw0 if r == 0 else kw1), rank)
    return out


@pytest.fixture(scope="module")
def results():
    return run_workers(_all_cases, 2, timeout=60)


def _words(words):
    return "(?s)" + "".join(rf"(?=.*(?<![\w]){re.escape(w)}(?![\w]))" for w in words)


@pytest.mark.parametrize("cid,exc,words", [(c[0], c[2], c[3]) for c in DO_CASES], ids=[c[0] for c in DO_CASES])
def test_distributed_optimizer_misuse_is_refused_and_changes_nothing(results, cid, exc, words):
    for rank in range(2):
        name, msg, unchanged = results[rank][cid]
        w = words[rank] if isinstance(words, dict) else words
        assert name == exc.__name__, (rank, name, msg)
        assert re.search(_words(w), msg), f"rank {rank}: {w} not all in: {msg}"
        assert unchanged, f"rank {rank}: the refusal changed state"


@pytest.mark.parametrize("cid,words", [(c[0], c[3]) for c in SETTINGS_CASES], ids=[c[0] for c in SETTINGS_CASES])
def test_settings_that_differ_raise_the_same_error_on_every_rank_before_any_change(results, cid, words):
    msgs = []
    for rank in range(2):
        name, msg, unchanged = results[rank][cid]
        assert name == "ValueError", (rank, name, msg)
        assert re.search(_words(words), msg), f"rank {rank}: {words} not all in: {msg}"
        assert unchanged, f"rank {rank}: the refusal changed state"
        msgs.append(msg)
    assert msgs[0] == msgs[1]


# ---- per-parameter grad norms: the same meaning as MixedPrecisionOptimizer's ------------------


def _grad(name, rank):
    """Exact fp32 grads (multiples of 1/8), different on each DP rank."""
    g = torch.Generator().manual_seed(10 * list(SHAPES).index(name) + rank)
    return torch.round(torch.randn(SHAPES[name], generator=g, dtype=torch.float64) * 8) / 8


def _norms(rank, world, bucket_size, norm_type):
    params = _params(torch.float32)
    opt = tpamp.DistributedOptimizer(
        torch.optim.SGD([params["w"], params["b"]], lr=0.0), data_parallel_group=dist.group.WORLD,
        param_names=params.items(), bucket_size=bucket_size, norm_type=norm_type)
    tracker = opt.track_param_grad_norms(params.items())
    split = {n: len(r) for n, r in opt.shard_ranges().items()}
    for n, p in params.items():
        p.grad = _grad(n, rank).float()
    result = opt.step(param_grad_norms=True)
    return dict(tracker.norms), result.grad_norm, split


@pytest.mark.parametrize("bucket_size,norm_type", [(None, 2.0), (4, 2.0), (None, math.inf)])
def test_param_grad_norms_of_a_param_split_across_dp_shards_match_the_fp64_reference(bucket_size, norm_type):
    out = run_workers(_norms, 2, bucket_size, norm_type, timeout=60)
    mean = {n: (_grad(n, 0) + _grad(n, 1)) / 2 for n in SHAPES}  # the DP mean, fp64
    ref = {n: float(torch.linalg.vector_norm(g, ord=norm_type)) for n, g in mean.items()}
    # "w" lies across the two ranks' shards (22 elements, shards of 11) when in one bucket
    assert bucket_size is not None or (out[0][2].get("w") and out[1][2].get("w"))
    for norms, grad_norm, _ in out:
        assert list(norms) == list(SHAPES)
        for n in SHAPES:
            assert norms[n] == pytest.approx(ref[n], rel=1e-6), n
        assert tpamp.param_norms.root_sum_square(norms.values(), norm_type) == pytest.approx(grad_norm, rel=1e-6)


def _raise_policy(rank, world):
    opt, params = _do(spike=dict(policy="raise", threshold=3.0, window=4, warmup=2, watch=("grad_norm",)))
    for _ in range(3):
        _backward(opt, params, rank)
        opt.step()
        opt.zero_grad()
    _backward(opt, params, rank, value=50.0 * (rank == 0) + 1.0)  # a spike on DP rank 0 only
    scaler = freeze(opt.grad_scaler.state_dict())
    before = [p.detach().clone() for p in params.values()]
    try:
        opt.step()
        raised = False
    except tpamp.GradSpikeError:
        raised = True
    same = all(torch.equal(a, b) for a, b in zip(before, params.values()))
    return raised, same, freeze(opt.grad_scaler.state_dict()) == scaler


def test_spike_policy_raise_raises_on_every_dp_rank_with_the_scaler_as_before():
    for raised, same, scaler_same in run_workers(_raise_policy, 2, timeout=60):
        assert raised and same and scaler_same


# ---- groups that do not match parallel_state (docs/spec.md section 19) -----------------------


def _layout_case(build, params, lr=0.1):
    """build(inner Adam) must raise (the group cases: before any collective); (type, message,
    params unchanged, inner not wrapped)."""
    inner = torch.optim.Adam(list(params.values()), lr=lr)
    before = [tensor_bytes(p) for p in params.values()]
    try:
        build(inner)
    except Exception as e:
        return (type(e).__name__, str(e),
                [tensor_bytes(p) for p in params.values()] == before and wrapped_by(inner) is None)
    return None, "", None


def _layout_cases(rank, world):
    from tpamp.parallel import initialize_model_parallel

    cp = initialize_model_parallel(1, 1, context_parallel_size=2)  # dp 1, cp 2
    ep = initialize_model_parallel(1, 1, expert_model_parallel_size=2)  # dp 2, ep 2, edp 1
    out = {}
    def scaler():
        return tpamp.ConstantGradScaler(1.0)

    out["cp-dp-group"] = _layout_case(lambda inner: tpamp.DistributedOptimizer(
        inner, grad_scaler=scaler(), data_parallel_group=cp.dp_group, parallel_state=cp), _params())
    params = _params()
    out["ep-expert-dp-group"] = _layout_case(lambda inner: tpamp.DistributedOptimizer(
        inner, grad_scaler=scaler(), data_parallel_group=ep.dp_group, parallel_state=ep,
        expert_data_parallel_group=ep.dp_group), {k: tpamp.mark_expert_param(p) for k, p in params.items()})
    out["ep-tp-group"] = _layout_case(lambda inner: tpamp.DistributedOptimizer(
        inner, grad_scaler=scaler(), data_parallel_group=ep.dp_group, parallel_state=ep,
        tensor_parallel_group=ep.dp_group), _params())
    # the DP x CP group: its ranks compare the inner optimizer's hyperparameters too
    out["cp-lr"] = _layout_case(lambda inner: tpamp.DistributedOptimizer(
        inner, grad_scaler=scaler(), data_parallel_group=cp.dp_cp_group, parallel_state=cp),
        _params(), lr=0.1 * (rank + 1))
    # the DP x CP group: the CP ranks' grads are summed, the replicas stay equal
    params = _params(torch.float32)
    opt = tpamp.DistributedOptimizer(torch.optim.SGD(list(params.values()), lr=0.5),
                                     data_parallel_group=cp.dp_cp_group, parallel_state=cp)
    for p in params.values():
        p.grad = torch.full_like(p, float(rank + 1))  # CP ranks' grads differ: mean 1.5
    before = {k: p.detach().clone() for k, p in params.items()}
    opt.step()
    out["cp-dp-cp-group"] = {k: ((p.detach().double() - before[k].double()).tolist(), tensor_bytes(p))
                             for k, p in params.items()}
    return out


@pytest.fixture(scope="module")
def layout_results():
    return run_workers(_layout_cases, 2, timeout=30)


@pytest.mark.parametrize("cid,words", [
    # under cp = 2 the DP group alone would never sum the CP ranks' grads (replicas drift)
    ("cp-dp-group", ["data_parallel_group", "parallel_state.dp_cp_group", "cp = 2", "[0, 1]"]),
    ("ep-expert-dp-group", ["expert_data_parallel_group", "parallel_state.expert_data_parallel_group", "[0, 1]"]),
    ("ep-tp-group", ["tensor_parallel_group", "parallel_state.tp_group", "[0, 1]"]),
    ("cp-lr", ["'lr'", "data-parallel", "[0, 1]", "rank 0: 0.1", "rank 1: 0.2"]),
])
def test_a_group_that_is_not_the_parallel_states_is_refused_before_any_collective(layout_results, cid, words):
    for rank in range(2):
        kind, msg, unchanged = layout_results[rank][cid]
        assert kind == "ValueError", (rank, kind, msg)
        assert re.search(_words(words), msg), f"rank {rank}: {words} not all in: {msg}"
        assert unchanged, f"rank {rank}: the refusal changed the params or wrapped the optimizer"


def test_the_dp_cp_group_steps_both_cp_ranks_with_the_mean_gradient(layout_results):
    for rank in range(2):
        for name, (delta, _) in layout_results[rank]["cp-dp-cp-group"].items():
            flat = torch.tensor(delta, dtype=torch.float64).reshape(-1)  # lr 0.5 x mean 1.5
            torch.testing.assert_close(flat, torch.full_like(flat, -0.75), rtol=0, atol=1e-6)
            assert layout_results[1]["cp-dp-cp-group"][name][1] == layout_results[0]["cp-dp-cp-group"][name][1]
