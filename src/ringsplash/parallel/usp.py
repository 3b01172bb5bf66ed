"""USP: 2-D context parallelism, Ulysses inside each ring member and the ring across.

The mesh has a Ulysses axis (``a`` devices) and a ring axis (``b`` devices), ``N = a * b``.
The sequence is sharded over both, ring-major: device ``(u, r)`` holds chunk ``r * a + u`` of
``N`` equal chunks. The Ulysses all-to-all over ``ulysses_axis`` gathers the ``a`` chunks of
ring member ``r``, i.e. chunk ``r`` of ``b``, for ``heads / a`` heads. So the inner ring
sees exactly a ``b``-device ring whose members hold the ``b`` shards of ``layout`` over ``b``:
the input must be laid out over the ring degree, ``ringsplash.layouts.permute(x, layout, b)``
(not over N), and the ring's load balance is that of ``layout`` over ``b`` shards. The ring
is :func:`ringsplash.parallel.ring.ring_attention` itself (its K/V hops overlap its kernels); then
the inverse all-to-all. Heads split over ``a`` as in :mod:`ringsplash.parallel.ulysses`.
"""

import dataclasses

import jax

from ringsplash import layouts
from ringsplash import masks as masks_lib
from ringsplash._internal.scalar_checks import check_positive_int, check_unroll
from ringsplash._internal.shard_map import axis_size
from ringsplash._internal.types import Array, AttentionOutput, Float, outputs
from ringsplash.masks.segment_ids import SegmentIds
from ringsplash.parallel._common import (
    check_global_inputs,
    check_local_inputs,
    check_mesh_axis,
    interpreter_for_mesh,
    run_sharded,
)
from ringsplash.parallel.heads import local_head_mask, ulysses_heads, usp_factorisations, valid_ulysses_degrees
from ringsplash.parallel.ring import ring_attention
from ringsplash.parallel.ring_plan import RingSchedule, fit_ring_blocks
from ringsplash.parallel.ulysses import KvToHeads, gather_head_maxima, heads_to_sequence, sequence_to_heads
from ringsplash.splash.config import SplashConfig

__all__ = ["usp_attention", "usp_attention_sharded", "usp_mesh", "usp_ring_config"]


def _check_axes(ulysses_axis, ring_axis) -> None:
    if ulysses_axis == ring_axis:
        raise ValueError(f"ulysses_axis and ring_axis must be two different mesh axes, both are {ring_axis!r}")


def _split(heads: int, kv_heads: int, a: int, b: int, ulysses_axis):
    if a not in valid_ulysses_degrees(heads, kv_heads):
        raise ValueError(
            f"the Ulysses axis {ulysses_axis!r} has {a} devices, which heads={heads}, kv_heads={kv_heads} "
            f"cannot split; (ulysses, ring) factorisations of N = {a} x {b} = {a * b} that work: "
            f"{usp_factorisations(a * b, heads, kv_heads)}"
        )
    return ulysses_heads(heads, kv_heads, a, ulysses_axis)


