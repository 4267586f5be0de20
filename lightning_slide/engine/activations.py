"""Activation offload: the block inputs that recompute needs, kept in pooled host memory between forward and
backward, and brought back one block ahead of the backward pass.

Only inputs that require grad are moved — the residual stream, unique to each block. Inputs shared by every block
(rotary tables, masks, position ids) stay where they are. Host buffers come from a pool keyed by size and are
reused from step to step, so a long context costs no allocation per tensor. On CUDA the copies run on the
transfer side streams, ordered by events; on the CPU they are plain copies through the same pool.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from .planner import WORKING_INPUTS, blocks_to_offload, tiling_needed
from .tiling import TILES, TiledMLP, gated_mlp
from .transfer import Transfer

log = logging.getLogger(__name__)


@dataclass
class _Offloaded:
    raw: Tensor  # the pooled host buffer (uint8), exactly the tensor's bytes
    shape: torch.Size
    dtype: torch.dtype
    saved: object | None  # event: the copy to the host is done
    back: Tensor | None = None  # the tensor on the device again, once fetched
    fetched: object | None = None  # event: ``back`` is complete


class ActivationStash:
    """Saves and restores the inputs of managed blocks for their backward pass."""

    def __init__(self, transfer: Transfer) -> None:
        self.transfer = transfer
        self._free: dict[int, list[tuple[Tensor, object | None]]] = {}  # nbytes -> (buffer, last use)
        self._pending: list[list] = []  # entries of this step's blocks, in forward order
        self.keep = False  # the backward pass running is not the last over these inputs ("norm-first")

    def save(self, tensors: tuple[Tensor, ...]) -> list:
        """What to keep of ``tensors`` for the backward pass: each one, or its offloaded copy."""
        entries: list = []
        for t in tensors:
            if not (t.requires_grad and t.is_floating_point()):
                entries.append(t)
                continue
            src = t.detach().reshape(-1)
            raw = self._take(src.numel() * src.element_size())
            with self.transfer.on_download_stream(after=self.transfer.record()):
                raw.view(src.dtype).copy_(src, non_blocking=True)
                self.transfer.keep_alive(src)
                saved = self.transfer.record(self.transfer.download_stream)
            entries.append(_Offloaded(raw, t.shape, t.dtype, saved))
        self._pending.append(entries)
        return entries

    def load(self, entries: list) -> list[Tensor]:
        """The saved tensors of one block, on the device; starts fetching the block before it (next in backward)."""
        index = next(i for i, e in enumerate(self._pending) if e is entries)
        self._fetch(entries)
        if index > 0:
            self._fetch(self._pending[index - 1])
        if not self.keep:
            del self._pending[index]
        out = []
        for e in entries:
            if not isinstance(e, _Offloaded):
                out.append(e)
                continue
            self.transfer.wait(e.fetched)
            out.append(e.back)
            e.back = None  # the autograd node keeps `entries` to the end of backward; it must not keep this alive
            if not self.keep:  # else fetched again by the next pass
                self._free.setdefault(e.raw.numel(), []).append((e.raw, e.fetched))
        return out

    def reset(self) -> None:
        """Forget saved inputs whose backward never ran (their buffers go back to the pool)."""
        for entries in self._pending:
            for e in entries:
                if isinstance(e, _Offloaded):
                    self._free.setdefault(e.raw.numel(), []).append((e.raw, e.fetched or e.saved))
        self._pending.clear()

    def release(self) -> None:
        """Drop the pool's host buffers (training is over)."""
        self._free.clear()
        self._pending.clear()

    def _fetch(self, entries: list) -> None:
        for e in entries:
            if isinstance(e, _Offloaded) and e.back is None:
                e.back = torch.empty(e.shape, dtype=e.dtype, device=self.transfer.device)
                # NOTE: `back` comes from the current stream's pool: its memory may still be read by kernels queued
                # there (freed tensors are reused in stream order). The upload stream must wait for them too, or it
                # overwrites live data (tests/test_gpu.py, the busy compute stream).
                here = self.transfer.record()
                e.fetched = self.transfer.upload([(e.raw.view(e.dtype).view(e.shape), e.back)], after=(e.saved, here))

    def _take(self, nbytes: int) -> Tensor:
        free = self._free.get(nbytes)
        if free:
            buffer, last_use = free.pop()
            if last_use is not None:
                last_use.synchronize()  # its copy back to the device has finished
            return buffer
        return self.transfer.host_empty(nbytes, torch.uint8)


def saved_bytes(inputs: tuple[Tensor, ...]) -> int:
    """What a block keeps of its ``inputs`` for its recompute: those the stash would offload (``ActivationStash``)."""
    return sum(t.numel() * t.element_size() for t in inputs if t.requires_grad and t.is_floating_point())


