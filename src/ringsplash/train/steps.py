"""``train_steps``: the training loop and nothing else: one jitted step per batch, the next batch
drawn on the host while the device works, a ``StepInfo`` yielded after each step. Logging, the
NaN stop, checkpoints and progress are hooks (``train.hooks``) that ``fit`` runs on each."""

import dataclasses
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import optax

from ringsplash.model import Transformer
from ringsplash.train.feed import Feed
from ringsplash.train.state import TrainState


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """One step just taken: ``step`` is the number of steps done (1 after the first); ``metrics``
    are device arrays (reading one waits for the step: hooks read them only when they act);
    ``first`` / ``last``: the first step of this ``fit`` call (its time includes compilation) /
    the last one it will take."""

    step: int
    metrics: dict
    model: Transformer
    opt_state: optax.OptState
    data_seed: jax.Array
    first: bool
    last: bool

    @property
    def loss(self) -> jax.Array:
        return self.metrics["loss"]

    @property
    def state(self) -> TrainState:
        """The ``TrainState`` after this step (what a checkpoint of it saves)."""
        return TrainState(self.model, self.opt_state, jnp.asarray(self.step, jnp.int32), self.data_seed)


def train_steps(step_fn: Callable, state: TrainState, feed: Feed, end: int, *, key: jax.Array,
                hold: Callable[[StepInfo], bool] = lambda info: False) -> Iterator[StepInfo]:
    """Steps ``state.step + 1`` to ``end``: ``step_fn(model, opt_state, batch, fold_in(key, i))``
    on batch ``i`` of ``feed``. Batch ``i + 1`` is drawn while the device runs step ``i`` and before
    its ``StepInfo`` is yielded, except after a step ``hold`` is true for (a checkpoint saves the data
    iterator there, standing at the next batch): then it is drawn once the caller resumes the loop."""
    start = int(state.step)
    model, opt_state = state.model, state.opt_state
    batch = feed.draw(start) if start < end else None
    for i in range(start, end):
        model, opt_state, metrics = step_fn(model, opt_state, batch, jax.random.fold_in(key, i))
        info = StepInfo(i + 1, metrics, model, opt_state, state.data_seed, first=i == start, last=i + 1 == end)
        held = info.last or hold(info)
        if not held:  # build the next batch on the host while the device works
            batch = feed.draw(i + 1)
        yield info
        if held and not info.last:
            batch = feed.draw(i + 1)
