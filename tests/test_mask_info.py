"""MaskInfo: round trip against the dense mask, the work-list contract, dtypes, cache, cost."""

import dataclasses
import time
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import ringsplash as rs
from ringsplash import build_mask_info, layouts, masks
from ringsplash.blocksparse import builder as mask_blocks
from ringsplash.blocksparse import mask_info as mask_info_lib
from ringsplash.masks import EMPTY, FULL, PARTIAL
from ringsplash.splash import work_pieces
from support.attention_inputs import inputs, max_err
from support.masks import any_masks

# ----------------------------------------------------------------------------------------
# helpers


def fitting_dtype(lo: int, hi: int) -> np.dtype:
    """Independent re-statement of "smallest signed integer dtype holding [lo, hi]"."""
    for dt in (np.int8, np.int16, np.int32, np.int64):
        if np.iinfo(dt).min <= lo and hi <= np.iinfo(dt).max:
            return np.dtype(dt)
    raise AssertionError


def positions(kind: str, length: int, shards: int) -> np.ndarray | None:
    if kind == "none":
        return None
    if kind == "random":
        return np.random.default_rng(length * 31 + shards).permutation(length).astype(np.int32)
    return layouts.permutation(kind, length, shards)


def check_info(info, mask, q_pos=None, kv_pos=None, partial_mode="auto"):
    """Assert the whole MaskInfo contract of docs/INTERNALS.md against the dense mask."""
    q_len, kv_len = masks.head_masks(mask)[0].shape
    q_pos = np.arange(q_len) if q_pos is None else np.asarray(q_pos)
    kv_pos = np.arange(kv_len) if kv_pos is None else np.asarray(kv_pos)
    heads = masks.head_masks(mask)
    want = [m[:, :][np.ix_(q_pos, kv_pos)] for m in heads]  # dense, in the laid-out frame
    np.testing.assert_array_equal(info.q_positions, q_pos)
    np.testing.assert_array_equal(info.kv_positions, kv_pos)
    assert info.head_to_list.shape == (len(heads),)
    for h in range(len(heads)):
        np.testing.assert_array_equal(info.to_dense(h), want[h], err_msg=f"head {h}")
        assert info.masks[int(info.head_to_list[h])] == heads[h]

    bq, bkv = info.block_shape
    nq, nk = info.q_blocks_per_shard, info.kv_blocks_per_shard
    L, QS, KS, T = info.kind.shape
    assert (info.q_shards, info.kv_shards) == (QS, KS)
    for arr in (info.q_block, info.kv_block, info.partial_index):
        assert arr.shape == info.kind.shape
    assert info.num_active.shape == (L, QS, KS)
    assert info.kind.dtype == np.int8
    assert info.partial_mask_blocks.dtype == np.bool_ and info.partial_mask_blocks.shape[1:] == (bq, bkv)

    # dtypes: the smallest that fit
    assert info.q_block.dtype == info.kv_block.dtype
    assert info.q_block.dtype == fitting_dtype(0, max(int(info.q_block.max()), int(info.kv_block.max())))
    assert info.partial_index.dtype == fitting_dtype(-1, max(info.partial_mask_blocks.shape[0] - 1, 0))
    assert info.num_active.dtype == fitting_dtype(0, T)

    min_padding = T
    for lst in range(L):
        dense_l = want[int(np.flatnonzero(info.head_to_list == lst)[0])]
        for a in range(QS):
            for b in range(KS):
                qb = info.q_block[lst, a, b].astype(np.int64)
                kb = info.kv_block[lst, a, b].astype(np.int64)
                kind = info.kind[lst, a, b]
                pidx = info.partial_index[lst, a, b].astype(np.int64)
                assert np.all((qb >= 0) & (qb < nq)) and np.all((kb >= 0) & (kb < nk))
                assert np.all(np.isin(kind, (EMPTY, PARTIAL, FULL)))
                major, minor, n_major, n_minor = (kb, qb, nk, nq) if info.transpose else (qb, kb, nq, nk)
                keys = major * n_minor + minor
                # ordering: (major, minor) non-decreasing; real entries strictly increasing
                assert np.all(np.diff(keys) >= 0), "work list out of order"
                active = kind > 0
                assert np.all(np.diff(keys[active]) > 0), "duplicate block pair"
                assert info.num_active[lst, a, b] == active.sum()
                # every major block appears at least once
                np.testing.assert_array_equal(np.unique(major), np.arange(n_major))
                # kind-0 entries are either trailing padding (repeat the previous entry) or the
                # single visit of a major block with nothing to compute
                padding = 0
                for t in np.flatnonzero(~active):
                    if t > 0 and keys[t] == keys[t - 1]:
                        assert np.all(kind[t:] == EMPTY) and np.all(keys[t:] == keys[t]), "padding not at end"
                        padding += 1
                    else:
                        assert not np.any(active & (major == major[t])), "kind-0 visit of a row with work"
                        assert np.all(keys[major == major[t]] == keys[t]), "a row visited twice"
                min_padding = min(min_padding, padding)
                assert np.all(pidx[kind != PARTIAL] == -1), "FULL / kind-0 entries carry a partial index"
                for t in np.flatnonzero(active):
                    rows = slice((a * nq + qb[t]) * bq, (a * nq + qb[t] + 1) * bq)
                    cols = slice((b * nk + kb[t]) * bkv, (b * nk + kb[t] + 1) * bkv)
                    blk = dense_l[rows, cols]
                    assert blk.any(), "an empty block is listed"
                    if kind[t] == FULL:
                        assert blk.all(), "a FULL entry is not full"
                    else:
                        assert not blk.all(), "a PARTIAL entry is full"
                        if pidx[t] >= 0:
                            np.testing.assert_array_equal(info.partial_mask_blocks[pidx[t]], blk)
                        if partial_mode == "stored" or not info.masks[lst].has_mask_function:
                            assert pidx[t] >= 0, "stored mode left a partial block unstored"
                        if partial_mode == "function" and info.masks[lst].has_mask_function:
                            assert pidx[t] == -1, "function mode stored a partial block"
    assert min_padding == 0, "max_steps is larger than the longest work list"


