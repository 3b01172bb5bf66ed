"""``Batch``: the record every data source hands the trainer, host side (numpy).

Every field is ``[batch, seq]`` in original token order; the trainer applies the ring layout.
"""

from typing import NamedTuple

import numpy as np


class Batch(NamedTuple):
    tokens: np.ndarray  # int32 [batch, seq]
    labels: np.ndarray  # int32 [batch, seq]: the token to predict at each position
    loss_mask: np.ndarray  # float32 [batch, seq]: 1 where the prediction is scored
    positions: np.ndarray  # int32 [batch, seq]: RoPE positions (within the document)
    segment_ids: np.ndarray  # int32 [batch, seq]: document id of each token


def check_token_ids(tokens, vocab_size: int, where: str) -> None:
    """Refuse token ids outside ``[0, vocab_size)``: an embedding lookup under ``jit`` clamps them
    silently (the run trains on other tokens, or turns NaN and seems to blame the learning rate).

    ``tokens``: any integer array. Concrete (numpy, or a ``Batch``: its tokens and labels are
    checked) raises a ``ValueError`` naming the first offending id, its place, ``vocab_size`` and
    ``where`` the batch came from. Traced (inside ``jit``): a ``checkify`` check, reported by a
    function wrapped in ``jax.experimental.checkify.checkify`` (and an error otherwise: an
    unwrapped ``checkify.check`` refuses to trace)."""
    if isinstance(tokens, Batch):
        for name in ("tokens", "labels"):
            check_token_ids(getattr(tokens, name), vocab_size, f"{where}, {name}")
        return
    import jax

    if isinstance(tokens, jax.core.Tracer):
        import jax.numpy as jnp
        from jax.experimental import checkify

        bad = (tokens < 0) | (tokens >= vocab_size)
        first = jnp.argmax(bad.reshape(-1))
        checkify.check(~jnp.any(bad), f"{where}: token id {{id}} (flat index {{at}}) is outside the vocabulary "
                       f"[0, {vocab_size=})", id=tokens.reshape(-1)[first], at=first)
        return
    tokens = np.asarray(tokens)
    if not np.issubdtype(tokens.dtype, np.integer):
        raise TypeError(f"{where}: token ids must be integers, got dtype {tokens.dtype}")
    bad = (tokens < 0) | (tokens >= vocab_size)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{where}: token id {int(tokens[at])} at index {at} is outside the vocabulary "
                         f"[0, {vocab_size=}) ({int(bad.sum())} such ids); an embedding would clamp it silently. "
                         "Was the data made with another tokenizer, or is the model's vocab_size too small?")
