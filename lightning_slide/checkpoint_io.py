"""Checkpoints for models whose state fills most of the host's memory: streamed to disk, atomic, and loaded
without unpickling code or a second in-memory copy.

With the optimizer state on NVMe, a checkpoint is a directory: ``checkpoint.pt`` (weights, hyperparameters, loop
state, and for each moment or master that lives in a file a reference to where it lies there) and ``state/``,
copies of the state files made by the kernel (``os.copy_file_range``: no pass through this process's memory), each
assembled from the pieces the node's processes hold (``NvmeStateStore.pieces``). Loading maps the copies and checks
each block's CRC before the state goes back into the live files.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import shutil
import stat
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override

from .engine.machine import size_text
from .engine.nvme import NvmeStateError

CHECKPOINT_FILE = "checkpoint.pt"  # inside a checkpoint directory
STATE_DIR = "state"
PARTIAL, OLD = ".partial", ".old"  # a save in progress; the checkpoint it replaces, while it does
CHECKSUMS = "slide_checksums"  # in a checkpoint: its tensors' CRC-32s
_CRC_BYTES = 64 << 20  # bytes per CRC: a large tensor's are computed in parallel


class CheckpointError(RuntimeError):
    """A checkpoint's tensors do not match the checksums saved with them."""


log = logging.getLogger(__name__)


class SlideCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint I/O for the SlideFormer strategy.

    Saving: ``torch.save`` streams tensor by tensor into a temporary file (or directory) beside the target, which is
    synced and then renamed over the target, so a crash mid-write leaves the previous checkpoint intact. (Lightning's
    default first serializes the whole checkpoint into an in-memory buffer: a second copy of every weight and
    optimizer state.) Every tensor's CRC-32s go into the checkpoint (``CHECKSUMS``). Loading:
    ``torch.load(weights_only=True, mmap=True)``: plain tensors and containers only, read from the page cache instead of
    into a second copy, each checked against its CRC-32s. A save that a crash cut short is finished or undone at the
    next load or save (``_recover``).

    ``storage_options``: ``{"state_pieces": [...]}``, what the files that the checkpoint's state references point
    into are made of (``NvmeStateStore.pieces``; the strategy passes them when the optimizer state is on NVMe).
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        options = dict(storage_options or {})
        pieces = options.pop("state_pieces", [])
        if options:
            raise TypeError(f"SlideCheckpointIO takes only storage_options={{'state_pieces': [...]}}; got {options}.")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        _tidy(path.parent)
        partial = _beside(path, PARTIAL)
        _remove(partial)
        checkpoint = {**checkpoint, CHECKSUMS: _checksums(checkpoint)}
        try:
            if _references(checkpoint):
                partial.mkdir(mode=0o700)  # private, as the live state files are
                (partial / STATE_DIR).mkdir(mode=0o700)
                _assemble(pieces, partial / STATE_DIR)
                _save(checkpoint, partial / CHECKPOINT_FILE)
            else:
                _save(checkpoint, partial)
            _replace(partial, path)
        except BaseException as err:
            _remove(partial)
            if isinstance(err, (OSError, RuntimeError)):
                _raise_if_disk_full(err, path, _checkpoint_bytes(checkpoint, pieces))
            raise

    @override
    def load_checkpoint(self, path: str | Path, map_location: Any = None, weights_only: bool | None = None) -> dict:
        return _load(Path(path), weights_only is not False, optimizer_state=True)

    @staticmethod
    def load_weights(path: str | Path) -> dict:
        """The checkpoint with its weights (masters that lived on NVMe included), its optimizer state left as
        references (never read): for export."""
        return _load(Path(path), True, optimizer_state=False)

    @override
    def remove_checkpoint(self, path: str | Path) -> None:
        _remove(Path(path))


