"""The autograd nodes of managed modules.

A managed module is one autograd node. Its forward runs the module's own code with the device copies of its
weights and keeps no graph, saving only its inputs (and a block's attention outputs, ``kept_attention.py``). Its
backward fetches the weights again, replays the forward with the RNG and autocast state of the first run (so dropout
draws the same mask; without the products nothing reads, ``dead_ends.py``, nor the attention's forward where its
outputs were kept), and takes the gradients of the inputs and of the weight copies; the weight gradients leave for
the CPU at once. Submodule outputs that leave the module by another way than its outputs (``guard.py``) are extra
outputs of the node.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.autograd import Function
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

from .activations import ActivationStash
from .dead_ends import DeadEnds
from .guard import Guard, Key, Site, extra_outputs, submodule_outputs
from .kept_attention import KeptAttention
from .rows import Contribution, Rows
from .units import Unit, alias, swapped


class UnitHost(Protocol):
    """What a managed module's node needs from the engine (``SlideEngine`` is one)."""

    device: torch.device
    dummy: Tensor  # requires grad: makes a unit's node run backward when only its weights need gradients
    activations: ActivationStash | None
    guard: Guard | None  # training only
    dead_ends: DeadEnds  # the layers the recompute leaves out
    kept_attention: KeptAttention  # the blocks whose forward keeps its attention outputs

    def acquire(self, unit: Unit, training: bool = False) -> list[Tensor]: ...

    def release(self, unit: Unit, *, forward: bool) -> None: ...

    def wants_grad(self, unit: Unit, index: int) -> bool: ...

    def offloads(self, unit: Unit, inputs: tuple[Tensor, ...]) -> bool: ...

    def after_backward(self, unit: Unit, grads: dict[int, Contribution]) -> None: ...


# KV-cache arguments must not reach a managed block: the recompute would append to the cache a second time.
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def run_block(engine: UnitHost, unit: Unit, *args, **kwargs) -> Any:
    """:func:`run_unit` for a block, without the KV cache its caller passes (``use_cache`` off)."""
    for key in _CACHE_KWARGS:
        if key in kwargs:
            kwargs[key] = None
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    return run_unit(engine, unit, args, kwargs)


def recomputed(forward, *args, **kwargs) -> Any:
    """A block kept on the device: it saves only its inputs for the backward and recomputes the rest, as a streamed
    one does."""
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


class RowsHost(Protocol):
    """What the embedding's node needs from the embedding's rows (``embedding.EmbeddingRows`` is one)."""

    unit: Unit

    def gather(self, ids: Tensor, *, training: bool = False) -> tuple[Tensor, Tensor, Tensor]: ...

    def after_backward(self, unit: Unit, grads: dict[int, Contribution]) -> None: ...


def head_loss(
    engine: UnitHost, unit: Unit, hidden: Tensor, target: Tensor, loss_fn, on_grad: Callable[[int, Tensor], None],
    **kwargs,
) -> Tensor:  # fmt: skip
    """``loss_fn(hidden, weight, target, bias=..., **kwargs)`` with the head ``unit``'s weights on the device.

    The head's weights stay in their own buffer from this forward to its backward, so the loss needs no recompute;
    each weight's gradient goes to ``on_grad(index, grad)`` as soon as the backward has produced it.
    """
    train = torch.is_grad_enabled()
    weights = [w.detach().requires_grad_(train and engine.wants_grad(unit, i)) for i, w in
               enumerate(engine.acquire(unit))]  # fmt: skip
    for i, w in enumerate(weights):
        if w.requires_grad:
            w.register_post_accumulate_grad_hook(partial(_leaf_grad, on_grad, i))
    by_name = {attr: weights[i] for sub, attr, i in unit.entries if sub is unit.module}
    loss = loss_fn(hidden, by_name["weight"], target, bias=by_name.get("bias"), **kwargs)
    engine.release(unit, forward=True)
    return loss


def _leaf_grad(on_grad: Callable[[int, Tensor], None], index: int, leaf: Tensor) -> None:
    grad, leaf.grad = leaf.grad, None
    on_grad(index, grad)


