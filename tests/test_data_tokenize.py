"""Tokenizing corpora to disk (``ringsplash.data.tokenize_corpus``) and reading them back."""

import json
import os
from pathlib import Path

import jaxtyping
import numpy as np
import pytest

from ringsplash import data


def _write(path, text: str | bytes):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(text.encode() if isinstance(text, str) else text)


def _texts(rng, n, lo=1, hi=60):
    alphabet = np.array(list("abcdefgh ijklmnop\nqrstuvwxyzé€"))
    return ["".join(rng.choice(alphabet, int(rng.integers(lo, hi)))) for _ in range(n)]


@pytest.fixture
def inputs(tmp_path):
    """A directory of text files (nested) and a JSONL file: 8 + 5 documents, fresh random text."""
    rng = np.random.default_rng()
    texts = _texts(rng, 13)
    for i, t in enumerate(texts[:8]):
        _write(str(tmp_path / "in" / ("sub" if i % 2 else "") / f"doc{i}.txt"), t)
    _write(str(tmp_path / "in.jsonl"), "\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(texts[8:])))
    return tmp_path, texts


def test_bytes_corpus_round_trips_documents_and_counts(inputs):
    tmp, texts = inputs
    m = data.tokenize_corpus([str(tmp / "in"), str(tmp / "in.jsonl")], str(tmp / "c"),
                             data.TokenizeOptions(shard_tokens=64), progress=False)
    corpus = data.TokenizedCorpus(str(tmp / "c"))
    files = data.input_files([str(tmp / "in")])  # the order documents are written in: sorted walk, then the JSONL
    expected = [Path(f).read_bytes() for f in files] + [t.encode() for t in texts[8:]]
    assert len(corpus) == m["num_documents"] == 13 and m["vocab_size"] == 256 and len(m["shards"]) > 1
    for i, e in enumerate(expected):
        assert bytes(np.asarray(corpus[i], np.uint8)) == e
    assert m["num_tokens"] == sum(len(e) for e in expected) == int(corpus.lengths.sum())
    assert isinstance(corpus[0], np.memmap) or isinstance(corpus[0].base, np.memmap)  # memory-mapped, not read


def test_retokenizing_the_same_input_is_a_no_op_and_identical(inputs):
    tmp, _ = inputs
    args = ([str(tmp / "in"), str(tmp / "in.jsonl")], str(tmp / "c"))
    m1 = data.tokenize_corpus(*args, progress=False)
    stamp = {f: os.stat(tmp / "c" / f).st_mtime_ns for f in os.listdir(tmp / "c")}
    assert data.tokenize_corpus(*args, progress=False) == m1
    assert {f: os.stat(tmp / "c" / f).st_mtime_ns for f in os.listdir(tmp / "c")} == stamp  # nothing rewritten
    m2 = data.tokenize_corpus(*args[:1], str(tmp / "c2"), progress=False)  # a second, independent run
    for shard in m1["shards"]:
        for key in ("tokens", "offsets"):
            assert (tmp / "c" / shard[key]).read_bytes() == (tmp / "c2" / shard[key]).read_bytes()
    assert m1["fingerprint"] == m2["fingerprint"]
    _write(str(tmp / "in" / "doc0.txt"), "changed")  # other input: refuses to overwrite unless asked
    with pytest.raises(FileExistsError, match=r"holds a corpus of other inputs.*overwrite=True"):
        data.tokenize_corpus(*args, progress=False)
    assert data.tokenize_corpus(*args, overwrite=True, progress=False)["fingerprint"] != m1["fingerprint"]


def test_hf_tokenizer_batches_match_single_encodes(inputs):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tmp, texts = inputs
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]"]))
    tok.save(str(tmp / "tokenizer.json"))
    m = data.tokenize_corpus([str(tmp / "in.jsonl")], str(tmp / "c"),
                             data.TokenizeOptions(tokenizer=str(tmp / "tokenizer.json"), batch_documents=2),
                             progress=False)
    corpus = data.TokenizedCorpus(str(tmp / "c"))
    assert m["tokenizer"]["kind"] == "hf" and m["vocab_size"] == tok.get_vocab_size(with_added_tokens=True)
    for i, t in enumerate(texts[8:]):
        np.testing.assert_array_equal(corpus[i], tok.encode(t, add_special_tokens=False).ids)


