"""Hugging Face's RMSNorm modules, rotary embedding and SwiGLU MLPs switched to the fused kernels for the run.

Each switch is guarded by a probe: the model's own code runs on random inputs (fp32 and bf16, on the CPU) and
must give Llama's formula, else it is left alone. A variant that differs (Gemma's ``1 + weight`` norm, an interleaved
or multimodal rotary, a GELU MLP) keeps its code: the switch never changes what a model computes, only how many
kernels it takes.

- **RMSNorm** (``kernels/norm.py``): a module whose class is named ``...RMSNorm``, with a 1-D ``weight`` and an
  epsilon (``variance_epsilon`` or ``eps``). Its instance's class is swapped for a subclass whose forward calls the
  kernel.
- **Rotary embedding** (``kernels/rotary.py``): the ``apply_rotary_pos_emb(q, k, cos, sin, ...)`` of each modeling
  file the model's modules come from (transformers' attention modules call that module-level function). It is
  replaced there by one that sends the inputs the kernel covers to it and anything else (a partial rotary, extra
  arguments) to the original. Other models of the same family in the process get the same numbers.
- **SwiGLU MLP** (``kernels/swiglu.py``): a module with ``gate_proj``, ``up_proj``, ``down_proj`` and ``act_fn`` whose
  forward computes ``down_proj(silu(gate_proj(x)) * up_proj(x))``; its class is swapped for a subclass whose forward
  takes the gated activation on the kernel (the projections stay the module's own: LoRA layers included).

All are undone when training ends.
"""

from __future__ import annotations

import copy
import inspect
import logging
import sys
from collections.abc import Callable

import torch
from torch import Tensor, nn

from .kernels.norm import rms_norm, rms_norm_ref
from .kernels.rotary import rotary_embedding_ref, rotary_on_kernel, runs_on_kernel
from .kernels.swiglu import swiglu, swiglu_ref

log = logging.getLogger(__name__)
_FUSED: dict[type, type] = {}  # an RMSNorm or MLP class -> its subclass with the fused forward
_ROTARY = "apply_rotary_pos_emb"


def use_fused_ops(model: nn.Module) -> Callable[[], None] | None:
    """Switch the model's qualifying RMSNorm modules, rotary embeddings and MLPs to the kernels (module docstring).

    Returns:
        a function that undoes the switch, or ``None`` if nothing qualified.
    """
    switches = (use_fused_rms_norm(model), use_fused_rotary(model), use_fused_swiglu(model))
    restores = [r for r in switches if r is not None]
    if not restores:
        return None
    return lambda: [restore() for restore in restores]


