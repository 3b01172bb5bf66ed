"""The trainer hands the model's ring its work lists per device: the schedule is a
``jit`` argument sharded over the ring axis, each device holding its own q shard's rows (1/N
of the bytes), and no longer a constant of the whole ``[lists, N, N, steps]`` schedule baked
into the program and replicated on every device. Numerics of the per-device path: the model
strategy tests (tests/test_model.py, tests/test_model_strategies.py) run it against the
reference, on the xla backend and (USP) on the Pallas generic interpreter, whose schedule also
carries the dK/dV view.
"""

import re

import equinox as eqx
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from ringsplash import data, train
from ringsplash.model import ContextParallel, Transformer, TransformerConfig
from ringsplash.model.schedule import model_ring_schedule
from ringsplash.splash import SplashConfig

S, N = 1024, 8
CONFIG = TransformerConfig(
    vocab_size=32, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2, max_seq_len=S,
    splash=SplashConfig(block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128, backend="xla"),
    context_parallel=ContextParallel("ring", ring_size=N, layout="zigzag"),
)


def _constants_of_shape(text: str, shape) -> int:
    """``stablehlo.constant`` s of exactly ``shape`` in a lowered module's text."""
    dims = "x".join(map(str, shape))
    return len(re.findall(rf"stablehlo\.constant dense<[^\n]*> : tensor<{dims}x\w+>", text))


@pytest.mark.slow
def test_train_step_takes_the_ring_schedule_sharded_not_as_a_constant():
    mesh = train.mesh_for(CONFIG)
    tc = train.TrainConfig(steps=2, batch_size=1, warmup_steps=1)
    optimizer = train.make_optimizer(tc)
    model = Transformer(CONFIG, key=jax.random.key(0))
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))  # (lowering only: placement does not matter)
    tokens = np.random.default_rng(0).integers(0, 32, S, dtype=np.int32)
    batch = train.shard_batch(data.pack_documents([tokens], S, 1), mesh, CONFIG)

    schedule = train.batch_ring_schedule(CONFIG, mesh, batch)
    assert train.batch_ring_schedule(CONFIG, mesh, batch) is schedule  # built once per (config, length, mesh)
    leaves = jax.tree.leaves(schedule)
    whole_shape = leaves[0].shape  # [lists, N, N, steps]
    assert whole_shape[1:3] == (N, N)
    assert all(x.sharding.spec == P(None, "context") for x in leaves)
    per_device = {sum(x.addressable_shards[i].data.nbytes for x in leaves) for i in range(N)}
    assert per_device == {schedule.nbytes_per_device} and N * schedule.nbytes_per_device == sum(
        x.nbytes for x in leaves)

    # the train step's program receives every leaf as an argument sharded over the ring axis
    text = train.make_train_step(CONFIG, optimizer, mesh).lower(model, opt_state, batch, jax.random.key(1)).as_text()
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    dims = "x".join(map(str, whole_shape))
    args = re.findall(rf"tensor<{dims}x\w+> \{{sdy\.sharding = #sdy\.sharding<@mesh, \[([^]]*)\]", main)
    # (jit drops the leaves this backend never reads, e.g. the pieces' bounds of a one-piece schedule)
    assert 0 < len(args) <= len(schedule.fwd) - 1, main
    assert set(args) == {'{}, {"context"}, {}, {}'}, args
    assert _constants_of_shape(text, whole_shape) == 0

    # without it (the old path, still grad_fn's default) the whole schedule is a constant of the program
    params, static = eqx.partition(model, eqx.is_array)
    grad_fn = train.make_grad_fn(CONFIG, mesh)
    const = jax.jit(lambda p, b: grad_fn(p, static, b)).lower(params, batch).as_text()
    assert _constants_of_shape(const, whole_shape) == len(schedule.fwd) - 1  # the four work-list arrays


def test_model_ring_schedule_matches_what_each_strategy_runs():
    """USP's inner ring runs over the ring degree b with heads / a q heads; others have no ring."""
    usp = CONFIG.replace(context_parallel=CONFIG.context_parallel.replace(strategy="usp", ring_size=2, ulysses_axis="ulysses", ulysses_size=4, layout="contiguous"))
    mesh = train.mesh_for(usp)
    schedule = model_ring_schedule(usp, S, mesh, shapes_only=True)
    assert all(x.shape[1:3] == (2, 2) and x.sharding.spec == P(None, "context") for x in jax.tree.leaves(schedule))
    assert model_ring_schedule(CONFIG.replace(context_parallel=CONFIG.context_parallel.replace(strategy="allgather")), S, train.mesh_for(CONFIG)) is None