@pytest.mark.parametrize("case", ["no_files", "all_empty", "empty_doc_error", "missing_field", "not_a_string",
                                  "bad_json", "undecodable", "missing_input", "no_manifest"])
def test_bad_input_names_the_file_and_field(tmp_path, case):
    opts, inputs = data.TokenizeOptions(), [str(tmp_path / "in")]
    os.makedirs(tmp_path / "in")
    if case == "no_files":
        match = r"empty corpus: the inputs .* hold no files"
    elif case == "all_empty":
        _write(str(tmp_path / "in" / "a.txt"), "")
        match = r"empty corpus: 1 input file\(s\) hold no non-empty document \(1 empty skipped\), e\.g\. .*a\.txt"
    elif case == "empty_doc_error":
        _write(str(tmp_path / "in" / "a.jsonl"), '{"text": "x"}\n{"text": ""}\n')
        opts = data.TokenizeOptions(empty_documents="error")
        match = r"a\.jsonl:2: empty document"
    elif case == "missing_field":
        _write(str(tmp_path / "in" / "a.jsonl"), '{"text": "x"}\n{"body": "y"}\n')
        match = r"a\.jsonl:2: no text field 'text' \(the line has \['body'\]\)"
    elif case == "not_a_string":
        _write(str(tmp_path / "in" / "a.jsonl"), '{"content": 3}\n')
        opts = data.TokenizeOptions(text_field="content")
        match = r"a\.jsonl:1: field 'content' must be a string, got int"
    elif case == "bad_json":
        _write(str(tmp_path / "in" / "a.jsonl"), '{"text": "x"\n')
        match = r"a\.jsonl:1: not a JSON line"
    elif case == "undecodable":
        _write(str(tmp_path / "in" / "a.txt"), b"ok \xff\xfe bad")
        match = r"a\.txt: bytes 3\.\.4 are not UTF-8 .*errors='replace'"
    elif case == "missing_input":
        inputs = [str(tmp_path / "nope")]
        match = r"input '.*nope' is neither a file nor a directory"
    else:
        with pytest.raises(FileNotFoundError, match=r"is not a tokenized corpus: no manifest\.json"):
            data.TokenizedCorpus(str(tmp_path / "in"))
        return
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        data.tokenize_corpus(inputs, str(tmp_path / "c"), opts, progress=False)
    assert not os.path.exists(tmp_path / "c")  # nothing half-written


def test_undecodable_bytes_replaced_and_empty_documents_skipped_by_option(tmp_path):
    _write(str(tmp_path / "in" / "a.txt"), b"ok \xff bad")
    _write(str(tmp_path / "in" / "b.txt"), b"")
    m = data.tokenize_corpus([str(tmp_path / "in")], str(tmp_path / "c"), data.TokenizeOptions(errors="replace"),
                             progress=False)
    assert m["replaced_documents"] == 1 and m["skipped_empty_documents"] == 1 and m["num_documents"] == 1
    assert bytes(np.asarray(data.TokenizedCorpus(str(tmp_path / "c"))[0], np.uint8)) == "ok \ufffd bad".encode()


def test_options_are_checked():
    # Literal modes: the shape-checked test run rejects them at the call, library code in __post_init__
    with pytest.raises((ValueError, jaxtyping.TypeCheckError), match=r"empty_documents"):
        data.TokenizeOptions(empty_documents="drop")
    with pytest.raises((ValueError, jaxtyping.TypeCheckError), match=r"errors"):
        data.TokenizeOptions(errors="ignore")
    with pytest.raises(FileNotFoundError, match=r"tokenizer='nope\.json' must be 'bytes' or an existing"):
        data.TokenizeOptions(tokenizer="nope.json")


