"""Splash attention: backend dispatch, custom VJP and the public entry points.

Internal backend interface (shared with ``splash/xla.py``), one shard pair, no sinks::

    forward(q, k, v, info, schedule, q_pos, kv_pos, q_seg, kv_seg, *,
            scale, logit_soft_cap, config) -> (out [heads, q_len, d] in q.dtype,
                                               lse [heads, q_len] float32)
    (both forwards also take ``out_dtype``, None = q's dtype)
    backward(q, k, v, d_out, lse, delta, info, schedule, info_dkv, schedule_dkv,
             q_pos, kv_pos, q_seg, kv_seg, *, scale, logit_soft_cap, config)
        -> (dq, dk, dv) float32

``info`` / ``info_dkv`` are MaskInfos (static metadata; ``info_dkv`` transposed, blocks
``config.block_shape_dkv``), ``schedule`` / ``schedule_dkv`` their ``BlockSchedule`` for the
shard pair (possibly traced), positions int32 ``[q_len]`` / ``[kv_len]`` of the local rows /
columns, segment ids int32 or None.
"""

import functools
import weakref

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu
from jax._src import dispatch
from jax.interpreters import batching, mlir

from ringsplash import masks as masks_lib
from ringsplash._checks import check_attention_inputs, check_segment_ids, default_scale
from ringsplash._types import Array, Float
from ringsplash.mask_info import MaskInfo, build_mask_info
from ringsplash.masks import PARTIAL
from ringsplash.segment_ids import SegmentIds
from ringsplash.splash import kernel_backward, kernel_forward
from ringsplash.splash import xla as xla_backend
from ringsplash.splash.config import SplashConfig

# ----------------------------------------------------------------------------------------
# "mosaic_tpu" guard: a no-op on TPU, a clear error when lowered for anything else


_mosaic_guard_p = jex_core.Primitive("splash_mosaic_tpu_guard")
# eager calls compile the primitive for the default device, so they hit the lowering too
_mosaic_guard_p.def_impl(functools.partial(dispatch.apply_primitive, _mosaic_guard_p))
_mosaic_guard_p.def_abstract_eval(lambda x: x)
batching.primitive_batchers[_mosaic_guard_p] = lambda args, dims: (_mosaic_guard_p.bind(*args), dims[0])


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

_STATIC_CACHE: "weakref.WeakKeyDictionary[MaskInfo, dict]" = weakref.WeakKeyDictionary()


def _static_operands(info: MaskInfo) -> dict:
    """int8 partial blocks (also transposed) and, per list, the mask to evaluate in kernel."""
    if info in _STATIC_CACHE:
        return _STATIC_CACHE[info]
    needs_fn = np.any((info.kind == PARTIAL) & (info.partial_index < 0), axis=(1, 2, 3))
    blocks = info.partial_mask_blocks.astype(np.int8) if info.partial_mask_blocks.shape[0] else None
    ops = {
        "masks": tuple(m if bool(n) else None for m, n in zip(info.masks, needs_fn)),
        "uses_fn": bool(needs_fn.any()),
        "blocks": blocks,
        "blocks_t": None if blocks is None else np.ascontiguousarray(np.swapaxes(blocks, 1, 2)),
    }
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
    if backend == "interpret":
        return config.interpret_params if config.interpret_params is not None else pltpu.InterpretParams()
    return False


# ----------------------------------------------------------------------------------------
# Pallas backends (same signatures as splash/xla.py, plus the gradient dtype)


def pallas_forward(q, k, v, info, schedule, q_pos, kv_pos, q_seg, kv_seg, *,
                   scale, logit_soft_cap, config, backend="interpret", count_steps=False, out_dtype=None):
    ops = _static_operands(info)
    if backend == "mosaic_tpu":
        q = _mosaic_guard_p.bind(q)
    as_col = lambda x: None if x is None else jnp.asarray(x, jnp.int32)[:, None]
    as_row = lambda x: None if x is None else jnp.asarray(x, jnp.int32)[None, :]
    return kernel_forward.splash_forward_kernel(
        q, k, v, schedule, _heads_to_list(info, q.shape[0]),
        q_pos=as_col(q_pos) if ops["uses_fn"] else None,
        kv_pos=as_row(kv_pos) if ops["uses_fn"] else None,
        q_seg=as_col(q_seg), kv_seg=as_row(kv_seg),
        mask_blocks=None if ops["blocks"] is None else jnp.asarray(ops["blocks"]),
        masks=ops["masks"], block_shape=info.block_shape,
        block_kv_compute=min(config.block_kv_compute, info.block_shape[1]),
        scale=default_scale(scale, q.shape[-1]), logit_soft_cap=logit_soft_cap, out_dtype=out_dtype,
        probs_dtype=config.matmul_dtype(q.dtype), interpret=_interpret(config, backend), vmem_limit_bytes=config.vmem_limit_bytes,
        count_steps=count_steps,
    )


