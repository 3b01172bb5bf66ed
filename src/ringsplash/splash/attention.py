"""Splash attention: backend dispatch, custom VJP and the public entry points.

The backends share the interface of ``splash/backend_interface.py`` (``ForwardInputs`` /
``BackwardInputs`` traced records, ``BackendStatic`` settings): the Pallas kernels here
(``pallas_forward`` / ``pallas_backward``, backends ``interpret`` and ``mosaic_tpu``) and
the jnp implementation in ``splash/xla.py``.
"""

import dataclasses
import functools
import weakref
from typing import NamedTuple

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu
from jax.interpreters import batching, mlir

from ringsplash import _softmax
from ringsplash import masks as masks_lib
from ringsplash._checks import check_attention_call, check_divides
from ringsplash._types import Array, Float
from ringsplash.mask_info import MaskInfo, build_mask_info
from ringsplash.segment_ids import SegmentIds
from ringsplash.splash import kernel_backward, kernel_forward, segment_blocks, work_pieces
from ringsplash.splash import xla as xla_backend
from ringsplash.splash.backend_interface import BackendStatic, BackwardInputs, ForwardInputs
from ringsplash.splash.config import GENERIC_INTERPRETER, SplashConfig
from ringsplash.splash.vmem import forward_vmem, vmem_guard

# ----------------------------------------------------------------------------------------
# "mosaic_tpu" guard: a no-op on TPU, a clear error when lowered for anything else


_mosaic_guard_p = jex_core.Primitive("splash_mosaic_tpu_guard")
# An eager call compiles the primitive for the default device (jit), so it hits the lowering
# rules below too: a clear error off TPU, the identity on TPU.
_mosaic_guard_p.def_impl(lambda x: jax.jit(_mosaic_guard_p.bind)(x))
_mosaic_guard_p.def_abstract_eval(lambda x: x)
batching.primitive_batchers[_mosaic_guard_p] = lambda args, dims: (_mosaic_guard_p.bind(*args), dims[0])


def mosaic_tpu_guard(x):
    """``x``, unchanged on TPU; lowering it for any other platform raises a ValueError that
    names ``backend='mosaic_tpu'`` (instead of Mosaic's own error deep inside the kernel)."""
    return _mosaic_guard_p.bind(x)


def _guard_error(ctx, x):
    platforms = getattr(ctx.module_context, "platforms", None)
    raise ValueError(
        f"SplashConfig(backend='mosaic_tpu') compiles Pallas TPU kernels, but this computation is "
        f"being lowered for {platforms}; use backend='auto' (TPU kernels on TPU, the jnp "
        f"implementation elsewhere) or backend='interpret' (the TPU kernels interpreted on CPU)"
    )


mlir.register_lowering(_mosaic_guard_p, _guard_error)
mlir.register_lowering(_mosaic_guard_p, lambda ctx, x: [x], platform="tpu")


# ----------------------------------------------------------------------------------------
# per-MaskInfo kernel operands (host side, cached per MaskInfo object)


class StaticOperands(NamedTuple):
    """Host-side kernel operands of one MaskInfo."""

    masks: tuple  # per list: the 2-D mask whose mask_function the kernel evaluates, or None
    uses_fn: bool  # some partial block has no stored block (partial_index -1): positions needed
    blocks: np.ndarray | None  # int8 [num_partials, bq, bkv] partial blocks, or None
    blocks_t: np.ndarray | None  # the same transposed, [num_partials, bkv, bq] (dK/dV kernel)


_STATIC_CACHE: "weakref.WeakKeyDictionary[MaskInfo, StaticOperands]" = weakref.WeakKeyDictionary()


