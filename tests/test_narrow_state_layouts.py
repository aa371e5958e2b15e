"""Narrow optimizer state (docs/spec.md section 9, section 21) on params that are not contiguous:
transposed, sliced out of a larger tensor, strided, at a storage offset.

Each format (bf16 and uint8 moments, bf16 params + int16 remainders, both, stochastic rounding
without masters, and float32 state for comparison) steps such a param exactly as it steps its
twin: a contiguous param holding the same values in the same memory order (the transposed
param's twin is its contiguous transpose; a sliced or strided param's is its contiguous copy),
with the same grads. The params must come out bit for bit the same, and the state must belong
to the param's elements (each moment decoded, read in the param's logical order, equals the
twin's). Through MixedPrecisionOptimizer (the kernel and the PyTorch reference), and through
DistributedOptimizer on gloo ranks (LayerWiseDistributedOptimizer takes no narrow-state
option; the FSDP2 path is not covered here).

(On e82d3a5 a transposed bf16 param with ``store_param_remainders=True`` stepped to wrong values,
and a transposed param with stochastic rounding kept its float32 moments in another element
order than the param's.)
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from dist_utils import run_workers

import tpamp
from tpamp import ops
from tpamp import state_formats as sf

OPTIONS = {
    "fp32": dict(),
    "bf16": dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16),
    "u8": dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8, min_8bit_size=0),
    "rem": dict(store_param_remainders=True),
    "u8+rem": dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8, min_8bit_size=0,
                   store_param_remainders=True),
    "bf16+rem": dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16,
                     store_param_remainders=True),
    "sr": dict(master_weights=False, stochastic_rounding=True),
    "u8+sr": dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8, min_8bit_size=0,
                  master_weights=False, stochastic_rounding=True),
}
LAYOUTS = ("transposed", "sliced", "strided", "offset")


def _layout(name, seed=0):
    """(param data, twin data, f): f maps a tensor shaped like the param to the twin's shape,
    element for element in memory order (the param's memory order is the twin's)."""
    g = torch.Generator().manual_seed(seed)
    if name == "transposed":
        base = torch.randn(64, 96, generator=g).bfloat16()
        return base.clone().t(), base.clone(), lambda x: x.t()
    big = torch.randn(64, 300, generator=g).bfloat16()
    if name == "sliced":
        view = big[:, 10:106]
    elif name == "strided":
        view = big[:, ::3]
    else:  # a dense view at a storage offset
        view = big.view(-1)[7:7 + 6000].view(60, 100)
    return view, view.contiguous().clone(), lambda x: x


def _grads(shape, n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).bfloat16() for _ in range(n)]


def _moments(opt, param):
    """The param's (exp_avg, exp_avg_sq) decoded to float32, in the param's logical order."""
    main = next(m for g in opt.optimizer.param_groups for m in g["params"]
                if m.shape == param.shape)
    st = opt.optimizer.state[main]
    return (sf.decode_moment(st["exp_avg"], st.get("exp_avg_scale")),
            sf.decode_moment(st["exp_avg_sq"], st.get("exp_avg_sq_scale"), sqrt=True))


def _mpo_run(data, grads, kw):
    p = torch.nn.Parameter(data)
    opt = tpamp.MixedPrecisionOptimizer(torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1), **kw)
    for g in grads:
        p.grad = g
        assert opt.step().update_successful
    return p, opt


def _check_twins(p, q, f, mp, mq):
    assert torch.equal(f(p.detach()).view(torch.int16), q.detach().view(torch.int16))
    for a, b in zip(mp, mq):
        assert torch.equal(f(a), b)


@pytest.mark.parametrize("fallback", [False, True], ids=["kernel", "reference"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_mixed_precision_optimizer_steps_any_layout_as_its_twin(option, layout, fallback):
    if not fallback and not ops.extension_available("cpu"):
        pytest.skip("CPU kernels not built")
    data, twin, f = _layout(layout)
    grads = _grads(data.shape)
    ctx = ops.force_fallback() if fallback else contextlib.nullcontext()
    with ctx:
        p, a = _mpo_run(data, [g.clone() for g in grads], OPTIONS[option])
        q, b = _mpo_run(twin, [f(g).contiguous() for g in grads], OPTIONS[option])
    if layout == "sliced":  # the view still shares the larger tensor's storage
        assert p.data_ptr() == data.data_ptr()
    _check_twins(p, q, f, _moments(a, p), _moments(b, q))


def test_split_remainders_element_by_element():
    """split_remainders on a transposed master: param and remainder hold each element's own
    halves (join_remainders gives the master back, element for element)."""
    master = torch.randn(33, 70).t()
    hi, lo = sf.split_remainders(master)
    assert hi.shape == lo.shape == master.shape
    assert torch.equal(sf.join_remainders(hi, lo), master)
    assert hi.stride() == master.stride()  # laid out like the master
    hi2, lo2 = sf.split_remainders(master.contiguous())
    assert torch.equal(hi.view(torch.int16), hi2.view(torch.int16)) and torch.equal(lo, lo2)


def _dist_worker(rank, world_size):
    import torch.distributed as dist

    dp = dist.new_group(list(range(world_size)))
    for option in ("bf16", "u8", "rem", "u8+rem", "sr"):
        for layout in LAYOUTS:
            kw = OPTIONS[option]
            # DistributedOptimizer flattens a param in its logical order into its buckets: the
            # twin is the param's contiguous copy
            data, _, _ = _layout(layout)
            twin = data.contiguous().clone()
            grads = _grads(data.shape)
            results = []
            for d in (data, twin):
                p = torch.nn.Parameter(d)
                inner = torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1)
                opt = tpamp.DistributedOptimizer(inner, data_parallel_group=dp,
                                                 bucket_size=5000, **kw)
                for g in grads:
                    p.main_grad.copy_(g)  # the same grad on every rank: its DP mean is g
                    assert opt.step().update_successful
                    opt.zero_grad()
                results.append(p.detach().clone())
            p, q = results
            assert torch.equal(p.view(torch.int16), q.view(torch.int16)), (option, layout)
    return True


def test_distributed_optimizer_steps_any_layout_as_its_twin():
    """DistributedOptimizer on 2 gloo ranks, every narrow-state option x layout (the
    LayerWiseDistributedOptimizer takes no narrow-state option)."""
    if not ops.extension_available("cpu"):
        pytest.skip("CPU kernels not built")
    run_workers(_dist_worker, 2, timeout=120.0)
