"""``decode_attention``: a Pallas TPU kernel for one new query per row against its KV cache, reading only the
cache blocks that hold visible slots.

Each row ``b`` attends the slots ``starts[b] <= slot < lengths[b]`` of its cache ``[kv_heads, max_len, d]``
(``starts`` 0 for a causal mask; a sliding window or a chunk raises it). The grid runs over ``(batch, kv blocks)``;
the kv blocks' index map starts at the row's first live block and clamps to its last, so the steps past a row's
length name the block already in VMEM and the pipeline issues no copy for them: slots past the length (a row shorter
than the batch's longest) cost no HBM bandwidth, only a grid step each; the grid's kv-block bound is the longest
row's block count (traced), so a bucket's padding past every row costs no step. One block holds every kv head of its
slots, and the kernel runs all the query heads of a GQA group against their kv head's block: K and V are read from
HBM once per step, whatever the group size.

The arithmetic is the oracle's (``_local_partial`` in ``decode.py``): float32 scores times ``scale``, the
optional soft-cap, online softmax in float32, ``P`` cast to V's dtype for ``P @ V``. It returns the partial
``(o, lse)`` (float32) that ``decode.py`` merges with the tokens fed earlier in the same program and with the
token itself; a row with nothing visible gives ``o = 0``, ``lse = MASKED_LSE``.

Stale slots (past a row's length) must hold finite values, as for the XLA path: their scores are masked, and
``0 * V`` of a finite ``V`` is 0.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ringsplash._internal.softmax import MASKED_LSE
from ringsplash._internal.types import Array, Float, Int
from ringsplash.splash.tpu_tiles import NUM_LANES, lanes, tile_bytes

#: bytes of K and V that one grid step reads (all kv heads of ``block_kv`` slots): large enough that a step's copy
#: (about 5 us at v5e's 819 GB/s) hides the pipeline's fixed cost per step (about 0.35 us, the Pallas TPU guide's
#: figure), small enough that the double-buffered blocks (8 MiB) sit inside v5e's 16 MiB scoped VMEM. On a v5e
#: chip (2026-12-07, MHA 8 heads of 128, 8K-128K, batch 1 and 8) this was 0.4-7% faster than 2 MiB in every row.
BLOCK_BYTES = 4 << 20
#: the largest block of slots a step reads (one kv head of 128: 1 MiB of bfloat16)
MAX_BLOCK_KV = 4096
#: a grid step's fixed cost in bytes of HBM reads (about 0.35 us, the Pallas TPU guide's figure, at v5e's
#: 819 GB/s): what choosing a smaller block that wastes fewer slots weighs against
STEP_COST_BYTES = 288 << 10
#: the scoped VMEM a call may be compiled with (within v5e's, v6e's and v5p's 64-128 MiB); a call that needs
#: more is refused with ringsplash's error, never Mosaic's
MAX_VMEM_LIMIT = 48 << 20
#: Mosaic's default scoped VMEM on v5e, the smallest of the chips: a call needing less keeps the default
DEFAULT_SCOPED_VMEM = 16 << 20
#: where the kernel's K / V live: ``"hbm"``: constrained to HBM (``pltpu.with_memory_space_constraint``), so every
#: call reads its layer from HBM; ``"auto"``: where XLA places them (compiled for v5e, a cache that fits VMEM, as
#: GQA 8:2's at 8K and batch 1, is copied whole into VMEM at the start of a 4-step decode program and back to HBM
#: after its write). On a v5e chip (2026-12-07, ``a208748``, GQA 8:2, 8,320 slots) ``"hbm"`` decoded at 0.558 ms a
#: token at batch 1 against 0.581 and at 1.538 against 1.536 at batch 8. Read when a call is traced: a program
#: traced before a change keeps its placement (``jax.clear_caches()`` drops it).
CACHE_MEMORY = "hbm"
_CACHE_MEMORIES = ("auto", "hbm")
_F32 = jnp.float32


def vmem_bytes(block_kv: int, kv_heads: int, group: int, head_dim: int, value_dim: int, itemsize: int) -> int:
    """The scoped VMEM one call needs, every buffer at its tiled shape: the double-buffered K and V blocks, q and
    the outputs (double-buffered), the float32 scratch, and the step's float32 score temporaries (s, p and their
    exponentials: four ``[group, block_kv]`` tiles a kv head, counted for one head at a time)."""
    kv = 2 * kv_heads * (tile_bytes(block_kv, head_dim, itemsize) + tile_bytes(block_kv, value_dim, itemsize))
    q = 2 * kv_heads * tile_bytes(group, head_dim, itemsize)
    out = 2 * kv_heads * (tile_bytes(group, value_dim, 4) + tile_bytes(group, NUM_LANES, 4))
    scratch = kv_heads * (2 * tile_bytes(group, NUM_LANES, 4) + tile_bytes(group, value_dim, 4))
    temps = 4 * tile_bytes(group, block_kv, 4)
    return kv + q + out + scratch + temps


def block_kv_for(max_len: int, kv_heads: int, head_dim: int, itemsize: int, block_bytes: int | None = None,
                 value_dim: int | None = None) -> int:
    """The slots per grid step: a multiple of 128 that keeps a step's K and V blocks within ``block_bytes`` as
    VMEM holds them (head sizes padded to whole 128 lanes; None: ``BLOCK_BYTES``; ``value_dim`` None:
    ``head_dim``; at least 128 slots, at most ``MAX_BLOCK_KV`` and ``max_len``), chosen to read the whole cache in
    the least time: blocks x (a block's bytes + ``STEP_COST_BYTES``). A block that does not divide ``max_len``
    makes the last one start ``max_len - block_kv`` in, overlapping the one before, and it reads its whole block
    for the slots the one before did not hold: the largest block under the budget for 8,320 slots (GQA 8:2, 4,096
    slots) read 12,288 for 8,256 live, and ``generate`` at batch 8 ran at 73% of the HBM roofline on a v5e chip
    (2026-12-07, ``a208748``); 2,816-slot blocks read 8,448. ``max_len`` must be a multiple of 128."""
    if max_len % NUM_LANES:
        raise ValueError(f"decode_attention: the cache's max_len must be a multiple of {NUM_LANES}, got {max_len=}")
    block_bytes = BLOCK_BYTES if block_bytes is None else block_bytes
    value_dim = head_dim if value_dim is None else value_dim
    per_slot = kv_heads * (lanes(head_dim) + lanes(value_dim)) * itemsize  # head sizes padded to whole lanes
    cache_lanes = max_len // NUM_LANES
    target = max(1, min(block_bytes // per_slot, MAX_BLOCK_KV, max_len) // NUM_LANES)

    def cost(block_lanes):  # bytes-equivalent of reading the whole cache in blocks of block_lanes x 128 slots
        return -(-cache_lanes // block_lanes) * (block_lanes * NUM_LANES * per_slot + STEP_COST_BYTES)

    return NUM_LANES * min(range(target, 0, -1), key=cost)  # ties: the largest block


# ----------------------------------------------------------------------------------------
# kernel body


def _decode_kernel(
    # prefetched
    layer_ref, starts_ref, lengths_ref,
    # inputs
    q_ref, k_ref, v_ref,
    # outputs
    o_ref, lse_ref,
    # scratch
    m_ref, l_ref, acc_ref,
    *, block_kv: int, max_len: int, scale: float, soft_cap: float | None,
):
    b, j = pl.program_id(0), pl.program_id(1)
    start, length = starts_ref[b], lengths_ref[b]
    block = lax.div(start, block_kv) + j  # the block this step stands for (its copy is skipped past the last)
    first_slot = block * block_kv  # the block's own slots start here; its copy starts at _block_offset
    kv_heads = k_ref.shape[0]

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, _F32)
        l_ref[...] = jnp.zeros(l_ref.shape, _F32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, _F32)

    @pl.when((first_slot < length) & (start < length))
    def _compute():
        slot = _block_offset(block, block_kv, max_len) + lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
        visible = (slot >= jnp.maximum(start, first_slot)) & (slot < length)  # the overlap counted once
        for h in range(kv_heads):  # static: every query head of the group against this kv head's block
            q = q_ref[h]  # [group, d]
            s = lax.dot_general(q, k_ref[h], (((1,), (1,)), ((), ())), preferred_element_type=_F32) * scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            s = jnp.where(visible, s, -jnp.inf)  # [group, block_kv]; every processed block has a visible slot
            m_prev = m_ref[h]  # [group, 128], the lanes equal
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            alpha = jnp.exp(m_prev - m_next)
            p = jnp.exp(s - m_next[:, :1])
            l_ref[h] = alpha * l_ref[h] + jnp.sum(p, axis=1, keepdims=True)
            m_ref[h] = m_next
            pv = lax.dot_general(p.astype(v_ref.dtype), v_ref[h], (((1,), (0,)), ((), ())),
                                 preferred_element_type=_F32)
            acc_ref[h] = alpha[:, :1] * acc_ref[h] + pv

    @pl.when(j == pl.num_programs(1) - 1)
    def _finish():
        for h in range(kv_heads):
            l = l_ref[h]
            empty = l == 0.0  # nothing visible: o = 0, lse = MASKED_LSE
            safe = jnp.where(empty, 1.0, l)
            o_ref[h] = (acc_ref[h] / safe[:, :1]).astype(o_ref.dtype)
            lse_ref[h] = jnp.where(empty, MASKED_LSE, m_ref[h] + jnp.log(safe))


# ----------------------------------------------------------------------------------------
# index maps


def _row_map(b, j, layer_ref, starts_ref, lengths_ref):
    return b, 0, 0, 0


def _live_span(starts, lengths, block_kv: int):
    """The first and last kv blocks holding a row's visible slots (``last >= first``; scalars or per row)."""
    first = lax.div(starts, block_kv)  # lax.div: the operands are >= 0 (jnp's // lowers through sign)
    return first, jnp.maximum(lax.div(jnp.maximum(lengths - 1, 0), block_kv), first)


def _block_offset(block, block_kv: int, max_len: int):
    """The first slot of the copy of kv block ``block``: ``block * block_kv``, except a last block that would run
    past ``max_len`` (``block_kv`` not dividing it) starts ``max_len - block_kv`` in, inside the cache."""
    lanes = jnp.minimum(block * (block_kv // NUM_LANES), (max_len - block_kv) // NUM_LANES)
    return lanes * NUM_LANES  # a product Mosaic can see is a multiple of the sublane tiling


def _kv_map(b, j, layer_ref, starts_ref, lengths_ref, *, block_kv: int, max_len: int):
    """The first slot (an element index) of block ``first + j`` of row ``b`` in layer ``layer_ref[0]``, the block
    clamped to the row's last live one: no copy past the length."""
    first, last = _live_span(starts_ref[b], lengths_ref[b], block_kv)
    return layer_ref[0], b, 0, _block_offset(jnp.minimum(first + j, last), block_kv, max_len), 0


def _live_blocks(starts, lengths, block_kv: int):
    """The most kv blocks any row's visible slots span (at least 1): the grid's traced kv-block bound."""
    first, last = _live_span(starts, lengths, block_kv)
    return jnp.max(last - first + 1).astype(jnp.int32)


# ----------------------------------------------------------------------------------------
# pallas_call wrapper


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "block_kv", "live_grid", "interpret"))
def decode_attention(
    q: Float[Array, "batch heads d"],
    k: Float[Array, "*layers batch kv_heads max_len d"],
    v: Float[Array, "*layers batch kv_heads max_len dv"],
    lengths: Int[Array, " batch"],
    starts: Int[Array, " batch"] | None = None,
    layer: Int[Array, ""] | int = 0,
    *,
    scale: float | None = None,
    soft_cap: float | None = None,
    block_kv: int | None = None,
    live_grid: bool = True,
    interpret: bool | pltpu.InterpretParams = False,
) -> tuple[Float[Array, "batch heads dv"], Float[Array, "batch heads"]]:
    """Float32 ``(o, lse)`` of each row's query heads over its cache slots ``starts[b] <= slot < lengths[b]``
    (``starts`` None: 0). ``k`` and ``v`` may hold every layer's cache (``[layers, batch, ...]``, the
    ``KVCache`` arrays): ``layer`` (an int32 scalar, traced or not) picks one, read in place (a slice passed to the
    kernel would be copied first, every layer of every step). ``heads`` is a multiple of ``kv_heads`` (query head
    ``i`` reads kv head ``i // (heads // kv_heads)``); ``max_len`` a multiple of 128. ``scale`` None: ``d ** -0.5``.
    ``block_kv``: slots per grid step (None: ``block_kv_for``). ``live_grid``: the grid's kv-block steps are the
    most blocks a row's visible slots span (a traced bound), not every block of ``max_len``; the steps past a row's
    last block copy nothing either way, but each costs the pipeline's fixed ~0.35 us: at 32K in a 40,960-slot cache
    (batch 8, MHA), 128 such steps, about the 3% the kernel trailed ``ragged_paged_attention`` by on a v5e chip
    (2026-12-07, with every block). ``interpret``: the Pallas TPU interpreter (CPU tests)."""
    if k.ndim == 4:  # one layer: a leading axis of 1 (a bitcast, no copy)
        k, v = k[None], v[None]
    batch, heads, d = q.shape
    _, _, kv_heads, max_len, dv = v.shape
    if k.shape[1:] != (batch, kv_heads, max_len, d) or v.shape[0] != k.shape[0] or heads % kv_heads:
        raise ValueError(f"decode_attention: expected q [batch, heads, d], k [batch, kv_heads, max_len, d] and v "
                         f"[batch, kv_heads, max_len, dv] with kv_heads dividing heads, got q.shape={q.shape}, "
                         f"k.shape={k.shape}, v.shape={v.shape}")
    if lengths.shape != (batch,) or (starts is not None and starts.shape != (batch,)):
        raise ValueError(f"decode_attention: lengths and starts must be int [batch={batch}], got "
                         f"lengths.shape={lengths.shape}, starts.shape={None if starts is None else starts.shape}")
    if block_kv is None:
        block_kv = block_kv_for(max_len, kv_heads, d, k.dtype.itemsize, value_dim=dv)
    if block_kv > max_len or block_kv % NUM_LANES or block_kv <= 0:
        raise ValueError(f"decode_attention: block_kv must be a positive multiple of {NUM_LANES} at most "
                         f"max_len={max_len}, got {block_kv=}")
    group = heads // kv_heads
    need = vmem_bytes(block_kv, kv_heads, group, d, dv, max(k.dtype.itemsize, v.dtype.itemsize))
    limit = None if need <= DEFAULT_SCOPED_VMEM * 3 // 4 else -(-(need * 5 // 4) // (1 << 20)) * (1 << 20)
    if limit is not None and limit > MAX_VMEM_LIMIT:
        raise ValueError(f"decode_attention: a block of {block_kv} slots of {kv_heads} kv heads (head sizes {d} / "
                         f"{dv}, {k.dtype}) needs {need / 2**20:.1f} MiB of VMEM, over the "
                         f"{MAX_VMEM_LIMIT >> 20} MiB a call may take: pass a smaller block_kv (at least 128), or "
                         f"shard the kv heads")
    scale = d**-0.5 if scale is None else float(scale)
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, max_len)
    starts = jnp.zeros((batch,), jnp.int32) if starts is None else jnp.maximum(starts.astype(jnp.int32), 0)
    empty = starts >= lengths  # nothing visible: (0, 0), so the index map names block 0, never one past the end
    starts, lengths = jnp.where(empty, 0, starts), jnp.where(empty, 0, lengths)
    if CACHE_MEMORY not in _CACHE_MEMORIES:
        raise ValueError(f"ringsplash.inference.decode_kernel.CACHE_MEMORY must be one of {_CACHE_MEMORIES}, got "
                         f"{CACHE_MEMORY!r}")
    # the interpreter has no memory spaces; the constraint cannot run eagerly
    memory = "auto" if interpret or not isinstance(k, jax.core.Tracer) else CACHE_MEMORY
    call = _folding_vmap(block_kv=block_kv, scale=scale, soft_cap=soft_cap, live_grid=live_grid,
                         interpret=interpret, limit=limit, cache_memory=memory)
    return call(jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), starts, lengths, q, k, v)


