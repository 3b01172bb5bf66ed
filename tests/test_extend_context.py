"""experiments/extend_context.py at its smallest: every method through base training, zero-shot
evaluation, the ring finetune and evaluation again; every artefact written, every number finite,
the same numbers from a second run with the same seed; and the AOT preflight of the long finetune."""

import importlib.util
import json
import math
import os

import numpy as np
import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")

TINY = dict(base_len=256, factor=2, d_model=32, num_layers=1, num_heads=2, base_steps=2, base_batch=2,
            finetune_steps=2, finetune_batch=2, context_parallel=2, eval_docs=1, passkey_samples=1, depths="0.5",
            passkey_docs=8, progress=False)


def _job():
    spec = importlib.util.spec_from_file_location("extend_context", os.path.join(ROOT, "experiments", "extend_context.py"))
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    return job


def _jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    job = _job()
    root = tmp_path_factory.mktemp("extend")
    corpora = str(root / "corpora")
    # The second run (yarn alone) before the first (every method, yarn first, "none" last): the base's and
    # yarn's train steps are then still in the process's cache of train steps (train/loop.py::_train_step,
    # the 4 newest) when the first run trains the same base and finetunes yarn, and "none"'s when the third
    # run finetunes "none" from the same base
    second = job.main(job.Config(**TINY, methods="yarn", corpus_dir=corpora, run_dir=str(root / "second")))
    order = ["yarn"] + [m for m in job.METHODS if m not in ("yarn", "none")] + ["none"]
    assert sorted(order) == sorted(job.METHODS)
    first = job.main(job.Config(**TINY, methods=",".join(order), corpus_dir=corpora, run_dir=str(root / "first")))
    # --init-from the first run's base (a ringsplash run directory, recall tokens in its vocabulary)
    resumed = job.main(job.Config(**{**TINY, "base_len": 0}, methods="none", init_from=str(root / "first" / "base_model"),
                                  corpus_dir=corpora, run_dir=str(root / "third")))
    return job, first, second, resumed


@pytest.mark.slow
@pytest.mark.e2e
def test_extend_context_writes_every_artefact_with_finite_numbers(runs):
    job, first, _, _ = runs
    run_dir = first["run_dir"]
    assert first["lengths"] == [256, 512]
    records = _jsonl(os.path.join(run_dir, "results.jsonl"))
    keys = {(r["method"], r["phase"], r["length"]) for r in records}
    assert keys == {(m, p, n) for m in job.METHODS for p in ("zero_shot", "finetuned") for n in (256, 512)}
    for r in records:
        assert math.isfinite(r["perplexity"]) and r["perplexity"] > 1, r
        assert 0.0 <= r["passkey"] <= 1.0, r
    with open(os.path.join(run_dir, "results.md")) as f:
        table = f.read()
    assert table.startswith("| method | phase | 256 ppl / passkey | 512 ppl / passkey |")
    assert len(table.strip().splitlines()) == 2 + 2 * len(job.METHODS)
    assert os.path.getsize(os.path.join(run_dir, "perplexity.png")) > 0
    for method in job.METHODS:
        for phase in ("zero_shot", "finetuned"):
            d = os.path.join(run_dir, method, phase)
            assert os.path.getsize(os.path.join(d, "heatmap_exact.png")) > 0, d
            assert len(_jsonl(os.path.join(d, "results.jsonl"))) == 2  # one prompt per length
        # the finetune ran on the ring and checkpointed its one step
        ft = os.path.join(run_dir, method, "finetune")
        with open(os.path.join(ft, "config.json")) as f:
            assert json.load(f)["model"]["context_parallel"]["strategy"] == "ring"
        assert os.path.isdir(os.path.join(ft, "checkpoints", "2"))
    # two finetune steps move every method's model (the first step's learning rate is warmup's 0)
    ppl = {(r["method"], r["phase"], r["length"]): r["perplexity"] for r in records}
    for method in job.METHODS:
        assert ppl[(method, "finetuned", 512)] != ppl[(method, "zero_shot", 512)], method


@pytest.mark.slow
@pytest.mark.e2e
def test_extend_context_same_seed_same_numbers(runs):
    _, first, second, _ = runs
    again = {(r["method"], r["phase"], r["length"]): r for r in second["results"]}
    assert len(again) == 4  # zero-shot and finetuned at two lengths
    for r in first["results"]:
        if r["method"] == "yarn":
            assert again[(r["method"], r["phase"], r["length"])] == r


def test_extend_context_methods_change_only_the_rope():
    job = _job()
    base = job.base_model_config(job.Config(**TINY), 256)
    seen = set()
    for method in job.METHODS:
        c = job.extended(base, method, 8, 512)
        assert c.max_seq_len == 4096 and (c.d_model, c.num_layers, c.vocab_size) == (32, 1, 256)
        seen.add((c.rope_theta, c.features.rope_scaling))
        ring = job.on_ring(c, job.Config(**TINY))
        cp = ring.context_parallel
        assert (cp.strategy, cp.ring_size, ring.features.rope_scaling) == ("ring", 2, c.features.rope_scaling)
    assert len(seen) == len(job.METHODS)  # six different RoPEs
    assert job.extended(base, "base", 8, 512).rope_theta == pytest.approx(10_000 * 8 ** (16 / 14))
    assert job.extended(base, "yarn", 8, 512).features.rope_scaling.original_max_position_embeddings == 512


