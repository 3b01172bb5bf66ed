"""Benchmark on a TPU chip: ringsplash's Splash kernels beside JAX's splash and tokamax's, in one process.

Rows: causal, sliding window 4096 and 16 packed causal documents (segment ids), S = 4K ... 64K forward and
4K ... 32K forward+backward; bfloat16, 16 heads, head size 128; at 16K also head sizes 64 and 256 and GQA
4:1. Columns per implementation: milliseconds (median of ``--repeats`` calls, each blocked on; with
``--back-to-back N`` each sample is N calls dispatched back to back, one block at the end), TF/s and
the ratio to ringsplash's default config. FLOPs count attended (query, key) pairs only: forward 4·d per pair
(2·H·S²·d for causal), forward+backward 3.5x that.

* ringsplash default: ``SplashConfig()`` (blocks and VMEM limit from the chip's table, ``splash/tuning.py``);
* ringsplash best / JAX best / tokamax best: the fastest of each one's block candidates (``--candidates``)
  for that row, its blocks printed beside it. tokamax is used where ``import tokamax`` works.

    python scripts/bench_splash_tpu.py                      # every row (on a v5e: ~8 min)
    python scripts/bench_splash_tpu.py --quick              # causal 16K and 32K only
    python scripts/bench_splash_tpu.py --rows causal:32768:fwd,causal:32768:bwd --candidates all
    python scripts/bench_splash_tpu.py --rows causal:4096:fwd --rounds 3   # each entry 3x, order reversed each round

It refuses to run without a TPU (CPU timings of these kernels mean nothing).
"""

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import _figures
from _bench import LOG_DIR, median_of, open_log

HEADS, HEAD_DIM = 16, 128
FWD_LENGTHS = (4096, 8192, 16384, 32768, 65536)
BWD_LENGTHS = (4096, 8192, 16384, 32768)
MASKS = ("causal", "local", "docs")
WINDOW, DOCS = 4096, 16
BWD_FACTOR = 3.5  # fwd + bwd FLOPs / fwd FLOPs (2 + 5 matmuls over 2)
# (block_q, block_kv, block_kv_compute) candidates; backward blocks follow (block_q_dkv, block_kv_dkv)
CANDIDATES = {
    "ringsplash": [(1024, 1024, 1024), (1024, 1024, 512), (2048, 1024, 1024), (1024, 2048, 1024), (512, 1024, 1024)],
    "jax": [(512, 512, 512), (1024, 1024, 512), (1024, 1024, 1024), (2048, 1024, 512)],
    "tokamax": [(512, 512, 512), (1024, 1024, 512), (1024, 1024, 1024), (2048, 1024, 512)],
}


@dataclasses.dataclass(frozen=True)
class Row:
    mask: str  # causal | local | docs
    seq_len: int
    bwd: bool
    heads: int = HEADS
    kv_heads: int = HEADS
    head_dim: int = HEAD_DIM

    @property
    def label(self) -> str:
        extra = []
        if self.head_dim != HEAD_DIM:
            extra.append(f"d={self.head_dim}")
        if self.kv_heads != self.heads:
            extra.append(f"GQA {self.heads // self.kv_heads}:1")
        name = {"causal": "causal", "local": f"window {WINDOW}", "docs": f"{DOCS} docs"}[self.mask]
        return f"{name} {self.seq_len // 1024}K {'fwd+bwd' if self.bwd else 'fwd'}" + (
            f" ({', '.join(extra)})" if extra else "")

    @property
    def spec(self) -> str:
        """The row as ``--rows`` spells it (its key in docs/figures.json)."""
        extra = ([f"d={self.head_dim}"] if self.head_dim != HEAD_DIM else []) + (
            [f"group={self.heads // self.kv_heads}"] if self.kv_heads != self.heads else [])
        return ":".join([self.mask, str(self.seq_len), "bwd" if self.bwd else "fwd", *extra])

    def pairs(self) -> int:
        """Attended (query, key) pairs of one head."""
        s = self.seq_len
        if self.mask == "causal":
            return s * (s + 1) // 2
        if self.mask == "local":  # keys in [q - WINDOW, q]
            return sum(min(i, WINDOW) + 1 for i in range(s))
        n = s // DOCS
        return DOCS * n * (n + 1) // 2

    def flops(self) -> float:
        fwd = 4.0 * self.heads * self.pairs() * self.head_dim
        return fwd * (BWD_FACTOR if self.bwd else 1.0)


