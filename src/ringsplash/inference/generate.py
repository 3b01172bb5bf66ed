"""``generate``: prefill, then jitted decode programs of ``STEPS_PER_PROGRAM`` tokens each (one token
each on a mesh), compiled once per bucket of lengths and sampling settings, never per token or per
prompt length, with an optional progress bar."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ringsplash._internal.types import Array, Int
from ringsplash.inference.cache import KVCache
from ringsplash.inference.checks import as_count, check_flags, check_key, check_model, check_stop_tokens
from ringsplash.inference.decode import decode_step, decode_steps
from ringsplash.inference.prefill import cache_multiple, check_prompts, max_cache_len, prefill
from ringsplash.inference.sample import check_sampling, sample
from ringsplash.model import Transformer
from ringsplash.splash.config import NUM_LANES

#: decode steps per jitted program on one device (``decode_steps``: one launch per this many tokens, the cache
#: read-only inside it); a cache on a mesh takes one step per program. On a v5e chip, GQA 8:2 at 32K batch 8:
#: 3.497 ms per token at 4, 3.519 at 8, 3.512 at 16, 3.585 at 1 (CHANGELOG.md, `c6a963f`)
STEPS_PER_PROGRAM = 4
#: how often (in steps) the loop checks whether every row has stopped and every logit is finite; a check
#: reads the flags of the one before (already computed while later programs were queued), a multiple of
#: ``STEPS_PER_PROGRAM``
STOP_CHECK_EVERY = 8
#: the shortest length ``bucket_length`` gives (``generate`` then rounds its cache up to 128 slots)
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
    max_new_tokens: int | np.integer | jax.Array,
    *,
    prompt_lengths: Int[Array, " batch"] | None = None,
    temperature: float | int | np.number | jax.Array = 0.0,
    top_k: int | np.integer | jax.Array | None = None,
    top_p: float | int | np.number | jax.Array | None = None,
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
            (``ringsplash.inference.filter_logits``), with ``key``; a temperature below float32's smallest
            normal number (``inference.sample.GREEDY_BELOW``, ~1.2e-38) is greedy. Numbers may be Python,
            NumPy or concrete 0-d JAX scalars.
        stop_tokens: token ids (an int or a sequence of ints) that end a row: once a row has produced
            one, the rest of the row repeats that stop token.
        key: a ``jax.random`` key, needed when ``temperature > 0`` (the same key, the same tokens).
        mesh: a mesh with a ``context`` axis: the KV cache (and the prefill forward pass) is sharded
            along the sequence over it, and each decode step merges the devices' partial attention.
        progress: show a progress bar over the generated tokens.
        bucket: size the cache by ``bucket_length`` of the longest prompt plus ``max_new_tokens``, and pad the
            prompts to ``bucket_length`` of the longest prompt, so that prompts of different lengths share a few
            compiled programs (the tokens are the same); False: the exact ``prompt_len + max_new_tokens`` rounded
            up to 128 slots (one compilation per length). On a TPU the decode kernel reads only each row's live
            slots, so the bucket's padding costs no bandwidth; on the CPU (XLA) a step reads every slot, up to 25%
            more than the exact length.

    Raises ``FloatingPointError`` when the model's logits are not finite (NaN / inf weights or
    activations): argmax would otherwise emit token 0 forever. The check runs on the device every
    step and is read every ``STOP_CHECK_EVERY`` steps (one check late) and at the end.
    """
    check_model(model, "generate")
    c = model.config
    temperature, top_k, top_p = check_sampling(temperature, top_k, top_p)
    max_new_tokens = as_count("max_new_tokens", max_new_tokens, 1)
    stop = check_stop_tokens(stop_tokens, c.vocab_size)
    check_flags(progress=progress, bucket=bucket)
    key = check_key(key, temperature)
    prompts, lengths = check_prompts(prompts, prompt_lengths, c.vocab_size, name="prompts")
    concrete = not isinstance(prompts, jax.core.Tracer) and not isinstance(lengths, jax.core.Tracer)
    longest = int(np.max(np.asarray(lengths))) if concrete else prompts.shape[1]
    if longest + max_new_tokens > c.max_seq_len:
        raise ValueError(f"generate would make sequences of {longest + max_new_tokens} tokens (the longest prompt, "
                         f"{longest} tokens, + max_new_tokens={max_new_tokens}), more than the model's "
                         f"max_seq_len={c.max_seq_len}: pass max_new_tokens <= {c.max_seq_len - longest}")
    # whole 128-slot lanes: on a v5e chip generate took 4.93 ms per token with a cache of 32,833 slots (32K + 65),
    # 3.35 with one of 32,896 (GQA 8:2, batch 8; CHANGELOG.md)
    multiple = math.lcm(cache_multiple(c, mesh), NUM_LANES)
    # never more slots than the model's max_seq_len rounded up to whole lanes (prefill refuses more)
    most = max_cache_len(c, mesh)
    if bucket and concrete:
        max_len = min(bucket_length(longest + max_new_tokens, multiple), most)
        # the prompts padded to their own bucket, not the cache's: a single-device prefill's forward pass runs over
        # the prompts' columns (a 32K prompt padded to its 40,960-slot cache did 1.44x the attention FLOPs)
        padded = np.zeros((prompts.shape[0], min(bucket_length(longest), max_len)), np.int32)
        padded[:, :longest] = np.asarray(prompts)[:, :longest]
        prompts = jnp.asarray(padded)
    else:
        if concrete:  # the columns past every row's prompt are ignored: not carried into the cache's length
            prompts = prompts[:, :longest]
        max_len = min(-(-(prompts.shape[1] + max_new_tokens) // multiple) * multiple, most)
    logits, cache = prefill(model, prompts, prompt_lengths=lengths, max_len=max_len, mesh=mesh)
    per_call = 1 if cache.mesh is not None else STEPS_PER_PROGRAM
    keys = jax.random.split(key if key is not None else jax.random.key(0), max_new_tokens)
    # one key per slot of the cache and per_call more (a shape of the bucket, not of max_new_tokens: one compile
    # serves every count); keys past max_new_tokens serve only the discarded steps of the last call
    keys = keys[np.minimum(np.arange(max_len + per_call), max_new_tokens - 1)]
    settings = dict(temperature=temperature, top_k=top_k, top_p=top_p, stop=stop)
    token = sample(logits, keys[0], temperature=temperature, top_k=top_k, top_p=top_p)
    done = jnp.isin(token, jnp.asarray(stop, jnp.int32)) if stop else jnp.zeros_like(token, bool)
    nonfinite = jnp.where(jnp.isfinite(logits).all(-1), -1, 0).astype(jnp.int32)  # first bad new token per row
    # (token, done, nonfinite, index of the next new token) and the count: on the device, so that the host passes
    # nothing between programs (a host value per call stalled generate on the chip, `7a80dfc`), placed where
    # the programs leave them (else the second call compiles again)
    scalar = lambda n: jax.device_put(jnp.int32(n), None if cache.mesh is None else NamedSharding(cache.mesh, P()))
    state, total = (token, done, nonfinite, scalar(1)), scalar(max_new_tokens)
    out = [token[:, None]]
    checked = None  # the flags as of the previous check, read at the next one: the device never waits idle
    from tqdm.auto import tqdm

    with tqdm(total=max_new_tokens, initial=1, desc="generate", unit="tok", disable=not progress) as bar:
        for i in range(1, max_new_tokens, per_call):  # i: the index of the first new token this call makes
            if i > 1 and (i - 1) % STOP_CHECK_EVERY == 0:
                # every row was done at the previous check: the tokens since repeat each row's stop token
                if checked is not None and _check_finite(*checked) and stop:
                    out.append(jnp.repeat(state[0][:, None], max_new_tokens - i, axis=1))
                    bar.update(max_new_tokens - i)
                    break
                checked = state[1:3]
            # past max_new_tokens (the last call's tail) nothing counts: trimmed below
            made, cache, state = _steps(model, cache, state, keys, total, steps=per_call, **settings)
            out.append(made)
            bar.update(min(per_call, max_new_tokens - i))
    _check_finite(*state[1:3])
    return jnp.concatenate(out, axis=1)[:, :max_new_tokens]


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


def _choose(logits, token, done, nonfinite, index, key, total, *, temperature, top_k, top_p, stop):
    """New token ``index`` from the logits of feeding ``token``: a finished row repeats its token;
    ``nonfinite``: per row, the first new token whose logits were not finite (-1: none yet), counting
    only tokens below ``total`` (a program's steps past it are discarded)."""
    bad = (nonfinite < 0) & ~jnp.isfinite(logits).all(-1) & (index < total)
    nonfinite = jnp.where(bad, index, nonfinite)
    nxt = sample(logits, key, temperature=temperature, top_k=top_k, top_p=top_p)
    nxt = jnp.where(done, token, nxt)
    if stop:
        done = done | jnp.isin(nxt, jnp.asarray(stop, jnp.int32))
    return nxt, done, nonfinite


@functools.partial(jax.jit, static_argnames=("steps", "temperature", "top_k", "top_p", "stop"), donate_argnums=(1,))
def _steps(model: Transformer, cache: KVCache, state, keys, total, *, steps: int, **settings):
    """``steps`` new tokens as one program from ``state = (token, done, nonfinite, index)``: one
    ``decode_step`` (any cache, a mesh's too) or ``decode_steps``; ``keys`` holds every new token's key,
    ``total`` the count asked for. Returns the tokens ``[batch, steps]``, the cache and the next state."""
    token, done, nonfinite, index = state

    def choose(logits, step, carry):
        token, done, nonfinite = _choose(logits, *carry, index + step, keys[index + step], total, **settings)
        return token, (token, done, nonfinite)

    if steps == 1:
        logits, cache = decode_step(model, cache, token)
        token, carry = choose(logits, 0, (token, done, nonfinite))
        return token[:, None], cache, (*carry, index + 1)
    out = decode_steps(model, cache, token, steps, choose, (token, done, nonfinite))
    return out.tokens.T, out.cache, (*out.carry, index + steps)


__all__ = ["MIN_BUCKET", "STEPS_PER_PROGRAM", "STOP_CHECK_EVERY", "bucket_length", "generate"]
