"""Kept attention: a streamed block's forward keeps its attention outputs, so that its backward's replay
(``functions.py``) skips the attention's forward.

The replay rebuilds the attention's inputs (q, k, v) with the same bits as the forward did; the attention's backward
needs those, its output and its softmax statistics (the lse). The forward keeps the output and the statistics, the
replay hands them to the kernel's backward, and the gradients are the ones the full replay gives. The idea is
torchtitan's selective activation checkpointing, which saves the attention ops' outputs for the same reason: at long
sequences they cost the most flops per byte kept.

The attention function asks :func:`through` how to run a call: ``None`` outside a recording or replaying block.
Kept outputs take device memory: a block keeps them where its inputs stay on the device and the room left beside
those inputs and one block at work (``planner.kept_room``), and by the placement plan, takes them; decided block by
block at the first training forward. One forward and its backward run at a time (the backward may run on
autograd's device thread), so the block being run is a module global, not a thread's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch import Tensor
from torch.autograd import Function

from ..kernels.attention import FlashAttentionFunction
from .units import Unit

log = logging.getLogger(__name__)

Record = tuple[Tensor, tuple[Tensor | None, ...]]  # one attention call's output and its statistics
_running: Callable[..., Tensor] | None = None  # how the running block's attention calls run (``through``)


def through() -> Callable[..., Tensor] | None:
    """``run(kernel, q, k, v) -> output`` while a block records or replays its attention calls, else ``None``.
    ``kernel`` has ``forward(q, k, v) -> (output, statistics)`` and ``backward(q, k, v, output, statistics, dout)
    -> (dq, dk, dv)``."""
    return _running


@contextmanager
def _running_as(run: Callable[..., Tensor]) -> Iterator[None]:
    global _running
    _running = run
    try:
        yield
    finally:
        _running = None


class KeptAttention:
    """Which streamed blocks keep their attention outputs from forward to backward.

    Args:
        enabled: ``EngineConfig.keep_attention``.
        blocks: the streamed blocks.
    """

    def __init__(self, enabled: bool, blocks: list[Unit]) -> None:
        self.enabled = enabled
        self.blocks = set(blocks)
        self.room: int | None = None  # device bytes they may take (None: no bound, off CUDA); set by the engine
        self.planned_room: int | None = None  # what the placement plan left of the device, where one was made
        self.keeps: dict[Unit, bool] = {}  # decided at each block's first training forward
        self.used = 0

    @contextmanager
    def recording(self, unit: Unit, offloaded: bool) -> Iterator[list[Record] | None]:
        """While active, ``unit``'s attention calls keep their outputs in the list it yields (``None``: they do not;
        an offloaded block's inputs leave the device, and so would these)."""
        if not self.enabled or offloaded or unit not in self.blocks or self.keeps.get(unit) is False:
            yield None
            return
        records: list[Record] = []
        with _running_as(lambda kernel, q, k, v: FlashAttentionFunction.apply(_Recording(kernel, records), q, k, v)):
            yield records

    def keep(self, unit: Unit, records: list[Record] | None) -> list[Record] | None:
        """``records`` where ``unit`` keeps them (the first time, where the room takes them), else ``None``."""
        if not records:
            return None
        if unit not in self.keeps:
            size = _nbytes(records)
            self.keeps[unit] = self.room is None or self.used + size <= self.room
            self.used += size if self.keeps[unit] else 0
            if list(self.keeps.values()).count(False) == 1 and not self.keeps[unit]:  # the first that does not fit
                log.info(
                    "SlideFormer keeps the attention outputs of %d blocks (%.2f GiB) for their backward; the rest"
                    " run their attention again there (no more GPU memory left for them).",
                    sum(self.keeps.values()), self.used / 2**30,
                )  # fmt: skip
        return records if self.keeps[unit] else None

    @staticmethod
    @contextmanager
    def replaying(records: list[Record] | None) -> Iterator[None]:
        """While active, the attention calls of a block's replay take ``records`` in their order, not running their
        forward (``None``: they run it)."""
        if records is None:
            yield
            return
        pending = iter(records)

        def replay(kernel, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            record = next(pending, None)
            if record is None or record[0].shape != q.shape or record[0].dtype != q.dtype:
                raise RuntimeError(
                    "A block's backward replayed other attention calls than its forward ran (a forward that depends"
                    " on state besides its inputs). Train with EngineConfig(keep_attention=False)."
                )
            return _Replayed.apply(kernel, record, q, k, v)

        with _running_as(replay):
            yield


@dataclass(frozen=True, eq=False)
class _Recording:
    """``kernel``, its forward's output and statistics appended to ``records``."""

    kernel: object
    records: list[Record]

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Record:
        out, stats = self.kernel.forward(q, k, v)
        self.records.append((out.detach(), stats))
        return out, stats

    def backward(self, *args) -> tuple[Tensor, Tensor, Tensor]:
        return self.kernel.backward(*args)


class _Replayed(Function):
    """The attention whose output the forward kept: returns it, differentiates as ``kernel`` does."""

    @staticmethod
    def forward(ctx, kernel, record: Record, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        ctx.kernel, ctx.record = kernel, record
        ctx.save_for_backward(q, k, v)
        return record[0].detach()  # an alias of its own: the kept tensor stays out of this graph

    @staticmethod
    def backward(ctx, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v = ctx.saved_tensors
        out, stats = ctx.record
        return None, None, *ctx.kernel.backward(q, k, v, out, stats, dout)


def _nbytes(records: list[Record]) -> int:
    # (cuDNN's statistics hold undefined tensors, None here, where a dense batch has no sequence offsets)
    return sum(t.numel() * t.element_size() for out, stats in records for t in (out, *stats) if t is not None)
