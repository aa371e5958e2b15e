"""Train a small GPT with tensor, pipeline and data parallelism in fp16, bf16 or fp32 with tpamp.

Run (CPU, gloo; 4 ranks = TP 2 x PP 2 x DP 1; the defaults run as they are)::

    torchrun --nproc-per-node 4 scripts/train_gpt.py
    torchrun --nproc-per-node 4 scripts/train_gpt.py --bf16
    torchrun --nproc-per-node 8 scripts/train_gpt.py --log-dir runs/gpt   # DP 2 as well

On GPUs the same command uses NCCL and one GPU per rank.

What happens:

- Data: a byte-level (vocab 256) text file, by default the Python standard library's own
  source (the sorted ``*.py`` files of the ``os`` module's directory, up to 4 MiB); ``--data``
  takes any text file. The last 10% is the validation split. Every rank draws the same global
  batch from a seeded generator and keeps its DP rank's slice, so TP and PP peers agree.
- Model (scripts/gpt_model.py): the blocks are split evenly over the pipeline stages; inside
  a stage, PyTorch's ``parallelize_module`` shards attention and MLP over the TP sub-mesh
  (Megatron's column/row split). The word embedding (first stage) is tied to the output head
  (last stage, a copy marked ``shared``), as in Megatron-LM; both are vocab-parallel (V/tp rows
  per TP rank), so each TP rank computes its own slice of the logits.
- Megatron's fp16 numerics, through ``tpamp.functional``: ``--fp32-residual-connection``
  (``tpamp.residual_add``; the residual stream, and so the activations passed between pipeline
  stages, are fp32), ``--attention-softmax-in-fp32`` (``tpamp.scale_mask_softmax``, always used
  for the attention probabilities; the flag decides whether fp16/bf16 scores are upcast) and
  ``--fp16-lm-cross-entropy``: the loss is always ``tpamp.vocab_parallel_cross_entropy`` over
  the vocab-sharded logits on the TP group, in fp32 unless this flag is given.
  ``--fp32-final-layernorm`` (not a Megatron flag) keeps the final LayerNorm an fp32 island
  (``tpamp.set_fp32_attr_to_module``). Stage activations are [mb, T, H] in the model dtype, or
  fp32 with ``--fp32-residual-connection``.
- Pipeline: ``torch.distributed.pipelining``. Each rank's stage is a ``PipelineStage``
  (tpamp.pipelining.NoSyncPipelineStage) on the PP group with static metadata (activations
  [mb, T, H] between stages; nothing runs on uninitialised tensors), driven by the schedule
  ``--pipeline-schedule`` names, with PyTorch's names: 1F1B (the default: at most PP
  microbatches' activations alive on a stage), GPipe (all forwards, then all backwards),
  Interleaved1F1B and LoopedBFS with Megatron's ``--num-layers-per-virtual-pipeline-stage``
  (each rank holds num-layers / (PP x that) model chunks, global stage ``chunk * PP +
  pp_rank``). The schedule's loss function (tpamp.pipelining.PipelineLoss, ``scale_grads=False``)
  divides each microbatch's loss by the number of microbatches and applies the loss scale
  before backward; the logged losses are unscaled again.
- After backward: grads are averaged over the DP group, the two embedding copies' grads are
  summed over the embedding group, then ``tpamp.MixedPrecisionOptimizer`` (around AdamW) unscales,
  checks inf/nan over the model-parallel group, updates the loss scale, clips, and steps or
  skips. With ``--use-distributed-optimizer`` (Megatron's flag) ``tpamp.DistributedOptimizer``
  holds fp32 main params and AdamW state for 1/DP of the params on each rank and its step
  reduce-scatters the grads over DP itself (no hand all-reduce), checks inf/nan and takes the
  norm over TP x PP x DP, and all-gathers the updated params. ``--overlap-grad-reduce`` starts
  those reduce-scatters from backward hooks during the last microbatch's backward (of each
  model chunk; the others run under its ``no_sync()``); the tied
  word embedding has a bucket of its own that waits for step(), since its two copies' grads
  are summed over the embedding group after backward, before they may be reduced over DP.
- With ``--use-torch-fsdp2`` (Megatron-LM's flag; any pipeline size, one model chunk per rank)
  data parallelism is PyTorch's FSDP2: after TP, each block and the whole stage go through
  ``fully_shard`` on the DP sub-mesh with ``MixedPrecisionPolicy(param_dtype=fp16/bf16, reduce_dtype=float32)``. The
  sharded fp32 DTensor params are the master weights; ``tpamp.fsdp.fully_shard_optimizer``
  wraps AdamW in ``tpamp.FP32Optimizer`` with the loss scaler, and found_inf, the grad norm,
  zeros and per-parameter norms are reduced over the whole PP x DP x TP mesh (tpamp/fsdp.py).
  Under a pipeline the stage is FSDP2's root inside the schedule (``PipelineStage`` runs FSDP2's
  no-sync and its post-backward reduce-scatter); the tied head copy's grad, a DTensor placed
  like the embedding's, is summed with it over the embedding group on the local shards.
- Learning rate: linear warm-up, then cosine decay (``torch.optim.lr_scheduler.LambdaLR``),
  advanced only after a successful step, as in Megatron-LM's training loop: a skipped step
  (overflow or spike) does not use up the schedule.
- Spikes (tpamp.SpikeDetector): the DP-averaged loss and the reduced grad norm of every step are
  judged against their last ``--spike-window`` values; ``--spike-policy`` log (the default)
  records spikes, ``--skip-grad-norm-spikes`` skips those steps (the loss scale untouched),
  raise stops the run.
- Per-parameter grad norms (``--log-param-grad-norms K``): at every log interval the top-K
  parameters by grad norm (names with the global layer index) follow the line, go into the
  JSONL record as ``param_grad_norms`` and into TensorBoard as ``grad-norm/NAME``; also with
  ``--use-distributed-optimizer`` (a param split across DP shards is summed over DP).
- Non-finite attribution: a skipped step's log line and JSONL record name the parameters whose
  grads held the inf/NaN, with their TP, PP and DP ranks (``optimizer.last_nonfinite``, global
  names; tpamp/nonfinite.py). ``--trace-nonfinite after-skip`` arms ``tpamp.NonFiniteTracer`` on
  every stage for the iteration after such a skip (``always``: every iteration, slow) and logs
  the first module, phase and micro-batch whose activations or activation grads are non-finite
  or within 2x of fp16's max, agreed over all ranks (JSONL ``nonfinite_activation``).
- Flags: every flag and the ``--data`` file are checked first, on every rank, before torch is
  imported or any process group, model or optimizer exists (``validate_args``): a bad one ends
  the run with exit status 2 on every rank and one line on stderr from rank 0 naming the flag,
  its value and what is expected.
- Logging on one rank (last PP stage, TP rank 0, DP rank 0): a tqdm bar when stderr is a
  terminal, Megatron's line every ``--log-interval`` iterations (``tpamp.TrainingLogger``), a
  JSONL record per iteration and TensorBoard scalars under ``--log-dir``, validation loss every
  ``--eval-interval`` iterations, and a summary at the end (also ``summary.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import glob
import json
import math
import os
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # gpt_model
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tpamp

import gpt_checkpoint  # noqa: E402 -- the standard library only at import

# ----------------------------------------------------------------------------- configuration
#
# Standard library only, up to the check of the flags: run as a script, a bad flag is refused
# before torch is imported (seconds on a busy machine; see the end of this section).

# the fp16 numerics switches, as argparse dests (reported in the first line and summary.json)
NUMERICS_FLAGS = (
    "fp32_residual_connection", "attention_softmax_in_fp32", "fp16_lm_cross_entropy",
    "fp32_final_layernorm",
)


# --pipeline-schedule: PyTorch's schedule names (torch.distributed.pipelining.schedules);
# those that run several model chunks per rank (Megatron's virtual pipeline stages, placed in a
# loop: rank r holds stages r, r + pp, ...) need --num-layers-per-virtual-pipeline-stage
SINGLE_STAGE_SCHEDULES = ("1F1B", "GPipe")
MULTI_STAGE_SCHEDULES = ("Interleaved1F1B", "LoopedBFS")
PIPELINE_SCHEDULES = SINGLE_STAGE_SCHEDULES + MULTI_STAGE_SCHEDULES

# --exp-avg-dtype / --exp-avg-sq-dtype (torch dtypes in build_optimizer)
STATE_DTYPE_CHOICES = ("bf16", "fp32", "fp8", "uint8")
PROG = "train_gpt.py"
VOCAB_SIZE = 256  # byte-level tokens


class FlagError(ValueError):
    """A command-line flag (or the data file it names) this run cannot use: ``flag`` and
    ``value`` as given, ``expected`` what would work. ``str()`` is the one-line message."""

    def __init__(self, flag: str, value, expected: str):
        self.flag, self.value, self.expected = flag, value, expected
        super().__init__(f"{flag} {value}: {expected}")


def launch_rank() -> int:
    """This process's global rank as torchrun sets it (``RANK``; 0 for a lone process), read
    from the environment: usable before any process group exists."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def launch_world_size() -> int:
    """The number of ranks torchrun started (``WORLD_SIZE``; 1 for a lone process)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def exit_with_flag_error(message: str) -> None:
    """argparse's convention on every rank: exit status 2. Only rank 0 (or the lone process)
    prints, one line on stderr, so a bad flag gives one message, not one traceback per rank.
    No collective: the other ranks need not wait for anything."""
    if launch_rank() == 0:
        print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own checks (types, choices, exclusive flags)
        exit_with_flag_error(message)


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, parsed and validated (:func:`validate_args`): a bad flag exits with status 2
    on every rank and one line on rank 0 (:func:`exit_with_flag_error`)."""
    p = _ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    a = p.add_argument
    # parallel layout
    a("--tensor-model-parallel-size", type=int, default=2)
    a("--pipeline-model-parallel-size", type=int, default=2)
    a("--pipeline-schedule", choices=PIPELINE_SCHEDULES, default="1F1B",
      help="torch.distributed.pipelining's schedule, by PyTorch's name (default 1F1B); "
           "Interleaved1F1B and LoopedBFS need --num-layers-per-virtual-pipeline-stage")
    a("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
      help="layers per model chunk for the interleaved schedules: each rank holds "
           "num-layers / (pipeline size x this) chunks")
    # model
    a("--num-layers", type=int, default=4)
    a("--hidden-size", type=int, default=256)
    a("--num-attention-heads", type=int, default=8)
    a("--seq-length", type=int, default=128)
    # batch: global = micro * num_microbatches * DP; give one of the last two
    a("--micro-batch-size", type=int, default=4)
    a("--global-batch-size", type=int, default=None)
    a("--num-microbatches", type=int, default=None, help="per DP rank (default 4)")
    # training
    a("--train-iters", type=int, default=300)
    a("--lr", type=float, default=2e-3)
    a("--min-lr", type=float, default=2e-4, help="end of the cosine decay")
    a("--lr-warmup-iters", type=int, default=20)
    a("--weight-decay", type=float, default=0.1)
    a("--clip-grad", type=float, default=1.0, help="max global grad norm; 0 disables")
    a("--use-distributed-optimizer", action="store_true",
      help="shard fp32 main params and optimizer state over DP (tpamp.DistributedOptimizer)")
    a("--overlap-grad-reduce", action="store_true",
      help="with --use-distributed-optimizer: start each grad bucket's reduce-scatter during "
           "the last microbatch's backward (the tied embedding's bucket waits for its sum)")
    a("--use-torch-fsdp2", action="store_true",
      help="shard params, grads and optimizer state over DP with torch's fully_shard (FSDP2) "
           "and a MixedPrecisionPolicy from --fp16/--bf16 (one model chunk per rank; tpamp.fsdp)")
    a("--seed", type=int, default=1234)
    # optimizer-state storage (Megatron-core's precision-aware optimizer flags; tpamp.state_formats)
    a("--exp-avg-dtype", choices=STATE_DTYPE_CHOICES, default="fp32",
      help="storage of Adam's exp_avg: fp32, bf16, uint8 (8-bit codes of the dynamic map of "
           "torchao's AdamW8bit, a scale per 256 elements: the 8-bit format to use) or fp8 "
           "(8-bit e4m3fn codes, a scale per 256 elements)")
    a("--exp-avg-sq-dtype", choices=STATE_DTYPE_CHOICES, default="fp32",
      help="storage of Adam's exp_avg_sq (as --exp-avg-dtype)")
    a("--store-param-remainders", action="store_true",
      help="--bf16 only: keep bf16 params + int16 remainders instead of fp32 master params")
    # precision and loss scaling (Megatron's flags)
    prec = p.add_mutually_exclusive_group()
    prec.add_argument("--fp16", action="store_true", help="the default")
    prec.add_argument("--bf16", action="store_true")
    prec.add_argument("--fp32", action="store_true")
    a("--loss-scale", type=float, default=None, help="a constant loss scale (ConstantGradScaler)")
    a("--initial-loss-scale", type=float, default=2.0**16)
    a("--min-loss-scale", type=float, default=1.0)
    a("--loss-scale-window", type=int, default=1000, help="growth interval (clean steps)")
    a("--hysteresis", type=int, default=2)
    a("--cpu-native-half-matmul", action="store_true",
      help="on CPU, use the (slow) native fp16/bf16 GEMM instead of fp32 accumulation")
    # Megatron's fp16 numerics flags (tpamp.functional)
    a("--fp32-residual-connection", action="store_true",
      help="keep the residual stream (and the activations between pipeline stages) in fp32")
    a("--attention-softmax-in-fp32", action="store_true",
      help="compute the attention softmax in fp32 for fp16/bf16 scores")
    a("--fp16-lm-cross-entropy", action="store_true",
      help="compute the vocab-parallel cross-entropy in fp16/bf16 instead of fp32")
    a("--fp32-final-layernorm", action="store_true",
      help="keep the final LayerNorm in fp32 (an fp32 island, tpamp.set_fp32_attr_to_module)")
    # data
    a("--data", default=None, help="a text file (default: the Python stdlib's .py source)")
    a("--data-max-bytes", type=int, default=4 * 2**20, help="cap for the default data")
    a("--valid-fraction", type=float, default=0.1)
    # logging and evaluation
    a("--log-interval", type=int, default=10)
    a("--log-num-zeros-in-grad", action="store_true")
    a("--log-param-grad-norms", type=int, default=0, metavar="K",
      help="at each log interval, log the K largest per-parameter grad norms (0: off)")
    # spike detection (tpamp.SpikeDetector)
    spike = p.add_mutually_exclusive_group()
    spike.add_argument("--spike-policy", choices=("off", "log", "skip", "raise"), default="log",
                       help="what to do with a grad-norm or loss spike (default: log it)")
    spike.add_argument("--skip-grad-norm-spikes", dest="spike_policy", action="store_const",
                       const="skip", help="skip the steps with a spike (= --spike-policy skip)")
    a("--spike-threshold", type=float, default=6.0, help="standard deviations above the mean")
    a("--spike-window", type=int, default=100, help="recent values the statistics hold")
    a("--spike-warmup", type=int, default=20, help="values seen before any decision")
    a("--trace-nonfinite", choices=("off", "after-skip", "always"), default="off",
      help="trace activations with tpamp.NonFiniteTracer on the iteration after a skipped "
           "step, or on every iteration (slow)")
    a("--log-dir", default=None, help="JSONL log, summary.json and TensorBoard events")
    a("--eval-interval", type=int, default=100)
    a("--eval-iters", type=int, default=5, help="global batches per evaluation")
    a("--no-progress", action="store_true", help="no tqdm bar")
    a("--dist-timeout", type=float, default=300.0, help="seconds before a collective fails")
    gpt_checkpoint.add_arguments(p)  # --save, --save-interval, --load, --ckpt-step
    args = p.parse_args(argv)
    try:
        validate_args(args)
    except FlagError as e:
        exit_with_flag_error(str(e))
    return args


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _check(args, dest: str, ok: bool, expected: str) -> None:
    if not ok:
        raise FlagError(_flag(dest), getattr(args, dest), expected)


