"""SlideFormerPrecision: bf16 (or fp32) compute over fp32 master weights that never leave the CPU."""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from typing_extensions import override

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from .engine import SlideEngine

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
