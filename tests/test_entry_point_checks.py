"""The one validation path: every attention entry point x every bad input; integer operands, soft-caps,
wide segment ids, scale and config errors.

Each entry point is called through ``inspect.unwrap``, i.e. without the test run's
jaxtyping/beartype wrapper, so these tests see what a user without runtime type checking
sees: the library's own error. Add a new entry point to ``ENTRY_POINTS`` (with the inputs it
takes) and every case below runs against it.
"""

import dataclasses
import inspect
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import ringsplash as rs
from ringsplash import masks
from ringsplash.model import ContextParallel, ModelFeatures
from ringsplash.splash.config import SplashConfig
from support.attention_inputs import inputs, max_err

S, HEADS, KV_HEADS, D = 256, 2, 1, 16
N = 2  # ring devices in the bad-input matrix (each shard holds 128 tokens)
XLA = SplashConfig(block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128, backend="xla")
CAUSAL = masks.CausalMask((S, S))


def _mesh(n):
    return jax.make_mesh((n,), ("ctx",), devices=jax.devices()[:n], axis_types=(AxisType.Auto,))


def _unchecked(fn):
    return inspect.unwrap(fn)


# ----------------------------------------------------------------------------------------
# entry points: each takes (q, k, v, **kw) with kw among FEATURES it lists


def _reference(q, k, v, mask=CAUSAL, **kw):
    return _unchecked(rs.reference_attention)(q, k, v, mask, **kw)


def _splash(q, k, v, mask=CAUSAL, config=XLA, **kw):
    return _unchecked(rs.splash_attention)(q, k, v, mask, config=config, **kw)


def _info(transpose=False):
    return rs.build_mask_info(CAUSAL, (128, 128), transpose=transpose)


def _splash_forward(q, k, v, config=XLA, **kw):
    return _unchecked(rs.splash_forward)(q, k, v, _info(), config=config, **kw)


def _splash_backward(q, k, v, config=XLA, **kw):
    shape = getattr(q, "shape", (HEADS, S, D))
    d_out = jnp.ones(shape, jnp.float32)
    lse = delta = jnp.zeros(shape[:2], jnp.float32)
    return _unchecked(rs.splash_backward)(q, k, v, d_out, lse, delta, _info(), _info(True), config=config, **kw)


def _ring(q, k, v, mask=CAUSAL, config=XLA, segment_ids=None, sinks=None, **kw):
    ring = _unchecked(rs.ring_attention)

    def local(q, k, v, segment_ids, sinks):
        return ring(q, k, v, mask, axis_name="ctx", segment_ids=segment_ids, sinks=sinks, config=config, **kw)

    seq = P(None, "ctx")
    seg_spec = jax.tree.map(lambda _: P("ctx"), segment_ids)  # the structure given, right or wrong
    specs = (seq, seq, seq, seg_spec, None if sinks is None else P())
    return jax.shard_map(local, mesh=_mesh(N), in_specs=specs, out_specs=seq, check_vma=False)(
        q, k, v, segment_ids, sinks)


def _ring_sharded(q, k, v, mask=CAUSAL, config=XLA, **kw):
    return _unchecked(rs.ring_attention_sharded)(q, k, v, mask, mesh=_mesh(N), axis_name="ctx", config=config, **kw)


def _in_shard_map(fn, mesh, seq_axes, q, k, v, segment_ids, sinks, **axis_kw):
    def local(q, k, v, segment_ids, sinks):
        return fn(q, k, v, segment_ids=segment_ids, sinks=sinks, **axis_kw)

    seq = P(None, seq_axes)
    seg_spec = jax.tree.map(lambda _: P(seq_axes), segment_ids)
    specs = (seq, seq, seq, seg_spec, None if sinks is None else P())
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=seq, check_vma=False)(
        q, k, v, segment_ids, sinks)


def _strategy(name):
    """The in-shard_map entry point ``rs.<name>`` on a 2-device axis (USP: 2 x 1)."""

    def call(q, k, v, mask=CAUSAL, config=XLA, segment_ids=None, sinks=None, **kw):
        fn = _unchecked(getattr(rs, name))
        if name == "usp_attention":
            mesh = jax.make_mesh((N, 1), ("u", "r"), devices=jax.devices()[:N], axis_types=(AxisType.Auto,) * 2)
            return _in_shard_map(lambda *a, **b: fn(*a, mask, config=config, **kw, **b), mesh, ("r", "u"),
                                 q, k, v, segment_ids, sinks, ulysses_axis="u", ring_axis="r")
        return _in_shard_map(lambda *a, **b: fn(*a, mask, config=config, **kw, **b), _mesh(N), "ctx",
                             q, k, v, segment_ids, sinks, axis_name="ctx")

    return call


def _strategy_sharded(name):
    def call(q, k, v, mask=CAUSAL, config=XLA, **kw):
        fn = _unchecked(getattr(rs, name))
        if name == "usp_attention_sharded":
            mesh = jax.make_mesh((N, 1), ("u", "r"), devices=jax.devices()[:N], axis_types=(AxisType.Auto,) * 2)
            return fn(q, k, v, mask, mesh=mesh, ulysses_axis="u", ring_axis="r", config=config, **kw)
        return fn(q, k, v, mask, mesh=_mesh(N), axis_name="ctx", config=config, **kw)

    return call


class Entry(NamedTuple):
    fn: object
    features: frozenset  # optional inputs it takes besides q, k, v


