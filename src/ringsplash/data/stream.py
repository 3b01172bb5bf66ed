"""``DataStream``: a deterministic function of ``(seed, step)``: the "data RNG state" a checkpoint
stores is just the next step, so a resumed run sees exactly the same batches."""

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

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

    def batch(self, step: int, rows: Sequence[int] | np.ndarray | None = None) -> Batch:
        """Batch ``step``, or only its rows ``rows`` (global row indices, in that order)."""
        if rows is None:
            rows = range(self.batch_size)
        rows = [int(r) for r in rows]
        bad = [r for r in rows if not 0 <= r < self.batch_size]
        if bad:
            raise ValueError(f"rows must be in [0, batch_size={self.batch_size}), got {bad}")
        if not self.per_row:
            full = self.make(np.random.default_rng([int(self.seed), int(step)]), self.batch_size, int(step))
            return full if rows == list(range(self.batch_size)) else Batch(*(np.asarray(x)[rows] for x in full))
        draws = [self.make(np.random.default_rng([int(self.seed), int(step), r]), 1, int(step)) for r in rows]
        return Batch(*(np.concatenate(field) for field in zip(*draws, strict=True)))


def heldout_stream(stream: DataStream) -> DataStream:
    """A stream whose seeds never meet the training stream's (a held-out set)."""
    return dataclasses.replace(stream, seed=stream.seed + 1_000_003)