def pallas_backward(q, k, v, d_out, lse, delta, info, schedule, info_dkv, schedule_dkv,
                    q_pos, kv_pos, q_seg, kv_seg, *, scale, logit_soft_cap, config,
                    backend="interpret", grad_dtype=jnp.float32, count_steps=False):
    if backend == "mosaic_tpu":
        q = _mosaic_guard_p.bind(q)
    if info_dkv is None or schedule_dkv is None:
        raise ValueError("the Pallas backward needs the transposed MaskInfo (info_dkv) and its schedule")
    heads = q.shape[0]
    scale = default_scale(scale, q.shape[-1])
    interpret = _interpret(config, backend)
    as_col = lambda x: None if x is None else jnp.asarray(x, jnp.int32)[:, None]
    as_row = lambda x: None if x is None else jnp.asarray(x, jnp.int32)[None, :]
    common = dict(scale=scale, logit_soft_cap=logit_soft_cap, out_dtype=grad_dtype,
                  probs_dtype=config.matmul_dtype(q.dtype),
                  interpret=interpret, vmem_limit_bytes=config.vmem_limit_bytes, count_steps=count_steps)

    ops = _static_operands(info)
    dq = kernel_backward.splash_dq_kernel(
        q, k, v, d_out, lse, delta, schedule, _heads_to_list(info, heads),
        q_pos=as_col(q_pos) if ops["uses_fn"] else None,
        kv_pos=as_row(kv_pos) if ops["uses_fn"] else None,
        q_seg=as_col(q_seg), kv_seg=as_row(kv_seg),
        mask_blocks=None if ops["blocks"] is None else jnp.asarray(ops["blocks"]),
        masks=ops["masks"], block_shape=info.block_shape, **common,
    )
    ops_t = _static_operands(info_dkv)
    dkv = kernel_backward.splash_dkv_kernel(
        q, k, v, d_out, lse, delta, schedule_dkv, _heads_to_list(info_dkv, heads),
        q_pos=as_row(q_pos) if ops_t["uses_fn"] else None,
        kv_pos=as_col(kv_pos) if ops_t["uses_fn"] else None,
        q_seg=as_row(q_seg), kv_seg=as_col(kv_seg),
        mask_blocks_t=None if ops_t["blocks_t"] is None else jnp.asarray(ops_t["blocks_t"]),
        masks=ops_t["masks"], block_shape=info_dkv.block_shape, **common,
    )
    if count_steps:
        (dq, count_dq), (dk, dv, count_dkv) = dq, dkv
        return dq, dk, dv, count_dq, count_dkv
    return dq, *dkv


# ----------------------------------------------------------------------------------------
# dispatch by backend


def _dispatch_forward(args, *, scale, logit_soft_cap, config, out_dtype=None):
    kw = dict(scale=scale, logit_soft_cap=logit_soft_cap, config=config)
    xla_fn = lambda *a: xla_backend.forward(*a, **kw, out_dtype=out_dtype)
    pallas_fn = lambda backend: (lambda *a: pallas_forward(*a, **kw, backend=backend, out_dtype=out_dtype))
    return _dispatch(config.backend, args, xla_fn, pallas_fn)


def _dispatch_backward(args, *, scale, logit_soft_cap, config, grad_dtype):
    kw = dict(scale=scale, logit_soft_cap=logit_soft_cap, config=config)

    def xla_fn(*a):
        return tuple(g.astype(grad_dtype) for g in xla_backend.backward(*a, **kw))

    pallas_fn = lambda backend: (lambda *a: pallas_backward(*a, **kw, backend=backend, grad_dtype=grad_dtype))
    return _dispatch(config.backend, args, xla_fn, pallas_fn)


def _dispatch(backend, args, xla_fn, pallas_fn):
    """Call a backend on ``args`` (a tuple whose MaskInfos / None stay static)."""
    static = [i for i, a in enumerate(args) if a is None or isinstance(a, MaskInfo)]
    dynamic = [a for i, a in enumerate(args) if i not in static]

    def call(fn):
        def run(*dyn):
            it = iter(dyn)
            return fn(*[args[i] if i in static else next(it) for i in range(len(args))])

        return run

    if backend == "xla":
        return call(xla_fn)(*dynamic)
    if backend in ("interpret", "mosaic_tpu"):
        return call(pallas_fn(backend))(*dynamic)
    # "auto": decided when the computation is lowered, by the lowering platform
    return jax.lax.platform_dependent(*dynamic, tpu=call(pallas_fn("mosaic_tpu")), default=call(xla_fn))


# ----------------------------------------------------------------------------------------
# shard-pair entry points (used by the ring)


def _local_positions(positions, info_positions, shard, shards, local_len):
    if positions is not None:
        return jnp.asarray(positions, jnp.int32)
    allpos = jnp.asarray(info_positions, jnp.int32)
    if shards == 1:
        return allpos
    return jax.lax.dynamic_slice_in_dim(allpos, shard * local_len, local_len)


def _segments(segment_ids, q_len, kv_len):
    if segment_ids is None:
        return None, None
    check_segment_ids(segment_ids, q_len, kv_len)
    return jnp.asarray(segment_ids.q, jnp.int32), jnp.asarray(segment_ids.kv, jnp.int32)


def splash_forward(
    q: Float[Array, "heads q_shard d"],
    k: Float[Array, "kv_heads kv_shard d"],
    v: Float[Array, "kv_heads kv_shard d"],
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
) -> tuple[Float[Array, "heads q_shard d"], Float[Array, "heads q_shard"]]:
    """Sink-free ``(out, lse)`` of the local q shard against the local kv shard.

    ``info`` is built with ``(config.block_q, config.block_kv)``; ``q_shard``/``kv_shard``
    (ints or traced) pick its shard-pair work list; positions default to the shard's slice
    of ``info.q_positions`` / ``info.kv_positions``; ``segment_ids`` are the local ones.
    ``out`` has ``out_dtype`` (None = q's dtype; ``jnp.float32`` gives a ring unrounded
    partial outputs; both backends write it directly from their float32 accumulators).
    """
    heads, q_len, kv_len, d = q.shape[0], q.shape[1], k.shape[1], q.shape[2]
    check_attention_inputs(q, k, v, same_dtype=True)
    _check_info(info, q_len, kv_len, transpose=False)
    q_pos = _local_positions(q_positions, info.q_positions, q_shard, info.q_shards, q_len)
    kv_pos = _local_positions(kv_positions, info.kv_positions, kv_shard, info.kv_shards, kv_len)
    q_seg, kv_seg = _segments(segment_ids, q_len, kv_len)
    args = (q, k, v, info, info.schedule(q_shard, kv_shard), q_pos, kv_pos, q_seg, kv_seg)
    return _dispatch_forward(args, scale=default_scale(scale, d), logit_soft_cap=logit_soft_cap, config=config,
                             out_dtype=out_dtype)


def splash_backward(
    q: Float[Array, "heads q_shard d"],
    k: Float[Array, "kv_heads kv_shard d"],
    v: Float[Array, "kv_heads kv_shard d"],
    d_out: Float[Array, "heads q_shard d"],
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
) -> tuple[Float[Array, "heads q_shard d"], Float[Array, "kv_heads kv_shard d"], Float[Array, "kv_heads kv_shard d"]]:
    """float32 ``(dq, dk, dv)`` of one shard pair from the *final* ``lse`` (sinks included)
    and ``delta = rowsum(d_out * out)`` of the final output. ``info_dkv`` is the transposed
    MaskInfo with ``config.block_shape_dkv`` (the xla backend accepts None)."""
    q_len, kv_len, d = q.shape[1], k.shape[1], q.shape[2]
    check_attention_inputs(q, k, v, same_dtype=True)
    _check_info(info, q_len, kv_len, transpose=False)
    if info_dkv is not None:
        _check_info(info_dkv, q_len, kv_len, transpose=True)
    q_pos = _local_positions(q_positions, info.q_positions, q_shard, info.q_shards, q_len)
    kv_pos = _local_positions(kv_positions, info.kv_positions, kv_shard, info.kv_shards, kv_len)
    q_seg, kv_seg = _segments(segment_ids, q_len, kv_len)
    sched_dkv = None if info_dkv is None else info_dkv.schedule(q_shard, kv_shard)
    args = (q, k, v, d_out, lse, delta, info, info.schedule(q_shard, kv_shard), info_dkv, sched_dkv,
            q_pos, kv_pos, q_seg, kv_seg)
    return _dispatch_backward(args, scale=default_scale(scale, d), logit_soft_cap=logit_soft_cap,
                              config=config, grad_dtype=jnp.float32)


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(static, q, k, v, sinks, q_seg, kv_seg):
    return _attention_fwd(static, q, k, v, sinks, q_seg, kv_seg)[0]