ALL = frozenset({"mask", "segment_ids", "scale", "logit_soft_cap", "sinks", "config"})
ENTRY_POINTS = {
    "reference_attention": Entry(_reference, ALL - {"config"}),
    "splash_attention": Entry(_splash, ALL),
    "splash_forward": Entry(_splash_forward, ALL - {"mask", "sinks"}),
    "splash_backward": Entry(_splash_backward, ALL - {"mask", "sinks"}),
    "ring_attention": Entry(_ring, ALL),
    "ring_attention_sharded": Entry(_ring_sharded, ALL),
    **{name: Entry(_strategy(name), ALL) for name in ("allgather_attention", "ulysses_attention", "usp_attention")},
    **{f"{name}_sharded": Entry(_strategy_sharded(f"{name}_sharded"), ALL)
       for name in ("allgather_attention", "ulysses_attention", "usp_attention")},
}


def _qkv(dtype=jnp.float32):
    q, k, v, _, _ = inputs(jax.random.key(0), HEADS, KV_HEADS, S, S, d=D)
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


IDS = jnp.arange(S, dtype=jnp.int32) // 64


class Bad(NamedTuple):
    feature: str | None  # the input it needs (None: q/k/v only)
    qkv: object  # () -> (q, k, v)
    kwargs: dict
    error: type
    match: str


