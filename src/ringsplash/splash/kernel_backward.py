"""Splash backward: a dK/dV kernel (with dq fused in) and a dq kernel, recomputing probabilities from lse.

With ``s`` the (scaled, soft-capped) scores, ``P = exp(s - lse)``, ``dP = dO @ V.T`` and
``delta = rowsum(dO * O)`` (computed outside), the score gradient is
``dS = P * (dP - delta)`` (times ``1 - tanh^2`` under a soft-cap); then
``dQ = scale * dS @ K``, ``dK = scale * dS.T @ Q`` and ``dV = P.T @ dO``.

* dK/dV kernel, fused with dq by default (``dq_init``): each tile's ``scale * dS.T @ K`` is added
  into a float32 dq in HBM (``dq_accumulator.py``), so the backward is one pass over the transposed
  work list (5 matmuls per tile) instead of two (7).
* dq kernel: grid ``(heads, max_steps)`` over the forward work list (sorted by q block);
  dq accumulates in float32 VMEM over a q block's run of steps. Used alone (``parts=("dq",)``,
  the ring's last step).
* dK/dV kernel: grid ``(kv_heads, steps, inner)``; dK / dV of a kv block accumulate in float32 VMEM over
  every (q head of the group, q block) that attends it; K / V are never repeated in memory. A GQA group walks
  *uniform* (every q head of the group has the same mask list: kv head ``g`` walks it once, ``inner = group``
  q heads innermost, the prefetched list ``[lists, steps]``) or *merged* (different masks: the group's
  transposed lists merged by kv block, ``[kv_heads, group * steps]`` plus each entry's q head, ``inner = 1``).
  Tiles are computed transposed, ``(kv, q)``: lse / delta rows broadcast without transposes.

Nothing is materialised per kv block: temporaries are the outputs and the lse-shaped rows.
"""

import functools

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ringsplash._internal.softmax import MASK_VALUE
from ringsplash.splash._kernel_common import (
    LOG2E,
    NN_DIMS,
    NT_DIMS,
    SMEM_SPEC,
    TN_DIMS,
    count_map,
    dispatch_kinds,
    kind_of,
    kv_block_of,
    kv_map,
    mask_operand_specs,
    one_call_per_batch_element,
    optional_specs,
    pack_schedule,
    partial_of,
    q_block_of,
    q_map,
    row_map,
    run_edges,
    sds,
    semantics,
    tally_step,
    uniform_group_lists,
    unpack_refs,
)
from ringsplash.splash.dkv_grid import (
    dkv_count_map,
    dkv_entry,
    dkv_kv_col_map,
    dkv_kv_map,
    dkv_mask_map,
    dkv_q_map,
    dkv_q_row_map,
    dkv_row_map,
    merge_group_lists,
    next_dkv_entry,
)
from ringsplash.splash.dq_accumulator import DqAccumulator
from ringsplash.splash.quadrants import by_quadrants
from ringsplash.splash.tile_masks import RunColumn, attended_only, scores_and_tanh, tile_mask
from ringsplash.splash.tpu_tiles import NUM_LANES, NUM_SUBLANES

# ----------------------------------------------------------------------------------------
# helpers


def _score_grad(p, dp, delta, t):
    ds = p * (dp - delta)
    if t is not None:
        ds = ds * (1.0 - t * t)  # d(c * tanh(x / c)) / dx
    return ds


# ----------------------------------------------------------------------------------------
# kernel bodies


