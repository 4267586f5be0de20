"""Whether the whole run sits on the device (the resident tier: plain training there) or streams, from what plain
training puts on the device at the tokens per batch (``choose_tier``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .engine.planner import (
    DEVICE_RESERVE,
    GIB,
    fused_loss_bytes,
    plain_activation_bytes,
    plain_training_bytes,
    usable_device_bytes,
)
from .models import Layout
from .options import Run


@dataclass(frozen=True)
class Tier:
    """Whether the whole run sits on the device, and the figures behind the choice."""

    resident: bool
    reason: str
    tokens: int | None = None  # per batch, as planned
    need: int = 0  # device bytes of the resident run at ``tokens`` tokens per batch
    max_tokens: int | None = None  # the most tokens per batch the resident run fits (``None``: streamed)


def choose_tier(run: Run, tokens: int | None, budget: int | None, logits_built: bool) -> Tier:
    """The resident tier when everything plain training puts on the device fits ``budget`` at ``tokens`` tokens per
    batch: parameters, gradients, optimizer state and activations (``planner.plain_training_bytes``); else stream.

    Args:
        logits_built: the loss builds the full logits (the model's own loss; not the installed one).
    """
    placement, layout, module, optimizer, dtype = (
        run.options.placement, run.layout, run.module, run.optimizer, run.dtype
    )  # fmt: skip
    if placement == "stream":
        return Tier(False, "placement='stream'", tokens)
    if budget is None:
        return Tier(False, "no device budget: on the CPU, SlideFormerStrategy(device_memory_gib=...) gives one", tokens)
    if tokens is None:
        return Tier(False, "the tokens per batch are unknown: SlideFormerStrategy(tokens_per_batch=...) gives them")
    params = list(dict.fromkeys(module.parameters()))
    copies = dtype.itemsize if dtype != torch.float32 else 0
    fixed = plain_training_bytes(params, optimizer, copies_itemsize=copies, stored=run.stored).total + DEVICE_RESERVE
    blocks = [m for _, m in layout.blocks]
    head = _head(module, layout)
    per_token = plain_activation_bytes(blocks, dtype.itemsize, head.out_features if logits_built and head else 0)
    fixed += loss_bytes(layout, tokens, logits_built)
    need = fixed + int(tokens * per_token)
    room = usable_device_bytes(budget) - fixed
    if need > usable_device_bytes(budget):
        reason = f"plain training would need {need / GIB:.2f} GiB of the {budget / GIB:.2f} GiB budget"
        return Tier(False, reason, tokens)
    most = int(room // per_token) if per_token else None
    return Tier(True, f"{need / GIB:.2f} GiB of the {budget / GIB:.2f} GiB budget", tokens, need, most)


def loss_bytes(layout: Layout, tokens: int | None, logits_built: bool, retained: bool = False) -> int:
    """Device bytes of the installed logits-free loss's workspace (the model's own loss: its logits count as
    activations); ``retained``: a backward pass keeps the graph (the "norm-first" schedule)."""
    if logits_built or not tokens or layout.head is None:
        return 0
    head = layout.head[1]
    return fused_loss_bytes(tokens, head.out_features, head.in_features, retained)


def _head(module: nn.Module, layout: Layout) -> nn.Linear | None:
    # the output head: the widest Linear outside the blocks
    inside = {m for _, b in layout.blocks for m in b.modules()}
    heads = [m for m in module.modules() if isinstance(m, nn.Linear) and m not in inside]
    return max(heads, key=lambda m: m.out_features, default=None)
