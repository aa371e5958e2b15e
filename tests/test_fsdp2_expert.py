"""FSDP2 with expert parallelism (docs/spec.md section 19): dense params fully_shard'ed over DP,
stacked expert params (DTensors Shard(0) over EP) over the expert-data-parallel dim with the
dense DP size as gradient divide factor (tpamp.fsdp.fully_shard_experts). The grad norm, zero
count and clipped update equal a single-process float64 computation of the unsharded model
(tests/test_expert_parallel.py's reference); an inf in one expert's grad on one rank skips the
step on every rank and names the expert param with its EP rank; a checkpoint saved at EP 2 loads at EP 1."""

import math

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_workers
from test_expert_parallel import _dist_opt_model, _load_at_ep1, _reference

import tpamp
from tpamp.parallel import initialize_model_parallel


class _Experts(torch.nn.Module):
    """The stacked expert params; called as a module so that FSDP2 unshards them (its hooks)."""

    def forward(self, grads):
        return sum((p.to_local() * grads[f"moe.experts.{n}"]).sum()
                   for n, p in self.named_parameters())


class _Model(torch.nn.Module):
    """Holds the params; forward gives sum(p * g) so that d loss / d p = this rank's grad g
    (dense: of its data shard; experts: of the data shards whose tokens reach its experts)."""

    def __init__(self, named, st, ep_dtensor=True):
        from torch.distributed.tensor import DTensor, Shard

        super().__init__()
        self.dense = torch.nn.Module()
        self.experts = _Experts()
        self.grads = {}
        for name, p, g in named:
            mod, attr = (self.experts, name.split(".")[-1]) if name.startswith("moe.") else (
                self.dense, name.replace(".", "_"))
            t = p.detach().clone()
            if name.startswith("moe.") and ep_dtensor:  # this EP rank's experts, at their index
                t = DTensor.from_local(t, st.expert_mesh["ep"], [Shard(0)], run_check=False)
            mod.register_parameter(attr, torch.nn.Parameter(t))
            self.grads[name] = g

    def named(self):
        return [(f"moe.experts.{n}", p) for n, p in self.experts.named_parameters()] + [
            (n.replace("_", "."), p) for n, p in self.dense.named_parameters()]

    def forward(self):
        dense = sum((p * self.grads[n.replace("_", ".")]).sum()
                    for n, p in self.dense.named_parameters())
        return dense + self.experts(self.grads)


def _fsdp_model(rank, world, ep, lr_opt):
    from torch.distributed.fsdp import fully_shard

    st = initialize_model_parallel(1, 1, expert_model_parallel_size=ep)
    model = _Model(_dist_opt_model(rank, world, st), st)
    tpamp.fsdp.fully_shard_experts(model.experts, st.expert_mesh, st.dims.dp)
    fully_shard(model, mesh=st.mesh["dp"])
    named = model.named()
    opt = tpamp.fsdp.fully_shard_optimizer(
        lr_opt([p for _, p in named]), st.mesh, expert_mesh=st.expert_mesh, clip_grad=0.5,
        log_num_zeros_in_grad=True, parallel_state=st, param_names=named)
    return st, model, opt


def _step(rank, world):
    st, model, opt = _fsdp_model(rank, world, 2, lambda ps: torch.optim.SGD(ps, lr=0.1))
    model().backward()
    ok, norm, zeros = opt.step()
    return ok, norm, zeros, {n: p.full_tensor().double() for n, p in model.named()}, \
        {n: str(p.device_mesh.mesh_dim_names) for n, p in model.named()}