def _dq_kernel(
    # prefetched
    blocks_ref, kinds_ref, list_ref,
    # inputs
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
    q_pos_ref, kv_pos_ref, q_seg_ref, kv_seg_ref, mask_ref,
    # outputs
    dq_ref, count_ref,
    # scratch
    dq_scr, lse_scr, delta_scr,
    *,
    scale, logit_soft_cap, masks, num_steps, probs_dtype, precision, column_check, q_pos_starts,
):
    h, i = pl.program_id(0), pl.program_id(1)
    lst = list_ref[h]
    kind = kind_of(kinds_ref[lst, i])
    first, last = run_edges(blocks_ref, lst, i, num_steps, q_block_of)
    bq = q_ref.shape[0]
    if q_pos_starts:  # the q block's positions: a run from its start (tile_masks.RunColumn)
        q_pos_ref = RunColumn(q_pos_ref[q_block_of(blocks_ref[lst, i])], bq)

    @pl.when(first)
    def _init():
        dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)
        # lse / delta arrive as (1, bq) rows; keep them as lane-replicated columns
        lse_scr[...] = jnp.transpose(jnp.broadcast_to(lse_ref[...], (NUM_LANES, bq)))
        delta_scr[...] = jnp.transpose(jnp.broadcast_to(delta_ref[...], (NUM_LANES, bq)))

    tally_step(count_ref, i, kind)

    pos_seg_refs = (q_pos_ref, kv_pos_ref, q_seg_ref, kv_seg_ref)

    def compute(which):
        q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
        stored = None if (which != "partial" or mask_ref is None) else mask_ref[0] != 0
        mask = tile_mask(which, partial_of(kinds_ref[lst, i]), lst, pos_seg_refs, stored, masks=masks)
        s, t = scores_and_tanh(q, k, scale=scale, logit_soft_cap=logit_soft_cap, precision=precision)
        if mask is not None:  # masked scores MASK_VALUE: their p = exp(s - lse) is exactly 0
            s = jnp.where(mask, s, MASK_VALUE)
            t = None if t is None else jnp.where(mask, t, 0.0)  # a masked NaN K's tanh
            k, v = attended_only(s, k, v, which=which, segments=q_seg_ref is not None, transposed=False,
                                 check=column_check, q_pos_ref=q_pos_ref, kv_pos_ref=kv_pos_ref)
        p = jnp.exp(s - lse_scr[:, :1])
        dp = lax.dot_general(do, v, NT_DIMS, precision=precision, preferred_element_type=jnp.float32)
        ds = _score_grad(p, dp, delta_scr[:, :1], t)
        dq_scr[...] += lax.dot_general(ds.astype(probs_dtype), k.astype(probs_dtype), NN_DIMS,
                                       precision=precision, preferred_element_type=jnp.float32)

    dispatch_kinds(kind, compute, segments=q_seg_ref is not None)

    @pl.when(last)
    def _finalise():
        dq_ref[...] = (dq_scr[...] * scale).astype(dq_ref.dtype)


