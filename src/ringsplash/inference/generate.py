"""``generate``: prefill, then one jitted decode step per new token (compiled once per bucket of
lengths and sampling settings, never per token or per prompt length), with an optional progress bar."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from ringsplash._types import Array, Int
from ringsplash.inference.cache import KVCache
from ringsplash.inference.checks import as_count, check_model, check_stop_tokens
from ringsplash.inference.decode import decode_step
from ringsplash.inference.prefill import cache_multiple, check_prompts, prefill
from ringsplash.inference.sample import check_sampling, sample
from ringsplash.model import Transformer

#: how often (in steps) the loop checks whether every row has stopped and every logit is finite (each check
#: waits for the device)
STOP_CHECK_EVERY = 8
#: the shortest cache ``generate`` compiles for (see ``bucket_length``)
MIN_BUCKET = 16


def bucket_length(n: int, multiple: int = 1) -> int:
    """The cache length ``generate`` compiles for when it needs ``n`` slots: at least ``MIN_BUCKET``, then
    four sizes per doubling (``2**k * (1.25, 1.5, 1.75, 2)``: less than 25% padding), rounded up to
    ``multiple``. Prompts of different lengths share these few compiled programs."""
    n = max(n, MIN_BUCKET)
    step = 2 ** max(0, (n - 1).bit_length() - 3)
    n = -(-n // step) * step
    return -(-n // multiple) * multiple


def generate(
    model: Transformer,
    prompts: Int[Array, "batch prompt_len"],
    max_new_tokens: int | np.integer,
    *,
    prompt_lengths: Int[Array, " batch"] | None = None,
    temperature: float = 0.0,
    top_k: int | np.integer | None = None,
    top_p: float | None = None,
    stop_tokens=(),
    key: jax.Array | None = None,
    mesh: Mesh | None = None,
    progress: bool = False,
    bucket: bool = True,
) -> Int[Array, "batch max_new_tokens"]:
    """The next ``max_new_tokens`` tokens of each prompt, int32 ``[batch, max_new_tokens]``.

    Args:
        model: a ``Transformer`` (trained here or ``ringsplash.hf.load_hf``) with a causal mask.
        prompts: int ``[batch, prompt_len]``; row ``b``'s prompt is its first ``prompt_lengths[b]``
            tokens (None: all of them); the rest of the row is ignored.
        max_new_tokens: tokens to generate per row (>= 1); the longest prompt plus ``max_new_tokens``
            must be at most the model's ``max_seq_len``.
        temperature: 0 (default) picks the most likely token (greedy); > 0 samples from
            ``softmax(logits / temperature)`` restricted by ``top_k`` / ``top_p``
            (``ringsplash.inference.filter_logits``), with ``key``.
        stop_tokens: token ids (an int or a sequence of ints) that end a row: once a row has produced
            one, the rest of the row repeats that stop token.
        key: a ``jax.random`` key, needed when ``temperature > 0`` (the same key, the same tokens).
        mesh: a mesh with a ``context`` axis: the KV cache (and the prefill forward pass) is sharded
            along the sequence over it, and each decode step merges the devices' partial attention.
        progress: show a progress bar over the generated tokens.
        bucket: size the cache (and the prompts, padded) by ``bucket_length``, so that prompts of
            different lengths share a few compiled programs (the tokens are the same); False: the
            exact ``prompt_len + max_new_tokens`` (one compilation per length).

    Raises ``FloatingPointError`` when the model's logits are not finite (NaN / inf weights or
    activations): argmax would otherwise emit token 0 forever. The check runs on the device every
    step and is read every ``STOP_CHECK_EVERY`` steps.
    """
    check_model(model, "generate")
    c = model.config
    check_sampling(temperature, top_k, top_p)
    max_new_tokens = as_count("max_new_tokens", max_new_tokens, 1)
    top_k = None if top_k is None else int(top_k)
    stop = check_stop_tokens(stop_tokens, c.vocab_size)
    if temperature > 0 and key is None:
        raise ValueError("sampling (temperature > 0) needs key=<a jax.random key>")
    prompts, lengths = check_prompts(prompts, prompt_lengths, c.vocab_size, name="prompts")
    concrete = not isinstance(prompts, jax.core.Tracer) and not isinstance(lengths, jax.core.Tracer)
    longest = int(np.max(np.asarray(lengths))) if concrete else prompts.shape[1]
    if longest + max_new_tokens > c.max_seq_len:
        raise ValueError(f"generate would make sequences of {longest + max_new_tokens} tokens (the longest prompt, "
                         f"{longest} tokens, + max_new_tokens={max_new_tokens}), more than the model's "
                         f"max_seq_len={c.max_seq_len}: pass max_new_tokens <= {c.max_seq_len - longest}")
    multiple = cache_multiple(c, mesh)
    if bucket and concrete:
        max_len = bucket_length(longest + max_new_tokens, multiple)
        padded = np.zeros((prompts.shape[0], max_len), np.int32)
        padded[:, :longest] = np.asarray(prompts)[:, :longest]
        prompts = jnp.asarray(padded)
    else:
        max_len = -(-(prompts.shape[1] + max_new_tokens) // multiple) * multiple
    logits, cache = prefill(model, prompts, prompt_lengths=lengths, max_len=max_len, mesh=mesh)
    keys = jax.random.split(key if key is not None else jax.random.key(0), max_new_tokens)
    settings = dict(temperature=float(temperature), top_k=top_k, top_p=top_p, stop=stop)
    token = sample(logits, keys[0], temperature=float(temperature), top_k=top_k, top_p=top_p)
    done = jnp.isin(token, jnp.asarray(stop, jnp.int32)) if stop else jnp.zeros_like(token, bool)
    nonfinite = jnp.where(jnp.isfinite(logits).all(-1), -1, 0).astype(jnp.int32)  # first bad new token per row
    out = [token]
    from tqdm.auto import tqdm

    with tqdm(total=max_new_tokens, initial=1, desc="generate", unit="tok", disable=not progress) as bar:
        for i in range(1, max_new_tokens):
            if i % STOP_CHECK_EVERY == 0:
                all_done = _check_finite(done, nonfinite)
                if stop and all_done:
                    out.extend([token] * (max_new_tokens - i))  # every row repeats its stop token
                    bar.update(max_new_tokens - i)
                    break
            token, cache, done, nonfinite = _step(model, cache, token, done, nonfinite, i, keys[i], **settings)
            out.append(token)
            bar.update(1)
    _check_finite(done, nonfinite)
    return jnp.stack(out, axis=1)


def _check_finite(done, nonfinite) -> bool:
    """Whether every row is done; ``FloatingPointError`` if a row's logits were not finite."""
    if isinstance(nonfinite, jax.core.Tracer):  # generate traced as a whole: nothing to read
        return False
    done, nonfinite = jax.device_get((done, nonfinite))
    rows = np.flatnonzero(nonfinite >= 0)
    if rows.size:
        raise FloatingPointError(
            f"generate: the model's logits are not finite (NaN or inf) for row(s) {rows.tolist()}, from new token "
            f"{int(nonfinite[rows].min())} on: the parameters (or activations) hold NaN / inf, and argmax would emit "
            f"token 0 forever; check the weights, e.g. [jnp.isfinite(x).all() for x in jax.tree.leaves(model)]")
    return bool(done.all())


@functools.partial(jax.jit, static_argnames=("temperature", "top_k", "top_p", "stop"), donate_argnums=(1,))
def _step(model: Transformer, cache: KVCache, token, done, nonfinite, index, key, *, temperature, top_k, top_p,
          stop):
    """Feed ``token``, choose the next one (new token ``index``); a finished row repeats its token;
    ``nonfinite``: per row, the first new token whose logits were not finite (-1: none yet)."""
    logits, cache = decode_step(model, cache, token)
    nonfinite = jnp.where((nonfinite < 0) & ~jnp.isfinite(logits).all(-1), index, nonfinite)
    nxt = sample(logits, key, temperature=temperature, top_k=top_k, top_p=top_p)
    nxt = jnp.where(done, token, nxt)
    if stop:
        done = done | jnp.isin(nxt, jnp.asarray(stop, jnp.int32))
    return nxt, cache, done, nonfinite


__all__ = ["MIN_BUCKET", "STOP_CHECK_EVERY", "bucket_length", "generate"]
