"""tpamp.megatron.get_megatron_optimizer inside megatron-core's own training pieces (GPTModel
with the local layer spec, Float16Module, DistributedDataParallel, finalize_model_grads,
get_forward_backward_func, OptimizerParamScheduler), against megatron-core's own
get_megatron_optimizer on the same model, data and loop (tests/megatron_utils.py): the same
skip decisions and loss scales on every rank, losses to 1e-3, at TP 2, TP 2 x DP 2 with the
distributed optimizer (megatron's buffers, overlap_grad_reduce on) and TP 2 x PP 2, with
injected overflows; Megatron dist-checkpoint (torch_dist) and "torch"-format round trips that
resume exactly; the interface's misuse and the layouts refused at construction. megatron-core
is a test dependency (skipped with the reason where absent; .ci/run installs it). It runs on
CPU with these shims only (tests/megatron_utils.py, scripts/megatron_cpu.py):
torch.cuda.current_device() -> 0, current_stream() with no-op waits, synchronize() a no-op, the
CudaAsCpu TorchFunctionMode (device "cuda" -> cpu, Tensor.cuda() -> itself, CUDA type names)
around megatron-core's own calls, and a queue.Queue for its dist-checkpoint writer's results
(it asks for a multiprocessing Manager, which a daemonic test rank may not start)."""

from __future__ import annotations

import math

import pytest
import torch
from dist_utils import run_workers
from megatron_utils import optimizer_config, require_megatron, train

STEPS = 7
OVERFLOW = (2, 3)  # two overflows in a row: hysteresis 2 backs off at the second
LOSS_TOL = 1e-3


@pytest.fixture(scope="module", autouse=True)
def _megatron():
    require_megatron()  # imported once here, before the ranks fork


def _train(rank, world_size, which, kw):
    out = train(which, **kw)
    return {"steps": out["steps"], "params": out["params"]}


