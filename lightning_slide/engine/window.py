"""The window: pre-allocated device slots that the blocks' weights slide through, and the buffers of the head and
the leftovers.

Forward walks blocks 0..L-1 and backward L-1..0; while block i computes, the next ``num_slots - 1`` blocks' weights
are on their way (:meth:`Window.release` sends them). A slot is reused in ring order, so block i lands in slot
``i % num_slots``; a buffer's ``tag`` says whose weights, at which version, it holds, so weights that have not been
updated since they were sent are not sent again. A unit's weights go up only once its pending update is done; a
delayed block's, in training, from its copy once that is taken (``delay.py``).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch
from torch import Tensor

from . import transfer as transfer_module
from .delay import DelayedBlocks
from .transfer import Transfer
from .units import DeviceBuffer, Unit, max_sizes


@dataclass
class WindowStats:
    """Where the training thread's time went, summed over the engine's life (seconds, bytes)."""

    wait_update_s: float = 0.0  # waiting for a CPU update before a unit could be sent
    wait_send_s: float = 0.0  # waiting for room to queue gradients (the CPU far behind)
    upload_bytes: int = 0
    uploads: int = 0


def window_bytes(blocks: list[Unit], others: list[Unit], num_slots: int, chunk_numel: int) -> int:
    """Device memory a window of ``num_slots`` takes for ``blocks``, the buffers of ``others`` (head, leftovers) and
    the staging chunks (activations not included)."""

    def nbytes(sizes: dict[torch.dtype, int]) -> int:
        return sum(n * torch.empty((), dtype=d).element_size() for d, n in sizes.items())

    own = sum(nbytes(u.numel) for u in others)
    staging = 2 * transfer_module.STAGES * 4 * chunk_numel  # the two rings of fp32 staging chunks (transfer.py)
    return num_slots * nbytes(max_sizes(blocks)) + own + staging


class Window:
    """Device buffers for the units' weights, filled from the host masters and reused.

    Args:
        blocks: the block units, in order (they share ``num_slots`` ring slots).
        others: units with a buffer of their own (the head, the leftovers).
        transfer: the host/device copier.
        num_slots: ring slots (>= 2).
        delay: the delayed blocks' copies (``None``: no block is delayed).
    """

    def __init__(
        self, blocks: list[Unit], others: list[Unit], transfer: Transfer, num_slots: int,
        delay: DelayedBlocks | None = None,
    ) -> None:  # fmt: skip
        self.blocks = blocks
        self.num_slots = num_slots
        self.transfer = transfer
        self.stats = WindowStats()
        self.order: dict[Unit, None] = {}  # units in the order of the first training forward
        self.index = {u: i for i, u in enumerate(blocks)}
        sizes = max_sizes(blocks)
        self.ring = [DeviceBuffer(sizes, transfer.device) for _ in range(num_slots)]
        self.own = {u: DeviceBuffer(u.numel, transfer.device) for u in others}
        self.delay = delay
        self.training = False  # the last unit acquired was for a training forward or backward

    def buffer(self, unit: Unit) -> DeviceBuffer:
        index = self.index.get(unit)
        return self.ring[index % self.num_slots] if index is not None else self.own[unit]

    def updated(self, unit: Unit) -> bool:
        """Nothing ``unit``'s upload waits for is pending (an update, or a delayed block's copy)."""
        return all(f is None or f.done() for f in self._awaited(unit))

    def _awaited(self, unit: Unit) -> list[Future | None]:
        if self.delay is not None and self.delay.sources(unit, self.training) is not None:
            return [self.delay.done[unit]]
        return [owner.update_done for owner in unit.owners()]

    def _tag(self, unit: Unit) -> tuple:
        if self.delay is not None and self.delay.sources(unit, self.training) is not None:
            return unit, "copy", self.delay.version[unit]
        return unit, sum(o.version for o in unit.owners())

    def wait_updates(self, unit: Unit) -> None:
        self.wait_for([owner.update_done for owner in unit.owners()])

    def wait_for(self, updates: list[Future | None]) -> None:
        for update in updates:
            if update is not None:
                start = time.perf_counter()
                update.result()  # also re-raises a failed update
                self.stats.wait_update_s += time.perf_counter() - start

    def prefetch(self, unit: Unit) -> None:
        """Start sending ``unit``'s weights unless its buffer already holds them."""
        buf = self.buffer(unit)
        if buf.tag != self._tag(unit):
            self._upload(unit, buf)

    def _upload(self, unit: Unit, buf: DeviceBuffer) -> None:
        self.wait_for(self._awaited(unit))
        sources = self.delay.sources(unit, self.training) if self.delay is not None else None
        sources = sources or [p.data for p in unit.params]
        buf.ready = self.transfer.upload(list(zip(sources, buf.views(unit))), after=buf.free)
        buf.tag = self._tag(unit)
        self.stats.uploads += 1
        self.stats.upload_bytes += sum(t.numel() * t.element_size() for t in sources)

    def prefetch_updated(self, blocks: list[Unit]) -> None:
        """Send those of ``blocks`` whose updates are done (a thread waiting for another update meanwhile)."""
        for block in blocks:
            if self.updated(block):
                self.prefetch(block)

    def acquire(self, unit: Unit, training: bool = False) -> list[Tensor]:
        """The device copies of ``unit``'s parameters, ready for the current stream (``training``: for a training
        forward or its backward, which read a delayed block's copy)."""
        self.training = training
        if torch.is_grad_enabled():
            self.order.setdefault(unit)
        self.prefetch(unit)
        buf = self.buffer(unit)
        self.transfer.wait(buf.ready)
        return buf.views(unit)

    def release(self, unit: Unit, *, forward: bool) -> None:
        """The current stream is done with ``unit``'s buffer; look ahead for the next blocks."""
        self.buffer(unit).free = self.transfer.record()
        index = self.index.get(unit)
        if index is None:
            return
        step = 1 if forward else -1
        for k in range(1, self.num_slots):
            j = index + step * k
            if 0 <= j < len(self.blocks):
                self.prefetch(self.blocks[j])
        # NOTE: the head (and leftovers), in buffers of their own, go up behind the first blocks where their update
        # is done, else after the last block: sent only during the last blocks, the head left the GPU idle
        last = index == len(self.blocks) - 1
        if forward:
            for other in self.own:
                if last or self.updated(other):
                    self.prefetch(other)