def default_rows() -> list[Row]:
    rows = [Row(m, s, False) for m in MASKS for s in FWD_LENGTHS]
    rows += [Row(m, s, True) for m in MASKS for s in BWD_LENGTHS]
    for bwd in (False, True):
        rows += [Row("causal", 16384, bwd, head_dim=64), Row("causal", 16384, bwd, head_dim=256),
                 Row("causal", 16384, bwd, kv_heads=HEADS // 4)]
    return rows


def parse_rows(text: str) -> list[Row]:
    rows = []
    for item in text.split(","):
        mask, s, kind, *rest = item.split(":")
        extra = dict(kv.split("=") for kv in rest)
        rows.append(Row(mask, int(s), kind == "bwd", kv_heads=HEADS // int(extra.get("group", 1)),
                        head_dim=int(extra.get("d", HEAD_DIM))))
    return rows


def segment_ids(row: Row):
    return np.repeat(np.arange(DOCS, dtype=np.int32), row.seq_len // DOCS)


def inputs(row: Row):
    kq, kk, kv, kd = jax.random.split(jax.random.key(0), 4)
    shape_q = (row.heads, row.seq_len, row.head_dim)
    shape_kv = (row.kv_heads, row.seq_len, row.head_dim)
    q = jax.random.normal(kq, shape_q, jnp.bfloat16)
    k = jax.random.normal(kk, shape_kv, jnp.bfloat16)
    v = jax.random.normal(kv, shape_kv, jnp.bfloat16)
    do = jax.random.normal(kd, shape_q, jnp.bfloat16)
    return q, k, v, do


def timed(fn, args, repeats: int, back_to_back: int = 1) -> float:
    """Median milliseconds of ``fn(*args)`` (compiled first). Each of the ``repeats`` samples
    dispatches ``back_to_back`` calls and blocks on the last: per call, its time over that count.
    1 blocks on every call (its host round trip counted); more hide it, as a training loop does."""
    jax.block_until_ready(fn(*args))

    def burst():
        out = None
        for _ in range(back_to_back):
            out = fn(*args)
        jax.block_until_ready(out)

    return 1e3 * median_of(burst, repeats)[0] / back_to_back


def with_grad(attn, bwd: bool):
    """``attn(q, k, v, *rest)`` or its forward+backward ``(q, k, v, do, *rest)`` (value and the q, k, v
    gradients), jitted; ``rest``: further jit arguments (segment ids), passed through."""
    if not bwd:
        return jax.jit(attn)

    def loss(q, k, v, do, *rest):
        return jnp.vdot(attn(q, k, v, *rest).astype(jnp.float32), do.astype(jnp.float32))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


# ----------------------------------------------------------------------------------------
# the implementations: each returns attn(q, k, v) for a row and a candidate, or raises


def _five(cand):
    """(block_q, block_kv, block_kv_compute, block_q_dkv, block_kv_dkv); a 3-tuple reuses (block_q, block_kv)."""
    return (*cand, *cand[:2]) if len(cand) == 3 else tuple(cand)


#: ``SplashConfig`` fields set on every ringsplash config of the run (``--set``)
OVERRIDES: dict = {}


def parse_overrides(text: str | None) -> dict:
    """``key=value,...`` -> SplashConfig keyword arguments (ints, true/false, else strings)."""
    out = {}
    for item in (text or "").split(","):
        if not item:
            continue
        key, value = item.split("=", 1)
        low = value.lower()
        out[key] = True if low == "true" else False if low == "false" else int(value) if value.isdigit() else value
    return out


def ringsplash_fn(row: Row, cand, overrides: dict | None = None):
    import ringsplash as rs
    from ringsplash import masks

    s = row.seq_len
    mask = {"causal": masks.CausalMask((s, s)), "local": masks.LocalMask((s, s), window=(WINDOW, 0)),
            "docs": masks.CausalMask((s, s))}[row.mask]
    overrides = OVERRIDES if overrides is None else overrides
    if cand is None:
        config = rs.SplashConfig(**{"backend": "mosaic_tpu", **overrides})
    else:  # (block_q, block_kv, block_kv_compute[, block_q_dkv, block_kv_dkv]); the VMEM limit is set by ringsplash
        bq, bkv, bkvc, bq_dkv, bkv_dkv = _five(cand)
        config = rs.SplashConfig(**{"block_q": bq, "block_kv": bkv, "block_kv_compute": bkvc, "block_q_dkv": bq_dkv,
                                    "block_kv_dkv": bkv_dkv, "backend": "mosaic_tpu", **overrides})
    seg = rs.SegmentIds(q=segment_ids(row), kv=segment_ids(row)) if row.mask == "docs" else None
    return lambda q, k, v: rs.splash_attention(q, k, v, mask, config=config, segment_ids=seg)


def _peer_mask(lib, row: Row):
    s = row.seq_len
    if row.mask == "local":
        return lib.LocalMask((s, s), window_size=(WINDOW, 0), offset=0)
    return lib.CausalMask((s, s))


def _grouped(make_kernel, row: Row, segments):
    """A kernel over [heads, S, d] q for peers whose GQA entry point is MQA (one kv head): vmapped over
    kv heads."""
    group = row.heads // row.kv_heads
    kernel = make_kernel(group, mqa=group > 1)

    def attn(q, k, v):
        if group == 1:
            return kernel(q, k, v, segment_ids=segments) if segments is not None else kernel(q, k, v)
        qg = q.reshape(row.kv_heads, group, row.seq_len, row.head_dim)
        call = (lambda a, b, c: kernel(a, b, c, segment_ids=segments)) if segments is not None else kernel
        return jax.vmap(call)(qg, k, v).reshape(q.shape)

    return attn


def jax_fn(row: Row, cand):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    bq, bkv, bkvc, bq_dkv, bkv_dkv = _five(cand)
    sizes = sk.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkvc, block_q_dkv=bq_dkv, block_kv_dkv=bkv_dkv,
                          block_kv_dkv_compute=min(bkvc, bkv_dkv), use_fused_bwd_kernel=True)

    def make(group, mqa):
        heads = group if mqa else row.heads
        mask = sm.MultiHeadMask([_peer_mask(sm, row)] * heads)
        return (sk.make_splash_mqa_single_device if mqa else sk.make_splash_mha_single_device)(
            mask, block_sizes=sizes)

    seg = sk.SegmentIds(q=jnp.asarray(segment_ids(row)), kv=jnp.asarray(segment_ids(row))) \
        if row.mask == "docs" else None
    return _grouped(make, row, seg)


def tokamax_fn(row: Row, cand):
    from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_kernel as tk
    from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_mask as tm

    bq, bkv, bkvc, bq_dkv, bkv_dkv = _five(cand)
    config = tk.SplashConfig(block_q=bq, block_kv=bkv, block_kv_compute=bkvc, block_q_dkv=bq_dkv,
                             block_kv_dkv=bkv_dkv, block_kv_dkv_compute=min(bkvc, bkv_dkv), use_fused_bwd_kernel=True,
                             dq_reduction_steps=3)

    def make(group, mqa):  # tokamax 0.0.12 takes one 2-D mask for every head
        return (tk.make_splash_mqa_single_device if mqa else tk.make_splash_mha_single_device)(
            _peer_mask(tm, row), config=config)

    seg = tk.SegmentIds(q=jnp.asarray(segment_ids(row)), kv=jnp.asarray(segment_ids(row))) \
        if row.mask == "docs" else None
    return _grouped(make, row, seg)


IMPLS = {"ringsplash": ringsplash_fn, "jax": jax_fn, "tokamax": tokamax_fn}


def tokamax_available() -> bool:
    try:
        import tokamax  # noqa: F401
    except Exception as exc:
        print(f"tokamax not used: {type(exc).__name__}: {exc}", file=sys.stderr)
        return False
    return True


def measure(row: Row, impl: str, cand, repeats: int, log, back_to_back: int = 1) -> tuple[float | None, str]:
    q, k, v, do = inputs(row)
    start = time.perf_counter()
    try:
        fn = with_grad(IMPLS[impl](row, cand), row.bwd)
        ms = timed(fn, (q, k, v, do) if row.bwd else (q, k, v), repeats, back_to_back)
        note = ""
    except Exception as exc:
        ms, note = None, " ".join(f"{type(exc).__name__}: {exc}".split())[:160]
    log.write(json.dumps(dict(row=row.label, impl=impl, blocks=cand, ms=ms, error=note or None,
                              wall_s=round(time.perf_counter() - start, 1))) + "\n")
    log.flush()
    return ms, note


class RowResult(NamedTuple):
    default: float | None  # ringsplash's default config: its fastest round (ms), None if every round failed
    default_error: str  # the last round's error when ``default`` is None
    default_spread: float  # its slowest round over its fastest (1.0 with one round)
    best: dict  # implementation -> (ms, candidate) of its fastest candidate and round, (None, None) if none ran


def measure_row(measure_one, candidates: dict, rounds: int) -> RowResult:
    """Measure one row: ringsplash's default and each implementation's candidates, ``rounds`` times, the
    order reversed every other round, so that a slow spell of the chip (one process measured the same
    row 1.9x slower once, 2026-12-06) falls on each side; each entry keeps its fastest round.
    ``measure_one(impl, cand) -> (ms or None, error)``; ``candidates``: implementation -> its candidates."""
    if rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {rounds}")
    entries = [("ringsplash", None)] + [(impl, cand) for impl, cands in candidates.items() for cand in cands]
    rounds_ms = [[] for _ in entries]  # per entry: the ms of each round that ran
    error = ""
    for r in range(rounds):
        for i in (range(len(entries)) if r % 2 == 0 else reversed(range(len(entries)))):
            ms, note = measure_one(*entries[i])
            if ms is not None:
                rounds_ms[i].append(ms)
            elif i == 0:
                error = note
    best = {}
    for impl in candidates:
        ran = [(min(rounds_ms[i]), cand) for i, (name, cand) in enumerate(entries)
               if i > 0 and name == impl and rounds_ms[i]]  # entry 0, the default, is no candidate of ringsplash's
        best[impl] = min(ran) if ran else (None, None)
    default = rounds_ms[0]
    return RowResult(min(default) if default else None, error, max(default) / min(default) if default else 1.0, best)


def record_row(row: Row, result: RowResult, impls: list[str], args, device_kind: str) -> None:
    """``splash_tpu/<row spec>`` in docs/figures.json: ringsplash's default and each peer's best, ms and TF/s,
    and the faster peer's time over the default."""
    tf = lambda ms: round(row.flops() / (ms * 1e-3) / 1e12, 1)
    values = {"ringsplash_ms": round(result.default, 3), "ringsplash_tflops": tf(result.default)}
    peers = []
    for impl in impls:
        ms = result.best[impl][0]
        if impl != "ringsplash" and ms:
            values |= {f"{impl}_ms": round(ms, 3), f"{impl}_tflops": tf(ms)}
            peers.append(ms)
    if peers:
        values["faster_peer_over_ringsplash"] = round(min(peers) / result.default, 3)
    values["timing"] = (f"back to back, {args.back_to_back} calls a sample" if args.back_to_back > 1
                        else "blocked on every call") + f", {args.rounds} round(s)"
    _figures.record("splash_tpu", row.spec, values, _figures.provenance(device_kind))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--rows", help="mask:S:fwd|bwd[:d=N][:group=G], comma-separated (default: every row)")
    parser.add_argument("--quick", action="store_true", help="causal 16K and 32K, forward and forward+backward")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per measurement (median)")
    parser.add_argument("--back-to-back", type=int, default=1,
                        help="calls per timed sample, dispatched back to back with one block at the end "
                             "(1: every call blocked on)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure every entry of a row this many times, the order reversed each round (the "
                             "default first, then the peers; then the other way); each one's fastest round is shown")
    parser.add_argument("--candidates", default="best", choices=("best", "all", "none"),
                        help="best / all: the candidate blocks of each implementation; none: only ringsplash's default")
    parser.add_argument("--impls", default="ringsplash,jax,tokamax", help="implementations with candidates")
    parser.add_argument("--log", default=os.path.join(LOG_DIR, "bench_splash_tpu.jsonl"), help="one JSON line per measurement")
    parser.add_argument("--record", action="store_true",
                        help="write each row's default and peers' times into docs/figures.json (scripts/_figures.py)")
    parser.add_argument("--set", dest="overrides",
                        help="SplashConfig fields for every ringsplash config, key=value,... (e.g. "
                             "skip_empty_quadrants=false)")
    for impl in CANDIDATES:
        parser.add_argument(f"--{impl}-candidates", help="bq,bkv,bkv_compute[,bq_dkv,bkv_dkv];... (replaces the list)")
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("rounds", "back_to_back"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")

    device = jax.devices()[0]
    if device.platform != "tpu":
        sys.exit(f"bench_splash_tpu.py measures TPU kernels; this process sees {device.platform!r} devices")
    import jaxlib
    try:
        from importlib.metadata import version
        libtpu = version("libtpu")
    except Exception:
        libtpu = "?"
    print(f"device: {device.device_kind} x{jax.device_count()}, jax {jax.__version__}, jaxlib {jaxlib.__version__}, "
          f"libtpu {libtpu}")
    OVERRIDES.update(parse_overrides(args.overrides))
    if OVERRIDES:
        print(f"ringsplash configs with {OVERRIDES}")
    rows = parse_rows(args.rows) if args.rows else (
        [Row("causal", s, b) for b in (False, True) for s in (16384, 32768)] if args.quick else default_rows())
    impls = [i for i in args.impls.split(",") if i != "tokamax" or tokamax_available()]
    for impl in CANDIDATES:
        if getattr(args, f"{impl}_candidates"):
            CANDIDATES[impl] = [tuple(int(x) for x in c.split(",")) for c in getattr(args, f"{impl}_candidates").split(";")]
    print("| row | ringsplash default ms (TF/s) | " + " | ".join(f"{i} best ms (TF/s) [blocks]" for i in impls)
          + " | " + " | ".join(f"{i} best / default" for i in impls)
          + (" | default's slowest / fastest round" if args.rounds > 1 else "") + " |")
    print("|---|---|" + "---|" * (2 * len(impls) + (args.rounds > 1)))
    with open_log(args.log) as log:
        # warm-up: the first measurement of a process ran ~12% slow (clocks / allocator), so discard one
        measure(rows[0], "ringsplash", None, args.repeats, log, args.back_to_back)
        for row in rows:
            tf = lambda ms, row=row: row.flops() / (ms * 1e-3) / 1e12
            candidates = {impl: [] if args.candidates == "none" else CANDIDATES[impl] for impl in impls}
            result = measure_row(lambda impl, cand, row=row: measure(row, impl, cand, args.repeats, log,
                                                                     args.back_to_back),
                                 candidates, args.rounds)
            base = result.default
            cells = [f"{base:.2f} ({tf(base):.0f})" if base else f"error: {result.default_error}"]
            ratios = []
            for impl in impls:
                ms, cand = result.best[impl]
                cells.append(f"{ms:.2f} ({tf(ms):.0f}) {list(cand)}" if ms else "-")
                ratios.append(f"{ms / base:.2f}" if ms and base else "-")
            spread = f" | {result.default_spread:.2f}" if args.rounds > 1 else ""
            print(f"| {row.label} | " + " | ".join(cells) + " | " + " | ".join(ratios) + spread + " |", flush=True)
            if args.record and base:
                record_row(row, result, impls, args, device.device_kind)


if __name__ == "__main__":
    main()
