"""The boundary guard: what leaves a managed module other than through its outputs.

A managed module's node (``functions.py``) computes without a graph, so a tensor that leaves the module another way
(captured by a forward hook, as transformers collects MoE router logits; stored in an attribute or a cache; read by a
later block, as shared K/V) would carry no gradient back into it, and a parameter read outside the forward of the
module that holds it is never streamed. Plain training differentiates through all of them.

The first training forward is a probe: each node computes with a graph, over copies of its inputs and weights tagged
as that node's. Whatever the module's submodules return is carried through the node as an extra output (the same
tensor object, so a hook's reference gets the node's gradient); the probe's backward keeps the outputs the loss
reached, and later calls carry only those. Anything else that leads back to a tagged copy, from another node's
graph or from the loss, or to a parameter read directly, is refused before the first update, by name.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._pytree import tree_flatten, tree_unflatten

from .units import BoundaryError, Unit, alias

Key = tuple[str, int, int]  # a submodule's path in the unit, its call number within one call, the output's leaf
Site = tuple[str, int]  # a submodule's path and an output's leaf: carried in every call of it
_TAG = "_slide_probe"  # attribute of a probe copy: (unit, what it copies)
_HOW = (
    "SlideFormer runs each block (and the other streamed modules) without a graph and differentiates only what goes"
    " in as its arguments and comes out as its outputs (or as the outputs of its submodules)."
)


class Guard:
    """Probes the first training forward and keeps, per unit, which submodule outputs its node carries.

    Args:
        names: every parameter's name (for messages).
        trained: the streamed parameters the optimizer updates.
        resident: the parameters on the device, whose gradients autograd leaves: the loss may reach them, a node
            may not (its backward computes gradients of its own weights and arguments only).
    """

    def __init__(
        self, names: dict[nn.Parameter, str], trained: set[nn.Parameter], resident: set[nn.Parameter] = frozenset()
    ) -> None:
        self.probing = True  # until the first training backward starts
        self._names, self._trained, self._resident = names, trained, resident
        self.carried: dict[Unit, set[Site]] = defaultdict(set)

    # ---- one node's probe ----------------------------------------------------------------------------------------

    def probe(
        self, unit: Unit, run: Callable[[list[Tensor], list[Tensor]], Any], tensors: list[Tensor], needs: list[bool],
        weights: list[Tensor], wants: list[bool],
    ) -> tuple[Any, dict[Key, Callable]]:  # fmt: skip
        """``run(tensors, weights)``, ``unit``'s forward, with a graph over copies of its arguments and weights tagged
        as ``unit``'s (requiring grad per ``needs`` and ``wants``). Returns its output (an argument returned as it is
        given back as itself) and the outputs of its submodules (weakly, :func:`submodule_outputs`)."""
        what = [f"argument {i}" for i in range(len(tensors))]
        what += [f"weight '{self._names.get(p, tuple(p.shape))}'" for p in unit.params]
        copies = []
        for t, need, name in zip([*tensors, *weights], [*needs, *wants], what):
            copy = alias(t).requires_grad_(need)  # the same memory
            setattr(copy, _TAG, (unit, name))
            copies.append(copy)
        originals = {id(c): t for c, t in zip(copies, tensors)}
        # the probe's graph is walked, never run backward (the node recomputes): it keeps no activations
        with torch.enable_grad(), saved_tensors_hooks(_drop, _drop), submodule_outputs(unit.module, None) as found:
            out = run(copies[: len(tensors)], copies[len(tensors) :])
        flat, spec = tree_flatten(out)
        return tree_unflatten([originals.get(id(x), x) for x in flat], spec), found

    def check_node(self, unit: Unit, roots: list[Tensor]) -> None:
        """``unit``'s probe produced ``roots`` (its outputs and carried submodule outputs): they must depend on no
        tensor of another node's computation and on no parameter read directly."""
        for leaf, path in _leaves(roots):
            if leaf is None:
                raise BoundaryError(
                    f"'{unit.name}' reads a tensor that another streamed module returned without it being an argument"
                    f" of '{unit.name}''s forward (a cache or an attribute holding it). {_HOW} Its gradient would be"
                    f" lost. Pass it as an argument (path: {path})."
                )
            tag = getattr(leaf, _TAG, None)
            if tag is not None and tag[0] is unit:
                continue
            if tag is not None:
                raise BoundaryError(
                    f"'{unit.name}' uses a tensor computed inside '{tag[0].name}' (from its {tag[1]}) that does not"
                    f" reach it as an argument: a cache or an attribute shared between them (layers that share"
                    f" keys and values, say). {_HOW} Its gradient into '{tag[0].name}' would be lost. Pass the tensor"
                    f" as an argument of '{unit.name}''s forward, or turn the sharing off in the model's config"
                    f" (path: {path})."
                )
            if leaf in self._trained or leaf in self._resident:
                raise self._direct_use(leaf, f"inside '{unit.name}'", path)

    # ---- the probe's loss --------------------------------------------------------------------------------------------

    def check_loss(self, loss: Tensor) -> None:
        """The first training backward starts from ``loss``: nothing it reaches may lead back to a probe copy
        (a tensor that left its node another way than through the node) or to a parameter read directly."""
        self.probing = False
        for leaf, path in _leaves([loss], through_nodes=True):
            tag = getattr(leaf, _TAG, None)
            if tag is not None:
                raise BoundaryError(
                    f"The loss depends on a tensor computed inside '{tag[0].name}' (from its {tag[1]}) that left it"
                    f" neither as an output nor as a submodule's output: an attribute, a cache, a global, or a hook on"
                    f" an intermediate result. {_HOW} Its gradient would be lost. Return the tensor from a submodule"
                    f" (or from the block), or compute it outside the block (path: {path})."
                )
            if leaf in self._trained:
                raise self._direct_use(leaf, "in the forward", path)

    def _direct_use(self, param: nn.Parameter, where: str, path: str) -> BoundaryError:
        name = self._names.get(param, tuple(param.shape))
        return BoundaryError(
            f"Parameter '{name}' is read {where} outside the forward of the module that holds it (a layer reading"
            f" another layer's weight, say). {_HOW} It would get no gradient. Call the module that holds it, move the"
            f" parameter into the module that reads it, or freeze it (requires_grad=False) (path: {path})."
        )


