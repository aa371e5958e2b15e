"""tpamp under FSDP2 (torch.distributed.fsdp.fully_shard) + DTensor TP (tpamp/fsdp.py).

The main job's GPT (scripts/gpt_model.py, tiny) on DP 2 (2 gloo ranks) and TP 2 x DP 2 (4 gloo
ranks): TP with parallelize_module on the TP sub-mesh, fully_shard of each block and the root on
the DP sub-mesh, tpamp.fsdp.fully_shard_optimizer around AdamW. The reference is the unsharded
model in float64 in one process (plain autograd, F.cross_entropy, its own clip and AdamW),
independent of tpamp: the grad norm, zero count, per-parameter norms and the params after
several steps must agree with it. Also: an inf in one rank's shard skips the step on every rank
with nothing changed; a torch.distributed.checkpoint resume continues bit-identically. Under a
pipeline (PP 2 x DP 2 on 4 ranks, PP 2 x DP 2 x TP 2 on 8; GPipe from
torch.distributed.pipelining, fully_shard_optimizer on the whole (pp, dp, tp) mesh): the same
reference for both stages together, and an inf in one stage's shard skips on every rank.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_workers

import tpamp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from gpt_model import GPTConfig, GPTStage, parallelize_stage  # noqa: E402

CFG = dict(vocab_size=64, seq_length=8, hidden_size=16, num_layers=2, num_attention_heads=4)
SEED = 3
BATCH = 4  # global batch (rows of T tokens), split over DP
T = 4  # < seq_length: position rows 4..7 get exact-zero grads (zero counts must see them)
LR, WD, CLIP = 1e-2, 0.1, 0.5


def _batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(CFG["vocab_size"], (BATCH, T), generator=g)
    y = torch.randint(CFG["vocab_size"], (BATCH, T), generator=g)
    return x, y


# ----------------------------------------------------------------------------- reference


def _reference(steps: int, skip_steps=()):
    """fp64, one process: per step the grad norm, zero count, per-param norms; the params
    after ``steps`` (the steps in ``skip_steps`` change nothing, as a skipped step must)."""
    model = GPTStage(GPTConfig(**CFG))
    model.init_weights(SEED)
    model.cast_(torch.float64)
    params = dict(model.named_parameters())
    state = {n: (torch.zeros_like(p), torch.zeros_like(p)) for n, p in params.items()}
    out, done = [], 0
    for step in range(1, steps + 1):
        x, y = _batch(step)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        grads = torch.autograd.grad(loss, list(params.values()))
        grads = dict(zip(params, grads))
        norms = {n: g.norm().item() for n, g in grads.items()}
        total = math.sqrt(sum(v * v for v in norms.values()))
        # exact zeros that any precision gets: the unused position rows (the key bias's grad
        # is zero in exact arithmetic -- softmax ignores a constant added to every key -- and
        # rounds to +-1e-20 or to 0 in any precision: counted apart, as "near" zeros)
        zeros = sum(int((g == 0).sum()) for n, g in grads.items() if not n.endswith("qkv.bias"))
        near = sum(int((g.abs() < 1e-12).sum()) for g in grads.values())
        key_bias = {n: g.abs() < 1e-12 for n, g in grads.items() if n.endswith("qkv.bias")}
        out.append(dict(grad_norm=total, zeros=zeros, near_zeros=near, norms=norms,
                        loss=loss.item(), key_bias=key_bias))
        if step in skip_steps:
            continue
        coeff = CLIP / (total + 1e-6)
        done += 1
        with torch.no_grad():
            for n, p in params.items():  # torch.optim.AdamW's update, by hand, in fp64
                g = grads[n] * coeff if coeff < 1.0 else grads[n]
                m, v = state[n]
                wd = WD if p.dim() >= 2 else 0.0
                p.mul_(1 - LR * wd)
                m.mul_(0.9).add_(g, alpha=0.1)
                v.mul_(0.999).addcmul_(g, g, value=0.001)
                denom = (v / (1 - 0.999**done)).sqrt() + 1e-8
                p.sub_(LR * (m / (1 - 0.9**done)) / denom)
    return out, {n: p.detach().clone() for n, p in params.items()}


# ----------------------------------------------------------------------------- workers


def _build(tp: int, dtype, *, hysteresis: int = 2, seed: int = SEED):

    from tpamp.parallel import initialize_model_parallel

    st = initialize_model_parallel(tp, 1)
    model = GPTStage(GPTConfig(**CFG))
    model.init_weights(seed)
    _tp_then_fully_shard(model, st, tp, dtype)
    groups = [
        {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": WD},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]
    scaler = None
    if dtype == torch.float16:
        scaler = tpamp.DynamicGradScaler(initial_scale=2.0**10, hysteresis=hysteresis)
    opt = tpamp.fsdp.fully_shard_optimizer(
        torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.999), eps=1e-8),
        st.mesh["dp", "tp"] if tp > 1 else st.mesh["dp"],
        grad_scaler=scaler, clip_grad=CLIP, log_num_zeros_in_grad=True,
        spike_detector=tpamp.SpikeDetector("log", warmup=2),
    )
    tracker = tpamp.fsdp.track_param_grad_norms(opt, model.named_parameters())
    return st, model, opt, tracker


def _train_step(st, model, opt, tracker, step: int, inject_rank=None):
    x, y = _batch(step)
    per_dp = BATCH // st.dims.dp
    x, y = x[st.dp_rank * per_dp:][:per_dp], y[st.dp_rank * per_dp:][:per_dp]
    logits = model(x)
    loss = tpamp.vocab_parallel_cross_entropy(logits, y, st.tp_group).float().mean()
    opt.scale_loss(loss).backward()
    if inject_rank is not None and torch.distributed.get_rank() == inject_rank:
        # one element of this rank's own shard of one block's fc1 grad (not the others')
        model.blocks[1].mlp.fc1.weight.grad.to_local().view(-1)[0] = math.inf
    opt.spike_detector.observe_loss(loss.item())
    scale = opt.get_loss_scale().item()
    result = opt.step(param_grad_norms=True, param_update_norms=True)
    opt.zero_grad()
    return dict(ok=result.update_successful, grad_norm=result.grad_norm,
                zeros=result.num_zeros_in_grad, norms=dict(tracker.norms), scale=scale,
                loss=loss.item(), updates=tracker.update_norms)


def _full_params(model):
    return {n: p.full_tensor().detach().double().clone() for n, p in model.named_parameters()}


def _tp_then_fully_shard(model, st, tp, dtype):
    """torchtitan's order: DTensor TP over st.tp_mesh (when tp > 1), then FSDP2 over the DP
    mesh, each block and the root, with tpamp's fp16/bf16-compute, fp32-reduce policy."""
    from torch.distributed.fsdp import fully_shard
    if tp > 1:
        parallelize_stage(model, st.tp_mesh)
    policy = tpamp.fsdp.mixed_precision_policy(dtype)
    for block in model.blocks:
        fully_shard(block, mesh=st.mesh["dp"], mp_policy=policy)
    fully_shard(model, mesh=st.mesh["dp"], mp_policy=policy)