def _float32(x: float) -> float:
    """``x`` rounded to float32 (inf beyond its range), as a loss scale is stored."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _check_scale(args, dest: str) -> None:
    """A loss scale flag: finite and > 0 in float32, the dtype tpamp's scalers store it in."""
    value = getattr(args, dest)
    _check(args, dest, math.isfinite(value) and value > 0 and 0 < _float32(value) < math.inf,
           "expected a loss scale > 0 that float32 holds (1.4e-45 to 3.4e+38)")


def default_text_files() -> list:
    """The sorted *.py files next to ``os.py``: the Python standard library's own source."""
    return sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))


def split_sizes(num_bytes: int, valid_fraction: float):
    """(train, validation) bytes of a text of ``num_bytes``: the last ``valid_fraction``
    (rounded down) is the validation split (ByteData)."""
    n_valid = int(num_bytes * valid_fraction)
    return num_bytes - n_valid, n_valid


def data_size(args) -> int:
    """Bytes of the text the run trains on: the --data file, or the default text cut to
    --data-max-bytes (from the file sizes; nothing is read)."""
    if args.data:
        return os.path.getsize(args.data)
    files = default_text_files()
    return min(sum(os.path.getsize(f) for f in files) + max(0, len(files) - 1), args.data_max_bytes)


