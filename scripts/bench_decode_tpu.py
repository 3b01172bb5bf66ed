"""Benchmark on a TPU chip (issue 55): decode as users call it, in one process.

1. Attention alone: ringsplash's decode kernel (``ringsplash.inference.decode_kernel.decode_attention``) beside
   JAX's ``jax.experimental.pallas.ops.tpu.ragged_paged_attention`` (the decode kernel of vLLM's TPU backend) on
   the same cache contents: one new query per row against a cache of ``bucket_length(prompt + 64)`` slots (the
   cache ``generate`` builds) holding ``prompt`` live tokens per row; the same K / V copied into
   ``ragged_paged_attention``'s pages (K and V interleaved on the head axis, each row's pages in order). Its page
   layout is tried at a few sizes (``--rpa-configs``: page size x pages per block); the fastest that compiles is
   its time. Milliseconds per call (``--attention-calls`` calls chained in one program, each output the next
   query, so that the host's dispatch is not timed; the median of ``--repeats``) and the ratio
   ``ragged_paged_attention / ours`` (> 1: ours is faster), the outputs' largest difference as a check. A layer's
   K / V only, no model.
2. ``rs.inference.generate(model, prompts, 64)`` with its defaults on the model of issue 40 (8 layers, d_model
   1024, 8 heads of 128 or GQA 8:2, SwiGLU 4096, vocab 32768, bfloat16 parameters and compute, Splash attention):
   ms per token = (time of 64 tokens - time of 1) / 63 (the fastest of ``--repeats`` each, after a call of each
   that compiles everything: at 128K the 1-token time is mostly a 2 s prefill, and a median can let its
   run-to-run spread into the per-token figure); tokens/s = batch / that; roofline = (every parameter's bytes +
   the K / V of the tokens held, read once per step: prompt + 32.5 on average over the 63 steps) / the chip's HBM
   bandwidth (819 GB/s on v5e); % of roofline = roofline / measured; % of streamed roofline: the same without the
   input embedding table, which a step gathers a row of per token rather than streams (the tighter bound: a row
   can pass 100% of the first, never of this one). At batch 1 the ms per token is the latency
   per token. The time of 1 token (a prefill and one sample) also gives a prefill MFU (a lower bound: it includes
   the sample and the launch).

A row whose memory would not fit the chip's HBM is skipped with the reason printed (MHA 128K batch 8: its KV
cache alone is 43 GiB); an out-of-memory error at run time is reported as such.

    python scripts/bench_decode_tpu.py                      # everything (estimated 6-10 minutes on one v5e chip,
                                                            # mostly compiles and 128K prefills; not run yet)
    python scripts/bench_decode_tpu.py --parts attention    # the kernels alone
    python scripts/bench_decode_tpu.py --parts attention --block-bytes 262144,524288,1048576,2097152
    python scripts/bench_decode_tpu.py --parts attention --grids live,all   # the grid over live blocks or all
    python scripts/bench_decode_tpu.py --parts generate --batches 1 --steps-per-program 4,8,16
    python scripts/bench_decode_tpu.py --parts generate --models gqa --prompt-lens 8192,32768 --batches 1 --profile /tmp/dec  # ops a token
    python scripts/bench_decode_tpu.py --parts generate --models gqa --prompt-lens 8192,32768 --cache-memory auto,hbm
    python scripts/bench_decode_tpu.py --cpu-smoke          # tiny shapes on the CPU (CI): checks the script

``--block-bytes`` tries the kernel's block sizes (bytes of K and V per grid step; the fastest is reported, each in the
note) and ``--steps-per-program`` generate's ``STEPS_PER_PROGRAM`` (a row each): what the defaults should be.

It refuses to run without a TPU, except with ``--cpu-smoke`` (the kernels in the Pallas TPU interpreter, CPU
times: never a TPU speed).
"""

import argparse
import collections
import gc
import importlib
import itertools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _model_bench as mb
from _bench import LOG_DIR, open_log

MODELS = {"mha": mb.Shape(), "gqa": mb.Shape(kv_heads=2)}
SMOKE_MODELS = {"mha": mb.Shape(layers=2, d_model=256, heads=2, kv_heads=2, head_dim=128, mlp=512, vocab=256),
                "gqa": mb.Shape(layers=2, d_model=256, heads=4, kv_heads=2, head_dim=128, mlp=512, vocab=256)}
