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
- Mixture of experts (``--num-experts N``, Megatron-core's flags; docs/guide/moe.md): every
  block's MLP becomes N expert MLPs behind a top-k router (``--moe-router-topk``, the switch
  load-balancing loss with ``--moe-aux-loss-coeff``); ``--expert-model-parallel-size EP`` splits
  the experts over EP ranks carved out of DP (tokens travel by all-to-all over the EP group),
  the experts are TP-sharded like the dense MLP (``--expert-tensor-parallel-size`` = TP), and
  expert grads are summed over the expert-data-parallel group and divided by DP. With
  ``--use-torch-fsdp2`` (TP 1, PP 1) each expert's MLP is fully_shard'ed over the expert-DP
  group (``tpamp.fsdp.fully_shard_experts``, divide factor DP).
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
  ``--use-distributed-optimizer`` (a param split across DP shards is summed over DP). The same
  steps take each param's update norm ||master_new - master_old|| and ||update|| / ||param||
  (tpamp/update_norms.py): the top-K by update norm follow as a second block, go into the
  record as ``param_update_norms`` / ``param_update_ratios`` and into TensorBoard as
  ``update-norm/NAME`` / ``update-ratio/NAME`` (with ``--optimizer muon`` also the Muon
  params' momentum norms before orthogonalisation, ``param_momentum_norms`` /
  ``momentum-norm/NAME``); other steps pay nothing for either.
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
- Restart after a failed rank: under ``torchrun --max-restarts N`` with ``--save D --load D``
  a rank that dies or hangs (the others fail at ``--dist-timeout``) costs the work since the
  latest checkpoint: torchrun starts every worker again, each attempt builds its process group
  under a store prefix of its own (``init_process_group_for_attempt``), rank 0 removes the
  staging directories of killed saves, and the run resumes exactly (docs/guide/restart.md).
