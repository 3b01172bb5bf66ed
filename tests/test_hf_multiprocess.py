"""``load_hf`` / ``save_hf`` across 2 processes x 2 devices (``scripts/launch_local.py``, gloo): each
process reads only the slices its devices hold (bytes counted), the sharded result equals the
single-process load, and ``save_hf`` from the sharded model writes a checkpoint transformers loads."""

import os
import subprocess
import sys

import numpy as np
import pytest

from support.processes import child_env
from test_hf import FAMILIES, _tokens, make_hf_model, torch_logits

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))

pytestmark = pytest.mark.multiprocess


def test_sharded_load_reads_only_local_slices_and_sharded_save_round_trips(tmp_path):
    import transformers

    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    original = make_hf_model("qwen3", FAMILIES["qwen3"], str(ckpt))
    env = child_env()
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "launch_local.py"), "--processes", "2",
                        "--devices", "2", os.path.join(ROOT, "tests", "multiprocess", "hf_load.py"), "--",
                        str(ckpt), str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    for p in (0, 1):
        line = next(x for x in r.stdout.splitlines() if f"BYTES process {p} " in x)
        read, expected, total = (int(line.split()[i]) for i in (-5, -3, -1))
        assert read == expected, line
        # FSDP over 4 devices, 2 per process: about half of the model (norms and unshardable
        # tensors are replicated, so every process reads those whole)
        assert read < 0.6 * total, line
        assert f"[p{p}] EQUAL process {p}" in r.stdout, r.stdout
        assert f"[p{p}] SAVED process {p}" in r.stdout, r.stdout
    back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    np.testing.assert_array_equal(torch_logits(back, _tokens()), torch_logits(original, _tokens()))
