"""Copies between host and device: side streams, events, staging and the pool of host landing buffers.

On CUDA, uploads run on one side stream and gradient downloads on another, both ordered against the compute
stream with events, from pinned host memory; their dtype conversions run on two more (see ``Transfer``). On the
CPU the same calls become plain synchronous copies with no events and no pinning (CPU builds of torch cannot pin),
so the engine around them runs unchanged.

Large host buffers are pinned by registering ordinary pages with the driver (``cudaHostRegister``), not with
``pin_memory=True``: torch's pinned-memory allocator rounds every request up to a power of two, which turned
a 2.1 GB embedding into 4 GiB of locked memory. Registered buffers are released when the ``Transfer`` closes.
"""

from __future__ import annotations

import mmap
import queue
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from .config import EngineConfig


class PinnedMemoryError(RuntimeError):
    """Host memory could not be pinned."""


STAGES = 3  # device staging chunks each way: uploads that convert, gradients (see Transfer)


def aligned_empty(nbytes: int, align: int) -> Tensor:
    """``nbytes`` of uninitialized host memory (uint8) starting at an ``align``-byte boundary (torch's CPU
    allocations are only 64-byte aligned; O_DIRECT and page registration need more)."""
    raw = torch.empty(nbytes + align, dtype=torch.uint8)
    return raw[(-raw.data_ptr()) % align :][:nbytes]


def _place(params: list[torch.nn.Parameter], flat: Tensor, fill: bool) -> None:
    # each parameter becomes a view of the flat tensor, in order
    offset = 0
    for p in params:
        view = flat[offset : offset + p.numel()].view(p.shape)
        if fill:
            view.copy_(p.data)
        p.data = view
        offset += p.numel()


def _cuda_register(ptr: int, nbytes: int) -> int:
    return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))


def _cuda_unregister(ptr: int) -> int:
    return int(torch.cuda.cudart().cudaHostUnregister(ptr))