NEW_TOKENS = 64
#: ragged_paged_attention's layouts tried: (page size, pages per block)
RPA_CONFIGS = "128:8,128:32,256:16"
#: the share of HBM a row may plan to use (the rest: XLA's temporaries, fragmentation)
HBM_SHARE = 0.85


def kv_bytes(shape: mb.Shape, batch: int, slots: int, layers: int, itemsize: int = 2) -> int:
    return layers * batch * shape.kv_heads * 2 * shape.head_dim * slots * itemsize


def timed(fn, args, repeats: int, calls: int) -> float:
    """Median seconds of one call: ``calls`` dispatched back to back, one block at the end, ``repeats`` times."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


# ----------------------------------------------------------------------------------------- 1. attention alone


def chained(fn, calls: int):
    """``calls`` calls of ``fn(q, *rest)`` as one jitted program, each call's output (q's shape: one query per row
    and head) the next call's query, so none can be merged or skipped: the kernel's own time, without a
    dispatch per call. Dispatched one by one, an 8K batch-1 call (8 MiB of K / V, 10 us at 819 GB/s) timed
    0.13-0.16 ms for either kernel on a v5e chip (2026-12-07): the host's dispatch, not the kernel."""
    import jax

    def run(q, *rest):
        return jax.lax.fori_loop(0, calls, lambda _, q: fn(q, *rest).astype(q.dtype), q)

    return jax.jit(run)


def rpa_inputs(k, v, lengths, page_size: int):
    """``ragged_paged_attention``'s operands holding the cache ``k, v [batch, kv_heads, slots, d]``: pages
    ``[batch * slots / page_size, page_size, 2 * kv_heads, d]`` (K and V interleaved on the head axis), each
    row's pages in order."""
    import jax.numpy as jnp

    batch, kv_heads, slots, d = k.shape
    pages = slots // page_size
    paged = lambda x: x.reshape(batch, kv_heads, pages, page_size, d).transpose(0, 2, 3, 1, 4)
    kv_pages = jnp.stack([paged(k), paged(v)], axis=4).reshape(batch * pages, page_size, 2 * kv_heads, d)
    page_indices = jnp.arange(batch * pages, dtype=jnp.int32).reshape(batch, pages)
    cu_q_lens = jnp.arange(batch + 1, dtype=jnp.int32)
    return kv_pages, lengths, page_indices, cu_q_lens, jnp.array([batch], jnp.int32)


