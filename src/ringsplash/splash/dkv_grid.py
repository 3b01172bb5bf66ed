"""The dK/dV kernel's grid ``(kv_heads, steps, inner)``: which work-list entry, q head and mask
list a step names (uniform GQA groups or merged lists, ``kernel_backward.py``'s docstring), the
step after it (the fused dq's read-ahead), the index maps of its blocks, and the merged lists."""

import jax.numpy as jnp

from ringsplash.splash._kernel_common import kv_block_of, partial_of, q_block_of

__all__ = ["dkv_count_map", "dkv_entry", "dkv_kv_col_map", "dkv_kv_map", "dkv_mask_map", "dkv_q_map",
           "dkv_q_row_map", "dkv_row_map", "merge_group_lists", "next_dkv_entry"]


def dkv_entry(g, i, j, q_head_ref, list_ref, *, group):
    """``(row of the packed work list, q head, mask list)`` of dK/dV grid step ``(g, i, j)``.

    Uniform groups (``q_head_ref`` None): ``list_ref[g]`` is kv head g's list, whose rows
    the packed arrays ``[lists, steps]`` are, and the q head is ``g * group + j``. Merged:
    row ``g`` of ``[kv_heads, merged_steps]``, the q head stored per entry, ``list_ref``
    maps q heads to lists."""
    if q_head_ref is None:
        row = list_ref[g]
        return row, g * group + j, row
    h = g * group + q_head_ref[g, i]
    return g, h, list_ref[h]


def next_dkv_entry(g, i, j, blocks_ref, q_head_ref, list_ref, *, group, inner, num_steps):
    """``(exists, q head, q block)`` of the dK/dV grid step after ``(g, i, j)`` (within kv head g)."""
    wrap = j == inner - 1
    i_next = jnp.where(wrap, i + 1, i)
    exists = i_next < num_steps
    i_next = jnp.minimum(i_next, num_steps - 1)
    row, h, _ = dkv_entry(g, i_next, jnp.where(wrap, 0, j + 1), q_head_ref, list_ref, group=group)
    return exists, h, q_block_of(blocks_ref[row, i_next])


# dK/dV maps: (kv head g, step i, inner j, *prefetched); prefetched is (blocks, kinds, lists)
# for uniform groups and (blocks, kinds, q_heads, lists) for merged lists (see dkv_entry)
def _dkv_where(g, i, j, prefetched, group):
    blocks, kinds, *rest = prefetched
    q_heads, lists = rest if len(rest) == 2 else (None, rest[0])
    row, h, _ = dkv_entry(g, i, j, q_heads, lists, group=group)
    return blocks[row, i], kinds[row, i], h


def dkv_q_map(g, i, j, *prefetched, group):
    word, _, h = _dkv_where(g, i, j, prefetched, group)
    return h, q_block_of(word), 0


def dkv_row_map(g, i, j, *prefetched, group):
    word, _, h = _dkv_where(g, i, j, prefetched, group)
    return h, 0, q_block_of(word)


def dkv_kv_map(g, i, j, *prefetched, group):
    word, _, _ = _dkv_where(g, i, j, prefetched, group)
    return g, kv_block_of(word), 0


def dkv_q_row_map(g, i, j, *prefetched, group):
    word, _, _ = _dkv_where(g, i, j, prefetched, group)
    return 0, q_block_of(word)  # positions / segment ids of the q block as a (1, bq) row


def dkv_kv_col_map(g, i, j, *prefetched, group):
    word, _, _ = _dkv_where(g, i, j, prefetched, group)
    return kv_block_of(word), 0  # ... of the kv block as a lane-replicated (bkv, 128) column


def dkv_mask_map(g, i, j, *prefetched, group):
    _, kinds, _ = _dkv_where(g, i, j, prefetched, group)
    return jnp.maximum(partial_of(kinds), 0), 0, 0  # transposed blocks [n, bkv, bq]


def dkv_count_map(g, i, j, *prefetched):
    return g, 0, 0


def merge_group_lists(blocks, kinds, head_to_list, group):
    """Per kv head, the packed transposed work lists of its q heads merged by kv block.

    ``blocks, kinds`` are packed ``[lists, steps]`` arrays sorted by kv block;
    ``head_to_list`` is ``[heads]``. Returns int32 ``blocks, kinds, q_head (in group)`` of
    shape ``[kv_heads, group * steps]``. A stable sort by kv block keeps each head's entries
    (and its padding, which repeats its last kv block) in order, so every kv block's entries
    are consecutive: first / last visit stay neighbour comparisons. Works on traced
    schedules (ring steps).
    """
    heads = head_to_list.shape[0]
    kv_heads, steps = heads // group, blocks.shape[-1]
    lists = jnp.asarray(head_to_list, jnp.int32).reshape(kv_heads, group)

    def gather(a):
        return a[lists].reshape(kv_heads, group * steps)  # [kv_heads, group, steps] flattened

    q_head = jnp.broadcast_to(jnp.arange(group, dtype=jnp.int32)[None, :, None], (kv_heads, group, steps))
    fields = [gather(blocks), gather(kinds), q_head.reshape(kv_heads, group * steps)]
    if group == 1:
        return tuple(fields)
    order = jnp.argsort(kv_block_of(fields[0]), axis=1, stable=True)
    return tuple(jnp.take_along_axis(f, order, axis=1) for f in fields)
