"""Sharded checkpoints (orbax): save and restore a pytree of sharded ``jax.Array``s without
gathering it on one host, onto any mesh.

Layout of a checkpoint directory (one orbax ``CheckpointManager`` root)::

    <directory>/<step>/state/...          the arrays (tensorstore; each process writes its shards)
    <directory>/<step>/_CHECKPOINT_METADATA  step metadata, incl. ours (see ``CheckpointMetadata``)

Contract:
- **Collective**: every process calls ``save_state`` / ``restore_state`` with the same arguments.
  Each process writes only the shards it holds (one replica of each); the metadata is written
  once by orbax's primary host. Nothing assumes one process holds everything. With several
  hosts the directory must be shared storage (``gs://...``, NFS): each host writes its part.
- **Atomic**: orbax writes into ``<step>.orbax-checkpoint-tmp*`` and renames it to ``<step>``
  only after every array and the metadata are on disk (on object stores without an atomic
  rename it writes a commit file last instead); a temporary directory left by a killed save is
  never listed as a step, so the previous checkpoint stays the latest usable one.
- **Any target sharding**: ``restore_state`` reads into the shardings of ``like`` (real arrays
  or ``jax.ShapeDtypeStruct``s with ``sharding=``), each device reading only its slice, so a
  checkpoint saved on a data 2 × context 4 mesh restores onto 1 × 8, replicated, or sharded.
- **Data iterator** (optional): ``save_state(..., data_iterator=it)`` also stores a Grain
  iterator's state (``it.get_state()``) under ``<step>/data/process_<i>-of-<n>.json``, one file per
  process, through Grain's orbax handler, inside the same atomic save; ``restore_data_iterator``
  sets it back (``it.set_state``).
- Only array leaves are stored; every other leaf (equinox static fields, activation functions,
  python scalars) is taken from ``like``. Typed PRNG keys are stored as their key data.
"""

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ringsplash._checks import check_positive_int
from ringsplash.distributed import config_digest

FORMAT = "ringsplash.checkpoints/1"
_ITEM = "state"
_DATA = "data"
_META_KEY = "ringsplash"


@dataclasses.dataclass(frozen=True)
class LeafInfo:
    """One stored array leaf: its key path in the state pytree, global shape and dtype."""

    path: str
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name, or the key dtype (e.g. ``key<fry>``) for typed PRNG keys
    key_impl: str | None = None  # PRNG implementation name for typed key leaves


@dataclasses.dataclass(frozen=True)
class CheckpointMetadata:
    """What a checkpoint holds, readable without loading any array (``read_metadata``)."""

    step: int
    config: Mapping[str, Any] | None  # the run's configuration (JSON-able), if one was given
    config_hash: str | None  # ``config_hash(config)``
    leaves: tuple[LeafInfo, ...]
    process_count: int  # processes that wrote it (restoring with another count is fine)
    format: str = FORMAT


def config_hash(config: Mapping[str, Any]) -> str:
    """A short stable hash of a JSON-able config (key order does not matter): ``distributed.config_digest``."""
    return config_digest(config)


# ----------------------------------------------------------------------------- leaves


def _is_array_leaf(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))


def _is_key(x) -> bool:
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _array_leaves(tree) -> list[tuple[str, Any]]:
    """``(path, leaf)`` for every array leaf of ``tree`` (ShapeDtypeStructs count as arrays)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in flat if _is_array_leaf(leaf)]


def _leaf_info(path: str, x) -> LeafInfo:
    if _is_key(x):  # the implementation is known for real keys only (not for a ShapeDtypeStruct)
        impl = str(jax.random.key_impl(x)) if isinstance(x, jax.Array) else None
        return LeafInfo(path, tuple(x.shape), str(x.dtype), impl)
    return LeafInfo(path, tuple(int(d) for d in x.shape), np.dtype(x.dtype).name)


def _savable(x, process_count: int):
    """The value orbax stores for an array leaf.

    Typed keys become their ``uint32`` key data (same sharding plus a trailing replicated axis).
    With several processes, an array held entirely by one process (a step counter made with
    ``jnp.asarray``, a host-local copy) is not a global array and orbax refuses it; every process
    holds the same value by the collective contract, so it is stored as numpy, which orbax's
    primary host writes once.
    """
    if isinstance(x, jax.Array) and _is_key(x):
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


def _restore_target(path: str, like, saved: LeafInfo):
    """The orbax restore target of one leaf: a sharded ShapeDtypeStruct or a numpy array type."""
    if isinstance(like, np.ndarray):
        return np.zeros(like.shape, like.dtype)  # restored as numpy
    sharding = getattr(like, "sharding", None)
    if sharding is None:
        raise ValueError(f"restore target leaf {path} is a ShapeDtypeStruct without a sharding: give sharding=...")
    if _is_key(like):
        impl = saved.key_impl  # same dtype as ``like`` (checked), so the same implementation
        data = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl)))
        extra = data.shape
        return jax.ShapeDtypeStruct(like.shape + extra, data.dtype,
                                    sharding=_key_data_sharding(sharding, len(like.shape), len(extra)))
    return jax.ShapeDtypeStruct(like.shape, like.dtype, sharding=sharding)


def _check_compatible(saved: tuple[LeafInfo, ...], target: list[LeafInfo], directory: str, step: int) -> None:
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


# ----------------------------------------------------------------------------- manager


def _path(directory: str) -> epath.Path:
    """Local paths made absolute; URLs (``gs://...``) kept as they are."""
    return epath.Path(directory if "://" in str(directory) else os.path.abspath(directory))


def _manager(directory: str, *, keep: int | None = None, create: bool = False,
             data: bool = False) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=create, enable_async_checkpointing=False,
    )
    handlers = {_ITEM: ocp.StandardCheckpointHandler()}
    if data:  # Grain's orbax handler: one JSON file of iterator state per process
        import grain.checkpoint

        handlers[_DATA] = grain.checkpoint.CheckpointHandler()
    return ocp.CheckpointManager(_path(directory), options=options, item_names=tuple(handlers),
                                 item_handlers=handlers)


