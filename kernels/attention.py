"""Flash attention for training (FlashAttention-2 algorithm, written for Triton): causal or not, grouped-query
(GQA/MQA), sliding window, and packed variable-length sequences, with forward and backward.

Every call runs the variable-length kernels: a dense batch (B, S, H, D) is the packed layout (B*S, H, D) with
sequence boundaries every S tokens, so the dense and packed cases share one code path.

    forward, per (query block, sequence, query head; a GQA group's heads share a program, ``_query_rows``):
        s = q k^T * scale;  online softmax over key blocks: m = running max, l = running sum of exp(s - m)
        o = sum_j softmax(s)_j v_j;  lse = m + log(l)   (kept for backward)
    backward: delta = rowsum(dO * O);  p = exp(s - lse);  dv = p^T dO;  dp = dO v^T;  ds = p (dp - delta)
              dq = ds k * scale (per query block; this kernel runs first and writes its rows' delta);
              dk = ds^T q * scale (per key block, from the transposed scores s^T = k q^T, summed over the group's
              query heads in one program, so GQA needs no atomics; where few query blocks see the key block, the
              group's heads share one loop; when there are too few programs to fill the GPU, one program per query
              head writes fp32 partial sums that are added up afterwards, as FlashAttention-2 does for GQA)

Every kernel's grid is (blocks, heads, sequences) with the sequences longest first (``_sequences``), so the longest
documents' programs, the heaviest, start first.

Masks: key j is visible to query i (positions within one sequence) iff j < len, and with ``causal`` j <= i, and
with ``window`` W also i - W < j (Hugging Face's sliding-window convention). Nothing crosses sequences.

Layering (as Liger-Kernel's): the Triton programs (``attention_triton.py``) -> ``flash_attention_forward`` /
``flash_attention_backward`` -> ``FlashKernel`` (one call's) -> ``FlashAttentionFunction`` -> ``flash_attention`` ->
``FlashAttention`` (module); ``flash_attention_ref`` is the readable reference.
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
from torch import Tensor

from .attention_triton import _INTERPRET, _bwd_dkdv_kernel, _bwd_dq_kernel, _fwd_kernel
from .tunable import Tunable

HEAD_DIMS = (16, 32, 64, 128, 256)


@dataclass(frozen=True)
class Tuning:
    """How the attention runs; benchmarks and tests change it with :func:`tuning`.

    Args:
        triton: the Triton kernels (``True``) or the torch path, per-sequence SDPA (``False``); ``None``: Triton for
            bf16/fp16 on CUDA (and on the CPU under ``TRITON_INTERPRET=1``). fp32 on CUDA takes the torch path:
            Triton would compute its products in TF32, and exact fp32 tiles take minutes to compile.
        pack_gqa: the forward and dQ kernels run a GQA group's query heads in one program (``_query_rows``) for
            groups of up to this many (a power of two, at most the smallest BLOCK_M of the configs, 32); 1: one
            program per query head.
        flat_below: a dK/dV program whose key block fewer query blocks than this see runs its group's query heads in
            one loop, with one pipeline fill instead of one per head: faster for short packed documents, slower for
            long sequences (``benchmarks/NOTES.md``, the threshold's A/B).
        split_below: dK/dV take one program per query head (not per kv head) when there would be fewer programs than
            this; ``None``: four per multiprocessor of the GPU (with few key blocks, whole-group programs leave
            multiprocessors idle), none off CUDA.
        tma: the tiles each step of a kernel's loop loads (K/V in the forward and dQ, Q/dO in dK/dV) come through TMA
            descriptors bounded by their sequence (``attention_triton._rows``), where the GPU has TMA (compute
            capability 9+; and under the interpreter) and the inputs' heads are contiguous and their rows 16-byte
            aligned; off: pointer loads with masks.
    """

    triton: bool | None = None
    pack_gqa: int = 8
    flat_below: int = 32
    split_below: int | None = None
    tma: bool = False


# tuning(**changes): a context within which the attention runs as ``Tuning(**changes)`` says
tuning = Tunable(Tuning())


_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class AttentionOptions:
    causal: bool = True
    softmax_scale: float = 1.0
    window: int | None = None
    max_seqlen: int = 0


def _use_triton(q: Tensor) -> bool:
    if tuning.value.triton is not None:
        return tuning.value.triton
    return _INTERPRET or (q.is_cuda and q.dtype != torch.float32)


def _use_tma(*tensors: Tensor) -> bool:
    if not tuning.value.tma:
        return False
    t = tensors[0]
    if not (_INTERPRET or t.is_cuda and torch.cuda.get_device_capability(t.device)[0] >= 9):
        return False
    aligned = all(x.data_ptr() % 16 == 0 and x.stride(0) * x.element_size() % 16 == 0 for x in tensors)
    if not aligned or any(x.stride(2) != 1 or x.stride(1) != x.shape[2] for x in tensors):
        return False
    # the descriptors live in global memory that Triton asks its allocator for; set at each call, as that allocator is
    # one per thread (a context variable) and any other library may set its own
    device = t.device
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=device))
    return True


def _grid(blocks_over: int, seqs: Tensor, heads: int, block: str, pack: int = 1):
    # (blocks, program heads, sequences): the blocks of one head and sequence run together (they share its K/V and
    # Q rows in L2), and the sequences longest first (_sequences), so the heaviest programs do not start last.
    # pack: query heads per program, whose rows share its block (_query_rows)
    return lambda meta: (triton.cdiv(blocks_over, meta[block] // pack), heads // pack, seqs.shape[1])


def _sequences(bounds: list[int], device: torch.device) -> Tensor:
    """(2, B) int32 on ``device``, from the sequences' offsets on the host: their first tokens and their lengths,
    longest first."""
    spans = sorted(zip(bounds, bounds[1:]), key=lambda span: span[0] - span[1])  # stable
    table = torch.tensor([[a for a, _ in spans], [b - a for a, b in spans]], dtype=torch.int32)
    return table.to(device, non_blocking=True)


@functools.lru_cache(maxsize=8)
def _dense_offsets(b: int, s: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """cu_seqlens and the kernels' table (``_sequences``) of a dense batch of ``b`` sequences of ``s`` tokens, made
    once per shape and device: every layer of every step asks for the same ones (the kernels only read them)."""
    bounds = list(range(0, (b + 1) * s, s))
    return torch.tensor(bounds, dtype=torch.int32, device=device), _sequences(bounds, device)


def _pack(group: int) -> int:
    """Query heads per forward and dQ program: the whole group where it is a power of two of at most
    ``Tuning.pack_gqa``, else 1."""
    return group if group & (group - 1) == 0 and group <= tuning.value.pack_gqa else 1


def flash_attention_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, seqs: Tensor,
                            opts: AttentionOptions):  # fmt: skip
    """q: (T, Hq, D), k/v: (T, Hkv, D), cu_seqlens: (B+1,) int32, seqs: ``_sequences``' table of them. Returns
    o (T, Hq, D) and lse (Hq, T) (log2)."""
    if not _use_triton(q):
        return _forward_torch(q, k, v, cu_seqlens, opts)
    t, hq, d = q.shape
    o = torch.empty_like(q)
    lse = torch.empty(hq, t, dtype=torch.float32, device=q.device)
    pack = _pack(hq // k.shape[1])
    _fwd_kernel[_grid(opts.max_seqlen, seqs, hq, "BLOCK_M", pack)](
        q, k, v, o, lse, seqs,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), o.stride(0), o.stride(1),
        lse.stride(0), opts.softmax_scale * _LOG2E, opts.window or 0, _seq_bucket(opts.max_seqlen),
        GROUP=hq // k.shape[1], PACK=pack, CAUSAL=opts.causal, HAS_WINDOW=opts.window is not None, HEAD_DIM=d,
        TMA=_use_tma(k, v),
    )  # fmt: skip
    return o, lse


def flash_attention_backward(q, k, v, o, lse, do, cu_seqlens, seqs, opts: AttentionOptions):
    """Gradients (dq, dk, dv) of the forward above, in the inputs' dtype."""
    if not _use_triton(q):
        return _backward_torch(q, k, v, do, cu_seqlens, opts)
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    t = q.shape[0]
    delta = torch.empty_like(lse)  # (Hq, T): rowsum(dO * O), written by the dQ kernel, read by dK/dV
    group = hq // hkv
    dq = torch.empty_like(q)
    programs = triton.cdiv(opts.max_seqlen, 128) * (cu_seqlens.numel() - 1) * hkv
    split = group > 1 and programs < _split_below(q.device) and 2 * t * hq * d * 4 <= _SPLIT_MAX_BYTES
    if split:  # fp32 partial sums per query head, summed over each group below
        dk, dv = (torch.empty(t, hq, d, dtype=torch.float32, device=q.device) for _ in range(2))
    else:
        dk, dv = torch.empty_like(k), torch.empty_like(v)
    common = dict(GROUP=group, CAUSAL=opts.causal, HAS_WINDOW=opts.window is not None, HEAD_DIM=d)
    tma = _use_tma(q, k, v, do)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0),
               do.stride(1), lse.stride(0))  # fmt: skip
    scales = (opts.softmax_scale * _LOG2E, opts.softmax_scale, opts.window or 0, _seq_bucket(opts.max_seqlen))
    pack = _pack(group)
    _bwd_dq_kernel[_grid(opts.max_seqlen, seqs, hq, "BLOCK_M", pack)](
        q, k, v, do, lse, delta, dq, seqs, *strides, dq.stride(0), dq.stride(1), o, o.stride(0), o.stride(1), *scales,
        PACK=pack, TMA=tma, **common,
    )  # fmt: skip
    _bwd_dkdv_kernel[_grid(opts.max_seqlen, seqs, hq if split else hkv, "BLOCK_N")](
        q, k, v, do, lse, delta, dk, dv, seqs, *strides, dk.stride(0), dk.stride(1), dv.stride(0),
        dv.stride(1), *scales, HEADS=1 if split else group, FLAT_BELOW=tuning.value.flat_below, TMA=tma, **common,
    )  # fmt: skip
    if split:
        dk, dv = (x.view(t, hkv, group, d).sum(2).to(k.dtype) for x in (dk, dv))
    return dq, dk, dv