- Logging on one rank (last PP stage, TP rank 0, DP rank 0): a tqdm bar when stderr is a
  terminal, Megatron's line every ``--log-interval`` iterations (``tpamp.TrainingLogger``), a
  JSONL record per iteration and TensorBoard scalars under ``--log-dir``, validation loss every
  ``--eval-interval`` iterations, and a summary at the end (also ``summary.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import glob
import json
import math
import os
import struct
import sys
import time
import warnings

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


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows the default of every flag that has one (argparse's
    ArgumentDefaultsHelpFormatter, also for the flags without a help text), except where the
    help text already says it (a default of None is resolved later, so its text says what
    applies) and for on/off switches (off by default)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (not action.option_strings or "(default" in text or action.default is None
                or isinstance(action.default, bool) or action.default is argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"

    def _format_action(self, action):
        if not action.help and self._get_help_string(action):
            action = copy.copy(action)  # argparse prints no help line for a flag without text
            action.help = self._get_help_string(action)
        return super()._format_action(action)


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, parsed and validated (:func:`validate_args`): a bad flag exits with status 2
    on every rank and one line on rank 0 (:func:`exit_with_flag_error`)."""
    p = _ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                        formatter_class=_HelpFormatter)
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
    # mixture of experts (Megatron-core's flags; scripts/gpt_model.py MoEMLP, docs/guide/moe.md)
    a("--num-experts", type=int, default=None,
      help="replace every block's MLP by this many expert MLPs and a top-k router (default: "
           "dense)")
    a("--moe-router-topk", type=int, default=None, help="experts per token (default 2)")
    a("--moe-aux-loss-coeff", type=float, default=None,
      help="weight of the load-balancing (switch) loss (default 0: none)")
    a("--expert-model-parallel-size", type=int, default=1,
      help="EP: ranks the experts are split over (out of the data-parallel ranks); tokens "
           "reach their experts by all-to-all")
    a("--expert-tensor-parallel-size", type=int, default=None,
      help="expert TP size; only the TP size (the default) is supported")
    # batch: global = micro * num_microbatches * DP; give one of the last two
    a("--micro-batch-size", type=int, default=4)
    a("--global-batch-size", type=int, default=None,
      help="sequences per iteration: micro-batch-size x num-microbatches x DP (default: from "
           "--num-microbatches)")
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
    a("--deterministic-mode", "--deterministic", action="store_true",
      help="Megatron-LM's --deterministic-mode: torch.use_deterministic_algorithms(True) (and "
           "CUBLAS_WORKSPACE_CONFIG=:4096:8 on GPUs) and the optimizer's "
           "deterministic_grad_norm=True: grad norm, zeros, clip and skip decision bitwise "
           "independent of the TP / PP / DP / EP layout (docs/spec.md section 23); with "
           "--use-distributed-optimizer also the DP grad sum in DP-rank order "
           "(deterministic_grad_reduction); the model's matmuls under another TP size are not")
    # optimizer-state storage (Megatron-core's precision-aware optimizer flags; tpamp.state_formats)
    a("--exp-avg-dtype", choices=STATE_DTYPE_CHOICES, default="fp32",
      help="storage of Adam's exp_avg: fp32, bf16, uint8 (8-bit codes of the dynamic map of "
           "torchao's AdamW8bit, a scale per 256 elements: the 8-bit format to use) or fp8 "
           "(8-bit e4m3fn codes, a scale per 256 elements)")
    a("--exp-avg-sq-dtype", choices=STATE_DTYPE_CHOICES, default="fp32",
      help="storage of Adam's exp_avg_sq (as --exp-avg-dtype)")
    a("--store-param-remainders", action="store_true",
      help="--bf16 only: keep bf16 params + int16 remainders instead of fp32 master params")
    # bf16 params without masters, stochastic rounding (docs/spec.md section 21)
    a("--no-master-weights", dest="master_weights", action="store_false",
      help="--bf16 only, with --stochastic-rounding: keep no fp32 master params (2 bytes per "
           "param + the moments)")
    a("--stochastic-rounding", action="store_true",
      help="--bf16 with --no-master-weights: the one-pass step writes the bf16 params with "
           "stochastic rounding, seeded by --seed, the param's name, the step and the element")
    # which params keep 8-bit moments (bitsandbytes' min_8bit_size; docs/spec.md section 9)
    a("--min-8bit-size", type=int, default=None,
      help="with --exp-avg-dtype/--exp-avg-sq-dtype uint8 or fp8: params with fewer elements "
           "keep float32 moments (default 4096, as bitsandbytes and torchao's AdamW8bit; 0 "
           "quantizes every param)")
    add_optimizer_arguments(p)  # --optimizer {adam,muon} and the --muon-* flags
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
    # param-group overrides (Megatron's flags; tpamp.build_param_groups, docs/spec.md section 16)
    a("--decoupled-lr", type=float, default=None,
      help="peak lr of the word embedding and output layer (default: --lr)")
    a("--decoupled-min-lr", type=float, default=None,
      help="with --decoupled-lr: the end of their cosine decay (default: --min-lr)")
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
    a("--inject-inf-grad", default=None, metavar="ITER:RANK:NAME",
      help="testing: at iteration ITER, after the grad reductions, set one element of the grad "
           "of parameter NAME (global name) on global rank RANK to inf")
    gpt_checkpoint.add_arguments(p)  # --save, --save-interval, --load, --ckpt-step
    add_restart_arguments(p)  # --inject-exit-at-iteration ... (testing the restart path)
    add_replica_arguments(p)  # --check-replicas-interval, --inject-bitflip-* (tpamp.replicas)
    args = p.parse_args(argv)
    try:
        validate_args(args)
    except FlagError as e:
        exit_with_flag_error(str(e))
    for message in flag_warnings(args):
        if launch_rank() == 0:  # one line per warning, from rank 0 only (as the errors)
            print(f"{PROG}: warning: {message}", file=sys.stderr, flush=True)
    return args


def flag_warnings(args) -> list:
    """What a valid set of flags does that its user may not expect (the run goes on): a run
    that ends inside the lr warm-up never reaches --lr (or --decoupled-lr)."""
    out = []
    if args.train_iters < args.lr_warmup_iters:
        frac = args.train_iters / args.lr_warmup_iters  # lr_at's linear warm-up at the last one
        peaks = [("--lr", args.lr)]
        if args.decoupled_lr is not None:
            peaks.append(("--decoupled-lr", args.decoupled_lr))
        reached = ", ".join(f"{frac * v:.4g} of {flag} {v:g}" for flag, v in peaks)
        out.append(f"--train-iters {args.train_iters} ends inside the lr warm-up "
                   f"(--lr-warmup-iters {args.lr_warmup_iters}): the lr never gets above "
                   f"{reached}; give --lr-warmup-iters <= {args.train_iters} to reach it")
    return out


def add_optimizer_arguments(p) -> None:
    """Megatron-LM's optimizer flags (arguments.py): ``--optimizer muon`` steps the hidden
    layers' 2-D weights with tpamp.TensorParallelMuon and the rest (embeddings, output head,
    biases, LayerNorms) with AdamW, in one tpamp wrapper (docs/spec.md section 17)."""
    g = p.add_argument_group("optimizer")
    g.add_argument("--optimizer", choices=("adam", "muon"), default="adam",
                   help="adam: AdamW everywhere (the default); muon: Muon for the hidden "
                        "matrices, AdamW for the rest")
    g.add_argument("--muon-momentum", type=float, default=0.95,
                   help="Muon's momentum (torch's default 0.95; Megatron-LM's is 0.9)")
    g.add_argument("--muon-use-nesterov", action="store_true", help="Nesterov momentum")
    g.add_argument("--muon-num-ns-steps", type=int, default=5, help="Newton-Schulz iterations")
    g.add_argument("--muon-tp-mode", choices=("duplicated", "distributed", "blockwise"),
                   default="duplicated",
                   help="Newton-Schulz of TP-sharded weights: duplicated (all-gather, the "
                        "unsharded math; default), distributed (all-reduce the Gram matrix, "
                        "the unsharded math), blockwise (each shard alone: other math)")
    g.add_argument("--muon-scale-mode", choices=("spectral", "match_rms_adamw"),
                   default="spectral",
                   help="lr adjustment by the global shape: spectral sqrt(max(1, rows/cols)) "
                        "(torch's 'original'), or match_rms_adamw 0.2 sqrt(max(rows, cols))")
    g.add_argument("--muon-no-split-qkv", dest="muon_split_qkv", action="store_false",
                   help="orthogonalise the fused QKV weight whole (default: Q, K, V apart)")


def validate_master_args(args, dtype_flag: str) -> None:
    """--no-master-weights / --stochastic-rounding (docs/spec.md section 21): both or neither,
    --bf16 only, not with --store-param-remainders, --use-torch-fsdp2 or --optimizer muon."""
    if not (args.stochastic_rounding or not args.master_weights):
        return
    _check(args, "stochastic_rounding", args.stochastic_rounding and not args.master_weights,
           "--no-master-weights and --stochastic-rounding go together (round-to-nearest "
           "without a master loses every update below half a bf16 ulp): expected both")
    _check(args, "stochastic_rounding", args.bf16,
           f"stochastic rounding writes bf16 params, this run has {dtype_flag} params: "
           "expected --bf16")
    _check(args, "stochastic_rounding", not args.store_param_remainders,
           "--store-param-remainders keeps the master exactly, --no-master-weights keeps "
           "none: expected one of them")
    _check(args, "stochastic_rounding", not args.use_torch_fsdp2,
           "with --use-torch-fsdp2 the sharded fp32 params are the masters: expected no "
           "--stochastic-rounding")
    _check(args, "stochastic_rounding", args.optimizer != "muon",
           "--stochastic-rounding needs the one-pass Adam step: expected --optimizer adam")


def validate_optimizer_args(args) -> None:
    """The --optimizer / --muon-* checks of :func:`validate_args` (FlagError)."""
    if args.optimizer != "muon":
        return
    _check(args, "muon_momentum", math.isfinite(args.muon_momentum)
           and 0 <= args.muon_momentum < 1,  # an average: buf.lerp_(grad, 1 - momentum)
           "expected a momentum in [0, 1)")
    _check(args, "muon_num_ns_steps", 1 <= args.muon_num_ns_steps < 100,
           "expected an int from 1 to 99")
    narrow = (args.exp_avg_dtype != "fp32" or args.exp_avg_sq_dtype != "fp32"
              or args.store_param_remainders)
    _check(args, "optimizer", not narrow,
           "--optimizer muon: narrow optimizer state (--exp-avg-dtype, --exp-avg-sq-dtype, "
           "--store-param-remainders) needs the one-pass Adam step: expected fp32 state")
    _check(args, "optimizer", not args.overlap_grad_reduce,
           "--optimizer muon with --overlap-grad-reduce: the layer-wise distributed optimizer "
           "(whole matrices per DP rank) reduces the grads in step(), so nothing overlaps "
           "backward: expected no --overlap-grad-reduce")
    _check(args, "optimizer", not args.use_torch_fsdp2,
           "--optimizer muon with --use-torch-fsdp2: FSDP2 shards each matrix over DP, which "
           "Muon cannot step piece by piece: expected no --use-torch-fsdp2")


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


def validate_moe_args(args, tp: int, dp: int) -> None:
    """The mixture-of-experts flags (part of :func:`validate_args`); fills in the defaults of
    --moe-router-topk (2), --moe-aux-loss-coeff (0) and --expert-tensor-parallel-size (TP)."""
    moe = args.num_experts is not None
    if moe:
        _check(args, "num_experts", args.num_experts >= 1, "expected an int >= 1")
    else:  # a flag that cannot apply is an error, not a no-op
        for dest in ("moe_router_topk", "moe_aux_loss_coeff", "expert_tensor_parallel_size"):
            _check(args, dest, getattr(args, dest) is None,
                   "applies to a mixture of experts only: expected --num-experts N with it")
        _check(args, "expert_model_parallel_size", args.expert_model_parallel_size == 1,
               "applies to a mixture of experts only: expected --num-experts N with it")
        return
    if args.moe_router_topk is None:
        args.moe_router_topk = 2 if args.num_experts >= 2 else 1
    if args.moe_aux_loss_coeff is None:
        args.moe_aux_loss_coeff = 0.0
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = tp
    e, ep = args.num_experts, args.expert_model_parallel_size
    _check(args, "moe_router_topk", 1 <= args.moe_router_topk <= e,
           f"expected 1 <= k <= --num-experts {e}")
    _check(args, "moe_aux_loss_coeff",
           math.isfinite(args.moe_aux_loss_coeff) and args.moe_aux_loss_coeff >= 0,
           "expected a finite value >= 0")
    _check(args, "expert_model_parallel_size", ep >= 1, "expected a size >= 1")
    _check(args, "expert_model_parallel_size", e % ep == 0,
           f"expected a divisor of --num-experts {e} (each EP rank holds num-experts / EP "
           "whole experts)")
    _check(args, "expert_model_parallel_size", dp % ep == 0,
           f"expected a divisor of the data-parallel size {dp} (= WORLD_SIZE / (TP x PP)): "
           "the EP ranks are carved out of the DP ranks, as in Megatron-core")
    _check(args, "expert_tensor_parallel_size", args.expert_tensor_parallel_size == tp,
           f"expected --tensor-model-parallel-size {tp} (the default): the experts are "
           "tensor-parallel over the TP group; another expert TP size is not supported")
    # FSDP2 with experts (each expert's MLP fully_shard'ed over the expert-DP group): the
    # layouts run and checked so far are TP 1 and PP 1
    _check(args, "use_torch_fsdp2", not args.use_torch_fsdp2 or (
        tp == 1 and args.pipeline_model_parallel_size == 1),
           "with --num-experts: expected --tensor-model-parallel-size 1 and "
           "--pipeline-model-parallel-size 1 (FSDP2 with experts under TP or PP is not supported)")
    _check(args, "log_param_grad_norms", not (args.use_torch_fsdp2 and args.log_param_grad_norms),
           "with --num-experts and --use-torch-fsdp2 (the expert params differ between EP ranks, "
           "the FSDP2 tracker needs the same names on every rank): expected no "
           "--log-param-grad-norms")


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
    validate_moe_args(args, tp, dp)
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
    _check(args, "min_lr", args.min_lr <= args.lr,  # Megatron's scheduler: max_lr >= min_lr
           f"expected at most --lr {args.lr} (the cosine decays from --lr to --min-lr)")
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
    # param-group overrides (tpamp.build_param_groups)
    if args.decoupled_lr is not None:
        _check(args, "decoupled_lr", math.isfinite(args.decoupled_lr) and args.decoupled_lr > 0,
               "expected a finite lr > 0")
    if args.decoupled_min_lr is not None:
        _check(args, "decoupled_min_lr", args.decoupled_lr is not None,
               "expected it only with --decoupled-lr")
        _check(args, "decoupled_min_lr", math.isfinite(args.decoupled_min_lr)
               and args.decoupled_min_lr >= 0, "expected a finite lr >= 0")
    if args.decoupled_lr is not None:
        end = args.min_lr if args.decoupled_min_lr is None else args.decoupled_min_lr
        _check(args, "decoupled_lr", args.decoupled_lr >= end,
               f"expected at least its end of decay {end} (--decoupled-min-lr, default "
               "--min-lr)")
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
    validate_master_args(args, dtype_flag)
    if args.min_8bit_size is not None:
        _check(args, "min_8bit_size", args.min_8bit_size >= 0, "expected an int >= 0")
        _check(args, "min_8bit_size", "uint8" in (args.exp_avg_dtype, args.exp_avg_sq_dtype)
               or "fp8" in (args.exp_avg_dtype, args.exp_avg_sq_dtype),
               "it chooses which params keep 8-bit moments: expected --exp-avg-dtype or "
               "--exp-avg-sq-dtype uint8 or fp8")
    narrow = (args.exp_avg_dtype != "fp32" or args.exp_avg_sq_dtype != "fp32"
              or args.store_param_remainders or args.stochastic_rounding)
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
    validate_optimizer_args(args)
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
    if args.inject_inf_grad is not None:
        parts = args.inject_inf_grad.split(":", 2)
        _check(args, "inject_inf_grad", len(parts) == 3 and all(parts)
               and parts[0].isdigit() and parts[1].isdigit() and int(parts[1]) < world,
               f"expected ITER:RANK:NAME with a rank below the {world} ranks")
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
    validate_restart_args(args)
    validate_replica_args(args)
    # the devices: the last check, as it imports torch (which the run imports next anyway)
    import torch

    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if torch.cuda.is_available() and torch.cuda.device_count() < local_world:
        raise FlagError("--nproc-per-node", local_world,
                        f"NCCL needs one GPU per rank and this node has "
                        f"{torch.cuda.device_count()} (run on CPU with CUDA_VISIBLE_DEVICES=\"\")")


# ----------------------------------------------------------------------------- restart
#
# A rank that dies or hangs ends its attempt; torchrun (--max-restarts N) starts every worker
# again and the job resumes from the latest complete checkpoint (--save D --load D): the cost
# is the work since the last save (docs/guide/restart.md, docs/spec.md section 20). The flags
# and their checks run before torch is imported; the functions that use torch.distributed
# (``dist``, imported below) run after the imports.


def restart_attempt() -> int:
    """torchrun's attempt number of this worker (``TORCHELASTIC_RESTART_COUNT``: 0 for the
    first start, N after N restarts; 0 for a lone process or without torchrun)."""
    try:
        return max(0, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    except ValueError:
        return 0


def add_restart_arguments(parser) -> None:
    """The test-only fault injection of the restart path (docs/guide/restart.md): one rank
    of the first attempt (never a restarted one) is killed or hangs at one iteration."""
    a = parser.add_argument
    fault = parser.add_mutually_exclusive_group()
    fault.add_argument(
        "--inject-exit-at-iteration", type=int, default=None, metavar="N",
        help="testing: --inject-fault-rank SIGKILLs itself after iteration N's step (first "
             "torchrun attempt only)")
    fault.add_argument(
        "--inject-hang-at-iteration", type=int, default=None, metavar="N",
        help="testing: --inject-fault-rank sleeps forever after iteration N's step, so the "
             "others fail at --dist-timeout (first torchrun attempt only)")
    a("--inject-fault-rank", type=int, default=0, metavar="R",
      help="testing: the global rank the injected fault happens on (default 0)")
    a("--inject-fault-during-save", action="store_true",
      help="testing: the fault happens inside iteration N's checkpoint save instead, once "
           "that rank's files are written into the staging directory, before it is published")


def validate_restart_args(args) -> None:
    """The fault-injection flags (:func:`add_restart_arguments`): FlagError for a bad one."""
    n = args.inject_exit_at_iteration
    flag = "inject_exit_at_iteration"
    if n is None:
        n, flag = args.inject_hang_at_iteration, "inject_hang_at_iteration"
    if n is None:
        _check(args, "inject_fault_during_save", not args.inject_fault_during_save,
               "expected --inject-exit-at-iteration N or --inject-hang-at-iteration N with it")
        return
    _check(args, flag, 1 <= n <= args.train_iters,
           f"expected an iteration from 1 to --train-iters {args.train_iters}")
    world = launch_world_size()
    _check(args, "inject_fault_rank", 0 <= args.inject_fault_rank < world,
           f"expected a rank from 0 to {world - 1} (WORLD_SIZE {world})")
    if args.inject_fault_during_save:
        _check(args, "inject_fault_during_save", gpt_checkpoint.should_save(args, n),
               f"iteration {n} saves no checkpoint: expected --save DIR and an iteration that "
               "--save-interval (or --train-iters) saves at")


def inject_fault(args) -> None:
    """The injected fault, on this process: SIGKILL (nothing runs after it, as for a rank
    killed by the kernel), or a sleep that never ends (the process holds its sockets open,
    as for a rank stuck in a kernel or a deadlock)."""
    import signal

    if args.inject_exit_at_iteration is not None:
        print(f"[rank {launch_rank()}] injected fault: SIGKILL", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    print(f"[rank {launch_rank()}] injected fault: hang at {time.time():.3f}",  # unix time
          file=sys.stderr, flush=True)
    while True:
        time.sleep(3600)


def fault_armed(args, it: int) -> bool:
    """Whether the injected fault happens on this rank at iteration ``it`` (first attempt)."""
    n = args.inject_exit_at_iteration if args.inject_exit_at_iteration is not None \
        else args.inject_hang_at_iteration
    return (n == it and restart_attempt() == 0 and launch_rank() == args.inject_fault_rank)


def maybe_inject_fault(run: "Run", it: int) -> None:
    """Called after iteration ``it``'s step: the injected fault, when it is armed for this
    rank and iteration (and not for the save). For the save, the fault is
    armed here and fires inside torch.distributed.checkpoint's FileSystemWriter.write_data,
    once this rank's files of the staging directory are written."""
    args = run.args
    if not fault_armed(args, it):
        return
    if not args.inject_fault_during_save:
        inject_fault(args)
    from torch.distributed.checkpoint import FileSystemWriter

    write_data = FileSystemWriter.write_data

    def write_data_then_fault(self, plan, planner):
        future = write_data(self, plan, planner)
        future.wait()  # this rank's files are on disk, .metadata and the publish are not
        inject_fault(args)

    FileSystemWriter.write_data = write_data_then_fault


