"""``TokenizedCorpus``: a tokenized corpus on disk (written by ``ringsplash.data.tokenize``), read
memory-mapped.

Layout of a corpus directory::

    <dir>/manifest.json                  tokenizer, vocabulary size, counts, input fingerprints, shards
    <dir>/shard_00000.tokens.npy         every token of the shard's documents, concatenated (uint16 / uint32)
    <dir>/shard_00000.offsets.npy        int64 [documents + 1]: document d is tokens[offsets[d]:offsets[d + 1]]

Nothing is read into memory until a document is asked for; the document lengths (one int64
per document) are the only thing held.

Checks (a damaged or edited corpus is refused naming the file, never packed into other batches):

* **At open**, each shard's offsets against its tokens (1-D, starting at 0, never decreasing,
  ending at the token count; the manifest's document and token counts), and each shard file
  against the fingerprint the manifest records of it: its size and a hash of
  ``SAMPLE_CHUNKS`` chunks of ``SAMPLE_BYTES`` spread over the file (the whole file when it is
  smaller). That reads 64 KiB per file whatever its size, so opening stays cheap.
* **When a run resumes** (``TokenizedCorpus.verify``, which ``fit`` calls through
  ``Loader.verify_sources``), also the modification time: a file whose mtime differs from the
  manifest's was written since tokenization (an edit in place, or a copy) and is hashed whole
  against the manifest's sha256. A copy reads the corpus once per resume and passes; an edit
  is refused. Hashing every shard on every resume would read the whole corpus (minutes for
  hundreds of GB), and sampling alone misses a same-length edit between the samples; an mtime
  restored by hand after an edit outside the samples is the one case not caught.
* **When tokens are read** (``check_document``, by the loader for every row it packs), every id
  against the manifest's ``vocab_size``: corruption the checks above cannot see (a corpus whose
  manifest was written after the damage) never reaches the model as a clamped id.

Manifests written before shard fingerprints were recorded skip the fingerprint checks.
"""

import hashlib
import json
import os

import numpy as np

FORMAT = "ringsplash.corpus/1"
MANIFEST = "manifest.json"


