"""Splash attention: the shard-pair entry points and the custom VJP (one shard pair through a
backend: ``splash/dispatch.py``); the public ``splash_attention`` and its factory are in
``splash/factory.py``."""

import dataclasses
import functools
from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from ringsplash._internal import softmax as _softmax
from ringsplash._internal.checks import check_attention_call, default_scale
from ringsplash._internal.shard_map import vma
from ringsplash._internal.types import Array, Float
from ringsplash.blocksparse.mask_info import MaskInfo
from ringsplash.masks.segment_ids import SegmentIds
from ringsplash.splash import work_pieces
from ringsplash.splash.backend_interface import BackendStatic
from ringsplash.splash.config import SplashConfig
from ringsplash.splash.dispatch import pair_backward, pair_forward, segments_of

# ----------------------------------------------------------------------------------------
# shard-pair entry points (used by the ring)


def splash_forward(
    q: Float[Array, "heads q_shard d"],
    k: Float[Array, "kv_heads kv_shard d"],
    v: Float[Array, "kv_heads kv_shard dv"],
    info: MaskInfo,
    *,
    q_shard=0,
    kv_shard=0,
    q_positions=None,
    kv_positions=None,
    segment_ids: SegmentIds | None = None,
    scale: float | None = None,
    logit_soft_cap: float | None = None,
    config: SplashConfig = SplashConfig(),
    out_dtype=None,
    return_max_logits: bool = False,
    pieces: work_pieces.PieceSchedules | None = None,
) -> (tuple[Float[Array, "heads q_shard dv"], Float[Array, "heads q_shard"]]
      | tuple[Float[Array, "heads q_shard dv"], Float[Array, "heads q_shard"], Float[Array, " heads"]]):
    """Sink-free ``(out, lse)`` of the local q shard against the local kv shard.

    Args:
        q: local queries ``[heads, q_shard, d]``, floating point.
        k: local keys ``[kv_heads, kv_shard, d]``, the dtype of ``q``.
        v: local values ``[kv_heads, kv_shard, dv]``, the dtype of ``k``; ``dv`` may differ from d.
        info: ``MaskInfo`` built with ``(config.block_q, config.block_kv)`` for these shards.
        q_shard: which q shard of ``info`` this is (int or traced int).
        kv_shard: which kv shard of ``info`` this is (int or traced int).
        q_positions: int ``[q_shard]`` original positions of the local rows; None = the shard's
            slice of ``info.q_positions``.
        kv_positions: int ``[kv_shard]`` original positions of the local columns; None = the
            shard's slice of ``info.kv_positions``.
        segment_ids: the local ``SegmentIds(q=[q_shard], kv=[kv_shard])``, or None.
        scale: positive multiplier of ``q k^T``; None means ``1 / sqrt(d)``.
        logit_soft_cap: None, or a positive cap ``c``: logits become ``c * tanh(logits / c)``.
        config: ``SplashConfig`` (backend; block sizes must match ``info``).
        out_dtype: dtype of ``out`` (None = q's dtype; ``jnp.float32`` gives a ring unrounded
            partial outputs; both backends write it directly from their float32 accumulators).
        return_max_logits: also return the per-head max logit of this shard pair (see
            ``splash_attention``; ``-inf`` where the pair attends nothing for a head), from
            the same forward pass. Not differentiable (``stop_gradient``).
        pieces: this pair's work lists in pieces (``work_pieces.PieceSchedules``, e.g. from a
            ring's per-device schedule); None = ``info``'s, split under ``config``'s budget.

    Returns:
        ``(out [heads, q_shard, dv], lse float32 [heads, q_shard])``, and float32
        ``max_logits [heads]`` third with ``return_max_logits``.
    """
    call = check_attention_call(q, k, v, segment_ids=segment_ids, scale=scale, logit_soft_cap=logit_soft_cap,
                                config=config, config_type=SplashConfig, return_max_logits=return_max_logits)
    _check_info(info, call.q_len, call.kv_len, transpose=False)
    return pair_forward(BackendStatic(info, None, call.scale, call.logit_soft_cap, config), q, k, v,
                        *segments_of(call.segment_ids), q_shard=q_shard, kv_shard=kv_shard, q_positions=q_positions,
                        kv_positions=kv_positions, out_dtype=out_dtype, return_max_logits=return_max_logits,
                        pieces=pieces)


