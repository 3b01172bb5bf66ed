"""``fit`` as a driver of hooks over ``train_steps``: a hook sees every step and the final state, a
hook can stop training (with a final checkpoint a resumed run continues from, bit for bit), the
NaN stop names the step; and the ``BatchSource`` protocol both data sources implement."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest

from ringsplash import data, train
from ringsplash.model import Transformer, TransformerConfig
from ringsplash.splash import SplashConfig
from support.corpus import make_corpus
from support.training import TASK
from support.training import setup as _setup


class _Recorder(train.Hook):
    def __init__(self):
        self.steps, self.flags, self.losses, self.ends = [], [], {}, []

    def on_step(self, info):
        self.steps.append(info.step)
        self.flags.append((info.first, info.last))
        self.losses[info.step] = float(info.loss)

    def on_end(self, state):
        self.ends.append(int(state.step))


@pytest.mark.slow
def test_a_hook_sees_every_step_and_the_final_state(tmp_path):
    config, tc, stream = _setup(steps=5)
    tc = dataclasses.replace(tc, log_every=2)
    recorder, called = _Recorder(), []
    log = train.MetricsLog(str(tmp_path))
    evaluate = train.Evaluate(2, lambda state: {"at": int(state.step)}, log)
    state = train.fit(config, tc, stream, str(tmp_path), hooks=[recorder, lambda info: called.append(info.step),
                                                                   evaluate])
    assert recorder.steps == called == [1, 2, 3, 4, 5] and recorder.ends == [5] and int(state.step) == 5
    assert recorder.flags == [(True, False)] + [(False, False)] * 3 + [(False, True)]
    train_records = [r for r in log.read() if r["split"] == "train"]
    assert [r["step"] for r in train_records] == [1, 2, 4, 5]  # every 2nd, the first and the last
    for r in train_records:  # the hook saw the loss that was logged
        assert r["loss"] == recorder.losses[r["step"]]
    assert [(r["step"], r["at"]) for r in log.read() if r["split"] == "eval"] == [(2, 2), (4, 4), (5, 5)]


@pytest.mark.slow
def test_a_hook_can_stop_training_and_the_run_resumes_from_there(tmp_path):
    """A hook returning True ends the run after that step, with a final checkpoint of it; the
    resumed run ends bit for bit where an uninterrupted one ends. With a ``Loader`` the data
    iterator's state saved is that step's, although the next batch was already drawn."""
    corpus = make_corpus(str(tmp_path / "c"), np.random.default_rng(0), n=60, hi=90)
    blocks = SplashConfig(block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128, backend="xla")
    config = TransformerConfig(vocab_size=256, d_model=32, num_layers=1, num_heads=2, max_seq_len=128, splash=blocks)
    tc = train.TrainConfig(steps=5, batch_size=4, learning_rate=3e-3, warmup_steps=2, log_every=2,
                           checkpoint_every=4, progress=False)
    loader = data.Loader(corpus.path, data.LoaderConfig(seq_len=128, batch_size=4, seed=3))
    full = train.fit(config, tc, loader, str(tmp_path / "full"))
    stopped = train.fit(config, tc, loader, str(tmp_path / "cut"), hooks=[lambda info: info.step == 3])
    ckpt = tmp_path / "cut" / "checkpoints"
    assert int(stopped.step) == 3 and sorted(os.listdir(ckpt)) == ["3"]
    assert json.loads((ckpt / "3" / "data" / "process_0-of-1.json").read_text()) == {"next_index": 3}
    resumed = train.fit(config, tc, loader, str(tmp_path / "cut"))
    assert train.state_digest(resumed) == train.state_digest(full)


_TINY = Transformer(TransformerConfig(vocab_size=8, d_model=8, num_layers=1, num_heads=1, max_seq_len=128),
                    key=jax.random.key(0))


def _info(step, loss=1.0, grad_norm=1.0):
    """A ``StepInfo`` of a tiny model with the scalars ``StopIfNonfinite`` reads."""
    metrics = {"loss": jax.numpy.asarray(loss), "grad_norm": jax.numpy.asarray(grad_norm)}
    return train.StepInfo(step, metrics, _TINY, (), jax.numpy.asarray(0), first=step == 1, last=False)


def test_the_nonfinite_stop_names_the_first_bad_step_when_it_checks(tmp_path):
    hook = train.StopIfNonfinite(str(tmp_path / "checkpoints"), when=lambda info: info.step % 3 == 0)
    hook.on_step(_info(1, 2.0))
    hook.on_step(_info(2, float("nan")))  # not checked yet: no synchronisation per step
    with pytest.raises(FloatingPointError, match=r"training stopped: the loss or gradient norm is NaN/Inf at step 2; "
                                                 r"no checkpoint was written \(lower the learning rate"):
        hook.on_step(_info(3, 1.0, grad_norm=float("inf")))
    hook.on_step(_info(4, float("inf")))
    with pytest.raises(FloatingPointError, match="at step 4"):  # what is left is checked at the end
        hook.on_end(_info(4).state)


def test_plain_functions_and_objects_become_hooks():
    seen, info = [], _info(1)
    fn = train.hooks.as_hook(seen.append)
    assert isinstance(fn, train.Hook) and fn.on_step(info) is None and seen == [info]

    class Stop:  # the protocol, without subclassing Hook
        def on_step(self, info):
            return True

        def on_end(self, state):
            pass

    stop, recorder = Stop(), _Recorder()
    assert train.hooks.as_hook(stop) is stop and train.hooks.as_hook(recorder) is recorder
    with pytest.raises(TypeError):
        train.hooks.as_hook(3)


def test_data_stream_and_loader_are_batch_sources(tmp_path):
    stream = data.DataStream(make=lambda rng, n, step: TASK.batch(rng, n), batch_size=4, seed=2, per_row=True)
    corpus = make_corpus(str(tmp_path / "c"), np.random.default_rng(0), n=20, hi=90)
    loader = data.Loader(corpus.path, data.LoaderConfig(seq_len=128, batch_size=4, seed=1))
    for source in (stream, loader):
        assert isinstance(source, data.BatchSource)
        it = source.iterator([1, 3], 2)
        assert isinstance(it, data.BatchIterator) and it.get_state() == {"next_index": 2}
        for step in (2, 3):
            for got, want in zip(next(it), source.batch(step, rows=[1, 3]), strict=True):
                np.testing.assert_array_equal(got, want)
        it.set_state({"next_index": 2})
        np.testing.assert_array_equal(next(it).tokens, source.batch(2, rows=[1, 3]).tokens)
    assert not stream.stateful and stream.describe() is None and stream.seq_len is stream.vocab_size is None
    assert loader.stateful and loader.describe()["config"]["seq_len"] == 128 and loader.seq_len == 128
    assert not isinstance(object(), data.BatchSource)
