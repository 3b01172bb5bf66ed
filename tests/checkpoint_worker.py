"""One process of a multi-process checkpoint test (``test_checkpoints.py``): saves or restores a
state sharded over a data 2 × context 4 mesh spanning all processes, each process holding
``8 / num_processes`` simulated CPU devices.

    python checkpoint_worker.py PROCESS_ID NUM_PROCESSES PORT DIRECTORY save|restore
"""

import os
import sys

import numpy as np

# Leaf name -> (shape, PartitionSpec axes on the data × context mesh).
SPECS = {"w": ((16, 8), ("context", "data")), "v": ((8, 16), (None, ("data", "context"))), "b": ((8,), ("data",))}
STEP = 5


def expected() -> dict[str, np.ndarray]:
    """Fresh, deterministic values (the same in every process)."""
    rng = np.random.default_rng(11)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, (shape, _) in SPECS.items()}


def make_state(mesh):
    """The global state: sharded arrays (each process fills only its shards), a host-local step
    counter and a host-local PRNG key, as ``train`` makes them."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    values = expected()
    state = {name: jax.make_array_from_callback(values[name].shape, NamedSharding(mesh, P(*axes)),
                                                lambda index, name=name: values[name][index])
             for name, (_, axes) in SPECS.items()}
    return {**state, "step": jnp.asarray(STEP, jnp.int32), "key": jax.random.key(9)}


def check_restored(restored, like) -> None:
    """Every addressable shard holds exactly the expected values, where the target says."""
    import jax

    values = expected()
    for name in SPECS:
        r, t = restored[name], like[name]
        assert r.sharding.is_equivalent_to(t.sharding, r.ndim), (name, r.sharding, t.sharding)
        for shard in r.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), values[name][shard.index])
    assert int(restored["step"]) == STEP
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(restored["key"])),
                                  np.asarray(jax.random.key_data(jax.random.key(9))))


def main(process_id: int, num_processes: int, port: int, directory: str, mode: str) -> None:
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_num_cpu_devices", 8 // num_processes)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", num_processes=num_processes, process_id=process_id)
    from ringsplash import checkpoints, train

    mesh = train.make_mesh(2, 4)  # spans the processes
    assert mesh.devices.flat[0].process_index != mesh.devices.flat[-1].process_index
    state = make_state(mesh)
    if mode == "save":
        checkpoints.save_state(directory, state, step=STEP)
    else:
        check_restored(checkpoints.restore_state(directory, state), state)
    print(f"process {process_id}: {mode} ok", flush=True)


if __name__ == "__main__":
    pid, n, port, directory, mode = sys.argv[1:]
    main(int(pid), int(n), int(port), directory, mode)
