"""The context-parallel strategies behind one signature, for tests that compare them."""

import jax
from jax.experimental.pallas import tpu as pltpu

import ringsplash as rs
from ringsplash.parallel import usp_mesh
from ringsplash.splash.config import SplashConfig
from support.meshes import mesh

XLA = SplashConfig(block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128, backend="xla")
INTERPRET = SplashConfig(block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128, backend="interpret",
                         interpret_params=pltpu.InterpretParams(uninitialized_memory="nan"))


def strategy(name: str, n: int, layout: str, config=XLA, degrees=None):
    """(function of global laid-out (q, k, v, ids, sinks, mask, cap), number of layout shards)."""
    if name == "usp":
        a, b = degrees
        m = usp_mesh(a, b, devices=jax.devices()[: a * b])

        def fn(q, k, v, ids, snk, mask, cap):
            return rs.usp_attention_sharded(q, k, v, mask, mesh=m, ulysses_axis="ulysses", ring_axis="ring",
                                            segment_ids=ids, layout=layout, logit_soft_cap=cap, sinks=snk,
                                            config=config)

        return fn, b  # the input is laid out over the ring degree
    m = mesh(n)
    sharded = {"allgather": rs.allgather_attention_sharded, "ulysses": rs.ulysses_attention_sharded,
               "ring": rs.ring_attention_sharded}[name]

    def fn(q, k, v, ids, snk, mask, cap):
        return sharded(q, k, v, mask, mesh=m, axis_name="ctx", segment_ids=ids, layout=layout, logit_soft_cap=cap,
                       sinks=snk, config=config)

    return fn, n
