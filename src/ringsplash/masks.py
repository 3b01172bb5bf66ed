"""Lazy, immutable, hashable attention masks (True = may attend).

A mask of shape ``(q_len, kv_len)`` is a predicate over *original* token positions. It never
builds a dense array unless asked for a slice. Every mask offers

* ``mask[q_slice, kv_slice]`` — the dense numpy bool slice (rows/columns in index order);
* ``mask.evaluate(xp, q_pos, kv_pos)`` — the predicate on broadcast position arrays, with
  ``xp`` numpy or ``jax.numpy``; structured masks expose it traced as ``mask_function``;
* ``mask.classify_blocks(q_lo, q_hi, kv_lo, kv_hi)`` — EMPTY / PARTIAL / FULL for block pairs
  from inclusive ranges of the original positions in each block, without dense work;
* ``mask.attended_kv_range`` / ``mask.attending_q_range`` — an interval of positions outside
  which nothing is attended, so a builder only enumerates candidate blocks;
* ``mask.block_key(q_start, kv_start, stride)`` — columns identifying a block's content when
  its positions are arithmetic progressions, so equal partial blocks are stored once.
"""

import numbers
from collections.abc import Sequence

import numpy as np

from ringsplash._scalar_checks import check_int

EMPTY, PARTIAL, FULL = 0, 1, 2
# Position sentinels for "unbounded" interval ends (positions are < 2**40 in practice).
_LO, _HI = -(2**62), 2**62


def _check_shape(shape, name: str = "shape") -> tuple[int, int]:
    if (
        not isinstance(shape, tuple | list)
        or len(shape) != 2
        or not all(isinstance(n, numbers.Integral) and not isinstance(n, bool) for n in shape)
    ):
        raise TypeError(f"{name} must be a (q_len, kv_len) pair of ints, got {shape!r}")
    q_len, kv_len = int(shape[0]), int(shape[1])
    if q_len <= 0 or kv_len <= 0:
        raise ValueError(f"{name} must be positive, got {name}={(q_len, kv_len)}")
    return q_len, kv_len


def _as_index(idx, n: int) -> np.ndarray:
    """Normalise a slice / int / int array into int64 indices within [0, n)."""
    if isinstance(idx, slice):
        return np.arange(n, dtype=np.int64)[idx]
    arr = np.asarray(idx)
    if arr.dtype == bool:
        raise TypeError("boolean indexing of masks is not supported; use slices or ints")
    arr = arr.astype(np.int64)
    if np.any((arr < -n) | (arr >= n)):
        raise IndexError(f"mask index out of range for length {n}: {idx!r}")
    return np.where(arr < 0, arr + n, arr)


