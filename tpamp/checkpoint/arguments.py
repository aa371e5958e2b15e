"""The argument checks that save_checkpoint and load_checkpoint share (TypeError for a wrong type,
ValueError for a wrong value, before any collective).
"""

from __future__ import annotations

import os
from typing import Mapping

import torch

__all__ = ["check_model_params", "check_dir_arg", "check_extra_arg", "tp_group_of", "shared_names"]

Tensor = torch.Tensor


def check_model_params(model_params) -> None:
    """model_params must be a mapping {non-empty str: Tensor}: TypeError / ValueError naming the
    bad entry."""
    if not isinstance(model_params, Mapping):
        raise TypeError(
            f"model_params must be a mapping {{global name: param}}, got {type(model_params).__name__}"
        )
    for n, p in model_params.items():
        if not isinstance(n, str) or not n:
            raise ValueError(f"model_params: names must be non-empty strings, got {n!r}")
        if not isinstance(p, Tensor):
            raise TypeError(f"model_params[{n!r}] is a {type(p).__name__}, not a tensor")


def check_dir_arg(checkpoint_dir) -> str:
    """The checkpoint directory as an absolute path; TypeError for a non-path (bytes included),
    ValueError for ''."""
    if isinstance(checkpoint_dir, bytes) or not isinstance(checkpoint_dir, (str, os.PathLike)):
        raise TypeError(f"checkpoint_dir must be a path (str), got {type(checkpoint_dir).__name__}")
    path = os.fspath(checkpoint_dir)
    if not path:
        raise ValueError("checkpoint_dir must not be empty")
    return os.path.abspath(path)


def check_extra_arg(extra) -> None:
    """extra must be None or a mapping with non-empty str keys (TypeError / ValueError)."""
    if extra is None:
        return
    if not isinstance(extra, Mapping):
        raise TypeError(f"extra must be a mapping {{key: value}}, got {type(extra).__name__}")
    for k in extra:
        if not isinstance(k, str) or not k:
            raise ValueError(f"extra: keys must be non-empty strings, got {k!r}")


def tp_group_of(optimizer, tensor_parallel_group):
    """The TP group of a save or load: the argument, else the optimizer's
    ``tensor_parallel_group``."""
    if tensor_parallel_group is not None:
        return tensor_parallel_group
    return getattr(optimizer, "tensor_parallel_group", None)


def shared_names(model_params) -> set:
    """Names of the params marked ``shared=True`` (tied copies: not written, read from their
    original)."""
    return {n for n, p in model_params.items() if getattr(p, "shared", False)}
