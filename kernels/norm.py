"""Fused RMSNorm: Hugging Face's Llama-style ``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` in one pass.

Transformers' RMSNorm modules run it as four or five elementwise kernels forward and about ten in the backward, each
reading or writing the (tokens x hidden) tensor, often in fp32 (the residual stream under bf16-mixed). Here the
forward reads the input once and writes the output once (and one fp32 ``rstd`` per row); the backward reads the
input and the output's gradient once and writes the input's gradient once, the weight's gradient summed per program
and then across programs (as Liger-Kernel's and Apex's fused norms do).

Dtypes are Hugging Face's: the statistics in fp32, the normalized row rounded to the input's dtype before the
weight multiplies it, the output in ``promote_types(weight, input)``. The backward works in fp32 and rounds each
gradient once.

Layering as in the other kernels: Triton kernels -> launchers ``rms_norm_forward`` / ``rms_norm_backward`` ->
``RMSNormFunction`` -> ``rms_norm``. ``rms_norm_ref`` is the readable reference (Llama's module, op for op); off CUDA
without ``TRITON_INTERPRET=1``, ``rms_norm`` is that reference.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MAX_WIDTH = 65536  # one row per program in registers; wider rows take the reference


@triton.jit
def _forward_kernel(X, W, Y, RSTD, stride_x, stride_y, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    normed = (x * rstd).to(X.dtype.element_ty).to(tl.float32)  # Hugging Face rounds before the weight
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (w * normed).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _backward_kernel(
    DY, X, W, RSTD, DX, DW, stride_dy, stride_x, stride_dx, n_rows, n_cols, rows_per_program, BLOCK: tl.constexpr
):
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    first = program.to(tl.int64) * rows_per_program  # 64-bit offsets: rows x width may pass 2^31
    for row in range(first, tl.minimum(first + rows_per_program, n_rows)):
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        normed = x * rstd
        dw += dy * normed.to(X.dtype.element_ty).to(tl.float32)
        g = dy * w
        dx = rstd * (g - normed * (tl.sum(g * normed, axis=0) / n_cols))
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW + program * n_cols + cols, dw, mask=mask)


def _rows(x: Tensor) -> Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def rms_norm_forward(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The normalized ``x`` (``x``'s shape, dtype ``promote_types(weight, x)``) and each row's fp32 ``rstd``."""
    rows = _rows(x)
    y = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    rstd = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(rows.shape[1])
    _forward_kernel[(rows.shape[0],)](
        rows, weight, y, rstd, rows.stride(0), y.stride(0), rows.shape[1], eps, BLOCK=block, num_warps=_warps(block)
    )
    return y.view(x.shape), rstd


def rms_norm_backward(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    """Gradients of ``x`` (its dtype) and of ``weight`` (its dtype, summed over rows in fp32)."""
    rows, grads = _rows(x), _rows(dy)
    n_rows, n_cols = rows.shape
    dx = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    many = 4 * torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 8
    programs = max(1, min(n_rows, many))
    per_program = triton.cdiv(n_rows, programs)
    programs = triton.cdiv(n_rows, per_program)
    partial = torch.empty(programs, n_cols, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(n_cols)
    _backward_kernel[(programs,)](
        grads, rows, weight, rstd, dx, partial, grads.stride(0), rows.stride(0), dx.stride(0), n_rows, n_cols,
        per_program, BLOCK=block, num_warps=_warps(block),
    )  # fmt: skip
    return dx.view(x.shape), partial.sum(0).to(weight.dtype)


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        y, rstd = rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(dy, x, weight, rstd)
        return dx, dw if ctx.needs_input_grad[1] else None, None


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Hugging Face's ``LlamaRMSNorm.forward``, op for op."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dimension of ``x`` with a weight of that width (module docstring)."""
    if (x.is_cuda or _INTERPRET) and x.shape[-1] <= MAX_WIDTH and x.numel():
        return RMSNormFunction.apply(x, weight, eps)
    return rms_norm_ref(x, weight, eps)
