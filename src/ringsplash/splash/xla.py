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
import numpy as np
from jax import lax

from ringsplash._checks import default_scale
from ringsplash._shard_map import varying, vma
from ringsplash._softmax import MASKED_LSE
from ringsplash._types import Array, Float
from ringsplash.splash._kernel_common import LOG2E as _LOG2E
from ringsplash.splash.backend_interface import BackendStatic, BackwardInputs, ForwardInputs

__all__ = ["backward", "forward"]

# Initial running max / masked-score value: finite, so no inf - inf appears anywhere.
_NEG_INIT = -1e30
_F32 = jnp.float32


# --------------------------------------------------------------------------- static planning


class _ListPlan:
    """Static (host-side) description of how one head list is computed."""

    def __init__(self, info, list_index: int, heads: np.ndarray, num_heads: int, num_kv_heads: int):
        group = num_heads // num_kv_heads
        self.index = list_index
        self.heads = heads
        self.mask = info.masks[list_index]
        kv_of_head = heads // group
        kvs = np.unique(kv_of_head)
        complete = np.concatenate([kv * group + np.arange(group) for kv in kvs])
        if np.array_equal(np.sort(heads), complete):
            # Whole GQA groups: view as [len(kvs), group, ...], head order kv-major.
            self.heads = complete
            self.kv_heads = kvs
            self.group = group
        else:
            # Arbitrary subset: one "group" of 1 per head; kv heads gathered per step.
            self.kv_heads = kv_of_head
            self.group = 1
        self.all_heads = np.array_equal(self.heads, np.arange(num_heads))
        self.kv_identity = np.array_equal(self.kv_heads, np.arange(num_kv_heads))
        # Which partial-block sources this list uses in any shard pair (static; the schedule
        # of one pair may be traced, the MaskInfo arrays are not).
        self.uses_blocks, self.uses_fn = (bool(x) for x in info.list_partial_sources()[list_index])


def _list_plans(info, num_heads: int, num_kv_heads: int) -> list[_ListPlan]:
    head_to_list = np.asarray(info.head_to_list)
    if head_to_list.size == 1:
        head_to_list = np.zeros(num_heads, dtype=np.int64)
    elif head_to_list.size != num_heads:
        raise ValueError(
            f"MaskInfo has {head_to_list.size} mask heads, expected 1 or heads={num_heads}"
        )
    plans = []
    for li in range(len(info.masks)):
        heads = np.nonzero(head_to_list == li)[0]
        if heads.size:
            plans.append(_ListPlan(info, li, heads, num_heads, num_kv_heads))
    return plans


def _check_shapes(q, k, v, info):
    heads, q_len, d = q.shape
    kv_heads, kv_len, dk = k.shape
    if v.shape[:2] != k.shape[:2]:  # v's head size may differ from k's
        raise ValueError(f"k and v must have equal kv_heads and kv_len, got k.shape={k.shape}, v.shape={v.shape}")
    if dk != d:
        raise ValueError(f"head_dim mismatch: q.shape={q.shape}, k.shape={k.shape}")
    if heads % kv_heads:
        raise ValueError(f"{kv_heads=} must divide {heads=}")
    bq, bkv = info.block_shape
    if q_len % bq or kv_len % bkv:
        raise ValueError(f"block_shape={(bq, bkv)} must divide local (q_len, kv_len)={(q_len, kv_len)}")


# --------------------------------------------------------------------------- per-step pieces


def _rounder(config, input_dtype):
    """``x -> x`` rounded to the matmul dtype of P / dS (``SplashConfig.probs_dtype``), kept
    float32: a bf16 x bf16 product is exact in float32, so a float32 matmul of rounded
    operands is what the MXU computes."""
    dtype = np.dtype(input_dtype) if config is None else config.matmul_dtype(input_dtype)
    if dtype == np.dtype(np.float32):
        return lambda x: x
    return lambda x: x.astype(dtype).astype(_F32)


def _make_block_mask(plan: _ListPlan, info, q_pos, kv_pos, q_seg, kv_seg):
    """Returns ``mask(kind, pidx, q_start, kv_start) -> bool [bq, bkv]`` for one list."""
    bq, bkv = info.block_shape
    has_blocks, has_fn = plan.uses_blocks, plan.uses_fn
    pmb_j = jnp.asarray(np.asarray(info.partial_mask_blocks), dtype=bool) if has_blocks else None

    def block_mask(kind, pidx, q_start, kv_start):
        qp = lax.dynamic_slice_in_dim(q_pos, q_start, bq)
        kp = lax.dynamic_slice_in_dim(kv_pos, kv_start, bkv)
        if has_blocks and has_fn:
            partial = jnp.where(
                pidx >= 0,
                pmb_j[jnp.maximum(pidx, 0)],
                plan.mask.mask_function(qp[:, None], kp[None, :]),
            )
        elif has_blocks:
            partial = pmb_j[jnp.maximum(pidx, 0)]
        elif has_fn:
            partial = plan.mask.mask_function(qp[:, None], kp[None, :])
        else:  # this list has no partial blocks: every visited block is full
            partial = jnp.zeros((bq, bkv), dtype=bool)
        mask = jnp.broadcast_to(partial, (bq, bkv)) | (kind >= 2)
        if q_seg is not None:
            qs = lax.dynamic_slice_in_dim(q_seg, q_start, bq)
            ks = lax.dynamic_slice_in_dim(kv_seg, kv_start, bkv)
            # kind 3: a full block inside one shared segment (segment_blocks), no compare needed
            mask = mask & ((qs[:, None] == ks[None, :]) | (kind == 3))
        return mask

    return block_mask


