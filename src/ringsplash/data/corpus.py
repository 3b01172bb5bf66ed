"""``TokenizedCorpus``: a tokenized corpus on disk (written by ``ringsplash.data.tokenize``), read
memory-mapped.

Layout of a corpus directory::

    <dir>/manifest.json                  tokenizer, vocabulary size, counts, input fingerprints, shards
    <dir>/shard_00000.tokens.npy         every token of the shard's documents, concatenated (uint16 / uint32)
    <dir>/shard_00000.offsets.npy        int64 [documents + 1]: document d is tokens[offsets[d]:offsets[d + 1]]

Nothing is read into memory until a document is asked for; the document lengths (one int64
per document) are the only thing held.
"""

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


class TokenizedCorpus:
    """The documents of a tokenized corpus directory, memory-mapped: ``len(corpus)`` documents,
    ``corpus[i]`` the tokens of document ``i`` (a read-only numpy view), ``corpus.lengths``."""

    def __init__(self, path: str):
        self.path = path
        self.manifest = read_manifest(path)
        self.vocab_size = int(self.manifest["vocab_size"])
        self._tokens, offsets = [], []
        for shard in self.manifest["shards"]:
            self._tokens.append(np.load(os.path.join(path, shard["tokens"]), mmap_mode="r"))
            offsets.append(np.load(os.path.join(path, shard["offsets"])))
        self._offsets = offsets
        self.lengths = np.concatenate([np.diff(o) for o in offsets]) if offsets else np.zeros(0, np.int64)
        self._first = np.cumsum([0] + [len(o) - 1 for o in offsets])  # first document of each shard
        if len(self.lengths) != self.manifest["num_documents"]:
            raise ValueError(f"{path}: the shards hold {len(self.lengths)} documents, the manifest says "
                             f"{self.manifest['num_documents']}")

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < len(self):
            raise IndexError(f"document {i=} out of range for {len(self)} documents in {self.path}")
        s = int(np.searchsorted(self._first, i, side="right")) - 1
        o = self._offsets[s]
        j = i - int(self._first[s])
        return self._tokens[s][o[j] : o[j + 1]]

    @property
    def fingerprint(self) -> str:
        """The input fingerprint recorded at tokenization (same corpus, same fingerprint)."""
        return self.manifest["fingerprint"]