def splash_backward(
    q: Float[Array, "heads q_shard d"],
    k: Float[Array, "kv_heads kv_shard d"],
    v: Float[Array, "kv_heads kv_shard dv"],
    d_out: Float[Array, "heads q_shard dv"],
    lse: Float[Array, "heads q_shard"],
    delta: Float[Array, "heads q_shard"],
    info: MaskInfo,
    info_dkv: MaskInfo | None,
    *,
    q_shard=0,
    kv_shard=0,
    q_positions=None,
    kv_positions=None,
    segment_ids: SegmentIds | None = None,
    scale: float | None = None,
    logit_soft_cap: float | None = None,
    config: SplashConfig = SplashConfig(),
    pieces: work_pieces.PieceSchedules | None = None,
    pieces_dkv: work_pieces.PieceSchedules | None = None,
    accumulate: tuple | None = None,
    parts: tuple = ("dq", "dkv"),
    fused: bool = True,
    grad_dtype=jnp.float32,
) -> tuple[Float[Array, "heads q_shard d"], Float[Array, "kv_heads kv_shard d"], Float[Array, "kv_heads kv_shard dv"]]:
    """``(dq, dk, dv)`` of one shard pair, float32 by default.

    Args:
        q, k, v: the local shards, as in :func:`splash_forward`.
        d_out: cotangent of the *final* output ``[heads, q_shard, dv]`` (cast to q's dtype).
        lse: float32 ``[heads, q_shard]`` log-sum-exp of the *final* output (sinks included).
        delta: float32 ``[heads, q_shard]``, ``rowsum(d_out * out)`` of the final output.
        info: forward ``MaskInfo`` (``config.block_shape``), as in :func:`splash_forward`.
        info_dkv: the transposed ``MaskInfo`` with ``config.block_shape_dkv``; the xla
            backend accepts None.
        q_shard, kv_shard, q_positions, kv_positions, segment_ids, scale, logit_soft_cap,
        config: as in :func:`splash_forward`.
        pieces: as in :func:`splash_forward`.
        pieces_dkv: likewise for ``info_dkv`` (None = ``info_dkv``'s, split under the budget).
        accumulate: float32 ``(dq, dk, dv)`` to add this pair's gradients into (each piece as it
            is computed: no whole-shard gradient temporaries); returned summed. None = fresh.
        parts: the gradients needed: ``("dq", "dkv")`` (all), ``("dq",)`` or ``("dkv",)``. The
            Pallas backends then run only that kernel (the fused one computes all three); the
            parts not asked for are returned as ``accumulate``'s (zeros without it).
        fused: the Pallas backends compute all three in one fused kernel (default) or, False, in the
            dq and dK/dV kernels (the ring: see ``parallel/ring_blocks.py::block_backward``).
        grad_dtype: the gradients' dtype without ``accumulate`` (float32: unrounded partials; a one-step
            ring writes its inputs' dtype directly, as single-device Splash does).

    Returns:
        ``(dq [heads, q_shard, d], dk [kv_heads, kv_shard, d], dv [kv_heads, kv_shard, dv])`` in
        ``grad_dtype`` (float32 with ``accumulate``).
    """
    call = check_attention_call(q, k, v, segment_ids=segment_ids, scale=scale, logit_soft_cap=logit_soft_cap,
                                config=config, config_type=SplashConfig)
    _check_info(info, call.q_len, call.kv_len, transpose=False)
    if info_dkv is not None:
        _check_info(info_dkv, call.q_len, call.kv_len, transpose=True)
    return pair_backward(BackendStatic(info, info_dkv, call.scale, call.logit_soft_cap, config), q, k, v, d_out, lse,
                         delta, *segments_of(call.segment_ids), q_shard=q_shard, kv_shard=kv_shard,
                         q_positions=q_positions, kv_positions=kv_positions, pieces=pieces, pieces_dkv=pieces_dkv,
                         accumulate=accumulate, parts=parts, fused=fused, grad_dtype=grad_dtype)


