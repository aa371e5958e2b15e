"""Every collective-only helper's docstring says which ranks must call it (a helper that only
some ranks call hangs the others)."""

from __future__ import annotations


def test_collective_helpers_say_so():
    """Every collective-only helper's docstring says which ranks must call it."""
    from tpamp import fsdp, grad_stats, nonfinite, param_norms
    from tpamp.checkpoint import load_checkpoint, save_checkpoint

    for fn in (fsdp.fully_shard_optimizer, fsdp.track_param_grad_norms,
               grad_stats.get_grad_norm_fp32, grad_stats.count_zeros_fp32,
               nonfinite.gather_nonfinite, nonfinite.NonFiniteTracer.result,
               param_norms.ParamGradNormTracker, save_checkpoint, load_checkpoint):
        doc = " ".join((fn.__doc__ or "").split())
        assert "ollective: every rank of" in doc and "must call it" in doc, fn.__qualname__
