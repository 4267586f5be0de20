"""One optimizer step, from its start to its last update queued: the ``Step`` object owns it.

    SlideFormerPrecision.optimizer_step      (Lightning calls it once per optimizer step)
      Step.begin                  the hyperparameters in force are frozen into a StepPlan
      closure                     training_step, then Step.backward per micro-batch (the embedding's bulk update
                                  starts; "norm-first" runs its measuring pass first); gradients leave block by block
                                  (Step.after_backward)
      Step.grads_ready            ("forward": every gradient is on the host, shown as param.grad)
      hooks, Step.clip            (the global norm sets the clipping coefficient)
      Step.grads_taken            (param.grad hidden again: the optimizer's own update finds none; with bf16
                                  moments, the parameters kept on the device are updated here, on the device)
      user's optimizer.step()     its post-hook, Step.finish: "forward" queues the updates in forward order (and
                                  "backward" those of its deferred blocks); with delayed blocks, their copies are
                                  taken first and their updates queued last (``delay.py``)

The schedules themselves are described in ``engine.py``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from functools import partial
from typing import Literal

import torch
from torch import nn

from .activations import ActivationStash
from .delay import DelayedBlocks
from .embedding import EmbeddingRows
from .grads import GradSender
from .guard import Guard
from .optim import CpuOptimizer
from .rows import Contribution, RowSplit
from .units import Unit
from .updates import StepPlan, Updates, nonfinite
from .window import Window
from .worker import CpuWorker
from .world import DataParallel

log = logging.getLogger(__name__)


class Step:
    """The optimizer step of a training run (module docstring).

    Args:
        schedule: the update schedule (``engine.py``).
        on_nonfinite: ``"raise"`` or ``"skip"`` a step whose global norm is not finite.
        optimizer, updates, sender, worker, window: the engine's parts.
        rows: the embedding's rows (``None``: no streamed embedding).
        activations: the stash of offloaded block inputs (``None``: none offloaded).
        forward_units: every unit in forward order (the update order of units no training forward met).
        names: the parameters' names, for messages.
        guard: the boundary guard, checking the first training backward (``guard.py``).
        resident: the parameters kept on the device.
        world: the processes of a data-parallel run (``world.py``); ``None``: one.
        deferred: schedule "backward": the blocks updated when the step ends, not as their backward ends.
        delay: the blocks whose update is one step late (``delay.py``); ``None``: none.
    """

    def __init__(
        self,
        *,
        schedule: Literal["backward", "forward", "norm-first"],
        on_nonfinite: Literal["raise", "skip"],
        optimizer: CpuOptimizer,
        updates: Updates,
        sender: GradSender,
        worker: CpuWorker,
        window: Window,
        rows: EmbeddingRows | None,
        activations: ActivationStash | None,
        forward_units: list[Unit],
        names: dict[nn.Parameter, str],
        guard: Guard,
        resident: list[nn.Parameter] = (),
        world: DataParallel | None = None,
        deferred: list[Unit] = (),
        delay: DelayedBlocks | None = None,
    ) -> None:
        self.schedule, self.on_nonfinite = schedule, on_nonfinite
        self.delay = delay
        self.deferred = set(deferred)
        # on the device: autograd leaves their gradients; the user's optimizer steps them (bf16 moments: this class)
        self.resident = resident
        self._resident_set = set(resident)
        self._engine_stepped: dict[int, list[nn.Parameter]] = {}  # bf16 moments: the fp32 ones, by param group
        if optimizer.state_dtype == torch.bfloat16:
            for p in resident:
                if p.dtype == torch.float32 and (g := optimizer.group_index(p)) is not None:
                    self._engine_stepped.setdefault(g, []).append(p)
        self.world = world  # several processes: the streamed units' gradients arrive averaged, the resident ones here
        self.optimizer, self.updates, self.sender, self.worker = optimizer, updates, sender, worker
        self.window, self.rows, self.activations = window, rows, activations
        self._forward_units = forward_units
        self._names = names
        self.guard = guard
        self.plan: StepPlan | None = None  # set from begin to finish
        self._measuring = False  # "norm-first": the backward pass running sums squares only
        self._norm_first_max = 0.0  # "norm-first": the max norm the step was clipped at
        self._shown: dict[nn.Parameter, int] = {}  # "forward": gradients shown as param.grad, at their version

    def attach(self) -> Callable[[], None]:
        """Hook the user's optimizer: its ``step()`` ends this step (LR schedulers see a real step). Returns a
        function that removes the hook."""
        return self.optimizer.optimizer.register_step_post_hook(lambda *_: self.finish()).remove

    def begin(self, step: int) -> None:
        """The step begins: the hyperparameters in force now are the ones applied."""
        if self.activations is not None:
            self.activations.reset()
        self.worker.raise_if_failed()
        self.plan = StepPlan(step=step, hypers=self.optimizer.snapshot())
        if self.rows is not None:
            self.rows.begin_step()

    def after_backward(
        self, unit: Unit, grads: dict[int, Contribution], averaged: Callable[[], None] | None = None
    ) -> None:
        """``unit``'s backward produced these gradients (by parameter index): on their way. ``averaged``: waits until
        they hold the mean over the processes (``DataParallel.average``)."""
        if self.rows is not None and unit is self.rows.unit:
            self.rows.received()
        if self._measuring:
            if averaged is not None:
                averaged()
            self.sender.measure(unit, grads)
            return
        start = time.perf_counter()
        streams = self.schedule != "forward" and unit not in self.deferred
        self.sender.push(unit, grads, self.plan if streams else None, averaged)
        self.window.stats.wait_send_s += time.perf_counter() - start

    def backward(self, loss: torch.Tensor, run: Callable[..., None], max_norm: float | None = None) -> None:
        """Run a micro-batch's backward pass from ``loss``: ``run(**kwargs)`` (``LightningModule.backward``). The
        guard checks the first one before anything updates.

        Where exact, the embedding's rows the step did not touch are updated as it starts (``embedding.py``). With
        "norm-first", a first pass over the retained graph only sums the gradients' squares; the clipping at
        ``max_norm`` follows, and the second pass streams the clipped updates (skipped for a non-finite norm with
        ``on_nonfinite="skip"``).
        """
        if self.guard.probing:
            self.guard.check_loss(loss)
        if self.rows is not None and self.plan is not None:
            self.rows.start(self.plan)
        if self.schedule == "norm-first" and self.plan is not None:
            self._measuring = True
            if self.activations is not None:
                self.activations.keep = True
            run(retain_graph=True)
            self._measuring = False
            if self.activations is not None:
                self.activations.keep = False
            self.sender.flush_measure()
            self._norm_first_max = max_norm
            self._clip_by(self.updates.global_norm(self._update_order_params()), max_norm)
            if self.plan.skip:
                return
        run()

    def grads_ready(self) -> None:
        """The step's backward is done. With the "forward" schedule, wait until every gradient is on the host and
        show them as ``param.grad`` (hooks and clipping read them there), but for a split embedding's."""
        if self.rows is not None:
            self.rows.check_received()
        if self.world is not None and (grads := self._resident_grads()):
            self.world.average_in_place(grads, "the modules kept on the device")
        self.sender.flush(self.plan if self.schedule != "forward" else None)
        if self.schedule != "forward":
            return
        self.sender.drain()
        self.worker.drain()
        if self.updates.shared is not None:  # the other processes' rows of the shared gradients have landed too
            self.updates.shared.main_barrier()
        split = self.rows.split if self.rows is not None else None
        for p in self.updates.pending:
            if split is not None and p is split.param:  # its touched rows only, in a buffer of their own
                continue
            if p in self.updates.compact:  # bf16, and no hook reads it
                continue
            if p.dtype == torch.float32 or getattr(p, "grad_dtype", p.dtype) is None:  # see SlideEngine.setup
                p.grad = self.updates.host[p]
                self._shown[p] = p.grad._version

    def grads_taken(self) -> None:
        """Hooks and clipping are done with ``param.grad``: hidden again, so the optimizer's own update finds none
        (the engine applies it). A gradient left on a master is one autograd put there itself: refused."""
        if self.schedule == "forward":  # the only schedule that shows them
            changed = [p for p, version in self._shown.items() if p.grad is not None and p.grad._version != version]
            self._shown.clear()
            if changed and self.updates.shared is not None:
                raise RuntimeError(
                    f"A hook changed the gradient of {self._names.get(changed[0], 'a parameter')!r} in place between"
                    " backward and the optimizer step. With several processes on a node, SlideFormer holds each"
                    " gradient once for all of them, so every process changed the same memory. Read the gradients"
                    " there, but change them in the LightningModule (e.g. scale the loss), or train with one process"
                    " per node."
                )
            for p in self.updates.pending:
                p.grad = None
        self._check_resident()
        self._update_resident()
        stray = [p for g in self.optimizer.optimizer.param_groups for p in g["params"]
                 if p.grad is not None and p not in self._resident_set]  # fmt: skip
        if stray:
            names = [self._names.get(p, f"a tensor of shape {tuple(p.shape)}") for p in stray]
            raise RuntimeError(
                f"SlideFormer cannot train {', '.join(repr(n) for n in names[:3])}"
                f"{f' and {len(names) - 3} more' if len(names) > 3 else ''}: each was used outside the forward of the"
                " module that holds it (a layer reading another layer's weight, say), so the engine took no"
                " gradient of it, and an update would escape the step's clipping. Freeze it (requires_grad=False) or"
                " leave it out of the optimizer."
            )

    def clip(self, value: float, algorithm: Literal["norm", "value"]) -> float | None:
        """Clip this step's gradients, exactly as ``torch.nn.utils.clip_grad_norm_`` (returns the global norm) or
        ``clip_grad_value_``."""
        if not (self.schedule == "forward" or (self.schedule == "norm-first" and algorithm == "norm")):
            raise RuntimeError(
                f"Gradient clipping by {algorithm} was requested, but the 'backward' update schedule has already"
                " applied the updates. Use SlideFormerStrategy(update_schedule='forward') (chosen automatically when"
                " Trainer(gradient_clip_val=...) is set)."
            )
        if algorithm == "value":
            self.plan.clip_value = float(value)
            if grads := self._resident_grads():
                torch._foreach_clamp_min_(grads, -value)
                torch._foreach_clamp_max_(grads, value)
            return None
        if self.schedule == "norm-first":  # applied already, by the second backward pass
            if value != self._norm_first_max:
                raise RuntimeError(
                    f"update_schedule='norm-first' clipped this step at {self._norm_first_max} (Trainer's"
                    f" gradient_clip_val when the backward ran), but clipping was asked at {value}. Change the"
                    " clipping value through Trainer(gradient_clip_val=...) only, or use update_schedule='forward'."
                )
            return self.plan.norm
        streamed = self.updates.global_norm(self._update_order_params())
        grads = self._resident_grads()
        on_device = torch.stack(torch._foreach_norm(grads, 2.0)).double().square().sum().item() if grads else 0.0
        return self._clip_by(math.sqrt(streamed**2 + on_device), value)

    def _clip_by(self, total: float, max_norm: float) -> float:
        plan = self.plan
        if not math.isfinite(total) and self.on_nonfinite == "skip":
            log.warning("Skipping optimizer step %d: the gradient norm is %s.", plan.step, total)
        self.updates.clip_by_norm(plan, total, max_norm, skip_nonfinite=self.on_nonfinite == "skip")
        plan.norm = total
        if plan.grad_scale is not None and (grads := self._resident_grads()):
            torch._foreach_mul_(grads, max_norm / (total + 1e-6))  # as clip_grad_norm_ scales them
        return total

    def _resident_grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.resident if p.grad is not None]

    def _check_resident(self) -> None:
        # the resident gradients the optimizer is about to apply: none in a skipped step, none non-finite
        grads = self._resident_grads()
        if not grads:
            return
        if self.plan.skip:
            for p in self.resident:
                p.grad = None
        elif not self.plan.norm_checked and not torch.stack(torch._foreach_norm(grads, 2.0)).isfinite().all().item():
            bad = next(p for p in self.resident if p.grad is not None and not torch.isfinite(p.grad).all())
            with contextlib.suppress(BaseException):  # the updates in flight: what the error names is complete
                self.worker.drain()
            raise nonfinite(self.plan, self._names.get(bad, "a parameter"))

    def _update_resident(self) -> None:
        # bf16 moments for the fp32 parameters kept on the device too: the host kernel's arithmetic (its Triton twin on
        # a GPU), after clipping; the user's optimizer then finds no gradient of theirs
        for g, kept in self._engine_stepped.items():
            params = [p for p in kept if p.grad is not None]
            if not params:
                continue
            hypers = self.plan.hypers[g]
            for p in params:
                self.optimizer.begin(p, hypers)
            self.optimizer.update(params, [p.grad for p in params], hypers)
            for p in params:
                self.optimizer.end(p)
                p.grad = None

    def _update_order_params(self) -> list[nn.Parameter]:
        return [p for u in self._update_order() for p in u.owned()]

    def _update_order(self) -> list[Unit]:
        order = self.window.order
        return list(order) + [u for u in self._forward_units if u not in order]

    def finish(self) -> None:
        """The step ends: with the "forward" schedule, its updates are queued in forward order. Delayed blocks: their
        copies swap first and their updates, which write the next ones, are queued last, after the embedding's
        write-back too, the last block's first (its next gradient arrives first); the delay starts once the warmup's
        last update is queued."""
        plan, self.plan = self.plan, None
        # NOTE: with the "backward" schedule the sender queues each unit's update; the next forward must see them
        # all queued before it waits on them.
        self.sender.drain()
        delay = self.delay
        order, late = self._update_order(), []
        if delay is not None and delay.filled:
            delay.swap()
            self.updates.lend(delay.grad_buffers())  # the next gradients land in the new live copies
            blocks = set(delay.blocks)
            late = [u for u in reversed(order) if u in blocks]
            order = [u for u in order if u not in blocks]
        split = self.rows.split if self.rows is not None else None
        if plan.skip:
            self.updates.discard()
        elif self.schedule == "forward" and split is not None:
            self.rows.prepare_update()
        self._queue_updates(plan, order, split)
        # NOTE: the embedding's write-back (sender thread) waits for landing buffers that only its own worker tasks
        # give back, and the next backward's start waits for it: the sender queues the delayed updates after it
        if self.rows is not None and self.rows.end_step() and late:
            self.sender.put(partial(self._finish_late, plan, late))
        else:
            self._finish_late(plan, late)

    def _queue_updates(self, plan: StepPlan, units: list[Unit], split: RowSplit | None) -> None:
        if plan.skip:
            return
        delay = self.delay if self.delay is not None and self.delay.filled else None
        copies = delay.targets if delay is not None else lambda unit: None  # a delayed block's next weights
        if self.schedule == "forward":
            for unit in units:
                touched = split is not None and unit is self.rows.unit
                run = self.rows.update_touched if touched else None
                self.updates.schedule(unit, plan, check_finite=not plan.norm_checked, run=run, copies=copies(unit))
        elif self.updates.pending:  # the deferred blocks', and those of a unit that skipped the last micro-batch
            for unit in units:
                flagged = unit in self.deferred and self.sender.check_window(unit, plan)  # no CPU pass over them
                self.updates.schedule(unit, plan, check_finite=not flagged, copies=copies(unit))

    def _finish_late(self, plan: StepPlan, late: list[Unit]) -> None:
        # the delayed blocks' updates and the step's bookkeeping (on the sender thread after a write-back)
        self._queue_updates(plan, late, None)
        delay = self.delay
        if late:
            for unit in delay.blocks:
                delay.copy_missed(unit, set() if plan.skip else self.updates.updated)
        elif delay is not None and delay.starts_after(plan.step):
            delay.fill()
        self.sender.window_done()
        plan.finished = True  # every update of the step is queued
        self.updates.updated.clear()
