"""The ``xla`` backend's pieces (``splash/xla.py``): the static plan of each head list, and the
per-step operations its scans share (block masks, masked-value zeroing, score tiles, the
list's view of the heads, the scan over a work list)."""

import jax.numpy as jnp
import numpy as np
from jax import lax

from ringsplash.splash._kernel_common import LOG2E as _LOG2E

_F32 = jnp.float32


# --------------------------------------------------------------------------- static planning


class ListPlan:
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


def list_plans(info, num_heads: int, num_kv_heads: int) -> list[ListPlan]:
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
            plans.append(ListPlan(info, li, heads, num_heads, num_kv_heads))
    return plans


def check_shapes(q, k, v, info):
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


def rounder(config, input_dtype):
    """``x -> x`` rounded to the matmul dtype of P / dS (``SplashConfig.probs_dtype``), kept
    float32: a bf16 x bf16 product is exact in float32, so a float32 matmul of rounded
    operands is what the MXU computes."""
    dtype = np.dtype(input_dtype) if config is None else config.matmul_dtype(input_dtype)
    if dtype == np.dtype(np.float32):
        return lambda x: x
    return lambda x: x.astype(dtype).astype(_F32)


def make_block_mask(plan: ListPlan, info, q_pos, kv_pos, q_seg, kv_seg):
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


def drop_unattended(mask, kb, vb):
    """Zero the K / V rows of kv positions no q row of the block attends (the masked-values
    contract of ``reference_attention``: 0 * NaN in ``P @ V`` / ``dS @ K`` would leak them)."""
    keep = jnp.any(mask, axis=0)[None, :, None]  # [1, bkv, 1]; the mask is shared by the list
    return jnp.where(keep, kb, 0.0), jnp.where(keep, vb, 0.0)


def kv_block(x, plan: ListPlan, kv_start, bkv):
    blk = lax.dynamic_slice_in_dim(x, kv_start, bkv, axis=1)  # [kv_heads, bkv, d]
    return blk if plan.kv_identity else blk[plan.kv_heads]


def scores(qb, kb, scale, logit_soft_cap):
    """Scaled (and soft-capped) scores ``[kvh, group, bq, bkv]``; also the tanh for the VJP."""
    s = jnp.einsum("kgqd,kcd->kgqc", qb, kb, preferred_element_type=_F32) * scale
    if logit_soft_cap is None:
        return s, None
    t = jnp.tanh(s / logit_soft_cap)
    return logit_soft_cap * t, t


def scores_base2(qb, kb, scale, logit_soft_cap):
    """``scores`` times log2(e) (soft-capped in base-2 units), with the tanh for the VJP: the
    Pallas backward's operations (``kernel_backward._dkv_kernel``)."""
    s = jnp.einsum("kgqd,kcd->kgqc", qb, kb, preferred_element_type=_F32) * (scale * _LOG2E)
    if logit_soft_cap is None:
        return s, None
    cap2 = logit_soft_cap * _LOG2E
    t = jnp.tanh(s * (1.0 / cap2))
    return cap2 * t, t


def list_view(x, plan: ListPlan):
    """``[heads, n, d] -> [kvh, group, n, d]`` (or ``[heads, n] -> [kvh, group, n]``)."""
    if not plan.all_heads:
        x = x[plan.heads]
    return x.reshape(len(plan.kv_heads), plan.group, *x.shape[1:])


def scatter_heads(full, part, plan: ListPlan):
    part = part.reshape(-1, *part.shape[2:])
    if plan.all_heads:
        return part
    return full.at[plan.heads].set(part)


def schedule_xs(schedule, li):
    return (
        jnp.asarray(schedule.q_block)[li].astype(jnp.int32),
        jnp.asarray(schedule.kv_block)[li].astype(jnp.int32),
        jnp.asarray(schedule.kind)[li].astype(jnp.int32),
        jnp.asarray(schedule.partial_index)[li].astype(jnp.int32),
    )


def walk(step, init, schedule, li):
    """Run ``step`` over list ``li``'s entries: a ``lax.scan`` over all of them or, for a
    segment-refined compacted list (``schedule.num_steps`` set), a loop over its first
    ``num_steps[li]`` (the rest repeat the last entry with kind 0: nothing to do)."""
    xs = schedule_xs(schedule, li)
    if schedule.num_steps is None:
        return lax.scan(step, init, xs)[0]
    count = jnp.asarray(schedule.num_steps)[li].astype(jnp.int32)
    return lax.fori_loop(0, count, lambda i, carry: step(carry, tuple(x[i] for x in xs))[0], init)
