"""QK-clip (as in MuonClip): keep every head's largest attention logit at or below a threshold τ.

After an optimiser update, each head ``h`` whose max logit ``m_h`` in that step's forward pass
exceeded τ gets its logits scaled by ``γ_h = τ / m_h`` by rescaling its columns of W_q and of
W_k (the logit ``scale · RoPE(x W_q,h) · RoPE(x W_k,g)`` is bilinear in the two, and RoPE is
linear), so with the same layer input its max logit becomes exactly τ (to float32 rounding).
Heads at or below τ (and heads that attended nothing, ``m_h = -inf``) have ``γ_h = 1``.

MHA: W_q,h and W_k,h are each scaled by ``sqrt(γ_h)``. GQA (``group`` q heads share a kv
head ``g``): W_k,g cannot take a different factor per q head, so it is scaled by
``s_g = sqrt(min_h γ_h)`` (the clip of the group's largest logit), and each q head by
``γ_h / s_g``: every q head's logits are scaled by exactly ``γ_h`` — clipped heads land on
τ, unclipped heads of a clipped group keep their logits (their W_q grows by ``1 / s_g`` to
compensate), groups with no clipped head are untouched (factor exactly 1). With ``group = 1``
this is the MHA rule.

Limits: the clip is exact per layer for that layer's input; deeper layers see the changed
outputs of the clipped layers, so their next max logits may move. The optimiser state is not
rescaled (as in MuonClip). Parameters stored in a low-precision dtype are rounded after scaling.
"""

from typing import NamedTuple

import equinox as eqx
import jax.numpy as jnp

from ringsplash._internal.types import Array, Float

__all__ = ["QKClipFactors", "apply_qk_clip", "qk_clip_factors"]


class QKClipFactors(NamedTuple):
    """Per-layer column factors of W_q (per q head) and W_k (per kv head)."""

    q: Float[Array, "layers heads"]
    k: Float[Array, "layers kv_heads"]


def qk_clip_factors(max_logits: Float[Array, "layers heads"], threshold: float, group: int) -> QKClipFactors:
    """The W_q / W_k factors that scale each head's logits by ``min(1, τ / max_logit)``.

    Args:
        max_logits: float32 per-layer, per-q-head max logits of a forward pass (``-inf`` = the
            head attended nothing).
        threshold: τ > 0.
        group: q heads per kv head (``heads // kv_heads``); q head ``h`` uses kv head ``h // group``.
    """
    m = jnp.asarray(max_logits, jnp.float32)
    gamma = jnp.where(m > threshold, threshold / m, 1.0)  # also 1 for -inf and NaN
    layers, heads = gamma.shape
    per_group = gamma.reshape(layers, heads // group, group)
    k = jnp.sqrt(jnp.min(per_group, axis=-1))  # 1 exactly where no head of the group is clipped
    q = per_group / k[..., None]
    return QKClipFactors(q=q.reshape(layers, heads), k=k)


def _scale_columns(w, factors, head_dim):
    """``w [layers, d_model, n * head_dim]`` with each head's ``head_dim`` columns times its
    factor (computed in float32; a factor of 1 leaves the weights bit-identical)."""
    f = jnp.repeat(factors, head_dim, axis=-1)[:, None, :]
    return (w.astype(jnp.float32) * f).astype(w.dtype)


def apply_qk_clip(model, max_logits: Float[Array, "layers heads"], threshold: float):
    """``model`` (a ``Transformer``, or its array partition from ``eqx.partition``) with every
    layer's W_q / W_k columns rescaled by :func:`qk_clip_factors`. Elementwise, so it keeps the
    parameters' sharding (FSDP)."""
    c = model.config
    if tuple(max_logits.shape) != (c.num_layers, c.num_heads):
        raise ValueError(f"max_logits must be [num_layers, num_heads]={(c.num_layers, c.num_heads)}, "
                         f"got shape {tuple(max_logits.shape)}")
    f = qk_clip_factors(max_logits, threshold, c.group_size)
    attn = model.layers.attention
    return eqx.tree_at(lambda m: (m.layers.attention.wq, m.layers.attention.wk), model,
                       (_scale_columns(attn.wq, f.q, c.head_dim), _scale_columns(attn.wk, f.k, c.head_dim)))