def _static_operands(info: MaskInfo) -> StaticOperands:
    if info in _STATIC_CACHE:
        return _STATIC_CACHE[info]
    needs_fn = info.list_partial_sources()[:, 1]  # every shard pair's, also for a rows-only MaskInfo
    blocks = info.partial_mask_blocks.astype(np.int8) if info.partial_mask_blocks.shape[0] else None
    ops = StaticOperands(
        masks=tuple(m if bool(n) else None for m, n in zip(info.masks, needs_fn)),
        uses_fn=bool(needs_fn.any()),
        blocks=blocks,
        blocks_t=None if blocks is None else np.ascontiguousarray(np.swapaxes(blocks, 1, 2)),
    )
    _STATIC_CACHE[info] = ops
    return ops


def _heads_to_list(info: MaskInfo, heads: int) -> np.ndarray:
    """The list of every q head, int32 ``[heads]``, on the host (the dK/dV kernel decides
    statically whether the heads of each GQA group share one list)."""
    h2l = np.asarray(info.head_to_list, np.int32)
    if h2l.shape[0] == 1:
        return np.broadcast_to(h2l, (heads,))
    if h2l.shape[0] != heads:
        raise ValueError(f"the MaskInfo has {h2l.shape[0]} mask heads, q has {heads=}")
    return h2l


def _interpret(config: SplashConfig, backend: str):
    """``pallas_call``'s ``interpret`` argument: False (Mosaic), True (the generic
    interpreter) or the TPU interpreter's ``InterpretParams``."""
    if backend != "interpret":
        return False
    if config.interpret_params == GENERIC_INTERPRETER:
        return True
    return config.interpret_params if config.interpret_params is not None else pltpu.InterpretParams()


def _as_col(x):
    return None if x is None else jnp.asarray(x, jnp.int32)[:, None]


def _as_row(x):
    return None if x is None else jnp.asarray(x, jnp.int32)[None, :]


def _mask_operands(ops: StaticOperands, q_pos, kv_pos, q_seg, kv_seg, *, transposed: bool) -> dict:
    """Keyword operands of a kernel wrapper: positions (only where the kernel evaluates a
    mask_function), segment ids and partial blocks, laid out for ``(q, kv)`` tiles or, when
    ``transposed``, ``(kv, q)`` tiles."""
    q_side, kv_side = (_as_row, _as_col) if transposed else (_as_col, _as_row)
    blocks = ops.blocks_t if transposed else ops.blocks
    return {
        "q_pos": q_side(q_pos) if ops.uses_fn else None,
        "kv_pos": kv_side(kv_pos) if ops.uses_fn else None,
        "q_seg": q_side(q_seg),
        "kv_seg": kv_side(kv_seg),
        "mask_blocks_t" if transposed else "mask_blocks": None if blocks is None else jnp.asarray(blocks),
        "masks": ops.masks,
    }


# ----------------------------------------------------------------------------------------
# Pallas backends (the interface of splash/backend_interface.py)


def pallas_forward(inputs: ForwardInputs, static: BackendStatic, *, backend: str = "interpret",
                   out_dtype=None, count_steps: bool = False, return_max_logits: bool = False):
    """The forward kernel on one shard pair; with ``return_max_logits`` also the per-head max
    raw logit, with ``count_steps`` (last) the number of computing grid steps per head."""
    q, config, info = inputs.q, static.config, static.info
    if backend == "mosaic_tpu":
        q = mosaic_tpu_guard(q)
        q = vmem_guard(q, forward_vmem(q, inputs.k, inputs.v, info.block_shape, out_dtype=out_dtype,
                                       vmem_limit_bytes=config.vmem_limit_bytes,
                                       mask_blocks=_static_operands(info).blocks is not None))
    return kernel_forward.splash_forward_kernel(
        q, inputs.k, inputs.v, inputs.schedule, _heads_to_list(info, q.shape[0]),
        **_mask_operands(_static_operands(info), inputs.q_pos, inputs.kv_pos, inputs.q_seg, inputs.kv_seg,
                         transposed=False),
        block_shape=info.block_shape, block_kv_compute=min(config.block_kv_compute, info.block_shape[1]),
        scale=static.scale, logit_soft_cap=static.logit_soft_cap, out_dtype=out_dtype,
        probs_dtype=config.matmul_dtype(q.dtype), interpret=_interpret(config, backend),
        vmem_limit_bytes=config.vmem_limit_bytes, count_steps=count_steps, return_max_logits=return_max_logits,
    )


