"""Benchmark: Splash ``backend="xla"`` vs dense ``jax.nn.dot_product_attention`` on this CPU.

Forward + backward (``jit(grad)`` of a scalar loss w.r.t. q, k, v), float32, 8 heads,
head_dim 128, one example. Each table row runs in its own subprocess (so its peak RSS is its
own); inside it both implementations are compiled first, then timed alternately
(ours, dense, ours, dense, ...) so machine noise hits both alike; the table shows medians and
the ratio ours / dense of those medians, measured in that one process.

Peak RSS: ``ours`` is the process peak after ours has run and before dense ever ran (so it
includes the Python + JAX baseline and the inputs); ``process`` is the peak after both.

    python scripts/bench_splash_xla.py                 # 4K and 8K with dense, 32K ours only
    python scripts/bench_splash_xla.py --rows 4096:causal --repeats 5

Targets: causal <= 0.75x dense, local window 1024 <= 0.35x dense at 4K and
8K; at 32K, where dense does not fit in memory, ours still runs.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import child_main, peak_rss_mib, run_child

DEFAULT_ROWS = ("4096:causal", "4096:local", "8192:causal", "8192:local", "32768:causal", "32768:local")
NO_DENSE_FROM = 32768  # dense needs heads * S^2 * 4 B = 32 GiB per score array at 32K
HEADS, HEAD_DIM, WINDOW = 8, 128, 1024


def run_row(seq_len: int, mask_name: str, repeats: int, block_q: int, block_kv: int, dense: bool) -> dict:
    import jax
    import jax.numpy as jnp

    import ringsplash as rs
    from ringsplash import masks

    if mask_name == "causal":
        mask = masks.CausalMask((seq_len, seq_len))
        dense_kw = dict(is_causal=True)
    elif mask_name == "local":
        mask = masks.LocalMask((seq_len, seq_len), window=(WINDOW, 0))
        dense_kw = dict(local_window_size=(WINDOW, 0))
    else:
        raise ValueError(f"mask must be 'causal' or 'local', got {mask_name!r}")

    key = jax.random.key(0)
    kq, kk, kv, kw = jax.random.split(key, 4)
    shape = (HEADS, seq_len, HEAD_DIM)
    q, k, v, w = (jax.random.normal(x, shape, jnp.float32) for x in (kq, kk, kv, kw))
    cfg = rs.SplashConfig(block_q=block_q, block_kv=block_kv, backend="xla")

    def ours_loss(q, k, v):
        return jnp.vdot(rs.splash_attention(q, k, v, mask, config=cfg), w)

    def dense_loss(q, k, v):  # [heads, S, d] -> [batch=1, S, heads, d]
        to_bsnh = lambda x: jnp.transpose(x, (1, 0, 2))[None]
        out = jax.nn.dot_product_attention(to_bsnh(q), to_bsnh(k), to_bsnh(v), implementation="xla", **dense_kw)
        return jnp.vdot(out[0].transpose(1, 0, 2), w)

    def compile_(loss):
        t0 = time.perf_counter()
        fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
        return fn, time.perf_counter() - t0

    def timed(fn):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(q, k, v))
        return time.perf_counter() - t0

    info = rs.build_mask_info(mask, (block_q, block_kv))
    active = int((info.kind > 0).sum())
    total = (seq_len // block_q) * (seq_len // block_kv)

    ours, ours_compile = compile_(ours_loss)
    ours_times = [timed(ours)]
    rss_ours = peak_rss_mib()
    dense_times, dense_compile = [], None
    if dense:
        dense_fn, dense_compile = compile_(dense_loss)
        dense_times.append(timed(dense_fn))
    for _i in range(repeats - 1):
        ours_times.append(timed(ours))
        if dense:
            dense_times.append(timed(dense_fn))
    median = statistics.median
    return dict(
        S=seq_len, mask=mask_name if mask_name == "causal" else f"local {WINDOW}",
        blocks=f"{block_q}x{block_kv}", active=f"{active}/{total}", repeats=repeats,
        ours_s=median(ours_times), dense_s=median(dense_times) if dense else None,
        ours_compile_s=ours_compile, dense_compile_s=dense_compile,
        rss_ours_mib=rss_ours, rss_process_mib=peak_rss_mib(),
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--rows", nargs="*", default=list(DEFAULT_ROWS),
                        help="S:mask, mask in {causal, local} (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs per implementation (rows < 32K) (default: %(default)s)")
    parser.add_argument("--repeats-large", type=int, default=1, help="timed runs at S >= 32K (slow) (default: %(default)s)")
    parser.add_argument("--block-q", type=int, default=512, help="Splash query block (default: %(default)s)")
    parser.add_argument("--block-kv", type=int, default=512, help="Splash key/value block (default: %(default)s)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)

    if args.worker:  # one row, in this process; prints one JSON line
        s, mask_name = args.worker.split(":")
        s = int(s)
        reps = args.repeats if s < NO_DENSE_FROM else args.repeats_large
        child_main(run_row)(s, mask_name, reps, args.block_q, args.block_kv, dense=s < NO_DENSE_FROM)
        return

    print(f"Splash backend='xla' vs jax.nn.dot_product_attention (XLA, dense) on this CPU "
          f"({os.cpu_count()} cores): fwd+bwd, float32, heads={HEADS}, d={HEAD_DIM}; "
          f"median of runs, timed alternately in one process per row.")
    header = (f"{'S':>6} {'mask':<11} {'blocks':>8} {'active':>10} {'runs':>4} {'dense s':>8} "
              f"{'ours s':>8} {'ratio':>6} {'target':>6} {'compile s':>9} {'RSS ours MiB':>12} {'RSS proc MiB':>12}")
    print(header)
    print("-" * len(header))
    for row in args.rows:
        r = run_child([__file__, "--worker", row, "--repeats", args.repeats, "--repeats-large", args.repeats_large,
                       "--block-q", args.block_q, "--block-kv", args.block_kv], env=dict(JAX_PLATFORMS="cpu"),
                      label="worker")
        if isinstance(r, str):
            print(f"{row}: {r}")
            continue
        target = 0.75 if r["mask"] == "causal" else 0.35
        if r["dense_s"] is None:
            dense, ratio, tgt = "n/a", "-", "runs"
        else:
            dense, ratio = f"{r['dense_s']:.3f}", r["ours_s"] / r["dense_s"]
            tgt = "ok" if ratio <= target else "MISS"
            ratio = f"{ratio:.3f}"
        print(f"{r['S']:>6} {r['mask']:<11} {r['blocks']:>8} {r['active']:>10} {r['repeats']:>4} {dense:>8} "
              f"{r['ours_s']:>8.3f} {ratio:>6} {tgt:>6} {r['ours_compile_s']:>9.2f} "
              f"{r['rss_ours_mib']:>12.0f} {r['rss_process_mib']:>12.0f}", flush=True)
    print("dense n/a at 32K: its [heads, S, S] float32 scores alone would take 32 GiB.")


if __name__ == "__main__":
    main()
