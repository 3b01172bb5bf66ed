"""``ringsplash.inference``: cache-based decoding against the full forward pass, the cache sharded
over 4 simulated devices against one device, greedy ``generate`` against transformers' ``generate``,
sampling, and bad input."""

import functools
import importlib
import logging
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ringsplash as rs
from ringsplash import train
from ringsplash.inference import bucket_length, decode_step, empty_cache, filter_logits, generate, prefill, sample
from ringsplash.model import ContextParallel, ModelFeatures, Transformer, TransformerConfig

# measured max |decode - full forward| logits (f32, logits of magnitude ~1-5): llama 9.5e-7, sliding 1.2e-6,
# gemma 1.9e-6; sharded vs unsharded 1.4e-6; the tolerance is 10x the largest
ATOL = 2e-5
SEQ = 24
TINY = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=1024,
            context_parallel=ContextParallel("reference"))  # the dense oracle the decode paths are compared with
CONFIGS = {
    "llama": TransformerConfig(**TINY),
    # one window on every layer, biases, sinks, attention-logit soft cap
    "sliding": TransformerConfig(**TINY, mask="local", local_window=3, features=ModelFeatures(attention_bias=True), sinks=True,
                                 logit_soft_cap=4.0),
    # Gemma 3: local / global layers with their own RoPE, q/k norms, offset and post norms, scaled embeddings,
    # GeGLU, a final logit soft cap, Llama 3 RoPE scaling on the global layers
    "gemma": TransformerConfig(**TINY, features=ModelFeatures(layer_types=("sliding_attention", "full_attention"), sliding_window=4, local_rope_theta=100.0, qk_norm=True, norm_offset=1.0, post_norms=True, scale_embeddings=True, mlp_activation="gelu_tanh", final_logit_soft_cap=3.0, rope_scaling=rs.model.RopeScaling("llama3", factor=8.0, low_freq_factor=1.0,
                                                                 high_freq_factor=4.0,
                                                                 original_max_position_embeddings=16))),
}


@functools.lru_cache
def _randomised(config: TransformerConfig, seed: int) -> Transformer:
    return _randomise(config, seed)


@eqx.filter_jit
def _randomise(config: TransformerConfig, seed: int) -> Transformer:
    """A model whose biases, sinks and norm weights are random too (a fresh one has them constant)."""
    model = Transformer(config, key=jax.random.key(seed))
    leaves, treedef = jax.tree.flatten(model)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    leaves = [x + 0.3 * jax.random.normal(k, x.shape, x.dtype) if x.ndim <= 2 and x.shape[-1] != config.vocab_size
              else x for x, k in zip(leaves, keys)]
    return jax.tree.unflatten(treedef, leaves)


@pytest.fixture(scope="module")
def decode_fn():
    return jax.jit(decode_step)


@eqx.filter_jit
def _full_logits(model, tokens):
    return jax.vmap(lambda t: model(t, jnp.arange(t.shape[0], dtype=jnp.int32)))(tokens)


@pytest.mark.parametrize("kind", ["gemma", "llama"])
@pytest.mark.slow
def test_decode_with_the_layers_unrolled_equals_the_scanned_loop(kind, monkeypatch):
    """``decode_step`` unrolls its layer loop (``UNROLL_LAYERS_UP_TO``; gemma: a local / global period, the
    grouped scan): its logits and cache equal the scanned loop's."""
    decode = importlib.import_module("ringsplash.inference.decode")
    config = CONFIGS[kind]
    if kind == "gemma":  # two periods of (local, global): the grouped scan runs two iterations
        config = config.replace(num_layers=4, features=config.features.replace(layer_types=(
            "sliding_attention", "full_attention") * 2))
    else:
        config = config.replace(num_layers=4)
    model = _randomised(config, seed=3)
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, 64, (2, 12)), jnp.int32)
    cache = prefill(model, tokens, max_len=32).cache
    token = jnp.asarray([3, 7], jnp.int32)
    out = {}
    for up_to in (64, 0):
        monkeypatch.setattr(decode, "UNROLL_LAYERS_UP_TO", up_to)
        jax.clear_caches()  # a module constant read while tracing: trace afresh
        logits, new = jax.jit(decode_step)(model, cache, token)
        hlo = jax.jit(decode_step).lower(model, cache, token).as_text()
        assert ("stablehlo.while" in hlo) == (up_to == 0)  # unrolled: no loop over the layers
        out[up_to] = (logits, new.k, new.v)
    for a, b in zip(out[64], out[0]):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)


