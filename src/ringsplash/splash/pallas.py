"""Pallas Splash backends (``"interpret"`` and ``"mosaic_tpu"``): the kernels of
``splash/kernel_forward.py`` and ``splash/kernel_backward.py`` behind the interface of
``splash/backend_interface.py``, as ``splash/xla.py`` is for the jnp implementation.

Host side, once per MaskInfo (cached): the kernel operands that do not depend on the traced
inputs (the masks whose ``mask_function`` a kernel evaluates, the int8 partial blocks and their
transpose). ``"mosaic_tpu"`` wraps q in the lowering guards of ``splash/guards.py``.
"""

import weakref
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from ringsplash._internal import caches
from ringsplash._internal.shard_map import varying, vma
from ringsplash.blocksparse.mask_info import MaskInfo
from ringsplash.splash import kernel_backward, kernel_forward
from ringsplash.splash.backend_interface import BackendStatic, BackwardInputs, ForwardInputs
from ringsplash.splash.config import GENERIC_INTERPRETER, SplashConfig
from ringsplash.splash.guards import mosaic_tpu_guard, vmem_guard
from ringsplash.splash.partial_tiles import partial_column_check, quadrant_band
from ringsplash.splash.tpu_tiles import NUM_LANES
from ringsplash.splash.vmem import kernel_vmem

__all__ = ["StaticOperands", "backward", "forward"]


# ----------------------------------------------------------------------------------------
# per-MaskInfo kernel operands (host side, cached per MaskInfo object)


class StaticOperands(NamedTuple):
    """Host-side kernel operands of one MaskInfo."""

    masks: tuple  # per list: the 2-D mask whose mask_function the kernel evaluates, or None
    uses_fn: bool  # some partial block has no stored block (partial_index -1): positions needed
    blocks: np.ndarray | None  # int8 [num_partials, bq, bkv] partial blocks, or None
    blocks_t: np.ndarray | None  # the same transposed, [num_partials, bkv, bq] (dK/dV kernel)
    column_check: str | tuple  # how partial tiles find unattended kv columns (partial_tiles.py)
    quadrant_band: tuple | None  # the band whose empty tile parts the kernels may skip (partial_tiles.py)
    q_runs: bool  # every q block (forward view's blocks) holds consecutive positions: a start table replaces its column
    kv_runs: bool  # likewise for every kv block


def _runs(positions, block: int) -> bool:
    """Whether every ``block``-token block of ``positions`` is a run ``start, start + 1, ...``."""
    pos = np.asarray(positions).reshape(-1, block)
    return bool(np.array_equal(pos, pos[:, :1] + np.arange(block)))


_STATIC_CACHE: "weakref.WeakKeyDictionary[MaskInfo, StaticOperands]" = weakref.WeakKeyDictionary()
caches.register(_STATIC_CACHE.clear)


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
        column_check=partial_column_check(info),
        quadrant_band=quadrant_band(info),
        q_runs=_runs(info.q_positions, info.block_shape[0]),
        kv_runs=_runs(info.kv_positions, info.block_shape[1]),
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
    """A column side replicated over the 128 lanes, ``[n, 128]``: the kernels widen a
    ``(block, 128)`` tile to the tile's width by repeating whole vregs (a ``[n, 1]`` column
    needs a lane broadcast per row; with segment ids that ran at ~4x the time per tile)."""
    if x is None:
        return None
    x = jnp.asarray(x, jnp.int32)
    return jnp.broadcast_to(x[:, None], (x.shape[0], NUM_LANES))


def _as_row(x):
    return None if x is None else jnp.asarray(x, jnp.int32)[None, :]


def _mask_operands(ops: StaticOperands, q_pos, kv_pos, q_seg, kv_seg, *, transposed: bool, block: int) -> dict:
    """Keyword operands of a kernel wrapper: positions (only where the kernel evaluates a
    mask_function), segment ids and partial blocks, laid out for ``(q, kv)`` tiles or, when
    ``transposed``, ``(kv, q)`` tiles. The column side's positions (q, or kv when ``transposed``;
    ``block`` tokens a block) go as a table of block starts when every block is a run
    (``tile_masks.RunColumn``), else as a lane-replicated column."""
    q_side, kv_side = (_as_row, _as_col) if transposed else (_as_col, _as_row)
    starts = ops.kv_runs if transposed else ops.q_runs
    q_pos_side, kv_pos_side = q_side, kv_side
    if starts:
        as_starts = lambda x: jnp.asarray(x, jnp.int32)[::block]
        q_pos_side, kv_pos_side = (_as_row, as_starts) if transposed else (as_starts, _as_row)
    blocks = ops.blocks_t if transposed else ops.blocks
    return {
        "kv_pos_starts" if transposed else "q_pos_starts": starts and ops.uses_fn,
        "q_pos": q_pos_side(q_pos) if ops.uses_fn else None,
        "kv_pos": kv_pos_side(kv_pos) if ops.uses_fn else None,
        "q_seg": q_side(q_seg),
        "kv_seg": kv_side(kv_seg),
        "mask_blocks_t" if transposed else "mask_blocks": None if blocks is None else jnp.asarray(blocks),
        "masks": ops.masks,
        "column_check": ops.column_check,
    }


# ----------------------------------------------------------------------------------------
# forward and backward (the interface of splash/backend_interface.py)


def _skippable_band(config: SplashConfig, view: MaskInfo, local_len: int, full_len: int) -> tuple | None:
    """The band whose empty tile parts the kernel may skip (``partial_tiles.quadrant_band``), or None. The
    kernel finds positions from block indices, so only when this call covers every block of the view's
    length (``local_len == full_len``: no work piece)."""
    if not config.skip_empty_quadrants or local_len != full_len:
        return None
    return _static_operands(view).quadrant_band


