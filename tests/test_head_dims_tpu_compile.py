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
from ringsplash.splash.vmem import KernelVmem
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
        m = re.match(r"\s*(?:ROOT )?%\S*?(splash_forward|splash_dq|splash_dkv|splash_fused_bwd)\S* = ", line)
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
    assert kernels.keys() == {"splash_forward", "splash_fused_bwd"}, kernels.keys()  # Mosaic, no fallback
    d, dv = dims
    outputs = {name: re.findall(r"(\w+)\[([\d,]+)\]", line.split(" custom-call(")[0]) for name, line in kernels.items()}
    assert outputs["splash_forward"][0] == ("bf16", f"{HEADS},{s},{dv}")  # out has v's head size
    # the fused backward: dK, dV (v's head size) and the float32 dq it accumulates in HBM
    assert outputs["splash_fused_bwd"][:3] == [("bf16", f"{KV_HEADS},{s},{d}"), ("bf16", f"{KV_HEADS},{s},{dv}"),
                                               ("f32", f"{HEADS},{s},{d}")]


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


def test_vmem_estimate_bounds_mosaic_from_above():
    """Each kernel compiled with the estimate (less 16 KiB) as its scoped limit compiles, and with
    1 / 1.45 of the estimate Mosaic runs out of scoped VMEM: the estimate is an upper bound within
    1.45x (measured: 1.12x ... 2.2x for blocks 256 ... 2048; the tightest are the large blocks, which
    are the ones that matter). Two compiles per kernel, where measuring Mosaic's size
    (``calibrate_vmem.mosaic_bytes``, from 1 MiB up) takes four or five."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "scripts" / "calibrate_vmem.py"
    spec = importlib.util.spec_from_file_location("calibrate_vmem", path)
    calibrate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(calibrate)
    for kernel, blocks, compute, d, dtype in [("forward", (2048, 2048), 512, 128, "bfloat16"),
                                              ("fused", (1024, 1024), 1024, 128, "float32")]:
        estimate = KernelVmem(kernel, blocks, compute, d, d, dtype, dtype if kernel == "forward" else "float32",
                              True, None).bytes
        oom = lambda limit, k=kernel, b=blocks, c=compute, d=d, t=dtype: calibrate.scoped_oom(
            "v5e:2x2", k, *b, c, d, t, limit, seq_len=4096)
        # Mosaic's size <= estimate - 16 KiB (the 16 KiB mosaic_bytes adds to the size it reports)
        assert oom(estimate - (16 << 10)) is None, (kernel, blocks, estimate)
        # Mosaic's size > estimate / 1.45: out of scoped VMEM (not another error) under that limit
        below = int(estimate / 1.45)
        size = oom(below)
        assert size is not None and size > 0, (kernel, blocks, estimate, size)


@pytest.mark.cheap
def test_calibrate_vmem_raises_the_limit_to_each_reported_size(monkeypatch):
    """scripts/calibrate_vmem.py's search (no compile: Mosaic's one-compile step stands in): from 1 MiB, the
    limit rises to each size Mosaic reports running out at (+ 16 KiB) until the kernel compiles; another
    compile error is None."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "scripts" / "calibrate_vmem.py"
    spec = importlib.util.spec_from_file_location("calibrate_vmem", path)
    calibrate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(calibrate)
    need, tried = 5 << 20, []

    def scoped_oom(target, kernel, bq, bkv, compute, d, dtype, limit, seq_len=4096):
        tried.append(limit)
        return None if limit >= need else min(need, 2 * limit)  # the cumulative allocation at which it failed

    monkeypatch.setattr(calibrate, "scoped_oom", scoped_oom)
    kib16 = 16 << 10
    assert calibrate.mosaic_bytes("v5e:2x2", "forward", 512, 512, 512, 128, "bfloat16") == need + kib16
    assert tried == [1 << 20, (2 << 20) + kib16, (4 << 20) + 3 * kib16, need + kib16]
    monkeypatch.setattr(calibrate, "scoped_oom", lambda *args, **kwargs: 0)
    assert calibrate.mosaic_bytes("v5e:2x2", "forward", 512, 512, 512, 128, "bfloat16") is None


