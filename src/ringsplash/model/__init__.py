"""Equinox transformer whose attention runs under a selectable strategy (reference / splash / ring / allgather /
ulysses / usp)."""

from ringsplash.model.attention import PAD_SEGMENT, Attention, attend, rope
from ringsplash.model.config import MASKS, REMAT_POLICIES, STRATEGIES, TransformerConfig
from ringsplash.model.hf_features import LAYER_TYPES, MLP_ACTIVATIONS, ModelFeatures, layer_segments
from ringsplash.model.parallelism import CONTEXT, ULYSSES, ContextParallel
from ringsplash.model.qk_clip import QKClipFactors, apply_qk_clip, qk_clip_factors
from ringsplash.model.rope_scaling import (
    ROPE_TYPES,
    RopeScaling,
    rope_attention_factor,
    rope_inv_freq,
    rope_scaling_from_flags,
)
from ringsplash.model.transformer import GATHERED, Block, RMSNorm, SwiGLU, Transformer, abstract_model, remat_policy

__all__ = [
    "CONTEXT",
    "GATHERED",
    "LAYER_TYPES",
    "MASKS",
    "MLP_ACTIVATIONS",
    "PAD_SEGMENT",
    "REMAT_POLICIES",
    "ROPE_TYPES",
    "STRATEGIES",
    "ULYSSES",
    "Attention",
    "Block",
    "ContextParallel",
    "ModelFeatures",
    "QKClipFactors",
    "RMSNorm",
    "RopeScaling",
    "SwiGLU",
    "Transformer",
    "TransformerConfig",
    "abstract_model",
    "apply_qk_clip",
    "attend",
    "layer_segments",
    "qk_clip_factors",
    "remat_policy",
    "rope",
    "rope_attention_factor",
    "rope_inv_freq",
    "rope_scaling_from_flags",
]
