"""Benchmark on a TPU chip: the library's training step (``ringsplash.train.make_train_step``: forward, backward
and the AdamW update, one jitted program) on the model of issue 40, in tokens/s and MFU.

Model: 8 layers, d_model 1024, 8 heads of 128, SwiGLU 4096 (``--vocab``, default 32768), float32 master
weights with bfloat16 compute, ``remat="full"``, batch 1; one document per row (the batch carries segment
ids, as the trainer's always do). Rows:

* (a) the step at each ``--seq-lens`` (default 16K) with ringsplash's Splash attention (``SplashConfig()``);
* (c) the same step with the attention swapped (``--attention``): ``ringsplash-noseg`` (ringsplash without the
  batch's segment ids, which is what the peers see), ``xla`` (``jax.nn.dot_product_attention``,
  ``implementation="xla"``), ``jax-splash`` (JAX's ``make_splash_mha_single_device``, fused backward,
  ``--jax-blocks``, vmapped over the batch rows); the peers replace the model's ``attend`` while the step is
  traced (``_model_bench.attention_override``; nothing in the library changes). The loss column is the first
  step's: the same batch and initialisation, so it agrees between implementations;
* (b) ``--find-largest``: at each ``--find-lengths`` (default 32K, 64K) the most layers of this width that
  train on the chip (one step runs; an out-of-memory error at compile or run time means no), found by doubling
  from ``--layers`` then bisecting, then timed.

MFU = FLOPs per step / step time / the chip's bfloat16 peak (a table per chip, or ``--peak-tflops``). FLOPs
count useful work only: 6 per parameter per token (forward 2, backward 4) for the non-embedding parameters N
(every layer + the final norm) and the unembedding matmul (d_model x vocab), plus causal attention, forward
4·dh per attended (query, key) pair per head, S(S+1)/2 pairs per head per layer, x3 for forward + backward.
The embedding lookup and remat's recomputed forward are not counted. Step time: ``--steps`` steps dispatched
back to back (a fresh batch each: the step donates it), one block at the end; median of ``--repeats``.

    python scripts/bench_train_tpu.py                                  # (a) + (c) at 16K
    python scripts/bench_train_tpu.py --seq-lens 8192,16384,32768 --find-largest
    python scripts/bench_train_tpu.py --attention ringsplash --profile /tmp/train_trace
    python scripts/bench_train_tpu.py --cpu-smoke                      # tiny shapes on the CPU (CI)

It refuses to run without a TPU, except with ``--cpu-smoke`` (tiny shapes, JAX's splash in interpret mode;
CPU times, never a TPU speed).
"""

import argparse
import dataclasses
import gc
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _figures
import _model_bench as mb
from _bench import LOG_DIR, open_log

ATTENTIONS = ("ringsplash", "ringsplash-noseg", "xla", "jax-splash")
TRAIN_STRATEGIES = ("splash", "ring", "allgather", "ulysses")  # one mesh axis each (usp needs two)
SMOKE_SHAPE = mb.Shape(layers=2, d_model=256, heads=2, kv_heads=2, head_dim=128, mlp=512, vocab=256)


@dataclasses.dataclass(frozen=True)
class Result:
    step_s: float | None  # median seconds per step
    loss: float | None  # the first step's loss
    error: str | None = None
    oom: bool = False


def peer(name: str, args):
    """The attention override of ``name`` (None: the library's own)."""
    if name == "ringsplash":
        return None
    if name == "ringsplash-noseg":
        return mb.without_segment_ids
    if name == "xla":
        return mb.xla_attention
    return mb.jax_splash_attention(tuple(args.jax_blocks), interpret=args.cpu_smoke)


def train_flops(config, counts: mb.Counts, batch: int, seq_len: int) -> float:
    """Useful FLOPs of one training step (see the module docstring)."""
    weights = 6.0 * (counts.body + counts.unembedding) * batch * seq_len
    return weights + 3.0 * batch * mb.causal_attention_flops(config, seq_len)


