"""Versions of the attention kernels side by side (GPU machine): each ``attention.py`` is loaded as a module of its
own (with its folder's other kernel files), and all run forward + backward on the same tensors, interleaved, three times
each (the middle time is kept). Cases: causal, bf16, 32/8 heads, D=128, dense B=2 at N=2048 and 8192, B=1 at
16384, and bench_attention.py's packed batch (16 documents of random lengths in 16k tokens, within-document work
counted). Appends CSV rows to --out: time, TFLOP/s, the time over the first version's, and the gradients' relative
difference from the first version's. ``--tune-new NAME=INT`` runs the last version under its ``tuning(NAME=INT)``,
so one file can be run against itself with another threshold.

    mkdir -p /tmp/main && git archive main kernels | tar -x -C /tmp/main
    python benchmarks/bench_attention_ab.py /tmp/main/kernels/attention.py kernels/attention.py --labels main,branch
    python benchmarks/bench_attention_ab.py kernels/attention.py kernels/attention.py --tune-new flat_below=8 \
        --labels flat_below_32,flat_below_8
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys
import tempfile
from contextlib import nullcontext

import torch
from triton.testing import do_bench

from bench_attention import autotuned, packed_offsets
from results_csv import append_row, environment

HQ, HKV, D = 32, 8, 128


def load(name: str, path: str):
    """The ``attention.py`` at ``path`` as ``name.attention``: a copy of its folder (its version of the kernels) becomes
    a package of its own, so its relative imports (``attention_triton.py``, ``tunable.py``) resolve within it."""
    root = tempfile.mkdtemp(prefix="attention_ab_")
    package = os.path.join(root, name)
    shutil.copytree(os.path.dirname(os.path.abspath(path)), package, ignore=shutil.ignore_patterns("__pycache__"))
    open(os.path.join(package, "__init__.py"), "a").close()
    sys.path.insert(0, root)
    return importlib.import_module(f"{name}.{os.path.splitext(os.path.basename(path))[0]}")


def tuned(module, items: list[str]):
    """A context that runs ``module`` under its ``tuning(NAME=INT, ...)`` (``nullcontext`` without items)."""
    if not items:
        return nullcontext
    changes = {key: int(value) for key, value in (item.split("=") for item in items)}
    if not hasattr(module, "tuning"):
        raise SystemExit(f"--tune-new {items}: {module.__file__} has no tuning() (an older version)")
    return lambda: module.tuning(**changes)


def cases(make):
    """(case, (q, k, v), kwargs, causal FLOPs of one forward)"""
    for n, b in ((2048, 2), (8192, 2), (16384, 1)):
        yield f"dense_causal_B{b}_N{n}", (make(b, n, HQ), make(b, n, HKV), make(b, n, HKV)), {}, 2 * b * HQ * n * n * D
    total = 16384
    cu, lengths = packed_offsets(total)
    qkv = (make(total, HQ), make(total, HKV), make(total, HKV))
    flops = sum(2 * HQ * n * n * D for n in lengths)  # within-document work
    yield f"packed_16docs_T{total}", qkv, {"cu_seqlens": cu, "max_seqlen": max(lengths)}, flops


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("versions", nargs="+", help="attention.py files, the first one the baseline")
    parser.add_argument("--labels", help="one per version (default: v0,v1,...)")
    parser.add_argument("--tune-new", action="append", default=[], metavar="NAME=INT",
                        help="a Tuning field for the last version")  # fmt: skip
    parser.add_argument("--out", default="benchmarks/results/attention_ab.csv")
    args = parser.parse_args()
    paths = args.versions
    labels = args.labels.split(",") if args.labels else [f"v{i}" for i in range(len(paths))]
    if len(paths) < 2 or len(labels) != len(paths):
        raise SystemExit(f"need two or more versions and one label each; got {len(paths)} versions, labels {labels}")
    modules = {label: load(f"attention_{i}", path) for i, (label, path) in enumerate(zip(labels, paths))}
    contexts = {label: tuned(modules[label], args.tune_new if label == labels[-1] else []) for label in labels}
    g = torch.Generator(device="cuda").manual_seed(0)

    def make(*shape):
        return torch.randn(*shape, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()

    for case, qkv, kwargs, flops in cases(make):
        grad_out = torch.randn_like(qkv[0])
        grads = {}
        for name, m in modules.items():
            with contexts[name]():
                grads[name] = torch.autograd.grad(m.flash_attention(*qkv, **kwargs), qkv, grad_out)
        first = grads.pop(labels[0])
        diff = {labels[0]: 0.0}
        for name, other in grads.items():
            diff[name] = max(((y.float() - x.float()).norm() / x.float().norm()).item() for x, y in zip(first, other))
        del grads, first
        times = {name: [] for name in labels}
        for rep in range(3):
            for name in labels if rep % 2 == 0 else labels[::-1]:
                fn, context = modules[name].flash_attention, contexts[name]

                def step():
                    with context():
                        torch.autograd.grad(fn(*qkv, **kwargs), qkv, grad_out)

                times[name].append(do_bench(step, warmup=25, rep=200, return_mode="median"))
        ms = {name: sorted(t)[1] for name, t in times.items()}
        for name, module in modules.items():
            print(f"{case} {name}: {autotuned(module)}", flush=True)
        for name in labels:
            tflops = flops * 3.5 / (ms[name] * 1e-3) / 1e12
            row = {"case": case, "system": name, "pass": "fwd+bwd", "ms": ms[name], "tflops": tflops}
            row |= {"vs_first": ms[name] / ms[labels[0]], "grad_rel_diff": diff[name]}
            append_row(args.out, {**environment(), **row})


if __name__ == "__main__":
    main()
