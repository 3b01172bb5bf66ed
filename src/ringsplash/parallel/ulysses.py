"""DeepSpeed-Ulysses context parallelism on the Splash kernels.

The sequence arrives sharded on ``axis_name`` (N devices, token ``layout``). One all-to-all
turns sequence-sharded q, k, v into head-sharded ones (``heads / N`` heads, the whole
sequence, still in ``layout`` order), the Splash layer runs on the whole sequence with a
MaskInfo whose positions are the layout's permutation (the mask stays on original positions),
and one all-to-all turns the output back. Segment ids are all-gathered.

GQA: when N divides ``kv_heads`` the kv heads split like the q heads. When ``kv_heads``
divides N, every kv head is repeated ``N / kv_heads`` times before the all-to-all, so each
device receives exactly the one kv head its q heads use (from every sequence shard) and
nothing else. Other ratios are rejected (they would send unused heads).

Backward: the custom VJP is around the local Splash call; JAX transposes the all-to-all of q
and of the output into the inverse all-to-all (the optimal collective). K and V reach the
kernels inside that custom VJP (``splash_info_attention(kv_exchange=...)``), whose backward
sends the kernels' dK / dV back by the inverse all-to-all and sums the repeated kv heads'
copies in float32 before the one cast to k / v's dtype, as the ring accumulates dK / dV.
(JAX's transpose of the repeat summed the copies' gradients already rounded to bfloat16: dK
48% and dV 49% less accurate than the ring's, bfloat16, S = 4096, N = 8, 8 q / 2 kv heads;
issue 39.) Without a repeat nothing is summed: the gradients are cast first and travel in
k / v's dtype, as before.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from ringsplash import layouts
from ringsplash import masks as masks_lib
from ringsplash._internal.shard_map import axis_index, axis_size
from ringsplash._internal.types import Array, AttentionOutput, Float, outputs
from ringsplash.blocksparse.mask_info import build_mask_info
from ringsplash.masks.segment_ids import SegmentIds
from ringsplash.parallel._common import (
    check_global_inputs,
    check_local_inputs,
    check_mesh_axis,
    fit_gathered_blocks,
    interpreter_for_mesh,
    run_sharded,
)
from ringsplash.parallel.heads import UlyssesHeads, local_head_mask, ulysses_heads
from ringsplash.splash.attention import splash_info_attention
from ringsplash.splash.blocks import is_sparse
from ringsplash.splash.config import NUM_LANES, SplashConfig
from ringsplash.splash.partial_tiles import partial_mode

__all__ = ["KvToHeads", "gather_head_maxima", "heads_to_sequence", "sequence_to_heads", "ulysses_attention",
           "ulysses_attention_sharded"]


@dataclasses.dataclass(frozen=True)
class KvToHeads:
    """The ``KvExchange`` of Ulysses (``splash.attention``): sequence-sharded k or v
    ``[kv_heads, L, d]`` -> head-sharded ``[kv_local, N L, d]`` (every kv head repeated
    ``kv_repeat`` times first); backward, the inverse all-to-all of the kernels' dK / dV and the
    sum of each head's copies, in float32 (the kernels' partials then), before the one cast to
    ``dtype``; without copies, the kernels' dK / dV in ``dtype``, sent as they are."""

    axis_name: object
    kv_repeat: int

    @property
    def sums_partials(self) -> bool:
        """Only repeated kv heads' copies are summed; otherwise ``reduce`` is the inverse all-to-all."""
        return self.kv_repeat > 1

    def gather(self, x):
        if self.kv_repeat > 1:
            x = jnp.repeat(x, self.kv_repeat, axis=0)
        return lax.all_to_all(x, self.axis_name, 0, 1, tiled=True)

    def reduce(self, dx, dtype):
        if not self.sums_partials:  # cast first, send k / v's dtype
            return lax.all_to_all(dx.astype(dtype), self.axis_name, 1, 0, tiled=True)
        dx = lax.all_to_all(dx, self.axis_name, 1, 0, tiled=True)  # [kv_heads * kv_repeat, L, d]
        return dx.reshape(-1, self.kv_repeat, *dx.shape[1:]).sum(axis=1).astype(dtype)


