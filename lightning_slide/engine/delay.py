"""The one-step-delayed update of the first streamed blocks (``SlideFormerStrategy(delayed_update=True)``).

The idea is DeepSpeed's delayed parameter update (ZeRO-Offload, Ren et al. 2021): the CPU applies step t's update
while the GPU runs step t+1 with the weights of before it. Here it applies to the first ``k`` streamed blocks (the plan
delays all of them where that predicts a faster step, ``overlap.py``; each one more delayed was measured faster); every
other parameter is updated exactly as before. For a delayed block, with ``m_t`` its masters before step t's update:

    step t computes with  w_t = m_(t-1)      (a copy on the host, in the dtype the device computes with)
    step t's update       m_(t+1) = update(m_t, gradient at w_t)

The copies are the upload source of those blocks in training (evaluation reads the masters). There are two sets:
step t reads the live one, while the update of step t-1, running meanwhile, writes ``m_t`` into the spare one as it
writes the masters (the bf16 kernel rounds each value as it stores it: no second pass over the masters). When step t
ends, the sets swap, and the delayed blocks' updates are queued after everything else of the step: their next forward
waits only for the update of the step before, so the updates overlap the whole next step. The first ``warmup`` steps
are exact (no copies yet); so is the step after a resume from a checkpoint that holds none.

A bf16 gradient held for its update (``in_place``) needs no buffer of its own: it lands in the live copy once the
step's last upload has read it (the block's backward, which the gradient comes from, waited for that upload), and the
update writes the next weights where it reads the gradient. After the swap that set is the spare one; the other, live,
takes the next gradient. Two buffers per parameter instead of three.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch
from torch import Tensor, nn

from .transfer import Transfer
from .units import Unit
from .worker import CpuWorker

COPY_KEY = "delayed_weight"  # the copies in a checkpoint's optimizer state, beside each parameter's moments


class DelayedBlocks:
    """The two sets of copies of the delayed blocks' trained weights, and when they are in force.

    Args:
        blocks: the delayed blocks (the first streamed ones).
        transfer: the host/device copier (pinned copies, the upload stream's progress).
        worker: the CPU worker (the updates that write the copies, in its order).
        warmup: the optimizer steps run exactly before the delay starts.
        trained: the parameters the optimizer updates (frozen ones are read from their masters).
        in_place: trained parameters whose gradients are held in bf16 in their live copies (module docstring).
    """

    def __init__(
        self, blocks: list[Unit], transfer: Transfer, worker: CpuWorker, warmup: int, trained: set[nn.Parameter],
        in_place: set[nn.Parameter] = frozenset(),
    ) -> None:  # fmt: skip
        self.blocks = blocks
        self.transfer, self.worker, self.warmup = transfer, worker, warmup
        params = [(p, dtype) for u in blocks for p, dtype in zip(u.params, u.dtypes) if p in trained]
        self.live, self.spare = ({p: transfer.host_empty(p.numel(), d).view(p.shape) for p, d in params} for _ in "ab")
        self.in_place = set(in_place)
        self.done: dict[Unit, Future | None] = dict.fromkeys(blocks)  # what the live set waits for
        self.version = dict.fromkeys(blocks, 0)
        self.filled = False  # the live set holds the weights of the next step

    def sources(self, unit: Unit, training: bool) -> list[Tensor] | None:
        """What ``unit``'s upload reads: the live copies where the delay is in force (``None``: its masters)."""
        if not (training and self.filled and unit in self.done):
            return None
        return [self.live.get(p, p.data) for p in unit.params]

    def starts_after(self, step: int) -> bool:
        """Whether the delay is in force from the step after ``step``."""
        return step + 1 >= self.warmup

    def fill(self, live: bool = True) -> None:
        """Copy the masters into the spare set and (``live``) the live one: the delay starts (its updates not queued
        yet), or a checkpoint brought the live set."""
        for unit in self.blocks:
            pairs = [(c[p], p.data) for p in unit.params for c in (self.live, self.spare)[not live :] if p in c]
            self.done[unit] = self.worker.submit(_copy, pairs, after=self._uploaded())
            self.version[unit] += 1
        self.filled = True

    def swap(self) -> None:
        """The step ends, its delayed updates not queued yet: the spare set (its values written by the updates
        queued when the last step ended) becomes the live one; the worker writes the other once this step's uploads
        have read it."""
        self.live, self.spare = self.spare, self.live
        for unit in self.blocks:
            self.done[unit] = unit.update_done
            self.version[unit] += 1
        self.worker.submit(_copy, [], after=self._uploaded())

    def targets(self, unit: Unit) -> dict[nn.Parameter, Tensor]:
        """Where ``unit``'s update writes the next weights (the spare set); an ``in_place`` parameter's gradient is
        there too."""
        return {p: self.spare[p] for p in unit.params if p in self.spare}

    def grad_buffers(self) -> dict[nn.Parameter, Tensor]:
        """Where the ``in_place`` parameters' next gradients land: their live copies."""
        return {p: self.live[p] for p in self.in_place}

    def copy_missed(self, unit: Unit, updated: set[nn.Parameter]) -> None:
        """Copy into the spare set the masters of ``unit``'s parameters this step did not update (a skipped step, a
        parameter that received no gradient)."""
        pairs = [(c, p.data) for p, c in self.targets(unit).items() if p not in updated]
        if pairs:
            self.worker.submit(_copy, pairs)

    def release(self) -> None:
        """Drop the copies (training is over: the masters hold every update)."""
        self.live.clear()
        self.spare.clear()
        self.filled = False

    def _uploaded(self):
        return self.transfer.record(self.transfer.upload_stream) if self.transfer.is_cuda else None

    # ---- checkpoints -----------------------------------------------------------------------------------------

    def into_state(self, state: dict, params: list[nn.Parameter]) -> dict:
        """``optimizer.state_dict()``'s ``state`` (numbered as ``params``) with each live copy beside its moments."""
        if not self.filled:
            return state
        state = {i: dict(s) for i, s in state.items()}
        for i, p in enumerate(params):
            if p in self.live and i in state:
                state[i][COPY_KEY] = self.live[p]
        return state

    def load(self, loaded: dict[nn.Parameter, Tensor]) -> None:
        """Take the live copies a checkpoint holds (all of them, or the delay restarts after one exact step); the
        spare ones are the masters it holds."""
        if set(loaded) != set(self.live):
            self.filled = False
            return
        for p, value in loaded.items():
            self.live[p].copy_(value)
        self.fill(live=False)


def copy_bytes(blocks: list[Unit], trained: set[nn.Parameter]) -> int:
    """Host bytes of the two sets of copies of ``blocks``' trained weights (``in_place`` gradients inside them)."""
    return 2 * sum(p.numel() * d.itemsize for u in blocks for p, d in zip(u.params, u.dtypes) if p in trained)


def check_delayed(blocks: list[Unit], count: int, disk_masters: bool) -> list[Unit]:
    """The first ``count`` of the streamed ``blocks``, or a clear refusal."""
    if count > len(blocks):
        raise ValueError(
            f"EngineConfig(delayed_blocks={count}) asks to delay more blocks than the {len(blocks)} the engine streams;"
            " give a number from 0 to that, or 'auto'."
        )
    if count and disk_masters:
        raise ValueError(
            "delayed_update=True reads the delayed blocks' masters in RAM, and nvme_masters=True keeps them on disk:"
            " use one of the two."
        )
    shared = [u.name for u in blocks[:count] if any(o is not u for o in u.owner)]
    if shared:
        raise ValueError(
            f"delayed_update=True needs blocks that own their weights; {shared[0]!r} shares one with another module."
            " Train without delayed_update."
        )
    return blocks[:count]


def without_copies(state_dict: dict, optimizer: torch.optim.Optimizer, delay: DelayedBlocks | None) -> dict:
    """A checkpoint's optimizer state for ``optimizer.load_state_dict``: the delayed blocks' copies taken out, and
    handed to ``delay`` (a run that delays no block drops them)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]  # the state dict's numbering
    copies, state = {}, {}
    for i, s in state_dict["state"].items():
        if COPY_KEY in s:
            s = dict(s)
            copies[params[int(i)]] = s.pop(COPY_KEY)
        state[i] = s
    if delay is not None:
        delay.load(copies)
    return {**state_dict, "state": state}


def _copy(pairs: list[tuple[Tensor, Tensor]]) -> None:
    for copy, master in pairs:
        copy.copy_(master)
