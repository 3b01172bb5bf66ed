"""Work lists longer than scalar memory: the SMEM budget and splitting a list into pieces.

The Pallas kernels scalar-prefetch one shard pair's work list into SMEM (packed, two int32
words per entry per list; the merged GQA dK/dV walk three per head). A list longer than the
budget is cut into *pieces*: contiguous ranges of major blocks (q blocks for the forward / dq
view, kv blocks for the transposed dK/dV view), each run by its own kernel call on the slice
of the major-side operands it covers (q, d_out, lse, delta, q positions / ids; or k, v, kv
positions / ids). A major block's entries never straddle two pieces, so each output block is
computed by exactly the steps of the unsplit list, in the same order: same numerics, and no
K/V block is fetched more often than in the unsplit walk (the minor side is read in full by
every piece, but only the blocks its entries name). Piece boundaries are common to every shard
pair (static shapes for the ring's traced pair); each piece is padded to its longest pair.

Budget: ``SplashConfig.smem_budget_bytes`` when set (any backend, so tests can force tiny
budgets on CPU), else 3/4 of the SMEM of the chip generation (``pltpu`` hardware table,
1 MiB per core on v4 / v5e / v5p / v6e / 7x; the rest is left to Mosaic's own scalars), for
the kernel backends; the xla backend has no SMEM and splits only when a budget is set.
"""

import dataclasses
import functools
import weakref
from typing import NamedTuple

import numpy as np

from ringsplash import aot
from ringsplash._internal import caches
from ringsplash.blocksparse.mask_info import BlockSchedule, MaskInfo
from ringsplash.masks import EMPTY
from ringsplash.splash._kernel_common import uniform_group_lists

#: fraction of the chip's SMEM a work list may take (Mosaic keeps scalars of its own there)
SMEM_FRACTION = 0.75
#: the generations the kernels target; with no TPU in sight the budget is their smallest SMEM
_TARGET_CHIPS = ("v4", "v5e", "v5p", "v6e", "tpu7x")
WORD = 4  # bytes of one int32


# ----------------------------------------------------------------------------------------
# budget


def smem_bytes(device_kind: str | None = None) -> int:
    """SMEM bytes per TensorCore of ``device_kind`` (a ``jax.Device.device_kind``); None or
    a non-TPU kind: the smallest SMEM of the generations the kernels target."""
    known = aot.find_chip(device_kind)
    chips = (known,) if known is not None else tuple(aot.chip(c) for c in _TARGET_CHIPS)
    return min(c.smem_bytes for c in chips)


def default_device_kind() -> str | None:
    """The device kind the current trace targets: the abstract mesh's device (inside
    ``shard_map`` over a TPU mesh), else the default device."""
    import jax

    abstract = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if abstract is not None:
        return abstract.device_kind
    return jax.devices()[0].device_kind


def list_budget_bytes(config, device_kind: str | None = None) -> int | None:
    """Bytes a kernel call's prefetched work list may take under ``config``; None = unlimited
    (the xla backend without an explicit ``smem_budget_bytes``)."""
    if config.smem_budget_bytes is not None:
        return config.smem_budget_bytes
    if config.backend == "xla":
        return None
    return int(smem_bytes(device_kind if device_kind is not None else default_device_kind()) * SMEM_FRACTION)


def forward_max_steps(budget: int | None, info: MaskInfo, heads: int, *, what: str = "forward / dq") -> int | None:
    """Longest forward / dq list (steps) under ``budget``: ``[lists, steps]`` x 2 words, plus
    ``head_to_list``."""
    return _steps(budget, fixed=WORD * heads, per_step=2 * WORD * info.num_lists, what=what)


