"""Decoder-only ``Transformer``: embedding → [RMSNorm → attention, RMSNorm → SwiGLU] × L → logits
(with the Hugging Face family options of ``TransformerConfig``: GeGLU, (1 + w) norms, sandwich norms,
scaled embeddings, a final logit soft cap, per-layer sliding / full attention).

Per example: ``model(tokens, positions, segment_ids=None) -> logits``; batch with ``jax.vmap``.
The loss path calls ``model.hidden(...)`` (final-normed hidden states) and projects chunks of
tokens with ``model.unembedding_matrix()`` itself (applying ``config.features.final_logit_soft_cap`` as
``model.logits`` does), so full ``[seq, vocab]`` logits never exist.
Layers are one stacked ``Block`` (built with ``eqx.filter_vmap``) run by ``lax.scan`` (with
``layer_types``: by scans over periods of the pattern, ``hf_features.layer_segments``), so the
compile time does not grow with depth; ``config.remat`` names the ``jax.checkpoint`` policy of
the scanned block (``remat_policy``). Under a sequence-parallel strategy (``"ring"``,
``"allgather"``, ``"ulysses"``, ``"usp"``) call it inside ``shard_map`` on the local shard of
layout-ordered tokens with their original positions.

``hidden(..., gather_layer=f)`` applies ``f`` to each layer's parameters inside the scanned step
just before use (sharded-parameter training gathers that layer's weights there); its results
are named ``GATHERED`` so no remat policy keeps them for the backward pass (they are gathered
again), and only about two layers' gathered weights are alive at once.
"""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from ringsplash._internal.types import Array, Float, Int
from ringsplash.model.attention import ATTENTION_LSE, ATTENTION_OUT, Attention
from ringsplash.model.config import RematPolicy, TransformerConfig, dtype_of
from ringsplash.model.hf_features import layer_segments
from ringsplash.model.norm import RMSNorm
from ringsplash.parallel.ring_plan import RingSchedule

#: checkpoint name of a layer's weights after ``gather_layer``
GATHERED = "gathered_weights"


def remat_policy(name: RematPolicy, *, gathered: bool = False):
    """``(wrap, policy)`` for the layer step: whether to wrap it in ``jax.checkpoint`` and with
    which ``jax.checkpoint_policies`` policy. With ``gathered`` (weights gathered inside the
    step) even ``"none"`` checkpoints, saving everything except the gathered weights."""
    cp = jax.checkpoint_policies
    attention = cp.save_only_these_names(ATTENTION_OUT, ATTENTION_LSE)
    if name == "none":
        return (True, cp.save_anything_except_these_names(GATHERED)) if gathered else (False, None)
    if name == "full":
        return True, cp.nothing_saveable
    if name == "save_attention":
        return True, attention
    if name == "save_dots":
        return True, cp.save_from_both_policies(cp.dots_with_no_batch_dims_saveable, attention)
    raise ValueError(f"unknown remat policy {name!r}")  # TransformerConfig validates; unreachable


class SwiGLU(eqx.Module):
    """Gated MLP ``(act(x W_gate) * x W_up) W_down``: SwiGLU (``silu``) or GeGLU (``gelu_tanh``)."""

    w_gate: Float[Array, "d_model hidden"]
    w_up: Float[Array, "d_model hidden"]
    w_down: Float[Array, "hidden d_model"]
    activation: str = eqx.field(static=True)

    def __init__(self, config: TransformerConfig, *, key: jax.Array):
        c = config
        k1, k2, k3 = jax.random.split(key, 3)
        pdt = dtype_of(c.param_dtype)
        h = c.mlp_hidden
        self.w_gate = (jax.random.normal(k1, (c.d_model, h)) / c.d_model**0.5).astype(pdt)
        self.w_up = (jax.random.normal(k2, (c.d_model, h)) / c.d_model**0.5).astype(pdt)
        self.w_down = (jax.random.normal(k3, (h, c.d_model)) / (h * 2 * c.num_layers) ** 0.5).astype(pdt)
        self.activation = c.features.mlp_activation

    def __call__(self, x: Float[Array, "seq d_model"]) -> Float[Array, "seq d_model"]:
        dt = x.dtype
        gate = x @ self.w_gate.astype(dt)
        gate = jax.nn.silu(gate) if self.activation == "silu" else jax.nn.gelu(gate, approximate=True)
        return (gate * (x @ self.w_up.astype(dt))) @ self.w_down.astype(dt)


