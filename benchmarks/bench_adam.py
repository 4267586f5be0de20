"""The optimizer step of the units kept on the GPU (GPU machine): torch's AdamW (foreach, its default, and fused) with
fp32 moments against the engine's bf16 moments (``optimizer_state="bf16"``: the Triton twin of the host kernel).

The shape is what a 24 GiB plan keeps on the GPU for the Llama-3.1 shapes: the embedding and the head, 2 x 128256 x
4096 fp32 parameters with fp32 gradients. Median of CUDA-event timings of one step each, and the moments' bytes.

    python benchmarks/bench_adam.py --out benchmarks/results/adam.csv
"""

from __future__ import annotations

import argparse
import os

import torch
from bench_fused import time_ms

from lightning_slide.engine.optim import CpuOptimizer
from results_csv import append_row, environment

SHAPE = (128256, 4096)


def torch_step(params: list[torch.nn.Parameter], fused: bool):
    optimizer = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01, fused=fused, foreach=None if fused else True)
    return optimizer, optimizer.step


def engine_step(params: list[torch.nn.Parameter]):
    optimizer = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01)
    engine = CpuOptimizer(optimizer, torch.bfloat16)  # its update runs where the tensors are: here, the GPU

    def step() -> None:
        hypers = engine.snapshot()[0]
        for p in params:
            engine.begin(p, hypers)
        engine.update(params, [p.grad for p in params], hypers)

    return optimizer, step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "adam.csv")
    )
    args = parser.parse_args()
    params = [torch.nn.Parameter(torch.randn(SHAPE, device="cuda") * 0.02) for _ in range(2)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    systems = {
        "torch AdamW, foreach, fp32 moments": lambda: torch_step(params, fused=False),
        "torch AdamW, fused, fp32 moments": lambda: torch_step(params, fused=True),
        "engine, bf16 moments (Triton)": lambda: engine_step(params),
    }
    for name, make in systems.items():
        optimizer, step = make()
        ms = time_ms(step, args.repeats)
        states = optimizer.state.values()
        moments = sum(t.numel() * t.element_size() for s in states for k, t in s.items() if k != "step")
        append_row(args.out, {**environment(), "case": f"AdamW step, 2 x {SHAPE[0]} x {SHAPE[1]} fp32", "system": name,
                              "step_ms": ms, "moments_gib": moments / 2**30})  # fmt: skip
        print(f"{name}: {ms:.2f} ms, moments {moments / 2**30:.2f} GiB")
        optimizer.state.clear()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
