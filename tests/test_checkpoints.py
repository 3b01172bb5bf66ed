"""Sharded checkpoints: bit-exact round trips in the target shardings, restore onto another mesh
shape, atomic saves (an interrupted or killed save leaves the previous checkpoint usable), keep
the last K, metadata without arrays, exact resumption of ``train.fit``, clear errors."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ringsplash import checkpoints, partitioning, train
from ringsplash.checkpoints import leaves as checkpoint_leaves
from support.training import setup as _setup

# Leaf name -> (shape, PartitionSpec on the data 2 x context 4 mesh): a different spec per leaf.
PARAMS = {
    "embed": ((16, 8), P("context", "data")),
    "w_in": ((8, 24), P(None, ("data", "context"))),
    "w_out": ((24, 8), P("context", None)),
    "bias": ((8,), P()),
    "stack": ((2, 8, 6), P(None, "context", "data")),
}


def _mesh(data, context):
    return train.make_mesh(data, context)


def _sharded_state(key, mesh, specs=None):
    """Params with per-leaf shardings, AdamW state after one update (non-zero moments), an int
    step, and typed PRNG keys (a sharded batch of keys and a replicated scalar key)."""
    specs = specs or {n: s for n, (_, s) in PARAMS.items()}
    keys = jax.random.split(key, len(PARAMS) + 2)
    params = {n: jax.device_put(jax.random.normal(k, shape), NamedSharding(mesh, specs[n]))
              for k, (n, (shape, _)) in zip(keys, PARAMS.items())}
    grads = jax.tree.map(lambda p: jnp.sin(3.0 * p) + 0.1, params)
    opt = optax.adamw(1e-2, weight_decay=0.1)
    opt_state = jax.jit(opt.init)(params)
    _, opt_state = jax.jit(opt.update)(grads, opt_state, params)
    rng = jax.device_put(jax.random.split(keys[-1], 8), NamedSharding(mesh, P("context")))
    return {"params": params, "opt_state": opt_state, "step": jnp.asarray(7, jnp.int32),
            "rng": rng, "key": jax.device_put(keys[-2], NamedSharding(mesh, P()))}


def _host(x):
    return np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)


def _assert_equal_in_sharding(restored, expected, target):
    """Bit-exact values, and every addressable shard where (and what) the target sharding says."""
    r_leaves, e_leaves, t_leaves = (jax.tree.leaves(t) for t in (restored, expected, target))
    assert len(r_leaves) == len(e_leaves) == len(t_leaves)
    for r, e, t in zip(r_leaves, e_leaves, t_leaves):
        assert r.shape == e.shape and r.dtype == e.dtype
        np.testing.assert_array_equal(_host(r), _host(e))
        assert r.sharding.is_equivalent_to(t.sharding, r.ndim), (r.sharding, t.sharding)
        want = t.sharding.addressable_devices_indices_map(t.shape)
        assert {s.device for s in r.addressable_shards} == set(want)
        for shard in r.addressable_shards:  # a key array's shard index also covers its key-data axis
            assert shard.index[: t.ndim] == want[shard.device]
            np.testing.assert_array_equal(_host(shard.data), _host(e)[shard.index])


def _abstract(tree, mesh, specs):
    """ShapeDtypeStruct targets: params sharded by ``specs`` on ``mesh``, the rest replicated."""
    def target(path, x):  # moments ``mu['embed']`` follow their parameter ``['params']['embed']``
        spec = specs.get(getattr(path[-1], "key", None), P())
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))
    return jax.tree_util.tree_map_with_path(target, tree)


@pytest.mark.slow
def test_round_trip_of_sharded_state_is_bit_exact(tmp_path, key):
    mesh = _mesh(2, 4)
    state = _sharded_state(key, mesh)
    assert checkpoints.save_state(str(tmp_path), state, step=7) == 7
    like = jax.tree.map(lambda x: x, state)  # real arrays as the target: their shardings are used
    restored = checkpoints.restore_state(str(tmp_path), like)
    _assert_equal_in_sharding(restored, state, state)
    # the moments really are sharded like their parameters (not replicated) after the round trip
    mu = restored["opt_state"][0].mu["embed"]
    assert mu.addressable_shards[0].data.shape == (4, 4)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["1x8", "replicated", "replicated->sharded"])
def test_restore_onto_another_mesh_shape_gives_identical_values(tmp_path, key, target):
    mesh24 = _mesh(2, 4)
    if target == "replicated->sharded":
        state = _sharded_state(key, mesh24, specs={n: P() for n in PARAMS})
        like = _abstract(state, mesh24, {n: s for n, (_, s) in PARAMS.items()})
    else:
        state = _sharded_state(key, mesh24)
        mesh18 = _mesh(1, 8)
        specs = ({"embed": P(None, "context"), "w_in": P("context"), "w_out": P(None, "context"),
                  "stack": P(None, "context")} if target == "1x8" else {})
        like = _abstract(state, mesh18, specs)
    checkpoints.save_state(str(tmp_path), state, step=3)
    restored = checkpoints.restore_state(str(tmp_path), like)
    _assert_equal_in_sharding(restored, state, like)


@pytest.mark.slow
def test_train_state_saved_on_2x4_restores_on_1x8(tmp_path):
    config, tc, stream = _setup(steps=3)
    state = train.init_state(config, tc, stream.seed)

    def shard(mesh, axes):  # the first axis divisible by 8 of every array split 8 ways, the rest replicated
        def put(x):
            split = [i for i, n in enumerate(x.shape) if n % 8 == 0][:1]
            spec = P(*(axes if i in split else None for i in range(x.ndim)))
            return jax.device_put(x, NamedSharding(mesh, spec))
        return jax.tree.map(lambda x: put(x) if eqx.is_array(x) else x, state)

    saved = shard(_mesh(2, 4), ("data", "context"))
    assert any(x.addressable_shards[0].data.size * 8 == x.size for x in jax.tree.leaves(saved))
    train.save_checkpoint(str(tmp_path), saved)
    like = shard(_mesh(1, 8), "context")
    restored = train.load_checkpoint(str(tmp_path), like)
    arrays = lambda t: jax.tree.leaves(eqx.filter(t, eqx.is_array))
    _assert_equal_in_sharding(arrays(restored), arrays(saved), arrays(like))
    assert restored.model.config == state.model.config  # static fields come from `like`


# Fault injection point: orbax's rename of the finished temporary directory to its step
# (there is no public hook inside a save).
_FINALIZE = "orbax.checkpoint._src.path.atomicity.AtomicRenameTemporaryPath.finalize"


def _tmp_dirs(directory):
    return [n for n in os.listdir(directory) if ".orbax-checkpoint-tmp" in n]


@pytest.mark.slow  # over the fast tier's 5 s a test on 2 cores (2026-12-07: 5.5-7.7 s)
def test_save_interrupted_before_commit_leaves_previous_checkpoint(tmp_path, key, monkeypatch):
    mesh = _mesh(2, 4)
    first = _sharded_state(key, mesh)
    second = jax.tree.map(lambda x: x if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x + 1, first)
    checkpoints.save_state(str(tmp_path), first, step=1)

    async def crash(self):
        raise RuntimeError("killed mid-save")

    with monkeypatch.context() as m:
        m.setattr(_FINALIZE, crash)
        with pytest.raises(RuntimeError, match="killed mid-save"):
            checkpoints.save_state(str(tmp_path), second, step=2)
    [tmp] = _tmp_dirs(tmp_path)  # everything was written, but not committed
    assert tmp.startswith("2.") and os.listdir(tmp_path / tmp)
    assert checkpoints.all_steps(str(tmp_path)) == [1]
    _assert_equal_in_sharding(checkpoints.restore_state(str(tmp_path), second), first, first)
    # the leftover temporary directory does not block saving that step again
    checkpoints.save_state(str(tmp_path), second, step=2)
    assert checkpoints.all_steps(str(tmp_path)) == [1, 2]
    _assert_equal_in_sharding(checkpoints.restore_state(str(tmp_path), first), second, second)


_KILLED_SAVE = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import jax
jax.config.update("jax_num_cpu_devices", 8)
import test_checkpoints as t
from ringsplash import checkpoints
mesh = t._mesh(2, 4)
state = t._sharded_state(jax.random.key(5), mesh)
checkpoints.save_state({directory!r}, state, step=1)
async def die(self):
    os.kill(os.getpid(), signal.SIGKILL)
import orbax.checkpoint._src.path.atomicity as atomicity
atomicity.AtomicRenameTemporaryPath.finalize = die
checkpoints.save_state({directory!r}, jax.tree.map(lambda x: x, state), step=2)
"""