S = 128  # 8 shards x 2 blocks of 8 tokens; zigzag chunks of 8
SQ = 64  # rectangular: zigzag over 8 shards gives chunks of 4, so blocks of 8 are not consecutive


def _numpy_mask(q_len, kv_len, seed=0):
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 3, size=(q_len // 8, kv_len // 8))  # empty / random / full regions
    fine = rng.random((q_len, kv_len)) < 0.5
    c = np.kron(coarse, np.ones((8, 8), int))
    return masks.NumpyMask(np.where(c == 2, True, np.where(c == 1, fine, False)))


SQUARE = {
    "full": masks.FullMask((S, S)),
    "causal": masks.CausalMask((S, S)),
    "causal_shifted": masks.CausalMask((S, S), offset=-12),  # first rows / last columns: nothing
    "local": masks.LocalMask((S, S), window=(16, 0)),
    "local_open_left": masks.LocalMask((S, S), window=(None, 3), offset=2),
    "chunked": masks.ChunkedCausalMask((S, S), 24),
    "prefix": masks.PrefixLMMask((S, S), 40),
    "numpy": _numpy_mask(S, S),
    "causal&local": masks.CausalMask((S, S)) & masks.LocalMask((S, S), window=(20, 0)),
    "chunked|prefix": masks.ChunkedCausalMask((S, S), 32) | masks.PrefixLMMask((S, S), 10),
    "multihead": masks.MultiHeadMask(
        [masks.CausalMask((S, S)), masks.LocalMask((S, S), (16, 0)), masks.CausalMask((S, S)), _numpy_mask(S, S, 1)]
    ),
}
RECT = {
    "rect_causal": masks.CausalMask((SQ, S), offset=S - SQ),
    "rect_local": masks.LocalMask((SQ, S), window=(32, 0), offset=S - SQ),
    "rect_chunked": masks.ChunkedCausalMask((SQ, S), 16),
}


@pytest.mark.parametrize("layout", ["none", "contiguous", "zigzag", "striped", "random"])
@pytest.mark.parametrize("shards", [1, 2, 4, 8])
@pytest.mark.parametrize("name", list(SQUARE) + list(RECT))
def test_mask_info_round_trip(name, shards, layout):
    mask = {**SQUARE, **RECT}[name]
    q_len, kv_len = masks.head_masks(mask)[0].shape
    q_pos, kv_pos = positions(layout, q_len, shards), positions(layout, kv_len, shards)
    # both orientations and every partial mode, rotated so each combination runs somewhere
    combos = [(False, "auto"), (True, "stored"), (True, "function")] if shards % 2 else [
        (True, "auto"), (False, "stored"), (False, "function")]
    for transpose, mode in combos:
        info = build_mask_info(
            mask, (8, 8), q_shards=shards, kv_shards=shards, q_positions=q_pos, kv_positions=kv_pos,
            transpose=transpose, partial_mode=mode,
        )
        assert info.transpose == transpose and info.q_shards == shards
        check_info(info, mask, q_pos, kv_pos, mode)


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("name", ["causal", "chunked", "prefix", "causal&local", "numpy"])
def test_mask_info_unequal_blocks_and_shards(name, transpose):
    mask = SQUARE[name]
    q_pos = layouts.permutation("zigzag", S, 2)
    kv_pos = layouts.permutation("striped", S, 4)
    for mode in mask_info_lib.PARTIAL_MODES:
        info = build_mask_info(mask, (16, 4), q_shards=2, kv_shards=4, q_positions=q_pos, kv_positions=kv_pos,
                               transpose=transpose, partial_mode=mode)
        check_info(info, mask, q_pos, kv_pos, mode)


@pytest.mark.parametrize("transpose", [False, True])
def test_empty_block_rows_get_one_kind0_visit(transpose):
    mask = SQUARE["causal_shifted"]  # q block 0 attends nothing; kv block 15 is attended by nobody
    info = build_mask_info(mask, (8, 8), transpose=transpose)
    check_info(info, mask)
    empty_major = 15 if transpose else 0
    major = (info.kv_block if transpose else info.q_block)[0, 0, 0]
    sel = major == empty_major
    assert sel.sum() >= 1 and np.all(info.kind[0, 0, 0][sel] == EMPTY)
    # the visit keeps the previous entry's minor block (no new fetch); padding repeats the last entry
    minor = (info.q_block if transpose else info.kv_block)[0, 0, 0]
    t = int(np.flatnonzero(sel)[0])
    assert minor[t] == (minor[t - 1] if t > 0 else 0)


def test_mask_info_transposed_minor_index_dtype():
    """Regression: the transposed (minor) q index may exceed every kv index; its dtype must fit."""
    arr = np.zeros((200, 2), bool)
    arr[:, 0] = True
    arr[0, 1] = True  # the last kv block is attended by q block 0 only
    mask = masks.NumpyMask(arr)
    info = build_mask_info(mask, (1, 1), transpose=True)
    check_info(info, mask)
    assert info.q_block.dtype == np.int16


def test_mask_info_orientations_list_the_same_pairs():
    mask = SQUARE["causal&local"]
    pos = layouts.permutation("zigzag", S, 4)
    a = build_mask_info(mask, (8, 8), q_shards=4, kv_shards=4, q_positions=pos, kv_positions=pos)
    b = build_mask_info(mask, (8, 8), q_shards=4, kv_shards=4, q_positions=pos, kv_positions=pos, transpose=True)

    def pairs(info, qs, ks):
        act = info.kind[0, qs, ks] > 0
        return set(zip(info.q_block[0, qs, ks][act].tolist(), info.kv_block[0, qs, ks][act].tolist(),
                       info.kind[0, qs, ks][act].tolist()))

    for qs in range(4):
        for ks in range(4):
            assert pairs(a, qs, ks) == pairs(b, qs, ks)


def test_causal_equal_blocks_has_one_unique_partial_block():
    for shards, layout in [(1, "contiguous"), (8, "zigzag"), (4, "contiguous")]:
        n = 1024
        pos = layouts.permutation(layout, n, shards)
        for mode in ("auto", "stored"):
            info = build_mask_info(masks.CausalMask((n, n)), (32, 32), q_shards=shards, kv_shards=shards,
                                   q_positions=pos, kv_positions=pos, partial_mode=mode)
            assert info.partial_mask_blocks.shape == (1, 32, 32)
            np.testing.assert_array_equal(info.partial_mask_blocks[0], np.tril(np.ones((32, 32), bool)))
            assert set(info.partial_index[info.kind == PARTIAL].tolist()) == {0}
    # rectangular, offset a multiple of the block: still one
    info = build_mask_info(masks.CausalMask((256, 1024), offset=768), (32, 32))
    assert info.partial_mask_blocks.shape[0] == 1


def test_auto_mode_falls_back_to_mask_function():
    """More than MAX_STORED_PARTIAL_BLOCKS distinct partial blocks -> evaluate in kernel."""
    n = 256
    pos = np.random.default_rng(0).permutation(n)
    mask = masks.CausalMask((n, n))
    info = build_mask_info(mask, (8, 8), q_positions=pos, kv_positions=pos, partial_mode="auto")
    assert info.uses_mask_function and info.partial_mask_blocks.shape[0] == 0
    stored = build_mask_info(mask, (8, 8), q_positions=pos, kv_positions=pos, partial_mode="stored")
    assert stored.partial_mask_blocks.shape[0] > mask_info_lib.MAX_STORED_PARTIAL_BLOCKS
    assert not stored.uses_mask_function
    np.testing.assert_array_equal(info.to_dense(), stored.to_dense())
    # a NumpyMask has no mask_function: always stored
    nm = build_mask_info(SQUARE["numpy"], (8, 8), partial_mode="function")
    assert not nm.uses_mask_function and nm.partial_mask_blocks.shape[0] > 0


def test_index_dtypes_grow_with_block_counts():
    n = 1 << 20
    m = masks.CausalMask((n, n))
    info = build_mask_info(m, (512, 512))  # 2048 blocks
    assert info.q_block.dtype == np.int16 and info.kv_block.dtype == np.int16
    assert info.num_active.dtype == np.int32  # max_steps = 2048 * 2049 / 2
    assert info.partial_index.dtype == np.int8
    info16 = build_mask_info(m, (512, 512), q_shards=16, kv_shards=16)  # 128 local blocks: 0..127
    assert info16.q_block.dtype == np.int8
    small = build_mask_info(masks.CausalMask((64, 64)), (8, 8))
    assert small.q_block.dtype == np.int8 and small.num_active.dtype == np.int8


def test_mask_info_is_cached():
    mask = masks.CausalMask((S, S))
    pos = layouts.permutation("zigzag", S, 4)
    a = build_mask_info(mask, (8, 8), q_shards=4, kv_shards=4, q_positions=pos, kv_positions=pos)
    b = build_mask_info(masks.CausalMask((S, S)), (8, 8), q_shards=4, kv_shards=4,
                        q_positions=np.array(pos), kv_positions=np.array(pos))
    assert a is b
    assert build_mask_info(mask, (8, 8), q_shards=4, kv_shards=4, q_positions=pos, kv_positions=pos,
                           transpose=True) is not a
    assert build_mask_info(mask, (8, 8), q_shards=4, kv_shards=4) is not a
    with pytest.raises(ValueError):
        a.kind[0, 0, 0, 0] = 0  # cached arrays are read-only
    build_mask_info.cache_clear()
    c = build_mask_info(mask, (8, 8), q_shards=4, kv_shards=4, q_positions=pos, kv_positions=pos)
    assert c is not a
    np.testing.assert_array_equal(c.kind, a.kind)


ROW_MASKS = {
    **{k: SQUARE[k] for k in ("causal", "local", "chunked", "numpy", "causal&local", "chunked|prefix", "multihead")},
    "numpy&causal": _numpy_mask(S, S, 2) & masks.CausalMask((S, S)),  # composite with a NumpyMask part
}


@pytest.mark.parametrize("name", list(ROW_MASKS))
def test_q_shard_rows_equal_the_rows_of_the_whole_build(name, monkeypatch):
    """A rows-only build holds exactly the whole build's rows; everything global (num_active,
    partial blocks and their numbering, max_steps, dtypes, per-major counts, pieces) is the whole
    build's; only the rows' pair lists are expanded."""
    mask, shards = ROW_MASKS[name], 4
    expanded = []
    finish = mask_blocks._finish
    monkeypatch.setattr(mask_blocks, "_finish", lambda *a: expanded.append(1) or finish(*a))
    several_pieces = False
    for layout in ("contiguous", "zigzag", "striped"):
        pos = layouts.permutation(layout, S, shards)
        for transpose in (False, True):
            for mode in ("auto", "function") if name in ("local", "chunked|prefix") else ("auto",):
                common = dict(q_shards=shards, kv_shards=shards, q_positions=pos, kv_positions=pos,
                              transpose=transpose, partial_mode=mode)
                build_mask_info.cache_clear()
                whole = build_mask_info(mask, (8, 8), **common)
                # some pieces: at most 3 major blocks' worth of entries each
                steps = max(int(whole.major_counts.max()), 3)
                for rows in ((2,), (3, 0), (), (1, 3, 2, 0)):
                    expanded.clear()
                    got = build_mask_info(mask, (8, 8), **common, q_shard_rows=rows)
                    where = f"{name} {layout} transpose={transpose} {mode} rows={rows}"
                    assert got.q_shard_rows == rows and len(expanded) == got.num_lists * len(rows) * shards, where
                    for f in ("q_block", "kv_block", "kind", "partial_index"):
                        want = getattr(whole, f)[:, list(rows)]
                        assert getattr(got, f).dtype == want.dtype, where
                        np.testing.assert_array_equal(getattr(got, f), want, err_msg=f"{where} {f}")
                    for f in ("num_active", "partial_mask_blocks", "head_to_list", "major_counts", "partial_sources"):
                        np.testing.assert_array_equal(getattr(got, f), getattr(whole, f), err_msg=f"{where} {f}")
                    assert got.uses_mask_function == whole.uses_mask_function
                    split, split_whole = (work_pieces.split_work_lists(i, steps) for i in (got, whole))
                    assert split.pieces == split_whole.pieces, where
                    np.testing.assert_array_equal(split.bounds, split_whole.bounds[:, list(rows)], err_msg=where)
                # the builder's counts give the pieces the lists themselves give
                by_lists = work_pieces._split(dataclasses.replace(whole, major_counts=None), steps)
                assert by_lists.pieces == split_whole.pieces
                np.testing.assert_array_equal(by_lists.bounds, split_whole.bounds)
                np.testing.assert_array_equal(
                    dataclasses.replace(whole, partial_sources=None).list_partial_sources(), whole.partial_sources)
                several_pieces = several_pieces or len(split_whole.pieces) > 1
    assert several_pieces


def test_q_shard_rows_bad_input():
    mask = masks.CausalMask((S, S))
    for rows, err in (((4,), ValueError), ((1, 1), ValueError), ((-1,), ValueError), ((0.5,), TypeError)):
        with pytest.raises(err, match="q_shard_rows"):
            build_mask_info(mask, (8, 8), q_shards=4, kv_shards=4, q_shard_rows=rows)
    info = build_mask_info(mask, (8, 8), q_shards=4, kv_shards=4, q_shard_rows=(1,))
    with pytest.raises(ValueError, match="q_shard_rows"):
        info.schedule(1, 0)


def test_equal_head_masks_share_a_list():
    c = masks.CausalMask((S, S))
    local = masks.LocalMask((S, S), (16, 0))
    mh = masks.MultiHeadMask([c, local, masks.CausalMask((S, S)), masks.LocalMask((S, S), (16, 0)), c])
    info = build_mask_info(mh, (8, 8))
    assert info.num_lists == 2
    np.testing.assert_array_equal(info.head_to_list, [0, 1, 0, 1, 0])
    assert info.masks == (c, local)
    check_info(info, mh)
    single = build_mask_info(c, (8, 8))
    assert single.num_lists == 1 and single.head_to_list.tolist() == [0]


def test_schedule_with_traced_shard_indices():
    mask = masks.CausalMask((S, S)) & masks.LocalMask((S, S), (40, 0))
    pos = layouts.permutation("zigzag", S, 4)
    info = build_mask_info(mask, (8, 8), q_shards=4, kv_shards=4, q_positions=pos, kv_positions=pos)
    sched = jax.jit(lambda a, b: info.schedule(a, b))
    for a, b in [(0, 0), (3, 1), (1, 2)]:
        s = sched(jnp.int32(a), jnp.int32(b))
        for got, want in [(s.q_block, info.q_block), (s.kv_block, info.kv_block), (s.kind, info.kind),
                          (s.partial_index, info.partial_index)]:
            assert got.dtype == jnp.int32 and got.shape == (info.num_lists, info.max_steps)
            np.testing.assert_array_equal(np.asarray(got), want[:, a, b])
        np.testing.assert_array_equal(np.asarray(s.head_to_list), info.head_to_list)

    # inside a shard_map, indices from lax.axis_index (as the ring does)
    mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])
    P = jax.sharding.PartitionSpec

    def body(dummy):
        i = jax.lax.axis_index("x")
        s = info.schedule(i, (i + 1) % 4)
        return s.kind[None]

    x = jax.device_put(jnp.zeros(4), jax.sharding.NamedSharding(mesh, P("x")))
    kinds = np.asarray(jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(x))
    for i in range(4):
        np.testing.assert_array_equal(kinds[i], info.kind[:, i, (i + 1) % 4])

    one = build_mask_info(mask, (8, 8))
    s1 = one.schedule()
    np.testing.assert_array_equal(np.asarray(s1.kind), one.kind[:, 0, 0])


