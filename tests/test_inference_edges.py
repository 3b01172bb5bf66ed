"""``ringsplash.inference`` at its edges (issue 39): non-finite logits, lengths past ``max_seq_len`` or
past a full cache, float lengths, compilations bounded across prompt lengths, and arguments of the
wrong kind, each a clear error (or, under ``jit``, detectable), never a silently wrong result.

The bad-argument cases call the entry points through ``inspect.unwrap``, i.e. without the test run's
jaxtyping/beartype wrapper, so they see what a user without runtime type checking sees: the
library's own error."""

import importlib
import inspect

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from ringsplash.inference import decode_step, empty_cache, filter_logits, generate, prefill, sample
from ringsplash.inference.sample import GREEDY_BELOW, check_sampling
from ringsplash.model import Transformer, TransformerConfig

CONFIG = TransformerConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=64)
PROMPTS = jnp.asarray(np.random.default_rng(3).integers(1, 64, (2, 8)), jnp.int32)
unchecked = inspect.unwrap  # the library's own checks, without the test run's jaxtyping hook


@pytest.fixture(scope="module")
def model() -> Transformer:
    """A random model whose norm weights are random too, so its greedy tokens vary (a fresh one's barely do)."""
    model = Transformer(CONFIG, key=jax.random.key(5))
    leaves, treedef = jax.tree.flatten(model)
    keys = jax.random.split(jax.random.key(6), len(leaves))
    leaves = [x + 0.3 * jax.random.normal(k, x.shape, x.dtype) if x.ndim == 1 else x for x, k in zip(leaves, keys)]
    return jax.tree.unflatten(treedef, leaves)


# ------------------------------------------------------------------------------ N3: non-finite logits


@pytest.mark.slow
def test_generate_refuses_non_finite_logits(model):
    """One NaN weight used by every token: the prefill's logits are NaN, refused (was: token 0 forever)."""
    nan_model = eqx.tree_at(lambda m: m.final_norm.weight, model, model.final_norm.weight.at[0].set(jnp.nan))
    with pytest.raises(FloatingPointError, match=r"logits are not finite.*row\(s\) \[0, 1\].*new token 0"):
        generate(nan_model, PROMPTS, 4)


@pytest.mark.slow  # over the fast tier's 5 s a test on 2 cores (2026-12-07: 5.5-7.7 s)
def test_generate_refuses_logits_that_turn_non_finite_while_decoding(model):
    """A NaN embedding row of the first generated token only: the prompt's logits are finite, the first
    decode step's are not; the loop reads the device's flag and names the row and the step."""
    prompt = PROMPTS[:1]
    first = int(generate(model, prompt, 1)[0, 0])
    assert first not in np.asarray(prompt).tolist()
    nan_model = eqx.tree_at(lambda m: m.embedding, model, model.embedding.at[first].set(jnp.nan))
    with pytest.raises(FloatingPointError, match=r"not finite.*row\(s\) \[0\], from new token 1 on"):
        generate(nan_model, prompt, 12)  # read at the periodic check (step 8), before the loop ends
    with pytest.raises(FloatingPointError, match=r"not finite.*row\(s\) \[0\], from new token 1 on"):
        generate(nan_model, prompt, 3)  # read after the last step


# ------------------------------------------------------------------------------ N4: past max_seq_len


def test_generate_refuses_to_run_past_max_seq_len(model):
    with pytest.raises(ValueError, match=r"sequences of 65 tokens \(the longest prompt, 8 tokens, \+ "
                                         r"max_new_tokens=57\).*max_seq_len=64.*max_new_tokens <= 56"):
        generate(model, PROMPTS, 57)
    # the longest row counts, not the padded width: 5 + 59 = 64 fits
    out = generate(model, PROMPTS, 59, prompt_lengths=jnp.asarray([5, 3], jnp.int32))
    assert out.shape == (2, 59)
    with pytest.raises(ValueError, match=r"sequences of 65 tokens \(the longest prompt, 5 tokens"):
        generate(model, PROMPTS, 60, prompt_lengths=jnp.asarray([5, 3], jnp.int32))


# ------------------------------------------------------------------------------ N5: a full cache


