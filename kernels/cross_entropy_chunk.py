"""One chunk of the fused linear cross-entropy's (tokens x vocabulary) logits: fold it into each token's running
log-sum-exp, or turn it into its gradient in place. Triton kernels (one program per token row), and the same math in
torch ops for the CPU without ``TRITON_INTERPRET=1``; and the scaling of the one pass's gradients.
``linear_cross_entropy.py`` walks the chunks and holds the formulas.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class CEOptions:
    """The loss's options, passed to the autograd function as one object."""

    ignore_index: int = -100
    reduction: str = "mean"
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: float | None = None
    return_correct: bool = False
    one_pass: bool | None = None


@dataclass
class RowStats:
    """Per-token running statistics of pass 1 (all fp32 except ``best_idx``)."""

    max: Tensor
    sumexp: Tensor
    target_logit: Tensor
    sum_z: Tensor
    best: Tensor
    best_idx: Tensor

    @classmethod
    def empty(cls, n: int, device: torch.device) -> RowStats:
        def full(value, dtype=torch.float32):
            return torch.full((n,), value, dtype=dtype, device=device)

        return cls(full(float("-inf")), full(0.0), full(0.0), full(0.0), full(float("-inf")), full(0, torch.int64))


def _configs() -> list[triton.Config]:
    # NOTE: one config when interpreting: multi-config autotuning fails under TRITON_INTERPRET=1.
    if _INTERPRET:
        return [triton.Config({"BLOCK_V": 256}, num_warps=4)]
    return [triton.Config({"BLOCK_V": b}, num_warps=w) for b in (1024, 2048, 4096) for w in (4, 8, 16)]


