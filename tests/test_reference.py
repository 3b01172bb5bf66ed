"""reference_attention against an independent float64 numpy implementation; gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ringsplash as rs
from ringsplash import masks
from support.tiers import fast_first

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
    # float32 against float64: measured max |error| 8.6e-7 (out), 7.3e-7 (lse); ~10x headroom. The
    # rtol only admits MASKED_LSE's float32 rounding (-1e30 is not a float32) at fully masked rows.
    np.testing.assert_allclose(np.asarray(got_out, np.float64), want_out, atol=8e-6, rtol=0)
    np.testing.assert_allclose(np.asarray(got_lse, np.float64), want_lse, atol=8e-6, rtol=1e-7)


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


@pytest.mark.parametrize("name", fast_first(list(CASES), 3))
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


@pytest.mark.slow
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
# gradients: against an independent float64 oracle (dense attention written out in jnp,
# differentiated by jax.grad in float64), for q, k, v and sinks, through out and lse.


def _dense64(q, k, v, sinks, allowed, scale, soft_cap):
    """float64 dense attention ``(out, lse)``: every row's softmax written out (GQA by repeating
    kv heads, sinks as an extra logit column, fully masked rows give out 0 and lse 0)."""
    group = q.shape[0] // k.shape[0]
    k, v = jnp.repeat(k, group, axis=0), jnp.repeat(v, group, axis=0)
    s = jnp.einsum("hqd,hkd->hqk", q, k) * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(allowed, s, -jnp.inf)
    if sinks is not None:
        s = jnp.concatenate([s, jnp.broadcast_to(sinks[:, None, None], s.shape[:2] + (1,))], axis=-1)
        v = jnp.concatenate([v, jnp.zeros_like(v[:, :1])], axis=1)  # a sink carries no value
    live = jnp.any(jnp.isfinite(s), axis=-1)
    m = jnp.where(live, jnp.max(jnp.where(jnp.isfinite(s), s, -1e300), axis=-1), 0.0)
    e = jnp.where(jnp.isfinite(s), jnp.exp(s - m[..., None]), 0.0)
    denom = jnp.sum(e, axis=-1)
    safe = jnp.where(live, denom, 1.0)
    out = jnp.einsum("hqk,hkd->hqd", e / safe[..., None], v)
    return out, jnp.where(live, m + jnp.log(safe), 0.0)


def _grads_against_float64(key, q, k, v, mask, *, sinks=None, segment_ids=None, scale=None, soft_cap=None):
    """Max absolute error of the reference's float32 (out, lse, dq, dk, dv[, dsinks]) against the
    float64 oracle, for a random cotangent on out and on lse (at rows that attend something)."""
    rng = rng_from(jax.random.fold_in(key, 1))
    d_out = rng.standard_normal(q.shape)
    d_lse = rng.standard_normal(q.shape[:2])
    allowed = np.ones((q.shape[0], q.shape[1], k.shape[1]), bool)
    if mask is not None:
        allowed &= masks.dense(mask)
    if segment_ids is not None:
        allowed &= np.asarray(segment_ids.q)[:, None] == np.asarray(segment_ids.kv)[None, :]
    live = allowed.any(-1) | (sinks is not None)
    scale_ = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    args = (q, k, v) + ((sinks,) if sinks is not None else ())
    argnums = tuple(range(len(args)))

    def loss32(q, k, v, *rest):
        out, lse = rs.reference_attention(q, k, v, mask, sinks=rest[0] if rest else None, segment_ids=segment_ids,
                                          scale=scale, logit_soft_cap=soft_cap, return_residuals=True)
        return jnp.sum(out * d_out) + jnp.sum(jnp.where(live, lse, 0.0) * d_lse), (out, lse)

    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss32, argnums=argnums, has_aux=True))(*args)
    with jax.enable_x64(True):
        args64 = tuple(jnp.asarray(np.asarray(x), jnp.float64) for x in args)

        def loss64(q, k, v, *rest):
            out, lse = _dense64(q, k, v, rest[0] if rest else None, allowed, scale_, soft_cap)
            return jnp.sum(out * d_out) + jnp.sum(lse * d_lse), (out, lse)

        (_, (out64, lse64)), grads64 = jax.value_and_grad(loss64, argnums=argnums, has_aux=True)(*args64)
        want = [np.asarray(x) for x in (out64, lse64, *grads64)]
    got = [np.asarray(out, np.float64), np.where(live, np.asarray(lse, np.float64), 0.0),
           *(np.asarray(g, np.float64) for g in grads)]
    names = ["out", "lse", "dq", "dk", "dv", "dsinks"][: len(got)]
    return {n: float(np.max(np.abs(g - w))) for n, g, w in zip(names, got, want)}


# float32 against float64, max absolute error over these cases: out 3.8e-7, lse 3.3e-7,
# dq/dk/dv/dsinks 4.0e-7 (measured); 10x headroom.
OUT_LSE_TOL = 4e-6
GRAD_TOL = 4e-6

GRAD_CASES = {
    # name: (heads, kv_heads, q_len, kv_len, d, mask factory, options)
    "gqa_causal": (4, 2, 8, 8, 4, lambda s: masks.CausalMask(s), {}),
    "mqa_rect_softcap": (2, 1, 6, 10, 4, lambda s: masks.CausalMask(s, offset=4), {"soft_cap": 3.0}),
    "segments_scale": (2, 2, 8, 8, 4, lambda s: masks.CausalMask(s),
                       {"scale": 0.5, "segments": [0, 0, 0, 1, 1, 1, 1, 2]}),
    "sinks_local": (4, 2, 8, 8, 4, lambda s: masks.LocalMask(s, window=(3, 0)), {"sinks": [-1.0, 0.0, 0.5, 1.0]}),
    "masked_rows": (2, 1, 8, 8, 4, lambda s: masks.CausalMask(s, offset=-3), {}),  # rows 0..2 attend nothing
    "masked_rows_sinks": (2, 1, 8, 8, 4, lambda s: masks.CausalMask(s, offset=-3), {"sinks": [0.3, -0.7]}),
    "nomask_d16": (2, 2, 16, 16, 16, None, {}),
}


@pytest.mark.parametrize("name", fast_first(list(GRAD_CASES)))
def test_reference_gradients_match_float64(key, name):
    heads, kv_heads, q_len, kv_len, d, factory, opts = GRAD_CASES[name]
    q, k, v = make_qkv(key, heads, kv_heads, q_len, kv_len, d)
    sinks = jnp.asarray(opts["sinks"], jnp.float32) if "sinks" in opts else None
    ids = jnp.asarray(opts["segments"], jnp.int32) if "segments" in opts else None
    errors = _grads_against_float64(
        key, q, k, v, factory((q_len, kv_len)) if factory else None, sinks=sinks,
        segment_ids=rs.SegmentIds(q=ids, kv=ids) if ids is not None else None, scale=opts.get("scale"),
        soft_cap=opts.get("soft_cap"),
    )
    assert set(errors) == {"out", "lse", "dq", "dk", "dv"} | ({"dsinks"} if sinks is not None else set())
    for n, e in errors.items():
        assert e <= (OUT_LSE_TOL if n in ("out", "lse") else GRAD_TOL), (n, e)


def test_reference_sink_gradient_closed_form(key):
    q, k, v = make_qkv(key, 4, 2, 8, 8, 4)
    sinks = jnp.asarray([-1.0, 0.0, 0.5, 1.0], jnp.float32)
    mask = masks.LocalMask((8, 8), window=(3, 0))
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
    # (the values of these gradients: test_reference_gradients_match_float64, "masked_rows*")


@pytest.mark.slow
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
    v64 = np.repeat(np.asarray(v, np.float64), 2, 0)
    expected = np.einsum("hqk,hkd->hqd", np.where(keep, p / (1 - rate), 0.0), v64)
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5)
    # rate 0 with a key drops nothing: the plain softmax of the same oracle (measured <= 3.1e-7; ~10x headroom)
    no_drop = rs.reference_attention(q, k, v, mask, dropout_rate=0.0, dropout_key=kd)
    np.testing.assert_allclose(np.asarray(no_drop), np.einsum("hqk,hkd->hqd", p, v64), atol=3e-6, rtol=0)


@pytest.mark.parametrize("rate, match", [(1.0, "dropout_rate"), (-0.1, "dropout_rate"), (0.5, "dropout_key")])
def test_reference_dropout_bad_input(rate, match):
    q = jnp.ones((2, 8, 4))
    with pytest.raises(ValueError, match=match):
        rs.reference_attention(q, q, q, dropout_rate=rate)


@pytest.mark.parametrize("sink", [np.nan, np.inf], ids=["nan", "pos_inf"])
def test_reference_equals_the_kernels_on_traced_non_finite_sinks(key, sink):
    """Concrete NaN / +inf sinks are refused; traced ones (inside jit) cannot be inspected, so
    every path must treat them alike: the reference now propagates them as the kernels do
    (before, a NaN sink gave a finite, un-normalised reference output)."""
    s, heads = 256, 2
    q, k, v = jax.random.normal(key, (3, heads, s, 32))
    mask = masks.CausalMask((s, s))
    sinks = jnp.asarray([sink, 0.5], jnp.float32)
    config = rs.SplashConfig(block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128, backend="xla")
    run = lambda attn: jax.jit(lambda sk: attn(q, k, v, mask, sinks=sk, return_residuals=True))(sinks)
    (ref, ref_lse), (out, lse) = run(rs.reference_attention), run(lambda *a, **kw: rs.splash_attention(
        *a, config=config, **kw))
    np.testing.assert_array_equal(np.isnan(ref), np.isnan(out))  # same rows NaN (all of head 0 for a NaN sink)
    np.testing.assert_array_equal(np.isnan(ref_lse), np.isnan(lse))
    if np.isnan(sink):
        assert np.isnan(np.asarray(ref[0])).all()
    else:  # +inf takes every row's whole weight: output 0, lse +inf
        assert not np.asarray(ref[0]).any() and np.isposinf(np.asarray(ref_lse[0])).all()
    # the other head is untouched and still agrees (measured 3.0e-7; 10x headroom)
    assert float(jnp.max(jnp.abs(ref[1] - out[1]))) <= 3e-6
