"""Data: the ``Batch`` record, tokenized corpora on disk, the Grain loader that packs documents
(segment ids, mixtures, process-local rows, resumable state), and the synthetic tasks.

* ``batch.py`` — ``Batch`` (tokens, labels, loss mask, positions, segment ids; ``[batch, seq]``).
* ``source.py`` — ``BatchSource``: the protocol ``DataStream`` and ``Loader`` implement (what ``fit`` draws from).
* ``stream.py`` — ``DataStream``: batches as a pure function of ``(seed, step)``.
* ``synthetic.py`` — the recall task, ``pack_documents`` of in-memory documents.
* ``tokenize.py`` / ``corpus.py`` — ``tokenize_corpus`` writes, ``TokenizedCorpus`` reads (memory-mapped).
* ``packing.py`` — packing plans (concat-and-split, first fit, best fit) and packed rows.
* ``loader.py`` — ``Loader``: packed, shuffled, mixed batches of tokenized corpora through Grain.
* ``holdout.py`` — ``is_held_out``: one document in ten held out by a stable hash (of its name, or of its tokens).

``tokenize_corpus`` needs ``tokenizers`` for Hugging Face tokenizers (the ``data`` extra,
``pip install -e ".[data]"``), imported only when used; ``Loader`` reads through ``grain``, a
core dependency.
"""

from ringsplash.data.batch import Batch, check_token_ids
from ringsplash.data.corpus import CorpusChangedError, TokenizedCorpus, read_manifest
from ringsplash.data.holdout import HELD_OUT_EVERY, held_out_documents, is_held_out
from ringsplash.data.loader import Loader, LoaderConfig
from ringsplash.data.packing import PackPlan, pack_row, plan_packing
from ringsplash.data.source import BatchIterator, BatchSource
from ringsplash.data.stream import DataStream, heldout_stream
from ringsplash.data.synthetic import RecallTask, pack_documents, recall_batch
from ringsplash.data.tokenize import TokenizeOptions, input_files, tokenize_corpus

__all__ = [
    "HELD_OUT_EVERY",
    "Batch",
    "BatchIterator",
    "BatchSource",
    "CorpusChangedError",
    "DataStream",
    "Loader",
    "LoaderConfig",
    "PackPlan",
    "RecallTask",
    "TokenizeOptions",
    "TokenizedCorpus",
    "check_token_ids",
    "held_out_documents",
    "heldout_stream",
    "input_files",
    "is_held_out",
    "pack_documents",
    "pack_row",
    "plan_packing",
    "read_manifest",
    "recall_batch",
    "tokenize_corpus",
]
