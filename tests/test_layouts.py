"""Token layouts: definitions, inverses, permute/unpermute on numpy and jax arrays."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ringsplash import layouts


def test_contiguous_is_identity():
    perm = layouts.permutation("contiguous", 24, 4)
    np.testing.assert_array_equal(perm, np.arange(24))
    np.testing.assert_array_equal(layouts.shard_positions("contiguous", 24, 4), np.arange(24).reshape(4, 6))


def test_zigzag_small_example():
    # 2N = 4 chunks of 2: shard 0 holds chunks 0 and 3, shard 1 holds chunks 1 and 2
    perm = layouts.permutation("zigzag", 8, 2)
    np.testing.assert_array_equal(perm, [0, 1, 6, 7, 2, 3, 4, 5])


def test_striped_small_example():
    perm = layouts.permutation("striped", 8, 4)
    np.testing.assert_array_equal(perm, [0, 4, 1, 5, 2, 6, 3, 7])


@pytest.mark.parametrize("num_shards", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("chunk", [1, 3, 4])
def test_zigzag_definition(num_shards, chunk):
    seq_len = 2 * num_shards * chunk
    held = layouts.shard_positions("zigzag", seq_len, num_shards)
    assert held.shape == (num_shards, seq_len // num_shards)
    for i in range(num_shards):
        first = np.arange(i * chunk, (i + 1) * chunk)
        j = 2 * num_shards - 1 - i
        second = np.arange(j * chunk, (j + 1) * chunk)
        np.testing.assert_array_equal(held[i], np.concatenate([first, second]))


@pytest.mark.parametrize("num_shards", [1, 2, 3, 4, 8])
def test_striped_definition(num_shards):
    seq_len = 5 * num_shards
    perm = layouts.permutation("striped", seq_len, num_shards)
    held = layouts.shard_positions("striped", seq_len, num_shards)
    local = seq_len // num_shards
    for idx, t in enumerate(perm):
        assert idx // local == t % num_shards  # token t lives on shard t mod N
    for s in range(num_shards):
        np.testing.assert_array_equal(held[s], np.arange(s, seq_len, num_shards))  # in increasing order


def defined_permutation(layout, seq_len, num_shards):
    """Independent statement of each layout: the original tokens of shard 0, then shard 1, ..."""
    if layout == "contiguous":
        return np.arange(seq_len)
    if layout == "striped":  # shard s holds s, s + N, s + 2N, ...
        return np.concatenate([np.arange(s, seq_len, num_shards) for s in range(num_shards)])
    chunks = np.arange(seq_len).reshape(2 * num_shards, -1)  # zigzag: chunks s and 2N - 1 - s
    return np.concatenate([np.concatenate([chunks[s], chunks[2 * num_shards - 1 - s]]) for s in range(num_shards)])


@given(
    layout=st.sampled_from(layouts.LAYOUTS),
    num_shards=st.integers(1, 8),
    per=st.integers(1, 6),
)
def test_permutation_and_inverse(layout, num_shards, per):
    seq_len = 2 * num_shards * per
    perm = layouts.permutation(layout, seq_len, num_shards)
    inv = layouts.inverse_permutation(layout, seq_len, num_shards)
    assert perm.dtype == np.int32 and inv.dtype == np.int32 and perm.shape == (seq_len,)
    np.testing.assert_array_equal(perm, defined_permutation(layout, seq_len, num_shards))
    np.testing.assert_array_equal(
        layouts.shard_positions(layout, seq_len, num_shards), perm.reshape(num_shards, -1))
    np.testing.assert_array_equal(perm[inv], np.arange(seq_len))
    np.testing.assert_array_equal(inv[perm], np.arange(seq_len))
    assert not perm.flags.writeable  # cached: callers must not be able to corrupt it


@given(
    layout=st.sampled_from(layouts.LAYOUTS),
    num_shards=st.sampled_from([1, 2, 4]),
    axis=st.integers(-3, 2),
    use_jax=st.booleans(),
)
def test_permute_unpermute_round_trip(layout, num_shards, axis, use_jax):
    shape = [3, 4, 5]
    shape[axis] = 2 * num_shards * 2
    x = np.arange(np.prod(shape)).reshape(shape).astype(np.float32)
    xs = jnp.asarray(x) if use_jax else x
    y = layouts.permute(xs, layout, num_shards, axis=axis)
    assert isinstance(y, jax.Array) == use_jax and y.shape == x.shape
    perm = layouts.permutation(layout, shape[axis], num_shards)
    # laid-out index i holds original token perm[i]
    np.testing.assert_array_equal(np.asarray(y), np.take(x, perm, axis=axis))
    back = layouts.unpermute(y, layout, num_shards, axis=axis)
    np.testing.assert_array_equal(np.asarray(back), x)


def test_permute_under_jit():
    x = jnp.arange(32.0).reshape(2, 16)
    laid_out = jax.jit(lambda a: layouts.permute(a, "zigzag", 4, axis=1))(x)
    np.testing.assert_array_equal(laid_out, np.asarray(x)[:, defined_permutation("zigzag", 16, 4)])
    back = jax.jit(lambda a: layouts.unpermute(a, "zigzag", 4, axis=1))(laid_out)
    np.testing.assert_array_equal(back, x)


def test_layout_errors():
    # Literal-typed: the library's ValueError, or the test run's type check (TypeError)
    with pytest.raises((ValueError, TypeError), match="layout"):
        layouts.permutation("spiral", 16, 2)
    with pytest.raises(ValueError, match="seq_len"):
        layouts.permutation("zigzag", 12, 4)  # needs 2N = 8 | seq_len
    with pytest.raises(ValueError, match="seq_len"):
        layouts.permutation("striped", 10, 4)
    with pytest.raises(ValueError, match="num_shards"):
        layouts.permutation("contiguous", 16, 0)
    with pytest.raises(ValueError, match="seq_len"):
        layouts.permutation("contiguous", 0, 1)
    with pytest.raises((ValueError, TypeError), match="layout"):
        layouts.permute(np.zeros(8), "spiral", 2)
    with pytest.raises(ValueError, match="seq_len"):
        layouts.unpermute(np.zeros(6), "zigzag", 2)
