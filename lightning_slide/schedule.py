"""The update schedule a fit can run, from the trainer's clipping and accumulation and the hooks that read
gradients."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.model_helpers import is_overridden


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
    if on_nonfinite == "skip" and (trainer.gradient_clip_algorithm or "norm") != "norm":
        raise ValueError(
            "on_nonfinite='skip' decides from the global gradient norm, which clipping by value does not compute:"
            " clip by norm (Trainer(gradient_clip_algorithm='norm'), the default) or use on_nonfinite='raise'."
        )
    return schedule


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