# ----------------------------------------------------------------------------- replicas
#
# Replica agreement (tpamp.replicas, docs/guide/nonfinite.md): every N iterations the fp32
# masters, optimizer state and model params of the DP replicas and the TP duplicates are
# compared bit for bit; the test-only --inject-bitflip-* flags corrupt one bit of one rank's
# tensor to see it found.

BITFLIP_TARGETS = ("grad", "main_param", "exp_avg", "exp_avg_sq", "param")


def add_replica_arguments(parser) -> None:
    """--check-replicas-interval, --on-replica-mismatch and the test-only bit flip."""
    a = parser.add_argument
    a("--check-replicas-interval", type=int, default=0, metavar="N",
      help="every N iterations, compare checksums of the fp32 masters, optimizer state and "
           "model params across DP replicas and TP duplicates (tpamp.replicas; 0: off)")
    a("--on-replica-mismatch", choices=("raise", "warn"), default="raise",
      help="raise: stop the run (exit status 3, the mismatch on one line); warn: log it and go on")
    a("--inject-bitflip-at-iteration", type=int, default=None, metavar="N",
      help="testing: flip one bit of one element of --inject-bitflip-target on "
           "--inject-fault-rank at iteration N (the grad before the step, the others after it; "
           "default: none)")
    a("--inject-bitflip-target", choices=BITFLIP_TARGETS, default="main_param",
      help="testing: which tensor --inject-bitflip-at-iteration corrupts")
    a("--inject-bitflip-param", default=None, metavar="NAME",
      help="testing: the global name of the param whose tensor is corrupted (default: the "
           "rank's first param that is not tensor-parallel, a TP duplicate)")


