"""Misuse suite: each bad argument or loaded value raises the documented exception type, with
a message that names the argument or key (docs/spec.md section 14). Single process, no collectives: the whole
file runs in a few seconds. Multi-rank faults live in tests/test_faults_dist.py."""

from __future__ import annotations

import copy
import math
import os
import re
import traceback

import pytest
import torch

import tpamp
from tpamp.parallel import ParallelDims, initialize_model_parallel

NAN, INF = math.nan, math.inf


# ---- small builders (fresh objects per case) ------------------------------------------------


def _fp16_opt(inner_cls=torch.optim.SGD, scaler=None, **inner_kwargs):
    """An fp16 model param [3], its inner optimizer and the wrapper."""
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    inner = inner_cls([p], lr=0.1, **inner_kwargs)
    scaler = scaler or tpamp.DynamicGradScaler(initial_scale=4.0, growth_interval=4)
    return p, inner, tpamp.MixedPrecisionOptimizer(inner, grad_scaler=scaler)


def _stepped_adam():
    """An fp16 Adam wrapper after one real step (so it has state) and its state dict."""
    p, inner, opt = _fp16_opt(torch.optim.Adam)
    opt.scale_loss(p.float().sum()).backward()
    opt.step()
    opt.zero_grad()
    # deep copy: torch's state_dict() shares the live per-param state dicts
    return opt, copy.deepcopy(opt.state_dict())


def _load_edited(edit):
    opt, sd = _stepped_adam()
    edit(sd)
    opt.load_state_dict(sd)


def _dyn_load(**state):
    base = {"scale": torch.tensor([8.0]), "growth_tracker": 0, "hysteresis_tracker": 2}
    base.update(state)
    for k in [k for k, v in base.items() if v is _DROP]:
        del base[k]
    s = tpamp.DynamicGradScaler(initial_scale=8.0, min_scale=2.0, max_scale=64.0,
                                growth_interval=4, hysteresis=2)
    s.load_state_dict(base)


_DROP = object()


def _torch_amp_opt(inner_cls=torch.optim.SGD, **kwargs):
    p = torch.nn.Parameter(torch.ones(3))
    inner = inner_cls([p], lr=0.1)
    return p, tpamp.TorchAMPOptimizer(inner, tpamp.ModelParallelGradScaler("cpu"), **kwargs)


def _step_twice_mpo():
    q = torch.nn.Parameter(torch.ones(3))
    opt = tpamp.MixedPrecisionOptimizer(torch.optim.SGD([q], lr=1.0),
                                        grad_scaler=tpamp.ConstantGradScaler(4.0))
    opt.scale_loss(q.sum()).backward()
    opt.step()
    opt.step()


def _step_twice_torch_amp():
    p, opt = _torch_amp_opt()
    opt.scale_loss(p.sum()).backward()
    opt.step()
    opt.step()


def _group_added_after_wrap():
    p, inner, opt = _fp16_opt()
    inner.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
    p.grad = torch.ones(3, dtype=torch.float16)
    opt.step()


def _wrap_twice():
    _, inner, _ = _fp16_opt()
    tpamp.MixedPrecisionOptimizer(inner, grad_scaler=tpamp.ConstantGradScaler(1.0))


def _sgd_state_into_adam():
    q = torch.nn.Parameter(torch.ones(3))
    sgd = torch.optim.SGD([q], lr=1.0, momentum=0.9)
    q.grad = torch.ones(3)
    sgd.step()
    r = torch.nn.Parameter(torch.ones(3))
    adam = tpamp.MixedPrecisionOptimizer(torch.optim.Adam([r]))
    adam.load_state_dict({"optimizer": sgd.state_dict(), "fp32_from_fp16_params": [[]],
                          "grad_scaler": None})


