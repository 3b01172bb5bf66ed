"""Packing plans and the Grain ``Loader``: pieces cover every document once, targets never cross
a document boundary, shuffles and mixtures by seed, process-local rows, resumable iterators."""

import dataclasses
import json
import os

import jaxtyping
import numpy as np
import pytest

from ringsplash import data
from support.corpus import documents_in_rows, make_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(str(tmp_path_factory.mktemp("corpus") / "c"), np.random.default_rng())


def _check_rows(docs, lengths, plan, seq_len):
    """Every row of ``plan`` against the documents: tokens, labels, mask, positions, segments."""
    for r in range(plan.num_rows):
        row = data.pack_row(docs, lengths, plan, r, seq_len)
        col = 0
        for seg, p in enumerate(range(plan.row_start[r], plan.row_start[r + 1]), start=1):
            d, s, n = int(plan.doc[p]), int(plan.start[p]), int(plan.length[p])
            doc = np.asarray(docs[d])
            sl = slice(col, col + n)
            np.testing.assert_array_equal(row.tokens[sl], doc[s : s + n])
            np.testing.assert_array_equal(row.positions[sl], np.arange(n))
            assert (row.segment_ids[sl] == seg).all()
            ends = s + n == len(doc)
            scored = n - 1 if ends else n  # the document's last token predicts nothing; a cut piece's does
            np.testing.assert_array_equal(row.loss_mask[sl], [1.0] * scored + [0.0] * (n - scored))
            np.testing.assert_array_equal(row.labels[col : col + scored], doc[s + 1 : s + 1 + scored])
            col += n
        assert col <= seq_len and (row.segment_ids[col:] == 0).all() and (row.loss_mask[col:] == 0).all()


@pytest.mark.parametrize("policy", ["concat_split", "first_fit", "best_fit"])
def test_plan_covers_every_document_once_and_targets_stay_inside_documents(policy):
    rng = np.random.default_rng()
    seq_len = 32
    docs = [rng.integers(1, 200, int(n)) for n in rng.integers(1, 3 * seq_len, 50)]
    lengths = np.array([len(d) for d in docs])
    order = rng.permutation(len(docs))
    plan = data.plan_packing(lengths, seq_len, policy, order=order)
    covered = [[] for _ in docs]
    for p in range(len(plan.doc)):
        covered[plan.doc[p]].append((int(plan.start[p]), int(plan.length[p])))
    for d, pieces in enumerate(covered):  # each document exactly once, in order, in pieces
        assert sum(n for _, n in sorted(pieces)) == lengths[d] and sorted(pieces)[0][0] == 0
        assert [s for s, _ in sorted(pieces)] == list(np.cumsum([0] + [n for _, n in sorted(pieces)])[:-1])
    row_len = np.add.reduceat(plan.length, plan.row_start[:-1])
    assert (row_len <= seq_len).all()
    if policy == "concat_split":
        assert (row_len[:-1] == seq_len).all() and plan.num_rows == -(-lengths.sum() // seq_len)
    else:  # a document that fits a row is never split
        for d in np.flatnonzero(lengths <= seq_len):
            assert covered[d] == [(0, lengths[d])]
        assert plan.num_rows >= -(-lengths.sum() // seq_len)
    _check_rows(docs, lengths, plan, seq_len)


def test_best_fit_packs_at_least_as_tightly_as_first_fit_here():
    rng = np.random.default_rng()
    lengths = rng.integers(1, 64, 300)
    rows = {p: data.plan_packing(lengths, 64, p).num_rows for p in ("first_fit", "best_fit")}
    assert rows["best_fit"] <= rows["first_fit"] + 1  # heuristics; best fit is never much worse
    assert rows["best_fit"] <= 1.15 * -(-lengths.sum() // 64)  # near the bound on random lengths


def test_long_documents_split_truncate_or_error():
    lengths = np.array([5, 70, 3])
    split = data.plan_packing(lengths, 32, "first_fit", long_documents="split")
    assert sorted(split.length[split.doc == 1].tolist()) == [6, 32, 32]
    trunc = data.plan_packing(lengths, 32, "best_fit", long_documents="truncate")
    assert trunc.length[trunc.doc == 1].tolist() == [32]
    with pytest.raises(ValueError, match=r"document 1 has 70 tokens, more than seq_len=32"):
        data.plan_packing(lengths, 32, "best_fit", long_documents="error")


def test_loader_batches_are_packed_rows_of_the_corpus(corpus):
    loader = data.Loader(corpus.path, data.LoaderConfig(seq_len=64, batch_size=4, seed=5))
    src = loader.sources[0]
    seen = set()
    for step in range(3 * src.plan.num_rows // 4 + 1):  # past one epoch
        b = loader.batch(step)
        assert b.tokens.shape == (4, 64) and b.tokens.dtype == np.int32
        for r in range(4):
            seen.add(b.tokens[r].tobytes())
    # the rows of the plan; one epoch holds each exactly once
    rows = {data.pack_row(corpus, corpus.lengths, src.plan, r, 64).tokens.tobytes() for r in range(src.plan.num_rows)}
    assert seen <= rows and len(rows) == src.plan.num_rows  # every batch row is a row of the plan
    epoch = [loader.row(g).tokens.tobytes() for g in range(src.plan.num_rows)]
    assert set(epoch) == rows
    again = [loader.row(g).tokens.tobytes() for g in range(src.plan.num_rows, 2 * src.plan.num_rows)]
    assert set(again) == rows and again != epoch  # the next epoch is shuffled anew


def test_shuffle_by_seed(corpus):
    a, b, c = (data.Loader(corpus.path, data.LoaderConfig(seq_len=64, batch_size=4, seed=s)) for s in (1, 1, 2))
    np.testing.assert_array_equal(a.batch(3).tokens, b.batch(3).tokens)
    assert not np.array_equal(a.batch(3).tokens, c.batch(3).tokens)


def test_iterator_reads_only_its_rows_and_resumes_from_its_state(corpus):
    loader = data.Loader(corpus.path, data.LoaderConfig(seq_len=64, batch_size=4, seed=0, num_threads=2, prefetch=3))
    parts = {name: loader.iterator(rows) for name, rows in (("even", [0, 2]), ("odd", [1, 3]))}
    for step in range(5):
        full = loader.batch(step)
        even, odd = next(parts["even"]), next(parts["odd"])
        for f, e, o in zip(full, even, odd):
            np.testing.assert_array_equal(f[[0, 2]], e)
            np.testing.assert_array_equal(f[[1, 3]], o)
    it = loader.iterator([1, 3])
    for _ in range(3):
        next(it)
    state = it.get_state()
    assert state == {"next_index": 3}
    rest = [next(it).tokens for _ in range(4)]
    fresh = loader.iterator([1, 3])
    fresh.set_state(state)
    for x in rest:
        np.testing.assert_array_equal(next(fresh).tokens, x)
    np.testing.assert_array_equal(next(loader.iterator([1, 3], step=3)).tokens, rest[0])


def test_mixture_meets_its_ratio(tmp_path):
    """Grain's ``MapDataset.mix`` interleaves deterministically: over any first N rows each source's
    count is within 1 of its share (bound stated and checked over N = 1..4000)."""
    rng = np.random.default_rng()
    short = make_corpus(str(tmp_path / "short"), rng, n=30, hi=40, letters="abcdefgh")
    long = make_corpus(str(tmp_path / "long"), rng, n=10, lo=60, hi=200, letters="qrstuvwx")
    loader = data.Loader([short.path, long.path], data.LoaderConfig(seq_len=64, batch_size=8, weights=(3, 1)))
    which = np.array([loader.source_of(g) for g in range(4000)])
    counts = np.cumsum(which == 1)
    assert np.abs(counts - np.arange(1, 4001) * 0.25).max() <= 1.0
    for g in range(64):  # each row really comes from its source's corpus
        row = loader.row(g)
        letters = set(bytes(row.tokens[row.segment_ids > 0].astype(np.uint8)).decode())
        assert letters <= set("qrstuvwx" if which[g] else "abcdefgh")


def test_train_and_heldout_documents_split_a_corpus_by_a_hash_of_each_document(tmp_path):
    """``documents="train"``: every document but the held-out share (one in ten by a hash of its tokens),
    ``"heldout"``: only that share. Two epochs of training rows hold every other document and no held-out
    one; the split is the documents' own, the same when they are tokenized in another order."""
    c = make_corpus(str(tmp_path / "c"), np.random.default_rng(0), n=60, lo=2, hi=60)
    docs = [np.asarray(c[i]).astype(np.uint8).tobytes() for i in range(len(c))]
    held = data.held_out_documents(c)
    heldout_docs = {d for d, h in zip(docs, held) if h}
    assert 0 < len(heldout_docs) < len(c) and not heldout_docs & {d for d, h in zip(docs, held) if not h}
    config = data.LoaderConfig(seq_len=64, batch_size=4, seed=3)
    train = data.Loader(c.path, dataclasses.replace(config, documents="train"))
    heldout = data.Loader(c.path, dataclasses.replace(config, documents="heldout"))
    assert list(train.sources[0].documents) == list(np.flatnonzero(~held))
    assert list(heldout.sources[0].documents) == list(np.flatnonzero(held))
    assert documents_in_rows(train, 2 * train.sources[0].plan.num_rows) == set(docs) - heldout_docs
    assert documents_in_rows(heldout, heldout.sources[0].plan.num_rows) == heldout_docs
    assert train.describe()["config"]["documents"] == "train"
    assert "documents" not in data.Loader(c.path, config).describe()["config"]  # "all": as before it existed
    # the same documents, tokenized in the reverse order: the same ones held out
    (tmp_path / "rev").mkdir()
    for i, d in enumerate(reversed(docs)):
        (tmp_path / "rev" / f"{i:04d}.txt").write_bytes(d)
    data.tokenize_corpus([str(tmp_path / "rev")], str(tmp_path / "c_rev"), progress=False)
    rev = data.TokenizedCorpus(str(tmp_path / "c_rev"))
    assert {np.asarray(rev[int(i)]).astype(np.uint8).tobytes() for i in np.flatnonzero(data.held_out_documents(rev))} \
        == heldout_docs


def test_a_side_of_the_split_without_documents_is_named(tmp_path):
    c = make_corpus(str(tmp_path / "c"), np.random.default_rng(0), n=1, lo=5, hi=6)
    side = "heldout" if not data.held_out_documents(c)[0] else "train"
    with pytest.raises(ValueError, match=rf"none of its 1 documents is .*documents='{side}'; one in 10 is held out"):
        data.Loader(c.path, data.LoaderConfig(seq_len=64, batch_size=4, documents=side))


def test_loader_config_rejects_bad_values(corpus):
    with pytest.raises((ValueError, jaxtyping.TypeCheckError), match=r"packing"):
        data.LoaderConfig(seq_len=64, batch_size=4, packing="greedy")
    with pytest.raises(ValueError, match=r"batch_size must be a positive int, got batch_size=0"):
        data.LoaderConfig(seq_len=64, batch_size=0)
    with pytest.raises((ValueError, jaxtyping.TypeCheckError), match=r"documents"):
        data.LoaderConfig(seq_len=64, batch_size=4, documents="test")
    with pytest.raises(ValueError, match=r"weights=\(1\.0,\) must give one weight per source \(2 paths\)"):
        data.Loader([corpus.path, corpus.path], data.LoaderConfig(seq_len=64, batch_size=4, weights=(1,)))
    loader = data.Loader(corpus.path, data.LoaderConfig(seq_len=64, batch_size=4))
    with pytest.raises(ValueError, match=r"rows must be in \[0, batch_size=4\), got \[4\]"):
        loader.batch(0, rows=[4])


# ----------------------------------------------------------------------------- damaged or edited corpora


def _own_corpus(tmp_path, n=40, hi=100):
    return make_corpus(str(tmp_path / "c"), np.random.default_rng(0), n=n, hi=hi)


def _tokens_file(corpus):
    return os.path.join(corpus.path, corpus.manifest["shards"][0]["tokens"])


def _edit_byte(file, at):
    """Replace the byte at ``at`` by another letter (same size, new mtime)."""
    with open(file, "r+b") as f:
        f.seek(at)
        old = f.read(1)
        f.seek(at)
        f.write(b"b" if old != b"b" else b"c")


def test_a_shard_edited_in_place_is_refused_when_the_corpus_is_opened(tmp_path):
    """Same size, same manifest: the sampled-chunk fingerprint (here the whole small file) differs."""
    corpus = _own_corpus(tmp_path)
    file = _tokens_file(corpus)
    _edit_byte(file, os.path.getsize(file) - 3)  # a token of the last document
    with pytest.raises(data.CorpusChangedError, match=rf"{file} was changed after tokenization: its sample .*"
                                                      r"manifest .*manifest.json records"):
        data.Loader(corpus.path, data.LoaderConfig(seq_len=64, batch_size=2))


def test_an_edit_between_the_samples_is_caught_on_resume_by_its_mtime(tmp_path, monkeypatch):
    """An edit the sampled chunks miss opens fine, but ``verify_sources`` (what ``fit`` runs when it
    resumes) sees the new mtime and hashes the file whole; a copy (new mtime, same bytes) passes."""
    import ringsplash.data.corpus as corpus_module

    monkeypatch.setattr(corpus_module, "SAMPLE_CHUNKS", 4)
    monkeypatch.setattr(corpus_module, "SAMPLE_BYTES", 16)
    corpus = _own_corpus(tmp_path)
    file = _tokens_file(corpus)
    size = os.path.getsize(file)
    step = (size - 16) // 3  # chunks at 0, step, 2 * step, 3 * step (16 bytes each)
    config = data.LoaderConfig(seq_len=64, batch_size=2)
    os.utime(file, ns=(0, 10**18))  # touched (as a copy would be), same bytes
    data.Loader(corpus.path, config).verify_sources()
    middle = (step + 16 + 2 * step) // 2  # between chunks 1 and 2
    _edit_byte(file, middle - middle % 2)  # the low byte of a uint16 token
    loader = data.Loader(corpus.path, config)  # opening reads only the samples
    with pytest.raises(data.CorpusChangedError, match=rf"{file} was changed after tokenization: its sha256"):
        loader.verify_sources()


@pytest.mark.parametrize("damage", ["last offset past the tokens", "decreasing offsets", "truncated tokens file",
                                    "2-D offsets"])
def test_offsets_inconsistent_with_the_tokens_are_refused_at_open(tmp_path, damage):
    corpus = _own_corpus(tmp_path)
    shard = corpus.manifest["shards"][0]
    tokens_file, offsets_file = (os.path.join(corpus.path, shard[k]) for k in ("tokens", "offsets"))
    offsets = np.load(offsets_file)
    if damage == "last offset past the tokens":
        offsets[-1] += 5
        np.save(offsets_file, offsets)
        message = rf"{offsets_file}: the document offsets do not fit {tokens_file} .*expected the last offset"
    elif damage == "decreasing offsets":
        offsets[3], offsets[4] = offsets[4], offsets[3]
        np.save(offsets_file, offsets)
        message = rf"{offsets_file}: .*expected non-decreasing offsets, got offsets\[3\]="
    elif damage == "truncated tokens file":
        with open(tokens_file, "r+b") as f:
            f.truncate(os.path.getsize(tokens_file) // 2)
        message = rf"corpus shard file {tokens_file} cannot be read as a .npy array"
    else:
        np.save(offsets_file, offsets[None])
        message = rf"{offsets_file}: expected a 1-D integer array of document offsets"
    with pytest.raises(ValueError, match=message):
        data.TokenizedCorpus(corpus.path)


def test_a_token_id_beyond_the_corpus_vocabulary_is_refused_naming_the_shard(tmp_path):
    """A corrupt id the manifest's fingerprints cannot flag (the manifest rewritten after the
    damage) is refused where rows are packed, naming the file, the id and the vocabulary."""
    corpus = _own_corpus(tmp_path)
    file = _tokens_file(corpus)
    tokens = np.load(file)
    tokens[5] = 300  # the bytes tokenizer's vocabulary is 256
    np.save(file, tokens)
    manifest_file = os.path.join(corpus.path, "manifest.json")
    manifest = corpus.manifest
    manifest["shards"][0]["files"]["tokens"] = data.corpus.file_fingerprint(file)
    with open(manifest_file, "w") as f:
        json.dump(manifest, f)
    loader = data.Loader(corpus.path, data.LoaderConfig(seq_len=64, batch_size=1, seed=1))
    with pytest.raises(ValueError, match=rf"{file}: token id 300 \(document 0, token 5, file offset 5\) is outside "
                                         r"the corpus vocabulary \[0, vocab_size=256\)"):
        for step in range(loader.sources[0].plan.num_rows):
            loader.batch(step)


def test_check_token_ids_refuses_ids_outside_the_vocabulary_on_the_host_and_under_jit():
    import jax
    from jax.experimental import checkify

    good = data.pack_documents([np.arange(10)], 16, 1)
    data.check_token_ids(good, 10, "ok")
    bad = good._replace(tokens=good.tokens.copy())
    bad.tokens[0, 3] = 12
    with pytest.raises(ValueError, match=r"batch 7, tokens: token id 12 at index \(0, 3\) is outside the vocabulary "
                                         r"\[0, vocab_size=10\)"):
        data.check_token_ids(bad, 10, "batch 7")
    with pytest.raises(ValueError, match=r"token id -1 at index \(1,\)"):
        data.check_token_ids(np.array([0, -1]), 10, "x")

    @jax.jit
    def embed(tokens):
        data.check_token_ids(tokens, 10, "the prompt")
        return jax.numpy.eye(10)[tokens]

    err, _ = checkify.checkify(embed)(np.asarray(bad.tokens))
    with pytest.raises(checkify.JaxRuntimeError, match=r"the prompt: token id 12 \(flat index 3\) is outside"):
        err.throw()
    err, _ = checkify.checkify(embed)(np.asarray(good.tokens))
    assert err.get() is None


# ----------------------------------------------------------------------------- bad values of the data API


def _constructed(config, **fields):
    """``config`` with ``fields`` set as its dataclass ``__init__`` sets them, then checked: what a user without
    the test run's runtime type checker (which refuses a float for an ``int`` field first) meets."""
    for name, value in fields.items():
        object.__setattr__(config, name, value)
    config.__post_init__()
    return config


@pytest.mark.parametrize("fields, error, match", [
    (dict(batch_size=True), ValueError, r"batch_size must be a positive int, got batch_size=True"),  # was 1 row
    (dict(seed=1.5), TypeError, r"seed must be an int, got seed=1.5"),  # was kept
    (dict(seed="1"), TypeError, r"seed must be an int, got seed='1'"),  # was a raw comparison TypeError
    (dict(seed=2**31), ValueError, r"seed must be in \[0, 2\*\*31\), got seed=2147483648"),
    (dict(weights=(1.0, float("inf"))), ValueError, r"weights\[1\] must be finite, got weights\[1\]=inf"),
    (dict(weights=("1", "2")), TypeError, r"weights\[0\] must be a real number, got weights\[0\]='1'"),  # float()
    (dict(weights=(True, 1)), TypeError, r"weights\[0\] must be a real number, got weights\[0\]=True"),
    (dict(weights=1), TypeError, r"weights must be a sequence of positive numbers.*got weights=1"),
    (dict(pad_id=-1), ValueError, r"pad_id must be >= 0, got pad_id=-1"),  # was kept: a padding token of -1
    (dict(pad_id=1.5), TypeError, r"pad_id must be an int, got pad_id=1.5"),
])
def test_loader_config_names_a_bad_seed_weight_or_pad_id(fields, error, match):
    with pytest.raises(error, match=match):
        _constructed(data.LoaderConfig(seq_len=16, batch_size=2), **fields)
    assert _constructed(data.LoaderConfig(seq_len=16, batch_size=2), seed=np.int64(3), pad_id=np.int32(1),
                        weights=np.array([1, 2.5])).weights == (1.0, 2.5)


def test_recall_task_stream_and_packing_name_bad_values():
    """RecallTask, DataStream, recall_batch, plan_packing and pack_documents check their numbers by name:
    before, filler_rule 1.5 / NaN and negative min_distance were taken, num_values 0 failed inside the draws,
    episode_len 0 was a ZeroDivisionError, DataStream batch_size 0 / step 1.5 were taken, negative or float
    lengths were packed, an order out of range an IndexError, float tokens were truncated."""
    import inspect

    task = data.RecallTask(seq_len=64, num_pairs=4, num_queries=4)
    for fields, match in [(dict(filler_rule=1.5), r"filler_rule must be <= 1.0"),
                          (dict(filler_rule=float("nan")), r"filler_rule must be finite"),
                          (dict(min_distance=-5), r"min_distance must be >= 0, got min_distance=-5"),
                          (dict(num_values=0), r"num_values must be a positive int, got num_values=0"),
                          (dict(seq_len=64.0), r"seq_len must be a positive int, got seq_len=64.0")]:
        with pytest.raises(ValueError, match=match):
            _constructed(data.RecallTask(seq_len=64, num_pairs=4, num_queries=4), **fields)
    assert type(_constructed(data.RecallTask(seq_len=64, num_pairs=4, num_queries=4), seq_len=np.int64(64)).seq_len) \
        is int
    rng = np.random.default_rng(0)
    recall_batch = inspect.unwrap(data.recall_batch)
    with pytest.raises(ValueError, match=r"episode_len must be a positive int, got episode_len=0"):
        recall_batch(rng, 2, task, episode_len=0)
    with pytest.raises(ValueError, match=r"batch_size must be a positive int, got batch_size=0"):
        recall_batch(rng, 0, task)
    with pytest.raises(ValueError, match=r"episode_len must be a positive int, got episode_len=0"):
        task.episode(0)
    make = lambda rng, b, step: recall_batch(rng, b, task)
    with pytest.raises(ValueError, match=r"batch_size must be a positive int, got batch_size=0"):
        _constructed(data.DataStream(make, 2), batch_size=0)
    stream = data.DataStream(make, 2)
    batch = inspect.unwrap(data.DataStream.batch)
    with pytest.raises(TypeError, match=r"step must be an int, got step=1.5"):
        batch(stream, 1.5)
    with pytest.raises(TypeError, match=r"rows\[0\] must be an int, got rows\[0\]=1.5"):
        batch(stream, 0, rows=[1.5])
    np.testing.assert_array_equal(batch(stream, np.int64(3)).tokens, stream.batch(3).tokens)
    plan_packing, pack_documents = inspect.unwrap(data.plan_packing), inspect.unwrap(data.pack_documents)
    with pytest.raises(ValueError, match=r"lengths must be >= 0, got lengths\[1\]=-20"):
        plan_packing(np.array([5, -20, 3]), 16)
    with pytest.raises(TypeError, match=r"lengths must hold integers, got dtype float64"):
        plan_packing(np.array([5.7, 3.2]), 16)
    with pytest.raises(ValueError, match=r"order must index lengths \(< 2\), got 5"):
        plan_packing(np.array([5, 3]), 16, order=np.array([0, 5]))
    with pytest.raises(TypeError, match=r"seq_len must be an int, got seq_len='16'"):
        plan_packing(np.array([5, 3]), "16")
    with pytest.raises(TypeError, match=r"docs\[0\] must hold integers, got dtype float64"):
        pack_documents([np.array([1.7, 2.2])], 8, 1)
    with pytest.raises(ValueError, match=r"num_rows must be a positive int, got num_rows=0"):
        pack_documents([np.arange(5)], 8, 0)
    assert plan_packing([], 16).num_rows == 0  # no documents: an empty plan, as before
