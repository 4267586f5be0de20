"""The sliding-window engine (no Lightning imports here; the strategy is a thin adapter over it)."""

from .config import EngineConfig
from .engine import SlideEngine
from .optim import SUPPORTED_OPTIMIZERS, CpuOptimizer
from .transfer import PinnedMemoryError
from .units import BoundaryError, move_except_parameters
from .updates import NonFiniteGradientError

__all__ = [
    "BoundaryError",
    "SUPPORTED_OPTIMIZERS",
    "CpuOptimizer",
    "EngineConfig",
    "NonFiniteGradientError",
    "PinnedMemoryError",
    "SlideEngine",
    "move_except_parameters",
]
