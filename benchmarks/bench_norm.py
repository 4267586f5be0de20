"""RMSNorm forward + backward (GPU machine): Hugging Face's ``LlamaRMSNorm`` against the fused kernel.

The shapes of a Llama-3.1-8B step of 8 x 4096 tokens: the blocks' norms (hidden 4096) on the fp32 residual stream that
bf16-mixed training carries, and Qwen3's per-head query norm (head dim 128, 32 heads) on bf16 projections; the weight
in fp32, as the engine keeps vectors. Median of CUDA-event timings; one row per case and implementation.

    python benchmarks/bench_norm.py --out benchmarks/results/norm.csv
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from lightning_slide.norms import use_fused_rms_norm
from results_csv import append_row, environment

CASES = {  # name: (input shape, input dtype)
    "blocks' norm, fp32 residual": ((8, 4096, 4096), torch.float32),
    "query norm per head, bf16": ((8, 4096, 32, 128), torch.bfloat16),
}


def time_ms(module: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, repeats: int) -> float:
    times = []
    for _ in range(repeats + 3):
        x.grad = module.weight.grad = None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        module(x).backward(dy)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[3:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "norm.csv")
    )
    args = parser.parse_args()
    for case, (shape, dtype) in CASES.items():
        module = LlamaRMSNorm(shape[-1], eps=1e-5).cuda()
        x = torch.randn(shape, device="cuda", dtype=dtype).requires_grad_()
        dy = torch.randn(shape, device="cuda")  # the output is fp32: an fp32 weight times the input's dtype
        for name in ("transformers", "fused"):
            if name == "fused":
                use_fused_rms_norm(module)
            ms = time_ms(module, x, dy, args.repeats)
            row = {**environment(), "case": case, "shape": "x".join(map(str, shape)), "dtype": str(dtype)[6:],
                   "implementation": name, "fwd_bwd_ms": ms}  # fmt: skip
            append_row(args.out, row)


if __name__ == "__main__":
    main()
