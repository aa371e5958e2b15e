"""tpamp.parallel with context and expert parallelism: Megatron-core's rank order (dense
tp-cp-dp-pp, expert tp-ep-dp-pp with the expert-TP size), against rank lists written out by
hand (docs/spec.md section 19)."""

import pytest
import torch.distributed as dist
from dist_utils import run_workers

from tpamp.parallel import ParallelDims, initialize_model_parallel

# Each case: sizes, then the groups of every rank as hand-written lists (Megatron-core's
# RankGenerator with order tp-cp-ep-dp-pp; expert generator with cp=1, tp=etp).
_SINGLE4 = [[0], [1], [2], [3]]
CASES = {
    "tp2-ep2": (dict(tp=2, ep=2), {
        "tp": [[0, 1], [2, 3]], "dp": [[0, 2], [1, 3]], "cp": _SINGLE4, "dp_cp": [[0, 2], [1, 3]],
        "mp": [[0, 1], [2, 3]], "ep": [[0, 2], [1, 3]], "etp": [[0, 1], [2, 3]],
        "emp": [[0, 1, 2, 3]], "edp": _SINGLE4,
    }),
    "tp2-ep2-etp1": (dict(tp=2, ep=2, etp=1), {
        "tp": [[0, 1], [2, 3]], "dp": [[0, 2], [1, 3]], "cp": _SINGLE4, "dp_cp": [[0, 2], [1, 3]],
        "mp": [[0, 1], [2, 3]], "ep": [[0, 1], [2, 3]], "etp": _SINGLE4,
        "emp": [[0, 1], [2, 3]], "edp": [[0, 2], [1, 3]],
    }),
    "pp2-ep2": (dict(pp=2, ep=2), {
        "tp": _SINGLE4, "dp": [[0, 1], [2, 3]], "pp": [[0, 2], [1, 3]], "cp": _SINGLE4,
        "dp_cp": [[0, 1], [2, 3]], "mp": [[0, 2], [1, 3]], "ep": [[0, 1], [2, 3]],
        "etp": _SINGLE4, "emp": [[0, 1, 2, 3]], "edp": _SINGLE4,
    }),
    "ep2-dp4": (dict(ep=2), {
        "tp": _SINGLE4, "dp": [[0, 1, 2, 3]], "cp": _SINGLE4, "dp_cp": [[0, 1, 2, 3]],
        "mp": _SINGLE4, "ep": [[0, 1], [2, 3]], "etp": _SINGLE4, "emp": [[0, 1], [2, 3]],
        "edp": [[0, 2], [1, 3]],
    }),
    "ep4": (dict(ep=4), {
        "dp": [[0, 1, 2, 3]], "ep": [[0, 1, 2, 3]], "emp": [[0, 1, 2, 3]], "edp": _SINGLE4,
    }),
    "tp2-cp2": (dict(tp=2, cp=2), {
        "tp": [[0, 1], [2, 3]], "cp": [[0, 2], [1, 3]], "dp": _SINGLE4, "dp_cp": [[0, 2], [1, 3]],
        "mp": [[0, 1], [2, 3]], "ep": _SINGLE4, "etp": [[0, 1], [2, 3]], "emp": [[0, 1], [2, 3]],
        "edp": [[0, 2], [1, 3]],
    }),
    "cp2-ep2": (dict(cp=2, ep=2), {
        "tp": _SINGLE4, "cp": [[0, 1], [2, 3]], "dp": [[0, 2], [1, 3]], "dp_cp": [[0, 1, 2, 3]],
        "mp": _SINGLE4, "ep": [[0, 1], [2, 3]], "emp": [[0, 1], [2, 3]], "edp": [[0, 2], [1, 3]],
    }),
}