# ----------------------------------------------------------------------------------------
# every composition of every mask type, NumpyMask included

C = 64  # 8 blocks of 8; zigzag over 4 shards gives chunks of 8, striped over 4 a stride of 4
LEAVES = {
    "full": masks.FullMask((C, C)),
    "causal": masks.CausalMask((C, C)),
    "causal_offset": masks.CausalMask((C, C), offset=-13),
    "local": masks.LocalMask((C, C), window=(10, 3), offset=2),
    "local_open_left": masks.LocalMask((C, C), window=(None, 5)),
    "local_open_right": masks.LocalMask((C, C), window=(6, None), offset=-20),
    "chunked": masks.ChunkedCausalMask((C, C), 12),
    "prefix": masks.PrefixLMMask((C, C), 20),
    "numpy_random": _numpy_mask(C, C, seed=3),
    "numpy_eye": masks.NumpyMask(np.eye(C, dtype=bool)),
}
OPS = {"&": np.logical_and, "|": np.logical_or}
# (layout, shards, transpose, partial_mode): identity, permuted with and without shards
COMPOSITE_CONFIGS = [("none", 1, False, "auto"), ("zigzag", 4, True, "stored"), ("striped", 4, False, "function"),
                     ("random", 2, True, "auto"), ("contiguous", 2, False, "stored")]


