"""Storage and checksums: DCP's ``.metadata`` and data files, and tpamp's manifest
``tpamp_checksums.json`` (sha256 of every saved tensor and object, and of every whole file),
written when a save is complete and verified before a load parses anything.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Dict, List, Sequence, Tuple

from tpamp.checkpoint.errors import CheckpointError, dcp_errors, describe, group_rank, world_size

__all__ = [
    "MANIFEST", "METADATA", "fsync_dir", "items_by_file", "hash_file", "sha256_of",
    "write_manifest", "open_checkpoint", "verify_data_files",
]


MANIFEST = "tpamp_checksums.json"  # written last into the staging directory, then renamed


METADATA = ".metadata"  # DCP's


_FORMAT = "tpamp.checkpoint"


_HASH_BLOCK = 1 << 22


def fsync_dir(path: str) -> None:
    """fsync a directory (its entries made durable); silently nothing where the OS refuses."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def items_by_file(metadata) -> Dict[str, List[Tuple[int, int, str]]]:
    """{data file: [(offset, length, what)]} of every item DCP wrote (from its metadata)."""
    out: Dict[str, List[Tuple[int, int, str]]] = {}
    for index, info in metadata.storage_data.items():
        where = "" if index.offset is None else f" at {tuple(index.offset)}"
        out.setdefault(info.relative_path, []).append(
            (int(info.offset), int(info.length), f"{index.fqn!r}{where}")
        )
    for items in out.values():
        items.sort()
    return out


def hash_file(path: str, items: Sequence[Tuple[int, int, str]]) -> dict:
    """{"size", "sha256" of the whole file, "items": [[offset, length, sha256, what]]}: one
    sequential read; every saved tensor or object gets its own checksum, so a fault names it."""
    whole = hashlib.sha256()
    out_items = []
    pos = 0
    with open(path, "rb") as f:

        def feed(n, *hashers):
            nonlocal pos
            while n > 0:
                block = f.read(min(n, _HASH_BLOCK))
                if not block:
                    raise CheckpointError(f"{path} ended at byte {pos}, before its items did")
                for h in hashers:
                    h.update(block)
                pos += len(block)
                n -= len(block)

        for offset, length, what in items:
            if offset < pos:  # overlapping items: hash this one by seeking back
                f.seek(offset)
                pos = offset
                h = hashlib.sha256()
                feed(length, h)
            else:
                feed(offset - pos, whole)
                h = hashlib.sha256()
                feed(length, whole, h)
            out_items.append([offset, length, h.hexdigest(), what])
        while True:
            block = f.read(_HASH_BLOCK)
            if not block:
                break
            whole.update(block)
            pos += len(block)
    return {"size": os.path.getsize(path), "sha256": whole.hexdigest(), "items": out_items}


def sha256_of(path: str) -> str:
    """The sha256 hex digest of the whole file ``path``."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_HASH_BLOCK), b""):
            h.update(block)
    return h.hexdigest()


def _verify_file(directory: str, name: str, want: dict, items) -> List[str]:
    """Faults of one data file against its manifest entry (size, each item, the whole)."""
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        return [f"data file {path} is missing"]
    size = os.path.getsize(path)
    if size != want.get("size"):
        return [
            f"data file {path} is {size} bytes, {want.get('size')} were written "
            f"({'truncated' if size < want.get('size', 0) else 'extended'})"
        ]
    try:
        got = hash_file(path, items)
    except (OSError, CheckpointError) as e:
        return [f"data file {path} cannot be read: {type(e).__name__}: {e}"]
    saved = {(o, n): (h, w) for o, n, h, w in want.get("items", [])}
    bad = [
        w for o, n, h, w in got["items"] if saved.get((o, n), (None,))[0] != h
    ]
    if bad:
        return [
            f"data file {path}: the bytes of {', '.join(bad[:4])}"
            f"{f' and {len(bad) - 4} more' if len(bad) > 4 else ''} do not match their "
            "checksum (corrupted)"
        ]
    if got["sha256"] != want.get("sha256"):
        return [f"data file {path} does not match its checksum (corrupted outside the tensors)"]
    return []


def write_manifest(directory: str, metadata_sha: str, files: Dict[str, dict]) -> None:
    """Write ``tpamp_checksums.json`` into ``directory`` (a temporary file, fsync, rename)."""
    doc = {
        "format": _FORMAT,
        "version": 1,
        "hash": "sha256",
        "metadata": {"name": METADATA, "sha256": metadata_sha},
        "files": files,
    }
    tmp = os.path.join(directory, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, MANIFEST))
    fsync_dir(directory)


def open_checkpoint(checkpoint_dir: str, verify_checksums: bool):
    """(DCP metadata, manifest or None, [faults]) read on this rank, changing nothing."""
    import torch.distributed.checkpoint as dcp

    if not os.path.isdir(checkpoint_dir):
        return None, None, [f"there is no checkpoint directory {checkpoint_dir!r}"]
    manifest = None
    if verify_checksums:
        path = os.path.join(checkpoint_dir, MANIFEST)
        try:
            with open(path) as f:
                manifest = json.load(f)
            if not (isinstance(manifest, dict) and manifest.get("format") == _FORMAT
                    and isinstance(manifest.get("files"), dict)
                    and isinstance(manifest.get("metadata"), dict)):
                raise ValueError("not a tpamp checkpoint manifest")
        except FileNotFoundError:
            return None, None, [
                f"{checkpoint_dir!r} has no {MANIFEST} (an incomplete save, or one written "
                "before tpamp stored checksums: load_checkpoint(..., verify_checksums=False) "
                "reads such a checkpoint unchecked)"
            ]
        except (OSError, ValueError) as e:
            return None, None, [f"{path} is unreadable: {type(e).__name__}: {e}"]
        md_path = os.path.join(checkpoint_dir, METADATA)
        try:
            if sha256_of(md_path) != manifest["metadata"].get("sha256"):
                return None, None, [f"{md_path} does not match its checksum (corrupted)"]
        except FileNotFoundError:
            return None, None, [f"{md_path} is missing: no readable DCP checkpoint (a torn save?)"]
        except OSError as e:
            return None, None, [f"{md_path} is unreadable: {type(e).__name__}: {e}"]
    try:
        metadata = dcp.FileSystemReader(checkpoint_dir).read_metadata()
    except dcp_errors() as e:  # reported with its cause, on every rank
        return None, None, [
            f"no readable DCP checkpoint at {checkpoint_dir!r} (missing or incomplete "
            f".metadata: {describe(e)})"
        ]
    if manifest is not None:
        want = set(items_by_file(metadata))
        if want != set(manifest["files"]):
            return None, None, [
                f"{checkpoint_dir!r}: the data files {sorted(want)} of .metadata are not those "
                f"of {MANIFEST} {sorted(manifest['files'])}"
            ]
    return metadata, manifest, []


def verify_data_files(checkpoint_dir, metadata, manifest, process_group) -> List[str]:
    """This rank's share of the data files (file i: group rank i mod world), verified."""
    files = items_by_file(metadata)
    world, me = world_size(process_group), group_rank(process_group)
    problems = []
    for i, name in enumerate(sorted(files)):
        if i % world == me:
            problems += _verify_file(checkpoint_dir, name, manifest["files"][name], files[name])
    return problems
