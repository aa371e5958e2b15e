"""Grad-norm logs a user reads (docs/spec.md section 5), in Megatron-LM's format.

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
With per-parameter update norms (``record(..., param_update_norms=tracker.update_norms,
param_update_ratios=tracker.update_ratios)``, tpamp/update_norms.py) the record holds the top-K
by update norm as ``"param_update_norms"`` and their ||update|| / ||param|| as
``"param_update_ratios"`` (model order), a block of them follows the grad-norm block, and
TensorBoard gets ``update-norm/NAME`` and ``update-ratio/NAME``; with a TensorParallelMuon
(``param_momentum_norms=tracker.momentum_norms``) those params' momentum norms before the
orthogonalisation go into ``"param_momentum_norms"`` and ``momentum-norm/NAME``.
With a spike detector (``record(..., spike=detector.last)``, tpamp/spikes.py) the record holds
``"spike"`` (the decision: judged grad norm and loss, z-scores, spike, skipped, overflow), spike
skips are counted apart from overflow skips, and the line gains ``number of spike skips``.
:meth:`TrainingLogger.summary` gives the run's counts for summary.json.
With the optimizer's non-finite attribution (``record(..., nonfinite=opt.last_nonfinite)``,
tpamp/nonfinite.py) the record of an iteration whose grads held inf/NaN carries
``"nonfinite": {"total": N, "first": [up to 16 records]}``, the line names the first culprit
(``skipped: inf in blocks.3.mlp.fc2.weight [tp 1, pp 1, dp 0] and 2 more``; a skipped iteration
between log intervals gets a short line of its own, as apex's "Gradient overflow. Skipping step"),
and TensorBoard gets ``nonfinite-params`` (the number of records).
"""

from __future__ import annotations

import json
import math
import numbers
import os
import sys
import warnings
from collections import Counter
from typing import Dict, Optional, TextIO

import torch

from tpamp._checks import check_int
from tpamp.nonfinite import nonfinite_record
from tpamp.param_norms import top_k as _top_k

__all__ = ["TrainingLogger", "NONFINITE_RECORDS_KEPT"]

