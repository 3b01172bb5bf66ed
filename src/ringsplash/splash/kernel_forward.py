"""Splash forward: a Pallas TPU flash-attention kernel driven by a MaskInfo work list.

Grid ``(heads, max_steps)``. Step ``i`` of head ``h`` visits entry ``i`` of the work list of
the head's mask list (``docs/INTERNALS.md``): the index maps (``_kernel_common``) fetch the
q / k / v / mask blocks that entry names, and the body only computes when the entry's kind
is non-zero. Entries are sorted by q block, so the output block of a q block is resident
over a run of consecutive steps: it is initialised at the first step of the run and
finalised at the last ("first" / "last" = the neighbouring entry names another q block).
Work lists are packed into two int32 words per entry (``_kernel_common.pack_schedule``).

Max logits (``return_max_logits``): at the last step of a q block the kernel also writes the
block's largest attended raw logit ``scale · q·k`` into one 128-lane row of an extra output
``[heads, 1, q_blocks · 128]`` (``MASK_VALUE`` where nothing is attended); the wrapper reduces
it to ``[heads]``. Without a soft-cap that is the max of the running row maxima ``m`` (masked
scores are ``MASK_VALUE``); with one, ``m`` holds capped scores, so a second ``(bq, 128)``
scratch tracks the raw row maxima (no tanh is inverted). No extra pass over K/V.
"""

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ringsplash._internal.softmax import MASK_VALUE, MASKED_LSE
from ringsplash.splash._kernel_common import (
    LN2,
    LOG2E,
    NN_DIMS,
    NT_DIMS,
    count_map,
    dispatch_kinds,
    kind_of,
    kv_map,
    mask_operand_specs,
    pack_schedule,
    partial_of,
    q_block_of,
    q_map,
    row_map,
    run_edges,
    sds,
    semantics,
    tally_step,
    unpack_refs,
)
from ringsplash.splash.quadrants import by_row_halves
from ringsplash.splash.tile_masks import RunColumn, attended_only, lane_tile, tile_mask
from ringsplash.splash.tpu_tiles import NUM_LANES, NUM_SUBLANES

#: the running row max starts here: above MASK_VALUE (masked scores), below any real score
M_START = 0.5 * MASK_VALUE

# ----------------------------------------------------------------------------------------
# kernel body


