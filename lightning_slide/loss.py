"""The causal-LM loss straight from the last hidden states: the (tokens x vocabulary) logits are never built.

It runs the fused linear cross-entropy of ``lightning_slide.kernels`` (Triton on CUDA, the same algorithm in
chunked torch ops on the CPU) on Hugging Face's label convention.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from .kernels.linear_cross_entropy import fused_linear_cross_entropy


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
        bias: optional (V,) head bias.
        num_items_in_batch: if given, the summed loss is divided by it instead of the number of valid tokens.
        shift_labels: already-shifted labels (B, S), used instead of ``labels``.
        softcap: final logit soft-capping (Gemma 2).
    """
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return fused_linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        shift_labels.reshape(-1).to(hidden.device),
        bias,
        ignore_index=ignore_index,
        normalizer=num_items_in_batch,
        softcap=softcap,
    )