def test_decode_step_refuses_a_full_cache_with_concrete_lengths(model):
    cache = prefill(model, PROMPTS, prompt_lengths=jnp.asarray([8, 5], jnp.int32), max_len=8).cache
    with pytest.raises(ValueError, match=r"cache is full: row\(s\) \[0\] already hold cache.max_len=8 tokens "
                                         r"\(cache.lengths=\[8, 5\]\)"):
        decode_step(model, cache, jnp.zeros((2,), jnp.int32))


@pytest.mark.slow
def test_decode_step_under_jit_makes_a_full_cache_detectable(model):
    """Traced lengths: the full row's logits are NaN (the other row's are right), and under checkify the
    step reports a failed check naming the lengths."""
    lengths = jnp.asarray([8, 5], jnp.int32)
    cache = prefill(model, PROMPTS, prompt_lengths=lengths, max_len=8).cache
    roomy = prefill(model, PROMPTS, prompt_lengths=lengths, max_len=16).cache
    tokens = jnp.asarray([3, 4], jnp.int32)
    logits, _ = jax.jit(decode_step)(model, cache, tokens)
    expected, _ = decode_step(model, roomy, tokens)
    assert np.isnan(np.asarray(logits[0])).all()
    np.testing.assert_allclose(logits[1], expected[1], atol=2e-5, rtol=0)
    err, _ = checkify.checkify(jax.jit(decode_step))(model, cache, tokens)
    with pytest.raises(checkify.JaxRuntimeError, match=r"cache is full.*cache.max_len=8.*cache.lengths=\[8 5\]"):
        err.throw()
    err, _ = checkify.checkify(jax.jit(decode_step))(model, roomy, tokens)
    assert err.get() is None


# ------------------------------------------------------------------------------ N6: float prompt_lengths


@pytest.mark.parametrize("entry", ["generate", "prefill"])
def test_float_prompt_lengths_are_refused(model, entry):
    lengths = jnp.asarray([3.7, 8.0], jnp.float32)
    call = (lambda: unchecked(generate)(model, PROMPTS, 2, prompt_lengths=lengths)) if entry == "generate" else (
        lambda: unchecked(prefill)(model, PROMPTS, prompt_lengths=lengths))
    with pytest.raises(TypeError, match=r"prompt_lengths must be integers.*prompt_lengths.dtype=float32"):
        call()


# ------------------------------------------------------------------------------ N11: compilations per length


def test_bucket_length_pads_less_than_a_quarter_and_takes_few_sizes():
    module = importlib.import_module("ringsplash.inference.generate")  # the package's ``generate`` is the function
    bucket_length, min_bucket = module.bucket_length, module.MIN_BUCKET
    sizes = {bucket_length(n) for n in range(1, 4097)}
    assert min(sizes) == min_bucket and len(sizes) <= 4 * 9  # 4 per doubling from 16 to 4096
    assert all(n <= bucket_length(n) < max(1.25 * n, min_bucket + 1) for n in range(1, 4097))
    assert bucket_length(300, 512) == 512 and bucket_length(600, 384) == 768  # then a mesh's multiple


@pytest.mark.slow
def test_generate_shares_compilations_across_prompt_lengths(model):
    """17 prompt lengths (1..17 tokens, 3 new): the cache lengths 4..20 fall in 2 buckets (16, 20), so at most 2
    prefill and 2 decode programs are compiled (was: one of each per length); the tokens equal the exact-shape
    (unbucketed) ones, rows of different lengths too."""
    module = importlib.import_module("ringsplash.inference.generate")
    prefill_jit = importlib.import_module("ringsplash.inference.prefill")._prefill_jit
    before = module._steps._cache_size(), prefill_jit._cache_size()
    prompts = jnp.asarray(np.random.default_rng(4).integers(0, 64, (2, 17)), jnp.int32)
    outs = {n: generate(model, prompts[:, :n], 3) for n in range(1, 18)}
    assert module._steps._cache_size() - before[0] <= 2
    assert prefill_jit._cache_size() - before[1] <= 2
    np.testing.assert_array_equal(outs[5], generate(model, prompts[:, :5], 3, bucket=False))
    lengths = jnp.asarray([17, 6], jnp.int32)  # rows of different lengths, masked past their own
    np.testing.assert_array_equal(generate(model, prompts, 3, prompt_lengths=lengths),
                                  generate(model, prompts, 3, prompt_lengths=lengths, bucket=False))


