"""Units: the groups of parameters that travel to the device together, how a model splits into them, and the device
memory they land in."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager

import torch
from torch import Tensor, nn


class BoundaryError(RuntimeError):
    """A tensor or a parameter crosses a streamed module's boundary where no gradient could follow it
    (``collect_units``, ``guard.py``)."""


class Unit:
    """One module whose parameters (its submodules' included) are streamed as a group: a transformer block, the
    embedding, the head, or a small leftover such as the final norm.

    The module's parameters stay the fp32 masters on the CPU. While the module computes, each of its
    parameter slots temporarily holds a device copy (``swapped``), so the module's own forward code runs
    unchanged and its parameter names never change.

    Args:
        name: the module's qualified name, used in messages.
        module: the module.
        compute_dtype: dtype of the device copies of matrices (bf16 under bf16-mixed); vectors (norm weights,
            biases) and embedding tables keep fp32, exactly as autocast would compute with them.
    """

    def __init__(self, name: str, module: nn.Module, compute_dtype: torch.dtype) -> None:
        self.name = name
        self.module = module
        self.forward = module.forward  # the original (bound) forward, called with swapped parameters
        self.entries: list[tuple[nn.Module, str, int]] = []  # (submodule, attribute, index into params)
        self.params: list[nn.Parameter] = []
        index: dict[nn.Parameter, int] = {}
        for sub in module.modules():
            for attr, param in sub._parameters.items():
                if param is None:
                    continue
                if param not in index:
                    index[param] = len(self.params)
                    self.params.append(param)
                self.entries.append((sub, attr, index[param]))
        # an embedding's table stays fp32, as autocast leaves a lookup
        tables = {i for sub, _, i in self.entries if isinstance(sub, nn.Embedding)}
        self.dtypes = [compute_dtype if p.dim() >= 2 and i not in tables else torch.float32
                       for i, p in enumerate(self.params)]  # fmt: skip
        self.trainable = [p.requires_grad for p in self.params]
        self.owner: list[Unit] = [self] * len(self.params)  # who streams each gradient (tied weights: one owner)
        self.update_done: Future | None = None  # the last scheduled update of the params this unit owns
        self.version = 0  # bumped whenever an update of any of its params is scheduled

    @property
    def master_bytes(self) -> int:
        """What one upload reads from the host."""
        return sum(p.numel() * p.element_size() for p in self.params)

    @property
    def numel(self) -> dict[torch.dtype, int]:
        sizes: dict[torch.dtype, int] = {}
        for p, dtype in zip(self.params, self.dtypes):
            sizes[dtype] = sizes.get(dtype, 0) + p.numel()
        return sizes

    def owners(self) -> list[Unit]:
        return list(dict.fromkeys(self.owner))

    def owned(self) -> list[nn.Parameter]:
        """The parameters whose gradients this unit streams and whose update it owns (a tied weight: one unit's)."""
        return [p for p, o in zip(self.params, self.owner) if o is self]

    def __repr__(self) -> str:
        return f"Unit({self.name})"


def replace_forward(module: nn.Module, forward: Callable) -> Callable[[], None]:
    """Make ``forward`` ``module``'s forward; returns a function that puts back what was there (a forward the user
    set on the instance, or none)."""
    previous = module.__dict__.get("forward")
    module.forward = forward

    def restore() -> None:
        if previous is None:
            module.__dict__.pop("forward", None)
        else:
            module.forward = previous

    return restore


def alias(t: Tensor) -> Tensor:
    """``t``'s memory under a tensor with a version counter of its own. A unit's device weights are views of one
    slot: through ``detach()`` an in-place op on one (a parametrization's ``set_``) would mark every other weight that
    autograd saved as modified."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        t.untyped_storage(), t.storage_offset(), t.shape, t.stride()
    )


@contextmanager
def swapped(unit: Unit, tensors: list[Tensor]) -> Iterator[None]:
    """Let ``unit.module`` compute with ``tensors`` in place of its parameters (restored on exit)."""
    saved = [(sub, attr, sub._parameters[attr]) for sub, attr, _ in unit.entries]
    for sub, attr, i in unit.entries:
        sub._parameters[attr] = tensors[i]
    try:
        yield
    finally:
        for sub, attr, param in saved:
            # a parametrization added and removed in the forward (peft's LoRA on a bare parameter) leaves the copy, not
            # a Parameter, as a buffer of that name
            sub._buffers.pop(attr, None)
            sub._parameters[attr] = param


class DeviceBuffer:
    """Pre-allocated device memory for one unit's weights at a time: a flat tensor per dtype, reused.

    ``ready`` marks the weights in place; ``free`` marks the end of the last computation reading them
    (both CUDA events, ``None`` on the CPU). ``tag`` says whose weights, at which version, it holds.
    """

    def __init__(self, sizes: dict[torch.dtype, int], device: torch.device) -> None:
        self.flat = {dtype: torch.empty(n, dtype=dtype, device=device) for dtype, n in sizes.items()}
        self.tag: tuple[Unit, int] | None = None
        self.ready: object | None = None
        self.free: object | None = None
        self._views: dict[Unit, list[Tensor]] = {}

    def views(self, unit: Unit) -> list[Tensor]:
        """One tensor per parameter of ``unit``, shaped like it, inside this buffer (cached)."""
        if unit not in self._views:
            offsets = dict.fromkeys(self.flat, 0)
            out = []
            for p, dtype in zip(unit.params, unit.dtypes):
                out.append(self.flat[dtype][offsets[dtype] : offsets[dtype] + p.numel()].view(p.shape))
                offsets[dtype] += p.numel()
            self._views[unit] = out
        return self._views[unit]


def max_sizes(units: list[Unit]) -> dict[torch.dtype, int]:
    """Per dtype, the largest need among ``units`` (the size of a ring slot that can hold any of them)."""
    sizes: dict[torch.dtype, int] = {}
    for unit in units:
        for dtype, n in unit.numel.items():
            sizes[dtype] = max(sizes.get(dtype, 0), n)
    return sizes


def collect_units(
    model: nn.Module,
    blocks: list[tuple[str, nn.Module]],
    compute_dtype: torch.dtype,
    embedding: tuple[str, nn.Embedding] | None = None,
    head: tuple[str, nn.Linear] | None = None,
    whole: list[tuple[str, nn.Module]] = (),
    resident: list[nn.Module] = (),
) -> tuple[Unit | None, list[Unit], Unit | None, list[Unit]]:
    """The units of ``model``: its embedding (fp32 rows), its blocks, its head, and every other outermost module that
    holds parameters of its own (the leftovers: the final norm, a plain model's pieces, and the ``whole`` modules),
    each with the modules inside it, with each shared parameter owned by one of them. The ``resident`` modules and
    what they hold stay out of every unit (they live on the device).

    Raises:
        BoundaryError: a leftover also holds blocks (its own parameters could not be streamed apart from them).
    """
    kept = {m for r in resident for m in r.modules()}
    embedding, head = (None if part is None or part[1] in kept else part for part in (embedding, head))
    blocks, whole = ([(n, m) for n, m in parts if m not in kept] for parts in (blocks, whole))
    emb = Unit(embedding[0], embedding[1], torch.float32) if embedding else None
    stack = [Unit(name, module, compute_dtype) for name, module in blocks]
    top = Unit(head[0], head[1], compute_dtype) if head else None
    named = [u for u in (emb, *stack, top) if u is not None]
    wholes = [Unit(name, module, compute_dtype) for name, module in whole]
    taken = {m for u in (*named, *wholes) for m in u.module.modules()} | kept
    unit_modules = {u.module: u for u in (*named, *wholes)}
    singles = []
    for name, m in model.named_modules():  # an outer module comes before the modules inside it
        own = [p for p in m._parameters.values() if p is not None]
        if m in taken or not own:
            continue
        nested = [unit_modules[sub] for sub in m.modules() if sub in unit_modules]
        if nested and set(own) <= {p for u in nested for p in u.params}:
            continue  # its own parameters stream with a unit inside it (BERT's head bias, tied)
        if nested or m is model:
            where = f"'{name}'" if name else "the LightningModule itself"
            raise BoundaryError(
                f"{where} registers parameters of its own and also holds streamed modules"
                f" ({[u.name for u in nested[:3]]}...). SlideFormer streams such parameters only from a leaf of the"
                " model: move them into a submodule (e.g. an nn.Linear) that the forward calls."
            )
        singles.append(Unit(name, m, compute_dtype))  # with the modules inside it: its forward may call them
        taken.update(m.modules())
    leftovers = wholes + singles
    # NOTE: a parameter used by several units (tied input/output embeddings) is owned by the first of them in forward
    # order, whose backward comes last; the others' gradients wait for it, so it moves and updates once with the sum.
    owner_of: dict[nn.Parameter, Unit] = {}
    for unit in in_forward_order(emb, stack, top, leftovers):
        for i, p in enumerate(unit.params):
            unit.owner[i] = owner_of.setdefault(p, unit)
    return emb, stack, top, leftovers


def in_forward_order(
    embedding: Unit | None, blocks: list[Unit], head: Unit | None, leftovers: list[Unit]
) -> list[Unit]:
    """All units in the order a causal LM's forward meets them."""
    return ([embedding] if embedding else []) + blocks + leftovers + ([head] if head else [])


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
