"""Checkpoint integrity: every array's checksum is recorded at save and checked at restore; a
damaged checkpoint (flipped bytes in a data file, a truncated data or metadata file, a deleted
process directory) is refused with a message naming it, a resumed ``fit`` falls back to the
previous good checkpoint and ends with the uninterrupted run's state, and with no good
checkpoint left the error names what is wrong. ``python -m ringsplash.checkpoints verify``
checks a run's checkpoints without resuming."""

import errno
import logging
import os
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ringsplash import checkpoints, train
from ringsplash.checkpoints.checksums import array_checksums, checksum_of
from support.training import setup as _setup


def _data_file(step_dir) -> str:
    """The largest array data file of a (one-process) checkpoint step."""
    d = os.path.join(step_dir, "state", "ocdbt.process_0", "d")
    return max((os.path.join(d, f) for f in os.listdir(d)), key=os.path.getsize)


def _flip(path, n=64):
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        mid = len(data) // 2
        for i in range(mid, mid + n):
            data[i] ^= 0xFF
        f.seek(0)
        f.write(bytes(data))


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


CORRUPTIONS = {
    "flipped data bytes": lambda step_dir: _flip(_data_file(step_dir)),
    "truncated data file": lambda step_dir: _truncate(_data_file(step_dir)),
    "truncated metadata": lambda step_dir: _truncate(os.path.join(step_dir, "_CHECKPOINT_METADATA")),
    "truncated array metadata": lambda step_dir: _truncate(os.path.join(step_dir, "state", "_METADATA")),
    "deleted process directory": lambda step_dir: shutil.rmtree(os.path.join(step_dir, "state", "ocdbt.process_0")),
}


def test_checksums_do_not_depend_on_sharding_and_see_one_bit():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    x = jax.random.normal(jax.random.key(0), (16, 24))
    mesh = train.make_mesh(2, 4)
    sharded = jax.device_put(x, NamedSharding(mesh, P("context", "data")))
    keys = jax.random.split(jax.random.key(1), 8)
    got = array_checksums([x, sharded, keys, x.astype(jnp.bfloat16), np.asarray(x)])
    assert got[0] == got[1] == got[4] == checksum_of(np.asarray(x))
    assert got[2] == checksum_of(keys) and got[3] == checksum_of(np.asarray(x.astype(jnp.bfloat16)))
    y = np.asarray(x).copy()
    y.view(np.uint32)[3, 4] ^= 1  # one bit
    assert checksum_of(y) != got[0]
    assert checksum_of(np.asarray(x).T.copy().T) == got[0]  # memory order does not matter
    assert checksum_of(np.roll(np.asarray(x), 1)) != got[0]  # position does


@pytest.fixture
def saved(tmp_path):
    state = {"w": jax.random.normal(jax.random.key(0), (64, 64)), "b": jnp.ones(3), "key": jax.random.key(2)}
    root = str(tmp_path / "ckpt")
    for step in (1, 2):
        checkpoints.save_state(root, {**state, "w": state["w"] * step}, step=step)
    return root, state


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_damaged_checkpoint_is_refused_and_the_previous_one_restored(saved, corruption):
    root, state = saved
    CORRUPTIONS[corruption](os.path.join(root, "2"))
    with pytest.raises(checkpoints.CheckpointCorruptError, match=rf"checkpoint '{root}/2'") as err:
        checkpoints.restore_state(root, state)
    if corruption == "flipped data bytes":  # read back without an error from the files: the checksum names it
        assert "array ['w']" in str(err.value) and "metadata records" in str(err.value)
    assert checkpoints.verify(root, 2) is not None and checkpoints.verify(root, 1) is None
    with pytest.warns(RuntimeWarning, match="skipping checkpoint step 2"):
        restored, step, skipped = checkpoints.restore_newest_valid(root, state)
    assert step == 1 and [s for s, _ in skipped] == [2]
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(state["w"]))