def _run(rank, world, tp, dtype, steps, inject):
    st, model, opt, tracker = _build(tp, dtype, hysteresis=1)
    records, snapshots = [], []
    initial = _full_params(model)
    for step in range(1, steps + 1):
        records.append(_train_step(st, model, opt, tracker, step,
                                   inject_rank=inject[1] if inject and step == inject[0] else None))
        snapshots.append(_full_params(model))
    steps_taken = [int(s["step"]) for s in opt.optimizer.state.values()]
    return dict(records=records, snapshots=snapshots if rank == 0 else None,
                steps_taken=steps_taken, initial=initial if rank == 0 else None)


# ----------------------------------------------------------------------------- tests

# (tp, world, dtype, tolerance of the grad norms / params against fp64)
LAYOUTS = [
    pytest.param(1, 2, torch.float32, 1e-5, id="dp2-fp32"),
    pytest.param(1, 2, torch.float16, 2e-2, id="dp2-fp16"),
    pytest.param(2, 4, torch.float32, 1e-5, id="tp2xdp2-fp32"),
    pytest.param(2, 4, torch.float16, 2e-2, id="tp2xdp2-fp16"),
    pytest.param(2, 4, torch.bfloat16, 5e-2, id="tp2xdp2-bf16"),
]


@pytest.mark.parametrize("tp,world,dtype,tol", LAYOUTS)
def test_matches_fp64_unsharded_model(tp, world, dtype, tol):
    steps = 3
    ref, ref_params = _reference(steps)
    results = run_workers(_run, world, tp, dtype, steps, None, timeout=120)
    for rank, res in enumerate(results):
        for step, (got, want) in enumerate(zip(res["records"], ref), start=1):
            where = f"rank {rank} step {step}"
            assert got["ok"], where
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=tol), where
            # every element once: the tied embedding once, TP-replicated params once, DP shards
            assert set(got["norms"]) == set(want["norms"]), where
            for name, norm in want["norms"].items():
                assert got["norms"][name] == pytest.approx(norm, rel=tol, abs=tol * 1e-2), (where, name)
            # the unused position rows count once (64; a double count of the TP-replicated
            # position embedding or of a DP shard would give >= 128), the 32 key-bias
            # entries may or may not be 0, half precision may flush a few more
            slack = 0 if dtype == torch.float32 else 8
            assert want["zeros"] <= got["zeros"] <= want["near_zeros"] + slack, where
            if dtype == torch.float32:  # update norms: the full params' change, in float64
                snaps = [results[0]["initial"]] + results[0]["snapshots"]
                before, after = snaps[step - 1], snaps[step]
                assert set(got["updates"]) == set(want["norms"]), where
                for name, upd in got["updates"].items():
                    assert upd == pytest.approx(float((after[name] - before[name]).norm()),
                                                rel=1e-5, abs=1e-12), (where, name)
        assert res["steps_taken"] and set(res["steps_taken"]) == {steps}
    _assert_params_close(results[0]["snapshots"][-1], ref_params, ref, dtype)