class Mask:
    """Base class: a lazy 2-D mask (True = may attend) over original token positions.

    Writing a subclass: set ``self.shape = (q_len, kv_len)`` in ``__init__`` and define

    * ``_key(self) -> tuple`` — the hashable values that identify the mask (``__eq__`` /
      ``__hash__`` compare it; equal keys must mean equal masks, the builders cache on them);
    * ``evaluate(self, xp, q_pos, kv_pos) -> bool array`` — the predicate on broadcasting
      integer position arrays, written with ``xp`` (numpy or ``jax.numpy``), broadcast shape;
    * ``classify_blocks(self, q_lo, q_hi, kv_lo, kv_hi) -> int8 array`` — EMPTY / PARTIAL /
      FULL per block pair from the inclusive position ranges of each block (broadcasting
      arrays); a FULL or EMPTY answer must always be true, PARTIAL may over-approximate
      where ``classification_exact`` allows.

    Optional (the defaults are safe but slower):

    * ``attended_kv_range(q_lo, q_hi) -> (lo, hi)`` / ``attending_q_range(kv_lo, kv_hi) ->
      (lo, hi)`` — inclusive intervals outside which nothing is attended (default unbounded:
      every block is a candidate);
    * ``block_key(q_start, kv_start, stride) -> list of int arrays | None`` — columns that
      determine a partial block's content (default None: each partial block is hashed);
    * ``classification_exact`` — ``"any"`` (exact for any position sets), ``"consecutive"``
      (exact for blocks of consecutive positions; the default) or ``"never"``;
    * ``has_mask_function`` — False if ``evaluate(jnp, ...)`` cannot run inside a kernel
      (partial blocks are then always stored);
    * ``bound_to(blocking) -> Mask`` — the mask with its analytics specialised to one blocking
      (``build_mask_info`` calls it once per build; default ``self``). ``NumpyMask`` and
      ``FunctionMask`` return tables computed from their contents here.
    """

    shape: tuple[int, int]
    #: When classify_blocks is exact: "any" position sets, only blocks of "consecutive"
    #: positions, or "never" (PARTIAL may then over-approximate; build_mask_info verifies).
    classification_exact: str = "consecutive"
    #: whether ``mask_function`` is cheap to trace inside a kernel
    has_mask_function: bool = True

    def _missing(self, method: str, what: str):
        return NotImplementedError(
            f"{type(self).__name__} subclasses Mask but does not define {method}: write "
            f"{method} returning {what} (see the ringsplash.masks.Mask docstring)"
        )

    # --- value semantics -------------------------------------------------------------
    def _key(self) -> tuple:
        raise self._missing("_key(self)", "a hashable tuple identifying the mask (shape and parameters)")

    def __eq__(self, other):
        return type(self) is type(other) and self._key() == other._key()

    def __hash__(self):
        return hash((type(self).__name__, self._key()))

    def __bool__(self):
        raise TypeError(
            f"the truth value of a {type(self).__name__} is ambiguous; "
            "index it (mask[:, :]) for a dense array"
        )

    def __and__(self, other: "Mask") -> "Mask":
        return LogicalAnd(self, other)

    def __or__(self, other: "Mask") -> "Mask":
        return LogicalOr(self, other)

    # --- dense access ---------------------------------------------------------------------
    def evaluate(self, xp, q_pos, kv_pos):
        raise self._missing("evaluate(self, xp, q_pos, kv_pos)",
                            "the bool predicate on broadcasting position arrays, written with xp")

    def mask_function(self, q_pos, kv_pos):
        """Traceable predicate on original positions (broadcasting ``jnp`` int arrays)."""
        import jax.numpy as jnp

        return self.evaluate(jnp, q_pos, kv_pos)

    def __getitem__(self, idx) -> np.ndarray:
        if not isinstance(idx, tuple) or len(idx) != 2:
            raise IndexError(f"index a 2-D mask with mask[q_index, kv_index], got {idx!r}")
        q = _as_index(idx[0], self.shape[0])
        kv = _as_index(idx[1], self.shape[1])
        rows, cols = np.atleast_1d(q), np.atleast_1d(kv)
        out = self.evaluate(np, rows[:, None], cols[None, :])
        out = np.broadcast_to(np.asarray(out, dtype=bool), (rows.size, cols.size))
        # np.array (not .copy()) so an int, int index gives a 0-d ndarray, not a numpy scalar
        return np.array(out[(0 if q.ndim == 0 else slice(None)), (0 if kv.ndim == 0 else slice(None))])

    # --- block analytics ---------------------------------------------------------------------
    def classify_blocks(self, q_lo, q_hi, kv_lo, kv_hi) -> np.ndarray:
        raise self._missing("classify_blocks(self, q_lo, q_hi, kv_lo, kv_hi)",
                            "an int8 array of EMPTY / PARTIAL / FULL per block pair (broadcast shape)")

    def attended_kv_range(self, q_lo, q_hi):
        """(lo, hi) inclusive kv positions that rows in [q_lo, q_hi] may attend (superset)."""
        return np.full_like(q_lo, _LO), np.full_like(q_hi, _HI)

    def attending_q_range(self, kv_lo, kv_hi):
        """(lo, hi) inclusive q positions that may attend columns in [kv_lo, kv_hi]."""
        return np.full_like(kv_lo, _LO), np.full_like(kv_hi, _HI)

    def block_key(self, q_start, kv_start, stride: int) -> list[np.ndarray] | None:
        """Columns that determine the content of a partial block whose rows are
        ``q_start + stride*i`` and columns ``kv_start + stride*j``; None = no such key."""
        return None

    def bound_to(self, blocking) -> "Mask":
        """This mask with its analytics specialised to ``blocking`` (a ``mask_blocks.Blocking``:
        the laid-out positions and block shape of one build). Structured masks answer from
        position ranges alone and return ``self``."""
        return self


def _where3(full, empty):
    """Kinds from two exclusive bool arrays: PARTIAL + full - empty, computed in int8."""
    full, empty = np.broadcast_arrays(np.asarray(full, bool), np.asarray(empty, bool))
    kinds = full.astype(np.int8)
    kinds -= empty.view(np.int8)
    kinds += PARTIAL
    return kinds


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
        from ringsplash.mask_blocks import bind_numpy

        return bind_numpy(self, blocking)


class _Binary(Mask):
    _op = ""

    def __init__(self, left: Mask, right: Mask):
        for name, m in (("left", left), ("right", right)):
            if not isinstance(m, Mask) or isinstance(m, MultiHeadMask):
                raise TypeError(f"{self._op} combines 2-D masks; {name} is {type(m).__name__}")
        if left.shape != right.shape:
            raise ValueError(
                f"cannot combine masks of different shapes: {left.shape} {self._op} {right.shape}"
            )
        self.shape = left.shape
        self.left, self.right = left, right
        self.has_mask_function = left.has_mask_function and right.has_mask_function

    def _key(self):
        return (self.left, self.right)

    def __repr__(self):
        return f"({self.left!r} {self._op} {self.right!r})"

    # A combination of two partial blocks may be empty or full: build_mask_info verifies.
    classification_exact = "never"

    def block_key(self, q_start, kv_start, stride):
        a = self.left.block_key(q_start, kv_start, stride)
        b = self.right.block_key(q_start, kv_start, stride)
        return None if a is None or b is None else a + b

    def bound_to(self, blocking):
        left, right = self.left.bound_to(blocking), self.right.bound_to(blocking)
        return self if (left is self.left and right is self.right) else type(self)(left, right)


