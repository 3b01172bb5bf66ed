"""The one validation path: scalar / choice helpers used by every config and entry point,
and the attention-input checks shared by every attention entry point (trace-time, shape-only).

Every helper names the argument, what was expected and what was given, and returns the
normalised value. The scalar helpers import nothing from ringsplash, so any module
(``masks``, ``layouts``, configs) can use them without an import cycle.
"""

import numbers
from collections.abc import Collection
from typing import Any

import jax.numpy as jnp
import numpy as np

from ringsplash.masks import Mask, MultiHeadMask
from ringsplash.segment_ids import SegmentIds


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


def check_choice(name: str, value: Any, choices: Collection[Any]) -> Any:
    """``value`` if it is one of ``choices``."""
    if isinstance(value, bool) or value not in tuple(choices):
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {name}={value!r}")
    return value


def check_divides(divisor_name: str, divisor: int, name: str, value: int, *, hint: str = "") -> None:
    """Raise unless ``divisor`` divides ``value``."""
    if value % divisor:
        raise ValueError(f"{divisor_name}={divisor} must divide {name}={value}" + (f" ({hint})" if hint else ""))



def check_attention_inputs(q, k, v, mask=None, segment_ids=None, sinks=None, *, same_dtype=False):
    """Validate per-example attention inputs; returns (heads, kv_heads, q_len, kv_len, head_dim)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 3:
            raise ValueError(
                f"{name} must be [heads, length, head_dim] (per example; batch with jax.vmap), "
                f"got shape {getattr(x, 'shape', type(x).__name__)}"
            )
    heads, q_len, d = q.shape
    kv_heads, kv_len, dk = k.shape
    if dk != d:
        raise ValueError(f"head_dim mismatch: q has head_dim={d}, k has head_dim={dk}")
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    if heads % kv_heads:
        raise ValueError(f"kv_heads={kv_heads} must divide heads={heads} (GQA groups)")
    if same_dtype and not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if mask is not None:
        if isinstance(mask, MultiHeadMask):
            if mask.shape[0] != heads:
                raise ValueError(f"MultiHeadMask has {mask.shape[0]} heads, q has {heads=}")
            mshape = mask.shape[1:]
        elif isinstance(mask, Mask):
            mshape = mask.shape
        else:
            raise TypeError(f"mask must be a ringsplash.masks.Mask or MultiHeadMask, got {type(mask).__name__}")
        if tuple(mshape) != (q_len, kv_len):
            raise ValueError(f"mask shape {tuple(mshape)} must equal (q_len, kv_len)={(q_len, kv_len)}")
    if segment_ids is not None:
        check_segment_ids(segment_ids, q_len, kv_len)
    if sinks is not None:
        if getattr(sinks, "shape", None) != (heads,):
            raise ValueError(f"sinks must have shape (heads,)={(heads,)}, got {getattr(sinks, 'shape', sinks)}")
    return heads, kv_heads, q_len, kv_len, d


def check_segment_ids(segment_ids, q_len: int, kv_len: int) -> None:
    if not isinstance(segment_ids, SegmentIds):
        raise TypeError(f"segment_ids must be ringsplash.SegmentIds(q=..., kv=...), got {type(segment_ids).__name__}")
    for name, ids, n in (("segment_ids.q", segment_ids.q, q_len), ("segment_ids.kv", segment_ids.kv, kv_len)):
        if getattr(ids, "shape", None) != (n,):
            raise ValueError(f"{name} must have shape ({n},), got {getattr(ids, 'shape', type(ids).__name__)}")
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(f"{name} must be an integer array, got dtype {ids.dtype}")


def default_scale(scale, head_dim: int) -> float:
    return float(1.0 / np.sqrt(head_dim)) if scale is None else float(scale)
