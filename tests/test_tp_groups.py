"""Groups are never silently missing (docs/spec.md section 22): a wrapper over params that
carry Megatron's ``tensor_model_parallel`` attribute, given no tensor_parallel_group, takes the
TP and model-parallel groups of the initialized parallel state, and without one raises; the
clip coefficient is computed as Megatron-LM computes it (float64)."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_workers

import tpamp
from tpamp.grad_stats import clip_coefficient


def _params(rank):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 3).half())
    w.tensor_model_parallel, w.partition_dim, w.partition_stride = True, 0, 1
    b = torch.nn.Parameter(torch.randn(3).half())  # replicated over TP
    return [w, b]


def _wrappers(params, st=None):
    import torch.distributed as dist

    mk = {
        "MixedPrecisionOptimizer": lambda: tpamp.MixedPrecisionOptimizer(
            torch.optim.SGD(params, lr=0.1), grad_scaler=tpamp.ConstantGradScaler(1.0)),
        "DistributedOptimizer": lambda: tpamp.DistributedOptimizer(
            torch.optim.SGD(params, lr=0.1), grad_scaler=tpamp.ConstantGradScaler(1.0),
            data_parallel_group=dist.group.WORLD if st is None else st.dp_group),
        # one param owned per DP rank: the rank that owns no marked param must refuse too
        "LayerWiseDistributedOptimizer": lambda: tpamp.LayerWiseDistributedOptimizer(
            torch.optim.SGD(params, lr=0.1), grad_scaler=tpamp.ConstantGradScaler(1.0),
            data_parallel_group=dist.group.WORLD if st is None else st.dp_group),
        "TorchAMPOptimizer": lambda: tpamp.TorchAMPOptimizer(
            torch.optim.SGD(params, lr=0.1), tpamp.ModelParallelGradScaler("cpu")),
    }
    return mk


def _refused(rank, world_size):
    import torch.distributed as dist

    out = {}
    for name, make in _wrappers(_params(rank)).items():
        try:
            make()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    dist.barrier()  # no rank leaves (and takes the store down) while another still works
    return out


def test_tensor_parallel_params_without_a_group_raise():
    for res in run_workers(_refused, 2):
        for name, msg in res.items():
            assert msg is not None, f"{name} accepted TP params without a TP group"
            assert "tensor_model_parallel" in msg and name in msg and "(4, 3)" in msg, msg


def _from_state(rank, world_size):
    st = tpamp.parallel.initialize_model_parallel(2)
    params = _params(rank)
    opt = tpamp.MixedPrecisionOptimizer(torch.optim.SGD(params, lr=0.1),
                                        grad_scaler=tpamp.DynamicGradScaler(initial_scale=4.0,
                                                                            hysteresis=1))
    groups_ok = (opt.tensor_parallel_group is st.tp_group
                 and opt.grad_stats_group is st.model_parallel_group)
    for p in params:
        p.grad = torch.ones_like(p)
    if rank == 1:  # an overflow on one TP rank only
        params[0].grad[0, 0] = float("inf")
    ok, _, _ = opt.step()
    dopt = tpamp.DistributedOptimizer(torch.optim.SGD(_params(rank), lr=0.1),
                                      grad_scaler=tpamp.ConstantGradScaler(1.0))
    # the layer-wise optimizer: the same overflow on TP rank 1 only
    lw_params = _params(rank)
    lw = tpamp.LayerWiseDistributedOptimizer(
        torch.optim.SGD(lw_params, lr=0.1), data_parallel_group=st.dp_group,
        grad_scaler=tpamp.DynamicGradScaler(initial_scale=4.0, hysteresis=1))
    for p in lw_params:
        p.grad = torch.ones_like(p)
    if rank == 1:
        lw_params[0].grad[0, 0] = float("inf")
    lw_ok, _, _ = lw.step()
    # torch.amp: the groups from the state; a scaler that reduces over no group is refused
    amp_params = [p.detach().float().requires_grad_() for p in _params(rank)]
    amp_params[0].tensor_model_parallel = True
    try:
        tpamp.TorchAMPOptimizer(torch.optim.SGD(amp_params, lr=0.1),
                                tpamp.ModelParallelGradScaler("cpu"))
        amp_refused = None
    except ValueError as e:
        amp_refused = str(e)
    amp = tpamp.TorchAMPOptimizer(
        torch.optim.SGD(amp_params, lr=0.1),
        tpamp.ModelParallelGradScaler("cpu", init_scale=4.0,
                                      model_parallel_group=st.model_parallel_group))
    return {"groups": groups_ok, "ok": bool(ok), "scale": float(opt.get_loss_scale().item()),
            "dist_tp": dopt.tensor_parallel_group is st.tp_group
            and dopt.data_parallel_group is st.dp_group,
            "lw_groups": lw.tensor_parallel_group is st.tp_group,
            "lw_ok": bool(lw_ok), "lw_scale": float(lw.get_loss_scale().item()),
            "amp_refused": amp_refused is not None and "model_parallel_group" in amp_refused,
            "amp_groups": amp.tensor_parallel_group is st.tp_group
            and amp.grad_stats_group is st.model_parallel_group}


def test_groups_come_from_tpamp_parallel_state():
    """Both TP ranks skip and back off although only rank 1 saw the inf (hand-worked: scale 4,
    hysteresis 1 -> 2), in MixedPrecisionOptimizer and LayerWiseDistributedOptimizer; the
    other wrappers take the state's groups, and TorchAMPOptimizer refuses a scaler that would
    let each TP rank skip on its own."""
    res = run_workers(_from_state, 2)
    for r in res:
        assert r == {"groups": True, "ok": False, "scale": 2.0, "dist_tp": True,
                     "lw_groups": True, "lw_ok": False, "lw_scale": 2.0, "amp_refused": True,
                     "amp_groups": True}, res


def test_one_rank_needs_no_group():
    params = _params(0)
    opt = tpamp.MixedPrecisionOptimizer(torch.optim.SGD(params, lr=0.1),
                                        grad_scaler=tpamp.ConstantGradScaler(1.0))
    assert opt.tensor_parallel_group is None


@pytest.mark.parametrize("norm", [3.0, 1.0 + 2**-20, 1e5 / 3.0])
def test_clip_coefficient_as_megatron_computes_it(norm):
    """Megatron-LM: clip_coeff = max_norm / (total_norm + 1e-6) in Python floats (float64),
    applied to float32 grads: rounded once to float32."""
    max_norm = 1.0
    want = torch.tensor(max_norm / (norm + 1.0e-6), dtype=torch.float64).float()
    got = clip_coefficient(max_norm, torch.tensor([norm], dtype=torch.float64))
    assert got.dtype == torch.float32 and got.item() == want.item()