def _layout(rank, world, sizes):
    st = initialize_model_parallel(
        sizes.get("tp", 1), sizes.get("pp", 1), context_parallel_size=sizes.get("cp", 1),
        expert_model_parallel_size=sizes.get("ep", 1),
        expert_tensor_parallel_size=sizes.get("etp"),
    )
    r = dist.get_process_group_ranks
    em = st.expert_mesh
    return {
        "groups": {
            "tp": r(st.tp_group), "dp": r(st.dp_group), "pp": r(st.pp_group), "cp": r(st.cp_group),
            "dp_cp": r(st.dp_cp_group), "mp": r(st.model_parallel_group), "ep": r(st.ep_group),
            "etp": r(st.expert_tp_group), "emp": r(st.expert_model_parallel_group),
            "edp": r(st.expert_data_parallel_group),
        },
        "expert_mesh": {n: r(em.get_group(n)) for n in ("pp", "edp", "ep", "etp")},
        "expert_mesh_names": em.mesh_dim_names,
        "dense_mesh_names": st.mesh.mesh_dim_names,
        "dense_mesh": {n: r(st.mesh.get_group(n)) for n in st.mesh.mesh_dim_names},
        "ranks": (st.tp_rank, st.cp_rank, st.dp_rank, st.pp_rank, st.ep_rank,
                  st.expert_tp_rank, st.expert_dp_rank),
        "stats": (r(st.grad_stats_group), r(st.expert_grad_stats_group)),
        "same_objects": (st.expert_model_parallel_group is st.model_parallel_group,
                         st.expert_data_parallel_group is st.dp_cp_group),
    }


@pytest.mark.parametrize("case", list(CASES))
def test_groups_follow_megatron_core_rank_order(case):
    sizes, expected = CASES[case]
    results = run_workers(_layout, 4, sizes)
    for rank, got in enumerate(results):
        for name, lists in expected.items():
            mine = [g for g in lists if rank in g]
            assert len(mine) == 1 and got["groups"][name] == mine[0], (case, rank, name, got["groups"][name])
        g = got["groups"]
        # the meshes are views of the same groups
        assert got["expert_mesh_names"] == ("pp", "edp", "ep", "etp")
        assert got["expert_mesh"] == {"pp": g["pp"], "edp": g["edp"], "ep": g["ep"], "etp": g["etp"]}
        cp = sizes.get("cp", 1)
        assert got["dense_mesh_names"] == (("pp", "dp", "cp", "tp") if cp > 1 else ("pp", "dp", "tp"))
        for n, ranks in got["dense_mesh"].items():
            assert ranks == g[n], (case, rank, n)
        assert got["stats"] == (g["mp"], g["emp"])
        # coordinates from the group positions
        tp_r, cp_r, dp_r, pp_r, ep_r, etp_r, edp_r = got["ranks"]
        assert (tp_r, cp_r, dp_r, pp_r) == tuple(g[n].index(rank) for n in ("tp", "cp", "dp", "pp"))
        assert (ep_r, etp_r, edp_r) == tuple(g[n].index(rank) for n in ("ep", "etp", "edp"))


def test_dense_only_layout_reuses_the_dense_groups_for_experts():
    res = run_workers(_layout, 4, dict(tp=2))
    for got in res:
        assert got["same_objects"] == (True, True)
        assert got["groups"]["ep"] == [got["groups"]["ep"][0]]  # one rank


def test_expert_layout_that_does_not_divide_names_the_numbers():
    with pytest.raises(ValueError, match=r"world_size 4 is not divisible by etp \* ep \* pp = 1 \* 3 \* 1 = 3"):
        ParallelDims(world_size=4, ep=3, etp=1)
    with pytest.raises(ValueError, match=r"tp \* cp \* pp \* dp = 2 \* 2 \* 1 \* 2 = 8 does not equal world_size 4"):
        ParallelDims(tp=2, cp=2, dp=2, world_size=4)
    with pytest.raises(ValueError, match=r"world_size 6 is not divisible by tp \* cp \* pp = 1 \* 4 \* 1 = 4"):
        ParallelDims(cp=4, world_size=6)
    with pytest.raises(TypeError, match="etp"):
        ParallelDims(world_size=4, etp=1.5)


def test_expert_coordinates_follow_megatron_core():
    d = ParallelDims(tp=2, pp=2, world_size=16, ep=4, etp=1)
    assert (d.dp, d.edp, d.etp) == (4, 2, 1)
    # expert rank = ((pp * edp + edp_rank) * ep + ep_rank) * etp + etp_rank
    assert d.expert_coords(13) == (1, 1, 1, 0)
    assert d.dense_coords(13) == (1, 2, 0, 1)
    assert ParallelDims(tp=2, world_size=8).etp == 2


def _init_bad_ep(rank, world):
    try:
        initialize_model_parallel(1, 1, expert_model_parallel_size=3)
    except ValueError as e:
        return str(e)
    return None


def test_initialize_with_expert_size_that_does_not_divide_raises_on_every_rank():
    for msg in run_workers(_init_bad_ep, 4):
        assert msg is not None and "3" in msg and "4" in msg
