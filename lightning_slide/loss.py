"""The causal-LM loss straight from the last hidden states: full logits (tokens x vocabulary) are never built.

``chunked_linear_cross_entropy`` is the PyTorch version used on the CPU (and on CUDA until the Triton kernel
lands): it walks the vocabulary in chunks, keeping one (tokens x chunk) block of logits at a time. The weight
gradient of each vocabulary chunk comes from one matmul over all tokens, so it is rounded once, exactly as in
plain training, and no fp32 (vocabulary x hidden) buffer is needed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd import Function

_CHUNK_ELEMENTS = 1 << 25  # logits elements per chunk (128 MiB in fp32)


def chunked_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    normalizer: Tensor | float | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``target`` without materializing the logits.

    Args:
        hidden: (N, H) hidden states.
        weight: (V, H) output head weight.
        target: (N,) int64 class ids; ``ignore_index`` marks tokens without a loss.
        bias: optional (V,) head bias.
        ignore_index: target value that contributes nothing.
        reduction: ``"mean"`` (over non-ignored tokens), ``"sum"`` or ``"none"`` (per token).
        normalizer: divide the summed loss by this instead (e.g. Hugging Face's ``num_items_in_batch``).
        softcap: Gemma-style ``softcap * tanh(logits / softcap)`` before the softmax.

    Returns:
        the loss: a scalar, or (N,) for ``reduction="none"``.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be (N, H) and weight (V, H); got {tuple(hidden.shape)} and {tuple(weight.shape)}."
        )
    if target.shape != hidden.shape[:1]:
        raise ValueError(f"target must be ({hidden.shape[0]},); got {tuple(target.shape)}.")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none'; got {reduction!r}.")
    per_token = _ChunkedLinearCrossEntropy.apply(hidden, weight, bias, target, ignore_index, softcap)
    if reduction == "none":
        return per_token
    total = per_token.sum()
    if normalizer is not None:
        return total / normalizer
    if reduction == "sum":
        return total
    return total / (target != ignore_index).sum()


class _ChunkedLinearCrossEntropy(Function):
    """Per-token loss; the backward recomputes each vocabulary chunk's logits."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, ignore_index, softcap):
        n, vocab = hidden.shape[0], weight.shape[0]
        h = hidden.to(weight.dtype)
        valid = target != ignore_index
        safe_target = torch.where(valid, target, 0)
        lse = torch.full((n,), float("-inf"), dtype=torch.float32, device=hidden.device)
        target_logit = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        for v0, v1 in _chunks(n, vocab):
            z = _logits(h, weight, bias, v0, v1, softcap)
            lse = torch.logaddexp(lse, torch.logsumexp(z, dim=1))
            inside = (safe_target >= v0) & (safe_target < v1)
            picked = z.gather(1, (safe_target - v0).clamp(0, v1 - v0 - 1).unsqueeze(1)).squeeze(1)
            target_logit = torch.where(inside, picked, target_logit)
        loss = torch.where(valid, lse - target_logit, 0.0)
        ctx.save_for_backward(hidden, weight, bias, safe_target, valid, lse)
        ctx.softcap = softcap
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, bias, target, valid, lse = ctx.saved_tensors
        n, vocab = hidden.shape[0], weight.shape[0]
        h = hidden.to(weight.dtype)
        scale = torch.where(valid, grad_loss.float(), 0.0).unsqueeze(1)
        grad_h = torch.zeros(n, hidden.shape[1], dtype=torch.float32, device=hidden.device)
        grad_w = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        grad_b = torch.empty(vocab, dtype=torch.float32, device=hidden.device) if bias is not None else None
        for v0, v1 in _chunks(n, vocab):
            raw = _logits(h, weight, bias, v0, v1, None)
            z = ctx.softcap * torch.tanh(raw / ctx.softcap) if ctx.softcap else raw
            dz = torch.exp(z - lse.unsqueeze(1))
            inside = (target >= v0) & (target < v1)
            rows = inside.nonzero().squeeze(1)
            dz[rows, target[rows] - v0] -= 1.0
            dz *= scale
            if ctx.softcap:
                dz *= 1.0 - (z / ctx.softcap) ** 2
            dz_c = dz.to(weight.dtype)
            grad_h += (dz_c @ weight[v0:v1]).float()
            if grad_w is not None:
                grad_w[v0:v1] = dz_c.t() @ h
            if grad_b is not None:
                grad_b[v0:v1] = dz.sum(0)
        grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
        return grad_h.to(hidden.dtype), grad_w, grad_b, None, None, None


def _chunks(n: int, vocab: int):
    size = max(1, min(vocab, _CHUNK_ELEMENTS // max(n, 1)))
    for v0 in range(0, vocab, size):
        yield v0, min(vocab, v0 + size)


def _logits(h: Tensor, weight: Tensor, bias: Tensor | None, v0: int, v1: int, softcap: float | None) -> Tensor:
    z = F.linear(h, weight[v0:v1], None if bias is None else bias[v0:v1].to(h.dtype)).float()
    return softcap * torch.tanh(z / softcap) if softcap else z


def causal_lm_loss(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None = None,
    *,
    ignore_index: int = -100,
    num_items_in_batch: Tensor | int | None = None,
    shift_labels: Tensor | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Hugging Face's causal-LM loss (``ForCausalLMLoss``) from hidden states: position i predicts label i+1.

    Args:
        hidden: (B, S, H) last hidden states.
        weight: (V, H) output head weight.
        labels: (B, S) labels (unshifted), ``ignore_index`` where there is no loss.
        num_items_in_batch: if given, the summed loss is divided by it instead of the number of valid tokens.
        shift_labels: already-shifted labels (B, S), used instead of ``labels``.
        softcap: final logit soft-capping (Gemma 2).
    """
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    hidden2d = hidden.reshape(-1, hidden.shape[-1])
    target = shift_labels.reshape(-1).to(hidden.device)
    if num_items_in_batch is not None:
        return chunked_linear_cross_entropy(
            hidden2d, weight, target, bias, ignore_index=ignore_index, normalizer=num_items_in_batch, softcap=softcap
        )
    return chunked_linear_cross_entropy(hidden2d, weight, target, bias, ignore_index=ignore_index, softcap=softcap)