def _kernel_call(layer, starts, lengths, q, k, v, *, block_kv: int, scale: float, soft_cap: float | None,
                 live_grid: bool, interpret, limit: int | None, cache_memory: str):
    """The ``pallas_call`` of ``decode_attention`` on checked operands (``k``, ``v`` with their layer axis)."""
    batch, heads, d = q.shape
    _, _, kv_heads, max_len, dv = v.shape
    group = heads // kv_heads
    qg = q.reshape(batch, kv_heads, group, d)
    kv_map = functools.partial(_kv_map, block_kv=block_kv, max_len=max_len)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(batch, _live_blocks(starts, lengths, block_kv) if live_grid else pl.cdiv(max_len, block_kv)),
        in_specs=[
            pl.BlockSpec((None, kv_heads, group, d), _row_map),
            # element offsets (Mosaic takes a whole block spec of them): the last block may start off the grid
            pl.BlockSpec((None, None, pl.Element(kv_heads), pl.Element(block_kv), pl.Element(d)), kv_map),
            pl.BlockSpec((None, None, pl.Element(kv_heads), pl.Element(block_kv), pl.Element(dv)), kv_map),
        ],
        out_specs=[
            pl.BlockSpec((None, kv_heads, group, dv), _row_map),
            pl.BlockSpec((None, kv_heads, group, NUM_LANES), _row_map),
        ],
        scratch_shapes=[
            pltpu.VMEM((kv_heads, group, NUM_LANES), _F32),  # m
            pltpu.VMEM((kv_heads, group, NUM_LANES), _F32),  # l
            pltpu.VMEM((kv_heads, group, dv), _F32),  # acc
        ],
    )
    kernel = functools.partial(_decode_kernel, block_kv=block_kv, max_len=max_len, scale=scale, soft_cap=soft_cap)
    live = batch * kv_heads * max_len  # an upper bound: the slots read are at most these
    o, lse = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((batch, kv_heads, group, dv), _F32),
                   jax.ShapeDtypeStruct((batch, kv_heads, group, NUM_LANES), _F32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=None if interpret else ("parallel", "arbitrary"), vmem_limit_bytes=limit),
        cost_estimate=pl.CostEstimate(
            flops=2 * live * group * (d + dv), transcendentals=live * group,
            bytes_accessed=int(live * (d * k.dtype.itemsize + dv * v.dtype.itemsize) + q.size * q.dtype.itemsize)),
        interpret=interpret,
        name="ringsplash_decode_attention",
    )(layer, starts, lengths, qg, *_placed(k, v, cache_memory))
    return o.reshape(batch, heads, dv), lse[..., 0].reshape(batch, heads)