def check_composite(mask, want_dense):
    """``mask`` builds under every COMPOSITE_CONFIGS entry and round-trips to ``want_dense``."""
    np.testing.assert_array_equal(masks.dense(mask), want_dense)  # the lazy definition itself
    for layout, shards, transpose, mode in COMPOSITE_CONFIGS:
        pos = positions(layout, C, shards)
        info = build_mask_info(mask, (8, 8), q_shards=shards, kv_shards=shards, q_positions=pos,
                               kv_positions=pos, transpose=transpose, partial_mode=mode)
        check_info(info, mask, pos, pos, mode)


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("right", list(LEAVES))
@pytest.mark.parametrize("left", list(LEAVES))
def test_every_pairing_round_trips(left, right, op):
    a, b = LEAVES[left], LEAVES[right]
    mask = a & b if op == "&" else a | b
    check_composite(mask, OPS[op](a[:, :], b[:, :])[None])


def _nested():
    L = LEAVES
    return {
        "(causal&numpy)|local": ((L["causal"] & L["numpy_random"]) | L["local"],
                                 lambda d: (d["causal"] & d["numpy_random"]) | d["local"]),
        "numpy|(chunked&prefix)": (L["numpy_eye"] | (L["chunked"] & L["prefix"]),
                                   lambda d: d["numpy_eye"] | (d["chunked"] & d["prefix"])),
        "(numpy&numpy)|full": ((L["numpy_random"] & L["numpy_eye"]) | L["full"],
                               lambda d: (d["numpy_random"] & d["numpy_eye"]) | d["full"]),
        "local_open&(numpy|causal_offset)": (L["local_open_right"] & (L["numpy_random"] | L["causal_offset"]),
                                             lambda d: d["local_open_right"] & (d["numpy_random"] | d["causal_offset"])),
        "(numpy|numpy)&(causal|prefix)": ((L["numpy_eye"] | L["numpy_random"]) & (L["causal"] | L["prefix"]),
                                          lambda d: (d["numpy_eye"] | d["numpy_random"]) & (d["causal"] | d["prefix"])),
    }


