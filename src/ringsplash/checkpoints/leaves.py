"""How a state pytree's array leaves become the items a checkpoint stores, and back
(``ringsplash.checkpoints`` saves and restores through these).

A leaf is stored under its index in flattening order (``ShapeDtypeStruct``s count as arrays);
``LeafInfo`` records its key path, global shape and dtype, so a restore target can be checked
against the checkpoint before anything is read. Typed PRNG keys are stored as their ``uint32``
key data, restored into the keys' sharding with the key-data axes replicated, and wrapped again.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
    "LeafInfo", "array_leaves", "check_compatible", "is_key", "key_data_struct", "leaf_info",
    "replace_array_leaves", "restore_target", "savable",
]


@dataclasses.dataclass(frozen=True)
class LeafInfo:
    """One stored array leaf: its key path in the state pytree, global shape and dtype."""

    path: str
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name, or the key dtype (e.g. ``key<fry>``) for typed PRNG keys
    key_impl: str | None = None  # PRNG implementation name for typed key leaves
    checksum: str | None = None  # ``ringsplash.checkpoints.checksums`` of the saved value (None: not recorded)


def _is_struct(x) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def _is_array_leaf(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))


def is_key(x) -> bool:
    """Whether array leaf ``x`` holds typed PRNG keys."""
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def key_data_struct(impl: str) -> jax.ShapeDtypeStruct:
    """Shape (the trailing axes of one key) and dtype of a key's data under PRNG ``impl``."""
    return jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl)))


def array_leaves(tree) -> list[tuple[str, Any]]:
    """``(path, leaf)`` for every array leaf of ``tree`` (ShapeDtypeStructs count as arrays)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_struct)
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in flat if _is_array_leaf(leaf)]


def replace_array_leaves(tree, values: list):
    """``tree`` with its array leaves (in ``array_leaves`` order) replaced by ``values``."""
    flat, treedef = jax.tree_util.tree_flatten(tree, is_leaf=_is_struct)
    it = iter(values)
    out = [next(it) if _is_array_leaf(leaf) else leaf for leaf in flat]
    return jax.tree_util.tree_unflatten(treedef, out)


def leaf_info(path: str, x) -> LeafInfo:
    """The record of array leaf ``x`` at ``path`` (no checksum)."""
    if is_key(x):  # the implementation is known for real keys only (not for a ShapeDtypeStruct)
        impl = str(jax.random.key_impl(x)) if isinstance(x, jax.Array) else None
        return LeafInfo(path, tuple(x.shape), str(x.dtype), impl)
    return LeafInfo(path, tuple(int(d) for d in x.shape), np.dtype(x.dtype).name)


def savable(x, process_count: int):
    """The value orbax stores for an array leaf.

    Typed keys become their ``uint32`` key data (same sharding plus a trailing replicated axis).
    With several processes, an array held entirely by one process (a step counter made with
    ``jnp.asarray``, a host-local copy) is not a global array and orbax refuses it; every process
    holds the same value by the collective contract, so it is stored as numpy, which orbax's
    primary host writes once.
    """
    if isinstance(x, jax.Array) and is_key(x):
        x = jax.random.key_data(x)
    if isinstance(x, jax.Array) and process_count > 1 and x.is_fully_addressable:
        x = np.asarray(x)
    return x


def _key_data_sharding(sharding, ndim: int, extra: int):
    """The sharding of a key array's key data: that of the keys, trailing axes replicated."""
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec) + extra)
        return NamedSharding(sharding.mesh, P(*spec), memory_kind=sharding.memory_kind)
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return sharding
    raise TypeError(f"a typed PRNG key leaf needs a NamedSharding or SingleDeviceSharding target, got {sharding}")


def restore_target(path: str, like, saved: LeafInfo):
    """The orbax restore target of one leaf: a sharded ShapeDtypeStruct or a numpy array type."""
    if isinstance(like, np.ndarray):
        return np.zeros(like.shape, like.dtype)  # restored as numpy
    sharding = getattr(like, "sharding", None)
    if sharding is None:
        raise ValueError(f"restore target leaf {path} is a ShapeDtypeStruct without a sharding: give sharding=...")
    if is_key(like):
        data = key_data_struct(saved.key_impl)  # same dtype as ``like`` (checked), so the same implementation
        extra = data.shape
        return jax.ShapeDtypeStruct(like.shape + extra, data.dtype,
                                    sharding=_key_data_sharding(sharding, len(like.shape), len(extra)))
    return jax.ShapeDtypeStruct(like.shape, like.dtype, sharding=sharding)


def check_compatible(saved: tuple[LeafInfo, ...], target: list[LeafInfo], directory: str, step: int) -> None:
    """Raise naming the first leaf whose path, shape or dtype differs (or that one side lacks)."""
    where = f"checkpoint {directory} step {step}"
    for i, (s, t) in enumerate(zip(saved, target)):
        if s.path != t.path:
            raise ValueError(f"{where}: leaf #{i} is {s.path} with shape {s.shape} in the checkpoint but "
                             f"{t.path} with shape {t.shape} in the restore target (different structure)")
        if s.shape != t.shape:
            raise ValueError(f"{where}: leaf {s.path} has shape {s.shape} in the checkpoint but {t.shape} "
                             f"in the restore target")
        if s.dtype != t.dtype:
            raise ValueError(f"{where}: leaf {s.path} has dtype {s.dtype} in the checkpoint but {t.dtype} "
                             f"in the restore target")
    if len(saved) != len(target):
        n = min(len(saved), len(target))
        extra, side = (saved[n], "only the checkpoint") if len(saved) > n else (target[n], "only the restore target")
        raise ValueError(f"{where}: {len(saved)} array leaves in the checkpoint, {len(target)} in the restore "
                         f"target; the first unmatched leaf {extra.path} with shape {extra.shape} is in {side}")
