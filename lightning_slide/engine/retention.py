"""Which gradients wait on the host for their update, and in what form (``Retention``), fixed when the engine is made:

- the units that retain theirs: all of them where accumulation or schedule "forward" needs any, else the deferred
  (and delayed) blocks of schedule "backward";
- ``compact``: those kept in the compute dtype, bf16, instead of fp32 (``EngineConfig.compact_retained_grads``): owned
  matrices computed with in bf16, one backward pass per step. Not where hooks read ``param.grad`` (an fp32 tensor
  there), nor shared weights (their contributions are summed in fp32), nor the embedding (fp32 rows), nor with the
  state on disk or shared by a node's processes (the engine's ``allowed``);
- ``in_copies``: the delayed blocks' compact ones, held in the copies of their weights (``delay.py``): no buffer of
  their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .units import Unit


@dataclass(frozen=True)
class Retention:
    units: list[Unit]
    compact: frozenset[nn.Parameter]
    in_copies: frozenset[nn.Parameter]

    def held(self) -> set[nn.Parameter]:
        """The parameters with a retained buffer of their own."""
        return {p for u in self.units for p in u.owned()} - self.in_copies


def retention(units: list[Unit], deferred: list[Unit], delayed: list[Unit], trained: set[nn.Parameter], *,
              schedule: str, accumulates: bool, allowed: bool, compute_dtype: torch.dtype,
              shared: set[nn.Parameter]) -> Retention:  # fmt: skip
    """The retention of an engine whose ``units`` train ``trained`` (``shared``: parameters several units compute
    with; ``allowed``: compact gradients asked for, and nothing the engine knows of rules them out)."""
    retaining = units if accumulates or schedule == "forward" else deferred
    compact = frozenset()
    if allowed and schedule in ("forward", "backward") and not accumulates and compute_dtype == torch.bfloat16:
        compact = frozenset(
            p for u in retaining for p, o, dtype in zip(u.params, u.owner, u.dtypes)
            if o is u and dtype == compute_dtype and p not in shared
        )  # fmt: skip
    in_copies = frozenset(p for u in delayed for p in u.owned() if p in trained) & compact
    return Retention(retaining, compact, in_copies)
