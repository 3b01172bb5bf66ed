"""Worker for tests/test_data_multiprocess.py: each process reads its rows of a ``data.Loader``.

    python scripts/launch_local.py --processes 2 --devices 2 tests/multiprocess/loader_rows.py -- CORPUS OUT_DIR

On a data 2 x context 2 mesh whose data axis spans the processes, each process takes its rows
(``train.process_rows``), reads ``STEPS`` batches of only those rows through the loader's Grain
iterator, and writes them with the row indices to ``OUT_DIR/process_<i>.npz``. Then it saves a
checkpoint with the iterator (each process its own state file), restores it into a fresh
iterator and writes that one's next batch (``next_<i>.npz``): batch ``STEPS``. No model runs.
"""

import os
import sys

import jax
import numpy as np

from ringsplash import checkpoints, data, train

SEQ, ROWS, STEPS = 64, 8, 3
CONFIG = data.LoaderConfig(seq_len=SEQ, batch_size=ROWS, seed=11, packing="concat_split")


def main(corpus: str, out: str) -> None:
    mesh = train.make_mesh(2, 2)
    rows = train.process_rows(mesh, ROWS)
    it = data.Loader(corpus, CONFIG).iterator(rows)
    batches = [next(it) for _ in range(STEPS)]
    fields = {f: np.stack([getattr(b, f) for b in batches]) for f in data.Batch._fields}
    np.savez(os.path.join(out, f"process_{jax.process_index()}.npz"), rows=rows, **fields)
    print(f"ROWS process {jax.process_index()} {rows.tolist()}", flush=True)
    ckpt = os.path.join(out, "checkpoints")
    checkpoints.save_state(ckpt, {"w": np.arange(3.0)}, step=STEPS, data_iterator=it)
    fresh = data.Loader(corpus, CONFIG).iterator(rows)
    assert checkpoints.restore_data_iterator(ckpt, STEPS, fresh)
    nxt = next(fresh)
    np.savez(os.path.join(out, f"next_{jax.process_index()}.npz"), **{f: getattr(nxt, f) for f in data.Batch._fields})


if __name__ == "__main__":
    main(*sys.argv[1:3])
