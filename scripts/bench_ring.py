"""Ring attention benchmark tables (markdown): work balance, host metadata cost, compiled TPU
memory and a modelled step time.

    python scripts/bench_ring.py [--quick] [--skip-compile]

1. Critical-path work balance: Σ over ring steps of the busiest device's non-empty blocks,
   divided by (total non-empty blocks / N); 1.0 = perfectly balanced. S = 32K, blocks 512.
2. Host metadata (``ring_plan``: forward and transposed MaskInfo for all N x N shard pairs)
   time (median of runs, cold cache), the build's peak traced allocation (tracemalloc, numpy
   included) and the whole process's peak RSS (Python + JAX + libtpu baseline included),
   N = 8, causal, zigzag; each size in a fresh subprocess.
3. Compiled per-device TPU memory of forward + backward (libtpu, compiled from this CPU host:
   no TPU is used), bf16, 8 heads, d = 128, causal, zigzag, Mosaic kernels.
4. Modelled forward time: Σ over steps of the busiest device's active-block FLOPs
   (4 · bq · bkv · d · heads per block, partial blocks counted whole) / chip peak, vs one
   device running every active block of the unsharded mask. A model, not a measurement.
5. Memory model (``--max-context``): for a topology, the largest S whose ring forward +
   backward (causal, zigzag, 8 heads, d = 128, bf16, blocks 512, per-device schedule as a jit
   argument) compiles and fits the chip's HBM (args + out + temp + code - aliased), found by
   doubling then bisecting in multiples of 2N x 512; the same for single-device
   ``splash_attention``; per-device ring schedule bytes at S = 4M, N = 8; and the targets
   table. Each compile runs in a fresh subprocess.
"""

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes may hold libtpu

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np

import ringsplash as rs
from _bench import child_main, peak_rss_mib, run_child
from ringsplash import aot, layouts, masks
from ringsplash.parallel import ring_plan as ring_plan_lib
from ringsplash.splash.config import SplashConfig

M = 1024 * 1024

K = 1024
PEAK_BF16 = {"v5e": 197e12, "v6e": 918e12}  # FLOP/s per chip


def mask_of(kind: str, s: int):
    shape = (s, s)
    return {
        "causal": lambda: masks.CausalMask(shape),
        "local": lambda: masks.LocalMask(shape, window=(4096, 0)),
        "chunked": lambda: masks.ChunkedCausalMask(shape, chunk_size=4096),
    }[kind]()


def pair_work(mask, s: int, n: int, layout: str, block: int) -> np.ndarray:
    """Non-empty blocks of each (q shard, kv shard) pair, int64 [N, N]."""
    config = SplashConfig(block_q=block, block_kv=block, block_q_dkv=block, block_kv_dkv=block, backend="xla")
    return ring_plan_lib.ring_work(ring_plan_lib.ring_plan(mask, n, layout, config))


def table_balance(s=32 * K, block=512, ns=(4, 8, 16)):
    print(f"\n### Critical-path work balance (S = {s // K}K, blocks {block}; 1.00 = ideal)\n")
    print("| mask | layout | " + " | ".join(f"N = {n}" for n in ns) + " |")
    print("|---|---|" + "---:|" * len(ns))
    for kind in ("causal", "local", "chunked"):
        mask = mask_of(kind, s)
        for layout in layouts.LAYOUTS:
            cells = []
            for n in ns:
                work = pair_work(mask, s, n, layout, block)
                cells.append(f"{ring_plan_lib.critical_path(work) / (work.sum() / n):.3f}")
            print(f"| {kind} | {layout} | " + " | ".join(cells) + " |")


# ----------------------------------------------------------------------------------------
# host metadata: one fresh process per size


