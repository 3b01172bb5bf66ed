"""Context-parallel strategy table: ring, all-gather, Ulysses and USP on the same Splash kernels.

    python scripts/bench_context_parallel.py [--seq 128K,1M] [--devices 8,16,64] [--no-compile]
        [--timeout 600] [--peak-tflops 459] [--link-gbs 90]

For each (S, N), 32 q heads / 8 kv heads, d = 128, causal, zigzag, bf16, blocks 512, per
strategy (USP: the (ulysses, ring) factorisation with the smallest modelled time):

* per-device bytes communicated per attention call, forward and backward, computed
  analytically from the algorithm, and counted from the collectives of the program compiled
  for the TPU topology with libtpu (loops multiplied by their known trip counts; all-gather /
  all-to-all / reduce-scatter count the (g - 1) / g of the data that crosses devices, an
  all-reduce 2 (g - 1) / g, a collective permute its whole buffer); the two must agree within
  10%. The all-gather backward's reduce-scatter of dK/dV is lowered by libtpu as an
  all-reduce + slice (twice the bytes), and on v5p:4x4x4 (64 chips) the forward all-gather
  too, as an all-reduce of a zero-padded buffer (read from the compiled HLO); the analytic
  model counts both that way;
* per-device compiled temp memory of forward + backward;
* critical-path active-block work: the busiest device's non-empty 512 x 512 blocks summed
  over heads (and over ring steps, taking the busiest device at each step);
* a modelled step time (forward + backward): compute = critical work x 4 x 512^2 x d FLOPs
  (backward 3.5x: the dq and dK/dV kernels recompute the scores) / peak FLOP/s;
  communication = bytes / link bandwidth; ring transfers overlap the kernels (max), the
  all-gather / all-to-all collectives do not (sum). A model, not a measurement.

Topologies: v5p:2x2x2 (8 chips), v5p:2x2x4 (16), v5p:4x4x4 (64). Every compile runs in a
fresh subprocess with a timeout; a row that does not compile prints the reason. ``--cache FILE``
keeps each compiled row's counts or failure (JSON, keyed by strategy, S, N, Ulysses degree), so
a rerun only compiles what is missing (and a timed-out row again when ``--timeout`` is longer).
"""

import argparse
import os
import re
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np

from _bench import child_main, fmt_tokens, run_child
from ringsplash import aot, masks
from ringsplash.parallel.heads import valid_ulysses_degrees
from ringsplash.parallel.ring_plan import critical_path, ring_plan, ring_work
from ringsplash.splash.config import SplashConfig

K = 1024
HEADS, KV_HEADS, D, BLOCK, BYTES = 32, 8, 128, 512, 2  # bf16
TOPOLOGY = {8: "v5p:2x2x2", 16: "v5p:2x2x4", 64: "v5p:4x4x4"}
STRATEGIES = ("ring", "allgather", "ulysses", "usp")
#: libtpu lowers the dK/dV reduce-scatter as an all-reduce + slice (v5p), moving twice the bytes
RS_AS_ALL_REDUCE = 2
#: ... and on v5p:4x4x4 the forward all-gather as a zero-padded all-reduce (compiled HLO: a
#: dynamic-update-slice into zeros, then all-reduce over the 64 chips), also twice the bytes
AG_AS_ALL_REDUCE = {64: 2}
BWD_FLOP_RATIO = 3.5  # dq kernel 3 matmuls + dK/dV kernel 4 matmuls vs the forward's 2


# ----------------------------------------------------------------------------------------
# analytic model


def pair_work(s: int, n: int) -> np.ndarray:
    """Non-empty blocks of each (q shard, kv shard) pair, causal, zigzag over n, one head."""
    config = SplashConfig(block_q=BLOCK, block_kv=BLOCK, block_q_dkv=BLOCK, block_kv_dkv=BLOCK, backend="xla")
    return ring_work(ring_plan(masks.CausalMask((s, s)), n, "zigzag", config))


def kv_repeat(a: int) -> int:
    return 1 if KV_HEADS % a == 0 else a // KV_HEADS


