"""tpamp.matrix_optimizers on one process: the classes step whole params exactly as the torch
classes do, the combined Muon + AdamW optimizer steps as the two torch optimizers would, and the
wrapper options that cannot apply are refused (docs/spec.md section 17). The TP runs are in
tests/test_matrix_optimizers_dist.py."""

import copy
import io
import math

import pytest
import torch
from dist_utils import freeze, tensor_bytes
from misuse_utils import Case, assert_every_setup_case_refused_by_tpamp, assert_refused_and_unchanged

import tpamp


def _pair(shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g, dtype=dtype)
    return torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())


def _grads(shape, n, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=dtype) for _ in range(n)]


@pytest.mark.parametrize("shape", [(8, 12), (12, 8), (6, 6)])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_tensor_parallel_muon_on_a_whole_param_is_torch_muon_bit_for_bit(shape, nesterov,
                                                                       adjust_lr_fn):
    a, b = _pair(shape)
    kw = dict(lr=0.02, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn, weight_decay=0.05)
    oa, ob = tpamp.TensorParallelMuon([a], **kw), torch.optim.Muon([b], **kw)
    for g in _grads(shape, 3):
        a.grad, b.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    assert torch.equal(a, b)
    assert torch.equal(oa.state[a]["momentum_buffer"], ob.state[b]["momentum_buffer"])


@pytest.mark.parametrize("shape", [(8, 12), (12, 8), (7,)])
def test_tensor_parallel_adafactor_on_a_whole_param_is_torch_adafactor(shape):
    a, b = _pair(shape)
    kw = dict(lr=0.01, weight_decay=0.1)
    oa, ob = tpamp.TensorParallelAdafactor([a], **kw), torch.optim.Adafactor([b], **kw)
    for g in _grads(shape, 3):
        a.grad, b.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert sorted(oa.state[a]) == sorted(ob.state[b])  # same state keys


def test_qkv_split_orthogonalises_like_three_separate_params():
    sizes = (4, 2, 2)
    w, _ = _pair((32, 8), dtype=torch.float64)

    def parts(t):
        blocks, out, off = t.reshape(4, 8, 8), [], 0
        for s in sizes:
            out.append(blocks[:, off:off + s].reshape(-1, 8))
            off += s
        return out

    def join(ts):
        return torch.cat([t.reshape(4, s, 8) for t, s in zip(ts, sizes)], dim=1).reshape(32, 8)

    sep = [torch.nn.Parameter(t.clone()) for t in parts(w.detach())]
    oa = tpamp.TensorParallelMuon([{"params": [w], "qkv_split_sizes": sizes}], lr=0.02)
    ob = torch.optim.Muon(sep, lr=0.02)
    for g in _grads((32, 8), 3, dtype=torch.float64):
        w.grad = g.clone()
        for p, q in zip(sep, parts(g)):
            p.grad = q.clone()
        oa.step()
        ob.step()
    torch.testing.assert_close(w, join(sep), rtol=0, atol=1e-15)


def test_bad_tp_mode_and_qkv_sizes_are_refused():
    p = torch.nn.Parameter(torch.randn(12, 8))
    with pytest.raises(ValueError, match="tp_mode must be one of"):
        tpamp.TensorParallelMuon([p], tp_mode="sharded")
    with pytest.raises(ValueError, match="do not tile"):
        tpamp.TensorParallelMuon([{"params": [p], "qkv_split_sizes": (5, 2, 2)}])
    with pytest.raises(ValueError, match="qkv_split_sizes must be"):
        tpamp.TensorParallelMuon([{"params": [p], "qkv_split_sizes": (12,)}])


def _named_model():
    torch.manual_seed(0)
    return [("embedding.word_embeddings.weight", torch.nn.Parameter(torch.randn(16, 8))),
            ("layers.0.fc1.weight", torch.nn.Parameter(torch.randn(12, 8))),
            ("layers.0.fc1.bias", torch.nn.Parameter(torch.randn(12))),
            ("layers.0.fc2.weight", torch.nn.Parameter(torch.randn(8, 12))),
            ("output_layer.weight", torch.nn.Parameter(torch.randn(16, 8)))]


def test_split_muon_params_gives_hidden_matrices_to_muon_and_the_rest_to_adamw():
    named = _named_model()
    muon, adamw = tpamp.split_muon_params(named)
    assert [id(p) for p in muon] == [id(named[1][1]), id(named[3][1])]
    assert [id(p) for p in adamw] == [id(named[0][1]), id(named[2][1]), id(named[4][1])]
    with pytest.raises(TypeError, match=r"\(name, param\) pairs"):
        tpamp.split_muon_params([named[0][1]])


def _combined_and_reference(dtype=torch.float32):
    named = _named_model()
    ref = {n: torch.nn.Parameter(p.detach().clone()) for n, p in named}
    combined = tpamp.muon_with_adamw(named, lr=0.02, adamw_weight_decay=0.01)
    muon, adamw = tpamp.split_muon_params(list(ref.items()))
    decayed = [{"params": [p for p in adamw if p.dim() == 2], "weight_decay": 0.01},
               {"params": [p for p in adamw if p.dim() == 1], "weight_decay": 0.0}]
    refs = [torch.optim.Muon(muon, lr=0.02), torch.optim.AdamW(decayed, lr=0.02)]
    return named, combined, ref, refs