@contextmanager
def submodule_outputs(module: nn.Module, sites: set[Site] | None) -> Iterator[dict[Key, Callable[[], Tensor | None]]]:
    """Collect, while active, the floating-point tensors ``module``'s submodules return, by :data:`Key`: at ``sites``
    only, or (``None``, the probe) all, held weakly: what is still alive after the call is what left the module."""
    found: dict[Key, Callable[[], Tensor | None]] = {}
    if sites is not None and not sites:
        yield found
        return
    calls: dict[str, int] = defaultdict(int)
    paths = None if sites is None else {path for path, _ in sites}

    def hook(path: str, _module: nn.Module, _args: Any, output: Any) -> None:
        call = calls[path]
        calls[path] += 1
        for i, leaf in enumerate(tree_flatten(output)[0]):
            key = (path, call, i)
            if isinstance(leaf, Tensor) and leaf.is_floating_point() and (sites is None or (path, i) in sites):
                found[key] = weakref.ref(leaf) if sites is None else partial(_same, leaf)

    handles = [
        sub.register_forward_hook(lambda m, a, o, path=path: hook(path, m, a, o))
        for path, sub in module.named_modules()
        if path and (paths is None or path in paths)
    ]
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()


def extra_outputs(
    found: dict[Key, Callable[[], Tensor | None]], outs: tuple[Tensor, ...], args: tuple[Tensor, ...], *, probe: bool
) -> dict[Key, Tensor]:
    """The submodule outputs (from :func:`submodule_outputs`) a node returns after its own ``outs``: each once, none it
    returns already or was given; in the probe only those that need a gradient, and none of the probe's copies."""
    taken = {id(t) for t in (*outs, *args)}
    extras = {}
    for key, ref in found.items():
        t = ref()
        if t is None or id(t) in taken or (probe and (not t.requires_grad or hasattr(t, _TAG))):
            continue
        taken.add(id(t))
        extras[key] = t
    return extras


def _same(tensor: Tensor) -> Tensor:
    return tensor


def _drop(_: Any) -> None:
    return None


def _leaves(roots: list[Tensor], *, through_nodes: bool = False) -> Iterator[tuple[Tensor | None, str]]:
    """The leaf tensors the graphs of ``roots`` lead to, each with the operations on the way to it (for messages).

    Without ``through_nodes`` the walk stops at a managed node and yields ``None`` for it: inside a node's probe,
    another node's output was read without being an argument."""
    stack = [(r.grad_fn, type(r.grad_fn).__name__) for r in roots if r.grad_fn is not None]
    seen: set[Any] = set()
    while stack:
        node, path = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):  # AccumulateGrad: a leaf
            yield node.variable, path
            continue
        if getattr(getattr(node, "_forward_cls", None), "managed_node", False) and not through_nodes:
            yield None, path
            continue
        for child, _ in node.next_functions:
            if child is not None:
                stack.append((child, f"{path} <- {type(child).__name__}" if path.count("<-") < 6 else path))
