"""``FunctionMask``: a mask given by a jnp predicate ``fn(q_pos, kv_pos)`` (FlexAttention's mask_mod).

Kernels evaluate ``fn`` itself on partial blocks. The block builder never holds a dense S x S
array: ``FunctionMask.bound_to`` evaluates ``fn`` tile by tile on the JAX device (a batch of
(q block, kv block) tiles at a time, ``vmap`` over the batch, ``lax.map`` over batches, jitted,
at most ``TILE_CHUNK_ELEMENTS`` mask elements live per step) and keeps per tile only its kind,
two content hashes and the attended position extremes; per block row / column the attended
intervals follow. The bound mask (``_BoundFunction``) answers the analytic methods by table
lookup, alone or as a leaf of ``&`` / ``|``, and is cached by (mask, positions, block shape) so
the forward and dK/dV views and repeated builds evaluate once. With ``within=`` (a mask the user
promises contains ``fn``) only the tiles ``within`` does not classify EMPTY are evaluated.

JAX is imported lazily: importing ``ringsplash.masks`` stays numpy-only.
"""

import collections
import concurrent.futures
import hashlib
import threading

import numpy as np

from ringsplash._internal import caches
from ringsplash.masks.base import _HI, _LO, EMPTY, FULL, PARTIAL, BoundIntervals, Mask, _check_shape, candidate_runs

__all__ = ["TILE_CHUNK_ELEMENTS", "FunctionMask"]

#: mask elements evaluated per ``lax.map`` step (bool + int32 temporaries: ~100 MiB at 2**22)
TILE_CHUNK_ELEMENTS = 2**22
#: ``lax.map`` steps per jitted call (bounded so each call's outputs stay small)
_STEPS_PER_CALL = 64
_INT32_MAX = np.iinfo(np.int32).max


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