def _seq_bucket(max_seqlen: int) -> int:
    # autotuning key: the longest sequence to the next power of two, so short packed documents pick their own tiles
    return 1 << max(0, min(16, (max_seqlen - 1).bit_length()))


_SPLIT_MAX_BYTES = 1 << 28  # the partial sums of dK/dV by query head, at most


def _split_below(device: torch.device) -> int:
    """``Tuning.split_below``, by default from the GPU's multiprocessors."""
    if tuning.value.split_below is not None:
        return tuning.value.split_below
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


def _forward_torch(q, k, v, cu_seqlens, opts: AttentionOptions):
    # The CPU path without the interpreter: per sequence, torch's scaled_dot_product_attention.
    o = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for s0, s1 in zip(bounds, bounds[1:]):
        o[s0:s1] = _sdpa(q[s0:s1], k[s0:s1], v[s0:s1], opts)
    return o, None


def _backward_torch(q, k, v, do, cu_seqlens, opts: AttentionOptions):
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        bounds = cu_seqlens.tolist()
        out = torch.cat([_sdpa(*(t[s0:s1] for t in leaves), opts) for s0, s1 in zip(bounds, bounds[1:])])
        return torch.autograd.grad(out, leaves, do)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions) -> Tensor:
    # one sequence: (S, H, D) -> (S, Hq, D)
    n = q.shape[0]
    mask = _mask(n, opts, q.device)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=opts.softmax_scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )  # fmt: skip
    return out.transpose(0, 1)


