"""Every ```python block of README.md (and of docs/INTERNALS.md) runs as pasted, in a fresh interpreter,
and exits 0."""

import pathlib
import re
import subprocess
import sys

import pytest

from support.processes import child_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.M | re.S)
BLOCKS += re.findall(r"^```python\n(.*?)^```", (ROOT / "docs" / "INTERNALS.md").read_text(), flags=re.M | re.S)
TIMEOUT_S = 300  # generous for a loaded machine; each block takes ~10 s of CPU


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 2, f"expected the README's tour blocks, found {len(BLOCKS)}"


@pytest.mark.e2e
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index, tmp_path):
    env = child_env(JAX_PLATFORMS="cpu")  # a fresh process: the block sets its own simulated devices
    proc = subprocess.run(
        [sys.executable, "-c", BLOCKS[index]],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, (
        f"README python block {index} exited {proc.returncode}\n--- block ---\n{BLOCKS[index]}"
        f"\n--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"
    )