def attention_rows(args, shapes, prompts, batches, hbm):
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    from ringsplash.inference import bucket_length
    from ringsplash.inference.decode_kernel import block_kv_for, decode_attention

    interpret = pltpu.InterpretParams() if args.cpu_smoke else False
    print("\n## decode attention alone: ringsplash's kernel beside ragged_paged_attention (one layer's K/V, the same "
          "contents)\n")
    print("| model | prompt | batch | cache slots | ours ms | block | ragged_paged_attention ms | its layout "
          "| ratio (rpa / ours) | max abs diff | note |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---|")
    for name, shape in shapes.items():
        for prompt in prompts:
            for batch in batches:
                slots = bucket_length(prompt + NEW_TOKENS, 128)
                cells = [name, str(prompt), str(batch), str(slots)]
                need = 3 * kv_bytes(shape, batch, slots, 1)  # ours, the paged copy and its build's temporary
                if hbm is not None and need > HBM_SHARE * hbm:
                    print("| " + " | ".join(cells + ["-"] * 6) + f" | skipped: three copies of the K/V "
                          f"{need / 2**30:.1f} GiB > {HBM_SHARE:.0%} of {hbm / 2**30:.0f} GiB HBM |", flush=True)
                    continue
                d = shape.head_dim
                keys = jax.random.split(jax.random.key(prompt + batch), 3)  # drawn on the device: GBs at 128K
                k = jax.random.normal(keys[0], (batch, shape.kv_heads, slots, d), jnp.bfloat16)
                v = jax.random.normal(keys[1], (batch, shape.kv_heads, slots, d), jnp.bfloat16)
                q = jax.random.normal(keys[2], (batch, shape.heads, d), jnp.bfloat16)
                lengths = jnp.full((batch,), prompt, jnp.int32)
                note, ours, block, ours_out = "", None, None, None
                # the fastest block size and grid tried; the others in the note
                for budget, grid in itertools.product(args.block_bytes, args.grids):
                    bk = block_kv_for(slots, shape.kv_heads, d, 2, budget)
                    ours_fn = jax.jit(lambda q, k, v, n, bk=bk, live=grid == "live": decode_attention(
                        q, k, v, n, block_kv=bk, live_grid=live, interpret=interpret)[0])
                    try:
                        t = timed(chained(ours_fn, args.attention_calls), (q, k, v, lengths), args.repeats,
                                  1) / args.attention_calls
                    except Exception as exc:
                        note += f"ours at block {bk}, {grid} grid: {mb.short_error(exc, 80)}; "
                        continue
                    if len(args.block_bytes) > 1 or len(args.grids) > 1:
                        note += f"block {bk}, {grid} grid: {1e3 * t:.3f} ms; "
                    if ours is None or t < ours:
                        ours, block, ours_out = t, bk, ours_fn(q, k, v, lengths)
                if ours is None:
                    print("| " + " | ".join(cells + ["-"] * 6) + f" | {note.rstrip('; ')} |", flush=True)
                    continue
                best, best_cfg, diff = None, "-", None
                if not args.cpu_smoke:  # ragged_paged_attention looks up tuned sizes by TPU generation
                    for cfg in args.rpa_configs.split(","):
                        page, per_block = (int(x) for x in cfg.split(":"))
                        if slots % page:
                            continue
                        operands = rpa_inputs(k, v, lengths, page)
                        per_q = min(batch, 8)
                        fn = jax.jit(lambda q, *ops, per_block=per_block, d=d, per_q=per_q: ragged_paged_attention(
                            q, *ops, sm_scale=d**-0.5, num_kv_pages_per_block=per_block, num_queries_per_block=per_q))
                        try:
                            t = timed(chained(fn, args.attention_calls), (q, *operands), args.repeats,
                                      1) / args.attention_calls
                        except Exception as exc:
                            note += f"rpa {cfg}: {mb.short_error(exc, 80)}; "
                            continue
                        if best is None or t < best:
                            best, best_cfg = t, f"page {page}, {per_block} pages/block"
                            diff = float(jnp.max(jnp.abs(fn(q, *operands).astype(jnp.float32) - ours_out)))
                        del operands
                        gc.collect()
                else:
                    note += "CPU: the TPU interpreter, not a TPU speed; ragged_paged_attention not run"
                row = cells + [f"{1e3 * ours:.3f}", str(block), "-" if best is None else f"{1e3 * best:.3f}", best_cfg,
                               "-" if best is None else f"{best / ours:.2f}x",
                               "-" if diff is None else f"{diff:.2g}", note.rstrip("; ")]
                print("| " + " | ".join(row) + " |", flush=True)
                mb.log_line(args.log_file, kind="decode_attention", model=name, prompt=prompt, batch=batch,
                            slots=slots, ours_s=ours, rpa_s=best, rpa_layout=best_cfg, max_abs_diff=diff, note=note)
                del k, v, q, ours_out
                gc.collect()


# ----------------------------------------------------------------------------------------- 2. generate


def roofline_s(config, counts: mb.Counts, shape: mb.Shape, batch: int, prompt: int, bandwidth: float,
               streamed: bool = False) -> float:
    """Every parameter + the K/V of the tokens held (mean over the 63 timed steps), read once per step.
    ``streamed``: without the input embedding table when it is not tied to the unembedding (a step gathers one row
    of it per token, so it is not streamed: 64 MiB of the bench model's 360), the tighter bound."""
    import jax.numpy as jnp

    held = prompt + (1 + NEW_TOKENS) / 2
    params = counts.param_bytes
    if streamed and not config.features.tie_embeddings:
        params -= (counts.embedding - batch * config.d_model) * jnp.dtype(config.param_dtype).itemsize
    return (params + kv_bytes(shape, batch, 1, config.num_layers) * held) / (bandwidth * 1e9)


def time_generate(model, tokens, repeats: int) -> tuple[float, float]:
    """The fastest seconds of ``generate(model, tokens, 1)`` and of ``generate(model, tokens, 64)``, alternated
    (drifts hit both), after a call of each that compiles everything (1 and 64 share the bucket at the chip's
    sizes)."""
    import jax

    import ringsplash as rs

    for n in (1, NEW_TOKENS):
        jax.block_until_ready(rs.inference.generate(model, tokens, n))
    ones, manys = [], []
    for _ in range(repeats):
        for n, out in ((1, ones), (NEW_TOKENS, manys)):
            t0 = time.perf_counter()
            jax.block_until_ready(rs.inference.generate(model, tokens, n))
            out.append(time.perf_counter() - t0)
    return min(ones), min(manys)


