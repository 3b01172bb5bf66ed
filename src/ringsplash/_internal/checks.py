"""The one validation path for every attention entry point.

:func:`check_attention_call` is the first thing ``reference_attention``, ``splash_attention``,
``splash_forward`` / ``splash_backward``, ``ring_attention`` and ``ring_attention_sharded`` do
(and what every future strategy must call): the config type, q/k/v ranks and dtypes, GQA
divisibility, ``scale``, ``logit_soft_cap``, ``sinks``, segment ids and the mask, in that
order, before any work that could fail for another reason. Shape and dtype checks are
trace-time only; values are read only from concrete (non-traced) segment ids.

The scalar helpers (``check_int`` ... ``check_divides``, ``literal_choices``) live in
:mod:`ringsplash._internal.scalar_checks`, which imports nothing from ringsplash so that ``masks`` and
the configs can use them; they are re-exported here.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ringsplash._internal.scalar_checks import (
    as_scalar,
    check_bool,
    check_float,
)
from ringsplash.masks import Mask, MultiHeadMask
from ringsplash.masks.segment_ids import SegmentIds

__all__ = [
    "AttentionCall",
    "check_attention_call",
    "check_attention_inputs",
    "check_segment_ids",
    "check_sink_values",
    "default_scale",
    "normalize_segment_ids",
]


class AttentionCall(NamedTuple):
    """What :func:`check_attention_call` validated, normalised for the implementation."""

    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    scale: float  # resolved: ``1 / sqrt(head_dim)`` when the caller passed None
    logit_soft_cap: float | None
    segment_ids: SegmentIds | None  # int32, equal exactly where the given ids are equal
    head_dim_v: int | None = None  # v's head size (the output's); may differ from head_dim (MLA)


def check_attention_call(
    q,
    k,
    v,
    *,
    mask=None,
    mask_required: bool = False,
    mask_shape: tuple[int, int] | None = None,
    mask_hint: str = "",
    segment_ids=None,
    segment_hint: str = "",
    scale=None,
    logit_soft_cap=None,
    sinks=None,
    config=None,
    config_type: type | None = None,
    equal_lengths: bool = False,
    return_max_logits: bool = False,
) -> AttentionCall:
    """Validate one call of an attention entry point; raise a clear error naming the argument.

    Args:
        q, k, v: per-example ``[heads, q_len, d]`` / ``[kv_heads, kv_len, d]`` /
            ``[kv_heads, kv_len, dv]`` floating arrays of one dtype (the kernels need it, and the
            reference refuses what they refuse); v's head size ``dv`` may differ from d.
        mask: a ``Mask`` / ``MultiHeadMask`` or None (``mask_required`` rejects None).
        mask_shape: the ``(q_len, kv_len)`` the mask must have (default: q's and k's lengths;
            the ring passes the global ``(S, S)``), ``mask_hint`` is appended to the error.
        segment_ids: ``SegmentIds`` or None; ``segment_hint`` is appended to a length error.
        scale: None or a finite positive real (a Python, NumPy or concrete 0-d JAX number).
        logit_soft_cap: None or a finite positive real (likewise).
        sinks: None or a floating ``[heads]`` array.
        config: the entry point's config, checked to be an instance of ``config_type`` first,
            before anything reads its attributes (skipped when ``config_type`` is None).
        equal_lengths: q_len must equal kv_len (the ring).
        return_max_logits: the entry point's flag, which must be a bool.

    Returns:
        :class:`AttentionCall` with the sizes, the resolved scale and cap, and int32 segment ids.
    """
    if config_type is not None and not isinstance(config, config_type):
        raise TypeError(f"config must be a {config_type.__name__}, got config={config!r} ({type(config).__name__})")
    check_bool("return_max_logits", return_max_logits)
    if mask_required and mask is None:
        raise TypeError("mask must be a ringsplash.masks.Mask or MultiHeadMask, got mask=None")
    heads, kv_heads, q_len, kv_len, d = check_attention_inputs(
        q, k, v, mask, None, sinks, mask_shape=mask_shape, mask_hint=mask_hint
    )
    if equal_lengths and q_len != kv_len:
        raise ValueError(f"q and k must have equal lengths here, got {q_len=}, {kv_len=}")
    # NumPy and concrete JAX scalars are numbers (``jnp.float32(0.1)``); a traced one is refused by name
    scale = default_scale(None if scale is None else check_float("scale", as_scalar(scale), positive=True), d)
    if logit_soft_cap is not None:
        logit_soft_cap = check_float("logit_soft_cap", as_scalar(logit_soft_cap), positive=True)
    if segment_ids is not None:
        try:
            segment_ids = normalize_segment_ids(segment_ids, q_len, kv_len)
        except ValueError as e:
            if not segment_hint:
                raise
            raise ValueError(f"{e} ({segment_hint})") from None
    return AttentionCall(heads, kv_heads, q_len, kv_len, d, scale, logit_soft_cap, segment_ids, int(v.shape[-1]))


def check_attention_inputs(q, k, v, mask=None, segment_ids=None, sinks=None, *, mask_shape=None, mask_hint=""):
    """Shape / dtype checks of per-example attention inputs; returns (heads, kv_heads, q_len, kv_len, head_dim).

    ``v`` is ``[kv_heads, kv_len, head_dim_v]``: its head size may differ from q's and k's. q, k and
    v share one floating dtype, for every entry point (the reference included)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 3:
            raise ValueError(
                f"{name} must be [heads, length, head_dim] (per example; batch with jax.vmap), "
                f"got shape {getattr(x, 'shape', type(x).__name__)}"
            )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be a floating-point array, got {name}.dtype={x.dtype}")
    heads, q_len, d = q.shape
    kv_heads, kv_len, dk = k.shape
    for what, size in (("heads (q.shape[0])", heads), ("kv_heads (k.shape[0])", kv_heads),
                       ("head_dim (q.shape[2])", d), ("head_dim_v (v.shape[2])", v.shape[2])):
        if size == 0:
            raise ValueError(f"{what} must be >= 1, got q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}, "
                             f"v.shape={tuple(v.shape)}")
    if dk != d:
        raise ValueError(f"head_dim mismatch: q has head_dim={d}, k has head_dim={dk}")
    if v.shape[:2] != k.shape[:2]:
        raise ValueError(
            f"v must be [kv_heads, kv_len, head_dim_v] with k's kv_heads and kv_len: k has shape "
            f"{tuple(k.shape)} = [kv_heads={kv_heads}, kv_len={kv_len}, head_dim={dk}], got v.shape={tuple(v.shape)}"
        )
    if heads % kv_heads:
        raise ValueError(f"kv_heads={kv_heads} must divide heads={heads} (GQA groups)")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share one dtype, got q.dtype={q.dtype}, k.dtype={k.dtype}, "
                        f"v.dtype={v.dtype}: cast them to one (e.g. k.astype(q.dtype))")
    if mask is not None:
        if isinstance(mask, MultiHeadMask):
            if mask.shape[0] != heads:
                raise ValueError(f"MultiHeadMask has {mask.shape[0]} heads, q has {heads=}")
            mshape = mask.shape[1:]
        elif isinstance(mask, Mask):
            mshape = mask.shape
        else:
            raise TypeError(f"mask must be a ringsplash.masks.Mask or MultiHeadMask, got {type(mask).__name__}")
        want = (q_len, kv_len) if mask_shape is None else tuple(mask_shape)
        if tuple(mshape) != want:
            hint = f" ({mask_hint})" if mask_hint else ""
            raise ValueError(f"mask shape {tuple(mshape)} must equal (q_len, kv_len)={want}{hint}")
    if segment_ids is not None:
        check_segment_ids(segment_ids, q_len, kv_len)
    if sinks is not None:
        if getattr(sinks, "shape", None) != (heads,):
            raise ValueError(f"sinks must have shape (heads,)={(heads,)}, got {getattr(sinks, 'shape', sinks)}")
        if not jnp.issubdtype(sinks.dtype, jnp.floating):
            raise TypeError(f"sinks must be a floating-point array, got sinks.dtype={sinks.dtype}")
        check_sink_values(sinks)
    return heads, kv_heads, q_len, kv_len, d


