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
  iterator's state under ``<step>/data/process_<i>-of-<n>.json`` in the same atomic save, its
  checksum in the metadata; ``restore_data_iterator`` sets it back (``it.set_state``).
- Only array leaves are stored; every other leaf (static fields, functions, python scalars) is taken
  from ``like``; typed PRNG keys are stored as their key data (``checkpoints.leaves``).
- **Verified**: the metadata records a checksum of every array (``checkpoints.checksums``: the same
  on any mesh); ``restore_state`` recomputes it and refuses a mismatch with a
  ``CheckpointCorruptError`` naming the checkpoint and the array; unreadable files (truncated,
  a missing process directory) and a damaged data-iterator file raise the same error.
  ``restore_newest_valid`` walks back to the newest checkpoint that verifies, saying which it
  skipped and why; ``python -m ringsplash.checkpoints verify RUN_DIR`` checks a run's checkpoints.
- **A full disk** fails a save with one ``OSError`` (``ENOSPC``) naming the step, the directory and
  the newest checkpoint left; the partial save is removed and earlier checkpoints are untouched.
"""

import dataclasses
import errno
import json
import os
import shutil
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from ringsplash._internal.scalar_checks import check_positive_int
from ringsplash.checkpoints.checksums import array_checksums, data_checksums, data_digest
from ringsplash.checkpoints.full_disk import held_logs, join_writers, no_space
from ringsplash.checkpoints.leaves import (
    LeafInfo,
    array_leaves,
    check_compatible,
    is_key,
    key_data_struct,
    leaf_info,
    replace_array_leaves,
    restore_target,
    savable,
)
from ringsplash.checkpoints.metadata import CheckpointCorruptError, CheckpointMetadata, config_hash

_ITEM = "state"
_DATA = "data"
_META_KEY = "ringsplash"


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


def _has_data(directory: str, step: int) -> bool:
    """Whether checkpoint ``step`` holds a data-iterator state: readers then register Grain's
    handler for it too (without it orbax warns, per read, that the item "could not be restored")."""
    return (_path(directory) / str(step) / _DATA).exists()


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
    leaves = array_leaves(state)
    process_count = jax.process_count()
    sums = array_checksums([x for _, x in leaves])  # collective: every process gets the same values
    meta = CheckpointMetadata(
        step=step, config=None if config is None else dict(config),
        config_hash=None if config is None else config_hash(config),
        leaves=tuple(dataclasses.replace(leaf_info(p, x), checksum=c) for (p, x), c in zip(leaves, sums)),
        process_count=process_count,
    )
    items = {f"{i:05d}": savable(x, process_count) for i, (_, x) in enumerate(leaves)}
    args = {_ITEM: ocp.args.StandardSave(items)}
    if data_iterator is not None:
        import grain.checkpoint

        args[_DATA] = grain.checkpoint.CheckpointSave(data_iterator)
        meta = dataclasses.replace(meta, data_checksums=data_checksums(data_iterator.get_state()))
    if step in all_steps(directory):
        raise FileExistsError(f"checkpoint step={step} already exists under {directory!r}")
    with held_logs() as held:
        try:
            with _manager(directory, keep=keep, create=True, data=data_iterator is not None) as mngr:
                # force: the steps are ours to choose (orbax would skip a step below its latest one)
                mngr.save(step, args=ocp.args.Composite(**args),
                          custom_metadata={_META_KEY: dataclasses.asdict(meta)}, force=True)
                mngr.wait_until_finished()
        except Exception as err:
            reason = no_space(err)
            if reason is None:
                raise
            join_writers()  # orbax's other writer threads fail too: let them end while their logs are held
            held.clear()  # orbax's tracebacks of each writer thread: the one line below says it
            if process_count == 1:  # the partial save, out of the way (it holds the space)
                for tmp in _path(directory).glob(f"{step}.orbax-checkpoint-tmp*"):
                    shutil.rmtree(tmp, ignore_errors=True)
            latest = latest_step(directory)
            raise OSError(errno.ENOSPC, f"checkpoint step {step} was not saved under {directory!r}: no space left "
                          f"on device ({reason}); the newest checkpoint is "
                          + (f"step {latest}" if latest is not None else "none")
                          + "; free space (or keep fewer checkpoints) and resume") from None
    return step


def _where(directory: str, step: int) -> str:
    return f"checkpoint {os.path.join(str(directory), str(step))!r}"


def _unreadable(directory: str, step: int, what: str, err: BaseException) -> CheckpointCorruptError:
    root = err  # the innermost error says what is wrong (orbax wraps tensorstore's)
    while (root.__cause__ or root.__context__) is not None:
        root = root.__cause__ or root.__context__
    first = (str(root).strip().splitlines() or [""])[0][:300]
    return CheckpointCorruptError(f"{_where(directory, step)}: its {what} cannot be read ({type(root).__name__}: "
                                  f"{first}); the files are truncated, missing or corrupt")


def _agree(error: CheckpointCorruptError | None, directory: str, step: int, what: str) -> None:
    """Raise on every process when any process could not read its part (so all of them fall back
    together, and none waits alone in a later collective); no-op with one process."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        failed = np.asarray(multihost_utils.process_allgather(np.int32(error is not None)))
        if failed.any() and error is None:
            error = CheckpointCorruptError(f"{_where(directory, step)}: processes {np.flatnonzero(failed).tolist()} "
                                           f"cannot read its {what}")
    if error is not None:
        raise error


