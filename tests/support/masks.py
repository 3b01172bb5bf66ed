"""Masks the context-parallel tests share: one mask per kind at a sequence length, packed
segment ids, and hypothesis strategies of (mask, dense numpy) pairs built independently of
``ringsplash.masks``' own slicing (``np.tril`` / ``np.triu`` / outer comparisons)."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from ringsplash import masks
from ringsplash.masks import EMPTY, FULL, PARTIAL


def make_mask(kind: str, s: int, heads: int):
    shape = (s, s)
    if kind == "causal":
        return masks.CausalMask(shape)
    if kind == "local":
        return masks.LocalMask(shape, window=(200, 37))
    if kind == "chunked":
        return masks.ChunkedCausalMask(shape, chunk_size=300)
    if kind == "prefix_lm":
        return masks.PrefixLMMask(shape, prefix_len=333)
    if kind == "composed":  # (causal & window) | a bidirectional prefix
        return (masks.CausalMask(shape) & masks.LocalMask(shape, window=(150, 0))) | masks.PrefixLMMask(shape, 100)
    if kind == "numpy":
        rng = np.random.default_rng(s)
        arr = np.tril(rng.random(shape) < 0.4) | np.eye(s, dtype=bool)
        arr[: s // 8, :] = False  # some rows attend nothing at all
        return masks.NumpyMask(arr)
    if kind == "multi_head":
        per_head = [masks.CausalMask(shape), masks.LocalMask(shape, window=(64, 64)),
                    masks.ChunkedCausalMask(shape, chunk_size=256), masks.CausalMask(shape)]
        return masks.MultiHeadMask(per_head[:heads])
    raise ValueError(kind)


MASK_KINDS = ("causal", "local", "chunked", "prefix_lm", "composed", "numpy", "multi_head")


def packed_segments(key, s: int):
    """Segment ids of a packed batch: runs of random lengths (original token order)."""
    starts = jax.random.bernoulli(key, 1 / 150, (s,)).at[0].set(True)
    return jnp.cumsum(starts).astype(jnp.int32)


# ----------------------------------------------------------------------------------------
# independent dense constructions


def dense_full(q_len, kv_len):
    return np.ones((q_len, kv_len), bool)


def dense_causal(q_len, kv_len, offset=0):
    # kv <= q + offset
    return np.tril(np.ones((q_len, kv_len), bool), k=offset)


def dense_local(q_len, kv_len, window, offset=0):
    left, right = window
    out = np.ones((q_len, kv_len), bool)
    if left is not None:  # kv >= q + offset - left
        out &= np.triu(np.ones((q_len, kv_len), bool), k=offset - left)
    if right is not None:  # kv <= q + offset + right
        out &= np.tril(np.ones((q_len, kv_len), bool), k=offset + right)
    return out


def dense_chunked(q_len, kv_len, chunk):
    same_chunk = np.equal.outer(np.arange(q_len) // chunk, np.arange(kv_len) // chunk)
    return np.tril(np.ones((q_len, kv_len), bool)) & same_chunk


def dense_prefix(q_len, kv_len, prefix):
    out = np.tril(np.ones((q_len, kv_len), bool))
    out[:, :prefix] = True
    return out


def dense_global(q_len, kv_len, num_tokens):
    out = np.zeros((q_len, kv_len), bool)
    out[:, :num_tokens] = True
    return out


def classify_dense(block: np.ndarray) -> int:
    return FULL if block.all() else (EMPTY if not block.any() else PARTIAL)


# ----------------------------------------------------------------------------------------
# hypothesis strategies: (mask, dense) pairs


@st.composite
def shapes(draw, max_len=40):
    return draw(st.integers(1, max_len)), draw(st.integers(1, max_len))


@st.composite
def leaf_masks(draw, shape, numpy=True):
    q_len, kv_len = shape
    kind = draw(st.sampled_from(["full", "causal", "local", "chunked", "prefix", "global"] + ["numpy"] * numpy))
    offset = draw(st.integers(-max(q_len, kv_len), max(q_len, kv_len)))
    if kind == "full":
        return masks.FullMask(shape), dense_full(q_len, kv_len)
    if kind == "causal":
        return masks.CausalMask(shape, offset=offset), dense_causal(q_len, kv_len, offset)
    if kind == "local":
        side = st.none() | st.integers(0, max(q_len, kv_len) + 2)
        window = (draw(side), draw(side))
        return masks.LocalMask(shape, window=window, offset=offset), dense_local(q_len, kv_len, window, offset)
    if kind == "chunked":
        chunk = draw(st.integers(1, max(q_len, kv_len) + 2))
        return masks.ChunkedCausalMask(shape, chunk), dense_chunked(q_len, kv_len, chunk)
    if kind == "prefix":
        prefix = draw(st.integers(0, kv_len))
        return masks.PrefixLMMask(shape, prefix), dense_prefix(q_len, kv_len, prefix)
    if kind == "global":
        n = draw(st.integers(0, kv_len))
        return masks.GlobalTokensMask(shape, n), dense_global(q_len, kv_len, n)
    arr = np.asarray(draw(st.lists(st.booleans(), min_size=q_len * kv_len, max_size=q_len * kv_len)))
    arr = arr.reshape(q_len, kv_len)
    return masks.NumpyMask(arr), arr.copy()


@st.composite
def any_masks(draw, shape=None, depth=2, numpy=True):
    """(mask, dense) for a leaf or an ``&`` / ``|`` tree of up to ``depth`` levels;
    ``numpy=False`` leaves NumpyMask out (for the analytic block methods it does not have)."""
    shape = shape if shape is not None else draw(shapes())
    if depth == 0 or draw(st.booleans()):
        return draw(leaf_masks(shape, numpy))
    a, da = draw(any_masks(shape, depth - 1, numpy))
    b, db = draw(any_masks(shape, depth - 1, numpy))
    if draw(st.booleans()):
        return a & b, da & db
    return a | b, da | db