def test_muon_with_adamw_in_one_wrapper_steps_as_torch_muon_plus_adamw_with_one_clip():
    named, combined, ref, refs = _combined_and_reference()
    # the wrapper over fp32 params (no main copies) with one clip over all params
    opt = tpamp.MixedPrecisionOptimizer(combined, clip_grad=1.0)
    for step in range(3):
        grads = {n: torch.randn_like(p) for n, p in named}
        total = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values()))
        coef = min(1.0, 1.0 / (float(total) + 1e-6))
        for n, p in named:
            p.grad = grads[n].clone()
            ref[n].grad = grads[n].clone() * coef
        res = opt.step()
        assert res.update_successful
        assert abs(float(res.grad_norm) - float(total)) < 1e-4 * float(total)
        for o in refs:
            o.step()
    for n, p in named:
        torch.testing.assert_close(p, ref[n], rtol=1e-5, atol=1e-6, msg=n)


def test_combined_optimizer_state_dict_round_trip():
    named, combined, _, _ = _combined_and_reference()
    for _, p in named:
        p.grad = torch.ones_like(p)
    combined.step()
    buf = io.BytesIO()
    torch.save(combined.state_dict(), buf)
    named2, combined2, _, _ = _combined_and_reference()
    buf.seek(0)
    combined2.load_state_dict(torch.load(buf))
    for (_, p), (_, q) in zip(named, named2):
        q.data.copy_(p.data)
    for _, p in named + named2:
        p.grad = torch.full_like(p, 0.5)
    combined.step()
    combined2.step()
    for (n, p), (_, q) in zip(named, named2):
        assert torch.equal(p, q), n
    # the parts see the loaded groups (an lr change reaches them)
    combined2.param_groups[0]["lr"] = 0.5
    assert combined2.optimizers[0].param_groups[0]["lr"] == 0.5


def test_is_elementwise_optimizer_knows_torch_elementwise_classes_only():
    p = [torch.nn.Parameter(torch.randn(4, 4))]
    for cls in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
                torch.optim.RMSprop):
        assert tpamp.is_elementwise_optimizer(cls(p, lr=0.1))
    assert not tpamp.is_elementwise_optimizer(torch.optim.Muon(p))
    assert not tpamp.is_elementwise_optimizer(torch.optim.Adafactor(p))
    assert not tpamp.is_elementwise_optimizer(torch.optim.LBFGS(p))
    with pytest.raises(TypeError, match="torch.optim.Optimizer subclass"):
        tpamp.declare_elementwise(object)


def test_unsharded_params_take_any_optimizer_as_before():
    p = torch.nn.Parameter(torch.randn(8, 8).half())
    opt = tpamp.MixedPrecisionOptimizer(torch.optim.Muon([p], lr=0.02),
                                        grad_scaler=tpamp.DynamicGradScaler(2.0 ** 8))
    p.grad = torch.ones_like(p) * 256
    assert opt.step().update_successful


def test_narrow_state_with_muon_is_refused():
    p = torch.nn.Parameter(torch.randn(8, 8).bfloat16())
    with pytest.raises(ValueError, match="need the one-pass fused Adam step"):
        tpamp.MixedPrecisionOptimizer(tpamp.TensorParallelMuon([p]),
                                      exp_avg_dtype=torch.bfloat16)


def test_fp16_skip_leaves_muon_params_and_momentum_untouched():
    p = torch.nn.Parameter(torch.randn(8, 8).half())
    inner = tpamp.TensorParallelMuon([p], lr=0.02)
    scaler = tpamp.DynamicGradScaler(2.0 ** 8, hysteresis=1)
    opt = tpamp.MixedPrecisionOptimizer(inner, grad_scaler=scaler)
    before = p.detach().clone()
    g = torch.ones_like(p)
    g[0, 0] = float("inf")
    p.grad = g
    assert not opt.step().update_successful
    assert torch.equal(p, before) and len(inner.state) == 0
    assert float(scaler.scale) == 2.0 ** 7


# ---- options that arrive after construction, foreign state, nesting (docs/spec.md section 17)


def _muon_ref_steps(params, grads_per_step, **kw):
    """torch.optim.Muon over ``params`` (the reference), one step per grads list."""
    opt = torch.optim.Muon(params, **kw)
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    return opt


