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
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ringsplash as rs
from ringsplash import masks
from ringsplash.splash.config import SplashConfig

pytestmark = pytest.mark.tpu_compile

HEADS, D = 8, 128


def _kernel_calls(hlo: str, name: str) -> int:
    """Mosaic kernel calls named ``name`` in compiled HLO text."""
    return len(re.findall(rf"%{name}[.\d]* = .*custom-call", hlo))


def test_ring_compiles_in_pieces_with_per_device_schedule():
    s, topology = 16384, "v5e:2x2"  # zigzag blocks 512, 8 q blocks per shard
    devices = np.asarray(topologies.get_topology_desc(topology, "tpu").devices)
    n = devices.size
    mesh = Mesh(devices.reshape(n), ("ctx",))
    mask = masks.CausalMask((s, s))
    config = SplashConfig(backend="mosaic_tpu", smem_budget_bytes=4 * HEADS + 8 * 24)  # 24 steps per call
    sched = rs.ring_schedule(mask, n, "zigzag", config, heads=HEADS, kv_heads=HEADS, mesh=mesh, axis_name="ctx",
                             shapes_only=True)
    whole = rs.ring_schedule(mask, n, "zigzag", config, heads=HEADS, kv_heads=HEADS)
    assert len(sched.fwd_pieces) > 1 and len(sched.dkv_pieces) > 1

    def fwd_bwd(q, k, v, d_out, sched):
        fn = lambda q, k, v: rs.ring_attention_sharded(q, k, v, mask, mesh=mesh, axis_name="ctx", layout="zigzag",
                                                       config=config, schedule=sched)
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(d_out)

    spec = jax.ShapeDtypeStruct((HEADS, s, D), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "ctx")))
    compiled = jax.jit(fwd_bwd).lower(spec, spec, spec, spec, sched).compile()
    mem = compiled.memory_analysis()
    local_qkvd = 4 * HEADS * (s // n) * D * 2
    whole_bytes = sum(x.nbytes for x in jax.tree.leaves(whole))
    assert whole.nbytes_per_device == whole_bytes // n
    # per device: q, k, v, d_out and exactly its own row of the schedule (1/N of it)
    assert mem.argument_size_in_bytes == local_qkvd + whole_bytes // n
    hlo = compiled.as_text()
    assert _kernel_calls(hlo, "splash_forward") >= len(sched.fwd_pieces)


def test_single_device_splash_compiles_in_pieces():
    s = 4096
    device = np.asarray(topologies.get_topology_desc("v5e:2x2", "tpu").devices).reshape(-1)[:1]
    mesh = Mesh(device, ("x",))
    mask = masks.CausalMask((s, s))
    config = SplashConfig(backend="mosaic_tpu", smem_budget_bytes=4 * HEADS + 8 * 12)  # 8 blocks: 36 entries
    info = rs.build_mask_info(mask, (512, 512))
    assert info.max_steps > 12

    def fwd_bwd(q, k, v, d_out):
        out, vjp = jax.vjp(lambda q, k, v: rs.splash_attention(q, k, v, mask, config=config), q, k, v)
        return out, vjp(d_out)

    spec = jax.ShapeDtypeStruct((HEADS, s, D), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    hlo = jax.jit(fwd_bwd).lower(spec, spec, spec, spec).compile().as_text()
    assert _kernel_calls(hlo, "splash_forward") >= 3
