"""Segment-aware block skipping: refine a static work list from the runtime segment ids.

The MaskInfo work lists come from the mask alone. With packed documents most of their block
pairs hold no (query, key) pair of the same segment. Per call, on device:

1. **Summaries** (``block_segments``): each block's segment range ``(lo, hi)`` (min, max id);
   ``lo == hi`` means the block holds a single segment.
2. **Refinement** (``shares_segment``): an entry whose q block and kv block ranges are
   disjoint cannot hold a same-segment pair; its kind becomes 0 (no compute). Exact when the
   ids are sorted (monotone) along the sequence and blocks are runs of consecutive tokens (q
   and kv the same ids): a q block before a kv block with overlapping ranges then shares the
   boundary id. A safe over-approximation otherwise (e.g. unsorted ids, striped layouts):
   skipping is only conservative, the per-element segment compare stays exact.
3. **Compaction** (``compact``): per work list (one row), the kept entries move to the front
   in order; ``num_steps`` counts them. Steps past it repeat the last kept entry with kind 0,
   so a kernel walking the static grid revisits a resident block (no new DMA, no compute),
   and the xla backend stops its loop at ``num_steps``. A major block (q block, or kv block in
   a transposed list) all of whose entries are dropped keeps one kind-0 visit, so its output
   block is still written (zeros / ``MASKED_LSE``, or zero dK / dV).

Kept entries keep their static kind, except that a FULL entry whose q block and kv block
both hold one and the same single segment becomes ``FULL_SAME`` (3): full with no
per-element segment compare (the kernels then build no mask for the tile at all). A FULL
entry spanning several segments stays FULL and compares segments, as every PARTIAL one.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ringsplash._internal.types import Array, Int
from ringsplash.blocksparse.mask_info import BlockSchedule
from ringsplash.masks import FULL

__all__ = ["FULL_SAME", "BlockSegments", "block_segments", "compact", "one_segment", "refine_schedule",
           "refined_kinds", "shares_segment"]

#: kind of a FULL entry whose q and kv blocks lie in one shared segment: the kernels and the
#: xla backend skip the per-element segment compare there (the static kinds are 0, 1, 2)
FULL_SAME = 3


class BlockSegments(NamedTuple):
    """Per-block segment range of one side (q or kv) of a shard, int32 ``[blocks]``."""

    lo: Int[Array, " blocks"]
    hi: Int[Array, " blocks"]


def block_segments(seg: Int[Array, " length"], block: int) -> BlockSegments:
    """``(min, max)`` segment id of each ``block``-token block of ``seg`` (laid-out order)."""
    blocks = jnp.asarray(seg, jnp.int32).reshape(-1, block)
    return BlockSegments(blocks.min(axis=1), blocks.max(axis=1))


def shares_segment(q: BlockSegments, kv: BlockSegments, q_block, kv_block):
    """Whether q block ``q_block`` and kv block ``kv_block`` *may* share a segment (their
    ranges intersect); False proves they share none."""
    return (q.lo[q_block] <= kv.hi[kv_block]) & (kv.lo[kv_block] <= q.hi[q_block])


def one_segment(q: BlockSegments, kv: BlockSegments, q_block, kv_block):
    """Whether every row of q block ``q_block`` and every column of kv block ``kv_block`` are
    in one and the same segment (then the segment compare is all-true)."""
    return (q.lo[q_block] == q.hi[q_block]) & (kv.lo[kv_block] == kv.hi[kv_block]) & (q.lo[q_block] == kv.lo[kv_block])


def refined_kinds(schedule: BlockSchedule, q: BlockSegments, kv: BlockSegments):
    """The schedule's kinds ``[lists, steps]`` with entries that share no segment set to 0 and
    FULL entries inside one shared segment set to ``FULL_SAME`` (kernels skip the compare)."""
    kind = jnp.asarray(schedule.kind, jnp.int32)
    qb = jnp.asarray(schedule.q_block, jnp.int32)
    kb = jnp.asarray(schedule.kv_block, jnp.int32)
    kind = jnp.where((kind == FULL) & one_segment(q, kv, qb, kb), FULL_SAME, kind)
    return jnp.where(shares_segment(q, kv, qb, kb), kind, 0)


def _compact_row(major, kind, fields, num_major: int):
    n = kind.shape[0]
    live = kind > 0
    run_start = jnp.concatenate([jnp.ones((1,), bool), major[1:] != major[:-1]])
    has_live = jnp.zeros((num_major,), jnp.int32).at[major].max(live.astype(jnp.int32)) > 0
    keep = live | (run_start & ~has_live[major])  # a dropped major block keeps one visit
    count = jnp.sum(keep.astype(jnp.int32))
    dest = jnp.where(keep, jnp.cumsum(keep.astype(jnp.int32)) - 1, n)  # n: dropped (out of range)
    step = jnp.arange(n, dtype=jnp.int32)
    last = jnp.minimum(step, count - 1)  # steps past the count repeat the last kept entry
    out = []
    for f in (kind, *fields):
        packed = jnp.zeros_like(f).at[dest].set(f, mode="drop")
        out.append(packed[last])
    out[0] = jnp.where(step < count, out[0], 0)
    return out[0], tuple(out[1:]), count


def compact(major, kind, fields, *, num_major: int):
    """Compact each row of ``[rows, steps]`` work-list arrays (see the module docstring).

    Args:
        major: int32 ``[rows, steps]`` block the list is sorted by (q block, or kv block for a
            transposed list), values in ``[0, num_major)``.
        kind: int32 ``[rows, steps]`` refined kinds (0 = no compute).
        fields: other ``[rows, steps]`` arrays moved with the entries (blocks, partial index).
        num_major: static number of major blocks per shard.

    Returns:
        ``(kind, fields, num_steps)``: the compacted arrays and int32 ``[rows]`` kept counts.
    """
    return jax.vmap(lambda m, k, f: _compact_row(m, k, f, num_major))(major, kind, tuple(fields))


def refine_schedule(
    schedule: BlockSchedule,
    q_seg: Int[Array, " q_len"],
    kv_seg: Int[Array, " kv_len"],
    block_shape: tuple[int, int],
    *,
    transpose: bool,
) -> BlockSchedule:
    """``schedule`` refined by the segment ids and compacted, with ``num_steps`` set.

    Args:
        schedule: one shard pair's static work lists ``[lists, steps]`` (``MaskInfo.schedule``).
        q_seg: int32 segment ids of the pair's q rows (laid-out order).
        kv_seg: int32 segment ids of its kv columns.
        block_shape: ``(block_q, block_kv)`` of the MaskInfo the schedule comes from.
        transpose: whether the lists are kv-major (the dK/dV view).
    """
    bq, bkv = block_shape
    q, kv = block_segments(q_seg, bq), block_segments(kv_seg, bkv)
    kind = refined_kinds(schedule, q, kv)
    qb = jnp.asarray(schedule.q_block, jnp.int32)
    kb = jnp.asarray(schedule.kv_block, jnp.int32)
    major, num_major = (kb, kv.lo.shape[0]) if transpose else (qb, q.lo.shape[0])
    kind, (qb, kb, pidx), count = compact(major, kind, (qb, kb, jnp.asarray(schedule.partial_index, jnp.int32)),
                                          num_major=num_major)
    return schedule._replace(q_block=qb, kv_block=kb, kind=kind, partial_index=pidx, num_steps=count)
