"""Decoder-only ``Transformer``: embedding → [RMSNorm → attention, RMSNorm → SwiGLU] × L → logits.

Per example: ``model(tokens, positions, segment_ids=None) -> logits``; batch with ``jax.vmap``.
Layers are one stacked ``Block`` (built with ``eqx.filter_vmap``) run by ``lax.scan``, so the
compile time does not grow with depth; ``config.remat`` wraps the scanned block in
``jax.checkpoint``. Under ``attention="ring"`` call it inside ``shard_map`` on the local shard of
layout-ordered tokens with their original positions.
"""

import jax
import jax.numpy as jnp
import equinox as eqx

from ringsplash._types import Array, Float, Int
from ringsplash.model.attention import Attention
from ringsplash.model.config import TransformerConfig, dtype_of


class RMSNorm(eqx.Module):
    weight: Float[Array, "d_model"]
    eps: float = eqx.field(static=True)

    def __init__(self, d_model: int, dtype, eps: float = 1e-6):
        self.weight = jnp.ones((d_model,), dtype)
        self.eps = eps

    def __call__(self, x: Float[Array, "seq d_model"]) -> Float[Array, "seq d_model"]:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf * self.weight.astype(jnp.float32)).astype(x.dtype)


class SwiGLU(eqx.Module):
    w_gate: Float[Array, "d_model hidden"]
    w_up: Float[Array, "d_model hidden"]
    w_down: Float[Array, "hidden d_model"]

    def __init__(self, config: TransformerConfig, *, key: jax.Array):
        c = config
        k1, k2, k3 = jax.random.split(key, 3)
        pdt = dtype_of(c.param_dtype)
        h = c.mlp_hidden
        self.w_gate = (jax.random.normal(k1, (c.d_model, h)) / c.d_model**0.5).astype(pdt)
        self.w_up = (jax.random.normal(k2, (c.d_model, h)) / c.d_model**0.5).astype(pdt)
        self.w_down = (jax.random.normal(k3, (h, c.d_model)) / (h * 2 * c.num_layers) ** 0.5).astype(pdt)

    def __call__(self, x: Float[Array, "seq d_model"]) -> Float[Array, "seq d_model"]:
        dt = x.dtype
        return (jax.nn.silu(x @ self.w_gate.astype(dt)) * (x @ self.w_up.astype(dt))) @ self.w_down.astype(dt)


class Block(eqx.Module):
    attention_norm: RMSNorm
    attention: Attention
    mlp_norm: RMSNorm
    mlp: SwiGLU

    def __init__(self, config: TransformerConfig, *, key: jax.Array):
        ka, km = jax.random.split(key)
        pdt = dtype_of(config.param_dtype)
        self.attention_norm = RMSNorm(config.d_model, pdt)
        self.attention = Attention(config, key=ka)
        self.mlp_norm = RMSNorm(config.d_model, pdt)
        self.mlp = SwiGLU(config, key=km)

    def __call__(
        self,
        x: Float[Array, "seq d_model"],
        positions: Int[Array, "seq"],
        segment_ids: Int[Array, "seq"] | None,
        *,
        key: jax.Array | None = None,
    ) -> Float[Array, "seq d_model"]:
        x = x + self.attention(self.attention_norm(x), positions, segment_ids, key=key).astype(x.dtype)
        return x + self.mlp(self.mlp_norm(x)).astype(x.dtype)


class Transformer(eqx.Module):
    """Embedding, ``num_layers`` stacked blocks, final RMSNorm, unembedding (optionally tied)."""

    embedding: Float[Array, "vocab d_model"]
    layers: Block  # every array leaf has a leading [num_layers] axis
    final_norm: RMSNorm
    unembedding: Float[Array, "d_model vocab"] | None
    config: TransformerConfig = eqx.field(static=True)

    def __init__(self, config: TransformerConfig, *, key: jax.Array):
        if not isinstance(config, TransformerConfig):
            raise TypeError(f"config must be a TransformerConfig, got {type(config).__name__}")
        ke, kl, ku = jax.random.split(key, 3)
        pdt = dtype_of(config.param_dtype)
        self.embedding = jax.random.normal(ke, (config.vocab_size, config.d_model)).astype(pdt)
        self.layers = eqx.filter_vmap(lambda k: Block(config, key=k))(jax.random.split(kl, config.num_layers))
        self.final_norm = RMSNorm(config.d_model, pdt)
        if config.tie_embeddings:
            self.unembedding = None
        else:
            self.unembedding = (
                jax.random.normal(ku, (config.d_model, config.vocab_size)) / config.d_model**0.5
            ).astype(pdt)
        self.config = config

    def __call__(
        self,
        tokens: Int[Array, "seq"],
        positions: Int[Array, "seq"],
        segment_ids: Int[Array, "seq"] | None = None,
        *,
        key: jax.Array | None = None,
    ) -> Float[Array, "seq vocab"]:
        """Float32 logits for one example. ``key`` enables attention dropout (training only)."""
        c = self.config
        cdt = dtype_of(c.compute_dtype)
        x = self.embedding[tokens].astype(cdt)
        dynamic, static = eqx.partition(self.layers, eqx.is_array)

        def step(h, xs):
            layer_params, layer_key = xs
            layer = eqx.combine(layer_params, static)
            return layer(h, positions, segment_ids, key=layer_key), None

        if c.remat:
            step = jax.checkpoint(step)
        keys = None if key is None else jax.random.split(key, c.num_layers)
        x, _ = jax.lax.scan(step, x, (dynamic, keys))
        x = self.final_norm(x)
        w = self.embedding.T / c.d_model**0.5 if self.unembedding is None else self.unembedding
        return (x @ w.astype(cdt)).astype(jnp.float32)

    def with_config(self, config: TransformerConfig) -> "Transformer":
        """These parameters under another config with the same parameter shapes (e.g. another
        attention strategy, ring size or remat setting)."""
        like = eqx.filter_eval_shape(Transformer, config, key=jax.random.key(0))
        leaves, mine = jax.tree.leaves(like), jax.tree.leaves(self)
        shapes = [(x.shape, x.dtype) for x in leaves]
        if shapes != [(x.shape, x.dtype) for x in mine]:
            raise ValueError("with_config needs a config with the same parameter shapes and dtypes")
        return jax.tree.unflatten(jax.tree.structure(like), mine)

    def num_params(self) -> int:
        return sum(x.size for x in jax.tree_util.tree_leaves(eqx.filter(self, eqx.is_array)))
