"""The Triton programs of the flash attention (``attention.py`` holds the algorithm, the launchers and the API): the
forward, the dQ and the dK/dV kernels, their tile configs and autotuning, and the block-range arithmetic they share.
Every kernel's grid is (blocks, heads, sequences); positions are within one sequence of the packed layout."""

from __future__ import annotations

import os

import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _configs(shapes, interpreted: tuple[int, int] | None = None) -> list[triton.Config]:
    # NOTE: one config when interpreting: multi-config autotuning fails under TRITON_INTERPRET=1. Its blocks are
    # unequal, as on the GPU, so the CPU tests walk the block-range arithmetic the GPU uses.
    if _INTERPRET:
        return [triton.Config(dict(zip(("BLOCK_M", "BLOCK_N"), interpreted)), num_warps=4)] if interpreted else []
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s, maxnreg=regs[0] if regs else None)
            for m, n, w, s, *regs in shapes]  # fmt: skip


# Short sequences (packed documents) favour configs that fit two programs on a multiprocessor, so that one program's
# first loads and last stores overlap the other's products: 8 warps capped at 128 registers (a few spills) for the
# forward and dQ, 4 warps for dK/dV. They are tried only where the longest sequence is at most _SHORT tokens: the
# autotuner, timing each kernel alone, picked them for long sequences too, where the whole fwd+bwd was slower
# (benchmarks/NOTES.md, "two programs per multiprocessor").
_SHORT = 4096


def _autotune(long: list[triton.Config], short: list[triton.Config], key: list[str]):
    """``triton.autotune`` over ``long + short``, the ``short`` configs tried only for short sequences."""
    return triton.autotune(configs=long + short, key=key, prune_configs_by={"early_config_prune": _for_length(long)})


def _for_length(long: list[triton.Config]):
    # early_config_prune: all the configs where the longest sequence (its power-of-two bucket) is at most _SHORT
    return lambda configs, named_args, **kwargs: configs if named_args["seq_bucket"] <= _SHORT else long


# (BLOCK_M, BLOCK_N, warps, stages[, registers per thread at most]). Forward and dQ walk key blocks for a query block;
# dK/dV walks query blocks for a key block, so it favours wide key blocks (as FlashAttention-2's Triton tutorial does).
_ROW_CONFIGS = _configs(((128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3)), (32, 16))
_ROW_SHORT = _configs(((128, 64, 8, 2, 128), (128, 32, 8, 3, 128)))
_COL_CONFIGS = _configs(
    ((64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 4, 3), (64, 64, 4, 3), (128, 64, 8, 3)), (16, 32)
)  # fmt: skip
_COL_SHORT = _configs(((64, 64, 4, 2),))


@triton.jit
def _bounds(seqs):
    # this program's sequence (grid axis 2, longest first): its first token in the packed layout, and its length
    seq = tl.program_id(2)
    start = tl.load(seqs + seq).to(tl.int64)
    return start, tl.load(seqs + tl.num_programs(2) + seq).to(tl.int64)


@triton.jit
def _tile(base, start, offs, head, stride_t, stride_h, offs_d, ok):
    # (len(offs), D): row r is position offs[r] of ``head`` (one head, or one per row), zeros where not ok
    return tl.load(base + ((start + offs) * stride_t + head * stride_h)[:, None] + offs_d[None, :], mask=ok[:, None],
                   other=0.0)  # fmt: skip