def _dkv_kernel(
    # prefetched
    blocks_ref, kinds_ref, q_head_ref, list_ref,
    # inputs
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
    q_pos_ref, kv_pos_ref, q_seg_ref, kv_seg_ref, mask_ref, dq_init_ref,
    # outputs
    dk_ref, dv_ref, count_ref, dq_hbm,
    # scratch
    dk_scr, dv_scr, dq_slots, dq_sems, dq_state,
    *,
    scale, logit_soft_cap, masks, num_steps, group, inner, probs_dtype, precision, column_check, quadrant_band,
    kv_pos_starts,
):
    del dq_init_ref  # aliased to dq_hbm
    g, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    row, h, lst = dkv_entry(g, i, j, q_head_ref, list_ref, group=group)
    word = blocks_ref[row, i]
    if kv_pos_starts:  # the kv block's positions: a run from its start (tile_masks.RunColumn)
        kv_pos_ref = RunColumn(kv_pos_ref[kv_block_of(word)], k_ref.shape[0])
    kind = kind_of(kinds_ref[row, i])
    # a kv block's run: consecutive steps naming it, each over the `inner` q heads
    first, last = run_edges(blocks_ref, row, i, num_steps, kv_block_of)
    first, last = first & (j == 0), last & (j == inner - 1)
    dq = None if dq_hbm is None else DqAccumulator(
        dq_hbm, dq_slots, dq_sems, dq_state, h=h, q_block=q_block_of(word),
        next_entry=next_dkv_entry(g, i, j, blocks_ref, q_head_ref, list_ref, group=group, inner=inner,
                                   num_steps=num_steps))

    @pl.when(first)
    def _init():
        dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
        dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

    if dq is not None:
        dq.begin(start=(i == 0) & (j == 0))
    tally_step(count_ref, i, kind, j)

    pos_seg_refs = (q_pos_ref, kv_pos_ref, q_seg_ref, kv_seg_ref)
    cap2 = None if logit_soft_cap is None else logit_soft_cap * LOG2E  # the cap in base-2 units

    def sub_tile(which, kv_rows, q_cols):
        """The (kv, q) tile, or its ``kv_rows`` x ``q_cols`` part (``pl.ds``; None: all)."""
        def part(ref, rows=None, cols=None):
            return ref[rows if rows is not None else slice(None), cols if cols is not None else slice(None)]

        q, do, k, v = part(q_ref, q_cols), part(do_ref, q_cols), part(k_ref, kv_rows), part(v_ref, kv_rows)
        # transposed tiles (kv, q): q-side rows (1, bq) broadcast over kv rows
        stored = None if (which != "partial" or mask_ref is None) else part(mask_ref.at[0], kv_rows, q_cols) != 0
        mask = tile_mask(which, partial_of(kinds_ref[row, i]), lst, pos_seg_refs, stored, masks=masks,
                         transposed=True, kv_slice=kv_rows, q_slice=q_cols)
        # base-2 scores: s2 = log2(e) * scale * k.q, p = exp2(s2 - log2(e) * lse) (the lse rows
        # arrive scaled). q is not pre-scaled as in the forward: it changes every step here, and
        # a bf16 rounding of q * scale moved bf16 gradients by an ulp.
        s = lax.dot_general(k, q, NT_DIMS, precision=precision, preferred_element_type=jnp.float32) * (
            scale * LOG2E)
        t = None
        if cap2 is not None:
            t = jnp.tanh(s * (1.0 / cap2))
            s = cap2 * t
        if mask is not None:  # masked scores MASK_VALUE: their p = exp2(s - lse) is exactly 0
            s = jnp.where(mask, s, MASK_VALUE)
            t = None if t is None else jnp.where(mask, t, 0.0)  # a masked NaN K's tanh
            k, v = attended_only(s, k, v, which=which, segments=q_seg_ref is not None, transposed=True,
                                 check=column_check, q_pos_ref=q_pos_ref, kv_pos_ref=kv_pos_ref, kv_slice=kv_rows)
        p = jnp.exp2(s - part(lse_ref, None, q_cols))
        dv_part = lax.dot_general(p.astype(probs_dtype), do.astype(probs_dtype), NN_DIMS, precision=precision,
                                  preferred_element_type=jnp.float32)
        dp = lax.dot_general(v, do, NT_DIMS, precision=precision, preferred_element_type=jnp.float32)
        ds = _score_grad(p, dp, part(delta_ref, None, q_cols), t).astype(probs_dtype)
        dk_part = lax.dot_general(ds, q.astype(probs_dtype), NN_DIMS, precision=precision,
                                  preferred_element_type=jnp.float32)
        if kv_rows is None:
            dv_scr[...] += dv_part
            dk_scr[...] += dk_part
        else:
            dv_scr[kv_rows, :] += dv_part
            dk_scr[kv_rows, :] += dk_part
        if dq is not None:  # dS.T @ K: this tile's share of the q block's dq
            dq.add(scale * lax.dot_general(ds, k.astype(probs_dtype), TN_DIMS, precision=precision,
                                           preferred_element_type=jnp.float32), rows=q_cols)

    def compute(which):
        if which != "partial" or quadrant_band is None:
            sub_tile(which, None, None)
        else:
            by_quadrants(functools.partial(sub_tile, which), quadrant_band, word, bq=q_ref.shape[0],
                         bkv=k_ref.shape[0])

    dispatch_kinds(kind, compute, segments=q_seg_ref is not None)

    if dq is not None:
        dq.end()

    @pl.when(last)
    def _finalise():
        dk_ref[...] = (dk_scr[...] * scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


# ----------------------------------------------------------------------------------------
# pallas_call wrappers


def splash_dq_kernel(
    q, k, v, d_out, lse, delta, schedule, head_to_list, *,
    q_pos=None, kv_pos=None, q_seg=None, kv_seg=None, mask_blocks=None,
    masks, block_shape, scale, logit_soft_cap=None, out_dtype=jnp.float32,
    probs_dtype=None, precision=None, interpret=False, vmem_limit_bytes=None, count_steps=False,
    column_check="scores", q_pos_starts=False,
):
    """dq over the forward work list. ``lse, delta: [heads, q_len]`` float32; the other
    arguments as in ``splash_forward_kernel`` (``probs_dtype``: operand dtype of ``dS @ K``).
    ``v`` and ``d_out`` have v's head size ``dv`` (which may differ from d). Returns ``dq [heads, q_len, d]`` in
    ``out_dtype`` (and the per-head count of computing steps with ``count_steps``); ``precision``: of every matmul."""
    heads, q_len, d = q.shape
    kv_heads = k.shape[0]
    dv = v.shape[-1]
    bq, bkv = block_shape
    num_steps = schedule.kind.shape[-1]
    kv_map_g = functools.partial(kv_map, group=heads // kv_heads)
    rows = lambda x: x.astype(jnp.float32).reshape(heads, 1, q_len)
    packed = pack_schedule(
        schedule.q_block, schedule.kv_block, schedule.kind, schedule.partial_index,
        q_blocks=q_len // bq, kv_blocks=k.shape[1] // bkv,
        num_partials=0 if mask_blocks is None else mask_blocks.shape[0],
    )

    in_specs = [
        pl.BlockSpec((None, bq, d), q_map),
        pl.BlockSpec((None, bkv, d), kv_map_g),
        pl.BlockSpec((None, bkv, dv), kv_map_g),
        pl.BlockSpec((None, bq, dv), q_map),
        pl.BlockSpec((None, 1, bq), row_map),
        pl.BlockSpec((None, 1, bq), row_map),
    ]
    specs, operands, present = mask_operand_specs(q_pos, kv_pos, q_seg, kv_seg, mask_blocks, bq, bkv,
                                                  q_pos_starts=q_pos_starts)
    out_shape = [sds(q, (heads, q_len, d), out_dtype)]
    out_specs = [pl.BlockSpec((None, bq, d), q_map)]
    if count_steps:
        out_shape.append(sds(q, (heads, NUM_SUBLANES, NUM_LANES), jnp.int32))
        out_specs.append(pl.BlockSpec((None, NUM_SUBLANES, NUM_LANES), count_map))

    body = functools.partial(
        _dq_kernel, scale=scale, logit_soft_cap=logit_soft_cap, masks=tuple(masks), num_steps=num_steps,
        probs_dtype=q.dtype if probs_dtype is None else probs_dtype, precision=precision,
        column_check=column_check, q_pos_starts=q_pos_starts and q_pos is not None,
    )
    kernel = lambda *refs: body(*unpack_refs(refs, 3, 6, present, 1, count_steps))
    results = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(heads, num_steps),
            in_specs=in_specs + specs,
            out_specs=out_specs,
            scratch_shapes=[
                pltpu.VMEM((bq, d), jnp.float32),  # dq accumulator
                pltpu.VMEM((bq, NUM_LANES), jnp.float32),  # lse column
                pltpu.VMEM((bq, NUM_LANES), jnp.float32),  # delta column
            ],
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=semantics(interpret), vmem_limit_bytes=vmem_limit_bytes
        ),
        cost_estimate=pl.CostEstimate(
            flops=6 * heads * num_steps * bq * bkv * d, transcendentals=heads * num_steps * bq * bkv,
            bytes_accessed=int(3 * q.size * q.dtype.itemsize + heads * num_steps * bkv * d * 2 * k.dtype.itemsize),
        ),
        interpret=interpret,
        name="splash_dq",
    )(*packed, jnp.asarray(head_to_list, jnp.int32), q, k, v, d_out, rows(lse), rows(delta), *operands)
    return (results[0], results[1][:, 0, 0]) if count_steps else results[0]


