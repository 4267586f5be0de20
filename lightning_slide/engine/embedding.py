"""The input embedding, moved by rows: the forward sends only the rows of the batch's tokens, the backward returns
only those rows' gradients, and the optimizer still updates every row, in two parts where that is exact.

**Rows, not the table.** A forward gathers the fp32 rows of its distinct tokens on the host and sends those
(:meth:`EmbeddingRows.gather`); its backward sums the output gradient into them (``functions.EmbeddingRowsFunction``).

**The update in two parts** (``rows.py`` holds the arithmetic; ``EngineConfig.split_embedding_update``). The rows the
step's tokens did not touch are updated when the backward starts (the bulk, :meth:`EmbeddingRows.start`), off the
end of the step; the touched rows when their gradients are known, in one of three ways:

- **streamed** (schedule "backward"): by the worker as their gradients land;
- **deferred** (schedule "backward", ``defer_touched_rows``): their gradients wait in landing buffers until the next
  forward's gather, which knows the rows it reads: the worker updates those first, the gather sends the rows outside
  this step's meanwhile (final once the bulk has run) and waits only for those, and the rest are updated while the
  forward runs (:meth:`EmbeddingRows.apply_deferred`);
- **on the device** (schedule "forward", ``device_row_update``): once the global norm is known, their values and
  optimizer state go up, the same fused kernel updates them there, and the next forward takes the rows it shares
  with this step from that device copy (``RowCopy``) until the worker has written the update back into the host's
  copies, behind the updates that forward waits for.

The embedding's update is the last of a backward and the first weight the next forward needs; each variant keeps the
next forward from waiting for all of it (``benchmarks/NOTES.md`` has the traces).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import Literal

import torch
from torch import Tensor

from .config import EngineConfig
from .functions import EmbeddingRowsFunction
from .grads import GradSender
from .optim import CpuOptimizer, Hypers
from .rows import Contribution, RowCopy, RowSplit
from .transfer import Transfer
from .units import Unit
from .updates import StepPlan, Updates, nonfinite
from .window import Window
from .worker import CpuWorker

log = logging.getLogger(__name__)
# the second optimizer step's timing decides "auto" (the first creates the optimizer state)
_SPLIT_DECIDED_AFTER = 2


class EmbeddingRows:
    """The embedding unit's rows: gathered for forwards, updated in two parts (module docstring).

    Args:
        unit: the embedding's unit (fp32 rows on the host).
        window: the device window (block 0 goes up before the rows; updates are waited for there).
        transfer: the host/device copier.
        config: the engine's knobs.
        schedule: the update schedule.
        split_allowed: whether the run allows the two-part update at all (see ``SlideEngine``).
        after_backward: where the rows' gradients go (``SlideEngine.after_backward``).
        dummy: a tensor that requires grad, so the lookup's node runs backward when only the rows need it.
        worker, optimizer, updates, sender: the training machinery (``None`` for evaluation only).
    """

    def __init__(
        self,
        unit: Unit,
        *,
        window: Window,
        transfer: Transfer,
        config: EngineConfig,
        schedule: Literal["backward", "forward", "norm-first"],
        split_allowed: bool,
        after_backward: Callable[[Unit, dict[int, Contribution]], None],
        dummy: Tensor,
        worker: CpuWorker,
        optimizer: CpuOptimizer | None,
        updates: Updates | None,
        sender: GradSender | None,
    ) -> None:
        self.unit = unit
        self.window, self.transfer, self.config, self.schedule = window, transfer, config, schedule
        self.worker, self.optimizer, self.updates, self.sender = worker, optimizer, updates, sender
        self.split_allowed = split_allowed
        self.after_backward, self.dummy = after_backward, dummy
        self.touched: list[Tensor] | None = None  # rows this optimizer step's forwards gathered (host); None: no step
        self.split: RowSplit | None = None  # this step's two-part update
        self.row_copy: RowCopy | None = None  # the last device update of the touched rows
        # the last step's touched rows, for the next gather
        self.deferred: tuple[RowSplit, Hypers, StepPlan] | None = None
        self._split_pays: bool | None = None  # "auto": whether the worker has time for the split; None: undecided
        self._steps = 0
        self._worker_at_step: tuple[float, float] = (0.0, 0.0)  # the worker's busy and waiting seconds then
        self._write_back_later: tuple | None = None  # schedule "forward": a write-back to queue at the step's end
        self._scratch: dict[str, Tensor] = {}  # host buffers of RowSplit, kept across steps
        self._rows_grad: Tensor | None = None  # the touched rows' gradients, kept for schedule "forward"
        self._stage: list[tuple[Tensor, object] | None] = [None, None]  # pinned buffers for rows on their way up

    @property
    def param(self) -> torch.nn.Parameter:
        return self.unit.params[0]

    def release(self) -> None:
        """Drop the host buffers kept from step to step (training is over)."""
        self._scratch.clear()
        self._rows_grad = None
        self._stage = [None, None]

    # ---- forward ---------------------------------------------------------------------------------------------

    def forward(self, ids: Tensor, *, train: bool) -> Tensor:
        """The embedding's output for ``ids``; ``train``: a forward whose backward sends these rows' gradients."""
        if train:
            return EmbeddingRowsFunction.apply(self, ids, self.dummy)
        index, inverse, rows = self.gather(ids)
        return rows[inverse]

    def gather(self, ids: Tensor, *, training: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """Send the embedding rows of the tokens in ``ids``.

        Args:
            training: a forward whose backward sends these rows' gradients (they are the step's touched rows).

        Returns:
            the sorted distinct ids (device), each token's position among them (shaped like ``ids``), and the
            fp32 rows (device, one per distinct id).
        """
        window, unit = self.window, self.unit
        if torch.is_grad_enabled():
            window.order.setdefault(unit)
        # NOTE: block 0 goes up before the rows, the window's next blocks once block 0's forward is queued; but while
        # the rows wait for an update on the worker, the next blocks whose updates are done go up meanwhile.
        look_ahead = window.blocks[: window.num_slots - 1]
        for block in look_ahead[:1]:
            window.prefetch(block)
        weight = self.param
        index, inverse = torch.unique(ids.reshape(-1), return_inverse=True)  # (U,), ids.shape: ids == index[inverse]
        index_host = index.cpu()
        if index_host.numel() and (index_host[0] < 0 or index_host[-1] >= weight.shape[0]):
            raise IndexError(
                f"Token id {int(index_host[-1] if index_host[-1] >= weight.shape[0] else index_host[0])} is out of"
                f" range for the embedding '{unit.name}' with {weight.shape[0]} rows."
            )
        if training and self.touched is not None:
            self.touched.append(index_host)
        copy = None
        if training and self.optimizer is not None:
            # used once: a later gather waits for the write-back instead, and the device frees the copy sooner
            copy, self.row_copy = self.row_copy, None
            if copy is not None and copy.landed.done():
                copy = None  # the host holds its rows
        deferred = self.apply_deferred(index_host) if copy is None and self.optimizer is not None else None
        rows = torch.empty(index_host.numel(), weight.shape[1], dtype=torch.float32, device=self.transfer.device)
        if copy is not None:
            held, at = copy.find(index_host)  # (U,) bool, (U,) positions in copy.values
            self._send_host_rows_at(weight.data, index_host, rows, ~held)
            self.transfer.wait(copy.event)
            held, at = held.to(self.transfer.device), at.to(self.transfer.device)
            rows[held] = copy.values[at[held]]
        elif deferred is not None:
            # the rows the deferred update does not touch are final: they go up while the worker updates the others
            first, first_rows = deferred
            pending = torch.isin(index_host, first_rows)
            self._send_host_rows_at(weight.data, index_host, rows, ~pending)
            window.prefetch_updated(look_ahead[1:])
            window.wait_for([first])
            self._send_host_rows_at(weight.data, index_host, rows, pending)
        else:
            if not window.updated(unit):
                window.prefetch_updated(look_ahead[1:])
                window.wait_updates(unit)
            self.send_host_rows(weight.data, index_host, rows)
        return index, inverse.view(ids.shape), rows

    def _send_host_rows_at(self, source: Tensor, index: Tensor, rows: Tensor, where: Tensor) -> None:
        """Copy rows ``index[where]`` of the host tensor ``source`` into ``rows[where]`` (device); ``where`` is a host
        mask over ``index``."""
        part = torch.empty(int(where.sum()), *rows.shape[1:], dtype=rows.dtype, device=self.transfer.device)
        self.send_host_rows(source, index[where], part)
        rows[where.to(self.transfer.device)] = part

    def send_host_rows(self, source: Tensor, index: Tensor, out: Tensor) -> None:
        """Copy rows ``index`` of the host tensor ``source`` into the device tensor ``out``; the current stream waits
        for them."""
        width = source[0].numel()
        per = max(1, min(self.config.rows_stage_numel // width, source.shape[0]))  # rows per staging buffer
        allocated = self.transfer.record()  # `out` may reuse memory still read on the compute stream
        event = None
        for k, lo in enumerate(range(0, index.numel(), per)):
            # two pinned staging buffers in turn: gathering the next rows overlaps sending the last ones
            if self._stage[k % 2] is None:
                self._stage[k % 2] = (self.transfer.host_empty(per * width), None)
            buffer, sent = self._stage[k % 2]
            if sent is not None:
                sent.synchronize()  # its previous rows have left
            part = buffer[: min(per, index.numel() - lo) * width].view(-1, *source.shape[1:])  # (rows, width)
            picked = index[lo : lo + len(part)]
            if source.dtype == part.dtype:
                torch.index_select(source, 0, picked, out=part)
            else:  # a frozen table kept in bf16: its rows widen exactly
                part.copy_(source.index_select(0, picked))
            event = self.transfer.upload([(part, out[lo : lo + len(part)])], after=allocated)
            self._stage[k % 2] = (buffer, event)
        self.transfer.wait(event)

    # ---- the step ----------------------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """An optimizer step begins: its forwards' rows are recorded; "auto" decides after the second one."""
        self.touched = []
        self._steps += 1
        before, self._worker_at_step = self._worker_at_step, (self.worker.busy_s, self.worker.wait_s)
        if self._steps == _SPLIT_DECIDED_AFTER + 1 and self.schedule == "backward":
            self._decide_split(self._worker_at_step[0] - before[0], self._worker_at_step[1] - before[1])

    def _decide_split(self, busy: float, waiting: float) -> None:
        # "auto": split when, in the last step, the worker waited for the GPU at least as long as the embedding's
        # update took (its share of the parameters, of the worker's busy time: the updates are bound by RAM bandwidth)
        trainable = {p for g in self.optimizer.optimizer.param_groups for p in g["params"] if p.requires_grad}
        share = self.param.numel() / max(1, sum(p.numel() for p in trainable))
        self._split_pays = waiting >= share * busy
        log.info(
            "SlideFormer %s the embedding's update in two parts: in the last step the CPU worker waited %.3f s for the"
            " GPU; the embedding's update takes ~%.3f s.", "runs" if self._split_pays else "does not run", waiting,
            share * busy,
        )  # fmt: skip

    def splits(self) -> bool:
        """Whether this step updates the embedding in two parts: with schedule "backward" where the worker has time
        for it ("auto"), with "forward" always ("auto"); never where the run does not allow it."""
        choice = self.config.split_embedding_update
        pays = bool(self._split_pays) if self.schedule == "backward" else True
        return (choice is True or (choice == "auto" and pays)) and self.split_allowed and self.touched is not None

    def _on_device(self) -> bool:
        return self.config.device_row_update and self.schedule == "forward" and self.splits()

    def device_bytes(self, plan: StepPlan | None) -> int:
        """Device memory the touched rows' update on the device holds from the step's end until the write-back (which
        can reach into the next backward): their gradient, values and optimizer state, as many rows as this step's
        forwards gathered."""
        if not (self.touched and plan is not None and self._on_device()):
            return 0
        hypers = plan.hypers[self.optimizer.group_index(self.param)]
        state = int(hypers.momentum != 0) if self.optimizer.is_sgd else 2 + int(hypers.amsgrad)
        return sum(len(t) for t in self.touched) * self.param[0].numel() * 4 * (2 + state)

    def start(self, plan: StepPlan) -> None:
        """The step's loss is about to run backward: where exact, the rows it did not touch are updated now."""
        touched = self.touched
        if touched is None:  # a micro-batch that only accumulates
            return
        self.touched = []
        if not (touched and self.splits()):
            return
        if self.split is not None:
            raise RuntimeError(
                "The input embedding ran forward again after the step's backward pass began, when SlideFormer had"
                " updated the rows the step had not touched so far. Run every forward of a step before its"
                " backward, or set SlideFormerStrategy(engine=EngineConfig(split_embedding_update=False))."
            )
        index = torch.unique(torch.cat(touched))
        # the state exists after the first update (the previous gather waited for it, or it is on the device)
        has_state = bool(self.optimizer.optimizer.state.get(self.param))
        on_device = self._on_device() and len(touched) == 1 and has_state
        defer = self.config.defer_touched_rows and self.schedule == "backward"
        self.sender.drain()  # a write-back queued at the last step's end reaches the worker before the bulk
        self.apply_deferred(None)  # and the last step's deferred update, where no gather has queued it
        split = RowSplit(self.param, index, self.transfer.chunk_numel, self.config.rows_pass_numel, self._scratch,
                         on_device=on_device, defer=defer)  # fmt: skip
        hypers = plan.hypers[self.optimizer.group_index(self.param)]
        split.bulk_done = self.worker.submit(split.bulk, self.optimizer, hypers)
        self.updates.count(plan)
        self.worker.submit(plan.applied.append, f"{self.unit.name} (the rows the step did not touch)")
        self.split = split
        self.sender.routes[self.param] = self._send_rows

    def received(self) -> None:
        """The embedding's backward produced the touched rows' gradients (main thread)."""
        if self.split is not None:
            self.split.received = True

    def check_received(self) -> None:
        """The step's backward is done: a split whose gradients never came is an error, not a silent half-update."""
        if self.split is not None and not self.split.received:
            raise RuntimeError(
                f"SlideFormer updated the rows of '{self.unit.name}' that the step's tokens did not touch when"
                " its backward pass began, but no gradient reached the embedding in that pass (is its output detached"
                " from the loss?). If it is not meant to train, freeze it or leave it out of the optimizer; else set"
                " SlideFormerStrategy(engine=EngineConfig(split_embedding_update=False))."
            )

    def prepare_update(self) -> None:
        """Schedule "forward", the step's end: the touched rows' values and state go up for their update there."""
        split = self.split
        if split is not None and split.on_device:
            split.bulk_done.result()  # it has put back the touched rows' state
            split.state = self._row_state(split)

    def update_touched(self, plan: StepPlan, check_finite: bool) -> Future:
        """Queue the touched rows' update (schedule "forward"); returns its future (``Updates.schedule``'s ``run``)."""
        split = self.split
        if split.on_device:
            return self._update_on_device(split, plan, check_finite)
        return self.worker.submit(self._update_rows, split, plan, check_finite)

    def end_step(self) -> bool:
        """The optimizer step's updates the next forward waits for are queued (after the sender drained); returns
        whether a write-back followed them."""
        self.touched = None
        self.split = None
        self.sender.routes.pop(self.param, None)
        if self._write_back_later is None:
            return False
        self.sender.put(partial(self._write_back, *self._write_back_later))
        self._write_back_later = None
        return True

    def _row_state(self, split: RowSplit) -> dict[str, Tensor]:
        """The touched rows of the embedding and of its optimizer state, on the device, for their update there."""
        self.window.wait_updates(self.unit)  # the write-back of its last update has landed
        state = {}
        for name, tensor in self.optimizer.state_like(split.param).items():
            state[name] = torch.empty(len(split.index), *tensor.shape[1:], dtype=tensor.dtype,
                                      device=self.transfer.device)  # fmt: skip
            self.send_host_rows(tensor, split.index, state[name])
        return state

    # ---- deferred (schedule "backward") ----------------------------------------------------------------------

    def apply_deferred(self, first: Tensor | None) -> tuple[Future, Tensor] | None:
        """Queue the last step's deferred update of its touched rows, those also in ``first`` (sorted host ids) before
        the others; return the future of that first part and its rows (sorted host ids), ``None`` if nothing was
        deferred. With ``first``, return once the bulk has run: the rows outside the deferred ones are then final.
        The embedding's ``update_done`` becomes the whole update's (main thread, after the sender drained)."""
        if self.deferred is None:
            return None
        (split, hypers, plan), self.deferred = self.deferred, None
        ahead = torch.isin(split.index, split.index[:0] if first is None else first)
        done = self.worker.submit(split.apply_landed, self.optimizer, hypers, ahead)
        self.unit.update_done = self.worker.submit(self._finish_deferred, split, hypers, ~ahead, plan)
        if first is not None:
            split.bulk_done.result()  # queued before both parts; also re-raises a failed bulk
        return done, split.index[ahead]

    def _finish_deferred(self, split: RowSplit, hypers: Hypers, rest: Tensor, plan: StepPlan) -> None:
        try:
            split.apply_landed(self.optimizer, hypers, rest)
            self.optimizer.end(split.param)
            plan.applied.append(self.unit.name)
        finally:
            for _, landing, _ in split.landed:
                self.transfer.give_landing(landing)
            split.landed = []

    # ---- on the sender thread --------------------------------------------------------------------------------

    def _send_rows(self, contribs: list[Contribution], plan: StepPlan | None) -> None:
        """The touched rows' gradients only, in the order of ``split.index``, chunk by chunk: to the worker's update
        (``plan``: streamed updates), or into a host buffer kept for the update at the end of the step (schedule
        "forward"; their squares summed on the device for the global norm), or, with ``split.on_device``, nowhere:
        they stay on the device for the update there."""
        split, tr = self.split, self.transfer
        if len(contribs) == 1:
            index, values = contribs[0].index, contribs[0].values
        else:  # several forwards of the embedding in the step: their rows summed (each index_add_ without repeats)
            index = torch.unique(torch.cat([c.index for c in contribs]))
            values = torch.zeros(len(index), *split.param.shape[1:], dtype=torch.float32, device=tr.device)
            for c in contribs:
                values.index_add_(0, torch.searchsorted(index, c.index), c.values)
        if len(index) != len(split.index):
            raise RuntimeError(
                f"Internal error: the embedding's gradient has {len(index)} rows, but its forward passes gathered"
                f" {len(split.index)}."
            )
        # deferred, the rows' gradients hold their landing buffers into the next step: at most half of them
        defer = plan is not None and split.defer and -(-len(index) // split.rows_per_chunk) <= tr.landing_count // 2
        if plan is None:
            flat = values.view(-1)
            self.updates.device_sq[split.param] = torch.dot(flat, flat)
            if split.on_device:
                split.grad = values
                return
            split.grad = self._kept_rows(values.shape)
        else:
            hypers = plan.hypers[self.optimizer.group_index(split.param)]
        for lo in range(0, len(index), split.rows_per_chunk):
            hi = min(len(index), lo + split.rows_per_chunk)
            landing, target, event = self.sender.land(values[lo:hi], split.grad[lo:hi] if plan is None else None)
            if defer:
                split.landed.append((lo, landing, target))
            elif plan is not None:
                self.worker.submit(self._apply_rows, split, lo, hi, landing, target, hypers, after=event)
        if plan is None or defer:
            self.worker.submit(lambda: None, after=event)  # the update, queued later, finds the rows landed
            if defer:
                self.deferred = (split, hypers, plan)
                plan.deferred.add(self.unit.name)
        else:
            self.worker.submit(self.optimizer.end, split.param)

    def _kept_rows(self, shape: tuple[int, ...]) -> Tensor:
        # pinned, kept across steps; a step with more distinct tokens than any before takes a larger one
        numel = math.prod(shape)
        if self._rows_grad is None or self._rows_grad.numel() < numel:
            if self._rows_grad is not None:
                self.transfer.release(self._rows_grad)
            self._rows_grad = self.transfer.host_empty(numel + numel // 4)
        return self._rows_grad[:numel].view(shape)

    def _write_back(self, split: RowSplit, landed: Future, after) -> None:
        """Copy the device-updated rows of ``split.state`` to landing buffers, chunk by chunk, for the worker to put
        into the host's masters and state; ``landed`` is done after the last."""
        last = None
        try:
            with self.transfer.converting(after):
                for name, t in split.state.items():
                    self.transfer.keep_alive(t)
                    for lo in range(0, len(t), split.rows_per_chunk):
                        landing, target, event = self.sender.land(t[lo : lo + split.rows_per_chunk])
                        last = self.worker.submit(self._write_back_rows, split, name, lo, landing, target, after=event)
            split.state = None  # all read by the copies above (keep_alive): the device may reuse it
        except BaseException as err:
            landed.set_exception(err)
            raise
        if last is None:
            landed.set_result(None)
        else:
            last.add_done_callback(partial(_settle, landed))

    # ---- on the worker (or the main thread, on the device) -----------------------------------------------------

    def _apply_rows(self, split: RowSplit, lo: int, hi: int, landing: Tensor, grad: Tensor, hypers: Hypers) -> None:
        try:
            split.apply(self.optimizer, lo, hi, grad, hypers)
        finally:
            self.transfer.give_landing(landing)

    def _checked_grad(self, split: RowSplit, plan: StepPlan, check_finite: bool) -> tuple[Tensor, Hypers]:
        # the touched rows' gradients (kept by _send_rows), checked and clipped by value, and their group's hypers
        grad = split.grad
        if check_finite and not bool(torch.isfinite(torch.linalg.vector_norm(grad))):
            if threading.current_thread() is threading.main_thread():  # the worker's updates so far, all named
                with contextlib.suppress(BaseException):
                    self.worker.drain()
            raise nonfinite(plan, self.unit.name)
        if plan.clip_value is not None:
            grad.clamp_(-plan.clip_value, plan.clip_value)
        return grad, plan.hypers[self.optimizer.group_index(split.param)]

    def _update_rows(self, split: RowSplit, plan: StepPlan, check_finite: bool) -> None:
        # the touched rows, on the worker; the rest had their update
        grad, hypers = self._checked_grad(split, plan, check_finite)
        split.apply(self.optimizer, 0, len(grad), grad, hypers, plan.grad_scale)
        self.optimizer.end(split.param)
        plan.applied.append(self.unit.name)

    def _update_on_device(self, split: RowSplit, plan: StepPlan, check_finite: bool) -> Future:
        # the update on the device now (main thread); the write-back after the updates the next forward waits for
        grad, hypers = self._checked_grad(split, plan, check_finite)
        split.update_on_device(self.optimizer, grad, hypers, plan.grad_scale)
        self.optimizer.end(split.param)
        plan.applied.append(self.unit.name)
        split.grad = None  # the device may reuse it
        # the next forward's rows shared with this step come from the device copy until the write-back has landed
        landed, done = Future(), self.transfer.record()
        self.row_copy = RowCopy(split.index, split.state["param"], done, landed)
        self._write_back_later = (split, landed, done)
        return landed

    def _write_back_rows(self, split: RowSplit, name: str, lo: int, landing: Tensor, values: Tensor) -> None:
        try:
            split.write_back(self.optimizer, name, lo, values)
        finally:
            self.transfer.give_landing(landing)


def _settle(future: Future, done: Future) -> None:
    """Finish ``future`` as ``done`` finished."""
    if done.exception() is not None:
        future.set_exception(done.exception())
    else:
        future.set_result(None)
