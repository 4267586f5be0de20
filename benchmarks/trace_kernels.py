"""Where a profiled step's GPU time goes, by kernel, for one or more Chrome traces side by side.

    python benchmarks/trace_kernels.py a_backward_32768.json.gz b_all_gpu_32768.json.gz [--top 30]

Sums the durations of each trace's GPU kernels by name (numbers in names are dropped, so one kernel's tile variants
count together) and prints the largest, each trace's seconds in one column. Then, per trace, the compute stream (the
stream with the most kernel time): its span, the time it computed, and the gaps over 1 ms where it sat idle, with
the kernel that ended each gap, the copies that ran in it, and the host's innermost ops that span most of it (what the
GPU waited for); where none spans it (a thread waiting in Python), the CUDA calls each thread made during it.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
from collections import Counter

HOST = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")


class Host:
    """A trace's host events: the longer ones (ops, annotations, CUDA calls that can cover half of a 1 ms gap) and
    every CUDA runtime call, by start time."""

    def __init__(self, events: list[dict]) -> None:
        self.long = [e for e in events if e.get("cat") in HOST and e["dur"] >= 500]
        self.calls = sorted((e for e in events if e.get("cat") == "cuda_runtime"), key=lambda e: e["ts"])
        self._starts = [e["ts"] for e in self.calls]

    def calls_by_thread(self, start: float, end: float) -> str:
        """Per thread, the CUDA calls that started in [start, end): how many, and the commonest."""
        per: dict = {}
        for e in self.calls[bisect.bisect_left(self._starts, start) : bisect.bisect_left(self._starts, end)]:
            per.setdefault(e["tid"], Counter())[e["name"]] += 1
        return ", ".join(f"tid {tid} {sum(c.values())} ({c.most_common(1)[0][0]})" for tid, c in per.items())


def trace_events(path: str) -> tuple[list[dict], Host]:
    """The trace's GPU events (kernels, copies, memsets) and its host events."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    return [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")], Host(events)


def overlap(e: dict, start: float, end: float) -> float:
    return max(0.0, min(end, e["ts"] + e["dur"]) - max(start, e["ts"]))


def in_gap(gpu: list[dict], host: Host, start: float, end: float) -> str:
    """The copies during a gap (ms) and the shortest host events that cover at least half of it, else the CUDA calls
    made during it."""
    copied = sum(overlap(e, start, end) for e in gpu if e["cat"] == "gpu_memcpy") / 1e3
    covering = sorted((e for e in host.long if overlap(e, start, end) >= (end - start) / 2), key=lambda e: e["dur"])
    names = ", ".join(f"{e['name'][:40]} (tid {e['tid']}, {e['dur'] / 1e3:.1f} ms)" for e in covering[:3])
    return f"copies {copied:.1f} ms; host: {names or '-; CUDA calls: ' + (host.calls_by_thread(start, end) or '-')}"


def kernel_seconds(events: list[dict]) -> Counter:
    totals: Counter = Counter()
    for e in events:
        name = e["name"] if e["cat"] == "kernel" else e["cat"] + ":" + e["name"].split()[0]
        totals[re.sub(r"\d+", "#", name)[:90]] += e["dur"] / 1e6
    return totals


def compute_stream(events: list[dict], host: Host, min_gap_ms: float = 1.0) -> str:
    """The compute stream's span, busy time and idle gaps (ms from the step's first GPU event)."""
    per_stream: Counter = Counter()
    for e in events:
        if e["cat"] == "kernel":
            per_stream[e["tid"]] += e["dur"]
    stream = per_stream.most_common(1)[0][0]
    kernels = sorted((e for e in events if e["tid"] == stream), key=lambda e: e["ts"])
    origin = min(e["ts"] for e in events)
    end, busy, gaps = kernels[0]["ts"], 0.0, []
    for e in kernels:
        if e["ts"] - end > min_gap_ms * 1e3:
            idle, at = (e["ts"] - end) / 1e3, (end - origin) / 1e3
            gaps.append(f"  idle {idle:7.1f} ms from {at:7.1f} ms, then {e['name'][:60]}")
            gaps.append(f"      {in_gap(events, host, end, e['ts'])}")
        busy += max(0.0, e["ts"] + e["dur"] - max(end, e["ts"]))
        end = max(end, e["ts"] + e["dur"])
    span = end - kernels[0]["ts"]
    head = f"compute stream: span {span / 1e3:.1f} ms, computing {busy / 1e3:.1f} ms, idle {(span - busy) / 1e3:.1f} ms"
    return "\n".join([head, *gaps])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    traces = [trace_events(p) for p in args.traces]
    totals = [kernel_seconds(gpu) for gpu, _ in traces]
    names = sorted(set().union(*totals), key=lambda n: -max(t[n] for t in totals))
    print("".join(f"{i:>10}" for i in range(len(totals))) + "  kernel (seconds per trace; 0.. = the traces in order)")
    for n in names[: args.top]:
        print("".join(f"{t[n]:>10.4f}" for t in totals) + "  " + n)
    print("".join(f"{sum(t.values()):>10.4f}" for t in totals) + "  all (copies overlap kernels)")
    for i, (gpu, host) in enumerate(traces):
        print(f"{i}: {compute_stream(gpu, host)}")


if __name__ == "__main__":
    main()
