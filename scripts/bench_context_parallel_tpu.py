"""Benchmark on a TPU chip: every context-parallel strategy beside single-device Splash, in one process.

Each strategy runs over the chip's one-device mesh (ring, all-gather and Ulysses over a 1-device axis, USP over
a 1 x 1 mesh), so no byte crosses a link: the table is each strategy's per-device kernel efficiency, the ratio
to ``splash_attention`` on the same inputs. Every call uses the default ``SplashConfig()`` and the zigzag layout
(the identity order on one device). tokamax's ring (``make_ring_attention``, the ring kernel MaxText uses: blocks
1024, kv-compute 512, fused backward with ``dq_reduction_steps=3``, a dense causal ``NumpyMask``) joins the causal
rows up to 32K where ``import tokamax`` works.

Rows: causal, sliding window 4096 and 16 packed causal documents (segment ids); S = 8K, 32K, 64K forward and 8K,
16K (causal), 32K forward+backward; at 16K also GQA 4:1 and head size 64; bfloat16, 16 heads, head size 128.
Segment ids are jit arguments, as in a training step (closed over as constants, they would let XLA refine
single-device Splash's work lists at compile time). Milliseconds are medians of ``--repeats`` samples, each
``--back-to-back`` calls dispatched back to back and blocked once (the host round trip hidden, as in a training
loop). The last column is each row's largest absolute difference between a strategy's outputs (forward+backward:
its loss and q, k, v gradients) and Splash's, with the strategy it came from: every timed row is a check too.

    python scripts/bench_context_parallel_tpu.py              # every row (on a v5e: ~12 min, compiles included)
    python scripts/bench_context_parallel_tpu.py --rows causal:32768:bwd --strategies ring,tokamax_ring

It refuses to run without a TPU (CPU timings of these kernels mean nothing) but for ``--cpu-smoke``: two small rows
(causal forward, packed documents forward+backward; 2 heads of 128, S = 1024) on the CPU, which checks the
script (tests/test_bench_scripts.py).
"""

import argparse
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import ringsplash as rs
from _bench import LOG_DIR, open_log
from bench_splash_tpu import HEADS, Row, inputs, parse_rows, segment_ids, timed, tokamax_available, with_grad
from ringsplash import masks

STRATEGIES = ("splash", "ring", "allgather", "ulysses", "usp", "tokamax_ring")
TOKAMAX_MAX_LEN = 32768  # its mask is a dense S x S numpy array, classified block by block in Python


def default_rows() -> list[Row]:
    rows = [Row(m, s, False) for m in ("causal", "local", "docs") for s in (8192, 32768, 65536)]
    rows += [Row(m, s, True) for m in ("causal", "local", "docs") for s in (8192, 32768)]
    rows += [Row("causal", 16384, True)]
    for bwd in (False, True):
        rows += [Row("causal", 16384, bwd, kv_heads=HEADS // 4), Row("causal", 16384, bwd, head_dim=64)]
    return rows


def the_mask(row: Row):
    s = row.seq_len
    if row.mask == "local":
        return masks.CausalMask((s, s)) & masks.LocalMask((s, s), window=(4096, 0))
    return masks.CausalMask((s, s))


def strategy_fn(name: str, row: Row):
    """``attn(q, k, v, ids)`` of one strategy on global arrays (one device); ``ids``: the row's segment ids
    (None but for the docs rows), a jit argument as in a training step, so no path refines its work lists
    at compile time from constant ids."""
    mask = the_mask(row)
    device = jax.devices()[:1]
    mesh = jax.make_mesh((1,), ("ctx",), devices=device, axis_types=(jax.sharding.AxisType.Auto,))
    seg = lambda ids: None if ids is None else rs.SegmentIds(q=ids, kv=ids)
    if name == "splash":
        return lambda q, k, v, ids: rs.splash_attention(q, k, v, mask, segment_ids=seg(ids))
    if name == "ring":
        return lambda q, k, v, ids: rs.ring_attention_sharded(q, k, v, mask, mesh=mesh, axis_name="ctx",
                                                              layout="zigzag", segment_ids=seg(ids))
    if name == "allgather":
        return lambda q, k, v, ids: rs.allgather_attention_sharded(q, k, v, mask, mesh=mesh, axis_name="ctx",
                                                                   layout="zigzag", segment_ids=seg(ids))
    if name == "ulysses":
        return lambda q, k, v, ids: rs.ulysses_attention_sharded(q, k, v, mask, mesh=mesh, axis_name="ctx",
                                                                 layout="zigzag", segment_ids=seg(ids))
    if name == "usp":
        mesh2 = jax.make_mesh((1, 1), ("uly", "ring"), devices=device, axis_types=(jax.sharding.AxisType.Auto,) * 2)
        return lambda q, k, v, ids: rs.usp_attention_sharded(q, k, v, mask, mesh=mesh2, ulysses_axis="uly",
                                                             ring_axis="ring", layout="zigzag", segment_ids=seg(ids))
    if name == "tokamax_ring":
        ring = tokamax_ring_fn(row, mesh)
        return lambda q, k, v, ids: ring(q, k, v)
    raise ValueError(f"unknown strategy {name!r}")


def tokamax_ring_fn(row: Row, mesh):
    from tokamax._src.ops.experimental.tpu.splash_attention import ring_attention_kernel as tr
    from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_kernel as tk
    from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_mask as tm

    s = row.seq_len
    config = tk.SplashConfig(block_q=1024, block_kv=1024, block_kv_compute=512, block_q_dkv=1024,
                             block_kv_dkv=1024, block_kv_dkv_compute=512, use_fused_bwd_kernel=True,
                             dq_reduction_steps=3)
    dense = np.tril(np.ones((s, s), dtype=np.bool_))
    kernel = tr.make_ring_attention(tm.NumpyMask(dense), config=config, is_mqa=False, ring_axis="ctx",
                                    q_seq_shards=1, kv_seq_shards=1)
    spec = kernel.manual_sharding_spec()
    seq = P(None, "ctx", None)
    call = jax.shard_map(lambda kern, q, k, v: kern(q, k, v), mesh=mesh, in_specs=(spec, seq, seq, seq),
                         out_specs=seq, check_vma=False)
    return functools.partial(call, kernel)


def largest_diff(out, reference) -> float:
    """The largest absolute difference between a strategy's outputs (forward: the attention output; forward +
    backward: the loss and the q, k, v gradients) and Splash's, in float32: each timed row is a check too."""
    leaves = zip(jax.tree.leaves(out), jax.tree.leaves(reference), strict=True)
    return max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))) for a, b in leaves)


