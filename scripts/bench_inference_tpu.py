"""Benchmark on a TPU chip: prefill and decoding (``ringsplash.inference``) on the model of issue 40 and its GQA
8:2 variant, beside the chip's peak FLOP/s and HBM-bandwidth roofline.

Models: 8 layers, d_model 1024, 8 heads of 128 (GQA: 2 kv heads), SwiGLU 4096, ``--vocab`` (default 32768),
bfloat16 parameters and compute, Splash attention (``SplashConfig()``). For each prompt length (``--prompt-lens``,
default 8K, 32K, 128K) and batch (``--batches``, default 1 and 8), where it fits (an out-of-memory error at
compile or run time is reported as such; a KV cache larger than the chip's HBM is not tried):

* prefill: ``rs.inference.prefill`` of random prompts (cache of ``prompt + --room`` slots, rounded up to 128),
  median seconds of ``--repeats`` calls after a compile; its logits must be ``[batch, vocab]`` (the last
  prompt token's only: no logits for every position). TF/s and MFU count useful FLOPs:
  ``B·(2·N·P + 2·d_model·V + L·4·H·dh·P(P+1)/2)`` for P prompt tokens, N the non-embedding parameters (every
  layer + the final norm), the unembedding of the last token, causal attention forward (2 FLOPs per
  multiply-add of QK^T and PV over the attended pairs); the padding to the cache length is not counted;
* decode: the jitted program ``generate`` launches (greedy, the cache donated): ``--steps-per-program`` tokens
  per call (default ``generate.STEPS_PER_PROGRAM``: ``decode_steps``; 1: ``decode_step``; a list gives a row
  each) timed directly: ``--decode-steps`` steps dispatched back to back after two warm-up calls, one block at
  the end, milliseconds per step = total / steps (median of ``--repeats``); tokens/s = batch / step time;
  ``--generate-tokens N`` adds ``generate`` itself, (its time for 1 + N tokens - for 1) / N, with
  ``bucket=False`` (the cache of the prompt and the new tokens, rounded up to 128 slots) or, with
  ``--generate-bucket``, its default ``bucket=True`` (the cache of ``bucket_length`` slots). Roofline per
  step = bytes that must be read / the chip's HBM bandwidth: every parameter as stored except the embedding
  table (B of its rows are read) + the KV cache of the tokens held (mean over the timed steps), K and V of
  every layer; the decode kernel reads the live slots only (XLA, before it, read every slot: up to ``--room``
  more than counted; ``scripts/bench_decode_tpu.py`` times generate with its defaults).
* compiles: each prefill shape must compile once and each decode shape once, with no compile while the cache
  fills: counted with ``jax.monitoring`` (one event per XLA backend compile) during the timed calls (must be
  0; a row that recompiled says so) and with the jit caches of ``_prefill_jit`` and the decode step.

    python scripts/bench_inference_tpu.py
    python scripts/bench_inference_tpu.py --prompt-lens 32768 --batches 8 --models gqa
    python scripts/bench_inference_tpu.py --prompt-lens 32768 --batches 8 --steps-per-program 1,4 --generate-tokens 64
    python scripts/bench_inference_tpu.py --cpu-smoke        # tiny shapes on the CPU (CI)

It refuses to run without a TPU, except with ``--cpu-smoke`` (CPU times, never a TPU speed).
"""

import argparse
import dataclasses
import functools
import gc
import importlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _figures
import _model_bench as mb
from _bench import LOG_DIR, open_log

MODELS = {"mha": mb.Shape(), "gqa": mb.Shape(kv_heads=2)}
SMOKE_MODELS = {"mha": mb.Shape(layers=2, d_model=256, heads=2, kv_heads=2, head_dim=128, mlp=512, vocab=256),
                "gqa": mb.Shape(layers=2, d_model=256, heads=4, kv_heads=2, head_dim=64, mlp=512, vocab=256)}
LANES = 128


@dataclasses.dataclass
class Row:
    prefill_s: float | None = None
    decode_s: float | None = None
    generate_s: float | None = None  # generate's seconds per new token (--generate-tokens)
    generate_bucket: bool = False  # generate timed with bucket=True (--generate-bucket)
    prefill_compiles: int | None = None  # _prefill_jit cache entries added by this shape
    decode_compiles: int | None = None  # decode-step cache entries after this shape
    recompiles: int = 0  # backend compiles during the timed calls (must be 0)
    note: str = ""


