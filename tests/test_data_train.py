"""The ``Loader`` as ``fit``'s data source: exact resumption (its Grain state in the checkpoint),
per-document losses under packing (splash and the ring), and the checks a loader must pass."""

import dataclasses
import json
import os

import equinox as eqx
import jax
import numpy as np
import optax
import pytest

from ringsplash import data, layouts, train
from ringsplash.model import ContextParallel, Transformer, TransformerConfig
from ringsplash.splash import SplashConfig
from support.corpus import make_corpus

S = 128
BLOCKS = SplashConfig(block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128, backend="xla")


def _config(**kw):
    return TransformerConfig(**{**dict(vocab_size=256, d_model=32, num_layers=2, num_heads=2, max_seq_len=S,
                                       splash=BLOCKS), **kw})


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(str(tmp_path_factory.mktemp("corpus") / "c"), np.random.default_rng(), n=60, hi=90)


@pytest.mark.slow
def test_killed_and_resumed_run_ends_bit_for_bit_where_an_uninterrupted_one_ends(corpus, tmp_path):
    config = _config()
    tc = train.TrainConfig(steps=6, batch_size=4, learning_rate=3e-3, warmup_steps=2, log_every=1,
                           checkpoint_every=2, progress=False)
    loader = data.Loader(corpus.path, data.LoaderConfig(seq_len=S, batch_size=4, seed=7, packing="first_fit"))
    full = train.fit(config, tc, loader, str(tmp_path / "full"))
    train.fit(config, tc, loader, str(tmp_path / "resumed"), stop_after=3)  # killed after step 3 (checkpoint: 2)
    ckpt = str(tmp_path / "resumed" / "checkpoints")
    # the Grain iterator's state went into each checkpoint: positioned at the batch of that step
    for step in (2, 3):
        with open(os.path.join(ckpt, str(step), "data", "process_0-of-1.json")) as f:
            state = json.load(f)
        assert state == {"next_index": step}
    os.rename(os.path.join(ckpt, "3"), str(tmp_path / "away"))  # resume from mid-epoch step 2
    resumed = train.fit(config, tc, loader, str(tmp_path / "resumed"))
    assert train.state_digest(resumed) == train.state_digest(full)
    losses = lambda run: [r["loss"] for r in train.MetricsLog(str(tmp_path / run)).read()]
    assert losses("resumed") == losses("full")  # the same batches, step by step
    # the data is part of the run's config: another packing cannot resume this run
    other = data.Loader(corpus.path, data.LoaderConfig(seq_len=S, batch_size=4, seed=7, packing="best_fit"))
    with pytest.raises(ValueError, match=r"data\.config\.packing: 'first_fit' vs 'best_fit'"):
        train.fit(config, dataclasses.replace(tc, steps=8), other, str(tmp_path / "resumed"))


def test_a_loader_that_does_not_fit_the_model_is_rejected_before_any_work(corpus, tmp_path):
    tc = train.TrainConfig(steps=2, batch_size=4, warmup_steps=1, progress=False)
    loader = data.Loader(corpus.path, data.LoaderConfig(seq_len=S, batch_size=4))
    with pytest.raises(ValueError, match=r"vocabulary of 256 tokens; the model's vocab_size=64 is smaller"):
        train.fit(_config(vocab_size=64), tc, loader, str(tmp_path))
    with pytest.raises(ValueError, match=r"the loader's seq_len=128 must equal the model's max_seq_len=256"):
        train.fit(_config(max_seq_len=256), tc, loader, str(tmp_path))
    with pytest.raises(ValueError, match=r"batch_size=4 must equal the train config's batch_size=8"):
        train.fit(_config(), dataclasses.replace(tc, batch_size=8), loader, str(tmp_path))
    assert not os.listdir(tmp_path)


def _doc_losses_fn(config, model):
    """Per-token cross-entropy of a batch (original order) through the trainer's mesh for ``config``
    (one compiled logits function: call it with batches of one shape)."""
    mesh = train.mesh_for(config)
    logits_fn = train.make_logits_fn(config, mesh)
    params, static = eqx.partition(model, eqx.is_array)
    model = eqx.combine(train.replicate(params, mesh), static)

    def losses(batch):
        logits = np.asarray(logits_fn(model, train.shard_batch(batch, mesh, config)))
        if config.context_shards > 1:
            logits = layouts.unpermute(logits, config.context_parallel.layout, config.layout_shards, axis=1)
        return np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, batch.labels))

    return losses


