"""Skipping the empty parts of banded partial tiles, kernel side (private to ``splash/``).

When ``splash.partial_tiles.quadrant_band`` holds (one band over positions equal to the block offsets), a
kernel knows each tile's positions from its work-list entry alone, so scalar arithmetic finds the parts of
a partial tile that no query attends. Skipping such a part is exact: its scores are all masked, so it
would change no running max, sum, accumulator or gradient.

* forward, ``(q, kv)`` tiles in kv-compute slices: per slice, the top / bottom row half may be empty
  (``by_row_halves``);
* dK/dV kernel, ``(kv, q)`` tiles: the causal diagonal leaves the (kv bottom, q left) quadrant empty and a
  sliding window's far edge the (kv top, q right) one; the other three run as two sub-tiles
  (``by_quadrants``).
"""

import jax.numpy as jnp
from jax.experimental import pallas as pl

from ringsplash.splash._kernel_common import kv_block_of, q_block_of


def band_misses(band, q_first, q_last, kv_first, kv_last):
    """Scalar bool: no (q, kv) with q in ``[q_first, q_last]`` and kv in ``[kv_first, kv_last]`` satisfies
    ``lo <= q - kv <= hi`` (``band = (lo, hi)``; scalar int32 bounds)."""
    lo, hi = band
    out = jnp.bool_(False)
    if lo is not None:
        out = out | (q_last - kv_first < lo)
    if hi is not None:
        out = out | (q_first - kv_last > hi)
    return out


def by_row_halves(step, band, word, *, bq, block_kv, start, width):
    """Run ``step(rows)`` for the forward slice ``[start, start + width)`` of the kv block of the entry
    ``word`` (``(bq, block_kv)`` tiles): on every row (``rows=None``) or, when one row half attends none of
    the slice, on the other half only (``pl.ds``); nothing when neither does."""
    half = bq // 2
    q0, k0 = q_block_of(word) * bq, kv_block_of(word) * block_kv + start
    top = band_misses(band, q0, q0 + half - 1, k0, k0 + width - 1)
    bottom = band_misses(band, q0 + half, q0 + bq - 1, k0, k0 + width - 1)
    lo, hi = band
    pl.when(~top & ~bottom)(lambda: step(None))
    if lo is not None:  # with no lower bound the top half (smaller q) misses only if the bottom does too
        pl.when(top & ~bottom)(lambda: step(pl.ds(half, half)))
    if hi is not None:  # likewise with no upper bound for the bottom half
        pl.when(~top & bottom)(lambda: step(pl.ds(0, half)))


def by_quadrants(sub_tile, band, word, *, bq, bkv):
    """Run a dK/dV ``(bkv, bq)`` tile of the entry ``word`` as ``sub_tile(kv_rows, q_cols)`` calls (``pl.ds``;
    None: all): whole, or without its one empty quadrant when that is the causal diagonal's or a window far
    edge's (any other pattern runs whole)."""
    hk, hq = bkv // 2, bq // 2
    k0, q0 = kv_block_of(word) * bkv, q_block_of(word) * bq
    (e00, e01), (e10, e11) = [[band_misses(band, q0 + c * hq, q0 + (c + 1) * hq - 1, k0 + r * hk,
                                           k0 + (r + 1) * hk - 1) for c in (0, 1)] for r in (0, 1)]
    top, bottom, left, right = pl.ds(0, hk), pl.ds(hk, hk), pl.ds(0, hq), pl.ds(hq, hq)
    # a lower bound alone (causal) can only empty the lower-left quadrant (q < kv), an upper bound alone only the
    # upper-right one: the other variant is not compiled (less kernel code, shorter Mosaic compiles)
    lo, hi = band
    lower_left = (e10 & ~e00 & ~e01 & ~e11) if lo is not None else jnp.bool_(False)
    upper_right = (e01 & ~e00 & ~e10 & ~e11) if hi is not None else jnp.bool_(False)

    @pl.when(~lower_left & ~upper_right)
    def _whole():
        sub_tile(None, None)

    if lo is not None:
        @pl.when(lower_left)
        def _without_lower_left():
            sub_tile(top, None)
            sub_tile(bottom, right)

    if hi is not None:
        @pl.when(upper_right)
        def _without_upper_right():
            sub_tile(top, left)
            sub_tile(bottom, None)
