"""The memory plan of a SlideFormer run, computed before anything is pinned or allocated: pure arithmetic on what it
is given (the machine's figures come from ``machine.py``), checked against the RAM the process may still take and the
locked-memory limit (``ulimit -l``) for pinned buffers.

What the run adds to the host on top of the model it was given (whose parameters are already in RAM):
optimizer state (AdamW/Adam: 8 bytes per trainable parameter, +4 with amsgrad; SGD with momentum: 4), retained
gradients (4 bytes per trainable parameter with the "forward" schedule or gradient accumulation, 2 for those kept in
bf16), the landing buffers of gradients in flight, and, while the masters are pinned unit by unit, one unit's copy
at a time.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch import nn

from ..kernels.linear_cross_entropy import tuning, workspace_bytes
from .machine import size_text
from .nvme import page_aligned, row_numel, rows_per_block

GIB = 2**30


@dataclass(frozen=True)
class HostPlan:
    """Host bytes of a run, by purpose."""

    masters: int  # parameters as stored on the host (frozen matrices in bf16 when they are stored so)
    optimizer_state: int
    retained_grads: int
    landing: int
    largest_unit: int  # the transient copy while a unit's masters move into pinned memory
    pinned: int  # of the above, what must be page-locked (CUDA only)
    disk: int = 0  # optimizer state (and masters) in files (the NVMe tier); optimizer_state is then what is read in
    # at once
    activations: int = 0  # block inputs offloaded to the host between forward and backward
    delayed_weights: int = 0  # the delayed blocks' weights of the step before (delay.py)

    @property
    def added(self) -> int:
        """What the run allocates beyond the model already in memory."""
        parts = (self.optimizer_state, self.retained_grads, self.landing, self.largest_unit, self.activations)
        return sum(parts) + self.delayed_weights

    def describe(self) -> str:
        rows = [("parameters (masters)", self.masters), ("optimizer state", self.optimizer_state),
                ("retained gradients", self.retained_grads), ("gradient landing buffers", self.landing)]  # fmt: skip
        rows += [("offloaded activations", self.activations)] if self.activations else []
        rows += [("delayed blocks' weights", self.delayed_weights)] if self.delayed_weights else []
        text = ", ".join(f"{name} {size / GIB:.2f} GiB" for name, size in rows)
        disk = f"; {self.disk / GIB:.2f} GiB of optimizer state (and masters) on disk" if self.disk else ""
        return f"host memory plan: {text}; {self.pinned / GIB:.2f} GiB of it pinned{disk}"


def plan_host(
    units: list[list[nn.Parameter]],
    optimizer: torch.optim.Optimizer | None,
    *,
    retained: Collection[nn.Parameter] = frozenset(),
    landing_bytes: int,
    compact_grads: set[nn.Parameter] = frozenset(),
    pinned: bool,
    frozen_bytes_per_element: dict[nn.Parameter, int] | None = None,
    state_block_numel: int | None = None,
    read_ahead_bytes: int = 0,
    disk_masters: list[nn.Parameter] = (),
    activations: int = 0,
    share: int = 1,
    state_itemsize: int = 4,
    delayed_weights: int = 0,
) -> HostPlan:
    """The host plan for ``units`` (each the parameters it owns) trained with ``optimizer``.

    Args:
        retained: parameters whose gradients wait on the host for their update (accumulation, clipping, deferred
            updates).
        compact_grads: parameters whose retained gradients are kept in bf16.
        frozen_bytes_per_element: element sizes that parameters will be stored with, where they differ from now.
        state_block_numel: with the optimizer state on disk, the elements of its row blocks (``None``: in RAM).
        read_ahead_bytes: with the optimizer state on disk, what its store reads ahead at most.
        disk_masters: parameters whose fp32 masters are on disk too, in the state's blocks (their copy in RAM is
            given by ``frozen_bytes_per_element``).
        activations: host bytes of block inputs offloaded between forward and backward.
        share: the node's processes that hold the masters, the optimizer state and the retained gradients once, in
            shared memory (``shared_host.py``; the state on disk, in files of their own): each process's part of them
            is planned.
        state_itemsize: bytes per element of the optimizer state (2: ``optimizer_state="bf16"``).
        delayed_weights: host bytes of the delayed blocks' copies (pinned).
    """
    sizes = frozen_bytes_per_element or {}

    def stored(p: nn.Parameter) -> int:
        return p.numel() * sizes.get(p, p.element_size())

    params = [p for unit in units for p in unit]
    masters = sum(stored(p) for p in params)
    groups = optimizer.param_groups if optimizer is not None else []
    # frozen: no state, no grads; parameters of no unit (resident on the device): nothing on the host
    trainable = {p for group in groups for p in group["params"] if p.requires_grad} & set(params)
    per = state_per_fp32(optimizer) if optimizer is not None else 0
    state = sum(p.numel() for p in trainable) * state_itemsize * per
    disk = 0
    if state_block_numel is not None:
        # on disk: all of it, in 4 KiB regions; in RAM: what is read ahead, as much again waiting to be written (the
        # reads queued behind those writes gate the next updates), and the block being updated
        disk = sum(page_aligned(p.numel() * state_itemsize) for p in trainable) * per
        disk += sum(page_aligned(p.numel() * 4) for p in disk_masters)
        block = max((rows_per_block(p, state_block_numel) * row_numel(p) for p in trainable), default=0)
        state = min(state, block * (state_itemsize * per + 4 * bool(disk_masters)) + 2 * read_ahead_bytes)
    retained = sum(p.numel() * (2 if p in compact_grads else 4) for p in trainable & set(retained))
    largest = max((sum(stored(p) for p in unit) for unit in units), default=0)
    if share > 1:  # the masters move into shared memory unit by unit; each process's files hold its rows' state
        masters, retained, disk = masters // share, retained // share, disk // share
        state = state if state_block_numel is not None else state // share  # on disk: its own blocks in RAM
    locked = masters + retained + landing_bytes + activations + delayed_weights if pinned else 0
    return HostPlan(masters, state, retained, landing_bytes, largest if pinned else 0, locked, disk, activations,
                    delayed_weights)  # fmt: skip


def state_per_fp32(optimizer: torch.optim.Optimizer) -> int:
    """State tensors per parameter, each the size of an fp32 parameter."""
    groups = optimizer.param_groups
    if isinstance(optimizer, torch.optim.SGD):
        return 1 if any(g.get("momentum") for g in groups) else 0
    return 3 if any(g.get("amsgrad") for g in groups) else 2


def check_host(
    plan: HostPlan, available: int, memlock: int | None, disk_free: int | None = None, disk_held: int = 0
) -> None:
    """Raise a clear error if the plan does not fit the machine (``disk_held``: bytes other runs' state holds at
    nvme_path)."""
    if disk_free is not None and plan.disk > disk_free:
        others = f" ({size_text(disk_held)} more is held by other running SlideFormer runs' state)" if disk_held else ""
        raise OSError(
            f"The optimizer state needs {size_text(plan.disk)} at nvme_path but only {size_text(disk_free)} is free"
            f" there{others}. Free disk space, or give nvme_path a larger disk."
        )
    if plan.added > available:
        retained = (
            f" or keep the step's gradients out of RAM ({plan.retained_grads / GIB:.2f} GiB; gradient"
            " accumulation and update_schedule='forward' keep them there): drop accumulation, and clip with"
            " update_schedule='norm-first';"
            if plan.retained_grads
            else ""
        )
        # negative where what is already loaded (the model) exceeds the RAM the run may take
        left = (
            f"only {available / GIB:.2f} GiB is"
            if available >= 0
            else f"the memory in use is {-available / GIB:.2f} GiB over what is"
        )
        raise MemoryError(
            f"SlideFormer needs {plan.added / GIB:.2f} GiB more host memory but {left}"
            f" available ({plan.describe()}). Move the optimizer state to disk (SlideFormerStrategy(nvme_path=...)"
            " or $SLIDE_NVME_PATH: optimizer_offload='auto' then puts it there), train fewer parameters (LoRA:"
            f" CausalLMModule(lora=...)),{retained} or free RAM."
        )
    if memlock is not None and plan.pinned > memlock:
        raise MemoryError(
            f"SlideFormer pins {plan.pinned / GIB:.2f} GiB of host memory, but the locked-memory limit (ulimit -l)"
            f" is {memlock / GIB:.2f} GiB. Raise it (`ulimit -l unlimited`, or memlock in"
            " /etc/security/limits.conf) and start again."
        )


# One block at work in backward, in units of its saved input (tokens x hidden, fp32 residual stream): its recompute
# and backward (the MLP's bf16 intermediates, ~3.5x the hidden width each, attention's q/k/v/o, the norms, their
# gradients), its input and the next one's fetched ahead, and the gradient flowing in. Fitted to the Llama-3.1-8B
# shape at 32k tokens (benchmarks/NOTES.md, "Activation memory").
WORKING_INPUTS = 19
# The same with the MLP on slices of the tokens (tiling.py): fitted to the Llama-3.1-8B shape at 64k tokens with every
# input offloaded, 18.3 GiB allocated (benchmarks/NOTES.md, "The GPU tier measured").
TILED_WORKING_INPUTS = 15
_DEVICE_MARGIN = 0.95  # of the budget: the allocator's rounding and fragmentation


def _room_for_inputs(saved_bytes: int, budget: int, reserved_bytes: int) -> int:
    # what ``budget`` leaves for kept inputs after one block at work and ``reserved_bytes``; negative: not even that
    return int(budget * _DEVICE_MARGIN) - reserved_bytes - WORKING_INPUTS * saved_bytes


def blocks_to_offload(saved_bytes: int, blocks: int, budget: int | None, reserved_bytes: int) -> int:
    """How many blocks must keep their saved inputs (``saved_bytes`` each) in host memory so that the others',
    one block at work and ``reserved_bytes`` (gradients queued to leave) fit ``budget``; 0 off CUDA."""
    if budget is None or saved_bytes == 0:
        return 0
    room = _room_for_inputs(saved_bytes, budget, reserved_bytes)
    return blocks - min(blocks, max(0, room // saved_bytes))


def kept_room(saved_bytes: int, on_device: int, budget: int | None, reserved_bytes: int) -> int | None:
    """Device bytes left beside the saved inputs (``saved_bytes`` each) of the ``on_device`` blocks that keep them
    there, one block at work and ``reserved_bytes`` in ``budget``: the room for kept attention outputs
    (``kept_attention.py``); ``None`` off CUDA (no bound)."""
    if budget is None:
        return None
    return max(0, _room_for_inputs(saved_bytes, budget, reserved_bytes) - on_device * saved_bytes)


def tiling_needed(saved_bytes: int, budget: int | None, reserved_bytes: int) -> bool:
    """Whether one block at work does not fit ``budget`` even with every saved input offloaded (its MLP must then
    run on slices of the tokens, ``tiling.py``)."""
    return budget is not None and _room_for_inputs(saved_bytes, budget, reserved_bytes) < 0


def check_window(need: int, budget: int | None, num_slots: int, device: torch.device) -> None:
    """Refuse a window (``need`` bytes of ``num_slots`` block slots, the head and staging) beyond the device
    ``budget``."""
    if budget is not None and need > budget:
        fix = "Lower SlideFormerStrategy(num_slots=...) (minimum 2) or free" if num_slots > 2 else "Free"
        raise torch.OutOfMemoryError(
            f"SlideFormer needs {need / GIB:.2f} GiB on {device} for its window of {num_slots} block slots, the head"
            f" and staging, but only {budget / GIB:.2f} GiB is free. {fix} GPU memory (other processes, or a lower"
            " torch.cuda.set_per_process_memory_fraction cap)."
        )


def window_slots(three_slots_bytes: int, budget: int | None) -> int:
    """The window for ``num_slots="auto"``: 3 slots (one computing, the next two arriving) when a window of 3 (head
    and staging included) takes at most a quarter of the GPU ``budget``, else 2; 3 off CUDA."""
    return 3 if budget is None or 4 * three_slots_bytes <= budget else 2


# Bytes a block saves per token for plain training's backward: each Linear's input and output in the compute dtype,
# 1.5 times over (activation functions, attention and casts save their own), and 8 bytes per element of the block's
# vectors (the fp32 residual stream around each norm). Fitted on the H200 (benchmarks/NOTES.md, "The resident tier").
_LINEAR_SAVES = 1.5
_VECTOR_SAVES = 8
# Bytes per token and vocabulary entry of a head that builds logits: bf16 logits, their fp32 copy and its gradient.
_LOGIT_BYTES = 12
# What kernels take beside the tensors counted: Triton's autotuning (a 256 MB buffer that clears the L2 cache) and
# cuBLAS workspaces (measured on the H200: benchmarks/NOTES.md, "The resident tier").
DEVICE_RESERVE = 384 << 20


def plain_activation_bytes(blocks: list[nn.Module], itemsize: int, logits: int = 0) -> float:
    """Device bytes per token that plain training keeps between forward and backward through ``blocks``, with
    activations of ``itemsize`` bytes and a head building ``logits`` entries per token (0: a loss without logits)."""
    per_token = 0.0
    for block in blocks:
        linear = sum(m.in_features + m.out_features for m in block.modules() if isinstance(m, nn.Linear))
        vectors = sum(p.numel() for p in block.parameters() if p.dim() == 1)
        per_token += _LINEAR_SAVES * itemsize * linear + _VECTOR_SAVES * vectors
    return per_token + _LOGIT_BYTES * logits


def fused_loss_bytes(tokens: int, vocab: int, hidden: int, retained: bool = False) -> int:
    """Device bytes of the logits-free loss (``kernels/linear_cross_entropy.py``) at its largest, in bf16: the walk
    a training step takes (one pass, unless tuned off); ``retained``: a backward pass keeps the graph (norm-first)."""
    return workspace_bytes(tokens, vocab, hidden, 2, one_pass=tuning.value.one_pass is not False, retained=retained)


@dataclass(frozen=True)
class TrainingBytes:
    """Device bytes of parameters trained on the device (``plain_training_bytes``), by when they are held."""

    held: int  # the parameters as stored, their gradients and the optimizer's state: all step long
    copies: int  # the compute-dtype copies autocast makes of the matrices: through the forward
    temporaries: int  # the optimizer step's: while it runs

    @property
    def total(self) -> int:
        return self.held + self.copies + self.temporaries


def plain_training_bytes(
    params: list[nn.Parameter],
    optimizer: torch.optim.Optimizer | None,
    *,
    copies_itemsize: int,
    stored: dict[nn.Parameter, int] | None = None,
    bf16_state: bool = False,
) -> TrainingBytes:
    """Device bytes of ``params`` trained on the device (activations apart): each parameter as stored, the
    compute-dtype copies autocast makes of the wider matrices (``copies_itemsize``; 0 under fp32), and for each
    trainable one its gradient, the optimizer's state and, unless the optimizer is fused, as much again as the
    gradients for the step's temporaries (torch's foreach implementations). ``bf16_state``: the engine steps the fp32
    ones (``optimizer_state="bf16"``): bf16 moments, updated in place."""
    sizes = stored or {}
    weights = sum(p.numel() * sizes.get(p, p.element_size()) for p in params)
    copies = sum(
        p.numel() * copies_itemsize for p in params if p.dim() >= 2 and sizes.get(p, p.element_size()) > copies_itemsize
    )
    if optimizer is None:
        return TrainingBytes(weights, copies, 0)
    trainable = {p for g in optimizer.param_groups for p in g["params"] if p.requires_grad} & set(params)
    stored_size = {p: sizes.get(p, p.element_size()) for p in trainable}
    engine_stepped = {p for p in trainable if bf16_state and stored_size[p] == 4}
    grads = sum(p.numel() * stored_size[p] for p in trainable)
    state = sum(p.numel() * (2 if p in engine_stepped else stored_size[p]) for p in trainable)
    fused = all(g.get("fused") for g in optimizer.param_groups)
    temporaries = 0 if fused else sum(p.numel() * stored_size[p] for p in trainable - engine_stepped)
    return TrainingBytes(weights + grads + state * state_per_fp32(optimizer), copies, temporaries)


def usable_device_bytes(budget: int) -> int:
    """What a device ``budget`` holds after the allocator's rounding and fragmentation."""
    return int(budget * _DEVICE_MARGIN)
