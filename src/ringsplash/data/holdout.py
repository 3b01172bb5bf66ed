"""Holding documents out by a stable hash: the same documents on every machine, in every run and in
any order. ``is_held_out(key)``: one document in ``HELD_OUT_EVERY``, by the CRC-32 of its key.

A key is whatever names a document stably. ``experiments/byte_lm.py``'s default corpus keys the
standard library's files by name; a tokenized corpus keys each document by its tokens
(``held_out_documents``), so the ``Loader``'s ``documents="train"`` never packs a document that
``documents="heldout"`` packs, and copies of one document fall on the same side.
"""

import zlib

import numpy as np

#: one document in this many is held out
HELD_OUT_EVERY = 10


def is_held_out(key: bytes) -> bool:
    """Whether the document named by ``key`` is held out (``crc32(key) % HELD_OUT_EVERY == 0``)."""
    return zlib.crc32(key) % HELD_OUT_EVERY == 0


def held_out_documents(corpus) -> np.ndarray:
    """bool ``[documents]``: which documents of a ``TokenizedCorpus`` are held out, each keyed by its
    token ids as little-endian uint32 (the same key whatever dtype the shards store). Reads every
    document once (memory-mapped; CRC-32 runs at GB/s)."""
    return np.fromiter((is_held_out(np.asarray(corpus[i], "<u4").tobytes()) for i in range(len(corpus))),
                       dtype=bool, count=len(corpus))