def test_nested_combined_optimizer_keeps_every_parts_state_and_resumes_bit_identically():
    """The nested state_dict holds the state of all three params (main e82d3a5: 1 of 3), and a
    resume from it continues as the uninterrupted run of the three torch optimizers."""
    shapes = [(6, 4), (5,), (4, 3)]

    def build(seed=0):
        g = torch.Generator().manual_seed(seed)
        ps = [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]
        inner = tpamp.CombinedOptimizer([tpamp.TensorParallelMuon([ps[0]], lr=0.02),
                                         torch.optim.AdamW([ps[1]], lr=0.01)])
        return ps, tpamp.CombinedOptimizer([inner, torch.optim.SGD([ps[2]], lr=0.1,
                                                                   momentum=0.9)])

    def refs():
        g = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]
        return ps, [torch.optim.Muon([ps[0]], lr=0.02), torch.optim.AdamW([ps[1]], lr=0.01),
                    torch.optim.SGD([ps[2]], lr=0.1, momentum=0.9)]

    grads = [_grads(s, 4, seed=7 + i) for i, s in enumerate(shapes)]
    ps, opt = build()
    rps, ropts = refs()
    for k in range(2):
        for p, q, gs in zip(ps, rps, grads):
            p.grad, q.grad = gs[k].clone(), gs[k].clone()
        opt.step()
        for o in ropts:
            o.step()
    sd = opt.state_dict()
    assert sorted(sd["state"]) == [0, 1, 2]
    assert set(sd["state"][2]) == {"momentum_buffer"} and "exp_avg" in sd["state"][1]
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    ps2, opt2 = build(seed=1)  # other values: the load and the copy below restore them
    opt2.load_state_dict(torch.load(buf))
    with torch.no_grad():
        for p, q in zip(ps2, ps):
            p.copy_(q)
    for k in range(2, 4):
        for p, q, gs in zip(ps2, rps, grads):
            p.grad, q.grad = gs[k].clone(), gs[k].clone()
        opt2.step()
        for o in ropts:
            o.step()
    for p, q in zip(ps2, rps):
        assert torch.equal(p, q)


def test_combined_optimizer_parts_in_another_order_load_by_key():
    """Saved with [Muon, AdamW], loaded into [AdamW, Muon] (main e82d3a5: KeyError 'exp_avg' at
    the next step): each part gets its own state; the run continues as torch's two optimizers."""
    def build(order):
        g = torch.Generator().manual_seed(0)
        w = torch.nn.Parameter(torch.randn(6, 4, generator=g))
        b = torch.nn.Parameter(torch.randn(4, generator=g))
        parts = [tpamp.TensorParallelMuon([w], lr=0.02), torch.optim.AdamW([b], lr=0.01)]
        return (w, b), tpamp.CombinedOptimizer(parts if order == 0 else parts[::-1])

    gw, gb = _grads((6, 4), 3, seed=3), _grads((4,), 3, seed=4)
    (w, b), opt = build(0)
    (rw, rb), ref = build(0)
    for k in range(3):
        for p, g in ((w, gw[k]), (b, gb[k]), (rw, gw[k]), (rb, gb[k])):
            p.grad = g.clone()
        if k < 2:
            opt.step()
        ref.step()
    (w2, b2), opt2 = build(1)
    opt2.load_state_dict(opt.state_dict())
    with torch.no_grad():
        w2.copy_(w)
        b2.copy_(b)
    w2.grad, b2.grad = gw[2].clone(), gb[2].clone()
    opt2.step()
    assert torch.equal(w2, rw) and torch.equal(b2, rb)
    # a state dict of other parts is refused before anything changes
    other = tpamp.CombinedOptimizer([torch.optim.SGD([torch.nn.Parameter(torch.ones(6, 4))],
                                                     lr=0.1)])
    with pytest.raises(ValueError, match=r"optimizer parts \['SGD'\] are not this"):
        opt2.load_state_dict(other.state_dict())


@pytest.mark.parametrize("kind", ["muon", "adafactor"])
def test_a_torch_state_dict_loads_into_the_tensor_parallel_class(kind):
    """torch.optim.Muon's state dict (no tp_mode: main e82d3a5 raised KeyError at every later
    step) and torch.optim.Adafactor's load, and the run continues as torch's."""
    shape = (8, 6)
    a, b = _pair(shape)
    torch_cls = torch.optim.Muon if kind == "muon" else torch.optim.Adafactor
    tp_cls = tpamp.TensorParallelMuon if kind == "muon" else tpamp.TensorParallelAdafactor
    ref = torch_cls([b], lr=0.02)
    src = torch_cls([a], lr=0.02)
    gs = _grads(shape, 3)
    for g in gs[:2]:
        a.grad, b.grad = g.clone(), g.clone()
        src.step()
        ref.step()
    tp = tp_cls([a], lr=0.02, **({"tp_mode": "duplicated"} if kind == "muon" else {}))
    tp.load_state_dict(src.state_dict())
    a.grad, b.grad = gs[2].clone(), gs[2].clone()
    tp.step()
    ref.step()
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    if kind == "muon":
        assert tp.param_groups[0]["tp_mode"] == "duplicated"


@pytest.mark.parametrize("kind", ["muon", "adafactor"])
def test_a_zero_element_param_is_left_alone_and_the_others_step_as_torch(kind):
    """main e82d3a5: ZeroDivisionError. A param of no element has nothing to update."""
    empty = torch.nn.Parameter(torch.zeros(0, 4))
    a, b = _pair((6, 4))
    tp_cls = tpamp.TensorParallelMuon if kind == "muon" else tpamp.TensorParallelAdafactor
    torch_cls = torch.optim.Muon if kind == "muon" else torch.optim.Adafactor
    tp, ref = tp_cls([empty, a], lr=0.02), torch_cls([b], lr=0.02)
    for g in _grads((6, 4), 2):
        empty.grad = torch.zeros(0, 4)
        a.grad, b.grad = g.clone(), g.clone()
        tp.step()
        ref.step()
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert empty.shape == (0, 4) and empty not in tp.state


