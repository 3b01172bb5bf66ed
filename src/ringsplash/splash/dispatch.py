"""One shard pair through the backend ``SplashConfig.backend`` names, work-list piece by piece.

The backends share the interface of ``splash/backend_interface.py`` (``ForwardInputs`` /
``BackwardInputs`` traced records, ``BackendStatic`` settings): the Pallas kernels in
``splash/pallas.py`` (backends ``interpret`` and ``mosaic_tpu``) and the jnp implementation in
``splash/xla.py``; ``"auto"`` picks by the lowering platform. With segment ids each piece's work
list is refined on device first (``splash/segment_blocks.py``).
"""

import functools

import jax
import jax.numpy as jnp

from ringsplash.blocksparse.mask_info import MaskInfo
from ringsplash.splash import pallas, segment_blocks, work_pieces
from ringsplash.splash import xla as xla_backend
from ringsplash.splash.backend_interface import BackendStatic, BackwardInputs, ForwardInputs

__all__ = ["pair_backward", "pair_forward", "segments_of"]


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


def _pair_positions(info: MaskInfo, q_len, kv_len, q_shard, kv_shard, q_positions, kv_positions):
    """int32 original positions of the pair's rows and columns: given, or sliced from ``info``."""

    def one(given, every, shard, shards, n):
        if given is not None:
            return jnp.asarray(given, jnp.int32)
        every = jnp.asarray(every, jnp.int32)
        return every if shards == 1 else jax.lax.dynamic_slice_in_dim(every, shard * n, n)

    return (one(q_positions, info.q_positions, q_shard, info.q_shards, q_len),
            one(kv_positions, info.kv_positions, kv_shard, info.kv_shards, kv_len))


def segments_of(segment_ids):
    """int32 (q, kv) ids from ids already normalised by ``check_attention_call`` (or None)."""
    return (None, None) if segment_ids is None else (segment_ids.q, segment_ids.kv)


def pair_forward(static: BackendStatic, q, k, v, q_seg, kv_seg, *, q_shard=0, kv_shard=0, q_positions=None,
             kv_positions=None, out_dtype=None, return_max_logits: bool = False,
             pieces: work_pieces.PieceSchedules | None = None):
    """Sink-free ``(out, lse)`` (and ``max_logits``, no gradient) of one shard pair through the
    backend of ``static.config``, one call per work-list piece (``work_pieces.py``)."""
    info, config = static.info, static.config
    if pieces is None:
        pieces = work_pieces.info_pieces(info, config, q.shape[0], q_shard, kv_shard)
    positions = _pair_positions(info, q.shape[1], k.shape[1], q_shard, kv_shard, q_positions, kv_positions)
    inputs = ForwardInputs(q, k, v, pieces.schedules[0], *positions, q_seg, kv_seg)
    # each piece is refined on its own q rows (work_pieces.py: the piece's sliced inputs)
    refine = lambda x: x._replace(schedule=_refine(x.schedule, info, x.q_seg, x.kv_seg, config))
    in_pieces = lambda one: lambda x: work_pieces.forward_in_pieces(x, pieces, info.block_shape[0],
                                                                    lambda s: one(refine(s)))
    kw = {"out_dtype": out_dtype, "return_max_logits": return_max_logits}
    out, lse, *mx = _dispatch(config.backend, inputs, in_pieces(lambda s: xla_backend.forward(s, static, **kw)),
                              lambda backend: in_pieces(lambda s: pallas.forward(s, static, backend=backend, **kw)))
    return (out, lse, jax.lax.stop_gradient(mx[0])) if return_max_logits else (out, lse)


def pair_backward(static: BackendStatic, q, k, v, d_out, lse, delta, q_seg, kv_seg, *, q_shard=0, kv_shard=0,
              q_positions=None, kv_positions=None, grad_dtype=jnp.float32,
              pieces: work_pieces.PieceSchedules | None = None,
              pieces_dkv: work_pieces.PieceSchedules | None = None, accumulate=None, parts=("dq", "dkv"),
              fused: bool = True):
    """``(dq, dk, dv)`` in ``grad_dtype`` of one shard pair through the backend of
    ``static.config``, piece by piece (added into ``accumulate`` when given); ``parts`` and
    ``fused`` as in ``attention.splash_backward``."""
    info, info_dkv, config = static.info, static.info_dkv, static.config
    if pieces is None:
        pieces = work_pieces.info_pieces(info, config, q.shape[0], q_shard, kv_shard)
    if pieces_dkv is None and info_dkv is not None:
        pieces_dkv = work_pieces.info_pieces_dkv(info_dkv, config, q.shape[0], k.shape[0], q_shard, kv_shard)
    inputs = BackwardInputs(q, k, v, d_out, lse, delta, pieces.schedules[0],
                            None if pieces_dkv is None else pieces_dkv.schedules[0],
                            *_pair_positions(info, q.shape[1], k.shape[1], q_shard, kv_shard, q_positions,
                                             kv_positions), q_seg, kv_seg)
    # each piece is refined on its own rows (work_pieces.py: the piece's sliced inputs)
    refine_q = lambda x: x._replace(schedule=_refine(x.schedule, info, x.q_seg, x.kv_seg, config))
    refine_kv = lambda x: x._replace(schedule_dkv=_refine(x.schedule_dkv, info_dkv, x.q_seg, x.kv_seg, config))

    def xla_fn(x):  # the fused xla backward walks the forward view's pieces
        grads = work_pieces.dq_in_pieces(x, pieces, info.block_shape[0],
                                         lambda s: xla_backend.backward(refine_q(s), static), acc=accumulate)
        return tuple(g.astype(grad_dtype) for g in grads)

    def pallas_fn(backend):
        run = functools.partial(pallas.backward, static=static, backend=backend, grad_dtype=grad_dtype)
        if pieces_dkv is None:
            return run  # raises: the Pallas backward needs the transposed MaskInfo

        def fused_backward(x):  # dq accumulated by the dK/dV kernel, chained through its pieces
            dq, dk, dv = work_pieces.fused_in_pieces(
                x, pieces_dkv, info_dkv.block_shape[1], lambda s, dq: run(refine_kv(s), dq_init=dq), acc=accumulate)
            return (dq if accumulate is not None else dq.astype(grad_dtype)), dk, dv

        if parts == ("dq", "dkv") and fused:
            return fused_backward
        return lambda x: work_pieces.kernels_in_pieces(
            x, pieces, pieces_dkv, info.block_shape[0], info_dkv.block_shape[1],
            (lambda s: run(refine_q(s), parts=("dq",))) if "dq" in parts else None,
            (lambda s: run(refine_kv(s), parts=("dkv",))) if "dkv" in parts else None, acc=accumulate)

    return _dispatch(config.backend, inputs, xla_fn, pallas_fn)
