"""One copy of the state per host: the processes of a node hold the masters, the optimizer state and the retained
gradients once, in shared memory, and each updates its own rows of every parameter.

Each process maps the same files of ``/dev/shm`` (unlinked once all have mapped them, so nothing outlives the
processes). A process moves to the host, and updates, only its share of each parameter's leading rows (``rows``); the
others' rows are there already, in the same pages. So no update is gathered: a unit's update ends on the CPU worker
with a barrier of the node's processes (``barrier``), after which any of them may send the unit's weights to its
device. Nodes each hold a copy and apply the same averaged gradients, as DDP's replicas do.

The model's weights are held once too: a node's other processes drop what they loaded (``drop_weights``; a module
built on the meta device holds nothing to drop) before the plan reads the RAM, and take the first process's values:
mapped, where the state is shared, or received (``SharedHost.from_first``) where each process keeps its own copy.
"""

from __future__ import annotations

import datetime
import mmap
import os
import uuid
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from .machine import size_text

SHM = "/dev/shm"


class SharedHost:
    """The shared memory and the row shares of one node's processes.

    Args:
        local_rank: this process's index on its node.
        local_size: processes per node (the global ranks of a node are consecutive, as Lightning numbers them).
        timeout: how long a process waits for the others at a barrier.
    """

    def __init__(self, local_rank: int, local_size: int, *, timeout: datetime.timedelta) -> None:
        self.rank, self.size = local_rank, local_size
        # gloo groups of the node: one for the CPU worker's barriers, one for the training thread (collectives of one
        # group must come in the same order on every process; the two threads' would interleave)
        self._worker_group, _ = dist.new_subgroups(local_size, backend="gloo", timeout=timeout)
        self._main_group, _ = dist.new_subgroups(local_size, backend="gloo", timeout=timeout)
        name = [f"lightning-slide-{uuid.uuid4().hex}" if local_rank == 0 else None]
        dist.broadcast_object_list(name, dist.get_global_rank(self._main_group, 0), group=self._main_group)
        self._prefix = os.path.join(SHM, name[0])
        self._count = 0

    @classmethod
    def on_paper(cls, local_size: int) -> SharedHost:
        """A node of ``local_size`` processes for a plan only (``slide plan``): its first process, no group, no
        memory."""
        host = cls.__new__(cls)
        host.rank, host.size = 0, local_size
        return host

    def rows(self, param: Tensor) -> slice | None:
        """The leading rows of ``param`` this process moves and updates (``None``: all of it, a scalar's owner)."""
        if param.dim() == 0:
            return None if self.rank == 0 else slice(0, 0)
        per = -(-param.shape[0] // self.size)  # equal shares (the last ones short): a reduce-scatter's (world.py)
        start = min(self.rank * per, param.shape[0])
        return slice(start, min(start + per, param.shape[0]))

    def tensors(self, sizes: list[tuple[int, torch.dtype]]) -> list[Tensor]:
        """Flat tensors of these sizes, the same memory in every process of the node (zeros when new). Every process
        calls it with the same sizes at the same point."""
        pages = [_pages(n * _itemsize(d)) for n, d in sizes]
        needed, free = sum(pages), _shm_free()
        if needed > free:  # every process sees it, and stops
            raise MemoryError(
                f"The processes of this node keep their state once, in shared memory ({SHM}), which needs"
                f" {size_text(needed)} but has {size_text(free)} free. Enlarge {SHM} (a container:"
                " `docker run --shm-size=...`), or run one process per node."
            )
        paths = [f"{self._prefix}-{self._count + i}" for i in range(len(sizes))]
        self._count += len(sizes)
        if self.rank == 0:
            for path, nbytes in zip(paths, pages):
                with open(path, "xb") as f:
                    f.truncate(nbytes)
        self.main_barrier()
        out = [
            torch.from_file(path, shared=True, size=nbytes // _itemsize(d), dtype=d)
            for path, nbytes, (_, d) in zip(paths, pages, sizes)
        ]
        self.main_barrier()  # every process has them mapped: the names may go
        if self.rank == 0:
            for path in paths:
                os.unlink(path)
        return [t[:n] for t, (n, _) in zip(out, sizes)]

    def hold_masters(self, owned: list[list[Tensor]], pin: Callable[..., None]) -> None:
        """The masters in memory the node's processes share: each unit's ``owned`` parameters of one dtype in one flat
        tensor, the first process's values (``pin(params, flat, fill=...)``, ``Transfer.pin``, moves them there)."""
        dtypes = [dict.fromkeys(p.dtype for p in params) for params in owned]
        groups = [[p for p in params if p.dtype == d] for params, ds in zip(owned, dtypes) for d in ds]
        flats = self.tensors([(sum(p.numel() for p in group), group[0].dtype) for group in groups])
        for group, flat in zip(groups, flats):
            pin(group, flat, fill=self.rank == 0)
        self.main_barrier()  # the first process's values are in

    def hold_state(
        self, state: dict[tuple[Tensor, str], Tensor], params: list[Tensor], keys: tuple[str, ...],
        dtype_of: Callable[[Tensor], torch.dtype],
    ) -> None:  # fmt: skip
        """The optimizer state of ``params`` (each of ``keys``, of ``dtype_of(param)``) in memory the node's processes
        share, into ``state`` (``CpuOptimizer.shared_state``, taken when the state is created)."""
        tensors = self.tensors([(p.numel(), dtype_of(p)) for p in params for _ in keys])
        for i, (p, key) in enumerate((p, key) for p in params for key in keys):
            state[p, key] = tensors[i].view(p.shape)

    def from_first(self, tensors: list[Tensor]) -> None:
        """The node's first process's values of ``tensors`` into the others' (which hold none: ``drop_weights``)."""
        for tensor in tensors:
            if self.rank:
                tensor.data = torch.empty(tensor.shape, dtype=tensor.dtype)
            try:
                dist.broadcast(tensor.data, group=self._main_group, group_src=0)
            except RuntimeError as err:
                raise stopped("Receiving the weights", self.size - 1) from err

    def gather(self, value: object) -> list:
        """Every process's ``value`` (picklable), in the order of their ranks (the training thread's)."""
        out = [None] * self.size
        try:
            dist.all_gather_object(out, value, group=self._main_group)
        except RuntimeError as err:
            raise stopped("Gathering the state's references", self.size - 1) from err
        return out

    def barrier(self) -> None:
        """Wait for the node's other processes (the CPU worker's: each calls it after the same update)."""
        self._all_reduce(torch.zeros(1), dist.ReduceOp.SUM, self._worker_group, "Updating")

    def all_true(self, ok: bool) -> bool:
        """Whether ``ok`` holds in every process of the node (the CPU worker's)."""
        return bool(self._all_reduce(torch.tensor([int(ok)]), dist.ReduceOp.MIN, self._worker_group, "Checking"))

    def sum(self, value: float) -> float:
        """``value`` summed over the node's processes (the training thread's)."""
        total = torch.tensor([value], dtype=torch.float64)
        return float(self._all_reduce(total, dist.ReduceOp.SUM, self._main_group, "Summing the gradient norm"))

    def main_barrier(self) -> None:
        """Wait for the node's other processes (the training thread's)."""
        self._all_reduce(torch.zeros(1), dist.ReduceOp.SUM, self._main_group, "Sharing the state")

    def _all_reduce(self, value: Tensor, op, group, what: str) -> float:
        try:
            dist.all_reduce(value, op=op, group=group)
        except RuntimeError as err:  # a dead process closes gloo's connections
            raise stopped(what, self.size - 1) from err
        return value.item()


def drop_weights(module: torch.nn.Module) -> None:
    """Every parameter of ``module`` keeps its shape and dtype but no memory (``placeholder``): its values come from
    the node's first process at setup; a buffer on the meta device gets memory (for the first process's values)."""
    with torch.no_grad():
        for param in module.parameters():
            if param.is_meta:  # its data cannot be set to a CPU tensor: the object takes another's contents
                empty = torch.nn.Parameter(placeholder(param.shape, param.dtype), param.requires_grad)
                empty.__dict__.update(param.__dict__)
                torch.utils.swap_tensors(param, empty)
            else:
                param.data = placeholder(param.shape, param.dtype)
        for name, owner in [(n, m) for m in module.modules() for n, b in m.named_buffers(recurse=False) if b.is_meta]:
            owner._buffers[name] = torch.empty_like(owner._buffers[name], device="cpu")


def placeholder(shape: torch.Size, dtype: torch.dtype) -> Tensor:
    """A CPU tensor of ``shape`` and ``dtype`` holding one element (every stride 0): no values, no memory."""
    return torch.empty((), dtype=dtype).expand(shape)


def is_placeholder(tensor: Tensor) -> bool:
    return tensor.numel() > 1 and not any(tensor.stride())


def stopped(what: str, others: int) -> RuntimeError:
    """The error of a collective that failed because another process stopped."""
    return RuntimeError(
        f"{what} with the other {others} process(es) failed: one of them stopped (killed, out of memory, or an error:"
        " see its log above), or timed out."
    )


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _pages(nbytes: int) -> int:
    # whole pages: the mapping may be registered with the driver (pinned) without sharing a page with another
    return max(mmap.PAGESIZE, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)


def _shm_free() -> int:
    stat = os.statvfs(SHM)
    return stat.f_bavail * stat.f_frsize
