"""Triton kernels, importable as ``lightning_slide.kernels`` (never as a top-level ``kernels`` package).

NOTE: keep this file free of side effects and without a ``__version__``: run from the repository root,
transformers imports a folder named ``kernels`` while building models, and would take one that carries a
version for Hugging Face's package of that name.
"""

from .attention import FlashAttention, flash_attention, flash_attention_ref
from .linear_cross_entropy import (
    FusedLinearCrossEntropy,
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_ref,
)
from .norm import RMSNormFunction, rms_norm, rms_norm_ref
from .rotary import RotaryFunction, rotary_embedding, rotary_embedding_ref

__all__ = [
    "FlashAttention",
    "FusedLinearCrossEntropy",
    "RMSNormFunction",
    "RotaryFunction",
    "flash_attention",
    "flash_attention_ref",
    "fused_linear_cross_entropy",
    "fused_linear_cross_entropy_ref",
    "rms_norm",
    "rms_norm_ref",
    "rotary_embedding",
    "rotary_embedding_ref",
]
