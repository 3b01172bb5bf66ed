"""FSDP (ZeRO-3) training on a data 2 x context 4 mesh of simulated devices with the zigzag
ring: one step and a 20-step run equal the replicated-parameter run; parameters and AdamW
state are really sharded; parameters that cannot be split evenly stay replicated and are
reported."""

import equinox as eqx
import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from ringsplash import data, partitioning, train
from ringsplash.model import ContextParallel, TransformerConfig
from ringsplash.splash import SplashConfig

SEQ, ROWS, DATA, CONTEXT = 128, 4, 2, 4
BLOCKS = SplashConfig(block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128, backend="xla")
TASK = data.RecallTask(seq_len=SEQ, num_pairs=8, num_queries=8, num_keys=16, num_values=8, num_filler=8)
# float32 throughout; the FSDP and replicated steps sum gradients in different orders
# (reduce-scatter vs all-reduce). Measured max |diff| (S = 128): grads 0, params after a step 0
# (XLA:CPU happens to sum in the same order), losses over the 20 steps 4.8e-7 (2.4e-7 and 4.8e-7
# at S = 512); 1e-6 leaves headroom for reordering, far below the ~1e-3 a wrong (e.g. un-summed or
# double-summed) gradient moves. S = 128 (32 tokens a device) costs what S = 512 does to compile,
# a quarter to run.
ATOL = 1e-6


def _config():
    # sinks [layers, heads=2]: no dimension divisible by 8 devices -> replicated (mixed tree)
    return TransformerConfig(vocab_size=TASK.vocab_size, d_model=16, num_layers=2, num_heads=2, max_seq_len=SEQ,
                             splash=BLOCKS, sinks=True, context_parallel=ContextParallel("ring", ring_size=CONTEXT), remat="save_attention")


def _first_step_grads(opt_state, grad_norm, tc):
    """The gradients of a train step that started from a fresh AdamW state, read back from it:
    the first moment is then ``(1 - b1) * clip(g)`` and ``clip_by_global_norm`` divides by
    ``max(1, |g| / grad_clip)``, with ``|g|`` the step's ``grad_norm``. This saves compiling a
    separate gradient function per run; measured against one (``make_grad_fn``, both layouts):
    max |diff| 3e-8 (float32 rounding of the rescale; the clip was active, |g| = 2.36)."""
    scale = max(1.0, float(grad_norm) / tc.grad_clip) / (1 - tc.b1)
    return jax.tree.map(lambda m: np.asarray(m) * np.float32(scale), optax.tree.get(opt_state, "mu"))


def _runs():
    """{fsdp: (plan, first-step grads and parameters, 20 losses, final state)} for fsdp in (False, True)."""
    config = _config()
    tc = train.TrainConfig(steps=20, batch_size=ROWS, data_parallel=DATA, warmup_steps=2,
                           learning_rate=1e-2, progress=False)
    mesh = train.make_mesh(DATA, CONTEXT)
    optimizer = train.make_optimizer(tc)
    state = train.init_state(config, tc)
    stream = data.DataStream(make=lambda rng, n, step: TASK.batch(rng, n), batch_size=ROWS, seed=1)
    out = {}
    for fsdp in (False, True):
        batches = [train.shard_batch(stream.batch(i), mesh, config) for i in range(tc.steps)]  # the step donates them
        plan = train.sharding_plan(config, mesh, fsdp)
        model, opt_state = train.place_state(state.model, state.opt_state, mesh, plan, optimizer)
        step = train.make_train_step(config, optimizer, mesh, plan=plan)
        losses, first = [], None
        for i, batch in enumerate(batches):
            model, opt_state, metrics = step(model, opt_state, batch, jax.random.key(i))
            losses.append(float(metrics["loss"]))
            if first is None:  # before the next step donates the state
                first = jax.device_get((eqx.filter(model, eqx.is_array), opt_state, metrics["grad_norm"]))
        out[fsdp] = dict(plan=plan, grads=_first_step_grads(*first[1:], tc), first=first[0],
                         losses=np.asarray(losses), final=(model, opt_state))
    return out


def _leaves(tree):
    return jax.tree.leaves(tree)


def _check_fsdp_step_equals_replicated_step(runs):
    rep, fsdp = runs[False], runs[True]
    for g_rep, g_fsdp in zip(_leaves(rep["grads"]), _leaves(fsdp["grads"]), strict=True):
        np.testing.assert_allclose(g_fsdp, g_rep, atol=ATOL, rtol=0)
    for p_rep, p_fsdp in zip(_leaves(rep["first"]), _leaves(fsdp["first"]), strict=True):
        np.testing.assert_allclose(p_fsdp, p_rep, atol=ATOL, rtol=0)
    assert abs(rep["losses"][0] - fsdp["losses"][0]) <= ATOL
    assert np.abs(np.concatenate([np.ravel(g) for g in _leaves(rep["grads"])])).max() > 1e-3  # not trivially zero