def _compare(world, split_step=False, **kw):
    kw = dict(steps=STEPS, overflow_at=OVERFLOW, opt_kw={"loss_scale_window": 3}, **kw)
    ref = run_workers(_train, world, "megatron", kw, timeout=120)
    got = run_workers(_train, world, "tpamp", dict(kw, split_step=split_step), timeout=120)
    for rank, (r, g) in enumerate(zip(ref, got)):
        ref_ok = [s[0] for s in r["steps"]]
        assert not all(ref_ok) and any(ref_ok), f"rank {rank}: the reference must skip some steps"
        assert len({s[1] for s in r["steps"]}) > 1, "the reference's loss scale must move"
        for i, (a, b) in enumerate(zip(r["steps"], g["steps"])):
            where = f"rank {rank} step {i}: megatron {a} vs tpamp {b}"
            assert a[0] == b[0], "skip decision differs: " + where
            assert a[1] == b[1], "loss scale differs: " + where
            assert a[5] == b[5], "learning rate differs: " + where
            if a[4] is not None:
                assert abs(a[4] - b[4]) <= LOSS_TOL, "loss differs: " + where
            if a[0]:
                assert math.isclose(a[2], b[2], rel_tol=1e-3), "grad norm differs: " + where
                if split_step:  # get_grad_norm() before the step: the same norm
                    assert math.isclose(a[2], b[6], rel_tol=1e-3), "get_grad_norm: " + where
            else:
                assert b[2] is None and b[3] is None, where
        for name, p in r["params"].items():
            torch.testing.assert_close(g["params"][name], p, atol=2e-3, rtol=0,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
    return ref, got


def test_tp2_matches_megatron_core():
    _compare(2, tp=2)


def test_tp2_pp2_matches_megatron_core():
    _compare(4, tp=2, pp=2)


def test_tp2_dp2_distributed_optimizer_overlap_matches_megatron_core():
    """megatron's DDP reduce-scatters its buckets during backward (overlap_grad_reduce) into
    its own buffers; tpamp's distributed optimizer steps this rank's range of them."""
    _compare(4, tp=2, dist_opt=True, overlap=True, bucket_size=4000)


def test_tp2_dp2_distributed_optimizer_fp32_reduce_matches_megatron_core():
    """Also the step as megatron-core composes it from the interface training.py may call
    (prepare_grads, clip_grad_norm, count_zeros, step_with_ready_grads; get_grad_norm before)."""
    _compare(4, split_step=True, tp=2, dist_opt=True, overlap=False, grad_reduce_in_fp32=True)


# ---------------------------------------------------------------------------------------------
# checkpoints: a run saved at iteration 4 and resumed in new processes repeats the uninterrupted
# run exactly (skip decisions, loss scales and their trackers, norms, zeros, losses, lr)


def _resume(tmp_path, world, **kw):
    kw = dict(steps=STEPS, overflow_at=OVERFLOW, opt_kw={"loss_scale_window": 3}, **kw)
    d = str(tmp_path)
    whole = run_workers(_train, world, "tpamp", dict(kw, save_at=4, ckpt_dir=d), timeout=120)
    resumed = run_workers(_train, world, "tpamp", dict(kw, start=4, ckpt_dir=d), timeout=120)
    for rank, (w, r) in enumerate(zip(whole, resumed)):
        assert r["steps"] == w["steps"][4:], f"rank {rank}"
        assert len({s[1] for s in r["steps"]}) > 1, "the scaler's growth tracker must matter"
        for name, p in w["params"].items():
            assert torch.equal(r["params"][name], p), f"rank {rank} {name}"


def test_dist_checkpoint_round_trip_tp2(tmp_path):
    """Megatron's dist-checkpointing (torch_dist format) of model, optimizer.sharded_state_dict
    and scheduler."""
    pytest.importorskip("psutil", reason="megatron-core's dist-checkpoint writer needs psutil")
    _resume(tmp_path, 2, tp=2)


def test_dist_checkpoint_round_trip_distributed_optimizer(tmp_path):
    """The distributed optimizer's state gathered over DP into model space (ShardedTensors
    made from the params' own), saved by DP rank 0, each rank's range loaded back."""
    pytest.importorskip("psutil", reason="megatron-core's dist-checkpoint writer needs psutil")
    _resume(tmp_path, 4, tp=2, dist_opt=True, overlap=True)


def test_parameter_state_round_trip_distributed_optimizer(tmp_path):
    """Megatron-LM's "torch" format: state_dict() per rank plus save_parameter_state /
    load_parameter_state."""
    _resume(tmp_path, 4, tp=2, dist_opt=True, overlap=True, ckpt_format="torch")


def test_dist_checkpoint_of_the_distributed_optimizer_loads_into_the_plain_one(tmp_path):
    """Model space: a checkpoint of the distributed optimizer (TP 2 x DP 2) resumes with the
    non-distributed one on the same layout; it goes on as the uninterrupted distributed run
    (same skips and loss scales, losses to 1e-3)."""
    pytest.importorskip("psutil", reason="megatron-core's dist-checkpoint writer needs psutil")
    kw = dict(steps=STEPS, overflow_at=OVERFLOW, opt_kw={"loss_scale_window": 3}, tp=2)
    d = str(tmp_path)
    whole = run_workers(_train, 4, "tpamp", dict(kw, dist_opt=True, save_at=4, ckpt_dir=d),
                        timeout=120)
    resumed = run_workers(_train, 4, "tpamp", dict(kw, start=4, ckpt_dir=d), timeout=120)
    for rank, (w, r) in enumerate(zip(whole, resumed)):
        for a, b in zip(w["steps"][4:], r["steps"]):
            assert a[:2] == b[:2] and a[5] == b[5], f"rank {rank}: {a} vs {b}"
            assert abs(a[4] - b[4]) <= LOSS_TOL and math.isclose(a[2], b[2], rel_tol=1e-3), \
                f"rank {rank}: {a} vs {b}"


def test_sharded_state_dict_names_a_missing_param():
    res = run_workers(_missing_param, 2, timeout=120)
    for msg in res:
        assert msg is not None and "not in model_sharded_state_dict" in msg, msg


def _missing_param(rank, world_size):
    from megatron_utils import build_model, setup_parallel

    from tpamp.megatron import get_megatron_optimizer

    CudaAsCpu = setup_parallel(2, 1)
    model, _ = build_model(tp=2, pp=1, dist_opt=False, overlap=False, grad_reduce_in_fp32=False)
    opt = get_megatron_optimizer(optimizer_config(), [model])
    with CudaAsCpu():
        model_sd = model.module.module.sharded_state_dict()
    model_sd.pop(next(k for k in model_sd if k.endswith("final_layernorm.weight")))
    try:
        opt.sharded_state_dict(model_sd)
    except ValueError as e:
        return str(e)
    return None


# ---------------------------------------------------------------------------------------------
# construction errors: an option that cannot apply is an error, never a silent difference


class _Chunk(torch.nn.Module):
    def __init__(self, ddp_config=None, expert=False):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
        if expert:
            self.w.allreduce = False
        if ddp_config is not None:
            self.ddp_config = ddp_config


def _ddp_config(**kw):
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(**kw)


@pytest.mark.parametrize("field,value", [
    ("optimizer", "muon"), ("use_precision_aware_optimizer", True),
    ("optimizer_cpu_offload", True), ("optimizer_cuda_graph", True),
    ("overlap_param_gather_with_optimizer_step", True),
])
def test_unsupported_optimizer_config_is_an_error(field, value):
    from tpamp.megatron import get_megatron_optimizer

    config = optimizer_config()
    setattr(config, field, value)  # past OptimizerConfig's own checks (no TE / Apex here)
    with pytest.raises(ValueError, match=field):
        get_megatron_optimizer(config, [_Chunk()])


@pytest.mark.parametrize("chunks,opt_kw,match", [
    (lambda: [_Chunk()], {"use_distributed_optimizer": True}, "use_distributed_optimizer"),
    (lambda: [_Chunk(_ddp_config(use_distributed_optimizer=True))], {},
     "use_distributed_optimizer"),
    (lambda: [_Chunk(_ddp_config()), _Chunk(_ddp_config(grad_reduce_in_fp32=True))], {},
     "chunk 1"),
    (lambda: [_Chunk(_ddp_config()), _Chunk()], {}, "wrap all or none"),
    (lambda: [_Chunk(_ddp_config(use_distributed_optimizer=True, overlap_param_gather=True))],
     {"use_distributed_optimizer": True}, "overlap_param_gather"),
    (lambda: [_Chunk(expert=True)], {}, "expert"),
    (lambda: [], {}, "empty"),
])
def test_layouts_that_cannot_work_are_refused(chunks, opt_kw, match):
    from tpamp.megatron import get_megatron_optimizer

    with pytest.raises(ValueError, match=match):
        get_megatron_optimizer(optimizer_config(**opt_kw), chunks())


# ---------------------------------------------------------------------------------------------
# tpamp's own wrappers inside megatron-core


def _wrappers_in_megatron(rank, world_size):
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron_utils import build_model, setup_parallel

    import tpamp

    CudaAsCpu = setup_parallel(2, 1)
    model, _ = build_model(tp=2, pp=1, dist_opt=False, overlap=True, grad_reduce_in_fp32=False)
    params = [p for p in model.parameters() if p.requires_grad]
    out = {}
    try:  # megatron's DDP owns these grads: a second DP reduce is refused at construction
        tpamp.DistributedOptimizer(torch.optim.AdamW(params),
                                   grad_scaler=tpamp.ConstantGradScaler(1.0))
        out["dist"] = None
    except ValueError as e:
        out["dist"] = str(e)
    # no groups given: megatron-core's parallel_state gives them
    opt = tpamp.MixedPrecisionOptimizer(torch.optim.AdamW(params),
                                        grad_scaler=tpamp.ConstantGradScaler(1.0))
    out["groups"] = (opt.tensor_parallel_group is mpu.get_tensor_model_parallel_group()
                     and opt.grad_stats_group is mpu.get_model_parallel_group())
    dist.barrier()
    with CudaAsCpu():
        mpu.destroy_model_parallel()
    return out


def test_tpamp_wrappers_inside_megatron_ddp():
    for r in run_workers(_wrappers_in_megatron, 2, timeout=120):
        assert r["dist"] is not None and "get_megatron_optimizer" in r["dist"], r
        assert r["groups"], "groups were not taken from megatron's parallel_state"


# ---------------------------------------------------------------------------------------------
# the interface's misuse: bad input names what is wrong; nothing changes


def _interface_misuse(rank, world_size, tmp):
    import os

    from megatron_utils import build_model, setup_parallel

    from tpamp.megatron import FORMAT_KEY, get_megatron_optimizer

    CudaAsCpu = setup_parallel(2, 1)
    model, _ = build_model(tp=2, pp=1, dist_opt=True, overlap=False, grad_reduce_in_fp32=True)
    opt = get_megatron_optimizer(optimizer_config(use_distributed_optimizer=True), [model])
    out = {"stub": opt.is_stub_optimizer, "chained": opt.chained_optimizers == [opt],
           "params": len(opt.get_parameters()) > 0,
           "default_config": [g["default_config"] for g in opt.param_groups]}

    def err(fn):
        try:
            fn()
        except Exception as e:  # the type and message are the result
            return f"{type(e).__name__}: {e}"
        return None

    out["ready_first"] = err(opt.step_with_ready_grads)
    out["not_dict"] = err(lambda: opt.load_state_dict([1]))
    out["no_names"] = err(lambda: opt.load_state_dict({FORMAT_KEY: 1}))
    with CudaAsCpu():
        model_sd = model.module.module.sharded_state_dict()
    opt.sharded_state_dict(model_sd, is_loading=True)
    before = [p.detach().clone() for p in opt.get_parameters()]
    good = {FORMAT_KEY: 1, "param_groups": opt.state_dict()["param_groups"], "step": 0.0,
            "grad_scaler": opt.state_dict()["grad_scaler"], "param_state": {}}
    out["missing_key"] = err(lambda: opt.load_state_dict({FORMAT_KEY: 1, "step": 0}))
    out["missing_param"] = err(lambda: opt.load_state_dict(good))
    path = os.path.join(tmp, f"foreign{rank}.pt")
    torch.save({"something": 1}, path)
    out["foreign_file"] = err(lambda: opt.load_parameter_state(path))
    out["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, opt.get_parameters()))
    opt.offload_to_cpu()
    opt.restore_from_cpu()
    out["offload_kept"] = all(torch.equal(a, b) for a, b in zip(before, opt.get_parameters()))
    return out


def test_interface_misuse(tmp_path):
    for r in run_workers(_interface_misuse, 2, str(tmp_path), timeout=120):
        assert r["stub"] is False and r["chained"] and r["params"], r
        assert r["default_config"] == [True, True], r  # megatron's two standard groups
        assert r["ready_first"].startswith("RuntimeError") and "prepare_grads" in r["ready_first"]
        assert r["not_dict"].startswith("TypeError") and "list" in r["not_dict"]
        assert r["no_names"].startswith("RuntimeError") and "sharded_state_dict" in r["no_names"]
        assert r["missing_key"].startswith("KeyError") and "param_groups" in r["missing_key"]
        assert r["missing_param"].startswith("KeyError") and "lacks" in r["missing_param"]
        assert r["foreign_file"].startswith("ValueError") and "foreign" in r["foreign_file"]
        assert r["unchanged"] and r["offload_kept"], r


@pytest.mark.parametrize("value", [1, "on", 0.0])
def test_deterministic_grad_norm_must_be_a_bool(value):
    """tpamp's keyword of the factory (docs/spec.md section 23): a bool or None."""
    from tpamp.megatron import get_megatron_optimizer

    with pytest.raises(TypeError, match="deterministic_grad_norm"):
        get_megatron_optimizer(optimizer_config(), [_Chunk()], deterministic_grad_norm=value)
