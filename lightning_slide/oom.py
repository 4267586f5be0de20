"""The GPU running out of memory in a step, explained: what the plan put there and what would lower it."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch

_OOM_EXPLAINED = "SlideFormer ran out of GPU memory"


@contextmanager
def explain_oom(strategy: Any) -> Generator[None, None, None]:
    """Around a step's work: an out-of-memory error from inside it gets what ``strategy`` (a ``SlideFormerStrategy``)
    planned and what to change."""
    try:
        yield
    except torch.OutOfMemoryError as err:
        if _OOM_EXPLAINED in str(err):  # by an inner call (the training step runs inside the optimizer step)
            raise
        engine = strategy.engine
        if engine is None and strategy.tier is not None and strategy.tier.resident:
            raise torch.OutOfMemoryError(
                f"{err}\n{_OOM_EXPLAINED}. The plan put the whole model on the GPU ({strategy.tier.reason}), and this"
                " step needed more. SlideFormerStrategy(placement='stream') streams it, or lower the tokens per step"
                " (batch size or sequence length, and use accumulate_grad_batches instead)."
            ) from err
        window = engine.device_bytes() / 2**30 if engine else float("nan")
        offload = "" if engine and engine.offload.blocks else " SlideFormerStrategy(offload_activations=True),"
        slots = engine.num_slots if engine else strategy.num_slots
        raise torch.OutOfMemoryError(
            f"{err}\n{_OOM_EXPLAINED}. Its window of {slots} block slots, the head and"
            f" staging take {window:.2f} GiB; the rest is activations. Lower the tokens per step (batch size or"
            f" sequence length, and use accumulate_grad_batches instead),{offload} or SlideFormerStrategy(num_slots=2)."
            " If much memory is 'reserved but unallocated' above, set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
            " before starting Python."
        ) from err
