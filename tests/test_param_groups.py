"""Param-group overrides (docs/spec.md section 16): tpamp.build_param_groups gives the groups of
a hand-built reference, torch.optim.AdamW stepped with them equals a float64 hand computation,
and a resume on a model whose params are declared in another order (groups in another order
too) continues bit-identically through MixedPrecisionOptimizer, DistributedOptimizer (2 gloo
ranks) and the sharded checkpoint path; a changed override is refused, naming the key."""

import io
import math
import zlib

import numpy as np
import pytest
import torch
import torch.distributed as dist
from dist_utils import run_workers, tensor_bytes
from misuse_utils import assert_every_case_refused_by_tpamp, assert_raises_naming, case_ids

import tpamp
from tpamp.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SHAPES = {  # name -> shape; "emb" and "head" are Megatron's embedding and output layer
    "emb.weight": (5, 3), "lin.weight": (4, 3), "lin.bias": (4,), "norm.weight": (4,),
    "norm.bias": (4,), "mlp.weight": (4, 4), "proj.weight": (2, 4), "head.weight": (2, 2),
}
ORDER_A = list(SHAPES)
ORDER_B = ["head.weight", "proj.weight", "norm.bias", "mlp.weight", "lin.bias", "norm.weight",
           "lin.weight", "emb.weight"]  # the same params declared in another order
LR, WD, DECOUPLED_LR = 1e-2, 0.1, 3e-2
OVERRIDES = {
    tpamp.ParamKey(name="lin.weight"): tpamp.ParamGroupOverride(wd_mult=0.5),
    tpamp.ParamKey(name="lin.*"): tpamp.ParamGroupOverride(lr_mult=0.25),
}


def _params(order, dtype=torch.float32, offset=0.0):
    out = {}
    for n in order:
        g = torch.Generator().manual_seed(zlib.crc32(n.encode()))
        p = torch.nn.Parameter((torch.randn(SHAPES[n], generator=g) + offset).to(dtype))
        if n in ("emb.weight", "head.weight"):
            p.is_embedding_or_output_parameter = True
        out[n] = p
    return out


def _groups(params, overrides=OVERRIDES, **kw):
    kw = {"lr": LR, "weight_decay": WD, "decoupled_lr": DECOUPLED_LR, **kw}
    return tpamp.build_param_groups(params.items(), overrides=overrides, **kw)


def _grad(name, step):
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 1000 * step)
    return torch.randn(SHAPES[name], generator=g, dtype=torch.float64)


# ---- the groups -------------------------------------------------------------------------------

# written out by hand from Megatron-core's rules: no weight decay for biases and 1-D params,
# decoupled_lr for the embedding and output layer, the two overrides merged on lin.*
REFERENCE = [
    {"override_key": "default", "param_names": ["mlp.weight", "proj.weight"],
     "lr": 1e-2, "weight_decay": 0.1, "lr_mult": 1.0, "wd_mult": 1.0, "override": {}},
    {"override_key": "attr=is_embedding_or_output_parameter",
     "param_names": ["emb.weight", "head.weight"],
     "lr": 3e-2, "weight_decay": 0.1, "lr_mult": 1.0, "wd_mult": 1.0,
     "override": {"max_lr": 3e-2}},
    {"override_key": "name=*.bias|ndim=1", "param_names": ["norm.weight", "norm.bias"],
     "lr": 1e-2, "weight_decay": 0.0, "lr_mult": 1.0, "wd_mult": 0.0,
     "override": {"wd_mult": 0.0}},
    {"override_key": "name=*.bias|ndim=1 + name=lin.*", "param_names": ["lin.bias"],
     "lr": 2.5e-3, "weight_decay": 0.0, "lr_mult": 0.25, "wd_mult": 0.0,
     "override": {"wd_mult": 0.0, "lr_mult": 0.25}},
    {"override_key": "name=lin.weight + name=lin.*", "param_names": ["lin.weight"],
     "lr": 2.5e-3, "weight_decay": 0.05, "lr_mult": 0.25, "wd_mult": 0.5,
     "override": {"wd_mult": 0.5, "lr_mult": 0.25}},
]


