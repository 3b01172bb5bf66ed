"""Smoke test: scripts/bench_splash.py --quick runs (S=8K, causal, v5e compile) and prints its tables."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.tpu_compile
@pytest.mark.e2e
def test_bench_splash_quick_prints_tables():
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_splash.py"), "--quick"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "| S | mask | active / total blocks (per head) |" in out
    assert "| target | S | mask | fwd temp MiB |" in out
    assert "| 8K | causal | 136 / 256 |" in out  # 16 x 17 / 2 blocks of 512 at 8K
    assert "| v5e:2x2 | 8K | causal |" in out and "ERROR" not in out
    assert "not a TPU speed" in out
