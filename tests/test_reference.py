"""reference_attention against an independent float64 numpy implementation; gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import ringsplash as rs
from ringsplash import masks

# ----------------------------------------------------------------------------------------
# independent float64 oracle: explicit loops over heads and rows


def numpy_attention(q, k, v, allowed=None, *, scale=None, soft_cap=None, sinks=None, seg_q=None, seg_kv=None):
    """float64 attention, row by row. ``allowed``: bool [heads or 1, q_len, kv_len] or None."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    heads, q_len, d = q.shape
    kv_heads, kv_len, _ = k.shape
    group = heads // kv_heads
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    out = np.zeros((heads, q_len, d))
    lse = np.zeros((heads, q_len))
    for h in range(heads):
        kh = h // group  # heads [kh*group, (kh+1)*group) share kv head kh
        for i in range(q_len):
            ok = np.ones(kv_len, bool)
            if allowed is not None:
                ok &= allowed[h if allowed.shape[0] > 1 else 0, i]
            if seg_q is not None:
                ok &= np.asarray(seg_kv) == np.asarray(seg_q)[i]
            logits = (k[kh][ok] @ q[h, i]) * scale
            if soft_cap is not None:
                logits = soft_cap * np.tanh(logits / soft_cap)
            terms = list(logits) + ([float(sinks[h])] if sinks is not None else [])
            if not terms:
                out[h, i] = 0.0
                lse[h, i] = rs.MASKED_LSE
                continue
            mx = max(terms)
            w = np.exp(logits - mx)
            denom = w.sum() + (np.exp(float(sinks[h]) - mx) if sinks is not None else 0.0)
            out[h, i] = (w @ v[kh][ok]) / denom
            lse[h, i] = mx + np.log(denom)
    return out, lse


def attend(q, k, v, mask=None, **kw):
    """reference_attention under one jit (eager dispatch compiles every primitive: slow on CPU)."""
    return jax.jit(lambda q, k, v: rs.reference_attention(q, k, v, mask, **kw))(q, k, v)


def rng_from(key) -> np.random.Generator:
    # numpy draws seeded by the test's key: eager jax.random compiles per shape (seconds on CPU)
    return np.random.default_rng(np.asarray(jax.random.key_data(key)).tolist())


def make_qkv(key, heads, kv_heads, q_len, kv_len, d, dtype=jnp.float32):
    rng = rng_from(key)
    q = jnp.asarray(rng.standard_normal((heads, q_len, d)), dtype)
    k = jnp.asarray(rng.standard_normal((kv_heads, kv_len, d)), dtype)
    v = jnp.asarray(rng.standard_normal((kv_heads, kv_len, d)), dtype)
    return q, k, v


def assert_matches(got_out, got_lse, want_out, want_lse):
    assert got_lse.dtype == jnp.float32
    assert np.all(np.isfinite(np.asarray(got_out))) and np.all(np.isfinite(np.asarray(got_lse)))
    np.testing.assert_allclose(np.asarray(got_out, np.float64), want_out, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(got_lse, np.float64), want_lse, atol=2e-5, rtol=2e-5)


