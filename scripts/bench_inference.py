"""Benchmark: inference (``ringsplash.inference``) vs transformers on the same imported model, one process, CPU.

A random Llama (``--layers``, ``--d-model``, ``--heads``, ``--vocab``; unit-scale weights) is made by
transformers, saved, and loaded by ``rs.hf.load_hf`` (float32, ``attention="splash"`` with
``SplashConfig(backend="xla")``: the block-sparse jnp path a CPU user runs). Rows:

* prefill seconds at each ``--prefill-lens`` (batch 1): ``rs.inference.prefill`` (jitted; compile
  excluded: one warm-up call) vs transformers' forward (``attn_implementation="sdpa"``, ``no_grad``);
* decode tokens/s at each ``--batches`` with a ``--decode-prompt``-token prompt, as users call it: each
  library's greedy ``generate`` of ``--new-tokens`` and of 1 token, per token = (the difference) /
  (``--new-tokens - 1``), each time the fastest of at least 3 runs, so the prefill cancels (each library's runs
  in a block of their own, so that neither's idle threads slow the other's)
  (``rs.inference.generate`` with its defaults: programs of
  ``STEPS_PER_PROGRAM`` steps; transformers' ``generate(do_sample=False)``); then the step loops alone: after a
  prefill, ``--new-tokens - 1`` greedy steps of ringsplash's jitted ``decode_step`` + argmax (one step a
  program) vs transformers' forward on one token with its ``past_key_values``; warm-up runs excluded;
* the ``decode_step`` loop with the cache sharded over ``--devices`` simulated CPU devices
  (``mesh=train.make_mesh(1, devices)``): the simulated devices share this host's cores, so this
  row shows the sharded path runs and what it costs here, not a multi-chip speed-up.

Medians of ``--repeats`` runs. This host is shared and noisy; the ratio column is measured in one run.

Each decode row also prints this host's memory roofline: the tokens/s at which every parameter but the
embedding table (one row per token) and the K/V held (mean over the steps) are read once per step, at the
host's streaming bandwidth (numpy summing 256 MiB of float32, a slice per core on as many threads, the
fastest of 5, measured at the start): a bound no library passes.

    python scripts/bench_inference.py                      # 4 layers, d 512, prefill 4K / 16K, decode at 4K
    python scripts/bench_inference.py --tiny               # the smoke run (tests/test_bench_scripts.py)
"""

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
from _bench import fmt_tokens, md_table, median_of


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--layers", type=int, default=4, help="transformer layers of the imported model")
    p.add_argument("--d-model", type=int, default=512, help="model width")
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, default=8, help="key/value heads (GQA)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size")
    p.add_argument("--prefill-lens", type=int, nargs="*", default=[4096, 16384], help="prompt lengths of the prefill rows")
    p.add_argument("--decode-prompt", type=int, default=4096, help="prompt length before the decode rows")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per decode row")
    p.add_argument("--batches", type=int, nargs="*", default=[1, 8], help="batch sizes of the decode rows")
    p.add_argument("--devices", type=int, default=4, help="simulated devices of the sharded-cache row (0: skip)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per row (the median is printed)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--tiny", action="store_true", help="a 2-layer d-64 model, 256-token prompts, 32 new tokens")
    return p


def _parse(argv=None):
    args = build_parser().parse_args(argv)
    if args.tiny:
        args.layers, args.d_model, args.heads, args.kv_heads, args.vocab = 2, 64, 4, 2, 256
        args.prefill_lens, args.decode_prompt, args.new_tokens, args.batches = [256], 256, 32, [1, 2]
        args.repeats = 1
    return args