def _muon_wrapped(inner_cls=tpamp.TensorParallelMuon, **kw):
    p = torch.nn.Parameter(torch.randn(6, 4, generator=torch.Generator().manual_seed(0)).half())
    inner = inner_cls([p], **{"lr": 0.02, **kw})
    opt = tpamp.MixedPrecisionOptimizer(inner, grad_scaler=tpamp.DynamicGradScaler(2.0 ** 8))
    return p, inner, opt


@pytest.mark.parametrize("inner_cls", [tpamp.TensorParallelMuon, torch.optim.Muon])
@pytest.mark.parametrize("key, value, words", [
    ("momentum", 1.0, ["momentum", "1.0", "<"]),
    ("momentum", 1.5, ["momentum", "1.5"]),
    ("eps", 0.0, ["eps", "0.0", ">"]),
    ("lr", math.inf, ["lr", "inf", "finite"]),
    ("lr", math.nan, ["lr", "nan", "finite"]),
    ("ns_steps", 100, ["ns_steps", "100"]),
])
def test_a_muon_value_set_after_construction_is_refused_at_the_step_with_nothing_changed(
        inner_cls, key, value, words):
    """main e82d3a5: the step reported success and wrote nan into the params (momentum >= 1
    grows the momentum without bound; eps 0 over a zero grad is 0/0; lr inf times 0)."""
    p, inner, opt = _muon_wrapped(inner_cls)
    inner.param_groups[0][key] = value
    p.grad = torch.zeros_like(p)
    before = (p.detach().clone(), float(opt.get_loss_scale()), dict(inner.state))
    with pytest.raises(ValueError) as info:
        opt.step()
    assert all(w in str(info.value) for w in words), str(info.value)
    assert torch.equal(p, before[0]) and float(opt.get_loss_scale()) == before[1]
    assert len(inner.state) == 0
    # the same value at construction is refused there
    with pytest.raises(ValueError, match=f"{key}|Learning rate"):  # torch's own, for lr nan
        _muon_wrapped(inner_cls, **{key: value})


# ---- misuse: each case refused with a clear error, nothing changed (tests/misuse_utils.py) ----


def _stepped(opt, params):
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    return opt


def _picture(opt, params):
    return lambda: (freeze(opt.state_dict()), [tensor_bytes(p) for p in params],
                    len(opt.param_groups))


def _on_muon(bad_call, **set_later):
    """setup: a TensorParallelMuon (stepped once; then its group's values ``set_later``, as a
    scheduler would) and ``bad_call(opt, sd)`` on it, ``sd`` its own state dict (a copy to
    corrupt)."""
    def setup():
        p = torch.nn.Parameter(torch.randn(6, 4))
        opt = _stepped(tpamp.TensorParallelMuon([p], lr=0.02), [p])
        sd = copy.deepcopy(opt.state_dict())
        opt.param_groups[0].update(set_later)
        p.grad = torch.ones_like(p)
        return _picture(opt, [p]), lambda: bad_call(opt, sd)
    return setup


def _on_adafactor(bad_call):
    def setup():
        p = torch.nn.Parameter(torch.randn(6, 4))
        opt = _stepped(tpamp.TensorParallelAdafactor([p], lr=0.02), [p])
        sd = copy.deepcopy(opt.state_dict())
        return _picture(opt, [p]), lambda: bad_call(opt, sd)
    return setup


def _on_combined(bad_call, part=0, **set_later):
    def setup():
        w, b = torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(4))
        opt = _stepped(tpamp.CombinedOptimizer([tpamp.TensorParallelMuon([w], lr=0.02),
                                                torch.optim.AdamW([b], lr=0.01)]), [w, b])
        sd = copy.deepcopy(opt.state_dict())
        opt.param_groups[part].update(set_later)
        w.grad, b.grad = torch.ones_like(w), torch.ones_like(b)
        return _picture(opt, [w, b]), lambda: bad_call(opt, sd)
    return setup


def _nothing(call):
    """setup for a refused construction: nothing to change."""
    return lambda: ((lambda: None), call)


def _edit_group(sd, **values):
    sd["param_groups"][0].update(values)
    return sd


def _new_param(*shape):
    return torch.nn.Parameter(torch.randn(*shape))


_P = lambda: [_new_param(6, 4)]  # noqa: E731

