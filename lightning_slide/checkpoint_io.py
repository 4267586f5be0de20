"""Checkpoints for models whose state fills most of the host's memory: streamed to disk, atomic, and loaded
without unpickling code or a second in-memory copy."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override


class SlideCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint I/O for the SlideFormer strategy.

    Saving: ``torch.save`` streams tensor by tensor into a temporary file beside the target, which is synced and
    then renamed over the target, so a crash mid-write leaves the previous checkpoint intact. (Lightning's
    default first serializes the whole checkpoint into an in-memory buffer: a second copy of every weight and
    optimizer state.) Loading: ``torch.load(weights_only=True, mmap=True)``: plain tensors and containers only,
    read from the page cache on demand instead of into a second copy.
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("SlideCheckpointIO takes no storage_options; it writes local files.")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        try:
            with open(partial, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(partial, path)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise

    @override
    def load_checkpoint(self, path: str | Path, map_location: Any = None, weights_only: bool | None = None) -> dict:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"Checkpoint {str(path)!r} not found.")
        return torch.load(path, map_location="cpu", weights_only=weights_only is not False, mmap=True)