def test_groups_match_a_hand_built_reference():
    params = _params(ORDER_A)
    groups = _groups(params)
    assert [g["override_key"] for g in groups] == [r["override_key"] for r in REFERENCE]
    for g, ref in zip(groups, REFERENCE):
        for k, v in ref.items():
            assert g[k] == pytest.approx(v) if isinstance(v, float) else g[k] == v, (ref, k)
        assert [id(p) for p in g["params"]] == [id(params[n]) for n in ref["param_names"]]
    # every trainable param in exactly one group; a frozen one in none
    frozen = dict(params, **{"frozen": torch.nn.Parameter(torch.ones(3), requires_grad=False)})
    again = _groups(frozen)
    assert sorted(n for g in again for n in g["param_names"]) == sorted(SHAPES)
    # deterministic: another declaration order gives the same groups in the same order
    other = _groups(_params(ORDER_B))
    assert [g["override_key"] for g in other] == [r["override_key"] for r in REFERENCE]
    assert [sorted(g["param_names"]) for g in other] == [sorted(r["param_names"]) for r in REFERENCE]


def test_megatron_defaults_can_be_turned_off():
    groups = tpamp.build_param_groups(_params(ORDER_A).items(), lr=LR, weight_decay=WD,
                                      no_weight_decay_for_1d=False)
    assert len(groups) == 1 and groups[0]["override_key"] == "default"
    assert groups[0]["weight_decay"] == WD and len(groups[0]["params"]) == len(SHAPES)


def test_adamw_with_the_groups_equals_a_float64_hand_computation():
    params = _params(ORDER_A, torch.float64)
    start = {n: p.detach().clone().numpy() for n, p in params.items()}
    opt = torch.optim.AdamW(_groups(params), betas=(0.9, 0.95), eps=1e-8)
    for step in range(1, 4):
        for n, p in params.items():
            p.grad = _grad(n, step)
        opt.step()
    # by hand (torch.optim.AdamW's documented algorithm): lr and decay per param from the
    # reference above, not from the built groups
    lr = {"mlp.weight": 1e-2, "proj.weight": 1e-2, "emb.weight": 3e-2, "head.weight": 3e-2,
          "norm.weight": 1e-2, "norm.bias": 1e-2, "lin.bias": 2.5e-3, "lin.weight": 2.5e-3}
    wd = {"mlp.weight": 0.1, "proj.weight": 0.1, "emb.weight": 0.1, "head.weight": 0.1,
          "norm.weight": 0.0, "norm.bias": 0.0, "lin.bias": 0.0, "lin.weight": 0.05}
    for n, p in params.items():
        x, m, v = start[n].copy(), 0.0, 0.0
        for t in range(1, 4):
            g = _grad(n, t).numpy()
            x = x * (1 - lr[n] * wd[n])
            m = 0.9 * m + 0.1 * g
            v = 0.95 * v + 0.05 * g * g
            x = x - lr[n] * (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.95**t)) + 1e-8)
        np.testing.assert_allclose(p.detach().numpy(), x, rtol=1e-13, atol=1e-15, err_msg=n)


# ---- errors -----------------------------------------------------------------------------------


def test_conflicting_overrides_raise_naming_the_param_and_both():
    bad = {tpamp.ParamKey(name="lin.*"): {"lr_mult": 0.5},
           tpamp.ParamKey(ndim=2): {"lr_mult": 2.0}}
    with pytest.raises(ValueError, match=r"'lin.weight'.*'name=lin\.\*'.*'ndim=2'.*lr_mult"):
        _groups(_params(ORDER_A), overrides=bad)
    # the built-in no-weight-decay key is one of the two
    with pytest.raises(ValueError, match=r"'lin.bias'.*'name=\*\.bias\|ndim=1'.*wd_mult"):
        _groups(_params(ORDER_A), overrides={tpamp.ParamKey(name="lin.bias"): {"wd_mult": 0.3}})


def test_an_override_that_matches_nothing_raises_unless_allowed():
    ov = {tpamp.ParamKey(name="decoder.*"): {"lr_mult": 0.5}}
    with pytest.raises(ValueError, match=r"\['name=decoder\.\*'\] match no trainable param"):
        _groups(_params(ORDER_A), overrides=ov)
    groups = _groups(_params(ORDER_A), overrides=ov, allow_unmatched=True)
    assert "name=decoder.*" not in [g["override_key"] for g in groups]