class Transfer:
    """Host <-> device copies for one device.

    Args:
        device: the compute device.
        chunk_numel: elements per staging chunk; large tensors move chunk by chunk through fixed buffers.
        landing_buffers: number of host landing buffers (each ``chunk_numel`` fp32) for gradients.
        register_min_bytes: pinned buffers from this size are registered pages; smaller ones come from torch's pinned
            allocator (its rounding up to a power of two is negligible there).
    """

    def __init__(
        self, device: torch.device, *, chunk_numel: int, landing_buffers: int, register_min_bytes: int = 1 << 20
    ) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.chunk_numel = chunk_numel
        self.landing_count = landing_buffers
        self.register_min_bytes = register_min_bytes
        self.upload_stream = torch.cuda.Stream(device) if self.is_cuda else None
        self.download_stream = torch.cuda.Stream(device) if self.is_cuda else None
        # NOTE: uploads convert fp32 masters to bf16 on the device (PCIe has room to spare; the CPU does not), and
        # gradients leave upcast to fp32. Both conversions run through rings of staging chunks, on high-priority
        # streams of their own, so a copy need not wait for a conversion that waits for SMs held by the compute
        # stream's matmuls (benchmarks/NOTES.md, "Staging rings").
        self._up_convert = torch.cuda.Stream(device, priority=-1) if self.is_cuda else None
        self._up_stages = _StagingRing(STAGES, chunk_numel, device) if self.is_cuda else None
        self._down_convert = torch.cuda.Stream(device, priority=-1) if self.is_cuda else None
        self._down_stages = _StagingRing(STAGES if self.is_cuda else 1, chunk_numel, device)
        self._registered: list[Tensor] = []
        self._landing: queue.SimpleQueue[Tensor] = queue.SimpleQueue()
        for _ in range(landing_buffers):
            self._landing.put(self.host_empty(chunk_numel))

    def host_empty(self, numel: int, dtype: torch.dtype = torch.float32) -> Tensor:
        """A flat host tensor, pinned when the device is CUDA."""
        if not self.is_cuda:
            return torch.empty(numel, dtype=dtype)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        try:
            if nbytes < self.register_min_bytes:
                return torch.empty(numel, dtype=dtype, pin_memory=True)
            return self._register(nbytes).view(dtype)
        except PinnedMemoryError:
            raise
        except RuntimeError as err:
            raise PinnedMemoryError(
                f"Could not pin {nbytes / 2**30:.2f} GiB of host memory ({err}). Check `ulimit -l` (locked-memory"
                " limit) and free RAM, or lower the memory the run needs (fewer window slots, a smaller landing"
                " pool)."
            ) from err

    def pin(self, params: list[torch.nn.Parameter], into: Tensor | None = None, *, fill: bool = True) -> None:
        """Move ``params`` (one unit's, all on the host) into pinned memory, one flat buffer per dtype (fp32 masters,
        bf16 frozen weights); pinned already (e.g. a second fit() of the same module): left as they are.

        Args:
            into: a flat tensor of whole pages for all of them (one dtype; memory shared with other processes,
                ``shared_host.py``): registered with the driver when the device is CUDA, and used as it is.
            fill: copy the values into ``into`` (another process does it otherwise).
        """
        if into is not None:
            if self.is_cuda:
                self.register(into)
            _place(params, into, fill)
            return
        if not params or all(p.is_pinned() for p in params):
            return
        for dtype in dict.fromkeys(p.dtype for p in params):
            group = [p for p in params if p.dtype == dtype]
            _place(group, self.host_empty(sum(p.numel() for p in group), dtype), True)

    def register(self, pages: Tensor) -> Tensor:
        """Pin the host memory of ``pages`` (a tensor starting on a page, of whole pages) until :meth:`close`."""
        nbytes = pages.numel() * pages.element_size()
        code = _cuda_register(pages.data_ptr(), -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
        if code != 0:
            raise PinnedMemoryError(
                f"Could not pin {nbytes / 2**30:.2f} GiB of host memory (cudaHostRegister: CUDA error {code}). Check"
                " `ulimit -l` (locked-memory limit) and free RAM, or lower the memory the run needs (fewer window"
                " slots, a smaller landing pool)."
            )
        self._registered.append(pages)
        return pages

    def _register(self, nbytes: int) -> Tensor:
        # Whole pages of a private allocation are registered, so no page is shared with another buffer (a page
        # registered twice is an error).
        size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        return self.register(aligned_empty(size, mmap.PAGESIZE))[:nbytes]

    def close(self) -> None:
        """Unregister the host memory this object pinned (the tensors stay valid, as pageable memory); drop the landing
        buffers."""
        if self._registered:
            torch.cuda.synchronize(self.device)  # no copy may still use it
        while self._registered:
            _cuda_unregister(self._registered.pop().data_ptr())
        while not self._landing.empty():
            self._landing.get_nowait()

    def record(self, stream: torch.cuda.Stream | None = None) -> torch.cuda.Event | None:
        """An event at the current point of ``stream`` (default: the current stream); ``None`` on the CPU."""
        if not self.is_cuda:
            return None
        # NOTE: blocking: a thread that synchronizes on it sleeps instead of spinning on the driver, which would
        # take a core from the CPU optimizer and contend with the thread launching GPU work.
        event = torch.cuda.Event(blocking=True)
        event.record(stream or torch.cuda.current_stream(self.device))
        return event

    def wait(self, event: torch.cuda.Event | None) -> None:
        """Make the current stream wait for ``event``."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def upload(
        self, pairs: list[tuple[Tensor, Tensor]], after: torch.cuda.Event | tuple | None
    ) -> torch.cuda.Event | None:
        """Copy each host ``src`` into its device ``dst`` (converting dtype) once ``after`` (an event, or a tuple of
        events and ``None``) has passed.

        Returns:
            an event marking the copies done (``None`` on the CPU, where they are done on return).
        """
        if not self.is_cuda:
            for src, dst in pairs:
                dst.copy_(src)
            return None
        up, cast = self.upload_stream, self._up_convert
        converted = None
        with torch.cuda.stream(up):
            for event in after if isinstance(after, tuple) else (after,):
                if event is not None:
                    up.wait_event(event)
            for src, dst in pairs:
                if src.dtype == dst.dtype:
                    dst.copy_(src, non_blocking=True)
                    continue
                src_flat, dst_flat = src.view(-1), dst.view(-1)
                for start in range(0, src_flat.numel(), self.chunk_numel):
                    n = min(self.chunk_numel, src_flat.numel() - start)
                    stage = self._up_stages.take(n, up)
                    stage.copy_(src_flat[start : start + n], non_blocking=True)
                    cast.wait_event(self.record(up))
                    with torch.cuda.stream(cast):
                        dst_flat[start : start + n].copy_(stage)
                    converted = self.record(cast)
                    self._up_stages.read_until(stage, converted)
            if converted is not None:  # the conversions run in order: the last one's event covers them all
                up.wait_event(converted)
            return self.record(up)

    @contextmanager
    def on_download_stream(self, after: torch.cuda.Event | None) -> Iterator[None]:
        """Run the enclosed device work on the download stream, after ``after``."""
        with self._on(self.download_stream, after):
            yield

    @contextmanager
    def converting(self, after: torch.cuda.Event | None) -> Iterator[None]:
        """Run the enclosed device work — kernels that fill download staging chunks (:meth:`down_stage`) — on the
        conversion stream, after ``after``."""
        with self._on(self._down_convert, after):
            yield

    @contextmanager
    def _on(self, stream: torch.cuda.Stream | None, after: torch.cuda.Event | None) -> Iterator[None]:
        if not self.is_cuda:
            yield
            return
        with torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            yield

    def down_stage(self, numel: int) -> Tensor:
        """The next device staging chunk for a download (within :meth:`converting`, which then waits until the
        chunk's previous contents have left)."""
        return self._down_stages.take(numel, self._down_convert)

    def download(self, stage: Tensor, target: Tensor) -> torch.cuda.Event | None:
        """Copy a staging chunk filled on the conversion stream into the host tensor ``target``.

        Returns:
            an event marking the copy done (``None`` on the CPU, where it is done on return).
        """
        if not self.is_cuda:
            target.copy_(stage)
            return None
        self.download_stream.wait_event(self.record(self._down_convert))
        with torch.cuda.stream(self.download_stream):
            target.copy_(stage, non_blocking=True)
        done = self.record(self.download_stream)
        self._down_stages.read_until(stage, done)
        return done

    def keep_alive(self, tensor: Tensor) -> None:
        """Tell the caching allocator that ``tensor`` is still read by the current (side) stream."""
        if self.is_cuda:
            tensor.record_stream(torch.cuda.current_stream(self.device))

    def take_landing(self, check: Callable[[], None]) -> Tensor:
        """A free host landing buffer; blocks until the CPU worker returns one (back-pressure).

        Args:
            check: called while waiting; raises if the worker has failed (it then returns no buffers).
        """
        while True:
            try:
                return self._landing.get(timeout=0.5)
            except queue.Empty:
                check()

    def give_landing(self, buffer: Tensor) -> None:
        self._landing.put(buffer)

    def drop_landing(self, keep: int) -> None:
        """Free all but ``keep`` of the landing buffers (call while none is in use)."""
        while self._landing.qsize() > keep:
            self.release(self._landing.get_nowait())
        self.landing_count = min(self.landing_count, keep)

    def release(self, buffer: Tensor) -> None:
        """Unpin a buffer from :meth:`host_empty` that no copy uses any more (it is freed with its last tensor)."""
        registered = next((i for i, r in enumerate(self._registered) if r.data_ptr() == buffer.data_ptr()), None)
        if registered is not None:
            _cuda_unregister(self._registered.pop(registered).data_ptr())


class _StagingRing:
    """fp32 device staging chunks, taken in turn; a chunk is handed out again only after the work that last read it."""

    def __init__(self, count: int, numel: int, device: torch.device) -> None:
        self._chunks = [torch.empty(numel, dtype=torch.float32, device=device) for _ in range(count)]
        self._read: list[torch.cuda.Event | None] = [None] * count  # the end of each chunk's last reader
        self._next = 0

    def take(self, numel: int, stream: torch.cuda.Stream | None) -> Tensor:
        """The next chunk's first ``numel`` elements; ``stream`` (``None`` on the CPU) first waits for its last
        reader."""
        i, self._next = self._next, (self._next + 1) % len(self._chunks)
        if self._read[i] is not None:
            stream.wait_event(self._read[i])
        return self._chunks[i][:numel]

    def read_until(self, chunk: Tensor, event: torch.cuda.Event | None) -> None:
        """The work reading ``chunk`` (from :meth:`take`) ends at ``event``."""
        self._read[next(i for i, c in enumerate(self._chunks) if c.data_ptr() == chunk.data_ptr())] = event


def landing_buffer_count(config: EngineConfig, grad_numel: int, chunk_numel: int, *, nvme: bool, retained: bool) -> int:
    """Pinned landing buffers for gradients on their way to the CPU optimizer: ``config``'s, but no more than one
    step's ``grad_numel`` gradient elements fill (a small model would pin GiBs for nothing); fewer with the state on
    disk (``nvme``: the disk sets the pace, and gradients waiting for it would only take RAM), and two where each
    gradient goes straight into its ``retained`` host buffer (only a second gradient of a weight in one step lands)."""
    most = min(config.landing_buffers, config.nvme_landing_buffers) if nvme else config.landing_buffers
    if retained:
        most = min(most, 2)
    return min(most, -(-grad_numel // chunk_numel) + 1)
