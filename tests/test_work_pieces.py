"""Work lists beyond the SMEM budget (``splash/work_pieces.py``) and per-device ring schedules.

A deliberately tiny ``SplashConfig.smem_budget_bytes`` makes lists split at small S. Split
runs must equal the unsplit ones (the Pallas kernels: bit for bit, each output block sees the
same steps in the same order; the xla backend to float32 rounding: XLA fuses the sliced
programs differently and the fused backward sums dK / dV over pieces) and the reference,
forward and gradients, single device and ring.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType

import ringsplash as rs
from ringsplash import layouts, masks
from ringsplash.masks import EMPTY
from ringsplash.parallel.ring import ring_attention_sharded
from ringsplash.splash import work_pieces
from ringsplash.splash.config import SplashConfig
from support.attention_inputs import inputs, max_err

B128 = dict(block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128)
# vs the float32 reference at S <= 512: measured out <= 9.6e-7, grads <= 4.8e-6 (both backends)
OUT_TOL, GRAD_TOL = 1e-5, 5e-5  # ~10x headroom
# xla backend, split vs unsplit: the programs differ (sliced shapes fuse differently, dK / dV
# are summed over pieces), so float32 rounding differs; measured <= 9.5e-7
SPLIT_TOL = 1e-5


def budget_for(steps: int, heads: int, lists: int = 1) -> int:
    """The budget holding exactly ``steps`` forward entries (``forward_max_steps``' formula)."""
    return 4 * heads + 8 * lists * steps


def make_mask(kind: str, s: int, heads: int):
    shape = (s, s)
    if kind == "causal":
        return masks.CausalMask(shape)
    if kind == "local":
        return masks.LocalMask(shape, window=(100, 20))
    if kind == "numpy":
        rng = np.random.default_rng(s)
        arr = np.tril(rng.random(shape) < 0.4)
        arr[: s // 4] = False  # rows attending nothing
        return masks.NumpyMask(arr)
    if kind == "multi_head":
        per = [masks.CausalMask(shape), masks.LocalMask(shape, window=(64, 0)), masks.FullMask(shape),
               masks.ChunkedCausalMask(shape, chunk_size=128)]
        return masks.MultiHeadMask(per[:heads])
    raise ValueError(kind)


# ----------------------------------------------------------------------------------------
# host split: pieces cover the list, fit the budget, and keep every needed entry in order


def _needed(q_block, kv_block, kind, partial, transpose):
    """The entries of one row a kernel needs (trailing padding dropped), as (major, minor, kind, partial)."""
    major, minor = (kv_block, q_block) if transpose else (q_block, kv_block)
    new_run = np.r_[True, major[1:] != major[:-1]]
    keep = (kind != EMPTY) | new_run
    return np.stack([major[keep], minor[keep], kind[keep], partial[keep]]).astype(np.int64)


@pytest.mark.slow
@settings(max_examples=6)
@given(kind=st.sampled_from(["causal", "local", "numpy", "multi_head"]), shards=st.sampled_from([1, 2, 4]),
       transpose=st.booleans(), layout=st.sampled_from(layouts.LAYOUTS), extra=st.integers(0, 6))
def test_split_pieces_cover_fit_and_keep_every_entry(kind, shards, transpose, layout, extra):
    s, block = 1024, 64
    mask = make_mask(kind, s, 4)
    perm = layouts.permutation(layout, s, shards)
    info = rs.build_mask_info(mask, (block, block), q_shards=shards, kv_shards=shards, q_positions=perm,
                              kv_positions=perm, transpose=transpose)
    n_minor = info.q_blocks_per_shard if transpose else info.kv_blocks_per_shard
    max_steps = n_minor + extra  # any major block's run fits; most lists need several pieces
    split = work_pieces.split_work_lists(info, max_steps)
    assert split.pieces[0].start == 0
    assert split.pieces[-1].stop == (info.kv_blocks_per_shard if transpose else info.q_blocks_per_shard)
    assert all(a.stop == b.start for a, b in zip(split.pieces, split.pieces[1:]))
    assert all(steps <= max_steps for steps in split.steps)
    if info.max_steps > max_steps:
        assert len(split.pieces) > 1
    for a in range(shards):
        for b in range(shards):
            pieces = work_pieces.pair_schedules(split.pieces, split.arrays, split.bounds, info.head_to_list, a, b,
                                                transpose=transpose)
            for lst in range(info.num_lists):
                want = _needed(*(x[lst, a, b] for x in (info.q_block, info.kv_block, info.kind, info.partial_index)),
                               transpose)
                got = []
                for piece, sched in zip(pieces.pieces, pieces.schedules):
                    e = _needed(*(np.asarray(x)[lst] for x in sched[:4]), transpose)
                    assert e[0].min() >= 0 and e[0].max() < piece.stop - piece.start
                    e[0] += piece.start
                    got.append(e)
                np.testing.assert_array_equal(np.concatenate(got, axis=1), want)


def test_split_within_budget_is_the_info_itself():
    info = rs.build_mask_info(masks.CausalMask((512, 512)), (128, 128))
    split = work_pieces.split_work_lists(info, info.max_steps)
    assert len(split.pieces) == 1 and split.arrays[0] is info.q_block
    assert work_pieces.split_work_lists(info, None).arrays[2] is info.kind


# ----------------------------------------------------------------------------------------
# budget: chip generation, override, bad input


def test_budget_from_chip_generation_and_override():
    tpu = SplashConfig(backend="mosaic_tpu")
    assert work_pieces.smem_bytes("TPU v5 lite") == 1 << 20  # pltpu's table: 1 MiB per core
    assert work_pieces.list_budget_bytes(tpu, "TPU v6 lite") == 3 << 18  # 3/4 of it
    assert work_pieces.list_budget_bytes(SplashConfig(backend="xla")) is None  # no SMEM
    assert work_pieces.list_budget_bytes(SplashConfig(backend="xla", smem_budget_bytes=999)) == 999


@pytest.mark.parametrize("bad", [0, -8, 1.5, "1MiB", True])
def test_budget_config_rejects_non_positive_ints(bad):
    # non-ints may already be refused by the shape-checked test run's type check (TypeError)
    with pytest.raises((ValueError, TypeError), match="smem_budget_bytes"):
        SplashConfig(smem_budget_bytes=bad)


def test_budget_below_one_step_is_a_clear_error(key):
    q, k, v, _, _ = inputs(key, 4, 2, 256, 256, d=32)
    config = SplashConfig(**B128, backend="xla", smem_budget_bytes=16)  # 4 heads x 4 bytes: no room for a step
    with pytest.raises(ValueError, match=r"smem_budget_bytes=16 cannot hold one step .* at least 24 bytes"):
        rs.splash_attention(q, k, v, masks.CausalMask((256, 256)), config=config)


def test_budget_below_one_block_run_is_a_clear_error(key):
    q, k, v, _, _ = inputs(key, 2, 2, 512, 512, d=32)
    config = SplashConfig(**B128, backend="xla", smem_budget_bytes=budget_for(2, 2))
    with pytest.raises(ValueError, match=r"q block 2 alone has 3 work-list entries, more than the 2 steps"):
        rs.splash_attention(q, k, v, masks.CausalMask((512, 512)), config=config)


# ----------------------------------------------------------------------------------------
# single device: split == unsplit == reference


def _single(q, k, v, d_out, mask, config, segment_ids=None):
    fn = lambda q, k, v: rs.splash_attention(q, k, v, mask, config=config, segment_ids=segment_ids)
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(d_out))


def _reference(q, k, v, d_out, mask, segment_ids=None):
    fn = lambda q, k, v: rs.reference_attention(q, k, v, mask, segment_ids=segment_ids)

    @jax.jit  # one program (eager, each op of the oracle compiles on its own)
    def run(q, k, v, d_out):
        out, vjp = jax.vjp(fn, q, k, v)
        return (out, *vjp(d_out))

    return run(q, k, v, d_out)


def _assert_split_matches(split, whole, want, *, exact):
    for name, a, b, w in zip(("out", "dq", "dk", "dv"), split, whole, want):
        if exact:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
        else:
            assert max_err(a, b) <= SPLIT_TOL, name
        assert max_err(a, w) <= (OUT_TOL if name == "out" else GRAD_TOL), name


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["causal", "multi_head"])
def test_single_device_xla_tiny_budget_equals_unsplit_and_reference(key, kind):
    s, heads, kv_heads = 384, 4, 2
    q, k, v, d_out, _ = inputs(key, heads, kv_heads, s, s, d=32)
    mask = make_mask(kind, s, heads)
    whole = SplashConfig(**B128, backend="xla")
    lists = len(rs.build_mask_info(mask, (128, 128)).masks)
    split = dataclasses.replace(whole, smem_budget_bytes=budget_for(5, heads, lists))
    seg = rs.SegmentIds(q=jnp.arange(s) // 200, kv=jnp.arange(s) // 200) if kind == "causal" else None
    f = jax.jit(_single, static_argnums=(4, 5))
    got, base = f(q, k, v, d_out, mask, split, seg), f(q, k, v, d_out, mask, whole, seg)
    _assert_split_matches(got, base, _reference(q, k, v, d_out, mask, seg), exact=False)


@pytest.mark.slow
@pytest.mark.xla_optimized
def test_single_device_interpret_tiny_budget_equals_unsplit_and_reference(key):
    """GQA, causal: forward, dq and dK/dV kernels each run in several pieces (bit-exact). The
    interpreter runs the kernel bodies as XLA:CPU programs: at the suite's -O0 the split and whole
    programs' exp2 / log2 codegen differed (lse by 2 ulps in one q block, then dq); with the
    optimisations users compile with they agree bit for bit."""
    s, heads, kv_heads = 384, 2, 1
    q, k, v, d_out, _ = inputs(key, heads, kv_heads, s, s, d=32)
    mask = masks.CausalMask((s, s))
    whole = SplashConfig(**B128, backend="interpret")
    split = dataclasses.replace(whole, smem_budget_bytes=budget_for(5, heads))  # q blocks [0, 2), [2, 3)
    info_t = rs.build_mask_info(mask, (128, 128), transpose=True)
    assert len(work_pieces.split_work_lists(info_t, work_pieces.dkv_max_steps(  # kv blocks [0, 1), [1, 3)
        split.smem_budget_bytes, info_t, heads, kv_heads)).pieces) > 1
    f = jax.jit(_single, static_argnums=(4, 5))
    got, base = f(q, k, v, d_out, mask, split), f(q, k, v, d_out, mask, whole)
    _assert_split_matches(got, base, _reference(q, k, v, d_out, mask), exact=True)


# ----------------------------------------------------------------------------------------
# ring: tiny budget, per-device schedules


def _mesh(n):
    return jax.make_mesh((n,), ("ctx",), devices=jax.devices()[:n], axis_types=(AxisType.Auto,))


def _ring(q, k, v, d_out, mask, mesh, layout, config, schedule=None):
    n = mesh.shape["ctx"]
    lay = lambda x: layouts.permute(x, layout, n, axis=1)
    unlay = lambda x: layouts.unpermute(x, layout, n, axis=1)

    def run(q, k, v, d_out, schedule):
        fn = lambda q, k, v: ring_attention_sharded(q, k, v, mask, mesh=mesh, axis_name="ctx", layout=layout,
                                                    config=config, schedule=schedule)
        out, vjp = jax.vjp(fn, lay(q), lay(k), lay(v))
        return tuple(unlay(x) for x in (out, *vjp(lay(d_out))))

    return jax.jit(run)(q, k, v, d_out, schedule)


@pytest.mark.slow
@pytest.mark.parametrize("n, layout", [(2, "zigzag"), (4, "contiguous"), (4, "striped"), (8, "zigzag")])
def test_ring_xla_tiny_budget_equals_unsplit_and_reference(key, n, layout):
    s, heads, kv_heads = 256 * n, 2, 1  # two 128-blocks per shard
    q, k, v, d_out, _ = inputs(key, heads, kv_heads, s, s, d=32)
    mask = masks.CausalMask((s, s))
    whole = SplashConfig(**B128, backend="xla")
    plan = rs.parallel.ring_plan.ring_plan(mask, n, layout, whole)
    n_minor = plan.info.kv_blocks_per_shard
    split = dataclasses.replace(whole, smem_budget_bytes=budget_for(n_minor, heads))  # one q block row per piece
    mesh = _mesh(n)
    sched = rs.ring_schedule(mask, n, layout, split, heads=heads, kv_heads=kv_heads, mesh=mesh, axis_name="ctx")
    assert len(sched.fwd_pieces) > 1
    got = _ring(q, k, v, d_out, mask, mesh, layout, split, sched)
    base = _ring(q, k, v, d_out, mask, mesh, layout, whole)
    _assert_split_matches(got, base, _reference(q, k, v, d_out, mask), exact=False)


@pytest.mark.slow
def test_ring_interpret_tiny_budget_per_device_schedule(key):
    """N = 2, zigzag, GQA: every kernel in pieces, schedule rows sharded over the ring axis."""
    n, s, heads, kv_heads = 2, 512, 2, 1
    q, k, v, d_out, _ = inputs(key, heads, kv_heads, s, s, d=32)
    mask = masks.CausalMask((s, s))
    whole = SplashConfig(**B128, backend="interpret")
    split = dataclasses.replace(whole, smem_budget_bytes=budget_for(2, heads))
    mesh = _mesh(n)
    sched = rs.ring_schedule(mask, n, "zigzag", split, heads=heads, kv_heads=kv_heads, mesh=mesh, axis_name="ctx")
    assert len(sched.fwd_pieces) > 1 and len(sched.dkv_pieces) > 1
    got = _ring(q, k, v, d_out, mask, mesh, "zigzag", split, sched)
    base = _ring(q, k, v, d_out, mask, mesh, "zigzag", whole)
    _assert_split_matches(got, base, _reference(q, k, v, d_out, mask), exact=True)


def test_ring_schedule_is_sharded_per_device_and_rows_build_alone():
    n, s = 4, 2048
    mask = masks.CausalMask((s, s))
    config = SplashConfig(backend="mosaic_tpu")
    whole = rs.ring_schedule(mask, n, "zigzag", config, heads=8, kv_heads=8)
    sched = rs.ring_schedule(mask, n, "zigzag", config, heads=8, kv_heads=8, mesh=_mesh(n), axis_name="ctx")
    for w, g in zip(jax.tree.leaves(whole), jax.tree.leaves(sched)):
        assert g.shape == w.shape and w.shape[1] == n
        for shard in g.addressable_shards:  # each device holds its own q shard's row only
            row = shard.index[1].start
            assert shard.data.shape[1] == 1
            np.testing.assert_array_equal(np.asarray(shard.data), w[:, row:row + 1])
    assert sched.nbytes_per_device * n == sum(x.nbytes for x in jax.tree.leaves(whole))


def test_ring_schedule_of_a_process_builds_only_its_rows(monkeypatch):
    """On a multi-host slice (simulated: this process "addresses" ring devices 1 and 2 only) the
    schedule's global shapes and pieces come from list-less plans, its arrays from plans of those
    rows; both equal the whole schedule's (every process must compile the same program)."""
    from ringsplash.blocksparse import mask_info
    from ringsplash.parallel import ring_plan as plan_lib

    n, s, heads = 4, 4096, 2
    mask = masks.LocalMask((s, s), window=(700, 0))  # some shard pairs inactive
    config = SplashConfig(**B128, backend="mosaic_tpu", smem_budget_bytes=budget_for(12, heads))
    whole = rs.ring_schedule(mask, n, "zigzag", config, heads=heads, kv_heads=1)
    assert len(whole.fwd_pieces) > 1 and len(whole.dkv_pieces) > 1
    full_plan = plan_lib.ring_plan(mask, n, "zigzag", config)
    assert not full_plan.active.all()
    header = plan_lib.ring_plan(mask, n, "zigzag", config, q_shard_rows=())
    np.testing.assert_array_equal(header.active, full_plan.active)

    built, captured = [], {}
    real_build = mask_info._build
    monkeypatch.setattr(mask_info, "_build", lambda *a: built.append(a[8]) or real_build(*a))
    monkeypatch.setattr(plan_lib, "process_rows", lambda mesh, axis: (1, 2))
    monkeypatch.setattr(plan_lib, "schedule_arrays",
                        lambda build_rows, shapes, mesh, axis: captured.update(build_rows=build_rows, shapes=shapes) or shapes)
    rs.clear_caches()
    mesh = _mesh(n)
    rs.ring_schedule(mask, n, "zigzag", config, heads=heads, kv_heads=1, mesh=mesh, axis_name="ctx")
    shapes = rs.ring_schedule(mask, n, "zigzag", config, heads=heads, kv_heads=1, mesh=mesh, axis_name="ctx",
                              shapes_only=True)
    derived = plan_lib.ring_plan(mask, n, "zigzag", config, q_shard_rows=())  # what ring_attention uses
    assert built == [(1, 2), (1, 2)]  # one build per view, of these rows only: the list-less plan is derived
    np.testing.assert_array_equal(derived.active, full_plan.active)
    for got, want in ((derived.info, header.info), (derived.info_dkv, header.info_dkv)):
        for f in ("q_block", "kv_block", "kind", "partial_index", "num_active", "partial_mask_blocks", "major_counts",
                  "partial_sources"):
            assert getattr(got, f).dtype == getattr(want, f).dtype
            np.testing.assert_array_equal(getattr(got, f), getattr(want, f))
        assert got.q_shard_rows == want.q_shard_rows == ()
    assert (shapes.fwd_pieces, shapes.dkv_pieces) == (whole.fwd_pieces, whole.dkv_pieces)
    assert (captured["shapes"].fwd_pieces, captured["shapes"].dkv_pieces) == (whole.fwd_pieces, whole.dkv_pieces)
    for w, sh, sh2 in zip(*(jax.tree.leaves(x) for x in (whole, shapes, captured["shapes"])), strict=True):
        assert sh.shape == sh2.shape == w.shape and sh.dtype == sh2.dtype == w.dtype
    for want in ((2,), (1,), (1, 2)):
        got = captured["build_rows"](want)
        for w, g in zip(jax.tree.leaves(whole), jax.tree.leaves(got), strict=True):
            np.testing.assert_array_equal(g, w[:, list(want)])


def test_ring_schedule_bad_input(key):
    n, s = 2, 512
    mask = masks.CausalMask((s, s))
    q, k, v, _, _ = inputs(key, 2, 1, s, s, d=32)
    config = SplashConfig(**B128, backend="xla")
    with pytest.raises(TypeError, match="schedule"):  # (the shape-checked run's type check may answer first)
        ring_attention_sharded(q, k, v, mask, mesh=_mesh(n), axis_name="ctx", config=config, schedule=(1, 2))
    other = rs.ring_schedule(masks.CausalMask((2 * s, 2 * s)), n, "contiguous", config, heads=2, kv_heads=1)
    with pytest.raises(ValueError, match="schedule was built for another ring call"):
        ring_attention_sharded(q, k, v, mask, mesh=_mesh(n), axis_name="ctx", config=config, schedule=other)


# ----------------------------------------------------------------------------------------
# all-gather, Ulysses, USP on 8 devices: their local Splash calls (all-gather: local q vs all
# kv, q shard traced; Ulysses: the whole sequence for heads / N) and USP's inner ring split
# under the budget the same way; split == unsplit == reference

# name, (ulysses, ring) degrees, layout, S, heads, kv_heads, forward steps per kernel call
CP_CASES = [
    ("allgather", None, "zigzag", 2048, 2, 1, 16),  # 2 q x 16 kv blocks per device: 2 pieces
    ("ulysses", None, "zigzag", 512, 8, 2, 4),  # 1 head per device, 4 x 4 blocks (zigzag: 4 per row): 4 pieces
    ("usp", (4, 2), "zigzag", 512, 4, 1, 2),  # inner ring of 2, 2 q blocks per member: 2 pieces
]


def _cp_run(name, degrees, layout, mask, config):
    """``run(q, k, v, d_out) -> (out, dq, dk, dv)`` of a strategy on 8 devices, in original token order."""
    from support.strategies import strategy

    fn, shards = strategy(name, 8, layout, config, degrees)
    lay = lambda x: layouts.permute(x, layout, shards, axis=1)
    unlay = lambda x: layouts.unpermute(x, layout, shards, axis=1)

    def run(q, k, v, d_out):
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, None, None, mask, None), lay(q), lay(k), lay(v))
        return tuple(unlay(x) for x in (out, *vjp(lay(d_out))))

    return run


