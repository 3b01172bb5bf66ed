"""Block-sparse metadata (``MaskInfo``) built on the host from lazy masks.

For every per-head mask and every (q shard, kv shard) pair, ``build_mask_info`` lists the
(q block, kv block) pairs a kernel must visit, each FULL or PARTIAL, in the order the kernel
walks them (q-major, or kv-major with ``transpose=True``). See ``docs/INTERNALS.md`` for the
array contract; the per-pair block builder is ``mask_blocks.py``. Cost: for structured masks
O(number of non-empty block pairs + tokens), never O(q_len * kv_len) — candidate blocks come
from each block row's attendable position interval and are classified from per-block position
ranges; only one representative of each distinct partial block is ever materialised.
"""

import collections
import dataclasses
import hashlib
import operator
import os
import threading
from typing import Literal, NamedTuple

import numpy as np

from ringsplash import masks as masks_lib
from ringsplash._internal import caches
from ringsplash._internal.scalar_checks import (
    check_bool,
    check_choice,
    check_divides,
    check_positive_int,
    literal_choices,
)
from ringsplash.blocksparse.builder import (
    MAX_STORED_PARTIAL_BLOCKS,
    assemble,
    build_list,
    candidate_runs,
    smallest_int_dtype,
    summarise,
)
from ringsplash.masks import EMPTY, FULL, PARTIAL, AnyMask, Mask

__all__ = ["MAX_STORED_PARTIAL_BLOCKS", "PARTIAL_MODES", "BlockSchedule", "MaskInfo", "PartialMode", "build_mask_info",
           "smallest_int_dtype"]

PartialMode = Literal["auto", "stored", "function"]
PARTIAL_MODES: tuple[str, ...] = literal_choices(PartialMode)


class BlockSchedule(NamedTuple):
    """One shard pair's work lists as jnp int32 arrays ``[lists, max_steps]``."""

    q_block: object
    kv_block: object
    kind: object
    partial_index: object
    head_to_list: object  # [mask_heads]
    # int32 [lists]: entries to walk per list, the rest repeat the last one with kind 0
    # (segment-refined, compacted lists: ``splash/segment_blocks.py``); None = every entry
    num_steps: object = None