def validate_replica_args(args) -> None:
    """The replica-check flags (:func:`add_replica_arguments`): FlagError for a bad one."""
    _check(args, "check_replicas_interval", args.check_replicas_interval >= 0,
           "expected an int >= 0 (0: off)")
    if args.check_replicas_interval:
        _check(args, "check_replicas_interval", not args.use_torch_fsdp2,
               "--use-torch-fsdp2 shards the params over DP (no replicas to compare); "
               "expected 0 with it")
    n = args.inject_bitflip_at_iteration
    if n is None:
        _check(args, "inject_bitflip_param", args.inject_bitflip_param is None,
               "expected --inject-bitflip-at-iteration N with it")
        return
    _check(args, "inject_bitflip_at_iteration", 1 <= n <= args.train_iters,
           f"expected an iteration from 1 to --train-iters {args.train_iters}")
    world = launch_world_size()
    _check(args, "inject_fault_rank", 0 <= args.inject_fault_rank < world,
           f"expected a rank from 0 to {world - 1} (WORLD_SIZE {world})")
    if args.inject_bitflip_target in ("main_param", "exp_avg", "exp_avg_sq"):
        _check(args, "inject_bitflip_target", not (args.use_distributed_optimizer
                                                   or args.use_torch_fsdp2),
               "the masters and moments are sharded over DP with --use-distributed-optimizer "
               "or --use-torch-fsdp2 (no replica holds them); expected grad or param")
        _check(args, "inject_bitflip_target", not (args.inject_bitflip_target == "main_param"
                                                   and (args.fp32 or args.store_param_remainders
                                                        or args.stochastic_rounding)),
               "this run keeps no fp32 master (--fp32, --store-param-remainders or "
               "--stochastic-rounding); expected another target")


