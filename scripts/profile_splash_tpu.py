"""Profile Splash attention on a TPU chip: where the device time of one call goes, op by op.

Each row (the rows of ``bench_splash_tpu.py``: ``mask:S:fwd|bwd[:d=N][:group=G]``) runs ``--repeats`` times
under ``jax.profiler.trace`` for ringsplash's default config (``--set`` overrides ``SplashConfig`` fields)
and, with ``--peer``, JAX's splash at the given blocks. The Perfetto trace is read back and the device ops
are printed by total time per call: the Pallas kernels by name (``splash_fwd``, ``splash_fused_bwd``, ...)
beside XLA's own ops (work-list refinement, transposes, reductions).

    python scripts/profile_splash_tpu.py --rows docs:32768:fwd,local:32768:fwd --peer 1024,1024,512
    python scripts/profile_splash_tpu.py --rows docs:32768:fwd --set segment_skipping=false

It refuses to run without a TPU.
"""

import argparse
import bisect
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile

import jax

import bench_splash_tpu as bench


def device_op_times(trace_dir: str, calls: int) -> list[tuple[str, float, int]]:
    """``(op name, ms per call, occurrences per call)`` of the device ops in the Perfetto trace under
    ``trace_dir``, longest first (ops of the TPU processes' "XLA Ops" threads, else every TPU thread;
    each op's own time, without the ops nested in it). Where the trace has an "XLA Modules" thread, an op's
    name is prefixed by its program's (``jit__steps | fusion.12``): HLO names repeat across programs, so a
    prefill's ``fusion.12`` and a decode step's are counted apart."""
    paths = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
    with gzip.open(paths[0]) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    tpu = {pid for pid, name in procs.items() if "TPU" in name and "CPU" not in name}
    ops_threads = {key for key, name in threads.items() if key[0] in tpu and "XLA Ops" in name}
    module_threads = {key for key, name in threads.items() if key[0] in tpu and "XLA Modules" in name}
    modules = collections.defaultdict(list)  # pid -> sorted (start, end, program name)
    for e in events:
        if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in module_threads:
            name = re.sub(r"\(\d+\)$", "", e["name"])  # "jit__steps(123)": the run's id dropped
            modules[e["pid"]].append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), name))
    for spans in modules.values():
        spans.sort()
    if not ops_threads:
        print(f"no 'XLA Ops' thread; every TPU thread counted: {sorted(set(threads.values()))}", file=sys.stderr)
    per_thread = collections.defaultdict(list)
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in tpu:
            continue
        if ops_threads and (e["pid"], e.get("tid")) not in ops_threads:
            continue
        per_thread[(e["pid"], e.get("tid"))].append(e)
    total, count = collections.Counter(), collections.Counter()
    for (pid, _), thread_events in per_thread.items():
        for name, us in self_times(thread_events, modules.get(pid, [])):
            total[name] += us
            count[name] += 1
    return [(name, us / 1e3 / calls, count[name] / calls) for name, us in total.most_common()]


def self_times(events: list[dict], programs=()) -> list[tuple[str, float]]:
    """``(name, microseconds)`` of one thread's events, each less the events nested in it (a ``while``
    op's span holds its body's ops: counting both would count the body twice); ``programs``: sorted ``(start,
    end, name)`` spans, the name of the one holding an event's start prefixed to the event's."""
    starts = [start for start, _, _ in programs]

    def named(e) -> str:
        i = bisect.bisect_right(starts, float(e["ts"])) - 1
        inside = i >= 0 and float(e["ts"]) < programs[i][1]
        return f"{programs[i][2]} | {e['name']}" if inside else e["name"]

    spans = sorted(((float(e["ts"]), float(e.get("dur", 0.0)), named(e)) for e in events),
                   key=lambda t: (t[0], -t[1]))
    own = [dur for _, dur, _ in spans]
    stack: list[int] = []  # indices of the open spans enclosing the current one
    for i, (start, dur, _) in enumerate(spans):
        while stack and spans[stack[-1]][0] + spans[stack[-1]][1] <= start:
            stack.pop()
        if stack:
            own[stack[-1]] -= dur
        stack.append(i)
    return [(name, max(us, 0.0)) for (_, _, name), us in zip(spans, own)]


def profile(label: str, fn, args, repeats: int, top: int):
    jax.block_until_ready(fn(*args))  # compile outside the trace
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            for _ in range(repeats):
                jax.block_until_ready(fn(*args))
        ops = device_op_times(tmp, repeats)
    print(f"\n{label}: device total {sum(ms for _, ms, _ in ops):.2f} ms per call")
    print("| op | ms per call | per call |\n|---|---|---|")
    for name, ms, n in ops[:top]:
        print(f"| {name[:90]} | {ms:.3f} | {n:g} |")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--rows", default="causal:32768:fwd,local:32768:fwd,docs:32768:fwd",
                        help="mask:S:fwd|bwd[:d=N][:group=G], comma-separated (default %(default)s)")
    parser.add_argument("--set", dest="overrides", help="SplashConfig overrides for ringsplash, key=value,...")
    parser.add_argument("--peer", help="also profile JAX's splash at these blocks: bq,bkv,bkv_compute[,bq_dkv,bkv_dkv]")
    parser.add_argument("--repeats", type=int, default=5, help="traced calls per profile (times are per call)")
    parser.add_argument("--top", type=int, default=12, help="ops printed per profile")
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if jax.devices()[0].platform != "tpu":
        sys.exit(f"profile_splash_tpu.py profiles TPU kernels; this process sees {jax.devices()[0].platform!r} devices")
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    overrides = bench.parse_overrides(args.overrides)
    for row in bench.parse_rows(args.rows):
        q, k, v, do = bench.inputs(row)
        call_args = (q, k, v, do) if row.bwd else (q, k, v)
        fn = bench.with_grad(bench.ringsplash_fn(row, None, overrides), row.bwd)
        profile(f"{row.label} ringsplash {overrides or 'default'}", fn, call_args, args.repeats, args.top)
        if args.peer:
            cand = tuple(int(x) for x in args.peer.split(","))
            profile(f"{row.label} jax {list(cand)}", bench.with_grad(bench.jax_fn(row, cand), row.bwd), call_args,
                    args.repeats, args.top)


if __name__ == "__main__":
    main()