def make_checkpoint(args, path: str):
    import torch
    import transformers

    longest = max([*args.prefill_lens, args.decode_prompt + args.new_tokens])
    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.d_model,
                                      intermediate_size=int(args.d_model * 8 / 3) // 8 * 8,
                                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                      num_key_value_heads=args.kv_heads, max_position_embeddings=longest,
                                      rms_norm_eps=1e-5, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, w in sorted(model.named_parameters()):
            w.copy_(torch.randn(w.shape, generator=gen) * w.shape[1] ** -0.5 if w.ndim == 2 else
                    torch.randn(w.shape, generator=gen) * 0.1 + 1.0)
    model.save_pretrained(path)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def host_bandwidth_gbps() -> float:
    """GB/s of numpy summing 256 MiB of float32 in one slice per core, on as many threads (numpy releases
    the GIL; the fastest of 5): this host's streaming read bandwidth, every core reading."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    a = np.ones(64 * 1024 * 1024, np.float32)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    parts = np.array_split(a, cores)
    best = float("inf")
    with ThreadPoolExecutor(cores) as pool:
        for _ in range(5):
            t0 = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = min(best, time.perf_counter() - t0)
    return a.nbytes / best / 1e9


def decode_step_bytes(model, batch: int, held: float) -> float:
    """Bytes a greedy decode step must read at least: every parameter but the embedding table (its ``batch``
    rows only) and the K / V of ``held`` tokens per row, in the model's dtypes."""
    import equinox as eqx
    import jax

    leaves = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    params = sum(x.nbytes for x in leaves) - model.embedding.nbytes + batch * model.embedding[0].nbytes
    if model.unembedding is None:  # tied: the unembedding is the embedding table, read whole
        params += model.embedding.nbytes
    c = model.config
    kv = c.num_layers * c.num_kv_heads * (c.head_dim + c.v_head_dim) * model.embedding.dtype.itemsize * held * batch
    return params + kv


