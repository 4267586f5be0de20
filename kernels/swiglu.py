"""Fused gated activation of a SwiGLU MLP: Hugging Face's ``act_fn(gate) * up`` with SiLU, in one pass each way.

Transformers' Llama MLP runs ``silu(gate)`` and the product as two elementwise kernels, and autograd keeps three
tensors for their backward (``gate``, ``silu(gate)``, ``up``), each as wide as the MLP's intermediate (3.5x the hidden
state). Here one kernel reads ``gate`` and ``up`` once and writes the product once; the backward reads the gradient,
``gate`` and ``up`` and writes both input gradients, recomputing the sigmoid (as Liger Kernel's SwiGLU does):

    out = g s(g) u        du = dout g s(g)        dg = dout u s(g) (1 + g (1 - s(g)))        (s: the sigmoid)

The arithmetic is fp32 with one rounding to the inputs' dtype (transformers rounds ``silu(gate)`` to it first).

Layering as in the other kernels: Triton kernels -> ``SwiGLUFunction`` -> ``swiglu``; ``swiglu_ref`` is
transformers' formula, op for op, and what ``swiglu`` runs off CUDA without ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK = 1024  # elements per program
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the kernel reads and writes


@triton.jit
def _swiglu_forward_kernel(G, U, OUT, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + offs, (g * tl.sigmoid(g) * u).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward_kernel(DOUT, G, U, DG, DU, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dout = tl.load(DOUT + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    tl.store(DU + offs, (dout * g * s).to(DU.dtype.element_ty), mask=mask)
    tl.store(DG + offs, (dout * u * s * (1.0 + g * (1.0 - s))).to(DG.dtype.element_ty), mask=mask)


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor) -> Tensor:
        out = torch.empty_like(gate)
        _swiglu_forward_kernel[(triton.cdiv(gate.numel(), BLOCK),)](gate, up, out, gate.numel(), BLOCK=BLOCK)
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    def backward(ctx, dout: Tensor) -> tuple[Tensor, Tensor]:
        gate, up = ctx.saved_tensors
        dout = dout.contiguous()
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        _swiglu_backward_kernel[(triton.cdiv(n, BLOCK),)](dout, gate, up, dgate, dup, n, BLOCK=BLOCK)
        return dgate, dup


def swiglu_ref(gate: Tensor, up: Tensor) -> Tensor:
    """Transformers' gated activation with SiLU (``act_fn(gate_proj(x)) * up_proj(x)``), op for op."""
    return torch.nn.functional.silu(gate) * up


def runs_on_kernel(gate: Tensor, up: Tensor) -> bool:
    """Whether :func:`swiglu` takes the kernel: same shape and dtype (fp32, bf16 or fp16), contiguous, on CUDA (or
    interpreted)."""
    if not (gate.is_cuda or _INTERPRET) or gate.device != up.device or gate.numel() == 0:
        return False
    same = gate.shape == up.shape and gate.dtype == up.dtype and gate.dtype in _DTYPES
    return same and gate.is_contiguous() and up.is_contiguous()


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up``, on the kernel where :func:`runs_on_kernel` allows, else transformers' formula."""
    return SwiGLUFunction.apply(gate, up) if runs_on_kernel(gate, up) else swiglu_ref(gate, up)
