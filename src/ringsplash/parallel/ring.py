"""Ring attention: the entry points and the factory that holds a ring's host plan.

Queries stay put, sharded along the sequence on ``axis_name`` (N devices, token ``layout``
from :mod:`ringsplash.layouts`); K, V and the kv segment ids travel one hop per step (the loop,
its online-softmax merge and its backward: :mod:`ringsplash.parallel.ring_loop`).

:func:`make_ring_attention` builds the plan (a ``MaskInfo`` for every shard pair, both views:
:mod:`ringsplash.parallel.ring_plan`) once; the :class:`RingAttention` it returns is called
inside ``shard_map`` with arrays. :func:`ring_attention` is a thin wrapper: it validates the
call, takes the object for its arguments from the one bounded cache
(``ringsplash._internal.caches.factories``, emptied by ``rs.clear_caches()``) and calls it.
"""

import dataclasses
import functools

import jax
from jax.sharding import PartitionSpec as P

from ringsplash import layouts
from ringsplash import masks as masks_lib
from ringsplash._internal.caches import factories
from ringsplash._internal.checks import AttentionCall, check_attention_call
from ringsplash._internal.scalar_checks import check_positive_int, check_unroll
from ringsplash._internal.shard_map import axis_size, vma
from ringsplash._internal.types import Array, AttentionOutput, Float, Outputs, outputs
from ringsplash.masks.segment_ids import SegmentIds
from ringsplash.parallel._common import interpreter_for_mesh
from ringsplash.parallel.ring_loop import RingStatic, run_ring
from ringsplash.parallel.ring_plan import (
    RingBlocks,
    RingPlan,
    RingSchedule,
    ScheduleKey,
    check_schedule,
    fit_ring_blocks,
    ring_plan,
    ring_schedule,
)
from ringsplash.parallel.ring_tuning import ring_config
from ringsplash.splash.attention import KvExchange
from ringsplash.splash.config import SplashConfig

# the host plan's public names, importable from here too
__all__ = ["RingAttention", "RingBlocks", "RingPlan", "RingSchedule", "ScheduleKey", "fit_ring_blocks",
           "make_ring_attention", "ring_attention", "ring_attention_sharded", "ring_config", "ring_plan",
           "ring_schedule"]


@dataclasses.dataclass(frozen=True, eq=False)
class RingAttention:
    """Ring attention for one global mask over ``num_shards`` devices, its host plan built
    (:func:`make_ring_attention`). Call it inside ``shard_map`` as
    ``attn(q, k, v, axis_name=..., segment_ids=None, ...)``: the arguments and results of
    :func:`ring_attention` without ``mask``, ``layout`` and ``config``. Not a pytree: close
    over it (hashed by identity)."""

    mask: masks_lib.AnyMask  # the global (S, S) mask on original positions
    num_shards: int
    layout: str
    config: SplashConfig  # the user's config (the kernels run blocks.config)
    blocks: RingBlocks  # the fitted blocks
    plan: RingPlan  # a MaskInfo for every shard pair (forward and dK/dV views)

    def __call__(
        self,
        q: Float[Array, "heads q_shard d"],
        k: Float[Array, "kv_heads kv_shard d"],
        v: Float[Array, "kv_heads kv_shard dv"],
        *,
        axis_name,
        segment_ids: SegmentIds | None = None,
        scale: float | None = None,
        logit_soft_cap: float | None = None,
        sinks: Float[Array, " heads"] | None = None,
        unroll: int | bool = 1,
        with_max_logits: bool = False,
        schedule: RingSchedule | None = None,
    ) -> Float[Array, "heads q_shard dv"] | AttentionOutput:
        """``out``, or an :class:`~ringsplash.AttentionOutput` with ``with_max_logits`` (see
        :func:`ring_attention`). No host work but the whole schedule when none is given."""
        want = outputs("RingAttention", with_max_logits=with_max_logits, lse_supported=False)
        unroll = check_unroll("unroll", unroll)
        n = axis_size(axis_name, "RingAttention")
        if n != self.num_shards:
            raise ValueError(f"RingAttention was built for num_shards={self.num_shards}, axis_name={axis_name!r} "
                             f"has {n} devices")
        call = _check_ring_call(q, k, v, self.mask, n * q.shape[1] if getattr(q, "ndim", 0) == 3 else None,
                                segment_ids, scale, logit_soft_cap, sinks, self.config, local=True,
                                axis_name=axis_name)
        return self.run(call, q, k, v, sinks, want, axis_name=axis_name, unroll=unroll, schedule=schedule)

    def run(self, call: AttentionCall, q, k, v, sinks, want: Outputs, *, axis_name, unroll, schedule,
            kv_exchange: KvExchange | None = None):
        """The call on inputs :func:`_check_ring_call` validated, inside ``shard_map`` (``k`` / ``v``
        the caller's, before ``kv_exchange``: see :func:`ring_attention`)."""
        n, mask, layout, config = self.num_shards, self.mask, self.layout, self.config
        static = RingStatic(
            self.plan, n, axis_name, call.scale, call.logit_soft_cap,
            interpreter_for_mesh(self.blocks.config, "ring_attention"), unroll,
            sinks_vma=frozenset() if sinks is None else vma(sinks), max_logits=want.max_logits,
            kv_exchange=kv_exchange,
        )
        given_k, given_v = k, v
        if kv_exchange is not None:  # scheduled on the exchanged shapes
            k, v = jax.eval_shape(kv_exchange.gather, k), jax.eval_shape(kv_exchange.gather, v)
        seg = call.segment_ids
        q_seg, kv_seg = (None, None) if seg is None else (seg.q, seg.kv)
        if schedule is None:  # the whole schedule as a constant (device `me` reads row `me`)
            schedule = ring_schedule(mask, n, layout, config, heads=q.shape[0], kv_heads=k.shape[0])
        else:
            check_schedule(schedule, self.plan, n, ScheduleKey.of(mask, n, layout, config, q.shape[0], k.shape[0]))
        result = run_ring(static, q, given_k, given_v, q_seg, kv_seg, sinks, schedule)
        return want.package(result[0], max_logits=result[1]) if want.max_logits else result


def make_ring_attention(mask: masks_lib.AnyMask, *, num_shards: int, layout: layouts.Layout = "contiguous",
                        config: SplashConfig = SplashConfig(),
                        q_shard_rows: tuple[int, ...] | None = None, head_dim: int | None = None, dtype=None,
                        segment_ids: bool = False) -> RingAttention:
    """Build the host plan of ring attention under ``mask`` over ``num_shards`` devices once.

    Args:
        mask: the global ``(S, S)`` mask on original token positions.
        num_shards: devices N on the ring axis the calls run over.
        layout: token order of the shards: ``"contiguous"``, ``"zigzag"`` or ``"striped"``.
        config: ``SplashConfig``; blocks shrink to fit the shards (:func:`fit_ring_blocks`).
        q_shard_rows: None, or the q shards whose work lists the plan expands (``()``: none, for
            calls that always pass a per-device ``schedule`` on a multi-host slice).
        head_dim, dtype, segment_ids: q's head size and dtype and whether the calls pass segment
            ids, which pick the tuned blocks of blocks left at None, for a kernel over one shard
            (None: 128, bfloat16), as ``make_splash_attention`` does.

    Raises:
        TypeError / ValueError: naming the argument, when one is not what is expected or no
            block tiles the shards.
    """
    if not isinstance(mask, masks_lib.Mask | masks_lib.MultiHeadMask):
        raise TypeError(f"make_ring_attention: mask must be a ringsplash.masks.Mask or MultiHeadMask, got "
                        f"{type(mask).__name__} {mask!r}")
    if not isinstance(config, SplashConfig):
        raise TypeError(f"make_ring_attention: config must be a SplashConfig, got {type(config).__name__} {config!r}")
    num_shards = check_positive_int("num_shards", num_shards)
    seq_len = masks_lib.head_masks(mask)[0].shape[0]
    config = ring_config(config, mask, num_shards, head_dim=head_dim, dtype=dtype, segment_ids=segment_ids)
    blocks = fit_ring_blocks(seq_len, num_shards, layout, config)
    plan = ring_plan(mask, num_shards, layout, config, q_shard_rows=q_shard_rows)
    return RingAttention(mask, num_shards, layout, config, blocks, plan)


def ring_attention(
    q: Float[Array, "heads q_shard d"],
    k: Float[Array, "kv_heads kv_shard d"],
    v: Float[Array, "kv_heads kv_shard dv"],
    mask: masks_lib.AnyMask,
    *,
    axis_name,
    segment_ids: SegmentIds | None = None,
    layout: layouts.Layout = "contiguous",
    scale: float | None = None,
    logit_soft_cap: float | None = None,
    sinks: Float[Array, " heads"] | None = None,
    config: SplashConfig = SplashConfig(),
    unroll: int | bool = 1,
    return_max_logits: bool = False,
    with_max_logits: bool = False,
    schedule: RingSchedule | None = None,
    kv_exchange: KvExchange | None = None,
) -> Float[Array, "heads q_shard dv"] | AttentionOutput | tuple:
    """Exact attention over a sequence sharded on ``axis_name``; call inside ``jax.shard_map``.

    Args:
        q: this device's queries ``[heads, q_shard, d]``, floating point, in ``layout`` order.
        k: this device's keys ``[kv_heads, q_shard, d]``; ``kv_heads`` divides ``heads``.
        v: this device's values ``[kv_heads, q_shard, dv]``; ``dv`` may differ from d (they
            travel with their own size).
        mask: the global ``(S, S)`` mask on original token positions, ``S = N * q_shard``.
        axis_name: the mesh axis (N devices) the sequence is sharded over; must be bound.
        segment_ids: this shard's ``SegmentIds(q=[q_shard], kv=[q_shard])`` (int32 inside
            ``shard_map``); the kv ids travel with K/V.
        layout: token order of the shards (``ringsplash.layouts``): ``"contiguous"``,
            ``"zigzag"`` or ``"striped"``.
        scale: positive multiplier of ``q k^T``; None means ``1 / sqrt(d)``.
        logit_soft_cap: None, or a positive cap ``c``: logits become ``c * tanh(logits / c)``.
        sinks: floating ``[heads]`` per-head sink logits (replicated), joining each row's
            denominator once, or None.
        config: ``SplashConfig``; blocks that do not tile a shard (zigzag: a half-shard)
            shrink to fit (:func:`fit_ring_blocks`).
        unroll: ``lax.scan`` unroll of the ring loop (int, or True for a full unroll).
        with_max_logits: also return float32 ``max_logits [heads]`` (replicated over the
            axis): per head the largest ``scale · q·k`` over every attended pair of the whole
            sequence, before the soft-cap, sinks excluded, ``-inf`` if nothing is attended;
            the max over every step's kernel and one ``pmax``; no gradient.
        return_max_logits: deprecated (``DeprecationWarning``): the tuple ``(out, max_logits)``.
        schedule: this device's slice of :func:`ring_schedule` for these arguments (a
            ``shard_map`` operand with ``schedule.specs(axis_name)``), so the device holds only
            its own rows; None = the whole schedule, a constant replicated on every device.
        kv_exchange: a ``splash.attention.KvExchange`` (a strategy's collective) inside the ring's
            custom VJP: ``k`` / ``v`` are then the caller's, which ``kv_exchange.gather`` maps to
            the shapes above, and their gradients come back through ``kv_exchange.reduce`` from
            the ring's float32 sums (one cast; USP's Ulysses all-to-all and kv-head repeat).

    Returns:
        this device's output ``[heads, q_shard, dv]`` in ``q.dtype``, ``layout`` order; with
        ``with_max_logits`` an :class:`~ringsplash.AttentionOutput` ``(out, None, max_logits)``.
    """
    want = outputs("ring_attention", with_max_logits=with_max_logits, return_max_logits=return_max_logits,
                   lse_supported=False)
    unroll = check_unroll("unroll", unroll)
    n = axis_size(axis_name, "ring_attention")
    k_ring, v_ring = (k, v) if kv_exchange is None else (jax.eval_shape(kv_exchange.gather, k),
                                                          jax.eval_shape(kv_exchange.gather, v))
    call = _check_ring_call(q, k_ring, v_ring, mask, n * q.shape[1] if getattr(q, "ndim", 0) == 3 else None,
                            segment_ids, scale, logit_soft_cap, sinks, config, local=True, axis_name=axis_name)
    # With a per-device schedule on a multi-host slice the ring needs no list of the plan (only
    # its shapes, partial blocks and `active`): a plan without rows keeps each host's work to its own.
    rows = () if schedule is not None and jax.process_count() > 1 else None
    config = ring_config(config, mask, n, head_dim=q.shape[-1], dtype=q.dtype, segment_ids=call.segment_ids is not None)
    attn = factories.get(("ring", mask, n, layout, config, rows),
                         lambda: make_ring_attention(mask, num_shards=n, layout=layout, config=config,
                                                     q_shard_rows=rows))
    return attn.run(call, q, k, v, sinks, want, axis_name=axis_name, unroll=unroll, schedule=schedule,
                    kv_exchange=kv_exchange)