def _epsilon(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def _fused_forward(self, hidden_states: Tensor) -> Tensor:
    return rms_norm(hidden_states, self.weight, _epsilon(self))


def _close(theirs, ours, dtype: torch.dtype) -> bool:
    if not isinstance(theirs, Tensor) or theirs.dtype != ours.dtype or theirs.shape != ours.shape:
        return False
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    return torch.allclose(theirs.float(), ours.float(), rtol=tolerance, atol=tolerance)


def _norm_follows_llama(module: nn.Module, eps: float) -> bool:
    """Whether the module's own forward computes :func:`rms_norm_ref`, for inputs and weights in fp32 and bf16 and for
    bf16 inputs with an fp32 weight (bf16-mixed, where the output's dtype tells the variants apart)."""
    width = module.weight.shape[0]
    twin = copy.copy(module)  # a CPU twin: the module's weight may be on the meta device or streamed
    generator = torch.Generator().manual_seed(0)
    for dtype, weight_dtype in ((torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.bfloat16, torch.float32)):
        weight = (torch.randn(width, generator=generator) * 0.5 + 1).to(weight_dtype)
        twin._parameters = {**module._parameters, "weight": nn.Parameter(weight, requires_grad=False)}
        x = (torch.randn(2, 3, width, generator=generator) * 3).to(dtype)
        with torch.no_grad():
            try:
                theirs = type(module).forward(twin, x)
            except Exception:  # a forward that wants more than the hidden states
                return False
            if not _close(theirs, rms_norm_ref(x, weight, eps), dtype):
                return False
    return True


def use_fused_rms_norm(model: nn.Module) -> Callable[[], None] | None:
    """Swap the class of each RMSNorm module that passes the probe; returns the undo, or ``None``."""

    def kind(module: nn.Module) -> type | None:
        weight = getattr(module, "weight", None)
        if not type(module).__name__.endswith("RMSNorm") or _epsilon(module) is None:
            return None
        return type(module) if isinstance(weight, nn.Parameter) and weight.dim() == 1 else None

    return _swap_classes(model, kind, lambda m: _norm_follows_llama(m, _epsilon(m)), _fused_forward, "RMSNorm")


def _fused_mlp_forward(self, x: Tensor) -> Tensor:
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


_MLP_PARTS = ("gate_proj", "up_proj", "down_proj", "act_fn")


def _mlp_follows_llama(module: nn.Module) -> bool:
    """Whether the module's own forward computes ``down_proj(silu(gate_proj(x)) * up_proj(x))`` (fp32 and bf16), on
    a CPU twin with small projections of its own (the module's may be on the meta device, streamed, or LoRA layers)."""
    twin = copy.copy(module)
    generator = torch.Generator().manual_seed(0)
    shapes = {"gate_proj": (8, 12), "up_proj": (8, 12), "down_proj": (12, 8)}
    for dtype in (torch.float32, torch.bfloat16):
        projections = {name: nn.Linear(*shape, bias=False, dtype=dtype) for name, shape in shapes.items()}
        for linear in projections.values():
            nn.init.normal_(linear.weight, std=0.5, generator=generator)
        twin._modules = {**module._modules, **projections}
        x = (torch.randn(2, 3, 8, generator=generator) * 2).to(dtype)
        with torch.no_grad():
            try:
                theirs = type(module).forward(twin, x)
            except Exception:  # a forward that wants more than the hidden states
                return False
            ours = twin.down_proj(swiglu_ref(twin.gate_proj(x), twin.up_proj(x)))
            if not _close(theirs, ours, dtype):
                return False
    return True


def use_fused_swiglu(model: nn.Module) -> Callable[[], None] | None:
    """Swap the class of each gated MLP that passes the probe (per class and activation); returns the undo, or
    ``None``."""

    def kind(module: nn.Module) -> tuple[type, type] | None:
        parts = [getattr(module, name, None) for name in _MLP_PARTS]
        return (type(module), type(parts[-1])) if all(isinstance(p, nn.Module) for p in parts) else None

    return _swap_classes(model, kind, _mlp_follows_llama, _fused_mlp_forward, "SwiGLU MLP")


def _swap_classes(model: nn.Module, kind: Callable, probe: Callable, forward: Callable, name: str):
    """Swap the class of each module of a ``kind`` (``None``: not a candidate) whose probe passes (run once per kind)
    for a subclass with ``forward``; returns the undo, or ``None`` if none was swapped."""
    verdicts: dict = {}
    switched: list[tuple[nn.Module, type]] = []
    kept: set[str] = set()
    for module in model.modules():
        cls = type(module)
        key = kind(module) if cls not in _FUSED.values() else None
        if key is None:
            continue
        if key not in verdicts:
            verdicts[key] = probe(module)
        if verdicts[key]:
            module.__class__ = _FUSED.setdefault(cls, type(cls.__name__, (cls,), {"forward": forward}))
            switched.append((module, cls))
        else:
            kept.add(cls.__name__)
    if kept:
        log.info("SlideFormer keeps the forward of %s: not Llama's %s formula.", ", ".join(sorted(kept)), name)
    if not switched:
        return None
    log.info("SlideFormer runs %d %s modules on the fused kernel.", len(switched), name)

    def restore() -> None:
        for module, cls in switched:
            module.__class__ = cls

    return restore


def _rotary_default_dims(function: Callable) -> tuple[int, ...]:
    """The ``unsqueeze_dim`` defaults ``function`` may have: its own if it is ``(q, k, cos, sin, <optional arguments,
    unsqueeze_dim among them>)``; both layouts if it hides its parameters behind ``(*args, **kwargs)`` (Hugging Face's
    ``kernels`` wraps transformers' functions so), for the probe to tell; none otherwise."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return ()
    if [p.kind for p in parameters] == [inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]:
        return (1, 2)
    if [p.name for p in parameters[:4]] != ["q", "k", "cos", "sin"]:
        return ()
    if any(p.default is inspect.Parameter.empty for p in parameters[4:] if p.kind is not p.VAR_KEYWORD):
        return ()
    dims = [p.default for p in parameters if p.name == "unsqueeze_dim"]
    return (dims[0],) if dims and dims[0] in (1, 2) else ()


def _rotary_follows_llama(function: Callable, dim: int) -> bool:
    """Whether ``function(q, k, cos, sin)`` computes :func:`rotary_embedding_ref` of each (fp32 and bf16 inputs)."""
    generator = torch.Generator().manual_seed(0)
    heads_first = dim == 1
    for dtype in (torch.float32, torch.bfloat16):
        q, k = ((torch.randn(2, 5, h, 8, generator=generator)).to(dtype) for h in (4, 2))
        if heads_first:
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        cos, sin = (torch.randn(2, 5, 8, generator=generator) for _ in range(2))
        with torch.no_grad():
            try:
                theirs = function(q, k, cos, sin)
            except Exception:
                return False
            if not isinstance(theirs, tuple) or len(theirs) != 2:
                return False
            if not all(
                _close(t, rotary_embedding_ref(x, cos, sin, dim), dtype) for t, x in zip(theirs, (q, k), strict=True)
            ):
                return False
    return True


def _llama_rotary_dim(function: Callable) -> int | None:
    """The ``unsqueeze_dim`` default under which ``function`` computes Llama's rotary embedding, or ``None``."""
    return next((dim for dim in _rotary_default_dims(function) if _rotary_follows_llama(function, dim)), None)


def _fused_rotary(original: Callable, dim: int) -> Callable:
    def apply_rotary_pos_emb(q, k, cos, sin, *args, unsqueeze_dim=dim, **kwargs):
        if args or kwargs or not all(runs_on_kernel(x, cos, sin, unsqueeze_dim) for x in (q, k)):
            return original(q, k, cos, sin, *args, unsqueeze_dim=unsqueeze_dim, **kwargs)
        return rotary_on_kernel(q, cos, sin, unsqueeze_dim), rotary_on_kernel(k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb.original = original
    return apply_rotary_pos_emb


def use_fused_rotary(model: nn.Module) -> Callable[[], None] | None:
    """Replace ``apply_rotary_pos_emb`` in the model's modeling files where it passes the probe; returns the undo, or
    ``None``."""
    files = {sys.modules.get(type(m).__module__) for m in model.modules()}
    switched = []
    for file in files:
        original = getattr(file, _ROTARY, None)
        if not callable(original) or hasattr(original, "original"):
            continue
        dim = _llama_rotary_dim(original)
        if dim is not None:
            setattr(file, _ROTARY, _fused_rotary(original, dim))
            switched.append((file, original))
        else:
            log.info("SlideFormer keeps %s.%s: not Llama's rotary formula.", file.__name__, _ROTARY)
    if not switched:
        return None
    log.info(
        "SlideFormer runs the rotary embedding of %s on the fused kernel.", ", ".join(f.__name__ for f, _ in switched)
    )

    def restore() -> None:
        for file, original in switched:
            setattr(file, _ROTARY, original)

    return restore
