"""Helpers for the tests: tiny real Hugging Face models, LightningModules, and a training runner."""

from __future__ import annotations

import copy
import os

import lightning as L
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

import lightning_slide

CUDA = torch.cuda.is_available()
# a user's process: without the tests' Triton interpreter, so the loss runs its torch path on the CPU, as the tests'
# own process does (conftest.py); a subprocess compared with this one bit for bit must take it
USER_ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
VOCAB = 101
SEQ = 12


def tiny_config(family: str = "llama", *, tied: bool = False, layers: int = 4, **overrides):
    """A small config of a real Hugging Face family (more blocks than window slots)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig}[family]
    kwargs = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    if family == "qwen3":
        kwargs["head_dim"] = 8
    kwargs.update(overrides)
    return cls(**kwargs)


class CausalLM(L.LightningModule):
    """The module a user writes: a Hugging Face causal LM, ``labels=ids``, AdamW with two param groups."""

    def __init__(self, config, *, optimizer: str = "adamw", lr: float = 1e-3, scheduler: bool = True):
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_config(config) if config is not None else None  # None: configure_model
        self.optimizer_name, self.lr, self.use_scheduler = optimizer, lr, scheduler
        self.grad_norms: list[float] = []

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def validation_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("val_loss", loss)
        return loss

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.named_parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
        if self.optimizer_name == "adamw":
            opt = torch.optim.AdamW(groups, lr=self.lr)
        elif self.optimizer_name == "adam":
            opt = torch.optim.Adam(groups, lr=self.lr, betas=(0.8, 0.99), amsgrad=True)
        else:
            opt = torch.optim.SGD(groups, lr=self.lr, momentum=0.9, nesterov=True)
        if not self.use_scheduler:
            return opt
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)]


class NaNIntoEmbedding(CausalLM):
    """A causal LM whose embedding output gets a NaN gradient at optimizer step 3."""

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        embeds = self.model.get_input_embeddings()(ids)
        if self.global_step == 3:
            embeds.register_hook(lambda grad: grad * float("nan"))
        return self.model(inputs_embeds=embeds, labels=ids).loss


class StackModel(nn.Module):
    """A plain (non-Hugging Face) model: an embedding, an nn.ModuleList of blocks with dropout, a head."""

    def __init__(self, width: int = 16, depth: int = 5, dropout: float = 0.1):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(), nn.Dropout(dropout),
                          nn.Linear(2 * width, width))
            for _ in range(depth)
        )  # fmt: skip
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.norm(x))


class StackLM(L.LightningModule):
    def __init__(self, **kwargs):
        super().__init__()
        self.net = StackModel(**kwargs)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        logits = self.net(ids)
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

    def validation_step(self, batch, batch_idx):
        loss = self.training_step(batch, batch_idx)
        self.log("val_loss", loss)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.05)


def streamed(**kwargs):
    """The strategy that always streams: on CUDA, "auto" places a test's small model whole on the GPU."""
    return lightning_slide.SlideFormerStrategy(placement="stream", **kwargs)


def token_data(n: int = 16, seq: int = SEQ, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, seq), generator=torch.Generator().manual_seed(seed))


def fit(
    module: L.LightningModule,
    strategy="auto",
    *,
    precision="32-true",
    steps: int = 6,
    batch_size: int = 4,
    accelerator: str = "cpu",
    data: torch.Tensor | None = None,
    seed: int = 7,
    ckpt_path: str | None = None,
    **trainer_kwargs,
):
    """Train a copy of ``module`` and return (its fp32 state dict, the trained copy)."""
    module = copy.deepcopy(module)
    L.seed_everything(seed, verbose=False)
    options = dict(
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )  # fmt: skip
    options.update(trainer_kwargs)
    trainer = L.Trainer(
        strategy=strategy, accelerator=accelerator, devices=1, precision=precision, max_steps=steps, **options
    )
    data = token_data() if data is None else data
    trainer.fit(module, DataLoader(TensorDataset(data), batch_size=batch_size), ckpt_path=ckpt_path)
    state = {k: v.detach().float().cpu().clone() for k, v in module.state_dict().items()}
    return state, module


