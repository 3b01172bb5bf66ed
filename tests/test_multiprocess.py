"""Several JAX processes on this machine (``scripts/launch_local.py``): the multi-host code paths."""

import os
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
LAUNCH = os.path.join(ROOT, "scripts", "launch_local.py")
WORKERS = os.path.join(ROOT, "tests", "multiprocess")


def _launch(*args, timeout=300, env=None):
    env = {**os.environ, **(env or {})}
    env.pop("XLA_FLAGS", None)
    return subprocess.run([sys.executable, LAUNCH, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_ring_across_two_processes_matches_reference():
    """2 processes x 2 devices: the ring's ppermutes cross the process boundary; every process
    checks its own output and gradient shards against the reference (forward, dq, dk, dv)."""
    r = _launch("--processes", "2", "--devices", "2", os.path.join(WORKERS, "ring_vs_reference.py"))
    assert r.returncode == 0, r.stdout + r.stderr
    for case in ("causal_zigzag", "packed_gqa_striped"):
        for p in (0, 1):
            assert f"[p{p}] CASE {case} process {p} shards 2 max_err" in r.stdout, r.stdout


def test_launcher_failure_stops_every_process(tmp_path):
    start = time.monotonic()
    r = _launch("--processes", "2", "--devices", "1", os.path.join(WORKERS, "fail_one.py"),
                env={"PID_DIR": str(tmp_path)}, timeout=120)
    elapsed = time.monotonic() - start
    assert r.returncode != 0, r.stdout + r.stderr
    assert "process 1 fails on purpose" in r.stdout
    assert "process 1 exited with code 1" in r.stdout
    assert elapsed < 60, f"the launcher took {elapsed:.0f} s to give up"  # the healthy peer sleeps 600 s
    pids = [int((tmp_path / f"{i}.pid").read_text()) for i in (0, 1)]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_launcher_picks_another_port_when_busy():
    with socket.socket() as busy:
        busy.bind(("localhost", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = _launch("--processes", "2", "--devices", "1", "--port", str(port),
                    os.path.join(WORKERS, "config_check.py"), "--", "--same")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"port {port} is in use; picking another" in r.stderr
    assert "[p0] CONFIG OK process 0" in r.stdout and "[p1] CONFIG OK process 1" in r.stdout


def test_mismatched_configs_fail_at_start_not_hang():
    r = _launch("--processes", "2", "--devices", "1", os.path.join(WORKERS, "config_check.py"), timeout=120)
    assert r.returncode != 0, r.stdout + r.stderr
    assert "the processes were started with different configs: processes [1] differ from process 0" in r.stdout
    assert "CONFIG OK" not in r.stdout


def test_launcher_rejects_bad_process_count():
    r = _launch("--processes", "0", os.path.join(WORKERS, "config_check.py"), timeout=60)
    assert r.returncode == 2
    assert "--processes must be a positive int, got 0" in r.stderr
