"""``RMSNorm`` over the last axis, in float32, scaled by ``offset + weight`` (Gemma: offset 1)."""

import equinox as eqx
import jax
import jax.numpy as jnp

from ringsplash._internal.types import Array, Float


class RMSNorm(eqx.Module):
    """``x / rms(x) * (offset + weight)`` computed in float32, returned in ``x``'s dtype; a fresh
    ``weight`` is ``1 - offset``, so a fresh norm scales by 1 whatever the offset."""

    weight: Float[Array, " d_model"]
    eps: float = eqx.field(static=True)
    offset: float = eqx.field(static=True)

    def __init__(self, d_model: int, dtype, eps: float = 1e-6, offset: float = 0.0):
        self.weight = jnp.ones((d_model,), dtype) if offset == 0 else jnp.full((d_model,), 1.0 - offset, dtype)
        self.eps = eps
        self.offset = offset

    def __call__(self, x: Float[Array, "*batch d_model"]) -> Float[Array, "*batch d_model"]:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        w = self.weight.astype(jnp.float32)
        if self.offset != 0:
            w = self.offset + w
        return (xf * w).astype(x.dtype)


__all__ = ["RMSNorm"]