def make_batch(config, batch: int, seq_len: int, seed: int):
    """One batch of random tokens, one document per row, every position scored."""
    import numpy as np

    from ringsplash.data import Batch

    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, config.vocab_size, (batch, seq_len + 1), dtype=np.int32)
    positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (batch, seq_len)).copy()
    return Batch(tokens=tokens[:, :-1].copy(), labels=tokens[:, 1:].copy(),
                 loss_mask=np.ones((batch, seq_len), np.float32), positions=positions,
                 segment_ids=np.zeros((batch, seq_len), np.int32))


def run_step(config, attention: str, args, *, batch: int, seq_len: int, timed: bool, profile_dir: str | None = None):
    """Build the state and the step, compile and run it (``timed``: then time ``--steps`` x ``--repeats``)."""
    import jax

    from ringsplash import train

    loss_chunk = math.gcd(args.loss_chunk, batch * seq_len)  # a divisor of the tokens (0 stays 0: unchunked)
    tc = train.TrainConfig(steps=1000, batch_size=batch, warmup_steps=10, loss_chunk=loss_chunk, progress=False)
    mesh = train.mesh_for(config)
    state = step = None
    try:
        state = train.init_state(config, tc)
        # on the mesh as the step returns them (replicated NamedSharding), so the first step compiles the
        # program every later step runs: from init_state's uncommitted single-device arrays it compiled twice
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        model, opt_state = jax.device_put((state.model, state.opt_state), replicated)
        state = None
        step = train.make_train_step(config, train.make_optimizer(tc), mesh, loss_chunk=loss_chunk)
        host = make_batch(config, batch, seq_len, seed=0)
        place = lambda: train.shard_batch(host, mesh, config)
        with mb.attention_override(peer(attention, args)) as calls:
            model, opt_state, metrics = step(model, opt_state, place(), jax.random.key(0))
            loss = float(metrics["loss"])  # blocks: compile + the first step
        if attention != "ringsplash" and not calls:
            raise RuntimeError(f"the {attention!r} attention was never traced into the step: the model no longer "
                               "picks its attention through ringsplash.model.attention.attend")
        if not timed:
            return Result(None, loss)
        model, opt_state, metrics = step(model, opt_state, place(), jax.random.key(1))  # discarded warm-up
        jax.block_until_ready(metrics)
        times = []
        for r in range(args.repeats):
            batches = [place() for _ in range(args.steps)]
            keys = [jax.random.key(2 + r * args.steps + i) for i in range(args.steps)]
            jax.block_until_ready(batches)
            t0 = time.perf_counter()
            for b, k in zip(batches, keys):
                model, opt_state, metrics = step(model, opt_state, b, k)
            jax.block_until_ready((model, opt_state, metrics))
            times.append((time.perf_counter() - t0) / args.steps)
        if profile_dir:
            profile(step, model, opt_state, place, profile_dir, args)
        return Result(statistics.median(times), loss)
    except Exception as exc:
        if args.raise_errors and not mb.is_oom(exc):
            raise
        return Result(None, None, mb.short_error(exc), mb.is_oom(exc))
    finally:
        del state, step
        gc.collect()
        jax.clear_caches()


def profile(step, model, opt_state, place, trace_dir: str, args) -> None:
    """``--profile-steps`` steps under ``jax.profiler.trace`` (Perfetto), device ops read back by
    ``profile_splash_tpu.device_op_times``: the top ``--top`` by time per step."""
    import jax

    import profile_splash_tpu

    os.makedirs(trace_dir, exist_ok=True)
    run_dir = os.path.join(trace_dir, time.strftime("train-%Y%m%d-%H%M%S"))
    batches = [place() for _ in range(args.profile_steps)]
    with jax.profiler.trace(run_dir, create_perfetto_trace=True):
        for i, b in enumerate(batches):
            model, opt_state, metrics = step(model, opt_state, b, jax.random.key(100 + i))
        jax.block_until_ready((model, opt_state, metrics))
    ops = profile_splash_tpu.device_op_times(run_dir, args.profile_steps)
    print(f"\nprofile ({run_dir}): device total {sum(ms for _, ms, _ in ops):.2f} ms per step")
    print("| op | ms per step | per step |\n|---|---|---|")
    for name, ms, n in ops[:args.top]:
        print(f"| {name[:90]} | {ms:.3f} | {n:g} |")


