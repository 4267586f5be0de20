"""The ``slide`` command: Lightning's CLI over :class:`CausalLMModule` and :class:`TextDataModule`, with the
SlideFormer strategy registered (``strategy: slideformer`` in YAML) and used by default, and the
:class:`SlideMonitor` callback (tokens/s, MFU, memory on the progress bar) on.

    slide fit --config recipes/quickstart.yaml --trainer.max_steps 20
    slide export --config recipes/quickstart.yaml --ckpt_path <checkpoint> --out <directory>
    slide plan --config recipes/llama3_1_8b_full.yaml --gpu-memory 24 --host-memory 128   # plan_command.py
"""

from __future__ import annotations

import sys

from lightning.pytorch.cli import LightningCLI

from .data import TextDataModule
from .module import CausalLMModule, check_vocab
from .monitor import SlideMonitor


class SlideCLI(LightningCLI):
    """Lightning's CLI, with the checks that need both the model and the data made before anything is written."""

    def instantiate_trainer(self, **kwargs):
        trainer = super().instantiate_trainer(**kwargs)
        if self._get(self.config_init, "trainer", default={}).get("logger") in (None, True):
            trainer.loggers = default_loggers(trainer.default_root_dir)
        return trainer

    def before_fit(self) -> None:
        vocab = self.model.vocab_size()
        if vocab is not None:
            check_vocab(len(self.datamodule.load_tokenizer()), vocab)


def trainer_defaults() -> dict:
    """The command's Trainer defaults: the strategy, and the monitor on the progress bar."""
    return {"strategy": "slideformer", "callbacks": [SlideMonitor()]}


def default_loggers(root: str) -> list:
    """Lightning's logger default picks one; the command logs to CSV, and to TensorBoard too when installed (one
    ``lightning_logs/version_N`` directory for both)."""
    from lightning.fabric.loggers.tensorboard import _TENSORBOARD_AVAILABLE, _TENSORBOARDX_AVAILABLE
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    csv = CSVLogger(save_dir=root)
    if not (_TENSORBOARD_AVAILABLE or _TENSORBOARDX_AVAILABLE):
        return [csv]
    return [csv, TensorBoardLogger(save_dir=root, version=csv.version)]


def main(args: list[str] | None = None) -> None:
    """Entry point of ``slide`` and ``python -m lightning_slide``."""
    argv = sys.argv[1:] if args is None else args
    if argv[:1] == ["export"]:
        from .export import export

        export(argv[1:])
        return
    if argv[:1] == ["plan"]:
        from .plan_command import plan

        sys.exit(plan(argv[1:]))
    SlideCLI(
        CausalLMModule,
        TextDataModule,
        trainer_defaults=trainer_defaults(),
        save_config_kwargs={"overwrite": True},
        args=args,
    )
