"""Sharding-independent checksums of arrays: what a checkpoint records of each array at save
and checks at restore (``ringsplash.checkpoints``).

The checksum of an array is two 32-bit sums over its elements of a mixed hash of (global flat
index, bits): integer sums are exact and associative, so one ``jit`` over a sharded array gives
the same value under any mesh, sharding or process count (each device sums its shard, XLA adds
the partial sums), and the numpy path on the host gives the same value too. Each element's hash
mixes its bits with its position (murmur3's finaliser), so flipped bits, swapped elements or a
shard read from the wrong place change it. An integrity check, not a cryptographic one: it
catches corruption, not a forger.
"""

import contextlib
import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["array_checksums", "checksum_of", "data_checksums", "data_digest"]

_SEEDS = ((0x9E3779B9, 0x85EBCA6B), (0x7FEB352D, 0x846CA68B))


def _fmix(h, xp):
    """murmur3's 32-bit finaliser (wrapping uint32 arithmetic)."""
    h = h ^ (h >> 16)
    h = h * xp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * xp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _mixed_sums(bits, index, xp):
    """The two wrapping sums over elements of ``fmix(fmix(bits * a) ^ (index * b))``."""
    out = []
    for a, b in _SEEDS:
        h = _fmix(_fmix(bits * xp.uint32(a), xp) ^ (index * xp.uint32(b)), xp)
        out.append(xp.sum(h, dtype=xp.uint32))
    return out


def _format(sums) -> str:
    return "".join(f"{int(s):08x}" for s in sums)


def _bits_jnp(x):
    """uint32 per element (an 8-byte element folds its two halves)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = jnp.dtype(x.dtype).itemsize
    if size == 8:
        u = lax.bitcast_convert_type(x, jnp.uint64)
        return (u & 0xFFFFFFFF).astype(jnp.uint32) ^ _fmix((u >> 32).astype(jnp.uint32) + jnp.uint32(1), jnp)
    return lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[size]).astype(jnp.uint32)


def _bits_np(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x)
    if x.dtype == np.bool_:
        return x.astype(np.uint32)
    size = x.dtype.itemsize
    if size == 8:
        u = x.view(np.uint64)
        return (u & 0xFFFFFFFF).astype(np.uint32) ^ _fmix((u >> 32).astype(np.uint32) + np.uint32(1), np)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[size]).astype(np.uint32)


def _key_data_np(x):
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def checksum_of(x: np.ndarray | jax.Array) -> str:
    """The checksum (16 hex digits) of an array, computed on the host (numpy)."""
    bits = _bits_np(_key_data_np(x)).reshape(-1)
    index = np.arange(bits.size, dtype=np.uint64).astype(np.uint32)  # wraps past 2**32 elements, as iota does
    with np.errstate(over="ignore"):
        return _format(_mixed_sums(bits, index, np))


@jax.jit
def _device_sums(leaves):
    out = []
    for x in leaves:
        bits = _bits_jnp(x)
        index = lax.iota(jnp.uint32, bits.size).reshape(bits.shape)
        out.append(jnp.stack(_mixed_sums(bits, index, jnp)))
    return out


def _host_value(s: jax.Array) -> np.ndarray:
    """A replicated (possibly multi-process) result on the host."""
    if s.is_fully_addressable or s.is_fully_replicated:
        return np.asarray(s.addressable_data(0))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(s, tiled=True))


def array_checksums(leaves: list[np.ndarray | jax.Array]) -> list[str]:
    """The checksum of every array in ``leaves`` (``jax.Array`` s sharded anyhow, typed PRNG keys,
    numpy arrays). Collective when some are global arrays spanning processes: every process
    calls it with the same leaves, and every one gets the same values. Arrays spanning
    processes are summed on their devices by one ``jit``; the others (numpy, and arrays one
    process holds whole) on the host."""
    device = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and
              (jax.process_count() == 1 or not x.is_fully_addressable)]
    out: list[str | None] = [None] * len(leaves)
    groups: dict = {}  # one jit per set of devices (a jit's arguments must share one)
    for i in device:
        groups.setdefault(frozenset(d.id for d in leaves[i].sharding.device_set), []).append(i)
    for members in groups.values():
        for i, sums in zip(members, _device_sums([leaves[i] for i in members])):
            out[i] = _format(_host_value(sums))
    for i, x in enumerate(leaves):
        if out[i] is None:
            out[i] = checksum_of(x)
    return out


# ----------------------------------------------------------------------------------------
# data-iterator state files


def data_digest(text: str) -> str:
    """sha256 of a data-iterator state file's text: of its JSON in canonical form (independent of
    how Grain formats the file), or of the text itself when it is not JSON."""
    with contextlib.suppress(ValueError):
        text = json.dumps(json.loads(text), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def data_checksums(state) -> dict[str, str]:
    """``{file name: checksum}`` of every process's data-iterator state file (collective);
    ``state``: this process's ``get_state()`` (a JSON-able dict, or the bytes of a legacy Grain
    iterator, which Grain writes as they are)."""
    n = jax.process_count()
    text = state.decode() if isinstance(state, bytes | bytearray) else json.dumps(state)
    digest = np.frombuffer(bytes.fromhex(data_digest(text)), np.uint8)
    if n > 1:
        from jax.experimental import multihost_utils

        digests = np.asarray(multihost_utils.process_allgather(digest)).reshape(n, -1)
    else:
        digests = digest[None]
    return {f"process_{i}-of-{n}.json": bytes(d.astype(np.uint8)).hex() for i, d in enumerate(digests)}
