"""Adam / AdamW with bf16 moments on the GPU (``optimizer_state="bf16"`` for the parameters kept there): the arithmetic
of ``engine/adam_bf16.c`` element for element, with the same roundings and the same random bits, so that a parameter's
update gives the same bits on the device as on the host (``engine/adam_bf16.c`` says why the moments round at random).

The moments travel as their bf16 bits (int16) and are widened and narrowed with integer operations, as the C kernel
does: exact on any device, and under ``TRITON_INTERPRET=1`` too, whose bf16 arithmetic is unreliable. The square root
and the division are the correctly rounded ones and no multiply-add is fused, as in the C kernel's build.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 1024  # elements per program


@triton.jit
def _widen(bits):
    return (bits.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _narrow(f, noise):
    # fp32 to bf16 bits, rounded up with the probability of the bits dropped; Inf and NaN keep their bits
    u = f.to(tl.uint32, bitcast=True)
    finite = (u & 0x7F800000) != 0x7F800000
    u = u + tl.where(finite, noise & 0xFFFF, 0)
    return (u >> 16).to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def _mix(x):  # MurmurHash3's 32-bit finalizer
    x ^= x >> 16
    x *= 0x85EBCA6B
    x ^= x >> 13
    x *= 0xC2B2AE35
    x ^= x >> 16
    return x


@triton.jit(do_not_specialize=["n", "width", "index0", "seed"])  # a seed of 1 would become a constant
def _adam_bf16_kernel(P, G, M, V, VMAX, ROWS, n, width, index0, sign, keep, l2, b1c, beta2, b2c, eps, step_size,
                      inv_bias2_sqrt, seed, AMSGRAD: tl.constexpr, BF16_GRAD: tl.constexpr, GATHERED: tl.constexpr,
                      BLOCK: tl.constexpr):  # fmt: skip
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if GATHERED:  # the element's index in its whole parameter: its row's, then its column
        row = tl.load(ROWS + offs // width, mask=mask, other=0)
        index = row * width + offs % width
    else:
        index = offs + index0
    p = tl.load(P + offs, mask=mask, other=0.0)
    gi = tl.load(G + offs, mask=mask, other=0)
    if BF16_GRAD:
        gi = _widen(gi)
    grad = gi * sign + l2 * p
    param = p * keep
    mi = _widen(tl.load(M + offs, mask=mask, other=0))
    vi = _widen(tl.load(V + offs, mask=mask, other=0))
    mi = mi + b1c * (grad - mi)
    vi = beta2 * vi + b2c * grad * grad
    second = vi
    bits = _mix((index.to(tl.uint32) * 0x9E3779B9) ^ seed.to(tl.uint32))
    if AMSGRAD:
        most = _widen(tl.load(VMAX + offs, mask=mask, other=0))
        second = tl.where(most > vi, most, vi)
        tl.store(VMAX + offs, _narrow(second, _mix(bits)), mask=mask)
    denom = tl.sqrt_rn(second) * inv_bias2_sqrt + eps
    tl.store(P + offs, param - tl.div_rn(step_size * mi, denom), mask=mask)
    tl.store(M + offs, _narrow(mi, bits), mask=mask)
    tl.store(V + offs, _narrow(vi, bits >> 16), mask=mask)


def adam_bf16(p: Tensor, g: Tensor, m: Tensor, v: Tensor, vmax: Tensor | None, scalars: tuple[float, ...], seed: int,
              *, index0: int = 0, rows: Tensor | None = None) -> None:  # fmt: skip
    """Update the contiguous fp32 ``p`` in place with the gradient ``g`` (fp32, or bf16 read as it is) and the bf16
    moments ``m``, ``v`` (``vmax``: amsgrad's), all of one size on one device. ``scalars``: ``AdamArgs``' fields in
    order (``engine/adam_bf16.py``); ``p`` starts at element ``index0`` of its parameter, or (``rows``, int64 on the
    same device) is those leading rows of it, gathered."""
    n = p.numel()
    if n == 0:
        return
    bits = [t.view(torch.int16) if t is not None else None for t in (m, v, vmax)]
    grad = g.view(torch.int16) if g.dtype == torch.bfloat16 else g
    width = n // len(rows) if rows is not None else 1
    _adam_bf16_kernel[(triton.cdiv(n, BLOCK),)](
        p, grad, bits[0], bits[1], bits[2] if vmax is not None else bits[0], rows if rows is not None else p, n, width,
        index0, *scalars, seed & 0xFFFFFFFF, AMSGRAD=vmax is not None, BF16_GRAD=g.dtype == torch.bfloat16,
        GATHERED=rows is not None, BLOCK=BLOCK, enable_fp_fusion=False,
    )  # fmt: skip
