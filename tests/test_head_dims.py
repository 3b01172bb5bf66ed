"""Head sizes other than 128, and a v head size of its own (MLA: q/k 192, v 128), on every
backend and strategy, forward and gradients, with GQA, against the dense float32 reference.

The sizes are in ``head_dims.py`` (shared with the TPU compile tests). Cheap breadth on the
xla backend (every size: single device, ring); the Pallas interpreter on the sizes of
``INTERPRET_HEAD_DIMS`` (single device) and MLA (ring); all-gather, Ulysses and USP on one each.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ringsplash as rs
from ringsplash import layouts, masks
from ringsplash.model import Attention, ContextParallel, TransformerConfig
from ringsplash.splash.config import SplashConfig
from support.attention_inputs import inputs, max_err
from support.head_dims import HEAD_DIMS, INTERPRET_HEAD_DIMS, head_dim_params
from support.strategies import INTERPRET, XLA, strategy

# the generic Pallas interpreter (plain JAX ops, no TPU memory model; same numerics, much cheaper):
# the TPU interpreter keeps the d = 96 case (a lane size that is not a multiple of 128, where its
# memory model matters); MLA runs the same kernels on the generic one
GENERIC = SplashConfig(block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128, backend="interpret",
                       interpret_params="generic")

# float32 max abs error vs the reference, measured over this file: out <= 5.4e-7, dq / dk / dv
# <= 5.7e-6 (dv of d = 192, splash xla); ~9x headroom, under the 1e-4 bound
TOL = {"out": 5e-6, "dq": 5e-5, "dk": 5e-5, "dv": 5e-5}
HEADS, KV_HEADS = 4, 2  # GQA


def reference_and(fn, key, dims, s, mask, *, heads=HEADS, kv_heads=KV_HEADS, cap=None):
    """``(out, dq, dk, dv)`` of ``fn(q, k, v, segment_ids)`` and of the reference (VJP of a random
    cotangent), float32, GQA, v of head size ``dims.dv``, two packed segments."""
    q, k, v, d_out, _ = inputs(key, heads, kv_heads, s, s, d=dims.d, dv=dims.dv)
    ids = rs.SegmentIds(*(2 * [(jnp.arange(s, dtype=jnp.int32) >= s // 2 + 37).astype(jnp.int32)]))

    def run(f):
        out, vjp = jax.vjp(f, q, k, v)
        return (out, *vjp(d_out))

    ref = lambda q, k, v: rs.reference_attention(q, k, v, mask, segment_ids=ids, logit_soft_cap=cap)
    return jax.jit(run, static_argnums=0)(lambda q, k, v: fn(q, k, v, ids)), jax.jit(run, static_argnums=0)(ref)


def assert_close(got, want, dims):
    errs = {}
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        assert not np.any(np.isnan(np.asarray(a))), f"{name} has NaN"
        errs[name] = max_err(a, b)
    assert got[0].shape[-1] == dims.dv and got[1].shape[-1] == dims.d and got[3].shape[-1] == dims.dv
    print(dims, "max abs errors:", {k: f"{e:.2e}" for k, e in errs.items()})
    bad = {k: e for k, e in errs.items() if e > TOL[k]}
    assert not bad, f"max abs error above {TOL}: {bad}"


# ----------------------------------------------------------------------------------------
# single device


def splash(config, mask, cap=None):
    return lambda q, k, v, ids: rs.splash_attention(q, k, v, mask, segment_ids=ids, logit_soft_cap=cap,
                                                    config=config)


@pytest.mark.slow
@pytest.mark.parametrize("dims", head_dim_params())
def test_splash_xla_head_dims_match_reference(key, dims):
    s = 256
    mask = masks.LocalMask((s, s), window=(100, 0))  # full, partial and empty blocks
    got, want = reference_and(splash(XLA, mask, cap=20.0), key, dims, s, mask, cap=20.0)
    assert_close(got, want, dims)


@pytest.mark.slow
@pytest.mark.parametrize("dims", head_dim_params(INTERPRET_HEAD_DIMS))
def test_splash_interpret_head_dims_match_reference(key, dims):
    s = 256
    mask = masks.CausalMask((s, s))
    config = INTERPRET if dims == HEAD_DIMS["d96"] else GENERIC
    got, want = reference_and(splash(config, mask), key, dims, s, mask, heads=2, kv_heads=1)
    assert_close(got, want, dims)


# ----------------------------------------------------------------------------------------
# context parallelism: V (and dV) travel with their own head size


def parallel(name, n, layout, config, mask, degrees=None):
    """``fn(q, k, v, ids)`` in original token order around the strategy's sharded entry point."""
    fn, shards = strategy(name, n, layout, config, degrees)
    lay = lambda x: layouts.permute(x, layout, shards, axis=x.ndim - 1 if x.ndim == 1 else 1)
    unlay = lambda x: layouts.unpermute(x, layout, shards, axis=1)

    def run(q, k, v, ids):
        ids = None if ids is None else rs.SegmentIds(q=lay(ids.q), kv=lay(ids.kv))
        return unlay(fn(lay(q), lay(k), lay(v), ids, None, mask, None))

    return run


