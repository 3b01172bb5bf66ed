"""Joining JAX's multi-process runtime: one entry point for TPU pod slices and local runs.

Every process of a multi-host run calls :func:`initialize` before touching devices:

* on a TPU slice (no ``RINGSPLASH_*`` variables) it is ``jax.distributed.initialize()``:
  coordinator, process count and id come from the TPU metadata;
* under ``scripts/launch_local.py`` the launcher sets ``RINGSPLASH_COORDINATOR``,
  ``RINGSPLASH_NUM_PROCESSES``, ``RINGSPLASH_PROCESS_ID`` and ``RINGSPLASH_LOCAL_DEVICES``: each
  process gets that many simulated CPU devices and gloo CPU collectives, so the multi-host
  code paths (process-local data, global arrays from local shards, collective checkpoints,
  collectives across process boundaries) run on one machine exactly as on a pod slice.

``python -m ringsplash.distributed SCRIPT [ARGS...]`` initialises, then runs ``SCRIPT`` as
``__main__``: both launchers start their workers through it.
"""

import contextlib
import glob
import hashlib
import json
import os
import runpy
import sys
import traceback
from typing import Any

ENV_COORDINATOR = "RINGSPLASH_COORDINATOR"
ENV_NUM_PROCESSES = "RINGSPLASH_NUM_PROCESSES"
ENV_PROCESS_ID = "RINGSPLASH_PROCESS_ID"
ENV_LOCAL_DEVICES = "RINGSPLASH_LOCAL_DEVICES"
#: seconds without a heartbeat after which the coordination service declares a process lost and
#: every other process aborts with a message naming it (jax.distributed's heartbeat_timeout_seconds)
ENV_HEARTBEAT_TIMEOUT = "RINGSPLASH_HEARTBEAT_TIMEOUT"
#: seconds a process waits for the others at start (initialization_timeout) and at the final
#: shutdown barrier (shutdown_timeout_seconds)
ENV_INIT_TIMEOUT = "RINGSPLASH_INIT_TIMEOUT"
ENV_SHUTDOWN_TIMEOUT = "RINGSPLASH_SHUTDOWN_TIMEOUT"
#: defaults (seconds): a lost or stopped process is reported within about HEARTBEAT_TIMEOUT
HEARTBEAT_TIMEOUT, INIT_TIMEOUT, SHUTDOWN_TIMEOUT = 30, 300, 60

_initialized = False


def local_launch_env(coordinator: str, num_processes: int, process_id: int, local_devices: int, *,
                     heartbeat_timeout: int = HEARTBEAT_TIMEOUT) -> dict[str, str]:
    """The environment variables ``scripts/launch_local.py`` gives process ``process_id``."""
    return {
        ENV_COORDINATOR: coordinator,
        ENV_NUM_PROCESSES: str(num_processes),
        ENV_PROCESS_ID: str(process_id),
        ENV_LOCAL_DEVICES: str(local_devices),
        ENV_HEARTBEAT_TIMEOUT: str(heartbeat_timeout),
    }


