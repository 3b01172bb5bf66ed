"""``DataStream``: a deterministic function of ``(seed, step)``: the "data RNG state" a checkpoint
stores is just the next step, so a resumed run sees exactly the same batches. It is a
``BatchSource`` (``ringsplash.data.source``), as the ``Loader`` is."""

import dataclasses
from collections.abc import Callable, Sequence
from typing import ClassVar

import numpy as np

from ringsplash._internal.scalar_checks import as_scalar, check_bool, check_int, check_positive_int, plain_fields
from ringsplash.data.batch import Batch


@dataclasses.dataclass(frozen=True)
class DataStream:
    """``batch(step)`` is a pure function of ``(seed, step)`` (so resuming is exact).

    ``make(rng, batch_size, step) -> Batch`` draws rows from a fresh ``np.random.Generator``
    (``step`` allows curricula):

    * ``per_row=False``: batch ``step`` is one draw ``make(rng(seed, step), batch_size, step)``;
      its rows depend on each other, so asking for some rows draws them all first;
    * ``per_row=True``: row ``r`` of batch ``step`` is its own draw
      ``make(rng(seed, step, r), 1, step)``, so any subset of rows is drawn without touching
      the others: a process of a multi-host run reads only the rows its devices hold.
    """

    make: Callable[[np.random.Generator, int, int], Batch]
    batch_size: int
    seed: int = 0
    per_row: bool = False

    #: the checkpoint's step is the whole position (``BatchSource``): no iterator state is saved
    stateful: ClassVar[bool] = False

    @property
    def seq_len(self) -> None:
        """Unknown until drawn (``make`` decides): ``fit`` checks each batch as it draws it."""
        return None

    @property
    def vocab_size(self) -> None:
        return None

    def __post_init__(self):
        plain_fields(self)  # NumPy / JAX scalars as Python numbers
        if not callable(self.make):
            raise TypeError(f"make must be a function make(rng, batch_size, step) -> Batch, got {self.make!r}")
        check_positive_int("batch_size", self.batch_size)  # 0 was taken: empty batches
        check_int("seed", self.seed, minimum=0)  # 1.5 was taken (int() at each draw)
        check_bool("per_row", self.per_row)

    def batch(self, step: int, rows: Sequence[int] | np.ndarray | None = None) -> Batch:
        """Batch ``step``, or only its rows ``rows`` (global row indices, in that order)."""
        step = check_int("step", as_scalar(step), minimum=0)  # 1.5 was batch 1
        if rows is None:
            rows = range(self.batch_size)
        rows = [check_int(f"rows[{i}]", as_scalar(r)) for i, r in enumerate(rows)]  # 1.5 was row 1
        bad = [r for r in rows if not 0 <= r < self.batch_size]
        if bad:
            raise ValueError(f"rows must be in [0, batch_size={self.batch_size}), got {bad}")
        if not self.per_row:
            full = self.make(np.random.default_rng([int(self.seed), int(step)]), self.batch_size, int(step))
            return full if rows == list(range(self.batch_size)) else Batch(*(np.asarray(x)[rows] for x in full))
        draws = [self.make(np.random.default_rng([int(self.seed), int(step), r]), 1, int(step)) for r in rows]
        return Batch(*(np.concatenate(field) for field in zip(*draws, strict=True)))

    def iterator(self, rows: Sequence[int] | np.ndarray, step: int = 0) -> "StepBatches":
        """Rows ``rows`` of batches ``step``, ``step + 1``, ... (``batch(step, rows)`` each)."""
        return StepBatches(self, [int(r) for r in rows], step)

    def describe(self) -> None:
        """Nothing beyond the seed (which a run's config holds anyway)."""
        return None

    def verify_sources(self) -> None:
        """Nothing on disk to check."""


class StepBatches:
    """A ``DataStream``'s batches (rows ``rows`` of each) from step ``step`` on, with the state
    protocol of Grain's iterators (``{"next_index": step}``)."""

    def __init__(self, stream: DataStream, rows: list[int], step: int):
        self.stream, self.rows, self.step = stream, rows, int(step)

    def __iter__(self) -> "StepBatches":
        return self

    def __next__(self) -> Batch:
        batch = self.stream.batch(self.step, rows=self.rows)
        self.step += 1
        return batch

    def get_state(self) -> dict:
        return {"next_index": self.step}

    def set_state(self, state: dict) -> None:
        self.step = int(state["next_index"])


def heldout_stream(stream: DataStream) -> DataStream:
    """A stream whose seeds never meet the training stream's (a held-out set)."""
    return dataclasses.replace(stream, seed=stream.seed + 1_000_003)
