"""Attention benchmark (GPU machine): our Triton flash attention, and ``attn_implementation="slide"``'s dispatch (a
dense batch to cuDNN where cuDNN takes it), against SDPA (flash and cuDNN backends, forced one at a time) and
FlexAttention, causal, bf16, B=2, Hq=32, Hkv=8, D=128, in one run; plus a packed batch of 16
documents of random lengths (16k tokens) against the dense kernel at the same total length and against the
explicit-mask SDPA that Hugging Face falls back to for packed sequences; FlashAttention-2 (varlen) and
FlexAttention run the packed batch too, beside their own dense runs at that length.

TFLOP/s use 4*B*Hq*N^2*D, halved for causal, x3.5 for fwd+bwd; for packed batches only within-document work counts.
Appends CSV rows to --out.

    python benchmarks/bench_attention.py
    python benchmarks/bench_attention.py --kernels   # ours, packed and dense at the packed length: GPU time per kernel
    python benchmarks/bench_attention.py --interleave slide_dispatch,sdpa_cudnn   # dense fwd+bwd, taking turns
"""

from __future__ import annotations

import argparse
import inspect
import time

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import lightning_slide.kernels.attention as attention
from lightning_slide.attention import slide_attention_forward
from lightning_slide.kernels.attention import flash_attention
from results_csv import append_row, environment

B, HQ, HKV, D = 2, 32, 8, 128


def run_once(fn, backward: bool, leaves: tuple) -> None:
    """One forward of ``fn``, and its backward; each backward's gradients are new tensors, not added into the last
    ones (an elementwise add per input that is not attention's work: 0.14 ms of our packed case's 4 ms on the H200,
    2026-11-30)."""
    for t in leaves:
        t.grad = None
    out = fn()
    if backward:
        out.backward(torch.ones_like(out))


def timed(fn, backward: bool, leaves: tuple = ()) -> float:
    def step():
        run_once(fn, backward, leaves)

    # compile and autotune before do_bench sizes its runs: on a fresh machine (cold Triton and Inductor caches) the
    # first fwd+bwd case measured 1.5x its time in a second run of the same script (2026-11-30)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    return do_bench(step, warmup=50, rep=300, return_mode="median")


def autotuned(module) -> str:
    """The configs the autotuner last picked for ``module``'s kernels (forward, dK/dV, dQ): a slow reading can then be
    told apart from a poor pick."""
    picks = []
    for name in ("_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel"):
        config = getattr(getattr(module, name, None), "best_config", None)
        if config is not None:
            kw = config.kwargs
            regs = f" r{config.maxnreg}" if config.maxnreg else ""
            picks.append(f"{name[1:-7]} {kw['BLOCK_M']}x{kw['BLOCK_N']} w{config.num_warps} s{config.num_stages}{regs}")
    return "autotuned: " + ", ".join(picks) if picks else ""


