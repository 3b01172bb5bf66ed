"""Equinox transformer whose attention runs under a selectable strategy (reference / splash / ring)."""

from ringsplash.model.attention import Attention, attend, rope
from ringsplash.model.config import MASKS, STRATEGIES, TransformerConfig
from ringsplash.model.transformer import Block, RMSNorm, SwiGLU, Transformer

__all__ = [
    "MASKS",
    "STRATEGIES",
    "Attention",
    "Block",
    "RMSNorm",
    "SwiGLU",
    "Transformer",
    "TransformerConfig",
    "attend",
    "rope",
]
