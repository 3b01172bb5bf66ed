"""What the benchmark scripts share: one child-process protocol, timing, formatting.

A benchmark that needs a fresh process per row (peak RSS, a compile that may exhaust memory or
hang) re-runs its own file with a hidden flag; the child's entry is decorated with
:func:`child_main` and prints its result as one JSON line, which :func:`run_child` reads back:

    @child_main
    def compile_child(s: int) -> dict: ...

    result = run_child([__file__, "--child", str(s)], timeout=600)  # dict, or why it failed (str)
"""

import functools
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time

__all__ = ["LOG_DIR", "child_main", "fmt_bytes", "fmt_tokens", "md_table", "median_of", "open_log", "peak_rss_mib",
           "run_child"]

#: where the TPU benchmarks append their JSON lines by default (ignored by git, as every run's output under runs/)
LOG_DIR = os.path.join("runs", "bench")


def open_log(path: str):
    """``path`` opened for appending, its folder made first."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    return open(path, "a")


def child_main(fn):
    """Make ``fn`` (returning a JSON-able dict) print its result as the last line of stdout."""

    @functools.wraps(fn)
    def main(*args, **kwargs):
        result = fn(*args, **kwargs)
        print(json.dumps(result), flush=True)
        return result

    return main


def _reason(stderr: str, label: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    err = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln), lines[-1] if lines else "?")
    return f"{label} failed: {err.strip()[:200]}"


def _timed_out_under(stored, timeout) -> bool:
    """A cached timeout that a longer ``timeout`` should retry."""
    m = re.search(r"timed out after (\d+) s", stored) if isinstance(stored, str) else None
    return bool(m) and timeout is not None and int(m.group(1)) < timeout


def run_child(argv, timeout: float | None = None, cache: str | None = None, *, key: str | None = None,
              env: dict | None = None, label: str = "compile") -> dict | str:
    """Run ``python *argv`` in a fresh process; its last JSON line (a dict), or why it gave none
    (a str: ``"<label> timed out after T s on this CPU host"`` / ``"<label> failed: <error>"``).

    ``cache``: a JSON file of results by ``key`` (default: the arguments), failures included
    (they are deterministic); a cached timeout is retried only under a longer ``timeout``.
    ``env``: variables added to this process's environment."""
    argv = [str(a) for a in argv]
    key = key if key is not None else " ".join(argv[1:])
    stored = {}
    if cache and os.path.exists(cache):
        with open(cache) as f:
            stored = json.load(f)
    if key in stored and not _timed_out_under(stored[key], timeout):
        return stored[key]
    try:
        r = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout,
                           env=None if env is None else {**os.environ, **env})
    except subprocess.TimeoutExpired:
        r = None
    lines = [ln for ln in (r.stdout if r is not None else "").strip().splitlines() if ln.startswith("{")]
    if r is None:
        result = f"{label} timed out after {timeout} s on this CPU host"
    elif r.returncode or not lines:
        result = _reason(r.stderr, label)
    else:
        result = json.loads(lines[-1])
    if cache:
        stored[key] = result
        with open(cache, "w") as f:
            json.dump(stored, f, indent=1)
    return result


def peak_rss_mib() -> float:
    """This process's peak resident set size so far (MiB): Linux's VmHWM, the peak of this process
    image alone (``ru_maxrss`` keeps the parent's RSS from before ``exec`` in a child); elsewhere
    ``ru_maxrss``."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def median_of(fn, repeats: int) -> tuple[float, list[float]]:
    """(median, all) wall seconds of ``repeats`` calls of ``fn()``."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def fmt_bytes(n: float, unit: str = "GiB", digits: int = 2) -> str:
    """``n`` bytes in ``unit`` (KiB, MiB or GiB), number only: ``fmt_bytes(3 << 29) == "1.50"``."""
    return f"{n / 1024 ** ('KiB', 'MiB', 'GiB').index(unit) / 1024:.{digits}f}"


def fmt_tokens(n: int) -> str:
    """A sequence length in K / M tokens (binary): 32768 -> "32K", 1 << 20 -> "1M"."""
    return f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}K"


def md_table(rows, columns) -> str:
    """A markdown table of ``rows`` (sequences or dicts keyed by column). A column is a header,
    right-aligned when it ends with ":" (the colon is dropped)."""
    heads = [c.rstrip(":") for c in columns]
    rule = ["---:" if c.endswith(":") else "---" for c in columns]
    cells = lambda row: [row[h] for h in heads] if isinstance(row, dict) else list(row)
    lines = ["| " + " | ".join(heads) + " |", "|" + "|".join(rule) + "|"]
    lines += ["| " + " | ".join(str(c) for c in cells(row)) + " |" for row in rows]
    return "\n".join(lines)
