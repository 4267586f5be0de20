"""What the strategy switches on the user's model for a run, each with its undo (run at teardown): Hugging Face's
hub kernels, gradient checkpointing and KV cache off (the engine patches the forwards and recomputes blocks itself),
the project's attention, the fused RMSNorm, rotary and SwiGLU kernels, and the loss computed from the hidden states
without the full logits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .attention import use_slide_attention
from .engine import SlideEngine
from .fused import use_fused_ops
from .loss import causal_lm_loss
from .models import Layout, disable_hf_cache, disable_hf_checkpointing, disable_hub_kernels, install_causal_lm_loss

Restore = Callable[[], None]


def switch_model(
    module: torch.nn.Module, layout: Layout, *, attention: str | None, fused_ops: bool | str, cuda: bool,
    dtype: torch.dtype, fitting: bool,
) -> list[Restore]:  # fmt: skip
    """Switch what the run changes before the plan (the strategy's ``attention`` and ``fused_ops``); returns the
    undos, in the order they were made."""
    restores = [disable_hub_kernels(module), disable_hf_checkpointing(module)]
    if fitting and layout.pretrained is not None:
        restores.append(disable_hf_cache(layout.pretrained))
    low_precision = dtype != torch.float32  # the attention kernel's Triton path is bf16/fp16
    if layout.pretrained is not None and (
        attention in ("slide", "slide_kernel") or (attention == "auto" and cuda and low_precision)
    ):
        required = attention != "auto"
        name = attention if required else "slide"
        restores.append(use_slide_attention(layout.pretrained, required=required, name=name))
    if fused_ops is True or (fused_ops == "auto" and cuda):
        restores.append(use_fused_ops(module))
    return [r for r in restores if r is not None]


def install_loss(layout: Layout, engine: SlideEngine | None, dtype: torch.dtype) -> Restore | None:
    """The logits-free loss on a Hugging Face causal LM: on the head's buffer when it streams (``engine``), on its own
    weights when it is on the device; ``None`` where the model has no such loss."""
    if layout.causal_lm is None:
        return None
    head = layout.causal_lm.get_output_embeddings()
    streamed = engine is not None and engine.head is not None

    def loss(hidden: torch.Tensor, labels: torch.Tensor, **kw: Any) -> torch.Tensor:
        if streamed:
            return engine.head_loss(hidden, labels, causal_lm_loss, **kw)
        return causal_lm_loss(hidden, head.weight.to(dtype), labels, head.bias, **kw)

    return install_causal_lm_loss(layout.causal_lm, loss)
