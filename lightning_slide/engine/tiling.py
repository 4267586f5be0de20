"""Sequence tiling of a block's MLP, for contexts so long that one block at work does not fit the GPU.

A gated MLP (``down_proj(act(gate_proj(x)) * up_proj(x))``, Llama, Qwen2/3, Mistral) acts on each token alone, and
its four intermediates are each ~3.5x as wide as the hidden state: at 64k tokens of the Llama-3.1-8B shape they are
7 GiB, more than the rest of the block's working memory. Tiled, the MLP runs on slices of the tokens, and its
backward recomputes one slice at a time, so the intermediates exist for one slice only. The price is one more
forward of the MLP per block in backward. The idea is Arctic Long Sequence Training's ``TiledMLP`` (Snowflake).

The forward (with or without a graph) and the recompute slice the tokens the same way, so they compute the same
values. Weight gradients are summed over the slices in fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.autograd import Function

from .units import Unit, replace_forward, swapped

TILES = 8


def gated_mlp(block: nn.Module) -> nn.Module | None:
    """The block's ``mlp`` if it is a dense gated MLP without dropout (what tiling knows to be token-wise)."""
    mlp = getattr(block, "mlp", None)
    if not isinstance(mlp, nn.Module) or not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
        return None
    if any(isinstance(m, nn.Dropout) and m.p > 0 for m in mlp.modules()):
        return None
    return mlp


class TiledMLP:
    """Replaces ``mlp.forward``; computes tiled while ``active``, else as before."""

    def __init__(self, mlp: nn.Module, tiles: int = TILES) -> None:
        self.unit = Unit("mlp", mlp, torch.float32)  # its parameter slots, and its own forward
        self.tiles = tiles
        self.active = False
        self.restore = replace_forward(mlp, self)

    def __call__(self, x: Tensor) -> Tensor:
        if not self.active:
            return self.unit.forward(x)
        weights = [None] * len(self.unit.params)  # the device copies swapped in
        for sub, attr, i in self.unit.entries:
            weights[i] = sub._parameters[attr]
        if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)):
            return _TiledFunction.apply(self, x, *weights)
        return self.run(x)

    def run(self, x: Tensor) -> Tensor:
        """The MLP on each slice of the tokens of ``x``, joined."""
        flat = x.reshape(-1, x.shape[-1])
        out = torch.cat([self.unit.forward(piece) for piece in flat.tensor_split(self.tiles)])
        return out.view(*x.shape[:-1], out.shape[-1])


class _TiledFunction(Function):
    @staticmethod
    def forward(ctx, tiled: TiledMLP, x: Tensor, *weights: Tensor) -> Tensor:
        ctx.tiled = tiled
        device = x.device.type
        ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        ctx.save_for_backward(x, *weights)
        with torch.no_grad():
            return tiled.run(x)

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        tiled: TiledMLP = ctx.tiled
        x, *weights = ctx.saved_tensors
        want_x, want_w = ctx.needs_input_grad[1], ctx.needs_input_grad[2:]
        flat_x, flat_g = x.reshape(-1, x.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = torch.empty_like(flat_x) if want_x else None
        grad_w: list[Tensor | None] = [None] * len(weights)
        start = 0
        device, dtype, enabled = ctx.autocast
        for piece, grad_piece in zip(flat_x.tensor_split(tiled.tiles), flat_g.tensor_split(tiled.tiles)):
            piece = piece.detach().requires_grad_(want_x)
            leaves = [w.detach().requires_grad_(need) for w, need in zip(weights, want_w)]
            with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled), swapped(tiled.unit, leaves):
                out = tiled.unit.forward(piece)
            wanted = ([piece] if want_x else []) + [w for w in leaves if w.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad_piece, allow_unused=True))
            if want_x:
                grad_x[start : start + piece.shape[0]] = next(grads)
            for i, leaf in enumerate(leaves):
                if leaf.requires_grad and (g := next(grads)) is not None:
                    grad_w[i] = g.float() if grad_w[i] is None else grad_w[i].add_(g)
            start += piece.shape[0]
        weight_grads = [g.to(w.dtype) if g is not None else None for g, w in zip(grad_w, weights)]
        return None, grad_x.view(x.shape) if want_x else None, *weight_grads
