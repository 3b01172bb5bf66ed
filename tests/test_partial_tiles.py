"""Partial tiles of banded masks: the band compare, the host's column check and the masked-values
contract on the paths they choose (``splash/partial_tiles.py``, ``_kernel_common.band_tile`` /
``attended_only``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import ringsplash as rs
from ringsplash import layouts, masks
from ringsplash.blocksparse.mask_info import build_mask_info
from ringsplash.masks.base import PARTIAL
from ringsplash.splash.partial_tiles import partial_column_check, partial_mode
from ringsplash.splash.tile_masks import band_of, band_tile
from support.attention_inputs import inputs, max_err

S = 256
BANDED = {
    "causal": masks.CausalMask((S, S)),
    "causal_offset": masks.CausalMask((S, S), offset=-40),  # the last 40 keys attended by nobody
    "local": masks.LocalMask((S, S), window=(50, 0)),
    "local_both": masks.LocalMask((S, S), window=(30, 20), offset=7),
    "right_only": masks.LocalMask((S, S), window=(None, 3)),
    "and": masks.CausalMask((S, S)) & masks.LocalMask((S, S), window=(70, None)),
    "window_wider_than_the_sequence": masks.LocalMask((S, S), window=(S, 0)),  # causal
}


@pytest.mark.parametrize("name", list(BANDED))
def test_band_tile_equals_the_mask_for_any_positions(name):
    """Both tile orientations, random (unsorted, repeated) positions: the band compare is the mask."""
    mask, rng = BANDED[name], np.random.default_rng(0)
    band = band_of(mask)
    assert band is not None and band != (None, None)
    col = rng.integers(0, S, 16).astype(np.int32)  # lane-replicated column side
    row = rng.integers(0, S, 256).astype(np.int32)
    wide = jnp.broadcast_to(jnp.asarray(col)[:, None], (16, 128))
    got = band_tile(band, wide, jnp.asarray(row)[None, :], transposed=False)
    np.testing.assert_array_equal(np.asarray(got), mask.evaluate(np, col[:, None], row[None, :]))
    got_t = band_tile(band, wide, jnp.asarray(row)[None, :], transposed=True)  # column = kv, row = q
    np.testing.assert_array_equal(np.asarray(got_t), mask.evaluate(np, row[None, :], col[:, None]))


def test_band_drops_a_side_no_position_pair_reaches():
    """q - kv lies in [1 - kv_len, q_len - 1]: a bound outside it never binds and costs a compare per score."""
    assert band_of(masks.LocalMask((S, S), window=(S - 1, 0))) == (0, None)
    assert band_of(masks.LocalMask((S, S), window=(S - 2, 0))) == (0, S - 2)  # binds at q - kv = S - 1
    assert band_of(masks.LocalMask((S, S), window=(5, S - 1))) == (None, 5)
    assert band_of(masks.LocalMask((S, 2 * S), window=(0, 2 * S - 1))) == (None, 0)  # kv_len bounds lo
    assert band_of(masks.LocalMask((S, 2 * S), window=(0, 2 * S - 2))) == (2 - 2 * S, 0)
    assert band_of(masks.LocalMask((S, S), window=(S, S))) == (-S, S)  # both free: kept, a band still


def test_only_banded_masks_have_a_band():
    assert band_of(masks.ChunkedCausalMask((S, S), chunk_size=64)) is None
    assert band_of(masks.CausalMask((S, S)) | masks.LocalMask((S, S), window=(5, 5))) is None
    assert band_of(masks.FullMask((S, S))) is None
    assert band_of(masks.CausalMask((1 << 30, 1 << 30))) is None  # int32 differences could overflow
    assert partial_mode(masks.LocalMask((S, S), window=(8, 0)), "mosaic_tpu") == "function"
    assert partial_mode(masks.MultiHeadMask([masks.CausalMask((S, S)), masks.FullMask((S, S))]),
                        "interpret") == "auto"
    assert partial_mode(masks.CausalMask((S, S)), "xla") == "auto"


def _attended_columns(info, mask):
    """Per PARTIAL entry: the block's kv columns that some query of the block attends (brute force)."""
    bq, bkv = info.block_shape
    dense = mask.evaluate(np, info.q_positions[:, None], info.kv_positions[None, :])
    out = []
    for lst, a, b, t in zip(*np.nonzero(info.kind == PARTIAL)):
        qb = a * info.q_blocks_per_shard + info.q_block[lst, a, b, t]
        kb = b * info.kv_blocks_per_shard + info.kv_block[lst, a, b, t]
        tile = dense[qb * bq:(qb + 1) * bq, kb * bkv:(kb + 1) * bkv]
        out.append((info.q_positions[qb * bq:(qb + 1) * bq], info.kv_positions[kb * bkv:(kb + 1) * bkv],
                    tile.any(axis=0)))
    return out