def all_steps(directory: str) -> list[int]:
    """The finalised (complete) checkpoint steps under ``directory``, ascending; ``[]`` if none.
    Temporary directories of unfinished saves are not steps."""
    # Read from the directory listing, not through a CheckpointManager: creating one is a
    # collective (it syncs every process), and this is called by each process on its own.
    # Orbax renames a save's temporary directory to the bare step number only once complete.
    root = _path(directory)
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir() if p.is_dir() and p.name.isdigit())


def latest_step(directory: str) -> int | None:
    """The newest finalised checkpoint step under ``directory`` (``None`` if there is none)."""
    steps = all_steps(directory)
    return steps[-1] if steps else None


def _resolve_step(directory: str, step: int | None) -> int:
    steps = all_steps(directory)
    if not steps:
        raise FileNotFoundError(f"no finalised checkpoint under {directory!r}")
    if step is None:
        return steps[-1]
    if step not in steps:
        raise FileNotFoundError(f"no checkpoint for step={step} under {directory!r}; saved steps: {steps}")
    return step


def _step_of(state, step: int | None) -> int:
    if step is None:
        if not hasattr(state, "step"):
            raise ValueError("step=None needs a state with a .step field (e.g. TrainState); pass step=...")
        step = int(np.asarray(jax.device_get(state.step)))
    return int(step)


# ----------------------------------------------------------------------------- public API


def save_state(
    directory: str,
    state,
    *,
    step: int | None = None,
    config: Mapping[str, Any] | None = None,
    keep: int | None = None,
    data_iterator=None,
) -> int:
    """Save the array leaves of ``state`` as checkpoint ``step`` under ``directory``. Collective.

    Args:
        directory: checkpoint root (created if missing); each step is a subdirectory.
        state: any pytree (e.g. ``train.TrainState``); array leaves may be sharded over any mesh
            and may span processes. Non-array leaves are not stored.
        step: the step number; ``None`` reads ``state.step``.
        config: JSON-able run configuration stored in the metadata with its ``config_hash``.
        keep: keep only the newest ``keep`` checkpoints (older ones are deleted after this save
            is finalised); ``None`` keeps all.
        data_iterator: a Grain ``DatasetIterator`` (anything with ``get_state()`` giving a JSON-able
            dict) whose state is stored too, one file per process (``restore_data_iterator``).

    Returns:
        The step saved. Raises ``FileExistsError`` if that step is already saved.
    """
    step = _step_of(state, step)
    if step < 0:
        raise ValueError(f"step must be >= 0, got step={step}")
    if keep is not None:
        keep = check_positive_int("keep", keep)
    if config is not None:
        json.dumps(config)  # fail here, before any write, if the config is not JSON-able
    leaves = _array_leaves(state)
    process_count = jax.process_count()
    meta = CheckpointMetadata(
        step=step, config=None if config is None else dict(config),
        config_hash=None if config is None else config_hash(config),
        leaves=tuple(_leaf_info(p, x) for p, x in leaves), process_count=process_count,
    )
    items = {f"{i:05d}": _savable(x, process_count) for i, (_, x) in enumerate(leaves)}
    args = {_ITEM: ocp.args.StandardSave(items)}
    if data_iterator is not None:
        import grain.checkpoint

        args[_DATA] = grain.checkpoint.CheckpointSave(data_iterator)
    with _manager(directory, keep=keep, create=True, data=data_iterator is not None) as mngr:
        if step in mngr.all_steps():
            raise FileExistsError(f"checkpoint step={step} already exists under {directory!r}")
        # force: the steps are ours to choose (orbax would skip a step below its latest one)
        mngr.save(step, args=ocp.args.Composite(**args),
                  custom_metadata={_META_KEY: dataclasses.asdict(meta)}, force=True)
        mngr.wait_until_finished()
    return step