@pytest.mark.parametrize("call, err, match", [
    (lambda: tpamp.ParamKey(), ValueError, "at least one"),
    (lambda: tpamp.ParamKey(predicate=lambda p, n: True), ValueError, "predicate_name"),
    (lambda: tpamp.ParamKey(ndim="1"), TypeError, "ndim"),
    (lambda: tpamp.ParamGroupOverride(lr_mult=-1.0), ValueError, "lr_mult"),
    (lambda: tpamp.ParamGroupOverride(options={"lr": 1.0}), ValueError, "max_lr"),
    (lambda: tpamp.build_param_groups([("a", torch.zeros(1)), ("a", torch.zeros(1))], lr=1.0),
     ValueError, "'a' twice"),
    (lambda: tpamp.build_param_groups([torch.zeros(1)], lr=1.0), TypeError, "pairs"),
    (lambda: tpamp.build_param_groups({}, lr=0.0), ValueError, "lr"),
])
def test_bad_arguments_raise(call, err, match):
    with pytest.raises(err, match=match):
        call()


# ParamGroupOverride(options=...): the values torch checks only in a constructor (main e82d3a5
# took any: eps 0 gave nan params at the first zero grad)
_OV = tpamp.ParamGroupOverride
OPTION_MISUSE = [
    ("options-eps-0", lambda: _OV(options={"eps": 0.0}), ValueError, ["eps", "0.0", ">"]),
    ("options-eps-nan", lambda: _OV(options={"eps": math.nan}), ValueError, ["eps", "nan"]),
    ("options-eps-str", lambda: _OV(options={"eps": "1e-8"}), TypeError, ["eps", "'1e-8'"]),
    ("options-eps-pair-negative", lambda: _OV(options={"eps": (None, -1.0)}), ValueError, ["eps", "-1.0"]),
    ("options-betas-1", lambda: _OV(options={"betas": (0.9, 1.0)}), ValueError, ["betas", "1.0"]),
    ("options-betas-inf", lambda: _OV(options={"betas": (math.inf, 0.99)}), ValueError, ["betas", "inf"]),
    ("options-betas-number", lambda: _OV(options={"betas": 0.9}), TypeError, ["betas", "0.9"]),
    ("options-momentum-negative", lambda: _OV(options={"momentum": -0.5}), ValueError, ["momentum", "-0.5"]),
    ("options-momentum-inf", lambda: _OV(options={"momentum": math.inf}), ValueError, ["momentum", "inf"]),
    ("options-ns_steps-100", lambda: _OV(options={"ns_steps": 100}), ValueError, ["ns_steps", "100"]),
    ("options-ns_coefficients-2", lambda: _OV(options={"ns_coefficients": (3.4, -4.7)}), ValueError, ["ns_coefficients", "3"]),
    ("options-nesterov-str", lambda: _OV(options={"nesterov": "yes"}), TypeError, ["nesterov", "'yes'"]),
    ("options-foreach-int", lambda: _OV(options={"foreach": 1}), TypeError, ["foreach", "1"]),
    ("options-unknown-nan", lambda: _OV(options={"my_option": math.nan}), ValueError, ["my_option", "nan"]),
    ("options-unknown-tuple-inf", lambda: _OV(options={"my_option": (1.0, -math.inf)}), ValueError, ["my_option", "-inf"]),
    ("options-twice", lambda: _OV(options=[("eps", 1e-8), ("eps", 1e-6)]), ValueError, ["eps", "twice"]),
    ("options-dict-form", lambda: _OV.of({"lr_mult": 0.5, "eps": math.inf}), ValueError, ["eps", "inf"]),
    ("min_lr-above-max_lr", lambda: _OV(max_lr=1e-4, min_lr=1e-3), ValueError, ["min_lr", "0.001", "max_lr"]),
    ("build-min_lr-above-lr", lambda: tpamp.build_param_groups({"w": torch.nn.Parameter(torch.ones(2))}, lr=1e-4, min_lr=1e-3), ValueError, ["min_lr", "0.001", "lr"]),
    ("build-decoupled-below-min_lr", lambda: tpamp.build_param_groups({"w": _emb()}, lr=1e-3, min_lr=1e-4, decoupled_lr=1e-5), ValueError, ["max_lr", "1e-05", "min_lr", "0.0001"]),
    ("options-in-build", lambda: tpamp.build_param_groups({"w": torch.nn.Parameter(torch.ones(2))}, lr=1.0, overrides={tpamp.ParamKey(name="w"): {"betas": (0.9, -0.1)}}), ValueError, ["betas", "-0.1"]),
]


