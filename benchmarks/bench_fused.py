"""RMSNorm, rotary embedding and the SwiGLU MLP's gated activation, forward + backward (GPU machine): transformers'
Llama code against the fused kernels.

The shapes of a Llama-3.1-8B step of 8 x 4096 tokens under bf16-mixed: the blocks' norms (hidden 4096) on the fp32
residual stream, Qwen3's per-head query norm (head dim 128, 32 heads) on bf16 projections, the weight in fp32 as the
engine keeps vectors; the rotary embedding of the bf16 queries (32 heads) and keys (8), heads first as transformers
views them, with fp32 cos/sin; the MLP's gated activation of bf16 projections (intermediate 14336; the projections'
matrix products are the same in both and left out). Median of CUDA-event timings; one row per case and
implementation.

    python benchmarks/bench_fused.py --out benchmarks/results/fused.csv
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable

import torch
from transformers.models.llama import modeling_llama

from lightning_slide.fused import use_fused_ops
from lightning_slide.kernels.swiglu import swiglu
from results_csv import append_row, environment


def time_ms(step: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[3:])


def norm_case(shape: tuple, dtype: torch.dtype) -> tuple[torch.nn.Module, Callable[[], None]]:
    module = modeling_llama.LlamaRMSNorm(shape[-1], eps=1e-5).cuda()
    x = torch.randn(shape, device="cuda", dtype=dtype).requires_grad_()
    dy = torch.randn(shape, device="cuda")  # the output is fp32: an fp32 weight times the input's dtype
    return module, lambda: module(x).backward(dy)


def rotary_case() -> tuple[torch.nn.Module, Callable[[], None]]:
    q, k = (torch.randn(8, 4096, h, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for h in (32, 8))
    q, k = q.requires_grad_(), k.requires_grad_()
    cos, sin = (torch.randn(1, 4096, 128, device="cuda") for _ in range(2))
    dq, dk = torch.randn(q.shape, device="cuda"), torch.randn(k.shape, device="cuda")
    attention = modeling_llama.LlamaAttention(modeling_llama.LlamaConfig(), 0)  # only for the switch to find its file

    def step() -> None:
        q_embed, k_embed = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)  # looked up per call, as transformers
        torch.autograd.backward((q_embed, k_embed), (dq, dk))

    return attention, step


def swiglu_case() -> tuple[torch.nn.Module, Callable[[], None]]:
    mlp = modeling_llama.LlamaMLP(modeling_llama.LlamaConfig(hidden_size=64, intermediate_size=128))
    gate, up = (torch.randn(8 * 4096, 14336, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "gu")
    dy = torch.randn(gate.shape, device="cuda", dtype=torch.bfloat16)

    def step() -> None:  # what the MLP's forward computes between its projections, as the switch left its class
        switched = type(mlp).forward is not modeling_llama.LlamaMLP.forward
        (swiglu(gate, up) if switched else mlp.act_fn(gate) * up).backward(dy)

    return mlp, step


CASES = {
    "blocks' norm, fp32 residual, 8x4096x4096": lambda: norm_case((8, 4096, 4096), torch.float32),
    "query norm per head, bf16, 8x4096x32x128": lambda: norm_case((8, 4096, 32, 128), torch.bfloat16),
    "rotary of queries and keys, bf16, 8x4096x(32+8)x128": rotary_case,
    "MLP's gated activation (SiLU), bf16, 8x4096x14336": swiglu_case,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "fused.csv")
    )
    args = parser.parse_args()
    for case, make in CASES.items():
        module, step = make()
        for name in ("transformers", "fused"):
            restore = use_fused_ops(module) if name == "fused" else None
            ms = time_ms(step, args.repeats)
            append_row(args.out, {**environment(), "case": case, "implementation": name, "fwd_bwd_ms": ms})
            if restore is not None:
                restore()


if __name__ == "__main__":
    main()
