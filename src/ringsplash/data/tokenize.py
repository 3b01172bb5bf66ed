"""``tokenize_corpus``: text files, directories of text, or JSONL → a tokenized corpus directory
(``ringsplash.data.corpus`` describes the layout).

* Inputs: a text file is one document; a ``.jsonl`` file holds one document per line, its text
  under ``text_field``; a directory contributes every file below it (sorted, hidden files
  skipped), each by its extension.
* Tokenizers: ``"bytes"`` (the UTF-8 bytes, vocabulary 256) or the path of a Hugging Face
  ``tokenizer.json`` (``tokenizers``; documents encoded in batches, in parallel by its Rust
  thread pool, without special tokens).
* Re-running on the same inputs with the same options is a no-op: the manifest's fingerprint
  (options, tokenizer file and the sha256 of every input) matches and nothing is written. A
  different fingerprint over an existing corpus is an error unless ``overwrite=True``. The
  corpus is written into a temporary directory and renamed into place when complete.
* Bad input fails with the file (and line, for JSONL) named: no documents at all; an empty
  document (``empty_documents="skip"``, the default, skips it and counts it in the manifest;
  ``"error"`` raises); a JSONL line without ``text_field`` or with a non-string value;
  bytes that are not UTF-8 (``errors="error"``, the default, raises; ``"replace"`` decodes
  them as U+FFFD and counts the documents affected).
"""

import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from typing import Literal

import numpy as np

from ringsplash._internal.optional import require
from ringsplash.data.corpus import FORMAT, MANIFEST, file_fingerprint, file_sha256

JSONL_SUFFIXES = (".jsonl",)


@dataclasses.dataclass(frozen=True)
class TokenizeOptions:
    """How a corpus is tokenized (all of it goes into the fingerprint)."""

    tokenizer: str = "bytes"  # "bytes" or the path of a Hugging Face tokenizer.json
    text_field: str = "text"  # JSONL: the field holding each document's text
    empty_documents: Literal["skip", "error"] = "skip"
    errors: Literal["error", "replace"] = "error"  # undecodable (non-UTF-8) bytes
    shard_tokens: int = 1 << 26  # tokens per shard file (a shard ends at a document boundary)
    batch_documents: int = 512  # documents per tokenizer call

    def __post_init__(self):
        if self.empty_documents not in ("skip", "error"):
            raise ValueError(f"empty_documents={self.empty_documents!r} must be 'skip' or 'error'")
        if self.errors not in ("error", "replace"):
            raise ValueError(f"errors={self.errors!r} must be 'error' or 'replace'")
        if self.shard_tokens <= 0 or self.batch_documents <= 0:
            raise ValueError(f"shard_tokens={self.shard_tokens} and batch_documents={self.batch_documents} "
                             "must be positive")
        if not self.text_field:
            raise ValueError(f"text_field={self.text_field!r} must be a non-empty field name")
        if self.tokenizer != "bytes" and not os.path.isfile(self.tokenizer):
            raise FileNotFoundError(f"tokenizer={self.tokenizer!r} must be 'bytes' or an existing tokenizer.json file")


# ----------------------------------------------------------------------------- inputs


def input_files(inputs: Sequence[str]) -> list[str]:
    """Every file the inputs name: files as given, directories walked (sorted, no hidden entries)."""
    if isinstance(inputs, str):
        inputs = [inputs]
    files = []
    for path in inputs:
        if os.path.isfile(path):
            files.append(path)
        elif os.path.isdir(path):
            for root, dirs, names in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                files += [os.path.join(root, n) for n in sorted(names) if not n.startswith(".")]
        else:
            raise FileNotFoundError(f"input {path!r} is neither a file nor a directory")
    return files


def _decode(raw: bytes, where: str, errors: str) -> tuple[str, bool]:
    """(text, whether bytes were replaced); undecodable bytes raise naming ``where`` and the offset."""
    try:
        return raw.decode("utf-8"), False
    except UnicodeDecodeError as e:
        if errors == "error":
            raise ValueError(f"{where}: bytes {e.start}..{e.end} are not UTF-8 ({e.reason}); pass "
                             "errors='replace' (--errors replace) to decode them as U+FFFD") from None
        return raw.decode("utf-8", errors="replace"), True


def _documents(path: str, options: TokenizeOptions) -> Iterator[tuple[str, str, bool, int]]:
    """(where, text, replaced, bytes read) of each document of one input file."""
    if path.endswith(JSONL_SUFFIXES):
        field = options.text_field
        with open(path, "rb") as f:
            for n, line in enumerate(f, start=1):
                where = f"{path}:{n}"
                if not line.strip():
                    continue  # blank lines separate nothing in JSONL
                text, replaced = _decode(line, where, options.errors)
                try:
                    record = json.loads(text)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: not a JSON line ({e.msg})") from None
                if not isinstance(record, dict) or field not in record:
                    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                    raise ValueError(f"{where}: no text field {field!r} (the line has {keys}); "
                                     "choose the field with text_field= (--text-field)")
                if not isinstance(record[field], str):
                    raise ValueError(f"{where}: field {field!r} must be a string, got "
                                     f"{type(record[field]).__name__}")
                yield where, record[field], replaced, len(line)
    else:
        with open(path, "rb") as f:
            raw = f.read()
        text, replaced = _decode(raw, path, options.errors)
        yield path, text, replaced, len(raw)


# ----------------------------------------------------------------------------- tokenizer


