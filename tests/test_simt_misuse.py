"""The SIMT emulator reports misuse of the CUDA built-ins with file:line, never a hang or a silent
result: mutation tests with small deliberately broken kernels (csrc/simt/mutants.cu, built into
tpamp._C_simt as torch.ops.tpamp_simt_mutants.run), each next to its correct twin so the test
can fail, under every schedule order."""

from __future__ import annotations

import os
import re

import pytest
import simt_utils
import torch
from simt_utils import order  # noqa: F401  (fixture: every test runs in each schedule order)

SIMT = simt_utils.load()
pytestmark = pytest.mark.skipif(SIMT is None, reason=simt_utils.skip_reason())
MUTANTS = os.path.join(os.path.dirname(__file__), "..", "csrc", "simt", "mutants.cu")


def line_of(text: str, nth: int = 0) -> str:
    """'csrc/simt/mutants.cu:<line>' of the nth line of mutants.cu that contains `text`."""
    with open(MUTANTS, encoding="utf-8") as f:
        hits = [i + 1 for i, line in enumerate(f) if text in line]
    return f"csrc/simt/mutants.cu:{hits[nth]}"


def run(name):
    out = torch.zeros(4)
    torch.ops.tpamp_simt_mutants.run(name, out)
    return out


def test_correct_twins_give_the_right_results(order):
    out = run("reduce_reuse_fixed")
    assert out[0] == 256 * 257 / 2 and out[1] == 1000 * (8 * 9 / 2)
    assert run("early_return_fixed")[0] == 256 - len(range(1, 256, 3))
    assert run("warp_after_exit_fixed")[0] == 16


def test_missing_closing_barrier_gives_a_wrong_sum_in_some_order(monkeypatch):
    """A race, not a rule violation: the emulator's schedule orders expose it as a wrong result
    (forward order hides this one; ThreadSanitizer names its lines in any order,
    tests/test_simt_tsan.py)."""
    wrong = []
    for o in simt_utils.ORDERS:
        monkeypatch.setenv("TPAMP_SIMT_ORDER", o)
        out = run("reduce_reuse")
        if float(out[0]) != 256 * 257 / 2:
            wrong.append(o)
    assert wrong, "no schedule order exposed the missing barrier"
    assert "reverse" in wrong


def test_early_return_before_a_barrier_is_reported(order):
    with pytest.raises(RuntimeError, match=r"exited while \d+ threads wait at __syncthreads at "
                       + re.escape(line_of("// early_return: the barrier"))):
        run("early_return")


def test_warp_reduction_after_lanes_exited_is_reported(order):
    with pytest.raises(RuntimeError) as e:
        run("warp_after_exit")
    msg = str(e.value)
    assert "__shfl_xor_sync at " + line_of("__shfl_xor_sync(0xffffffffu") in msg
    assert "which has exited" in msg
    assert "kernel warp_after_exit_kernel launched at " + line_of("warp_after_exit_kernel, 1") in msg


def test_divergent_barriers_are_reported(order):
    with pytest.raises(RuntimeError, match="divergent __syncthreads") as e:
        run("divergent_barrier")
    msg = str(e.value)
    first = line_of("if (threadIdx.x < 64) {")
    n = int(first.split(":")[1])
    assert f"mutants.cu:{n + 1}" in msg and f"mutants.cu:{n + 3}" in msg


def test_deadlock_is_reported(order):
    with pytest.raises(RuntimeError, match="deadlock") as e:
        run("deadlock")
    msg = str(e.value)
    assert line_of("__syncwarp();  // waits") in msg


def test_shuffle_reading_outside_its_mask_is_reported(order):
    with pytest.raises(RuntimeError, match="does not name") as e:
        run("shfl_outside_mask")
    assert line_of("__shfl_xor_sync(0x0000ffffu") in str(e.value)


@pytest.mark.parametrize("name,message", [
    ("too_many_threads", r"1025 threads; the limit is 1024"),
    ("too_many_param_bytes", r"passes 50\d\d bytes of kernel parameters; the limit is 4 KiB"),
    ("too_much_shared", r"49153 bytes of dynamic shared memory; the limit is 48 KiB"),
    ("empty_grid", r"every dimension must be >= 1"),
])
def test_launches_over_the_hardware_limits_are_refused(name, message):
    with pytest.raises(RuntimeError, match=message) as e:
        run(name)
    assert "csrc/simt/mutants.cu:" in str(e.value)


def test_an_unknown_order_is_refused(monkeypatch):
    monkeypatch.setenv("TPAMP_SIMT_ORDER", "sideways")
    with pytest.raises(RuntimeError, match="TPAMP_SIMT_ORDER is 'sideways'"):
        run("reduce_reuse_fixed")


def test_the_emulator_recovers_after_an_error(order):
    with pytest.raises(RuntimeError):
        run("warp_after_exit")
    assert run("reduce_reuse_fixed")[0] == 256 * 257 / 2