def check_sink_values(sinks) -> None:
    """Concrete sinks must be finite or ``-inf`` (a head without a sink): NaN would make every
    row of its head NaN and ``+inf`` its output 0 with a NaN gradient. Traced sinks are not
    inspected (every path then propagates a NaN / +inf alike)."""
    if not _is_concrete(sinks):
        return
    values = np.asarray(sinks, np.float32)
    bad = np.isnan(values) | np.isposinf(values)
    if bad.any():
        raise ValueError(f"sinks must be finite or -inf (no sink), got sinks={values.tolist()} "
                         f"(heads {np.flatnonzero(bad).tolist()})")


def check_segment_ids(segment_ids, q_len: int, kv_len: int) -> None:
    """Type, shape and integer dtype of ``segment_ids`` (values: :func:`normalize_segment_ids`)."""
    if not isinstance(segment_ids, SegmentIds):
        raise TypeError(f"segment_ids must be ringsplash.SegmentIds(q=..., kv=...), got {type(segment_ids).__name__}")
    for name, ids, n in (("segment_ids.q", segment_ids.q, q_len), ("segment_ids.kv", segment_ids.kv, kv_len)):
        if getattr(ids, "shape", None) != (n,):
            raise ValueError(f"{name} must have shape ({n},), got {getattr(ids, 'shape', type(ids).__name__)}")
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(f"{name} must be an integer array, got dtype {ids.dtype}")