def test_configs_beyond_the_chips_vmem_name_kernel_bytes_limit_and_a_fitting_config():
    s, d = 4096, 512
    mask = masks.CausalMask((s, s))
    big = rs.SplashConfig(block_q=2048, block_kv=2048, block_q_dkv=2048, block_kv_dkv=2048, backend="mosaic_tpu")
    for target, chip in (("v5e:2x2", "TPU v5 lite"), ("v6e:2x2", "TPU v6 lite"), ("v5p:2x2x1", "TPU v5")):
        sharding = jax.sharding.SingleDeviceSharding(device(target))
        q, k, v, _ = specs(sharding, s, d, d, jnp.float32)
        match = (r"the Splash forward kernel with \(block_q, block_kv\)=\(2048, 2048\), block_kv_compute=2048, "
                 r"head_dim=512, head_dim_v=512 and float32 inputs needs about [\d.]+ MiB of scoped VMEM, over the "
                 rf"\d+ MiB of VMEM a kernel may take on {target.split(':')[0]} \('{chip}'\): use "
                 r"SplashConfig\(block_q=(\d+), block_kv=(\d+), block_kv_compute=(\d+)\)")
        with pytest.raises(ValueError, match=match) as caught:
            jax.jit(lambda q, k, v: rs.splash_attention(q, k, v, mask, config=big)).lower(q, k, v)
        bq, bkv, compute = map(int, re.search(match, str(caught.value)).groups())
        fitting = rs.SplashConfig(block_q=bq, block_kv=bkv, block_kv_compute=compute, backend="mosaic_tpu")
        aot.compile_report(lambda q, k, v, c=fitting: rs.splash_attention(q, k, v, mask, config=c), q, k, v)
    # an explicit limit below the estimate is refused by name
    small = rs.SplashConfig(backend="mosaic_tpu", vmem_limit_bytes=4 * 2**20)
    sharding = jax.sharding.SingleDeviceSharding(device("v5e:2x2"))
    q, k, v, _ = specs(sharding, s, 128, 128)
    with pytest.raises(ValueError, match=r"over SplashConfig.vmem_limit_bytes=4194304 \(4.0 MiB\).* or raise "
                                         r"SplashConfig.vmem_limit_bytes"):
        jax.jit(lambda q, k, v: rs.splash_attention(q, k, v, mask, config=small)).lower(q, k, v)
    # one over what the chip compiles with is refused by name, with the most it may be (not other blocks)
    large = rs.SplashConfig(backend="mosaic_tpu", vmem_limit_bytes=128 * 2**20)
    with pytest.raises(ValueError, match=r"SplashConfig.vmem_limit_bytes=134217728 \(128.0 MiB\) is over the \d+ MiB "
                                         r"a kernel may be compiled with on v5e .*pass at most \d+, or None"):
        jax.jit(lambda q, k, v: rs.splash_attention(q, k, v, mask, config=large)).lower(q, k, v)


def test_ring_large_head_dim_compiles_with_the_limit_it_needs():
    """bf16 d = 1536 in the ring (float32 partial outputs): over v5e's 16 MiB default scoped limit,
    refused before the limit was set per kernel; now compiled with the limit its kernels need."""
    s, d = 8192, 1536
    mesh = aot.topology_mesh("v5e:2x2", ("ctx",))
    mask = masks.CausalMask((s, s))
    fn = lambda q, k, v: rs.ring_attention_sharded(q, k, v, mask, mesh=mesh, axis_name="ctx", layout="zigzag",
                                                   config=MOSAIC)
    q, k, v, _ = specs(NamedSharding(mesh, P(None, "ctx")), s, d, d, jnp.bfloat16)
    assert "tpu_custom_call" in aot.compile_report(fn, q, k, v).hlo_text


VMEM_GRID = [  # (block_q, block_kv, block_kv_compute, head size, dtype): near and past each chip's VMEM
    (2048, 2048, 512, 128, jnp.bfloat16),
    (2048, 2048, 2048, 256, jnp.float32),
    (1024, 1024, 1024, 256, jnp.float32),
    (512, 512, 512, 64, jnp.bfloat16),
]


@pytest.mark.parametrize("target", ["v5p:2x2x1"])
def test_no_accepted_config_fails_in_mosaic_for_vmem(target):
    """Forward + backward (forward, fused dK/dV + dq kernels) of configurations near and past the
    chip's VMEM: each compiles, with the scoped limit ringsplash sets, or is refused by ringsplash's
    own error before Mosaic (never ``CompileTimeScopedVmemOom``). On v5p, the smallest VMEM of the three
    chips (v5e and v6e took 127-154 s more of this grid on 2 cores: tests/test_vmem_tpu_compile.py's property
    draws every target)."""
    s = 4096
    mask = masks.CausalMask((s, s))
    sharding = jax.sharding.SingleDeviceSharding(device(target))
    outcomes = []
    for bq, bkv, compute, d, dtype in VMEM_GRID:
        config = rs.SplashConfig(block_q=bq, block_kv=bkv, block_kv_compute=compute, block_q_dkv=bq,
                                 block_kv_dkv=bkv, backend="mosaic_tpu")
        q, k, v, d_out = specs(sharding, s, d, d, dtype)
        fn = lambda q, k, v, c=config: rs.splash_attention(q, k, v, mask, config=c)
        try:
            aot.compile_report(fwd_bwd(fn), q, k, v, d_out)
            outcomes.append("compiled")
        except ValueError as e:  # ringsplash's refusal, naming the kernel and a config that fits
            assert "of scoped VMEM" in str(e) and "use SplashConfig(" in str(e), str(e)
            outcomes.append("refused")
    # 1024- and 512-blocks fit every chip here. The 2048-blocks' fused backward fits too: causal partial tiles
    # are built from positions and store no int8 mask block (splash/partial_tiles.py; with the stored block's
    # two 4 MiB buffers the estimate refused it on v5p, 64 MiB of VMEM, 54 MiB for one kernel); Mosaic's own
    # compile for v5p accepts it
    assert outcomes[0] == outcomes[2] == outcomes[3] == "compiled", outcomes
    # the tuned default never is: its blocks are halved until they fit the chip
    cfg = rs.SplashConfig(backend="mosaic_tpu")
    q, k, v, d_out = specs(sharding, s, 256, 256, jnp.float32)
    aot.compile_report(fwd_bwd(lambda q, k, v: rs.splash_attention(q, k, v, mask, config=cfg)), q, k, v, d_out)
