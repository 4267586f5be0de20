"""SlideFormerPrecision: bf16 (or fp32) compute over fp32 master weights that never leave the CPU."""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from .engine.shared_host import is_placeholder, placeholder
from .models import Layout

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from .engine import SlideEngine

log = logging.getLogger(__name__)

SUPPORTED_PRECISION = ("bf16-mixed", "32-true")


class SlideFormerPrecision(Precision):
    """The precision plugin of :class:`~lightning_slide.SlideFormerStrategy`.

    ``"bf16-mixed"`` computes like Lightning's bf16-mixed (autocast over fp32 weights): weight matrices travel to
    the GPU as bf16, which is what autocast would cast them to, while vectors (norm weights, biases), the
    embedding rows and the residual stream stay fp32. ``"32-true"`` (Lightning's default) computes in fp32
    throughout. Either way the masters and the optimizer state are fp32 on the CPU; the optimizer's ``step()`` is
    called as in Lightning, and the engine's step hook on it queues the update (``engine/step.py``). Without an engine
    (the resident tier: the whole model on the device) it is Lightning's own precision plugin.

    Args:
        precision: ``"bf16-mixed"`` or ``"32-true"``.
        device: the device type for autocast (``"cuda"`` or ``"cpu"``).
    """

    def __init__(self, precision: Literal["bf16-mixed", "32-true"] = "bf16-mixed", device: str = "cuda") -> None:
        if precision not in SUPPORTED_PRECISION:
            raise ValueError(
                f"SlideFormer supports precision='bf16-mixed' or '32-true'; got {precision!r}."
                " Pass one of them to Trainer(precision=...)."
            )
        self.precision = precision
        self.device = device
        self.engine: SlideEngine | None = None  # set by the strategy

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.precision == "bf16-mixed" else torch.float32

    @classmethod
    def convert(cls, plugin: Precision | None, device: str) -> SlideFormerPrecision:
        """Our plugin for what the Trainer's connector produced from its ``precision`` flag.

        Args:
            plugin: the connector's plugin (``Precision`` for "32-true", ``MixedPrecision`` for the mixed ones).
            device: the accelerator's device type.
        """
        if isinstance(plugin, SlideFormerPrecision):
            return plugin
        if isinstance(plugin, MixedPrecision) and plugin.precision == "bf16-mixed":
            return cls("bf16-mixed", device)
        if type(plugin) is Precision:
            return cls("32-true", device)
        name = getattr(plugin, "precision", type(plugin).__name__)
        raise ValueError(
            f"SlideFormer supports precision='bf16-mixed' or '32-true'; got {name!r}."
            " fp16 needs loss scaling that the CPU optimizer does not do, and 'bf16-true' would drop the fp32"
            " master weights; use 'bf16-mixed'."
        )

    def storage(
        self, layout: Layout, optimizer: Optimizer | None, *, frozen_in_compute_dtype: bool, half_weights: str
    ) -> Storage:
        """What changes dtype on the host before training (the strategy's ``frozen_in_compute_dtype`` and
        ``half_weights``): the frozen matrices of the blocks and the head to the compute dtype, and the trained
        parameters loaded in a half dtype (to fp32 masters with ``"fp32_masters"``)."""
        dtype = self.compute_dtype
        frozen = _frozen_to_store(layout) if frozen_in_compute_dtype and dtype != torch.float32 else []
        half = _half_trained(optimizer) if optimizer is not None else []
        return Storage(dtype, frozen, half, half if half_weights == "fp32_masters" else [])

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.precision != "bf16-mixed":
            yield
            return
        # NOTE: cache_enabled=False, as Lightning's MixedPrecision, so casts match plain bf16-mixed training.
        with torch.autocast(self.device, dtype=torch.bfloat16, cache_enabled=False):
            yield

    @override
    def backward(self, tensor: torch.Tensor, model: pl.LightningModule, optimizer: Any, *args: Any, **kwargs: Any):
        step = self.engine.step if self.engine is not None else None
        if step is None or optimizer is None:
            model.backward(tensor, *args, **kwargs)
            return
        clip = model.trainer.gradient_clip_val
        step.backward(tensor, lambda **extra: model.backward(tensor, *args, **{**kwargs, **extra}),
                      max_norm=float(clip) if clip else None)  # fmt: skip

    @override
    def _wrap_closure(self, model: pl.LightningModule, optimizer: Any, closure: Callable[[], Any]) -> Any:
        if self.engine is None:  # the resident tier: plain training
            return super()._wrap_closure(model, optimizer, closure)
        closure_result = closure()
        step = self.engine.step
        step.grads_ready()  # before the hooks and clipping, which read the gradients
        self._after_closure(model, optimizer)
        step.grads_taken()
        return closure_result

    @override
    def optimizer_step(
        self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        # NOTE: the closure runs here, not inside optimizer.step(closure) as Lightning's default has it: within torch's
        # step wrappers (dynamo disabled) the Python of the forward and backward ran slower (benchmarks/NOTES.md).
        if self.engine is None:
            return super().optimizer_step(optimizer, model, closure, **kwargs)
        self.engine.step.begin(model.trainer.global_step)
        closure_result = self._wrap_closure(model, optimizer, closure)
        optimizer.step(**kwargs)  # its post-hook ends the engine's step (engine/step.py); it finds no param.grad
        return closure_result

    @override
    def clip_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if self.engine is None:
            super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)
            return
        if clip_val <= 0:
            return
        algorithm = "value" if gradient_clip_algorithm == GradClipAlgorithmType.VALUE else "norm"
        self.engine.step.clip(clip_val, algorithm)


