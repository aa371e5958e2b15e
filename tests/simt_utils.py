"""Shared by the tests of the emulated CUDA launchers (tests/test_simt*.py): loading
torch.ops.tpamp_simt (tpamp._C_simt, built with TPAMP_BUILD_SIMT=1) and the schedule orders.

The module is skipped when not built, unless TPAMP_REQUIRE_SIMT=1 (CI sets it: there a missing
module is a failure, not a skip)."""

from __future__ import annotations

import os

import pytest

from tpamp import _ext

ORDERS = ("forward", "reverse", "random")
REQUIRED = os.environ.get("TPAMP_REQUIRE_SIMT") == "1"


def load():
    """torch.ops.tpamp_simt, or None (skip) when tpamp._C_simt is not built."""
    try:
        return _ext.load_simt()
    except RuntimeError:
        if REQUIRED:
            raise
        return None


def skip_reason() -> str:
    return "tpamp._C_simt is not built (TPAMP_BUILD_SIMT=1 pip install --no-build-isolation -e .)"


@pytest.fixture(params=ORDERS)
def order(request, monkeypatch):
    """Runs the test once per schedule order (TPAMP_SIMT_ORDER, read at every launch)."""
    monkeypatch.setenv("TPAMP_SIMT_ORDER", request.param)
    monkeypatch.setenv("TPAMP_SIMT_SEED", "20261123")
    return request.param
