"""Masks: dense slices, jnp mask functions and block classification against dense numpy.

Every expected value here is built independently of ``ringsplash.masks`` (``np.tril`` /
``np.triu`` / outer comparisons), never by calling the mask under test.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ringsplash import masks
from ringsplash.masks import EMPTY, FULL, PARTIAL
from support.masks import any_masks, classify_dense, dense_causal, dense_chunked, dense_full, dense_local, dense_prefix


def index_strategy(n):
    """A slice (any step), an int (possibly negative) or a 1-D int array (repeats, negatives)."""
    bound = st.none() | st.integers(-n - 2, n + 2)
    slices = st.builds(slice, bound, bound, st.none() | st.integers(-3, 3).filter(bool))
    ints = st.integers(-n, n - 1)
    arrays = st.lists(st.integers(-n, n - 1), min_size=0, max_size=8).map(lambda xs: np.asarray(xs, np.int64))
    return slices | ints | arrays


def reference_slice(d: np.ndarray, qi, ki):
    out = d[qi]
    return out[..., ki]


# ----------------------------------------------------------------------------------------
# fixed examples (each mask type at least once, rectangular shapes)

FIXED = [
    (masks.FullMask((5, 7)), dense_full(5, 7)),
    (masks.CausalMask((8, 8)), dense_causal(8, 8)),
    (masks.CausalMask((6, 10), offset=4), dense_causal(6, 10, 4)),
    (masks.CausalMask((10, 6), offset=-3), dense_causal(10, 6, -3)),
    (masks.LocalMask((12, 12), window=(3, 0)), dense_local(12, 12, (3, 0))),
    (masks.LocalMask((12, 9), window=(None, 2), offset=1), dense_local(12, 9, (None, 2), 1)),
    (masks.LocalMask((9, 12), window=(2, None), offset=-2), dense_local(9, 12, (2, None), -2)),
    (masks.LocalMask((7, 7), window=(None, None)), dense_local(7, 7, (None, None))),
    (masks.ChunkedCausalMask((16, 16), 4), dense_chunked(16, 16, 4)),
    (masks.ChunkedCausalMask((10, 14), 3), dense_chunked(10, 14, 3)),
    (masks.PrefixLMMask((12, 12), 5), dense_prefix(12, 12, 5)),
    (masks.PrefixLMMask((6, 11), 11), dense_prefix(6, 11, 11)),
    (masks.PrefixLMMask((6, 11), 0), dense_prefix(6, 11, 0)),
    (
        masks.CausalMask((16, 16)) & masks.LocalMask((16, 16), window=(4, 0)),
        dense_causal(16, 16) & dense_local(16, 16, (4, 0)),
    ),
    (
        masks.ChunkedCausalMask((16, 20), 8) | masks.PrefixLMMask((16, 20), 3),
        dense_chunked(16, 20, 8) | dense_prefix(16, 20, 3),
    ),
]


@pytest.mark.parametrize("mask, expected", FIXED, ids=[repr(m) for m, _ in FIXED])
def test_mask_full_slice_matches_dense(mask, expected):
    got = mask[:, :]
    assert got.dtype == np.bool_ and got.shape == mask.shape
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(masks.dense(mask)[0], expected)


def test_causal_mask_bottom_right_alignment():
    # offset = kv_len - q_len puts the last query on the last key (decode-style)
    m = masks.CausalMask((3, 8), offset=5)
    assert m[2, :].all() and m[0, 5] and not m[0, 6]


def test_numpy_mask_slices_and_copy_semantics():
    arr = np.random.default_rng(0).random((6, 9)) < 0.5
    m = masks.NumpyMask(arr)
    arr[0, 0] = not arr[0, 0]  # the mask keeps its own copy
    assert m[0, 0] != arr[0, 0]
    arr[0, 0] = not arr[0, 0]
    np.testing.assert_array_equal(m[1:5, ::2], arr[1:5, ::2])
    out = m[:, :]
    out[:] = False  # the returned slice is a fresh writable array
    np.testing.assert_array_equal(m[:, :], arr)


def test_multi_head_mask_indexing():
    heads = [masks.CausalMask((8, 12), offset=4), masks.LocalMask((8, 12), window=(2, 1)), masks.FullMask((8, 12))]
    dense = np.stack([dense_causal(8, 12, 4), dense_local(8, 12, (2, 1)), dense_full(8, 12)])
    mh = masks.MultiHeadMask(heads)
    assert mh.shape == (3, 8, 12) and len(mh) == 3
    np.testing.assert_array_equal(mh[:, :, :], dense)
    np.testing.assert_array_equal(mh[1, 2:6, ::3], dense[1, 2:6, ::3])
    np.testing.assert_array_equal(mh[-1, 3, :], dense[2, 3, :])
    np.testing.assert_array_equal(mh[np.array([2, 0]), :, 5], dense[[2, 0]][:, :, 5])
    np.testing.assert_array_equal(masks.dense(mh), dense)
    assert masks.head_masks(mh) == tuple(heads)


@given(data=st.data())
def test_mask_lazy_slices_match_dense(data):
    mask, expected = data.draw(any_masks())
    q_len, kv_len = mask.shape
    np.testing.assert_array_equal(mask[:, :], expected)
    for _ in range(3):
        qi = data.draw(index_strategy(q_len))
        ki = data.draw(index_strategy(kv_len))
        got = mask[qi, ki]
        want = reference_slice(expected, qi, ki)
        assert np.shape(got) == want.shape
        np.testing.assert_array_equal(got, want)


# ----------------------------------------------------------------------------------------
# mask_function (jnp, jitted)


@given(data=st.data())
def test_mask_function_jitted_matches_dense(data):
    """Every mask's jnp predicate, numpy parts included (they gather from a constant; only
    ``has_mask_function`` says whether it is cheap enough for a kernel)."""
    mask, expected = data.draw(any_masks())
    q_len, kv_len = mask.shape
    q_pos = jnp.arange(q_len, dtype=jnp.int32)[:, None]
    kv_pos = jnp.arange(kv_len, dtype=jnp.int32)[None, :]
    got = jax.jit(mask.mask_function)(q_pos, kv_pos)
    assert got.dtype == jnp.bool_ and got.shape == (q_len, kv_len)
    np.testing.assert_array_equal(np.asarray(got), expected)


@pytest.mark.parametrize("mask, expected", FIXED, ids=[repr(m) for m, _ in FIXED])
def test_mask_function_on_permuted_positions(mask, expected):
    """Positions are original positions in any order; the predicate follows them."""
    rng = np.random.default_rng(1)
    qp, kp = rng.permutation(mask.shape[0]), rng.permutation(mask.shape[1])
    got = jax.jit(mask.mask_function)(jnp.asarray(qp, jnp.int32)[:, None], jnp.asarray(kp, jnp.int32)[None, :])
    np.testing.assert_array_equal(np.asarray(got), expected[np.ix_(qp, kp)])
    # scalar / broadcasting use, as a kernel does per element
    assert bool(mask.mask_function(jnp.int32(qp[0]), jnp.int32(kp[0]))) == expected[qp[0], kp[0]]


def test_structured_masks_have_mask_function_numpy_does_not():
    s = (8, 8)
    assert masks.CausalMask(s).has_mask_function
    assert (masks.CausalMask(s) & masks.LocalMask(s, (2, 0))).has_mask_function
    nm = masks.NumpyMask(np.ones(s, bool))
    assert not nm.has_mask_function
    assert not (masks.CausalMask(s) | nm).has_mask_function


# ----------------------------------------------------------------------------------------
# block classification


def _ranges(draw, n):
    """Inclusive [lo, hi] ranges of consecutive positions inside [0, n)."""
    lo = draw(st.integers(0, n - 1))
    hi = draw(st.integers(lo, n - 1))
    return lo, hi


@given(data=st.data())
def test_classify_blocks_consecutive_matches_dense(data):
    mask, expected = data.draw(any_masks(numpy=False))  # NumpyMask blocks are classified by mask_info
    q_len, kv_len = mask.shape
    nq, nk = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 4))
    q_r = np.array([_ranges(data.draw, q_len) for _ in range(nq)], np.int64)
    k_r = np.array([_ranges(data.draw, kv_len) for _ in range(nk)], np.int64)
    kinds = mask.classify_blocks(q_r[:, 0, None], q_r[:, 1, None], k_r[None, :, 0], k_r[None, :, 1])
    assert kinds.shape == (nq, nk) and kinds.dtype == np.int8
    for i in range(nq):
        for j in range(nk):
            true = classify_dense(expected[q_r[i, 0] : q_r[i, 1] + 1, k_r[j, 0] : k_r[j, 1] + 1])
            _assert_kind(mask, int(kinds[i, j]), true, exact=mask.classification_exact != "never")


@given(data=st.data())
def test_classify_blocks_arbitrary_position_sets_never_wrong(data):
    """For any position sets: FULL/EMPTY claims are always true; "any" masks are exact."""
    mask, expected = data.draw(any_masks(numpy=False))
    q_len, kv_len = mask.shape
    for _ in range(4):
        rows = np.unique(data.draw(st.lists(st.integers(0, q_len - 1), min_size=1, max_size=6)))
        cols = np.unique(data.draw(st.lists(st.integers(0, kv_len - 1), min_size=1, max_size=6)))
        kind = int(mask.classify_blocks(rows.min(), rows.max(), cols.min(), cols.max()))
        true = classify_dense(expected[np.ix_(rows, cols)])
        _assert_kind(mask, kind, true, exact=mask.classification_exact == "any")


def _contains_numpy(mask):
    if isinstance(mask, masks.NumpyMask):
        return True
    if isinstance(mask, masks.base._Binary):
        return _contains_numpy(mask.left) or _contains_numpy(mask.right)
    return False


def _assert_kind(mask, got, true, *, exact):
    assert got in (EMPTY, PARTIAL, FULL)
    if exact:
        assert got == true, f"{mask!r}: classified {got}, dense says {true}"
    else:  # sound over-approximation: FULL and EMPTY claims must hold
        assert got in (PARTIAL, true), f"{mask!r}: classified {got}, dense says {true}"


@pytest.mark.parametrize(
    "mask, expected",
    [(m, d) for m, d in FIXED if not _contains_numpy(m)],
    ids=[repr(m) for m, _ in FIXED if not _contains_numpy(m)],
)
def test_classify_blocks_grid_matches_dense(mask, expected):
    """Vectorised over a whole grid of equal consecutive blocks (the builder's use)."""
    q_len, kv_len = mask.shape
    for bq in (1, 2, 3):
        for bk in (1, 2, 4):
            nq, nk = q_len // bq, kv_len // bk
            q_lo = np.arange(nq) * bq
            k_lo = np.arange(nk) * bk
            kinds = mask.classify_blocks(q_lo[:, None], q_lo[:, None] + bq - 1, k_lo[None], k_lo[None] + bk - 1)
            true = np.array(
                [[classify_dense(expected[i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]) for j in range(nk)] for i in range(nq)]
            ).reshape(nq, nk)
            if mask.classification_exact == "never":
                assert np.all((kinds == PARTIAL) | (kinds == true))
            else:
                np.testing.assert_array_equal(kinds, true)


def test_attended_ranges_are_supersets():
    """Nothing outside attended_kv_range / attending_q_range is ever attended."""
    for mask, expected in FIXED:
        if _contains_numpy(mask):
            continue
        q_len, kv_len = mask.shape
        q = np.arange(q_len, dtype=np.int64)
        lo, hi = mask.attended_kv_range(q, q)
        for i in range(q_len):
            cols = np.flatnonzero(expected[i])
            assert np.all((cols >= lo[i]) & (cols <= hi[i])), mask
        k = np.arange(kv_len, dtype=np.int64)
        lo, hi = mask.attending_q_range(k, k)
        for j in range(kv_len):
            rows = np.flatnonzero(expected[:, j])
            assert np.all((rows >= lo[j]) & (rows <= hi[j])), mask


# ----------------------------------------------------------------------------------------
# value semantics


def _equal_pairs():
    s = (16, 16)
    return [
        (masks.FullMask(s), masks.FullMask([16, 16])),
        (masks.CausalMask(s, offset=2), masks.CausalMask(s, offset=2)),
        (masks.LocalMask(s, window=(3, None)), masks.LocalMask(s, window=(3, None))),
        (masks.ChunkedCausalMask(s, 4), masks.ChunkedCausalMask(s, 4)),
        (masks.PrefixLMMask(s, 5), masks.PrefixLMMask(s, 5)),
        (masks.NumpyMask(np.eye(16, dtype=bool)), masks.NumpyMask(np.eye(16, dtype=bool))),
        (masks.CausalMask(s) & masks.LocalMask(s, (4, 0)), masks.CausalMask(s) & masks.LocalMask(s, (4, 0))),
        (masks.CausalMask(s) | masks.PrefixLMMask(s, 3), masks.CausalMask(s) | masks.PrefixLMMask(s, 3)),
        (masks.MultiHeadMask([masks.CausalMask(s)] * 2), masks.MultiHeadMask((masks.CausalMask(s), masks.CausalMask(s)))),
    ]


@pytest.mark.parametrize("a, b", _equal_pairs(), ids=lambda m: type(m).__name__)
def test_equal_masks_are_equal_and_hash_equal(a, b):
    assert a == b and (a != b) is False
    assert hash(a) == hash(b)
    assert len({a, b}) == 1
    assert {a: 1}[b] == 1


def test_different_masks_are_unequal():
    s = (16, 16)
    distinct = [
        masks.FullMask(s),
        masks.FullMask((16, 8)),
        masks.CausalMask(s),
        masks.CausalMask(s, offset=1),
        masks.LocalMask(s, window=(3, 0)),
        masks.LocalMask(s, window=(3, 1)),
        masks.LocalMask(s, window=(None, 0)),
        masks.ChunkedCausalMask(s, 4),
        masks.ChunkedCausalMask(s, 8),
        masks.PrefixLMMask(s, 4),
        masks.PrefixLMMask(s, 5),
        masks.NumpyMask(np.eye(16, dtype=bool)),
        masks.NumpyMask(~np.eye(16, dtype=bool)),
        masks.CausalMask(s) & masks.LocalMask(s, (4, 0)),
        masks.CausalMask(s) | masks.LocalMask(s, (4, 0)),
        masks.LocalMask(s, (4, 0)) & masks.CausalMask(s),
        masks.MultiHeadMask([masks.CausalMask(s)]),
        masks.MultiHeadMask([masks.CausalMask(s)] * 2),
    ]
    for i, a in enumerate(distinct):
        for j, b in enumerate(distinct):
            assert (a == b) == (i == j), (a, b)
    assert masks.CausalMask(s) != "causal" and masks.CausalMask(s) != None  # noqa: E711


def test_numpy_mask_is_hashable_and_immutable():
    m = masks.NumpyMask(np.tril(np.ones((6, 6), bool)))
    with pytest.raises(ValueError):
        m.array[0, 1] = True
    assert hash(m) == hash(masks.NumpyMask(np.tril(np.ones((6, 6), bool))))


@pytest.mark.parametrize(
    "mask",
    [
        masks.FullMask((4, 4)),
        masks.CausalMask((4, 4)),
        masks.NumpyMask(np.ones((4, 4), bool)),
        masks.CausalMask((4, 4)) & masks.FullMask((4, 4)),
        masks.MultiHeadMask([masks.CausalMask((4, 4))]),
    ],
    ids=lambda m: type(m).__name__,
)
def test_mask_bool_raises(mask):
    with pytest.raises(TypeError, match="ambiguous"):
        bool(mask)
    with pytest.raises(TypeError):
        if mask:
            pass


def test_composition_shapes_and_operands():
    s = (8, 12)
    m = masks.CausalMask(s, offset=4) & masks.LocalMask(s, (2, 0), offset=4) | masks.FullMask(s)
    assert m.shape == s
    np.testing.assert_array_equal(m[:, :], np.ones(s, bool))
    with pytest.raises(TypeError):
        masks.CausalMask(s) & masks.MultiHeadMask([masks.CausalMask(s)])
