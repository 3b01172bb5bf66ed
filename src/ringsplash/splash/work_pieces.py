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
import weakref
from typing import NamedTuple

import numpy as np

from ringsplash.mask_info import BlockSchedule, MaskInfo
from ringsplash.masks import EMPTY

#: fraction of the chip's SMEM a work list may take (Mosaic keeps scalars of its own there)
SMEM_FRACTION = 0.75
#: ``jax.Device.device_kind`` -> ``pltpu.ChipVersion`` value (as pltpu's own table)
_DEVICE_KINDS = {
    "TPU v4": "v4", "TPU v4 lite": "v4i", "TPU v5e": "v5e", "TPU v5 lite": "v5e", "TPU v5": "v5p",
    "TPU v5p": "v5p", "TPU v6e": "v6e", "TPU v6 lite": "v6e", "TPU7x": "7x",
}
#: the generations the kernels target; with no TPU in sight the budget is their smallest SMEM
_TARGET_CHIPS = ("v4", "v5e", "v5p", "v6e", "7x")
WORD = 4  # bytes of one int32


# ----------------------------------------------------------------------------------------
# budget


def smem_bytes(device_kind: str | None = None) -> int:
    """SMEM bytes per TensorCore of ``device_kind`` (a ``jax.Device.device_kind``); None or
    a non-TPU kind: the smallest SMEM of the generations the kernels target."""
    from jax.experimental.pallas import tpu as pltpu

    chip = _DEVICE_KINDS.get(device_kind or "")
    chips = (chip,) if chip is not None else _TARGET_CHIPS
    return min(pltpu.get_tpu_info_for_chip(pltpu.ChipVersion(c), 1).smem_capacity_bytes for c in chips)


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
    from ringsplash.splash.kernel_backward import uniform_group_lists

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
    """A range ``[start, stop)`` of major blocks (q blocks; kv blocks for a transposed view)."""

    start: int
    stop: int


@dataclasses.dataclass(frozen=True, eq=False)
class SplitLists:
    """A MaskInfo's work lists cut into pieces: ``arrays[j]`` holds ``(q_block, kv_block, kind,
    partial_index)``, each ``[lists, q_shards, kv_shards, steps_j]`` in MaskInfo's compact
    dtypes, major indices relative to ``pieces[j].start``. One piece covering every major
    block is the MaskInfo's own arrays."""

    pieces: tuple[Piece, ...]
    arrays: tuple[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], ...]
    transpose: bool

    @property
    def steps(self) -> tuple[int, ...]:
        return tuple(a[2].shape[-1] for a in self.arrays)

    def rows(self, q_rows) -> tuple[tuple[np.ndarray, ...], ...]:
        """The arrays of q shards ``q_rows`` only (a per-device slice of the schedule)."""
        return tuple(tuple(a[:, q_rows] for a in arrs) for arrs in self.arrays)


_SPLIT_CACHE: "weakref.WeakKeyDictionary[MaskInfo, dict]" = weakref.WeakKeyDictionary()


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
    if max_steps is None or info.max_steps <= max_steps:
        return SplitLists((Piece(0, n_major),), (arrays,), info.transpose)
    major = (info.kv_block if info.transpose else info.q_block).astype(np.int64)
    lead, steps = major.shape[:-1], major.shape[-1]
    major = major.reshape(-1, steps)
    kind = info.kind.reshape(-1, steps)
    rows = major.shape[0]
    # an entry is needed unless it repeats its major block with kind 0 (the trailing padding)
    new_run = np.ones(major.shape, bool)
    new_run[:, 1:] = major[:, 1:] != major[:, :-1]
    needed = (kind != EMPTY) | new_run
    offset = (np.arange(rows, dtype=np.int64) * n_major)[:, None]
    counts = np.bincount((major + offset)[needed], minlength=rows * n_major).reshape(rows, n_major)
    every = np.bincount((major + offset).ravel(), minlength=rows * n_major).reshape(rows, n_major)
    csum = np.concatenate([np.zeros((rows, 1), np.int64), np.cumsum(counts, axis=1)], axis=1)
    first = np.concatenate([np.zeros((rows, 1), np.int64), np.cumsum(every, axis=1)], axis=1)

    pieces, out = [], []
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
        length = csum[:, m1] - csum[:, m0]  # [rows] needed entries of each row in the piece
        width = int(length.max())
        t = np.arange(width, dtype=np.int64)[None, :]
        idx = first[:, m0:m0 + 1] + np.minimum(t, length[:, None] - 1)
        pad = t >= length[:, None]
        piece_arrays = []
        for a in arrays:
            p = np.take_along_axis(a.reshape(rows, steps), idx, axis=1)
            if a is info.kind:
                p = np.where(pad, 0, p).astype(a.dtype)
            elif a is info.partial_index:
                p = np.where(pad, -1, p).astype(a.dtype)
            elif a is (info.kv_block if info.transpose else info.q_block):
                p = (p - m0).astype(a.dtype)
            piece_arrays.append(p.reshape(*lead, width))
        pieces.append(Piece(m0, m1))
        out.append(tuple(piece_arrays))
        m0 = m1
    return SplitLists(tuple(pieces), tuple(out), info.transpose)


# ----------------------------------------------------------------------------------------
# traced schedules of one shard pair