def test_generate_sizes_its_cache_in_whole_lanes_and_prefills_only_the_prompts_bucket(model, monkeypatch):
    """The cache ``generate`` prefills is a multiple of 128 slots, bucketed or not: on a v5e chip generate took
    4.93 ms per token with a cache of 32,833 slots and 3.35 with one of 32,896 (docs/tpu.md). The prompts are
    padded to their own bucket, not the cache's: the prefill's forward pass runs over the prompts' columns (a 32K
    prompt padded to its 40,960-slot cache did 1.44x the attention FLOPs on the chip, 2026-12-07)."""
    module = importlib.import_module("ringsplash.inference.generate")
    sizes, widths = [], []

    def spy(model, prompts, *, max_len, **kwargs):
        sizes.append(max_len)
        widths.append(prompts.shape[1])
        return prefill(model, prompts, max_len=max_len, **kwargs)

    monkeypatch.setattr(module, "prefill", spy)
    prompts = jnp.asarray(np.random.default_rng(5).integers(0, 64, (2, 9)), jnp.int32)
    for bucket in (False, True):
        generate(model, prompts, 3, bucket=bucket)
    assert sizes == [128, 128]  # 9 + 3 tokens: 12 exact, 16 bucketed, each rounded up to one lane
    assert widths == [9, 16]  # the prompts: exact, then bucket_length(9), not the cache's 128 slots


# ------------------------------------------------------------------------------ N13: arguments of the wrong kind


def _bad_calls(model):
    cache = prefill(model, PROMPTS, max_len=16).cache
    return [
        (lambda: unchecked(generate)(model, jnp.zeros((0, 8), jnp.int32), 2), ValueError,
         r"prompts must hold at least one row \(batch >= 1\), got prompts.shape=\(0, 8\)"),
        (lambda: unchecked(prefill)(model, jnp.zeros((0, 8), jnp.int32)), ValueError,
         r"tokens must hold at least one row \(batch >= 1\), got tokens.shape=\(0, 8\)"),
        (lambda: unchecked(generate)(model, PROMPTS, 2, stop_tokens="a"), TypeError,
         r"stop_tokens must be token ids in \[0, vocab_size=64\): an int or a sequence of ints, got the str 'a'"),
        (lambda: unchecked(generate)(model, PROMPTS, 2, stop_tokens=[3.0]), TypeError,
         r"stop_tokens must be token ids.*not ints: \[3.0\]"),
        (lambda: unchecked(prefill)(model, PROMPTS, max_len=12.0), ValueError,
         r"max_len must be an int >= 1, got max_len=12.0 \(float\)"),
        (lambda: unchecked(generate)(model, PROMPTS, 2.0), ValueError,
         r"max_new_tokens must be an int >= 1, got max_new_tokens=2.0 \(float\)"),
        (lambda: unchecked(generate)(model, PROMPTS.astype(jnp.float32), 2), TypeError,
         r"prompts must be integer token ids, got prompts.dtype=float32"),
        (lambda: unchecked(prefill)(model, PROMPTS.astype(jnp.float32)), TypeError,
         r"tokens must be integer token ids, got tokens.dtype=float32"),
        (lambda: unchecked(decode_step)(model, cache, jnp.zeros((2,), jnp.float32)), TypeError,
         r"tokens must be integer token ids, got tokens.dtype=float32"),
        (lambda: unchecked(generate)(CONFIG, PROMPTS, 2), TypeError,
         r"generate: model must be a ringsplash.model.Transformer, got TransformerConfig.*Transformer\(config, key"),
        (lambda: unchecked(prefill)(CONFIG, PROMPTS), TypeError,
         r"prefill: model must be a ringsplash.model.Transformer, got TransformerConfig"),
        (lambda: unchecked(decode_step)(CONFIG, cache, jnp.zeros((2,), jnp.int32)), TypeError,
         r"decode_step: model must be a ringsplash.model.Transformer, got TransformerConfig"),
        # issue 56 (7): a key that is no key, flags that are no bools, sizes that are no counts
        (lambda: unchecked(generate)(model, PROMPTS, 2, temperature=1.0, key=0), TypeError,
         r"key must be one jax.random key .*got a int 0"),
        (lambda: unchecked(generate)(model, PROMPTS, 2, temperature=1.0, key=jax.random.split(jax.random.key(0))),
         TypeError, r"key must be one jax.random key .*got a .* of shape \(2,\)"),
        (lambda: unchecked(generate)(model, PROMPTS, 2, temperature=float("inf"), key=jax.random.key(0)), ValueError,
         r"temperature must be a finite number >= 0 \(0: greedy\), got temperature=inf"),
        (lambda: unchecked(generate)(model, PROMPTS, 2, progress="no"), TypeError,
         r"progress must be a bool, got progress='no' \(str\)"),
        (lambda: unchecked(generate)(model, PROMPTS, 2, bucket=None), TypeError, r"bucket must be a bool, got bucket=None"),
        (lambda: unchecked(prefill)(model, PROMPTS, all_logits=1), TypeError, r"all_logits must be a bool, got all_logits=1"),
        (lambda: unchecked(empty_cache)(CONFIG, 0, 16), ValueError, r"batch must be an int >= 1, got batch=0"),
        (lambda: unchecked(empty_cache)(CONFIG, 2, 16.0), ValueError, r"max_len must be an int >= 1, got max_len=16.0"),
    ]