def pallas_backward(inputs: BackwardInputs, static: BackendStatic, *, backend: str = "interpret",
                    grad_dtype=jnp.float32, count_steps: bool = False, parts: tuple = ("dq", "dkv")):
    """The dq and dK/dV kernels on one shard pair: ``(dq, dk, dv)`` in ``grad_dtype`` (with
    ``count_steps`` also the computing steps of each kernel). ``parts=("dq",)`` runs only the
    dq kernel and returns ``dq``; ``parts=("dkv",)`` only the dK/dV kernel: ``(dk, dv)``."""
    q, config, info, info_dkv = inputs.q, static.config, static.info, static.info_dkv
    if backend == "mosaic_tpu":
        q = mosaic_tpu_guard(q)
    if "dkv" in parts and (info_dkv is None or inputs.schedule_dkv is None):
        raise ValueError("the Pallas backward needs the transposed MaskInfo (info_dkv) and its schedule")
    heads = q.shape[0]
    common = {
        "scale": static.scale, "logit_soft_cap": static.logit_soft_cap, "out_dtype": grad_dtype,
        "probs_dtype": config.matmul_dtype(q.dtype), "interpret": _interpret(config, backend),
        "vmem_limit_bytes": config.vmem_limit_bytes, "count_steps": count_steps,
    }
    positions = (inputs.q_pos, inputs.kv_pos, inputs.q_seg, inputs.kv_seg)
    operands = (q, inputs.k, inputs.v, inputs.d_out, inputs.lse, inputs.delta)
    if parts == ("dkv",):  # pieces of the transposed view (splash/work_pieces.py)
        return kernel_backward.splash_dkv_kernel(
            *operands, inputs.schedule_dkv, _heads_to_list(info_dkv, heads),
            **_mask_operands(_static_operands(info_dkv), *positions, transposed=True),
            block_shape=info_dkv.block_shape, **common,
        )
    dq = kernel_backward.splash_dq_kernel(
        *operands, inputs.schedule, _heads_to_list(info, heads),
        **_mask_operands(_static_operands(info), *positions, transposed=False),
        block_shape=info.block_shape, **common,
    )
    if parts == ("dq",):
        return dq
    dkv = kernel_backward.splash_dkv_kernel(
        *operands, inputs.schedule_dkv, _heads_to_list(info_dkv, heads),
        **_mask_operands(_static_operands(info_dkv), *positions, transposed=True),
        block_shape=info_dkv.block_shape, **common,
    )
    if count_steps:
        (dq, count_dq), (dk, dv, count_dkv) = dq, dkv
        return dq, dk, dv, count_dq, count_dkv
    return dq, *dkv


# ----------------------------------------------------------------------------------------
# dispatch by backend


def _dispatch(backend: str, inputs, xla_fn, pallas_fn):
    """``xla_fn(inputs)`` or ``pallas_fn(kernel_backend)(inputs)`` by ``config.backend``;
    ``"auto"`` decides when the computation is lowered, by the lowering platform."""
    if backend == "xla":
        return xla_fn(inputs)
    if backend in ("interpret", "mosaic_tpu"):
        return pallas_fn(backend)(inputs)
    return jax.lax.platform_dependent(inputs, tpu=pallas_fn("mosaic_tpu"), default=xla_fn)


def _refine(schedule, info, q_seg, kv_seg, config):
    """``schedule`` refined by the segment ids and compacted (``splash/segment_blocks.py``),
    or unchanged without segment ids / with ``config.segment_skipping`` off."""
    if schedule is None or info is None or q_seg is None or not config.segment_skipping:
        return schedule
    return segment_blocks.refine_schedule(schedule, q_seg, kv_seg, info.block_shape, transpose=info.transpose)


