"""Run any experiment or script as P JAX processes on this machine, as on a multi-host slice.

    python scripts/launch_local.py --processes 2 --devices 2 experiments/train_long_context.py -- --steps 50

Each process joins the coordinator on localhost through ``python -m ringsplash.distributed``
(the entry point ``scripts/tpu/launch.py`` uses on a pod slice) with ``--devices`` simulated CPU
devices and gloo collectives, so a mesh spans ``processes x devices`` devices across process
boundaries. Output lines are forwarded with a ``[pN]`` prefix. When any process fails, the
others are stopped and the launcher exits with that process's code.

No process outlives the launcher: each worker leads a process group of its own (its children
included), and on every way out (the workers done, one failing, ``--timeout``, SIGTERM as from
``timeout`` or ``kill``, SIGINT / Ctrl-C, SIGHUP) the launcher sends SIGTERM to every group that
still has a process, then SIGKILL to what is left after ``GRACE_S`` seconds, and exits (128 + the
signal's number when a signal stopped it). Workers honour SIGTERM: ``ringsplash.distributed``
turns off JAX's preemption service in a local launch, whose SIGTERM handler would otherwise
record a preemption notice and keep running. (SIGKILL of the launcher itself cannot be caught:
then stop the workers by their process groups, ``kill -- -PID``.)

A process that dies or stops (killed, SIGSTOP, a hung host) stops sending heartbeats: after
``--heartbeat-timeout`` seconds (default 30) the coordination service declares it lost, and the
others exit with a message naming it (``ringsplash.distributed``); the launcher then stops the
rest and says which processes were stopped rather than dead.
"""

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from ringsplash.distributed import HEARTBEAT_TIMEOUT, inherited_xla_flags, local_launch_env

GRACE_S = 5.0  # between SIGTERM and SIGKILL when stopping the other processes


def free_port(preferred: int | None = None) -> int:
    """``preferred`` if it can be bound on localhost, else a free port chosen by the OS."""
    if preferred is not None:
        with socket.socket() as s:
            try:
                s.bind(("localhost", preferred))
                return preferred
            except OSError:
                print(f"[launch_local] port {preferred} is in use; picking another", file=sys.stderr, flush=True)
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--processes", type=int, default=2, help="JAX processes to start (default 2)")
    parser.add_argument("--devices", type=int, default=2, help="simulated CPU devices per process (default 2)")
    parser.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    parser.add_argument("--timeout", type=float, default=None, help="stop everything after this many seconds (default: none)")
    parser.add_argument("--heartbeat-timeout", type=int, default=HEARTBEAT_TIMEOUT,
                        help="seconds without a heartbeat after which a process counts as lost (died or stopped) "
                             f"and the others stop, naming it (default {HEARTBEAT_TIMEOUT})")
    parser.add_argument("script", help="the experiment or script to run, e.g. experiments/train_long_context.py")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments (after --)")
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.script_args and args.script_args[0] == "--":
        args.script_args = args.script_args[1:]
    for name in ("processes", "devices"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name} must be a positive int, got {getattr(args, name)}")
    return args


def _forward(stream, prefix: str, out) -> None:
    for line in iter(stream.readline, ""):
        out.write(f"{prefix}{line}")
        out.flush()
    stream.close()