def usp_attention(
    q: Float[Array, "heads q_shard d"],
    k: Float[Array, "kv_heads kv_shard d"],
    v: Float[Array, "kv_heads kv_shard dv"],
    mask: masks_lib.AnyMask,
    *,
    ulysses_axis,
    ring_axis,
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
) -> Float[Array, "heads q_shard dv"] | AttentionOutput | tuple:
    """Exact attention over a sequence sharded on two mesh axes; call inside ``jax.shard_map``.

    Args:
        q, k, v: this device's shard: chunk ``r * a + u`` of the sequence laid out by
            ``layout`` over the ring degree ``b`` (``S = a * b * q_shard``).
        mask: the global ``(S, S)`` mask on original token positions; a MultiHeadMask must give
            every Ulysses rank's ``heads / a`` heads the same masks.
        ulysses_axis: mesh axis of the all-to-all (``a`` devices, dividing the heads).
        ring_axis: mesh axis of the ring (``b`` devices).
        segment_ids: this shard's segment ids (``q`` and ``kv``, length ``q_shard``) or None.
        layout: the ring's token order over ``b`` shards (see ``ringsplash.layouts``).
        scale: logit scale, None = ``1/sqrt(d)``.
        logit_soft_cap: ``cap * tanh(s / cap)`` on the logits, or None.
        sinks: float ``[heads]`` per-head sink logits (replicated), or None.
        config: Splash block sizes and backend; blocks must tile each ring shard (``S / b``;
            half of it for zigzag).
        unroll: the ring's ``lax.scan`` unroll.
        with_max_logits: also return float32 ``max_logits [heads]`` (replicated): per head the
            largest ``scale · q·k`` over every attended pair, before the soft-cap, sinks
            excluded, ``-inf`` if nothing is attended: the inner ring's (one pmax over the ring
            axis) for this rank's heads, assembled by one all-gather over the Ulysses axis.
        return_max_logits: deprecated (``DeprecationWarning``): the tuple ``(out, max_logits)``.
        schedule: this device's slice of the inner ring's ``ring_schedule`` (``b`` shards, the
            local head mask, ``heads / a`` q heads and the local kv heads; a ``shard_map``
            operand with ``schedule.specs(ring_axis)``); None = the whole schedule as a constant
            replicated on every device.
    """
    want = outputs("usp_attention", with_max_logits=with_max_logits,
                   return_max_logits=return_max_logits, lse_supported=False)
    _check_axes(ulysses_axis, ring_axis)
    unroll = check_unroll("unroll", unroll)
    a, b = axis_size(ulysses_axis, "usp_attention"), axis_size(ring_axis, "usp_attention")
    heads, kv_heads, q_len, _, segment_ids = check_local_inputs(
        q, k, v, mask, segment_ids, sinks, config, shards=a * b, what=f"axes {ulysses_axis!r} x {ring_axis!r}",
        scale=scale, logit_soft_cap=logit_soft_cap)
    split = _split(heads, kv_heads, a, b, ulysses_axis)
    fit_ring_blocks(q_len * a * b, b, layout, config)
    config = interpreter_for_mesh(usp_ring_config(config, b), "usp_attention")  # the whole a x b mesh runs kernels
    local_mask = local_head_mask(mask, split)
    # K / V cross to heads inside the ring's custom VJP (KvToHeads): their gradients come back summed
    # over the kv-head copies in float32 before one cast, as the ring's own sums are
    q, _, _, segment_ids, sinks = sequence_to_heads(q, None, None, segment_ids, sinks, split, ulysses_axis)
    out = ring_attention(q, k, v, local_mask, axis_name=ring_axis, segment_ids=segment_ids, layout=layout,
                         scale=scale, logit_soft_cap=logit_soft_cap, sinks=sinks, config=config, unroll=unroll,
                         with_max_logits=want.max_logits, schedule=schedule,
                         kv_exchange=KvToHeads(ulysses_axis, split.kv_repeat))
    if want.max_logits:
        return want.package(heads_to_sequence(out.out, ulysses_axis),
                            max_logits=gather_head_maxima(out.max_logits, ulysses_axis))
    return heads_to_sequence(out, ulysses_axis)


def usp_ring_config(config: SplashConfig, ring_size: int) -> SplashConfig:
    """The config USP's inner ring runs: ``config`` itself on a one-device ring; over more devices the
    split backward and stored partial blocks (``SplashConfig.fused_backward=False``,
    ``partial_tiles="stored"``). Compiled for v5p:2x2x2 (Ulysses 2 x ring 4, 32K, 8 / 2 heads), either
    the fused backward kernel or the position-computed partial tiles made XLA's memory-space
    assignment stage the visiting K / V through another memory space and schedule the forward
    loop's K / V transfers after its kernel instead of behind it (tests/test_parallel_tpu_compile.py):
    the overlap a ring exists for. The plain ring, all-gather and Ulysses keep both (their transfers
    stay hidden: tests/test_ring_tpu_compile.py). Not understood beyond that; checked at each change."""
    if ring_size == 1:
        return config
    return dataclasses.replace(config, partial_tiles="stored", fused_backward=False)


