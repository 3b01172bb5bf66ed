"""Any sequence length under the context-parallel strategies: the trainer pads each batch to the
smallest length the strategy's layout and blocks tile (``TransformerConfig.padded_seq_len``,
``train.layout_batch``), the padding unscored and unseen, and ``train.unlayout`` gives the caller's
``S`` positions back; logits, loss, gradients and max logits equal the unpadded reference's.

S = 600 is refused by every strategy's layout or blocks as the TPU kernels tile them (backend
``"auto"``: the XLA path on this CPU, under the Pallas TPU tiling rule): 75-token zigzag half-shards
over 4 devices, a 600-token kv dimension no multiple of 128 divides, 150-token half-shards of USP's
2-device ring.
"""

import inspect
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ringsplash import data, train
from ringsplash.model import PAD_SEGMENT, ContextParallel, ModelFeatures, RopeScaling, Transformer, TransformerConfig
from ringsplash.splash import SplashConfig

S = 600
TPU_TILING = SplashConfig(block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128)  # backend "auto"
XLA = SplashConfig(block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128, backend="xla")
BASE = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=S, splash=TPU_TILING)
STRATEGIES = {
    "ring-zigzag-4": dict(context_parallel=ContextParallel("ring", ring_size=4, layout="zigzag")),
    "allgather-4": dict(context_parallel=ContextParallel("allgather", ring_size=4, layout="zigzag")),
    "ulysses-4": dict(context_parallel=ContextParallel("ulysses", ulysses_size=4)),
    "usp-2x2": dict(context_parallel=ContextParallel("usp", ring_size=2, ulysses_size=2)),
}
# measured (float32, CPU) over the four strategies: max |d logits| <= 1.5e-6; ~7x headroom
LOGITS_ATOL = 1e-5
# measured (the ring on the Pallas kernels, interpreted): |d loss| <= 4.8e-7, max |d grad| / max |grad| per leaf
# <= 5.3e-7, max |d max logit| <= 4.8e-7; ~10x headroom
LOSS_ATOL, GRAD_RTOL, MAX_LOGITS_ATOL = 5e-6, 5e-6, 5e-6
INTERPRET = SplashConfig(block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128, backend="interpret")


def _config(**kw) -> TransformerConfig:
    return TransformerConfig(**{**BASE, **kw})