@triton.jit
def _rows(base, start, seqlen, stride_t, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    # A TMA descriptor over one sequence of a (T, H, D) tensor whose heads are contiguous, viewed as (T, H * D):
    # loads are bounded by the sequence (rows past its end read as zeros, as the masked loads' `other`) and need no
    # address tensors in registers (FlashAttention-3 loads its tiles by TMA for the same reasons)
    return tl.make_tensor_descriptor(base + start * stride_t, shape=[seqlen.to(tl.int32), stride_t],
                                     strides=[stride_t, 1], block_shape=[BLOCK, HEAD_DIM])  # fmt: skip


@triton.jit
def _block(base, start, first, offs, head, stride_t, stride_h, offs_d, ok, TMA: tl.constexpr):
    # the tile of positions offs = first + arange of one head: through the descriptor of _rows, or _tile's pointers
    if TMA:
        return base.load([tl.cast(first, tl.int32), tl.cast(head * stride_h, tl.int32)])
    return _tile(base, start, offs, head, stride_t, stride_h, offs_d, ok)


@triton.jit
def _query_rows(m_start, head0, ROWS: tl.constexpr, BLOCK_M: tl.constexpr):
    # A program's BLOCK_M rows are ROWS positions of BLOCK_M // ROWS query heads of one group (FlashAttention-3's
    # "PackGQA"): the heads share every key block, so a tile's rows cover fewer positions and the causal diagonal
    # wastes less of it. Returns each row's position and head.
    r = tl.arange(0, BLOCK_M)
    return m_start + r % ROWS, head0 + r // ROWS


@triton.jit
def _visible(q_pos, k_pos, seqlen, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    # mask of the keys each query may attend to, shaped as q_pos and k_pos broadcast together: (queries, keys) from
    # offs_m[:, None] and offs_n[None, :], (keys, queries) from offs_m[None, :] and offs_n[:, None]
    ok = (q_pos < seqlen) & (k_pos < seqlen)
    if CAUSAL:
        ok = ok & (q_pos >= k_pos)
    if HAS_WINDOW:
        ok = ok & (q_pos - k_pos < window)
    return ok


@triton.jit
def _key_ranges(m_start, seqlen, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                HAS_WINDOW: tl.constexpr):  # fmt: skip
    # Key blocks for queries m_start .. m_start + BLOCK_M - 1: [lo, hi) may hold visible keys, and the blocks in
    # [full_lo, full_hi) are visible to every query of the block and inside the sequence, so they need no mask.
    # All four are lo + a multiple of BLOCK_N, except hi.
    lo = 0
    hi = seqlen
    full_hi = seqlen // BLOCK_N * BLOCK_N
    if CAUSAL:
        hi = tl.minimum(seqlen, m_start + BLOCK_M)
        full_hi = (m_start + 1) // BLOCK_N * BLOCK_N  # keys <= m_start are seen by all the block's queries
    full_lo = lo
    if HAS_WINDOW:
        lo = tl.maximum(0, m_start - window + 1) // BLOCK_N * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(0, m_start + BLOCK_M - window), BLOCK_N) * BLOCK_N
    full_hi = tl.maximum(full_hi, lo)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), full_hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def _query_ranges(n_start, seqlen, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                  HAS_WINDOW: tl.constexpr):  # fmt: skip
    # Query blocks that can see a key of n_start .. n_start + BLOCK_N - 1: [lo, hi); those in [full_lo, full_hi)
    # see all of them. Rows past the sequence end are zero (q, dO, lse, delta) and add nothing to dK or dV, so
    # only visibility is masked here.
    lo = 0
    hi = seqlen
    if CAUSAL:
        lo = n_start // BLOCK_M * BLOCK_M
    if HAS_WINDOW:
        hi = tl.minimum(seqlen, n_start + BLOCK_N + window - 1)
    end = lo + tl.cdiv(hi - lo, BLOCK_M) * BLOCK_M
    full_lo = lo
    full_hi = end
    if CAUSAL:
        full_lo = tl.cdiv(n_start + BLOCK_N - 1, BLOCK_M) * BLOCK_M  # queries >= the block's last key
    if HAS_WINDOW:
        full_hi = (n_start + window) // BLOCK_M * BLOCK_M  # queries < the block's first key + window
    full_hi = tl.minimum(tl.maximum(full_hi, lo), end)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), full_hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def _fwd_step(acc, m_i, l_i, q, K, V, start, n_start, offs_m, kv_head, stride_kt, stride_kh, stride_vt, stride_vh,
              offs_d, seqlen, window, qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
              HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr):  # fmt: skip
    # one key block of the online softmax
    offs_n = n_start + tl.arange(0, BLOCK_N)
    key_ok = offs_n < seqlen
    k = _block(K, start, n_start, offs_n, kv_head, stride_kt, stride_kh, offs_d, key_ok, TMA)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    if MASKED:
        s = tl.where(_visible(offs_m[:, None], offs_n[None, :], seqlen, window, CAUSAL, HAS_WINDOW), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no visible key yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _block(V, start, n_start, offs_n, kv_head, stride_vt, stride_vh, offs_d, key_ok, TMA)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@_autotune(_ROW_CONFIGS, _ROW_SHORT, ["HEAD_DIM", "CAUSAL", "HAS_WINDOW", "GROUP", "PACK", "TMA", "seq_bucket"])
@triton.jit
def _fwd_kernel(
    Q, K, V, Out, LSE, seqs,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lh,
    qk_scale, window, seq_bucket,
    GROUP: tl.constexpr, PACK: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HEAD_DIM: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # q/o: (T, Hq, D), k/v: (T, Hkv, D), lse: (Hq, T) in the log2 domain; one program per (query block of
    # BLOCK_M // PACK positions, sequence, PACK query heads of a group), the last query blocks (the most work when
    # causal) first
    ROWS: tl.constexpr = BLOCK_M // PACK
    head0 = tl.program_id(1) * PACK
    start, seqlen = _bounds(seqs)
    m_start = (tl.num_programs(0) - 1 - tl.program_id(0)) * ROWS
    if m_start >= seqlen:
        return
    if TMA:
        K = _rows(K, start, seqlen, stride_kt, BLOCK_N, HEAD_DIM)
        V = _rows(V, start, seqlen, stride_vt, BLOCK_N, HEAD_DIM)
    kv_head = head0 // GROUP
    offs_m, heads = _query_rows(m_start, head0, ROWS, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < seqlen
    q = _tile(Q, start, offs_m, heads, stride_qt, stride_qh, offs_d, row_ok)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    lo, full_lo, full_hi, hi = _key_ranges(m_start, seqlen, window, ROWS, BLOCK_N, CAUSAL, HAS_WINDOW)
    # masked blocks (window edge), unmasked blocks, masked blocks (diagonal, sequence end)
    for n_start in range(lo, full_lo, BLOCK_N):
        acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, K, V, start, n_start, offs_m, kv_head, stride_kt, stride_kh,
                                  stride_vt, stride_vh, offs_d, seqlen, window, qk_scale, True, CAUSAL, HAS_WINDOW,
                                  BLOCK_N, TMA)  # fmt: skip
    for n_start in range(full_lo, full_hi, BLOCK_N):
        acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, K, V, start, n_start, offs_m, kv_head, stride_kt, stride_kh,
                                  stride_vt, stride_vh, offs_d, seqlen, window, qk_scale, False, CAUSAL, HAS_WINDOW,
                                  BLOCK_N, TMA)  # fmt: skip
    for n_start in range(full_hi, hi, BLOCK_N):
        acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, K, V, start, n_start, offs_m, kv_head, stride_kt, stride_kh,
                                  stride_vt, stride_vh, offs_d, seqlen, window, qk_scale, True, CAUSAL, HAS_WINDOW,
                                  BLOCK_N, TMA)  # fmt: skip
    l_i = tl.where(row_ok, l_i, 1.0)  # rows past the sequence end (not stored) stay finite
    acc = acc / l_i[:, None]
    tl.store(Out + ((start + offs_m) * stride_ot + heads * stride_oh)[:, None] + offs_d[None, :],
             acc.to(Out.dtype.element_ty), mask=row_ok[:, None])  # fmt: skip
    tl.store(LSE + heads * stride_lh + start + offs_m, m_i + tl.log2(l_i), mask=row_ok)


