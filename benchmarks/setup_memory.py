"""The host memory a node's processes take while the strategy sets up (CPU, gloo; needs a quiet machine): how far the
machine's available memory falls below what it was with the model loaded, from then until the first training batch.
It checks the plan's transient for the move of the masters into the memory the processes share (``plan_host``).

The module is the README's plain LightningModule loading a Llama shape (``--hidden``, ``--layers``) in fp32, its
weights read only where ``strategy.loads_weights`` (the meta device elsewhere); AdamW; the state in RAM.

    python benchmarks/setup_memory.py --devices 2 --hidden 2048 --layers 16
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_slide import SlideFormerStrategy


def available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))


class Model(L.LightningModule):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config, self.model = config, None
        self.lowest = self.loaded = None

    def configure_model(self):
        if self.model is not None:
            return
        if getattr(self.trainer.strategy, "loads_weights", True):
            self.model = LlamaForCausalLM(self.config)
        else:
            with torch.device("meta"):
                self.model = LlamaForCausalLM(self.config)
        self.loaded, self.lowest = available(), [available()]  # from here on, sampled
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self):
        while self.lowest is not None:
            self.lowest[0] = min(self.lowest[0], available())
            time.sleep(0.002)

    def on_train_batch_start(self, batch, batch_idx):
        if batch_idx == 0 and self.global_rank == 0:
            low, self.lowest = self.lowest[0], None
            params = sum(p.numel() for p in self.model.parameters())
            unit = sum(p.numel() for p in self.model.model.layers[0].parameters())
            head = self.model.lm_head.weight.numel()
            print(f"fp32 model {params * 4 / 2**30:.2f} GiB, a block {unit * 4 / 2**30:.2f} GiB, the head"
                  f" {head * 4 / 2**30:.2f} GiB; available fell {(self.loaded - low) / 2**30:.2f} GiB below its"
                  " figure with the model loaded, as the strategy set up", flush=True)  # fmt: skip

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-5)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=args.hidden // 128, num_key_value_heads=args.hidden // 128,
                         vocab_size=args.vocab)  # fmt: skip
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(strategy=SlideFormerStrategy(optimizer_offload="cpu"), accelerator="cpu", devices=args.devices,
                        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    ids = torch.randint(0, args.vocab, (2, 16))
    trainer.fit(Model(config), DataLoader(TensorDataset(ids), batch_size=1))
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"devices {args.devices}, hidden {args.hidden}, layers {args.layers}")


if __name__ == "__main__":
    main()
