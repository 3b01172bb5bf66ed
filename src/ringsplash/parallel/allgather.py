"""All-gather context parallelism (the Llama-3 method) on the Splash kernels.

Queries stay sharded along the sequence on ``axis_name`` (N devices, token ``layout``); K, V
and the kv segment ids are all-gathered over the axis, and each device runs the Splash layer
on (its q positions, all kv positions) of the layout: one MaskInfo built on the host with
``q_shards=N, kv_shards=1`` and the layout's permutation for both sides, so a causal mask with
``layout="zigzag"`` or ``"striped"`` gives every device the same active-block work, as in the
ring.

Backward: the all-gather of K / V is part of the local Splash call's custom VJP
(``splash_info_attention(kv_exchange=...)``), whose backward reduce-scatters (``psum_scatter``,
the optimal collective here) the kernels' float32 dK / dV and casts once, to the dtype of k / v:
the N devices' partial sums are added in float32, as the ring accumulates them. (JAX's own
transpose of a bfloat16 all-gather summed bfloat16 partials, each rounded: bfloat16 dK 22% less
accurate than the ring's on S = 4096, N = 8; issue 39.) The float32 reduce-scatter moves twice
the bytes of a bfloat16 one, as the ring's float32 accumulators do. (libtpu lowers that
reduce-scatter on v5p as an all-reduce + slice, checked on the compiled HLO in
tests/test_parallel_tpu_compile.py.) The gathered K / V are residuals of the local call
(``kv_heads x S x d`` each per device), which saves re-gathering them in the backward.
"""

import dataclasses

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
from ringsplash.splash.attention import splash_info_attention
from ringsplash.splash.blocks import is_sparse
from ringsplash.splash.config import NUM_LANES, SplashConfig
from ringsplash.splash.partial_tiles import partial_mode

__all__ = ["allgather_attention", "allgather_attention_sharded"]


@dataclasses.dataclass(frozen=True)
class _GatherSequence:
    """The ``KvExchange`` of all-gather: local ``[kv_heads, S / N, d]`` -> ``[kv_heads, S, d]``
    along the sequence; backward, the float32 partial gradients reduce-scattered, then cast."""

    axis_name: object
    devices: int  # on the axis

    @property
    def sums_partials(self) -> bool:
        return self.devices > 1

    def gather(self, x):
        return lax.all_gather(x, self.axis_name, axis=1, tiled=True)

    def reduce(self, dx, dtype):
        return lax.psum_scatter(dx, self.axis_name, scatter_dimension=1, tiled=True).astype(dtype)


def allgather_attention(
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
        q, k, v: this device's shard, in ``layout`` order (``S = N * q_shard``).
        mask: the global ``(S, S)`` mask on original token positions.
        axis_name: the mesh axis the sequence is sharded over (N devices).
        segment_ids: this shard's segment ids (``q`` and ``kv``, length ``q_shard``) or None.
        layout: ``"contiguous"``, ``"zigzag"`` or ``"striped"`` (see ``ringsplash.layouts``).
        scale: logit scale, None = ``1/sqrt(d)``.
        logit_soft_cap: ``cap * tanh(s / cap)`` on the logits, or None.
        sinks: float ``[heads]`` per-head sink logits (replicated), or None.
        config: Splash block sizes and backend; blocks are fitted to ``q_shard`` and ``S`` (``splash/blocks.py``).
        with_max_logits: also return float32 ``max_logits [heads]`` (replicated): per head the
            largest ``scale · q·k`` over every attended pair, before the soft-cap, sinks
            excluded, ``-inf`` if nothing is attended; from the local kernel and one ``pmax``.
        return_max_logits: deprecated (``DeprecationWarning``): the tuple ``(out, max_logits)``.
    """
    want = outputs("allgather_attention", with_max_logits=with_max_logits,
                   return_max_logits=return_max_logits, lse_supported=False)
    n = axis_size(axis_name, "allgather_attention")
    _, _, q_len, _, segment_ids = check_local_inputs(
        q, k, v, mask, segment_ids, sinks, config, shards=n, what=f"axis {axis_name!r}", scale=scale,
        logit_soft_cap=logit_soft_cap)
    seq_len = q_len * n
    perm = layouts.permutation(layout, seq_len, n)
    blocks = fit_gathered_blocks(config, q_len=q_len, kv_len=seq_len, seq_multiple=n * NUM_LANES,
                                 what="allgather_attention", head_dim=q.shape[-1], dtype=q.dtype,
                                 sparse=is_sparse(mask, segment_ids is not None))
    config = interpreter_for_mesh(blocks.config, "allgather_attention")
    common = {"q_shards": n, "kv_shards": 1, "q_positions": perm, "kv_positions": perm,
              "partial_mode": partial_mode(mask, config.backend, config.partial_tiles)}
    info = build_mask_info(mask, blocks.block_shape, **common)
    info_dkv = None if config.backend == "xla" else build_mask_info(mask, blocks.block_shape_dkv, transpose=True,
                                                                   **common)
    if segment_ids is not None:
        segment_ids = SegmentIds(q=segment_ids.q, kv=lax.all_gather(segment_ids.kv, axis_name, axis=0, tiled=True))
    # dK / dV partials are summed across the N devices (the reduce-scatter) in float32, with one final
    # rounding; on one device there is no sum: written in k's dtype, as single-device Splash writes them
    exchange = _GatherSequence(axis_name, n)
    result = splash_info_attention(q, k, v, info, info_dkv, q_shard=axis_index(axis_name),
                                   segment_ids=segment_ids, scale=scale, logit_soft_cap=logit_soft_cap, sinks=sinks,
                                   config=config, partial_dtype=jnp.float32 if exchange.sums_partials else None,
                                   return_max_logits=want.max_logits, kv_exchange=exchange)
    if want.max_logits:  # each device saw its own q rows against every key: one pmax
        out, mx = result
        return want.package(out, max_logits=lax.pmax(mx, axis_name))
    return want.package(result)


def allgather_attention_sharded(
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
    """:func:`allgather_attention` on global arrays already in ``layout`` order over
    ``N = mesh.shape[axis_name]`` shards (``ringsplash.layouts.permute(x, layout, N)``),
    sharded along the sequence over ``axis_name``. The mask is on original positions; the
    output is in ``layout`` order. Other arguments as in :func:`allgather_attention`."""
    want = outputs("allgather_attention_sharded", with_max_logits=with_max_logits,
                   return_max_logits=return_max_logits, lse_supported=False)
    n = check_mesh_axis(mesh, "axis_name", axis_name)
    _, _, seq_len, _, segment_ids = check_global_inputs(
        q, k, v, mask, segment_ids, sinks, "allgather_attention", config=config, scale=scale,
        logit_soft_cap=logit_soft_cap,
    )
    layouts.check_layout(layout, seq_len, n)
    fit_gathered_blocks(config, q_len=seq_len // n, kv_len=seq_len, seq_multiple=n * NUM_LANES,
                        what="allgather_attention")

    def local(q, k, v, segment_ids, sinks):
        return allgather_attention(q, k, v, mask, axis_name=axis_name, segment_ids=segment_ids, layout=layout,
                                   scale=scale, logit_soft_cap=logit_soft_cap, sinks=sinks, config=config,
                                   with_max_logits=want.max_logits)

    return run_sharded(local, mesh, axis_name, q, k, v, segment_ids, sinks, want=want)