def validate_args(args) -> None:
    """Every check of the flags and the data file, with nothing but the environment torchrun
    sets (``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``): run on every rank before any process group,
    model or optimizer exists. Raises :class:`FlagError` (a ValueError) naming the first flag
    this run cannot take, its value and what is expected; returns None when all fit."""
    world = launch_world_size()
    # parallel layout
    for dest in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        _check(args, dest, getattr(args, dest) >= 1, "expected a size >= 1")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    _check(args, "tensor_model_parallel_size", world % (tp * pp) == 0,
           f"expected tensor x pipeline size ({tp} x {pp} = {tp * pp}) to divide the {world} "
           "ranks (WORLD_SIZE)")
    dp = world // (tp * pp)
    if args.use_torch_fsdp2:
        _check(args, "use_distributed_optimizer", not args.use_distributed_optimizer,
               "--use-torch-fsdp2 and --use-distributed-optimizer exclude each other")
        _check(args, "pipeline_schedule", args.pipeline_schedule not in MULTI_STAGE_SCHEDULES,
               f"--use-torch-fsdp2 runs one model chunk per rank: expected a single-stage "
               f"schedule (GPipe, 1F1B, ...), not {args.pipeline_schedule}")
    virtual = args.num_layers_per_virtual_pipeline_stage
    if args.pipeline_schedule in MULTI_STAGE_SCHEDULES:
        _check(args, "num_layers_per_virtual_pipeline_stage", virtual is not None,
               f"--pipeline-schedule {args.pipeline_schedule} runs several model chunks per "
               "rank: expected --num-layers-per-virtual-pipeline-stage N")
        _check(args, "pipeline_model_parallel_size", pp >= 2,
               f"--pipeline-schedule {args.pipeline_schedule} needs a pipeline size >= 2 (the "
               "word embedding and its tied head copy on different ranks)")
        _check(args, "num_layers_per_virtual_pipeline_stage",
               virtual >= 1 and args.num_layers % (pp * virtual) == 0,
               f"expected a divisor of --num-layers {args.num_layers} / "
               f"--pipeline-model-parallel-size {pp}")
    else:
        _check(args, "num_layers_per_virtual_pipeline_stage", virtual is None,
               f"--pipeline-schedule {args.pipeline_schedule} runs one model chunk per rank: "
               f"expected {', '.join(MULTI_STAGE_SCHEDULES)} with it, or no such flag")
    _check(args, "overlap_grad_reduce",
           not args.overlap_grad_reduce or args.use_distributed_optimizer,
           "--overlap-grad-reduce needs --use-distributed-optimizer (the grads are "
           "reduce-scattered by its backward hooks)")
    # model
    for dest in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        _check(args, dest, getattr(args, dest) >= 1, "expected an int >= 1")
    _check(args, "num_layers", args.num_layers % pp == 0,
           f"expected a multiple of --pipeline-model-parallel-size {pp} (an even split)")
    _check(args, "hidden_size", args.hidden_size % args.num_attention_heads == 0,
           f"expected a multiple of --num-attention-heads {args.num_attention_heads}")
    _check(args, "num_attention_heads", args.num_attention_heads % tp == 0,
           f"expected a multiple of --tensor-model-parallel-size {tp}")
    _check(args, "tensor_model_parallel_size", VOCAB_SIZE % tp == 0,
           f"expected a divisor of the vocabulary size {VOCAB_SIZE} (vocab-parallel embedding)")
    # batch
    _check(args, "micro_batch_size", args.micro_batch_size >= 1, "expected an int >= 1")
    if args.num_microbatches is not None:
        _check(args, "num_microbatches", args.num_microbatches >= 1, "expected an int >= 1")
    if args.global_batch_size is not None:
        per_step = args.micro_batch_size * dp
        _check(args, "global_batch_size",
               args.num_microbatches is None and args.global_batch_size >= 1
               and args.global_batch_size % per_step == 0,
               f"expected a positive multiple of micro-batch-size * DP = "
               f"{args.micro_batch_size} * {dp} (and no --num-microbatches)")
    m = (args.global_batch_size // (args.micro_batch_size * dp)
         if args.global_batch_size is not None else args.num_microbatches or 4)
    if args.pipeline_schedule == "1F1B":  # PyTorch's Schedule1F1B
        _check(args, "pipeline_schedule", m >= pp,
               f"1F1B needs at least as many microbatches per DP rank as pipeline stages, this "
               f"run has {m} microbatches and pipeline size {pp}: expected --num-microbatches "
               f">= {pp} (or --global-batch-size >= {pp * args.micro_batch_size * dp}), or GPipe")
    if args.pipeline_schedule == "Interleaved1F1B":  # PyTorch: whole rounds of microbatches
        rounds = max(1, m // pp)
        _check(args, "pipeline_schedule", m % rounds == 0,
               f"Interleaved1F1B runs the {m} microbatches per DP rank in rounds of up to the "
               f"pipeline size {pp}: expected a number of microbatches that max(1, M // {pp}) "
               "divides")
    # training
    _check(args, "train_iters", args.train_iters >= 1, "expected an int >= 1")
    _check(args, "lr", math.isfinite(args.lr) and args.lr > 0, "expected a finite lr > 0")
    _check(args, "min_lr", math.isfinite(args.min_lr) and args.min_lr >= 0,
           "expected a finite lr >= 0")
    _check(args, "lr_warmup_iters", args.lr_warmup_iters >= 0, "expected an int >= 0")
    for dest in ("weight_decay", "clip_grad"):
        _check(args, dest, math.isfinite(getattr(args, dest)) and getattr(args, dest) >= 0,
               "expected a finite value >= 0")
    # loss scaling (tpamp.ConstantGradScaler / DynamicGradScaler: float32 scales, ints >= 1)
    if args.loss_scale is not None:
        _check_scale(args, "loss_scale")
    _check_scale(args, "initial_loss_scale")
    _check_scale(args, "min_loss_scale")
    _check(args, "min_loss_scale", args.min_loss_scale <= args.initial_loss_scale,
           f"expected at most --initial-loss-scale {args.initial_loss_scale}")
    for dest in ("loss_scale_window", "hysteresis"):
        _check(args, dest, 1 <= getattr(args, dest) <= 2**31 - 1, "expected an int >= 1")
    # spike detection (tpamp.SpikeDetector)
    _check(args, "spike_threshold", math.isfinite(args.spike_threshold)
           and args.spike_threshold > 0, "expected a finite number > 0")
    for dest in ("spike_window", "spike_warmup"):
        _check(args, dest, getattr(args, dest) >= 2, "expected an int >= 2")
    _check(args, "spike_warmup", args.spike_warmup <= args.spike_window,
           f"expected at most --spike-window {args.spike_window}")
    # narrow optimizer state (tpamp.state_formats): the one-pass Adam step only
    dtype_flag = "--bf16" if args.bf16 else "--fp32" if args.fp32 else "--fp16 (the default)"
    if args.store_param_remainders:
        _check(args, "store_param_remainders", args.bf16,
               f"remainders apply only to bf16 params, this run has {dtype_flag} params: "
               "expected --bf16 (or no --store-param-remainders)")
        _check(args, "store_param_remainders", not args.use_torch_fsdp2,
               "with --use-torch-fsdp2 the sharded fp32 params are the masters: expected "
               "no --store-param-remainders")
    narrow = (args.exp_avg_dtype != "fp32" or args.exp_avg_sq_dtype != "fp32"
              or args.store_param_remainders)
    if narrow:
        state = (f"--exp-avg-dtype {args.exp_avg_dtype} --exp-avg-sq-dtype "
                 f"{args.exp_avg_sq_dtype}{' --store-param-remainders' if args.store_param_remainders else ''}")
        if args.loss_scale is not None:
            _check(args, "loss_scale", args.loss_scale >= 1,
                   f"narrow optimizer state ({state}) needs the one-pass step, which needs a "
                   "loss scale >= 1: expected --loss-scale >= 1")
        elif not (args.bf16 or args.fp32):
            _check(args, "min_loss_scale", args.min_loss_scale >= 1,
                   f"narrow optimizer state ({state}) needs the one-pass step, which needs a "
                   "loss scale that never drops below 1: expected --min-loss-scale >= 1")
    # data
    _check(args, "valid_fraction", 0 < args.valid_fraction < 1, "expected 0 < fraction < 1")
    _check(args, "data_max_bytes", args.data_max_bytes >= 1, "expected an int >= 1")
    if args.data:
        if not os.path.exists(args.data):
            raise FlagError("--data", args.data, "no such file; expected a text file")
        if os.path.isdir(args.data):
            raise FlagError("--data", args.data, "is a directory; expected a text file")
        if not os.access(args.data, os.R_OK):
            raise FlagError("--data", args.data, "is not readable; expected a readable text file")
    size = data_size(args)
    n_train, n_valid = split_sizes(size, args.valid_fraction)
    if min(n_train, n_valid) <= args.seq_length + 1:
        flag, value = ("--data", args.data) if args.data else ("--data-max-bytes", args.data_max_bytes)
        raise FlagError(
            flag, value,
            f"{'an empty file' if size == 0 else f'{size} bytes'} split into {n_train} train and "
            f"{n_valid} validation bytes (--valid-fraction {args.valid_fraction}); expected more "
            f"than --seq-length + 1 = {args.seq_length + 1} bytes in each split"
        )
    # logging and evaluation
    _check(args, "log_interval", args.log_interval >= 1, "expected an int >= 1")
    _check(args, "log_param_grad_norms", args.log_param_grad_norms >= 0, "expected an int >= 0")
    _check(args, "eval_interval", args.eval_interval >= 0, "expected an int >= 0 (0: no evaluation)")
    _check(args, "eval_iters", args.eval_iters >= 1, "expected an int >= 1")
    _check(args, "dist_timeout", math.isfinite(args.dist_timeout) and args.dist_timeout > 0,
           "expected a finite number of seconds > 0")
    for dest in ("log_dir", "save"):
        path = getattr(args, dest)
        _check(args, dest, path is None or not os.path.exists(path) or os.path.isdir(path),
               "exists and is not a directory; expected a directory")
    # checkpoints (Megatron-LM's flags)
    if args.save_interval is not None:
        _check(args, "save_interval", args.save_interval >= 1, "expected an int >= 1")
        _check(args, "save_interval", args.save is not None, "expected --save DIR with it")
    if args.ckpt_step is not None:
        _check(args, "ckpt_step", args.load is not None, "expected --load DIR with it")
        _check(args, "ckpt_step", args.ckpt_step >= 0, "expected an iteration >= 0")
    if args.load is not None:
        _check(args, "load", not os.path.exists(args.load) or os.path.isdir(args.load),
               "exists and is not a directory; expected a checkpoint directory")
        flag, value = (("--ckpt-step", args.ckpt_step) if args.ckpt_step is not None
                       else ("--load", args.load))
        try:
            it = gpt_checkpoint.resume_iteration(args)
        except ValueError as e:
            raise FlagError(flag, value, str(e)) from None
        if it is not None and it >= args.train_iters:
            raise FlagError(flag, value, f"the checkpoint is at iteration {it}, not before "
                            f"--train-iters {args.train_iters}: nothing to train")
    # the devices: the last check, as it imports torch (which the run imports next anyway)
    import torch

    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if torch.cuda.is_available() and torch.cuda.device_count() < local_world:
        raise FlagError("--nproc-per-node", local_world,
                        f"NCCL needs one GPU per rank and this node has "
                        f"{torch.cuda.device_count()} (run on CPU with CUDA_VISIBLE_DEVICES=\"\")")


if __name__ == "__main__":  # a bad flag exits here, before the imports below
    parse_args()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from gpt_model import GPTChunks, GPTConfig, GPTStage, count_params, parallelize_stage  # noqa: E402

import tpamp  # noqa: E402
from tpamp.grad_stats import local_tensor  # noqa: E402
from tpamp.parallel import initialize_model_parallel  # noqa: E402

_STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn,
                 "uint8": torch.uint8}


