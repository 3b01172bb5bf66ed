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

_initialized = False


def local_launch_env(coordinator: str, num_processes: int, process_id: int, local_devices: int) -> dict[str, str]:
    """The environment variables ``scripts/launch_local.py`` gives process ``process_id``."""
    return {
        ENV_COORDINATOR: coordinator,
        ENV_NUM_PROCESSES: str(num_processes),
        ENV_PROCESS_ID: str(process_id),
        ENV_LOCAL_DEVICES: str(local_devices),
    }


def launched_locally() -> bool:
    """Whether this process was started by the local launcher."""
    return ENV_COORDINATOR in os.environ


def initialize() -> None:
    """Join the multi-process runtime (idempotent; a no-op for a plain single-process run).

    Local launch: ``jax.distributed.initialize(coordinator, num_processes, process_id)`` with
    ``jax_num_cpu_devices`` simulated CPU devices and gloo collectives, all set before JAX
    creates its backends. TPU slice (``TPU_WORKER_HOSTNAMES`` lists more than one worker, or
    ``RINGSPLASH_TPU_MULTIHOST=1``): ``jax.distributed.initialize()`` from the TPU metadata.
    """
    global _initialized
    if _initialized:
        return
    import jax

    if launched_locally():
        from ringsplash._checks import check_positive_int

        num_processes = check_positive_int(ENV_NUM_PROCESSES, int(os.environ[ENV_NUM_PROCESSES]))
        process_id = int(os.environ[ENV_PROCESS_ID])
        if not 0 <= process_id < num_processes:
            raise ValueError(f"{ENV_PROCESS_ID}={process_id} must be in [0, {ENV_NUM_PROCESSES}={num_processes})")
        local_devices = check_positive_int(ENV_LOCAL_DEVICES, int(os.environ[ENV_LOCAL_DEVICES]))
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", local_devices)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(os.environ[ENV_COORDINATOR], num_processes=num_processes, process_id=process_id)
    elif _tpu_multihost():
        jax.distributed.initialize()
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
    except BaseException:
        traceback.print_exc()
        _exit_now(1)


def _exit_now(code: int) -> None:
    """Exit without JAX's distributed shutdown: its barrier would wait for peers that may never
    arrive, so a failing process would hang instead of letting its launcher stop the run."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
