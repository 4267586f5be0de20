"""The sliding-window engine: places a model's parameters, streams them through the device, and steps the
optimizer on the CPU while the device keeps computing. It knows nothing of Lightning; the strategy drives it.

Update schedules (both give exactly the update plain training gives):

- **"backward"** — used when nothing needs the global gradient norm. Each parameter's update runs on the CPU
  worker as soon as its last gradient of the step has arrived, while the device continues the backward pass
  through earlier blocks. The next forward of a block waits only for that block's update. (A split embedding's
  touched rows wait for the next forward's gather, which waits only for the rows it reads: rows.py.)
- **"forward"** — used with gradient clipping. The global norm needs every gradient, so nothing is updated
  before the backward pass ends. Then the updates are queued in forward order (embedding, block 0, 1, ...),
  each scaled by the clipping coefficient, and the next step's forward starts at once: block i's forward waits
  only for block i's update, so the CPU step overlaps the next forward pass. The step's gradients wait in host
  memory (4 bytes per parameter; 2 for the matrices computed with in bf16, COMPACT_RETAINED_GRADS).
- **"norm-first"** — gradient clipping by norm without that host memory. A first backward pass only sums the
  gradients' squares on the device (nothing leaves it); the clipping coefficient follows, and a second backward
  pass over the same graph streams the clipped updates as "backward" does. One more backward pass of GPU work.

Pending updates are completed (``wait``) before validation, checkpointing and the end of training.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from . import transfer
from .activations import ActivationStash
from .functions import EmbeddingRowsFunction, run_unit
from .grads import Contribution, GradRouter, NonFiniteGradientError, StepPlan, _nonfinite_message
from .nvme import MASTER, NvmeStateStore, min_block_numel, row_numel
from .optim import CpuOptimizer
from .planner import (
    WORKING_INPUTS,
    HostPlan,
    available_host_bytes,
    blocks_to_offload,
    device_budget,
    plan_host,
    tiling_needed,
)
from .rows import RowSplit
from .tiling import TILES, TiledMLP, gated_mlp
from .transfer import Transfer
from .units import DeviceBuffer, Unit, max_sizes
from .worker import CpuWorker

log = logging.getLogger(__name__)

Schedule = Literal["backward", "forward", "norm-first"]
# KV-cache arguments must not reach a managed block: the recompute would append to the cache a second time.
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")
# Host buffers of chunk_numel fp32 elements (32 MiB by default) for gradients on their way to the CPU worker: with
# the "backward" schedule they hold what the worker has not yet taken (1 GiB pinned, ~0.38 bytes per parameter of
# bench_core's 2.8 B model). Side by side on the H200 (bench_core.py --engine-set LANDING_BUFFERS=N, "backward"),
# 64 / 32 / 16 / 64 buffers: 8k steps 1.077 / 1.050 / 1.023 / 1.007 s, 32k steps 1.326 / 1.332 / 1.380 / 1.330 s, host
# 13.5 / 13.1 / 12.9 bytes per parameter. With 16 the touched embedding rows (15 chunks at 32k uniform ids) no longer
# fit in half the pool to be deferred (grads.py).
LANDING_BUFFERS = 32
_NVME_LANDING_BUFFERS = 16
_OFFLOAD_LANDING_BUFFERS = 16  # see _plan_activations
_SPARE_LANDING_BUFFERS = 2  # with every gradient retained (see __init__)
_ROWS_STAGE_NUMEL = 1 << 23  # fp32 elements per staging buffer of embedding rows (two of them)
# The embedding's update in two parts where exact (rows.py): True, False, or "auto": when the CPU worker has the time.
# The split moves the untouched rows' update off the end of the step, but gathering the touched rows costs the CPU
# more: on the H200 (bench_core, uniform token ids) the step at 32k tokens, where the worker waits for the GPU, took
# 1.370 s instead of 1.413; at 8k, where the worker is the bottleneck, 1.052 instead of 1.015.
SPLIT_EMBEDDING_UPDATE: bool | Literal["auto"] = "auto"
_SPLIT_DECIDED_AFTER = 2  # "auto" decides from the second optimizer step's timing (the first creates the state)
# With the "forward" schedule, a split embedding's touched rows are updated on the device, and the next forward reads
# the rows it shares with the step from there (rows.py): the CPU worker, which the next forward waits for block by
# block, no longer starts with their update. It costs the device their values and optimizer state from the step's end
# into the next step: at 32k uniform token ids, ~29k rows of 4096, 0.47 GB each. Used from the second step that
# splits (the first creates the optimizer state), where one forward per step gathered the rows. On the H200
# (bench_core.py, 32k, side by side) the "forward" step took 1.669-1.694 s instead of 1.747; the same done at the end
# of the "backward" schedule's backward (its state uploaded when the backward started) took 1.420-1.425 s instead of
# 1.339, so that schedule keeps the CPU's update.
DEVICE_ROW_UPDATE = True
# With the "backward" schedule, a split embedding's touched rows are updated when the next step's forward gathers its
# rows, those it reads first, the others while it runs (rows.py): the next forward no longer waits for the whole
# update (~56 ms at 32k uniform token ids on the H200's host, a trace of bench_core.py). Their gradients wait in
# landing buffers meanwhile, where they take at most half of them.
DEFER_TOUCHED_ROWS = True
# With the "forward" schedule and no accumulation, the host can keep the step's gradients of the matrices the device
# computes with in bf16 in bf16 too (compact_grads): each arrives as one bf16 tensor, so bf16 holds it exactly, in 2
# bytes per parameter instead of 4. The CPU update widens them to fp32 a chunk at a time, and the step is slower:
# 5-10 % at 8k and 32k tokens per step in bench_core.py on the H200 machine (widening alone, bench_cpu_adam.py
# --widen, costs little; beside the next forward's uploads it does not). "auto": only where fp32 gradients would not
# fit the RAM available (the strategy decides, before "norm-first"); True: always; False: never.
COMPACT_RETAINED_GRADS: bool | Literal["auto"] = "auto"


@dataclass
class EngineStats:
    """Where the training thread's time went, summed over the engine's life (seconds, bytes)."""

    wait_update_s: float = 0.0  # waiting for a CPU update before a block could be sent
    wait_send_s: float = 0.0  # waiting for room to queue gradients (the CPU far behind)
    upload_bytes: int = 0
    uploads: int = 0


class SlideEngine:
    """Streams a model's blocks through a window of device slots and runs the optimizer on the CPU.

    Args:
        model: the module whose parameters the engine manages (fp32 masters, on the CPU).
        blocks: the stack of transformer blocks, in order.
        device: the compute device (CUDA, or the CPU itself).
        compute_dtype: dtype of weight matrices on the device (``torch.bfloat16`` or ``torch.float32``).
        embedding: the input embedding, streamed by rows (``None``: it is a leftover like any other).
        head: the output head, kept in a buffer of its own (``None``: a leftover).
        optimizer: the user's optimizer (``None`` for evaluation only).
        schedule: ``"backward"``, ``"forward"`` or ``"norm-first"`` (see the module docstring).
        retain_grads: keep whole gradients on the host for the window (gradient accumulation; implied by
            ``"forward"``).
        num_slots: ring slots for blocks on the device (>= 2).
        on_nonfinite: ``"raise"`` or, with clipping by norm, ``"skip"`` the step.
        cpu_threads: intra-op threads of the CPU worker (``None``: torch's default).
        chunk_numel: elements per transfer chunk.
        max_queued_grad_bytes: device memory that gradients waiting to be sent may hold before the backward
            pass waits.
        offload_activations: keep the blocks' saved inputs in pooled host memory between forward and backward
            (long contexts; see ``activations.py``); ``True``: every block's; ``"auto"``: on CUDA, those of as few
            of the first blocks as let the rest and one block at work fit the GPU, decided at the first training
            forward (``planner.py``). When one block at work alone would not fit, the MLPs run tiled (``tiling.py``).
        nvme_path: keep Adam's moments in files in a private directory made here (the NVMe tier, ``nvme.py``)
            instead of in RAM.
        nvme_masters: with ``nvme_path``, keep the fp32 masters of the blocks' trainable weight matrices there too;
            those parameters then hold their compute-dtype copy (bf16: 2 bytes per parameter in RAM instead of 4),
            which the updates refresh. Their fp32 values come back into the parameters when training ends, when
            RAM allows (see :meth:`teardown`).
        hooks_read_grads: user code may read or change ``param.grad`` between backward and step (an overridden
            ``on_after_backward``, ``on_before_optimizer_step`` or ``configure_gradient_clipping``); with the
            "forward" schedule the gradients are then shown there, and the embedding's update is not split.
        compact_grads: keep retained gradients in bf16 where they can be (see :meth:`compact_grads`).
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
        optimizer: Optimizer | None = None,
        schedule: Schedule = "backward",
        retain_grads: bool = False,
        num_slots: int = 3,
        on_nonfinite: Literal["raise", "skip"] = "raise",
        cpu_threads: int | None = None,
        chunk_numel: int = 1 << 23,
        max_queued_grad_bytes: int = 1 << 30,
        offload_activations: bool | Literal["auto"] = False,
        nvme_path: str | None = None,
        nvme_masters: bool = False,
        hooks_read_grads: bool = True,
        compact_grads: bool = False,
    ) -> None:
        if num_slots < 2:
            raise ValueError(
                f"num_slots must be at least 2 (one block computes while the next arrives); got {num_slots}."
            )
        if on_nonfinite not in ("raise", "skip"):
            raise ValueError(f"on_nonfinite must be 'raise' or 'skip'; got {on_nonfinite!r}.")
        self.model = model
        self.device = device
        self.compute_dtype = compute_dtype
        self.schedule: Schedule = schedule
        self.on_nonfinite = on_nonfinite
        self.num_slots = num_slots
        self.stats = EngineStats()
        self.blocks = [Unit(name, module, compute_dtype) for name, module in blocks]
        self.embedding = Unit(embedding[0], embedding[1], torch.float32) if embedding else None
        self.head = Unit(head[0], head[1], compute_dtype) if head else None
        taken = {m for u in self._named_units() for m in u.module.modules()}
        self.leftovers = [
            Unit(name, m, compute_dtype, recurse=False)
            for name, m in model.named_modules()
            if m not in taken and any(p is not None for p in m._parameters.values())
        ]
        self._check_leftovers()
        self._assign_owners()
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
        self._chunk_numel = max(chunk_numel, *(row_numel(p) for u in self.units for p in u.params))
        if self.nvme_path is not None:  # a chunk holds at least one of the store's row blocks (whole pages)
            self._chunk_numel = max(self._chunk_numel, *(min_block_numel(p) for u in self.units for p in u.params))
        # no more landing buffers than one step's gradients fill (a small model would pin GiBs for nothing); with
        # the state on disk, the disk sets the pace and gradients waiting for it would only take RAM
        grad_numel = sum(p.numel() for u in self.units for p in u.params if p.requires_grad)
        most = min(LANDING_BUFFERS, _NVME_LANDING_BUFFERS) if nvme_path is not None else LANDING_BUFFERS
        if schedule == "forward" and not retain_grads:
            # each gradient goes straight into its retained host buffer; the pool only takes a second one in the
            # same step (weights used twice), so 2 GiB of pinned buffers would sit idle
            most = min(most, _SPARE_LANDING_BUFFERS)
        self._landing_buffers = min(most, -(-grad_numel // self._chunk_numel) + 1)
        self._max_queued_grad_bytes = max_queued_grad_bytes
        self._cpu_threads = cpu_threads
        self._retain = retain_grads or schedule == "forward"
        self._accumulates = retain_grads
        self.hooks_read_grads = hooks_read_grads
        self._compact_grads = compact_grads
        self._offload_activations = offload_activations
        self.activations: ActivationStash | None = None
        self.offloading: int | None = 0  # the first blocks whose inputs go to the host; None: "auto", undecided
        self.tiling: bool | None = None  # whether the blocks' MLPs run on slices of the tokens; None: undecided
        self._tiled: list[TiledMLP] = []
        self.dummy = torch.empty(0, requires_grad=True)  # makes a unit's node run backward when only weights need it
        self._plan: StepPlan | None = None
        self._order: dict[Unit, None] = {}  # units in the order of the first training forward
        self._touched: list[Tensor] = []  # the embedding rows this optimizer step's forwards gathered (host)
        self._split_pays: bool | None = None  # "auto": whether the worker has time for the split; None: undecided
        self._steps_begun = 0
        self._worker_at_step: tuple[float, float] = (0.0, 0.0)  # the worker's busy and waiting seconds then
        self._measuring = False  # "norm-first": the backward pass running sums squares only
        self._norm_first_max = 0.0  # "norm-first": the max norm the step was clipped at
        self._ready = False

    # ---- set-up ------------------------------------------------------------------------------------------------

    @property
    def units(self) -> list[Unit]:
        return self._named_units() + self.leftovers

    def _forward_units(self) -> list[Unit]:
        """All units in the order a causal LM's forward meets them."""
        first = [self.embedding] if self.embedding is not None else []
        last = [self.head] if self.head is not None else []
        return first + self.blocks + self.leftovers + last

    def _named_units(self) -> list[Unit]:
        return [u for u in (self.embedding, *self.blocks, self.head) if u is not None]

    def _check_leftovers(self) -> None:
        unit_modules = {u.module for u in self._named_units()}
        for unit in self.leftovers:
            nested = [name for name, m in unit.module.named_modules() if m in unit_modules]
            if nested or unit.module is self.model:
                where = f"'{unit.name}'" if unit.name else "the LightningModule itself"
                raise ValueError(
                    f"{where} registers parameters of its own and also holds streamed blocks ({nested[:3]}...)."
                    " SlideFormer streams such parameters only from a leaf of the model: move them into a"
                    " submodule (e.g. an nn.Linear) that the forward calls."
                )

    def _assign_owners(self) -> None:
        # NOTE: a parameter used by several units (tied input/output embeddings) is owned by the first of them
        # in forward order, whose backward comes last; the others' gradients wait for it, so it moves and
        # updates once with the sum.
        owner_of: dict[nn.Parameter, Unit] = {}
        for unit in self._forward_units():
            for i, p in enumerate(unit.params):
                unit.owner[i] = owner_of.setdefault(p, unit)

    def _disk_masters(self) -> list[nn.Parameter]:
        if self.compute_dtype == torch.float32:
            raise ValueError(
                "nvme_masters=True keeps the masters on disk and their bf16 copies in RAM; under 32-true the device"
                " computes with fp32 weights, so nothing would be saved. Train with precision='bf16-mixed' or set"
                " nvme_masters=False."
            )
        trainable = self._trainable()
        return [p for u in self.blocks for p, o in zip(u.params, u.owner) if o is u and p.dim() >= 2 and p in trainable]

    def _trainable(self) -> set[nn.Parameter]:
        # the parameters the optimizer updates (frozen ones in it have no state)
        return {p for g in self.optimizer.optimizer.param_groups for p in g["params"] if p.requires_grad}

    def _check_optimizer_params(self) -> None:
        if self.optimizer is None:
            return
        managed = {p for u in self.units for p in u.params}
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

        def nbytes(sizes: dict[torch.dtype, int]) -> int:
            return sum(n * torch.empty((), dtype=d).element_size() for d, n in sizes.items())

        own = sum(nbytes(u.numel) for u in [self.head, *self.leftovers] if u is not None)
        staging = 2 * transfer.STAGES * 4 * self._chunk_numel  # the two rings of fp32 staging chunks (transfer.py)
        return (num_slots or self.num_slots) * nbytes(max_sizes(self.blocks)) + own + staging

    def with_offloaded_state(self, state_dict: dict) -> dict:
        """``optimizer.state_dict()`` plus, for the moments that live in files, references to where they lie there
        (``NvmeStateStore.reference``; the checkpoint I/O copies the files beside the checkpoint)."""
        store = self.optimizer.store if self.optimizer is not None else None
        if store is None:
            return state_dict
        store.flush()
        params = [p for g in self.optimizer.optimizer.param_groups for p in g["params"]]  # state_dict's numbering
        state = dict(state_dict["state"])
        for i, p in enumerate(params):
            if i in state and p in store.regions:
                state[i] = {**state[i], **store.reference(p)}
        return {**state_dict, "state": state}

    def with_offloaded_masters(self, state_dict: dict) -> dict:
        """The module's ``state_dict()`` with, for each master on disk, a reference to where it lies there in place of
        its compute-dtype copy."""
        if not self.disk_masters:
            return state_dict
        store = self.optimizer.store
        store.flush()
        on_disk = set(self.disk_masters)
        names = {name: p for name, p in self.model.named_parameters() if p in on_disk}  # the state_dict's keys
        return {k: store.reference(names[k], (MASTER,))[MASTER] if k in names else v for k, v in state_dict.items()}

    def state_files(self) -> list[str]:
        """The files the optimizer state lives in (the NVMe tier), synced; none without it."""
        store = self.optimizer.store if self.optimizer is not None else None
        return store.synced_paths() if store is not None else []

    @contextmanager
    def masters_as_fp32(self) -> Iterator[None]:
        """Within, the parameters whose masters are on disk look fp32 (without memory): ``Optimizer.load_state_dict``
        casts the state it loads to its parameter's dtype, which would round Adam's moments to bf16."""
        copies = [p.data for p in self.disk_masters]
        for p in self.disk_masters:
            p.data = torch.zeros((), dtype=torch.float32).expand(p.shape)
        try:
            yield
        finally:
            for p, copy in zip(self.disk_masters, copies):
                p.data = copy

    def adopt_loaded_state(self) -> None:
        """After ``optimizer.load_state_dict``: the loaded moments go into the files (NVMe tier), or into memory of
        their own (they may still be views of the memory-mapped checkpoint file, which would keep it alive)."""
        if self.optimizer is None:
            return
        store = self.optimizer.store
        for p, state in self.optimizer.optimizer.state.items():
            for key in [k for k, v in state.items() if isinstance(v, Tensor) and v.dim() > 0]:
                if store is not None and p in store.regions:
                    store.write(p, key, state.pop(key))
                else:
                    state[key] = state[key].clone()

    def _state_units(self) -> list[tuple[str, list[nn.Parameter]]]:
        # per unit, the trainable parameters it owns (what has optimizer state)
        trainable = self._trainable()
        units = [(u.name, [p for p, o in zip(u.params, u.owner) if o is u and p in trainable]) for u in self.units]
        return [(name, params) for name, params in units if params]

    def _state_keys(self) -> tuple[str, ...]:
        amsgrad = any(g.get("amsgrad") for g in self.optimizer.optimizer.param_groups)
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if amsgrad else ("exp_avg", "exp_avg_sq")

    def host_plan(self, stored_sizes: dict[nn.Parameter, int] | None = None) -> HostPlan:
        """What :meth:`setup` and training will add to host memory (see ``lightning_slide.planner``).

        Args:
            stored_sizes: element sizes parameters will be stored with, where they differ from now.
        """
        owned = [[p for p, o in zip(u.params, u.owner) if o is u] for u in self.units]
        landing = self._landing_buffers * self._chunk_numel * 4 if self.optimizer is not None else 0
        copy_size = torch.empty((), dtype=self.compute_dtype).element_size()
        return plan_host(
            owned,
            self.optimizer.optimizer if self.optimizer is not None else None,
            retain_grads=self._retain,
            compact_grads=self.compact_grads(),
            landing_bytes=landing,
            pinned=self.device.type == "cuda",
            frozen_bytes_per_element={**dict.fromkeys(self.disk_masters, copy_size), **(stored_sizes or {})},
            state_block_numel=self._chunk_numel if self.nvme_path is not None else None,
            disk_masters=self.disk_masters,
        )

    def compact_grads(self) -> set[nn.Parameter]:
        """The parameters whose retained gradients the host keeps in the compute dtype (``compact_grads``,
        COMPACT_RETAINED_GRADS): owned matrices computed with in bf16, with the "forward" schedule and no
        accumulation. Not where hooks read ``param.grad`` (an fp32 tensor there), nor shared weights (their
        contributions are summed in fp32), nor the embedding (fp32 rows), nor with the state on disk."""
        if not (
            self._compact_grads
            and self.optimizer is not None
            and self.schedule == "forward"
            and not self._accumulates
            and not self.hooks_read_grads
            and self.compute_dtype == torch.bfloat16
            and self.nvme_path is None
        ):
            return set()
        return {
            p
            for u in self.units
            for p, o, dtype in zip(u.params, u.owner, u.dtypes)
            if o is u and dtype == self.compute_dtype and p not in self._shared
        }

    def setup(self, loaded_masters: dict[nn.Parameter, Tensor] | None = None) -> None:
        """Pin the masters, allocate the window, and route the modules' forwards through the engine.

        Args:
            loaded_masters: fp32 values (from a checkpoint) for masters that go to disk, where the parameter itself
                holds fewer bits (a model loaded in bf16).
        """
        budget = device_budget(self.device)  # within the process's memory fraction
        need = self.device_bytes()
        if budget is not None and need > budget:
            fix = "Lower SlideFormerStrategy(num_slots=...) (minimum 2) or free" if self.num_slots > 2 else "Free"
            raise torch.OutOfMemoryError(
                f"SlideFormer needs {need / 2**30:.2f} GiB on {self.device} for its window of {self.num_slots}"
                f" block slots, the head and staging, but only {budget / 2**30:.2f} GiB is free. {fix} GPU memory"
                " (other processes, or a lower torch.cuda.set_per_process_memory_fraction cap)."
            )
        landing = self._landing_buffers if self.optimizer is not None else 0
        self.transfer = Transfer(self.device, chunk_numel=self._chunk_numel, landing_buffers=landing)
        self.worker = CpuWorker(num_threads=self._cpu_threads)
        if self.optimizer is not None:
            self.router = GradRouter(
                self.transfer,
                self.worker,
                self.optimizer,
                retain=self._retain,
                max_queued_bytes=self._max_queued_grad_bytes,
                compact=self.compact_grads(),
            )
        self._ready = True  # from here on, teardown releases what setup made, also if setup fails below
        if self.nvme_path is not None:
            self.optimizer.store = NvmeStateStore(
                self.nvme_path, self._state_units(), self._state_keys(), masters=frozenset(self.disk_masters),
                chunk_numel=self._chunk_numel,
            )  # fmt: skip
            for p in self.disk_masters:  # the master to disk; the parameter keeps the copy the device computes with
                self.optimizer.store.write(p, MASTER, (loaded_masters or {}).get(p, p.data))
                p.data = p.data.to(self.compute_dtype)
                if hasattr(p, "grad_dtype"):  # its .grad shows the fp32 gradient (older torch: no .grad)
                    p.grad_dtype = None
        if self._offload_activations:
            self.activations = ActivationStash(self.transfer)
            self.offloading = None if self._offload_activations == "auto" else len(self.blocks)
        move_except_parameters(self.model, self.device)
        self._pin_masters()
        ring_sizes = max_sizes(self.blocks)
        self._ring = [DeviceBuffer(ring_sizes, self.device) for _ in range(self.num_slots)]
        self._own = {u: DeviceBuffer(u.numel, self.device) for u in [self.head, *self.leftovers] if u is not None}
        self._block_index = {u: i for i, u in enumerate(self.blocks)}
        self._rows_stage: list[tuple[Tensor, object] | None] = [None, None]  # pinned buffers for embedding rows
        self._patch()

    def _pin_masters(self) -> None:
        if not self.transfer.is_cuda:
            return
        for unit in self.units:
            params = [p for p, o in zip(unit.params, unit.owner) if o is unit]
            if not params or all(p.is_pinned() for p in params):  # e.g. a second fit() of the same module
                continue
            for dtype in dict.fromkeys(p.dtype for p in params):  # fp32 masters; bf16 frozen weights
                group = [p for p in params if p.dtype == dtype]
                flat = self.transfer.host_empty(sum(p.numel() for p in group), dtype)
                offset = 0
                for p in group:
                    view = flat[offset : offset + p.numel()].view(p.shape)
                    view.copy_(p.data)
                    p.data = view
                    offset += p.numel()

    def _patch(self) -> None:
        for unit in self.blocks:
            unit.module.gradient_checkpointing = False  # the engine owns recompute
            unit.module.forward = partial(self._block_forward, unit)
            if self.activations is not None and (mlp := gated_mlp(unit.module)) is not None:
                self._tiled.append(TiledMLP(mlp))
        if self.embedding is not None:
            self.embedding.module.forward = partial(self._embedding_forward, self.embedding)
        for unit in [self.head, *self.leftovers]:
            if unit is not None:
                unit.module.forward = partial(self._unit_forward, unit)

    def teardown(self) -> None:
        """Finish pending work, restore the modules' own forwards and move non-parameter state back."""
        if not self._ready:
            return
        self._ready = False
        try:
            self.wait()
        finally:
            for unit in self.units:
                unit.module.__dict__.pop("forward", None)
            for tiled in self._tiled:
                tiled.restore()
            self._tiled = []
            if self.optimizer is not None:
                self.router.close()
            self.worker.shutdown()
            self.transfer.close()  # first: each unit's pinned copies are freed as its masters come back below
            if self.optimizer is not None and self.optimizer.store is not None:
                try:
                    self._masters_from_disk()
                finally:
                    self.optimizer.store.close()
                    self.optimizer.store = None
            move_except_parameters(self.model, torch.device("cpu"))
            self._ring, self._own = [], {}

    def _masters_from_disk(self) -> None:
        # the store's files go with it: the fp32 masters come back into the parameters, if RAM holds them
        need = sum(p.numel() * 4 for p in self.disk_masters)
        if need > 0.9 * available_host_bytes():
            log.warning(
                "SlideFormer leaves the bf16 copies in the %d block weights whose fp32 masters were on disk: the"
                " masters (%.2f GiB) do not fit the RAM available now. The checkpoints hold them (Trainer callbacks"
                " ModelCheckpoint; `slide export` reads them).", len(self.disk_masters), need / 2**30,
            )  # fmt: skip
            return
        for p in self.disk_masters:
            p.data = self.optimizer.store.read(p, MASTER)

    # ---- weights on the device -------------------------------------------------------------------------------

    def _buffer(self, unit: Unit) -> DeviceBuffer:
        index = self._block_index.get(unit)
        return self._ring[index % self.num_slots] if index is not None else self._own[unit]

    def _version(self, unit: Unit) -> int:
        return sum(o.version for o in unit.owners())

    def _wait_updates(self, unit: Unit) -> None:
        self._wait_for([owner.update_done for owner in unit.owners()])

    def _wait_for(self, updates: list[Future | None]) -> None:
        for update in updates:
            if update is not None:
                start = time.perf_counter()
                update.result()  # also re-raises a failed update
                self.stats.wait_update_s += time.perf_counter() - start

    def _updated(self, unit: Unit) -> bool:
        # no update of ``unit`` is pending
        return all(owner.update_done is None or owner.update_done.done() for owner in unit.owners())

    def _upload(self, unit: Unit, buf: DeviceBuffer) -> None:
        self._wait_updates(unit)
        buf.ready = self.transfer.upload(list(zip((p.data for p in unit.params), buf.views(unit))), after=buf.free)
        buf.tag = (unit, self._version(unit))
        self.stats.uploads += 1
        self.stats.upload_bytes += unit.master_bytes

    def prefetch(self, unit: Unit) -> None:
        """Start sending ``unit``'s weights unless its buffer already holds them."""
        buf = self._buffer(unit)
        if buf.tag != (unit, self._version(unit)):
            self._upload(unit, buf)

    def acquire(self, unit: Unit) -> list[Tensor]:
        """The device copies of ``unit``'s parameters, ready for the current stream."""
        if torch.is_grad_enabled():
            self._order.setdefault(unit)
        self.prefetch(unit)
        buf = self._buffer(unit)
        self.transfer.wait(buf.ready)
        return buf.views(unit)

    def release(self, unit: Unit, *, forward: bool) -> None:
        """The current stream is done with ``unit``'s buffer; look ahead for the next blocks."""
        self._buffer(unit).free = self.transfer.record()
        index = self._block_index.get(unit)
        if index is None:
            return
        step = 1 if forward else -1
        for k in range(1, self.num_slots):
            j = index + step * k
            if 0 <= j < len(self.blocks):
                self.prefetch(self.blocks[j])
        # the head (and leftovers) in their own buffers: sent behind the first blocks, where their update is done,
        # else after the last block. At 32k the head's 2 GiB (fp32) took ~40 ms to send: sent during the last blocks,
        # it still left the GPU idle 27 ms (traces of bench_core.py)
        last = index == len(self.blocks) - 1
        if forward:
            for other in self._own:
                if last or self._updated(other):
                    self.prefetch(other)

    def wants_grad(self, unit: Unit, index: int) -> bool:
        """Whether ``unit.params[index]`` needs a gradient (trainable and in the optimizer)."""
        return self.optimizer is not None and self.router.wants(unit, index)

    # ---- forwards of managed modules ---------------------------------------------------------------------------

    def _unit_forward(self, unit: Unit, *args, **kwargs):
        return run_unit(self, unit, args, kwargs)

    def _block_forward(self, unit: Unit, *args, **kwargs):
        for key in _CACHE_KWARGS:
            if key in kwargs:
                kwargs[key] = None
        if "use_cache" in kwargs:
            kwargs["use_cache"] = False
        return run_unit(self, unit, args, kwargs)

    def _embedding_forward(self, unit: Unit, ids: Tensor) -> Tensor:
        if torch.is_grad_enabled() and self.wants_grad(unit, 0):
            return EmbeddingRowsFunction.apply(self, unit, ids, self.dummy)
        index, inverse, rows = self.gather_rows(unit, ids)
        return rows[inverse]

    def gather_rows(self, unit: Unit, ids: Tensor, *, training: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """Send the embedding rows of the tokens in ``ids``.

        Args:
            training: a forward whose backward sends these rows' gradients (they are the step's touched rows).

        Returns:
            the sorted distinct ids (device), each token's position among them (shaped like ``ids``), and the
            fp32 rows (device, one per distinct id).
        """
        if torch.is_grad_enabled():
            self._order.setdefault(unit)
        # NOTE: block 0 goes up before the rows, the window's next blocks once block 0's forward is queued (release):
        # with the "forward" schedule, waiting here for block 1's update kept the device from starting block 0. But
        # while the rows wait for an update on the worker (the embedding's whole update, or the deferred update's
        # first part, rows.py), the next blocks whose updates are done go up meanwhile: an upload issued during the
        # forward is slower, each staging chunk's conversion waiting for the running matmul, and blocks the thread.
        # A trace of bench_core.py (32k, "backward", 9c7ff5e) had block 1 go up during block 0's forward in ~26 ms
        # (~16 ms when nothing computes), and the GPU idle 28 ms before block 1 while this thread issued block 2's.
        look_ahead = self.blocks[: self.num_slots - 1]
        for block in look_ahead[:1]:
            self.prefetch(block)
        weight = unit.params[0]
        index, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
        index_host = index.cpu()
        if index_host.numel() and (index_host[0] < 0 or index_host[-1] >= weight.shape[0]):
            raise IndexError(
                f"Token id {int(index_host[-1] if index_host[-1] >= weight.shape[0] else index_host[0])} is out of"
                f" range for the embedding '{unit.name}' with {weight.shape[0]} rows."
            )
        if training and self._plan is not None:
            self._touched.append(index_host)
        copy = None
        if training and self.optimizer is not None:
            # used once: a later gather waits for the write-back instead, and the device frees the copy sooner
            copy, self.router.row_copy = self.router.row_copy, None
            if copy is not None and copy.landed.done():
                copy = None  # the host holds its rows
        # the last step's deferred update of its touched rows: those read here first (rows.py)
        deferred = self.router.apply_deferred(index_host) if copy is None and self.optimizer is not None else None
        rows = torch.empty(index_host.numel(), weight.shape[1], dtype=torch.float32, device=self.device)
        if copy is not None:
            held, at = copy.find(index_host)
            self._send_host_rows_at(weight.data, index_host, rows, ~held)
            self.transfer.wait(copy.event)
            held, at = held.to(self.device), at.to(self.device)
            rows[held] = copy.values[at[held]]
        elif deferred is not None:
            # the rows the deferred update does not touch are final: they go up while the worker updates the others
            first, first_rows = deferred
            pending = torch.isin(index_host, first_rows)
            self._send_host_rows_at(weight.data, index_host, rows, ~pending)
            self._prefetch_updated(look_ahead[1:])
            self._wait_for([first])
            self._send_host_rows_at(weight.data, index_host, rows, pending)
        else:
            if not self._updated(unit):
                self._prefetch_updated(look_ahead[1:])
                self._wait_updates(unit)
            self._send_host_rows(weight.data, index_host, rows)
        return index, inverse.view(ids.shape), rows

    def _prefetch_updated(self, blocks: list[Unit]) -> None:
        for block in blocks:
            if self._updated(block):
                self.prefetch(block)

    def _send_host_rows_at(self, source: Tensor, index: Tensor, rows: Tensor, where: Tensor) -> None:
        """Copy rows ``index[where]`` of the host tensor ``source`` into ``rows[where]`` (device); ``where`` is a host
        mask over ``index``."""
        part = torch.empty(int(where.sum()), *rows.shape[1:], dtype=rows.dtype, device=self.device)
        self._send_host_rows(source, index[where], part)
        rows[where.to(self.device)] = part

    def _send_host_rows(self, source: Tensor, index: Tensor, out: Tensor) -> None:
        """Copy rows ``index`` of the host tensor ``source`` into the device tensor ``out``; the current stream waits
        for them."""
        width = source[0].numel()
        per = max(1, min(_ROWS_STAGE_NUMEL // width, source.shape[0]))  # rows per staging buffer
        allocated = self.transfer.record()  # `out` may reuse memory still read on the compute stream
        event = None
        for k, lo in enumerate(range(0, index.numel(), per)):
            # two pinned staging buffers in turn: gathering the next rows overlaps sending the last ones
            if self._rows_stage[k % 2] is None:
                self._rows_stage[k % 2] = (self.transfer.host_empty(per * width), None)
            buffer, sent = self._rows_stage[k % 2]
            if sent is not None:
                sent.synchronize()  # its previous rows have left
            part = buffer[: min(per, index.numel() - lo) * width].view(-1, *source.shape[1:])
            torch.index_select(source, 0, index[lo : lo + len(part)], out=part)
            event = self.transfer.upload([(part, out[lo : lo + len(part)])], after=allocated)
            self._rows_stage[k % 2] = (buffer, event)
        self.transfer.wait(event)

    def _row_state(self, split: RowSplit) -> dict[str, Tensor]:
        """The touched rows of the embedding and of its optimizer state, on the device, for their update there."""
        self._wait_updates(self.embedding)  # the write-back of its last update has landed
        state = {}
        for name, tensor in self.optimizer.state_like(split.param).items():
            state[name] = torch.empty(len(split.index), *tensor.shape[1:], dtype=torch.float32, device=self.device)
            self._send_host_rows(tensor, split.index, state[name])
        return state

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
        self._buffer(self.head).free = self.transfer.record()  # the backward has read the weights
        self.after_backward(self.head, {index: grad})

    def after_backward(self, unit: Unit, grads: dict[int, Contribution]) -> None:
        if self.optimizer is None or not grads:
            return
        if self._measuring:
            self.router.measure(unit, grads)
            return
        plan = self._plan if self._streams() else None
        start = time.perf_counter()
        self.router.push(unit, grads, plan)
        self.stats.wait_send_s += time.perf_counter() - start

    # ---- the optimizer step ------------------------------------------------------------------------------------

    def is_block(self, unit: Unit) -> bool:
        return unit in self._block_index

    def offloads(self, unit: Unit, inputs: tuple[Tensor, ...]) -> bool:
        """Whether ``unit`` keeps its saved ``inputs`` in host memory: the first ``offloading`` blocks do (their
        inputs wait longest for their backward). Called before the block runs; the first call decides."""
        if self.activations is None or not self.is_block(unit):
            return False
        if self.tiling is None:
            self._plan_activations(inputs)
        return self._block_index[unit] < self.offloading

    def _plan_activations(self, inputs: tuple[Tensor, ...]) -> None:
        # From the size of a block's saved inputs and the GPU memory left: with "auto", how many blocks offload
        # (as few as make the rest fit); whether the MLPs must run tiled (one block at work would not fit).
        saved = sum(t.numel() * t.element_size() for t in inputs if t.requires_grad and t.is_floating_point())
        budget = device_budget(self.device)
        blocks, reserved = len(self.blocks), self._max_queued_grad_bytes + self._device_rows_bytes()
        if self.offloading is None:
            self.offloading = blocks_to_offload(saved, blocks, budget, reserved)
            if self.offloading:
                log.info(
                    "SlideFormer offloads the activations of %d of %d blocks (%.2f GiB to host memory): all %d blocks'"
                    " saved inputs (%.2f GiB) and one block at work (~%.2f GiB) exceed the %.2f GiB left on the GPU.",
                    self.offloading, blocks, saved * self.offloading / 2**30, blocks, saved * blocks / 2**30,
                    saved * WORKING_INPUTS / 2**30, budget / 2**30,
                )  # fmt: skip
        if self.offloading:
            self._offload_to_host(saved)
        self.tiling = bool(self._tiled) and tiling_needed(saved, budget, reserved)
        for tiled in self._tiled:
            tiled.active = self.tiling
        if self.tiling:
            log.info(
                "SlideFormer runs the blocks' MLPs on %d slices of the tokens: one block at work (~%.2f GiB) would not"
                " fit the %.2f GiB left on the GPU.", TILES, saved * WORKING_INPUTS / 2**30, budget / 2**30,
            )  # fmt: skip

    def _device_rows_bytes(self) -> int:
        # the "forward" schedule's touched-rows update on the device (rows.py) holds their gradient, values and
        # optimizer state from the step's end until the worker has written them back, which can reach into the next
        # backward; as many rows as this step's forward gathered
        if not (self._touched and self._rows_on_device()):
            return 0
        weight = self.embedding.params[0]
        hypers = self._plan.hypers[self.optimizer.group_index(weight)]
        state = int(hypers.momentum != 0) if self.optimizer.is_sgd else 2 + int(hypers.amsgrad)
        return sum(len(t) for t in self._touched) * weight[0].numel() * 4 * (2 + state)

    def _offload_to_host(self, saved: int) -> None:
        # Steps long enough to need offloading keep the GPU busy far longer than the CPU optimizer: gradients
        # seldom wait for it, and the host memory is better left to the offloaded inputs.
        if self.optimizer is not None:
            self._landing_buffers = min(self._landing_buffers, _OFFLOAD_LANDING_BUFFERS)
            self.transfer.drop_landing(self._landing_buffers)
        if saved * self.offloading > (available := available_host_bytes() - self._host_to_come()):
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
        return state + (plan.retained_grads if not self.router.host else 0)

    def begin_step(self, step: int) -> None:
        """``optimizer_step`` was called: the hyperparameters in force now are the ones applied."""
        if self.activations is not None:
            self.activations.reset()
        self.worker.raise_if_failed()
        self._plan = StepPlan(step=step, hypers=self.optimizer.snapshot())
        self._touched = []
        self._steps_begun += 1
        before, self._worker_at_step = self._worker_at_step, (self.worker.busy_s, self.worker.wait_s)
        if self._steps_begun == _SPLIT_DECIDED_AFTER + 1 and self.embedding is not None and self.schedule == "backward":
            self._decide_split(self._worker_at_step[0] - before[0], self._worker_at_step[1] - before[1])

    def _decide_split(self, busy: float, waiting: float) -> None:
        # "auto": split when, in the last step, the worker waited for the GPU at least as long as the embedding's
        # update took (its share of the parameters, of the worker's busy time: the updates are bound by RAM bandwidth)
        trainable = sum(p.numel() for _, params in self._state_units() for p in params)
        share = self.embedding.params[0].numel() / max(1, trainable)
        self._split_pays = waiting >= share * busy
        log.info(
            "SlideFormer %s the embedding's update in two parts: in the last step the CPU worker waited %.3f s for"
            " the GPU; the embedding's update takes ~%.3f s.", "runs" if self._split_pays else "does not run",
            waiting, share * busy,
        )  # fmt: skip

    def backward_starts(self) -> None:
        """The step's loss is about to run backward: where exact, the embedding's rows the step did not touch are
        updated now (see ``rows.py``)."""
        touched, self._touched = self._touched, []
        if touched and self._splits_embedding():
            param = self.embedding.params[0]
            index = torch.unique(torch.cat(touched))
            # the state exists after the first update (the previous gather waited for it, or it is on the device)
            has_state = bool(self.optimizer.optimizer.state.get(param))
            on_device = self._rows_on_device() and len(touched) == 1 and has_state
            defer = DEFER_TOUCHED_ROWS and self.schedule == "backward"
            self.router.start_split(param, index, self._plan, on_device=on_device, defer=defer)

    def _rows_on_device(self) -> bool:
        # the split embedding's touched rows are updated on the device (DEVICE_ROW_UPDATE, rows.py)
        return DEVICE_ROW_UPDATE and self.schedule == "forward" and self._splits_embedding()

    def _splits_embedding(self) -> bool:
        # an embedding in RAM that nothing else uses, one backward pass per step, and either
        # - streamed updates ("backward" schedule): "auto" splits where the worker has time for the split (it then
        #   takes the embedding's update off the end of the step, but gathers and scatters the touched rows), or
        # - the "forward" schedule: "auto" always splits. The bulk runs while the worker waits for the backward, and
        #   the step no longer starts with the whole embedding's update (0.13 s at 32k, bench_core.py) nor keeps its
        #   whole gradient in RAM. Its gradient is then not a `param.grad`, so only where no hook reads those; and
        #   not with on_nonfinite="skip": a skipped step must not have updated the untouched rows.
        unit = self.embedding
        if self.schedule == "backward":
            allowed, pays = not self._retain, bool(self._split_pays)
        elif self.schedule == "forward":
            allowed = not self._accumulates and self.on_nonfinite == "raise" and not self.hooks_read_grads
            pays = True
        else:
            return False
        return (
            (SPLIT_EMBEDDING_UPDATE is True or (SPLIT_EMBEDDING_UPDATE == "auto" and pays))
            and allowed
            and self._plan is not None
            and self.optimizer.store is None
            and self.wants_grad(unit, 0)
            and unit.params[0] not in self._shared
        )

    def grads_ready(self) -> None:
        """The step's backward is done. With the "forward" schedule, wait until every gradient is on the host
        and show them as ``param.grad`` (hooks and clipping read them there), but for a split embedding's."""
        split = self.router.split if self.optimizer is not None else None
        if split is not None and not split.received:
            raise RuntimeError(
                f"SlideFormer updated the rows of '{self.embedding.name}' that the step's tokens did not touch when"
                " its backward pass began, but no gradient reached the embedding in that pass (is its output detached"
                " from the loss?). If it is not meant to train, freeze it or leave it out of the optimizer; else set"
                " lightning_slide.engine.engine.SPLIT_EMBEDDING_UPDATE = False."
            )
        self.router.flush(self._plan if self._streams() else None)
        if self.schedule == "forward":
            self.router.drain()
            self.worker.drain()
            for p in self.router.pending:
                if split is not None and p is split.param:  # its touched rows only, in a buffer of their own
                    continue
                if p in self.router.compact:  # bf16, and no hook reads it
                    continue
                if p.dtype == torch.float32 or getattr(p, "grad_dtype", p.dtype) is None:  # see setup
                    p.grad = self.router.host[p]

    def _streams(self) -> bool:
        # updates run as gradients arrive (the step's last backward pass, where a schedule has several)
        return self.schedule != "forward"

    def start_norm_pass(self) -> None:
        """ "norm-first": the backward pass about to run only sums the gradients' squares (``router.measure``); the
        graph must be retained for the second one."""
        self._measuring = True
        if self.activations is not None:
            self.activations.keep = True

    def end_norm_pass(self, max_norm: float) -> bool:
        """ "norm-first": the first backward pass is done; set the clipping of the second one from the global norm.

        Returns:
            whether the second pass should run (``False``: a non-finite norm and ``on_nonfinite="skip"``).
        """
        self._measuring = False
        if self.activations is not None:
            self.activations.keep = False
        self.router.flush_measure()
        self._norm_first_max = max_norm
        self._plan.norm = self._clip_by(self.router.global_norm(self._update_order_params()), max_norm)
        return not self._plan.skip

    def _check_clip(self, kind: str) -> None:
        if self.schedule == "norm-first" and kind == "norm":
            return
        if self.schedule != "forward":
            raise RuntimeError(
                f"Gradient clipping by {kind} was requested, but the 'backward' update schedule has already applied"
                " the updates. Use SlideFormerStrategy(update_schedule='forward') (chosen automatically when"
                " Trainer(gradient_clip_val=...) is set)."
            )

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip by the global 2-norm, exactly as ``torch.nn.utils.clip_grad_norm_``; returns the norm."""
        self._check_clip("norm")
        if self.schedule == "norm-first":  # applied already, by the second backward pass
            if max_norm != self._norm_first_max:
                raise RuntimeError(
                    f"update_schedule='norm-first' clipped this step at {self._norm_first_max} (Trainer's"
                    f" gradient_clip_val when the backward ran), but clipping was asked at {max_norm}. Change the"
                    " clipping value through Trainer(gradient_clip_val=...) only, or use update_schedule='forward'."
                )
            return self._plan.norm
        return self._clip_by(self.router.global_norm(self._update_order_params()), max_norm)

    def _clip_by(self, total: float, max_norm: float) -> float:
        if not math.isfinite(total):
            if self.on_nonfinite == "skip":
                log.warning("Skipping optimizer step %d: the gradient norm is %s.", self._plan.step, total)
                self._plan.skip = True
                return total
            raise NonFiniteGradientError(_nonfinite_message(self._plan.step, "the global gradient norm"))
        self._plan.norm_checked = True
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            self._plan.grad_scale = torch.tensor(1.0 / coef, dtype=torch.float32)
        return total

    def clip_grad_value(self, clip_value: float) -> None:
        self._check_clip("value")
        self._plan.clip_value = float(clip_value)

    def _update_order_params(self) -> list[nn.Parameter]:
        return [p for u in self._update_order() for p, o in zip(u.params, u.owner) if o is u]

    def _update_order(self) -> list[Unit]:
        return list(self._order) + [u for u in self._forward_units() if u not in self._order]

    def finish_step(self) -> None:
        """End of ``optimizer_step``: with the "forward" schedule, queue the updates in forward order."""
        plan, self._plan = self._plan, None
        # NOTE: with the "backward" schedule, the sender queues each unit's update; the next forward must see
        # them all queued before it waits on them.
        self.router.drain()
        # NOTE: torch's LR schedulers warn unless the optimizer's step() ran; the engine applied it instead.
        self.optimizer.optimizer._opt_called = True
        if plan.skip:
            self.router.discard()
        elif self.schedule == "forward":
            split = self.router.split
            if split is not None and split.on_device:
                split.bulk_done.result()  # it has put back the touched rows' state
                split.state = self._row_state(split)
            for unit in self._update_order():
                self.router.schedule_update(unit, plan, check_finite=not plan.norm_checked)
        self.router.end_window()

    def wait(self) -> None:
        """Complete every pending update (before validation, checkpoints, and the end of training)."""
        if self._ready:
            if self.optimizer is not None:
                self.router.drain()
                self.router.apply_deferred(None)
            self.worker.drain()
            if self.optimizer is not None:
                self.router.row_copy = None  # the host holds it


def move_except_parameters(module: nn.Module, device: torch.device) -> None:
    """``module.to(device)`` for everything but parameters: buffers, metric states, the module's device."""
    saved = []
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None:
                saved.append((m, name, p))
                m._parameters[name] = None
    try:
        module.to(device)
    finally:
        for m, name, p in saved:
            m._parameters[name] = p