@dataclasses.dataclass(frozen=True, eq=False)
class MaskInfo:
    block_shape: tuple[int, int]
    q_len: int
    kv_len: int
    q_shards: int
    kv_shards: int
    transpose: bool
    head_to_list: np.ndarray  # [mask_heads]
    q_block: np.ndarray  # [lists, q_shards, kv_shards, max_steps], local to the q shard
    kv_block: np.ndarray  # same, local to the kv shard
    kind: np.ndarray  # same, int8: 0 no compute, 1 partial, 2 full
    partial_index: np.ndarray  # same: row of partial_mask_blocks, -1 = mask_function in kernel
    num_active: np.ndarray  # [lists, q_shards, kv_shards]
    partial_mask_blocks: np.ndarray  # [num_partials, bq, bkv] bool
    masks: tuple[Mask, ...]  # one per list
    q_positions: np.ndarray  # int32 [q_len]
    kv_positions: np.ndarray  # int32 [kv_len]
    # The q shards whose lists the four list arrays hold (their q-shard axis is ``len(q_shard_rows)``
    # long, in this order); None = every q shard. Everything below (and ``num_active``,
    # ``partial_mask_blocks``, ``max_steps``, the dtypes) always covers every q shard, so a rows-only
    # build equals the same rows of the whole build.
    q_shard_rows: tuple[int, ...] | None = None
    # int32 [lists, q_shards, kv_shards, n_major]: entries of each major block (q block; kv block when
    # transposed) in each pair's list, a visit without work counted as 1 (``work_pieces`` cuts pieces
    # from these). None only for MaskInfos made by hand.
    major_counts: np.ndarray | None = None
    # bool [lists, 2]: whether any pair of the list has a PARTIAL entry with a stored block / one
    # evaluated by mask_function in the kernel. None only for MaskInfos made by hand.
    partial_sources: np.ndarray | None = None

    @property
    def num_lists(self) -> int:
        return self.kind.shape[0]

    @property
    def max_steps(self) -> int:
        return self.kind.shape[-1]

    @property
    def q_blocks_per_shard(self) -> int:
        return self.q_len // self.q_shards // self.block_shape[0]

    @property
    def kv_blocks_per_shard(self) -> int:
        return self.kv_len // self.kv_shards // self.block_shape[1]

    @property
    def uses_mask_function(self) -> bool:
        return bool(self.list_partial_sources()[:, 1].any())

    def list_partial_sources(self) -> np.ndarray:
        """bool ``[lists, 2]``: per list, whether some entry (of any shard pair) is PARTIAL with a
        stored block, and whether some is PARTIAL with ``mask_function`` evaluated in the kernel."""
        if self.partial_sources is not None:
            return self.partial_sources
        partial = self.kind == PARTIAL
        return np.stack([np.any(partial & (self.partial_index >= 0), axis=(1, 2, 3)),
                         np.any(partial & (self.partial_index < 0), axis=(1, 2, 3))], axis=1)

    def schedule(self, q_shard=0, kv_shard=0) -> BlockSchedule:
        """The work lists of one shard pair; ``q_shard``/``kv_shard`` may be traced."""
        import jax.numpy as jnp

        if self.q_shard_rows is not None:
            raise ValueError(f"schedule() needs every q shard's lists; this MaskInfo holds q_shard_rows="
                             f"{self.q_shard_rows} (build it without q_shard_rows)")

        def pick(a):  # slice in the compact dtype, widen only the selected pair
            if self.q_shards == 1 and self.kv_shards == 1:
                return jnp.asarray(a[:, 0, 0]).astype(jnp.int32)
            return jnp.asarray(a)[:, q_shard, kv_shard].astype(jnp.int32)

        return BlockSchedule(
            pick(self.q_block),
            pick(self.kv_block),
            pick(self.kind),
            pick(self.partial_index),
            jnp.asarray(self.head_to_list.astype(np.int32)),
        )

    def to_dense(self, head: int = 0) -> np.ndarray:
        """Rebuild the dense ``[q_len, kv_len]`` mask of ``head`` (laid-out frame; tests)."""
        bq, bkv = self.block_shape
        nq, nk = self.q_blocks_per_shard, self.kv_blocks_per_shard
        if self.q_shard_rows is not None:
            raise ValueError(f"to_dense() needs every q shard's lists; this MaskInfo holds q_shard_rows="
                             f"{self.q_shard_rows}")
        out = np.zeros((self.q_len, self.kv_len), dtype=bool)
        lst = int(self.head_to_list[head])
        for a in range(self.q_shards):
            for b in range(self.kv_shards):
                for t in np.flatnonzero(self.kind[lst, a, b] != EMPTY):
                    qb = a * nq + int(self.q_block[lst, a, b, t])
                    kb = b * nk + int(self.kv_block[lst, a, b, t])
                    rows, cols = slice(qb * bq, (qb + 1) * bq), slice(kb * bkv, (kb + 1) * bkv)
                    if self.kind[lst, a, b, t] == FULL:
                        out[rows, cols] = True
                    elif (p := int(self.partial_index[lst, a, b, t])) >= 0:
                        out[rows, cols] = self.partial_mask_blocks[p]
                    else:
                        qp = self.q_positions[rows][:, None]
                        out[rows, cols] = self.masks[lst].evaluate(np, qp, self.kv_positions[cols][None, :])
        return out


# ----------------------------------------------------------------------------------------
# validation


def _check_positions(positions, length: int, name: str) -> np.ndarray | None:
    """int32 positions, or None for the identity (not materialised: it may be huge)."""
    if positions is None:
        return None
    pos = np.asarray(positions)
    if pos.shape != (length,):
        raise ValueError(f"{name} must have shape ({length},), got {pos.shape}")
    if not np.issubdtype(pos.dtype, np.integer):
        raise TypeError(f"{name} must be integers, got dtype {pos.dtype}")
    seen = np.zeros(length, dtype=bool)
    if pos.min() < 0 or pos.max() >= length:
        raise ValueError(f"{name} must be a permutation of range({length}); values out of range")
    seen[pos] = True
    if not seen.all():
        raise ValueError(f"{name} must be a permutation of range({length}); it repeats positions")
    return pos.astype(np.int32)


def _check_rows(rows, q_shards: int) -> tuple[int, ...] | None:
    if rows is None:
        return None
    try:
        out = tuple(operator.index(r) for r in rows)
    except TypeError:
        raise TypeError(f"q_shard_rows must be None or a sequence of ints, got {rows!r}") from None
    if any(not 0 <= r < q_shards for r in out) or len(set(out)) != len(out):
        raise ValueError(f"q_shard_rows must be distinct q shard indices in range({q_shards}), got {out}")
    return out


def _check_blocking(length: int, block: int, shards: int, what: str) -> int:
    """``shards`` as an int, after checking it divides ``length`` and the block tiles each shard."""
    shards = check_positive_int(f"{what}_shards", shards)
    check_divides(f"{what}_shards", shards, f"{what}_len", length)
    check_divides(f"block_shape[{0 if what == 'q' else 1}]", block, f"the per-shard {what} length", length // shards,
                  hint=f"{what}_len // {what}_shards = {length} // {shards} = {length // shards}")
    return shards


