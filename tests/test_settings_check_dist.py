"""The cross-rank settings check (docs/spec.md section 2.4) when a peer never joins it, and
which ranks compare the inner optimizer's hyperparameters (TP / DP / EP peers, not stages).

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


# ---- which ranks compare the inner optimizer's hyperparameters (docs/spec.md section 2.4) ----


def _stages_and_experts(rank, world_size):
    from tpamp.parallel import initialize_model_parallel

    out = {}
    # two pipeline stages (grad-stats group = both, no TP group): each holds other layers, in
    # other param groups with other lrs; not compared, the step runs
    params = [torch.nn.Parameter(torch.ones(3)) for _ in range(1 + rank)]
    groups = [{"params": [p], "lr": 0.1 * (i + 1 + rank)} for i, p in enumerate(params)]
    opt = tpamp.FP32Optimizer(torch.optim.SGD(groups), grad_stats_group=dist.group.WORLD)
    for p in params:
        p.grad = torch.ones(3)
    out["stages"] = bool(opt.step().update_successful)
    # EP 2 (the dense grad-stats group is one rank): the expert params' statistics are reduced
    # over the expert model-parallel group, whose EP peers then compare their settings too
    st = initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    for lrs in ((0.5, 0.5), (0.5, 0.25)):
        dense = torch.nn.Parameter(torch.ones(3))
        expert = tpamp.mark_expert_param(torch.nn.Parameter(torch.ones(3)))
        opt = tpamp.FP32Optimizer(torch.optim.SGD([dense, expert], lr=lrs[rank]),
                                  grad_stats_group=st.model_parallel_group, parallel_state=st)
        dense.grad, expert.grad = torch.ones(3), torch.ones(3)
        try:
            opt.step()
            out[lrs] = (None, "", expert.detach().tolist())
        except ValueError as e:
            out[lrs] = ("ValueError", str(e), expert.detach().tolist())
    return out


def test_stages_are_not_compared_and_ep_peers_are():
    results = run_workers(_stages_and_experts, 2, timeout=10)
    for rank, out in enumerate(results):
        assert out["stages"]
        assert out[(0.5, 0.5)][0] is None and out[(0.5, 0.5)][2] == [0.5] * 3
        kind, msg, expert = out[(0.5, 0.25)]
        assert kind == "ValueError", (rank, msg)
        for word in ("'lr'", "expert-parallel", "rank 0: 0.5", "rank 1: 0.25"):
            assert word in msg, (word, msg)
        assert expert == [1.0] * 3  # refused before the step
    assert results[0][(0.5, 0.25)][1] == results[1][(0.5, 0.25)][1]


def test_an_expert_param_is_recognized_as_megatron_core_recognizes_it():
    # megatron/core: not getattr(param, "allreduce", True)
    for value, expert in ((False, True), (0, True), (None, True), (True, False), (1, False)):
        p = torch.nn.Parameter(torch.ones(2))
        p.allreduce = value
        assert tpamp.is_expert_param(p) is expert, value
    assert tpamp.is_expert_param(torch.nn.Parameter(torch.ones(2))) is False
