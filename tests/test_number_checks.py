"""One rule for every public argument that takes a number: TypeError for a value of the wrong
type (a string; a bool where a number is expected; a float where an int is expected), ValueError
for a value of the right type that is wrong (nan, inf, negative), each message naming the
argument and the value.

The table lists, per public constructor (and the grad-stats functions), each argument that
takes a number, whether it is a real or an int, and whether inf is a legal value (norm_type and
max_norm: the inf-norm / no clipping). Every bad value below is checked for every row.
"""

from __future__ import annotations

import math
import re
from typing import Callable, NamedTuple

import pytest
import torch

import tpamp
from tpamp.parallel import ParallelDims


class Arg(NamedTuple):
    owner: str  # the public object (for the test id)
    name: str  # the argument, as it must appear in the message
    build: Callable  # value -> constructs the object (or calls the function) with it
    kind: str  # "real" or "int"
    inf_ok: bool = False  # inf is a legal value of this argument


def _half_param():
    return torch.nn.Parameter(torch.ones(3, dtype=torch.float16))


def _mpo(**kw):
    inner = torch.optim.SGD([_half_param()], lr=0.1)
    return tpamp.MixedPrecisionOptimizer(inner, grad_scaler=tpamp.ConstantGradScaler(2.0), **kw)


def _fp32(**kw):
    return tpamp.FP32Optimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1), **kw)


def _torch_amp(**kw):
    inner = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    return tpamp.TorchAMPOptimizer(inner, tpamp.ModelParallelGradScaler("cpu"), **kw)


def _config(**kw):
    return tpamp.parse_amp_config(dict(mode="parallel", **kw))


def _torch_config(**kw):
    return tpamp.parse_amp_config(dict(mode="torch", **kw))



ARGS = [
    Arg("ConstantGradScaler", "scale", lambda v: tpamp.ConstantGradScaler(v), "real"),
    Arg("DynamicGradScaler", "initial_scale", lambda v: tpamp.DynamicGradScaler(initial_scale=v), "real"),
    Arg("DynamicGradScaler", "min_scale", lambda v: tpamp.DynamicGradScaler(min_scale=v), "real"),
    Arg("DynamicGradScaler", "growth_factor", lambda v: tpamp.DynamicGradScaler(growth_factor=v), "real"),
    Arg("DynamicGradScaler", "backoff_factor", lambda v: tpamp.DynamicGradScaler(backoff_factor=v), "real"),
    Arg("DynamicGradScaler", "growth_interval", lambda v: tpamp.DynamicGradScaler(growth_interval=v), "int"),
    Arg("DynamicGradScaler", "hysteresis", lambda v: tpamp.DynamicGradScaler(hysteresis=v), "int"),
    Arg("DynamicGradScaler", "max_scale", lambda v: tpamp.DynamicGradScaler(max_scale=v), "real"),
    Arg("ModelParallelGradScaler", "init_scale",
        lambda v: tpamp.ModelParallelGradScaler("cpu", init_scale=v), "real"),
    Arg("ModelParallelGradScaler", "growth_factor",
        lambda v: tpamp.ModelParallelGradScaler("cpu", growth_factor=v), "real"),
    Arg("ModelParallelGradScaler", "backoff_factor",
        lambda v: tpamp.ModelParallelGradScaler("cpu", backoff_factor=v), "real"),
    Arg("ModelParallelGradScaler", "growth_interval",
        lambda v: tpamp.ModelParallelGradScaler("cpu", growth_interval=v), "int"),
    Arg("MixedPrecisionOptimizer", "clip_grad", lambda v: _mpo(clip_grad=v), "real"),
    Arg("MixedPrecisionOptimizer", "norm_type", lambda v: _mpo(norm_type=v), "real", inf_ok=True),
    Arg("FP32Optimizer", "clip_grad", lambda v: _fp32(clip_grad=v), "real"),
    Arg("FP32Optimizer", "norm_type", lambda v: _fp32(norm_type=v), "real", inf_ok=True),
    Arg("TorchAMPOptimizer", "clip_grad", lambda v: _torch_amp(clip_grad=v), "real"),
    Arg("TorchAMPOptimizer", "norm_type", lambda v: _torch_amp(norm_type=v), "real", inf_ok=True),
    Arg("get_grad_norm_fp32", "norm_type",
        lambda v: tpamp.get_grad_norm_fp32([torch.ones(3)], norm_type=v), "real", inf_ok=True),
    Arg("clip_grad_by_total_norm_fp32", "max_norm",
        lambda v: tpamp.clip_grad_by_total_norm_fp32([torch.nn.Parameter(torch.ones(3))], v, 1.0),
        "real", inf_ok=True),
    Arg("SpikeDetector", "threshold", lambda v: tpamp.SpikeDetector(threshold=v), "real"),
    Arg("SpikeDetector", "window", lambda v: tpamp.SpikeDetector(window=v), "int"),
    Arg("SpikeDetector", "warmup", lambda v: tpamp.SpikeDetector(warmup=v), "int"),
    Arg("SpikeDetector", "grad_norm_min_rel_std",
        lambda v: tpamp.SpikeDetector(grad_norm_min_rel_std=v), "real"),
    Arg("SpikeDetector", "loss_min_rel_std", lambda v: tpamp.SpikeDetector(loss_min_rel_std=v), "real"),
    Arg("ParallelDims", "tp", lambda v: ParallelDims(tp=v), "int"),
    Arg("ParallelDims", "pp", lambda v: ParallelDims(pp=v), "int"),
    Arg("ParallelDims", "dp", lambda v: ParallelDims(dp=v), "int"),
    Arg("ParallelDims", "world_size", lambda v: ParallelDims(world_size=v), "int"),
    Arg("TrainingLogger", "train_iters", lambda v: tpamp.TrainingLogger(v), "int"),
    Arg("TrainingLogger", "log_interval", lambda v: tpamp.TrainingLogger(10, log_interval=v), "int"),
    Arg("TrainingLogger", "param_grad_norms_top_k",
        lambda v: tpamp.TrainingLogger(10, param_grad_norms_top_k=v), "int"),
    Arg("NonFiniteTracer", "margin",
        lambda v: tpamp.NonFiniteTracer(torch.nn.Linear(2, 2), margin=v), "real"),
    Arg("ParallelAMPConfig", "initial_scale", lambda v: _config(initial_scale=v), "real"),
    Arg("ParallelAMPConfig", "min_scale", lambda v: _config(min_scale=v), "real"),
    Arg("ParallelAMPConfig", "growth_factor", lambda v: _config(growth_factor=v), "real"),
    Arg("ParallelAMPConfig", "backoff_factor", lambda v: _config(backoff_factor=v), "real"),
    Arg("ParallelAMPConfig", "growth_interval", lambda v: _config(growth_interval=v), "int"),
    Arg("ParallelAMPConfig", "hysteresis", lambda v: _config(hysteresis=v), "int"),
    Arg("ParallelAMPConfig", "max_scale", lambda v: _config(max_scale=v), "real"),
    Arg("ParallelAMPConfig", "loss_scale", lambda v: _config(loss_scale=v), "real"),
    Arg("ParallelAMPConfig", "clip_grad", lambda v: _config(clip_grad=v), "real"),
    Arg("ParallelAMPConfig", "norm_type", lambda v: _config(norm_type=v), "real", inf_ok=True),
    Arg("TorchAMPConfig", "init_scale", lambda v: _torch_config(init_scale=v), "real"),
    Arg("TorchAMPConfig", "growth_interval", lambda v: _torch_config(growth_interval=v), "int"),
]

