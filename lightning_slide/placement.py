"""Where a run's state goes, decided at setup before anything large is allocated: the whole model on the device (the
resident tier) or streamed; for a streamed run the update schedule, bf16 retained gradients and the optimizer state's
tier (RAM or NVMe), from the trainer's settings and the host plan against the RAM available. Each "auto" that the plan
decides is logged."""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.optim import Optimizer

from .engine import EngineConfig, SlideEngine
from .engine.planner import (
    GIB,
    HostPlan,
    fused_loss_bytes,
    plain_activation_bytes,
    plain_training_bytes,
    usable_device_bytes,
)
from .models import Layout

log = logging.getLogger(__name__)

SCHEDULES = ("auto", "backward", "forward", "norm-first")
PLACEMENTS = ("auto", "stream")


@dataclass(frozen=True)
class EngineOptions:
    """The strategy's choices that the engine carries out (``SlideFormerStrategy``'s arguments, resolved)."""

    num_slots: int
    update_schedule: Literal["auto", "backward", "forward", "norm-first"]
    on_nonfinite: Literal["raise", "skip"]
    cpu_threads: int | None
    offload_activations: bool | Literal["auto"]
    optimizer_offload: Literal["auto", "cpu", "nvme"]
    nvme_path: str | None
    nvme_masters: bool
    config: EngineConfig


def resolve_schedule(update_schedule: str, on_nonfinite: str, trainer: Any, module: LightningModule) -> str:
    """The update schedule for ``update_schedule`` ("auto": "forward" when clipping, else "backward"); a schedule
    that cannot run this fit is refused."""
    clipping = bool(trainer.gradient_clip_val) or is_overridden("configure_gradient_clipping", module)
    schedule = update_schedule
    if schedule == "auto":
        schedule = "forward" if clipping else "backward"
    if schedule == "backward" and clipping:
        raise ValueError(
            "Gradient clipping needs every gradient before any update, so it runs with"
            " update_schedule='forward'; got update_schedule='backward'."
        )
    if schedule == "norm-first" and (why := norm_first_refusal(trainer, module)):
        raise ValueError(f"update_schedule='norm-first' {why}; use update_schedule='forward'.")
    if on_nonfinite == "skip" and schedule == "backward":
        raise ValueError(
            "on_nonfinite='skip' needs the global gradient norm before any update: set"
            " Trainer(gradient_clip_val=...) or use on_nonfinite='raise'."
        )
    return schedule


def choose_engine(
    module: LightningModule,
    layout: Layout,
    device: torch.device,
    dtype: torch.dtype,
    optimizer: Optimizer | None,
    schedule: str,
    trainer: Any,
    options: EngineOptions,
    stored: dict[nn.Parameter, int],
    available: int,
) -> tuple[SlideEngine, HostPlan]:
    """The engine for this fit and its host plan: where the plan does not fit the ``available`` RAM, each "auto"
    takes its cheaper choice in turn (bf16 retained gradients, then "norm-first", then the optimizer state on NVMe).

    Args:
        stored: the element sizes parameters will be stored with on the host, where they differ from now.
    """
    config = options.config

    def make(nvme_path: str | None, compact: bool = config.compact_retained_grads is True) -> SlideEngine:
        return SlideEngine(
            module, layout.blocks, device, compute_dtype=dtype, embedding=layout.embedding, head=layout.head,
            whole=layout.whole, optimizer=optimizer, schedule=schedule,
            retain_grads=trainer.accumulate_grad_batches > 1,
            num_slots=options.num_slots, on_nonfinite=options.on_nonfinite, cpu_threads=options.cpu_threads,
            offload_activations=options.offload_activations, nvme_path=nvme_path, nvme_masters=options.nvme_masters,
            hooks_read_grads=hooks_read_grads(trainer, module), compact_grads=compact, config=config,
        )  # fmt: skip

    nvme = options.nvme_path if options.optimizer_offload == "nvme" else None
    engine = make(nvme)
    plan = engine.host_plan(stored)
    if plan.added > available and config.compact_retained_grads == "auto":
        candidate = make(engine.nvme_path, compact=True)
        if candidate.compact_grads():
            engine, plan = candidate, candidate.host_plan(stored)
            log.info(
                "SlideFormer keeps the step's bf16 gradients in bf16 on the host (a slower CPU update): in fp32"
                " they would not fit the %.2f GiB of RAM available.", available / 2**30,
            )  # fmt: skip
    if (
        options.update_schedule == "auto"
        and engine.schedule == "forward"
        and plan.added > available
        and not norm_first_refusal(trainer, module)
    ):
        log.info(
            "SlideFormer clips with update_schedule='norm-first' (two backward passes): keeping the step's"
            " gradients for 'forward' would need %.2f GiB more than the %.2f GiB of RAM available.",
            plan.added / 2**30, available / 2**30,
        )  # fmt: skip
        schedule = "norm-first"
        engine = make(nvme)
        plan = engine.host_plan(stored)
    if (
        options.optimizer_offload == "auto"
        and options.nvme_path is not None
        and engine.optimizer is not None
        and not engine.optimizer.is_sgd
        and plan.added > available
    ):
        log.info(
            "SlideFormer keeps the optimizer state on NVMe (%s): in RAM the run would need %.2f GiB more than"
            " the %.2f GiB available.", options.nvme_path, plan.added / 2**30, available / 2**30,
        )  # fmt: skip
        engine = make(options.nvme_path)
        plan = engine.host_plan(stored)
    return engine, plan