@pytest.mark.e2e
def test_process_killed_during_save_leaves_previous_checkpoint(tmp_path):
    directory = str(tmp_path / "ckpt")
    script = _KILLED_SAVE.format(tests=os.path.dirname(__file__), directory=directory)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], check=False, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert [n.split(".")[0] for n in _tmp_dirs(directory)] == ["2"]
    assert checkpoints.latest_step(directory) == 1
    expected = _sharded_state(jax.random.key(5), _mesh(2, 4))
    _assert_equal_in_sharding(checkpoints.restore_state(directory, expected), expected, expected)


def test_keep_last_k(tmp_path, key):
    state = {"w": jax.random.normal(key, (8, 4))}
    for step in range(1, 5):
        checkpoints.save_state(str(tmp_path), {"w": state["w"] * step}, step=step, keep=2)
    assert checkpoints.all_steps(str(tmp_path)) == [3, 4]
    restored = checkpoints.restore_state(str(tmp_path), state, step=3)
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(state["w"] * 3))


def test_metadata_is_readable_without_the_arrays(tmp_path, key):
    state = _sharded_state(key, _mesh(2, 4))
    config = {"model": {"d_model": 32}, "lr": 3e-3}
    checkpoints.save_state(str(tmp_path), state, step=7, config=config)
    # the arrays are gone: metadata must not need them
    shutil.rmtree(tmp_path / "7" / "state")
    meta = checkpoints.read_metadata(str(tmp_path))
    assert meta.step == 7 and meta.config == config and meta.process_count == 1
    assert meta.config_hash == checkpoints.config_hash({"lr": 3e-3, "model": {"d_model": 32}})
    assert meta.config_hash != checkpoints.config_hash({**config, "lr": 1e-3})
    by_path = {leaf.path: leaf for leaf in meta.leaves}
    assert by_path["['params']['stack']"].shape == (2, 8, 6) and by_path["['params']['stack']"].dtype == "float32"
    assert by_path["['rng']"].dtype == "key<fry>" and by_path["['rng']"].key_impl == "threefry2x32"
    assert len(meta.leaves) == len(jax.tree.leaves(state))