def build_replica_checker(run: "Run"):
    """The tpamp.replicas.ReplicaChecker of --check-replicas-interval N (None when 0): a
    collective over the world (the ranks agree on the interval and policy)."""
    if not run.args.check_replicas_interval:
        return None
    # the loop prints a mismatch once, on rank 0 (the checker warns on every rank)
    warnings.filterwarnings("ignore", message="replicas disagree", category=RuntimeWarning)
    return tpamp.replicas.ReplicaChecker(
        run.optimizer, run.args.check_replicas_interval,
        on_mismatch=run.args.on_replica_mismatch, parallel_state=run.st)


def _bitflip_bit(t) -> int:
    """The highest mantissa bit of a float element (a large, finite change), bit 2 of an
    8-bit code."""
    return {torch.float32: 22, torch.float16: 9, torch.bfloat16: 6,
            torch.float64: 51}.get(t.dtype, 8 * t.element_size() - 6)


def maybe_inject_bitflip(run: "Run", it: int, before_step: bool) -> None:
    """--inject-bitflip-at-iteration: on --inject-fault-rank at iteration ``it``, flip one bit
    (:func:`_bitflip_bit`) of the middle element of the target tensor of the param (a grad
    before the step, the others after it); prints what it flipped on stderr."""
    args = run.args
    if (args.inject_bitflip_at_iteration != it or dist.get_rank() != args.inject_fault_rank
            or before_step != (args.inject_bitflip_target == "grad")):
        return
    rows = run.optimizer.replica_tensors()
    if args.inject_bitflip_param is not None:
        rows = [r for r in rows if r[0] == args.inject_bitflip_param]
    else:
        rows = [r for r in rows if tpamp.replicas.is_tp_duplicate(r[1])]
    if not rows:
        raise ValueError(f"--inject-bitflip-param: rank {dist.get_rank()} holds no parameter "
                         f"{args.inject_bitflip_param!r}")
    name, model, tensors = rows[0]
    target = args.inject_bitflip_target
    if target == "grad":
        grad = getattr(model, "main_grad", None)
        t = grad if grad is not None else local_tensor(model.grad)
    elif target not in tensors:
        raise ValueError(f"--inject-bitflip-target {target}: rank {dist.get_rank()} holds no "
                         f"{target} of {name!r} (it holds {', '.join(tensors)})")
    else:
        t = tensors[target]
    index, bit = t.numel() // 2, _bitflip_bit(t)
    tpamp.replicas.flip_bit(local_tensor(t), index, bit)
    print(f"[rank {dist.get_rank()}] injected bit flip: bit {bit} of element {index} of "
          f"{name} {target} at iteration {it}", file=sys.stderr, flush=True)