# (label, value, expected exception for a real argument, for an int argument, words of the value)
BAD_VALUES = [
    ("str", "2", TypeError, TypeError, ["'2'"]),
    ("bool", True, TypeError, TypeError, ["True"]),
    ("none", None, TypeError, TypeError, ["None"]),
    ("nan", math.nan, ValueError, TypeError, ["nan"]),
    ("inf", math.inf, ValueError, TypeError, ["inf"]),
    ("negative", -3, ValueError, ValueError, ["-3"]),
    ("negative_float", -3.0, ValueError, TypeError, ["-3.0"]),
]
# arguments for which None is a legal value (off / derived)
_NONE_OK = {("DynamicGradScaler", "max_scale"), ("ParallelDims", "dp"),
            ("TrainingLogger", "param_grad_norms_top_k"), ("NonFiniteTracer", "margin"),
            ("ParallelAMPConfig", "max_scale"), ("ParallelAMPConfig", "loss_scale")}


def _cases():
    out = []
    for arg in ARGS:
        for label, value, real_exc, int_exc, words in BAD_VALUES:
            if label == "inf" and arg.inf_ok:
                continue
            if label == "none" and (arg.owner, arg.name) in _NONE_OK:
                continue
            exc = real_exc if arg.kind == "real" else int_exc
            out.append(pytest.param(arg, value, exc, words,
                                    id=f"{arg.owner}-{arg.name}-{label}"))
    return out


def _words(words):
    """Regex: every word present as a token of its own (not part of a longer identifier)."""
    return "(?s)" + "".join(rf"(?=.*(?<![\w.]){re.escape(w)}(?![\w]))" for w in words)


@pytest.mark.parametrize("arg,value,exc,words", _cases())
def test_a_bad_number_raises_the_one_rule_naming_the_argument_and_the_value(arg, value, exc, words):
    with pytest.raises((TypeError, ValueError)) as info:
        arg.build(value)
    assert type(info.value) is exc, (
        f"{arg.owner}({arg.name}={value!r}) raised {type(info.value).__name__}, expected "
        f"{exc.__name__}: {info.value}"
    )
    msg = str(info.value)
    assert re.search(_words([arg.name, *words]), msg), f"{arg.name} / {words} not in: {msg}"


def test_the_table_covers_every_family_and_every_bad_value():
    owners = {a.owner for a in ARGS}
    assert {"ConstantGradScaler", "DynamicGradScaler", "ModelParallelGradScaler",
            "MixedPrecisionOptimizer", "FP32Optimizer", "TorchAMPOptimizer", "SpikeDetector",
            "ParallelDims", "TrainingLogger", "ParallelAMPConfig"} <= owners
    assert {a.kind for a in ARGS} == {"real", "int"}
    # every row is built with a good value first: the table's builders themselves are sound
    good = {"real": 2.0, "int": 4}
    for a in ARGS:
        value = good[a.kind]
        if (a.owner, a.name) in {("DynamicGradScaler", "backoff_factor"),
                                 ("ModelParallelGradScaler", "backoff_factor"),
                                 ("ParallelAMPConfig", "backoff_factor")}:
            value = 0.5
        if a.owner == "ParallelDims":
            value = 1
        if (a.owner, a.name) == ("DynamicGradScaler", "min_scale"):
            value = 1.0
        if (a.owner, a.name) in {("DynamicGradScaler", "max_scale"), ("ParallelAMPConfig", "max_scale")}:
            value = 2.0**40
        if (a.owner, a.name) == ("SpikeDetector", "window"):
            value = 100
        a.build(value)
