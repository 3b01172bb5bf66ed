"""Host work bound to objects: the Splash and ring factories, the one bounded cache behind the
functional entry points, ``rs.clear_caches()`` and the typed result (``AttentionOutput``)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ringsplash as rs
from ringsplash import masks
from ringsplash._internal import caches as _caches
from ringsplash.splash import factory

XLA = rs.SplashConfig(backend="xla")


def _qkv(s=256, heads=2):
    keys = jax.random.split(jax.random.key(0), 3)
    return tuple(jax.random.normal(k, (heads, s, 64), jnp.float32) for k in keys)


def test_splash_factory_does_its_host_work_once(monkeypatch):
    built = []
    real = factory.build_mask_info
    monkeypatch.setattr(factory, "build_mask_info", lambda *a, **kw: built.append(a) or real(*a, **kw))
    rs.clear_caches()
    attn = rs.make_splash_attention(masks.CausalMask((256, 256)), config=XLA)
    assert len(built) == 1  # the xla backend has no dK/dV view
    q, k, v = _qkv()
    first, second = attn(q, k, v), attn(q * 2, k, v)
    assert len(built) == 1 and first.shape == second.shape == q.shape


def test_functional_splash_equals_the_factory_and_is_cached():
    rs.clear_caches()
    mask = masks.LocalMask((256, 256), window=(64, 0))
    q, k, v = _qkv()
    attn = rs.make_splash_attention(mask, config=XLA, head_dim=64, dtype=jnp.float32)
    got = rs.splash_attention(q, k, v, mask, config=XLA, with_lse=True, with_max_logits=True)
    want = attn(q, k, v, with_lse=True, with_max_logits=True)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert len(_caches.factories) == 1
    rs.splash_attention(q, k, v, mask, config=XLA)
    assert len(_caches.factories) == 1  # the same object served the second call


def test_factory_cache_evicts_and_clear_caches_empties_it(monkeypatch):
    rs.clear_caches()
    monkeypatch.setattr(_caches.factories, "maxsize", 2)
    q, k, v = _qkv()
    for w in (16, 32, 48):
        rs.splash_attention(q, k, v, masks.LocalMask((256, 256), window=(w, 0)), config=XLA)
    assert len(_caches.factories) == 2
    rs.clear_caches()
    assert len(_caches.factories) == 0


def test_attention_output_fields():
    q, k, v = _qkv()
    mask = masks.CausalMask((256, 256))
    out = rs.splash_attention(q, k, v, mask, config=XLA)
    r = rs.splash_attention(q, k, v, mask, config=XLA, with_max_logits=True)
    assert isinstance(r, rs.AttentionOutput) and r.lse is None and r.max_logits.shape == (2,)
    np.testing.assert_array_equal(np.asarray(r.out), np.asarray(out))
    r = rs.reference_attention(q, k, v, mask, with_lse=True)
    assert r._fields == ("out", "lse", "max_logits") and r.lse.shape == (2, 256) and r.max_logits is None


def test_deprecated_tuple_forms_warn_and_keep_their_shapes():
    q, k, v = _qkv()
    mask = masks.CausalMask((256, 256))
    with pytest.warns(DeprecationWarning, match="return_residuals=True is deprecated|return_residuals=True\\) is"):
        out, lse = rs.splash_attention(q, k, v, mask, config=XLA, return_residuals=True)
    with pytest.warns(DeprecationWarning, match="return_max_logits"):
        out2, mx = rs.reference_attention(q, k, v, mask, return_max_logits=True)
    assert lse.shape == (2, 256) and mx.shape == (2,) and out2.shape == out.shape
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rs.splash_attention(q, k, v, mask, config=XLA, with_lse=True)  # the new flags do not warn


def test_bad_factory_and_flag_inputs_name_the_argument():
    """(Under the shape-checked test run the annotations refuse wrong types first, naming the
    parameter; the library's own checks say what was expected and what was given.)"""
    with pytest.raises(TypeError, match="mask"):
        rs.make_splash_attention("causal")
    with pytest.raises(TypeError, match="config"):
        rs.make_splash_attention(masks.CausalMask((256, 256)), config={})
    with pytest.raises(TypeError, match="dtype must be a floating dtype"):
        rs.make_splash_attention(masks.CausalMask((256, 256)), dtype=jnp.int32)
    with pytest.raises(ValueError, match="num_shards"):
        rs.make_ring_attention(masks.CausalMask((256, 256)), num_shards=0)
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="with_lse"):
        rs.splash_attention(q, k, v, config=XLA, with_lse="yes")
    with pytest.raises(ValueError, match="not both"):
        rs.splash_attention(q, k, v, config=XLA, with_lse=True, return_max_logits=True)


@pytest.mark.slow
def test_ring_factory_holds_its_plan_and_equals_the_functional_ring(monkeypatch):
    from ringsplash.parallel import ring_plan as plan_lib

    rs.clear_caches()
    n, s = 2, 512
    mask = masks.CausalMask((s, s))
    cfg = rs.SplashConfig(block_q=128, block_kv=128, backend="xla")
    attn = rs.make_ring_attention(mask, num_shards=n, layout="zigzag", config=cfg)
    plans = []
    real = plan_lib._ring_plan
    monkeypatch.setattr(plan_lib, "_ring_plan", lambda *a: plans.append(a) or real(*a))
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:n]), ("ctx",))
    q, k, v = _qkv(s)
    spec = jax.sharding.PartitionSpec(None, "ctx")
    run = lambda fn: jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)(q, k, v)
    got = run(lambda q, k, v: attn(q, k, v, axis_name="ctx"))
    again = run(lambda q, k, v: attn(q * 1.0, k, v, axis_name="ctx"))
    want = run(lambda q, k, v: rs.ring_attention(q, k, v, mask, axis_name="ctx", layout="zigzag", config=cfg))
    assert plans == []  # the plan was built by make_ring_attention only
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=0)
    np.testing.assert_allclose(np.asarray(again), np.asarray(got), rtol=0, atol=0)
