"""The CPU worker: one thread that runs gradient absorption and optimizer updates in submission order."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch


class CpuWorker:
    """Runs tasks on one background thread, first in, first out.

    NOTE: one thread, not a pool. Tasks touch the same optimizer state and gradient buffers, and a single
    FIFO makes "this task's future is done" mean "every task submitted before it is done" — the engine's
    dependency tracking rests on that. The heavy kernels (fused AdamW) are multi-threaded inside torch.

    After a task fails, every later task fails with the same error without running, so no update is applied
    after a fault; the error reaches the training thread at its next wait.

    Args:
        num_threads: intra-op threads for this worker's torch kernels (``None`` keeps torch's default).
    """

    def __init__(self, *, num_threads: int | None = None) -> None:
        self._error: BaseException | None = None
        self.busy_s = 0.0  # seconds spent running tasks (for the benchmark's timeline)
        self.wait_s = 0.0  # seconds spent waiting for the device before a task could run
        # when a list: each task's (name, perf_counter when it was taken up, when it began to run, when it ended)
        self.timeline: list[tuple[str, float, float, float]] | None = None
        self._lock = threading.Lock()
        self._last: Future | None = None
        self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="slide-cpu", initializer=_set_threads, initargs=(num_threads,)
        )

    @property
    def error(self) -> BaseException | None:
        return self._error

    def submit(self, fn: Callable[..., Any], *args: Any, after: Any = None) -> Future:
        """Run ``fn(*args)`` after every earlier task and, if given, after the CUDA event ``after``."""
        with self._lock:
            self._last = self._pool.submit(self._run, fn, args, after)
            return self._last

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def drain(self) -> None:
        """Wait until every submitted task has run; raise the first task error, if any."""
        with self._lock:
            last = self._last
        if last is not None:
            last.result()
        self.raise_if_failed()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)

    def _run(self, fn: Callable[..., Any], args: tuple, after: Any) -> Any:
        if self._error is not None:
            raise self._error
        taken = time.perf_counter()
        if after is not None:
            after.synchronize()
            self.wait_s += time.perf_counter() - taken
        start = time.perf_counter()
        try:
            return fn(*args)
        except BaseException as err:
            self._error = err
            raise
        finally:
            end = time.perf_counter()
            self.busy_s += end - start
            if self.timeline is not None:
                self.timeline.append((getattr(fn, "__name__", type(fn).__name__), taken, start, end))


def _set_threads(num_threads: int | None) -> None:
    # NOTE: set in the worker thread itself; the training thread keeps its own setting.
    if num_threads is not None:
        torch.set_num_threads(num_threads)
