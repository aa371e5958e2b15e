"""Checkpoint directories: the atomic publish of a save's staging directory (a hidden
``.NAME.saving-TOKEN`` beside the target, renamed over it in one ``renameat2`` exchange where the OS
has one), the clean-up after a killed save, and Megatron-LM's iteration directories and
latest-iteration tracker file.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import uuid
from typing import List, Optional

from tpamp.checkpoint.storage import MANIFEST, METADATA, fsync_dir

__all__ = [
    "looks_like_checkpoint", "clean_up_after_killed_saves", "clean_up_interrupted_saves", "publish", "rename_exchange", "TRACKER_FILENAME",
    "iteration_dir", "read_latest_iteration", "write_latest_iteration", "check_root",
]


def looks_like_checkpoint(path: str) -> bool:
    """Whether the directory ``path`` may be replaced by a save: empty, or holding DCP's .metadata
    or the manifest."""
    try:
        names = set(os.listdir(path))
    except OSError:
        return False
    return not names or METADATA in names or MANIFEST in names


def clean_up_after_killed_saves(parent: str, base: str) -> None:
    """Remove the staging directories of earlier saves of ``base`` that were killed part-way;
    a previous checkpoint set aside by a publish killed between its two renames (only where
    the OS has no atomic exchange) is put back first."""
    for name in sorted(os.listdir(parent)):
        path = os.path.join(parent, name)
        if name.startswith(f".{base}.old-") and not os.path.lexists(os.path.join(parent, base)):
            os.rename(path, os.path.join(parent, base))
        elif name.startswith(f".{base}.saving-") or name.startswith(f".{base}.old-"):
            shutil.rmtree(path, ignore_errors=True)


# the hidden names save_checkpoint and publish use beside a checkpoint NAME (uuid4 hex tokens)
_LEFTOVER = re.compile(r"^\.(?P<base>.+)\.(?:saving|old)-[0-9a-f]+$")


def check_root(root) -> str:
    """The directory of the checkpoints as a str: TypeError for anything but a str or a str
    ``os.PathLike`` (bytes included: the names of the checkpoint API are str), ValueError for
    ''."""
    if isinstance(root, bytes) or not isinstance(root, (str, os.PathLike)):
        raise TypeError(f"root must be a path (str or os.PathLike), got {root!r:.80} "
                        f"({type(root).__name__})")
    root = os.fspath(root)
    if isinstance(root, bytes):  # a PathLike that gives bytes
        raise TypeError(f"root must be a str path, got the bytes path {root!r:.80}")
    if not root:
        raise ValueError("root must not be empty (give the directory of the checkpoints)")
    return root


def clean_up_interrupted_saves(root: str) -> List[str]:
    """Remove what saves into ``root`` that were killed part-way left behind, for every
    checkpoint name in it: the hidden staging directories (``.NAME.saving-TOKEN``), never
    loaded, and a previous checkpoint set aside by a publish killed between its two renames
    (``.NAME.old-TOKEN``, only where the OS has no atomic exchange), which is put back as
    ``NAME`` when ``NAME`` is missing (else removed). What :func:`clean_up_after_killed_saves`
    does for one name at the next save of that name, done for all of them at once: call it on
    one rank when a job (re)starts, before any save into ``root`` begins (docs/spec.md
    section 20). Returns the sorted names removed or put back; [] when ``root`` does not
    exist. Raises TypeError for a ``root`` that is not a str or ``os.PathLike`` path (bytes
    included: the names of the checkpoint API are str), ValueError for '', OSError when
    ``root`` cannot be listed or a set-aside checkpoint cannot be renamed back."""
    root = check_root(root)
    if not os.path.isdir(root):
        return []
    bases = sorted({m.group("base") for m in map(_LEFTOVER.match, os.listdir(root)) if m})
    before = set(os.listdir(root))
    for base in bases:
        clean_up_after_killed_saves(root, base)
    after = set(os.listdir(root))
    return sorted(n for n in before - after if _LEFTOVER.match(n))


def rename_exchange(a: str, b: str) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), b)


def publish(staging: str, final: str) -> None:
    """Make ``staging`` visible as ``final``; a checkpoint already there is replaced in one
    atomic swap where the OS has one (else two renames, the old one kept until the second)."""
    fsync_dir(staging)
    parent = os.path.dirname(final)
    if not os.path.lexists(final):
        os.rename(staging, final)
    elif rename_exchange(staging, final):
        shutil.rmtree(staging, ignore_errors=True)  # now the previous checkpoint
    else:
        old = os.path.join(parent, f".{os.path.basename(final)}.old-{uuid.uuid4().hex[:12]}")
        os.rename(final, old)
        os.rename(staging, final)
        shutil.rmtree(old, ignore_errors=True)
    fsync_dir(parent)


TRACKER_FILENAME = "latest_checkpointed_iteration.txt"  # Megatron-LM's name


def iteration_dir(root: str, iteration: int) -> str:
    """Megatron-LM's directory of one iteration's checkpoint: ``root/iter_0000100``. Raises
    TypeError for a root that is not a str path (:func:`check_root`) or an iteration that is
    not an int (a bool, a float), ValueError for a negative one."""
    root = check_root(root)
    if isinstance(iteration, bool) or not isinstance(iteration, int):
        raise TypeError(f"iteration must be an int >= 0, got {iteration!r} "
                        f"({type(iteration).__name__})")
    if iteration < 0:
        raise ValueError(f"iteration must be an int >= 0, got {iteration!r}")
    return os.path.join(root, f"iter_{iteration:07d}")


def read_latest_iteration(root: str) -> Optional[int]:
    """The iteration in ``root/latest_checkpointed_iteration.txt``, or None when there is none.
    Raises TypeError for a root that is not a str path, ValueError when the file does not
    hold an int >= 0."""
    path = os.path.join(check_root(root), TRACKER_FILENAME)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{path} holds {text!r}, expected an iteration number") from None
    if value < 0:
        raise ValueError(f"{path} holds {text!r}, expected an iteration number >= 0")
    return value


def write_latest_iteration(root: str, iteration: int) -> None:
    """Record ``iteration`` as the latest complete checkpoint: write a new file, fsync, and
    rename it over the marker (atomic), so the marker always names a whole checkpoint. Call
    on one rank after :func:`save_checkpoint` returned (the checkpoint is then in place on
    every rank). Raises TypeError / ValueError as :func:`iteration_dir`, ValueError when
    ``root/iter_NNNNNNN`` is not a saved checkpoint."""
    root = check_root(root)
    ckpt = iteration_dir(root, iteration)  # validates
    if not os.path.isfile(os.path.join(ckpt, METADATA)):
        raise ValueError(f"{ckpt} is not a saved checkpoint (no {METADATA}): not recording it")
    path = os.path.join(root, TRACKER_FILENAME)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(root)
