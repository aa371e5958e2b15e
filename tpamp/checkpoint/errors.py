"""CheckpointError, and how a fault found on one rank becomes the same CheckpointError on every
rank: the collectives every save and load stage ends with (``agree``), and the one-line
descriptions of torch.distributed.checkpoint's errors (a ``CheckpointException`` is a
BaseException, ``dcp_errors`` catches it too).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import List

import torch.distributed as dist

__all__ = [
    "CheckpointError", "single_process_quiet", "world_size", "global_rank", "group_rank",
    "gather_objects", "faults_message", "agree_on_faults", "dcp_errors", "describe",
]


_MAX_LISTED = 8  # faults named in one CheckpointError


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded: missing or extra keys, wrong shapes,
    non-finite values, a scaler state the scaler refuses, another optimizer class or param-group
    structure, a missing, truncated or corrupted file (checksum), any error of
    torch.distributed.checkpoint (whose CheckpointException is a BaseException). The message
    names the ranks and files. Raised on every rank; nothing was changed (a failed save leaves
    the checkpoint directory as it was; a failed load leaves model and optimizer as they were)."""


@contextlib.contextmanager
def single_process_quiet():
    """Without a process group DCP warns that it assumes one process: that is meant here."""
    with warnings.catch_warnings():
        if not (dist.is_available() and dist.is_initialized()):
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def world_size(process_group) -> int:
    """Ranks in ``process_group`` (1 without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(process_group)


def global_rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def group_rank(process_group) -> int:
    """This process's rank in ``process_group`` (0 without a process group)."""
    return dist.get_rank(process_group) if world_size(process_group) > 1 else 0


def gather_objects(obj, process_group) -> list:
    """[obj of every rank of process_group] (just [obj] without a process group)."""
    if world_size(process_group) == 1:
        return [obj]
    out = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(out, obj, group=process_group)
    return out


def faults_message(what: str, faults: List[str], tail: str) -> str:
    """``what``; ``tail``. and the first faults (at most 8 named, then a count)."""
    more = f" (and {len(faults) - _MAX_LISTED} more)" if len(faults) > _MAX_LISTED else ""
    return f"{what}; {tail}. " + "; ".join(faults[:_MAX_LISTED]) + more


def agree_on_faults(problems: List[str], process_group, what: str, tail: str = "nothing was changed") -> None:
    """Raise CheckpointError on every rank if any rank found a fault (a collective: every
    rank calls it, so a fault on one rank never leaves the others waiting)."""
    faults = [
        f"rank {r}: {msg}" for r, ps in gather_objects((global_rank(), problems), process_group) for msg in ps
    ]
    if faults:
        raise CheckpointError(faults_message(what, faults, tail))


# torch.distributed.checkpoint raises CheckpointException, a BaseException: `except Exception`
# alone would let it through as a raw traceback
def dcp_errors() -> tuple:
    """The exception classes a save or load turns into CheckpointError (Exception and DCP's
    CheckpointException)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def describe(e: BaseException, process_group=None) -> str:
    """One line per failure; a CheckpointException's failures by (global) rank."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for r, pair in sorted(failures.items()):
            exc = pair[0] if isinstance(pair, tuple) and pair else pair
            try:
                g = dist.get_global_rank(process_group, r) if process_group is not None else r
            except Exception:  # noqa: BLE001 -- only a label
                g = r
            parts.append(f"rank {g}: {type(exc).__name__}: {_first_line(exc)}")
        return "torch.distributed.checkpoint failed on " + ", ".join(parts)
    return f"{type(e).__name__}: {_first_line(e)}"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "(no message)"
