"""``EngineConfig``: every knob of the engine's mechanism, with its default and why; and the check of the engine's
choices (``check_choices``).

The user's choices (window size, update schedule, offloading, NVMe) are ``SlideFormerStrategy``'s arguments; these
fields are the mechanism underneath, for benchmarks, tests and users tuning a machine:
``SlideFormerStrategy(engine=EngineConfig(landing_buffers=16))``, or in LightningCLI YAML
``init_args: {engine: {split_embedding_update: false}}``. How each default was measured: ``benchmarks/NOTES.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Auto = Literal["auto"]


@dataclass(frozen=True)
class EngineConfig:
    """The engine's knobs.

    Args:
        chunk_numel: fp32 elements per transfer chunk (32 MiB): gradients leave the device, and uploads convert, a
            chunk at a time through fixed staging buffers.
        landing_buffers: pinned host chunks for gradients on their way to the CPU optimizer. More let the backward
            run further ahead of the optimizer; each costs ``4 * chunk_numel`` bytes of pinned RAM.
        nvme_landing_buffers: the same, with the optimizer state on NVMe (the disk sets the pace there).
        offload_landing_buffers: the same, once activations are offloaded (their host memory is worth more).
        max_queued_grad_bytes: device memory the gradients waiting to leave may hold before the backward waits.
        rows_stage_numel: fp32 elements per pinned staging buffer (two of them) for the embedding rows a forward
            reads.
        rows_pass_numel: elements of each tensor the touched embedding rows' CPU update gathers at a time.
        split_embedding_update: update the embedding's untouched rows when the backward starts and its touched rows
            when their gradients arrive (``embedding.py``); ``"auto"``: with schedule "forward" always, with
            "backward" when the CPU worker waited for the GPU in the second step at least as long as the embedding's
            update takes.
        device_row_update: schedule "forward": update the split embedding's touched rows on the device, and let the
            next forward read them there, so the CPU worker does not start the next step with them.
        defer_touched_rows: schedule "backward": the split embedding's touched rows are updated when the next
            forward gathers its rows, those it reads first, instead of at the end of the backward.
        deferred_updates: schedule "backward": the first N streamed blocks are updated during the next forward, where
            the CPU worker would otherwise idle, instead of as their backward ends (their gradients wait on the host,
            4 bytes per parameter). ``"auto"``: the plan picks N for the fastest predicted step (``rates.py``), 0
            where the GPU sets the pace, with several processes, or on the CPU.
        delayed_blocks: with ``delayed_update=True``, the first N streamed blocks are updated a step late
            (``delay.py``). ``"auto"``: every streamed block where the plan predicts a faster step (``rates.py``), none
            where the GPU sets the pace (every block on the CPU), fewer where the host cannot hold their copies.
        compact_retained_grads: without accumulation, keep the retained gradients (schedule "forward"; the deferred
            and delayed blocks' with "backward") of the matrices computed with in bf16 in bf16 (2 bytes per parameter
            instead of 4). ``"auto"``: with ``optimizer_state="bf16"``, whose kernel reads them as they are; else
            only where fp32 ones would not fit the RAM available (torch's fused AdamW needs them widened: a slower
            CPU update).
        skip_dead_ends: a block's backward replays its forward without the products of the linear layers whose
            outputs only its residual additions read (``dead_ends.py``; the same gradients, bit for bit).
        keep_attention: a streamed block whose inputs stay on the GPU keeps its attention outputs (and their softmax
            statistics) from its forward where the GPU has room for them, so its backward's replay skips the
            attention's forward (``kept_attention.py``; the same gradients).
        nvme_read_ahead_bytes: the NVMe tier's optimizer state read ahead of its updates and not yet used, at most
            (RAM that keeps the disk busy; 0: one block at a time).
        register_min_bytes: pinned host buffers from this size are pinned by registering their pages with the driver;
            smaller ones come from torch's pinned allocator (which rounds each request up to a power of two).
    """

    chunk_numel: int = 1 << 23
    landing_buffers: int = 32
    nvme_landing_buffers: int = 16
    offload_landing_buffers: int = 16
    max_queued_grad_bytes: int = 1 << 30
    rows_stage_numel: int = 1 << 23
    rows_pass_numel: int = 1 << 23
    split_embedding_update: bool | Auto = "auto"
    device_row_update: bool = True
    defer_touched_rows: bool = True
    deferred_updates: int | Auto = "auto"
    delayed_blocks: int | Auto = "auto"
    compact_retained_grads: bool | Auto = "auto"
    skip_dead_ends: bool = True
    keep_attention: bool = True
    nvme_read_ahead_bytes: int = 512 << 20
    register_min_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        for name in ("chunk_numel", "landing_buffers", "nvme_landing_buffers", "offload_landing_buffers",
                     "max_queued_grad_bytes", "rows_stage_numel", "rows_pass_numel"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EngineConfig({name}=...) must be a positive int; got {value!r}.")
        for name in ("nvme_read_ahead_bytes", "register_min_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"EngineConfig({name}=...) must be an int >= 0; got {value!r}.")
        for name in ("deferred_updates", "delayed_blocks"):
            value = getattr(self, name)
            if value != "auto" and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"EngineConfig({name}=...) must be 'auto' or an int >= 0; got {value!r}.")
        for name in ("split_embedding_update", "compact_retained_grads"):
            if (value := getattr(self, name)) not in (True, False, "auto"):
                raise ValueError(f"EngineConfig({name}=...) must be True, False or 'auto'; got {value!r}.")
        for name in ("device_row_update", "defer_touched_rows", "skip_dead_ends", "keep_attention"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"EngineConfig({name}=...) must be True or False; got {getattr(self, name)!r}.")


def check_choices(
    *, num_slots: int, on_nonfinite: str, schedule: str, resident: bool, defer_blocks: int, delay_blocks: int = 0,
    several: bool = False,
) -> None:  # fmt: skip
    """Refuse a combination of the engine's choices it cannot carry out (``SlideEngine``'s arguments)."""
    if delay_blocks and schedule == "norm-first":
        raise ValueError(
            "delayed_update=True keeps the delayed blocks' gradients for the next step, and update_schedule="
            "'norm-first' was chosen to keep no gradient on the host: give the run more RAM, or train without"
            " delayed_update."
        )
    if delay_blocks and several:
        raise ValueError(
            "delayed_update=True is not available with several processes yet; train with devices=1, or without"
            " delayed_update."
        )
    if num_slots < 2:
        raise ValueError(f"num_slots must be at least 2 (one block computes while the next arrives); got {num_slots}.")
    if on_nonfinite not in ("raise", "skip"):
        raise ValueError(f"on_nonfinite must be 'raise' or 'skip'; got {on_nonfinite!r}.")
    if resident and schedule == "norm-first":
        raise ValueError("update_schedule='norm-first' streams every update; it keeps no module on the device.")
    if defer_blocks and schedule != "backward":
        raise ValueError(
            f"Deferring block updates to the next forward is a variant of update_schedule='backward'; the schedule"
            f" is {schedule!r}, whose updates wait for the step's end anyway. Leave"
            " EngineConfig(deferred_updates=...) at 'auto' or 0."
        )