def _adam_state_into_sgd():
    opt, sd = _stepped_adam()
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    sgd = tpamp.MixedPrecisionOptimizer(torch.optim.SGD([p], lr=0.1, momentum=0.9),
                                        grad_scaler=tpamp.ConstantGradScaler(1.0))
    sd["grad_scaler"] = None
    sgd.load_state_dict(sd)


def _logger_record(*args, **extra):
    defaults = [1, 2.5, 1e-3, 1024.0, tpamp.StepResult(True, 0.5, None)]
    for i, a in enumerate(args):
        if a is not _KEEP:
            defaults[i] = a
    tpamp.TrainingLogger(10, stream=open("/dev/null", "w")).record(*defaults, **extra)


_KEEP = object()


def _grads():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    return [p]


def _set(path, value):
    def edit(sd):
        d = sd
        for k in path[:-1]:
            d = d[k]
        if value is _DROP:
            del d[path[-1]]
        else:
            d[path[-1]] = value(d[path[-1]]) if callable(value) else value
    return edit


def _first_state(sd):
    return next(iter(sd["optimizer"]["state"].values()))


def _edit_state(key, fn):
    def edit(sd):
        st = _first_state(sd)
        st[key] = fn(st[key])
    return edit


# ---- the cases: (id, call, exception type, words the message must contain) ------------------

