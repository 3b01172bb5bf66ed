"""Compile the Splash kernels for real TPU targets (libtpu, ``JAX_PLATFORMS=cpu``).

Interpret mode accepts things Mosaic rejects; only this proves the kernels lower. It also
checks the backward's compiled temporary memory stays within 2 x |q| float32.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

import ringsplash as rs
from ringsplash import aot, masks
from support.jaxprs import equations

pytestmark = pytest.mark.tpu_compile

S, HEADS, D = 8192, 8, 128
#: the blocks the work-list tests count entries with (the tuned default is larger from 4K)
SMALL_BLOCKS = rs.SplashConfig(block_q=512, block_kv=512, block_q_dkv=512, block_kv_dkv=512, backend="mosaic_tpu")


def device(target: str):
    return aot.topology_devices(target)[0]


def spec(target, heads, dtype=jnp.bfloat16):
    sharding = jax.sharding.SingleDeviceSharding(device(target))
    return jax.ShapeDtypeStruct((heads, S, D), dtype, sharding=sharding)


def compile_fwd_bwd(target, mask, kv_heads, config, remat=False):
    attn = functools.partial(rs.splash_attention, mask=mask, config=config)
    if remat:
        attn = jax.checkpoint(attn)

    def bwd(q, k, v, d_out):
        _, vjp = jax.vjp(attn, q, k, v)
        return vjp(d_out)

    fwd = aot.compile_report(attn, spec(target, HEADS), spec(target, kv_heads), spec(target, kv_heads))
    bwd = aot.compile_report(bwd, spec(target, HEADS), spec(target, kv_heads), spec(target, kv_heads),
                             spec(target, HEADS))
    return fwd, bwd


CASES = {
    "causal": (masks.CausalMask((S, S)), HEADS),
    "local": (masks.LocalMask((S, S), window=(4096, 0)), HEADS),
    "gqa_causal": (masks.CausalMask((S, S)), 2),
}


@pytest.mark.parametrize("target", ["v5e:2x2", "v6e:2x2"])
@pytest.mark.parametrize("case", list(CASES))
def test_splash_compiles_for_tpu_within_memory_budget(target, case):
    mask, kv_heads = CASES[case]
    fwd, bwd = compile_fwd_bwd(target, mask, kv_heads, rs.SplashConfig(backend="mosaic_tpu"))
    for compiled in (fwd, bwd):
        assert "tpu_custom_call" in compiled.hlo_text  # the Mosaic kernels, not a fallback
    q_f32_bytes = HEADS * S * D * 4
    temp = bwd.temp
    assert temp <= 2 * q_f32_bytes, f"backward temp {temp / 2**20:.1f} MiB > 2 x |q| f32"
    assert fwd.temp <= q_f32_bytes


@pytest.mark.parametrize("heads_mask", ["banded", "mixed"])
def test_multi_head_in_kernel_masks_compile_for_tpu(heads_mask):
    """Heads with different in-kernel masks pick their list's tile mask per step. Regression: the
    pick was a select over bool tiles, which Mosaic cannot legalise (seen on the chip once banded
    masks stopped storing their partial blocks); "mixed" also picks between a stored block (a
    NumpyMask head) and an evaluated one."""
    import numpy as np

    other = masks.LocalMask((S, S), window=(100, 0))
    if heads_mask == "mixed":
        other = masks.NumpyMask(np.tril(np.ones((S, S), bool)) & ~np.tri(S, S, -7, bool))
        mask = masks.MultiHeadMask([masks.ChunkedCausalMask((S, S), chunk_size=1000), other] * (HEADS // 2))
    else:
        mask = masks.MultiHeadMask([masks.CausalMask((S, S)), other] * (HEADS // 2))
    fwd, bwd = compile_fwd_bwd("v5e:2x2", mask, 2, rs.SplashConfig(backend="mosaic_tpu"))
    assert "tpu_custom_call" in fwd.hlo_text and "tpu_custom_call" in bwd.hlo_text


def test_splash_auto_backend_picks_mosaic_when_lowered_for_tpu():
    mask = masks.ChunkedCausalMask((S, S), chunk_size=1000)  # in-kernel // and %
    config = rs.SplashConfig(backend="auto")
    fwd, bwd = compile_fwd_bwd("v5e:2x2", mask, HEADS, config, remat=True)
    assert "tpu_custom_call" in fwd.hlo_text and "tpu_custom_call" in bwd.hlo_text


def test_splash_segment_ids_soft_cap_and_sinks_compile_for_tpu():
    mask = masks.LocalMask((S, S), window=(1000, 0))
    sharding = jax.sharding.SingleDeviceSharding(device("v6e:2x2"))
    ids = jax.ShapeDtypeStruct((S,), jnp.int32, sharding=sharding)
    sinks = jax.ShapeDtypeStruct((HEADS,), jnp.float32, sharding=sharding)

    def loss(q, k, v, sinks, q_ids, kv_ids):
        out = rs.splash_attention(q, k, v, mask, segment_ids=rs.SegmentIds(q_ids, kv_ids), sinks=sinks,
                                  logit_soft_cap=30.0, config=rs.SplashConfig(backend="mosaic_tpu"))
        return jnp.sum(out.astype(jnp.float32))

    args = (spec("v6e:2x2", HEADS), spec("v6e:2x2", 2), spec("v6e:2x2", 2), sinks, ids, ids)
    compiled = aot.compile_report(jax.grad(loss, argnums=(0, 1, 2, 3)), *args)
    assert "tpu_custom_call" in compiled.hlo_text


def _prefetch_bytes(jaxpr, found):
    """{pallas_call name: bytes of its scalar-prefetch operands} over a (nested) jaxpr."""
    for eqn in equations(jaxpr):
        if eqn.primitive.name == "pallas_call":
            n = eqn.params["grid_mapping"].num_index_operands
            found[str(eqn.params["name"])] = sum(v.aval.size * v.aval.dtype.itemsize for v in eqn.invars[:n])
    return found


def test_splash_128k_causal_work_lists_fit_smem_and_compile():
    """Regression: at S=128K causal (blocks 512) the work lists once overflowed the 1 MiB of
    TPU SMEM (the dK/dV kernel prefetched one merged list per head, 5 MiB). Packed lists,
    walked once per kv head, prefetch 2 int32 words per entry: 257 KiB per kernel (the
    forward and the fused backward, which walks the transposed list). Explicit 512 blocks:
    the tuned default at 128K (2048) makes the lists 16x shorter."""
    s, target = 131072, "v5e:2x2"
    mask = masks.CausalMask((s, s))
    config = SMALL_BLOCKS
    sharding = jax.sharding.SingleDeviceSharding(device(target))
    x = jax.ShapeDtypeStruct((HEADS, s, D), jnp.bfloat16, sharding=sharding)

    def loss(q, k, v, w):
        out = rs.splash_attention(q, k, v, mask, config=config)
        return jnp.vdot(out.astype(jnp.float32), w.astype(jnp.float32))

    grad = jax.grad(loss, argnums=(0, 1, 2))
    blocks = s // 512
    steps = blocks * (blocks + 1) // 2  # one entry per non-empty block of the causal triangle
    expected = 2 * steps * 4 + HEADS * 4  # (blocks, kinds) words + the list of each (kv) head
    found = _prefetch_bytes(jax.make_jaxpr(grad)(x, x, x, x).jaxpr, {})
    assert found == {"splash_forward": expected, "splash_fused_bwd": expected}
    compiled = aot.compile_report(grad, x, x, x, x)
    assert "tpu_custom_call" in compiled.hlo_text


def test_splash_segment_skipping_kernels_compile_for_v5e_at_32k():
    """Segment-refined dynamic work lists (issue 13): forward + backward with segment ids at
    S=32K, bfloat16, on v5e. The refined lists are computed on device and walked on the static
    grid: the kernels prefetch the static-length lists (2080 causal entries at blocks 512,
    explicit: the tuned default at 32K is 2048)."""
    s, target = 32768, "v5e:2x2"
    mask = masks.CausalMask((s, s))
    config = SMALL_BLOCKS
    assert config.segment_skipping
    sharding = jax.sharding.SingleDeviceSharding(device(target))
    x = jax.ShapeDtypeStruct((HEADS, s, D), jnp.bfloat16, sharding=sharding)
    ids = jax.ShapeDtypeStruct((s,), jnp.int32, sharding=sharding)

    def loss(q, k, v, w, seg):
        out = rs.splash_attention(q, k, v, mask, segment_ids=rs.SegmentIds(seg, seg), config=config)
        return jnp.vdot(out.astype(jnp.float32), w.astype(jnp.float32))

    grad = jax.grad(loss, argnums=(0, 1, 2))
    blocks = s // 512
    expected = 2 * (blocks * (blocks + 1) // 2) * 4 + HEADS * 4
    found = _prefetch_bytes(jax.make_jaxpr(grad)(x, x, x, x, ids).jaxpr, {})
    assert found == {"splash_forward": expected, "splash_fused_bwd": expected}
    compiled = aot.compile_report(grad, x, x, x, x, ids)
    assert "tpu_custom_call" in compiled.hlo_text
    assert compiled.temp <= 2 * HEADS * s * D * 4  # as the 8K budget above
