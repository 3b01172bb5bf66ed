"""Head sizes other than 128 and a v head size of its own, compiled for v5e with libtpu
(``JAX_PLATFORMS=cpu``): Splash forward + backward for every size of ``head_dims.py``, the
ring for MLA and v > q/k, and the scoped-VMEM error of a block / head size / dtype / chip
that cannot fit (checked at lowering, before Mosaic's own out-of-memory error).

Small S (bf16, GQA 8:2) keeps each compile short; the kernels' block shapes do not depend on S.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ringsplash as rs
from ringsplash import aot, masks
from ringsplash.splash.vmem import ForwardVmem
from support.head_dims import head_dim_params

pytestmark = pytest.mark.tpu_compile

HEADS, KV_HEADS = 8, 2
MOSAIC = rs.SplashConfig(backend="mosaic_tpu")


def device(target: str):
    return aot.topology_devices(target)[0]


def specs(sharding, s, d, dv, dtype=jnp.bfloat16):
    """q, k, v, d_out shape structs with v / d_out of head size ``dv``."""
    shape = lambda h, e: jax.ShapeDtypeStruct((h, s, e), dtype, sharding=sharding)
    return shape(HEADS, d), shape(KV_HEADS, d), shape(KV_HEADS, dv), shape(HEADS, dv)


def fwd_bwd(fn):
    def run(q, k, v, d_out):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(d_out)

    return jax.jit(run)


def kernel_lines(text: str) -> dict[str, str]:
    """{Splash kernel: its Mosaic custom-call line} of a compiled module's HLO text (names carry
    jvp_ / transpose_ prefixes)."""
    found = {}
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%\S*?(splash_forward|splash_dq|splash_dkv)\S* = ", line)
        if m and 'custom_call_target="tpu_custom_call"' in line:
            found[m.group(1)] = line
    return found


@pytest.mark.parametrize("dims", head_dim_params())
def test_splash_head_dims_compile_for_v5e(dims):
    s = 2048
    mask = masks.CausalMask((s, s))
    sharding = jax.sharding.SingleDeviceSharding(device("v5e:2x2"))
    fn = lambda q, k, v: rs.splash_attention(q, k, v, mask, config=MOSAIC)
    compiled = aot.compile_report(fwd_bwd(fn), *specs(sharding, s, dims.d, dims.dv))
    kernels = kernel_lines(compiled.hlo_text)
    assert kernels.keys() == {"splash_forward", "splash_dq", "splash_dkv"}, kernels.keys()  # Mosaic, no fallback
    d, dv = dims
    outputs = {name: re.findall(r"(\w+)\[([\d,]+)\]", line.split(" custom-call(")[0]) for name, line in kernels.items()}
    assert outputs["splash_forward"][0] == ("bf16", f"{HEADS},{s},{dv}")  # out has v's head size
    assert outputs["splash_dq"][0] == ("bf16", f"{HEADS},{s},{d}")
    assert outputs["splash_dkv"][:2] == [("bf16", f"{KV_HEADS},{s},{d}"), ("bf16", f"{KV_HEADS},{s},{dv}")]


@pytest.mark.parametrize("dims", head_dim_params(("mla_d192_dv128", "d64_dv128")))
def test_ring_head_dims_compile_for_v5e(dims):
    """V and dV travel around the ring with their own head size (4 chips, zigzag, S = 4096)."""
    s = 4096
    mesh = aot.topology_mesh("v5e:2x2", ("ctx",))
    mask = masks.CausalMask((s, s))
    fn = lambda q, k, v: rs.ring_attention_sharded(q, k, v, mask, mesh=mesh, axis_name="ctx", layout="zigzag",
                                                   config=MOSAIC)
    text = aot.compile_report(fwd_bwd(fn), *specs(NamedSharding(mesh, P(None, "ctx")), s, dims.d, dims.dv)).hlo_text
    assert "tpu_custom_call" in text and "collective-permute" in text
    out_shape = f"bf16[{HEADS},{s // mesh.size},{dims.dv}]"  # the per-device output has v's head size
    assert out_shape in text, out_shape


# ----------------------------------------------------------------------------------------
# a block shape that cannot fit a head size / dtype on a chip: a clear error at lowering


def test_forward_vmem_bound_equals_mosaic_reported_size():
    """Mosaic's CompileTimeScopedVmemOom reported, for the causal forward with 512-blocks:
    19.00M (f32, d = 1024) on v5e, 37.00M (f32, d = 2048) on v6e; the bound is a lower one
    (bf16, d = 1536: Mosaic 16.42M)."""
    need = lambda d, dtype: ForwardVmem((512, 512), d, d, dtype, dtype, None, mask_blocks=True).bytes / 2**20
    assert need(1024, "float32") == 19.0
    assert need(2048, "float32") == 37.0
    assert 16.0 <= need(1536, "bfloat16") <= 16.42


def test_head_dim_too_large_for_v5e_vmem_names_block_head_dim_and_chip():
    s, d = 2048, 1024
    mask = masks.CausalMask((s, s))
    fn = jax.jit(lambda q, k, v: rs.splash_attention(q, k, v, mask, config=MOSAIC))
    for target in ("v5e:2x2", "v6e:2x2"):
        sharding = jax.sharding.SingleDeviceSharding(device(target))
        q, k, v, _ = specs(sharding, s, d, d, jnp.float32)
        if target == "v6e:2x2":  # 19 MiB fit v6e's 32 MiB: lowers (and, measured, compiles)
            fn.lower(q, k, v)
            continue
        match = (r"the Splash forward kernel with \(block_q, block_kv\)=\(512, 512\), head_dim=1024, head_dim_v=1024 "
                 r"and float32 inputs needs at least 19\.00 MiB of VMEM .* on chip 'TPU v5 lite', over the default "
                 r"scoped limit of 16\.00 MiB: use smaller blocks \(e\.g\. SplashConfig\(block_q=256, block_kv=256\)\)")
        with pytest.raises(ValueError, match=match):
            fn.lower(q, k, v)
        # the suggested blocks fit (and a raised vmem_limit_bytes is honoured)
        for config in (rs.SplashConfig(block_q=256, block_kv=256, backend="mosaic_tpu"),
                       rs.SplashConfig(backend="mosaic_tpu", vmem_limit_bytes=20 * 2**20)):
            jax.jit(lambda q, k, v, c=config: rs.splash_attention(q, k, v, mask, config=c)).lower(q, k, v)


def test_ring_head_dim_too_large_for_v5e_vmem_is_rejected():
    s, d = 8192, 1536
    mesh = aot.topology_mesh("v5e:2x2", ("ctx",))
    mask = masks.CausalMask((s, s))
    fn = lambda q, k, v: rs.ring_attention_sharded(q, k, v, mask, mesh=mesh, axis_name="ctx", layout="zigzag",
                                                   config=MOSAIC)
    # the ring's partial outputs are float32: bf16 d = 1536 needs at least 19 MiB (6 of them f32 out blocks)
    q, k, v, _ = specs(NamedSharding(mesh, P(None, "ctx")), s, d, d, jnp.bfloat16)
    with pytest.raises(ValueError, match=r"head_dim=1536, head_dim_v=1536 and bfloat16 inputs .* chip 'TPU v5 lite'"):
        jax.jit(fn).lower(q, k, v)

