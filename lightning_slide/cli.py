"""Lightning's CLI for the ``slide`` command (``__main__.py``): over :class:`CausalLMModule` and
:class:`TextDataModule`, with the SlideFormer strategy registered (``strategy: slideformer`` in YAML) and used by
default, the :class:`SlideMonitor` callback (tokens/s, MFU, memory on the progress bar) on, and errors in a few lines.
"""

from __future__ import annotations

import difflib
import inspect
import os
import re
import shlex
import sys
from typing import NoReturn

from jsonargparse import ArgumentParser
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from .display import use_slide_display
from .module import check_vocab
from .monitor import SlideMonitor

COMMANDS = {
    "fit": "train a model (a recipe: --config recipes/<name>.yaml)",
    "validate": "one pass over the validation data",
    "test": "one pass over the test data",
    "predict": "run the model over the prediction data",
    "export": "write a checkpoint as a Hugging Face model directory (or a LoRA adapter)",
    "generate": "continue a prompt with a checkpoint's model, streamed to the terminal",
    "plan": "plan a run's memory and step time from its config alone, no GPU or weights needed",
}


def overview() -> str:
    """What bare ``slide`` and ``slide --help`` print: the commands, one line each."""
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {text}" for name, text in COMMANDS.items()]
    return (
        "usage: slide <command> [options]\n\ncommands:\n"
        + "\n".join(lines)
        + "\n\n`slide <command> --help` for its options.\n"
    )


class SlideParser(LightningArgumentParser):
    """Lightning's parser, without abbreviated options (``--trainer.max_step`` is not ``max_steps``) and with errors
    in at most three lines: what was wrong, the closest valid options, and where to find them all."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error:
            super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        last = parser.prog.split()[-1]
        command = f"slide {last}" if last in COMMANDS else "slide"
        sys.stderr.write("\n".join(short_error(parser, message, command)[:3]) + "\n")
        self.exit(2)


def short_error(parser: ArgumentParser, message: str, command: str) -> list[str]:
    """The lines of a CLI error: the unknown option with the closest known ones, or the value refused and what
    would be accepted."""
    options = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    unknown = re.search(r"unrecognized arguments: (--\S+)", message)
    in_config = re.search(r"does not accept option '([^']+)'", message)
    in_class = re.search(
        r'Parser key "([^"]+)".*class_path \'([\w.]+)\'.*Option \'(\w+)\' is not accepted', message, re.S
    )
    choice = re.search(r"invalid choice: '([^']*)'", message)
    what = "key" if in_config else "option"
    if unknown:
        bad, known = unknown.group(1), options
    elif in_config:
        bad, known = in_config.group(1), [o[2:] for o in options]
    elif in_class:
        key, path, name = in_class.groups()
        bad, known = f"--{key}.{name}", [f"--{key}.{n}" for n in _init_args(path)]
    elif choice:
        return [
            f"slide: no command {choice.group(1)!r}",
            f"commands: {', '.join(COMMANDS)}",
            "`slide --help` says what each does",
        ]
    else:
        return [f"{command}: {_bad_value(message)}", f"`{command} --help` lists every option"]
    close = difflib.get_close_matches(bad, known, n=2, cutoff=0.6)
    hint = f"did you mean {' or '.join(close)}?" if close else f"no {what} is close to it"
    return [f"{command}: unknown {what} {bad}", hint, f"`{command} --help` lists every option"]


def _bad_value(message: str) -> str:
    # jsonargparse's report of a value no type accepts (nested through unions), as "key: value is not T or U"
    keys = list(dict.fromkeys(re.findall(r'Parser key "([^"]+)"', message)))
    value = re.search(r"(?:Given|Got) value: (.*?)\s*$", message, re.M)
    if not keys or value is None:
        return " ".join(line.strip() for line in message.splitlines() if line.strip())
    tail = message[message.rfind(f'Parser key "{keys[-1]}"') :]
    types = re.findall(r"Expected a (.+?)(?:\. Got value: .*)?$", tail, re.M)
    names = [re.sub(r"typing\.Literal\[(.*)\]", r"one of \1", re.sub(r"<class '(?:[\w.]+\.)?(\w+)'>", r"\1", t))
             for t in types]  # fmt: skip
    names = ["null" if n == "NoneType" else n for n in dict.fromkeys(names)]
    return f"{'.'.join(keys)}: {value.group(1)} is not {' or '.join(names) or 'accepted'}"


def reason(err: Exception) -> str:
    """The refusal inside an error jsonargparse wraps around it (its list of the union's failed subtypes)."""
    lines = [line.strip() for line in str(err).splitlines()]
    inner = [line[2:] for line in lines if line.startswith("- ") and not line.startswith("- Expected a")]
    return inner[-1] if inner else next((line for line in lines if line), type(err).__name__)


def _init_args(class_path: str) -> list[str]:
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(__import__(module, fromlist=[name]), name)
    except (ImportError, AttributeError):
        return []
    return [p for p in inspect.signature(cls).parameters if p not in ("self", "args", "kwargs")]


class SlideCLI(LightningCLI):
    """Lightning's CLI, with the checks that need both the model and the data made before anything is written."""

    def instantiate_trainer(self, **kwargs):
        config = self._get(self.config_init, "trainer", default={})
        configured = list(config.get("callbacks") or [])  # before Lightning adds its own to that list
        trainer = super().instantiate_trainer(**kwargs)
        if config.get("logger") in (None, True):
            trainer.loggers = default_loggers(trainer.default_root_dir)
        use_slide_display(trainer, configured)
        return trainer

    def instantiate_classes(self) -> None:
        # a class that refuses its arguments (the strategy, the module, the data) gets the parser's short error; without
        # a subcommand (`slide plan`), the caller reports it
        try:
            super().instantiate_classes()
        except (ValueError, TypeError, OSError, ImportError) as err:
            if self.subcommand is None:
                raise
            self._subcommand_parsers[self.subcommand].error(reason(err))

    def before_fit(self) -> None:
        vocab = self.model.vocab_size()
        if vocab is not None:
            check_vocab(len(self.datamodule.load_tokenizer()), vocab)

    def after_fit(self) -> None:
        hint = export_hint(self.trainer)  # on every process: Trainer.log_dir is a collective
        if self.trainer.is_global_zero:
            print(hint, flush=True)


def export_hint(trainer) -> str:
    """The ``slide export`` command for this run's last checkpoint, alone on its line (or how to get a checkpoint)."""
    callback = trainer.checkpoint_callback
    ckpt = callback and (callback.last_model_path or callback.best_model_path)
    if not ckpt:
        return "no checkpoint was saved; to export the model, train with --trainer.enable_checkpointing true"
    run = trainer.log_dir or trainer.default_root_dir
    paths = [os.path.join(run, "config.yaml"), ckpt, os.path.join(run, "hf")]
    config, ckpt, out = (p if os.path.relpath(p).startswith("..") else os.path.relpath(p) for p in paths)
    words = ["slide", "export", "--config", config, "--ckpt_path", ckpt, "--out", out]
    return "export it with:\n" + shlex.join(words)


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