def test_prefill_runs_its_forward_over_a_length_the_kernels_tile_with_large_blocks():
    """A cache of prompt + room slots (8320 for an 8K prompt) has no 1024-multiple divisor: a forward over it
    would run the Splash kernels at 128-token blocks (a tenth of the chip's speed, measured on v5e)."""
    from ringsplash.inference.prefill import forward_len

    for prompt, block in ((8192, 512), (16384, 1024), (32768, 1024), (131072, 1024)):
        for extra in (0, 1, 100, 1023):
            assert forward_len(prompt + extra) % block == 0 and forward_len(prompt + extra) >= prompt + extra
    assert [forward_len(n) for n in (9, 128, 300, 1100, 8193)] == [128, 128, 384, 1152, 8704]
    for n in range(1, 5000, 7):  # never more than 1/16 of padding beyond the 128-token lanes
        assert forward_len(n) - n <= max(n / 16, 127) and forward_len(n) % 128 == 0


#: Gemma-like runs in the fast tier: it has nearly every option the other two have
@pytest.mark.parametrize("kind", [k if k == "gemma" else pytest.param(k, marks=pytest.mark.slow) for k in CONFIGS])
@pytest.mark.slow
def test_decode_logits_equal_full_forward_at_every_position(kind, decode_fn):
    model = _randomised(CONFIGS[kind], seed=3)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 64, (2, SEQ)), jnp.int32)
    lengths = np.array([5, 9])
    full = _full_logits(model, tokens)
    logits, cache = prefill(model, tokens[:, :9], prompt_lengths=jnp.asarray(lengths), max_len=SEQ, all_logits=True)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(logits[b, :n], full[b, :n], atol=ATOL, rtol=0)
    rows = np.arange(2)
    for i in range(SEQ - lengths.max()):
        logits, cache = decode_fn(model, cache, tokens[rows, lengths + i])
        np.testing.assert_allclose(logits, full[rows, lengths + i], atol=ATOL, rtol=0)
    assert cache.lengths.tolist() == (lengths + SEQ - lengths.max()).tolist()


@pytest.mark.slow  # the fast tier compares generate on a mesh with one device
def test_sharded_cache_equals_one_device(decode_fn):
    """4 devices, 512 slots (128 per device), prompts of 300 and 200 tokens: longer than a device's share."""
    model = _randomised(CONFIGS["gemma"], seed=5)
    mesh = train.make_mesh(1, 4)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 300)), jnp.int32)
    lengths = jnp.asarray([300, 200], jnp.int32)
    one, cache1 = prefill(model, tokens, prompt_lengths=lengths, max_len=512)
    four, cache4 = prefill(model, tokens, prompt_lengths=lengths, max_len=512, mesh=mesh)
    assert cache4.k.sharding.spec[3] == "context"
    assert cache4.k.addressable_shards[0].data.shape[3] == 512 // 4  # each device holds a quarter of the slots
    np.testing.assert_allclose(four, one, atol=ATOL, rtol=0)
    token1 = token4 = jnp.argmax(one, -1).astype(jnp.int32)
    for _ in range(4):
        one, cache1 = decode_fn(model, cache1, token1)
        four, cache4 = decode_fn(model, cache4, token4)
        np.testing.assert_allclose(four, one, atol=ATOL, rtol=0)
        token1, token4 = jnp.argmax(one, -1).astype(jnp.int32), jnp.argmax(four, -1).astype(jnp.int32)
        np.testing.assert_array_equal(token4, token1)
    # the new tokens' keys went to the devices owning positions 300..303 (device 2) and 200..203 (device 1)
    np.testing.assert_allclose(cache4.k, cache1.k, atol=ATOL, rtol=0)