class FunctionMask(Mask):
    """A mask from a jnp predicate: ``fn(q_pos, kv_pos) -> bool array``.

    ``fn`` receives broadcasting int32 arrays of *original* token positions and must return a
    bool array of their broadcast shape, written in ``jax.numpy`` (it is traced in kernels,
    jitted for dense slices and evaluated tile by tile when blocks are classified).

    Args:
        shape: ``(q_len, kv_len)``.
        fn: the predicate (its identity is the mask's identity: equal masks share ``fn`` object).
        within: optional ``Mask`` promised to contain ``fn`` (``fn`` true only where ``within`` is
            true), e.g. ``CausalMask(shape)`` or a ``LocalMask`` window. Only the blocks ``within``
            does not classify EMPTY are evaluated, so a windowed ``fn`` over 1M tokens is cheap.
            Evaluated tiles are checked against it (a ValueError names ``within`` otherwise).

    Example::

        sink_window = lambda q, kv: (kv < 4) | ((q >= kv) & (q - kv < 1024))
        m = FunctionMask((S, S), sink_window, within=GlobalTokensMask((S, S), 4) | LocalMask((S, S), (1024, 0)))
    """

    # unbound: classified from ``within`` (EMPTY where it is, else PARTIAL); bound: exact
    classification_exact = "never"
    has_mask_function = True

    def __init__(self, shape, fn, *, within=None):
        self.shape = _check_shape(shape)
        if not callable(fn):
            raise TypeError(f"fn must be a callable fn(q_pos, kv_pos) -> bool array, got {type(fn).__name__}")
        if within is not None:
            if not isinstance(within, Mask):
                raise TypeError(f"within must be a 2-D ringsplash.masks.Mask or None, got {type(within).__name__}")
            if within.shape != self.shape:
                raise ValueError(f"within must have the mask's shape {self.shape}, got within.shape={within.shape}")
        self.fn, self.within = fn, within
        self._jit = None
        self._evaluators = {}
        _probe(fn)

    def _key(self):
        return (self.shape, self.fn, self.within)

    def __repr__(self):
        name = getattr(self.fn, "__qualname__", repr(self.fn))
        return f"FunctionMask({self.shape}, {name}, within={self.within!r})"

    # --- dense access ---------------------------------------------------------------------
    def evaluate(self, xp, q_pos, kv_pos):
        if xp is np:
            import jax
            import jax.numpy as jnp

            if self._jit is None:
                self._jit = jax.jit(self.fn)
            shape = np.broadcast_shapes(np.shape(q_pos), np.shape(kv_pos))
            q_pos, kv_pos = np.asarray(q_pos, np.int32), np.asarray(kv_pos, np.int32)
            out = _outside_traces(lambda: np.asarray(self._jit(jnp.asarray(q_pos), jnp.asarray(kv_pos)), dtype=bool))
            return np.broadcast_to(out, shape)
        return xp.broadcast_to(self.fn(q_pos, kv_pos), xp.broadcast_shapes(xp.shape(q_pos), xp.shape(kv_pos)))

    def mask_function(self, q_pos, kv_pos):
        return self.fn(q_pos, kv_pos)

    # --- block analytics (unbound: from ``within``; ``bound_to`` gives the exact tables) ------
    def classify_blocks(self, q_lo, q_hi, kv_lo, kv_hi):
        shape = np.broadcast_shapes(np.shape(q_lo), np.shape(kv_lo))
        if self.within is None:
            return np.full(shape, PARTIAL, np.int8)
        return np.minimum(self.within.classify_blocks(q_lo, q_hi, kv_lo, kv_hi), np.int8(PARTIAL))

    def attended_kv_range(self, q_lo, q_hi):
        if self.within is None:
            return super().attended_kv_range(q_lo, q_hi)
        return self.within.attended_kv_range(q_lo, q_hi)

    def attending_q_range(self, kv_lo, kv_hi):
        if self.within is None:
            return super().attending_q_range(kv_lo, kv_hi)
        return self.within.attending_q_range(kv_lo, kv_hi)

    def _evaluator(self, bq: int, bkv: int) -> "_TileEvaluator":
        """The jitted tile evaluator for one block shape (kept, so a new build does not recompile)."""
        if (bq, bkv) not in self._evaluators:
            within = self.within
            within_fn = within.mask_function if within is not None and within.has_mask_function else None
            self._evaluators[bq, bkv] = _TileEvaluator(self.fn, within_fn, bq, bkv)
        return self._evaluators[bq, bkv]

    def bound_to(self, blocking):
        key = (self, _digest(blocking.qb.positions), _digest(blocking.kb.positions), blocking.bq, blocking.bkv)
        with _BOUND_LOCK:  # one evaluation per key, also when two views are built on two threads
            if key in _BOUND:
                _BOUND.move_to_end(key)
                return _BOUND[key]
            bound = _BoundFunction(self, blocking)
            _BOUND[key] = bound
            while len(_BOUND) > _BOUND_SIZE:
                _BOUND.popitem(last=False)
            return bound


def _probe(fn) -> None:
    """Trace ``fn`` once on int32 positions of shapes (2, 1) and (1, 3): bool, broadcastable to (2, 3)."""
    import jax
    import jax.numpy as jnp

    q = jax.ShapeDtypeStruct((2, 1), jnp.int32)
    kv = jax.ShapeDtypeStruct((1, 3), jnp.int32)
    try:
        out = jax.eval_shape(fn, q, kv)
    except Exception as e:  # any failure to trace is the user's fn: say so
        raise TypeError(
            "fn must be traceable by JAX on int32 position arrays (jnp code): fn(q_pos int32[2, 1], kv_pos "
            f"int32[1, 3]) raised {type(e).__name__}: {e}"
        ) from e
    if not hasattr(out, "dtype") or not hasattr(out, "shape"):
        raise TypeError(f"fn must return one bool array, got {type(out).__name__} for fn(q_pos[2, 1], kv_pos[1, 3])")
    if out.dtype != jnp.bool_:
        raise TypeError(
            f"fn must return a bool array, got dtype {out.dtype} for fn(q_pos int32[2, 1], kv_pos int32[1, 3]) "
            "(compare, e.g. q_pos >= kv_pos)"
        )
    try:
        ok = np.broadcast_shapes(tuple(out.shape), (2, 3)) == (2, 3)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(
            f"fn must return an array broadcastable to the broadcast shape of its arguments: fn(q_pos[2, 1], "
            f"kv_pos[1, 3]) should give shape (2, 3), got shape {tuple(out.shape)}"
        )