def _group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` still has a process (a zombie not yet reaped counts)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of another user took the id: not ours to signal
        return False
    return True


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _stop(procs: list[subprocess.Popen], hurry=lambda: False) -> None:
    """Stop every worker's process group (the worker and whatever it started): SIGTERM (and SIGCONT,
    so a stopped process can act on it), then SIGKILL to the groups still there after ``GRACE_S``
    seconds, or at once when ``hurry()`` turns true (a second signal to the launcher)."""
    groups = [p.pid for p in procs]  # each worker leads a process group of its own id (launch)
    for p in procs:
        p.poll()  # reap the workers that are done, so that their groups can empty
    live = [g for g in groups if _group_alive(g)]
    for g in live:
        _signal_group(g, signal.SIGTERM)
        _signal_group(g, signal.SIGCONT)
    deadline = time.monotonic() + GRACE_S
    while live and time.monotonic() < deadline and not hurry():
        time.sleep(0.05)
        for p in procs:
            p.poll()
        live = [g for g in live if _group_alive(g)]
    for g in live:
        _signal_group(g, signal.SIGKILL)
    for p in procs:
        p.wait()


def _is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (state T in /proc; False where /proc is absent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


#: signals that stop the launcher and, through it, every worker (SIGKILL cannot be caught)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _record_stop_signals(received: list[int]) -> dict:
    """From now on ``STOP_SIGNALS`` delivered to the launcher are appended to ``received`` (the loop
    below acts on them) instead of ending it before it could stop its workers; the handlers they
    replace (to restore). A handler that only records is safe at any point (never mid-``Popen``,
    where an exception would lose a child). Signal handlers are the main thread's only."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.signal(s, lambda signum, frame: received.append(signum)) for s in STOP_SIGNALS}


def launch(args) -> int:
    port = free_port(args.port)
    coordinator = f"localhost:{port}"
    env = {**os.environ, "XLA_FLAGS": inherited_xla_flags(os.environ.get("XLA_FLAGS")),
           "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    # libtpu (the tpu extra) probes for TPU metadata on import; on a CPU host there is none
    env.setdefault("TPU_SKIP_MDS_QUERY", "1")
    env.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    procs, threads, received = [], [], []
    print(f"[launch_local] {args.processes} processes x {args.devices} CPU devices, coordinator {coordinator}",
          flush=True)
    previous = _record_stop_signals(received)
    try:
        for i in range(args.processes):
            if received:
                break
            penv = {**env, **local_launch_env(coordinator, args.processes, i, args.devices,
                                              heartbeat_timeout=args.heartbeat_timeout)}
            cmd = [sys.executable, "-m", "ringsplash.distributed", args.script, "--", *args.script_args]
            # a process group of its own: the whole group can be stopped, children included
            p = subprocess.Popen(cmd, env=penv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 start_new_session=True)
            procs.append(p)
            t = threading.Thread(target=_forward, args=(p.stdout, f"[p{i}] ", sys.stdout), daemon=True)
            t.start()
            threads.append(t)
        start = time.monotonic()
        while True:
            if received:
                print(f"[launch_local] {signal.Signals(received[0]).name} received; stopping every process",
                      flush=True)
                _stop(procs, hurry=lambda: len(received) > 1)
                return 128 + received[0]
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i, code = failed[0]
                stopped = [j for j, p in enumerate(procs) if codes[j] is None and _is_stopped(p.pid)]
                print(f"[launch_local] process {i} exited with code {code}"
                      + (f" (process(es) {stopped} are stopped: SIGSTOP / suspended)" if stopped else "")
                      + "; stopping the others", flush=True)
                _stop(procs, hurry=lambda: bool(received))
                return code if code > 0 else 1
            if all(c == 0 for c in codes):
                return 0
            if args.timeout is not None and time.monotonic() - start > args.timeout:
                print(f"[launch_local] timeout after {args.timeout:.0f} s; stopping every process", flush=True)
                _stop(procs, hurry=lambda: bool(received))
                return 124
            time.sleep(0.05)
    except KeyboardInterrupt:  # SIGINT where the handlers are not ours (launch() off the main thread)
        print("[launch_local] interrupted; stopping every process", flush=True)
        _stop(procs)
        return 130
    finally:
        _stop(procs, hurry=lambda: bool(received))  # the normal exit too: a worker's children go with it
        for s, handler in previous.items():
            signal.signal(s, handler)
        for t in threads:
            t.join(timeout=1.0)


def main(argv=None) -> int:
    return launch(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