@pytest.mark.parametrize("name", list(_nested()))
def test_nested_compositions_round_trip(name):
    mask, expr = _nested()[name]
    check_composite(mask, expr({k: m[:, :] for k, m in LEAVES.items()})[None])


def test_multihead_of_numpy_composites_round_trips():
    L = LEAVES
    heads = [L["local"] | L["numpy_eye"], L["causal"] & L["numpy_random"], L["numpy_eye"] | L["numpy_eye"],
             L["local"] | masks.NumpyMask(np.eye(C, dtype=bool)), L["causal"]]
    mask = masks.MultiHeadMask(heads)
    check_composite(mask, np.stack([h[:, :] for h in heads]))
    info = build_mask_info(mask, (8, 8))
    # heads 0 and 3 are equal (the NumpyMask compares by content) and share one list
    assert info.num_lists == 4 and info.head_to_list[0] == info.head_to_list[3]


def test_numpy_composites_always_store_partial_blocks():
    """No in-kernel mask_function exists for a numpy part: every partial block is materialised."""
    mask = LEAVES["local"] | LEAVES["numpy_eye"]
    assert not mask.has_mask_function
    pos = layouts.permutation("zigzag", C, 4)
    for mode in mask_info_lib.PARTIAL_MODES:
        info = build_mask_info(mask, (8, 8), q_shards=4, kv_shards=4, q_positions=pos, kv_positions=pos,
                               partial_mode=mode)
        assert not info.uses_mask_function and int(np.sum(info.kind == PARTIAL)) > 0
        assert np.all(info.partial_index[info.kind == PARTIAL] >= 0)


