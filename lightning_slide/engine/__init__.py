"""The sliding-window engine (no Lightning imports here; the strategy is a thin adapter over it)."""

from .engine import EngineStats, SlideEngine, move_except_parameters
from .grads import NonFiniteGradientError
from .optim import SUPPORTED_OPTIMIZERS, CpuOptimizer
from .transfer import PinnedMemoryError

__all__ = [
    "SUPPORTED_OPTIMIZERS",
    "CpuOptimizer",
    "EngineStats",
    "NonFiniteGradientError",
    "PinnedMemoryError",
    "SlideEngine",
    "move_except_parameters",
]
