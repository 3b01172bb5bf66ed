"""``Loader``: tokenized corpora → packed training batches, with Grain (``grain`` on PyPI).

Each source (a ``TokenizedCorpus`` directory) is packed once, from its document lengths, into
rows of ``seq_len`` (``ringsplash.data.packing``; documents taken in an order shuffled by the
seed); its rows, in a new seeded order every epoch, repeated forever, are a Grain data source.
Several sources are mixed with ``MapDataset.mix``: a deterministic interleave in the ratio of
the weights (in every window of rows the count of each source is within one of its share).
``documents`` packs every document of a source, all but its held-out share (``"train"``) or only
that share (``"heldout"``): one in ten, by a hash of each document's tokens (``data.holdout``), so
one corpus gives a training set and a held-out set that never share a document.

Global row ``g`` (row ``r`` of batch ``step``: ``g = step * batch_size + r``) is a pure function
of ``(seed, g)``: random access, so

* ``batch(step, rows)`` draws any rows of any batch (the ``BatchSource`` protocol,
  ``ringsplash.data.source``, that ``fit``, ``stream_batch`` and ``evaluate`` use);
* ``iterator(rows, step)`` is this process's Grain ``DatasetIterator``: the batches of rows
  ``rows`` only (a process reads only the rows its devices hold) from ``step`` on, read by
  ``num_threads`` background threads ``prefetch`` batches ahead. Its state
  (``get_state()``, a small JSON dict) is what ``fit`` saves with each checkpoint, one file
  per process (Grain's orbax handler), and restores with ``set_state``.

Every row is checked on the way out: a token id outside the corpus vocabulary (a corrupt
shard) raises naming the shard file and the document (``TokenizedCorpus.check_document``).
"""

import dataclasses
import functools
import threading
from collections.abc import Sequence
from typing import ClassVar, Literal

import numpy as np

from ringsplash._internal.optional import require
from ringsplash._internal.scalar_checks import check_float, check_int, check_positive_int, plain_fields
from ringsplash.data.batch import Batch
from ringsplash.data.corpus import TokenizedCorpus
from ringsplash.data.holdout import HELD_OUT_EVERY, held_out_documents
from ringsplash.data.packing import LONG_DOCUMENTS, POLICIES, LongDocuments, PackingPolicy, pack_row, plan_packing

#: which documents of each source the loader packs: every one, all but the held-out share, or only that
#: share (``ringsplash.data.holdout``: one in ``HELD_OUT_EVERY`` by a hash of each document's tokens)
Documents = Literal["all", "train", "heldout"]
DOCUMENTS = ("all", "train", "heldout")
#: ``LoaderConfig.seed`` is in ``[0, SEED_LIMIT)`` (Grain's index sampler takes a 32-bit seed)
SEED_LIMIT = 2**31


@dataclasses.dataclass(frozen=True)
class LoaderConfig:
    """How documents become batches."""

    seq_len: int  # tokens per row
    batch_size: int  # global rows per batch
    seed: int = 0  # document order, row shuffles (every epoch)
    packing: PackingPolicy = "best_fit"  # concat_split | first_fit | best_fit (ringsplash.data.packing)
    long_documents: LongDocuments = "split"  # first / best fit: split | truncate | error
    weights: tuple[int | float, ...] | None = None  # mixture weight of each source; None = equal
    pad_id: int = 0  # token of padding (never scored)
    num_threads: int = 2  # background reader threads (Grain ReadOptions)
    prefetch: int = 4  # elements read ahead (Grain ReadOptions.prefetch_buffer_size)
    #: all | train (all but the held-out share) | heldout (only that share): one document in
    #: HELD_OUT_EVERY is held out, by a hash of its tokens (ringsplash.data.holdout)
    documents: Documents = "all"

    def __post_init__(self):
        plain_fields(self)  # NumPy / JAX scalars as Python numbers (np.int64 was refused as not an int)
        for name in ("seq_len", "batch_size", "num_threads", "prefetch"):  # bools refused (True was 1 row)
            check_positive_int(name, getattr(self, name))
        if self.seq_len < 2:
            raise ValueError(f"seq_len={self.seq_len} must be >= 2 (a token and its target)")
        if self.packing not in POLICIES:
            raise ValueError(f"packing={self.packing!r} must be one of {POLICIES}")
        if self.long_documents not in LONG_DOCUMENTS:
            raise ValueError(f"long_documents={self.long_documents!r} must be one of {LONG_DOCUMENTS}")
        if self.documents not in DOCUMENTS:
            raise ValueError(f"documents={self.documents!r} must be one of {DOCUMENTS}")
        if self.weights is not None:  # finite numbers > 0: inf, "2" and True were taken (float(w))
            if isinstance(self.weights, (str, bytes)) or not hasattr(self.weights, "__iter__"):
                raise TypeError(f"weights must be a sequence of positive numbers, one per source, got "
                                f"weights={self.weights!r}")
            weights = tuple(check_float(f"weights[{i}]", w, positive=True) for i, w in enumerate(self.weights))
            if not weights:
                raise ValueError(f"weights={self.weights!r} must be positive numbers, one per source")
            object.__setattr__(self, "weights", weights)
        check_int("pad_id", self.pad_id, minimum=0)  # a token id: 1.5 and "0" were kept
        if check_int("seed", self.seed, minimum=0) >= SEED_LIMIT:  # 1.5 and True were kept, "1" a raw TypeError
            raise ValueError(f"seed must be in [0, 2**31), got seed={self.seed!r}")


class _PackedRows:
    """The rows of one packed source, epoch after epoch, each epoch in its own seeded order: a
    Grain random-access data source of unbounded length (element ``i`` is row
    ``order(e)[i % rows]`` of epoch ``e = i // rows``).

    The epoch orders are numpy permutations (the last two cached) rather than Grain's
    ``shuffle``: its index shuffle measured ~1-7 ms per element on corpora of < 100 rows here."""

    def __init__(self, corpus: TokenizedCorpus, config: LoaderConfig, index: int):
        self.corpus, self.seq_len, self.pad_id = corpus, config.seq_len, config.pad_id
        self.seed, self.index = config.seed, index
        #: the documents packed (ascending indices): every one, or one side of the held-out split
        self.documents = np.arange(len(corpus))
        if config.documents != "all":
            held_out = held_out_documents(corpus)
            self.documents = np.flatnonzero(held_out if config.documents == "heldout" else ~held_out)
            if not len(self.documents):
                side = "held out" if config.documents == "heldout" else "left once the held-out ones are taken out"
                raise ValueError(f"source {corpus.path}: none of its {len(corpus)} documents is {side} (documents="
                                 f"{config.documents!r}; one in {HELD_OUT_EVERY} is held out, by a hash of its tokens)")
        order = self.documents[np.random.default_rng([config.seed, index, 1]).permutation(len(self.documents))]
        self.plan = plan_packing(corpus.lengths, config.seq_len, config.packing,
                                 long_documents=config.long_documents, order=order)
        if self.plan.num_rows == 0:
            raise ValueError(f"source {corpus.path} packs into no rows")
        self._orders: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return 2**62

    def order(self, epoch: int) -> np.ndarray:
        with self._lock:
            if epoch not in self._orders:
                if len(self._orders) >= 2:
                    self._orders.pop(min(self._orders))
                rng = np.random.default_rng([self.seed, self.index, 2, epoch])
                self._orders[epoch] = rng.permutation(self.plan.num_rows)
            return self._orders[epoch]

    def __getitem__(self, i: int) -> Batch:
        epoch, k = divmod(int(i), self.plan.num_rows)
        row = int(self.order(epoch)[k])
        out = pack_row(self.corpus, self.corpus.lengths, self.plan, row, self.seq_len, self.pad_id)
        vocab = self.corpus.vocab_size
        if (out.tokens[out.segment_ids > 0] >= vocab).any() or (out.labels >= vocab).any():
            for p in range(self.plan.row_start[row], self.plan.row_start[row + 1]):  # name the document
                d, s, n = int(self.plan.doc[p]), int(self.plan.start[p]), int(self.plan.length[p])
                self.corpus.check_document(d, s, self.corpus[d][s : s + n + 1])
        return out


class _ProcessRows:
    """Element ``j`` is global row ``(j // len(rows)) * batch_size + rows[j % len(rows)]``: this
    process's rows of consecutive batches (a Grain data source)."""

    def __init__(self, rows_of, rows: np.ndarray, batch_size: int):
        self.rows_of, self.rows, self.batch_size = rows_of, np.asarray(rows, np.int64), batch_size

    def __len__(self) -> int:
        return 2**62

    def __getitem__(self, j: int) -> Batch:
        step, k = divmod(int(j), len(self.rows))
        return self.rows_of[step * self.batch_size + int(self.rows[k])][1]


def _tagged(k: int, row: Batch) -> tuple[int, Batch]:
    return k, row


def _grain():
    """Grain: a core dependency; an environment installed before it was one is told to reinstall."""
    return require("grain", extra=None, needed_for="ringsplash.data.Loader (tokenized corpora)")


