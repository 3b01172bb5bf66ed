"""A ring schedule is bound to the call it was built for (``ring_plan.ScheduleKey``: mask, shards,
layout, fitted blocks, heads): passed to a call with another mask, layout or shape it is refused
with both named, on every path that takes one (ring, USP's inner ring, the model's schedule)."""

import equinox as eqx
import jax
import numpy as np
import pytest
from jax.sharding import AxisType

import ringsplash as rs
from ringsplash import data, masks, train
from ringsplash.model import ContextParallel, Transformer, TransformerConfig
from ringsplash.model.schedule import model_ring_schedule
from ringsplash.splash import SplashConfig
from support.attention_inputs import inputs

S, N = 256, 2
CONFIG = SplashConfig(block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128, backend="xla")


def _mesh(n):
    return jax.make_mesh((n,), ("ctx",), devices=jax.devices()[:n], axis_types=(AxisType.Auto,))


@pytest.fixture(scope="module")
def qkv():  # (never reaches a kernel: every call below is refused while it is traced)
    q, k, v, _, _ = inputs(jax.random.key(0), 2, 1, S, S, d=32)
    return q, k, v


def test_ring_refuses_a_schedule_built_for_another_mask(qkv):
    q, k, v = qkv
    mesh = _mesh(N)
    causal, local = masks.CausalMask((S, S)), masks.LocalMask((S, S), window=(16, 0))
    sched = rs.ring_schedule(local, N, "zigzag", CONFIG, heads=2, kv_heads=1, mesh=mesh, axis_name="ctx")
    with pytest.raises(ValueError, match=r"mask: the schedule was built for LocalMask.*this call has CausalMask"):
        rs.ring_attention_sharded(q, k, v, causal, mesh=mesh, axis_name="ctx", layout="zigzag", config=CONFIG,
                                  schedule=sched)
    with pytest.raises(ValueError, match=r"layout: the schedule was built for 'zigzag', this call has 'contiguous'"):
        rs.ring_attention_sharded(q, k, v, local, mesh=mesh, axis_name="ctx", layout="contiguous", config=CONFIG,
                                  schedule=sched)
    with pytest.raises(ValueError, match=r"kv_heads: the schedule was built for 1, this call has 2"):
        rs.ring_attention_sharded(q, q, q, local, mesh=mesh, axis_name="ctx",
                                  layout="zigzag", config=CONFIG, schedule=sched)
    # (the schedule of the call itself runs: tests/test_work_pieces.py)


MODEL = TransformerConfig(vocab_size=32, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2, max_seq_len=S,
                          splash=CONFIG, context_parallel=ContextParallel("ring", ring_size=N, layout="zigzag"))


@pytest.mark.parametrize("strategy", [dict(context_parallel=ContextParallel("ring")),
                                      dict(context_parallel=ContextParallel("usp", ulysses_size=2))])
def test_model_refuses_a_schedule_built_for_another_mask(strategy):
    config = MODEL.replace(**strategy)
    other = config.replace(mask="local", local_window=16)
    mesh = train.mesh_for(config)
    model = Transformer(config, key=jax.random.key(1))
    params, static = eqx.partition(model, eqx.is_array)
    tokens = np.random.default_rng(0).integers(0, 32, S, dtype=np.int32)
    batch = train.shard_batch(data.pack_documents([tokens], S, 1), mesh, config)
    grad_fn = train.make_grad_fn(config, mesh)
    with pytest.raises(ValueError, match=r"mask: the schedule was built for LocalMask.*this call has CausalMask"):
        grad_fn(params, static, batch, jax.random.key(2), model_ring_schedule(other, S, mesh))
