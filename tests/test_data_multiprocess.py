"""2 processes x 2 devices: each process reads only its rows of the ``Loader``, and the rows of all
processes together are the batch one process reads whole; each process's iterator state goes
into a checkpoint (one file per process) and comes back."""

import os
import subprocess
import sys

import numpy as np
import pytest

from ringsplash import data
from support.corpus import make_corpus
from support.processes import child_env

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
WORKERS = os.path.join(ROOT, "tests", "multiprocess")

pytestmark = pytest.mark.multiprocess


def test_two_processes_read_disjoint_rows_whose_union_is_the_batch(tmp_path):
    sys.path.insert(0, WORKERS)
    import loader_rows as worker

    corpus = make_corpus(str(tmp_path / "c"), np.random.default_rng(), n=50, hi=120)
    env = child_env()
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "launch_local.py"), "--processes", "2",
                        "--devices", "2", os.path.join(WORKERS, "loader_rows.py"), "--", corpus.path, str(tmp_path)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    parts = [np.load(tmp_path / f"process_{p}.npz") for p in (0, 1)]
    rows = [set(p["rows"].tolist()) for p in parts]
    assert rows[0] and rows[1] and not rows[0] & rows[1] and rows[0] | rows[1] == set(range(worker.ROWS))
    loader = data.Loader(corpus.path, worker.CONFIG)
    for step in range(worker.STEPS):
        whole = loader.batch(step)
        for p in parts:
            for field in data.Batch._fields:
                np.testing.assert_array_equal(p[field][step], getattr(whole, field)[p["rows"]])
    whole = loader.batch(worker.STEPS)  # after the restore, each process reads on from its saved position
    for i, p in enumerate(parts):
        assert (tmp_path / "checkpoints" / str(worker.STEPS) / "data" / f"process_{i}-of-2.json").exists()
        restored = np.load(tmp_path / f"next_{i}.npz")
        for field in data.Batch._fields:
            np.testing.assert_array_equal(restored[field], getattr(whole, field)[p["rows"]])