# ----------------------------------------------------------------------------- data


def default_text() -> bytes:
    """The default data: the files of :func:`default_text_files`, joined by newlines."""
    return b"\n".join(open(f, "rb").read() for f in default_text_files())


class ByteData:
    """Byte-level tokens (vocab 256) of one text, split into train and validation.

    ``batch`` returns (x, y): int64 [n, T] inputs and the next-byte targets.
    """

    def __init__(self, text: bytes, seq_length: int, valid_fraction: float):
        tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8) if text else \
            torch.zeros(0, dtype=torch.uint8)
        n_train, _ = split_sizes(len(tokens), valid_fraction)
        self.train, self.valid = tokens[:n_train], tokens[n_train:]
        self.seq_length = seq_length
        for name, split in (("train", self.train), ("validation", self.valid)):
            if len(split) <= seq_length + 1:
                raise ValueError(
                    f"the {name} split has {len(split)} bytes, too few for --seq-length "
                    f"{seq_length}; use a larger --data file"
                )

    def batch(self, split: str, n: int, gen: torch.Generator):
        data = self.train if split == "train" else self.valid
        starts = torch.randint(len(data) - self.seq_length - 1, (n,), generator=gen)
        offsets = torch.arange(self.seq_length + 1)
        chunk = data[starts[:, None] + offsets].long()  # [n, T + 1]
        return chunk[:, :-1], chunk[:, 1:]