def _dispatch_forward(inputs: ForwardInputs, static: BackendStatic, *, out_dtype=None,
                      return_max_logits: bool = False, pieces: work_pieces.PieceSchedules | None = None):
    # each piece is refined on its own q rows (work_pieces.py: the piece's sliced inputs)
    refine = lambda x: x._replace(schedule=_refine(x.schedule, static.info, x.q_seg, x.kv_seg, static.config))
    if pieces is None:
        inputs = refine(inputs)

    def xla_fn(x):
        one = lambda s: xla_backend.forward(s, static, out_dtype=out_dtype, return_max_logits=return_max_logits)
        if pieces is not None:  # work lists beyond the budget: one call per piece (work_pieces.py)
            return work_pieces.forward_in_pieces(x, pieces, static.info.block_shape[0], lambda s: one(refine(s)))
        return one(x)

    def pallas_fn(backend):
        one = lambda s: pallas_forward(s, static, backend=backend, out_dtype=out_dtype,
                                       return_max_logits=return_max_logits)
        if pieces is not None:
            return lambda x: work_pieces.forward_in_pieces(x, pieces, static.info.block_shape[0],
                                                           lambda s: one(refine(s)))
        return one

    return _dispatch(static.config.backend, inputs, xla_fn, pallas_fn)


def _dispatch_backward(inputs: BackwardInputs, static: BackendStatic, *, grad_dtype,
                       pieces: work_pieces.PieceSchedules | None = None,
                       pieces_dkv: work_pieces.PieceSchedules | None = None, accumulate=None):
    # each piece is refined on its own rows (work_pieces.py: the piece's sliced inputs)
    refine_q = lambda x: x._replace(schedule=_refine(x.schedule, static.info, x.q_seg, x.kv_seg, static.config))
    refine_kv = lambda x: x._replace(schedule_dkv=_refine(x.schedule_dkv, static.info_dkv, x.q_seg, x.kv_seg,
                                                          static.config))
    if pieces is None:
        inputs = refine_kv(refine_q(inputs))

    def xla_fn(x):
        if pieces is not None:  # the fused xla backward walks the forward view's pieces
            grads = work_pieces.dq_in_pieces(x, pieces, static.info.block_shape[0],
                                             lambda s: xla_backend.backward(refine_q(s), static), acc=accumulate)
            return tuple(g.astype(grad_dtype) for g in grads)
        return tuple(g.astype(grad_dtype) for g in xla_backend.backward(x, static))

    def pallas_fn(backend):
        if pieces is not None and pieces_dkv is not None:
            run = functools.partial(pallas_backward, static=static, backend=backend, grad_dtype=grad_dtype)
            return lambda x: work_pieces.kernels_in_pieces(
                x, pieces, pieces_dkv, static.info.block_shape[0], static.info_dkv.block_shape[1],
                lambda s: run(refine_q(s), parts=("dq",)), lambda s: run(refine_kv(s), parts=("dkv",)),
                acc=accumulate)
        if accumulate is not None:
            return lambda x: tuple(a + g for a, g in zip(accumulate, pallas_backward(x, static, backend=backend,
                                                                                     grad_dtype=grad_dtype)))
        return lambda x: pallas_backward(x, static, backend=backend, grad_dtype=grad_dtype)

    return _dispatch(static.config.backend, inputs, xla_fn, pallas_fn)


# ----------------------------------------------------------------------------------------
# shard-pair entry points (used by the ring)


def _local_positions(positions, info_positions, shard, shards, local_len):
    if positions is not None:
        return jnp.asarray(positions, jnp.int32)
    allpos = jnp.asarray(info_positions, jnp.int32)
    if shards == 1:
        return allpos
    return jax.lax.dynamic_slice_in_dim(allpos, shard * local_len, local_len)


