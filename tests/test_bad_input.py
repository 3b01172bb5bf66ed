"""Bad input to the foundation (masks, layouts, build_mask_info, reference_attention).

Each case asserts the exception type and that the message names the offending argument.
Kernel / ring / model entry points add their own cases in their test files.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ringsplash as rs
from ringsplash import layouts, masks
from ringsplash._internal import checks as _checks
from ringsplash._internal import scalar_checks as _scalar_checks

S4 = (4, 4)


def _bad(fn, exc, match, id_):
    return pytest.param(fn, exc, match, id=id_)


MASK_CASES = [
    # zero / negative sizes
    _bad(lambda: masks.FullMask((0, 4)), ValueError, r"shape.*\(0, 4\)", "full_zero_q_len"),
    _bad(lambda: masks.CausalMask((4, -2)), ValueError, r"shape.*\(4, -2\)", "causal_negative_kv_len"),
    _bad(lambda: masks.LocalMask((-1, 4), window=(1, 0)), ValueError, r"shape", "local_negative_q_len"),
    _bad(lambda: masks.ChunkedCausalMask((0, 0), 2), ValueError, r"shape", "chunked_zero_shape"),
    _bad(lambda: masks.PrefixLMMask((4, 0), 0), ValueError, r"shape", "prefix_zero_kv_len"),
    _bad(lambda: masks.CausalMask((4,)), TypeError, r"shape", "shape_not_a_pair"),
    _bad(lambda: masks.CausalMask((4.0, 4)), TypeError, r"shape", "shape_not_ints"),
    # negative window sides
    _bad(lambda: masks.LocalMask(S4, window=(-1, 0)), ValueError, r"window.*-1", "window_left_negative"),
    _bad(lambda: masks.LocalMask(S4, window=(None, -3)), ValueError, r"window.*-3", "window_right_negative"),
    _bad(lambda: masks.LocalMask(S4, window=(1, 2, 3)), TypeError, r"window", "window_not_a_pair"),
    # chunk_size <= 0
    _bad(lambda: masks.ChunkedCausalMask(S4, 0), ValueError, r"chunk_size.*0", "chunk_size_zero"),
    _bad(lambda: masks.ChunkedCausalMask(S4, -4), ValueError, r"chunk_size.*-4", "chunk_size_negative"),
    # prefix_len outside [0, kv_len]
    _bad(lambda: masks.PrefixLMMask((4, 6), -1), ValueError, r"prefix_len.*-1", "prefix_negative"),
    _bad(lambda: masks.PrefixLMMask((4, 6), 7), ValueError, r"prefix_len.*kv_len=6.*7", "prefix_past_kv_len"),
    # NumpyMask not a 2-D bool array
    _bad(lambda: masks.NumpyMask(np.ones((4, 4), np.int32)), TypeError, r"2-D bool array.*int32", "numpy_int_dtype"),
    _bad(lambda: masks.NumpyMask(np.ones((4,), bool)), TypeError, r"2-D bool array.*\(4,\)", "numpy_1d"),
    _bad(lambda: masks.NumpyMask(np.ones((2, 4, 4), bool)), TypeError, r"2-D bool array", "numpy_3d"),
    _bad(lambda: masks.NumpyMask(np.ones((0, 4), bool)), ValueError, r"array\.shape", "numpy_empty"),
    # & / | of different shapes
    _bad(lambda: masks.CausalMask(S4) & masks.CausalMask((4, 8)), ValueError, r"different shapes.*\(4, 4\).*\(4, 8\)",
         "and_shapes"),
    _bad(lambda: masks.FullMask((8, 4)) | masks.CausalMask(S4), ValueError, r"different shapes.*\(8, 4\).*\(4, 4\)",
         "or_shapes"),
    # MultiHeadMask of differing shapes or empty
    _bad(lambda: masks.MultiHeadMask([]), ValueError, r"at least one mask", "multihead_empty"),
    _bad(lambda: masks.MultiHeadMask([masks.CausalMask(S4), masks.CausalMask((4, 8))]), ValueError,
         r"masks\[1\]\.shape=\(4, 8\)", "multihead_shapes"),
]


@pytest.mark.parametrize("fn, exc, match", MASK_CASES)
def test_bad_mask_input(fn, exc, match):
    with pytest.raises(exc, match=match):
        fn()


C64 = masks.CausalMask((64, 64))
MASK_INFO_CASES = [
    # block sizes not dividing lengths
    _bad(lambda: rs.build_mask_info(masks.CausalMask((100, 100)), (16, 16)), ValueError,
         r"block_shape\[0\]=16 must divide.*q_len", "block_q_not_dividing"),
    _bad(lambda: rs.build_mask_info(masks.CausalMask((64, 60)), (16, 16)), ValueError,
         r"block_shape\[1\]=16 must divide.*kv_len", "block_kv_not_dividing"),
    _bad(lambda: rs.build_mask_info(C64, (0, 16)), ValueError, r"block_shape", "block_zero"),
    _bad(lambda: rs.build_mask_info(C64, (-8, 16)), ValueError, r"block_shape", "block_negative"),
    # shard counts not dividing lengths, or per-shard lengths not divisible by the block
    _bad(lambda: rs.build_mask_info(C64, (8, 8), q_shards=3), ValueError, r"q_shards=3 must divide q_len=64",
         "q_shards_not_dividing"),
    _bad(lambda: rs.build_mask_info(C64, (8, 8), kv_shards=5), ValueError, r"kv_shards=5 must divide kv_len=64",
         "kv_shards_not_dividing"),
    _bad(lambda: rs.build_mask_info(C64, (16, 16), q_shards=8), ValueError,
         r"block_shape\[0\]=16.*q_len // q_shards = 64 // 8 = 8", "q_shard_len_not_block_multiple"),
    _bad(lambda: rs.build_mask_info(C64, (8, 16), kv_shards=8), ValueError,
         r"block_shape\[1\]=16.*kv_len // kv_shards", "kv_shard_len_not_block_multiple"),
    _bad(lambda: rs.build_mask_info(C64, (8, 8), q_shards=0), ValueError, r"q_shards", "q_shards_zero"),
    _bad(lambda: rs.build_mask_info(C64, (8, 8), kv_shards=-2), ValueError, r"kv_shards", "kv_shards_negative"),
    # positions of the wrong length or not a permutation
    _bad(lambda: rs.build_mask_info(C64, (8, 8), q_positions=np.arange(63)), ValueError,
         r"q_positions must have shape \(64,\), got \(63,\)", "q_positions_length"),
    _bad(lambda: rs.build_mask_info(C64, (8, 8), kv_positions=np.arange(64).reshape(8, 8)), ValueError,
         r"kv_positions must have shape", "kv_positions_2d"),
    _bad(lambda: rs.build_mask_info(C64, (8, 8), q_positions=np.r_[0, np.arange(63)]), ValueError,
         r"q_positions must be a permutation", "q_positions_repeat"),
    _bad(lambda: rs.build_mask_info(C64, (8, 8), kv_positions=np.arange(1, 65)), ValueError,
         r"kv_positions must be a permutation", "kv_positions_out_of_range"),
    _bad(lambda: rs.build_mask_info(C64, (8, 8), kv_positions=-np.arange(64)), ValueError,
         r"kv_positions must be a permutation", "kv_positions_negative"),
    _bad(lambda: rs.build_mask_info(C64, (8, 8), q_positions=np.arange(64.0)), TypeError,
         r"q_positions must be integers", "q_positions_float"),
    # other arguments
    # a Literal-typed mode string: the library's ValueError, or the test run's type check (TypeError)
    _bad(lambda: rs.build_mask_info(C64, (8, 8), partial_mode="dense"), (ValueError, TypeError),
         r"partial_mode.*'dense'", "partial_mode"),
    _bad(lambda: rs.build_mask_info(np.ones((64, 64), bool), (8, 8)), TypeError, r"mask", "mask_not_a_mask"),
]


@pytest.mark.parametrize("fn, exc, match", MASK_INFO_CASES)
def test_bad_mask_info_input(fn, exc, match):
    rs.clear_caches()
    with pytest.raises(exc, match=match):
        fn()


LAYOUT_CASES = [
    # Literal-typed: the library's ValueError, or the test run's type check (TypeError)
    _bad(lambda: layouts.permutation("spiral", 16, 2), (ValueError, TypeError), r"layout.*'spiral'", "unknown_layout"),
    _bad(lambda: layouts.inverse_permutation("Zigzag", 16, 2), (ValueError, TypeError), r"layout",
         "layout_case_sensitive"),
    _bad(lambda: layouts.permute(np.zeros(16), "ring", 2), (ValueError, TypeError), r"layout.*'ring'",
         "permute_unknown"),
    _bad(lambda: layouts.unpermute(np.zeros(16), "zigzag", 0), ValueError, r"num_shards", "zero_shards"),
    _bad(lambda: layouts.permutation("zigzag", 12, 4), ValueError, r"seq_len=12.*num_shards=4", "zigzag_not_divisible"),
    _bad(lambda: layouts.permutation("striped", 0, 1), ValueError, r"seq_len", "zero_seq_len"),
]


@pytest.mark.parametrize("fn, exc, match", LAYOUT_CASES)
def test_bad_layout_input(fn, exc, match):
    with pytest.raises(exc, match=match):
        fn()


def _qkv(heads=4, kv_heads=2, q_len=8, kv_len=8, d=16, dk=None):
    q = jnp.zeros((heads, q_len, d), jnp.float32)
    k = jnp.zeros((kv_heads, kv_len, d if dk is None else dk), jnp.float32)
    return q, k, k


IDS8 = jnp.zeros((8,), jnp.int32)
ATTENTION_CASES = [
    # kv_heads not dividing heads
    _bad(lambda: rs.reference_attention(*_qkv(heads=4, kv_heads=3)), ValueError, r"kv_heads=3 must divide heads=4",
         "kv_heads_not_dividing"),
    # segment ids of the wrong length or dtype
    _bad(lambda: rs.reference_attention(*_qkv(), segment_ids=rs.SegmentIds(q=jnp.zeros((7,), jnp.int32), kv=IDS8)),
         ValueError, r"segment_ids\.q must have shape \(8,\), got \(7,\)", "segment_ids_q_length"),
    _bad(lambda: rs.reference_attention(*_qkv(kv_len=12), segment_ids=rs.SegmentIds(q=IDS8, kv=IDS8)),
         ValueError, r"segment_ids\.kv must have shape \(12,\)", "segment_ids_kv_length"),
    _bad(lambda: rs.reference_attention(*_qkv(), segment_ids=rs.SegmentIds(q=IDS8, kv=jnp.zeros((8,), jnp.float32))),
         TypeError, r"segment_ids\.kv must be an integer array.*float32", "segment_ids_float"),
    _bad(lambda: rs.reference_attention(*_qkv(), segment_ids=rs.SegmentIds(q=jnp.zeros((8, 1), jnp.int32), kv=IDS8)),
         ValueError, r"segment_ids\.q", "segment_ids_2d"),
    # mask / sinks that do not fit
    _bad(lambda: rs.reference_attention(*_qkv(), masks.CausalMask((8, 16))), ValueError,
         r"mask shape \(8, 16\).*\(8, 8\)", "mask_shape"),
    _bad(lambda: rs.reference_attention(*_qkv(), masks.MultiHeadMask([masks.CausalMask((8, 8))] * 3)), ValueError,
         r"MultiHeadMask has 3 heads.*heads=4", "multihead_heads"),
]


@pytest.mark.parametrize("fn, exc, match", ATTENTION_CASES)
def test_bad_attention_input(fn, exc, match):
    with pytest.raises(exc, match=match):
        fn()


def test_head_dim_mismatch():
    q, k, v = _qkv(d=16, dk=8)
    # the library's own check (what users without runtime type checking see)
    with pytest.raises(ValueError, match=r"head_dim mismatch: q has head_dim=16, k has head_dim=8"):
        _checks.check_attention_inputs(q, k, v)
    # through the public entry point (under the test suite's jaxtyping checks the annotation's
    # shared "d" dimension may fire first; either way it is a TypeError/ValueError naming k)
    with pytest.raises((ValueError, TypeError), match=r"head_dim|parameter 'k'"):
        rs.reference_attention(q, k, v)


def test_qkv_rank_and_kv_shape_checks():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"q must be \[heads, length, head_dim\]"):
        _checks.check_attention_inputs(q[0], k, v)
    with pytest.raises(ValueError, match=r"v must be \[kv_heads, kv_len, head_dim_v\] with k's kv_heads and kv_len"):
        _checks.check_attention_inputs(q, k, v[:, :4])
    with pytest.raises(ValueError, match=r"kv_heads=3 must divide heads=4"):
        _checks.check_attention_inputs(q, jnp.zeros((3, 8, 16)), jnp.zeros((3, 8, 16)))
    with pytest.raises(ValueError, match=r"sinks must have shape"):
        _checks.check_attention_inputs(q, k, v, sinks=jnp.zeros((3,)))
    with pytest.raises(TypeError, match=r"segment_ids must be ringsplash.SegmentIds"):
        _checks.check_segment_ids((IDS8, IDS8), 8, 8)
    with pytest.raises(TypeError, match=r"mask must be"):
        _checks.check_attention_inputs(q, k, v, mask=np.ones((8, 8), bool))


def test_mask_indexing_errors():
    m = masks.CausalMask((4, 6))
    with pytest.raises(IndexError, match=r"mask\[q_index, kv_index\]"):
        m[0]
    with pytest.raises(IndexError, match="out of range"):
        m[4, 0]
    with pytest.raises(IndexError, match="out of range"):
        m[:, np.array([0, 6])]
    with pytest.raises(TypeError, match="boolean indexing"):
        m[np.ones(4, bool), :]
    mh = masks.MultiHeadMask([m, m])
    with pytest.raises(IndexError, match=r"mask\[head, q_index, kv_index\]"):
        mh[0, 0]


@pytest.mark.parametrize("shapes, match", [
    (((0, 8, 16), (1, 8, 16), (1, 8, 16)), r"heads \(q\.shape\[0\]\) must be >= 1"),
    (((4, 8, 16), (0, 8, 16), (0, 8, 16)), r"kv_heads \(k\.shape\[0\]\) must be >= 1"),
    (((4, 8, 0), (2, 8, 0), (2, 8, 16)), r"head_dim \(q\.shape\[2\]\) must be >= 1"),
    (((4, 8, 16), (2, 8, 16), (2, 8, 0)), r"head_dim_v \(v\.shape\[2\]\) must be >= 1"),
], ids=["heads", "kv_heads", "head_dim", "head_dim_v"])
def test_zero_sized_heads_are_refused_by_name(shapes, match):
    q, k, v = (jnp.ones(s, jnp.float32) for s in shapes)
    with pytest.raises(ValueError, match=match):  # was a ZeroDivisionError from the GQA / scale arithmetic
        _checks.check_attention_inputs(q, k, v)


@pytest.mark.parametrize("sinks, bad", [([np.nan, 0.0], "[0]"), ([0.0, np.inf], "[1]")], ids=["nan", "pos_inf"])
@pytest.mark.parametrize("entry", ["reference", "splash"])
def test_sinks_must_be_finite_or_minus_inf(sinks, bad, entry):
    q, k, v = _qkv(heads=2, kv_heads=2, q_len=128, kv_len=128)
    attn = rs.reference_attention if entry == "reference" else functools.partial(
        rs.splash_attention, config=rs.SplashConfig(backend="xla"))
    with pytest.raises(ValueError, match=r"sinks must be finite or -inf.*heads " + re.escape(bad)):
        attn(q, k, v, masks.CausalMask((128, 128)), sinks=jnp.asarray(sinks, jnp.float32))
    # -inf (a head without a sink) is allowed and equals no sink at all
    ok = attn(q + 1, k + 1, v + 1, masks.CausalMask((128, 128)), sinks=jnp.asarray([-np.inf, -np.inf], jnp.float32))
    assert np.array_equal(np.asarray(ok), np.asarray(attn(q + 1, k + 1, v + 1, masks.CausalMask((128, 128)))))


@pytest.mark.parametrize("unroll", ["x", 0, -1, 1.5, None])
def test_unroll_is_checked_by_name(unroll):
    message = r"unroll must be an int >= 1 or a bool.*unroll=" + re.escape(repr(unroll))
    with pytest.raises(ValueError, match=message):  # "x" was a TypeError from a comparison inside lax.scan
        _scalar_checks.check_unroll("unroll", unroll)
    if isinstance(unroll, int):  # what the annotation lets through reaches the ring's own check
        q, k, v = _qkv(heads=2, kv_heads=2, q_len=256, kv_len=256)
        mesh = jax.make_mesh((2,), ("c",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
        with pytest.raises(ValueError, match=message):
            rs.ring_attention_sharded(q, k, v, masks.CausalMask((256, 256)), mesh=mesh, axis_name="c",
                                      unroll=unroll, config=rs.SplashConfig(backend="xla"))
    assert _scalar_checks.check_unroll("unroll", True) is True and _scalar_checks.check_unroll("unroll", 2) == 2
