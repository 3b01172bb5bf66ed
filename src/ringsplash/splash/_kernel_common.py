"""Pieces shared by the Splash forward, dq and dK/dV kernels (private to ``splash/``).

Packed work lists: scalar prefetch (SMEM, 1 MiB on TPU) holds the work lists *packed*, two
int32 words per entry::

    blocks word: bits  0-15 q block, bits 16-31 kv block   (both local to the shard)
    kind word:   bits  0-1  kind (0 none, 1 partial, 2 full, 3 full inside one shared
                 segment: no segment compare), bits 2-31 partial_index + 1

so a 128K causal list at blocks 512 (32,896 entries) takes 257 KiB. Kernel bodies and index
maps decode with ``q_block_of`` / ``kv_block_of`` / ``kind_of`` / ``partial_of`` (shifts and
masks only; the masks after arithmetic shifts make them exact for all 32 bits).

Also here: the host-side GQA group check, the index maps of the ``(heads, steps)`` grids of the
forward and dq kernels, and the bookkeeping of optional operands (a tile's scores, mask and
masked values: ``splash/tile_masks.py``).
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ringsplash.splash.config import NUM_LANES

NT_DIMS = (((1,), (1,)), ((), ()))  # a @ b.T
NN_DIMS = (((1,), (0,)), ((), ()))  # a @ b
TN_DIMS = (((0,), (0,)), ((), ()))  # a.T @ b
LOG2E = float(np.log2(np.e))  # the kernels' softmax runs in base 2: exp(x) = exp2(x * LOG2E)
LN2 = float(np.log(2.0))
#: packed work-list layout (see the module docstring)
BLOCK_BITS = 16
BLOCK_FIELD = (1 << BLOCK_BITS) - 1
KIND_BITS = 2
KIND_FIELD = (1 << KIND_BITS) - 1
PARTIAL_FIELD = (1 << (32 - KIND_BITS)) - 1


# ----------------------------------------------------------------------------------------
# packed work lists


def q_block_of(word):
    return word & BLOCK_FIELD


def kv_block_of(word):
    return (word >> BLOCK_BITS) & BLOCK_FIELD


def kind_of(word):
    return word & KIND_FIELD


def partial_of(word):
    return ((word >> KIND_BITS) & PARTIAL_FIELD) - 1  # -1 = evaluate mask_function in kernel


def check_packable(*, q_blocks, kv_blocks, num_partials):
    """Raise unless block indices fit 16 bits and partial indices + 1 fit 30 bits."""
    for name, count in (("q", q_blocks), ("kv", kv_blocks)):
        if count > BLOCK_FIELD + 1:
            raise ValueError(
                f"the packed Splash work list holds {BLOCK_BITS}-bit block indices, so at most "
                f"{BLOCK_FIELD + 1} {name} blocks per shard; got {name}_blocks={count} "
                f"(use larger blocks or more shards)"
            )
    if num_partials > PARTIAL_FIELD:  # partial_index + 1 <= num_partials
        raise ValueError(
            f"the packed Splash work list holds at most {PARTIAL_FIELD} partial mask blocks, "
            f"got {num_partials=}"
        )


def pack_schedule(q_block, kv_block, kind, partial_index, *, q_blocks, kv_blocks, num_partials):
    """Pack int work-list arrays (any equal shapes, possibly traced) into the two int32 words
    of the module docstring: ``(blocks, kinds)``. ``q_blocks`` / ``kv_blocks`` (blocks per
    shard) and ``num_partials`` are the static bounds checked by ``check_packable``."""
    check_packable(q_blocks=q_blocks, kv_blocks=kv_blocks, num_partials=num_partials)
    u32 = lambda x: jnp.asarray(x).astype(jnp.uint32)
    blocks = u32(q_block) | (u32(kv_block) << BLOCK_BITS)
    kinds = u32(kind) | (u32(jnp.asarray(partial_index).astype(jnp.int32) + 1) << KIND_BITS)
    as_i32 = lambda x: lax.bitcast_convert_type(x, jnp.int32)
    return as_i32(blocks), as_i32(kinds)


# ----------------------------------------------------------------------------------------
# GQA groups (host side)


def uniform_group_lists(head_to_list, group):
    """The list of each kv head when every q head of each group uses the same list
    (int32 ``[kv_heads]``), else None. ``head_to_list`` must be concrete (host) values."""
    h2l = np.asarray(head_to_list).reshape(-1, group)
    if np.all(h2l == h2l[:, :1]):
        return h2l[:, 0].astype(np.int32)
    return None


# ----------------------------------------------------------------------------------------
# grid bookkeeping


def sds(like, shape, dtype):
    """An output shape that varies over the same manual mesh axes as ``like`` (shard_map)."""
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(like).mat)


def semantics(interpret, arbitrary=1):
    # The TPU interpreter does not account for grid dimensions added by vmap in
    # dimension_semantics (Mosaic does); it only uses them to shuffle parallel dimensions.
    return None if interpret else ("parallel",) + ("arbitrary",) * arbitrary


def run_edges(blocks_ref, row, i, num_steps, block_of):
    """Whether step ``i`` is the first / last of its run: consecutive entries of work list
    ``row`` naming the same block (``block_of`` = ``q_block_of`` or ``kv_block_of``)."""
    here = block_of(blocks_ref[row, i])
    first = (i == 0) | (block_of(blocks_ref[row, jnp.maximum(i - 1, 0)]) != here)
    last = (i == num_steps - 1) | (block_of(blocks_ref[row, jnp.minimum(i + 1, num_steps - 1)]) != here)
    return first, last


def dispatch_kinds(kind, compute, *, segments=False):
    """``compute("full")`` / ``compute("partial")`` under the entry's kind (0: nothing); with
    ``segments`` (segment ids given) also ``compute("full_same")`` for kind 3 (a full block
    inside one shared segment, from ``segment_blocks.refine_schedule``)."""
    if segments:

        @pl.when(kind == 3)
        def _full_same():
            compute("full_same")

    @pl.when(kind == 2)
    def _full():
        compute("full")

    @pl.when(kind == 1)
    def _partial():
        compute("partial")


def tally_step(count_ref, i, kind, j=0):
    """Count the computing steps into ``count_ref`` (tests; None = not counted)."""
    if count_ref is None:
        return

    @pl.when((i == 0) & (j == 0))
    def _zero():
        count_ref[...] = jnp.zeros(count_ref.shape, jnp.int32)

    @pl.when(kind > 0)
    def _count():
        count_ref[...] += 1


def optional_specs(pairs):
    """``(specs, operands, present)`` of ``(array or None, BlockSpec)`` pairs."""
    specs, operands, present = [], [], []
    for arr, spec in pairs:
        present.append(arr is not None)
        if arr is not None:
            specs.append(spec)
            operands.append(arr)
    return specs, operands, present


#: a whole small operand in scalar memory (a table of block starts, ``tile_masks.RunColumn``)
SMEM_SPEC = pl.BlockSpec(memory_space=pltpu.SMEM)


def mask_operand_specs(q_pos, kv_pos, q_seg, kv_seg, mask_blocks, bq, bkv, *, q_pos_starts: bool = False):
    """``optional_specs`` of the forward / dq kernels' positions, segment ids and partial
    blocks, ``(q, kv)`` tiles: q side lane-replicated ``(bq, 128)`` columns, kv side ``(1, bkv)`` rows;
    ``q_pos_starts``: ``q_pos`` is the int32 ``[q_blocks]`` table of each q block's first position, in SMEM."""
    return optional_specs([
        (q_pos, SMEM_SPEC if q_pos_starts else pl.BlockSpec((bq, NUM_LANES), q_col_map)),
        (kv_pos, pl.BlockSpec((1, bkv), kv_row_map)),
        (q_seg, pl.BlockSpec((bq, NUM_LANES), q_col_map)),
        (kv_seg, pl.BlockSpec((1, bkv), kv_row_map)),
        (mask_blocks, pl.BlockSpec((1, bq, bkv), mask_map)),
    ])


