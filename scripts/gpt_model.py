"""A small GPT (decoder-only transformer), cut into pipeline stages, with a tensor-parallel plan.

Example code for scripts/train_gpt.py, not library code. One :class:`GPTStage` holds the layers
of one pipeline stage:

- first stage: token embedding ``wte`` [V, H] and position embedding ``wpe`` [T, H];
- every stage: its slice of the transformer blocks (pre-LayerNorm, causal self-attention, MLP);
- last stage: the final LayerNorm and the output head. The head is tied to the word embedding
  as in Megatron-LM: with one stage it *is* ``wte.weight``; with several, the last stage holds
  its own copy ``head_weight`` [V, H], marked ``shared = True``, that the trainer initialises
  from the first stage and keeps identical by summing the two copies' grads over the
  embedding group before every optimizer step.

Megatron-LM's fp16 numerics, with tpamp's helpers (``tpamp.functional``):

- ``cfg.fp32_residual_connection`` (``--fp32-residual-connection``): the embedding output is
  cast to fp32 and every block adds its sublayer outputs to the residual stream with
  :func:`tpamp.residual_add` in fp32; the sublayers still run in the model dtype (their input is
  cast down before the LayerNorm). Stage activations are then fp32 (what the pipeline sends
  between stages too).
- ``cfg.attention_softmax_in_fp32`` (``--attention-softmax-in-fp32``): attention is computed
  explicitly, ``softmax(scale * q k^T)`` with :func:`tpamp.scale_mask_softmax` (causal), which
  upcasts fp16/bf16 scores to fp32 for the softmax when the flag is on and otherwise runs it in
  the model dtype. The explicit path is always used, so the flag is the only difference.
- ``cfg.fp32_final_layernorm``: the final LayerNorm is an fp32 island, marked with
  :func:`tpamp.set_fp32_attr_to_module`: :meth:`GPTStage.cast_` keeps its params fp32 (so
  ``tpamp.MixedPrecisionOptimizer`` updates them directly, with no fp32 main copy) and the stage
  feeds it fp32 and casts its output to the model dtype for the head.
- The cross-entropy (in the trainer) is :func:`tpamp.vocab_parallel_cross_entropy` over the
  vocab-sharded logits (``--fp16-lm-cross-entropy`` keeps it in fp16/bf16).

Tensor parallelism (:func:`tensor_parallel_plan`) follows Megatron's split, in PyTorch's own
``torch.distributed.tensor.parallel``: the fused q/k/v linear (rows grouped by head) and the
first MLP linear are column-parallel (each
TP rank holds ``n_head / tp`` heads and ``4H / tp`` MLP features), the attention output and the
second MLP linear are row-parallel (their outputs are summed over the TP group). The word
embedding is vocab-parallel (Megatron's ``VocabParallelEmbedding``: ``RowwiseParallel`` on
``wte``, each TP rank holds V/tp rows, the lookup is summed over the TP group), and so is the
tied output head: its weight (``wte.weight`` itself, or the last stage's copy, sharded the same
way by :func:`parallelize_stage`) gives each TP rank its own [B, T, V/tp] slice of the logits
(Megatron's column-parallel head with ``parallel_output=True``), for a vocab-parallel
cross-entropy on the TP group. The position embedding and the LayerNorms stay replicated, so a
stage's input and output activations are plain, identical tensors on every TP rank: [B, T, H]
in the model dtype (fp32 with ``fp32_residual_connection``).

Half precision on CPU: CPUs without AVX512-FP16/BF16 have no fast fp16/bf16 GEMM (here a
[1024, 256] x [256, 512] matmul is ~45x slower in fp16 than in fp32). With
``cfg.cpu_matmul_in_fp32`` (the default) every matmul and attention whose inputs are fp16/bf16
CPU tensors runs in fp32 and its output is rounded back to the half dtype: params, activations
and gradients are still stored in fp16/bf16 (so overflow in a gradient still gives inf, which is
what loss scaling handles), only the accumulation is fp32 -- as on a GPU's tensor cores. CUDA
tensors always use the native half-precision kernels.

Mixture of experts (``cfg.num_experts``): every block's MLP is a :class:`MoEMLP` (router,
experts keyed by their global index, all-to-all dispatch over the expert-parallel group given
as :class:`ExpertParallel`); see its docstring and docs/guide/moe.md.

Initialisation is seeded per layer (:meth:`GPTStage.init_weights`), so the full model is the same
whatever the TP x PP layout: block ``i`` gets the same weights on whichever stage it lands.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard

from tpamp import (
    is_expert_param,  # noqa: F401 (re-exported for the trainer)
    mark_expert_param,
    module_has_fp32_attr,
    residual_add,
    scale_mask_softmax,
    set_fp32_attr_to_module,
)


@dataclass
class GPTConfig:
    vocab_size: int = 256  # byte-level tokens
    seq_length: int = 128  # T, also the size of the position embedding
    hidden_size: int = 256  # H
    num_layers: int = 4
    num_attention_heads: int = 8
    cpu_matmul_in_fp32: bool = True  # see the module docstring
    # Megatron's fp16 numerics flags (see the module docstring)
    fp32_residual_connection: bool = False
    attention_softmax_in_fp32: bool = False
    fp32_final_layernorm: bool = False
    # mixture of experts (Megatron-core's names; see MoEMLP): None = the dense MLP
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_aux_loss_coeff: float = 0.0

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads}"
            )
        if self.num_experts is not None:
            if self.num_experts < 1:
                raise ValueError(f"num_experts {self.num_experts}: expected None or an int >= 1")
            if not 1 <= self.moe_router_topk <= self.num_experts:
                raise ValueError(
                    f"moe_router_topk {self.moe_router_topk}: expected 1 <= k <= num_experts "
                    f"{self.num_experts}"
                )
            if not (math.isfinite(self.moe_aux_loss_coeff) and self.moe_aux_loss_coeff >= 0):
                raise ValueError(
                    f"moe_aux_loss_coeff {self.moe_aux_loss_coeff}: expected a finite value >= 0"
                )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


_HALF = (torch.float16, torch.bfloat16)


def _in_fp32(x: torch.Tensor, enabled: bool) -> bool:
    """Run this op in fp32? Only for fp16/bf16 CPU tensors and when enabled."""
    return enabled and x.dtype in _HALF and x.device.type == "cpu"


def linear(x: torch.Tensor, weight: torch.Tensor, bias=None, cpu_in_fp32: bool = True):
    """F.linear; for half-precision CPU inputs computed in fp32 and returned in x.dtype."""
    if _in_fp32(x, cpu_in_fp32):
        b = bias.float() if bias is not None else None
        return F.linear(x.float(), weight.float(), b).to(x.dtype)
    return F.linear(x, weight, bias)


def matmul(a: torch.Tensor, b: torch.Tensor, cpu_in_fp32: bool = True) -> torch.Tensor:
    """a @ b; for half-precision CPU inputs computed in fp32 and returned in a.dtype."""
    if _in_fp32(a, cpu_in_fp32):
        return torch.matmul(a.float(), b.float()).to(a.dtype)
    return torch.matmul(a, b)


def output_head(h: torch.Tensor, weight: torch.Tensor, cpu_in_fp32: bool = True) -> torch.Tensor:
    """Logits ``h @ weight.T`` of the tied head. h: [B, T, H], a plain tensor identical on every
    TP rank. For a vocab-sharded DTensor weight (Shard(0) over the TP mesh) returns this rank's
    [B, T, V/tp] slice (plain tensor); the backward all-reduces h's grad over the TP group (the
    column-parallel input grad). For a plain weight returns the full [B, T, V]."""
    if not isinstance(weight, DTensor):
        return linear(h, weight, None, cpu_in_fp32)
    if tuple(weight.placements) != (Shard(0),):
        raise ValueError(f"the head weight must be Shard(0) on the TP mesh: {weight.placements}")
    h = DTensor.from_local(h, weight.device_mesh, [Replicate()], run_check=False)
    logits = linear(h, weight, None, cpu_in_fp32)
    if tuple(logits.placements) != (Shard(logits.dim() - 1),):  # not expected: keep V/tp local
        logits = logits.redistribute(weight.device_mesh, [Shard(logits.dim() - 1)])
    return logits.to_local()


class Linear(nn.Linear):
    """nn.Linear (so the TP styles accept it) that uses :func:`linear`."""

    def __init__(self, in_features: int, out_features: int, cpu_in_fp32: bool = True):
        super().__init__(in_features, out_features)
        self.cpu_in_fp32 = cpu_in_fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.cpu_in_fp32)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        h, f = cfg.hidden_size, cfg.cpu_matmul_in_fp32
        self.head_dim = cfg.head_dim
        self.cpu_in_fp32 = f
        self.softmax_in_fp32 = cfg.attention_softmax_in_fp32
        # One fused [3H, H] q/k/v weight whose rows are grouped by head (Megatron's layout:
        # head 0's q, k, v, then head 1's, ...), so that a column split over TP ranks hands
        # each rank whole heads, and the TP all-reduce of the input grad happens once, not 3x.
        self.qkv = Linear(h, 3 * h, f)
        self.proj = Linear(h, h, f)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, H] -> [B, T, H]. Under TP, qkv gives [B, T, 3H/tp]: this rank's heads."""
        b, t, _ = x.shape
        # -1: the number of heads held here (n_head / tp under tensor parallelism)
        qkv = self.qkv(x).view(b, t, -1, 3, self.head_dim)
        q, k, v = (z.transpose(1, 2) for z in qkv.unbind(dim=3))  # [B, heads, T, head_dim]
        f = self.cpu_in_fp32
        scores = matmul(q, k.transpose(-2, -1), f)  # [B, heads, T, T] in the model dtype
        # Megatron's FusedScaleMaskSoftmax (torch path): scale, causal mask, softmax; in fp32
        # for fp16/bf16 scores only with --attention-softmax-in-fp32
        probs = scale_mask_softmax(
            scores, None, 1.0 / math.sqrt(self.head_dim), causal=True,
            softmax_in_fp32=self.softmax_in_fp32,
        )
        y = matmul(probs, v, f)  # [B, heads, T, head_dim]
        y = y.transpose(1, 2).reshape(b, t, -1)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        h, f = cfg.hidden_size, cfg.cpu_matmul_in_fp32
        self.fc1 = Linear(h, 4 * h, f)
        self.fc2 = Linear(4 * h, h, f)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


