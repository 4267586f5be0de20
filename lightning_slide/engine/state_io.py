"""Checkpoint adapters: the optimizer state and the masters as checkpoints see them, where parts of them live in the
NVMe tier's files, and loaded state put back where the engine keeps it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from .nvme import MASTER
from .optim import CpuOptimizer, own_part, rows_of


class StateIO:
    """Checkpoint views of a run's state.

    Args:
        model: the module whose parameters are the masters.
        optimizer: the CPU optimizer driver (``None`` for evaluation only); its ``store`` is the NVMe tier, if any.
        disk_masters: parameters whose fp32 masters live in the store (they hold their compute-dtype copies).
    """

    def __init__(self, model: nn.Module, optimizer: CpuOptimizer | None, disk_masters: list[nn.Parameter]) -> None:
        self.model = model
        self.optimizer = optimizer
        self.disk_masters = disk_masters

    @property
    def _store(self):
        return self.optimizer.store if self.optimizer is not None else None

    def with_offloaded_state(self, state_dict: dict) -> dict:
        """``optimizer.state_dict()`` plus, for the moments that live in files, references to where they lie there
        (``NvmeStateStore.reference``; the checkpoint I/O copies the files beside the checkpoint)."""
        store = self._store
        if store is None:
            return state_dict
        store.flush()
        params = [p for g in self.optimizer.optimizer.param_groups for p in g["params"]]  # state_dict's numbering
        state = dict(state_dict["state"])
        for i, p in enumerate(params):
            if i in state and p in store.regions:
                state[i] = {**state[i], **store.reference(p)}
        return {**state_dict, "state": state}

    def with_offloaded_masters(self, state_dict: dict) -> dict:
        """The module's ``state_dict()`` with, for each master on disk, a reference to where it lies there in place of
        its compute-dtype copy."""
        if not self.disk_masters:
            return state_dict
        store = self._store
        store.flush()
        on_disk = set(self.disk_masters)
        names = {name: p for name, p in self.model.named_parameters() if p in on_disk}  # the state_dict's keys
        return {k: store.reference(names[k], (MASTER,))[MASTER] if k in names else v for k, v in state_dict.items()}

    def state_files(self) -> list[str]:
        """The files the optimizer state lives in (the NVMe tier), synced; none without it."""
        store = self._store
        return store.synced_paths() if store is not None else []

    @contextmanager
    def masters_as_fp32(self) -> Iterator[None]:
        """Within, the parameters whose masters are on disk look fp32 (without memory): ``Optimizer.load_state_dict``
        casts the state it loads to its parameter's dtype, which would round Adam's moments to bf16."""
        copies = [p.data for p in self.disk_masters]
        for p in self.disk_masters:
            p.data = torch.zeros((), dtype=torch.float32).expand(p.shape)
        try:
            yield
        finally:
            for p, copy in zip(self.disk_masters, copies):
                p.data = copy

    def adopt_loaded_state(self) -> None:
        """After ``optimizer.load_state_dict``: the loaded moments go into the files (NVMe tier), or into memory of
        their own (they may still be views of the memory-mapped checkpoint file, which would keep it alive)."""
        if self.optimizer is None:
            return
        store = self._store
        shared = self.optimizer.shared_state
        for p, state in self.optimizer.optimizer.state.items():
            for key in [k for k, v in state.items() if isinstance(v, Tensor) and v.dim() > 0]:
                if store is not None and p in store.regions:
                    store.write(p, key, state.pop(key))
                elif (p, key) in shared:  # each of the node's processes puts its rows into the memory they share
                    rows = self.optimizer.own_rows[p]
                    if (part := own_part(shared[p, key], rows)) is not None:
                        part.copy_(rows_of(state[key], rows))
                    state[key] = shared[p, key]
                else:
                    state[key] = state[key].clone()
