"""The NVMe tier: the optimizer's moment tensors live in files, one per unit (a block, the head, ...), instead of
in RAM. Each parameter's state is split into row blocks (at most one transfer chunk of the parameter, whole pages
each), so that a large parameter (a 128k-row embedding) never has its whole state in RAM. A block's state is read
into pooled, page-aligned buffers ahead of its update (as soon as its gradients are on their way, up to
``max_ahead_bytes`` of state in RAM) and written behind it (the blocks waiting to be written hold about as much
again: the reads queued behind their writes gate the next updates). A few threads do the I/O, several blocks at
once (one thread, checksumming in between, reached less than half the disk's rate: ``benchmarks/NOTES.md``); a
block's read waits for the write of that block submitted before it.

With ``masters``, some parameters' fp32 values live in the same blocks under the key ``"param"``: the block's master
is read and written with its moments, and the parameter itself holds only a compute-dtype copy (``optim.py``).

Files sit in a private directory made under ``nvme_path`` (``state_dirs.py``: the next run there removes one that a
killed run left). The files are private (0600), opened with ``O_DIRECT``
where the file system allows it (page-aligned buffers, offsets and sizes), carry a CRC-32 per block that is checked
on every read, and are removed when training ends. A block never written reads as zeros (Adam's initial state)
without touching the disk.

Where a node's processes share the state out (``shared_host.py``), each holds its own rows of every parameter
(``own_rows``) in files of its own, and updates only those.

Checkpoints: :meth:`NvmeStateStore.reference` describes where a parameter's state will lie in the checkpoint's copy
of its unit's file (offset, shape, each block's size and CRC); that copy lays the state out as a one-process store
does, each process's rows where they belong (:meth:`NvmeStateStore.pieces`, :func:`merged`), so a checkpoint is the
same whoever wrote it and resumes on any number of processes. The checkpoint holds these references and the copies
(``checkpoint_io.py``), so the state never passes through RAM whole; :meth:`write` puts loaded state back.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import shutil
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .machine import size_text
from .state_dirs import make_state_dir
from .transfer import aligned_empty

ALIGN = 4096

log = logging.getLogger(__name__)


class NvmeStateError(RuntimeError):
    """Optimizer state on disk is missing, short or corrupt."""


def page_aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages (what a region takes on disk)."""
    return -(-nbytes // ALIGN) * ALIGN


def row_numel(param: Tensor) -> int:
    """Elements per row (leading index) of ``param``; a 0-d tensor is one row."""
    return param.numel() // param.shape[0] if param.dim() and param.shape[0] else max(1, param.numel())


def _rows(param: Tensor) -> int:
    return param.shape[0] if param.dim() else 1


def _rows_per_page_unit(param: Tensor) -> int:
    # the fewest rows whose fp32 bytes fill whole pages
    return ALIGN // math.gcd(row_numel(param) * 4, ALIGN)


def min_block_numel(param: Tensor) -> int:
    """The fewest elements a row block of ``param`` can hold (whole rows filling whole pages)."""
    return _rows_per_page_unit(param) * row_numel(param)


def rows_per_block(param: Tensor, chunk_numel: int) -> int:
    """Rows of ``param`` in one block: as many as fit ``chunk_numel`` elements in whole pages (at least
    :func:`min_block_numel`'s rows), or all of them."""
    unit = _rows_per_page_unit(param)
    return max(1, min(_rows(param), unit * max(1, chunk_numel // row_numel(param) // unit)))


@dataclass
class _Region:
    file: int  # index into the store's files
    offset: int
    nbytes: int
    block_bytes: int  # one row block (whole pages); the last one may be shorter
    copy_offset: int  # where these bytes go in the checkpoint's copy of the file (a one-process store's layout)
    crcs: list[int | None] = field(default_factory=list)  # per block; None: never written (zeros)

    def block(self, index: int) -> tuple[int, int]:
        """(start, end) of a block relative to the region; the last one ends at the region's aligned size."""
        start = index * self.block_bytes
        end = start + self.block_bytes
        return start, end if end < self.nbytes else page_aligned(self.nbytes)


MASTER = "param"  # the key of a master kept in the store


class NvmeStateStore:
    """Optimizer state tensors (``keys``, each shaped like its fp32 parameter) of ``units`` in files.

    Args:
        root: an existing, writable directory on the fast disk.
        units: (name, parameters) per file.
        keys: the state tensors per parameter, e.g. ``("exp_avg", "exp_avg_sq")``.
        state_dtype: their dtype on disk and in the buffers :meth:`load` gives (fp32 or bf16; masters are fp32).
        masters: parameters whose fp32 master is kept here too (key :data:`MASTER`), beside their state.
        chunk_numel: elements per row block, at most (see :func:`rows_per_block`).
        max_ahead_bytes: state read ahead and not yet used may hold at most this much RAM.
        io_threads: blocks read or written at once.
        own_rows: the leading rows of each parameter this store holds (``SharedHost.rows``: ``None`` or absent, all
            of them; an empty slice, none): a node's processes share the state out.
    """

    def __init__(
        self,
        root: str,
        units: list[tuple[str, list[nn.Parameter]]],
        keys: tuple[str, ...],
        *,
        state_dtype: torch.dtype = torch.float32,
        masters: frozenset[nn.Parameter] = frozenset(),
        chunk_numel: int,
        max_ahead_bytes: int = 512 << 20,
        io_threads: int = 4,
        own_rows: dict[nn.Parameter, slice | None] | None = None,
    ) -> None:
        self.keys = keys
        self.dtypes = {**dict.fromkeys(keys, state_dtype), MASTER: torch.float32}
        self.scope = {p for _, params in units for p in params}  # held here or not
        self.max_ahead_bytes = max_ahead_bytes
        self.dir, self._owner = make_state_dir(root)
        self.paths: list[str] = []
        self._fds: list[int] = []
        self.direct = True
        self.regions: dict[nn.Parameter, dict[str, _Region]] = {}
        self.rows: dict[nn.Parameter, int] = {}  # rows per block
        self.first: dict[nn.Parameter, int] = {}  # the first row held
        self._shapes: dict[nn.Parameter, tuple[int, ...]] = {}  # the rows held
        self._free: dict[int, list[Tensor]] = {}  # pooled page-aligned buffers by size
        self._loaned: dict[tuple[nn.Parameter, int], dict[str, Tensor] | None] = {}  # None: its read is awaited
        self._names: dict[nn.Parameter, str] = {}
        self._io = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="slide-nvme")
        self._writes: dict[tuple[nn.Parameter, int], Future] = {}  # the last write of each block
        self._ahead: dict[tuple[nn.Parameter, int], Future] = {}
        self._wanted: dict[tuple[nn.Parameter, int], None] = {}  # blocks to read ahead when there is room, in order
        self._ahead_bytes = 0
        self._lock = threading.Lock()
        self._error: BaseException | None = None  # a failed write-behind, raised at the next load or flush
        try:
            for i, (name, params) in enumerate(units):
                offset = whole = 0
                for p in params:
                    first, count = _held(p, (own_rows or {}).get(p))
                    for key in keys + ((MASTER,) if p in masters else ()):
                        row_bytes = row_numel(p) * self.dtypes[key].itemsize
                        if count:
                            region = _Region(len(self.paths), offset, count * row_bytes, 0, whole + first * row_bytes)
                            self.regions.setdefault(p, {})[key] = region
                            offset += page_aligned(region.nbytes)
                        whole += page_aligned(p.numel() * self.dtypes[key].itemsize)
                    if not count:
                        continue
                    self._names[p] = f"{name}: {tuple(p.shape)}"
                    self.first[p] = first
                    self._shapes[p] = (count, *p.shape[1:]) if p.dim() else ()
                    self.rows[p] = min(count, rows_per_block(p, chunk_numel))
                    for key, region in self.regions[p].items():
                        region.block_bytes = self.rows[p] * row_numel(p) * self.dtypes[key].itemsize
                        region.crcs = [None] * -(-count // self.rows[p])
                path = os.path.join(self.dir, f"{i:04d}-{name or 'root'}.bin")
                self.paths.append(path)
                self._fds.append(self._open(path))
                self._reserve(self._fds[-1], offset, root)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _reserve(fd: int, nbytes: int, root: str) -> None:
        # the file's blocks allocated now: a disk too full fails here, at setup, not at a write mid-training
        os.ftruncate(fd, nbytes)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise
            raise OSError(
                errno.ENOSPC, f"The disk at nvme_path {root} filled while SlideFormer reserved the optimizer state's"
                f" files ({size_text(shutil.disk_usage(root).free)} free now). Free disk space, or give nvme_path a"
                " larger disk.",
            ) from None  # fmt: skip

    def _open(self, path: str) -> int:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
        if self.direct and hasattr(os, "O_DIRECT"):
            fd = None
            try:
                fd = os.open(path, flags | os.O_DIRECT, 0o600)
                os.pwritev(fd, [aligned_empty(ALIGN, ALIGN).zero_().numpy()], 0)  # some file systems refuse only here
                return fd
            except OSError:  # e.g. tmpfs: no direct I/O; buffered from here on
                self.direct = False
                if fd is not None:
                    os.close(fd)
                if os.path.exists(path):
                    os.unlink(path)
        return os.open(path, flags, 0o600)

    def blocks(self, param: nn.Parameter, rows: slice | None) -> list[tuple[slice | None, int]]:
        """``param``'s blocks within its rows ``rows`` (``None``: all this store holds; else whole blocks of them):
        their rows (relative to ``rows``; ``None`` for a 0-d parameter) and indices. None where it holds no row."""
        if param not in self.regions:
            return []
        if param.dim() == 0:
            return [(None, 0)]
        first, held = self.first[param], self._shapes[param][0]
        start, stop = (rows.start - first, rows.stop - first) if rows is not None else (0, held)
        per = self.rows[param]
        if start < 0 or stop > held or start % per or (stop % per and stop != held):
            raise ValueError(
                f"rows {start + first}..{stop + first} of {self._names[param]} are not whole blocks of {per} rows"
                f" of the rows {first}..{first + held} held here"
            )
        return [(slice(r - start, min(r + per, stop) - start), r // per) for r in range(start, stop, per)]

    # ---- one block's state in RAM while it is updated --------------------------------------------------------

    def prefetch(self, params: list[nn.Parameter]) -> None:
        """The updates of ``params`` come next: read their blocks ahead, as far as ``max_ahead_bytes`` allows."""
        with self._lock:
            for p in params:
                if p in self.regions:
                    self._wanted.update(dict.fromkeys((p, b) for b in range(len(self.regions[p][self.keys[0]].crcs))))
        self._refill()

    def _refill(self) -> None:
        # NOTE: a block being updated (loaned) is not read ahead: that read could run before the block's write
        with self._lock:
            while self._wanted:
                block = next(iter(self._wanted))
                nbytes = self._block_bytes(*block)
                if block not in self._ahead and block not in self._loaned:
                    if self._ahead and self._ahead_bytes + nbytes > self.max_ahead_bytes:
                        return
                    self._ahead_bytes += nbytes
                    self._ahead[block] = self._io.submit(self._read_block, *block)
                del self._wanted[block]

    def load(self, param: nn.Parameter, block: int) -> dict[str, Tensor]:
        """The state of one block of ``param`` (its rows) in pooled buffers (read ahead, or now), CRC-checked."""
        self._raise()
        key = (param, block)
        with self._lock:
            future = self._ahead.pop(key, None)
            if future is not None:
                self._ahead_bytes -= self._block_bytes(param, block)
            else:
                future = self._io.submit(self._read_block, param, block)
            self._loaned[key] = None  # from here to its write, no other read of it
        buffers = self._loaned[key] = future.result()
        self._refill()
        per, held = self.rows[param], self._shapes[param]
        shape = held if param.dim() == 0 else (min(per, held[0] - block * per), *held[1:])
        return {k: self._typed(buffers[k], k, shape) for k in buffers}

    def save(self, param: nn.Parameter, block: int) -> None:
        """Write back the block's state (updated in the buffers :meth:`load` gave), behind the caller."""
        key = (param, block)
        with self._lock:  # the write is known before the block may be read ahead again
            self._writes[key] = self._io.submit(self._write_block, param, block, self._loaned.pop(key))

    def flush(self) -> None:
        """Wait for every write submitted so far (and raise a failed one)."""
        for future in list(self._writes.values()):
            future.result()
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _typed(self, buffer: Tensor, key: str, shape: tuple[int, ...]) -> Tensor:
        # the start of a pooled byte buffer, as ``key``'s tensor of ``shape``
        dtype = self.dtypes[key]
        return buffer[: math.prod(shape) * dtype.itemsize].view(dtype).view(shape)

    def _block_bytes(self, param: nn.Parameter, block: int) -> int:
        return sum(page_aligned(r.block(block)[1] - r.block(block)[0]) for r in self.regions[param].values())

    # ---- on the I/O threads ----------------------------------------------------------------------------------

    def _read_block(self, param: nn.Parameter, block: int) -> dict[str, Tensor]:
        prior = self._writes.get((param, block))
        if prior is not None:
            prior.result()  # submitted before this read, so already taken by a thread: no deadlock
        buffers = {}
        for key, region in self.regions[param].items():
            start, end = region.block(block)
            buffer = self._take(end - start)
            if region.crcs[block] is None:
                buffer.zero_()
            else:
                self._read(region, block, buffer, f"{key} of {self._names[param]}")
            buffers[key] = buffer
        return buffers

    def _write_block(self, param: nn.Parameter, block: int, buffers: dict[str, Tensor]) -> None:
        try:
            for key, buffer in buffers.items():
                self._write(self.regions[param][key], block, buffer)
                self._give(buffer)
        except BaseException as err:
            self._error = err

    def _write(self, region: _Region, block: int, buffer: Tensor) -> None:
        start, end = region.block(block)
        written = os.pwritev(self._fds[region.file], [buffer.numpy()], region.offset + start)
        if written != end - start:
            free = size_text(shutil.disk_usage(self.dir).free)
            raise NvmeStateError(
                f"Short write to {self.paths[region.file]} ({written} of {end - start} bytes; {free} free on its"
                " disk). Free disk space, or give nvme_path a larger disk."
            )
        region.crcs[block] = zlib.crc32(buffer[: min(end, region.nbytes) - start].numpy())

    def _read(self, region: _Region, block: int, buffer: Tensor, what: str) -> None:
        start, end = region.block(block)
        got = os.preadv(self._fds[region.file], [buffer.numpy()], region.offset + start)
        if got == end - start and zlib.crc32(buffer[: min(end, region.nbytes) - start].numpy()) == region.crcs[block]:
            return
        at = region.offset + start
        raise NvmeStateError(
            f"State in {self.paths[region.file]} ({what}, bytes {at}..{at + end - start}) is"
            f" {'corrupt (checksum mismatch)' if got == end - start else 'truncated'}. Training stops here; resume"
            " from the last checkpoint."
        )

    def _take(self, nbytes: int) -> Tensor:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                return free.pop()
        return aligned_empty(nbytes, ALIGN)

    def _give(self, buffer: Tensor) -> None:
        with self._lock:
            self._free.setdefault(buffer.numel(), []).append(buffer)

    # ---- checkpoints -----------------------------------------------------------------------------------------

    def reference(self, param: nn.Parameter, keys: tuple[str, ...] | None = None) -> dict[str, dict]:
        """Where ``param``'s state will lie in the checkpoint's copy of its file, per key (default: the optimizer's,
        not the master): the file's name, the byte offset and size and the shape of the whole tensor, and the size
        and CRC of each block (``None``: never written, zeros) of the part held here, which starts ``part`` bytes
        in (:func:`merged` joins the parts). Plain data; call :meth:`flush` first."""
        out = {}
        for key, r in self.regions[param].items():
            if key not in (keys or self.keys):
                continue
            sizes = [min(r.block_bytes, r.nbytes - b * r.block_bytes) for b in range(len(r.crcs))]
            itemsize = self.dtypes[key].itemsize
            part = self.first[param] * row_numel(param) * itemsize
            out[key] = {
                "nvme_state_file": os.path.basename(self.paths[r.file]),
                "offset": r.copy_offset - part,
                "nbytes": param.numel() * itemsize,
                "shape": list(param.shape),
                "dtype": str(self.dtypes[key]).removeprefix("torch."),
                "blocks": [[n, crc] for n, crc in zip(sizes, r.crcs)],
                "part": part,
            }  # fmt: skip
        return out

    def pieces(self) -> list[tuple[str, int, str, int, int]]:
        """What the checkpoint's copies of the files are made of, with every write submitted so far on disk: (this
        store's file, offset, the copy's file name, offset there, bytes)."""
        self.flush()
        for fd in self._fds:
            os.fsync(fd)
        return [
            (self.paths[r.file], r.offset, os.path.basename(self.paths[r.file]), r.copy_offset, r.nbytes)
            for regions in self.regions.values()
            for r in regions.values()
        ]

    def write(self, param: nn.Parameter, key: str, value: Tensor) -> None:
        """Store ``value`` (e.g. from a checkpoint; any float dtype; all of ``param``'s rows) as ``param``'s ``key``
        state: the rows held here."""
        if param not in self.regions:
            return
        region = self.regions[param][key]
        if param.dim():
            value = value[self.first[param] : self.first[param] + self._shapes[param][0]]

        def write(block: int, part: Tensor, buffer: Tensor) -> None:
            self._typed(buffer, key, part.shape).copy_(part)
            self._write(region, block, buffer)

        self._each_block(param, region, value, write)

    def read(self, param: nn.Parameter, key: str, out: Tensor | None = None) -> Tensor:
        """``param``'s ``key`` state, the rows held here, in ``out`` (all of ``param``'s rows; default: a new fp32
        tensor), CRC-checked."""
        self.flush()
        out = torch.empty(param.shape, dtype=torch.float32) if out is None else out
        if param not in self.regions:
            return out
        region = self.regions[param][key]
        value = out[self.first[param] : self.first[param] + self._shapes[param][0]] if param.dim() else out

        def read(block: int, part: Tensor, buffer: Tensor) -> None:
            if region.crcs[block] is None:
                part.zero_()
                return
            self._read(region, block, buffer, f"{key} of {self._names[param]}")
            part.copy_(self._typed(buffer, key, part.shape))

        self._each_block(param, region, value, read)
        return out

    def _each_block(self, param: nn.Parameter, region: _Region, value: Tensor, move) -> None:
        # move(block, the block's part of value, a pooled buffer) on the I/O threads, all blocks at once
        def one(block: int, rows: slice | None) -> None:
            start, end = region.block(block)
            buffer = self._take(end - start)
            try:
                move(block, value if rows is None else value[rows], buffer)
            finally:
                self._give(buffer)

        for future in [self._io.submit(one, block, rows) for rows, block in self.blocks(param, None)]:
            future.result()

    def close(self) -> None:
        """Finish pending I/O, close and remove the files."""
        self._io.shutdown(wait=True)
        while self._fds:
            os.close(self._fds.pop())
        shutil.rmtree(self.dir, ignore_errors=True)
        os.close(self._owner)  # the lock goes with its file descriptor


def merged(parts: list[dict]) -> dict:
    """The checkpoint's reference of a tensor from :meth:`NvmeStateStore.reference`'s of its parts (each process's
    rows; in any order)."""
    parts = sorted(parts, key=lambda ref: ref["part"])
    return {**{k: v for k, v in parts[0].items() if k != "part"}, "blocks": [b for ref in parts for b in ref["blocks"]]}


def _held(param: Tensor, rows: slice | None) -> tuple[int, int]:
    # (first row, rows) of ``param`` that a store holds, given its share (SharedHost.rows)
    if rows is None:
        return 0, _rows(param)
    if not param.dim():
        return 0, 0  # a scalar's other process holds it
    return rows.start, max(0, min(rows.stop, param.shape[0]) - rows.start)