def sequence_to_heads(q, k, v, segment_ids, sinks, split: UlyssesHeads, axis_name):
    """All-to-all from sequence-sharded ``[heads, L, d]`` to head-sharded ``[heads / N, N L, d]``
    (kv heads repeated first where ``split`` says so, :class:`KvToHeads`; ``k`` and ``v`` None:
    returned None, for a caller that passes them through ``KvToHeads`` itself); segment ids
    all-gathered, sinks sliced to the local heads."""
    kv = KvToHeads(axis_name, split.kv_repeat)
    if k is not None:
        k, v = kv.gather(k), kv.gather(v)
    if segment_ids is not None:
        gather = lambda x: lax.all_gather(x, axis_name, axis=0, tiled=True)
        segment_ids = SegmentIds(q=gather(segment_ids.q), kv=gather(segment_ids.kv))
    if sinks is not None:
        sinks = lax.dynamic_slice_in_dim(sinks, axis_index(axis_name) * split.q_local, split.q_local)
    return lax.all_to_all(q, axis_name, 0, 1, tiled=True), k, v, segment_ids, sinks


def heads_to_sequence(out, axis_name):
    """Inverse all-to-all of :func:`sequence_to_heads` for the output."""
    return lax.all_to_all(out, axis_name, 1, 0, tiled=True)


def gather_head_maxima(max_logits, axis_name):
    """``[heads / N]`` maxima of this device's heads (complete: it saw the whole sequence) ->
    ``[heads]`` on every device, in head order (device ``u`` holds heads ``u·heads/N ..``, as
    :func:`sequence_to_heads` split them): one all-gather, the Ulysses counterpart of a pmax."""
    return lax.all_gather(max_logits, axis_name, axis=0, tiled=True)


def ulysses_attention(
    q: Float[Array, "heads q_shard d"],
    k: Float[Array, "kv_heads kv_shard d"],
    v: Float[Array, "kv_heads kv_shard dv"],
    mask: masks_lib.AnyMask,
    *,
    axis_name,
    segment_ids: SegmentIds | None = None,
    layout: layouts.Layout = "contiguous",
    scale: float | None = None,
    logit_soft_cap: float | None = None,
    sinks: Float[Array, " heads"] | None = None,
    config: SplashConfig = SplashConfig(),
    return_max_logits: bool = False,
    with_max_logits: bool = False,
) -> Float[Array, "heads q_shard dv"] | AttentionOutput | tuple:
    """Exact attention over a sequence sharded on ``axis_name``; call inside ``jax.shard_map``.

    Args:
        q, k, v: this device's shard, in ``layout`` order (``S = N * q_shard``); N must divide
            ``heads``, and divide or be a multiple of ``kv_heads``.
        mask: the global ``(S, S)`` mask on original token positions; a MultiHeadMask must give
            every device's ``heads / N`` heads the same masks.
        axis_name: the mesh axis the sequence is sharded over (N devices).
        segment_ids: this shard's segment ids (``q`` and ``kv``, length ``q_shard``) or None.
        layout: ``"contiguous"``, ``"zigzag"`` or ``"striped"`` (see ``ringsplash.layouts``);
            every device sees the whole sequence, so the layout does not change the balance.
        scale: logit scale, None = ``1/sqrt(d)``.
        logit_soft_cap: ``cap * tanh(s / cap)`` on the logits, or None.
        sinks: float ``[heads]`` per-head sink logits (replicated), or None.
        config: Splash block sizes and backend; blocks are fitted to ``S`` (``splash/blocks.py``).
        with_max_logits: also return float32 ``max_logits [heads]`` (replicated): per head the
            largest ``scale · q·k`` over every attended pair, before the soft-cap, sinks
            excluded, ``-inf`` if nothing is attended. Each device computes its own heads'
            maxima over the whole sequence; one all-gather assembles ``[heads]``.
        return_max_logits: deprecated (``DeprecationWarning``): the tuple ``(out, max_logits)``.
    """
    want = outputs("ulysses_attention", with_max_logits=with_max_logits,
                   return_max_logits=return_max_logits, lse_supported=False)
    n = axis_size(axis_name, "ulysses_attention")
    heads, kv_heads, q_len, _, segment_ids = check_local_inputs(
        q, k, v, mask, segment_ids, sinks, config, shards=n, what=f"axis {axis_name!r}", scale=scale,
        logit_soft_cap=logit_soft_cap)
    split = ulysses_heads(heads, kv_heads, n, axis_name)
    seq_len = q_len * n
    perm = layouts.permutation(layout, seq_len, n)
    blocks = fit_gathered_blocks(config, q_len=seq_len, kv_len=seq_len, seq_multiple=math.lcm(n, NUM_LANES),
                                 what="ulysses_attention", head_dim=q.shape[-1], dtype=q.dtype,
                                 sparse=is_sparse(mask, segment_ids is not None))
    config = interpreter_for_mesh(blocks.config, "ulysses_attention")
    local_mask = local_head_mask(mask, split)
    # K / V go to heads inside the Splash call's custom VJP (KvToHeads: float32 sum of repeated heads' dK / dV)
    q, _, _, segment_ids, sinks = sequence_to_heads(q, None, None, segment_ids, sinks, split, axis_name)
    common = {"q_positions": perm, "kv_positions": perm,
              "partial_mode": partial_mode(local_mask, config.backend, config.partial_tiles)}
    info = build_mask_info(local_mask, blocks.block_shape, **common)
    info_dkv = None if config.backend == "xla" else build_mask_info(local_mask, blocks.block_shape_dkv,
                                                                   transpose=True, **common)
    # dK / dV partials of repeated kv heads are summed over their copies in float32 (one final
    # rounding); with no copies there is no sum: written in k's dtype, as single-device Splash writes them
    exchange = KvToHeads(axis_name, split.kv_repeat)
    out = splash_info_attention(q, k, v, info, info_dkv, segment_ids=segment_ids, scale=scale,
                                logit_soft_cap=logit_soft_cap, sinks=sinks, config=config,
                                partial_dtype=jnp.float32 if exchange.sums_partials else None,
                                return_max_logits=want.max_logits, kv_exchange=exchange)
    if want.max_logits:
        out, mx = out
        return want.package(heads_to_sequence(out, axis_name), max_logits=gather_head_maxima(mx, axis_name))
    return heads_to_sequence(out, axis_name)


