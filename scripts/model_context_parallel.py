"""A step-time model of each context-parallel strategy on 4 to 256 chips, built from the kernels' measured chip
times and the chips' ICI bandwidth: what a user needs to pick a strategy for a slice not run on yet.

    python scripts/model_context_parallel.py [--seq 128K,1M] [--chips 4,8,...,256] [--chip v5e|v5p]
        [--block-us-fwd-bwd 2.754] [--link-gbs 45]

Per device and attention call (32 q / 8 kv heads, d = 128, causal, zigzag, bf16; the layout balances causal work):

* compute = the busiest device's non-empty 512 x 512 blocks (summed over heads, and for the ring over its steps,
  the busiest device at each step: ``ring_plan.critical_path``) x the measured time of one block: single-device
  Splash's causal 32K forward+backward on one v5e chip (91.65 ms for 16 heads x 2,080 blocks = 2.754 us a block,
  ``scripts/bench_context_parallel_tpu.py``, 2026-12-07; every strategy ran within 0-8% of it on the chip's
  one-device mesh, the ring at 1.00x). Other chips: that time x v5e's bf16 peak / the chip's (an assumption:
  no other chip was measured);
* communication = the bytes each device sends (``bench_context_parallel.analytic``: the ring's K / V hops and
  float32 dK / dV hops, the all-gather's gather and reduce-scatter, Ulysses' all-to-alls, USP's both) / the
  bandwidth of one ICI link in one direction (``--link-gbs``; v5e 45 GB/s, v5p 90 GB/s: 1,600 / 4,800 Gbps a
  chip over 4 / 6 links, both directions, as published; a collective is assumed to get no more than one link);
* step = exposed communication + max(compute, communication the strategy overlaps): the ring's transfers run
  behind its kernels (checked on compiled programs: tests/test_ring_tpu_compile.py), the all-gather and Ulysses
  collectives do not overlap, USP's inner ring does and its all-to-alls do not.

A model, not a measurement: no slice was run. It ignores the per-step launch cost of the kernels (~0.35 us a grid
step, dwarfed here), HBM limits (``scripts/aot_preflight.py`` finds the largest context that fits) and the latency
of each transfer (4-256 chips move megabytes a hop: bandwidth-bound).
"""

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_context_parallel import BLOCK, HEADS, KV_HEADS, analytic, valid_ulysses_degrees

K = 1024
#: one 512 x 512 block of one head, causal forward+backward, d = 128, bf16, on one v5e chip (module docstring)
V5E_BLOCK_US = 91.65e3 / (16 * 64 * 65 // 2)
PEAK_TFLOPS = {"v5e": 197.0, "v5p": 459.0}
LINK_GBS = {"v5e": 45.0, "v5p": 90.0}


def step_ms(strategy: str, s: int, n: int, a: int, block_us: float, link_gbs: float) -> float:
    """Modelled forward+backward milliseconds of one attention call per device."""
    fwd, bwd, blocks, overlapped = analytic(strategy, s, n, a)
    compute = blocks * block_us * 1e-3
    link = link_gbs * 1e9 / 1e3  # bytes per ms
    exposed = (fwd + bwd - overlapped) / link
    return exposed + max(compute, overlapped / link)


def best_usp(s: int, n: int, block_us: float, link_gbs: float):
    """(ms, (ulysses, ring)) of USP's best factorisation with both factors > 1, or None."""
    best = None
    for a in valid_ulysses_degrees(HEADS, KV_HEADS):
        if 1 < a < n and n % a == 0:
            ms = step_ms("usp", s, n, a, block_us, link_gbs)
            best = min(best, (ms, (a, n // a))) if best else (ms, (a, n // a))
    return best


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--seq", default="128K,1M", help="sequence lengths (K = 1024, M = 1024K), comma-separated")
    p.add_argument("--chips", default="4,8,16,32,64,128,256", help="chips on the context axis, comma-separated")
    p.add_argument("--chip", default="v5e", choices=sorted(PEAK_TFLOPS), help="the chip generation")
    p.add_argument("--block-us-fwd-bwd", type=float, default=None,
                   help="measured microseconds of one 512 x 512 causal block, forward+backward (default: v5e's, "
                        "scaled by peak for other chips)")
    p.add_argument("--link-gbs", type=float, default=None, help="GB/s of one ICI link, one direction")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    block_us = args.block_us_fwd_bwd or V5E_BLOCK_US * PEAK_TFLOPS["v5e"] / PEAK_TFLOPS[args.chip]
    link = args.link_gbs or LINK_GBS[args.chip]
    seqs = [int(x[:-1]) * (K if x.endswith("K") else K * K) if x[-1] in "KM" else int(x) for x in args.seq.split(",")]
    print(f"# {args.chip}: {block_us:.3f} us a {BLOCK}x{BLOCK} block (fwd+bwd), {link:g} GB/s a link; "
          f"{HEADS} q heads, 8 kv heads, d=128, causal, zigzag, bf16; modelled ms per attention call (fwd+bwd)")
    print("| S | chips | ring | all-gather | Ulysses | USP (ulysses x ring) | pick |\n|---|---:|---:|---:|---:|---|---|")
    for s in seqs:
        for n in (int(c) for c in args.chips.split(",")):
            if s % (2 * n * BLOCK):
                print(f"| {s // K}K | {n} | - | - | - | - | S not divisible by 2 x {n} x {BLOCK} |")
                continue
            cells = {"ring": step_ms("ring", s, n, 1, block_us, link),
                     "all-gather": step_ms("allgather", s, n, 1, block_us, link)}
            if n in valid_ulysses_degrees(HEADS, KV_HEADS):
                cells["Ulysses"] = step_ms("ulysses", s, n, n, block_us, link)
            usp = best_usp(s, n, block_us, link)
            if usp:
                cells["USP"] = usp[0]
            pick = min(cells, key=cells.get)
            ulysses = f"{cells['Ulysses']:.1f}" if "Ulysses" in cells else f"— ({HEADS} heads)"
            usp_cell = f"{usp[0]:.1f} ({usp[1][0]}x{usp[1][1]})" if usp else "—"
            print(f"| {s // K}K | {n} | {cells['ring']:.1f} | {cells['all-gather']:.1f} | {ulysses} | {usp_cell} | "
                  f"{pick} |", flush=True)


if __name__ == "__main__":
    main()
