"""The ring's Splash layer, one shard pair at a time: the forward and backward of q shard ``a``
against kv shard ``b`` (``splash_forward`` / ``splash_backward`` on the plan's MaskInfo, the
device's ring schedule in pieces), and whether the pair can share a segment at all."""

import jax.numpy as jnp

from ringsplash.masks.segment_ids import SegmentIds
from ringsplash.splash.attention import splash_backward, splash_forward
from ringsplash.splash.segment_blocks import block_segments, refined_kinds

__all__ = ["block_backward", "block_forward", "shares_segment"]


def block_forward(q, k, v, plan, a, b, q_seg, kv_seg, *, scale, cap, config, max_logits=False, sched=None,
                  out_dtype=jnp.float32):
    """Sink-free ``(o, lse float32)`` of q shard ``a`` against kv shard ``b`` (and the pair's
    per-head max logits with ``max_logits``), ``o`` in ``out_dtype``; ``sched``: this device's ring
    schedule."""
    pos = jnp.asarray(plan.positions)
    seg = None if q_seg is None else SegmentIds(q=q_seg, kv=kv_seg)
    pieces = None if sched is None else sched.pair(plan.info, plan.info_dkv, a, b)[0]
    return splash_forward(
        q, k, v, plan.info, q_shard=a, kv_shard=b, q_positions=pos[a], kv_positions=pos[b],
        segment_ids=seg, scale=scale, logit_soft_cap=cap, config=config, out_dtype=out_dtype,
        return_max_logits=max_logits, pieces=pieces,
    )


def block_backward(q, k, v, d_out, lse, delta, plan, a, b, q_seg, kv_seg, *, scale, cap, config, sched=None,
                   accumulate=None, parts=("dq", "dkv"), grad_dtype=jnp.float32):
    """``(dq, dk, dv)`` of q shard ``a`` against kv shard ``b`` (float32 added into ``accumulate``'s,
    piece by piece, when given; else in ``grad_dtype``). All three ``parts`` run the fused kernel, as
    single-device Splash does (the dK/dV kernel adds each tile's dq into the ring's float32 dq, aliased
    in place: 5 matmuls per tile instead of the split kernels' 7); one part runs its own kernel (the
    ring's last step, ``ring_loop``)."""
    pos = jnp.asarray(plan.positions)
    seg = None if q_seg is None else SegmentIds(q=q_seg, kv=kv_seg)
    pieces, pieces_dkv = (None, None) if sched is None else sched.pair(plan.info, plan.info_dkv, a, b)
    return splash_backward(
        q, k, v, d_out, lse, delta, plan.info, plan.info_dkv, q_shard=a, kv_shard=b,
        q_positions=pos[a], kv_positions=pos[b], segment_ids=seg, scale=scale,
        logit_soft_cap=cap, config=config, pieces=pieces, pieces_dkv=pieces_dkv, accumulate=accumulate,
        parts=parts, fused=config.fused_backward, grad_dtype=grad_dtype,
    )


def shares_segment(plan, a, b, q_seg, kv_seg, config, sched=None):
    """Whether q shard ``a`` and kv shard ``b`` may hold a same-segment pair the mask allows:
    some entry of the pair's static work list survives the segment refinement
    (``splash/segment_blocks.py``; False proves the pair contributes nothing). ``kv_seg`` are
    the ids that travelled with kv shard ``b``. True without segment ids or with
    ``config.segment_skipping`` off. ``sched``: the (per-device) ``RingSchedule`` to read the
    pair's lists from, piece by piece (None = the plan's whole lists)."""
    if q_seg is None or not config.segment_skipping:
        return True
    bq, bkv = plan.info.block_shape
    kv_blocks = block_segments(kv_seg, bkv)
    if sched is None:
        return jnp.any(refined_kinds(plan.info.schedule(a, b), block_segments(q_seg, bq), kv_blocks) > 0)
    pieces, _ = sched.pair(plan.info, plan.info_dkv, a, b)
    hit = False
    for piece, schedule in zip(pieces.pieces, pieces.schedules):
        q_blocks = block_segments(q_seg[piece.start * bq:piece.stop * bq], bq)
        hit = hit | jnp.any(refined_kinds(schedule, q_blocks, kv_blocks) > 0)
    return hit
