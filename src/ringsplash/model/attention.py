"""Grouped-query attention with RoPE from explicit positions and a selectable strategy.

Positions are passed in, never inferred from array indices: under a ring layout the local
shard holds permuted tokens, and RoPE must still see each token's true position. The mask is
the config's mask over original positions; packed documents add segment ids.
"""

from collections.abc import Callable
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from ringsplash import masks as masks_lib
from ringsplash import parallel
from ringsplash._internal.types import Array, Float, Int
from ringsplash.masks.segment_ids import SegmentIds
from ringsplash.model.config import TransformerConfig, dtype_of
from ringsplash.model.norm import RMSNorm
from ringsplash.model.parallelism import STRATEGIES, ContextParallel
from ringsplash.model.rope_scaling import RopeScaling, rope_attention_factor, rope_inv_freq
from ringsplash.parallel.ring_plan import RingSchedule
from ringsplash.reference import reference_attention
from ringsplash.splash import splash_attention
from ringsplash.splash.config import NUM_LANES

#: checkpoint names of the attention output and its log-sum-exp (the ring names its residuals
#: with them, so a policy saving them never re-runs the ring forward in the backward pass)
ATTENTION_OUT, ATTENTION_LSE = "attention_out", "attention_lse"
#: the segment id of padding a length no strategy tiles is padded with (``_padded_splash`` inside the
#: model; ``ringsplash.train.layout_batch`` for the context-parallel strategies): padded queries carry
#: it and padded keys ``PAD_SEGMENT + 1``, below any real id, so no real query sees a padded key and
#: a padded query sees nothing (its row is 0, never NaN, and has no max logit)
PAD_SEGMENT = int(jnp.iinfo(jnp.int32).min)