def run_unit(engine: UnitHost, unit: Unit, args: tuple, kwargs: dict) -> Any:
    """Call ``unit``'s module on ``args``/``kwargs`` with its weights on the device."""
    flat, spec = tree_flatten((args, kwargs))
    positions = [i for i, x in enumerate(flat) if isinstance(x, Tensor)]
    needs_graph = torch.is_grad_enabled() and (any(unit.trainable) or any(flat[i].requires_grad for i in positions))
    if not needs_graph:
        weights = engine.acquire(unit)
        with swapped(unit, weights):
            out = unit.forward(*args, **kwargs)
        engine.release(unit, forward=True)
        return out
    call = _Call(engine, unit, flat, spec, positions)
    outs = _UnitFunction.apply(call, engine.dummy, *[flat[i] for i in positions])
    flat_out = list(call.out_leaves)
    for pos, t in zip(call.out_positions, outs):
        flat_out[pos] = t
    return tree_unflatten(flat_out, call.out_spec)


class _Call:
    """One call of a managed module: what its autograd node needs to replay it."""

    def __init__(self, engine: UnitHost, unit: Unit, flat: list, spec: Any, positions: list[int]) -> None:
        self.engine, self.unit, self.spec, self.positions = engine, unit, spec, positions
        tensor_at = set(positions)
        self.leaves = [None if i in tensor_at else x for i, x in enumerate(flat)]
        device = engine.device
        self.device_type = device.type
        self.cpu_rng = torch.get_rng_state()
        self.device_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.autocast = torch.is_autocast_enabled(device.type)
        self.autocast_dtype = torch.get_autocast_dtype(device.type)
        self.out_spec: Any = None
        self.out_leaves: list = []
        self.out_positions: list[int] = []
        self.probe = engine.guard is not None and engine.guard.probing  # guard.py
        self.extra_keys: list[Key] = []  # the submodule outputs the node returns after the module's own

    def run(self, tensors: tuple[Tensor, ...] | list[Tensor], weights: list[Tensor]) -> Any:
        flat = list(self.leaves)
        for pos, t in zip(self.positions, tensors):
            flat[pos] = t
        args, kwargs = tree_unflatten(flat, self.spec)
        with swapped(self.unit, weights):
            return self.unit.forward(*args, **kwargs)

    def carried(self) -> set[Site] | None:
        """The submodule outputs the node returns (``None``: all it can, in the probe)."""
        if self.probe:
            return None
        guard = self.engine.guard
        return guard.carried.get(self.unit, set()) if guard is not None else set()

    @contextmanager
    def replay(self) -> Iterator[None]:
        """The RNG and autocast state of the forward, restored for the recompute (and the RNG put back after)."""
        devices = [self.engine.device] if self.device_rng is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu_rng)
            if self.device_rng is not None:
                torch.cuda.set_rng_state(self.device_rng, self.engine.device)
            with torch.autocast(self.device_type, dtype=self.autocast_dtype, enabled=self.autocast):
                yield


