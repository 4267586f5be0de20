"""Where a run's state goes, decided at setup before anything large is allocated (``make_plan``): the whole model on
the device (the resident tier) or streamed; for a streamed run, the modules that stay on the device (the GPU tier),
the blocks whose inputs are offloaded, the update schedule, bf16 retained gradients and the optimizer state's tier
(RAM or NVMe), from the trainer's settings, the tokens per batch and the machine's figures. The plan is logged."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from torch import nn
from torch.optim import Optimizer

from . import overlap
from .attention import kept_bytes_per_token
from .engine import SlideEngine
from .engine.activations import plan_offload
from .engine.planner import (
    DEVICE_RESERVE,
    GIB,
    TILED_WORKING_INPUTS,
    WORKING_INPUTS,
    HostPlan,
    check_host,
    check_window,
    plain_training_bytes,
    state_per_fp32,
    usable_device_bytes,
    window_slots,
)
from .engine.tiling import gated_mlp
from .engine.units import Unit, in_forward_order
from .models import Layout
from .options import Run
from .rates import Rates, Work, predict_step_s
from .schedule import hooks_read_grads, norm_first_refusal
from .tier import Tier, choose_tier, loss_bytes

log = logging.getLogger(__name__)


def choose_engine(
    run: Run, available: int, activations: int = 0, resident: list[tuple[str, nn.Module]] = (), deferred: int = 0,
    delayed: int = 0,
) -> tuple[SlideEngine, HostPlan]:  # fmt: skip
    """The engine for ``run`` and its host plan: where the plan does not fit the ``available`` RAM, each "auto" takes
    its cheaper choice in turn (bf16 retained gradients, then "norm-first", then the optimizer state on NVMe).

    Args:
        activations: host bytes of the block inputs that will be offloaded.
        resident: modules kept on the device (the GPU tier).
        deferred: schedule "backward": the first blocks updated during the next forward (``SlideEngine``'s
            ``defer_blocks``; ``EngineConfig(deferred_updates=N)`` overrides it).
        delayed: the first blocks updated a step late (``delay.py``).
    """
    module, layout, optimizer, trainer, options, stored = (
        run.module, run.layout, run.optimizer, run.trainer, run.options, run.stored
    )  # fmt: skip
    schedule = run.schedule
    config = options.config
    if config.deferred_updates != "auto":
        deferred = config.deferred_updates

    # the bf16 state's kernel reads a bf16 gradient as it is: no widening to pay for the bytes saved
    compact_first = config.compact_retained_grads is True or (
        config.compact_retained_grads == "auto" and options.optimizer_state == "bf16"
    )

    def make(nvme_path: str | None, compact: bool = compact_first) -> SlideEngine:
        return SlideEngine(
            module, layout.blocks, run.device, compute_dtype=run.dtype, embedding=layout.embedding, head=layout.head,
            whole=layout.whole, optimizer=optimizer, schedule=schedule,
            retain_grads=trainer.accumulate_grad_batches > 1,
            num_slots=options.num_slots or 3, on_nonfinite=options.on_nonfinite, cpu_threads=options.cpu_threads,
            offload_activations=options.offload_activations, nvme_path=nvme_path, nvme_masters=options.nvme_masters,
            state_dtype=torch.bfloat16 if options.optimizer_state == "bf16" else torch.float32,
            hooks_read_grads=hooks_read_grads(trainer, module), compact_grads=compact, config=config,
            resident=resident if schedule != "norm-first" else (), world=options.world,
            shared=options.shared, defer_blocks=deferred, delay_blocks=delayed, delay_warmup=options.delay_warmup,
        )  # fmt: skip

    nvme = options.nvme_path if options.optimizer_offload == "nvme" else None
    engine = make(nvme)
    plan = engine.host_plan(stored, activations)
    if plan.added > available and config.compact_retained_grads == "auto" and not compact_first:
        candidate = make(engine.nvme_path, compact=True)
        if candidate.retention.compact:
            engine, plan = candidate, candidate.host_plan(stored, activations)
            log.info(
                "SlideFormer keeps the step's bf16 gradients in bf16 on the host (a slower CPU update): in fp32"
                " they would not fit the %.2f GiB of RAM available.", available / 2**30,
            )  # fmt: skip
    if (
        options.update_schedule == "auto"
        and engine.schedule == "forward"
        and plan.added > available
        and not norm_first_refusal(trainer, module)
    ):
        log.info(
            "SlideFormer clips with update_schedule='norm-first' (two backward passes): keeping the step's"
            " gradients for 'forward' would need %.2f GiB more than the %.2f GiB of RAM available.",
            plan.added / 2**30, available / 2**30,
        )  # fmt: skip
        schedule = "norm-first"
        engine = make(nvme)
        plan = engine.host_plan(stored, activations)
    if (
        options.optimizer_offload == "auto"
        and options.nvme_path is not None
        and engine.optimizer is not None
        and not engine.optimizer.is_sgd
        and plan.added > available
    ):
        log.info(
            "SlideFormer keeps the optimizer state on NVMe (%s): in RAM the run would need %.2f GiB more than"
            " the %.2f GiB available.", options.nvme_path, plan.added / 2**30, available / 2**30,
        )  # fmt: skip
        engine = make(options.nvme_path)
        plan = engine.host_plan(stored, activations)
    return engine, plan


@dataclass(frozen=True)
class Machine:
    """What a plan may use: this machine's figures (the strategy) or given ones (``slide plan``)."""

    device: int | None  # device bytes the run may use; None: the CPU, without a budget
    host: int  # RAM the run may still take
    memlock: int | None = None  # ulimit -l; None: unlimited
    disk: int | None = None  # free at nvme_path; None: no NVMe
    disk_held: int = 0  # at nvme_path, by other runs' state