def _drop_unattended(mask, kb, vb):
    """Zero the K / V rows of kv positions no q row of the block attends (the masked-values
    contract of ``reference_attention``: 0 * NaN in ``P @ V`` / ``dS @ K`` would leak them)."""
    keep = jnp.any(mask, axis=0)[None, :, None]  # [1, bkv, 1]; the mask is shared by the list
    return jnp.where(keep, kb, 0.0), jnp.where(keep, vb, 0.0)


def _kv_block(x, plan: _ListPlan, kv_start, bkv):
    blk = lax.dynamic_slice_in_dim(x, kv_start, bkv, axis=1)  # [kv_heads, bkv, d]
    return blk if plan.kv_identity else blk[plan.kv_heads]


def _scores(qb, kb, scale, logit_soft_cap):
    """Scaled (and soft-capped) scores ``[kvh, group, bq, bkv]``; also the tanh for the VJP."""
    s = jnp.einsum("kgqd,kcd->kgqc", qb, kb, preferred_element_type=_F32) * scale
    if logit_soft_cap is None:
        return s, None
    t = jnp.tanh(s / logit_soft_cap)
    return logit_soft_cap * t, t


def _scores_base2(qb, kb, scale, logit_soft_cap):
    """``_scores`` times log2(e) (soft-capped in base-2 units), with the tanh for the VJP: the
    Pallas backward's operations (``kernel_backward._dkv_kernel``)."""
    s = jnp.einsum("kgqd,kcd->kgqc", qb, kb, preferred_element_type=_F32) * (scale * _LOG2E)
    if logit_soft_cap is None:
        return s, None
    cap2 = logit_soft_cap * _LOG2E
    t = jnp.tanh(s * (1.0 / cap2))
    return cap2 * t, t


def _list_view(x, plan: _ListPlan):
    """``[heads, n, d] -> [kvh, group, n, d]`` (or ``[heads, n] -> [kvh, group, n]``)."""
    if not plan.all_heads:
        x = x[plan.heads]
    return x.reshape(len(plan.kv_heads), plan.group, *x.shape[1:])


def _scatter_heads(full, part, plan: _ListPlan):
    part = part.reshape(-1, *part.shape[2:])
    if plan.all_heads:
        return part
    return full.at[plan.heads].set(part)


def _schedule_xs(schedule, li):
    return (
        jnp.asarray(schedule.q_block)[li].astype(jnp.int32),
        jnp.asarray(schedule.kv_block)[li].astype(jnp.int32),
        jnp.asarray(schedule.kind)[li].astype(jnp.int32),
        jnp.asarray(schedule.partial_index)[li].astype(jnp.int32),
    )


def _walk(step, init, schedule, li):
    """Run ``step`` over list ``li``'s entries: a ``lax.scan`` over all of them or, for a
    segment-refined compacted list (``schedule.num_steps`` set), a loop over its first
    ``num_steps[li]`` (the rest repeat the last entry with kind 0: nothing to do)."""
    xs = _schedule_xs(schedule, li)
    if schedule.num_steps is None:
        return lax.scan(step, init, xs)[0]
    count = jnp.asarray(schedule.num_steps)[li].astype(jnp.int32)
    return lax.fori_loop(0, count, lambda i, carry: step(carry, tuple(x[i] for x in xs))[0], init)


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
    _check_shapes(q, k, v, info)
    rnd = _rounder(config, q.dtype)
    heads, q_len, d = q.shape
    kv_heads = k.shape[0]
    _bq, _bkv = info.block_shape
    scale = default_scale(scale, d)
    qf, kf, vf = q.astype(_F32), k.astype(_F32), v.astype(_F32)
    q_pos, kv_pos = jnp.asarray(q_pos, jnp.int32), jnp.asarray(kv_pos, jnp.int32)

    axes = vma(qf, kf, vf, q_pos, kv_pos, q_seg, kv_seg, _schedule_xs(schedule, 0))
    out = jnp.zeros((heads, q_len, v.shape[-1]), _F32)
    lse = jnp.full((heads, q_len), MASKED_LSE, _F32)
    mx = jnp.full((heads,), -jnp.inf, _F32)
    for plan in _list_plans(info, heads, kv_heads):
        o_l, lse_l, mx_l = _forward_list(
            qf, kf, vf, plan, info, schedule, q_pos, kv_pos, q_seg, kv_seg, scale, logit_soft_cap, axes, rnd,
            return_max_logits,
        )
        out = _scatter_heads(out, o_l, plan)
        lse = _scatter_heads(lse, lse_l, plan)
        if return_max_logits:
            mx = _scatter_heads(mx, mx_l, plan)
    out = out.astype(q.dtype if out_dtype is None else out_dtype)
    return (out, lse, mx) if return_max_logits else (out, lse)