@triton.jit
def _dkdv_step(dk, dv, k, v, Q, DO, LSE, DELTA, start, m_start, head, offs_n, offs_d, seqlen, window, qk_scale,
               stride_qt, stride_qh, stride_dot, stride_doh, stride_lh, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
               HAS_WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, TMA: tl.constexpr):  # fmt: skip
    # one query block's contribution to a key block's dK and dV
    offs_m = m_start + tl.arange(0, BLOCK_M)
    row_ok = offs_m < seqlen
    q = _block(Q, start, m_start, offs_m, head, stride_qt, stride_qh, offs_d, row_ok, TMA)
    do = _block(DO, start, m_start, offs_m, head, stride_dot, stride_doh, offs_d, row_ok, TMA)
    lse = tl.load(LSE + head * stride_lh + start + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + head * stride_lh + start + offs_m, mask=row_ok, other=0.0)
    # transposed scores (BLOCK_N, BLOCK_M): p^T and ds^T come out of their products in the layout the next
    # products take them in, with no transpose of a computed tile (as Triton's fused-attention tutorial does)
    s_t = tl.dot(k, tl.trans(q)) * qk_scale
    p_t = tl.exp2(s_t - lse[None, :])
    if MASKED:
        p_t = tl.where(_visible(offs_m[None, :], offs_n[:, None], seqlen, window, CAUSAL, HAS_WINDOW), p_t, 0.0)
    dv += tl.dot(p_t.to(do.dtype), do)
    dp_t = tl.dot(v, tl.trans(do))
    ds_t = p_t * (dp_t - delta[None, :])
    dk += tl.dot(ds_t.to(q.dtype), q)
    return dk, dv