def _load(path: Path, weights_only: bool, *, optimizer_state: bool) -> dict:
    # mapped, not read; the references into the state files resolved to mapped, CRC-checked tensors
    if not path.exists():
        _recover(path)
    if not path.exists():
        raise FileNotFoundError(f"Checkpoint {str(path)!r} not found.")
    file = path / CHECKPOINT_FILE if path.is_dir() else path
    checkpoint = torch.load(file, map_location="cpu", weights_only=weights_only, mmap=True)
    if (saved := checkpoint.pop(CHECKSUMS, None)) is not None:
        _verify(checkpoint, saved, path, weights_only=not optimizer_state)
    maps: dict[str, torch.Tensor] = {}
    for where, container in _containers(checkpoint, optimizer_state=optimizer_state):
        for key, value in container.items():
            if _is_reference(value):
                container[key] = _resolve(value, path, f"{where}[{key!r}]", maps)
    return checkpoint


def _save(checkpoint: dict, file: Path) -> None:
    with open(file, "wb") as f:
        torch.save(checkpoint, f)
        f.flush()
        os.fsync(f.fileno())


def _raise_if_disk_full(err: BaseException, path: Path, need: int) -> None:
    # a failed save's error, where the disk filled (torch's writer says only "unexpected pos"), as one that says so
    free = shutil.disk_usage(path.parent).free
    if errno.ENOSPC in _errnos(err) or free < need:
        raise OSError(
            errno.ENOSPC, f"Saving checkpoint {path} failed: its disk is full ({size_text(free)} free, the checkpoint"
            f" needs about {size_text(need)}). The previous checkpoints are intact. Free disk space, or save elsewhere"
            " (ModelCheckpoint(dirpath=...)).",
        ) from err  # fmt: skip


def _errnos(err: BaseException | None) -> list[int | None]:
    # the error's errno and those of the errors it was raised from or while handling (torch's writer raises a
    # RuntimeError while handling the write's OSError)
    found = []
    while err is not None and len(found) < 16:
        found.append(getattr(err, "errno", None))
        err = err.__cause__ or err.__context__
    return found


def _assemble(pieces: list[tuple[str, int, str, int, int]], folder: Path) -> None:
    # each (source file, offset, name, offset there, bytes) copied into folder/name by the kernel, each file synced
    sources: dict[str, int] = {}
    targets: dict[str, int] = {}
    try:
        for source, at, name, to, nbytes in pieces:
            if source not in sources:
                sources[source] = os.open(source, os.O_RDONLY)
            if name not in targets:
                targets[name] = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            _copy_range(sources[source], targets[name], at, to, nbytes)
        for fd in targets.values():
            os.fsync(fd)
    finally:
        for fd in [*sources.values(), *targets.values()]:
            os.close(fd)


def _copy_range(source: int, target: int, at: int, to: int, nbytes: int) -> None:
    while nbytes:
        try:
            done = os.copy_file_range(source, target, nbytes, at, to)
        except OSError as err:  # a file system or kernel without it
            if err.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
            done = os.pwrite(target, os.pread(source, min(nbytes, 64 << 20), at), to)
        if done == 0:
            raise OSError(errno.EIO, f"a state file ended {nbytes} bytes short while it was copied")
        at, to, nbytes = at + done, to + done, nbytes - done


def _checkpoint_bytes(checkpoint: dict, pieces: list[tuple[str, int, str, int, int]]) -> int:
    # about what a checkpoint takes on disk: its tensors and the state copied beside it
    return sum(t.numel() * t.element_size() for _, t in _tensors(checkpoint)) + sum(p[-1] for p in pieces)