class LogicalAnd(_Binary):
    _op = "&"

    def evaluate(self, xp, q_pos, kv_pos):
        return self.left.evaluate(xp, q_pos, kv_pos) & self.right.evaluate(xp, q_pos, kv_pos)

    def classify_blocks(self, *ranges):
        return np.minimum(self.left.classify_blocks(*ranges), self.right.classify_blocks(*ranges))

    def attended_kv_range(self, q_lo, q_hi):
        (a, b), (c, d) = self.left.attended_kv_range(q_lo, q_hi), self.right.attended_kv_range(q_lo, q_hi)
        return np.maximum(a, c), np.minimum(b, d)

    def attending_q_range(self, kv_lo, kv_hi):
        (a, b), (c, d) = self.left.attending_q_range(kv_lo, kv_hi), self.right.attending_q_range(kv_lo, kv_hi)
        return np.maximum(a, c), np.minimum(b, d)


class LogicalOr(_Binary):
    _op = "|"

    def evaluate(self, xp, q_pos, kv_pos):
        return self.left.evaluate(xp, q_pos, kv_pos) | self.right.evaluate(xp, q_pos, kv_pos)

    def classify_blocks(self, *ranges):
        return np.maximum(self.left.classify_blocks(*ranges), self.right.classify_blocks(*ranges))

    def attended_kv_range(self, q_lo, q_hi):
        (a, b), (c, d) = self.left.attended_kv_range(q_lo, q_hi), self.right.attended_kv_range(q_lo, q_hi)
        return np.minimum(a, c), np.maximum(b, d)

    def attending_q_range(self, kv_lo, kv_hi):
        (a, b), (c, d) = self.left.attending_q_range(kv_lo, kv_hi), self.right.attending_q_range(kv_lo, kv_hi)
        return np.minimum(a, c), np.maximum(b, d)


class MultiHeadMask:
    """One 2-D mask per head; shape ``(heads, q_len, kv_len)``."""

    def __init__(self, masks: Sequence[Mask]):
        masks = tuple(masks)
        if not masks:
            raise ValueError("MultiHeadMask needs at least one mask, got an empty sequence")
        for i, m in enumerate(masks):
            if not isinstance(m, Mask):
                raise TypeError(f"masks[{i}] must be a 2-D Mask, got {type(m).__name__}")
            if m.shape != masks[0].shape:
                raise ValueError(
                    f"all head masks must share one shape: masks[0].shape={masks[0].shape}, "
                    f"masks[{i}].shape={m.shape}"
                )
        self.masks = masks
        self.shape = (len(masks), *masks[0].shape)

    def __eq__(self, other):
        return type(other) is MultiHeadMask and self.masks == other.masks

    def __hash__(self):
        return hash(("MultiHeadMask", self.masks))

    def __len__(self):
        return len(self.masks)

    def __repr__(self):
        return f"MultiHeadMask({list(self.masks)!r})"

    def __bool__(self):
        raise TypeError("the truth value of a MultiHeadMask is ambiguous")

    def __getitem__(self, idx) -> np.ndarray:
        if not isinstance(idx, tuple) or len(idx) != 3:
            raise IndexError(f"index a MultiHeadMask with mask[head, q_index, kv_index], got {idx!r}")
        heads = _as_index(idx[0], len(self.masks))
        if heads.ndim == 0:
            return self.masks[int(heads)][idx[1], idx[2]]
        return np.stack([self.masks[int(h)][idx[1], idx[2]] for h in heads])


AnyMask = Mask | MultiHeadMask


def head_masks(mask: AnyMask) -> tuple[Mask, ...]:
    """The per-head 2-D masks (a single 2-D mask is one shared head)."""
    if isinstance(mask, MultiHeadMask):
        return mask.masks
    if isinstance(mask, Mask):
        return (mask,)
    raise TypeError(f"mask must be a ringsplash.masks.Mask or MultiHeadMask, got {type(mask).__name__}")


def dense(mask: AnyMask) -> np.ndarray:
    """The full dense bool array ``[mask_heads, q_len, kv_len]`` (tests and the oracle only)."""
    return np.stack([m[:, :] for m in head_masks(mask)])


# FunctionMask (a mask from a jnp predicate) lives in its own module, which imports JAX lazily;
# re-exported here last, as it builds on the classes above.
from ringsplash.function_mask import FunctionMask  # noqa: E402

__all__ = [
    "EMPTY", "FULL", "PARTIAL", "AnyMask", "CausalMask", "ChunkedCausalMask", "FullMask", "FunctionMask",
    "GlobalTokensMask", "LocalMask", "LogicalAnd", "LogicalOr", "Mask", "MultiHeadMask", "NumpyMask", "PrefixLMMask",
    "dense", "head_masks",
]
