"""What the machine has: the RAM the process may still take, the locked-memory limit and the GPU memory left. The
planner (``planner.py``) takes these figures as arguments; only this module reads the machine. ``size_text`` says
how many bytes in the unit that fits."""

from __future__ import annotations

import os
import resource

import torch

from ..kernels.linear_cross_entropy import device_room


def available_host_bytes() -> int:
    """RAM this process may still take: the kernel's MemAvailable, within the cgroup's limit if there is one."""
    available = None
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                available = min(available, int(limit) - int(f.read()))
    except OSError:
        pass
    return available if available is not None else 1 << 62


def locked_memory_limit() -> int | None:
    """The soft ``ulimit -l`` in bytes, or ``None`` if unlimited (root usually is)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or os.geteuid() == 0:
        return None
    return soft


def device_budget(device: torch.device) -> int | None:
    """:func:`~lightning_slide.kernels.linear_cross_entropy.device_room` on CUDA; ``None`` off CUDA."""
    return device_room(device) if device.type == "cuda" else None


def size_text(nbytes: int) -> str:
    """``nbytes`` in the binary unit that fits it (GiB, MiB, KiB or bytes)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.2f} {unit}"
    return f"{nbytes} bytes"
