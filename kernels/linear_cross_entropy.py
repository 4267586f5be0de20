"""Fused linear cross-entropy: the loss of ``hidden @ weight.T (+ bias)`` without the (tokens x vocabulary) logits.

Two ways to walk the (tokens x vocabulary) matrix, both rounding each gradient once, as plain PyTorch does:

- **Two passes, vocabulary chunks** (fewer tokens than ``Tuning.one_pass_min_tokens``, no gradient wanted, or no room
  on the GPU for the one pass; ``one_pass=`` forces either). Pass 1
  (forward) computes each chunk's logits with one matmul and folds them into a running log-sum-exp per token
  (``_lse_kernel``). Pass 2 (backward) recomputes each chunk's logits, turns them into their gradient in place
  (``_grad_kernel``), and takes two matmuls: the hidden gradient accumulates in fp32 across chunks, and the weight
  gradient of the chunk comes from one matmul over *all* tokens. No fp32 (vocabulary x hidden) buffer, at the cost
  of a fourth matmul (the recompute): 4 x 2NHV FLOPs instead of 3 x 2NHV.
- **One pass, token chunks** (many tokens, a gradient wanted, and on CUDA room for it). The forward computes each
  token chunk's logits over the whole vocabulary, its log-sum-exp, its gradient in place, and both gradient
  matmuls; the weight gradient accumulates in an fp32 (vocabulary x hidden) buffer, the hidden gradient is one
  matmul per chunk. The backward only scales them by the incoming gradient. 3 x 2NHV FLOPs, for 4 bytes per head
  parameter of device memory between forward and backward (Liger-Kernel's FLCE also computes its gradients in the
  forward). They are saved tensors of the autograd node, so its backward frees them at once (unless the graph is
  retained).

Per token t with logits z (after the optional soft-cap ``c * tanh(x / c)``), target y, smoothing e, z-loss a:

    lse = log(sum_j exp z_j)
    loss = lse - (1 - e) * z_y - (e / V) * sum_j z_j + a * lse^2
    dloss/dz_j = softmax_j * (1 + 2 a lse) - (1 - e) [j == y] - e / V        (times 1 - (z_j / c)^2 for the cap)

Layering (as Liger-Kernel's): Triton kernels -> launchers ``flce_forward`` / ``flce_backward`` ->
``FusedLinearCrossEntropyFunction`` -> ``FusedLinearCrossEntropy`` (module) -> ``fused_linear_cross_entropy``.
``fused_linear_cross_entropy_ref`` is the readable full-logits reference. On the CPU (without
``TRITON_INTERPRET=1``) the two kernels' work is done by the equivalent torch ops in ``_lse_chunk_torch`` and
``_grad_chunk_torch``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from .tunable import Tunable

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class Tuning:
    """How the loss walks the (tokens x vocabulary) matrix; benchmarks and tests change it with :func:`tuning`.

    Args:
        triton: the Triton kernels (``True``) or the same algorithm in torch ops (``False``); ``None``: Triton on CUDA
            (and on the CPU under ``TRITON_INTERPRET=1``).
        chunk_elements: logits per vocabulary chunk (N x Vc) of the two-pass walk, 64 MiB in bf16 ...
        min_chunk_cols: ... but at least this many vocabulary columns: every chunk reads and writes the fp32 hidden
            gradient (N x H) once.
        one_pass_min_tokens: from this many tokens the loss takes one pass (module docstring): at 32k tokens and a
            128k vocabulary the recompute costs more than the fp32 weight gradient; below, less.
        one_pass_chunk_elements: logits per token chunk (n x V) of the one-pass walk, 1 GiB in bf16 ...
        min_chunk_rows: ... but at least this many tokens (whole tiles for the matmuls).
    """

    triton: bool | None = None
    chunk_elements: int = 1 << 25
    min_chunk_cols: int = 4096
    one_pass_min_tokens: int = 16384
    one_pass_chunk_elements: int = 1 << 29
    min_chunk_rows: int = 128


# tuning(**changes): a context within which the loss walks the matrix as ``Tuning(**changes)`` says
tuning = Tunable(Tuning())


_REDUCTIONS = ("mean", "sum", "none")


def _configs() -> list[triton.Config]:
    # NOTE: one config when interpreting: multi-config autotuning fails under TRITON_INTERPRET=1.
    if _INTERPRET:
        return [triton.Config({"BLOCK_V": 256}, num_warps=4)]
    return [triton.Config({"BLOCK_V": b}, num_warps=w) for b in (1024, 2048, 4096) for w in (4, 8, 16)]


# NOTE: both kernels update their arguments in place; restore_value keeps autotuning's trial runs from compounding.
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
    # Folds the chunk into the row's running max m and sum of exp(z - m) (online softmax), picks z[target].
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    target = tl.load(target_ptr + row) - col_offset
    m = tl.load(max_ptr + row)
    s = tl.load(sumexp_ptr + row)
    z_target = tl.load(target_logit_ptr + row)
    sum_z = 0.0
    best = tl.full((), float("-inf"), tl.float32)
    best_idx = tl.zeros((), tl.int64)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        inside = cols < n_cols
        z = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            z = softcap * _tanh(z / softcap)
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
    base = logits_ptr + row * stride_row
    target = tl.load(target_ptr + row) - col_offset
    lse = tl.load(lse_ptr + row)
    scale = tl.load(scale_ptr + row)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        inside = cols < n_cols
        z = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            z = softcap * _tanh(z / softcap)
        g = tl.exp(z - lse) * (1.0 + 2.0 * z_loss * lse) - smoothing / vocab
        g = tl.where(cols == target, g - (1.0 - smoothing), g)
        if HAS_SOFTCAP:
            g = g * (1.0 - (z / softcap) * (z / softcap))
        tl.store(base + cols, (g * scale).to(logits_ptr.dtype.element_ty), mask=inside)


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
class _RowStats:
    """Per-token running statistics of pass 1 (all fp32 except ``best_idx``)."""

    max: Tensor
    sumexp: Tensor
    target_logit: Tensor
    sum_z: Tensor
    best: Tensor
    best_idx: Tensor

    @classmethod
    def empty(cls, n: int, device: torch.device) -> _RowStats:
        def full(value, dtype=torch.float32):
            return torch.full((n,), value, dtype=dtype, device=device)

        return cls(full(float("-inf")), full(0.0), full(0.0), full(0.0), full(float("-inf")), full(0, torch.int64))


def _use_triton(t: Tensor) -> bool:
    return tuning.value.triton if tuning.value.triton is not None else _INTERPRET or t.is_cuda


def _chunks(n: int, vocab: int):
    size = min(vocab, max(tuning.value.min_chunk_cols, tuning.value.chunk_elements // max(n, 1)))
    if 128 <= size < vocab:
        size -= size % 128  # whole tiles for the matmuls
    for v0 in range(0, vocab, size):
        yield v0, min(vocab, v0 + size)


def _chunk_logits(h: Tensor, weight: Tensor, bias: Tensor | None, v0: int, v1: int) -> Tensor:
    # h: (N, H) in the weight's dtype; returns x = h @ W[v0:v1].T + b[v0:v1]: (N, v1 - v0)
    if bias is None:
        return h @ weight[v0:v1].t()
    return torch.addmm(bias[v0:v1].to(h.dtype), h, weight[v0:v1].t())


def _lse_chunk_torch(x: Tensor, target: Tensor, stats: _RowStats, v0: int, opts: CEOptions) -> None:
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


def _token_chunks(n: int, vocab: int):
    size = min(n, max(tuning.value.min_chunk_rows, tuning.value.one_pass_chunk_elements // vocab))
    if tuning.value.min_chunk_rows <= size < n:
        size -= size % tuning.value.min_chunk_rows
    for t0 in range(0, n, size):
        yield t0, min(n, t0 + size)


def _fold_lse(x: Tensor, target: Tensor, stats: _RowStats, v0: int, opts: CEOptions) -> None:
    # folds the logits chunk x (tokens x columns from v0) into the running statistics
    if not _use_triton(x):
        _lse_chunk_torch(x, target, stats, v0, opts)
        return
    _lse_kernel[(x.shape[0],)](
        x, x.stride(0), target, stats.max, stats.sumexp, stats.target_logit, stats.sum_z, stats.best, stats.best_idx,
        x.shape[1], v0, float(opts.softcap or 1.0),
        HAS_SOFTCAP=bool(opts.softcap), SUM_Z=bool(opts.label_smoothing), ARGMAX=opts.return_correct,
    )  # fmt: skip


def _logits_to_grad(x: Tensor, target: Tensor, lse: Tensor, scale: Tensor, v0: int, vocab: int, opts: CEOptions):
    # overwrites the logits chunk x with dloss/dx times each token's scale
    if not _use_triton(x):
        _grad_chunk_torch(x, target, lse, scale, v0, vocab, opts)
        return
    _grad_kernel[(x.shape[0],)](
        x, x.stride(0), target, lse, scale, x.shape[1], v0, vocab, float(opts.softcap or 1.0),
        float(opts.label_smoothing), float(opts.z_loss), HAS_SOFTCAP=bool(opts.softcap),
    )  # fmt: skip


def _token_losses(stats: _RowStats, target: Tensor, vocab: int, opts: CEOptions):
    lse = stats.max + torch.log(stats.sumexp)
    valid = target != opts.ignore_index
    eps = opts.label_smoothing
    loss = lse - (1.0 - eps) * stats.target_logit - (eps / vocab) * stats.sum_z + opts.z_loss * lse * lse
    loss = torch.where(valid, loss, 0.0)
    correct = (stats.best_idx == target) & valid if opts.return_correct else None
    return loss, lse, correct


def flce_forward(hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, opts: CEOptions):
    """Pass 1 of two. hidden: (N, H), weight: (V, H), target: (N,).

    Returns:
        per-token loss (N,) fp32 (0 where ignored), lse (N,) fp32, per-token correctness (N,) bool or None.
    """
    n, vocab = hidden.shape[0], weight.shape[0]
    h = hidden.to(weight.dtype)
    stats = _RowStats.empty(n, hidden.device)
    for v0, v1 in _chunks(n, vocab):
        _fold_lse(_chunk_logits(h, weight, bias, v0, v1), target, stats, v0, opts)
    return _token_losses(stats, target, vocab, opts)


def flce_backward(hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, lse: Tensor, scale: Tensor,
                  opts: CEOptions, need_weight_grad: bool):  # fmt: skip
    """Pass 2 of two. scale: (N,) fp32, dloss_total/dloss_token (0 where ignored).

    Returns:
        grad_hidden (N, H) in hidden's dtype, grad_weight (V, H) in weight's dtype or None, grad_bias or None.
    """
    n, vocab = hidden.shape[0], weight.shape[0]
    h = hidden.to(weight.dtype)
    grad_h = torch.zeros(n, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    grad_w = torch.empty_like(weight) if need_weight_grad else None
    grad_b = torch.empty(vocab, dtype=torch.float32, device=hidden.device) if bias is not None else None
    for v0, v1 in _chunks(n, vocab):
        x = _chunk_logits(h, weight, bias, v0, v1)
        _logits_to_grad(x, target, lse, scale, v0, vocab, opts)
        _add_matmul(grad_h, x, weight[v0:v1])  # dh += dz @ W_c, summed over chunks in fp32
        if grad_w is not None:
            torch.mm(x.t(), h, out=grad_w[v0:v1])  # dW_c = dz.T @ h: one matmul over all tokens
        if grad_b is not None:
            grad_b[v0:v1] = x.sum(0, dtype=torch.float32)
    return grad_h.to(hidden.dtype), grad_w, None if grad_b is None else grad_b.to(bias.dtype)


def flce_one_pass(hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, scale: Tensor,
                  opts: CEOptions, need_hidden_grad: bool, need_weight_grad: bool):  # fmt: skip
    """The loss and its gradients in one walk over token chunks. scale: as in :func:`flce_backward`.

    Returns:
        per-token loss (N,) fp32, per-token correctness or None, and the fp32 gradients of hidden (N, H), weight
        (V, H) and bias (V,), each None where not wanted.
    """
    n, vocab = hidden.shape[0], weight.shape[0]
    h = hidden.to(weight.dtype)
    stats = _RowStats.empty(n, hidden.device)
    lse = torch.empty(n, dtype=torch.float32, device=hidden.device)

    def zeros(*shape):
        return torch.zeros(*shape, dtype=torch.float32, device=hidden.device)

    grad_h = zeros(n, hidden.shape[1]) if need_hidden_grad else None
    grad_w = zeros(vocab, hidden.shape[1]) if need_weight_grad else None
    grad_b = zeros(vocab) if bias is not None else None
    for t0, t1 in _token_chunks(n, vocab):
        rows = _RowStats(*(t[t0:t1] for t in vars(stats).values()))
        x = _chunk_logits(h[t0:t1], weight, bias, 0, vocab)
        _fold_lse(x, target[t0:t1], rows, 0, opts)
        torch.add(rows.max, torch.log(rows.sumexp), out=lse[t0:t1])
        _logits_to_grad(x, target[t0:t1], lse[t0:t1], scale[t0:t1], 0, vocab, opts)
        if grad_h is not None:
            _add_matmul(grad_h[t0:t1], x, weight)  # the whole vocabulary in one matmul
        if grad_w is not None:
            _add_matmul(grad_w, x.t(), h[t0:t1])  # summed over token chunks in fp32
        if grad_b is not None:
            grad_b += x.sum(0, dtype=torch.float32)
    loss, _, correct = _token_losses(stats, target, vocab, opts)
    return loss, correct, (grad_h, grad_w, grad_b)


def _add_matmul(acc: Tensor, a: Tensor, b: Tensor) -> None:
    # acc (fp32) += a @ b. On CUDA one cuBLAS call with an fp32 output accumulates without rounding the partial
    # product to bf16 and without a temporary of acc's size; elsewhere the product is upcast and added.
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.is_cuda:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc += (a @ b).to(acc.dtype)


def _one_pass(hidden: Tensor, weight: Tensor, opts: CEOptions, wants: tuple[bool, ...]) -> bool:
    # the walk to take (module docstring); on CUDA the one pass needs room for its fp32 gradients and a logits chunk
    if opts.one_pass is not None:
        return opts.one_pass and any(wants[:3])
    n, vocab = hidden.shape[0], weight.shape[0]
    if opts.reduction == "none" or n < tuning.value.one_pass_min_tokens or not any(wants[:3]):
        return False
    if not hidden.is_cuda:
        return True
    rows = next(_token_chunks(n, vocab))[1]
    need = 4 * (vocab + n) * hidden.shape[1] + weight.element_size() * rows * vocab
    return need <= device_room(hidden.device)


def device_room(device: torch.device) -> int:
    """Bytes the caching allocator may still hand out on the CUDA ``device``: its free memory and cached blocks,
    within the process's cap (``torch.cuda.set_per_process_memory_fraction``)."""
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    cap = int(torch.cuda.get_per_process_memory_fraction(device) * total)
    return min(free + torch.cuda.memory_reserved(device) - allocated, cap - allocated)