def _assert_params_close(got_params, ref_params, ref, dtype):
    """fp32: every element to 1e-5. Half precision (fp16/bf16 forward and backward): AdamW
    moves an element by about lr per step whatever its gradient's size, so an element whose
    gradient is within rounding of 0 may step the other way: on average over each param the
    difference is under 5% of one step (fp16), and no element is off by more than 2 lr per step.
    Not compared: the key bias, whose exact gradient is 0 (AdamW steps it by rounding noise)."""
    steps = len(ref)
    for name, want in ref_params.items():
        got = got_params[name]
        if name in ref[0]["key_bias"]:
            keep = ~ref[0]["key_bias"][name]
            got, want = got[keep], want[keep]
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=name)
        else:
            diff = (got - want).abs()
            assert diff.max() <= 2 * LR * steps, (name, diff.max())
            if dtype == torch.float16:  # bf16's 8-bit mantissa: small grads are mostly noise
                assert diff.mean() < 0.05 * LR, (name, diff.mean())


def _assert_step_1_skipped_everywhere(results, steps):
    """Every rank's records: step 1 of 3 skipped with no norm or zero count, the scale halved
    after it (hysteresis 1: DynamicGradScaler, Megatron-LM), the per-parameter norms naming the
    culprit (non-finite) on every rank, and AdamW's step count short of that step."""
    scale0 = results[0]["records"][0]["scale"]
    for rank, res in enumerate(results):
        rec = res["records"]
        assert [r["ok"] for r in rec] == [True, False, True], rank
        assert rec[1]["grad_norm"] is None and rec[1]["zeros"] is None
        assert rec[1]["scale"] == scale0 and rec[2]["scale"] == scale0 / 2, rank
        top = next(iter(tpamp.param_norms.top_k(rec[1]["norms"], 1)))
        assert top == "blocks.1.mlp.fc1.weight", (rank, top)
        assert not math.isfinite(rec[1]["norms"][top]), rank
        assert set(res["steps_taken"]) == {steps - 1}, rank


