"""``python tests/support/script_runs.py SCRIPT OUT_DIR``: the experiment ``SCRIPT``
(``experiments/<SCRIPT>.py``) run as from the command line (``run_script``), once per line of stdin
(a JSON list: the run's arguments), one run after another in this one process: a later run reuses
what an earlier one compiled (a run's jitted train step, initialisation and evaluations are built
once per process for equal configs), as a notebook or a sweep would. The process is a script's, not
the test run's: its programs compile as a user's do (``tests/conftest.py`` sets the test run's
compile options, not its children's).

Run ``i`` (from 0) writes its stdout and stderr (file descriptors 1 and 2: also what XLA, absl and
orbax write there) to ``OUT_DIR/<i>.out`` and ``OUT_DIR/<i>.err``; then its exit status, what a
process of its own would have exited with (2 for a bad flag or run directory, 1 and the traceback
for an uncaught exception), is one line on stdout (its only line: whatever else is printed between
runs goes to stderr), and the next line of stdin is read."""

import contextlib
import importlib.util
import json
import os
import sys
import traceback

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


@contextlib.contextmanager
def _fds_to(out_path: str, err_path: str):
    """File descriptors 1 and 2 (and so ``sys.stdout`` / ``sys.stderr``) to these files meanwhile."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(out_path, "w") as out, open(err_path, "w") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def _exit_status(run) -> int:
    """The exit status of a process that would have run ``run()`` and exited (as ``sys.exit`` does)."""
    try:
        result = run()
    except SystemExit as e:
        return 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    except Exception:
        traceback.print_exc()
        return 1
    return result.get("returncode", 0) if isinstance(result, dict) else 0


def main(script: str, out_dir: str) -> None:
    replies = os.fdopen(os.dup(1), "w")  # the exit statuses; anything else on stdout between runs goes to stderr
    os.dup2(2, 1)
    path = os.path.join(ROOT, "experiments", f"{script}.py")
    spec = importlib.util.spec_from_file_location(f"_runs_{script}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.argv[0] = path
    for i, line in enumerate(iter(sys.stdin.readline, "")):
        argv = json.loads(line)
        with _fds_to(os.path.join(out_dir, f"{i}.out"), os.path.join(out_dir, f"{i}.err")):
            code = _exit_status(lambda argv=argv: module.run_script(module.main, module.parse_args, argv))
        print(code, file=replies, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
