"""``slide export``: a trained checkpoint to a Hugging Face directory (``save_pretrained``: config, safetensors
weights, tokenizer) or, for LoRA runs, a peft adapter directory (or the merged model with ``--merge_lora``).

    slide export --config recipes/quickstart.yaml --ckpt_path lightning_logs/version_0/checkpoints/last.ckpt \\
        --out exported/
"""

from __future__ import annotations

import argparse
import os
from argparse import ArgumentError


def export(args: list[str]) -> None:
    cli = argparse.ArgumentParser(prog="slide export", description=__doc__.split("\n\n")[0])
    cli.add_argument("--config", required=True, help="the run's config.yaml (next to its logs) or its recipe")
    cli.add_argument("--ckpt_path", required=True, help="a Lightning checkpoint of that run")
    cli.add_argument("--out", required=True, help="a new (or empty) directory to write")
    cli.add_argument("--merge_lora", action="store_true", help="LoRA runs: write the merged model, not the adapter")
    opts = cli.parse_args(args)
    if not os.path.isfile(opts.config):
        cli.error(f"--config {opts.config!r}: no such file.")
    if not os.path.exists(opts.ckpt_path):  # a file, or a directory when the optimizer state was on NVMe
        cli.error(f"--ckpt_path {opts.ckpt_path!r}: no such checkpoint.")
    if os.path.exists(opts.out) and (not os.path.isdir(opts.out) or os.listdir(opts.out)):
        cli.error(f"--out {opts.out!r} exists and is not an empty directory; nothing is overwritten.")

    import yaml
    from lightning.pytorch.cli import LightningArgumentParser
    from transformers.utils import logging as hf_logging

    from .checkpoint_io import SlideCheckpointIO
    from .data import TextDataModule
    from .module import CausalLMModule

    with open(opts.config) as f:
        config = yaml.safe_load(f)
    # a recipe, or the config.yaml a run saved next to its logs: only the model and the data are built (no Trainer,
    # so none of its banners)
    parser = LightningArgumentParser(exit_on_error=False)
    parser.add_lightning_class_args(CausalLMModule, "model", subclass_mode=False)
    parser.add_lightning_class_args(TextDataModule, "data", subclass_mode=False)
    try:
        parsed = parser.parse_object({k: config.get(k) or {} for k in ("model", "data")})
    except ArgumentError as err:
        cli.error(f"--config {opts.config!r}: {' '.join(str(err).split())}")
    built = parser.instantiate_classes(parsed)
    module, data = built.model, built.data
    module.configure_model()
    hf_logging.disable_progress_bar()
    # no arbitrary unpickling; mapped, not read: the optimizer state in it is never loaded (masters on NVMe are)
    checkpoint = SlideCheckpointIO.load_weights(opts.ckpt_path)
    module.load_state_dict(checkpoint["state_dict"])
    model = module.model
    if module.lora is not None and opts.merge_lora:
        model = model.merge_and_unload()
    model.save_pretrained(opts.out)  # safetensors; a peft model writes its adapter
    data.load_tokenizer().save_pretrained(opts.out)
    print(f"wrote {opts.out}")
