"""The one-step-delayed rule in plain Lightning, as a callback (``bench_loss.py``'s ``plain_delayed_rule``).

It shows what the rule itself does to a loss curve, without the strategy: after ``warmup`` exact steps, the first
``blocks`` decoder layers compute step t with their weights of before step t-1's update, and the optimizer updates the
current weights with the gradient so computed (``lightning_slide/engine/delay.py`` documents the same rule).
"""

from __future__ import annotations

import lightning as L
import torch


class DelayedRule(L.Callback):
    def __init__(self, warmup: int = 20, blocks: int | None = None) -> None:
        self.warmup, self.blocks = warmup, blocks
        self.held: dict[torch.nn.Parameter, torch.Tensor] = {}  # the late weights of before the last update
        self.masters: dict[torch.nn.Parameter, torch.Tensor] = {}  # the current weights while the step runs
        self.late: list[torch.nn.Parameter] = []

    def on_fit_start(self, trainer, pl_module) -> None:
        layers = pl_module.model.model.layers
        self.late = [p for layer in layers[: self.blocks] for p in layer.parameters() if p.requires_grad]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step > self.warmup:
            for p in self.late:
                if p not in self.masters:  # the first micro-batch of the step
                    self.masters[p] = p.data.clone()
                    p.data.copy_(self.held[p])

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        for p in self.late:
            current = self.masters.pop(p, None)
            if current is None:
                current = p.data.clone()
            else:
                p.data.copy_(current)
            self.held[p] = current
