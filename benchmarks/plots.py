"""The README's pictures, drawn from the CSVs in ``results/`` (matplotlib: ``pip install -e ".[plots]"``):

- ``throughput.png``: tokens/s against tokens per step, for SlideFormer (each update schedule, GPU capped at 24 GiB),
  all-on-GPU and FSDP2 CPU offload (``core.csv``);
- ``memory.png``: peak GPU (allocated) and peak host memory of each of those systems (``core.csv``);
- ``attention.png``: attention TFLOP/s (forward and backward) by kernel and sequence length (``attention.csv``);
- ``loss.png``: the training loss of the same run with and without the strategy (``loss.csv``, from
  ``bench_loss.py``), when that file exists: its newest run, whatever ``--until`` says.

Each point of the others is the newest row of its system and shape dated on or before ``--until`` (default: any
date), so a figure can be redrawn as of the runs a README table quotes. PNGs go to ``--out``.

    python benchmarks/plots.py --until 2026-12-01
"""

from __future__ import annotations

import argparse
import csv
import os

HERE = os.path.dirname(os.path.abspath(__file__))
SYSTEMS = {  # core.csv (system, schedule) -> label
    ("a_slideformer", "backward"): "SlideFormer, no clipping (24 GiB cap)",
    ("a_slideformer", "forward"): "SlideFormer, clip 1.0 (24 GiB cap)",
    ("b_all_gpu", ""): "all on GPU",
    ("c_fsdp2_offload", ""): "FSDP2 CPU offload",
}
KERNELS = {"ours": "ours (Triton)", "sdpa_flash": "SDPA flash", "sdpa_cudnn": "SDPA cuDNN", "flex": "FlexAttention"}


def newest(rows: list[dict], key, until: str | None) -> dict:
    """The last row (in file order) of each ``key(row)``, among rows dated on or before ``until``."""
    out = {}
    for row in rows:
        if until is None or row["date"] <= until:
            out[key(row)] = row
    return out


def core_rows(path: str, until: str | None) -> dict:
    with open(path) as f:
        rows = [r for r in csv.DictReader(f) if r.get("accumulate", "1") in ("", "1") and r["step_s"] != "nan"]
    rows = [r for r in rows if (r["system"], r["schedule"]) in SYSTEMS and r["gpu"].startswith("NVIDIA H200")]
    return newest(rows, lambda r: (r["system"], r["schedule"], int(r["tokens"])), until)


def throughput(plt, core: dict, out: str) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for (system, schedule), label in SYSTEMS.items():
        points = sorted((t, float(r["tok_s"])) for (s, sc, t), r in core.items() if (s, sc) == (system, schedule))
        if points:
            ax.plot(*zip(*points), marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per optimizer step")
    ax.set_ylabel("tokens / s")
    ax.set_title("2.8 B Llama shape, bf16, one H200")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "throughput.png"), dpi=120)


def memory(plt, core: dict, out: str, tokens: int = 32768) -> None:
    shown = [(label, core[(s, sc, tokens)]) for (s, sc), label in SYSTEMS.items() if (s, sc, tokens) in core]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    width, xs = 0.38, range(len(shown))
    ax.bar([x - width / 2 for x in xs], [float(r["gpu_alloc_gib"]) for _, r in shown], width, label="peak GPU")
    ax.bar([x + width / 2 for x in xs], [float(r["host_peak_gib"]) for _, r in shown], width, label="peak host")
    ax.set_xticks(list(xs), [label.replace(" (", "\n(").replace(", ", ",\n", 1) for label, _ in shown], fontsize=7)
    ax.set_ylabel("GiB")
    ax.set_title(f"2.8 B Llama shape, {tokens // 1024}k tokens per step")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "memory.png"), dpi=120)


def attention(plt, path: str, out: str, until: str | None) -> None:
    with open(path) as f:
        rows = [r for r in csv.DictReader(f) if r["system"] in KERNELS and r["case"].startswith("dense_causal_N")]
    last = newest(rows, lambda r: (r["system"], r["case"], r["pass"]), until)
    cases = sorted({case for _, case, _ in last}, key=lambda c: int(c.rsplit("N", 1)[1]))
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.8), sharey=True)
    for ax, step in zip(axes, ("fwd", "fwd+bwd")):
        width = 0.8 / len(KERNELS)
        for k, (system, label) in enumerate(KERNELS.items()):
            values = [float(last[(system, c, step)]["tflops"]) if (system, c, step) in last else 0.0 for c in cases]
            ax.bar([i + (k - (len(KERNELS) - 1) / 2) * width for i in range(len(cases))], values, width, label=label)
        ax.set_xticks(range(len(cases)), [f"N={c.rsplit('N', 1)[1]}" for c in cases])
        ax.set_title(f"causal attention, {step}")
    axes[0].set_ylabel("TFLOP/s (bf16, B=2, 32/8 heads, D=128)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "attention.png"), dpi=120)


def loss(plt, path: str, out: str) -> None:
    with open(path) as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return
    date = max(r["date"] for r in rows)  # the newest run of each system, drawn together, a panel per model
    rows = [r for r in rows if r["date"] == date]
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6.4 * len(models), 4.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        these = [r for r in rows if r["model"] == model]
        for system, precision in dict.fromkeys((r["system"], r["precision"]) for r in these):
            points = {int(r["step"]): float(r["train_loss"]) for r in these if r["system"] == system}
            ax.plot(list(points), list(points.values()), label=f"{system} ({precision})", linewidth=1.0)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("train/loss")
        ax.set_yscale("log")
        ax.set_title(f"{model}, {these[-1]['gpu'].replace('none', 'CPU')} ({date})")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "loss.png"), dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=os.path.join(HERE, "results"))
    parser.add_argument("--out", default=os.path.join(HERE, "results", "plots"))
    parser.add_argument("--until", default=None, help="YYYY-MM-DD: the newest rows dated on or before it")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(args.out, exist_ok=True)
    core = core_rows(os.path.join(args.results, "core.csv"), args.until)
    throughput(plt, core, args.out)
    memory(plt, core, args.out)
    attention(plt, os.path.join(args.results, "attention.csv"), args.out, args.until)
    if os.path.exists(os.path.join(args.results, "loss.csv")):
        loss(plt, os.path.join(args.results, "loss.csv"), args.out)
    print(f"wrote {', '.join(sorted(os.listdir(args.out)))} in {args.out}")


if __name__ == "__main__":
    main()
