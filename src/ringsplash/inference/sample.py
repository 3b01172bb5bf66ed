"""Choosing the next token from logits: greedy, or sampling with temperature, top-k and top-p
(applied in that order, as transformers' logits processors do)."""

import math
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ringsplash._internal.scalar_checks import as_scalar
from ringsplash._internal.types import Array, Float, Int
from ringsplash.inference.checks import check_key, is_int

#: temperatures below this (float32's smallest normal number, 2**-126) sample as greedy. Below it the temperature
#: is not a normal float32: the device flushes it to 0 (a division by zero: NaN / inf logits, then garbage
#: tokens), and the distribution it asks for already is the argmax's: the runner-up's probability is
#: ``exp(-gap / temperature)``, 0 in float32 for any logit gap above ~1e-36. At or above it, ``sample`` divides
#: the max-subtracted logits, so the best token's scaled logit is 0 and no other's is above it (at worst
#: ``-inf``, probability 0): never ``+inf`` or NaN, however small the temperature (its reciprocal, <= 2**126,
#: is a finite float32 too, should the compiler multiply by it).
GREEDY_BELOW = float(np.finfo(np.float32).tiny)


class Sampling(NamedTuple):
    """Checked sampling settings as Python numbers (``temperature`` 0.0: greedy)."""

    temperature: float
    top_k: int | None
    top_p: float | None


def check_sampling(temperature, top_k, top_p) -> Sampling:
    """``temperature`` a finite number >= 0 (below ``GREEDY_BELOW``: 0, greedy), ``top_k`` None or an int >= 1,
    ``top_p`` None or in ``(0, 1]``; Python, NumPy or concrete 0-d JAX numbers, returned as Python ones."""
    temperature, top_p = as_scalar(temperature), as_scalar(top_p)
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not 0 <= temperature < math.inf:
        raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature=}")
    if top_k is not None and (not is_int(top_k) or as_scalar(top_k) < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k=}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be None or in (0, 1], got {top_p=}")
    temperature = float(temperature)
    return Sampling(0.0 if temperature < GREEDY_BELOW else temperature,
                    None if top_k is None else int(as_scalar(top_k)), None if top_p is None else float(top_p))


def filter_logits(logits: Float[Array, "*batch vocab"], top_k: int | None = None,
                  top_p: float | None = None) -> Float[Array, "*batch vocab"]:
    """``logits`` with ``-inf`` outside the kept tokens.

    ``top_k``: the ``top_k`` largest logits are kept (with any tied with the k-th). ``top_p``: the
    smallest set of most probable tokens whose probability (softmax of the logits given, after
    ``top_k``) reaches ``top_p`` is kept: a token is kept when the probability of the tokens
    ranked before it is below ``top_p`` (the most probable always is). ``top_p=0`` (nothing kept: every
    logit ``-inf``) and ``top_k=0`` are refused."""
    _, top_k, top_p = check_sampling(0, top_k, top_p)
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
    """int32 next tokens: ``argmax`` when ``temperature`` is 0 (or below ``GREEDY_BELOW``), else a draw from
    ``softmax(filter_logits(logits / temperature, top_k, top_p))`` with ``key`` (the logits' maximum is
    subtracted first, which leaves the softmax as it is and keeps a tiny temperature from overflowing).
    The settings are checked as ``generate`` checks them (a negative temperature would sample the least likely
    tokens)."""
    temperature, top_k, top_p = check_sampling(temperature, top_k, top_p)
    key = check_key(key, temperature)
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32)
    scaled = (logits - jnp.max(logits, axis=-1, keepdims=True)) / temperature
    filtered = filter_logits(scaled, top_k, top_p)
    return jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)


__all__ = ["GREEDY_BELOW", "Sampling", "check_sampling", "filter_logits", "sample"]
