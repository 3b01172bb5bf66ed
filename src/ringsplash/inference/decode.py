"""``decode_step``: one new token per row against a ``KVCache`` sharded along the sequence.

Each device of the context axis attends its own slots of the cache (the model's projections,
norms and RoPE: ``Attention.project_qkv`` / ``project_out``; the oracle's softmax,
``reference_attention``, on one query) and returns a partial output and its log-sum-exp; one
``all_gather`` of those (``[heads, dv + 1]`` floats per row and layer) per layer and the online-softmax
``merge`` (``ringsplash._softmax``) give the exact attention over the whole cache, no key or value
moves. The new token attends itself as one more partial, merged once; sinks join at the end
(``fold_sinks``). After the layers, the new token's keys and values are written into the slot
that holds its position, on the device that owns that slot.
"""

import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ringsplash import layouts
from ringsplash._softmax import fold_sinks, merge
from ringsplash._types import Array, Float, Int
from ringsplash.inference.cache import KVCache, cache_specs, check_cache
from ringsplash.model import Transformer, layer_segments
from ringsplash.model.transformer import run_segment
from ringsplash.reference import reference_attention
from ringsplash.segment_ids import SegmentIds

_F32 = jnp.float32


def decode_step(
    model: Transformer, cache: KVCache, tokens: Int[Array, " batch"], *, mesh: Mesh | str | None = "cache"
) -> tuple[Float[Array, "batch vocab"], KVCache]:
    """Feed one token per row at position ``cache.lengths``: float32 logits of the next token
    (``final_logit_soft_cap`` applied) and the cache with the token's keys and values written and
    ``lengths + 1``. Traceable (``jax.jit`` it; ``generate`` does); on the cache's mesh it runs
    inside ``shard_map`` over the cache's context axis. ``mesh``: the mesh the caller means (checked
    against the cache's; the default takes the cache's). The caller keeps every row's
    ``lengths`` below ``cache.max_len`` (``generate`` sizes the cache so)."""
    check_cache(cache, model.config, None if mesh == "cache" else mesh, check_mesh_arg=mesh != "cache")
    if tokens.shape != (cache.batch,):
        raise ValueError(f"tokens must be [batch={cache.batch}] (one new token per cached row), got "
                         f"tokens.shape={tokens.shape}")
    params, static = eqx.partition(model, eqx.is_array)
    body = functools.partial(_local_step, static=static, layout=cache.layout, max_len=cache.max_len,
                             shards=cache.shards, axis_name=cache.axis_name)
    args = (params, cache.k, cache.v, cache.lengths, cache.slot_positions, tokens)
    if cache.mesh is None:
        logits, k, v = body(*args)
    else:
        kv, _, lengths, slots = cache_specs(cache.axis_name)
        in_specs = (jax.tree.map(lambda _: P(), params), kv, kv, lengths, slots, P())
        logits, k, v = jax.shard_map(body, mesh=cache.mesh, in_specs=in_specs, out_specs=(P(), kv, kv),
                                     check_vma=False)(*args)
    return logits, dataclasses.replace(cache, k=k, v=v, lengths=cache.lengths + 1)


def _local_step(params, k_cache, v_cache, lengths, slot_positions, tokens, *, static, layout: str, max_len: int,
                shards: int, axis_name: str | None):
    """One device's step: its cache slots ``[layers, batch, kv_heads, local_len, d]``; returns the
    logits (the same on every device) and its updated slots."""
    model = eqx.combine(params, static)
    row = functools.partial(_decode_row, model, max_len=max_len, axis_name=axis_name)
    logits, new_k, new_v = jax.vmap(row, in_axes=(1, 1, 0, None, 0))(k_cache, v_cache, lengths, slot_positions,
                                                                      tokens)
    # the slot of each row's new position, and whether this device owns it
    slot = lengths if layout == "contiguous" else jnp.asarray(layouts.inverse_permutation(layout, max_len, shards))[
        lengths]
    local_len = k_cache.shape[3]
    offset = 0 if axis_name is None else lax.axis_index(axis_name) * local_len
    local = slot - offset
    owned = (local >= 0) & (local < local_len)
    write = jax.vmap(_write_slot, in_axes=(1, 0, 0, 0), out_axes=1)
    return logits, write(k_cache, new_k, local, owned), write(v_cache, new_v, local, owned)


