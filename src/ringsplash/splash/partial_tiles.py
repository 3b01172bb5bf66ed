"""How the Pallas kernels treat partial tiles, decided on the host: where a tile's mask comes
from, and how its unattended kv columns are found.

Banded masks (``Mask.band``: causal, sliding window and their intersections) build a partial
tile from the positions with one compare per score (``tile_masks.band_tile``), so their
partial blocks are not stored (``partial_mode``): a stored block costs a DMA of the int8 block
and its unpacking on every partial step. Other masks keep ``build_mask_info``'s ``"auto"``. The
price is the position operands: a ``(1, len)`` int32 row on the side the kernels read as a row,
and on the column side a table of block starts in SMEM (``tile_masks.RunColumn``) where every block
holds consecutive positions (contiguous and zigzag layouts), else a lane-replicated ``(len, 128)``
column. Every path takes it (single-device Splash and every context-parallel strategy), except USP
over a ring of more than one device (``parallel/usp.py``) and ``SplashConfig(partial_tiles="stored")``.

A kv position that no query of a tile attends must not carry a NaN / Inf K or V into the tile's
matmuls (the masked-values contract: ``tile_masks.drop_unattended`` zeroes such rows). Reading
the attended columns off the tile's scores costs a reduction over the whole tile, about a tenth of
a partial tile's time on v5e. For banded masks (``Mask.band``) over q blocks of consecutive
positions the host knows better:

* ``"none"``: every partial tile attends every kv column (causal with aligned blocks): no check;
* ``("band", lo, hi)``: a column is attended iff its position lies in ``[q_first - hi, q_last -
  lo]`` (exact for consecutive q positions): the kernels test the kv positions, not the scores;
* ``"scores"``: anything else (stored partial blocks, other masks, lists with different bands, q
  blocks of scattered positions, a MaskInfo holding some q shards' lists only): the scores decide.

Segment ids can leave more columns unattended; the kernels read the scores whenever they are given.

Empty quadrants (``quadrant_band``): with blocks [1024, 1024, 512] the causal diagonal tile leaves rows
0-511 of its second kv-compute slice unattended, and a sliding window's far-edge tile rows 512-1023 of its
first: a quarter of each such tile. When every partial tile comes from one band over the identity layout
(a single device, q and kv positions ``0 .. len - 1``, the kernel call covering every q block), the
forward kernel finds each (row half, slice) pair that no query attends from the entry's block indices
alone (scalar arithmetic) and computes only the other half's rows: skipping a pair whose every score is
masked leaves the running max, sum and accumulator exactly as computing it would. The dK/dV kernel does
the same with the (kv half, q half) quadrants of its transposed tiles: a tile with one empty quadrant runs
as two sub-tiles (a half-height one over every q column and a quarter over the other half).
"""

import numpy as np

from ringsplash.masks.base import PARTIAL, head_masks
from ringsplash.splash.tile_masks import band_of

__all__ = ["partial_column_check", "partial_mode", "quadrant_band"]


def partial_mode(mask, backend: str, partial_tiles: str = "auto") -> str:
    """``build_mask_info``'s ``partial_mode`` for ``mask`` (a ``Mask`` or ``MultiHeadMask``) on
    ``backend``: ``"function"`` when every head's mask is banded and a Pallas kernel runs it, unless
    ``partial_tiles`` (``SplashConfig.partial_tiles``) is ``"stored"``."""
    if backend == "xla" or partial_tiles == "stored":
        return "auto"
    return "function" if all(band_of(m) is not None for m in head_masks(mask)) else "auto"


def partial_column_check(info) -> str | tuple:
    """``"none"``, ``("band", lo, hi)`` or ``"scores"`` for the partial tiles of ``info`` (every
    list and shard pair), as in the module docstring; host work is linear in the entries."""
    if info.q_shard_rows is not None:  # the lists of some q shards only (a multi-host ring): the check
        return "scores"  # must hold for every shard's tiles, and the scores are always right
    partial = info.kind == PARTIAL
    if not partial.any():
        return "none"
    if (partial & (info.partial_index >= 0)).any():
        return "scores"
    lst, a, b, t = np.nonzero(partial)
    bands = {band_of(info.masks[i]) for i in np.unique(lst)}
    if len(bands) != 1 or None in bands:
        return "scores"
    (lo, hi), = bands
    bq, bkv = info.block_shape
    q_pos = np.asarray(info.q_positions).reshape(-1, bq)
    if not np.array_equal(q_pos, q_pos[:, :1] + np.arange(bq)):
        return "scores"
    kv_pos = np.asarray(info.kv_positions).reshape(-1, bkv)
    qb = a * info.q_blocks_per_shard + info.q_block[lst, a, b, t]
    kb = b * info.kv_blocks_per_shard + info.kv_block[lst, a, b, t]
    every = np.ones(qb.shape, bool)
    if lo is not None:  # the last query reaches the block's last key
        every &= kv_pos.max(1)[kb] <= q_pos[qb, -1] - lo
    if hi is not None:  # the first query reaches the block's first key
        every &= kv_pos.min(1)[kb] >= q_pos[qb, 0] - hi
    return "none" if every.all() else ("band", lo, hi)


def quadrant_band(info) -> tuple | None:
    """``(lo, hi)`` when the kernels may skip the empty parts of ``info``'s partial tiles (the module
    docstring; a transposed MaskInfo: the dK/dV kernel's), else None; host work linear in the length."""
    if info.q_shard_rows is not None or info.q_shards != 1 or info.kv_shards != 1:
        return None
    if info.partial_mask_blocks.shape[0]:  # stored blocks: not a band's tiles
        return None
    partial = info.kind == PARTIAL
    if not partial.any():
        return None
    bands = {band_of(info.masks[i]) for i in np.unique(np.nonzero(partial)[0])}
    if len(bands) != 1 or None in bands:
        return None
    for pos, n in ((info.q_positions, info.q_len), (info.kv_positions, info.kv_len)):
        if not np.array_equal(np.asarray(pos), np.arange(n)):
            return None
    (band,) = bands
    return band
