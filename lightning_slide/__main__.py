"""The ``slide`` command (and ``python -m lightning_slide``): Lightning's CLI for fit, validate, test and predict
(``cli.py``), and the commands of its own.

    slide fit --config recipes/quickstart.yaml --trainer.max_steps 20
    slide export --config recipes/quickstart.yaml --ckpt_path <checkpoint> --out <directory>     # export.py
    slide generate --config <run>/config.yaml --ckpt_path <checkpoint> --prompt "seven plus five is"   # generate.py
    slide plan --config recipes/llama3_1_8b_full.yaml --gpu-memory 24 --host-memory 128   # plan_command.py
"""

from __future__ import annotations

import os
import sys

import torch

from .checkpoint_io import CheckpointError
from .cli import COMMANDS, SlideCLI, SlideParser, overview, trainer_defaults
from .data import TextDataModule
from .engine import BoundaryError, PinnedMemoryError
from .export import export
from .generate import generate
from .module import CausalLMModule
from .plan_command import plan

# what the package raises for what a user gave it (a file, a model, a machine): its message is the whole report
REPORTED = (ValueError, TypeError, OSError, ImportError, MemoryError, FloatingPointError, torch.OutOfMemoryError,
            BoundaryError, PinnedMemoryError, CheckpointError)  # fmt: skip
PACKAGE = os.path.dirname(os.path.abspath(__file__))


def main(args: list[str] | None = None) -> None:
    """Entry point of ``slide`` and ``python -m lightning_slide``."""
    argv = sys.argv[1:] if args is None else args
    if not argv or argv[0] in ("-h", "--help"):
        (sys.stdout if argv else sys.stderr).write(overview())
        sys.exit(0 if argv else 2)
    command = f"slide {argv[0]}" if argv[0] in COMMANDS else "slide"
    try:
        _run(argv, args)
    except REPORTED as err:
        if not _raised_by_the_package(err):
            raise
        sys.stderr.write(f"{command}: {err}\n")
        sys.exit(1)


def _run(argv: list[str], args: list[str] | None) -> None:
    if argv[0] == "export":
        export(argv[1:])
    elif argv[0] == "generate":
        generate(argv[1:])
    elif argv[0] == "plan":
        sys.exit(plan(argv[1:]))
    else:
        SlideCLI(
            CausalLMModule,
            TextDataModule,
            trainer_defaults=trainer_defaults(),
            save_config_kwargs={"overwrite": True},
            parser_class=SlideParser,
            args=args,
        )


def _raised_by_the_package(err: BaseException) -> bool:
    # a refusal the package raised itself (its message says what to change), not an error inside another library
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(PACKAGE + os.sep)


if __name__ == "__main__":
    main()