# ----------------------------------------------------------------------------- mixture of experts


@dataclass
class ExpertParallel:
    """Where this rank sits in the expert layout: ``size`` EP ranks, this one ``rank``, the
    all-to-all ``group`` (None with size 1). Rank ``r`` holds the experts
    ``[r * E / size, (r + 1) * E / size)`` of each MoE layer (Megatron-core's contiguous split)."""

    size: int = 1
    rank: int = 0
    group: object = None

    def local_experts(self, num_experts: int) -> range:
        if num_experts % self.size:
            raise ValueError(
                f"num_experts {num_experts} is not divisible by the expert-parallel size "
                f"{self.size}"
            )
        per = num_experts // self.size
        return range(self.rank * per, (self.rank + 1) * per)


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Megatron-core's ``MoEAuxLossAutoScaler`` (moe_utils.py): ``apply(x, aux_loss)`` returns x
    unchanged; its backward hands ``aux_loss`` the gradient ``main_loss_backward_scale`` (the
    factor the main loss is multiplied by before backward: loss scale / number of
    microbatches), so the auxiliary loss is trained without being added to the reported
    loss. The trainer sets the factor with :meth:`set_loss_scale` before each step."""

    main_loss_backward_scale: torch.Tensor = torch.tensor(1.0)

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor):
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        scale = MoEAuxLossAutoScaler.main_loss_backward_scale.to(aux_loss.device)
        return grad_output, torch.ones_like(aux_loss) * scale

    @staticmethod
    def set_loss_scale(scale: torch.Tensor) -> None:
        """The factor the aux loss's gradient is multiplied by (a 0-dim tensor or float)."""
        MoEAuxLossAutoScaler.main_loss_backward_scale = torch.as_tensor(
            scale, dtype=torch.float32).detach().clone()


