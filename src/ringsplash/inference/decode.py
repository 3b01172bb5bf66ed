"""``decode_step``: one new token per row against a ``KVCache`` sharded along the sequence.

Each device of the context axis attends its own slots of the cache (the model's projections,
norms and RoPE: ``Attention.project_qkv`` / ``project_out``, with the batch where the blocks take
the sequence; the reference's arithmetic on one query per row, ``_local_partial``) and returns a partial
output and its log-sum-exp; one ``all_gather`` of those (``[heads, batch, dv + 1]`` floats) per layer and
the online-softmax
``merge`` (``ringsplash._internal.softmax``) give the exact attention over the whole cache, no key or value
moves. The new token attends itself as one more partial, merged once; sinks join at the end
(``fold_sinks``). After the layers, the new token's keys and values are written into the slot
that holds its position, on the device that owns that slot.

``decode_steps``: several steps as one program on a cache without a mesh (the cache read-only
until one write at the end, the new tokens' keys and values attended from a side buffer).

On one device with the contiguous layout, the cache is read by the Pallas kernel of ``decode_kernel.py``
when JAX's default backend is a TPU (``DECODE_ATTENTION``): it reads only the cache blocks that hold visible
slots, so a bucket's padding costs no bandwidth. Elsewhere (the CPU, a mesh, another layout, a mask other than
causal / local / chunked) XLA reads every slot, masked.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import checkify
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ringsplash import layouts, masks
from ringsplash._internal.scalar_checks import as_scalar
from ringsplash._internal.softmax import MASKED_LSE, fold_sinks, merge
from ringsplash._internal.types import Array, Bool, Float, Int
from ringsplash.inference.cache import KVCache, cache_specs, check_cache
from ringsplash.inference.checks import check_model, is_int
from ringsplash.inference.decode_kernel import NUM_LANES, decode_attention
from ringsplash.model import Transformer, layer_segments
from ringsplash.model.transformer import run_segment

_F32 = jnp.float32
#: ``decode_step`` on one device (a cache without a mesh) unrolls its layer loop for models of at most this
#: many layers (0: never). A scanned loop slices each layer's weights out of the stacked arrays at run time
#: and copies some of them (about 0.07 ms of a 3.6 ms step in a v5e profile); unrolled, the slices are static
#: and the weights are read in place. The compile grows with the layers, hence the bound; a sharded cache keeps
#: the loop (an 8B model's step over 64 chips compiled in 77 s unrolled). On a v5e chip, GQA 8:2 at 32K
#: batch 8: 3.581 ms per step unrolled, 3.623 scanned (CHANGELOG.md, `b00b902`).
UNROLL_LAYERS_UP_TO = 64
#: what reads the cache in a step on one device (no mesh, the contiguous layout, a cache of whole 128-slot lanes,
#: a causal / local / chunked mask): ``"auto"``: the Pallas kernel (``decode_kernel.decode_attention``: only the
#: blocks that hold visible slots) when ``jax.default_backend()`` is ``"tpu"``, else XLA (every slot, masked);
#: ``"kernel"``: the kernel, for a TPU (what an ahead-of-time compile for a TPU target from a CPU host needs);
#: ``"interpret"``: the kernel in the Pallas TPU interpreter (the CPU tests); ``"xla"``: XLA. Read when a step
#: is traced: a program compiled before a change keeps what it was traced with.
DECODE_ATTENTION: Literal["auto", "kernel", "interpret", "xla"] = "auto"
_MODES = ("auto", "kernel", "interpret", "xla")


def _kernel_mode(max_len: int):
    """None: XLA reads the cache; else the kernel does, the value its ``interpret`` (False, or the TPU
    interpreter's ``InterpretParams``)."""
    if DECODE_ATTENTION not in _MODES:
        raise ValueError(f"ringsplash.inference.decode.DECODE_ATTENTION must be one of {_MODES}, got "
                         f"{DECODE_ATTENTION!r}")
    mode = DECODE_ATTENTION
    if mode == "auto":
        mode = "kernel" if jax.default_backend() == "tpu" else "xla"
    if mode == "xla" or max_len % NUM_LANES:
        return None
    return pltpu.InterpretParams() if mode == "interpret" else False


def decode_step(
    model: Transformer, cache: KVCache, tokens: Int[Array, " batch"], *, mesh: Mesh | str | None = "cache"
) -> tuple[Float[Array, "batch vocab"], KVCache]:
    """Feed one token per row at position ``cache.lengths``: float32 logits of the next token
    (``final_logit_soft_cap`` applied) and the cache with the token's keys and values written and
    ``lengths + 1``. Traceable (``jax.jit`` it; ``generate`` does); on the cache's mesh it runs
    inside ``shard_map`` over the cache's context axis. ``mesh``: the mesh the caller means (checked
    against the cache's; the default takes the cache's).

    A full cache (a row with ``lengths == cache.max_len``: no slot left for the token), a row at the
    model's ``max_seq_len`` (no position left: ``model()`` refuses longer sequences) and a token id outside
    the vocabulary are never silently wrong: with concrete ``cache.lengths`` / ``tokens`` they are refused
    (``ValueError``); under ``jit`` that row's logits are NaN, and under
    ``jax.experimental.checkify.checkify`` the step reports a failed check naming the lengths or tokens
    (``checkify.checkify(jax.jit(decode_step))``)."""
    check_model(model, "decode_step")
    check_cache(cache, model.config, None if mesh == "cache" else mesh, check_mesh_arg=mesh != "cache")
    tokens = _check_tokens(tokens, cache, model.config.vocab_size)
    room = _check_room(cache, model.config.max_seq_len)
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
    # a full row's logits, or an unknown token's, would be wrong: NaN, never silent
    logits = jnp.where((room & _known(tokens, model.config.vocab_size))[:, None], logits, jnp.nan)
    return logits, dataclasses.replace(cache, k=k, v=v, lengths=cache.lengths + 1)


def _check_tokens(tokens, cache: KVCache, vocab_size: int):
    """One integer token id in ``[0, vocab_size)`` per cached row (ids read when concrete), or a clear error;
    the tokens (a NumPy array as a JAX one)."""
    if getattr(tokens, "shape", None) != (cache.batch,):
        raise ValueError(f"tokens must be int [batch={cache.batch}] (one new token per cached row), got "
                         f"tokens.shape={getattr(tokens, 'shape', type(tokens).__name__)}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"tokens must be integer token ids, got tokens.dtype={tokens.dtype}")
    if not isinstance(tokens, jax.core.Tracer):  # an id outside the table would read a clamped row: refused
        ids = np.asarray(tokens)
        bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
        if bad.size:
            raise ValueError(f"tokens must be token ids in [0, vocab_size={vocab_size}), got tokens={ids.tolist()} "
                             f"(row(s) {bad.tolist()} outside)")
    return jnp.asarray(tokens)


def _known(tokens, vocab_size: int) -> Bool[Array, " batch"]:
    """Whether each token id is in ``[0, vocab_size)`` (concrete ids were refused by ``_check_tokens``)."""
    # the rows' logits are NaN; no checkify check of its own here: beside the room check, a second
    # debug_check broke checkify's error reduction for a cache sharded over a mesh (docs/inference.md's example)
    return (tokens >= 0) & (tokens < vocab_size)


def _check_room(cache: KVCache, max_seq_len: int) -> Bool[Array, " batch"]:
    """Whether each row has a free slot and a position below the model's ``max_seq_len``: refused if not when
    the lengths are concrete; under a trace a ``checkify.debug_check`` (reported under ``checkify.checkify``,
    free otherwise)."""
    if not isinstance(cache.lengths, jax.core.Tracer):
        lengths = np.asarray(cache.lengths)
        full = np.flatnonzero(lengths >= cache.max_len)
        if full.size:
            raise ValueError(f"decode_step: the cache is full: row(s) {full.tolist()} already hold "
                             f"cache.max_len={cache.max_len} tokens (cache.lengths={lengths.tolist()}), no slot is "
                             f"left for the new token; prefill with a larger max_len")
        past = np.flatnonzero(lengths >= max_seq_len)
        if past.size:
            raise ValueError(f"decode_step: row(s) {past.tolist()} already hold the model's max_seq_len="
                             f"{max_seq_len} tokens (cache.lengths={lengths.tolist()}): a new token would be past "
                             f"it, which the model refuses; build the model with a larger max_seq_len")
    room = cache.lengths < min(cache.max_len, max_seq_len)
    checkify.debug_check(jnp.all(room), f"decode_step: the cache is full: a row's cache.lengths reached "
                         f"cache.max_len={cache.max_len} (no slot left for the new token), or the model's "
                         f"max_seq_len={max_seq_len} (its logits are NaN): cache.lengths={{lengths}}",
                         lengths=cache.lengths)
    return room


def _local_step(params, k_cache, v_cache, lengths, slot_positions, tokens, *, static, layout: str, max_len: int,
                shards: int, axis_name: str | None):
    """One device's step on its cache slots ``[layers, batch, kv_heads, local_len, d]``: the logits (the
    same on every device) and its updated slots."""
    kernel = _kernel_mode(max_len) if axis_name is None and layout == "contiguous" else None
    logits, new_k, new_v = _layers(eqx.combine(params, static), k_cache, v_cache, lengths, slot_positions, tokens,
                                   lengths, None, max_len=max_len, axis_name=axis_name, kernel=kernel)
    # the slot of each row's new position; a device that does not own it writes out of bounds (dropped)
    local_len = k_cache.shape[3]
    slot = lengths if layout == "contiguous" else jnp.asarray(
        layouts.inverse_permutation(layout, max_len, shards))[lengths]
    local = slot - (0 if axis_name is None else lax.axis_index(axis_name) * local_len)
    local = jnp.where((local >= 0) & (local < local_len), local, local_len)
    rows = jnp.arange(tokens.shape[0])

    def write(cache, new):  # new: [layers, kv_heads, batch, d] -> cache[:, b, :, local[b]]
        return cache.at[:, rows, :, local].set(new.transpose(2, 0, 1, 3).astype(cache.dtype), mode="drop")

    return logits, write(k_cache, new_k), write(v_cache, new_v)


def _layers(model, k_cache, v_cache, lengths, slot_positions, tokens, positions, pending, *, max_len: int,
            axis_name: str | None, kernel=None):
    """The layers on one new token per row at ``positions``: its logits and keys / values ``[layers, kv_heads,
    batch, d]``. Each row attends the cache's slots below its ``lengths``, then ``pending`` (None, or the keys and
    values ``[layers, batch, kv_heads, n, d]`` of the row's n tokens fed earlier in the same program, not yet in
    the cache), then itself. The batch rides where the model's blocks take the sequence (projections, norms,
    RoPE and MLP act per token), so no array is transposed or vmapped. ``kernel`` (not None: one device, the
    contiguous layout): the cache is read by ``decode_attention`` (``interpret=kernel``) where the layer's mask
    bounds each row's visible slots to one range."""
    c = model.config
    x = model.embed(tokens)
    dynamic, layer_static = eqx.partition(model.layers, eqx.is_array)

    bounds = {kind: None if kernel is None else _slot_range(c.make_mask(max_len, kind), positions, lengths)
              for kind in c.attention_kinds}
    in_kernel = all(b is not None for b in bounds.values())  # else XLA reads every layer's cache

    def step_for(kind):
        mask = c.make_mask(max_len, kind)

        def step(h, xs):
            layer_params, k_layer, v_layer, pending_layer = xs  # in_kernel: k_layer is the layer's index
            layer = eqx.combine(layer_params, layer_static)
            visible = (slot_positions[None] < lengths[:, None]) & mask.mask_function(positions[:, None],
                                                                                     slot_positions[None])

            def attention(module, hn):
                q, k, v = module.project_qkv(hn, positions, rope_len=max_len, layer_type=kind)  # [heads, batch, d]
                if in_kernel:  # the whole cache and the layer's index: the kernel reads the layer in place
                    starts, ends = bounds[kind]
                    o, lse = decode_attention(q.transpose(1, 0, 2), k_cache, v_cache, ends, starts, k_layer,
                                              scale=c.features.attention_scale, soft_cap=c.logit_soft_cap,
                                              interpret=kernel)
                    o, lse = o.transpose(1, 0, 2), lse.T
                else:
                    o, lse = _attend_shards(c, q, k_layer, v_layer, visible, axis_name)
                if pending_layer is not None:
                    pk, pv = pending_layer
                    n = pk.shape[2]
                    pending_pos = positions[:, None] - n + jnp.arange(n)[None]
                    seen = mask.mask_function(positions[:, None], pending_pos)
                    o, lse = merge(o, lse, *_local_partial(q, pk, pv, seen, c.features.attention_scale,
                                                           c.logit_soft_cap))
                o, lse = merge(o, lse, *_self_partial(c, q, k, v))
                o, _ = fold_sinks(o, lse, module.sinks)
                return module.project_out(o.astype(q.dtype)), (k, v)

            return layer.apply(h, attention)

        return step

    steps = {kind: step_for(kind) for kind in c.attention_kinds}
    new_k, new_v = [], []
    for seg in layer_segments(c.features.layer_types, c.num_layers):
        layer_ids = jnp.arange(c.num_layers, dtype=jnp.int32)
        xs = (dynamic, layer_ids, layer_ids, pending) if in_kernel else (dynamic, k_cache, v_cache, pending)
        x, (k_new, v_new) = run_segment(seg, steps, x, xs, c.num_layers,
                                        unroll=axis_name is None and c.num_layers <= UNROLL_LAYERS_UP_TO)
        new_k.append(k_new)
        new_v.append(v_new)
    return model.logits(model.final_norm(x)), jnp.concatenate(new_k), jnp.concatenate(new_v)


class Decoded(NamedTuple):
    """What ``decode_steps`` returns: the chosen tokens ``[steps, batch]``, the last step's float32 logits,
    the cache with ``lengths + steps`` and ``choose``'s carry after the last step."""

    tokens: Int[Array, "steps batch"]
    logits: Float[Array, "batch vocab"]
    cache: KVCache
    carry: Any = None


def greedy(logits, step, carry):
    """``decode_steps``' default ``choose``: the most likely token, the carry unchanged."""
    return jnp.argmax(logits, -1).astype(jnp.int32), carry


def decode_steps(model: Transformer, cache: KVCache, tokens: Int[Array, " batch"], steps: int | np.integer | jax.Array,
                 choose: Callable = greedy, carry: Any = None) -> Decoded:
    """``steps`` decode steps as one program (jit it), on a cache without a mesh: each step feeds one token per
    row, and ``choose(logits, step, carry) -> (next tokens, carry)`` picks the next from its float32 logits
    (default ``greedy``; ``generate`` samples and tracks stop tokens in the carry).

    The same tokens as ``steps`` ``decode_step`` calls, with one program launch instead of ``steps``. The cache is
    only read inside the program: the new tokens' keys and values wait in a side buffer, which each later step
    attends to, and are written once at the end. (Written after every step, as ``steps`` ``decode_step`` calls in
    one program would, XLA's compile for v5e copies the whole cache each step.) On a v5e chip, GQA 8:2 at 32K
    batch 8: 3.497 ms per token at 4 steps per program, 3.585 one step per program (CHANGELOG.md, `c6a963f`).
    A row without room for all ``steps`` tokens is refused (``ValueError``) when the lengths are concrete; under
    ``jit`` it gets NaN logits from the step that finds no slot on (its keys and values are dropped)."""
    check_model(model, "decode_steps")
    check_cache(cache, model.config)
    if cache.mesh is not None or cache.layout != "contiguous":
        raise ValueError(f"decode_steps: a cache without a mesh and with the contiguous layout is supported, got "
                         f"mesh={cache.mesh}, layout={cache.layout!r}; use decode_step")
    if not is_int(steps) or as_scalar(steps) < 1:
        raise ValueError(f"decode_steps: steps must be a positive int, got {steps!r}")
    steps = int(as_scalar(steps))
    tokens = _check_tokens(tokens, cache, model.config.vocab_size)
    k_cache, v_cache, lengths = cache.k, cache.v, cache.lengths
    layers, batch, kv_heads, max_len = k_cache.shape[:4]
    limit = min(max_len, model.config.max_seq_len)  # the last position + 1 a step may feed
    if not isinstance(lengths, jax.core.Tracer):  # as decode_step: concrete lengths without room are refused
        held = np.asarray(lengths)
        short = np.flatnonzero(held + steps > max_len)
        if short.size:
            raise ValueError(f"decode_steps: no room for steps={steps} more tokens in row(s) {short.tolist()} "
                             f"(cache.lengths={held.tolist()}, cache.max_len={max_len}); prefill with a larger "
                             f"max_len or take fewer steps")
        past = np.flatnonzero(held + steps > limit)
        if past.size:
            raise ValueError(f"decode_steps: steps={steps} more tokens in row(s) {past.tolist()} (cache.lengths="
                             f"{held.tolist()}) would go past the model's max_seq_len={model.config.max_seq_len}; "
                             f"take fewer steps")
    known = _known(tokens, model.config.vocab_size)
    kernel = _kernel_mode(max_len)
    side_k = jnp.zeros((layers, batch, kv_heads, 0, k_cache.shape[4]), k_cache.dtype)
    side_v = jnp.zeros((layers, batch, kv_heads, 0, v_cache.shape[4]), v_cache.dtype)
    chosen = []
    for step in range(int(steps)):  # unrolled: the side buffer grows by one slot a step
        positions = lengths + step
        logits, k_new, v_new = _layers(model, k_cache, v_cache, lengths, cache.slot_positions, tokens, positions,
                                       None if step == 0 else (side_k, side_v), max_len=max_len, axis_name=None,
                                       kernel=kernel)
        # no slot or position (or an unknown first token): NaN, never silent
        logits = jnp.where(((positions < limit) & known)[:, None], logits, jnp.nan)
        # [layers, kv_heads, batch, d] -> one more slot of [layers, batch, kv_heads, slots, d]
        side_k = jnp.concatenate([side_k, k_new.transpose(0, 2, 1, 3)[:, :, :, None].astype(side_k.dtype)], axis=3)
        side_v = jnp.concatenate([side_v, v_new.transpose(0, 2, 1, 3)[:, :, :, None].astype(side_v.dtype)], axis=3)
        tokens, carry = choose(logits, step, carry)
        chosen.append(tokens)
    new_cache = dataclasses.replace(cache, k=_write_side(k_cache, side_k, lengths),
                                    v=_write_side(v_cache, side_v, lengths), lengths=lengths + steps)
    return Decoded(jnp.stack(chosen), logits, new_cache, carry)


def _write_side(cache_arr, side, lengths):
    """``cache_arr [layers, batch, kv_heads, max_len, d]`` with each row's ``side [layers, batch, kv_heads, steps,
    d]`` written at slots ``lengths[b] .. lengths[b] + steps - 1`` (slots past ``max_len`` dropped).

    Several rows: one scatter over the batch and slot axes, which XLA's compile for v5e does in place on the
    donated cache. One row: a ``dynamic_update_slice`` of ``steps`` slots, since there the scatter made XLA lay
    the whole cache out again and back around the write: two copies of the cache per program (at 8 rows a
    slice per row made it do the same; 2026-12-07). A row without room for all ``steps`` gets a window clamped
    to the cache's end, its slots before ``lengths[0]`` rewritten as they were."""
    max_len, steps = cache_arr.shape[3], side.shape[3]
    if steps > max_len or side.shape[1] > 1:
        slots = lengths[:, None] + jnp.arange(steps)[None]
        rows = jnp.arange(side.shape[1])[:, None]
        return cache_arr.at[:, rows, :, jnp.where(slots < max_len, slots, max_len)].set(
            side.transpose(1, 3, 0, 2, 4).astype(cache_arr.dtype), mode="drop")
    zero = jnp.int32(0)
    start = jnp.clip(lengths[0], 0, max_len - steps).astype(jnp.int32)
    index = (zero, zero, zero, start, zero)
    old = lax.dynamic_slice(cache_arr, index, (*cache_arr.shape[:3], steps, cache_arr.shape[4]))
    source = jnp.arange(steps) - (lengths[0] - start)  # the side slot each window slot takes (< 0: kept)
    new = jnp.take(side, jnp.clip(source, 0, steps - 1), axis=3).astype(cache_arr.dtype)
    return lax.dynamic_update_slice(cache_arr, jnp.where((source >= 0)[:, None], new, old), index)


def _slot_range(mask, positions, lengths):
    """``(starts, ends)`` int32 ``[batch]``: the contiguous cache slots ``starts <= slot < ends`` a query at
    ``positions`` sees among the ``lengths`` cached, for a causal, local or chunked mask (None for another mask:
    XLA reads the cache then)."""
    kind = type(mask)
    if kind is masks.CausalMask:
        return jnp.zeros_like(lengths), jnp.minimum(lengths, positions + mask.offset + 1)
    if kind is masks.LocalMask:
        left, right = mask.window
        p = positions + mask.offset
        starts = jnp.zeros_like(lengths) if left is None else jnp.maximum(p - left, 0)
        return starts, lengths if right is None else jnp.minimum(lengths, p + right + 1)
    if kind is masks.ChunkedCausalMask:
        return positions // mask.chunk_size * mask.chunk_size, jnp.minimum(lengths, positions + 1)
    return None


def _self_partial(c, q, k, v):
    """Float32 ``(o, lse)`` of each row's query over its own new key: ``o = v``, ``lse`` its logit."""
    kv_heads = k.shape[0]
    qg = q.reshape(kv_heads, -1, *q.shape[1:])  # [kv_heads, group, batch, d]
    s = jnp.einsum("hgbd,hbd->hgb", qg, k, preferred_element_type=_F32)
    s = s * (q.shape[-1] ** -0.5 if c.features.attention_scale is None else c.features.attention_scale)
    if c.logit_soft_cap is not None:
        s = c.logit_soft_cap * jnp.tanh(s / c.logit_soft_cap)
    o = jnp.broadcast_to(v.astype(_F32)[:, None], (*qg.shape[:3], v.shape[-1]))
    return o.reshape(q.shape[0], q.shape[1], v.shape[-1]), s.reshape(q.shape[0], q.shape[1])


def _attend_shards(c, q, k_local, v_local, visible, axis_name: str | None):
    """Float32 ``(o [heads, batch, dv], lse [heads, batch])`` of ``q`` over the visible slots of every
    device's cache shard: local partials, one all-gather, merged."""
    o, lse = _local_partial(q, k_local, v_local, visible, c.features.attention_scale, c.logit_soft_cap)
    if axis_name is None:
        return o, lse
    packed = lax.all_gather(jnp.concatenate([o, lse[..., None]], axis=-1), axis_name)  # [shards, heads, batch, dv+1]
    o, lse = packed[0, ..., :-1], packed[0, ..., -1]
    for i in range(1, packed.shape[0]):
        o, lse = merge(o, lse, packed[i, ..., :-1], packed[i, ..., -1])
    return o, lse


def _local_partial(q: Float[Array, "heads batch d"], k: Float[Array, "batch kv_heads slots d"],
                   v: Float[Array, "batch kv_heads slots dv"], visible, scale: float | None, cap: float | None):
    """Float32 ``(o [heads, batch, dv], lse [heads, batch])`` of each row's query over its ``visible``
    slots ``[batch, slots]``: the oracle's arithmetic (``reference_attention``: scale, soft-cap,
    max-subtracted exp; a row with nothing visible gives ``o = 0``, ``lse = MASKED_LSE``) without its
    masked copy of K and V: stale slots hold finite values (prefill padding or earlier writes), and the
    scores, not the values, are masked."""
    heads, batch, d = q.shape
    kv_heads = k.shape[1]
    scale = d**-0.5 if scale is None else scale
    qg = q.reshape(kv_heads, heads // kv_heads, batch, d)
    s = jnp.einsum("hgbd,bhkd->bhgk", qg, k, preferred_element_type=_F32) * scale
    if cap is not None:
        s = cap * jnp.tanh(s / cap)
    s = jnp.where(visible[:, None, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=-1)
    pv = jnp.einsum("bhgk,bhkd->bhgd", p.astype(v.dtype), v, preferred_element_type=_F32)
    safe = jnp.where(l == 0, 1.0, l)
    o = (pv / safe[..., None]).reshape(batch, heads, v.shape[-1]).transpose(1, 0, 2)
    lse = jnp.where(l == 0, MASKED_LSE, m[..., 0] + jnp.log(safe)).reshape(batch, heads).T
    return o, lse


__all__ = ["Decoded", "decode_step", "decode_steps", "greedy"]
