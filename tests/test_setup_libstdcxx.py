"""setup.py keeps one C++ runtime in the process: a compiler that links libstdc++ statically into
shared libraries gets every tpamp module linked against the libstdc++.so.6 torch loaded.

Why: on the first GPU machine (2026-11-27, CXX=/opt/gcc/bin/g++) tpamp._C carried libstdc++'s own
code, and every kernel error message that formats a number crashed the process (SIGSEGV in
std::ostream). Built here with `g++ -static-libstdc++` the same message comes out cut off at the
number ("mask has " and nothing after); with the link arguments below it is whole. These tests
use such a compiler (a wrapper that adds -static-libstdc++) and readelf's view of the result,
not the function's own reasoning."""

from __future__ import annotations

import importlib.util
import os
import shutil
import stat
import subprocess

import pytest
import torch  # noqa: F401  (maps the libstdc++ the modules must share)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = ("#include <sstream>\n#include <string>\n"
       "std::string probe(unsigned long v) { std::ostringstream s; s << v; return s.str(); }\n")

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None or shutil.which("readelf") is None,
    reason="needs g++ and readelf (binutils)")


def _setup_module():
    spec = importlib.util.spec_from_file_location("tpamp_setup_script", os.path.join(ROOT, "setup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines, builds nothing
    return module


def _static_wrapper(tmp_path):
    path = tmp_path / "static-g++"
    path.write_text(f'#!/bin/sh\nexec {shutil.which("g++")} "$@" -static-libstdc++\n')
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def _link(cxx, extra, tmp_path):
    """A one-line shared library linked by `cxx` with `extra`; its readelf -d output."""
    out = str(tmp_path / "probe.so")
    subprocess.run([cxx, "-shared", "-fPIC", "-x", "c++", "-", "-x", "none", "-o", out, *extra], input=SRC,
                   text=True, errors="replace", check=True, capture_output=True, timeout=120)
    return subprocess.run(["readelf", "-d", out], capture_output=True, text=True, check=True).stdout


def test_a_compiler_that_links_the_shared_runtime_gets_nothing(monkeypatch):
    monkeypatch.setenv("CXX", shutil.which("g++"))
    assert _setup_module()._libstdcxx_link_args() == []


def test_a_compiler_that_links_libstdcxx_statically_gets_torchs_shared_one(monkeypatch, tmp_path):
    cxx = _static_wrapper(tmp_path)
    assert "libstdc++.so" not in _link(cxx, [], tmp_path)  # the wrapper does what it says
    monkeypatch.setenv("CXX", cxx)
    args = _setup_module()._libstdcxx_link_args()
    assert len(args) == 1 and os.path.isfile(args[0]), args
    # the library this process (with torch) has mapped, by /proc/self/maps
    with open("/proc/self/maps", encoding="utf-8") as f:
        mapped = {line.split()[-1] for line in f if "libstdc++.so" in line}
    assert args[0] in mapped, (args, mapped)
    # linked with it, the library needs the shared libstdc++ (one runtime in the process)
    assert "libstdc++.so.6" in _link(cxx, args, tmp_path)


def test_a_compiler_that_cannot_link_is_left_alone(monkeypatch, tmp_path):
    broken = tmp_path / "broken-g++"
    broken.write_text("#!/bin/sh\nexit 3\n")
    broken.chmod(broken.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CXX", str(broken))
    assert _setup_module()._libstdcxx_link_args() == []
