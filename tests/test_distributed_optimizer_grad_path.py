"""DistributedOptimizer's gradient path (grads into the bucketed main_grad buffers: the first
copied into its zeroed slot, later ones added chunk by chunk; the gloo ring reduce-scatter and
all-gather) against a single-process float64 reference of the DP-mean gradient and of one SGD
step (lr=1: main param = param - mean grad), at DP 2, 3 and 4, with several microbatches,
overlapped or not, a grad set by hand and a param whose grad never arrives."""

import math

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_workers

import tpamp
import tpamp.distributed_optimizer as dopt

# odd sizes: the shard boundaries of DP 2, 3, 4 fall inside params; "never" gets no grad
SHAPES = {"w1": (7, 5), "b1": (7,), "w2": (3, 7), "b2": (3,), "ln": (13,), "never": (5,)}
MICROBATCHES = 3
EPS = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 2.0**-23}


def _values(dtype):
    g = torch.Generator().manual_seed(0)
    return {k: (torch.randn(s, generator=g) * 4).to(dtype) for k, s in SHAPES.items()}


def _grad(name, rank, step, mb):
    """float64 grad of one rank and microbatch: multiples of 1/4 in [-2, 2], so any sum of
    them over 3 microbatches and 4 ranks is exact in bf16, fp16 and fp32."""
    i = list(SHAPES).index(name)
    g = torch.Generator().manual_seed(10000 * step + 100 * mb + 10 * i + rank)
    return torch.randint(-8, 9, SHAPES[name], generator=g, dtype=torch.int64).double() / 4


def _reference(world, step):
    """float64 DP-mean gradient of every param (the 'never' param's is zero)."""
    return {k: sum(_grad(k, r, step, mb) for r in range(world) for mb in range(MICROBATCHES))
            / world if k != "never" else torch.zeros(SHAPES[k], dtype=torch.float64)
            for k in SHAPES}


def _run(rank, world, cases):
    dopt._ADD_CHUNK = 4  # so the chunked add of a later microbatch runs over many chunks
    return [_run_one(rank, world, *case) for case in cases]


def _run_one(rank, world, dtype, reduce_in_fp32, overlap):
    params = {k: torch.nn.Parameter(v.clone()) for k, v in _values(dtype).items()}
    opt = tpamp.DistributedOptimizer(
        torch.optim.SGD(list(params.values()), lr=1.0),
        grad_scaler=tpamp.ConstantGradScaler(1.0) if dtype == torch.float16 else None,
        log_num_zeros_in_grad=True, data_parallel_group=dist.group.WORLD,
        grad_reduce_in_fp32=reduce_in_fp32, overlap_grad_reduce=overlap, bucket_size=20,
        param_names=list(params.items()))
    out = []
    for step in range(2):
        for mb in range(MICROBATCHES):
            last = mb == MICROBATCHES - 1
            # every grad through autograd's hook, but b1's on the last microbatch: set by hand
            loss = sum((p.float() * _grad(k, rank, step, mb).float()).sum()
                       for k, p in params.items()
                       if k != "never" and not (last and k == "b1"))
            with opt.no_sync() if overlap and not last else torch.enable_grad():
                loss.backward()
            if last:
                params["b1"].grad = _grad("b1", rank, step, mb).to(dtype)
        ok, norm, zeros = opt.step()
        out.append((bool(ok), norm, zeros, {k: p.detach().double().clone()
                                            for k, p in params.items()}))
        opt.zero_grad()
    return out


CASES = {
    2: [(d, fp32, ov) for d in (torch.float16, torch.bfloat16, torch.float32)
        for fp32 in (True, False) for ov in (False, True)],
    3: [(torch.float16, True, True), (torch.bfloat16, True, False), (torch.float32, True, True)],
    4: [(torch.bfloat16, True, True), (torch.float16, False, True), (torch.float32, False, False)],
}


@pytest.mark.parametrize("world", sorted(CASES))
def test_grad_path_matches_the_fp64_dp_mean_and_sgd_step(world):
    per_rank = run_workers(_run, world, CASES[world], timeout=60.0)
    for ci, (dtype, reduce_in_fp32, overlap) in enumerate(CASES[world]):
        master = {k: v.float() for k, v in _values(dtype).items()}  # the fp32 main params
        for step in range(2):
            mean = _reference(world, step)
            norm = math.sqrt(sum(float(g.pow(2).sum()) for g in mean.values()))
            zeros = sum(int((g == 0).sum()) for g in mean.values())
            # lr=1 SGD: the fp32 main param minus the mean grad, rounded once to fp32; the
            # model param is that rounded to the model dtype
            master = {k: (master[k].double() - mean[k]).float() for k in master}
            want = {k: v.to(dtype).double() for k, v in master.items()}
            for rank in range(world):
                ok, got_norm, got_zeros, got = per_rank[rank][ci][step]
                what = f"DP {world} {dtype} fp32 reduce {reduce_in_fp32} overlap {overlap} " \
                       f"step {step} rank {rank}"
                assert ok, what
                # the mean is exact for d = 2, 4 (1/d a power of two); at d = 3 the fp32 1/3
                # rounds (|mean| <= 6: under 2**-20), which may move a model param by one ulp
                # of its dtype (a misplaced chunk would be off by >= 1/12)
                assert got_norm == pytest.approx(norm, rel=1e-6), what
                assert got_zeros == zeros, what
                for k in SHAPES:
                    torch.testing.assert_close(got[k], want[k], rtol=EPS[dtype] if world == 3 else 0,
                                               atol=2.0**-18 if world == 3 else 0, msg=lambda m: f"{what} {k}: {m}")