@pytest.mark.parametrize("tp,world,inject_rank", [(1, 2, 1), (2, 4, 3)], ids=["dp2", "tp2xdp2"])
def test_inf_in_one_shard_skips_on_every_rank(tp, world, inject_rank):
    steps, bad = 3, 2
    ref, ref_params = _reference(steps, skip_steps=(bad,))
    results = run_workers(_run, world, tp, torch.float16, steps, (bad, inject_rank), timeout=120)
    _assert_step_1_skipped_everywhere(results, steps)
    for res in results:
        assert res["records"][2]["grad_norm"] == pytest.approx(ref[2]["grad_norm"], rel=2e-2)
    snaps = results[0]["snapshots"]
    for name in snaps[0]:  # nothing changed on the skipped step, bit for bit
        assert torch.equal(snaps[0][name], snaps[1][name]), name
    _assert_params_close(snaps[-1], ref_params, ref, torch.float16)


def _resume(rank, world, tp, ckpt_dir):
    from tpamp.checkpoint import load_checkpoint, save_checkpoint

    st, model, opt, tracker = _build(tp, torch.float16)
    for step in (1, 2):
        _train_step(st, model, opt, tracker, step)
    save_checkpoint(ckpt_dir, dict(model.named_parameters()), opt, extra={"iteration": 2})
    scale_at_save = opt.get_loss_scale().item()
    straight = [_train_step(st, model, opt, tracker, step) for step in (3, 4)]
    want = _full_params(model)
    # a fresh model (another init) and optimizer, loaded from the checkpoint
    st2, model2, opt2, tracker2 = _build(tp, torch.float16, seed=SEED + 7)
    got_extra = load_checkpoint(ckpt_dir, dict(model2.named_parameters()), opt2,
                                extra={"iteration": None})
    loaded_scale = opt2.get_loss_scale().item()
    resumed = [_train_step(st2, model2, opt2, tracker2, step) for step in (3, 4)]
    got = _full_params(model2)
    same = all(torch.equal(got[n], want[n]) for n in want)
    return dict(straight=straight, resumed=resumed, same=same, iteration=got_extra["iteration"],
                scale=(scale_at_save, loaded_scale),
                spikes=(opt.spike_detector.state_dict(), opt2.spike_detector.state_dict()))


@pytest.mark.parametrize("tp,world", [(1, 2), (2, 4)], ids=["dp2", "tp2xdp2"])
def test_dcp_resume_is_bit_identical(tp, world, tmp_path):
    results = run_workers(_resume, world, tp, str(tmp_path / "ckpt"), timeout=150)
    for rank, res in enumerate(results):
        assert res["iteration"] == 2
        assert res["scale"][0] == res["scale"][1], rank
        for a, b in zip(res["straight"], res["resumed"]):
            assert a == b, (rank, a, b)  # losses, grad norms, zeros, per-param norms, scale
        assert res["same"], f"rank {rank}: params after the resume differ"
        assert res["spikes"][0] == res["spikes"][1], rank


def _misuse(rank, world):
    from torch.distributed.fsdp import fully_shard

    from tpamp.parallel import initialize_model_parallel

    st = initialize_model_parallel(1, 1)
    errors = []
    model = GPTStage(GPTConfig(**CFG))
    try:  # the optimizer built before fully_shard: plain params
        tpamp.fsdp.fully_shard_optimizer(torch.optim.AdamW(model.parameters()), st.mesh["dp"])
    except TypeError as e:
        errors.append(str(e))
    half = GPTStage(GPTConfig(**CFG)).half()
    fully_shard(half, mesh=st.mesh["dp"])
    try:  # fp16 sharded params: no fp32 masters
        tpamp.fsdp.fully_shard_optimizer(torch.optim.AdamW(half.parameters()), st.mesh["dp"])
    except TypeError as e:
        errors.append(str(e))
    return errors


def _lr_per_dp_rank(rank, world):
    from torch.distributed.fsdp import fully_shard

    from tpamp.parallel import initialize_model_parallel

    mesh = initialize_model_parallel(1, 1).mesh["dp"]
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    fully_shard(model, mesh=mesh)
    before = [p.to_local().clone() for p in model.parameters()]
    opt = tpamp.fsdp.fully_shard_optimizer(
        torch.optim.SGD(model.parameters(), lr=(0.1, 0.2)[rank]), mesh)
    model(torch.ones(2, 8)).sum().backward()
    try:
        opt.step()
        err = None
    except ValueError as e:
        err = str(e)
    same = all(torch.equal(b, p.to_local()) for b, p in zip(before, model.parameters()))
    return {"err": err, "unchanged": same}


