"""The model under every context-parallel strategy: all-gather, Ulysses and USP give the reference's logits and gradients on 4 and 8 simulated devices, through the trainer's own
mesh (``train.mesh_for``), batch layout and sharded gradient function; bad strategy configs and
meshes that do not match them are rejected with the numbers and a valid alternative.
"""

import dataclasses

import equinox as eqx
import jax
import numpy as np
import pytest

from ringsplash import data, layouts, masks, train
from ringsplash.model import ContextParallel, Transformer, TransformerConfig
from ringsplash.splash import SplashConfig
from support.errors import assert_refused

BLOCKS = SplashConfig(block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128, backend="xla")
# the shortest sequence every case below accepts: all-gather on 8 devices runs the kernels on its S / 8 = 64
# queries as one block (backend='xla' takes a short part whole); the Pallas case's zigzag half-shards are
# S / 4 = 128 tokens, one block each. Compiling, not S, is most of each case's time; S = 1024 ran ~10% longer
S = 512
# measured (float32, CPU) over every case below: max |d logits| <= 1.2e-6, max |d grad| / max |grad| per
# leaf <= 1.5e-6; ~10x headroom
LOGITS_ATOL, GRAD_RTOL = 1e-5, 1.5e-5


def _config(**kw):
    base = dict(vocab_size=32, d_model=32, num_layers=1, num_heads=8, num_kv_heads=2, max_seq_len=S, splash=BLOCKS,
                sinks=True, logit_soft_cap=20.0)
    return TransformerConfig(**{**base, **kw})


def _batch():
    """One row of two packed documents (segment ids, positions restarting), every token scored."""
    rng = np.random.default_rng(0)
    cut = S // 3
    tokens = rng.integers(0, 32, (1, S), dtype=np.int32)
    docs = [tokens[0, :cut], tokens[0, cut:]]
    return data.pack_documents(docs, S, 1)


def _run(config, model, batch):
    """(logits in original order, grads) through the trainer's mesh for ``config``."""
    mesh = train.mesh_for(config)
    sharded = train.shard_batch(batch, mesh, config)
    params, static = eqx.partition(model, eqx.is_array)
    params = train.replicate(params, mesh)
    logits_fn, grad_fn = train.make_logits_fn(config, mesh), train.make_grad_fn(config, mesh)
    schedule = train.batch_ring_schedule(config, mesh, sharded)  # ring / USP: per-device rows, a jit argument
    # two programs: one holding both rings (the logits' and the gradient's, independent of each other)
    # can hang on XLA:CPU or return garbage gradients (its collectives ran in different orders on
    # different devices: seen 2 suite runs in 3 in test_model_masks); each alone ran 60 times the same
    logits = np.asarray(logits_fn(eqx.combine(params, static), sharded))  # jitted, built once per config and mesh
    grads, _ = jax.jit(lambda p, b, sc: grad_fn(p, static, b, None, sc))(params, sharded, schedule)
    if config.context_shards > 1:
        logits = layouts.unpermute(logits, config.context_parallel.layout, config.layout_shards, axis=1)
    return logits, jax.device_get(grads)


@pytest.fixture(scope="module")
def reference():
    config = _config(context_parallel=ContextParallel("reference"))  # the dense oracle
    model = Transformer(config, key=jax.random.key(0))
    batch = _batch()
    return model, batch, _run(config, model, batch)


# One model-level case per strategy wiring (mesh, batch layout, sharded grads); the degrees and layouts
# a strategy supports are swept at the attention level in test_parallel.py (all-gather: every mask x
# every layout at N = 4; Ulysses at N = 4; USP at both (2, 4) and (4, 2) with kv heads repeated and
# split), so the former all-gather N = 4, Ulysses N = 4, USP 2 x 2 (xla) and USP 2 x 4 model cases
# were merged into the cases below, which between them keep every model-level path: N = 4 and 8,
# kv heads repeated (Ulysses 8, USP 4 x 2) and split (USP 2 x 2: 1 kv head per rank), the zigzag,
# striped and contiguous layouts, the xla backend and the Pallas kernels.
CASES = {
    # 8 devices: Ulysses repeats each of the 2 kv heads 4 times; USP repeats them twice
    "allgather-8-striped": dict(context_parallel=ContextParallel("allgather", ring_size=8, layout="striped")),
    "ulysses-8": dict(context_parallel=ContextParallel("ulysses", ulysses_size=8)),
    "usp-4x2-contiguous": dict(context_parallel=ContextParallel("usp", ring_size=2, ulysses_size=4, layout="contiguous")),
    # 4 devices, zigzag, the Pallas kernels (generic interpreter): the inner ring's per-device schedule
    # carries the dK/dV view too; Ulysses 2 splits the 2 kv heads (1 per rank)
    "usp-2x2-interpret": dict(context_parallel=ContextParallel("usp", ring_size=2, ulysses_size=2), splash=dataclasses.replace(BLOCKS, backend="interpret", interpret_params="generic")),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_model_strategy_matches_reference(reference, case):
    model, batch, (ref_logits, ref_grads) = reference
    config = model.config.replace(**CASES[case])
    assert config.context_shards in (4, 8)
    logits, grads = _run(config, model.with_config(config), batch)
    err = float(np.max(np.abs(logits - ref_logits)))
    grad_errs = [float(np.max(np.abs(np.asarray(g) - np.asarray(r))) / np.max(np.abs(np.asarray(r))))
                 for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True)]
    print(f"{case}: max |d logits| = {err:.2e}, max relative grad error = {max(grad_errs):.2e}")
    assert err <= LOGITS_ATOL
    assert max(grad_errs) <= GRAD_RTOL


