"""Misuse around narrow optimizer state, options that cannot apply, names and the unclear cases
(docs/spec.md section 9 for the formats, section 2.4 for the guards), single process.

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