def _outside_traces(f, *args):
    """``f(*args)`` on a worker thread: JAX's trace state is per thread, so host evaluation stays
    concrete when a build runs while the caller traces (``splash_attention`` under ``jit``)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(f, *args).result()


def _digest(pos: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(pos).tobytes(), digest_size=16).digest()


_BOUND: "collections.OrderedDict[tuple, _BoundFunction]" = collections.OrderedDict()
_BOUND_SIZE = 16
_BOUND_LOCK = threading.Lock()


@caches.register
def _clear_bound() -> None:
    with _BOUND_LOCK:
        _BOUND.clear()


# ----------------------------------------------------------------------------------------
# tile evaluation on the device


class _TileEvaluator:
    """The jitted per-tile reductions of one (fn, within, block shape): ``classify`` (kind,
    attended extremes, within violated) for candidate tiles, ``hashes`` for the PARTIAL ones."""

    def __init__(self, fn, within_fn, bq: int, bkv: int):
        import jax
        import jax.numpy as jnp

        rng = np.random.default_rng(0x5EED)
        # two independent linear hashes of a tile's content (mod 2**32): equal tiles hash equal, an
        # empty tile hashes to 0, two different tiles collide with probability 2**-64
        weights = rng.integers(0, 2**32, size=(2, bq, bkv), dtype=np.uint32)
        self.full_hashes = weights.sum(axis=(1, 2), dtype=np.uint32)
        weights = jnp.asarray(weights)

        def tile_mask(qp, kp):
            return jnp.broadcast_to(fn(qp[:, None], kp[None, :]), (bq, bkv))

        def classify(qp, kp):  # [bq], [bkv] -> reductions of one tile
            m = tile_mask(qp, kp)
            rows, cols = m.any(axis=1), m.any(axis=0)
            kind = jnp.where(m.all(), FULL, jnp.where(rows.any(), PARTIAL, EMPTY)).astype(jnp.int8)
            ext = jnp.stack([jnp.where(cols, kp, _INT32_MAX).min(), jnp.where(cols, kp, -1).max(),
                             jnp.where(rows, qp, _INT32_MAX).min(), jnp.where(rows, qp, -1).max()])
            if within_fn is None:
                return kind, ext
            bad = jnp.any(m & ~jnp.broadcast_to(within_fn(qp[:, None], kp[None, :]), (bq, bkv)))
            return kind, ext, bad

        def hashes(qp, kp):
            m = tile_mask(qp, kp)
            return (jnp.sum(jnp.where(m[None], weights, jnp.uint32(0)), axis=(1, 2), dtype=jnp.uint32),)

        def mapped(per_tile):
            @jax.jit
            def run(q_blocks, kv_blocks, ti, tj):  # ti, tj [steps, per_step] tile indices
                step = lambda t: jax.vmap(per_tile)(q_blocks[t[0]], kv_blocks[t[1]])
                return jax.lax.map(step, (ti, tj))

            return run

        self._classify, self._hashes = mapped(classify), mapped(hashes)
        self.per_step = max(1, TILE_CHUNK_ELEMENTS // (bq * bkv))

    def classify(self, q_blocks, kv_blocks, ti: np.ndarray, tj: np.ndarray):
        """Per tile (host numpy): kind int8, extremes int32 [n, 4] (kv min, kv max, q min, q max of
        what is attended), within violated (bool, or None without within)."""
        kinds, ext, *bad = _outside_traces(self._map, self._classify, q_blocks, kv_blocks, ti, tj)
        return kinds, ext, (bad[0] if bad else None)

    def hashes(self, q_blocks, kv_blocks, ti: np.ndarray, tj: np.ndarray) -> np.ndarray:
        """uint32 [n, 2] content hashes per tile."""
        return _outside_traces(self._map, self._hashes, q_blocks, kv_blocks, ti, tj)[0]

    def _map(self, run, q_blocks, kv_blocks, ti, tj):
        import jax.numpy as jnp

        q_blocks, kv_blocks = jnp.asarray(q_blocks), jnp.asarray(kv_blocks)
        per_step = min(self.per_step, _pow2_at_least(ti.size))
        per_call = per_step * _STEPS_PER_CALL
        outs = []
        for start in range(0, max(ti.size, 1), per_call):
            a, b = ti[start:start + per_call], tj[start:start + per_call]
            steps = -(-max(a.size, 1) // per_step)
            steps = _pow2_at_least(steps) if steps < 8 else -(-steps // 8) * 8  # few shapes: few compiles
            pad = steps * per_step - a.size
            a = np.concatenate([a, np.zeros(pad, a.dtype)]).reshape(steps, per_step)
            b = np.concatenate([b, np.zeros(pad, b.dtype)]).reshape(steps, per_step)
            res = run(q_blocks, kv_blocks, jnp.asarray(a), jnp.asarray(b))
            outs.append([np.asarray(r).reshape(steps * per_step, *r.shape[2:])[: steps * per_step - pad] for r in res])
        return tuple(np.concatenate(parts) for parts in zip(*outs, strict=True))


class _BoundFunction(BoundIntervals, Mask):
    """A ``FunctionMask`` bound to one blocking: per non-empty tile its kind and content hashes,
    per block row / column the attended interval; every analytic call is a table lookup.

    Calls receive the ``lo`` position (``block_key``: the ``start`` position) of real blocks, and
    a position belongs to exactly one block, so it identifies its block under any layout. A block
    row that attends nothing gets the inverted interval (_HI, _LO), as ``_BoundNumpy`` does.
    """

    classification_exact = "any"
    has_mask_function = True

    def __init__(self, mask: FunctionMask, blocking):

        qb, kb, bq, bkv = blocking.qb, blocking.kb, blocking.bq, blocking.bkv
        self.shape, self.mask = mask.shape, mask
        q_len, kv_len = mask.shape
        nq, nk = q_len // bq, kv_len // bkv
        self._nk = nk
        self._q_block = np.empty(q_len, np.int32)
        self._q_block[qb.positions] = np.arange(q_len, dtype=np.int32) // bq
        self._kv_block = np.empty(kv_len, np.int32)
        self._kv_block[kb.positions] = np.arange(kv_len, dtype=np.int32) // bkv

        ti, tj = self._candidates(mask.within, blocking, nq, nk)
        within = mask.within
        evaluator = mask._evaluator(bq, bkv)
        q_blocks = qb.positions.reshape(nq, bq).astype(np.int32)
        kv_blocks = kb.positions.reshape(nk, bkv).astype(np.int32)
        kinds, ext, bad = evaluator.classify(q_blocks, kv_blocks, ti, tj)
        self.tiles_evaluated = int(ti.size)
        if bad is not None and bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"fn attends positions outside within={within!r} (the promise that within contains fn is broken), "
                f"e.g. in the block of laid-out rows {int(ti[i]) * bq}..{(int(ti[i]) + 1) * bq - 1} and columns "
                f"{int(tj[i]) * bkv}..{(int(tj[i]) + 1) * bkv - 1}: pass a larger within, or within=None"
            )
        keep = kinds != EMPTY
        ti, tj, kinds, ext = ti[keep], tj[keep], kinds[keep], ext[keep].astype(np.int64)
        self._tile_key = ti.astype(np.int64) * nk + tj  # sorted (candidates are row-major)
        self._kinds = kinds
        # content hashes: evaluated again for the PARTIAL tiles only (FULL ones are known)
        self._hashes = np.broadcast_to(evaluator.full_hashes.astype(np.int64), (kinds.size, 2)).copy()
        partial = np.flatnonzero(kinds == PARTIAL)
        if partial.size:
            self._hashes[partial] = evaluator.hashes(q_blocks, kv_blocks, ti[partial], tj[partial])
        lo, hi = _LO, _HI
        self._kv_lo, self._kv_hi = np.full(nq, hi, np.int64), np.full(nq, lo, np.int64)
        np.minimum.at(self._kv_lo, ti, ext[:, 0])
        np.maximum.at(self._kv_hi, ti, ext[:, 1])
        self._q_lo, self._q_hi = np.full(nk, hi, np.int64), np.full(nk, lo, np.int64)
        np.minimum.at(self._q_lo, tj, ext[:, 2])
        np.maximum.at(self._q_hi, tj, ext[:, 3])

    @staticmethod
    def _candidates(within, blocking, nq: int, nk: int):
        """Row-major (q block, kv block) tiles to evaluate: all, or those ``within`` allows."""
        if within is None:
            ti = np.repeat(np.arange(nq, dtype=np.int32), nk)
            return ti, np.tile(np.arange(nk, dtype=np.int32), nq)

        w = within.bound_to(blocking)
        qb, kb = blocking.qb, blocking.kb
        q_lo, q_hi = qb.lo.astype(np.int64), qb.hi.astype(np.int64)
        kv_lo, kv_hi = kb.lo.astype(np.int64), kb.hi.astype(np.int64)
        first, counts, order = candidate_runs(w.attended_kv_range, q_lo, q_hi, kv_lo, kv_hi)
        offsets = np.cumsum(counts) - counts
        idx = np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(first - offsets, counts)
        ti = np.repeat(np.arange(nq, dtype=np.int32), counts)
        tj = (idx if order is None else order[idx]).astype(np.int32)
        if order is not None:  # back to row-major order
            resort = np.lexsort((tj, ti))
            ti, tj = ti[resort], tj[resort]
        kinds = w.classify_blocks(q_lo[ti], q_hi[ti], kv_lo[tj], kv_hi[tj])
        keep = kinds != EMPTY
        return ti[keep], tj[keep]

    def _key(self):
        return (self.mask, id(self))

    def __repr__(self):
        return f"bound({self.mask!r})"

    def evaluate(self, xp, q_pos, kv_pos):
        return self.mask.evaluate(xp, q_pos, kv_pos)

    def mask_function(self, q_pos, kv_pos):
        return self.mask.fn(q_pos, kv_pos)

    def _find(self, qi, kj):
        """Index of each (q block, kv block) tile among the non-empty ones, and whether it is there."""
        key = np.asarray(qi, np.int64) * self._nk + np.asarray(kj, np.int64)
        if self._tile_key.size == 0:
            return np.zeros(key.shape, np.int64), np.zeros(key.shape, bool)
        at = np.minimum(np.searchsorted(self._tile_key, key), self._tile_key.size - 1)
        return at, self._tile_key[at] == key

    def classify_blocks(self, q_lo, q_hi, kv_lo, kv_hi):
        qi, kj = np.broadcast_arrays(self._q_block[q_lo], self._kv_block[kv_lo])
        at, found = self._find(qi, kj)
        if self._kinds.size == 0:
            return np.full(qi.shape, EMPTY, np.int8)
        return np.where(found, self._kinds[at], EMPTY).astype(np.int8)


    def block_key(self, q_start, kv_start, stride):
        # the tile's content hashes; a tile not stored is empty, whose hashes are 0 (linear hashes)
        at, found = self._find(self._q_block[q_start], self._kv_block[kv_start])
        if self._hashes.size == 0:
            return [np.zeros(at.shape, np.int64)] * 2
        return [np.where(found, self._hashes[at, 0], 0), np.where(found, self._hashes[at, 1], 0)]