class Offloading:
    """Which blocks keep the inputs they save for their recompute in host memory (the first ``blocks``: their inputs
    wait longest for their backward), and whether their MLPs run on slices of the tokens (``tiling``): as the plan
    predicted at setup (``planned``), or decided at the first training forward from the inputs' size and the device
    memory left (:func:`plan_offload`).

    Args:
        asked: ``True``: every block's inputs; ``"auto"``: as few as let the rest fit; ``False``: none.
        num_blocks: the streamed blocks.
    """

    def __init__(self, asked: bool | Literal["auto"], num_blocks: int) -> None:
        self.asked, self.num_blocks = asked, num_blocks
        self.stash: ActivationStash | None = None
        self.blocks: int | None = 0  # None: "auto", undecided
        self.tiling: bool | None = None  # None: undecided
        self.planned: tuple[int, int, bool] | None = None  # (saved bytes per block, blocks, tiling) from the plan
        self.tiled: list[TiledMLP] = []

    def setup(self, transfer: Transfer, modules: list[nn.Module]) -> None:
        """The host pool, and the blocks' MLPs that can run tiled, where inputs may be offloaded."""
        if not self.asked:
            return
        self.stash = ActivationStash(transfer)
        self.blocks = None if self.asked == "auto" else self.num_blocks
        self.tiled = [TiledMLP(mlp) for module in modules if (mlp := gated_mlp(module)) is not None]

    def decide(
        self, inputs: tuple[Tensor, ...], *, budget: int | None, reserved: int, host_room: Callable[[], int],
        before_offload: Callable[[], None],
    ) -> None:  # fmt: skip
        """Decide from a block's ``inputs`` before the first block runs: as planned, if they are no larger than
        planned; else from their size, the device ``budget`` and the ``reserved`` bytes. Where anything is offloaded,
        ``before_offload()`` runs, and the inputs must fit ``host_room()`` bytes of RAM."""
        saved = saved_bytes(inputs)
        if self.planned is not None:
            planned, self.blocks, self.tiling = self.planned
            if saved > planned:
                raise ValueError(
                    f"A block's inputs take {saved:,} bytes, but the placement plan counted {planned:,} (its tokens"
                    " per batch). Give SlideFormerStrategy(tokens_per_batch=...) the largest batch's tokens, or lower"
                    " the batch size or sequence length."
                )
        else:
            self.blocks, self.tiling = plan_offload(
                saved, blocks=self.num_blocks, offloading=self.blocks, budget=budget, reserved=reserved,
                can_tile=bool(self.tiled),
            )  # fmt: skip
        if self.blocks:
            before_offload()
            if saved * self.blocks > (available := host_room()):
                raise MemoryError(
                    f"SlideFormer must keep the saved inputs of {self.blocks} blocks ({saved * self.blocks / 2**30:.2f}"
                    f" GiB) in host memory for the GPU to hold the rest, but only {available / 2**30:.2f} GiB of RAM"
                    " is available. Lower the tokens per step (batch size or sequence length; accumulate_grad_batches"
                    " keeps the tokens per optimizer step), or free RAM."
                )
        for tiled in self.tiled:
            tiled.active = self.tiling

    def restore_mlps(self) -> None:
        """The MLPs' own forwards back."""
        for tiled in self.tiled:
            tiled.restore()
        self.tiled = []


def plan_offload(
    saved: int, *, blocks: int, offloading: int | None, budget: int | None, reserved: int, can_tile: bool
) -> tuple[int, bool]:
    """How many of the first blocks keep their saved inputs (``saved`` bytes each) in host memory, and whether the
    blocks' MLPs run on slices of the tokens (``tiling.py``); the choices logged.

    Args:
        blocks: the blocks of the model.
        offloading: blocks that offload, as asked; ``None`` ("auto"): as few as let the others' inputs, one block at
            work and ``reserved`` bytes fit the GPU ``budget`` (``None``: off CUDA, where nothing offloads).
        can_tile: the blocks' MLPs can run tiled; they do where one block at work would not fit even so.
    """
    if offloading is None:
        offloading = blocks_to_offload(saved, blocks, budget, reserved)
        if offloading:
            log.info(
                "SlideFormer offloads the activations of %d of %d blocks (%.2f GiB to host memory): all %d blocks'"
                " saved inputs (%.2f GiB) and one block at work (~%.2f GiB) exceed the %.2f GiB left on the GPU.",
                offloading, blocks, saved * offloading / 2**30, blocks, saved * blocks / 2**30,
                saved * WORKING_INPUTS / 2**30, budget / 2**30,
            )  # fmt: skip
    tiling = can_tile and tiling_needed(saved, budget, reserved)
    if tiling:
        log.info(
            "SlideFormer runs the blocks' MLPs on %d slices of the tokens: one block at work (~%.2f GiB) would not fit"
            " the %.2f GiB left on the GPU.", TILES, saved * WORKING_INPUTS / 2**30, budget / 2**30,
        )  # fmt: skip
    return offloading, tiling
