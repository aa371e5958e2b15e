"""Save and resume scripts/train_gpt.py with tpamp.checkpoint (torch.distributed.checkpoint).

Megatron-LM's flags and layout: ``--save DIR`` writes ``DIR/iter_0000100/`` every
``--save-interval`` iterations and at the end, then records the iteration in
``DIR/latest_checkpointed_iteration.txt``; ``--load DIR`` resumes from the latest (or
``--ckpt-step N``). A checkpoint holds, by global names
(``GPTStage.checkpoint_named_parameters``): the model params, the fp32 main params, AdamW's
state and param groups, the loss scaler (scale and trackers), the optimizer's spike detector if
any, and the training position: the iteration, the data generator's state (every rank draws the
same global batches from it), the torch RNG state, the logger's counters (skipped and nan
iterations, loss-scale changes, spike counts where the logger keeps them) and an LR scheduler's
state when one is passed. So a resumed run continues exactly where the saved one stopped; on
another TP x PP x DP layout too, as long as the global batch size is the same (pass
``--global-batch-size``).

torch and tpamp are imported by the functions that use them: train_gpt.py checks its flags
with :func:`resume_iteration` before torch is imported.

The trainer draws no per-rank random numbers (no dropout; initialisation has its own seeded
generators), so the torch RNG state is the same on every rank and is saved once.
"""

from __future__ import annotations

import os

# Megatron-LM's layout, as tpamp.checkpoint names it (iteration_dir, TRACKER_FILENAME), here in
# the standard library: train_gpt.validate_args reads it before torch is imported
ITERATION_DIR = "iter_{:07d}"
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"

# the logger's running counters (spike counts where the logger keeps them)
_COUNTERS = ("skipped_iters", "nan_iters", "loss_scale_changes", "spike_skips", "spikes", "_last_scale")
_EXTRA_KEYS = (
    "iteration", "global_batch_size", "train_generator", "torch_rng_state", "logger", "layout",
    "lr_scheduler",
)


def add_arguments(parser) -> None:
    """Megatron-LM's checkpoint flags."""
    a = parser.add_argument
    a("--save", default=None, help="directory to save checkpoints to (iter_NNNNNNN/ inside)")
    a("--save-interval", type=int, default=None, help="save every N iterations (and at the end)")
    a("--load", default=None, help="directory to resume from (latest checkpoint by default)")
    a("--ckpt-step", type=int, default=None, help="resume from this iteration's checkpoint")


def resume_iteration(args):
    """The iteration ``--load`` resumes from: ``--ckpt-step``, else the latest recorded in
    ``--load``'s tracker file, else None (no checkpoint there yet: train from scratch, as
    Megatron-LM does). Raises ValueError for a ``--ckpt-step`` that was not saved there or a
    tracker file that does not hold an iteration number. Reads files only, with the standard
    library: train_gpt.validate_args calls it before any process group (or torch) exists."""
    if args.ckpt_step is not None:
        path = os.path.join(args.load, ITERATION_DIR.format(args.ckpt_step))
        if not os.path.isdir(path):
            raise ValueError(f"there is no {path}")
        return args.ckpt_step
    tracker = os.path.join(args.load, TRACKER_FILENAME)
    if not os.path.isfile(tracker):
        return None
    with open(tracker) as f:
        text = f.read().strip()
    if not (text.isascii() and text.isdigit()):
        raise ValueError(f"{tracker} holds {text!r}, expected an iteration number >= 0")
    return int(text)


def should_save(args, it: int) -> bool:
    if not args.save:
        return False
    return it == args.train_iters or bool(args.save_interval and it % args.save_interval == 0)


def _logging_rank(st) -> int:
    return st.dims.rank_of(st.dims.pp - 1, 0, 0)


def save_training_state(
    args, it, stage, optimizer, st, train_gen, logger, global_batch, say, scheduler=None
) -> str:
    """Write iteration ``it``'s checkpoint (collective); returns its directory. ``scheduler``:
    an LR scheduler whose state_dict is saved too (one that advances on successful steps only
    is not a function of the iteration)."""
    import torch
    import torch.distributed as dist

    from tpamp import checkpoint as ckpt

    counters = [None]
    if dist.get_rank() == _logging_rank(st):  # the logger counts on the logging rank only
        counters[0] = {k: getattr(logger, k) for k in _COUNTERS if hasattr(logger, k)}
    dist.broadcast_object_list(counters, src=_logging_rank(st))
    path = ckpt.iteration_dir(args.save, it)
    ckpt.save_checkpoint(
        path,
        stage.checkpoint_named_parameters(),
        optimizer,
        extra={
            "iteration": it,
            "global_batch_size": global_batch,
            "train_generator": train_gen.get_state(),
            "torch_rng_state": torch.get_rng_state(),
            "logger": counters[0],
            "layout": {"tp": st.dims.tp, "pp": st.dims.pp, "dp": st.dims.dp},
            "lr_scheduler": scheduler.state_dict() if scheduler is not None else None,
        },
    )
    if dist.get_rank() == 0:  # every rank's files and .metadata are written when save returns
        ckpt.write_latest_iteration(args.save, it)
    say(f" saved checkpoint at iteration {it} to {path}", flush=True)
    return path


