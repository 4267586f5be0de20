"""The NVMe tier: the optimizer's moment tensors live in files, one per unit (a block, the head, ...), instead of
in RAM. A parameter's state is read into pooled, page-aligned buffers ahead of its update (as soon as its
gradients are on their way, up to ``max_ahead_bytes`` of state in RAM) and written behind it. One ordering thread
takes the reads and writes in submission order, so a read always sees the write submitted before it; each of them
splits its regions into chunks that a few threads move and checksum at once (a single thread reaching the disk
one request at a time, checksumming in between, got 1.1 GB/s of the 2.5-3 GB/s dd gets on the H200 machine).

Files sit in a private directory (0700) made under ``nvme_path``, are private (0600), opened with ``O_DIRECT``
where the file system allows it (page-aligned buffers, offsets and sizes), carry a CRC-32 per chunk of a region
that is checked on every read, and are removed when training ends. A region never written reads as zeros (Adam's
initial state) without touching the disk.

Checkpoints: :meth:`NvmeStateStore.reference` describes where a parameter's state lies (file, offset, shape, CRCs);
the checkpoint holds these references and a copy of the files (``checkpoint_io.py``), so the state never passes
through RAM whole; :meth:`write` puts loaded state back.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .transfer import aligned_empty

ALIGN = 4096
READ_AHEAD_BYTES = 512 << 20  # state read ahead and not yet used, at most
CHUNK_BYTES = 16 << 20  # one read or write request, and one checksum (a multiple of ALIGN)


class NvmeStateError(RuntimeError):
    """Optimizer state on disk is missing, short or corrupt."""


@dataclass
class _Region:
    file: int  # index into the store's files
    offset: int
    nbytes: int
    crcs: list[int] | None = None  # one per chunk; None: never written (zeros)

    def chunks(self) -> list[tuple[int, int]]:
        """(start, end) of each chunk, relative to the region; the last one ends at the region's aligned size."""
        size = _aligned(self.nbytes)
        return [(start, min(start + CHUNK_BYTES, size)) for start in range(0, size, CHUNK_BYTES)]


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class NvmeStateStore:
    """Optimizer state tensors (``keys``, each shaped like its fp32 parameter) of ``units`` in files.

    Args:
        root: an existing, writable directory on the fast disk.
        units: (name, parameters) per file.
        keys: the state tensors per parameter, e.g. ``("exp_avg", "exp_avg_sq")``.
        max_ahead_bytes: state read ahead and not yet used may hold at most this much RAM.
        io_threads: chunks moved (and checksummed) at once.
    """

    def __init__(
        self,
        root: str,
        units: list[tuple[str, list[nn.Parameter]]],
        keys: tuple[str, ...],
        max_ahead_bytes: int = READ_AHEAD_BYTES,
        io_threads: int = 4,
    ) -> None:
        self.keys = keys
        self.max_ahead_bytes = max_ahead_bytes
        self.dir = tempfile.mkdtemp(prefix="lightning-slide-state-", dir=root)  # private: 0700
        self.paths: list[str] = []
        self._fds: list[int] = []
        self.direct = True
        self.regions: dict[nn.Parameter, dict[str, _Region]] = {}
        self._free: dict[int, list[Tensor]] = {}  # pooled page-aligned buffers by size
        self._loaned: dict[nn.Parameter, dict[str, Tensor]] = {}
        self._names: dict[nn.Parameter, str] = {}
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slide-nvme")  # all file I/O, in order
        self._chunk_pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="slide-nvme-chunk")
        self._ahead: dict[nn.Parameter, Future] = {}
        self._ahead_bytes = 0
        self._lock = threading.Lock()
        self._error: BaseException | None = None  # a failed write-behind, raised at the next load or flush
        try:
            for i, (name, params) in enumerate(units):
                offset = 0
                for p in params:
                    self._names[p] = f"{name}: {tuple(p.shape)}"
                    self.regions[p] = {}
                    for key in keys:
                        self.regions[p][key] = _Region(len(self.paths), offset, p.numel() * 4)
                        offset += _aligned(p.numel() * 4)
                path = os.path.join(self.dir, f"{i:04d}-{name or 'root'}.bin")
                self.paths.append(path)
                self._fds.append(self._open(path))
                os.ftruncate(self._fds[-1], offset)
        except BaseException:
            self.close()
            raise

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

    # ---- one parameter's state in RAM while it is updated ----------------------------------------------------

    def prefetch(self, params: list[nn.Parameter]) -> None:
        """Start reading the state of ``params`` (their updates come next), within ``max_ahead_bytes``."""
        with self._lock:
            for p in params:
                if p not in self.regions or p in self._ahead:
                    continue
                nbytes = self._state_bytes(p)
                if self._ahead_bytes + nbytes > self.max_ahead_bytes:
                    return
                self._ahead_bytes += nbytes
                self._ahead[p] = self._io.submit(self._read_param, p)

    def load(self, param: nn.Parameter) -> dict[str, Tensor]:
        """The state of ``param`` in pooled buffers (read ahead, or now), checked against its CRCs."""
        self._raise()
        with self._lock:
            future = self._ahead.pop(param, None)
            if future is not None:
                self._ahead_bytes -= self._state_bytes(param)
        buffers = (future or self._io.submit(self._read_param, param)).result()
        self._loaned[param] = buffers
        return {key: _as_state(buffers[key], param) for key in buffers}

    def save(self, param: nn.Parameter) -> None:
        """Write back ``param``'s state (updated in the buffers :meth:`load` gave), behind the caller."""
        self._io.submit(self._write_param, param, self._loaned.pop(param))

    def flush(self) -> None:
        """Wait for every write submitted so far (and raise a failed one)."""
        self._io.submit(lambda: None).result()
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _state_bytes(self, param: nn.Parameter) -> int:
        return sum(_aligned(r.nbytes) for r in self.regions[param].values())

    # ---- on the I/O thread -----------------------------------------------------------------------------------

    def _read_param(self, param: nn.Parameter) -> dict[str, Tensor]:
        buffers = {}
        for key, region in self.regions[param].items():
            buffer = self._take(_aligned(region.nbytes))
            if region.crcs is None:
                buffer.zero_()
            else:
                self._read(region, buffer, f"{key} of {self._names[param]}")
            buffers[key] = buffer
        return buffers

    def _write_param(self, param: nn.Parameter, buffers: dict[str, Tensor]) -> None:
        try:
            for key, buffer in buffers.items():
                self._write(self.regions[param][key], buffer)
                self._give(buffer)
        except BaseException as err:
            self._error = err

    def _write(self, region: _Region, buffer: Tensor) -> None:
        fd = self._fds[region.file]

        def write(chunk: tuple[int, int]) -> int:
            start, end = chunk
            written = os.pwritev(fd, [buffer[start:end].numpy()], region.offset + start)
            if written != end - start:
                raise NvmeStateError(f"Short write to {self.paths[region.file]} ({written} of {end - start} bytes).")
            return zlib.crc32(buffer[start : min(end, region.nbytes)].numpy())

        region.crcs = None  # until every chunk is on disk
        region.crcs = list(self._chunk_pool.map(write, region.chunks()))

    def _read(self, region: _Region, buffer: Tensor, what: str) -> None:
        fd = self._fds[region.file]

        def read(chunk: tuple[int, int]) -> tuple[bool, int]:
            start, end = chunk
            complete = os.preadv(fd, [buffer[start:end].numpy()], region.offset + start) == end - start
            return complete, zlib.crc32(buffer[start : min(end, region.nbytes)].numpy())

        results = list(self._chunk_pool.map(read, region.chunks()))
        complete = all(done for done, _ in results)
        if complete and [crc for _, crc in results] == region.crcs:
            return
        end = region.offset + region.nbytes
        raise NvmeStateError(
            f"Optimizer state in {self.paths[region.file]} ({what}, bytes {region.offset}..{end}) is"
            f" {'corrupt (checksum mismatch)' if complete else 'truncated'}. Training stops here; resume from the"
            " last checkpoint."
        )

    def _take(self, nbytes: int) -> Tensor:
        free = self._free.get(nbytes)
        return free.pop() if free else aligned_empty(nbytes, ALIGN)

    def _give(self, buffer: Tensor) -> None:
        self._free.setdefault(buffer.numel(), []).append(buffer)

    # ---- checkpoints -----------------------------------------------------------------------------------------

    def reference(self, param: nn.Parameter) -> dict[str, dict]:
        """Where ``param``'s state lies, per key: the file's name, the byte offset and size, the shape and the CRC of
        each chunk (``None``: never written, zeros). Plain data, for a checkpoint; call :meth:`flush` first."""
        return {
            key: {
                "nvme_state_file": os.path.basename(self.paths[r.file]),
                "offset": r.offset,
                "nbytes": r.nbytes,
                "shape": list(param.shape),
                "chunk_bytes": CHUNK_BYTES,
                "crcs": r.crcs,
            }  # fmt: skip
            for key, r in self.regions[param].items()
        }

    def synced_paths(self) -> list[str]:
        """The state files, with every write submitted so far on disk."""
        self.flush()
        for fd in self._fds:
            os.fsync(fd)
        return list(self.paths)

    def write(self, param: nn.Parameter, key: str, value: Tensor) -> None:
        """Store ``value`` (e.g. from a checkpoint) as ``param``'s ``key`` state."""

        def write() -> None:
            region = self.regions[param][key]
            buffer = self._take(_aligned(region.nbytes))
            _as_state(buffer, param).copy_(value)
            self._write(region, buffer)
            self._give(buffer)

        self._io.submit(write).result()

    def close(self) -> None:
        """Finish pending I/O, close and remove the files."""
        self._io.shutdown(wait=True)
        self._chunk_pool.shutdown(wait=True)
        while self._fds:
            os.close(self._fds.pop())
        shutil.rmtree(self.dir, ignore_errors=True)


def _as_state(buffer: Tensor, param: nn.Parameter) -> Tensor:
    return buffer[: param.numel() * 4].view(torch.float32).view(param.shape)
