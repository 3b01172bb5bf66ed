"""Splash forward: a Pallas TPU flash-attention kernel driven by a MaskInfo work list.

Grid ``(heads, max_steps)``. Step ``i`` of head ``h`` visits entry ``i`` of the work list of
the head's mask list (``docs/INTERNALS.md``): the index maps below fetch the q / k / v /
mask blocks that entry names, and the body only computes when the entry's kind is non-zero.
Entries are sorted by q block, so the output block of a q block is resident over a run of
consecutive steps: it is initialised at the first step of the run and finalised at the
last ("first" / "last" = the neighbouring entry names another q block).

Scalar prefetch (SMEM, 1 MiB on TPU) holds the work lists *packed*, two int32 words per
entry (``pack_schedule``; the backward kernels use the same layout)::

    blocks word: bits  0-15 q block, bits 16-31 kv block   (both local to the shard)
    kind word:   bits  0-1  kind (0 none, 1 partial, 2 full), bits 2-31 partial_index + 1

so a 128K causal list at blocks 512 (32,896 entries) takes 257 KiB. Kernel bodies and index
maps decode with ``q_block_of`` / ``kv_block_of`` / ``kind_of`` / ``partial_of`` (shifts and
masks only; the masks after arithmetic shifts make them exact for all 32 bits).
"""

import functools

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ringsplash.reference import MASKED_LSE  # lse of a row with nothing to attend (finite)
from ringsplash.splash.config import NUM_LANES, NUM_SUBLANES

#: score given to masked entries before the max; finite so that no inf - inf appears
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
NT_DIMS = (((1,), (1,)), ((), ()))  # a @ b.T
NN_DIMS = (((1,), (0,)), ((), ()))  # a @ b
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
# helpers shared with the backward kernels


def scores(q, k, *, scale, logit_soft_cap):
    """Scaled (and soft-capped) float32 scores ``q @ k.T``."""
    s = lax.dot_general(q, k, NT_DIMS, preferred_element_type=jnp.float32) * scale
    if logit_soft_cap is not None:
        s = logit_soft_cap * jnp.tanh(s / logit_soft_cap)
    return s


def _eval_without_int_sign(closed, *args):
    """Evaluate a closed jaxpr inline, replacing integer ``sign`` (emitted by ``//`` and
    ``%``) with compares: Mosaic's ``sign`` lowering asks for the *default* device's TPU
    generation, which fails when compiling for a TPU topology from a CPU host."""
    env = dict(zip(closed.jaxpr.constvars, closed.consts))
    env.update(zip(closed.jaxpr.invars, args))
    read = lambda var: var.val if isinstance(var, jex_core.Literal) else env[var]
    for eqn in closed.jaxpr.eqns:
        invals = [read(var) for var in eqn.invars]
        sub = eqn.params.get("jaxpr")
        if eqn.primitive is lax.sign_p and jnp.issubdtype(invals[0].dtype, jnp.integer):
            x = invals[0]
            outs = [(x > 0).astype(x.dtype) - (x < 0).astype(x.dtype)]
        elif isinstance(sub, jex_core.ClosedJaxpr) and eqn.primitive.name in ("pjit", "jit", "closed_call"):
            outs = _eval_without_int_sign(sub, *invals)
        else:
            outs = eqn.primitive.bind(*invals, **eqn.params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs))
    return [read(var) for var in closed.jaxpr.outvars]


def mask_function_value(mask, q_pos, kv_pos):
    """``mask.mask_function(q_pos, kv_pos)`` broadcast to a tile, Mosaic-safe."""
    shape = jnp.broadcast_shapes(q_pos.shape, kv_pos.shape)
    closed = jax.make_jaxpr(lambda a, b: jnp.broadcast_to(mask.mask_function(a, b), shape))(q_pos, kv_pos)
    return _eval_without_int_sign(closed, q_pos, kv_pos)[0]


