"""SlideFormerStrategy: Lightning's hooks, adapted onto the sliding-window engine."""

from __future__ import annotations

import datetime
import logging
import os
import shutil
from collections.abc import Generator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.init import _EmptyInit
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from .attention import use_slide_attention
from .checkpoint_io import SlideCheckpointIO
from .device_draws import DrawOnDevice
from .engine import EngineConfig, SlideEngine
from .engine.machine import available_host_bytes, device_budget, locked_memory_limit
from .engine.nvme import sweep_stale_state
from .engine.shared_host import SharedHost, drop_weights, is_placeholder, placeholder
from .engine.world import DataParallel
from .fused import use_fused_ops
from .loss import causal_lm_loss
from .models import Layout, disable_hf_cache, disable_hf_checkpointing, find_layout, install_causal_lm_loss
from .placement import (
    PLACEMENTS,
    SCHEDULES,
    EngineOptions,
    Machine,
    Plan,
    Run,
    Tier,
    check_batch_tokens,
    frozen_to_store,
    half_trained,
    make_plan,
    resolve_schedule,
    tokens_ahead,
)
from .precision import SlideFormerPrecision
from .processes import Processes, broadcast_tensors
from .rates import Rates

log = logging.getLogger(__name__)


class SlideFormerStrategy(Processes):
    """Train a model far larger than GPU memory on one GPU (or data parallel on several: ``Trainer(devices=N)``).

    The LightningModule's parameters stay fp32 masters in CPU memory; transformer blocks slide through a small
    window of GPU slots; gradients leave the GPU block by block; the optimizer steps on the CPU while the GPU
    keeps computing. Training gives the same parameters as plain Lightning training of the same module with the
    same torch optimizer — including gradient accumulation, global-norm clipping and tied embeddings.

    Args:
        num_slots: block slots in the GPU window (>= 2). More slots copy further ahead, at the cost of memory.
            ``"auto"``: 3, or 2 when a window of 3 would take more than a quarter of the GPU memory left.
        blocks: attribute path (from the LightningModule) of the ``nn.ModuleList`` of blocks, e.g.
            ``"model.model.layers"``; ``None`` finds it.
        update_schedule: ``"backward"`` updates each block while the backward pass continues (not compatible
            with clipping by norm); ``"forward"`` updates after backward, in forward order, overlapping the
            next forward pass (needed for exact global-norm clipping; the step's gradients wait in host
            memory); ``"norm-first"`` clips by norm without keeping them: a first backward pass only finds the
            global norm, a second one streams the clipped updates as ``"backward"`` does (one more backward pass
            of GPU work; Trainer(gradient_clip_val=...) by norm, no accumulation). ``"auto"`` picks ``"forward"``
            when gradient clipping is configured (keeping the bf16 gradients in bf16 when fp32 ones would not fit
            in RAM), ``"norm-first"`` instead when even those would not fit, and ``"backward"`` otherwise.
        install_loss: on Hugging Face causal LMs (Llama, Mistral, Qwen2, Qwen3), compute ``labels=`` losses from
            the hidden states without building the full logits.
        on_nonfinite: ``"raise"`` stops training at a NaN/Inf gradient; ``"skip"`` (clipping by norm only)
            skips that optimizer step.
        cpu_threads: threads of the CPU optimizer; ``None``: all cores but one on CUDA (the other feeds the GPU),
            shared by a node's processes, torch's default on the CPU.
        frozen_in_compute_dtype: under bf16-mixed, keep the frozen weight matrices of the blocks and the head (a
            LoRA base) in bf16 on the host: half the memory, and exactly the values bf16 compute reads. The
            module's frozen weights stay bf16 after training; ``False`` keeps them fp32.
        half_weights: trained parameters loaded in bf16 or fp16 (``torch_dtype=torch.bfloat16``):
            ``"fp32_masters"`` steps fp32 master weights made from them (4 bytes per parameter more on the host; they
            stay fp32 after training); ``"keep"`` steps them in their own dtype, as plain Lightning does (with RAM
            for the optimizer state only, not with ``optimizer_offload="nvme"``).
        offload_activations: keep the inputs each block saves for its recompute in pooled host memory instead of
            on the GPU, fetched back one block ahead of the backward pass (long contexts). ``True``: every block's;
            ``"auto"``: on CUDA, those of as few of the first blocks as let the rest and one block at work fit the
            GPU; never on the CPU. When one block at work alone would not fit, its MLP also runs on slices of the
            tokens (``engine/tiling.py``). Decided at the first training step, logged.
        optimizer_offload: where Adam's moments live between updates: ``"cpu"`` (RAM) or ``"nvme"`` (files under
            ``nvme_path``, read block by block of rows before each update and written after it; 8 bytes per trainable
            parameter less RAM; a node's processes each keep their rows' in files of their own); ``"auto"``: in RAM,
            unless they would not fit there and ``nvme_path`` is given (decided from the host plan before anything is
            pinned, logged).
        nvme_path: an existing, writable directory on a fast disk for the NVMe tier; ``None``: the
            ``SLIDE_NVME_PATH`` environment variable.
        nvme_masters: with ``optimizer_offload="nvme"`` under bf16-mixed, keep the fp32 masters of the blocks'
            weight matrices on disk too, beside their Adam state; RAM then holds their bf16 copies (2 bytes per
            parameter instead of 4), refreshed by each update. Checkpoints hold the fp32 masters; when training
            ends they come back into the parameters if RAM allows (else a warning says the parameters keep the bf16
            copies). A model loaded in bf16 gets exact fp32 masters of its values.
        attention: on Hugging Face models, ``"auto"`` switches to the project's flash attention
            (``attn_implementation="slide"``) when training in bf16 on CUDA and the kernel covers the model,
            ``"slide"`` requires it, ``"slide_kernel"`` requires it and sends dense batches to the kernel too
            (``"slide"`` gives those to PyTorch's cuDNN attention where it runs them), ``None`` keeps the model's own.
            Restored when training ends.
        fused_ops: run Hugging Face's Llama-style RMSNorm modules and rotary embedding on the project's fused
            kernels (one pass each way, the same formula; a model whose code differs keeps it): ``"auto"`` on CUDA,
            ``True`` everywhere (off CUDA the kernels need ``TRITON_INTERPRET=1``, else the same formulas run in
            torch), ``False`` keeps the model's own code. Restored when training ends.
        placement: ``"auto"`` trains the whole model on the GPU as plain Lightning does (nothing streams, torch's
            optimizer steps there) when parameters, gradients, optimizer state and activations fit the GPU memory the
            process may use; otherwise it streams the blocks and keeps on the GPU what fits the memory the window and
            activations leave: the modules outside the blocks (the embedding, the final norm, the head), then the
            first blocks (recomputed in backward), stepped there by the optimizer. ``"stream"`` streams everything.
            Decided at setup, logged as one table.
        device_memory_gib: the device memory the plan may use (within what the GPU has free); on the CPU, a budget
            that lets ``placement="auto"`` place the model there (tests). ``None``: the GPU's free memory.
        tokens_per_batch: tokens per micro-batch for the plan; ``None``: the datamodule's ``tokens_per_batch``, else
            those of the first batch, fetched ahead (the run still draws the same batches).
        engine: the engine's mechanism knobs (:class:`~lightning_slide.engine.EngineConfig`): transfer chunks,
            landing buffers, the embedding's update variants, bf16 retained gradients.
        timeout: several processes: how long a collective waits for one that stopped answering (hung, or stuck
            in a slow data loader) before every process stops with an error; torch's default, 30 minutes, as
            ``DDPStrategy(timeout=...)``. A process that dies stops the others at once.
    """

    strategy_name = "slideformer"

    def __init__(
        self,
        *,
        num_slots: int | Literal["auto"] = "auto",
        blocks: str | None = None,
        update_schedule: Literal["auto", "backward", "forward", "norm-first"] = "auto",
        install_loss: bool = True,
        frozen_in_compute_dtype: bool = True,
        half_weights: Literal["fp32_masters", "keep"] = "fp32_masters",
        offload_activations: bool | Literal["auto"] = "auto",
        optimizer_offload: Literal["auto", "cpu", "nvme"] = "auto",
        nvme_path: str | None = None,
        nvme_masters: bool = False,
        on_nonfinite: Literal["raise", "skip"] = "raise",
        cpu_threads: int | None = None,
        attention: Literal["auto", "slide", "slide_kernel"] | None = "auto",
        fused_ops: bool | Literal["auto"] = "auto",
        placement: Literal["auto", "stream"] = "auto",
        device_memory_gib: float | None = None,
        tokens_per_batch: int | None = None,
        engine: EngineConfig | None = None,
        timeout: datetime.timedelta = default_pg_timeout,
        accelerator: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        if num_slots != "auto" and (not isinstance(num_slots, int) or num_slots < 2):
            raise ValueError(f"num_slots must be an int >= 2 or 'auto'; got {num_slots!r}.")
        if update_schedule not in SCHEDULES:
            raise ValueError(f"update_schedule must be one of {SCHEDULES}; got {update_schedule!r}.")
        if on_nonfinite not in ("raise", "skip"):
            raise ValueError(f"on_nonfinite must be 'raise' or 'skip'; got {on_nonfinite!r}.")
        if cpu_threads is not None and (not isinstance(cpu_threads, int) or cpu_threads < 1):
            raise ValueError(f"cpu_threads must be a positive int or None; got {cpu_threads!r}.")
        if attention not in ("auto", "slide", "slide_kernel", None):
            raise ValueError(f"attention must be 'auto', 'slide', 'slide_kernel' or None; got {attention!r}.")
        if fused_ops not in (True, False, "auto"):
            raise ValueError(f"fused_ops must be True, False or 'auto'; got {fused_ops!r}.")
        if engine is not None and not isinstance(engine, EngineConfig):
            raise TypeError(f"engine must be a lightning_slide.engine.EngineConfig; got {type(engine).__name__}.")
        if offload_activations not in (True, False, "auto"):
            raise ValueError(f"offload_activations must be True, False or 'auto'; got {offload_activations!r}.")
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}; got {placement!r}.")
        if device_memory_gib is not None and (isinstance(device_memory_gib, bool) or not device_memory_gib > 0):
            raise ValueError(f"device_memory_gib must be a number > 0 or None; got {device_memory_gib!r}.")
        if tokens_per_batch is not None and (not isinstance(tokens_per_batch, int) or tokens_per_batch < 1):
            raise ValueError(f"tokens_per_batch must be a positive int or None; got {tokens_per_batch!r}.")
        if half_weights not in ("fp32_masters", "keep"):
            raise ValueError(f"half_weights must be 'fp32_masters' or 'keep'; got {half_weights!r}.")
        if optimizer_offload not in ("auto", "cpu", "nvme"):
            raise ValueError(f"optimizer_offload must be 'auto', 'cpu' or 'nvme'; got {optimizer_offload!r}.")
        if nvme_masters and optimizer_offload != "nvme":
            raise ValueError(
                "nvme_masters=True keeps the masters beside Adam's state on disk: set optimizer_offload='nvme' (and"
                f" nvme_path); got optimizer_offload={optimizer_offload!r}."
            )
        nvme_path = nvme_path or os.environ.get("SLIDE_NVME_PATH")
        if optimizer_offload == "nvme" or (optimizer_offload == "auto" and nvme_path):
            nvme_path = _check_nvme_path(nvme_path)
        super().__init__(
            timeout=timeout,
            accelerator=accelerator,
            checkpoint_io=checkpoint_io or SlideCheckpointIO(),  # streamed and atomic
            precision_plugin=precision_plugin,
        )
        self.num_slots = num_slots
        self.blocks = blocks
        self.update_schedule = update_schedule
        self.install_loss = install_loss
        self.frozen_in_compute_dtype = frozen_in_compute_dtype
        self.half_weights = half_weights
        self.offload_activations = offload_activations
        self.optimizer_offload = optimizer_offload
        self.nvme_path = nvme_path if optimizer_offload != "cpu" else None
        self.nvme_masters = nvme_masters
        self._loaded_masters: dict[nn.Parameter, torch.Tensor] = {}  # fp32 masters from a checkpoint, until setup
        self._unsaved: str | None = None  # after a fault: why the state may not be saved ("": it may)
        self.on_nonfinite = on_nonfinite
        self.cpu_threads = cpu_threads
        self.attention = attention
        self.fused_ops = fused_ops
        self.placement = placement
        self.device_memory_gib = device_memory_gib
        self.tokens_per_batch = tokens_per_batch
        self.plan: Plan | None = None  # made at setup
        self.tier: Tier | None = None  # the plan's choice of tier
        self.engine_config = engine or EngineConfig()
        self.engine: SlideEngine | None = None
        self._restores: list = []  # undo what setup changed on the user's model, at teardown
        self._world: DataParallel | None = None  # the processes of a data-parallel run, from setup
        self._shared: SharedHost | None = None  # the memory a node's processes share, from setup
        self._stepping = False  # within the optimizer step (the last accumulated micro-batch's backward)

    # ---- device and precision ----------------------------------------------------------------------------------

    @property
    @override
    def precision_plugin(self) -> SlideFormerPrecision:
        if self._precision_plugin is None:  # not stored: the connector reads `_precision_plugin` as a user choice
            return SlideFormerPrecision("32-true", self.root_device.type)
        return self._precision_plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        # NOTE: the connector replaces a string-built strategy's plugin with a generic one (FSDPStrategy guards
        # the same way); we turn what it made from the Trainer's `precision` flag into ours.
        if plugin is None:
            self._precision_plugin = None
            return
        device = "cuda" if isinstance(self.accelerator, CUDAAccelerator) else self.root_device.type
        self._precision_plugin = SlideFormerPrecision.convert(plugin, device)

    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        # NOTE: False: Lightning runs only the closure on accumulating micro-batches and calls optimizer_step on
        # the last one; the engine keeps the gradients of the window on the host and updates once.
        return False

    # ---- set-up ------------------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None
        self._unsaved = None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self.is_distributed:
            self._world = DataParallel(self.num_processes, self.root_device, timeout=self.timeout)
            if self.num_processes > 1:  # the node's processes hold the state once (on NVMe, each its rows)
                self._shared = SharedHost(self.local_rank, self.num_processes, timeout=self.timeout)
            self._start_alike(module)
        optimizer = None
        if fitting:
            if not module.automatic_optimization:
                raise ValueError(
                    "SlideFormer supports automatic optimization only: the optimizer step runs on the CPU inside the"
                    " engine. Remove `self.automatic_optimization = False` and return the optimizer from"
                    " configure_optimizers."
                )
            # NOTE: Lightning itself refuses several optimizers under automatic optimization.
            self.optimizers, self.lr_scheduler_configs = _init_optimizers_and_lr_schedulers(module)
            optimizer = self.optimizers[0]
        layout = find_layout(module, self.blocks)
        self._restores.append(disable_hf_checkpointing(module))
        if fitting and layout.pretrained is not None:
            self._restores.append(disable_hf_cache(layout.pretrained))
        cuda = self.root_device.type == "cuda"
        dtype = self.precision_plugin.compute_dtype
        low_precision = dtype != torch.float32  # the kernel's Triton path is bf16/fp16
        if layout.pretrained is not None and (
            self.attention in ("slide", "slide_kernel") or (self.attention == "auto" and cuda and low_precision)
        ):
            required = self.attention != "auto"
            name = self.attention if required else "slide"
            restore = use_slide_attention(layout.pretrained, required=required, name=name)
            if restore is not None:
                self._restores.append(restore)
        if self.fused_ops is True or (self.fused_ops == "auto" and cuda):
            restore = use_fused_ops(module)
            if restore is not None:
                self._restores.append(restore)
        budget = device_budget(self.root_device)
        if self.device_memory_gib is not None:
            budget = min(budget or 1 << 62, int(self.device_memory_gib * 2**30))
        tokens = tokens_ahead(trainer, self.tokens_per_batch) if budget else None
        # NOTE: the GPU's memory, and the plan with it, depend less on how the allocator splits its segments.
        if cuda and "expandable_segments" not in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
            settings = getattr(torch._C, "_accelerator_setAllocatorSettings", torch.cuda.memory._set_allocator_settings)
            settings("expandable_segments:True")
        # NOTE: the plugin was made before the accelerator was known (a CPU run on a CUDA machine said "cuda").
        self.precision_plugin.device = self.root_device.type
        disk_free, disk_held = None, 0
        if self.nvme_path:  # what killed runs left there goes first
            _, disk_held = sweep_stale_state(self.nvme_path)
            disk_free = shutil.disk_usage(self.nvme_path).free
        # a node's processes plan at once, each on its share of the node's RAM and disk
        share = self.num_processes
        disk_free = disk_free // share if disk_free is not None else None
        machine = Machine(budget, available_host_bytes() // share, locked_memory_limit() if cuda else None, disk_free,
                          disk_held)  # fmt: skip
        self.plan = self.plan_run(trainer, module, layout, optimizer, self.root_device, tokens, machine)
        frozen, half, widen, _ = self._storage(layout, optimizer)
        self.tier = self.plan.tier
        log.info("SlideFormer's placement plan:\n%s", self.plan.table())
        if self.tier.resident:
            self._convert(frozen, widen, half, dtype)
            self._from_first(list(module.parameters()))
            self._setup_resident(module, layout, dtype, fitting)
            return
        self.engine = self.plan.engine
        if self.engine.nvme_path is not None and not isinstance(self.checkpoint_io, SlideCheckpointIO):
            raise ValueError(
                f"optimizer_offload='nvme' saves checkpoints as directories holding the state files, through"
                f" SlideCheckpointIO; got checkpoint_io={type(self.checkpoint_io).__name__}. Leave checkpoint_io unset"
                " (or subclass SlideCheckpointIO)."
            )
        if half and not widen and self.engine.nvme_path is not None:
            raise ValueError(
                f"half_weights='keep' steps {len(half)} parameters in {half[0].dtype}, but the NVMe tier keeps fp32"
                " optimizer state. Use half_weights='fp32_masters' (the default) or optimizer_offload='cpu'."
            )
        self.precision_plugin.engine = self.engine
        log.info("SlideFormer streams the model (%s); %s", self.tier.reason, self.plan.host.describe())
        if self.plan.error is not None:
            raise self.plan.error
        disk = set(self.engine.disk_masters)  # their exact fp32 masters go straight to disk at setup
        self._convert(frozen, [p for p in widen if p not in disk], half, dtype)  # after every check, before pinning
        mapped = self.engine.mapped_params()
        self._from_first([p for p in module.parameters() if p not in mapped])
        if cuda and dtype == torch.float32:
            log.info(
                "SlideFormer computes in fp32 (precision='32-true', Lightning's default): Trainer(precision="
                "'bf16-mixed') sends half the bytes per weight and computes as Lightning's bf16-mixed does."
            )
        self.engine.setup(self._loaded_masters)
        self._loaded_masters = {}
        if fitting:  # the optimizer's step() ends the engine's step
            self._restores.append(self.engine.step.attach())
        self._install_loss(layout, dtype)
        self.model = module
        if fitting:
            self.setup_precision_plugin()

    @property
    def loads_weights(self) -> bool:
        """Whether this process needs the model's weights: ``False`` on a node's processes but its first, which take
        the first one's at setup (what they load is dropped). Their ``configure_model`` may build the model on the
        meta device instead of loading it (``CausalLMModule`` does), so a node loads the model once."""
        return self.num_processes == 1 or self.local_rank == 0

    def _start_alike(self, module: Any) -> None:
        # every process starts from the first one's weights, as under DDP: a node's first processes receive them, the
        # others hold none (freed on every process before any reads the RAM left) and take their node's first's
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

    def _from_first(self, params: list[nn.Parameter]) -> None:
        # a node's processes but its first: the first one's values of the parameters they do not map from shared memory
        if self._shared is not None:
            self._shared.from_first(params)

    def _install_loss(self, layout: Layout, dtype: torch.dtype) -> None:
        # the logits-free loss: on the head's buffer when it streams, on its own weights when it is on the device
        if not (self.install_loss and layout.causal_lm is not None):
            return
        engine, head = self.engine, layout.causal_lm.get_output_embeddings()
        streamed = engine is not None and engine.head is not None

        def loss(hidden: torch.Tensor, labels: torch.Tensor, **kw: Any) -> torch.Tensor:
            if streamed:
                return engine.head_loss(hidden, labels, causal_lm_loss, **kw)
            return causal_lm_loss(hidden, head.weight.to(dtype), labels, head.bias, **kw)

        self._restores.append(install_causal_lm_loss(layout.causal_lm, loss))

    def plan_run(
        self,
        trainer: Any,
        module: Any,
        layout: Layout,
        optimizer: Optimizer | None,
        device: torch.device,
        tokens: int | None,
        machine: Machine,
        rates: Rates = Rates(),
        shared: SharedHost | None = None,
    ) -> Plan:
        """The placement plan of training ``module`` (its parts in ``layout``) under ``trainer`` on ``device`` with
        ``tokens`` per micro-batch, within ``machine``'s figures (one process's, ``shared`` the node's processes
        holding the state once: this run's when ``None``); nothing is allocated (``slide plan`` calls it on a model
        on the meta device)."""
        schedule = resolve_schedule(self.update_schedule, self.on_nonfinite, trainer, module)
        options = EngineOptions(
            num_slots=None if self.num_slots == "auto" else self.num_slots, update_schedule=self.update_schedule,
            placement="stream" if self.optimizer_offload == "nvme" else self.placement,
            on_nonfinite=self.on_nonfinite,
            cpu_threads=self.cpu_threads or (self._default_threads() if device.type == "cuda" else None),
            offload_activations=self.offload_activations, optimizer_offload=self.optimizer_offload,
            nvme_path=self.nvme_path, nvme_masters=self.nvme_masters, config=self.engine_config,
            world=self._world, shared=shared or self._shared,
        )  # fmt: skip
        stored = self._storage(layout, optimizer)[3]
        loss = self.install_loss and layout.causal_lm is not None
        dtype = self.precision_plugin.compute_dtype
        run = Run(module, layout, device, dtype, optimizer, schedule, trainer, options, stored)
        return make_plan(run, tokens, machine, not loss, rates)

    def _default_threads(self) -> int:
        # all cores but one (it feeds the GPU), shared by the processes of the node
        return max(1, torch.get_num_threads() // self.num_processes - 1)

    def _storage(self, layout: Layout, optimizer: Optimizer | None) -> tuple[list, list, list, dict]:
        # what changes dtype before training: frozen matrices to the compute dtype, trained half weights (all of
        # them, and those widened to fp32 masters), and the element sizes the plan counts for them
        dtype = self.precision_plugin.compute_dtype
        frozen = frozen_to_store(layout) if self.frozen_in_compute_dtype and dtype != torch.float32 else []
        half = half_trained(optimizer) if optimizer is not None else []
        widen = half if self.half_weights == "fp32_masters" else []
        return frozen, half, widen, {**dict.fromkeys(frozen, dtype.itemsize), **dict.fromkeys(widen, 4)}

    def _convert(self, frozen: list[nn.Parameter], widen: list[nn.Parameter], half: list[nn.Parameter],
                 dtype: torch.dtype) -> None:  # fmt: skip
        # the storage the plan counted: frozen matrices in the compute dtype, fp32 masters of half trained weights
        for p in frozen:
            p.data = _converted(p.data, dtype)
        if half and not widen:
            log.info("SlideFormer steps the %d parameters loaded in %s in that dtype, as plain Lightning does"
                     " (half_weights='keep').", len(half), half[0].dtype)  # fmt: skip
        if widen:
            log.info(
                "SlideFormer trains the %d parameters loaded in %s with fp32 master weights made from them (%.2f GiB"
                " more RAM; they stay fp32 after training): the optimizer steps in fp32, and the GPU computes with"
                " bf16 copies under bf16-mixed; half_weights='keep' steps the bf16 values as plain Lightning does.",
                len(widen), widen[0].dtype, sum(p.numel() for p in widen) * 2 / 2**30,
            )  # fmt: skip
            for p in widen:
                p.data = _converted(p.data, torch.float32)

    def _setup_resident(self, module: Any, layout: Any, dtype: torch.dtype, fitting: bool) -> None:
        # the resident tier: plain training on the device, with the logits-free loss on the head's own weights
        tier = self.tier
        log.info(
            "SlideFormer trains the whole model on %s, as plain Lightning does (nothing streams): it needs %s at"
            " %d tokens per batch; batches of up to %s tokens fit.", self.root_device, tier.reason, tier.tokens,
            tier.max_tokens,
        )  # fmt: skip
        module.to(self.root_device)
        self.precision_plugin.engine = None
        self._install_loss(layout, dtype)
        self.model = module
        if fitting:
            self.setup_precision_plugin()

    @override
    def model_to_device(self) -> None:
        """Nothing to move: parameters stay on the CPU, the engine places everything else."""

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # New parameters are fp32 masters on the CPU, not tensors on the root device; their random init is drawn
        # there, as plain Lightning draws it.
        draws = self.root_device.type == "cuda" and not empty_init
        with (
            _EmptyInit(enabled=bool(empty_init)),
            torch.device("cpu"),
            DrawOnDevice(self.root_device) if draws else nullcontext(),
        ):
            yield
        if draws:
            torch.cuda.empty_cache()  # the draws' blocks, before the plan reads what the GPU has free

    @override
    def teardown(self) -> None:
        while self._restores:
            self._restores.pop()()
        if self.engine is not None:
            engine, self.engine = self.engine, None
            try:
                engine.teardown()
            except Exception as err:  # already reported where it happened
                log.debug("SlideFormer engine teardown: %s", err)
        super().teardown()

    # ---- training ----------------------------------------------------------------------------------------------

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if args and self.tier is not None and self.tier.max_tokens is not None:
            check_batch_tokens(args[0], self.tier.max_tokens)
        with _explain_oom(self):
            return super().training_step(*args, **kwargs)

    @override
    def backward(
        self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        with _explain_oom(self):
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        # the whole-model tier across processes: the gradients summed over the accumulated micro-batches are averaged
        # once, after the last one's backward (the one inside the optimizer step), as DDP's no_sync does; the engine
        # averages the streamed units' as they leave backward
        if self.engine is None and self._world is not None and self._stepping:
            grads = [p.grad for p in self.lightning_module.parameters() if p.grad is not None]
            self._world.average_in_place(grads, "the model")

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        self._stepping = True  # Lightning runs the last micro-batch's closure inside the step, the others before it
        try:
            with _explain_oom(self):  # the "forward" schedule sends the embedding's touched rows up at the step's end
                return super().optimizer_step(optimizer, closure, model, **kwargs)
        finally:
            self._stepping = False

    @override
    def on_validation_start(self) -> None:
        self._wait()

    @override
    def on_train_end(self) -> None:
        self._wait()

    def _wait(self) -> None:
        if self.engine is None:
            return
        if self._interrupted():  # after a fault: what can still complete, quietly, and whether a step is half done
            self._unsaved_reason()
        else:
            self.engine.wait()

    def _interrupted(self) -> bool:
        # Lightning sets this before any on_exception hook runs (its on-exception checkpoint's among them)
        module = self.lightning_module
        return module is not None and module._trainer is not None and module.trainer.interrupted

    def _unsaved_reason(self) -> str | None:
        # after a fault: why the state may not be saved (a step applied in part), once found
        if self._unsaved is None and self.engine is not None and self._interrupted():
            plan = self.engine.partial_step()
            applied = ", ".join(plan.applied) if plan is not None else ""
            self._unsaved = (
                f"optimizer step {plan.step} was applied in part ({applied}) when it stopped" if plan else ""
            )
        return self._unsaved or None

    # ---- checkpoints -------------------------------------------------------------------------------------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._wait()
        state = super().lightning_module_state_dict()
        return self.engine.state_io.with_offloaded_masters(state) if self.engine is not None else state

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self.loads_weights:  # the node's other processes take its first one's values at setup
            super().load_model_state_dict(checkpoint, strict=strict)
        # a parameter holding fewer bits than its checkpointed fp32 master (a model loaded in bf16): the engine
        # puts the exact master on disk at setup (nvme_masters)
        params = dict(self.lightning_module.named_parameters())
        self._loaded_masters = {
            params[name]: value for name, value in checkpoint["state_dict"].items()
            if name in params and isinstance(value, torch.Tensor) and value.dtype == torch.float32
            and params[name].dtype != torch.float32
        }  # fmt: skip

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, torch.Tensor]:
        self._wait()
        state = super().optimizer_state(optimizer)
        return self.engine.state_io.with_offloaded_state(state) if self.engine is not None else state

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if (reason := self._unsaved_reason()) is not None:
            callback = self.lightning_module.trainer.checkpoint_callback
            last = getattr(callback, "last_model_path", "") or getattr(callback, "best_model_path", "") or "none"
            log.error("SlideFormer saved no checkpoint at %s: %s. The last checkpoint saved: %s.", filepath, reason,
                      last)  # fmt: skip
            return
        # with the optimizer state on NVMe, the checkpoint references the state files; they are copied beside it
        pieces = self.engine.state_io.state_pieces() if self.engine is not None else []
        if pieces:
            storage_options = {**(storage_options or {}), "state_pieces": pieces}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        # Like the base class, minus its move of the state to the root device: the state lives on the CPU.
        with self.engine.state_io.masters_as_fp32() if self.engine is not None else nullcontext():
            for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
                optimizer.load_state_dict(state)
        if self.engine is not None:
            self.engine.state_io.adopt_loaded_state()
            if self.engine.shared is not None:  # every process's rows are in before any of them saves them
                self.engine.shared.main_barrier()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name,
                cls,
                description="SlideFormer: blocks slide through the GPU, the optimizer steps on the CPU",
            )
        if "slideformer_nvme" not in strategy_registry:
            strategy_registry.register(
                "slideformer_nvme",
                cls,
                description="SlideFormer with Adam's state on NVMe (directory: $SLIDE_NVME_PATH)",
                optimizer_offload="nvme",
            )


