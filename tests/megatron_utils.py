"""megatron-core as a test client: its GPTModel (local layer spec), Float16Module,
DistributedDataParallel, finalize_model_grads, get_forward_backward_func and
OptimizerParamScheduler, wired as Megatron-LM's training.py wires them, on CPU gloo ranks.

megatron-core is a test dependency (``.ci/run`` installs it); :func:`require_megatron` skips a
test where it is absent. It runs on CPU through scripts/megatron_cpu.py: the three torch.cuda
shims (``install_cuda_shims``: current_device, current_stream, synchronize) and the
``CudaAsCpu`` TorchFunctionMode (device "cuda" -> cpu), entered only around megatron-core's own
calls -- the forward/backward schedule, DDP, finalize_model_grads and megatron's own optimizer --
never around tpamp's step (/work/shared/MEGATRON_CPU.md).

:func:`train` is the one training loop every comparison runs, with either optimizer:
``which="megatron"`` (megatron-core's ``get_megatron_optimizer``) or ``which="tpamp"``
(``tpamp.megatron.get_megatron_optimizer``), and returns plain per-step records.
"""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB, SEQ, MICRO_BATCH, MICROBATCHES, HIDDEN = 64, 8, 2, 2, 32


def require_megatron():
    """Import megatron-core once (in the parent, before forking: the ranks then start in
    milliseconds) or skip with the reason."""
    try:
        import megatron.core  # noqa: F401
        import megatron.core.distributed  # noqa: F401
        import megatron.core.models.gpt  # noqa: F401
        import megatron.core.optimizer  # noqa: F401
        import megatron.core.pipeline_parallel  # noqa: F401
    except Exception as e:  # ImportError, or triton missing at load (megatron-core >= 0.17)
        pytest.skip(f"megatron-core is not importable ({type(e).__name__}: {e}); .ci/run "
                    "installs it: pip install --ignore-requires-python megatron-core==0.19.2 triton")


def _cpu_tools():
    if os.path.join(ROOT, "scripts") not in sys.path:
        sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import megatron_cpu

    megatron_cpu.install_cuda_shims()
    return megatron_cpu.CudaAsCpu


def setup_parallel(tp: int, pp: int, seed: int = 1234):
    """megatron-core's parallel_state for tp x pp (DP what is left) and its RNG seeds."""
    CudaAsCpu = _cpu_tools()
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    with CudaAsCpu():
        mpu.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)
    return CudaAsCpu


def build_model(*, tp, pp, dist_opt, overlap, grad_reduce_in_fp32, bucket_size=None):
    """One model chunk: GPTModel (local spec, tied embeddings) in Float16Module in megatron's
    DDP. Returns (ddp model, transformer config)."""
    CudaAsCpu = _cpu_tools()
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    config = TransformerConfig(
        num_layers=2 * pp, hidden_size=HIDDEN, num_attention_heads=4, use_cpu_initialization=True,
        fp16=True, params_dtype=torch.float32, pipeline_dtype=torch.float16,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        hidden_dropout=0.0, attention_dropout=0.0, masked_softmax_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        init_method_std=0.05,
    )
    with CudaAsCpu():
        model = GPTModel(
            config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=VOCAB, max_sequence_length=SEQ,
            pre_process=mpu.is_pipeline_first_stage(), post_process=mpu.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=True, position_embedding_type="learned_absolute",
        )
        model = Float16Module(config, model)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=grad_reduce_in_fp32, overlap_grad_reduce=overlap,
            use_distributed_optimizer=dist_opt, bucket_size=bucket_size,
        )
        model = DistributedDataParallel(config, ddp_config, model)
    return model, config


