"""The mask interface and algebra: ``Mask`` (what every mask offers, and what a subclass writes),
``&`` / ``|`` (``LogicalAnd`` / ``LogicalOr``), ``MultiHeadMask``; the concrete masks are in
``ringsplash.masks``, which re-exports everything here. True = may attend.

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
    * ``band() -> (lo, hi) | None`` — bounds with ``mask(q, kv) == (lo <= q - kv <= hi)``
      exactly (a side None is unbounded; default None): kernels then build a partial tile with
      one compare per score instead of evaluating ``evaluate(jnp, ...)``;
    * ``has_mask_function`` — False if ``evaluate(jnp, ...)`` cannot run inside a kernel
      (partial blocks are then always stored);
    * ``bound_to(blocking) -> Mask`` — the mask with its analytics specialised to one blocking
      (``build_mask_info`` calls it once per build; default ``self``). ``NumpyMask`` and
      ``FunctionMask`` return tables computed from their contents here.
    """

    shape: tuple[int, int]

    def band(self):
        return None

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


class BoundIntervals:
    """Mixin for a mask bound to one blocking (``Mask.bound_to``): the attended intervals of a
    block row / column by table lookup. The subclass sets ``_q_block`` / ``_kv_block`` (block of
    each original position) and per block ``_kv_lo`` / ``_kv_hi`` (kv positions its rows attend)
    and ``_q_lo`` / ``_q_hi`` (q positions attending its columns). Calls pass positions of real
    blocks, and a position belongs to exactly one block, so any one identifies its block."""

    def attended_kv_range(self, q_lo, q_hi):
        blk = self._q_block[q_lo]
        return self._kv_lo[blk], self._kv_hi[blk]

    def attending_q_range(self, kv_lo, kv_hi):
        blk = self._kv_block[kv_lo]
        return self._q_lo[blk], self._q_hi[blk]


def candidate_runs(range_fn, m_lo, m_hi, n_lo, n_hi):
    """``(first, counts, order)``: major block ``i`` may touch the ``counts[i]`` minor blocks
    from ``first[i]`` on, in minor blocks sorted by lowest position (``order``: that sort, or
    None when they already are); ``range_fn`` gives each major block's minor-position interval."""
    want_lo, want_hi = range_fn(m_lo.astype(np.int64), m_hi.astype(np.int64))
    order = None
    if np.any(np.diff(n_lo) < 0):  # unusual custom orders: sort minor blocks by position
        order = np.argsort(n_lo, kind="stable")
        n_lo, n_hi = n_lo[order], n_hi[order]
    first = np.searchsorted(np.maximum.accumulate(n_hi), want_lo, side="left")
    end = np.searchsorted(n_lo, want_hi, side="right")
    return first, np.maximum(end - first, 0), order


def _where3(full, empty):
    """Kinds from two exclusive bool arrays: PARTIAL + full - empty, computed in int8."""
    full, empty = np.broadcast_arrays(np.asarray(full, bool), np.asarray(empty, bool))
    kinds = full.astype(np.int8)
    kinds -= empty.view(np.int8)
    kinds += PARTIAL
    return kinds


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

    def band(self):  # the intersection of two bands
        a, b = self.left.band(), self.right.band()
        if a is None or b is None:
            return None
        pick = lambda x, y, f: x if y is None else y if x is None else f(x, y)
        return pick(a[0], b[0], max), pick(a[1], b[1], min)


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