def _norm(config: TransformerConfig, d: int | None = None) -> RMSNorm:
    c = config
    return RMSNorm(d or c.d_model, dtype_of(c.param_dtype), c.features.norm_eps, c.features.norm_offset)


class Block(eqx.Module):
    """Pre-norm block; with ``post_norms`` also a norm on each sub-layer's output before its residual add."""

    attention_norm: RMSNorm
    attention: Attention
    mlp_norm: RMSNorm
    mlp: SwiGLU
    post_attention_norm: RMSNorm | None
    post_mlp_norm: RMSNorm | None

    def __init__(self, config: TransformerConfig, *, key: jax.Array):
        ka, km = jax.random.split(key)
        self.attention_norm = _norm(config)
        self.attention = Attention(config, key=ka)
        self.mlp_norm = _norm(config)
        self.mlp = SwiGLU(config, key=km)
        self.post_attention_norm = self.post_mlp_norm = None
        if config.features.post_norms:
            self.post_attention_norm, self.post_mlp_norm = _norm(config), _norm(config)

    def __call__(
        self,
        x: Float[Array, "seq d_model"],
        positions: Int[Array, " seq"],
        segment_ids: Int[Array, " seq"] | None,
        *,
        key: jax.Array | None = None,
        return_max_logits: bool = False,
        schedule: RingSchedule | None = None,
        layer_type: str | None = None,
    ) -> Float[Array, "seq d_model"] | tuple[Float[Array, "seq d_model"], Float[Array, " heads"]]:
        def attention(module: Attention, h):
            a = module(h, positions, segment_ids, key=key, return_max_logits=return_max_logits, schedule=schedule,
                       layer_type=layer_type)
            return a if return_max_logits else (a, None)

        x, max_logits = self.apply(x, attention)
        return (x, max_logits) if return_max_logits else x

    def apply(self, x: Float[Array, "seq d_model"], attention: Callable) -> tuple[Float[Array, "seq d_model"], object]:
        """The block with its attention sub-layer computed by ``attention(self.attention, normed_x) -> (a, aux)``
        (decoding attends a KV cache this way); returns the block output and ``aux``."""
        a, aux = attention(self.attention, self.attention_norm(x))
        if self.post_attention_norm is not None:
            a = self.post_attention_norm(a)
        x = x + a.astype(x.dtype)
        m = self.mlp(self.mlp_norm(x))
        if self.post_mlp_norm is not None:
            m = self.post_mlp_norm(m)
        x = x + m.astype(x.dtype)
        return x, aux