def read_metadata(directory: str, step: int | None = None) -> CheckpointMetadata:
    """The metadata of checkpoint ``step`` (default: the latest), without reading any array.
    Raises ``CheckpointCorruptError`` when it cannot be read."""
    step = _resolve_step(directory, step)
    try:
        with _manager(directory, data=_has_data(directory, step)) as mngr:
            custom = mngr.metadata(step).custom_metadata or {}
        if _META_KEY in custom:
            raw = dict(custom[_META_KEY])
            leaves = tuple(LeafInfo(d["path"], tuple(d["shape"]), d["dtype"], d.get("key_impl"), d.get("checksum"))
                           for d in raw.pop("leaves"))
            return CheckpointMetadata(**raw, leaves=leaves)
    except Exception as err:  # any failure to read is reported as a corrupt checkpoint
        raise _unreadable(directory, step, "metadata (_CHECKPOINT_METADATA, state/_METADATA)", err) from err
    raise CheckpointCorruptError(
        f"{_where(directory, step)} holds no ringsplash metadata (_CHECKPOINT_METADATA is missing, empty or "
        f"truncated, or the checkpoint was not written by ringsplash.checkpoints)")


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
    meta, error = None, None
    try:
        meta = read_metadata(directory, step)
    except CheckpointCorruptError as err:
        error = err
    _agree(error, directory, step, "metadata")
    if config is not None and meta.config_hash != config_hash(config):
        saved = meta.config or {}
        differ = sorted(k for k in set(saved) | set(config) if saved.get(k) != config.get(k))
        raise ValueError(f"checkpoint {directory!r} step {step} was written with config hash {meta.config_hash}, "
                         f"the given config hashes to {config_hash(config)} (differing keys: {differ})")
    error = None
    try:
        _verify_data(directory, step, meta)
    except CheckpointCorruptError as err:
        error = err
    _agree(error, directory, step, "data-iterator state")
    leaves = array_leaves(like)
    check_compatible(meta.leaves, [leaf_info(p, x) for p, x in leaves], directory, step)
    targets = {f"{i:05d}": restore_target(p, x, s) for i, ((p, x), s) in enumerate(zip(leaves, meta.leaves))}
    raw, error = None, None
    try:
        raw = _read_arrays(directory, step, targets)
    except CheckpointCorruptError as err:
        error = err
    _agree(error, directory, step, "array data")
    _verify(directory, step, meta.leaves, raw)
    values = []
    for value, (_, x), s in zip(raw, leaves, meta.leaves):
        if is_key(x):
            value = jax.random.wrap_key_data(value, impl=s.key_impl)
        values.append(value)
    return replace_array_leaves(like, values)


def data_state_file(directory: str, step: int) -> epath.Path:
    """This process's data-iterator state file in checkpoint ``step`` (it may not exist)."""
    return _path(directory) / str(step) / _DATA / f"process_{jax.process_index()}-of-{jax.process_count()}.json"


def restore_data_iterator(directory: str, step: int, iterator) -> bool:
    """Set ``iterator`` (``set_state``) to the data-iterator state this process saved with checkpoint
    ``step``; ``False`` (iterator untouched) when the checkpoint holds none for this process (saved
    without one, or by another number of processes). Collective. Raises ``CheckpointCorruptError``
    when the file is missing, unreadable or not the state saved (its recorded checksum)."""
    step = _resolve_step(directory, step)
    file = data_state_file(directory, step)
    error = None
    try:  # the file this process reads, against the checksum recorded for it
        meta = read_metadata(directory, step)
        recorded = meta.data_checksums or {}
        if file.name in recorded:
            _verify_data(directory, step, dataclasses.replace(meta, data_checksums={file.name: recorded[file.name]}))
    except CheckpointCorruptError as err:
        error = err
    _agree(error, directory, step, "data-iterator state")
    has = file.exists()
    if jax.process_count() > 1:  # every process takes the same branch (the restore is collective)
        from jax.experimental import multihost_utils

        has = bool(np.all(multihost_utils.process_allgather(np.asarray(has))))
    if not has:
        return False
    import grain.checkpoint

    with _manager(directory, data=True) as mngr:
        mngr.restore(step, args=ocp.args.Composite(**{_DATA: grain.checkpoint.CheckpointRestore(iterator)}))
    return True