def _placed(k, v, cache_memory: str):
    """``k, v`` placed as ``cache_memory`` (``CACHE_MEMORY``) says."""
    if cache_memory == "auto":
        return k, v
    return tuple(pltpu.with_memory_space_constraint(x, pltpu.HBM) for x in (k, v))


@functools.cache
def _folding_vmap(**static):
    """``_kernel_call`` whose ``jax.vmap`` folds the mapped axis into the batch: one kernel over ``V x batch`` rows
    (a reshape of a one-layer cache: no copy). Pallas' own batching of the scalar-prefetched lengths ran a
    ``while`` loop of kernels with the cache as its loop state, which XLA copied: 320 MiB of temporaries for
    2 x 8 rows of 40,960 slots (v5e compile, 2026-12-07). A batched layer index or a multi-layer cache (whose
    mapped axis is not next to the batch) keeps that path."""
    kernel_call = functools.partial(_kernel_call, **static)
    call = jax.custom_batching.custom_vmap(kernel_call)

    @call.def_vmap
    def _fold(axis_size, in_batched, layer, starts, lengths, q, k, v):
        layer_b, starts_b, lengths_b, q_b, k_b, v_b = in_batched
        if layer_b or not (k_b and v_b) or k.shape[1] != 1:
            axes = [0 if b else None for b in in_batched]
            # Pallas' own batching; the memory-space constraint has no batching rule: XLA places the cache here
            batched = functools.partial(_kernel_call, **{**static, "cache_memory": "auto"})
            return jax.vmap(batched, in_axes=axes)(layer, starts, lengths, q, k, v), (True, True)
        batch = k.shape[2]
        rows = lambda x, b: (x if b else jnp.broadcast_to(x, (axis_size, *x.shape))).reshape(
            axis_size * batch, *x.shape[1 + b:])
        fold = lambda x: x.reshape(1, axis_size * batch, *x.shape[3:])  # [V, 1, batch, ...]: V and batch adjacent
        o, lse = call(layer, rows(starts, starts_b), rows(lengths, lengths_b), rows(q, q_b), fold(k), fold(v))
        return (o.reshape(axis_size, batch, *o.shape[1:]), lse.reshape(axis_size, batch, *lse.shape[1:])), (True, True)

    return call


