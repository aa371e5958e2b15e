"""tpamp.model: NaiveAMPModel casts, buffer sync, fp32 islands, TF32 flags."""

from collections import OrderedDict, namedtuple

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.dist_utils import run_workers
from tpamp.model import (
    NaiveAMPModel,
    TF32Flags,
    module_has_fp32_attr,
    parse_dtype,
    set_fp32_attr_to_module,
    tf32_enabled,
)

Pair = namedtuple("Pair", ["a", "b"])


def _dtypes(obj):
    """Structure of obj with every tensor replaced by its dtype (an independent reader)."""
    if isinstance(obj, torch.Tensor):
        return obj.dtype
    if isinstance(obj, dict):
        return {k: _dtypes(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_dtypes(v) for v in obj]
    return obj


class Recorder(nn.Module):
    """Records what reaches forward and returns it (plus a float tensor from a param)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))
        self.seen = None

    def forward(self, *args, **kwargs):
        self.seen = (_dtypes(args), _dtypes(kwargs), type(args[1]), type(args[2]))
        return {"args": args, "kwargs": kwargs, "w": self.w * 2}


# ---- dtype parsing -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,expected",
    [
        ("torch.float16", (torch.float16, False)),
        ("torch.half", (torch.float16, False)),
        ("fp16", (torch.float16, False)),
        ("torch.bfloat16", (torch.bfloat16, False)),
        ("bf16", (torch.bfloat16, False)),
        ("torch.float32", (torch.float32, False)),
        ("fp32", (torch.float32, False)),
        ("torch.tf32", (torch.float32, True)),
        ("tf32", (torch.float32, True)),
        (torch.bfloat16, (torch.bfloat16, False)),
    ],
)
def test_parse_dtype_accepts_internevo_strings_aliases_and_torch_dtypes(name, expected):
    assert parse_dtype(name) == expected


@pytest.mark.parametrize("bad", ["torch.float64", "fp8", "", torch.float64, torch.int32])
def test_parse_dtype_rejects_unknown_naming_value_and_accepted_ones(bad):
    with pytest.raises(ValueError) as e:
        parse_dtype(bad)
    msg = str(e.value)
    assert str(bad) in msg and "torch.bfloat16" in msg and "torch.tf32" in msg


# ---- params, buffers, input and output casts -----------------------------------------------


def test_params_and_floating_buffers_are_cast_in_place_integer_buffers_kept():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    params = list(model.parameters())
    model[0].weight.tensor_model_parallel = True  # Megatron attribute must survive the cast
    ref = [p.detach().clone() for p in params]
    wrapped = NaiveAMPModel(model, dtype="torch.bfloat16")
    assert [id(p) for p in wrapped.parameters()] == [id(p) for p in params]
    assert all(p.dtype == torch.bfloat16 for p in params)
    for p, r in zip(params, ref):
        assert torch.equal(p, r.to(torch.bfloat16))
    assert model[0].weight.tensor_model_parallel is True
    assert model[1].running_mean.dtype == torch.bfloat16
    assert model[1].num_batches_tracked.dtype == torch.int64


def test_floating_inputs_nested_and_kwargs_cast_integer_and_objects_untouched():
    rec = Recorder()
    model = NaiveAMPModel(rec, dtype=torch.float16, output_to_fp32=False)
    x = torch.randn(2)
    ids = torch.arange(3)
    mask = torch.ones(2, dtype=torch.bool)
    model(
        x,
        [x.double(), (ids, x)],
        Pair(a=x, b=ids),
        OrderedDict(h=x, n=7),
        flag="text",
        kw=x,
        nested={"a": [x, ids], "m": mask},
    )
    args, kwargs, list_type, pair_type = rec.seen
    h, i64, b = torch.float16, torch.int64, torch.bool
    assert args == [h, [h, [i64, h]], [h, i64], {"h": h, "n": 7}]
    assert kwargs == {"flag": "text", "kw": h, "nested": {"a": [h, i64], "m": b}}
    assert list_type is list and pair_type is Pair


def test_outputs_cast_to_fp32_nested_unless_disabled_or_not_last_stage():
    x = torch.randn(2)
    ids = torch.arange(3)

    out = NaiveAMPModel(Recorder(), dtype="fp16")(x, [x], Pair(x, ids), {"k": x})
    d = _dtypes(out)
    f, i64 = torch.float32, torch.int64
    assert d["w"] == f
    assert d["args"] == [f, [f], [f, i64], {"k": f}]
    assert isinstance(out["args"][2], Pair)
    # values: the fp32 output is the fp16 result widened (independent: compute by hand)
    assert torch.equal(out["w"], (torch.ones(3, dtype=torch.float16) * 2).float())

    for kwargs in ({"output_to_fp32": False}, {"is_last_stage": False}):
        out = NaiveAMPModel(Recorder(), dtype="fp16", **kwargs)(x, [x], Pair(x, ids), {})
        assert out["w"].dtype == torch.float16
        assert _dtypes(out["args"])[0] == torch.float16


def test_gradient_flows_through_input_and_output_casts():
    torch.manual_seed(0)
    lin = nn.Linear(3, 2)
    model = NaiveAMPModel(lin, dtype=torch.bfloat16)
    x = torch.randn(4, 3, requires_grad=True)
    model(x).sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32
    assert lin.weight.grad.dtype == torch.bfloat16
    # d(sum(xW^T+b))/dW = column sums of x (rounded to bf16 as the model computes)
    ref = x.detach().to(torch.bfloat16).float().sum(0).expand(2, 3)
    torch.testing.assert_close(lin.weight.grad.float(), ref, atol=0.05, rtol=0.02)


# ---- buffer averaging over DP ranks --------------------------------------------------------


def _buffer_sync_worker(rank, world_size):
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(3)
    with torch.no_grad():
        bn.running_mean.copy_(torch.tensor([1.0, 2.0, 3.0]) * (rank + 1))
        bn.running_var.fill_(rank + 1.0)
        bn.num_batches_tracked.fill_(10 * (rank + 1))
    gathered = [torch.zeros(3) for _ in range(world_size)]
    dist.all_gather(gathered, bn.running_mean.clone())
    expected_mean = torch.stack(gathered).mean(0).half()
    model = NaiveAMPModel(bn, dtype=torch.float16, data_parallel_group=dist.group.WORLD)
    assert model.sync_buffer
    x = torch.randn(8, 3) + rank  # different data per rank
    # momentum 0: the forward does not change the running stats, so we see the sync alone
    bn.momentum = 0.0
    model(x)
    assert torch.equal(bn.running_mean, expected_mean), (bn.running_mean, expected_mean)
    assert torch.equal(bn.running_var, torch.full((3,), 1.5, dtype=torch.float16))
    # integer buffers are not averaged (num_batches_tracked counts this rank's steps: +1)
    assert bn.num_batches_tracked.item() == 10 * (rank + 1) + 1

    # first eval forward syncs; later eval forwards do not
    with torch.no_grad():
        bn.running_mean.fill_(float(rank))
    model.eval()
    model(x)
    assert torch.equal(bn.running_mean, torch.full((3,), 0.5, dtype=torch.float16))
    with torch.no_grad():
        bn.running_mean.fill_(float(rank))
    model(x)
    assert torch.equal(bn.running_mean, torch.full((3,), float(rank), dtype=torch.float16))

    # no group: nothing is averaged
    bn2 = nn.BatchNorm1d(3, momentum=0.0)
    with torch.no_grad():
        bn2.running_mean.fill_(float(rank))
    NaiveAMPModel(bn2, dtype=torch.float16)(x)
    assert torch.equal(bn2.running_mean, torch.full((3,), float(rank), dtype=torch.float16))
    return True


def test_floating_buffers_are_averaged_over_data_parallel_ranks():
    run_workers(_buffer_sync_worker, 2)


# ---- fp32 islands --------------------------------------------------------------------------


class IslandModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3))
        self.seen = {}
        self.norm.register_forward_pre_hook(self._record("norm_in"))
        self.head.register_forward_hook(lambda m, a, o: self.seen.__setitem__("head_out", o.dtype))
        self.head[1].register_forward_pre_hook(self._record("inner_in"))

    def _record(self, key):
        def hook(module, args):
            self.seen[key] = args[0].dtype

        return hook

    def forward(self, x, scale=None):
        h = self.inp(x)
        self.seen["inp_out"] = h.dtype
        h = self.norm(h)
        self.seen["norm_out"] = h.dtype
        return self.head(h, ) if scale is None else self.head(h) * scale


def test_fp32_island_keeps_exact_fp32_params_and_hooks_cast_both_ways():
    torch.manual_seed(0)
    m = IslandModel()
    with torch.no_grad():
        m.norm.weight.add_(torch.randn(8) * 1e-4)  # bits that an fp16 round trip would lose
    set_fp32_attr_to_module(m.norm)
    set_fp32_attr_to_module(m.head)
    set_fp32_attr_to_module(m.head[1])  # nested island: no second set of hooks
    assert module_has_fp32_attr(m.norm) and not module_has_fp32_attr(m.inp)
    norm_w = m.norm.weight.detach().clone()
    model = NaiveAMPModel(m, dtype=torch.float16, output_to_fp32=False)

    assert m.inp.weight.dtype == torch.float16
    assert all(p.dtype == torch.float32 for p in m.norm.parameters())
    assert all(p.dtype == torch.float32 for p in m.head.parameters())
    assert torch.equal(m.norm.weight, norm_w)  # not round-tripped through fp16

    out = model(torch.randn(2, 4))
    s = m.seen
    assert s["inp_out"] == torch.float16
    assert s["norm_in"] == torch.float32  # pre-hook cast fp16 -> fp32
    assert s["norm_out"] == torch.float16  # forward hook cast back to the model dtype
    assert s["inner_in"] == torch.float32  # inside the outer island: no cast to fp16
    assert out.dtype == torch.float16
    out.float().sum().backward()
    assert m.inp.weight.grad.dtype == torch.float16
    assert m.norm.weight.grad.dtype == torch.float32
    assert m.head[1].weight.grad.dtype == torch.float32
    assert len(m.head[1]._forward_pre_hooks) == 1  # only the test's recorder


def test_fp32_island_casts_kwargs_and_nested_inputs():
    class Island(nn.Module):
        def forward(self, xs, *, mask, bias=None):
            self.seen = _dtypes((xs, mask, bias))
            return xs[0] + bias

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.island = set_fp32_attr_to_module(Island())

        def forward(self, x):
            h = self.lin(x)
            return self.island([h, h], mask=torch.ones(2, dtype=torch.bool), bias=h)

    outer = Outer()
    out = NaiveAMPModel(outer, dtype=torch.bfloat16, output_to_fp32=False)(torch.randn(2))
    f = torch.float32
    assert outer.island.seen == [[f, f], torch.bool, f]
    assert out.dtype == torch.bfloat16


def test_set_fp32_attr_rejects_non_modules():
    with pytest.raises(TypeError, match="nn.Module"):
        set_fp32_attr_to_module(torch.zeros(1))


def test_fp32_islands_train_through_mixed_precision_optimizer_without_master_copy():
    optimizer_mod = pytest.importorskip("tpamp.optimizer")
    from tpamp.grad_scaler import DynamicGradScaler

    torch.manual_seed(0)
    m = IslandModel()
    set_fp32_attr_to_module(m.norm)
    set_fp32_attr_to_module(m.head)
    model = NaiveAMPModel(m, dtype=torch.float16)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = optimizer_mod.MixedPrecisionOptimizer(
        inner, grad_scaler=DynamicGradScaler(initial_scale=2.0**10, device="cpu"), clip_grad=1.0,
        log_num_zeros_in_grad=True,
    )
    # fp32 params are used as they are; fp16 params have an fp32 main copy
    inner_params = {id(p) for g in opt.param_groups for p in g["params"]}
    for p in list(m.norm.parameters()) + list(m.head.parameters()):
        assert p.dtype == torch.float32 and id(p) in inner_params
    for p in m.inp.parameters():
        assert p.dtype == torch.float16 and id(p) not in inner_params
    assert all(p.dtype == torch.float32 for g in opt.param_groups for p in g["params"])

    x, y = torch.randn(16, 4), torch.randn(16, 3)
    norm_before = m.norm.weight.detach().clone()
    losses = []
    for _ in range(4):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.scale_loss(loss).backward()
        # independent reference over ALL grads, fp32 island included (no TP: all count)
        scale = opt.get_loss_scale().item()
        grads = [p.grad.double() / scale for p in model.parameters()]
        ref_norm = torch.cat([g.flatten() for g in grads]).norm().item()
        ref_zeros = sum(int((g == 0).sum()) for g in grads)
        island_norm = torch.cat([p.grad.double().flatten() / scale for p in m.head.parameters()]).norm()
        assert island_norm > 0
        result = opt.step()
        opt.zero_grad()
        assert result.update_successful
        assert result.grad_norm == pytest.approx(ref_norm, rel=1e-5)
        assert result.num_zeros_in_grad == ref_zeros
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert m.norm.weight.dtype == torch.float32 and not torch.equal(m.norm.weight, norm_before)

    # the fp32 island's grads count in found_inf: an inf there skips the step
    before = [p.detach().clone() for p in model.parameters()]
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.scale_loss(loss).backward()
    m.head[1].weight.grad[0, 0] = float("inf")
    result = opt.step()
    opt.zero_grad()
    assert not result.update_successful
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# ---- TF32 ----------------------------------------------------------------------------------


def _flags():
    return (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)


@pytest.fixture
def odd_tf32_flags():
    """Start from a non-default combination so that restoring is distinguishable from resetting."""
    saved = _flags()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield (False, False)
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_tf32_model_turns_flags_on_inside_and_restores_them_after(odd_tf32_flags):
    precision = torch.get_float32_matmul_precision()
    lin = nn.Linear(2, 2)
    with NaiveAMPModel(lin, dtype="torch.tf32") as model:
        assert _flags() == (True, True)
        assert model.dtype == torch.float32 and model.tf32
        assert lin.weight.dtype == torch.float32
        assert model(torch.randn(1, 2, dtype=torch.float64)).dtype == torch.float32
    assert _flags() == odd_tf32_flags
    assert torch.get_float32_matmul_precision() == precision

    model = NaiveAMPModel(nn.Linear(2, 2), dtype="tf32")
    assert _flags() == (True, True)
    model.release()
    model.release()  # idempotent
    assert _flags() == odd_tf32_flags


def test_tf32_context_restores_flags_after_an_exception(odd_tf32_flags):
    with pytest.raises(RuntimeError, match="boom"):
        with tf32_enabled():
            assert _flags() == (True, True)
            raise RuntimeError("boom")
    assert _flags() == odd_tf32_flags
    flags = TF32Flags()
    with flags:
        with TF32Flags():
            pass
        assert _flags() == (True, True)  # inner restore puts back the outer's setting
    assert _flags() == odd_tf32_flags


def test_non_tf32_dtypes_leave_flags_alone(odd_tf32_flags):
    NaiveAMPModel(nn.Linear(2, 2), dtype="bf16")
    NaiveAMPModel(nn.Linear(2, 2), dtype="fp32")
    assert _flags() == odd_tf32_flags
