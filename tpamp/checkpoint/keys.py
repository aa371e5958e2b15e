"""The names of a checkpoint's entries: flat torch.distributed.checkpoint keys, the table of the
package docstring (``{name}`` is a global parameter name, ``{key}`` a state or scaler key)."""

from __future__ import annotations

__all__ = ["MODEL", "MAIN", "STATE", "GROUPS", "SCALER", "SPIKES", "META", "EXTRA", "state_key"]

MODEL = "model."  # model.{name}: the model param in its global shape
MAIN = "optimizer.main_params."  # optimizer.main_params.{name}: its fp32 master
STATE = "optimizer.state."  # optimizer.state.{name}.{key}: the inner optimizer's state
GROUPS = "optimizer.param_groups"  # the groups' hyperparameters (one object)
SCALER = "optimizer.grad_scaler."  # optimizer.grad_scaler.{key}: the loss scaler's state_dict
SPIKES = "optimizer.spike_detector"  # the spike detector's state_dict (one object)
META = "optimizer.meta"  # the optimizer record: inner class, param groups by name
EXTRA = "extra."  # extra.{key}: the caller's values


def state_key(name: str, key: str) -> str:
    """``optimizer.state.{name}.{key}``: one state entry of the param ``name``."""
    return f"{STATE}{name}.{key}"
