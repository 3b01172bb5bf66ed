"""``generate``: prefill, then one jitted decode step per new token (compiled once per call's shapes
and sampling settings, never per token), with an optional progress bar."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from ringsplash._types import Array, Int
from ringsplash.inference.cache import KVCache
from ringsplash.inference.decode import decode_step
from ringsplash.inference.prefill import cache_multiple, check_prompts, prefill
from ringsplash.inference.sample import check_sampling, sample
from ringsplash.model import Transformer

#: how often (in steps) the loop checks whether every row has stopped (each check waits for the device)
STOP_CHECK_EVERY = 8


def generate(
    model: Transformer,
    prompts: Int[Array, "batch prompt_len"],
    max_new_tokens: int,
    *,
    prompt_lengths: Int[Array, " batch"] | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_tokens=(),
    key: jax.Array | None = None,
    mesh: Mesh | None = None,
    progress: bool = False,
) -> Int[Array, "batch max_new_tokens"]:
    """The next ``max_new_tokens`` tokens of each prompt, int32 ``[batch, max_new_tokens]``.

    Args:
        model: a ``Transformer`` (trained here or ``ringsplash.hf.load_hf``) with a causal mask.
        prompts: int ``[batch, prompt_len]``; row ``b``'s prompt is its first ``prompt_lengths[b]``
            tokens (None: all of them); the rest of the row is ignored.
        max_new_tokens: tokens to generate per row (>= 1).
        temperature: 0 (default) picks the most likely token (greedy); > 0 samples from
            ``softmax(logits / temperature)`` restricted by ``top_k`` / ``top_p``
            (``ringsplash.inference.filter_logits``), with ``key``.
        stop_tokens: token ids that end a row: once a row has produced one, the rest of the row
            repeats that stop token.
        key: a ``jax.random`` key, needed when ``temperature > 0`` (the same key, the same tokens).
        mesh: a mesh with a ``context`` axis: the KV cache (and the prefill forward pass) is sharded
            along the sequence over it, and each decode step merges the devices' partial attention.
        progress: show a progress bar over the generated tokens.
    """
    c = model.config
    check_sampling(temperature, top_k, top_p)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens=}")
    stop = tuple(int(t) for t in np.atleast_1d(np.asarray(stop_tokens, dtype=np.int64)))
    bad = [t for t in stop if not 0 <= t < c.vocab_size]
    if bad:
        raise ValueError(f"stop_tokens must be token ids in [0, vocab_size={c.vocab_size}), got {bad}")
    if temperature > 0 and key is None:
        raise ValueError("sampling (temperature > 0) needs key=<a jax.random key>")
    prompts, lengths = check_prompts(prompts, prompt_lengths, c.vocab_size)
    multiple = cache_multiple(c, mesh)
    max_len = -(-(prompts.shape[1] + max_new_tokens) // multiple) * multiple
    logits, cache = prefill(model, prompts, prompt_lengths=lengths, max_len=max_len, mesh=mesh)
    keys = jax.random.split(key if key is not None else jax.random.key(0), max_new_tokens)
    settings = dict(temperature=float(temperature), top_k=top_k, top_p=top_p, stop=stop)
    token = sample(logits, keys[0], temperature=float(temperature), top_k=top_k, top_p=top_p)
    done = jnp.isin(token, jnp.asarray(stop, jnp.int32)) if stop else jnp.zeros_like(token, bool)
    out = [token]
    from tqdm.auto import tqdm

    with tqdm(total=max_new_tokens, initial=1, desc="generate", unit="tok", disable=not progress) as bar:
        for i in range(1, max_new_tokens):
            if stop and i % STOP_CHECK_EVERY == 0 and bool(done.all()):
                out.extend([token] * (max_new_tokens - i))  # every row repeats its stop token
                bar.update(max_new_tokens - i)
                break
            token, cache, done = _step(model, cache, token, done, keys[i], **settings)
            out.append(token)
            bar.update(1)
    return jnp.stack(out, axis=1)


@functools.partial(jax.jit, static_argnames=("temperature", "top_k", "top_p", "stop"), donate_argnums=(1,))
def _step(model: Transformer, cache: KVCache, token, done, key, *, temperature, top_k, top_p, stop):
    """Feed ``token``, choose the next one; a finished row repeats its token."""
    logits, cache = decode_step(model, cache, token)
    nxt = sample(logits, key, temperature=temperature, top_k=top_k, top_p=top_p)
    nxt = jnp.where(done, token, nxt)
    if stop:
        done = done | jnp.isin(nxt, jnp.asarray(stop, jnp.int32))
    return nxt, cache, done


__all__ = ["STOP_CHECK_EVERY", "generate"]