def ulysses_attention_sharded(
    q: Float[Array, "heads seq d"],
    k: Float[Array, "kv_heads seq d"],
    v: Float[Array, "kv_heads seq dv"],
    mask: masks_lib.AnyMask,
    *,
    mesh: jax.sharding.Mesh,
    axis_name,
    segment_ids: SegmentIds | None = None,
    layout: layouts.Layout = "contiguous",
    scale: float | None = None,
    logit_soft_cap: float | None = None,
    sinks: Float[Array, " heads"] | None = None,
    config: SplashConfig = SplashConfig(),
    return_max_logits: bool = False,
    with_max_logits: bool = False,
) -> Float[Array, "heads seq dv"] | AttentionOutput | tuple:
    """:func:`ulysses_attention` on global arrays already in ``layout`` order over
    ``N = mesh.shape[axis_name]`` shards (``ringsplash.layouts.permute(x, layout, N)``),
    sharded along the sequence over ``axis_name``. The mask is on original positions; the
    output is in ``layout`` order. Other arguments as in :func:`ulysses_attention`."""
    want = outputs("ulysses_attention_sharded", with_max_logits=with_max_logits,
                   return_max_logits=return_max_logits, lse_supported=False)
    n = check_mesh_axis(mesh, "axis_name", axis_name)
    heads, kv_heads, seq_len, _, segment_ids = check_global_inputs(
        q, k, v, mask, segment_ids, sinks, "ulysses_attention", config=config, scale=scale,
        logit_soft_cap=logit_soft_cap,
    )
    split = ulysses_heads(heads, kv_heads, n, axis_name)
    local_head_mask(mask, split)
    layouts.check_layout(layout, seq_len, n)
    fit_gathered_blocks(config, q_len=seq_len, kv_len=seq_len, seq_multiple=math.lcm(n, NUM_LANES),
                        what="ulysses_attention")

    def local(q, k, v, segment_ids, sinks):
        return ulysses_attention(q, k, v, mask, axis_name=axis_name, segment_ids=segment_ids, layout=layout,
                                 scale=scale, logit_soft_cap=logit_soft_cap, sinks=sinks, config=config,
                                 with_max_logits=want.max_logits)

    return run_sharded(local, mesh, axis_name, q, k, v, segment_ids, sinks, want=want)