def test_no_good_checkpoint_left_names_each(saved):
    root, state = saved
    _flip(_data_file(os.path.join(root, "2")))
    shutil.rmtree(os.path.join(root, "1", "state", "ocdbt.process_0"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(checkpoints.CheckpointCorruptError,
                           match=r"no checkpoint under .* reads back intact.*/2'.*array \['w'\].*/1'.*cannot be read"):
            checkpoints.restore_newest_valid(root, state)


def test_verify_command_reports_each_checkpoint(saved, capsys):
    root, _ = saved
    assert checkpoints.main(["verify", root]) == 0
    assert "step 1: ok" in capsys.readouterr().out
    _flip(_data_file(os.path.join(root, "2")))
    assert checkpoints.main(["verify", root]) == 1
    out = capsys.readouterr().out
    assert "step 1: ok" in out and "step 2: checkpoint" in out and "array ['w']" in out
    assert "1 of 2 checkpoints verify; a resumed run starts from step 1" in out


# ----------------------------------------------------------------------------- resumed fit


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A tiny run trained to its end (6 steps, checkpoints every 2), and a copy of it that lost its
    last checkpoint (checkpoints 2 and 4: a run interrupted after step 4), which each case
    copies, damages and resumes."""
    root = tmp_path_factory.mktemp("integrity")
    config, tc, stream = _setup(steps=6)
    tc = tc.__class__(**{**tc.__dict__, "checkpoint_every": 2})
    full = train.fit(config, tc, stream, str(root / "full"))
    shutil.copytree(root / "full", root / "cut")
    shutil.rmtree(root / "cut" / "checkpoints" / "6")
    assert checkpoints.all_steps(str(root / "cut" / "checkpoints")) == [2, 4]
    return root, (config, tc, stream), train.state_digest(full)


@pytest.mark.slow  # each case trains 4 steps of a tiny model (~3 s)
@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_resume_falls_back_to_the_previous_good_checkpoint(runs, tmp_path, corruption):
    root, (config, tc, stream), want = runs
    run = tmp_path / "run"
    shutil.copytree(root / "cut", run)
    ckpt = str(run / "checkpoints")
    CORRUPTIONS[corruption](os.path.join(ckpt, "4"))
    with pytest.warns(RuntimeWarning, match=r"skipping checkpoint step 4: checkpoint '.*/4'"):
        state = train.fit(config, tc, stream, str(run))
    assert int(state.step) == 6 and train.state_digest(state) == want
    assert checkpoints.all_steps(ckpt) == [2, 4, 6] and os.path.isdir(os.path.join(ckpt, "4.corrupt"))
    assert all(checkpoints.verify(ckpt, s) is None for s in (2, 4, 6))


@pytest.mark.slow
def test_resume_with_no_good_checkpoint_is_an_error_not_a_fresh_start(runs, tmp_path):
    root, (config, tc, stream), _ = runs
    run = tmp_path / "run"
    shutil.copytree(root / "cut", run)
    ckpt = str(run / "checkpoints")
    CORRUPTIONS["truncated data file"](os.path.join(ckpt, "4"))
    CORRUPTIONS["flipped data bytes"](os.path.join(ckpt, "2"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(checkpoints.CheckpointCorruptError, match=r"no checkpoint .* reads back intact.*/4'.*/2'"):
            train.fit(config, tc, stream, str(run))
    assert checkpoints.all_steps(ckpt) == [2, 4]  # nothing written, nothing moved


# ----------------------------------------------------------------------------- the data-iterator state


def _iterator(at: int):
    """A Grain iterator standing at element ``at`` (its state: ``{"next_index": at}``)."""
    import grain

    it = iter(grain.MapDataset.range(100).to_iter_dataset())
    for _ in range(at):
        next(it)
    return it


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


DATA_DAMAGE = {
    "edited": lambda file: _write(file, '{"next_index": 7}'),
    "truncated": _truncate,
    "deleted": os.remove,
}


@pytest.mark.parametrize("damage", DATA_DAMAGE)
def test_damaged_data_iterator_state_is_refused_verified_and_skipped(tmp_path, damage):
    """The metadata records a checksum of each data-iterator state file: a damaged one fails
    ``restore_state`` (so ``restore_newest_valid`` falls back), ``verify`` and the verify command,
    and ``restore_data_iterator`` refuses it."""
    root = str(tmp_path / "ckpt")
    state = {"w": jnp.arange(4.0)}
    for step in (1, 2):
        checkpoints.save_state(root, state, step=step, data_iterator=_iterator(step))
    assert set(checkpoints.read_metadata(root, 2).data_checksums) == {"process_0-of-1.json"}
    assert checkpoints.verify(root, 2) is None
    DATA_DAMAGE[damage](os.path.join(root, "2", "data", "process_0-of-1.json"))
    message = r"checkpoint '.*/2'.*data-iterator state \(data/process_0-of-1.json\)"
    with pytest.raises(checkpoints.CheckpointCorruptError, match=message):
        checkpoints.restore_state(root, state, step=2)
    assert "data-iterator state" in checkpoints.verify(root, 2) and checkpoints.verify(root, 1) is None
    with pytest.raises(checkpoints.CheckpointCorruptError, match=message):
        checkpoints.restore_data_iterator(root, 2, _iterator(0))
    with pytest.warns(RuntimeWarning, match="skipping checkpoint step 2"):
        _, step, _ = checkpoints.restore_newest_valid(root, state)
    assert step == 1
    it = _iterator(0)
    assert checkpoints.restore_data_iterator(root, 1, it) and next(it) == 1


def test_reading_a_checkpoint_with_a_data_iterator_state_warns_nothing(tmp_path):
    """Readers register Grain's handler when a checkpoint holds a data-iterator state: orbax used to
    warn, per read, 'Item "data" was found in the checkpoint, but could not be restored'."""
    import logging

    root = str(tmp_path / "ckpt")
    state = {"w": jnp.arange(4.0)}
    checkpoints.save_state(root, state, step=1, data_iterator=_iterator(1))
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("absl")
    logger.addHandler(handler)
    try:
        checkpoints.read_metadata(root, 1)
        checkpoints.restore_state(root, state, step=1)
        assert checkpoints.verify(root, 1) is None
    finally:
        logger.removeHandler(handler)
    assert not [m for m in seen if "could not be restored" in m], seen


def test_verify_command_catches_a_damaged_data_iterator_state(tmp_path, capsys):
    root = str(tmp_path / "ckpt")
    for step in (1, 2):
        checkpoints.save_state(root, {"w": jnp.arange(4.0)}, step=step, data_iterator=_iterator(step))
    _write(os.path.join(root, "2", "data", "process_0-of-1.json"), '{"next_index": 1}')  # JSON, wrong position
    assert checkpoints.main(["verify", root]) == 1
    out = capsys.readouterr().out
    assert "step 1: ok" in out and "step 2: checkpoint" in out and "data/process_0-of-1.json" in out
    assert "1 of 2 checkpoints verify; a resumed run starts from step 1" in out


# ----------------------------------------------------------------------------- a full disk


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _tensorstore_enospc(*args, **kwargs):  # how tensorstore reports it (a ValueError)
    raise ValueError('RESOURCE_EXHAUSTED: Error writing local file "x/_sharding": Failed to write 173 bytes to '
                     "file 23: No space left on device [os_error_code='28']")


@pytest.mark.parametrize("writer", ["data-iterator state", "arrays"])
def test_a_full_disk_fails_a_save_with_one_clear_error(tmp_path, monkeypatch, caplog, capfd, writer):
    """A save that runs out of space raises one ``OSError`` (ENOSPC) naming the step, the directory
    and the newest checkpoint left, with no chained tracebacks and no logged ones; the partial save
    is removed and the previous checkpoint still verifies."""
    import grain.checkpoint
    import orbax.checkpoint as ocp

    root = str(tmp_path / "ckpt")
    state = {"w": jnp.arange(4.0)}
    checkpoints.save_state(root, state, step=1, data_iterator=_iterator(1))
    if writer == "data-iterator state":
        monkeypatch.setattr(grain.checkpoint.CheckpointHandler, "save", _enospc)
    else:
        monkeypatch.setattr(ocp.StandardCheckpointHandler, "async_save", _tensorstore_enospc)
    capfd.readouterr()
    with pytest.raises(OSError, match=rf"checkpoint step 2 was not saved under '{root}': no space left on device "
                                      r"\(.*\); the newest checkpoint is step 1; free space") as err:
        checkpoints.save_state(root, state, step=2, data_iterator=_iterator(2))
    assert err.value.errno == errno.ENOSPC
    assert err.value.__cause__ is None and err.value.__suppress_context__  # one error, not a chain
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "Traceback" not in "".join(capfd.readouterr())
    assert sorted(os.listdir(root)) == ["1"] and checkpoints.verify(root, 1) is None


def test_other_save_errors_are_not_reported_as_a_full_disk(tmp_path, monkeypatch):
    import grain.checkpoint

    def broken(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(grain.checkpoint.CheckpointHandler, "save", broken)
    with pytest.raises(Exception, match="Permission denied") as err:
        checkpoints.save_state(str(tmp_path / "ckpt"), {"w": jnp.arange(4.0)}, step=1, data_iterator=_iterator(1))
    assert "no space left" not in str(err.value)