def test_structured_part_bounds_the_work_of_a_numpy_composite(monkeypatch):
    """Only the band's blocks are candidates and materialised, though the numpy part is dense."""
    n, blk, window = 2048, 32, 40
    band = masks.LocalMask((n, n), window=(window, 0))
    mask = band & masks.NumpyMask(np.random.default_rng(0).random((n, n)) < 0.5)
    materialised = []
    original = masks.LogicalAnd.evaluate

    def counting(self, xp, q_pos, kv_pos):
        materialised.append(1)
        return original(self, xp, q_pos, kv_pos)

    monkeypatch.setattr(masks.LogicalAnd, "evaluate", counting)
    info = build_mask_info(mask, (blk, blk), partial_mode="stored")
    band_blocks = int(np.count_nonzero(build_mask_info(band, (blk, blk)).kind))  # 2 or 3 per block row
    assert len(materialised) <= band_blocks < 3 * n // blk
    assert int(np.count_nonzero(info.kind)) <= band_blocks
    np.testing.assert_array_equal(info.to_dense(), masks.dense(mask)[0])


def test_or_of_disjoint_bands_lists_no_empty_gap():
    """Regression: the union's candidate interval spans the gap between two bands; the gap's
    blocks classify EMPTY and must not stay in the work list as kind-0 steps."""
    mask = masks.LocalMask((C, C), (2, 0)) | masks.LocalMask((C, C), (2, 0), offset=-40)
    for transpose in (False, True):
        info = build_mask_info(mask, (8, 8), transpose=transpose)
        check_info(info, mask)
        assert int(info.num_active[0, 0, 0]) == info.kind.shape[-1]  # no kind-0 step at all