class _Tokenizer:
    def __init__(self, spec: str):
        self.spec = spec
        if spec == "bytes":
            self.vocab_size, self.sha256, self._tok = 256, None, None
        else:
            tokenizers = require("tokenizers", extra="data", needed_for=f"tokenizer={spec!r} (a tokenizer.json)")
            try:
                self._tok = tokenizers.Tokenizer.from_file(spec)
            except Exception as e:  # the Rust library raises a bare Exception for a file it cannot parse
                raise ValueError(f"tokenizer={spec!r} is not a Hugging Face tokenizer.json ({e})") from None
            self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
            self.sha256 = file_sha256(spec)

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        if self._tok is None:
            return [np.frombuffer(t.encode("utf-8"), np.uint8) for t in texts]
        return [np.asarray(e.ids, np.int64) for e in self._tok.encode_batch(texts, add_special_tokens=False)]


# ----------------------------------------------------------------------------- writing


class _ShardWriter:
    def __init__(self, directory: str, dtype: np.dtype, shard_tokens: int):
        self.directory, self.dtype, self.shard_tokens = directory, dtype, shard_tokens
        self.shards, self._pending, self._count = [], [], 0

    def add(self, doc: np.ndarray) -> None:
        self._pending.append(doc)
        self._count += doc.size
        if self._count >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        name = f"shard_{len(self.shards):05d}"
        lengths = np.array([d.size for d in self._pending], np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        files = {"tokens": f"{name}.tokens.npy", "offsets": f"{name}.offsets.npy"}
        np.save(os.path.join(self.directory, files["tokens"]),
                np.concatenate(self._pending).astype(self.dtype, copy=False))
        np.save(os.path.join(self.directory, files["offsets"]), offsets)
        # what TokenizedCorpus checks the files against (size, mtime, sampled chunks, sha256)
        fingerprints = {k: file_fingerprint(os.path.join(self.directory, f)) for k, f in files.items()}
        self.shards.append({**files, "documents": len(lengths), "num_tokens": int(offsets[-1]),
                            "files": fingerprints})
        self._pending, self._count = [], 0


def _fingerprint(files: list[str], options: TokenizeOptions, tokenizer: _Tokenizer) -> tuple[str, list[dict]]:
    inputs = [{"path": os.path.abspath(p), "size": os.path.getsize(p), "sha256": file_sha256(p)} for p in files]
    opts = {**dataclasses.asdict(options), "tokenizer": tokenizer.sha256 or "bytes"}
    blob = json.dumps({"options": opts, "inputs": [(i["size"], i["sha256"]) for i in inputs]}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32], inputs


def tokenize_corpus(inputs: str | Sequence[str], output: str, options: TokenizeOptions = TokenizeOptions(), *,
                    overwrite: bool = False, progress: bool = True) -> dict:
    """Tokenize ``inputs`` (files / directories, see the module doc) into the corpus directory
    ``output``; returns its manifest. A no-op when ``output`` already holds this input's corpus."""
    from tqdm.auto import tqdm

    files = input_files(inputs)
    if not files:
        raise ValueError(f"empty corpus: the inputs {list(inputs) if not isinstance(inputs, str) else [inputs]} "
                         "hold no files")
    tokenizer = _Tokenizer(options.tokenizer)
    fingerprint, fingerprints = _fingerprint(files, options, tokenizer)
    manifest_path = os.path.join(output, MANIFEST)
    if os.path.exists(manifest_path):
        with open(manifest_path) as f:
            existing = json.load(f)
        if existing.get("fingerprint") == fingerprint:
            return existing  # same inputs, same options: nothing to do
        if not overwrite:
            raise FileExistsError(f"{output=} holds a corpus of other inputs or options (fingerprint "
                                  f"{existing.get('fingerprint')}, these give {fingerprint}); pass overwrite=True "
                                  "(--overwrite) to replace it")
    elif os.path.exists(output) and os.listdir(output):
        raise FileExistsError(f"{output=} exists, is not empty and holds no corpus manifest")

    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)
    tmp = f"{output.rstrip(os.sep)}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    writer = _ShardWriter(tmp, dtype, options.shard_tokens)
    skipped, replaced_docs, docs, tokens = 0, 0, 0, 0
    total = sum(i["size"] for i in fingerprints)
    try:
        with tqdm(total=total, unit="B", unit_scale=True, desc="tokenize", disable=not progress) as bar:
            batch: list[str] = []

            def encode(batch):
                nonlocal docs, tokens
                for doc in tokenizer.encode(batch):
                    writer.add(doc)
                    docs, tokens = docs + 1, tokens + doc.size

            for path in files:
                for where, text, replaced, size in _documents(path, options):
                    bar.update(size)
                    if not text:
                        if options.empty_documents == "error":
                            raise ValueError(f"{where}: empty document (pass empty_documents='skip', "
                                             "--empty-documents skip, to skip empty documents)")
                        skipped += 1
                        continue
                    replaced_docs += replaced
                    batch.append(text)
                    if len(batch) >= options.batch_documents:
                        encode(batch)
                        batch = []
            encode(batch)
        writer.flush()
        if docs == 0:
            raise ValueError(f"empty corpus: {len(files)} input file(s) hold no non-empty document "
                             f"({skipped} empty skipped), e.g. {files[0]}")
        manifest = {
            "format": FORMAT, "fingerprint": fingerprint,
            "tokenizer": {"kind": "bytes" if options.tokenizer == "bytes" else "hf",
                          "path": None if options.tokenizer == "bytes" else os.path.abspath(options.tokenizer),
                          "sha256": tokenizer.sha256},
            "vocab_size": tokenizer.vocab_size, "dtype": dtype.name, "num_documents": docs, "num_tokens": tokens,
            "num_bytes": total, "skipped_empty_documents": skipped, "replaced_documents": replaced_docs,
            "options": dataclasses.asdict(options), "inputs": fingerprints, "shards": writer.shards,
        }
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
        if os.path.exists(output):
            shutil.rmtree(output)
        os.replace(tmp, output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest
