"""All-gather, Ulysses and USP context parallelism on simulated CPU meshes vs the dense reference.

Every case lays the unsharded inputs out in the strategy's token order, runs the strategy's
``*_attention_sharded`` forward and backward in one jit (the output and the VJP of a random
cotangent) and compares out, dq, dk, dv (and d_sinks) in original order with
``reference_attention`` (float32, max abs error <= TOL). Most cases use the plain-jnp Splash
backend (fast on CPU); one per strategy uses the Pallas TPU interpreter.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import ringsplash as rs
from ringsplash import layouts, masks
from ringsplash.parallel import usp_mesh
from support.attention_inputs import max_err
from support.masks import MASK_KINDS, packed_segments
from support.masks import make_mask as ring_mask
from support.meshes import mesh
from support.strategies import INTERPRET, XLA, strategy
from support.tiers import fast_first

# measured max abs error over this file <= 8.1e-6 (dv, float32); ~6x headroom (the bound is 1e-4)
TOL = 5e-5
LAYOUTS = ("contiguous", "zigzag", "striped")
def make_mask(kind: str, s: int, heads: int, period: int):
    """The ring tests' mask of one kind; ``multi_head`` repeats its per-head masks with ``period``
    (the heads per Ulysses rank) so every rank's head group has the same masks."""
    if kind != "multi_head":
        return ring_mask(kind, s, heads)
    shape = (s, s)
    per_head = [masks.LocalMask(shape, window=(64, 64)), masks.CausalMask(shape),
                masks.ChunkedCausalMask(shape, chunk_size=256), masks.CausalMask(shape)]
    return masks.MultiHeadMask(per_head[:period] * (heads // period))


def run_both(key, name, mask, *, layout, n=4, degrees=None, heads=4, kv_heads=2, s=1024, d=32, segments=False,
             sinks=False, cap=None, config=XLA):
    """((out, dq, dk, dv, d_sinks) of the strategy, same of the reference), original order."""
    kq, kk, kv, kd, ks, kseg = jax.random.split(key, 6)
    q = jax.random.normal(kq, (heads, s, d), jnp.float32)
    k = jax.random.normal(kk, (kv_heads, s, d), jnp.float32)
    v = jax.random.normal(kv, (kv_heads, s, d), jnp.float32)
    d_out = jax.random.normal(kd, (heads, s, d), jnp.float32)
    snk = jax.random.normal(ks, (heads,), jnp.float32) if sinks else None
    seg = packed_segments(kseg, s) if segments else None
    fn, shards = strategy(name, n, layout, config, degrees)
    lay = lambda x: layouts.permute(x, layout, shards, axis=x.ndim - 1 if x.ndim == 1 else 1)
    unlay = lambda x: layouts.unpermute(x, layout, shards, axis=1)

    def parallel(q, k, v, snk):
        ids = None if seg is None else rs.SegmentIds(q=lay(seg), kv=lay(seg))
        out, vjp = jax.vjp(lambda q, k, v, snk: fn(q, k, v, ids, snk, mask, cap), lay(q), lay(k), lay(v), snk)
        dq, dk, dv, dsnk = vjp(lay(d_out))
        return unlay(out), unlay(dq), unlay(dk), unlay(dv), dsnk

    def ref(q, k, v, snk):
        ids = None if seg is None else rs.SegmentIds(q=seg, kv=seg)
        fn = lambda q, k, v, snk: rs.reference_attention(q, k, v, mask, segment_ids=ids, logit_soft_cap=cap, sinks=snk)
        out, vjp = jax.vjp(fn, q, k, v, snk)
        return (out, *vjp(d_out))

    return jax.jit(parallel)(q, k, v, snk), jax.jit(ref)(q, k, v, snk)


def assert_close(got, want, tol=TOL):
    errs = {}
    for name, a, b in zip(("out", "dq", "dk", "dv", "d_sinks"), got, want):
        if b is None:
            assert a is None, name
            continue
        assert not np.any(np.isnan(np.asarray(a))), f"{name} has NaN"
        errs[name] = max_err(a, b)
    print("max abs errors:", {k: f"{e:.2e}" for k, e in errs.items()})
    bad = {k: e for k, e in errs.items() if e > tol}
    assert not bad, f"max abs error above {tol}: {bad}"


# ----------------------------------------------------------------------------------------
# every mask type x every layout on all-gather (N = 4, S = 512); on Ulysses (N = 4) and USP (S = 512,
# (2, 4) and (4, 2)) the masks that stress them most (numpy: empty rows; multi_head; composed),
# the layout rotating. Features rotate over the grid so each mask runs
# with and without segment ids, and GQA 8:2 / MQA / kv heads split / soft-cap / sinks all appear.

HEAD_CASES = ((8, 2), (8, 1), (8, 4))  # GQA 8:2 (kv heads repeated), MQA, kv heads split over 4


def features(i: int) -> dict:
    heads, kv_heads = HEAD_CASES[i % 3]
    return dict(heads=heads, kv_heads=kv_heads, segments=i % 2 == 0, sinks=i % 3 == 1,
                cap=30.0 if i % 3 == 2 else None)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_allgather_mask_layout_matches_reference(key, kind, layout):
    kw = features(MASK_KINDS.index(kind) + LAYOUTS.index(layout))
    got, want = run_both(key, "allgather", make_mask(kind, 512, kw["heads"], 2), layout=layout, n=4, s=512, **kw)
    assert_close(got, want)


CP_KINDS = ("causal", "composed", "numpy", "multi_head")
CP_S = 512  # the smallest S every case's layout allows (USP (2, 4) contiguous/striped: 128 tokens per ring shard)


@pytest.mark.slow
@pytest.mark.parametrize("kind", CP_KINDS)
def test_ulysses_mask_matches_reference(key, kind):
    i = CP_KINDS.index(kind)
    kw = features(i)
    # Ulysses over 4 devices: 8 heads -> 2 per device, so multi-head masks repeat with period 2
    got, want = run_both(key, "ulysses", make_mask(kind, CP_S, kw["heads"], 2), layout=LAYOUTS[i % 3], n=4, s=CP_S,
                         **kw)
    assert_close(got, want)


@pytest.mark.parametrize("kind", fast_first(CP_KINDS))
@pytest.mark.slow
def test_usp_mask_matches_reference(key, kind):
    i = CP_KINDS.index(kind)
    a, b = ((2, 4), (4, 2))[i % 2]
    kw = features(i)
    got, want = run_both(key, "usp", make_mask(kind, CP_S, kw["heads"], kw["heads"] // a), layout=LAYOUTS[i % 3],
                         degrees=(a, b), s=CP_S, **kw)
    assert_close(got, want)


# ----------------------------------------------------------------------------------------
# 8 devices, every feature at once, on each strategy and both USP factorisations


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, degrees, layout, heads, kv_heads",
    [
        ("allgather", None, "zigzag", 8, 2),
        ("usp", (4, 2), "striped", 8, 2),
    ],
)
def test_strategy_eight_devices_all_features(key, name, degrees, layout, heads, kv_heads):
    got, want = run_both(key, name, make_mask("causal", 2048, heads, 1), layout=layout, n=8, degrees=degrees,
                         heads=heads, kv_heads=kv_heads, s=2048, segments=True, sinks=True, cap=20.0)
    assert_close(got, want)


# ----------------------------------------------------------------------------------------
# the Pallas TPU kernels (interpreter), tiny


# USP contiguous: causal gives its inner ring an empty shard pair, which the ring computes (as
# zeros) on the interpret backend instead of skipping (the interpreter needs every device in
# every kernel), so this also covers that path inside USP
@pytest.mark.slow
@pytest.mark.parametrize("name, degrees", [("allgather", None), ("ulysses", None), ("usp", (2, 2))])
def test_strategy_interpret_backend_matches_reference(key, name, degrees):
    s, layout = 256, "contiguous"  # one 128-block per shard (USP: per ring member)
    got, want = run_both(key, name, make_mask("causal", s, 4, 1), layout=layout, n=2, degrees=degrees,
                         heads=4, kv_heads=2, s=s, d=128, segments=True, sinks=True, config=INTERPRET)
    assert_close(got, want)


def test_usp_refuses_the_tpu_interpreter_on_its_whole_mesh(monkeypatch):
    """The ring axis has 4 devices, but all 2 x 4 run kernels: with NPROC=8 they would hold every
    client thread (see parallel/_common.py), so refused."""
    monkeypatch.setenv("NPROC", "8")
    s = 1024
    q, k, v = (jnp.ones((h, s, 32)) for h in (4, 2, 2))
    fn = functools.partial(rs.usp_attention_sharded, mask=masks.CausalMask((s, s)),
                           mesh=usp_mesh(2, 4, devices=jax.devices()[:8]), ulysses_axis="ulysses", ring_axis="ring",
                           config=INTERPRET)
    with pytest.raises(ValueError, match=r"usp_attention: .*deadlocks when the mesh's 8 devices"):
        jax.eval_shape(fn, q, k, v)


# ----------------------------------------------------------------------------------------
# inside the caller's own shard_map


@pytest.mark.slow
@pytest.mark.parametrize("name", ["allgather", "ulysses"])
def test_strategy_inside_user_shard_map(key, name):
    n, s, layout = 4, 1024, "zigzag"
    mask = masks.CausalMask((s, s))
    q = jax.random.normal(key, (4, s, 32), jnp.float32)
    fn = {"allgather": rs.allgather_attention, "ulysses": rs.ulysses_attention}[name]
    local = lambda x: fn(x, x, x, mask, axis_name="sp", layout=layout, config=XLA)
    sm = jax.shard_map(local, mesh=mesh(n, "sp"), in_specs=P(None, "sp"), out_specs=P(None, "sp"), check_vma=False)
    out = layouts.unpermute(jax.jit(sm)(layouts.permute(q, layout, n, axis=1)), layout, n, axis=1)
    assert max_err(out, rs.reference_attention(q, q, q, mask)) <= TOL


# ----------------------------------------------------------------------------------------
# bad input


def _qkv(s=1024, heads=8, kv_heads=2, d=32):
    return jnp.ones((heads, s, d)), jnp.ones((kv_heads, s, d)), jnp.ones((kv_heads, s, d))


def test_ulysses_rejects_heads_not_divisible():
    q, k, v = _qkv(heads=6, kv_heads=2)
    with pytest.raises(ValueError, match=r"heads=6 is not divisible by the Ulysses degree 4 .*'ctx'.* "
                                         r"work for heads=6, kv_heads=2: \[1, 2, 6\]"):
        rs.ulysses_attention_sharded(q, k, v, masks.CausalMask((1024, 1024)), mesh=mesh(4), axis_name="ctx",
                                     config=XLA)


def test_ulysses_rejects_kv_heads_that_would_need_unused_copies():
    q, k, v = _qkv(heads=12, kv_heads=3)
    with pytest.raises(ValueError, match=r"kv_heads=3 neither divides nor is divisible by the Ulysses degree 4.*"
                                         r"\[1, 3, 6, 12\]"):
        rs.ulysses_attention_sharded(q, k, v, masks.CausalMask((1024, 1024)), mesh=mesh(4), axis_name="ctx",
                                     config=XLA)


@pytest.mark.parametrize("name", ["allgather", "ulysses"])
def test_strategy_rejects_mesh_without_axis(name):
    q, k, v = _qkv()
    fn = {"allgather": rs.allgather_attention_sharded, "ulysses": rs.ulysses_attention_sharded}[name]
    with pytest.raises(ValueError, match=r"mesh has axes \{'other': 4\}, no axis_name='ctx'"):
        fn(q, k, v, masks.CausalMask((1024, 1024)), mesh=mesh(4, "other"), axis_name="ctx", config=XLA)


def test_usp_rejects_mesh_without_ring_axis():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"no ring_axis='ring'"):
        rs.usp_attention_sharded(q, k, v, masks.CausalMask((1024, 1024)), mesh=mesh(4, "ulysses"),
                                 ulysses_axis="ulysses", ring_axis="ring", config=XLA)


def test_usp_rejects_ulysses_degree_the_heads_do_not_allow():
    q, k, v = _qkv(heads=4, kv_heads=4)
    m = usp_mesh(8, 1, devices=jax.devices()[:8])
    with pytest.raises(ValueError, match=r"Ulysses axis 'ulysses' has 8 devices.*heads=4, kv_heads=4.*"
                                         r"N = 8 x 1 = 8 that work: \[\(1, 8\), \(2, 4\), \(4, 2\)\]"):
        rs.usp_attention_sharded(q, k, v, masks.CausalMask((1024, 1024)), mesh=m, ulysses_axis="ulysses",
                                 ring_axis="ring", config=XLA)


def test_usp_mesh_rejects_factorisation_not_matching_devices():
    with pytest.raises(ValueError, match=r"ulysses x ring = 4 x 4 = 16 must equal the number of devices N=8; "
                                         r"\(ulysses, ring\) factorisations that work: "
                                         r"\[\(1, 8\), \(2, 4\), \(4, 2\)\]"):
        usp_mesh(4, 4, devices=jax.devices()[:8], heads=12, kv_heads=2)


def test_ulysses_rejects_per_head_masks_that_differ_between_ranks():
    q, k, v = _qkv(heads=8, kv_heads=2)
    mask = make_mask("multi_head", 1024, 8, 4)  # period 4, but 2 heads per rank
    with pytest.raises(ValueError, match=r"head group \(heads / degree = 8 / 4 = 2 heads\) the same masks"):
        rs.ulysses_attention_sharded(q, k, v, mask, mesh=mesh(4), axis_name="ctx", config=XLA)


def test_allgather_outside_shard_map_says_what_to_do():
    q, k, v = _qkv(256)
    with pytest.raises(ValueError, match=r"inside jax.shard_map.*allgather_attention_sharded"):
        rs.allgather_attention(q, k, v, masks.CausalMask((256, 256)), axis_name="ctx", config=XLA)
