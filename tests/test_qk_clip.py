"""QK-clip: the factor rule (MHA and the exact GQA split), one clipping train step on a batch
whose logits exceed τ (FSDP-sharded parameters; splash and ring strategies), max logits in
the metrics / plot, exact resumption with QK-clip on, and bad configs."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ringsplash import data, train
from ringsplash.model import ContextParallel, Transformer, TransformerConfig, apply_qk_clip, qk_clip_factors
from ringsplash.splash import SplashConfig

BLOCKS = SplashConfig(block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128, backend="xla")
TASK = data.RecallTask(seq_len=128, num_pairs=8, num_queries=8, num_keys=16, num_values=8, num_filler=8)


def test_qk_clip_factors_scale_each_head_by_exactly_its_clip():
    rng = np.random.default_rng(0)
    m = jnp.asarray(rng.uniform(1.0, 10.0, (3, 8)), jnp.float32).at[1, 2].set(-jnp.inf)  # a head attending nothing
    tau = 5.0
    gamma = np.where(np.asarray(m) > tau, tau / np.asarray(m), 1.0)
    for group in (1, 2, 4, 8):
        f = qk_clip_factors(m, tau, group)
        per_head = np.asarray(f.q) * np.repeat(np.asarray(f.k), group, axis=-1)
        np.testing.assert_allclose(per_head, gamma, rtol=3e-7)  # measured 1.2e-7 (one rounding each)
        untouched = np.all(gamma.reshape(3, -1, group) == 1.0, axis=-1)  # groups with no head above tau
        assert np.all(np.asarray(f.k)[untouched] == 1.0)
        assert np.all(np.asarray(f.q).reshape(3, -1, group)[untouched] == 1.0)
    mha = qk_clip_factors(m, tau, 1)
    np.testing.assert_allclose(np.asarray(mha.q), np.sqrt(gamma), rtol=3e-7)  # sqrt(tau / max) each
    np.testing.assert_array_equal(np.asarray(mha.k), np.sqrt(gamma).astype(np.float32))


def _model_and_batch(attention, heads, kv_heads, ring_size=1):
    config = TransformerConfig(
        vocab_size=TASK.vocab_size, d_model=32, num_layers=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=16,
        max_seq_len=TASK.seq_len, splash=BLOCKS, context_parallel=ContextParallel(attention, ring_size=ring_size),
    )
    model = Transformer(config, key=jax.random.key(1))
    # head 0 gets large logits (its W_q x 4): it alone exceeds the threshold chosen below
    wq = model.layers.attention.wq
    model = eqx.tree_at(lambda m: m.layers.attention.wq, model, wq.at[..., :config.head_dim].multiply(4.0))
    return config, model, TASK.batch(np.random.default_rng(2), 4)


@eqx.filter_jit
def _batch_max_logits(m, tokens, positions, segment_ids):
    _, mx = jax.vmap(lambda t, p, s: m.hidden(t, p, s, return_max_logits=True))(tokens, positions, segment_ids)
    return jnp.max(mx, axis=0)


def _max_logits(model, config, batch):
    """Per-layer per-head max logits of the whole batch, computed on one device with splash."""
    m = model.with_config(config.replace(context_parallel=config.context_parallel.replace(strategy="splash", ring_axis=None, ring_size=1), qk_clip_threshold=None))
    return np.asarray(_batch_max_logits(m, batch.tokens, batch.positions, batch.segment_ids))


@pytest.mark.slow
@pytest.mark.parametrize("attention, heads, kv_heads, data_parallel, context_parallel",
                         [("splash", 4, 2, 2, 1), ("ring", 2, 2, 1, 2)], ids=["splash_gqa_fsdp", "ring_mha"])
def test_qk_clip_step_brings_every_head_to_the_threshold(attention, heads, kv_heads, data_parallel,
                                                         context_parallel):
    config, model, batch = _model_and_batch(attention, heads, kv_heads, ring_size=context_parallel)
    before = _max_logits(model, config, batch)
    tau = float(1.05 * before[0, 1:].max())
    assert before[0, 0] > 1.5 * tau and np.all(before[0, 1:] < tau)  # head 0 alone is above tau
    config = config.replace(qk_clip_threshold=tau)
    # learning rate 0: the step's change to the parameters is the clip alone
    tc = train.TrainConfig(steps=2, batch_size=4, learning_rate=0.0, warmup_steps=0, data_parallel=data_parallel,
                           context_parallel=context_parallel, progress=False)
    mesh = train.make_mesh(data_parallel, context_parallel)
    optimizer = train.make_optimizer(tc)
    plan = train.sharding_plan(config, mesh, fsdp=True)
    assert data_parallel == 1 or plan.sharded
    model = model.with_config(config)
    state_model, opt_state = train.place_state(model, optimizer.init(eqx.filter(model, eqx.is_array)), mesh, plan,
                                               optimizer)
    step = train.make_train_step(config, optimizer, mesh, plan=plan)
    new, _, metrics = step(state_model, opt_state, train.shard_batch(batch, mesh, config), jax.random.key(0))
    np.testing.assert_allclose(np.asarray(metrics["max_logits"]), before, rtol=1e-6)  # measured 0 (same kernels)
    assert int(metrics["qk_clipped_heads"]) == 1

    after = _max_logits(new, config, batch)
    print("max logits before", before, "after", after, "tau", tau)
    assert after[0, 0] <= tau * (1 + 1e-5)
    np.testing.assert_allclose(after[0, 0], tau, rtol=1e-5)  # clipped exactly onto tau; measured 1.2e-7
    np.testing.assert_allclose(after[0, 1:], before[0, 1:], rtol=1e-5)  # the others keep theirs; measured 2.4e-7
    hd, group = config.head_dim, heads // kv_heads
    old_attn, new_attn = model.layers.attention, new.layers.attention
    # heads of groups without a clipped head: W_q / W_k columns bit-identical
    np.testing.assert_array_equal(np.asarray(new_attn.wq)[..., group * hd:], np.asarray(old_attn.wq)[..., group * hd:])
    np.testing.assert_array_equal(np.asarray(new_attn.wk)[..., hd:], np.asarray(old_attn.wk)[..., hd:])
    assert not np.array_equal(np.asarray(new_attn.wk)[..., :hd], np.asarray(old_attn.wk)[..., :hd])
    # every other parameter bit-identical
    rest = lambda m: jax.tree.leaves(eqx.filter(eqx.tree_at(lambda t: (t.layers.attention.wq, t.layers.attention.wk),
                                                            m, (None, None)), eqx.is_array))
    for x, y in zip(rest(model), rest(new), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
def test_fit_with_qk_clip_logs_max_logits_and_resumes_exactly(tmp_path):
    task = TASK
    config = TransformerConfig(vocab_size=task.vocab_size, d_model=32, num_layers=2, num_heads=2,
                               max_seq_len=task.seq_len, splash=BLOCKS, context_parallel=ContextParallel("splash"), qk_clip_threshold=0.3)
    tc = train.TrainConfig(steps=2, batch_size=2, learning_rate=3e-3, warmup_steps=1, log_every=1, progress=False,
                           checkpoint_every=1)
    stream = data.DataStream(make=lambda rng, n, step: task.batch(rng, n), batch_size=2, seed=3)
    full = train.fit(config, tc, stream, str(tmp_path / "full"))
    train.fit(config, tc, stream, str(tmp_path / "resumed"), stop_after=1)
    resumed = train.fit(config, tc, stream, str(tmp_path / "resumed"))
    assert train.state_digest(full) == train.state_digest(resumed)
    records = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert {"max_logit/layer0", "max_logit/layer1"} <= r.keys()
        above = sum(r[f"max_logit/layer{i}"] > 0.3 for i in range(2))
        assert r["qk_clipped_heads"] >= above >= 1  # the threshold is low enough to clip every step
    assert train.MetricsLog(str(tmp_path / "full")).plot().endswith(".png")


@pytest.mark.parametrize("value, error", [(0.0, ValueError), (-1.0, ValueError), (float("nan"), ValueError),
                                          ("1", TypeError)])
def test_qk_clip_threshold_must_be_positive(value, error):
    with pytest.raises(error, match="qk_clip_threshold"):
        TransformerConfig(vocab_size=16, qk_clip_threshold=value)


def test_apply_qk_clip_rejects_max_logits_of_the_wrong_shape():
    model = Transformer(TransformerConfig(vocab_size=16, d_model=32, num_layers=2, num_heads=2), key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"max_logits must be \[num_layers, num_heads\]=\(2, 2\), got shape \(3, 2\)"):
        apply_qk_clip(model, jnp.ones((3, 2)), 1.0)