def test_fsdp2_ep2_grad_norm_zeros_and_update_match_the_unsharded_float64_model():
    results = run_workers(_step, 4)
    ref_params, ref_grads = _reference(4)
    flat = torch.cat([g.reshape(-1) for g in ref_grads.values()])
    ref_norm = float(flat.norm())
    ref_zeros = int((flat == 0).sum())
    assert ref_zeros > 0
    coeff = 0.5 / (ref_norm + 1e-6)
    assert coeff < 1  # the clip applies, to dense and expert params alike
    for ok, norm, zeros, after, meshes in results:
        assert meshes["moe.experts.weight"] == "('edp', 'ep')"
        assert meshes["dense.w1"] == "('dp',)"
        assert ok
        assert norm == pytest.approx(ref_norm, rel=1e-5)
        assert zeros == ref_zeros
        for name, value in after.items():
            want = ref_params[name] - 0.1 * coeff * ref_grads[name]
            torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-6, msg=name)


def _inf_step(rank, world):
    st, model, opt = _fsdp_model(rank, world, 2, lambda ps: torch.optim.SGD(ps, lr=0.1))
    model().backward()
    before = {n: p.detach().to_local().clone() for n, p in model.named()}
    if rank == 3:  # ep rank 1, edp rank 1: its shard of the stacked expert weight
        dict(model.named())["moe.experts.weight"].grad.to_local()[0, 0, 0] = math.inf
    ok, _, _ = opt.step()
    unchanged = all(torch.equal(p.detach().to_local(), before[n]) for n, p in model.named())
    return ok, unchanged, [str(r) for r in opt.last_nonfinite], st.ep_rank


def test_fsdp2_inf_in_one_experts_grad_on_one_rank_skips_the_step_on_every_rank_and_names_it():
    for ok, unchanged, records, _ in run_workers(_inf_step, 4):
        assert not ok and unchanged
        assert records == ["inf in moe.experts.weight [ep 1, etp 0, pp 0, edp 1]"], records


def _save(rank, world, path):
    from tpamp.checkpoint import save_checkpoint

    st, model, opt = _fsdp_model(rank, world, 2, lambda ps: torch.optim.AdamW(ps, lr=0.01))
    model().backward()
    assert opt.step().update_successful
    named = model.named()
    save_checkpoint(path, dict(named), opt)
    state = {n: {k: v.full_tensor().clone() for k, v in opt.optimizer.state[p].items()
                 if k != "step"} for n, p in named}
    return {n: p.full_tensor().clone() for n, p in named}, state


def test_fsdp2_checkpoint_saved_at_ep2_loads_at_ep1(tmp_path):
    path = str(tmp_path / "fsdp-ep2")
    saved = run_workers(_save, 4, path)
    want_params, want_state = saved[0]
    for params, state in saved[1:]:  # every rank gathered the same global tensors
        for n in params:
            torch.testing.assert_close(params[n], want_params[n], rtol=0, atol=0)
    (params, state), = run_workers(_load_at_ep1, 1, path)
    assert set(params) == set(want_params)
    for name in params:
        torch.testing.assert_close(params[name], want_params[name], rtol=0, atol=0, msg=name)
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state[name][k], want_state[name][k], rtol=0, atol=0,
                                       msg=f"{name} {k}")


def _refusals(rank, world):
    from torch.distributed.fsdp import fully_shard

    st = initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    model = _Model(_dist_opt_model(rank, world, st), st, ep_dtensor=False)
    fully_shard(model.experts, mesh=st.mesh["dp"])  # on the dense DP mesh: not the expert layout
    fully_shard(model, mesh=st.mesh["dp"])
    for p in model.experts.parameters():
        tpamp.mark_expert_param(p)
    out = []
    for kw in ({}, {"expert_mesh": st.expert_mesh}):
        try:
            tpamp.fsdp.fully_shard_optimizer(
                torch.optim.SGD(model.parameters(), lr=0.1), st.mesh, **kw)
            out.append(None)
        except (ValueError, RuntimeError) as e:
            out.append(f"{type(e).__name__}: {e}")
    dist.barrier()
    return out


def test_fsdp2_refuses_experts_without_their_expert_mesh_layout():
    for missing, wrong in run_workers(_refusals, 4):
        assert missing is not None and "expert_mesh=" in missing, missing
        assert wrong is not None and "ValueError" in wrong and "expected" in wrong, wrong
