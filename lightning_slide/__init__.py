"""lightning-slide: fine-tune language models far larger than GPU memory on one GPU with PyTorch Lightning.

``import lightning_slide`` registers the ``"slideformer"`` strategy, so ``Trainer(strategy="slideformer")`` works.
"""

from lightning.pytorch.strategies import StrategyRegistry

from .attention import register as _register_attention
from .engine import NonFiniteGradientError, PinnedMemoryError
from .kernels import fused_linear_cross_entropy
from .loss import causal_lm_loss
from .precision import SlideFormerPrecision
from .strategy import SlideFormerStrategy

SlideFormerStrategy.register_strategies(StrategyRegistry)
_register_attention()  # attn_implementation="slide" for transformers models

__version__ = "0.1.0"
__all__ = [
    "NonFiniteGradientError",
    "PinnedMemoryError",
    "SlideFormerPrecision",
    "SlideFormerStrategy",
    "causal_lm_loss",
    "fused_linear_cross_entropy",
]