def _segments(segment_ids):
    """int32 (q, kv) ids from ids already normalised by ``check_attention_call`` (or None)."""
    return (None, None) if segment_ids is None else (segment_ids.q, segment_ids.kv)


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
            :func:`splash_attention`; ``-inf`` where the pair attends nothing for a head), from
            the same forward pass. Not differentiable (``stop_gradient``).
        pieces: this pair's work lists in pieces (``work_pieces.PieceSchedules``, e.g. from a
            ring's per-device schedule); None = ``info``'s, split under ``config``'s budget.

    Returns:
        ``(out [heads, q_shard, dv], lse float32 [heads, q_shard])``, and float32
        ``max_logits [heads]`` third with ``return_max_logits``.
    """
    call = check_attention_call(q, k, v, segment_ids=segment_ids, scale=scale, logit_soft_cap=logit_soft_cap,
                                config=config, config_type=SplashConfig, same_dtype=True,
                                return_max_logits=return_max_logits)
    q_len, kv_len = call.q_len, call.kv_len
    _check_info(info, q_len, kv_len, transpose=False)
    q_pos = _local_positions(q_positions, info.q_positions, q_shard, info.q_shards, q_len)
    kv_pos = _local_positions(kv_positions, info.kv_positions, kv_shard, info.kv_shards, kv_len)
    q_seg, kv_seg = _segments(call.segment_ids)
    if pieces is None:
        pieces = work_pieces.info_pieces(info, config, q.shape[0], q_shard, kv_shard)
    inputs = ForwardInputs(q, k, v, pieces.schedules[0], q_pos, kv_pos, q_seg, kv_seg)
    static = BackendStatic(info, None, call.scale, call.logit_soft_cap, config)
    if return_max_logits:
        out, lse, mx = _dispatch_forward(inputs, static, out_dtype=out_dtype, return_max_logits=True, pieces=pieces)
        return out, lse, jax.lax.stop_gradient(mx)
    return _dispatch_forward(inputs, static, out_dtype=out_dtype, pieces=pieces)


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
) -> tuple[Float[Array, "heads q_shard d"], Float[Array, "kv_heads kv_shard d"], Float[Array, "kv_heads kv_shard dv"]]:
    """float32 ``(dq, dk, dv)`` of one shard pair.

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

    Returns:
        float32 ``(dq [heads, q_shard, d], dk [kv_heads, kv_shard, d], dv [kv_heads, kv_shard, dv])``.
    """
    call = check_attention_call(q, k, v, segment_ids=segment_ids, scale=scale, logit_soft_cap=logit_soft_cap,
                                config=config, config_type=SplashConfig, same_dtype=True)
    q_len, kv_len = call.q_len, call.kv_len
    _check_info(info, q_len, kv_len, transpose=False)
    if info_dkv is not None:
        _check_info(info_dkv, q_len, kv_len, transpose=True)
    q_pos = _local_positions(q_positions, info.q_positions, q_shard, info.q_shards, q_len)
    kv_pos = _local_positions(kv_positions, info.kv_positions, kv_shard, info.kv_shards, kv_len)
    q_seg, kv_seg = _segments(call.segment_ids)
    if pieces is None:
        pieces = work_pieces.info_pieces(info, config, q.shape[0], q_shard, kv_shard)
    if pieces_dkv is None and info_dkv is not None:
        pieces_dkv = work_pieces.info_pieces_dkv(info_dkv, config, q.shape[0], k.shape[0], q_shard, kv_shard)
    sched_dkv = None if pieces_dkv is None else pieces_dkv.schedules[0]
    inputs = BackwardInputs(q, k, v, d_out, lse, delta, pieces.schedules[0], sched_dkv,
                            q_pos, kv_pos, q_seg, kv_seg)
    static = BackendStatic(info, info_dkv, call.scale, call.logit_soft_cap, config)
    return _dispatch_backward(inputs, static, grad_dtype=jnp.float32, pieces=pieces, pieces_dkv=pieces_dkv,
                              accumulate=accumulate)


def _check_info(info, q_len, kv_len, *, transpose):
    if not isinstance(info, MaskInfo):
        raise TypeError(f"info must be a ringsplash.MaskInfo, got {type(info).__name__}")
    if info.transpose != transpose:
        raise ValueError(f"expected a MaskInfo built with transpose={transpose}, got transpose={info.transpose}")
    local = (info.q_len // info.q_shards, info.kv_len // info.kv_shards)
    if local != (q_len, kv_len):
        raise ValueError(f"the MaskInfo's shard shape (q, kv)={local} does not match {q_len=}, {kv_len=}")


# ----------------------------------------------------------------------------------------
# custom VJP over the whole (unsharded) attention, sinks included


@dataclasses.dataclass(frozen=True)
class _VjpStatic:
    """Non-differentiable settings of ``_attention`` (hashable)."""

    backend: BackendStatic
    return_residuals: bool
    return_max_logits: bool = False


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(static: _VjpStatic, q, k, v, sinks, q_seg, kv_seg):
    return _attention_fwd(static, q, k, v, sinks, q_seg, kv_seg)[0]


def _attention_fwd(static: _VjpStatic, q, k, v, sinks, q_seg, kv_seg):
    info = static.backend.info
    pieces = work_pieces.info_pieces(info, static.backend.config, q.shape[0])
    inputs = ForwardInputs(q, k, v, pieces.schedules[0], jnp.asarray(info.q_positions),
                           jnp.asarray(info.kv_positions), q_seg, kv_seg)
    mx = ()
    if static.return_max_logits:  # from the same forward pass; carries no gradient (see _attention_bwd)
        out, lse, mx = _dispatch_forward(inputs, static.backend, return_max_logits=True, pieces=pieces)
        mx = (jax.lax.stop_gradient(mx),)
    else:
        out, lse = _dispatch_forward(inputs, static.backend, pieces=pieces)
    if sinks is not None:  # sinks join the denominator only (docs/INTERNALS.md)
        out, lse = _softmax.fold_sinks(out, lse, sinks)
        out = out.astype(q.dtype)
    result = (out, lse) if static.return_residuals else out
    if static.return_max_logits:
        result = (*(result if static.return_residuals else (result,)), *mx)
    return result, (q, k, v, sinks, q_seg, kv_seg, out, lse)


def _attention_bwd(static: _VjpStatic, residuals, g):
    info, info_dkv = static.backend.info, static.backend.info_dkv
    q, k, v, sinks, q_seg, kv_seg, out, lse = residuals
    if static.return_max_logits:  # the max logits' cotangent is dropped: they carry no gradient
        g = g[:-1] if static.return_residuals else g[0]
    d_out, d_lse = g if static.return_residuals else (g, None)
    delta = _softmax.delta(d_out, out, d_lse)
    config = static.backend.config
    pieces = work_pieces.info_pieces(info, config, q.shape[0])
    pieces_dkv = None if info_dkv is None else work_pieces.info_pieces_dkv(info_dkv, config, q.shape[0], k.shape[0])
    inputs = BackwardInputs(q, k, v, d_out.astype(q.dtype), lse, delta, pieces.schedules[0],
                            None if pieces_dkv is None else pieces_dkv.schedules[0],
                            jnp.asarray(info.q_positions), jnp.asarray(info.kv_positions), q_seg, kv_seg)
    dq, dk, dv = _dispatch_backward(inputs, static.backend, grad_dtype=q.dtype, pieces=pieces, pieces_dkv=pieces_dkv)
    d_sinks = None if sinks is None else _softmax.sinks_grad(sinks, lse, delta).astype(sinks.dtype)
    return dq, dk, dv, d_sinks, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def _effective_block(block: int, length: int) -> int:
    return length if length < block else block


def splash_attention(
    q: Float[Array, "heads q_len d"],
    k: Float[Array, "kv_heads kv_len d"],
    v: Float[Array, "kv_heads kv_len dv"],
    mask: masks_lib.AnyMask | None = None,
    *,
    segment_ids: SegmentIds | None = None,
    scale: float | None = None,
    logit_soft_cap: float | None = None,
    sinks: Float[Array, " heads"] | None = None,
    config: SplashConfig = SplashConfig(),
    return_residuals: bool = False,
    return_max_logits: bool = False,
):
    """Block-sparse attention with the shapes and semantics of ``reference_attention``.

    Differentiable in q, k, v and sinks (custom VJP). MaskInfos are built on the host at
    trace time (cached). A block longer than its sequence shrinks to the sequence length.

    Args:
        q: queries ``[heads, q_len, d]``, floating point (per example; batch with ``jax.vmap``).
        k: keys ``[kv_heads, kv_len, d]``, the dtype of ``q``; ``kv_heads`` divides ``heads``.
        v: values ``[kv_heads, kv_len, dv]``, the dtype of ``k``; ``dv`` (the output's head size)
            may differ from ``d`` (e.g. MLA: q/k 192, v 128).
        mask: a ``ringsplash.masks`` mask of shape ``(q_len, kv_len)`` (``MultiHeadMask``: one
            per head), or None to attend everything.
        segment_ids: ``SegmentIds(q=[q_len], kv=[kv_len])`` integer ids; a query attends only
            keys with an equal id. Concrete ids of any integer dtype are compared exactly;
            traced ids must fit int32.
        scale: positive multiplier of ``q k^T``; None means ``1 / sqrt(d)``.
        logit_soft_cap: None, or a positive cap ``c``: logits become ``c * tanh(logits / c)``.
        sinks: floating ``[heads]`` per-head sink logits that join each row's softmax
            denominator only, or None.
        config: ``SplashConfig`` (block sizes, backend).
        return_residuals: also return ``lse`` (float32 ``[heads, q_len]``, natural log, sinks
            included); ``lse`` is differentiable too.
        return_max_logits: also return float32 ``max_logits [heads]``: per q head, the largest
            ``scale · q·k`` over the (query, key) pairs it attends (mask and segment ids
            applied), *before* the soft-cap, without the sinks (they are not q·k logits);
            ``-inf`` for a head that attends nothing. Computed by the forward pass itself (no
            extra pass over K/V); carries no gradient (``stop_gradient``, its cotangent is
            dropped). For QK-clip (``TransformerConfig.qk_clip_threshold``).

    Returns:
        ``out`` (``q.dtype``, ``[heads, q_len, dv]``), ``(out, lse)``, ``(out, max_logits)`` or
        ``(out, lse, max_logits)``.
    """
    call = check_attention_call(q, k, v, mask=mask, segment_ids=segment_ids, scale=scale,
                                logit_soft_cap=logit_soft_cap, sinks=sinks, config=config,
                                config_type=SplashConfig, same_dtype=True, return_max_logits=return_max_logits)
    q_len, kv_len = call.q_len, call.kv_len
    if mask is None:
        mask = masks_lib.FullMask((q_len, kv_len))
    bq, bkv = _effective_block(config.block_q, q_len), _effective_block(config.block_kv, kv_len)
    bq_dkv, bkv_dkv = _effective_block(config.block_q_dkv, q_len), _effective_block(config.block_kv_dkv, kv_len)
    for name, block, length, lname in (("block_q", bq, q_len, "q_len"), ("block_kv", bkv, kv_len, "kv_len"),
                                       ("block_q_dkv", bq_dkv, q_len, "q_len"),
                                       ("block_kv_dkv", bkv_dkv, kv_len, "kv_len")):
        check_divides(name, block, lname, length)
    info = build_mask_info(mask, (bq, bkv))
    info_dkv = None if config.backend == "xla" else build_mask_info(mask, (bq_dkv, bkv_dkv), transpose=True)
    q_seg, kv_seg = _segments(call.segment_ids)
    static = _VjpStatic(BackendStatic(info, info_dkv, call.scale, call.logit_soft_cap, config),
                        bool(return_residuals), bool(return_max_logits))
    return _attention(static, q, k, v, sinks, q_seg, kv_seg)