@pytest.mark.parametrize("name", list(BANDED))
@pytest.mark.parametrize("blocks", [(64, 64), (32, 128), (128, 32)])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("transpose", [False, True])
def test_column_check_is_exact(name, blocks, layout, transpose):
    """"none" only when every partial tile attends every kv column; ("band", lo, hi) keeps exactly
    the attended columns; q blocks of scattered positions fall back to the scores."""
    mask = BANDED[name]
    perm = None if layout == "contiguous" else layouts.permutation("zigzag", S, 4)
    info = build_mask_info(mask, blocks, q_positions=perm, kv_positions=perm, partial_mode="function",
                           transpose=transpose)
    check = partial_column_check(info)
    tiles = _attended_columns(info, mask)
    if layout == "zigzag" and blocks[0] > S // 8:  # a q block spans two zigzag chunks
        assert check == "scores"
    if check == "none":
        assert all(attended.all() for *_, attended in tiles)
    elif check != "scores":
        _, lo, hi = check
        for q_pos, kv_pos, attended in tiles:
            keep = np.ones(kv_pos.shape, bool)
            keep &= True if lo is None else kv_pos <= q_pos[-1] - lo
            keep &= True if hi is None else kv_pos >= q_pos[0] - hi
            np.testing.assert_array_equal(keep, attended)
    if name == "causal_offset" and layout == "contiguous":
        assert check[0] == "band"  # tiles with unattended columns exist: the check must not be "none"
    if name == "causal" and layout == "contiguous" and blocks[0] >= blocks[1]:
        assert check == "none"


def test_stored_blocks_and_unbanded_masks_read_the_scores():
    info = build_mask_info(masks.CausalMask((S, S)), (64, 64), partial_mode="stored")
    assert partial_column_check(info) == "scores"
    info = build_mask_info(masks.ChunkedCausalMask((S, S), chunk_size=48), (64, 64), partial_mode="function")
    assert partial_column_check(info) == "scores"
    info = build_mask_info(masks.FullMask((S, S)), (64, 64), partial_mode="function")
    assert partial_column_check(info) == "none"  # no partial tile
    # a multi-host ring's MaskInfo holds some q shards' lists (or none): never "none" from a subset
    for rows in ((), (1,)):
        info = build_mask_info(BANDED["causal_offset"], (32, 32), q_shards=4, kv_shards=4, q_shard_rows=rows,
                               partial_mode="function")
        assert partial_column_check(info) == "scores"


N = 512  # the kernels' blocks are multiples of 128
LEAKY = {  # banded masks with keys no query attends, inside partial tiles
    "causal_offset": masks.CausalMask((N, N), offset=-40),  # the last 40 keys
    "window_both": masks.LocalMask((N, N), window=(30, 20), offset=-40),  # the last 20 keys
    "hi_only": masks.LocalMask((N, N), window=(5, None), offset=40),  # the first 35 keys
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LEAKY))
def test_non_finite_values_at_unattended_positions_never_leak_banded(key, name):
    """The masked-values contract on the band check's path: K / V of keys that no query attends are
    NaN / +-Inf; outputs, lse and gradients equal the reference on clean inputs, with dk = dv = 0
    there. Without the check's zeroing (``attended_only`` returning k, v) they turn NaN."""
    mask = LEAKY[name]
    unattended = ~mask.evaluate(np, np.arange(N)[:, None], np.arange(N)[None, :]).any(axis=0)
    assert unattended.any()
    config = rs.SplashConfig(block_q=128, block_kv=256, block_kv_compute=128, block_q_dkv=128, block_kv_dkv=256,
                             backend="interpret", interpret_params=pltpu.InterpretParams(uninitialized_memory="nan"))
    for transpose, blocks in ((False, (128, 256)), (True, (128, 256))):
        info = build_mask_info(mask, blocks, partial_mode=partial_mode(mask, "interpret"), transpose=transpose)
        assert partial_column_check(info)[0] == "band"
    q, k, v, d_out, _ = inputs(key, 2, 2, N, N, 64)
    bad = jnp.asarray(unattended)[None, :, None]
    poison = jnp.asarray(np.resize([np.nan, np.inf, -np.inf], (2, N, 64)), jnp.float32)

    def run(fn, k, v):
        def loss(q, k, v):
            res = fn(q, k, v, mask, with_lse=True)
            return jnp.sum(res.out * d_out) + jnp.sum(jnp.where(res.lse > -1e29, res.lse, 0.0)), res

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    (dq, dk, dv), got = run(lambda *a, **kw: rs.splash_attention(*a, config=config, **kw),
                            jnp.where(bad, poison, k), jnp.where(bad, poison[:, ::-1], v))
    (rdq, rdk, rdv), want = run(rs.reference_attention, k, v)
    # measured <= 1e-6 (float32, interpret); 1e-5 = 10x headroom
    for label, a, b in [("out", got.out, want.out), ("lse", got.lse, want.lse), ("dq", dq, rdq), ("dk", dk, rdk),
                        ("dv", dv, rdv)]:
        assert bool(jnp.all(jnp.isfinite(a))), f"{label} has non-finite values"
        assert max_err(a, b) <= 1e-5, (label, max_err(a, b))
    assert bool(jnp.all(dk[:, unattended] == 0)) and bool(jnp.all(dv[:, unattended] == 0))


