"""The tokens per batch the plan counts: given, declared by the data module, or read from the first batch
(``tokens_ahead``); a batch beyond the plan refused before it runs (``check_batch_tokens``)."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerFn


def tokens_ahead(trainer: Any, given: int | None) -> int | None:
    """Tokens per batch for the plan: ``given``, else the datamodule's ``tokens_per_batch``, else the largest integer
    tensor of the first batch, fetched ahead with Python's and torch's random state put back (the run then draws the
    same batches). ``None`` when there is no batch to look at."""
    if given is not None:
        return given
    if (declared := getattr(trainer.datamodule, "tokens_per_batch", None)) is not None:
        return int(declared)
    loops = {TrainerFn.FITTING: trainer.fit_loop, TrainerFn.VALIDATING: trainer.validate_loop,
             TrainerFn.TESTING: trainer.test_loop, TrainerFn.PREDICTING: trainer.predict_loop}  # fmt: skip
    source = loops[trainer.state.fn]._data_source
    if not source.is_defined():
        return None
    python_state = random.getstate()
    with torch.random.fork_rng(devices=[]):
        loader = source.dataloader()
        loader = loader[0] if isinstance(loader, (list, tuple)) and loader else loader
        try:
            batch = next(iter(loader))
        except (StopIteration, TypeError):
            batch = None
    random.setstate(python_state)
    return _tokens(batch) or None


def check_batch_tokens(batch: Any, most: int) -> None:
    """Refuse a training batch with more tokens than the plan fits (``most``), before it runs out of memory."""
    if (tokens := _tokens(batch)) > most:
        raise ValueError(
            f"This batch has {tokens} tokens, but the placement plan fits at most {most} per batch on the device."
            " Lower the batch size or sequence length (accumulate_grad_batches keeps the tokens per optimizer step),"
            " or give SlideFormerStrategy(tokens_per_batch=...) the largest batch so that the plan counts it."
        )


def _tokens(batch: Any) -> int:
    # the largest integer tensor of a batch (its token ids)
    return max((t.numel() for t in _tensors(batch) if not t.is_floating_point() and t.dim() >= 1), default=0)


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        return [t for item in batch for t in _tensors(item)]
    return []