# measured (float32, CPU): max |packed - alone| of a document's mean loss: 0 under splash, 4.8e-7 under the
# ring (its online softmax sums the blocks in another order); ~10x headroom
DOC_ATOL = 5e-6


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["splash", "ring"])
def test_each_packed_documents_loss_is_its_loss_alone(corpus, attention):
    """Rows packed by the loader (best fit, no splitting): every document's loss in the packed row
    equals its loss run alone in a row of its own, under splash and under the ring on 4 devices."""
    cp = ContextParallel("ring", ring_size=4, layout="zigzag") if attention == "ring" else ContextParallel(attention)
    config = _config(context_parallel=cp)
    model = Transformer(config, key=jax.random.key(1))
    loader = data.Loader(corpus.path, data.LoaderConfig(seq_len=S, batch_size=2, seed=3, long_documents="error"))
    packed = loader.batch(0)
    losses = _doc_losses_fn(config, model)
    ce = losses(packed)
    alone_docs, where = [], []
    for r in range(2):
        for seg in range(1, packed.segment_ids[r].max() + 1):
            cols = np.flatnonzero(packed.segment_ids[r] == seg)
            alone_docs.append(packed.tokens[r, cols]), where.append((r, cols))
            assert packed.loss_mask[r, cols[-1]] == 0  # the document's last token predicts nothing
            np.testing.assert_array_equal(packed.labels[r, cols[:-1]], packed.tokens[r, cols[1:]])
    rows = [data.pack_documents([doc], S, 1) for doc in alone_docs]  # one document per row, padded
    rows += rows[-1:] * (len(rows) % 2)  # whole batches of 2 rows: the packed batch's shape, no new compile
    alone = data.Batch(*(np.concatenate(f) for f in zip(*rows, strict=True)))
    ce_alone = np.concatenate([losses(data.Batch(*(x[i : i + 2] for x in alone))) for i in range(0, len(rows), 2)])
    for i, (r, cols) in enumerate(where):
        n = len(cols)
        packed_loss = (ce[r, cols] * packed.loss_mask[r, cols]).sum() / max(packed.loss_mask[r, cols].sum(), 1)
        alone_loss = (ce_alone[i, :n] * alone.loss_mask[i, :n]).sum() / max(alone.loss_mask[i, :n].sum(), 1)
        assert abs(packed_loss - alone_loss) <= DOC_ATOL, (i, packed_loss, alone_loss)
    assert len(where) > 2  # the rows really pack several documents


def test_checkpoint_stores_and_restores_the_loader_iterator(corpus, tmp_path):
    """``checkpoints.save_state(data_iterator=...)`` writes this process's Grain state next to the
    arrays; ``restore_data_iterator`` puts a fresh iterator back there (its next batch is the one
    the saved iterator would have read), and reports a checkpoint without one."""
    from ringsplash import checkpoints

    loader = data.Loader(corpus.path, data.LoaderConfig(seq_len=S, batch_size=4, seed=2))
    it = loader.iterator([0, 1, 2, 3])
    for _ in range(3):
        next(it)
    checkpoints.save_state(str(tmp_path), {"w": np.arange(3.0)}, step=3, data_iterator=it)
    checkpoints.save_state(str(tmp_path), {"w": np.arange(3.0)}, step=4)
    fresh = loader.iterator([0, 1, 2, 3])
    assert checkpoints.restore_data_iterator(str(tmp_path), 3, fresh)
    np.testing.assert_array_equal(next(fresh).tokens, loader.batch(3).tokens)
    assert not checkpoints.restore_data_iterator(str(tmp_path), 4, loader.iterator([0, 1, 2, 3]))