def init_process_group_for_attempt(backend: str, timeout: datetime.timedelta) -> None:
    """``init_process_group`` on torchrun's store, under a key prefix of this attempt.

    torchrun's agent hosts the TCPStore the workers rendezvous on (``TORCHELASTIC_USE_AGENT_STORE``;
    the static rendezvous, the default, and c10d's shared store) and keeps it, with every key
    the workers wrote, from one attempt to the next. Without a prefix, a restarted worker's
    process group reads the previous attempt's keys: gloo's full-mesh connect finds the
    listening addresses of workers that are gone ("connectFullMesh failed ... Connection
    refused" or "Connect timeout"), NCCL the previous unique id
    (pytorch/pytorch#135712). ``torch.distributed.PrefixStore`` with the attempt number
    (``TORCHELASTIC_RESTART_COUNT``, the same on every worker of an attempt when one agent,
    or agents that all restart together, started them) gives every attempt keys of its own.
    The store comes from torch's own ``env://`` rendezvous (MASTER_ADDR, MASTER_PORT, RANK,
    WORLD_SIZE; rank 0 hosts the store when no agent does), so nothing else changes."""
    from torch.distributed.rendezvous import rendezvous

    store, rank, world_size = next(rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    store = dist.PrefixStore(f"train_gpt/attempt_{restart_attempt()}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout)


def resume_after_restart(run: "Run") -> None:
    """On rank 0, before anything is loaded or saved: remove the staging directories that
    saves killed part-way (a rank that died in a save) left in --save and --load
    (tpamp.checkpoint.clean_up_interrupted_saves); a load reads only the iteration the tracker
    names, so they are never loaded. Says when this is a restarted attempt and where it
    resumes from, or that a restart without --load trains from scratch."""
    from tpamp.checkpoint import clean_up_interrupted_saves

    args = run.args
    if dist.get_rank() == 0:
        for root in dict.fromkeys(d for d in (args.save, args.load) if d):
            for name in clean_up_interrupted_saves(root):
                print(f" removed {os.path.join(root, name)} (left by a save that was killed)",
                      flush=True)
    attempt = restart_attempt()
    if attempt:
        where = (f"resuming from the latest checkpoint in {args.load}" if args.load else
                 "no --load: training from scratch (pass --load with --save to resume)")
        run.say(f" restarted by torchrun (attempt {attempt}): {where}", flush=True)


if __name__ == "__main__":  # a bad flag exits here, before the imports below
    parse_args()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from gpt_model import (  # noqa: E402
    ExpertParallel,
    GPTChunks,
    GPTConfig,
    GPTStage,
    MoEAuxLossAutoScaler,
    MoEMLP,
    count_params,
    is_expert_param,
    mark_expert_params,
    parallelize_stage,
)

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
        # contiguous [n, T] tensors: torch.distributed.pipelining of torch 2.11 checks a stage
        # input's strides against its static metadata (a [n, T] view of the [n, T + 1] chunk
        # has row stride T + 1 and fails; torch 2.13 accepts it)
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


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
    if train:  # the MoE load-balancing loss's grad: scaled like the main loss (PipelineLoss)
        MoEAuxLossAutoScaler.set_loss_scale(scale.float() / run.num_microbatches)
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
    """Average every grad over the DP group (for a DTensor grad: its local shard). Expert
    params (``allreduce = False``) are summed over the expert-data-parallel group instead (the
    ranks holding the same experts) and divided by DP, as Megatron-core's DDP scales them
    (edp / dp after its average over edp): their grads already hold the tokens of every EP
    rank, so both kinds end at the mean over all DP ranks' losses."""
    if st.dims.dp > 1:
        params = [p for p in stage.parameters() if p.grad is not None]
        dense = [local_tensor(p.grad) for p in params if not is_expert_param(p)]
        _all_reduce_grads(dense, st.dp_group, divide_by=st.dims.dp)
        expert = [local_tensor(p.grad) for p in params if is_expert_param(p)]
        _all_reduce_grads(expert, st.expert_data_parallel_group, divide_by=st.dims.dp)


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
    if args.deterministic_mode:  # before any cuBLAS handle exists (torch's reproducibility notes)
        if use_cuda:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    if use_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        torch.set_num_threads(1)  # several ranks share the cores
        device = torch.device("cpu")
    init_process_group_for_attempt(  # keys of its own for each torchrun attempt
        "nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=args.dist_timeout)
    )
    st = model_parallel_state(args.tensor_model_parallel_size,
                              args.pipeline_model_parallel_size, args.expert_model_parallel_size)
    return st, device


def model_parallel_state(tp: int, pp: int, ep: int = 1):
    """The TP x PP x DP layout with ``ep`` expert-parallel ranks (expert TP = TP, so EP is
    carved out of DP: Megatron-core's expert order tp-ep-dp-pp), on the default process group
    (every rank calls it; tpamp.parallel, docs/spec.md section 19)."""
    return initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)


def expert_parallel(st, args) -> ExpertParallel:
    """This rank's place among the EP ranks (what the MoE layers dispatch over)."""
    ep = args.expert_model_parallel_size
    return ExpertParallel(ep, st.ep_rank, st.ep_group if ep > 1 else None)


def virtual_stages(args) -> int:
    """Model chunks per rank: num_layers / (pp x --num-layers-per-virtual-pipeline-stage), or 1."""
    per = args.num_layers_per_virtual_pipeline_stage
    return 1 if per is None else args.num_layers // (args.pipeline_model_parallel_size * per)


def build_stage(cfg: GPTConfig, st, dtype, device, seed: int, fsdp2: bool = False,
                virtual: int = 1, ep: ExpertParallel | None = None):
    """This rank's stage (a GPTStage, or with ``virtual`` > 1 the GPTChunks of an interleaved
    schedule): seeded fp32 init, tied head copied from the first stage, cast to
    ``dtype`` (fp32 islands, e.g. --fp32-final-layernorm, stay fp32), then TP-sharded with
    parallelize_module (vocab-parallel embedding and head copy). Cast before sharding: the
    grad hooks that parallelize_stage puts on the DTensor params do not survive a later cast."""
    if virtual > 1:
        stage = GPTChunks(cfg, st.dims.pp, st.pp_rank, virtual, ep)
    else:
        stage = GPTStage(cfg, st.dims.pp, st.pp_rank, ep)
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
    for moe in (m for m in stage.modules() if isinstance(m, MoEMLP)):
        for expert in moe.experts.values():  # one expert's MLP over the expert-DP group,
            tpamp.fsdp.fully_shard_experts(    # grads divided by dp like dense ones
                expert, st.expert_mesh, st.dims.dp, mp_policy=policy)
    for block in stage.blocks:
        fully_shard(block, mesh=dp_mesh, mp_policy=policy)
    fully_shard(stage, mesh=dp_mesh, mp_policy=policy)
    if stage.is_last and not stage.is_first:  # fully_shard made new params: mark the tied
        stage.head_weight.shared = True         # head copy again (counted once, on stage 0)
    mark_expert_params(stage)  # and the expert params again
    return stage


def build_inner_optimizer(stage, args, st):
    """The torch optimizer the wrapper steps. AdamW: its groups from tpamp.build_param_groups,
    Megatron's default of no weight decay for biases and 1-D params (norm weights), and with
    --decoupled-lr the word embedding and output layer (Megatron's
    ``is_embedding_or_output_parameter``: the tied weight's copy on this stage) at their own
    lr; the groups are aligned over the world, so every stage has the same groups (some
    empty). ``--optimizer muon``: tpamp.muon_with_adamw (Muon for the hidden 2-D weights, Q/K/V
    apart unless --muon-no-split-qkv; AdamW for the rest)."""
    if args.optimizer == "muon":
        named = [(n, p) for n, p in stage.global_named_parameters() if p.requires_grad]
        head_dim = args.hidden_size // args.num_attention_heads
        qkv = ({n: (head_dim,) * 3 for n, _ in named if n.endswith("attn.qkv.weight")}
               if args.muon_split_qkv else None)  # per head [q, k, v] rows (gpt_model.py)
        return tpamp.muon_with_adamw(
            named, lr=args.lr, weight_decay=args.weight_decay, momentum=args.muon_momentum,
            nesterov=args.muon_use_nesterov, ns_steps=args.muon_num_ns_steps,
            adjust_lr_fn="original" if args.muon_scale_mode == "spectral" else "match_rms_adamw",
            tp_mode=args.muon_tp_mode, tensor_parallel_group=st.tp_group,
            adamw_betas=(0.9, 0.95), adamw_eps=1e-8, qkv_split_sizes=qkv)
    tied = stage.word_embedding_weight() if args.decoupled_lr is not None else None
    if tied is not None:
        tied.is_embedding_or_output_parameter = True
    groups = tpamp.build_param_groups(
        stage.named_parameters(), lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        decoupled_lr=args.decoupled_lr, decoupled_min_lr=args.decoupled_min_lr,
        process_group=dist.group.WORLD,
    )
    return torch.optim.AdamW(groups, betas=(0.9, 0.95), eps=1e-8)


def build_optimizer(stage, args, st, dtype):
    """:func:`build_inner_optimizer` inside tpamp's wrapper for ``dtype``."""
    adamw = build_inner_optimizer(stage, args, st)
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
        min_8bit_size=args.min_8bit_size,
        log_num_zeros_in_grad=args.log_num_zeros_in_grad,
        grad_stats_group=st.model_parallel_group,
        tensor_parallel_group=st.tp_group,
    )
    if args.deterministic_mode:  # an exact, order-invariant grad norm (docs/spec.md section 23)
        kwargs["deterministic_grad_norm"] = True
    if args.stochastic_rounding:  # bf16, no master (validate_master_args)
        kwargs.update(master_weights=False, stochastic_rounding=True,
                      stochastic_rounding_seed=args.seed % 2**63)
    if args.spike_policy != "off":
        kwargs["spike_detector"] = tpamp.SpikeDetector(
            args.spike_policy, threshold=args.spike_threshold, window=args.spike_window,
            warmup=args.spike_warmup,
        )
    if args.use_torch_fsdp2:  # the sharded fp32 params are the masters; stats over PP x DP x TP
        del kwargs["grad_stats_group"], kwargs["tensor_parallel_group"]
        # global names and this rank's TP / PP / DP coordinates for the culprit of a skip
        kwargs.update(parallel_state=st, param_names=stage.global_named_parameters())
        if args.num_experts is not None:  # expert params on the expert-DP dim (section 19)
            kwargs.update(expert_mesh=st.expert_mesh)
        return tpamp.fsdp.fully_shard_optimizer(adamw, st.mesh, **kwargs)
    if args.use_distributed_optimizer and not tpamp.is_elementwise_optimizer(adamw):
        # Muon, Adafactor: whole params per DP rank (tpamp.LayerWiseDistributedOptimizer,
        # docs/spec.md section 18); it reduces the grads to their owners in step(), so the
        # tied embedding's sum before step() needs nothing more (and nothing overlaps:
        # validate_args refuses --overlap-grad-reduce with --optimizer muon)
        for key in ("exp_avg_dtype", "exp_avg_sq_dtype", "store_param_remainders",
                    "min_8bit_size"):
            del kwargs[key]  # Adam's storage options (refused for other optimizers before)
        kwargs.update(data_parallel_group=st.dp_group, grad_stats_group=dist.group.WORLD,
                      param_names=stage.global_named_parameters(), parallel_state=st)
        return tpamp.LayerWiseDistributedOptimizer(adamw, **kwargs)
    if args.use_distributed_optimizer:  # it reduces the grads over DP itself, in step()
        # the tied embedding's grad is summed over the embedding group (first + last stage)
        # after backward, on its main_grad: its bucket must wait for that sum, so it is
        # reduce-scattered by step(), never by the overlapping backward hooks
        tied = stage.word_embedding_weight() if st.embedding_group is not None else None
        kwargs.update(data_parallel_group=st.dp_group, grad_stats_group=dist.group.WORLD,
                      param_names=stage.global_named_parameters(), parallel_state=st,
                      overlap_grad_reduce=args.overlap_grad_reduce,
                      deferred_reduce_params=[tied] if tied is not None else None,
                      # the DP grad sum in DP-rank order (docs/spec.md section 23)
                      deterministic_grad_reduction=args.deterministic_mode)
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


