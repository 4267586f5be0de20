"""``slide export``: a trained checkpoint to a Hugging Face directory (``save_pretrained``: config, safetensors
weights, tokenizer) or, for LoRA runs, a peft adapter directory (or the merged model with ``--merge_lora``).

    slide export --config recipes/quickstart.yaml --ckpt_path lightning_logs/version_0/checkpoints/last.ckpt \\
        --out exported/
"""

from __future__ import annotations

import argparse
import os
from argparse import ArgumentError


def run_arguments(prog: str, description: str) -> argparse.ArgumentParser:
    """The options of a command that reads a trained run: its config and a checkpoint."""
    cli = argparse.ArgumentParser(prog=prog, description=description)
    cli.add_argument("--config", required=True, help="the run's config.yaml (next to its logs) or its recipe")
    cli.add_argument("--ckpt_path", required=True, help="a Lightning checkpoint of that run")
    return cli


def load_run(cli: argparse.ArgumentParser, config_path: str, ckpt_path: str):
    """The run's module with the checkpoint's weights, and its tokenizer; bad paths and configs end in
    ``cli.error``. Only the model and the data are built from the config (no Trainer, so none of its banners)."""
    if not os.path.isfile(config_path):
        cli.error(f"--config {config_path!r}: no such file.")
    if not os.path.exists(ckpt_path):  # a file, or a directory when the optimizer state was on NVMe
        cli.error(f"--ckpt_path {ckpt_path!r}: no such checkpoint.")

    import yaml
    from lightning.pytorch.cli import LightningArgumentParser
    from transformers.utils import logging as hf_logging

    from .checkpoint_io import SlideCheckpointIO
    from .data import TextDataModule
    from .module import CausalLMModule

    with open(config_path) as f:
        config = yaml.safe_load(f)
    parser = LightningArgumentParser(exit_on_error=False)
    parser.add_lightning_class_args(CausalLMModule, "model", subclass_mode=False)
    parser.add_lightning_class_args(TextDataModule, "data", subclass_mode=False)
    try:
        parsed = parser.parse_object({k: config.get(k) or {} for k in ("model", "data")})
    except ArgumentError as err:
        cli.error(f"--config {config_path!r}: {' '.join(str(err).split())}")
    built = parser.instantiate_classes(parsed)
    module, data = built.model, built.data
    module.configure_model()
    hf_logging.disable_progress_bar()
    # no arbitrary unpickling; mapped, not read: the optimizer state in it is never loaded (masters on NVMe are)
    module.load_state_dict(SlideCheckpointIO.load_weights(ckpt_path)["state_dict"])
    return module, data.load_tokenizer()


def export(args: list[str]) -> None:
    cli = run_arguments("slide export", __doc__.split("\n\n")[0])
    cli.add_argument("--out", required=True, help="a new (or empty) directory to write")
    cli.add_argument("--merge_lora", action="store_true", help="LoRA runs: write the merged model, not the adapter")
    opts = cli.parse_args(args)
    if os.path.exists(opts.out) and (not os.path.isdir(opts.out) or os.listdir(opts.out)):
        cli.error(f"--out {opts.out!r} exists and is not an empty directory; nothing is overwritten.")
    module, tokenizer = load_run(cli, opts.config, opts.ckpt_path)
    model = module.model
    if module.lora is not None and opts.merge_lora:
        model = model.merge_and_unload()
    model.save_pretrained(opts.out)  # safetensors; a peft model writes its adapter
    tokenizer.save_pretrained(opts.out)
    print(f"wrote {opts.out}")
