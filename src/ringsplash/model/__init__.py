"""Equinox transformer whose attention runs under a selectable strategy (reference / splash / ring / allgather /
ulysses / usp)."""

from ringsplash.model.attention import Attention, attend, rope
from ringsplash.model.config import MASKS, REMAT_POLICIES, STRATEGIES, TransformerConfig
from ringsplash.model.transformer import GATHERED, Block, RMSNorm, SwiGLU, Transformer, remat_policy

__all__ = [
    "GATHERED",
    "MASKS",
    "REMAT_POLICIES",
    "STRATEGIES",
    "Attention",
    "Block",
    "RMSNorm",
    "SwiGLU",
    "Transformer",
    "TransformerConfig",
    "attend",
    "remat_policy",
    "rope",
]