def test_bad_arguments_name_the_argument_the_expectation_and_the_value(model):
    for call, exc, match in _bad_calls(model):
        with pytest.raises(exc, match=match):
            call()


@pytest.mark.slow
def test_numpy_integer_counts_are_accepted(model):
    """``np.int64`` counts (``max_new_tokens``, ``top_k``, ``max_len``, stop ids) are integers: accepted, through
    the annotated entry points too, with the same results as Python ints."""
    kw = dict(temperature=1.0, key=jax.random.key(0))
    np.testing.assert_array_equal(generate(model, PROMPTS, np.int64(4), top_k=np.int64(5), **kw),
                                  generate(model, PROMPTS, 4, top_k=5, **kw))
    free = np.asarray(generate(model, PROMPTS, 4))
    np.testing.assert_array_equal(generate(model, PROMPTS, 4, stop_tokens=np.int64(free[0, 1])),
                                  generate(model, PROMPTS, 4, stop_tokens=(int(free[0, 1]),)))
    a, b = prefill(model, PROMPTS, max_len=np.int64(16)), prefill(model, PROMPTS, max_len=16)
    assert a.cache.max_len == 16
    np.testing.assert_array_equal(a.logits, b.logits)


# ------------------------------------------------------------------------------ issue 56 (7): inputs mishandled


def test_sample_at_a_tiny_temperature_is_greedy_never_garbage():
    """``logits / temperature`` overflowed float32 below ~1e-38 (inf - inf: NaN, then arbitrary draws); now the
    max-subtracted logits are scaled, and a temperature below float32's smallest normal number is greedy."""
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(8, 64)) * 5, jnp.float32)
    greedy = np.argmax(np.asarray(logits), axis=-1)
    for temperature in (1e-45, 1e-38, GREEDY_BELOW, 2e-38, 1e-30):
        drawn = sample(logits, jax.random.key(1), temperature=temperature, top_p=0.9)
        np.testing.assert_array_equal(drawn, greedy, err_msg=str(temperature))