def prefill_flops(config, counts: mb.Counts, batch: int, prompt: int) -> float:
    return batch * (2.0 * counts.body * prompt + 2.0 * counts.unembedding) + batch * mb.causal_attention_flops(
        config, prompt)


def decode_bytes(config, counts: mb.Counts, batch: int, context: float) -> float:
    """Bytes one decode step must read: the parameters but the embedding table, B embedding rows, the KV
    cache of ``context`` tokens per row."""
    c = config
    itemsize = counts.param_bytes / (counts.body + counts.embedding + counts.unembedding)
    weights = (counts.body + counts.unembedding + batch * c.d_model) * itemsize
    kv_item = 2 if c.compute_dtype in ("bfloat16", "float16") else 4
    kv = c.num_layers * batch * c.num_kv_heads * (c.head_dim + c.v_head_dim) * context * kv_item
    return weights + kv


def cache_bytes(config, batch: int, max_len: int) -> int:
    c = config
    kv_item = 2 if c.compute_dtype in ("bfloat16", "float16") else 4
    return c.num_layers * batch * c.num_kv_heads * (c.head_dim + c.v_head_dim) * max_len * kv_item


@functools.cache
def generate_program(per_call: int, batch: int, max_len: int):
    """What ``generate`` launches per call, greedy, the cache donated: ``generate._steps`` with ``per_call``
    steps (1: ``decode_step``; more: ``decode_steps``) on a cache of ``max_len`` slots, its arguments shaped as
    ``generate`` shapes them (``max_len + per_call`` keys): ``generate`` with a cache of as many slots then runs
    this compiled program rather than compiling its own. Returns ``(model, cache, token) -> (last token, cache)``
    and the jitted function (for its compile cache)."""
    import jax
    import jax.numpy as jnp

    gen = importlib.import_module("ringsplash.inference.generate")
    settings = dict(temperature=0.0, top_k=None, top_p=None, stop=())
    keys = jax.random.split(jax.random.key(0), max_len + per_call)
    flags = jnp.zeros((batch,), bool), jnp.full((batch,), -1, jnp.int32), jnp.int32(1)  # done, nonfinite, index
    total = jnp.int32(2**31 - 1)

    def steps(model, cache, token):
        _, cache, (token, *_) = gen._steps(model, cache, (token, *flags), keys, total, steps=per_call, **settings)
        return token, cache

    return steps, gen._steps


def time_generate(model, tokens, new: int, per_call: int, repeats: int, bucket: bool = False) -> float:
    """Median seconds of ``generate(model, tokens, new, bucket=bucket)`` with ``STEPS_PER_PROGRAM = per_call``
    (compiled first)."""
    import jax

    from ringsplash.inference import generate

    gen = importlib.import_module("ringsplash.inference.generate")
    saved, gen.STEPS_PER_PROGRAM = gen.STEPS_PER_PROGRAM, per_call
    try:
        jax.block_until_ready(generate(model, tokens, new, bucket=bucket))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(generate(model, tokens, new, bucket=bucket))
            times.append(time.perf_counter() - t0)
    finally:
        gen.STEPS_PER_PROGRAM = saved
    return statistics.median(times)


