"""Segment-aware block skipping (``splash/segment_blocks.py``): refined work lists are exact for
sorted ids and safe otherwise, full blocks inside one document skip the segment compare,
kernels compute exactly the refined entries, results match the reference (forward and every
gradient) on random packings, and the ring skips shard pairs that share no segment."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental.pallas import tpu as pltpu

import ringsplash as rs
from ringsplash import layouts, masks
from ringsplash.parallel import ring_loop as ring_lib
from ringsplash.splash import dispatch as dispatch_lib
from ringsplash.splash import pallas as pallas_backend
from ringsplash.splash import segment_blocks
from ringsplash.splash.backend_interface import BackendStatic, BackwardInputs, ForwardInputs
from ringsplash.splash.config import SplashConfig
from support.attention_inputs import inputs, max_err
from support.meshes import mesh

# float32 max abs error vs the reference, measured over these cases: out <= 6e-7,
# dq / dk / dv <= 4e-6 (single device); ring as tests/test_ring.py. ~10x headroom.
OUT_TOL, GRAD_TOL = 6e-6, 4e-5
NAN_PARAMS = pltpu.InterpretParams(uninitialized_memory="nan")


def config(backend, skipping=True):
    return SplashConfig(block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128, backend=backend,
                        interpret_params=NAN_PARAMS, segment_skipping=skipping)


# ----------------------------------------------------------------------------------------
# packings


def packing(rng, s, *, docs, pad, order, pad_mode="shared"):
    """(q ids, kv ids) of ``docs`` documents of random lengths then ``pad`` padding tokens.

    ``order``: "sorted" (ids 0, 1, ... along the sequence), "relabelled" (contiguous runs with
    shuffled labels: not monotone) or "shuffled" (tokens of the documents interleaved at
    random). ``pad_mode``: "shared" (one padding segment attending itself) or "disjoint" (q and
    kv padding ids differ: padded rows attend nothing)."""
    body = s - pad
    cuts = np.sort(rng.choice(np.arange(1, body), size=min(docs, body) - 1, replace=False))
    ids = np.repeat(np.arange(len(cuts) + 1), np.diff(np.concatenate([[0], cuts, [body]])))
    if order == "relabelled":
        ids = rng.permutation(ids.max() + 1)[ids]
    elif order == "shuffled":
        ids = rng.permutation(ids)
    big = 1 << 20
    q = np.concatenate([ids, np.full(pad, big)]).astype(np.int32)
    kv = np.concatenate([ids, np.full(pad, big if pad_mode == "shared" else big + 1)]).astype(np.int32)
    return q, kv


def same_segment_blocks(mask_dense, q_ids, kv_ids, bq, bkv):
    """bool [q blocks, kv blocks]: the block pair holds an allowed same-segment (q, k) pair."""
    both = mask_dense & (q_ids[:, None] == kv_ids[None, :])
    nq, nk = both.shape[0] // bq, both.shape[1] // bkv
    return both.reshape(nq, bq, nk, bkv).any(axis=(1, 3))


_refine = jax.jit(segment_blocks.refine_schedule, static_argnums=(3,), static_argnames=("transpose",))


def refined(info, q_ids, kv_ids):
    return _refine(info.schedule(), jnp.asarray(q_ids), jnp.asarray(kv_ids), info.block_shape,
                   transpose=info.transpose)


def entries(sched, lst=0):
    """The computing entries of list ``lst`` as a set of (q block, kv block)."""
    kind, qb, kb = (np.asarray(x)[lst] for x in (sched.kind, sched.q_block, sched.kv_block))
    return {(int(a), int(b)) for a, b in zip(qb[kind > 0], kb[kind > 0])}


def check_compacted(sched, info, lst=0):
    """Order kept, every major block visited, padding repeats the last kept entry (kind 0)."""
    n = int(sched.num_steps[lst])
    kind, qb, kb, pidx = (np.asarray(x)[lst] for x in (sched.kind, sched.q_block, sched.kv_block,
                                                        sched.partial_index))
    major, num_major = (kb, info.kv_blocks_per_shard) if info.transpose else (qb, info.q_blocks_per_shard)
    assert np.all(np.diff(major[:n]) >= 0), "entries must stay sorted by their major block"
    assert set(major[:n].tolist()) == set(range(num_major)), "every major block keeps a visit"
    assert np.all(kind[n:] == 0)
    for a in (qb, kb, pidx):
        assert np.all(a[n:] == a[n - 1]), "padding must repeat the last kept entry (no new fetch)"
    static_entries = {(int(a), int(b), int(k)) for a, b, k in zip(
        np.asarray(info.q_block)[lst, 0, 0], np.asarray(info.kv_block)[lst, 0, 0], np.asarray(info.kind)[lst, 0, 0])
        if k > 0}
    # FULL_SAME (3) is a FULL (2) entry inside one shared segment
    kept = {(int(a), int(b), min(int(k), 2)) for a, b, k in zip(qb[:n], kb[:n], kind[:n]) if k > 0}
    assert kept <= static_entries, "a kept entry must be a static entry with its static kind"
    return {(int(a), int(b)) for a, b, k in zip(qb[:n], kb[:n], kind[:n]) if k == segment_blocks.FULL_SAME}


def full_same_blocks(mask_dense, q_ids, kv_ids, bq, bkv):
    """(q block, kv block) pairs whose mask is all-true and whose rows and columns all lie in
    one and the same segment."""
    nq, nk = q_ids.size // bq, kv_ids.size // bkv
    qs, ks = q_ids.reshape(nq, bq), kv_ids.reshape(nk, bkv)
    full = mask_dense.reshape(nq, bq, nk, bkv).all(axis=(1, 3))
    return {(a, b) for a in range(nq) for b in range(nk)
            if full[a, b] and np.all(qs[a] == qs[a, 0]) and np.all(ks[b] == qs[a, 0])}


MASKS = {
    "causal": lambda s: masks.CausalMask((s, s)),
    "local": lambda s: masks.LocalMask((s, s), window=(300, 40)),
    "full": lambda s: masks.FullMask((s, s)),
}


@settings(max_examples=6, deadline=None)
@given(
    docs=st.integers(1, 40), pad=st.sampled_from([0, 1, 200]), mask=st.sampled_from(list(MASKS)),
    blocks=st.sampled_from([(128, 128), (128, 256), (256, 128)]), seed=st.integers(0, 2**31 - 1),
)
@pytest.mark.slow
def test_refined_lists_are_exactly_the_same_segment_blocks_for_sorted_ids(docs, pad, mask, blocks, seed):
    s = 1024
    q_ids, kv_ids = packing(np.random.default_rng(seed), s, docs=docs, pad=pad, order="sorted")
    m = MASKS[mask](s)
    exact = same_segment_blocks(masks.dense(m)[0], q_ids, kv_ids, *blocks)
    want = {tuple(map(int, x)) for x in np.argwhere(exact)}
    for transpose in (False, True):
        info = rs.build_mask_info(m, blocks, transpose=transpose)
        sched = refined(info, q_ids, kv_ids)
        assert entries(sched) == want, (transpose, len(entries(sched)), len(want))
        full_same = check_compacted(sched, info)
        assert full_same == full_same_blocks(masks.dense(m)[0], q_ids, kv_ids, *blocks) & want


@settings(max_examples=8, deadline=None)
@given(
    docs=st.integers(1, 30), pad=st.sampled_from([0, 130]), order=st.sampled_from(["relabelled", "shuffled"]),
    pad_mode=st.sampled_from(["shared", "disjoint"]), seed=st.integers(0, 2**31 - 1),
)
def test_refined_lists_keep_every_same_segment_block_for_any_ids(docs, pad, order, pad_mode, seed):
    """Unsorted ids: refinement may keep more than needed, never less."""
    s = 1024
    q_ids, kv_ids = packing(np.random.default_rng(seed), s, docs=docs, pad=pad, order=order, pad_mode=pad_mode)
    m = masks.CausalMask((s, s))
    exact = same_segment_blocks(masks.dense(m)[0], q_ids, kv_ids, 128, 128)
    for transpose in (False, True):
        info = rs.build_mask_info(m, (128, 128), transpose=transpose)
        sched = refined(info, q_ids, kv_ids)
        assert {tuple(map(int, x)) for x in np.argwhere(exact)} <= entries(sched)
        check_compacted(sched, info)


def test_segment_skipping_off_keeps_the_static_lists_and_config_validates():
    info = rs.build_mask_info(masks.CausalMask((512, 512)), (128, 128))
    ids = jnp.repeat(jnp.arange(4, dtype=jnp.int32), 128)
    sched = dispatch_lib._refine(info.schedule(), info, ids, ids, config("xla", skipping=False))
    assert sched.num_steps is None and np.array_equal(np.asarray(sched.kind), np.asarray(info.schedule().kind))
    on = dispatch_lib._refine(info.schedule(), info, ids, ids, config("xla"))
    assert np.asarray(on.num_steps).tolist() == [4]  # one diagonal block per document
    # the library's TypeError, or the shape-checked test run's (both name the field)
    with pytest.raises(TypeError, match=r"segment_skipping"):
        SplashConfig(segment_skipping=1)


# ----------------------------------------------------------------------------------------
# numerics: forward and every gradient vs the reference


def check_against_reference(key, mask, q_ids, kv_ids, cfg, *, heads=2, kv_heads=1, d=32):
    s = q_ids.shape[0]
    q, k, v, d_out, _ = inputs(key, heads, kv_heads, s, s, d)
    ids = rs.SegmentIds(q=jnp.asarray(q_ids), kv=jnp.asarray(kv_ids))

    def run(fn):
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, mask, segment_ids=ids), q, k, v)
        return (out, *vjp(d_out))

    got = jax.jit(lambda q, k, v: run(functools.partial(rs.splash_attention, config=cfg)))(q, k, v)
    want = jax.jit(lambda q, k, v: run(rs.reference_attention))(q, k, v)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert bool(jnp.all(jnp.isfinite(a))), name
        assert max_err(a, b) <= (OUT_TOL if name == "out" else GRAD_TOL), (name, max_err(a, b))
    return got


@pytest.mark.slow
@settings(max_examples=4, deadline=None)
@given(
    docs=st.integers(1, 12), pad=st.sampled_from([0, 3, 100]),
    order=st.sampled_from(["sorted", "relabelled", "shuffled"]), pad_mode=st.sampled_from(["shared", "disjoint"]),
    mask=st.sampled_from(["causal", "local"]), seed=st.integers(0, 2**31 - 1),
)
def test_xla_backend_matches_reference_on_random_packings(docs, pad, order, pad_mode, mask, seed):
    s = 512
    q_ids, kv_ids = packing(np.random.default_rng(seed), s, docs=docs, pad=pad, order=order, pad_mode=pad_mode)
    check_against_reference(jax.random.key(seed), MASKS[mask](s), q_ids, kv_ids, config("xla"))


@pytest.mark.slow
@pytest.mark.parametrize("order, pad_mode, docs, full_same", [("sorted", "disjoint", 7, set()),
                                                              ("relabelled", "shared", 3, {(1, 0)})])
def test_interpret_kernels_match_reference_on_packings(key, order, pad_mode, docs, full_same):
    s = 512
    q_ids, kv_ids = packing(np.random.default_rng(len(order)), s, docs=docs, pad=70, order=order, pad_mode=pad_mode)
    # the second case has a full block inside one document (FULL_SAME: no segment compare)
    assert full_same_blocks(masks.dense(masks.CausalMask((s, s)))[0], q_ids, kv_ids, 128, 128) == full_same
    check_against_reference(key, masks.CausalMask((s, s)), q_ids, kv_ids, config("interpret"), d=64)


@pytest.mark.slow
def test_kernels_compute_exactly_the_refined_entries(key):
    """In-kernel step counters (forward, dq, dK/dV): computing steps == refined entries ==
    block pairs holding a same-document pair (sorted ids), far fewer than the static lists."""
    s, heads, kv_heads = 512, 2, 1
    ids = np.repeat(np.arange(5), [300, 40, 30, 100, 42]).astype(np.int32)
    mask = masks.CausalMask((s, s))
    cfg = config("interpret")
    info = rs.build_mask_info(mask, cfg.block_shape)
    info_dkv = rs.build_mask_info(mask, cfg.block_shape_dkv, transpose=True)
    exact = int(same_segment_blocks(masks.dense(mask)[0], ids, ids, 128, 128).sum())
    static_count = int(info.num_active.sum())
    assert exact < static_count
    q, k, v, d_out, _ = inputs(key, heads, kv_heads, s, s, 64)
    pos, seg = jnp.arange(s, dtype=jnp.int32), jnp.asarray(ids)
    sched, sched_dkv = refined(info, ids, ids), refined(info_dkv, ids, ids)
    assert len(entries(sched)) == len(entries(sched_dkv)) == exact
    # blocks 0 and 1 lie inside document 0: that full entry skips the segment compare
    assert check_compacted(sched, info) == check_compacted(sched_dkv, info_dkv) == {(1, 0)}
    static = BackendStatic(info, info_dkv, 0.125, None, cfg)
    out, lse, count = pallas_backend.forward(
        ForwardInputs(q, k, v, sched, pos, pos, seg, seg), static, count_steps=True)
    np.testing.assert_array_equal(np.asarray(count), exact)
    ref_out = rs.reference_attention(q, k, v, mask, segment_ids=rs.SegmentIds(seg, seg))
    assert max_err(out, ref_out) <= OUT_TOL
    delta = jnp.sum(out * d_out, axis=-1)
    grads_in = BackwardInputs(q, k, v, d_out, lse, delta, sched, sched_dkv, pos, pos, seg, seg)
    _, count_dq = pallas_backend.backward(grads_in, static, count_steps=True, parts=("dq",))
    *_, count_dkv = pallas_backend.backward(grads_in, static, count_steps=True, parts=("dkv",))
    *_, count_fused = pallas_backend.backward(grads_in, static, count_steps=True)  # dq in the dK/dV kernel
    np.testing.assert_array_equal(np.asarray(count_dq), exact)
    np.testing.assert_array_equal(np.asarray(count_dkv), exact * heads // kv_heads)
    np.testing.assert_array_equal(np.asarray(count_fused), exact * heads // kv_heads)


# ----------------------------------------------------------------------------------------
# the ring: inactive shard pairs skip their steps


RING_CASES = [(2, "contiguous", 512), (4, "zigzag", 1024), (8, "striped", 1024)]


@pytest.mark.slow
@pytest.mark.parametrize("n, layout, s", RING_CASES)
def test_ring_skips_shard_pairs_without_a_shared_segment(monkeypatch, key, n, layout, s):
    """Counts the forward and backward block calls the ring runs (a host callback inside the
    taken branch) and checks them against the shard pairs holding a same-document pair;
    out and every gradient against the reference."""
    heads, kv_heads, d = 2, 1, 32
    rng = np.random.default_rng(n)
    half = lambda docs: rng.multinomial(s // 2 - docs, np.ones(docs) / docs) + 1  # a document ends at s / 2
    ids = np.repeat(np.arange(9), np.concatenate([half(4), half(5)])).astype(np.int32)
    mask = masks.CausalMask((s, s))
    calls = {"fwd": 0, "bwd": 0}

    def counted(fn, name):
        def wrapped(*args, **kw):
            jax.debug.callback(lambda: calls.__setitem__(name, calls[name] + 1))
            return fn(*args, **kw)
        return wrapped

    monkeypatch.setattr(ring_lib, "block_forward", counted(ring_lib.block_forward, "fwd"))
    monkeypatch.setattr(ring_lib, "block_backward", counted(ring_lib.block_backward, "bwd"))
    cfg = config("xla")
    m = mesh(n)
    q, k, v, d_out, _ = inputs(key, heads, kv_heads, s, s, d)
    lay = lambda x: layouts.permute(x, layout, n, axis=0 if x.ndim == 1 else 1)
    seg = rs.SegmentIds(q=lay(jnp.asarray(ids)), kv=lay(jnp.asarray(ids)))

    def ring(q, k, v):
        fn = lambda q, k, v: rs.ring_attention_sharded(q, k, v, mask, mesh=m, axis_name="ctx", segment_ids=seg,
                                                       layout=layout, config=cfg)
        out, vjp = jax.vjp(fn, lay(q), lay(k), lay(v))
        return (out, *vjp(lay(d_out)))

    got = jax.block_until_ready(jax.jit(ring)(q, k, v))
    unlay = lambda x: layouts.unpermute(x, layout, n, axis=1)
    ids_j = rs.SegmentIds(jnp.asarray(ids), jnp.asarray(ids))
    @jax.jit
    def reference(q, k, v):
        out, vjp = jax.vjp(lambda q, k, v: rs.reference_attention(q, k, v, mask, segment_ids=ids_j), q, k, v)
        return (out, *vjp(d_out))

    for name, a, b in zip(("out", "dq", "dk", "dv"), got, reference(q, k, v)):
        assert max_err(unlay(a), b) <= (OUT_TOL if name == "out" else GRAD_TOL), (name, max_err(unlay(a), b))

    # shard pairs (q shard a, kv shard b) with an allowed same-document (q, k) pair
    perm = layouts.permutation(layout, s, n).reshape(n, -1)
    dense = masks.dense(mask)[0] & (ids[:, None] == ids[None, :])
    exact = sum(bool(dense[np.ix_(perm[a], perm[b])].any()) for a in range(n) for b in range(n))
    plan = rs.parallel.ring.ring_plan(mask, n, layout, cfg)
    static = int(plan.active.sum())
    if layout == "striped":  # blocks are strided runs: refinement is a safe over-approximation
        assert exact <= calls["fwd"] <= static
    else:  # blocks are runs of consecutive tokens of sorted ids: exact
        assert calls["fwd"] == exact < static, (calls, exact, static)
    assert calls["bwd"] == calls["fwd"]
