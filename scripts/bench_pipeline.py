"""Peak activation memory and step time per pipeline stage: GPipe vs 1F1B vs Interleaved1F1B.

Run (CPU, gloo; one rank per stage)::

    torchrun --nproc-per-node 2 scripts/bench_pipeline.py
    torchrun --nproc-per-node 4 scripts/bench_pipeline.py --microbatches 8

Each rank builds its stage of the GPT of scripts/gpt_model.py (fp32, TP 1; with
Interleaved1F1B two model chunks per rank) and runs forward + backward steps of one global
batch of ``--microbatches`` microbatches under each schedule of ``torch.distributed.pipelining``
with tpamp.pipelining's stage and loss. Activation memory is what autograd saves for backward:
every tensor packed by ``torch.autograd.graph.saved_tensors_hooks`` counts its bytes until
autograd releases it, and the peak of that sum during a step is reported (on CUDA also
``torch.cuda.max_memory_allocated`` minus the memory before the step). Step time is the median
over ``--steps`` steps after one warm-up step. Rank 0 prints one row per schedule and stage.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
import weakref

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from gpt_model import GPTChunks, GPTConfig, GPTStage  # noqa: E402
from torch.distributed.pipelining.schedules import get_schedule_class  # noqa: E402

from tpamp.pipelining import NoSyncPipelineStage, PipelineLoss  # noqa: E402

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")


class _Box:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


class SavedBytes:
    """Bytes of the tensors autograd holds for backward, and their peak."""

    def __init__(self):
        self.live = self.peak = 0

    def _release(self, n):
        self.live -= n

    def pack(self, t):
        n = t.numel() * t.element_size()
        self.live += n
        self.peak = max(self.peak, self.live)
        box = _Box(t)
        weakref.finalize(box, self._release, n)
        return box

    @staticmethod
    def unpack(box):
        return box.t


def build(name, args, rank, pp, device):
    cfg = GPTConfig(seq_length=args.seq_length, hidden_size=args.hidden_size,
                    num_layers=args.num_layers, num_attention_heads=args.num_attention_heads)
    virtual = 2 if name == "Interleaved1F1B" else 1
    model = GPTChunks(cfg, pp, rank, virtual) if virtual > 1 else GPTStage(cfg, pp, rank)
    model.init_weights(1234)
    model.to(device)
    chunks = model.chunks if virtual > 1 else [model]
    mb, t, h = args.micro_batch_size, args.seq_length, args.hidden_size
    stages = []
    for c, chunk in enumerate(chunks):
        x = (torch.zeros(mb, t, dtype=torch.long, device=device) if chunk.is_first
             else torch.empty(mb, t, h, device=device, requires_grad=True))
        y = torch.empty(mb, t, cfg.vocab_size if chunk.is_last else h, device=device,
                        requires_grad=True)
        stages.append(NoSyncPipelineStage(chunk, c * pp + rank, pp * virtual, device,
                                          input_args=(x,), output_args=(y,)))

    def lm_loss(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    loss = PipelineLoss(lm_loss, args.microbatches)
    cls = get_schedule_class(name)
    schedule = cls(stages if virtual > 1 else stages[0], n_microbatches=args.microbatches,
                   loss_fn=loss, scale_grads=False)
    return model, schedule


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    args = p.parse_args()
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=300))
    rank, pp = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    n = args.micro_batch_size * args.microbatches
    x = torch.randint(256, (n, args.seq_length), generator=gen).to(device)
    y = torch.randint(256, (n, args.seq_length), generator=gen).to(device)
    rows = []
    for name in args.schedules:
        if name == "Interleaved1F1B" and args.num_layers % (2 * pp):
            continue
        model, schedule = build(name, args, rank, pp, device)
        times, peaks, cuda_peaks = [], [], []
        for step in range(args.steps + 1):
            saved = SavedBytes()
            if use_cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            dist.barrier()
            t0 = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
                inputs = (x,) if rank == 0 else ()
                last = rank == pp - 1
                schedule.step(*inputs, target=y if last else None, return_outputs=False)
            if use_cuda:
                torch.cuda.synchronize()
                cuda_peaks.append(torch.cuda.max_memory_allocated() - base)
            dt = time.perf_counter() - t0
            for prm in model.parameters():
                prm.grad = None
            if step:  # the first step warms up
                times.append(dt)
                peaks.append(saved.peak)
        rows.append((name, rank, max(peaks), statistics.median(times),
                     max(cuda_peaks) if cuda_peaks else None))
        del model, schedule
    everything = [None] * pp
    dist.all_gather_object(everything, rows)
    if rank == 0:
        print(f"PP {pp}, {args.microbatches} microbatches of {args.micro_batch_size} x "
              f"{args.seq_length} tokens, {args.num_layers} layers, hidden {args.hidden_size}, "
              f"fp32, {device.type}")
        print(f"{'schedule':>16} {'stage':>5} {'peak saved MiB':>15} {'step ms':>9}"
              + (f" {'cuda peak MiB':>14}" if use_cuda else ""))
        for name in args.schedules:
            for r in range(pp):
                for n_, rk, peak, t, cp in everything[r]:
                    if n_ == name:
                        print(f"{name:>16} {rk:>5} {peak / 2**20:>15.1f} {1000 * t:>9.1f}"
                              + (f" {cp / 2**20:>14.1f}" if cp is not None else ""))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
