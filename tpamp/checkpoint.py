"""Layout-free checkpoints of the full mixed-precision state through torch.distributed.checkpoint.

tpamp's ``MixedPrecisionOptimizer.state_dict()`` is per rank and positional (Megatron-LM's
format): it resumes only on the same layout. :func:`save_checkpoint` / :func:`load_checkpoint`
write and read the same state with torch.distributed.checkpoint (DCP), keyed by the model's
*global* parameter names, each tensor in its *global* shape, so DCP reshards it: a checkpoint
written on one TP x PP x DP layout loads on another (SPEC.md section 7), and a checkpoint of a
4-rank run loads in one process. This is what Megatron-LM's dist_checkpointing and torchtitan's
DCP checkpointer do.

Usage (every rank of ``process_group`` calls both, collectively)::

    params = {global_name: param for ...}            # names do not depend on the PP stage
    tpamp.checkpoint.save_checkpoint(path, params, optimizer, extra={"iteration": it})
    extra = tpamp.checkpoint.load_checkpoint(path, params, optimizer, extra={"iteration": None})

What a checkpoint holds (flat DCP keys; ``{name}`` is a global parameter name):

=================================  ==========================================================
``model.{name}``                   the model param (fp16/bf16/fp32) in its global shape
``optimizer.main_params.{name}``   the fp32 main param of an fp16/bf16 param
``optimizer.state.{name}.{key}``   the inner optimizer's state of that param (AdamW: exp_avg,
                                   exp_avg_sq in the param's global shape; step, 0-dim)
``optimizer.param_groups``         the hyperparameters of each param group (no ``params``)
``optimizer.grad_scaler.{key}``    the loss scaler's state_dict: scale (float32 [1]) and the
                                   growth/hysteresis trackers
``extra.{key}``                    the caller's values: iteration, data position, RNG state,
                                   skip counters ... (objects or tensors, the same on every
                                   rank, or keyed per rank by the caller)
=================================  ==========================================================

How a tensor gets its global shape (:func:`global_view`): a DTensor is saved as it is (DCP
writes each rank's shard at its offset); a Megatron-attribute param (``tensor_model_parallel``
True, ``partition_dim``, ``partition_stride`` 1) is wrapped as a DTensor ``Shard(partition_dim)``
over the TP group without copying; any other tensor is replicated (every rank holding it writes
the same key; DCP keeps one copy). A param marked ``shared=True`` (a tied copy such as the last
PP stage's output-embedding copy, SPEC section 3) is not written: its original, under the same
global name, is; it is read back from there.

Loading is all-or-nothing. First, without touching anything: the DCP metadata must exist, hold
every key this rank needs with the right global shape, and (checked over all ranks) hold
exactly this model's params; then everything is read into new buffers and checked again (main
params and model params finite, the scaler state accepted by a copy of the scaler). Only when
every rank found no fault is anything copied into the model, the main params, the optimizer
state, the scaler and returned to the caller; otherwise every rank raises
:class:`CheckpointError` naming the first faults. The new buffers double the state's memory
for the duration of the load.

Hook for other optimizers (e.g. a data-parallel-sharded ``tpamp.DistributedOptimizer``)
--------------------------------------------------------------------------------------------
:class:`tpamp.MixedPrecisionOptimizer` and :class:`tpamp.FP32Optimizer` are handled here. Any
other optimizer plugs in by exposing two methods; this module then does everything else
(keys, shared-param skipping, validation, the scaler, all-or-nothing loading)::

    def sharded_state_dict(self, model_params: Mapping[str, Tensor]) -> dict:
        '''model_params: {global name: model param}, as given to save/load_checkpoint.
        Returns {
          "main_params": {name: T},            # fp32 main params this rank holds (any part of)
          "state": {name: {key: T or object}}, # inner-optimizer state of those params
          "param_groups": [dict, ...],         # hyperparameters per group, without "params"
        }
        T is a Tensor, DTensor or ShardedTensor in the param's GLOBAL shape, sharing storage
        with the live buffers. A part of a param (a data-parallel rank's contiguous range of
        the flattened param, possibly a piece of a TP shard) is a ShardedTensor whose local
        shards are views of the flat buffer: flat_range_chunks() cuts a flat range into
        row-major boxes, sharded_tensor_from_chunks() builds the ShardedTensor (collective
        over a group that holds every piece of the param exactly once). State tensors shaped
        like the param must be sharded exactly like main_params[name]; others (AdamW's 0-dim
        step) are plain tensors, replicated. A param with no state yet has no "state" entry.'''

    def load_sharded_state_dict(self, state: dict) -> None:
        '''state: the same structure, read from the checkpoint into NEW buffers: main params
        and param-shaped state sharded like this rank's own sharded_state_dict() entries
        (built with torch.empty_like / the same ShardedTensor metadata), other state as
        saved. "state" holds exactly the checkpoint's state of each name in "main_params"
        (a name with no entry had no state when saved). Copy into the live buffers; every
        shape and key has already been checked, and the values are finite.'''

The loss scaler is taken from ``optimizer.grad_scaler`` (None: none) and saved and loaded
here; the model params are saved and loaded here from ``model_params``.

Megatron-LM's iteration directories (``iter_0000100``) and ``latest_checkpointed_iteration.txt``
tracker: :func:`iteration_dir`, :func:`read_latest_iteration`, :func:`write_latest_iteration`.
"""

from __future__ import annotations

import copy
import math
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = [
    "CheckpointError",
    "save_checkpoint",
    "load_checkpoint",
    "global_view",
    "flat_range_chunks",
    "sharded_tensor_from_chunks",
    "iteration_dir",
    "read_latest_iteration",
    "write_latest_iteration",
]

Tensor = torch.Tensor
