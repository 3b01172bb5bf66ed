"""Scalar argument checks (ints, floats, choices, divisibility) shared by every module.

This module imports nothing from ringsplash, so the lowest layers (``masks``, ``layouts``,
config dataclasses) can use it; :mod:`ringsplash._internal.checks` re-exports every helper together
with the attention-input checks (which need ``masks`` and so cannot live here without an
import cycle). Every helper names the argument, what was expected and what was given, and
returns the normalised value.
"""

import dataclasses
import numbers
import sys
import typing
from collections.abc import Collection
from typing import Any

import numpy as np


def literal_choices(literal: Any) -> tuple:
    """The tuple of values of a ``Literal[...]`` type: one source of truth for mode strings."""
    choices = typing.get_args(literal)
    if typing.get_origin(literal) is not typing.Literal or not choices:
        raise TypeError(f"expected a Literal[...] type, got {literal!r}")
    return choices


def as_scalar(value: Any) -> Any:
    """A NumPy scalar (``np.float32(0.7)``) or a concrete 0-d NumPy / JAX array (``jnp.float32(0.7)``) as its
    Python number (``.item()``); anything else, a traced JAX value too, unchanged (the checks then name it).

    Entry points that take a number pass it through this before their check, so NumPy and JAX scalars are
    accepted wherever Python numbers are, and what they keep (a static argument, a config field, JSON) is a
    plain Python value."""
    if isinstance(value, np.generic) or (isinstance(value, np.ndarray) and value.ndim == 0):
        return value.item()
    jax = sys.modules.get("jax")  # a JAX array exists only once jax is imported: no import here
    if jax is not None and isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer) \
            and value.ndim == 0:
        return value.item()
    return value


def plain_fields(config: Any) -> None:
    """Each field of the dataclass ``config`` (frozen too) holding a NumPy scalar or a concrete 0-d JAX array
    (or a tuple of them) set to its Python number (``as_scalar``). A config's ``__post_init__`` calls it first:
    its checks then see Python numbers, and the config hashes, compares and writes to JSON as one built from
    them (an ``np.int64`` field made ``json.dump`` of a run's config fail once training had started)."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if isinstance(value, tuple):
            plain = tuple(as_scalar(x) for x in value)
            changed = any(a is not b for a, b in zip(plain, value))
        else:
            plain = as_scalar(value)
            changed = plain is not value
        if changed:
            object.__setattr__(config, field.name, plain)


def check_int(name: str, value: Any, *, minimum: int | None = None) -> int:
    """``value`` as an ``int`` (numpy integers accepted, bools rejected), ``>= minimum``."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {name}={value!r} ({type(value).__name__})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {name}={value!r}")
    return int(value)


def check_positive_int(name: str, value: Any) -> int:
    """``value`` as an ``int`` > 0."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {name}={value!r}")
    return int(value)


def check_positive_multiple(name: str, value: Any, multiple: int) -> int:
    """``value`` as an ``int`` > 0 divisible by ``multiple``."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0 or value % multiple:
        raise ValueError(f"{name} must be a positive multiple of {multiple}, got {name}={value!r}")
    return int(value)


def check_unroll(name: str, value: Any) -> int | bool:
    """A ``lax.scan`` unroll: ``True`` / ``False`` or an ``int >= 1``."""
    if isinstance(value, bool):
        return value
    if not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an int >= 1 or a bool (True: unroll fully), got {name}={value!r}")
    return int(value)


def check_float(name: str, value: Any, *, positive: bool = False, minimum: float | None = None,
                maximum: float | None = None) -> float:
    """``value`` as a finite python ``float`` (ints accepted; bools, strings, arrays rejected)."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"{name} must be a real number, got {name}={value!r} ({type(value).__name__})")
    value = float(value)
    if not np.isfinite(value):
        raise ValueError(f"{name} must be finite, got {name}={value!r}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {name}={value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {name}={value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {name}={value!r}")
    return value


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool (numpy bools too), else a TypeError naming ``name``."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {name}={value!r} ({type(value).__name__})")
    return bool(value)


def check_name(name: str, value: Any) -> str:
    """``value`` if it is a non-empty ``str`` (a mesh axis name, ...)."""
    if not isinstance(value, str) or not value:
        raise TypeError(f"{name} must be a non-empty str, got {name}={value!r} ({type(value).__name__})")
    return value


def check_choice(name: str, value: Any, choices: Collection[Any]) -> Any:
    """``value`` if it is one of ``choices``."""
    if isinstance(value, bool) or value not in tuple(choices):
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {name}={value!r}")
    return value


def check_divides(divisor_name: str, divisor: int, name: str, value: int, *, hint: str = "") -> None:
    """Raise unless ``divisor`` divides ``value``."""
    if value % divisor:
        raise ValueError(f"{divisor_name}={divisor} must divide {name}={value}" + (f" ({hint})" if hint else ""))