def _mask(n: int, opts: AttentionOptions, device: torch.device) -> Tensor | None:
    if not opts.causal:
        return None
    i = torch.arange(n, device=device)
    visible = i[:, None] >= i[None, :]
    if opts.window is not None:
        visible &= i[:, None] - i[None, :] < opts.window
    return visible


@dataclass(frozen=True, eq=False)
class FlashKernel:
    """The kernels of one call: packed (T, H, D) inputs, their sequences (``cu_seqlens`` and ``_sequences``' table of
    them) and options. ``forward`` returns the output and the statistics its backward needs (the lse; none on the
    torch path, whose backward runs the forward again)."""

    cu_seqlens: Tensor
    seqs: Tensor
    opts: AttentionOptions

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        o, lse = flash_attention_forward(q, k, v, self.cu_seqlens, self.seqs, self.opts)
        return o, (lse,) if lse is not None else ()

    def backward(self, q, k, v, o, stats: tuple[Tensor, ...], do: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        lse = stats[0] if stats else None
        return flash_attention_backward(q, k, v, o, lse, do.contiguous(), self.cu_seqlens, self.seqs, self.opts)


class FlashAttentionFunction(torch.autograd.Function):
    """``kernel``'s attention (a :class:`FlashKernel`, or any object with its two methods) with its gradients."""

    @staticmethod
    def forward(ctx, kernel: FlashKernel, q, k, v):
        o, stats = kernel.forward(q, k, v)
        ctx.save_for_backward(q, k, v, o, *stats)
        ctx.kernel = kernel
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, *stats = ctx.saved_tensors
        return None, *ctx.kernel.backward(q, k, v, o, tuple(stats), do)


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    window: int | None = None,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    through: Callable[..., Tensor] | None = None,
) -> Tensor:
    """Attention ``softmax(q k^T * scale + mask) v``, memory-efficient, with gradients for q, k and v.

    Args:
        q: dense (B, S, Hq, D), or packed (T, Hq, D) with ``cu_seqlens``.
        k: dense (B, S, Hkv, D) or packed (T, Hkv, D); Hq must be a multiple of Hkv (GQA, MQA).
        v: shaped like ``k``.
        causal: query i sees keys j <= i (within its sequence).
        softmax_scale: defaults to 1 / sqrt(D).
        window: sliding window W (with ``causal``): query i sees keys j with i - W < j <= i.
        cu_seqlens: packed layout: (B+1,) int32 offsets of the sequences in T, from 0, non-decreasing.
        max_seqlen: packed layout: the longest sequence (read from ``cu_seqlens`` when not given; a value below it
            is an error).
        through: ``through(kernel, q, k, v)`` runs the prepared call (a :class:`FlashKernel` on packed, contiguous
            inputs) instead of :class:`FlashAttentionFunction` (a caller that keeps the outputs for its backward).

    Returns:
        the attention output, shaped like ``q``.
    """
    packed = cu_seqlens is not None
    _check(q, k, v, packed, cu_seqlens, causal, window)
    if packed:
        longest, seqs = _offsets(cu_seqlens, q.shape[0])
        if max_seqlen is None:
            max_seqlen = longest
        elif max_seqlen < longest:
            raise ValueError(
                f"max_seqlen={max_seqlen} is shorter than the longest sequence in cu_seqlens ({longest}); pass"
                " max_seqlen=None to have it computed."
            )
        flat = (q, k, v)
    else:
        b, s = q.shape[:2]
        flat = tuple(t.reshape(b * s, *t.shape[2:]) for t in (q, k, v))
        cu_seqlens, seqs = _dense_offsets(b, s, q.device)
        max_seqlen = s
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    opts = AttentionOptions(causal, float(scale), window, int(max_seqlen))
    kernel = FlashKernel(cu_seqlens.contiguous(), seqs, opts)
    out = (through or FlashAttentionFunction.apply)(kernel, *(t.contiguous() for t in flat))
    return out if packed else out.view(q.shape)


