"""Lazy, immutable, hashable attention masks (True = may attend): the structured masks (full,
causal, sliding window, chunked, prefix-LM, global tokens), ``NumpyMask`` and ``FunctionMask``,
on the interface and algebra of ``ringsplash.masks.base`` (``Mask``, ``&`` / ``|``,
``MultiHeadMask``), all importable from here.
"""


import numpy as np

from ringsplash._internal.scalar_checks import check_int
from ringsplash.masks.base import (  # noqa: F401  (re-exported: the one import path for masks)
    _HI,
    _LO,
    EMPTY,
    FULL,
    PARTIAL,
    AnyMask,
    LogicalAnd,
    LogicalOr,
    Mask,
    MultiHeadMask,
    _as_index,
    _Binary,
    _check_shape,
    _where3,
    dense,
    head_masks,
)


class FullMask(Mask):
    """Every query attends every key."""

    classification_exact = "any"

    def __init__(self, shape):
        self.shape = _check_shape(shape)

    def _key(self):
        return (self.shape,)

    def __repr__(self):
        return f"FullMask({self.shape})"

    def evaluate(self, xp, q_pos, kv_pos):
        return xp.ones(xp.broadcast_shapes(xp.shape(q_pos), xp.shape(kv_pos)), dtype=bool)

    def classify_blocks(self, q_lo, q_hi, kv_lo, kv_hi):
        return np.full(np.broadcast_shapes(np.shape(q_lo), np.shape(kv_lo)), FULL, np.int8)

    def block_key(self, q_start, kv_start, stride):
        return []


class CausalMask(Mask):
    """``q + offset >= kv``; ``offset = kv_len - q_len`` aligns the diagonal bottom-right."""

    # Monotone in q and kv: the extreme pairs of the two ranges decide, for any position set.
    classification_exact = "any"

    def __init__(self, shape, offset: int = 0):
        self.shape = _check_shape(shape)
        self.offset = check_int("offset", offset)

    def _key(self):
        return (self.shape, self.offset)

    def __repr__(self):
        return f"CausalMask({self.shape}, offset={self.offset})"

    def evaluate(self, xp, q_pos, kv_pos):
        return q_pos + self.offset >= kv_pos

    def band(self):
        return (-self.offset, None)

    def classify_blocks(self, q_lo, q_hi, kv_lo, kv_hi):
        return _where3(q_lo + self.offset >= kv_hi, q_hi + self.offset < kv_lo)

    def attended_kv_range(self, q_lo, q_hi):
        return np.full_like(q_lo, _LO), q_hi + self.offset

    def attending_q_range(self, kv_lo, kv_hi):
        return kv_lo - self.offset, np.full_like(kv_hi, _HI)

    def block_key(self, q_start, kv_start, stride):
        return [kv_start - q_start]


class LocalMask(Mask):
    """Sliding window: ``-right <= (q + offset) - kv <= left``; a side of None is unbounded."""

    def __init__(self, shape, window: tuple[int | None, int | None], offset: int = 0):
        self.shape = _check_shape(shape)
        if not isinstance(window, tuple | list) or len(window) != 2:
            raise TypeError(f"window must be a (left, right) pair, got {window!r}")
        left, right = (None if w is None else check_int("window side", w, minimum=0) for w in window)
        self.window = (left, right)
        self.offset = check_int("offset", offset)

    def _key(self):
        return (self.shape, self.window, self.offset)

    def __repr__(self):
        return f"LocalMask({self.shape}, window={self.window}, offset={self.offset})"

    def evaluate(self, xp, q_pos, kv_pos):
        left, right = self.window
        diff = q_pos + self.offset - kv_pos
        ok = xp.ones(xp.broadcast_shapes(xp.shape(q_pos), xp.shape(kv_pos)), dtype=bool)
        if left is not None:
            ok = ok & (diff <= left)
        if right is not None:
            ok = ok & (diff >= -right)
        return ok

    def band(self):
        left, right = self.window
        return (None if right is None else -right - self.offset, None if left is None else left - self.offset)

    def classify_blocks(self, q_lo, q_hi, kv_lo, kv_hi):
        left, right = self.window
        dmin = q_lo + self.offset - kv_hi
        dmax = q_hi + self.offset - kv_lo
        full = np.ones(np.broadcast_shapes(np.shape(dmin), np.shape(dmax)), dtype=bool)
        empty = np.zeros_like(full)
        if left is not None:
            full &= dmax <= left
            empty |= dmin > left
        if right is not None:
            full &= dmin >= -right
            empty |= dmax < -right
        return _where3(full, empty)

    def attended_kv_range(self, q_lo, q_hi):
        left, right = self.window
        lo = np.full_like(q_lo, _LO) if left is None else q_lo + self.offset - left
        hi = np.full_like(q_hi, _HI) if right is None else q_hi + self.offset + right
        return lo, hi

    def attending_q_range(self, kv_lo, kv_hi):
        left, right = self.window
        lo = np.full_like(kv_lo, _LO) if right is None else kv_lo - self.offset - right
        hi = np.full_like(kv_hi, _HI) if left is None else kv_hi - self.offset + left
        return lo, hi

    def block_key(self, q_start, kv_start, stride):
        return [kv_start - q_start]


