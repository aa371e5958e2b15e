"""setup.py says what the kernel build is doing (a capability module compiles for minutes):
the modules it builds, then each one's start and end with its time and the time since the build
began, and a last line with what was built. The lines are checked against a hand-written trace
of a fake clock; importing setup.py builds nothing (its setup() runs only as __main__, as pip's
build backend and `python setup.py` run it)."""

from __future__ import annotations

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setup_module():
    spec = importlib.util.spec_from_file_location("tpamp_setup_script", os.path.join(ROOT, "setup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines, builds nothing
    return module


def test_importing_setup_py_builds_nothing():
    module = _setup_module()
    assert not hasattr(module, "ext_modules") and not hasattr(module, "cmdclass")


def test_the_progress_lines_of_a_build():
    times = iter([100.0, 100.5, 161.2, 161.2, 405.9, 406.0, 407.4, 410.0])
    progress = _setup_module().BuildProgress(
        ["tpamp._C", "tpamp._C_cpu_avx2", "tpamp._C_cpu_avx512"], clock=lambda: next(times))
    lines = [
        progress.begin("2"),
        progress.start("tpamp._C", 1),
        progress.end("tpamp._C"),
        progress.start("tpamp._C_cpu_avx2", 6),
        progress.end("tpamp._C_cpu_avx2"),
        progress.start("tpamp._C_cpu_avx512", 6),
        progress.end("tpamp._C_cpu_avx512", ok=False),
        progress.finish(["tpamp._C_cpu_avx512"]),
    ]
    assert lines == [
        "building 3 extension modules (tpamp._C, tpamp._C_cpu_avx2, tpamp._C_cpu_avx512) with 2 "
        "parallel compile jobs (MAX_JOBS); each takes up to a few minutes",
        "[1/3] tpamp._C: compiling 1 source file",
        "[1/3] tpamp._C: built in 61 s (61 s since the build began)",
        "[2/3] tpamp._C_cpu_avx2: compiling 6 source files",
        "[2/3] tpamp._C_cpu_avx2: built in 245 s (306 s since the build began)",
        "[3/3] tpamp._C_cpu_avx512: compiling 6 source files",
        "[3/3] tpamp._C_cpu_avx512: FAILED in 1 s (307 s since the build began)",
        "built 2 of 3 extension modules in 310 s",
    ]