def read_manifest(path: str) -> dict:
    """The manifest of the corpus directory ``path`` (a clear error if it is not one)."""
    file = os.path.join(path, MANIFEST)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{path=} is not a tokenized corpus: no {MANIFEST} (write one with "
                                "scripts/tokenize_corpus.py or ringsplash.data.tokenize_corpus)")
    with open(file) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{file} has format={manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


SAMPLE_CHUNKS = 16  # chunks hashed per shard file at open (evenly spread, first and last included)
SAMPLE_BYTES = 4096  # bytes per chunk


class CorpusChangedError(ValueError):
    """A corpus whose shard files no longer match what its manifest records of them (edited,
    truncated or replaced after tokenization); the message names the file."""


def file_fingerprint(file: str, *, full: bool = True) -> dict:
    """What a manifest records of a shard file: ``size``, ``mtime_ns``, ``sample`` (a hash of the
    size and of ``SAMPLE_CHUNKS`` chunks of ``SAMPLE_BYTES`` spread over the file, or of all of it
    when smaller) and, with ``full``, the ``sha256`` of the whole file."""
    st = os.stat(file)
    size = st.st_size
    h = hashlib.sha256(str(size).encode())
    with open(file, "rb") as f:
        if size <= SAMPLE_CHUNKS * SAMPLE_BYTES:
            h.update(f.read())
        else:
            for k in range(SAMPLE_CHUNKS):
                f.seek((size - SAMPLE_BYTES) * k // (SAMPLE_CHUNKS - 1))
                h.update(f.read(SAMPLE_BYTES))
    out = {"size": size, "mtime_ns": st.st_mtime_ns, "sample": h.hexdigest()[:32]}
    if full:
        out["sha256"] = file_sha256(file)
    return out


def file_sha256(file: str) -> str:
    """sha256 of a file's bytes, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _load(file: str, **kw) -> np.ndarray:
    """``np.load`` naming the file when it is missing or not a readable .npy array."""
    try:
        return np.load(file, **kw)
    except FileNotFoundError:
        raise FileNotFoundError(f"corpus shard file {file} is missing (the manifest lists it)") from None
    except (ValueError, OSError, EOFError) as err:
        raise ValueError(f"corpus shard file {file} cannot be read as a .npy array ({type(err).__name__}: "
                         f"{err}); it is truncated or corrupt: re-tokenize the corpus") from None


def _check_shard(tokens_file: str, offsets_file: str, tokens: np.ndarray, offsets: np.ndarray, shard: dict) -> None:
    """The offsets of a shard against its tokens and the manifest's counts (before any packing)."""
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"{tokens_file}: expected a 1-D array of integer token ids, got shape {tokens.shape} "
                         f"dtype {tokens.dtype}")
    if offsets.ndim != 1 or not np.issubdtype(offsets.dtype, np.integer) or len(offsets) < 1:
        raise ValueError(f"{offsets_file}: expected a 1-D integer array of document offsets [documents + 1], got "
                         f"shape {offsets.shape} dtype {offsets.dtype}")
    where = f"{offsets_file}: the document offsets do not fit {tokens_file} ({len(tokens)} tokens)"
    if offsets[0] != 0:
        raise ValueError(f"{where}: expected offsets[0] == 0, got {int(offsets[0])}")
    step = np.diff(offsets)
    if (step < 0).any():
        d = int(np.flatnonzero(step < 0)[0])
        raise ValueError(f"{where}: expected non-decreasing offsets, got offsets[{d}]={int(offsets[d])} > "
                         f"offsets[{d + 1}]={int(offsets[d + 1])}")
    if offsets[-1] != len(tokens):
        raise ValueError(f"{where}: expected the last offset to equal the token count {len(tokens)}, got "
                         f"{int(offsets[-1])}")
    if "documents" in shard and len(offsets) - 1 != shard["documents"]:
        raise ValueError(f"{where}: it holds {len(offsets) - 1} documents, the manifest says {shard['documents']}")
    if "num_tokens" in shard and len(tokens) != shard["num_tokens"]:
        raise ValueError(f"{tokens_file}: holds {len(tokens)} tokens, the manifest says {shard['num_tokens']}")


class TokenizedCorpus:
    """The documents of a tokenized corpus directory, memory-mapped: ``len(corpus)`` documents,
    ``corpus[i]`` the tokens of document ``i`` (a read-only numpy view), ``corpus.lengths``.
    Opening checks the shards (see the module doc)."""

    def __init__(self, path: str):
        self.path = path
        self.manifest = read_manifest(path)
        self.vocab_size = int(self.manifest["vocab_size"])
        self._tokens, offsets, self._files = [], [], []
        for shard in self.manifest["shards"]:
            tokens_file, offsets_file = (os.path.join(path, shard[k]) for k in ("tokens", "offsets"))
            tokens, offs = _load(tokens_file, mmap_mode="r"), _load(offsets_file)
            _check_shard(tokens_file, offsets_file, tokens, offs, shard)
            self._tokens.append(tokens)
            offsets.append(offs.astype(np.int64, copy=False))
            self._files.append((tokens_file, offsets_file))
        self._offsets = offsets
        self.lengths = np.concatenate([np.diff(o) for o in offsets]) if offsets else np.zeros(0, np.int64)
        self._first = np.cumsum([0] + [len(o) - 1 for o in offsets])  # first document of each shard
        if len(self.lengths) != self.manifest["num_documents"]:
            raise ValueError(f"{path}: the shards hold {len(self.lengths)} documents, the manifest says "
                             f"{self.manifest['num_documents']}")
        self.verify(thorough=False)

    def __len__(self) -> int:
        return len(self.lengths)

    def _locate(self, i: int) -> tuple[int, int]:
        s = int(np.searchsorted(self._first, i, side="right")) - 1
        return s, i - int(self._first[s])

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < len(self):
            raise IndexError(f"document {i=} out of range for {len(self)} documents in {self.path}")
        s, j = self._locate(i)
        o = self._offsets[s]
        return self._tokens[s][o[j] : o[j + 1]]

    def check_document(self, i: int, start: int, tokens: np.ndarray) -> None:
        """Refuse ``tokens`` (read from document ``i`` at ``start``) if an id is outside the
        vocabulary the manifest records, naming the shard file and the offending id."""
        tokens = np.asarray(tokens)
        bad = tokens >= self.vocab_size
        if bad.any():
            k = int(np.argmax(bad))
            s, j = self._locate(i)
            raise ValueError(
                f"{self._files[s][0]}: token id {int(tokens[k])} (document {i}, token {start + k}, file offset "
                f"{int(self._offsets[s][j]) + start + k}) is outside the corpus vocabulary [0, vocab_size="
                f"{self.vocab_size}) of {os.path.join(self.path, MANIFEST)}: the shard is corrupt or was written "
                "by another tokenizer; re-tokenize the corpus")

    def verify(self, *, thorough: bool = True, full: bool = False) -> None:
        """Check every shard file against the fingerprint its manifest records (size and sampled
        chunks; ``thorough``: a file whose mtime changed is hashed whole; ``full``: every file is);
        raise ``CorpusChangedError`` naming the first that differs. A no-op for manifests that
        record no fingerprints."""
        for shard, files in zip(self.manifest["shards"], self._files):
            for key, file in zip(("tokens", "offsets"), files):
                want = shard.get("files", {}).get(key)
                if want is None:
                    continue
                got = file_fingerprint(file, full=False)
                for what in ("size", "sample"):
                    if got[what] != want[what]:
                        self._changed(file, what, want[what], got[what])
                if full or (thorough and got["mtime_ns"] != want["mtime_ns"]):
                    sha = file_sha256(file)
                    if sha != want["sha256"]:
                        self._changed(file, "sha256", want["sha256"], sha)

    def _changed(self, file: str, what: str, want, got) -> None:
        raise CorpusChangedError(
            f"{file} was changed after tokenization: its {what} is {got}, the manifest "
            f"{os.path.join(self.path, MANIFEST)} records {want}. Its documents are no longer the ones the "
            "manifest describes (a run resumed on it would read other batches); restore the file, or "
            "re-tokenize (overwrite=True, --overwrite) and start a new run")

    @property
    def fingerprint(self) -> str:
        """The input fingerprint recorded at tokenization (same corpus, same fingerprint)."""
        return self.manifest["fingerprint"]
