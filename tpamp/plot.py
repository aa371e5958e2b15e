"""A picture of a training log: ``python -m tpamp.plot LOG.jsonl [-o FILE.png]``.

Reads the JSON-lines log that :class:`tpamp.TrainingLogger` writes (scripts/train_gpt.py:
``--log-dir D`` gives ``D/log.jsonl``) and draws, one panel under the other on a shared
iteration axis:

1. loss: training loss per iteration, validation loss (``val_loss``) as points;
2. grad norm (log axis), with overflow-skipped steps (red ticks along the bottom, each labelled
   with the first parameter whose gradient held the inf/NaN when the record has ``nonfinite``,
   e.g. ``blocks.3.mlp.fc2.weight [tp 1, pp 1, dp 0] +2``; at most ``max_labels`` labels, the
   first ones), spike-skipped steps (orange crosses at the norm that was judged) and spikes only
   logged (orange triangles);
3. loss scale on a log2 axis, with the same skip ticks;
4. when the log has ``param_grad_norms``: a heatmap of log10 of the largest per-parameter grad
   norms over the logged iterations (rows in model order);
5. when the log has ``param_update_ratios`` (or only ``param_update_norms``): the same heatmap
   of log10 of each param's ||update|| / ||param|| (or ||update||), tpamp/update_norms.py.

Needs matplotlib (``pip install tpamp[plot]``); uses the non-interactive Agg backend.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Dict, List, Optional, Sequence

__all__ = ["read_log", "plot_log", "culprit_label", "main"]


def read_log(path: str) -> List[Dict]:
    """The records of a JSON-lines log, in file order. Raises ValueError naming the line that
    is not JSON or has no "iteration", and when the file holds no record."""
    records = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON record ({e})") from None
            if not isinstance(rec, dict) or "iteration" not in rec:
                raise ValueError(f"{path}:{n}: a record needs an 'iteration' field, got {line[:80]!r}")
            records.append(rec)
    if not records:
        raise ValueError(f"{path}: no records")
    return records


def _num(v) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan


def _spike(rec) -> Dict:
    return rec.get("spike") or {}


def _heatmap_rows(records: Sequence[Dict], max_params: int,
                  key: str = "param_grad_norms") -> List[str]:
    """Names of the max_params params with the largest mean log value of ``key``, in model order
    (order of first appearance in the records)."""
    order: Dict[str, int] = {}
    logs: Dict[str, List[float]] = {}
    for rec in records:
        for name, v in (rec.get(key) or {}).items():
            order.setdefault(name, len(order))
            if isinstance(v, (int, float)) and v > 0:
                logs.setdefault(name, []).append(math.log10(v))
    mean = {n: sum(v) / len(v) for n, v in logs.items()}
    chosen = sorted(mean, key=lambda n: -mean[n])[:max_params]
    return sorted(chosen, key=lambda n: order[n])


def culprit_label(rec: Dict) -> Optional[str]:
    """The label of a record's first non-finite grad ("NAME [tp 1, pp 1, dp 0] +2"), or None."""
    info = rec.get("nonfinite") or {}
    first = (info.get("first") or [None])[0]
    if not isinstance(first, dict) or "name" not in first:
        return None
    show = lambda k: "?" if first.get(k) is None else str(first.get(k))
    text = f"{first['name']} [tp {show('tp_rank')}, pp {show('pp_rank')}, dp {show('dp_rank')}]"
    more = int(info.get("total", 1)) - 1
    return text + (f" +{more}" if more > 0 else "")


_NO_MATPLOTLIB = ("tpamp.plot needs matplotlib, which is not installed: pip install matplotlib "
                  "(or pip install 'tpamp[plot]')")


