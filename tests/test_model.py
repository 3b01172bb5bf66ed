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
from ringsplash.model import ContextParallel, ModelFeatures, Transformer, TransformerConfig
from ringsplash.splash import SplashConfig

BLOCKS = SplashConfig(block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128, backend="xla")
# float32, accumulation order differs between strategies. Measured (S = 512, splash / ring zigzag / ring striped
# against the reference): logits <= 1.4e-6 abs, at most 0.31 of this bound; grads <= 1.9e-8 abs; loss 1.1e-7
# relative. Each bound below is within 10x of its measured error.
RTOL, ATOL = 2e-5, 2e-6
GRAD_RTOL, GRAD_ATOL = 2e-5, 1.5e-7
LOSS_RTOL = 1e-6


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
    """(logits in original order, grads, loss) for one strategy: the trainer's logits function and
    sharded gradient function in one jit, so one compile per strategy (compiling dominates these runs)."""
    n = config.context_parallel.ring_size
    mesh = train.make_mesh(1, n)
    sharded = train.shard_batch(batch, mesh, config)
    params, static = eqx.partition(model, eqx.is_array)
    params = train.replicate(params, mesh)
    logits_fn, grad_fn = train.make_logits_fn(config, mesh), train.make_grad_fn(config, mesh)
    schedule = train.batch_ring_schedule(config, mesh, sharded)  # the ring's per-device rows, a jit argument
    logits, (grads, metrics) = jax.jit(
        lambda p, b, sc: (logits_fn(eqx.combine(p, static), b), grad_fn(p, static, b, None, sc)))(params, sharded, schedule)
    logits = np.asarray(logits)
    if config.context_parallel.strategy == "ring":
        logits = layouts.unpermute(logits, config.context_parallel.layout, n, axis=1)
    return logits, jax.device_get(grads), float(metrics["loss"])


@pytest.mark.slow
def test_model_strategies_agree():
    """Splash and the ring under both layouts against the reference model, one reference run for all
    three (one test rather than a shared fixture, so that a parallel run cannot repeat the reference on
    two workers). Zigzag at S = 1024 on 4 devices (half-shards of whole blocks) is covered by
    tests/test_ring.py's N=4, S=1024 zigzag case; here the half-shards are 64 tokens."""
    seq = 512
    # two layers (the default), not one: at num_layers=1 the ring's gradient program trips an XLA:CPU collective
    # race (jax 0.10.2, seen while compiling with XLA:CPU's legacy emitters; a collective-permute rendezvous
    # joined by 5 of 4 devices): about half the runs aborted, one returned a wrong loss. Two layers: no failure in 144
    ref_config = _config(max_seq_len=seq, context_parallel=ContextParallel("reference"))  # the dense oracle
    model = Transformer(ref_config, key=jax.random.key(0))
    batch = _batch(seq)
    ref_logits, ref_grads, ref_loss = _run(ref_config, model, batch)
    assert np.isfinite(ref_logits).all() and np.isfinite(ref_loss)
    ring = ref_config.replace(context_parallel=ref_config.context_parallel.replace(strategy="ring", ring_axis="context", ring_size=4))
    for config in (ref_config.replace(context_parallel=ref_config.context_parallel.replace(strategy="splash")), ring.replace(context_parallel=ring.context_parallel.replace(layout="zigzag")),
                   ring.replace(context_parallel=ring.context_parallel.replace(layout="striped"))):
        logits, grads, loss = _run(config, _with_config(model, config), batch)
        name = f"{config.context_parallel.strategy} {config.context_parallel.layout}"
        np.testing.assert_allclose(logits, ref_logits, rtol=RTOL, atol=ATOL, err_msg=name)
        np.testing.assert_allclose(loss, ref_loss, rtol=LOSS_RTOL, err_msg=name)
        for x, y in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=GRAD_RTOL, atol=GRAD_ATOL, err_msg=name)


def _with_config(model, config):
    """The same parameters under another (compatible) config."""
    return model.with_config(config)


def test_model_shapes_and_options(key):
    config = _config(max_seq_len=256, num_kv_heads=1, remat="full", features=ModelFeatures(tie_embeddings=True))
    model = Transformer(config, key=key)
    tokens = jnp.arange(256) % config.vocab_size
    logits = model(tokens, jnp.arange(256))
    assert logits.shape == (256, config.vocab_size) and logits.dtype == jnp.float32
    assert model.layers.attention.wq.shape == (2, 32, 32)  # stacked [layers, ...]
    assert model.layers.attention.sinks.shape == (2, 4)


