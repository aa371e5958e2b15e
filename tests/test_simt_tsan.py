"""ThreadSanitizer over the emulated CUDA launchers (tpamp._C_simt_thread: built with
TPAMP_BUILD_SIMT=1 TPAMP_SIMT_SANITIZE=thread), in subprocesses with libtsan preloaded (python
itself is not instrumented):

* every launcher, on small inputs under two schedule orders: no race reported;
* the block reduction missing its closing barrier (csrc/simt/mutants.cu): a data race reported,
  naming the mutant's lines, in forward order too, where its result happens to be right.

ThreadSanitizer runs ~20x slower than the plain emulator, so inputs stay small (a few blocks).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import simt_utils

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _built() -> bool:
    import importlib.util

    return importlib.util.find_spec("tpamp._C_simt_thread") is not None


pytestmark = pytest.mark.skipif(
    not _built() and not simt_utils.REQUIRED,
    reason="tpamp._C_simt_thread is not built (TPAMP_BUILD_SIMT=1 TPAMP_SIMT_SANITIZE=thread)",
)

LAUNCHERS = r"""
import math, torch
from tpamp import _ext
S = _ext.load_simt("thread")
g = torch.Generator().manual_seed(0)
def r(n, dt=torch.float32, off=0):
    return torch.randn(n + off, generator=g).to(dt)[off:]
sizes = [0, 3, 600, 65537, 9]
dts = [torch.float32, torch.float16, torch.bfloat16]
grads = [r(n, dts[i % 3], i % 2) for i, n in enumerate(sizes)]
scale = torch.tensor([0.5])
S.grad_stats_([t.clone() for t in grads], scale, [True] * 5, True, True)
S.grad_stats_out(grads, None, [True, False] * 2 + [True], True, True,
                 out=[torch.empty(t.shape) for t in grads])
S.scale_([t.clone() for t in grads], torch.tensor([2.0]))
S.scale_and_copy(grads, [torch.empty(t.shape, dtype=torch.bfloat16) for t in grads], scale)
S.dynamic_scaler_update_(torch.tensor([4.0]), torch.zeros(1, dtype=torch.int32),
                         torch.ones(1, dtype=torch.int32), torch.zeros(1), 2.0, 0.5, 2, 1, 1.0,
                         math.inf, False)
ps = [r(n) for n in sizes]
S.fused_adam_step_(ps, [torch.zeros(p.shape) for p in ps], [torch.zeros(p.shape) for p in ps],
                   [torch.zeros(1, dtype=torch.float64 if i % 2 else torch.float32)
                    for i in range(5)], [torch.empty(p.shape, dtype=torch.float16) for p in ps],
                   grads, scale, torch.zeros(1), None, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, False, [], [])
sp = [r(n).to(torch.bfloat16) for n in sizes]  # bf16 params, stochastic rounding (section 21)
S.fused_adam_step_(sp, [torch.zeros(p.shape, dtype=torch.bfloat16) for p in sp],
                   [torch.zeros(p.shape) for p in sp], [torch.zeros(1) for _ in sp], [], grads,
                   scale, torch.zeros(1), None, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, False, [], [],
                   torch.tensor([[7 * i, 1000 * i] for i in range(5)], dtype=torch.int64))
S.fused_sgd_step_(ps, [torch.zeros(p.shape) for p in ps], [], grads, [True, False] * 2 + [True],
                  None, None, torch.tensor([0.1]), 0.1, 0.9, 0.0, 0.0, True, False)
d = S.grad_sumsq_exact(grads, scale)
S.exact_sumsq_to_double(d)
print("launchers ran")
"""

MUTANT = r"""
import torch
from tpamp import _ext
_ext.load_simt("thread")
out = torch.zeros(4)
torch.ops.tpamp_simt_mutants.run("reduce_reuse", out)
print("mutant result", out.tolist())
"""


def _libtsan() -> str:
    cxx = os.environ.get("CXX", "c++")
    path = subprocess.run([cxx, "-print-file-name=libtsan.so"], capture_output=True, text=True,
                          check=True).stdout.strip()
    return os.path.realpath(path)


def _run(code: str, order: str):
    env = dict(os.environ)
    env.update(
        LD_PRELOAD=_libtsan(),
        TSAN_OPTIONS="halt_on_error=0 exitcode=66 report_signal_unsafe=0 "
        "ignore_noninstrumented_modules=1",
        TPAMP_SIMT_ORDER=order,
        OMP_NUM_THREADS="1",
    )
    cmd = [sys.executable, "-c", code]
    if sys.platform.startswith("linux"):
        # older libtsan cannot map its shadow memory with full address-space randomisation
        cmd = ["setarch", os.uname().machine, "-R"] + cmd
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)


@pytest.mark.parametrize("order", ["forward", "random"])
def test_every_launcher_runs_race_free_under_thread_sanitizer(order):
    p = _run(LAUNCHERS, order)
    assert p.returncode == 0 and "launchers ran" in p.stdout, p.stderr[-6000:]
    assert "ThreadSanitizer" not in p.stderr, p.stderr[-6000:]


def test_thread_sanitizer_names_the_missing_barrier_race():
    p = _run(MUTANT, "forward")
    assert "mutant result" in p.stdout, p.stderr[-6000:]
    assert "WARNING: ThreadSanitizer: data race" in p.stderr, p.stderr[-6000:]
    with open(os.path.join(ROOT, "csrc", "simt", "mutants.cu"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    read = 1 + next(i for i, s in enumerate(lines) if "the read the missing barrier races" in s)
    assert f"mutants.cu:{read}" in p.stderr, p.stderr[-6000:]
