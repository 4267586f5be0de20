"""``SlideMonitor``: what a run is doing, on the progress bar and in the loggers — tokens/s, model FLOPs
utilization, GPU and host memory — and a start-up summary of the run's settings and memory.

MFU counts the model's useful FLOPs, ``6 N`` per token for N parameters plus causal attention
(``6 L d S`` per token for L layers of width d at sequence length S), not the engine's recompute, against the
GPU's dense bf16 peak. The peaks are looked up by device name (Lightning's own table does not recognise
"NVIDIA H200", and lists its sparse figure).
"""

from __future__ import annotations

import resource
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info

from .display import count_text
from .engine.machine import size_text

GIB = 2**30
# dense bf16 tensor-core peaks (FLOP/s), most specific names first
DENSE_BF16_PEAKS = (
    ("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12), ("B200", 2250e12),
    ("A100", 312e12), ("L40S", 362e12), ("L40", 181e12), ("L4", 121e12), ("A10G", 70e12), ("A10", 125e12),
    ("RTX 4090", 165e12), ("RTX 3090", 71e12), ("RTX 6000 Ada", 364e12),
)  # fmt: skip


def dense_bf16_peak(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU by its name (``torch.cuda.get_device_name``), or ``None`` if unknown."""
    for key, peak in DENSE_BF16_PEAKS:
        if key in device_name:
            return peak
    return None


def flops_per_token(module: torch.nn.Module) -> tuple[float, float]:
    """``(6 N, 6 L d)`` for a transformers model inside ``module``: a token at sequence length S costs
    ``6 N + 6 L d S`` FLOPs (forward and backward, causal attention)."""
    n = sum(p.numel() for p in module.parameters())
    config = next((m.config for m in module.modules() if hasattr(m, "config") and hasattr(m.config, "hidden_size")),
                  None)  # fmt: skip
    return 6 * n, 6 * config.num_hidden_layers * config.hidden_size if config is not None else 0


def _tokens(batch: Any) -> tuple[int, int]:
    """Tokens in a batch and its sequence length: the first integer tensor (the input ids)."""
    tensors = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else [batch]
    for t in tensors:
        if isinstance(t, torch.Tensor) and not t.is_floating_point():
            return t.numel(), t.shape[-1]
    return 0, 0


def _host_gib() -> float:
    """Resident memory of the process now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / GIB


class SlideMonitor(L.Callback):
    """Logs ``perf/tokens_per_s``, ``perf/mfu`` (known GPUs), ``mem/gpu_peak_gib`` and ``mem/host_gib`` every
    optimizer step (on the progress bar too), and prints a summary of the run when training starts."""

    def __init__(self) -> None:
        self._start: float | None = None
        self._tokens = 0
        self._seq_len = 0
        self._peak: float | None = None  # dense bf16 FLOP/s of the GPU (None: unknown, or no GPU)
        self._flops = (0.0, 0.0)

    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        params = list(module.parameters())
        trainable = sum(p.numel() for p in params if p.requires_grad)
        strategy = trainer.strategy
        lines = [
            f"model: {count_text(sum(p.numel() for p in params))} parameters, {count_text(trainable)} trainable",
            f"strategy: {type(strategy).__name__}, precision {trainer.precision}, device {strategy.root_device}",
        ]
        engine = getattr(strategy, "engine", None)
        if engine is not None:
            lines.append(
                f"window: {engine.num_slots} slots for {len(engine.blocks)} blocks, update schedule"
                f" '{engine.schedule}', {engine.device_bytes() / GIB:.2f} GiB of device weights and staging"
            )
        if (plan := getattr(strategy, "plan", None)) is not None:
            lines += plan.table().splitlines()
        host_params = sum(p.numel() * p.element_size() for p in params)
        lines.append(f"host: {size_text(host_params)} of parameters, {_host_gib():.2f} GiB resident now")
        rank_zero_info("SlideFormer run\n  " + "\n  ".join(lines))
        # what MFU needs, once: the model's FLOPs per token and the GPU's peak
        device = strategy.root_device
        self._peak = dense_bf16_peak(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
        self._flops = flops_per_token(module)

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._start is None:  # then from one step's end to the next: data loading counts, as the user sees it
            self._start = time.perf_counter()
        tokens, self._seq_len = _tokens(batch)
        self._tokens += tokens

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return  # mid-accumulation: measure whole optimizer steps
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - self._start
        rate = self._tokens / elapsed
        metrics = {"perf/tokens_per_s": rate}
        if device.type == "cuda":
            metrics["mem/gpu_peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        if self._peak is not None:
            dense, attention = self._flops
            metrics["perf/mfu"] = rate * (dense + attention * self._seq_len) / self._peak
        metrics["mem/host_gib"] = _host_gib()
        module.log_dict(metrics, prog_bar=True, on_step=True, on_epoch=False)
        self._start, self._tokens = time.perf_counter(), 0
