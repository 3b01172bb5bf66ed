"""Token orderings for context parallelism.

A layout is a permutation ``perm`` of ``range(seq_len)``: position ``i`` of the laid-out
sequence holds original token ``perm[i]``, and shard ``s`` of ``num_shards`` owns the
contiguous slice ``[s * L, (s + 1) * L)`` with ``L = seq_len // num_shards``.

* ``"contiguous"``: identity; shard s holds tokens [s L, (s+1) L).
* ``"zigzag"``: split into 2N equal chunks; shard i holds chunks i and 2N-1-i, which
  balances causal work (early and late tokens on every shard).
* ``"striped"``: token t goes to shard t mod N (round robin).
"""

import functools

import numpy as np

LAYOUTS = ("contiguous", "zigzag", "striped")


def check_layout(layout: str, seq_len: int, num_shards: int) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout=!r}")
    for name, value in (("seq_len", seq_len), ("num_shards", num_shards)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {name}={value!r}")
    parts = 2 * num_shards if layout == "zigzag" else num_shards
    if seq_len % parts:
        raise ValueError(
            f"layout {layout!r} needs seq_len divisible by {parts} "
            f"({'2 x ' if layout == 'zigzag' else ''}num_shards), got {seq_len=}, {num_shards=}"
        )


@functools.lru_cache(maxsize=64)
def _permutation(layout: str, seq_len: int, num_shards: int) -> np.ndarray:
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


def permutation(layout: str, seq_len: int, num_shards: int) -> np.ndarray:
    """int32 ``[seq_len]``: laid-out index -> original token position (read-only, cached)."""
    check_layout(layout, seq_len, num_shards)
    return _permutation(layout, int(seq_len), int(num_shards))


def inverse_permutation(layout: str, seq_len: int, num_shards: int) -> np.ndarray:
    """int32 ``[seq_len]``: original token position -> laid-out index."""
    perm = permutation(layout, seq_len, num_shards)
    inv = np.empty_like(perm)
    inv[perm] = np.arange(seq_len, dtype=np.int32)
    return inv


def permute(x, layout: str, num_shards: int, axis: int = -1):
    """Reorder ``x`` (numpy or jax array) along ``axis`` from original order into ``layout``."""
    perm = permutation(layout, x.shape[axis], num_shards)
    return x if layout == "contiguous" else x.take(perm, axis=axis)


def unpermute(x, layout: str, num_shards: int, axis: int = -1):
    """Inverse of :func:`permute`: back from ``layout`` into original order."""
    inv = inverse_permutation(layout, x.shape[axis], num_shards)
    return x if layout == "contiguous" else x.take(inv, axis=axis)


def shard_positions(layout: str, seq_len: int, num_shards: int) -> np.ndarray:
    """int32 ``[num_shards, seq_len // num_shards]``: original positions held by each shard."""
    return permutation(layout, seq_len, num_shards).reshape(num_shards, -1)