@pytest.mark.parametrize("kwargs, match", [
    (dict(methods="none,ntk"), r"--methods methods='none,ntk' is not accepted: expected a comma-separated subset"),
    (dict(factor=1), r"--factor factor=1 is not accepted: expected an int >= 2"),
    (dict(passkey_mix=1.0), r"--passkey-mix passkey_mix=1.0 is not accepted: expected a number in \[0, 1\)"),
    (dict(finetune_steps=0), r"--finetune-steps finetune_steps=0 is not accepted: expected >= 1"),
    (dict(retrieval="passkey"), r"--retrieval retrieval='passkey' is not accepted: expected one of \('recall', 'text', 'none'\)"),
    (dict(compute_dtype="float64"), r"--compute-dtype 'float64' is not accepted: expected one of float32, bfloat16"),
    (dict(block=100), r"--block 100 is not accepted: expected 0 \(auto"),
])
def test_extend_context_rejects_bad_flags(kwargs, match):
    job = _job()
    with pytest.raises(ValueError, match=match):
        job.Config(**{**TINY, **kwargs})


@pytest.mark.tpu_compile
@pytest.mark.e2e
def test_extend_context_preflight_compiles_the_long_finetune_for_v5e(tmp_path, capfd):
    """--preflight: the long finetune step of a method (YaRN, 4K over the ring) compiles for v5e:2x2."""
    job = _job()
    config = job.Config(**{**TINY, "base_len": 1024, "factor": 4, "context_parallel": 4}, methods="yarn",
                        preflight="v5e:2x2", block=256, run_dir=str(tmp_path))
    assert job.main(config)["returncode"] == 0
    out = capfd.readouterr().out
    assert "--rope-scaling yarn --rope-factor 4.0 --rope-original-max-len 1024" in out
    assert "context=4" in out and out.strip().endswith("FITS")


def test_extend_context_recall_rows_sit_above_the_text_and_score_only_answers(tmp_path):
    """--retrieval recall: each batch = the loader's text rows + recall rows in tokens above the text's
    vocabulary (answers only scored), short episodes first, the same batch for the same step."""
    import numpy as np

    from ringsplash import data

    (tmp_path / "t.txt").write_text("some text to pack into rows " * 200)
    data.tokenize_corpus(str(tmp_path / "t.txt"), str(tmp_path / "c"), progress=False)
    job = _job()
    loader = data.Loader(str(tmp_path / "c"), data.LoaderConfig(seq_len=256, batch_size=3))
    stream = job.mixed_stream(loader, 256, 2, steps=10, offset=256, seed=0)
    first = stream.batch(0)
    assert first.tokens.shape == (5, 256) and stream.batch_size == 5
    np.testing.assert_array_equal(first.tokens[:3], loader.batch(0).tokens)
    recall = first.tokens[3:]
    assert recall.min() >= 256 and recall.max() < 256 + job.recall_task(256).vocab_size
    assert set(np.unique(first.loss_mask[3:])) == {0.0, 1.0} and first.loss_mask[3:].sum() > 0
    assert np.all(first.labels[3:][first.loss_mask[3:] > 0] >= 256 + job.recall_task(256).value_offset)
    assert len(np.unique(first.segment_ids[3])) == 256 // 16  # step 0: 16-token episodes packed
    assert len(np.unique(stream.batch(9).segment_ids[3])) == 1  # past the curriculum: whole rows
    for a, b in zip(first, stream.batch(0), strict=True):
        np.testing.assert_array_equal(a, b)


def test_extend_context_text_passkey_documents_fit_and_hold_their_key(tmp_path):
    job = _job()
    from ringsplash import data, evals

    config = job.Config(**TINY, retrieval="text", corpus_dir=str(tmp_path))
    tok = evals.load_tokenizer("bytes")
    hay = evals.Haystack.from_text("filler words about nothing in particular. " * 100, tok)
    corpus = data.TokenizedCorpus(job.passkey_corpus(config, tok, hay, 512, "pk"))
    assert len(corpus) == TINY["passkey_docs"]
    for i in range(len(corpus)):
        text = bytes(np.asarray(corpus[i], np.uint8)).decode()
        assert len(corpus[i]) <= 512 and "The pass key is " in text
        key = text.split("The pass key is ")[1][:5]
        assert key.isdigit() and text.endswith(key + ".")


@pytest.mark.slow
@pytest.mark.e2e
def test_extend_context_init_from_a_run_directory_reproduces_its_base(runs):
    """--init-from the first run's base run directory (base_len 0: the model's own length): the
    unchanged-RoPE rows equal the first run's, which trained that base itself."""
    _, first, _, resumed = runs
    assert resumed["lengths"] == [256, 512]
    want = [r for r in first["results"] if r["method"] == "none"]
    assert resumed["results"] == want
