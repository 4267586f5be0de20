"""lightning-slide: fine-tune language models far larger than GPU memory on one GPU with PyTorch Lightning.

``import lightning_slide`` registers the ``"slideformer"`` strategy, so ``Trainer(strategy="slideformer")`` works.
"""

from lightning.pytorch.strategies import StrategyRegistry

from .attention import register as _register_attention
from .data import TextDataModule
from .engine import BoundaryError, NonFiniteGradientError, PinnedMemoryError
from .kernels.linear_cross_entropy import fused_linear_cross_entropy
from .loss import causal_lm_loss
from .module import CausalLMModule, LoRA
from .monitor import SlideMonitor
from .precision import SlideFormerPrecision
from .strategy import SlideFormerStrategy

SlideFormerStrategy.register_strategies(StrategyRegistry)
_register_attention()  # attn_implementation="slide" for transformers models

__version__ = "0.1.0"
__all__ = [
    "BoundaryError",
    "CausalLMModule",
    "LoRA",
    "NonFiniteGradientError",
    "PinnedMemoryError",
    "SlideFormerPrecision",
    "SlideFormerStrategy",
    "SlideMonitor",
    "TextDataModule",
    "causal_lm_loss",
    "fused_linear_cross_entropy",
]
