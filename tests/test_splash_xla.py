"""The plain-jnp Splash backend (``splash/xla.py``) vs the dense reference, forward and gradients.

Every case draws fresh unit-normal inputs and compares ``out``, ``lse`` and the gradients of
q, k, v with ``reference_attention``: float32 max abs error <= 1e-4, bfloat16 <= 2e-2. The
backend is exercised both directly (``xla.forward`` / ``xla.backward`` on a MaskInfo schedule,
which is what the ring calls per shard pair) and through
``splash_attention(..., config=SplashConfig(backend="xla"))`` (custom VJP, sinks).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import ringsplash as rs
from ringsplash import layouts, masks
from ringsplash._internal.checks import default_scale
from ringsplash.splash import xla
from ringsplash.splash.backend_interface import BackendStatic, BackwardInputs, ForwardInputs
from support.attention_inputs import inputs, max_err

TOL = {jnp.float32: 1e-4, jnp.bfloat16: 2e-2}


def xla_config(bq=128, bkv=128):
    return rs.SplashConfig(block_q=bq, block_kv=bkv, block_q_dkv=bq, block_kv_dkv=bkv, backend="xla")


def xla_forward(q, k, v, info, sched, q_pos, kv_pos, q_seg, kv_seg, *, scale=None, logit_soft_cap=None):
    static = BackendStatic(info, None, default_scale(scale, q.shape[-1]), logit_soft_cap, xla_config())
    return xla.forward(ForwardInputs(q, k, v, sched, q_pos, kv_pos, q_seg, kv_seg), static)


def xla_backward(q, k, v, d_out, lse, delta, info, sched, q_pos, kv_pos, q_seg, kv_seg, *, scale=None,
                 logit_soft_cap=None):
    static = BackendStatic(info, None, default_scale(scale, q.shape[-1]), logit_soft_cap, xla_config())
    inputs = BackwardInputs(q, k, v, d_out, lse, delta, sched, None, q_pos, kv_pos, q_seg, kv_seg)
    return xla.backward(inputs, static)


def random_numpy_mask(seed, q_len, kv_len):
    """Random blocks of every kind: empty, full and random partial, plus an empty row."""
    rng = np.random.default_rng(seed)
    arr = rng.random((q_len, kv_len)) < 0.3
    arr[:, : kv_len // 4] = False
    arr[: q_len // 4, kv_len // 2 :] = True
    arr[7] = False
    return masks.NumpyMask(arr)


S = 256
MASKS = {
    "full": lambda: masks.FullMask((S, S)),
    "causal": lambda: masks.CausalMask((S, S)),
    "local": lambda: masks.LocalMask((S, S), window=(100, 20)),
    "chunked": lambda: masks.ChunkedCausalMask((S, S), chunk_size=96),
    "prefix_lm": lambda: masks.PrefixLMMask((S, S), prefix_len=70),
    "numpy": lambda: random_numpy_mask(0, S, S),
    "and": lambda: masks.CausalMask((S, S)) & masks.LocalMask((S, S), window=(60, 0)),
    "or": lambda: masks.LocalMask((S, S), window=(10, 10)) | masks.PrefixLMMask((S, S), prefix_len=30),
}


# ----------------------------------------------------------------------------------------
# direct calls: xla.forward / xla.backward on a MaskInfo


def check_direct(key, mask, *, heads=4, kv_heads=2, q_len=S, kv_len=S, d=64, dtype=jnp.float32,
                 block_shape=(128, 128), partial_mode="auto", perm_q=None, perm_kv=None,
                 segment_ids=None, scale=None, logit_soft_cap=None):
    """Laid-out rows/columns ``perm_q`` / ``perm_kv`` (original positions), compared in that frame."""
    q, k, v, d_out, _ = inputs(key, heads, kv_heads, q_len, kv_len, d, dtype)
    perm_q = np.arange(q_len) if perm_q is None else np.asarray(perm_q)
    perm_kv = np.arange(kv_len) if perm_kv is None else np.asarray(perm_kv)
    info = rs.build_mask_info(mask, block_shape, q_positions=perm_q, kv_positions=perm_kv,
                              partial_mode=partial_mode)
    q_seg = kv_seg = None
    if segment_ids is not None:
        q_seg, kv_seg = segment_ids.q[perm_q], segment_ids.kv[perm_kv]

    def ref(q, k, v):
        # the reference works in the original frame: undo the layout, then redo it
        inv_q, inv_kv = np.argsort(perm_q), np.argsort(perm_kv)
        out, lse = rs.reference_attention(
            q[:, inv_q], k[:, inv_kv], v[:, inv_kv], mask, segment_ids=segment_ids, scale=scale,
            logit_soft_cap=logit_soft_cap, return_residuals=True,
        )
        return out[:, perm_q], lse[:, perm_q]

    @jax.jit  # one compiled program: eager, every op of the dense oracle compiles on its own per shape
    def ref_and_grads(q, k, v, d_out):
        (out_ref, lse_ref), vjp = jax.vjp(ref, q, k, v)
        return out_ref, lse_ref, vjp((d_out, jnp.zeros_like(lse_ref)))

    out_ref, lse_ref, grads_ref = ref_and_grads(q, k, v, d_out)

    pos_q, pos_kv = jnp.asarray(perm_q, jnp.int32), jnp.asarray(perm_kv, jnp.int32)
    kw = dict(scale=scale, logit_soft_cap=logit_soft_cap)

    @jax.jit
    def run(q, k, v, d_out):
        sched = info.schedule()
        out, lse = xla_forward(q, k, v, info, sched, pos_q, pos_kv, q_seg, kv_seg, **kw)
        delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
        grads = xla_backward(q, k, v, d_out, lse, delta, info, sched, pos_q, pos_kv, q_seg, kv_seg, **kw)
        return out, lse, grads

    out, lse, grads = run(q, k, v, d_out)
    tol = TOL[dtype]
    assert out.dtype == q.dtype and lse.dtype == jnp.float32
    assert all(g.dtype == jnp.float32 for g in grads)
    assert max_err(out, out_ref) <= tol, "out"
    # lse: compare where the row attends something; masked rows must carry the sentinel exactly
    masked = lse_ref <= rs.MASKED_LSE / 2
    assert bool(jnp.all(jnp.where(masked, lse == rs.MASKED_LSE, True))), "masked lse"
    assert max_err(jnp.where(masked, 0.0, lse), jnp.where(masked, 0.0, lse_ref)) <= tol, "lse"
    for name, g, g_ref in zip("qkv", grads, grads_ref):
        assert bool(jnp.all(jnp.isfinite(g))), f"d{name} not finite"
        assert max_err(g, g_ref) <= tol, f"d{name}: {max_err(g, g_ref)}"
    return out, lse, grads


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MASKS))
def test_xla_forward_backward_match_reference_for_every_mask(key, name):
    check_direct(key, MASKS[name]())


@pytest.mark.slow
@pytest.mark.parametrize("partial_mode", ["stored", "function"])
def test_xla_partial_blocks_stored_or_mask_function(key, partial_mode):
    mask = masks.ChunkedCausalMask((S, S), chunk_size=96) | masks.LocalMask((S, S), window=(3, 3))
    check_direct(key, mask, partial_mode=partial_mode)


@pytest.mark.slow
def test_xla_multi_head_mask_with_gqa_groups_and_subsets(key):
    # 8 heads, 2 kv heads (groups of 4): lists {0,1,2,3} (a whole group), {4,6}, {5}, {7}
    c, l1 = masks.CausalMask((S, S)), masks.LocalMask((S, S), window=(40, 0))
    p = masks.PrefixLMMask((S, S), prefix_len=50)
    mask = masks.MultiHeadMask([c, c, c, c, l1, p, l1, random_numpy_mask(1, S, S)])
    check_direct(key, mask, heads=8, kv_heads=2)


@pytest.mark.slow
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa_4_2", "mqa"])
def test_xla_gqa_and_mqa(key, kv_heads):
    check_direct(key, masks.CausalMask((S, S)), heads=4, kv_heads=kv_heads)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_xla_permuted_positions(key, layout):
    perm = layouts.permutation(layout, S, 2)
    mask = masks.CausalMask((S, S)) & masks.LocalMask((S, S), window=(90, 0))
    check_direct(key, mask, perm_q=perm, perm_kv=perm)
    check_direct(jax.random.fold_in(key, 1), mask, perm_q=perm, perm_kv=perm, partial_mode="function")


@pytest.mark.slow
def test_xla_segment_ids_soft_cap_scale_and_fully_masked_rows(key):
    ids = np.repeat(np.arange(4), S // 4).astype(np.int32)
    kv_ids = ids.copy()
    kv_ids[kv_ids == 2] = 9  # segment 2 has no keys: its rows attend nothing
    seg = rs.SegmentIds(q=jnp.asarray(ids), kv=jnp.asarray(kv_ids))
    out, lse, grads = check_direct(key, masks.CausalMask((S, S)), segment_ids=seg, scale=0.3,
                                   logit_soft_cap=2.5)
    rows = ids == 2
    assert bool(jnp.all(out[:, rows] == 0)) and bool(jnp.all(lse[:, rows] == rs.MASKED_LSE))
    assert bool(jnp.all(grads[0][:, rows] == 0))


@pytest.mark.slow
def test_xla_q_len_differs_from_kv_len_with_empty_rows(key):
    # bottom-right aligned causal with more queries than keys: the first 128 rows attend nothing
    mask = masks.CausalMask((384, 256), offset=-128)
    out, lse, _ = check_direct(key, mask, q_len=384, kv_len=256, block_shape=(128, 256))
    assert bool(jnp.all(lse[:, :128] == rs.MASKED_LSE)) and bool(jnp.all(out[:, :128] == 0))
    check_direct(key, masks.LocalMask((128, 512), window=(200, 50), offset=300), q_len=128, kv_len=512)


@pytest.mark.slow
def test_xla_bfloat16(key):
    check_direct(key, masks.LocalMask((S, S), window=(100, 0)), dtype=jnp.bfloat16)


@pytest.mark.slow
@settings(max_examples=6, deadline=None)
@given(
    q_blocks=st.integers(1, 3), kv_blocks=st.integers(1, 3), bq=st.sampled_from([64, 128]),
    bkv=st.sampled_from([64, 128]), group=st.sampled_from([1, 2]), d=st.sampled_from([32, 64]),
    window=st.integers(0, 300), seed=st.integers(0, 2**31 - 1),
)
def test_xla_hypothesis_shapes(q_blocks, kv_blocks, bq, bkv, group, d, window, seed):
    q_len, kv_len = q_blocks * bq, kv_blocks * bkv
    mask = masks.LocalMask((q_len, kv_len), window=(window, window // 3))
    check_direct(jax.random.key(seed), mask, heads=2 * group, kv_heads=2, q_len=q_len,
                 kv_len=kv_len, d=d, block_shape=(bq, bkv))


@pytest.mark.slow
def test_xla_shard_pairs_of_a_zigzag_ring(key):
    """Each (q shard, kv shard) schedule of a sharded MaskInfo, merged, equals the reference."""
    shards, heads, d = 2, 2, 64
    perm = layouts.permutation("zigzag", S, shards)
    mask = masks.CausalMask((S, S))
    info = rs.build_mask_info(mask, (64, 64), q_shards=shards, kv_shards=shards,
                              q_positions=perm, kv_positions=perm)
    q, k, v, _, _ = inputs(key, heads, heads, S, S, d)
    ql, kl, vl = q[:, perm], k[:, perm], v[:, perm]
    out_ref = rs.reference_attention(q, k, v, mask)[:, perm]
    n = S // shards
    pos = jnp.asarray(perm, jnp.int32)
    for a in range(shards):
        outs, lses = [], []
        for b in range(shards):
            o, lse = xla_forward(
                ql[:, a * n : (a + 1) * n], kl[:, b * n : (b + 1) * n], vl[:, b * n : (b + 1) * n], info,
                info.schedule(jnp.int32(a), jnp.int32(b)), pos[a * n : (a + 1) * n],
                pos[b * n : (b + 1) * n], None, None, scale=None, logit_soft_cap=None,
            )
            outs.append(o), lses.append(lse)
        lse_tot = jnp.logaddexp(*lses)
        merged = sum(o * jnp.exp(l - lse_tot)[..., None] for o, l in zip(outs, lses))
        assert max_err(merged, out_ref[:, a * n : (a + 1) * n]) <= 1e-4


# ----------------------------------------------------------------------------------------
# through splash_attention(config=SplashConfig(backend="xla"))


def check_splash(key, mask, *, heads=4, kv_heads=2, q_len=S, kv_len=S, d=64, dtype=jnp.float32,
                 cfg=None, sinks=False, segment_ids=None, logit_soft_cap=None):
    cfg = cfg or xla_config()
    q, k, v, d_out, s = inputs(key, heads, kv_heads, q_len, kv_len, d, dtype)
    s = s if sinks else None
    d_lse = jax.random.normal(jax.random.fold_in(key, 7), (heads, q_len), jnp.float32)
    kw = dict(segment_ids=segment_ids, logit_soft_cap=logit_soft_cap, return_residuals=True)

    def loss(fn, q, k, v, s):
        out, lse = fn(q, k, v, mask, sinks=s, **kw)
        lse = jnp.where(lse <= rs.MASKED_LSE / 2, 0.0, lse)
        return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32)) + jnp.sum(lse * d_lse), (out, lse)

    argnums = (0, 1, 2, 3) if sinks else (0, 1, 2)
    ours = jax.jit(jax.grad(lambda *a: loss(lambda *b, **c: rs.splash_attention(*b, config=cfg, **c), *a),
                            argnums=argnums, has_aux=True))
    ref = jax.grad(lambda *a: loss(rs.reference_attention, *a), argnums=argnums, has_aux=True)
    (g, (out, lse)), (g_ref, (out_ref, lse_ref)) = ours(q, k, v, s), ref(q, k, v, s)
    tol = TOL[dtype]
    assert max_err(out, out_ref) <= tol and max_err(lse, lse_ref) <= tol
    for name, a, b in zip("qkvs", g, g_ref):
        assert max_err(a, b) <= tol, f"d{name}: {max_err(a, b)}"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["causal", "numpy", "or"])
def test_xla_splash_attention_matches_reference(key, name):
    check_splash(key, MASKS[name]())


@pytest.mark.slow
def test_xla_splash_attention_sinks_soft_cap_segments_bf16(key):
    ids = jnp.asarray(np.repeat(np.arange(3), [100, 100, 56]), jnp.int32)
    seg = rs.SegmentIds(q=ids, kv=ids)
    check_splash(key, masks.LocalMask((S, S), window=(64, 0)), sinks=True, logit_soft_cap=4.0,
                 segment_ids=seg, kv_heads=1)
    check_splash(key, masks.CausalMask((S, S)), sinks=True, dtype=jnp.bfloat16, cfg=xla_config(256, 128))


@pytest.mark.slow
def test_xla_splash_attention_under_vmap_checkpoint_and_shard_map(key):
    batch, heads, d = 2, 4, 32
    mask = masks.CausalMask((S, S))
    cfg = xla_config()
    q = jax.random.normal(key, (batch, heads, S, d))

    def f(q):
        return rs.splash_attention(q, q, q, mask, config=cfg)

    def f_ref(q):
        return rs.reference_attention(q, q, q, mask)

    loss = lambda fn: (lambda q: jnp.sum(jnp.sin(jax.vmap(jax.checkpoint(fn))(q))))
    g, g_ref = jax.jit(jax.grad(loss(f)))(q), jax.grad(loss(f_ref))(q)
    assert max_err(g, g_ref) <= 1e-4

    mesh = jax.make_mesh((4,), ("heads",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:4])
    sharded = jax.shard_map(f, mesh=mesh, in_specs=P("heads"), out_specs=P("heads"), check_vma=True)
    gs = jax.jit(jax.grad(lambda q: jnp.sum(jnp.sin(sharded(q)))))(q[0])
    assert max_err(gs, jax.grad(lambda q: jnp.sum(jnp.sin(f_ref(q))))(q[0])) <= 1e-4


def test_xla_splash_sinks_replicated_over_a_batch_shard_map_with_vma_checks(key):
    """Replicated sinks under ``shard_map(check_vma=True)`` over the batch: the sinks' cotangent
    is summed over the axis the rows vary over and the sinks do not."""
    mask, heads, d = masks.CausalMask((S, S)), 2, 32
    q = jax.random.normal(key, (2, heads, S, d))
    sinks = jnp.array([0.5, -1.0])
    mesh = jax.make_mesh((2,), ("b",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    loss = lambda attn, q, s: jnp.sum(jnp.sin(attn(q, q, q, mask, sinks=s)))
    local = lambda q, s: jax.lax.psum(loss(functools.partial(rs.splash_attention, config=xla_config()), q[0], s), "b")
    sm = jax.shard_map(local, mesh=mesh, in_specs=(P("b"), P()), out_specs=P(), check_vma=True)
    got = jax.jit(jax.grad(sm, argnums=1))(q, sinks)
    want = jax.grad(lambda s: loss(rs.reference_attention, q[0], s) + loss(rs.reference_attention, q[1], s))(sinks)
    assert max_err(got, want) <= 1e-4


@pytest.mark.slow
def test_xla_scans_type_check_under_shard_map_with_traced_shard_indices(key):
    """Ring-style use: the shard pair comes from ``axis_index`` (a varying, traced schedule)."""
    shards, n, heads, d = 4, S // 4, 2, 32
    mask = masks.CausalMask((S, S))
    info = rs.build_mask_info(mask, (64, 64), q_shards=shards, kv_shards=shards)
    q, k, v, d_out, _ = inputs(key, heads, heads, S, S, d)
    mesh = jax.make_mesh((shards,), ("ctx",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:shards])
    pos = jnp.arange(S, dtype=jnp.int32)

    def diagonal(q, k, v, d_out):  # shard a against kv shard a
        a = jax.lax.axis_index("ctx")
        sched = info.schedule(a, a)
        p = jax.lax.dynamic_slice_in_dim(pos, a * n, n)
        kw = dict(scale=None, logit_soft_cap=None)
        out, lse = xla_forward(q, k, v, info, sched, p, p, None, None, **kw)
        delta = jnp.sum(d_out * out, axis=-1)
        dq, _dk, _dv = xla_backward(q, k, v, d_out, lse, delta, info, sched, p, p, None, None, **kw)
        return out, dq

    spec = P(None, "ctx")
    out, dq = jax.jit(jax.shard_map(diagonal, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec, spec),
                                    check_vma=True))(q, k, v, d_out)
    # block-diagonal causal reference
    block = np.arange(S) // n
    diag = masks.NumpyMask(masks.CausalMask((S, S))[:, :] & (block[:, None] == block[None, :]))
    ref = lambda q: rs.reference_attention(q, k, v, diag)
    out_ref, vjp = jax.vjp(ref, q)
    assert max_err(out, out_ref) <= 1e-4 and max_err(dq, vjp(d_out)[0]) <= 1e-4


def test_xla_memory_is_not_quadratic():
    """Compiled temporaries of forward + backward stay O(S * d), far below one S x S array."""
    heads, s_len, d = 2, 8192, 64
    mask = masks.CausalMask((s_len, s_len))
    cfg = xla_config(512, 512)
    q = jax.ShapeDtypeStruct((heads, s_len, d), jnp.float32)
    step = jax.jit(jax.grad(lambda q, k, v: jnp.sum(rs.splash_attention(q, k, v, mask, config=cfg)),
                            argnums=(0, 1, 2)))
    mem = step.lower(q, q, q).compile().memory_analysis()
    qkv_bytes = heads * s_len * d * 4
    assert mem.temp_size_in_bytes <= 16 * qkv_bytes, mem.temp_size_in_bytes  # S^2 would be 256x