def fits(shape: mb.Shape, seq_len: int, args) -> Result:
    config = mb.model_config(shape, seq_len, param_dtype=args.param_dtype, compute_dtype=args.compute_dtype,
                             remat=args.remat)
    return run_step(config, "ringsplash", args, batch=args.batch, seq_len=seq_len, timed=False)


def find_largest(base: mb.Shape, seq_len: int, args, log) -> tuple[int | None, list[str]]:
    """The most layers (at most ``--max-layers``) of ``base``'s width whose step trains at ``seq_len``:
    doubling from ``base.layers`` (or halving down to 1 when it does not fit), then bisection."""
    tried = []

    def ok(layers: int) -> bool:
        r = fits(dataclasses.replace(base, layers=layers), seq_len, args)
        mb.log_line(log, kind="fit", seq_len=seq_len, layers=layers, fits=r.error is None, error=r.error)
        tried.append(f"{layers}: {'fits' if r.error is None else 'OOM' if r.oom else 'error'}")
        if r.error is not None and not r.oom:  # not a question of size: stop the search, say why
            raise RuntimeError(f"layers {layers} at {seq_len}: {r.error}")
        return r.error is None

    n = max(1, min(base.layers, args.max_layers))
    lo, hi = 0, None  # lo: the most layers known to fit (0: none), hi: the fewest known not to (None: none)
    if ok(n):
        lo = n
        while lo < args.max_layers:
            m = min(2 * lo, args.max_layers)
            if not ok(m):
                hi = m
                break
            lo = m
        if hi is None:
            return lo, tried
    else:
        hi = n
        while hi > 1:
            m = hi // 2
            if ok(m):
                lo = m
                break
            hi = m
        if not lo:
            return None, tried
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo, tried


def row_cells(config, counts, res: Result, batch: int, seq_len: int, peak: float | None) -> list[str]:
    if res.step_s is None:
        why = "does not fit (OOM)" if res.oom else f"error: {res.error}"
        return ["-", "-", "-", "-", "-", why]
    flops = train_flops(config, counts, batch, seq_len)
    tflops = flops / res.step_s / 1e12
    mfu = f"{100 * tflops / peak:.1f}%" if peak else "-"
    step_ms = f"{1e3 * res.step_s:.{1 if res.step_s >= 0.1 else 3}f}"  # a 2.4 ms step to the microsecond
    return [step_ms, f"{batch * seq_len / res.step_s:,.0f}", f"{tflops:.3g}", mfu,
            f"{res.loss:.4f}", ""]


def record_row(config, counts, res: Result, attention: str, label: str, batch: int, seq_len: int,
               peak: float | None, device_kind: str) -> None:
    """``train_tpu/<attention>:<S>:<layers x d_model>`` in docs/figures.json: step ms, tokens/s, TF/s, MFU."""
    if res.step_s is None:
        values = {"error": "out of memory" if res.oom else str(res.error)}
    else:
        tflops = train_flops(config, counts, batch, seq_len) / res.step_s / 1e12
        values = {"step_ms": round(1e3 * res.step_s, 1), "tokens_per_s": round(batch * seq_len / res.step_s),
                  "tflops": round(tflops, 1), "batch": batch}
        if peak:
            values["mfu_pct"] = round(100 * tflops / peak, 1)
    _figures.record("train_tpu", f"{attention}:{seq_len}:{label}", values, _figures.provenance(device_kind))