def dp_batch(data: ByteData, split: str, gen, st, micro_batch_size, num_microbatches, device):
    """This DP rank's slice of one global batch: (x, y) int64 [M * mb, T], which the pipeline
    schedule splits into M microbatches of ``micro_batch_size`` rows along dim 0.

    Every rank draws the whole global batch from ``gen`` (so the generators stay in step) and
    keeps rows [dp_rank * per_dp, (dp_rank + 1) * per_dp)."""
    per_dp = micro_batch_size * num_microbatches
    x, y = data.batch(split, per_dp * st.dims.dp, gen)
    return x[st.dp_rank * per_dp:][:per_dp].to(device), y[st.dp_rank * per_dp:][:per_dp].to(device)


# ----------------------------------------------------------------------------- pipeline

def lm_loss_fn(st, fp16_lm_cross_entropy: bool):
    """The last stage's loss of one microbatch: ``tpamp.vocab_parallel_cross_entropy`` of its
    [mb, T, V/tp] logits and [mb, T] targets over the TP group (in the logits' dtype with
    ``fp16_lm_cross_entropy``, else fp32), then the fp32 mean over tokens, as Megatron-LM."""

    def loss_fn(logits, targets):
        return tpamp.vocab_parallel_cross_entropy(
            logits, targets, st.tp_group, fp16_lm_cross_entropy=fp16_lm_cross_entropy
        ).float().mean()

    return loss_fn


def build_pipeline(run: "Run"):
    """This rank's ``torch.distributed.pipelining`` stage and the --pipeline-schedule over it.

    The stage (:class:`tpamp.pipelining.NoSyncPipelineStage`, index ``pp_rank`` of ``pp`` on
    ``st.pp_group``) has static metadata, so no forward runs on uninitialised tensors: inputs
    are token ids [mb, T] int64 on the first stage, else activations [mb, T, H] in the residual
    stream's dtype (the model dtype, fp32 with --fp32-residual-connection) with
    requires_grad; outputs are those activations, or on the last stage the logits [mb, T,
    V/tp] in the model dtype. The schedule has ``scale_grads=False``: its ``loss_fn``
    (:class:`tpamp.pipelining.PipelineLoss`) divides by the number of microbatches and applies
    the loss scale before backward. With --overlap-grad-reduce every backward but the last of
    a step runs under the distributed optimizer's ``no_sync()``. Under an interleaved schedule
    (Interleaved1F1B, LoopedBFS) each of the rank's model chunks is a stage of its own, global
    index ``chunk * pp + pp_rank``."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    from tpamp.pipelining import NoSyncPipelineStage, PipelineLoss

    args, st, device = run.args, run.st, run.device
    mb, seq, hidden = args.micro_batch_size, args.seq_length, args.hidden_size
    act_dtype = torch.float32 if args.fp32_residual_connection else run.dtype
    no_sync = run.optimizer.no_sync if args.overlap_grad_reduce else None
    chunks = run.stage.chunks if isinstance(run.stage, GPTChunks) else [run.stage]
    num_stages = st.dims.pp * len(chunks)
    stages = []
    for c, chunk in enumerate(chunks):  # global stage c * pp + pp_rank (a loop over the ranks)
        if chunk.is_first:
            example_in = torch.zeros(mb, seq, dtype=torch.long, device=device)
        else:
            example_in = torch.empty(mb, seq, hidden, dtype=act_dtype, device=device,
                                     requires_grad=True)
        if chunk.is_last:
            out_shape, out_dtype = (mb, seq, VOCAB_SIZE // st.dims.tp), run.dtype
        else:
            out_shape, out_dtype = (mb, seq, hidden), act_dtype
        example_out = torch.empty(out_shape, dtype=out_dtype, device=device, requires_grad=True)
        stages.append(NoSyncPipelineStage(
            chunk, c * st.dims.pp + st.pp_rank, num_stages, device, input_args=(example_in,),
            output_args=(example_out,), group=st.pp_group, no_sync=no_sync,
        ))
    loss = PipelineLoss(lm_loss_fn(st, args.fp16_lm_cross_entropy), run.num_microbatches,
                        run.optimizer)
    schedule = get_schedule_class(args.pipeline_schedule)(
        stages if args.pipeline_schedule in MULTI_STAGE_SCHEDULES else stages[0],
        n_microbatches=run.num_microbatches, loss_fn=loss, scale_grads=False,
    )
    return schedule, loss


def run_pipeline(run: "Run", x, y, train: bool) -> list:
    """One pass of the schedule over this DP rank's batch ``x``, ``y`` ([M * mb, T]): forward
    and backward (``train``) or forward only. Returns the last stage's per-microbatch losses
    (fp32 0-dim, detached, unscaled), [] elsewhere."""
    st, schedule = run.st, run.schedule
    inputs = (x,) if st.is_first_stage else ()
    losses = [] if st.is_last_stage else None
    target = y if st.is_last_stage else None
    scale = run.optimizer.get_loss_scale().clone()  # the step may change it afterwards
    if train:
        schedule.step(*inputs, target=target, losses=losses, return_outputs=False)
    else:
        with torch.no_grad():
            schedule.eval(*inputs, target=target, losses=losses, return_outputs=False)
    return run.loss.unscale(losses, scale) if st.is_last_stage else []


def mean_over_dp(losses, st) -> float:
    """Mean of the last stage's microbatch losses, averaged over the DP group (host float)."""
    loss = torch.stack(losses).mean()
    if st.dims.dp > 1:
        dist.all_reduce(loss, group=st.dp_group)
        loss /= st.dims.dp
    return loss.item()


# ----------------------------------------------------------------------------- grad sync


def _all_reduce_grads(grads, group, divide_by: int = 1) -> None:
    """Sum (then divide) grads over ``group`` in one fp32 buffer, written back in place.

    fp32, so that the sum of two finite fp16 grads is not rounded twice and a half-precision
    all-reduce is not needed from the backend; a sum that overflows fp16 still turns into inf
    on the way back, and the optimizer skips that step."""
    if not grads:
        return
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat, group=group)
    if divide_by != 1:
        flat /= divide_by
    for g, new in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(new.view_as(g))


def all_reduce_data_parallel_grads(stage, st) -> None:
    """Average every grad over the DP group (for a DTensor grad: its local shard)."""
    if st.dims.dp > 1:
        grads = [local_tensor(p.grad) for p in stage.parameters() if p.grad is not None]
        _all_reduce_grads(grads, st.dp_group, divide_by=st.dims.dp)


def all_reduce_embedding_grads(stage, st) -> None:
    """Sum the grads of the word embedding (first stage) and its tied copy, the output head
    (last stage), so both copies take the same step and stay identical (Megatron-LM)."""
    weight = stage.word_embedding_weight() if st.embedding_group is not None else None
    if weight is not None:  # both copies are Shard(0) alike: sum the local vocab rows
        # the distributed optimizer has moved the grad into its main_grad buffer
        grad = getattr(weight, "main_grad", None)
        grad = grad if grad is not None else local_tensor(weight.grad)
        _all_reduce_grads([grad], st.embedding_group)