def _emb():
    p = torch.nn.Parameter(torch.ones(2, 2))
    p.is_embedding_or_output_parameter = True
    return p


def test_every_option_misuse_is_refused_by_tpamp_itself():
    assert_every_case_refused_by_tpamp(OPTION_MISUSE)


@pytest.mark.parametrize("case_id,call,exc,words", OPTION_MISUSE, ids=case_ids(OPTION_MISUSE))
def test_a_bad_option_value_is_refused_naming_it(case_id, call, exc, words):
    assert_raises_naming(case_id, call, exc, words)


def test_good_option_values_are_kept():
    ov = _OV(options={"eps": 1e-10, "betas": (0.9, 0.95), "nesterov": True, "adjust_lr_fn": None,
                      "eps_pair": (None, 1e-3)})
    assert dict(ov.options) == {"eps": 1e-10, "betas": (0.9, 0.95), "nesterov": True,
                                "adjust_lr_fn": None, "eps_pair": (None, 1e-3)}


def test_a_predicate_key_matches_and_names_the_group():
    key = tpamp.ParamKey(predicate=lambda p, n: n.startswith("mlp"), predicate_name="mlp")
    groups = _groups(_params(ORDER_A), overrides={key: {"lr_mult": 0.5, "eps": 1e-6}})
    g = next(g for g in groups if g["override_key"] == "predicate=mlp")
    assert g["param_names"] == ["mlp.weight"] and g["lr"] == pytest.approx(5e-3) and g["eps"] == 1e-6


# ---- resume on a reordered model: MixedPrecisionOptimizer, torch.save of state_dict ------------


def _mpo(order, overrides=OVERRIDES, reverse=False, offset=0.0):
    params = _params(order, torch.float16, offset)
    groups = _groups(params, overrides=overrides)
    if reverse:  # the groups given to the optimizer in another order too
        groups = groups[::-1]
    inner = torch.optim.AdamW(groups, betas=(0.9, 0.95), eps=1e-8)
    scaler = tpamp.DynamicGradScaler(initial_scale=2.0**4, growth_interval=2, hysteresis=1)
    return params, tpamp.MixedPrecisionOptimizer(inner, grad_scaler=scaler, clip_grad=0.0)


def _run(params, opt, steps):
    for step in steps:
        scale = float(opt.get_loss_scale())
        for n, p in params.items():
            p.grad = (_grad(n, step) * scale).to(p.dtype)
        opt.step()
        opt.zero_grad()
    return {n: tensor_bytes(p) for n, p in params.items()}


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def test_resume_on_a_reordered_model_is_bit_identical_through_state_dict():
    params, opt = _mpo(ORDER_A)
    want = _run(params, opt, range(6))
    params, opt = _mpo(ORDER_A)
    _run(params, opt, range(3))
    saved = _roundtrip(opt.state_dict())
    params_b, opt_b = _mpo(ORDER_B, reverse=True, offset=1.0)  # all must come from the state dict
    opt_b.load_state_dict(saved)
    assert _run(params_b, opt_b, range(3, 6)) == want
    assert [g["override_key"] for g in opt_b.param_groups] == \
        [r["override_key"] for r in REFERENCE][::-1]


