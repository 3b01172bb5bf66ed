"""Choosing the next token from logits: greedy, or sampling with temperature, top-k and top-p
(applied in that order, as transformers' logits processors do)."""

import jax
import jax.numpy as jnp

from ringsplash._types import Array, Float, Int
from ringsplash.inference.checks import is_int


def check_sampling(temperature, top_k, top_p) -> None:
    """``temperature >= 0``, ``top_k`` None or a positive int (``np.int64`` too), ``top_p`` None or in ``(0, 1]``."""
    if isinstance(temperature, bool) or not isinstance(temperature, int | float) or not temperature >= 0:
        raise ValueError(f"temperature must be a number >= 0 (0: greedy), got {temperature=}")
    if top_k is not None and (not is_int(top_k) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k=}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, int | float) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be None or in (0, 1], got {top_p=}")


def filter_logits(logits: Float[Array, "*batch vocab"], top_k: int | None = None,
                  top_p: float | None = None) -> Float[Array, "*batch vocab"]:
    """``logits`` with ``-inf`` outside the kept tokens.

    ``top_k``: the ``top_k`` largest logits are kept (with any tied with the k-th). ``top_p``: the
    smallest set of most probable tokens whose probability (softmax of the logits given, after
    ``top_k``) reaches ``top_p`` is kept: a token is kept when the probability of the tokens
    ranked before it is below ``top_p`` (the most probable always is)."""
    logits = logits.astype(jnp.float32)
    if top_k is not None and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits >= kth, logits, -jnp.inf)
    if top_p is not None and top_p < 1:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs
        keep_sorted = before < top_p
        keep = jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), axis=-1)  # back to vocab order
        logits = jnp.where(keep, logits, -jnp.inf)
    return logits


def sample(logits: Float[Array, "batch vocab"], key: jax.Array | None, *, temperature: float = 0.0,
           top_k: int | None = None, top_p: float | None = None) -> Int[Array, " batch"]:
    """int32 next tokens: ``argmax`` when ``temperature == 0``, else a draw from
    ``softmax(filter_logits(logits / temperature, top_k, top_p))`` with ``key``."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    filtered = filter_logits(logits.astype(jnp.float32) / temperature, top_k, top_p)
    return jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)


__all__ = ["check_sampling", "filter_logits", "sample"]