BAD = {
    # integer q/k/v (the reference and the ring returned a silently wrong int output)
    "int_qkv": Bad(None, lambda: _qkv(jnp.int32), {}, TypeError,
                   r"q must be a floating-point array, got q\.dtype=int32"),
    "int_v": Bad(None, lambda: (*_qkv()[:2], _qkv(jnp.int32)[2]), {}, TypeError,
                 r"v must be a floating-point array, got v\.dtype=int32"),
    "bool_k": Bad(None, lambda: (_qkv()[0], _qkv(bool)[1], _qkv()[2]), {}, TypeError,
                  r"k must be a floating-point array, got k\.dtype=bool"),
    "q_rank": Bad(None, lambda: (_qkv()[0][0], *_qkv()[1:]), {}, ValueError, r"q must be \[heads, length, head_dim\]"),
    # one dtype for q, k, v at every entry point: the reference refuses what the kernels refuse
    "mixed_dtype": Bad(None, lambda: (_qkv(jnp.bfloat16)[0], *_qkv()[1:]), {}, TypeError,
                       r"q, k, v must share one dtype, got q\.dtype=bfloat16, k\.dtype=float32, v\.dtype=float32"),
    "gqa": Bad(None, lambda: (jnp.ones((3, S, D)), jnp.ones((2, S, D)), jnp.ones((2, S, D))), {}, ValueError,
               r"kv_heads=2 must divide heads=3"),
    # v has a head size of its own (MLA), but k's kv_heads and kv_len; the error names both shapes
    "v_kv_len": Bad(None, lambda: (*_qkv()[:2], jnp.ones((KV_HEADS, S // 2, 2 * D))), {}, ValueError,
                    rf"v must be \[kv_heads, kv_len, head_dim_v\] with k's kv_heads and kv_len: k has shape "
                    rf"\({KV_HEADS}, (\d+), {D}\) = \[kv_heads={KV_HEADS}, kv_len=\1, head_dim={D}\], "
                    rf"got v\.shape=\({KV_HEADS}, \d+, {2 * D}\)"),  # lengths: local ones in shard_map
    "v_kv_heads": Bad(None, lambda: (*_qkv()[:2], jnp.ones((KV_HEADS + 1, S, D // 2))), {}, ValueError,
                      rf"k's kv_heads and kv_len: .*, got v\.shape=\({KV_HEADS + 1}, \d+, {D // 2}\)"),
    # logit_soft_cap 0 / negative / non-finite (uniform attention, NaN at a zero logit)
    "soft_cap_zero": Bad("logit_soft_cap", _qkv, dict(logit_soft_cap=0), ValueError,
                         r"logit_soft_cap must be > 0, got logit_soft_cap=0\.0"),
    "soft_cap_negative": Bad("logit_soft_cap", _qkv, dict(logit_soft_cap=-30.0), ValueError,
                             r"logit_soft_cap must be > 0, got logit_soft_cap=-30\.0"),
    "soft_cap_inf": Bad("logit_soft_cap", _qkv, dict(logit_soft_cap=float("inf")), ValueError,
                        r"logit_soft_cap must be finite, got logit_soft_cap=inf"),
    "soft_cap_str": Bad("logit_soft_cap", _qkv, dict(logit_soft_cap="30"), TypeError,
                        r"logit_soft_cap must be a real number, got logit_soft_cap='30'"),
    # scale errors name scale
    "scale_str": Bad("scale", _qkv, dict(scale="a"), TypeError, r"scale must be a real number, got scale='a'"),
    "scale_zero": Bad("scale", _qkv, dict(scale=0.0), ValueError, r"scale must be > 0, got scale=0\.0"),
    "scale_nan": Bad("scale", _qkv, dict(scale=float("nan")), ValueError, r"scale must be finite, got scale=nan"),
    # a config of the wrong type is named before anything reads its attributes
    "config_dict": Bad("config", _qkv, dict(config={"block_q": 128}), TypeError,
                       r"config must be a SplashConfig, got config=\{'block_q': 128\} \(dict\)"),
    "config_none": Bad("config", _qkv, dict(config=None), TypeError, r"config must be a SplashConfig, got config=None"),
    # sinks
    "sinks_shape": Bad("sinks", _qkv, dict(sinks=jnp.zeros((HEADS + 1,))), ValueError,
                       r"sinks must have shape \(heads,\)=\(2,\), got \(3,\)"),
    "sinks_int": Bad("sinks", _qkv, dict(sinks=jnp.zeros((HEADS,), jnp.int32)), TypeError,
                     r"sinks must be a floating-point array, got sinks\.dtype=int32"),
    # segment ids (the wide-id value rule is tested numerically below)
    "segment_ids_float": Bad("segment_ids", _qkv, dict(segment_ids=rs.SegmentIds(IDS, IDS.astype(jnp.float32))),
                             TypeError, r"segment_ids\.kv must be an integer array, got dtype float32"),
    "segment_ids_bool": Bad("segment_ids", _qkv, dict(segment_ids=rs.SegmentIds(IDS > 1, IDS)),
                            TypeError, r"segment_ids\.q must be an integer array, got dtype bool"),
    "segment_ids_tuple": Bad("segment_ids", _qkv, dict(segment_ids=(IDS, IDS)), TypeError,
                             r"segment_ids must be ringsplash\.SegmentIds"),
    # mask
    "mask_array": Bad("mask", _qkv, dict(mask=np.ones((S, S), bool)), TypeError,
                      r"mask must be a ringsplash\.masks\.Mask or MultiHeadMask, got ndarray"),
    "mask_shape": Bad("mask", _qkv, dict(mask=masks.CausalMask((S, 2 * S))), ValueError,
                      rf"mask shape \({S}, {2 * S}\) must equal \(q_len, kv_len\)=\({S}, {S}\)"),
    "multihead_heads": Bad("mask", _qkv, dict(mask=masks.MultiHeadMask([CAUSAL] * 3)), ValueError,
                           r"MultiHeadMask has 3 heads, q has heads=2"),
}

CASES = [
    pytest.param(entry, bad, id=f"{name}-{case}")
    for name, entry in ENTRY_POINTS.items()
    for case, bad in BAD.items()
    if bad.feature is None or bad.feature in entry.features
]


@pytest.mark.parametrize("entry, bad", CASES)
def test_entry_point_rejects_bad_input(entry, bad):
    with pytest.raises(bad.error, match=bad.match):
        entry.fn(*bad.qkv(), **bad.kwargs)


DTYPE_MIXES = [("bfloat16", "float32", "float32"), ("float32", "float32", "bfloat16"), ("float32", "bfloat16", "float32"),
               ("float16", "bfloat16", "bfloat16")]


@pytest.mark.parametrize("dtypes", DTYPE_MIXES, ids="-".join)
def test_reference_and_splash_refuse_a_dtype_mix_with_one_message(dtypes):
    """One rule, one message: reference_attention accepted bf16 q with float32 k / v (upcasting
    silently) while splash_attention refused it."""
    q, k, v = (x.astype(dt) for x, dt in zip(_qkv(), dtypes, strict=True))
    messages = []
    for entry in (_reference, _splash):
        with pytest.raises(TypeError) as error:
            entry(q, k, v)
        messages.append(str(error.value))
    assert messages[0] == messages[1]
    assert messages[0].startswith(f"q, k, v must share one dtype, got q.dtype={dtypes[0]}, k.dtype={dtypes[1]}, "
                                  f"v.dtype={dtypes[2]}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_reference_and_splash_accept_matched_dtypes(dtype):
    q, k, v = _qkv(dtype)
    ref, out = _reference(q, k, v), _splash(q, k, v)
    assert ref.dtype == out.dtype == dtype
    assert float(jnp.max(jnp.abs(ref.astype(jnp.float32) - out.astype(jnp.float32)))) < (1e-5 if dtype == jnp.float32
                                                                                           else 2e-2)


def test_config_type_is_checked_before_lengths():
    """ring_attention_sharded(config=<dict>) raised AttributeError from a length check."""
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"config must be a SplashConfig, got config=\{\} \(dict\)"):
        _unchecked(rs.ring_attention_sharded)(q, k, v, CAUSAL, mesh=_mesh(8), axis_name="ctx", config={})


def test_every_entry_point_is_in_the_matrix():
    """A new public attention function (e.g. another strategy) must join ENTRY_POINTS (the
    factories ``make_*_attention`` build objects; tests/test_factories.py checks them)."""
    public = {n for n in rs.__all__ if (n.endswith(("_attention", "_attention_sharded")) or n.startswith("splash_"))
              and not n.startswith("make_")}
    assert public == set(ENTRY_POINTS)


# ----------------------------------------------------------------------------------------
# segment ids wider than int32 are never merged silently


def _documents(dtype, offset):
    """Four documents of S/4 tokens whose ids differ only above bit 31 (when offset = 2**32)."""
    ids = np.arange(S) // (S // 4)
    wide = (ids % 2).astype(dtype) * dtype(offset) + (ids // 2).astype(dtype)  # 0, 2**32, 1, 2**32 + 1
    separate = jnp.asarray(ids, jnp.int32)
    return rs.SegmentIds(q=wide.astype(dtype), kv=wide.astype(dtype)), rs.SegmentIds(q=separate, kv=separate)


FULL = masks.FullMask((S, S))
SHARDED_STRATEGIES = ("ring_attention_sharded", "allgather_attention_sharded", "ulysses_attention_sharded",
                      "usp_attention_sharded")
# Numerically: the single-device entry points, and one strategy end to end (Ulysses, the cheapest:
# ~2 s under jit; an eager shard_map runs its body op by op, 12-27 s a strategy). The ids are closed
# over, so concrete at trace time and renumbered as in an eager call. Every strategy's ids are
# checked where they enter its shard_map (test_sharded_strategies_renumber_wide_ids_before_shard_map).
SEGMENT_ENTRY_POINTS = {
    "reference_attention": lambda q, k, v, seg: _reference(q, k, v, FULL, segment_ids=seg),
    "splash_attention": lambda q, k, v, seg: _splash(q, k, v, FULL, segment_ids=seg),
    "splash_forward": lambda q, k, v, seg: rs.splash_forward(q, k, v, rs.build_mask_info(FULL, (128, 128)),
                                                             segment_ids=seg, config=XLA)[0],
    "ulysses_attention_sharded": lambda q, k, v, seg: jax.jit(
        lambda q, k, v: _strategy_sharded("ulysses_attention_sharded")(q, k, v, FULL, segment_ids=seg))(q, k, v),
}


# Every entry point with int64 ids; every wide dtype on the cheap single-device entry points (the
# strategies renumber ids through the same check; their dtype matrix is checked at the shard_map below).
WIDE_DTYPES = [(np.int64, 2**32), (np.uint64, 2**63), (np.uint32, 2**31)]
SINGLE_DEVICE = ("reference_attention", "splash_attention", "splash_forward")
# fast tier: int64 ids on the reference and on splash_forward; every other case compiles another program (slow)
FAST_WIDE = {("reference_attention", np.int64), ("splash_forward", np.int64)}
WIDE_CASES = [pytest.param(name, *dt, marks=() if (name, dt[0]) in FAST_WIDE else pytest.mark.slow)
              for name in SEGMENT_ENTRY_POINTS for dt in WIDE_DTYPES if dt == WIDE_DTYPES[0] or name in SINGLE_DEVICE]


@pytest.mark.parametrize("name, dtype, offset", WIDE_CASES)
def test_wide_segment_ids_stay_apart(name, dtype, offset):
    """int64 / uint64 / uint32 numpy ids that differ only in high bits give the answer of the
    separated documents (int32 ids 0..3), never that of merged ones (the int32 cast of the
    64-bit ids merges documents 0+1 and 2+3)."""
    wide, separate = _documents(dtype, offset)
    q, k, v = _qkv()
    got = SEGMENT_ENTRY_POINTS[name](q, k, v, wide)
    want = rs.reference_attention(q, k, v, FULL, segment_ids=separate)
    merged = rs.reference_attention(q, k, v, FULL, segment_ids=rs.SegmentIds(separate.q // 2, separate.kv // 2))
    assert max_err(merged, want) > 0.1  # a merge would be visible
    # measured 0.0 for every entry point and dtype; 1e-6 allows float32 reassociation only
    assert max_err(got, want) < 1e-6


def _operands_of_shard_map(monkeypatch, call):
    """Run ``call()`` with ``jax.shard_map`` spied on; return the operands of its one shard_map,
    which is traced (``jax.eval_shape``: the local function sees the ids' shapes and dtypes), not
    compiled or run. The strategy itself runs eagerly, so the ids it hands over are concrete."""
    real, calls = jax.shard_map, []

    def spy(f, **kw):
        mapped = real(f, **kw)

        def traced(*args):
            calls.append(args)
            return jax.eval_shape(mapped, *args)

        return traced

    monkeypatch.setattr(jax, "shard_map", spy)
    call()
    (operands,) = calls
    return operands


@pytest.mark.parametrize("dtype, offset", WIDE_DTYPES)
@pytest.mark.parametrize("name", SHARDED_STRATEGIES)
def test_sharded_strategies_renumber_wide_ids_before_shard_map(monkeypatch, name, dtype, offset):
    """Every ``*_attention_sharded`` hands its shard_map int32 ids that are equal exactly where
    the wide ids are equal: the four documents, which differ only above bit 31, stay four (an
    int32 cast of the 64-bit ids merges them pairwise, as test_wide_segment_ids_stay_apart shows
    numerically). The shard_map is only traced, so the strategy's attention is not compiled."""
    wide, separate = _documents(dtype, offset)
    assert int(wide.q.max()) > np.iinfo(np.int32).max  # a plain int32 cast cannot hold these ids
    q, k, v = _qkv()
    operands = _operands_of_shard_map(
        monkeypatch, lambda: _strategy_sharded(name)(q, k, v, FULL, segment_ids=wide))
    (ids,) = [x for x in operands if isinstance(x, rs.SegmentIds)]
    assert ids.q.dtype == ids.kv.dtype == np.int32
    same = lambda seg: np.asarray(seg.q)[:, None] == np.asarray(seg.kv)[None, :]
    assert np.array_equal(same(wide), same(separate))  # the wide ids are the four separate documents
    assert np.array_equal(same(ids), same(separate))


def test_traced_wide_segment_ids_are_rejected():
    """Inside a traced computation int64 ids cannot be renumbered: a clear error, not a cast."""
    q, k, v = _qkv()
    with jax.enable_x64(True):
        ids = jnp.arange(S, dtype=jnp.int64)
        for fn in (_reference, _splash):
            with pytest.raises(TypeError, match=r"segment_ids\.q has dtype int64.*pass int32 segment ids"):
                jax.jit(lambda a, b: fn(q, k, v, segment_ids=rs.SegmentIds(a, b)))(ids, ids)  # noqa: B023


def test_traced_uint32_segment_ids_bitcast_exactly():
    wide, separate = _documents(np.uint32, 2**31)
    q, k, v = _qkv()
    got = jax.jit(lambda a, b: _splash(q, k, v, FULL, segment_ids=rs.SegmentIds(a, b)))(
        jnp.asarray(wide.q), jnp.asarray(wide.kv))
    want = rs.reference_attention(q, k, v, FULL, segment_ids=separate)
    assert max_err(got, want) < 1e-6  # measured 0.0; 1e-6 allows float32 reassociation only


# ----------------------------------------------------------------------------------------
# the ring fits its blocks to its shards


@pytest.mark.slow
def test_ring_default_config_fits_short_shards():
    """S = 2048 on 8 devices with a default SplashConfig (512 blocks; zigzag half-shards of 128
    tokens, refused before): the ring shrinks its blocks and matches the reference, forward and
    gradients (contiguous shards of 256 are covered by test_fit_ring_blocks_shrinks_like_splash)."""
    s, n, layout = 2048, 8, "zigzag"
    q, k, v, d_out, _ = inputs(jax.random.key(1), 2, 1, s, s, d=16)
    mask = masks.CausalMask((s, s))
    perm = rs.layouts.permutation(layout, s, n)
    inv = rs.layouts.inverse_permutation(layout, s, n)

    def ring(q, k, v):
        out = rs.ring_attention_sharded(q[:, perm], k[:, perm], v[:, perm], mask, mesh=_mesh(n), axis_name="ctx",
                                        layout=layout, config=SplashConfig())
        return out[:, inv]

    def out_and_grads(fn):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(d_out)

    got_out, got_grads = jax.jit(lambda: out_and_grads(ring))()
    want_out, want_grads = out_and_grads(lambda q, k, v: rs.reference_attention(q, k, v, mask))
    assert max_err(got_out, want_out) < 3e-6  # measured 3.5e-7 in float32; < 10x headroom
    for g, w in zip(got_grads, want_grads):
        assert max_err(g, w) < 5e-5  # measured <= 6.7e-6 (dk) in float32; < 10x headroom


def test_fit_ring_blocks_shrinks_like_splash():
    from ringsplash.parallel.ring_plan import fit_ring_blocks

    assert fit_ring_blocks(2048, 8, "zigzag", SplashConfig()).block_shape == (128, 128)
    assert fit_ring_blocks(2048, 8, "contiguous", SplashConfig()).block_shape == (256, 256)
    assert fit_ring_blocks(8192, 8, "contiguous", SplashConfig()).block_shape == (512, 512)
    fit = fit_ring_blocks(3 * 256 * 8, 8, "contiguous", SplashConfig(block_kv=512, block_kv_compute=256))
    assert fit.block_shape == (256, 256) and fit.config.block_kv_compute == 256  # gcd(512, 768)
    fit = fit_ring_blocks(3 * 128 * 8, 8, "contiguous", SplashConfig(block_kv=768, block_kv_compute=256))
    assert fit.block_shape == (384, 384) and fit.config.block_kv_compute == 128  # 256 does not tile 384
    assert fit_ring_blocks(64 * 8, 8, "striped", SplashConfig()).block_shape == (64, 64)  # whole short shard


def test_ring_impossible_shape_names_a_config_that_works():
    from ringsplash.parallel.ring_plan import fit_ring_blocks

    s, n = 8 * 600, 8  # shards of 600 tokens: no multiple of 128 <= 512 tiles them
    q = jnp.ones((2, s, 16))
    expected = (
        "ring attention over 8 devices (layout 'contiguous', S // 8 = 4800 // 8 = 600 tokens per shard): "
        "SplashConfig.block_q=512 cannot tile the 600-token shard: a block is a multiple of 128 dividing the shard, "
        "or the whole shard when it is shorter than the block. Pass SplashConfig(block_q=640, block_kv=640, "
        "block_q_dkv=640, block_kv_dkv=640) (blocks shrink to the 600-token shard), or use S divisible by "
        "8 x 128 = 1024 (e.g. S=5120)"
    )
    with pytest.raises(ValueError, match=re.escape(expected) + "$"):
        _unchecked(rs.ring_attention_sharded)(q, q[:1], q[:1], masks.CausalMask((s, s)), mesh=_mesh(n),
                                              axis_name="ctx")
    # what it suggests works
    good = SplashConfig(block_q=640, block_kv=640, block_q_dkv=640, block_kv_dkv=640)
    assert fit_ring_blocks(s, n, "contiguous", good).block_shape == (600, 600)
    assert fit_ring_blocks(5120, n, "contiguous", SplashConfig()).block_shape == (128, 128)


# ----------------------------------------------------------------------------------------
# one block rule on every path (splash/blocks.py)


def test_every_path_fits_blocks_by_one_rule():
    """A configured block that does not divide a length shrinks to a multiple of 128 that does
    (was refused by splash_attention, all-gather and Ulysses while the ring shrank); a short
    length is one whole block; a part that no block lowers for is refused on every path."""
    from ringsplash.splash.blocks import Extent, fit_blocks

    cfg = SplashConfig(block_q=512, block_kv=512, block_kv_compute=256, block_q_dkv=512, block_kv_dkv=512)
    whole = lambda n: Extent(n, n, "q_len")
    fit = fit_blocks(cfg, q=whole(768), kv=whole(768), what="t")
    assert fit.block_shape == (256, 256) and fit.config.block_kv_compute == 256  # gcd(512, 768)
    assert fit_blocks(cfg, q=whole(250), kv=whole(250), what="t").block_shape == (250, 250)  # whole array
    with pytest.raises(ValueError, match=r"^t: SplashConfig.block_q=512 cannot tile the 1000-token q_len: .*"
                                         r"Pass SplashConfig\(block_q=1024, .*, or use S divisible by 128$"):
        fit_blocks(cfg, q=whole(1000), kv=whole(1000), what="t", length_hint="use S divisible by 128")
    half = Extent(125, 250, "zigzag half-shard")  # part of an array: must itself be a multiple of 128
    with pytest.raises(ValueError, match=r"cannot tile the 125-token zigzag half-shard: .*250-token array"):
        fit_blocks(cfg, q=half, kv=half, what="t")
    xla = dataclasses.replace(cfg, backend="xla")  # plain XLA, no TPU tiling: any shorter part is one block
    assert fit_blocks(xla, q=half, kv=half, what="t").block_shape == (125, 125)
    fit = fit_blocks(SplashConfig(block_q=256, block_kv=256, block_kv_compute=128), q=whole(384), kv=whole(200),
                     what="t")
    assert fit.block_shape == (128, 200) and fit.config.block_kv_compute == 256  # 128 does not tile 200: whole


# allgather: ~6 s alone (8-12 s in the 2-core fast tier), over the fast tier's 5 s budget
@pytest.mark.parametrize("strategy", ["splash", pytest.param("allgather", marks=pytest.mark.slow), "ulysses"])
@pytest.mark.slow
def test_a_length_blocks_do_not_divide_runs_on_every_path(strategy):
    """S = 768 with 512 blocks (refused before on these three paths) runs with 256 blocks and
    matches the reference, as the ring does."""
    s, n = 768, 2
    q, k, v, _, _ = inputs(jax.random.key(7), 2, 2, s, s, d=16)
    mask = masks.CausalMask((s, s))
    cfg = SplashConfig(backend="xla")
    if strategy == "splash":
        got = rs.splash_attention(q, k, v, mask, config=cfg)
    else:
        fn = rs.allgather_attention_sharded if strategy == "allgather" else rs.ulysses_attention_sharded
        got = fn(q, k, v, mask, mesh=_mesh(n), axis_name="ctx", config=cfg)
    assert max_err(got, rs.reference_attention(q, k, v, mask)) < 3e-6  # measured <= 4e-7 in float32; < 10x


def test_model_config_accepts_what_splash_attention_accepts():
    from ringsplash.model import TransformerConfig

    base = dict(vocab_size=32, d_model=64, num_layers=1, num_heads=4)
    assert TransformerConfig(**base, context_parallel=ContextParallel("splash"), max_seq_len=256).max_seq_len == 256  # refused before
    assert TransformerConfig(**base, context_parallel=ContextParallel("splash"), max_seq_len=768).max_seq_len == 768
    # a length the 128-token lanes do not tile: the model pads it inside (tests/test_model.py), the config accepts it
    assert TransformerConfig(**base, context_parallel=ContextParallel("splash"), max_seq_len=1000).max_seq_len == 1000
    # the context-parallel strategies: the trainer pads a length they do not tile (test_context_parallel_lengths.py)
    ring = dict(context_parallel=ContextParallel("ring", ring_size=4), max_seq_len=1000)
    assert TransformerConfig(**base, **ring).padded_seq_len(1000) == 1024
    # ... except under a fixed-shape Mask, which serves its own length only
    with pytest.raises(ValueError, match=r"125-token zigzag half-shard.*e.g. S=1024\), or SplashConfig\(backend='xla'\)"):
        TransformerConfig(**base, **ring, mask=masks.CausalMask((1000, 1000)))


# ----------------------------------------------------------------------------------------
# configs and entry points: a bad string option, out-of-range number or wrong type is an
# error naming the argument (one validation path: ringsplash._internal.checks)


def _train_config(**kw):
    from ringsplash import train

    return train.TrainConfig(**kw)


def _model_config(**kw):
    from ringsplash.model import TransformerConfig

    return TransformerConfig(**{**dict(vocab_size=64, d_model=32, num_layers=2, num_heads=2, max_seq_len=S), **kw})


def _ring_sharded(**kw):
    q, k, v, _, _ = inputs(jax.random.key(0), HEADS, KV_HEADS, S, S, d=D)
    return rs.ring_attention_sharded(q, k, v, CAUSAL, mesh=_mesh(N), axis_name="ctx", config=XLA, **kw)


def _schedule(**kw):
    return rs.ring_schedule(CAUSAL, kw.pop("num_shards", N), kw.pop("layout", "zigzag"), XLA,
                            **{**dict(heads=HEADS, kv_heads=KV_HEADS), **kw})


def _experiment_config(script: str, **kw):
    """The experiment script's ``Config`` (loaded from experiments/) built with ``kw``."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "experiments" / f"{script}.py"
    spec = importlib.util.spec_from_file_location(f"_experiment_{script}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return (getattr(module, "DemoConfig", None) or module.Config)(**kw)


CONFIG_CASES = [  # (id, call, argument the error must name)
    ("splash backend", lambda: SplashConfig(backend="tpu"), "backend"),
    ("splash probs_dtype", lambda: SplashConfig(probs_dtype="bf16"), "probs_dtype"),
    ("splash block_q not a multiple", lambda: SplashConfig(block_q=100), "block_q"),
    ("splash block_kv str", lambda: SplashConfig(block_kv="512"), "block_kv"),
    ("model strategy", lambda: _model_config(context_parallel=ContextParallel(strategy="flash")), "strategy"),
    ("model mask", lambda: _model_config(mask="triangle"), "mask"),
    ("model remat", lambda: _model_config(remat="yes"), "remat"),
    ("model param_dtype", lambda: _model_config(param_dtype="fp32"), "param_dtype"),
    ("model layout", lambda: ContextParallel("ring", layout="yes"), "layout"),
    ("model ring_axis", lambda: ContextParallel("ring", ring_axis=3), "ring_axis"),
    ("model ulysses_axis", lambda: ContextParallel("ulysses", ulysses_axis=("a", "b")), "ulysses_axis"),
    ("model context_parallel type", lambda: _model_config(context_parallel="ring"), "context_parallel"),
    ("model features type", lambda: _model_config(features={"qk_norm": True}), "features"),
    ("model sinks str", lambda: _model_config(sinks="yes"), "sinks"),
    ("model tie_embeddings int", lambda: ModelFeatures(tie_embeddings=1), "tie_embeddings"),
    ("model qk_norm", lambda: _model_config(features=ModelFeatures(qk_norm="no")), "qk_norm"),
    ("model d_model 0", lambda: _model_config(d_model=0), "d_model"),
    ("model rope_theta str", lambda: _model_config(rope_theta="1e4"), "rope_theta"),
    ("model attention_dropout 1", lambda: _model_config(attention_dropout=1.0), "attention_dropout"),
    ("train learning_rate negative", lambda: _train_config(learning_rate=-1e-3), "learning_rate"),
    ("train learning_rate str", lambda: _train_config(learning_rate="3e-3"), "learning_rate"),
    ("train min_lr_ratio > 1", lambda: _train_config(min_lr_ratio=1.5), "min_lr_ratio"),
    ("train weight_decay < 0", lambda: _train_config(weight_decay=-0.1), "weight_decay"),
    ("train b1 = 1", lambda: _train_config(b1=1.0), "b1"),
    ("train b2 None", lambda: _train_config(b2=None), "b2"),
    ("train grad_clip 0", lambda: _train_config(grad_clip=0.0), "grad_clip"),
    ("train seed float", lambda: _train_config(seed=1.5), "seed"),
    ("train checkpoint_every < 0", lambda: _train_config(checkpoint_every=-1), "checkpoint_every"),
    ("train checkpoint_every str", lambda: _train_config(checkpoint_every="10"), "checkpoint_every"),
    ("train progress str", lambda: _train_config(progress="yes"), "progress"),
    ("train fsdp int", lambda: _train_config(fsdp=1), "fsdp"),
    ("train log_max_logits", lambda: _train_config(log_max_logits="no"), "log_max_logits"),
    ("train steps 0", lambda: _train_config(steps=0), "steps"),
    ("build_mask_info transpose str", lambda: rs.build_mask_info(CAUSAL, (128, 128), transpose="yes"), "transpose"),
    ("build_mask_info transpose None", lambda: rs.build_mask_info(CAUSAL, (128, 128), transpose=None), "transpose"),
    ("build_mask_info partial_mode", lambda: rs.build_mask_info(CAUSAL, (128, 128), partial_mode="x"),
     "partial_mode"),
    ("build_mask_info q_shards 0", lambda: rs.build_mask_info(CAUSAL, (128, 128), q_shards=0), "q_shards"),
    ("layouts.permutation layout", lambda: rs.layouts.permutation("yes", S, N), "layout"),
    ("ring_attention_sharded layout", lambda: _ring_sharded(layout="yes"), "layout"),
    ("ring_attention_sharded unroll", lambda: _ring_sharded(unroll=0), "unroll"),
    ("ring_attention_sharded axis_name", lambda: _ring_sharded(axis_name="nope"), "axis_name"),
    ("ring_schedule layout", lambda: _schedule(layout="diagonal"), "layout"),
    ("ring_schedule heads 0", lambda: _schedule(heads=0), "heads"),
    ("ring_schedule kv_heads", lambda: _schedule(kv_heads=3), "kv_heads"),
    ("ring_schedule num_shards str", lambda: _schedule(num_shards="2"), "num_shards"),
    ("byte_lm layout", lambda: _experiment_config("byte_lm", layout="yes"), "layout"),
    ("byte_lm backend", lambda: _experiment_config("byte_lm", backend="tpu"), "backend"),
    ("train_long_context attention", lambda: _experiment_config("train_long_context", attention="flash"), "attention"),
    ("train_long_context remat", lambda: _experiment_config("train_long_context", remat="yes"), "remat"),
    ("strategy_equivalence layout", lambda: _experiment_config("strategy_equivalence", layout="diagonal"), "layout"),
    # issue 56 (7): numbers the library configs refused only once main() built them (naming their own fields),
    # or never (a depth read after the base model trained, a negative seed failing in the data stream)
    ("train_long_context mlp_ratio nan", lambda: _experiment_config("train_long_context", mlp_ratio=float("nan")),
     "mlp-ratio"),
    ("train_long_context learning_rate inf",
     lambda: _experiment_config("train_long_context", learning_rate=float("inf")), "learning-rate"),
    ("train_long_context qk_clip_threshold 0", lambda: _experiment_config("train_long_context", qk_clip_threshold=0.0),
     "qk-clip-threshold"),
    ("train_long_context seed -1", lambda: _experiment_config("train_long_context", seed=-1), "seed"),
    ("byte_lm rope_theta -1", lambda: _experiment_config("byte_lm", rope_theta=-1.0), "rope-theta"),
    ("extend_context depths 1.5", lambda: _experiment_config("extend_context", depths="0,1.5"), "depths"),
    ("extend_context finetune_lr nan", lambda: _experiment_config("extend_context", finetune_lr=float("nan")),
     "finetune-lr"),
    ("extend_context init_from missing", lambda: _experiment_config("extend_context", init_from="no/such/dir"),
     "init-from"),
    ("strategy_equivalence seq_len 0", lambda: _experiment_config("strategy_equivalence", seq_len=0), "seq-len"),
    ("strategy_equivalence ring_sizes", lambda: _experiment_config("strategy_equivalence", ring_sizes="2,x"),
     "ring-sizes"),
    ("mask_demo mask", lambda: _experiment_config("mask_demo", mask="triangle"), "mask"),
    ("usp_mesh ulysses 0", lambda: rs.parallel.usp.usp_mesh(0, 2), "ulysses"),
    ("splash_attention scale str", lambda: _splash(*inputs(jax.random.key(0), HEADS, KV_HEADS, S, S, d=D)[:3],
                                                   scale="0.1"), "scale"),
    ("splash_attention config type", lambda: _splash(*inputs(jax.random.key(0), HEADS, KV_HEADS, S, S, d=D)[:3],
                                                     config={"backend": "xla"}), "config"),
]


@pytest.mark.parametrize("call, argument", [c[1:] for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES])
def test_bad_option_is_an_error_naming_the_argument(call, argument):
    with pytest.raises((ValueError, TypeError)) as err:
        call()
    assert re.search(rf"\b{argument}\b", str(err.value)), str(err.value)


def test_numpy_and_jax_scalars_are_numbers_at_every_attention_entry_point():
    """Issue 56 (7): ``scale`` / ``logit_soft_cap`` / ``dropout_rate`` given as a concrete JAX (or 0-d NumPy)
    scalar were refused as if not numbers; now the Python numbers they hold, the same output; a traced one is
    still refused by name. (The sequence-parallel entry points pass ``scale`` on to inner functions annotated
    ``float``, which this test run's type checker refuses for a JAX scalar: not covered here.)"""
    q, k, v, _, _ = inputs(jax.random.key(0), HEADS, KV_HEADS, S, S, d=D)
    scale, cap = float(np.float32(0.1)), 30.0
    for fn in (_reference, _splash):
        expected = fn(q, k, v, scale=scale, logit_soft_cap=cap)
        np.testing.assert_array_equal(fn(q, k, v, scale=jnp.float32(0.1), logit_soft_cap=jnp.float32(cap)), expected)
    np.testing.assert_array_equal(_reference(q, k, v, scale=np.array(0.1, np.float32)), _reference(q, k, v, scale=scale))
    np.testing.assert_array_equal(_reference(q, k, v, dropout_rate=jnp.float32(0.0)), _reference(q, k, v))
    with pytest.raises(TypeError, match=r"scale must be a real number"):
        jax.jit(lambda s: _reference(q, k, v, scale=s))(jnp.float32(0.1))


def _as_constructed(config, **fields):
    """``config`` with ``fields`` set as its dataclass ``__init__`` sets them (then ``__post_init__``), without the
    test run's type checker, which refuses a NumPy scalar for an ``int`` field before the config sees it."""
    for name, value in fields.items():
        object.__setattr__(config, name, value)
    config.__post_init__()
    return config


def test_configs_hold_numpy_and_jax_scalars_as_python_numbers():
    """Issue 56 (7) probe: NumPy scalars in a config were kept as such, so ``json.dump`` of a run's config (which
    ``train.fit`` writes) failed once a run had started; a JAX scalar was refused, an ``np.int64`` loader length
    too. Now every field holds the Python number."""
    import json

    from ringsplash.data import LoaderConfig
    from ringsplash.model import TransformerConfig
    from ringsplash.train import TrainConfig

    shape = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, max_seq_len=64, mlp_ratio=2.0)
    cp = _as_constructed(ContextParallel("ring", ring_size=4), ring_size=np.int64(4))
    model = _as_constructed(TransformerConfig(**shape), vocab_size=np.int64(64), d_model=jnp.int32(32),
                            mlp_ratio=np.float32(2.0), context_parallel=cp)
    assert model == TransformerConfig(**shape, context_parallel=ContextParallel("ring", ring_size=4))
    assert type(model.d_model) is int and type(model.mlp_ratio) is float and type(cp.ring_size) is int
    train = _as_constructed(TrainConfig(steps=10, batch_size=2, warmup_steps=1), steps=np.int64(10),
                            learning_rate=np.float32(0.5))
    json.dumps({"model": model.to_dict(), "train": dataclasses.asdict(train)})
    assert type(_as_constructed(LoaderConfig(seq_len=16, batch_size=2), seq_len=np.int64(16)).seq_len) is int