def warm_up(seconds: float = 3.0) -> None:
    """Busy the GPU before the first timing. Our fwd+bwd in the script's first case (dense N=2048) read from 185 to 252
    TFLOP/s across runs on machines fresh from idle, while bench_attention_ab.py read 258-275 for the same kernels
    (H200, 2026-11-30). Clocks still rising is one guess."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a @ a
        torch.cuda.synchronize()


def dense_systems(q, k, v):
    # q: (B, S, Hq, D); SDPA and Flex take (B, H, S, D)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)

        return run

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    n = q.shape[1]
    block_mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, n, n, device=q.device)
    flex = torch.compile(flex_attention)
    return {
        "ours": lambda: flash_attention(q, k, v, causal=True),
        # attn_implementation="slide" as a model runs it: a dense batch goes to cuDNN where cuDNN takes it
        "slide_dispatch": lambda: slide_attention_forward(None, qt, kt, vt, None, is_causal=True)[0],
        "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "flex": lambda: flex(qt, kt, vt, block_mask=block_mask, enable_gqa=True),
    }


def packed_systems(q, k, v, cu, max_len):
    # q: (T, Hq, D) packed. Each kernel family runs packed and dense over the same total length, so its own
    # packed/dense ratio can be set beside ours: FlashAttention-2's varlen kernel (torch's varlen_attn, where this
    # torch has it) against SDPA-flash, FlexAttention with a document mask against its causal mask. The fallback
    # Hugging Face takes is one (1, H, T, D) SDPA call with a block-diagonal causal mask.
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    t = q.shape[0]
    doc = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=q.device), (cu[1:] - cu[:-1]).long())
    pos = torch.arange(t, device=q.device)
    mask = (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    flex = torch.compile(flex_attention)
    doc_mask = create_block_mask(lambda b, h, i, j: (doc[i] == doc[j]) & (i >= j), None, None, t, t, device=q.device)
    causal_mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, t, t, device=q.device)

    def sdpa_flash():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)

    systems = {
        "ours_packed": lambda: flash_attention(q, k, v, cu_seqlens=cu, max_seqlen=max_len),
        "ours_dense_same_length": lambda: flash_attention(q[None], k[None], v[None], causal=True),
        "flex_packed": lambda: flex(qt, kt, vt, block_mask=doc_mask, enable_gqa=True),
        "flex_dense_same_length": lambda: flex(qt, kt, vt, block_mask=causal_mask, enable_gqa=True),
        "sdpa_flash_dense_same_length": sdpa_flash,
        "sdpa_explicit_mask": lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=True),
    }
    varlen = _fa2_varlen(q, k, v, cu, max_len)
    if varlen is not None:
        systems["fa2_varlen_packed"] = varlen
    return systems


def _fa2_varlen(q, k, v, cu, max_len):
    # torch.nn.attention.varlen.varlen_attn (FlashAttention-2), whose keywords changed between torch releases
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if "enable_gqa" in params:
        kv = {"enable_gqa": True}
    else:  # no GQA in this torch: the kv heads are repeated beforehand (more reads, the same work)
        group = q.shape[1] // k.shape[1]
        k, v = (x.detach().repeat_interleave(group, 1).requires_grad_() for x in (k, v))
        kv = {}

    def run():
        k.grad = v.grad = None  # where repeated, leaves of their own (see run_once)
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, **causal, **kv)

    return run


def kernel_ms(fn, leaves: tuple, iters: int = 20) -> dict[str, float]:
    """GPU time per kernel name of one fwd+bwd of ``fn``, in ms (the mean over ``iters`` profiled runs)."""
    timed(fn, True, leaves)  # compiled and autotuned outside the profile
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        for _ in range(iters):
            run_once(fn, True, leaves)
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for e in profiler.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            totals[e.name] = totals.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e3 / iters
    return totals


def packed_offsets(total: int) -> tuple[Tensor, list[int]]:
    """cu_seqlens (on the GPU) and lengths of 16 documents of random lengths (seeded) in ``total`` tokens."""
    cuts = torch.sort(torch.randperm(total - 1, generator=torch.Generator().manual_seed(0))[:15] + 1).values
    cu = torch.cat([torch.tensor([0]), cuts, torch.tensor([total])]).to(torch.int32).cuda()
    return cu, (cu[1:] - cu[:-1]).tolist()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="2048,8192")
    parser.add_argument("--packed-tokens", type=int, default=16384)
    parser.add_argument("--out", default="benchmarks/results/attention.csv")
    parser.add_argument("--kernels", action="store_true", help="only: GPU time per kernel, packed vs dense (ours)")
    parser.add_argument("--kernels-out", default="benchmarks/results/attention_kernels.csv")
    parser.add_argument("--interleave", default=None, help="only: these dense systems' fwd+bwd, taking turns")
    parser.add_argument("--repeats", type=int, default=4, help="with --interleave: turns of each system")
    args = parser.parse_args()
    warm_up()
    g = torch.Generator(device="cuda").manual_seed(0)

    def make(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()

    common = {**environment(), "B": B, "Hq": HQ, "Hkv": HKV, "D": D}

    def record(case, name, fn, flops, leaves):
        for backward in (False, True):
            try:
                ms = timed(fn, backward, leaves)
                tflops = flops * (3.5 if backward else 1.0) / (ms * 1e-3) / 1e12
                note = autotuned(attention) if name.startswith("ours") else ""
            except Exception as err:  # keep the others; say what failed
                ms, tflops, note = float("nan"), float("nan"), f"FAILED: {type(err).__name__}: {str(err)[:200]}"
            append_row(args.out, {**common, "case": case, "system": name, "pass": "fwd+bwd" if backward else "fwd",
                                  "ms": ms, "tflops": tflops, "note": note})  # fmt: skip

    if args.kernels:  # where our packed fwd+bwd spends its time, beside the dense kernel at the same length
        total = args.packed_tokens
        cu, lengths = packed_offsets(total)
        q, k, v = make(total, HQ, D), make(total, HKV, D), make(total, HKV, D)
        systems = {
            "ours_packed": lambda: flash_attention(q, k, v, cu_seqlens=cu, max_seqlen=max(lengths)),
            "ours_dense_same_length": lambda: flash_attention(q[None], k[None], v[None], causal=True),
        }
        for name, fn in systems.items():
            row = {**common, "case": f"packed_16docs_T{total}", "system": name}
            for kernel, ms in sorted(kernel_ms(fn, (q, k, v)).items(), key=lambda kv: -kv[1]):
                append_row(args.kernels_out, {**row, "kernel": kernel[:120], "ms": ms, "note": autotuned(attention)})
        return
    if args.interleave:  # a difference between two systems that drift would show as one in the order they ran
        names = args.interleave.split(",")
        for n in (int(x) for x in args.lengths.split(",")):
            q, k, v = make(B, n, HQ, D), make(B, n, HKV, D), make(B, n, HKV, D)
            systems = dense_systems(q, k, v)
            for turn in range(args.repeats):
                for name in names:
                    ms = timed(systems[name], True, (q, k, v))
                    append_row(args.out, {**common, "case": f"dense_causal_N{n}", "system": name, "pass": "fwd+bwd",
                                          "ms": ms, "tflops": 4 * B * HQ * n * n * D / 2 * 3.5 / (ms * 1e-3) / 1e12,
                                          "note": f"interleaved, turn {turn}"})  # fmt: skip
        return
    for n in (int(x) for x in args.lengths.split(",")):
        q, k, v = make(B, n, HQ, D), make(B, n, HKV, D), make(B, n, HKV, D)
        flops = 4 * B * HQ * n * n * D / 2
        for name, fn in dense_systems(q, k, v).items():
            record(f"dense_causal_N{n}", name, fn, flops, (q, k, v))
    total = args.packed_tokens
    cu, lengths = packed_offsets(total)
    q, k, v = make(total, HQ, D), make(total, HKV, D), make(total, HKV, D)
    useful = sum(4 * HQ * n * n * D / 2 for n in lengths)  # within-document work only
    whole = 4 * HQ * total * total * D / 2  # the dense kernel's own causal work over the whole length
    for name, fn in packed_systems(q, k, v, cu, max(lengths)).items():
        flops = whole if name.endswith("dense_same_length") else useful
        record(f"packed_16docs_T{total}", name, fn, flops, (q, k, v))


if __name__ == "__main__":
    main()
