"""The step's updates: what an optimizer step applies (``StepPlan``), the gradients kept on the host for it, the
global norm and clipping, and the update tasks the CPU worker runs.

Two ways a gradient reaches its update (``grads.py`` moves it):

- **streamed** (schedules "backward" and "norm-first"): each chunk lands in a pinned buffer from a pool and the worker
  applies the optimizer to those rows at once (:meth:`Updates.apply_chunk`). Without accumulation no full gradient
  ever exists in host memory.
- **retained** (accumulation, or schedule "forward" for exact global-norm clipping): gradients are kept in host
  buffers (:attr:`Updates.host`) for the window. The first contribution is copied straight into them; a later one is
  added on the device to the rows brought back up from them (``grads.py``), so the CPU never adds gradients. With
  "backward", the window's last backward streams those sums to their update; otherwise :meth:`Updates.schedule` queues
  the update once the window is complete. ``compact`` parameters (one bf16 contribution per window) keep theirs in
  bf16, which holds it exactly; the update reads it as it is (bf16 moments' kernel) or widens it to fp32 a chunk at a
  time. One that receives a second contribution (a block that ran twice) is widened to fp32 for the rest of the run,
  its second contribution added by the worker (:meth:`Updates.absorb_chunk`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .optim import CpuOptimizer, Hypers, own_part, rows_of
from .shared_host import SharedHost
from .transfer import Transfer
from .units import Unit
from .worker import CpuWorker


class NonFiniteGradientError(FloatingPointError):
    """A gradient held NaN or Inf; it was not applied. ``applied``: the units whose update of that step had been
    applied before it was found (the "backward" schedule updates each unit as its gradient arrives)."""

    def __init__(self, message: str, applied: list[str] = ()) -> None:
        super().__init__(message)
        self.applied = list(applied)


def nonfinite(plan: StepPlan, name: str) -> NonFiniteGradientError:
    """The error for a non-finite gradient of ``name`` in ``plan``'s step, naming what of the step was applied."""
    if plan.applied:
        what = (
            f"it was not applied, but the step's updates of {', '.join(repr(n) for n in plan.applied)} had been"
            f" already: the model now mixes steps {plan.step - 1} and {plan.step}, and SlideFormer saves no checkpoint"
            " of it. Training stops here; resume from the last checkpoint"
        )
    else:
        what = "nothing of that step was applied and training stops here"
    return NonFiniteGradientError(
        f"Non-finite gradient (NaN or Inf) at optimizer step {plan.step} in '{name}'; {what}. Lower the learning"
        " rate, check the data of this step, or enable gradient clipping (with clipping by norm,"
        " SlideFormerStrategy(on_nonfinite='skip') skips such steps instead).",
        plan.applied,
    )


def _streamed_done(plan: StepPlan, name: str) -> None:
    # a streamed unit's chunks are applied (on the worker), unless its update was deferred (embedding.py)
    if name not in plan.deferred:
        plan.applied.append(name)


@dataclass
class StepPlan:
    """What the next update applies, frozen when the optimizer step begins."""

    step: int
    hypers: list[Hypers]
    grad_scale: Tensor | None = None  # clipping by norm: gradients are divided by this
    clip_value: float | None = None  # clipping by value
    norm_checked: bool = False  # the global norm was found finite
    norm: float = 0.0  # "norm-first": the global norm of the first backward pass
    skip: bool = False  # non-finite norm and on_nonfinite="skip": apply nothing
    applied: list[str] = field(default_factory=list)  # the units updated so far, in order (by the worker)
    scheduled: int = 0  # updates queued (main thread)
    deferred: set[str] = field(default_factory=set)  # units whose update runs later than their bookkeeping says
    finished: bool = False  # every update of the step is queued

    @property
    def partial(self) -> bool:
        """Some of the step's updates were applied, not all (after a fault: the model mixes two steps)."""
        return bool(self.applied) and not (self.finished and len(self.applied) >= self.scheduled)


