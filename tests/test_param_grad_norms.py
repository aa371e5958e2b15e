"""Per-parameter grad norms (tpamp/param_norms.py) under TP x PP equal those of the unsharded
model's gradients computed in fp64 in one process, and add up to the global grad norm."""

import math

import pytest
import torch
from dist_utils import run_workers
from model_fixture import FULL_MODEL, full_grads, round_to, shard_params

import tpamp
from tpamp.parallel import initialize_model_parallel
from tpamp.param_norms import root_sum_square

CASES = [("megatron", torch.float16), ("dtensor", torch.float32)]


def _step_with_param_norms(st, style, dtype):
    grads = round_to(full_grads(seed=4), dtype)
    scale = 2.0**10 if dtype == torch.float16 else 1.0
    params = shard_params(st, grads, style=style, dtype=dtype, grad_scale=scale)
    opt = tpamp.MixedPrecisionOptimizer(
        torch.optim.SGD(list(params.values()), lr=0.1),
        grad_scaler=tpamp.ConstantGradScaler(scale) if dtype == torch.float16 else None,
        grad_stats_group=st.model_parallel_group,
        tensor_parallel_group=st.tp_group,
    )
    # "head" (the last stage's tied copy, shared=True) is named too: it must not count
    tracker = opt.track_param_grad_norms(params.items())
    result = opt.step(param_grad_norms=True)
    return tracker.names, tracker.norms, result.grad_norm, st.pp_rank


def _stage_local_names(st):
    p = torch.nn.Parameter(torch.ones(2))
    opt = tpamp.FP32Optimizer(
        torch.optim.SGD([p], lr=0.1),
        grad_stats_group=st.model_parallel_group,
        tensor_parallel_group=st.tp_group,
    )
    try:
        opt.track_param_grad_norms([("layers.0.weight", p)])  # the same name on both stages
    except ValueError as e:
        return str(e)
    return None


def _tp2_pp2_worker(rank, world):
    st = initialize_model_parallel(2, 2)
    steps = [_step_with_param_norms(st, style, dtype) for style, dtype in CASES]
    return steps, _stage_local_names(st)


@pytest.fixture(scope="module")
def tp2_pp2():
    """One 4-rank TP2 x PP2 run of every case (forking ranks is the slow part)."""
    return run_workers(_tp2_pp2_worker, 4)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{s}-{d}" for s, d in CASES])
def test_tp2_pp2_param_norms_equal_unsharded_fp64_and_add_up_to_the_grad_norm(tp2_pp2, case):
    style, dtype = CASES[case]
    grads = round_to(full_grads(seed=4), dtype)
    ref = {name: float(g.norm()) for name, g in grads.items()}  # fp64, the full tensors
    ref_total = math.sqrt(math.fsum(v * v for v in ref.values()))
    first = [n for n, (_, where, _) in FULL_MODEL.items() if where == "first"]
    last = [n for n, (_, where, _) in FULL_MODEL.items() if where == "last"]
    for steps, _ in tp2_pp2:
        names, norms, grad_norm, pp_rank = steps[case]
        # every param of the whole model once, the first stage's before the last stage's
        assert names == first + last and list(norms) == names, (pp_rank, names)
        for name, want in ref.items():
            assert math.isclose(norms[name], want, rel_tol=1e-6), (name, norms[name], want)
        assert math.isclose(grad_norm, ref_total, rel_tol=1e-6)
        assert math.isclose(root_sum_square(norms.values()), grad_norm, rel_tol=1e-6)


def test_the_same_name_on_two_pipeline_stages_is_refused_on_every_rank(tp2_pp2):
    for _, msg in tp2_pp2:
        assert msg is not None and "'layers.0.weight' comes from two TP groups" in msg, msg


def _model_and_opt():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).half()
    opt = tpamp.MixedPrecisionOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), grad_scaler=tpamp.ConstantGradScaler(8.0)
    )
    return model, opt


def test_an_unnamed_param_is_refused_naming_the_count():
    model, opt = _model_and_opt()
    with pytest.raises(ValueError, match="1 param\\(s\\) of the optimizer have no name"):
        opt.track_param_grad_norms(list(model.named_parameters())[:-1])


def test_step_asking_for_param_norms_without_names_is_refused():
    model, opt = _model_and_opt()
    with pytest.raises(ValueError, match="needs track_param_grad_norms"):
        opt.step(param_grad_norms=True)


def test_overflow_step_shows_which_param_overflowed():
    model, opt = _model_and_opt()
    tracker = opt.track_param_grad_norms(model.named_parameters())
    for name, p in model.named_parameters():
        p.grad = torch.full_like(p, 0.5)
    model[1].bias.grad[0] = math.inf
    result = opt.step(param_grad_norms=True)
    assert not result.update_successful
    assert tracker.norms["1.bias"] == math.inf
    # 0.5 * 1/8 per element, unscaled, in the three finite params
    for name, n in (("0.weight", 12), ("0.bias", 4), ("1.weight", 8)):
        assert math.isclose(tracker.norms[name], 0.0625 * math.sqrt(n), rel_tol=1e-6)
    assert list(tracker.top_k(2)) == ["1.bias", "0.weight"]  # inf first, then the largest


# ---- track_param_grad_norms: what it takes -------------------------------------------------------


def test_track_param_grad_norms_takes_a_dict_or_says_what_to_pass():
    """A dict {name: param} (or {param: name}) names the params as its items do; a list of
    names raises TypeError saying to pass named_parameters() / .items(), tracker unchanged."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)).to(torch.bfloat16)
    opt = tpamp.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1))
    want = [n for n, _ in model.named_parameters()]

    def norms_after_a_step(tracker):
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.5)
        opt.step(param_grad_norms=True)
        return dict(tracker.norms)

    by_pairs = norms_after_a_step(opt.track_param_grad_norms(model.named_parameters()))
    assert list(by_pairs) == want
    # an independent reference: the norm of a grad of 0.5 everywhere
    for n, p in model.named_parameters():
        assert by_pairs[n] == pytest.approx(0.5 * p.numel() ** 0.5, rel=1e-6)
    by_name = opt.track_param_grad_norms(dict(model.named_parameters()))
    assert by_name.names == want
    by_param = opt.track_param_grad_norms({p: n for n, p in model.named_parameters()})
    assert by_param.names == want
    current = opt.param_norm_tracker
    for bad, words in ((want, ["named_parameters()", ".items()", "'0.weight'"]),
                       ({"w": "not a tensor"}, ["dict {name: param}", "str: str"]),
                       (torch.ones(2), ["Tensor"])):
        with pytest.raises(TypeError) as info:
            opt.track_param_grad_norms(bad)
        for w in words:
            assert w in str(info.value), (w, str(info.value))
        assert opt.param_norm_tracker is current  # unchanged