@pytest.mark.slow
def test_model_remat_recomputes_without_changing_value_or_gradients(key):
    config = _config(max_seq_len=128, remat="full")
    remat = Transformer(config, key=key)
    plain = _with_config(remat, config.replace(remat="none"))
    tokens = jax.random.randint(key, (128,), 0, config.vocab_size)
    d_logits = jax.random.normal(jax.random.fold_in(key, 1), (128, config.vocab_size))

    def loss(params, static):
        return jnp.sum(eqx.combine(params, static)(tokens, jnp.arange(128)) * d_logits)

    def value_and_grads(model):
        params, static = eqx.partition(model, eqx.is_array)
        f = jax.value_and_grad(loss)
        # XLA:CPU's default emitters (tests/conftest.py compiles single-device programs with its
        # classic ones, which fuse the two programs differently: ~2e-6 apart)
        jitted = jax.jit(f, static_argnums=1, compiler_options={"xla_cpu_use_fusion_emitters": True})
        return jitted(params, static), str(jax.make_jaxpr(f, static_argnums=1)(params, static))

    (v_remat, g_remat), jaxpr_remat = value_and_grads(remat)
    (v_plain, g_plain), jaxpr_plain = value_and_grads(plain)
    # remat is really applied (a checkpoint in the differentiated program), and only when asked
    assert "remat" in jaxpr_remat and "remat" not in jaxpr_plain
    # the recomputation is the same float32 work: value and gradients measured bit-identical on CPU
    # (XLA's default emitters)
    np.testing.assert_array_equal(np.asarray(v_remat), np.asarray(v_plain))
    for x, y in zip(jax.tree.leaves(g_remat), jax.tree.leaves(g_plain), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
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


@pytest.mark.slow
def test_model_dropout_only_with_key(key):
    config = _config(max_seq_len=128, context_parallel=ContextParallel("reference"), attention_dropout=0.3)
    model = Transformer(config, key=key)
    plain = _with_config(model, config.replace(attention_dropout=0.0))
    tokens, positions = jnp.arange(128) % config.vocab_size, jnp.arange(128)
    call = jax.jit(lambda m, k: m(tokens, positions, key=k))
    k1, k2 = jax.random.split(jax.random.fold_in(key, 1))
    no_key = np.asarray(jax.jit(lambda m: m(tokens, positions))(model))
    # without a key (evaluation) a dropout model is the rate-0 model, bit for bit
    np.testing.assert_array_equal(no_key, np.asarray(jax.jit(lambda m: m(tokens, positions))(plain)))
    # rate 0 ignores a key; rate 0.3 with a key drops, the same key the same way, another key differently
    np.testing.assert_array_equal(np.asarray(call(plain, k1)), no_key)
    dropped = np.asarray(call(model, k1))
    np.testing.assert_array_equal(np.asarray(call(model, k1)), dropped)
    assert np.abs(dropped - no_key).max() > 1e-2 and np.abs(np.asarray(call(model, k2)) - dropped).max() > 1e-2


@pytest.mark.slow
def test_model_bfloat16(key):
    config = _config(max_seq_len=128, param_dtype="bfloat16", compute_dtype="bfloat16")
    model = Transformer(config, key=key)
    assert model.embedding.dtype == jnp.bfloat16
    logits = model(jnp.arange(128) % 48, jnp.arange(128))
    assert logits.dtype == jnp.float32 and np.isfinite(np.asarray(logits)).all()


def test_model_input_errors_name_the_argument(key):
    from ringsplash.model.transformer import _check_example

    config = _config(max_seq_len=256, context_parallel=ContextParallel("splash"))
    model = Transformer(config, key=key)
    tokens, positions = jnp.arange(256) % 48, jnp.arange(256)
    with pytest.raises(ValueError, match=r"tokens must be \[seq\].*batch with jax.vmap.*\(1, 256\)"):
        _check_example(tokens[None], positions[None], None, 48)  # the library's own check (no jaxtyping hook)
    with pytest.raises(ValueError, match=r"positions must have the shape of tokens \(256,\).*\(255,\)"):
        _check_example(tokens, positions[:255], None, 48)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, vocab_size=48\), got ids in \[0, 48\]"):
        model(tokens.at[3].set(48), positions)
    # concrete ids closed over by a jitted function are read on the host, not traced (was a ConcretizationTypeError)
    with pytest.raises(ValueError, match=r"got ids in \[-1, 47\]"):
        bad = tokens.at[0].set(-1)
        jax.jit(lambda m: m(bad, positions))(model)
    assert jax.jit(lambda m: m(tokens, positions))(model).shape == (256, 48)
    with pytest.raises(TypeError, match=r"segment_ids must be integers"):
        _check_example(tokens, positions, jnp.zeros(256), 48)
    # through the model, under the suite's jaxtyping hook the annotation may fire first: either names tokens
    with pytest.raises((ValueError, TypeError), match=r"tokens"):
        model(tokens[None], positions[None])


