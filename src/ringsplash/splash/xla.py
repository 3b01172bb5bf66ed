"""Plain-jnp block-sparse attention (``SplashConfig(backend="xla")``), forward and backward.

The same MaskInfo-driven algorithm as the Pallas kernels, written as one ``lax.scan`` per
head list over that list's work list (one shard pair's ``BlockSchedule``): a step visits one
(q block, kv block) pair for *all* heads of the list at once, so each step is a few batched
matmuls of ``[heads, bq, bkv]`` and the scan's per-step overhead is amortised. Steps of kind 0
(padding, or a block row with nothing to attend) skip the arithmetic with ``lax.cond``; only
the bookkeeping runs. Memory is O(S · d) for the outputs and accumulators plus O(heads · bq ·
bkv) per step, never O(S²).

It is the fast path on CPU (the Pallas interpreter is for proving numerics, not for speed) and
a portable fallback elsewhere.

Design choices (see docs/INTERNALS.md for the MaskInfo contract and the numerics):

* **Compute dtype.** Inputs are cast to float32 once; all arithmetic is float32 (CPU has no
  fast bf16 matmul, and the oracle is float32). ``out`` is cast back to ``q.dtype``. Under
  ``SplashConfig.probs_dtype="input"`` P and dS (and the other operand of their matmuls) are
  rounded to q's dtype before the float32 matmul, exactly as the Pallas kernels feed the MXU,
  so the backends agree to float32-accumulation noise.
* **GQA / MQA.** The q heads of a list are viewed as ``[kv_heads, group, q_len, d]`` against
  ``k: [kv_heads, kv_len, d]``, ``v: [kv_heads, kv_len, dv]`` (v's head size may differ); K/V
  are never repeated. A list holding an arbitrary subset of heads (``MultiHeadMask``) gathers
  its kv heads per step, a block at a time.
* **Forward.** Online softmax with float32 ``m, l, acc`` for the current q block carried by the
  scan; the first visit of a q block (its index differs from the previous entry's) resets them,
  and every step writes the normalised block into the output, so the last visit's write stands.
* **Backward.** One fused pass over the *forward* work list (sorted by q block): each step
  recomputes ``P = exp(s - lse)`` once and accumulates dq, dK and dV by dynamic-update-slice
  adds into float32 buffers. ``info_dkv`` / ``schedule_dkv`` (the transposed view) are
  accepted for interface parity with the kernels and ignored: scatter-adding dK/dV from the
  forward order does 5 block matmuls per pair instead of the 7 of separate dq and dK/dV passes.
* **Masked values.** K / V rows of kv positions that no q row of a block attends are zeroed
  before the block's matmuls, so non-finite values there never leak (the contract of
  ``reference_attention``).
* **Masks.** Every visited block goes through one ``where`` (full blocks select all; its cost
  is ~1/(4·heads·d) of the block's matmuls, so no separate full-block branch); partial blocks
  take the deduplicated ``partial_mask_blocks`` row or, for ``partial_index == -1``, the list
  mask's ``mask_function`` on the original positions; which of the two sources a list needs is
  decided statically from the whole MaskInfo. Segment ids apply to every visited block.
* **shard_map.** Scan carries and ``cond`` branches are marked varying over the manual axes of
  the inputs (``lax.pcast``), so the backend type-checks under ``shard_map(check_vma=True)``,
  including a traced, per-device schedule in the ring.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from ringsplash._internal.checks import default_scale
from ringsplash._internal.shard_map import varying, vma
from ringsplash._internal.softmax import MASKED_LSE
from ringsplash._internal.types import Array, Float
from ringsplash.splash._kernel_common import LOG2E as _LOG2E
from ringsplash.splash.backend_interface import BackendStatic, BackwardInputs, ForwardInputs
from ringsplash.splash.xla_steps import (
    check_shapes,
    drop_unattended,
    kv_block,
    list_plans,
    list_view,
    make_block_mask,
    rounder,
    scatter_heads,
    schedule_xs,
    scores,
    scores_base2,
    walk,
)

__all__ = ["backward", "forward"]

# Initial running max / masked-score value: finite, so no inf - inf appears anywhere.
_NEG_INIT = -1e30
_F32 = jnp.float32


# --------------------------------------------------------------------------- forward


def _with_precision(fn):
    """Run ``fn(inputs, static, ...)`` with its matmuls at ``static.config``'s precision for
    q's dtype (``SplashConfig.precision``; einsums pick it up from jax's default)."""

    @functools.wraps(fn)
    def wrapped(inputs, static, **kwargs):
        precision = None if static.config is None else static.config.matmul_precision(inputs.q.dtype)
        if precision is None:
            return fn(inputs, static, **kwargs)
        with jax.default_matmul_precision(str(precision.name).lower()):
            return fn(inputs, static, **kwargs)

    return wrapped


@_with_precision
def forward(
    inputs: ForwardInputs, static: BackendStatic, *, out_dtype=None, return_max_logits: bool = False,
) -> (tuple[Float[Array, "heads q_len dv"], Float[Array, "heads q_len"]]
      | tuple[Float[Array, "heads q_len dv"], Float[Array, "heads q_len"], Float[Array, " heads"]]):
    """Sink-free block-sparse attention of one shard pair: ``(out, lse float32)``; ``out`` in
    ``out_dtype`` (None = q's dtype; float32 keeps a ring's partial results unrounded).

    ``static.info`` supplies the static parts (``block_shape``, ``head_to_list``, ``masks``,
    ``partial_mask_blocks``); ``inputs.schedule`` the (possibly traced) ``[lists, max_steps]``
    work lists. Rows with nothing to attend get ``out = 0`` and ``lse = MASKED_LSE``.
    ``return_max_logits`` appends float32 ``[heads]``: the max attended raw logit ``scale ·
    q·k`` (before the soft-cap; ``-inf`` where a head attends nothing), tracked in the same scan.
    """
    q, k, v, schedule, q_pos, kv_pos, q_seg, kv_seg = inputs
    info, scale, logit_soft_cap, config = static.info, static.scale, static.logit_soft_cap, static.config
    check_shapes(q, k, v, info)
    rnd = rounder(config, q.dtype)
    heads, q_len, d = q.shape
    kv_heads = k.shape[0]
    _bq, _bkv = info.block_shape
    scale = default_scale(scale, d)
    qf, kf, vf = q.astype(_F32), k.astype(_F32), v.astype(_F32)
    q_pos, kv_pos = jnp.asarray(q_pos, jnp.int32), jnp.asarray(kv_pos, jnp.int32)

    axes = vma(qf, kf, vf, q_pos, kv_pos, q_seg, kv_seg, schedule_xs(schedule, 0))
    out = jnp.zeros((heads, q_len, v.shape[-1]), _F32)
    lse = jnp.full((heads, q_len), MASKED_LSE, _F32)
    mx = jnp.full((heads,), -jnp.inf, _F32)
    for plan in list_plans(info, heads, kv_heads):
        o_l, lse_l, mx_l = _forward_list(
            qf, kf, vf, plan, info, schedule, q_pos, kv_pos, q_seg, kv_seg, scale, logit_soft_cap, axes, rnd,
            return_max_logits,
        )
        out = scatter_heads(out, o_l, plan)
        lse = scatter_heads(lse, lse_l, plan)
        if return_max_logits:
            mx = scatter_heads(mx, mx_l, plan)
    out = out.astype(q.dtype if out_dtype is None else out_dtype)
    return (out, lse, mx) if return_max_logits else (out, lse)


def _forward_list(q, k, v, plan, info, schedule, q_pos, kv_pos, q_seg, kv_seg, scale, cap, axes, rnd,
                  track_max=False):
    bq, bkv = info.block_shape
    ql = list_view(q, plan)  # [kvh, g, q_len, d]
    kvh, g, q_len, _ = ql.shape
    dv = v.shape[-1]  # the output's head size (v's, may differ from q's)
    block_mask = make_block_mask(plan, info, q_pos, kv_pos, q_seg, kv_seg)

    def compute(args):
        m, l, acc, mx, qi, ki, kind, pidx = args
        qb = lax.dynamic_slice_in_dim(ql, qi * bq, bq, axis=2)
        kb = kv_block(k, plan, ki * bkv, bkv)
        vb = kv_block(v, plan, ki * bkv, bkv)
        mask = block_mask(kind, pidx, qi * bq, ki * bkv)
        kb, vb = drop_unattended(mask, kb, vb)
        if track_max:  # the raw (pre-soft-cap) max over attended pairs, per head
            s, _ = scores(qb, kb, scale, None)
            mx = jnp.maximum(mx, jnp.where(mask, s, -jnp.inf).max(axis=(-2, -1)))
            if cap is not None:  # as scores
                s = cap * jnp.tanh(s / cap)
        else:
            s, _ = scores(qb, kb, scale, cap)
        s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))  # finite: m starts at _NEG_INIT
        p = jnp.exp(s - m_new[..., None])
        alpha = jnp.exp(m - m_new)
        l_new = alpha * l + p.sum(-1)
        pv = jnp.einsum("kgqc,kcd->kgqd", rnd(p), rnd(vb), preferred_element_type=_F32)
        return varying((m_new, l_new, alpha[..., None] * acc + pv, mx), axes)

    def skip(args):
        return varying(args[:4], axes)

    def step(carry, xs):
        out, lse, m, l, acc, mx, prev_qi = carry
        qi, ki, kind, pidx = xs
        fresh = qi != prev_qi
        m = jnp.where(fresh, _NEG_INIT, m)
        l = jnp.where(fresh, 0.0, l)
        acc = jnp.where(fresh, 0.0, acc)
        m, l, acc, mx = lax.cond(kind > 0, compute, skip, (m, l, acc, mx, qi, ki, kind, pidx))
        has = l > 0
        safe_l = jnp.where(has, l, 1.0)
        o_blk = acc / safe_l[..., None]
        lse_blk = jnp.where(has, m + jnp.log(safe_l), MASKED_LSE)
        out = lax.dynamic_update_slice_in_dim(out, o_blk, qi * bq, axis=2)
        lse = lax.dynamic_update_slice_in_dim(lse, lse_blk, qi * bq, axis=2)
        return varying((out, lse, m, l, acc, mx, qi), axes), None

    init = varying((
        jnp.zeros((kvh, g, q_len, dv), _F32),
        jnp.full((kvh, g, q_len), MASKED_LSE, _F32),
        jnp.full((kvh, g, bq), _NEG_INIT, _F32),
        jnp.zeros((kvh, g, bq), _F32),
        jnp.zeros((kvh, g, bq, dv), _F32),
        jnp.full((kvh, g), -jnp.inf, _F32),  # max raw logit per head (track_max)
        jnp.int32(-1),
    ), axes)
    out, lse, _, _, _, mx, _ = walk(step, init, schedule, plan.index)
    return out, lse, mx


# --------------------------------------------------------------------------- backward


@_with_precision
def backward(
    inputs: BackwardInputs, static: BackendStatic,
) -> tuple[
    Float[Array, "heads q_len d"],
    Float[Array, "kv_heads kv_len d"],
    Float[Array, "kv_heads kv_len dv"],
]:
    """``(dq, dk, dv)`` in float32 for one shard pair, given the final ``lse`` and
    ``delta = rowsum(d_out * out)``: ``P = exp(s - lse)``, ``dS = P * (dP - delta)``.

    Walks the forward ``schedule`` once and scatter-adds dK/dV, so ``static.info_dkv`` and
    ``inputs.schedule_dkv`` are unused (they may be None).
    """
    q, k, v, d_out, lse, delta, schedule, _, q_pos, kv_pos, q_seg, kv_seg = inputs
    info, scale, logit_soft_cap, config = static.info, static.scale, static.logit_soft_cap, static.config
    check_shapes(q, k, v, info)
    rnd = rounder(config, q.dtype)
    heads, q_len, d = q.shape
    kv_heads, kv_len, _ = k.shape
    scale = default_scale(scale, d)
    qf, kf, vf, dof = (x.astype(_F32) for x in (q, k, v, d_out))
    lse, delta = lse.astype(_F32), delta.astype(_F32)
    q_pos, kv_pos = jnp.asarray(q_pos, jnp.int32), jnp.asarray(kv_pos, jnp.int32)

    axes = vma(qf, kf, vf, dof, lse, delta, q_pos, kv_pos, q_seg, kv_seg, schedule_xs(schedule, 0))
    dq = jnp.zeros((heads, q_len, d), _F32)
    dk = jnp.zeros((kv_heads, kv_len, d), _F32)
    dv = jnp.zeros((kv_heads, kv_len, v.shape[-1]), _F32)
    for plan in list_plans(info, heads, kv_heads):
        dq_l, dk_l, dv_l = _backward_list(
            qf, kf, vf, dof, lse, delta, plan, info, schedule,
            q_pos, kv_pos, q_seg, kv_seg, scale, logit_soft_cap, axes, rnd,
        )
        dq = scatter_heads(dq, dq_l, plan)
        if plan.kv_identity:
            dk, dv = dk + dk_l, dv + dv_l
        else:
            dk = dk.at[plan.kv_heads].add(dk_l)
            dv = dv.at[plan.kv_heads].add(dv_l)
    return dq, dk, dv


def _backward_list(q, k, v, do, lse, delta, plan, info, schedule,
                   q_pos, kv_pos, q_seg, kv_seg, scale, cap, axes, rnd):
    bq, bkv = info.block_shape
    ql, dol = list_view(q, plan), list_view(do, plan)  # [kvh, g, q_len, d]
    # base-2 exponent, as the Pallas backward: the same float32 operations give P (and its bf16
    # rounding) to the last bit, so the backends agree to accumulation-order noise
    lsel, deltal = list_view(lse * _LOG2E, plan), list_view(delta, plan)  # [kvh, g, q_len]
    kvh, g, q_len, d = ql.shape
    kv_len, d_v = k.shape[1], v.shape[-1]
    block_mask = make_block_mask(plan, info, q_pos, kv_pos, q_seg, kv_seg)

    def compute(args):
        qi, ki, kind, pidx = args
        qs, ks = qi * bq, ki * bkv
        qb = lax.dynamic_slice_in_dim(ql, qs, bq, axis=2)
        dob = lax.dynamic_slice_in_dim(dol, qs, bq, axis=2)
        lse_b = lax.dynamic_slice_in_dim(lsel, qs, bq, axis=2)
        delta_b = lax.dynamic_slice_in_dim(deltal, qs, bq, axis=2)
        kb = kv_block(k, plan, ks, bkv)
        vb = kv_block(v, plan, ks, bkv)
        mask = block_mask(kind, pidx, qs, ks)
        kb, vb = drop_unattended(mask, kb, vb)
        s, t = scores_base2(qb, kb, scale, cap)
        # Masked entries (and rows with lse = MASKED_LSE, which are fully masked) give P = 0.
        p = jnp.where(mask, jnp.exp2(jnp.where(mask, s, -jnp.inf) - lse_b[..., None]), 0.0)
        dp = jnp.einsum("kgqd,kcd->kgqc", dob, vb, preferred_element_type=_F32)
        ds = p * (dp - delta_b[..., None])
        if t is not None:
            ds = ds * (1.0 - t * t)
        ds = rnd(ds)  # rounded unscaled, then scaled after the matmul, as in the kernels
        dq_b = jnp.einsum("kgqc,kcd->kgqd", ds, rnd(kb), preferred_element_type=_F32) * scale
        dk_b = jnp.einsum("kgqc,kgqd->kcd", ds, rnd(qb), preferred_element_type=_F32) * scale
        dv_b = jnp.einsum("kgqc,kgqd->kcd", rnd(p), rnd(dob), preferred_element_type=_F32)
        return varying((dq_b, dk_b, dv_b), axes)

    def skip(args):
        return varying((
            jnp.zeros((kvh, g, bq, d), _F32),
            jnp.zeros((kvh, bkv, d), _F32),
            jnp.zeros((kvh, bkv, d_v), _F32),
        ), axes)

    def add_block(buf, blk, start, axis):
        cur = lax.dynamic_slice_in_dim(buf, start, blk.shape[axis], axis=axis)
        return lax.dynamic_update_slice_in_dim(buf, cur + blk, start, axis=axis)

    def step(carry, xs):
        dq, dk, dv = carry
        qi, ki, kind, pidx = xs
        dq_b, dk_b, dv_b = lax.cond(kind > 0, compute, skip, (qi, ki, kind, pidx))
        dq = add_block(dq, dq_b, qi * bq, 2)
        dk = add_block(dk, dk_b, ki * bkv, 1)
        dv = add_block(dv, dv_b, ki * bkv, 1)
        return varying((dq, dk, dv), axes), None

    init = varying((
        jnp.zeros((kvh, g, q_len, d), _F32),
        jnp.zeros((kvh, kv_len, d), _F32),
        jnp.zeros((kvh, kv_len, d_v), _F32),
    ), axes)
    dq, dk, dv = walk(step, init, schedule, plan.index)
    return dq, dk, dv