@pytest.mark.slow
@pytest.mark.parametrize("dims", head_dim_params())
def test_ring_xla_head_dims_match_reference(key, dims):
    s, n = 256, 2
    mask = masks.CausalMask((s, s))
    got, want = reference_and(parallel("ring", n, "zigzag", XLA, mask), key, dims, s, mask)
    assert_close(got, want, dims)


@pytest.mark.slow
def test_ring_interpret_mla_head_dims_match_reference(key):
    # striped causal: every shard pair is active, so every device runs every step's kernels (zigzag would
    # need S = 512 for its 64-token half-shards to tile); the generic interpreter (the TPU interpreter's
    # barriers around the ring are covered by test_ring.py)
    s, n, dims = 256, 2, HEAD_DIMS["mla_d192_dv128"]
    mask = masks.CausalMask((s, s))
    got, want = reference_and(parallel("ring", n, "striped", GENERIC, mask), key, dims, s, mask, heads=2,
                              kv_heads=1)
    assert_close(got, want, dims)


@pytest.mark.slow
@pytest.mark.parametrize("name, n, degrees, dims", [
    ("allgather", 2, None, HEAD_DIMS["mla_d192_dv128"]),  # q shards of one 128-block
    ("ulysses", 4, None, HEAD_DIMS["d64_dv128"]),
    ("usp", 4, (2, 2), HEAD_DIMS["mla_d192_dv128"]),
], ids=["allgather", "ulysses", "usp"])
def test_strategy_head_dims_match_reference(key, name, n, degrees, dims):
    s = 256
    mask = masks.CausalMask((s, s))
    got, want = reference_and(parallel(name, n, "zigzag", XLA, mask, degrees), key, dims, s, mask)
    assert_close(got, want, dims)


# ----------------------------------------------------------------------------------------
# the model: TransformerConfig(v_head_dim=...)


@pytest.mark.slow
def test_model_attention_v_head_dim_splash_matches_reference(key):
    """The attention module with v / output head size 20 != q / k head size 12: parameter
    shapes, and the splash strategy's output and parameter gradients equal the reference's."""
    seq = 256
    splash_config = SplashConfig(block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128, backend="xla")
    ref_config = TransformerConfig(vocab_size=8, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=12,
                                   v_head_dim=20, max_seq_len=seq, sinks=True, splash=splash_config,
                                   context_parallel=ContextParallel("reference"))  # the dense oracle
    attn = Attention(ref_config, key=key)
    assert attn.wv.shape == (32, 2 * 20) and attn.wo.shape == (4 * 20, 32)
    x = jax.random.normal(jax.random.fold_in(key, 1), (seq, 32), jnp.float32)
    positions = jnp.arange(seq, dtype=jnp.int32)
    segment_ids = (positions >= 100).astype(jnp.int32)

    @jax.jit
    def out_and_grads(attn):
        loss = lambda a: jnp.sum(jnp.sin(a(x, positions, segment_ids)))
        return attn(x, positions, segment_ids), eqx.filter_grad(loss)(attn)

    splash = Attention(ref_config.replace(context_parallel=ref_config.context_parallel.replace(strategy="splash")), key=key)  # the same parameters
    (want, want_g), (got, got_g) = out_and_grads(attn), out_and_grads(splash)
    rel = lambda a, b: max_err(a, b) / float(jnp.max(jnp.abs(b)))  # gradients reach ~40
    errs = {n: rel(getattr(got_g, n), getattr(want_g, n)) for n in ("wq", "wk", "wv", "wo", "sinks")}
    print("out", max_err(got, want), "relative grads", errs)
    # measured 3.0e-7 (out, absolute; |out| ~ 1) and <= 5.9e-7 (relative grads); 10x headroom
    assert max_err(got, want) <= 3e-6
    assert all(e <= 6e-6 for e in errs.values()), errs
