"""tpamp.matrix_optimizers on one process: the classes step whole params exactly as the torch
classes do, the combined Muon + AdamW optimizer steps as the two torch optimizers would, and the
wrapper options that cannot apply are refused (docs/spec.md section 17). The TP runs are in
tests/test_matrix_optimizers_dist.py."""

import io

import pytest
import torch

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