def profile_generate(model, tokens, trace_dir: str, label: str, top: int) -> None:
    """One ``generate(model, tokens, 64)`` under ``jax.profiler.trace`` (Perfetto; compiled beforehand by the
    timing), its device ops read back by ``profile_splash_tpu.device_op_times``: the ``top`` longest per token,
    and the device time and op count per token (the prefill and the first token's program included, 1/64th)."""
    import jax

    import profile_splash_tpu
    import ringsplash as rs

    run_dir = os.path.join(trace_dir, time.strftime(f"generate-{label}-%Y%m%d-%H%M%S"))
    os.makedirs(run_dir, exist_ok=True)
    with jax.profiler.trace(run_dir, create_perfetto_trace=True):
        jax.block_until_ready(rs.inference.generate(model, tokens, NEW_TOKENS))
    ops = profile_splash_tpu.device_op_times(run_dir, NEW_TOKENS)
    print(f"\nprofile of {label} ({run_dir}): device total {sum(ms for _, ms, _ in ops):.3f} ms per token, "
          f"{sum(n for _, _, n in ops):.0f} device ops per token")
    programs = collections.defaultdict(lambda: [0.0, 0.0])  # "program | op" names: each program's share
    for op, ms, n in ops:
        share = programs[op.split(" | ")[0] if " | " in op else "-"]
        share[0] += ms
        share[1] += n
    print("| program | ms per token | ops per token |\n|---|---:|---:|")
    for name, (ms, n) in sorted(programs.items(), key=lambda kv: -kv[1][0]):
        print(f"| {name[:60]} | {ms:.4f} | {n:.1f} |")
    print("\n| op | ms per token | per token |\n|---|---:|---:|")
    for op, ms, n in ops[:top]:
        print(f"| {op[:90]} | {ms:.4f} | {n:g} |")
    print(flush=True)