@triton.jit
def _dkdv_blocks(dk, dv, k, v, Q, DO, LSE, DELTA, start, first, count, head0, offs_n, offs_d, seqlen, window,
                 qk_scale, stride_qt, stride_qh, stride_dot, stride_doh, stride_lh, MASKED: tl.constexpr,
                 CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HEADS: tl.constexpr,
                 BLOCK_M: tl.constexpr, TMA: tl.constexpr):  # fmt: skip
    # `count` query blocks from `first`, for query heads head0 .. head0 + HEADS - 1. Several heads run in one loop:
    # one software pipeline instead of one per head, which pays where each head has few blocks (short sequences)
    if HEADS == 1:
        for m_start in range(first, first + count * BLOCK_M, BLOCK_M):
            dk, dv = _dkdv_step(dk, dv, k, v, Q, DO, LSE, DELTA, start, m_start, head0, offs_n, offs_d, seqlen,
                                window, qk_scale, stride_qt, stride_qh, stride_dot, stride_doh, stride_lh, MASKED,
                                CAUSAL, HAS_WINDOW, BLOCK_M, TMA)  # fmt: skip
    else:
        for i in range(0, HEADS * count):
            m_start = first + (i % count) * BLOCK_M
            dk, dv = _dkdv_step(dk, dv, k, v, Q, DO, LSE, DELTA, start, m_start, head0 + i // count, offs_n,
                                offs_d, seqlen, window, qk_scale, stride_qt, stride_qh, stride_dot, stride_doh,
                                stride_lh, MASKED, CAUSAL, HAS_WINDOW, BLOCK_M, TMA)  # fmt: skip
    return dk, dv


@triton.jit
def _dkdv_sections(dk, dv, k, v, Q, DO, LSE, DELTA, start, lo, full_lo, full_hi, hi, head0, offs_n, offs_d, seqlen,
                   window, qk_scale, stride_qt, stride_qh, stride_dot, stride_doh, stride_lh, CAUSAL: tl.constexpr,
                   HAS_WINDOW: tl.constexpr, HEADS: tl.constexpr, BLOCK_M: tl.constexpr,
                   TMA: tl.constexpr):  # fmt: skip
    # masked blocks (diagonal), unmasked blocks, masked blocks (window edge)
    dk, dv = _dkdv_blocks(dk, dv, k, v, Q, DO, LSE, DELTA, start, lo, (full_lo - lo) // BLOCK_M, head0, offs_n,
                          offs_d, seqlen, window, qk_scale, stride_qt, stride_qh, stride_dot, stride_doh, stride_lh,
                          True, CAUSAL, HAS_WINDOW, HEADS, BLOCK_M, TMA)  # fmt: skip
    dk, dv = _dkdv_blocks(dk, dv, k, v, Q, DO, LSE, DELTA, start, full_lo, (full_hi - full_lo) // BLOCK_M, head0,
                          offs_n, offs_d, seqlen, window, qk_scale, stride_qt, stride_qh, stride_dot, stride_doh,
                          stride_lh, False, CAUSAL, HAS_WINDOW, HEADS, BLOCK_M, TMA)  # fmt: skip
    tail = tl.maximum(tl.cdiv(hi - full_hi, BLOCK_M), 0)
    dk, dv = _dkdv_blocks(dk, dv, k, v, Q, DO, LSE, DELTA, start, full_hi, tail, head0, offs_n, offs_d, seqlen, window,
                          qk_scale, stride_qt, stride_qh, stride_dot, stride_doh, stride_lh, True, CAUSAL, HAS_WINDOW,
                          HEADS, BLOCK_M, TMA)  # fmt: skip
    return dk, dv


