"""The ``slide`` command: Lightning's CLI over :class:`CausalLMModule` and :class:`TextDataModule`, with the
SlideFormer strategy registered (``strategy: slideformer`` in YAML) and used by default.

    slide fit --config recipes/quickstart.yaml --trainer.max_steps 20
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

from .data import TextDataModule
from .module import CausalLMModule


def main(args: list[str] | None = None) -> None:
    """Entry point of ``slide`` and ``python -m lightning_slide``."""
    LightningCLI(
        CausalLMModule,
        TextDataModule,
        trainer_defaults={"strategy": "slideformer"},
        save_config_kwargs={"overwrite": True},
        args=args,
    )