# ----------------------------------------------------------------------------------------
# bad input

CP = ContextParallel
REJECTED = [
    # Ulysses degree the heads do not allow: the numbers and the degrees that work
    (dict(context_parallel=CP("ulysses", ulysses_size=16)),
     ["num_heads=8 is not divisible by ulysses_size=16", "use ContextParallel.ulysses_size in [1, 2, 4, 8]"]),
    (dict(context_parallel=CP("ulysses", ulysses_size=4), num_heads=12, num_kv_heads=3, d_model=48),
     ["num_kv_heads=3 neither divides nor is divisible by ulysses_size=4", "ulysses_size in [1, 3, 6, 12]"]),
    # USP: a bad inner degree names the factorisations of N that work
    (dict(context_parallel=CP("usp", ring_size=2, ulysses_size=16), max_seq_len=4096),
     ["ulysses_size=16", "factorisations of the 32 devices that work: [(1, 32), (2, 16), (4, 8), (8, 4)]"]),
    # a length the strategy cannot tile is padded by the trainer (tests/test_context_parallel_lengths.py), except
    # under a fixed-shape Mask (its own length only). All-gather: blocks must tile each device's queries
    (dict(context_parallel=CP("allgather", ring_size=4), max_seq_len=1000, mask=masks.CausalMask((1000, 1000))),
     ["strategy='allgather' at max_seq_len=1000: SplashConfig.block_q=128 cannot tile the 250-token per-device "
      "q_len", "SplashConfig(block_q=256", "divisible by 512"]),
    (dict(context_parallel=CP("usp", ring_size=4, ulysses_size=2), max_seq_len=1020,
          mask=masks.CausalMask((1020, 1020))),
     ["max_seq_len=1020 must be divisible by ring_size x ulysses_size = 4 x 2 = 8"]),
    (dict(context_parallel=CP("ulysses", ulysses_size=4), attention_dropout=0.1),
     ["not supported by the splash/ring kernels"]),
]


@pytest.mark.parametrize("changes, fragments", REJECTED, ids=[str(c) for c, _ in REJECTED])
def test_strategy_config_rejects_with_message(changes, fragments):
    assert_refused(ValueError, lambda: _config(**changes), fragments)


# the axes and sizes: ContextParallel's own checks
CP_REJECTED = [
    (dict(strategy="usp", ring_size=2, ulysses_axis="context", ulysses_size=2),
     ["two different mesh axes", "both 'context'"]),
    (dict(strategy="ulysses", ulysses_size=4, ring_size=2),
     ["ContextParallel.ring_size=2 needs strategy in ('ring', 'allgather', 'usp')", "got strategy='ulysses'"]),
    (dict(strategy="ring", ring_size=4, ulysses_size=2),
     ["ContextParallel.ulysses_size=2 needs strategy in ('ulysses', 'usp')", "ulysses_size=1"]),
]


@pytest.mark.parametrize("kwargs, fragments", CP_REJECTED, ids=[str(c) for c, _ in CP_REJECTED])
def test_context_parallel_rejects_with_message(kwargs, fragments):
    assert_refused(ValueError, lambda: ContextParallel(**kwargs), fragments)


def test_trainer_mesh_must_match_the_strategy():
    usp = _config(context_parallel=CP("usp", ring_size=2, ulysses_size=4))
    # a mesh missing the Ulysses axis
    with pytest.raises(ValueError, match=r"needs a 'ulysses' mesh axis of 4 devices.*mesh_for"):
        train.check_mesh(usp, train.make_mesh(1, 2))
    # a 2-D factorisation that does not match the mesh (4 x 2 config, 2 x 4 mesh)
    with pytest.raises(ValueError, match=r"'context' axis has 2 devices but the mesh's has 4"):
        train.check_mesh(usp, train.make_mesh(1, 4, ulysses=2))
    # a Ulysses axis under a strategy that does not use it, and Ulysses off the trainer's axis
    ring = _config(context_parallel=CP("ring", ring_size=4))
    with pytest.raises(ValueError, match=r"mesh's 'ulysses' axis has 2 devices, but strategy='ring' does not"):
        train.check_mesh(ring, train.make_mesh(1, 4, ulysses=2))
    with pytest.raises(ValueError, match=r"the trainer runs context_parallel over the mesh axes \('context',\)"):
        train.check_mesh(_config(context_parallel=CP("ulysses", ulysses_axis="sp", ulysses_size=4)),
                         train.make_mesh(1, 4))
    with pytest.raises(ValueError, match=r"mesh's 'context' axis has 4 devices, but strategy='splash' does not"):
        train.check_mesh(_config(context_parallel=CP("splash")), train.make_mesh(1, 4))
    # the mesh the trainer builds for each strategy passes
    for config in (usp, ring, _config(context_parallel=CP("ulysses", ulysses_size=8))):
        mesh = train.mesh_for(config)
        train.check_mesh(config, mesh)
        assert mesh.size == config.context_parallel.shards


def test_usp_fsdp_shards_over_every_mesh_axis():
    """FSDP on the USP mesh shards parameters over data x context x ulysses together."""
    usp = _config(context_parallel=ContextParallel("usp", ring_size=2, ulysses_size=2))
    plan = train.sharding_plan(usp, train.mesh_for(usp, data=2), fsdp=True)
    assert plan.axes == ("data", "context", "ulysses") and plan.num_shards == 8
    assert plan.specs.layers.mlp.w_gate[2] == ("data", "context", "ulysses")
