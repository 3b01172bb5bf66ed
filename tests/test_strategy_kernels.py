"""The context-parallel strategies run single-device Splash's kernels: the same tuned blocks, partial tiles
computed from positions (no stored mask blocks for banded masks, no position column in memory where blocks
are runs of consecutive tokens), the fused backward, and on a one-device ring exactly Splash's result."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ringsplash as rs
from ringsplash import masks
from ringsplash.parallel.ring import make_ring_attention, ring_schedule
from ringsplash.parallel.ring_plan import ScheduleKey
from ringsplash.parallel.ring_tuning import ring_config
from ringsplash.parallel.usp import usp_ring_config
from ringsplash.splash import pallas
from ringsplash.splash.config import SplashConfig
from ringsplash.splash.factory import make_splash_attention
from support.jaxprs import equations

K = 1024


@pytest.mark.parametrize("segment_ids", [False, True])
@pytest.mark.parametrize("head_dim, dtype", [(128, jnp.bfloat16), (256, jnp.float32)])
def test_ring_blocks_are_single_device_splash_blocks_for_the_same_kernel_call(segment_ids, head_dim, dtype):
    """A ring over N devices runs the blocks Splash runs on one shard (S / N keys), with q's head size,
    dtype and the segment ids' sparsity (v5e's tuned rows: the host has no TPU). Before, the ring looked
    its row up by the zigzag half-shard and without head size, dtype or sparsity."""
    for n, s in ((1, 32 * K), (4, 128 * K)):
        ring = make_ring_attention(masks.CausalMask((s, s)), num_shards=n, layout="zigzag", head_dim=head_dim,
                                   dtype=dtype, segment_ids=segment_ids)
        one = make_splash_attention(masks.CausalMask((s // n, s // n)), head_dim=head_dim, dtype=dtype,
                                    segment_ids=segment_ids)
        assert ring.blocks.block_shape == one.info.block_shape
        assert ring.blocks.block_shape_dkv == one.info_dkv.block_shape
        assert ring.blocks.config.block_kv_compute == one.config.block_kv_compute


def test_ring_runs_the_split_backward_on_v5p_only_over_more_than_one_device():
    """``ring_config`` keeps the fused backward on v5e / v6e and on any one-device ring, and turns it off for a
    ring of N > 1 on v5p (SPLIT_BACKWARD_CHIPS: the compiled forward loop's overlap, tests/test_ring_tpu_compile.py);
    the chip is the mesh's device kind when given, else the one traced on (none here: the CPU)."""
    mask = masks.CausalMask((8 * K, 8 * K))
    fused = lambda n, kind: ring_config(SplashConfig(), mask, n, device_kind=kind).fused_backward
    assert fused(4, "TPU v5") is False and fused(4, "TPU v5p") is False
    assert fused(4, "TPU v5 lite") and fused(4, "TPU v6 lite") and fused(1, "TPU v5") and fused(4, None)
    assert ring_config(SplashConfig(fused_backward=False), mask, 4, device_kind="TPU v5 lite").fused_backward is False


@pytest.mark.parametrize("mask", ["causal", "window"])
def test_strategies_compute_banded_partial_tiles_from_block_starts(mask):
    """Banded masks store no partial block on any strategy, and the kernels' column side (q for the forward
    and dq kernels, kv for the dK/dV kernel) gets a table of block starts, not a [len, 128] column, on the
    zigzag layout (every block a run of consecutive positions)."""
    s, n = 8 * K, 4
    m = masks.CausalMask((s, s))
    if mask == "window":
        m = m & masks.LocalMask((s, s), window=(1000, 0))
    ring = make_ring_attention(m, num_shards=n, layout="zigzag", config=SplashConfig(block_q=512, block_kv=512,
                                                                                    block_q_dkv=512, block_kv_dkv=512))
    for info, transposed in ((ring.plan.info, False), (ring.plan.info_dkv, True)):
        assert info.partial_mask_blocks.shape[0] == 0
        ops = pallas._static_operands(info)
        assert ops.uses_fn and (ops.kv_runs if transposed else ops.q_runs)
        local = jnp.arange(s // n, dtype=jnp.int32)
        kw = pallas._mask_operands(ops, local, local, None, None, transposed=transposed, block=512)
        column = kw["kv_pos"] if transposed else kw["q_pos"]
        assert column.shape == (s // n // 512,)
        assert kw["kv_pos_starts" if transposed else "q_pos_starts"]
    # USP over a ring of more than one device keeps stored blocks and the split backward (parallel/usp.py)
    usp = usp_ring_config(SplashConfig(), 4)
    assert (usp.partial_tiles, usp.fused_backward) == ("stored", False)
    assert usp_ring_config(SplashConfig(), 1) == SplashConfig()
    stored = make_ring_attention(m, num_shards=n, layout="zigzag", config=usp)
    assert stored.plan.info.partial_mask_blocks.shape[0] > 0
    # a schedule built for one partial-tile mode is refused by a call in the other
    key = ScheduleKey.of(m, n, "zigzag", usp, heads=2, kv_heads=2)
    assert ring_schedule(m, n, "zigzag", usp, heads=2, kv_heads=2).key == key
    assert "partial_tiles" in " ".join(key.differences(ScheduleKey.of(m, n, "zigzag", SplashConfig(), 2, 2)))


STRATEGY_CASES = [("ring", "causal"), ("ring", "window"), ("ring", "docs"), ("allgather", "causal"),
                  ("ulysses", "docs")]


@pytest.mark.slow
@pytest.mark.parametrize("strategy, kind", STRATEGY_CASES, ids=["-".join(c) for c in STRATEGY_CASES])
def test_one_device_strategy_is_single_device_splash(strategy, kind):
    """On a one-device mesh a strategy is one Splash call: the same kernels (fused backward, position-computed
    partial tiles), no merge, outputs and gradients written in the inputs' dtype, so out, dq, dk and dv are
    bit-identical to ``splash_attention``'s (Pallas interpreter, bfloat16, GQA 2:1; with segment ids within
    one bfloat16 ulp). Before, the ring merged a float32 output and ran the split backward, and the all-gather
    and Ulysses wrote float32 outputs and gradients."""
    s, heads, kv_heads, d = 256, 2, 1, 64
    m = masks.CausalMask((s, s))
    if kind == "window":
        m = m & masks.LocalMask((s, s), window=(100, 0))
    seg = None
    if kind == "docs":
        ids = jnp.repeat(jnp.arange(4), s // 4)
        seg = rs.SegmentIds(q=ids, kv=ids)
    ks = jax.random.split(jax.random.key(11), 4)
    q, do = (jax.random.normal(k, (heads, s, d), jnp.bfloat16) for k in (ks[0], ks[3]))
    k, v = (jax.random.normal(x, (kv_heads, s, d), jnp.bfloat16) for x in (ks[1], ks[2]))
    cfg = SplashConfig(block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128, backend="interpret")
    mesh = jax.make_mesh((1,), ("c",), devices=jax.devices()[:1], axis_types=(jax.sharding.AxisType.Auto,))
    splash = lambda q, k, v: rs.splash_attention(q, k, v, m, config=cfg, segment_ids=seg)
    sharded = {"ring": rs.ring_attention_sharded, "allgather": rs.allgather_attention_sharded,
               "ulysses": rs.ulysses_attention_sharded}[strategy]
    ring = lambda q, k, v: sharded(q, k, v, m, mesh=mesh, axis_name="c", layout="zigzag", config=cfg,
                                   segment_ids=seg)
    out_a, vjp_a = jax.vjp(splash, q, k, v)
    out_b, vjp_b = jax.vjp(ring, q, k, v)
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out_a, *vjp_a(do)), (out_b, *vjp_b(do))):
        assert b.dtype == a.dtype == jnp.bfloat16, name
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if kind != "docs":
            np.testing.assert_array_equal(a, b, err_msg=name)
        else:  # with segment ids, under the suite's XLA flags, 19 of 32768 dv entries differed by one bf16 ulp
            np.testing.assert_allclose(b, a, rtol=2.0**-7, atol=0, err_msg=name)


# (strategy, ulysses devices, ring devices, kv heads of 4 q heads, float32 dK / dV expected)
PARTIALS_CASES = [("splash", 1, 1, 4, False), ("ring", 1, 1, 4, False), ("allgather", 1, 1, 4, False),
                  ("ulysses", 1, 1, 4, False), ("usp", 1, 1, 4, False), ("usp", 2, 1, 4, False),
                  ("ulysses", 2, 1, 4, False), ("ulysses", 4, 1, 2, True), ("allgather", 1, 2, 4, True),
                  ("ring", 1, 2, 4, True), ("usp", 1, 2, 4, True)]


@pytest.mark.parametrize("strategy, a, b, kv_heads, partials", PARTIALS_CASES,
                         ids=[f"{c[0]}-{c[1]}x{c[2]}-kv{c[3]}" for c in PARTIALS_CASES])
def test_kernels_write_float32_gradients_only_where_they_are_summed(strategy, a, b, kv_heads, partials):
    """The backward kernels write dK / dV in float32 only where partials are summed after them (over
    ring steps or devices, or over the copies of a repeated kv head); otherwise in the inputs'
    dtype, as single-device Splash. USP over a 1 x 1 mesh wrote float32 (its ring took any K/V
    exchange as a sum) and ran its fused backward at 0.84-0.96x Splash on a v5e chip (2026-12-07);
    Ulysses over devices without repeated kv heads did too, only to cast before its all-to-all."""
    s, heads, d = 1024, 4, 64
    m = masks.CausalMask((s, s))
    cfg = SplashConfig(block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128, backend="interpret")
    q = jax.ShapeDtypeStruct((heads, s, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((kv_heads, s, d), jnp.bfloat16)
    devices = jax.devices()[: a * b]
    if strategy == "usp":
        mesh = rs.parallel.usp_mesh(a, b, devices=devices)
        attn = lambda q, k, v: rs.usp_attention_sharded(q, k, v, m, mesh=mesh, ulysses_axis="ulysses",
                                                        ring_axis="ring", layout="zigzag", config=cfg)
    elif strategy == "splash":
        attn = lambda q, k, v: rs.splash_attention(q, k, v, m, config=cfg)
    else:
        mesh = jax.make_mesh((a * b,), ("c",), devices=devices, axis_types=(jax.sharding.AxisType.Auto,))
        sharded = {"ring": rs.ring_attention_sharded, "allgather": rs.allgather_attention_sharded,
                   "ulysses": rs.ulysses_attention_sharded}[strategy]
        attn = lambda q, k, v: sharded(q, k, v, m, mesh=mesh, axis_name="c", layout="zigzag", config=cfg)
    loss = lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32))
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, kv, kv)
    dtypes = {v.aval.dtype for eqn in equations(jaxpr) if eqn.primitive.name == "pallas_call"
              and str(eqn.params["name"]) in ("splash_fused_bwd", "splash_dkv") for v in eqn.outvars[:2]}
    assert dtypes == {jnp.dtype(jnp.float32 if partials else jnp.bfloat16)}, dtypes


@pytest.mark.parametrize("devices", [1, 2])
def test_one_device_ring_tests_no_segment_sharing_and_indexes_nothing_before_its_kernels(devices):
    """A ring of one device has one shard pair, its own: with segment ids it runs Splash's kernels
    unconditionally, as single-device Splash does (their work lists refined by the ids on the device),
    with no ``lax.cond`` on whether the pair shares a segment, which only a longer ring's pairs can
    skip. With it, the one-device ring ran 16 packed documents at 8K fwd+bwd at 0.96x Splash on a
    v5e chip (2026-12-07). Traced for the TPU kernels (nothing compiled)."""
    s, heads, d = 2048, 2, 128
    m = masks.CausalMask((s, s))
    ids = jnp.repeat(jnp.arange(4), s // 4)
    seg = rs.SegmentIds(q=ids, kv=ids)
    cfg = SplashConfig(block_q=256, block_kv=256, block_q_dkv=256, block_kv_dkv=256, backend="mosaic_tpu")
    mesh = jax.make_mesh((devices,), ("c",), devices=jax.devices()[:devices], axis_types=(jax.sharding.AxisType.Auto,))
    attn = lambda q, k, v: rs.ring_attention_sharded(q, k, v, m, mesh=mesh, axis_name="c", layout="zigzag",
                                                     config=cfg, segment_ids=seg)
    loss = lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32))
    x = jax.ShapeDtypeStruct((heads, s, d), jnp.bfloat16)
    grad = lambda f: {eqn.primitive.name for eqn in equations(
        jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(x, x, x), into_kernels=False)}
    prims = grad(loss)
    assert "pallas_call" in prims
    assert ("cond" in prims) == (devices > 1), sorted(prims)
    # and reads its schedule rows and pair tables at the static index 0: no axis_index, no dynamic slices
    # (a one-chip training step of a 2-layer model carried 16 dynamic slices and 57 scalar index ops more
    # than single-device Splash's, 2026-12-07)
    assert ("axis_index" in prims) == (devices > 1) and ("dynamic_slice" in prims) == (devices > 1), sorted(prims)
    splash = grad(lambda q, k, v: jnp.sum(rs.splash_attention(q, k, v, m, config=cfg, segment_ids=seg)
                                          .astype(jnp.float32)))
    assert "pallas_call" in splash and "cond" not in splash
