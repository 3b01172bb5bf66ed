"""Split work lists and per-device ring schedules compiled for TPU (libtpu, from this CPU host).

A forced tiny ``smem_budget_bytes`` makes every kernel run in several pieces at a CI-sized S;
the ring's schedule is a jit argument sharded over the ring axis, and the compiled program's
per-device argument bytes must be exactly q, k, v, d_out plus 1/N of the schedule.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import ringsplash as rs
from ringsplash import aot, masks
from ringsplash.splash import work_pieces
from ringsplash.splash.config import SplashConfig

pytestmark = pytest.mark.tpu_compile

HEADS, D = 8, 128
#: the blocks the piece counts below assume (the tuned default is larger from 4K tokens)
BLOCKS = {"block_q": 512, "block_kv": 512, "block_q_dkv": 512, "block_kv_dkv": 512}


def _kernel_calls(hlo: str, name: str) -> int:
    """Mosaic kernel calls named ``name`` in compiled HLO text."""
    return len(re.findall(rf"%\w*{name}\w*[.\d]* = .*custom-call", hlo))


def _entry_parameters(hlo: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, per-device shape) of each parameter of the compiled ENTRY computation."""
    entry = hlo[hlo.index("\nENTRY "):]
    entry = entry[:entry.index("\n}")]
    found = re.findall(r"= (\w+)\[([\d,]*)\][^ ]* parameter\((\d+)\)", entry)
    return [(dt, tuple(int(x) for x in dims.split(",") if x)) for dt, dims, _ in found]


def test_ring_compiles_in_pieces_with_per_device_schedule():
    s, topology = 16384, "v5e:2x2"  # zigzag blocks 512, 8 q blocks per shard
    mesh = aot.topology_mesh(topology, ("ctx",))
    n = mesh.size
    mask = masks.CausalMask((s, s))
    config = SplashConfig(**BLOCKS, backend="mosaic_tpu", smem_budget_bytes=4 * HEADS + 8 * 24)  # 24 steps per call
    sched = rs.ring_schedule(mask, n, "zigzag", config, heads=HEADS, kv_heads=HEADS, mesh=mesh, axis_name="ctx",
                             shapes_only=True)
    whole = rs.ring_schedule(mask, n, "zigzag", config, heads=HEADS, kv_heads=HEADS)
    assert len(sched.fwd_pieces) > 1 and len(sched.dkv_pieces) > 1

    def fwd_bwd(q, k, v, d_out, sched):
        fn = lambda q, k, v: rs.ring_attention_sharded(q, k, v, mask, mesh=mesh, axis_name="ctx", layout="zigzag",
                                                       config=config, schedule=sched)
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(d_out)

    spec = aot.abstract((HEADS, s, D), jnp.bfloat16, mesh, P(None, "ctx"))
    hlo = aot.compile_report(fwd_bwd, spec, spec, spec, spec, sched).hlo_text
    whole_bytes = sum(x.nbytes for x in jax.tree.leaves(whole))
    assert whole.nbytes_per_device == whole_bytes // n
    # the compiled per-device program's integer parameters are exactly this device's schedule
    # row: [lists, 1, N, steps] each, 1/N of the schedule's bytes in all
    params = _entry_parameters(hlo)
    sched_params = [(dt, shape) for dt, shape in params if dt.startswith(("s8", "s16", "s32"))]
    assert len(sched_params) == len(jax.tree.leaves(whole))
    assert all(shape[1] == 1 and shape[2] == n for _, shape in sched_params)
    itemsize = {"s8": 1, "s16": 2, "s32": 4}
    assert sum(itemsize[dt] * int(np.prod(shape)) for dt, shape in sched_params) == whole_bytes // n
    # and q, k, v, d_out are the other arguments: nothing else (no replicated schedule) is passed
    local_qkvd = 4 * HEADS * (s // n) * D * 2
    bf16 = [shape for dt, shape in params if dt == "bf16"]
    assert len(params) == len(sched_params) + 4 and sum(2 * int(np.prod(x)) for x in bf16) == local_qkvd
    assert _kernel_calls(hlo, "splash_forward") >= len(sched.fwd_pieces)
    # the ring's backward (parallel/ring_loop.py): the fused kernel per transposed piece in every step but the
    # last, whose dK/dV and dq kernels run apart (dK/dV per transposed piece, dq per piece)
    calls = {name: _kernel_calls(hlo, name) for name in ("splash_fused_bwd", "splash_dkv", "splash_dq")}
    assert calls["splash_fused_bwd"] >= len(sched.dkv_pieces), calls
    assert calls["splash_dkv"] == len(sched.dkv_pieces) and calls["splash_dq"] == len(sched.fwd_pieces), calls


def test_single_device_splash_compiles_in_pieces():
    s = 4096
    mesh = jax.sharding.Mesh(aot.topology_devices("v5e:2x2")[:1], ("x",))
    mask = masks.CausalMask((s, s))
    config = SplashConfig(**BLOCKS, backend="mosaic_tpu", smem_budget_bytes=4 * HEADS + 8 * 12)  # 8 blocks: 36 entries
    info = rs.build_mask_info(mask, (512, 512))
    assert info.max_steps > 12

    def fwd_bwd(q, k, v, d_out):
        out, vjp = jax.vjp(lambda q, k, v: rs.splash_attention(q, k, v, mask, config=config), q, k, v)
        return out, vjp(d_out)

    spec = aot.abstract((HEADS, s, D), jnp.bfloat16, mesh, P())
    hlo = aot.compile_report(fwd_bwd, spec, spec, spec, spec).hlo_text
    fwd = work_pieces.split_work_lists(info, work_pieces.forward_max_steps(config.smem_budget_bytes, info, HEADS))
    info_t = rs.build_mask_info(mask, (512, 512), transpose=True)
    dkv = work_pieces.split_work_lists(info_t, work_pieces.dkv_max_steps(config.smem_budget_bytes, info_t, HEADS,
                                                                         HEADS))
    assert len(fwd.pieces) > 2 and len(dkv.pieces) > 2
    # one Mosaic kernel per piece: the forward per q-block range, the fused backward (dK/dV
    # accumulating dq) per kv-block range; no separate dq or dK/dV kernel
    assert _kernel_calls(hlo, "splash_forward") == len(fwd.pieces)
    assert _kernel_calls(hlo, "splash_fused_bwd") == len(dkv.pieces)
    assert _kernel_calls(hlo, "splash_dq") == 0 and _kernel_calls(hlo, "splash_dkv") == 0
