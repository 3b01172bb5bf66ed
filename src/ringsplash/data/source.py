"""``BatchSource``: what ``train.fit`` (and ``evaluate``) draw batches from, the one protocol that
``DataStream`` (batches as a pure function of ``(seed, step)``) and ``Loader`` (tokenized corpora
through Grain) both implement, so the trainer never asks which one it holds."""

from collections.abc import Sequence
from typing import ClassVar, Protocol, runtime_checkable

import numpy as np

from ringsplash.data.batch import Batch


@runtime_checkable
class BatchIterator(Protocol):
    """One process's batches (some rows of each), ascending steps; its position is a small JSON
    dict, ``{"next_index": step}`` (Grain's ``DatasetIterator`` state)."""

    def __next__(self) -> Batch: ...

    def get_state(self) -> dict: ...

    def set_state(self, state: dict) -> None: ...


@runtime_checkable
class BatchSource(Protocol):
    """Batches of ``batch_size`` rows, batch ``step`` a pure function of ``(seed, step)``.

    * ``batch(step, rows)``: batch ``step`` or only its rows ``rows`` (global row indices);
    * ``iterator(rows, step)``: the batches of rows ``rows`` only (what one process reads) from
      ``step`` on, a ``BatchIterator``;
    * ``stateful``: whether the iterator's state goes into every checkpoint and is restored with it
      (a ``Loader``'s Grain iterator); otherwise the checkpoint's step is the whole position;
    * ``seq_len`` / ``vocab_size``: what every row promises (checked once, before any work), or
      ``None`` (a ``DataStream``: its ``make`` decides, so each batch is checked as it is drawn);
    * ``describe()``: what makes the batches, part of a run's config (``None``: the seed says it all);
    * ``verify_sources()``: check the files behind the batches before a run resumes (raises).
    """

    stateful: ClassVar[bool]

    @property
    def batch_size(self) -> int: ...

    @property
    def seed(self) -> int: ...

    @property
    def seq_len(self) -> int | None: ...

    @property
    def vocab_size(self) -> int | None: ...

    def batch(self, step: int, rows: Sequence[int] | np.ndarray | None = None) -> Batch: ...

    def iterator(self, rows: Sequence[int] | np.ndarray, step: int = 0) -> BatchIterator: ...

    def describe(self) -> dict | None: ...

    def verify_sources(self) -> None: ...