def _batch(seq: int = S) -> data.Batch:
    """Two rows: two packed documents (user segment ids, positions restarting), then one document."""
    tokens = np.random.default_rng(0).integers(0, BASE["vocab_size"], (2, seq), dtype=np.int32)
    return data.pack_documents([tokens[0, : seq // 3], tokens[0, seq // 3:], tokens[1]], seq, 2)


# ------------------------------------------------------------------------------ lengths (host side)


PADDED = {  # id: (config changes, S, the length it runs at)
    "ring-zigzag": (STRATEGIES["ring-zigzag-4"], 600, 1024),  # half-shards of a multiple of 128 (parts of a shard)
    "ring-zigzag-tiled": (STRATEGIES["ring-zigzag-4"], 1024, 1024),  # a length that tiles runs as it is
    "ring-zigzag-xla": (dict(STRATEGIES["ring-zigzag-4"], splash=XLA), 600, 600),  # xla: a short whole part
    "ring-zigzag-xla-layout": (dict(STRATEGIES["ring-zigzag-4"], splash=XLA), 300, 304),  # ... once split
    "ring-zigzag-default-blocks": (dict(STRATEGIES["ring-zigzag-4"], splash=SplashConfig()), 1000, 1024),
    "ring-contiguous": (dict(STRATEGIES["ring-zigzag-4"],
                             context_parallel=ContextParallel("ring", ring_size=4, layout="contiguous")),
                        600, 1024),  # 150-token shards
    "allgather": (STRATEGIES["allgather-4"], 600, 1024),  # 160 .. 224 queries per device: no 128-multiple block
    "ulysses": (STRATEGIES["ulysses-4"], 600, 640),
    "usp": (STRATEGIES["usp-2x2"], 600, 1024),
    "splash": (dict(context_parallel=ContextParallel("splash")), 600, 600),  # pads inside the attention itself (model.attention)
    "reference": (dict(context_parallel=ContextParallel("reference")), 600, 600),
}


@pytest.mark.parametrize("changes, seq, padded", list(PADDED.values()), ids=list(PADDED))
def test_padded_seq_len_is_the_smallest_length_the_strategy_tiles(changes, seq, padded):
    config = _config(**{**changes, "max_seq_len": seq})  # accepted: refused before for the 600-token rows
    assert config.padded_seq_len(seq) == padded
    if config.context_parallel.roles:
        config.check_seq_len(padded)
        for shorter in range(seq, padded):
            with pytest.raises(ValueError):
                config.check_seq_len(shorter)


def test_layout_batch_pads_inertly_and_unlayout_undoes_it():
    config = _config(**STRATEGIES["ring-zigzag-4"])
    batch = _batch()
    padded = train.pad_batch(batch, config)
    assert padded.tokens.shape == (2, 1024)
    for got, want in zip(padded, batch):
        np.testing.assert_array_equal(got[:, :S], want)
    tail = slice(S, None)
    assert (padded.tokens[:, tail] == 0).all() and (padded.labels[:, tail] == 0).all()
    assert (padded.loss_mask[:, tail] == 0).all() and (padded.segment_ids[:, tail] == PAD_SEGMENT).all()
    np.testing.assert_array_equal(padded.positions[:, tail], batch.positions[:, -1:] + 1 + np.arange(1024 - S))
    laid = train.layout_batch(batch, config)
    assert laid.tokens.shape == (2, 1024) and not np.array_equal(laid.tokens, padded.tokens)  # permuted
    for got, want in zip(laid, batch):
        np.testing.assert_array_equal(train.unlayout(got, config, S), want)
    # a length that tiles: nothing added
    assert train.layout_batch(_batch(1024), config.replace(max_seq_len=1024)).tokens.shape == (2, 1024)


def test_padding_bad_input_names_the_argument():
    config = _config(**STRATEGIES["ring-zigzag-4"])
    batch = _batch()
    bad = batch._replace(segment_ids=np.where(batch.segment_ids == 2, PAD_SEGMENT, batch.segment_ids))
    with pytest.raises(ValueError, match=r"segment_ids must be > -2147483647 .*mark padding.*-2147483648"):
        train.layout_batch(bad, config)
    with pytest.raises(ValueError, match=r"the batch has seq_len=1024 tokens, more than the model's max_seq_len=600"):
        train.layout_batch(_batch(1024), config)
    with pytest.raises(ValueError, match=r"x has 600 positions on axis 1.*seq_len=600 tokens is laid out at 1024"):
        train.unlayout(np.zeros((2, S)), config, S)


# ------------------------------------------------------------------------------ the model on the mesh


@pytest.fixture(scope="module")
def reference():
    """(model, batch, the reference strategy's logits on it)."""
    model = Transformer(_config(context_parallel=ContextParallel("reference")), key=jax.random.key(0))  # the oracle
    batch = _batch()
    forward = eqx.filter_jit(lambda m, b: jax.vmap(m)(b.tokens, b.positions, b.segment_ids))
    return model, batch, np.asarray(forward(model, batch))


@pytest.mark.parametrize("strategy", list(STRATEGIES))  # 1.4-2.9 s each (+ 3.5 s for the module's reference)
@pytest.mark.slow
def test_logits_at_an_untileable_length_equal_the_reference(reference, strategy):
    model, batch, expected = reference
    config = _config(**STRATEGIES[strategy])
    mesh = train.mesh_for(config)
    logits = train.make_logits_fn(config, mesh)(model.with_config(config), train.shard_batch(batch, mesh, config))
    assert logits.shape[1] == config.padded_seq_len(S) > S
    np.testing.assert_allclose(train.unlayout(logits, config, S), expected, rtol=0, atol=LOGITS_ATOL)


@pytest.mark.slow
def test_dynamic_rope_reads_the_callers_length_not_the_padded_one(reference):
    """Dynamic NTK's frequencies follow the current length (600 tokens, past the original 256), not the
    1024 the ring runs at: the model caps it at max_seq_len, so padding never changes the frequencies."""
    model, batch, _ = reference
    dynamic = dict(features=ModelFeatures(rope_scaling=RopeScaling("dynamic", factor=2.0,
                                                                   original_max_position_embeddings=256)))
    want = model.with_config(_config(**dynamic))
    want = np.asarray(eqx.filter_jit(lambda m, b: jax.vmap(m)(b.tokens, b.positions, b.segment_ids))(want, batch))
    config = _config(**STRATEGIES["ring-zigzag-4"], **dynamic)
    mesh = train.mesh_for(config)
    logits = train.make_logits_fn(config, mesh)(model.with_config(config), train.shard_batch(batch, mesh, config))
    np.testing.assert_allclose(train.unlayout(logits, config, S), want, rtol=0, atol=LOGITS_ATOL)


def _loss_grads_and_eval(config: TransformerConfig, model: Transformer, batch: data.Batch):
    """(metrics with max logits, gradients, eval step sums) through the trainer's mesh for ``config``."""
    mesh = train.mesh_for(config)
    sharded = train.shard_batch(batch, mesh, config)
    params, static = eqx.partition(model.with_config(config), eqx.is_array)
    params = train.replicate(params, mesh)
    grad_fn = train.make_grad_fn(config, mesh, max_logits=True)
    schedule = train.batch_ring_schedule(config, mesh, sharded)
    grads, metrics = jax.jit(lambda p, b, sc: grad_fn(p, static, b, None, sc))(params, sharded, schedule)
    sums = train.make_eval_step(config, mesh)(eqx.combine(params, static), sharded)
    return jax.device_get(metrics), jax.device_get(grads), [float(x) for x in sums]


@pytest.mark.slow
def test_training_loss_and_grads_at_an_untileable_length_equal_the_reference(reference):
    """Ring (zigzag) at 600 tokens, padded to 1024, on the Pallas kernels (interpreted: padded query
    rows fully masked in the kernels themselves): the mean loss counts the real tokens only, and the
    gradients, accuracy and max logits (QK-clip's input) are the unpadded reference's; rows hold
    packed documents (user segment ids) and a single document."""
    model, batch, _ = reference
    batch = batch._replace(loss_mask=batch.loss_mask * (np.arange(S) % 5 != 0))  # a loss mask of the user's own
    want_metrics, want_grads, want_sums = _loss_grads_and_eval(_config(), model, batch)
    ring = _config(**STRATEGIES["ring-zigzag-4"], splash=INTERPRET)
    metrics, grads, sums = _loss_grads_and_eval(ring, model, batch)
    for name in ("loss", "accuracy"):
        np.testing.assert_allclose(metrics[name], want_metrics[name], rtol=0, atol=LOSS_ATOL)
    np.testing.assert_allclose(metrics["max_logits"], want_metrics["max_logits"], rtol=0, atol=MAX_LOGITS_ATOL)
    assert sums[1] == want_sums[1] == float(batch.loss_mask.sum())  # the eval step's weight: real tokens only
    np.testing.assert_allclose(sums, want_sums, rtol=1e-6)
    for (path, want), got in zip(jax.tree_util.tree_leaves_with_path(want_grads), jax.tree.leaves(grads)):
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err <= GRAD_RTOL, (jax.tree_util.keystr(path), err)


@pytest.mark.parametrize("strategy", ["splash", "reference", "ring"])
def test_check_seq_len_takes_a_positive_int_only_naming_the_length(strategy):
    """0, -5 and 512.0 passed check_seq_len under "splash" and "reference" (they are never split, so nothing
    else looked at the length); NumPy / JAX integers are lengths as ints are. Unwrapped: the library's own
    check, as a user without the test run's runtime type checking meets it."""
    cp = ContextParallel(strategy, ring_size=4) if strategy == "ring" else ContextParallel(strategy)
    check_seq_len, splash = inspect.unwrap(ContextParallel.check_seq_len), SplashConfig()
    for bad in (0, -5, 512.0, True, "512"):
        with pytest.raises(ValueError, match=rf"q_len must be a positive int, got q_len={re.escape(repr(bad))}"):
            check_seq_len(cp, bad, splash, name="q_len")
    check_seq_len(cp, np.int64(1024), splash)
    check_seq_len(cp, jnp.int32(1024), splash)
