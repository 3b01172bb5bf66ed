"""Teacher-forced scoring: next-token log-probabilities of a model on batches of token rows.

``Scorer(model)`` jits one program per row shape (rows right-padded to a multiple of
``pad_multiple``, so nearby lengths share one). The vocabulary projection runs over chunks of
positions, so ``[seq, vocab]`` float32 logits of a long row never exist at once. The model runs
as a single-device strategy (``reference`` / ``splash``; ``ringsplash.evals.model_io`` converts a
context-parallel model); under ``jit`` its arrays may live on any one device or be sharded.
"""

from collections.abc import Callable
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ringsplash._internal.types import Array, Float, Int
from ringsplash.model import Transformer

#: ``generate_fn(prompts [batch, len] int32 (right-padded), prompt_lengths [batch], max_new_tokens)
#: -> [batch, max_new_tokens]`` new token ids (e.g. ``rs.inference.generate`` with ``prompt_lengths``)
GenerateFn = Callable[[np.ndarray, np.ndarray, int], np.ndarray]


class TokenScores(NamedTuple):
    """Per-position teacher-forced scores of rows ``tokens [batch, seq]``: entry ``i`` scores the
    prediction of ``tokens[:, i + 1]`` from ``tokens[:, :i + 1]``."""

    logprob: np.ndarray  # float32 [batch, seq - 1]
    correct: np.ndarray  # bool [batch, seq - 1]: the argmax is the next token


class Scorer:
    """Teacher-forced scores of ``model`` (positions ``0..seq-1``, one document per row)."""

    def __init__(self, model: Transformer, *, chunk: int = 2048, pad_multiple: int = 128):
        if not isinstance(model, Transformer):
            raise TypeError(f"model must be a ringsplash Transformer, got {type(model).__name__}")
        if chunk < 1 or pad_multiple < 1:
            raise ValueError(f"chunk={chunk} and pad_multiple={pad_multiple} must be >= 1")
        self.model, self.chunk, self.pad_multiple = model, chunk, pad_multiple
        self.config = model.config

    def check_rows(self, tokens: np.ndarray) -> np.ndarray:
        """``tokens`` as int32 ``[batch, seq]`` after checking the length and the ids against the model."""
        t = np.asarray(tokens)
        if t.ndim != 2 or not np.issubdtype(t.dtype, np.integer):
            raise ValueError(f"tokens must be int [batch, seq], got dtype {t.dtype} shape {t.shape}")
        c = self.config
        if t.shape[1] > c.max_seq_len:
            raise ValueError(f"rows of {t.shape[1]} tokens do not fit the model's max_seq_len={c.max_seq_len}: "
                             f"evaluate at lengths <= {c.max_seq_len} (or load the model with a larger max_seq_len)")
        if t.size and (t.min() < 0 or t.max() >= c.vocab_size):
            raise ValueError(f"token ids must be in [0, vocab_size={c.vocab_size}), got ids in [{t.min()}, {t.max()}]: "
                             f"is the tokenizer the model's?")
        return t.astype(np.int32)

    def _padded(self, t: np.ndarray) -> np.ndarray:
        """Right-padded (token 0) to a multiple of ``pad_multiple`` (at most ``max_seq_len``), so rows of
        nearby lengths share one compiled program; causal attention keeps earlier positions unchanged."""
        n = min(-(-t.shape[1] // self.pad_multiple) * self.pad_multiple, self.config.max_seq_len)
        return np.pad(t, ((0, 0), (0, n - t.shape[1]))) if n > t.shape[1] else t

    def token_scores(self, tokens: np.ndarray) -> TokenScores:
        t = self.check_rows(tokens)
        lp, ok = jax.device_get(_token_scores(self.model, jnp.asarray(self._padded(t)), self.chunk))
        n = t.shape[1] - 1
        return TokenScores(np.asarray(lp, np.float32)[:, :n], np.asarray(ok, bool)[:, :n])

    def logprobs_at(self, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """float32 ``[batch, k, vocab]``: the next-token log-distribution at ``positions [batch, k]``."""
        t = self.check_rows(tokens)
        q = np.asarray(positions, np.int32)
        if q.ndim != 2 or q.shape[0] != t.shape[0] or q.min() < 0 or q.max() >= t.shape[1]:
            raise ValueError(f"positions must be int [batch={t.shape[0]}, k] in [0, {t.shape[1]}), got shape "
                             f"{q.shape} range [{q.min()}, {q.max()}]")
        return np.asarray(jax.device_get(_logprobs_at(self.model, jnp.asarray(self._padded(t)),
                                                           jnp.asarray(q))))


def _hidden(model: Transformer, tokens: Int[Array, "batch seq"]) -> Float[Array, "batch seq d_model"]:
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)
    return jax.vmap(lambda t: model.hidden(t, positions))(tokens)


# module-level jits keyed by the model's structure and config (its arrays are traced): scorers of
# models of one config, e.g. a checkpoint before and after finetuning, share their compiled programs
@eqx.filter_jit
def _token_scores(model: Transformer, tokens: Int[Array, "batch seq"], chunk: int):
    h = _hidden(model, tokens)[:, :-1]
    targets = tokens[:, 1:]
    n = targets.shape[1]
    lps, oks = [], []
    for s in range(0, n, chunk):  # static chunks: one [batch, chunk, vocab] block of logits at a time
        logits = model.logits(h[:, s:s + chunk])
        y = targets[:, s:s + chunk]
        logz = jax.nn.logsumexp(logits, axis=-1)
        lps.append(jnp.take_along_axis(logits, y[..., None], axis=-1)[..., 0] - logz)
        oks.append(jnp.argmax(logits, axis=-1) == y)
    return jnp.concatenate(lps, axis=1), jnp.concatenate(oks, axis=1)


@eqx.filter_jit
def _logprobs_at(model: Transformer, tokens: Int[Array, "batch seq"], positions: Int[Array, "batch k"]):
    h = _hidden(model, tokens)
    picked = jnp.take_along_axis(h, positions[..., None], axis=1)
    return jax.nn.log_softmax(model.logits(picked), axis=-1)


__all__ = ["GenerateFn", "Scorer", "TokenScores"]