QUADRANT_MASKS = {  # banded masks whose partial tiles have row halves that attend none of a kv slice
    "causal": masks.CausalMask((N, N)),
    "window": masks.LocalMask((N, N), window=(256, 0)),  # the far-edge tile: rows 128-255 miss slice 0
    "window_both": masks.LocalMask((N, N), window=(100, 60), offset=-20),
    "causal_offset": masks.CausalMask((N, N), offset=-40),
}


@pytest.mark.parametrize("name", list(QUADRANT_MASKS))
@pytest.mark.slow
def test_skipping_empty_quadrants_is_exact(key, name):
    """Blocks [256, 256, 128]: the forward skips the (row half, kv slice) pairs of partial tiles that no query
    attends (``quadrant_band``). Outputs, lse and max logits equal the reference, and equal the run that computes
    every tile whole (``skip_empty_quadrants=False``) up to the rounding of half-height matmuls (skipping an
    all-masked pair changes nothing). The host's decision is checked too: some pair of this mask is empty by
    brute force."""
    from ringsplash.splash.partial_tiles import quadrant_band

    mask = QUADRANT_MASKS[name]
    info = build_mask_info(mask, (256, 256), partial_mode="function")
    assert quadrant_band(info) == band_of(mask)
    dense = mask.evaluate(np, np.arange(N)[:, None], np.arange(N)[None, :])
    empty_pairs = 0
    for a, b, t in zip(*np.nonzero(info.kind[0] == PARTIAL)):
        qb, kb = int(info.q_block[0, a, b, t]), int(info.kv_block[0, a, b, t])
        tile = dense[qb * 256:(qb + 1) * 256, kb * 256:(kb + 1) * 256]
        empty_pairs += sum(not tile[r:r + 128, c:c + 128].any() for r in (0, 128) for c in (0, 128))
    assert empty_pairs > 0
    q, k, v, d_out, _ = inputs(key, 2, 2, N, N, 128)
    base = dict(block_q=256, block_kv=256, block_kv_compute=128, block_q_dkv=256, block_kv_dkv=256,
                backend="interpret")

    def run(fn):
        def loss(q, k, v):
            res = fn(q, k, v, mask, with_lse=True, with_max_logits=True)
            return jnp.sum(res.out * d_out), res

        (dq, dk, dv), res = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return {"out": res.out, "lse": res.lse, "max_logits": res.max_logits, "dq": dq, "dk": dk, "dv": dv}

    got, whole = (run(lambda *a, skip=skip, **kw: rs.splash_attention(
        *a, config=rs.SplashConfig(**base, skip_empty_quadrants=skip), **kw)) for skip in (True, False))
    want = run(rs.reference_attention)
    for label in got:
        # part-height matmuls may round differently on the CPU: measured <= 1.8e-7 relative (out, lse); the
        # gradients' sums of sub-tiles <= ...; 2e-6 = 10x headroom
        np.testing.assert_allclose(np.asarray(got[label]), np.asarray(whole[label]), rtol=2e-6, atol=2e-6,
                                   err_msg=label)
        # measured <= 1e-6 (float32, interpret); 1e-5 = 10x headroom
        assert max_err(got[label], want[label]) <= 1e-5, (label, max_err(got[label], want[label]))


def test_quadrant_band_only_for_one_band_over_the_identity_layout():
    from ringsplash.splash.partial_tiles import quadrant_band

    causal = masks.CausalMask((S, S))
    assert quadrant_band(build_mask_info(causal, (64, 64), partial_mode="function")) == (0, None)
    assert quadrant_band(build_mask_info(causal, (64, 64), partial_mode="stored")) is None
    assert quadrant_band(build_mask_info(causal, (64, 64), partial_mode="function", transpose=True)) == (0, None)
    perm = layouts.permutation("zigzag", S, 4)
    assert quadrant_band(build_mask_info(causal, (32, 32), q_positions=perm, kv_positions=perm,
                                         partial_mode="function")) is None
    assert quadrant_band(build_mask_info(causal, (32, 32), q_shards=4, kv_shards=4, partial_mode="function")) is None
    two = masks.MultiHeadMask([causal, masks.LocalMask((S, S), window=(40, 0))])
    assert quadrant_band(build_mask_info(two, (64, 64), partial_mode="function")) is None
    assert quadrant_band(build_mask_info(masks.FullMask((S, S)), (64, 64), partial_mode="function")) is None