def _cp_info(name, degrees, layout, mask, s, config):
    """The forward MaskInfo of the strategy's local Splash call (USP: its inner ring's)."""
    if name == "allgather":
        perm = layouts.permutation(layout, s, 8)
        return rs.build_mask_info(mask, config.block_shape, q_shards=8, kv_shards=1, q_positions=perm,
                                  kv_positions=perm)
    if name == "ulysses":
        perm = layouts.permutation(layout, s, 8)
        return rs.build_mask_info(mask, config.block_shape, q_positions=perm, kv_positions=perm)
    return rs.parallel.ring_plan.ring_plan(mask, degrees[1], layout, config).info


# split vs unsplit on the xla backend: measured 0 (all-gather, Ulysses), <= 7.2e-7 (USP: its
# ring sums dK / dV over pieces); vs the reference <= 3.4e-7 out, 6.2e-6 grads: ~10x headroom
CP_SPLIT_TOL, CP_OUT_TOL, CP_GRAD_TOL = 7e-6, 3e-6, 6e-5


@pytest.mark.slow
@pytest.mark.parametrize("name, degrees, layout, s, heads, kv_heads, steps", CP_CASES)
def test_strategy_xla_tiny_budget_equals_unsplit_and_reference(key, name, degrees, layout, s, heads, kv_heads,
                                                                steps):
    q, k, v, d_out, _ = inputs(key, heads, kv_heads, s, s, d=32)
    mask = masks.CausalMask((s, s))
    whole = SplashConfig(**B128, backend="xla")
    local_heads = heads // (8 if name == "ulysses" else degrees[0] if name == "usp" else 1)
    split = dataclasses.replace(whole, smem_budget_bytes=budget_for(steps, local_heads))
    info = _cp_info(name, degrees, layout, mask, s, whole)
    assert len(work_pieces.split_work_lists(info, steps).pieces) > 1
    lowered_split, lowered_whole = (jax.jit(_cp_run(name, degrees, layout, mask, c)).lower(q, k, v, d_out)
                                    for c in (split, whole))
    # the strategy runs its kernels in pieces: more matmuls in its program than unsplit
    matmuls = lambda lowered: lowered.as_text().count("dot_general")
    assert matmuls(lowered_split) > matmuls(lowered_whole)
    got, base = lowered_split.compile()(q, k, v, d_out), lowered_whole.compile()(q, k, v, d_out)
    want = jax.jit(_reference, static_argnums=4)(q, k, v, d_out, mask)
    for what, a, b, w in zip(("out", "dq", "dk", "dv"), got, base, want):
        assert max_err(a, b) <= CP_SPLIT_TOL, f"{what}: split vs unsplit {max_err(a, b):.2e}"
        assert max_err(a, w) <= (CP_OUT_TOL if what == "out" else CP_GRAD_TOL), f"{what}: vs reference"