# ----------------------------------------------------------------------------- setup


def setup_distributed(args):
    """init_process_group (NCCL with GPUs, one per rank as validate_args checked, else gloo)
    and the TP x PP x DP layout."""
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        torch.set_num_threads(1)  # several ranks share the cores
        device = torch.device("cpu")
    dist.init_process_group(
        "nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=args.dist_timeout)
    )
    st = initialize_model_parallel(
        args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    )
    return st, device


def virtual_stages(args) -> int:
    """Model chunks per rank: num_layers / (pp x --num-layers-per-virtual-pipeline-stage), or 1."""
    per = args.num_layers_per_virtual_pipeline_stage
    return 1 if per is None else args.num_layers // (args.pipeline_model_parallel_size * per)


def build_stage(cfg: GPTConfig, st, dtype, device, seed: int, fsdp2: bool = False,
                virtual: int = 1):
    """This rank's stage (a GPTStage, or with ``virtual`` > 1 the GPTChunks of an interleaved
    schedule): seeded fp32 init, tied head copied from the first stage, cast to
    ``dtype`` (fp32 islands, e.g. --fp32-final-layernorm, stay fp32), then TP-sharded with
    parallelize_module (vocab-parallel embedding and head copy). Cast before sharding: the
    grad hooks that parallelize_stage puts on the DTensor params do not survive a later cast."""
    if virtual > 1:
        stage = GPTChunks(cfg, st.dims.pp, st.pp_rank, virtual)
    else:
        stage = GPTStage(cfg, st.dims.pp, st.pp_rank)
    stage.init_weights(seed)
    stage.to(device)
    weight = stage.word_embedding_weight() if st.embedding_group is not None else None
    if weight is not None:  # the head copy starts as the first stage's embedding
        with torch.no_grad():
            dist.broadcast(weight, src=st.pp_ranks[0], group=st.embedding_group)
    # src_data_rank=None: every TP rank holds the same seeded full weights and keeps its shard
    if fsdp2:
        return fully_shard_stage(parallelize_stage(stage, st.tp_mesh), st, dtype)
    stage.cast_(dtype)
    return parallelize_stage(stage, st.tp_mesh)


def fully_shard_stage(stage: GPTStage, st, dtype) -> GPTStage:
    """--use-torch-fsdp2: the TP-sharded fp32 stage through FSDP2's ``fully_shard`` on the DP
    sub-mesh, each block, then the whole stage (its params stay fp32: the master weights;
    forward and backward run in ``dtype`` through the MixedPrecisionPolicy). An fp32 island
    (--fp32-final-layernorm) gets its own fully_shard with an fp32 policy."""
    from torch.distributed.fsdp import fully_shard

    from tpamp import module_has_fp32_attr

    policy = tpamp.fsdp.mixed_precision_policy(dtype)
    dp_mesh = st.mesh["dp"]
    for module in reversed(list(stage.modules())):  # inner modules before outer ones
        if module is not stage and module_has_fp32_attr(module) and list(module.parameters()):
            fully_shard(module, mesh=dp_mesh,
                        mp_policy=tpamp.fsdp.mixed_precision_policy(torch.float32))
    for block in stage.blocks:
        fully_shard(block, mesh=dp_mesh, mp_policy=policy)
    fully_shard(stage, mesh=dp_mesh, mp_policy=policy)
    if stage.is_last and not stage.is_first:  # fully_shard made new params: mark the tied
        stage.head_weight.shared = True         # head copy again (counted once, on stage 0)
    return stage


def build_optimizer(stage, args, st, dtype):
    """AdamW (weight decay on matrices only) inside tpamp's wrapper for ``dtype``."""
    params = [p for p in stage.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    adamw = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    if args.loss_scale is not None:
        scaler = tpamp.ConstantGradScaler(args.loss_scale)
    elif dtype == torch.float16:
        scaler = tpamp.DynamicGradScaler(
            initial_scale=args.initial_loss_scale,
            min_scale=args.min_loss_scale,
            growth_interval=args.loss_scale_window,
            hysteresis=args.hysteresis,
        )
    else:
        scaler = None  # bf16 and fp32 train without loss scaling
    kwargs = dict(
        grad_scaler=scaler,
        clip_grad=args.clip_grad,
        exp_avg_dtype=_STATE_DTYPES[args.exp_avg_dtype],
        exp_avg_sq_dtype=_STATE_DTYPES[args.exp_avg_sq_dtype],
        store_param_remainders=args.store_param_remainders,
        log_num_zeros_in_grad=args.log_num_zeros_in_grad,
        grad_stats_group=st.model_parallel_group,
        tensor_parallel_group=st.tp_group,
    )
    if args.spike_policy != "off":
        kwargs["spike_detector"] = tpamp.SpikeDetector(
            args.spike_policy, threshold=args.spike_threshold, window=args.spike_window,
            warmup=args.spike_warmup,
        )
    if args.use_torch_fsdp2:  # the sharded fp32 params are the masters; stats over PP x DP x TP
        del kwargs["grad_stats_group"], kwargs["tensor_parallel_group"]
        return tpamp.fsdp.fully_shard_optimizer(adamw, st.mesh, **kwargs)
    if args.use_distributed_optimizer:  # it reduces the grads over DP itself, in step()
        # the tied embedding's grad is summed over the embedding group (first + last stage)
        # after backward, on its main_grad: its bucket must wait for that sum, so it is
        # reduce-scattered by step(), never by the overlapping backward hooks
        tied = stage.word_embedding_weight() if st.embedding_group is not None else None
        kwargs.update(data_parallel_group=st.dp_group, grad_stats_group=dist.group.WORLD,
                      param_names=stage.global_named_parameters(), parallel_state=st,
                      overlap_grad_reduce=args.overlap_grad_reduce,
                      deferred_reduce_params=[tied] if tied is not None else None)
        return tpamp.DistributedOptimizer(adamw, **kwargs)
    # global names (layer index) and the rank's coordinates for optimizer.last_nonfinite
    kwargs.update(param_names=stage.global_named_parameters(), parallel_state=st)
    if dtype == torch.float32:
        return tpamp.FP32Optimizer(adamw, **kwargs)
    return tpamp.MixedPrecisionOptimizer(adamw, **kwargs)


def module_tracer(stage, st):
    """A tpamp.NonFiniteTracer on this rank's stage, modules named with the global layer index
    (``blocks.5.mlp.fc1``), the stage itself ``stage<pp>``. With model chunks (GPTChunks) a
    chunk is ``stage<global stage index>`` and its modules have their global names; the
    tracer counts micro-batches on forwards of the module it traces, which the schedule does not
    call (it calls the chunks), so a finding there reads micro-batch 0."""

    def name(qualified: str, stage=stage) -> str:
        if not qualified:
            return f"stage{st.pp_rank}"
        if isinstance(stage, GPTChunks) and qualified.startswith("chunks."):
            _, c, *rest = qualified.split(".", 2)  # a chunk's modules by their global names
            return name(rest[0], stage.chunks[int(c)]) if rest else f"stage{stage.stage_indices[int(c)]}"
        if qualified.startswith("blocks."):
            _, local, *rest = qualified.split(".", 2)
            return ".".join([f"blocks.{stage.layer_ids[int(local)]}", *rest])
        return qualified

    return tpamp.NonFiniteTracer(stage, names=name, parallel_state=st)


def lr_at(it: int, args) -> float:
    """Linear warmup to --lr, then cosine decay to --min-lr at --train-iters."""
    if it <= args.lr_warmup_iters:
        return args.lr * it / max(1, args.lr_warmup_iters)
    frac = (it - args.lr_warmup_iters) / max(1, args.train_iters - args.lr_warmup_iters)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * min(frac, 1.0)))


