"""``prefill``: the model over a batch of prompts, filling a ``KVCache`` in its sharded layout.

Each row's prompt (its first ``prompt_lengths[b]`` tokens) is padded with token 0 and run through
the model's own layers (``Block.apply`` with ``Attention.project_qkv``, the strategy's ``attend``,
``project_out``), keeping every layer's keys and values. The masks decoding supports are causal, so
padding never reaches a prompt token; the cache's slots past each row's prompt hold zeros, and
decoding overwrites each before any query sees it. Without a mesh the forward pass runs over
:func:`forward_len` tokens (the prompt rounded up to a length the kernels tile with large blocks; a
cache length such as ``prompt + 128`` would leave the kernels 128-token blocks and a tenth of the
chip's speed), its keys / values cut or zero-padded to the cache's ``max_len`` slots; on a mesh it
runs over ``max_len``, the cache's layout (a ``max_len`` that is a multiple of 1024 per device keeps
the large blocks there). RoPE always reads ``max_len`` as the current length, as decoding does.

Strategy: without a mesh, the model's own single-device strategy (``"reference"`` or
``"splash"``; a sequence-parallel model runs ``"splash"``). With a mesh, the model's strategy when it
is ``"ring"`` / ``"allgather"`` over the mesh's context axis (its ``layout`` is then the
cache's layout), otherwise ``"allgather"`` with the contiguous layout; the tokens are laid out
so each device's local shard of the forward pass is its shard of the cache.
"""

import functools
import math
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ringsplash import layouts
from ringsplash._internal import caches
from ringsplash._internal.types import Array, Float, Int
from ringsplash.inference.cache import KVCache, cache_specs, check_decodable, check_mesh, model_key, place
from ringsplash.inference.checks import as_count, check_flags, check_model
from ringsplash.model import Transformer, TransformerConfig, abstract_model, attend, layer_segments
from ringsplash.model.transformer import run_segment
from ringsplash.splash.config import NUM_LANES

#: tokens of the rows one step of the prefill's forward runs together (a bound on its activations)
ROW_TOKENS = 32768


class Prefilled(NamedTuple):
    """``prefill``'s result: float32 logits (``[batch, vocab]`` of each row's last prompt token, or
    ``[batch, prompt_len, vocab]`` of every prompt position with ``all_logits``) and the filled cache."""

    logits: Float[Array, "batch *positions vocab"]
    cache: KVCache


def check_prompts(tokens, prompt_lengths, vocab_size: int, name: str = "tokens"
                  ) -> tuple[np.ndarray | jax.Array, jax.Array]:
    """Validated ``tokens`` ``[batch, prompt_len]`` and int32 ``prompt_lengths`` ``[batch]`` (None: full rows);
    ``name``: what the caller calls ``tokens`` (the errors name it)."""
    shape = getattr(tokens, "shape", None)
    if shape is None or len(shape) != 2 or shape[1] < 1:
        given = f"shape {shape}" if shape is not None else f"a {type(tokens).__name__}"
        raise ValueError(f"{name} must be an int array [batch, prompt_len] of token ids with prompt_len >= 1, got "
                         f"{given}")
    if shape[0] < 1:
        raise ValueError(f"{name} must hold at least one row (batch >= 1), got {name}.shape={tuple(shape)}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"{name} must be integer token ids, got {name}.dtype={tokens.dtype} (cast with "
                        f".astype(jnp.int32) if the values are ids)")
    if not isinstance(tokens, jax.core.Tracer):
        ids = np.asarray(tokens)
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"{name} must hold token ids in [0, vocab_size={vocab_size}), got ids in [{lo}, {hi}]")
    batch, prompt_len = shape
    if prompt_lengths is None:
        return tokens, jnp.full((batch,), prompt_len, jnp.int32)
    if getattr(prompt_lengths, "shape", None) != (batch,):
        raise ValueError(f"prompt_lengths must be int [batch={batch}], got shape "
                         f"{getattr(prompt_lengths, 'shape', type(prompt_lengths).__name__)}")
    if not jnp.issubdtype(prompt_lengths.dtype, jnp.integer):
        raise TypeError(f"prompt_lengths must be integers (the tokens of each row), got "
                        f"prompt_lengths.dtype={prompt_lengths.dtype}: a fraction would be truncated")
    if not isinstance(prompt_lengths, jax.core.Tracer):
        lengths = np.asarray(prompt_lengths)
        if lengths.min() < 1 or lengths.max() > prompt_len:
            raise ValueError(f"prompt_lengths must be in [1, prompt_len={prompt_len}], got values in "
                             f"[{lengths.min()}, {lengths.max()}]")
    return tokens, jnp.asarray(prompt_lengths, jnp.int32)