def _forward_list(q, k, v, plan, info, schedule, q_pos, kv_pos, q_seg, kv_seg, scale, cap, axes, rnd,
                  track_max=False):
    bq, bkv = info.block_shape
    ql = _list_view(q, plan)  # [kvh, g, q_len, d]
    kvh, g, q_len, _ = ql.shape
    dv = v.shape[-1]  # the output's head size (v's, may differ from q's)
    block_mask = _make_block_mask(plan, info, q_pos, kv_pos, q_seg, kv_seg)

    def compute(args):
        m, l, acc, mx, qi, ki, kind, pidx = args
        qb = lax.dynamic_slice_in_dim(ql, qi * bq, bq, axis=2)
        kb = _kv_block(k, plan, ki * bkv, bkv)
        vb = _kv_block(v, plan, ki * bkv, bkv)
        mask = block_mask(kind, pidx, qi * bq, ki * bkv)
        kb, vb = _drop_unattended(mask, kb, vb)
        if track_max:  # the raw (pre-soft-cap) max over attended pairs, per head
            s, _ = _scores(qb, kb, scale, None)
            mx = jnp.maximum(mx, jnp.where(mask, s, -jnp.inf).max(axis=(-2, -1)))
            if cap is not None:  # as _scores
                s = cap * jnp.tanh(s / cap)
        else:
            s, _ = _scores(qb, kb, scale, cap)
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
    out, lse, _, _, _, mx, _ = _walk(step, init, schedule, plan.index)
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
    _check_shapes(q, k, v, info)
    rnd = _rounder(config, q.dtype)
    heads, q_len, d = q.shape
    kv_heads, kv_len, _ = k.shape
    scale = default_scale(scale, d)
    qf, kf, vf, dof = (x.astype(_F32) for x in (q, k, v, d_out))
    lse, delta = lse.astype(_F32), delta.astype(_F32)
    q_pos, kv_pos = jnp.asarray(q_pos, jnp.int32), jnp.asarray(kv_pos, jnp.int32)

    axes = vma(qf, kf, vf, dof, lse, delta, q_pos, kv_pos, q_seg, kv_seg, _schedule_xs(schedule, 0))
    dq = jnp.zeros((heads, q_len, d), _F32)
    dk = jnp.zeros((kv_heads, kv_len, d), _F32)
    dv = jnp.zeros((kv_heads, kv_len, v.shape[-1]), _F32)
    for plan in _list_plans(info, heads, kv_heads):
        dq_l, dk_l, dv_l = _backward_list(
            qf, kf, vf, dof, lse, delta, plan, info, schedule,
            q_pos, kv_pos, q_seg, kv_seg, scale, logit_soft_cap, axes, rnd,
        )
        dq = _scatter_heads(dq, dq_l, plan)
        if plan.kv_identity:
            dk, dv = dk + dk_l, dv + dv_l
        else:
            dk = dk.at[plan.kv_heads].add(dk_l)
            dv = dv.at[plan.kv_heads].add(dv_l)
    return dq, dk, dv


def _backward_list(q, k, v, do, lse, delta, plan, info, schedule,
                   q_pos, kv_pos, q_seg, kv_seg, scale, cap, axes, rnd):
    bq, bkv = info.block_shape
    ql, dol = _list_view(q, plan), _list_view(do, plan)  # [kvh, g, q_len, d]
    # base-2 exponent, as the Pallas backward: the same float32 operations give P (and its bf16
    # rounding) to the last bit, so the backends agree to accumulation-order noise
    lsel, deltal = _list_view(lse * _LOG2E, plan), _list_view(delta, plan)  # [kvh, g, q_len]
    kvh, g, q_len, d = ql.shape
    kv_len, d_v = k.shape[1], v.shape[-1]
    block_mask = _make_block_mask(plan, info, q_pos, kv_pos, q_seg, kv_seg)

    def compute(args):
        qi, ki, kind, pidx = args
        qs, ks = qi * bq, ki * bkv
        qb = lax.dynamic_slice_in_dim(ql, qs, bq, axis=2)
        dob = lax.dynamic_slice_in_dim(dol, qs, bq, axis=2)
        lse_b = lax.dynamic_slice_in_dim(lsel, qs, bq, axis=2)
        delta_b = lax.dynamic_slice_in_dim(deltal, qs, bq, axis=2)
        kb = _kv_block(k, plan, ks, bkv)
        vb = _kv_block(v, plan, ks, bkv)
        mask = block_mask(kind, pidx, qs, ks)
        kb, vb = _drop_unattended(mask, kb, vb)
        s, t = _scores_base2(qb, kb, scale, cap)
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
    dq, dk, dv = _walk(step, init, schedule, plan.index)
    return dq, dk, dv