@pytest.mark.slow
def test_generate_on_a_mesh_equals_one_device_and_compiles_the_step_once(caplog):
    model = _randomised(CONFIGS["sliding"], seed=7)
    prompts = jnp.asarray(np.random.default_rng(2).integers(0, 64, (2, 140)), jnp.int32)
    lengths = jnp.asarray([140, 131], jnp.int32)
    one = generate(model, prompts, 10, prompt_lengths=lengths)
    step = importlib.import_module("ringsplash.inference.generate")._steps
    before = step._cache_size()
    with jax.log_compiles(), caplog.at_level(logging.WARNING):
        four = generate(model, prompts, 10, prompt_lengths=lengths, mesh=train.make_mesh(1, 4))
    np.testing.assert_array_equal(four, one)
    assert four.shape == (2, 10) and four.dtype == jnp.int32
    assert step._cache_size() == before + 1  # one decode program (a step each on a mesh) for the 9 steps
    assert sum("_steps" in r.getMessage() and "Compiling" in r.getMessage() for r in caplog.records) <= 1



@pytest.mark.slow
def test_ring_model_fills_a_zigzag_cache_and_generates_as_on_one_device():
    """A model of attention='ring' (zigzag) prefills with its own ring over the mesh; the cache keeps the zigzag
    layout (each new token goes to the device whose zigzag chunk holds its position)."""
    model = _randomised(CONFIGS["gemma"], seed=5)
    ring = model.with_config(CONFIGS["gemma"].replace(context_parallel=CONFIGS["gemma"].context_parallel.replace(strategy="ring", ring_axis="context", ring_size=4, layout="zigzag")))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 300)), jnp.int32)
    lengths = jnp.asarray([300, 200], jnp.int32)
    _, cache = prefill(ring, tokens, prompt_lengths=lengths, mesh=train.make_mesh(1, 4))
    assert cache.layout == "zigzag" and cache.max_len == 1024  # 300 rounded up to 2 x 4 devices x 128
    one = generate(model, tokens, 6, prompt_lengths=lengths)
    four = generate(ring, tokens, 6, prompt_lengths=lengths, mesh=train.make_mesh(1, 4))
    np.testing.assert_array_equal(four, one)

# ------------------------------------------------------------------------------ sampling


PROBS = np.array([0.5, 0.2, 0.15, 0.1, 0.05])


@pytest.mark.parametrize("top_k, top_p, kept", [
    (2, None, [0, 1]), (None, 0.5, [0]), (None, 0.6, [0, 1]), (None, 0.7, [0, 1]), (None, 0.75, [0, 1, 2]),
    (None, 1.0, [0, 1, 2, 3, 4]),
    # after top-3 the probabilities are (0.5, 0.2, 0.15) / 0.85: 0.588 alone is below 0.8, with 0.235 it is not
    (3, 0.8, [0, 1]),
])
def test_filter_logits_keeps_the_defined_set(top_k, top_p, kept):
    logits = jnp.log(jnp.asarray(PROBS, jnp.float32))[None]
    out = filter_logits(logits, top_k, top_p)[0]
    assert np.flatnonzero(np.isfinite(np.asarray(out))).tolist() == kept
    np.testing.assert_array_equal(out[jnp.asarray(kept)], logits[0, jnp.asarray(kept)])


def test_sample_frequencies_follow_the_renormalised_distribution():
    n = 20_000
    logits = jnp.tile(jnp.log(jnp.asarray(PROBS, jnp.float32)), (n, 1))
    draws = np.asarray(sample(logits, jax.random.key(0), temperature=1.0, top_k=2))
    freq = np.bincount(draws, minlength=5) / n
    # binomial std at n=20000 is ~0.0032; 0.015 is ~5 std
    np.testing.assert_allclose(freq, [5 / 7, 2 / 7, 0, 0, 0], atol=0.015)
    assert (np.asarray(sample(logits[:3], None)) == 0).all()  # temperature 0: argmax


