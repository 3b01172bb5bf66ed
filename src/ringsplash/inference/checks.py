"""Argument checks shared by the inference entry points (``prefill``, ``decode_step``, ``generate``).

Each error names the argument, what was expected and what was given. Counts accept any integer
(``int``, ``np.int64``, a concrete 0-d JAX integer array, ...) but not ``bool`` or ``float``: a float would
be truncated silently.
"""

import numbers

import numpy as np

from ringsplash._internal.scalar_checks import as_scalar, check_bool
from ringsplash.model import Transformer, TransformerConfig


def check_model(model, fn: str) -> None:
    """``model`` is a ``Transformer`` (a config passed where the model goes says how to build one)."""
    if isinstance(model, Transformer):
        return
    hint = ""
    if isinstance(model, TransformerConfig):
        hint = (": that is a model's config; build the model with Transformer(config, key=...) or load one with "
                "ringsplash.hf.load_hf")
    raise TypeError(f"{fn}: model must be a ringsplash.model.Transformer, got {type(model).__name__}{hint}")


def is_int(value) -> bool:
    """A Python or NumPy integer (or a concrete 0-d JAX integer array), not a bool."""
    value = as_scalar(value)
    return isinstance(value, numbers.Integral) and not isinstance(value, bool | np.bool_)


def as_count(name: str, value, minimum: int) -> int:
    """``value`` as a Python ``int`` >= ``minimum`` (a Python, NumPy or concrete 0-d JAX integer)."""
    value = as_scalar(value)
    if not is_int(value) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {name}={value!r} ({type(value).__name__})")
    return int(value)


def check_stop_tokens(stop_tokens, vocab_size: int) -> tuple[int, ...]:
    """``stop_tokens`` (an id, or a sequence / integer array of ids) as a tuple of ints in ``[0, vocab_size)``."""
    expected = f"stop_tokens must be token ids in [0, vocab_size={vocab_size}): an int or a sequence of ints"
    if isinstance(stop_tokens, str | bytes):
        raise TypeError(f"{expected}, got the {type(stop_tokens).__name__} {stop_tokens!r}")
    if is_int(stop_tokens):
        ids = [stop_tokens]
    elif hasattr(stop_tokens, "dtype"):  # a NumPy / JAX array
        if not np.issubdtype(stop_tokens.dtype, np.integer):
            raise TypeError(f"{expected}, got an array of dtype {stop_tokens.dtype}")
        ids = np.asarray(stop_tokens).reshape(-1).tolist()
    else:
        try:
            ids = list(stop_tokens)
        except TypeError:
            raise TypeError(f"{expected}, got {stop_tokens!r} ({type(stop_tokens).__name__})") from None
        wrong = [t for t in ids if not is_int(t)]
        if wrong:
            raise TypeError(f"{expected}, got {stop_tokens!r} (not ints: {wrong!r})")
    ids = [int(t) for t in ids]
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{expected}, got {bad}")
    return tuple(ids)


def check_key(key, temperature: float):
    """``key``: None (greedy needs none) or one ``jax.random`` key (``jax.random.key(0)``, or a legacy
    ``jax.random.PRNGKey(0)``); sampling (``temperature > 0``) needs one."""
    if key is None:
        if temperature > 0:
            raise ValueError("sampling (temperature > 0) needs key=<a jax.random key>, e.g. key=jax.random.key(0)")
        return None
    import jax

    dtype = getattr(key, "dtype", None)
    typed = dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
    legacy = dtype == np.uint32 and getattr(key, "shape", None) == (2,)
    if not (typed and key.shape == ()) and not legacy:
        shape = getattr(key, "shape", None)
        given = f"{type(key).__name__}" + (f" of shape {tuple(shape)} and dtype {dtype}" if shape is not None else
                                           f" {key!r}")
        raise TypeError(f"key must be one jax.random key (jax.random.key(0), or a uint32 [2] jax.random.PRNGKey(0)), "
                        f"got a {given}")
    return key


def check_flags(**flags) -> None:
    """Each keyword a bool (``np.bool_`` too): ``progress="no"`` would otherwise switch a bar on."""
    for name, value in flags.items():
        check_bool(name, as_scalar(value))


__all__ = ["as_count", "check_flags", "check_key", "check_model", "check_stop_tokens", "is_int"]