def _forward_kernel(
    # prefetched
    blocks_ref, kinds_ref, list_ref,
    # inputs
    q_ref, k_ref, v_ref, q_pos_ref, kv_pos_ref, q_seg_ref, kv_seg_ref, mask_ref,
    # outputs
    out_ref, lse_ref, count_ref, max_ref,
    # scratch
    q_scr, m_scr, l_scr, acc_scr, raw_scr,
    *,
    scale, logit_soft_cap, masks, block_kv_compute, num_steps, probs_dtype, precision, column_check,
    quadrant_band, q_pos_starts,
):
    h, i = pl.program_id(0), pl.program_id(1)
    lst = list_ref[h]
    kind = kind_of(kinds_ref[lst, i])
    if q_pos_starts:  # the q block's positions: a run from its start (tile_masks.RunColumn)
        q_pos_ref = RunColumn(q_pos_ref[q_block_of(blocks_ref[lst, i])], q_ref.shape[0])
    first, last = run_edges(blocks_ref, lst, i, num_steps, q_block_of)
    dv = acc_scr.shape[1]

    # Scores in base 2: s2 = log2(e) * scale * q.k, p = exp2(s2 - m2). float32 q is scaled once
    # per q block (a float32 rounding); bfloat16 q is not: a bf16 rounding of q * scale moved
    # lse by ~1e-2, so bf16 scores are scaled per tile instead (one multiply per score).
    prescaled = q_scr is not None

    @pl.when(first)
    def _init():
        if prescaled:
            q_scr[...] = (q_ref[...].astype(jnp.float32) * (scale * LOG2E)).astype(q_scr.dtype)
        m_scr[...] = jnp.full(m_scr.shape, M_START, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)
        if raw_scr is not None:
            raw_scr[...] = jnp.full(raw_scr.shape, MASK_VALUE, jnp.float32)

    tally_step(count_ref, i, kind)

    block_kv = k_ref.shape[0]
    bq = q_ref.shape[0]
    pos_seg_refs = (q_pos_ref, kv_pos_ref, q_seg_ref, kv_seg_ref)
    cap2 = None if logit_soft_cap is None else logit_soft_cap * LOG2E  # the cap in base-2 units

    def slice_step(which, partial, c, rows):
        """One kv-compute slice ``c`` of the tile, on the q ``rows`` (a ``pl.ds``; None: all)."""
        load = (lambda ref: ref[...]) if rows is None else (lambda ref: ref[rows, :])

        def store(ref, value):
            if rows is None:
                ref[...] = value
            else:
                ref[rows, :] = value

        cols = pl.ds(c * block_kv_compute, block_kv_compute)
        q = load(q_scr) if prescaled else load(q_ref)
        k, v = k_ref[cols, :], v_ref[cols, :]
        stored = None
        if which == "partial" and mask_ref is not None:
            stored = (mask_ref[0, :, cols] if rows is None else mask_ref[0, rows, cols]) != 0
        mask = tile_mask(which, partial, lst, pos_seg_refs, stored, masks=masks, kv_slice=cols, q_slice=rows)
        s = lax.dot_general(q, k, NT_DIMS, precision=precision, preferred_element_type=jnp.float32)
        if not prescaled:
            s = s * (scale * LOG2E)
        if raw_scr is not None:  # max logits under a soft-cap: the raw scores' row maxima too
            raw = s if mask is None else jnp.where(mask, s, MASK_VALUE)
            store(raw_scr, jnp.maximum(load(raw_scr), jnp.max(raw, axis=1, keepdims=True)))
        if cap2 is not None:
            s = cap2 * jnp.tanh(s * (1.0 / cap2))
        if mask is not None:  # the mask's only use; masked scores are MASK_VALUE < M_START
            s = jnp.where(mask, s, MASK_VALUE)
            _, v = attended_only(s, None, v, which=which, segments=q_seg_ref is not None, transposed=False,
                                 check=column_check, q_pos_ref=q_pos_ref, kv_pos_ref=kv_pos_ref, kv_slice=cols)
        # Online softmax in base 2: m = running row max, l = running sum of exp2(s - m),
        # acc = running sum of exp2(s - m) @ v, both rescaled by exp2(m_old - m_new).
        # m starts at M_START, above MASK_VALUE, so a masked score's exp2(s - m) is exactly 0
        # even in a row with nothing attended yet (no second where over p).
        # m and l are replicated over the 128 lanes (the native tile), so they broadcast
        # over the tile by repeating whole vregs.
        m_prev, l_prev = load(m_scr), load(l_scr)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp2(m_prev - m_next)
        p = jnp.exp2(s - lane_tile(m_next, block_kv_compute))
        store(m_scr, m_next)
        store(l_scr, alpha * l_prev + jnp.sum(p, axis=1, keepdims=True))
        pv = lax.dot_general(p.astype(probs_dtype), v.astype(probs_dtype), NN_DIMS, precision=precision,
                             preferred_element_type=jnp.float32)
        store(acc_scr, lane_tile(alpha, dv) * load(acc_scr) + pv)

    def compute(which):
        partial = partial_of(kinds_ref[lst, i])
        # statically unrolled slices of the kv block (a rolled loop with dynamic slices ran at half speed)
        for c in range(block_kv // block_kv_compute):
            step = functools.partial(slice_step, which, partial, c)
            if which != "partial" or quadrant_band is None:
                step(None)
            else:
                by_row_halves(step, quadrant_band, blocks_ref[lst, i], bq=bq, block_kv=block_kv,
                              start=c * block_kv_compute, width=block_kv_compute)

    dispatch_kinds(kind, compute, segments=q_seg_ref is not None)

    @pl.when(last)
    def _finalise():
        l = l_scr[...]
        empty = l == 0.0
        l_safe = jnp.where(empty, 1.0, l)
        out_ref[...] = (acc_scr[...] * lane_tile(1.0 / l_safe, dv)).astype(out_ref.dtype)  # acc = 0 if empty
        lse = jnp.where(empty, MASKED_LSE, (m_scr[...] + jnp.log2(l_safe)) * LN2)
        lse_ref[...] = jnp.transpose(lse)[:1, :]  # (bq, lanes) -> (1, bq) row
        if max_ref is not None:  # the block's max raw logit, replicated over the 128 lanes
            rows = m_scr[...] if raw_scr is None else raw_scr[...]
            rows = jnp.where(rows > M_START, rows * LN2, MASK_VALUE)  # base-2 units -> scale · q·k
            max_ref[...] = jnp.max(rows, axis=0, keepdims=True)


# ----------------------------------------------------------------------------------------
# pallas_call wrapper


def splash_forward_kernel(
    q, k, v, schedule, head_to_list, *,
    q_pos=None, kv_pos=None, q_seg=None, kv_seg=None, mask_blocks=None,
    masks, block_shape, block_kv_compute, scale, logit_soft_cap=None, out_dtype=None,
    probs_dtype=None, precision=None, interpret=False, vmem_limit_bytes=None, count_steps=False,
    return_max_logits=False, column_check="scores", quadrant_band=None, q_pos_starts=False,
):
    """Run the forward kernel on one shard pair.

    ``q: [heads, q_len, d]``, ``k: [kv_heads, kv_len, d]``, ``v: [kv_heads, kv_len, dv]`` (v's
    head size may differ from q's and k's). ``schedule`` holds int32
    ``q_block, kv_block, kind, partial_index`` of shape ``[lists, max_steps]``;
    ``head_to_list`` is int32 ``[heads]``. ``q_pos / q_seg`` are int32 ``[q_len, 128]`` (lane-replicated),
    ``kv_pos / kv_seg`` int32 ``[1, kv_len]`` (pass positions only when ``masks`` has a
    mask to evaluate in kernel; ``q_pos_starts``: ``q_pos`` is instead the int32 ``[q_blocks]`` first position
    of each q block, every block a run of consecutive positions). ``mask_blocks`` is int8 ``[num_partials, bq, bkv]`` or
    None. ``masks``: per list, the mask whose ``mask_function`` the kernel may evaluate, or
    None. Returns ``out [heads, q_len, dv]`` (``out_dtype``, default q's), ``lse [heads,
    q_len]`` float32 and, with ``count_steps``, the number of computing steps per head
    ``[heads]``. ``probs_dtype`` (None = q's dtype) is the operand dtype of ``P @ V``
    (``SplashConfig.probs_dtype``); ``precision`` that of both matmuls (``lax.Precision``; None =
    the default: one bfloat16 pass for float32 operands on TPU). The schedule is packed
    (``pack_schedule``) before scalar prefetch. With ``return_max_logits`` a float32 ``[heads]``
    max of the attended raw logits ``scale · q·k`` (before the soft-cap; ``-inf`` for a head with
    nothing attended) follows ``lse`` (before the count). ``quadrant_band`` ``(lo, hi)``: every partial tile
    is of that band over positions equal to the block offsets (``splash.partial_tiles.quadrant_band``), and the
    kernel skips the (row half, kv slice) pairs of partial tiles that no query attends.
    """
    heads, q_len, d = q.shape
    kv_heads, kv_len, _ = k.shape
    dv = v.shape[-1]
    bq, bkv = block_shape
    group = heads // kv_heads
    num_steps = schedule.kind.shape[-1]
    kv_map_g = functools.partial(kv_map, group=group)
    out_dtype = q.dtype if out_dtype is None else out_dtype
    packed = pack_schedule(
        schedule.q_block, schedule.kv_block, schedule.kind, schedule.partial_index,
        q_blocks=q_len // bq, kv_blocks=kv_len // bkv,
        num_partials=0 if mask_blocks is None else mask_blocks.shape[0],
    )

    in_specs = [
        pl.BlockSpec((None, bq, d), q_map),
        pl.BlockSpec((None, bkv, d), kv_map_g),
        pl.BlockSpec((None, bkv, dv), kv_map_g),
    ]
    specs, operands, present = mask_operand_specs(q_pos, kv_pos, q_seg, kv_seg, mask_blocks, bq, bkv,
                                                  q_pos_starts=q_pos_starts)

    out_shape = [
        sds(q, (heads, q_len, dv), out_dtype),
        sds(q, (heads, 1, q_len), jnp.float32),
    ]
    out_specs = [pl.BlockSpec((None, bq, dv), q_map), pl.BlockSpec((None, 1, bq), row_map)]
    if count_steps:
        out_shape.append(sds(q, (heads, NUM_SUBLANES, NUM_LANES), jnp.int32))
        out_specs.append(pl.BlockSpec((None, NUM_SUBLANES, NUM_LANES), count_map))
    if return_max_logits:  # one 128-lane row per (head, q block), reduced below
        out_shape.append(sds(q, (heads, 1, (q_len // bq) * NUM_LANES), jnp.float32))
        out_specs.append(pl.BlockSpec((None, 1, NUM_LANES), row_map))
    raw_max = return_max_logits and logit_soft_cap is not None
    prescale = q.dtype == jnp.float32  # see _forward_kernel

    body = functools.partial(
        _forward_kernel, scale=scale, logit_soft_cap=logit_soft_cap, masks=tuple(masks),
        block_kv_compute=block_kv_compute, num_steps=num_steps,
        probs_dtype=q.dtype if probs_dtype is None else probs_dtype, precision=precision,
        column_check=column_check, quadrant_band=quadrant_band if (bq // 2) % NUM_SUBLANES == 0 else None,
        q_pos_starts=q_pos_starts and q_pos is not None,
    )

    def kernel(*refs):
        refs = unpack_refs(refs, 3, 3, present, 2, count_steps)
        split = 3 + 3 + len(present) + 3  # prefetched, inputs, (out, lse, count)
        head, rest = refs[:split], refs[split:]
        max_ref, rest = (rest[0], rest[1:]) if return_max_logits else (None, rest)
        return body(*head, max_ref, *([] if prescale else [None]), *rest, *([] if raw_max else [None]))

    scratch = [
        pltpu.VMEM((bq, NUM_LANES), jnp.float32),  # m
        pltpu.VMEM((bq, NUM_LANES), jnp.float32),  # l
        pltpu.VMEM((bq, dv), jnp.float32),  # acc
    ]
    if prescale:
        scratch.insert(0, pltpu.VMEM((bq, d), q.dtype))  # q * scale * log2(e)
    if raw_max:
        scratch.append(pltpu.VMEM((bq, NUM_LANES), jnp.float32))  # raw row max
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3, grid=(heads, num_steps), in_specs=in_specs + specs, out_specs=out_specs,
        scratch_shapes=scratch,
    )
    flops = 4 * heads * num_steps * bq * bkv * d
    results = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=semantics(interpret), vmem_limit_bytes=vmem_limit_bytes
        ),
        cost_estimate=pl.CostEstimate(
            flops=flops, transcendentals=heads * num_steps * bq * bkv,
            bytes_accessed=int(q.size * q.dtype.itemsize * 2 + heads * num_steps * bkv * d * 2 * k.dtype.itemsize),
        ),
        interpret=interpret,
        name="splash_forward",
    )(*packed, jnp.asarray(head_to_list, jnp.int32), q, k, v, *operands)
    out, lse = results[0], results[1][:, 0, :]
    extra = ()
    if return_max_logits:
        extra = (block_max_to_heads(results[-1][:, 0, :]),)
    if count_steps:
        return out, lse, *extra, results[2][:, 0, 0]
    return (out, lse, *extra)


def block_max_to_heads(block_max):
    """``[heads, n]`` per-block maxima (``MASK_VALUE`` = nothing attended) -> float32
    ``[heads]``, ``-inf`` for a head with nothing attended."""
    m = jnp.max(block_max, axis=-1)
    return jnp.where(m > jnp.float32(MASK_VALUE), m, -jnp.inf)
