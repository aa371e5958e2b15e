"""Grad-norm logs a user reads (SPEC.md section 5), in Megatron-LM's format.

Per logged iteration, a line such as::

     iteration       10/     300 | lr: 3.000E-04 | loss: 2.713E+00 | loss scale: 65536.0 |
     grad norm: 0.873 | num zeros: 0 | number of skipped iterations:   0 |
     number of nan iterations:   0 |

a JSON-lines record for every iteration (iteration, loss, lr, loss_scale, grad_norm, num_zeros,
skipped, nan, plus any extra fields), and TensorBoard scalars ``loss-scale``, ``grad-norm``,
``num-zeros`` (and ``lm loss``, ``learning-rate``) when a log dir is given and TensorBoard is
installed. Only the logging rank (Megatron: last pipeline stage, TP rank 0) should pass
``enabled=True``.

With per-parameter grad norms (``record(..., param_grad_norms={name: norm})``, see
tpamp/param_norms.py) the record holds the top-K as ``"param_grad_norms"`` (model order), a
readable block of them (largest first) follows the line, and TensorBoard gets ``grad-norm/NAME``.
With a spike detector (``record(..., spike=detector.last)``, tpamp/spikes.py) the record holds
``"spike"`` (the decision: judged grad norm and loss, z-scores, spike, skipped, overflow), spike
skips are counted apart from overflow skips, and the line gains ``number of spike skips``.
:meth:`TrainingLogger.summary` gives the run's counts for summary.json.
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from collections import Counter
from typing import Dict, Optional, TextIO

from tpamp.param_norms import top_k as _top_k

__all__ = ["TrainingLogger"]


class TrainingLogger:
    """Count skipped and nan iterations and write the line, the JSONL record and TensorBoard.

    Args:
        train_iters: total iterations (for the "N/ M" of the line).
        log_interval: print the line every this many iterations (>= 1).
        jsonl_path: file for one JSON record per iteration (directories are created), or None.
        tensorboard_dir: directory for TensorBoard event files, or None. Needs the
            ``tensorboard`` package; without it a warning is given and scalars are not written.
        enabled: False on every rank but the logging one (all calls become no-ops that still
            return the record).
        stream: where lines go (default sys.stdout).
        param_grad_norms_top_k: how many per-parameter norms a record keeps and the block
            shows (the largest; >= 1; None: all).
    """

    def __init__(
        self,
        train_iters: int,
        *,
        log_interval: int = 10,
        jsonl_path: Optional[str] = None,
        tensorboard_dir: Optional[str] = None,
        enabled: bool = True,
        stream: Optional[TextIO] = None,
        param_grad_norms_top_k: Optional[int] = None,
    ):
        if not isinstance(log_interval, int) or log_interval < 1:
            raise ValueError(f"log_interval must be an int >= 1, got {log_interval!r}")
        if not isinstance(train_iters, int) or train_iters < 0:
            raise ValueError(f"train_iters must be an int >= 0, got {train_iters!r}")
        if param_grad_norms_top_k is not None and (
            not isinstance(param_grad_norms_top_k, int) or param_grad_norms_top_k < 1
        ):
            raise ValueError(
                f"param_grad_norms_top_k must be an int >= 1 or None, got {param_grad_norms_top_k!r}"
            )
        self.param_grad_norms_top_k = param_grad_norms_top_k
        self.spike_skips = 0  # skipped for a spike (also counted in skipped_iters)
        self.spikes = 0  # flagged by the detector, whatever its policy
        self.param_grad_norm_leaders: Counter = Counter()  # name -> records it was the largest
        self._interval_spike_skips = 0
        self._spike_watched = False
        self.train_iters = train_iters
        self.log_interval = log_interval
        self.enabled = enabled
        self.stream = stream
        self.skipped_iters = 0
        self.nan_iters = 0
        self.loss_scale_changes = 0
        self._last_scale: Optional[float] = None
        self._interval_skipped = 0
        self._interval_nan = 0
        self._jsonl = None
        self._tb = None
        if enabled and jsonl_path:
            os.makedirs(os.path.dirname(os.path.abspath(jsonl_path)), exist_ok=True)
            self._jsonl = open(jsonl_path, "w", encoding="utf-8")
        if enabled and tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                warnings.warn(
                    "tensorboard is not installed (pip install tensorboard): no TensorBoard "
                    "scalars will be written",
                    RuntimeWarning,
                    stacklevel=2,
                )
            else:
                self._tb = SummaryWriter(log_dir=tensorboard_dir)

    def record(
        self, iteration: int, loss: float, lr: float, loss_scale: float, result, *,
        param_grad_norms: Optional[Dict[str, float]] = None, spike=None, **extra,
    ) -> dict:
        """Account for one iteration and return its JSON record.

        result: the :class:`tpamp.StepResult` of the iteration's step. loss: the iteration's
        training loss (float; nan/inf counts as a nan iteration, as in Megatron-LM).
        param_grad_norms: {name: norm} of every param (``ParamGradNormTracker.norms``) on the
        iterations that computed them; the record keeps the top-K (non-finite as null).
        spike: the :class:`tpamp.SpikeDecision` of the step (``SpikeDetector.last``), or None.
        Extra keyword fields go into the record unchanged (JSON-serialisable).
        """
        update_successful, grad_norm, num_zeros = result
        loss = float(loss)
        loss_scale = float(loss_scale)
        skipped = not bool(update_successful)
        nan = not math.isfinite(loss)
        self.skipped_iters += skipped
        self.nan_iters += nan
        self._interval_skipped += skipped
        self._interval_nan += nan
        if self._last_scale is not None and loss_scale != self._last_scale:
            self.loss_scale_changes += 1
        self._last_scale = loss_scale
        rec = {
            "iteration": int(iteration),
            "loss": loss if not nan else None,  # JSON has no nan/inf: null, with "nan": true
            "lr": float(lr),
            "loss_scale": loss_scale,
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "num_zeros": None if num_zeros is None else int(num_zeros),
            "skipped": skipped,
            "nan": nan,
        }
        top = None
        if param_grad_norms is not None:
            top = _top_k(param_grad_norms, self.param_grad_norms_top_k)
            if top:
                self.param_grad_norm_leaders[next(iter(top))] += 1
            order = {name: i for i, name in enumerate(param_grad_norms)}  # model order
            rec["param_grad_norms"] = {
                name: (v if math.isfinite(v) else None)
                for name, v in sorted(top.items(), key=lambda kv: order[kv[0]])
            }
        if spike is not None:
            self._spike_watched = True
            self.spikes += bool(spike.spike)
            self.spike_skips += bool(spike.skipped)
            self._interval_spike_skips += bool(spike.skipped)
            rec["spike"] = spike.as_record()
        rec.update(extra)
        if not self.enabled:
            return rec
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(rec) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            self._tb.add_scalar("loss-scale", loss_scale, iteration)
            self._tb.add_scalar("learning-rate", lr, iteration)
            if not nan:
                self._tb.add_scalar("lm loss", loss, iteration)
            if grad_norm is not None:
                self._tb.add_scalar("grad-norm", float(grad_norm), iteration)
            if num_zeros is not None:
                self._tb.add_scalar("num-zeros", int(num_zeros), iteration)
            for name, v in (top or {}).items():
                if math.isfinite(v):
                    self._tb.add_scalar(f"grad-norm/{name}", v, iteration)
        if iteration % self.log_interval == 0:
            text = self.format_line(rec)
            if top:
                text += "\n" + self.format_param_grad_norms(top, len(param_grad_norms))
            print(text, file=self.stream or sys.stdout, flush=True)
            self._interval_skipped = 0
            self._interval_nan = 0
            self._interval_spike_skips = 0
        return rec

    def format_line(self, rec: dict) -> str:
        """Megatron-LM's training_log line for one record."""
        parts = [f" iteration {rec['iteration']:8d}/{self.train_iters:8d}"]
        parts.append(f"lr: {rec['lr']:.3E}")
        loss = rec["loss"]
        parts.append(f"loss: {loss:.4E}" if loss is not None else "loss: nan")
        parts.append(f"loss scale: {rec['loss_scale']:.1f}")
        if rec["grad_norm"] is not None:
            parts.append(f"grad norm: {rec['grad_norm']:.3f}")
        if rec["num_zeros"] is not None:
            parts.append(f"num zeros: {rec['num_zeros']}")
        parts.append(f"number of skipped iterations: {self._interval_skipped:3d}")
        parts.append(f"number of nan iterations: {self._interval_nan:3d}")
        if self._spike_watched:
            parts.append(f"number of spike skips: {self._interval_spike_skips:3d}")
        return " | ".join(parts) + " |"

    @staticmethod
    def format_param_grad_norms(top: Dict[str, float], total: int) -> str:
        """The readable block of per-parameter grad norms, largest first."""
        width = max(len(name) for name in top)
        lines = [f"   param grad norms (top {len(top)} of {total}):"]
        lines += [f"     {name:<{width}}  {v:.4E}" for name, v in top.items()]
        return "\n".join(lines)

    def summary(self, leaders: int = 5) -> dict:
        """The run's counts for summary.json: skipped iterations (all), of them overflow skips
        and spike skips, spikes flagged, nan iterations, loss-scale changes, and the params that
        most often had the largest grad norm of a record ([name, records] pairs)."""
        return {
            "skipped_iterations": self.skipped_iters,
            "overflow_skips": self.skipped_iters - self.spike_skips,
            "spike_skips": self.spike_skips,
            "spikes": self.spikes,
            "nan_iterations": self.nan_iters,
            "loss_scale_changes": self.loss_scale_changes,
            "param_grad_norm_leaders": [
                [name, n] for name, n in self.param_grad_norm_leaders.most_common(leaders)
            ],
        }

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