def _token_scale(grad: Tensor, valid: Tensor, normalizer, reduction: str) -> Tensor:
    # dloss_total/dloss_token for an incoming gradient `grad` of the reduced loss; 0 where ignored
    if reduction == "none" or (normalizer is None and reduction == "sum"):
        scale = grad
    elif normalizer is not None:
        scale = grad / normalizer
    else:
        scale = grad / valid.sum().clamp_min(1)
    return torch.where(valid, scale.expand(valid.shape), 0.0).contiguous()


def _scaled(grad: Tensor | None, factor: Tensor, dtype: torch.dtype) -> Tensor | None:
    # grad * factor in dtype, rounded once, leaving grad (kept by the graph) as it is
    return None if grad is None else torch.mul(grad, factor, out=torch.empty_like(grad, dtype=dtype))


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, normalizer, opts: CEOptions):
        valid = target != opts.ignore_index
        wants = ctx.needs_input_grad
        ctx.one_pass = _one_pass(hidden, weight, opts, wants)
        if ctx.one_pass:
            scale = _token_scale(torch.ones((), device=hidden.device), valid, normalizer, opts.reduction)
            loss, correct, grads = flce_one_pass(hidden, weight, bias, target, scale, opts, wants[0], wants[1])
            ctx.save_for_backward(*grads)  # freed by the backward, kept where the graph is retained
        else:
            loss, lse, correct = flce_forward(hidden, weight, bias, target, opts)
            ctx.save_for_backward(hidden, weight, bias, target, lse)
        if opts.reduction == "none":
            out = loss
        elif normalizer is not None:
            out = loss.sum() / normalizer
        elif opts.reduction == "mean":
            out = loss.sum() / valid.sum().clamp_min(1)  # all ignored: 0, not NaN; no host sync
        else:
            out = loss.sum()
        ctx.normalizer, ctx.opts = normalizer, opts
        ctx.dtypes = tuple(None if t is None else t.dtype for t in (hidden, weight, bias))
        if correct is not None:
            ctx.mark_non_differentiable(correct)
            return out, correct
        return out

    @staticmethod
    def backward(ctx, grad_out, *_):
        if ctx.one_pass:  # the one-pass walk computed them for an incoming gradient of 1
            factor = grad_out.float()
            grads = (_scaled(g, factor, dtype) for g, dtype in zip(ctx.saved_tensors, ctx.dtypes))
            return (*grads, None, None, None)
        hidden, weight, bias, target, lse = ctx.saved_tensors
        opts = ctx.opts
        scale = _token_scale(grad_out.float(), target != opts.ignore_index, ctx.normalizer, opts.reduction)
        grad_h, grad_w, grad_b = flce_backward(hidden, weight, bias, target, lse, scale, opts, ctx.needs_input_grad[1])
        return grad_h, grad_w, grad_b, None, None, None