def lr_at(it: int, args, max_lr=None, min_lr=None) -> float:
    """Linear warmup to --lr (or ``max_lr``), then cosine decay to --min-lr (or ``min_lr``) at
    --train-iters."""
    max_lr = args.lr if max_lr is None else max_lr
    min_lr = args.min_lr if min_lr is None else min_lr
    if it <= args.lr_warmup_iters:
        return max_lr * it / max(1, args.lr_warmup_iters)
    frac = (it - args.lr_warmup_iters) / max(1, args.train_iters - args.lr_warmup_iters)
    return min_lr + 0.5 * (max_lr - min_lr) * (1 + math.cos(math.pi * min(frac, 1.0)))


def lr_lambdas(optimizer, args) -> list:
    """One LambdaLR factor per param group: the group's own schedule from its ``max_lr`` and
    ``min_lr`` (tpamp.build_param_groups; Megatron's decoupled lr) over its initial lr
    (``max_lr * lr_mult``)."""
    out = []
    for g in optimizer.param_groups:
        max_lr, min_lr = g.get("max_lr", args.lr), g.get("min_lr", args.min_lr)
        if max_lr == args.lr and min_lr == args.min_lr:
            out.append(lambda steps_done: lr_at(steps_done + 1, args) / args.lr)
        else:
            out.append(lambda steps_done, hi=max_lr, lo=min_lr:
                       lr_at(steps_done + 1, args, hi, lo) / hi)
    return out


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
    replica_checker: object = None  # tpamp.replicas.ReplicaChecker (--check-replicas-interval)
    iteration: int = 0  # the iteration being run (the bit-flip injector's clock)

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
        num_experts=args.num_experts,
        moe_router_topk=args.moe_router_topk or 2,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff or 0.0,
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
                        virtual=virtual_stages(args), ep=expert_parallel(st, args))
    optimizer = build_optimizer(stage, args, st, dtype)
    # Megatron-LM: the schedule advances only on successful steps (scheduler.step() in the loop)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer,
                                                  lr_lambdas(optimizer.optimizer, args))
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
    run.replica_checker = build_replica_checker(run)
    return run