def rope(
    x: Float[Array, "heads seq d"],
    positions: Int[Array, " seq"],
    theta: float,
    scaling: RopeScaling | None = None,
    *,
    seq_len: int | None = None,
) -> Float[Array, "heads seq d"]:
    """Rotary embedding (rotate-half convention), angles computed in float32 from ``positions``.

    ``scaling=None``: ringsplash's own frequencies ``theta ** (-2i / d)``; a ``RopeScaling``: its
    frequencies and cos / sin multiplier with Hugging Face's numerics (``ringsplash.model.rope_scaling``),
    ``seq_len`` being the current (global, static) sequence length ``dynamic`` and ``longrope`` read."""
    d = x.shape[-1]
    if scaling is None:
        inv_freq = theta ** (-jnp.arange(0, d // 2, dtype=jnp.float32) * 2.0 / d)
        attention_factor = 1.0
    else:  # host-side constants: the scaling, d, theta and seq_len are all static
        inv_freq = jnp.asarray(rope_inv_freq(scaling, d, theta, seq_len=seq_len))
        attention_factor = rope_attention_factor(scaling)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : d // 2], xf[..., d // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def attend(
    config: TransformerConfig,
    q: Float[Array, "heads seq d"],
    k: Float[Array, "kv_heads seq d"],
    v: Float[Array, "kv_heads seq dv"],
    segment_ids: Int[Array, " seq"] | None,
    sinks: Float[Array, " heads"] | None,
    *,
    key: jax.Array | None = None,
    return_max_logits: bool = False,
    schedule: RingSchedule | None = None,
    layer_type: str | None = None,
) -> Float[Array, "heads seq dv"] | tuple[Float[Array, "heads seq dv"], Float[Array, " heads"]]:
    """Run the configured strategy on one example (sequence-parallel strategies: one local shard);
    with ``return_max_logits`` also the per-head max logits over the whole sequence (no gradient).
    ``schedule``: this device's slice of the ring's schedule (``model.schedule.model_ring_schedule``)
    for ``"ring"`` / ``"usp"`` (None: the whole schedule as a replicated constant); others ignore it.
    ``layer_type``: the layer's entry of ``config.features.layer_types`` (its mask, ``config.make_mask``)."""
    seq = q.shape[1]
    cp = config.context_parallel
    for role in cp.roles:
        axis_name, size = cp.axis(role), cp.size(role)
        try:
            actual = jax.lax.axis_size(axis_name)
        except NameError:
            raise ValueError(
                f"ContextParallel(strategy={cp.strategy!r}) runs attention inside jax.shard_map over the mesh axis "
                f"{axis_name!r}, which is not bound here: call the model through ringsplash.train.make_logits_fn / "
                f"make_train_step (they shard_map it over train.mesh_for(config)), or inside your own shard_map "
                f"over such a mesh; context_parallel.single_device() runs on one device"
            ) from None
        if actual != size:
            raise ValueError(
                f"mesh axis {axis_name!r} has {actual} devices but the config says context_parallel.{role}_size={size}"
            )
        seq = seq * actual
    mask = config.make_mask(seq, layer_type)
    seg = None if segment_ids is None else SegmentIds(q=segment_ids, kv=segment_ids)
    if cp.roles and segment_ids is not None:  # padding (train.layout_batch): its keys one id above its queries
        seg = SegmentIds(q=segment_ids, kv=jnp.where(segment_ids == PAD_SEGMENT, PAD_SEGMENT + 1, segment_ids))
    common = dict(segment_ids=seg, scale=config.features.attention_scale, logit_soft_cap=config.logit_soft_cap,
                  sinks=sinks, with_max_logits=return_max_logits)
    if cp.roles:
        common.update(layout=cp.layout, config=config.splash)
    call = LocalCall(config, segment_ids, layer_type, schedule, key)
    result = LOCAL_ATTENTION[cp.strategy](q, k, v, mask, cp, call, common)
    return (result.out, result.max_logits) if return_max_logits else result


class LocalCall(NamedTuple):
    """What a strategy's local attention may need beyond q, k, v, the mask and ``common``."""

    config: TransformerConfig
    segment_ids: Int[Array, " seq"] | None  # the caller's, before the padding rule
    layer_type: str | None
    schedule: RingSchedule | None
    key: jax.Array | None


def _reference(q, k, v, mask, cp: ContextParallel, call: LocalCall, common: dict):
    dropout = call.config.attention_dropout
    if dropout > 0 and call.key is not None:
        return reference_attention(q, k, v, mask, **common, dropout_rate=dropout, dropout_key=call.key)
    return reference_attention(q, k, v, mask, **common)


def _splash(q, k, v, mask, cp: ContextParallel, call: LocalCall, common: dict):
    config = call.config
    pad = -q.shape[1] % NUM_LANES
    if not pad or isinstance(config.mask, masks_lib.Mask):  # a Mask serves its own length only
        return splash_attention(q, k, v, mask, config=config.splash, **common)
    return _padded_splash(config, q, k, v, call.segment_ids, pad, call.layer_type, common)


#: each strategy's attention on one example (inside ``shard_map``: one local shard), the dispatch of
#: ``attend``: ``LOCAL_ATTENTION[strategy](q, k, v, mask, context_parallel, call, common)``, ``common``
#: holding the shared keywords (segment ids, scale, soft cap, sinks, max logits; plus ``layout`` and
#: the Splash ``config`` for the context-parallel ones). The strategies' rules: ``model.parallelism.RULES``.
LOCAL_ATTENTION: dict[str, Callable] = {
    "reference": _reference,
    "splash": _splash,
    "ring": lambda q, k, v, mask, cp, call, common: parallel.ring_attention(
        q, k, v, mask, axis_name=cp.ring_axis, schedule=call.schedule, **common),
    "allgather": lambda q, k, v, mask, cp, call, common: parallel.allgather_attention(
        q, k, v, mask, axis_name=cp.ring_axis, **common),
    "ulysses": lambda q, k, v, mask, cp, call, common: parallel.ulysses_attention(
        q, k, v, mask, axis_name=cp.ulysses_axis, **common),
    "usp": lambda q, k, v, mask, cp, call, common: parallel.usp_attention(
        q, k, v, mask, ulysses_axis=cp.ulysses_axis, ring_axis=cp.ring_axis, schedule=call.schedule, **common),
}
assert set(LOCAL_ATTENTION) == set(STRATEGIES), "every strategy has a local attention"


def _padded_splash(config, q, k, v, segment_ids, pad: int, layer_type, common: dict):
    """Splash attention at a length its 128-token lanes do not tile (600 tokens, say): the tokens
    padded to the next multiple of 128 inside, never by the user. Padded queries and keys get two
    segment ids of their own (below any real one), so no real query sees a padded key and every
    padded query row is fully masked (0, no NaN; no max logit); the padding is sliced off after."""
    seq = q.shape[1]
    widen = lambda x: jnp.pad(x, ((0, 0), (0, pad), (0, 0)))
    real = jnp.zeros((seq,), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    seg = SegmentIds(q=jnp.concatenate([real, jnp.full((pad,), PAD_SEGMENT, jnp.int32)]),
                     kv=jnp.concatenate([real, jnp.full((pad,), PAD_SEGMENT + 1, jnp.int32)]))
    out = splash_attention(widen(q), widen(k), widen(v), config.make_mask(seq + pad, layer_type),
                           config=config.splash, **{**common, "segment_ids": seg})
    if common["with_max_logits"]:
        return out._replace(out=out.out[:, :seq])
    return out[:, :seq]


class Attention(eqx.Module):
    """GQA self-attention: projections (+ biases with ``attention_bias``), per-head RMSNorm of q and k
    (``qk_norm``), RoPE on q and k, the chosen strategy, output projection."""

    wq: Float[Array, "d_model heads_x_d"]
    wk: Float[Array, "d_model kv_heads_x_d"]
    wv: Float[Array, "d_model kv_heads_x_dv"]
    wo: Float[Array, "heads_x_dv d_model"]
    sinks: Float[Array, " heads"] | None
    config: TransformerConfig = eqx.field(static=True)
    bq: Float[Array, " heads_x_d"] | None
    bk: Float[Array, " kv_heads_x_d"] | None
    bv: Float[Array, " kv_heads_x_dv"] | None
    q_norm: RMSNorm | None
    k_norm: RMSNorm | None

    def __init__(self, config: TransformerConfig, *, key: jax.Array):
        c = config
        kq, kk, kv, ko = jax.random.split(key, 4)
        pdt = dtype_of(c.param_dtype)

        def init(k, fan_in, fan_out, gain=1.0):
            return (jax.random.normal(k, (fan_in, fan_out), jnp.float32) * gain / fan_in**0.5).astype(pdt)

        self.wq = init(kq, c.d_model, c.num_heads * c.head_dim)
        self.wk = init(kk, c.d_model, c.num_kv_heads * c.head_dim)
        self.wv = init(kv, c.d_model, c.num_kv_heads * c.v_head_dim)
        self.wo = init(ko, c.num_heads * c.v_head_dim, c.d_model, gain=(2 * c.num_layers) ** -0.5)
        self.sinks = jnp.zeros((c.num_heads,), jnp.float32) if c.sinks else None
        self.bq = self.bk = self.bv = self.q_norm = self.k_norm = None
        f = c.features
        if f.attention_bias:
            self.bq = jnp.zeros((c.num_heads * c.head_dim,), pdt)
            self.bk = jnp.zeros((c.num_kv_heads * c.head_dim,), pdt)
            self.bv = jnp.zeros((c.num_kv_heads * c.v_head_dim,), pdt)
        if f.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, pdt, f.norm_eps, f.norm_offset)
            self.k_norm = RMSNorm(c.head_dim, pdt, f.norm_eps, f.norm_offset)
        self.config = config

    def __call__(
        self,
        x: Float[Array, "seq d_model"],
        positions: Int[Array, " seq"],
        segment_ids: Int[Array, " seq"] | None = None,
        *,
        key: jax.Array | None = None,
        return_max_logits: bool = False,
        schedule: RingSchedule | None = None,
        layer_type: str | None = None,
    ) -> Float[Array, "seq d_model"] | tuple[Float[Array, "seq d_model"], Float[Array, " heads"]]:
        """The layer's output; with ``return_max_logits`` also its per-head max logits
        (``schedule``: the ring's per-device schedule, ``layer_type``: the layer's mask and RoPE, see ``attend``)."""
        c = self.config
        seq = x.shape[0]
        # the current length of dynamic / longrope RoPE: the whole sequence's (this call holds one of its
        # context_shards local shards), static (ringsplash.model.rope_scaling); capped at max_seq_len, since
        # only the padding a context-parallel strategy adds (train.layout_batch) runs past it
        rope_len = min(seq * c.context_parallel.shards, c.max_seq_len)
        q, k, v = self.project_qkv(x, positions, rope_len=rope_len, layer_type=layer_type)
        out = attend(c, q, k, v, segment_ids, self.sinks, key=key, return_max_logits=return_max_logits,
                     schedule=schedule, layer_type=layer_type)
        max_logits = None
        if return_max_logits:
            out, max_logits = out
        if not c.context_parallel.rule.ring_schedule:  # the ring names its own residual (twice would save it twice)
            out = checkpoint_name(out, ATTENTION_OUT)
        out = self.project_out(out)
        return (out, max_logits) if return_max_logits else out

    def project_qkv(
        self,
        x: Float[Array, "seq d_model"],
        positions: Int[Array, " seq"],
        *,
        rope_len: int,
        layer_type: str | None = None,
    ) -> tuple[Float[Array, "heads seq d"], Float[Array, "kv_heads seq d"], Float[Array, "kv_heads seq dv"]]:
        """q, k, v of ``x`` in the compute dtype: projections (+ biases), q/k norms, RoPE of the layer
        type at ``positions`` (``rope_len``: the static current length dynamic / longrope RoPE reads).
        What ``__call__`` attends; decoding (``ringsplash.inference``) calls it on new tokens."""
        c = self.config
        cdt = dtype_of(c.compute_dtype)
        seq = x.shape[0]
        x = x.astype(cdt)

        def heads(w, b, n, dim=c.head_dim):
            y = x @ w.astype(cdt)
            if b is not None:
                y = y + b.astype(cdt)
            return y.reshape(seq, n, dim).transpose(1, 0, 2)

        q, k = heads(self.wq, self.bq, c.num_heads), heads(self.wk, self.bk, c.num_kv_heads)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        theta, scaling = c.rope_for(layer_type)
        q = rope(q, positions, theta, scaling, seq_len=rope_len)
        k = rope(k, positions, theta, scaling, seq_len=rope_len)
        v = heads(self.wv, self.bv, c.num_kv_heads, c.v_head_dim)
        return q, k, v

    def project_out(self, out: Float[Array, "heads seq dv"]) -> Float[Array, "seq d_model"]:
        """The output projection of attention's per-head output (compute dtype)."""
        c = self.config
        cdt = dtype_of(c.compute_dtype)
        seq = out.shape[1]
        out = out.astype(cdt).transpose(1, 0, 2).reshape(seq, c.num_heads * c.v_head_dim)
        return out @ self.wo.astype(cdt)
