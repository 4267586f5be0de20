"""Gradients from a unit's backward on the device to the host, chunk by chunk, on a sender thread.

Each gradient leaves through the device staging chunks (upcast to fp32 on the device, unless its update reads it in
bf16: ``CpuOptimizer.reads_bf16_grads``) into a pinned landing buffer from a pool, for the CPU worker to apply
(streamed), or straight into the retained host buffer (``updates.py``). A later contribution to a retained gradient is
added in the staging chunk to the rows brought back up from that buffer (PCIe has room where the CPU has none), and the
sum goes back into it, or to its update. The copies are issued by the sender thread, so the backward pass never waits
for a free landing buffer while the CPU catches up; it waits only when the gradients queued on the device exceed
``max_queued_bytes``.

Contributions from a unit that does not own a parameter (the output head of a model with tied embeddings) wait on
the device until the owner's backward adds its own, so every parameter is moved and updated once.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor, nn

from .optim import rows_of
from .rows import Contribution, Rows
from .transfer import Transfer
from .units import Unit
from .updates import StepPlan, Updates
from .worker import CpuWorker

# sends one parameter's contributions another way than whole chunks (the split embedding's touched rows)
Route = Callable[[list[Contribution], "StepPlan | None"], None]


class GradSender:
    """Moves each unit's gradients to the host and hands them to the CPU worker.

    Args:
        transfer: the host/device copier.
        worker: the CPU worker.
        updates: the retained buffers and the updates (``updates.py``).
        max_queued_bytes: device memory the gradients waiting to be sent may hold before :meth:`push` waits.
    """

    def __init__(self, transfer: Transfer, worker: CpuWorker, updates: Updates, *, max_queued_bytes: int) -> None:
        self.transfer = transfer
        self.worker = worker
        self.updates = updates
        self.routes: dict[nn.Parameter, Route] = {}  # parameters sent by a route of their own, this step
        self.download_bytes = 0
        self.upload_bytes = 0  # retained rows brought back up to add a later contribution
        self._landed: dict[nn.Parameter, object] = {}  # the copy that brought a retained gradient's rows back
        self._window_ok: dict[Unit, Tensor] = {}  # on the device: the window's earlier contributions were finite
        self.max_queued_bytes = max_queued_bytes
        self._stash: dict[nn.Parameter, list[Contribution]] = {}  # waiting for the owner's contribution
        self._owner_of: dict[nn.Parameter, Unit] = {}
        self._flags: dict[Unit, Tensor] = {}
        self._averaging: list[Callable[[], None]] = []  # waits for gradients pushed, for the next send to call
        self._queued_bytes = 0
        self._room = threading.Condition()
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._sender = threading.Thread(target=self._send_loop, name="slide-send", daemon=True)
        self._sender.start()

    def owner_of(self, param: nn.Parameter) -> Unit:
        return self._owner_of[param]

    def push(
        self, unit: Unit, grads: dict[int, Contribution], plan: StepPlan | None,
        averaged: Callable[[], None] | None = None,
    ) -> None:  # fmt: skip
        """Send ``unit``'s gradients (by parameter index) on their way; called right after its backward.

        Args:
            plan: set when this backward completes the window and the updates stream (schedule "backward"): each
                parameter is updated as soon as its gradient has arrived.
            averaged: waits until the gradients hold their mean over the processes (``DataParallel.average``); the
                sender calls it before it reads them.
        """
        if averaged is not None:
            self._averaging.append(averaged)
        ready: list[tuple[Unit, nn.Parameter, list[Contribution]]] = []
        for i, grad in grads.items():
            param, owner = unit.params[i], unit.owner[i]
            self._owner_of[param] = owner
            self._stash.setdefault(param, []).append(grad)
            if owner is unit:
                ready.append((owner, param, self._stash.pop(param)))
        self._enqueue(ready, plan)

    def measure(self, unit: Unit, grads: dict[int, Contribution]) -> None:
        """Sum the squares of ``unit``'s gradients on the device, as ``Updates.global_norm`` reads them, and drop the
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
        for cut, shape, _ in self.updates.chunks(param):
            stage = torch.empty(shape, dtype=torch.float32, device=self.transfer.device)
            combine(stage, contributions, cut)
            flat = stage.view(-1)
            total += torch.dot(flat, flat)
        self.updates.device_sq[param] = total
        self.updates.pending.add(param)

    def flush(self, plan: StepPlan | None) -> None:
        """Send contributions still waiting for an owner whose backward did not run (e.g. an unused embedding)."""
        ready = [(self._owner_of[p], p, c) for p, c in self._stash.items()]
        self._stash.clear()
        self._enqueue(ready, plan)

    def put(self, job: Callable[[], None], nbytes: int = 0) -> None:
        """Run ``job`` on the sender thread, after everything queued before it."""
        self._queue.put((job, nbytes))

    def drain(self) -> None:
        """Wait until every queued gradient has been sent (and its update queued); raise the sender's error."""
        self._queue.join()
        self._raise()

    def close(self) -> None:
        self._queue.put(None)
        self._sender.join()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _enqueue(self, ready: list, plan: StepPlan | None) -> None:
        if not ready:  # (a contribution waiting for its owner: its averaging is waited for with the owner's)
            return
        nbytes = sum(t.numel() * t.element_size() for _, _, cs in ready for c in cs for t in _tensors(c))
        with self._room:
            while self._queued_bytes and self._queued_bytes + nbytes > self.max_queued_bytes:
                self._room.wait(timeout=0.5)
                self._raise()
            self._queued_bytes += nbytes
        self._raise()
        averaging, self._averaging = self._averaging, []
        self.put(partial(self._send, ready, plan, self.transfer.record(), averaging), nbytes)

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

    # ---- on the sender thread --------------------------------------------------------------------------------

    def _send(
        self, ready: list[tuple[Unit, nn.Parameter, list[Contribution]]], plan: StepPlan | None, event,
        averaging: list[Callable[[], None]],
    ) -> None:  # fmt: skip
        tr, updates = self.transfer, self.updates
        with tr.converting(event):  # the conversion stream (not the training one) waits for the averages
            for wait in averaging:
                wait()
        if plan is None and not updates.retain:
            raise RuntimeError(
                "A backward pass ran outside the optimizer step, but gradients are not being kept across micro-batches."
                " The engine was set up without gradient accumulation; this happens when backward is called by hand."
            )
        owners = list(dict.fromkeys(owner for owner, _, _ in ready))
        if plan is not None and any(p in updates.updated for _, p, _ in ready):
            raise RuntimeError(
                "A parameter received a second gradient after its update in the step's last backward (a block ran"
                " twice, or shares weights with another). The 'backward' update schedule cannot apply that exactly;"
                " use SlideFormerStrategy(update_schedule='forward')."
            )
        if updates.retain:
            for owner in owners:
                if owner.update_done is not None:
                    owner.update_done.result()  # the previous update no longer reads the retained buffers
        # the updates stream with the window's last backward, accumulated gradients too (schedule "backward")
        streamed = plan is not None
        if streamed:
            updates.optimizer.prefetch([p for _, p, _ in ready])
        with tr.converting(event):
            for owner in owners:
                contributions = [c for o, _, cs in ready if o is owner for c in cs]
                if streamed and not plan.norm_checked:  # "norm-first" found the norm finite
                    flag, flag_event = self._finite_flag(owner, contributions)
                    self.worker.submit(updates.check_flag, flag, plan, owner.name, after=flag_event)
                elif not streamed and updates.retain:
                    self._window_finite(owner, contributions)
            for owner, param, contributions in ready:
                if param in self.routes:
                    self.routes[param](contributions, plan)
                else:
                    self._send_param(owner, param, contributions, plan)
                for c in contributions:
                    for t in _tensors(c):
                        tr.keep_alive(t)
        for _, param, _ in ready:
            updates.pending.add(param)
        if plan is not None:
            for owner in owners:
                updates.schedule(owner, plan, check_finite=True, streamed=[p for o, p, _ in ready if o is owner])

    def _send_param(
        self, owner: Unit, param: nn.Parameter, contribs: list[Contribution], plan: StepPlan | None
    ) -> None:
        tr, updates = self.transfer, self.updates
        if updates.retain and plan is not None and param not in updates.host:
            direct = True  # its first contribution streams to its update: no retained buffer (deferred updates)
        else:
            direct = updates.retain and updates.take_fresh(owner, param)
        compact = param in updates.compact
        # a later contribution is added on the device, into the retained rows brought up for it, so an accumulated
        # micro-batch costs PCIe time, not a CPU pass over the gradients; a buffer the worker is still widening
        # takes the landing path
        readback = updates.retain and not direct and not compact
        if compact and not (direct and len(contribs) == 1 and _dtype(contribs[0]) == updates.host[param].dtype):
            updates.widen(param, keep=not direct)
            compact = False
        into_host = (direct or readback) and plan is None  # else the sum streams to its update
        # a lone bf16 gradient that streams to an update reading it as it is leaves in bf16 (half the bytes; exact)
        compact = compact or (
            plan is not None and not readback and len(contribs) == 1 and isinstance(contribs[0], Tensor)
            and contribs[0].dtype == torch.bfloat16 and updates.optimizer.reads_bf16_grads(param)
        )  # fmt: skip
        if into_host:
            updates.device_sq[param] = torch.zeros((), dtype=torch.float32, device=tr.device)
        else:
            updates.device_sq.pop(param, None)
        if readback:
            tr.wait(self._landed.get(param))  # the previous contribution's rows are back on the host
        event = None  # (no rows of it are this process's: shared_host.py)
        for cut, shape, last in updates.chunks(param):
            landing = None if into_host else tr.take_landing(self.worker.raise_if_failed)
            numel = math.prod(shape)
            stage = tr.down_stage(numel)
            if compact:  # the bf16 gradient as it came, in the first half of the fp32 chunk
                stage = stage.view(torch.bfloat16)[:numel].view(shape)
                stage.copy_(rows_of(contribs[0], cut))
            else:
                stage = stage.view(shape)
                if readback:
                    stage.copy_(rows_of(updates.host[param], cut), non_blocking=True)
                    self.upload_bytes += 4 * numel
                combine(stage, contribs, cut, add=readback)
            if into_host:
                flat = stage.view(-1).float()
                updates.device_sq[param] += torch.dot(flat, flat)
                target = rows_of(updates.host[param], cut)
            else:
                target = landing.view(stage.dtype)[:numel].view(shape)
            event = tr.download(stage, target)
            self.download_bytes += stage.element_size() * numel
            if plan is not None:
                self.worker.submit(updates.apply_chunk, param, cut, landing, target, plan, last, after=event)
            else:
                self.worker.submit(updates.absorb_chunk, param, cut, landing, target, after=event)
        if into_host:
            self._landed[param] = event

    def land(self, part: Tensor, target: Tensor | None = None) -> tuple[Tensor | None, Tensor, object]:
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

    def window_done(self) -> None:
        """The accumulation window is over (its updates are queued, or it was skipped)."""
        self._window_ok.clear()

    def check_window(self, owner: Unit, plan: StepPlan) -> bool:
        """Queue the check that ``owner``'s retained gradients of this window are finite (found on the device as they
        left) before its update, on the worker; ``False`` when they were not checked as they left."""
        if owner not in self._window_ok:
            return False
        with self.transfer.converting(None):
            flag, event = self._finite_flag(owner, [])
        self.worker.submit(self.updates.check_flag, flag, plan, owner.name, after=event)
        return True

    def _window_finite(self, owner: Unit, contributions: list[Contribution]) -> None:
        # whether the window's earlier contributions were finite, for the check when the last one streams
        ok = self._window_ok.setdefault(owner, torch.ones((), dtype=torch.bool, device=self.transfer.device))
        ok &= _all_finite(contributions, self.transfer.device)

    def _finite_flag(self, owner: Unit, contributions: list[Contribution]) -> tuple[Tensor, object]:
        ok = _all_finite(contributions, self.transfer.device)
        if owner in self._window_ok:
            ok &= self._window_ok.pop(owner)
        if owner not in self._flags:
            self._flags[owner] = self.transfer.host_empty(1, torch.bool)
        flag = self._flags[owner]
        flag.copy_(ok.view(1), non_blocking=True)
        return flag, self.transfer.record()  # on the conversion stream


