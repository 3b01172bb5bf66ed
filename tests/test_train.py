"""Trainer: loss goes down, checkpoints round-trip bit-exactly, a resumed run equals an
uninterrupted one, metrics and plot are written, batches are laid out once for the ring."""

import dataclasses
import json
import os

import equinox as eqx
import jax
import numpy as np
import pytest

from ringsplash import data, layouts, train
from ringsplash.model import ContextParallel, Transformer, TransformerConfig
from ringsplash.train import loop
from support.training import BLOCKS, TASK
from support.training import setup as _setup


@pytest.mark.slow
def test_train_reduces_loss(tmp_path):
    config, tc, stream = _setup(steps=30)
    train.fit(config, tc, stream, str(tmp_path))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records]
    assert losses[-1] < losses[0] - 0.5, losses
    assert all("tokens_per_s" in r for r in records[1:])
    assert os.path.exists(train.MetricsLog(str(tmp_path)).plot())


@pytest.mark.slow
def test_train_ring_on_data_by_context_mesh_reduces_loss(tmp_path):
    config, tc, stream = _setup(seq=512, steps=6, context_parallel=ContextParallel("ring", ring_size=2))
    tc = tc.__class__(**{**tc.__dict__, "data_parallel": 2, "learning_rate": 1e-2})
    state = train.fit(config, tc, stream, str(tmp_path))
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert int(state.step) == 6 and losses[-1] < losses[0], losses


def test_layout_batch_permutes_every_field_once():
    config = TransformerConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=2, max_seq_len=1024, splash=BLOCKS,
                               context_parallel=ContextParallel("ring", ring_size=4))
    task = data.RecallTask(seq_len=1024)
    batch = task.batch(np.random.default_rng(0), 2)
    laid = train.layout_batch(batch, config)
    for original, permuted in zip(batch, laid):
        np.testing.assert_array_equal(layouts.unpermute(permuted, "zigzag", 4, axis=1), original)
    np.testing.assert_array_equal(laid.positions[0], layouts.permutation("zigzag", 1024, 4))