def fused_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    normalizer: Tensor | float | None = None,
    return_correct: bool = False,
    check_targets: bool = False,
    one_pass: bool | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``target``, without materializing the logits.

    Args:
        hidden: (N, H) hidden states; cast to the weight's dtype for the matmuls (as autocast would).
        weight: (V, H) output head weight.
        target: (N,) integer class ids; ``ignore_index`` marks tokens without a loss.
        bias: optional (V,) bias.
        ignore_index: target value that contributes nothing.
        reduction: ``"mean"`` over non-ignored tokens (all ignored: 0, with zero gradients), ``"sum"``, or
            ``"none"`` (per-token losses, 0 where ignored).
        label_smoothing: as in ``torch.nn.functional.cross_entropy``.
        z_loss: coefficient of ``logsumexp(logits)^2`` per non-ignored token.
        softcap: Gemma-style ``softcap * tanh(logits / softcap)`` before the softmax.
        normalizer: divide the summed loss by this instead of the valid-token count (e.g. Hugging Face's
            ``num_items_in_batch``); with it, ``reduction`` must not be ``"none"``.
        return_correct: also return (N,) booleans ``argmax(logits) == target`` (False where ignored).
        check_targets: verify every target is in ``[0, V)`` or ``ignore_index`` (needs a host sync; always done
            on the CPU).
        one_pass: walk the tokens in one pass (``True``) or the vocabulary in two (``False``); ``None``: one pass
            from ``Tuning.one_pass_min_tokens`` tokens when a gradient is wanted and, on CUDA, there is room for it
            (module docstring). One pass needs ``reduction`` "mean" or "sum".

    Returns:
        the loss, and with ``return_correct`` the per-token correctness.
    """
    _check(hidden, weight, target, bias, reduction, label_smoothing, z_loss, softcap, normalizer)
    if one_pass and reduction == "none":
        raise ValueError("one_pass=True computes the gradient of a reduced loss; use reduction 'mean' or 'sum'.")
    if check_targets or not hidden.is_cuda:
        _check_target_range(target, weight.shape[0], ignore_index)
    opts = CEOptions(ignore_index, reduction, float(label_smoothing), float(z_loss), softcap, return_correct, one_pass)
    return FusedLinearCrossEntropyFunction.apply(hidden, weight, bias, target.contiguous(), normalizer, opts)


class FusedLinearCrossEntropy(torch.nn.Module):
    """Module form of :func:`fused_linear_cross_entropy`; ``forward(hidden, weight, target, bias=None)``."""

    def __init__(self, **options) -> None:
        super().__init__()
        self.options = options

    def forward(self, hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None):
        return fused_linear_cross_entropy(hidden, weight, target, bias, **self.options)


def fused_linear_cross_entropy_ref(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    normalizer: Tensor | float | None = None,
) -> Tensor:
    """The readable reference: full logits, then torch's cross-entropy (plus z-loss and soft-cap)."""
    logits = F.linear(hidden, weight, bias).float()
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    valid = target != ignore_index
    per_token = F.cross_entropy(
        logits, target, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing
    )
    per_token = per_token + z_loss * torch.logsumexp(logits, dim=-1) ** 2 * valid
    if reduction == "none":
        return per_token
    if normalizer is not None:
        return per_token.sum() / normalizer
    if reduction == "sum":
        return per_token.sum()
    return per_token.sum() / valid.sum().clamp_min(1)