CASES = [
    # DynamicGradScaler construction: scales are validated in float32, the dtype they live in
    ("dyn-initial_scale-1e39", lambda: tpamp.DynamicGradScaler(initial_scale=1e39), ValueError, ["initial_scale", "float32"]),
    ("dyn-initial_scale-1e-50", lambda: tpamp.DynamicGradScaler(initial_scale=1e-50, min_scale=1e-50), ValueError, ["initial_scale", "float32"]),
    ("dyn-min_scale-1e-50", lambda: tpamp.DynamicGradScaler(initial_scale=1.0, min_scale=1e-50), ValueError, ["min_scale", "float32"]),
    ("dyn-max_scale-1e39", lambda: tpamp.DynamicGradScaler(initial_scale=1.0, max_scale=1e39), ValueError, ["max_scale", "float32"]),
    ("dyn-initial_scale-list", lambda: tpamp.DynamicGradScaler(initial_scale=[8.0]), TypeError, ["initial_scale", "8.0", "list"]),
    ("dyn-device-cuda99", lambda: tpamp.DynamicGradScaler(device="cuda:99"), ValueError, ["device", "cuda:99"]),
    ("dyn-device-bogus", lambda: tpamp.DynamicGradScaler(device="bogus"), ValueError, ["device", "bogus"]),
    ("dyn-device-float", lambda: tpamp.DynamicGradScaler(device=3.5), TypeError, ["device", "3.5"]),
    # ConstantGradScaler construction
    ("const-1e39", lambda: tpamp.ConstantGradScaler(1e39), ValueError, ["scale", "float32"]),
    ("const-1e-50", lambda: tpamp.ConstantGradScaler(1e-50), ValueError, ["scale", "float32"]),
    ("const-0", lambda: tpamp.ConstantGradScaler(0.0), ValueError, ["scale"]),
    ("const-negative", lambda: tpamp.ConstantGradScaler(-2.0), ValueError, ["scale", "-2.0"]),
    ("const-nan", lambda: tpamp.ConstantGradScaler(NAN), ValueError, ["scale", "nan"]),
    ("const-inf", lambda: tpamp.ConstantGradScaler(INF), ValueError, ["scale", "inf"]),
    ("const-str", lambda: tpamp.ConstantGradScaler("8"), TypeError, ["scale", "'8'"]),
    ("const-device-bogus", lambda: tpamp.ConstantGradScaler(8.0, device="bogus"), ValueError, ["device"]),
    # DynamicGradScaler.load_state_dict: checked against the scaler's config
    ("dynload-None", lambda: tpamp.DynamicGradScaler().load_state_dict(None), TypeError, ["state_dict", "None"]),
    ("dynload-list", lambda: tpamp.DynamicGradScaler().load_state_dict([8.0]), TypeError, ["state_dict", "list"]),
    ("dynload-missing-scale", lambda: _dyn_load(scale=_DROP), KeyError, ["scale"]),
    ("dynload-missing-growth", lambda: _dyn_load(growth_tracker=_DROP), KeyError, ["growth_tracker"]),
    ("dynload-unknown-key", lambda: _dyn_load(loss_scale=8.0), KeyError, ["loss_scale"]),
    ("dynload-scale-str", lambda: _dyn_load(scale="x"), TypeError, ["scale", "'x'"]),
    ("dynload-scale-None", lambda: _dyn_load(scale=None), TypeError, ["scale", "None"]),
    ("dynload-scale-nan", lambda: _dyn_load(scale=torch.tensor([NAN])), ValueError, ["scale", "nan"]),
    ("dynload-scale-inf", lambda: _dyn_load(scale=torch.tensor([INF])), ValueError, ["scale", "inf"]),
    ("dynload-scale-1e39", lambda: _dyn_load(scale=1e39), ValueError, ["scale", "float32"]),
    ("dynload-scale-zero", lambda: _dyn_load(scale=torch.tensor([0.0])), ValueError, ["scale"]),
    ("dynload-scale-2-elements", lambda: _dyn_load(scale=torch.tensor([8.0, 8.0])), ValueError, ["scale", "shape"]),
    ("dynload-scale-int-tensor", lambda: _dyn_load(scale=torch.tensor([8])), ValueError, ["scale", "int64"]),
    ("dynload-scale-below-min", lambda: _dyn_load(scale=torch.tensor([1.0])), ValueError, ["scale", "min_scale"]),
    ("dynload-scale-above-max", lambda: _dyn_load(scale=torch.tensor([128.0])), ValueError, ["scale", "max_scale"]),
    ("dynload-growth-at-interval", lambda: _dyn_load(growth_tracker=4), ValueError, ["growth_tracker", "4"]),
    ("dynload-growth-negative", lambda: _dyn_load(growth_tracker=-1), ValueError, ["growth_tracker", "-1"]),
    ("dynload-growth-float", lambda: _dyn_load(growth_tracker=1.5), TypeError, ["growth_tracker", "1.5"]),
    ("dynload-growth-str", lambda: _dyn_load(growth_tracker="3"), TypeError, ["growth_tracker", "'3'"]),
    ("dynload-growth-bool", lambda: _dyn_load(growth_tracker=True), TypeError, ["growth_tracker", "True"]),
    ("dynload-hysteresis-above", lambda: _dyn_load(hysteresis_tracker=3), ValueError, ["hysteresis_tracker", "3"]),
    ("dynload-hysteresis-None", lambda: _dyn_load(hysteresis_tracker=None), TypeError, ["hysteresis_tracker", "None"]),
    # ConstantGradScaler.load_state_dict
    ("constload-nan", lambda: tpamp.ConstantGradScaler(4.0).load_state_dict({"tpamp_constant_scale": NAN}), ValueError, ["tpamp_constant_scale", "nan"]),
    ("constload-1e39", lambda: tpamp.ConstantGradScaler(4.0).load_state_dict({"tpamp_constant_scale": 1e39}), ValueError, ["tpamp_constant_scale", "float32"]),
    ("constload-negative", lambda: tpamp.ConstantGradScaler(4.0).load_state_dict({"tpamp_constant_scale": -4.0}), ValueError, ["tpamp_constant_scale", "-4.0"]),
    ("constload-str", lambda: tpamp.ConstantGradScaler(4.0).load_state_dict({"tpamp_constant_scale": "4"}), TypeError, ["tpamp_constant_scale", "'4'"]),
    ("constload-unknown-key", lambda: tpamp.ConstantGradScaler(4.0).load_state_dict({"scale": 4.0}), KeyError, ["scale"]),
    ("constload-None", lambda: tpamp.ConstantGradScaler(4.0).load_state_dict(None), TypeError, ["state_dict"]),
    # update(found_inf)
    ("update-found_inf-str", lambda: tpamp.DynamicGradScaler().update("yes"), TypeError, ["found_inf", "str"]),
    ("update-found_inf-2-elements", lambda: tpamp.DynamicGradScaler().update(torch.zeros(2)), ValueError, ["found_inf", "shape"]),
    ("const-update-found_inf-None", lambda: tpamp.ConstantGradScaler(2.0).update(None), TypeError, ["found_inf"]),
    # MixedPrecisionOptimizer construction and use
    ("mpo-wrap-twice", _wrap_twice, ValueError, ["optimizer", "already", "wrapped"]),
    ("mpo-group-added-after-wrap", _group_added_after_wrap, RuntimeError, ["param_groups", "wrapped"]),
    ("mpo-step-twice", _step_twice_mpo, RuntimeError, ["step", "backward"]),
    ("mpo-scale_loss-float", lambda: _fp16_opt()[2].scale_loss(1.0), TypeError, ["loss", "float"]),
    ("mpo-scale_loss-int-tensor", lambda: _fp16_opt()[2].scale_loss(torch.tensor(3)), TypeError, ["loss", "int64"]),
    ("mpo-backward-str", lambda: _fp16_opt()[2].backward("loss"), TypeError, ["loss", "str"]),
    ("mpo-grad_scaler-torch", lambda: tpamp.MixedPrecisionOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1), grad_scaler=torch.amp.GradScaler("cpu")), TypeError, ["grad_scaler", "GradScaler"]),
    ("mpo-grad_stats_group-int", lambda: tpamp.MixedPrecisionOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1), grad_stats_group=5), TypeError, ["grad_stats_group", "int"]),
    ("mpo-tensor_parallel_group-str", lambda: tpamp.MixedPrecisionOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1), tensor_parallel_group="tp"), TypeError, ["tensor_parallel_group", "str"]),
    ("mpo-clip_grad-str", lambda: tpamp.MixedPrecisionOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1), clip_grad="1"), TypeError, ["clip_grad", "'1'"]),
    ("mpo-norm_type-str", lambda: tpamp.MixedPrecisionOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1), norm_type="2"), TypeError, ["norm_type", "'2'"]),
    ("mpo-sync_free-unfused", lambda: tpamp.MixedPrecisionOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1), sync_free=True), ValueError, ["sync_free", "SGD"]),
    ("mpo-step-closure", lambda: _fp16_opt()[2].step(lambda: 0.0), ValueError, ["closure"]),
    ("mpo-float64-param-in-second-group", lambda: tpamp.MixedPrecisionOptimizer(torch.optim.SGD([{"params": [torch.nn.Parameter(torch.ones(1, dtype=torch.float16))]}, {"params": [torch.nn.Parameter(torch.ones(1, dtype=torch.float64))]}], lr=1), grad_scaler=tpamp.ConstantGradScaler(1.0)), TypeError, ["param", "group", "torch.float64"]),
    # MixedPrecisionOptimizer.load_state_dict: all of it checked first
    ("load-None", lambda: _stepped_adam()[0].load_state_dict(None), TypeError, ["state_dict", "None"]),
    ("load-list", lambda: _stepped_adam()[0].load_state_dict([]), TypeError, ["state_dict", "list"]),
    ("load-missing-optimizer", lambda: _load_edited(_set(["optimizer"], _DROP)), KeyError, ["optimizer"]),
    ("load-missing-main-params", lambda: _load_edited(_set(["fp32_from_fp16_params"], _DROP)), KeyError, ["fp32_from_fp16_params"]),
    ("load-optimizer-str", lambda: _load_edited(_set(["optimizer"], "adam")), TypeError, ["optimizer", "str"]),
    ("load-optimizer-no-state", lambda: _load_edited(_set(["optimizer", "state"], _DROP)), KeyError, ["state"]),
    ("load-optimizer-no-param_groups", lambda: _load_edited(_set(["optimizer", "param_groups"], _DROP)), KeyError, ["param_groups"]),
    ("load-param-group-count", lambda: _load_edited(_set(["optimizer", "param_groups"], lambda g: g + g)), ValueError, ["param_groups", "2"]),
    ("load-param-count", lambda: _load_edited(lambda sd: sd["optimizer"]["param_groups"][0].update(params=[0, 1])), ValueError, ["params", "2"]),
    ("load-group-without-params", lambda: _load_edited(lambda sd: sd["optimizer"]["param_groups"][0].pop("params")), KeyError, ["params"]),
    ("load-group-missing-betas", lambda: _load_edited(lambda sd: sd["optimizer"]["param_groups"][0].pop("betas")), ValueError, ["betas", "Adam"]),
    ("load-sgd-into-adam", _sgd_state_into_adam, ValueError, ["betas", "Adam"]),
    ("load-adam-into-sgd", _adam_state_into_sgd, ValueError, ["momentum", "SGD"]),
    ("load-state-unknown-id", lambda: _load_edited(lambda sd: sd["optimizer"]["state"].update({7: {}})), ValueError, ["state", "7"]),
    ("load-state-wrong-shape", lambda: _load_edited(_edit_state("exp_avg", lambda t: torch.zeros(5))), ValueError, ["exp_avg", "shape"]),
    ("load-state-nan", lambda: _load_edited(_edit_state("exp_avg_sq", lambda t: torch.full_like(t, NAN))), ValueError, ["exp_avg_sq", "nan"]),
    ("load-state-other-keys", lambda: _load_edited(lambda sd: sd["optimizer"]["state"].update({0: {"momentum_buffer": torch.zeros(3)}})), ValueError, ["momentum_buffer", "exp_avg"]),
    ("load-state-entry-not-dict", lambda: _load_edited(lambda sd: sd["optimizer"]["state"].update({0: 1.0})), TypeError, ["state", "float"]),
    ("load-scaler-nan", lambda: _load_edited(_set(["grad_scaler", "scale"], torch.tensor([NAN]))), ValueError, ["grad_scaler", "scale", "nan"]),
    ("load-scaler-str-scale", lambda: _load_edited(_set(["grad_scaler", "scale"], "big")), TypeError, ["grad_scaler", "scale"]),
    ("load-scaler-growth-tracker", lambda: _load_edited(_set(["grad_scaler", "growth_tracker"], 4)), ValueError, ["grad_scaler", "growth_tracker"]),
    ("load-scaler-not-dict", lambda: _load_edited(_set(["grad_scaler"], 8.0)), TypeError, ["grad_scaler", "float"]),
    ("load-main-nan", lambda: _load_edited(lambda sd: sd["fp32_from_fp16_params"][0][0].fill_(NAN)), ValueError, ["fp32_from_fp16_params", "nan"]),
    ("load-main-inf", lambda: _load_edited(lambda sd: sd["fp32_from_fp16_params"][0][0].__setitem__(1, INF)), ValueError, ["fp32_from_fp16_params", "inf"]),
    ("load-main-shape", lambda: _load_edited(lambda sd: sd["fp32_from_fp16_params"][0].__setitem__(0, torch.zeros(4))), ValueError, ["shape", "fp32_from_fp16_params"]),
    ("load-main-fp16", lambda: _load_edited(lambda sd: sd["fp32_from_fp16_params"][0].__setitem__(0, torch.zeros(3, dtype=torch.float16))), ValueError, ["fp32_from_fp16_params", "torch.float16"]),
    ("load-main-not-list", lambda: _load_edited(_set(["fp32_from_fp16_params"], torch.zeros(3))), TypeError, ["fp32_from_fp16_params", "Tensor"]),
    ("load-main-group-count", lambda: _load_edited(_set(["fp32_from_fp16_params"], lambda g: g + g)), ValueError, ["param groups", "2"]),
    ("load-main-not-tensor", lambda: _load_edited(lambda sd: sd["fp32_from_fp16_params"][0].__setitem__(0, [1.0, 1.0, 1.0])), TypeError, ["fp32_from_fp16_params", "list"]),
    # ModelParallelGradScaler
    ("mpgs-init_scale-0", lambda: tpamp.ModelParallelGradScaler("cpu", init_scale=0.0), ValueError, ["init_scale"]),
    ("mpgs-init_scale-negative", lambda: tpamp.ModelParallelGradScaler("cpu", init_scale=-8.0), ValueError, ["init_scale", "-8.0"]),
    ("mpgs-init_scale-1e39", lambda: tpamp.ModelParallelGradScaler("cpu", init_scale=1e39), ValueError, ["init_scale", "float32"]),
    ("mpgs-init_scale-nan", lambda: tpamp.ModelParallelGradScaler("cpu", init_scale=NAN), ValueError, ["init_scale", "nan"]),
    ("mpgs-growth_factor-1", lambda: tpamp.ModelParallelGradScaler("cpu", growth_factor=1.0), ValueError, ["growth_factor", "1.0"]),
    ("mpgs-backoff_factor-1.5", lambda: tpamp.ModelParallelGradScaler("cpu", backoff_factor=1.5), ValueError, ["backoff_factor", "1.5"]),
    ("mpgs-growth_interval-0", lambda: tpamp.ModelParallelGradScaler("cpu", growth_interval=0), ValueError, ["growth_interval", "0"]),
    ("mpgs-growth_interval-float", lambda: tpamp.ModelParallelGradScaler("cpu", growth_interval=2.5), TypeError, ["growth_interval", "2.5"]),
    ("mpgs-enabled-str", lambda: tpamp.ModelParallelGradScaler("cpu", enabled="yes"), TypeError, ["enabled", "'yes'"]),
    ("mpgs-device-int", lambda: tpamp.ModelParallelGradScaler(3), TypeError, ["device", "3"]),
    ("mpgs-group-int", lambda: tpamp.ModelParallelGradScaler("cpu", model_parallel_group=7), TypeError, ["model_parallel_group", "int"]),
    # TorchAMPOptimizer
    ("tamp-clip_grad-negative", lambda: _torch_amp_opt(clip_grad=-1.0), ValueError, ["clip_grad", "-1.0"]),
    ("tamp-clip_grad-nan", lambda: _torch_amp_opt(clip_grad=NAN), ValueError, ["clip_grad", "nan"]),
    ("tamp-norm_type-0.5", lambda: _torch_amp_opt(norm_type=0.5), ValueError, ["norm_type", "0.5"]),
    ("tamp-scaler-None", lambda: tpamp.TorchAMPOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1), None), TypeError, ["scaler", "NoneType"]),
    ("tamp-optimizer-list", lambda: tpamp.TorchAMPOptimizer([torch.ones(1)], tpamp.ModelParallelGradScaler("cpu")), TypeError, ["optimizer", "list"]),
    ("tamp-grad_stats_group-str", lambda: _torch_amp_opt(grad_stats_group="mp"), TypeError, ["grad_stats_group", "str"]),
    ("tamp-scale_loss-float", lambda: _torch_amp_opt()[1].scale_loss(2.0), TypeError, ["loss", "float"]),
    ("tamp-step-twice", _step_twice_torch_amp, RuntimeError, ["step", "backward"]),
    ("tamp-load-None", lambda: _torch_amp_opt()[1].load_state_dict(None), TypeError, ["state_dict", "None"]),
    ("tamp-load-missing-optimizer", lambda: _torch_amp_opt()[1].load_state_dict({"grad_scaler": {}}), KeyError, ["optimizer"]),
    ("tamp-load-adam-into-sgd", lambda: _torch_amp_opt()[1].load_state_dict({"optimizer": torch.optim.Adam([torch.nn.Parameter(torch.ones(3))]).state_dict()}), ValueError, ["momentum", "SGD"]),
    ("tamp-load-scaler-nan", lambda: _torch_amp_opt()[1].load_state_dict({"optimizer": torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1).state_dict(), "grad_scaler": {"scale": NAN, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000, "_growth_tracker": 0}}), ValueError, ["grad_scaler", "scale", "nan"]),
    ("tamp-load-scaler-tracker", lambda: _torch_amp_opt()[1].load_state_dict({"optimizer": torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1).state_dict(), "grad_scaler": {"scale": 8.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 10, "_growth_tracker": 10}}), ValueError, ["_growth_tracker", "10"]),
    ("tamp-load-scaler-missing", lambda: _torch_amp_opt()[1].load_state_dict({"optimizer": torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1).state_dict(), "grad_scaler": {"scale": 8.0}}), KeyError, ["grad_scaler", "growth_factor"]),
    # grad statistics
    ("norm-floats", lambda: tpamp.get_grad_norm_fp32([1.0, 2.0]), TypeError, ["grads_for_norm", "float"]),
    ("norm-None", lambda: tpamp.get_grad_norm_fp32(None), TypeError, ["grads_for_norm", "NoneType"]),
    ("norm-dict", lambda: tpamp.get_grad_norm_fp32({"w": torch.ones(2)}), TypeError, ["grads_for_norm", "dict"]),
    ("norm-group-int", lambda: tpamp.get_grad_norm_fp32([torch.ones(2)], grad_stats_group=3), TypeError, ["grad_stats_group", "int"]),
    ("clip-total_norm-str", lambda: tpamp.clip_grad_by_total_norm_fp32(_grads(), 1.0, "big"), TypeError, ["total_norm", "str"]),
    ("clip-total_norm-2-elements", lambda: tpamp.clip_grad_by_total_norm_fp32(_grads(), 1.0, torch.ones(2)), ValueError, ["total_norm", "shape"]),
    ("clip-max_norm-0", lambda: tpamp.clip_grad_by_total_norm_fp32(_grads(), 0.0, 1.0), ValueError, ["max_norm", "0.0"]),
    ("clip-params-floats", lambda: tpamp.clip_grad_by_total_norm_fp32([1.0], 1.0, 2.0), TypeError, ["params", "float"]),
    ("zeros-params-str", lambda: tpamp.count_zeros_fp32("weights"), TypeError, ["params", "str"]),
    ("zeros-tp-group-str", lambda: tpamp.count_zeros_fp32(_grads(), tensor_parallel_group="tp"), TypeError, ["tensor_parallel_group", "str"]),
    ("filter-params-int", lambda: tpamp.filter_grads_for_norm(5), TypeError, ["params", "int"]),
    # TrainingLogger
    ("log-result-None", lambda: _logger_record(_KEEP, _KEEP, _KEEP, _KEEP, None), TypeError, ["result", "None"]),
    ("log-result-pair", lambda: _logger_record(_KEEP, _KEEP, _KEEP, _KEEP, (True, 1.0)), TypeError, ["result", "tuple"]),
    ("log-result-str", lambda: _logger_record(_KEEP, _KEEP, _KEEP, _KEEP, "ok!"), TypeError, ["result", "str"]),
    ("log-loss-str", lambda: _logger_record(_KEEP, "2.5"), TypeError, ["loss", "'2.5'"]),
    ("log-lr-None", lambda: _logger_record(_KEEP, _KEEP, None), TypeError, ["lr", "None"]),
    ("log-loss_scale-list", lambda: _logger_record(_KEEP, _KEEP, _KEEP, [1024.0]), TypeError, ["loss_scale", "list"]),
    ("log-iteration-float", lambda: _logger_record(1.5), TypeError, ["iteration", "1.5"]),
    ("log-grad_norm-str", lambda: _logger_record(_KEEP, _KEEP, _KEEP, _KEEP, (True, "0.5", None)), TypeError, ["grad_norm", "'0.5'"]),
    ("log-extra-object", lambda: _logger_record(tokens=object()), TypeError, ["tokens"]),
    ("log-log_interval-0", lambda: tpamp.TrainingLogger(10, log_interval=0), ValueError, ["log_interval", "0"]),
    ("log-train_iters-negative", lambda: tpamp.TrainingLogger(-1), ValueError, ["train_iters", "-1"]),
    # parallel layout
    ("dims-tp-0", lambda: ParallelDims(tp=0, world_size=4), ValueError, ["tp", "0"]),
    ("dims-pp-float", lambda: ParallelDims(pp=1.5, world_size=4), TypeError, ["pp", "1.5"]),
    ("dims-dp-0", lambda: ParallelDims(dp=0, world_size=4), ValueError, ["dp", "0"]),
    ("dims-coords-rank", lambda: ParallelDims(tp=2, world_size=4).coords(9), ValueError, ["rank", "9"]),
    ("init-mp-not-initialized", lambda: initialize_model_parallel(1, 1), RuntimeError, ["init_process_group"]),
    # tpamp.initialize configs: scales validated in float32 too
    ("cfg-initial_scale-1e39", lambda: tpamp.parse_amp_config(dict(initial_scale=1e39)), ValueError, ["initial_scale", "float32"]),
    ("cfg-min_scale-1e-50", lambda: tpamp.parse_amp_config(dict(min_scale=1e-50, initial_scale=1.0)), ValueError, ["min_scale", "float32"]),
    ("cfg-max_scale-1e39", lambda: tpamp.parse_amp_config(dict(max_scale=1e39)), ValueError, ["max_scale", "float32"]),
    ("cfg-loss_scale-1e39", lambda: tpamp.parse_amp_config(dict(loss_scale=1e39)), ValueError, ["loss_scale", "float32"]),
    ("cfg-torch-init_scale-1e39", lambda: tpamp.parse_amp_config(dict(mode="torch", init_scale=1e39)), ValueError, ["init_scale", "float32"]),
]