def _check_info(info, q_len, kv_len, *, transpose):
    if not isinstance(info, MaskInfo):
        raise TypeError(f"info must be a ringsplash.MaskInfo, got {type(info).__name__}")
    if info.transpose != transpose:
        raise ValueError(f"expected a MaskInfo built with transpose={transpose}, got transpose={info.transpose}")
    local = (info.q_len // info.q_shards, info.kv_len // info.kv_shards)
    if local != (q_len, kv_len):
        raise ValueError(f"the MaskInfo's shard shape (q, kv)={local} does not match {q_len=}, {kv_len=}")


# ----------------------------------------------------------------------------------------
# the custom VJP over one q shard of a MaskInfo against all its kv columns, sinks included


@runtime_checkable
class KvExchange(Protocol):
    """How a caller's local K / V reach :func:`splash_info_attention` and their gradients go back
    (a strategy's collective, e.g. the all-gather; a hashable value, part of the custom VJP's
    statics). ``gather`` maps the local k or v to the kernels' operand in the forward; ``reduce``
    is its transpose, applied to the kernels' *unrounded* dK or dV (``partial_dtype``, float32
    for the strategies) and returning the local gradient in ``dtype``: a sum across devices or
    heads then happens in float32 with one final rounding, as the ring accumulates dK / dV
    (JAX's own transpose of a bfloat16 all-gather sums bfloat16 partials). ``sums_partials``:
    whether ``reduce`` adds partials at all; where it does not (one device, no repeated heads) the
    kernels write the gradients in the inputs' dtype, as single-device Splash does."""

    @property
    def sums_partials(self) -> bool: ...

    def gather(self, x: Array) -> Array: ...

    def reduce(self, dx: Array, dtype) -> Array: ...


@dataclasses.dataclass(frozen=True)
class _VjpStatic:
    """Non-differentiable settings of ``_attention`` (hashable)."""

    backend: BackendStatic
    q_shard: int  # the q shard when it is static (the traced argument is then None)
    partial_dtype: object  # dtype of the kernels' gradients (None = q's), before the final cast
    sinks_vma: frozenset  # the manual mesh axes the sinks vary over
    return_residuals: bool
    return_max_logits: bool
    kv_exchange: KvExchange | None = None  # K / V from the caller's shards (None: k, v as given)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(static: _VjpStatic, q, k, v, sinks, q_seg, kv_seg, q_shard):
    return _attention_fwd(static, q, k, v, sinks, q_seg, kv_seg, q_shard)[0]


def _attention_fwd(static: _VjpStatic, q, k, v, sinks, q_seg, kv_seg, q_shard):
    if static.kv_exchange is not None:  # the gathered K / V are the residuals (no re-gather backward)
        k, v = static.kv_exchange.gather(k), static.kv_exchange.gather(v)
    shard = static.q_shard if q_shard is None else q_shard
    # the output is this call's own rows: written in q's dtype (as every path does), only the
    # gradients a KvExchange sums across devices or heads need unrounded partials
    out, lse, *mx = pair_forward(static.backend, q, k, v, q_seg, kv_seg, q_shard=shard, out_dtype=None,
                                 return_max_logits=static.return_max_logits)
    out, lse = _softmax.fold_sinks(out, lse, sinks)  # sinks join the denominator only (docs/INTERNALS.md)
    out = out.astype(q.dtype)
    result = (out, lse, *mx) if static.return_residuals else (out, *mx)
    return result if len(result) > 1 else out, (q, k, v, sinks, q_seg, kv_seg, q_shard, out, lse)


def _attention_bwd(static: _VjpStatic, residuals, g):
    q, k, v, sinks, q_seg, kv_seg, q_shard, out, lse = residuals
    if not (static.return_residuals or static.return_max_logits):
        g = (g,)
    d_out = g[0].astype(q.dtype)  # the max logits' cotangent is dropped: they carry no gradient
    delta = _softmax.delta(d_out, out, g[1] if static.return_residuals else None)
    grad_dtype = q.dtype if static.partial_dtype is None else static.partial_dtype
    dq, dk, dv = pair_backward(static.backend, q, k, v, d_out, lse, delta, q_seg, kv_seg,
                               q_shard=static.q_shard if q_shard is None else q_shard, grad_dtype=grad_dtype,
                               fused=static.backend.config.fused_backward)
    d_sinks = None
    if sinks is not None:  # over the local rows; other rows' devices add theirs
        d_sinks = _softmax.sinks_grad(sinks, lse, delta)
        # with vma checking a replicated sink needs a replicated cotangent: sum it here; without
        # it (vma empty everywhere) shard_map's transpose sums it
        extra = tuple(sorted(vma(d_sinks) - static.sinks_vma, key=str))
        if extra:
            d_sinks = jax.lax.psum(d_sinks, extra)
        d_sinks = d_sinks.astype(sinks.dtype)
    if static.kv_exchange is None:
        dk, dv = dk.astype(k.dtype), dv.astype(v.dtype)
    else:  # reduced before the cast (float32 partials on the strategies)
        dk, dv = static.kv_exchange.reduce(dk, k.dtype), static.kv_exchange.reduce(dv, v.dtype)
    return dq.astype(q.dtype), dk, dv, d_sinks, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def splash_info_attention(
    q: Float[Array, "heads q_shard d"],
    k: Float[Array, "kv_heads kv_len d"],
    v: Float[Array, "kv_heads kv_len dv"],
    info: MaskInfo,
    info_dkv: MaskInfo | None,
    *,
    q_shard=0,
    segment_ids: SegmentIds | None = None,
    scale: float | None = None,
    logit_soft_cap: float | None = None,
    sinks: Float[Array, " heads"] | None = None,
    config: SplashConfig = SplashConfig(),
    partial_dtype=None,
    return_residuals: bool = False,
    return_max_logits: bool = False,
    kv_exchange: KvExchange | None = None,
):
    """Attention of q shard ``q_shard`` of ``info`` against every kv column of it (one kv
    shard), sinks included: the custom VJP behind :func:`splash_attention` and the
    all-gather and Ulysses strategies, on inputs their entry points have validated.

    Args:
        q, k, v: the q shard and all keys / values of ``info``'s (laid-out) frame (with
            ``kv_exchange``: the caller's local k, v, which ``kv_exchange.gather`` maps to them).
        info: forward ``MaskInfo`` with one kv shard; ``info_dkv``: its transposed view with
            ``config.block_shape_dkv`` (None for the xla backend).
        q_shard: which q shard of ``info`` (int or traced int).
        segment_ids: int32 ``SegmentIds(q=[q_shard], kv=[kv_len])`` or None.
        scale, logit_soft_cap, config: as in :func:`splash_forward`.
        sinks: per-head sink logits ``[heads]`` or None; inside ``shard_map`` their gradient over
            these rows is summed over the mesh axes the rows vary over and the sinks do not.
        partial_dtype: dtype the kernels write the gradients in before ``kv_exchange``'s sum and the
            cast to the input dtypes; None = q's dtype (the output is always written in q's dtype).
        return_residuals, return_max_logits: as in :func:`splash_attention` (max logits of
            these rows only: a sharded caller reduces them).
        kv_exchange: a :class:`KvExchange` (a strategy's collective) inside the custom VJP,
            whose ``reduce`` sees the gradients in ``partial_dtype``; None = k, v used as given.

    Returns:
        ``out``, or a tuple ``(out, [lse], [max_logits])`` as in :func:`splash_attention`.
    """
    kv_len = k.shape[1] if kv_exchange is None else jax.eval_shape(kv_exchange.gather, k).shape[1]
    _check_info(info, q.shape[1], kv_len, transpose=False)
    if info_dkv is not None:
        _check_info(info_dkv, q.shape[1], kv_len, transpose=True)
    backend = BackendStatic(info, info_dkv, default_scale(scale, q.shape[-1]),
                            None if logit_soft_cap is None else float(logit_soft_cap), config)
    traced = None if isinstance(q_shard, int) else jnp.asarray(q_shard, jnp.int32)
    static = _VjpStatic(backend, q_shard if traced is None else 0, partial_dtype,
                        frozenset() if sinks is None else vma(sinks), bool(return_residuals), bool(return_max_logits),
                        kv_exchange)
    return _attention(static, q, k, v, sinks, *segments_of(segment_ids), traced)
