"""Time the optimizer step of this working tree against another git revision, in one run.

A benchmark, not a test. It checks out REV into a scratch directory (``git worktree add
--detach``; with ``--rev-dir DIR`` an export kept in DIR and reused on later runs), gives it
kernels (copied from this tree when REV's csrc/ and setup.py are the same as the working
tree's, else built there with ``setup.py build_ext --inplace``, CPU kernels only), and then
times ``MixedPrecisionOptimizer.step()`` in fresh processes, alternating the two trees in ABBA
order over ``--rounds`` rounds so that drift of the machine hits both. Each process builds the
same fp16 model (``--numel`` elements in ``--tensors`` tensors of odd sizes), AdamW (lr 1e-4,
weight decay 0.01) behind a DynamicGradScaler, clip_grad 1.0 and the zero count: the one-pass
path of both revisions. It prints each round's medians and the paired median of the per-round
ratio working tree / REV (below 1: the working tree is faster). With ``--bare``, a third
process per round times ``torch.optim.AdamW(fused=True).step()`` alone on fp32 params and grads
of the same sizes (the floor), and both trees' paired ratios to it are printed. The given grads
stay referenced until the timer has stopped: the tpamp step releases the model grads it consumed
(as Megatron-LM's does), ``AdamW.step()`` leaves that to ``zero_grad()``, and neither is timed
freeing them (1-2 ms for ~200 MB of grads on this machine).

Run from the repository root, with the kernels of this tree built (``pip install -e .``)::

    python scripts/bench_revision.py --rev main --numel 2e7 --rounds 8
    python scripts/bench_revision.py --rev 98824f5 --json out.json
    python scripts/bench_revision.py --rev dd26f99 --rev-dir /tmp/tpamp-dd26f99  # built once

Each process also measures its CPU time (``time.process_time``); with ``--threads 1`` on a
busy machine the paired CPU-time ratios are the steadier figures (wall time then counts the
time the process waited for a core).

Quote the paired median with the machine, the torch version, the date and the load average
(docs/benchmarks.md); a busy machine makes the rounds disagree.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The timed child: runs with PYTHONPATH set to one of the two trees.
CHILD = r"""
import json, statistics, sys, time
import torch
import tpamp

numel, ntensors, steps, warmup = int(float(sys.argv[1])), int(sys.argv[2]), int(sys.argv[3]), 3
bare = sys.argv[4] == "bare"
torch.manual_seed(0)
sizes = [numel // ntensors + (i * 37) % 101 for i in range(ntensors)]
params = [torch.nn.Parameter(torch.randn(n).half()) for n in sizes]
grads = [torch.randn(n).half() * 1e-2 for n in sizes]
if bare:  # the floor: AdamW(fused=True).step() alone on fp32 params and fp32 grads
    params = [torch.nn.Parameter(p.detach().float()) for p in params]
    grads = [g.float() for g in grads]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)
else:
    opt = tpamp.MixedPrecisionOptimizer(
        torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01),
        grad_scaler=tpamp.DynamicGradScaler(initial_scale=1.0), clip_grad=1.0,
        log_num_zeros_in_grad=True)
times, cpu_times = [], []
for i in range(warmup + steps):
    for p, g in zip(params, grads):
        p.grad = g.clone()
    held = [p.grad for p in params]  # freed after the timer, for both (module docstring)
    start, cpu_start = time.perf_counter(), time.process_time()
    opt.step()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    opt.zero_grad()
    del held
    if i >= warmup:
        times.append(elapsed * 1e3)
        cpu_times.append(cpu * 1e3)
print(json.dumps({"ms": statistics.median(times), "cpu_ms": statistics.median(cpu_times),
                  "tpamp": tpamp.__file__}))
