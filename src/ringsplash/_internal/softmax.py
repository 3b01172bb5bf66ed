"""Online-softmax algebra shared by the oracle, both Splash backends, their VJPs and the ring.

A partial attention result is ``(o, lse)``: ``o`` the softmax-weighted values over some set of
keys, ``lse`` (float32, natural log) the log-sum-exp of that set's logits. Two partials over
disjoint key sets merge exactly (``merge``); sinks join a row's denominator once, at the end
(``fold_sinks``). A row with nothing to attend carries ``lse = MASKED_LSE``: finite, so its merge
weight ``exp(MASKED_LSE - lse')`` is 0 and gradients stay NaN-free.

Backward: with ``delta = rowsum(d_out * out)`` (minus the cotangent of a returned lse), the score
gradient is ``dS = P * (dP - delta)``, and a sink's gradient is ``-sum_rows exp(sink - lse) * delta``.
"""

import jax
import jax.numpy as jnp
import numpy as np

#: lse of a row with nothing to attend (and no sink): finite, so merges and gradients stay NaN-free.
MASKED_LSE = -1e30
#: the score of a masked (query, key) pair inside the kernels: far below any real logit, finite.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)

_F32 = jnp.float32


def merge(o, lse, o_t, lse_t):
    """``(o, lse)`` and ``(o_t, lse_t)`` over disjoint keys -> the partial over both:
    ``lse' = logaddexp(lse, lse_t)``, ``o' = o exp(lse - lse') + o_t exp(lse_t - lse')``.

    The weights are computed as ``sigmoid(-/+ (lse_t - lse))``, not as ``exp`` of differences
    with the rounded ``lse'``: float32 rounds ``lse'`` by up to half an ulp of its magnitude
    (3.8e-6 at logits ~100), and both ``exp(lse - lse')`` and ``exp(lse_t - lse')`` would carry
    that error in the same direction, rescaling ``o`` by ``1 +- 3.8e-6`` on every merge: an error
    that grew with the number of merges (a ring's size; issue 39). The sigmoids sum to 1 to
    float32 precision whatever the magnitude of the lse's; ``lse'`` itself is rounded once per
    merge, as ``logaddexp`` rounds it (``lse - lse_t`` is exact for lse's within a factor 2).
    """
    d = lse_t - lse
    new = jnp.maximum(lse, lse_t) + jnp.log1p(jnp.exp(-jnp.abs(d)))  # logaddexp (both MASKED_LSE: MASKED_LSE)
    return o * jax.nn.sigmoid(-d)[..., None] + o_t * jax.nn.sigmoid(d)[..., None], new


def fold_sinks(o, lse, sinks):
    """Sinks ``[heads]`` (or None: unchanged) join each row's denominator once: float32
    ``(o exp(lse - lse_total), lse_total)`` with ``lse_total = logaddexp(lse, sink)``; the
    weight is ``sigmoid(lse - sink)``, free of ``lse_total``'s rounding (see :func:`merge`)."""
    if sinks is None:
        return o, lse
    sinks = sinks.astype(_F32)[:, None]
    lse_total = jnp.logaddexp(lse, sinks)
    return o.astype(_F32) * jax.nn.sigmoid(lse - sinks)[..., None], lse_total


def delta(d_out, out, d_lse=None):
    """float32 ``rowsum(d_out * out)``, less the cotangent of a returned lse (``d lse / d s = P``
    folds into ``dS = P * (dP - (delta - d_lse))``)."""
    result = jnp.sum(d_out.astype(_F32) * out.astype(_F32), axis=-1)
    return result if d_lse is None else result - d_lse.astype(_F32)


def sinks_grad(sinks, lse, delta):
    """float32 ``d sink_h = -sum_i exp(sink_h - lse_i) delta_i`` over the rows given (the final,
    sink-including ``lse``); callers sum it over the devices that hold other rows."""
    return -jnp.sum(jnp.exp(sinks.astype(_F32)[:, None] - lse) * delta, axis=-1)