def test_tokenize_script_writes_a_corpus_and_reports_bad_input(inputs, capsys):
    import importlib.util

    tmp, _ = inputs
    spec = importlib.util.spec_from_file_location(
        "tokenize_corpus_script", os.path.join(os.path.dirname(__file__), "..", "scripts", "tokenize_corpus.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    m = script.main([str(tmp / "in"), str(tmp / "in.jsonl"), str(tmp / "c"), "--no-progress"])
    assert m["num_documents"] == 13 and '"num_documents": 13' in capsys.readouterr().out
    _write(str(tmp / "bad.jsonl"), '{"body": "x"}\n')
    with pytest.raises(SystemExit) as exit_:
        script.main([str(tmp / "bad.jsonl"), str(tmp / "c2"), "--no-progress"])
    assert exit_.value.code == 2
    assert "bad.jsonl:1: no text field 'text'" in capsys.readouterr().err


def test_tokenize_script_refuses_bad_flags_and_paths_in_one_line(tmp_path, monkeypatch, capsys):
    """Issue 56 (7) probes, each was a traceback: an output at or under a regular file, a count of 0, a
    missing or unreadable tokenizer.json; now argparse's one line (exit status 2) or the script's."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "tokenize_corpus_script", os.path.join(os.path.dirname(__file__), "..", "scripts", "tokenize_corpus.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.chdir(tmp_path)
    for name, text in (("a.txt", "hello"), ("afile", "not a directory"), ("bad.json", "")):
        _write(str(tmp_path / name), text)
    cases = [(["afile/out"], "error: the output corpus directory (the last path) cannot be made: "),
             (["afile"], "'afile' is a file"),
             (["out", "--shard-tokens", "0"], "error: argument --shard-tokens: expected an integer >= 1, got '0'"),
             (["out", "--batch-documents", "-1"], "error: argument --batch-documents: expected an integer >= 1"),
             (["out", "--tokenizer", "none.json"], "error: argument --tokenizer: expected 'bytes' or a tokenizer.json"),
             (["out", "--tokenizer", "bad.json"], "error: tokenizer='bad.json' is not a Hugging Face tokenizer.json")]
    for args, message in cases:
        with pytest.raises(SystemExit) as exit_:
            script.main(["a.txt", *args, "--no-progress"])
        assert exit_.value.code == 2, args
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (args, err)
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "afile", "bad.json"]


def test_byte_lm_builds_its_default_stdlib_corpora_once(tmp_path):
    """experiments/byte_lm.py without --data: the stdlib's .py files, tokenized as bytes into a
    training and a held-out corpus with no file in both; a second call rewrites nothing."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "byte_lm_corpora", os.path.join(os.path.dirname(__file__), "..", "experiments", "byte_lm.py"))
    byte_lm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(byte_lm)
    config = byte_lm.Config(corpus_dir=str(tmp_path), progress=False)
    train_path, heldout_path = byte_lm.corpora(config)
    manifests = [data.read_manifest(p) for p in (train_path, heldout_path)]
    files = [{i["path"] for i in m["inputs"]} for m in manifests]
    assert files[0] and files[1] and not files[0] & files[1] and all(m["vocab_size"] == 256 for m in manifests)
    stamp = os.stat(os.path.join(train_path, "manifest.json")).st_mtime_ns
    assert byte_lm.corpora(config) == (train_path, heldout_path)
    assert os.stat(os.path.join(train_path, "manifest.json")).st_mtime_ns == stamp
    # a corpus of one's own is held out by a corpus of other documents, never by itself, or by a share
    # of its own documents (byte_lm.datasets splits them: tests/test_data_loader.py)
    assert byte_lm.corpora(byte_lm.Config(data="mine", heldout="other")) == ("mine", "other")
    assert byte_lm.corpora(byte_lm.Config(data="mine")) == ("mine", "mine")
    with pytest.raises(ValueError, match=r"--heldout 'mine' is --data itself"):
        byte_lm.Config(data="mine", heldout="mine")