def _attention_fwd(static, q, k, v, sinks, q_seg, kv_seg):
    info, info_dkv, scale, cap, config, return_residuals = static
    args = (q, k, v, info, info.schedule(), jnp.asarray(info.q_positions), jnp.asarray(info.kv_positions),
            q_seg, kv_seg)
    out, lse = _dispatch_forward(args, scale=scale, logit_soft_cap=cap, config=config)
    if sinks is not None:  # sinks join the denominator only (docs/INTERNALS.md)
        lse_total = jnp.logaddexp(lse, sinks.astype(jnp.float32)[:, None])
        out = (out.astype(jnp.float32) * jnp.exp(lse - lse_total)[..., None]).astype(q.dtype)
        lse = lse_total
    result = (out, lse) if return_residuals else out
    return result, (q, k, v, sinks, q_seg, kv_seg, out, lse)


def _attention_bwd(static, residuals, g):
    info, info_dkv, scale, cap, config, return_residuals = static
    q, k, v, sinks, q_seg, kv_seg, out, lse = residuals
    d_out, d_lse = g if return_residuals else (g, None)
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    if d_lse is not None:  # d lse / d s = P: folds into dS = P * (dP - (delta - d_lse))
        delta = delta - d_lse.astype(jnp.float32)
    args = (q, k, v, d_out.astype(q.dtype), lse, delta, info, info.schedule(), info_dkv,
            None if info_dkv is None else info_dkv.schedule(),
            jnp.asarray(info.q_positions), jnp.asarray(info.kv_positions), q_seg, kv_seg)
    dq, dk, dv = _dispatch_backward(args, scale=scale, logit_soft_cap=cap, config=config, grad_dtype=q.dtype)
    d_sinks = None
    if sinks is not None:
        p_sink = jnp.exp(sinks.astype(jnp.float32)[:, None] - lse)
        d_sinks = (-jnp.sum(p_sink * delta, axis=-1)).astype(sinks.dtype)
    return dq, dk, dv, d_sinks, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def _effective_block(block: int, length: int) -> int:
    return length if length < block else block


def splash_attention(
    q: Float[Array, "heads q_len d"],
    k: Float[Array, "kv_heads kv_len d"],
    v: Float[Array, "kv_heads kv_len d"],
    mask: masks_lib.AnyMask | None = None,
    *,
    segment_ids: SegmentIds | None = None,
    scale: float | None = None,
    logit_soft_cap: float | None = None,
    sinks: Float[Array, "heads"] | None = None,
    config: SplashConfig = SplashConfig(),
    return_residuals: bool = False,
):
    """Block-sparse attention with the shapes and semantics of ``reference_attention``.

    Returns ``out`` (q.dtype) or ``(out, lse)`` (``lse`` float32, sinks included).
    Differentiable in q, k, v and sinks (custom VJP). MaskInfos are built on the host at
    trace time (cached). Blocks larger than a length shrink to it.
    """
    if not isinstance(config, SplashConfig):
        raise TypeError(f"config must be a SplashConfig, got {type(config).__name__}")
    heads, kv_heads, q_len, kv_len, d = check_attention_inputs(q, k, v, mask, segment_ids, sinks, same_dtype=True)
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise TypeError(f"q, k, v must be floating point, got dtype {q.dtype}")
    if logit_soft_cap is not None and not logit_soft_cap > 0:
        raise ValueError(f"logit_soft_cap must be positive or None, got {logit_soft_cap=}")
    if mask is None:
        mask = masks_lib.FullMask((q_len, kv_len))
    bq, bkv = _effective_block(config.block_q, q_len), _effective_block(config.block_kv, kv_len)
    bq_dkv, bkv_dkv = _effective_block(config.block_q_dkv, q_len), _effective_block(config.block_kv_dkv, kv_len)
    for name, block, length, lname in (("block_q", bq, q_len, "q_len"), ("block_kv", bkv, kv_len, "kv_len"),
                                       ("block_q_dkv", bq_dkv, q_len, "q_len"),
                                       ("block_kv_dkv", bkv_dkv, kv_len, "kv_len")):
        if length % block:
            raise ValueError(f"{name}={block} must divide {lname}={length}")
    info = build_mask_info(mask, (bq, bkv))
    info_dkv = None if config.backend == "xla" else build_mask_info(mask, (bq_dkv, bkv_dkv), transpose=True)
    q_seg, kv_seg = _segments(segment_ids, q_len, kv_len)
    static = (info, info_dkv, default_scale(scale, d), logit_soft_cap, config, bool(return_residuals))
    return _attention(static, q, k, v, sinks, q_seg, kv_seg)