def _read_arrays(directory: str, step: int, targets: dict) -> list:
    """The stored arrays of ``step`` read into ``targets`` (in leaf order); files that cannot be
    read raise ``CheckpointCorruptError`` instead of orbax's / tensorstore's error."""
    try:
        with _manager(directory, data=_has_data(directory, step)) as mngr:
            restored = mngr.restore(step, args=ocp.args.Composite(**{_ITEM: ocp.args.StandardRestore(targets)}))
        restored = restored[_ITEM]
    except Exception as err:  # orbax / tensorstore errors of truncated or missing files
        raise _unreadable(directory, step, "array data (state/)", err) from err
    return [restored[f"{i:05d}"] for i in range(len(targets))]


def _verify(directory: str, step: int, saved: tuple[LeafInfo, ...], values: list) -> None:
    """Raise naming the first array whose checksum differs from the recorded one (collective)."""
    got = array_checksums(values)
    for info, value in zip(saved, got):
        if info.checksum is not None and info.checksum != value:
            raise CheckpointCorruptError(
                f"{_where(directory, step)}: array {info.path} (shape {info.shape}, {info.dtype}) reads back with "
                f"checksum {value}, but its metadata records {info.checksum}: the data files are corrupt")


def _verify_data(directory: str, step: int, meta: CheckpointMetadata) -> None:
    """Raise naming the first data-iterator state file that is missing, unreadable or whose
    checksum differs from the recorded one; a no-op when none is recorded."""
    for name, want in sorted((meta.data_checksums or {}).items()):
        what = f"data-iterator state ({_DATA}/{name})"
        try:
            text = (_path(directory) / str(step) / _DATA / name).read_text()
        except Exception as err:  # missing, unreadable
            raise _unreadable(directory, step, what, err) from err
        got = data_digest(text)
        if got != want:
            shown = " ".join(text.split())[:200]
            raise CheckpointCorruptError(
                f"{_where(directory, step)}: its {what} reads back as {shown!r} with checksum "
                f"{got[:16]}, but its metadata records {want[:16]}: the file is corrupt")


def restore_newest_valid(directory: str, like, *, config: Mapping[str, Any] | None = None):
    """``(state, step, skipped)``: the newest checkpoint under ``directory`` that reads and verifies
    (``restore_state``), after warning about each newer one skipped (``skipped``: ``[(step,
    reason)]``, newest first). Collective. Other errors (a config or structure that does not
    match) are raised at once: they are not a damaged checkpoint.

    Raises:
        FileNotFoundError: when there is no finalised checkpoint at all.
        CheckpointCorruptError: when none verifies; it names each checkpoint and what is wrong.
    """
    steps = all_steps(directory)
    if not steps:
        raise FileNotFoundError(f"no finalised checkpoint under {directory!r}")
    skipped = []
    for step in reversed(steps):
        try:
            return restore_state(directory, like, step=step, config=config), step, skipped
        except CheckpointCorruptError as err:
            skipped.append((step, str(err)))
            warnings.warn(f"skipping checkpoint step {step}: {err}", RuntimeWarning, stacklevel=2)
    raise CheckpointCorruptError(
        f"no checkpoint under {directory!r} reads back intact, so the run cannot resume (delete the directory, "
        f"or pass resume=False, to start over): " + "; ".join(reason for _, reason in skipped))


def set_aside(directory: str, step: int) -> str:
    """Rename checkpoint ``step`` to ``<step>.corrupt`` (``.corrupt-1``, ... if taken) so that it is
    no longer a step (a resumed run writes that step again); returns the new path. Call it on one
    process."""
    root = _path(directory)
    target = root / f"{step}.corrupt"
    n = 0
    while target.exists():
        n += 1
        target = root / f"{step}.corrupt-{n}"
    (root / str(step)).rename(target)
    return str(target)


# ----------------------------------------------------------------------------- verification without a target


def verify(directory: str, step: int) -> str | None:
    """None if checkpoint ``step`` under ``directory`` reads back and matches its recorded checksums,
    else what is wrong. Reads every array whole on this host (numpy), with no target state: a
    check of the files, for one process."""
    try:
        meta = read_metadata(directory, step)
        targets = {}
        for i, s in enumerate(meta.leaves):
            shape, dtype = s.shape, s.dtype
            if s.key_impl is not None:  # stored as key data
                data = key_data_struct(s.key_impl)
                shape, dtype = s.shape + data.shape, data.dtype
            targets[f"{i:05d}"] = np.zeros(shape, dtype)
        _verify(directory, step, meta.leaves, _read_arrays(directory, step, targets))
        _verify_data(directory, step, meta)
        if any(s.checksum is None for s in meta.leaves):
            return "readable, but its metadata records no checksums (written before they were recorded)"
        if meta.data_checksums is None and (_path(directory) / str(step) / _DATA).exists():
            return ("readable, but its metadata records no checksums of its data-iterator state (written "
                    "before they were recorded)")
    except CheckpointCorruptError as err:
        return str(err)
    return None