def splash_dkv_kernel(
    q, k, v, d_out, lse, delta, schedule_dkv, head_to_list, *,
    q_pos=None, kv_pos=None, q_seg=None, kv_seg=None, mask_blocks_t=None,
    masks, block_shape, scale, logit_soft_cap=None, out_dtype=jnp.float32,
    probs_dtype=None, precision=None, interpret=False, vmem_limit_bytes=None, count_steps=False, dq_init=None,
    column_check="scores", quadrant_band=None, kv_pos_starts=False,
):
    """dK, dV over the transposed work list (``block_shape = (bq_dkv, bkv_dkv)``), and with
    ``dq_init`` also dq (the fused backward).

    ``head_to_list`` (``[heads]``) must be concrete: it picks, statically, the uniform-group
    walk (prefetched list ``[lists, steps]``) or the merged one (``[kv_heads, group *
    steps]``, for groups whose heads have different masks). Positions / segment ids: q side
    int32 ``[1, q_len]`` rows, kv side lane-replicated ``[kv_len, 128]`` columns (``kv_pos_starts``: ``kv_pos``
    is the int32 ``[kv_blocks]`` first position of each kv block, every block a run). ``mask_blocks_t`` holds the
    partial blocks transposed, int8 ``[num_partials, bkv, bq]``. ``probs_dtype`` (None = q's
    dtype) is the operand dtype of ``P.T @ dO``, ``dS.T @ Q`` and ``dS @ K``; ``precision``
    that of every matmul. Returns ``dk [kv_heads, kv_len, d]`` and ``dv [kv_heads, kv_len,
    dv]`` (v's head size) in ``out_dtype``, then with ``count_steps`` the per-kv-head count of
    computing steps, then with ``dq_init`` (float32 ``[heads, q_len, d]``) float32 ``dq_init +
    dq``: the kernel adds each tile's ``scale * dS @ K`` into it in HBM (``dq_accumulator.DqAccumulator``),
    so dq costs no second pass over the work list and no memory beyond its own. ``quadrant_band`` ``(lo, hi)``:
    every partial tile is of that band over positions equal to the block offsets
    (``splash.partial_tiles.quadrant_band``); a partial tile with one (kv half, q half) quadrant that no query
    attends is computed as two sub-tiles without it.
    """
    heads, q_len, d = q.shape
    kv_heads, kv_len, _ = k.shape
    dv = v.shape[-1]
    group = heads // kv_heads
    bq, bkv = block_shape
    fused = dq_init is not None
    blocks, kinds = pack_schedule(
        schedule_dkv.q_block, schedule_dkv.kv_block, schedule_dkv.kind, schedule_dkv.partial_index,
        q_blocks=q_len // bq, kv_blocks=kv_len // bkv,
        num_partials=0 if mask_blocks_t is None else mask_blocks_t.shape[0],
    )
    kv_lists = uniform_group_lists(head_to_list, group)
    if kv_lists is not None:  # walk the shared list once per kv head, q heads innermost
        prefetched = [blocks, kinds, jnp.asarray(kv_lists)]
        inner = group
    else:
        blocks, kinds, q_head = merge_group_lists(blocks, kinds, np.asarray(head_to_list), group)
        prefetched = [blocks, kinds, q_head, jnp.asarray(head_to_list, jnp.int32)]
        inner = 1
    num_steps = blocks.shape[-1]
    rows = lambda x: x.astype(jnp.float32).reshape(heads, 1, q_len)
    maps = {name: functools.partial(fn, group=group) for name, fn in (
        ("q", dkv_q_map), ("row", dkv_row_map), ("kv", dkv_kv_map), ("q_row", dkv_q_row_map),
        ("kv_col", dkv_kv_col_map), ("mask", dkv_mask_map))}

    in_specs = [
        pl.BlockSpec((None, bq, d), maps["q"]),
        pl.BlockSpec((None, bkv, d), maps["kv"]),
        pl.BlockSpec((None, bkv, dv), maps["kv"]),
        pl.BlockSpec((None, bq, dv), maps["q"]),
        pl.BlockSpec((None, 1, bq), maps["row"]),
        pl.BlockSpec((None, 1, bq), maps["row"]),
    ]
    specs, operands, present = optional_specs([
        (q_pos, pl.BlockSpec((1, bq), maps["q_row"])),
        (kv_pos, SMEM_SPEC if kv_pos_starts else pl.BlockSpec((bkv, NUM_LANES), maps["kv_col"])),
        (q_seg, pl.BlockSpec((1, bq), maps["q_row"])),
        (kv_seg, pl.BlockSpec((bkv, NUM_LANES), maps["kv_col"])),
        (mask_blocks_t, pl.BlockSpec((1, bkv, bq), maps["mask"])),
        (dq_init, pl.BlockSpec(memory_space=pl.ANY)),  # the dq accumulator, in HBM
    ])
    out_shape = [sds(q, (kv_heads, kv_len, d), out_dtype), sds(q, (kv_heads, kv_len, dv), out_dtype)]
    out_specs = [pl.BlockSpec((None, bkv, d), maps["kv"]), pl.BlockSpec((None, bkv, dv), maps["kv"])]
    if count_steps:
        out_shape.append(sds(q, (kv_heads, NUM_SUBLANES, NUM_LANES), jnp.int32))
        out_specs.append(pl.BlockSpec((None, NUM_SUBLANES, NUM_LANES), dkv_count_map))
    scratch = [pltpu.VMEM((bkv, d), jnp.float32), pltpu.VMEM((bkv, dv), jnp.float32)]
    aliases = {}
    if fused:
        out_shape.append(sds(q, (heads, q_len, d), jnp.float32))
        out_specs.append(pl.BlockSpec(memory_space=pl.ANY))
        scratch += [pltpu.VMEM((2, bq, d), jnp.float32), pltpu.SemaphoreType.DMA((2, 2)),
                    pltpu.SMEM((3,), jnp.int32)]
        aliases = {len(prefetched) + len(in_specs) + len(operands) - 1: len(out_shape) - 1}

    body = functools.partial(
        _dkv_kernel, scale=scale, logit_soft_cap=logit_soft_cap, masks=tuple(masks),
        num_steps=num_steps, group=group, inner=inner,
        probs_dtype=q.dtype if probs_dtype is None else probs_dtype, precision=precision,
        column_check=column_check,
        quadrant_band=quadrant_band if bq % (2 * NUM_LANES) == 0 and bkv % (2 * NUM_SUBLANES) == 0 else None,
        kv_pos_starts=kv_pos_starts and kv_pos is not None,
    )
    num_prefetch = len(prefetched)

    def kernel(*refs):
        args = unpack_refs(refs, num_prefetch, 6, present, 2, count_steps)
        if num_prefetch == 3:  # uniform: no per-entry q head
            args.insert(2, None)
        if not fused:  # no dq output, slots, semaphores or state
            args = args[:-2] + [None] + args[-2:] + [None, None, None]
        return body(*args)

    visits = kv_heads * num_steps * inner
    call = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=num_prefetch,
            grid=(kv_heads, num_steps, inner),
            in_specs=in_specs + specs,
            out_specs=out_specs,
            scratch_shapes=scratch,
        ),
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=semantics(interpret, arbitrary=2), vmem_limit_bytes=vmem_limit_bytes
        ),
        cost_estimate=pl.CostEstimate(
            flops=(10 if fused else 8) * visits * bq * bkv * d, transcendentals=visits * bq * bkv,
            bytes_accessed=int(2 * visits * bq * d * 2 * q.dtype.itemsize + 4 * k.size * k.dtype.itemsize
                               + (2 * visits * bq * d * 4 if fused else 0)),
        ),
        interpret=interpret,
        name="splash_fused_bwd" if fused else "splash_dkv",
    )
    if fused:
        call = one_call_per_batch_element(call)
    results = list(call(*prefetched, q, k, v, d_out, rows(lse) * LOG2E, rows(delta), *operands))
    if count_steps:
        results[2] = results[2][:, 0, 0]
    return tuple(results)