@child_main
def _metadata_child(s: int, n: int, runs: int) -> dict:
    import tracemalloc

    from ringsplash.parallel.ring_plan import ring_plan, ring_schedule

    config = SplashConfig(block_q=512, block_kv=512, block_q_dkv=512, block_kv_dkv=512, backend="auto")
    mask = masks.CausalMask((s, s))
    layouts.permutation("zigzag", s, n)  # the layout itself is not metadata
    base = int(peak_rss_mib() * 2**20)
    times = []
    for _ in range(runs):
        rs.clear_caches()
        t0 = time.perf_counter()
        plan = ring_plan(mask, n, "zigzag", config)
        # the per-device schedule in SMEM-sized pieces (v5e budget), as the ring runs it
        sched = ring_schedule(mask, n, "zigzag", config, heads=8, kv_heads=8, device_kind="TPU v5 lite")
        times.append(time.perf_counter() - t0)
    peak = int(peak_rss_mib() * 2**20)
    rs.clear_caches()
    del plan
    tracemalloc.start()
    plan = ring_plan(mask, n, "zigzag", config)  # numpy allocations are traced
    traced = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    nbytes = sum(a.nbytes for info in (plan.info, plan.info_dkv)
                 for a in (info.q_block, info.kv_block, info.kind, info.partial_index, info.num_active,
                           info.partial_mask_blocks))
    return dict(median=statistics.median(times), min=min(times), rss=peak, base=base, traced=traced, nbytes=nbytes,
                max_steps=plan.info.max_steps, sched_device=sched.nbytes_per_device,
                pieces=len(sched.fwd_pieces), pieces_dkv=len(sched.dkv_pieces))


