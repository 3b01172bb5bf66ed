"""Worker for tests/test_multiprocess.py: FSDP training on a data 2 x context 4 mesh whose data
axis spans 2 processes x 4 devices (ring zigzag over ``context`` inside each process, parameter
gathers and gradient reductions across them).

    python scripts/launch_local.py --processes 2 --devices 4 tests/multiprocess/fsdp_train.py -- RUN_DIR ONE_CKPT

1. ``train.fit`` for ``STEPS`` steps into ``RUN_DIR`` (metrics, final checkpoint), recording
   every row of the data stream this process draws;
2. the global batch assembled from each process's rows equals the whole batch one process draws;
3. restores ``ONE_CKPT`` (the single-process run's checkpoints) straight into this mesh's FSDP
   shardings;
4. asks for a mesh whose size the process count does not divide.

Prints ``ROWS`` / ``BATCH`` / ``DIGEST`` / ``RESTORED`` / ``MESH`` lines for the test; the test
process imports ``setup`` to train the same run in one process.
"""

import sys

from ringsplash.model import ContextParallel

SEQ, ROWS, DATA, CONTEXT, STEPS = 512, 4, 2, 4, 3
DRAWN: list[tuple[int, int]] = []  # (step, row) of every row this process drew


def setup():
    """(model config, train config, data stream) of the run, identical in every process."""
    from ringsplash import data, train
    from ringsplash.model import TransformerConfig
    from ringsplash.splash import SplashConfig

    task = data.RecallTask(seq_len=SEQ, num_pairs=8, num_queries=8, num_keys=16, num_values=8, num_filler=8)

    def make(rng, n, step):
        _, step_, row = rng.bit_generator.seed_seq.entropy  # a per-row stream seeds with (seed, step, row)
        DRAWN.append((int(step_), int(row)))
        return task.batch(rng, n)

    blocks = SplashConfig(block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128, backend="xla")
    config = TransformerConfig(vocab_size=task.vocab_size, d_model=16, num_layers=1, num_heads=2, max_seq_len=SEQ,
                               splash=blocks, context_parallel=ContextParallel("ring", ring_size=CONTEXT))
    tc = train.TrainConfig(steps=STEPS, batch_size=ROWS, data_parallel=DATA,
                           warmup_steps=1, learning_rate=1e-2, log_every=1, progress=False)
    return config, tc, data.DataStream(make=make, batch_size=ROWS, seed=1, per_row=True)


def main(run_dir: str, one_ckpt: str) -> int:
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from ringsplash import partitioning, train

    p = jax.process_index()
    assert jax.process_count() == 2 and jax.device_count() == DATA * CONTEXT, "run under launch_local 2 x 4"
    config, tc, stream = setup()
    mesh = train.make_mesh(DATA, CONTEXT)
    state = train.fit(config, tc, stream, run_dir, mesh=mesh)
    print(f"ROWS process {p} drew {sorted(set(DRAWN))}", flush=True)

    DRAWN.clear()
    batch = train.stream_batch(stream, 5, mesh, config)
    drawn = sorted(set(DRAWN))
    whole = train.layout_batch(stream.batch(5), config)  # every row, for the comparison only
    same = all(np.array_equal(multihost_utils.process_allgather(g, tiled=True), w)
               for g, w in zip(batch, whole, strict=True))
    print(f"BATCH process {p} drew {drawn} global batch {'equal' if same else 'DIFFERENT'}", flush=True)
    print(f"DIGEST {train.state_digest(state)}", flush=True)

    plan = train.sharding_plan(config, mesh, tc.fsdp)
    restored = train.restore_sharded_state(one_ckpt, config, tc, mesh, plan, stream.seed)
    want = jax.tree.leaves(partitioning.shardings(plan.specs, mesh))
    leaves = jax.tree.leaves(restored.model)
    in_plan = len(leaves) == len(want) and all(x.sharding.is_equivalent_to(w, x.ndim) for x, w in zip(leaves, want))
    print(f"RESTORED process {p} step {int(restored.step)} in plan shardings {in_plan} "
          f"digest {train.state_digest(restored)}", flush=True)

    try:
        train.make_mesh(1, 3)
        print("MESH no error", flush=True)
    except ValueError as e:
        print(f"MESH ERROR {e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