def norm_first_refusal(trainer: Any, module: LightningModule) -> str | None:
    """Why ``update_schedule="norm-first"`` cannot train this fit (``None``: it can)."""
    if not trainer.gradient_clip_val:
        return "clips by norm and needs Trainer(gradient_clip_val=...)"
    if (trainer.gradient_clip_algorithm or "norm") != "norm":
        return "clips by norm, not by value"
    if is_overridden("configure_gradient_clipping", module):
        return (
            "clips at Trainer(gradient_clip_val=...) during the backward and cannot run an overridden"
            " configure_gradient_clipping"
        )
    if trainer.accumulate_grad_batches > 1:
        return "keeps no gradients between micro-batches and cannot accumulate them"
    return None


def hooks_read_grads(trainer: Any, module: LightningModule) -> bool:
    """Whether the module or a callback overrides a hook that sees ``param.grad`` between backward and step."""
    hooks = ("on_after_backward", "on_before_optimizer_step")
    return any(is_overridden(h, module) for h in hooks + ("configure_gradient_clipping",)) or any(
        is_overridden(h, cb) for cb in trainer.callbacks for h in hooks
    )


def half_trained(optimizer: Optimizer) -> list[nn.Parameter]:
    """The trained parameters loaded in a half dtype (a model loaded in bf16)."""
    params = dict.fromkeys(p for g in optimizer.param_groups for p in g["params"] if p.requires_grad)
    return [p for p in params if p.is_floating_point() and p.dtype != torch.float32]


def frozen_to_store(layout: Layout) -> list[nn.Parameter]:
    """Frozen fp32 matrices of the blocks and the head, to be kept in the compute dtype on the host; the embedding
    (streamed by fp32 rows) and anything tied to it keep fp32."""
    keep = set(layout.embedding[1].parameters()) if layout.embedding is not None else set()
    modules = [m for _, m in layout.blocks] + ([layout.head[1]] if layout.head is not None else [])
    params = dict.fromkeys(p for m in modules for p in m.parameters())
    return [p for p in params if not p.requires_grad and p.dim() >= 2 and p.dtype == torch.float32 and p not in keep]


@dataclass(frozen=True)
class Tier:
    """Whether the whole run sits on the device, and the figures behind the choice."""

    resident: bool
    reason: str
    tokens: int | None = None  # per batch, as planned
    need: int = 0  # device bytes of the resident run at ``tokens`` tokens per batch
    max_tokens: int | None = None  # the most tokens per batch the resident run fits (``None``: streamed)