def unpack_refs(refs, num_prefetch, num_fixed, present, num_outputs, with_count):
    """Kernel refs in body order, with None where an optional input / the count is absent."""
    prefetched, rest = list(refs[:num_prefetch]), list(refs[num_prefetch:])
    inputs, rest = rest[:num_fixed], rest[num_fixed:]
    for flag in present:
        inputs.append(rest.pop(0) if flag else None)
    outputs = [rest.pop(0) for _ in range(num_outputs)] + [rest.pop(0) if with_count else None]
    return prefetched + inputs + outputs + rest


# ----------------------------------------------------------------------------------------
# index maps of the (heads, steps) grids (forward, dq): (head, step, *prefetched refs)


def q_map(h, i, blocks, kinds, lists):
    return h, q_block_of(blocks[lists[h], i]), 0


def row_map(h, i, blocks, kinds, lists):
    return h, 0, q_block_of(blocks[lists[h], i])  # lse / delta rows [heads, 1, q_len]


def kv_map(h, i, blocks, kinds, lists, *, group):
    # GQA: q head h reads kv head h // group
    return lax.div(h, group), kv_block_of(blocks[lists[h], i]), 0


def q_col_map(h, i, blocks, kinds, lists):
    return q_block_of(blocks[lists[h], i]), 0  # positions / segment ids as a (bq, 128) column


def kv_row_map(h, i, blocks, kinds, lists):
    return 0, kv_block_of(blocks[lists[h], i])  # ... as a (1, bkv) row


def mask_map(h, i, blocks, kinds, lists):
    # Non-partial entries (index -1) fetch block 0; it is only read by partial entries.
    return jnp.maximum(partial_of(kinds[lists[h], i]), 0), 0, 0


def count_map(h, i, *prefetched):
    return h, 0, 0


# ----------------------------------------------------------------------------------------
# batching


def one_call_per_batch_element(call):
    """``call`` whose ``vmap`` runs it once per batch element (``lax.map``): Pallas cannot add a
    batch axis to an HBM (``memory_space=ANY``) operand such as the fused kernel's dq, and a
    batched model (``jax.vmap`` over examples) reaches the kernel through ``vmap``."""

    @jax.custom_batching.custom_vmap
    def mapped(*args):
        return call(*args)

    @mapped.def_vmap
    def _rule(axis_size, in_batched, *args):
        batched = [a for a, b in zip(args, in_batched) if b]

        def one(xs):
            it = iter(xs)
            return mapped(*(next(it) if b else a for a, b in zip(args, in_batched)))

        outs = lax.map(one, batched)
        return outs, jax.tree.map(lambda _: True, outs)

    return mapped
