"""The embedding's touched rows' update (any machine, CPU only): how its pass size sets its speed.

At the end of each backward the CPU worker updates the embedding rows the step's tokens touched (rows.py): per pass,
it gathers those rows of the fp32 masters and both Adam moments, runs fused AdamW on them and scatters them back.
The next step's forward waits for it (benchmarks/NOTES.md, "Core engine"). This times ``RowSplit.apply`` over one step's
gradient chunks (8 M elements each, as the engine sends them) for each pass size given
(``EngineConfig.rows_pass_numel``), interleaved, median of --repeats, on a Llama-3 sized embedding and the distinct ids
of --tokens uniform random token ids.

    python benchmarks/bench_rows_update.py --pass-numel 8388608,2097152,1048576
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import torch

from lightning_slide.engine import rows
from lightning_slide.engine.optim import CpuOptimizer
from results_csv import append_row

CHUNK_NUMEL = 1 << 23  # the engine's default chunk_numel


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pass-numel", default="8388608,2097152,1048576")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/rows_update.csv")
    args = parser.parse_args()
    sizes = [int(x) for x in args.pass_numel.split(",")]

    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(args.vocab, args.hidden))
    optimizer = CpuOptimizer(torch.optim.AdamW([weight], lr=1e-4, weight_decay=0.01, fused=True))
    hypers = optimizer.snapshot()[0]
    optimizer.begin(weight, hypers)
    for tensor in optimizer.state_like(weight).values():  # the masters and moments, with valid values
        tensor.uniform_(0.1, 1.0)
    index = torch.unique(torch.randint(0, args.vocab, (args.tokens,)))
    # one split per pass size, each with its scratch buffers kept across rounds (as the engine keeps them)
    splits = {n: rows.RowSplit(weight, index, CHUNK_NUMEL, n, {}, on_device=False) for n in sizes}
    grads = torch.randn(splits[sizes[0]].rows_per_chunk, args.hidden)

    def one_step(split: rows.RowSplit) -> float:
        start = time.perf_counter()
        for lo in range(0, len(index), split.rows_per_chunk):
            hi = min(len(index), lo + split.rows_per_chunk)
            split.apply(optimizer, lo, hi, grads[: hi - lo], hypers)
        return time.perf_counter() - start

    times: dict[int, list[float]] = {n: [] for n in sizes}
    for rep in range(args.repeats + 1):  # the first round warms up
        for n in sizes if rep % 2 == 0 else sizes[::-1]:
            elapsed = one_step(splits[n])
            if rep:
                times[n].append(elapsed)
    first = statistics.median(times[sizes[0]])
    for n in sizes:
        median = statistics.median(times[n])
        append_row(args.out, {
            "date": datetime.date.today().isoformat(), "cpu": cpu_name(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "vocab": args.vocab, "hidden": args.hidden, "rows": len(index),
            "pass_numel": n, "ms": median * 1e3, "vs_first": median / first,
        })  # fmt: skip


if __name__ == "__main__":
    main()