def _write_slot(cache_row: Float[Array, "layers kv_heads local_len d"], new: Float[Array, "layers kv_heads d"],
                local, owned) -> Float[Array, "layers kv_heads local_len d"]:
    index = jnp.clip(local, 0, cache_row.shape[2] - 1)
    old = lax.dynamic_slice_in_dim(cache_row, index, 1, axis=2)
    value = jnp.where(owned, new[:, :, None].astype(cache_row.dtype), old)
    return lax.dynamic_update_slice_in_dim(cache_row, value, index, axis=2)


def _decode_row(model: Transformer, k_row, v_row, length, slot_positions, token, *, max_len: int,
                axis_name: str | None):
    """One row: logits ``[vocab]`` and the new token's keys / values ``[layers, kv_heads, d]``."""
    c = model.config
    position = length
    x = model.embed(token[None])
    dynamic, static = eqx.partition(model.layers, eqx.is_array)

    def step_for(kind):
        mask = c.make_mask(max_len, kind)

        def step(h, xs):
            layer_params, k_layer, v_layer = xs
            layer = eqx.combine(layer_params, static)
            visible = (slot_positions < position) & mask.mask_function(position, slot_positions)

            def attention(module, hn):
                q, k, v = module.project_qkv(hn, position[None], rope_len=max_len, layer_type=kind)
                o, lse = _attend_shards(c, q, k_layer, v_layer, visible, axis_name)
                o_self, lse_self = reference_attention(q, k, v, None, scale=c.attention_scale,
                                                       logit_soft_cap=c.logit_soft_cap, return_residuals=True)
                o, lse = merge(o, lse, o_self.astype(_F32), lse_self)
                o, _ = fold_sinks(o, lse, module.sinks)
                return module.project_out(o.astype(q.dtype)), (k[:, 0], v[:, 0])

            return layer.apply(h, attention)

        return step

    steps = {kind: step_for(kind) for kind in c.attention_kinds}
    new_k, new_v = [], []
    for seg in layer_segments(c.layer_types, c.num_layers):
        x, (k_new, v_new) = run_segment(seg, steps, x, (dynamic, k_row, v_row), c.num_layers)
        new_k.append(k_new)
        new_v.append(v_new)
    logits = model.logits(model.final_norm(x))[0]
    return logits, jnp.concatenate(new_k), jnp.concatenate(new_v)


def _attend_shards(c, q, k_local, v_local, visible, axis_name: str | None):
    """Float32 ``(o [heads, 1, dv], lse [heads, 1])`` of ``q`` over the visible slots of every
    device's cache shard: local partials, one all-gather, merged."""
    seg = SegmentIds(q=jnp.ones((1,), jnp.int32), kv=visible.astype(jnp.int32))
    o, lse = reference_attention(q, k_local, v_local, None, segment_ids=seg, scale=c.attention_scale,
                                 logit_soft_cap=c.logit_soft_cap, return_residuals=True)
    o = o.astype(_F32)
    if axis_name is None:
        return o, lse
    packed = lax.all_gather(jnp.concatenate([o, lse[..., None]], axis=-1), axis_name)  # [shards, heads, 1, dv + 1]
    o, lse = packed[0, ..., :-1], packed[0, ..., -1]
    for i in range(1, packed.shape[0]):
        o, lse = merge(o, lse, packed[i, ..., :-1], packed[i, ..., -1])
    return o, lse


__all__ = ["decode_step"]