def main(argv=None) -> None:
    args = _parse(argv)
    import jax

    if args.devices:
        jax.config.update("jax_num_cpu_devices", max(args.devices, 1))
    import jax.numpy as jnp
    import numpy as np
    import torch

    import ringsplash as rs
    from ringsplash import train
    from ringsplash.splash import SplashConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as path:
        hf = make_checkpoint(args, path)
        model = rs.hf.load_hf(path, attention="splash", splash=SplashConfig(backend="xla"))
        _MODEL.append(model)
        gbps = host_bandwidth_gbps()
        print(f"model: Llama, {args.layers} layers, d_model {args.d_model}, {args.heads} heads "
              f"({args.kv_heads} kv), vocab {args.vocab}, float32; {jax.device_count()} CPU devices, "
              f"torch threads {torch.get_num_threads()}; medians of {args.repeats}; host memory {gbps:.1f} GB/s")

        rows = []
        for n in args.prefill_lens:
            tokens = rng.integers(0, args.vocab, (1, n)).astype(np.int32)
            ids = torch.from_numpy(tokens.astype(np.int64))

            def ours(tokens=tokens):
                logits, cache = rs.inference.prefill(model, jnp.asarray(tokens))
                jax.block_until_ready((logits, cache.k))

            def theirs(ids=ids):
                with torch.no_grad():
                    hf(ids)

            ours()
            theirs()
            t_ours, _ = median_of(ours, args.repeats)
            t_theirs, _ = median_of(theirs, args.repeats)
            rows.append((fmt_tokens(n) if n >= 1024 else n, f"{t_ours:.2f}", f"{t_theirs:.2f}",
                         f"{t_theirs / t_ours:.2f}"))
        print("\n## prefill (batch 1, seconds)\n")
        print(md_table(rows, ["prompt", "ringsplash (s):", "transformers (s):", "speed-up:"]))

        rows = []
        mesh = train.make_mesh(1, args.devices) if args.devices else None
        for batch in args.batches:
            prompts = rng.integers(0, args.vocab, (batch, args.decode_prompt)).astype(np.int32)
            ids = torch.from_numpy(prompts.astype(np.int64))

            def rate(prefill_then_loop, batch=batch):
                prefill_then_loop()  # warm-up: every program compiled
                times = [prefill_then_loop() for _ in range(args.repeats)]
                return batch * (args.new_tokens - 1) / sorted(times)[len(times) // 2]

            def ours(mesh=None, prompts=prompts):
                """Seconds of new_tokens - 1 greedy decode steps after a prefill (the loop only)."""
                logits, cache = rs.inference.prefill(model, jnp.asarray(prompts),
                                                     max_len=_cache_len(args, mesh), mesh=mesh)
                token = jnp.argmax(logits, -1).astype(jnp.int32)
                jax.block_until_ready((token, cache.k))
                t0 = time.perf_counter()
                for _ in range(args.new_tokens - 1):
                    token, cache = _greedy_step(model, cache, token)
                jax.block_until_ready(token)
                return time.perf_counter() - t0

            def theirs(ids=ids):
                with torch.no_grad():
                    out = hf(ids, use_cache=True)
                    token = out.logits[:, -1].argmax(-1, keepdim=True)
                    t0 = time.perf_counter()
                    for _ in range(args.new_tokens - 1):
                        out = hf(token, cache=out.cache, use_cache=True)
                        token = out.logits[:, -1].argmax(-1, keepdim=True)
                    return time.perf_counter() - t0

            def generate_ours(n, prompts=prompts):
                jax.block_until_ready(rs.inference.generate(model, jnp.asarray(prompts), n))

            def generate_theirs(n, ids=ids):
                with torch.no_grad():
                    hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)

            def per_token_rate(generate_n, batch=batch):
                """Tokens/s of one library's own greedy generate: (n new tokens - 1) / (the fastest of at least 3
                runs of n - the fastest of 1; prefill included in both, so it cancels). Each library is timed in a
                block of its own: alternated, the one whose threads had just run (torch's OpenMP workers spin
                after a parallel region) slowed the other (2026-12-07: ours 48.7 tok/s alternated, 70.5 alone)."""
                generate_n(args.new_tokens), generate_n(1)  # warm-up: every program compiled
                best = {}
                for n in (args.new_tokens, 1):
                    for _ in range(max(3, args.repeats)):
                        t0 = time.perf_counter()
                        generate_n(n)
                        best[n] = min(best.get(n, float("inf")), time.perf_counter() - t0)
                return batch * (args.new_tokens - 1) / (best[args.new_tokens] - best[1])

            r_ours, r_theirs = rate(ours), rate(theirs)
            sharded = f"{rate(lambda: ours(mesh)):.1f}" if mesh is not None else "-"
            g_ours, g_theirs = per_token_rate(generate_ours), per_token_rate(generate_theirs)
            held = args.decode_prompt + args.new_tokens / 2
            roof = batch / (decode_step_bytes(model, batch, held) / (gbps * 1e9))
            rows.append((batch, fmt_tokens(args.decode_prompt) if args.decode_prompt >= 1024 else args.decode_prompt,
                         f"{roof:.1f}", f"{g_ours:.1f}", f"{g_theirs:.1f}", f"{g_ours / g_theirs:.2f}",
                         f"{r_ours:.1f}", f"{r_theirs:.1f}", f"{r_ours / r_theirs:.2f}", sharded))
        print(f"\n## decode (greedy, {args.new_tokens} new tokens, tokens/s)\n")
        print(md_table(rows, ["batch:", "prompt:", "host memory roofline (tok/s):", "generate, ringsplash (tok/s):",
                              "generate, transformers (tok/s):",
                              "ratio:", "decode_step loop (tok/s):", "transformers forward loop (tok/s):",
                              "ratio:", f"decode_step loop, cache on {args.devices} simulated devices (tok/s):"]))


def _cache_len(args, mesh) -> int:
    from ringsplash.inference import cache_multiple

    multiple = cache_multiple(_MODEL[0].config, mesh)
    return -(-(args.decode_prompt + args.new_tokens) // multiple) * multiple


def _greedy_step(model, cache, token):
    import jax

    global _STEP
    if _STEP is None:
        import jax.numpy as jnp

        from ringsplash.inference import decode_step

        def step(model, cache, token):
            logits, cache = decode_step(model, cache, token)
            return jnp.argmax(logits, -1).astype(jnp.int32), cache

        _STEP = jax.jit(step, donate_argnums=1)
    return _STEP(model, cache, token)


_STEP = None
_MODEL = []


if __name__ == "__main__":
    main()
