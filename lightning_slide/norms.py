"""Hugging Face RMSNorm modules switched to the fused kernel (``kernels/norm.py``) for the run.

A module qualifies when its class is named ``...RMSNorm``, it has a 1-D ``weight`` and an epsilon (``variance_epsilon``
or ``eps``), and its own forward gives Llama's formula on a probe: random inputs and weights, in fp32 and in bf16, on
the CPU. A variant that differs (Gemma's ``1 + weight``, a norm without the rounding step) fails the probe and keeps
its forward: the switch never changes what a model computes, only how many kernels it takes. The instance's class is
swapped for a subclass whose forward calls the kernel, and swapped back when training ends.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable

import torch
from torch import Tensor, nn

from .kernels.norm import rms_norm, rms_norm_ref

log = logging.getLogger(__name__)
_FUSED: dict[type, type] = {}  # a module class -> its subclass with the fused forward


def _epsilon(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def _fused_forward(self, hidden_states: Tensor) -> Tensor:
    return rms_norm(hidden_states, self.weight, _epsilon(self))


def _follows_llama(module: nn.Module, eps: float) -> bool:
    """Whether the module's own forward computes :func:`rms_norm_ref` (the probe in the module docstring)."""
    width = module.weight.shape[0]
    twin = copy.copy(module)  # a CPU twin: the module's weight may be on the meta device or streamed
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        weight = (torch.randn(width, generator=generator) * 0.5 + 1).to(dtype)
        twin._parameters = {**module._parameters, "weight": nn.Parameter(weight, requires_grad=False)}
        x = (torch.randn(2, 3, width, generator=generator) * 3).to(dtype)
        with torch.no_grad():
            try:
                theirs = type(module).forward(twin, x)
            except Exception:  # a forward that wants more than the hidden states
                return False
            ours = rms_norm_ref(x, weight, eps)
        if not isinstance(theirs, Tensor) or theirs.dtype != ours.dtype or theirs.shape != ours.shape:
            return False
        tolerance = 1e-6 if dtype == torch.float32 else 1e-2
        if not torch.allclose(theirs.float(), ours.float(), rtol=tolerance, atol=tolerance):
            return False
    return True


def use_fused_rms_norm(model: nn.Module) -> Callable[[], None] | None:
    """Switch the model's qualifying RMSNorm modules to the kernel (module docstring).

    Returns:
        a function that restores their forwards, or ``None`` if no module qualified.
    """
    verdicts: dict[type, bool] = {}
    switched: list[tuple[nn.Module, type]] = []
    for module in model.modules():
        cls = type(module)
        weight, eps = getattr(module, "weight", None), _epsilon(module)
        if not cls.__name__.endswith("RMSNorm") or not isinstance(weight, nn.Parameter) or weight.dim() != 1:
            continue
        if eps is None or cls in _FUSED.values():
            continue
        if cls not in verdicts:
            verdicts[cls] = _follows_llama(module, eps)
        if verdicts[cls]:
            fused = _FUSED.setdefault(cls, type(cls.__name__, (cls,), {"forward": _fused_forward}))
            module.__class__ = fused
            switched.append((module, cls))
    kept = sorted(cls.__name__ for cls, ok in verdicts.items() if not ok)
    if kept:
        log.info("SlideFormer keeps the forward of %s: not Llama's RMSNorm formula.", ", ".join(kept))
    if not switched:
        return None
    log.info("SlideFormer runs %d RMSNorm modules on the fused kernel.", len(switched))

    def restore() -> None:
        for module, cls in switched:
            module.__class__ = cls

    return restore
