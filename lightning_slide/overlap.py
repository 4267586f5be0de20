"""How many of the first streamed blocks have their updates moved where the CPU worker would idle, for the fastest
predicted step (``rates.py``): to the next forward (deferred, exact) or to the next step (delayed, ``delay.py``)."""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from .engine import SlideEngine
from .engine.units import Unit
from .rates import Rates, Work, predict_step_s


def trained(blocks: list[Unit], trainable: set[nn.Parameter]) -> tuple[int, int]:
    """The parameters of ``blocks`` the optimizer steps, and the weights of their matrices."""
    params = sum(p.numel() for u in blocks for p in u.owned() if p in trainable)
    matmul = sum(m.weight.numel() for u in blocks for m in u.module.modules() if isinstance(m, nn.Linear))
    return params, matmul


def deferral(engine: SlideEngine, work: Work, rates: Rates) -> int:
    """Schedule "backward": the blocks updated during the next forward, where that is at least 1 % faster than none
    (each costs the host its gradients)."""
    if engine.schedule != "backward" or engine.optimizer is None:
        return 0
    return _fastest(engine, work, rates, "deferred")


def delay(engine: SlideEngine, work: Work, rates: Rates) -> int:
    """The blocks updated a step late: the fewest within 1 % of the fastest predicted step (each costs the host a
    copy of its weights, and its training a step's staleness)."""
    return _fastest(engine, work, rates, "delayed")


def _fastest(engine: SlideEngine, work: Work, rates: Rates, field: str) -> int:
    trainable = engine.streamed_trainable()
    times, params, matmul = [predict_step_s(work, engine.schedule, rates)], 0, 0
    for block in engine.blocks:
        block_params, block_matmul = trained([block], trainable)
        params, matmul = params + block_params, matmul + block_matmul
        trial = replace(work, **{field: params, f"{field}_matmul": matmul})
        times.append(predict_step_s(trial, engine.schedule, rates))
    best = min(times)
    if field == "deferred":
        fastest = times.index(best)
        return fastest if best < 0.99 * times[0] else 0
    return next(k for k, t in enumerate(times) if t <= 1.01 * best)