@pytest.mark.slow
def test_sampling_with_a_fixed_key_is_reproducible():
    model = _randomised(CONFIGS["llama"], seed=11)
    prompts = jnp.asarray(np.random.default_rng(3).integers(0, 64, (2, 6)), jnp.int32)
    kw = dict(temperature=1.5, top_k=20, top_p=0.9)
    a = rs.inference.generate(model, prompts, 8, key=jax.random.key(1), **kw)  # rs.inference: imported lazily
    b = generate(model, prompts, 8, key=jax.random.key(1), **kw)
    c = generate(model, prompts, 8, key=jax.random.key(2), **kw)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


@pytest.mark.slow
def test_generate_pads_a_stopped_row_with_its_stop_token():
    model = _randomised(CONFIGS["llama"], seed=11)
    prompts = jnp.asarray(np.random.default_rng(3).integers(0, 64, (2, 6)), jnp.int32)
    free = np.asarray(generate(model, prompts, 8))
    stop = int(free[0, 2])
    out = np.asarray(generate(model, prompts, 8, stop_tokens=(stop,)))
    first = int(np.flatnonzero(free[0] == stop)[0])
    np.testing.assert_array_equal(out[0, :first + 1], free[0, :first + 1])
    assert (out[0, first:] == stop).all()
    hit = np.flatnonzero(free[1] == stop)
    end = hit[0] if hit.size else 8
    np.testing.assert_array_equal(out[1, :end], free[1, :end])


@pytest.mark.slow
def test_generate_in_programs_of_several_steps_equals_one_step_per_program(monkeypatch):
    """``generate`` on one device runs ``STEPS_PER_PROGRAM`` tokens per program (``decode_steps``): the same
    tokens as one ``decode_step`` per program, greedy and sampled, with a stop token hit mid-program, for
    token counts that are not multiples of it (the last program's extra steps are trimmed); each setting's
    program is compiled once, for any token count that keeps the cache's bucket (11 and 9 here)."""
    module = importlib.import_module("ringsplash.inference.generate")
    model = _randomised(CONFIGS["llama"], seed=11)
    prompts = jnp.asarray(np.random.default_rng(3).integers(0, 64, (2, 9)), jnp.int32)
    lengths = jnp.asarray([9, 5], jnp.int32)
    before = module._steps._cache_size()
    free = np.asarray(generate(model, prompts, 11, prompt_lengths=lengths))
    runs = [dict(n=11, stop_tokens=(int(free[0, 6]),)), dict(n=6, temperature=1.5, top_k=20, key=jax.random.key(1)),
            dict(n=9)]
    multi = [free]
    for r in runs:
        before_run = module._steps._cache_size()
        multi.append(np.asarray(generate(model, prompts, r["n"], prompt_lengths=lengths,
                                         **{k: v for k, v in r.items() if k != "n"})))
    assert module.STEPS_PER_PROGRAM == 4
    # greedy, stop, sampled: at most one program each (fewer where an earlier test in this process compiled one)
    assert module._steps._cache_size() - before <= 3
    # greedy of 9 tokens (the last run) runs greedy of 11's program: the same cache, no compile
    assert bucket_length(9 + 9) == bucket_length(9 + 11) and module._steps._cache_size() == before_run
    monkeypatch.setattr(module, "STEPS_PER_PROGRAM", 1)
    runs = [dict(n=11)] + runs
    single = [np.asarray(generate(model, prompts, r["n"], prompt_lengths=lengths,
                                  **{k: v for k, v in r.items() if k != "n"})) for r in runs]
    for run, a, b in zip(runs, multi, single, strict=True):
        assert a.shape == (2, run["n"]), run
        np.testing.assert_array_equal(a, b, err_msg=str(run))
    assert (multi[1][0, 6:] == free[0, 6]).all() and not (free[0, 7:] == free[0, 6]).all()  # stopped mid-program
    np.testing.assert_array_equal(multi[3], free[:, :9])