@pytest.mark.slow
def test_checkpoint_round_trip_is_bit_exact(tmp_path):
    config, tc, stream = _setup(steps=3)
    state = train.fit(config, tc, stream, str(tmp_path / "a"))
    path = str(tmp_path / "ckpt.eqx")
    train.save_checkpoint(path, state)
    restored = train.load_checkpoint(path, train.init_state(config, tc, stream.seed))
    assert int(restored.step) == 3
    leaves = lambda t: jax.tree.leaves(eqx.filter(t, eqx.is_array))
    for x, y in zip(leaves(state), leaves(restored), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_runs_that_differ_in_schedule_share_the_initialisation_program():
    """A fresh state does not depend on the schedule or AdamW's hyper-parameters, so runs that differ
    only there share one jitted initialisation; what it returns is each run's own optimiser's init."""
    config, tc, _ = _setup(steps=3)
    other = dataclasses.replace(tc, steps=9, learning_rate=0.5, warmup_steps=4, b1=0.5, weight_decay=0.3)
    mesh = train.make_mesh(1, 1)
    plan = train.sharding_plan(config, mesh, tc.fsdp)
    assert train.sharded_init_fn(config, tc, mesh, plan) is train.sharded_init_fn(config, other, mesh, plan)
    clipped_off = dataclasses.replace(tc, grad_clip=None)
    assert train.sharded_init_fn(config, clipped_off, mesh, plan) is not train.sharded_init_fn(config, tc, mesh, plan)
    for run in (other, clipped_off):
        state = train.init_state(config, run)
        own = train.make_optimizer(run).init(eqx.filter(state.model, eqx.is_array))
        assert jax.tree.structure(state.opt_state) == jax.tree.structure(own)
        for x, y in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(own), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
def test_resumed_run_equals_uninterrupted_and_drops_metrics_past_its_checkpoint(tmp_path):
    """One interrupted-and-resumed run feeds both checks (one test rather than a fixture shared
    by two, so that a parallel run cannot repeat the runs on two workers): the resumed run ends
    bit for bit where the uninterrupted one ends, and metrics logged past the last checkpoint
    are dropped when it resumes."""
    config, tc, stream = _setup(steps=8)
    tc = tc.__class__(**{**tc.__dict__, "log_every": 1, "checkpoint_every": 2})
    loop._train_step.cache_clear()
    full = train.fit(config, tc, stream, str(tmp_path / "full"))
    train.fit(config, tc, stream, str(tmp_path / "resumed"), stop_after=3)  # "interrupted" after 3 steps
    log = train.MetricsLog(str(tmp_path / "resumed"))
    # an interruption after step 4 was logged but before its checkpoint: the last one is step 3
    log.write({"split": "train", "step": 4, "loss": -1.0})
    # picks up the checkpoint (a bookkeeping field may change)
    resumed = train.fit(config, dataclasses.replace(tc, progress=True), stream, str(tmp_path / "resumed"))
    # the three fits built one train step (the later two reused the first one's compiled program)
    assert (loop._train_step.cache_info().misses, loop._train_step.cache_info().hits) == (1, 2)
    assert int(resumed.step) == int(full.step) == 8
    for x, y in zip(jax.tree.leaves(eqx.filter(full, eqx.is_array)), jax.tree.leaves(eqx.filter(resumed, eqx.is_array)),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    steps = [r["step"] for r in log.read()]
    assert steps == [1, 2, 3, 4, 5, 6, 7, 8] and all(r["loss"] > 0 for r in log.read())


def test_pack_documents_segments_and_labels():
    docs = [np.arange(1, 6), np.arange(10, 13), np.arange(20, 30)]
    b = data.pack_documents(docs, seq_len=8, num_rows=3)
    np.testing.assert_array_equal(b.tokens[0], [1, 2, 3, 4, 5, 10, 11, 12])
    np.testing.assert_array_equal(b.segment_ids[0], [1, 1, 1, 1, 1, 2, 2, 2])
    np.testing.assert_array_equal(b.positions[0], [0, 1, 2, 3, 4, 0, 1, 2])
    np.testing.assert_array_equal(b.loss_mask[0], [1, 1, 1, 1, 0, 1, 1, 0])  # never across documents
    np.testing.assert_array_equal(b.labels[0][:4], [2, 3, 4, 5])
    np.testing.assert_array_equal(b.tokens[1], np.arange(20, 28))
    np.testing.assert_array_equal(b.tokens[2][:2], [28, 29])
    assert b.segment_ids[2][2:].tolist() == [0] * 6 and b.loss_mask[2][2:].sum() == 0


def test_recall_batch_answers_are_in_context():
    task = data.RecallTask(seq_len=1024, num_pairs=32, num_queries=32)
    b = task.batch(np.random.default_rng(1), 3)
    for row in range(3):
        scored = np.flatnonzero(b.loss_mask[row])
        assert len(scored) == 32
        for i in scored:
            key, value = b.tokens[row, i], b.labels[row, i]
            where = np.flatnonzero(b.tokens[row, : task.context_len] == key)
            assert len(where) == 1 and b.tokens[row, where[0] + 1] == value
    packed = task.batch(np.random.default_rng(1), 2, episode_len=128)
    assert packed.tokens.shape == (2, 1024) and packed.segment_ids[0].max() == 7
    assert packed.positions[0, 128] == 0



def test_data_stream_is_a_function_of_seed_and_step():
    task = data.RecallTask(seq_len=128, num_pairs=8, num_queries=8, num_keys=16, num_values=8, num_filler=8)
    stream = data.DataStream(lambda r, n, s: task.batch(r, n), 2, seed=5)
    # what a resumed run relies on: batch(step) is the draw of a generator seeded by (seed, step)
    want = task.batch(np.random.default_rng([5, 7]), 2)
    for got, expected in zip(stream.batch(7), want, strict=True):
        np.testing.assert_array_equal(got, expected)
    assert not np.array_equal(stream.batch(8).tokens, want.tokens)
    assert not np.array_equal(data.DataStream(stream.make, 2, seed=6).batch(7).tokens, want.tokens)


def _recording_make(task, drawn):
    """A ``make`` that records the seed of every generator it draws from: ``(seed, step, row)``
    for a ``per_row`` stream."""
    def make(rng, n, step):
        drawn.append(tuple(int(e) for e in rng.bit_generator.seed_seq.entropy))
        return task.batch(rng, n)
    return make


def test_data_stream_draws_only_the_rows_asked_for():
    drawn = []
    stream = data.DataStream(_recording_make(TASK, drawn), 4, seed=5, per_row=True)
    full = stream.batch(7)
    assert drawn == [(5, 7, 0), (5, 7, 1), (5, 7, 2), (5, 7, 3)]
    drawn.clear()
    part = stream.batch(7, rows=[3, 1])
    assert drawn == [(5, 7, 3), (5, 7, 1)]  # the other rows are never drawn
    for got, want in zip(part, full, strict=True):
        np.testing.assert_array_equal(got, want[[3, 1]])
    assert not np.array_equal(full.tokens[0], full.tokens[1])  # rows are independent draws
    # a batch-seeded stream draws the whole batch, then selects
    whole = data.DataStream(stream.make, 4, seed=5)
    np.testing.assert_array_equal(whole.batch(7, rows=[2]).labels, whole.batch(7).labels[[2]])
    with pytest.raises(ValueError, match=r"rows must be in \[0, batch_size=4\), got \[4, -1\]"):
        stream.batch(7, rows=[0, 4, -1])


def test_stream_batch_equals_shard_batch_of_the_whole_batch():
    """One process: ``stream_batch`` (the process-local path) places exactly what
    ``shard_batch`` places from the whole batch, in the same shardings."""
    config, _, _ = _setup(seq=512, context_parallel=ContextParallel("ring", ring_size=4))
    stream = data.DataStream(lambda rng, n, step: TASK.__class__(**{**TASK.__dict__, "seq_len": 512}).batch(rng, n),
                             4, seed=2, per_row=True)
    mesh = train.make_mesh(2, 4)
    np.testing.assert_array_equal(train.process_rows(mesh, 4), [0, 1, 2, 3])
    got, want = train.stream_batch(stream, 3, mesh, config), train.shard_batch(stream.batch(3), mesh, config)
    for g, w in zip(got, want, strict=True):
        assert g.sharding == w.sharding and g.shape == w.shape == (4, 512)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_make_mesh_rejects_a_process_count_that_does_not_divide_it(monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match=r"mesh data=1 x context=3 = 3 devices cannot be split evenly over 2 "
                                         r"processes"):
        train.make_mesh(1, 3)


@pytest.mark.slow
def test_resume_with_a_different_config_names_the_fields(tmp_path):
    config, tc, stream = _setup(steps=4)
    train.fit(config, tc, stream, str(tmp_path), stop_after=2)
    changed = tc.__class__(**{**tc.__dict__, "learning_rate": 1e-3, "progress": True, "checkpoint_every": 1})
    with pytest.raises(ValueError, match=r"config.json.*different config.*train\.learning_rate: 0\.003 vs 0\.001$"):
        train.fit(config, changed, stream, str(tmp_path))
    with pytest.raises(ValueError, match=r"model\.d_model: 32 vs 64; train\.learning_rate"):
        train.fit(config.replace(d_model=64), changed, stream, str(tmp_path))
    # bookkeeping may change, and resume=False starts afresh under any config
    state = train.fit(config, tc.__class__(**{**tc.__dict__, "progress": True, "log_every": 1}), stream, str(tmp_path))
    assert int(state.step) == 4
    assert int(train.fit(config, changed, stream, str(tmp_path), resume=False).step) == 4


@pytest.mark.slow
def test_a_non_finite_loss_stops_training_naming_the_step(tmp_path):
    """A run whose loss becomes NaN/Inf (here: a learning rate that overflows the weights) stops
    with the step instead of training on and reporting accuracy 0, and writes no checkpoint."""
    config, tc, stream = _setup(steps=8)
    tc = tc.__class__(**{**tc.__dict__, "learning_rate": 1e30, "warmup_steps": 0, "checkpoint_every": 4})
    with pytest.raises(FloatingPointError, match=r"NaN/Inf at step (\d+); no checkpoint was written"):
        train.fit(config, tc, stream, str(tmp_path))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records and all(np.isfinite(r["loss"]) for r in records)  # nothing non-finite was logged
    assert not os.path.isdir(tmp_path / "checkpoints") or not os.listdir(tmp_path / "checkpoints")


@pytest.mark.slow
def test_fit_starts_from_given_parameters(tmp_path):
    """``fit(init_model=...)`` trains those parameters, wherever they are: with a zero learning rate
    AdamW leaves them unchanged bit for bit, and the optimiser state is fresh (one step counted)."""
    config, tc, stream = _setup(steps=2)
    tc = tc.__class__(**{**tc.__dict__, "steps": 1, "learning_rate": 0.0, "warmup_steps": 0, "data_parallel": 2})
    # committed to a device outside the run's mesh (as a model trained in another run is)
    start = jax.device_put(Transformer(config, key=jax.random.key(42)), jax.devices()[7])
    state = train.fit(config, tc, stream, str(tmp_path), init_model=start)
    for got, want in zip(jax.tree.leaves(eqx.filter(state.model, eqx.is_array)),
                         jax.tree.leaves(eqx.filter(start, eqx.is_array)), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    fresh = train.init_state(config, tc)
    assert not np.array_equal(np.asarray(state.model.embedding), np.asarray(fresh.model.embedding))
    with pytest.raises(ValueError, match=r"init_model's parameters do not have the shapes.*2 layers, d_model 32"):
        train.fit(config.replace(d_model=64), tc, stream, str(tmp_path / "other"), init_model=start)
