"""Several JAX processes on this machine (``scripts/launch_local.py``): the multi-host code paths."""

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import equinox as eqx
import numpy as np
import pytest

from support.processes import child_env

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
LAUNCH = os.path.join(ROOT, "scripts", "launch_local.py")
WORKERS = os.path.join(ROOT, "tests", "multiprocess")

pytestmark = pytest.mark.multiprocess


def _launch(*args, timeout=300, env=None):
    env = child_env(**(env or {}))
    return subprocess.run([sys.executable, LAUNCH, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_ring_across_two_processes_matches_reference():
    """2 processes x 2 devices: the ring's ppermutes cross the process boundary; every process
    checks its own output and gradient shards against the reference (forward, dq, dk, dv).
    Launched on a busy ``--port``: the launcher picks another (one launch, both checked)."""
    with socket.socket() as busy:
        busy.bind(("localhost", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = _launch("--processes", "2", "--devices", "2", "--port", str(port),
                    os.path.join(WORKERS, "ring_vs_reference.py"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"port {port} is in use; picking another" in r.stderr
    for case in ("causal_zigzag", "packed_gqa_striped"):
        for p in (0, 1):
            assert f"[p{p}] CASE {case} process {p} shards 2 max_err" in r.stdout, r.stdout
    # with a per-device schedule each process builds only its own q-shard rows
    assert "[p0] ROWS process 0 mine (0, 1) built [(0, 1)]" in r.stdout, r.stdout
    assert "[p1] ROWS process 1 mine (2, 3) built [(2, 3)]" in r.stdout, r.stdout


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


def test_mismatched_configs_fail_at_start_not_hang():
    # (matching configs pass the same check: the 2-process main job below runs it at start)
    r = _launch("--processes", "2", "--devices", "1", os.path.join(WORKERS, "config_check.py"), timeout=120)
    assert r.returncode != 0, r.stdout + r.stderr
    assert "the processes were started with different configs: processes [1] differ from process 0" in r.stdout
    assert "CONFIG OK" not in r.stdout


@pytest.mark.cheap  # in this process: no process is started
def test_launcher_rejects_bad_process_count(capsys):
    """Argument checking happens before any process starts (tested in this process)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("launch_local", LAUNCH)
    launcher = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launcher)
    with pytest.raises(SystemExit) as exit_:
        launcher.main(["--processes", "0", os.path.join(WORKERS, "config_check.py")])
    assert exit_.value.code == 2
    assert "--processes must be a positive int, got 0" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------
# the main job across processes

MAIN_JOB = ["experiments/train_long_context.py", "--steps", "8", "--batch-size", "2", "--d-model", "32",
            "--num-layers", "1", "--seq-len", "256", "--num-pairs", "4", "--num-queries", "4", "--num-filler", "4",
            "--curriculum", "32:0.5", "--block", "128", "--eval-batches", "1", "--eval-every", "4", "--log-every", "1",
            "--checkpoint-every", "4", "--no-progress", "--context-parallel", "4"]


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _digest(stdout):
    return [line.split("final state digest: ")[1] for line in stdout.splitlines() if "final state digest: " in line]


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("two") / "run"
    r = _launch("--processes", "2", "--devices", "2", *MAIN_JOB[:1], "--", *MAIN_JOB[1:], "--run-dir", str(run_dir))
    assert r.returncode == 0, r.stdout + r.stderr
    return run_dir, r.stdout


def _main_job_module():
    """``experiments/train_long_context.py`` as a module (its ``main`` runs in this process)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_long_context", os.path.join(ROOT, MAIN_JOB[0]))
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    return job


def test_main_job_two_processes_follow_the_single_process_loss_curve(tmp_path, two_process_run):
    """A ring over 4 devices spanning 2 processes (2 x 2) trains like 1 process x 4 devices
    (run here, in the test process: its first 4 of 8 simulated devices)."""
    import jax

    run_dir, stdout = two_process_run
    jax.devices()  # the 8 test devices exist before the job asks for 4 (it can no longer change them)
    job = _main_job_module()
    job.main(job.parse_args([*MAIN_JOB[1:], "--run-dir", str(tmp_path / "one")]))
    single, multi = _records(tmp_path / "one"), _records(run_dir)
    assert [(r["split"], r["step"]) for r in single] == [(r["split"], r["step"]) for r in multi]
    for a, b in zip(single, multi, strict=True):
        # measured ≤ 1.2e-7 relative (gloo vs in-process reductions order sums differently); ~8x headroom
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(a["loss"]), (a, b)
        if a["split"] == "eval":
            assert a["accuracy"] == b["accuracy"], (a, b)
    # metrics, plot and the summary come from process 0 only
    assert "[p0] held-out recall accuracy" in stdout and "[p1] held-out recall accuracy" not in stdout
    assert (run_dir / "metrics.png").exists()


def test_main_job_interrupted_under_two_processes_resumes_bit_for_bit(tmp_path, two_process_run):
    """A 2-process run that died after its step-4 checkpoint (the uninterrupted run's directory
    without the final checkpoint: metrics logged past step 4, checkpoint 4 the latest), resumed
    under 2 processes: the final state equals the uninterrupted run's bit for bit, and the
    metrics past the checkpoint are rewritten, not duplicated. (A real SIGKILL mid-run:
    ``test_scripts.py``; the launcher's failure path: ``test_launcher_failure_stops_every_process``.)"""
    full_dir, full_stdout = two_process_run
    cut_dir = tmp_path / "cut"
    shutil.copytree(full_dir, cut_dir)
    shutil.rmtree(cut_dir / "checkpoints" / "8")
    assert sorted(os.listdir(cut_dir / "checkpoints")) == ["4"]
    args = ("--processes", "2", "--devices", "2", *MAIN_JOB[:1], "--", *MAIN_JOB[1:], "--run-dir", str(cut_dir))
    resumed = _launch(*args)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "(resuming from its checkpoint)" in resumed.stdout
    assert _digest(resumed.stdout) and _digest(resumed.stdout) == _digest(full_stdout)
    assert [r["step"] for r in _records(cut_dir) if r["split"] == "train"] == list(range(1, 9))


# ----------------------------------------------------------------------------------------
# FSDP training, process-local input and checkpoints across 2 processes x 4 devices


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    """The same run (``tests/multiprocess/fsdp_train.py``) trained in this process on 8 devices
    and in 2 processes x 4 devices, each restoring the other's checkpoint."""
    import jax

    sys.path.insert(0, WORKERS)
    import fsdp_train as worker

    from ringsplash import train

    root = tmp_path_factory.mktemp("fsdp")
    config, tc, stream = worker.setup()
    one = train.fit(config, tc, stream, str(root / "one"), mesh=train.make_mesh(worker.DATA, worker.CONTEXT))
    one_params = [np.asarray(x) for x in jax.tree.leaves(eqx.filter(one.model, eqx.is_array))]
    r = _launch("--processes", "2", "--devices", "4", os.path.join(WORKERS, "fsdp_train.py"), "--",
                str(root / "two"), str(root / "one" / "checkpoints"))
    assert r.returncode == 0, r.stdout + r.stderr
    return dict(worker=worker, root=root, stdout=r.stdout, one_digest=train.state_digest(one), one_params=one_params,
                config=config, tc=tc, stream=stream)


def test_fsdp_training_in_two_processes_equals_one_process(fsdp_runs):
    """data 2 x context 4, FSDP parameters: every logged loss and the final parameters of the
    2-process run equal the single-process 8-device run's."""
    import jax

    from ringsplash import train

    run, worker = fsdp_runs, fsdp_runs["worker"]
    one, two = _records(run["root"] / "one"), _records(run["root"] / "two")
    assert [r["step"] for r in one] == [r["step"] for r in two] == list(range(1, worker.STEPS + 1))
    # measured: identical losses and parameters (the gloo reductions happen to sum in XLA:CPU's
    # order here); 1e-6 relative leaves room for reordering, far below a wrong gradient's effect
    for a, b in zip(one, two, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(a["loss"]), (a, b)
    assert one[-1]["loss"] < one[0]["loss"]  # it trains
    mesh = train.make_mesh(worker.DATA, worker.CONTEXT)
    plan = train.sharding_plan(run["config"], mesh, True)
    two_state = train.restore_sharded_state(str(run["root"] / "two" / "checkpoints"), run["config"], run["tc"], mesh,
                                            plan, run["stream"].seed)
    for a, b in zip(run["one_params"], jax.tree.leaves(eqx.filter(two_state.model, eqx.is_array)), strict=True):
        np.testing.assert_allclose(np.asarray(b), a, atol=1e-6, rtol=0)


def test_checkpoint_saved_in_two_processes_restores_in_one_and_back(fsdp_runs):
    """A TrainState checkpoint written by 2 processes restores (sharded, FSDP) in 1 process to
    the 2-process run's final state bit for bit, and the 1-process run's checkpoint restores
    in 2 processes to the 1-process state bit for bit."""
    from ringsplash import train

    run, worker = fsdp_runs, fsdp_runs["worker"]
    digests = {line.split("] DIGEST ")[1] for line in run["stdout"].splitlines() if "] DIGEST " in line}
    assert len(digests) == 1, run["stdout"]  # both processes see the same global state
    [two_digest] = digests
    mesh = train.make_mesh(worker.DATA, worker.CONTEXT)
    plan = train.sharding_plan(run["config"], mesh, True)
    restored = train.restore_sharded_state(str(run["root"] / "two" / "checkpoints"), run["config"], run["tc"], mesh,
                                           plan, run["stream"].seed)
    assert int(restored.step) == worker.STEPS and train.state_digest(restored) == two_digest
    for p in (0, 1):
        assert (f"[p{p}] RESTORED process {p} step {worker.STEPS} in plan shardings True "
                f"digest {run['one_digest']}") in run["stdout"], run["stdout"]


def test_each_process_draws_only_its_rows(fsdp_runs):
    """Process p holds data shard p (rows 2p, 2p + 1 of 4): it draws those rows of every batch
    and no other, and the global batch built from both processes' rows is the whole batch."""
    stdout, steps = fsdp_runs["stdout"], fsdp_runs["worker"].STEPS
    for p in (0, 1):
        rows = [2 * p, 2 * p + 1]
        assert f"[p{p}] ROWS process {p} drew {[(s, r) for s in range(steps) for r in rows]}" in stdout, stdout
        assert f"[p{p}] BATCH process {p} drew {[(5, r) for r in rows]} global batch equal" in stdout, stdout


def test_a_process_count_that_does_not_divide_the_mesh_is_named(fsdp_runs):
    assert ("MESH ERROR mesh data=1 x context=3 = 3 devices cannot be split evenly over 2 processes"
            in fsdp_runs["stdout"]), fsdp_runs["stdout"]


HEARTBEAT = 5  # s: RINGSPLASH_HEARTBEAT_TIMEOUT in the lost-peer tests (small, to keep them short)


def _start_pair(tmp_path):
    """Two processes of collectives_forever.py (one device each) with a HEARTBEAT-second heartbeat
    timeout, both past their first collective."""
    from ringsplash.distributed import local_launch_env

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = child_env()
    env.update(JAX_PLATFORMS="cpu", PID_DIR=str(tmp_path), PYTHONUNBUFFERED="1")
    procs = [subprocess.Popen([sys.executable, "-m", "ringsplash.distributed",
                               os.path.join(WORKERS, "collectives_forever.py")], cwd=ROOT,
                              env={**env, **local_launch_env(f"localhost:{port}", 2, i, 1, heartbeat_timeout=HEARTBEAT)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for i in range(2)]
    for p in procs:
        for line in p.stdout:
            if line.startswith("READY"):
                break
        else:
            raise AssertionError(f"a worker ended before it was ready (code {p.wait()})")
    return procs


@pytest.mark.parametrize("sig, sign", [
    ("SIGKILL", r"process 0: lost process\(es\) \[1\] of 2 \(no heartbeat for 5 s"),
    ("SIGSTOP", r"unhealthy \(stopped sending heartbeats\):\s*1\s"),  # the service names task 1
], ids=["SIGKILL", "SIGSTOP"])
def test_a_lost_process_is_reported_within_the_heartbeat_timeout(tmp_path, sig, sign):
    """Process 1 killed or stopped mid-run: process 0 leaves within the heartbeat timeout (plus
    start-up slack), with a message naming process 1 (SIGKILL: ringsplash.distributed asks the
    coordination service who is alive; SIGSTOP: the service's own report of the silent task)."""
    import signal

    procs = _start_pair(tmp_path)
    try:
        start = time.monotonic()
        os.kill(procs[1].pid, getattr(signal, sig))
        out, _ = procs[0].communicate(timeout=HEARTBEAT + 30)
        elapsed = time.monotonic() - start
    finally:
        for p in procs:
            p.kill()
            p.wait()
    print(f"{sig}: process 0 exited with code {procs[0].returncode} after {elapsed:.1f} s")
    assert procs[0].returncode != 0, out
    assert elapsed < HEARTBEAT + 10, f"process 0 took {elapsed:.0f} s to notice: {out[-2000:]}"
    assert re.search(sign, out), out[-3000:]


def test_launcher_names_a_stopped_process(tmp_path):
    """Process 1 stopped under the launcher: process 0 is aborted by the coordination service
    within the heartbeat timeout, and the launcher says that process 1 is stopped, not dead."""
    import signal
    import threading

    def stop_process_1():
        pid_file = tmp_path / "1.pid"
        deadline = time.monotonic() + 60
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(2.0)  # past the first collectives
        os.kill(int(pid_file.read_text()), signal.SIGSTOP)

    stopper = threading.Thread(target=stop_process_1, daemon=True)
    stopper.start()
    r = _launch("--processes", "2", "--devices", "1", "--heartbeat-timeout", str(HEARTBEAT),
                os.path.join(WORKERS, "collectives_forever.py"), env={"PID_DIR": str(tmp_path)}, timeout=120)
    stopper.join()
    assert r.returncode != 0, r.stdout + r.stderr
    assert re.search(r"process 0 exited with code -?\d+ \(process\(es\) \[1\] are stopped", r.stdout), r.stdout[-3000:]
    with pytest.raises(ProcessLookupError):  # the launcher left nothing behind, stopped or not
        os.kill(int((tmp_path / "1.pid").read_text()), 0)


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_launcher_stopped_by_sigterm_stops_every_worker_and_their_children(tmp_path):
    """SIGTERM to the launcher (``timeout``, ``kill``; SIGINT and SIGHUP take the same path): it exits
    143, and every worker and every process a worker started are gone within 3 s of it, so the workers
    honour SIGTERM (the launcher would SIGKILL only after its 5 s grace). Workers that only sleep:
    the cost is starting them (two JAX processes, ~5 s on 2 cores, up to ~15 s when the machine is busy)."""
    import signal

    sig = "SIGTERM"

    launcher = subprocess.Popen([sys.executable, LAUNCH, "--processes", "2", "--devices", "1",
                                 os.path.join(WORKERS, "sleep_with_child.py")], cwd=ROOT,
                                env=child_env(PID_DIR=str(tmp_path)), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    pids = []
    try:
        deadline = time.monotonic() + 120
        while len(pids) < 4 and time.monotonic() < deadline and launcher.poll() is None:
            files = [tmp_path / f"{i}.pid" for i in (0, 1)]
            if all(f.exists() for f in files):
                pids = [int(p) for f in files for p in f.read_text().split()]
            time.sleep(0.1)
        assert len(pids) == 4, f"the workers did not start: {launcher.poll()=}"
        assert all(_alive(pid) for pid in pids)
        gone_by = time.monotonic() + 3.0
        os.kill(launcher.pid, getattr(signal, sig))
        while any(_alive(pid) for pid in pids) and time.monotonic() < gone_by:
            time.sleep(0.05)
        left = [pid for pid in pids if _alive(pid)]
        code = launcher.wait(timeout=30)
        out = launcher.stdout.read()
        assert not left, f"still running 3 s after the {sig}: {left} of workers + children {pids}\n{out}"
        assert code == 128 + getattr(signal, sig), out
        assert f"[launch_local] {sig} received; stopping every process" in out, out
    finally:
        for pid in [launcher.pid, *pids[::2]]:  # the launcher's and each worker's process group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        launcher.wait()
        launcher.stdout.close()
