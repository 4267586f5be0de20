"""The embedding's update in two parts: the rows the step's tokens touched, and all the others.

A batch touches few rows of the input embedding, yet the optimizer updates every row: Adam's moments decay and
weight decay applies where the gradient is zero. The update of an untouched row depends only on its state and the
step's hyperparameters, not on the gradient, so it can run as soon as the step is known to have a backward pass:

- **bulk** (when the backward starts): every row's update with a zero gradient, chunk by chunk; the touched rows of
  each chunk are saved before and put back after, so they keep their state.
- **touched rows** (when their gradients arrive, the last of the backward pass; with the "forward" schedule, once
  the global norm is known): only those rows move to the host, and their update runs on them gathered, then they
  are scattered back.

Both parts are the same elementwise kernel as one update of the whole matrix, on the same values, so the result is
identical (tests/test_engine.py checks it bitwise). The embedding was the last update of the backward pass and the
first weight the next forward needs: at 32k tokens its whole-matrix update left the GPU idle ~0.1 s at the start of
every step (a trace of bench_core.py).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .optim import CpuOptimizer, Hypers

# Elements of each tensor the touched rows' CPU update gathers, updates and scatters at a time. Smaller passes keep
# the rows in cache between the three, which paid on a 2-core Xeon (2 M: 0.82x the time of 8 M) but not on the H200's
# 16-core host (2 M: 1.10x; 1 M: 1.18x), where the step is measured (benchmarks/bench_rows_update.py).
PASS_NUMEL = 1 << 23


class RowSplit:
    """One step's two-part update of an embedding matrix.

    Args:
        param: the embedding weight (fp32 master, rows first).
        index: the distinct touched rows, sorted (host, int64).
        chunk_numel: elements per chunk of either part.
        scratch: host buffers kept across steps, filled here on first use. NOTE: gathering rows into a fresh
            tensor is dominated by its page faults (index_select ran at 7 GB/s into a new tensor, 27 GB/s into a
            kept one, on 2 cores); a first version that allocated them cost the CPU worker 0.44 s more per step at
            32k tokens on the H200.
    """

    def __init__(self, param: nn.Parameter, index: Tensor, chunk_numel: int, scratch: dict[str, Tensor]) -> None:
        self.param = param
        self.index = index
        self.rows_per_chunk = max(1, chunk_numel // param[0].numel())
        self.received = False  # the touched rows' gradients reached the router
        self.grad: Tensor | None = None  # the "forward" schedule: those gradients, kept on the host (grads.py)
        self._scratch = scratch

    def _buffer(self, name: str) -> Tensor:
        shape = (min(self.param.shape[0], self.rows_per_chunk), *self.param.shape[1:])
        if name not in self._scratch or self._scratch[name].shape != shape:
            self._scratch[name] = torch.zeros(shape)
        return self._scratch[name]

    def _gather(self, tensors: dict[str, Tensor], keep: Tensor) -> dict[str, Tensor]:
        return {k: torch.index_select(t, 0, keep, out=self._buffer(k)[: len(keep)]) for k, t in tensors.items()}

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
        self, optimizer: CpuOptimizer, lo: int, hi: int, grad: Tensor, hypers: Hypers, grad_scale: Tensor | None = None
    ) -> None:
        """The update of touched rows ``index[lo:hi]`` with their gradient ``grad`` (divided by ``grad_scale``: the
        clipping coefficient), on the CPU worker."""
        tensors = optimizer.state_like(self.param)
        rows = max(1, PASS_NUMEL // self.param[0].numel())
        for a in range(lo, hi, rows):
            b = min(hi, a + rows)
            keep = self.index[a:b]
            gathered = self._gather(tensors, keep)
            optimizer.update_gathered(self.param, gathered, grad[a - lo : b - lo], hypers, grad_scale)
            for k, t in tensors.items():
                t.index_copy_(0, keep, gathered[k])