def _kind(mesh) -> str:
    return mesh.devices.flat[0].device_kind


def _check_ring_call(q, k, v, mask, seq_len, segment_ids, scale, logit_soft_cap, sinks, config, *, local,
                     axis_name):
    """The shared entry check, with the ring's global-mask and equal-length rules."""
    hint = ""
    if local and seq_len:
        hint = f"the global (S, S) mask for {seq_len // q.shape[1]} shards on axis {axis_name!r}"
    return check_attention_call(
        q, k, v, mask=mask, mask_required=True, mask_shape=None if seq_len is None else (seq_len, seq_len),
        mask_hint=hint, segment_ids=segment_ids,
        segment_hint=f"segment ids are per shard: local length S/N = {q.shape[1]}" if local and seq_len else "",
        scale=scale, logit_soft_cap=logit_soft_cap, sinks=sinks, config=config, config_type=SplashConfig,
        equal_lengths=True,
    )


def ring_attention_sharded(
    q: Float[Array, "heads seq d"],
    k: Float[Array, "kv_heads seq d"],
    v: Float[Array, "kv_heads seq dv"],
    mask: masks_lib.AnyMask,
    *,
    mesh: jax.sharding.Mesh,
    axis_name,
    segment_ids: SegmentIds | None = None,
    layout: layouts.Layout = "contiguous",
    scale: float | None = None,
    logit_soft_cap: float | None = None,
    sinks: Float[Array, " heads"] | None = None,
    config: SplashConfig = SplashConfig(),
    unroll: int | bool = 1,
    return_max_logits: bool = False,
    with_max_logits: bool = False,
    schedule: RingSchedule | None = None,
) -> Float[Array, "heads seq dv"] | AttentionOutput | tuple:
    """:func:`ring_attention` on global arrays already in ``layout`` order, sharded along the
    sequence over ``mesh.shape[axis_name]`` devices.

    Args:
        q: queries ``[heads, S, d]``, floating point, in ``layout`` order
            (``ringsplash.layouts.permute``).
        k: keys ``[kv_heads, S, d]`` in ``layout`` order; ``kv_heads`` divides ``heads``.
        v: values ``[kv_heads, S, dv]`` in ``layout`` order (``dv`` may differ from d).
        mask: the ``(S, S)`` mask on original token positions.
        mesh: a ``jax.sharding.Mesh`` with the axis ``axis_name``.
        axis_name: the mesh axis (N devices) to shard the sequence over.
        segment_ids: global ``SegmentIds(q=[S], kv=[S])`` in ``layout`` order, or None.
            Concrete ids of any integer dtype are renumbered exactly; traced ids must fit int32.
        layout: ``"contiguous"``, ``"zigzag"`` or ``"striped"`` (``ringsplash.layouts``).
        scale: positive multiplier of ``q k^T``; None means ``1 / sqrt(d)``.
        logit_soft_cap: None, or a positive cap ``c``: logits become ``c * tanh(logits / c)``.
        sinks: floating ``[heads]`` per-head sink logits, or None.
        config: ``SplashConfig``; blocks shrink to fit the shards (:func:`fit_ring_blocks`).
        unroll: ``lax.scan`` unroll of the ring loop (int, or True for a full unroll).
        with_max_logits: also return float32 ``max_logits [heads]`` (see :func:`ring_attention`).
        return_max_logits: deprecated (``DeprecationWarning``): the tuple ``(out, max_logits)``.
        schedule: :func:`ring_schedule` for these arguments (``mesh=mesh`` gives arrays sharded
            over the ring axis; pass it as a ``jit`` argument so each device holds only its own
            rows); None = built here (its numpy arrays become constants of an enclosing ``jit``,
            replicated on every device).

    Returns:
        ``[heads, S, dv]`` in ``q.dtype`` and ``layout`` order; with ``with_max_logits`` an
        :class:`~ringsplash.AttentionOutput` ``(out, None, max_logits)``.
    """
    want = outputs("ring_attention_sharded", with_max_logits=with_max_logits,
                   return_max_logits=return_max_logits, lse_supported=False)
    call = _check_ring_call(q, k, v, mask, None, segment_ids, scale, logit_soft_cap, sinks, config,
                            local=False, axis_name=axis_name)
    unroll = check_unroll("unroll", unroll)
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis_name not in mesh.axis_names:
        raise ValueError(f"mesh has axes {tuple(mesh.axis_names)}, no axis_name={axis_name!r}")
    n = mesh.shape[axis_name]
    config = ring_config(config, mask, n, head_dim=q.shape[-1], dtype=q.dtype, segment_ids=segment_ids is not None,
                         device_kind=_kind(mesh))
    fit_ring_blocks(call.q_len, n, layout, config)
    segment_ids = call.segment_ids  # int32, renumbered exactly if wider ids were given
    seq = P(None, axis_name)
    seg_spec = None if segment_ids is None else SegmentIds(P(axis_name), P(axis_name))
    fn = functools.partial(
        ring_attention, mask=mask, axis_name=axis_name, layout=layout, scale=scale,
        logit_soft_cap=logit_soft_cap, config=config, unroll=unroll, with_max_logits=want.max_logits,
    )

    def local(q, k, v, segment_ids, sinks, schedule):
        r = fn(q, k, v, segment_ids=segment_ids, sinks=sinks, schedule=schedule)
        return (r.out, r.max_logits) if want.max_logits else r

    if schedule is None:
        schedule = ring_schedule(mask, n, layout, config, heads=q.shape[0], kv_heads=k.shape[0],
                                 device_kind=_kind(mesh))
    in_specs = (seq, seq, seq, seg_spec, None if sinks is None else P(), schedule.specs(axis_name))
    args = (q, k, v, segment_ids, sinks, schedule)
    explicit = jax.sharding.AxisType.Explicit
    if any(t == explicit for t in getattr(mesh, "axis_types", ())):  # explicit meshes do not reshard implicitly
        args = jax.tree.map(lambda x, s: jax.reshard(x, jax.NamedSharding(mesh, s)), args, in_specs)
    # check_vma=False: inside the custom_vjp backward the residuals' varying-axis types are not
    # visible (jax 0.10.2), so the replicated sinks' cotangent cannot be typed as replicated.
    out_specs = (seq, P()) if want.max_logits else seq  # max logits: replicated after the pmax
    result = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)
    return want.package(result[0], max_logits=result[1]) if want.max_logits else result