@pytest.mark.slow
@settings(max_examples=150)
@given(data=st.data())
def test_random_compositions_round_trip(data):
    """Random ``&`` / ``|`` trees of every mask type on random blockings, layouts and shards."""
    shards = data.draw(st.sampled_from([1, 2, 4]), label="shards")
    bq, bkv = data.draw(st.sampled_from([1, 2, 4]), label="bq"), data.draw(st.sampled_from([1, 2, 4]), label="bkv")
    q_len = shards * bq * data.draw(st.integers(1, 4), label="q blocks per shard")
    kv_len = shards * bkv * data.draw(st.integers(1, 4), label="kv blocks per shard")
    mask, expected = data.draw(any_masks((q_len, kv_len), depth=3), label="mask")
    layout = data.draw(st.sampled_from(["none", "striped", "zigzag", "random"]), label="layout")
    if layout == "zigzag":  # 2N chunks must tile both lengths
        assume(q_len % (2 * shards) == 0 and kv_len % (2 * shards) == 0)
    q_pos, kv_pos = positions(layout, q_len, shards), positions(layout, kv_len, shards)
    transpose = data.draw(st.booleans(), label="transpose")
    mode = data.draw(st.sampled_from(mask_info_lib.PARTIAL_MODES), label="partial_mode")
    np.testing.assert_array_equal(mask[:, :], expected)
    info = build_mask_info(mask, (bq, bkv), q_shards=shards, kv_shards=shards, q_positions=q_pos,
                           kv_positions=kv_pos, transpose=transpose, partial_mode=mode)
    check_info(info, mask, q_pos, kv_pos, mode)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["local|eye", "causal&random"])
def test_splash_on_numpy_composites_matches_reference(key, name):
    n = 256  # 2 x 2 blocks of 128 (the smallest block the config allows)
    mask = {
        "local|eye": masks.LocalMask((n, n), window=(16, 0)) | masks.NumpyMask(np.eye(n, dtype=bool)[::-1]),
        "causal&random": masks.CausalMask((n, n)) & masks.NumpyMask(np.random.default_rng(1).random((n, n)) < 0.4),
    }[name]
    q, k, v, d_out, _ = inputs(key, 2, 1, n, n, d=32)
    config = rs.SplashConfig(block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128,
                              backend="xla")

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * d_out)

    def splash(q, k, v):
        return rs.splash_attention(q, k, v, mask, config=config)

    def ref(q, k, v):
        return rs.reference_attention(q, k, v, mask)

    out, want = splash(q, k, v), ref(q, k, v)
    grads = jax.grad(loss(splash), argnums=(0, 1, 2))(q, k, v)
    grads_want = jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)
    errs = [max_err(out, want)] + [max_err(g, w) for g, w in zip(grads, grads_want)]
    assert errs[0] < 2e-6, errs  # measured <= 2.7e-7; ~7x headroom
    assert max(errs[1:]) < 1e-5, errs  # measured <= 1.9e-6 (dk, dv); ~5x headroom