def switch_load_balancing_loss(probs: torch.Tensor, tokens_per_expert: torch.Tensor,
                               topk: int, coeff: float) -> torch.Tensor:
    """Megatron-core's ``switch_load_balancing_loss_func`` (Switch Transformer): ``probs`` the
    fp32 softmax over all E experts [N, E], ``tokens_per_expert`` [E] the tokens routed to each
    expert (top-k counted k times). Returns ``coeff * E / (k * N^2) * sum_e(sum_n probs[n, e] *
    tokens_per_expert[e])``, a 0-dim fp32 tensor (``coeff`` when the load is uniform)."""
    n, e = probs.shape
    return torch.sum(probs.sum(dim=0) * tokens_per_expert) * (e * coeff / (topk * n * n))


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` along dim 0 with autograd (the backward sends the grads back with
    the split sizes swapped). Half-precision CPU tensors travel as fp32 (exact), which gloo
    supports for all-to-all whatever its half support."""

    @staticmethod
    def forward(ctx, x, output_splits: list, input_splits: list, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, input_splits, output_splits, ctx.group), None, None, None


def _all_to_all(x, output_splits, input_splits, group):
    import torch.distributed as dist

    wire = x.float() if (x.device.type == "cpu" and x.dtype in _HALF) else x
    out = wire.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, wire.contiguous(), output_splits, input_splits, group=group)
    return out.to(x.dtype)


class MoEMLP(nn.Module):
    """The GPT's MLP as a mixture of experts (Megatron-core's ``MoELayer`` with a ``TopKRouter``,
    the all-to-all token dispatcher and ``SequentialMLP`` experts).

    - Router ``router.weight`` [E, H] (a dense, replicated param): logits = x W^T in fp32, the
      top-k experts per token, their weights the fp32 softmax over those k logits (Megatron's
      default, ``moe_router_pre_softmax=False``). With ``moe_aux_loss_coeff > 0`` the
      load-balancing loss (:func:`switch_load_balancing_loss` over this rank's tokens of the
      microbatch, probs the softmax over all E logits) is trained through
      :class:`MoEAuxLossAutoScaler`.
    - Experts ``experts[str(e)]``: one :class:`MLP` (H -> 4H -> H) per expert held here, keyed by
      the *global* expert index ``e`` (so ``blocks.3.mlp.experts.5.fc1.weight`` names the same
      weight under any EP size; checkpoints re-map by name). Each expert param carries
      ``expert_index = e`` and ``allreduce = False`` (Megatron's mark of an expert param).
    - Dispatch: the (token, expert) pairs are sorted by expert; with EP > 1 the counts and then
      the tokens go to the rank holding each expert by ``all_to_all_single`` over the EP group,
      are regrouped by local expert, run, and come back by the reverse all-to-all; the outputs
      are weighted by the router probs and summed per token in fp32.
    - Expert tensor parallelism: the experts take the TP plan of the dense MLP (fc1
      column-parallel, fc2 row-parallel, :func:`tensor_parallel_plan`), so the expert TP group
      is the TP group (expert TP size = TP size). Tokens are replicated over TP, so every TP
      rank routes alike and the all-to-all runs among ranks of one TP index.

    forward(x): [B, T, H] in the model dtype -> [B, T, H] in the same dtype.
    """

    def __init__(self, cfg: GPTConfig, ep: ExpertParallel | None = None):
        super().__init__()
        self.num_experts, self.topk = cfg.num_experts, cfg.moe_router_topk
        self.aux_loss_coeff = cfg.moe_aux_loss_coeff
        self.ep = ep if ep is not None else ExpertParallel()
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        local = self.ep.local_experts(cfg.num_experts)
        self.experts = nn.ModuleDict({str(e): MLP(cfg) for e in local})
        mark_expert_params(self)

    def route(self, h: torch.Tensor):
        """h: [N, H] -> (top-k expert ids [N, k] int64, their weights [N, k] in fp32, or
        fp64 for an fp64 model)."""
        dt = torch.promote_types(h.dtype, torch.float32)
        logits = F.linear(h.to(dt), self.router.weight.to(dt))  # [N, E] fp32
        top_logits, top_idx = torch.topk(logits, self.topk, dim=-1)
        probs = torch.softmax(top_logits, dim=-1)
        if self.aux_loss_coeff > 0 and torch.is_grad_enabled():
            counts = torch.bincount(top_idx.reshape(-1), minlength=self.num_experts)
            aux = switch_load_balancing_loss(
                torch.softmax(logits, dim=-1), counts.float(), self.topk, self.aux_loss_coeff
            )
            probs = MoEAuxLossAutoScaler.apply(probs, aux)
        return top_idx, probs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, hidden = x.shape, x.shape[-1]
        h = x.reshape(-1, hidden)  # [N, H]
        top_idx, probs = self.route(h)
        k, ep, n_local = self.topk, self.ep.size, len(self.experts)
        flat = top_idx.reshape(-1)  # [N k]: the expert of each (token, slot)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs sorted by expert
        token_of = order // k
        tokens = h[token_of]  # [N k, H]
        counts = torch.bincount(flat, minlength=self.num_experts)  # [E]
        if ep > 1:
            import torch.distributed as dist

            send = counts.view(ep, n_local)  # row r: what goes to EP rank r
            recv = torch.empty_like(send)  # row r: what EP rank r sends here
            dist.all_to_all_single(recv, send.contiguous(), group=self.ep.group)
            in_splits, out_splits = send.sum(1).tolist(), recv.sum(1).tolist()
            tokens = _AllToAll.apply(tokens, out_splits, in_splits, self.ep.group)
            # received segments are (source rank, local expert) in row-major order: regroup
            # them by local expert (source order kept inside each)
            seg = torch.repeat_interleave(torch.arange(ep * n_local, device=x.device),
                                          recv.reshape(-1))
            regroup = torch.argsort((seg % n_local) * ep + seg // n_local, stable=True)
            tokens = tokens[regroup]
            local_counts = recv.sum(0).tolist()
        else:
            local_counts = counts.tolist()
        outs = [expert(chunk) for expert, chunk in
                zip(self.experts.values(), tokens.split(local_counts))]
        y = torch.cat(outs) if outs else tokens
        if ep > 1:
            y = y[torch.argsort(regroup)]  # back to (source rank, local expert) order
            y = _AllToAll.apply(y, in_splits, out_splits, self.ep.group)
        weights = probs.reshape(-1)[order]  # [N k] fp32, in y's order
        out = torch.zeros(h.shape, dtype=weights.dtype, device=x.device)
        out = out.index_add(0, token_of, y.to(weights.dtype) * weights[:, None])
        return out.to(x.dtype).view(shape)


def mark_expert_params(module: nn.Module) -> None:
    """Mark the expert params of every :class:`MoEMLP` in ``module`` (again after anything that
    makes new param objects: parallelize_module, fully_shard) with
    :func:`tpamp.mark_expert_param` (Megatron's ``allreduce = False``; each param belongs to one
    expert and its name carries the global expert index), and ``expert_index`` = that index."""
    for m in module.modules():
        if isinstance(m, MoEMLP):
            for e, expert in m.experts.items():
                for p in expert.parameters():
                    mark_expert_param(p)
                    p.expert_index = int(e)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, ep: ExpertParallel | None = None):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size)
        self.mlp = MLP(cfg) if cfg.num_experts is None else MoEMLP(cfg, ep)
        self.fp32_residual = cfg.fp32_residual_connection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: the residual stream [B, T, H], in the model dtype or (fp32_residual_connection)
        fp32. The sublayers run in the model dtype; the residual adds in fp32 if the flag is on."""
        dt = self.attn.qkv.weight.dtype  # the model dtype
        f = self.fp32_residual
        x = residual_add(self.attn(self.ln_1(x.to(dt))), x, f)
        return residual_add(self.mlp(self.ln_2(x.to(dt))), x, f)


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """Global indices of the blocks on pipeline stage ``pp_rank`` of ``pp_size`` stages (an
    even split; with virtual stages ``pp_size`` counts all of them, see :class:`GPTChunks`)."""
    if num_layers % pp_size != 0:
        raise ValueError(f"num_layers {num_layers} is not divisible by pipeline size {pp_size}")
    per = num_layers // pp_size
    return range(pp_rank * per, (pp_rank + 1) * per)


class GPTStage(nn.Module):
    """The part of the GPT on one pipeline stage (see the module docstring).

    forward(x): on the first stage x is token ids [B, T] int64, otherwise the previous stage's
    activation [B, T, H] (model dtype, or fp32 with ``cfg.fp32_residual_connection``). Returns
    the activation [B, T, H] for the next stage (same dtype rule), or on the last stage the
    logits in the model dtype: this TP rank's [B, T, V/tp] slice once the stage is
    parallelized (:func:`parallelize_stage`), the full [B, T, V] before.
    """

    def __init__(self, cfg: GPTConfig, pp_size: int = 1, pp_rank: int = 0,
                 ep: ExpertParallel | None = None):
        super().__init__()
        self.cfg = cfg
        self.is_first = pp_rank == 0
        self.is_last = pp_rank == pp_size - 1
        self.layer_ids = list(stage_layers(cfg.num_layers, pp_size, pp_rank))
        if self.is_first:
            self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.wpe = nn.Embedding(cfg.seq_length, cfg.hidden_size)
        self.blocks = nn.ModuleList(Block(cfg, ep) for _ in self.layer_ids)
        if self.is_last:
            self.ln_f = nn.LayerNorm(cfg.hidden_size)
            if cfg.fp32_final_layernorm:
                set_fp32_attr_to_module(self.ln_f)  # an fp32 island (see cast_)
            if not self.is_first:
                # The last stage's copy of the word embedding, used as the output head.
                self.head_weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
                self.head_weight.shared = True

    def global_named_parameters(self):
        """(name, param) pairs like ``named_parameters()``, but each block is named by its
        global layer index (``blocks.5.mlp.fc1.weight`` on whichever stage holds layer 5), so a
        name is unique in the whole model and the same under any pipeline split. The last
        stage's tied head copy keeps the name ``head_weight`` (it is ``shared``)."""
        for name, param in self.named_parameters():
            if name.startswith("blocks."):
                _, local, rest = name.split(".", 2)
                name = f"blocks.{self.layer_ids[int(local)]}.{rest}"
            yield name, param

    def output_head_weight(self) -> torch.Tensor:
        """The [V, H] weight of the output head: wte.weight itself, or the tied copy."""
        return self.wte.weight if self.is_first else self.head_weight

    def word_embedding_weight(self):
        """The weight to keep identical across the embedding group (None in middle stages)."""
        if self.is_first:
            return self.wte.weight
        if self.is_last:
            return self.head_weight
        return None

    def checkpoint_named_parameters(self) -> dict:
        """{global name: param} of this stage for tpamp.checkpoint, named as in the whole
        one-stage model so the names do not depend on the PP layout: the stage's ``blocks.{j}``
        is ``blocks.{layer_ids[j]}``, and the last stage's tied head copy ``head_weight``
        (marked ``shared``) is ``wte.weight``, the weight it is a copy of (one-stage models
        have no head copy), so it is saved once and loads on any layout."""
        out = {}
        for name, param in self.named_parameters():
            if name.startswith("blocks."):
                j, rest = name[len("blocks."):].split(".", 1)
                name = f"blocks.{self.layer_ids[int(j)]}.{rest}"
            elif name == "head_weight":
                name = "wte.weight"
            out[name] = param
        return out

    @property
    def model_dtype(self) -> torch.dtype:
        """The dtype the matmuls run in (that of the params outside fp32 islands)."""
        if self.is_first:
            return self.wte.weight.dtype
        if self.is_last:
            return self.head_weight.dtype
        return self.blocks[0].attn.qkv.weight.dtype

    def cast_(self, dtype: torch.dtype) -> "GPTStage":
        """Cast the floating params and buffers to ``dtype`` in place, except inside modules
        marked with :func:`tpamp.set_fp32_attr_to_module`, which are kept (made) fp32 -- the
        casting rule of :class:`tpamp.NaiveAMPModel`, whose input casts do not suit a pipeline
        stage that receives fp32 activations. Returns self."""
        stack = [(self, False)]
        while stack:
            module, island = stack.pop()
            island = island or module_has_fp32_attr(module)
            target = torch.float32 if island else dtype
            module._apply(
                lambda t, target=target: t.to(target) if t.is_floating_point() else t,
                recurse=False,
            )
            stack.extend((child, island) for child in module.children())
        return self

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """GPT-2 init (normal std 0.02; residual projections 0.02/sqrt(2L); zero biases; unit
        LayerNorm), each module from its own seeded generator so the result does not depend on
        the pipeline split. The last stage's head copy gets the same values as ``wte``."""
        std = 0.02
        proj_std = std / math.sqrt(2 * self.cfg.num_layers)

        def gen(k: int) -> torch.Generator:
            return torch.Generator().manual_seed(seed * 1_000_003 + k)

        def normal_(t: torch.Tensor, s: float, g: torch.Generator) -> None:
            t.copy_(torch.randn(t.shape, generator=g) * s)

        if self.is_first:
            normal_(self.wte.weight, std, gen(0))
            normal_(self.wpe.weight, std, gen(1))
        if self.is_last and not self.is_first:
            normal_(self.head_weight, std, gen(0))  # the same stream as wte
        for i, block in zip(self.layer_ids, self.blocks):
            g = gen(100 + i)
            linears = [("qkv", block.attn.qkv, g), ("proj", block.attn.proj, g)]
            if isinstance(block.mlp, MoEMLP):  # router and each expert: streams of their own,
                # keyed by the global layer and expert index (the same under any EP size)
                normal_(block.mlp.router.weight, std, gen(200_000 + i))
                for e, expert in block.mlp.experts.items():
                    ge = gen(300_000 + i * self.cfg.num_experts + int(e))
                    linears += [("fc1", expert.fc1, ge), ("fc2", expert.fc2, ge)]
            else:
                linears += [("fc1", block.mlp.fc1, g), ("fc2", block.mlp.fc2, g)]
            for name, lin, g_lin in linears:
                normal_(lin.weight, proj_std if name in ("proj", "fc2") else std, g_lin)
                lin.bias.zero_()
        for m in self.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.fill_(1.0)
                m.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = self.model_dtype
        if self.is_first:
            t = x.shape[1]
            pos = torch.arange(t, device=x.device)
            x = self.wte(x) + self.wpe(pos)
            if self.cfg.fp32_residual_connection:
                x = x.float()  # Megatron: the residual stream starts fp32 at the embedding
        for block in self.blocks:
            x = block(x)
        if self.is_last:
            if module_has_fp32_attr(self.ln_f):
                h = self.ln_f(x.float()).to(dt)
            else:
                h = self.ln_f(x.to(dt))
            x = output_head(h, self.output_head_weight(), self.cfg.cpu_matmul_in_fp32)
        return x


class GPTChunks(nn.Module):
    """The model chunks of one pipeline rank under an interleaved schedule (Megatron's virtual
    pipeline stages): ``chunks[c]`` is the :class:`GPTStage` of global stage ``c * pp + pp_rank``
    of ``v * pp`` stages (so with 4 layers, PP 2 and 2 virtual stages, rank 0 holds layers 0 and
    2, rank 1 layers 1 and 3). The word embedding is on chunk 0 of the first rank, the final
    LayerNorm and the tied head copy on the last chunk of the last rank.

    It offers the methods of :class:`GPTStage` that the trainer, the optimizer and the
    checkpoint use (parameter names with the global layer index, the tied weight, cast, init),
    over all its chunks; the pipeline schedule runs the chunks themselves, so ``forward`` is
    not defined. Raises ValueError for ``v < 1`` or ``pp < 2`` with ``v > 1`` (the tied
    embedding and its head copy would be on one rank)."""

    def __init__(self, cfg: GPTConfig, pp_size: int, pp_rank: int, virtual_stages: int,
                 ep: ExpertParallel | None = None):
        super().__init__()
        if virtual_stages < 1 or (virtual_stages > 1 and pp_size < 2):
            raise ValueError(
                f"virtual_stages {virtual_stages} with pipeline size {pp_size}: expected "
                "virtual_stages >= 1, and pipeline size >= 2 for more than one"
            )
        self.cfg = cfg
        self.pp_size, self.pp_rank, self.virtual_stages = pp_size, pp_rank, virtual_stages
        num_stages = pp_size * virtual_stages
        self.stage_indices = [c * pp_size + pp_rank for c in range(virtual_stages)]
        self.chunks = nn.ModuleList(GPTStage(cfg, num_stages, s, ep) for s in self.stage_indices)
        self.is_first = self.chunks[0].is_first
        self.is_last = self.chunks[-1].is_last

    @property
    def layer_ids(self) -> list:
        """The global indices of the blocks held here, in chunk order."""
        return [i for chunk in self.chunks for i in chunk.layer_ids]

    def global_named_parameters(self):
        """As :meth:`GPTStage.global_named_parameters`, over the chunks."""
        for chunk in self.chunks:
            yield from chunk.global_named_parameters()

    def checkpoint_named_parameters(self) -> dict:
        """As :meth:`GPTStage.checkpoint_named_parameters`, over the chunks (names of the
        one-stage model: the same under any pipeline split, virtual or not)."""
        out = {}
        for chunk in self.chunks:
            out.update(chunk.checkpoint_named_parameters())
        return out

    def word_embedding_weight(self):
        """``wte.weight`` (first rank), the tied head copy (last rank), else None."""
        if self.is_first:
            return self.chunks[0].word_embedding_weight()
        if self.is_last:
            return self.chunks[-1].word_embedding_weight()
        return None

    def output_head_weight(self) -> torch.Tensor:
        return self.chunks[-1].output_head_weight()

    @property
    def model_dtype(self) -> torch.dtype:
        return self.chunks[0].model_dtype

    def cast_(self, dtype: torch.dtype) -> "GPTChunks":
        for chunk in self.chunks:
            chunk.cast_(dtype)
        return self

    def init_weights(self, seed: int) -> None:
        for chunk in self.chunks:
            chunk.init_weights(seed)


def tensor_parallel_plan(stage: GPTStage) -> dict:
    """The parallelize_module plan of one stage: Megatron's column/row split of each block,
    and the vocab-parallel word embedding.

    Column-parallel qkv and fc1 take a replicated [B, T, H] input and give this rank's features
    (a plain local tensor); row-parallel proj, fc2 take those and return the TP-summed,
    replicated [B, T, H]. ``wte`` (first stage) is row-parallel: its weight is Shard(0) (V/tp
    vocabulary rows per rank), the token ids go in replicated and the looked-up [B, T, H] comes
    out TP-summed and replicated. The last stage's head copy is not a module: see
    :func:`parallelize_stage`. Everything else stays replicated.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    if stage.is_first:
        plan["wte"] = RowwiseParallel(input_layouts=Replicate())
    for j in range(len(stage.blocks)):
        p = f"blocks.{j}"
        mlp = stage.blocks[j].mlp
        mlps = [f"mlp.experts.{e}" for e in mlp.experts] if isinstance(mlp, MoEMLP) else ["mlp"]
        for name in ("attn.qkv", *(f"{m}.fc1" for m in mlps)):
            plan[f"{p}.{name}"] = ColwiseParallel()
        for name in ("attn.proj", *(f"{m}.fc2" for m in mlps)):
            plan[f"{p}.{name}"] = RowwiseParallel()
    return plan


def parallelize_stage(stage: GPTStage, tp_mesh) -> GPTStage:
    """Shard ``stage`` over the 1-D TP mesh: :func:`tensor_parallel_plan` through
    parallelize_module, and the last stage's tied head copy ``head_weight`` Shard(0) like
    ``wte``, so that both copies of the tied weight hold the same vocab rows on a TP rank and the
    head gives vocab-parallel logits. Every TP rank must already hold the same full weights
    (each keeps its own shard; nothing is sent). Every DTensor param gets a grad hook that
    places its grad like the param (see :func:`_grad_like_param`); a later in-place conversion
    of the params (``.to``, :meth:`GPTStage.cast_`) drops those hooks, so cast first. Returns
    the stage."""
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    if isinstance(stage, GPTChunks):
        for chunk in stage.chunks:
            parallelize_stage(chunk, tp_mesh)
        return stage
    if stage.cfg.vocab_size % tp_mesh.size():
        raise ValueError(
            f"vocab_size {stage.cfg.vocab_size} is not divisible by the TP size {tp_mesh.size()}"
        )
    parallelize_module(stage, tp_mesh, tensor_parallel_plan(stage), src_data_rank=None)
    if stage.is_last and not stage.is_first:
        sharded = distribute_tensor(
            stage.head_weight.detach(), tp_mesh, [Shard(0)], src_data_rank=None
        )
        stage.head_weight = nn.Parameter(sharded, requires_grad=stage.head_weight.requires_grad)
        stage.head_weight.shared = True
    for param in stage.parameters():
        if isinstance(param, DTensor) and param.requires_grad:
            param.register_hook(_grad_like_param(param))
    mark_expert_params(stage)  # parallelize_module made new param objects
    return stage


def _grad_like_param(param):
    """A grad hook giving the grad ``param``'s own placements. DTensor's embedding backward
    returns a Replicate grad (the full [V, H] on every TP rank) for the Shard(0) ``wte``; the
    optimizer and the grad syncs expect a grad sharded like its param. Replicate -> Shard is a
    local slice, no communication; grads already placed like the param pass through."""
    mesh, placements = param.device_mesh, tuple(param.placements)

    def hook(grad):
        if isinstance(grad, DTensor) and tuple(grad.placements) != placements:
            return grad.redistribute(mesh, placements)
        return grad

    return hook


def count_params(cfg: GPTConfig) -> int:
    """Parameters of the whole model (all experts), counting the tied embedding/head once."""
    h, v, t, n = cfg.hidden_size, cfg.vocab_size, cfg.seq_length, cfg.num_layers
    mlp = (4 * h * h + 4 * h) + (4 * h * h + h)
    if cfg.num_experts is not None:
        mlp = cfg.num_experts * mlp + cfg.num_experts * h  # the experts and the router
    per_block = 4 * (h * h + h) + mlp + 4 * h
    return v * h + t * h + n * per_block + 2 * h