def _check_example(tokens, positions, segment_ids, vocab_size: int, max_seq_len: int | None = None,
                   shards: int = 1, attention: str = "", padded_max: int | None = None) -> None:
    """One example's token ids, positions and segment ids: int ``[seq]`` each, of one length, at
    most ``max_seq_len`` tokens over the ``shards`` the sequence is split into (a local shard
    each under the sequence-parallel strategies, of a sequence padded to at most ``padded_max``
    tokens, ``TransformerConfig.padded_seq_len``); concrete token ids inside the vocabulary
    (traced ids cannot be inspected)."""
    shape = getattr(tokens, "shape", None)
    if shape is None or len(shape) != 1:
        raise ValueError(f"tokens must be [seq] token ids of one example (batch with jax.vmap, or use the "
                         f"train/eval step functions, which do), got tokens.shape={shape}")
    # the padded length whatever the shard count: a one-device ring pads as a wider one does (a 600-token
    # config's batches run at 768 over one device, were refused there and accepted over four)
    limit = max_seq_len if padded_max is None else padded_max
    if max_seq_len is not None and shape[0] * shards > limit:
        padded, most = ("", "max_seq_len") if limit == max_seq_len else (f" (padded inside to {limit})", limit)
        if shards == 1:
            raise ValueError(f"tokens has {shape[0]} positions, more than the config's max_seq_len={max_seq_len}"
                             f"{padded}: pass at most {most} tokens, or build the model with a larger max_seq_len")
        raise ValueError(
            f"tokens has {shape[0]} positions per shard x {shards} shards (attention={attention!r}) = "
            f"{shape[0] * shards}, more than the config's max_seq_len={max_seq_len}{padded}: under a "
            f"sequence-parallel strategy the model takes one local shard of at most {most} / {shards} = "
            f"{limit // shards} tokens, inside shard_map")
    for name, x in (("tokens", tokens), ("positions", positions), ("segment_ids", segment_ids)):
        if x is None:
            continue
        if getattr(x, "shape", None) != shape:
            raise ValueError(f"{name} must have the shape of tokens {tuple(shape)}, got {name}.shape="
                             f"{getattr(x, 'shape', type(x).__name__)}")
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{name} must be integers, got {name}.dtype={x.dtype}")
    # Host-side check of concrete ids (numpy, so that a concrete array closed over by a jitted function
    # is read rather than traced); ids spread over other processes cannot be read here.
    if (not isinstance(tokens, jax.core.Tracer) and shape[0]
            and getattr(tokens, "is_fully_addressable", True)):
        ids = np.asarray(tokens)
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"token ids must be in [0, vocab_size={vocab_size}), got ids in [{lo}, {hi}]")