def test_a_changed_override_is_refused_naming_the_key_and_nothing_changes():
    params, opt = _mpo(ORDER_A)
    _run(params, opt, range(2))
    saved = _roundtrip(opt.state_dict())
    changed = {tpamp.ParamKey(name="lin.weight"): {"wd_mult": 0.5},
               tpamp.ParamKey(name="lin.*"): {"lr_mult": 0.5}}  # was 0.25
    params_b, opt_b = _mpo(ORDER_B, overrides=changed)
    before = {n: tensor_bytes(p) for n, p in params_b.items()}
    with pytest.raises(ValueError, match=r"'name=lin\.weight \+ name=lin\.\*'.*lr_mult.*0\.25.*0\.5"):
        opt_b.load_state_dict(saved)
    assert {n: tensor_bytes(p) for n, p in params_b.items()} == before
    # a key that is new or gone (the override's ParamKey changed)
    moved = {tpamp.ParamKey(name="lin.weight"): {"wd_mult": 0.5},
             tpamp.ParamKey(name="lin.?ias"): {"lr_mult": 0.25}}
    with pytest.raises(ValueError, match=r"'name=\*\.bias\|ndim=1 \+ name=lin\.\?ias'.*not in"):
        _mpo(ORDER_B, overrides=moved)[1].load_state_dict(saved)


def test_groups_without_override_keys_still_load_by_position():
    params = _params(ORDER_A, torch.float16)
    plain = [{"params": [params[n] for n in ORDER_A[:4]]},
             {"params": [params[n] for n in ORDER_A[4:]], "weight_decay": 0.0}]
    opt = tpamp.MixedPrecisionOptimizer(torch.optim.AdamW(plain, lr=LR), clip_grad=0.0,
                                        grad_scaler=tpamp.ConstantGradScaler(1.0))
    _run(params, opt, range(2))
    saved = _roundtrip(opt.state_dict())
    # a live optimizer with override keys loads a checkpoint without them by position, and
    # keeps its keys
    params_k = _params(ORDER_A, torch.float16)
    keyed = tpamp.build_param_groups(params_k.items(), lr=LR, no_weight_decay_for_1d=False,
                                     overrides={tpamp.ParamKey(name=ORDER_A[4:]): {"wd_mult": 0.0}})
    opt_k = tpamp.MixedPrecisionOptimizer(torch.optim.AdamW(keyed), clip_grad=0.0,
                                          grad_scaler=tpamp.ConstantGradScaler(1.0))
    opt_k.load_state_dict(saved)
    assert {n: tensor_bytes(p) for n, p in params_k.items()} == \
        {n: tensor_bytes(p) for n, p in params.items()}
    assert [g["override_key"] for g in opt_k.param_groups][0] == "default"


# ---- the sharded checkpoint path (tpamp.checkpoint), one process ------------------------------


def test_resume_on_a_reordered_model_is_bit_identical_through_the_sharded_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    params, opt = _mpo(ORDER_A)
    want = _run(params, opt, range(6))
    params, opt = _mpo(ORDER_A)
    _run(params, opt, range(3))
    save_checkpoint(path, params, opt)
    params_b, opt_b = _mpo(ORDER_B, reverse=True, offset=1.0)
    load_checkpoint(path, params_b, opt_b)
    assert _run(params_b, opt_b, range(3, 6)) == want
    # a changed override: refused before anything changes, naming the key
    changed = {tpamp.ParamKey(name="lin.weight"): {"wd_mult": 0.75},
               tpamp.ParamKey(name="lin.*"): {"lr_mult": 0.25}}
    params_c, opt_c = _mpo(ORDER_B, overrides=changed)
    with pytest.raises(CheckpointError, match=r"'name=lin\.weight \+ name=lin\.\*'.*wd_mult"):
        load_checkpoint(path, params_c, opt_c)


# ---- DistributedOptimizer, 2 gloo ranks -------------------------------------------------------


def _dist(order, reverse=False, offset=0.0, overrides=OVERRIDES):
    params = _params(order, torch.float16, offset)
    groups = _groups(params, overrides=overrides)
    if reverse:
        groups = groups[::-1]
    inner = torch.optim.AdamW(groups, betas=(0.9, 0.95), eps=1e-8)
    scaler = tpamp.DynamicGradScaler(initial_scale=2.0**4, growth_interval=2, hysteresis=1)
    opt = tpamp.DistributedOptimizer(inner, grad_scaler=scaler, clip_grad=0.0,
                                     data_parallel_group=dist.group.WORLD, bucket_size=24)
    return params, opt


