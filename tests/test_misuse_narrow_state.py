"""Misuse around narrow optimizer state, options that cannot apply, names and the unclear cases
(docs/spec.md section 9 for the formats, section 2.4 for the guards), single process but for
one DistributedOptimizer case on two forked gloo ranks.

Each case names the exception type and the words its message must contain, and checks that the
refusal changed nothing: the bytes of every param and of the optimizer's state dict (inner
state, scaler, main params) are the same after it."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from dist_utils import freeze, fused_step_built, tensor_bytes

import tpamp
from tpamp import state_formats

F8 = torch.float8_e4m3fn
CONFIGS = {
    "fp32": dict(),
    "bf16": dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16),
    "8bit": dict(exp_avg_dtype=F8, exp_avg_sq_dtype=F8),
    "8bit+rem": dict(exp_avg_dtype=F8, exp_avg_sq_dtype=F8, store_param_remainders=True),
}

needs_kernel = pytest.mark.skipif(not fused_step_built(),
                                  reason="tpamp._C with the fused step kernels is not built")


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(20, 300), torch.nn.Linear(300, 3)).to(torch.bfloat16)


def _trained(cfg, seed=0, steps=2):
    model = _model(seed)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    opt = tpamp.MixedPrecisionOptimizer(inner, **CONFIGS[cfg])
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(p.dtype)
        assert opt.step().update_successful
    return model, opt


def _saved(opt):
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _picture(model, opt):
    return ([tensor_bytes(p) for p in model.parameters()], freeze(opt.state_dict()))


def _refused(model, opt, call, exc, words):
    before = _picture(model, opt)
    with pytest.raises(exc) as info:
        call()
    msg = str(info.value)
    for w in words:
        assert w in msg, (w, msg)
    assert _picture(model, opt) == before  # nothing changed
    return msg


# -- 8-bit state dicts: the scale keys are checked before anything loads ----------------------


def _first_entry(sd):
    return next(iter(sd["optimizer"]["state"].values()))


def _short_scale(sd):
    e = _first_entry(sd)
    e["exp_avg_scale"] = e["exp_avg_scale"][:-1].clone()
    return sd


def _no_scales(sd):
    for e in sd["optimizer"]["state"].values():
        e.pop("exp_avg_scale"), e.pop("exp_avg_sq_scale")
    return sd


def _nan_scale(sd):
    _first_entry(sd)["exp_avg_sq_scale"][0] = float("nan")
    return sd


def _negative_scale(sd):
    _first_entry(sd)["exp_avg_scale"][0] = -1.0
    return sd


def _stray_scale(sd):  # a float32 state dict with a scale key: not 8-bit codes
    e = _first_entry(sd)
    e["exp_avg_scale"] = torch.ones(state_formats.moment_blocks(e["exp_avg"].numel()))
    return sd


def _scale_list(sd):
    _first_entry(sd)["exp_avg_scale"] = [1.0]
    return sd


CASES = [
    # (source config, edit, exception, words)
    ("8bit", _short_scale, ValueError, ["exp_avg_scale", "shape", "one per block"]),
    ("8bit", _no_scales, KeyError, ["exp_avg", "8-bit", "exp_avg_scale"]),
    ("8bit", _nan_scale, ValueError, ["exp_avg_sq_scale", "nan"]),
    ("8bit", _negative_scale, ValueError, ["exp_avg_scale", "negative", "-1.0"]),
    ("fp32", _stray_scale, ValueError, ["exp_avg_scale", "not float8_e4m3fn codes"]),
    ("8bit", _scale_list, TypeError, ["exp_avg_scale", "tensor", "list"]),
]


@needs_kernel
@pytest.mark.parametrize("dst", list(CONFIGS))
@pytest.mark.parametrize("src,edit,exc,words", CASES, ids=[c[1].__name__ for c in CASES])
def test_narrow_state_dict_refused_before_anything_changes(src, edit, exc, words, dst):
    """Into every configuration (an fp32-moment optimizer loading an 8-bit dict and the
    reverse): the refused load leaves params and state as they were, and the next step runs."""
    _, src_opt = _trained(src, seed=1)
    sd = edit(_saved(src_opt))
    model, opt = _trained(dst, seed=2)
    _refused(model, opt, lambda: opt.load_state_dict(sd), exc, words)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    assert opt.step().update_successful  # still usable
    assert all(bool(p.isfinite().all()) for p in model.parameters())


@needs_kernel
@pytest.mark.parametrize("dst", list(CONFIGS))
def test_untouched_8bit_state_dict_loads_into_every_configuration(dst):
    """The checks refuse nothing valid: an 8-bit dict (fresh zero-scale blocks included) loads
    everywhere and decodes to its saved values."""
    _, src_opt = _trained("8bit", seed=1)
    sd = _saved(src_opt)
    model, opt = _trained(dst, seed=2)
    opt.load_state_dict(copy.deepcopy(sd))
    for pid, entry in sd["optimizer"]["state"].items():
        p = opt.optimizer.param_groups[0]["params"][pid]
        st = opt.optimizer.state[p]
        saved = state_formats.decode_moment(entry["exp_avg"], entry["exp_avg_scale"])
        got = state_formats.decode_moment(st["exp_avg"], st.get("exp_avg_scale"))
        if dst.startswith("8bit") or dst == "fp32":
            assert torch.equal(got, saved)
        else:
            assert torch.equal(got, saved.to(torch.bfloat16).float())


def test_check_saved_scales_accepts_codes_cast_to_float32():
    """torch.optim's own load casts 8-bit codes to the param dtype: float32 code values with
    their scales are the codes still (exact), not a stray scale."""
    codes, scales = state_formats.encode_moment(torch.linspace(-1, 1, 300), F8)
    state_formats.check_saved_scales({0: {"exp_avg": codes.float(), "exp_avg_scale": scales}})
    with pytest.raises(ValueError, match="not float8_e4m3fn codes"):
        state_formats.check_saved_scales(
            {0: {"exp_avg": codes.float() + 0.01, "exp_avg_scale": scales}})
    with pytest.raises(ValueError, match="scales without their 8-bit moment"):
        state_formats.check_saved_scales({0: {"exp_avg_scale": scales}})


# -- options that cannot apply are refused at construction -----------------------------------


def _inner_picture(inner, params):
    return ([tensor_bytes(p) for p in params], freeze(inner.state_dict()))


def _refused_construction(build, inner, params, exc, words):
    from tpamp._guards import wrapped_by

    before = _inner_picture(inner, params)
    with pytest.raises(exc) as info:
        build()
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    assert _inner_picture(inner, params) == before and wrapped_by(inner) is None
    return str(info.value)


@pytest.mark.parametrize("cls", ["MixedPrecisionOptimizer", "FP32Optimizer"])
def test_remainders_without_bf16_params_are_refused(cls):
    """fp32 params are their own masters: store_param_remainders would do nothing."""
    model = torch.nn.Linear(4, 3)
    inner = torch.optim.AdamW(model.parameters(), lr=0.1)
    _refused_construction(
        lambda: getattr(tpamp, cls)(inner, store_param_remainders=True), inner,
        list(model.parameters()), ValueError,
        ["store_param_remainders=True", "no trainable bf16 param", "torch.float32",
         "store_param_remainders=False"])
    getattr(tpamp, cls)(inner)  # without it: accepted


def test_remainders_with_bf16_and_fp32_params_apply_to_the_bf16_ones():
    bf, fp = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16)), torch.nn.Parameter(torch.ones(3))
    opt = tpamp.MixedPrecisionOptimizer(torch.optim.AdamW([bf, fp], lr=0.1),
                                        store_param_remainders=True)
    assert opt.store_param_remainders


@pytest.mark.parametrize("option", ["amsgrad", "capturable", "differentiable"])
@pytest.mark.parametrize("cfg", ["bf16", "8bit", "8bit+rem"])
def test_narrow_state_with_an_adam_option_the_one_pass_step_lacks_is_refused(option, cfg):
    model = _model()
    inner = torch.optim.Adam(model.parameters(), lr=0.1, **{option: True})
    _refused_construction(
        lambda: tpamp.MixedPrecisionOptimizer(inner, **CONFIGS[cfg]), inner,
        list(model.parameters()), ValueError,
        [f"{option}=True", "param group 0", f"pass {option}=False to Adam"])


_LOW_SCALERS = [
    (lambda: tpamp.DynamicGradScaler(initial_scale=8.0, min_scale=0.5), "min_scale=0.5"),
    (lambda: tpamp.ConstantGradScaler(0.25), "scale=0.25"),
]


@pytest.mark.parametrize("make,setting", _LOW_SCALERS, ids=["dynamic", "constant"])
@pytest.mark.parametrize("cfg", ["bf16", "8bit+rem"])
def test_check_narrow_state_scaler_names_the_setting(make, setting, cfg):
    from tpamp._checks import check_narrow_state_scaler

    opts = CONFIGS[cfg]
    args = (opts["exp_avg_dtype"], opts["exp_avg_sq_dtype"],
            opts.get("store_param_remainders", False))
    scaler = make()
    before = freeze(scaler.state_dict())
    with pytest.raises(ValueError, match="never drops below 1") as info:
        check_narrow_state_scaler(scaler, *args)
    assert setting in str(info.value) and type(scaler).__name__ in str(info.value)
    assert freeze(scaler.state_dict()) == before
    # accepted: float32 state with that scaler; narrow state without a scaler or with one >= 1
    check_narrow_state_scaler(scaler, torch.float32, torch.float32, False)
    check_narrow_state_scaler(None, *args)
    check_narrow_state_scaler(tpamp.DynamicGradScaler(initial_scale=8.0, min_scale=1.0), *args)
    check_narrow_state_scaler(tpamp.ConstantGradScaler(1.0), *args)


def test_narrow_state_with_a_scaler_below_one_is_refused_at_construction():
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=0.1)
    _refused_construction(
        lambda: tpamp.MixedPrecisionOptimizer(
            inner, grad_scaler=tpamp.DynamicGradScaler(initial_scale=8.0, min_scale=0.5),
            **CONFIGS["8bit"]),
        inner, list(model.parameters()), ValueError, ["min_scale=0.5", "never drops below 1"])


# -- names for last_nonfinite: the grad-norm tracker's rules ---------------------------------


def _names_cases():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)).to(torch.bfloat16)
    w0, b0, w1, b1 = model.parameters()
    return model, [
        ("duplicate-name", [("w", w0), ("w", b0), ("x", w1), ("y", b1)],
         ["'w'", "two different params"]),
        ("empty-name", [("", w0), ("b0", b0)], ["non-empty", "''"]),
        ("two-names", [("a", w0), ("b", w0)], ["named both", "'a'", "'b'"]),
        ("dict-duplicate", {w0: "same", b0: "same"}, ["'same'", "two different params"]),
    ]


@pytest.mark.parametrize("case", [c[0] for c in _names_cases()[1]])
def test_param_names_for_last_nonfinite_are_checked_as_the_tracker_checks_them(case):
    from tpamp.nonfinite import param_name_map

    model, cases = _names_cases()
    names, words = {c[0]: (c[1], c[2]) for c in cases}[case]
    inner = torch.optim.AdamW(model.parameters(), lr=0.1)
    _refused_construction(
        lambda: tpamp.MixedPrecisionOptimizer(inner, param_names=names), inner,
        list(model.parameters()), ValueError, ["param_names", *words])
    with pytest.raises(ValueError, match="param_names"):
        param_name_map(names)
    # the tracker refuses the same names
    if not isinstance(names, dict):
        opt = tpamp.MixedPrecisionOptimizer(inner)
        with pytest.raises(ValueError):
            opt.track_param_grad_norms(names)


def test_param_names_accepts_named_parameters_and_a_repeated_pair():
    from tpamp.nonfinite import param_name_map

    model = torch.nn.Linear(3, 2)
    pairs = list(model.named_parameters())
    assert param_name_map(pairs + pairs[:1]) == {id(p): n for n, p in pairs}


# -- the unclear cases ----------------------------------------------------------------------


def test_plot_without_matplotlib_prints_one_install_line_and_exits_2(tmp_path):
    """``python -m tpamp.plot`` where matplotlib cannot be imported (hidden by a path entry
    that makes its import fail): exit code 2, one line on stderr naming the install command,
    no traceback, no image written."""
    import os
    import subprocess
    import sys

    log = tmp_path / "log.jsonl"
    log.write_text('{"iteration": 1, "loss": 2.0, "grad_norm": 1.0, "loss_scale": 8.0}\n')
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import sys\nsys.modules['matplotlib'] = None  # import matplotlib -> ModuleNotFoundError\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(blocker), root]))
    res = subprocess.run([sys.executable, "-m", "tpamp.plot", str(log)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, (res.returncode, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert lines == ["tpamp.plot needs matplotlib, which is not installed: pip install matplotlib "
                     "(or pip install 'tpamp[plot]')"], res.stderr
    assert not (tmp_path / "log.png").exists()


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


@needs_kernel
def test_param_grad_norms_work_with_narrow_state():
    """step(param_grad_norms=True) takes the one-pass path with narrow state (no refusal): the
    norms equal the grads' own norms, and the params moved."""
    model, opt = _trained("8bit+rem", steps=1)
    tracker = opt.track_param_grad_norms(model.named_parameters())
    gen = torch.Generator().manual_seed(9)
    grads = {n: (torch.randn(p.shape, generator=gen) * 1e-2).to(p.dtype)
             for n, p in model.named_parameters()}
    before = [p.detach().clone() for p in model.parameters()]
    for n, p in model.named_parameters():
        p.grad = grads[n].clone()
    assert opt.step(param_grad_norms=True).update_successful
    for n, g in grads.items():
        assert tracker.norms[n] == pytest.approx(float(g.double().norm()), rel=1e-5)
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_collective_helpers_say_so():
    """Every collective-only helper's docstring says which ranks must call it."""
    from tpamp import fsdp, grad_stats, nonfinite, param_norms
    from tpamp.checkpoint import load_checkpoint, save_checkpoint

    for fn in (fsdp.fully_shard_optimizer, fsdp.track_param_grad_norms,
               grad_stats.get_grad_norm_fp32, grad_stats.count_zeros_fp32,
               nonfinite.gather_nonfinite, nonfinite.NonFiniteTracer.result,
               param_norms.ParamGradNormTracker, save_checkpoint, load_checkpoint):
        doc = " ".join((fn.__doc__ or "").split())
        assert "ollective: every rank of" in doc and "must call it" in doc, fn.__qualname__


def _dist_names_worker(rank, world_size):
    import torch.distributed as dist

    from tpamp._guards import wrapped_by

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)).to(torch.bfloat16)
    w0, b0, w1, b1 = model.parameters()
    inner = torch.optim.AdamW(model.parameters(), lr=0.1)
    dp = dist.new_group(list(range(world_size)))
    out = []
    for names in ([("w", w0), ("w", b0), ("x", w1), ("y", b1)], [("", w0)]):
        try:
            tpamp.DistributedOptimizer(inner, data_parallel_group=dp, param_names=names)
            out.append(None)
        except ValueError as e:
            out.append(str(e))
    return out, wrapped_by(inner) is None


def test_distributed_optimizer_param_names_are_checked_too():
    """The same rules in DistributedOptimizer (DP 2, forked gloo ranks), nothing wrapped."""
    from dist_utils import run_workers

    for msgs, unwrapped in run_workers(_dist_names_worker, 2, timeout=60.0):
        assert unwrapped
        assert msgs[0] is not None and "'w'" in msgs[0] and "two different params" in msgs[0]
        assert msgs[1] is not None and "non-empty" in msgs[1]
