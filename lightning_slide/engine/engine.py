"""The sliding-window engine: places a model's parameters, streams them through the device, and steps the optimizer
on the CPU while the device keeps computing. It knows nothing of Lightning; the strategy drives it. ARCHITECTURE.md
draws one step and its update schedules ("backward", "forward", "norm-first": each gives exactly the update plain
training gives).

One optimizer step's lifecycle is ``SlideEngine.step`` (``step.py``): it begins where Lightning's optimizer step
begins and ends in the user's optimizer's ``step()``, through a step hook. Pending updates are completed
(:meth:`SlideEngine.wait`) before validation, checkpointing and the end of training.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import replace
from functools import partial
from typing import Literal

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from . import disk_masters, machine
from .activations import ActivationStash, Offloading, saved_bytes
from .config import EngineConfig, check_choices
from .dead_ends import DeadEnds
from .delay import DelayedBlocks, check_delayed, copy_bytes
from .embedding import EmbeddingRows
from .functions import head_loss, recomputed, run_block, run_unit
from .grads import GradSender
from .guard import Guard
from .kept_attention import KeptAttention
from .nvme import NvmeStateStore, min_block_numel, row_numel
from .optim import CpuOptimizer
from .planner import HostPlan, check_window, kept_room, plan_host
from .retention import retention
from .rows import Contribution
from .shared_host import SharedHost
from .state_io import StateIO
from .step import Step
from .transfer import Transfer, landing_buffer_count
from .units import Unit, collect_units, in_forward_order, move_except_parameters, replace_forward
from .updates import StepPlan, Updates
from .window import Window, window_bytes
from .worker import CpuWorker
from .world import DataParallel

log = logging.getLogger(__name__)

Schedule = Literal["backward", "forward", "norm-first"]


class SlideEngine:
    """Streams a model's blocks through a window of device slots and runs the optimizer on the CPU.

    Args:
        model: the module whose parameters the engine manages (fp32 masters, on the CPU).
        blocks: the stack of transformer blocks, in order.
        device: the compute device (CUDA, or the CPU itself).
        compute_dtype: dtype of weight matrices on the device (``torch.bfloat16`` or ``torch.float32``).
        embedding: the input embedding, streamed by rows (``None``: it is a leftover like any other).
        head: the output head, kept in a buffer of its own (``None``: a leftover).
        whole: modules streamed as one unit with their submodules (their forward reads their children's parameters).
        optimizer: the user's optimizer (``None`` for evaluation only).
        schedule: ``"backward"``, ``"forward"`` or ``"norm-first"`` (ARCHITECTURE.md).
        retain_grads: keep whole gradients on the host across micro-batches (accumulation).
        num_slots: ring slots for blocks on the device (>= 2).
        on_nonfinite: ``"raise"`` or, with clipping by norm, ``"skip"`` the step.
        cpu_threads: intra-op threads of the CPU worker (``None``: torch's default).
        offload_activations: the blocks' saved inputs in host memory between forward and backward: ``True``: every
            block's; ``"auto"``: as few as let the rest fit, decided at the first training forward (``activations.py``).
        nvme_path: Adam's moments in files of a private directory made there (``nvme.py``) instead of in RAM.
        state_dtype: Adam's moments of fp32 parameters in fp32 or bf16 (``adam_bf16.py``), in RAM and on NVMe.
        nvme_masters: with ``nvme_path``, the fp32 masters of the blocks' trained matrices there too; the parameters
            hold compute-dtype copies until :meth:`teardown` reads the masters back (``disk_masters.py``).
        hooks_read_grads: user code may read ``param.grad`` between backward and step: "forward" shows the gradients
            there, and the embedding's update is not split.
        compact_grads: keep retained gradients in bf16 where they can be (``retention.py``).
        config: the mechanism's knobs (``config.py``).
        resident: modules kept whole on the device (the GPU tier), out of every unit; the user's optimizer steps them
            there (``step.py``); blocks among them recompute in backward.
        world: the processes of a data-parallel run (``world.py``): gradients averaged over them.
        shared: the node's processes hold the masters, the optimizer state and the retained gradients once, each
            updating its rows (``shared_host.py``).
        defer_blocks: schedule "backward": the first blocks updated during the next forward, not as their backward ends.
        delay_blocks, delay_warmup: the first blocks updated a step late, after that many exact steps (``delay.py``).
    """

    def __init__(
        self,
        model: nn.Module,
        blocks: list[tuple[str, nn.Module]],
        device: torch.device,
        *,
        compute_dtype: torch.dtype,
        embedding: tuple[str, nn.Embedding] | None = None,
        head: tuple[str, nn.Linear] | None = None,
        whole: list[tuple[str, nn.Module]] = (),
        optimizer: Optimizer | None = None,
        schedule: Schedule = "backward",
        retain_grads: bool = False,
        num_slots: int = 3,
        on_nonfinite: Literal["raise", "skip"] = "raise",
        cpu_threads: int | None = None,
        offload_activations: bool | Literal["auto"] = False,
        nvme_path: str | None = None,
        state_dtype: torch.dtype = torch.float32,
        nvme_masters: bool = False,
        hooks_read_grads: bool = True,
        compact_grads: bool = False,
        config: EngineConfig | None = None,
        resident: list[tuple[str, nn.Module]] = (),
        world: DataParallel | None = None,
        shared: SharedHost | None = None,
        defer_blocks: int = 0,
        delay_blocks: int = 0,
        delay_warmup: int = 1,
    ) -> None:
        check_choices(num_slots=num_slots, on_nonfinite=on_nonfinite, schedule=schedule, resident=bool(resident),
                      defer_blocks=defer_blocks, delay_blocks=delay_blocks, several=world is not None)  # fmt: skip
        self.config = config = config or EngineConfig()
        self.world = world
        self.shared = shared
        self.model, self.device, self.compute_dtype = model, device, compute_dtype
        self.schedule: Schedule = schedule
        self.on_nonfinite = on_nonfinite
        self.num_slots = num_slots
        # the resident modules live on the device, out of every unit; torch's optimizer steps them there
        self.resident_named = list(resident)
        self.resident = [m for _, m in resident]
        self.resident_params = list(dict.fromkeys(p for m in self.resident for p in m.parameters()))
        kept = {m for r in self.resident for m in r.modules()}
        self.resident_blocks = [m for _, m in blocks if m in kept]
        self.embedding, self.blocks, self.head, self.leftovers = collect_units(
            model, blocks, compute_dtype, embedding, head, whole, self.resident
        )
        # parameters more than one unit computes with (tied embeddings)
        self._shared = {p for u in self.units for p, o in zip(u.params, u.owner) if o is not u}
        self.optimizer = CpuOptimizer(optimizer, state_dtype) if optimizer is not None else None
        if nvme_path is not None and self.optimizer is not None and self.optimizer.is_sgd:
            raise ValueError(
                "optimizer_offload='nvme' holds Adam/AdamW moments; train SGD with optimizer_offload='cpu'."
            )
        self.nvme_path = nvme_path if self.optimizer is not None else None
        if self.optimizer is not None:
            self.optimizer.check_params({p for u in self.units for p in u.params} | set(self.resident_params))
        self.disk_masters = (
            disk_masters.choose(self.blocks, self.streamed_trainable(), compute_dtype)
            if nvme_masters and self.nvme_path is not None else []
        )  # fmt: skip
        self.state_io = StateIO(model, self.optimizer, self.disk_masters, shared if nvme_path is not None else None)
        self.chunk_numel = max(config.chunk_numel, *(row_numel(p) for u in self.units for p in u.params))
        if self.nvme_path is not None:  # a chunk holds at least one of the store's row blocks (whole pages)
            self.chunk_numel = max(self.chunk_numel, *(min_block_numel(p) for u in self.units for p in u.params))
        grad_numel = sum(p.numel() for u in self.units for p in u.params if p.requires_grad)
        self._landing_buffers = landing_buffer_count(
            config, grad_numel, self.chunk_numel, nvme=nvme_path is not None,
            retained=schedule == "forward" and not retain_grads,
        )  # fmt: skip
        self._cpu_threads = cpu_threads
        if not 0 <= defer_blocks <= len(self.blocks):
            raise ValueError(
                f"EngineConfig(deferred_updates={defer_blocks}) asks to defer more blocks than the {len(self.blocks)}"
                " the engine streams; give a number from 0 to that."
            )
        self.delayed = check_delayed(self.blocks, delay_blocks, bool(self.disk_masters)) if optimizer else []
        self._delay_warmup = delay_warmup
        if schedule == "backward":  # their gradients wait on the host for the step's end
            defer_blocks = max(defer_blocks, len(self.delayed))
        self.deferred = self.blocks[:defer_blocks] if self.optimizer is not None else []
        self._retain = retain_grads or schedule == "forward" or bool(self.deferred)
        self._accumulates = retain_grads
        self.hooks_read_grads = hooks_read_grads
        self.retention = retention(
            self.units, self.deferred, self.delayed, self.streamed_trainable() if self.optimizer is not None else set(),
            schedule=schedule, accumulates=retain_grads, compute_dtype=compute_dtype, shared=self._shared,
            allowed=compact_grads and self.optimizer is not None and not hooks_read_grads and self.nvme_path is None
            and shared is None,
        )  # fmt: skip
        self.offload = Offloading(offload_activations, len(self.blocks))  # the block inputs kept in RAM
        self.activations: ActivationStash | None = None  # its stash, from setup
        self.rows: EmbeddingRows | None = None
        self.delay: DelayedBlocks | None = None  # the delayed blocks' copies, from setup
        self._unpatch: list = []  # what puts the modules' own forwards back
        self.dummy = torch.empty(0, requires_grad=True)  # makes a unit's node run backward when only weights need it
        self.step: Step | None = None  # the optimizer step's lifecycle (training only; step.py)
        self.guard: Guard | None = None  # what crosses the managed modules' boundaries (training only; guard.py)
        self.dead_ends = DeadEnds(self.config.skip_dead_ends)  # the products the recompute leaves out (dead_ends.py)
        self.kept_attention = KeptAttention(self.config.keep_attention, self.blocks)  # (kept_attention.py)
        self._room_decided = False  # the first training forward decides offloading and the kept attention's room
        self._ready = False

    # ---- what the run needs, before setup --------------------------------------------------------------------

    @property
    def units(self) -> list[Unit]:
        return [u for u in (self.embedding, *self.blocks, self.head) if u is not None] + self.leftovers

    def shared_params(self) -> set[nn.Parameter]:
        """Parameters that more than one unit computes with (tied embeddings)."""
        return self._shared

    def mapped_params(self) -> set[nn.Parameter]:
        """The parameters whose values :meth:`setup` maps from the memory the node's processes share (none without
        ``shared``): each unit's own."""
        if self.shared is None:
            return set()
        return {p for u in self.units for p in u.owned()}

    def _forward_units(self) -> list[Unit]:
        return in_forward_order(self.embedding, self.blocks, self.head, self.leftovers)

    def _own_buffer_units(self) -> list[Unit]:
        # the units with a device buffer of their own, outside the blocks' ring: the head and the leftovers
        return [u for u in [self.head, *self.leftovers] if u is not None]

    def streamed_trainable(self) -> set[nn.Parameter]:
        """The streamed parameters the optimizer updates (frozen ones in it have no state)."""
        trainable = {p for g in self.optimizer.optimizer.param_groups for p in g["params"] if p.requires_grad}
        return trainable - set(self.resident_params)

    def device_bytes(self, num_slots: int | None = None) -> int:
        """Device memory the engine allocates for weights and staging (activations not included), with its window
        or one of ``num_slots``."""
        return window_bytes(self.blocks, self._own_buffer_units(), num_slots or self.num_slots, self.chunk_numel)

    def host_plan(self, stored_sizes: dict[nn.Parameter, int] | None = None, activations: int = 0) -> HostPlan:
        """What :meth:`setup` and training will add to host memory (``planner.plan_host``): ``stored_sizes``, the
        element sizes parameters will be stored with where they differ from now; ``activations``, host bytes of the
        block inputs that will be offloaded."""
        owned = [u.owned() for u in self.units]
        landing = self._landing_buffers * self.chunk_numel * 4 if self.optimizer is not None else 0
        copy_size = torch.empty((), dtype=self.compute_dtype).element_size()
        return plan_host(
            owned,
            self.optimizer.optimizer if self.optimizer is not None else None,
            retained=self.retention.held(),
            compact_grads=self.retention.compact,
            landing_bytes=landing,
            pinned=self.device.type == "cuda",
            frozen_bytes_per_element={**(stored_sizes or {}), **dict.fromkeys(self.disk_masters, copy_size)},
            state_block_numel=self.chunk_numel if self.nvme_path is not None else None,
            state_itemsize=self.optimizer.state_dtype.itemsize if self.optimizer is not None else 4,
            read_ahead_bytes=self.config.nvme_read_ahead_bytes,
            disk_masters=self.disk_masters,
            activations=activations,
            share=self.shared.size if self.shared is not None else 1,
            delayed_weights=copy_bytes(self.delayed, self.streamed_trainable() if self.delayed else set()),
        )

    def _split_allowed(self) -> bool:
        # the embedding's two-part update (embedding.py) is exact for an embedding in RAM that nothing else uses, one
        # backward pass per step, one process (each process touches other rows); with "forward", not where hooks read
        # `param.grad` (its gradient is then not one), nor with on_nonfinite="skip" (a skipped step must not have
        # updated the untouched rows)
        if self.world is not None or self._accumulates or self.schedule not in ("backward", "forward"):
            return False
        if self.schedule == "forward" and (self.on_nonfinite != "raise" or self.hooks_read_grads):
            return False
        table = self.embedding.params[0]
        in_ram = self.optimizer.store is None and table.dtype == torch.float32
        return in_ram and self.wants_grad(self.embedding, 0) and table not in self._shared

    # ---- set-up and teardown ---------------------------------------------------------------------------------

    def setup(self, loaded_masters: dict[nn.Parameter, Tensor] | None = None) -> None:
        """Pin the masters, allocate the window, and route the modules' forwards through the engine.

        Args:
            loaded_masters: fp32 values (from a checkpoint) for masters that go to disk, where the parameter itself
                holds fewer bits (a model loaded in bf16).
        """
        # within the process's memory fraction
        check_window(self.device_bytes(), machine.device_budget(self.device), self.num_slots, self.device)
        training = self.optimizer is not None
        landing = self._landing_buffers if training else 0
        self.transfer = Transfer(self.device, chunk_numel=self.chunk_numel, landing_buffers=landing,
                                 register_min_bytes=self.config.register_min_bytes)  # fmt: skip
        self.worker = CpuWorker(num_threads=self._cpu_threads)
        self.updates = self.sender = None
        if training:
            self.updates = Updates(self.transfer, self.worker, self.optimizer, retain=self._retain,
                                   compact=self.retention.compact)  # fmt: skip
            self.sender = GradSender(self.transfer, self.worker, self.updates,
                                     max_queued_bytes=self.config.max_queued_grad_bytes)  # fmt: skip
        self._ready = True  # from here on, teardown releases what setup made, also if setup fails below
        if self.nvme_path is not None:
            trainable = self.streamed_trainable()
            units = [(u.name, [p for p in u.owned() if p in trainable]) for u in self.units]
            store = self.optimizer.store = NvmeStateStore(
                self.nvme_path, [(n, ps) for n, ps in units if ps], self.optimizer.state_keys(),
                state_dtype=self.optimizer.state_dtype, masters=frozenset(self.disk_masters),
                chunk_numel=self.chunk_numel, max_ahead_bytes=self.config.nvme_read_ahead_bytes,
                own_rows=self._own_rows(),
            )  # fmt: skip
            disk_masters.to_disk(store, self.disk_masters, loaded_masters or {}, self.shared, self.compute_dtype)
        self.offload.setup(self.transfer, [u.module for u in self.blocks])
        self.activations = self.offload.stash
        move_except_parameters(self.model, self.device)
        for p in self.resident_params:
            p.data = p.data.to(self.device)
        if self.shared is not None:
            self._share()
        elif self.transfer.is_cuda:
            for unit in self.units:
                self.transfer.pin(unit.owned())
        self.delay = None
        if self.delayed:
            self.delay = DelayedBlocks(self.delayed, self.transfer, self.worker, self._delay_warmup,
                                       self.streamed_trainable(), self.retention.in_copies)  # fmt: skip
            self.updates.lend(self.delay.grad_buffers())
        self.window = Window(self.blocks, self._own_buffer_units(), self.transfer, self.num_slots, self.delay)
        self.state_io.delay = delay = self.delay
        if self.embedding is not None:
            self.rows = EmbeddingRows(
                self.embedding, window=self.window, transfer=self.transfer,
                # its touched rows' update, deferred, would queue behind the deferred blocks' that its forward precedes
                config=replace(self.config, defer_touched_rows=False) if self.deferred else self.config,
                schedule=self.schedule, split_allowed=training and self._split_allowed(),
                after_backward=self.after_backward, dummy=self.dummy, worker=self.worker, optimizer=self.optimizer,
                updates=self.updates, sender=self.sender,
            )  # fmt: skip
        if training:
            names = {p: name for name, p in self.model.named_parameters()}
            self.guard = Guard(names, self.streamed_trainable(), set(self.resident_params))
            self.step = Step(
                schedule=self.schedule, on_nonfinite=self.on_nonfinite, optimizer=self.optimizer, updates=self.updates,
                sender=self.sender, worker=self.worker, window=self.window, rows=self.rows,
                activations=self.activations, forward_units=self._forward_units(), names=names, guard=self.guard,
                resident=self.resident_params, world=self.world, deferred=self.deferred, delay=delay,
            )  # fmt: skip
        self._patch()

    def _share(self) -> None:
        # the masters, then the optimizer state and the retained gradients, once for the node's processes
        owned = [u.owned() for u in self.units]
        self.shared.hold_masters(owned, self.transfer.pin)
        if self.optimizer is None:
            return
        trainable = self.streamed_trainable()
        self.optimizer.own_rows = self._own_rows()
        keys = self.optimizer.state_keys() if self.optimizer.store is None else ()  # else in each process's files
        params = [p for group in owned for p in group if p in trainable]
        self.shared.hold_state(self.optimizer.shared_state, params, keys, self.optimizer.state_dtype_of)
        self.updates.share(self.shared, self.retention.units)

    def _own_rows(self) -> dict[nn.Parameter, slice | None]:
        # the rows of each unit's own parameters this process updates (all of them without `shared`)
        if self.shared is None:
            return {}
        return {p: self.shared.rows(p) for u in self.units for p in u.owned()}

    def _patch(self) -> None:
        patch = self._unpatch.append
        for module in self.resident_blocks:
            patch(replace_forward(module, partial(recomputed, module.forward)))
        for unit in self.blocks:
            patch(replace_forward(unit.module, partial(run_block, self, unit)))
        if self.embedding is not None:
            patch(replace_forward(self.embedding.module, self._embedding_forward))
        for unit in self._own_buffer_units():
            patch(replace_forward(unit.module, partial(self._unit_forward, unit)))

    def teardown(self) -> None:
        """Finish pending work, restore the modules' own forwards and move non-parameter state back."""
        if not self._ready:
            return
        self._ready = False
        try:
            self.wait()
        finally:
            while self._unpatch:
                self._unpatch.pop()()
            self.offload.restore_mlps()
            if self.sender is not None:
                self.sender.close()
            self.worker.shutdown()
            self.transfer.close()  # first: each unit's pinned copies are freed as its masters come back below
            # what only training needs leaves the host before the resident units' weights come to it (below) and,
            # in Lightning's teardown, their optimizer state: the host's peak after fit is not training's plus theirs
            for part in (self.updates, self.activations, self.rows, self.delay):
                if part is not None:
                    part.release()
            if self.optimizer is not None and self.optimizer.store is not None:
                try:
                    disk_masters.from_disk(self.optimizer.store, self.disk_masters, self.shared)
                finally:
                    self.optimizer.store.close()
                    self.optimizer.store = None
            move_except_parameters(self.model, torch.device("cpu"))
            for p in self.resident_params:
                p.data = p.data.cpu()
                p.grad = None
            self.window = None

    # ---- the forwards of managed modules (functions.UnitHost) -------------------------------------------------

    def acquire(self, unit: Unit, training: bool = False) -> list[Tensor]:
        return self.window.acquire(unit, training)

    def release(self, unit: Unit, *, forward: bool) -> None:
        self.window.release(unit, forward=forward)

    def wants_grad(self, unit: Unit, index: int) -> bool:
        """Whether ``unit.params[index]`` needs a gradient (trainable and in the optimizer)."""
        if self.optimizer is None or not unit.trainable[index]:
            return False
        return self.optimizer.group_index(unit.params[index]) is not None

    def _unit_forward(self, unit: Unit, *args, **kwargs):
        return run_unit(self, unit, args, kwargs)

    def _embedding_forward(self, ids: Tensor) -> Tensor:
        return self.rows.forward(ids, train=torch.is_grad_enabled() and self.wants_grad(self.embedding, 0))

    def head_loss(self, hidden: Tensor, target: Tensor, loss_fn, **kwargs) -> Tensor:
        """``loss_fn(hidden, weight, target, bias=..., **kwargs)`` with the head's weights on the device
        (``functions.head_loss``)."""
        return head_loss(self, self.head, hidden, target, loss_fn, self._head_grad, **kwargs)

    def _head_grad(self, index: int, grad: Tensor) -> None:
        self.window.buffer(self.head).free = self.transfer.record()  # the backward has read the weights
        self.after_backward(self.head, {index: grad})

    def after_backward(self, unit: Unit, grads: dict[int, Contribution]) -> None:
        """``unit``'s backward produced these gradients (by parameter index): on their way (``Step``)."""
        if self.step is not None and grads:
            averaged = None
            if self.world is not None:  # started here, waited for on the way (world.py)
                own = self.optimizer.own_rows  # the rows a node's processes share out
                split = {i for i in grads if unit.params[i] in own and unit.params[i].dim()}
                grads, averaged = self.world.average(grads, unit.name, split)
            self.step.after_backward(unit, grads, averaged)

    def offloads(self, unit: Unit, inputs: tuple[Tensor, ...]) -> bool:
        """Whether ``unit`` keeps its saved ``inputs`` in host memory (``Offloading``). Called before the block runs;
        the first call decides, and sets the room the blocks' kept attention outputs take (``kept_attention.py``)."""
        offload = self.offload
        if unit not in self.window.index:
            return False
        if not self._room_decided:
            self._room_decided = True
            rows = self.rows.device_bytes(self.step.plan) if self.rows is not None and self.step is not None else 0
            budget, reserved = machine.device_budget(self.device), self.config.max_queued_grad_bytes + rows
            if offload.stash is not None:
                offload.decide(
                    inputs, budget=budget, reserved=reserved, before_offload=self._fewer_landing_buffers,
                    host_room=lambda: machine.available_host_bytes() - self._host_to_come(),
                )  # fmt: skip
            on_device = len(self.blocks) - offload.blocks  # (0 offloaded without a stash)
            room, kept = kept_room(saved_bytes(inputs), on_device, budget, reserved), self.kept_attention
            kept.room = room if room is None or kept.planned_room is None else min(room, kept.planned_room)
        return self.window.index[unit] < offload.blocks

    def _fewer_landing_buffers(self) -> None:
        # Steps long enough to need offloading keep the GPU busy far longer than the CPU optimizer: gradients
        # seldom wait for it, and the host memory is better left to the offloaded inputs.
        if self.optimizer is not None:
            self._landing_buffers = min(self._landing_buffers, self.config.offload_landing_buffers)
            self.transfer.drop_landing(self._landing_buffers)

    def _host_to_come(self) -> int:
        # host bytes of the plan not allocated yet: the optimizer state and retained gradients appear at the first step
        if self.optimizer is None:
            return 0
        plan = self.host_plan()
        state = plan.optimizer_state if not self.optimizer.optimizer.state else 0
        allocated = any(p not in self.updates.lent for p in self.updates.host)  # (lent: the delayed blocks' copies)
        return state + (plan.retained_grads if not allocated else 0)

    def partial_step(self) -> StepPlan | None:
        """After a fault: the step whose updates were applied in part (the model then mixes two steps), once the
        worker has stopped; ``None`` when each step is applied whole or not at all."""
        with contextlib.suppress(BaseException):  # the fault itself: what matters here is what ran before it
            self.worker.drain()
        updates = self.updates
        return next((plan for plan in updates.recent if plan.partial), None) if updates is not None else None

    def wait(self) -> None:
        """Complete every pending update (before validation, checkpoints, and the end of training)."""
        if not self._ready:
            return
        if self.optimizer is not None:
            self.sender.drain()
            if self.rows is not None:
                self.rows.apply_deferred(None)
        self.worker.drain()
        if self.rows is not None:
            self.rows.row_copy = None  # the host holds it