class Transformer(eqx.Module):
    """Embedding, ``num_layers`` stacked blocks, final RMSNorm, unembedding (optionally tied: then
    ``embedding.T`` itself, and a fresh embedding has std ``d_model ** -0.5``, not 1, so the initial
    logits are well scaled)."""

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
        embedding = jax.random.normal(ke, (config.vocab_size, config.d_model))
        if config.features.tie_embeddings:
            embedding = embedding / config.d_model**0.5
        self.embedding = embedding.astype(pdt)
        self.layers = eqx.filter_vmap(lambda k: Block(config, key=k))(jax.random.split(kl, config.num_layers))
        self.final_norm = _norm(config)
        if config.features.tie_embeddings:
            self.unembedding = None
        else:
            self.unembedding = (
                jax.random.normal(ku, (config.d_model, config.vocab_size)) / config.d_model**0.5
            ).astype(pdt)
        self.config = config

    def __call__(
        self,
        tokens: Int[Array, " seq"],
        positions: Int[Array, " seq"],
        segment_ids: Int[Array, " seq"] | None = None,
        *,
        key: jax.Array | None = None,
        schedule: RingSchedule | dict[str, RingSchedule] | None = None,
    ) -> Float[Array, "seq vocab"]:
        """Float32 logits for one example. ``key`` enables attention dropout (training only);
        ``schedule`` as for ``hidden``."""
        x = self.hidden(tokens, positions, segment_ids, key=key, schedule=schedule)
        return self.logits(x)

    def logits(self, hidden: Float[Array, "*tokens d_model"]) -> Float[Array, "*tokens vocab"]:
        """Float32 logits of final hidden states (``final_logit_soft_cap`` applied)."""
        cap = self.config.features.final_logit_soft_cap
        return soft_cap((hidden @ self.unembedding_matrix()).astype(jnp.float32), cap)

    def hidden(
        self,
        tokens: Int[Array, " seq"],
        positions: Int[Array, " seq"],
        segment_ids: Int[Array, " seq"] | None = None,
        *,
        key: jax.Array | None = None,
        gather_layer: Callable[[Block], Block] | None = None,
        return_max_logits: bool = False,
        schedule: RingSchedule | dict[str, RingSchedule] | None = None,
    ) -> Float[Array, "seq d_model"] | tuple[Float[Array, "seq d_model"], Float[Array, "layers heads"]]:
        """Final-normed hidden states (compute dtype) for one example.

        Args:
            tokens, positions, segment_ids: one example (or its local shard under the ring).
            key: enables attention dropout (training only).
            gather_layer: applied to one layer's parameters (a ``Block`` of arrays without the
                stacked axis) inside the scanned step, e.g. to all-gather sharded weights.
            return_max_logits: also return float32 ``[num_layers, heads]``: each layer's per-head
                max attention logit (``splash_attention(return_max_logits=True)``; under the ring
                over the whole sequence), collected by the layer scan; no gradient. QK-clip input.
            schedule: under ``"ring"`` / ``"usp"``, this device's slice of the ring's schedule
                (``ringsplash.model.schedule.model_ring_schedule``, passed into ``shard_map`` with
                ``schedule_specs(schedule, ring axis)``): one ``RingSchedule`` shared by every layer, or
                with ``layer_types`` a dict of one per layer type; None = each layer's ring holds the
                whole schedule as a constant replicated on every device.

        Layers run as ``lax.scan`` s (``hf_features.layer_segments``): one over every layer, or with
        ``layer_types`` one over groups of a period of the pattern, so the program does not grow with depth.
        """
        c = self.config
        _check_example(tokens, positions, segment_ids, c.vocab_size, c.max_seq_len, c.context_shards, c.strategy,
                       c.padded_seq_len(c.max_seq_len))
        x = self.embed(tokens)
        dynamic, static = eqx.partition(self.layers, eqx.is_array)
        schedules = _layer_schedules(c, schedule)

        def layer_step(layer_type):
            def step(h, xs):
                layer_params, layer_key = xs
                if gather_layer is not None:
                    layer_params = jax.tree.map(lambda w: checkpoint_name(w, GATHERED), gather_layer(layer_params))
                layer = eqx.combine(layer_params, static)
                kw = dict(key=layer_key, schedule=schedules[layer_type], layer_type=layer_type)
                if return_max_logits:  # the layer's max logits leave the scan as its per-layer output
                    return layer(h, positions, segment_ids, return_max_logits=True, **kw)
                return layer(h, positions, segment_ids, **kw), None

            wrap, policy = remat_policy(c.remat, gathered=gather_layer is not None)
            return jax.checkpoint(step, policy=policy) if wrap else step

        steps = {kind: layer_step(kind) for kind in c.attention_kinds}
        keys = None if key is None else jax.random.split(key, c.num_layers)
        max_logits = []
        for seg in layer_segments(c.features.layer_types, c.num_layers):
            x, mx = run_segment(seg, steps, x, (dynamic, keys), c.num_layers)
            max_logits.append(mx)
        if not return_max_logits:
            return self.final_norm(x)
        return self.final_norm(x), max_logits[0] if len(max_logits) == 1 else jnp.concatenate(max_logits)

    def embed(self, tokens: Int[Array, "*tokens"]) -> Float[Array, "*tokens d_model"]:
        """Token embeddings in the compute dtype (times sqrt(d_model) with ``scale_embeddings``)."""
        c = self.config
        cdt = dtype_of(c.compute_dtype)
        x = self.embedding[tokens].astype(cdt)
        if c.features.scale_embeddings:  # the factor rounded to the hidden dtype first, as transformers does
            x = x * jnp.asarray(c.d_model**0.5, cdt)
        return x

    def unembedding_matrix(self) -> Float[Array, "d_model vocab"]:
        """The output projection in the compute dtype (``embedding.T`` itself when tied)."""
        w = self.embedding.T if self.unembedding is None else self.unembedding
        return w.astype(dtype_of(self.config.compute_dtype))

    def with_config(self, config: TransformerConfig) -> "Transformer":
        """These parameters under another config with the same parameter shapes (e.g. another
        attention strategy, ring size or remat setting)."""
        like = abstract_model(config)
        leaves, mine = jax.tree.leaves(like), jax.tree.leaves(self)
        shapes = [(x.shape, x.dtype) for x in leaves]
        if shapes != [(x.shape, x.dtype) for x in mine]:
            raise ValueError("with_config needs a config with the same parameter shapes and dtypes")
        return jax.tree.unflatten(jax.tree.structure(like), mine)

    def num_params(self) -> int:
        return sum(x.size for x in jax.tree_util.tree_leaves(eqx.filter(self, eqx.is_array)))