def generate_rows(args, shapes, prompts, batches, hbm, peak, bandwidth):
    import jax
    import numpy as np

    from ringsplash.inference import bucket_length
    from ringsplash.inference.prefill import max_cache_len
    from ringsplash.model import Transformer

    gen = importlib.import_module("ringsplash.inference.generate")
    kernel = importlib.import_module("ringsplash.inference.decode_kernel")

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_inference_tpu import prefill_flops

    print(f"\n## generate(model, prompts, {NEW_TOKENS}) with its defaults\n")
    print("| model | prompt | batch | cache slots | 1 token s | prefill MFU (lower bound) | ms / token "
          "| tokens/s | roofline ms / token | % of roofline | % of streamed roofline | note |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, shape in shapes.items():
        config = mb.model_config(shape, max(prompts) + NEW_TOKENS, param_dtype=args.dtype, compute_dtype=args.dtype)
        counts = mb.param_counts(config)
        model = Transformer(config, key=jax.random.key(0))
        for prompt in prompts:
            for batch in batches:
                # the cache generate builds: the bucket, at most the model's max_seq_len in whole lanes
                slots = min(bucket_length(prompt + NEW_TOKENS, 128), max_cache_len(config, None))
                cells = [name, str(prompt), str(batch), str(slots)]
                need = kv_bytes(shape, batch, slots, config.num_layers) + counts.param_bytes
                if hbm is not None and need > HBM_SHARE * hbm:
                    print("| " + " | ".join(cells + ["-"] * 7) + f" | skipped: KV cache + parameters "
                          f"{need / 2**30:.1f} GiB > {HBM_SHARE:.0%} of {hbm / 2**30:.0f} GiB HBM |", flush=True)
                    continue
                tokens = np.random.default_rng(0).integers(0, config.vocab_size, (batch, prompt), dtype=np.int32)
                repeats = args.repeats if batch * prompt <= args.long_tokens else max(1, args.repeats - 1)
                for per_call, memory, budget in itertools.product(args.steps_per_program, args.cache_memory,
                                                                  args.block_bytes):
                    saved = gen.STEPS_PER_PROGRAM, kernel.CACHE_MEMORY, kernel.BLOCK_BYTES
                    gen.STEPS_PER_PROGRAM, kernel.CACHE_MEMORY, kernel.BLOCK_BYTES = per_call, memory, budget
                    if len(args.cache_memory) > 1 or len(args.block_bytes) > 1:
                        jax.clear_caches()  # the placement and the block are chosen when a program is traced
                    try:
                        one, many = time_generate(model, tokens, repeats)
                    except Exception as exc:
                        why = "does not fit (out of memory)" if mb.is_oom(exc) else mb.short_error(exc)
                        print("| " + " | ".join(cells + ["-"] * 7) + f" | {why} |", flush=True)
                        gc.collect()
                        continue
                    finally:
                        gen.STEPS_PER_PROGRAM, kernel.CACHE_MEMORY, kernel.BLOCK_BYTES = saved
                    per_token = (many - one) / (NEW_TOKENS - 1)
                    roof = roofline_s(config, counts, shape, batch, prompt, bandwidth) if bandwidth else None
                    tight = roofline_s(config, counts, shape, batch, prompt, bandwidth, True) if bandwidth else None
                    mfu = prefill_flops(config, counts, batch, prompt) / one / 1e12 / peak if peak else None
                    note = f"{repeats} repeats" + ("; CPU times, not a TPU speed" if args.cpu_smoke else "")
                    if len(args.steps_per_program) > 1:
                        note = f"{per_call} steps per program; " + note
                    if len(args.cache_memory) > 1:
                        note = f"cache memory {memory}; " + note
                    if len(args.block_bytes) > 1:
                        block = kernel.block_kv_for(slots, shape.kv_heads, shape.head_dim,
                                                    np.dtype(args.dtype).itemsize, budget)
                        note = f"{budget / 2**20:g} MiB budget: {block}-slot blocks; " + note
                    row = cells + [f"{one:.3f}", "-" if mfu is None else f"{100 * mfu:.1f}%",
                                   f"{1e3 * per_token:.3f}", f"{batch / per_token:,.0f}" if per_token > 0 else "-",
                                   "-" if roof is None else f"{1e3 * roof:.3f}",
                                   "-" if roof is None or per_token <= 0 else f"{100 * roof / per_token:.0f}%",
                                   "-" if tight is None or per_token <= 0 else f"{100 * tight / per_token:.0f}%", note]
                    print("| " + " | ".join(row) + " |", flush=True)
                    if args.profile:  # the first row only
                        profile_generate(model, tokens, args.profile, f"{name}-{prompt}-{batch}", args.top)
                        args.profile = None
                    mb.log_line(args.log_file, kind="generate", model=name, prompt=prompt, batch=batch, slots=slots,
                                steps_per_program=per_call, cache_memory=memory, block_bytes=budget, one_s=one, many_s=many,
                                ms_per_token=1e3 * per_token, roofline_ms=None if roof is None else 1e3 * roof,
                                streamed_roofline_ms=None if tight is None else 1e3 * tight,
                                prefill_mfu=mfu)
                gc.collect()
        del model
        gc.collect()


# ----------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--parts", default="attention,generate", help="attention and/or generate, comma-separated")
    p.add_argument("--prompt-lens", default="8192,32768,131072", help="prompt lengths, comma-separated")
    p.add_argument("--batches", default="1,8", help="batch sizes, comma-separated")
    p.add_argument("--models", default="mha,gqa", help="mha (8 kv heads) and/or gqa (2 kv heads), comma-separated")
    p.add_argument("--dtype", default="bfloat16", help="parameter and compute dtype of the generate model")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed runs (attention: the median is printed; generate: the fastest)")
    p.add_argument("--long-tokens", type=int, default=262144,
                   help="generate rows of more prompt tokens (batch x prompt) than this take one repeat fewer "
                        "(their prefill dominates the run's time)")
    p.add_argument("--block-bytes", default=None,
                   help="decode kernel: bytes of K and V per grid step to try, comma-separated (attention: the fastest is "
                        "reported; generate: a row each, decode_kernel.BLOCK_BYTES set; default: BLOCK_BYTES)")
    p.add_argument("--steps-per-program", default=None,
                   help="generate: STEPS_PER_PROGRAM values to try, comma-separated, a row each (default: "
                        "generate's own)")
    p.add_argument("--cache-memory", default=None,
                   help="generate: decode_kernel.CACHE_MEMORY values to try, comma-separated (auto: where XLA "
                        "places the cache; hbm: kept in HBM), a row each (default: the library's own)")
    p.add_argument("--grids", default="live",
                   help="decode kernel: live (the grid stops at the longest row's last block, the default) and/or "
                        "all (every block of the cache), comma-separated; the fastest is reported")
    p.add_argument("--attention-calls", type=int, default=20,
                   help="kernel calls per timed run, chained in one program (each output the next query)")
    p.add_argument("--rpa-configs", default=RPA_CONFIGS,
                   help="ragged_paged_attention layouts tried, page_size:pages_per_block, comma-separated")
    p.add_argument("--profile", metavar="DIR",
                   help="generate: trace one generate(model, prompts, 64) of the first row here and print its "
                        "device ops per token (where a token's time goes beside the roofline's reads)")
    p.add_argument("--top", type=int, default=30, help="ops printed by --profile")
    p.add_argument("--peak-tflops", type=float, help="the chip's peak TF/s (default: the table for the device kind)")
    p.add_argument("--hbm-gbps", type=float, help="the chip's HBM GB/s (default: the table for the device kind)")
    p.add_argument("--log", default=os.path.join(LOG_DIR, "bench_decode_tpu.jsonl"), help="one JSON line per row (appended)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny shapes on the CPU (2 layers, prompt 200, batch 2): checks the script")
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    device = mb.start("bench_decode_tpu.py", args.cpu_smoke)
    parts = set(args.parts.split(","))
    if not parts <= {"attention", "generate"}:
        sys.exit(f"--parts: expected attention and/or generate, got {args.parts!r}")
    shapes = {name: MODELS[name] for name in args.models.split(",")}
    kernel_module = importlib.import_module("ringsplash.inference.decode_kernel")
    args.block_bytes = [int(x) for x in (args.block_bytes or str(kernel_module.BLOCK_BYTES)).split(",")]
    args.grids = args.grids.split(",")
    if not set(args.grids) <= {"live", "all"}:
        sys.exit(f"--grids: expected live and/or all, got {','.join(args.grids)!r}")
    gen_module = importlib.import_module("ringsplash.inference.generate")
    args.steps_per_program = [int(x) for x in (args.steps_per_program or str(gen_module.STEPS_PER_PROGRAM)).split(",")]
    args.cache_memory = (args.cache_memory or kernel_module.CACHE_MEMORY).split(",")
    if not set(args.cache_memory) <= {"auto", "hbm"}:
        sys.exit(f"--cache-memory: expected auto and/or hbm, got {','.join(args.cache_memory)!r}")
    prompts = [int(s) for s in args.prompt_lens.split(",")]
    batches = [int(s) for s in args.batches.split(",")]
    if args.cpu_smoke:
        shapes = {name: SMOKE_MODELS[name] for name in shapes}
        prompts, batches, args.repeats, args.attention_calls = [200], [2], 2, 2
    peak = mb.chip_rate(mb.PEAK_BF16_TFLOPS, device, args.peak_tflops)
    bandwidth = mb.chip_rate(mb.HBM_GBPS, device, args.hbm_gbps)
    chip = mb.chip_name(device)
    hbm = None
    if chip:
        from ringsplash import aot

        hbm = aot.chip(chip).hbm_bytes
    print(mb.device_line(device))
    print(f"command: {' '.join([os.path.basename(sys.argv[0]), *(sys.argv[1:] if argv is None else argv)])}")
    if args.cpu_smoke:
        print("--cpu-smoke: tiny shapes on the CPU: these are CPU times, not a TPU speed")
    print(f"peak: {f'{peak:g} TF/s bf16' if peak else 'unknown'}; HBM bandwidth: "
          f"{f'{bandwidth:g} GB/s' if bandwidth else 'unknown'} (--peak-tflops / --hbm-gbps set them)")
    decode = importlib.import_module("ringsplash.inference.decode")
    generate = importlib.import_module("ringsplash.inference.generate")
    print(f"decode defaults: DECODE_ATTENTION={decode.DECODE_ATTENTION!r} (the kernel on a TPU), "
          f"STEPS_PER_PROGRAM={generate.STEPS_PER_PROGRAM}, CACHE_MEMORY={kernel_module.CACHE_MEMORY!r}, bucket=True")
    start = time.perf_counter()
    with open_log(args.log) as log:
        args.log_file = log
        if "attention" in parts:
            attention_rows(args, shapes, prompts, batches, hbm)
        if "generate" in parts:
            generate_rows(args, shapes, prompts, batches, hbm, peak, bandwidth)
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