# ----------------------------------------------------------------------------- the run


@dataclasses.dataclass
class Run:
    """What :func:`build` makes for one run, shared by the loop and the summary."""

    args: argparse.Namespace
    st: object  # tpamp.parallel.ParallelState
    device: torch.device
    dtype: torch.dtype
    cfg: GPTConfig
    data: ByteData
    num_microbatches: int
    global_batch: int
    stage: GPTStage
    optimizer: object  # tpamp's wrapper around AdamW
    scheduler: torch.optim.lr_scheduler.LambdaLR
    tracker: object  # per-parameter grad norms (--log-param-grad-norms), or None
    is_logging_rank: bool
    schedule: object = None  # the torch.distributed.pipelining schedule (build_pipeline)
    loss: object = None  # its loss_fn, a tpamp.pipelining.PipelineLoss
    logger: tpamp.TrainingLogger = None
    bar: object = None  # tqdm bar on the logging rank, or None
    stream: object = None  # where log lines go (above the bar), or None: stdout
    train_gen: torch.Generator = None

    def say(self, *a, **k) -> None:
        """print on the logging rank only."""
        if self.is_logging_rank:
            print(*a, **k)


def batch_layout(args, dp: int):
    """(microbatches per DP rank, global batch size) from --global-batch-size or
    --num-microbatches (checked by validate_args)."""
    if args.global_batch_size is not None:
        num_microbatches = args.global_batch_size // (args.micro_batch_size * dp)
    else:
        num_microbatches = args.num_microbatches or 4
    return num_microbatches, args.micro_batch_size * num_microbatches * dp


def model_config(args) -> GPTConfig:
    return GPTConfig(
        vocab_size=VOCAB_SIZE,
        seq_length=args.seq_length,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_attention_heads=args.num_attention_heads,
        cpu_matmul_in_fp32=not args.cpu_native_half_matmul,
        fp32_residual_connection=args.fp32_residual_connection,
        attention_softmax_in_fp32=args.attention_softmax_in_fp32,
        fp32_final_layernorm=args.fp32_final_layernorm,
    )


def build(args, st, device) -> Run:
    """Data, model stage, optimizer, LR schedule, per-parameter norm tracker and pipeline
    schedule of this rank."""
    dtype = torch.bfloat16 if args.bf16 else torch.float32 if args.fp32 else torch.float16
    num_microbatches, global_batch = batch_layout(args, st.dims.dp)
    cfg = model_config(args)
    text = open(args.data, "rb").read() if args.data else default_text()[: args.data_max_bytes]
    data = ByteData(text, args.seq_length, args.valid_fraction)
    torch.manual_seed(args.seed)
    stage = build_stage(cfg, st, dtype, device, args.seed, fsdp2=args.use_torch_fsdp2,
                        virtual=virtual_stages(args))
    optimizer = build_optimizer(stage, args, st, dtype)
    # Megatron-LM: the schedule advances only on successful steps (scheduler.step() in the loop)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer.optimizer, lambda steps_done: lr_at(steps_done + 1, args) / args.lr
    )
    tracker = None
    if args.log_param_grad_norms:  # names with the global layer index: unique across stages
        if args.use_torch_fsdp2:  # a stage's TP x DP ranks each hold a piece of its params
            tracker = tpamp.fsdp.track_param_grad_norms(optimizer, stage.global_named_parameters())
        else:
            tracker = optimizer.track_param_grad_norms(stage.global_named_parameters())
    run = Run(
        args=args, st=st, device=device, dtype=dtype, cfg=cfg, data=data,
        num_microbatches=num_microbatches, global_batch=global_batch, stage=stage,
        optimizer=optimizer, scheduler=scheduler, tracker=tracker,
        is_logging_rank=st.is_last_stage and st.tp_rank == 0 and st.dp_rank == 0,
    )
    run.schedule, run.loss = build_pipeline(run)
    return run


def pipeline_label(args) -> str:
    """`` (1F1B)``, or `` (Interleaved1F1B, 2 chunks per rank)`` with virtual stages."""
    v = virtual_stages(args)
    return f" ({args.pipeline_schedule}{f', {v} chunks per rank' if v > 1 else ''})"


def describe(run: Run) -> str:
    """The first line: model, layout, precision and numerics flags, batch and data."""
    args, cfg, st = run.args, run.cfg, run.st
    numerics = [name for name in NUMERICS_FLAGS if getattr(args, name)]
    return (
        f"GPT {count_params(cfg) / 1e6:.2f}M params ({cfg.num_layers} layers, hidden "
        f"{cfg.hidden_size}, {cfg.num_attention_heads} heads, seq {cfg.seq_length}, vocab 256) | "
        f"{dist.get_world_size()} ranks: TP {st.dims.tp} x PP {st.dims.pp}"
        f"{pipeline_label(args) if st.dims.pp > 1 else ''} x DP {st.dims.dp}"
        f"{' (FSDP2 fully_shard)' if args.use_torch_fsdp2 else ''} on "
        f"{run.device.type} ({dist.get_backend()}) | {str(run.dtype).replace('torch.', '')}"
        f"{''.join(' +' + n for n in numerics)} | "
        f"global batch {run.global_batch} = micro {args.micro_batch_size} x "
        f"{run.num_microbatches} microbatches x DP {st.dims.dp} | data "
        f"{args.data or 'python stdlib source'}: "
        f"{len(run.data.train)} train / {len(run.data.valid)} validation bytes"
    )


def start_logging(run: Run) -> None:
    """The tqdm bar (a terminal only) and tpamp.TrainingLogger (line, JSONL, TensorBoard)."""
    args = run.args
    if run.is_logging_rank and not args.no_progress:
        try:
            from tqdm import tqdm
            from tqdm.contrib import DummyTqdmFile
        except ImportError:
            pass
        else:  # disable=None: no bar when stderr is not a terminal (CI logs)
            run.bar = tqdm(total=args.train_iters, disable=None, unit="it", dynamic_ncols=True)
            run.stream = DummyTqdmFile(sys.stdout)  # log lines go above the bar, not through it
    log_dir = args.log_dir
    run.logger = tpamp.TrainingLogger(
        args.train_iters,
        log_interval=args.log_interval,
        jsonl_path=os.path.join(log_dir, "log.jsonl") if log_dir else None,
        tensorboard_dir=os.path.join(log_dir, "tensorboard") if log_dir else None,
        enabled=run.is_logging_rank,
        stream=run.stream,
        param_grad_norms_top_k=args.log_param_grad_norms or None,
    )


def resume(run: Run) -> int:
    """The training generator, and with --load the checkpoint's state (model, optimizer,
    scaler, data position, RNG, log counters); returns the iteration to continue after."""
    args = run.args
    run.train_gen = torch.Generator().manual_seed(args.seed)
    if not args.load:
        return 0
    start_iter = gpt_checkpoint.load_training_state(
        args, run.stage, run.optimizer, run.st, run.train_gen, run.logger, run.global_batch,
        run.say, scheduler=run.scheduler,
    )
    if run.bar is not None:
        run.bar.update(start_iter)
    return start_iter


def evaluate(run: Run) -> float:
    """Validation loss over --eval-iters fixed global batches (last stage; nan elsewhere)."""
    args, st = run.args, run.st
    gen = torch.Generator().manual_seed(args.seed + 1)  # the same batches every time
    losses = []
    for _ in range(args.eval_iters):
        x, y = dp_batch(run.data, "valid", gen, st, args.micro_batch_size,
                        run.num_microbatches, run.device)
        losses += run_pipeline(run, x, y, train=False)
    if args.use_torch_fsdp2:  # FSDP2's root keeps its params unsharded after a forward
        run.stage.reshard()       # with no backward: back to the sharded fp32 masters
    return mean_over_dp(losses, st) if st.is_last_stage else float("nan")