MATRIX_MISUSE = [
    # TensorParallelMuon: values torch checks only in its constructor, or never
    Case("muon-ns_coefficients-2", _nothing(lambda: tpamp.TensorParallelMuon(_P(), ns_coefficients=(3.4, -4.7))), ValueError, ["ns_coefficients", "3"]),
    Case("muon-ns_coefficients-str", _nothing(lambda: tpamp.TensorParallelMuon(_P(), ns_coefficients="abc")), TypeError, ["ns_coefficients", "'abc'"]),
    Case("muon-ns_coefficients-nan", _nothing(lambda: tpamp.TensorParallelMuon(_P(), ns_coefficients=(3.4, math.nan, 2.0))), ValueError, ["ns_coefficients", "nan"]),
    Case("muon-ns_steps-100", _nothing(lambda: tpamp.TensorParallelMuon(_P(), ns_steps=100)), ValueError, ["ns_steps", "100"]),
    Case("muon-ns_steps-float", _nothing(lambda: tpamp.TensorParallelMuon(_P(), ns_steps=5.0)), TypeError, ["ns_steps", "5.0"]),
    Case("muon-momentum-1", _nothing(lambda: tpamp.TensorParallelMuon(_P(), momentum=1.0)), ValueError, ["momentum", "1.0"]),
    Case("muon-eps-0", _nothing(lambda: tpamp.TensorParallelMuon(_P(), eps=0.0)), ValueError, ["eps", "0.0"]),
    Case("muon-lr-inf", _nothing(lambda: tpamp.TensorParallelMuon(_P(), lr=math.inf)), ValueError, ["lr", "inf"]),
    Case("muon-lr-str", _nothing(lambda: tpamp.TensorParallelMuon(_P(), lr="0.1")), TypeError, ["lr", "'0.1'"]),
    Case("muon-nesterov-int", _nothing(lambda: tpamp.TensorParallelMuon(_P(), nesterov=1)), TypeError, ["nesterov", "1"]),
    Case("muon-adjust_lr_fn", _nothing(lambda: tpamp.TensorParallelMuon(_P(), adjust_lr_fn="spectral")), ValueError, ["adjust_lr_fn", "'spectral'"]),
    Case("muon-group-momentum-inf", _nothing(lambda: tpamp.TensorParallelMuon([{"params": _P(), "momentum": math.inf}])), ValueError, ["momentum", "inf"]),
    # ... in a group added later
    Case("muon-add-group-momentum", _on_muon(lambda o, sd: o.add_param_group({"params": [_new_param(4, 4)], "momentum": 1.5})), ValueError, ["momentum", "1.5"]),
    Case("muon-add-group-eps", _on_muon(lambda o, sd: o.add_param_group({"params": [_new_param(4, 4)], "eps": -1.0})), ValueError, ["eps", "-1.0"]),
    Case("muon-add-group-tp_mode", _on_muon(lambda o, sd: o.add_param_group({"params": [_new_param(4, 4)], "tp_mode": "sharded"})), ValueError, ["tp_mode", "'sharded'"]),
    Case("muon-add-group-1d", _on_muon(lambda o, sd: o.add_param_group({"params": [_new_param(4)]})), ValueError, ["2D", "(4,)"]),
    # ... loaded
    Case("muon-load-lr-inf", _on_muon(lambda o, sd: o.load_state_dict(_edit_group(sd, lr=math.inf))), ValueError, ["lr", "inf"]),
    Case("muon-load-momentum-1", _on_muon(lambda o, sd: o.load_state_dict(_edit_group(sd, momentum=1.0))), ValueError, ["momentum", "1.0"]),
    Case("muon-load-ns_coefficients", _on_muon(lambda o, sd: o.load_state_dict(_edit_group(sd, ns_coefficients=(1.0, 2.0)))), ValueError, ["ns_coefficients", "3"]),
    Case("muon-load-tp_mode", _on_muon(lambda o, sd: o.load_state_dict(_edit_group(sd, tp_mode="bad"))), ValueError, ["tp_mode", "'bad'"]),
    Case("muon-load-qkv", _on_muon(lambda o, sd: o.load_state_dict(_edit_group(sd, qkv_split_sizes=(5, 2, 2)))), ValueError, ["qkv_split_sizes", "tile"]),
    Case("muon-load-nan-momentum", _on_muon(lambda o, sd: (sd["state"][0]["momentum_buffer"].fill_(math.nan), o.load_state_dict(sd))), ValueError, ["momentum_buffer", "nan"]),
    Case("muon-load-wrong-shape", _on_muon(lambda o, sd: (sd["state"][0].update(momentum_buffer=torch.zeros(4, 6)), o.load_state_dict(sd))), ValueError, ["momentum_buffer", "shape"]),
    Case("muon-load-sgd", _on_muon(lambda o, sd: o.load_state_dict(torch.optim.SGD(_P(), lr=0.1).state_dict())), ValueError, ["ns_steps", "TensorParallelMuon"]),
    Case("muon-load-adam-state", _on_muon(lambda o, sd: o.load_state_dict(_stepped(torch.optim.Adam(ps := _P(), lr=0.1), ps).state_dict())), ValueError, ["TensorParallelMuon"]),
    Case("muon-load-None", _on_muon(lambda o, sd: o.load_state_dict(None)), TypeError, ["state_dict", "None"]),
    Case("muon-load-two-groups", _on_muon(lambda o, sd: o.load_state_dict({**sd, "param_groups": sd["param_groups"] * 2})), ValueError, ["2", "1", "param_groups"]),
    Case("muon-tp-group-str", _nothing(lambda: tpamp.TensorParallelMuon(_P(), tensor_parallel_group="tp")), TypeError, ["tensor_parallel_group", "str"]),
    Case("muon-lr-tensor-2", _nothing(lambda: tpamp.TensorParallelMuon(_P(), lr=torch.tensor([0.1, 0.2]))), TypeError, ["lr", "(2,)"]),
    # TensorParallelAdafactor
    Case("adafactor-tp-group-int", _nothing(lambda: tpamp.TensorParallelAdafactor(_P(), tensor_parallel_group=0)), TypeError, ["tensor_parallel_group", "int"]),
    Case("adafactor-eps2-nan", _nothing(lambda: tpamp.TensorParallelAdafactor(_P(), eps=(None, math.nan))), ValueError, ["eps", "nan"]),
    Case("adafactor-eps1-0", _nothing(lambda: tpamp.TensorParallelAdafactor(_P(), eps=(0.0, 1e-3))), ValueError, ["eps", "0.0"]),
    Case("adafactor-eps-number", _nothing(lambda: tpamp.TensorParallelAdafactor(_P(), eps=1e-3)), TypeError, ["eps", "0.001"]),
    Case("adafactor-lr-nan-group", _nothing(lambda: tpamp.TensorParallelAdafactor([{"params": _P(), "lr": math.nan}])), ValueError, ["lr", "nan"]),
    Case("adafactor-d-inf-group", _nothing(lambda: tpamp.TensorParallelAdafactor([{"params": _P(), "d": math.inf}])), ValueError, ["d", "inf"]),
    Case("adafactor-beta2_decay-group", _nothing(lambda: tpamp.TensorParallelAdafactor([{"params": _P(), "beta2_decay": 0.5}])), ValueError, ["beta2_decay", "0.5"]),
    Case("adafactor-add-group-eps", _on_adafactor(lambda o, sd: o.add_param_group({"params": [_new_param(3, 3)], "eps": (0.0, 0.0)})), ValueError, ["eps", "0.0"]),
    Case("adafactor-load-d", _on_adafactor(lambda o, sd: o.load_state_dict(_edit_group(sd, d=0.5))), ValueError, ["d", "0.5"]),
    Case("adafactor-load-nan-row", _on_adafactor(lambda o, sd: (sd["state"][0]["row_var"].fill_(math.nan), o.load_state_dict(sd))), ValueError, ["row_var", "nan"]),
    Case("adafactor-load-muon", _on_adafactor(lambda o, sd: o.load_state_dict(tpamp.TensorParallelMuon(_P()).state_dict())), ValueError, ["TensorParallelAdafactor", "beta2_decay"]),
    # CombinedOptimizer
    Case("combined-one-optimizer", _nothing(lambda: tpamp.CombinedOptimizer(torch.optim.SGD(_P(), lr=0.1))), TypeError, ["list", "SGD"]),
    Case("combined-part-str", _nothing(lambda: tpamp.CombinedOptimizer([torch.optim.SGD(_P(), lr=0.1), "adam"])), TypeError, ["part", "1", "str"]),
    Case("combined-name-empty", _nothing(lambda: tpamp.CombinedOptimizer({"": torch.optim.SGD(_P(), lr=0.1)})), TypeError, ["names", "''"]),
    Case("combined-shared-param", _nothing(lambda: tpamp.CombinedOptimizer([torch.optim.SGD(ps := _P(), lr=0.1), torch.optim.Adam(ps)])), ValueError, ["'SGD'", "'Adam'", "disjoint"]),
    Case("combined-adamw-group-eps-0", _nothing(lambda: tpamp.CombinedOptimizer([torch.optim.AdamW([{"params": _P(), "eps": 0.0}])])), ValueError, ["'AdamW'", "eps", "0.0"]),
    Case("combined-sgd-group-lr-inf", _nothing(lambda: tpamp.CombinedOptimizer([torch.optim.SGD([{"params": _P(), "lr": math.inf}], lr=0.1)])), ValueError, ["'SGD'", "lr", "inf"]),
    Case("muon_with_adamw-adamw_eps-0", _nothing(lambda: tpamp.muon_with_adamw(_named_model(), lr=0.02, adamw_eps=0.0)), ValueError, ["eps", "0.0"]),
    Case("muon_with_adamw-momentum-1", _nothing(lambda: tpamp.muon_with_adamw(_named_model(), lr=0.02, momentum=1.0)), ValueError, ["momentum", "1.0"]),
    Case("muon_with_adamw-lr-nan", _nothing(lambda: tpamp.muon_with_adamw(_named_model(), lr=math.nan)), ValueError, ["lr", "nan"]),
    Case("muon_with_adamw-tp_mode", _nothing(lambda: tpamp.muon_with_adamw(_named_model(), lr=0.02, tp_mode="rows")), ValueError, ["tp_mode", "'rows'"]),
    Case("muon_with_adamw-qkv-list", _nothing(lambda: tpamp.muon_with_adamw(_named_model(), lr=0.02, qkv_split_sizes=[4, 4, 4])), TypeError, ["qkv_split_sizes", "list"]),
    Case("muon_with_adamw-qkv-name", _nothing(lambda: tpamp.muon_with_adamw(_named_model(), lr=0.02, qkv_split_sizes={"layers.0.fc1.bias": (4, 4, 4)})), ValueError, ["qkv_split_sizes", "'layers.0.fc1.bias'"]),
    Case("muon_with_adamw-betas-number", _nothing(lambda: tpamp.muon_with_adamw(_named_model(), lr=0.02, adamw_betas=0.9)), TypeError, ["adamw_betas", "0.9"]),
    Case("muon_with_adamw-betas-1", _nothing(lambda: tpamp.muon_with_adamw(_named_model(), lr=0.02, adamw_betas=(0.9, 1.0))), ValueError, ["betas", "1.0"]),
    Case("split_muon_params-names-str", _nothing(lambda: tpamp.split_muon_params(_named_model(), adamw_names="*embedding*")), TypeError, ["adamw_names", "str"]),
    Case("split_muon_params-is_adamw-str", _nothing(lambda: tpamp.split_muon_params(_named_model(), is_adamw="bias")), TypeError, ["is_adamw", "str"]),
    Case("check_sharded_math-str", _nothing(lambda: tpamp.check_sharded_math("adam")), TypeError, ["check_sharded_math", "str"]),
    Case("declare_elementwise-instance", _nothing(lambda: tpamp.declare_elementwise(torch.optim.SGD(_P(), lr=0.1))), TypeError, ["declare_elementwise", "subclass"]),
    Case("combined-add-group", _on_combined(lambda o, sd: o.add_param_group({"params": _P()})), RuntimeError, ["add_param_group", "part"]),
    Case("combined-load-other-parts", _on_combined(lambda o, sd: o.load_state_dict(tpamp.CombinedOptimizer({"x": torch.optim.SGD(_P(), lr=0.1), "y": torch.optim.SGD([_new_param(4)], lr=0.1)}).state_dict())), ValueError, ["parts", "'x'", "'AdamW'"]),
    Case("combined-load-part-groups", _on_combined(lambda o, sd: o.load_state_dict({**sd, "param_groups": [sd["param_groups"][0], {**sd["param_groups"][1], "params": []}, {**sd["param_groups"][1]}]})), ValueError, ["'AdamW'", "2", "1"]),
    Case("combined-load-lr-inf", _on_combined(lambda o, sd: (sd["param_groups"][1].update(lr=math.inf), o.load_state_dict(sd))), ValueError, ["lr", "inf"]),
    Case("combined-load-adam-eps-0", _on_combined(lambda o, sd: (sd["param_groups"][1].update(eps=0.0), o.load_state_dict(sd))), ValueError, ["eps", "0.0"]),
    Case("combined-load-positional-swapped", _on_combined(lambda o, sd: o.load_state_dict({**sd, "param_groups": [{k: v for k, v in g.items() if k != "optimizer_part"} for g in sd["param_groups"][::-1]]})), ValueError, ["TensorParallelMuon", "lacks"]),
    Case("combined-load-nan-state", _on_combined(lambda o, sd: (sd["state"][1]["exp_avg"].fill_(math.inf), o.load_state_dict(sd))), ValueError, ["exp_avg", "inf"]),
    Case("combined-step-momentum", _on_combined(lambda o, sd: o.step(), momentum=1.0), ValueError, ["momentum", "1.0"]),
    Case("combined-step-adamw-beta", _on_combined(lambda o, sd: o.step(), part=1, betas=(0.9, 1.0)), ValueError, ["betas", "1.0"]),
    Case("muon-step-lr-nan", _on_muon(lambda o, sd: o.step(), lr=math.nan), ValueError, ["lr", "nan"]),
]


