"""``CausalLMModule``: a ready-made LightningModule that fine-tunes a Hugging Face causal LM.

The model comes from a hub id or local directory (``from_pretrained``) or from a config (random init). LoRA is
optional (peft). The loss and the validation metrics come from the last hidden states through the fused linear
cross-entropy, so the (tokens x vocabulary) logits are never built — with or without the SlideFormer strategy
(under it, the head's weights are streamed by the engine).

Batches are dicts with ``input_ids`` and ``labels`` (B, S) and optionally ``position_ids`` (packed documents
restart at 0) — what :class:`lightning_slide.data.TextDataModule` yields.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import SumMetric

from .data import _missing_directory
from .engine.machine import available_host_bytes
from .kernels.linear_cross_entropy import fused_linear_cross_entropy


@dataclass
class LoRA:
    """peft LoRA settings (``--model.lora.r 16`` on the command line)."""

    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])

    def __post_init__(self) -> None:
        # here, not when peft wraps the model: that happens after the base's weights are loaded
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"LoRA r must be a positive int; got r={self.r!r}.")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"LoRA dropout must be in [0, 1); got dropout={self.dropout!r}.")
        if not self.target_modules:
            raise ValueError("LoRA target_modules is empty: name the layers to adapt, e.g. ['q_proj', 'v_proj'].")


class CausalLMModule(L.LightningModule):
    """Fine-tune a Hugging Face causal LM.

    Args:
        model: hub id or local directory for ``from_pretrained`` (exclusive with ``config``).
        config: a transformers config as a dict with ``model_type`` (random init), e.g. for tests and benchmarks.
        lora: LoRA settings; ``None`` trains every parameter.
        lr: peak learning rate of AdamW.
        weight_decay: AdamW weight decay, applied to matrices only (not to norms, biases or other vectors).
        betas: AdamW betas.
        warmup_steps: linear warm-up steps, then cosine decay to ``min_lr_ratio * lr`` at the last step.
        min_lr_ratio: the final learning rate as a fraction of ``lr``.
        normalize: ``"batch"``: each micro-batch's loss is its mean over its target tokens (Lightning then averages
            the micro-batches of an accumulation step); ``"step"``: the step's summed token losses are divided by
            the step's total target tokens (every token weighs the same; needs ``step_tokens`` in the batch, as
            :class:`~lightning_slide.TextDataModule` provides).
    """

    def __init__(
        self,
        model: str | None = None,
        config: dict[str, Any] | None = None,
        lora: LoRA | None = None,
        lr: float = 2e-5,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
        min_lr_ratio: float = 0.1,
        normalize: Literal["batch", "step"] = "batch",
    ) -> None:
        super().__init__()
        if (model is None) == (config is None):
            raise ValueError("CausalLMModule needs exactly one of model= (hub id or directory) and config= (a dict).")
        if _missing_directory(model):
            raise FileNotFoundError(f"model={model!r}: no such directory. Give a local model directory or a hub id.")
        if config is not None and "model_type" not in config:
            raise ValueError(f"config= needs a 'model_type' (e.g. 'llama'); got keys {sorted(config)}.")
        if lr <= 0 or warmup_steps < 0 or not 0 <= min_lr_ratio <= 1:
            raise ValueError(
                f"lr must be > 0, warmup_steps >= 0 and 0 <= min_lr_ratio <= 1; got {lr}, {warmup_steps},"
                f" {min_lr_ratio}."
            )
        if weight_decay < 0 or len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise ValueError(
                f"weight_decay must be >= 0 and betas two values in [0, 1); got weight_decay={weight_decay},"
                f" betas={tuple(betas)}."
            )
        if normalize not in ("batch", "step"):
            raise ValueError(f"normalize must be 'batch' or 'step'; got {normalize!r}.")
        self.source, self.config_dict, self.lora = model, config, lora
        self._derived: dict[str, Any] = {}  # the transformers config and a meta-device model, each made once
        if lora is not None:
            _check_lora_targets(self._meta_model(), lora)
        # NOTE: plain data only, so that checkpoints load with torch.load(weights_only=True)
        self.save_hyperparameters(ignore=["lora"])
        self.hparams["lora"] = asdict(lora) if lora is not None else None
        self.lr, self.weight_decay, self.betas = lr, weight_decay, tuple(betas)
        self.warmup_steps, self.min_lr_ratio, self.normalize = warmup_steps, min_lr_ratio, normalize
        self.model: nn.Module | None = None
        self.val_loss, self.val_correct, self.val_tokens = SumMetric(), SumMetric(), SumMetric()

    # ---- the model -----------------------------------------------------------------------------------------------

    def configure_model(self) -> None:
        """Build or load the model. With LoRA under bf16-mixed, a base stored in bf16 loads as bf16 (2 bytes per
        parameter, the values bf16 compute reads), with norms, the embedding and the adapters in fp32; so does a base
        built from a config that says ``dtype: bfloat16``. Likewise, for full fine-tuning with the masters on NVMe
        (``SlideFormerStrategy(nvme_masters=True)``), the blocks' weight matrices load in bf16: their exact fp32
        masters go to disk, and the rest is fp32. A node's processes but its first (data parallel) read no weights:
        they build the model on the meta device and take the first one's weights at setup."""
        if self.model is not None:
            return
        tokenizer = getattr(self.trainer.datamodule, "tokenizer", None) if self._trainer is not None else None
        if tokenizer is not None and (shapes := self._meta_model()) is not None:  # before any weight is loaded
            check_vocab(len(tokenizer), shapes.get_input_embeddings().num_embeddings)
        if not getattr(self.trainer.strategy if self._trainer is not None else None, "loads_weights", True):
            self.configure_meta_model()  # a node's other processes take its first one's weights at setup
            return
        from transformers import AutoModelForCausalLM

        bf16_base = self._bf16_base()
        what = f"Loading {self.source}" if self.source else "Building config="
        _check_ram(self._meta_model(), what, bf16_base, head_fp32=self.lora is None)
        dtype = torch.bfloat16 if bf16_base else torch.float32
        if self.source is not None:
            model = AutoModelForCausalLM.from_pretrained(os.path.expanduser(self.source), dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_config(self._architecture(), dtype=dtype)
        model = self._adapted(model, bf16_base)
        # from_pretrained returns the model in eval mode and Lightning trains in the mode it finds (it only warns):
        # dropout, the model's and LoRA's, would be off. The validation loop switches to eval and back.
        self.model = model.train(self.training)
        self._derived.pop("meta", None)

    def configure_meta_model(self) -> None:
        """The model :meth:`configure_model` would make, on the meta device: its shapes, dtypes and adapters, with no
        weights read and no memory taken (``slide plan``)."""
        from transformers import AutoModelForCausalLM

        config = self._architecture()
        if config is None:
            raise FileNotFoundError(
                f"The config of model={self.source!r} is not reachable from here: give --model.model a local directory"
                " holding its config.json."
            )
        bf16_base = self._bf16_base()
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if bf16_base else torch.float32)
        self.model = self._adapted(model, bf16_base).train(self.training)

    def _bf16_base(self) -> bool:
        # the weights load in bf16 (module docstring of configure_model)
        return (
            self._trainer is not None
            and self.trainer.precision == "bf16-mixed"
            and (self.lora is not None or getattr(self.trainer.strategy, "nvme_masters", False))
            and _stored_dtype(self._architecture()) in (torch.bfloat16, torch.float16)  # bf16 loses nothing
        )

    def _adapted(self, model: nn.Module, bf16_base: bool) -> nn.Module:
        # LoRA's adapters, and fp32 for what is not a frozen (or disk-mastered) block matrix
        if self.lora is not None:
            model = _with_lora(model, self.lora)
        if bf16_base:
            _fp32_except_block_matrices(model, trainable=self.lora is None)
        return model

    def vocab_size(self) -> int | None:
        """The model's vocabulary from its config (no weights loaded), or ``None`` if the config is unreachable."""
        config = self._architecture()
        return config.vocab_size if config is not None else None

    def _architecture(self):
        """The transformers config (no weights), read once; ``None`` if a hub id's config is not reachable."""
        if "config" not in self._derived:
            from transformers import AutoConfig

            try:
                config = (
                    AutoConfig.for_model(**self.config_dict)
                    if self.config_dict is not None
                    else AutoConfig.from_pretrained(os.path.expanduser(self.source))
                )
            except OSError:
                config = None
            self._derived["config"] = config
        return self._derived["config"]

    def _meta_model(self) -> nn.Module | None:
        """The model's modules and parameter shapes on the meta device (no memory); ``None`` without a config."""
        if "meta" not in self._derived:
            from transformers import AutoModelForCausalLM

            config = self._architecture()
            with torch.device("meta"):
                self._derived["meta"] = AutoModelForCausalLM.from_config(config) if config is not None else None
        return self._derived["meta"]

    @property
    def causal_lm(self) -> nn.Module:
        """The transformers ``*ForCausalLM`` (inside the peft wrapper when LoRA is on)."""
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    def token_losses(self, batch: dict[str, Tensor], **options) -> Tensor | tuple[Tensor, Tensor]:
        """The fused cross-entropy of the batch's next-token predictions (``options`` go to the kernel)."""
        lm = self.causal_lm
        hidden = lm.base_model(
            input_ids=batch["input_ids"], position_ids=batch.get("position_ids"), use_cache=False
        ).last_hidden_state
        target = F.pad(batch["labels"], (0, 1), value=-100)[:, 1:].reshape(-1)
        hidden = hidden.reshape(-1, hidden.shape[-1])
        head = lm.get_output_embeddings()
        engine = getattr(self.trainer.strategy, "engine", None) if self._trainer is not None else None
        if engine is not None and engine.head is not None and engine.head.module is head:
            return engine.head_loss(hidden, target, fused_linear_cross_entropy, **options)  # streamed head
        weight = head.weight
        if torch.is_autocast_enabled(hidden.device.type):  # the head's matmuls in the autocast dtype, as nn.Linear
            weight = weight.to(torch.get_autocast_dtype(hidden.device.type))
        return fused_linear_cross_entropy(hidden, weight, target, head.bias, **options)

    # ---- steps ---------------------------------------------------------------------------------------------------

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        if self.normalize == "batch":
            loss = self.token_losses(batch)
            self.log("train/loss", loss, prog_bar=True)
            return loss
        if "step_tokens" not in batch:
            raise ValueError("normalize='step' needs 'step_tokens' in each batch (TextDataModule provides it).")
        total = self.token_losses(batch, reduction="sum")
        self.log("train/loss", total / (batch["labels"][:, 1:] != -100).sum().clamp_min(1), prog_bar=True)
        # Lightning divides each micro-batch's loss by the accumulation count, and data parallel averages the
        # processes' gradients; undo both, so the step's gradient is that of its summed token losses over its token
        # count (``step_tokens`` counts every process's)
        scale = self.trainer.accumulate_grad_batches * self.trainer.world_size
        return total / batch["step_tokens"][0].clamp_min(1) * scale

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        total, correct = self.token_losses(batch, reduction="sum", return_correct=True)
        self.val_loss.update(total.float())
        self.val_correct.update(correct.sum().float())
        self.val_tokens.update((batch["labels"][:, 1:] != -100).sum().float())

    def on_validation_epoch_end(self) -> None:
        tokens = self.val_tokens.compute().clamp_min(1)
        mean = self.val_loss.compute() / tokens
        accuracy = self.val_correct.compute() / tokens
        self.log_dict({"val/loss": mean, "val/perplexity": mean.exp(), "val/accuracy": accuracy}, prog_bar=True)
        for metric in (self.val_loss, self.val_correct, self.val_tokens):
            metric.reset()

    # ---- optimization --------------------------------------------------------------------------------------------

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = self.make_optimizer()
        total = max(1, int(self.trainer.estimated_stepping_batches))
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, _warmup_cosine(self.warmup_steps, total, self.min_lr_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def make_optimizer(self) -> torch.optim.AdamW:
        """AdamW over the trained parameters: weight decay on the matrices, none on the vectors."""
        trainable = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in trainable if p.ndim >= 2], "weight_decay": self.weight_decay},
            {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=self.lr, betas=self.betas)


