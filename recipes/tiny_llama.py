"""A small offline training run with the SlideFormer strategy: a tiny Llama (random init from a config) learns a
synthetic token pattern. Runs on a GPU if there is one, else on the CPU, in well under a minute.

    python recipes/tiny_llama.py            # add --steps 200, --layers 8, --slots 2 ...
"""

import argparse

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoModelForCausalLM, LlamaConfig

import lightning_slide  # noqa: F401  (registers strategy="slideformer")


class TinyLM(L.LightningModule):
    def __init__(self, layers: int, vocab: int, lr: float = 3e-3):
        super().__init__()
        config = LlamaConfig(
            hidden_size=64, intermediate_size=172, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=256,
        )  # fmt: skip
        self.model = AutoModelForCausalLM.from_config(config)
        self.lr = lr
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss  # no full logits: the strategy installs a fused loss
        self.log("loss", loss, prog_bar=True)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


def pattern_data(n: int, seq: int, vocab: int) -> torch.Tensor:
    """Sequences that follow t[i+1] = (5 * t[i] + 3) mod vocab from a random start: learnable, offline."""
    start = torch.randint(0, vocab, (n, 1), generator=torch.Generator().manual_seed(0))
    out = start.expand(n, seq).clone()
    for i in range(1, seq):
        out[:, i] = (5 * out[:, i - 1] + 3) % vocab
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--slots", type=int, default=2, help="GPU window slots (fewer than layers: blocks slide)")
    args = parser.parse_args()

    L.seed_everything(0)
    vocab = 512
    module = TinyLM(args.layers, vocab)
    data = DataLoader(TensorDataset(pattern_data(512, 64, vocab)), batch_size=8, shuffle=True)
    trainer = L.Trainer(
        strategy=lightning_slide.SlideFormerStrategy(num_slots=args.slots),
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        log_every_n_steps=10,
    )
    trainer.fit(module, data)
    first, last = module.losses[0], module.losses[-1]
    print(f"loss: first step {first:.3f} -> last step {last:.3f} after {len(module.losses)} steps")


if __name__ == "__main__":
    main()
