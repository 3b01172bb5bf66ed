"""Smoke test: scripts/bench_splash.py --quick runs (S=8K, causal, v5e compile) and prints its tables."""

import os
import pathlib
import subprocess
import sys

import pytest

from support.processes import child_env

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


@pytest.mark.multiprocess
@pytest.mark.e2e
def test_bench_hf_tiny_prints_tables(tmp_path):
    """scripts/bench_hf.py --tiny: the write, load (whole, 4 devices in one process, 2 processes
    via the launcher) and forward sections run; each sharded process reads its share; the two
    forwards' logits agree; the checkpoint is deleted at the end."""
    env = child_env(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_hf.py"), "--tiny", "--seq-lens", "256", "--repeats", "1",
         "--layouts", "whole", "1x4", "2x1", "--dir", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "| load | process | seconds | read (GiB) |" in out
    rows = [ln for ln in out.splitlines() if ln.startswith("| FSDP, 2 processes x 1 device |")]
    assert len(rows) == 2 and all("| 0.50 |" in r for r in rows), out
    assert "| whole, 1 process x 1 device | 0 |" in out and "| FSDP, 1 process x 4 devices | 0 |" in out
    diff = next(ln for ln in out.splitlines() if "transformers (sdpa)" in ln).split("|")[7]
    assert float(diff.split()[0]) < 1e-4, out
    assert not os.path.exists(tmp_path / "tiny")


@pytest.mark.e2e
def test_bench_inference_tiny_prints_tables():
    """scripts/bench_inference.py --tiny: the prefill and decode tables, transformers side by side and the
    sharded-cache column."""
    env = child_env(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_inference.py"), "--tiny"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "| prompt | ringsplash (s) | transformers (s) | speed-up |" in out
    rows = [ln for ln in out.splitlines() if ln.startswith(("| 1 | 256 |", "| 2 | 256 |"))]
    assert len(rows) == 2 and all(float(r.split("|")[-2]) > 0 for r in rows), out  # the sharded column ran
