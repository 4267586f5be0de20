"""What the attention autotuner saw (GPU machine): for one version of ``attention.py``, the time of every config of
each kernel, as the autotuner measured it (each kernel alone), on bench_attention.py's packed batch and on dense
B=2 x 2048 and B=1 x 16384; then each compiled kernel's registers, spills, shared memory, and how many of its
programs fit on one multiprocessor. Prints only.

    python benchmarks/attention_configs.py kernels/attention.py
    python benchmarks/attention_configs.py kernels/attention.py flat_below=64   # under its tuning(flat_below=64)
"""

from __future__ import annotations

import re
import sys

import torch

from bench_attention import packed_offsets
from bench_attention_ab import load, tuned

HQ, HKV, D = 32, 8, 128
KERNELS = ("_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel")


def describe(config) -> str:
    kw = config.kwargs
    return f"{kw['BLOCK_M']}x{kw['BLOCK_N']} w{config.num_warps} s{config.num_stages} r{config.maxnreg}"


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    module = load("attention_configs_version", sys.argv[1])
    context = tuned(module, sys.argv[2:])
    g = torch.Generator(device="cuda").manual_seed(0)

    def make(*shape):
        return torch.randn(*shape, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()

    total = 16384
    cu, lengths = packed_offsets(total)
    cases = {
        "packed": ((make(total, HQ), make(total, HKV), make(total, HKV)), dict(cu_seqlens=cu, max_seqlen=max(lengths))),
        "dense_B2_N2048": ((make(2, 2048, HQ), make(2, 2048, HKV), make(2, 2048, HKV)), {}),
        "dense_B1_N16384": ((make(1, total, HQ), make(1, total, HKV), make(1, total, HKV)), {}),
    }  # fmt: skip
    for case, (qkv, kwargs) in cases.items():
        with context():
            out = module.flash_attention(*qkv, **kwargs)
            torch.autograd.grad(out, qkv, torch.randn_like(out))
        torch.cuda.synchronize()
        for name in KERNELS:
            kernel = getattr(module, name)
            # configs_timings: config -> the autotuner's time (a float, or a list whose first item is the median)
            timed = kernel.configs_timings.items()
            timings = sorted((t if isinstance(t, float) else t[0], describe(c)) for c, t in timed)
            listed = " | ".join(f"{c} {ms:.3f} ms" for ms, c in timings)
            print(case, name, "picked", describe(kernel.best_config), "|", listed, flush=True)
    props = torch.cuda.get_device_properties(0)
    regs_per_sm, smem_per_sm = props.regs_per_multiprocessor, props.shared_memory_per_multiprocessor
    for name in KERNELS:
        for caches in getattr(module, name).fn.device_caches.values():
            for key, compiled in caches[0].items():
                meta = compiled.metadata
                threads = meta.num_warps * 32
                # programs per multiprocessor: registers, shared memory (1 KiB of it reserved per program), threads
                fit = min(regs_per_sm // (compiled.n_regs * threads), smem_per_sm // (meta.shared + 1024),
                          2048 // threads)  # fmt: skip
                constexprs = re.findall(r"\('constexpr', (\w+)\)", str(key))
                print(name, f"w{meta.num_warps} s{meta.num_stages} shared {meta.shared} registers {compiled.n_regs}",
                      f"spills {compiled.n_spills} programs/SM {fit} constexprs {constexprs}")  # fmt: skip


if __name__ == "__main__":
    main()