"""


def _git(*args, cwd=ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout


def _kernels_differ(rev: str) -> bool:
    return bool(_git("diff", "--name-only", rev, "--", "csrc", "setup.py").strip())


def _build_or_copy_kernels(rev: str, tree: str) -> None:
    built = glob.glob(os.path.join(ROOT, "tpamp", "_C*.so"))
    if not built:
        raise SystemExit("this tree has no built kernels: pip install --no-build-isolation -e .")
    if _kernels_differ(rev):
        print(f"bench_revision: {rev}'s csrc/ differs from this tree: building its kernels",
              flush=True)
        # the CPU kernels only (a revision's setup.py that predates a variable ignores it)
        env = dict(os.environ, TPAMP_BUILD_EXT="1", TPAMP_BUILD_CUDA="0", TPAMP_BUILD_SIMT="0")
        subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tree,
                       check=True, env=env, stdout=subprocess.DEVNULL)
    else:
        for so in built:
            shutil.copy2(so, os.path.join(tree, "tpamp"))


def prepare(rev: str, scratch: str) -> str:
    """A checkout of ``rev`` under ``scratch`` with kernels that match its csrc/."""
    tree = os.path.join(scratch, "rev")
    _git("worktree", "add", "--detach", tree, rev)
    _build_or_copy_kernels(rev, tree)
    return tree


def prepare_kept(rev: str, tree: str) -> str:
    """``rev`` exported (``git archive``, no worktree) into ``tree`` with its kernels, kept for
    later runs: reused as it is when ``tree`` already holds that commit with built kernels."""
    sha = _git("rev-parse", rev + "^{commit}").strip()
    stamp = os.path.join(tree, ".bench_revision_commit")
    if os.path.exists(stamp) and glob.glob(os.path.join(tree, "tpamp", "_C*.so")):
        with open(stamp, encoding="utf-8") as f:
            if f.read().strip() == sha:
                print(f"bench_revision: reusing {tree} ({sha[:12]})", flush=True)
                return tree
    if os.path.exists(tree) and os.listdir(tree):
        raise SystemExit(f"--rev-dir {tree} exists and holds something else than {rev} "
                         f"({sha[:12]}) with built kernels; give an empty or new directory")
    os.makedirs(tree, exist_ok=True)
    archive = subprocess.run(["git", "archive", sha], cwd=ROOT, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
    _build_or_copy_kernels(rev, tree)
    with open(stamp, "w", encoding="utf-8") as f:
        f.write(sha + "\n")
    return tree


def time_tree(tree: str, args, mode: str = "tpamp") -> float:
    env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS=str(args.threads))
    out = subprocess.run([sys.executable, "-c", CHILD, str(args.numel), str(args.tensors),
                          str(args.steps), mode], env=env, cwd=tree, check=True,
                         capture_output=True, text=True).stdout  # cwd: `python -c` puts it first on sys.path
    row = json.loads(out.strip().splitlines()[-1])
    if not row["tpamp"].startswith(tree):
        raise SystemExit(f"the child imported {row['tpamp']}, not the tree {tree}")
    return row["ms"], row["cpu_ms"]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rev", required=True, help="git revision to compare with")
    p.add_argument("--numel", type=float, default=2e7)
    p.add_argument("--tensors", type=int, default=196)
    p.add_argument("--steps", type=int, default=15, help="timed steps per process")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--bare", action="store_true",
                   help="also time torch.optim.AdamW(fused=True).step() alone on fp32 params and "
                        "grads of the same sizes in every round (the floor), and report both "
                        "trees' paired ratio to it")
    p.add_argument("--rev-dir", default=None,
                   help="keep REV's tree and kernels in this directory and reuse them on the next "
                        "run (default: a scratch worktree, built and removed each run)")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        p.error(f"--rounds and --steps must be >= 1, got {args.rounds} and {args.steps}")
    _git("rev-parse", "--verify", args.rev + "^{commit}")
    scratch = tempfile.mkdtemp(prefix="tpamp-bench-rev-")
    try:
        if args.rev_dir:
            rev_tree = prepare_kept(args.rev, os.path.abspath(args.rev_dir))
        else:
            rev_tree = prepare(args.rev, scratch)
        rounds, cpu_rounds = [], []
        for r in range(args.rounds):
            order = [("work", ROOT, "tpamp"), ("rev", rev_tree, "tpamp")]
            if args.bare:
                order.append(("bare", ROOT, "bare"))
            if r % 2:
                order.reverse()  # ABBA: neither tree always runs first
            timed = {name: time_tree(tree, args, mode) for name, tree, mode in order}
            ms = {name: t[0] for name, t in timed.items()}
            cpu_rounds.append({name: t[1] for name, t in timed.items()})
            rounds.append(ms)
            line = (f"round {r + 1}: working tree {ms['work']:.2f} ms, {args.rev} "
                    f"{ms['rev']:.2f} ms, ratio {ms['work'] / ms['rev']:.3f}")
            if args.bare:
                line += (f"; bare AdamW(fused) {ms['bare']:.2f} ms, working tree / bare "
                         f"{ms['work'] / ms['bare']:.3f}, {args.rev} / bare "
                         f"{ms['rev'] / ms['bare']:.3f}")
            print(line, flush=True)
        ratios = [ms["work"] / ms["rev"] for ms in rounds]
        summary = {
            "rev": args.rev, "numel": int(args.numel), "tensors": args.tensors,
            "threads": args.threads, "rounds": rounds,
            "median_ms_work": statistics.median(ms["work"] for ms in rounds),
            "median_ms_rev": statistics.median(ms["rev"] for ms in rounds),
            "paired_median_ratio": statistics.median(ratios),
            "cpu_rounds": cpu_rounds,
            "paired_median_cpu_ratio": statistics.median(c["work"] / c["rev"] for c in cpu_rounds),
            "load_average": os.getloadavg(),
        }
        print(f"paired median working tree / {args.rev}: {summary['paired_median_ratio']:.3f} "
              f"(medians {summary['median_ms_work']:.2f} vs {summary['median_ms_rev']:.2f} ms; "
              f"load average {summary['load_average'][0]:.2f})")
        print(f"paired median of the process CPU time, working tree / {args.rev}: "
              f"{summary['paired_median_cpu_ratio']:.3f}")
        if args.bare:
            for name, label in (("work", "working tree"), ("rev", args.rev)):
                key = f"paired_median_{name}_over_bare"
                summary[key] = statistics.median(ms[name] / ms["bare"] for ms in rounds)
                summary[key + "_cpu"] = statistics.median(c[name] / c["bare"] for c in cpu_rounds)
                print(f"paired median {label} / bare AdamW(fused=True): {summary[key]:.3f} "
                      f"(process CPU time: {summary[key + '_cpu']:.3f})")
            summary["median_ms_bare"] = statistics.median(ms["bare"] for ms in rounds)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(summary, f, indent=1)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", os.path.join(scratch, "rev")],
                       cwd=ROOT, capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
