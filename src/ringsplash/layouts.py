"""Token orderings for context parallelism.

A layout is a permutation ``perm`` of ``range(seq_len)``: position ``i`` of the laid-out
sequence holds original token ``perm[i]``, and shard ``s`` of ``num_shards`` owns the
contiguous slice ``[s * L, (s + 1) * L)`` with ``L = seq_len // num_shards``.

* ``"contiguous"``: identity; shard s holds tokens [s L, (s+1) L).
* ``"zigzag"``: split into 2N equal chunks; shard i holds chunks i and 2N-1-i, which
  balances causal work (early and late tokens on every shard).
* ``"striped"``: token t goes to shard t mod N (round robin).
"""

from typing import Literal

import numpy as np

from ringsplash._internal import caches
from ringsplash._internal.scalar_checks import check_choice, check_positive_int, literal_choices

Layout = Literal["contiguous", "zigzag", "striped"]
LAYOUTS: tuple[str, ...] = literal_choices(Layout)


def check_layout(layout: Layout, seq_len: int, num_shards: int) -> None:
    """Raise unless ``layout`` is known and splits ``seq_len`` into ``num_shards`` equal shards
    (``2 x num_shards`` equal chunks for zigzag).

    Args:
        layout: ``"contiguous"``, ``"zigzag"`` or ``"striped"``.
        seq_len: sequence length S (positive int).
        num_shards: number of shards N (positive int).
    """
    check_choice("layout", layout, LAYOUTS)
    seq_len = check_positive_int("seq_len", seq_len)
    num_shards = check_positive_int("num_shards", num_shards)
    parts = 2 * num_shards if layout == "zigzag" else num_shards
    if seq_len % parts:
        raise ValueError(
            f"layout {layout!r} needs seq_len divisible by {parts} "
            f"({'2 x ' if layout == 'zigzag' else ''}num_shards), got {seq_len=}, {num_shards=}"
        )


@caches.lru_cache(maxsize=64)
def _permutation(layout: Layout, seq_len: int, num_shards: int) -> np.ndarray:
    if layout == "contiguous":
        perm = np.arange(seq_len, dtype=np.int32)
    elif layout == "zigzag":
        chunks = np.arange(seq_len, dtype=np.int32).reshape(2 * num_shards, -1)
        order = np.stack([np.arange(num_shards), 2 * num_shards - 1 - np.arange(num_shards)], 1)
        perm = chunks[order.reshape(-1)].reshape(-1)
    else:  # striped: shard s holds s, s + N, s + 2N, ...
        perm = np.arange(seq_len, dtype=np.int32).reshape(-1, num_shards).T.reshape(-1)
    perm.flags.writeable = False
    return perm


def permutation(layout: Layout, seq_len: int, num_shards: int) -> np.ndarray:
    """int32 ``[seq_len]``: laid-out index -> original token position (read-only, cached).

    Args:
        layout: ``"contiguous"``, ``"zigzag"`` or ``"striped"``.
        seq_len: sequence length S, divisible by ``num_shards`` (``2 x num_shards`` for zigzag).
        num_shards: number of shards N.
    """
    check_layout(layout, seq_len, num_shards)
    return _permutation(layout, int(seq_len), int(num_shards))


def inverse_permutation(layout: Layout, seq_len: int, num_shards: int) -> np.ndarray:
    """int32 ``[seq_len]``: original token position -> laid-out index.

    Args:
        layout, seq_len, num_shards: as in :func:`permutation`.
    """
    perm = permutation(layout, seq_len, num_shards)
    inv = np.empty_like(perm)
    inv[perm] = np.arange(seq_len, dtype=np.int32)
    return inv


def permute(x, layout: Layout, num_shards: int, axis: int = -1):
    """Reorder ``x`` along ``axis`` from original order into ``layout``.

    Args:
        x: numpy or jax array.
        layout: ``"contiguous"``, ``"zigzag"`` or ``"striped"``.
        num_shards: number of shards N.
        axis: the sequence axis of ``x``.
    """
    perm = permutation(layout, x.shape[axis], num_shards)
    return x if layout == "contiguous" else x.take(perm, axis=axis)


def unpermute(x, layout: Layout, num_shards: int, axis: int = -1):
    """Inverse of :func:`permute`: back from ``layout`` into original order.

    Args:
        x, layout, num_shards, axis: as in :func:`permute`.
    """
    inv = inverse_permutation(layout, x.shape[axis], num_shards)
    return x if layout == "contiguous" else x.take(inv, axis=axis)


def shard_positions(layout: Layout, seq_len: int, num_shards: int) -> np.ndarray:
    """int32 ``[num_shards, seq_len // num_shards]``: original positions held by each shard.

    Args:
        layout, seq_len, num_shards: as in :func:`permutation`.
    """
    return permutation(layout, seq_len, num_shards).reshape(num_shards, -1)