@dataclass(frozen=True)
class Storage:
    """The dtypes parameters are stored in on the host for training, where they change
    (``SlideFormerPrecision.storage``).

    Args:
        dtype: the compute dtype.
        frozen: frozen matrices to be stored in it.
        half: trained parameters loaded in a half dtype.
        widen: those of them stepped as fp32 masters (``half_weights="fp32_masters"``; the rest keep their dtype).
    """

    dtype: torch.dtype
    frozen: list[nn.Parameter]
    half: list[nn.Parameter]
    widen: list[nn.Parameter]

    @property
    def sizes(self) -> dict[nn.Parameter, int]:
        """The element sizes the plan counts for the parameters that change."""
        return {**dict.fromkeys(self.frozen, self.dtype.itemsize), **dict.fromkeys(self.widen, 4)}

    def convert(self, *, skip: set[nn.Parameter] = frozenset()) -> None:
        """Store the parameters as counted, but ``skip`` (fp32 masters the engine puts straight on disk)."""
        for p in self.frozen:
            p.data = _converted(p.data, self.dtype)
        if self.half and not self.widen:
            log.info("SlideFormer steps the %d parameters loaded in %s in that dtype, as plain Lightning does"
                     " (half_weights='keep').", len(self.half), self.half[0].dtype)  # fmt: skip
        if self.widen:
            log.info(
                "SlideFormer trains the %d parameters loaded in %s with fp32 master weights made from them (%.2f GiB"
                " more RAM; they stay fp32 after training): the optimizer steps in fp32, and the GPU computes with"
                " bf16 copies under bf16-mixed; half_weights='keep' steps the bf16 values as plain Lightning does.",
                len(self.widen), self.widen[0].dtype, sum(p.numel() for p in self.widen) * 2 / 2**30,
            )  # fmt: skip
        for p in self.widen:
            if p not in skip:
                p.data = _converted(p.data, torch.float32)


def _converted(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # a placeholder (a node's process holding no weights) stays one, in the new dtype
    return placeholder(tensor.shape, dtype) if is_placeholder(tensor) else tensor.to(dtype)


def _half_trained(optimizer: Optimizer) -> list[nn.Parameter]:
    # the trained parameters loaded in a half dtype (a model loaded in bf16)
    params = dict.fromkeys(p for g in optimizer.param_groups for p in g["params"] if p.requires_grad)
    return [p for p in params if p.is_floating_point() and p.dtype != torch.float32]


def _frozen_to_store(layout: Layout) -> list[nn.Parameter]:
    # frozen fp32 matrices of the blocks and the head, to be kept in the compute dtype on the host; the embedding
    # (streamed by fp32 rows) and anything tied to it keep fp32
    keep = set(layout.embedding[1].parameters()) if layout.embedding is not None else set()
    modules = [m for _, m in layout.blocks] + ([layout.head[1]] if layout.head is not None else [])
    params = dict.fromkeys(p for m in modules for p in m.parameters())
    return [p for p in params if not p.requires_grad and p.dim() >= 2 and p.dtype == torch.float32 and p not in keep]