def test_every_matrix_misuse_case_is_refused_by_tpamp_itself():
    assert_every_setup_case_refused_by_tpamp(MATRIX_MISUSE)


@pytest.mark.parametrize("case", MATRIX_MISUSE, ids=[c.id for c in MATRIX_MISUSE])
def test_matrix_misuse_is_refused_naming_the_value_and_changes_nothing(case):
    assert_refused_and_unchanged(case)


def test_a_wrapped_combined_optimizer_with_parts_in_another_order_resumes_exactly():
    """MixedPrecisionOptimizer (fp16 params, fp32 main copies per group) over [Muon, AdamW],
    loaded into one over [AdamW, Muon]: the main params follow their groups (the wrapper's
    load realigns both by part key) and the run continues as the uninterrupted one."""
    def build(order):
        g = torch.Generator().manual_seed(0)
        w = torch.nn.Parameter(torch.randn(6, 4, generator=g).half())
        b = torch.nn.Parameter(torch.randn(4, generator=g).half())
        parts = [tpamp.TensorParallelMuon([w], lr=0.02), torch.optim.AdamW([b], lr=0.01)]
        inner = tpamp.CombinedOptimizer(parts if order == 0 else parts[::-1])
        return (w, b), tpamp.MixedPrecisionOptimizer(
            inner, grad_scaler=tpamp.DynamicGradScaler(2.0 ** 4))

    gw, gb = _grads((6, 4), 3, seed=5), _grads((4,), 3, seed=6)

    def step(params, opt, k):
        params[0].grad, params[1].grad = gw[k].half() * 16, gb[k].half() * 16
        assert opt.step().update_successful

    ref_params, ref = build(0)
    params, opt = build(0)
    for k in range(3):
        step(ref_params, ref, k)
        if k < 2:
            step(params, opt, k)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    params2, opt2 = build(1)
    opt2.load_state_dict(torch.load(buf))
    step(params2, opt2, 2)
    for p, q in zip(params2, ref_params):
        assert torch.equal(p, q)


