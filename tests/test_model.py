"""Transformer: shapes, options, and the same logits and gradients under every strategy.

The strategies run through the trainer's own sharded gradient function, on a (1 x N) mesh
of simulated CPU devices for the ring (tokens laid out by the ring layout, results mapped
back to original order) and on one device otherwise.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ringsplash import data, layouts, train
from ringsplash.model import Transformer, TransformerConfig
from ringsplash.splash import SplashConfig

BLOCKS = SplashConfig(block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128, backend="xla")
RTOL, ATOL = 2e-4, 2e-5  # float32, accumulation order differs between strategies


def _config(**kw):
    base = dict(vocab_size=48, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=1024,
                splash=BLOCKS, sinks=True, logit_soft_cap=20.0)
    return TransformerConfig(**{**base, **kw})


def _batch(seq, rows=2):
    task = data.RecallTask(seq_len=seq, num_pairs=8, num_queries=8, num_keys=16, num_values=8, num_filler=16)
    b = task.batch(np.random.default_rng(0), rows)
    # two documents per row (segment ids, positions restart) and every position scored
    cut = seq // 3
    seg = (np.arange(seq) >= cut).astype(np.int32)
    pos = np.where(np.arange(seq) >= cut, np.arange(seq) - cut, np.arange(seq)).astype(np.int32)
    return b._replace(segment_ids=np.broadcast_to(seg, (rows, seq)).copy(),
                      positions=np.broadcast_to(pos, (rows, seq)).copy(), loss_mask=np.ones((rows, seq), np.float32))


def _run(config, model, batch):
    """(logits in original order, grads) for one strategy."""
    n = config.ring_size
    mesh = train.make_mesh(1, n)
    sharded = train.shard_batch(batch, mesh, config)
    params, static = eqx.partition(model, eqx.is_array)
    params = train.replicate(params, mesh)
    logits = train.make_logits_fn(config, mesh)(eqx.combine(params, static), sharded)
    grads, metrics = jax.jit(lambda p, b: train.make_grad_fn(config, mesh)(p, static, b))(params, sharded)
    logits = np.asarray(logits)
    if config.attention == "ring":
        logits = layouts.unpermute(logits, config.ring_layout, n, axis=1)
    return logits, jax.device_get(grads), float(metrics["loss"])


def _assert_tree_close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("layout, seq", [("zigzag", 1024), ("striped", 512)])
def test_model_strategies_agree(layout, seq):
    ref_config = _config(max_seq_len=seq)
    model = Transformer(ref_config, key=jax.random.key(0))
    batch = _batch(seq)
    ref_logits, ref_grads, ref_loss = _run(ref_config, model, batch)
    assert np.isfinite(ref_logits).all() and np.isfinite(ref_loss)
    for config in (
        ref_config.replace(attention="splash"),
        ref_config.replace(attention="ring", ring_axis_name="context", ring_size=4, ring_layout=layout),
    ):
        m = _with_config(model, config)
        logits, grads, loss = _run(config, m, batch)
        np.testing.assert_allclose(logits, ref_logits, rtol=RTOL, atol=ATOL, err_msg=config.attention)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
        _assert_tree_close(grads, ref_grads)


def _with_config(model, config):
    """The same parameters under another (compatible) config."""
    return model.with_config(config)


def test_model_shapes_and_options(key):
    config = _config(max_seq_len=256, num_kv_heads=1, remat="full", tie_embeddings=True)
    model = Transformer(config, key=key)
    tokens = jnp.arange(256) % config.vocab_size
    logits = model(tokens, jnp.arange(256))
    assert logits.shape == (256, config.vocab_size) and logits.dtype == jnp.float32
    assert model.layers.attention.wq.shape == (2, 32, 32)  # stacked [layers, ...]
    assert model.layers.attention.sinks.shape == (2, 4)
    # remat does not change the function
    plain = _with_config(model, config.replace(remat="none"))
    np.testing.assert_allclose(plain(tokens, jnp.arange(256)), logits, rtol=1e-6, atol=1e-6)


def test_model_positions_are_explicit(key):
    """RoPE uses the positions passed in: a permuted sequence with its positions, under full
    attention, gives the permuted logits."""
    config = _config(max_seq_len=128, mask="full", sinks=False)
    model = Transformer(config, key=key)
    tokens = jax.random.randint(key, (128,), 0, config.vocab_size)
    perm = layouts.permutation("zigzag", 128, 4)
    out = model(tokens, jnp.arange(128))
    out_perm = model(tokens[perm], jnp.asarray(perm))
    np.testing.assert_allclose(out_perm, out[perm], rtol=1e-4, atol=1e-5)


def test_model_dropout_only_with_key(key):
    config = _config(max_seq_len=128, attention_dropout=0.3)
    model = Transformer(config, key=key)
    tokens = jnp.arange(128) % config.vocab_size
    plain = _with_config(model, config.replace(attention_dropout=0.0))
    np.testing.assert_allclose(model(tokens, jnp.arange(128)), plain(tokens, jnp.arange(128)), rtol=1e-6)
    assert not np.allclose(model(tokens, jnp.arange(128), key=key), plain(tokens, jnp.arange(128)))


def test_model_bfloat16(key):
    config = _config(max_seq_len=128, param_dtype="bfloat16", compute_dtype="bfloat16")
    model = Transformer(config, key=key)
    assert model.embedding.dtype == jnp.bfloat16
    logits = model(jnp.arange(128) % 48, jnp.arange(128))
    assert logits.dtype == jnp.float32 and np.isfinite(np.asarray(logits)).all()