def _own_strategy(config: TransformerConfig, shards: int, axis_name: str) -> bool:
    """Whether the model's own strategy shards the sequence over ``axis_name``'s ``shards`` devices."""
    cp = config.context_parallel
    return cp.roles == ("ring",) and cp.ring_axis == axis_name and cp.ring_size == shards


def prefill_config(config: TransformerConfig, max_len: int, mesh: Mesh | None, axis_name: str) -> TransformerConfig:
    """The config the prefill forward runs under (see the module docstring)."""
    shards = check_mesh(mesh, axis_name)
    plain = dict(max_seq_len=max_len, attention_dropout=0.0, qk_clip_threshold=None, remat="none")
    cp = config.context_parallel
    if mesh is None:
        return config.replace(**plain, context_parallel=cp.single_device())
    if _own_strategy(config, shards, axis_name):
        return config.replace(**plain)
    return config.replace(**plain, context_parallel=cp.on_axis(axis_name, shards, "allgather", layout="contiguous"))


def forward_len(prompt_len: int, *, max_waste: float = 1 / 16) -> int:
    """The length a single-device prefill runs its forward pass over: ``prompt_len`` rounded up to
    the largest of 1024, 512, 256, 128 tokens that pads it by at most ``max_waste`` (128 always
    applies: the kernels' lanes), so the Splash kernels tile it with blocks of that size or more."""
    for multiple in (1024, 512, 256, NUM_LANES):
        padded = -(-prompt_len // multiple) * multiple
        if padded - prompt_len <= max_waste * prompt_len or multiple == NUM_LANES:
            return padded
    raise AssertionError("unreachable")


def cache_multiple(config: TransformerConfig, mesh: Mesh | None, axis_name: str = "context") -> int:
    """What a cache length must be a multiple of for the prefill strategy on ``mesh`` (the kernels'
    128-token lanes on each device's shard, twice as many shards under the zigzag layout)."""
    shards = check_mesh(mesh, axis_name)
    if mesh is None:
        return 1
    zigzag = _own_strategy(config, shards, axis_name) and config.context_parallel.layout == "zigzag"
    return shards * NUM_LANES * (2 if zigzag else 1)


def max_cache_len(config: TransformerConfig, mesh: Mesh | None, axis_name: str = "context") -> int:
    """The most slots a cache of this model may have: ``max_seq_len`` rounded up to whole 128-slot lanes
    (and ``cache_multiple``); the slots past ``max_seq_len`` are never decoded into (``decode_step`` refuses
    positions past it), they only keep the kernels' tiles whole."""
    multiple = math.lcm(cache_multiple(config, mesh, axis_name), NUM_LANES)
    return -(-config.max_seq_len // multiple) * multiple


def prefill(
    model: Transformer,
    tokens: Int[Array, "batch prompt_len"],
    *,
    prompt_lengths: Int[Array, " batch"] | None = None,
    max_len: int | np.integer | jax.Array | None = None,
    mesh: Mesh | None = None,
    axis_name: str = "context",
    all_logits: bool = False,
) -> Prefilled:
    """Run ``model`` over ``tokens`` and return the logits and a ``KVCache`` of ``max_len`` slots per row.

    Args:
        model: a ``Transformer`` with a causal mask (``"causal"`` / ``"local"`` / ``"chunked"``, any
            ``layer_types``).
        tokens: int ``[batch, prompt_len]``; row ``b``'s prompt is its first ``prompt_lengths[b]`` tokens.
        prompt_lengths: int ``[batch]`` in ``[1, prompt_len]``, or None (every row is ``prompt_len`` long).
        max_len: cache slots per row (tokens the cache can ever hold): an int (``np.int64`` too), at least
            ``prompt_len``; None: ``prompt_len`` rounded up to ``cache_multiple``. The forward pass runs over
            :func:`forward_len` tokens without a mesh, ``max_len`` on one. A multiple of 128 decodes fastest
            on a TPU (``generate`` rounds up to one): on a v5e chip, 32,833 slots decoded 1.5x slower than
            32,896 (CHANGELOG.md).
        mesh, axis_name: shard the cache (and the forward pass) along the sequence over this mesh axis.
        all_logits: return the logits of every prompt position, not only each row's last.
    """
    check_model(model, "prefill")
    c = model.config
    check_decodable(c)
    check_flags(all_logits=all_logits)
    tokens, lengths = check_prompts(tokens, prompt_lengths, c.vocab_size)
    prompt_len = tokens.shape[1]
    longest = prompt_len if isinstance(lengths, jax.core.Tracer) else int(np.max(np.asarray(lengths)))
    if longest > c.max_seq_len:  # as model() refuses it
        raise ValueError(f"the longest prompt has {longest} tokens, more than the model's max_seq_len="
                         f"{c.max_seq_len}: pass prompts of at most max_seq_len tokens, or build the model with a "
                         f"larger max_seq_len")
    multiple = cache_multiple(c, mesh, axis_name)
    most = max_cache_len(c, mesh, axis_name)
    max_len = -(-prompt_len // multiple) * multiple if max_len is None else as_count("max_len", max_len, 1)
    if max_len < prompt_len:
        raise ValueError(f"the prompt has prompt_len={prompt_len} tokens, more than the cache holds: "
                         f"max_len={max_len!r}; pass max_len >= {prompt_len}")
    if max_len > most:
        raise ValueError(f"max_len={max_len} is more than the model's max_seq_len={c.max_seq_len} (a cache may "
                         f"round it up to whole 128-slot lanes, {most} slots here, but no position past it can be "
                         f"decoded): pass max_len <= {most}, or build the model with a larger max_seq_len")
    if max_len % multiple:
        raise ValueError(f"max_len={max_len} must be a multiple of {multiple} on this mesh (devices on "
                         f"{axis_name!r} x 128-token kernel lanes)")
    program = prefill_program(model, prompt_len, max_len, mesh, axis_name, all_logits)
    logits, k, v = program(tokens, lengths)
    layout = program.keywords["layout"]
    perm = layouts.permutation(layout, max_len, program.keywords["shards"])
    # lengths copied: generate donates the cache, and the caller may hold prompt_lengths
    cache = KVCache(k, v, jnp.array(lengths, copy=True), jnp.asarray(perm), model_key(c), layout, mesh,
                    axis_name if mesh else None)
    return Prefilled(logits, place(cache))


def prefill_program(model: Transformer, prompt_len: int, max_len: int, mesh: Mesh | None = None,
                    axis_name: str = "context", all_logits: bool = False) -> functools.partial:
    """The jitted program ``prefill`` runs, bound to its model and static arguments: call it with
    ``(tokens, prompt_lengths)`` (checked arrays, or abstract ones to compile it ahead of time)."""
    fwd_len = max_len if mesh is not None else forward_len(prompt_len)
    pconfig = prefill_config(model.config, max(max_len, fwd_len), mesh, axis_name)
    layout = "contiguous" if mesh is None else pconfig.context_parallel.layout
    return functools.partial(_prefill_jit, _with_config(model, pconfig), max_len=max_len, fwd_len=fwd_len,
                             mesh=mesh, axis_name=axis_name, layout=layout, shards=check_mesh(mesh, axis_name),
                             all_logits=all_logits)


def _with_config(model: Transformer, config: TransformerConfig) -> Transformer:
    """``model.with_config(config)`` without re-deriving the parameter layout on every call."""
    if config == model.config:
        return model
    treedef = _treedef(config)
    leaves = jax.tree.leaves(model)
    if treedef.num_leaves != len(leaves):  # not expected: prefill_config keeps every parameter shape
        return model.with_config(config)
    return jax.tree.unflatten(treedef, leaves)


@caches.lru_cache(maxsize=32)
def _treedef(config: TransformerConfig):
    return jax.tree.structure(abstract_model(config))


@functools.partial(jax.jit, static_argnames=("max_len", "fwd_len", "mesh", "axis_name", "layout", "shards",
                                             "all_logits"))
def _prefill_jit(model, tokens, lengths, *, max_len, fwd_len, mesh, axis_name, layout, shards, all_logits):
    batch, prompt_len = tokens.shape
    keep = jnp.arange(prompt_len)[None, :] < lengths[:, None]
    padded = jnp.zeros((batch, fwd_len), jnp.int32).at[:, :prompt_len].set(jnp.where(keep, tokens, 0))
    perm = jnp.asarray(layouts.permutation(layout, fwd_len, shards))
    laid = padded[:, perm]
    params, static = eqx.partition(model, eqx.is_array)
    # each layer's keys / values leave the forward already as the cache's slots (cut or zero-padded to
    # max_len, zeros past each row's prompt): a second cache-sized copy made after the forward pushed
    # 8 x 32K tokens of the benchmark model past the chip's 16 GiB
    body = functools.partial(_forward, static=static, rope_len=max_len, cache_len=max_len if mesh is None else None)
    if mesh is None:
        hidden, k, v = body(params, laid, perm, lengths)
    else:
        kv = cache_specs(axis_name)[0]
        in_specs = (jax.tree.map(lambda _: P(), params), P(None, axis_name), P(axis_name), P())
        hidden, k, v = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=(P(None, axis_name), kv, kv),
                                     check_vma=False)(params, laid, perm, lengths)
    inverse = jnp.asarray(layouts.inverse_permutation(layout, fwd_len, shards))
    if all_logits:
        h = hidden[:, inverse[:prompt_len]]
    else:
        h = jnp.take_along_axis(hidden, inverse[lengths - 1][:, None, None], axis=1)[:, 0]
    return model.logits(h), k, v


def _forward(params, tokens, positions, lengths, *, static, rope_len, cache_len):
    """Final-normed hidden states ``[batch, seq, d]`` of the (local shard of) laid-out tokens and
    every layer's keys / values as cache slots ``[layers, batch, kv_heads, slots, d]``: zero where the
    token's position is past its row's ``lengths``, then cut or zero-padded to ``cache_len`` slots when
    the forward ran over another length (single device: slot = position; None: a mesh's shard, kept).
    RoPE reads ``rope_len`` as the current length (the cache's, as decoding does). Rows run in
    equal spans, the most that divide the batch within ``ROW_TOKENS`` tokens (at least one row), so
    the activations held at once stay bounded whatever the batch."""
    model = eqx.combine(params, static)
    c = model.config

    def as_slots(x, length):
        x = jnp.where((positions < length)[None, :, None], x, 0)
        if cache_len is None or x.shape[1] == cache_len:  # None: a mesh's shard, already the cache's
            return x
        keep = min(x.shape[1], cache_len)
        return jnp.pad(x[:, :keep], ((0, 0), (0, cache_len - keep), (0, 0)))

    dynamic, layer_static = eqx.partition(model.layers, eqx.is_array)

    def row(tok, length):
        x = model.embed(tok)

        def step_for(kind):
            def step(h, layer_params):
                layer = eqx.combine(layer_params, layer_static)

                def attention(module, hn):
                    q, k, v = module.project_qkv(hn, positions, rope_len=rope_len, layer_type=kind)
                    out = attend(c, q, k, v, None, module.sinks, layer_type=kind)
                    return module.project_out(out), (as_slots(k, length), as_slots(v, length))

                return layer.apply(h, attention)

            return step

        steps = {kind: step_for(kind) for kind in c.attention_kinds}
        ks, vs = [], []
        for seg in layer_segments(c.features.layer_types, c.num_layers):
            x, (k, v) = run_segment(seg, steps, x, dynamic, c.num_layers)
            ks.append(k)
            vs.append(v)
        return model.final_norm(x), jnp.concatenate(ks), jnp.concatenate(vs)

    batch, seq = tokens.shape
    rows = max(r for r in range(1, batch + 1) if batch % r == 0 and (r == 1 or r * seq <= ROW_TOKENS))

    def rows_step(kv, i):  # rows [i * rows, (i + 1) * rows): their keys / values written into the cache's slots
        span = (lax.dynamic_slice_in_dim(x, i * rows, rows) for x in (tokens, lengths))
        hidden, *new = jax.vmap(row)(*span)
        kv = tuple(lax.dynamic_update_slice_in_dim(a, b.swapaxes(0, 1), i * rows, axis=1) for a, b in zip(kv, new))
        return kv, hidden

    _, *one = jax.eval_shape(row, tokens[0], lengths[0])  # one row's [layers, kv_heads, slots, d]
    empty = tuple(jnp.zeros((x.shape[0], batch, *x.shape[1:]), x.dtype) for x in one)
    (k, v), hidden = lax.scan(rows_step, empty, jnp.arange(batch // rows))
    return hidden.reshape(batch, *hidden.shape[2:]), k, v


__all__ = ["Prefilled", "cache_multiple", "check_prompts", "forward_len", "max_cache_len", "prefill", "prefill_config",
           "prefill_program"]
