"""Fused rotary position embedding: Hugging Face's ``x * cos + rotate_half(x) * sin`` in one pass.

Transformers' ``apply_rotary_pos_emb`` takes five elementwise kernels per tensor (two products, a negation, a
concatenation, a sum) and about as many in the backward; under bf16-mixed the products mix bf16 projections with the
fp32 ``cos``/``sin`` of the residual stream's dtype, which PyTorch runs on its slower mixed-dtype path. Here one
kernel reads each row of ``x`` and of ``cos``/``sin`` once and writes the row once; the backward is the same kernel
with the rotation transposed:

    out[:h] = x[:h] cos[:h] - x[h:] sin[:h]        dx[:h] = g[:h] cos[:h] + g[h:] sin[h:]
    out[h:] = x[h:] cos[h:] + x[:h] sin[h:]        dx[h:] = g[h:] cos[h:] - g[:h] sin[:h]

(h = half the head dim). The output's dtype is ``promote_types(x, cos)``, as transformers' ops give; the arithmetic
is fp32 with one rounding. ``x`` is (batch, heads, seq, dim) or (batch, seq, heads, dim) with any strides but a unit
last one; ``cos``/``sin`` broadcast to it (``unsqueeze_dim``); the output keeps ``x``'s memory layout.

Layering as in the other kernels: Triton kernel -> ``rotate`` (launcher) -> ``RotaryFunction`` ->
``rotary_embedding``; ``rotary_embedding_ref`` is transformers' formula, op for op, and what ``rotary_embedding`` runs
off CUDA without ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ROWS = 16  # rows of x per program


@triton.jit
def _rotary_kernel(
    X, COS, SIN, OUT, n_rows, n1, n2,
    xs0, xs1, xs2, cs0, cs1, cs2, os0, os1, os2,
    HALF: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, TRANSPOSE: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    i2, i1, i0 = rows % n2, (rows // n2) % n1, rows // (n1 * n2)
    x_row = (i0 * xs0 + i1 * xs1 + i2 * xs2)[:, None]
    c_row = (i0 * cs0 + i1 * cs1 + i2 * cs2)[:, None]
    o_row = (i0 * os0 + i1 * os1 + i2 * os2)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    mask = (rows < n_rows)[:, None] & (cols < HALF)
    x1 = tl.load(X + x_row + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + x_row + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(COS + c_row + cols, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + c_row + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + c_row + cols, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + c_row + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    if TRANSPOSE:
        y1, y2 = x1 * c1 + x2 * s2, x2 * c2 - x1 * s1
    else:
        y1, y2 = x1 * c1 - x2 * s1, x2 * c2 + x1 * s2
    tl.store(OUT + o_row + cols, y1.to(OUT.dtype.element_ty), mask=mask)
    tl.store(OUT + o_row + HALF + cols, y2.to(OUT.dtype.element_ty), mask=mask)


def rotate(x: Tensor, cos: Tensor, sin: Tensor, dtype: torch.dtype, transpose: bool = False) -> Tensor:
    """``x`` rotated by ``cos``/``sin`` (already broadcast to ``x``'s shape, same strides as each other) into a new
    tensor of ``dtype`` with ``x``'s layout; ``transpose``: the backward's rotation (module docstring)."""
    out = torch.empty_like(x, dtype=dtype)
    n0, n1, n2, dim = x.shape
    n_rows, half = n0 * n1 * n2, dim // 2
    strides = [*x.stride()[:3], *cos.stride()[:3], *out.stride()[:3]]
    _rotary_kernel[(triton.cdiv(n_rows, ROWS),)](
        x, cos, sin, out, n_rows, n1, n2, *strides,
        HALF=half, BLOCK=triton.next_power_of_2(half), ROWS=ROWS, TRANSPOSE=transpose,
    )  # fmt: skip
    return out


class RotaryFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.x_dtype = x.dtype
        return rotate(x, cos, sin, torch.promote_types(x.dtype, cos.dtype))

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        if grad.stride(-1) != 1:
            grad = grad.contiguous()
        return rotate(grad, cos, sin, ctx.x_dtype, transpose=True), None, None


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_embedding_ref(x: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1) -> Tensor:
    """Transformers' rotary embedding of one tensor (``apply_rotary_pos_emb``), op for op."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return (x * cos) + (_rotate_half(x) * sin)


def runs_on_kernel(x: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int) -> bool:
    """Whether :func:`rotary_embedding` takes the kernel for these inputs (else transformers' formula)."""
    if not (x.is_cuda or _INTERPRET) or x.dim() != 4 or cos.dim() != 3 or x.numel() == 0 or x.stride(-1) != 1:
        return False
    if cos.shape != sin.shape or cos.dtype != sin.dtype or cos.requires_grad or sin.requires_grad:
        return False
    try:  # a partial rotary (cos narrower than the head) or another layout takes the formula
        return x.shape[-1] % 2 == 0 and torch.broadcast_shapes(cos.unsqueeze(unsqueeze_dim).shape, x.shape) == x.shape
    except (RuntimeError, IndexError):
        return False


def rotary_embedding(x: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1) -> Tensor:
    """``x * cos + rotate_half(x) * sin`` with ``cos``/``sin`` (batch, seq, dim) unsqueezed at ``unsqueeze_dim``."""
    if not runs_on_kernel(x, cos, sin, unsqueeze_dim):
        return rotary_embedding_ref(x, cos, sin, unsqueeze_dim)
    return rotary_on_kernel(x, cos, sin, unsqueeze_dim)


def rotary_on_kernel(x: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int) -> Tensor:
    """:func:`rotary_embedding` on the kernel, for inputs that :func:`runs_on_kernel` accepted."""
    cos, sin = (t.contiguous().unsqueeze(unsqueeze_dim).expand(x.shape) for t in (cos, sin))  # same strides
    return RotaryFunction.apply(x, cos, sin)
