"""The fp32 masters of the blocks' matrices on NVMe (``nvme_masters``): chosen, written to the store at setup (the
parameters keep the compute-dtype copy the device computes with) and read back into the parameters at teardown."""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

from . import machine
from .nvme import MASTER, NvmeStateStore
from .shared_host import SharedHost, is_placeholder, placeholder
from .units import Unit

log = logging.getLogger(__name__)


def choose(blocks: list[Unit], trainable: set[nn.Parameter], compute_dtype: torch.dtype) -> list[nn.Parameter]:
    """The trained weight matrices each block owns: those whose masters go to disk."""
    if compute_dtype == torch.float32:
        raise ValueError(
            "nvme_masters=True keeps the masters on disk and their bf16 copies in RAM; under 32-true the device"
            " computes with fp32 weights, so nothing would be saved. Train with precision='bf16-mixed' or set"
            " nvme_masters=False."
        )
    return [p for u in blocks for p in u.owned() if p.dim() >= 2 and p in trainable]


def to_disk(
    store: NvmeStateStore, params: list[nn.Parameter], loaded: dict[nn.Parameter, Tensor], shared: SharedHost | None,
    compute_dtype: torch.dtype,
) -> None:  # fmt: skip
    """Each master to disk (its rows, where a node's processes share them out; ``loaded``: exact fp32 values from a
    checkpoint where the parameter holds fewer bits); the parameter keeps the copy the device computes with. A node's
    other processes hold no values: theirs pass through memory they share."""
    shared = shared if shared is not None and any(p not in loaded for p in params) else None
    staging = shared.tensors([(max(p.numel() for p in params), torch.float32)])[0] if shared else None
    for p in params:
        value = loaded.get(p)
        if value is None and shared is not None:
            value = staging[: p.numel()].view(p.shape)
            if shared.rank == 0:
                value.copy_(p.data)
            shared.main_barrier()
        store.write(p, MASTER, p.data if value is None else value)
        if shared is not None and p not in loaded:  # every process has its rows before the next one comes
            shared.main_barrier()
        p.data = placeholder(p.shape, compute_dtype) if is_placeholder(p.data) else p.data.to(compute_dtype)
        if hasattr(p, "grad_dtype"):  # its .grad shows the fp32 gradient (older torch: no .grad)
            p.grad_dtype = None


def from_disk(store: NvmeStateStore, params: list[nn.Parameter], shared: SharedHost | None) -> None:
    """The fp32 masters back into the parameters before the store's files go, if RAM holds them (once for a node's
    processes, each reading its rows into the memory they share); else a warning, and the bf16 copies stay."""
    need = sum(p.numel() * 4 for p in params)
    fits = need <= 0.9 * machine.available_host_bytes()
    if shared is not None:
        fits = all(shared.gather(fits))
    if not fits:
        log.warning(
            "SlideFormer leaves the bf16 copies in the %d block weights whose fp32 masters were on disk: the"
            " masters (%.2f GiB) do not fit the RAM available now. The checkpoints hold them (Trainer callbacks"
            " ModelCheckpoint; `slide export` reads them).", len(params), need / 2**30,
        )  # fmt: skip
        return
    if shared is None:
        for p in params:
            p.data = store.read(p, MASTER)
        return
    flats = shared.tensors([(p.numel(), torch.float32) for p in params])
    for p, flat in zip(params, flats):
        store.read(p, MASTER, flat.view(p.shape))
    shared.main_barrier()  # every process's rows are in
    for p, flat in zip(params, flats):
        p.data = flat.view(p.shape)