class ChunkedCausalMask(Mask):
    """Causal attention inside fixed chunks: ``q >= kv`` and ``q // chunk == kv // chunk``."""

    def __init__(self, shape, chunk_size: int):
        self.shape = _check_shape(shape)
        self.chunk_size = check_int("chunk_size", chunk_size, minimum=1)

    def _key(self):
        return (self.shape, self.chunk_size)

    def __repr__(self):
        return f"ChunkedCausalMask({self.shape}, chunk_size={self.chunk_size})"

    def evaluate(self, xp, q_pos, kv_pos):
        c = self.chunk_size
        return (q_pos >= kv_pos) & (q_pos // c == kv_pos // c)

    def classify_blocks(self, q_lo, q_hi, kv_lo, kv_hi):
        c = self.chunk_size
        full = (q_lo >= kv_hi) & (q_lo // c == kv_hi // c) & (q_hi // c == kv_lo // c)
        # Chunks shared by both ranges are [first, last]; inside a shared chunk the best pair is
        # the latest query against the earliest key (exact for consecutive positions).
        first = np.maximum(q_lo // c, kv_lo // c)
        last = np.minimum(q_hi // c, kv_hi // c)

        def attends_in(chunk):
            return np.minimum(q_hi, chunk * c + c - 1) >= np.maximum(kv_lo, chunk * c)

        nonempty = (first <= last) & ((last - first >= 2) | attends_in(first) | attends_in(last))
        return _where3(full, ~nonempty)

    def attended_kv_range(self, q_lo, q_hi):
        return (q_lo // self.chunk_size) * self.chunk_size, q_hi

    def attending_q_range(self, kv_lo, kv_hi):
        return kv_lo, (kv_hi // self.chunk_size) * self.chunk_size + self.chunk_size - 1

    def block_key(self, q_start, kv_start, stride):
        return [q_start % self.chunk_size, kv_start - q_start]


class PrefixLMMask(Mask):
    """Bidirectional over the first ``prefix_len`` keys, causal after: ``kv < prefix or q >= kv``."""

    classification_exact = "any"

    def __init__(self, shape, prefix_len: int):
        self.shape = _check_shape(shape)
        prefix_len = check_int("prefix_len", prefix_len)
        if not 0 <= prefix_len <= self.shape[1]:
            raise ValueError(f"prefix_len must be in [0, kv_len={self.shape[1]}], got {prefix_len=}")
        self.prefix_len = prefix_len

    def _key(self):
        return (self.shape, self.prefix_len)

    def __repr__(self):
        return f"PrefixLMMask({self.shape}, prefix_len={self.prefix_len})"

    def evaluate(self, xp, q_pos, kv_pos):
        return (kv_pos < self.prefix_len) | (q_pos >= kv_pos)

    def classify_blocks(self, q_lo, q_hi, kv_lo, kv_hi):
        p = self.prefix_len
        return _where3((kv_hi < p) | (q_lo >= kv_hi), (kv_lo >= p) & (q_hi < kv_lo))

    def attended_kv_range(self, q_lo, q_hi):
        return np.full_like(q_lo, _LO), np.maximum(q_hi, self.prefix_len - 1)

    def attending_q_range(self, kv_lo, kv_hi):
        return np.where(kv_lo < self.prefix_len, _LO, kv_lo), np.full_like(kv_hi, _HI)

    def block_key(self, q_start, kv_start, stride):
        # columns inside the prefix: j with kv_start + stride*j < prefix_len
        in_prefix = np.clip(-((kv_start - self.prefix_len) // stride), 0, None)
        return [kv_start - q_start, in_prefix]


class GlobalTokensMask(Mask):
    """Global tokens ("attention sinks as tokens"): every query may attend the first
    ``num_tokens`` keys, ``kv < num_tokens``; nothing else. Combine it with a window,
    ``GlobalTokensMask(shape, 4) | LocalMask(shape, window=(1024, 0))`` (StreamingLLM), and with
    ``& CausalMask(shape)`` where queries before a global token must not see it."""

    classification_exact = "any"

    def __init__(self, shape, num_tokens: int):
        self.shape = _check_shape(shape)
        num_tokens = check_int("num_tokens", num_tokens)
        if not 0 <= num_tokens <= self.shape[1]:
            raise ValueError(f"num_tokens must be in [0, kv_len={self.shape[1]}], got {num_tokens=}")
        self.num_tokens = num_tokens

    def _key(self):
        return (self.shape, self.num_tokens)

    def __repr__(self):
        return f"GlobalTokensMask({self.shape}, num_tokens={self.num_tokens})"

    def evaluate(self, xp, q_pos, kv_pos):
        return xp.broadcast_to(kv_pos < self.num_tokens, xp.broadcast_shapes(xp.shape(q_pos), xp.shape(kv_pos)))

    def classify_blocks(self, q_lo, q_hi, kv_lo, kv_hi):
        n = self.num_tokens
        shape = np.broadcast_shapes(np.shape(q_lo), np.shape(kv_lo))
        return _where3(np.broadcast_to(kv_hi < n, shape), np.broadcast_to(kv_lo >= n, shape))

    def attended_kv_range(self, q_lo, q_hi):
        # no global token: the inverted interval (nothing attended)
        if self.num_tokens == 0:
            return np.full_like(q_lo, _HI), np.full_like(q_hi, _LO)
        return np.full_like(q_lo, 0), np.full_like(q_hi, self.num_tokens - 1)

    def attending_q_range(self, kv_lo, kv_hi):
        some = kv_lo < self.num_tokens
        return np.where(some, _LO, _HI), np.where(some, _HI, _LO)

    def block_key(self, q_start, kv_start, stride):
        # rows are all alike; the content is the number of columns j with kv_start + stride*j < n
        global_cols = np.clip(-((kv_start - self.num_tokens) // stride), 0, None)
        return [global_cols + 0 * q_start]


class NumpyMask(Mask):
    """An explicit dense bool array (hashable by content); classified from the array by
    ``build_mask_info``, alone or combined with other masks by ``&`` / ``|``."""

    has_mask_function = False

    def __init__(self, array):
        arr = np.asarray(array)
        if arr.ndim != 2 or arr.dtype != np.bool_:
            raise TypeError(
                f"NumpyMask needs a 2-D bool array, got shape {arr.shape} dtype {arr.dtype}"
            )
        _check_shape(arr.shape, "array.shape")
        self.array = arr.copy()
        self.array.flags.writeable = False
        self.shape = arr.shape
        self._digest = hash(self.array.tobytes())

    def _key(self):
        return (self.shape, self._digest)

    def __eq__(self, other):
        return (
            type(other) is NumpyMask
            and self._key() == other._key()
            and np.array_equal(self.array, other.array)
        )

    __hash__ = Mask.__hash__

    def __repr__(self):
        return f"NumpyMask(shape={self.shape})"

    def evaluate(self, xp, q_pos, kv_pos):
        return xp.asarray(self.array)[q_pos, kv_pos]

    def classify_blocks(self, q_lo, q_hi, kv_lo, kv_hi):
        # position ranges do not determine a block of an arbitrary array; build_mask_info binds
        # the array to its blocking instead (alone, or as a leaf of an & / | composite)
        raise NotImplementedError(
            "NumpyMask.classify_blocks needs the blocking: build_mask_info classifies its blocks from the "
            "array (mask.bound_to(blocking) gives a mask that answers classify_blocks)"
        )

    def bound_to(self, blocking):
        return blocking.bind_numpy(self)  # the builder's blocking binds arrays (mask_blocks.Blocking)


# FunctionMask (a mask from a jnp predicate) lives in its own module on mask_base, importing JAX lazily
from ringsplash.masks.function import FunctionMask  # noqa: E402

__all__ = [
    "EMPTY", "FULL", "PARTIAL", "AnyMask", "CausalMask", "ChunkedCausalMask", "FullMask", "FunctionMask",
    "GlobalTokensMask", "LocalMask", "LogicalAnd", "LogicalOr", "Mask", "MultiHeadMask", "NumpyMask", "PrefixLMMask",
    "dense", "head_masks",
]