@dataclass(frozen=True)
class UnitPlacement:
    name: str
    params: int
    weights: Literal["gpu", "stream"]
    optimizer: Literal["gpu", "cpu", "nvme", "none"]  # "none": nothing of it is trained


@dataclass
class Plan:
    """Where every unit of a run lives, its figures, and why it does not fit (``error``, raised by the strategy)."""

    tier: Tier
    schedule: str | None  # the update schedule of a streamed run
    units: list[UnitPlacement]
    device_bytes: int  # the device's peak, the allocator's reserve included
    host: HostPlan | None  # a streamed run's host memory
    offloaded_blocks: int = 0
    kept_attention_bytes: int = 0  # of device_bytes, the blocks' kept attention outputs (kept_attention.py)
    predicted_step_s: float | None = None
    processes: int = 1  # of the node, each planned alike: its host and disk figures are one process's
    device: str = "cuda"  # the device type it computes on
    error: Exception | None = None
    engine: SlideEngine | None = None  # a streamed run's engine, not yet set up

    @property
    def deferred_blocks(self) -> int:
        """Blocks whose updates run during the next forward (schedule "backward"), the delayed ones aside."""
        return len(set(self.engine.deferred) - set(self.engine.delayed)) if self.engine is not None else 0

    @property
    def delayed_blocks(self) -> int:
        """Blocks whose updates are one step late (``delay.py``)."""
        return len(self.engine.delayed) if self.engine is not None else 0

    @property
    def fits(self) -> bool:
        return self.error is None

    def to_json(self) -> dict[str, Any]:
        """The plan's figures: the GPU's of one process, the host's and the disk's of the node (all its processes)."""
        host = (self.host.masters + self.host.added) * self.processes if self.host is not None else 0
        return {
            "fits": self.fits, "reason": str(self.error) if self.error else self.tier.reason,
            "placement": "resident" if self.tier.resident else "stream", "schedule": self.schedule,
            "processes": self.processes, "tokens_per_batch": self.tier.tokens, "gpu_bytes": self.device_bytes,
            "host_bytes": host, "disk_bytes": self.host.disk * self.processes if self.host is not None else 0,
            "offloaded_blocks": self.offloaded_blocks, "deferred_blocks": self.deferred_blocks,
            "delayed_blocks": self.delayed_blocks, "kept_attention_bytes": self.kept_attention_bytes,
            "predicted_step_s": self.predicted_step_s,
            "units": [vars(u) for u in self.units],
        }  # fmt: skip

    def table(self) -> str:
        """The plan as text: a line of figures, then one row per unit (consecutive alike units as one row)."""
        data = self.to_json()
        step = f"{self.predicted_step_s:.3g} s" if self.predicted_step_s is not None else "unknown"
        node = f" (the node's {self.processes} processes)" if self.processes > 1 else ""
        tokens = f" tokens per batch: {self.tier.tokens};" if self.tier.tokens is not None else ""
        device = "GPU" if self.device == "cuda" else f"device ({self.device})"
        lines = [
            f"placement: {data['placement']} ({self.tier.reason}); schedule: {self.schedule or 'plain'};{tokens}"
            f" {device} {self.device_bytes / GIB:.2f} GiB, host {data['host_bytes'] / GIB:.2f} GiB, disk"
            f" {data['disk_bytes'] / GIB:.2f} GiB{node}; offloaded blocks: {self.offloaded_blocks};"
            f"{f' blocks updated during the next forward: {self.deferred_blocks};' if self.deferred_blocks else ''}"
            f"{f' blocks updated a step late: {self.delayed_blocks};' if self.delayed_blocks else ''}"
            f"{f' kept attention outputs: {kept / GIB:.2f} GiB;' if (kept := self.kept_attention_bytes) else ''}"
            f" predicted step: {step}",
        ]
        rows: list[list] = []
        for u in self.units:
            if rows and rows[-1][1:] == [u.params, u.weights, u.optimizer]:
                rows[-1][0] = rows[-1][0].split(" .. ")[0] + " .. " + u.name
            else:
                rows.append([u.name, u.params, u.weights, u.optimizer])
        width = max([40] + [len(name) for name, *_ in rows])
        lines.append(f"{'unit':<{width}} {'params':>14} {'weights':>8} {'optimizer':>9}")
        lines += [
            f"{name:<{width}} {params:>14,} {weights:>8} {optimizer:>9}" for name, params, weights, optimizer in rows
        ]
        if self.error is not None:
            lines.append(f"does not fit: {self.error}")
        return "\n".join(lines)