class _UnitFunction(Function):
    managed_node = True  # guard.py: a node of a streamed module

    @staticmethod
    def forward(ctx, call: _Call, dummy: Tensor, *tensors: Tensor) -> tuple[Tensor, ...]:
        engine, unit = call.engine, call.unit
        offload = engine.offloads(unit, tensors)  # decided before the first block runs (it may tile the MLPs)
        weights = engine.acquire(unit, training=True)
        with engine.kept_attention.recording(unit, offload) as records:
            if call.probe:  # with a graph, so the guard sees where every result leads (guard.py)
                needs = list(ctx.needs_input_grad[2:])
                wants = [engine.wants_grad(unit, i) for i in range(len(weights))]
                with engine.dead_ends.probing(unit):
                    out, found = engine.guard.probe(unit, call.run, list(tensors), needs, weights, wants)
            else:
                with submodule_outputs(unit.module, call.carried()) as found:
                    out = call.run(tensors, weights)
        engine.release(unit, forward=True)
        flat_out, call.out_spec = tree_flatten(out)
        call.out_positions = [i for i, x in enumerate(flat_out) if isinstance(x, Tensor)]
        call.out_leaves = [None if isinstance(x, Tensor) else x for x in flat_out]
        outs = tuple(flat_out[i] for i in call.out_positions)
        extras = extra_outputs(found, outs, tensors, probe=call.probe)
        if call.probe:
            passed = {id(t) for t in tensors}  # an argument returned as it is was not made here
            made = [o for o in outs if o.requires_grad and id(o) not in passed]
            engine.guard.check_node(unit, made + list(extras.values()))
        call.extra_keys = list(extras)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        ctx.call = call
        ctx.kept = engine.kept_attention.keep(unit, records)
        if offload:
            ctx.offloaded = engine.activations.save(tensors)  # kept in host memory until the backward
        else:
            ctx.save_for_backward(*tensors)
        return (*outs, *extras.values())

    @staticmethod
    def backward(ctx, *grad_outs: Tensor | None) -> tuple[Tensor | None, ...]:
        call: _Call = ctx.call
        engine, unit = call.engine, call.unit
        saved = engine.activations.load(ctx.offloaded) if hasattr(ctx, "offloaded") else ctx.saved_tensors
        inputs = [t.detach().requires_grad_(need) for t, need in zip(saved, ctx.needs_input_grad[2:])]
        weights = engine.acquire(unit, training=True)
        weights = [alias(w).requires_grad_(engine.wants_grad(unit, i)) for i, w in enumerate(weights)]
        sites = {(path, leaf) for path, _, leaf in call.extra_keys}
        with (
            torch.enable_grad(),
            call.replay(),
            submodule_outputs(unit.module, sites) as found,
            engine.dead_ends.skipped(unit),
            engine.kept_attention.replaying(ctx.kept),
        ):
            out = call.run(inputs, weights)
        flat_out = tree_flatten(out)[0]
        grad_extras = grad_outs[len(call.out_positions) :]
        pairs = [
            (flat_out[pos], g)
            for pos, g in zip(call.out_positions, grad_outs)
            if g is not None and flat_out[pos].requires_grad
        ]
        for key, g in zip(call.extra_keys, grad_extras):
            if g is not None:
                pairs.append((found[key](), g))
                if call.probe:  # the loss reached it: later calls carry what that submodule returns there
                    engine.guard.carried[unit].add((key[0], key[2]))
        wanted = [x for x in inputs if x.requires_grad] + [w for w in weights if w.requires_grad]
        grads: list[Tensor | None] = [None] * len(wanted)
        if pairs and wanted:
            grads = list(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True))
        engine.release(unit, forward=False)
        grad_iter = iter(grads)
        input_grads = [next(grad_iter) if x.requires_grad else None for x in inputs]
        weight_grads = {i: g for i, w in enumerate(weights) if w.requires_grad and (g := next(grad_iter)) is not None}
        engine.after_backward(unit, weight_grads)
        return (None, None, *input_grads)


class EmbeddingRowsFunction(Function):
    """An embedding lookup that moves only the rows of the tokens in the batch: forward gathers them
    (:meth:`EmbeddingRows.gather`), backward sums the output gradient into them and sends those back."""

    managed_node = True  # guard.py: a node of a streamed module

    @staticmethod
    def forward(ctx, rows: RowsHost, ids: Tensor, dummy: Tensor) -> Tensor:
        index, inverse, values = rows.gather(ids, training=True)
        ctx.rows = rows
        ctx.save_for_backward(index, inverse)
        return values[inverse]  # (*ids.shape, width)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[None, ...]:
        index, inverse = ctx.saved_tensors
        rows: RowsHost = ctx.rows
        width = grad.shape[-1]
        # NOTE: the op plain nn.Embedding's backward runs, on the positions among the distinct ids: its CUDA kernel
        # sums each row's contributions in a fixed order (index_add_ adds with atomics: runs differ in the last bits)
        values = torch.ops.aten.embedding_dense_backward(
            grad.reshape(-1, width).float(), inverse.reshape(-1), index.numel(), -1, False
        )  # (U, width)
        padding_idx = rows.unit.module.padding_idx
        if padding_idx is not None:
            values[index == padding_idx] = 0
        rows.after_backward(rows.unit, {0: Rows(index, values)})
        return None, None, None
