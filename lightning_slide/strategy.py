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

from .checkpoint_io import SlideCheckpointIO
from .device_draws import DrawOnDevice
from .engine import EngineConfig, SlideEngine
from .engine.delay import without_copies
from .engine.machine import available_host_bytes, device_budget, locked_memory_limit
from .engine.shared_host import SharedHost
from .engine.state_dirs import sweep_stale_state
from .model_switches import install_loss, switch_model
from .models import Layout, find_layout
from .oom import explain_oom
from .options import EngineOptions, Run, check_options, check_streamed
from .placement import Machine, Plan, make_plan
from .precision import SlideFormerPrecision, Storage
from .processes import Processes
from .rates import Rates
from .schedule import resolve_schedule
from .tier import Tier
from .tokens import check_batch_tokens, tokens_ahead

log = logging.getLogger(__name__)


class SlideFormerStrategy(Processes):
    """Train a model far larger than GPU memory on one GPU (or data parallel on several: ``Trainer(devices=N)``).

    The LightningModule's parameters stay fp32 masters in CPU memory; transformer blocks slide through a small
    window of GPU slots; gradients leave the GPU block by block; the optimizer steps on the CPU while the GPU
    keeps computing. Training gives the same parameters as plain Lightning training of the same module with the
    same torch optimizer — including gradient accumulation, global-norm clipping and tied embeddings.

    Args (each in full, with its trade-off: ``docs/options.md``):
        num_slots: block slots in the GPU window (>= 2); ``"auto"``: 3, or 2 where 3 would crowd the GPU.
        blocks: attribute path of the ``nn.ModuleList`` of blocks, e.g. ``"model.model.layers"``; ``None`` finds it.
        update_schedule: ``"backward"`` updates each block while the backward goes on (no clipping by norm);
            ``"forward"`` after the backward, in forward order, during the next forward (exact clipping; the step's
            gradients wait in RAM); ``"norm-first"`` clips by norm with a second backward instead of that RAM;
            ``"auto"``: ``"forward"`` when clipping (``"norm-first"`` where RAM is short), else ``"backward"``.
        install_loss: on Hugging Face causal LMs, ``labels=`` losses from the hidden states, without full logits.
        on_nonfinite: ``"raise"`` stops at a NaN/Inf gradient; ``"skip"`` (clipping by norm) skips that step.
        cpu_threads: threads of the CPU optimizer; ``None``: all cores but one on CUDA, torch's default on the CPU.
        frozen_in_compute_dtype: under bf16-mixed, the frozen matrices (a LoRA base) stored in bf16 on the host.
        half_weights: trained parameters loaded in bf16/fp16: ``"fp32_masters"`` steps fp32 masters made from them;
            ``"keep"`` steps them in their own dtype, as plain Lightning does.
        offload_activations: block inputs in pinned RAM between forward and backward: ``True`` every block's,
            ``"auto"`` on CUDA as few as let the rest fit (MLPs tiled where one block at work would not).
        optimizer_offload: Adam's moments in RAM (``"cpu"``) or in files under ``nvme_path`` (``"nvme"``);
            ``"auto"``: RAM unless it is short and ``nvme_path`` is given.
        optimizer_state: Adam's moments in ``"fp32"`` or ``"bf16"`` (half the bytes, a faster CPU step;
            stochastically rounded: ``engine/adam_bf16.py``), the units kept on the GPU's too.
        delayed_update: the first blocks' updates one step late, as DeepSpeed's delayed parameter update: the CPU
            updates them while the GPU runs the next step with their weights of before (``engine/delay.py``; the
            plan picks how many). Not exact: opt-in.
        delay_warmup: with ``delayed_update``, the exact optimizer steps before the delay starts.
        nvme_path: an existing, writable directory on a fast disk; ``None``: ``$SLIDE_NVME_PATH``.
        nvme_masters: with ``"nvme"`` under bf16-mixed, the blocks' fp32 masters on disk too (bf16 copies in RAM).
        attention: Hugging Face models: ``"auto"``: the project's attention in bf16 on CUDA where it covers the
            model; ``"slide"`` requires it; ``"slide_kernel"`` also for dense batches; ``None`` keeps the model's.
        fused_ops: Llama-style RMSNorm, rotary and SwiGLU on the fused kernels: ``"auto"`` on CUDA, ``True``, ``False``.
        placement: ``"auto"``: the whole model on the GPU where it fits, else streamed with what fits kept there;
            ``"stream"`` streams everything.
        device_memory_gib: the device memory the plan may use; ``None``: the GPU's free memory.
        tokens_per_batch: tokens per micro-batch for the plan; ``None``: the data module's, else the first batch's.
        engine: the mechanism's knobs (:class:`~lightning_slide.engine.EngineConfig`).
        timeout: several processes: how long a collective waits for one that stopped answering (30 minutes).
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
        optimizer_state: Literal["fp32", "bf16"] = "fp32",
        delayed_update: bool = False,
        delay_warmup: int = 20,
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
        nvme_path = check_options(
            num_slots=num_slots, update_schedule=update_schedule, on_nonfinite=on_nonfinite, cpu_threads=cpu_threads,
            attention=attention, fused_ops=fused_ops, engine=engine, offload_activations=offload_activations,
            placement=placement, device_memory_gib=device_memory_gib, tokens_per_batch=tokens_per_batch,
            half_weights=half_weights, optimizer_offload=optimizer_offload, optimizer_state=optimizer_state,
            nvme_masters=nvme_masters, nvme_path=nvme_path, delayed_update=delayed_update, delay_warmup=delay_warmup,
        )  # fmt: skip
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
        self.moments = optimizer_state  # not `optimizer_state`: Lightning's hook of that name
        self.delayed_update, self.delay_warmup = delayed_update, delay_warmup
        self.nvme_path = nvme_path
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
        self.join(module)
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
        cuda = self.root_device.type == "cuda"
        dtype = self.precision_plugin.compute_dtype
        self._restores += switch_model(module, layout, attention=self.attention, fused_ops=self.fused_ops, cuda=cuda,
                                       dtype=dtype, fitting=fitting)  # fmt: skip
        # NOTE: the GPU's memory, and the plan with it, depend less on how the allocator splits its segments.
        if cuda and "expandable_segments" not in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
            settings = getattr(torch._C, "_accelerator_setAllocatorSettings", torch.cuda.memory._set_allocator_settings)
            settings("expandable_segments:True")
        # NOTE: the plugin was made before the accelerator was known (a CPU run on a CUDA machine said "cuda").
        self.precision_plugin.device = self.root_device.type
        machine = self._machine()
        tokens = tokens_ahead(trainer, self.tokens_per_batch) if machine.device else None
        self.plan = self.plan_run(trainer, module, layout, optimizer, self.root_device, tokens, machine)
        storage = self._storage(layout, optimizer)
        self.tier = self.plan.tier
        log.info("SlideFormer's placement plan:\n%s", self.plan.table())
        if self.tier.resident:
            storage.convert()
            self.from_first(list(module.parameters()))
            self._setup_resident(module, layout, dtype, fitting)
            return
        self.engine = self.plan.engine
        check_streamed(self.engine, storage, self.checkpoint_io)
        self.precision_plugin.engine = self.engine
        log.info("SlideFormer streams the model (%s); %s", self.tier.reason, self.plan.host.describe())
        if self.plan.error is not None:
            raise self.plan.error
        storage.convert(skip=set(self.engine.disk_masters))  # after every check, before pinning (their exact fp32
        # masters go straight to disk at setup)
        mapped = self.engine.mapped_params()
        self.from_first([p for p in module.parameters() if p not in mapped])
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

    def _machine(self) -> Machine:
        # this process's figures: the device budget, and its share of the node's RAM and NVMe disk (a node's processes
        # plan at once); what killed runs left at nvme_path goes first
        budget = device_budget(self.root_device)
        if self.device_memory_gib is not None:
            budget = min(budget or 1 << 62, int(self.device_memory_gib * 2**30))
        disk_free, disk_held = None, 0
        if self.nvme_path:
            _, disk_held = sweep_stale_state(self.nvme_path)
            disk_free = shutil.disk_usage(self.nvme_path).free // self.num_processes
        memlock = locked_memory_limit() if self.root_device.type == "cuda" else None
        return Machine(budget, available_host_bytes() // self.num_processes, memlock, disk_free, disk_held)

    def _install_loss(self, layout: Layout, dtype: torch.dtype) -> None:
        if self.install_loss and (restore := install_loss(layout, self.engine, dtype)) is not None:
            self._restores.append(restore)

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
            optimizer_state=self.moments, nvme_path=self.nvme_path, nvme_masters=self.nvme_masters,
            config=self.engine_config, delayed_update=self.delayed_update, delay_warmup=self.delay_warmup,
            world=self._world, shared=shared or self._shared,
        )  # fmt: skip
        stored = self._storage(layout, optimizer).sizes
        loss = self.install_loss and layout.causal_lm is not None
        dtype = self.precision_plugin.compute_dtype
        run = Run(module, layout, device, dtype, optimizer, schedule, trainer, options, stored)
        return make_plan(run, tokens, machine, not loss, rates)

    def _default_threads(self) -> int:
        # all cores but one (it feeds the GPU), shared by the processes of the node
        return max(1, torch.get_num_threads() // self.num_processes - 1)

    def _storage(self, layout: Layout, optimizer: Optimizer | None) -> Storage:
        return self.precision_plugin.storage(layout, optimizer, frozen_in_compute_dtype=self.frozen_in_compute_dtype,
                                             half_weights=self.half_weights)  # fmt: skip

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
        with explain_oom(self):
            return super().training_step(*args, **kwargs)

    @override
    def backward(
        self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        with explain_oom(self):
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
            with explain_oom(self):  # the "forward" schedule sends the embedding's touched rows up at the step's end
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
                delay = self.engine.state_io.delay if self.engine is not None else None
                optimizer.load_state_dict(without_copies(state, optimizer, delay))
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
