"""Splash backward: a dq kernel and a dK/dV kernel, both recomputing probabilities from lse.

With ``s`` the (scaled, soft-capped) scores, ``P = exp(s - lse)``, ``dP = dO @ V.T`` and
``delta = rowsum(dO * O)`` (computed outside), the score gradient is
``dS = P * (dP - delta)`` (times ``1 - tanh^2`` under a soft-cap); then
``dQ = scale * dS @ K``, ``dK = scale * dS.T @ Q`` and ``dV = P.T @ dO``.

* dq kernel: grid ``(heads, max_steps)`` over the forward work list (sorted by q block);
  dq accumulates in float32 VMEM over a q block's run of steps.
* dK/dV kernel: grid ``(kv_heads, merged_steps)``. The merged work list of kv head ``g``
  interleaves the transposed work lists of the q heads of its group, sorted by kv block, so
  dK / dV of a kv block accumulate over every (q head, q block) in VMEM and K / V are never
  repeated in memory. Tiles are computed transposed, ``(kv, q)``, so lse / delta rows
  broadcast without transposes.

Nothing is materialised per kv block: temporaries are the outputs and the lse-shaped rows.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ringsplash.splash.config import NUM_LANES, NUM_SUBLANES
from ringsplash.splash.kernel_forward import MASK_VALUE, NN_DIMS, NT_DIMS, _sds, _semantics, block_mask

# ----------------------------------------------------------------------------------------
# helpers


def _scores_and_tanh(a, b, *, scale, logit_soft_cap):
    """``a @ b.T * scale`` soft-capped, and the tanh needed by the soft-cap derivative."""
    s = lax.dot_general(a, b, NT_DIMS, preferred_element_type=jnp.float32) * scale
    if logit_soft_cap is None:
        return s, None
    t = jnp.tanh(s / logit_soft_cap)
    return logit_soft_cap * t, t


def _score_grad(p, dp, delta, t):
    ds = p * (dp - delta)
    if t is not None:
        ds = ds * (1.0 - t * t)  # d(c * tanh(x / c)) / dx
    return ds


def _dispatch_kinds(kind, compute):
    @pl.when(kind == 2)
    def _full():
        compute("full")

    @pl.when(kind == 1)
    def _partial():
        compute("partial")


def _count_steps(count_ref, i, kind):
    if count_ref is None:
        return

    @pl.when(i == 0)
    def _zero():
        count_ref[...] = jnp.zeros(count_ref.shape, jnp.int32)

    @pl.when(kind > 0)
    def _count():
        count_ref[...] += 1


# ----------------------------------------------------------------------------------------
# kernel bodies


def _dq_kernel(
    # prefetched
    q_block_ref, kv_block_ref, kind_ref, partial_ref, list_ref,
    # inputs
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
    q_pos_ref, kv_pos_ref, q_seg_ref, kv_seg_ref, mask_ref,
    # outputs
    dq_ref, count_ref,
    # scratch
    dq_scr, lse_scr, delta_scr,
    *,
    scale, logit_soft_cap, masks, num_steps,
):
    h, i = pl.program_id(0), pl.program_id(1)
    lst = list_ref[h]
    q_blk = q_block_ref[lst, i]
    kind = kind_ref[lst, i]
    first = (i == 0) | (q_block_ref[lst, jnp.maximum(i - 1, 0)] != q_blk)
    last = (i == num_steps - 1) | (q_block_ref[lst, jnp.minimum(i + 1, num_steps - 1)] != q_blk)
    bq = q_ref.shape[0]

    @pl.when(first)
    def _init():
        dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)
        # lse / delta arrive as (1, bq) rows; keep them as lane-replicated columns
        lse_scr[...] = jnp.transpose(jnp.broadcast_to(lse_ref[...], (NUM_LANES, bq)))
        delta_scr[...] = jnp.transpose(jnp.broadcast_to(delta_ref[...], (NUM_LANES, bq)))

    _count_steps(count_ref, i, kind)

    def compute(which):
        q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
        s, t = _scores_and_tanh(q, k, scale=scale, logit_soft_cap=logit_soft_cap)
        mask = block_mask(
            which, partial_ref[lst, i], lst,
            None if q_pos_ref is None else q_pos_ref[...],
            None if kv_pos_ref is None else kv_pos_ref[...],
            None if q_seg_ref is None else q_seg_ref[...],
            None if kv_seg_ref is None else kv_seg_ref[...],
            None if (which != "partial" or mask_ref is None) else mask_ref[0] != 0,
            masks=masks,
        )
        if mask is not None:
            s = jnp.where(mask, s, MASK_VALUE)
        p = jnp.exp(s - lse_scr[:, :1])
        if mask is not None:
            p = jnp.where(mask, p, 0.0)
        dp = lax.dot_general(do, v, NT_DIMS, preferred_element_type=jnp.float32)
        ds = _score_grad(p, dp, delta_scr[:, :1], t)
        dq_scr[...] += lax.dot_general(ds.astype(k.dtype), k, NN_DIMS, preferred_element_type=jnp.float32)

    _dispatch_kinds(kind, compute)

    @pl.when(last)
    def _finalise():
        dq_ref[...] = (dq_scr[...] * scale).astype(dq_ref.dtype)


def _dkv_kernel(
    # prefetched
    kv_block_ref, q_head_ref, q_block_ref, kind_ref, partial_ref, list_ref,
    # inputs
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
    q_pos_ref, kv_pos_ref, q_seg_ref, kv_seg_ref, mask_ref,
    # outputs
    dk_ref, dv_ref, count_ref,
    # scratch
    dk_scr, dv_scr,
    *,
    scale, logit_soft_cap, masks, num_steps, group,
):
    g, i = pl.program_id(0), pl.program_id(1)
    kv_blk = kv_block_ref[g, i]
    kind = kind_ref[g, i]
    lst = list_ref[g * group + q_head_ref[g, i]]
    first = (i == 0) | (kv_block_ref[g, jnp.maximum(i - 1, 0)] != kv_blk)
    last = (i == num_steps - 1) | (kv_block_ref[g, jnp.minimum(i + 1, num_steps - 1)] != kv_blk)

    @pl.when(first)
    def _init():
        dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
        dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

    _count_steps(count_ref, i, kind)

    def compute(which):
        q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
        # transposed tiles (kv, q): q-side rows (1, bq) broadcast over kv rows
        s, t = _scores_and_tanh(k, q, scale=scale, logit_soft_cap=logit_soft_cap)
        mask = block_mask(
            which, partial_ref[g, i], lst,
            None if q_pos_ref is None else q_pos_ref[...],
            None if kv_pos_ref is None else kv_pos_ref[...],
            None if q_seg_ref is None else q_seg_ref[...],
            None if kv_seg_ref is None else kv_seg_ref[...],
            None if (which != "partial" or mask_ref is None) else mask_ref[0] != 0,
            masks=masks,
        )
        if mask is not None:
            s = jnp.where(mask, s, MASK_VALUE)
        p = jnp.exp(s - lse_ref[...])
        if mask is not None:
            p = jnp.where(mask, p, 0.0)
        dv_scr[...] += lax.dot_general(p.astype(do.dtype), do, NN_DIMS, preferred_element_type=jnp.float32)
        dp = lax.dot_general(v, do, NT_DIMS, preferred_element_type=jnp.float32)
        ds = _score_grad(p, dp, delta_ref[...], t)
        dk_scr[...] += lax.dot_general(ds.astype(q.dtype), q, NN_DIMS, preferred_element_type=jnp.float32)

    _dispatch_kinds(kind, compute)

    @pl.when(last)
    def _finalise():
        dk_ref[...] = (dk_scr[...] * scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


# ----------------------------------------------------------------------------------------
# index maps


def _q_map(h, i, q_blocks, kv_blocks, kinds, partials, lists):
    return h, q_blocks[lists[h], i], 0


def _row_map(h, i, q_blocks, kv_blocks, kinds, partials, lists):
    return h, 0, q_blocks[lists[h], i]  # lse / delta rows [heads, 1, q_len]


def _kv_map(h, i, q_blocks, kv_blocks, kinds, partials, lists, *, group):
    return lax.div(h, group), kv_blocks[lists[h], i], 0  # GQA: q head h reads kv head h // group


def _q_col_map(h, i, q_blocks, kv_blocks, kinds, partials, lists):
    return q_blocks[lists[h], i], 0


def _kv_row_map(h, i, q_blocks, kv_blocks, kinds, partials, lists):
    return 0, kv_blocks[lists[h], i]


def _mask_map(h, i, q_blocks, kv_blocks, kinds, partials, lists):
    return jnp.maximum(partials[lists[h], i], 0), 0, 0  # only partial entries read it


def _count_map(h, i, *prefetched):
    return h, 0, 0


# dK/dV maps: (kv head g, merged step i); the entry names a q head of the group and blocks
def _dkv_q_map(g, i, kv_blocks, q_heads, q_blocks, kinds, partials, lists, *, group):
    return g * group + q_heads[g, i], q_blocks[g, i], 0


def _dkv_row_map(g, i, kv_blocks, q_heads, q_blocks, kinds, partials, lists, *, group):
    return g * group + q_heads[g, i], 0, q_blocks[g, i]


def _dkv_kv_map(g, i, kv_blocks, q_heads, q_blocks, kinds, partials, lists):
    return g, kv_blocks[g, i], 0


def _dkv_q_row_map(g, i, kv_blocks, q_heads, q_blocks, kinds, partials, lists):
    return 0, q_blocks[g, i]  # positions / segment ids of the q block as a (1, bq) row


def _dkv_kv_col_map(g, i, kv_blocks, q_heads, q_blocks, kinds, partials, lists):
    return kv_blocks[g, i], 0  # ... of the kv block as a (bkv, 1) column


def _dkv_mask_map(g, i, kv_blocks, q_heads, q_blocks, kinds, partials, lists):
    return jnp.maximum(partials[g, i], 0), 0, 0  # transposed blocks [n, bkv, bq]


# ----------------------------------------------------------------------------------------
# merged GQA work list


def merge_group_lists(schedule_dkv, head_to_list, group):
    """Per kv head, the transposed work lists of its q heads merged by kv block.

    ``schedule_dkv`` arrays are ``[lists, steps]`` sorted by kv block; ``head_to_list`` is
    ``[heads]``. Returns int32 ``kv_block, q_head (in group), q_block, kind, partial_index``
    of shape ``[kv_heads, group * steps]``. A stable sort by kv block keeps each head's
    entries (and its padding, which repeats its last kv block) in order, so every kv block's
    entries are consecutive: first / last visit stay neighbour comparisons. Works on traced
    schedules (ring steps).
    """
    heads = head_to_list.shape[0]
    kv_heads, steps = heads // group, schedule_dkv.kind.shape[-1]
    lists = head_to_list.reshape(kv_heads, group)

    def gather(a):
        return a[lists].reshape(kv_heads, group * steps)  # [kv_heads, group, steps] flattened

    kv_block = gather(schedule_dkv.kv_block)
    q_head = jnp.broadcast_to(jnp.arange(group, dtype=jnp.int32)[None, :, None], (kv_heads, group, steps))
    q_head = q_head.reshape(kv_heads, group * steps)
    fields = [kv_block, q_head, gather(schedule_dkv.q_block), gather(schedule_dkv.kind),
              gather(schedule_dkv.partial_index)]
    if group == 1:
        return tuple(fields)
    order = jnp.argsort(kv_block, axis=1, stable=True)
    return tuple(jnp.take_along_axis(f, order, axis=1) for f in fields)


# ----------------------------------------------------------------------------------------
# pallas_call wrappers


def _optional_specs(pairs):
    specs, operands, present = [], [], []
    for arr, spec in pairs:
        present.append(arr is not None)
        if arr is not None:
            specs.append(spec)
            operands.append(arr)
    return specs, operands, present


def _unpack(refs, num_prefetch, num_fixed, present, num_outputs, count_steps):
    prefetched, rest = list(refs[:num_prefetch]), list(refs[num_prefetch:])
    inputs, rest = rest[:num_fixed], rest[num_fixed:]
    for flag in present:
        inputs.append(rest.pop(0) if flag else None)
    outputs = [rest.pop(0) for _ in range(num_outputs)] + [rest.pop(0) if count_steps else None]
    return prefetched + inputs + outputs + rest


def splash_dq_kernel(
    q, k, v, d_out, lse, delta, schedule, head_to_list, *,
    q_pos=None, kv_pos=None, q_seg=None, kv_seg=None, mask_blocks=None,
    masks, block_shape, scale, logit_soft_cap=None, out_dtype=jnp.float32,
    interpret=False, vmem_limit_bytes=None, count_steps=False,
):
    """dq over the forward work list. ``lse, delta: [heads, q_len]`` float32; the other
    arguments as in ``splash_forward_kernel``. Returns ``dq [heads, q_len, d]`` in
    ``out_dtype`` (and the per-head count of computing steps with ``count_steps``)."""
    heads, q_len, d = q.shape
    kv_heads = k.shape[0]
    bq, bkv = block_shape
    num_steps = schedule.kind.shape[-1]
    kv_map = functools.partial(_kv_map, group=heads // kv_heads)
    rows = lambda x: x.astype(jnp.float32).reshape(heads, 1, q_len)

    in_specs = [
        pl.BlockSpec((None, bq, d), _q_map),
        pl.BlockSpec((None, bkv, d), kv_map),
        pl.BlockSpec((None, bkv, d), kv_map),
        pl.BlockSpec((None, bq, d), _q_map),
        pl.BlockSpec((None, 1, bq), _row_map),
        pl.BlockSpec((None, 1, bq), _row_map),
    ]
    specs, operands, present = _optional_specs([
        (q_pos, pl.BlockSpec((bq, 1), _q_col_map)),
        (kv_pos, pl.BlockSpec((1, bkv), _kv_row_map)),
        (q_seg, pl.BlockSpec((bq, 1), _q_col_map)),
        (kv_seg, pl.BlockSpec((1, bkv), _kv_row_map)),
        (mask_blocks, pl.BlockSpec((1, bq, bkv), _mask_map)),
    ])
    out_shape = [_sds(q, (heads, q_len, d), out_dtype)]
    out_specs = [pl.BlockSpec((None, bq, d), _q_map)]
    if count_steps:
        out_shape.append(_sds(q, (heads, NUM_SUBLANES, NUM_LANES), jnp.int32))
        out_specs.append(pl.BlockSpec((None, NUM_SUBLANES, NUM_LANES), _count_map))

    body = functools.partial(
        _dq_kernel, scale=scale, logit_soft_cap=logit_soft_cap, masks=tuple(masks), num_steps=num_steps,
    )
    kernel = lambda *refs: body(*_unpack(refs, 5, 6, present, 1, count_steps))
    results = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
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
            dimension_semantics=_semantics(interpret), vmem_limit_bytes=vmem_limit_bytes
        ),
        cost_estimate=pl.CostEstimate(
            flops=6 * heads * num_steps * bq * bkv * d, transcendentals=heads * num_steps * bq * bkv,
            bytes_accessed=int(3 * q.size * q.dtype.itemsize + heads * num_steps * bkv * d * 2 * k.dtype.itemsize),
        ),
        interpret=interpret,
        name="splash_dq",
    )(
        schedule.q_block, schedule.kv_block, schedule.kind, schedule.partial_index, head_to_list,
        q, k, v, d_out, rows(lse), rows(delta), *operands,
    )
    return (results[0], results[1][:, 0, 0]) if count_steps else results[0]


def splash_dkv_kernel(
    q, k, v, d_out, lse, delta, schedule_dkv, head_to_list, *,
    q_pos=None, kv_pos=None, q_seg=None, kv_seg=None, mask_blocks_t=None,
    masks, block_shape, scale, logit_soft_cap=None, out_dtype=jnp.float32,
    interpret=False, vmem_limit_bytes=None, count_steps=False,
):
    """dK, dV over the transposed work list (``block_shape = (bq_dkv, bkv_dkv)``).

    Positions / segment ids: q side int32 ``[1, q_len]`` rows, kv side ``[kv_len, 1]``
    columns. ``mask_blocks_t`` holds the partial blocks transposed, int8
    ``[num_partials, bkv, bq]``. Returns ``dk, dv [kv_heads, kv_len, d]`` in ``out_dtype``
    (and the per-kv-head count of computing steps with ``count_steps``).
    """
    heads, q_len, d = q.shape
    kv_heads, kv_len, _ = k.shape
    group = heads // kv_heads
    bq, bkv = block_shape
    merged = merge_group_lists(schedule_dkv, head_to_list, group)
    num_steps = merged[0].shape[-1]
    rows = lambda x: x.astype(jnp.float32).reshape(heads, 1, q_len)
    q_map = functools.partial(_dkv_q_map, group=group)
    row_map = functools.partial(_dkv_row_map, group=group)

    in_specs = [
        pl.BlockSpec((None, bq, d), q_map),
        pl.BlockSpec((None, bkv, d), _dkv_kv_map),
        pl.BlockSpec((None, bkv, d), _dkv_kv_map),
        pl.BlockSpec((None, bq, d), q_map),
        pl.BlockSpec((None, 1, bq), row_map),
        pl.BlockSpec((None, 1, bq), row_map),
    ]
    specs, operands, present = _optional_specs([
        (q_pos, pl.BlockSpec((1, bq), _dkv_q_row_map)),
        (kv_pos, pl.BlockSpec((bkv, 1), _dkv_kv_col_map)),
        (q_seg, pl.BlockSpec((1, bq), _dkv_q_row_map)),
        (kv_seg, pl.BlockSpec((bkv, 1), _dkv_kv_col_map)),
        (mask_blocks_t, pl.BlockSpec((1, bkv, bq), _dkv_mask_map)),
    ])
    out_shape = [_sds(q, (kv_heads, kv_len, d), out_dtype)] * 2
    out_specs = [pl.BlockSpec((None, bkv, d), _dkv_kv_map)] * 2
    if count_steps:
        out_shape.append(_sds(q, (kv_heads, NUM_SUBLANES, NUM_LANES), jnp.int32))
        out_specs.append(pl.BlockSpec((None, NUM_SUBLANES, NUM_LANES), _count_map))

    body = functools.partial(
        _dkv_kernel, scale=scale, logit_soft_cap=logit_soft_cap, masks=tuple(masks),
        num_steps=num_steps, group=group,
    )
    kernel = lambda *refs: body(*_unpack(refs, 6, 6, present, 2, count_steps))
    results = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(kv_heads, num_steps),
            in_specs=in_specs + specs,
            out_specs=out_specs,
            scratch_shapes=[pltpu.VMEM((bkv, d), jnp.float32), pltpu.VMEM((bkv, d), jnp.float32)],
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=_semantics(interpret), vmem_limit_bytes=vmem_limit_bytes
        ),
        cost_estimate=pl.CostEstimate(
            flops=8 * kv_heads * num_steps * bq * bkv * d, transcendentals=kv_heads * num_steps * bq * bkv,
            bytes_accessed=int(2 * kv_heads * num_steps * bq * d * 2 * q.dtype.itemsize + 4 * k.size * k.dtype.itemsize),
        ),
        interpret=interpret,
        name="splash_dkv",
    )(*merged, head_to_list, q, k, v, d_out, rows(lse), rows(delta), *operands)
    if count_steps:
        return results[0], results[1], results[2][:, 0, 0]
    return results[0], results[1]