class PieceSchedules(NamedTuple):
    """One shard pair's pieces: static ranges and their traced ``BlockSchedule`` s."""

    pieces: tuple[Piece, ...]
    schedules: tuple[BlockSchedule, ...]


def pair_schedules(pieces: tuple[Piece, ...], arrays, head_to_list, q_row, kv_shard) -> PieceSchedules:
    """The pieces of shard pair (``q_row``, ``kv_shard``) (either may be traced).

    Args:
        pieces: the static ranges (``SplitLists.pieces``).
        arrays: the piece arrays (``SplitLists.arrays`` layout, numpy constants or traced, possibly
            only some q rows).
        head_to_list: the MaskInfo's ``head_to_list``.
        q_row: index along the arrays' q-shard axis (0 for a per-device row).
        kv_shard: the kv shard.
    """
    import jax.numpy as jnp

    h2l = jnp.asarray(np.asarray(head_to_list).astype(np.int32))
    scheds = tuple(
        BlockSchedule(*(jnp.asarray(a)[:, q_row, kv_shard].astype(jnp.int32) for a in arrs), h2l)
        for arrs in arrays
    )
    return PieceSchedules(tuple(pieces), scheds)


# ----------------------------------------------------------------------------------------
# running a backend piece by piece


def _slice_rows(x, start, stop, axis=0):
    return None if x is None else x[(slice(None),) * axis + (slice(start, stop),)]


def forward_in_pieces(inputs, pieces: PieceSchedules, block_q: int, run):
    """``run(inputs)`` per piece on its q rows; ``(out, lse)`` concatenated along q."""
    import jax.numpy as jnp

    if len(pieces.pieces) == 1:
        return run(inputs._replace(schedule=pieces.schedules[0]))
    outs, lses = [], []
    for (m0, m1), sched in zip(pieces.pieces, pieces.schedules):
        a, b = m0 * block_q, m1 * block_q
        sub = inputs._replace(q=inputs.q[:, a:b], q_pos=inputs.q_pos[a:b], q_seg=_slice_rows(inputs.q_seg, a, b),
                              schedule=sched)
        out, lse = run(sub)
        outs.append(out)
        lses.append(lse)
    return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=1)


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
    for (m0, m1), sched in zip(pieces.pieces, pieces.schedules):
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
    """The Pallas backward in pieces: ``run_dq(inputs) -> dq`` per forward-view piece on its
    q rows, ``run_dkv(inputs) -> (dk, dv)`` per transposed piece on its kv rows; with ``acc``
    as in :func:`dq_in_pieces`."""
    import jax.numpy as jnp

    q_len, kv_len = inputs.q.shape[1], inputs.k.shape[1]
    dq, dk, dv = (None, None, None) if acc is None else acc
    dqs, dks, dvs = [], [], []
    for (m0, m1), sched in zip(pieces.pieces, pieces.schedules):
        a, b = m0 * block_q, m1 * block_q
        piece = run_dq(inputs._replace(schedule=sched) if (a, b) == (0, q_len) else _q_slice(inputs, a, b, sched))
        if acc is None:
            dqs.append(piece)
        else:
            dq = _add_rows(dq, piece, a, b)
            if len(pieces.pieces) > 1:
                dq, inputs = _after(dq, inputs)
    for (m0, m1), sched in zip(pieces_dkv.pieces, pieces_dkv.schedules):
        a, b = m0 * block_kv, m1 * block_kv
        if (a, b) == (0, kv_len):
            sub = inputs._replace(schedule_dkv=sched)
        else:
            sub = inputs._replace(k=inputs.k[:, a:b], v=inputs.v[:, a:b], kv_pos=inputs.kv_pos[a:b],
                                  kv_seg=_slice_rows(inputs.kv_seg, a, b), schedule_dkv=sched)
        dk_j, dv_j = run_dkv(sub)
        if acc is None:
            dks.append(dk_j)
            dvs.append(dv_j)
        else:
            dk, dv = _add_rows(dk, dk_j, a, b), _add_rows(dv, dv_j, a, b)
            if len(pieces_dkv.pieces) > 1:
                (dk, dv), inputs = _after((dk, dv), inputs)
    if acc is not None:
        return dq, dk, dv
    cat = lambda xs: xs[0] if len(xs) == 1 else jnp.concatenate(xs, axis=1)
    return cat(dqs), cat(dks), cat(dvs)


def info_pieces(info: MaskInfo, config, heads: int, q_shard=0, kv_shard=0, device_kind=None) -> PieceSchedules:
    """The forward / dq pieces of shard pair (``q_shard``, ``kv_shard``) under ``config``'s
    budget, from ``info``'s arrays as constants."""
    max_steps = forward_max_steps(list_budget_bytes(config, device_kind), info, heads)
    split = split_work_lists(info, max_steps)
    return pair_schedules(split.pieces, split.arrays, info.head_to_list, q_shard, kv_shard)


def info_pieces_dkv(info_dkv: MaskInfo, config, heads: int, kv_heads: int, q_shard=0, kv_shard=0,
                    device_kind=None) -> PieceSchedules:
    """The dK/dV pieces of a shard pair (as :func:`info_pieces`, transposed view)."""
    max_steps = dkv_max_steps(list_budget_bytes(config, device_kind), info_dkv, heads, kv_heads)
    split = split_work_lists(info_dkv, max_steps)
    return pair_schedules(split.pieces, split.arrays, info_dkv.head_to_list, q_shard, kv_shard)
