"""The read plan of a load: every key this rank reads, a new buffer for each (sharded like the live
tensor it replaces), and the faults found on the way, without reading data.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List

import torch

from tpamp.checkpoint.layout import empty_like, view_global_shape

__all__ = ["ReadPlan", "files_of"]


def _covered(md) -> bool:
    """The saved chunks add up to the whole tensor (a torn write would not)."""
    total = sum(math.prod(c.sizes) for c in md.chunks)
    return total == math.prod(md.size)


class ReadPlan:
    """The keys this rank reads, their new buffers, and the faults found on the way."""

    def __init__(self, metadata):
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        self.md = metadata.state_dict_metadata
        self.bytes_cls = BytesStorageMetadata
        self.targets: Dict[str, Any] = {}
        self.problems: List[str] = []

    def _entry(self, key):
        e = self.md.get(key)
        if e is None:
            self.problems.append(f"the checkpoint has no {key!r}")
        return e

    def tensor(self, key, view, dtype=None) -> None:
        """Read ``key`` into a new buffer sharded like ``view``."""
        e = self._entry(key)
        if e is None:
            return
        if isinstance(e, self.bytes_cls):
            self.problems.append(f"{key!r} is an object in the checkpoint, expected a tensor")
            return
        want = view_global_shape(view)
        if tuple(e.size) != want:
            self.problems.append(
                f"{key!r} has shape {tuple(e.size)} in the checkpoint, expected {want}"
            )
            return
        if not _covered(e):
            self.problems.append(f"{key!r}: the saved chunks do not cover the tensor (incomplete)")
            return
        self.targets[key] = empty_like(view, dtype)

    def saved(self, key, like=None) -> None:
        """Read ``key`` as saved: an object, or a tensor (sharded like ``like`` when it has
        like's global shape, else a plain full tensor of the saved dtype)."""
        e = self._entry(key)
        if e is None:
            return
        if isinstance(e, self.bytes_cls):
            self.targets[key] = None  # DCP puts the loaded object here
        elif not _covered(e):
            self.problems.append(f"{key!r}: the saved chunks do not cover the tensor (incomplete)")
        elif like is not None and tuple(e.size) == view_global_shape(like):
            self.targets[key] = empty_like(like, e.properties.dtype)
        else:
            self.targets[key] = torch.empty(tuple(e.size), dtype=e.properties.dtype)

    def under(self, prefix: str) -> List[str]:
        """Suffixes of the checkpoint's keys ``prefix + suffix`` that hold no further dot."""
        n = len(prefix)
        return sorted(k[n:] for k in self.md if k.startswith(prefix) and "." not in k[n:])


def files_of(metadata, keys) -> List[str]:
    """The data files (relative paths) that hold any of ``keys``, sorted."""
    keys = set(keys)
    return sorted({i.relative_path for x, i in metadata.storage_data.items() if x.fqn in keys})
