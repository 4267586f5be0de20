"""The processes of a run: one per device, started by Lightning's launcher, joined in one torch.distributed group.

``SlideFormerStrategy`` stands on this class: a world of one (``devices=1``, one node) starts nothing and joins no
group, exactly as a single-device strategy; a larger world (``devices=N``, ``num_nodes=M``, or ``torchrun`` and SLURM
through Lightning's cluster environments) starts its processes with Lightning's subprocess launcher and joins a group
on NCCL (CUDA) or gloo (CPU). The collectives here are Lightning's own (``barrier``, ``broadcast``, ``reduce``,
``all_gather``), as ``DDPStrategy`` provides them.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _init_dist_connection
from lightning.fabric.utilities.distributed import _sync_ddp_if_available as _sync
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import nn
from typing_extensions import override

from .engine.shared_host import SharedHost, drop_weights
from .engine.world import DataParallel


class Processes(ParallelStrategy):
    """A Lightning strategy whose world may span processes.

    Args:
        timeout: how long a collective waits for a process that stopped answering before it fails (a process that
            died fails it at once); torch's default: 30 minutes.
    """

    def __init__(self, *, timeout: datetime.timedelta = default_pg_timeout, **kwargs: Any) -> None:
        if not isinstance(timeout, datetime.timedelta) or timeout <= datetime.timedelta(0):
            raise ValueError(f"timeout must be a positive datetime.timedelta; got {timeout!r}.")
        self._parallel_devices: list[torch.device] = []
        self._num_nodes = 1
        self.timeout = timeout
        self._world: DataParallel | None = None  # the processes of a data-parallel run, from setup
        self._shared: SharedHost | None = None  # the memory a node's processes share, from setup
        super().__init__(**kwargs)

    @property
    @override
    def parallel_devices(self) -> list[torch.device]:
        return self._parallel_devices

    @parallel_devices.setter
    @override
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        # NOTE: the Trainer's connector fills this; a strategy built from a string would otherwise have no device.
        self._parallel_devices = [torch.device(d) for d in devices or []]

    @property
    @override
    def root_device(self) -> torch.device:
        if self._parallel_devices:
            return self._parallel_devices[self.local_rank]
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:  # set by the Trainer's connector
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        """Processes per node: one per device."""
        return max(1, len(self._parallel_devices))

    @property
    def is_distributed(self) -> bool:
        """More than one process (Lightning's connector reads it: the data then gets a distributed sampler)."""
        return self.num_nodes * self.num_processes > 1

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @override
    def _configure_launcher(self) -> None:
        if self.is_distributed:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.is_distributed and not _distributed_is_initialized():
            self.set_world_ranks()
            backend = "nccl" if self.root_device.type == "cuda" else "gloo"
            device_id = self.root_device if backend == "nccl" else None
            _init_dist_connection(self.cluster_environment, backend, timeout=self.timeout, device_id=device_id)
        if self.is_distributed:  # on the CPU, whatever the backend: the batch counts' check syncs no device
            self._batch_group = dist.new_group(backend="gloo", timeout=self.timeout)

    @property
    def loads_weights(self) -> bool:
        """Whether this process needs the model's weights: ``False`` on a node's processes but its first, which take
        the first one's at setup (what they load is dropped). Their ``configure_model`` may build the model on the
        meta device instead of loading it (``CausalLMModule`` does), so a node loads the model once."""
        return self.num_processes == 1 or self.local_rank == 0

    def join(self, module: nn.Module) -> None:
        """At setup, with several processes: their gradients' averaging, the memory a node's processes share, and
        every process starting from the first one's weights, as under DDP: a node's first processes receive them, the
        others hold none (freed on every process before any reads the RAM left) and take their node's first's."""
        if not self.is_distributed:
            return
        self._world = DataParallel(self.num_processes, self.root_device, timeout=self.timeout)
        if self.num_processes > 1:  # the node's processes hold the state once (on NVMe, each its rows)
            self._shared = SharedHost(self.local_rank, self.num_processes, timeout=self.timeout)
        built_on_meta = all(p.is_meta for p in module.parameters())
        if not self.loads_weights:
            drop_weights(module)
        broadcast_tensors(list(module.buffers()), self.root_device)
        if self.loads_weights and self.num_nodes > 1:
            broadcast_tensors(list(module.parameters()), self.root_device, self._world.across_nodes)
        if self._shared is not None:
            # one that built the model on the meta device drew no initial values: it takes the random state the first
            # one has after drawing them, as a DDP process would have (its dropout masks, as under DDP)
            state = torch.get_rng_state()
            self._shared.from_first([state])
            if built_on_meta:
                torch.set_rng_state(state)
            self._shared.main_barrier()

    def from_first(self, params: list[nn.Parameter]) -> None:
        """A node's processes but its first: the first one's values of ``params`` (those they do not map from shared
        memory)."""
        if self._shared is not None:
            self._shared.from_first(params)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self.is_distributed and trainer is not None and trainer.training:
            return EvenBatches(dataloader, self._batch_group, lambda: trainer.num_training_batches)
        return dataloader

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if _distributed_is_initialized():
            dist.barrier(device_ids=[self.root_device.index] if dist.get_backend() == "nccl" else None)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        return _sync(tensor, group, reduce_op=reduce_op) if isinstance(tensor, torch.Tensor) else tensor


def broadcast_tensors(tensors: list[torch.Tensor], device: torch.device, group: Any = None) -> None:
    """The values of ``group``'s first process (default group: the first process) into the other processes'
    ``tensors`` (through ``device``: NCCL sends device tensors only)."""
    with torch.no_grad():
        for tensor in tensors:
            sent = tensor.data.to(device)
            dist.broadcast(sent, group=group, group_src=0)
            if sent is not tensor.data:
                tensor.data.copy_(sent)


class EvenBatches:
    """A process's training batches, checked against the other processes' as each epoch starts: one that would run
    fewer batches than another stops every process with an error that says so (otherwise a collective of one
    process's epoch end would meet a gradient average of another's step). A loader of no length is checked as each
    batch is taken and as its data ends (one small all-reduce on the CPU each time).

    Everything else is the data loader's (``len``, ``sampler``, ``state_dict``).

    Args:
        loader: the process's training data loader.
        group: a gloo group of every process.
        count: the batches of an epoch of this process (Lightning's ``num_training_batches``; ``inf``: until its
            data ends).
    """

    def __init__(self, loader: Any, group: Any, count: Callable[[], float]) -> None:
        self.loader = loader
        self.group = group
        self.count = count

    def __iter__(self):
        count = float(self.count())
        self._agree(count, f"{count:g} batches per epoch")
        taken = 0
        for batch in self.loader:
            if count == math.inf:
                self._agree(1, f"a batch more after {taken}")
            taken += 1
            yield batch
        if count == math.inf:
            self._agree(0, f"no batch more after {taken}")

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def _agree(self, value: float, what: str) -> None:
        spread = torch.tensor([value, -value], dtype=torch.float64)
        dist.all_reduce(spread, op=dist.ReduceOp.MIN, group=self.group)
        if spread[0] == -spread[1]:
            return
        said = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(said, what, group=self.group)
        raise RuntimeError(
            "The processes have unequal numbers of training batches ("
            + ", ".join(f"process {rank}: {text}" for rank, text in enumerate(said))
            + "). Each step averages every process's gradients, so each process needs the same number of batches:"
            " let Lightning's DistributedSampler split the data (use_distributed_sampler=True), or give each"
            " process's loader the same length (drop_last=True; limit_train_batches)."
        )
