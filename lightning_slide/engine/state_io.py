"""Checkpoint adapters: the optimizer state and the masters as checkpoints see them, where parts of them live in the
NVMe tier's files, and loaded state put back where the engine keeps it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from .delay import DelayedBlocks
from .nvme import MASTER, merged
from .optim import CpuOptimizer, own_part, rows_of
from .shared_host import SharedHost


class StateIO:
    """Checkpoint views of a run's state.

    Args:
        model: the module whose parameters are the masters.
        optimizer: the CPU optimizer driver (``None`` for evaluation only); its ``store`` is the NVMe tier, if any.
        disk_masters: parameters whose fp32 masters live in the store (they hold their compute-dtype copies).
        shared: the node's processes, each holding its rows of the state in a store of its own; every process then
            calls each method at once, and the first one's answers describe the whole state.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: CpuOptimizer | None,
        disk_masters: list[nn.Parameter],
        shared: SharedHost | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.disk_masters = disk_masters
        self.shared = shared
        self.delay: DelayedBlocks | None = None  # the delayed blocks' copies, saved beside their moments (setup)

    @property
    def _store(self):
        return self.optimizer.store if self.optimizer is not None else None

    def with_offloaded_state(self, state_dict: dict) -> dict:
        """``optimizer.state_dict()`` plus, for the moments that live in files, references to where they lie there
        (``NvmeStateStore.reference``; the checkpoint I/O copies the files beside the checkpoint), and the delayed
        blocks' copies."""
        if self.optimizer is None:
            return state_dict
        params = [p for g in self.optimizer.optimizer.param_groups for p in g["params"]]  # state_dict's numbering
        if self.delay is not None:
            state_dict = {**state_dict, "state": self.delay.into_state(state_dict["state"], params)}
        store = self._store
        if store is None:
            return state_dict
        store.flush()
        held = [(i, p) for i, p in enumerate(params) if p in store.regions]
        refs = {(i, key): ref for i, p in held for key, ref in store.reference(p).items()}
        state = {i: dict(s) for i, s in state_dict["state"].items()}
        for (i, key), ref in self._merged(refs).items():
            if i in state:
                state[i][key] = ref
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
        refs = {name: store.reference(p, (MASTER,))[MASTER] for name, p in names.items() if p in store.regions}
        return {**state_dict, **self._merged(refs)}

    def state_pieces(self) -> list[tuple[str, int, str, int, int]]:
        """What the checkpoint's copies of the state files are made of (``NvmeStateStore.pieces``), the files
        synced; none without the NVMe tier."""
        store = self._store
        if store is None:
            return []
        pieces = store.pieces()
        return [p for part in self.shared.gather(pieces) for p in part] if self.shared is not None else pieces

    def _merged(self, refs: dict) -> dict:
        # the references of the tensors whose parts `refs` describes, joined with the other processes' parts
        parts = self.shared.gather(refs) if self.shared is not None else [refs]
        keys = dict.fromkeys(k for part in parts for k in part)
        return {k: merged([part[k] for part in parts if k in part]) for k in keys}

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
        their own (they may still be views of the memory-mapped checkpoint file, which would keep it alive), in the
        state's dtype (``load_state_dict`` casts them to their parameter's)."""
        if self.optimizer is None:
            return
        store = self._store
        shared = self.optimizer.shared_state
        for p, state in self.optimizer.optimizer.state.items():
            for key in [k for k, v in state.items() if isinstance(v, Tensor) and k != "step"]:  # a scalar's too
                if store is not None and p in store.scope:  # the rows held here
                    store.write(p, key, state.pop(key))
                elif (p, key) in shared:  # each of the node's processes puts its rows into the memory they share
                    rows = self.optimizer.own_rows[p]
                    if (part := own_part(shared[p, key], rows)) is not None:
                        part.copy_(rows_of(state[key], rows))
                    state[key] = shared[p, key]
                else:
                    state[key] = state[key].to(self.optimizer.state_dtype_of(p), copy=True)