def dkv_max_steps(budget: int | None, info_dkv: MaskInfo, heads: int, kv_heads: int) -> int | None:
    """Longest transposed list under ``budget``: the uniform GQA walk prefetches ``[lists,
    steps]`` x 2 words, the merged walk ``[kv_heads, group * steps]`` x 3 (``kernel_backward``)."""
    h2l = np.asarray(info_dkv.head_to_list)
    h2l = np.broadcast_to(h2l, (heads,)) if h2l.size == 1 else h2l
    if uniform_group_lists(h2l, heads // kv_heads) is not None:
        return _steps(budget, fixed=WORD * kv_heads, per_step=2 * WORD * info_dkv.num_lists, what="dK/dV")
    return _steps(budget, fixed=WORD * heads, per_step=3 * WORD * heads, what="dK/dV (merged GQA walk)")


def _steps(budget, *, fixed, per_step, what) -> int | None:
    if budget is None:
        return None
    steps = (budget - fixed) // per_step
    if steps < 1:
        raise ValueError(
            f"SplashConfig.smem_budget_bytes={budget} cannot hold one step of the {what} work list: "
            f"it needs at least {fixed + per_step} bytes ({fixed} fixed + {per_step} per step)"
        )
    return steps


# ----------------------------------------------------------------------------------------
# splitting (host side, cached per MaskInfo)


class Piece(NamedTuple):
    """A range ``[start, stop)`` of major blocks (q blocks; kv blocks for a transposed view) and
    the ``width`` (steps) of its kernel call: the most entries any shard pair has there."""

    start: int
    stop: int
    width: int


@dataclasses.dataclass(frozen=True, eq=False)
class SplitLists:
    """A MaskInfo's work lists cut into pieces. The lists stay as they are (``arrays``: the
    MaskInfo's ``(q_block, kv_block, kind, partial_index)``, ``[lists, q_shards, kv_shards,
    steps]``); ``bounds[..., j, :]`` (int32 ``[lists, q_shards, kv_shards, pieces, 2]``) holds
    where piece ``j``'s entries start in each list and how many it has. A kernel call's piece
    is cut out at run time (:func:`pair_schedules`), so nothing is padded twice."""

    pieces: tuple[Piece, ...]
    arrays: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
    bounds: np.ndarray
    transpose: bool

    @property
    def steps(self) -> tuple[int, ...]:
        return tuple(p.width for p in self.pieces)


_SPLIT_CACHE: "weakref.WeakKeyDictionary[MaskInfo, dict]" = weakref.WeakKeyDictionary()
caches.register(_SPLIT_CACHE.clear)


def split_work_lists(info: MaskInfo, max_steps: int | None) -> SplitLists:
    """``info``'s work lists in pieces of at most ``max_steps`` entries (None: one piece).

    Raises:
        ValueError: when one major block's entries alone exceed ``max_steps``.
    """
    cache = _SPLIT_CACHE.setdefault(info, {})
    if max_steps not in cache:
        cache[max_steps] = _split(info, max_steps)
    return cache[max_steps]


def _split(info: MaskInfo, max_steps: int | None) -> SplitLists:
    arrays = (info.q_block, info.kv_block, info.kind, info.partial_index)
    n_major = info.kv_blocks_per_shard if info.transpose else info.q_blocks_per_shard
    lead, steps = info.kind.shape[:-1], info.max_steps
    if max_steps is None or steps <= max_steps:
        bounds = np.broadcast_to(np.asarray([0, steps], np.int32), (*lead, 1, 2))
        return SplitLists((Piece(0, n_major, steps),), arrays, bounds, info.transpose)
    if info.major_counts is not None:  # the builder's counts: every pair's, also for a rows-only MaskInfo
        counts = info.major_counts.reshape(-1, n_major)
        own = info.major_counts if info.q_shard_rows is None else info.major_counts[:, list(info.q_shard_rows)]
        return _cut(info, max_steps, arrays, counts, own.reshape(-1, n_major), lead)
    major = (info.kv_block if info.transpose else info.q_block).reshape(-1, steps)
    kind = info.kind.reshape(-1, steps)
    rows = major.shape[0]
    flat = major.astype(np.int32) + (np.arange(rows, dtype=np.int32) * n_major)[:, None]
    every = np.bincount(flat.ravel(), minlength=rows * n_major).reshape(rows, n_major)
    del flat
    # An entry is needed unless it repeats its major block with kind 0: only the trailing
    # padding (repeating the last entry), which the last major block's count loses.
    needed = kind != EMPTY
    needed[:, 1:] |= major[:, 1:] != major[:, :-1]
    needed[:, 0] = True
    padding = np.argmax(needed[:, ::-1], axis=1)  # entries after the last needed one
    counts = every.copy()
    counts[np.arange(rows), major[:, -1].astype(np.int64)] -= padding
    del needed
    csum = np.zeros((rows, n_major + 1), np.int64)
    np.cumsum(counts, axis=1, out=csum[:, 1:])
    first = np.zeros((rows, n_major + 1), np.int64)
    np.cumsum(every, axis=1, out=first[:, 1:])
    return _cut(info, max_steps, arrays, counts, counts, lead, csum=csum, first=first)


def _cut(info: MaskInfo, max_steps: int, arrays, counts, own, lead, *, csum=None, first=None) -> SplitLists:
    """Pieces from ``counts`` ``[pairs, n_major]`` (every pair's entries per major block), and the
    bounds of the pairs ``own`` (the rows the MaskInfo holds; ``first``: where each major block's
    entries start in them, ``csum``: ``counts``' running sums, when already computed)."""
    n_major = counts.shape[1]
    if csum is None:
        csum = np.zeros((counts.shape[0], n_major + 1), np.int64)
        np.cumsum(counts, axis=1, out=csum[:, 1:])
    own_csum = csum if own is counts else np.concatenate([np.zeros((own.shape[0], 1), np.int64),
                                                          np.cumsum(own, axis=1, dtype=np.int64)], axis=1)
    # entries of major block m start after those of the blocks before it (padding trails the last)
    first = own_csum if first is None else first
    pieces, bounds = [], []
    m0 = 0
    while m0 < n_major:
        span = csum[:, m0 + 1:] - csum[:, m0:m0 + 1]  # [rows, n_major - m0]: entries of [m0, m)
        fits = int(np.count_nonzero(np.all(span <= max_steps, axis=0)))  # a prefix: spans grow with m
        if fits == 0:
            worst = int(span[:, 0].max())
            raise ValueError(
                f"{'kv' if info.transpose else 'q'} block {m0} alone has {worst} work-list entries, more than the "
                f"{max_steps} steps SplashConfig.smem_budget_bytes allows per kernel call; raise the budget or "
                f"use larger blocks"
            )
        m1 = m0 + fits
        length = csum[:, m1] - csum[:, m0]  # needed entries of each list in the piece
        pieces.append(Piece(m0, m1, int(length.max())))
        bounds.append(np.stack([first[:, m0], own_csum[:, m1] - own_csum[:, m0]], axis=-1))
        m0 = m1
    bounds = np.stack(bounds, axis=1).astype(np.int32).reshape(*lead, len(pieces), 2)
    return SplitLists(tuple(pieces), arrays, bounds, info.transpose)


# ----------------------------------------------------------------------------------------
# traced schedules of one shard pair


class PieceSchedules(NamedTuple):
    """One shard pair's pieces: static ranges and their traced ``BlockSchedule`` s."""

    pieces: tuple[Piece, ...]
    schedules: tuple[BlockSchedule, ...]


def pair_schedules(pieces: tuple[Piece, ...], arrays, bounds, head_to_list, q_row, kv_shard, *,
                   transpose: bool) -> PieceSchedules:
    """The pieces of shard pair (``q_row``, ``kv_shard``) (either may be traced), cut out of
    its lists: entry ``t`` of piece ``j`` is list entry ``start_j + t`` while ``t < count_j``,
    then padding (the last entry again with kind 0: no compute, no new block fetched); major
    indices become relative to the piece's first block.

    Args:
        pieces: the static ranges and widths (``SplitLists.pieces``).
        arrays: ``(q_block, kv_block, kind, partial_index)`` (numpy constants or traced,
            possibly only some q rows), ``[lists, rows, kv_shards, steps]``.
        bounds: ``SplitLists.bounds`` for the same rows.
        head_to_list: the MaskInfo's ``head_to_list``.
        q_row: index along the arrays' q-shard axis (0 for a per-device row).
        kv_shard: the kv shard.
        transpose: the lists are kv-major (the dK/dV view).
    """
    import jax.numpy as jnp

    h2l = jnp.asarray(np.asarray(head_to_list).astype(np.int32))
    rows = [jnp.asarray(a)[:, q_row, kv_shard].astype(jnp.int32) for a in arrays]  # [lists, steps]
    if len(pieces) == 1 and pieces[0].width == rows[0].shape[-1]:
        return PieceSchedules(tuple(pieces), (BlockSchedule(*rows, h2l),))
    b = jnp.asarray(bounds)[:, q_row, kv_shard].astype(jnp.int32)  # [lists, pieces, 2]
    last = rows[0].shape[-1] - 1
    major_field = 1 if transpose else 0
    scheds = []
    for j, piece in enumerate(pieces):
        start, count = b[:, j, 0:1], b[:, j, 1:2]
        t = jnp.arange(piece.width, dtype=jnp.int32)[None, :]
        idx = jnp.minimum(start + jnp.minimum(t, count - 1), last)
        valid = t < count
        q_block, kv_block, kind, partial = (jnp.take_along_axis(r, idx, axis=1) for r in rows)
        fields = [q_block, kv_block]
        fields[major_field] = fields[major_field] - piece.start
        scheds.append(BlockSchedule(*fields, jnp.where(valid, kind, 0), jnp.where(valid, partial, -1), h2l))
    return PieceSchedules(tuple(pieces), tuple(scheds))


# ----------------------------------------------------------------------------------------
# running a backend piece by piece


def _slice_rows(x, start, stop, axis=0):
    return None if x is None else x[(slice(None),) * axis + (slice(start, stop),)]


def forward_in_pieces(inputs, pieces: PieceSchedules, block_q: int, run):
    """``run(inputs)`` per piece on its q rows; ``(out, lse)`` concatenated along q, and a
    third output (per-head max logits) reduced by max over the pieces when ``run`` gives one."""
    import jax.numpy as jnp

    if len(pieces.pieces) == 1:
        return run(inputs._replace(schedule=pieces.schedules[0]))
    results = []
    for (m0, m1, _), sched in zip(pieces.pieces, pieces.schedules):
        a, b = m0 * block_q, m1 * block_q
        sub = inputs._replace(q=inputs.q[:, a:b], q_pos=inputs.q_pos[a:b], q_seg=_slice_rows(inputs.q_seg, a, b),
                              schedule=sched)
        results.append(run(sub))
    out = jnp.concatenate([r[0] for r in results], axis=1)
    lse = jnp.concatenate([r[1] for r in results], axis=1)
    if len(results[0]) == 2:
        return out, lse
    return out, lse, functools.reduce(jnp.maximum, [r[2] for r in results])


def _add_rows(acc, x, a, b):
    """``acc`` with ``x`` added to rows ``[a, b)`` of axis 1 (in place under XLA), or ``x``
    when there is no accumulator."""
    if acc is None:
        return x
    x = x.astype(acc.dtype)
    return acc + x if (a, b) == (0, acc.shape[1]) else acc.at[:, a:b].add(x)


def _after(acc, inputs):
    """``(acc, inputs)`` tied by an optimisation barrier: the next piece's kernel cannot start
    before this piece's gradients are added (else XLA may run every piece first and keep all
    their outputs alive, which is what accumulating per piece avoids)."""
    from jax import lax

    return lax.optimization_barrier((acc, inputs))


def _q_slice(inputs, a, b, sched):
    return inputs._replace(
        q=inputs.q[:, a:b], d_out=inputs.d_out[:, a:b], lse=inputs.lse[:, a:b], delta=inputs.delta[:, a:b],
        q_pos=inputs.q_pos[a:b], q_seg=_slice_rows(inputs.q_seg, a, b), schedule=sched,
    )


def dq_in_pieces(inputs, pieces: PieceSchedules, block_q: int, run, acc=None):
    """``run(inputs) -> (dq, dk, dv)`` per piece of the forward view on its q rows: dq
    concatenated along q, dK / dV summed (the fused xla backward, which walks the forward list).
    With ``acc = (dq, dk, dv)`` float32 accumulators, each piece is added into them as soon as
    it is computed (no whole-shard gradient temporaries) and the sums are returned."""
    import jax.numpy as jnp

    if len(pieces.pieces) == 1 and acc is None:
        return run(inputs._replace(schedule=pieces.schedules[0]))
    q_len = inputs.q.shape[1]
    dqs, (dq, dk, dv) = [], (None, None, None) if acc is None else acc
    for (m0, m1, _), sched in zip(pieces.pieces, pieces.schedules):
        a, b = m0 * block_q, m1 * block_q
        sub = inputs._replace(schedule=sched) if (a, b) == (0, q_len) else _q_slice(inputs, a, b, sched)
        dq_j, dk_j, dv_j = run(sub)
        if acc is None:
            dqs.append(dq_j)
        else:
            dq = _add_rows(dq, dq_j, a, b)
        dk, dv = _add_rows(dk, dk_j, 0, dk_j.shape[1]), _add_rows(dv, dv_j, 0, dv_j.shape[1])
        if acc is not None and len(pieces.pieces) > 1:
            (dq, dk, dv), inputs = _after((dq, dk, dv), inputs)
    return (jnp.concatenate(dqs, axis=1) if acc is None else dq), dk, dv


def kernels_in_pieces(inputs, pieces: PieceSchedules, pieces_dkv: PieceSchedules, block_q: int, block_kv: int,
                      run_dq, run_dkv, acc=None):
    """The split Pallas backward in pieces: ``run_dq(inputs) -> dq`` per forward-view piece on
    its q rows, ``run_dkv(inputs) -> (dk, dv)`` per transposed piece on its kv rows; with
    ``acc`` as in :func:`dq_in_pieces`. A ``run_*`` of None skips that kernel: its gradients
    are ``acc``'s (float32 zeros without it)."""
    import jax.numpy as jnp

    zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
    q_len = inputs.q.shape[1]
    dq, dk, dv = (None, None, None) if acc is None else acc
    dqs = []
    for (m0, m1, _), sched in zip(pieces.pieces, pieces.schedules) if run_dq is not None else ():
        a, b = m0 * block_q, m1 * block_q
        piece = run_dq(inputs._replace(schedule=sched) if (a, b) == (0, q_len) else _q_slice(inputs, a, b, sched))
        if acc is None:
            dqs.append(piece)
        else:
            dq = _add_rows(dq, piece, a, b)
            if len(pieces.pieces) > 1:
                dq, inputs = _after(dq, inputs)
    if acc is None:
        dq = zeros(inputs.q) if not dqs else _cat(dqs)
    if run_dkv is None:
        return dq, (zeros(inputs.k) if acc is None else dk), (zeros(inputs.v) if acc is None else dv)
    _, dk, dv = _over_kv_pieces(inputs, pieces_dkv, block_kv, lambda sub, carry: (carry, *run_dkv(sub)), None,
                                None if acc is None else (dk, dv))
    return dq, dk, dv


def fused_in_pieces(inputs, pieces_dkv: PieceSchedules, block_kv: int, run_fused, acc=None):
    """The fused Pallas backward in pieces: ``run_fused(inputs, dq) -> (dq, dk, dv)`` per
    transposed piece on its kv rows, each piece adding its share of dq into the float32 dq the
    previous one returned (starting from zeros, or ``acc``'s dq); dK / dV as in
    :func:`kernels_in_pieces`."""
    import jax.numpy as jnp

    from ringsplash._internal.shard_map import varying, vma

    dq_acc, dk, dv = (None, None, None) if acc is None else acc
    fresh = lambda: varying(jnp.zeros(inputs.q.shape, jnp.float32), vma(inputs.q))  # q's mesh axes (shard_map)
    dq = fresh() if dq_acc is None else dq_acc.astype(jnp.float32)
    dq, dk, dv = _over_kv_pieces(inputs, pieces_dkv, block_kv, run_fused, dq, None if acc is None else (dk, dv))
    return (dq, dk, dv) if acc is None else (dq.astype(dq_acc.dtype), dk, dv)


def _over_kv_pieces(inputs, pieces_dkv: PieceSchedules, block_kv: int, run, carry, acc_kv):
    """``run(inputs, carry) -> (carry, dk, dv)`` per transposed piece on its kv rows: dK / dV
    concatenated along kv, or added into ``acc_kv = (dk, dv)`` as each piece is computed."""
    dk, dv = (None, None) if acc_kv is None else acc_kv
    dks, dvs = [], []
    for (m0, m1, _), sched in zip(pieces_dkv.pieces, pieces_dkv.schedules):
        a, b = m0 * block_kv, m1 * block_kv
        carry, dk_j, dv_j = run(_kv_slice(inputs, a, b, sched), carry)
        if acc_kv is None:
            dks.append(dk_j)
            dvs.append(dv_j)
        else:
            dk, dv = _add_rows(dk, dk_j, a, b), _add_rows(dv, dv_j, a, b)
            if len(pieces_dkv.pieces) > 1:
                (carry, dk, dv), inputs = _after((carry, dk, dv), inputs)
    return (carry, _cat(dks), _cat(dvs)) if acc_kv is None else (carry, dk, dv)


def _cat(xs):
    import jax.numpy as jnp

    return xs[0] if len(xs) == 1 else jnp.concatenate(xs, axis=1)


def _kv_slice(inputs, a, b, sched):
    """``inputs`` on kv rows ``[a, b)`` with the transposed schedule ``sched``."""
    if (a, b) == (0, inputs.k.shape[1]):
        return inputs._replace(schedule_dkv=sched)
    return inputs._replace(k=inputs.k[:, a:b], v=inputs.v[:, a:b], kv_pos=inputs.kv_pos[a:b],
                           kv_seg=_slice_rows(inputs.kv_seg, a, b), schedule_dkv=sched)


def info_pieces(info: MaskInfo, config, heads: int, q_shard=0, kv_shard=0, device_kind=None) -> PieceSchedules:
    """The forward / dq pieces of shard pair (``q_shard``, ``kv_shard``) under ``config``'s
    budget, from ``info``'s arrays as constants."""
    max_steps = forward_max_steps(list_budget_bytes(config, device_kind), info, heads)
    split = split_work_lists(info, max_steps)
    return pair_schedules(split.pieces, split.arrays, split.bounds, info.head_to_list, q_shard, kv_shard,
                          transpose=False)


def info_pieces_dkv(info_dkv: MaskInfo, config, heads: int, kv_heads: int, q_shard=0, kv_shard=0,
                    device_kind=None) -> PieceSchedules:
    """The dK/dV pieces of a shard pair (as :func:`info_pieces`, transposed view)."""
    max_steps = dkv_max_steps(list_budget_bytes(config, device_kind), info_dkv, heads, kv_heads)
    split = split_work_lists(info_dkv, max_steps)
    return pair_schedules(split.pieces, split.arrays, split.bounds, info_dkv.head_to_list, q_shard, kv_shard,
                          transpose=True)
