"""Time tpamp.TensorParallelMuon's step per --muon-tp-mode at TP 2 and 4, paired; state bytes.

A benchmark, not a test. For each TP size it starts that many gloo ranks (CPU; NCCL and one GPU
per rank with ``--device cuda``), each holding the Megatron-attribute shards of one transformer
layer's four matrices (hidden H: QKV [3H, H] and fc1 [4H, H] column-parallel, proj [H, H] and
fc2 [H, 4H] row-parallel), fp32 params with random grads. Three optimizers (tp_mode duplicated,
distributed, blockwise; same data) step in a rotating order each round, so that drift of the
machine hits every mode alike; a step's time is the slowest rank's (barrier before and after).
It prints per mode the median step time, the paired median ratio to "duplicated", and the
optimizer state bytes per param element (local state bytes / local param elements: Muon keeps
one fp32 momentum buffer, sharded), and the unsharded torch.optim.Muon step of the same four
matrices on one rank as the baseline.

Run from the repository root::

    python scripts/bench_muon.py --hidden 512 --rounds 10 --tp 2 4

Quote the numbers with the machine, the torch version, the date and the load average
(docs/benchmarks.md); a busy machine makes the rounds disagree.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tpamp  # noqa: E402

MODES = ("duplicated", "distributed", "blockwise")


def _matrices(h: int):
    """(name, global shape, split dim) of one layer's matrices."""
    return [("qkv", (3 * h, h), 0), ("fc1", (4 * h, h), 0), ("proj", (h, h), 1),
            ("fc2", (h, 4 * h), 1)]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _rank(rank, world, port, args, queue):
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(args.threads)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    g = torch.Generator().manual_seed(0)
    opts = {}
    for mode in MODES:
        params = []
        for _, shape, dim in _matrices(args.hidden):
            full = torch.randn(*shape, generator=g)
            grad = torch.randn(*shape, generator=g)
            p = torch.nn.Parameter(full.chunk(world, dim=dim)[rank].clone().to(device))
            p.grad = grad.chunk(world, dim=dim)[rank].clone().to(device)
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1
            params.append(p)
        opts[mode] = tpamp.TensorParallelMuon(params, lr=1e-3, tp_mode=mode,
                                              tensor_parallel_group=dist.group.WORLD)
    times = {m: [] for m in MODES}
    for r in range(args.warmup + args.rounds):
        order = MODES[r % 3:] + MODES[:r % 3]
        for mode in order:
            dist.barrier()
            _sync(device)
            t0 = time.perf_counter()
            opts[mode].step()
            _sync(device)
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if r >= args.warmup:
                times[mode].append(float(dt))
    state = {}
    for mode, opt in opts.items():
        nbytes = sum(t.numel() * t.element_size() for s in opt.state.values()
                     for t in s.values() if isinstance(t, torch.Tensor))
        numel = sum(p.numel() for grp in opt.param_groups for p in grp["params"])
        state[mode] = nbytes / numel
    if rank == 0:
        queue.put((times, state))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _unsharded(args) -> float:
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    params = []
    for _, shape, _ in _matrices(args.hidden):
        p = torch.nn.Parameter(torch.randn(*shape, generator=g))
        p.grad = torch.randn(*shape, generator=g)
        params.append(p)
    opt = torch.optim.Muon(params, lr=1e-3)
    out = []
    for r in range(args.warmup + args.rounds):
        t0 = time.perf_counter()
        opt.step()
        if r >= args.warmup:
            out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (CPU)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    ctx = mp.get_context("spawn")
    results = {"hidden": args.hidden, "unsharded_torch_muon_s": None, "tp": {}}
    if args.device == "cpu":
        results["unsharded_torch_muon_s"] = _unsharded(args)
        print(f"unsharded torch.optim.Muon, 1 rank: {results['unsharded_torch_muon_s'] * 1e3:.2f} ms")
    for tp in args.tp:
        queue = ctx.SimpleQueue()
        port = _free_port()
        procs = [ctx.Process(target=_rank, args=(r, tp, port, args, queue)) for r in range(tp)]
        for proc in procs:
            proc.start()
        times, state = queue.get()
        for proc in procs:
            proc.join()
        base = times["duplicated"]
        row = {}
        for mode in MODES:
            ratio = statistics.median(t / b for t, b in zip(times[mode], base))
            row[mode] = {"median_s": statistics.median(times[mode]), "ratio_to_duplicated": ratio,
                         "state_bytes_per_param": state[mode]}
            print(f"TP {tp} {mode:11s}: {row[mode]['median_s'] * 1e3:8.2f} ms  "
                  f"x{ratio:.2f} of duplicated (paired median)  "
                  f"state {state[mode]:.1f} B/param")
        results["tp"][tp] = row
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