NONFINITE_RECORDS_KEPT = 16  # records of non-finite grads a JSONL record keeps (the first ones)


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
        check_int("log_interval", log_interval, low=1)
        check_int("train_iters", train_iters, low=0)
        check_int("param_grad_norms_top_k", param_grad_norms_top_k, low=1, allow_none=True)
        self.param_grad_norms_top_k = param_grad_norms_top_k
        self.spike_skips = 0  # skipped for a spike (also counted in skipped_iters)
        self.spikes = 0  # flagged by the detector, whatever its policy
        self.param_grad_norm_leaders: Counter = Counter()  # name -> records it was the largest
        self.nonfinite_culprits: Counter = Counter()  # name -> iterations it was the first culprit
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
        param_grad_norms: Optional[Dict[str, float]] = None, spike=None, nonfinite=None,
        param_update_norms: Optional[Dict[str, float]] = None,
        param_update_ratios: Optional[Dict[str, float]] = None,
        param_momentum_norms: Optional[Dict[str, float]] = None,
        **extra,
    ) -> dict:
        """Account for one iteration and return its JSON record.

        result: the :class:`tpamp.StepResult` of the iteration's step (or a 3-tuple
        (update_successful, grad_norm, num_zeros); tensors are read here). loss: the
        iteration's training loss (nan/inf counts as a nan iteration, as in Megatron-LM).
        loss, lr, loss_scale: numbers or 1-element tensors. Extra keyword fields go into the
        record (JSON-serialisable; non-finite floats become null).

        The record is always valid JSON: grad_norm is null when the step was skipped or the
        norm is not finite (sync_free's sentinel nan included), num_zeros null when skipped,
        not requested or negative (sync_free's sentinel -1); a non-finite loss_scale or lr is
        null. Raises TypeError naming the argument for a value of the wrong type.
        param_grad_norms: {name: norm} of every param (``ParamGradNormTracker.norms``) on the
        iterations that computed them; the record keeps the top-K (non-finite as null).
        param_update_norms, param_update_ratios: {name: ||update||} and {name: ||update|| /
        ||param||} of every param (``ParamGradNormTracker.update_norms`` / ``update_ratios``)
        on the iterations that computed them (None after a skipped step); the record keeps the
        top-K by update norm and those params' ratios. Ratios without norms, or a ratio for a
        name without a norm, raise ValueError.
        param_momentum_norms: {name: momentum norm} (``ParamGradNormTracker.momentum_norms``,
        TensorParallelMuon params); the record keeps those of the top-K update-norm params.
        spike: the :class:`tpamp.SpikeDecision` of the step (``SpikeDetector.last``), or None.
        nonfinite: the step's :class:`tpamp.NonFiniteGrad` records (``optimizer.last_nonfinite``;
            records or their ``as_record()`` dicts), or None when not known; non-empty ones go
            into the record as ``{"total": N, "first": [...]}`` (the first 16).
        """
        if isinstance(result, (str, bytes)) or not isinstance(result, (tuple, list)) or len(result) < 3:
            raise TypeError(
                "result must be the StepResult (update_successful, grad_norm, num_zeros) of the "
                f"step, got {result!r:.80} ({type(result).__name__})"
            )
        if isinstance(iteration, bool) or not isinstance(iteration, numbers.Integral):
            raise TypeError(f"iteration must be an int, got {iteration!r} ({type(iteration).__name__})")
        update_successful, grad_norm, num_zeros = result[0], result[1], result[2]
        loss = _number("loss", loss)
        lr = _number("lr", lr)
        loss_scale = _number("loss_scale", loss_scale)
        culprits = _nonfinite_records(nonfinite)
        if param_update_ratios is not None and (
                param_update_norms is None or not set(param_update_ratios) <= set(param_update_norms)):
            raise ValueError("param_update_ratios needs param_update_norms with the same names "
                             "(the tracker's update_norms and update_ratios of one step)")
        if param_momentum_norms is not None and param_update_norms is None:
            raise ValueError("param_momentum_norms needs param_update_norms (the tracker's "
                             "update_norms and momentum_norms of one step)")
        skipped = not bool(update_successful)
        grad_norm = None if grad_norm is None or skipped else _number("result.grad_norm", grad_norm)
        if grad_norm is not None and not math.isfinite(grad_norm):
            grad_norm = None
        num_zeros = None if num_zeros is None or skipped else _number("result.num_zeros_in_grad", num_zeros)
        if num_zeros is not None and not (math.isfinite(num_zeros) and num_zeros >= 0):
            num_zeros = None
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
            "lr": lr if math.isfinite(lr) else None,
            "loss_scale": loss_scale if math.isfinite(loss_scale) else None,
            "grad_norm": grad_norm,
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
        top_update = None
        if param_update_norms is not None:
            top_update = _top_k(param_update_norms, self.param_grad_norms_top_k)
            order = {name: i for i, name in enumerate(param_update_norms)}  # model order
            names = sorted(top_update, key=order.__getitem__)
            rec["param_update_norms"] = {n: _finite_or_none(top_update[n]) for n in names}
            if param_update_ratios is not None:
                rec["param_update_ratios"] = {
                    n: _finite_or_none(param_update_ratios[n]) for n in names
                    if n in param_update_ratios}
            if param_momentum_norms:
                rec["param_momentum_norms"] = {
                    n: _finite_or_none(param_momentum_norms[n]) for n in names
                    if n in param_momentum_norms}
        if culprits:
            self.nonfinite_culprits[culprits[0].name] += 1
            rec["nonfinite"] = {
                "total": len(culprits),
                "first": [r.as_record() for r in culprits[:NONFINITE_RECORDS_KEPT]],
            }
        if spike is not None:
            self._spike_watched = True
            self.spikes += bool(spike.spike)
            self.spike_skips += bool(spike.skipped)
            self._interval_spike_skips += bool(spike.skipped)
            rec["spike"] = _json_safe("spike", spike.as_record())
        for key, value in extra.items():
            rec[key] = _json_safe(f"extra field {key!r}", value)
        if not self.enabled:
            return rec
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(rec, allow_nan=False) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            if rec["loss_scale"] is not None:
                self._tb.add_scalar("loss-scale", loss_scale, iteration)
            if rec["lr"] is not None:
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
            for name, v in (top_update or {}).items():
                if math.isfinite(v):
                    self._tb.add_scalar(f"update-norm/{name}", v, iteration)
                ratio = rec.get("param_update_ratios", {}).get(name)
                if ratio is not None:
                    self._tb.add_scalar(f"update-ratio/{name}", ratio, iteration)
                momentum = rec.get("param_momentum_norms", {}).get(name)
                if momentum is not None:
                    self._tb.add_scalar(f"momentum-norm/{name}", momentum, iteration)
            if culprits is not None:
                self._tb.add_scalar("nonfinite-params", len(culprits), iteration)
        if iteration % self.log_interval != 0 and skipped and culprits:
            # a skipped step between log intervals: say at once where its inf/nan came from
            text = f" iteration {rec['iteration']:8d}/{self.train_iters:8d} | {self.format_nonfinite(rec)} |"
            print(text, file=self.stream or sys.stdout, flush=True)
        if iteration % self.log_interval == 0:
            text = self.format_line(rec)
            if top:
                text += "\n" + self.format_param_grad_norms(top, len(param_grad_norms))
            if top_update:
                text += "\n" + self.format_param_update_norms(
                    top_update, param_update_ratios or {}, len(param_update_norms))
            print(text, file=self.stream or sys.stdout, flush=True)
            self._interval_skipped = 0
            self._interval_nan = 0
            self._interval_spike_skips = 0
        return rec

    def format_line(self, rec: dict) -> str:
        """Megatron-LM's training_log line for one record."""
        parts = [f" iteration {rec['iteration']:8d}/{self.train_iters:8d}"]
        parts.append(f"lr: {rec['lr']:.3E}" if rec["lr"] is not None else "lr: nan")
        loss = rec["loss"]
        parts.append(f"loss: {loss:.4E}" if loss is not None else "loss: nan")
        scale = rec["loss_scale"]
        parts.append(f"loss scale: {scale:.1f}" if scale is not None else "loss scale: inf")
        if rec["grad_norm"] is not None:
            parts.append(f"grad norm: {rec['grad_norm']:.3f}")
        if rec["num_zeros"] is not None:
            parts.append(f"num zeros: {rec['num_zeros']}")
        parts.append(f"number of skipped iterations: {self._interval_skipped:3d}")
        parts.append(f"number of nan iterations: {self._interval_nan:3d}")
        if self._spike_watched:
            parts.append(f"number of spike skips: {self._interval_spike_skips:3d}")
        if rec.get("nonfinite"):
            parts.append(self.format_nonfinite(rec))
        return " | ".join(parts) + " |"

    @staticmethod
    def format_nonfinite(rec: dict) -> str:
        """"skipped: inf in NAME [tp 1, pp 1, dp 0] and 2 more" for a record with non-finite
        grads ("nonfinite: ..." when the step was not skipped); "" without."""
        info = rec.get("nonfinite")
        if not info or not info.get("first"):
            return ""
        first = str(nonfinite_record(info["first"][0]))
        more = int(info["total"]) - 1
        text = f"{first} and {more} more" if more > 0 else first
        return ("skipped: " if rec.get("skipped") else "nonfinite: ") + text

    @staticmethod
    def format_param_grad_norms(top: Dict[str, float], total: int) -> str:
        """The readable block of per-parameter grad norms, largest first."""
        width = max(len(name) for name in top)
        lines = [f"   param grad norms (top {len(top)} of {total}):"]
        lines += [f"     {name:<{width}}  {v:.4E}" for name, v in top.items()]
        return "\n".join(lines)

    @staticmethod
    def format_param_update_norms(top: Dict[str, float], ratios: Dict[str, float],
                                  total: int) -> str:
        """The readable block of per-parameter update norms (and ||update|| / ||param||),
        largest update first."""
        width = max(len(name) for name in top)
        lines = [f"   param update norms (top {len(top)} of {total}; update / param):"]
        for name, v in top.items():
            ratio = ratios.get(name)
            tail = f"  {ratio:.4E}" if ratio is not None else ""
            lines.append(f"     {name:<{width}}  {v:.4E}{tail}")
        return "\n".join(lines)

    def summary(self, leaders: int = 5) -> dict:
        """The run's counts for summary.json: skipped iterations (all), of them overflow skips
        and spike skips, spikes flagged, nan iterations, loss-scale changes, the params that
        most often had the largest grad norm of a record and those most often named first for
        a non-finite grad ([name, records] pairs)."""
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
            "nonfinite_culprits": [
                [name, n] for name, n in self.nonfinite_culprits.most_common(leaders)
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


def _nonfinite_records(nonfinite):
    """The records as NonFiniteGrad (None stays None). Raises TypeError for anything else."""
    if nonfinite is None:
        return None
    if isinstance(nonfinite, (str, bytes, dict)) or not isinstance(nonfinite, (list, tuple)):
        raise TypeError(
            "nonfinite must be the optimizer's last_nonfinite (a list of tpamp.NonFiniteGrad), "
            f"got {type(nonfinite).__name__}"
        )
    out = []
    for i, r in enumerate(nonfinite):
        try:
            out.append(nonfinite_record(r))
        except TypeError as e:
            raise TypeError(f"nonfinite[{i}] is not a tpamp.NonFiniteGrad record: {r!r:.80} ({e})") from None
    return out


def _number(name: str, value) -> float:
    """A real number or a 1-element tensor, as a float (read on the host: logging time)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"{name} must be a number or a 1-element tensor, got shape {tuple(value.shape)}")
        return float(value.detach().reshape(()).item())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    return float(value)


def _json_safe(name: str, value):
    """value with non-finite floats replaced by None (JSON has no nan/inf); tensors of one
    element become numbers. Raises TypeError naming the field for what JSON cannot hold."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.detach().reshape(()).item()
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _json_safe(f"{name}[{k!r}]", v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(f"{name}[{i}]", v) for i, v in enumerate(value)]
    raise TypeError(f"{name} is not JSON-serialisable: {value!r:.80} ({type(value).__name__})")


def _finite_or_none(v: float) -> Optional[float]:
    """A float for JSON (non-finite: None)."""
    v = float(v)
    return v if math.isfinite(v) else None