# ----------------------------------------------------------------------------------------
# size guard: estimate the build's host memory before building

#: host bytes the builder holds per candidate block pair and per token (positions, per-block
#: summaries): measured 27-30 B per block on causal builds of 1M and 4M tokens and ~9 B per
#: token on a local-window build of 16M tokens (tracemalloc peaks), rounded up
BUILD_BYTES_PER_BLOCK, BUILD_BYTES_PER_TOKEN = 32, 16


def _block_ranges(positions: np.ndarray | None, length: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """int64 (lowest, highest) original position of each block of ``block`` rows."""
    if positions is None:  # the identity, without materialising it
        lo = np.arange(length // block, dtype=np.int64) * block
        return lo, lo + (block - 1)
    p = positions.reshape(length // block, block)
    return p.min(1).astype(np.int64), p.max(1).astype(np.int64)


def estimate_build_bytes(mask: AnyMask, block_shape: tuple[int, int], q_positions=None, kv_positions=None) -> int:
    """An upper bound on the host bytes :func:`build_mask_info` needs: its candidate block pairs
    (each q block against the kv blocks its mask's attended interval reaches, as the builder
    enumerates them) and its per-token arrays; O(blocks), nothing of size S x S."""
    heads = masks_lib.head_masks(mask)
    q_len, kv_len = heads[0].shape
    bq, bkv = block_shape
    q_lo, q_hi = _block_ranges(None if q_positions is None else np.asarray(q_positions), q_len, bq)
    kv_lo, kv_hi = _block_ranges(None if kv_positions is None else np.asarray(kv_positions), kv_len, bkv)
    candidates = sum(int(candidate_runs(m.attended_kv_range, q_lo, q_hi, kv_lo, kv_hi)[1].sum())
                     for m in dict.fromkeys(heads))
    return BUILD_BYTES_PER_BLOCK * candidates + BUILD_BYTES_PER_TOKEN * (q_len + kv_len)


def _host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _check_build_size(heads, block_shape, q_pos, kv_pos) -> None:
    mask = heads[0] if len(heads) == 1 else masks_lib.MultiHeadMask(heads)
    need, have = estimate_build_bytes(mask, block_shape, q_pos, kv_pos), _host_memory_bytes()
    if need > have:
        blocks = (need - BUILD_BYTES_PER_TOKEN * sum(heads[0].shape)) // BUILD_BYTES_PER_BLOCK
        raise MemoryError(
            f"build_mask_info for a {heads[0].shape} mask with block_shape={tuple(block_shape)} would need about "
            f"{need / 2**30:,.1f} GiB of host memory (up to {blocks:,} non-empty blocks), more than this host's "
            f"{have / 2**30:.1f} GiB: use larger blocks, a sparser mask or a shorter sequence"
        )


def _build(mask: AnyMask, block_shape, q_shards, kv_shards, q_pos, kv_pos, transpose, partial_mode,
           rows=None) -> MaskInfo:
    heads = masks_lib.head_masks(mask)
    q_len, kv_len = heads[0].shape
    bq, bkv = block_shape
    q_identity = q_pos is None or bool(np.array_equal(q_pos, np.arange(q_len)))
    kv_identity = kv_pos is None or bool(np.array_equal(kv_pos, np.arange(kv_len)))
    q_pos = np.arange(q_len, dtype=np.int32) if q_pos is None else q_pos
    kv_pos = np.arange(kv_len, dtype=np.int32) if kv_pos is None else kv_pos
    qb = summarise(q_pos, bq, identity=q_identity)
    kb = summarise(kv_pos, bkv, identity=kv_identity)
    unique, head_to_list = {}, []
    for m in heads:  # heads with equal masks share one list
        head_to_list.append(unique.setdefault(m, len(unique)))
    builds = [build_list(m, qb, kb, bq, bkv, q_shards, kv_shards, transpose, partial_mode, rows) for m in unique]
    q_block, kv_block, kind, partial, num_active, major_counts = assemble(builds, q_shards, kv_shards, rows)
    blocks = [blk for _, stored, _, _ in builds for blk in (stored or [])]
    pmb = np.stack(blocks).astype(bool) if blocks else np.zeros((0, bq, bkv), bool)
    return MaskInfo(
        block_shape=(bq, bkv), q_len=q_len, kv_len=kv_len, q_shards=q_shards, kv_shards=kv_shards,
        transpose=transpose, head_to_list=np.asarray(head_to_list, smallest_int_dtype(0, len(unique))),
        q_block=q_block, kv_block=kv_block, kind=kind, partial_index=partial, num_active=num_active,
        partial_mask_blocks=pmb, masks=tuple(unique), q_positions=q_pos, kv_positions=kv_pos,
        q_shard_rows=rows, major_counts=major_counts, partial_sources=np.stack([src for *_, src in builds]),
    )


# ----------------------------------------------------------------------------------------
# public entry point with an LRU cache


_CACHE: "collections.OrderedDict[tuple, MaskInfo]" = collections.OrderedDict()
_CACHE_SIZE = 32
_CACHE_LOCK = threading.Lock()


def _digest(pos: np.ndarray | None):
    if pos is None:
        return None
    return hashlib.blake2b(np.ascontiguousarray(pos).tobytes(), digest_size=16).digest()


def build_mask_info(
    mask: AnyMask,
    block_shape: tuple[int, int],
    *,
    q_shards: int = 1,
    kv_shards: int = 1,
    q_positions=None,
    kv_positions=None,
    transpose: bool = False,
    partial_mode: PartialMode = "auto",
    q_shard_rows=None,
) -> MaskInfo:
    """Block-sparse metadata for ``mask`` (LRU-cached on its arguments).

    Args:
        mask: a ``Mask`` or ``MultiHeadMask`` of shape ``(q_len, kv_len)`` on original positions.
        block_shape: ``(block_q, block_kv)`` positive ints; each tiles a shard exactly.
        q_shards: number of equal q shards (``q_len // q_shards`` rows each); one work list per
            (q shard, kv shard) pair.
        kv_shards: number of equal kv shards.
        q_positions: int ``[q_len]`` permutation: ``q_positions[i]`` is the original position of
            row ``i`` (a token layout); None = identity.
        kv_positions: likewise for the kv columns.
        transpose: build the transposed (kv-major) view the dK/dV kernel walks.
        partial_mode: ``"stored"`` keeps deduplicated partial blocks, ``"function"`` flags
            partial blocks for in-kernel ``mask_function`` evaluation, ``"auto"`` stores up to
            ``MAX_STORED_PARTIAL_BLOCKS`` distinct blocks per mask (NumpyMask always stores).
        q_shard_rows: None (every q shard), or a sequence of distinct q shard indices: the list
            arrays then hold only those q shards' lists (``[lists, len(q_shard_rows), kv_shards,
            max_steps]``, in this order), equal to the same rows of the whole build; everything
            else (``num_active``, ``partial_mask_blocks``, ``max_steps``, dtypes, pieces) is the
            whole build's, so every process of a multi-host slice agrees on it. For either view
            (``transpose``) the rows are q shards. Every pair is still enumerated and classified
            (O(candidate blocks), needed for those global parts); only the expansion into
            padded lists (most of the time and memory) is limited to these rows.

    Returns:
        the cached ``MaskInfo``.
    """
    heads = masks_lib.head_masks(mask)
    q_len, kv_len = heads[0].shape
    if not isinstance(block_shape, tuple | list) or len(block_shape) != 2:
        raise ValueError(f"block_shape must be a pair of positive ints, got {block_shape!r}")
    bq, bkv = (check_positive_int(f"block_shape[{i}]", b) for i, b in enumerate(block_shape))
    check_choice("partial_mode", partial_mode, PARTIAL_MODES)
    transpose = check_bool("transpose", transpose)
    q_shards = _check_blocking(q_len, bq, q_shards, "q")
    kv_shards = _check_blocking(kv_len, bkv, kv_shards, "kv")
    q_pos = _check_positions(q_positions, q_len, "q_positions")
    kv_pos = _check_positions(kv_positions, kv_len, "kv_positions")
    rows = _check_rows(q_shard_rows, q_shards)
    key = (mask, bq, bkv, int(q_shards), int(kv_shards), _digest(q_positions), _digest(kv_positions),
           bool(transpose), partial_mode, rows)
    with _CACHE_LOCK:
        if key in _CACHE:
            _CACHE.move_to_end(key)
            return _CACHE[key]
    _check_build_size(heads, (bq, bkv), q_pos, kv_pos)
    info = _build(mask, (bq, bkv), int(q_shards), int(kv_shards), q_pos, kv_pos, bool(transpose), partial_mode,
                  rows)
    for a in (info.q_block, info.kv_block, info.kind, info.partial_index, info.num_active,
              info.partial_mask_blocks, info.head_to_list, info.major_counts, info.partial_sources):
        a.flags.writeable = False
    with _CACHE_LOCK:
        _CACHE[key] = info
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return info


@caches.register
def _cache_clear() -> None:
    with _CACHE_LOCK:
        _CACHE.clear()


build_mask_info.cache_clear = _cache_clear
