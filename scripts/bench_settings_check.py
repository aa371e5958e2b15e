"""The cross-rank settings check's time on the main job's first step (docs/spec.md section 2.4).

Runs scripts/train_gpt.py with every flag given here, timing ``tpamp._guards.agree_on_settings``
(the check ``step()`` runs on the first step and after a load). Every rank prints, for that
first call (after a barrier, so the ranks start it together): its time; with
``MEASURE_REPS=N``, the median and minimum of N further calls (each after a barrier: the same
all-gather again, nothing else); and, where the tree has it, the time of the peer payload
(the inner optimizer's hyperparameters and the params' layout, tpamp/_peer_settings.py). Run it
with ``PYTHONPATH`` set to the tree to measure (a checkout of another revision gives the
baseline)::

    MEASURE_REPS=200 PYTHONPATH=$PWD OMP_NUM_THREADS=1 python -m torch.distributed.run \\
        --nproc-per-node 4 scripts/bench_settings_check.py --train-iters 2 \\
        --eval-interval 100 --eval-iters 1 --no-progress
"""

import os
import runpy
import sys
import time

import torch.distributed as dist

import tpamp
import tpamp._guards as guards

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(tpamp.__file__)))
_CHECK = guards.agree_on_settings
_TIMES = []


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.3f} ms"


def _timed(wrapper) -> None:
    dist.barrier()  # the ranks start the check together: its time, not the peers' skew
    t0 = time.perf_counter()
    _CHECK(wrapper)
    _TIMES.append(time.perf_counter() - t0)
    if len(_TIMES) != 1:
        return
    rank = os.environ.get("RANK", "0")
    line = f"rank {rank}: first check {_ms(_TIMES[0])}"
    reps = []
    for _ in range(int(os.environ.get("MEASURE_REPS", "0"))):
        dist.barrier()
        t0 = time.perf_counter()
        _CHECK(wrapper)
        reps.append(time.perf_counter() - t0)
    if reps:
        reps.sort()
        line += f"; x{len(reps)} median {_ms(reps[len(reps) // 2])}, min {_ms(reps[0])}"
    try:
        from tpamp import _peer_settings
    except ImportError:  # a tree without the peer comparison
        _peer_settings = None
    if _peer_settings is not None:
        t0 = time.perf_counter()
        for _ in range(20):
            _peer_settings.payload(wrapper)
        line += f"; peer payload {_ms((time.perf_counter() - t0) / 20)}"
    print(line, flush=True)


guards.agree_on_settings = _timed
sys.argv = [os.path.join(ROOT, "scripts", "train_gpt.py")] + sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
