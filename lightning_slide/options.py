"""The strategy's options: each value it cannot take refused with what would do (``check_options``), the choices the
engine carries out, resolved (``EngineOptions``), and the run a plan is made for (``Run``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.optim import Optimizer

from .checkpoint_io import SlideCheckpointIO
from .engine import EngineConfig, SlideEngine, adam_bf16
from .engine.shared_host import SharedHost
from .engine.world import DataParallel
from .models import Layout
from .precision import Storage

SCHEDULES = ("auto", "backward", "forward", "norm-first")
PLACEMENTS = ("auto", "stream")


@dataclass(frozen=True)
class EngineOptions:
    """The strategy's choices that the engine carries out (``SlideFormerStrategy``'s arguments, resolved)."""

    num_slots: int | None  # None: "auto"
    update_schedule: Literal["auto", "backward", "forward", "norm-first"]
    placement: Literal["auto", "stream"]
    on_nonfinite: Literal["raise", "skip"]
    cpu_threads: int | None
    offload_activations: bool | Literal["auto"]
    optimizer_offload: Literal["auto", "cpu", "nvme"]
    optimizer_state: Literal["fp32", "bf16"]
    nvme_path: str | None
    nvme_masters: bool
    config: EngineConfig
    delayed_update: bool = False  # the first blocks' updates a step late (engine/delay.py)
    delay_warmup: int = 1  # exact steps before the delay
    world: DataParallel | None = None  # more than one process: their gradients averaged
    shared: SharedHost | None = None  # more than one process on the node: they hold the state once


@dataclass(frozen=True)
class Run:
    """What a plan is made for: the module and its parts, where and in what dtype it computes, its optimizer, update
    schedule and trainer, the strategy's choices, and the element sizes parameters will be stored with on the host
    where they differ from now."""

    module: LightningModule
    layout: Layout
    device: torch.device
    dtype: torch.dtype
    optimizer: Optimizer | None
    schedule: str
    trainer: Any
    options: EngineOptions
    stored: dict[nn.Parameter, int]


def check_options(
    *, num_slots: Any, update_schedule: Any, on_nonfinite: Any, cpu_threads: Any, attention: Any, fused_ops: Any,
    engine: Any, offload_activations: Any, placement: Any, device_memory_gib: Any, tokens_per_batch: Any,
    half_weights: Any, optimizer_offload: Any, optimizer_state: Any, nvme_masters: Any, nvme_path: str | None,
    delayed_update: Any = False, delay_warmup: Any = 1,
) -> str | None:  # fmt: skip
    """Refuse a value ``SlideFormerStrategy`` cannot take, saying what would do; returns the NVMe directory (``None``:
    the tier is off; the ``SLIDE_NVME_PATH`` environment variable when ``nvme_path`` is unset)."""
    if num_slots != "auto" and (not isinstance(num_slots, int) or num_slots < 2):
        raise ValueError(f"num_slots must be an int >= 2 or 'auto'; got {num_slots!r}.")
    if update_schedule not in SCHEDULES:
        raise ValueError(f"update_schedule must be one of {SCHEDULES}; got {update_schedule!r}.")
    if on_nonfinite not in ("raise", "skip"):
        raise ValueError(f"on_nonfinite must be 'raise' or 'skip'; got {on_nonfinite!r}.")
    if cpu_threads is not None and (not isinstance(cpu_threads, int) or cpu_threads < 1):
        raise ValueError(f"cpu_threads must be a positive int or None; got {cpu_threads!r}.")
    if attention not in ("auto", "slide", "slide_kernel", None):
        raise ValueError(f"attention must be 'auto', 'slide', 'slide_kernel' or None; got {attention!r}.")
    if fused_ops not in (True, False, "auto"):
        raise ValueError(f"fused_ops must be True, False or 'auto'; got {fused_ops!r}.")
    if engine is not None and not isinstance(engine, EngineConfig):
        raise TypeError(f"engine must be a lightning_slide.engine.EngineConfig; got {type(engine).__name__}.")
    if offload_activations not in (True, False, "auto"):
        raise ValueError(f"offload_activations must be True, False or 'auto'; got {offload_activations!r}.")
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}; got {placement!r}.")
    if device_memory_gib is not None and (isinstance(device_memory_gib, bool) or not device_memory_gib > 0):
        raise ValueError(f"device_memory_gib must be a number > 0 or None; got {device_memory_gib!r}.")
    if tokens_per_batch is not None and (not isinstance(tokens_per_batch, int) or tokens_per_batch < 1):
        raise ValueError(f"tokens_per_batch must be a positive int or None; got {tokens_per_batch!r}.")
    if half_weights not in ("fp32_masters", "keep"):
        raise ValueError(f"half_weights must be 'fp32_masters' or 'keep'; got {half_weights!r}.")
    if optimizer_offload not in ("auto", "cpu", "nvme"):
        raise ValueError(f"optimizer_offload must be 'auto', 'cpu' or 'nvme'; got {optimizer_offload!r}.")
    if optimizer_state not in ("fp32", "bf16"):
        raise ValueError(f"optimizer_state must be 'fp32' or 'bf16'; got {optimizer_state!r}.")
    if not isinstance(delayed_update, bool):
        raise ValueError(f"delayed_update must be True or False; got {delayed_update!r}.")
    if not isinstance(delay_warmup, int) or isinstance(delay_warmup, bool) or delay_warmup < 1:
        raise ValueError(f"delay_warmup must be an int >= 1 (the exact steps before the delay); got {delay_warmup!r}.")
    if optimizer_state == "bf16":
        adam_bf16.library()  # built now, or refused with what to do, before anything is allocated
    if nvme_masters and optimizer_offload != "nvme":
        raise ValueError(
            "nvme_masters=True keeps the masters beside Adam's state on disk: set optimizer_offload='nvme' (and"
            f" nvme_path); got optimizer_offload={optimizer_offload!r}."
        )
    nvme_path = nvme_path or os.environ.get("SLIDE_NVME_PATH")
    if optimizer_offload == "nvme" or (optimizer_offload == "auto" and nvme_path):
        return _check_nvme_path(nvme_path)
    return None


def check_streamed(engine: SlideEngine, storage: Storage, checkpoint_io: Any) -> None:
    """Refuse what the streamed tier cannot take of the strategy's other choices."""
    if engine.nvme_path is not None and not isinstance(checkpoint_io, SlideCheckpointIO):
        raise ValueError(
            f"optimizer_offload='nvme' saves checkpoints as directories holding the state files, through"
            f" SlideCheckpointIO; got checkpoint_io={type(checkpoint_io).__name__}. Leave checkpoint_io unset"
            " (or subclass SlideCheckpointIO)."
        )
    if storage.half and not storage.widen and engine.nvme_path is not None:
        raise ValueError(
            f"half_weights='keep' steps {len(storage.half)} parameters in {storage.half[0].dtype}, but the NVMe"
            " tier keeps fp32 optimizer state. Use half_weights='fp32_masters' (the default) or"
            " optimizer_offload='cpu'."
        )


def _check_nvme_path(path: str | None) -> str:
    if path is None:
        raise ValueError(
            "optimizer_offload='nvme' needs a directory on a fast disk: SlideFormerStrategy(nvme_path=...) or the"
            " SLIDE_NVME_PATH environment variable."
        )
    path = os.path.expanduser(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"nvme_path {path!r} does not exist; create the directory first.")
    if not os.path.isdir(path):
        raise NotADirectoryError(f"nvme_path {path!r} is not a directory.")
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(f"nvme_path {path!r} is not writable by this user.")
    return path
