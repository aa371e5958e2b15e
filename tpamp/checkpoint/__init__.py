"""Layout-free checkpoints of the full mixed-precision state through torch.distributed.checkpoint.

tpamp's ``MixedPrecisionOptimizer.state_dict()`` is per rank and positional (Megatron-LM's
format): it resumes only on the same layout. :func:`save_checkpoint` / :func:`load_checkpoint`
write and read the same state with torch.distributed.checkpoint (DCP), keyed by the model's
*global* parameter names, each tensor in its *global* shape, so DCP reshards it: a checkpoint
written on one TP x PP x DP layout loads on another (docs/spec.md section 7), and a checkpoint of a
4-rank run loads in one process. This is what Megatron-LM's dist_checkpointing and torchtitan's
DCP checkpointer do.

Usage (every rank of ``process_group`` calls both, collectively)::

    params = {global_name: param for ...}            # names do not depend on the PP stage
    tpamp.checkpoint.save_checkpoint(path, params, optimizer, extra={"iteration": it})
    extra = tpamp.checkpoint.load_checkpoint(path, params, optimizer, extra={"iteration": None})

What a checkpoint holds (flat DCP keys; ``{name}`` is a global parameter name):

=================================  ==========================================================
``model.{name}``                   the model param (fp16/bf16/fp32) in its global shape
``optimizer.main_params.{name}``   the fp32 main param of every param the optimizer updates
                                   (an fp16/bf16 param's fp32 copy, an fp32 param itself), so
                                   the masters do not depend on the run's precision
``optimizer.state.{name}.{key}``   the inner optimizer's state of that param (AdamW: exp_avg,
                                   exp_avg_sq in the param's global shape; step, 0-dim)
``optimizer.param_groups``         the hyperparameters of each param group (no ``params``)
``optimizer.meta``                 the inner optimizer's class and each param group's
                                   hyperparameter keys and param names (checked at load)
``optimizer.grad_scaler.{key}``    the loss scaler's state_dict: scale (float32 [1]) and the
                                   growth/hysteresis trackers
``optimizer.spike_detector``       the optimizer's ``spike_detector`` state_dict (windows and
                                   spike counters), when it has one
``extra.{key}``                    the caller's values: iteration, data position, RNG state,
                                   skip counters ... (tensors, or objects stored as a 1-tuple
                                   ``(value,)``; the same on every rank, or keyed per rank)
=================================  ==========================================================

How a tensor gets its global shape (:func:`global_view`): a DTensor is saved as it is (DCP
writes each rank's shard at its offset); a Megatron-attribute param (``tensor_model_parallel``
True, ``partition_dim``, ``partition_stride`` 1) is wrapped as a DTensor ``Shard(partition_dim)``
over the TP group without copying; any other tensor is replicated (every rank holding it writes
the same key; DCP keeps one copy). A param marked ``shared=True`` (a tied copy such as the last
PP stage's output-embedding copy, docs/spec.md section 3) is not written: its original, under the same
global name, is; it is read back from there.

Saving is atomic. All ranks write into a new hidden directory beside the target
(``.NAME.saving-TOKEN``); when every rank's data file and DCP's ``.metadata`` are written, the
ranks checksum the data (sha256 of every tensor and object DCP wrote, and of every whole file,
each file hashed by one rank) into ``tpamp_checksums.json``; only then is the directory renamed
to its name (a checkpoint already there is swapped out in one atomic ``renameat2`` exchange,
then deleted), and only then does :func:`save_checkpoint` return on any rank. So a save that
raises (any rank: an unpicklable ``extra``, a full disk, a DCP error) or is killed part-way
leaves the directory of that name as it was: the previous checkpoint still loads,
bit-identically. A trainer writes the latest-iteration marker (:func:`write_latest_iteration`,
itself an atomic rename) after the save returned, so the marker always names a whole
checkpoint. Every fault of a save is a :class:`CheckpointError` on every rank, naming the
rank and the fault (a rank that dies makes the others' collectives fail: they raise too).

Loading is all-or-nothing, each stage agreed over all ranks before the next: (1) the manifest
and ``.metadata`` are read (``.metadata`` against its checksum); (2) every data file and every
tensor and object in it is verified against its checksum (each file by one rank), so a
truncated, extended, missing or overwritten file (finite garbage included) is refused, naming
the file and the tensor; (3) without reading data, every key this rank needs must exist with
the right global shape, the checkpoint must hold exactly this model's params (over all
ranks), and it must have been written by an optimizer of this inner optimizer's class (e.g.
``torch.optim.adamw.AdamW``) with the same param-group structure (every param in the same
group index, no hyperparameter this optimizer's groups lack); ``reset_optimizer_state=True``
is the deliberate way past this (the params, masters, scaler and detector load, the optimizer
state starts afresh); (4) everything is read into new buffers and checked (model params, main
params and optimizer state finite, hyperparameters of the live kinds, the scaler and spike
detector states accepted by copies of them, the caller's ``check_extra`` accepts the extras).
Only when every rank found no fault is anything copied into the model, the main params, the
optimizer state and groups, the scaler and the detector; otherwise every rank raises
:class:`CheckpointError` naming the first faults (rank, file, key), with nothing changed. Every
error of torch.distributed.checkpoint (whose ``CheckpointException`` is a BaseException) is
turned into that CheckpointError. Should the copying itself fail on any rank (e.g. in an
optimizer's ``load_sharded_state_dict``), every rank restores what it had from a host copy
taken just before and raises CheckpointError. The new buffers double the state's memory for
the duration of the load; the host copy takes as much host memory again.

The optimizer hook (Megatron-core's model: each optimizer answers for its own state)
-------------------------------------------------------------------------------------
This package reads no optimizer's internals. Every optimizer plugs in by exposing two public
methods, as :class:`tpamp.MixedPrecisionOptimizer`, :class:`tpamp.FP32Optimizer` and
:class:`tpamp.DistributedOptimizer` do; the package then does everything else (keys,
shared-param skipping, validation, the scaler, checksums, the optimizer class and param-group
check, all-or-nothing loading with rollback). ``sharded_state_dict`` may also take a keyword
``tensor_parallel_group`` (MixedPrecisionOptimizer's does): it then gets the save's or load's
TP group (the ``tensor_parallel_group`` argument, else the optimizer's own)::

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
        '''Called by load_checkpoint after this rank's sharded_state_dict(model_params) of the
        same model_params (a hook may keep what it needs from that call).
        state: the same structure, read from the checkpoint into NEW buffers: main params
        and param-shaped state sharded like this rank's own sharded_state_dict() entries
        (built with torch.empty_like / the same ShardedTensor metadata), other state as
        saved. "state" holds exactly the checkpoint's state of each name in "main_params"
        (a name with no entry had no state when saved). Copy into the live buffers; every
        shape and key has already been checked, and the values are finite. With
        load_checkpoint(reset_optimizer_state=True), "state" is empty (drop the params'
        state) and "param_groups" are the optimizer's own. Should this raise part-way,
        load_checkpoint restores everything it had (host copies), on every rank.'''

The loss scaler (``optimizer.grad_scaler``, None: none) and a spike detector
(``optimizer.spike_detector``, if any) are saved and loaded here, and so are the model params
from ``model_params`` (copied in before ``load_sharded_state_dict`` is called). Param-group
hyperparameters are restored by group index; the group counts must match. An optimizer with a
third, optional hook ``align_param_groups(saved_groups) -> saved groups in its own order``
(MixedPrecisionOptimizer's, :mod:`tpamp.param_groups`) has the saved groups matched to its
own by override key first (docs/spec.md section 16): groups built in another order, or for a
model whose params are declared in another order, load into the right groups; a changed
override (a key that is new or gone, or other values) is refused, naming the key.

The param-group structure is found without the hook's help: each main param (or DP shard
box) lies in the memory of one tensor of one of the inner optimizer's param groups.

Megatron-LM's iteration directories (``iter_0000100``) and ``latest_checkpointed_iteration.txt``
tracker (:data:`TRACKER_FILENAME`): :func:`iteration_dir`, :func:`read_latest_iteration`,
:func:`write_latest_iteration`; :func:`clean_up_interrupted_saves` removes the staging
directories that saves killed part-way left in such a directory (a job restarting after a
failed rank, docs/spec.md section 20).

The package, by job: :mod:`~tpamp.checkpoint.keys` (the entries' names),
:mod:`~tpamp.checkpoint.layout` (global views, flat ranges as boxes),
:mod:`~tpamp.checkpoint.optimizers` (the hook, the optimizer's class and param-group record),
:mod:`~tpamp.checkpoint.storage` (DCP files and checksums), :mod:`~tpamp.checkpoint.directories`
(staging, atomic publish, Megatron's iteration directories), :mod:`~tpamp.checkpoint.save`,
:mod:`~tpamp.checkpoint.plan` / :mod:`~tpamp.checkpoint.load` / :mod:`~tpamp.checkpoint.rollback`
(the all-or-nothing load), :mod:`~tpamp.checkpoint.errors` (CheckpointError agreed over ranks),
:mod:`~tpamp.checkpoint.arguments` (the checks save and load share).
"""

from tpamp.checkpoint.directories import (
    TRACKER_FILENAME,
    clean_up_interrupted_saves,
    iteration_dir,
    read_latest_iteration,
    write_latest_iteration,
)
from tpamp.checkpoint.errors import CheckpointError
from tpamp.checkpoint.layout import flat_range_chunks, global_view, sharded_tensor_from_chunks
from tpamp.checkpoint.load import load_checkpoint
from tpamp.checkpoint.save import save_checkpoint

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
    "TRACKER_FILENAME",
    "clean_up_interrupted_saves",
]