def _check(hidden, weight, target, bias, reduction, label_smoothing, z_loss, softcap, normalizer) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be (N, H) and weight (V, H) with the same H; got {tuple(hidden.shape)} and"
            f" {tuple(weight.shape)}."
        )
    if not hidden.is_floating_point() or not weight.is_floating_point():
        raise TypeError(f"hidden and weight must be floating point; got {hidden.dtype} and {weight.dtype}.")
    if target.shape != hidden.shape[:1] or target.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"target must be ({hidden.shape[0]},) int64 or int32; got {tuple(target.shape)} {target.dtype}."
        )
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must be ({weight.shape[0]},); got {tuple(bias.shape)}.")
    devices = {t.device for t in (hidden, weight, target, bias) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"hidden, weight, target and bias must be on one device; got {sorted(map(str, devices))}.")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}; got {reduction!r}.")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1); got {label_smoothing}.")
    if z_loss < 0:
        raise ValueError(f"z_loss must be >= 0; got {z_loss}.")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be None or > 0; got {softcap}.")
    if normalizer is not None and reduction == "none":
        raise ValueError("normalizer divides a summed loss; it cannot be combined with reduction='none'.")


def _check_target_range(target: Tensor, vocab: int, ignore_index: int) -> None:
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"target[{i}] = {int(target[i])} is outside [0, {vocab}) and is not ignore_index={ignore_index}."
        )