def decode_attention_reference(q, k, v, lengths, starts=None, *, scale=None, soft_cap=None):
    """The dense float32 oracle of ``decode_attention`` (same arguments but the kernel's): every slot scored,
    the invisible ones masked."""
    batch, heads, d = q.shape
    kv_heads, max_len = k.shape[1], k.shape[2]
    scale = d**-0.5 if scale is None else scale
    starts = jnp.zeros((batch,), jnp.int32) if starts is None else starts
    qg = q.astype(_F32).reshape(batch, kv_heads, heads // kv_heads, d)
    s = jnp.einsum("bhgd,bhkd->bhgk", qg, k.astype(_F32), precision="highest") * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    slot = jnp.arange(max_len)
    visible = (slot[None] >= starts[:, None]) & (slot[None] < lengths[:, None])
    s = jnp.where(visible[:, None, None], s, -jnp.inf)
    m = jnp.max(s, -1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    l = jnp.sum(p, -1)
    safe = jnp.where(l == 0, 1.0, l)
    o = jnp.einsum("bhgk,bhkd->bhgd", p, v.astype(_F32), precision="highest") / safe[..., None]
    lse = jnp.where(l == 0, MASKED_LSE, m[..., 0] + jnp.log(safe))
    return o.reshape(batch, heads, -1), lse.reshape(batch, heads)


__all__ = ["BLOCK_BYTES", "block_kv_for", "decode_attention", "decode_attention_reference", "vmem_bytes"]