# ----------------------------------------------------------------------------------------
# segment ids -> int32 without collisions
#
# The kernels compare int32 ids. Narrowing must keep "q id == kv id" exactly:
# * dtypes whose every value fits int32 (signed <= 32 bits, unsigned <= 16 bits): cast;
# * concrete (numpy / non-traced) ids: cast if every value fits int32, else renumber q and kv
#   jointly (np.unique), which keeps equality exactly;
# * traced ids that are both unsigned (<= 32 bits): bitcast uint32 -> int32 is a bijection;
# * traced ids of any other wider dtype (int64 / uint64 / uint32 with signed): rejected.

_I32 = np.iinfo(np.int32)


def _narrow_dtype_is_exact(dtype) -> bool:
    dtype = np.dtype(dtype)
    return (dtype.kind == "i" and dtype.itemsize <= 4) or (dtype.kind == "u" and dtype.itemsize <= 2)


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _fits_int32(x) -> bool:
    a = np.asarray(x)
    return a.size == 0 or (int(a.min()) >= _I32.min and int(a.max()) <= _I32.max)


def normalize_segment_ids(segment_ids, q_len: int, kv_len: int) -> SegmentIds:
    """Validated int32 ``SegmentIds`` whose ``q[i] == kv[j]`` exactly where the given ids are equal.

    Raises a ``TypeError`` for traced ids of a dtype wider than 32 bits (pass int32), never
    merges ids silently.
    """
    check_segment_ids(segment_ids, q_len, kv_len)
    q, kv = segment_ids
    safe = [_narrow_dtype_is_exact(x.dtype) or (_is_concrete(x) and _fits_int32(x)) for x in (q, kv)]
    if all(safe):
        return SegmentIds(q=jnp.asarray(q, jnp.int32), kv=jnp.asarray(kv, jnp.int32))
    if _is_concrete(q) and _is_concrete(kv):  # renumber jointly: exact, whatever the values
        qa, kva = np.asarray(q), np.asarray(kv)
        if qa.dtype != kva.dtype:  # e.g. int64 with uint64: compare as python ints, never via float64
            qa, kva = qa.astype(object), kva.astype(object)
        both = np.concatenate([qa, kva])
        _, inverse = np.unique(both, return_inverse=True)
        inverse = inverse.reshape(-1).astype(np.int32)
        return SegmentIds(q=jnp.asarray(inverse[:q_len]), kv=jnp.asarray(inverse[q_len:]))
    if all(np.dtype(x.dtype).kind == "u" and np.dtype(x.dtype).itemsize <= 4 for x in (q, kv)):
        as_i32 = lambda x: jax.lax.bitcast_convert_type(jnp.asarray(x).astype(jnp.uint32), jnp.int32)
        return SegmentIds(q=as_i32(q), kv=as_i32(kv))
    wide = q if not safe[0] else kv
    name = "segment_ids.q" if not safe[0] else "segment_ids.kv"
    raise TypeError(
        f"{name} has dtype {wide.dtype}, which cannot be narrowed to the kernels' int32 without "
        f"merging ids inside a traced computation; pass int32 segment ids (renumber them, e.g. "
        f"np.unique(ids, return_inverse=True)), or pass concrete numpy ids, which are renumbered exactly"
    )


def default_scale(scale, head_dim: int) -> float:
    """``scale``, or ``1 / sqrt(head_dim)`` when it is None."""
    return float(1.0 / np.sqrt(head_dim)) if scale is None else float(scale)