def block_mask(kind, partial, lst, q_pos, kv_pos, q_seg, kv_seg, stored, *, masks):
    """The bool mask of one tile, or None when every entry may attend.

    ``kind`` / ``partial`` / ``lst`` are scalars of the current entry. ``stored`` is the
    loaded partial block (or None), positions / segment ids are broadcastable tiles.
    ``masks`` holds, per list, the 2-D mask whose ``mask_function`` to evaluate in kernel
    (None for lists that never need it). Everything broadcasts, so a (kv, q) tile is made
    by passing q rows ``[1, bq]`` and kv columns ``[bkv, 1]``.
    """
    mask = None
    if kind == "partial":
        fn_mask = None
        if any(m is not None for m in masks):
            for index, m in enumerate(masks):
                if m is None:
                    continue
                value = mask_function_value(m, q_pos, kv_pos)
                fn_mask = value if fn_mask is None else jnp.where(lst == index, value, fn_mask)
        if stored is not None and fn_mask is not None:
            mask = jnp.where(partial >= 0, stored, fn_mask)
        else:
            mask = stored if stored is not None else fn_mask
    if q_seg is not None:
        same = q_seg == kv_seg
        mask = same if mask is None else mask & same
    return mask


def drop_unattended(mask, k, v, *, transposed):
    """``k, v`` with the rows of kv positions that no row of the tile attends set to 0.

    This is the masked-values contract (``reference_attention``): a kv position that no
    query attends never reaches an output or gradient, even when its K / V are NaN or Inf.
    The score ``where`` alone removes a masked K from the forward, but ``P @ V`` multiplies
    a masked V by P = 0 (0 * NaN = NaN) and ``dS @ K`` a masked K by dS = 0, so both are
    zeroed before their matmuls. ``mask`` is the bool tile, ``(q, kv)`` or, ``transposed``,
    ``(kv, q)``; ``k, v`` are ``[bkv, d]``.
    """
    hit = mask.astype(jnp.float32)
    if transposed:
        col = jnp.max(hit, axis=1, keepdims=True)  # (bkv, 1)
    else:  # (1, bkv) row -> (bkv, 1) column through a lane-aligned transpose
        row = jnp.max(hit, axis=0, keepdims=True)
        col = jnp.transpose(jnp.broadcast_to(row, (NUM_LANES, row.shape[1])))[:, :1]
    keep = col > 0.0
    return jnp.where(keep, k, jnp.zeros_like(k)), jnp.where(keep, v, jnp.zeros_like(v))


def _sds(like, shape, dtype):
    """An output shape that varies over the same manual mesh axes as ``like`` (shard_map)."""
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(like).mat)


def _semantics(interpret, arbitrary=1):
    # The TPU interpreter does not account for grid dimensions added by vmap in
    # dimension_semantics (Mosaic does); it only uses them to shuffle parallel dimensions.
    return None if interpret else ("parallel",) + ("arbitrary",) * arbitrary


# ----------------------------------------------------------------------------------------
# kernel body


