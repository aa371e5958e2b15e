"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest
from dist_utils import fused_step_built

from tpamp import ops


@pytest.fixture(params=["kernel", "reference"])
def path(request):
    """Runs a test on the extension's fused-step kernel and on the PyTorch reference path
    (tpamp.ops.force_fallback); the kernel case skips where the extension is not built."""
    if request.param == "kernel":
        if not fused_step_built():
            pytest.skip("tpamp._C with the fused step kernels is not built")
        yield request.param
    else:
        with ops.force_fallback():
            yield request.param