def test_an_lr_that_differs_across_the_dp_shards_is_refused_on_every_rank():
    """The DP ranks hold shards of the same params: an inner lr of 0.1 on one and 0.2 on the
    other would update the halves of one param differently. Both ranks refuse it at the first
    step, naming the setting and both values, with the params unchanged (before: both
    stepped)."""
    for res in run_workers(_lr_per_dp_rank, 2, timeout=30):
        assert res["err"] is not None and res["unchanged"], res
        assert "'lr'" in res["err"] and "0.1" in res["err"] and "0.2" in res["err"], res["err"]


def test_misuse_is_refused_with_a_clear_error():
    for errors in run_workers(_misuse, 2, timeout=30):
        assert len(errors) == 2
        assert "call fully_shard on the model before building the optimizer" in errors[0]
        assert "torch.float16" in errors[1] and "MixedPrecisionPolicy" in errors[1]
    with pytest.raises(ValueError, match="dtype must be one of"):
        tpamp.fsdp.mixed_precision_policy(torch.float64)
    plain = tpamp.FP32Optimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1))
    with pytest.raises(ValueError, match="built by tpamp.fsdp.fully_shard_optimizer"):
        tpamp.fsdp.track_param_grad_norms(plain, [("w", plain.param_groups[0]["params"][0])])


def _wrong_mesh(rank, world):
    """A model fully_shard'ed over a 1-D DP mesh of 4, given a (dp 2, tp 2) mesh: refused
    naming both meshes, nothing changed (the inner optimizer is not wrapped, params and grads
    keep their bytes); the right mesh is accepted afterwards."""
    from dist_utils import tensor_bytes
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tpamp._guards import wrapped_by

    dp4 = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    dp2tp2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    fully_shard(model, mesh=dp4)
    model(torch.ones(2, 8)).sum().backward()
    inner = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = [(tensor_bytes(p.to_local()), tensor_bytes(p.grad.to_local()))
              for p in model.parameters()]
    out = {}
    for name, mesh in (("2d", dp2tp2), ("dp-of-2d", dp2tp2["dp"])):
        try:
            tpamp.fsdp.fully_shard_optimizer(inner, mesh)
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    out["unchanged"] = wrapped_by(inner) is None and before == [
        (tensor_bytes(p.to_local()), tensor_bytes(p.grad.to_local())) for p in model.parameters()]
    try:  # FSDP2's sharded fp32 params are their own masters: no remainder to keep
        tpamp.fsdp.fully_shard_optimizer(inner, dp4, store_param_remainders=True)
        out["remainders"] = None
    except ValueError as e:
        out["remainders"] = str(e)
    opt = tpamp.fsdp.fully_shard_optimizer(inner, dp4)  # the mesh it was sharded on
    out["accepted"] = opt.step().update_successful
    return out


def test_a_mesh_other_than_the_models_is_refused_naming_both():
    for rank, out in enumerate(run_workers(_wrong_mesh, 4, timeout=60)):
        for key in ("2d", "dp-of-2d"):
            msg = out[key]
            assert msg is not None, (rank, key)
            assert "was sharded on DeviceMesh(dims ('dp',), sizes (4,), ranks [0, 1, 2, 3]" in msg
            assert "pass the mesh the model was fully_shard'ed" in msg
        dp_ranks = [0, 2] if rank % 2 == 0 else [1, 3]
        assert "dims ('dp', 'tp'), sizes (2, 2), ranks [[0, 1], [2, 3]]" in out["2d"]
        assert f"DP sub-mesh DeviceMesh(dims ('dp',), sizes (2,), ranks {dp_ranks}" in out["2d"]
        assert f"given DeviceMesh(dims ('dp',), sizes (2,), ranks {dp_ranks}" in out["dp-of-2d"]
        assert out["unchanged"] and out["accepted"], rank
        assert "no trainable bf16 param" in out["remainders"], rank
        assert "FSDP2's sharded fp32 params" in out["remainders"], rank


