"""Where a profiled step's GPU time goes, by kernel, for one or more Chrome traces side by side.

    python benchmarks/trace_kernels.py a_backward_32768.json.gz b_all_gpu_32768.json.gz [--top 30]

Sums the durations of each trace's GPU kernels by name (numbers in names are dropped, so one kernel's tile variants
count together) and prints the largest, each trace's seconds in one column.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import Counter


def kernel_seconds(path: str) -> Counter:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    totals: Counter = Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            name = e["name"] if e["cat"] == "kernel" else e["cat"] + ":" + e["name"].split()[0]
            totals[re.sub(r"\d+", "#", name)[:90]] += e["dur"] / 1e6
    return totals


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    totals = [kernel_seconds(p) for p in args.traces]
    names = sorted(set().union(*totals), key=lambda n: -max(t[n] for t in totals))
    print("".join(f"{i:>10}" for i in range(len(totals))) + "  kernel (seconds per trace; 0.. = the traces in order)")
    for n in names[: args.top]:
        print("".join(f"{t[n]:>10.4f}" for t in totals) + "  " + n)
    print("".join(f"{sum(t.values()):>10.4f}" for t in totals) + "  all (copies overlap kernels)")


if __name__ == "__main__":
    main()
