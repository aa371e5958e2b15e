"""Multi-process test harness: fork-started gloo ranks with short timeouts.

Each worker reports its own exception (with traceback) through a queue, so the failure shown is
the rank that failed first, not a peer's "connection closed".

Also the byte-exact pictures of state that the guard tests compare before and after a refusal
(tensor_bytes, freeze), and whether the fused-step kernels are built (fused_step_built).
"""

from __future__ import annotations

import datetime
import math
import os
import pickle
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def fused_step_built() -> bool:
    """Whether the extension's CPU fused optimizer-step kernels are built and load."""
    from tpamp import ops

    return ops._step_kernels(torch.device("cpu"), "fused_adam_step_") is not None


def tensor_bytes(t: torch.Tensor):
    """(dtype, shape, raw bytes) of a tensor: equal only for bit-identical tensors (NaNs too)."""
    if t.device.type == "meta":
        return ("meta", str(t.dtype), tuple(t.shape))
    t = t.detach().cpu().contiguous()
    return (str(t.dtype), tuple(t.shape), bytes(t.reshape(-1).view(torch.uint8).numpy()))


def freeze(x):
    """Nested containers with tensors -> comparable values (tensors by their bytes, NaN floats
    as "nan"), copied now: a later in-place change of a live tensor does not reach it."""
    if isinstance(x, torch.Tensor):
        return tensor_bytes(x)
    if isinstance(x, dict):
        return tuple(sorted((repr(k), freeze(v)) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return tuple(freeze(v) for v in x)
    if isinstance(x, float) and math.isnan(x):
        return "nan"
    return x


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue, timeout):
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        result = fn(rank, world_size, *args)
        # plain pickle: tensors by value. The queue's own pickler would pass tensor storage as
        # a file descriptor that the parent fetches from this process after os._exit below:
        # "Connection reset by peer" whenever the parent is slower than the exit.
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException as e:  # report every rank's own failure
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
        os._exit(0)


def run_workers(fn, world_size: int, *args, timeout: float = 30.0):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fork-started gloo ranks.

    Returns the list of per-rank return values (must be picklable). Raises AssertionError with
    the first failing rank's own traceback (errors from the rank that failed first are listed
    before peers' follow-on errors such as connection closed).
    """
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, timeout), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results, errors = {}, []
    deadline = timeout * 2 + 10
    import time

    start = time.monotonic()
    got = 0
    while got < world_size:
        if time.monotonic() - start > deadline:
            for p in procs:
                p.kill()
            raise AssertionError(f"workers did not finish within {deadline:.0f}s; got {got}/{world_size}")
        if queue.empty():
            if not any(p.is_alive() for p in procs) and queue.empty():
                break
            time.sleep(0.005)
            continue
        rank, status, payload = queue.get()
        got += 1
        if status == "ok":
            results[rank] = pickle.loads(payload)
        else:
            errors.append((rank, payload))
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    if errors:
        first_rank, first = errors[0]
        others = "".join(f"\n--- rank {r} ---\n{e}" for r, e in errors[1:])
        raise AssertionError(f"rank {first_rank} failed:\n{first}{others}")
    if len(results) != world_size:
        raise AssertionError(f"only ranks {sorted(results)} reported; {world_size} expected")
    return [results[r] for r in range(world_size)]
