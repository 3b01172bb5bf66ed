"""The block builder behind ``build_mask_info``: for one mask, every (q shard, kv shard) pair's
work list of (q block, kv block, kind) entries, with the partial blocks deduplicated.

Blocks are summarised by their position ranges (``summarise``); candidate blocks of each pair come
from each block row's attendable interval and are classified from those ranges; a mask whose
analytics need the layout (``NumpyMask``, ``FunctionMask``, composites of them) is bound once to the
layout's blocks (``Mask.bound_to``) so it classifies the same way; partial blocks
are keyed by content, verified and stored or left to the kernel's ``mask_function``
(``_resolve_partials``); ``build_list`` expands one mask's lists (optionally only some q shards'),
``assemble`` pads every mask's lists into the ``MaskInfo`` arrays. Host-only numpy.
"""

import hashlib
from typing import NamedTuple

import numpy as np

from ringsplash.masks import EMPTY, FULL, PARTIAL, Mask, NumpyMask
from ringsplash.masks import base as mask_base
from ringsplash.masks.base import BoundIntervals, candidate_runs

__all__ = ["MAX_STORED_PARTIAL_BLOCKS", "Blocking", "assemble", "build_list", "smallest_int_dtype",
           "summarise"]

#: "auto" stores partial blocks while there are at most this many distinct ones.
MAX_STORED_PARTIAL_BLOCKS = 64


def smallest_int_dtype(lo: int, hi: int) -> np.dtype:
    """The smallest signed integer dtype holding every value in [lo, hi]."""
    for dtype in (np.int8, np.int16, np.int32, np.int64):
        info = np.iinfo(dtype)
        if info.min <= lo and hi <= info.max:
            return np.dtype(dtype)
    raise OverflowError(f"no integer dtype holds [{lo}, {hi}]")


# ----------------------------------------------------------------------------------------
# per-block position summaries


class _Blocks(NamedTuple):
    lo: np.ndarray  # int32 [num_blocks] min position in each block
    hi: np.ndarray  # int32 [num_blocks] max position
    start: np.ndarray  # int32 position of each block's first row/column
    stride: int | None  # common stride if every block is an arithmetic progression
    positions: np.ndarray  # int32 [length]


def summarise(positions: np.ndarray, block: int, identity: bool) -> _Blocks:
    n = positions.size // block
    if identity:
        start = np.arange(n, dtype=np.int32) * block
        return _Blocks(start, start + (block - 1), start, 1, positions)
    p = positions.reshape(n, block)
    start = p[:, 0]
    stride = None
    if block == 1:
        stride = 1
    else:
        steps = p[:, 1] - p[:, 0]
        if (np.all(steps == steps[0]) and steps[0] > 0
                and np.array_equal(p, start[:, None] + steps[0] * np.arange(block))):
            stride = int(steps[0])
    return _Blocks(p.min(1), p.max(1), start, stride, positions)


# ----------------------------------------------------------------------------------------
# candidate enumeration and classification for one mask and one shard pair
#
# A pair's work list is kept run-length encoded while it is built: ``counts[m]`` entries for
# major block m (q block, or kv block when transposed), then per entry the local ``minor``
# block and its ``kind``. Only PARTIAL entries (a thin band for structured masks) are ever
# looked at individually.


class _PairWork(NamedTuple):
    counts: np.ndarray  # [n_major] entries of each major block
    minor: np.ndarray  # int32 [n] local minor block of each entry
    kinds: np.ndarray  # int8 [n]


def _pair_entries(mask: Mask, qb: _Blocks, kb: _Blocks, q_sel: slice, kv_sel: slice, transpose: bool) -> _PairWork:
    """Non-empty block pairs of one shard pair, in the kernel's walk order.

    Each major block gets the interval of minor positions it may touch; minor blocks of one
    shard are sorted by their lowest position, so its candidates are one contiguous run found
    by two binary searches. Nothing outside those runs is touched.
    """
    major, minor = (kb, qb) if transpose else (qb, kb)
    major_sel, minor_sel = (kv_sel, q_sel) if transpose else (q_sel, kv_sel)
    m_lo, m_hi = major.lo[major_sel], major.hi[major_sel]
    n_lo, n_hi = minor.lo[minor_sel], minor.hi[minor_sel]
    range_fn = mask.attending_q_range if transpose else mask.attended_kv_range
    first, counts, order = candidate_runs(range_fn, m_lo, m_hi, n_lo, n_hi)
    if order is not None:
        n_lo, n_hi = n_lo[order], n_hi[order]
    offsets = np.cumsum(counts) - counts
    minor_idx = np.arange(int(counts.sum()), dtype=np.int32)
    minor_idx += np.repeat((first - offsets).astype(np.int32), counts)

    ml, mh = np.repeat(m_lo, counts), np.repeat(m_hi, counts)
    nl, nh = n_lo[minor_idx], n_hi[minor_idx]
    kinds = mask.classify_blocks(nl, nh, ml, mh) if transpose else mask.classify_blocks(ml, mh, nl, nh)
    # candidate intervals are supersets (a union under ``|``, a numpy block row's span): drop
    # what classifies EMPTY
    work = _drop_empty(_PairWork(counts, minor_idx, kinds))
    if order is not None:
        major_of = np.repeat(np.arange(counts.size), work.counts)
        minor_idx = order[work.minor].astype(np.int32)
        resort = np.lexsort((minor_idx, major_of))
        work = _PairWork(work.counts, minor_idx[resort], work.kinds[resort])
    return work