@pytest.mark.slow
def test_resumed_fit_equals_uninterrupted(tmp_path, monkeypatch):
    """... and ``fit`` restores straight into the FSDP shardings: the restore target is
    abstract (``ShapeDtypeStruct``s carrying the plan's shardings, no array of the state made
    before), and the restored arrays are the saved ones, in those shardings."""
    config, tc, stream = _setup(steps=8)
    tc = tc.__class__(**{**tc.__dict__, "data_parallel": 2, "checkpoint_every": 2})
    full = train.fit(config, tc, stream, str(tmp_path / "full"))
    cut = train.fit(config, tc, stream, str(tmp_path / "resumed"), stop_after=3)  # "interrupted" after step 3
    host = lambda t: [(np.asarray(x), getattr(x, "sharding", None)) for x in jax.tree.leaves(eqx.filter(t, eqx.is_array_like))]
    cut = host(cut)
    ckpt = str(tmp_path / "resumed" / "checkpoints")
    assert checkpoints.all_steps(ckpt) == [2, 3]  # the periodic one and the one at the stop
    seen = {}

    def spy(directory, like, **kw):
        seen["like"] = like
        out = restore(directory, like, **kw)
        seen["restored"] = host(out)  # before the first step donates it
        return out

    restore = checkpoints.restore_state
    monkeypatch.setattr(checkpoints.store, "restore_state", spy)
    resumed = train.fit(config, tc, stream, str(tmp_path / "resumed"))  # restores step 3
    mesh = train.make_mesh(2, 1)
    plan = train.sharding_plan(config, mesh, fsdp=True)
    is_struct = lambda x: isinstance(x, jax.ShapeDtypeStruct)
    like_arrays = lambda t: jax.tree.leaves(t, is_leaf=is_struct)  # every array-like leaf of the target
    targets = like_arrays((seen["like"].model, seen["like"].opt_state))
    assert targets and all(is_struct(t) for t in targets)  # nothing allocated before the restore
    want = jax.tree.leaves(partitioning.shardings(plan.specs, mesh))
    got = [t.sharding for t in like_arrays(seen["like"].model) if is_struct(t)]
    assert got == want and any(partitioning.is_sharded(s.spec) for s in want)
    assert len(seen["restored"]) == len(cut) == len(targets) + 2  # + step and data seed
    for (value, sharding), (want_value, want_sharding) in zip(seen["restored"], cut, strict=True):
        np.testing.assert_array_equal(value, want_value)
        if value.ndim:  # parameters and optimiser state, sharded like the interrupted run's
            assert sharding.is_equivalent_to(want_sharding, value.ndim), (sharding, want_sharding)
    assert int(resumed.step) == int(full.step) == 8
    assert checkpoints.all_steps(ckpt) == [4, 6, 8]  # keep=3
    for x, y in zip(jax.tree.leaves(eqx.filter(full, eqx.is_array)),
                    jax.tree.leaves(eqx.filter(resumed, eqx.is_array)), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_restore_mismatch_names_first_leaf_and_both_shapes(tmp_path, key):
    state = {"a": jax.random.normal(key, (4, 8)), "b": {"c": jnp.zeros((3,)), "d": jnp.ones((2, 2))}}
    checkpoints.save_state(str(tmp_path), state, step=1, config={"x": 1})
    wrong_shape = {**state, "b": {**state["b"], "c": jnp.zeros((5,))}}
    with pytest.raises(ValueError, match=r"leaf \['b'\]\['c'\] has shape \(3,\) in the checkpoint but \(5,\)"):
        checkpoints.restore_state(str(tmp_path), wrong_shape)
    renamed = {"a": state["a"], "b": {"e": state["b"]["c"], "d": state["b"]["d"]}}
    with pytest.raises(ValueError, match=r"\['b'\]\['c'\] with shape \(3,\) in the checkpoint but "
                                         r"\['b'\]\['d'\] with shape \(2, 2\) in the restore target"):
        checkpoints.restore_state(str(tmp_path), renamed)
    missing = {"a": state["a"], "b": {"c": state["b"]["c"]}}
    with pytest.raises(ValueError, match=r"3 array leaves in the checkpoint, 2 in the restore target; the first "
                                         r"unmatched leaf \['b'\]\['d'\] with shape \(2, 2\) is in only the checkpoint"):
        checkpoints.restore_state(str(tmp_path), missing)
    with pytest.raises(ValueError, match=r"leaf \['a'\] has dtype float32 in the checkpoint but int32"):
        checkpoints.restore_state(str(tmp_path), {**state, "a": state["a"].astype(jnp.int32)})
    no_sharding = {**state, "a": jax.ShapeDtypeStruct((4, 8), jnp.float32)}
    with pytest.raises(ValueError, match=r"\['a'\] is a ShapeDtypeStruct without a sharding"):
        checkpoints.restore_state(str(tmp_path), no_sharding)
    with pytest.raises(ValueError, match=r"config hash .*\(differing keys: \['x'\]\)"):
        checkpoints.restore_state(str(tmp_path), state, config={"x": 2})
    with pytest.raises(FileNotFoundError, match=r"no checkpoint for step=2 .* saved steps: \[1\]"):
        checkpoints.restore_state(str(tmp_path), state, step=2)
    with pytest.raises(FileNotFoundError, match="no finalised checkpoint"):
        checkpoints.restore_state(str(tmp_path / "nothing"), state)
    with pytest.raises(FileExistsError, match="step=1 already exists"):
        checkpoints.save_state(str(tmp_path), state, step=1)
    with pytest.raises(ValueError, match="keep must be a positive int, got keep=0"):
        checkpoints.save_state(str(tmp_path), state, step=2, keep=0)
    with pytest.raises(ValueError, match=r"step=None needs a state with a \.step field"):
        checkpoints.save_state(str(tmp_path), state)
    assert checkpoints.all_steps(str(tmp_path)) == [1]


@pytest.mark.multiprocess
def test_host_local_arrays_are_stored_as_numpy_with_several_processes():
    """orbax refuses host-local jax.Arrays when there are several processes; such a leaf (every
    process holds the same value) is handed to orbax as numpy, which the primary host writes."""
    mesh = _mesh(2, 4)
    sharded = jax.device_put(jnp.arange(16.0).reshape(8, 2), NamedSharding(mesh, P(("data", "context"))))
    step = jnp.asarray(3, jnp.int32)
    assert isinstance(checkpoint_leaves.savable(step, process_count=2), np.ndarray)
    assert checkpoint_leaves.savable(step, process_count=1) is step
    # in one process every array is host-local, yet stays a jax.Array (each device's shard written once)
    assert checkpoint_leaves.savable(sharded, process_count=1) is sharded
    data = checkpoint_leaves.savable(jax.random.split(jax.random.key(0), 8), process_count=1)
    assert data.dtype == jnp.uint32 and data.shape == (8, 2)


def _run_processes(mode, directory, num_processes=2):
    """Run ``checkpoint_worker.py`` in ``num_processes`` processes (coordinator on localhost)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    worker = os.path.join(os.path.dirname(__file__), "checkpoint_worker.py")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, worker, str(i), str(num_processes), str(port), directory, mode],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(num_processes)]
    try:
        outputs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0 and f"process {i}: {mode} ok" in out, out[-3000:]


@pytest.mark.multiprocess
def test_saved_in_two_processes_restores_in_one_and_back(tmp_path):
    """Each process writes only its shards (nothing gathered on process 0); the checkpoint
    restores in a single process onto a 1 × 8 mesh, and a single-process one in two processes."""
    import checkpoint_worker as worker

    two = str(tmp_path / "two")
    _run_processes("save", two)
    assert sorted(n for n in os.listdir(os.path.join(two, "5", "state")) if n.startswith("ocdbt.process_")) == [
        "ocdbt.process_0", "ocdbt.process_1"]
    assert checkpoints.read_metadata(two).process_count == 2
    state = worker.make_state(_mesh(2, 4))
    like = {**_abstract(state, _mesh(1, 8), {"w": P(None, "context"), "v": P("context"), "b": P("context")}),
            "key": state["key"]}
    worker.check_restored(checkpoints.restore_state(two, like), like)

    one = str(tmp_path / "one")
    checkpoints.save_state(one, state, step=worker.STEP)
    _run_processes("restore", one)
