"""The NVMe tier's state directories under ``nvme_path``: each private (0700), recording its owner (process, host,
start) in a file the process holds a lock on, so that the kernel drops the lock with the process. A run killed
outright (SIGKILL, the OOM killer) leaves its directory behind, and the next run on the same ``nvme_path`` removes it
(:func:`sweep_stale_state`); a live run's is left alone and counted."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import socket
import tempfile
import time

from .machine import size_text

STATE_PREFIX = "lightning-slide-state-"
OWNER_FILE = ".owner"  # inside a state directory, locked by the process that uses it

log = logging.getLogger(__name__)


def make_state_dir(root: str) -> tuple[str, int]:
    """A new private state directory under ``root``, and the descriptor of its owner lock (held until closed)."""
    directory = tempfile.mkdtemp(prefix=STATE_PREFIX, dir=root)  # private: 0700
    return directory, hold_owner_lock(directory)


def hold_owner_lock(directory: str) -> int:
    """The owner file, locked for as long as the returned descriptor is open (the kernel closes it with the
    process)."""
    fd = os.open(os.path.join(directory, OWNER_FILE), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, started {time.ctime()}\n".encode())
    return fd


def sweep_stale_state(root: str) -> tuple[int, int]:
    """Remove the state directories under ``root`` whose process is gone (its owner lock is free, or it has none);
    returns the bytes removed and the bytes the live ones (other runs') hold."""
    removed = held = 0
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if not name.startswith(STATE_PREFIX) or os.path.islink(path) or not os.path.isdir(path):
            continue
        size = _tree_bytes(path)
        try:
            fd = os.open(os.path.join(path, OWNER_FILE), os.O_RDWR)
        except FileNotFoundError:
            if time.time() - os.stat(path).st_mtime < 60:
                held += size  # just made: its owner may be about to lock it
                continue
            fd = None  # made, but never owned: its process died at once
        except OSError:
            held += size  # not ours to judge (another user's)
            continue
        try:
            if fd is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    held += size  # a live run's
                    continue
                owner = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            else:
                owner = "unknown"
            shutil.rmtree(path, ignore_errors=True)
            removed += size
            log.warning("Removed %s (%s) under nvme_path, left by a run that was killed (%s).", name,
                        size_text(size), owner)  # fmt: skip
        finally:
            if fd is not None:
                os.close(fd)
    return removed, held


def _tree_bytes(path: str) -> int:
    # bytes of the files under ``path`` as allocated on disk
    return sum(os.lstat(os.path.join(d, f)).st_blocks * 512 for d, _, files in os.walk(path) for f in files)