def supported(name: str, row: Row, have_tokamax: bool) -> str | None:
    """None, or why this cell is not measured."""
    if name != "tokamax_ring":
        return None
    if not have_tokamax:
        return "tokamax not installed"
    if row.mask != "causal" or row.kv_heads != row.heads or row.head_dim != 128 or row.seq_len > TOKAMAX_MAX_LEN:
        return "causal MHA d=128 up to 32K only"
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--rows", help="mask:S:fwd|bwd[:d=N][:group=G], comma-separated (default: every row)")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated, from " + ", ".join(STRATEGIES))
    p.add_argument("--repeats", type=int, default=5, help="timed samples per cell (median)")
    p.add_argument("--back-to-back", type=int, default=5, help="calls dispatched per sample, blocked once")
    p.add_argument("--log", default=os.path.join(LOG_DIR, "bench_context_parallel_tpu.jsonl"), help="one JSON line per cell")
    p.add_argument("--cpu-smoke", action="store_true", help="two small rows on the CPU: checks the script")
    return p


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    if jax.devices()[0].platform != "tpu" and not args.cpu_smoke:
        sys.exit("bench_context_parallel_tpu.py measures TPU kernels: run it on a TPU (CPU timings mean nothing)")
    names = [n.strip() for n in args.strategies.split(",") if n.strip()]
    unknown = sorted(set(names) - set(STRATEGIES))
    if unknown:
        p.error(f"--strategies: unknown {unknown}; choose from {', '.join(STRATEGIES)}")
    rows = parse_rows(args.rows) if args.rows else default_rows()
    if args.cpu_smoke:
        rows = [Row("causal", 1024, False, heads=2, kv_heads=2), Row("docs", 1024, True, heads=2, kv_heads=2)]
    have_tokamax = "tokamax_ring" in names and tokamax_available()
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, {time.strftime('%Y-%m-%d')}; "
          f"one-device mesh; SplashConfig(); median of {args.repeats} x {args.back_to_back} calls back to back")
    header = " | ".join(f"{n} ms (x splash)" if n != "splash" else "splash ms" for n in names)
    print(f"| row | {header} | largest abs diff from splash |\n|---|" + "---|" * (len(names) + 1))
    with open_log(args.log) as log:
        for row in rows:
            q, k, v, do = inputs(row)
            ids = jnp.asarray(segment_ids(row)) if row.mask == "docs" else None
            cells, base, reference, worst = [], None, None, (0.0, "-")
            for name in names:
                why = supported(name, row, have_tokamax)
                if why:
                    cells.append(f"- ({why})")
                    continue
                try:
                    fn = with_grad(strategy_fn(name, row), row.bwd)
                    args_ = (q, k, v, do, ids) if row.bwd else (q, k, v, ids)
                    ms = timed(fn, args_, args.repeats, args.back_to_back)
                    out = fn(*args_)  # compiled by the timing: the output (and gradients) it timed
                except Exception as exc:  # a cell that fails prints why; the table goes on
                    cells.append(f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}")
                    print(json.dumps({"row": row.label, "strategy": name, "error": repr(exc)[:500]}), file=log)
                    continue
                base = ms if name == "splash" else base
                reference = out if name == "splash" else reference
                diff = None if reference is None or name == "splash" else largest_diff(out, reference)
                worst = max(worst, (diff, name)) if diff is not None else worst
                ratio = f" ({base / ms:.2f}x)" if base and name != "splash" else ""
                cells.append(f"{ms:.2f}{ratio}")
                print(json.dumps({"row": row.label, "strategy": name, "ms": ms,
                                  "vs_splash": None if not base else base / ms, "max_abs_diff": diff}), file=log)
            cells.append(f"{worst[0]:.2g} ({worst[1]})" if worst[1] != "-" else "-")
            print(f"| {row.label} | " + " | ".join(cells) + " |", flush=True)
            log.flush()  # a run stopped between rows keeps the rows it measured


if __name__ == "__main__":
    main()