def _drop_empty(work: _PairWork) -> _PairWork:
    keep = work.kinds != EMPTY
    if keep.all():
        return work
    major_of = np.repeat(np.arange(work.counts.size), work.counts)
    counts = np.bincount(major_of[keep], minlength=work.counts.size)
    return _PairWork(counts, work.minor[keep], work.kinds[keep])


def _dense_kinds(mask: NumpyMask, qb: _Blocks, kb: _Blocks, bq: int, bkv: int) -> np.ndarray:
    arr = mask.array[qb.positions][:, kb.positions]
    arr = arr.reshape(arr.shape[0] // bq, bq, arr.shape[1] // bkv, bkv)
    any_, all_ = arr.any(axis=(1, 3)), arr.all(axis=(1, 3))
    return np.where(all_, FULL, np.where(any_, PARTIAL, EMPTY)).astype(np.int8)


class _BoundNumpy(BoundIntervals, Mask):
    """A ``NumpyMask`` leaf bound to one blocking, so composites containing it take the
    O(candidates) path of structured masks.

    One pass over the array (O(q_len * kv_len), the size the user already handed over)
    gives every block's kind and every block's attended interval; afterwards each analytic
    call is a table lookup. Calls receive the ``lo`` position of real blocks (as
    ``_pair_entries`` passes them), and a position belongs to exactly one block, so
    ``lo`` identifies its block under any layout. A block row that attends nothing gets
    the inverted interval (_HI, _LO): empty under ``&``, neutral under ``|``'s min/max.
    """

    classification_exact = "any"
    has_mask_function = False

    def __init__(self, mask: NumpyMask, qb: "_Blocks", kb: "_Blocks", bq: int, bkv: int):
        self.shape, self.mask = mask.shape, mask
        arr = mask.array
        q_len, kv_len = arr.shape
        nq, nk = q_len // bq, kv_len // bkv
        self._q_block = np.empty(q_len, np.int64)
        self._q_block[qb.positions] = np.arange(q_len) // bq
        self._kv_block = np.empty(kv_len, np.int64)
        self._kv_block[kb.positions] = np.arange(kv_len) // bkv
        self._kinds = _dense_kinds(mask, qb, kb, bq, bkv)
        # per row / column (original positions): first and last attended position
        lo_hi = mask_base._LO, mask_base._HI
        self._kv_lo, self._kv_hi = _block_intervals(arr, qb.positions, nq, *lo_hi)
        self._q_lo, self._q_hi = _block_intervals(arr.T, kb.positions, nk, *lo_hi)

    def _key(self):
        return (self.mask, id(self))

    def evaluate(self, xp, q_pos, kv_pos):
        return self.mask.evaluate(xp, q_pos, kv_pos)

    def classify_blocks(self, q_lo, q_hi, kv_lo, kv_hi):
        return self._kinds[self._q_block[q_lo], self._kv_block[kv_lo]]


def _block_intervals(arr: np.ndarray, row_positions: np.ndarray, n_blocks: int, lo_sentinel, hi_sentinel):
    """Per block of rows (rows in laid-out order): the min / max column position attended."""
    has = arr.any(axis=1)
    first = np.where(has, arr.argmax(axis=1), hi_sentinel).astype(np.int64)
    last = np.where(has, arr.shape[1] - 1 - arr[:, ::-1].argmax(axis=1), lo_sentinel).astype(np.int64)
    first, last = first[row_positions].reshape(n_blocks, -1), last[row_positions].reshape(n_blocks, -1)
    return first.min(axis=1), last.max(axis=1)


class Blocking(NamedTuple):
    """One build's blocking, what ``Mask.bound_to`` specialises a mask to: the laid-out q and kv
    blocks (``positions`` in layout order, ``lo`` / ``hi`` per block) and the block shape.
    ``bound`` memoises the bound leaves of one build (a leaf repeated in a composite binds once)."""

    qb: _Blocks
    kb: _Blocks
    bq: int
    bkv: int
    bound: dict

    def bind_numpy(self, mask: NumpyMask) -> Mask:
        """``NumpyMask.bound_to``: the array's ``_BoundNumpy`` for this blocking (analytics only)."""
        if mask not in self.bound:
            self.bound[mask] = _BoundNumpy(mask, self.qb, self.kb, self.bq, self.bkv)
        return self.bound[mask]


def _dense_pair_entries(kinds: np.ndarray, q_sel: slice, kv_sel: slice, transpose: bool) -> _PairWork:
    sub = kinds[q_sel, kv_sel]
    sub = sub.T if transpose else sub
    major, minor = np.nonzero(sub)
    return _PairWork(np.bincount(major, minlength=sub.shape[0]), minor.astype(np.int32), sub[major, minor])


# ----------------------------------------------------------------------------------------
# partial blocks: deduplicate by content key, verify, store


def _materialise(mask: Mask, qb: _Blocks, kb: _Blocks, q_block: int, kv_block: int, bq: int, bkv: int):
    rows = qb.positions[q_block * bq : (q_block + 1) * bq].astype(np.int64)
    cols = kb.positions[kv_block * bkv : (kv_block + 1) * bkv].astype(np.int64)
    return np.broadcast_to(mask.evaluate(np, rows[:, None], cols[None, :]), (bq, bkv))


def _content_key(mask: Mask, qb: _Blocks, kb: _Blocks, q_idx, kv_idx) -> list[np.ndarray] | None:
    """Columns that determine the blocks' content (None: no analytic key): per leaf of an ``&`` /
    ``|`` tree its kind, and its ``block_key`` where that kind is PARTIAL (a FULL or EMPTY leaf's
    content is its kind), so a leaf that does not touch a block does not split equal blocks."""
    if isinstance(mask, mask_base._Binary):
        a = _content_key(mask.left, qb, kb, q_idx, kv_idx)
        b = None if a is None else _content_key(mask.right, qb, kb, q_idx, kv_idx)
        return None if b is None else a + b
    cols = mask.block_key(qb.start[q_idx], kb.start[kv_idx], qb.stride)
    if cols is None:
        return None
    kinds = mask.classify_blocks(qb.lo[q_idx], qb.hi[q_idx], kb.lo[kv_idx], kb.hi[kv_idx])
    partial = kinds == PARTIAL
    return [kinds] + [np.where(partial, c, 0) for c in cols]


def _resolve_partials(mask, qb, kb, q_idx, kv_idx, bq, bkv, *, exact, store):
    """Content ids for the PARTIAL candidates at global blocks (q_idx, kv_idx).

    Returns (new kind per candidate, id per candidate (-1 unless stored partial), unique
    blocks). Candidates with equal content keys share one materialised block; when the
    classification is not exact, that block also decides whether they are really partial.
    Without ``store`` (mask_function mode) and with an exact classification nothing is
    materialised.
    """
    n = q_idx.size
    partial_kinds = np.full(n, PARTIAL, np.int8)
    no_ids = np.full(n, -1, np.int64)
    if n == 0 or (exact and not store):
        return partial_kinds, no_ids, []
    key_cols = None
    if qb.stride is not None and qb.stride == kb.stride:
        key_cols = _content_key(mask, qb, kb, q_idx, kv_idx)
    materialised = {}  # candidate -> block, so no candidate is materialised twice
    if key_cols:
        keys = np.stack([np.asarray(c, dtype=np.int64) for c in key_cols], axis=1)
        _, first, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
        inverse = inverse.reshape(-1)
    elif key_cols == []:  # content never varies
        first, inverse = np.zeros(1, np.int64), np.zeros(n, np.int64)
    else:  # no analytic key (e.g. a NumpyMask part): hash each candidate's content
        digests, first, inverse = {}, [], np.empty(n, np.int64)
        for i in range(n):
            blk = _materialise(mask, qb, kb, int(q_idx[i]), int(kv_idx[i]), bq, bkv)
            d = hashlib.blake2b(np.packbits(blk).tobytes(), digest_size=16).digest()
            inverse[i] = digests.setdefault(d, len(digests))
            if inverse[i] == len(first):
                first.append(i)
                materialised[i] = blk
        first = np.asarray(first, np.int64)
    blocks, unique_kind = [], np.empty(first.size, np.int8)
    for u, i in enumerate(first):
        blk = materialised.get(int(i))
        if blk is None:
            blk = _materialise(mask, qb, kb, int(q_idx[i]), int(kv_idx[i]), bq, bkv)
        unique_kind[u] = FULL if blk.all() else (EMPTY if not blk.any() else PARTIAL)
        blocks.append(blk)
    still_partial = np.flatnonzero(unique_kind == PARTIAL)
    renumber = np.full(first.size, -1, np.int64)
    renumber[still_partial] = np.arange(still_partial.size)
    return unique_kind[inverse], renumber[inverse], [blocks[u] for u in still_partial]


# ----------------------------------------------------------------------------------------
# assembling work lists


class _PairList(NamedTuple):
    """A finished work list in walk order, local block indices."""

    q_block: np.ndarray
    kv_block: np.ndarray
    kind: np.ndarray
    partial_at: np.ndarray  # entries with a stored partial block (the rest have partial index -1)
    partial_ids: np.ndarray  # their ids into the list's stored blocks


def _finish(work: _PairWork, partial_at: np.ndarray, partial_ids: np.ndarray, transpose: bool) -> _PairList:
    """Expand the run-length form; a major block without work gets one kind-0 visit."""
    counts, minor, kinds = work
    if np.any(counts == 0):
        ins = np.cumsum(counts)[counts == 0]  # a visit goes before the entries of the next major block
        # a visit keeps the previous entry's minor block (0 before any), so no new block is fetched
        visit_minor = minor[ins - 1] if minor.size else np.zeros(ins.size, minor.dtype)
        visit_minor[ins == 0] = 0
        minor, kinds = np.insert(minor, ins, visit_minor), np.insert(kinds, ins, np.int8(EMPTY))
        partial_at = partial_at + np.searchsorted(ins, partial_at, side="right")
        counts = np.maximum(counts, 1)
    major = np.repeat(np.arange(counts.size, dtype=np.int32), counts)
    q_block, kv_block = (minor, major) if transpose else (major, minor)
    return _PairList(q_block, kv_block, kinds, partial_at, partial_ids)


class _PairStats(NamedTuple):
    """What the whole build needs of a pair whose list is not expanded (every pair has one)."""

    counts: np.ndarray  # [n_major] entries of each major block in the finished list (a visit counts 1)
    active: int  # non-empty entries
    hi_minor: int  # largest local minor block of an entry (0 without entries)


def build_list(mask: Mask, qb, kb, bq, bkv, q_shards, kv_shards, transpose, partial_mode, rows=None):
    """Work lists of one 2-D mask: ({(a, b): _PairList}, blocks | None, {(a, b): _PairStats},
    bool [2] partial sources). Lists are expanded for the q shards ``rows`` only (None = all);
    every pair is still enumerated and classified, so partial blocks are numbered over all pairs
    and the stats cover them all."""
    nq_s, nk_s = qb.lo.size // q_shards, kb.lo.size // kv_shards
    dense_kinds = _dense_kinds(mask, qb, kb, bq, bkv) if isinstance(mask, NumpyMask) else None
    # Masks whose analytics need the blocking (NumpyMask, FunctionMask, composites with such parts)
    # are bound to it once (``Mask.bound_to``): candidates, kinds, exactness and partial-block keys
    # come from the bound tree, which evaluates like ``mask`` itself. NumpyMask parts have no
    # in-kernel mask_function (has_mask_function is False), so their partial blocks are always stored.
    analytic = mask.bound_to(Blocking(qb, kb, bq, bkv, {})) if dense_kinds is None else mask
    works = {}
    for a in range(q_shards):
        for b in range(kv_shards):
            q_sel, kv_sel = slice(a * nq_s, (a + 1) * nq_s), slice(b * nk_s, (b + 1) * nk_s)
            if dense_kinds is not None:
                works[a, b] = _dense_pair_entries(dense_kinds, q_sel, kv_sel, transpose)
            else:
                works[a, b] = _pair_entries(analytic, qb, kb, q_sel, kv_sel, transpose)

    # Gather every PARTIAL candidate (global block indices) to deduplicate across pairs.
    parts, q_glob, kv_glob = {}, [], []
    for (a, b), w in works.items():
        p = np.flatnonzero(w.kinds == PARTIAL)
        major = np.searchsorted(np.cumsum(w.counts), p, side="right")
        q_loc, kv_loc = (w.minor[p], major) if transpose else (major, w.minor[p])
        parts[a, b] = p
        q_glob.append(q_loc + a * nq_s)
        kv_glob.append(kv_loc + b * nk_s)
    q_glob, kv_glob = np.concatenate(q_glob), np.concatenate(kv_glob)

    consecutive = qb.stride == 1 and kb.stride == 1
    exactness = analytic.classification_exact
    exact = exactness == "any" or (exactness == "consecutive" and consecutive)
    store = partial_mode == "stored" or not mask.has_mask_function
    new_kinds, ids, blocks = _resolve_partials(
        analytic, qb, kb, q_glob, kv_glob, bq, bkv, exact=exact, store=store or partial_mode == "auto"
    )
    if not store and (partial_mode == "function" or len(blocks) > MAX_STORED_PARTIAL_BLOCKS):
        blocks, ids = None, np.full(ids.shape, -1, np.int64)  # evaluate mask_function in kernel

    lists, stats, start = {}, {}, 0
    for (a, b), w in works.items():
        p = parts[a, b]
        sl = slice(start, start + p.size)
        start += p.size
        kinds, stored_at, stored_ids = w.kinds, p[:0], ids[:0]  # entries with a stored block, their ids
        if p.size:
            kinds = kinds.copy()
            kinds[p] = new_kinds[sl]
            stored = ids[sl] >= 0
            stored_at, stored_ids = p[stored], ids[sl][stored]
            if np.any(new_kinds[sl] == EMPTY):  # inexact classification: drop what is empty
                keep = kinds != EMPTY
                major_of = np.repeat(np.arange(w.counts.size), w.counts)
                w = _PairWork(np.bincount(major_of[keep], minlength=w.counts.size), w.minor[keep], kinds[keep])
                kinds, stored_at = w.kinds, (np.cumsum(keep) - 1)[stored_at]  # stored ones are kept
        stats[a, b] = _PairStats(np.maximum(w.counts, 1), int(w.counts.sum()), int(w.minor.max(initial=0)))
        if rows is None or a in rows:
            lists[a, b] = _finish(_PairWork(w.counts, w.minor, kinds), stored_at, stored_ids, transpose)
    partial = new_kinds == PARTIAL
    sources = np.asarray([np.any(partial & (ids >= 0)), np.any(partial & (ids < 0))])
    return lists, blocks, stats, sources


def assemble(builds, q_shards, kv_shards, rows=None):
    """Stack the lists' pair work lists into padded [lists, len(rows), kv_shards, max_steps] (rows
    None = every q shard); ``num_active`` [lists, q_shards, kv_shards] and the major counts
    [lists, q_shards, kv_shards, n_major] cover every pair (from the stats)."""
    stats = [st for _, _, st, _ in builds]
    max_steps = max(int(ps.counts.sum()) for st in stats for ps in st.values())
    offsets = np.cumsum([0] + [len(blocks or []) for _, blocks, _, _ in builds])
    n_part = int(offsets[-1])
    # the largest local block index of either array: every major block is visited, the minor
    # ones are not sorted (visits repeat an earlier minor block, or 0)
    hi_block = max(max(ps.counts.size - 1, ps.hi_minor) for st in stats for ps in st.values())
    idx_dtype = smallest_int_dtype(0, hi_block)
    rows = range(q_shards) if rows is None else rows
    shape = (len(builds), len(rows), kv_shards, max_steps)
    q_block, kv_block = np.empty(shape, idx_dtype), np.empty(shape, idx_dtype)
    kind = np.zeros(shape, np.int8)
    partial = np.full(shape, -1, smallest_int_dtype(-1, max(n_part - 1, 0)))
    num_active = np.zeros((len(builds), q_shards, kv_shards), smallest_int_dtype(0, max_steps))
    n_major = next(iter(stats[0].values())).counts.size
    major_counts = np.zeros((len(builds), q_shards, kv_shards, n_major), np.int32)
    for li, (lists, _, st, _) in enumerate(builds):
        for (a, b), ps in st.items():
            num_active[li, a, b], major_counts[li, a, b] = ps.active, ps.counts
        for r, a in enumerate(rows):
            for b in range(kv_shards):
                pl = lists[a, b]
                n = pl.kind.size
                q_block[li, r, b, :n], kv_block[li, r, b, :n], kind[li, r, b, :n] = pl.q_block, pl.kv_block, pl.kind
                partial[li, r, b, pl.partial_at] = pl.partial_ids + offsets[li]
                # padding repeats the last entry's blocks with kind 0 (no compute, no new fetch)
                q_block[li, r, b, n:], kv_block[li, r, b, n:] = pl.q_block[-1], pl.kv_block[-1]
    return q_block, kv_block, kind, partial, num_active, major_counts
