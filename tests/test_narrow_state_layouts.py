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
option). The FSDP2 path cannot receive such a param: fully_shard refuses a non-contiguous one
and copies any other into a contiguous shard of its own (checked below, with bf16 and uint8
moments on a view at a storage offset).

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


# ---- the FSDP2 path (tpamp.fsdp.fully_shard_optimizer) -----------------------------------------


def _fp32_layout(name):
    """An fp32 param of each layout (FSDP2 takes fp32 params); a dense view at a storage
    offset of 61 rows: uneven over 2 ranks, so one rank's shard is padded by FSDP2."""
    g = torch.Generator().manual_seed(0)
    if name == "transposed":
        return torch.randn(64, 96, generator=g).t()
    big = torch.randn(64, 300, generator=g)
    return {"sliced": big[:, 10:106], "strided": big[:, ::3],
            "offset": big.view(-1)[7:7 + 6100].view(61, 100)}[name]


class _Holder(torch.nn.Module):
    def __init__(self, data):
        super().__init__()
        self.w = torch.nn.Parameter(data)

    def forward(self, x):
        return (self.w * x).sum()


def _fsdp_worker(rank, world_size):
    from torch.distributed.fsdp import fully_shard

    from tpamp.parallel import initialize_model_parallel

    mesh = initialize_model_parallel(1, 1).mesh["dp"]
    out = {}
    # FSDP2 refuses a param that is not contiguous before sharding anything
    for layout in ("transposed", "sliced", "strided"):
        data = _fp32_layout(layout)
        assert not data.is_contiguous()
        try:
            fully_shard(_Holder(data), mesh=mesh)
            out[layout] = None
        except NotImplementedError as e:
            out[layout] = str(e)
    # a contiguous view at a storage offset is accepted, but copied: the optimizer receives
    # FSDP2's own shard (contiguous, offset 0, in a padded buffer of its own), so it steps as
    # its contiguous twin, state included
    for option in ("bf16", "u8"):
        data = _fp32_layout("offset")
        runs = []
        for d in (data, data.contiguous().clone()):
            model = _Holder(d)
            fully_shard(model, mesh=mesh)
            local = model.w.to_local()
            layout = (local.is_contiguous(), local.storage_offset(),
                      local.untyped_storage().data_ptr() == data.untyped_storage().data_ptr(),
                      local.untyped_storage().nbytes() // 4 - local.numel())
            start = local.detach().clone()
            opt = tpamp.fsdp.fully_shard_optimizer(
                torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), mesh,
                **OPTIONS[option])
            for x in _grads(data.shape):
                model(x.float()).backward()  # the same x on every rank: the DP mean is x
                assert opt.step().update_successful
                opt.zero_grad()
            st = opt.optimizer.state[model.w]
            moments = [(t.to_local() if hasattr(t, "to_local") else t) for t in
                       (st["exp_avg"], st.get("exp_avg_scale"), st["exp_avg_sq"],
                        st.get("exp_avg_sq_scale"))]
            moved = bool((model.w.to_local().detach() != start).all())
            runs.append((layout + (moved,), model.w.to_local().detach().clone(),
                         sf.decode_moment(moments[0], moments[1]),
                         sf.decode_moment(moments[2], moments[3], sqrt=True),
                         str(moments[0].dtype), str(moments[2].dtype)))
        (lay_p, p, m1, v1, d1, d2), (lay_q, q, m2, v2, e1, e2) = runs
        out[option] = dict(layout=lay_p, twin_layout=lay_q, dtypes=(d1, d2, e1, e2),
                           same=torch.equal(p.view(torch.int32), q.view(torch.int32))
                           and torch.equal(m1, m2) and torch.equal(v1, v2))
    return out


def test_fsdp2_takes_only_contiguous_params_and_steps_an_offset_view_as_its_twin():
    """The FSDP2 path (docs/spec.md section 9, Layouts): fully_shard refuses a transposed,
    sliced or strided param (NotImplementedError), and shards any other into a contiguous
    buffer of its own, so the optimizer only ever sees contiguous local shards at offset 0
    (a padded buffer on the rank whose shard is short); with bf16 and uint8 moments such a
    param (a view at a storage offset, 61 rows over 2 ranks) steps as its contiguous twin."""
    if not ops.extension_available("cpu"):
        pytest.skip("CPU kernels not built")
    results = run_workers(_fsdp_worker, 2, timeout=60.0)
    for rank, out in enumerate(results):
        for layout in ("transposed", "sliced", "strided"):
            assert out[layout] is not None and "non-contiguous" in out[layout], (rank, layout)
        for option, want in (("bf16", "torch.bfloat16"), ("u8", "torch.uint8")):
            got = out[option]
            assert got["dtypes"] == (want,) * 4, (rank, option, got["dtypes"])
            # contiguous, at offset 0, not the original storage; padded on rank 1 (30 of 31
            # rows); every element stepped
            assert got["layout"] == (True, 0, False, 100 * rank, True), (rank, option, got["layout"])
            assert got["twin_layout"] == got["layout"], (rank, option)
            assert got["same"], (rank, option)