def calls_per_repeat(args, per_call: int) -> int:
    return max(1, args.decode_steps // args.repeats // per_call)


def decoded(args, per_call: int) -> int:
    """Tokens the decode of one row appends to the cache: two warm-up calls, then the timed ones."""
    return per_call * (2 + args.repeats * calls_per_repeat(args, per_call))


def measure(model, config, batch: int, prompt: int, args, counter, per_call: int, timed_prefill: bool) -> Row:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ringsplash.inference import prefill

    prefill_module = importlib.import_module("ringsplash.inference.prefill")
    row = Row()
    max_len = -(-(prompt + args.room) // LANES) * LANES
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (batch, prompt), dtype=np.int32)
    step, jitted = generate_program(per_call, batch, max_len)
    stage = "prefill"
    try:
        before = prefill_module._prefill_jit._cache_size()
        out = prefill(model, tokens, max_len=max_len)
        jax.block_until_ready(out)
        row.prefill_compiles = prefill_module._prefill_jit._cache_size() - before
        if out.logits.shape != (batch, config.vocab_size):
            raise AssertionError(f"prefill returned logits of shape {out.logits.shape}, expected "
                                 f"{(batch, config.vocab_size)}: the last prompt token's only")
        if timed_prefill:
            times, start = [], counter.count
            for _ in range(args.repeats):
                out = None  # the previous call's cache freed first: one cache alive at a time
                t0 = time.perf_counter()
                out = prefill(model, tokens, max_len=max_len)
                jax.block_until_ready(out)
                times.append(time.perf_counter() - t0)
            row.prefill_s = statistics.median(times)
            row.recompiles += counter.count - start
        stage = "decode"
        cache = out.cache
        token = jnp.argmax(out.logits, -1).astype(jnp.int32)
        del out
        before = jitted._cache_size()
        for _ in range(2):  # compile + a warm-up step
            token, cache = step(model, cache, token)
        jax.block_until_ready((token, cache))
        times, start = [], counter.count
        calls = calls_per_repeat(args, per_call)
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            for _ in range(calls):
                token, cache = step(model, cache, token)
            jax.block_until_ready((token, cache))
            times.append((time.perf_counter() - t0) / (calls * per_call))
        row.decode_s = statistics.median(times)
        row.recompiles += counter.count - start
        row.decode_compiles = jitted._cache_size() - before
        del cache
        if args.generate_tokens:
            stage = "generate"
            gc.collect()
            one = time_generate(model, tokens, 1, per_call, args.repeats, args.generate_bucket)
            many = time_generate(model, tokens, 1 + args.generate_tokens, per_call, args.repeats, args.generate_bucket)
            row.generate_s, row.generate_bucket = (many - one) / args.generate_tokens, args.generate_bucket
    except Exception as exc:
        if args.raise_errors and not mb.is_oom(exc):
            raise
        row.note = f"does not fit (out of memory at {stage})" if mb.is_oom(exc) else f"{stage}: {mb.short_error(exc)}"
    finally:
        gc.collect()
    return row


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--prompt-lens", default="8192,32768,131072", help="prompt lengths, comma-separated")
    p.add_argument("--batches", default="1,8", help="batch sizes, comma-separated")
    p.add_argument("--models", default="mha,gqa", help="mha (8 kv heads) and/or gqa (2 kv heads), comma-separated")
    p.add_argument("--vocab", type=int, default=32768, help="vocabulary size (default %(default)s)")
    p.add_argument("--dtype", default="bfloat16", help="parameter and compute dtype")
    p.add_argument("--room", type=int, default=128, help="cache slots beyond the prompt (decode steps must fit)")
    p.add_argument("--decode-steps", type=int, default=60, help="timed decode steps, split over --repeats runs")
    p.add_argument("--repeats", type=int, default=3, help="timed runs (the median is printed)")
    p.add_argument("--peak-tflops", type=float, help="the chip's peak TF/s (default: the table for the device kind)")
    p.add_argument("--hbm-gbps", type=float, help="the chip's HBM GB/s (default: the table for the device kind)")
    p.add_argument("--log", default=os.path.join(LOG_DIR, "bench_inference_tpu.jsonl"), help="one JSON line per row (appended)")
    p.add_argument("--decode-unroll-up-to", type=int,
                   help="ringsplash.inference.decode.UNROLL_LAYERS_UP_TO for this run (0: the scanned layer loop)")
    p.add_argument("--steps-per-program",
                   help="decode steps per jitted program, comma-separated: a row each, the prefill timed in the "
                        "first (1: decode_step; more: decode_steps, the cache read-only inside it; default: "
                        "generate's STEPS_PER_PROGRAM)")
    p.add_argument("--generate-tokens", type=int, default=0,
                   help="also time generate end to end: (generate of 1 + N tokens - generate of 1) / N, "
                        "bucket=False (0: not)")
    p.add_argument("--generate-bucket", action="store_true",
                   help="time generate with bucket=True (its default: the cache sized by bucket_length, each step "
                        "reading the live slots with the decode kernel) instead of the exact length")
    p.add_argument("--raise-errors", action="store_true", help="raise errors other than out-of-memory")
    p.add_argument("--record", action="store_true",
                   help="write each row's prefill, decode and generate figures into docs/figures.json "
                        "(scripts/_figures.py)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny shapes on the CPU (2 layers, prompt 256, batches 1 / 2): checks the script")
    return p


HEADER = ("| model | prompt | batch | prefill s | prefill TF/s | prefill MFU | decode ms/step | decode tokens/s "
          "| roofline ms/step | % of roofline | compiles (prefill, decode) | note |")


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    device = mb.start("bench_inference_tpu.py", args.cpu_smoke)
    import jax

    from ringsplash.model import Transformer

    if args.decode_unroll_up_to is not None:
        importlib.import_module("ringsplash.inference.decode").UNROLL_LAYERS_UP_TO = args.decode_unroll_up_to
        print(f"decode_step unrolls up to {args.decode_unroll_up_to} layers")
    models = {name: dataclasses.replace(MODELS[name], vocab=args.vocab) for name in args.models.split(",")}
    prompts = [int(s) for s in args.prompt_lens.split(",")]
    batches = [int(s) for s in args.batches.split(",")]
    if args.cpu_smoke:
        models = {name: SMOKE_MODELS[name] for name in models}
        prompts, batches, args.decode_steps, args.repeats = [256], [1, 2], 4, 2
    if args.steps_per_program is None:
        args.steps_per_program = str(importlib.import_module("ringsplash.inference.generate").STEPS_PER_PROGRAM)
    per_calls = [int(k) for k in args.steps_per_program.split(",")]
    if min(per_calls) < 1:
        sys.exit(f"--steps-per-program: expected positive step counts, got {args.steps_per_program!r}")
    if args.decode_steps // args.repeats < 1 or max(decoded(args, k) for k in per_calls) > args.room:
        sys.exit(f"--decode-steps {args.decode_steps} must give each of --repeats {args.repeats} runs a step, and "
                 f"fit with the 2 warm-up calls in --room {args.room}")
    peak = mb.chip_rate(mb.PEAK_BF16_TFLOPS, device, args.peak_tflops)
    bandwidth = mb.chip_rate(mb.HBM_GBPS, device, args.hbm_gbps)
    chip = mb.chip_name(device)
    hbm = None
    if chip:
        from ringsplash import aot

        hbm = aot.chip(chip).hbm_bytes
    counter = mb.CompileCounter.install()
    print(mb.device_line(device))
    if args.cpu_smoke:
        print("--cpu-smoke: tiny shapes on the CPU: these are CPU times, not a TPU speed")
    print(f"peak: {f'{peak:g} TF/s bf16' if peak else 'unknown'}; HBM bandwidth: "
          f"{f'{bandwidth:g} GB/s' if bandwidth else 'unknown'} (--peak-tflops / --hbm-gbps set them); "
          f"dtype {args.dtype}; vocab {args.vocab if not args.cpu_smoke else 256}")
    print("prefill FLOPs = B·(2·N·P + 2·d_model·V + L·4·H·dh·P(P+1)/2), N = non-embedding parameters (every layer + "
          "the final norm); decode: generate's jitted program timed directly (calls back to back, one block at the "
          f"end; {args.steps_per_program} steps per program), roofline = (parameters but the embedding table + B embedding rows + K/V of the cached tokens) "
          "bytes / HBM bandwidth")
    for name, shape in models.items():
        config = mb.model_config(shape, max(prompts) + args.room + LANES, param_dtype=args.dtype,
                                 compute_dtype=args.dtype)
        counts = mb.param_counts(config)
        print(f"{name}: {shape.label}, {shape.heads} heads ({shape.kv_heads} kv) of {shape.head_dim}, N = "
              f"{counts.body:,}, d_model·V = {counts.unembedding:,}, {counts.param_bytes / 2**20:.0f} MiB of "
              f"parameters")
    print()
    print(HEADER)
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
    with open_log(args.log) as log:
        for name, shape in models.items():
            config = mb.model_config(shape, max(prompts) + args.room + LANES, param_dtype=args.dtype,
                                     compute_dtype=args.dtype)
            counts = mb.param_counts(config)
            model = Transformer(config, key=jax.random.key(0))
            for prompt in prompts:
                for batch in batches:
                    max_len = -(-(prompt + args.room) // LANES) * LANES
                    need = cache_bytes(config, batch, max_len)
                    if hbm is not None and need + counts.param_bytes > hbm:
                        row = Row(note=f"does not fit: KV cache {need / 2**30:.1f} GiB + parameters > "
                                       f"{hbm / 2**30:.0f} GiB HBM (not tried)")
                        rows = [(per_calls[0], row)]
                    else:
                        rows = [(k, measure(model, config, batch, prompt, args, counter, k, i == 0))
                                for i, k in enumerate(per_calls)]
                    for per_call, row in rows:
                        if per_call > 1:
                            row.note = (row.note + "; " if row.note else "") + f"{per_call} steps per program"
                        cells = cells_of(row, config, counts, batch, prompt, args, peak, bandwidth, per_call)
                        mb.log_line(log, kind="inference", device=device.device_kind, model=name,
                                    shape=shape.label, prompt=prompt, batch=batch, steps_per_program=per_call,
                                    **dataclasses.asdict(row),
                                    prefill_flops=prefill_flops(config, counts, batch, prompt), peak_tflops=peak,
                                    hbm_gbps=bandwidth)
                        print(f"| {name} ({shape.label}) | {prompt} | {batch} | " + " | ".join(cells) + " |",
                              flush=True)
                        if args.record and not args.cpu_smoke:
                            record_row(row, config, counts, name, batch, prompt, args, peak, bandwidth, per_call,
                                       device.device_kind)
            del model
            gc.collect()


def record_row(row: Row, config, counts, name: str, batch: int, prompt: int, args, peak, bandwidth, per_call: int,
               device_kind: str) -> None:
    """``inference_tpu/<model>:<prompt>:<batch>:<steps per program>[:bucket]`` in docs/figures.json: prefill
    seconds and MFU, the decode program's ms per step, ``generate``'s ms per token, each against the roofline."""
    values = {"note": row.note} if row.note else {}
    roof = None
    if row.prefill_s is not None:
        tflops = prefill_flops(config, counts, batch, prompt) / row.prefill_s / 1e12
        values |= {"prefill_s": round(row.prefill_s, 3), "prefill_tflops": round(tflops, 1)}
        if peak:
            values["prefill_mfu_pct"] = round(100 * tflops / peak, 1)
    if row.decode_s is not None:
        context = prompt + (2 * per_call + decoded(args, per_call)) / 2
        roof = decode_bytes(config, counts, batch, context) / (bandwidth * 1e9) if bandwidth else None
        values |= {"decode_ms": round(1e3 * row.decode_s, 3), "decode_tokens_per_s": round(batch / row.decode_s)}
        if roof:
            values |= {"roofline_ms": round(1e3 * roof, 3), "decode_roofline_pct": round(100 * roof / row.decode_s)}
    if row.generate_s is not None and row.generate_s > 0:
        values |= {"generate_ms": round(1e3 * row.generate_s, 3),
                   "generate_tokens_per_s": round(batch / row.generate_s)}
        if roof:
            values["generate_roofline_pct"] = round(100 * roof / row.generate_s)
    key = f"{name}:{prompt}:{batch}:{per_call}" + (":bucket" if row.generate_bucket else "")
    _figures.record("inference_tpu", key, values, _figures.provenance(device_kind))


def cells_of(row: Row, config, counts, batch: int, prompt: int, args, peak, bandwidth, per_call: int = 1) -> list[str]:
    dash = "-"
    pre = [dash] * 3
    if row.prefill_s is not None:
        tflops = prefill_flops(config, counts, batch, prompt) / row.prefill_s / 1e12
        pre = [f"{row.prefill_s:.3f}", f"{tflops:.3g}", f"{100 * tflops / peak:.1f}%" if peak else dash]
    dec, roof = [dash] * 4, None
    if row.decode_s is not None:
        warm = 2 * per_call
        context = prompt + (warm + decoded(args, per_call)) / 2  # mean tokens held over the timed steps
        roof = decode_bytes(config, counts, batch, context) / (bandwidth * 1e9) if bandwidth else None
        dec = [f"{1e3 * row.decode_s:.3f}", f"{batch / row.decode_s:,.0f}",
               f"{1e3 * roof:.3f}" if roof else dash, f"{100 * roof / row.decode_s:.0f}%" if roof else dash]
    decode = dash if row.decode_compiles is None else row.decode_compiles
    compiles = dash if row.prefill_compiles is None else f"{row.prefill_compiles}, {decode}"
    note = row.note
    if row.generate_s is not None:  # a difference of two timings: on tiny CPU shapes, noise can exceed it
        share = f" ({100 * roof / row.generate_s:.0f}% of roofline)" if roof else ""
        per_token = f"{1e3 * row.generate_s:.3f} ms/token{share}" if row.generate_s > 0 else "below timing noise"
        how = " (bucket=True)" if row.generate_bucket else ""
        note = (note + "; " if note else "") + f"generate{how}: {per_token}"
    if row.recompiles:
        note = (note + "; " if note else "") + f"RECOMPILED {row.recompiles}x during the timed calls"
    return [*pre, *dec, compiles, note]


if __name__ == "__main__":
    main()