def _dist_run(params, opt, steps, rank):
    for step in steps:
        scale = float(opt.get_loss_scale())
        for n, p in params.items():  # each DP rank its own grad; the step uses their mean
            p.grad = (_grad(n, step) * (1 + rank) * scale).to(p.dtype)
        opt.step()
        opt.zero_grad()
    return {n: tensor_bytes(p) for n, p in params.items()}


def _dist_worker(rank, world, path):
    params, opt = _dist(ORDER_A)
    want = _dist_run(params, opt, range(6), rank)
    params, opt = _dist(ORDER_A)
    _dist_run(params, opt, range(3), rank)
    same = opt.state_dict()
    save_checkpoint(path, params, opt)
    out = {"want": want}
    # the same layout: state_dict loads, groups matched by key
    params_s, opt_s = _dist(ORDER_A, offset=1.0)
    opt_s.load_state_dict(same)
    out["state_dict"] = _dist_run(params_s, opt_s, range(3, 6), rank)
    # groups in another order: state_dict (main shards per bucket) refuses, naming the way out
    params_r, opt_r = _dist(ORDER_A, reverse=True, offset=1.0)
    try:
        opt_r.load_state_dict(same)
        out["reordered_state_dict"] = "loaded"
    except ValueError as e:
        out["reordered_state_dict"] = str(e)
    # a reordered model through the sharded checkpoint
    params_b, opt_b = _dist(ORDER_B, reverse=True, offset=1.0)
    load_checkpoint(path, params_b, opt_b)
    out["sharded"] = _dist_run(params_b, opt_b, range(3, 6), rank)
    changed = {tpamp.ParamKey(name="lin.weight"): {"wd_mult": 0.5},
               tpamp.ParamKey(name="lin.*"): {"lr_mult": 0.125}}
    params_c, opt_c = _dist(ORDER_B, offset=1.0, overrides=changed)
    try:
        load_checkpoint(path, params_c, opt_c)
        out["changed"] = "loaded"
    except CheckpointError as e:
        out["changed"] = str(e)
    # pipeline stages with different params: with process_group every rank gets every group
    stage = {"emb.weight": params["emb.weight"]} if rank == 0 else {"norm.bias": params["norm.bias"]}
    aligned = tpamp.build_param_groups(stage.items(), lr=LR, decoupled_lr=DECOUPLED_LR,
                                       process_group=dist.group.WORLD)
    out["aligned"] = [(g["override_key"], g["param_names"], g["lr"]) for g in aligned]
    return out


def test_distributed_optimizer_resumes_by_override_key(tmp_path):
    for rank, out in enumerate(run_workers(_dist_worker, 2, str(tmp_path / "ckpt"), timeout=60)):
        assert out["state_dict"] == out["want"], rank
        assert out["sharded"] == out["want"], rank
        assert "same layout only" in out["reordered_state_dict"], out["reordered_state_dict"]
        assert "tpamp.checkpoint" in out["reordered_state_dict"]
        assert "'name=lin.weight + name=lin.*'" in out["changed"] and "lr_mult" in out["changed"]
        mine = ["emb.weight"] if rank == 0 else ["norm.bias"]
        assert out["aligned"] == [
            ("attr=is_embedding_or_output_parameter", mine if rank == 0 else [], DECOUPLED_LR),
            ("name=*.bias|ndim=1", mine if rank == 1 else [], LR)]


# ---- the main job's schedule ------------------------------------------------------------------


def test_the_main_jobs_schedule_gives_the_decoupled_group_its_own_peak_and_end():
    import argparse
    import math
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "scripts"))
    import train_gpt

    args = argparse.Namespace(lr=1e-2, min_lr=1e-3, lr_warmup_iters=2, train_iters=10)
    groups = _groups(_params(ORDER_A), min_lr=1e-3, decoupled_min_lr=2e-4)
    opt = torch.optim.AdamW(groups)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, train_gpt.lr_lambdas(opt, args))

    def cosine(it, hi, lo):  # warm-up to hi over 2 iterations, cosine to lo at iteration 10
        if it <= 2:
            return hi * it / 2
        return lo + 0.5 * (hi - lo) * (1 + math.cos(math.pi * (it - 2) / 8))

    for it in range(1, 11):  # the lr of iteration it (the scheduler advanced it - 1 times)
        want = {"default": cosine(it, 1e-2, 1e-3),
                "attr=is_embedding_or_output_parameter": cosine(it, 3e-2, 2e-4),
                "name=lin.weight + name=lin.*": 0.25 * cosine(it, 1e-2, 1e-3)}
        for g in opt.param_groups:
            if g["override_key"] in want:
                assert g["lr"] == pytest.approx(want[g["override_key"]], rel=1e-12), (it, g)
        opt.step()
        sched.step()