CASES = {
    # name: (heads, kv_heads, q_len, kv_len, d, mask factory or None)
    "mha_nomask": (4, 4, 16, 16, 8, None),
    "gqa_8_2_causal": (8, 2, 24, 24, 16, lambda s: masks.CausalMask(s)),
    "mqa_local": (4, 1, 32, 32, 8, lambda s: masks.LocalMask(s, window=(5, 0))),
    "rect_q_lt_kv": (2, 2, 12, 40, 8, lambda s: masks.CausalMask(s, offset=28)),
    "rect_q_gt_kv": (2, 1, 40, 12, 8, lambda s: masks.PrefixLMMask(s, 4) | masks.LocalMask(s, (None, 0))),
    "chunked_and": (4, 2, 32, 32, 8, lambda s: masks.ChunkedCausalMask(s, 8) & masks.LocalMask(s, (6, 0))),
    "multihead": (
        3, 1, 16, 20, 8,
        lambda s: masks.MultiHeadMask([masks.CausalMask(s, offset=4), masks.FullMask(s), masks.LocalMask(s, (2, 2))]),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_numpy(key, name):
    heads, kv_heads, q_len, kv_len, d, factory = CASES[name]
    q, k, v = make_qkv(key, heads, kv_heads, q_len, kv_len, d)
    mask = factory((q_len, kv_len)) if factory else None
    allowed = masks.dense(mask) if mask is not None else None
    out, lse = attend(q, k, v, mask, return_residuals=True)
    assert out.shape == (heads, q_len, d) and out.dtype == q.dtype and lse.shape == (heads, q_len)
    want_out, want_lse = numpy_attention(q, k, v, allowed)
    assert_matches(out, lse, want_out, want_lse)
    # without residuals: just out
    np.testing.assert_array_equal(np.asarray(attend(q, k, v, mask)), np.asarray(out))


def test_reference_features_combined(key):
    """GQA + segment ids + soft-cap + sinks + explicit scale, q_len != kv_len."""
    heads, kv_heads, q_len, kv_len, d = 8, 2, 20, 28, 16
    q, k, v = make_qkv(key, heads, kv_heads, q_len, kv_len, d)
    q = 3.0 * q  # large logits so the soft-cap matters
    mask = masks.CausalMask((q_len, kv_len), offset=kv_len - q_len)
    seg_q = jnp.asarray(np.repeat([0, 1, 2, 3], 5), jnp.int32)
    seg_kv = jnp.asarray(np.repeat([0, 1, 2, 3], 7), jnp.int32)
    sinks = jnp.linspace(-1.0, 2.0, heads, dtype=jnp.float32)
    kw = dict(scale=0.3, logit_soft_cap=5.0)
    out, lse = attend(q, k, v, mask, segment_ids=rs.SegmentIds(q=seg_q, kv=seg_kv), sinks=sinks,
                                      return_residuals=True, **kw)
    want_out, want_lse = numpy_attention(q, k, v, masks.dense(mask), scale=0.3, soft_cap=5.0, sinks=np.asarray(sinks),
                                         seg_q=seg_q, seg_kv=seg_kv)
    assert_matches(out, lse, want_out, want_lse)


@pytest.mark.parametrize("soft_cap", [None, 2.0])
def test_reference_segment_ids_and_soft_cap(key, soft_cap):
    q, k, v = make_qkv(key, 4, 2, 16, 16, 8)
    ids = jnp.asarray([0] * 5 + [1] * 7 + [2] * 4, jnp.int32)
    out, lse = attend(q, k, v, segment_ids=rs.SegmentIds(q=ids, kv=ids), logit_soft_cap=soft_cap,
                                      return_residuals=True)
    want_out, want_lse = numpy_attention(q, k, v, soft_cap=soft_cap, seg_q=ids, seg_kv=ids)
    assert_matches(out, lse, want_out, want_lse)


def test_reference_sinks(key):
    q, k, v = make_qkv(key, 4, 4, 12, 12, 8)
    sinks = jnp.asarray([-3.0, 0.0, 1.5, 20.0], jnp.float32)  # the last one swallows nearly all mass
    mask = masks.CausalMask((12, 12))
    out, lse = attend(q, k, v, mask, sinks=sinks, return_residuals=True)
    want_out, want_lse = numpy_attention(q, k, v, masks.dense(mask), sinks=np.asarray(sinks))
    assert_matches(out, lse, want_out, want_lse)
    # sinks only add denominator mass: lse grows, out is the sink-free out scaled down
    out0, lse0 = attend(q, k, v, mask, return_residuals=True)
    np.testing.assert_allclose(lse, jnp.logaddexp(lse0, sinks[:, None]), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(out, out0 * jnp.exp(lse0 - lse)[..., None], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("with_sinks", [False, True])
def test_reference_fully_masked_rows(key, with_sinks):
    heads, q_len, kv_len, d = 2, 12, 10, 8
    q, k, v = make_qkv(key, heads, 1, q_len, kv_len, d)
    mask = masks.CausalMask((q_len, kv_len), offset=-3)  # rows 0..2 attend nothing
    ids_q = jnp.asarray([0] * 6 + [5] * 6, jnp.int32)  # segment 5 has no keys: rows 6.. empty too
    ids_kv = jnp.zeros((kv_len,), jnp.int32)
    sinks = jnp.asarray([0.5, -1.0], jnp.float32) if with_sinks else None
    out, lse = attend(q, k, v, mask, segment_ids=rs.SegmentIds(q=ids_q, kv=ids_kv), sinks=sinks,
                                      return_residuals=True)
    out, lse = np.asarray(out), np.asarray(lse)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))
    empty = np.r_[0:3, 6:12]
    np.testing.assert_array_equal(out[:, empty], 0.0)
    if with_sinks:  # only the sink is left: lse = sink
        np.testing.assert_allclose(lse[:, empty], np.broadcast_to(np.asarray(sinks)[:, None], (2, empty.size)))
    else:
        np.testing.assert_array_equal(lse[:, empty], np.float32(rs.MASKED_LSE))
    want_out, want_lse = numpy_attention(q, k, v, masks.dense(mask), seg_q=ids_q, seg_kv=ids_kv,
                                         sinks=None if sinks is None else np.asarray(sinks))
    assert_matches(out, lse, want_out, want_lse)


def test_reference_vmaps_over_batch(key):
    q, k, v = make_qkv(key, 4, 2, 8, 8, 8)
    qb, kb, vb = (jnp.stack([x, 2 * x]) for x in (q, k, v))
    mask = masks.CausalMask((8, 8))
    out = jax.jit(jax.vmap(lambda a, b, c: rs.reference_attention(a, b, c, mask)))(qb, kb, vb)
    for i in range(2):
        np.testing.assert_allclose(out[i], attend(qb[i], kb[i], vb[i], mask), atol=1e-6)


def test_reference_bfloat16_inputs_compute_in_float32(key):
    q, k, v = make_qkv(key, 2, 2, 8, 8, 8)
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
    out, lse = attend(qb, kb, vb, masks.CausalMask((8, 8)), return_residuals=True)
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    want_out, want_lse = numpy_attention(np.asarray(qb, np.float64), np.asarray(kb, np.float64),
                                         np.asarray(vb, np.float64), masks.dense(masks.CausalMask((8, 8))))
    np.testing.assert_allclose(np.asarray(out, np.float64), want_out, atol=1e-2, rtol=1e-2)  # bf16 output rounding
    np.testing.assert_allclose(np.asarray(lse, np.float64), want_lse, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------
# gradients (the oracle computes in float32: finite differences with float32 tolerances)

GRAD_TOL = dict(atol=1e-2, rtol=1e-2, eps=1e-2)


def _loss_fn(mask, **kw):
    @jax.jit
    def f(q, k, v, *rest):
        sinks = rest[0] if rest else None
        out, lse = rs.reference_attention(q, k, v, mask, sinks=sinks, return_residuals=True, **kw)
        return out, jnp.where(lse > rs.MASKED_LSE / 2, lse, 0.0)

    return f


@pytest.mark.parametrize(
    "name, heads, kv_heads, q_len, kv_len, kw",
    [
        ("gqa_causal", 4, 2, 8, 8, {}),
        ("mqa_rect_softcap", 2, 1, 6, 10, {"logit_soft_cap": 3.0}),
        ("segments_scale", 2, 2, 8, 8, {"scale": 0.5}),
    ],
)
def test_reference_gradients(key, name, heads, kv_heads, q_len, kv_len, kw):
    q, k, v = make_qkv(key, heads, kv_heads, q_len, kv_len, 4)
    mask = masks.CausalMask((q_len, kv_len), offset=kv_len - q_len)
    if name == "segments_scale":
        ids = jnp.asarray([0, 0, 0, 1, 1, 1, 1, 2], jnp.int32)
        kw = {**kw, "segment_ids": rs.SegmentIds(q=ids, kv=ids)}
    check_grads(_loss_fn(mask, **kw), (q, k, v), order=1, modes=("rev",), **GRAD_TOL)


def test_reference_gradients_with_sinks(key):
    q, k, v = make_qkv(key, 4, 2, 8, 8, 4)
    sinks = jnp.asarray([-1.0, 0.0, 0.5, 1.0], jnp.float32)
    mask = masks.LocalMask((8, 8), window=(3, 0))
    check_grads(_loss_fn(mask), (q, k, v, sinks), order=1, modes=("rev",), **GRAD_TOL)
    # the documented closed form for d_sink: -sum_i exp(sink - lse_i) * delta_i, delta = rowsum(dO * out)
    d_out = jnp.asarray(rng_from(key).standard_normal(q.shape), jnp.float32)
    out, lse = attend(q, k, v, mask, sinks=sinks, return_residuals=True)
    g = jax.jit(jax.grad(lambda s: jnp.sum(rs.reference_attention(q, k, v, mask, sinks=s) * d_out)))(sinks)
    delta = jnp.sum(d_out * out, axis=-1)
    np.testing.assert_allclose(g, -jnp.sum(jnp.exp(sinks[:, None] - lse) * delta, axis=-1), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("with_sinks", [False, True])
def test_reference_gradients_finite_for_fully_masked_rows(key, with_sinks):
    q, k, v = make_qkv(key, 2, 1, 8, 8, 4)
    mask = masks.CausalMask((8, 8), offset=-3)  # rows 0..2 attend nothing
    sinks = jnp.asarray([0.3, -0.7], jnp.float32) if with_sinks else None

    def loss(q, k, v, sinks):
        out, lse = attend(q, k, v, mask, sinks=sinks, return_residuals=True)
        return jnp.sum(out**2) + jnp.sum(jnp.sin(out)) + jnp.sum(jnp.where(lse > rs.MASKED_LSE / 2, lse, 0.0))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3) if with_sinks else (0, 1, 2)))(q, k, v, sinks)
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g)))
    np.testing.assert_array_equal(np.asarray(grads[0])[:, :3], 0.0)  # masked rows: no gradient to q
    # the differentiable part still checks numerically
    if with_sinks:
        check_grads(_loss_fn(mask), (q, k, v, sinks), order=1, modes=("rev",), **GRAD_TOL)
    else:
        check_grads(_loss_fn(mask), (q, k, v), order=1, modes=("rev",), **GRAD_TOL)