def _all_finite(contributions: list[Contribution], device: torch.device) -> Tensor:
    ok = torch.ones((), dtype=torch.bool, device=device)
    for c in contributions:
        t = c.values if isinstance(c, Rows) else c
        if t.numel():
            lo, hi = torch.aminmax(t)
            ok &= torch.isfinite(lo) & torch.isfinite(hi)
    return ok


def _dtype(c: Contribution) -> torch.dtype:
    return c.values.dtype if isinstance(c, Rows) else c.dtype


def _tensors(c: Contribution) -> tuple[Tensor, ...]:
    return (c.index, c.values) if isinstance(c, Rows) else (c,)


def combine(stage: Tensor, contributions: list[Contribution], cut: slice | None, *, add: bool = False) -> None:
    """Write the fp32 sum of the contributions' rows ``cut`` into ``stage`` (on the device), or add it (``add``)."""
    for k, c in enumerate(contributions, start=int(add)):
        if isinstance(c, Rows):
            if k == 0:
                stage.zero_()
            keep = (c.index >= cut.start) & (c.index < cut.stop)  # (U,) the rows inside this chunk
            stage.index_add_(0, c.index[keep] - cut.start, c.values[keep])
        elif k == 0:
            stage.copy_(rows_of(c, cut))
        else:
            stage.add_(rows_of(c, cut))