def test_fit_refuses_a_stream_token_id_beyond_the_models_vocabulary(tmp_path):
    """A ``DataStream`` id >= vocab_size would be clamped by the embedding and train silently: ``fit``
    refuses the batch on the host, naming the id, the vocabulary and the batch."""
    from support.training import setup

    config, tc, stream = setup(steps=2)
    make = stream.make

    def bad(rng, n, step):
        batch = make(rng, n, step)
        batch.tokens[0, 4] = config.vocab_size + 3
        return batch

    with pytest.raises(ValueError, match=rf"batch 0 of the data stream \(seed 3\), tokens: token id "
                                         rf"{config.vocab_size + 3} at index \(0, 4\) is outside the vocabulary "
                                         rf"\[0, vocab_size={config.vocab_size}\)"):
        train.fit(config, tc, dataclasses.replace(stream, make=bad), str(tmp_path))


@pytest.fixture(scope="module")
def loader_run(corpus, tmp_path_factory):
    """A loader run of 4 steps with checkpoints at 2 and 4 (each with its data-iterator state)."""
    root = tmp_path_factory.mktemp("loader_run")
    tc = train.TrainConfig(steps=4, batch_size=4, learning_rate=3e-3, warmup_steps=2, log_every=2,
                           checkpoint_every=2, progress=False)
    loader = data.Loader(corpus.path, data.LoaderConfig(seq_len=S, batch_size=4, seed=5))
    full = train.fit(_config(), tc, loader, str(root / "full"))
    return root, tc, train.state_digest(full)


@pytest.mark.slow  # resumes a tiny loader run (2 steps)
def test_a_damaged_data_iterator_state_falls_back_to_the_previous_checkpoint(corpus, loader_run, tmp_path):
    import shutil

    from ringsplash import checkpoints

    root, tc, want = loader_run
    run = tmp_path / "run"
    shutil.copytree(root / "full", run)
    ckpt = str(run / "checkpoints")
    with open(os.path.join(ckpt, "4", "data", "process_0-of-1.json"), "w") as f:
        f.write('{"next_index": 3}')
    assert "data-iterator state" in checkpoints.verify(ckpt, 4)
    loader = data.Loader(corpus.path, data.LoaderConfig(seq_len=S, batch_size=4, seed=5))
    with pytest.warns(RuntimeWarning, match=r"skipping checkpoint step 4: .*data-iterator state"):
        state = train.fit(_config(), tc, loader, str(run))
    assert int(state.step) == 4 and train.state_digest(state) == want
    assert checkpoints.all_steps(ckpt) == [2, 4] and all(checkpoints.verify(ckpt, s) is None for s in (2, 4))


@pytest.mark.slow  # trains 2 steps and resumes
def test_a_resumed_run_refuses_a_shard_edited_in_place(loader_run, tmp_path, monkeypatch):
    """An edit the sampled chunks miss (same size, same manifest) opens fine but is caught when the
    run resumes: the shard's mtime changed, so it is hashed whole against the manifest."""
    import ringsplash.data.corpus as corpus_module

    _, tc, _ = loader_run
    monkeypatch.setattr(corpus_module, "SAMPLE_CHUNKS", 4)  # chunks at 0, step, 2 step, 3 step
    monkeypatch.setattr(corpus_module, "SAMPLE_BYTES", 16)
    path, run = str(tmp_path / "c"), str(tmp_path / "run")
    c = make_corpus(path, np.random.default_rng(), n=60, hi=90)
    config = data.LoaderConfig(seq_len=S, batch_size=4, seed=5)
    train.fit(_config(), tc, data.Loader(path, config), run, stop_after=2)
    file = os.path.join(path, c.manifest["shards"][0]["tokens"])
    step = (os.path.getsize(file) - 16) // 3
    middle = (step + 16 + 2 * step) // 2 // 2 * 2  # between chunks 1 and 2: the low byte of a uint16 token
    with open(file, "r+b") as f:
        f.seek(middle)
        f.write(b"z" if f.read(1) != b"z" else b"y")
    loader = data.Loader(path, config)  # opens: the size and the samples agree
    with pytest.raises(data.CorpusChangedError, match=rf"{file} was changed after tokenization: its sha256"):
        train.fit(_config(), tc, loader, run)
