"""``Feed``: a run's batches on the mesh from any ``data.BatchSource`` (a ``DataStream`` or a
``Loader``): each process reads only its rows, through the source's iterator, whose position a
checkpoint saves when the source is ``stateful``; ``check_source`` checks a source against the
model and the run before any work."""

import jax

from ringsplash import checkpoints
from ringsplash.data import Batch, BatchSource, check_token_ids
from ringsplash.model import TransformerConfig
from ringsplash.train.batches import place_rows, process_rows
from ringsplash.train.config import TrainConfig


def check_source(source: BatchSource, model_config: TransformerConfig, tc: TrainConfig) -> None:
    """A source whose rows promise a length and a vocabulary (a ``Loader``) fits the model and
    the run (before any work); a ``DataStream`` promises neither: its batches are checked as drawn."""
    if source.seq_len is None:
        return
    if source.seq_len != model_config.max_seq_len:
        raise ValueError(f"the loader's seq_len={source.seq_len} must equal the model's "
                         f"max_seq_len={model_config.max_seq_len}")
    if source.batch_size != tc.batch_size:
        raise ValueError(f"the loader's batch_size={source.batch_size} must equal the train config's "
                         f"batch_size={tc.batch_size}")
    if source.vocab_size is not None and source.vocab_size > model_config.vocab_size:
        raise ValueError(f"the corpus {getattr(source, 'paths', '')} was tokenized with a vocabulary "
                         f"of {source.vocab_size} tokens; the model's vocab_size={model_config.vocab_size} is "
                         f"smaller (another tokenizer?)")


class Feed:
    """This process's batches of ``source`` from step ``start``, placed on ``mesh``.

    ``resumed_from``: the checkpoint directory of a resumed run: a ``stateful`` source's files
    are verified and its iterator is set to the state saved with checkpoint ``start``."""

    def __init__(self, source: BatchSource, start: int, mesh: jax.sharding.Mesh, model_config: TransformerConfig,
                 resumed_from: str | None = None):
        self.source, self.mesh, self.model_config = source, mesh, model_config
        self.rows = process_rows(mesh, source.batch_size)
        self.iterator = source.iterator(self.rows, start)
        self._before = None  # the iterator's state before its latest batch was drawn
        if resumed_from is not None and source.stateful:  # absent when the process count changed
            source.verify_sources()  # the shards are still the ones the manifests describe
            checkpoints.restore_data_iterator(resumed_from, start, self.iterator)

    def _at(self) -> int | None:
        return self.iterator.get_state().get("next_index")

    def draw(self, step: int) -> Batch:
        """Batch ``step`` (the iterator must stand there: raises otherwise, e.g. a restored state of
        another loader or Grain format)."""
        self._before = self.iterator.get_state()
        if (at := self._before.get("next_index")) != step:
            raise RuntimeError(f"the data iterator stands at batch {at}, the run at step {step}")
        local = next(self.iterator)
        if self.source.vocab_size is None:  # a promised vocabulary was checked up front (check_source)
            check_token_ids(local, self.model_config.vocab_size,
                            f"batch {step} of the data stream (seed {self.source.seed})")
        return place_rows(local, self.rows, self.source.batch_size, self.mesh, self.model_config)

    def iterator_at(self, step: int):
        """What a checkpoint of step ``step`` saves with the state: the iterator standing at batch
        ``step`` (a batch drawn ahead is put back), or ``None`` for a source that is not ``stateful``."""
        if not self.source.stateful:
            return None
        if self._at() == step + 1 and self._before is not None:  # batch ``step`` was drawn ahead
            self.iterator.set_state(self._before)
            self._before = None
        if (at := self._at()) != step:
            raise RuntimeError(f"the data iterator stands at batch {at}, the checkpoint is of step {step}")
        return self.iterator