def table_metadata(sizes, n=8, runs=5):
    print(f"\n### Host metadata: ring_plan (forward + dK/dV MaskInfo, all {n}x{n} shard pairs) + ring_schedule "
          f"(SMEM pieces, v5e budget), causal, zigzag, blocks 512\n")
    print("| S | median time (s) | min (s) | build peak alloc (MiB) | process peak RSS (MiB) "
          "| RSS before build (MiB) | MaskInfo arrays (MiB) | max_steps | schedule per device (MiB) | pieces fwd / dkv |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    results = {}
    for s in sizes:
        d = _metadata(s, n, runs)
        results[s] = d
        print(f"| {s // K}K | {d['median']:.3f} | {d['min']:.3f} | {d['traced'] / 2**20:.0f} | {d['rss'] / 2**20:.0f} "
              f"| {d['base'] / 2**20:.0f} | {d['nbytes'] / 2**20:.1f} | {d['max_steps']} "
              f"| {d['sched_device'] / 2**20:.1f} | {d['pieces']} / {d['pieces_dkv']} |")
    return results


# per process: a multi-host slice builds only its own devices' rows


@child_main
def _rows_child(s: int, n: int, runs: int) -> dict:
    from ringsplash.parallel import ring_plan as ring

    config = SplashConfig(block_q=512, block_kv=512, block_q_dkv=512, block_kv_dkv=512, backend="auto")
    mask = masks.CausalMask((s, s))
    layouts.permutation("zigzag", s, n)  # the layout itself is not metadata
    kw = dict(heads=8, kv_heads=8, device_kind="TPU v5 lite")
    cases = {  # what one process builds: the whole schedule (one host), or shapes + pieces + its rows
        "whole schedule (1 host)": lambda: ring.ring_schedule(mask, n, "zigzag", config, **kw),
        f"rows 0-{n // 2 - 1} (1 of 2 hosts)": lambda: ring.rows_schedule(
            mask, n, "zigzag", config, **kw, rows=tuple(range(n // 2))),
        "row 0 (1 of 8 hosts)": lambda: ring.rows_schedule(mask, n, "zigzag", config, **kw, rows=(0,)),
        "list-less plan only (shapes, pieces, active)": lambda: ring.rows_schedule(
            mask, n, "zigzag", config, **kw, rows=()),
    }
    out = {}
    for name, fn in cases.items():
        times = []
        for _ in range(runs):
            rs.clear_caches()
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            times.append((time.perf_counter() - t0, time.process_time() - c0))
        out[name] = times
    return out


def table_rows(s=4096 * K, n=8, runs=3):
    print(f"\n### Host metadata per process: ring_schedule at S = {s // K}K, N = {n} (causal, zigzag, blocks 512, "
          f"8 heads, forward + dK/dV views, SMEM pieces at the v5e budget), cold caches, {runs} runs\n")
    res = _child(["--rows-child", s, n, runs])
    print("| what one process builds | min (s) | median (s) | runs (s) | median CPU (s, both threads) |")
    print("|---|---:|---:|---|---:|")
    for name, runs_ in res.items():
        wall = [w for w, _ in runs_]
        print(f"| {name} | {min(wall):.2f} | {statistics.median(wall):.2f} | {', '.join(f'{t:.2f}' for t in wall)} "
              f"| {statistics.median(c for _, c in runs_):.2f} |")
    return res


def _metadata(s: int, n: int, runs: int) -> dict:
    return _child(["--metadata-child", s, n, runs])


def _child(args) -> dict:
    """This script's child ``args`` in a fresh process; its result, or an error if it failed."""
    r = run_child([__file__, *args], label="child")
    if isinstance(r, str):
        raise RuntimeError(f"{' '.join(map(str, args))}: {r}")
    return r


# ----------------------------------------------------------------------------------------
# compiled TPU memory


def table_tpu_memory(cases):
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from ringsplash import ring_attention_sharded

    heads, d = 8, 128
    print("\n### Compiled per-device TPU memory, forward + backward (libtpu AOT from CPU; bf16, 8 heads, d = 128, "
          "causal, zigzag)\n")
    print("| topology | N | S | temp (MiB) | args (MiB) | temp / local q | compile (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for topology, s in cases:
        mesh = aot.topology_mesh(topology, ("ctx",))
        n = mesh.size
        mask = masks.CausalMask((s, s))

        def fwd_bwd(q, k, v, do):
            fn = lambda q, k, v: ring_attention_sharded(q, k, v, mask, mesh=mesh,  # noqa: B023 (called at once) axis_name="ctx", layout="zigzag",
                                                        config=SplashConfig(backend="mosaic_tpu"))
            out, vjp = jax.vjp(fn, q, k, v)
            return out, vjp(do)

        spec = aot.abstract((heads, s, d), jnp.bfloat16, mesh, P(None, "ctx"))
        mem = aot.compile_report(fwd_bwd, spec, spec, spec, spec)
        local_q = heads * (s // n) * d * 2
        print(f"| {topology} | {n} | {s // K}K | {mem.temp / 2**20:.0f} | "
              f"{mem.args / 2**20:.0f} | {mem.temp / local_q:.1f} | {mem.seconds:.1f} |")


# ----------------------------------------------------------------------------------------
# modelled step time


def table_model(s=32 * K, block=512, heads=8, d=128, ns=(4, 8, 16)):
    flops_per_block = 4 * block * block * d * heads
    print(f"\n### Modelled forward time (S = {s // K}K, blocks {block}, {heads} heads, d = {d}; "
          f"busiest device per step, summed; a model, not a measurement)\n")
    print("| mask | layout | N | v5e ring (ms) | v5e 1 chip (ms) | speedup | ideal | v6e ring (ms) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for kind in ("causal", "local", "chunked"):
        mask = mask_of(kind, s)
        single = int(pair_work(mask, s, 1, "contiguous", block).sum())
        t1 = {c: single * flops_per_block / p * 1e3 for c, p in PEAK_BF16.items()}
        for layout in layouts.LAYOUTS:
            for n in ns:
                crit = ring_plan_lib.critical_path(pair_work(mask, s, n, layout, block))
                tr = {c: crit * flops_per_block / p * 1e3 for c, p in PEAK_BF16.items()}
                print(f"| {kind} | {layout} | {n} | {tr['v5e']:.2f} | {t1['v5e']:.2f} | "
                      f"{t1['v5e'] / tr['v5e']:.2f} | {n} | {tr['v6e']:.3f} |")


# ----------------------------------------------------------------------------------------
# memory model: largest S that compiles and fits (one subprocess per compile)


@child_main
def _compile_child(kind: str, topology: str, s: int) -> dict:
    """Compile ring (``kind="ring"``) or single-device splash (``"splash"``) fwd + bwd at S = s;
    its per-device memory (``ok`` false with the error's first line)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from ringsplash import ring_attention_sharded, ring_schedule, splash_attention

    heads, d = 8, 128
    devs = aot.topology_devices(topology)
    hbm = aot.chip(topology).hbm_bytes
    mask = masks.CausalMask((s, s))
    config = SplashConfig(backend="mosaic_tpu")
    t0 = time.perf_counter()
    sched_bytes = 0
    try:
        if kind == "ring":
            n = devs.size
            mesh = aot.topology_mesh(topology, ("ctx",))
            sched = ring_schedule(mask, n, "zigzag", config, heads=heads, kv_heads=heads, mesh=mesh, axis_name="ctx",
                                  shapes_only=True)
            sched_bytes = sum(int(np.prod(x.shape)) // n * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(sched))

            def fwd_bwd(q, k, v, do, sched):
                fn = lambda q, k, v: ring_attention_sharded(q, k, v, mask, mesh=mesh, axis_name="ctx", layout="zigzag",
                                                            config=config, schedule=sched)
                out, vjp = jax.vjp(fn, q, k, v)
                return out, vjp(do)

            spec = aot.abstract((heads, s, d), jnp.bfloat16, mesh, P(None, "ctx"))
            mem = aot.compile_report(fwd_bwd, spec, spec, spec, spec, sched)
        else:
            mesh = Mesh(devs[:1], ("x",))

            def fwd_bwd(q, k, v, do):
                out, vjp = jax.vjp(lambda q, k, v: splash_attention(q, k, v, mask, config=config), q, k, v)
                return out, vjp(do)

            spec = aot.abstract((heads, s, d), jnp.bfloat16, mesh, P())
            mem = aot.compile_report(fwd_bwd, spec, spec, spec, spec)
    except Exception as e:  # a failed compile is a result here
        msg = next((line for line in str(e).splitlines() if "memory" in line.lower()), str(e).splitlines()[0])
        return dict(ok=False, error=msg[:200], seconds=time.perf_counter() - t0)
    total = mem.total  # args + out + temp + code - aliased
    return dict(ok=total <= hbm, fits=total <= hbm, temp=mem.temp, args=mem.args, out=mem.out, total=total, hbm=hbm,
                sched=sched_bytes, seconds=time.perf_counter() - t0)


_COMPILED: dict = {}


def _compile(kind: str, topology: str, s: int) -> dict:
    """``_compile_child`` in a fresh process (memoised per run)."""
    if (kind, topology, s) in _COMPILED:
        return _COMPILED[kind, topology, s]
    _COMPILED[kind, topology, s] = r = _compile_process(kind, topology, s)
    return r


def _compile_process(kind: str, topology: str, s: int) -> dict:
    r = run_child([__file__, "--compile-child", kind, topology, s])
    return r if isinstance(r, dict) else dict(ok=False, error=r, seconds=0.0)


def max_context(kind: str, topology: str, start: int, granularity: int, *, rel_tol: float = 0.25,
                log=print) -> tuple[int, dict, list]:
    """Largest multiple of ``granularity`` that compiles and fits: double from ``start`` (which
    must fit) until a failure, then bisect until hi / lo <= 1 + rel_tol. Returns (S, its
    memory dict, [(S, ok) tried])."""
    tried = []

    def attempt(s):
        r = _compile(kind, topology, s)
        tried.append((s, r["ok"]))
        log(f"  [{kind} {topology}] S={s} ({s / M:.3f}M): {'ok' if r['ok'] else 'FAIL ' + r.get('error', 'HBM')}"
            f" ({r['seconds']:.0f} s)")
        return r

    best = attempt(start)
    if not best["ok"]:
        return 0, best, tried
    lo, hi = start, None
    while hi is None:
        r = attempt(2 * lo)
        if r["ok"]:
            lo, best = 2 * lo, r
        else:
            hi = 2 * lo
    while hi / lo > 1 + rel_tol:
        mid = (lo + hi) // 2 // granularity * granularity
        if mid in (lo, hi):
            break
        r = attempt(mid)
        if r["ok"]:
            lo, best = mid, r
        else:
            hi = mid
    return lo, best, tried


def _gib(x) -> str:
    return f"{x / 2**30:.2f}"


def table_memory_model(metadata_4m: dict | None, *, rel_tol: float = 0.25):
    """The targets (fixed sizes first, each row printed as soon as it is compiled), then
    the max-context searches, then the targets table."""
    print("\n### Memory model (causal zigzag ring / single-device splash, fwd + bwd, 8 heads, d = 128, bf16, "
          "blocks 512; libtpu AOT from CPU; fits = args + out + temp + code - aliased <= HBM)\n")
    checks = [("ring", "v5e:2x2", 1024 * K), ("splash", "v5e:2x2", 256 * K), ("ring", "v5e:4x4", 4096 * K)]
    fixed = {}
    for c in checks:
        fixed[c] = r = _compile(*c)
        print(f"  fixed {c}: {r}", flush=True)
    # starts: sizes known to fit, so the search spends its (minutes-long) compiles near the limit
    cases = [("ring", "v5e:2x2", 4, 1024 * K), ("ring", "v6e:2x4", 8, 2048 * K), ("splash", "v5e:2x2", 1, 256 * K)]
    rows = []
    for kind, topology, n, start in cases:
        granularity = 2 * n * 512 if kind == "ring" else 512
        s, mem, tried = max_context(kind, topology, start, granularity, rel_tol=rel_tol,
                                    log=lambda *a: print(*a, flush=True))
        rows.append((kind, topology, n, s, mem, tried))
    print("\n| what | topology | N | max S found | per-device temp / args / out (GiB) | HBM (GiB) | tried |")
    print("|---|---|---:|---:|---|---:|---|")
    for kind, topology, n, s, mem, tried in rows:
        tries = ", ".join(f"{t // K}K{'' if ok else '✗'}" for t, ok in tried)
        where = topology if kind == "ring" else "one chip of " + topology
        sizes = (f"{_gib(mem['temp'])} / {_gib(mem['args'])} / {_gib(mem['out'])} | {_gib(mem['hbm'])}"
                 if "temp" in mem else f"— ({mem.get('error', '?')}) | —")
        print(f"| {kind} fwd+bwd | {where} | {n} | {s:,} | {sizes} | {tries} |")
    found = {topology: s for kind, topology, n, s, mem, tried in rows if kind == "ring"}
    today = 512 * K  # largest ring S compiling on main on v5e:2x2 (1M hit the SMEM wall)
    print("\n### Targets\n")
    print("| what | topology | target | measured | met |")
    print("|---|---|---|---|---|")
    for (kind, topology, s), r in fixed.items():
        what = "ring fwd+bwd, causal zigzag, 8 heads, d 128, bf16" if kind == "ring" else "single-device splash fwd+bwd"
        got = (f"compiles; temp / args / out {_gib(r['temp'])} / {_gib(r['args'])} / {_gib(r['out'])} GiB, total "
               f"{_gib(r['total'])} of {_gib(r['hbm'])} GiB" if "temp" in r else f"fails: {r['error']}")
        where = topology if kind == "ring" else "one chip of " + topology
        print(f"| {what} | {where} | S = {s:,} compiles and fits | {got} | {'yes' if r['ok'] else 'NO'} |")
    for topology in ("v5e:2x2", "v6e:2x4"):
        s = found[topology]
        print(f"| same, max S found by the bench | {topology} | >= 2 x {today:,} | {s:,} ({s / today:.2f}x) | "
              f"{'yes' if s >= 2 * today else 'NO'} |")
    if metadata_4m is not None:
        sched = metadata_4m["sched_device"]
        limit = 385 * M / 8 * 1.1
        print(f"| per-device ring schedule at S = 4M, N = 8 | — | <= 385 MiB / 8 (+10%) = {limit / M:.1f} MiB | "
              f"{sched / M:.1f} MiB | {'yes' if sched <= limit else 'NO'} |")
        t = metadata_4m["median"]
        print(f"| ring host metadata (plan + schedule) at S = 4M, N = 8 | this CPU (shared, loaded) | <= 3 s | "
              f"{t:.2f} s (median) | {'yes' if t <= 3 else 'NO'} |")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--quick", action="store_true", help="skip the 4M metadata size and the 16K compiles")
    p.add_argument("--skip-compile", action="store_true", help="skip the libtpu compiles")
    p.add_argument("--max-context", action="store_true",
                   help="only the memory model: max S that compiles and fits, and the targets")
    p.add_argument("--rel-tol", type=float, default=0.25, help="bisection stops when hi / lo <= 1 + rel_tol (default: %(default)s)")
    p.add_argument("--rows", action="store_true", help="only the per-process host metadata table (S = 4M, N = 8)")
    p.add_argument("--metadata-child", nargs=3, type=int, help=argparse.SUPPRESS)
    p.add_argument("--rows-child", nargs=3, type=int, help=argparse.SUPPRESS)
    p.add_argument("--compile-child", nargs=3, help=argparse.SUPPRESS)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.metadata_child:
        _metadata_child(*args.metadata_child)
        return
    if args.rows_child:
        _rows_child(*args.rows_child)
        return
    if args.rows:
        table_rows()
        return
    if args.compile_child:
        kind, topology, s = args.compile_child
        _compile_child(kind, topology, int(s))
        return
    if args.max_context:
        meta = table_metadata([4096 * K], runs=3)[4096 * K]
        table_memory_model(meta, rel_tol=args.rel_tol)
        return
    table_balance()
    table_metadata([128 * K, 1024 * K] + ([] if args.quick else [4096 * K]))
    if not args.quick:
        table_rows()
    if not args.skip_compile:
        cases = [("v5e:2x2", 32 * K), ("v6e:2x4", 32 * K)]
        if not args.quick:
            cases += [("v5e:2x2", 64 * K), ("v6e:2x4", 64 * K)]
        table_tpu_memory(cases)
    table_model()


if __name__ == "__main__":
    main()