def test_model_length_beyond_max_seq_len_names_both(key):
    from ringsplash.model.transformer import _check_example

    config = _config(max_seq_len=128, context_parallel=ContextParallel("reference"), num_layers=1)
    model = Transformer(config, key=key)
    tokens, positions = jnp.arange(192) % 48, jnp.arange(192)
    # was accepted: the reference builds its mask at any length, past the length the config was checked for
    with pytest.raises(ValueError, match=r"tokens has 192 positions, more than the config's max_seq_len=128"):
        model(tokens, positions)
    assert model(tokens[:128], positions[:128]).shape == (128, 48)  # max_seq_len itself, and shorter, run
    # under a sequence-parallel strategy the model sees one local shard: the global length is what counts
    with pytest.raises(ValueError, match=r"tokens has 96 positions per shard x 2 shards \(attention='ring'\) = 192, "
                                         r"more than the config's max_seq_len=128.*at most max_seq_len / 2 = 64"):
        _check_example(tokens[:96], positions[:96], None, 48, 128, 2, "ring")
    _check_example(tokens[:64], positions[:64], None, 48, 128, 2, "ring")
    # the padded length counts on one device too: a 600-token ring config's batches run at 768 on one chip (were
    # refused there, accepted over four)
    config = _config(max_seq_len=600, context_parallel=ContextParallel("ring", ring_size=1))
    tokens, positions = jnp.arange(769) % 48, jnp.arange(769)
    padded = config.padded_seq_len(600)
    assert padded == 768
    _check_example(tokens[:padded], positions[:padded], None, 48, 600, 1, "ring", padded)
    with pytest.raises(ValueError, match=r"tokens has 769 positions, more than the config's max_seq_len=600 "
                                         r"\(padded inside to 768\): pass at most 768 tokens"):
        _check_example(tokens, positions, None, 48, 600, 1, "ring", padded)


@pytest.mark.slow
def test_model_hands_attention_one_dtype_whatever_the_parameters(key):
    """q, k, v reach the strategy in the compute dtype even when the parameters mix dtypes (e.g.
    a checkpoint with some weights in float16): every attention entry point now refuses a q / k / v
    dtype mix, the reference included, so the model must never produce one."""
    config = _config(max_seq_len=128, context_parallel=ContextParallel("reference"), num_layers=1)
    model = Transformer(config, key=key)
    mixed = eqx.tree_at(lambda m: (m.layers.attention.wk, m.layers.attention.wv), model,
                        (model.layers.attention.wk.astype(jnp.bfloat16), model.layers.attention.wv.astype(jnp.float16)))
    logits = mixed(jnp.arange(128) % 48, jnp.arange(128))
    assert logits.dtype == jnp.float32 and np.isfinite(np.asarray(logits)).all()


def test_ring_model_outside_shard_map_says_how_to_call_it(key):
    config = _config(max_seq_len=512, context_parallel=ContextParallel("ring", ring_size=2))
    model = Transformer(config, key=key)
    with pytest.raises(ValueError, match=r"strategy='ring'.*inside jax.shard_map.*make_logits_fn"):
        model(jnp.arange(256) % 48, jnp.arange(256))  # was NameError: unbound axis name


@pytest.mark.slow
def test_splash_model_runs_at_a_length_the_blocks_do_not_tile(key):
    """600 tokens (not a multiple of the kernels' 128-token lanes): the model pads inside; logits,
    gradients and max logits equal the reference strategy's, with and without packed documents."""
    config = TransformerConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=2, max_seq_len=600, sinks=True,
                               context_parallel=ContextParallel("splash"))
    model = Transformer(config, key=key)
    reference = model.with_config(config.replace(context_parallel=config.context_parallel.replace(strategy="reference")))
    tokens = jax.random.randint(jax.random.fold_in(key, 1), (600,), 0, 64)
    positions = jnp.arange(600)
    segments = (jnp.arange(600) >= 250).astype(jnp.int32)
    for seg in (None, segments):
        loss = lambda m, seg=seg: jnp.sum(m(tokens, positions, seg) ** 2) / 600
        (got, g_got), (want, g_want) = (jax.jit(jax.value_and_grad(loss))(m) for m in (model, reference))
        # measured: loss 1.1e-7 relative, gradients <= 4.8e-7 absolute (float32 block order vs dense)
        np.testing.assert_allclose(got, want, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(eqx.filter(g_got, eqx.is_array)),
                        jax.tree.leaves(eqx.filter(g_want, eqx.is_array)), strict=True):
            np.testing.assert_allclose(a, b, atol=4e-6, rtol=0)
    _, got = model.hidden(tokens, positions, segments, return_max_logits=True)
    _, want = reference.hidden(tokens, positions, segments, return_max_logits=True)
    np.testing.assert_allclose(got, want, atol=1e-6)  # measured: equal (padded rows add no logit)