HEADER = ("| row | attention | model (layers x d_model) | S | batch | step ms | tokens/s | TF/s | MFU | first loss "
          "| note |")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--seq-lens", default="16384", help="sequence lengths of rows (a) and (c), comma-separated")
    p.add_argument("--attention", default=",".join(ATTENTIONS), help=f"comma-separated, of {ATTENTIONS}")
    p.add_argument("--strategies", default="splash",
                   help="comma-separated context-parallel strategies of the model (ContextParallel(strategy): "
                        "splash on one device, or ring / allgather / ulysses over the chip's one-device axis); "
                        "each runs with the library's own attention (default %(default)s)")
    p.add_argument("--batch", type=int, default=1, help="rows per step")
    p.add_argument("--layers", type=int, default=8, help="transformer layers (default %(default)s)")
    p.add_argument("--d-model", type=int, default=1024, help="model width (default %(default)s)")
    p.add_argument("--heads", type=int, default=8, help="query heads (default %(default)s)")
    p.add_argument("--kv-heads", type=int, default=8, help="key/value heads (GQA when fewer; default %(default)s)")
    p.add_argument("--head-dim", type=int, default=128, help="head size (default %(default)s)")
    p.add_argument("--mlp", type=int, default=4096, help="SwiGLU hidden width")
    p.add_argument("--vocab", type=int, default=32768, help="vocabulary size (default %(default)s; the recall task of the issue used ~100)")
    p.add_argument("--param-dtype", default="float32", help="master weights")
    p.add_argument("--compute-dtype", default="bfloat16", help="activations / matmul dtype (weights stay float32)")
    p.add_argument("--remat", default="full", help="none | full | save_attention | save_dots")
    p.add_argument("--loss-chunk", type=int, default=4096, help="tokens per chunk of the cross-entropy, capped to a divisor of B·S (0: all at once)")
    p.add_argument("--jax-blocks", type=int, nargs=3, default=[1024, 1024, 512], metavar=("BQ", "BKV", "BKV_C"),
                   help="JAX splash blocks (block_q, block_kv, block_kv_compute; dK/dV the same)")
    p.add_argument("--steps", type=int, default=5, help="steps per timed run")
    p.add_argument("--repeats", type=int, default=3, help="timed runs (the median is printed)")
    p.add_argument("--find-largest", action="store_true", help="row (b): the most layers that train at each length")
    p.add_argument("--find-lengths", default="32768,65536", help="lengths of --find-largest, comma-separated")
    p.add_argument("--max-layers", type=int, default=64, help="upper bound of --find-largest")
    p.add_argument("--peak-tflops", type=float, help="the chip's peak TF/s (default: the table for the device kind)")
    p.add_argument("--profile", metavar="DIR", help="trace --profile-steps steps of the first ringsplash row here "
                   "and print the top device ops")
    p.add_argument("--profile-steps", type=int, default=3, help="steps traced with --profile")
    p.add_argument("--top", type=int, default=15, help="ops printed by --profile")
    p.add_argument("--log", default=os.path.join(LOG_DIR, "bench_train_tpu.jsonl"), help="one JSON line per measurement (appended)")
    p.add_argument("--record", action="store_true",
                   help="write each (a)/(c) row's step time and MFU into docs/figures.json (scripts/_figures.py)")
    p.add_argument("--raise-errors", action="store_true", help="raise errors other than out-of-memory")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny shapes on the CPU (2 layers, d_model 256, S 256, 1 timed step): checks the script")
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    attentions = args.attention.split(",")
    unknown = set(attentions) - set(ATTENTIONS)
    if unknown:
        sys.exit(f"--attention {sorted(unknown)} not known: expected some of {ATTENTIONS}")
    strategies = ["splash", *(x for x in args.strategies.split(",") if x and x != "splash")]
    bad = set(strategies) - set(TRAIN_STRATEGIES)
    if bad:
        sys.exit(f"--strategies {sorted(bad)} not known: expected some of {TRAIN_STRATEGIES}")
    device = mb.start("bench_train_tpu.py", args.cpu_smoke)
    from ringsplash.model import ContextParallel
    shape = mb.Shape(args.layers, args.d_model, args.heads, args.kv_heads, args.head_dim, args.mlp, args.vocab)
    seq_lens = [int(s) for s in args.seq_lens.split(",")]
    find_lengths = [int(s) for s in args.find_lengths.split(",")]
    if args.cpu_smoke:
        shape, seq_lens, find_lengths = SMOKE_SHAPE, [256], [512]
        args.steps, args.repeats, args.max_layers, args.jax_blocks = 1, 1, 2, [128, 128, 128]
    peak = mb.chip_rate(mb.PEAK_BF16_TFLOPS, device, args.peak_tflops)
    print(mb.device_line(device))
    if args.cpu_smoke:
        print("--cpu-smoke: tiny shapes on the CPU, JAX's splash interpreted: these are CPU times, not a TPU speed")
    print(f"peak: {f'{peak:g} TF/s bf16' if peak else 'unknown (no MFU column; --peak-tflops sets it)'}; "
          f"params {args.param_dtype}, compute {args.compute_dtype}, remat {args.remat}, loss chunk "
          f"{args.loss_chunk}, vocab {shape.vocab}")
    config = mb.model_config(shape, max(seq_lens), param_dtype=args.param_dtype, compute_dtype=args.compute_dtype,
                             remat=args.remat)
    counts = mb.param_counts(config)
    print(f"FLOPs per step = 6·(N + d_model·V)·B·S + 3·L·4·H·dh·B·S(S+1)/2, with N = {counts.body:,} non-embedding "
          f"parameters (every layer + the final norm), d_model·V = {counts.unembedding:,} (the unembedding, a "
          f"matmul), L = {shape.layers}, H·dh = {shape.heads * shape.head_dim}; the embedding lookup "
          f"({counts.embedding:,}) and remat recompute not counted")
    print(f"step time: {args.steps} steps back to back, one block at the end; median of {args.repeats}\n")
    print(HEADER)
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    profiled = False
    with open_log(args.log) as log:
        for s in seq_lens:
            cfg = config.replace(max_seq_len=s)
            for strategy in strategies[1:]:  # the library's attention under another strategy, beside splash's rows
                scfg = cfg.replace(context_parallel=ContextParallel(strategy))
                res = run_step(scfg, "ringsplash", args, batch=args.batch, seq_len=s, timed=True)
                cells = row_cells(scfg, counts, res, args.batch, s, peak)
                mb.log_line(log, kind="train", device=device.device_kind, attention=f"ringsplash {strategy}",
                            shape=shape.label, seq_len=s, batch=args.batch, step_s=res.step_s, loss=res.loss,
                            error=res.error, flops=train_flops(scfg, counts, args.batch, s), peak_tflops=peak)
                print(f"| (a) | ringsplash {strategy} | {shape.label} | {s} | {args.batch} | " + " | ".join(cells)
                      + " |", flush=True)
            for attention in attentions:
                prof = args.profile if attention == "ringsplash" and not profiled else None
                res = run_step(cfg, attention, args, batch=args.batch, seq_len=s, timed=True, profile_dir=prof)
                profiled = profiled or prof is not None
                cells = row_cells(cfg, counts, res, args.batch, s, peak)
                mb.log_line(log, kind="train", device=device.device_kind, attention=attention, shape=shape.label,
                            seq_len=s, batch=args.batch, step_s=res.step_s, loss=res.loss, error=res.error,
                            flops=train_flops(cfg, counts, args.batch, s), peak_tflops=peak)
                print(f"| (a)/(c) | {attention} | {shape.label} | {s} | {args.batch} | " + " | ".join(cells) + " |",
                      flush=True)
                if args.record and not args.cpu_smoke:
                    record_row(cfg, counts, res, attention, shape.label, args.batch, s, peak, device.device_kind)
        if not args.find_largest:
            return
        for s in find_lengths:
            try:
                layers, tried = find_largest(shape, s, args, log)
            except RuntimeError as exc:
                print(f"| (b) largest | ringsplash | search stopped: {exc} | {s} | {args.batch} |" + " - |" * 6)
                continue
            if layers is None:
                print(f"| (b) largest | ringsplash | none fits ({'; '.join(tried)}) | {s} | {args.batch} |"
                      + " - |" * 6, flush=True)
                continue
            big = dataclasses.replace(shape, layers=layers)
            cfg = mb.model_config(big, s, param_dtype=args.param_dtype, compute_dtype=args.compute_dtype,
                                  remat=args.remat)
            big_counts = mb.param_counts(cfg)
            res = run_step(cfg, "ringsplash", args, batch=args.batch, seq_len=s, timed=True)
            cells = row_cells(cfg, big_counts, res, args.batch, s, peak)
            cells[-1] = (cells[-1] + "; " if cells[-1] else "") + f"layers tried: {', '.join(tried)}"
            mb.log_line(log, kind="largest", device=device.device_kind, shape=big.label, seq_len=s, step_s=res.step_s,
                        layers=layers, tried=tried, flops=train_flops(cfg, big_counts, args.batch, s))
            print(f"| (b) largest | ringsplash | {big.label} ({big_counts.body / 1e6:.0f}M) | {s} | {args.batch} | "
                  + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
