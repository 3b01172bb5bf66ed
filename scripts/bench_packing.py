"""Benchmark: segment-aware block skipping on packed documents.

For causal attention over a sequence packed with documents (sorted segment ids), prints per
(S, packing):

* active blocks of the static MaskInfo work list vs the segment-refined one (per head, blocks
  512), and the exact number of block pairs holding a (query, key) pair of the same document
  (computed independently, per document); ``refined == exact`` is the target;
* the ideal FLOP ratio refined / static;
* measured forward + backward time (``jit`` of ``vjp``; CPU, ``backend="xla"``, float32, 8
  heads, head_dim 128) with ``SplashConfig(segment_skipping=True)`` and ``False``, compiled
  first, then timed alternately on / off in this one process; medians and their ratio.
  With ``--cond-skip`` also the alternative the xla backend does not use: refined kinds kept
  in the static-length ``lax.scan`` (skipped steps take the ``lax.cond`` no-op branch and still
  do the per-step bookkeeping) instead of the compacted list walked to its dynamic count.

At 128K (``--tpu``) the same counts, plus a compile of the Mosaic kernels (forward + backward,
bfloat16, segment ids, skipping on) for a v5e TPU from this CPU host: compile seconds and
compiled temporary memory — never a TPU speed.

    python scripts/bench_packing.py                         # 8K and 32K timed, 128K counts
    python scripts/bench_packing.py --seqs 8192 --repeats 5 --cond-skip
    python scripts/bench_packing.py --counts-only --tpu     # no CPU timing; TPU compiles

Targets (CPU, xla backend): 32K with 32 documents of 1K: time on <= 1/8 of off; 32K single
document: on <= 1.05x off; refined active blocks == exact.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np

from _bench import fmt_tokens

HEADS, HEAD_DIM, BLOCK = 8, 128, 512
TPU_TARGET = "v5e:2x2"


def packings(seq_len: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Named sorted segment-id arrays: fixed document lengths, and a mixed-length draw
    (log-normal lengths, median 1K, clipped to [64, S]; the last document is cut at S)."""
    out = {"1 doc": np.zeros(seq_len, np.int32)}
    for doc in (512, 1024, 2048, 8192):
        if doc < seq_len:
            name = f"{seq_len // doc} x {doc // 1024}K" if doc >= 1024 else f"{seq_len // doc} x {doc}"
            out[name] = (np.arange(seq_len) // doc).astype(np.int32)
    rng = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < seq_len:
        lengths.append(int(np.clip(rng.lognormal(np.log(1024), 1.0), 64, seq_len)))
    ids = np.repeat(np.arange(len(lengths)), lengths)[:seq_len].astype(np.int32)
    out[f"mixed ({len(lengths)} docs)"] = ids
    return out


def exact_blocks(ids: np.ndarray, block: int) -> int:
    """Causal block pairs (q block, kv block) holding a same-document (q, k) pair, for sorted
    ids and equal q / kv blocks: per document, kv blocks up to the q block inside it."""
    starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
    ends = np.r_[starts[1:], ids.size]
    pairs = set()
    for s, e in zip(starts, ends):
        first, last = s // block, (e - 1) // block
        for qb in range(first, last + 1):
            pairs.update((qb, kb) for kb in range(first, qb + 1))
    return len(pairs)


def counts(seq_len: int, ids: np.ndarray) -> tuple[int, int, int]:
    """(static, refined, exact) active blocks per head of the causal forward list."""
    import jax
    import jax.numpy as jnp

    import ringsplash as rs
    from ringsplash import masks
    from ringsplash.splash import segment_blocks

    info = rs.build_mask_info(masks.CausalMask((seq_len, seq_len)), (BLOCK, BLOCK))
    refine = jax.jit(lambda s, i: segment_blocks.refine_schedule(s, i, i, (BLOCK, BLOCK), transpose=False))
    sched = refine(info.schedule(), jnp.asarray(ids))
    refined = int(np.count_nonzero(np.asarray(sched.kind) > 0))
    return int(info.num_active.sum()), refined, exact_blocks(ids, BLOCK)


def timed_rows(seq_len: int, rows: dict, repeats: int, cond_skip: bool) -> dict:
    """Median fwd+bwd seconds per packing: {name: {"on": s, "off": s, ("cond": s)}}."""
    import jax
    import jax.numpy as jnp

    import ringsplash as rs
    from ringsplash import masks
    from ringsplash.splash import attention as attention_lib

    mask = masks.CausalMask((seq_len, seq_len))
    kq, kk, kv, kd = jax.random.split(jax.random.key(0), 4)
    shape = (HEADS, seq_len, HEAD_DIM)
    q, k, v, d_out = (jax.random.normal(x, shape, jnp.float32) for x in (kq, kk, kv, kd))

    def make(skipping):
        cfg = rs.SplashConfig(block_q=BLOCK, block_kv=BLOCK, backend="xla", segment_skipping=skipping)

        def run(q, k, v, ids):
            seg = rs.SegmentIds(ids, ids)
            out, vjp = jax.vjp(lambda q, k, v: rs.splash_attention(q, k, v, mask, segment_ids=seg, config=cfg),
                               q, k, v)
            return out, *vjp(d_out)

        return jax.jit(run)

    fns = {"on": make(True), "off": make(False)}
    if cond_skip:  # refined kinds, static length: drop the dynamic count, keep the scan's cond skip
        refine = attention_lib._refine

        def cond_refine(schedule, info, q_seg, kv_seg, config):
            out = refine(schedule, info, q_seg, kv_seg, config)
            if out is None or out is schedule:
                return out
            kinds = attention_lib.segment_blocks.refined_kinds(
                schedule, *(attention_lib.segment_blocks.block_segments(x, b)
                            for x, b in ((q_seg, info.block_shape[0]), (kv_seg, info.block_shape[1]))))
            return schedule._replace(kind=kinds)

        attention_lib._refine = cond_refine
        try:  # traced and compiled while patched
            fns["cond"] = make(True).lower(q, k, v, jnp.zeros(seq_len, jnp.int32)).compile()
        finally:
            attention_lib._refine = refine
    results = {}
    for name, ids in rows.items():
        ids = jnp.asarray(ids)
        for fn in fns.values():
            jax.block_until_ready(fn(q, k, v, ids))  # compile / warm up
        times = {mode: [] for mode in fns}
        for _ in range(repeats):
            for mode, fn in fns.items():  # alternated: on, off, (cond), on, off, ...
                start = time.perf_counter()
                jax.block_until_ready(fn(q, k, v, ids))
                times[mode].append(time.perf_counter() - start)
        results[name] = {mode: statistics.median(t) for mode, t in times.items()}
        print(f"  [{seq_len}] {name}: " + ", ".join(f"{m} {t:.2f}s" for m, t in results[name].items()), flush=True)
    return results


def tpu_compile(seq_len: int) -> tuple[float, float]:
    """(compile seconds, temp MiB) of fwd + bwd Mosaic kernels with segment ids on v5e."""
    import jax
    import jax.numpy as jnp

    import ringsplash as rs
    from ringsplash import aot, masks

    sharding = jax.sharding.SingleDeviceSharding(aot.topology_devices(TPU_TARGET)[0])
    x = jax.ShapeDtypeStruct((HEADS, seq_len, HEAD_DIM), jnp.bfloat16, sharding=sharding)
    ids = jax.ShapeDtypeStruct((seq_len,), jnp.int32, sharding=sharding)
    mask = masks.CausalMask((seq_len, seq_len))
    cfg = rs.SplashConfig(block_q=BLOCK, block_kv=BLOCK, backend="mosaic_tpu")

    def loss(q, k, v, w, i):
        out = rs.splash_attention(q, k, v, mask, segment_ids=rs.SegmentIds(i, i), config=cfg)
        return jnp.vdot(out.astype(jnp.float32), w.astype(jnp.float32))

    report = aot.compile_report(jax.grad(loss, argnums=(0, 1, 2)), x, x, x, x, ids)
    assert "tpu_custom_call" in report.hlo_text
    return report.seconds, report.temp / 2**20


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--seqs", type=int, nargs="*", default=[8192, 32768],
                        help="CPU-timed sequence lengths (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="timed on/off pairs per row (median) (default: %(default)s)")
    parser.add_argument("--rows", nargs="*", default=None,
                        help="only time packings whose name starts with these (default: all)")
    parser.add_argument("--counts-only", action="store_true", help="no CPU timing")
    parser.add_argument("--cond-skip", action="store_true", help="also time the cond-skip alternative")
    parser.add_argument("--tpu", action="store_true", help=f"compile the Mosaic kernels for {TPU_TARGET} at 32K, 128K")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.tpu:
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    lines = []
    header = ("| S | packing | static blocks | refined blocks | exact | ideal FLOP ratio | on s | off s | "
              "time ratio on/off |" + (" cond-skip s |" if args.cond_skip else ""))
    lines += [header, "|" + "---|" * (header.count("|") - 1)]
    for seq_len in [*args.seqs, 131072]:
        rows = packings(seq_len)
        timed = {}
        if not args.counts_only and seq_len in args.seqs:
            pick = {n: ids for n, ids in rows.items() if args.rows is None or any(n.startswith(r) for r in args.rows)}
            timed = timed_rows(seq_len, pick, args.repeats, args.cond_skip)
        for name, ids in rows.items():
            static, refined, exact = counts(seq_len, ids)
            t = timed.get(name)
            cells = [fmt_tokens(seq_len), name, str(static), str(refined), str(exact), f"{refined / static:.4f}"]
            if t:
                cells += [f"{t['on']:.3f}", f"{t['off']:.3f}", f"{t['on'] / t['off']:.3f}"]
                cells += [f"{t['cond']:.3f}"] if args.cond_skip else []
            else:
                cells += ["-", "-", "-"] + (["-"] if args.cond_skip else [])
            lines.append("| " + " | ".join(cells) + " |")
    print()
    print("CPU timings: backend='xla', float32, 8 heads, head_dim 128, fwd+bwd, blocks 512, medians of "
          f"{args.repeats} alternated on/off runs in one process (shared, loaded machine: ratios, not speeds).")
    print("\n".join(lines))
    if args.tpu:
        print()
        print("| target | S | compile s (fwd+bwd, bf16, segment ids, skipping on) | temp MiB |")
        print("|---|---|---|---|")
        for seq_len in (32768, 131072):
            seconds, temp = tpu_compile(seq_len)
            print(f"| {TPU_TARGET} | {fmt_tokens(seq_len)} | {seconds:.1f} | {temp:.1f} |")
        print("Compile only: not a TPU speed.")


if __name__ == "__main__":
    main()