@pytest.mark.slow  # over the fast tier's 5 s a test on 2 cores (2026-12-07: 5.5-7.7 s)
def test_generate_stops_launching_programs_once_every_row_has_stopped(monkeypatch):
    """Both rows stop at their second token: ``generate`` of 40 tokens stops launching decode programs at the
    second check (it reads the first check's flags, computed meanwhile): 4 programs of 4 steps, not 10, and
    the rows repeat their stop tokens to the end."""
    module = importlib.import_module("ringsplash.inference.generate")
    model = _randomised(CONFIGS["llama"], seed=11)
    prompts = jnp.asarray(np.random.default_rng(3).integers(0, 64, (2, 6)), jnp.int32)
    free = np.asarray(generate(model, prompts, 2))
    calls, steps = [], module._steps
    monkeypatch.setattr(module, "_steps", lambda *a, **k: calls.append(1) or steps(*a, **k))
    out = np.asarray(generate(model, prompts, 40, stop_tokens=tuple(int(t) for t in free[:, 1])))
    assert out.shape == (2, 40) and len(calls) == 4, len(calls)
    np.testing.assert_array_equal(out[:, :2], free)
    assert (out[:, 1:] == free[:, 1:]).all()


# ------------------------------------------------------------------------------ bad input


def test_bad_input_errors():
    model = _randomised(CONFIGS["llama"], seed=0)
    prompts = jnp.zeros((1, 8), jnp.int32)
    with pytest.raises(ValueError, match=r"prompt_len=8.*max_len=6"):
        prefill(model, prompts, max_len=6)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, prompts, 2, temperature=-1.0)
    for top_p in (0.0, 1.5):
        with pytest.raises(ValueError, match="top_p"):
            generate(model, prompts, 2, temperature=1.0, top_p=top_p, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"stop_tokens.*vocab_size=64.*\[64\]"):
        generate(model, prompts, 2, stop_tokens=(3, 64))
    with pytest.raises(ValueError, match=r"prompts must hold token ids in \[0, vocab_size=64\), got ids in \[64, 64\]"):
        generate(model, prompts + 64, 2)
    cache = empty_cache(model.config, 1, 8)
    other = eqx.filter_eval_shape(Transformer, CONFIGS["llama"].replace(num_kv_heads=4), key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"another model.*num_kv_heads"):
        decode_step(other, cache, jnp.zeros((1,), jnp.int32))
    with pytest.raises(ValueError, match="mesh"):
        decode_step(model, cache, jnp.zeros((1,), jnp.int32), mesh=train.make_mesh(1, 4))
    with pytest.raises(ValueError, match="causal mask"):
        prefill(model.with_config(CONFIGS["llama"].replace(mask="full")), prompts)


# ------------------------------------------------------------------------------ AOT at scale


@pytest.mark.tpu_compile
def test_decode_step_compiles_for_8b_with_1m_cache_on_v5p_4x4x4():
    """Llama-3-8B shapes, bfloat16, batch 1, a 1M-token cache sharded over the 64 chips of v5p:4x4x4
    (abstract shapes only): each device holds 1/64 of the cache."""
    from ringsplash import aot
    from ringsplash.inference.cache import KVCache, cache_specs, model_key

    config = TransformerConfig(vocab_size=128256, d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                               features=ModelFeatures(intermediate_size=14336), rope_theta=500000.0, max_seq_len=1 << 20,
                               param_dtype="bfloat16", compute_dtype="bfloat16")
    mesh = aot.topology_mesh("v5p:4x4x4", ("context",))
    n, max_len = mesh.shape["context"], 1 << 20
    model = jax.tree.map(lambda x: aot.abstract(x.shape, x.dtype, mesh),
                         eqx.filter_eval_shape(Transformer, config, key=jax.random.key(0)))
    kv, _, lengths, slots = cache_specs("context")
    shape = (config.num_layers, 1, config.num_kv_heads, max_len, config.head_dim)
    like = KVCache(jnp.zeros((1,) * 5, jnp.bfloat16), jnp.zeros((1,) * 5, jnp.bfloat16), jnp.zeros((1,), jnp.int32),
                   jnp.zeros((1,), jnp.int32), model_key(config), "contiguous", mesh, "context")
    cache = jax.tree.unflatten(jax.tree.structure(like), [
        aot.abstract(shape, jnp.bfloat16, mesh, kv), aot.abstract(shape, jnp.bfloat16, mesh, kv),
        aot.abstract((1,), jnp.int32, mesh, lengths), aot.abstract((max_len,), jnp.int32, mesh, slots)])
    tokens = aot.abstract((1,), jnp.int32, mesh)
    report = aot.compile_report(jax.jit(decode_step, donate_argnums=1), model, cache, tokens)
    cache_bytes = 2 * int(np.prod(shape)) * 2
    params_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model))
    print(f"8B decode step, 1M-token cache over {n} v5p chips: cache {cache_bytes / 2**30:.1f} GiB in all, "
          f"{cache_bytes / n / 2**30:.2f} GiB per device; per-device arguments {report.args / 2**30:.2f} GiB "
          f"(params {params_bytes / 2**30:.1f} GiB replicated), temp {report.temp / 2**30:.2f} GiB, "
          f"compiled in {report.seconds:.0f} s")
    # arguments per device = replicated parameters + this device's share of the cache (+ a few small arrays)
    assert abs(report.args - (params_bytes + cache_bytes / n)) < 2**20
    assert report.fits
    # one small collective in the (scanned) layer step: every device's partial output + lse, [64, heads, 1, dv + 1]
    # float32 (XLA may write the all-gather as an all-reduce, and merge its dimensions); no K/V moves (no permute, all-to-all, reduce-scatter)
    collectives = re.findall(r"= (\S+) (all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter)\(",
                             report.hlo_text)
    assert len(collectives) == 1 and collectives[0][0].startswith("f32["), collectives
    dims = collectives[0][0].split("{")[0][4:-1].split(",")
    assert np.prod([int(x) for x in dims]) == n * config.num_heads * 1 * (config.head_dim + 1), collectives


