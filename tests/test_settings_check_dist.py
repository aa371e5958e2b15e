"""The cross-rank settings check (docs/spec.md section 2.4) when a peer never joins it, and
which ranks compare the inner optimizer's hyperparameters (TP / DP / EP / expert-TP /
expert-DP peers, not stages).

A rank that builds its wrapper with ``grad_stats_group=None`` while its peers pass a group does
no collective at all; the peers' first step then waits in the settings all-gather. They must
fail fast (the group's timeout, or the closed connection of the peer that finished) with a
message that names the mistake and the fix, not gloo's bare "Connection closed by peer".
"""

import torch
import torch.distributed as dist
from dist_utils import run_workers, tensor_bytes

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


# ---- expert-TP and expert-DP peers (docs/spec.md sections 2.4 and 19) ----------------------


def _expert_step(build, lr, rank, dtype):
    """Build a wrapper (build(inner) -> wrapper; a DistributedOptimizer checks at construction)
    over one dense and one expert param in two param groups, the expert group at ``lr``, and
    step it: (exception type or None, message, expert param before == after, its values)."""
    g = torch.Generator().manual_seed(0)
    dense = torch.nn.Parameter(torch.randn(6, generator=g).to(dtype))
    expert = tpamp.mark_expert_param(torch.nn.Parameter(torch.randn(4, 3, generator=g).to(dtype)))
    params = (dense, expert)
    before = [tensor_bytes(p) for p in params]
    inner = torch.optim.SGD([{"params": [dense], "lr": 0.5}, {"params": [expert], "lr": lr}])
    try:
        opt = build(inner)
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
    except ValueError as e:
        return ("ValueError", str(e), [tensor_bytes(p) for p in params] == before,
                expert.detach().float().tolist())
    return (None, "", [tensor_bytes(p) for p in params] == before,
            expert.detach().float().tolist())


def _record_mismatches(found):
    """Wrap tpamp._peer_settings.mismatches (in this forked rank only) to append every
    (kind label, peers' ranks) it finds to ``found``: which peer groups were seen to differ,
    beyond the first one that the message names."""
    from tpamp import _peer_settings

    real = _peer_settings.mismatches

    def spy(rows, ranks):
        result = real(rows, ranks)
        found.extend((label, list(members)) for label, members, _ in result)
        return result

    _peer_settings.mismatches = spy


def _expert_tp_peers(rank, world_size):
    from tpamp.parallel import initialize_model_parallel

    # tp 1 (dp 4); etp 2 x ep 2 (edp 1): expert-TP groups [0, 1] and [2, 3], EP groups [0, 2]
    # and [1, 3]; the dense grad-stats group (TP x PP) is one rank, the expert one every rank
    st = initialize_model_parallel(1, 1, expert_model_parallel_size=2,
                                   expert_tensor_parallel_size=2)
    assert dist.get_process_group_ranks(st.expert_tp_group) == [rank - rank % 2, rank - rank % 2 + 1]
    out = {"found": []}
    _record_mismatches(out["found"])
    for name, lrs in (("same", (0.25,) * 4), ("etp", (0.25, 0.125, 0.25, 0.125))):
        out[name] = _expert_step(lambda inner: tpamp.MixedPrecisionOptimizer(
            inner, grad_scaler=tpamp.ConstantGradScaler(1.0),
            grad_stats_group=st.model_parallel_group, parallel_state=st),
            lrs[rank], rank, torch.bfloat16)
    return out


def test_an_lr_that_differs_between_expert_tp_peers_is_refused_on_every_rank():
    # EP peers ([0, 2], [1, 3]) agree; only the expert-TP peers differ
    # every rank of the expert grad-stats group (all 4) gathered the same rows: each names the
    # first group that differs; both expert-TP groups were found to differ, nothing else
    _assert_refused_on_every_rank(
        run_workers(_expert_tp_peers, 4, timeout=20), "etp",
        ("'lr' of param group 1", "expert-tensor-parallel group [0, 1]", "rank 0: 0.25",
         "rank 1: 0.125"),
        [("expert-tensor-parallel", [0, 1]), ("expert-tensor-parallel", [2, 3])])


def _assert_refused_on_every_rank(results, case, words, found):
    """The equal-lr step ran; the `case` step raised the same ValueError holding `words` on
    every rank with the params unchanged; the peer groups found to differ are `found`."""
    for rank, out in enumerate(results):
        assert out["same"][0] is None and not out["same"][2], (rank, out["same"])
        kind, msg, unchanged, _ = out[case]
        assert kind == "ValueError", (rank, msg)
        for word in words:
            assert word in msg, (rank, word, msg)
        assert unchanged, f"rank {rank}: the refused step changed a param"
        assert out["found"] == found, (rank, out["found"])
    assert all(out[case][1] == results[0][case][1] for out in results)


def _expert_dp_peers(rank, world_size):
    from tpamp.parallel import initialize_model_parallel

    # tp 1 (dp 4); ep 2, etp 1 (edp 2): EP groups [0, 1] and [2, 3], expert-DP groups [0, 2]
    # and [1, 3]
    st = initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    assert dist.get_process_group_ranks(st.expert_data_parallel_group) == [rank % 2, rank % 2 + 2]
    out = {"found": []}
    _record_mismatches(out["found"])
    for name, lrs in (("same", (0.25,) * 4), ("edp", (0.25, 0.25, 0.125, 0.125))):
        out[name] = _expert_step(lambda inner: tpamp.DistributedOptimizer(
            inner, grad_scaler=tpamp.ConstantGradScaler(1.0), parallel_state=st),
            lrs[rank], rank, torch.float16)
    return out


def test_an_lr_that_differs_between_expert_dp_peers_is_refused_on_every_rank():
    # EP peers ([0, 1], [2, 3]) agree; the expert-DP peers ([0, 2], [1, 3]) differ. The dense
    # DP group (dp_cp_group, every rank here) holds the expert-DP peers of each stage and comes
    # first in PEER_KINDS, so it is the group the message names (the difference is the same)
    # the expert-DP peers' own comparison found both of their groups too (EP peers agree)
    _assert_refused_on_every_rank(
        run_workers(_expert_dp_peers, 4, timeout=20), "edp",
        ("'lr' of param group 1", "data-parallel group [0, 1, 2, 3]", "rank 0: 0.25",
         "rank 1: 0.25", "rank 2: 0.125", "rank 3: 0.125"),
        [("data-parallel", [0, 1, 2, 3]), ("expert-data-parallel", [0, 2]),
         ("expert-data-parallel", [1, 3])])
