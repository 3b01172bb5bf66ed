"""Dense float32 attention oracle with the full feature set (tests and small runs only)."""

import jax
import jax.numpy as jnp

from ringsplash import masks as masks_lib
from ringsplash._internal.checks import check_attention_call
from ringsplash._internal.scalar_checks import as_scalar, check_float
from ringsplash._internal.softmax import MASKED_LSE
from ringsplash._internal.types import Array, AttentionOutput, Float, outputs
from ringsplash.masks.segment_ids import SegmentIds


def reference_attention(
    q: Float[Array, "heads q_len d"],
    k: Float[Array, "kv_heads kv_len d"],
    v: Float[Array, "kv_heads kv_len dv"],
    mask: masks_lib.AnyMask | None = None,
    *,
    segment_ids: SegmentIds | None = None,
    scale: float | None = None,
    logit_soft_cap: float | None = None,
    sinks: Float[Array, " heads"] | None = None,
    return_residuals: bool = False,
    dropout_rate: float = 0.0,
    dropout_key=None,
    return_max_logits: bool = False,
    with_lse: bool = False,
    with_max_logits: bool = False,
) -> Float[Array, "heads q_len dv"] | AttentionOutput | tuple:
    """softmax(scale * q k^T [soft-capped], masked [, sinks]) v, computed densely in float32.

    Args:
        q: queries ``[heads, q_len, d]``, floating point (per example; batch with ``jax.vmap``).
        k: keys ``[kv_heads, kv_len, d]``, the dtype of ``q``; ``kv_heads`` divides ``heads``
            (GQA; 1 = MQA). A q / k / v dtype mix is refused as by ``splash_attention`` (one rule,
            ``ringsplash._internal.checks``), never upcast silently.
        v: values ``[kv_heads, kv_len, dv]``, the dtype of ``k``; their head size ``dv`` may
            differ from ``d`` (the output has it).
        mask: a ``ringsplash.masks`` mask of shape ``(q_len, kv_len)`` (``MultiHeadMask``: one
            per head), or None to attend everything.
        segment_ids: ``SegmentIds(q=[q_len], kv=[kv_len])`` integer ids; a query attends only
            keys with an equal id. Concrete ids of any integer dtype are compared exactly;
            traced ids must fit int32.
        scale: positive multiplier of ``q k^T``; None means ``1 / sqrt(d)``.
        logit_soft_cap: None, or a positive cap ``c``: logits become ``c * tanh(logits / c)``.
        sinks: floating ``[heads]`` per-head sink logits that join each row's softmax
            denominator only (attention to "nothing"), or None.
        return_residuals: deprecated (``DeprecationWarning``): ``with_lse`` as a tuple.
        dropout_rate: probability in ``[0, 1)`` of dropping each attention probability (the
            kept ones are rescaled by ``1 / (1 - rate)``); only this dense path supports it.
        dropout_key: a ``jax.random`` key, needed when ``dropout_rate > 0``.
        return_max_logits: deprecated (``DeprecationWarning``): ``with_max_logits`` as a tuple
            ``(out, [lse], max_logits)``.
        with_lse: also return ``lse`` (float32 ``[heads, q_len]``, natural log, sinks
            included; ``MASKED_LSE`` for a row with nothing to attend).
        with_max_logits: also return float32 ``max_logits [heads]``: per head the largest
            ``scale · q·k`` over attended pairs, before the soft-cap, sinks excluded; ``-inf``
            for a head that attends nothing; no gradient (``stop_gradient``).

    Returns:
        ``out`` (``q.dtype``, ``[heads, q_len, dv]``), or with ``with_lse`` / ``with_max_logits``
        an :class:`~ringsplash.AttentionOutput` ``(out, lse, max_logits)`` (None where not asked).

    Masked values (the contract every strategy follows): K and V at a kv position that no
    query row attends (of any q head sharing its kv head: masked out everywhere, or a
    padding segment no q segment matches) never reach an output, lse or gradient, even when
    they are NaN or Inf, and their dk / dv are 0. A non-finite K / V at a position that some
    row attends is an input of that row and may make other rows NaN as well (in Splash the
    rows of the same q block; here every row of the head group).
    """
    want = outputs("reference_attention", with_lse=with_lse, with_max_logits=with_max_logits,
                   return_residuals=return_residuals, return_max_logits=return_max_logits)
    call = check_attention_call(
        q, k, v, mask=mask, segment_ids=segment_ids, scale=scale, logit_soft_cap=logit_soft_cap, sinks=sinks,
    )
    heads, kv_heads, q_len, kv_len, d = call[:5]
    scale, logit_soft_cap, segment_ids = call.scale, call.logit_soft_cap, call.segment_ids
    dropout_rate = check_float("dropout_rate", as_scalar(dropout_rate), minimum=0.0)
    if not dropout_rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate=}")
    if dropout_rate > 0 and dropout_key is None:
        raise ValueError("dropout_rate > 0 needs a dropout_key (a jax.random key)")
    group = heads // kv_heads
    allowed = jnp.ones((1, q_len, kv_len), bool)
    if mask is not None:
        allowed = jnp.asarray(masks_lib.dense(mask))
    if segment_ids is not None:
        allowed = allowed & (segment_ids.q[:, None] == segment_ids.kv[None, :])[None]
    allowed = jnp.broadcast_to(allowed, (heads, q_len, kv_len))
    # Masked values: a kv position that no query of its kv head's group attends may hold
    # anything (NaN / Inf in padding); zeroing it keeps 0 * NaN out of p @ v and the gradients.
    attended = jnp.any(allowed.reshape(kv_heads, group * q_len, kv_len), axis=1)[..., None]
    k = jnp.where(attended, k.astype(jnp.float32), 0.0)
    v = jnp.where(attended, v.astype(jnp.float32), 0.0)
    qf = q.astype(jnp.float32).reshape(kv_heads, group, q_len, d)
    s = jnp.einsum("hgqd,hkd->hgqk", qf, k) * scale
    raw = s.reshape(heads, q_len, kv_len)
    if logit_soft_cap is not None:
        s = logit_soft_cap * jnp.tanh(s / logit_soft_cap)
    s = s.reshape(heads, q_len, kv_len)

    s = jnp.where(allowed, s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    if sinks is not None:
        m = jnp.maximum(m, sinks.astype(jnp.float32)[:, None])
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    p = jnp.where(allowed, jnp.exp(s - m[..., None]), 0.0)
    l = jnp.sum(p, axis=-1)
    if sinks is not None:
        l = l + jnp.exp(sinks.astype(jnp.float32)[:, None] - m)
    safe_l = jnp.where(l == 0, 1.0, l)  # a NaN denominator (NaN input) stays NaN, as in the kernels
    if dropout_rate > 0:  # dropping unnormalised p then dividing by l = dropping probabilities
        keep = jax.random.bernoulli(dropout_key, 1.0 - dropout_rate, p.shape)
        p = jnp.where(keep, p / (1.0 - dropout_rate), 0.0)
    pv = jnp.einsum("hgqk,hkd->hgqd", p.reshape(kv_heads, group, q_len, kv_len), v)
    out = pv.reshape(heads, q_len, v.shape[-1]) / safe_l[..., None]
    out = out.astype(q.dtype)
    max_logits = lse = None
    if want.max_logits:
        max_logits = jax.lax.stop_gradient(jnp.max(jnp.where(allowed, raw, -jnp.inf), axis=(1, 2)))
    if want.lse:
        lse = jnp.where(l == 0, MASKED_LSE, m + jnp.log(safe_l))
    return want.package(out, lse, max_logits)