def make_plan(run: Run, tokens: int | None, machine: Machine, logits_built: bool, rates: Rates = Rates()) -> Plan:
    """The run's plan: the resident tier when the whole run fits the device, else the engine that streams it, with
    its window, the block inputs it will offload (predicted from the tokens per batch, as the engine decides them at
    the first step) and its host memory. Nothing is allocated."""
    module, layout, optimizer, options = run.module, run.layout, run.optimizer, run.options
    tier = choose_tier(run, tokens, machine.device, logits_built)
    work = _work(module, layout, optimizer, tokens, run.trainer.accumulate_grad_batches)
    if tier.resident:
        units = [UnitPlacement(n, p, "gpu", "gpu" if t else "none") for n, p, t in _layout_units(module, layout)]
        step = predict_step_s(work, None, rates) if work is not None else None
        return Plan(tier, None, units, tier.need, None, predicted_step_s=step, device=run.device.type)

    def engine_and_host(activations: int, resident=(), deferred=0, delayed=0) -> tuple[SlideEngine, HostPlan]:
        engine, host = choose_engine(run, machine.host, activations, resident, deferred, delayed)
        if options.num_slots is None:
            engine.num_slots = window_slots(engine.device_bytes(3), machine.device)
        return engine, host

    engine, host = engine_and_host(0)
    saved = tokens * layout.embedding[1].embedding_dim * 4 if tokens and layout.embedding else 0  # fp32 residual
    loss, queue, working = (
        loss_bytes(layout, tokens, logits_built, retained=engine.schedule == "norm-first"),
        options.config.max_queued_grad_bytes,
        WORKING_INPUTS * saved,
    )

    def rows(engine: SlideEngine) -> int:
        # at most a row per token: its gradient, value and optimizer state, updated on the device (embedding.py)
        on_device = engine.schedule == "forward" and options.config.device_row_update and optimizer is not None
        if engine.embedding is None or not on_device or not tokens:
            return 0
        return tokens * engine.embedding.params[0].shape[1] * 4 * (2 + state_per_fp32(optimizer))

    offloaded, planned = 0, None
    cuda = machine.device is not None and run.device.type == "cuda"  # "auto" offloads nothing on the CPU
    if saved and (options.offload_activations is True or (options.offload_activations == "auto" and cuda)):
        room = machine.device - engine.device_bytes() if machine.device is not None else None
        asked = len(engine.blocks) if options.offload_activations is True else None
        can_tile = any(gated_mlp(u.module) is not None for u in engine.blocks)
        # beside the kept inputs and one block at work: the loss's workspace where it is larger, else the queue
        reserved = DEVICE_RESERVE + max(queue, loss - working)
        offloaded, tiling = plan_offload(saved, blocks=len(engine.blocks), offloading=asked, budget=room,
                                         reserved=reserved, can_tile=can_tile)  # fmt: skip
        planned = (saved, offloaded, tiling)
        working = (TILED_WORKING_INPUTS if tiling else WORKING_INPUTS) * saved
        if offloaded:
            engine, host = engine_and_host(saved * offloaded)
    kept = saved * (len(layout.blocks) - offloaded)

    def peaks(engine: SlideEngine) -> DevicePeaks:
        fixed = engine.device_bytes() + DEVICE_RESERVE
        return DevicePeaks(fixed + kept + loss, fixed + kept + working + queue, fixed + queue + rows(engine))

    device = peaks(engine)
    after_fit_short = False  # a unit the device could keep whose optimizer state the host could not take after fit

    def after_fit(engine: SlideEngine, host: HostPlan) -> int:
        # what the host holds once Lightning's teardown has brought the kept units' optimizer state to it
        return host.optimizer_state + _resident_state_bytes(engine)

    # "norm-first" streams every update; where the host's shortage chose it, the units kept on the device may leave
    # room for "forward" (each trial engine is chosen with them). The host must hold their state after fit too.
    if options.placement == "auto" and machine.device is not None and run.schedule != "norm-first":
        resident: list[tuple[str, nn.Module]] = []
        held = DevicePeaks(0, 0, 0)
        for group in _resident_candidates(engine):
            trial, trial_host = engine_and_host(saved * offloaded, resident + [(u.name, u.module) for u in group])
            cost = _resident_peaks(run, group)
            short = after_fit(trial, trial_host) > machine.host
            after_fit_short |= short
            if short or (peaks(trial) + held + cost).peak > usable_device_bytes(machine.device):
                if group[0] in engine.blocks:
                    break  # the next blocks are no smaller
                continue
            resident += [(u.name, u.module) for u in group]
            held += cost
        if resident:
            kept_engine, kept_host = engine_and_host(saved * offloaded, resident)
            kept_device = peaks(kept_engine) + (held if kept_engine.resident else DevicePeaks(0, 0, 0))
            short = after_fit(kept_engine, kept_host) > machine.host
            after_fit_short |= short
            if kept_device.peak <= usable_device_bytes(machine.device) and not short:
                engine, host, device = kept_engine, kept_host, kept_device
    processes = options.shared.size if options.shared is not None else 1
    if options.delayed_update and engine.optimizer is not None:
        engine, host = _with_delay(engine, host, work, lambda k: engine_and_host(saved * offloaded,
                                   engine.resident_named, delayed=k), run, machine, rates, cuda)  # fmt: skip
    elif cuda and work is not None and options.config.deferred_updates == "auto" and options.world is None:
        # the CPU worker idles through the forward: the first blocks' updates can run there (rates.py)
        deferred = overlap.deferral(engine, _streamed_work(work, engine, host), rates)
        if deferred:
            trial, trial_host = engine_and_host(saved * offloaded, engine.resident_named, deferred)
            fits = _shortfall(trial, trial_host, machine) is None
            if trial.deferred and fits and trial.nvme_path == engine.nvme_path:  # their gradients, not NVMe's pace
                engine, host = trial, trial_host
    engine.offload.planned = planned
    kept_attention = 0
    if cuda and tokens and engine.kept_attention.enabled:  # (the on-device blocks' attention outputs, room allowing)
        per_block = tokens * kept_bytes_per_token(layout.pretrained, run.dtype.itemsize)
        room = max(0, usable_device_bytes(machine.device) - device.peak)
        kept_attention = min(len(engine.blocks) - offloaded, room // per_block) * per_block if per_block else 0
        engine.kept_attention.planned_room = kept_attention
        device += DevicePeaks(kept_attention, kept_attention, 0)
    plan = Plan(tier, engine.schedule, _placements(engine), device.peak, host, offloaded, kept_attention,
                processes=processes, device=run.device.type, engine=engine)  # fmt: skip
    if work is not None:
        plan.predicted_step_s = predict_step_s(_streamed_work(work, engine, host), engine.schedule, rates)
    plan.error = _shortfall(engine, host, machine)
    if isinstance(plan.error, MemoryError) and after_fit_short:
        plan.error = MemoryError(
            f"{plan.error} Keeping units on the GPU would spare RAM while training, but after fit Lightning's teardown"
            " brings their optimizer state back to the host, which cannot hold it then."
        )
    if plan.error is None and cuda and device.peak > machine.device:
        plan.error = _device_shortfall(device.peak, machine.device, tokens, offloaded == len(layout.blocks))
    return plan


@dataclass(frozen=True)
class DevicePeaks:
    """Device bytes of a streamed step at its three peaks: at the loss (every kept block input, the loss's workspace),
    with one block at work in backward (the kept inputs, its working memory, the gradients queued to leave) and in
    the update (the activations freed)."""

    loss: int
    backward: int
    update: int

    def __add__(self, other: DevicePeaks) -> DevicePeaks:
        return DevicePeaks(self.loss + other.loss, self.backward + other.backward, self.update + other.update)

    @property
    def peak(self) -> int:
        return max(self.loss, self.backward, self.update)


def _streamed_work(work: Work, engine: SlideEngine, host: HostPlan) -> Work:
    # the CPU steps, and the weights that travel, are the streamed units' only
    units = _placements(engine)
    rows_only = engine.embedding.name if engine.embedding is not None else None  # its rows travel, not its weights
    travel = sum(u.params for u in units if u.weights == "stream" and u.name != rows_only)
    trainable = engine.streamed_trainable() if engine.optimizer is not None else set()
    share = engine.shared.size if engine.shared is not None else 1
    deferred = overlap.trained(engine.deferred, trainable)
    delayed = overlap.trained(engine.delayed, trainable)
    bf16 = engine.optimizer is not None and engine.optimizer.state_dtype == torch.bfloat16
    return replace(work, streamed=travel, trained=sum(p.numel() for p in trainable), bf16_state=bf16,
                   bf16_grads=bf16 and engine.compute_dtype == torch.bfloat16,
                   disk_state_bytes=2 * host.disk, processes=share, share=share, deferred=deferred[0],
                   deferred_matmul=deferred[1], delayed=delayed[0], delayed_matmul=delayed[1])  # fmt: skip


def _with_delay(engine, host, work, trial, run: Run, machine: Machine, rates: Rates, cuda: bool):
    # the delayed blocks: as many as the fastest predicted step takes (all of them on the CPU), fewer where the host
    # cannot hold their copies
    asked = run.options.config.delayed_blocks
    if asked != "auto":
        return trial(asked)
    count = len(engine.blocks)
    if cuda and work is not None:
        count = overlap.delay(engine, _streamed_work(work, engine, host), rates)
        if not count:
            log.info("SlideFormer updates every block exactly (delayed_update=True): the GPU sets the step's pace.")
            return engine, host
    while count:
        delayed, delayed_host = trial(count)
        if _shortfall(delayed, delayed_host, machine) is None:
            return delayed, delayed_host
        count //= 2
    log.warning("SlideFormer updates every block exactly (delayed_update=True): the host has no room for a copy of"
                " the delayed blocks' weights.")  # fmt: skip
    return engine, host


def _resident_peaks(run: Run, group: list[Unit]) -> DevicePeaks:
    # a group kept on the device: autocast's copies through the forward, the optimizer's temporaries in the update
    params = list(dict.fromkeys(p for u in group for p in u.params))
    copies = run.dtype.itemsize if run.dtype != torch.float32 else 0
    cost = plain_training_bytes(params, run.optimizer, copies_itemsize=copies, stored=run.stored,
                                bf16_state=run.options.optimizer_state == "bf16")  # fmt: skip
    return DevicePeaks(cost.held + cost.copies, cost.held, cost.held + cost.temporaries)


def _placements(engine: SlideEngine) -> list[UnitPlacement]:
    # the modules on the device (a parameter shared by two of them counted once), then the streamed units
    units, seen = [], set()
    for name, m in engine.resident_named:
        params = [p for p in m.parameters() if p not in seen]
        seen.update(params)
        trained = "gpu" if any(p.requires_grad for p in params) else "none"
        units.append(UnitPlacement(name, sum(p.numel() for p in params), "gpu", trained))
    return units + [
        UnitPlacement(u.name, sum(p.numel() for p in u.owned()), "stream",
                      ("nvme" if engine.nvme_path else "cpu") if any(u.trainable) else "none")
        for u in in_forward_order(engine.embedding, engine.blocks, engine.head, engine.leftovers)
    ]  # fmt: skip


def _resident_candidates(engine: SlideEngine) -> list[list[Unit]]:
    # what could live on the device, in this order: the units outside the blocks in forward order, each with those it
    # shares a parameter with (none that shares one with a block), then the blocks from the first, all but the last
    outside = in_forward_order(engine.embedding, [], engine.head, engine.leftovers)
    shared = engine.shared_params()
    in_blocks = {p for u in engine.blocks for p in u.params}
    groups: list[list[Unit]] = []
    for unit in outside:
        if any(unit in g for g in groups) or in_blocks & set(unit.params):
            continue
        groups.append([u for u in outside if u is unit or set(u.params) & set(unit.params)])
    return groups + [[u] for u in engine.blocks[:-1] if not shared & set(u.params)]


def _resident_state_bytes(engine: SlideEngine) -> int:
    # the optimizer state of the trained parameters kept on the device, in the state's dtype
    optimizer = engine.optimizer
    if optimizer is None:
        return 0
    trained = [p for p in engine.resident_params if p.requires_grad]
    return sum(p.numel() * optimizer.state_dtype_of(p).itemsize for p in trained) * state_per_fp32(optimizer.optimizer)


def _shortfall(engine: SlideEngine, host: HostPlan, machine: Machine) -> Exception | None:
    # the first thing that does not fit, as the error the strategy raises
    try:
        check_window(engine.device_bytes(), machine.device, engine.num_slots, engine.device)
        check_host(host, machine.host, machine.memlock, machine.disk, machine.disk_held)
    except (MemoryError, OSError, torch.OutOfMemoryError) as err:
        if isinstance(err, MemoryError) and engine.shared is not None:  # a node's processes: whose figures these are
            return MemoryError(
                f"{err} These are each of this node's {engine.shared.size} processes' figures: each plans on its share"
                " of the RAM left, where the state is kept once; fewer processes per node need less."
            )
        return err
    return None


def _device_shortfall(peak: int, budget: int, tokens: int | None, all_offloaded: bool) -> torch.OutOfMemoryError:
    # the plan's device peak beyond the budget
    fix = "lower the tokens per micro-batch (batch size or sequence length; accumulate_grad_batches keeps the tokens"
    fix += " per optimizer step)"
    if not all_offloaded:
        fix = f"keep every block's input in RAM (SlideFormerStrategy(offload_activations=True)), or {fix}"
    return torch.OutOfMemoryError(
        f"SlideFormer's plan needs {peak / GIB:.2f} GiB of device memory at {tokens} tokens per batch (the window, the"
        f" kept block inputs, one block at work and the loss), {(peak - budget) / GIB:.2f} GiB more than the"
        f" {budget / GIB:.2f} GiB it may use: {fix}."
    )


def _layout_units(module: nn.Module, layout: Layout) -> list[tuple[str, int, bool]]:
    # (name, parameters, trained) of the embedding, each block, the head and the rest
    named = [*([layout.embedding] if layout.embedding else []), *layout.blocks, *([layout.head] if layout.head else [])]
    seen: set[nn.Parameter] = set()
    rows = []
    for name, part in named:
        params = [p for p in part.parameters() if p not in seen]
        seen.update(params)
        rows.append((name, sum(p.numel() for p in params), any(p.requires_grad for p in params)))
    rest = [p for p in module.parameters() if p not in seen]
    if rest:
        rows.append(("(other parameters)", sum(p.numel() for p in rest), any(p.requires_grad for p in rest)))
    return rows


def _work(
    module: nn.Module, layout: Layout, optimizer: Optimizer | None, tokens: int | None, micro: int
) -> Work | None:
    # what a step computes, for the predicted step time (``rates.py``); what it moves is the streamed units' (make_plan)
    if tokens is None or optimizer is None:
        return None
    inside = {m for _, b in layout.blocks for m in b.modules()}
    linear = [m for m in module.modules() if isinstance(m, nn.Linear)]
    block = sum(m.weight.numel() for m in linear if m in inside)
    other = sum(m.weight.numel() for m in linear if m not in inside)
    return Work(tokens, micro, block, other, streamed=0, trained=0, disk_state_bytes=0)