# NOTE: the kernels update their arguments in place; restore_value keeps autotuning's trial runs from compounding.
@triton.autotune(
    configs=_configs(),
    key=["n_cols"],
    restore_value=["max_ptr", "sumexp_ptr", "target_logit_ptr", "sum_z_ptr", "best_ptr", "best_idx_ptr"],
)
@triton.jit
def _lse_kernel(
    logits_ptr, stride_row, target_ptr, max_ptr, sumexp_ptr, target_logit_ptr, sum_z_ptr, best_ptr, best_idx_ptr,
    n_cols, col_offset, softcap,
    HAS_SOFTCAP: tl.constexpr, SUM_Z: tl.constexpr, ARGMAX: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    # logits: (N, n_cols), one vocabulary chunk starting at col_offset; one program per token row.
    # Folds the chunk into the row's running statistics.
    row = tl.program_id(0).to(tl.int64)
    m, s, z_target = tl.load(max_ptr + row), tl.load(sumexp_ptr + row), tl.load(target_logit_ptr + row)
    m, s, z_target, sum_z, best, best_idx = _fold_row(
        logits_ptr + row * stride_row, tl.load(target_ptr + row) - col_offset, m, s, z_target, n_cols, softcap,
        HAS_SOFTCAP, SUM_Z, ARGMAX, BLOCK_V,
    )  # fmt: skip
    tl.store(max_ptr + row, m)
    tl.store(sumexp_ptr + row, s)
    tl.store(target_logit_ptr + row, z_target)
    if SUM_Z:
        tl.store(sum_z_ptr + row, tl.load(sum_z_ptr + row) + sum_z)
    if ARGMAX:
        old = tl.load(best_ptr + row)
        better = best > old  # strictly: an earlier chunk keeps ties, as torch.argmax does
        tl.store(best_ptr + row, tl.where(better, best, old))
        tl.store(best_idx_ptr + row, tl.where(better, best_idx + col_offset, tl.load(best_idx_ptr + row)))


@triton.autotune(configs=_configs(), key=["n_cols"], restore_value=["logits_ptr"])
@triton.jit
def _grad_kernel(
    logits_ptr, stride_row, target_ptr, lse_ptr, scale_ptr,
    n_cols, col_offset, vocab, softcap, smoothing, z_loss,
    HAS_SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    # logits: (N, n_cols), overwritten in place with dloss/dlogits times the row's scale (0 for ignored rows).
    row = tl.program_id(0).to(tl.int64)
    _grad_row(
        logits_ptr + row * stride_row, tl.load(target_ptr + row) - col_offset, tl.load(lse_ptr + row),
        tl.load(scale_ptr + row), n_cols, vocab, softcap, smoothing, z_loss, HAS_SOFTCAP, BLOCK_V,
    )  # fmt: skip


@triton.autotune(configs=_configs(), key=["n_cols"], restore_value=["logits_ptr"])
@triton.jit
def _lse_grad_kernel(
    logits_ptr, stride_row, target_ptr, max_ptr, sumexp_ptr, target_logit_ptr, sum_z_ptr, best_idx_ptr, lse_ptr,
    scale_ptr, n_cols, softcap, smoothing, z_loss,
    HAS_SOFTCAP: tl.constexpr, SUM_Z: tl.constexpr, ARGMAX: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    # logits: (N, n_cols), the whole vocabulary; one program per token row. The row's statistics, then its
    # gradient in place: the second read of the row mostly hits L2, where two kernels read it twice from memory.
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    target = tl.load(target_ptr + row)
    m, s, z_target, sum_z, best, best_idx = _fold_row(
        base, target, tl.full((), float("-inf"), tl.float32), tl.zeros((), tl.float32), tl.zeros((), tl.float32),
        n_cols, softcap, HAS_SOFTCAP, SUM_Z, ARGMAX, BLOCK_V,
    )  # fmt: skip
    lse = m + tl.log(s)
    tl.store(max_ptr + row, m)
    tl.store(sumexp_ptr + row, s)
    tl.store(target_logit_ptr + row, z_target)
    tl.store(lse_ptr + row, lse)
    if SUM_Z:
        tl.store(sum_z_ptr + row, sum_z)
    if ARGMAX:
        tl.store(best_idx_ptr + row, best_idx)
    _grad_row(base, target, lse, tl.load(scale_ptr + row), n_cols, n_cols, softcap, smoothing, z_loss, HAS_SOFTCAP,
              BLOCK_V)  # fmt: skip


@triton.jit
def _fold_row(base, target, m, s, z_target, n_cols, softcap,
              HAS_SOFTCAP: tl.constexpr, SUM_Z: tl.constexpr, ARGMAX: tl.constexpr, BLOCK_V: tl.constexpr):  # fmt: skip
    # folds one row of logits (n_cols from base) into its running max m and sum of exp(z - m) (online softmax),
    # picks z[target] (target relative to base), and sums z and finds the row's argmax where asked
    sum_z = 0.0
    best = tl.full((), float("-inf"), tl.float32)
    best_idx = tl.zeros((), tl.int64)
    for start in range(0, n_cols, BLOCK_V):
        cols, inside, z = _logit_block(base, start, n_cols, softcap, HAS_SOFTCAP, BLOCK_V)
        z = tl.where(inside, z, float("-inf"))  # after the cap, which would map -inf to -softcap
        m_new = tl.maximum(m, tl.max(z, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
        m = m_new
        z_target += tl.sum(tl.where(cols == target, z, 0.0), 0)
        if SUM_Z:
            sum_z += tl.sum(tl.where(inside, z, 0.0), 0)
        if ARGMAX:
            block_best = tl.max(z, 0)
            block_idx = tl.argmax(z, 0).to(tl.int64) + start
            better = block_best > best
            best_idx = tl.where(better, block_idx, best_idx)
            best = tl.maximum(best, block_best)
    return m, s, z_target, sum_z, best, best_idx


@triton.jit
def _grad_row(base, target, lse, scale, n_cols, vocab, softcap, smoothing, z_loss,
              HAS_SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr):  # fmt: skip
    # overwrites one row of logits (n_cols from base) with dloss/dz times scale
    for start in range(0, n_cols, BLOCK_V):
        cols, inside, z = _logit_block(base, start, n_cols, softcap, HAS_SOFTCAP, BLOCK_V)
        g = tl.exp(z - lse) * (1.0 + 2.0 * z_loss * lse) - smoothing / vocab
        g = tl.where(cols == target, g - (1.0 - smoothing), g)
        if HAS_SOFTCAP:
            g = g * (1.0 - (z / softcap) * (z / softcap))
        tl.store(base + cols, (g * scale).to(base.dtype.element_ty), mask=inside)


@triton.jit
def _logit_block(base, start, n_cols, softcap, HAS_SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr):
    # the row's columns [start, start + BLOCK_V), which of them are inside it, and their logits in fp32 (capped)
    cols = start + tl.arange(0, BLOCK_V)
    inside = cols < n_cols
    z = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        z = softcap * _tanh(z / softcap)
    return cols, inside, z


@triton.jit
def _scale_kernel(src_ptr, dst_ptr, factor_ptr, n, BLOCK: tl.constexpr):
    # dst = src * factor: the product in fp32, rounded once to dst's dtype
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    x = tl.load(src_ptr + offsets, mask=inside).to(tl.float32)
    tl.store(dst_ptr + offsets, (x * tl.load(factor_ptr)).to(dst_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _tanh(x):
    # tanh from exp (portable, interpreter included): (1 - e) / (1 + e) with e = exp(-2|x|) is exact to a few
    # ulps for |x| >= 0.1; below, where 1 - e cancels, the series x - x^3/3 + 2x^5/15 - 17x^7/315 is.
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    big = (1.0 - e) / (1.0 + e)
    a2 = a * a
    small = a * (1.0 + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 - a2 * (17.0 / 315.0))))
    t = tl.where(a < 0.1, small, big)
    return tl.where(x >= 0, t, -t)


def _lse_chunk_torch(x: Tensor, target: Tensor, stats: RowStats, v0: int, opts: CEOptions) -> None:
    z = x.float()
    if opts.softcap:
        z = opts.softcap * torch.tanh(z / opts.softcap)
    m_new = torch.maximum(stats.max, z.max(1).values)
    stats.sumexp.mul_(torch.exp(stats.max - m_new)).add_(torch.exp(z - m_new[:, None]).sum(1))
    stats.max.copy_(m_new)
    local = target - v0
    inside = (local >= 0) & (local < z.shape[1])
    picked = z.gather(1, local.clamp(0, z.shape[1] - 1)[:, None]).squeeze(1)
    stats.target_logit.add_(torch.where(inside, picked, 0.0))
    if opts.label_smoothing:
        stats.sum_z.add_(z.sum(1))
    if opts.return_correct:
        best, idx = z.max(1)
        better = best > stats.best
        stats.best_idx.copy_(torch.where(better, idx + v0, stats.best_idx))
        stats.best.copy_(torch.maximum(best, stats.best))


def _grad_chunk_torch(x: Tensor, target: Tensor, lse: Tensor, scale: Tensor, v0: int, vocab: int, o: CEOptions):
    raw = x.float()
    z = o.softcap * torch.tanh(raw / o.softcap) if o.softcap else raw
    g = torch.exp(z - lse[:, None]) * (1.0 + 2.0 * o.z_loss * lse[:, None]) - o.label_smoothing / vocab
    local = target - v0
    inside = (local >= 0) & (local < z.shape[1])
    hit = torch.where(inside, o.label_smoothing - 1.0, 0.0).unsqueeze(1)  # no host sync (unlike nonzero)
    g.scatter_add_(1, local.clamp(0, z.shape[1] - 1).unsqueeze(1), hit)
    if o.softcap:
        g = g * (1.0 - (z / o.softcap) ** 2)
    x.copy_(g * scale[:, None])


def fold_lse(x: Tensor, target: Tensor, stats: RowStats, v0: int, opts: CEOptions, triton_path: bool) -> None:
    # folds the logits chunk x (tokens x columns from v0) into the running statistics
    if not triton_path:
        _lse_chunk_torch(x, target, stats, v0, opts)
        return
    _lse_kernel[(x.shape[0],)](
        x, x.stride(0), target, stats.max, stats.sumexp, stats.target_logit, stats.sum_z, stats.best, stats.best_idx,
        x.shape[1], v0, float(opts.softcap or 1.0),
        HAS_SOFTCAP=bool(opts.softcap), SUM_Z=bool(opts.label_smoothing), ARGMAX=opts.return_correct,
    )  # fmt: skip


def logits_to_grad(x: Tensor, target: Tensor, lse: Tensor, scale: Tensor, v0: int, vocab: int, opts: CEOptions,
                   triton_path: bool) -> None:  # fmt: skip
    # overwrites the logits chunk x with dloss/dx times each token's scale
    if not triton_path:
        _grad_chunk_torch(x, target, lse, scale, v0, vocab, opts)
        return
    _grad_kernel[(x.shape[0],)](
        x, x.stride(0), target, lse, scale, x.shape[1], v0, vocab, float(opts.softcap or 1.0),
        float(opts.label_smoothing), float(opts.z_loss), HAS_SOFTCAP=bool(opts.softcap),
    )  # fmt: skip


def fold_lse_and_grad(x: Tensor, target: Tensor, stats: RowStats, lse: Tensor, scale: Tensor, opts: CEOptions,
                      triton_path: bool) -> None:  # fmt: skip
    # x: the logits of a token chunk over the whole vocabulary, and fresh statistics for its tokens: fills them and
    # lse, and overwrites x with dloss/dx times each token's scale
    if not triton_path:
        _lse_chunk_torch(x, target, stats, 0, opts)
        torch.add(stats.max, torch.log(stats.sumexp), out=lse)
        _grad_chunk_torch(x, target, lse, scale, 0, x.shape[1], opts)
        return
    _lse_grad_kernel[(x.shape[0],)](
        x, x.stride(0), target, stats.max, stats.sumexp, stats.target_logit, stats.sum_z, stats.best_idx, lse, scale,
        x.shape[1], float(opts.softcap or 1.0), float(opts.label_smoothing), float(opts.z_loss),
        HAS_SOFTCAP=bool(opts.softcap), SUM_Z=bool(opts.label_smoothing), ARGMAX=opts.return_correct,
    )  # fmt: skip


def scale_into(src: Tensor, factor: Tensor, out: Tensor) -> Tensor:
    """``out = src * factor`` (``out`` may be ``src``); factor: a 0-dim fp32 tensor on src's device. On CUDA one
    pass over memory: torch's ``mul`` by a 0-dim device tensor takes a strided, non-vectorized kernel (2.5 ms for a
    128k x 4096 bf16 head's gradient on an H100, against 0.74) and rounds the factor to src's dtype first."""
    if not (src.is_cuda and src.is_contiguous() and out.is_contiguous()):
        return torch.mul(src, factor, out=out)
    block = 4096
    _scale_kernel[(triton.cdiv(src.numel(), block),)](src, out, factor, src.numel(), BLOCK=block, num_warps=8)
    return out


def token_losses(stats: RowStats, target: Tensor, vocab: int, opts: CEOptions):
    lse = stats.max + torch.log(stats.sumexp)
    valid = target != opts.ignore_index
    eps = opts.label_smoothing
    loss = lse - (1.0 - eps) * stats.target_logit - (eps / vocab) * stats.sum_z + opts.z_loss * lse * lse
    loss = torch.where(valid, loss, 0.0)
    correct = (stats.best_idx == target) & valid if opts.return_correct else None
    return loss, lse, correct