# ----------------------------------------------------------------------------- FSDP2 x PP

M_PP = 2  # microbatches per step of the pipeline tests (one row each on DP 2)


def _build_pp(tp: int, dtype, device=torch.device("cpu")):
    """PP 2 x DP 2 (x TP ``tp``): this rank's stage of the GPT (block 0 on stage 0, block 1 and
    the tied head copy on stage 1, the copy broadcast from the embedding), TP on mesh["tp"],
    fully_shard on mesh["dp"], fully_shard_optimizer on the whole (pp, dp, tp) mesh, and a
    GPipe schedule (torch.distributed.pipelining) over the stage."""
    from torch.distributed.pipelining import ScheduleGPipe

    from tpamp.parallel import initialize_model_parallel
    from tpamp.pipelining import NoSyncPipelineStage, PipelineLoss

    st = initialize_model_parallel(tp, 2)
    model = GPTStage(GPTConfig(**CFG), 2, st.pp_rank)
    model.init_weights(SEED)
    tied = model.word_embedding_weight()
    with torch.no_grad():  # the head copy starts as the embedding
        torch.distributed.broadcast(tied, src=st.pp_ranks[0], group=st.embedding_group)
    _tp_then_fully_shard(model, st, tp, dtype)
    if model.is_last:
        model.head_weight.shared = True  # fully_shard made a new param: counted on stage 0
    groups = [
        {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": WD},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]
    scaler = None
    if dtype == torch.float16:
        scaler = tpamp.DynamicGradScaler(initial_scale=2.0**10, hysteresis=1)
    opt = tpamp.fsdp.fully_shard_optimizer(
        torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.999), eps=1e-8), st.mesh,
        grad_scaler=scaler, clip_grad=CLIP, log_num_zeros_in_grad=True,
    )
    tracker = tpamp.fsdp.track_param_grad_norms(opt, model.global_named_parameters())
    mb = BATCH // st.dims.dp // M_PP
    if model.is_first:
        example_in = torch.zeros(mb, T, dtype=torch.long)
    else:
        example_in = torch.empty(mb, T, CFG["hidden_size"], dtype=dtype, requires_grad=True)
    out_shape = (mb, T, CFG["vocab_size"] // tp) if model.is_last else (mb, T, CFG["hidden_size"])
    example_out = torch.empty(out_shape, dtype=dtype, requires_grad=True)
    stage = NoSyncPipelineStage(model, st.pp_rank, 2, device, input_args=(example_in,),
                                output_args=(example_out,), group=st.pp_group)
    loss = PipelineLoss(
        lambda logits, y: tpamp.vocab_parallel_cross_entropy(logits, y, st.tp_group).float().mean(),
        M_PP, opt)
    schedule = ScheduleGPipe(stage, n_microbatches=M_PP, loss_fn=loss, scale_grads=False)
    return st, model, opt, tracker, schedule, loss


def _pp_step(st, model, opt, tracker, schedule, loss_fn, step, inject=None):
    from tpamp.common import local_tensor

    x, y = _batch(step)
    per_dp = BATCH // st.dims.dp
    x, y = x[st.dp_rank * per_dp:][:per_dp], y[st.dp_rank * per_dp:][:per_dp]
    losses = [] if model.is_last else None
    scale = opt.get_loss_scale().clone()
    schedule.step(*((x,) if model.is_first else ()), target=y if model.is_last else None,
                  losses=losses)
    tied = model.word_embedding_weight()  # the embedding's and the head copy's grads summed
    grad = local_tensor(tied.grad)          # on the local shards (same DP x TP placements)
    torch.distributed.all_reduce(grad, group=st.embedding_group)
    if inject is not None and (st.pp_rank, st.dp_rank, st.tp_rank) == inject:
        # one element of this rank's own shard of stage 1's block (global blocks.1)
        model.blocks[0].mlp.fc1.weight.grad.to_local().view(-1)[0] = math.inf
    result = opt.step(param_grad_norms=True)
    opt.zero_grad()
    loss = None
    if model.is_last:  # this DP rank's mean over its microbatches, then the mean over DP
        mean = torch.stack(loss_fn.unscale(losses, scale)).mean()
        torch.distributed.all_reduce(mean, group=st.dp_group)
        loss = mean.item() / st.dims.dp
    return dict(ok=result.update_successful, grad_norm=result.grad_norm,
                zeros=result.num_zeros_in_grad, norms=dict(tracker.norms), loss=loss,
                scale=scale.item())


def _run_pp(rank, world, tp, dtype, steps, inject):
    st, model, opt, tracker, schedule, loss_fn = _build_pp(tp, dtype)
    records, snapshots = [], []
    for step in range(1, steps + 1):
        records.append(_pp_step(st, model, opt, tracker, schedule, loss_fn, step,
                                inject=inject[1] if inject and step == inject[0] else None))
        snapshots.append({n: p.full_tensor().detach().double().clone()
                          for n, p in model.global_named_parameters()})
    steps_taken = [int(s["step"]) for s in opt.optimizer.state.values()]
    return dict(records=records, snapshots=snapshots, steps_taken=steps_taken,
                pp_rank=st.pp_rank)


def _merged(results, i):
    """The whole model's params after step i + 1 from both stages; the head copy apart."""
    params, head = {}, None
    for res in results:
        snap = dict(res["snapshots"][i])
        head = snap.pop("head_weight", head)
        params.update(snap)
    return params, head


PP_LAYOUTS = [pytest.param(1, 4, id="pp2xdp2"), pytest.param(2, 8, id="pp2xdp2xtp2")]


@pytest.mark.parametrize("tp,world", PP_LAYOUTS)
def test_pp_mesh_matches_fp64_unsharded_model(tp, world):
    """fp32 on the (pp 2, dp 2, tp) mesh: every rank of both stages reports the unsharded
    model's grad norm, zero count (each element once: DP shards, TP shards, TP-replicated
    params on TP rank 0, the tied copy not at all) and per-parameter norms of both stages; the
    last stage's DP-mean loss is the reference's; the params of both stages after 3 steps are
    the reference's and the tied copy stays equal to the embedding."""
    steps = 3
    ref, ref_params = _reference(steps)
    results = run_workers(_run_pp, world, tp, torch.float32, steps, None, timeout=150)
    for rank, res in enumerate(results):
        for step, (got, want) in enumerate(zip(res["records"], ref), start=1):
            where = f"rank {rank} step {step}"
            assert got["ok"], where
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), where
            assert set(got["norms"]) == set(want["norms"]), where
            for name, norm in want["norms"].items():
                assert got["norms"][name] == pytest.approx(norm, rel=1e-5, abs=1e-7), (where, name)
            assert want["zeros"] <= got["zeros"] <= want["near_zeros"], where
            if got["loss"] is not None:
                assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), where
        assert res["steps_taken"] and set(res["steps_taken"]) == {steps}
    params, head = _merged(results, -1)
    assert set(params) == set(ref_params)
    _assert_params_close(params, ref_params, ref, torch.float32)
    torch.testing.assert_close(head, params["wte.weight"], rtol=0, atol=0)


