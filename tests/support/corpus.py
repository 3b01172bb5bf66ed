"""Small tokenized corpora on disk for the data tests: random letters, one document a file."""

import os

import numpy as np

from ringsplash import data


def make_corpus(path: str, rng: np.random.Generator, n: int = 40, lo: int = 1, hi: int = 100,
                letters: str = "abcdefghijklmnopqrstuvwxyz") -> data.TokenizedCorpus:
    """A bytes corpus of ``n`` random documents of ``lo..hi-1`` letters at ``path``."""
    src = path + "_src"
    os.makedirs(src, exist_ok=True)
    alphabet = np.array(list(letters))
    for i in range(n):
        with open(os.path.join(src, f"{i:04d}.txt"), "w") as f:
            f.write("".join(rng.choice(alphabet, int(rng.integers(lo, hi)))))
    data.tokenize_corpus([src], path, progress=False)
    return data.TokenizedCorpus(path)


def documents_in_rows(loader: data.Loader, rows: int) -> set[bytes]:
    """The documents (their bytes) in the loader's global rows ``0..rows-1``, each whole in its row
    (documents shorter than a row, packed by first / best fit)."""
    seen = set()
    for g in range(rows):
        row = loader.row(g)
        for s in set(row.segment_ids.tolist()) - {0}:
            seen.add(row.tokens[row.segment_ids == s].astype(np.uint8).tobytes())
    return seen