def test_combined_optimizer_parts_in_another_order_resume_through_the_sharded_checkpoint(tmp_path):
    """tpamp.checkpoint: the saved groups are matched to the parts by key (the optimizer's
    align_param_groups), and a saved hyperparameter the class refuses is a CheckpointError
    before anything changes."""
    from tpamp.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    def build(order):
        g = torch.Generator().manual_seed(0)
        named = {"w": torch.nn.Parameter(torch.randn(6, 4, generator=g).half()),
                 "b": torch.nn.Parameter(torch.randn(4, generator=g).half())}
        parts = [tpamp.TensorParallelMuon([named["w"]], lr=0.02),
                 torch.optim.AdamW([named["b"]], lr=0.01)]
        inner = tpamp.CombinedOptimizer(parts if order == 0 else parts[::-1])
        return named, tpamp.MixedPrecisionOptimizer(
            inner, grad_scaler=tpamp.DynamicGradScaler(2.0 ** 4))

    grads = {"w": _grads((6, 4), 4, seed=8), "b": _grads((4,), 4, seed=9)}

    def run(named, opt, steps):
        for k in steps:
            for n, p in named.items():
                p.grad = grads[n][k].half() * 16
            assert opt.step().update_successful
        return {n: tensor_bytes(p) for n, p in named.items()}

    want = run(*build(0), range(4))
    named, opt = build(0)
    run(named, opt, range(2))
    path = str(tmp_path / "ckpt")
    save_checkpoint(path, named, opt)
    named2, opt2 = build(1)
    load_checkpoint(path, named2, opt2)
    assert run(named2, opt2, range(2, 4)) == want
    # a saved group value the class refuses (here through a part that now says lr=inf)
    named3, opt3 = build(1)
    aligned = opt3.align_param_groups([dict(g) for g in opt.optimizer.param_groups])
    assert [g["optimizer_part"] for g in aligned] == ["AdamW", "TensorParallelMuon"]
    bad = [dict(g) for g in opt.optimizer.param_groups]
    bad[0]["momentum"] = 1.0
    with pytest.raises(ValueError, match=r"checkpoint's param_groups\[1\]\['momentum'\]"):
        opt3.check_saved_param_groups(opt3.align_param_groups(bad))
    opt.optimizer.param_groups[0]["momentum"] = 1.0  # saved as the checkpoint's value
    save_checkpoint(str(tmp_path / "bad"), named, opt)
    named3_before = {n: tensor_bytes(p) for n, p in named3.items()}
    with pytest.raises(CheckpointError, match=r"param_groups\[1\]\['momentum'\] must be finite "
                                              r"and >= 0.0 and < 1.0, got 1.0"):
        load_checkpoint(str(tmp_path / "bad"), named3, opt3)
    assert {n: tensor_bytes(p) for n, p in named3.items()} == named3_before
    named4, _ = build(0)
    other = tpamp.MixedPrecisionOptimizer(tpamp.CombinedOptimizer(
        {"x": torch.optim.SGD([named4["w"]], lr=0.1), "y": torch.optim.AdamW([named4["b"]])}),
        grad_scaler=tpamp.DynamicGradScaler(2.0 ** 4))
    before = {n: tensor_bytes(p) for n, p in named4.items()}
    with pytest.raises(CheckpointError, match=r"optimizer parts \['AdamW', 'TensorParallelMuon'\]"):
        load_checkpoint(path, named4, other)
    assert {n: tensor_bytes(p) for n, p in named4.items()} == before


def test_a_bad_qkv_split_set_later_is_refused_before_any_param_changes():
    """The second param's qkv_split_sizes (set after construction) do not tile its rows: the
    step refuses before the first param (in the group before) is stepped."""
    a, b = _new_param(6, 4), _new_param(12, 4)
    opt = tpamp.TensorParallelMuon([{"params": [a]}, {"params": [b], "qkv_split_sizes": (2, 1, 1)}])
    opt.param_groups[1]["qkv_split_sizes"] = (5, 2, 2)
    a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    before = (tensor_bytes(a), tensor_bytes(b))
    with pytest.raises(ValueError, match=r"param 0 of group 1: qkv_split_sizes \(5, 2, 2\)"):
        opt.step()
    assert (tensor_bytes(a), tensor_bytes(b)) == before and len(opt.state) == 0
