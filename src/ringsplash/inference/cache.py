"""``KVCache``: every layer's keys and values for a batch of sequences, laid out along the sequence
so that a mesh's ``context`` axis can shard it.

The cache has ``max_len`` slots per row. Slot ``i`` holds the token at original position
``slot_positions[i]`` (a layout permutation, ``ringsplash.layouts``: ``"contiguous"`` = slot ``i``
holds position ``i``); with a mesh, device ``d`` of the context axis holds the slots
``d * max_len / shards .. (d + 1) * max_len / shards - 1``, so the token at position ``p`` lives on
the device that owns slot ``inverse(p)``. ``lengths[b]`` tokens of row ``b`` are in the cache
(positions ``0 .. lengths[b] - 1``); the other slots hold stale values no query attends.

Which model and mesh a cache belongs to are static fields, checked by ``check_cache``.
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ringsplash import layouts
from ringsplash._internal.types import Array, Float, Int
from ringsplash.inference.checks import as_count
from ringsplash.model import TransformerConfig

#: the config fields a cache depends on (shapes, masks, RoPE); the strategy fields do not matter
MODEL_FIELDS = ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "v_head_dim",
                "compute_dtype", "mask", "local_window", "chunk_size", "rope_theta")
#: the ``features`` fields a cache depends on
FEATURE_FIELDS = ("layer_types", "sliding_window", "local_rope_theta", "rope_scaling")
#: the named masks decoding supports: causal ones, where later (padding) tokens never reach earlier ones
DECODE_MASKS = ("causal", "local", "chunked")
#: RoPE scalings whose frequencies depend on the current length: not supported by decoding
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def model_key(config: TransformerConfig) -> tuple:
    """What must agree between a cache and the model decoding with it."""
    return (tuple((name, getattr(config, name)) for name in MODEL_FIELDS)
            + tuple((name, getattr(config.features, name)) for name in FEATURE_FIELDS))


def check_decodable(config: TransformerConfig) -> None:
    """The model options decoding supports (causal masks, RoPE independent of the current length)."""
    if not isinstance(config.mask, str) or config.mask not in DECODE_MASKS:
        raise ValueError(f"decoding with a KV cache needs a causal mask, one of {DECODE_MASKS} (or layer_types), "
                         f"got mask={config.mask!r}")
    scaling = config.features.rope_scaling
    if scaling is not None and scaling.type in LENGTH_DEPENDENT_ROPE:
        raise ValueError(f"decoding does not support rope_scaling of type {scaling.type!r} (its "
                         f"frequencies change with the current length); supported: every other type")


class KVCache(eqx.Module):
    """Keys and values of every layer (``k``, ``v``: ``[layers, batch, kv_heads, max_len, head_dim]``
    in the compute dtype), ``lengths`` (int32 ``[batch]``: tokens cached per row) and
    ``slot_positions`` (int32 ``[max_len]``: the original position each slot holds)."""

    k: Float[Array, "layers batch kv_heads max_len d"]
    v: Float[Array, "layers batch kv_heads max_len dv"]
    lengths: Int[Array, " batch"]
    slot_positions: Int[Array, " max_len"]
    model: tuple = eqx.field(static=True)  # model_key(config)
    layout: str = eqx.field(static=True)
    mesh: Mesh | None = eqx.field(static=True)
    axis_name: str | None = eqx.field(static=True)

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def shards(self) -> int:
        return 1 if self.mesh is None else int(self.mesh.shape[self.axis_name])

    def nbytes(self) -> int:
        """Bytes of the keys and values (all devices together)."""
        return self.k.size * self.k.dtype.itemsize + self.v.size * self.v.dtype.itemsize


def cache_specs(axis_name: str | None) -> tuple[P, P, P, P]:
    """``PartitionSpec`` s of a cache's ``(k, v, lengths, slot_positions)``: the slots over ``axis_name``."""
    kv = P(None, None, None, axis_name)  # no trailing None: the spec jit gives outputs, so cache hits
    return kv, kv, P(), P(axis_name)


def check_mesh(mesh: Mesh | None, axis_name: str) -> int:
    """Devices on the context axis of ``mesh`` (1 without a mesh)."""
    if mesh is None:
        return 1
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh or None, got {type(mesh).__name__}")
    if axis_name not in mesh.shape:
        raise ValueError(f"mesh must have the context axis {axis_name!r} the cache is sharded over, "
                         f"got mesh axes {tuple(mesh.shape)}")
    return int(mesh.shape[axis_name])


def slot_positions(layout: str, max_len: int, shards: int) -> np.ndarray:
    """int32 ``[max_len]``: the original position held by each cache slot."""
    return np.asarray(layouts.permutation(layout, max_len, shards), np.int32)


def empty_cache(config: TransformerConfig, batch: int, max_len: int, *, mesh: Mesh | None = None,
                axis_name: str = "context", layout: str = "contiguous") -> KVCache:
    """A zeroed cache (lengths 0) of ``max_len`` slots per row, sharded over ``axis_name`` of ``mesh``."""
    check_decodable(config)
    batch, max_len = as_count("batch", batch, 1), as_count("max_len", max_len, 1)
    shards = check_mesh(mesh, axis_name)
    if max_len % shards:
        raise ValueError(f"max_len={max_len} must be divisible by the {shards} devices of mesh axis {axis_name!r}")
    c = config
    from ringsplash.model.config import dtype_of

    dt = dtype_of(c.compute_dtype)
    k = jnp.zeros((c.num_layers, batch, c.num_kv_heads, max_len, c.head_dim), dt)
    v = jnp.zeros((c.num_layers, batch, c.num_kv_heads, max_len, c.v_head_dim), dt)
    cache = KVCache(k, v, jnp.zeros((batch,), jnp.int32), jnp.asarray(slot_positions(layout, max_len, shards)),
                    model_key(c), layout, mesh, axis_name if mesh is not None else None)
    return place(cache)


def place(cache: KVCache) -> KVCache:
    """The cache's arrays put into their shardings on its mesh (unchanged without a mesh)."""
    if cache.mesh is None:
        return cache
    specs = cache_specs(cache.axis_name)
    arrays = (cache.k, cache.v, cache.lengths, cache.slot_positions)
    placed = [jax.device_put(a, NamedSharding(cache.mesh, s)) for a, s in zip(arrays, specs)]
    return dataclasses.replace(cache, k=placed[0], v=placed[1], lengths=placed[2], slot_positions=placed[3])


def check_cache(cache: KVCache, config: TransformerConfig, mesh: Mesh | None = None, *,
                check_mesh_arg: bool = False) -> None:
    """``cache`` was built for a model of ``config`` (and, with ``check_mesh_arg``, for ``mesh``)."""
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a ringsplash.inference.KVCache, got {type(cache).__name__}")
    mine, theirs = dict(model_key(config)), dict(cache.model)
    diff = [f"{k}: cache {theirs.get(k)!r} vs model {v!r}" for k, v in mine.items() if theirs.get(k) != v]
    if diff:
        raise ValueError(f"the cache was built for another model ({'; '.join(diff)}): build it with this model's "
                         f"prefill")
    if check_mesh_arg and mesh != cache.mesh:
        raise ValueError(f"the cache was built for mesh={cache.mesh!r}, not mesh={mesh!r}: pass the mesh the "
                         f"cache was prefilled on")


__all__ = ["KVCache", "check_cache", "check_decodable", "empty_cache", "model_key", "slot_positions"]
