"""tpamp.parallel: Megatron rank order (TP fastest, then DP, then PP) and its groups."""

import pytest
import torch.distributed as dist
from dist_utils import run_workers
from misuse_utils import all_of, assert_every_case_refused_by_tpamp, assert_raises_naming, case_ids
from torch.distributed.device_mesh import init_device_mesh

from tpamp.parallel import ParallelDims, initialize_model_parallel

# Megatron-LM's parallel_state for world 8, TP=2, PP=2 (DP=2), written out by hand.
MEGATRON_8 = {
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
    "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    "mp": [[0, 1, 4, 5], [2, 3, 6, 7]],
    "emb": [[0, 4], [1, 5], [2, 6], [3, 7]],
}


def _groups(rank, world, use_mesh):
    if use_mesh:
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
        st = initialize_model_parallel(mesh=mesh)
    else:
        st = initialize_model_parallel(2, 2)
    ranks = dist.get_process_group_ranks
    return {
        "tp": ranks(st.tp_group), "dp": ranks(st.dp_group), "pp": ranks(st.pp_group),
        "mp": ranks(st.model_parallel_group), "emb": ranks(st.embedding_group),
        "coords": (st.pp_rank, st.dp_rank, st.tp_rank), "pp_ranks": st.pp_ranks,
        "first": st.is_first_stage, "last": st.is_last_stage,
    }


@pytest.mark.parametrize("use_mesh", [False, True])
def test_groups_follow_megatron_rank_order(use_mesh):
    results = run_workers(_groups, 8, use_mesh)
    for rank, got in enumerate(results):
        for name, lists in MEGATRON_8.items():
            mine = [g for g in lists if rank in g]
            assert sorted(got[name]) == mine[0], (rank, name, got[name])
        assert got["coords"] == (rank // 4, (rank // 2) % 2, rank % 2)
        assert got["pp_ranks"] == [rank % 4, rank % 4 + 4]
        assert got["first"] == (rank < 4) and got["last"] == (rank >= 4)


def _bad_mesh(rank, world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match=r"mesh dim names must be \('pp', 'dp', 'tp'\)"):
        initialize_model_parallel(mesh=mesh)
    return True


def test_mesh_with_other_dim_names_is_rejected():
    assert all(run_workers(_bad_mesh, 4))


def test_layout_that_does_not_multiply_out_names_the_numbers():
    with pytest.raises(ValueError, match=r"tp \* pp \* dp = 2 \* 2 \* 3 = 12 does not equal world_size 8"):
        ParallelDims(tp=2, pp=2, dp=3, world_size=8)
    with pytest.raises(ValueError, match="world_size 6 is not divisible by tp \\* pp = 2 \\* 2 = 4"):
        ParallelDims(tp=2, pp=2, world_size=6)


# ---- misuse: each bad argument or loaded value raises the documented exception type, with a
# message that names the argument or key (docs/spec.md section 14); runner: tests/misuse_utils.py


MISUSE_CASES = [
    # parallel layout
    ("dims-tp-0", lambda: ParallelDims(tp=0, world_size=4), ValueError, ["tp", "0"]),
    ("dims-pp-float", lambda: ParallelDims(pp=1.5, world_size=4), TypeError, ["pp", "1.5"]),
    ("dims-dp-0", lambda: ParallelDims(dp=0, world_size=4), ValueError, ["dp", "0"]),
    ("dims-coords-rank", lambda: ParallelDims(tp=2, world_size=4).coords(9), ValueError, ["rank", "9"]),
    ("init-mp-not-initialized", lambda: initialize_model_parallel(1, 1), RuntimeError, ["init_process_group"]),
]


def test_every_case_is_refused_by_tpamp_itself():
    """Ids distinct; each case refused inside tpamp itself (tests/misuse_utils.py)."""
    assert_every_case_refused_by_tpamp(MISUSE_CASES)


@pytest.mark.parametrize("case_id,call,exc,words", MISUSE_CASES, ids=case_ids(MISUSE_CASES))
def test_misuse_raises_a_clear_error_naming_the_argument(case_id, call, exc, words):
    assert_raises_naming(case_id, call, exc, words)


# ---- a layout that does not multiply to the world size names the numbers -------------------------


def test_parallel_dims_not_multiplying_to_world_size_raise_value_error_showing_numbers():
    with pytest.raises(ValueError, match=all_of("3", "2", "8")):
        ParallelDims(tp=3, pp=2, world_size=8)


def test_parallel_dims_with_explicit_dp_mismatch_raise_value_error_showing_numbers():
    with pytest.raises(ValueError, match=all_of("2", "3", "16")):
        ParallelDims(tp=2, pp=2, dp=3, world_size=16)


def test_parallel_dims_that_fit_are_accepted():
    d = ParallelDims(tp=2, pp=2, world_size=8)
    assert (d.tp, d.pp, d.dp, d.world_size) == (2, 2, 2, 8)


def _init_tp3_on_4(rank, world_size):
    try:
        initialize_model_parallel(3, 1)
    except ValueError as e:
        return "ValueError", str(e)
    except Exception as e:  # a different error type is a failure of the check below
        return type(e).__name__, str(e)
    return None, None


def test_initialize_model_parallel_tp3_on_4_ranks_raises_value_error_showing_numbers():
    import re

    results = run_workers(_init_tp3_on_4, 4)
    for rank, (kind, msg) in enumerate(results):
        assert kind == "ValueError", (rank, kind, msg)
        assert re.search(all_of("3", "4"), msg), (rank, msg)
