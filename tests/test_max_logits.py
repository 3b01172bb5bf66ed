"""Max-logit statistics (``return_max_logits``) of Splash and every context-parallel strategy vs
the dense reference, and the reference vs a float64 numpy oracle.

``max_logits[h]`` is the largest ``scale · q·k`` over the (query, key) pairs head ``h`` attends
(mask and segment ids applied), before the soft-cap, sinks excluded, ``-inf`` for a head that
attends nothing. Forward only (the statistic has no gradient; one test checks that it leaves
the gradients alone), tiny shapes, the xla backend for breadth and the Pallas interpreter for
representative cases.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import ringsplash as rs
from ringsplash import layouts, masks
from ringsplash.parallel import usp_mesh
from ringsplash.splash.config import SplashConfig
from support.masks import MASK_KINDS, make_mask, packed_segments
from support.meshes import mesh

# Measured: every backend / strategy below reproduces the reference's float32 maxima exactly
# (max relative error 0.0: the same float32 q·k dot, then the same multiply by scale). Allowed:
# a few float32 ulps (a different summation order of the d-term dot would stay far below this).
RTOL = 1e-6
BLOCKS = dict(block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128)
XLA = SplashConfig(**BLOCKS, backend="xla")
INTERPRET = SplashConfig(**BLOCKS, backend="interpret",
                         interpret_params=pltpu.InterpretParams(uninitialized_memory="nan"))
# the generic Pallas interpreter: the same kernels as plain JAX ops (no TPU memory model), much cheaper
GENERIC = SplashConfig(**BLOCKS, backend="interpret", interpret_params="generic")
HEAD_CASES = ((4, 2), (4, 1), (4, 4))  # GQA, MQA, MHA


def operands(key, heads, kv_heads, s, d=32):
    kq, kk, kv = jax.random.split(key, 3)
    return (jax.random.normal(kq, (heads, s, d), jnp.float32), jax.random.normal(kk, (kv_heads, s, d), jnp.float32),
            jax.random.normal(kv, (kv_heads, s, d), jnp.float32))


def assert_max_logits(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == np.float32
    assert np.array_equal(np.isneginf(got), np.isneginf(want)), (got, want)
    fin = np.isfinite(want)
    assert np.all(np.isfinite(got[fin]))
    err = np.max(np.abs(got[fin] - want[fin]) / np.abs(want[fin]), initial=0.0)
    print(f"max logits: max relative error {err:.2e}")
    assert err <= RTOL, (got, want)


def empty_head_mask(s: int, heads: int):
    """Causal for every head but the last, which attends nothing at all."""
    nothing = masks.NumpyMask(np.zeros((s, s), bool))
    return masks.MultiHeadMask([masks.CausalMask((s, s))] * (heads - 1) + [nothing])


def reference(q, k, v, mask, seg=None, cap=None):
    ids = None if seg is None else rs.SegmentIds(q=seg, kv=seg)
    return rs.reference_attention(q, k, v, mask, segment_ids=ids, logit_soft_cap=cap, return_max_logits=True)[1]


# ----------------------------------------------------------------------------------------
# the reference against float64 numpy


def test_reference_max_logits_match_a_float64_numpy_oracle(key):
    s, heads, kv_heads = 256, 4, 2
    q, k, v = operands(key, heads, kv_heads, s)
    mask = empty_head_mask(s, heads)
    seg = np.repeat(np.arange(4), s // 4).astype(np.int32)
    ids = rs.SegmentIds(q=jnp.asarray(seg), kv=jnp.asarray(seg))
    sinks = jnp.full((heads,), 50.0)  # larger than every logit: must not show up
    _out, mx = rs.reference_attention(q, k, v, mask, segment_ids=ids, logit_soft_cap=0.5, sinks=sinks, scale=0.3,
                                     return_max_logits=True)
    qn, kn = np.asarray(q, np.float64), np.repeat(np.asarray(k, np.float64), heads // kv_heads, axis=0)
    logits = 0.3 * np.einsum("hqd,hkd->hqk", qn, kn)
    allowed = np.asarray(masks.dense(mask)) & (seg[:, None] == seg[None, :])
    want = np.where(allowed, logits, -np.inf).max(axis=(1, 2))
    assert np.isneginf(want[-1]) and np.all(np.isfinite(want[:-1])) and np.all(want[:-1] > 0.5)  # above the cap
    np.testing.assert_allclose(np.asarray(mx), want, rtol=1e-6)  # float32 dot vs float64: measured 2.4e-7
    _, lse, mx2 = rs.reference_attention(q, k, v, mask, segment_ids=ids, return_residuals=True, scale=0.3,
                                         return_max_logits=True)
    assert lse.shape == (heads, s) and np.array_equal(np.isneginf(mx2), np.isneginf(mx))


# ----------------------------------------------------------------------------------------
# splash_attention, every mask kind; GQA / MQA / soft-cap / segment ids rotate over the kinds


@pytest.mark.slow
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_splash_max_logits_match_reference_xla(key, kind):
    i = MASK_KINDS.index(kind)
    heads, kv_heads = HEAD_CASES[i % 3]
    s = 512
    q, k, v = operands(key, heads, kv_heads, s)
    seg = packed_segments(jax.random.fold_in(key, 1), s) if i % 2 == 0 else None
    cap = 0.5 if i % 3 == 2 else None  # below the logits' maxima: a capped max would differ
    mask = make_mask(kind, s, heads)
    ids = None if seg is None else rs.SegmentIds(q=seg, kv=seg)
    sinks = jnp.full((heads,), 50.0) if i % 2 else None  # above every logit: must not show up
    _out, mx = jax.jit(lambda q, k, v: rs.splash_attention(q, k, v, mask, segment_ids=ids, logit_soft_cap=cap,
                                                          sinks=sinks, config=XLA, return_max_logits=True))(q, k, v)
    assert_max_logits(mx, reference(q, k, v, mask, seg, cap))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["causal_gqa_segments_cap", "numpy_mqa_empty_rows", "empty_head_mha_cap"])
def test_splash_max_logits_match_reference_and_xla_interpret(key, case):
    s = 256
    kind, (heads, kv_heads), segments, cap = {
        "causal_gqa_segments_cap": ("causal", (4, 2), True, 0.5),
        "numpy_mqa_empty_rows": ("numpy", (4, 1), False, None),
        "empty_head_mha_cap": ("empty_head", (4, 4), True, 2.0),
    }[case]
    q, k, v = operands(key, heads, kv_heads, s, d=128)
    mask = empty_head_mask(s, heads) if kind == "empty_head" else make_mask(kind, s, heads)
    seg = packed_segments(jax.random.fold_in(key, 1), s) if segments else None
    ids = None if seg is None else rs.SegmentIds(q=seg, kv=seg)
    got = {}
    # the TPU interpreter (unwritten memory reads as NaN) on the case where a whole head writes nothing;
    # the generic interpreter on the others
    interpret = INTERPRET if kind == "empty_head" else GENERIC
    for name, cfg in (("interpret", interpret), ("xla", XLA)):
        out, _lse, got[name] = rs.splash_attention(q, k, v, mask, segment_ids=ids, logit_soft_cap=cap, config=cfg,
                                                  return_residuals=True, return_max_logits=True)
        assert not np.any(np.isnan(np.asarray(out)))
    want = reference(q, k, v, mask, seg, cap)
    assert_max_logits(got["interpret"], want)
    assert_max_logits(got["xla"], want)
    if kind == "empty_head":
        assert np.isneginf(np.asarray(got["interpret"])[-1])


@pytest.mark.slow
def test_splash_forward_max_logits_per_shard_pair_reduce_to_the_whole(key):
    """``splash_forward(return_max_logits=True)`` on each of 2 x 2 shard pairs (what the ring
    runs): the max over the pairs is the whole sequence's; a pair with nothing attended is -inf."""
    s, n, heads = 256, 2, 2
    q, k, v = operands(key, heads, 1, s, d=128)
    mask = masks.CausalMask((s, s))
    cfg = INTERPRET
    info = rs.build_mask_info(mask, (128, 128), q_shards=n, kv_shards=n)
    sl = lambda x, i: x[:, i * (s // n):(i + 1) * (s // n)]
    pair = {(a, b): rs.splash_forward(sl(q, a), sl(k, b), sl(v, b), info, q_shard=a, kv_shard=b, config=cfg,
                                      return_max_logits=True)[2] for a in range(n) for b in range(n)}
    assert np.all(np.isneginf(np.asarray(pair[0, 1])))  # causal, contiguous: q shard 0 never sees kv shard 1
    whole = jnp.max(jnp.stack(list(pair.values())), axis=0)
    assert_max_logits(whole, reference(q, k, v, mask))


@pytest.mark.slow
def test_max_logits_carry_no_gradient_and_leave_the_gradients_alone(key):
    s = 256
    q, k, v = operands(key, 4, 2, s)
    mask, cap = masks.CausalMask((s, s)), 1.0

    def loss(q, k, v, flag):
        res = rs.splash_attention(q, k, v, mask, logit_soft_cap=cap, config=XLA, return_max_logits=flag)
        out, mx = res if flag else (res, 0.0)
        return jnp.sum(out * jnp.cos(out)) + jnp.sum(mx)  # mx contributes nothing to the gradient

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)
    with_flag, without = grads(q, k, v, True), grads(q, k, v, False)
    for a, b in zip(with_flag, without):
        np.testing.assert_array_equal(a, b)
    outs = jax.jit(lambda q, k, v: (rs.splash_attention(q, k, v, mask, logit_soft_cap=cap, config=XLA),
                                    rs.splash_attention(q, k, v, mask, logit_soft_cap=cap, config=XLA,
                                                        return_max_logits=True)[0]))(q, k, v)
    np.testing.assert_array_equal(*outs)
    only_mx = jax.jit(jax.grad(lambda q: jnp.sum(rs.splash_attention(q, k, v, mask, config=XLA,
                                                                     return_max_logits=True)[1])))(q)
    assert not np.any(np.asarray(only_mx))


# ----------------------------------------------------------------------------------------
# the ring: every device count (2 / 4 / 8) and every layout appear; mask kinds and features rotate

RING_CASES = [(2, "zigzag"), (4, "contiguous"), (4, "striped"), (8, "striped")]


@pytest.mark.slow
@pytest.mark.parametrize("n, layout", RING_CASES, ids=[f"n{n}-{lay}" for n, lay in RING_CASES])
def test_ring_max_logits_match_reference(key, n, layout):
    i = RING_CASES.index((n, layout))
    kind = ("numpy", "composed", "multi_head", "local")[i]
    heads, kv_heads = HEAD_CASES[i % 3]
    s = 1024
    q, k, v = operands(key, heads, kv_heads, s)
    seg = packed_segments(jax.random.fold_in(key, 1), s) if i % 2 == 0 else None
    cap = 0.5 if i % 3 == 1 else None
    mask = make_mask(kind, s, heads)
    lay = lambda x: layouts.permute(x, layout, n, axis=x.ndim - 1 if x.ndim == 1 else 1)
    ids = None if seg is None else rs.SegmentIds(q=lay(seg), kv=lay(seg))
    _out, mx = jax.jit(lambda q, k, v: rs.ring_attention_sharded(
        q, k, v, mask, mesh=mesh(n), axis_name="ctx", segment_ids=ids, layout=layout, logit_soft_cap=cap,
        config=XLA, return_max_logits=True))(lay(q), lay(k), lay(v))
    print(kind, (heads, kv_heads), "segments" if seg is not None else "", cap)
    assert_max_logits(mx, reference(q, k, v, mask, seg, cap))


@pytest.mark.slow
@pytest.mark.parametrize("interpreter, n", [("tpu", 2), ("generic", 4)])
def test_ring_max_logits_interpret_backend_and_empty_head(key, interpreter, n):
    # one 128-block per shard: striped, since a zigzag half-shard of 64 tokens cannot be tiled by the
    # Pallas TPU kernels (splash/blocks.py); zigzag's half-shard merges are backend-independent and
    # covered with backend='xla' above
    s, heads = 128 * n, 4
    config = INTERPRET if interpreter == "tpu" else SplashConfig(**BLOCKS, backend="interpret")  # None: generic
    q, k, v = operands(key, heads, 2, s, d=128)
    mask = empty_head_mask(s, heads)
    seg = packed_segments(jax.random.fold_in(key, 1), s)
    lay = lambda x: layouts.permute(x, "striped", n, axis=x.ndim - 1 if x.ndim == 1 else 1)
    out, mx = jax.jit(lambda q, k, v: rs.ring_attention_sharded(
        q, k, v, mask, mesh=mesh(n), axis_name="ctx", segment_ids=rs.SegmentIds(q=lay(seg), kv=lay(seg)),
        layout="striped", logit_soft_cap=1.0, config=config, return_max_logits=True))(lay(q), lay(k), lay(v))
    assert np.isneginf(np.asarray(mx)[-1]) and not np.any(np.isnan(np.asarray(out)))
    assert_max_logits(mx, reference(q, k, v, mask, seg, 1.0))


# ----------------------------------------------------------------------------------------
# all-gather, Ulysses (heads split over devices: the per-head result is assembled), USP


STRATEGY_CASES = {
    "allgather_n4_zigzag_segments": ("allgather", 4, None, "zigzag", (4, 2), "numpy", True, None),
    "ulysses_n4_multi_head_gqa_repeat": ("ulysses", 4, None, "contiguous", (8, 2), "multi_head", False, 0.5),
    "ulysses_n2_mqa_empty_rows": ("ulysses", 2, None, "striped", (4, 1), "numpy", True, None),
    "usp_2x2_multi_head": ("usp", 4, (2, 2), "zigzag", (4, 2), "multi_head", True, 0.5),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", STRATEGY_CASES)
def test_strategy_max_logits_match_reference(key, case):
    name, n, degrees, layout, (heads, kv_heads), kind, segments, cap = STRATEGY_CASES[case]
    s = 1024
    q, k, v = operands(key, heads, kv_heads, s)
    if kind == "multi_head":  # distinct masks per head (repeating with the heads-per-rank period)
        period = heads // (degrees[0] if degrees else n)
        per = [masks.LocalMask((s, s), window=(8, 0)), masks.CausalMask((s, s))]
        mask = masks.MultiHeadMask((per * heads)[:period] * (heads // period))
    else:
        mask = make_mask(kind, s, heads)
    seg = packed_segments(jax.random.fold_in(key, 1), s) if segments else None
    shards = degrees[1] if name == "usp" else n
    lay = lambda x: layouts.permute(x, layout, shards, axis=x.ndim - 1 if x.ndim == 1 else 1)
    ids = None if seg is None else rs.SegmentIds(q=lay(seg), kv=lay(seg))
    kw = dict(segment_ids=ids, layout=layout, logit_soft_cap=cap, config=XLA, return_max_logits=True)
    if name == "usp":
        fn = lambda q, k, v: rs.usp_attention_sharded(q, k, v, mask, mesh=usp_mesh(*degrees, devices=jax.devices()[:n]),
                                                      ulysses_axis="ulysses", ring_axis="ring", **kw)
    else:
        sharded = {"allgather": rs.allgather_attention_sharded, "ulysses": rs.ulysses_attention_sharded}[name]
        fn = lambda q, k, v: sharded(q, k, v, mask, mesh=mesh(n), axis_name="ctx", **kw)
    _out, mx = jax.jit(fn)(lay(q), lay(k), lay(v))
    want = reference(q, k, v, mask, seg, cap)
    if kind == "multi_head":
        assert len(set(np.round(np.asarray(want), 4))) > 1  # per-head values differ: head order is checked
    assert_max_logits(mx, want)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ring", "ulysses"])
def test_max_logits_inside_user_shard_map_are_replicated(key, name):
    from jax.sharding import PartitionSpec as P

    n, s = 4, 512
    q, k, v = operands(key, 4, 4, s)
    mask = masks.CausalMask((s, s))
    fn = {"ring": rs.ring_attention, "allgather": rs.allgather_attention, "ulysses": rs.ulysses_attention}[name]
    local = lambda q, k, v: fn(q, k, v, mask, axis_name="sp", config=XLA, return_max_logits=True)
    m = mesh(n, "sp")
    seq = P(None, "sp")
    _, mx = jax.jit(jax.shard_map(local, mesh=m, in_specs=(seq,) * 3, out_specs=(seq, P(None)),
                                  check_vma=False))(q, k, v)
    assert_max_logits(mx, reference(q, k, v, mask))


# ----------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize("fn", ["splash", "reference", "ring"])
def test_return_max_logits_must_be_a_bool(fn):
    s = 256
    q = jnp.ones((2, s, 32))
    mask = masks.CausalMask((s, s))
    call = {
        "splash": lambda: rs.splash_attention(q, q, q, mask, config=XLA, return_max_logits="yes"),
        "reference": lambda: rs.reference_attention(q, q, q, mask, return_max_logits=1),
        "ring": lambda: rs.ring_attention_sharded(q, q, q, mask, mesh=mesh(2), axis_name="ctx", config=XLA,
                                                  return_max_logits=None),
    }[fn]
    with pytest.raises(TypeError, match="return_max_logits"):  # jaxtyping (tests) or check_bool
        call()


# ----------------------------------------------------------------------------------------
# TPU compile (libtpu, v5e): the kernel lowers with the extra output, which costs no HBM
# beyond one 128-lane float32 row per (head, q block)


@pytest.mark.tpu_compile
@pytest.mark.parametrize("cap", [None, 30.0], ids=["no_cap", "soft_cap"])
def test_splash_forward_with_max_logits_compiles_for_v5e_within_heads_x_q_blocks(cap):
    from ringsplash import aot

    target, heads, s, block = "v5e:2x2", 8, 8192, 512
    device = jax.sharding.SingleDeviceSharding(aot.topology_devices(target)[0])
    spec = lambda target, heads: jax.ShapeDtypeStruct((heads, s, 128), jnp.bfloat16, sharding=device)
    mask = masks.CausalMask((s, s))
    config = SplashConfig(backend="mosaic_tpu")

    def compile_fwd(flag):
        fn = lambda q, k, v: rs.splash_attention(q, k, v, mask, logit_soft_cap=cap, config=config,
                                                 return_max_logits=flag)
        return aot.compile_report(fn, spec(target, heads), spec(target, 2), spec(target, 2))

    plain, with_max = compile_fwd(False), compile_fwd(True)
    assert "tpu_custom_call" in with_max.hlo_text
    extra_temp = with_max.temp - plain.temp
    extra_out = with_max.out - plain.out
    budget = heads * (s // block) * 128 * 4  # the kernel's [heads, 1, q_blocks * 128] float32 rows
    print(f"extra temp {extra_temp} B, extra output {extra_out} B, budget {budget} B")
    # measured (no cap and soft-cap): extra temp 0 B; extra output 1024 B (f32[8] in its padded TPU layout)
    assert 0 < extra_out <= 4096  # max_logits [heads] float32, at most one padded (8, 128) tile
    assert extra_temp <= budget