def inherited_xla_flags(xla_flags: str | None) -> str:
    """``XLA_FLAGS`` for a process this one starts: the caller's flags without
    ``--xla_force_host_platform_device_count`` (a launched process sets its own device count,
    ``jax_num_cpu_devices``); every other flag (compile options, dumps) reaches it."""
    kept = [f for f in (xla_flags or "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join(kept)


def timeouts() -> dict[str, int]:
    """``jax.distributed.initialize``'s timeout arguments, from ``RINGSPLASH_HEARTBEAT_TIMEOUT`` /
    ``_INIT_TIMEOUT`` / ``_SHUTDOWN_TIMEOUT`` (seconds, positive ints) or the defaults."""
    from ringsplash._internal.scalar_checks import check_positive_int

    def read(env: str, default: int) -> int:
        raw = os.environ.get(env, "")
        try:
            value = int(raw) if raw else default
        except ValueError:
            raise ValueError(f"{env} must be a positive int (seconds), got {env}={raw!r}") from None
        return check_positive_int(env, value)

    return {"heartbeat_timeout_seconds": read(ENV_HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT),
            "initialization_timeout": read(ENV_INIT_TIMEOUT, INIT_TIMEOUT),
            "shutdown_timeout_seconds": read(ENV_SHUTDOWN_TIMEOUT, SHUTDOWN_TIMEOUT)}


def launched_locally() -> bool:
    """Whether this process was started by the local launcher."""
    return ENV_COORDINATOR in os.environ


def tpu_present() -> bool:
    """Whether this machine has a TPU, without starting libtpu: the TPU VM's device files
    (``/dev/accel*`` on v2-v5e, numbered ``/dev/vfio/*`` groups on v5p / v6e and later)."""
    if glob.glob("/dev/accel*"):
        return True
    return any(name.isdigit() for name in (os.listdir("/dev/vfio") if os.path.isdir("/dev/vfio") else ()))


def choose_platform(cpu_devices: int = 1) -> str:
    """Choose JAX's platform before it starts its backends, and return it: ``JAX_PLATFORMS`` (or
    ``jax.config.jax_platforms``) when the user set one, else ``"tpu"`` when the machine has one
    (:func:`tpu_present`) and ``"cpu"`` otherwise. On the CPU (only there) ``cpu_devices`` simulated
    devices are made for a mesh (not under the local launcher, which gives each process its own).
    Nothing is written to the environment: ``jax.config`` holds the choice, so child processes
    choose for themselves, and a CPU machine never loads libtpu (which prints errors while it looks
    for TPU metadata). A no-op once JAX's backends have started."""
    import jax

    chosen = os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or ""
    if not chosen:
        chosen = "tpu" if tpu_present() else "cpu"
        if chosen == "cpu":
            jax.config.update("jax_platforms", "cpu")
    if chosen.split(",")[0] == "cpu" and cpu_devices > 1 and not launched_locally():
        with contextlib.suppress(RuntimeError):  # impossible (and unneeded) once JAX has started
            jax.config.update("jax_num_cpu_devices", cpu_devices)
    return chosen


def device_line() -> str:
    """``devices: N x KIND (platform P, P processes)``: what JAX computes on (starts JAX)."""
    import jax

    devices = jax.devices()
    kinds = sorted({d.device_kind for d in devices})
    return (f"devices: {len(devices)} x {', '.join(kinds)} (platform {devices[0].platform}, "
            f"{jax.process_count()} process{'es' if jax.process_count() > 1 else ''})")


def initialize() -> None:
    """Join the multi-process runtime (idempotent; a no-op for a plain single-process run).

    Local launch: ``jax.distributed.initialize(coordinator, num_processes, process_id)`` with
    ``jax_num_cpu_devices`` simulated CPU devices and gloo collectives, all set before JAX
    creates its backends, and JAX's preemption service off (SIGTERM ends the process). TPU
    slice (``TPU_WORKER_HOSTNAMES`` lists more than one worker, or
    ``RINGSPLASH_TPU_MULTIHOST=1``): ``jax.distributed.initialize()`` from the TPU metadata.
    Both pass :func:`timeouts`: a process that dies or stops (no heartbeat for
    ``RINGSPLASH_HEARTBEAT_TIMEOUT`` seconds) is reported by the coordination service, and the
    others abort with a message naming its task (``/job:jax_worker/replica:0/task:<process id>``).
    """
    global _initialized
    if _initialized:
        return
    import jax

    if launched_locally():
        from ringsplash._internal.scalar_checks import check_positive_int

        num_processes = check_positive_int(ENV_NUM_PROCESSES, int(os.environ[ENV_NUM_PROCESSES]))
        process_id = int(os.environ[ENV_PROCESS_ID])
        if not 0 <= process_id < num_processes:
            raise ValueError(f"{ENV_PROCESS_ID}={process_id} must be in [0, {ENV_NUM_PROCESSES}={num_processes})")
        local_devices = check_positive_int(ENV_LOCAL_DEVICES, int(os.environ[ENV_LOCAL_DEVICES]))
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", local_devices)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        # JAX's preemption service installs a SIGTERM handler that records a preemption notice (for
        # multihost_utils.reached_preemption_sync_point, which ringsplash does not use) and keeps the
        # process running: a local worker would then ignore the launcher's SIGTERM. Off, SIGTERM ends it.
        jax.config.update("jax_enable_preemption_service", False)
        jax.distributed.initialize(os.environ[ENV_COORDINATOR], num_processes=num_processes, process_id=process_id,
                                   **timeouts())
    elif _tpu_multihost():
        jax.distributed.initialize(**timeouts())
    _initialized = True


def _tpu_multihost() -> bool:
    hosts = [h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
    return os.environ.get("RINGSPLASH_TPU_MULTIHOST") == "1" or len(hosts) > 1


def is_main_process() -> bool:
    """True on the process that prints, plots and writes metrics (process 0)."""
    import jax

    return jax.process_index() == 0


def config_digest(config: Any) -> str:
    """A short stable hash of a config: a dataclass or a JSON-able mapping (key order does not
    matter; other leaves hash by ``str``). Checkpoints store it (``checkpoints.config_hash``)."""
    import dataclasses

    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_same_config(config: Any, name: str = "config") -> None:
    """Raise on every process unless all processes were started with the same ``config``.

    Run at start-up: a process given other flags would otherwise compile another program and
    hang in its first collective instead of failing.
    """
    import jax
    import numpy as np

    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    digest = config_digest(config)
    mine = np.frombuffer(bytes.fromhex(digest), np.uint8)
    every = np.asarray(multihost_utils.process_allgather(mine))
    differ = [i for i in range(every.shape[0]) if not np.array_equal(every[i], every[0])]
    if differ:
        raise ValueError(
            f"the processes were started with different {name}s: processes {differ} differ from process 0 "
            f"(this process {jax.process_index()} has {name} digest {digest}); start every process with the "
            f"same flags"
        )


def agree_on(text: str, max_bytes: int = 4096) -> str:
    """Process 0's ``text`` on every process (e.g. a run directory named after the clock)."""
    import jax
    import numpy as np

    if jax.process_count() == 1:
        return text
    from jax.experimental import multihost_utils

    raw = text.encode()
    if len(raw) > max_bytes:
        raise ValueError(f"agree_on: text of {len(raw)} bytes is longer than {max_bytes=}")
    buf = np.zeros(max_bytes + 4, np.uint8)
    buf[:4] = np.frombuffer(np.uint32(len(raw)).tobytes(), np.uint8)
    buf[4 : 4 + len(raw)] = np.frombuffer(raw, np.uint8)
    got = np.asarray(multihost_utils.broadcast_one_to_all(buf))
    n = int(np.frombuffer(got[:4].tobytes(), np.uint32)[0])
    return got[4 : 4 + n].tobytes().decode()


def run_script(script: str, args: list[str]) -> None:
    """Initialise, then run ``script`` as ``__main__`` with ``args`` as its argv."""
    initialize()
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        raise SystemExit("usage: python -m ringsplash.distributed SCRIPT [ARGS...]")
    script, args = argv[0], argv[1:]
    if args and args[0] == "--":
        args = args[1:]
    try:
        run_script(script, args)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if code:
            _exit_now(code)
        raise
    except BaseException as e:
        traceback.print_exc()
        if _initialized and _looks_like_a_lost_peer(e):
            print(f"[ringsplash.distributed] {_lost_peer_report()}", file=sys.stderr, flush=True)
        _exit_now(1)


#: what a collective reports when a peer process went away (gloo's TCP errors, the coordination service)
_LOST_PEER_SIGNS = ("Gloo", "Connection reset", "Connection closed", "UNAVAILABLE", "DEADLINE_EXCEEDED", "heartbeat")


def _looks_like_a_lost_peer(error: BaseException) -> bool:
    import jax

    return jax.process_count() > 1 and any(sign in str(error) for sign in _LOST_PEER_SIGNS)


def lost_processes(timeout: float) -> list[int] | None:
    """The processes the coordination service no longer sees alive, ascending (it answers once it
    knows, i.e. within about the heartbeat timeout of a death or stop); None when it cannot tell
    within ``timeout`` seconds (e.g. process 0, which hosts it, is the one lost)."""
    import threading

    import jax
    from jax._src import distributed as jax_distributed

    client = jax_distributed.global_state.client
    if client is None:
        return None
    n, answer = jax.process_count(), {}

    def ask():
        with contextlib.suppress(Exception):  # the service is unreachable: no answer
            answer["live"] = client.get_live_nodes(list(range(n)))

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    thread.join(timeout)
    if "live" not in answer:
        return None
    return sorted(set(range(n)) - set(answer["live"]))


def _lost_peer_report() -> str:
    import jax

    me, heartbeat = jax.process_index(), timeouts()["heartbeat_timeout_seconds"]
    lost = lost_processes(heartbeat + 5.0)
    if lost:
        return (f"process {me}: lost process(es) {lost} of {jax.process_count()} (no heartbeat for "
                f"{heartbeat} s: died or stopped); stopping")
    if lost is None:
        return (f"process {me}: lost the coordination service (process 0 died or stopped, or the network "
                f"failed); stopping")
    return f"process {me}: a collective failed while every process is alive; stopping"


def _exit_now(code: int) -> None:
    """Exit without JAX's distributed shutdown: its barrier would wait for peers that may never
    arrive, so a failing process would hang instead of letting its launcher stop the run."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