def analytic(strategy: str, s: int, n: int, a: int = 1):
    """(fwd bytes, bwd bytes, critical-path blocks, overlapped comm bytes) per device."""
    local = s // n
    if strategy == "ring":
        kv = 2 * KV_HEADS * local * D
        fwd, bwd = kv * BYTES * (n - 1), kv * BYTES * (n - 1) + kv * 4 * n  # K, V hops; float32 dK, dV hops
        return fwd, bwd, HEADS * critical_path(pair_work(s, n)), fwd + bwd
    if strategy == "allgather":
        kv = 2 * KV_HEADS * s * D * BYTES * (n - 1) // n  # gather K, V; reduce-scatter dK, dV (bf16)
        return kv * AG_AS_ALL_REDUCE.get(n, 1), kv * RS_AS_ALL_REDUCE, HEADS * int(pair_work(s, n).sum(1).max()), 0
    b = n // a
    per = (2 * HEADS + 2 * KV_HEADS * kv_repeat(a)) * local * D * BYTES * (a - 1) // a  # q, k, v, out / grads
    if strategy == "ulysses":
        return per, per, HEADS // a * int(pair_work(s, 1).sum()), 0
    ring_kv = 2 * (KV_HEADS * kv_repeat(a) // a) * (s // b) * D  # the inner ring's K, V per member
    rfwd, rbwd = ring_kv * BYTES * (b - 1), ring_kv * BYTES * (b - 1) + ring_kv * 4 * b
    return per + rfwd, per + rbwd, HEADS // a * critical_path(pair_work(s, b)), rfwd + rbwd


def model_time(strategy, fwd, bwd, blocks, overlapped, peak, link):
    compute = blocks * 4 * BLOCK * BLOCK * D * (1 + BWD_FLOP_RATIO) / peak
    exposed = (fwd + bwd - overlapped) / link
    return exposed + max(compute, overlapped / link)


# ----------------------------------------------------------------------------------------
# compiled program: collectives counted from the scheduled HLO


_COMP = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{$")
_SHAPE = re.compile(r"\b(pred|s8|u8|s16|u16|bf16|f16|s32|u32|f32|s64|u64|f64)\[([\d,]*)\]")
_SIZES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8}
_OPS = ("all-gather", "reduce-scatter", "all-to-all", "collective-permute", "all-reduce")
_CALLEE = re.compile(r"\b(body|calls|to_apply|branch_computations|true_computation|false_computation)="
                     r"\{?([%\w.\-, ]+)\}?")


def _arrays(text: str) -> list[int]:
    """Bytes of every non-scalar array shape in ``text``."""
    return [_SIZES[t] * int(np.prod([int(x) for x in dims.split(",")])) for t, dims in _SHAPE.findall(text) if dims]


def _group_size(line: str, n: int) -> int:
    if m := re.search(r"replica_groups=\[(\d+),(\d+)\]", line):
        return int(m.group(2))
    if m := re.search(r"replica_groups=\{\{([\d,]+)\}", line):
        return len(m.group(1).split(","))
    return n


def collective_bytes(text: str, n: int) -> float:
    """Per-device bytes crossing devices in one run of the compiled program."""
    comps, current = {}, None
    for line in text.splitlines():
        if m := _COMP.match(line):
            current = comps.setdefault(m.group(1), [])
        elif current is not None and " = " in line:
            current.append(line)
    entry = next(m.group(1) for line in text.splitlines() if (m := re.match(r"^ENTRY %([\w.\-]+)", line)))

    def own(line: str) -> float:
        m = re.search(r" = (.*?) ([a-z][\w\-]*)\(", line)
        if not m:
            return 0.0
        result, op = m.group(1), m.group(2)
        base = op.removesuffix("-start")
        if base not in _OPS or op.endswith("-done"):
            return 0.0
        arrays = _arrays(result)
        g = _group_size(line, n)
        size = sum(arrays)
        if op == "all-gather-start":  # (operands, outputs): outputs are g x operands
            size = size * g / (g + 1)
        elif op == "collective-permute-start":  # (operands, outputs, contexts)
            size = size / 2
        if base == "collective-permute":
            return size
        if base == "reduce-scatter":
            return size * (g - 1)
        if base == "all-reduce":
            return 2 * size * (g - 1) / g
        return size * (g - 1) / g  # all-gather (of the output), all-to-all

    memo = {}

    def total(comp: str) -> float:
        if comp in memo:
            return memo[comp]
        memo[comp] = 0.0
        acc = 0.0
        for line in comps.get(comp, []):
            acc += own(line)
            if re.search(r" (async-done|async-update)\(", line):  # the async-start already counted it
                continue
            trips = 1
            if " while(" in line:  # trip count: known_trip_count, else the condition's `< constant`
                m = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                cond = re.search(r"condition=%([\w.\-]+)", line)
                consts = [int(c) for ln in comps.get(cond.group(1) if cond else "", [])
                          for c in re.findall(r"constant\((\d+)\)", ln)]
                trips = int(m.group(1)) if m else (max(consts) if consts else 1)
            for kind, group in _CALLEE.findall(line):
                callees = [c.strip().lstrip("%") for c in group.split(",")]
                if kind == "to_apply":
                    continue
                vals = [total(c) for c in callees if c in comps]
                if not vals:
                    continue
                acc += (trips if kind == "body" else 1) * (max(vals) if kind == "branch_computations" else sum(vals))
        memo[comp] = acc
        return acc

    return total(entry)


@child_main
def compile_child(strategy: str, s: int, n: int, a: int) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import ringsplash as rs

    mask, config = masks.CausalMask((s, s)), SplashConfig(backend="mosaic_tpu")
    if strategy == "usp":
        mesh = aot.topology_mesh(TOPOLOGY[n], ("ring", "ulysses"), (n // a, a))
        seq = P(None, ("ring", "ulysses"))
        kw = dict(mesh=mesh, ulysses_axis="ulysses", ring_axis="ring")
    else:
        mesh, seq = aot.topology_mesh(TOPOLOGY[n], ("ctx",)), P(None, "ctx")
        kw = dict(mesh=mesh, axis_name="ctx")
    sharded = getattr(rs, f"{strategy}_attention_sharded")
    fn = lambda q, k, v: sharded(q, k, v, mask, layout="zigzag", config=config, **kw)

    def fwd_bwd(q, k, v, d_out):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(d_out)

    spec = lambda h: aot.abstract((h, s, D), jnp.bfloat16, mesh, seq)
    t0 = time.perf_counter()
    fwd = aot.compile_report(fn, spec(HEADS), spec(KV_HEADS), spec(KV_HEADS))
    both = aot.compile_report(fwd_bwd, spec(HEADS), spec(KV_HEADS), spec(KV_HEADS), spec(HEADS))
    if dump := os.environ.get("BENCH_CP_DUMP"):  # keep the HLO for inspection
        for tag, c in (("fwd", fwd), ("fwd_bwd", both)):
            with open(os.path.join(dump, f"{strategy}_{s}_{n}_{a}_{tag}.hlo"), "w") as f:
                f.write(c.hlo_text)
    fwd_bytes, total = collective_bytes(fwd.hlo_text, n), collective_bytes(both.hlo_text, n)
    return {"fwd": fwd_bytes, "bwd": total - fwd_bytes, "temp": both.temp, "compile_s": time.perf_counter() - t0}


def compile_row(strategy, s, n, a, timeout, cache: str | None = None):
    """The child's counts (dict), or the reason it did not compile (str); cached in ``cache``
    (failures too: they are deterministic; a timeout is retried under a longer ``timeout``)."""
    return run_child([__file__, "--child", strategy, s, n, a], timeout, cache, key=f"{strategy} {s} {n} {a}")


# ----------------------------------------------------------------------------------------


def rows(s: int, n: int, peak: float, link: float):
    """[(strategy label, a, analytic tuple, modelled time) or (label, reason)] for one (S, N)."""
    out = []
    for strategy in STRATEGIES:
        if strategy == "ulysses":
            if n not in valid_ulysses_degrees(HEADS, KV_HEADS):
                out.append(("ulysses", 0, f"n/a: heads={HEADS} / kv_heads={KV_HEADS} cannot split over N={n}"))
                continue
            cands = [n]
        elif strategy == "usp":
            cands = [a for a in valid_ulysses_degrees(HEADS, KV_HEADS) if n % a == 0 and 1 < a < n]
        else:
            cands = [1]
        best = None
        for a in cands:
            an = analytic(strategy, s, n, a)
            t = model_time(strategy, *an, peak, link)
            if best is None or t < best[3]:
                best = (strategy if strategy != "usp" else f"usp {a}x{n // a}", a, an, t)
        out.append(best)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--seq", default="128K,1M", help="sequence lengths, comma-separated, K or M suffix (default: %(default)s)")
    p.add_argument("--devices", default="8,16,64",
                   help=f"device counts, comma-separated, among {tuple(TOPOLOGY)} (default: %(default)s)")
    p.add_argument("--no-compile", action="store_true", help="only the analytic rows; compile nothing")
    p.add_argument("--timeout", type=int, default=600, help="seconds per compile subprocess (default: %(default)s)")
    p.add_argument("--peak-tflops", type=float, default=459.0, help="chip peak bf16 TFLOP/s (default: %(default)s, v5p)")
    p.add_argument("--link-gbs", type=float, default=90.0,
                   help="per-device interconnect GB/s used by the model (default: %(default)s)")
    p.add_argument("--cache", default=None, help="JSON file keeping compiled rows between runs (default: none)")
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.child:
        strategy, s, n, a = args.child
        return compile_child(strategy, int(s), int(n), int(a))
    peak, link = args.peak_tflops * 1e12, args.link_gbs * 1e9
    seqs = [int(x[:-1]) * (K * K if x.endswith("M") else K) for x in args.seq.split(",")]
    print(f"\n### Context-parallel strategies: {HEADS} q / {KV_HEADS} kv heads, d = {D}, causal, zigzag, bf16, "
          f"blocks {BLOCK}; model: peak {args.peak_tflops:.0f} TFLOP/s, link {args.link_gbs:.0f} GB/s per device "
          f"(a model from compiled programs, not a TPU measurement; compiled on a shared 2-core CPU host)\n")
    print("| S | N (topology) | strategy | fwd MiB/dev (analytic / compiled) | bwd MiB/dev (analytic / compiled) "
          "| temp MiB/dev (compile s) | critical blocks | model ms | pick |")
    print("|---|---|---|---|---|---:|---:|---:|---|")
    for s in seqs:
        for n in [int(x) for x in args.devices.split(",")]:
            table = rows(s, n, peak, link)
            compiled = {r[0]: ("not compiled" if args.no_compile
                               else compile_row(r[0].split()[0], s, n, r[1], args.timeout, args.cache))
                        for r in table if len(r) == 4}
            # the pick: the fastest modelled strategy among those that compile (all with --no-compile)
            valid = [r for r in table if len(r) == 4 and (args.no_compile or isinstance(compiled[r[0]], dict))]
            pick = min(valid, key=lambda r: r[3])[0] if valid else "-"
            for r in table:
                head = f"| {fmt_tokens(s)} | {n} ({TOPOLOGY[n]}) | {r[0]} |"
                if len(r) == 3:
                    print(f"{head} {r[2]} | | | | | |", flush=True)
                    continue
                label, a, (fwd, bwd, blocks, _), t = r
                comp = compiled[label]
                mib = lambda x: f"{x / 2**20:.0f}"
                if isinstance(comp, dict):
                    agree = all(abs(c - x) <= 0.1 * max(x, 1) for c, x in ((comp["fwd"], fwd), (comp["bwd"], bwd)))
                    cf, cb = mib(comp["fwd"]), mib(comp["bwd"]) + ("" if agree else " (DISAGREE >10%)")
                    temp = f"{mib(comp['temp'])} ({comp['compile_s']:.0f} s)"
                else:
                    cf, cb, temp = short_reason(comp), "-", "-"
                print(f"{head} {mib(fwd)} / {cf} | {mib(bwd)} / {cb} | {temp} | {blocks} | {t * 1e3:.1f} | "
                      f"{'**pick**' if label == pick else ''} |", flush=True)


def short_reason(reason: str) -> str:
    """A table-sized version of a compile failure (the SMEM work-list wall named as such)."""
    if m := re.search(r"Allocation \(size=(\d+)\) would exceed memory \(size=(\d+)\).*space=smem", reason):
        return (f"no compile: SMEM wall, a {int(m.group(1)) / 2**10:.1f} KiB work-list buffer > "
                f"{int(m.group(2)) / 2**10:.0f} KiB SMEM")
    if m := re.search(r"Ran out of memory in memory space smem\. Used ([\d.]+\w) of ([\d.]+\w) smem\. "
                      r"Exceeded smem capacity by ([\d.]+\w)", reason):
        return f"no compile: SMEM wall, {m.group(3)} over the {m.group(2)} SMEM"
    return reason


if __name__ == "__main__":
    main()
