"""Fused linear cross-entropy: the loss of ``hidden @ weight.T (+ bias)`` without the (tokens x vocabulary) logits.

Two ways to walk the (tokens x vocabulary) matrix (the kernels for one chunk are in ``cross_entropy_chunk.py``):

- **One pass, token chunks** (the default when a gradient is wanted and, on CUDA, there is room). The forward
  computes each token chunk's logits over the whole vocabulary, its log-sum-exp, its gradient in place, and both
  gradient matmuls: 3 x 2NHV FLOPs, as plain PyTorch. The hidden gradient of a chunk is one matmul over the
  vocabulary; the weight gradient is summed over the chunks in the weight's own dtype, by cuBLAS in fp32 with one
  rounding per chunk, so there are at most ``Tuning.max_token_chunks`` of them (the more roundings, the farther
  from fp64: ``Tuning``). The gradients wait, in the weights' dtype, as saved tensors; the backward scales them in
  place by the incoming gradient (Liger-Kernel's FLCE also computes its gradients in the forward).
- **Two passes, vocabulary chunks** (no gradient wanted, ``reduction="none"``, no room on the GPU for the one pass,
  or ``one_pass=False``). Pass 1 (forward) computes each chunk's logits with one matmul and folds them into a running
  log-sum-exp per token. Pass 2 (backward) recomputes each chunk's logits, turns them into their gradient in place,
  and takes two matmuls: the hidden gradient accumulates in fp32 across chunks, and the weight gradient of the chunk
  comes from one matmul over *all* tokens, rounded once. A fourth matmul (the recompute): 4 x 2NHV FLOPs.

Per token t with logits z (after the optional soft-cap ``c * tanh(x / c)``), target y, smoothing e, z-loss a:

    lse = log(sum_j exp z_j)
    loss = lse - (1 - e) * z_y - (e / V) * sum_j z_j + a * lse^2
    dloss/dz_j = softmax_j * (1 + 2 a lse) - (1 - e) [j == y] - e / V        (times 1 - (z_j / c)^2 for the cap)

Layering (as Liger-Kernel's): chunk kernels -> walks ``flce_one_pass`` / ``flce_forward`` + ``flce_backward`` ->
``FusedLinearCrossEntropyFunction`` -> ``FusedLinearCrossEntropy`` (module) -> ``fused_linear_cross_entropy``.
``fused_linear_cross_entropy_ref`` is the readable full-logits reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .cross_entropy_chunk import (
    _INTERPRET,
    CEOptions,
    RowStats,
    fold_lse,
    fold_lse_and_grad,
    logits_to_grad,
    scale_into,
    token_losses,
)
from .tunable import Tunable


@dataclass(frozen=True)
class Tuning:
    """How the loss walks the (tokens x vocabulary) matrix; benchmarks and tests change it with :func:`tuning`.

    Args:
        triton: the Triton kernels (``True``) or the same algorithm in torch ops (``False``); ``None``: Triton on CUDA
            (and on the CPU under ``TRITON_INTERPRET=1``).
        one_pass: the walk when a call does not say (module docstring); ``None``: one pass where a gradient is wanted
            and, on CUDA, there is room for it.
        chunk_elements: logits per vocabulary chunk (N x Vc) of the two-pass walk, 64 MiB in bf16 ...
        min_chunk_cols: ... but at least this many vocabulary columns: every chunk reads and writes the fp32 hidden
            gradient (N x H) once.
        one_pass_chunk_elements: logits per token chunk (n x V) of the one pass, 256 MiB in bf16 ...
        max_token_chunks: ... or larger chunks, so that there are at most this many: each rounds the weight
            gradient's running sum once (in bf16, 8 chunks put it 1.27x as far from fp32 as plain bf16's at 8k tokens,
            H 4096 and V 128k, 1.84x at 32k; ``benchmarks/NOTES.md``) ...
        min_chunk_rows: ... in whole tiles of this many tokens for the matmuls.
    """

    triton: bool | None = None
    one_pass: bool | None = None
    chunk_elements: int = 1 << 25
    min_chunk_cols: int = 4096
    one_pass_chunk_elements: int = 1 << 27
    max_token_chunks: int = 8
    min_chunk_rows: int = 128


# tuning(**changes): a context within which the loss walks the matrix as ``Tuning(**changes)`` says
tuning = Tunable(Tuning())


_REDUCTIONS = ("mean", "sum", "none")


def _use_triton(t: Tensor) -> bool:
    return tuning.value.triton if tuning.value.triton is not None else _INTERPRET or t.is_cuda


def _vocab_cols(n: int, vocab: int) -> int:
    # vocabulary columns per chunk of the two-pass walk
    size = min(vocab, max(tuning.value.min_chunk_cols, tuning.value.chunk_elements // max(n, 1)))
    return size - size % 128 if 128 <= size < vocab else size  # whole tiles for the matmuls


def _token_rows(n: int, vocab: int) -> int:
    # tokens per chunk of the one pass: the logits budget's, or more where that would make over max_token_chunks
    walk, tile = tuning.value, tuning.value.min_chunk_rows
    budget = max(tile, walk.one_pass_chunk_elements // vocab // tile * tile)
    fewest = -(-n // walk.max_token_chunks)
    return max(1, min(n, max(budget, -(-fewest // tile) * tile)))


def workspace_bytes(tokens: int, vocab: int, hidden: int, itemsize: int, one_pass: bool, retained: bool = False) -> int:
    """Device bytes the loss takes at its largest beside its inputs: a chunk of logits, and with one pass the
    gradients of the head and the hidden states, which it holds from forward to backward, and their scaled copies
    where a backward keeps the graph (``retained``: the "norm-first" schedule's first pass)."""
    if one_pass:
        grads = (vocab + tokens) * hidden * (2 if retained else 1)
        return itemsize * (_token_rows(tokens, vocab) * vocab + grads)
    return itemsize * tokens * _vocab_cols(tokens, vocab)


def _chunk_logits(h: Tensor, weight: Tensor, bias: Tensor | None, v0: int, v1: int, buf: Tensor) -> Tensor:
    # h: (N, H) in the weight's dtype; x = h @ W[v0:v1].T + b[v0:v1]: (N, v1 - v0), written over the front of buf,
    # the walk's one buffer for every chunk (a new tensor each would keep the last chunk alive beside the next)
    x = buf[: h.shape[0] * (v1 - v0)].view(h.shape[0], v1 - v0)
    if bias is None:
        return torch.mm(h, weight[v0:v1].t(), out=x)
    return torch.addmm(bias[v0:v1].to(h.dtype), h, weight[v0:v1].t(), out=x)


def _vocab_chunks(h: Tensor, weight: Tensor, bias: Tensor | None):
    # the two-pass walk: (v0, the logits of the vocabulary chunk from v0), every chunk in one buffer
    n, vocab = h.shape[0], weight.shape[0]
    size = _vocab_cols(n, vocab)
    buf = h.new_empty(n * size)
    for v0 in range(0, vocab, size):
        yield v0, _chunk_logits(h, weight, bias, v0, min(vocab, v0 + size), buf)


def flce_forward(hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, opts: CEOptions):
    """Pass 1 of two. hidden: (N, H), weight: (V, H), target: (N,).

    Returns:
        per-token loss (N,) fp32 (0 where ignored), lse (N,) fp32, per-token correctness (N,) bool or None.
    """
    n, vocab = hidden.shape[0], weight.shape[0]
    h = hidden.to(weight.dtype)
    stats = RowStats.empty(n, hidden.device)
    for v0, x in _vocab_chunks(h, weight, bias):
        fold_lse(x, target, stats, v0, opts, _use_triton(h))
    return token_losses(stats, target, vocab, opts)


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
    for v0, x in _vocab_chunks(h, weight, bias):
        v1 = v0 + x.shape[1]
        logits_to_grad(x, target, lse, scale, v0, vocab, opts, _use_triton(h))
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
        per-token loss (N,) fp32, per-token correctness or None, and the gradients of hidden (N, H) and weight
        (V, H) in the weight's dtype and of the bias (V,) in fp32, each None where not wanted.
    """
    n, vocab = hidden.shape[0], weight.shape[0]
    h = hidden.to(weight.dtype)
    triton_path = _use_triton(h)
    stats = RowStats.empty(n, hidden.device)
    lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
    grad_h = torch.empty_like(h) if need_hidden_grad else None
    grad_w = (torch.empty_like if n else torch.zeros_like)(weight) if need_weight_grad else None  # no tokens: 0
    grad_b = torch.zeros(vocab, dtype=torch.float32, device=hidden.device) if bias is not None else None
    rows = _token_rows(n, vocab)
    buf = h.new_empty(rows * vocab)
    for t0 in range(0, n, rows):
        t1 = min(n, t0 + rows)
        chunk = RowStats(*(t[t0:t1] for t in vars(stats).values()))
        x = _chunk_logits(h[t0:t1], weight, bias, 0, vocab, buf)
        fold_lse_and_grad(x, target[t0:t1], chunk, lse[t0:t1], scale[t0:t1], opts, triton_path)
        if grad_h is not None:
            torch.mm(x, weight, out=grad_h[t0:t1])  # the whole vocabulary in one matmul
        if grad_w is not None:  # summed over the chunks: cuBLAS adds in fp32 and rounds once per chunk
            torch.mm(x.t(), h[t0:t1], out=grad_w) if t0 == 0 else grad_w.addmm_(x.t(), h[t0:t1])
        if grad_b is not None:
            grad_b += x.sum(0, dtype=torch.float32)
    loss, _, correct = token_losses(stats, target, vocab, opts)
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
    # the walk to take (module docstring)
    if opts.reduction == "none" or not any(wants[:3]):
        return False
    chosen = opts.one_pass if opts.one_pass is not None else tuning.value.one_pass
    if chosen is not None or not hidden.is_cuda:
        return chosen is not False
    need = workspace_bytes(hidden.shape[0], weight.shape[0], hidden.shape[1], weight.element_size(), True)
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


def _scale_one_pass(saved: tuple, dtypes: tuple, factor: Tensor) -> list[Tensor | None]:
    """The one pass's gradients (computed for an incoming gradient of 1) times ``factor``, in the inputs' dtypes.

    A backward that frees the graph scales them in place, without a second copy of the head's gradient (1 GiB for a
    bf16 head of 128k x 4096); one that keeps it (``retain_graph``) gets scaled copies, and the saved stay as they
    are for the next.
    """
    in_place = not _keeps_graph()
    scaled = []
    for g, dtype in zip(saved, dtypes):
        if g is not None:
            g = scale_into(g, factor, g if in_place and g.dtype == dtype else torch.empty_like(g, dtype=dtype))
        scaled.append(g)
    return scaled


def _keeps_graph() -> bool:
    # whether the running backward retains the graph (the private query AOTAutograd asks too; absent: assume so)
    query = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return query is None or query()


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
            return (*_scale_one_pass(ctx.saved_tensors, ctx.dtypes, grad_out.float()), None, None, None)
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
        one_pass: walk the tokens in one pass (``True``) or the vocabulary in two (``False``); ``None``: as
            ``Tuning.one_pass`` says, by default one pass when a gradient is wanted and, on CUDA, there is room for it
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
