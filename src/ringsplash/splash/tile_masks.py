"""One tile of the Splash kernels (private to ``splash/``): its scores, its mask and its masked values.

A tile's mask comes from a stored int8 block, from a banded mask's positions (``band_tile``: one
compare per score) or from a mask's ``mask_function`` on the positions; segment ids add a compare.
``drop_unattended`` / ``attended_only`` zero the K / V rows of kv positions no query of the tile
attends (the masked-values contract), the latter as ``splash/partial_tiles.py`` decided on the host.
"""

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
from jax import lax

from ringsplash._internal.softmax import MASK_VALUE
from ringsplash.splash._kernel_common import NT_DIMS
from ringsplash.splash.tpu_tiles import NUM_LANES, NUM_SUBLANES


def scores_and_tanh(a, b, *, scale, logit_soft_cap, precision=None):
    """Scaled (and soft-capped) float32 scores ``a @ b.T``, and the tanh the soft-cap
    derivative needs (None without a cap)."""
    s = lax.dot_general(a, b, NT_DIMS, precision=precision, preferred_element_type=jnp.float32) * scale
    if logit_soft_cap is None:
        return s, None
    t = jnp.tanh(s / logit_soft_cap)
    return logit_soft_cap * t, t


def lane_tile(x, width):
    """A lane-replicated ``(rows, 128)`` value as ``(rows, width)``: whole vregs repeated when
    ``width`` is a multiple of 128 (no lane shuffles), its first lanes when narrower, else its
    first column broadcast."""
    if width % NUM_LANES == 0:
        return x if width == NUM_LANES else jnp.tile(x, (1, width // NUM_LANES))
    if width < NUM_LANES:
        return x[:, :width]  # every lane holds the row's value: a slice, no lane broadcast
    return jnp.broadcast_to(x[:, :1], (x.shape[0], width))


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


_BAND_LIMIT = 1 << 29  # |q - kv - lo| stays far inside int32 for positions and bounds below this


def band_of(mask):
    """``(lo, hi)`` when ``mask(q, kv)`` is exactly ``lo <= q - kv <= hi`` (a side None is
    unbounded; causal and sliding-window masks), else None. Bounds that could overflow the
    kernels' int32 differences are refused (None: the mask function is evaluated instead).

    A side no position pair of the mask's shape can reach is dropped (a window at least as
    wide as the sequence is causal: one compare per score, not a subtract and a compare), as
    long as the other side bounds the band."""
    band = None if mask is None else mask.band()
    if band is None or max(mask.shape) >= _BAND_LIMIT or any(b is not None and abs(b) >= _BAND_LIMIT for b in band):
        return None
    lo, hi = band
    lo_free = lo is not None and lo <= 1 - mask.shape[1]  # q - kv >= 1 - kv_len always
    hi_free = hi is not None and hi >= mask.shape[0] - 1  # q - kv <= q_len - 1 always
    if lo_free and hi is not None and not hi_free:
        return None, hi
    if hi_free and lo is not None and not lo_free:
        return lo, None
    return band


def band_tile(band, col, row, *, transposed):
    """The bool tile of ``lo <= q - kv <= hi`` from a lane-replicated column side ``col``
    ``(rows, 128)`` and a row side ``row`` ``(1, width)`` (q is the column unless
    ``transposed``). The band's constants are folded into the narrow column before it is
    widened, so the tile costs one compare per score (two with both sides bounded: an
    unsigned compare of ``q - kv - lo`` against ``hi - lo``)."""
    lo, hi = band
    width = row.shape[1]
    if lo is not None and hi is not None:
        d = (lane_tile(col - lo, width) - row) if not transposed else (row - lane_tile(col + lo, width))
        return lax.bitcast_convert_type(d, jnp.uint32) <= jnp.uint32(hi - lo)
    if lo is not None:  # q - kv >= lo
        return lane_tile(col - lo, width) >= row if not transposed else row >= lane_tile(col + lo, width)
    if hi is not None:  # q - kv <= hi
        return lane_tile(col - hi, width) <= row if not transposed else row <= lane_tile(col + hi, width)
    return None


class RunColumn:
    """The lane-replicated ``(rows, 128)`` position column of a block whose tokens are a run of
    consecutive positions ``start, start + 1, ...``, computed from ``start`` (a scalar) instead of
    read from memory; indexed like the column ref it replaces (``[...]``, ``[rows, :]`` with a
    slice or ``pl.ds``). The kernels take a table of block starts in SMEM where the host found every
    block of that side to be such a run (``splash/pallas.py``): a ``[len, 128]`` int32 column in HBM
    costs 512 bytes per token, and a ring's or all-gather's columns cost budget and overlap."""

    def __init__(self, start, rows: int):
        self.start = start
        self.shape = (rows, NUM_LANES)

    def __getitem__(self, index):
        rows = index[0] if isinstance(index, tuple) else slice(None)
        if isinstance(rows, slice):
            first, stop, _ = rows.indices(self.shape[0])
            size = stop - first
        else:  # pl.ds: a (possibly traced) start and a static size
            first, size = rows.start, rows.size
        return self.start + first + lax.broadcasted_iota(jnp.int32, (size, NUM_LANES), 0)


def pick_bool_tile(which, a, b):
    """``a`` where the scalar ``which`` holds, else ``b`` (bool tiles): Mosaic cannot legalise a
    select between bool vectors, so this picks with and / or under a predicate tile."""
    pred = jnp.full(a.shape, which.astype(jnp.int32), jnp.int32) != 0
    return (a & pred) | (b & ~pred)


def block_mask(kind, partial, lst, fn_value, q_seg, kv_seg, stored, *, masks):
    """The bool mask of one tile, or None when every entry may attend.

    ``kind`` / ``partial`` / ``lst`` are scalars of the current entry. ``stored`` is the
    loaded partial block (or None); ``fn_value(mask)`` the tile of one list's mask
    evaluated from positions; segment ids are broadcastable tiles. ``masks`` holds, per
    list, the 2-D mask whose ``mask_function`` to evaluate in kernel (None for lists that
    never need it).
    """
    mask = None
    if kind == "partial":
        fn_mask = None
        for index, m in enumerate(masks):
            if m is None:
                continue
            value = fn_value(m)
            fn_mask = value if fn_mask is None else pick_bool_tile(lst == index, value, fn_mask)
        if stored is not None and fn_mask is not None:
            mask = pick_bool_tile(partial >= 0, stored, fn_mask)
        else:
            mask = stored if stored is not None else fn_mask
    if q_seg is not None and kind != "full_same":  # full_same: one shared segment (segment_blocks)
        same = q_seg == kv_seg
        mask = same if mask is None else mask & same
    return mask


def drop_unattended(s, k, v, *, transposed):
    """``k, v`` with the rows of kv positions that no row of the tile attends set to 0.

    This is the masked-values contract (``reference_attention``): a kv position that no
    query attends never reaches an output or gradient, even when its K / V are NaN or Inf.
    The score ``where`` alone removes a masked K from the scores, but ``P @ V`` multiplies
    a masked V by P = 0 (0 * NaN = NaN) and ``dS @ K`` a masked K by dS = 0, so both are
    zeroed before those matmuls. ``s`` is the tile's scores after the mask's ``where``
    (``MASK_VALUE`` where masked: a kv position is attended iff some score of it is above),
    ``(q, kv)`` or, ``transposed``, ``(kv, q)``; ``k, v`` are ``[bkv, d]`` (either may be None).
    Reading the attended positions off the scores keeps the bool mask to one use (its
    ``where``), so Mosaic need not keep it live across the matmuls.
    """
    if transposed:
        col = jnp.max(s, axis=1, keepdims=True)  # (bkv, 1)
    else:  # (1, bkv) row -> (bkv, 1) column through a lane-aligned transpose
        row = jnp.max(s, axis=0, keepdims=True)
        col = jnp.transpose(jnp.broadcast_to(row, (NUM_LANES, row.shape[1])))[:, :1]
    keep = col > MASK_VALUE
    zero = lambda x: None if x is None else jnp.where(keep, x, jnp.zeros_like(x))
    return zero(k), zero(v)


def attended_only(s, k, v, *, which, segments, transposed, check, q_pos_ref, kv_pos_ref, kv_slice=None):
    """``k, v`` with the rows of kv positions no query of the tile attends zeroed, for a tile of
    kind ``which`` (``segments``: segment ids are given). A partial tile without segment ids goes
    as ``check`` (``splash.partial_tiles.partial_column_check``) allows: ``"none"`` returns ``k,
    v`` unchanged, ``("band", lo, hi)`` keeps the kv rows whose position lies in ``[q_first - hi,
    q_last - lo]`` (the tile's q positions are consecutive); every other tile, and ``"scores"``,
    reads the scores (``drop_unattended``). ``kv_slice``: the kv rows / columns of the tile (None: all)."""
    if which != "partial" or segments:
        check = "scores"
    if check == "none":
        return k, v
    if check == "scores":
        return drop_unattended(s, k, v, transposed=transposed)
    _, lo, hi = check
    if transposed:  # q positions a (1, bq) row, kv positions a lane-replicated (bkv, 128) column
        q_row = q_pos_ref[...]
        q_first, q_last = q_row[:, :1], q_row[:, q_row.shape[1] - 1:]
        kv = (kv_pos_ref[...] if kv_slice is None else kv_pos_ref[kv_slice, :])[:, :1]
    else:  # q positions a lane-replicated (bq, 128) column, kv positions a (1, bkv) row
        rows = q_pos_ref.shape[0]
        q_first = jnp.min(q_pos_ref[:NUM_SUBLANES, :], axis=0, keepdims=True)[:, :1]
        q_last = jnp.max(q_pos_ref[rows - NUM_SUBLANES:, :], axis=0, keepdims=True)[:, :1]
        row = kv_pos_ref[...] if kv_slice is None else kv_pos_ref[:, kv_slice]
        kv = jnp.transpose(jnp.broadcast_to(row, (NUM_LANES, row.shape[1])))[:, :1]  # (bkv, 1)
    keep = None
    if lo is not None:
        keep = kv <= q_last - lo
    if hi is not None:
        above = kv >= q_first - hi
        keep = above if keep is None else keep & above
    zero = lambda x: None if x is None else jnp.where(keep, x, jnp.zeros_like(x))
    return zero(k), zero(v)


def tile_mask(which, partial, lst, pos_seg_refs, stored, *, masks, kv_slice=None, q_slice=None, transposed=False):
    """``block_mask`` of the current tile from its refs: ``pos_seg_refs`` is the ``(q_pos,
    kv_pos, q_seg, kv_seg)`` refs (None where absent); ``kv_slice`` / ``q_slice`` (``pl.ds``; None: all)
    take part of the kv / q side (the forward's kv-compute slices and row halves, the dK/dV kernel's
    sub-tiles); ``transposed``: a (kv, q) tile. Banded masks (``band_of``) are built from the positions by
    ``band_tile``; others by their ``mask_function`` on the widened positions."""
    q_pos, kv_pos, q_seg, kv_seg = pos_seg_refs

    def loader(part, as_row):  # a row side (1, n) is sliced along lanes, a column side (n, 128) along rows
        if part is None:
            return lambda ref: None if ref is None else ref[...]
        return (lambda ref: None if ref is None else ref[:, part]) if as_row else \
            (lambda ref: None if ref is None else ref[part, :])

    load_q, load_kv = loader(q_slice, as_row=transposed), loader(kv_slice, as_row=not transposed)
    qp, kp, qs, ks = load_q(q_pos), load_kv(kv_pos), load_q(q_seg), load_kv(kv_seg)
    # the column side (q of a (q, kv) tile, kv of a transposed (kv, q) one) arrives
    # lane-replicated, (rows, 128): widen it to the row side's width by repeating whole vregs
    widen = lambda col, row: None if col is None else lane_tile(col, row.shape[1])
    col, row = (kp, qp) if transposed else (qp, kp)

    def fn_value(m):
        band = band_of(m)
        if band is not None:
            return band_tile(band, col, row, transposed=transposed)
        wide = widen(col, row)
        return mask_function_value(m, *((row, wide) if transposed else (wide, row)))

    if transposed:
        ks = widen(ks, qs)
    else:
        qs = widen(qs, ks)
    return block_mask(which, partial, lst, fn_value, qs, ks, stored, masks=masks)
