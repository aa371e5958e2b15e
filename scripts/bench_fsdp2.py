"""Benchmark the FSDP2 path (tpamp.fsdp) against tpamp.DistributedOptimizer at DP 2.

A benchmark, not a test. Run with torchrun on one machine (gloo, one thread per rank)::

    torchrun --nproc-per-node 2 scripts/bench_fsdp2.py                 # the main job's GPT
    torchrun --nproc-per-node 2 scripts/bench_fsdp2.py --reps 5 --json out.json

Both approaches train the main job's GPT (scripts/gpt_model.py, default 4 layers, hidden 256,
3.26M params; no TP) in fp16 with a DynamicGradScaler, clip_grad 1.0, AdamW, the zero count:

  fsdp2  fully_shard (each block, then the root) on the 2-rank DP mesh with
         MixedPrecisionPolicy(param_dtype=fp16, reduce_dtype=fp32), tpamp.fsdp.fully_shard_optimizer
         (FP32Optimizer on the sharded fp32 DTensor params): the grads are reduce-scattered in
         backward; the step updates the local shard.
  dist   an fp16 model, tpamp.DistributedOptimizer over the 2 ranks (Megatron's ZeRO-1: fp32
         main params and AdamW state sharded, fp32 grad buffers, reduce-scatter and all-gather
         in step()).

1. Bytes per parameter on one rank, after a step (before zero_grad): every distinct storage
   reachable from the model params, their grads / main_grad buffers, the inner optimizer's
   params and state, divided by the model's parameter count. Transient buffers (FSDP2's
   all-gathered fp16 params during forward and backward, activations) are not counted.
2. Step time: one training iteration (forward, scaled backward, grad reduction, optimizer
   step, zero_grad) on ``--micro-batch-size`` x ``--seq-length`` tokens per rank, the two
   approaches interleaved round-robin over ``--reps`` rounds after ``--warmup``; rank 0
   reports the medians and the paired median ratio fsdp2 / dist.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # gpt_model
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tpamp
from gpt_model import GPTConfig, GPTStage, count_params  # noqa: E402

import tpamp  # noqa: E402
from tpamp.grad_stats import local_tensor  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def build(kind, cfg, dp_mesh):
    model = GPTStage(cfg)
    model.init_weights(1)
    adamw_kw = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    kw = dict(grad_scaler=tpamp.DynamicGradScaler(initial_scale=2.0**12), clip_grad=1.0,
              log_num_zeros_in_grad=True)
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        policy = tpamp.fsdp.mixed_precision_policy(torch.float16)
        for block in model.blocks:
            fully_shard(block, mesh=dp_mesh, mp_policy=policy)
        fully_shard(model, mesh=dp_mesh, mp_policy=policy)
        opt = tpamp.fsdp.fully_shard_optimizer(
            torch.optim.AdamW(model.parameters(), **adamw_kw), dp_mesh, **kw)
    else:
        model.cast_(torch.float16)
        opt = tpamp.DistributedOptimizer(
            torch.optim.AdamW(model.parameters(), **adamw_kw),
            data_parallel_group=dist.group.WORLD, grad_stats_group=dist.group.WORLD, **kw)
    return model, opt


def iteration(model, opt, x, y):
    logits = model(x)
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
    opt.scale_loss(loss).backward()
    result = opt.step()
    return result


def state_bytes(model, opt) -> dict:
    """Distinct storages on this rank by role (bytes): params, grads, fp32 main + state."""
    seen, out = set(), {"params": 0, "grads": 0, "main_and_state": 0}

    def add(role, t):
        if t is None or not torch.is_tensor(t):
            return
        s = local_tensor(t).untyped_storage()
        if s.data_ptr() in seen or s.nbytes() == 0:
            return
        seen.add(s.data_ptr())
        out[role] += s.nbytes()

    for p in model.parameters():
        add("params", p)
    for p in model.parameters():
        add("grads", p.grad)
        add("grads", getattr(p, "main_grad", None))
    inner = opt.optimizer
    for g in inner.param_groups:
        for p in g["params"]:
            add("main_and_state", p)
            add("grads", p.grad)
    for st in inner.state.values():
        for v in st.values():
            if torch.is_tensor(v) and v.dim() > 0:
                add("main_and_state", v)
    return out


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh

    dp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    cfg = GPTConfig(seq_length=args.seq_length, hidden_size=args.hidden_size,
                    num_layers=args.num_layers, num_attention_heads=args.num_attention_heads)
    n_params = count_params(cfg)
    runs = {kind: build(kind, cfg, dp_mesh) for kind in ("fsdp2", "dist")}
    gen = torch.Generator().manual_seed(100 + rank)

    def batch():
        x = torch.randint(256, (args.micro_batch_size, args.seq_length), generator=gen)
        return x, torch.randint(256, (args.micro_batch_size, args.seq_length), generator=gen)

    mem = {}
    for kind, (model, opt) in runs.items():
        assert iteration(model, opt, *batch()).update_successful
        mem[kind] = {k: v / n_params for k, v in state_bytes(model, opt).items()}
        mem[kind]["total"] = sum(mem[kind].values())
        opt.zero_grad()
    times = {kind: [] for kind in runs}
    for r in range(args.warmup + args.reps):
        for kind, (model, opt) in runs.items():
            x, y = batch()
            dist.barrier()
            t0 = time.perf_counter()
            iteration(model, opt, x, y)
            opt.zero_grad()
            dist.barrier()
            if r >= args.warmup:
                times[kind].append(time.perf_counter() - t0)
    if rank == 0:
        ratios = [a / b for a, b in zip(times["fsdp2"], times["dist"])]
        result = {
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "torch": torch.__version__, "dp": world, "params": n_params,
            "tokens_per_rank": args.micro_batch_size * args.seq_length,
            "bytes_per_param": mem,
            "median_s": {k: statistics.median(v) for k, v in times.items()},
            "paired_median_ratio_fsdp2_over_dist": statistics.median(ratios),
            "reps": args.reps,
        }
        print(json.dumps(result, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