class FlashAttention(torch.nn.Module):
    """Module form of :func:`flash_attention`; ``forward(q, k, v, cu_seqlens=None, max_seqlen=None)``."""

    def __init__(self, *, causal: bool = True, softmax_scale: float | None = None, window: int | None = None):
        super().__init__()
        self.causal, self.softmax_scale, self.window = causal, softmax_scale, window

    def forward(self, q, k, v, cu_seqlens=None, max_seqlen=None):
        return flash_attention(q, k, v, causal=self.causal, softmax_scale=self.softmax_scale, window=self.window,
                               cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)  # fmt: skip


def flash_attention_ref(q, k, v, *, causal=True, softmax_scale=None, window=None, cu_seqlens=None) -> Tensor:
    """The readable reference: per sequence, explicit scores, mask, softmax and weighted sum."""
    if cu_seqlens is None:
        return torch.stack([flash_attention_ref(qb, kb, vb, causal=causal, softmax_scale=softmax_scale,
                                                window=window, cu_seqlens=torch.tensor([0, q.shape[1]]))
                            for qb, kb, vb in zip(q, k, v)])  # fmt: skip
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    group = q.shape[1] // k.shape[1]
    outs = []
    bounds = cu_seqlens.tolist()
    for s0, s1 in zip(bounds, bounds[1:]):
        qs, ks, vs = q[s0:s1], k[s0:s1].repeat_interleave(group, 1), v[s0:s1].repeat_interleave(group, 1)
        scores = torch.einsum("ihd,jhd->hij", qs, ks) * scale
        mask = _mask(s1 - s0, AttentionOptions(causal, scale, window), q.device)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        outs.append(torch.einsum("hij,jhd->ihd", scores.softmax(-1), vs))
    return torch.cat(outs)


