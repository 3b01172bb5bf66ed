"""``decode_steps``: several decode steps as one program, the cache read-only until one write at the end."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ringsplash import train
from ringsplash.inference import decode_step, decode_steps, empty_cache, prefill
from ringsplash.model import ModelFeatures, Transformer, TransformerConfig
from support.decode_compile import v5e_decode_inputs

TINY = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=1024)
CONFIGS = {
    "llama": TransformerConfig(**TINY),
    # a window of 3 on every layer (the side buffer's earlier tokens leave it), biases, sinks, soft cap
    "sliding": TransformerConfig(**TINY, mask="local", local_window=3, features=ModelFeatures(attention_bias=True),
                                 sinks=True, logit_soft_cap=4.0),
}


def _model(name="llama"):
    return Transformer(CONFIGS[name], key=jax.random.key(1))


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.slow
def test_decode_steps_equals_decode_step_calls_with_ragged_rows(name):
    """6 steps in one program against 6 ``decode_step`` calls, rows at different lengths: the same greedy
    tokens, the last logits and the cache within 1e-5 (float32; measured 1.2e-6 / 1.4e-6 on a larger model:
    the programs fuse differently)."""
    model = _model(name)
    tokens = np.random.default_rng(0).integers(0, 64, (3, 40), dtype=np.int32)
    out = prefill(model, jnp.asarray(tokens), max_len=128, prompt_lengths=jnp.array([40, 17, 33]))
    token = jnp.argmax(out.logits, -1).astype(jnp.int32)
    ref, cache, t = [], out.cache, token
    for _ in range(6):
        logits, cache = decode_step(model, cache, t)
        t = jnp.argmax(logits, -1).astype(jnp.int32)
        ref.append(t)
    got, last, new, _ = jax.jit(lambda m, c, t: decode_steps(m, c, t, 6))(model, out.cache, token)
    np.testing.assert_array_equal(got, jnp.stack(ref))
    np.testing.assert_allclose(last, logits, atol=1e-5)
    np.testing.assert_allclose(new.k, cache.k, atol=1e-5)
    np.testing.assert_allclose(new.v, cache.v, atol=1e-5)
    np.testing.assert_array_equal(new.lengths, [46, 23, 39])


def test_decode_steps_refuses_what_it_does_not_support():
    model = _model()
    cache = empty_cache(model.config, 2, 128)
    with pytest.raises(ValueError, match="steps must be a positive int, got 0"):
        decode_steps(model, cache, jnp.zeros((2,), jnp.int32), 0)
    with pytest.raises(ValueError, match=r"tokens must be int \[batch=2\]"):
        decode_steps(model, cache, jnp.zeros((3,), jnp.int32), 2)
    with pytest.raises(ValueError, match=r"no room for steps=129 more tokens in row\(s\) \[0, 1\] \(cache.lengths="
                                         r"\[0, 0\], cache.max_len=128\)"):
        decode_steps(model, cache, jnp.zeros((2,), jnp.int32), 129)
    sharded = empty_cache(model.config, 2, 128, mesh=train.make_mesh(1, 2))
    with pytest.raises(ValueError, match=r"a cache without a mesh and with the contiguous layout is supported, got "
                                         r"mesh=.*use decode_step"):
        decode_steps(model, sharded, jnp.zeros((2,), jnp.int32), 2)
    with pytest.raises(TypeError, match="typechecking parameter 'tokens'"):  # jaxtyping: Int[Array, " batch"]
        decode_steps(model, cache, jnp.zeros((2,), jnp.float32), 2)


@pytest.mark.tpu_compile
def test_decode_steps_compiles_for_v5e_without_copying_the_cache():
    """XLA's compile for one v5e chip (head size 128, bfloat16, GQA 4:2, 8 rows of 8K slots): 8 steps as one
    program hold no copy of the cache and temporaries far below it, while 8 ``decode_step`` calls in one
    program copy the whole cache after every step's write (why ``decode_steps`` keeps it read-only)."""
    config = TransformerConfig(vocab_size=256, d_model=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=128,
                               max_seq_len=8192, param_dtype="bfloat16", compute_dtype="bfloat16")
    inputs = v5e_decode_inputs(config, 8, 8192)
    cache_bytes = inputs.cache_bytes
    report = lambda fn: inputs.report(fn)[1:]

    copies, temp = report(lambda m, c, t: decode_steps(m, c, t, 8))
    assert not copies and temp < cache_bytes / 4, (copies[:2], temp, cache_bytes)

    def calls(m, c, t):
        for _ in range(8):
            logits, c = decode_step(m, c, t)
            t = jnp.argmax(logits, -1).astype(jnp.int32)
        return t, c

    copies, temp = report(calls)
    assert copies and temp >= cache_bytes, (len(copies), temp, cache_bytes)


@pytest.mark.parametrize("length", [0, 5, 61, 63, 64])
def test_write_side_of_one_row_equals_the_scatter(length):
    """``_write_side`` at batch 1 (a ``dynamic_update_slice``) writes what the scatter writes: the 4 new slots at
    the row's length, those past the 64-slot cache dropped (a row without room: lengths 61, 63, 64)."""
    from ringsplash.inference.decode import _write_side

    rng = np.random.default_rng(length)
    cache = jnp.asarray(rng.standard_normal((2, 1, 2, 64, 8)), jnp.float32)
    side = jnp.asarray(rng.standard_normal((2, 1, 2, 4, 8)), jnp.float32)
    lengths = jnp.array([length], jnp.int32)
    got = jax.jit(_write_side)(cache, side, lengths)
    slots = length + np.arange(4)
    want = np.asarray(cache).copy()
    want[:, 0, :, slots[slots < 64]] = np.asarray(side)[:, 0, :, slots < 64]
    np.testing.assert_array_equal(got, want)


@pytest.mark.tpu_compile
def test_decode_steps_at_batch_one_compiles_for_v5e_without_copying_the_cache():
    """At batch 1 the program holds no copy of the cache either: the new slots go in with a dynamic_update_slice
    (the scatter made XLA lay the cache out again and back around the write, two copies per program)."""
    config = TransformerConfig(vocab_size=256, d_model=256, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=128,
                               max_seq_len=8192, param_dtype="bfloat16", compute_dtype="bfloat16")
    inputs = v5e_decode_inputs(config, 1, 8192)
    _, copies, temp = inputs.report(lambda m, c, t: decode_steps(m, c, t, 4))
    assert not copies, copies[:2]
    assert temp < inputs.cache_bytes / 4