def forward(inputs: ForwardInputs, static: BackendStatic, *, backend: str = "interpret", out_dtype=None,
            count_steps: bool = False, return_max_logits: bool = False):
    """The forward kernel on one shard pair; with ``return_max_logits`` also the per-head max
    raw logit, with ``count_steps`` (last) the number of computing grid steps per head."""
    q, config, info = inputs.q, static.config, static.info
    block_kv_compute = min(config.block_kv_compute, info.block_shape[1])
    operands = _mask_operands(_static_operands(info), inputs.q_pos, inputs.kv_pos, inputs.q_seg, inputs.kv_seg,
                              transposed=False, block=info.block_shape[0])
    vmem = kernel_vmem("forward", q, inputs.k, inputs.v, info.block_shape, block_kv_compute=block_kv_compute,
                       out_dtype=out_dtype, operands=operands, vmem_limit_bytes=config.vmem_limit_bytes)
    if backend == "mosaic_tpu":
        q = vmem_guard(mosaic_tpu_guard(q), vmem)
    quadrants = _skippable_band(config, info, q.shape[1], info.q_len)
    return kernel_forward.splash_forward_kernel(
        q, inputs.k, inputs.v, inputs.schedule, _heads_to_list(info, q.shape[0]), **operands,
        block_shape=info.block_shape, block_kv_compute=block_kv_compute,
        scale=static.scale, logit_soft_cap=static.logit_soft_cap, out_dtype=out_dtype,
        probs_dtype=config.matmul_dtype(q.dtype), precision=config.matmul_precision(q.dtype),
        interpret=_interpret(config, backend), vmem_limit_bytes=vmem.limit, count_steps=count_steps,
        return_max_logits=return_max_logits, quadrant_band=quadrants,
    )


def backward(inputs: BackwardInputs, static: BackendStatic, *, backend: str = "interpret",
             grad_dtype=jnp.float32, count_steps: bool = False, parts: tuple = ("dq", "dkv"), dq_init=None):
    """The backward kernels on one shard pair.

    ``parts=("dq", "dkv")`` (default) runs the fused kernel: the dK/dV kernel, which also adds
    each tile's dq into a float32 dq in HBM (``dq_accumulator.DqAccumulator``), starting from
    ``dq_init`` (float32 ``[heads, q_len, d]``; None = zeros). Returns ``(dq, dk, dv)`` in
    ``grad_dtype`` (dq float32 when ``dq_init`` is given, so pieces can chain through it), with
    ``count_steps`` also the kernel's computing steps per kv head. ``parts=("dq",)`` runs only
    the dq kernel (the forward work list) and returns ``dq``; ``parts=("dkv",)`` only the dK/dV
    kernel: ``(dk, dv)`` (each with its count under ``count_steps``)."""
    q, config, info, info_dkv = inputs.q, static.config, static.info, static.info_dkv
    if parts not in (("dq", "dkv"), ("dq",), ("dkv",)):
        raise ValueError(f"parts must be ('dq', 'dkv'), ('dq',) or ('dkv',), got {parts=}")
    if "dkv" in parts and (info_dkv is None or inputs.schedule_dkv is None):
        raise ValueError("the Pallas backward needs the transposed MaskInfo (info_dkv) and its schedule")
    heads = q.shape[0]
    common = {
        "scale": static.scale, "logit_soft_cap": static.logit_soft_cap, "out_dtype": grad_dtype,
        "probs_dtype": config.matmul_dtype(q.dtype), "precision": config.matmul_precision(q.dtype),
        "interpret": _interpret(config, backend), "count_steps": count_steps,
    }
    positions = (inputs.q_pos, inputs.kv_pos, inputs.q_seg, inputs.kv_seg)

    def kernel(name, fn, sched, view, transposed, **extra):
        operands = _mask_operands(_static_operands(view), *positions, transposed=transposed,
                                  block=view.block_shape[1 if transposed else 0])
        vmem = kernel_vmem(name, q, inputs.k, inputs.v, view.block_shape, out_dtype=grad_dtype, operands=operands,
                           vmem_limit_bytes=config.vmem_limit_bytes)
        guarded = vmem_guard(mosaic_tpu_guard(q), vmem) if backend == "mosaic_tpu" else q
        return fn(guarded, inputs.k, inputs.v, inputs.d_out, inputs.lse, inputs.delta, sched,
                  _heads_to_list(view, heads), **operands,
                  block_shape=view.block_shape, vmem_limit_bytes=vmem.limit, **common, **extra)

    if parts == ("dq",):
        return kernel("dq", kernel_backward.splash_dq_kernel, inputs.schedule, info, False)
    quadrants = _skippable_band(config, info_dkv, inputs.k.shape[1], info_dkv.kv_len)
    if parts == ("dkv",):
        return kernel("dkv", kernel_backward.splash_dkv_kernel, inputs.schedule_dkv, info_dkv, True,
                      quadrant_band=quadrants)
    # fresh zeros vary over the same manual mesh axes as q (shard_map): the kernel's aliased dq takes their type
    init = varying(jnp.zeros(q.shape, jnp.float32), vma(q)) if dq_init is None else dq_init
    dk, dv, *rest = kernel("fused", kernel_backward.splash_dkv_kernel, inputs.schedule_dkv, info_dkv, True,
                           dq_init=init, quadrant_band=quadrants)
    dq = rest[-1] if dq_init is not None else rest[-1].astype(grad_dtype)
    return (dq, dk, dv, rest[0]) if count_steps else (dq, dk, dv)
