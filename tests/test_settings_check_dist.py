"""The cross-rank settings check (docs/spec.md section 8) when a peer never joins it.

A rank that builds its wrapper with ``grad_stats_group=None`` while its peers pass a group does
no collective at all; the peers' first step then waits in the settings all-gather. They must
fail fast (the group's timeout, or the closed connection of the peer that finished) with a
message that names the mistake and the fix, not gloo's bare "Connection closed by peer".
"""

import torch
import torch.distributed as dist
from dist_utils import run_workers

import tpamp


def _mismatched_group(rank, world_size):
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    group = dist.group.WORLD if rank == 0 else None  # rank 1 makes the mistake
    opt = tpamp.MixedPrecisionOptimizer(
        torch.optim.SGD([param], lr=0.1),
        grad_scaler=tpamp.ConstantGradScaler(1.0),
        grad_stats_group=group,
    )
    before = param.detach().clone()
    param.grad = torch.full_like(param, 0.5)
    try:
        result = opt.step()
    except RuntimeError as e:
        return {"raised": str(e), "unchanged": torch.equal(param.detach(), before)}
    return {"raised": None, "stepped": bool(result.update_successful)}


def test_a_peer_with_grad_stats_group_none_is_named_by_the_ranks_that_wait():
    rank0, rank1 = run_workers(_mismatched_group, 2, timeout=5)
    # the rank without a group steps alone (nothing it can detect: no collective is its own)
    assert rank1 == {"raised": None, "stepped": True}
    message = rank0["raised"]
    assert message is not None, "the rank with the group stepped although its peer never joined"
    assert "grad_stats_group" in message and "grad_stats_group=None" in message
    assert "[0, 1]" in message  # the group's ranks
    assert rank0["unchanged"], "the refused step changed the param"