def max_rel_error(a: dict, b: dict) -> tuple[float, str]:
    """The largest per-tensor relative L2 error between two state dicts, and where.

    Tensors with a norm under 0.1 are measured against 0.1 instead: Qwen2's key bias, for one, has an exact
    gradient of zero (softmax ignores a per-row constant), so Adam turns float noise into its update in every
    implementation; a 1e-5 bound on it is then a 1e-6 absolute bound.
    """
    worst, where = 0.0, ""
    for k in a:
        err = ((a[k] - b[k]).norm() / b[k].norm().clamp_min(0.1)).item()
        if err > worst:
            worst, where = err, k
    return worst, where


def fp32_error(ours: dict, ref: dict, float64_run, tol: float) -> tuple[float, str]:
    """``max_rel_error(ours, ref)`` where that is under ``tol``; else, tensor by tensor, the relative error of ``ours``
    against float64 training (``float64_run()``, run only then) beyond twice plain fp32's own.

    Adam's first steps move a weight by about the learning rate whatever its gradient's size, so on a tensor with
    near-zero gradients fp32's rounding alone shifts the update: Qwen3's up_proj read 4e-5 from float64 with plain
    Lightning on an AMD EPYC host, 3e-6 with ours. The bound on ``ours`` is then the project's bf16 rule, in fp32.
    """
    err, where = max_rel_error(ours, ref)
    if err < tol:
        return err, where
    exact = {k: v.float() for k, v in float64_run().items()}
    worst, where = 0.0, ""
    for k in ours:
        excess = (ours[k] - exact[k]).norm() - 2 * (ref[k] - exact[k]).norm()
        err = (excess / exact[k].norm().clamp_min(0.1)).item()
        if err > worst:
            worst, where = err, k
    return worst, where


def relative_update(a: dict, b: dict, start: dict) -> float:
    """How far ``a`` is from ``b``, relative to how far ``b`` moved from ``start`` (all tensors together)."""
    diff = sum(((a[k] - b[k]) ** 2).sum() for k in start) ** 0.5
    moved = sum(((b[k] - start[k]) ** 2).sum() for k in start) ** 0.5
    return float(diff / moved.clamp_min(1e-12))


def global_error(a: dict, b: dict) -> float:
    return sum(((a[k] - b[k]) ** 2).sum().item() for k in a) ** 0.5


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produced while active, in bytes (Triton's interpreter works on byte
    views of storages, so bytes are comparable across both paths)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def kernel_path(module, path: str, tune) -> str:
    """Run a kernel module's Triton path (under TRITON_INTERPRET=1) or its torch path, for a ``path`` fixture
    (``tune``: the fixture of conftest.py)."""
    import pytest

    if path == "triton" and not module._INTERPRET:
        pytest.skip("the Triton path on CPU tensors needs TRITON_INTERPRET=1")
    tune(module, triton=path == "triton")
    return path


def count_deferred_gathers(monkeypatch) -> list[bool]:
    """Record, for each call of ``EmbeddingRows.apply_deferred``, whether a gather queued a deferred update."""
    from lightning_slide.engine.embedding import EmbeddingRows

    gathers, apply_deferred = [], EmbeddingRows.apply_deferred
    monkeypatch.setattr(EmbeddingRows, "apply_deferred", lambda self, first: gathers.append(
        first is not None and self.deferred is not None) or apply_deferred(self, first))  # fmt: skip
    return gathers


def record_splits(monkeypatch) -> list[tuple[int, bool]]:
    """Record each two-part embedding update a step starts (``rows.RowSplit``): its touched rows, and whether they
    are updated on the device."""
    from lightning_slide.engine.rows import RowSplit

    splits, init = [], RowSplit.__init__

    def recorded(self, param, index, *args, **kwargs):
        splits.append((len(index), kwargs["on_device"]))
        init(self, param, index, *args, **kwargs)

    monkeypatch.setattr(RowSplit, "__init__", recorded)
    return splits
