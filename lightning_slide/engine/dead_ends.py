"""Dead ends: the linear layers whose outputs a streamed block's recompute never reads.

A managed module's backward replays its forward to rebuild what its gradients need (``functions.py``). The last
matrix of a residual branch (Llama's ``mlp.down_proj``: a quarter of a block's weights) computes an output that only
the residual addition reads, and an addition's gradient needs no values: the replay can leave that product out and
still take the layer's gradients (dX = dY W, dW = dY^T X, the bias's the sum of dY) with the operations torch's own
linear backward runs, so the same bits. The first training forward (the guard's probe, ``guard.py``) finds those
layers per unit: an ``nn.Linear`` whose forward is its class's, called once, whose output no operation reads but
out-of-place additions and dtype casts (and those results none but more of them): a torch function mode sees every
call on it, the ones autograd records and the ones it does not (a comparison, an ``argmax``, a kernel launched on its
memory). What the probe saw holds for the unit's later calls, as the guard's carried outputs do.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd import Function
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from .units import Unit, replace_forward

# the operations through which a dead end's output may pass on its way out: their gradients need no values; and
# dropout where it returns its input as it is (p = 0, or not training)
_PASSING_CALLS = frozenset({torch.add, Tensor.add, Tensor.__add__, Tensor.__radd__, Tensor.to})
_PASSING_AS_IS = frozenset({nn.functional.dropout})
# calls that read a tensor's metadata, not its values (and properties, ``__get__``, that return no tensor); not
# ``data_ptr``: a kernel launched on the tensor reads its values through it
_METADATA = frozenset({"is_floating_point", "is_complex", "dim", "ndimension", "size", "stride", "numel",
                       "nelement", "is_contiguous", "element_size", "get_device", "__len__"})  # fmt: skip


class DeadEnds:
    """Per unit, the linear layers its recompute leaves out (found in the probe); nothing while not ``enabled``."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.layers: dict[Unit, list[nn.Linear]] = {}

    @contextmanager
    def probing(self, unit: Unit) -> Iterator[None]:
        """While active, watch ``unit``'s probe forward; then keep its dead ends."""
        if not self.enabled:
            yield
            return
        with _Watch(unit.module) as watch:
            yield
        self.layers[unit] = watch.dead()

    @contextmanager
    def skipped(self, unit: Unit) -> Iterator[None]:
        """While active, ``unit``'s dead ends return no product, only the node that differentiates them."""
        restores = [replace_forward(layer, partial(_dead_forward, layer)) for layer in self.layers.get(unit, ())]
        try:
            yield
        finally:
            for restore in restores:
                restore()


class _Watch(TorchFunctionMode):
    """The probe of one unit: its ``nn.Linear`` layers' outputs, and every call that reads them."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        # NOTE: exactly nn.Linear, whose product and gradients _DeadLinear knows, and none whose forward was replaced
        self.layers = [m for m in module.modules() if type(m) is nn.Linear and "forward" not in m.__dict__]
        self.calls: dict[nn.Linear, int] = defaultdict(int)
        self.graphed: set[nn.Linear] = set()  # those whose output has a gradient to take
        self.owners: dict[int, set[nn.Linear]] = {}  # id of a tensor carrying layers' outputs unread -> the layers
        self.kept: list[Tensor] = []  # those tensors, alive until the probe ends (their ids stay theirs)
        self.read: set[nn.Linear] = set()
        self.handles: list = []

    def __enter__(self):
        self.handles = [layer.register_forward_hook(self._output) for layer in self.layers]
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.kept.clear()
        super().__exit__(*exc)

    def _output(self, layer: nn.Linear, _args: Any, out: Tensor) -> None:
        self.calls[layer] += 1
        if out.grad_fn is not None:
            self.graphed.add(layer)
        self._carry(out, {layer})

    def _carry(self, t: Tensor, layers: set[nn.Linear]) -> None:
        self.owners.setdefault(id(t), set()).update(layers)
        self.kept.append(t)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        given = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
        layers = set().union(*(self.owners.get(id(t), set()) for t in given))
        if not layers or not _reads_values(func, out):
            return out
        if (func in _PASSING_CALLS and isinstance(out, Tensor)) or (
            func in _PASSING_AS_IS and any(out is t for t in given)
        ):
            self._carry(out, layers)
        else:
            self.read |= layers
        return out

    def dead(self) -> list[nn.Linear]:
        """The layers called once, with a gradient, whose outputs nothing read but the passing calls."""
        return [layer for layer in self.layers if self.calls[layer] == 1 and layer in self.graphed
                and layer not in self.read]  # fmt: skip


def _reads_values(func, out: Any) -> bool:
    name = getattr(func, "__name__", "")
    return isinstance(out, Tensor) if name == "__get__" else name not in _METADATA


def _dead_forward(layer: nn.Linear, x: Tensor) -> Tensor:
    # NOTE: autocast casts a linear's floating inputs to its dtype before the product; done here in the graph, as
    # autocast does it, so their gradients are cast back the same way
    weight, bias = layer.weight, layer.bias
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x, weight, bias = (t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t
                           for t in (x, weight, bias))  # fmt: skip
    if not (x.is_contiguous() and 2 <= x.dim() <= 3 and weight.is_contiguous() and weight.dim() == 2):
        return nn.Linear.forward(layer, x)  # another layout takes other products in torch's backward
    return _DeadLinear.apply(x, weight, bias)


class _DeadLinear(Function):
    """``x @ weight.T + bias`` whose value is never read: returns zeros (one element, expanded), differentiates as
    torch's linear does on a contiguous input of at most 3 dimensions (folded to (T, K): ``mm``, or ``addmm`` with a
    bias, whose gradient autograd sums over the broadcast rows)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        return x.new_zeros(()).expand(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        # x: (..., K), weight: (N, K), grad: (..., N); torch folds the leading dims: (T, K) @ (K, N)
        with torch.autocast(grad.device.type, enabled=False):
            grad2 = grad.reshape(-1, grad.shape[-1])  # (T, N)
            grad_x = grad2.mm(weight).view(x.shape) if need_x else None
            grad_w = grad2.t().mm(x.reshape(-1, x.shape[-1])) if need_w else None  # (N, K)
            grad_b = grad2.sum(0, keepdim=True).view(-1) if need_b else None  # (N,), as at::sum_to reduces it
        return grad_x, grad_w, grad_b
