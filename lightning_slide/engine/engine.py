"""The sliding-window engine: places a model's parameters, streams them through the device, and steps the optimizer
on the CPU while the device keeps computing. It knows nothing of Lightning; the strategy drives it. ARCHITECTURE.md
draws one step.

Update schedules (all give exactly the update plain training gives):

- **"backward"**: nothing needs the global gradient norm. Each parameter's update runs on the CPU worker as soon as
  its last gradient of the step has arrived, while the device continues the backward pass through earlier blocks.
  The next forward of a block waits only for that block's update. With ``defer_blocks``, the first blocks' updates
  wait instead for the end of the step and run while the next forward goes on, as with "forward": the CPU worker,
  idle during a forward otherwise, then overlaps it (their gradients wait on the host, 4 bytes per parameter).
- **"forward"**: gradient clipping. The global norm needs every gradient, so nothing is updated before the backward
  pass ends. Then the updates are queued in forward order (embedding, block 0, 1, ...), each scaled by the clipping
  coefficient, and the next step's forward starts at once: block i's forward waits only for block i's update. The
  step's gradients wait in host memory (4 bytes per parameter; 2 for the matrices computed with in bf16 with
  ``EngineConfig.compact_retained_grads``).
- **"norm-first"**: clipping by norm without that host memory. A first backward pass only sums the gradients' squares
  on the device; the clipping coefficient follows, and a second backward pass over the same graph streams the clipped
  updates as "backward" does. One more backward pass of GPU work.

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
from torch.utils.checkpoint import checkpoint

from . import machine
from .activations import ActivationStash, plan_offload
from .config import EngineConfig
from .embedding import EmbeddingRows
from .functions import run_unit
from .grads import GradSender
from .guard import Guard
from .nvme import MASTER, NvmeStateStore, min_block_numel, row_numel
from .optim import CpuOptimizer
from .planner import HostPlan, check_window, plan_host
from .rows import Contribution
from .shared_host import SharedHost, is_placeholder, placeholder
from .state_io import StateIO
from .step import Step
from .tiling import TiledMLP, gated_mlp
from .transfer import Transfer
from .units import Unit, collect_units, in_forward_order, move_except_parameters, replace_forward
from .updates import StepPlan, Updates
from .window import Window, WindowStats, window_bytes
from .worker import CpuWorker
from .world import DataParallel

log = logging.getLogger(__name__)

Schedule = Literal["backward", "forward", "norm-first"]
# KV-cache arguments must not reach a managed block: the recompute would append to the cache a second time.
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")
_SPARE_LANDING_BUFFERS = 2  # with every gradient retained: only a second gradient of a weight in one step lands


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
        schedule: ``"backward"``, ``"forward"`` or ``"norm-first"`` (see the module docstring).
        retain_grads: keep whole gradients on the host for the window (gradient accumulation; implied by
            ``"forward"``).
        num_slots: ring slots for blocks on the device (>= 2).
        on_nonfinite: ``"raise"`` or, with clipping by norm, ``"skip"`` the step.
        cpu_threads: intra-op threads of the CPU worker (``None``: torch's default).
        offload_activations: keep the blocks' saved inputs in pooled host memory between forward and backward
            (``activations.py``); ``True``: every block's; ``"auto"``: on CUDA, those of as few of the first blocks
            as let the rest and one block at work fit the GPU, decided at the first training forward. When one block
            at work alone would not fit, the MLPs run tiled (``tiling.py``).
        nvme_path: keep Adam's moments in files in a private directory made here (``nvme.py``) instead of in RAM.
        nvme_masters: with ``nvme_path``, keep the fp32 masters of the blocks' trainable weight matrices there too;
            those parameters then hold their compute-dtype copy, which the updates refresh. Their fp32 values come
            back into the parameters when training ends, when RAM allows (see :meth:`teardown`).
        hooks_read_grads: user code may read or change ``param.grad`` between backward and step; with the
            "forward" schedule the gradients are then shown there, and the embedding's update is not split.
        compact_grads: keep retained gradients in bf16 where they can be (see :meth:`compact_grads`).
        config: the mechanism's knobs (``config.py``).
        resident: modules kept whole on the device (the GPU tier): out of every unit, their gradients stay there and
            the user's optimizer steps them there (``step.py``); blocks among them recompute in backward.
        world: the processes of a data-parallel run (``world.py``): gradients averaged over them.
        shared: the node's processes hold the masters, the optimizer state and the retained gradients once, each
            updating its rows (``shared_host.py``); with ``nvme_path``, each its rows' state (and masters) in files
            of its own.
        defer_blocks: schedule "backward": how many of the first blocks are updated at the end of the step, while the
            next forward runs (the module docstring), instead of as their backward ends.
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
        nvme_masters: bool = False,
        hooks_read_grads: bool = True,
        compact_grads: bool = False,
        config: EngineConfig | None = None,
        resident: list[tuple[str, nn.Module]] = (),
        world: DataParallel | None = None,
        shared: SharedHost | None = None,
        defer_blocks: int = 0,
    ) -> None:
        if num_slots < 2:
            raise ValueError(
                f"num_slots must be at least 2 (one block computes while the next arrives); got {num_slots}."
            )
        if on_nonfinite not in ("raise", "skip"):
            raise ValueError(f"on_nonfinite must be 'raise' or 'skip'; got {on_nonfinite!r}.")
        if resident and schedule == "norm-first":
            raise ValueError("update_schedule='norm-first' streams every update; it keeps no module on the device.")
        if defer_blocks and schedule != "backward":
            raise ValueError(
                f"Deferring block updates to the next forward is a variant of update_schedule='backward'; the schedule"
                f" is {schedule!r}, whose updates wait for the step's end anyway. Leave"
                " EngineConfig(deferred_updates=...) at 'auto' or 0."
            )
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
        embedding, head = (None if part is None or part[1] in kept else part for part in (embedding, head))
        whole = [(n, m) for n, m in whole if m not in kept]
        self.resident_blocks = [m for _, m in blocks if m in kept]
        blocks = [(n, m) for n, m in blocks if m not in kept]
        self.embedding, self.blocks, self.head, self.leftovers = collect_units(
            model, blocks, compute_dtype, embedding, head, whole, self.resident
        )
        # parameters more than one unit computes with (tied embeddings)
        self._shared = {p for u in self.units for p, o in zip(u.params, u.owner) if o is not u}
        self.optimizer = CpuOptimizer(optimizer) if optimizer is not None else None
        if nvme_path is not None and self.optimizer is not None and self.optimizer.is_sgd:
            raise ValueError(
                "optimizer_offload='nvme' holds Adam/AdamW moments; train SGD with optimizer_offload='cpu'."
            )
        self.nvme_path = nvme_path if self.optimizer is not None else None
        self._check_optimizer_params()
        self.disk_masters = self._disk_masters() if nvme_masters and self.nvme_path is not None else []
        self.state_io = StateIO(model, self.optimizer, self.disk_masters, shared if nvme_path is not None else None)
        self.chunk_numel = max(config.chunk_numel, *(row_numel(p) for u in self.units for p in u.params))
        if self.nvme_path is not None:  # a chunk holds at least one of the store's row blocks (whole pages)
            self.chunk_numel = max(self.chunk_numel, *(min_block_numel(p) for u in self.units for p in u.params))
        # no more landing buffers than one step's gradients fill (a small model would pin GiBs for nothing); with
        # the state on disk, the disk sets the pace and gradients waiting for it would only take RAM
        grad_numel = sum(p.numel() for u in self.units for p in u.params if p.requires_grad)
        most = min(config.landing_buffers, config.nvme_landing_buffers) if nvme_path else config.landing_buffers
        if schedule == "forward" and not retain_grads:
            # each gradient goes straight into its retained host buffer; the pool only takes a second one in the
            # same step (weights used twice)
            most = min(most, _SPARE_LANDING_BUFFERS)
        self._landing_buffers = min(most, -(-grad_numel // self.chunk_numel) + 1)
        self._cpu_threads = cpu_threads
        if not 0 <= defer_blocks <= len(self.blocks):
            raise ValueError(
                f"EngineConfig(deferred_updates={defer_blocks}) asks to defer more blocks than the {len(self.blocks)}"
                " the engine streams; give a number from 0 to that."
            )
        self.deferred = self.blocks[:defer_blocks] if self.optimizer is not None else []
        self._retain = retain_grads or schedule == "forward" or bool(self.deferred)
        self._accumulates = retain_grads
        self.hooks_read_grads = hooks_read_grads
        self._compact_grads = compact_grads
        self._offload_activations = offload_activations
        self.activations: ActivationStash | None = None
        self.rows: EmbeddingRows | None = None
        self.offloading: int | None = 0  # the first blocks whose inputs go to the host; None: "auto", undecided
        self.tiling: bool | None = None  # whether the blocks' MLPs run on slices of the tokens; None: undecided
        self.planned: tuple[int, int, bool] | None = None  # (saved bytes per block, offloading, tiling) from setup
        self._tiled: list[TiledMLP] = []
        self._unpatch: list = []  # what puts the modules' own forwards back
        self.dummy = torch.empty(0, requires_grad=True)  # makes a unit's node run backward when only weights need it
        self.step: Step | None = None  # the optimizer step's lifecycle (training only; step.py)
        self.guard: Guard | None = None  # what crosses the managed modules' boundaries (training only; guard.py)
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
        return {p for u in self.units for p, o in zip(u.params, u.owner) if o is u}

    def _forward_units(self) -> list[Unit]:
        return in_forward_order(self.embedding, self.blocks, self.head, self.leftovers)

    def _own_buffer_units(self) -> list[Unit]:
        # the units with a device buffer of their own, outside the blocks' ring: the head and the leftovers
        return [u for u in [self.head, *self.leftovers] if u is not None]

    def _disk_masters(self) -> list[nn.Parameter]:
        if self.compute_dtype == torch.float32:
            raise ValueError(
                "nvme_masters=True keeps the masters on disk and their bf16 copies in RAM; under 32-true the device"
                " computes with fp32 weights, so nothing would be saved. Train with precision='bf16-mixed' or set"
                " nvme_masters=False."
            )
        trainable = self.streamed_trainable()
        return [p for u in self.blocks for p, o in zip(u.params, u.owner) if o is u and p.dim() >= 2 and p in trainable]

    def streamed_trainable(self) -> set[nn.Parameter]:
        """The streamed parameters the optimizer updates (frozen ones in it have no state)."""
        trainable = {p for g in self.optimizer.optimizer.param_groups for p in g["params"] if p.requires_grad}
        return trainable - set(self.resident_params)

    def _check_optimizer_params(self) -> None:
        if self.optimizer is None:
            return
        managed = {p for u in self.units for p in u.params} | set(self.resident_params)
        stray = [p for g in self.optimizer.optimizer.param_groups for p in g["params"] if p not in managed]
        if stray:
            raise ValueError(
                f"The optimizer holds {len(stray)} tensor(s) that are not parameters of the model being trained"
                f" (first shape {tuple(stray[0].shape)}). Give configure_optimizers only self.parameters() (or"
                " subsets of them)."
            )

    def device_bytes(self, num_slots: int | None = None) -> int:
        """Device memory the engine allocates for weights and staging (activations not included), with its window
        or one of ``num_slots``."""
        return window_bytes(self.blocks, self._own_buffer_units(), num_slots or self.num_slots, self.chunk_numel)

    def host_plan(self, stored_sizes: dict[nn.Parameter, int] | None = None, activations: int = 0) -> HostPlan:
        """What :meth:`setup` and training will add to host memory (see ``planner.py``).

        Args:
            stored_sizes: element sizes parameters will be stored with, where they differ from now.
            activations: host bytes of the block inputs that will be offloaded.
        """
        owned = [[p for p, o in zip(u.params, u.owner) if o is u] for u in self.units]
        landing = self._landing_buffers * self.chunk_numel * 4 if self.optimizer is not None else 0
        copy_size = torch.empty((), dtype=self.compute_dtype).element_size()
        return plan_host(
            owned,
            self.optimizer.optimizer if self.optimizer is not None else None,
            retained={p for u in self._retained_units() for p, o in zip(u.params, u.owner) if o is u},
            compact_grads=self.compact_grads(),
            landing_bytes=landing,
            pinned=self.device.type == "cuda",
            frozen_bytes_per_element={**(stored_sizes or {}), **dict.fromkeys(self.disk_masters, copy_size)},
            state_block_numel=self.chunk_numel if self.nvme_path is not None else None,
            read_ahead_bytes=self.config.nvme_read_ahead_bytes,
            disk_masters=self.disk_masters,
            activations=activations,
            share=self.shared.size if self.shared is not None else 1,
        )

    def compact_grads(self) -> set[nn.Parameter]:
        """The parameters whose retained gradients the host keeps in the compute dtype (``compact_grads``): owned
        matrices computed with in bf16, with the "forward" schedule and no accumulation. Not where hooks read
        ``param.grad`` (an fp32 tensor there), nor shared weights (their contributions are summed in fp32), nor the
        embedding (fp32 rows), nor with the state on disk or shared by a node's processes."""
        if not (
            self._compact_grads
            and self.optimizer is not None
            and self.schedule == "forward"
            and not self._accumulates
            and not self.hooks_read_grads
            and self.compute_dtype == torch.bfloat16
            and self.nvme_path is None
            and self.shared is None
        ):
            return set()
        return {
            p
            for u in self.units
            for p, o, dtype in zip(u.params, u.owner, u.dtypes)
            if o is u and dtype == self.compute_dtype and p not in self._shared
        }

    def _retained_units(self) -> list[Unit]:
        # the units whose gradients wait on the host for their update (all, where any must)
        if self._accumulates or self.schedule == "forward":
            return self.units
        return self.deferred

    def _split_allowed(self) -> bool:
        # the embedding's two-part update (embedding.py) is exact here: an embedding in RAM that nothing else uses,
        # one backward pass per step; with "forward", not where hooks read `param.grad` (its gradient is then not
        # one), nor with on_nonfinite="skip" (a skipped step must not have updated the untouched rows)
        if self.world is not None:  # each process touched other rows
            return False
        if self.schedule == "backward":
            allowed = not self._accumulates
        elif self.schedule == "forward":
            allowed = not self._accumulates and self.on_nonfinite == "raise" and not self.hooks_read_grads
        else:
            return False
        return (
            allowed
            and self.optimizer.store is None
            and self.embedding.params[0].dtype == torch.float32
            and self.wants_grad(self.embedding, 0)
            and self.embedding.params[0] not in self._shared
        )

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
                                   compact=self.compact_grads())  # fmt: skip
            self.sender = GradSender(self.transfer, self.worker, self.updates,
                                     max_queued_bytes=self.config.max_queued_grad_bytes)  # fmt: skip
        self._ready = True  # from here on, teardown releases what setup made, also if setup fails below
        if self.nvme_path is not None:
            store = self.optimizer.store = NvmeStateStore(
                self.nvme_path, self._state_units(), self._state_keys(), masters=frozenset(self.disk_masters),
                chunk_numel=self.chunk_numel, max_ahead_bytes=self.config.nvme_read_ahead_bytes,
                own_rows=self._own_rows(),
            )  # fmt: skip
            self._masters_to_disk(store, loaded_masters or {})
        if self._offload_activations:
            self.activations = ActivationStash(self.transfer)
            self.offloading = None if self._offload_activations == "auto" else len(self.blocks)
        move_except_parameters(self.model, self.device)
        for p in self.resident_params:
            p.data = p.data.to(self.device)
        if self.shared is not None:
            self._share()
        elif self.transfer.is_cuda:
            for unit in self.units:
                self.transfer.pin([p for p, o in zip(unit.params, unit.owner) if o is unit])
        self.window = Window(self.blocks, self._own_buffer_units(), self.transfer, self.num_slots)
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
                resident=self.resident_params, world=self.world, deferred=self.deferred,
            )  # fmt: skip
        self._patch()

    def _share(self) -> None:
        # the masters, then the optimizer state and the retained gradients, once for the node's processes
        shared = self.shared
        owned = [[p for p, o in zip(u.params, u.owner) if o is u] for u in self.units]
        dtypes = [dict.fromkeys(p.dtype for p in params) for params in owned]
        groups = [[p for p in params if p.dtype == d] for params, ds in zip(owned, dtypes) for d in ds]
        flats = shared.tensors([(sum(p.numel() for p in group), group[0].dtype) for group in groups])
        for group, flat in zip(groups, flats):
            self.transfer.pin(group, flat, fill=shared.rank == 0)
        shared.main_barrier()  # the first process's values are in
        if self.optimizer is None:
            return
        trainable = self.streamed_trainable()
        params = [p for group in owned for p in group if p in trainable]
        self.optimizer.own_rows = self._own_rows()
        keys = self._state_keys() if self.optimizer.store is None else ()  # else in each process's files
        states = shared.tensors([(p.numel(), p.dtype) for p in params for _ in keys])
        for i, (p, key) in enumerate((p, key) for p in params for key in keys):
            self.optimizer.shared_state[p, key] = states[i].view(p.shape)
        self.updates.share(shared, self._retained_units())

    def _masters_to_disk(self, store: NvmeStateStore, loaded: dict[nn.Parameter, Tensor]) -> None:
        # each master to disk (its rows, where a node's processes share them out); the parameter keeps the copy the
        # device computes with. A node's other processes hold no values: theirs pass through memory they share.
        shared = self.shared if self.shared is not None and any(p not in loaded for p in self.disk_masters) else None
        staging = shared.tensors([(max(p.numel() for p in self.disk_masters), torch.float32)])[0] if shared else None
        for p in self.disk_masters:
            value = loaded.get(p)
            if value is None and shared is not None:
                value = staging[: p.numel()].view(p.shape)
                if shared.rank == 0:
                    value.copy_(p.data)
                shared.main_barrier()
            store.write(p, MASTER, p.data if value is None else value)
            if shared is not None and p not in loaded:  # every process has its rows before the next one comes
                shared.main_barrier()
            p.data = (
                placeholder(p.shape, self.compute_dtype) if is_placeholder(p.data) else p.data.to(self.compute_dtype)
            )
            if hasattr(p, "grad_dtype"):  # its .grad shows the fp32 gradient (older torch: no .grad)
                p.grad_dtype = None

    def _own_rows(self) -> dict[nn.Parameter, slice | None]:
        # the rows of each unit's own parameters this process updates (all of them without `shared`)
        if self.shared is None:
            return {}
        return {p: self.shared.rows(p) for u in self.units for p, o in zip(u.params, u.owner) if o is u}

    def _state_units(self) -> list[tuple[str, list[nn.Parameter]]]:
        # per unit, the trainable parameters it owns (what has optimizer state)
        trainable = self.streamed_trainable()
        units = [(u.name, [p for p, o in zip(u.params, u.owner) if o is u and p in trainable]) for u in self.units]
        return [(name, params) for name, params in units if params]

    def _state_keys(self) -> tuple[str, ...]:
        if self.optimizer.is_sgd:
            return ("momentum_buffer",) if any(g["momentum"] for g in self.optimizer.optimizer.param_groups) else ()
        amsgrad = any(g.get("amsgrad") for g in self.optimizer.optimizer.param_groups)
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if amsgrad else ("exp_avg", "exp_avg_sq")

    def _patch(self) -> None:
        patch = self._unpatch.append
        for module in self.resident_blocks:
            patch(replace_forward(module, partial(_recomputed, module.forward)))
        for unit in self.blocks:
            patch(replace_forward(unit.module, partial(self._block_forward, unit)))
            if self.activations is not None and (mlp := gated_mlp(unit.module)) is not None:
                self._tiled.append(TiledMLP(mlp))
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
            for tiled in self._tiled:
                tiled.restore()
            self._tiled = []
            if self.sender is not None:
                self.sender.close()
            self.worker.shutdown()
            self.transfer.close()  # first: each unit's pinned copies are freed as its masters come back below
            # what only training needs leaves the host before the resident units' weights come to it (below) and,
            # in Lightning's teardown, their optimizer state: the host's peak after fit is not training's plus theirs
            for part in (self.updates, self.activations, self.rows):
                if part is not None:
                    part.release()
            if self.optimizer is not None and self.optimizer.store is not None:
                try:
                    self._masters_from_disk()
                finally:
                    self.optimizer.store.close()
                    self.optimizer.store = None
            move_except_parameters(self.model, torch.device("cpu"))
            for p in self.resident_params:
                p.data = p.data.cpu()
                p.grad = None
            self.window = None

    def _masters_from_disk(self) -> None:
        # the store's files go with it: the fp32 masters come back into the parameters, if RAM holds them (once for a
        # node's processes, each reading its rows into the memory they share)
        need = sum(p.numel() * 4 for p in self.disk_masters)
        fits = need <= 0.9 * machine.available_host_bytes()
        if self.shared is not None:
            fits = all(self.shared.gather(fits))
        if not fits:
            log.warning(
                "SlideFormer leaves the bf16 copies in the %d block weights whose fp32 masters were on disk: the"
                " masters (%.2f GiB) do not fit the RAM available now. The checkpoints hold them (Trainer callbacks"
                " ModelCheckpoint; `slide export` reads them).", len(self.disk_masters), need / 2**30,
            )  # fmt: skip
            return
        if self.shared is None:
            for p in self.disk_masters:
                p.data = self.optimizer.store.read(p, MASTER)
            return
        flats = self.shared.tensors([(p.numel(), torch.float32) for p in self.disk_masters])
        for p, flat in zip(self.disk_masters, flats):
            self.optimizer.store.read(p, MASTER, flat.view(p.shape))
        self.shared.main_barrier()  # every process's rows are in
        for p, flat in zip(self.disk_masters, flats):
            p.data = flat.view(p.shape)

    # ---- the forwards of managed modules (functions.UnitHost) -------------------------------------------------

    @property
    def stats(self) -> WindowStats:
        return self.window.stats

    def acquire(self, unit: Unit) -> list[Tensor]:
        return self.window.acquire(unit)

    def release(self, unit: Unit, *, forward: bool) -> None:
        self.window.release(unit, forward=forward)

    def wants_grad(self, unit: Unit, index: int) -> bool:
        """Whether ``unit.params[index]`` needs a gradient (trainable and in the optimizer)."""
        if self.optimizer is None or not unit.trainable[index]:
            return False
        return self.optimizer.group_index(unit.params[index]) is not None

    def _unit_forward(self, unit: Unit, *args, **kwargs):
        return run_unit(self, unit, args, kwargs)

    def _block_forward(self, unit: Unit, *args, **kwargs):
        for key in _CACHE_KWARGS:
            if key in kwargs:
                kwargs[key] = None
        if "use_cache" in kwargs:
            kwargs["use_cache"] = False
        return run_unit(self, unit, args, kwargs)

    def _embedding_forward(self, ids: Tensor) -> Tensor:
        return self.rows.forward(ids, train=torch.is_grad_enabled() and self.wants_grad(self.embedding, 0))

    def head_loss(self, hidden: Tensor, target: Tensor, loss_fn, **kwargs) -> Tensor:
        """``loss_fn(hidden, weight, target, bias=..., **kwargs)`` with the head's weights on the device.

        The head's weights stay in their own buffer from this forward to its backward, so the loss needs no
        recompute; their gradients leave for the CPU as soon as the backward has produced them.
        """
        unit = self.head
        train = torch.is_grad_enabled()
        weights = [
            w.detach().requires_grad_(train and self.wants_grad(unit, i)) for i, w in enumerate(self.acquire(unit))
        ]
        for i, w in enumerate(weights):
            if w.requires_grad:
                w.register_post_accumulate_grad_hook(partial(self._head_grad, i))
        by_name = {attr: weights[i] for sub, attr, i in unit.entries if sub is unit.module}
        loss = loss_fn(hidden, by_name["weight"], target, bias=by_name.get("bias"), **kwargs)
        self.release(unit, forward=True)
        return loss

    def _head_grad(self, index: int, leaf: Tensor) -> None:
        grad, leaf.grad = leaf.grad, None
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
        """Whether ``unit`` keeps its saved ``inputs`` in host memory: the first ``offloading`` blocks do (their
        inputs wait longest for their backward). Called before the block runs; the first call decides."""
        if self.activations is None or unit not in self.window.index:
            return False
        if self.tiling is None:
            self._plan_activations(inputs)
        return self.window.index[unit] < self.offloading

    def _plan_activations(self, inputs: tuple[Tensor, ...]) -> None:
        # as planned at setup, if the inputs are no larger than planned; else from their size and the GPU memory left
        # (activations.plan_offload)
        saved = sum(t.numel() * t.element_size() for t in inputs if t.requires_grad and t.is_floating_point())
        if self.planned is not None:
            planned, self.offloading, self.tiling = self.planned
            if saved > planned:
                raise ValueError(
                    f"A block's inputs take {saved:,} bytes, but the placement plan counted {planned:,} (its tokens"
                    " per batch). Give SlideFormerStrategy(tokens_per_batch=...)"
                    " the largest batch's tokens, or lower the batch size or sequence length."
                )
        else:
            rows = self.rows.device_bytes(self.step.plan) if self.rows is not None and self.step is not None else 0
            self.offloading, self.tiling = plan_offload(
                saved, blocks=len(self.blocks), offloading=self.offloading, budget=machine.device_budget(self.device),
                reserved=self.config.max_queued_grad_bytes + rows, can_tile=bool(self._tiled),
            )  # fmt: skip
        if self.offloading:
            self._offload_to_host(saved)
        for tiled in self._tiled:
            tiled.active = self.tiling

    def _offload_to_host(self, saved: int) -> None:
        # Steps long enough to need offloading keep the GPU busy far longer than the CPU optimizer: gradients
        # seldom wait for it, and the host memory is better left to the offloaded inputs.
        if self.optimizer is not None:
            self._landing_buffers = min(self._landing_buffers, self.config.offload_landing_buffers)
            self.transfer.drop_landing(self._landing_buffers)
        if saved * self.offloading > (available := machine.available_host_bytes() - self._host_to_come()):
            raise MemoryError(
                f"SlideFormer must keep the saved inputs of {self.offloading} blocks"
                f" ({saved * self.offloading / 2**30:.2f} GiB) in host memory for the GPU to hold the rest, but only"
                f" {available / 2**30:.2f} GiB of RAM is available. Lower the tokens per step (batch size or sequence"
                " length; accumulate_grad_batches keeps the tokens per optimizer step), or free RAM."
            )

    def _host_to_come(self) -> int:
        # host bytes of the plan not allocated yet: the optimizer state and retained gradients appear at the first step
        if self.optimizer is None:
            return 0
        plan = self.host_plan()
        state = plan.optimizer_state if not self.optimizer.optimizer.state else 0
        return state + (plan.retained_grads if not self.updates.host else 0)

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


def _recomputed(forward, *args, **kwargs):
    # a block on the device keeps only its inputs for the backward and recomputes the rest, as a streamed one does
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