def read_metadata(directory: str, step: int | None = None) -> CheckpointMetadata:
    """The metadata of checkpoint ``step`` (default: the latest), without reading any array."""
    step = _resolve_step(directory, step)
    with _manager(directory) as mngr:
        custom = mngr.metadata(step).custom_metadata or {}
    if _META_KEY not in custom:
        raise ValueError(f"checkpoint {directory!r} step {step} was not written by ringsplash.checkpoints")
    raw = dict(custom[_META_KEY])
    leaves = tuple(LeafInfo(d["path"], tuple(d["shape"]), d["dtype"], d.get("key_impl")) for d in raw.pop("leaves"))
    return CheckpointMetadata(**raw, leaves=leaves)


def restore_state(directory: str, like, *, step: int | None = None, config: Mapping[str, Any] | None = None):
    """Restore checkpoint ``step`` (default: the latest) into the structure and shardings of ``like``.
    Collective.

    Args:
        directory: checkpoint root given to ``save_state``.
        like: a pytree of the same structure as the saved state whose array leaves are
            ``jax.Array``s (their shardings are the targets; their values are ignored) or
            ``jax.ShapeDtypeStruct``s with ``sharding=``; numpy leaves are restored as numpy.
            The target mesh may differ from the one the checkpoint was written on.
        step: which checkpoint; ``None`` for the latest finalised one.
        config: if given, it must hash like the config stored at save time.

    Returns:
        ``like`` with every array leaf replaced by the stored value, in the target sharding.
    """
    step = _resolve_step(directory, step)
    meta = read_metadata(directory, step)
    if config is not None and meta.config_hash != config_hash(config):
        saved = meta.config or {}
        differ = sorted(k for k in set(saved) | set(config) if saved.get(k) != config.get(k))
        raise ValueError(f"checkpoint {directory!r} step {step} was written with config hash {meta.config_hash}, "
                         f"the given config hashes to {config_hash(config)} (differing keys: {differ})")
    leaves = _array_leaves(like)
    _check_compatible(meta.leaves, [_leaf_info(p, x) for p, x in leaves], directory, step)
    targets = {f"{i:05d}": _restore_target(p, x, s) for i, ((p, x), s) in enumerate(zip(leaves, meta.leaves))}
    with _manager(directory) as mngr:
        restored = mngr.restore(step, args=ocp.args.Composite(**{_ITEM: ocp.args.StandardRestore(targets)}))[_ITEM]
    values = []
    for i, ((_, x), s) in enumerate(zip(leaves, meta.leaves)):
        value = restored[f"{i:05d}"]
        if _is_key(x):
            value = jax.random.wrap_key_data(value, impl=s.key_impl)
        values.append(value)
    return _replace_array_leaves(like, values)


def data_state_file(directory: str, step: int) -> epath.Path:
    """This process's data-iterator state file in checkpoint ``step`` (it may not exist)."""
    return _path(directory) / str(step) / _DATA / f"process_{jax.process_index()}-of-{jax.process_count()}.json"


def restore_data_iterator(directory: str, step: int, iterator) -> bool:
    """Set ``iterator`` (``set_state``) to the data-iterator state this process saved with checkpoint
    ``step``; ``False`` (iterator untouched) when the checkpoint holds none for this process (saved
    without one, or by another number of processes). Collective."""
    step = _resolve_step(directory, step)
    has = data_state_file(directory, step).exists()
    if jax.process_count() > 1:  # every process takes the same branch (the restore is collective)
        from jax.experimental import multihost_utils

        has = bool(np.all(multihost_utils.process_allgather(np.asarray(has))))
    if not has:
        return False
    import grain.checkpoint

    with _manager(directory, data=True) as mngr:
        mngr.restore(step, args=ocp.args.Composite(**{_DATA: grain.checkpoint.CheckpointRestore(iterator)}))
    return True


def _replace_array_leaves(tree, values: list):
    flat, treedef = jax.tree_util.tree_flatten(tree, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    it = iter(values)
    out = [next(it) if _is_array_leaf(leaf) else leaf for leaf in flat]
    return jax.tree_util.tree_unflatten(treedef, out)