def train_step(run: Run, tracer, log_now: bool):
    """One iteration: a global batch forward and backward (traced under ``tracer``, if any),
    the grad reductions, the optimizer step and the LR schedule. Returns (the DP-mean loss on
    the last stage, else None; the StepResult)."""
    args, st, optimizer = run.args, run.st, run.optimizer
    x, y = dp_batch(run.data, "train", run.train_gen, st, args.micro_batch_size,
                    run.num_microbatches, run.device)
    with tracer if tracer is not None else contextlib.nullcontext():
        losses = run_pipeline(run, x, y, train=True)
    # DistributedOptimizer.step and FSDP2's backward reduce-scatter the grads themselves
    if not (args.use_distributed_optimizer or args.use_torch_fsdp2):
        all_reduce_data_parallel_grads(run.stage, st)
    all_reduce_embedding_grads(run.stage, st)
    loss = None
    if st.is_last_stage:  # the DP mean, so that every DP replica judges the same loss
        loss = mean_over_dp(losses, st)
        if optimizer.spike_detector is not None:
            optimizer.spike_detector.observe_loss(loss)
    result = optimizer.step(param_grad_norms=True) if log_now else optimizer.step()
    optimizer.zero_grad()
    if result.update_successful:
        run.scheduler.step()
    return loss, result


def log_iteration(run: Run, it, loss, lr, loss_scale, result, log_now, extra) -> None:
    """The logger's record and line, and the validation line (on the logging rank)."""
    optimizer = run.optimizer
    if run.is_logging_rank:
        run.logger.record(
            it, loss, lr, loss_scale, result,
            param_grad_norms=run.tracker.norms if log_now else None,
            spike=optimizer.spike_detector.last if optimizer.spike_detector else None,
            nonfinite=optimizer.last_nonfinite,
            **extra,
        )
        if "val_loss" in extra:
            val_loss = extra["val_loss"]
            run.say(
                f" validation loss at iteration {it} | lm loss value: {val_loss:.6E} | "
                f"lm loss PPL: {math.exp(min(val_loss, 700.0)):.6E} |",
                file=run.stream,
                flush=True,
            )


def train(run: Run, start_iter: int):
    """The loop from ``start_iter + 1`` to --train-iters: step, trace, evaluate, log, save.
    Returns (last-stage losses, last validation loss, seconds)."""
    args, st, optimizer = run.args, run.st, run.optimizer
    history, val_loss = [], float("nan")
    tracer = module_tracer(run.stage, st) if args.trace_nonfinite != "off" else None
    trace_next = args.trace_nonfinite == "always"  # the same decision on every rank
    start = time.time()
    for it in range(start_iter + 1, args.train_iters + 1):
        t0 = time.time()
        lr = optimizer.param_groups[0]["lr"]  # set by the scheduler
        # logged: the scale this iteration's loss is multiplied by (the step may change it)
        loss_scale = optimizer.get_loss_scale().item()
        traced = tracer is not None and trace_next
        log_now = run.tracker is not None and it % args.log_interval == 0
        loss, result = train_step(run, tracer if traced else None, log_now)

        extra = {"elapsed_ms": round(1000 * (time.time() - t0), 1)}
        if traced:  # every rank took part: agree on the earliest finding along the pipeline
            finding = tracer.result(group=dist.group.WORLD)
            extra["nonfinite_activation"] = finding.as_record() if finding else None
            run.say(f" iteration {it:8d}/{args.train_iters:8d} | activation trace: "
                    f"{finding if finding else 'nothing non-finite or near fp16 overflow'} |",
                    file=run.stream, flush=True)
        if tracer is not None and args.trace_nonfinite == "after-skip":
            # last_nonfinite is agreed over the grad-stats group, and DP replicas hold the same
            # reduced grads (or share the group): every rank arms the tracer alike
            trace_next = not result.update_successful and bool(optimizer.last_nonfinite)
        if args.eval_interval > 0 and (it % args.eval_interval == 0 or it == args.train_iters):
            val_loss = evaluate(run)
            extra["val_loss"] = val_loss
        if st.is_last_stage:
            history.append(loss)
            log_iteration(run, it, loss, lr, loss_scale, result, log_now, extra)
        if run.bar is not None:
            run.bar.update(1)
            if st.is_last_stage:
                run.bar.set_postfix(loss=f"{history[-1]:.3f}", scale=f"{loss_scale:g}",
                                    refresh=False)
        if gpt_checkpoint.should_save(args, it):
            gpt_checkpoint.save_training_state(
                args, it, run.stage, optimizer, st, run.train_gen, run.logger,
                run.global_batch, run.say, scheduler=run.scheduler,
            )
    elapsed = time.time() - start
    if run.bar is not None:
        run.bar.close()
    return history, val_loss, elapsed


def summarize(run: Run, history, val_loss: float, elapsed: float) -> None:
    """The closing line and summary.json (logging rank)."""
    if not run.is_logging_rank:
        return
    args, st = run.args, run.st
    tail = history[-10:]
    first_loss = history[0] if history else None
    summary = {
        "iterations": args.train_iters,
        # skipped (all), overflow skips, spike skips, spikes, nan iterations, scale changes
        # and the params that most often led the per-parameter norms
        **run.logger.summary(),
        "spike_policy": args.spike_policy,
        "final_loss_scale": run.optimizer.get_loss_scale().item(),
        "first_train_loss": first_loss,
        "final_train_loss": sum(tail) / len(tail) if tail else float("nan"),
        "final_validation_loss": val_loss,
        "wall_time_s": round(elapsed, 1),
        "dtype": str(run.dtype).replace("torch.", ""),
        **{name: bool(getattr(args, name)) for name in NUMERICS_FLAGS},
        "tp": st.dims.tp,
        "pp": st.dims.pp,
        "dp": st.dims.dp,
        "pipeline_schedule": args.pipeline_schedule,
        "virtual_pipeline_stages": virtual_stages(args),
        "distributed_optimizer": args.use_distributed_optimizer,
        "torch_fsdp2": args.use_torch_fsdp2,
    }
    run.say(
        f"done: {summary['iterations']} iterations in {elapsed:.1f} s "
        f"({elapsed / max(1, args.train_iters):.2f} s/it) | skipped {summary['skipped_iterations']} "
        f"(overflow {summary['overflow_skips']}, spike {summary['spike_skips']}; spikes "
        f"{summary['spikes']}) | nan iterations {summary['nan_iterations']} | loss scale changed {summary['loss_scale_changes']} "
        f"times, final {summary['final_loss_scale']:g} | train loss {first_loss:.4f} -> "
        f"{summary['final_train_loss']:.4f} (mean of last {len(tail)}) | validation loss "
        f"{val_loss:.4f}",
        flush=True,
    )
    if args.log_dir:
        with open(os.path.join(args.log_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)


def main(argv=None):
    """Configuration, build, one loop, summary. ``argv``: the flags (default sys.argv[1:])."""
    args = parse_args(argv)  # every flag and the data file checked: a bad one exits 2 here
    st, device = setup_distributed(args)
    run = build(args, st, device)
    run.say(describe(run), flush=True)
    start_logging(run)
    start_iter = resume(run)
    history, val_loss, elapsed = train(run, start_iter)
    summarize(run, history, val_loss, elapsed)
    run.logger.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