def _check_fsdp_run_follows_the_replicated_loss_curve(runs):
    rep, fsdp = runs[False]["losses"], runs[True]["losses"]
    assert rep[-1] < rep[0] - 0.3, rep  # it trains
    np.testing.assert_allclose(fsdp, rep, atol=2e-6, rtol=0)  # 20 AdamW steps: measured 4.8e-7; ~4x headroom


def _check_fsdp_shards_params_and_optimizer_state(runs):
    model, opt_state = runs[True]["final"]
    n = DATA * CONTEXT
    params = eqx.filter(model, eqx.is_array)
    wq = model.layers.attention.wq  # [layers, d_model, heads x d] = [2, 16, 16]: split on a non-layer axis
    assert wq.shape == (2, 16, 16) and wq.addressable_shards[0].data.shape == (2, 2, 16)
    assert model.embedding.addressable_shards[0].data.shape == (TASK.vocab_size, 16 // n)
    for leaf in _leaves(params):
        local = leaf.addressable_shards[0].data.size
        if leaf is model.layers.attention.sinks:  # [2, 2]: replicated, reported
            assert local == leaf.size
        else:
            assert local * n == leaf.size, (leaf.shape, leaf.sharding)
    sinks_shape = model.layers.attention.sinks.shape
    moments = [x for x in _leaves(opt_state) if x.size > 1 and x.shape != sinks_shape]  # AdamW mu, nu
    assert len(moments) == 2 * (len(_leaves(params)) - 1)
    for m in moments:
        assert m.addressable_shards[0].data.size * n == m.size, (m.shape, m.sharding)
    # replicated run: full copies everywhere
    rep_model, _ = runs[False]["final"]
    assert rep_model.layers.attention.wq.addressable_shards[0].data.shape == (2, 16, 16)


def test_fsdp_plan_reports_parameters_it_cannot_split():
    plan = train.sharding_plan(_config(), train.make_mesh(DATA, CONTEXT), fsdp=True)
    assert plan.sharded and plan.num_shards == 8
    assert plan.replicated == ("layers.attention.sinks (2, 2)",)
    assert "replicated (no dimension divisible by 8): layers.attention.sinks (2, 2)" in partitioning.describe(plan)
    # an uneven width: d_model 12 and vocab 33 split over 8 nowhere -> the embedding is replicated
    config = _config().replace(d_model=12, num_heads=2, head_dim=8, sinks=False)
    plan = train.sharding_plan(config, train.make_mesh(DATA, CONTEXT), fsdp=True)
    assert plan.specs.embedding == P() and f"embedding ({TASK.vocab_size}, 12)" in plan.replicated
    assert "layers.attention_norm.weight (2, 12)" in plan.replicated and plan.specs.unembedding == P()
    assert plan.specs.layers.attention.wq == P(None, None, ("data", "context"))  # [2, 12, 2 heads x 8]
    assert plan.specs.layers.mlp.w_gate == P(None, None, ("data", "context"))  # [2, 12, 32]
    assert train.sharding_plan(config, train.make_mesh(DATA, CONTEXT), fsdp=False).specs.layers.mlp.w_gate == P()


def test_fsdp_dim_never_splits_the_stacked_axis():
    assert partitioning.fsdp_dim((8, 3, 5), 8, skip_leading=1) is None
    assert partitioning.fsdp_dim((8, 3, 5), 8) == 0
    assert partitioning.fsdp_dim((4, 16, 32), 8, skip_leading=1) == 2
    assert partitioning.fsdp_dim((16, 16), 8) == 0  # ties: the first


def _shard_map_inputs(fn, model, batch) -> list:
    """The per-device shapes of the parameter inputs of the ``shard_map`` inside ``fn(model, batch)``."""
    params, static = eqx.partition(model, eqx.is_array)
    jaxpr = jax.make_jaxpr(lambda p, b: fn(eqx.combine(p, static), b))(params, batch).jaxpr

    def shard_maps(j):
        for eqn in j.eqns:
            if eqn.primitive.name == "shard_map":
                yield eqn
            for v in eqn.params.values():
                sub = getattr(v, "jaxpr", v)
                if hasattr(sub, "eqns"):
                    yield from shard_maps(sub)

    [eqn] = list(shard_maps(jaxpr))
    # inputs: hoisted constants (mask info), the parameters, the batch, the ring's per-device schedule
    schedule = train.batch_ring_schedule(model.config, batch.tokens.sharding.mesh, batch)
    tail = len(train.Batch._fields) + len(jax.tree.leaves(schedule))
    return [v.aval.shape for v in eqn.params["jaxpr"].invars[-(len(_leaves(params)) + tail):-tail]]


def _check_eval_and_logits_run_on_the_sharded_parameters(runs):
    """Held-out evaluation and logits take the FSDP layout as training does: each device
    receives its parameter shards (never a replicated copy of the model), with the values of
    the replicated evaluation."""
    model, _ = runs[True]["final"]
    plan = runs[True]["plan"]
    config, mesh = _config(), train.make_mesh(DATA, CONTEXT)
    stream = data.DataStream(make=lambda rng, n, step: TASK.batch(rng, n), batch_size=ROWS, seed=7)
    batch = train.stream_batch(stream, 0, mesh, config)
    sharded_eval = train.make_eval_step(config, mesh, plan=plan)
    replicated_eval = train.make_eval_step(config, mesh)
    sharded_logits = train.make_logits_fn(config, mesh, plan=plan)
    params = eqx.filter(model, eqx.is_array)
    local = partitioning.local_bytes(params, plan.specs, dict(mesh.shape)) // 4  # float32 elements per device
    assert local * 4 < sum(x.size for x in _leaves(params))  # sharded: far below the whole model
    for fn in (sharded_eval, sharded_logits):
        assert sum(int(np.prod(s)) for s in _shard_map_inputs(fn, model, batch)) == local
    assert sum(int(np.prod(s)) for s in _shard_map_inputs(replicated_eval, model, batch)) == model.num_params()
    got, want = sharded_eval(model, batch), replicated_eval(model, batch)
    # measured: identical (the gathered weights are the replicated ones; same per-device compute)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(float(g), float(w), rtol=1e-6, atol=0)
    assert float(want[1]) > 0 and 0 < float(want[2]) < float(want[1])  # scored tokens, some (not all) correct
    logits = np.asarray(sharded_logits(model, batch))
    np.testing.assert_allclose(logits, np.asarray(train.make_logits_fn(config, mesh)(model, batch)), atol=1e-6, rtol=0)


@pytest.mark.slow
def test_fsdp_training_equals_replicated_training():
    """One replicated and one FSDP run feed every check (one test rather than a module fixture
    shared by four, so that a parallel run cannot repeat both trainings on two workers)."""
    runs = _runs()
    _check_fsdp_step_equals_replicated_step(runs)
    _check_fsdp_run_follows_the_replicated_loss_curve(runs)
    _check_fsdp_shards_params_and_optimizer_state(runs)
    _check_eval_and_logits_run_on_the_sharded_parameters(runs)


@pytest.mark.slow
def test_sharded_init_equals_the_unsharded_init_and_is_born_sharded():
    """``init_sharded_state`` (what ``fit`` starts from) creates each parameter and AdamW moment
    directly in the plan's shardings, with ``init_state``'s values bit for bit."""
    config, mesh = _config(), train.make_mesh(DATA, CONTEXT)
    tc = train.TrainConfig(steps=20, batch_size=ROWS, data_parallel=DATA, warmup_steps=2)
    plan = train.sharding_plan(config, mesh, True)
    want = train.init_state(config, tc, data_seed=3)
    got = train.init_sharded_state(config, tc, mesh, plan, data_seed=3)
    assert int(got.step) == 0 and int(got.data_seed) == 3
    target = train.abstract_state(config, tc, mesh, plan)
    for g, w, t in zip(_leaves((got.model, got.opt_state)), _leaves((want.model, want.opt_state)),
                       _leaves((target.model, target.opt_state)), strict=True):
        assert g.sharding.is_equivalent_to(t.sharding, g.ndim), (g.shape, g.sharding, t.sharding)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert got.model.layers.attention.wq.addressable_shards[0].data.shape == (2, 2, 16)


@pytest.mark.slow
def test_sharded_init_of_an_8b_model_never_holds_the_whole_model_on_a_device():
    """Compiled (not run) for 8 simulated devices, a fresh FSDP init of Llama-3-8B: each device's
    outputs are its 1/8 of the parameters + AdamW moments, and its temporaries stay far below the
    whole model (measured 5.3 GiB of scratch against 29.9 GiB of float32 parameters: the random
    bits of its own shards), so no device, and no host, materialises the whole model."""
    from ringsplash.model.presets import preset

    config = preset("llama3-8b", max_seq_len=8192)
    mesh = train.make_mesh(DATA * CONTEXT, 1)
    tc = train.TrainConfig(steps=100)
    plan = train.sharding_plan(config, mesh, True)
    compiled = train.sharded_init_fn(config, tc, mesh, plan).lower(jax.random.key(0)).compile()
    memory = compiled.memory_analysis()
    params = train.abstract_state(config, tc, mesh, plan).model
    whole = sum(x.size * x.dtype.itemsize for x in _leaves(params))
    local = partitioning.local_bytes(eqx.filter(params, lambda x: isinstance(x, jax.ShapeDtypeStruct)), plan.specs,
                                     dict(mesh.shape))
    assert local < whole / 7  # every large leaf split 8 ways
    # parameters + AdamW mu + nu, each device's shards only (+ the optimiser's scalars: 312 bytes measured)
    assert 3 * local <= memory.output_size_in_bytes <= 3 * local + 1024, (memory.output_size_in_bytes, local)
    assert memory.temp_size_in_bytes < whole / 4, (memory.temp_size_in_bytes, whole)
