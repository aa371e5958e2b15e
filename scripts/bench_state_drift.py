"""How far narrow optimizer state moves the params from the fp32-state run (docs/spec.md section 9).

A benchmark, not a test. 200 AdamW steps (lr 1e-3, weight decay 0.01, betas (0.9, 0.999), eps
1e-8, grad-norm clipping at 1.0) on 5 float32 tensors of 120,832 elements (initial values
N(0, 0.02)), with the same random bf16-representable grads (N(0, 0.01) rounded to bfloat16)
given to every optimizer. Reported per optimizer state:

    drift / movement = mean |param - reference param| / mean |reference param - initial param|

where the reference is torch.optim.AdamW with float32 state on the same grads. The grads are
clipped once per step (torch.nn.utils.clip_grad_norm_'s arithmetic) and every optimizer gets the
same clipped grads, so the rows differ by their state only (``--clip-in-optimizer``: tpamp's
rows clip inside FP32Optimizer instead, clip_grad=1.0, whose fused norm may differ from torch's
by a float32 rounding; the trajectories then part after a few code flips). The rows:

    tpamp fp32           tpamp.FP32Optimizer (one-pass fused step), fp32 state
    tpamp bf16           exp_avg / exp_avg_sq bfloat16
    tpamp uint8          exp_avg / exp_avg_sq uint8 (the dynamic map, blocks of 256)
    tpamp e4m3           exp_avg / exp_avg_sq float8_e4m3fn (blocks of 256, root of exp_avg_sq)
    torchao AdamW8bit    torchao.optim.AdamW8bit (dynamic map, blocks of 256)
    torchao AdamWFp8     torchao.optim.AdamWFp8 (e4m3, blockwise scale)
    torchao AdamW4bit    torchao.optim.AdamW4bit

torchao is a benchmark-only dependency (``pip install torchao``; its rows are skipped, with a
note, when it does not import). Its optimizers compile their step with torch.compile (a C++
compiler on CPU). Every tensor is a multiple of 256 elements and >= 4096, so torchao quantizes
them all.

Run::

    python scripts/bench_state_drift.py                # every row, about 2 min on 2 cores
    python scripts/bench_state_drift.py --steps 50 --json out.json
    python scripts/bench_state_drift.py --fallback     # tpamp rows on the PyTorch reference
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
import tpamp  # noqa: E402

SHAPES = [(256, 256), (128, 256), (32, 256), (32, 256), (24, 256)]  # 120,832 elements
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
CLIP = 1.0

TPAMP_ROWS = {
    "tpamp fp32": dict(),
    "tpamp bf16": dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16),
    "tpamp uint8": dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8),
    "tpamp e4m3": dict(exp_avg_dtype=torch.float8_e4m3fn, exp_avg_sq_dtype=torch.float8_e4m3fn),
}
TORCHAO_ROWS = {"torchao AdamW8bit": "AdamW8bit", "torchao AdamWFp8": "AdamWFp8",
                "torchao AdamW4bit": "AdamW4bit"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rows", default=",".join(list(TPAMP_ROWS) + list(TORCHAO_ROWS)),
                   help="comma-separated row names (see the module doc)")
    p.add_argument("--clip-in-optimizer", action="store_true",
                   help="tpamp rows clip inside FP32Optimizer (clip_grad=1.0) instead of taking "
                        "the grads clipped once for every row")
    p.add_argument("--fallback", action="store_true",
                   help="tpamp rows on the PyTorch reference step (tpamp.ops.force_fallback)")
    p.add_argument("--json", default=None, help="also write the results here")
    return p.parse_args(argv)


def _params(init):
    return [torch.nn.Parameter(t.clone()) for t in init]


def _build(name, params, clip_in_optimizer=False):
    """(step function taking the list of grads) for one row."""
    if name in TPAMP_ROWS:
        opt = tpamp.FP32Optimizer(torch.optim.AdamW(params, **HYPER),
                                  clip_grad=CLIP if clip_in_optimizer else 0.0,
                                  **TPAMP_ROWS[name])

        def step(grads):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
        return step
    if name in TORCHAO_ROWS:
        import torchao.optim

        cls = getattr(torchao.optim, TORCHAO_ROWS[name])
        opt = cls(params, **HYPER)
    elif name == "reference":
        opt = torch.optim.AdamW(params, **HYPER, foreach=False)
    else:
        raise SystemExit(f"unknown row {name!r}")

    def step(grads):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    return step


def main(argv=None):
    args = parse_args(argv)
    if args.fallback:
        with tpamp.ops.force_fallback():
            return _run(args)
    return _run(args)


def _run(args):
    rows = args.rows.split(",")
    notes = []
    if any(r in TORCHAO_ROWS for r in rows):
        try:
            import torchao.optim  # noqa: F401
        except Exception as e:  # noqa: BLE001 - any import failure: skip those rows
            notes.append(f"torchao rows skipped: {type(e).__name__}: {e}")
            rows = [r for r in rows if r not in TORCHAO_ROWS]
    gen = torch.Generator().manual_seed(args.seed)
    init = [torch.randn(s, generator=gen) * 0.02 for s in SHAPES]
    runs = {"reference": _params(init)}
    runs.update({r: _params(init) for r in rows})
    steps = {r: _build(r, ps, args.clip_in_optimizer) for r, ps in runs.items()}
    seconds = {r: 0.0 for r in runs}
    for _ in range(args.steps):
        grads = [(torch.randn(s, generator=gen) * 0.01).to(torch.bfloat16).float()
                 for s in SHAPES]
        raw = [g.clone() for g in grads]
        torch.nn.utils.clip_grads_with_norm_(grads, CLIP, torch.nn.utils.get_total_norm(grads))
        for r, step in steps.items():
            t0 = time.perf_counter()
            step(raw if args.clip_in_optimizer and r in TPAMP_ROWS else grads)
            seconds[r] += time.perf_counter() - t0
    ref = torch.cat([p.detach().reshape(-1) for p in runs["reference"]]).double()
    start = torch.cat([t.reshape(-1) for t in init]).double()
    movement = (ref - start).abs().mean().item()
    results = {}
    print(f"{args.steps} AdamW steps, {sum(t.numel() for t in init):,} elements in "
          f"{len(SHAPES)} tensors; reference: torch.optim.AdamW, float32 state")
    print(f"  mean |reference movement| = {movement:.4g}")
    print(f"  {'optimizer state':<20} {'drift / movement':>16} {'s / step':>9}")
    for r in rows:
        cur = torch.cat([p.detach().reshape(-1) for p in runs[r]]).double()
        drift = (cur - ref).abs().mean().item() / movement
        results[r] = {"drift_over_movement": drift, "seconds_per_step": seconds[r] / args.steps}
        print(f"  {r:<20} {drift:>16.4f} {seconds[r] / args.steps:>9.4f}")
    if "tpamp uint8" in rows and "torchao AdamW8bit" in rows:
        same = all(torch.equal(a.detach(), b.detach())
                   for a, b in zip(runs["tpamp uint8"], runs["torchao AdamW8bit"]))
        results["tpamp uint8"]["params_equal_torchao_adamw8bit"] = same
        print(f"  tpamp uint8 params bit for bit torchao AdamW8bit's: {same}")
    for n in notes:
        print(f"  note: {n}")
    if args.json:
        meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "machine": platform.processor() or platform.machine(),
                "torch": torch.__version__, "args": vars(args), "notes": notes}
        try:
            import torchao
            meta["torchao"] = torchao.__version__
        except Exception:  # noqa: BLE001
            pass
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