def choose_tier(
    placement: str,
    layout: Layout,
    module: LightningModule,
    optimizer: Optimizer | None,
    dtype: torch.dtype,
    stored: dict[nn.Parameter, int],
    tokens: int | None,
    budget: int | None,
    logits_built: bool,
) -> Tier:
    """The resident tier when everything plain training puts on the device fits ``budget`` at ``tokens`` tokens per
    batch: parameters, gradients, optimizer state and activations (``planner.plain_training_bytes``); else stream.

    Args:
        stored: element sizes parameters will be stored with, where they differ from now.
        logits_built: the loss builds the full logits (the model's own loss; not the installed one).
    """
    if placement == "stream":
        return Tier(False, "placement='stream'")
    if budget is None:
        return Tier(False, "no device budget (on the CPU, SlideFormerStrategy(device_memory_gib=...) gives one)")
    if tokens is None:
        return Tier(False, "the tokens per batch are unknown (SlideFormerStrategy(tokens_per_batch=...))")
    params = list(dict.fromkeys(module.parameters()))
    copies = dtype.itemsize if dtype != torch.float32 else 0
    fixed = plain_training_bytes(params, optimizer, copies_itemsize=copies, stored=stored)
    blocks = [m for _, m in layout.blocks]
    head = _head(module, layout)
    per_token = plain_activation_bytes(blocks, dtype.itemsize, head.out_features if logits_built and head else 0)
    if not logits_built and head is not None:
        fixed += fused_loss_bytes(tokens, head.out_features, head.in_features)
    need = fixed + int(tokens * per_token)
    room = usable_device_bytes(budget) - fixed
    if need > usable_device_bytes(budget):
        reason = f"plain training would need {need / GIB:.2f} GiB of the {budget / GIB:.2f} GiB budget"
        return Tier(False, reason, tokens)
    most = int(room // per_token) if per_token else None
    return Tier(True, f"{need / GIB:.2f} GiB of the {budget / GIB:.2f} GiB budget", tokens, need, most)


def _head(module: nn.Module, layout: Layout) -> nn.Linear | None:
    # the output head: the widest Linear outside the blocks
    inside = {m for _, b in layout.blocks for m in b.modules()}
    heads = [m for m in module.modules() if isinstance(m, nn.Linear) and m not in inside]
    return max(heads, key=lambda m: m.out_features, default=None)


def tokens_ahead(trainer: Any, given: int | None) -> int | None:
    """Tokens per batch for the plan: ``given``, else the datamodule's ``tokens_per_batch``, else the largest integer
    tensor of the first batch, fetched ahead with Python's and torch's random state put back (the run then draws the
    same batches). ``None`` when there is no batch to look at."""
    if given is not None:
        return given
    if (declared := getattr(trainer.datamodule, "tokens_per_batch", None)) is not None:
        return int(declared)
    loops = {TrainerFn.FITTING: trainer.fit_loop, TrainerFn.VALIDATING: trainer.validate_loop,
             TrainerFn.TESTING: trainer.test_loop, TrainerFn.PREDICTING: trainer.predict_loop}  # fmt: skip
    source = loops[trainer.state.fn]._data_source
    if not source.is_defined():
        return None
    python_state = random.getstate()
    with torch.random.fork_rng(devices=[]):
        loader = source.dataloader()
        loader = loader[0] if isinstance(loader, (list, tuple)) and loader else loader
        try:
            batch = next(iter(loader))
        except (StopIteration, TypeError):
            batch = None
    random.setstate(python_state)
    return _tokens(batch) or None


def check_batch_tokens(batch: Any, most: int) -> None:
    """Refuse a training batch with more tokens than the plan fits (``most``), before it runs out of memory."""
    if (tokens := _tokens(batch)) > most:
        raise ValueError(
            f"This batch has {tokens} tokens, but the placement plan fits at most {most} per batch on the device."
            " Lower the batch size or sequence length (accumulate_grad_batches keeps the tokens per optimizer step),"
            " or give SlideFormerStrategy(tokens_per_batch=...) the largest batch so that the plan counts it."
        )


def _tokens(batch: Any) -> int:
    # the largest integer tensor of a batch (its token ids)
    return max((t.numel() for t in _tensors(batch) if not t.is_floating_point() and t.dim() >= 1), default=0)


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        return [t for item in batch for t in _tensors(item)]
    return []
