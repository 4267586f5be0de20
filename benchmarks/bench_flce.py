"""Fused linear cross-entropy benchmark (GPU machine): ours (Triton, and the chunked torch path) against torch
eager, torch.compile and Liger-Kernel (default bf16 accumulation and fp32 accumulation, if installed), in one run.

H=4096, V=128256, bf16, fwd+bwd. Reports the median time (triton.testing.do_bench), the peak memory the op allocates
beyond its inputs (gradient outputs and workspaces included), and the relative error of dx and dW against an fp32
reference. Appends CSV rows to --out.

    python benchmarks/bench_flce.py --tokens 4096,8192,16384,32768
    python benchmarks/bench_flce.py --tokens 8192 --systems ours_triton,torch_compile --kernels   # GPU time per kernel
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import lightning_slide.kernels.linear_cross_entropy as flce
from bench_attention import kernel_ms
from lightning_slide.kernels.linear_cross_entropy import fused_linear_cross_entropy
from results_csv import append_row, environment

GIB = 2**30


def eager(h, w, t):
    return F.cross_entropy(F.linear(h, w).float(), t)


def systems():
    # name: (the loss's tuning, empty for a baseline; the function). Ours as the loss runs it (one pass, at most 8
    # token chunks: within 1.3 GiB at 8k tokens), with 4 chunks and 2 (more memory, fewer roundings of dW), with two
    # passes, and its torch path.
    ours = fused_linear_cross_entropy
    out = {"ours_triton": ({"triton": True}, ours),
           "ours_triton_4chunks": ({"triton": True, "max_token_chunks": 4}, ours),
           "ours_triton_2chunks": ({"triton": True, "max_token_chunks": 2}, ours),
           "ours_triton_two_pass": ({"triton": True, "one_pass": False}, ours), "ours_torch": ({"triton": False}, ours),
           "torch_eager": ({}, eager), "torch_compile": ({}, torch.compile(eager))}  # fmt: skip
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy as liger

        out["liger"] = ({}, lambda h, w, t: liger(h, w, t))
        out["liger_fp32_accum"] = ({}, lambda h, w, t: liger(h, w, t, accum_dtype=torch.float32))
    except ImportError as err:
        print(f"Liger not available ({err}); skipping it")
    return out


def measure(fn, h, w, t, ref_grads):
    def step():
        hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
        return torch.autograd.grad(fn(hh, ww, t), (hh, ww))

    dx, dw = step()  # warm-up (and autotuning / compilation)
    errors = [((a.float() - b).norm() / b.norm()).item() for a, b in zip((dx, dw), ref_grads)]
    del dx, dw
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / GIB
    ms = do_bench(step, warmup=100, rep=500, return_mode="median")
    return ms, peak, errors


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="4096,8192,16384,32768")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--systems", default=None, help="comma-separated subset of the systems (default: all)")
    parser.add_argument("--out", default="benchmarks/results/flce.csv")
    parser.add_argument("--note", default="", help="written in each row's note column")
    parser.add_argument("--kernels", action="store_true", help="only: GPU time per kernel of each system's fwd+bwd")
    parser.add_argument("--kernels-out", default="benchmarks/results/flce_kernels.csv")
    args = parser.parse_args()
    common = {**environment(), "hidden": args.hidden, "vocab": args.vocab}
    todo = systems()
    if args.systems:
        todo = {name: todo[name] for name in args.systems.split(",")}
    for n in (int(x) for x in args.tokens.split(",")):
        g = torch.Generator(device="cuda").manual_seed(0)
        h = torch.randn(n, args.hidden, device="cuda", generator=g).bfloat16()
        w = (torch.randn(args.vocab, args.hidden, device="cuda", generator=g) * 0.02).bfloat16()
        t = torch.randint(0, args.vocab, (n,), device="cuda", generator=g)
        if args.kernels:  # where each system's time goes, kernel by kernel
            leaves = (h.detach().requires_grad_(), w.detach().requires_grad_())
            for name, (changes, fn) in todo.items():
                with flce.tuning(**changes):
                    times = kernel_ms(lambda fn=fn: fn(*leaves, t), leaves)
                for kernel, ms in sorted(times.items(), key=lambda kv: -kv[1]):
                    append_row(args.kernels_out, {**common, "system": name, "tokens": n, "kernel": kernel[:120],
                                                  "ms": ms, "note": args.note})  # fmt: skip
            continue
        hf, wf = h.float().requires_grad_(), w.float().requires_grad_()
        ref_grads = torch.autograd.grad(eager(hf, wf, t), (hf, wf))
        del hf, wf
        for name, (changes, fn) in todo.items():
            try:
                with flce.tuning(**changes):
                    ms, peak, (err_dx, err_dw) = measure(fn, h, w, t, ref_grads)
                note = args.note
            except Exception as err:  # keep the others; say what failed
                ms = peak = err_dx = err_dw = float("nan")
                note = f"FAILED: {type(err).__name__}: {str(err)[:200]}"
            tflops = 3 * 2 * n * args.hidden * args.vocab / (ms * 1e-3) / 1e12
            append_row(args.out, {**common, "system": name, "tokens": n, "ms": ms, "tflops_3mm": tflops,
                                  "peak_extra_gib": peak, "dx_rel_err": err_dx, "dw_rel_err": err_dw,
                                  "note": note})  # fmt: skip
        del ref_grads


if __name__ == "__main__":
    main()