class Updates:
    """The updates of one run: retained gradients, the step's bookkeeping, the global norm, the worker's tasks.

    Args:
        transfer: the host/device copier (pinned host buffers).
        worker: the CPU worker.
        optimizer: the CPU optimizer driver.
        retain: keep full gradients on the host for the accumulation window (module docstring).
        compact: parameters whose retained gradients are kept in bf16 (module docstring).
    """

    def __init__(
        self,
        transfer: Transfer,
        worker: CpuWorker,
        optimizer: CpuOptimizer,
        *,
        retain: bool,
        compact: set[nn.Parameter] = frozenset(),
    ) -> None:
        self.transfer = transfer
        self.worker = worker
        self.optimizer = optimizer
        self.retain = retain
        self.compact = set(compact) if retain else set()
        self.host: dict[nn.Parameter, Tensor] = {}  # retained gradients (views into one buffer per owner unit)
        self.lent: set[nn.Parameter] = set()  # those held in the delayed blocks' copies (lend)
        self.fresh: dict[nn.Parameter, bool] = {}  # retained buffer holds nothing of this window yet
        self.pending: set[nn.Parameter] = set()  # parameters with gradients in this window
        self.recent: deque[StepPlan] = deque(maxlen=2)  # the steps whose updates may still run (one overlaps the next)
        self.updated: set[nn.Parameter] = set()  # updated during this window's last backward
        # NOTE: squared norms of gradients with one contribution in the window, summed on the device as they
        # leave, so clipping by norm costs the CPU no pass over the gradients.
        self.device_sq: dict[nn.Parameter, Tensor] = {}
        self._widening: Tensor | None = None  # the worker's fp32 chunk for a compact gradient's update
        self.shared: SharedHost | None = None  # the node's processes share the state, each updating its rows

    def share(self, shared: SharedHost, units: list[Unit]) -> None:
        """The node's processes hold the retained gradients once (``shared_host.py``): their buffers, made now (every
        process at once), and each process's rows (``CpuOptimizer.own_rows``) from here on."""
        self.shared = shared
        if not self.retain:
            return
        owned = [[p for p in u.owned() if p.requires_grad] for u in units]
        owned = [params for params in owned if params]
        flats = shared.tensors([(sum(p.numel() for p in params), torch.float32) for params in owned])
        for params, flat in zip(owned, flats):
            if self.transfer.is_cuda:
                self.transfer.register(flat)
            offset = 0
            for p in params:
                self.host[p] = flat[offset : offset + p.numel()].view(p.shape)
                self.fresh[p] = True
                offset += p.numel()

    def release(self) -> None:
        """Drop the retained gradients' host buffers (training is over)."""
        self.host.clear()
        self.fresh.clear()
        self.lent.clear()
        self._widening = None

    def own_rows(self, param: nn.Parameter) -> slice | None:
        """The rows of ``param`` this process moves and updates (``None``: all)."""
        return self.optimizer.own_rows.get(param)

    def chunks(self, param: nn.Parameter) -> Iterator[tuple[slice | None, tuple[int, ...], bool]]:
        """``param``'s gradient in chunks of leading rows (with the NVMe tier, its blocks): each chunk's rows
        (``None`` for a scalar), shape, and whether it is the last."""
        own = self.own_rows(param)
        if not param.dim():
            if own is None:
                yield None, (), True
            return
        start, stop = (own.start, own.stop) if own is not None else (0, param.shape[0])
        step = self.optimizer.chunk_rows(param, self.transfer.chunk_numel)
        for r0 in range(start, stop, step):
            r1 = min(stop, r0 + step)
            yield slice(r0, r1), (r1 - r0, *param.shape[1:]), r1 == stop

    # ---- retained buffers ------------------------------------------------------------------------------------

    def take_fresh(self, owner: Unit, param: nn.Parameter) -> bool:
        """Whether ``param``'s retained buffer holds nothing of this window yet (it does from now on)."""
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

    def lend(self, buffers: dict[nn.Parameter, Tensor]) -> None:
        """These parameters' next gradients land in the given bf16 buffers (a delayed block's live copies,
        ``delay.py``), not in buffers of their own."""
        self.host.update(buffers)
        self.fresh.update(dict.fromkeys(buffers, True))
        self.lent.update(buffers)

    def widen(self, param: nn.Parameter, *, keep: bool) -> None:
        """A compact gradient becomes fp32 for good: a second contribution in the window (``keep``: the worker copies
        the first one over, after the copies queued before) or one not in bf16."""
        if param in self.lent:
            raise RuntimeError(
                "A delayed block's weight received a second gradient in one step (a block that runs twice), but its"
                " gradient is held in the copy of its weights that this step computes with. Train with"
                " SlideFormerStrategy(engine=EngineConfig(compact_retained_grads=False)), or without delayed_update."
            )
        compact = self.host[param]
        self.host[param] = wide = self.transfer.host_empty(param.numel()).view(param.shape)
        self.compact.discard(param)
        if keep:
            self.worker.submit(wide.copy_, compact)

    # ---- scheduling ------------------------------------------------------------------------------------------

    def schedule(
        self,
        owner: Unit,
        plan: StepPlan,
        *,
        check_finite: bool,
        streamed: Collection[nn.Parameter] = (),
        run: Callable[[StepPlan, bool], Future] | None = None,
        copies: dict[nn.Parameter, Tensor] | None = None,
    ) -> None:
        """Queue the update of ``owner``'s parameters that have gradients in this window (main thread).

        Args:
            check_finite: refuse NaN/Inf gradients (not needed when the global norm was found finite).
            streamed: parameters whose chunks already carry the update; only the bookkeeping is left for them.
            run: queues the update itself and returns its future (the split embedding's touched rows).
            copies: tensors that receive updated parameters' values (a delayed block's next weights, ``delay.py``); a
                lent parameter's gradient is there, its buffer swapped since it landed.
        """
        params = [p for p, o in zip(owner.params, owner.owner) if o is owner and p in self.pending]
        if not params:
            return
        self.count(plan)
        for p in params:
            self.pending.discard(p)
            self.device_sq.pop(p, None)
            self.updated.add(p)
            if self.retain:
                self.fresh[p] = True
        owner.version += 1
        # a retained gradient with no contribution in the window's last backward did not stream: it is applied here
        streamed = set(streamed)
        rest = [p for p in params if p not in streamed]
        if not rest:  # after its chunks
            owner.update_done = self.worker.submit(_streamed_done, plan, owner.name)
        elif run is not None:
            owner.update_done = run(plan, check_finite)
        else:
            self.optimizer.prefetch(rest)
            held = {p: copies[p] if copies and p in self.lent else self.held(p) for p in rest}  # read now
            owner.update_done = self.worker.submit(self._update, owner.name, held, plan, check_finite, copies or {})
        if self.shared is not None:  # the unit's weights are whole once every process has updated its rows
            owner.update_done = self.worker.submit(self.shared.barrier)

    def count(self, plan: StepPlan) -> None:
        """One more update of ``plan``'s step is queued (main thread)."""
        plan.scheduled += 1
        if not any(p is plan for p in self.recent):
            self.recent.append(plan)

    def discard(self) -> None:
        """Drop this window's gradients without applying them (a skipped step)."""
        for p in self.pending:
            self.fresh[p] = True
        self.pending.clear()
        self.device_sq.clear()

    def global_norm(self, params: list[nn.Parameter]) -> float:
        """The 2-norm of this window's gradients of ``params``, summed in the given (fixed) order."""
        params = [p for p in params if p in self.pending]
        on_device = [p for p in params if p in self.device_sq]
        on_host = [p for p in params if p not in self.device_sq]
        squares = {}
        if on_device:
            values = torch.stack([self.device_sq[p] for p in on_device]).double().cpu().tolist()
            squares.update(zip(on_device, values))
        if on_host:
            norms = torch._foreach_norm([self.held(p) for p in on_host], 2.0)
            squares.update((p, float(n) ** 2) for p, n in zip(on_host, norms))
        total = sum(squares[p] for p in params)
        return math.sqrt(self.shared.sum(total) if self.shared is not None else total)

    def check_flag(self, flag: Tensor, plan: StepPlan, name: str) -> None:
        """Raise for a host flag (from the device) that says a gradient was not finite (on the worker); with a
        node's processes sharing the rows out, in every process if in one (each checked its own rows)."""
        finite = bool(flag[0])
        if self.shared is not None:
            finite = self.shared.all_true(finite)
        if not finite:
            raise nonfinite(plan, name)

    def held(self, param: nn.Parameter) -> Tensor:
        """This process's rows of ``param``'s retained gradient."""
        part = own_part(self.host[param], self.own_rows(param))
        return part if part is not None else self.host[param].new_zeros(0)  # a scalar another process updates

    def clip_by_norm(self, plan: StepPlan, total: float, max_norm: float, *, skip_nonfinite: bool) -> None:
        """Set ``plan``'s clipping coefficient from the global norm ``total``, exactly as
        ``torch.nn.utils.clip_grad_norm_``; a non-finite norm skips the step or raises."""
        if not math.isfinite(total):
            if skip_nonfinite:
                plan.skip = True
                return
            raise nonfinite(plan, "the global gradient norm")
        plan.norm_checked = True
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            plan.grad_scale = torch.tensor(1.0 / coef, dtype=torch.float32)

    # ---- on the worker ---------------------------------------------------------------------------------------

    def absorb_chunk(self, param: nn.Parameter, cut: slice | None, landing: Tensor | None, grad: Tensor) -> None:
        """Add a landed chunk of a later contribution into the retained gradient."""
        if landing is not None:
            rows_of(self.host[param], cut).add_(grad)
            self.transfer.give_landing(landing)

    def apply_chunk(self, param, cut, landing, grad, plan: StepPlan, last: bool) -> None:
        """Apply the update to the rows ``cut`` of ``param`` with their landed gradient (streamed)."""
        try:
            hypers = plan.hypers[self.optimizer.group_index(param)]
            own = self.own_rows(param)
            if cut is None or cut.start == (own.start if own is not None else 0):
                self.optimizer.begin(param, hypers)
            self.optimizer.update([param], [grad], hypers, rows=[cut], grad_scale=plan.grad_scale)
            if last:
                self.optimizer.end(param)
        finally:
            self.transfer.give_landing(landing)

    def _update(
        self, name: str, held: dict[nn.Parameter, Tensor], plan: StepPlan, check_finite: bool,
        copies: dict[nn.Parameter, Tensor],
    ) -> None:  # fmt: skip
        params = [p for p in held if p.dim() or self.own_rows(p) is None]  # not the scalars of other processes
        rows = [self.own_rows(p) for p in params]
        grads = [held[p] for p in params]
        if check_finite:
            norms = [n.float() for n in torch._foreach_norm(grads, 2.0)]
            finite = bool(torch.isfinite(torch.linalg.vector_norm(torch.stack(norms), 2.0))) if norms else True
            if self.shared is not None:  # every process stops, or none
                finite = self.shared.all_true(finite)
            if not finite:
                raise nonfinite(plan, name)
        # bf16 gradients the update does not read as they are: widened chunk by chunk (_update_compact)
        widen = [
            g.dtype != torch.float32 and (plan.clip_value is not None or not self.optimizer.reads_bf16_grads(p))
            for p, g in zip(params, grads)
        ]
        groups: dict[int, list[int]] = {}
        for i, p in enumerate(params):
            groups.setdefault(self.optimizer.group_index(p), []).append(i)
        for g, idx in groups.items():
            hypers = plan.hypers[g]
            for i in idx:
                self.optimizer.begin(params[i], hypers)
            together = [i for i in idx if not widen[i]]
            if together:
                given = [grads[i] for i in together]
                if plan.clip_value is not None:
                    torch._foreach_clamp_min_(given, -plan.clip_value)
                    torch._foreach_clamp_max_(given, plan.clip_value)
                self.optimizer.update([params[i] for i in together], given, hypers, rows=[rows[i] for i in together],
                                      grad_scale=plan.grad_scale,
                                      copies=[copies.get(params[i]) for i in together])  # fmt: skip
            for i in idx:
                if widen[i]:
                    self._update_compact(params[i], grads[i], hypers, plan, copies.get(params[i]))
            for i in idx:
                self.optimizer.end(params[i])
        plan.applied.append(name)

    def _update_compact(
        self, param: nn.Parameter, grad: Tensor, hypers: Hypers, plan: StepPlan, copy: Tensor | None
    ) -> None:
        # a bf16 retained gradient, widened to fp32 a chunk at a time (clipped by value there)
        if self._widening is None:
            self._widening = torch.empty(self.transfer.chunk_numel, dtype=torch.float32)
        for cut, shape, _ in self.chunks(param):
            chunk = self._widening[: math.prod(shape)].view(shape)
            chunk.copy_(rows_of(grad, cut))
            if plan.clip_value is not None:
                chunk.clamp_(-plan.clip_value, plan.clip_value)
            copies = [rows_of(copy, cut) if copy is not None else None]
            self.optimizer.update([param], [chunk], hypers, rows=[cut], grad_scale=plan.grad_scale, copies=copies)