def _check_training_state(extra, path, it, global_batch, scheduler) -> None:
    """Raise ValueError naming the first of ``extra``'s values this run cannot take."""
    import torch

    if extra["global_batch_size"] != global_batch:
        raise ValueError(
            f"{path} was written with global batch size {extra['global_batch_size']}, this run "
            f"has {global_batch}: the data position would not match (pass --global-batch-size "
            f"{extra['global_batch_size']})"
        )
    if extra["iteration"] != it:
        raise ValueError(f"{path} holds iteration {extra['iteration']!r}, expected {it}")
    torch.Generator().set_state(extra["train_generator"])  # raises for a bad state
    rng, want = extra["torch_rng_state"], torch.get_rng_state()
    if not (isinstance(rng, torch.Tensor) and rng.dtype == want.dtype and rng.shape == want.shape):
        raise ValueError(f"torch_rng_state is not a {want.dtype} tensor of {tuple(want.shape)}")
    sched = extra["lr_scheduler"]
    if scheduler is not None and sched is not None and (
        not isinstance(sched, dict) or set(sched) != set(scheduler.state_dict())
    ):
        raise ValueError(
            f"lr_scheduler state has keys {sorted(sched) if isinstance(sched, dict) else sched!r}, "
            f"{type(scheduler).__name__} has {sorted(scheduler.state_dict())}"
        )
    counters = extra["logger"]
    if not isinstance(counters, dict) or "skipped_iters" not in counters \
            or not set(counters) <= set(_COUNTERS):
        raise ValueError(f"logger counters {counters!r} are not {_COUNTERS}")
    layout = extra["layout"]
    if not isinstance(layout, dict) or set(layout) != {"tp", "pp", "dp"}:
        raise ValueError(f"layout {layout!r} is not {{'tp', 'pp', 'dp'}}")


def load_training_state(
    args, stage, optimizer, st, train_gen, logger, global_batch, say, scheduler=None
) -> int:
    """Resume from ``--load`` (``--ckpt-step`` or the latest); returns the iteration to
    continue after (0: no checkpoint there yet, train from scratch, as Megatron-LM does).

    All-or-nothing: the data position, RNG state, scheduler state and log counters are checked
    (``check_extra``) together with the model and optimizer state before anything changes.
    Raises tpamp.checkpoint.CheckpointError (nothing changed) for a checkpoint that does not
    fit this model or run (another global batch size, iteration or scheduler), ValueError for
    a missing --ckpt-step (train_gpt.validate_args refuses it, and a checkpoint at or beyond
    --train-iters, before the process group exists)."""
    import torch

    from tpamp import checkpoint as ckpt

    it = resume_iteration(args)  # checked before the process group by train_gpt.validate_args
    if it is None:
        say(f" no checkpoint in {args.load} (no {ckpt.TRACKER_FILENAME}): training from scratch", flush=True)
        return 0
    path = ckpt.iteration_dir(args.load, it)

    def check_extra(extra):  # the trainer's own values, checked before anything changes
        _check_training_state(extra, path, it, global_batch, scheduler)

    extra = ckpt.load_checkpoint(
        path, stage.checkpoint_named_parameters(), optimizer, extra={k: None for k in _EXTRA_KEYS},
        check_extra=check_extra,
    )
    # nothing below can fail: every value was checked by check_extra
    train_gen.set_state(extra["train_generator"])
    torch.set_rng_state(extra["torch_rng_state"])
    if scheduler is not None:
        if extra["lr_scheduler"] is None:
            say(" the checkpoint has no LR scheduler state: the schedule starts afresh", flush=True)
        else:
            scheduler.load_state_dict(extra["lr_scheduler"])
    counters = extra["logger"]
    for k, v in counters.items():
        if hasattr(logger, k):
            setattr(logger, k, v)
    saved = extra["layout"]
    say(
        f" loaded checkpoint {path} (iteration {it}, written on TP {saved['tp']} x PP "
        f"{saved['pp']} x DP {saved['dp']}): loss scale "
        f"{optimizer.get_loss_scale().item():g}, {counters['skipped_iters']} skipped iterations",
        flush=True,
    )
    return it