def _forward_kernel(
    # prefetched
    blocks_ref, kinds_ref, list_ref,
    # inputs
    q_ref, k_ref, v_ref, q_pos_ref, kv_pos_ref, q_seg_ref, kv_seg_ref, mask_ref,
    # outputs
    out_ref, lse_ref, count_ref,
    # scratch
    m_scr, l_scr, acc_scr,
    *,
    scale, logit_soft_cap, masks, block_kv_compute, num_steps, probs_dtype,
):
    h, i = pl.program_id(0), pl.program_id(1)
    lst = list_ref[h]
    q_blk = q_block_of(blocks_ref[lst, i])
    kind = kind_of(kinds_ref[lst, i])
    first = (i == 0) | (q_block_of(blocks_ref[lst, jnp.maximum(i - 1, 0)]) != q_blk)
    last = (i == num_steps - 1) | (q_block_of(blocks_ref[lst, jnp.minimum(i + 1, num_steps - 1)]) != q_blk)

    @pl.when(first)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, MASK_VALUE, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    if count_ref is not None:

        @pl.when(i == 0)
        def _zero_count():
            count_ref[...] = jnp.zeros(count_ref.shape, jnp.int32)

        @pl.when(kind > 0)
        def _count():
            count_ref[...] += 1

    block_kv = k_ref.shape[0]
    q = q_ref[...]

    def compute(which):
        partial = partial_of(kinds_ref[lst, i])

        def body(c, carry):
            cols = pl.ds(pl.multiple_of(c * block_kv_compute, block_kv_compute), block_kv_compute)
            k, v = k_ref[cols, :], v_ref[cols, :]
            stored = None
            if which == "partial" and mask_ref is not None:
                stored = mask_ref[0, :, cols] != 0
            mask = block_mask(
                which, partial, lst,
                None if q_pos_ref is None else q_pos_ref[...],
                None if kv_pos_ref is None else kv_pos_ref[:, cols],
                None if q_seg_ref is None else q_seg_ref[...],
                None if kv_seg_ref is None else kv_seg_ref[:, cols],
                stored, masks=masks,
            )
            if mask is not None:
                k, v = drop_unattended(mask, k, v, transposed=False)
            s = scores(q, k, scale=scale, logit_soft_cap=logit_soft_cap)
            if mask is not None:
                s = jnp.where(mask, s, MASK_VALUE)
            # Online softmax: m = running row max, l = running sum of exp(s - m), acc =
            # running sum of exp(s - m) @ v; rescale both by exp(m_old - m_new) when m grows.
            # m and l are kept replicated across the 128 lanes (native TPU tile layout).
            m_prev, l_prev = m_scr[...], l_scr[...]
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            alpha = jnp.exp(m_prev - m_next)
            p = jnp.exp(s - m_next[:, :1])
            if mask is not None:
                p = jnp.where(mask, p, 0.0)  # a fully masked tile row must add nothing
            m_scr[...] = m_next
            l_scr[...] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
            pv = lax.dot_general(p.astype(probs_dtype), v.astype(probs_dtype), NN_DIMS,
                                 preferred_element_type=jnp.float32)
            acc_scr[...] = alpha[:, :1] * acc_scr[...] + pv
            return carry

        lax.fori_loop(0, block_kv // block_kv_compute, body, 0, unroll=block_kv == block_kv_compute)

    @pl.when(kind == 2)
    def _full():
        compute("full")

    @pl.when(kind == 1)
    def _partial():
        compute("partial")

    @pl.when(last)
    def _finalise():
        l = l_scr[...]
        empty = l == 0.0
        l_safe = jnp.where(empty, 1.0, l)
        out_ref[...] = (acc_scr[...] / l_safe[:, :1]).astype(out_ref.dtype)  # acc = 0 if empty
        lse = jnp.where(empty, MASKED_LSE, m_scr[...] + jnp.log(l_safe))
        lse_ref[...] = jnp.transpose(lse)[:1, :]  # (bq, lanes) -> (1, bq) row


# ----------------------------------------------------------------------------------------
# index maps: (head, step, *prefetched refs) -> block indices


def _q_map(h, i, blocks, kinds, lists):
    return h, q_block_of(blocks[lists[h], i]), 0


def _lse_map(h, i, blocks, kinds, lists):
    return h, 0, q_block_of(blocks[lists[h], i])


def _kv_map(h, i, blocks, kinds, lists, *, group):
    # GQA: q head h reads kv head h // group
    return lax.div(h, group), kv_block_of(blocks[lists[h], i]), 0


def _q_col_map(h, i, blocks, kinds, lists):
    return q_block_of(blocks[lists[h], i]), 0


def _kv_row_map(h, i, blocks, kinds, lists):
    return 0, kv_block_of(blocks[lists[h], i])


def _mask_map(h, i, blocks, kinds, lists):
    # Non-partial entries (index -1) fetch block 0; it is only read by partial entries.
    return jnp.maximum(partial_of(kinds[lists[h], i]), 0), 0, 0


def _count_map(h, i, *prefetched):
    return h, 0, 0


# ----------------------------------------------------------------------------------------
# pallas_call wrapper


def splash_forward_kernel(
    q, k, v, schedule, head_to_list, *,
    q_pos=None, kv_pos=None, q_seg=None, kv_seg=None, mask_blocks=None,
    masks, block_shape, block_kv_compute, scale, logit_soft_cap=None, out_dtype=None,
    probs_dtype=None, interpret=False, vmem_limit_bytes=None, count_steps=False,
):
    """Run the forward kernel on one shard pair.

    ``q: [heads, q_len, d]``, ``k, v: [kv_heads, kv_len, d]``. ``schedule`` holds int32
    ``q_block, kv_block, kind, partial_index`` of shape ``[lists, max_steps]``;
    ``head_to_list`` is int32 ``[heads]``. ``q_pos / q_seg`` are int32 ``[q_len, 1]``,
    ``kv_pos / kv_seg`` int32 ``[1, kv_len]`` (pass positions only when ``masks`` has a
    mask to evaluate in kernel). ``mask_blocks`` is int8 ``[num_partials, bq, bkv]`` or
    None. ``masks``: per list, the mask whose ``mask_function`` the kernel may evaluate, or
    None. Returns ``out [heads, q_len, d]`` (``out_dtype``, default q's), ``lse [heads,
    q_len]`` float32 and, with ``count_steps``, the number of computing steps per head
    ``[heads]``. ``probs_dtype`` (None = q's dtype) is the operand dtype of ``P @ V``
    (``SplashConfig.probs_dtype``). The schedule is packed (``pack_schedule``) before scalar
    prefetch.
    """
    heads, q_len, d = q.shape
    kv_heads, kv_len, _ = k.shape
    bq, bkv = block_shape
    group = heads // kv_heads
    num_steps = schedule.kind.shape[-1]
    kv_map = functools.partial(_kv_map, group=group)
    out_dtype = q.dtype if out_dtype is None else out_dtype
    packed = pack_schedule(
        schedule.q_block, schedule.kv_block, schedule.kind, schedule.partial_index,
        q_blocks=q_len // bq, kv_blocks=kv_len // bkv,
        num_partials=0 if mask_blocks is None else mask_blocks.shape[0],
    )

    in_specs = [
        pl.BlockSpec((None, bq, d), _q_map),
        pl.BlockSpec((None, bkv, d), kv_map),
        pl.BlockSpec((None, bkv, d), kv_map),
    ]
    operands = [q, k, v]
    present = []
    for arr, spec in (
        (q_pos, pl.BlockSpec((bq, 1), _q_col_map)),
        (kv_pos, pl.BlockSpec((1, bkv), _kv_row_map)),
        (q_seg, pl.BlockSpec((bq, 1), _q_col_map)),
        (kv_seg, pl.BlockSpec((1, bkv), _kv_row_map)),
        (mask_blocks, pl.BlockSpec((1, bq, bkv), _mask_map)),
    ):
        present.append(arr is not None)
        if arr is not None:
            in_specs.append(spec)
            operands.append(arr)

    out_shape = [
        _sds(q, (heads, q_len, d), out_dtype),
        _sds(q, (heads, 1, q_len), jnp.float32),
    ]
    out_specs = [pl.BlockSpec((None, bq, d), _q_map), pl.BlockSpec((None, 1, bq), _lse_map)]
    if count_steps:
        out_shape.append(_sds(q, (heads, NUM_SUBLANES, NUM_LANES), jnp.int32))
        out_specs.append(pl.BlockSpec((None, NUM_SUBLANES, NUM_LANES), _count_map))

    body = functools.partial(
        _forward_kernel, scale=scale, logit_soft_cap=logit_soft_cap, masks=tuple(masks),
        block_kv_compute=block_kv_compute, num_steps=num_steps,
        probs_dtype=q.dtype if probs_dtype is None else probs_dtype,
    )

    def kernel(*refs):
        prefetched, rest = refs[:3], list(refs[3:])
        inputs = rest[:3]
        rest = rest[3:]
        for flag in present:
            inputs.append(rest.pop(0) if flag else None)
        outputs = [rest.pop(0), rest.pop(0), rest.pop(0) if count_steps else None]
        return body(*prefetched, *inputs, *outputs, *rest)

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(heads, num_steps),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=[
            pltpu.VMEM((bq, NUM_LANES), jnp.float32),  # m
            pltpu.VMEM((bq, NUM_LANES), jnp.float32),  # l
            pltpu.VMEM((bq, d), jnp.float32),  # acc
        ],
    )
    flops = 4 * heads * num_steps * bq * bkv * d
    results = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=_semantics(interpret), vmem_limit_bytes=vmem_limit_bytes
        ),
        cost_estimate=pl.CostEstimate(
            flops=flops, transcendentals=heads * num_steps * bq * bkv,
            bytes_accessed=int(q.size * q.dtype.itemsize * 2 + heads * num_steps * bkv * d * 2 * k.dtype.itemsize),
        ),
        interpret=interpret,
        name="splash_forward",
    )(*packed, jnp.asarray(head_to_list, jnp.int32), *operands)
    out, lse = results[0], results[1][:, 0, :]
    if count_steps:
        return out, lse, results[2][:, 0, 0]
    return out, lse
