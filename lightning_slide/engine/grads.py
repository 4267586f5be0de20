"""Gradients: from a unit's backward on the device to the CPU optimizer, chunk by chunk.

Two ways a gradient can go, chosen per run by the engine:

- **streamed** (update schedules "backward" and "norm-first", no accumulation): each chunk of a gradient lands in a
  small pinned buffer from a pool and the CPU worker applies the optimizer to the matching rows of the parameter
  at once (a split embedding's touched rows wait there for the next step's gather: ``apply_deferred``). No full
  gradient ever exists in host memory. ("norm-first" runs a backward pass before, whose gradients only add their
  squares up on the device: ``measure``.)
- **retained** (accumulation, or update schedule "forward" for exact global-norm clipping): gradients are kept
  in host buffers for the whole accumulation window. The first contribution is copied straight into them,
  later ones are added by the worker; the update runs once the window is complete. ``compact`` parameters (one
  bf16 contribution per window: ``SlideEngine.compact_grads``) keep theirs in bf16, which holds it exactly, and the
  update widens it to fp32 a chunk at a time; one that receives a second contribution (a block that ran twice) is
  widened to fp32 for the rest of the run.

Contributions from a unit that does not own a parameter (the output head of a model with tied embeddings)
wait on the device until the owner's backward adds its own, so every parameter is moved and updated once.

The copies are issued by a sender thread, so the backward pass never waits for a free host buffer while the CPU
catches up; it waits only when the gradients queued on the device exceed ``max_queued_bytes``.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor, nn

from .optim import CpuOptimizer, Hypers
from .rows import RowCopy, RowSplit
from .transfer import Transfer
from .units import Unit
from .worker import CpuWorker


class NonFiniteGradientError(FloatingPointError):
    """A gradient held NaN or Inf; it was not applied."""


@dataclass
class Rows:
    """A gradient that is non-zero only in some rows: ``values[i]`` belongs to row ``index[i]``."""

    index: Tensor  # (U,) int64, on the device
    values: Tensor  # (U, ...) fp32, on the device


Contribution = Tensor | Rows


@dataclass
class StepPlan:
    """What the next update applies, frozen when ``optimizer_step`` is called."""

    step: int
    hypers: list[Hypers]
    grad_scale: Tensor | None = None  # clipping by norm: gradients are divided by this
    clip_value: float | None = None  # clipping by value
    norm_checked: bool = False  # the global norm was found finite
    norm: float = 0.0  # "norm-first": the global norm of the first backward pass
    skip: bool = False  # non-finite norm and on_nonfinite="skip": apply nothing


class GradRouter:
    """Moves each unit's gradients to the host and hands them to the CPU optimizer.

    Args:
        transfer: the host/device copier.
        worker: the CPU worker.
        optimizer: the CPU optimizer driver.
        retain: keep full gradients on the host for the accumulation window (see module docstring).
        compact: retained gradients kept in bf16 (see module docstring).
    """

    def __init__(
        self,
        transfer: Transfer,
        worker: CpuWorker,
        optimizer: CpuOptimizer,
        *,
        retain: bool,
        max_queued_bytes: int,
        compact: set[nn.Parameter] = frozenset(),
    ) -> None:
        self.transfer = transfer
        self.worker = worker
        self.optimizer = optimizer
        self.retain = retain
        self.compact = set(compact) if retain else set()
        self._widening: Tensor | None = None  # the worker's fp32 chunk for a compact gradient's update
        self.host: dict[nn.Parameter, Tensor] = {}  # retained gradients (views into one buffer per owner unit)
        self.fresh: dict[nn.Parameter, bool] = {}  # retained buffer holds nothing of this window yet
        self.pending: set[nn.Parameter] = set()  # parameters with gradients in this window
        self._stash: dict[nn.Parameter, list[Contribution]] = {}  # waiting for the owner's contribution
        self._owner_of: dict[nn.Parameter, Unit] = {}
        self._updated: set[nn.Parameter] = set()  # updated during this window's last backward
        # NOTE: squared norms of gradients with one contribution in the window, summed on the device as they
        # leave, so clipping by norm costs the CPU no pass over the gradients.
        self._device_sq: dict[nn.Parameter, Tensor] = {}
        self.split: RowSplit | None = None  # this step's two-part embedding update (rows.py)
        self.row_copy: RowCopy | None = None  # the last device update of an embedding's touched rows (rows.py)
        # the "backward" schedule: the last step's split whose touched rows wait for the next gather, and their hypers
        self.deferred: tuple[RowSplit, Hypers] | None = None
        self._write_back_later: tuple | None = None  # the "forward" schedule: a write-back queued at end_window
        self._row_scratch: dict[str, Tensor] = {}  # its host buffers, kept across steps
        self._rows_grad: Tensor | None = None  # the touched rows' gradients, kept for the "forward" schedule
        self.download_bytes = 0
        self._flags: dict[Unit, Tensor] = {}
        self.max_queued_bytes = max_queued_bytes
        self._queued_bytes = 0
        self._room = threading.Condition()
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._sender = threading.Thread(target=self._send_loop, name="slide-send", daemon=True)
        self._sender.start()

    def wants(self, unit: Unit, index: int) -> bool:
        """Whether the gradient of ``unit.params[index]`` is needed at all."""
        return unit.trainable[index] and self.optimizer.group_index(unit.params[index]) is not None

    def push(self, unit: Unit, grads: dict[int, Contribution], plan: StepPlan | None) -> None:
        """Send ``unit``'s gradients (by parameter index) on their way; called right after its backward.

        Args:
            plan: set when this backward completes the window and the update schedule is "backward": each
                parameter is updated as soon as its gradient has arrived.
        """
        ready: list[tuple[Unit, nn.Parameter, list[Contribution]]] = []
        for i, grad in grads.items():
            param, owner = unit.params[i], unit.owner[i]
            if self.split is not None and param is self.split.param:
                self.split.received = True
            self._owner_of[param] = owner
            self._stash.setdefault(param, []).append(grad)
            if owner is unit:
                ready.append((owner, param, self._stash.pop(param)))
        self._enqueue(ready, plan)

    def measure(self, unit: Unit, grads: dict[int, Contribution]) -> None:
        """Sum the squares of ``unit``'s gradients on the device, as :meth:`global_norm` reads them, and drop the
        gradients ("norm-first": the step's first backward pass). Shared parameters wait for their owner as in
        :meth:`push`."""
        for i, grad in grads.items():
            param, owner = unit.params[i], unit.owner[i]
            self._owner_of[param] = owner
            self._stash.setdefault(param, []).append(grad)
            if owner is unit:
                self._measure_param(param, self._stash.pop(param))

    def flush_measure(self) -> None:
        """The first backward pass is over: measure contributions whose owner's backward did not run."""
        for param, contributions in list(self._stash.items()):
            self._measure_param(param, contributions)
        self._stash.clear()

    def _measure_param(self, param: nn.Parameter, contributions: list[Contribution]) -> None:
        # summed over chunks of rows (an fp32 copy of the whole gradient could be GiBs), as _send_param does
        total = torch.zeros((), dtype=torch.float32, device=self.transfer.device)
        for cut, shape, _ in self._chunks(param):
            stage = torch.empty(shape, dtype=torch.float32, device=self.transfer.device)
            _combine(stage, contributions, cut)
            flat = stage.view(-1)
            total += torch.dot(flat, flat)
        self._device_sq[param] = total
        self.pending.add(param)

    def flush(self, plan: StepPlan | None) -> None:
        """Send contributions still waiting for an owner whose backward did not run (e.g. an unused embedding)."""
        ready = [(self._owner_of[p], p, c) for p, c in self._stash.items()]
        self._stash.clear()
        self._enqueue(ready, plan)

    def drain(self) -> None:
        """Wait until every queued gradient has been sent (and its update queued); raise the sender's error."""
        self._queue.join()
        self._raise()

    def end_window(self) -> None:
        """The optimizer step is over (after ``drain``): parameters may receive gradients for the next one."""
        self._updated.clear()
        self.split = None
        if self._write_back_later is not None:  # behind the updates the next forward waits for
            self._put(partial(self._write_back, *self._write_back_later), 0)
            self._write_back_later = None

    def start_split(
        self, param: nn.Parameter, index: Tensor, plan: StepPlan, *, on_device: bool, defer: bool = False
    ) -> None:
        """Update ``param``'s rows outside ``index`` now, and those in it when their gradients arrive (rows.py).

        Args:
            on_device: ("forward" schedule) update those on the device, once the engine has set ``split.state``.
            defer: ("backward" schedule) leave their gradients in landing buffers for ``apply_deferred``.
        """
        if self.split is not None:
            raise RuntimeError(
                "The input embedding ran forward again after the step's backward pass began, when SlideFormer had"
                " updated the rows the step had not touched so far. Run every forward of a step before its"
                " backward, or set lightning_slide.engine.engine.SPLIT_EMBEDDING_UPDATE = False."
            )
        self.drain()  # a write-back queued at end_window reaches the worker before the bulk
        self.apply_deferred(None)  # and the last step's deferred update, where no gather has queued it
        self.split = RowSplit(
            param, index, self.transfer.chunk_numel, self._row_scratch, on_device=on_device, defer=defer
        )
        hypers = plan.hypers[self.optimizer.group_index(param)]
        self.split.bulk_done = self.worker.submit(self.split.bulk, self.optimizer, hypers)

    def apply_deferred(self, first: Tensor | None) -> tuple[Future, Tensor] | None:
        """Queue the last step's deferred update of its touched rows (rows.py), those also in ``first`` (sorted host
        ids) before the others; return the future of that first part and its rows (sorted host ids), ``None`` if
        nothing was deferred. With ``first``, return once the bulk has run: the rows outside the deferred ones are
        then final. The embedding's ``update_done`` becomes the whole update's (main thread, after ``drain``)."""
        if self.deferred is None:
            return None
        (split, hypers), self.deferred = self.deferred, None
        ahead = torch.isin(split.index, split.index[:0] if first is None else first)
        done = self.worker.submit(split.apply_landed, self.optimizer, hypers, ahead)
        self._owner_of[split.param].update_done = self.worker.submit(self._finish_deferred, split, hypers, ~ahead)
        if first is not None:
            split.bulk_done.result()  # queued before both parts; also re-raises a failed bulk
        return done, split.index[ahead]

    def _finish_deferred(self, split: RowSplit, hypers: Hypers, rest: Tensor) -> None:
        try:
            split.apply_landed(self.optimizer, hypers, rest)
            self.optimizer.end(split.param)
        finally:
            for _, landing, _ in split.landed:
                self.transfer.give_landing(landing)
            split.landed = []

    def close(self) -> None:
        self._queue.put(None)
        self._sender.join()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _enqueue(self, ready: list, plan: StepPlan | None) -> None:
        if not ready:
            return
        nbytes = sum(t.numel() * t.element_size() for _, _, cs in ready for c in cs for t in _tensors(c))
        with self._room:
            while self._queued_bytes and self._queued_bytes + nbytes > self.max_queued_bytes:
                self._room.wait(timeout=0.5)
                self._raise()
            self._queued_bytes += nbytes
        self._raise()
        self._put(partial(self._send, ready, plan, self.transfer.record()), nbytes)

    def _put(self, job: Callable[[], None], nbytes: int) -> None:
        self._queue.put((job, nbytes))

    def _send_loop(self) -> None:
        if self.transfer.is_cuda:
            torch.cuda.set_device(self.transfer.device)
        while (item := self._queue.get()) is not None:
            job, nbytes = item
            try:
                if self._error is None:
                    job()
            except BaseException as err:
                self._error = err
            finally:
                del job, item  # the device gradients may be freed (their copies are ordered by record_stream)
                with self._room:
                    self._queued_bytes -= nbytes
                    self._room.notify_all()
                self._queue.task_done()
        self._queue.task_done()

    def _send(self, ready: list[tuple[Unit, nn.Parameter, list[Contribution]]], plan: StepPlan | None, event) -> None:
        tr = self.transfer
        if plan is None and not self.retain:
            raise RuntimeError(
                "A backward pass ran outside the optimizer step, but gradients are not being kept across micro-batches."
                " The engine was set up without gradient accumulation; this happens when backward is called by hand."
            )
        owners = list(dict.fromkeys(owner for owner, _, _ in ready))
        if plan is not None and any(p in self._updated for _, p, _ in ready):
            raise RuntimeError(
                "A parameter received a second gradient after its update in the step's last backward (a block ran"
                " twice, or shares weights with another). The 'backward' update schedule cannot apply that exactly;"
                " use SlideFormerStrategy(update_schedule='forward')."
            )
        if self.retain:
            for owner in owners:
                if owner.update_done is not None:
                    owner.update_done.result()  # the previous update no longer reads the retained buffers
        streamed = plan is not None and not self.retain
        if streamed:
            self.optimizer.prefetch([p for _, p, _ in ready])
        with tr.converting(event):
            if streamed and not plan.norm_checked:  # "norm-first" found the norm finite
                for owner in owners:
                    flag, flag_event = self._finite_flag(owner, [c for o, _, cs in ready if o is owner for c in cs])
                    self.worker.submit(_check_finite, flag, plan.step, owner.name, after=flag_event)
            for owner, param, contributions in ready:
                if self.split is not None and param is self.split.param:
                    self._send_rows(self.split, contributions, plan if streamed else None)
                else:
                    self._send_param(owner, param, contributions, plan if streamed else None)
                for c in contributions:
                    for t in _tensors(c):
                        tr.keep_alive(t)
        for _, param, _ in ready:
            self.pending.add(param)
        if plan is not None:
            for owner in owners:
                self.schedule_update(owner, plan, check_finite=True, streamed=streamed)

    def _send_param(
        self, owner: Unit, param: nn.Parameter, contribs: list[Contribution], plan: StepPlan | None
    ) -> None:
        tr = self.transfer
        direct = self.retain and self._take_fresh(owner, param)
        compact = param in self.compact
        if compact and not (direct and len(contribs) == 1 and _dtype(contribs[0]) == self.host[param].dtype):
            self._widen(param, keep=not direct)
            compact = False
        if direct:
            self._device_sq[param] = torch.zeros((), dtype=torch.float32, device=tr.device)
        else:
            self._device_sq.pop(param, None)
        for cut, shape, last in self._chunks(param):
            landing = None if direct else tr.take_landing(self.worker.raise_if_failed)
            numel = math.prod(shape)
            stage = tr.down_stage(numel)
            if compact:  # the bf16 gradient as it came, in the first half of the fp32 chunk
                stage = stage.view(torch.bfloat16)[:numel].view(shape)
                stage.copy_(_rows(contribs[0], cut))
                flat = stage.view(-1).float()
            else:
                stage = stage.view(shape)
                _combine(stage, contribs, cut)
                flat = stage.view(-1)
            if direct:
                self._device_sq[param] += torch.dot(flat, flat)
            target = _rows(self.host[param], cut) if direct else landing[:numel].view(shape)
            event = tr.download(stage, target)
            self.download_bytes += stage.element_size() * numel
            if plan is not None:
                self.worker.submit(self._apply_chunk, param, cut, landing, target, plan, last, after=event)
            else:
                self.worker.submit(self._absorb_chunk, param, cut, landing, target, after=event)

    def _chunks(self, param: nn.Parameter) -> Iterator[tuple[slice | None, tuple[int, ...], bool]]:
        """``param``'s gradient in chunks of leading rows (with the NVMe tier, its blocks): each chunk's rows
        (``None`` for a scalar), shape, and whether it is the last."""
        rows = param.shape[0] if param.dim() else 1
        step = self.optimizer.chunk_rows(param, self.transfer.chunk_numel)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            if not param.dim():
                yield None, (), True
            else:
                yield slice(r0, r1), (r1 - r0, *param.shape[1:]), r1 == rows

    def _send_rows(self, split: RowSplit, contribs: list[Contribution], plan: StepPlan | None) -> None:
        """The touched rows' gradients only, in the order of ``split.index``, chunk by chunk: to the worker's update
        (``plan``: streamed updates), or into a host buffer kept for the update at the end of the step (the
        "forward" schedule; their squares summed on the device for the global norm), or, with ``split.on_device``,
        nowhere: they stay on the device for the update there."""
        tr = self.transfer
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
            self._device_sq[split.param] = torch.dot(flat, flat)
            if split.on_device:
                split.grad = values
                return
            split.grad = self._kept_rows(values.shape)
        else:
            hypers = plan.hypers[self.optimizer.group_index(split.param)]
        for lo in range(0, len(index), split.rows_per_chunk):
            hi = min(len(index), lo + split.rows_per_chunk)
            landing, target, event = self._land(values[lo:hi], split.grad[lo:hi] if plan is None else None)
            if defer:
                split.landed.append((lo, landing, target))
            elif plan is not None:
                self.worker.submit(self._apply_rows, split, lo, hi, landing, target, hypers, after=event)
        if plan is None or defer:
            self.worker.submit(lambda: None, after=event)  # the update, queued later, finds the rows landed
            if defer:
                self.deferred = (split, hypers)
        else:
            self.worker.submit(self.optimizer.end, split.param)

    def _land(self, part: Tensor, target: Tensor | None = None) -> tuple[Tensor | None, Tensor, object]:
        """Copy the device rows ``part`` through a staging chunk into the host tensor ``target``, or into a landing
        buffer taken for them; returns that buffer (``None`` with ``target``), the host rows and the copy's event."""
        tr = self.transfer
        landing = None
        if target is None:
            landing = tr.take_landing(self.worker.raise_if_failed)
            target = landing[: part.numel()].view(part.shape)
        stage = tr.down_stage(part.numel()).view(part.shape)
        stage.copy_(part)
        event = tr.download(stage, target)
        self.download_bytes += 4 * part.numel()
        return landing, target, event

    def _kept_rows(self, shape: tuple[int, ...]) -> Tensor:
        # pinned, kept across steps; a step with more distinct tokens than any before takes a larger one
        numel = math.prod(shape)
        if self._rows_grad is None or self._rows_grad.numel() < numel:
            if self._rows_grad is not None:
                self.transfer.release(self._rows_grad)
            self._rows_grad = self.transfer.host_empty(numel + numel // 4)
        return self._rows_grad[:numel].view(shape)

    def _apply_rows(self, split: RowSplit, lo: int, hi: int, landing: Tensor, grad: Tensor, hypers: Hypers) -> None:
        try:
            split.apply(self.optimizer, lo, hi, grad, hypers)
        finally:
            self.transfer.give_landing(landing)

    def _take_fresh(self, owner: Unit, param: nn.Parameter) -> bool:
        if param not in self.host:
            self._allocate(owner)
        fresh = self.fresh[param]
        self.fresh[param] = False
        return fresh

    def _allocate(self, owner: Unit) -> None:
        params = [p for p, o in zip(owner.params, owner.owner) if o is owner and p not in self.host]
        for dtype in (torch.float32, torch.bfloat16):
            these = [p for p in params if (p in self.compact) == (dtype == torch.bfloat16)]
            if not these:  # no empty pinned buffer per unit
                continue
            flat = self.transfer.host_empty(sum(p.numel() for p in these), dtype)
            offset = 0
            for p in these:
                self.host[p] = flat[offset : offset + p.numel()].view(p.shape)
                self.fresh[p] = True
                offset += p.numel()

    def _widen(self, param: nn.Parameter, *, keep: bool) -> None:
        # a compact gradient becomes fp32 for good: a second contribution in the window (``keep``: the worker copies
        # the first one over, after the copies queued before) or one not in bf16
        compact = self.host[param]
        self.host[param] = wide = self.transfer.host_empty(param.numel()).view(param.shape)
        self.compact.discard(param)
        if keep:
            self.worker.submit(wide.copy_, compact)

    def _finite_flag(self, owner: Unit, contributions: list[Contribution]) -> tuple[Tensor, object]:
        ok = torch.ones((), dtype=torch.bool, device=self.transfer.device)
        for c in contributions:
            t = c.values if isinstance(c, Rows) else c
            if t.numel():
                lo, hi = torch.aminmax(t)
                ok &= torch.isfinite(lo) & torch.isfinite(hi)
        if owner not in self._flags:
            self._flags[owner] = self.transfer.host_empty(1, torch.bool)
        flag = self._flags[owner]
        flag.copy_(ok.view(1), non_blocking=True)
        return flag, self.transfer.record()  # on the conversion stream

    # ---- on the worker ---------------------------------------------------------------------------------------

    def _absorb_chunk(self, param, cut, landing, grad) -> None:
        if landing is not None:
            _rows(self.host[param], cut).add_(grad)
            self.transfer.give_landing(landing)

    def _apply_chunk(self, param, cut, landing, grad, plan: StepPlan, last: bool) -> None:
        try:
            hypers = plan.hypers[self.optimizer.group_index(param)]
            if cut is None or cut.start == 0:
                self.optimizer.begin(param, hypers)
            self.optimizer.update([param], [grad], hypers, rows=[cut], grad_scale=plan.grad_scale)
            if last:
                self.optimizer.end(param)
        finally:
            self.transfer.give_landing(landing)

    # ---- retained gradients ----------------------------------------------------------------------------------

    def schedule_update(self, owner: Unit, plan: StepPlan, *, check_finite: bool, streamed: bool = False) -> None:
        """Queue the update of ``owner``'s parameters that have gradients in this window (main thread).

        Args:
            check_finite: refuse NaN/Inf gradients (not needed when the global norm was found finite).
            streamed: the chunks already carry the update; only the bookkeeping is left.
        """
        params = [p for p, o in zip(owner.params, owner.owner) if o is owner and p in self.pending]
        if not params:
            return
        for p in params:
            self.pending.discard(p)
            self._device_sq.pop(p, None)
            self._updated.add(p)
            if self.retain:
                self.fresh[p] = True
        owner.version += 1
        if not streamed:
            self.optimizer.prefetch(params)
        if streamed:
            task = (lambda: None,)
        elif self.split is not None and len(params) == 1 and params[0] is self.split.param:
            if self.split.on_device:
                owner.update_done = self._update_rows_on_device(owner.name, self.split, plan, check_finite)
                return
            task = (self._update_rows, owner.name, self.split, plan, check_finite)
        else:
            task = (self._update, owner.name, params, plan, check_finite)
        owner.update_done = self.worker.submit(*task)

    def discard(self) -> None:
        """Drop this window's gradients without applying them (a skipped step)."""
        for p in self.pending:
            self.fresh[p] = True
        self.pending.clear()
        self._device_sq.clear()

    def global_norm(self, params: list[nn.Parameter]) -> float:
        """The 2-norm of this window's gradients of ``params``, summed in the given (fixed) order."""
        params = [p for p in params if p in self.pending]
        on_device = [p for p in params if p in self._device_sq]
        on_host = [p for p in params if p not in self._device_sq]
        squares = {}
        if on_device:
            values = torch.stack([self._device_sq[p] for p in on_device]).double().cpu().tolist()
            squares.update(zip(on_device, values))
        if on_host:
            norms = torch._foreach_norm([self.host[p] for p in on_host], 2.0)
            squares.update((p, float(n) ** 2) for p, n in zip(on_host, norms))
        return math.sqrt(sum(squares[p] for p in params))

    def _checked_rows_grad(
        self, name: str, split: RowSplit, plan: StepPlan, check_finite: bool
    ) -> tuple[Tensor, Hypers]:
        # the touched rows' gradients (kept by _send_rows), checked and clipped by value, and their group's hypers
        grad = split.grad
        if check_finite and not bool(torch.isfinite(torch.linalg.vector_norm(grad))):
            raise NonFiniteGradientError(_nonfinite_message(plan.step, name))
        if plan.clip_value is not None:
            grad.clamp_(-plan.clip_value, plan.clip_value)
        return grad, plan.hypers[self.optimizer.group_index(split.param)]

    def _update_rows(self, name: str, split: RowSplit, plan: StepPlan, check_finite: bool) -> None:
        # the touched rows of a split embedding, on the worker; the rest had their update
        grad, hypers = self._checked_rows_grad(name, split, plan, check_finite)
        split.apply(self.optimizer, 0, len(grad), grad, hypers, plan.grad_scale)  # in passes of rows.PASS_NUMEL
        self.optimizer.end(split.param)

    def _update_rows_on_device(self, name: str, split: RowSplit, plan: StepPlan, check_finite: bool) -> Future:
        # the "forward" schedule (main thread): the update on the device now; the write-back after the updates that
        # the next forward waits for (end_window)
        grad, hypers = self._checked_rows_grad(name, split, plan, check_finite)
        split.update_on_device(self.optimizer, grad, hypers, plan.grad_scale)
        self.optimizer.end(split.param)
        split.grad = None  # the device may reuse it
        # the next forward's rows shared with this step come from the device copy until the write-back has landed
        landed, done = Future(), self.transfer.record()
        self.row_copy = RowCopy(split.index, split.state["param"], done, landed)
        self._write_back_later = (split, landed, done)
        return landed

    def _write_back(self, split: RowSplit, landed: Future, after) -> None:
        """Copy the device-updated rows of ``split.state`` to landing buffers, chunk by chunk, for the worker to put
        into the host's masters and state; ``landed`` is done after the last (sender thread)."""
        tr = self.transfer
        last = None
        try:
            with tr.converting(after):
                for name, t in split.state.items():
                    tr.keep_alive(t)
                    for lo in range(0, len(t), split.rows_per_chunk):
                        landing, target, event = self._land(t[lo : lo + split.rows_per_chunk])
                        last = self.worker.submit(self._write_back_rows, split, name, lo, landing, target, after=event)
            split.state = None  # all read by the copies above (keep_alive): the device may reuse it
        except BaseException as err:
            landed.set_exception(err)
            raise
        if last is None:
            landed.set_result(None)
        else:
            last.add_done_callback(partial(_settle, landed))

    def _write_back_rows(self, split: RowSplit, name: str, lo: int, landing: Tensor, values: Tensor) -> None:
        try:
            split.write_back(self.optimizer, name, lo, values)
        finally:
            self.transfer.give_landing(landing)

    def _update(self, name: str, params: list[nn.Parameter], plan: StepPlan, check_finite: bool) -> None:
        grads = [self.host[p] for p in params]
        if check_finite:
            norm = torch.linalg.vector_norm(torch.stack([n.float() for n in torch._foreach_norm(grads, 2.0)]), 2.0)
            if not torch.isfinite(norm):
                raise NonFiniteGradientError(_nonfinite_message(plan.step, name))
        compact = [g.dtype != torch.float32 for g in grads]  # bf16: widened chunk by chunk (_update_compact)
        groups: dict[int, list[int]] = {}
        for i, p in enumerate(params):
            groups.setdefault(self.optimizer.group_index(p), []).append(i)
        for g, idx in groups.items():
            hypers = plan.hypers[g]
            for i in idx:
                self.optimizer.begin(params[i], hypers)
            together = [i for i in idx if not compact[i]]
            if together:
                wide = [grads[i] for i in together]
                if plan.clip_value is not None:
                    torch._foreach_clamp_min_(wide, -plan.clip_value)
                    torch._foreach_clamp_max_(wide, plan.clip_value)
                self.optimizer.update([params[i] for i in together], wide, hypers, grad_scale=plan.grad_scale)
            for i in idx:
                if compact[i]:
                    self._update_compact(params[i], grads[i], hypers, plan)
            for i in idx:
                self.optimizer.end(params[i])

    def _update_compact(self, param: nn.Parameter, grad: Tensor, hypers: Hypers, plan: StepPlan) -> None:
        # a bf16 retained gradient, widened to fp32 a chunk at a time (clipped by value there)
        if self._widening is None:
            self._widening = torch.empty(self.transfer.chunk_numel, dtype=torch.float32)
        for cut, shape, _ in self._chunks(param):
            chunk = self._widening[: math.prod(shape)].view(shape)
            chunk.copy_(_rows(grad, cut))
            if plan.clip_value is not None:
                chunk.clamp_(-plan.clip_value, plan.clip_value)
            self.optimizer.update([param], [chunk], hypers, rows=[cut], grad_scale=plan.grad_scale)


def _dtype(c: Contribution) -> torch.dtype:
    return c.values.dtype if isinstance(c, Rows) else c.dtype


def _tensors(c: Contribution) -> tuple[Tensor, ...]:
    return (c.index, c.values) if isinstance(c, Rows) else (c,)


def _rows(t: Tensor, cut: slice | None) -> Tensor:
    return t if cut is None else t[cut]


def _combine(stage: Tensor, contributions: list[Contribution], cut: slice | None) -> None:
    """Write the fp32 sum of the contributions' rows ``cut`` into ``stage`` (on the device)."""
    for k, c in enumerate(contributions):
        if isinstance(c, Rows):
            if k == 0:
                stage.zero_()
            keep = (c.index >= cut.start) & (c.index < cut.stop)
            stage.index_add_(0, c.index[keep] - cut.start, c.values[keep])
        elif k == 0:
            stage.copy_(_rows(c, cut))
        else:
            stage.add_(_rows(c, cut))


def _settle(future: Future, done: Future) -> None:
    """Finish ``future`` as ``done`` finished."""
    if done.exception() is not None:
        future.set_exception(done.exception())
    else:
        future.set_result(None)


def _check_finite(flag: Tensor, step: int, name: str) -> None:
    if not bool(flag[0]):
        raise NonFiniteGradientError(_nonfinite_message(step, name))


def _nonfinite_message(step: int, name: str) -> str:
    return (
        f"Non-finite gradient (NaN or Inf) at optimizer step {step} in '{name}'; it was not applied and training"
        " stops here. Lower the learning rate, check the data of this step, or enable gradient clipping"
        " (with clipping, SlideFormerStrategy(on_nonfinite='skip') skips such steps instead)."
    )
