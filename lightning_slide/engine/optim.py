"""Step the user's torch optimizer on CPU tensors, a few parameters (or rows of one) at a time.

The user's optimizer object keeps its ``param_groups`` and its ``state`` in torch's own format, so
``optimizer.state_dict()``, Lightning checkpoints and LR schedulers work unchanged. Only the arithmetic moves:
the engine calls torch's fused CPU kernels on the parameters whose gradients have arrived, with the
hyperparameters that were in force when ``optimizer_step`` was called. With ``state_dtype=torch.bfloat16`` Adam's
moments of fp32 parameters are bf16 tensors there, updated by ``adam_bf16.py``'s kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.optim import SGD, Adam, AdamW, Optimizer

from . import adam_bf16
from .adam_bf16 import AdamArgs
from .nvme import MASTER, NvmeStateStore, row_numel

SUPPORTED_OPTIMIZERS = (AdamW, Adam, SGD)


@dataclass(frozen=True)
class Hypers:
    """The hyperparameters of one param group, frozen when ``optimizer_step`` is called."""

    lr: float
    weight_decay: float
    maximize: bool
    # Adam / AdamW
    beta1: float = 0.0
    beta2: float = 0.0
    eps: float = 0.0
    amsgrad: bool = False
    decoupled: bool = False
    # SGD
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False


class CpuOptimizer:
    """Applies ``torch.optim.AdamW``, ``Adam`` or ``SGD`` updates with torch's fused CPU kernels.

    Args:
        optimizer: the user's optimizer; its parameters are the fp32 masters in CPU memory.
        state_dtype: the dtype of Adam's moments of fp32 parameters (``torch.bfloat16``: ``adam_bf16.py``); a
            parameter of another dtype has state of its own dtype, as torch's optimizers make it.

    With a ``store`` (the NVMe tier, set by the engine), Adam's moments live there instead of in
    ``optimizer.state``, which then keeps only each parameter's step count; updates then run block by block of
    the store's rows, each block's moments read before and written after. A parameter whose fp32 master is in the
    store too holds a compute-dtype copy: the update runs on the block's master, then rounds it into the copy.

    Raises:
        TypeError: for any other optimizer class (subclasses included: their ``step`` may differ).
        ValueError: for options the fused kernels do not implement.
    """

    def __init__(self, optimizer: Optimizer, state_dtype: torch.dtype = torch.float32) -> None:
        if type(optimizer) not in SUPPORTED_OPTIMIZERS:
            names = ", ".join(f"torch.optim.{cls.__name__}" for cls in SUPPORTED_OPTIMIZERS)
            raise TypeError(
                f"SlideFormer steps the optimizer on the CPU and supports {names}; got {type(optimizer).__qualname__}."
                " Return one of these from configure_optimizers."
            )
        for group in optimizer.param_groups:
            for flag in ("capturable", "differentiable"):
                if group.get(flag):
                    raise ValueError(f"SlideFormer does not support {type(optimizer).__name__}({flag}=True).")
        self.optimizer = optimizer
        self.is_sgd = type(optimizer) is SGD
        if state_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"The optimizer state is kept in float32 or bfloat16; got {state_dtype}.")
        if state_dtype != torch.float32 and self.is_sgd:
            raise ValueError(
                "optimizer_state='bf16' keeps Adam's moments in bf16; SGD's momentum stays fp32: train SGD with"
                " optimizer_state='fp32'."
            )
        self.state_dtype = state_dtype
        # each parameter's number in the optimizer, for the bf16 moments' random rounding (a step repeats exactly)
        self._number = {p: i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
        self.store: NvmeStateStore | None = None
        # state tensors in memory shared by a node's processes (shared_host.py), taken when the state is created,
        # and the rows of each parameter this process updates
        self.shared_state: dict[tuple[Tensor, str], Tensor] = {}
        self.own_rows: dict[Tensor, slice | None] = {}
        self._group_of = {p: i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self._sgd_first: dict[Tensor, bool] = {}  # SGD: does this step create the momentum buffer?

    def check_params(self, managed: set[Tensor]) -> None:
        """Refuse tensors in the optimizer that are not among the ``managed`` parameters of the model."""
        stray = [p for g in self.optimizer.param_groups for p in g["params"] if p not in managed]
        if stray:
            raise ValueError(
                f"The optimizer holds {len(stray)} tensor(s) that are not parameters of the model being trained"
                f" (first shape {tuple(stray[0].shape)}). Give configure_optimizers only self.parameters() (or"
                " subsets of them)."
            )

    def state_keys(self) -> tuple[str, ...]:
        """The names of the state each parameter has (``exp_avg``, ...)."""
        groups = self.optimizer.param_groups
        if self.is_sgd:
            return ("momentum_buffer",) if any(g["momentum"] for g in groups) else ()
        amsgrad = any(g.get("amsgrad") for g in groups)
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if amsgrad else ("exp_avg", "exp_avg_sq")

    def group_index(self, param: Tensor) -> int | None:
        """The param group holding ``param``, or ``None`` when the optimizer does not update it."""
        return self._group_of.get(param)

    def snapshot(self) -> list[Hypers]:
        """Freeze each group's hyperparameters; a scheduler may change them before the update runs."""
        out = []
        for g in self.optimizer.param_groups:
            common = {"lr": float(g["lr"]), "weight_decay": float(g["weight_decay"]), "maximize": g["maximize"]}
            if self.is_sgd:
                out.append(Hypers(**common, momentum=g["momentum"], dampening=g["dampening"], nesterov=g["nesterov"]))
            else:
                beta1, beta2 = (float(b) for b in g["betas"])
                decoupled = type(self.optimizer) is AdamW or bool(g.get("decoupled_weight_decay", False))
                out.append(
                    Hypers(**common, beta1=beta1, beta2=beta2, eps=g["eps"], amsgrad=g["amsgrad"], decoupled=decoupled)
                )
        return out

    def chunk_rows(self, param: Tensor, chunk_numel: int) -> int:
        """Rows of ``param`` per gradient chunk: the store's blocks, or as many as fit ``chunk_numel``."""
        if self.store is not None and param in self.store.rows:
            return self.store.rows[param]
        return max(1, chunk_numel // row_numel(param))

    def prefetch(self, params: list[Tensor]) -> None:
        """The updates of ``params`` come next: start reading their state if it lives on disk."""
        if self.store is not None:
            self.store.prefetch(params)

    def begin(self, param: Tensor, hypers: Hypers) -> None:
        """Start this step's update of ``param``: create its state if new and count the step (once per step)."""
        state = self.optimizer.state[param]
        if self.is_sgd:
            first = hypers.momentum != 0 and state.get("momentum_buffer") is None
            self._sgd_first[param] = first
            if first:
                state["momentum_buffer"] = self._new_state(param, "momentum_buffer")
            return
        if not state:
            # Same keys, dtypes and layout as torch.optim.Adam(fused=True) creates.
            state["step"] = torch.zeros((), dtype=torch.float32)
            if self.store is None:
                for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")[: 2 + hypers.amsgrad]:
                    state[key] = self._new_state(param, key)
        state["step"] += 1

    def reads_bf16_grads(self, param: Tensor) -> bool:
        """Whether ``param``'s update reads a bf16 gradient as it is (the bf16 moments' kernel); elsewhere one is
        widened first."""
        return not self.is_sgd and param.dtype == torch.float32 and self.state_dtype == torch.bfloat16

    def state_dtype_of(self, param: Tensor) -> torch.dtype:
        """The dtype of ``param``'s state tensors."""
        return self.state_dtype if param.dtype == torch.float32 else param.dtype

    def _new_state(self, param: Tensor, key: str) -> Tensor:
        shared = self.shared_state.get((param, key))
        if shared is None:
            return torch.zeros_like(param, dtype=self.state_dtype_of(param), memory_format=torch.preserve_format)
        part = own_part(shared, self.own_rows[param])
        if part is not None:
            part.zero_()  # the other processes zero theirs
        return shared

    def update(
        self,
        params: list[Tensor],
        grads: list[Tensor],
        hypers: Hypers,
        rows: list[slice | None] | None = None,
        grad_scale: Tensor | None = None,
        copies: list[Tensor | None] | None = None,
    ) -> None:
        """Apply the update to ``params`` (all of one group), after :meth:`begin` was called for each.

        Args:
            params: the master parameters.
            grads: fp32 gradients (bf16 ones where :meth:`reads_bf16_grads`), one per parameter, shaped like
                ``param[rows[i]]``.
            hypers: the group's frozen hyperparameters.
            rows: for each parameter, the slice of leading rows to update (``None``: all of it).
            grad_scale: a 1-element tensor; gradients are divided by it (the clipping coefficient enters here).
            copies: tensors shaped like ``param[rows[i]]`` (or ``None``) that receive the updated values in their
                dtype (a delayed block's next weights, ``delay.py``): written by the bf16 kernel as it updates.
        """
        rows = rows if rows is not None else [None] * len(params)
        copies = copies or [None] * len(params)
        written = self._update(params, grads, hypers, rows, grad_scale, copies)
        for p, r, copy in zip(params, rows, copies):
            if copy is not None and id(copy) not in written:
                copy.copy_(rows_of(p.data, r))

    def _update(self, params, grads, hypers: Hypers, rows, grad_scale, copies) -> set[int]:
        # the update itself; returns the ids of the copies it wrote
        if self.store is not None and not self.is_sgd:  # the moments come from disk, block by block
            for p, g, r in zip(params, grads, rows):
                start = r.start if r is not None else 0
                for part, block in self.store.blocks(p, r):
                    moments = self.store.load(p, block)  # the block's rows
                    at = None if part is None else slice(start + part.start, start + part.stop)
                    grad = g if part is None or part == slice(0, len(g)) else g[part]
                    master = moments.pop(MASTER, None)
                    target = rows_of(p.data, at) if master is None else master
                    step = self.optimizer.state[p]["step"]
                    self._adam([p], [target], [grad], [moments], [step], hypers, grad_scale, [_first(p, at)])
                    if master is not None:
                        rows_of(p.data, at).copy_(master)  # the copy the device computes with
                    self.store.save(p, block)
            return set()
        states = [self.optimizer.state[p] for p in params]
        ps = [rows_of(p.data, r) for p, r in zip(params, rows)]
        if self.is_sgd:
            first = self._sgd_first[params[0]]
            assert all(self._sgd_first[p] == first for p in params)
            bufs = [rows_of(s["momentum_buffer"], r) for s, r in zip(states, rows)] if hypers.momentum != 0 else []
            self._sgd(ps, grads, bufs, hypers, first, grad_scale)
            return set()
        moments = [{k: rows_of(v, r) for k, v in s.items() if k != "step"} for s, r in zip(states, rows)]
        starts = [_first(p, r) for p, r in zip(params, rows)]
        return self._adam(params, ps, grads, moments, [s["step"] for s in states], hypers, grad_scale, starts, copies)

    def state_like(self, param: Tensor) -> dict[str, Tensor]:
        """``param``'s values and each of its state tensors shaped like it (Adam's moments, SGD's momentum), by name
        (the values under ``"param"``); in RAM, after :meth:`begin`."""
        state = self.optimizer.state[param]
        shaped = {k: v for k, v in state.items() if isinstance(v, Tensor) and v.shape == param.shape and k != "step"}
        return {"param": param.data, **shaped}

    def update_gathered(
        self, param: Tensor, rows: dict[str, Tensor], grad: Tensor, hypers: Hypers, grad_scale: Tensor | None = None,
        *, index: Tensor,
    ) -> None:  # fmt: skip
        """Apply the update to rows ``index`` (int64, on the host) gathered from :meth:`state_like` (same keys), in
        place, after :meth:`begin`.

        The rows may be on the device: the same fused kernel (bf16 moments: its Triton twin) then runs there (the step
        count and ``grad_scale`` go with them)."""
        device = grad.device
        if grad_scale is not None:
            grad_scale = grad_scale.to(device)
        if self.is_sgd:
            bufs = [rows["momentum_buffer"]] if hypers.momentum != 0 else []
            self._sgd([rows["param"]], [grad], bufs, hypers, self._sgd_first[param], grad_scale)
            return
        step = self.optimizer.state[param]["step"]
        if _bf16_moments(rows, param):
            args, seed = self._bf16_args(param, step, hypers, grad_scale)
            adam_bf16.step(rows["param"], grad, rows["exp_avg"], rows["exp_avg_sq"], rows.get("max_exp_avg_sq"), args,
                           seed, rows=index, threads=torch.get_num_threads())  # fmt: skip
            return
        self._fused_adam([rows["param"]], [grad], [rows], [step.to(device)], hypers, grad_scale)

    @staticmethod
    def _sgd(ps, grads, bufs, hypers: Hypers, first: bool, grad_scale) -> None:
        grads = _as_params(ps, grads)
        torch._fused_sgd_(
            ps, grads, bufs, weight_decay=hypers.weight_decay, momentum=hypers.momentum, lr=hypers.lr,
            dampening=hypers.dampening, nesterov=hypers.nesterov, maximize=hypers.maximize,
            is_first_step=first, grad_scale=grad_scale,
        )  # fmt: skip

    def _adam(self, params, ps, grads, moments: list[dict[str, Tensor]], steps, hypers: Hypers, grad_scale,
              starts: list[int], copies: list[Tensor | None] | None = None) -> set[int]:  # fmt: skip
        # params: the parameters; ps: the tensors updated (their rows, or a block's master), the first element of each
        # at starts[i] in its parameter; returns the ids of the bf16 copies written with the update
        copies = copies or [None] * len(ps)
        bf16 = [i for i, (m, p) in enumerate(zip(moments, ps)) if _bf16_moments(m, p)]
        written = set()
        for i in bf16:
            args, seed = self._bf16_args(params[i], steps[i], hypers, grad_scale)
            m = moments[i]
            copy = copies[i] if copies[i] is not None and copies[i].dtype == torch.bfloat16 else None
            adam_bf16.step(ps[i], grads[i], m["exp_avg"], m["exp_avg_sq"], m.get("max_exp_avg_sq"), args, seed,
                           index0=starts[i], threads=torch.get_num_threads(), copy=copy)  # fmt: skip
            if copy is not None:
                written.add(id(copy))
        rest = [i for i in range(len(ps)) if i not in bf16]
        if rest:
            ps, grads, moments, steps = ([xs[i] for i in rest] for xs in (ps, grads, moments, steps))
            self._fused_adam(ps, grads, moments, steps, hypers, grad_scale)
        return written

    def _bf16_args(
        self, param: Tensor, step: Tensor, hypers: Hypers, grad_scale: Tensor | None
    ) -> tuple[AdamArgs, int]:
        # the bf16 kernel's scalars for this step, and its random bits' seed: this parameter's, this step's
        count = int(step)
        scale = 1.0 / float(grad_scale) if grad_scale is not None else 1.0
        args = AdamArgs.of(lr=hypers.lr, beta1=hypers.beta1, beta2=hypers.beta2, eps=hypers.eps,
                           weight_decay=hypers.weight_decay, decoupled=hypers.decoupled, maximize=hypers.maximize,
                           step=count, scale=scale)  # fmt: skip
        return args, (self._number[param] * 0x632BE5AB + count * 0x9E3779B1) & 0xFFFFFFFF

    @staticmethod
    def _fused_adam(ps, grads, moments: list[dict[str, Tensor]], steps, hypers: Hypers, grad_scale) -> None:
        fused = torch._fused_adamw_ if hypers.decoupled else torch._fused_adam_
        grads = _as_params(ps, grads)
        fused(
            ps, grads, [m["exp_avg"] for m in moments], [m["exp_avg_sq"] for m in moments],
            [m["max_exp_avg_sq"] for m in moments] if hypers.amsgrad else [], steps,
            lr=hypers.lr, beta1=hypers.beta1, beta2=hypers.beta2, weight_decay=hypers.weight_decay,
            eps=hypers.eps, amsgrad=hypers.amsgrad, maximize=hypers.maximize, grad_scale=grad_scale,
        )  # fmt: skip

    def end(self, param: Tensor) -> None:
        """Finish this step's update of ``param``."""
        self._sgd_first.pop(param, None)


def _as_params(ps: list[Tensor], grads: list[Tensor]) -> list[Tensor]:
    # the fp32 gradients of parameters kept in bf16 (half_weights="keep"), in their dtype, as autograd gives them
    return [g if g.dtype == p.dtype else g.to(p.dtype) for p, g in zip(ps, grads)]


def rows_of(t: Tensor, rows: slice | None) -> Tensor:
    """``t``'s leading rows ``rows`` (``None``: all of it)."""
    return t if rows is None else t[rows]


def own_part(t: Tensor, rows: slice | None) -> Tensor | None:
    """The rows of ``t`` a process holds (``rows`` from ``SharedHost.rows``); ``None``: ``t`` is a scalar another
    process holds."""
    if t.dim() == 0 and rows is not None:
        return None
    return rows_of(t, rows)


def _first(param: Tensor, rows: slice | None) -> int:
    # the index, in ``param``, of the first element of its leading rows ``rows``
    return rows.start * row_numel(param) if rows is not None and param.dim() else 0


def _bf16_moments(moments: dict[str, Tensor], param: Tensor) -> bool:
    # bf16 moments of an fp32 parameter: adam_bf16's kernel (torch's fused ones take one dtype)
    return moments["exp_avg"].dtype == torch.bfloat16 and param.dtype == torch.float32