def _words(words):
    """Regex: every word present as a token of its own (not part of a longer identifier)."""
    return "(?s)" + "".join(rf"(?=.*(?<![\w]){re.escape(w)}(?![\w]))" for w in words)


def test_every_case_is_refused_by_tpamp_itself():
    """The innermost frame of each case's exception is in the tpamp package: tpamp refuses the
    input itself, rather than the case's own builder (a broken lambda raising the expected type
    would otherwise pass) or torch further down. Ids are distinct, so ``-k`` selects one case."""
    ids = [c[0] for c in CASES]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    package = os.path.dirname(os.path.abspath(tpamp.__file__)) + os.sep
    elsewhere = {}
    for case_id, call, exc, _ in CASES:
        try:
            call()
        except exc as e:
            frame = traceback.extract_tb(e.__traceback__)[-1]
            if not os.path.abspath(frame.filename).startswith(package):
                elsewhere[case_id] = f"{frame.filename}:{frame.lineno}"
        else:
            elsewhere[case_id] = "nothing raised"
    assert not elsewhere, elsewhere


@pytest.mark.parametrize("case_id,call,exc,words", CASES, ids=[c[0] for c in CASES])
def test_misuse_raises_a_clear_error_naming_the_argument(case_id, call, exc, words):
    with pytest.raises(exc) as info:
        call()
    assert type(info.value) is exc or exc in type(info.value).__mro__
    msg = info.value.args[0] if isinstance(info.value, KeyError) and info.value.args else str(info.value)
    assert re.search(_words(words), str(msg)), f"{case_id}: {words} not all in: {msg}"