def test_reference_dropout_drops_probabilities_with_the_key(key):
    kq, kk, kv, kd = jax.random.split(key, 4)
    q = jax.random.normal(kq, (4, 32, 16))
    k = jax.random.normal(kk, (2, 32, 16))
    v = jax.random.normal(kv, (2, 32, 16))
    mask = masks.CausalMask((32, 32))
    rate = 0.25
    out = rs.reference_attention(q, k, v, mask, dropout_rate=rate, dropout_key=kd)
    # independent construction: dense softmax, the same Bernoulli draw, kept entries rescaled
    s = np.einsum("hqd,hkd->hqk", np.asarray(q, np.float64), np.repeat(np.asarray(k, np.float64), 2, 0)) / 4.0
    s = np.where(mask[:, :], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    keep = np.asarray(jax.random.bernoulli(kd, 1.0 - rate, (4, 32, 32)))
    expected = np.einsum("hqk,hkd->hqd", np.where(keep, p / (1 - rate), 0.0), np.repeat(np.asarray(v, np.float64), 2, 0))
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5)
    assert np.array_equal(np.asarray(rs.reference_attention(q, k, v, mask, dropout_rate=0.0)),
                          np.asarray(rs.reference_attention(q, k, v, mask)))


@pytest.mark.parametrize("rate, match", [(1.0, "dropout_rate"), (-0.1, "dropout_rate"), (0.5, "dropout_key")])
def test_reference_dropout_bad_input(rate, match):
    q = jnp.ones((2, 8, 4))
    with pytest.raises(ValueError, match=match):
        rs.reference_attention(q, q, q, dropout_rate=rate)