def _check(q, k, v, packed, cu_seqlens, causal, window) -> None:
    dims = 3 if packed else 4
    layout = "(T, H, D) with cu_seqlens" if packed else "(B, S, H, D)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != dims:
            raise ValueError(f"{name} must be {layout}; got shape {tuple(t.shape)}.")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}.")
    if q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in all but the head count.")
    if q.shape[-2] % k.shape[-2]:
        raise ValueError(f"the query heads ({q.shape[-2]}) must be a multiple of the key/value heads ({k.shape[-2]}).")
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"head dim {q.shape[-1]} is not supported; supported: {HEAD_DIMS}.")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one of bf16, fp16, fp32; got {q.dtype}, {k.dtype}, {v.dtype}.")
    if len({q.device, k.device, v.device}) != 1:
        raise ValueError("q, k and v must be on one device.")
    if window is not None and (not causal or window < 1):
        raise ValueError(f"window must be a positive int and needs causal=True; got window={window}, causal={causal}.")
    if packed and (cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32 or cu_seqlens.numel() < 2):
        raise ValueError(f"cu_seqlens must be (B+1,) int32; got {tuple(cu_seqlens.shape)} {cu_seqlens.dtype}.")


# Reading cu_seqlens on the host synchronizes with the GPU; every layer of a step, and its recompute, gets the same
# tensor. So the check, the longest sequence and the kernels' table of the sequences are kept for the few most recent
# tensors, keyed by the tensor object and its version counter; each entry holds its tensor, so the key cannot come back
# for another one. (A key of the memory address could: a new batch's offsets are often allocated where the last
# batch's were, and went unchecked.)
_OFFSETS: OrderedDict[tuple, tuple[Tensor, int, Tensor]] = OrderedDict()


def _offsets(cu_seqlens: Tensor, total: int) -> tuple[int, Tensor]:
    """Check that ``cu_seqlens`` are offsets into ``total`` tokens; return the longest sequence's length and the
    kernels' table of the sequences (``_sequences``)."""
    key = (id(cu_seqlens), cu_seqlens._version, total)
    if key not in _OFFSETS:
        values = cu_seqlens.tolist()
        if values[0] != 0 or values[-1] != total or any(b < a for a, b in zip(values, values[1:])):
            raise ValueError(
                f"cu_seqlens must start at 0, never decrease and end at the token count {total}; got {values[:8]}"
                f"{'...' if len(values) > 8 else ''}."
            )
        longest = max(b - a for a, b in zip(values, values[1:]))
        _OFFSETS[key] = (cu_seqlens, longest, _sequences(values, cu_seqlens.device))
        while len(_OFFSETS) > 8:
            _OFFSETS.popitem(last=False)
    return _OFFSETS[key][1:]