def _tensors(value: Any, where: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    # every tensor in a checkpoint, with where it is (``['state_dict']['model.x.weight']``)
    if isinstance(value, torch.Tensor):
        yield where, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _tensors(item, f"{where}[{i}]")


def _checksums(checkpoint: dict) -> dict[str, list[int]]:
    # each tensor's CRC-32s, one per _CRC_BYTES of it, on all cores (zlib leaves the GIL for large buffers); a tensor
    # on the device is copied to the host one at a time
    checksums: dict[str, list] = {}
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for where, t in _tensors(checkpoint):
            raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            parts = [raw[lo : lo + _CRC_BYTES] for lo in range(0, max(len(raw), 1), _CRC_BYTES)]
            checksums[where] = [pool.submit(zlib.crc32, part) for part in parts]
            if t.device.type != "cpu":
                checksums[where] = [f.result() for f in checksums[where]]
    return {where: [f if isinstance(f, int) else f.result() for f in crcs] for where, crcs in checksums.items()}


def _verify(checkpoint: dict, saved: dict[str, list[int]], path: Path, *, weights_only: bool) -> None:
    # the tensors against the checksums saved with them (only the weights', read alone, for ``weights_only``: an
    # export need not read the optimizer state)
    if weights_only:
        saved = {where: crcs for where, crcs in saved.items() if where.startswith("['state_dict']")}
        checkpoint = {"state_dict": checkpoint.get("state_dict", {})}
    found = _checksums(checkpoint)
    for where, crcs in saved.items():
        if found.get(where) != crcs:
            what = "is missing" if where not in found else "does not match the checksum saved with it"
            raise CheckpointError(
                f"Checkpoint {str(path)!r} is damaged: its tensor at {where} {what}. Resume from another checkpoint."
            )


def _fsync(file: Path) -> None:
    with open(file, "rb") as f:
        os.fsync(f.fileno())


def _replace(new: Path, path: Path) -> None:
    """Put ``new`` at ``path``; a directory there (or a file, where ``new`` is a directory) goes only after. A crash
    between the two renames leaves ``path`` absent, the old one at ``path.old`` and ``new``, complete, at
    ``path.partial``: :func:`_recover` finishes the replacement."""
    if new.is_file() and not path.is_dir():
        os.replace(new, path)
        return
    old = _beside(path, OLD)
    _remove(old)
    if path.exists():
        os.replace(path, old)
    os.replace(new, path)
    _remove(old)


def _recover(path: Path) -> None:
    # ``path`` after a crash in _replace: the new checkpoint if it was complete (renamed), else the old one
    old, partial = _beside(path, OLD), _beside(path, PARTIAL)
    if not old.exists():
        return
    if path.exists():  # the crash came after the second rename: the old one is superseded
        _remove(old)
        return
    found = partial if partial.exists() else old
    os.replace(found, path)
    _remove(old)
    log.warning(
        "Checkpoint %s was being replaced when the process stopped: restored it from %s (the %s one).",
        path, found.name, "new, complete" if found is partial else "previous",
    )  # fmt: skip


def _tidy(folder: Path) -> None:
    # before a save: finish replacements a crash interrupted, then remove what killed saves left
    for leftover in sorted(folder.glob(f"*{OLD}")):
        _recover(leftover.with_name(leftover.name.removesuffix(OLD)))
    for leftover in sorted(folder.glob(f"*{PARTIAL}")):
        log.info("Removing %s, left by a save that did not finish.", leftover)
        _remove(leftover)


def _beside(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _containers(checkpoint: dict, *, optimizer_state: bool = True) -> list[tuple[str, dict]]:
    # the dicts whose values may be references into state files, each with where it is in the checkpoint: the
    # weights, and each parameter's optimizer state
    containers = [("state_dict", checkpoint.get("state_dict", {}))]
    if optimizer_state:
        for o, opt in enumerate(checkpoint.get("optimizer_states", [])):
            containers += [(f"optimizer_states[{o}]['state'][{i}]", s) for i, s in opt.get("state", {}).items()]
    return containers


def _is_reference(value: Any) -> bool:
    return isinstance(value, dict) and "nvme_state_file" in value


def _references(checkpoint: dict) -> bool:
    return any(_is_reference(v) for _, container in _containers(checkpoint) for v in container.values())


_STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # of the NVMe tier's state (optimizer_state)


def _resolve(ref: dict, path: Path, where: str, maps: dict[str, torch.Tensor]) -> torch.Tensor:
    """The tensor a state reference points to: a view of a read-only map of the copied file in the checkpoint's own
    ``state/`` folder, every block's CRC checked (a block never written, ``None``, must be zeros)."""
    file = _state_file(ref, path, where)
    start, nbytes = ref["offset"], ref["nbytes"]
    if file.name not in maps:
        if not file.is_file():
            raise NvmeStateError(f"State file {file} of this checkpoint is missing. Resume from another checkpoint.")
        maps[file.name] = torch.from_file(str(file), shared=False, size=file.stat().st_size, dtype=torch.uint8)
    if (size := maps[file.name].numel()) < start + nbytes:
        raise NvmeStateError(
            f"State file {file} of this checkpoint is truncated ({size} bytes, needs {start + nbytes}). Resume"
            " from another checkpoint."
        )
    raw = maps[file.name][start : start + nbytes]
    at = 0
    for size, crc in ref["blocks"]:
        block, at = raw[at : at + size], at + size
        if bool(block.any()) if crc is None else zlib.crc32(block.numpy()) != crc:
            raise NvmeStateError(
                f"State in {file} (bytes {start}..{start + nbytes}) of this checkpoint is corrupt (checksum"
                " mismatch). Resume from another checkpoint."
            )
    return raw.view(_STATE_DTYPES[ref.get("dtype", "float32")]).view(ref["shape"])


def _state_file(ref: dict, path: Path, where: str) -> Path:
    # the regular file inside ``path``'s state/ folder that a well-formed reference names; anything else is refused
    def refuse(why: str) -> ValueError:
        return ValueError(
            f"Checkpoint {str(path)!r} holds a state reference at {where} that {why}; nothing was loaded. A checkpoint"
            f" written by lightning-slide references only files of its own {STATE_DIR}/ folder, each block with its"
            " checksum: this one was altered or crafted. Resume from another checkpoint."
        )

    chunk = ref.get("chunk_bytes")
    if "blocks" not in ref and isinstance(ref.get("crcs"), list) and _natural(chunk) and chunk:
        # written before the state was shared out by rows: blocks of one size
        ref["blocks"] = [[min(chunk, ref.get("nbytes", 0) - i * chunk), crc] for i, crc in enumerate(ref["crcs"])]
    name, shape, blocks = ref.get("nvme_state_file"), ref.get("shape"), ref.get("blocks")
    if not isinstance(name, str) or not name or name in (".", "..") or any(c in name for c in "/\\\0"):
        raise refuse(f"names {name!r}, not a file name")
    if not (isinstance(shape, list) and all(_natural(n) for n in shape) and all(_natural(ref.get(k)) for k in
            ("offset", "nbytes")) and isinstance(blocks, list)):  # fmt: skip
        raise refuse("is malformed (offset, nbytes, shape, blocks)")
    dtype = _STATE_DTYPES.get(ref.get("dtype", "float32")) if isinstance(ref.get("dtype", ""), str) else None
    if dtype is None:
        raise refuse(f"names the dtype {ref.get('dtype')!r}, not float32 or bfloat16")
    if ref["nbytes"] != dtype.itemsize * math.prod(shape):
        raise refuse(f"gives {ref['nbytes']} bytes for a {dtype} tensor of shape {shape}")
    if (
        not all(
            isinstance(b, list) and len(b) == 2 and _natural(b[0]) and b[0] > 0 and (b[1] is None or _natural(b[1]))
            for b in blocks
        )
        or sum(b[0] for b in blocks) != ref["nbytes"]
    ):
        raise refuse("does not carry a size and a checksum for each block, covering the tensor")
    folder = path / STATE_DIR
    file = folder / name
    if folder.is_symlink() or file.is_symlink() or (file.exists() and not stat.S_ISREG(file.lstat().st_mode)):
        raise refuse(f"names {name!r}, which is a link or not a regular file")
    return file


def _natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