# ----------------------------------------------------------------------------------------
# cost: million-token masks are cheap and never densified

M = 1 << 20
STRUCTURED_1M = [
    ("causal", masks.CausalMask((M, M)), 1, "contiguous"),
    ("local", masks.LocalMask((M, M), window=(4096, 0)), 1, "contiguous"),
    ("chunked", masks.ChunkedCausalMask((M, M), 8192), 1, "contiguous"),
    ("prefix", masks.PrefixLMMask((M, M), M // 4), 1, "contiguous"),
    ("causal&local", masks.CausalMask((M, M)) & masks.LocalMask((M, M), window=(4096, 0)), 1, "contiguous"),
    ("causal_zigzag8", masks.CausalMask((M, M)), 8, "zigzag"),
]


@pytest.mark.parametrize("name, mask, shards, layout", STRUCTURED_1M, ids=[r[0] for r in STRUCTURED_1M])
def test_mask_info_1m_is_cheap_and_never_dense(monkeypatch, name, mask, shards, layout):
    def no_dense(self, idx):
        raise AssertionError("build_mask_info densified a structured mask")

    monkeypatch.setattr(masks.Mask, "__getitem__", no_dense)
    evaluated = []
    original = type(mask).evaluate

    def counting(self, xp, q_pos, kv_pos):
        out = original(self, xp, q_pos, kv_pos)
        evaluated.append(int(np.size(out)))
        return out

    monkeypatch.setattr(type(mask), "evaluate", counting)
    pos = layouts.permutation(layout, M, shards)
    for mode in ("auto", "function"):
        build_mask_info.cache_clear()
        evaluated.clear()
        tracemalloc.start()
        t0 = time.process_time()  # CPU time: a loaded machine does not inflate it
        info = build_mask_info(mask, (512, 512), q_shards=shards, kv_shards=shards,
                               q_positions=pos, kv_positions=pos, partial_mode=mode)
        seconds = time.process_time() - t0
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert seconds < 2.0, f"{name}: {seconds:.2f} s CPU"  # measured <= 0.4 s (tracemalloc on); 5x headroom
        assert peak < 512 * 2**20, f"{name}: peak traced allocation {peak / 2**20:.0f} MiB"
        # only single blocks are materialised, one per distinct content key
        assert all(n <= 512 * 512 for n in evaluated)
        n_unique = info.partial_mask_blocks.shape[0]
        if mode == "auto":
            assert n_unique <= mask_info_lib.MAX_STORED_PARTIAL_BLOCKS
            assert len(evaluated) <= n_unique + 4, f"{name}: {len(evaluated)} blocks evaluated, {n_unique} unique"
        elif mask.classification_exact != "never":
            assert evaluated == [] and n_unique == 0  # exact classification: nothing to materialise
        assert int(info.num_active.sum()) > 0


def test_a_build_that_cannot_fit_is_refused_before_it_starts():
    """A 2^31-token causal mask needs ~8.8e12 blocks: refused up front with the estimate (it used
    to grow until the OOM killer ended the process)."""
    import time

    t0 = time.perf_counter()
    with pytest.raises(MemoryError, match=r"block_shape=\(512, 512\) would need about [\d,.]+ GiB.*8,796,\d{3},\d{3},\d{3} "
                                          r"non-empty blocks.*use larger blocks"):
        build_mask_info(masks.CausalMask((2**31, 2**31)), (512, 512))
    assert time.perf_counter() - t0 < 60  # O(blocks per side): seconds, not an S x S walk


@pytest.mark.parametrize("kind", ["causal", "local", "zigzag_causal"])
def test_build_size_estimate_bounds_the_measured_peak(kind):
    """The estimate is an upper bound on what the build allocates, and not a loose one."""
    import tracemalloc

    s = 1 << 18
    mask = masks.LocalMask((s, s), window=(4096, 0)) if kind == "local" else masks.CausalMask((s, s))
    perm = layouts.permutation("zigzag", s, 4) if kind.startswith("zigzag") else None
    estimate = mask_info_lib.estimate_build_bytes(mask, (512, 512), perm, perm)
    build_mask_info.cache_clear()
    tracemalloc.start()
    build_mask_info(mask, (512, 512), q_shards=4 if perm is not None else 1, kv_shards=4 if perm is not None else 1,
                    q_positions=perm, kv_positions=perm)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    build_mask_info.cache_clear()
    print(f"{kind}: peak {peak / 2**20:.1f} MiB, estimate {estimate / 2**20:.1f} MiB")
    assert peak <= estimate <= 8 * peak