def test_inf_in_one_stage_shard_skips_on_every_rank_of_the_pipeline():
    """fp16, PP 2 x DP 2: an inf in the shard of stage 1, DP rank 1 skips step 2 on all four
    ranks (both stages): nothing changed, the scale halved, the culprit named everywhere."""
    steps, bad = 3, 2
    results = run_workers(_run_pp, 4, 1, torch.float16, steps, (bad, (1, 1, 0)), timeout=150)
    _assert_step_1_skipped_everywhere(results, steps)
    for rank, res in enumerate(results):
        snaps = res["snapshots"]
        for name in snaps[0]:  # nothing changed on the skipped step, bit for bit
            assert torch.equal(snaps[0][name], snaps[1][name]), (rank, name)
    assert {res["pp_rank"] for res in results} == {0, 1}


def _pp_mesh_checks(rank, world):
    """The (pp, dp) mesh without a TP dim is accepted; the stage's params given with a mesh
    whose DP dim is not theirs are refused, naming the stage's sub-mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    fully_shard(model, mesh=mesh["dp"])
    out = {}
    opt = tpamp.fsdp.fully_shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), mesh)
    model(torch.ones(2, 4)).sum().backward()
    out["group_size"] = torch.distributed.get_world_size(opt.grad_stats_group)
    out["ok"] = opt.step().update_successful
    swapped = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    try:
        tpamp.fsdp.fully_shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), swapped)
        out["swapped"] = None
    except ValueError as e:
        out["swapped"] = str(e)
    try:
        tpamp.fsdp.fully_shard_optimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp")))
        out["no_dp"] = None
    except ValueError as e:
        out["no_dp"] = str(e)
    return out


def test_pp_mesh_is_accepted_and_a_mismatched_one_refused():
    for rank, out in enumerate(run_workers(_pp_mesh_checks, 4, timeout=60)):
        assert out["ok"] and out["group_size"] == 4, rank
        assert "this stage's sub-mesh DeviceMesh(dims ('dp',)" in out["swapped"], rank
        assert "expected exactly one DP dim" in out["no_dp"], rank


# ----------------------------------------------------------------------------- the main job

FSDP2_TP2_DP2 = ["--use-torch-fsdp2", "--tensor-model-parallel-size", "2",
                 "--pipeline-model-parallel-size", "1"]


def test_main_job_fsdp2_tp2_dp2_trains_logs_and_resumes_bit_identically(tmp_path):
    """scripts/train_gpt.py --use-torch-fsdp2 on TP 2 x DP 2 (4 ranks, fp16): the log's fields,
    a falling loss, per-parameter norms (global names) whose root-sum-square is the logged grad
    norm, and a resume from the DCP checkpoint of iteration 4 that repeats iterations 5-8."""
    from test_train_gpt import ITERS, assert_loss_falls, check_records, run_train

    run = tmp_path / "run"
    records, summary, stdout = run_train(
        run, *FSDP2_TP2_DP2, "--log-num-zeros-in-grad", "--log-param-grad-norms", "100",
        "--save", str(tmp_path / "ckpt"), "--save-interval", "4",
    )
    check_records(records, loss_scaling=True)
    assert_loss_falls(records)
    assert (summary["tp"], summary["pp"], summary["dp"]) == (2, 1, 2)
    assert summary["torch_fsdp2"] is True and "(FSDP2 fully_shard)" in stdout
    logged = [r for r in records if "param_grad_norms" in r]
    assert len(logged) == ITERS // 2
    for r in logged:
        norms = r["param_grad_norms"]
        assert "blocks.1.mlp.fc1.weight" in norms and "wte.weight" in norms
        assert len(norms) == 2 + 12 * 2 + 2  # wte, wpe, 12 per block, ln_f: each once
        assert math.sqrt(sum(v * v for v in norms.values())) == pytest.approx(
            r["grad_norm"], rel=1e-5)
    resumed, _, _ = run_train(tmp_path / "resumed", *FSDP2_TP2_DP2, "--log-param-grad-norms",
                              "100", "--load", str(tmp_path / "ckpt"), "--ckpt-step", "4")
    assert [r["iteration"] for r in resumed] == list(range(5, ITERS + 1))
    for a, b in zip(records[4:], resumed):
        for key in ("loss", "grad_norm", "loss_scale", "skipped", "param_grad_norms"):
            assert a.get(key) == b.get(key), (key, a, b)


def test_main_job_fsdp2_fp32_equals_the_default_data_parallel_path(tmp_path):
    """In fp32, FSDP2 (grads reduce-scattered by fully_shard, sharded AdamW on the DTensor
    params) and the default path (grads all-reduced over DP, MixedPrecisionOptimizer) train
    the same model on the same batches: the same losses and global grad norms."""
    from test_train_gpt import run_train

    fsdp, summary, _ = run_train(tmp_path / "fsdp2", "--fp32", *FSDP2_TP2_DP2)
    assert summary["dtype"] == "float32" and summary["torch_fsdp2"] is True
    plain, summary, _ = run_train(tmp_path / "plain", "--fp32", *FSDP2_TP2_DP2[1:])
    assert (summary["tp"], summary["pp"], summary["dp"]) == (2, 1, 2)
    for a, b in zip(fsdp, plain):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-5), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), (a, b)
