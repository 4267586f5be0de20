"""Data parallel over the processes of a torch.distributed group: each unit's gradients are averaged as its backward
ends, so every process holds the same gradients, applies the same updates and keeps the same weights (as
``DistributedDataParallel``, whose gradients are the mean over the processes).

The processes of a node hold one copy of the state between them, each updating its rows (``shared_host.py``).

A unit's collectives start as its backward ends and run while the next unit's backward computes (as DDP's buckets
do): the training thread issues them (``async_op``), in the same order on every process, and the gradient sender
waits for them (``grads.py``), on the device by making its conversion stream wait, never the training stream.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch import Tensor

from .rows import Contribution, Rows
from .shared_host import stopped

BUCKET_NUMEL = 1 << 24  # fp32 elements averaged in one collective by average_in_place (64 MiB)


class DataParallel:
    """The gradients of one process averaged with the others' of the default group.

    Args:
        local_size: processes per node (they share out each gradient's rows).
        device: where the gradients are.
        timeout: of the node's and the nodes' groups (the default group's is set where it is made).
    """

    def __init__(
        self, local_size: int = 1, device: torch.device | None = None, timeout: datetime.timedelta | None = None
    ) -> None:
        self.size = dist.get_world_size()
        self._node = self._nodes = self._chain = None
        if local_size > 1:  # a node's processes split each gradient's rows (shared_host.py): their groups
            self._node, _ = dist.new_subgroups(local_size, timeout=timeout)
            if self.size > local_size:  # the processes of each local rank, one per node
                ranks = [list(range(r, self.size, local_size)) for r in range(local_size)]
                self._nodes, _ = dist.new_subgroups_by_enumeration(ranks, timeout=timeout)
                if device is not None and device.type == "cuda":  # it waits for the node's part, then the nodes'
                    self._chain = torch.cuda.Stream(device)

    @property
    def across_nodes(self):
        """With several nodes: the group of this process and those of its local rank on the other nodes (``None``:
        the default group, one process per node)."""
        return self._nodes

    def average(
        self, grads: dict[int, Contribution], unit: str, split: set[int] = frozenset()
    ) -> tuple[dict[int, Contribution], Callable[[], None]]:
        """Start averaging each contribution (by parameter index) of ``unit`` over the processes. Every process calls
        it for the same units in the same order (the backward's); a dense fp32 gradient is averaged in place.

        Returns the contributions, which hold the mean once the returned function has run (it waits for the
        collectives; on the device, the current stream waits for them).

        Args:
            split: the indices of gradients whose rows the node's processes share out (``SharedHost.rows``): each
                process gets the mean of its rows only (a reduce-scatter in the node, then an all-reduce across
                nodes), the other rows holding its own gradient.
        """
        out: dict[int, Contribution] = {}
        finishes: list[Callable[[], None]] = []
        with self._stopped(unit):
            for i, c in grads.items():
                if isinstance(c, Rows):
                    out[i] = self._rows(c)
                else:
                    out[i], finish = self._split(c) if i in split else self._dense(c)
                    finishes.append(finish)

        def wait() -> None:
            with self._stopped(unit):
                for finish in finishes:
                    finish()

        return out, wait

    @contextmanager
    def _stopped(self, unit: str) -> Iterator[None]:
        try:
            yield
        except RuntimeError as err:  # gloo raises it, NCCL its subclass DistBackendError
            raise stopped(f"Averaging the gradients of '{unit}'", self.size - 1) from err

    def average_in_place(self, grads: list[Tensor], what: str) -> None:
        """The mean over the processes, into each gradient (those the user's optimizer steps on the device): the
        gradients of a dtype and device go flat into buckets of at most ``BUCKET_NUMEL`` elements, one all-reduce
        each (as DDP's buckets; one per tensor took a collective's latency per parameter)."""
        groups: dict[tuple, list[Tensor]] = {}
        for grad in grads:
            groups.setdefault((grad.dtype, grad.device), []).append(grad)
        for group in groups.values():
            bucket: list[Tensor] = []
            for grad in group:
                if bucket and sum(g.numel() for g in bucket) + grad.numel() > BUCKET_NUMEL:
                    self._average_bucket(bucket, what)
                    bucket = []
                bucket.append(grad)
            self._average_bucket(bucket, what)

    def _average_bucket(self, grads: list[Tensor], what: str) -> None:
        if len(grads) == 1:  # no copy of a large gradient (an fp32 one is averaged in place)
            if (mean := self._mean(grads[0], what)) is not grads[0]:
                grads[0].copy_(mean)
            return
        mean = self._mean(torch.cat([g.reshape(-1).float() for g in grads]), what)
        offset = 0
        for grad in grads:
            grad.copy_(mean[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    def _mean(self, grad: Tensor, what: str) -> Tensor:
        mean, wait = self.average({0: grad}, what)
        wait()
        return mean[0]

    def _dense(self, grad: Tensor) -> tuple[Tensor, Callable[[], None]]:
        # summed in fp32 where the gradient is lower precision (DDP's gradients are those of fp32 parameters)
        total = grad.float() if grad.dtype != torch.float32 else grad
        work = dist.all_reduce(total, async_op=True)
        return total, lambda: (work.wait(), total.div_(self.size))

    def _split(self, grad: Tensor) -> tuple[Tensor, Callable[[], None]]:
        rows, size, rank = grad.shape[0], dist.get_world_size(self._node), dist.get_rank(self._node)
        per = -(-rows // size)
        if grad.dtype == torch.float32 and rows == per * size and grad.is_contiguous():
            flat = grad
        else:  # in fp32 (as _dense), padded to equal shares
            flat = torch.zeros((per * size, *grad.shape[1:]), dtype=torch.float32, device=grad.device)
            flat[:rows] = grad
        mine = flat[rank * per : (rank + 1) * per]
        # NOTE: in place, into this process's share of the input (NCCL's in-place form; gloo takes it too)
        work = dist.reduce_scatter_tensor(mine, flat, group=self._node, async_op=True)
        if self._nodes is not None:  # after it (on the CPU, gloo: the training thread waits for the node's part)
            with torch.cuda.stream(self._chain) if self._chain is not None else nullcontext():
                work.wait()
                work = dist.all_reduce(mine, group=self._nodes, async_op=True)
        return flat[:rows], lambda: (work.wait(), mine.div_(self.size))

    def _rows(self, rows: Rows) -> Rows:
        # the processes touched different rows: all of them, each process's in turn (duplicates add up where used)
        mine = rows.index.numel()
        count = torch.tensor([mine], dtype=torch.int64, device=rows.index.device)
        counts = [torch.empty_like(count) for _ in range(self.size)]
        dist.all_gather(counts, count)
        sizes = [int(c) for c in counts]
        most = max(sizes)
        index = torch.zeros(most, dtype=rows.index.dtype, device=rows.index.device)
        index[:mine] = rows.index
        values = torch.zeros((most, *rows.values.shape[1:]), dtype=torch.float32, device=rows.values.device)
        values[:mine] = rows.values
        indices = [torch.empty_like(index) for _ in range(self.size)]
        all_values = [torch.empty_like(values) for _ in range(self.size)]
        dist.all_gather(indices, index)
        dist.all_gather(all_values, values)
        index = torch.cat([t[:n] for t, n in zip(indices, sizes)])
        values = torch.cat([t[:n] for t, n in zip(all_values, sizes)])
        return Rows(index, values.div_(self.size))
