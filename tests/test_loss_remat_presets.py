"""Chunked cross-entropy equals the unchunked loss (value and gradient); every remat policy
gives the gradients of ``"none"``; presets and their command-line overrides; bad input."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ringsplash import train
from ringsplash.cli import parse_config
from ringsplash.model import REMAT_POLICIES, ContextParallel, Transformer, TransformerConfig
from ringsplash.model.presets import PRESET_NAMES, PRESETS, preset


def _loss_inputs(key, tokens=96, d=16, vocab=40):
    kh, kw, kl, km = jax.random.split(key, 4)
    hidden = jax.random.normal(kh, (tokens, d))
    w = jax.random.normal(kw, (d, vocab)) / d**0.5
    labels = jax.random.randint(kl, (tokens,), 0, vocab)
    weights = (jax.random.uniform(km, (tokens,)) > 0.3).astype(jnp.float32)
    return hidden, w, labels, weights


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [8, 32, 96])
def test_chunked_loss_equals_unchunked_value_and_gradient(key, chunk):
    hidden, w, labels, weights = _loss_inputs(key)

    def direct(h, u):  # the textbook loss on the full [tokens, vocab] logits
        logits = h @ u
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        return jnp.sum(ce * weights), jnp.sum((jnp.argmax(logits, -1) == labels) * weights)

    def chunked(h, u):
        return train.chunked_loss_sums(h, u, labels, weights, chunk)

    (ref, ref_correct), (chk, chk_correct) = direct(hidden, w), chunked(hidden, w)
    np.testing.assert_allclose(chk, ref, rtol=1e-6)  # measured 0-2e-7 relative; float32 sums in another order
    assert float(chk_correct) == float(ref_correct)
    g_ref = jax.grad(lambda h, u: direct(h, u)[0], argnums=(0, 1))(hidden, w)
    g_chk = jax.jit(jax.grad(lambda h, u: chunked(h, u)[0], argnums=(0, 1)))(hidden, w)
    for a, b in zip(g_chk, g_ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)  # measured < 5e-7 abs; 10x headroom


def test_chunked_loss_rejects_a_chunk_that_does_not_divide(key):
    hidden, w, labels, weights = _loss_inputs(key)
    with pytest.raises(ValueError, match=r"loss_chunk=40 must divide the number of local tokens per device \(96"):
        train.chunked_loss_sums(hidden, w, labels, weights, 40)
    with pytest.raises(ValueError, match="loss_chunk must be >= 0"):
        train.TrainConfig(loss_chunk=-1)


@pytest.mark.slow
def test_every_remat_policy_gives_the_gradients_of_none(key):
    config = TransformerConfig(vocab_size=40, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=64,
                               sinks=True, context_parallel=ContextParallel("reference"))  # as measured (<= 1e-7)
    model = Transformer(config, key=key)
    tokens = jax.random.randint(jax.random.fold_in(key, 1), (64,), 0, 40)

    def grads(policy):
        m = model.with_config(config.replace(remat=policy))
        return jax.jit(jax.grad(lambda m: jnp.sum(jnp.sin(m(tokens, jnp.arange(64))))))(m)

    ref = jax.tree.leaves(grads("none"))
    assert max(float(jnp.abs(g).max()) for g in ref) > 1e-3
    for policy in REMAT_POLICIES[1:]:
        for a, b in zip(jax.tree.leaves(grads(policy)), ref, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=policy)  # measured <= 1e-7 abs


def test_unknown_remat_policy_lists_the_choices():
    # ValueError from the config's check; under the shape-checked test run the Literal annotation
    # may reject it first (a TypeError naming the same choices)
    for bad in ("some", True):
        with pytest.raises((ValueError, TypeError)) as error:
            TransformerConfig(vocab_size=8, remat=bad)
        assert "'none', 'full', 'save_attention', 'save_dots'" in str(error.value)


def test_presets_have_the_issue_shapes():
    big = preset("llama3-8b")
    assert (big.num_layers, big.d_model, big.num_heads, big.num_kv_heads, big.head_dim, big.mlp_hidden,
            big.vocab_size, big.rope_theta) == (32, 4096, 32, 8, 128, 14336, 128256, 500000.0)
    one = preset("1b")
    assert (one.num_layers, one.d_model, one.num_heads, one.num_kv_heads, one.head_dim, one.mlp_hidden,
            one.vocab_size) == (16, 2048, 16, 8, 128, 8192, 128256)
    tiny = preset("tiny", max_seq_len=1024)
    assert (tiny.vocab_size, tiny.d_model, tiny.num_layers, tiny.num_heads, tiny.mlp_ratio) == (97, 64, 2, 1, 2.0)
    assert preset("1b", num_layers=2).num_layers == 2


def test_unknown_preset_lists_the_choices(capsys):
    with pytest.raises(ValueError, match=r"preset must be one of \('tiny', '1b', 'llama3-8b'\)"):
        preset("7b")

    @dataclasses.dataclass(frozen=True)
    class Cfg:
        preset: str = ""
        d_model: int = 8
        num_layers: int = 1

    with pytest.raises(SystemExit):
        parse_config(Cfg, ["--preset", "7b"], presets=PRESETS)
    assert "unknown preset '7b': choose one of ('tiny', '1b', 'llama3-8b')" in capsys.readouterr().err
    assert parse_config(Cfg, [], presets=PRESETS) == Cfg()
    assert parse_config(Cfg, ["--preset", "1b"], presets=PRESETS) == Cfg(preset="1b", d_model=2048, num_layers=16)
    assert parse_config(Cfg, ["--preset", "1b", "--num-layers", "3"], presets=PRESETS) == Cfg("1b", 2048, 3)
    assert PRESET_NAMES == ("tiny", "1b", "llama3-8b")


def test_main_job_takes_a_preset_and_overrides():
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "experiments"))
    import train_long_context as job

    assert job.parse_args([]) == job.Config()  # the default is the tiny preset
    got = job.parse_args(["--preset", "1b", "--num-layers", "2"])
    assert (got.d_model, got.num_layers, got.num_heads, got.num_kv_heads, got.head_dim, got.mlp_ratio,
            got.mlp_multiple, got.rope_theta) == (2048, 2, 16, 8, 128, 4.0, 256, 500000.0)


def test_byte_lm_takes_a_preset_and_overrides():
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "experiments"))
    import byte_lm

    default = byte_lm.parse_args([])
    assert default == byte_lm.Config() and default.preset == ""  # no preset: the experiment's own model
    ring = ["--context-parallel", "4"]  # main() resolves the default (0: auto) before it builds the model config
    mc = byte_lm.model_config(byte_lm.parse_args(ring))
    assert (mc.vocab_size, mc.d_model, mc.num_layers, mc.num_heads, mc.num_kv_heads, mc.head_dim) == (256, 128, 3, 4,
                                                                                                      4, 32)
    got = byte_lm.parse_args(["--preset", "1b", "--num-layers", "2", "--rope-theta", "1000", "--seq-len", "512", *ring])
    assert (got.d_model, got.num_layers, got.num_heads, got.num_kv_heads, got.head_dim, got.mlp_ratio,
            got.mlp_multiple, got.rope_theta) == (2048, 2, 16, 8, 128, 4.0, 256, 1000.0)
    mc = byte_lm.model_config(got)
    want = preset("1b", num_layers=2, rope_theta=1000.0, vocab_size=256, max_seq_len=512)
    assert (mc.vocab_size, mc.d_model, mc.num_layers, mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.mlp_hidden,
            mc.rope_theta) == (want.vocab_size, want.d_model, 2, 16, 8, 128, 8192, 1000.0)
    tiny = byte_lm.model_config(byte_lm.parse_args(["--preset", "tiny", *ring]))
    assert (tiny.vocab_size, tiny.d_model, tiny.num_layers, tiny.num_heads, tiny.mlp_ratio) == (256, 64, 2, 1, 2.0)


@pytest.mark.slow
def test_save_attention_does_not_rerun_the_ring_forward():
    """Under "full" the backward pass re-runs each layer, ring included (more collective-permutes
    in the step); "save_attention" keeps the ring's named output / lse residuals, so its step has
    exactly the permutes of "none" (measured: none 13, full 16, save_attention 13). Remat is
    decided before XLA runs: the lowered (StableHLO) program gives the same counts as the compiled
    one (checked for all three policies), without three XLA compiles.
    One layer and S = 512 (half-shards of 64 tokens): the counts are per program, not per layer."""
    import equinox as eqx

    from ringsplash import data
    from ringsplash.splash import SplashConfig

    blocks = SplashConfig(block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128, backend="xla")
    task = data.RecallTask(seq_len=512, num_pairs=8, num_queries=8, num_keys=16, num_values=8, num_filler=8)
    mesh = train.make_mesh(1, 4)
    counts = {}
    for policy in ("none", "full", "save_attention"):
        config = TransformerConfig(vocab_size=task.vocab_size, d_model=16, num_layers=1, num_heads=2, max_seq_len=512,
                                   splash=blocks, context_parallel=ContextParallel("ring", ring_size=4), remat=policy)
        params, static = eqx.partition(Transformer(config, key=jax.random.key(0)), eqx.is_array)
        batch = train.shard_batch(task.batch(np.random.default_rng(0), 2), mesh, config)
        grad_fn = train.make_grad_fn(config, mesh)
        lowered = jax.jit(lambda p, b, g=grad_fn, s=static: g(p, s, b)).lower(params, batch).as_text()
        counts[policy] = lowered.count("collective_permute")
    assert counts["full"] > counts["none"] == counts["save_attention"], counts
