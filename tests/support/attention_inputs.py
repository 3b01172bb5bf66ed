"""Shared test inputs: fresh unit-normal attention operands and an error measure."""

import jax
import jax.numpy as jnp


def inputs(key, heads, kv_heads, q_len, kv_len, d=64, dtype=jnp.float32, dv=None):
    """(q, k, v, d_out, sinks), unit-normal, never zeros; sinks float32 ``[heads]``. v and d_out
    have head size ``dv`` (None = ``d``)."""
    dv = d if dv is None else dv
    kq, kk, kv, kd, ks = jax.random.split(key, 5)
    q = jax.random.normal(kq, (heads, q_len, d), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (kv_heads, kv_len, d), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (kv_heads, kv_len, dv), jnp.float32).astype(dtype)
    d_out = jax.random.normal(kd, (heads, q_len, dv), jnp.float32).astype(dtype)
    sinks = jax.random.normal(ks, (heads,), jnp.float32)
    return q, k, v, d_out, sinks


def max_err(a, b) -> float:
    """Max absolute difference, compared in float32 (jax or numpy arrays)."""
    return float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))))