def _converted(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # a placeholder (a node's process holding no weights) stays one, in the new dtype
    return placeholder(tensor.shape, dtype) if is_placeholder(tensor) else tensor.to(dtype)


def _check_nvme_path(path: str | None) -> str:
    if path is None:
        raise ValueError(
            "optimizer_offload='nvme' needs a directory on a fast disk: SlideFormerStrategy(nvme_path=...) or the"
            " SLIDE_NVME_PATH environment variable."
        )
    path = os.path.expanduser(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"nvme_path {path!r} does not exist; create the directory first.")
    if not os.path.isdir(path):
        raise NotADirectoryError(f"nvme_path {path!r} is not a directory.")
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(f"nvme_path {path!r} is not writable by this user.")
    return path


_OOM_EXPLAINED = "SlideFormer ran out of GPU memory"


@contextmanager
def _explain_oom(strategy: SlideFormerStrategy) -> Generator[None, None, None]:
    try:
        yield
    except torch.OutOfMemoryError as err:
        if _OOM_EXPLAINED in str(err):  # by an inner call (the training step runs inside the optimizer step)
            raise
        engine = strategy.engine
        if engine is None and strategy.tier is not None and strategy.tier.resident:
            raise torch.OutOfMemoryError(
                f"{err}\n{_OOM_EXPLAINED}. The plan put the whole model on the GPU ({strategy.tier.reason}), and this"
                " step needed more. SlideFormerStrategy(placement='stream') streams it, or lower the tokens per step"
                " (batch size or sequence length, and use accumulate_grad_batches instead)."
            ) from err
        window = engine.device_bytes() / 2**30 if engine else float("nan")
        offload = "" if engine and engine.offloading else " SlideFormerStrategy(offload_activations=True),"
        slots = engine.num_slots if engine else strategy.num_slots
        raise torch.OutOfMemoryError(
            f"{err}\n{_OOM_EXPLAINED}. Its window of {slots} block slots, the head and"
            f" staging take {window:.2f} GiB; the rest is activations. Lower the tokens per step (batch size or"
            f" sequence length, and use accumulate_grad_batches instead),{offload} or SlideFormerStrategy(num_slots=2)."
            " If much memory is 'reserved but unallocated' above, set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
            " before starting Python."
        ) from err
