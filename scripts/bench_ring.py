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
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")

import numpy as np

from ringsplash import build_mask_info, layouts, masks
from ringsplash.splash.config import SplashConfig

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
    perm = layouts.permutation(layout, s, n)
    info = build_mask_info(mask, (block, block), q_shards=n, kv_shards=n, q_positions=perm, kv_positions=perm)
    return np.asarray(info.num_active, np.int64).sum(0)


def critical_path(work: np.ndarray) -> int:
    """Σ_t max_a work[a, (a - t) mod N]: device a holds kv shard (a - t) mod N at step t."""
    n = work.shape[0]
    a = np.arange(n)
    return int(sum(work[a, (a - t) % n].max() for t in range(n)))


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
                cells.append(f"{critical_path(work) / (work.sum() / n):.3f}")
            print(f"| {kind} | {layout} | " + " | ".join(cells) + " |")


# ----------------------------------------------------------------------------------------
# host metadata: one fresh process per size


def _metadata_child(s: int, n: int, runs: int) -> None:
    import resource
    import tracemalloc

    from ringsplash.parallel.ring import _ring_plan, ring_plan

    config = SplashConfig(block_q=512, block_kv=512, block_q_dkv=512, block_kv_dkv=512, backend="auto")
    mask = masks.CausalMask((s, s))
    layouts.permutation("zigzag", s, n)  # the layout itself is not metadata
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = []
    for _ in range(runs):
        build_mask_info.cache_clear()
        _ring_plan.cache_clear()
        t0 = time.perf_counter()
        plan = ring_plan(mask, n, "zigzag", config)
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    build_mask_info.cache_clear()
    _ring_plan.cache_clear()
    del plan
    tracemalloc.start()
    plan = ring_plan(mask, n, "zigzag", config)  # numpy allocations are traced
    traced = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    nbytes = sum(a.nbytes for info in (plan.info, plan.info_dkv)
                 for a in (info.q_block, info.kv_block, info.kind, info.partial_index, info.num_active,
                           info.partial_mask_blocks))
    print(json.dumps(dict(median=statistics.median(times), min=min(times), rss=peak, base=base, traced=traced, nbytes=nbytes,
                          max_steps=plan.info.max_steps)))


def table_metadata(sizes, n=8, runs=5):
    print(f"\n### Host metadata: ring_plan (forward + dK/dV MaskInfo, all {n}x{n} shard pairs), causal, zigzag, "
          f"blocks 512\n")
    print("| S | median time (s) | min (s) | build peak alloc (MiB) | process peak RSS (MiB) "
          "| RSS before build (MiB) | MaskInfo arrays (MiB) | max_steps |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for s in sizes:
        r = subprocess.run([sys.executable, __file__, "--metadata-child", str(s), str(n), str(runs)],
                           capture_output=True, text=True, check=True)
        d = json.loads(r.stdout.strip().splitlines()[-1])
        print(f"| {s // K}K | {d['median']:.3f} | {d['min']:.3f} | {d['traced'] / 2**20:.0f} | {d['rss'] / 2**20:.0f} "
              f"| {d['base'] / 2**20:.0f} | {d['nbytes'] / 2**20:.1f} | {d['max_steps']} |")


# ----------------------------------------------------------------------------------------
# compiled TPU memory


def table_tpu_memory(cases):
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from ringsplash.parallel.ring import ring_attention_sharded

    heads, d = 8, 128
    print("\n### Compiled per-device TPU memory, forward + backward (libtpu AOT from CPU; bf16, 8 heads, d = 128, "
          "causal, zigzag)\n")
    print("| topology | N | S | temp (MiB) | args (MiB) | temp / local q | compile (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for topology, s in cases:
        topo = topologies.get_topology_desc(topology, "tpu")
        devs = np.asarray(topo.devices)
        n = devs.size
        mesh = Mesh(devs.reshape(n), ("ctx",))
        mask = masks.CausalMask((s, s))

        def fwd_bwd(q, k, v, do):
            fn = lambda q, k, v: ring_attention_sharded(q, k, v, mask, mesh=mesh,  # noqa: B023 (called at once) axis_name="ctx", layout="zigzag",
                                                        config=SplashConfig(backend="mosaic_tpu"))
            out, vjp = jax.vjp(fn, q, k, v)
            return out, vjp(do)

        spec = jax.ShapeDtypeStruct((heads, s, d), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "ctx")))
        t0 = time.perf_counter()
        mem = jax.jit(fwd_bwd).lower(spec, spec, spec, spec).compile().memory_analysis()
        dt = time.perf_counter() - t0
        local_q = heads * (s // n) * d * 2
        print(f"| {topology} | {n} | {s // K}K | {mem.temp_size_in_bytes / 2**20:.0f} | "
              f"{mem.argument_size_in_bytes / 2**20:.0f} | {mem.temp_size_in_bytes / local_q:.1f} | {dt:.1f} |")


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
                crit = critical_path(pair_work(mask, s, n, layout, block))
                tr = {c: crit * flops_per_block / p * 1e3 for c, p in PEAK_BF16.items()}
                print(f"| {kind} | {layout} | {n} | {tr['v5e']:.2f} | {t1['v5e']:.2f} | "
                      f"{t1['v5e'] / tr['v5e']:.2f} | {n} | {tr['v6e']:.3f} |")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="skip the 4M metadata size and the 16K compiles")
    p.add_argument("--skip-compile", action="store_true", help="skip the libtpu compiles")
    p.add_argument("--metadata-child", nargs=3, type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.metadata_child:
        _metadata_child(*args.metadata_child)
        return
    table_balance()
    table_metadata([128 * K, 1024 * K] + ([] if args.quick else [4096 * K]))
    if not args.skip_compile:
        cases = [("v5e:2x2", 32 * K), ("v6e:2x4", 32 * K)]
        if not args.quick:
            cases += [("v5e:2x2", 64 * K), ("v6e:2x4", 64 * K)]
        table_tpu_memory(cases)
    table_model()


if __name__ == "__main__":
    main()