def test_sample_and_filter_logits_check_their_settings_as_generate_does():
    """``sample`` / ``filter_logits`` are public too: a negative temperature sampled the least likely tokens,
    ``top_p=0`` kept nothing (every logit -inf: arbitrary draws), a missing key was JAX's own error."""
    logits = jnp.zeros((2, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"temperature must be a finite number >= 0"):
        sample(logits, jax.random.key(0), temperature=-1.0)
    with pytest.raises(ValueError, match=r"sampling \(temperature > 0\) needs key="):
        sample(logits, None, temperature=1.0)
    with pytest.raises(ValueError, match=r"top_p must be None or in \(0, 1\], got top_p=0.0"):
        unchecked(filter_logits)(logits, top_p=0.0)
    with pytest.raises(ValueError, match=r"top_k must be None or an int >= 1, got top_k=0"):
        unchecked(filter_logits)(logits, top_k=0)


def test_generate_at_a_tiny_temperature_equals_greedy(model):
    np.testing.assert_array_equal(generate(model, PROMPTS, 3, temperature=1e-38, key=jax.random.key(0)),
                                  generate(model, PROMPTS, 3))


def test_numpy_and_jax_scalars_are_accepted_as_numbers(model):
    """``np.float32`` / ``jnp.float32`` temperatures and top-p, NumPy / JAX integer counts: the Python numbers they
    hold, the same tokens (were: refused as if not numbers), through the annotated entry points too."""
    assert check_sampling(np.float32(0.7), jnp.int32(5), jnp.float32(0.9)) == (float(np.float32(0.7)), 5,
                                                                                float(np.float32(0.9)))
    key = jax.random.key(0)
    expected = generate(model, PROMPTS, 4, temperature=1.0, top_k=5, key=key)  # as the integer-count test's
    for temperature, top_k, count in ((np.float32(1.0), np.int64(5), np.int32(4)),
                                      (jnp.float32(1.0), jnp.int32(5), jnp.int32(4))):
        np.testing.assert_array_equal(generate(model, PROMPTS, count, temperature=temperature, top_k=top_k, key=key),
                                      expected)
    assert prefill(model, PROMPTS, max_len=jnp.int32(16)).cache.max_len == 16


def test_prefill_refuses_prompts_and_caches_past_max_seq_len(model):
    """As ``model()`` and ``generate`` do: a prompt longer than ``max_seq_len`` (64), or a cache beyond it rounded up
    to whole 128-slot lanes (were: accepted, and decodable past ``max_seq_len``); padding past every row's
    length does not count."""
    with pytest.raises(ValueError, match=r"longest prompt has 65 tokens, more than the model's max_seq_len=64"):
        prefill(model, jnp.ones((1, 65), jnp.int32))
    with pytest.raises(ValueError, match=r"max_len=256 is more than the model's max_seq_len=64 .*max_len <= 128"):
        prefill(model, PROMPTS, max_len=256)
    long = jnp.ones((2, 80), jnp.int32)
    with pytest.raises(ValueError, match=r"longest prompt has 70 tokens"):
        prefill(model, long, prompt_lengths=jnp.asarray([70, 3], jnp.int32))


def test_decode_step_refuses_positions_past_max_seq_len_and_unknown_tokens(model):
    """Concrete lengths at ``max_seq_len`` and concrete token ids outside the vocabulary are refused (were: logits
    returned); under ``jit`` those rows' logits are NaN and ``checkify`` names them."""
    cache = empty_cache(CONFIG, 3, 128)
    at_end = eqx.tree_at(lambda c: c.lengths, cache, jnp.asarray([64, 5, 5], jnp.int32))
    with pytest.raises(ValueError, match=r"row\(s\) \[0\] already hold the model's max_seq_len=64 tokens"):
        decode_step(model, at_end, jnp.asarray([1, 2, 3], jnp.int32))
    for bad in (64, -1):
        with pytest.raises(ValueError, match=rf"tokens must be token ids in \[0, vocab_size=64\), got tokens=\[1, "
                                             rf"{bad}, 3\] \(row\(s\) \[1\] outside\)"):
            decode_step(model, cache, jnp.asarray([1, bad, 3], jnp.int32))
    step = jax.jit(decode_step)
    logits, _ = step(model, at_end, jnp.asarray([1, 64, 3], jnp.int32))
    assert np.isnan(np.asarray(logits[:2])).all() and np.isfinite(np.asarray(logits[2])).all()
    err, _ = checkify.checkify(step)(model, at_end, jnp.asarray([1, 64, 3], jnp.int32))
    with pytest.raises(checkify.JaxRuntimeError, match=r"max_seq_len=64|vocab_size=64"):
        err.throw()
