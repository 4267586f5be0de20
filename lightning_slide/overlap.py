"""How many of the first streamed blocks have their updates moved where the CPU worker would idle, by the predicted
step (``rates.py``): to the next forward (deferred, exact) or to the next step (delayed, ``delay.py``)."""

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
    trainable = engine.streamed_trainable()
    times, params, matmul = [predict_step_s(work, engine.schedule, rates)], 0, 0
    for block in engine.blocks:
        block_params, block_matmul = trained([block], trainable)
        params, matmul = params + block_params, matmul + block_matmul
        times.append(predict_step_s(replace(work, deferred=params, deferred_matmul=matmul), engine.schedule, rates))
    fastest = times.index(min(times))
    return fastest if times[fastest] < 0.99 * times[0] else 0


def delay(engine: SlideEngine, work: Work, rates: Rates) -> int:
    """The blocks updated a step late: every streamed block, where that predicts a step at least 1 % faster than
    none, else none (each delayed block made the measured step faster: benchmarks/NOTES.md, session 45)."""
    if engine.optimizer is None or not engine.blocks:
        return 0
    params, matmul = trained(engine.blocks, engine.streamed_trainable())
    every = predict_step_s(replace(work, delayed=params, delayed_matmul=matmul), engine.schedule, rates)
    return len(engine.blocks) if every < 0.99 * predict_step_s(work, engine.schedule, rates) else 0