@_autotune(_COL_CONFIGS, _COL_SHORT, ["HEAD_DIM", "CAUSAL", "HAS_WINDOW", "GROUP", "HEADS", "TMA", "seq_bucket"])
@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, seqs,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_lh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    qk_scale, sm_scale, window, seq_bucket,
    GROUP: tl.constexpr, HEADS: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HEAD_DIM: tl.constexpr, FLAT_BELOW: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    # one program per (key block, sequence, program head); loops over HEADS query heads and the query blocks.
    # HEADS == GROUP: a program head is a kv head, and its dK/dV is complete. HEADS == 1: a program head is a query
    # head (more programs when there are few key blocks), and DK/DV receive its partial sums, one per query head.
    pid_h = tl.program_id(1)
    kv_head = pid_h * HEADS // GROUP
    start, seqlen = _bounds(seqs)
    n_start = tl.program_id(0) * BLOCK_N
    if n_start >= seqlen:
        return
    offs_n = n_start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    key_ok = offs_n < seqlen
    k = _tile(K, start, offs_n, kv_head, stride_kt, stride_kh, offs_d, key_ok)
    v = _tile(V, start, offs_n, kv_head, stride_vt, stride_vh, offs_d, key_ok)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    if TMA:
        Q = _rows(Q, start, seqlen, stride_qt, BLOCK_M, HEAD_DIM)
        DO = _rows(DO, start, seqlen, stride_dot, BLOCK_M, HEAD_DIM)
    lo, full_lo, full_hi, hi = _query_ranges(n_start, seqlen, window, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW)
    head0 = pid_h * HEADS
    if HEADS == 1:
        dk, dv = _dkdv_sections(dk, dv, k, v, Q, DO, LSE, DELTA, start, lo, full_lo, full_hi, hi, head0, offs_n, offs_d,
                                seqlen, window, qk_scale, stride_qt, stride_qh, stride_dot, stride_doh, stride_lh,
                                CAUSAL, HAS_WINDOW, 1, BLOCK_M, TMA)  # fmt: skip
    elif tl.cdiv(hi - lo, BLOCK_M) < FLAT_BELOW:  # few blocks per head: one loop over all the heads' blocks
        dk, dv = _dkdv_sections(dk, dv, k, v, Q, DO, LSE, DELTA, start, lo, full_lo, full_hi, hi, head0, offs_n, offs_d,
                                seqlen, window, qk_scale, stride_qt, stride_qh, stride_dot, stride_doh, stride_lh,
                                CAUSAL, HAS_WINDOW, HEADS, BLOCK_M, TMA)  # fmt: skip
    else:
        for g in range(HEADS):
            dk, dv = _dkdv_sections(dk, dv, k, v, Q, DO, LSE, DELTA, start, lo, full_lo, full_hi, hi, head0 + g,
                                    offs_n, offs_d, seqlen, window, qk_scale, stride_qt, stride_qh, stride_dot,
                                    stride_doh, stride_lh, CAUSAL, HAS_WINDOW, 1, BLOCK_M, TMA)  # fmt: skip
    tl.store(DK + (start + offs_n)[:, None] * stride_dkt + pid_h * stride_dkh + offs_d[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=key_ok[:, None])  # fmt: skip
    tl.store(DV + (start + offs_n)[:, None] * stride_dvt + pid_h * stride_dvh + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=key_ok[:, None])  # fmt: skip


@triton.jit
def _dq_step(dq, q, do, lse, delta, K, V, start, n_start, offs_m, kv_head, stride_kt, stride_kh, stride_vt,
             stride_vh, offs_d, seqlen, window, qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
             HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr):  # fmt: skip
    # one key block's contribution to a query block's dQ
    offs_n = n_start + tl.arange(0, BLOCK_N)
    key_ok = offs_n < seqlen
    k = _block(K, start, n_start, offs_n, kv_head, stride_kt, stride_kh, offs_d, key_ok, TMA)
    v = _block(V, start, n_start, offs_n, kv_head, stride_vt, stride_vh, offs_d, key_ok, TMA)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    p = tl.exp2(s - lse[:, None])
    if MASKED:
        p = tl.where(_visible(offs_m[:, None], offs_n[None, :], seqlen, window, CAUSAL, HAS_WINDOW), p, 0.0)
    dp = tl.dot(do, tl.trans(v))
    ds = p * (dp - delta[:, None])
    return dq + tl.dot(ds.to(k.dtype), k)


@_autotune(_ROW_CONFIGS, _ROW_SHORT, ["HEAD_DIM", "CAUSAL", "HAS_WINDOW", "GROUP", "PACK", "TMA", "seq_bucket"])
@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, seqs,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_lh,
    stride_dqt, stride_dqh, OUT, stride_ot, stride_oh,
    qk_scale, sm_scale, window, seq_bucket,
    GROUP: tl.constexpr, PACK: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HEAD_DIM: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # one program per (query block, sequence, PACK query heads) as in the forward, the most work (last blocks when
    # causal) first. It also computes its rows' delta = rowsum(dO * O) and stores it for the dK/dV kernel, which runs
    # after it
    ROWS: tl.constexpr = BLOCK_M // PACK
    head0 = tl.program_id(1) * PACK
    start, seqlen = _bounds(seqs)
    m_start = (tl.num_programs(0) - 1 - tl.program_id(0)) * ROWS
    if m_start >= seqlen:
        return
    if TMA:
        K = _rows(K, start, seqlen, stride_kt, BLOCK_N, HEAD_DIM)
        V = _rows(V, start, seqlen, stride_vt, BLOCK_N, HEAD_DIM)
    kv_head = head0 // GROUP
    offs_m, heads = _query_rows(m_start, head0, ROWS, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < seqlen
    q = _tile(Q, start, offs_m, heads, stride_qt, stride_qh, offs_d, row_ok)
    do = _tile(DO, start, offs_m, heads, stride_dot, stride_doh, offs_d, row_ok)
    lse = tl.load(LSE + heads * stride_lh + start + offs_m, mask=row_ok, other=0.0)
    o = _tile(OUT, start, offs_m, heads, stride_ot, stride_oh, offs_d, row_ok)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + heads * stride_lh + start + offs_m, delta, mask=row_ok)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    lo, full_lo, full_hi, hi = _key_ranges(m_start, seqlen, window, ROWS, BLOCK_N, CAUSAL, HAS_WINDOW)
    for n_start in range(lo, full_lo, BLOCK_N):
        dq = _dq_step(dq, q, do, lse, delta, K, V, start, n_start, offs_m, kv_head, stride_kt, stride_kh, stride_vt,
                      stride_vh, offs_d, seqlen, window, qk_scale, True, CAUSAL, HAS_WINDOW, BLOCK_N, TMA)  # fmt: skip
    for n_start in range(full_lo, full_hi, BLOCK_N):
        dq = _dq_step(dq, q, do, lse, delta, K, V, start, n_start, offs_m, kv_head, stride_kt, stride_kh, stride_vt,
                      stride_vh, offs_d, seqlen, window, qk_scale, False, CAUSAL, HAS_WINDOW, BLOCK_N, TMA)  # fmt: skip
    for n_start in range(full_hi, hi, BLOCK_N):
        dq = _dq_step(dq, q, do, lse, delta, K, V, start, n_start, offs_m, kv_head, stride_kt, stride_kh, stride_vt,
                      stride_vh, offs_d, seqlen, window, qk_scale, True, CAUSAL, HAS_WINDOW, BLOCK_N, TMA)  # fmt: skip
    tl.store(DQ + ((start + offs_m) * stride_dqt + heads * stride_dqh)[:, None] + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])  # fmt: skip
