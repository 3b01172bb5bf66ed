"""GlobalTokensMask and subclassing Mask.

Expected masks are built independently (``dense_global``: the first ``num_tokens`` columns set);
GlobalTokensMask also runs through every hypothesis property of ``test_masks.py`` (it is one of
``support.masks.leaf_masks``' kinds)."""

import time
import tracemalloc

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import ringsplash as rs
from ringsplash import layouts, masks
from ringsplash.masks import EMPTY, FULL, PARTIAL
from support.masks import classify_dense, dense_global, dense_local


def test_global_tokens_mask_dense_and_definition():
    m = masks.GlobalTokensMask((6, 10), 3)
    np.testing.assert_array_equal(m[:, :], dense_global(6, 10, 3))
    assert not masks.GlobalTokensMask((4, 4), 0)[:, :].any()
    assert masks.GlobalTokensMask((4, 4), 4)[:, :].all()
    assert m == masks.GlobalTokensMask([6, 10], 3) and m != masks.GlobalTokensMask((6, 10), 4)


@given(data=st.data())
def test_global_tokens_classify_blocks_matches_dense_on_random_position_sets(data):
    q_len, kv_len = data.draw(st.integers(1, 40)), data.draw(st.integers(1, 40))
    n = data.draw(st.integers(0, kv_len))
    mask, want = masks.GlobalTokensMask((q_len, kv_len), n), dense_global(q_len, kv_len, n)
    for _ in range(6):  # arbitrary (not only consecutive) position sets: exact ("any")
        rows = np.unique(data.draw(st.lists(st.integers(0, q_len - 1), min_size=1, max_size=6)))
        cols = np.unique(data.draw(st.lists(st.integers(0, kv_len - 1), min_size=1, max_size=6)))
        got = int(mask.classify_blocks(rows.min(), rows.max(), cols.min(), cols.max()))
        assert got == classify_dense(want[np.ix_(rows, cols)])
    lo, hi = mask.attended_kv_range(np.arange(q_len), np.arange(q_len))
    for i in range(q_len):
        cols = np.flatnonzero(want[i])
        assert np.all((cols >= lo[i]) & (cols <= hi[i]))
    lo, hi = mask.attending_q_range(np.arange(kv_len), np.arange(kv_len))
    for j in range(kv_len):
        rows = np.flatnonzero(want[:, j])
        assert np.all((rows >= lo[j]) & (rows <= hi[j]))


@pytest.mark.parametrize("layout, shards", [("contiguous", 1), ("zigzag", 4), ("striped", 4)])
def test_global_tokens_or_window_build_matches_dense(layout, shards):
    s = 1024
    mask = masks.GlobalTokensMask((s, s), 40) | masks.LocalMask((s, s), window=(100, 0))
    want = dense_global(s, s, 40) | dense_local(s, s, (100, 0))
    perm = layouts.permutation(layout, s, shards)
    for transpose in (False, True):
        for mode in ("auto", "stored", "function"):
            info = rs.build_mask_info(mask, (64, 128), q_shards=shards, kv_shards=shards, q_positions=perm,
                                      kv_positions=perm, transpose=transpose, partial_mode=mode)
            np.testing.assert_array_equal(info.to_dense(), want[np.ix_(perm, perm)])


def test_global_tokens_or_window_classifies_analytically_at_1m():
    """1M tokens: O(blocks) host work (no S x S, no per-block materialising beyond the distinct
    partial blocks, which block_key deduplicates to a handful)."""
    s = 1 << 20
    mask = masks.GlobalTokensMask((s, s), 64) | masks.LocalMask((s, s), window=(4095, 0))
    tracemalloc.start()
    t0 = time.perf_counter()
    info = rs.build_mask_info(mask, (512, 512))
    seconds = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    nb = s // 512
    # per block row: the global column block plus the window's 9 blocks (fewer near the start)
    assert int(info.num_active.sum()) == sum(len({0} | set(range(max(0, i - 8), i + 1))) for i in range(nb))
    assert info.partial_mask_blocks.shape[0] == 5  # diagonal, window edge, global column; the first two with it
    assert peak < 256 * 2**20, f"tracemalloc peak {peak / 2**20:.0f} MiB"
    assert seconds < 30, seconds  # ~1 s here; a dense path would need 1 TiB


def test_global_tokens_mask_rejects_bad_num_tokens():
    with pytest.raises(ValueError, match=r"num_tokens must be in \[0, kv_len=8\], got num_tokens=9"):
        masks.GlobalTokensMask((4, 8), 9)
    with pytest.raises(ValueError, match=r"num_tokens must be in \[0, kv_len=8\], got num_tokens=-1"):
        masks.GlobalTokensMask((4, 8), -1)
    with pytest.raises(TypeError, match="num_tokens"):
        masks.GlobalTokensMask((4, 8), 2.5)


# ----------------------------------------------------------------------------------------
# subclassing Mask


class EveryOtherKey(masks.Mask):
    """A subclass written from the Mask docstring: queries attend even keys only."""

    classification_exact = "any"

    def __init__(self, shape):
        self.shape = tuple(shape)

    def _key(self):
        return (self.shape,)

    def evaluate(self, xp, q_pos, kv_pos):
        return xp.broadcast_to(kv_pos % 2 == 0, xp.broadcast_shapes(xp.shape(q_pos), xp.shape(kv_pos)))

    def classify_blocks(self, q_lo, q_hi, kv_lo, kv_hi):
        shape = np.broadcast_shapes(np.shape(q_lo), np.shape(kv_lo))
        single = np.broadcast_to(kv_lo == kv_hi, shape)
        even = np.broadcast_to(kv_lo % 2 == 0, shape)
        return np.where(single, np.where(even, FULL, EMPTY), PARTIAL).astype(np.int8)


def test_mask_subclass_from_the_docstring_builds():
    m = EveryOtherKey((256, 256))
    want = np.broadcast_to(np.arange(256) % 2 == 0, (256, 256))
    perm = layouts.permutation("zigzag", 256, 2)
    info = rs.build_mask_info(m, (64, 64), q_shards=2, kv_shards=2, q_positions=perm, kv_positions=perm,
                              transpose=True)
    np.testing.assert_array_equal(info.to_dense(), want[np.ix_(perm, perm)])
    assert (m | masks.CausalMask((256, 256)))[:, :].sum() > want.sum()


class Bare(masks.Mask):
    def __init__(self, shape):
        self.shape = shape


def test_mask_subclass_missing_methods_are_named():
    m = Bare((8, 8))
    with pytest.raises(NotImplementedError, match=r"Bare subclasses Mask but does not define _key\(self\)"):
        hash(m)
    with pytest.raises(NotImplementedError, match=r"does not define evaluate\(self, xp, q_pos, kv_pos\)"):
        m[:, :]
    with pytest.raises(NotImplementedError, match=r"does not define classify_blocks\(self, q_lo, q_hi, kv_lo, kv_hi\)"):
        m.classify_blocks(np.zeros(1), np.zeros(1), np.zeros(1), np.zeros(1))


def test_numpy_mask_classify_blocks_says_what_answers_it():
    with pytest.raises(NotImplementedError, match=r"bound_to\(blocking\)"):
        masks.NumpyMask(np.eye(4, dtype=bool)).classify_blocks(0, 1, 0, 1)