def pipeline_label(args) -> str:
    """`` (1F1B)``, or `` (Interleaved1F1B, 2 chunks per rank)`` with virtual stages."""
    v = virtual_stages(args)
    return f" ({args.pipeline_schedule}{f', {v} chunks per rank' if v > 1 else ''})"


def describe(run: Run) -> str:
    """The first line: model, layout, precision and numerics flags, batch and data."""
    args, cfg, st = run.args, run.cfg, run.st
    numerics = [name for name in NUMERICS_FLAGS if getattr(args, name)]
    moe = ""
    if cfg.num_experts is not None:
        moe = (f", MoE {cfg.num_experts} experts top-{cfg.moe_router_topk}, aux loss coeff "
               f"{cfg.moe_aux_loss_coeff:g}")
    return (
        f"GPT {count_params(cfg) / 1e6:.2f}M params ({cfg.num_layers} layers, hidden "
        f"{cfg.hidden_size}, {cfg.num_attention_heads} heads, seq {cfg.seq_length}, vocab 256"
        f"{moe}) | "
        f"{dist.get_world_size()} ranks: TP {st.dims.tp} x PP {st.dims.pp}"
        f"{pipeline_label(args) if st.dims.pp > 1 else ''} x DP {st.dims.dp}"
        f"{' (FSDP2 fully_shard)' if args.use_torch_fsdp2 else ''}"
        f"{f' (EP {args.expert_model_parallel_size})' if cfg.num_experts is not None else ''} on "
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
    resume_after_restart(run)
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
    if args.inject_inf_grad is not None:
        inject_inf_grad(run, args.inject_inf_grad)
    if args.inject_bitflip_at_iteration is not None:
        maybe_inject_bitflip(run, run.iteration, before_step=True)
    loss = None
    if st.is_last_stage:  # the DP mean, so that every DP replica judges the same loss
        loss = mean_over_dp(losses, st)
        if optimizer.spike_detector is not None:
            optimizer.spike_detector.observe_loss(loss)
    result = (optimizer.step(param_grad_norms=True, param_update_norms=True) if log_now
              else optimizer.step())
    optimizer.zero_grad()
    if result.update_successful:
        run.scheduler.step()
    return loss, result


def inject_inf_grad(run: Run, spec: str) -> None:
    """--inject-inf-grad ITER:RANK:NAME: an inf in the first element of the local grad of the
    param with global name NAME on global rank RANK at iteration ITER (counted by the
    calls of this function in this process: the run's first iteration is 1, also after
    --load)."""
    it, rank, name = spec.split(":", 2)
    run.injection_calls = getattr(run, "injection_calls", 0) + 1
    if run.injection_calls != int(it) or dist.get_rank() != int(rank):
        return
    for pname, param in run.stage.global_named_parameters():
        if pname == name:
            grad = getattr(param, "main_grad", None)
            grad = grad if grad is not None else local_tensor(param.grad)
            grad.view(-1)[0] = float("inf")
            return
    raise ValueError(f"--inject-inf-grad: rank {rank} holds no parameter {name!r}")


def log_iteration(run: Run, it, loss, lr, loss_scale, result, log_now, extra) -> None:
    """The logger's record and line, and the validation line (on the logging rank)."""
    optimizer = run.optimizer
    if run.is_logging_rank:
        run.logger.record(
            it, loss, lr, loss_scale, result,
            param_grad_norms=run.tracker.norms if log_now else None,
            param_update_norms=run.tracker.update_norms if log_now else None,
            param_update_ratios=run.tracker.update_ratios if log_now else None,
            param_momentum_norms=run.tracker.momentum_norms if log_now else None,
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
        run.iteration = it
        loss, result = train_step(run, tracer if traced else None, log_now)
        maybe_inject_fault(run, it)  # testing the restart path only
        if args.inject_bitflip_at_iteration is not None:
            maybe_inject_bitflip(run, it, before_step=False)
        t_check = time.time()
        replicas = run.replica_checker.maybe_check(it) if run.replica_checker else None
        t_check = time.time() - t_check

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
        if replicas is not None:  # a check ran (warn policy: the run goes on)
            extra["replica_mismatches"] = [m.as_record() for m in replicas]
            extra["replica_check_ms"] = round(1000 * t_check, 1)  # within elapsed_ms
            if replicas and dist.get_rank() == 0:
                print(f"[rank 0] {tpamp.replicas.describe(replicas, it)}", file=sys.stderr,
                      flush=True)
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
        "deterministic_grad_norm": run.optimizer.deterministic_grad_norm,
        "deterministic_grad_reduction": bool(
            getattr(run.optimizer, "deterministic_grad_reduction", False)),
        "tp": st.dims.tp,
        "pp": st.dims.pp,
        "dp": st.dims.dp,
        "pipeline_schedule": args.pipeline_schedule,
        "virtual_pipeline_stages": virtual_stages(args),
        "distributed_optimizer": args.use_distributed_optimizer,
        "torch_fsdp2": args.use_torch_fsdp2,
        "optimizer": args.optimizer,
        "num_experts": args.num_experts,
        "moe_router_topk": args.moe_router_topk,
        "moe_aux_loss_coeff": args.moe_aux_loss_coeff,
        "ep": args.expert_model_parallel_size,
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
    try:
        history, val_loss, elapsed = train(run, start_iter)
    except tpamp.replicas.ReplicaMismatchError as e:  # every rank alike (an agreed verdict)
        if dist.get_rank() == 0:
            print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        run.logger.close()
        dist.destroy_process_group()
        sys.exit(3)
    summarize(run, history, val_loss, elapsed)
    run.logger.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
