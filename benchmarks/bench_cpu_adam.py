"""The CPU optimizer's budget (GPU machine): torch's fused CPU AdamW on pageable vs pinned memory, alone and while
PCIe copies run in both directions, and whole tensors vs 8M-element chunks. ``--widen`` instead compares fp32
gradients with bf16 ones widened to fp32 a chunk at a time (the "forward" schedule's bf16 retained gradients), for
several chunk sizes. ``--state`` compares fp32 moments (torch's fused AdamW) with bf16 ones (``optimizer_state="bf16"``:
``lightning_slide/engine/adam_bf16.py``), the latter with fp32 gradients and with bf16 ones read as they are, through
the engine's ``CpuOptimizer``, chunk by chunk as the engine updates, on the same pinned parameters, alone and under
PCIe load (``results/cpu_adam_state.csv``).

    python benchmarks/bench_cpu_adam.py --params 1e9
    python benchmarks/bench_cpu_adam.py --params 1e9 --widen
    python benchmarks/bench_cpu_adam.py --params 1e9 --state
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import threading
import time

import torch

from results_csv import append_row, environment


def adam_time(params, grads, threads: int, chunk: int | None, repeats: int = 3) -> float:
    """Median time of fused AdamW over ``params``; bf16 ``grads`` are widened into an fp32 chunk first."""
    states = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    steps = [torch.zeros(()) for _ in params]
    wide = torch.empty(chunk) if grads[0].dtype != torch.float32 else None
    torch.set_num_threads(threads)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for p, g, (m, v), s in zip(params, grads, states, steps):
            s += 1
            cuts = [slice(None)] if chunk is None else [slice(i, i + chunk) for i in range(0, p.numel(), chunk)]
            for c in cuts:
                grad = g[c] if wide is None else wide[: len(g[c])].copy_(g[c])
                torch._fused_adamw_([p[c]], [grad], [m[c]], [v[c]], [], [s], lr=1e-5, beta1=0.9, beta2=0.999,
                                    weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)  # fmt: skip
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def widen(n: int, threads: int, common: dict, out: str) -> None:
    params = [torch.randn(n, pin_memory=True) for _ in range(4)]
    grads = [torch.randn(n, pin_memory=True) * 1e-3 for _ in range(4)]
    cases = [(torch.float32, None), (torch.float32, 1 << 23)] + [(torch.bfloat16, 1 << k) for k in (23, 21, 19, 17)]
    for load in (False, True):
        for dtype, chunk in cases + cases[::-1]:  # both orders: drift shows as a difference between the two
            # (the bf16 copies are pageable; pageable and pinned run alike on the CPU, see the default mode's rows)
            measure(out, {**common, "memory": "pinned"}, params, [g.to(dtype) for g in grads], threads, chunk, load)


def engine_time(params, grads, state: torch.dtype, threads: int, repeats: int = 3) -> float:
    """Median time of the engine's CPU update (``CpuOptimizer``, AdamW, moments in ``state``) over ``params``, as
    the engine runs it: chunks of 8M elements, each gradient first copied into a landing buffer of its dtype."""
    from lightning_slide.engine.optim import CpuOptimizer

    optimizer = CpuOptimizer(torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01), state)
    hypers = optimizer.snapshot()[0]
    landing = torch.empty(CHUNK, dtype=grads[0].dtype, pin_memory=torch.cuda.is_available())
    torch.set_num_threads(threads)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for p, g in zip(params, grads):
            optimizer.begin(p, hypers)
            for lo in range(0, p.numel(), CHUNK):
                grad = landing[: min(CHUNK, p.numel() - lo)].copy_(g[lo : lo + CHUNK])
                optimizer.update([p], [grad], hypers, rows=[slice(lo, lo + len(grad))])
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


CHUNK = 1 << 23  # the engine's transfer chunk (EngineConfig.chunk_numel)


def state_dtypes(n: int, threads: int, common: dict, out: str) -> None:
    params = [torch.randn(n, pin_memory=True) for _ in range(4)]
    grads = [torch.randn(n, pin_memory=True) * 1e-3 for _ in range(4)]
    narrow = [g.bfloat16() for g in grads]
    cases = [(torch.float32, grads), (torch.bfloat16, grads), (torch.bfloat16, narrow)]
    for load in (False, True):
        for state, these in cases + cases[::-1]:  # both orders: drift shows
            with PcieLoad() if load else contextlib.nullcontext() as pcie:
                t = engine_time(params, these, state, threads)
            append_row(out, {**common, "memory": "pinned", "state": str(state).removeprefix("torch."),
                             "grads": str(these[0].dtype).removeprefix("torch."), "chunk": CHUNK,
                             "pcie_load_gbps": round(pcie.gbps, 1) if load else 0.0, "seconds": t,
                             "gparams_per_s": sum(p.numel() for p in params) / t / 1e9})  # fmt: skip


def measure(out: str, common: dict, params, grads, threads: int, chunk: int | None, load: bool) -> None:
    """One case, alone or while both copy directions run (``load``), appended to ``out``."""
    if load:
        with PcieLoad() as pcie:
            t = adam_time(params, grads, threads, chunk)
        gbps = pcie.gbps
    else:
        t, gbps = adam_time(params, grads, threads, chunk), 0.0
    append_row(out, {**common, "grads": str(grads[0].dtype).removeprefix("torch."), "chunk": chunk or 0,
                     "pcie_load_gbps": round(gbps, 1), "seconds": t,
                     "gparams_per_s": sum(p.numel() for p in params) / t / 1e9})  # fmt: skip


class PcieLoad:
    """Keeps both copy directions busy from a background thread (pinned host <-> device, 256 MiB each)."""

    def __init__(self):
        n = 64 << 20
        self.host_up, self.host_down = torch.empty(n, pin_memory=True), torch.empty(n, pin_memory=True)
        self.dev_up, self.dev_down = torch.empty(n, device="cuda"), torch.empty(n, device="cuda")
        self.up, self.down = torch.cuda.Stream(), torch.cuda.Stream()
        self.stop, self.bytes = False, 0
        self.thread = threading.Thread(target=self.run)

    def run(self):
        while not self.stop:
            with torch.cuda.stream(self.up):
                self.dev_up.copy_(self.host_up, non_blocking=True)
            with torch.cuda.stream(self.down):
                self.host_down.copy_(self.dev_down, non_blocking=True)
            self.up.synchronize()
            self.down.synchronize()
            self.bytes += 2 * self.host_up.numel() * 4

    def __enter__(self):
        self.start = time.perf_counter()
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop = True
        self.thread.join()
        self.gbps = self.bytes / (time.perf_counter() - self.start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=float, default=1e9)
    parser.add_argument("--widen", action="store_true", help="fp32 vs bf16 gradients widened in chunks")
    parser.add_argument("--state", action="store_true", help="fp32 vs bf16 moments")
    parser.add_argument("--out", default=None, help="default: results/cpu_adam.csv (--state: cpu_adam_state.csv)")
    args = parser.parse_args()
    args.out = args.out or f"benchmarks/results/cpu_adam{'_state' if args.state else ''}.csv"
    n = int(args.params) // 4
    threads = max(1, os.cpu_count() - 1)
    common = {**environment(), "threads": threads, "params": 4 * n}
    if args.state:
        state_dtypes(n, threads, common, args.out)
        return
    if args.widen:
        widen(n, threads, common, args.out)
        return
    for memory in ("pageable", "pinned"):
        params = [torch.randn(n, pin_memory=memory == "pinned") for _ in range(4)]
        grads = [torch.randn(n, pin_memory=memory == "pinned") * 1e-3 for _ in range(4)]
        for chunk in (None, 1 << 23):
            for load in (False, True):
                measure(args.out, {**common, "memory": memory}, params, grads, threads, chunk, load)
        del params, grads


if __name__ == "__main__":
    main()