def _batches(step: int, dp_rank: int):
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    out = []
    for _ in range(MICROBATCHES):
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=g)
        out.append({"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()})
    return out


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    pos = torch.arange(SEQ).unsqueeze(0).expand(MICRO_BATCH, SEQ)
    out = model(batch["tokens"], pos, None, labels=batch["labels"])

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"lm loss": loss.detach().clone()}

    return out, loss_func


def optimizer_config(**kw):
    from megatron.core.optimizer import OptimizerConfig

    base = dict(optimizer="adam", lr=3e-3, min_lr=3e-4, weight_decay=0.1, adam_beta1=0.9,
                adam_beta2=0.95, adam_eps=1e-8, clip_grad=0.05, fp16=True,
                initial_loss_scale=2.0**12, min_loss_scale=1.0, loss_scale_window=4,
                hysteresis=2, log_num_zeros_in_grad=True)
    base.update(kw)
    return OptimizerConfig(**base)


def train(which: str, *, tp=2, pp=1, steps=6, dist_opt=False, overlap=False,
          grad_reduce_in_fp32=False, overflow_at=(), bucket_size=None, opt_kw=None,
          after=None, save_at=None, ckpt_dir=None, start=0, ckpt_format="torch_dist",
          split_step=False):
    """Megatron-LM's training loop (train_step) for ``steps`` iterations with ``which``'s
    get_megatron_optimizer. ``overflow_at``: iterations at which the last rank's first
    trainable param gets an inf gradient element (a tensor hook, before DDP's accumulation).
    Returns {"steps": [(ok, loss scale, grad norm, zeros, loss or None, lr)], "params":
    {name: fp32 values}} for this rank; ``after(model, optimizer, CudaAsCpu)`` may add more.
    ``save_at``: before that iteration, a Megatron dist-checkpoint (model, optimizer,
    scheduler) is saved to ``ckpt_dir``; ``start`` > 0: the run begins by loading it from
    ``ckpt_dir`` and goes on at iteration ``start``. ``ckpt_format``: "torch_dist"
    (dist-checkpointing) or "torch" (Megatron-LM's per-rank torch.save, with the distributed
    optimizer's save_parameter_state / load_parameter_state). ``split_step``: the step as
    megatron-core's MixedPrecisionOptimizer.step composes it (prepare_grads, clip_grad_norm,
    count_zeros, step_with_ready_grads), with get_grad_norm() read before it (records get a
    7th entry: that norm)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func

    CudaAsCpu = setup_parallel(tp, pp)
    model, config = build_model(tp=tp, pp=pp, dist_opt=dist_opt, overlap=overlap,
                                grad_reduce_in_fp32=grad_reduce_in_fp32, bucket_size=bucket_size)
    ocfg = optimizer_config(use_distributed_optimizer=dist_opt, **(opt_kw or {}))
    if which == "megatron":
        from megatron.core.optimizer import get_megatron_optimizer

        with CudaAsCpu():
            optimizer = get_megatron_optimizer(ocfg, [model])
        mode = CudaAsCpu
    else:
        import tpamp.megatron

        optimizer = tpamp.megatron.get_megatron_optimizer(ocfg, [model])
        mode = contextlib.nullcontext
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=ocfg.lr, min_lr=ocfg.min_lr, lr_warmup_steps=2,
        lr_decay_steps=steps, lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
        wd_incr_steps=steps, wd_incr_style="constant")
    # as Megatron-LM's training.py wires them
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = model.no_sync
    if overlap:
        config.grad_sync_func = model.start_grad_sync
    config.finalize_model_grads_func = finalize_model_grads
    inject = {"on": False}
    if overflow_at and dist.get_rank() == dist.get_world_size() - 1:
        first = next(p for p in model.parameters() if p.requires_grad)

        def hook(g):
            if inject["on"]:
                g = g.clone()
                g.view(-1)[0] = float("inf")
            return g

        first.register_hook(hook)
    fwd_bwd = get_forward_backward_func()
    records = []
    if start:
        load = load_checkpoint if ckpt_format == "torch_dist" else load_torch_checkpoint
        load(model, optimizer, scheduler, ckpt_dir, CudaAsCpu, mode)
    for it in range(start, steps):
        if it == save_at:
            save = save_checkpoint if ckpt_format == "torch_dist" else save_torch_checkpoint
            save(model, optimizer, scheduler, ckpt_dir, CudaAsCpu, mode)
        inject["on"] = it in overflow_at
        with CudaAsCpu():
            model.zero_grad_buffer()
        optimizer.zero_grad()
        with CudaAsCpu():
            losses = fwd_bwd(
                forward_step_func=_forward_step,
                data_iterator=iter(_batches(it, mpu.get_data_parallel_rank())),
                model=[model], num_microbatches=MICROBATCHES, seq_length=SEQ,
                micro_batch_size=MICRO_BATCH, decoder_seq_length=SEQ, forward_only=False)
        with mode():
            if split_step:
                before = optimizer.get_grad_norm()
                if optimizer.prepare_grads():
                    ok, grad_norm, zeros = False, None, None
                else:
                    grad_norm = optimizer.clip_grad_norm(ocfg.clip_grad)
                    zeros = optimizer.count_zeros()
                    ok = optimizer.step_with_ready_grads()
            else:
                ok, grad_norm, zeros = optimizer.step()
        if ok:
            scheduler.step(increment=1)
        loss = None
        if losses:
            loss = float(sum(d["lm loss"] for d in losses) / len(losses))
        records.append((bool(ok), float(optimizer.get_loss_scale().item()),
                        None if grad_norm is None else float(grad_norm),
                        None if zeros is None else int(zeros), loss,
                        float(optimizer.param_groups[0]["lr"]))
                       + ((before,) if split_step else ()))
    params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    out = {"steps": records, "params": params}
    if after is not None:
        out.update(after(model, optimizer, CudaAsCpu) or {})
    with CudaAsCpu():
        mpu.destroy_model_parallel()
    return out


def save_checkpoint(model, optimizer, scheduler, ckpt_dir, CudaAsCpu, mode):
    """Megatron-LM's dist-checkpoint save (torch_dist format, its default; on CPU gloo).

    Shim: the writer asks for a multiprocessing Manager queue (a child process, which a
    daemonic test rank may not start) even for a synchronous save, whose writer threads run in
    this process: a plain queue.Queue serves them."""
    import queue

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    results = queue.Queue()
    filesystem_async.get_write_results_queue = lambda *a, **k: results

    with CudaAsCpu():
        model_sd = model.module.module.sharded_state_dict()  # GPTModel's (unwrapped) keys
    with mode():
        opt_sd = optimizer.sharded_state_dict(model_sd)
    with CudaAsCpu():
        dist_checkpointing.save({"model": model_sd, "optimizer": opt_sd,
                                 "scheduler": scheduler.state_dict()}, ckpt_dir)


def load_checkpoint(model, optimizer, scheduler, ckpt_dir, CudaAsCpu, mode):
    """Megatron-LM's dist-checkpoint load: the model, then the optimizer, then the scheduler."""
    from megatron.core import dist_checkpointing

    with CudaAsCpu():
        model_sd = model.module.module.sharded_state_dict()
    with mode():
        opt_sd = optimizer.sharded_state_dict(model_sd, is_loading=True)
    with CudaAsCpu():
        loaded = dist_checkpointing.load({"model": model_sd, "optimizer": opt_sd}, ckpt_dir)
        model.module.module.load_state_dict(loaded["model"])
    with mode():
        optimizer.load_state_dict(loaded["optimizer"])
    scheduler.load_state_dict(loaded["scheduler"])


def _torch_names(ckpt_dir):
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    where = f"tp{mpu.get_tensor_model_parallel_rank()}_pp{mpu.get_pipeline_model_parallel_rank()}"
    return (os.path.join(ckpt_dir, f"rank{dist.get_rank()}.pt"),
            os.path.join(ckpt_dir, f"distrib_optim_{where}.pt"))


def save_torch_checkpoint(model, optimizer, scheduler, ckpt_dir, CudaAsCpu, mode):
    """Megatron-LM's "torch" checkpoint format: model, optimizer.state_dict() and scheduler
    per rank, and the distributed optimizer's save_parameter_state per TP / PP position."""
    own, param_state = _torch_names(ckpt_dir)
    with mode():
        torch.save({"model": model.module.module.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict()}, own)
        if optimizer.distributed:
            optimizer.save_parameter_state(param_state)
    import torch.distributed as dist

    dist.barrier()


def load_torch_checkpoint(model, optimizer, scheduler, ckpt_dir, CudaAsCpu, mode):
    own, param_state = _torch_names(ckpt_dir)
    sd = torch.load(own, weights_only=False)
    with CudaAsCpu():
        model.module.module.load_state_dict(sd["model"])
    with mode():
        optimizer.load_state_dict(sd["optimizer"])
        if optimizer.distributed:
            optimizer.load_parameter_state(param_state)
    scheduler.load_state_dict(sd["scheduler"])