def soft_cap(logits: Float[Array, "*shape"], cap: float | None) -> Float[Array, "*shape"]:
    """``cap * tanh(logits / cap)`` (None: unchanged)."""
    return logits if cap is None else cap * jnp.tanh(logits / cap)


def _layer_schedules(c: TransformerConfig, schedule) -> dict:
    """The ring schedule of each layer type (``c.attention_kinds``): a dict passed in is checked, one
    ``RingSchedule`` serves a config whose layers share one mask."""
    kinds = c.attention_kinds
    if isinstance(schedule, dict):
        if set(schedule) != set(kinds):
            raise ValueError(f"schedule must map each layer type {kinds} to its RingSchedule "
                             f"(model_ring_schedule builds it), got keys {tuple(schedule)}")
        return schedule
    if schedule is not None and len(kinds) > 1:
        raise ValueError(f"layer_types has layers of {kinds}, each with its own mask and ring schedule: pass "
                         f"schedule as a dict {{layer type: RingSchedule}} (model_ring_schedule builds it) or None")
    return dict.fromkeys(kinds, schedule)


def run_segment(seg, steps: dict, x, xs, num_layers: int, *, unroll: bool = False):
    """Scan the layers of ``seg`` (a ``LayerSegment``) over ``x``; ``xs``: a pytree of per-layer inputs with a
    leading ``[num_layers]`` axis (here: stacked params, keys or None), ``steps``: ``{layer type: step(h, xs_i)
    -> (h, out)}``. Returns the new ``x`` and the segment's per-layer step outputs (a pytree of ``[layers, ...]``,
    or None). ``unroll``: the layers unrolled (``lax.scan(unroll=True)``): static slices of the stacked inputs."""
    if seg.num_layers != num_layers:
        xs = jax.tree.map(lambda a: a[seg.start:seg.start + seg.num_layers], xs)
    if len(seg.kinds) == 1:
        return jax.lax.scan(steps[seg.kinds[0]], x, xs, unroll=unroll)
    p = len(seg.kinds)
    xs = jax.tree.map(lambda a: a.reshape(seg.groups, p, *a.shape[1:]), xs)

    def group(h, group_xs):
        outs = []
        for j, kind in enumerate(seg.kinds):  # static: each layer of the period with its own mask
            h, out = steps[kind](h, jax.tree.map(lambda a, j=j: a[j], group_xs))
            outs.append(out)
        return h, None if outs[0] is None else jax.tree.map(lambda *o: jnp.stack(o), *outs)

    x, outs = jax.lax.scan(group, x, xs, unroll=unroll)
    return x, jax.tree.map(lambda o: o.reshape(seg.num_layers, *o.shape[2:]), outs)


def abstract_model(config: TransformerConfig) -> Transformer:
    """The ``Transformer`` of ``config`` with ``jax.ShapeDtypeStruct`` leaves: its structure,
    shapes and dtypes without allocating or initialising anything (a restore target, a sharding
    plan's input, the pytree structure of a cache)."""
    return eqx.filter_eval_shape(Transformer, config, key=jax.random.key(0))