def plot_log(
    records: Sequence[Dict], path: str, *, max_params: int = 24, title: Optional[str] = None,
    max_labels: int = 40,
) -> str:
    """Draw ``records`` (from :func:`read_log`) into the image file ``path`` (format from its
    suffix, e.g. .png); returns path. max_params: rows of the per-parameter heatmap (>= 1).
    max_labels: culprit labels on overflow-skipped steps (>= 0; the first ones). Raises
    ModuleNotFoundError with the install line when matplotlib is missing."""
    if not isinstance(max_params, int) or max_params < 1:
        raise ValueError(f"max_params must be an int >= 1, got {max_params!r}")
    if isinstance(max_labels, bool) or not isinstance(max_labels, int) or max_labels < 0:
        raise ValueError(f"max_labels must be an int >= 0, got {max_labels!r}")
    try:
        import matplotlib
    except ModuleNotFoundError as e:
        if e.name != "matplotlib":
            raise
        raise ModuleNotFoundError(_NO_MATPLOTLIB, name="matplotlib") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    import numpy as np

    it = np.array([_num(r["iteration"]) for r in records])
    loss = np.array([_num(r.get("loss")) for r in records])
    gnorm = np.array([_num(r.get("grad_norm")) for r in records])
    scale = np.array([_num(r.get("loss_scale")) for r in records])
    spike_skip = np.array([bool(_spike(r).get("skipped")) for r in records])
    spike_only = np.array([bool(_spike(r).get("spike")) and not _spike(r).get("skipped") for r in records])
    judged = np.array([_num(_spike(r).get("grad_norm")) for r in records])
    overflow = np.array([bool(r.get("skipped")) for r in records]) & ~spike_skip
    val = [(r["iteration"], _num(r["val_loss"])) for r in records if "val_loss" in r]

    heatmaps = []  # (record key, colour bar label, rows)
    update_key = ("param_update_ratios" if any(r.get("param_update_ratios") for r in records)
                  else "param_update_norms")
    for key, label in (("param_grad_norms", "log10 param grad norm"),
                       (update_key, "log10 update / param" if update_key == "param_update_ratios"
                        else "log10 param update norm")):
        rows = _heatmap_rows(records, max_params, key)
        if rows:
            heatmaps.append((key, label, rows))
    n_panels = 3 + len(heatmaps)
    heights = [1.0, 1.0, 0.6] + [max(1.2, 0.13 * len(rows)) for _, _, rows in heatmaps]
    fig, axes = plt.subplots(
        n_panels, 1, figsize=(10, 2.0 * sum(heights) + 0.6), sharex=True,
        gridspec_kw={"height_ratios": heights}, layout="constrained",
    )
    ax_loss, ax_norm, ax_scale = axes[:3]

    ax_loss.plot(it, loss, lw=0.9, color="tab:blue", label="train loss")
    if val:
        vx, vy = zip(*val)
        ax_loss.plot(vx, vy, "o-", ms=4, color="tab:green", label="validation loss")
    ax_loss.set_ylabel("loss")
    ax_loss.legend(loc="upper right", fontsize=8)

    ax_norm.plot(it, gnorm, lw=0.9, color="tab:purple", label="grad norm")
    if spike_skip.any():
        ax_norm.plot(it[spike_skip], judged[spike_skip], "x", ms=8, mew=2, color="tab:orange",
                     label=f"spike skipped ({int(spike_skip.sum())})")
    if spike_only.any():
        ax_norm.plot(it[spike_only], gnorm[spike_only], "^", ms=7, color="tab:orange",
                     label=f"spike logged ({int(spike_only.sum())})")
    for ax in (ax_norm, ax_scale):
        if overflow.any():
            ax.plot(it[overflow], np.zeros(int(overflow.sum())), "|", ms=12, mew=1.5,
                    color="tab:red", transform=ax.get_xaxis_transform(), clip_on=False,
                    label=f"overflow skipped ({int(overflow.sum())})")
    labelled = [(r["iteration"], culprit_label(r)) for r in records
                if r.get("skipped") and not _spike(r).get("skipped") and culprit_label(r)]
    for x, text in labelled[:max_labels]:  # the culprit of each overflow skip, up the red tick
        ax_norm.annotate(text, (x, 0.03), xycoords=("data", "axes fraction"), rotation=90,
                         fontsize=6, color="tab:red", va="bottom", ha="right", alpha=0.85)
    finite = gnorm[np.isfinite(gnorm)]
    if finite.size and (finite > 0).all() and finite.max() > 10 * finite.min():
        ax_norm.set_yscale("log")
        ax_norm.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax_norm.set_ylabel("grad norm")
    ax_norm.legend(loc="upper right", fontsize=8)

    ax_scale.step(it, scale, where="post", lw=1.0, color="tab:gray")
    if np.isfinite(scale).any() and (scale[np.isfinite(scale)] > 0).all():
        ax_scale.set_yscale("log", base=2)
    ax_scale.set_ylabel("loss scale")

    for ax_heat, (key, label, rows) in zip(axes[3:], heatmaps):
        logged = [r for r in records if r.get(key)]
        xs = np.array([r["iteration"] for r in logged], dtype=float)
        grid = np.full((len(rows), len(logged)), np.nan)
        for j, r in enumerate(logged):
            for i, name in enumerate(rows):
                v = r[key].get(name)
                if isinstance(v, (int, float)) and v > 0:
                    grid[i, j] = math.log10(v)
        step = np.diff(xs).min() if len(xs) > 1 else 1.0
        img = ax_heat.imshow(
            np.ma.masked_invalid(grid), aspect="auto", interpolation="nearest", cmap="viridis",
            extent=(xs[0] - step / 2, xs[-1] + step / 2, len(rows) - 0.5, -0.5),
        )
        # imshow pins the shared x limits to the image: widen them to every iteration
        ax_heat.set_xlim(min(np.nanmin(it), xs[0] - step / 2), max(np.nanmax(it), xs[-1] + step / 2))
        ax_heat.set_yticks(range(len(rows)))
        ax_heat.set_yticklabels(rows, fontsize=6)
        total = len({n for r in logged for n in r[key]})
        ax_heat.set_ylabel(f"top {len(rows)} of {total} params")
        cbar = fig.colorbar(img, ax=ax_heat, location="right", pad=0.01, fraction=0.03)
        cbar.set_label(label)
    axes[-1].set_xlabel("iteration")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(title or "training log", fontsize=11)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tpamp.plot", description=__doc__.split("\n\n")[0])
    p.add_argument("log", help="a JSON-lines log (log.jsonl)")
    p.add_argument("-o", "--output", default=None, help="image file (default: LOG's name with .png)")
    p.add_argument("--max-params", type=int, default=24, help="heatmap rows (largest mean norm)")
    p.add_argument("--title", default=None)
    p.add_argument("--max-labels", type=int, default=40,
                   help="culprit labels on overflow-skipped steps (the first ones)")
    args = p.parse_args(argv)
    out = args.output or os.path.splitext(args.log)[0] + ".png"
    try:
        records = read_log(args.log)
        plot_log(records, out, max_params=args.max_params, title=args.title or args.log,
                 max_labels=args.max_labels)
    except ModuleNotFoundError as e:
        if e.name != "matplotlib":
            raise
        print(_NO_MATPLOTLIB, file=sys.stderr)  # one line, no traceback
        return 2
    except (OSError, ValueError) as e:
        print(f"tpamp.plot: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
