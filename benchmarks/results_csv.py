"""Shared by the benchmark scripts: the run's environment, and CSV rows appended as they are measured (a run that
is cut short keeps what it measured)."""

from __future__ import annotations

import csv
import datetime
import os

import torch


def environment() -> dict:
    """Date, GPU and versions, for every row."""
    import triton

    return {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }


def append_row(path: str, row: dict) -> None:
    """Append ``row`` to the CSV at ``path``; a new file takes the row's keys as its header."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    if os.path.exists(path):
        with open(path, newline="") as f:
            fields = next(csv.reader(f))
    else:
        fields = list(row)
        with open(path, "w", newline="") as f:
            csv.writer(f).writerow(fields)
    with open(path, "a", newline="") as f:
        csv.DictWriter(f, fieldnames=fields, extrasaction="ignore").writerow(row)
    print(row, flush=True)
