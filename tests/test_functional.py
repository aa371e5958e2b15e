"""tpamp.functional: Megatron's fp16 helpers against fp64 single-process references."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.dist_utils import run_workers
from tpamp.functional import residual_add, scale_mask_softmax, vocab_parallel_cross_entropy

# ---- residual ------------------------------------------------------------------------------


def test_fp32_residual_connection_adds_and_returns_fp32():
    torch.manual_seed(0)
    residual = torch.randn(4, 8) * 1000  # a big residual stream: fp16 would lose the small x
    x = (torch.randn(4, 8) * 1e-2).half()
    ref = residual.double() + x.double()
    out = residual_add(x, residual, fp32_residual_connection=True)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-7, atol=1e-4)
    plain = residual_add(x, residual.half())
    assert plain.dtype == torch.float16
    # fp16 stream error is orders of magnitude above the fp32 stream's
    assert (plain.double() - ref).abs().max() > 100 * (out.double() - ref).abs().max()


def test_residual_add_is_differentiable_into_half_inputs():
    x = torch.randn(3, dtype=torch.float16, requires_grad=True)
    r = torch.randn(3, requires_grad=True)
    residual_add(x, r, True).sum().backward()
    assert x.grad.dtype == torch.float16 and torch.equal(x.grad, torch.ones(3, dtype=torch.half))
    assert torch.equal(r.grad, torch.ones(3))


# ---- softmax -------------------------------------------------------------------------------


def _softmax_reference(scores, mask, scale, causal):
    x = scores.double() * (1.0 if scale is None else scale)
    sq, sk = x.shape[-2:]
    full = torch.zeros(x.shape, dtype=torch.bool)
    if mask is not None:
        full = full | mask
    if causal:
        i = torch.arange(sq).unsqueeze(1) + (sk - sq)
        j = torch.arange(sk).unsqueeze(0)
        full = full | (j > i)
    x = x.masked_fill(full, -10000.0)
    return torch.exp(x - x.amax(-1, keepdim=True)) / torch.exp(x - x.amax(-1, keepdim=True)).sum(
        -1, keepdim=True
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal,sq,sk", [(False, 5, 5), (True, 5, 5), (True, 3, 6)])
def test_fp32_softmax_matches_fp64_reference_and_returns_input_dtype(dtype, causal, sq, sk):
    torch.manual_seed(1)
    scores = (torch.randn(2, 3, sq, sk) * 4).to(dtype)
    mask = torch.rand(2, 1, sq, sk) < 0.3
    scale = 0.7
    out = scale_mask_softmax(scores, mask, scale, causal=causal)
    assert out.dtype == dtype and out.shape == scores.shape
    ref = _softmax_reference(scores, mask, scale, causal)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(out.double(), ref, rtol=eps, atol=eps)


def test_fp32_softmax_survives_scores_that_overflow_when_scaled_in_fp16():
    scores = torch.full((1, 1, 2, 4), 2000.0, dtype=torch.float16)
    scores[..., 0] = 1990.0
    out32 = scale_mask_softmax(scores, None, 64.0)  # 2000 * 64 > fp16 max 65504
    out16 = scale_mask_softmax(scores, None, 64.0, softmax_in_fp32=False)
    ref = _softmax_reference(scores, None, 64.0, False)
    assert torch.isfinite(out32).all()
    torch.testing.assert_close(out32.double(), ref, rtol=1e-3, atol=1e-3)
    assert not torch.isfinite(out16).all()


def test_softmax_rejects_non_bool_mask_and_wrong_rank():
    with pytest.raises(ValueError, match="bool"):
        scale_mask_softmax(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))
    with pytest.raises(ValueError, match=r"\[b, np, sq, sk\]"):
        scale_mask_softmax(torch.zeros(2, 2), None)


def _softmax_tp_worker(rank, world_size):
    # attention heads are split over TP ranks; each rank's softmax matches its slice of the
    # single-process fp64 reference
    torch.manual_seed(3)
    scores = (torch.randn(2, 4, 6, 6) * 3).half()
    mask = torch.rand(2, 1, 6, 6) < 0.2
    heads = 4 // world_size
    local = scores[:, rank * heads : (rank + 1) * heads]
    out = scale_mask_softmax(local, mask, 0.5, causal=True)
    ref = _softmax_reference(scores, mask, 0.5, True)[:, rank * heads : (rank + 1) * heads]
    eps = torch.finfo(torch.float16).eps
    torch.testing.assert_close(out.double(), ref, rtol=eps, atol=eps)
    return True


def test_fp32_softmax_on_tp_head_shards_matches_fp64_reference():
    run_workers(_softmax_tp_worker, 2)


# ---- vocab-parallel cross-entropy ----------------------------------------------------------


def _ce_reference(logits, target, grad_out):
    """Loss and logits grad of unsharded fp64 cross-entropy (torch's own implementation)."""
    lg = logits.detach().double().requires_grad_(True)
    loss = F.cross_entropy(lg.reshape(-1, lg.size(-1)), target.reshape(-1), reduction="none")
    loss = loss.reshape(target.shape)
    (loss * grad_out.double()).sum().backward()
    return loss.detach(), lg.grad


def _ce_tp_worker(rank, world_size):
    torch.manual_seed(7)
    b, s, vocab = 3, 4, 16
    logits = torch.randn(b, s, vocab) * 3
    target = torch.randint(0, vocab, (b, s))
    target[0, :2] = torch.tensor([0, vocab - 1])  # both ends of the vocabulary
    grad_out = torch.rand(b, s)
    ref_loss, ref_grad = _ce_reference(logits, target, grad_out)
    part = vocab // world_size
    sl = slice(rank * part, (rank + 1) * part)
    group = dist.group.WORLD
    out = {}

    # fp32 logits
    local = logits[..., sl].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, target, group)
    (loss * grad_out).sum().backward()
    assert loss.dtype == torch.float32 and loss.shape == target.shape
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(local.grad.double(), ref_grad[..., sl], rtol=1e-5, atol=1e-6)

    # fp16 logits, default: computed in fp32, fp32 loss, fp16 grad
    local16 = logits[..., sl].half().requires_grad_(True)
    ref_loss16, ref_grad16 = _ce_reference(logits.half(), target, grad_out)
    loss = vocab_parallel_cross_entropy(local16, target, group)
    (loss * grad_out).sum().backward()
    assert loss.dtype == torch.float32 and local16.grad.dtype == torch.float16
    torch.testing.assert_close(loss.double(), ref_loss16, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(local16.grad.double(), ref_grad16[..., sl], rtol=2e-3, atol=2e-3)
    out["fp32_err"] = (loss.double() - ref_loss16).abs().max().item()

    # fp16_lm_cross_entropy: stays fp16 (loss and grad), close to the reference at fp16 precision
    local16.grad = None
    loss = vocab_parallel_cross_entropy(local16, target, group, fp16_lm_cross_entropy=True)
    (loss * grad_out.half()).sum().backward()
    assert loss.dtype == torch.float16 and local16.grad.dtype == torch.float16
    torch.testing.assert_close(loss.double(), ref_loss16, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(local16.grad.double(), ref_grad16[..., sl], rtol=1e-2, atol=1e-2)
    out["fp16_err"] = (loss.double() - ref_loss16).abs().max().item()
    # the input was not modified in place
    assert torch.equal(local16.detach(), logits[..., sl].half())
    return out


def test_vocab_parallel_cross_entropy_loss_and_grad_match_fp64_reference_on_tp2():
    results = run_workers(_ce_tp_worker, 2)
    # the fp16 computation is measurably less exact than the fp32 one (so the option matters)
    assert all(r["fp16_err"] > r["fp32_err"] for r in results)


def test_vocab_parallel_cross_entropy_gradcheck_unsharded_fp64():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 5, (2, 3))
    assert torch.autograd.gradcheck(
        lambda lg: vocab_parallel_cross_entropy(lg, target), (logits,), eps=1e-6, atol=1e-5
    )
    ref = F.cross_entropy(logits.reshape(-1, 5), target.reshape(-1), reduction="none")
    torch.testing.assert_close(vocab_parallel_cross_entropy(logits, target), ref.reshape(2, 3))


def test_vocab_parallel_cross_entropy_validates_inputs():
    with pytest.raises(ValueError, match="shape"):
        vocab_parallel_cross_entropy(torch.zeros(2, 3, 4), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        vocab_parallel_cross_entropy(torch.zeros(2, 4), torch.zeros(2))
    with pytest.raises(TypeError, match="floating"):
        vocab_parallel_cross_entropy(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, dtype=torch.long))