def usp_attention_sharded(
    q: Float[Array, "heads seq d"],
    k: Float[Array, "kv_heads seq d"],
    v: Float[Array, "kv_heads seq dv"],
    mask: masks_lib.AnyMask,
    *,
    mesh: jax.sharding.Mesh,
    ulysses_axis,
    ring_axis,
    segment_ids: SegmentIds | None = None,
    layout: layouts.Layout = "contiguous",
    scale: float | None = None,
    logit_soft_cap: float | None = None,
    sinks: Float[Array, " heads"] | None = None,
    config: SplashConfig = SplashConfig(),
    unroll: int | bool = 1,
    return_max_logits: bool = False,
    with_max_logits: bool = False,
) -> Float[Array, "heads seq dv"] | AttentionOutput | tuple:
    """:func:`usp_attention` on global arrays already in ``layout`` order over the ring degree
    ``b = mesh.shape[ring_axis]`` (``ringsplash.layouts.permute(x, layout, b)``), sharded
    along the sequence over ``(ring_axis, ulysses_axis)`` (ring-major). The mask is on
    original positions; the output is in the input's order (with ``with_max_logits``:
    an ``AttentionOutput`` with ``max_logits [heads]``)."""
    want = outputs("usp_attention_sharded", with_max_logits=with_max_logits,
                   return_max_logits=return_max_logits, lse_supported=False)
    _check_axes(ulysses_axis, ring_axis)
    a = check_mesh_axis(mesh, "ulysses_axis", ulysses_axis)
    b = check_mesh_axis(mesh, "ring_axis", ring_axis)
    heads, kv_heads, seq_len, _, segment_ids = check_global_inputs(
        q, k, v, mask, segment_ids, sinks, "usp_attention", config=config, scale=scale, logit_soft_cap=logit_soft_cap,
    )
    local_head_mask(mask, _split(heads, kv_heads, a, b, ulysses_axis))
    fit_ring_blocks(seq_len, b, layout, config)
    if seq_len % (a * b):
        raise ValueError(f"sequence length S={seq_len} must be divisible by N = ulysses x ring = {a} x {b}")

    def local(q, k, v, segment_ids, sinks):
        return usp_attention(q, k, v, mask, ulysses_axis=ulysses_axis, ring_axis=ring_axis, segment_ids=segment_ids,
                             layout=layout, scale=scale, logit_soft_cap=logit_soft_cap, sinks=sinks, config=config,
                             unroll=unroll, with_max_logits=want.max_logits)

    return run_sharded(local, mesh, (ring_axis, ulysses_axis), q, k, v, segment_ids, sinks, want=want)


def usp_mesh(ulysses: int, ring: int, *, devices=None, axis_names=("ulysses", "ring"), heads: int | None = None,
             kv_heads: int | None = None) -> jax.sharding.Mesh:
    """A ``(ring, ulysses)`` mesh for :func:`usp_attention_sharded`.

    Args:
        ulysses, ring: the factorisation ``N = ulysses * ring`` of the devices.
        devices: the devices (default ``jax.devices()``); their number must be ``ulysses * ring``.
        axis_names: ``(ulysses_axis, ring_axis)`` names.
        heads, kv_heads: when given, the error for a bad factorisation lists the ones they allow.
    """
    ulysses, ring = check_positive_int("ulysses", ulysses), check_positive_int("ring", ring)
    devices = jax.devices() if devices is None else list(devices)
    n = len(devices)
    if ulysses * ring != n:
        options = ([(a, n // a) for a in range(1, n + 1) if n % a == 0] if heads is None
                   else usp_factorisations(n, heads, kv_heads or heads))
        raise ValueError(f"ulysses x ring = {ulysses} x {ring} = {ulysses * ring} must equal the number of devices "
                         f"N={n}; (ulysses, ring) factorisations that work: {options}")
    if heads is not None:
        _split(heads, kv_heads or heads, ulysses, ring, axis_names[0])
    uly_name, ring_name = axis_names
    return jax.make_mesh((ring, ulysses), (ring_name, uly_name), devices=devices,
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)