def _warmup_cosine(warmup: int, total: int, floor: float):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def check_vocab(tokens: int, vocab: int) -> None:
    """Refuse a tokenizer with more tokens than the model's embedding has rows."""
    if tokens > vocab:
        raise ValueError(
            f"The tokenizer has {tokens} tokens but the model's vocabulary has {vocab}: give the model"
            f" vocab_size >= {tokens} (config) or the model's own tokenizer (data.tokenizer)."
        )


def _check_lora_targets(model: nn.Module | None, lora: LoRA) -> None:
    # Before any weights load (and before the CLI writes anything); a hub id whose config is not reachable is
    # checked later, by peft.
    if model is None:
        return
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in lora.target_modules if t not in names]
    if missing:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(
            f"LoRA target_modules {missing} are not modules of this model; its linear layers are {linear}."
        )


def _stored_dtype(config) -> torch.dtype | None:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def _check_ram(model: nn.Module | None, what: str, bf16_base: bool, head_fp32: bool) -> None:
    if model is None:
        return
    fp32 = {model.get_input_embeddings().weight} | ({model.get_output_embeddings().weight} if head_fp32 else set())
    need = sum(p.numel() * (2 if bf16_base and p.dim() >= 2 and p not in fp32 else 4) for p in model.parameters())
    available = available_host_bytes()
    if need > available:
        raise MemoryError(
            f"{what} needs {need / 2**30:.1f} GiB of RAM for its weights"
            f" ({'bf16 base' if bf16_base else 'fp32'}), but only {available / 2**30:.1f} GiB is available. Free RAM,"
            + ("" if bf16_base else " or train LoRA under bf16-mixed (the base then loads in bf16),")
            + " or use a machine with more memory."
        )


def _fp32_except_block_matrices(model: nn.Module, *, trainable: bool) -> None:
    # The blocks' weight matrices stay bf16: frozen (a LoRA base, whose frozen head stays bf16 too) or, if
    # ``trainable``, with their fp32 masters on disk. Norms, the embedding, LoRA's adapters and a trained head: fp32.
    fp32 = {model.get_input_embeddings().weight}
    if trainable:
        fp32.add(model.get_output_embeddings().weight)
    for p in model.parameters():
        if p.dtype != torch.float32 and ((p.requires_grad and not trainable) or p.dim() < 2 or p in fp32):
            p.data = p.data.float()


def _with_lora(model: nn.Module, lora: LoRA) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=list(lora.target_modules), task_type="CAUSAL_LM")  # fmt: skip
    return get_peft_model(model, config)