# ---- torch.amp's path (TorchAMPOptimizer): the same realignment -------------------------------


def _torch_amp(order, reverse=False, offset=0.0):
    params = _params(order, torch.float32, offset)
    groups = _groups(params)
    inner = torch.optim.AdamW(groups[::-1] if reverse else groups, betas=(0.9, 0.95), eps=1e-8)
    return params, tpamp.TorchAMPOptimizer(inner, tpamp.ModelParallelGradScaler("cpu"))


def _torch_amp_run(params, opt, steps):
    for step in steps:
        loss = sum((p * _grad(n, step).float()).sum() for n, p in params.items())
        opt.scale_loss(loss).backward()
        opt.step()
        opt.zero_grad()
    return {n: tensor_bytes(p) for n, p in params.items()}


def test_torch_amp_optimizer_resumes_on_a_reordered_model():
    params, opt = _torch_amp(ORDER_A)
    want = _torch_amp_run(params, opt, range(6))
    params, opt = _torch_amp(ORDER_A)
    _torch_amp_run(params, opt, range(3))
    saved = _roundtrip(opt.state_dict())
    params_b, opt_b = _torch_amp(ORDER_B, reverse=True, offset=1.0)
    with torch.no_grad():  # torch.amp keeps no fp32 copy: the params come with the model
        for n, p in params_b.items():
            p.copy_(params[n])
    opt_b.load_state_dict(saved)
    assert _torch_amp_run(params_b, opt_b, range(3, 6)) == want


def test_a_checkpoint_written_before_override_keys_loads_by_position(tmp_path):
    import json
    import os
    import shutil

    fixtures = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
    path = str(tmp_path / "mpo_fp16")
    shutil.copytree(os.path.join(fixtures, "mpo_fp16"), path)
    with open(os.path.join(fixtures, "mpo_fp16.json")) as f:
        rec = json.load(f)
    params = {n: torch.nn.Parameter(torch.full(rec["shapes"][n], 0.25, dtype=dtype))
              for n, dtype in (("w", torch.float16), ("v", torch.float32), ("b", torch.float16))}
    groups = tpamp.build_param_groups(params.items(), lr=1.0, weight_decay=0.5)
    assert [g["param_names"] for g in groups] == [["w", "v"], ["b"]]  # the saved structure
    opt = tpamp.MixedPrecisionOptimizer(torch.optim.AdamW(groups),
                                        grad_scaler=tpamp.DynamicGradScaler(initial_scale=2.0**8))
    load_checkpoint(path, params, opt, extra={"iteration": None})
    for n, p in params.items():
        want = torch.tensor(rec["model"][n]["values"], dtype=torch.float64).to(p.dtype)
        assert torch.equal(p.detach().reshape(-1), want.reshape(-1)), n
    assert [{"lr": g["lr"], "weight_decay": g["weight_decay"]} for g in opt.param_groups] == \
        rec["groups"]  # the saved hyperparameters, by position
    assert [g["override_key"] for g in opt.param_groups] == ["default", "name=*.bias|ndim=1"]


def test_default_config_marks_the_groups_on_the_default_lr_schedule():
    """Megatron-core's rule (_get_param_groups): a group whose override names no lr field keeps
    the default schedule (default_config=True); Megatron-LM logs that group's lr."""
    model = torch.nn.Linear(3, 2)
    groups = tpamp.build_param_groups(
        model.named_parameters(), lr=1.0, weight_decay=0.1,
        overrides={tpamp.ParamKey(name="weight"): tpamp.ParamGroupOverride(lr_mult=0.5)})
    flags = {tuple(g["param_names"]): g["default_config"] for g in groups}
    assert flags == {("weight",): False, ("bias",): True}, flags
