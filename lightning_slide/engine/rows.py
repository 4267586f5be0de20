"""Row arithmetic of the embedding's update, run on the CPU worker (``embedding.py`` decides when).

A batch touches few rows of the input embedding, yet the optimizer updates every row: Adam's moments decay and
weight decay applies where the gradient is zero. The update of an untouched row depends only on its state and the
step's hyperparameters, not on the gradient, so it can run as soon as the step is known to have a backward pass:

- **bulk** (:meth:`RowSplit.bulk`): every row's update with a zero gradient, chunk by chunk; the touched rows of each
  chunk are saved before and put back after, so they keep their state.
- **touched rows** (:meth:`RowSplit.apply`): only those rows' values and state are gathered, updated with their
  gradients by the same fused kernel, and scattered back.

Both parts are the same elementwise kernel as one update of the whole matrix, on the same values, so the result is
identical (``tests/test_engine.py`` checks it bitwise). On the device (:meth:`RowSplit.update_on_device`) that update
is torch's CUDA kernel: the same arithmetic, not the same last bits; on the CPU the same bits.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .optim import CpuOptimizer, Hypers


@dataclass
class Rows:
    """A gradient that is non-zero only in some rows: ``values[i]`` belongs to row ``index[i]``."""

    index: Tensor  # (U,) int64, on the device
    values: Tensor  # (U, ...) fp32, on the device


Contribution = Tensor | Rows  # what one backward gives a parameter: a whole gradient, or some of its rows


class RowSplit:
    """One step's two-part update of an embedding matrix.

    Args:
        param: the embedding weight (fp32 master, rows first).
        index: the distinct touched rows, sorted (host, int64).
        chunk_numel: elements per chunk of either part.
        pass_numel: elements of each tensor the touched rows' update gathers at a time.
        scratch: host buffers kept across steps, filled here on first use. NOTE: kept, because gathering rows into
            a fresh tensor is dominated by its page faults (``benchmarks/NOTES.md``).
        on_device: update the touched rows on the device (``embedding.py``); ``state`` is set before that.
        defer: the touched rows' update waits for the next gather (``embedding.py``).
    """

    def __init__(
        self,
        param: nn.Parameter,
        index: Tensor,
        chunk_numel: int,
        pass_numel: int,
        scratch: dict[str, Tensor],
        *,
        on_device: bool,
        defer: bool = False,
    ) -> None:
        self.param = param
        self.index = index
        self.rows_per_chunk = max(1, chunk_numel // param[0].numel())
        self.pass_numel = pass_numel
        self.received = False  # the touched rows' gradients reached the sender
        self.grad: Tensor | None = None  # the "forward" schedule: those gradients, kept until the update (embedding.py)
        self.on_device = on_device
        # on the device: the touched rows of each of `optimizer.state_like`'s tensors, uploaded before the update
        self.state: dict[str, Tensor] | None = None
        self.bulk_done: Future | None = None  # the bulk's task on the worker
        self.defer = defer
        # deferred: each chunk's first position in `index`, its landing buffer and the gradients landed in it
        self.landed: list[tuple[int, Tensor, Tensor]] = []
        self._scratch = scratch

    def _pass_rows(self) -> int:
        # rows the touched rows' update gathers at a time
        return max(1, self.pass_numel // self.param[0].numel())

    def _buffer(self, name: str, dtype: torch.dtype = torch.float32) -> Tensor:
        # rows for a bulk chunk or a pass of the touched rows' update, whichever is more
        rows = min(self.param.shape[0], max(self.rows_per_chunk, self._pass_rows()))
        shape = (rows, *self.param.shape[1:])
        scratch = self._scratch.get(name)
        if scratch is None or scratch.shape != shape or scratch.dtype != dtype:
            self._scratch[name] = scratch = torch.zeros(shape, dtype=dtype)
        return scratch

    def _gather(self, tensors: dict[str, Tensor], keep: Tensor) -> dict[str, Tensor]:
        return {k: torch.index_select(t, 0, keep, out=self._buffer(k, t.dtype)[: len(keep)])
                for k, t in tensors.items()}  # fmt: skip

    def bulk(self, optimizer: CpuOptimizer, hypers: Hypers) -> None:
        """Every row's update with a zero gradient; the touched rows keep their state (on the CPU worker)."""
        optimizer.begin(self.param, hypers)
        tensors = optimizer.state_like(self.param)
        rows = self.param.shape[0]
        zeros = self._buffer("zero gradient")
        for r0 in range(0, rows, self.rows_per_chunk):
            r1 = min(rows, r0 + self.rows_per_chunk)
            lo, hi = (int(i) for i in torch.searchsorted(self.index, torch.tensor([r0, r1])))
            keep = self.index[lo:hi]
            saved = self._gather(tensors, keep)
            optimizer.update([self.param], [zeros[: r1 - r0]], hypers, rows=[slice(r0, r1)])
            for k, t in tensors.items():
                t.index_copy_(0, keep, saved[k])

    def apply(
        self,
        optimizer: CpuOptimizer,
        lo: int,
        hi: int,
        grad: Tensor,
        hypers: Hypers,
        grad_scale: Tensor | None = None,
        *,
        only: Tensor | None = None,
    ) -> None:
        """The update of touched rows ``index[lo:hi]`` with their gradient ``grad`` (divided by ``grad_scale``: the
        clipping coefficient), on the CPU worker; ``only``: of those, just where it is true."""
        tensors = optimizer.state_like(self.param)
        rows = self._pass_rows()
        index = self.index[lo:hi]
        at = None if only is None else only.nonzero().squeeze(1)
        if at is not None:
            index = index[at]
        for a in range(0, len(index), rows):
            b = min(len(index), a + rows)
            keep = index[a:b]
            gathered = self._gather(tensors, keep)
            part = grad[a:b] if at is None else self._gather({"grad": grad}, at[a:b])["grad"]
            optimizer.update_gathered(self.param, gathered, part, hypers, grad_scale, index=keep)
            for k, t in tensors.items():
                t.index_copy_(0, keep, gathered[k])

    def apply_landed(self, optimizer: CpuOptimizer, hypers: Hypers, only: Tensor) -> None:
        """The deferred update of the touched rows where ``only`` (over ``index``) is true (on the CPU worker)."""
        for lo, _, grad in self.landed:
            self.apply(optimizer, lo, lo + len(grad), grad, hypers, only=only[lo : lo + len(grad)])

    def update_on_device(
        self, optimizer: CpuOptimizer, grad: Tensor, hypers: Hypers, grad_scale: Tensor | None = None
    ) -> None:
        """The touched rows' update on their device copies ``state``, once the bulk has counted the step."""
        self.bulk_done.result()
        optimizer.update_gathered(self.param, self.state, grad, hypers, grad_scale, index=self.index)

    def write_back(self, optimizer: CpuOptimizer, name: str, lo: int, values: Tensor) -> None:
        """Put rows ``index[lo:lo + len(values)]`` of the device-updated ``state[name]`` into the host's tensor (on the
        CPU worker)."""
        target = optimizer.state_like(self.param)[name]
        # bf16 moments land widened, exactly: narrowed again here
        target.index_copy_(0, self.index[lo : lo + len(values)], values.to(target.dtype))


@dataclass
class RowCopy:
    """The rows a step's device update produced, kept on the device until the host holds them too. It exists only
    after the step's bulk has run, so the rows outside ``index`` are final in RAM."""

    index: Tensor  # the rows, sorted (host)
    values: Tensor  # their updated values (device)
    event: object  # the update is done on the device (None on the CPU)
    landed: Future  # done when the host's masters and state hold the update

    def find(self, index: Tensor) -> tuple[Tensor, Tensor]:
        """For sorted rows ``index`` (host): which of them this copy holds, and where (both host tensors)."""
        at = torch.searchsorted(self.index, index).clamp_(max=len(self.index) - 1)
        return self.index[at] == index, at