@pytest.mark.tpu_compile
def test_prefill_of_8_rows_of_32k_fits_one_v5e_chip():
    """Issue 40's benchmark model (8 layers, d_model 1024, 8 heads of 128, SwiGLU 4096, vocab 32768, bfloat16)
    prefilling 8 prompts of 32K tokens into a cache of 32K + 128 slots, compiled for one v5e chip: it holds
    the 8 GiB cache plus bounded activations. Cutting / padding the forward's keys and values to the cache's
    slots after the forward made a second cache-sized copy: Mosaic's compile ran out of HBM (15.91 GiB of
    temporaries); rows run 32K tokens at a time, the keys and values written into the cache's slots."""
    from ringsplash import aot
    from ringsplash.inference.prefill import prefill_program
    from ringsplash.model import abstract_model

    batch, prompt, max_len = 8, 32768, 32768 + 128
    config = TransformerConfig(vocab_size=32768, d_model=1024, num_layers=8, num_heads=8, num_kv_heads=8,
                               head_dim=128, features=ModelFeatures(intermediate_size=4096), max_seq_len=max_len,
                               context_parallel=ContextParallel("splash"), param_dtype="bfloat16",
                               compute_dtype="bfloat16")
    one_chip = jax.sharding.Mesh(aot.topology_devices("v5e:2x2")[:1], ("x",))
    model = jax.tree.map(lambda x: aot.abstract(x.shape, x.dtype, one_chip), abstract_model(config))
    program = prefill_program(model, prompt, max_len)
    # the model an argument (the program binds it: an abstract constant cannot be compiled in)
    report = aot.compile_report(lambda m, t, n: program.func(m, t, n, **program.keywords), program.args[0],
                                aot.abstract((batch, prompt), jnp.int32, one_chip),
                                aot.abstract((batch,), jnp.int32, one_chip))
    cache = 2 * config.num_layers * batch * config.num_kv_heads * max_len * config.head_dim * 2
    print(f"prefill 8 x 32K on v5e: cache {cache / 2**30:.2f} GiB, temporaries {report.temp / 2**30:.2f} GiB, "
          f"total {report.total / 2**30:.2f} GiB of {report.hbm / 2**30:.0f}")
    assert abs(report.out - cache) < 2**25  # the cache (and the [8, vocab] logits) is the output
    # measured: 3.1 GiB of temporaries (one row's activations and keys / values); a second copy of the
    # cache would be 8 GiB more
    assert report.temp < cache / 2 and report.fits_within(0.8)
