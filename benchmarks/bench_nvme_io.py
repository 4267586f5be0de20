"""NVMe I/O benchmark (any Linux machine): how fast the NVMe tier's way of moving optimizer state can go.

The tier writes and reads row blocks of a parameter's moment tensors (up to 32 MiB each) with O_DIRECT from
page-aligned buffers, on 4 I/O threads. Measured here on one file of --gib GiB under --dir, in regions of
--region-mib MiB:

  pwritev/preadv, N threads   os.pwritev/os.preadv with O_DIRECT, regions spread over N threads (the tier: N=4)
  caio linux-aio, depth D     the maintained asyncio binding of Linux AIO (pip install caio), D requests in
                              flight, with O_DIRECT and buffered; it takes and returns bytes objects (a copy each
                              way, and buffers O_DIRECT may refuse); skipped if not installed
  dd                          dd with oflag/iflag=direct, bs = one region: the disk's reference figure

Appends CSV rows (date, host, method, median GB/s written and read over --repeats runs) to --out.

    python benchmarks/bench_nvme_io.py --dir /path/on/nvme --out benchmarks/results/nvme_io.csv
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from lightning_slide.engine.transfer import aligned_empty
from results_csv import append_row

ALIGN = 4096


def aligned_buffer(nbytes: int):
    return aligned_empty(nbytes, ALIGN).fill_(7).numpy()  # the tier's own page-aligned buffers


def drop_cache(path: str) -> None:
    """O_DIRECT bypasses the page cache; this also keeps buffered methods honest."""
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def threaded(path: str, regions: int, size: int, threads: int) -> tuple[float, float]:
    buffers = [aligned_buffer(size) for _ in range(threads)]
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    figures = []
    for op in (os.pwritev, os.preadv):

        def run(worker: int) -> None:
            for i in range(worker, regions, threads):
                assert op(fd, [buffers[worker]], i * size) == size

        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(run, range(threads)))
        os.fsync(fd)
        figures.append(regions * size / (time.perf_counter() - start) / 1e9)
    os.close(fd)
    return figures[0], figures[1]


def caio_aio(path: str, regions: int, size: int, setting: tuple[int, bool]) -> tuple[float, float]:
    from caio import AsyncioContext

    depth, direct = setting
    payload = bytes(aligned_buffer(size))

    async def main() -> list[float]:
        ctx = AsyncioContext(max_requests=depth)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0), 0o600)
        figures = []
        for write in (True, False):
            drop_cache(path)  # buffered reads come from the disk too
            start = time.perf_counter()
            for first in range(0, regions, depth):
                batch = range(first, min(first + depth, regions))
                ops = [ctx.write(payload, fd, i * size) if write else ctx.read(size, fd, i * size) for i in batch]
                await asyncio.gather(*ops)
            os.fsync(fd)
            figures.append(regions * size / (time.perf_counter() - start) / 1e9)
        os.close(fd)
        return figures

    return tuple(asyncio.run(main()))


def dd(path: str, regions: int, size: int) -> tuple[float, float]:
    figures = []
    for args in ([f"of={path}", "if=/dev/zero", "oflag=direct"], [f"if={path}", "of=/dev/null", "iflag=direct"]):
        start = time.perf_counter()
        subprocess.run(["dd", f"bs={size}", f"count={regions}", *args], check=True, capture_output=True)
        figures.append(regions * size / (time.perf_counter() - start) / 1e9)
    return figures[0], figures[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True, help="a directory on the disk to measure")
    parser.add_argument("--gib", type=float, default=8.0)
    parser.add_argument("--region-mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/nvme_io.csv")
    args = parser.parse_args()
    size = args.region_mib << 20
    regions = int(args.gib * 1024) // args.region_mib
    path = os.path.join(args.dir, "bench_nvme_io.bin")
    methods = [(f"pwritev/preadv, {n} thread(s)", threaded, n) for n in (1, 2, 4)]
    methods += [(f"caio linux-aio, depth {d}{', O_DIRECT' if o else ', buffered'}", caio_aio, (d, o))
                for d in (4, 16) for o in (True, False)]  # fmt: skip
    methods += [("dd direct", dd, None)]
    common = {"date": datetime.date.today().isoformat(), "host": platform.node(), "torch": torch.__version__,
              "region_mib": args.region_mib, "gib": args.gib}  # fmt: skip
    try:
        for name, run, knob in methods:
            try:
                runs = [
                    run(path, regions, size, knob) if knob else run(path, regions, size) for _ in range(args.repeats)
                ]
                written, read = (statistics.median(r[i] for r in runs) for i in (0, 1))
                note = f"median of {args.repeats}"
            except (ImportError, OSError, SystemError) as err:  # a missing library, or refused O_DIRECT buffers
                written, read, note = float("nan"), float("nan"), f"{type(err).__name__}: {err}"
            append_row(args.out, {**common, "method": name, "write_gb_s": written, "read_gb_s": read, "note": note})
            drop_cache(path)
    finally:
        if os.path.exists(path):
            os.remove(path)


if __name__ == "__main__":
    main()
