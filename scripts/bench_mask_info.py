"""Benchmark: build_mask_info seconds and peak RSS for structured masks at 32K .. 4M tokens.

Every (mask, S) row runs in a fresh subprocess (JAX and ringsplash imported), so its peak RSS
is that row's process total. Build time is the median of ``--repeats`` builds, each after
``build_mask_info.cache_clear()``. Targets (on a 2-core CPU machine): every row at
S = 1M in <= 0.3 s and <= 1 GiB peak RSS, at 4M <= 2 s, at 128K <= 20 ms. The "dense" row
is the approach ringsplash avoids: evaluate the whole S x S causal mask and classify its
blocks with numpy (32K only: it is O(S^2) in time and memory).

    python scripts/bench_mask_info.py                 # full table (markdown)
    python scripts/bench_mask_info.py --sizes 32K 1M  # a subset
    python scripts/bench_mask_info.py --function      # FunctionMask vs the same structured mask

``--function``: "64 global tokens + a causal window of 4096" written three ways — a FunctionMask
rule without a hint (every tile of the S x S grid evaluated with JAX), the same rule with
``within=GlobalTokensMask | LocalMask`` (only the hint's tiles evaluated) and the structured
``GlobalTokensMask | LocalMask`` itself; first build (JAX compiles the tile evaluator) and the
median of the repeats (each after clearing both caches); rows over ``--timeout`` seconds are
reported as such.
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import child_main, fmt_tokens, md_table, peak_rss_mib, run_child

BLOCK = (512, 512)
MASKS = ("causal", "local", "chunked", "prefix", "causal_zigzag8")
DESCRIPTIONS = {
    "causal": "CausalMask",
    "local": "LocalMask(window=(4096, 0))",
    "chunked": "ChunkedCausalMask(8192)",
    "prefix": "PrefixLMMask(S // 4)",
    "causal_zigzag8": "CausalMask, 8x8 shards, zigzag",
    "dense": "dense causal + numpy block classification",
}
FUNCTION_MASKS = ("fn", "fn_within", "structured_global_window")
DESCRIPTIONS.update({
    "fn": "FunctionMask(global 64 + window 4096), no hint",
    "fn_within": "same FunctionMask, within=GlobalTokensMask \\| LocalMask",
    "structured_global_window": "GlobalTokensMask(64) \\| LocalMask((4095, 0))",
})
SIZES = {"32K": 1 << 15, "128K": 1 << 17, "1M": 1 << 20, "4M": 1 << 22}
# S -> (max seconds, max peak RSS MiB or None)
TARGETS = {1 << 17: (0.020, None), 1 << 20: (0.300, 1024), 1 << 22: (2.0, None)}


def run_row(name: str, seq_len: int, repeats: int) -> dict:
    """One row, in this (fresh) process."""
    import jax  # noqa: F401  (the RSS we report includes JAX, as in real use)
    import numpy as np

    import ringsplash as rs
    from ringsplash import masks
    from ringsplash.masks import function as function_mask

    shape = (seq_len, seq_len)
    rss_before = peak_rss_mib()
    times, entries = [], None
    if name == "dense":
        bq, bk = BLOCK
        mask = masks.CausalMask(shape)
        for _ in range(repeats):
            t0 = time.perf_counter()
            arr = mask[:, :]  # S x S bool
            blocks = arr.reshape(seq_len // bq, bq, seq_len // bk, bk)
            any_, all_ = blocks.any(axis=(1, 3)), blocks.all(axis=(1, 3))
            kinds = np.where(all_, 2, np.where(any_, 1, 0)).astype(np.int8)
            times.append(time.perf_counter() - t0)
            entries = int(np.count_nonzero(kinds))
            del arr, blocks
    else:
        kw = {}
        if name == "causal":
            mask = masks.CausalMask(shape)
        elif name == "local":
            mask = masks.LocalMask(shape, window=(4096, 0))
        elif name == "chunked":
            mask = masks.ChunkedCausalMask(shape, 8192)
        elif name == "prefix":
            mask = masks.PrefixLMMask(shape, seq_len // 4)
        elif name in FUNCTION_MASKS:
            mask = _global_window(name, shape)
        elif name == "causal_zigzag8":
            mask = masks.CausalMask(shape)
            pos = rs.layouts.permutation("zigzag", seq_len, 8)
            kw = dict(q_shards=8, kv_shards=8, q_positions=pos, kv_positions=pos)
        else:
            raise ValueError(f"unknown row {name=}")
        for _ in range(repeats):
            rs.build_mask_info.cache_clear()
            function_mask._BOUND.clear()  # the bound FunctionMask evaluation, cached apart
            t0 = time.perf_counter()
            info = rs.build_mask_info(mask, BLOCK, **kw)
            times.append(time.perf_counter() - t0)
            entries = int(info.num_active.sum())
            del info
    return {
        "name": name,
        "seq_len": seq_len,
        "seconds": statistics.median(times),
        "all_seconds": times,
        "peak_rss_mib": peak_rss_mib(),
        "rss_after_import_mib": rss_before,
        "entries": entries,
    }


def _global_window_rule(q, kv):
    return (kv < 64) | ((q >= kv) & (q - kv < 4096))


def _global_window(name: str, shape):
    from ringsplash import masks

    structured = masks.GlobalTokensMask(shape, 64) | masks.LocalMask(shape, window=(4095, 0))
    if name == "structured_global_window":
        return structured
    return masks.FunctionMask(shape, _global_window_rule, within=structured if name == "fn_within" else None)


def run_row_subprocess(name: str, seq_len: int, repeats: int, timeout: float | None = None) -> dict | str:
    result = run_child([__file__, "--row", name, seq_len, "--repeats", repeats], timeout=timeout,
                       env=dict(JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1"), label=f"row {name} S={seq_len}")
    if isinstance(result, str) and timeout is None:
        raise RuntimeError(result)
    return result


def function_table(args) -> None:
    sizes = args.sizes if args.sizes != list(SIZES) else ["32K", "128K", "1M"]
    rows = []
    for seq_len in (SIZES[s] for s in sizes):
        for name in FUNCTION_MASKS:
            print(f"{name} S={fmt_tokens(seq_len)}", file=sys.stderr, flush=True)
            rows.append((name, seq_len, run_row_subprocess(name, seq_len, args.repeats, timeout=args.timeout)))
    print(f"build_mask_info, blocks {BLOCK}, one fresh process per row: first build (includes JAX compiling "
          f"the tile evaluator), then the median of {args.repeats} builds with both caches cleared; peak RSS = "
          f"whole process with JAX imported; {os.cpu_count()} CPUs\n")
    table = []
    for name, seq_len, r in rows:
        if isinstance(r, str):
            table.append([DESCRIPTIONS[name], fmt_tokens(seq_len), r, "", "", ""])
            continue
        first, rest = r["all_seconds"][0], r["all_seconds"][1:] or r["all_seconds"]
        table.append([DESCRIPTIONS[name], fmt_tokens(seq_len), f"{first:.3f}", f"{statistics.median(rest):.3f}",
                      f"{r['peak_rss_mib']:.0f}", f"{r['entries']:,}"])
    print(md_table(table, ["mask", "S", "first build (s)", "median build (s)", "peak RSS (MiB)",
                           "non-empty block pairs"]))


def verdict(row: dict) -> tuple[str, str]:
    target = TARGETS.get(row["seq_len"])
    if row["name"] == "dense" or target is None:
        return "—", "—"
    max_s, max_mib = target
    text = f"≤ {max_s * 1e3:.0f} ms" if max_s < 1 else f"≤ {max_s:g} s"
    ok = row["seconds"] <= max_s
    if max_mib is not None:
        text += f", ≤ {max_mib / 1024:g} GiB"
        ok = ok and row["peak_rss_mib"] <= max_mib
    return text, "pass" if ok else "**FAIL**"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--row", nargs=2, metavar=("MASK", "SEQ_LEN"), help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=3, help="timed builds per row (median) (default: %(default)s)")
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES),
                        help="sequence lengths to build (default: all)")
    parser.add_argument("--masks", nargs="+", default=list(MASKS), choices=list(MASKS),
                        help="masks to build (default: all)")
    parser.add_argument("--no-dense", action="store_true", help="skip the dense 32K comparison row")
    parser.add_argument("--json", help="also write the rows to this JSONL file")
    parser.add_argument("--function", action="store_true",
                        help="FunctionMask rows (no hint, within=) beside the structured mask (default 32K 128K 1M)")
    parser.add_argument("--timeout", type=float, default=900,
                        help="--function: seconds per row before giving up (default: %(default)s)")
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)

    if args.row:
        child_main(run_row)(args.row[0], int(args.row[1]), args.repeats)
        return
    if args.function:
        function_table(args)
        return

    rows = []
    jobs = [(m, SIZES[s]) for m in args.masks for s in args.sizes]
    if not args.no_dense:
        jobs.append(("dense", SIZES["32K"]))
    for i, (name, seq_len) in enumerate(jobs):
        print(f"[{i + 1}/{len(jobs)}] {name} S={fmt_tokens(seq_len)}", file=sys.stderr, flush=True)
        rows.append(run_row_subprocess(name, seq_len, args.repeats))
    if args.json:
        with open(args.json, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")

    print(f"build_mask_info, blocks {BLOCK}, median of {args.repeats} (cache cleared each time); "
          f"peak RSS = whole process with JAX imported, one fresh process per row; {os.cpu_count()} CPUs\n")
    table = []
    for r in rows:
        target, result = verdict(r)
        runs = " / ".join(f"{t:.3f}" for t in r["all_seconds"])
        table.append([DESCRIPTIONS[r["name"]], fmt_tokens(r["seq_len"]), f"{r['seconds']:.4f}", runs,
                      f"{r['peak_rss_mib']:.0f}", f"{r['rss_after_import_mib']:.0f}", f"{r['entries']:,}", target, result])
    print(md_table(table, ["mask", "S", "build (s)", "runs (s)", "peak RSS (MiB)", "RSS after import (MiB)",
                           "non-empty block pairs", "target", "result"]))


if __name__ == "__main__":
    main()