def _stack(rows: Sequence[Batch]) -> Batch:
    return Batch(*(np.stack(field) for field in zip(*rows, strict=True)))


class Loader:
    """Packed batches of one or several tokenized corpora (see the module doc).

    ``Loader(paths, LoaderConfig(seq_len=..., batch_size=...))``; ``paths`` is one corpus
    directory or a sequence of them (mixed by ``config.weights``)."""

    def __init__(self, paths: str | Sequence[str], config: LoaderConfig):
        grain = _grain()

        self.paths = [paths] if isinstance(paths, str) else list(paths)
        if not self.paths:
            raise ValueError("paths must name at least one tokenized corpus directory")
        if config.weights is not None and len(config.weights) != len(self.paths):
            raise ValueError(f"weights={config.weights} must give one weight per source ({len(self.paths)} paths)")
        self.config = config
        self.corpora = [TokenizedCorpus(p) for p in self.paths]
        self.vocab_size = max(c.vocab_size for c in self.corpora)
        self.sources = [_PackedRows(c, config, k) for k, c in enumerate(self.corpora)]
        per_source = [grain.MapDataset.source(s).map(functools.partial(_tagged, k)) for k, s in enumerate(self.sources)]
        # element g: (source index, row g)
        self.dataset = per_source[0] if len(per_source) == 1 else grain.MapDataset.mix(per_source, config.weights)

    # the BatchSource protocol (ringsplash.data.source)
    #: the Grain iterator's state goes into every checkpoint and is restored with it
    stateful: ClassVar[bool] = True

    @property
    def batch_size(self) -> int:
        return self.config.batch_size

    @property
    def seed(self) -> int:
        return self.config.seed

    @property
    def seq_len(self) -> int:
        return self.config.seq_len

    def row(self, g: int) -> Batch:
        """Global row ``g`` (1-D fields)."""
        return self.dataset[int(g)][1]

    def batch(self, step: int, rows: Sequence[int] | np.ndarray | None = None) -> Batch:
        """Batch ``step``, or only its rows ``rows`` (global row indices, in that order)."""
        rows = range(self.batch_size) if rows is None else [int(r) for r in rows]
        bad = [r for r in rows if not 0 <= r < self.batch_size]
        if bad:
            raise ValueError(f"rows must be in [0, batch_size={self.batch_size}), got {bad}")
        return _stack([self.row(int(step) * self.batch_size + r) for r in rows])

    def source_of(self, g: int) -> int:
        """Which source global row ``g`` comes from (the mixture's choice)."""
        return self.dataset[int(g)][0]

    def iterator(self, rows: Sequence[int] | np.ndarray, step: int = 0):
        """This process's batches (rows ``rows`` of every batch, ascending steps) from ``step``: a
        Grain ``DatasetIterator`` reading ahead in background threads; ``get_state()`` /
        ``set_state()`` save and restore its position (``{"next_index": step}``)."""
        grain = _grain()

        rows = np.asarray(rows, np.int64)
        if rows.ndim != 1 or not len(rows) or rows.min() < 0 or rows.max() >= self.batch_size:
            raise ValueError(f"rows must be a non-empty list of rows in [0, batch_size={self.batch_size}), got {rows}")
        ds = grain.MapDataset.source(_ProcessRows(self.dataset, rows, self.batch_size))
        ds = ds.batch(len(rows), batch_fn=_stack)
        options = grain.ReadOptions(num_threads=self.config.num_threads, prefetch_buffer_size=self.config.prefetch)
        it = ds.to_iter_dataset(options).__iter__()
        if step:
            state = it.get_state()
            if set(state) != {"next_index"}:
                raise RuntimeError(f"unexpected Grain iterator state {state} (grain version?)")
            it.set_state({"next_index": int(step)})
        return it

    def verify_sources(self) -> None:
        """Check every source's shard files against its manifest, mtimes included (a file written
        since tokenization is hashed whole): ``TokenizedCorpus.verify``. ``fit`` calls it when a
        run resumes; raises ``CorpusChangedError`` naming the file."""
        for corpus in self.corpora:
            corpus.verify(thorough=True)

    def describe(self) -> dict:
        """What makes the batches (sources by fingerprint, not path: a corpus may move; the config
        but its thread and prefetch counts, and ``documents`` when "all", as before it existed): a
        resumed run must match it."""
        return {"sources": [{"fingerprint": c.fingerprint, "vocab_size": c.vocab_size, "documents": len(c)}
                            for c in self.corpora],
                "config": {k: v for k, v in dataclasses.asdict(self.config).items()
                           if k not in ("num_threads", "prefetch") and not (k == "documents" and v == "all")}}
